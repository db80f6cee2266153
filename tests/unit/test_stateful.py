"""Stateful, model-based test of :class:`indexer.PrefixIndex`.

A hypothesis ``RuleBasedStateMachine`` drives one index with vLLM payloads (both
wire layouts, ``encode_batch`` versions "0.33" and "0.23") and, after every step,
checks every query answer against a deliberately simple reference model written
here from the contract (``shared/spec/indexer-contract.md``):

* residency: per ``(worker, tier, group)`` a ``Counter`` engine hash -> count
  (R-APP-4), plus for the non-GPU tiers the set of chunks (tuples of hashes)
  stored as whole events (R-APP-5); a chunk is known by its last hash (it goes
  when that block's count reaches 0) and counts while all its blocks are held;
* orphans: a store whose parent the worker does not hold (any tier, same group)
  waits, and is attached when the worker stores the parent (R-APP-3);
* ``AllBlocksCleared`` drops GPU and CPU, keeps STORAGE (R-APP-8); a restart
  (sequence going backwards with a newer ts, or ``reset_worker``) and
  ``drop_worker`` drop everything of that worker (R-STR-5, R-STR-6);
* queries: per group GPU run, CPU/STORAGE through whole chunks, ``total`` as the
  GPU -> CPU -> STORAGE chain, score with credits 1.0 / 0.75 / 0.25, headline =
  minimum over the default groups (R-Q-2, R-Q-3, R-APP-10);
* memory: node count = the blocks held by someone plus their ancestors (R-APP-9).

Choices where the contract leaves room (the index agrees with all of them today):
parents resolve through the storing worker's own hashes only (R-APP-3 allows also
other workers'); the orphan buffer survives ``AllBlocksCleared`` (it holds no
residency) but not a restart or a drop; the default groups are the groups the
model has seen a rich store for, ever (even one still waiting as an orphan).

World (small so shrinking works): 3 workers, tiers GPU/CPU/STORAGE, groups 0 and 1
(both full attention, block size 4), 4 prompts of up to 6 blocks sharing
prefixes. Engine hashes are a chained hash of the prompt prefix, identical on
every worker (shared seed), and identical in both groups.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import msgspec

from indexer import PrefixIndex
from indexer.wire.keys import tokens_to_bytes
from indexer.producer.events import Cleared, Removed, Stored, encode_batch

_ENC = msgspec.json.encode

BS = 4
WORKERS = (("e0", 0), ("e1", 0), ("e0", 1))
TIERS = ("GPU", "CPU", "STORAGE")
CHUNK_TIERS = ("CPU", "STORAGE")
GROUPS = (0, 1)
CREDITS = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
VERSIONS = ("0.33", "0.23")
MAX_DEPTH = 6

# The prompts, as block labels. A label's tokens are fixed, so prompts 0-2 share
# blocks (1, 2[, 3]) and prompt 3 repeats the *content* of blocks 1, 2 at another
# depth (other prefix, so other engine hash and another tree node).
LABELS = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 7, 8), (1, 2, 9, 10, 11, 12), (13, 1, 2, 14))


def _label_tokens(label: int) -> list[int]:
    return [label * 1000 + 7 * i + 1 for i in range(BS)]


def _engine_hash(prefix_tokens) -> int:
    """vLLM-like chained block hash: a 64-bit digest of the whole prefix."""
    d = hashlib.blake2b(repr(tuple(prefix_tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(d, "little")


def _timeless(res: dict) -> dict:
    """A match's dict without what the clock moves between two calls (the answers' ages)."""
    return {**res, "workers": [{k: v for k, v in w.items() if k != "last_event_age_s"} for w in res["workers"]]}


class _Prompt:
    def __init__(self, labels) -> None:
        self.tokens: list[int] = []
        self.hashes: list[int] = []
        for lab in labels:
            self.tokens += _label_tokens(lab)
            self.hashes.append(_engine_hash(self.tokens))


PROMPTS = [_Prompt(lbl) for lbl in LABELS]
PARENT: dict[int, int | None] = {}
for _p in PROMPTS:
    for _i, _h in enumerate(_p.hashes):
        PARENT[_h] = _p.hashes[_i - 1] if _i else None
UNIVERSE = sorted(PARENT)
UNKNOWN = (0xDEAD_BEEF_0000_0001, 2**64 - 1)  # never stored by anyone


def _layout(sizes) -> list[tuple[int, int]]:
    """Chunk boundaries by depth: consecutive chunks of ``sizes`` blocks from block 0."""
    out, s = [], 0
    for n in sizes:
        if s + n > MAX_DEPTH:
            break
        out.append((s, s + n))
        s += n
    return out


def _extend(pos: int, ivs) -> int:
    """From ``pos`` on through whole chunks that cover block ``pos`` onward (R-Q-2)."""
    while True:
        nxt = max((e for s, e in ivs if s <= pos < e), default=pos)
        if nxt == pos:
            return pos
        pos = nxt


class IndexMachine(RuleBasedStateMachine):
    """Drives a PrefixIndex and a reference model side by side.

    ``CHUNKING`` (how non-GPU stores are cut; chunks never overlap in any mode):
    "aligned" = one chunk size (1-3 blocks) per tier from block 0, like an
    OffloadingConnector; "per_group" = the same, but each group has its own size;
    "partition" = chunks of varying sizes within one tier (a fixed partition by
    depth). R-APP-5 allows all three: the blocks of one event form a chunk.
    """

    CHUNKING = "aligned"
    PREFIXES = True  # query every prefix of every prompt (False: whole prompts only)

    def __init__(self) -> None:
        super().__init__()
        self.idx = PrefixIndex(orphan_ttl_s=1e9)
        self.cnt: dict[tuple, Counter] = {}  # (w, tier, g) -> Counter hash -> count
        self.chunks: dict[tuple, set] = {}  # (w, tier, g) -> {tuple of hashes}
        self.pending: dict[tuple, list] = {w: [] for w in WORKERS}  # orphan stores
        self.known_groups: set[int] = set()
        self.known: dict[tuple, bool] = {w: False for w in WORKERS}  # index knows it
        self.last_seq: dict[tuple, int | None] = {w: None for w in WORKERS}
        self.next_seq: dict[tuple, int] = {w: 0 for w in WORKERS}
        self.last_batch: dict[tuple, tuple | None] = {w: None for w in WORKERS}
        self.history: list[tuple] = []  # applied store events: (w, tier, g, hashes, parent, tokens)
        self.ts = 1767225600.0
        self.layout: dict[tuple, list] = {}  # (tier, group) -> chunk intervals by depth
        self._fulls: dict | None = None  # per-invariant cache of _full()

    # ------------------------------------------------------------ reference

    def _held_any(self, w, g, h) -> bool:
        return any(self.cnt.get((w, t, g), {}).get(h, 0) > 0 for t in TIERS)

    def _attach(self, w, tier, g, hashes) -> None:
        c = self.cnt.setdefault((w, tier, g), Counter())
        for h in hashes:
            c[h] += 1
        if tier != "GPU":
            self.chunks.setdefault((w, tier, g), set()).add(tuple(hashes))

    def _model_store(self, w, tier, g, hashes, parent) -> None:
        self.known_groups.add(g)
        if parent is not None and not self._held_any(w, g, parent):
            self.pending[w].append((tier, g, tuple(hashes), parent))
            return
        self._attach(w, tier, g, hashes)
        # Adopt buffered children whose parent is now held (and theirs).
        changed = True
        while changed:
            changed = False
            for p in list(self.pending[w]):
                ptier, pg, phashes, pparent = p
                if self._held_any(w, pg, pparent):
                    self.pending[w].remove(p)
                    self._attach(w, ptier, pg, phashes)
                    changed = True

    def _model_remove(self, w, tier, g, hashes) -> None:
        c = self.cnt.get((w, tier, g))
        for h in hashes:
            if c is None or c.get(h, 0) <= 0:
                continue  # unknown or below zero: ignored (R-APP-4)
            c[h] -= 1
            if c[h] == 0:
                del c[h]
                if tier != "GPU":
                    # A chunk is known by its last hash (R-APP-5: "the connector looks
                    # chunks up by their last hash"): it goes when that block goes. A
                    # chunk that lost another block is kept but not whole until the
                    # block is held again.
                    self.chunks[(w, tier, g)] = {ch for ch in self.chunks[(w, tier, g)] if ch[-1] != h}

    def _model_drop_tiers(self, w, tiers) -> None:
        for (w2, t, g) in list(self.cnt):
            if w2 == w and t in tiers:
                del self.cnt[(w2, t, g)]
                self.chunks.pop((w2, t, g), None)

    def _model_drop_all(self, w) -> None:
        self._model_drop_tiers(w, TIERS)
        self.pending[w] = []

    def _intervals(self, w, tier, g, hs) -> list[tuple[int, int]]:
        """Whole resident chunks of (w, tier, g) that lie inside the query ``hs``."""
        pos = {h: i for i, h in enumerate(hs)}
        c = self.cnt.get((w, tier, g), {})
        out = []
        for ch in self.chunks.get((w, tier, g), ()):
            i = pos.get(ch[0])
            if i is None or tuple(hs[i : i + len(ch)]) != ch:
                continue
            if all(c.get(h, 0) > 0 for h in ch):
                out.append((i, i + len(ch)))
        return out

    def _full(self, w, g, hs):
        """GPU run and whole resident chunks of (w, g) along the whole prompt ``hs``."""
        c = self.cnt.get((w, "GPU", g), {})
        gpu = 0
        while gpu < len(hs) and c.get(hs[gpu], 0) > 0:
            gpu += 1
        return gpu, {t: self._intervals(w, t, g, hs) for t in CHUNK_TIERS}

    @staticmethod
    def group_figures(full, k):
        """(tiers alone, total, score) for the first ``k`` blocks, or None if nothing matches.

        ``full`` is :meth:`_full` of the whole prompt; a query of ``k`` blocks sees
        the GPU run up to ``k`` and only the chunks that end within it.
        """
        gpu_full, ivs_full = full
        gpu = min(gpu_full, k)
        ivs = {t: [iv for iv in v if iv[1] <= k] for t, v in ivs_full.items()}
        tiers = {"GPU": gpu}
        for t in CHUNK_TIERS:
            tiers[t] = _extend(0, ivs[t])  # the tier alone, whole chunks only (R-APP-5)
        pos = gpu
        score = gpu * CREDITS["GPU"]
        for t in CHUNK_TIERS:  # total: GPU, then CPU, then STORAGE (R-Q-2)
            nxt = _extend(pos, ivs[t])
            score += (nxt - pos) * CREDITS[t]
            pos = nxt
        if not any(tiers.values()):
            return None
        return tiers, pos, score

    def headline(self, figs: dict):
        """R-APP-10: each headline figure is the minimum over the default groups."""
        gs = sorted(self.known_groups)
        if not gs or any(figs.get(g) is None for g in gs):
            return {}, 0, 0.0
        tiers = {t: min(figs[g][0][t] for g in gs) for t in TIERS}
        total = min(figs[g][1] for g in gs)
        score = min(figs[g][2] for g in gs)
        return {t: n for t, n in tiers.items() if n}, total, score

    def expected(self, hs, k=None) -> dict:
        """The expected ``workers`` of a query of the first ``k`` blocks of prompt ``hs``."""
        k = len(hs) if k is None else k
        out = {}
        for w in WORKERS:
            fulls = self._fulls.get((w, tuple(hs))) if self._fulls is not None else None
            if fulls is None:
                fulls = {g: self._full(w, g, hs) for g in GROUPS}
                if self._fulls is not None:
                    self._fulls[(w, tuple(hs))] = fulls
            figs = {g: self.group_figures(fulls[g], k) for g in GROUPS}
            if all(f is None for f in figs.values()):
                continue  # matches nothing: absent (R-Q-2)
            groups = {}
            for g, f in figs.items():
                if f is not None:
                    d = {t: n for t, n in f[0].items() if n}
                    d["total_blocks"] = f[1]
                    groups[str(g)] = d
            tiers, total, score = self.headline(figs)
            out[w] = {
                "tiers": tiers,
                "groups": groups,
                "total_blocks": total,
                "total_tokens": total * BS,
                "score": score,
            }
        return out

    def expected_nodes(self, g) -> int:
        """R-APP-9: nodes = blocks someone holds in group g, plus their ancestors."""
        live = set()
        for (_w, _t, g2), c in self.cnt.items():
            if g2 != g:
                continue
            for h, n in c.items():
                while n > 0 and h is not None and h not in live:
                    live.add(h)
                    h = PARENT[h]
        return len(live)

    # ------------------------------------------------------------ driving

    def _send(self, w, events, version, *, seq=None, expect="applied") -> None:
        engine, rank = w
        if seq is None:
            seq = self.next_seq[w]
        self.ts += 1.0
        payload = encode_batch(events, ts=self.ts, dp_rank=rank, version=version)
        got = self.idx.apply(engine, payload, seq=seq)
        assert got == expect, (got, expect)
        self.known[w] = True
        self.last_seq[w] = seq
        self.next_seq[w] = seq + 1
        self.last_batch[w] = (payload, seq)

    @staticmethod
    def _stored(tier, g, hashes, parent, tokens, spelled) -> Stored:
        medium = tier.lower() if spelled else tier
        if tier == "GPU" and spelled:
            medium = None  # a missing medium means GPU
        return Stored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
            block_size=BS, medium=medium, group_idx=g, kv_cache_spec_kind="full_attention",
        )

    def _pick_blocks(self, tier, g, p, start, n):
        prompt = PROMPTS[p]
        ln = len(prompt.hashes)
        if tier == "GPU":
            start %= ln
            n = 1 + (n - 1) % (ln - start)
        else:
            ivs = [iv for iv in self.layout[(tier, g)] if iv[1] <= ln]
            start, end = ivs[start % len(ivs)]
            n = end - start
        hashes = prompt.hashes[start : start + n]
        parent = prompt.hashes[start - 1] if start else None
        tokens = prompt.tokens[start * BS : (start + n) * BS]
        return hashes, parent, tokens

    @initialize(sizes=st.lists(st.integers(1, 3), min_size=4 * MAX_DEPTH, max_size=4 * MAX_DEPTH))
    def chunking(self, sizes) -> None:
        for i, key in enumerate((t, g) for t in CHUNK_TIERS for g in GROUPS):
            mine = sizes[i * MAX_DEPTH : (i + 1) * MAX_DEPTH]
            if self.CHUNKING == "aligned":
                mine = [sizes[CHUNK_TIERS.index(key[0]) * MAX_DEPTH * len(GROUPS)]] * MAX_DEPTH
            elif self.CHUNKING == "per_group":
                mine = [mine[0]] * MAX_DEPTH
            self.layout[key] = _layout(mine)

    @rule(w=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS), g=st.sampled_from(GROUPS),
          p=st.integers(0, len(PROMPTS) - 1), start=st.integers(0, 5), n=st.integers(1, 6),
          version=st.sampled_from(VERSIONS), spelled=st.booleans())
    def store(self, w, tier, g, p, start, n, version, spelled) -> None:
        """R-APP-1/3/5: store blocks [start, start+n) of a prompt (child-first allowed)."""
        hashes, parent, tokens = self._pick_blocks(tier, g, p, start, n)
        self._send(w, [self._stored(tier, g, hashes, parent, tokens, spelled)], version)
        self._model_store(w, tier, g, hashes, parent)
        self.history.append((w, tier, g, tuple(hashes), parent, tuple(tokens)))

    @rule(w=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS), g=st.sampled_from(GROUPS),
          p=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, 6), version=st.sampled_from(VERSIONS))
    def store_next(self, w, tier, g, p, n, version) -> None:
        """Parent-first: extend the worker's GPU run (or a chunk chain) of a prompt."""
        prompt = PROMPTS[p]
        c = self.cnt.get((w, "GPU", g), {})
        d = 0
        while d < len(prompt.hashes) and c.get(prompt.hashes[d], 0) > 0:
            d += 1
        if d >= len(prompt.hashes):
            d = 0
        if tier == "GPU":
            start = d
        else:
            ivs = [iv for iv in self.layout[(tier, g)] if iv[1] <= len(prompt.hashes)]
            start = max([i for i, iv in enumerate(ivs) if iv[0] <= d], default=0)
        hashes, parent, tokens = self._pick_blocks(tier, g, p, start, n)
        self._send(w, [self._stored(tier, g, hashes, parent, tokens, False)], version)
        self._model_store(w, tier, g, hashes, parent)
        self.history.append((w, tier, g, tuple(hashes), parent, tuple(tokens)))

    @rule(i=st.integers(0, 1000), version=st.sampled_from(VERSIONS))
    def store_again(self, i, version) -> None:
        """R-APP-4: the same announcement again only raises the count."""
        if not self.history:
            return
        w, tier, g, hashes, parent, tokens = self.history[i % len(self.history)]
        self._send(w, [self._stored(tier, g, hashes, parent, tokens, False)], version)
        self._model_store(w, tier, g, hashes, parent)
        self.history.append((w, tier, g, hashes, parent, tokens))

    @rule(w=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS), g=st.sampled_from(GROUPS),
          picks=st.lists(st.integers(0, 40), min_size=1, max_size=4),
          version=st.sampled_from(VERSIONS))
    def remove(self, w, tier, g, picks, version) -> None:
        """R-APP-4: removals of held (listed first), not held and unknown hashes."""
        held = sorted(h for h, n in self.cnt.get((w, tier, g), {}).items() if n > 0)
        pool = held + UNIVERSE + list(UNKNOWN)
        hashes = [pool[i % len(pool)] for i in picks]
        self._send(w, [Removed(block_hashes=hashes, medium=tier, group_idx=g)], version)
        self._model_remove(w, tier, g, hashes)

    @rule(i=st.integers(0, 1000), picks=st.lists(st.integers(0, 40), min_size=1, max_size=3),
          version=st.sampled_from(VERSIONS))
    def remove_held(self, i, picks, version) -> None:
        """Remove blocks some (worker, tier, group) holds (a hash may repeat: two removals)."""
        keys = sorted((k for k, c in self.cnt.items() if any(n > 0 for n in c.values())), key=repr)
        if not keys:
            return
        w, tier, g = keys[i % len(keys)]
        held = sorted(h for h, n in self.cnt[(w, tier, g)].items() if n > 0)
        hashes = [held[j % len(held)] for j in picks]
        self._send(w, [Removed(block_hashes=hashes, medium=tier, group_idx=g)], version)
        self._model_remove(w, tier, g, hashes)

    @rule(i=st.integers(0, 1000), version=st.sampled_from(VERSIONS))
    def remove_stored(self, i, version) -> None:
        """Remove exactly what one earlier store announced (drives counts to zero)."""
        if not self.history:
            return
        w, tier, g, hashes, _, _ = self.history[i % len(self.history)]
        self._send(w, [Removed(block_hashes=list(hashes), medium=tier, group_idx=g)], version)
        self._model_remove(w, tier, g, hashes)

    @rule(w=st.sampled_from(WORKERS), kind=st.sampled_from(("clear", "restart", "reset", "drop")),
          p=st.integers(0, len(PROMPTS) - 1), n=st.integers(0, 6), version=st.sampled_from(VERSIONS))
    def lifecycle(self, w, kind, p, n, version) -> None:
        """One rule for the destructive steps, so that state can build up between them."""
        if kind == "clear":
            self.clear(w, version)
        elif kind == "drop":
            self.drop_worker(w)
        else:
            self.restart(w, kind == "restart", p, n, version)

    def clear(self, w, version) -> None:
        """R-APP-8: AllBlocksCleared drops GPU and CPU, STORAGE stays."""
        self._send(w, [Cleared()], version)
        self._model_drop_tiers(w, ("GPU", "CPU"))

    def restart(self, w, via_batch, p, n, version) -> None:
        """R-STR-5: sequence going backwards with a newer ts (or reset_worker) drops the worker."""
        if via_batch:
            events, stores = [], []
            if n:
                prompt = PROMPTS[p]
                n = min(n, len(prompt.hashes))
                hashes, tokens = prompt.hashes[:n], prompt.tokens[: n * BS]
                events.append(self._stored("GPU", 0, hashes, None, tokens, False))
                stores.append(("GPU", 0, tuple(hashes), None, tuple(tokens)))
            restarting = self.last_seq[w] is not None
            self._send(w, events, version, seq=0)
            if restarting:
                self._model_drop_all(w)
            for tier, g, hashes, parent, tokens in stores:
                self._model_store(w, tier, g, hashes, parent)
                self.history.append((w, tier, g, hashes, parent, tokens))
        else:
            assert self.idx.reset_worker(*w) == self.known[w]
            self._model_drop_all(w)
            self.last_seq[w] = None
            self.last_batch[w] = None

    def drop_worker(self, w) -> None:
        """R-STR-6: a removed worker's residency goes."""
        assert self.idx.drop_worker(*w) == self.known[w]
        self._model_drop_all(w)
        self.known[w] = False
        self.last_seq[w] = None
        self.next_seq[w] = 0
        self.last_batch[w] = None

    @rule(w=st.sampled_from(WORKERS))
    def resend_last(self, w) -> None:
        """R-STR-1: a batch already applied (same seq, same ts) is skipped."""
        if self.last_batch[w] is None:
            return
        payload, seq = self.last_batch[w]
        assert self.idx.apply(w[0], payload, seq=seq) == "duplicate"

    # ------------------------------------------------------------ invariants

    @invariant()
    def matches_agree_with_model(self) -> None:
        """R-APP-5, R-APP-10, R-Q-2, R-Q-3 for every prompt and each of its prefixes."""
        if not any(self.known.values()) and not self.idx.models():
            return
        self._fulls = {}
        try:
            self._check_matches()
        finally:
            self._fulls = None

    def _check_matches(self) -> None:
        for p, prompt in enumerate(PROMPTS):
            for k in range(1 if self.PREFIXES else len(prompt.hashes), len(prompt.hashes) + 1):
                tokens = prompt.tokens[: k * BS]
                if k == len(prompt.hashes):
                    tokens = tokens + [5, 6]  # a trailing partial block is ignored (R-Q-1)
                r = self.idx.match(tokens)
                res = r.to_dict()
                assert _ENC(r.body()) == _ENC(res)  # the service's encoding path
                plain = self.idx.match_plain(tokens_to_bytes(tokens), None) if self.idx.models() else None
                if plain is not None:  # the one-frame door (GPU only, one group) answers alike
                    assert _timeless(plain.to_dict()) == _timeless(res)
                exp = self.expected(prompt.hashes, k)
                got = {
                    (x["engine"], x["dp_rank"]): {
                        "tiers": x["tiers"], "groups": x["groups"], "total_blocks": x["total_blocks"],
                        "total_tokens": x["total_tokens"], "score": x["score"],
                    }
                    for x in res["workers"]
                }
                for v in got.values():
                    v["score"] = round(v["score"], 6)
                assert got == exp, f"prompt {p} first {k} blocks:\n got {got}\n exp {exp}"
                order = sorted(exp, key=lambda w: (-exp[w]["score"], -exp[w]["total_blocks"], w))
                assert [(x["engine"], x["dp_rank"]) for x in res["workers"]] == order
                best = res["best"]
                if order and exp[order[0]]["total_blocks"] > 0:
                    assert best is not None and (best["engine"], best["dp_rank"]) == order[0], best
                else:
                    assert best is None, best

    @invariant()
    def stats_agree_with_model(self) -> None:
        """R-APP-4 counts, R-APP-3 orphan buffer, R-APP-9 memory."""
        s = self.idx.stats()
        held = sum(1 for c in self.cnt.values() for n in c.values() if n > 0)
        assert s["resident_entries"] == held, (s["resident_entries"], held)
        assert s["orphans"] == sum(len(v) for v in self.pending.values()), (s["orphans"], self.pending)
        groups = s["models"].get("default", {}).get("groups", {})
        for g in GROUPS:
            got = groups.get(str(g), {}).get("nodes", 0)
            assert got == self.expected_nodes(g), (g, got, self.expected_nodes(g))
        if held == 0:
            assert s["nodes"] == 0
        ws = {(x["engine"], x["dp_rank"]): x for x in self.idx.workers()}
        assert set(ws) == {w for w in WORKERS if self.known[w]}
        for w, x in ws.items():
            res = Counter()
            for (w2, t, _), c in self.cnt.items():
                if w2 == w:
                    res[t] += sum(1 for n in c.values() if n > 0)
            assert x["resident_blocks"] == {t: n for t, n in res.items() if n}, (w, x["resident_blocks"], res)
            assert x["orphans"] == len(self.pending[w])


