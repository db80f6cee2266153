"""One model's longest prefixes (contract §6): each KV-cache group's tree walked along a
prompt's block keys, and per worker the blocks held per tier, the engine-style
``total`` (R-Q-2), the weighted score (R-Q-3) and the headline over the default
groups (R-APP-10), capped for sliding-window groups (R-APP-12). Read-only: the
only state touched is the lazy ranking of a model's workers (``ModelState.rank``).
:class:`~.match.Query` above it takes the lock and makes the block keys."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from indexer.query.answers import MatchResult, WorkerMatch, _bits, gpu_answers
from indexer.store.lifecycle import Lifecycle
from indexer.store.state import GPU, ModelState
from indexer.store.tree import Tree, walk

if TYPE_CHECKING:
    from indexer.query.answers import TierItems
    from indexer.store.tree import Node

    # One group's answer for one worker: (((tier, blocks), ...), total blocks, weighted blocks).
    _Answer = tuple[TierItems, int, float]
    # A query's block keys at a block size, in chunks (see match._LazyKeys).
    KeysFor = Callable[[int], Iterable[Sequence[int]]]

__all__ = ["Prefixes", "tier_chunks"]


class Prefixes(Lifecycle):
    """The walk and the answers of one model (the caller holds the lock)."""

    def _gpu_only(self, m: ModelState, g: int, tree: Tree, key_chunks: Iterable[Sequence[int]],
                  ntok: int) -> MatchResult:
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

    def match_model(self, m: ModelState, keys_for: KeysFor, ntok: int) -> MatchResult:
        """:meth:`~indexer.query.match.Query.match`'s answer for model ``m`` (from
        :meth:`model_state`), the prompt's block keys at each block size from
        ``keys_for``, ``ntok`` tokens long; without predictions. The caller holds
        :attr:`lock`. Changes nothing the index holds (R-Q-4)."""
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
        self, m: ModelState, defaults: list[int], per_group: dict[int, dict[int, _Answer]], head_bs: int
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

    def _window_capped(self, m: ModelState, head: dict[int, _Answer], windows: list[tuple[int, Tree]],
                       keys_for: KeysFor, ntok: int) -> dict[int, _Answer]:
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

    def _match_path(self, m: ModelState, tree: Tree, key_chunks: Iterable[Sequence[int]]) -> dict[int, _Answer] | None:
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
        other = tier_chunks(m, tree.group, path)  # type: ignore[arg-type]  # a list when keep
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


def tier_chunks(m: ModelState, group: int, path: list[Node]) -> dict[int, dict[int, list[tuple[int, int]]]]:
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
