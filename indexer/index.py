"""PrefixIndex: vLLM KV events in, longest-prefix matches out.

Contract sections 2-4 and 6 (``shared/spec/indexer-contract.md``) in one object:

* :meth:`PrefixIndex.apply` decodes one batch payload exactly as it came off the
  wire and applies it (stores, removals, clears, placeholders) to the trees of
  the worker's model;
* :meth:`PrefixIndex.match` / :meth:`PrefixIndex.match_by_keys` answer which
  worker holds the longest prefix of a prompt, per tier and group, with the
  engine-style ``total`` and a best-replica score;
* worker lifecycle (drop, stale marks, freshness) and :meth:`PrefixIndex.stats`.

Every public method takes one lock, so a query never sees a half-applied batch
(R-Q-5) and waits behind at most one batch. The lock is cheap; the ingest layer
decides which threads call in.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Iterable, Sequence

import msgspec

from .keys import KEY_SEED, block_keys, query_extra_keys, seeds_for_blocks, tokens_to_bytes
from .result import MatchResult, WorkerMatch, _bits, gpu_answers
from .route import route
from .sequencer import DUPLICATE, GAP, NEXT, classify
from .tree import DEAD, MAX_TIERS, Kids, Node, Tree, dup_add, insert_gpu, remove_gpu, walk
from .wire import REMOVED, STORED, DecodeError, decode_batch, raw_array_len, token_bytes

__all__ = ["PrefixIndex", "DEFAULT_CREDITS", "DEFAULT_GROUP_KINDS"]

DEFAULT_CREDITS = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
# R-APP-10: groups whose headline figures count. None stands for "unknown".
DEFAULT_GROUP_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "unknown", None}
)
GPU = 0  # tier id of "GPU", fixed

_now = time.monotonic


class _WG:
    """One worker's state in one KV-cache group."""

    __slots__ = ("map", "orphans", "res", "ends")

    def __init__(self) -> None:
        self.map = Kids()  # engine hash -> Node (R-APP-2 / R-APP-3 resolution)
        self.orphans: dict = {}  # missing parent hash -> [pending store, ...]
        self.res = [0] * MAX_TIERS  # resident entries per tier id
        # tier id -> {chunk-end node: blocks in that chunk} (R-APP-5: the blocks
        # of one event form a chunk, whatever size each event has)
        self.ends: dict[int, dict] = {}

    def mark_end(self, tiers: dict, tid: int, bit: int, node, nblocks: int) -> None:
        """Record ``node`` as the last block of an ``nblocks`` chunk in tier ``tid``."""
        tiers[-tid] = tiers.get(-tid, 0) | bit
        ends = self.ends.get(tid)
        if ends is None:
            ends = self.ends[tid] = {}
        ends[node] = nblocks

    def clear_end(self, tiers: dict, tid: int, bit: int, node) -> None:
        """Forget ``node`` as a chunk end of this worker in tier ``tid`` (if it was one)."""
        e = tiers.get(-tid, 0)
        if e & bit:
            e ^= bit
            if e:
                tiers[-tid] = e
            else:
                del tiers[-tid]
            self.ends[tid].pop(node, None)


class _Worker:
    __slots__ = (
        "wid", "bit", "engine", "dp_rank", "model", "groups", "last_seq", "last_ts",
        "last_apply", "stale", "stale_reason", "dropped", "batches", "restarts", "gaps", "fresh", "rows", "pos",
    )

    def __init__(self, wid: int, engine: str, dp_rank: int, model: str, rows: list) -> None:
        self.wid = wid
        self.bit = 1 << wid
        self.engine = engine
        self.dp_rank = dp_rank
        self.model = model
        self.groups: dict[int, _WG] = {}
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.last_apply: float | None = None
        self.stale = False
        self.stale_reason: str | None = None
        self.dropped: dict[str, int] = {}
        self.batches = 0
        self.restarts = 0
        self.gaps = 0
        self.rows = rows  # the model's rows: wid -> (engine, dp_rank, freshness, position)
        self.pos = 0  # this worker's place in its model's (engine, dp_rank) order (_Model.rank)
        if len(rows) <= wid:
            rows.extend([None] * (wid + 1 - len(rows)))
        self.refresh()

    def refresh(self) -> None:
        """Snapshot the freshness fields a query reports (one tuple, shared by answers)
        into ``fresh`` and the model's row of this worker."""
        self.fresh = (self.stale, self.stale_reason, self.last_seq, self.last_apply)
        self.rows[self.wid] = (self.engine, self.dp_rank, self.fresh, self.pos)