class PerGroupChunkMachine(IndexMachine):
    """Each group has its own chunk size in a tier (R-APP-5: an event's blocks form a chunk)."""

    CHUNKING = "per_group"
    PREFIXES = False  # keeps shrinking fast


class PartitionChunkMachine(IndexMachine):
    """Chunks of varying sizes in one tier (R-APP-5: an event's blocks form a chunk)."""

    CHUNKING = "partition"
    PREFIXES = False


class SnapshotMachine(IndexMachine):
    """R-DUR-1: at any step the index may be written to a snapshot and restored into a
    new process's empty index; the restored index must keep agreeing with the model
    (same answers, sizes, orphans, freshness) as the steps go on."""

    PREFIXES = False

    @rule(capped=st.booleans())
    def snapshot_restore(self, capped) -> None:
        from indexer.store.snapshot import dumps, loads

        data = dumps(self.idx, meta={"step": len(self.history)})
        fresh = PrefixIndex(orphan_ttl_s=1e9, max_nodes=10_000 if capped else None)
        snap = loads(data)
        assert snap.meta == {"step": len(self.history)}
        snap.restore(fresh)
        self.idx.close()
        self.idx = fresh


_SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestR_APP_stateful_aligned_chunks = IndexMachine.TestCase
TestR_APP_stateful_aligned_chunks.settings = _SETTINGS

