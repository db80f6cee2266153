"""Blocks into a tree (contract §4): a rich store's blocks attached under their parent
with the worker's residency (R-APP-1, R-APP-2, R-APP-5), a placeholder's residency on
nodes the worker maps already (R-APP-6), and stores whose parent is not known yet
buffered as orphans until it comes (R-APP-3). :mod:`.apply` above decides which
event takes which; called under the index lock."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from indexer.store.lifecycle import Lifecycle
from indexer.store.state import GPU, WorkerGroup, WorkerState
from indexer.store.tree import DEAD, Node, Tree, dup_add, insert_gpu
from indexer.wire.decode import token_bytes
from indexer.wire.keys import KEY_SEED, block_keys, seeds_for_blocks

if TYPE_CHECKING:
    from indexer.wire.decode import StoredEvent
    from indexer.wire.events import Hash

__all__ = ["Placement"]


class Placement(Lifecycle):
    """Stores, placeholders and orphans placed in a worker's tree."""

    def _insert(self, tree: Tree, wg: WorkerGroup, w: WorkerState, tid: int, parent: Node, ev: StoredEvent) -> str:
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
            wg.mark_end(parent.tiers, tid, bit, parent, len(hashes))  # type: ignore[arg-type]  # set above
            self._models[w.model].tiered = True
        wg.res[tid] += new
        return "applied" if new == len(hashes) else "applied_with_duplicates"

    def _rollback(self, tree: Tree, wg: WorkerGroup, w: WorkerState, tid: int, hashes: list[Hash], upto: int) -> None:
        # Tokens that do not decode or exceed uint32 (R-BAD-3): undo the blocks of
        # this event already attached through known hashes, so the event is all or
        # nothing.
        for h in hashes[:upto]:
            node = wg.map.get(h)
            if node is not None:
                self._remove_one(tree, wg, w, tid, h, node)

    @staticmethod
    def _event_keys(ev: StoredEvent, block_size: int, n: int) -> list[int] | None:
        try:
            buf = token_bytes(ev.token_ids)
        except (msgspec.DecodeError, OverflowError, TypeError, ValueError):
            return None
        lora = ev.lora_name
        extra = ev.extra_keys
        seed = KEY_SEED if (not lora and not extra) else seeds_for_blocks(n, lora, extra)
        return block_keys(buf, block_size, seed)

    def _on_placeholder(self, w: WorkerState, ev: StoredEvent, tid: int, group: int) -> str:
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

    def _orphan(self, wg: WorkerGroup, parent_hash: Hash, ev: StoredEvent, tid: int) -> str:
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

    def _adopt(self, tree: Tree, wg: WorkerGroup, w: WorkerState, hashes: Iterable[Hash]) -> None:
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