class _Model:
    __slots__ = ("name", "trees", "kinds", "workers", "rows", "ranked", "_defaults", "tiered")

    def __init__(self, name: str) -> None:
        self.name = name
        self.trees: dict[int, Tree] = {}
        self.kinds: dict[int, str | None] = {}
        self.workers: dict[int, _Worker] = {}
        # wid -> (engine, dp_rank, freshness, position) or None: what a query's answers
        # need of each worker, in one list the compiled answers() reads by index.
        self.rows: list = []
        # Whether every worker's position is its place in (engine, dp_rank) order: a
        # new worker clears it, the next query ranks again (a leaving one keeps it).
        self.ranked = True
        self._defaults: list[int] | None = None
        # Set once any non-GPU residency was stored: GPU-only fleets skip the
        # per-tier chunk scan on every query.
        self.tiered = False

    def rank(self) -> None:
        """Give every worker its place in (engine, dp_rank) order, in its row."""
        for i, w in enumerate(sorted(self.workers.values(), key=_engine_rank)):
            w.pos = i
            w.refresh()
        self.ranked = True

    def set_kind(self, group: int, kind: str | None) -> None:
        self.kinds[group] = kind
        self._defaults = None

    def default_groups(self) -> list[int]:
        """R-APP-10 default groups (all groups when none qualifies); cached."""
        d = self._defaults
        if d is None:
            gs = [g for g in self.trees if self.kinds.get(g) in DEFAULT_GROUP_KINDS]
            d = self._defaults = sorted(gs) if gs else sorted(self.trees)
        return d


_EVENT_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def _engine_rank(w: _Worker) -> tuple:
    return w.engine, w.dp_rank


class ModelRequiredError(KeyError):
    """A query named no model while several are indexed (a client error, not a missing model)."""