# Shorter runs: these two only vary the chunking; the aligned machine covers the rest.
TestR_APP_5_stateful_chunk_size_per_group = PerGroupChunkMachine.TestCase
TestR_APP_5_stateful_chunk_size_per_group.settings = settings(_SETTINGS, max_examples=100, stateful_step_count=12)

TestR_DUR_1_stateful_snapshot_restore = SnapshotMachine.TestCase
TestR_DUR_1_stateful_snapshot_restore.settings = settings(_SETTINGS, max_examples=120, stateful_step_count=30)

TestR_APP_5_stateful_variable_chunks = PartitionChunkMachine.TestCase
TestR_APP_5_stateful_variable_chunks.settings = settings(_SETTINGS, max_examples=60, stateful_step_count=12)


# ------------------------------------------------------------------ R-APP-9

_store_args = st.tuples(
    st.sampled_from(WORKERS), st.sampled_from(TIERS), st.sampled_from(GROUPS),
    st.integers(0, len(PROMPTS) - 1), st.integers(0, 5), st.integers(1, 6),
)


@settings(max_examples=100, deadline=None)
@given(stores=st.lists(_store_args, min_size=1, max_size=25), seed=st.integers(0, 2**32 - 1),
       version=st.sampled_from(VERSIONS))
def test_R_APP_9_all_stores_removed_no_nodes(stores, seed, version) -> None:
    """After every store has been removed (each announcement once), the index holds no nodes."""
    idx = PrefixIndex(orphan_ttl_s=1e9)
    seq = {w: 0 for w in WORKERS}
    removals = []

    def send(w, ev):
        idx.apply(w[0], encode_batch([ev], dp_rank=w[1], version=version), seq=seq[w])
        seq[w] += 1

    for w, tier, g, p, start, n in stores:
        prompt = PROMPTS[p]
        ln = len(prompt.hashes)
        start %= ln
        n = 1 + (n - 1) % (ln - start)
        hashes = prompt.hashes[start : start + n]
        send(w, Stored(
            block_hashes=hashes, parent_block_hash=prompt.hashes[start - 1] if start else None,
            token_ids=prompt.tokens[start * BS : (start + n) * BS], block_size=BS, medium=tier,
            group_idx=g, kv_cache_spec_kind="full_attention",
        ))
        removals.append((w, Removed(block_hashes=hashes, medium=tier, group_idx=g)))
    assert idx.stats()["nodes"] > 0 or idx.stats()["orphans"] > 0
    random.Random(seed).shuffle(removals)
    for w, ev in removals:
        send(w, ev)
    s = idx.stats()
    assert s["resident_entries"] == 0
    assert s["nodes"] == 0


