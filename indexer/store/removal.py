"""Removals and clears (R-APP-4, R-APP-8, R-APP-9): residency taken away, nodes that
nobody holds freed up the chain, and the node cap's evictions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from indexer.store.state import GPU, IndexState, ModelState, WorkerGroup, WorkerState
from indexer.store.tree import DEAD, Node, Tree, remove_gpu

if TYPE_CHECKING:
    from indexer.wire.decode import RemovedEvent
    from indexer.wire.events import Hash

__all__ = ["Removal"]


class Removal(IndexState):
    """What takes residency away."""

    def _on_remove(self, w: WorkerState, ev: RemovedEvent) -> str:
        loc = ev.locality
        if loc is not None and loc.upper() == "REMOTE":
            return "remote_ignored"  # R-APP-11
        tid = self._tier(ev.medium, ev.ownership, False)
        if tid < 0:
            return "unknown_hash"  # a tier nothing was ever stored to (or no tier at all)
        group = self._group(ev)
        wg = w.groups.get(group) if group >= 0 else None
        if wg is None:
            return "unknown_hash"
        tree: Tree = self._models[w.model].trees.get(group)  # type: ignore[assignment]  # wg exists: so does its tree
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
                if node is None or not self._remove_one(tree, wg, w, tid, h, node):
                    unknown += 1
        if unknown:
            self._count("removed_unknown_blocks", unknown)
            return "unknown_hash" if unknown == len(ev.block_hashes) else "applied_partial"
        return "applied"

    def _remove_one(self, tree: Tree, wg: WorkerGroup, w: WorkerState, tid: int, h: Hash, node: Node) -> bool:
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
            # None only when m is 0, which returns just below.
            tiers: dict[int, int] = node.tiers  # type: ignore[assignment]
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

    def _on_clear(self, w: WorkerState) -> str:
        """R-APP-8: drop the worker's GPU and CPU residency; other tiers stay."""
        tids = [GPU]
        cpu = self._tier_ids.get("CPU")
        if cpu is not None:
            tids.append(cpu)
        self._drop_worker_tiers(w, tids)
        return "applied"

    def _drop_worker_tiers(self, w: WorkerState, tids: Iterable[int] | None) -> None:
        """Remove every residency of ``w`` in ``tids`` (all tiers when None)."""
        m = self._models[w.model]
        bit = w.bit
        wid = w.wid
        only = None if tids is None else set(tids)
        if self.inflight.requests and (only is None or GPU in only):
            # Removed, restarted or cleared: what it was going to cache, and its queue, are gone.
            self.inflight.forget_worker((w.engine, w.dp_rank))
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

    def _clear_node(self, node: Node, bit: int, wid: int, only: set[int] | None, wg: WorkerGroup) -> None:
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

    def _cap(self, m: ModelState, tree: Tree) -> None:
        """R-APP-9 node cap: evict least recently stored leaves with all their residency."""
        evicted = 0
        while tree.nodes > self.max_nodes:  # type: ignore[operator]  # capped: an int
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