class PrefixIndex:
    """The in-process prefix index (no I/O, no threads of its own).

    Parameters
    ----------
    credits:
        Tier credits for the score (R-Q-3). Defaults GPU 1.0, CPU 0.75, STORAGE 0.25;
        a tier without a credit scores 0.
    total_chain:
        The tiers the engine loads from, in order, for ``total`` (R-Q-2).
    stale_factor:
        Multiplier applied to a stale worker's score when ranking (R-Q-3).
    max_orphans, orphan_ttl_s:
        Bounds of the orphan buffer (R-APP-3): buffered stores, and their age.
    max_nodes:
        Per-tree node cap; ``None`` for none. When exceeded, the least recently
        stored leaves are evicted with all their residency (R-APP-9).
    max_dp_rank, max_groups, max_tiers:
        Bounds on what a publisher can make the index allocate (R-BAD-3).
    """

    def __init__(
        self,
        *,
        credits: dict[str, float] | None = None,
        total_chain: Sequence[str] = ("GPU", "CPU", "STORAGE"),
        stale_factor: float = 0.5,
        max_orphans: int = 10_000,
        orphan_ttl_s: float = 30.0,
        max_nodes: int | None = None,
        max_dp_rank: int = 1023,
        max_groups: int = 64,
        max_tiers: int = MAX_TIERS,
        clock=_now,
    ) -> None:
        self.credits = {k.upper(): float(v) for k, v in (DEFAULT_CREDITS if credits is None else credits).items()}
        self.total_chain = tuple(t.upper() for t in total_chain)
        self.stale_factor = float(stale_factor)
        self.max_orphans = int(max_orphans)
        self.orphan_ttl_s = float(orphan_ttl_s)
        self.max_nodes = max_nodes
        self.max_dp_rank = int(max_dp_rank)
        self.max_groups = int(max_groups)
        self.max_tiers = min(int(max_tiers), MAX_TIERS)
        self._clock = clock
        self._lock = threading.Lock()
        # Queries about to take the lock: a writer thread yields the GIL after a
        # batch when this is not empty, so a query waits for one batch, not for the
        # interpreter's 5 ms switch interval. A deque because append/pop are atomic
        # under the GIL, where `+= 1` from several query threads could drift.
        self.readers_waiting: deque = deque()
        self._models: dict[str, _Model] = {}
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._free_wids: list[int] = []
        self._next_wid = 0
        # Tier names <-> ids; GPU is 0. The cache maps raw (medium, ownership) to an id.
        self._tier_names: list[str] = ["GPU"]
        self._tier_ids: dict[str, int] = {"GPU": 0}
        self._tier_cache: dict = {None: 0}
        self._orphan_queue: deque = deque()  # (t, wg, parent_hash, entry) in arrival order
        self._orphans = 0
        self._counters: dict[str, int] = {}
        # {event type: {outcome: n}}; index 3 collects what the decoder ignored.
        self._events: list[dict[str, int]] = [{}, {}, {}, {}]
        self._dropped: dict[str, int] = {}
        self._credits_cache: list[float] = []

    def close(self) -> None:
        """Free the whole index now (nodes are outside the cycle collector)."""
        with self._lock:
            for m in self._models.values():
                for tree in m.trees.values():
                    tree.clear()
                m.trees.clear()
            self._models.clear()
            self._workers.clear()
            self._orphan_queue.clear()
            self._orphans = 0

    def __del__(self) -> None:
        try:
            for m in self._models.values():
                for tree in m.trees.values():
                    tree.clear()
        except Exception:  # interpreter shutdown: nothing left to free
            pass

    # ------------------------------------------------------------------ apply

    def apply(
        self,
        engine: str,
        payload: bytes,
        *,
        model: str = "default",
        dp_rank: int | None = None,
        seq: int | None = None,
    ) -> str:
        """Decode and apply one batch payload (frame 3 of a vLLM live message).

        ``dp_rank=None`` takes the rank from the batch (R-DEC-4: the batch's rank
        wins when present). With ``seq`` the sequencer's rule applies
        (:func:`indexer.sequencer.classify`): an already applied sequence is skipped
        (R-STR-1); one that goes backwards with a newer batch timestamp is an engine
        restart and drops the worker's residency first (R-STR-5); a forward jump is
        counted as a gap.

        Returns ``"applied"``, ``"duplicate"`` or ``"dropped"`` (the payload did not
        decode: counted per worker and reason, nothing indexed is touched, R-DEC-3).
        """
        with self._lock:
            return self._apply(engine, payload, model, dp_rank, seq, True)[0]

    def apply_sequenced(
        self, engine: str, payload: bytes, *, model: str = "default", dp_rank: int | None = None, seq: int
    ) -> float | None:
        """Apply one batch that a :class:`~indexer.sequencer.Stream` already sequenced
        (no decision is made again here); record ``seq`` as the worker's last.

        Returns the batch's ts, or None when the payload did not decode.
        """
        with self._lock:
            return self._apply(engine, payload, model, dp_rank, seq, False)[1]

    def _apply(self, engine: str, payload: bytes, model: str, dp_rank: int | None, seq: int | None,
               decide: bool) -> tuple[str, float | None]:
        try:
            batch = decode_batch(payload)
        except DecodeError as e:
            self._drop(engine, model, dp_rank, e.reason)
            w = self._workers.get((engine, dp_rank or 0))
            if w is not None and seq is not None and (w.last_seq is None or seq > w.last_seq):
                w.last_seq = seq  # the sequence number was used, by a bad batch
                w.refresh()
            return "dropped", None
        rank = batch.dp_rank if batch.dp_rank is not None else (dp_rank or 0)
        if rank.__class__ is not int or rank < 0 or rank > self.max_dp_rank:
            self._drop(engine, model, dp_rank, "bad_dp_rank")
            return "dropped", None
        w = self._worker(engine, rank, model)
        if seq is not None:
            verdict = classify(w.last_seq, w.last_ts, seq, batch.ts)
            if verdict == GAP:
                w.gaps += 1
                self._count("sequence_gaps")
            elif decide and verdict != NEXT:
                if verdict == DUPLICATE:
                    self._count("batches_duplicate")
                    return "duplicate", None
                self._restart(w)
            w.last_seq = seq
        if batch.issues:
            unknown = self._events[3]
            for k, v in batch.issues.items():
                unknown[k] = unknown.get(k, 0) + v
        if self._orphans:
            # Expire first: an orphan past its age bound is not adopted by this batch.
            self._expire_orphans()
        ev_counts = self._events
        for ev in batch.events:
            kind = ev.kind
            if kind == STORED:
                outcome = self._on_store(w, ev)
            elif kind == REMOVED:
                outcome = self._on_remove(w, ev)
            else:
                outcome = self._on_clear(w)
            c = ev_counts[kind]
            c[outcome] = c.get(outcome, 0) + 1
        w.last_ts = batch.ts
        w.last_apply = self._clock()
        w.refresh()
        w.batches += 1
        self._count("batches_applied")
        return "applied", batch.ts

    def _tier(self, medium, ownership) -> int:
        """Tier id of an event (contract §1 Tier); -1 once ``max_tiers`` are in use."""
        ck = medium if ownership is None else (medium, ownership)
        tid = self._tier_cache.get(ck)
        if tid is not None:
            return tid
        if not isinstance(medium, (str, type(None))) or not isinstance(ownership, (str, type(None))):
            return -1
        name = (medium or "GPU").upper()
        if ownership is not None:
            name = f"{name}:{ownership}"
        tid = self._tier_ids.get(name)
        if tid is None:
            if len(self._tier_names) >= self.max_tiers:
                return -1
            tid = len(self._tier_names)
            self._tier_names.append(name)
            self._tier_ids[name] = tid
        if len(self._tier_cache) < 4 * self.max_tiers:
            self._tier_cache[ck] = tid
        return tid

    def _group(self, ev) -> int:
        g = ev.group_idx
        if g is None:
            return 0
        if g < 0 or g >= self.max_groups:
            return -1
        return g

    def _on_store(self, w: _Worker, ev) -> str:
        loc = ev.locality
        if loc is not None and loc.upper() == "REMOTE":
            return "remote_ignored"  # R-APP-11
        tid = self._tier(ev.medium, ev.ownership)
        if tid < 0:
            return "tier_limit"
        group = self._group(ev)
        if group < 0:
            return "bad_group"
        hashes = ev.block_hashes
        n = len(hashes)
        bs = ev.block_size
        ntok = raw_array_len(ev.token_ids)
        if bs <= 0 or ntok == 0:
            return self._on_placeholder(w, ev, tid, group)
        if n == 0 or ntok != n * bs:
            return "shape_mismatch"  # R-APP-1: SWA/Mamba stores skip null blocks
        m = self._models[w.model]
        tree = m.trees.get(group)
        if tree is None:
            tree = m.trees[group] = Tree(group, bs, self.max_nodes is not None)
            m.set_kind(group, ev.kv_cache_spec_kind)
        elif tree.block_size != bs:
            w.dropped["block_size_mismatch"] = w.dropped.get("block_size_mismatch", 0) + 1
            return "block_size_mismatch"  # R-APP-7
        elif m.kinds.get(group) is None and ev.kv_cache_spec_kind is not None:
            m.set_kind(group, ev.kv_cache_spec_kind)
        wg = w.groups.get(group)
        if wg is None:
            wg = w.groups[group] = _WG()
        ph = ev.parent_block_hash
        if ph is None:
            parent = tree.root
        else:
            parent = wg.map.get(ph)
            if parent is None or parent.parent is DEAD:
                return self._orphan(wg, ph, ev, tid)
        outcome = self._insert(tree, wg, w, tid, parent, ev)
        if wg.orphans and outcome.startswith("applied"):
            self._adopt(tree, wg, w, hashes)
        if tree.stamps is not None and tree.nodes > self.max_nodes:
            self._cap(m, tree)
        return outcome

    def _insert(self, tree: Tree, wg: _WG, w: _Worker, tid: int, parent: Node, ev) -> str:
        """Attach the blocks of one rich store under ``parent`` and add residency.

        Known hashes win (R-APP-2): a hash the worker already maps keeps its node,
        and the event's tokens are only decoded and hashed when a block is new.
        """
        hashes = ev.block_hashes
        wmap = wg.map
        bit = w.bit
        keys = None
        new = 0
        capped = tree.stamps is not None
        get = wmap.get
        if tid == GPU and not capped and get(hashes[0]) is None:
            # The hot path: a GPU store that starts with a new block (tree.insert_gpu:
            # the general loop below minus its per-block branches).
            keys = self._event_keys(ev, tree.block_size, len(hashes))
            if keys is None:
                return "bad_tokens"
            _, created, new = insert_gpu(wmap, parent, hashes, keys, bit, w.wid << 5)
            tree.nodes += created
            wg.res[GPU] += new
            return "applied" if new == len(hashes) else "applied_with_duplicates"
        for i, h in enumerate(hashes):
            node = get(h)
            if node is None or node.parent is DEAD:
                if keys is None:
                    keys = self._event_keys(ev, tree.block_size, len(hashes))
                    if keys is None:
                        self._rollback(tree, wg, w, tid, hashes, i)
                        return "bad_tokens"
                k = keys[i]
                node = tree.child(parent, k)
                if node is None:
                    node = tree.add_child(parent, k)
                wmap[h] = node
            if capped:
                tree.touch(node)
            if tid == GPU:
                m = node.gpu
                if m & bit:
                    dup_add(node, (w.wid << 5) | tid)
                else:
                    node.gpu = m | bit
                    new += 1
            else:
                tiers = node.tiers
                if tiers is None:
                    node.tiers = {tid: bit}
                    new += 1
                else:
                    m = tiers.get(tid, 0)
                    if m & bit:
                        dup_add(node, (w.wid << 5) | tid)
                    else:
                        tiers[tid] = m | bit
                        new += 1
            parent = node
        if tid != GPU:
            # R-APP-5: the blocks of one event form a chunk; mark its last block.
            wg.mark_end(parent.tiers, tid, bit, parent, len(hashes))
            self._models[w.model].tiered = True
        wg.res[tid] += new
        return "applied" if new == len(hashes) else "applied_with_duplicates"

    def _rollback(self, tree, wg, w, tid, hashes, upto) -> None:
        # Tokens that do not decode or exceed uint32 (R-BAD-3): undo the blocks of
        # this event already attached through known hashes, so the event is all or
        # nothing.
        for h in hashes[:upto]:
            node = wg.map.get(h)
            if node is not None:
                self._remove_one(tree, wg, w, tid, h, node)

    @staticmethod
    def _event_keys(ev, block_size: int, n: int):
        try:
            buf = token_bytes(ev.token_ids)
        except (msgspec.DecodeError, OverflowError, TypeError, ValueError):
            return None
        lora = ev.lora_name
        extra = ev.extra_keys
        seed = KEY_SEED if (not lora and not extra) else seeds_for_blocks(n, lora, extra)
        return block_keys(buf, block_size, seed)

    def _on_placeholder(self, w: _Worker, ev, tid: int, group: int) -> str:
        """R-APP-6: residency on nodes the worker already maps by hash; never a new node."""
        wg = w.groups.get(group)
        if wg is None:
            return "placeholder_ignored"
        if tid != GPU:
            self._models[w.model].tiered = True
        wmap = wg.map
        bit = w.bit
        hit = 0
        new = 0
        for h in ev.block_hashes:
            node = wmap.get(h)
            if node is None or node.parent is DEAD:
                continue
            hit += 1
            if tid == GPU:
                if node.gpu & bit:
                    dup_add(node, (w.wid << 5) | tid)
                else:
                    node.gpu |= bit
                    new += 1
            else:
                tiers = node.tiers
                if tiers is None:
                    tiers = node.tiers = {}
                m = tiers.get(tid, 0)
                if m & bit:
                    dup_add(node, (w.wid << 5) | tid)
                else:
                    tiers[tid] = m | bit
                    new += 1
                # A placeholder names a chunk by its tail only. Taken as a chunk of
                # one block it is credited only where the engine would load it too
                # (the GPU prefix reaches the block before it): never over-credit.
                if not tiers.get(-tid, 0) & bit:
                    wg.mark_end(tiers, tid, bit, node, 1)
        wg.res[tid] += new
        if hit == 0:
            return "placeholder_ignored"
        return "placeholder_attached" if hit == len(ev.block_hashes) else "placeholder_partial"

    # ---------------------------------------------------------------- orphans

    def _orphan(self, wg: _WG, parent_hash, ev, tid: int) -> str:
        """R-APP-3: buffer a store whose parent is unknown, keyed by that parent."""
        entry = (ev, tid)
        lst = wg.orphans.get(parent_hash)
        if lst is None:
            wg.orphans[parent_hash] = [entry]
        else:
            lst.append(entry)
        self._orphans += 1
        self._orphan_queue.append((self._clock(), wg, parent_hash, entry))
        while self._orphans > self.max_orphans:
            self._drop_oldest_orphan("orphan_overflow")
        return "orphaned"

    def _adopt(self, tree: Tree, wg: _WG, w: _Worker, hashes) -> None:
        """Attach buffered children of the hashes just stored, then theirs (iterative)."""
        stack = list(hashes)
        orphans = wg.orphans
        while stack and orphans:
            h = stack.pop()
            lst = orphans.pop(h, None)
            if not lst:
                continue
            parent = wg.map.get(h)
            for ev, tid in lst:
                self._orphans -= 1
                if parent is None or parent.parent is DEAD:
                    self._count("orphans_dropped_parent_gone")
                    continue
                outcome = self._insert(tree, wg, w, tid, parent, ev)
                self._count("orphans_adopted" if outcome.startswith("applied") else "orphans_dropped_bad")
                stack.extend(ev.block_hashes)

    def _drop_oldest_orphan(self, reason: str) -> None:
        _, wg, ph, entry = self._orphan_queue.popleft()
        lst = wg.orphans.get(ph)
        if lst is None:
            return  # adopted or dropped with its worker already
        for i, e in enumerate(lst):
            if e is entry:
                del lst[i]
                if not lst:
                    del wg.orphans[ph]
                self._orphans -= 1
                self._count(reason)
                return

    def _expire_orphans(self) -> None:
        q = self._orphan_queue
        limit = self._clock() - self.orphan_ttl_s
        while q and q[0][0] < limit:
            self._drop_oldest_orphan("orphan_expired")
        if not self._orphans:
            q.clear()

    # --------------------------------------------------------------- removals

    def _on_remove(self, w: _Worker, ev) -> str:
        loc = ev.locality
        if loc is not None and loc.upper() == "REMOTE":
            return "remote_ignored"  # R-APP-11
        tid = self._tier(ev.medium, ev.ownership)
        if tid < 0:
            return "tier_limit"
        group = self._group(ev)
        wg = w.groups.get(group) if group >= 0 else None
        if wg is None:
            return "unknown_hash"
        tree = self._models[w.model].trees.get(group)
        wmap = wg.map
        if tid == GPU and remove_gpu is not None and tree.stamps is None:
            # The compiled loop: _remove_one and Tree.free_up for the GPU tier.
            cleared, unknown, freed = remove_gpu(wmap, tree.root, ev.block_hashes, w.bit, w.wid << 5)
            wg.res[GPU] -= cleared
            tree.nodes -= freed
        else:
            unknown = 0
            for h in ev.block_hashes:
                node = wmap.get(h)
                if node is None:
                    unknown += 1
                elif not self._remove_one(tree, wg, w, tid, h, node):
                    unknown += 1
        if unknown:
            self._count("removed_unknown_blocks", unknown)
            return "unknown_hash" if unknown == len(ev.block_hashes) else "applied_partial"
        return "applied"

    def _remove_one(self, tree: Tree, wg: _WG, w: _Worker, tid: int, h, node: Node) -> bool:
        """Subtract one announcement of ``h`` in tier ``tid`` (R-APP-4); False if not held."""
        if node.parent is DEAD:
            del wg.map[h]
            return False
        bit = w.bit
        if tid == GPU:
            m = node.gpu
            if not m & bit:
                return False
        else:
            tiers = node.tiers
            m = tiers.get(tid, 0) if tiers is not None else 0
            if not m & bit:
                return False
        d = node.dup
        if d is not None:
            k = (w.wid << 5) | tid
            c = d.get(k)
            if c:
                if c == 1:
                    del d[k]
                    if not d:
                        node.dup = None
                else:
                    d[k] = c - 1
                return True
        if tid == GPU:
            node.gpu = m ^ bit
        else:
            m ^= bit
            if m:
                tiers[tid] = m
            else:
                del tiers[tid]
            wg.clear_end(tiers, tid, bit, node)
            if not tiers:
                node.tiers = None
        wg.res[tid] -= 1
        if not self._holds(node, bit):
            del wg.map[h]
            tree.free_up(node)
        return True

    @staticmethod
    def _holds(node: Node, bit: int) -> bool:
        if node.gpu & bit:
            return True
        tiers = node.tiers
        if tiers is not None:
            for t, m in tiers.items():
                if t > 0 and m & bit:
                    return True
        return False

    def _on_clear(self, w: _Worker) -> str:
        """R-APP-8: drop the worker's GPU and CPU residency; other tiers stay."""
        tids = [GPU]
        cpu = self._tier_ids.get("CPU")
        if cpu is not None:
            tids.append(cpu)
        self._drop_worker_tiers(w, tids)
        return "applied"

    def _drop_worker_tiers(self, w: _Worker, tids: Iterable[int] | None) -> None:
        """Remove every residency of ``w`` in ``tids`` (all tiers when None)."""
        m = self._models[w.model]
        bit = w.bit
        wid = w.wid
        only = None if tids is None else set(tids)
        for group, wg in list(w.groups.items()):
            tree = m.trees.get(group)
            for h, node in list(wg.map.items()):
                if node.parent is DEAD:
                    del wg.map[h]
                    continue
                self._clear_node(node, bit, wid, only, wg)
                if not self._holds(node, bit):
                    del wg.map[h]
                    if tree is not None:
                        tree.free_up(node)
            if tids is None:
                # Orphans of a dropped worker go with it.
                self._orphans -= sum(len(v) for v in wg.orphans.values())
                wg.orphans.clear()

    def _clear_node(self, node: Node, bit: int, wid: int, only: set | None, wg: _WG) -> None:
        res = wg.res
        if (only is None or GPU in only) and node.gpu & bit:
            node.gpu ^= bit
            res[GPU] -= 1
        tiers = node.tiers
        if tiers is not None:
            for t in [t for t in tiers if t > 0 and (only is None or t in only)]:
                m = tiers[t]
                if m & bit:
                    m ^= bit
                    res[t] -= 1
                    if m:
                        tiers[t] = m
                    else:
                        del tiers[t]
                    wg.clear_end(tiers, t, bit, node)
            if not tiers:
                node.tiers = None
        d = node.dup
        if d is not None:
            for k in [k for k in d if k >> 5 == wid and (only is None or (k & 31) in only)]:
                del d[k]
            if not d:
                node.dup = None

    def _cap(self, m: _Model, tree: Tree) -> None:
        """R-APP-9 node cap: evict least recently stored leaves with all their residency."""
        evicted = 0
        while tree.nodes > self.max_nodes:
            node = tree.oldest_leaf()
            if node is None:
                break
            held = node.gpu
            tiers = node.tiers
            if tiers:
                for t, mask in tiers.items():
                    if t > 0:
                        held |= mask
            for w in m.workers.values():
                if held & w.bit:
                    wg = w.groups.get(tree.group)
                    if wg is not None:
                        self._clear_node(node, w.bit, w.wid, None, wg)
            node.gpu = 0
            node.tiers = None
            tree.free_up(node)
            evicted += 1
        if evicted:
            self._count("cap_evicted_nodes", evicted)

    # -------------------------------------------------------------- lifecycle

    def _worker(self, engine: str, rank: int, model: str) -> _Worker:
        w = self._workers.get((engine, rank))
        if w is not None:
            if w.model == model:
                return w
            # The engine moved to another model pool: its old state is meaningless.
            self._remove_worker(w)
        if self._free_wids:
            wid = self._free_wids.pop()
        else:
            wid = self._next_wid
            self._next_wid += 1
        mo = self._models.get(model)
        if mo is None:
            mo = self._models[model] = _Model(model)
        w = _Worker(wid, engine, rank, model, mo.rows)
        self._workers[(engine, rank)] = w
        mo.workers[wid] = w
        mo.ranked = False
        return w

    def _remove_worker(self, w: _Worker) -> None:
        self._drop_worker_tiers(w, None)
        del self._workers[(w.engine, w.dp_rank)]
        self._models[w.model].workers.pop(w.wid, None)
        w.rows[w.wid] = None
        self._free_wids.append(w.wid)

    def _restart(self, w: _Worker) -> None:
        self._drop_worker_tiers(w, None)
        w.restarts += 1
        w.last_seq = None
        w.refresh()
        self._count("restarts")

    def drop_worker(self, engine: str, dp_rank: int = 0) -> bool:
        """Forget one worker and all its residency. Returns False when unknown."""
        with self._lock:
            w = self._workers.get((engine, dp_rank))
            if w is None:
                return False
            self._remove_worker(w)
            return True

    def drop_engine(self, engine: str) -> int:
        """Forget every DP rank of ``engine``; returns how many workers went."""
        with self._lock:
            ws = [w for (e, _), w in self._workers.items() if e == engine]
            for w in ws:
                self._remove_worker(w)
            return len(ws)

    def reset_worker(self, engine: str, dp_rank: int = 0) -> bool:
        """Drop one worker's residency but keep it known (an engine restart)."""
        with self._lock:
            w = self._workers.get((engine, dp_rank))
            if w is None:
                return False
            self._restart(w)
            return True

    def register_worker(self, engine: str, dp_rank: int = 0, *, model: str = "default") -> None:
        """Make a worker known before its first event (so freshness can report it)."""
        with self._lock:
            self._worker(engine, dp_rank, model)

    def mark_stale(self, engine: str, dp_rank: int = 0, reason: str = "stale") -> None:
        """Mark a worker stale with ``reason``; its index is kept and answers say so."""
        with self._lock:
            w = self._workers.get((engine, dp_rank))
            if w is not None:
                if not w.stale:
                    self._count("stale_marked")
                w.stale = True
                w.stale_reason = reason
                w.refresh()

    def clear_stale(self, engine: str, dp_rank: int = 0) -> None:
        """Clear a worker's stale mark (after a successful recovery)."""
        with self._lock:
            w = self._workers.get((engine, dp_rank))
            if w is not None and w.stale:
                w.stale = False
                w.stale_reason = None
                w.refresh()
                self._count("stale_cleared")

    def workers(self) -> list[dict]:
        """Per-worker freshness and sizes, sorted by engine then rank."""
        with self._lock:
            now = self._clock()
            out = []
            for (engine, rank), w in sorted(self._workers.items()):
                res: dict[str, int] = {}
                for wg in w.groups.values():
                    for tid, c in enumerate(wg.res):
                        if c:
                            name = self._tier_names[tid]
                            res[name] = res.get(name, 0) + c
                out.append({
                    "engine": engine,
                    "dp_rank": rank,
                    "model": w.model,
                    "stale": w.stale,
                    "stale_reason": w.stale_reason,
                    "last_seq": w.last_seq,
                    "last_event_age_s": None if w.last_apply is None else round(now - w.last_apply, 6),
                    "batches": w.batches,
                    "gaps": w.gaps,
                    "restarts": w.restarts,
                    "dropped": dict(w.dropped),
                    "resident_blocks": res,
                    "orphans": sum(len(v) for wg in w.groups.values() for v in wg.orphans.values()),
                })
            return out

    def model_workers(self, model: str | None = "default") -> list[tuple[str, int, bool]]:
        """``(engine, dp_rank, stale)`` of every worker of ``model``, in no particular order
        (cheap: no sizes, no sort; ``indexer.route`` ranks them itself).

        Raises KeyError like :meth:`match` when the model is unknown."""
        with self._lock:
            m = self._model(model)
            return [(w.engine, w.dp_rank, w.stale) for w in m.workers.values()]

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def block_size(self, model: str = "default") -> int | None:
        """Block size of the model's headline group (None before its first rich store)."""
        with self._lock:
            m = self._models.get(model)
            if m is None or not m.trees:
                return None
            return m.trees[m.default_groups()[0]].block_size

    # ------------------------------------------------------------------ query

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
        :func:`indexer.keys.split_json_tokens` reads them from a request). Keys are computed
        for every full block at each group's block size; a trailing partial block
        is ignored. Read-only (R-Q-4).

        Raises
        ------
        KeyError
            When ``model`` is not indexed (or is None while several models are).
        OverflowError, TypeError
            When a token id is not an int in ``[0, 2**32-1]``.
        """
        buf = token_ids if token_ids.__class__ is bytes else tokens_to_bytes(token_ids)
        ntok = len(buf) // 4
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            m = self._model(model)
            cache: dict[int, _LazyKeys] = {}

            def keys_for(bs: int):
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

            return self._match(m, keys_for, ntok)

    def route(self, token_ids: Sequence[int], *, model: str | None = "default", lora_name: str | None = None,
              cache_salt: str | None = None, load=None, candidates=None, prefill_load_scale: float = 1.0) -> dict:
        """The best worker for a prompt: :meth:`match` weighed against ``load``
        (:func:`indexer.route.route`; the ``POST /v1/route`` body). Read-only."""
        res = self.match(token_ids, model=model, lora_name=lora_name, cache_salt=cache_salt)
        return route(res, self.model_workers(res.model), load=load, candidates=candidates,
                     prefill_load_scale=prefill_load_scale)

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

            def keys_for(b: int):
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
            names = ", ".join(sorted(m.name for m in live))
            raise ModelRequiredError(f"model is required: several models are indexed ({names})")
        m = self._models.get(model)
        if m is None:
            raise KeyError(f"unknown model {model!r}")
        return m

    def _match(self, m: _Model, keys_for, ntok: int) -> MatchResult:
        trees = m.trees
        if not trees:
            return MatchResult(m.name, None, 0, [], None)
        if len(trees) == 1 and not m.tiered:
            # The common shape: one attention group, GPU only. Its one group is the
            # headline (R-APP-10); the walk's stops are the whole answer.
            (g, tree), = trees.items()
            bs = tree.block_size
            d, stops, active, _ = walk(tree.root, keys_for(bs), False)
            if d and active > 0:
                stops.append((d, active))
            if not m.ranked:
                m.rank()
            out = gpu_answers(stops, m.rows, str(g), bs, self._credit_by_tid()[GPU], self.stale_factor,
                              self._clock(), WorkerMatch) if stops else []
            best = out[0] if out and out[0][1] < 0 else None
            return tuple.__new__(MatchResult, (m.name, bs, ntok // bs, out, best))
        defaults = m.default_groups()
        head_bs = trees[defaults[0]].block_size
        # group -> {wid: (((tier name, blocks), ...), total blocks, weighted blocks)}
        per_group: dict[int, dict] = {}
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
        out = []
        append = out.append
        # tuple.__new__ skips NamedTuple's Python-level __new__ (one call per worker per query).
        tnew = tuple.__new__
        wm = WorkerMatch
        if len(per_group) == 1 and len(defaults) == 1 and defaults[0] in per_group:
            # The common shape: one attention group. Headline = that group.
            (g, got), = per_group.items()
            gname = str(g)
            shared: dict[int, tuple] = {}  # answers are shared by workers at one depth
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
            return tuple.__new__(MatchResult, (m.name, head_bs, qblocks, out, best))
        head = self._headline(m, defaults, per_group, head_bs)
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

    def _headline(self, m: _Model, defaults: list, per_group: dict, head_bs: int) -> dict:
        """R-APP-10 headline per worker: each figure is its minimum over the default groups.

        Figures are compared in tokens and given in blocks of the headline size:
        {wid: (((tier, blocks), ...), total blocks, weighted blocks)}.
        """
        head: dict = {}
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

    def _match_path(self, m: _Model, tree: Tree, key_chunks) -> dict | None:
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
        if not keep or all(nd.tiers is None for nd in path):
            if not stops:
                return None
            # Workers that stop at one depth share one answer tuple.
            out = {}
            for g, mask in stops:
                r = ((("GPU", g),), g, g * cg)
                for wid in _bits(mask):
                    out[wid] = r
            return out
        gpu = {wid: g for g, mask in stops for wid in _bits(mask)}
        names = self._tier_names
        other = self._other_tiers(m, tree.group, path)
        out: dict[int, tuple] = {}
        chain = [self._tier_ids.get(t) for t in self.total_chain]
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

    def _credit_by_tid(self) -> list:
        c = self._credits_cache
        if len(c) != len(self._tier_names):
            c = self._credits_cache = [self.credits.get(n, 0.0) for n in self._tier_names]
        return c

    def _other_tiers(self, m: _Model, group: int, path: list) -> dict:
        """Fully covered chunks per non-GPU tier and worker: {tid: {wid: [(start, end)]}}.

        A chunk ends at a block marked as a chunk end for the worker (R-APP-5); it
        starts as many blocks earlier as its store event carried, and counts only
        when the worker holds every one of its blocks in that tier.
        """
        workers = m.workers
        out: dict[int, dict] = {}
        runs: dict[tuple, int] = {}  # (tid, wid) -> start depth of the current unbroken run
        lasts: dict[tuple, int] = {}
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

    # ------------------------------------------------------------------ stats

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _drop(self, engine: str, model: str, dp_rank: int | None, reason: str) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        w = self._workers.get((engine, dp_rank or 0))
        if w is not None:
            w.dropped[reason] = w.dropped.get(reason, 0) + 1

    def counter(self, name: str) -> int:
        """One counter of ``stats()["counters"]`` (e.g. ``"batches_applied"``), cheaply:
        no lock and no copy, for pollers that must not slow ingest down."""
        return self._counters.get(name, 0)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one of ``stats()["counters"]`` (for the transport's own events)."""
        with self._lock:
            self._count(name, n)

    def count_dropped(self, engine: str, dp_rank: int | None, reason: str) -> None:
        """Count a message the transport dropped before decoding (R-DEC-3)."""
        with self._lock:
            self._drop(engine, "", dp_rank, reason)

    def stats(self) -> dict:
        """Sizes and counters, JSON-able; reads counters only (no tree walk)."""
        with self._lock:
            names = self._tier_names
            models = {}
            tot_nodes = tot_entries = tot_orphans = 0
            for name, m in sorted(self._models.items()):
                groups = {}
                m_entries = m_orphans = 0
                for g, tree in sorted(m.trees.items()):
                    groups[str(g)] = {
                        "kind": m.kinds.get(g),
                        "block_size": tree.block_size,
                        "default": m.kinds.get(g) in DEFAULT_GROUP_KINDS,
                        "nodes": tree.nodes,
                        "tiers": {},
                    }
                for w in m.workers.values():
                    for g, wg in w.groups.items():
                        gd = groups.setdefault(
                            str(g), {"kind": None, "block_size": None, "default": True, "nodes": 0, "tiers": {}}
                        )
                        o = sum(len(v) for v in wg.orphans.values())
                        m_orphans += o
                        for tid, c in enumerate(wg.res):
                            if c:
                                gd["tiers"][names[tid]] = gd["tiers"].get(names[tid], 0) + c
                                m_entries += c
                nodes = sum(t.nodes for t in m.trees.values())
                tiers: dict[str, int] = {}
                for gd in groups.values():
                    for t, c in gd["tiers"].items():
                        tiers[t] = tiers.get(t, 0) + c
                models[name] = {
                    "nodes": nodes,
                    "resident_entries": m_entries,
                    "orphans": m_orphans,
                    "workers": len(m.workers),
                    "tiers": tiers,
                    "groups": groups,
                }
                tot_nodes += nodes
                tot_entries += m_entries
                tot_orphans += m_orphans
            events = {
                name: dict(sorted(c.items()))
                for name, c in zip(_EVENT_NAMES + ("unknown",), self._events)
                if c
            }
            return {
                "nodes": tot_nodes,
                "resident_entries": tot_entries,
                "orphans": tot_orphans,
                "workers": len(self._workers),
                "stale_workers": sum(1 for w in self._workers.values() if w.stale),
                "models": models,
                "events": events,
                "dropped_payloads": dict(sorted(self._dropped.items())),
                "counters": dict(sorted(self._counters.items())),
                "tiers": list(names),
            }


_EMPTY: dict = {}


class _LazyKeys:
    """A query's block keys, hashed in growing chunks (64, 512, 4096 blocks) as the
    walk asks for them: a prompt that misses early hashes a few blocks, not all
    (64 blocks hash in ~1 us in the compiled core: one chunk for a 1,024-token prompt).
    Computed chunks are kept for the next group with the same block size."""

    __slots__ = ("buf", "block_size", "seed", "n", "done", "i")

    def __init__(self, buf: bytes, block_size: int, seed, n: int) -> None:
        self.buf = buf
        self.block_size = block_size
        self.seed = seed
        self.n = n
        self.done: list[list[int]] = []
        self.i = 0

    def chunks(self):
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