# ------------------------------------------------- minimal cases found by the machine


def _stored(prompt, start, n, tier, g=0) -> Stored:
    return Stored(
        block_hashes=prompt.hashes[start : start + n],
        parent_block_hash=prompt.hashes[start - 1] if start else None,
        token_ids=prompt.tokens[start * BS : (start + n) * BS], block_size=BS, medium=tier,
        group_idx=g, kv_cache_spec_kind="full_attention",
    )


def _apply_all(idx, events, engine="e0", rank=0) -> None:
    for seq, ev in enumerate(events):
        assert idx.apply(engine, encode_batch([ev], dp_rank=rank), seq=seq) == "applied"


def test_R_APP_3_adopted_cpu_orphan_counts_in_total() -> None:
    """A CPU store that arrived child-first and was adopted continues the GPU prefix (R-Q-2).

    GPU block 0, then CPU block 2 (parent block 1 unknown: buffered), then GPU block 1
    (adopts the CPU store): total = 2 GPU + 1 CPU = 3 blocks, score 2.75.
    """
    p = PROMPTS[0]
    idx = PrefixIndex(orphan_ttl_s=1e9)
    _apply_all(idx, [_stored(p, 0, 1, "GPU"), _stored(p, 2, 1, "CPU"), _stored(p, 1, 1, "GPU")])
    assert idx.stats()["orphans"] == 0 and idx.stats()["resident_entries"] == 3
    wm = idx.match(p.tokens[: 3 * BS]).worker("e0", 0)
    assert wm is not None
    assert (wm.tiers, wm.total_blocks, wm.score) == ({"GPU": 2}, 3, 2.75)


