"""Queries (contract §6): which worker holds the longest prefix of a prompt, per
tier and group, with the engine-style ``total`` and the best-replica score. They take
the index lock and read the trees; the only state they touch is the lazy ranking of a
model's workers (``_Model.rank``, a cache of the (engine, dp_rank) order that answers
come out in), never what the index holds (R-Q-4)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from indexer._native import core as _core
from indexer.query.answers import MatchResult, WorkerMatch, _bits, gpu_answers
from indexer.query.route import Load, route
from indexer.store.lifecycle import Lifecycle
from indexer.store.state import GPU, ModelRequiredError, _Model
from indexer.store.tree import Tree, walk
from indexer.wire.keys import (
    KEY_SEED,
    block_keys,
    query_extra_keys,
    seeds_for_blocks,
    tokens_to_bytes,
)

if TYPE_CHECKING:
    from indexer.query.answers import TierItems
    from indexer.store.tree import Node

    # One group's answer for one worker: (((tier, blocks), ...), total blocks, weighted blocks).
    _Answer = tuple[TierItems, int, float]
    # A query's block keys at a block size, in chunks (see _LazyKeys).
    _KeysFor = Callable[[int], Iterable[Sequence[int]]]

__all__ = ["Query"]


class Query(Lifecycle):
    """Matches and routes."""

    def match(
        self,
        token_ids: Sequence[int],
        *,
        model: str | None = "default",
        lora_name: str | None = None,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> MatchResult:
        """Longest-prefix match of a prompt for every worker of ``model`` (R-Q-1, R-Q-2).

        ``token_ids`` are ints, or already their little-endian uint32 bytes (as
        the service's ``api.surface.split_json_tokens`` reads them from a request). Keys are computed
        for every full block at each group's block size; a trailing partial block
        is ignored. Changes nothing the index holds (R-Q-4); the first query after a
        worker joins re-ranks the model's workers (a cache of their (engine, dp_rank)
        order, under the lock), the only write a query makes.

        Raises
        ------
        KeyError
            When ``model`` is not indexed (or is None while several models are).
        OverflowError, TypeError
            When a token id is not an int in ``[0, 2**32-1]``.
        """
        return self._match_tokens(token_ids, model, lora_name, cache_salt, extra_keys)[0]

    def _match_tokens(self, token_ids: Sequence[int], model: str | None, lora_name: str | None,
                      cache_salt: str | None, extra_keys: Sequence[Any] | None = None
                      ) -> tuple[MatchResult, _KeysFor, int]:
        """:meth:`match`, plus the query's key source and its token count (for a route
        to record). Predictions, when the model has any, come in ``predicted``."""
        buf = token_ids if token_ids.__class__ is bytes else tokens_to_bytes(token_ids)
        ntok = len(buf) // 4
        cache: dict[int, _LazyKeys] = {}

        def keys_for(bs: int) -> Iterator[list[int]]:
            ks = cache.get(bs)
            if ks is None:
                n = ntok // bs
                if not lora_name and cache_salt is None and not extra_keys:
                    seed: Any = KEY_SEED
                else:
                    ek = query_extra_keys(n, cache_salt, extra_keys)
                    seed = seeds_for_blocks(n, lora_name, ek)
                ks = cache[bs] = _LazyKeys(buf, bs, seed, n)
            return ks.chunks()

        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            m = self._model(model)
            res = self._match(m, keys_for, ntok)
            tries = self.inflight.tries
            if tries and m.name in tries:
                res = self._with_predictions(res, keys_for)
            return res, keys_for, ntok

    def _with_predictions(self, res: MatchResult, keys_for: _KeysFor) -> MatchResult:
        """``res`` with the blocks routed prompts will add beyond what each worker announced."""
        bs = res.block_size or self.default_block_size
        pred = self.inflight.predicted(res.model, keys_for(bs), self._clock())
        if not pred:
            return res
        totals = {(w[2], w[3]): -w[1] for w in res.workers}
        credit = self.predicted_credit
        extra = [(d - totals.get(k, 0), k) for k, d in pred.items() if d > totals.get(k, 0)]
        if not extra:
            return res
        extra.sort(key=lambda x: (-x[0], x[1]))
        return res._replace(predicted=tuple((k[0], k[1], n, n * credit) for n, k in extra))

    def route(self, token_ids: Sequence[int], *, model: str | None = "default", lora_name: str | None = None,
              cache_salt: str | None = None, load: Mapping[str, Load] | None = None,
              candidates: Iterable[str] | None = None, prefill_load_scale: float = 1.0, record: bool = True,
              max_tokens: int | None = None,
              link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None) -> dict[str, Any]:
        """The best worker for a prompt (:func:`indexer.query.route.route`; the ``POST
        /v1/route`` body): the announced prefix plus predicted blocks (credit
        ``predicted_credit``) against load: the caller's ``load`` for the workers it
        names, the index's own in-flight estimate for the others.

        With ``record`` (the default) the decision is recorded (:mod:`.inflight`): the
        chosen worker's prompt blocks become predicted and its uncached prefill tokens
        in-flight load until the worker announces them (or ``prefill_ttl_s``), plus
        decode blocks for ``max_tokens`` until :meth:`route_done` (or ``decode_ttl_s``).
        The answer's ``request_id`` names it (None without ``record``)."""
        res, keys_for, ntok = self._match_tokens(token_ids, model, lora_name, cache_salt)
        if res.block_size is None:  # nothing stored yet: the prompt's size in default blocks
            dbs = self.default_block_size
            res = res._replace(block_size=dbs, query_blocks=ntok // dbs)
        known = self.model_workers(res.model)
        with self._lock:
            inf = self.inflight
            inf.expire(self._clock())
            busy = inf.prefill or inf.decode or inf.engine_extra  # else: nothing to ask per worker
            out = route(res, known, load=load, candidates=candidates, prefill_load_scale=prefill_load_scale,
                        link=link, in_flight=inf.load if busy else None, index_load=True)
            rid = None
            bs: int = res.block_size  # type: ignore[assignment]  # set just above when None
            if record:
                top = out["ranked"][0]
                held = (top["cached_blocks"] + top["predicted_blocks"]) * bs
                decode = -(-(ntok + max_tokens) // bs) if max_tokens else 0
                keys = chain.from_iterable(keys_for(bs))  # InFlight copies them into one array
                rid = inf.record(res.model, (out["engine"], out["dp_rank"]), keys, ntok - held, decode,
                                 predict=top["cached_blocks"] < ntok // bs)
            out["request_id"] = rid
            return out

    def correct_load(self, worker: tuple[str, int], waiting: float, running: float, t: float) -> None:
        """A worker's engine reported its queue (vLLM metrics): correct the in-flight
        estimate (:meth:`indexer.store.inflight.InFlight.correct`)."""
        with self._lock:
            self.inflight.correct(worker, waiting, running, t)

    def route_done(self, request_id: str) -> bool | None:
        """Request ``request_id`` (a route's answer) finished: release its in-flight load
        (True). False when it had ended already (its prefill announced with no decode to
        wait for, done before, expired); None when the index does not know it."""
        with self._lock:
            return self.inflight.done(request_id)

    def match_by_keys(self, block_keys_: Sequence[int], *, model: str | None = "default") -> MatchResult:
        """Like :meth:`match`, with the caller's block keys (R-Q-1, R-KEY-2).

        The keys apply to every group whose block size is the headline block size.
        """
        keys = list(block_keys_)
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            m = self._model(model)
            bs = m.trees[m.default_groups()[0]].block_size if m.trees else 0

            def keys_for(b: int) -> tuple[list[int], ...]:
                return (keys,) if b == bs else ()

            return self._match(m, keys_for, len(keys) * bs)

    def _model(self, model: str | None) -> _Model:
        if model is None:
            # The one model with workers (a model whose engines all left does not count).
            live = [m for m in self._models.values() if m.workers] or list(self._models.values())
            if len(live) == 1:
                return live[0]
            if not live:
                raise KeyError("no model is indexed yet")
            # Engines register under "default" unless told otherwise: a query without a
            # model keeps meaning that pool when another model joins.
            d = self._models.get("default")
            if d is not None and d.workers:
                return d
            names = ", ".join(sorted(m.name for m in live))
            raise ModelRequiredError(f"model is required: several models are indexed ({names})")
        m = self._models.get(model)
        if m is None:
            raise KeyError(f"unknown model {model!r}")
        return m

    def match_plain(self, buf: bytes, model: str | None) -> MatchResult | None:
        """:meth:`match` of ``buf`` (token ids as little-endian uint32 bytes, no LoRA, salt
        or extra keys) in one Python frame, when ``model`` has the common shape: one
        attention group, GPU only, no predictions. None for any other model (ask
        :meth:`match`). Raises as :meth:`match` does for an unknown model.

        Why a second door: on the 2-vCPU VM the service is measured on, a query runs with
        cold caches (the vCPU idles between requests), where each Python frame on the way
        costs ~4 us; :meth:`match` takes ~12 frames to the same three compiled calls."""
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            m = self._models.get(model) if model is not None else None
            if m is None:
                m = self._model(model)  # None, or unknown: match's answer (or KeyError)
            trees = m.trees
            if len(trees) != 1 or m.tiered:
                return None
            tries = self.inflight.tries
            if tries and m.name in tries:
                return None
            (g, tree), = trees.items()
            bs = tree.block_size
            ntok = len(buf) >> 2
            n = ntok // bs
            # Up to 64 blocks in one call (packed: no int per key); a longer prompt hashed
            # as the walk goes (_LazyKeys).
            chunks: Any = (
                (_core.block_keys(buf, bs, KEY_SEED, n, 0, True) if _core is not None
                 else block_keys(buf, bs, KEY_SEED, n),) if n <= 64 else _LazyKeys(buf, bs, KEY_SEED, n).chunks())
            return self._gpu_only(m, g, tree, chunks, ntok)

    def _gpu_only(self, m: _Model, g: int, tree: Tree, key_chunks: Iterable[Sequence[int]], ntok: int) -> MatchResult:
        """The common shape: one attention group, GPU only. Its one group is the headline
        (R-APP-10); the walk's stops are the whole answer."""
        bs = tree.block_size
        d, stops, active, _ = walk(tree.root, key_chunks, False)
        if d and active > 0:
            stops.append((d, active))
        if not m.ranked:
            m.rank()
        if stops:
            credits = self._credits_cache  # _credit_by_tid's cache, read here without its frame
            if len(credits) != len(self._tier_names):
                credits = self._credit_by_tid()
            out = gpu_answers(stops, m.rows, str(g), bs, credits[GPU], self.stale_factor, self._clock(), WorkerMatch)
        else:
            out = []
        best = out[0] if out and out[0][1] < 0 else None
        return tuple.__new__(MatchResult, (m.name, bs, ntok // bs, out, best, ()))

    def _match(self, m: _Model, keys_for: _KeysFor, ntok: int) -> MatchResult:
        trees = m.trees
        if not trees:
            return MatchResult(m.name, None, 0, [], None)
        if len(trees) == 1 and not m.tiered:
            (g, tree), = trees.items()
            return self._gpu_only(m, g, tree, keys_for(tree.block_size), ntok)
        defaults = m.default_groups()
        head_bs = trees[defaults[0]].block_size
        # group -> {wid: (((tier name, blocks), ...), total blocks, weighted blocks)}
        per_group: dict[int, dict[int, _Answer]] = {}
        for g, tree in trees.items():
            got = self._match_path(m, tree, keys_for(tree.block_size))
            if got:
                per_group[g] = got
        qblocks = ntok // head_bs
        if not per_group:
            return MatchResult(m.name, head_bs, qblocks, [], None)
        workers = m.workers
        stale_factor = self.stale_factor
        now = self._clock()
        out: list[WorkerMatch] = []
        append = out.append
        # tuple.__new__ skips NamedTuple's Python-level __new__ (one call per worker per query).
        tnew = tuple.__new__
        wm = WorkerMatch
        r: _Answer | None  # one worker's answer in one group (both branches below)
        windows = [(g, trees[g]) for g in m.windows if g in trees and trees[g].block_size == head_bs]
        if len(per_group) == 1 and len(defaults) == 1 and defaults[0] in per_group and not windows:
            # The common shape: one attention group. Headline = that group.
            (g, got), = per_group.items()
            gname = str(g)
            # answers are shared by workers at one depth
            shared: dict[int, tuple[float, int, TierItems, Any, int]] = {}
            for wid, r in got.items():
                w = workers.get(wid)
                if w is None:
                    continue
                c = shared.get(id(r))
                if c is None:
                    tier_items, total, weighted = r
                    c = shared[id(r)] = (-weighted, -total, tier_items, ((gname, tier_items, total),),
                                         total * head_bs)
                fresh = w.fresh
                append(tnew(wm, (
                    c[0] * stale_factor if fresh[0] else c[0], c[1], w.engine, w.dp_rank,
                    c[2], c[3], c[4], fresh, now,
                )))
            out.sort()  # WorkerMatch tuples order as the ranking: no key function
            best = out[0] if out and out[0].total_blocks > 0 else None
            return tuple.__new__(MatchResult, (m.name, head_bs, qblocks, out, best, ()))
        head = self._headline(m, defaults, per_group, head_bs)
        if windows and head:
            head = self._window_capped(m, head, windows, keys_for, ntok)
        for wid in set().union(*per_group.values()):
            w = workers.get(wid)
            if w is None:
                continue
            group_items = tuple(
                (str(g), r[0], r[1]) for g, got in per_group.items() if (r := got.get(wid)) is not None
            )
            h = head.get(wid)
            if h is not None:
                tier_items, total_blocks, score = h
                if w.stale:
                    score *= stale_factor
            else:
                tier_items, total_blocks, score = (), 0, 0.0
            append(tnew(wm, (
                -float(score), -total_blocks, w.engine, w.dp_rank, tier_items, group_items,
                total_blocks * head_bs, w.fresh, now,
            )))
        out.sort()
        best = out[0] if out and out[0].total_blocks > 0 else None
        return MatchResult(m.name, head_bs, qblocks, out, best)

    def _headline(
        self, m: _Model, defaults: list[int], per_group: dict[int, dict[int, _Answer]], head_bs: int
    ) -> dict[int, _Answer]:
        """R-APP-10 headline per worker: each figure is its minimum over the default groups.

        Figures are compared in tokens and given in blocks of the headline size:
        {wid: (((tier, blocks), ...), total blocks, weighted blocks)}.
        """
        head: dict[int, tuple[dict[str, float], float, float]] = {}
        total: float  # blocks, then scaled blocks
        weighted: float
        for i, g in enumerate(defaults):
            got = per_group.get(g)
            if not got:
                return {}
            sc = m.trees[g].block_size / head_bs
            if i == 0:
                for wid, (items, total, weighted) in got.items():
                    head[wid] = ({t: b * sc for t, b in items}, total * sc, weighted * sc)
                continue
            for wid in list(head):
                r = got.get(wid)
                if r is None:
                    del head[wid]
                    continue
                tiers, total, weighted = head[wid]
                mine = {t: b * sc for t, b in r[0]}
                tiers = {t: min(b, mine.get(t, 0)) for t, b in tiers.items()}
                head[wid] = (tiers, min(total, r[1] * sc), min(weighted, r[2] * sc))
        return {
            wid: (tuple((t, int(b)) for t, b in tiers.items()), int(total), weighted)
            for wid, (tiers, total, weighted) in head.items()
        }

    def _window_capped(self, m: _Model, head: dict[int, _Answer], windows: list[tuple[int, Tree]],
                       keys_for: _KeysFor, ntok: int) -> dict[int, _Answer]:
        """R-APP-10 for a hybrid model: each headline cut to what vLLM's hit rule lets a
        sliding-window group reuse of this prompt (R-APP-12).

        vLLM (``HybridKVCacheCoordinator``) takes the full-attention hit within
        ``len - 1`` tokens, then scans each sliding-window group from there leftwards
        for ``ceil((window - 1) / block_size)`` cached blocks in a row: the hit ends
        with the first such run, or, with none, is the run of cached blocks from the
        start. A full-attention prefix is a prefix, so one pass reaches its fixed point.
        """
        cap = max(ntok - 1, 0) // windows[0][1].block_size
        workers = m.workers
        for g, tree in windows:
            _, _, _, path = walk(tree.root, keys_for(tree.block_size), True)
            need = max(-(-(m.windows[g] - 1) // tree.block_size), 1)
            out: dict[int, _Answer] = {}
            for wid, (items, total, weighted) in head.items():
                w = workers.get(wid)
                hit = total if w is None else _window_hit(path, w.bit, min(total, cap), need)  # type: ignore[arg-type]
                if hit < total:
                    items = tuple((t, min(b, hit)) for t, b in items)
                    weighted = weighted * hit / total
                    total = hit
                out[wid] = (items, total, weighted)
            head = out
        return head

    def _match_path(self, m: _Model, tree: Tree, key_chunks: Iterable[Sequence[int]]) -> dict[int, _Answer] | None:
        """Walk one group's tree along the keys and answer per worker (read-only).

        Returns ``{wid: (((tier, blocks), ...), total, weighted blocks)}``, or None
        when nothing matched. The GPU prefix of every worker is computed during the
        walk, as bit masks: ``active`` holds the workers whose GPU run is unbroken.
        """
        keep = m.tiered  # only tiered models need the path for the chunk scan
        # keys come in growing chunks: a miss hashes little
        d, stops, active, path = walk(tree.root, key_chunks, keep)
        if d == 0:
            return None
        if active > 0:
            stops.append((d, active))
        credits = self._credit_by_tid()
        cg = credits[GPU]
        if not keep or all(nd.tiers is None for nd in path):  # type: ignore[union-attr]  # a list when keep
            if not stops:
                return None
            # Workers that stop at one depth share one answer tuple.
            out: dict[int, _Answer] = {}
            for g, mask in stops:
                r = ((("GPU", g),), g, g * cg)
                for wid in _bits(mask):
                    out[wid] = r
            return out
        gpu = {wid: g for g, mask in stops for wid in _bits(mask)}
        names = self._tier_names
        other = self._other_tiers(m, tree.group, path)  # type: ignore[arg-type]  # a list when keep
        out = {}
        chain = [self._tier_ids.get(t) for t in self.total_chain]
        t: int | None  # a tier id (None: a chain tier not in use)
        wids = set(gpu)
        for per_w in other.values():
            wids.update(per_w)
        for wid in wids:
            g = gpu.get(wid, 0)
            items = [("GPU", g)]
            for t, per_w in other.items():
                chunks = per_w.get(wid)
                if chunks:
                    alone = 0
                    for s, e in chunks:
                        if s == alone + 1:
                            alone = e
                    items.append((names[t], alone))
            pos = g
            weighted = g * cg
            for t in chain:
                if t is None or t == GPU:
                    continue
                chunks = other.get(t, _EMPTY).get(wid)
                if not chunks:
                    continue
                start = pos
                for s, e in chunks:
                    if s <= pos + 1 and e > pos:
                        pos = e
                weighted += (pos - start) * credits[t]
            if pos or any(b for _, b in items):
                out[wid] = (tuple(items), pos, weighted)
        return out

    def _credit_by_tid(self) -> list[float]:
        c = self._credits_cache
        if len(c) != len(self._tier_names):
            c = self._credits_cache = [self.credits.get(n, 0.0) for n in self._tier_names]
        return c

    def _other_tiers(self, m: _Model, group: int, path: list[Node]) -> dict[int, dict[int, list[tuple[int, int]]]]:
        """Fully covered chunks per non-GPU tier and worker: {tid: {wid: [(start, end)]}}.

        A chunk ends at a block marked as a chunk end for the worker (R-APP-5); it
        starts as many blocks earlier as its store event carried, and counts only
        when the worker holds every one of its blocks in that tier.
        """
        workers = m.workers
        out: dict[int, dict[int, list[tuple[int, int]]]] = {}
        runs: dict[tuple[int, int], int] = {}  # (tid, wid) -> start depth of the current unbroken run
        lasts: dict[tuple[int, int], int] = {}
        for d, node in enumerate(path, 1):
            tiers = node.tiers
            if tiers is None:
                continue
            for t, mask in tiers.items():
                if t <= 0:
                    continue
                ends = tiers.get(-t, 0)
                x = mask
                while x:
                    low = x & -x
                    x ^= low
                    wid = low.bit_length() - 1
                    k = (t, wid)
                    if lasts.get(k) != d - 1:
                        runs[k] = d
                    lasts[k] = d
                    if ends & low:
                        w = workers.get(wid)
                        wg = w.groups.get(group) if w is not None else None
                        n = wg.ends.get(t, _EMPTY).get(node, 1) if wg is not None else 1
                        if d - n + 1 >= runs[k]:
                            out.setdefault(t, {}).setdefault(wid, []).append((d - n + 1, d))
        return out


_EMPTY: dict[Any, Any] = {}


class _LazyKeys:
    """A query's block keys, hashed in growing chunks (64, 512, 4096 blocks) as the
    walk asks for them: a prompt that misses early hashes a few blocks, not all
    (64 blocks hash in ~1 us in the compiled core: one chunk for a 1,024-token prompt).
    Computed chunks are kept for the next group with the same block size."""

    __slots__ = ("buf", "block_size", "seed", "n", "done", "i")

    def __init__(self, buf: bytes, block_size: int, seed: int | Sequence[int], n: int) -> None:
        self.buf = buf
        self.block_size = block_size
        self.seed = seed
        self.n = n
        self.done: list[list[int]] = []
        self.i = 0

    def chunks(self) -> Iterator[list[int]]:
        if self.done:
            yield from self.done
        i = self.i
        size = 64 << (3 * len(self.done))
        while i < self.n:
            j = min(self.n, i + size)
            c = block_keys(self.buf, self.block_size, self.seed, j, i)
            self.done.append(c)
            self.i = i = j
            size <<= 3
            yield c




def _window_hit(path: Sequence[Node], bit: int, max_blocks: int, need: int) -> int:
    """Blocks a sliding-window group lets vLLM reuse (``SlidingWindowManager.
    find_longest_cache_hit``): from ``max_blocks`` leftwards, the end of the first run
    of ``need`` blocks ``bit`` holds on GPU; without one, the run from the start."""
    run = 0
    for i in range(min(max_blocks, len(path)) - 1, -1, -1):
        if path[i].gpu & bit:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run