def test_R_APP_5_chunks_of_different_sizes_in_one_tier() -> None:
    """Each event's blocks form a chunk: CPU chunks [0,1) then [1,3) give CPU 3 (and 1 for block 0)."""
    p = PROMPTS[0]
    idx = PrefixIndex()
    _apply_all(idx, [_stored(p, 0, 1, "CPU"), _stored(p, 1, 2, "CPU")])
    one = idx.match(p.tokens[:BS]).worker("e0", 0)
    three = idx.match(p.tokens[: 3 * BS]).worker("e0", 0)
    assert one is not None and (one.tiers, one.total_blocks) == ({"CPU": 1}, 1)
    assert three is not None and (three.tiers, three.total_blocks, three.score) == ({"CPU": 3}, 3, 2.25)


def test_R_APP_5_chunk_size_per_group() -> None:
    """A chunk in group 1 (1 block) is whole even when group 0 uses 2-block chunks in that tier."""
    p = PROMPTS[0]
    idx = PrefixIndex()
    _apply_all(idx, [_stored(p, 0, 1, "STORAGE", g=1), _stored(p, 0, 2, "STORAGE", g=0)])
    wm = idx.match(p.tokens[: 2 * BS]).worker("e0", 0)
    assert wm is not None
    assert wm.groups == {"0": {"STORAGE": 2, "total_blocks": 2}, "1": {"STORAGE": 1, "total_blocks": 1}}
    assert (wm.tiers, wm.total_blocks, wm.score) == ({"STORAGE": 1}, 1, 0.25)
