"""Applying a batch (contract §4): decoded (or scanned by the compiled core), sequenced,
and each event handed to what it takes: a store to :mod:`.place` (blocks, placeholders,
orphans) or, for a sliding-window group, held to the end of its batch (R-APP-12); a
removal or clear to :mod:`.removal`. With those two the only writer of the trees;
called under the index lock."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from indexer.sequence.sequencer import DUPLICATE, GAP, RESTART, classify
from indexer.store.place import Placement
from indexer.store.state import GPU, WINDOW_KIND, ModelState, WorkerGroup, WorkerState
from indexer.store.tree import DEAD, Node, Tree, dup_add, insert_gpu_raw, walk
from indexer.wire.decode import (
    CLEARED,
    REMOVED,
    STORED,
    DecodeError,
    decode_batch,
    decode_event,
    raw_array_len,
    scan_gpu_batch,
)
from indexer.wire.keys import KEY_SEED

if TYPE_CHECKING:
    from indexer.wire.decode import StoredEvent

__all__ = ["Store"]


# What _on_store returns for a store held to the end of its batch (not counted yet).
DEFERRED = "deferred"


def _mirror(tree: Tree, twin: Node) -> Node:
    """The node of ``tree`` on the same key path as ``twin`` (a node of another group's
    tree), made with its missing ancestors: they hold nothing, and go when their last
    held descendant does (R-APP-9)."""
    keys = []
    n = twin
    while n.parent is not None:
        keys.append(n.key)
        n = n.parent
    node = tree.root
    for k in reversed(keys):
        c = tree.child(node, k)
        node = c if c is not None else tree.add_child(node, k)
    return node


def _note_window(m: ModelState, group: int, ev: StoredEvent) -> None:
    """Remember a sliding-window group's window: its hit rule caps the headline (R-APP-10)."""
    win = ev.kv_cache_spec_sliding_window
    kind = ev.kv_cache_spec_kind
    if win.__class__ is int and win > 0 and kind.__class__ is str and kind.startswith(WINDOW_KIND):
        m.windows[group] = win


class Store(Placement):
    """Decode-and-apply of one batch, stores and orphans."""

    # The compiled one-pass reader of plain GPU batches, or None (then every batch takes
    # the typed decoder): a replay of a hashed recording keys stores its own way.
    _scan_gpu: Any = staticmethod(scan_gpu_batch) if scan_gpu_batch is not None else None

    def _apply(self, engine: str, payload: bytes, model: str, dp_rank: int | None, seq: int | None,
               decide: bool) -> tuple[str, float | None]:
        # The common batch (plain GPU stores only) is read in one pass by the compiled
        # core; anything else, or no core, goes through the typed decoder.
        scan = self._scan_gpu
        scanned = scan(payload) if scan is not None else None
        if scanned is not None:
            ts, brank, stores = scanned
            batch = None
        else:
            try:
                batch = decode_batch(payload)
            except DecodeError as e:
                return self._bad_batch(engine, model, dp_rank, seq, e.reason)
            ts, brank = batch.ts, batch.dp_rank
        rank = brank if brank is not None else (dp_rank or 0)
        if rank.__class__ is not int or rank < 0 or rank > self.max_dp_rank:
            return self._bad_batch(engine, model, dp_rank, seq, "bad_dp_rank")
        w = self._worker(engine, rank, model)
        if seq is not None:
            last = w.last_seq
            if decide:
                verdict = classify(last, w.last_ts, seq, ts)
                if verdict == GAP:
                    w.gaps += 1
                    self._count("sequence_gaps")
                elif verdict == DUPLICATE:
                    self._count("batches_duplicate")
                    return "duplicate", None
                elif verdict == RESTART:
                    self._restart(w)
            elif (seq > last + 1) if last is not None else seq > 0:
                # A Stream decided already (no call to classify on the live hot path);
                # a gap it accepted still counts as one that reached the index.
                w.gaps += 1
                self._count("sequence_gaps")
            w.last_seq = seq
        if batch is not None and batch.issues:
            unknown = self._events[3]
            for k, v in batch.issues.items():
                unknown[k] = unknown.get(k, 0) + v
        if self._orphans:
            # Expire first: an orphan past its age bound is not adopted by this batch.
            self._expire_orphans()
        ev_counts = self._events
        # A sliding-window store whose full-attention twins are not there yet is held to
        # the end of the batch (R-APP-12: vLLM lists that group's store of a step first),
        # and so is every later event of a window group, to keep their order.
        later = self._later
        if later:
            later.clear()  # left by a batch an exception cut short: never another batch's
        if batch is None:
            c = ev_counts[STORED]
            on_store = self._on_scanned_store
            for st in stores:
                if later and (st[4] or 0) in self._models[w.model].window_groups:
                    later.append(decode_event(payload[st[6]:st[7]]))
                    continue
                outcome = on_store(w, st, payload)
                c[outcome] = c.get(outcome, 0) + 1
            if later:
                c.pop(DEFERRED, None)  # counted when applied, at the end
        else:
            for ev in batch.events:
                kind = ev.kind
                if later and kind != CLEARED and (ev.group_idx or 0) in self._models[w.model].window_groups:
                    later.append(ev)
                    continue
                if kind == STORED:
                    outcome = self._on_store(w, ev)
                elif kind == REMOVED:
                    outcome = self._on_remove(w, ev)
                else:
                    outcome = self._on_clear(w)
                c = ev_counts[kind]
                c[outcome] = c.get(outcome, 0) + 1
            if later:
                ev_counts[STORED].pop(DEFERRED, None)  # counted when applied, at the end
        if later:
            self._apply_later(w)
        w.last_ts = ts
        w.last_apply = self._clock()
        w.refresh()
        w.batches += 1
        self._count("batches_applied")
        if self.inflight.pending:
            self._check_announced(w)
        return "applied", ts

    def _check_announced(self, w: WorkerState) -> None:
        """End the prefill of ``w``'s routed requests whose prompts it now holds on GPU."""
        key = (w.engine, w.dp_rank)
        if key not in self.inflight.pending:
            return
        resident = self._resident_on(w)
        if resident is not None:
            self.inflight.check_announced(key, resident)

    def _resident_on(self, w: WorkerState) -> Callable[[Sequence[int]], bool] | None:
        """A test of whether ``w`` holds every one of some block keys on GPU (the headline
        group's, as a routed prompt's are), or None while its model has no tree."""
        m = self._models[w.model]
        if not m.trees:
            return None
        root = m.trees[m.default_groups()[0]].root
        bit = w.bit

        def resident(keys: Sequence[int]) -> bool:
            d, _, active, _ = walk(root, (keys,), False)
            return d == len(keys) and bool(active & bit)

        return resident

    def _bad_batch(self, engine: str, model: str, dp_rank: int | None, seq: int | None,
                   reason: str) -> tuple[str, None]:
        """Count a batch dropped whole; its seq was used all the same (no gap after it)."""
        self._drop(engine, model, dp_rank, reason)
        w = self._workers.get((engine, dp_rank or 0))
        if w is not None and seq is not None and (w.last_seq is None or seq > w.last_seq):
            w.last_seq = seq  # the sequence number was used, by a bad batch
            w.refresh()
        return "dropped", None

    def _on_scanned_store(self, w: WorkerState, st: tuple[Any, ...], payload: bytes) -> str:
        """A plain GPU store read by ``scan_gpu_batch``: :meth:`_on_store` and
        :meth:`_insert` for a known, uncapped tree and a parent the worker maps (or none),
        with no Python object per block; blocks it holds already count as duplicates in
        the compiled loop, as in the general one (R-APP-2). Any other case, and before
        anything changes, decodes the event as the typed decoder does and takes
        :meth:`_on_store`: the same outcome and state either way."""
        hashes, ph, tokens, bs, g, kind, start, end = st
        if g is not None and (g < 0 or g >= self.max_groups):
            return "bad_group"
        group = 0 if g is None else g
        m = self._models[w.model]
        if m.window_groups and group in m.window_groups:
            return self._on_store(w, decode_event(payload[start:end]))  # R-APP-12: never the raw insert
        tree = m.trees.get(group)
        wg = w.groups.get(group)
        parent: Node | None = None
        if tree is not None and tree.stamps is None and tree.block_size == bs:  # GPU: a tier always in use
            wmap = wg.map if wg is not None else None
            if ph is None:
                parent = tree.root
            elif wmap is not None:
                parent = wmap.get(ph)
                if parent is not None and parent.parent is DEAD:
                    parent = None
        if parent is None:
            return self._on_store(w, decode_event(payload[start:end]))
        if kind is not None and m.kinds.get(group) is None:
            m.set_kind(group, kind)
        if wg is None:
            wg = w.groups[group] = WorkerGroup()
        n = len(hashes) >> 3
        _, created, new = insert_gpu_raw(wg.map, parent, hashes, tokens, bs, KEY_SEED, w.bit, w.wid << 5)
        tree.nodes += created  # type: ignore[union-attr]  # checked above
        wg.res[GPU] += new
        outcome = "applied" if new == n else "applied_with_duplicates"
        if wg.orphans:
            self._adopt(tree, wg, w, struct.unpack(f"<{n}Q", hashes))  # type: ignore[arg-type]  # checked above
        return outcome

    def _on_store(self, w: WorkerState, ev: StoredEvent) -> str:
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
            kind = ev.kv_cache_spec_kind
            if (tid == GPU and n and ntok > n * bs and ntok % bs == 0
                    and kind.__class__ is str and kind.startswith(WINDOW_KIND)):
                return self._on_window_store(w, ev, group)  # R-APP-12
            return "shape_mismatch"  # R-APP-1 (a Mamba store skipping null blocks, say)
        m = self._models[w.model]
        tree = m.trees.get(group)
        if tree is None:
            # A group's first store fixes its block size and makes it a (headline) group:
            # only once it is known to apply (its tokens read), never for a bad one.
            if self._event_keys(ev, bs, n) is None:
                return "bad_tokens"
            tree = m.trees[group] = Tree(group, bs, self.max_nodes is not None)
            m.set_kind(group, ev.kv_cache_spec_kind)
        elif tree.block_size != bs:
            w.dropped["block_size_mismatch"] = w.dropped.get("block_size_mismatch", 0) + 1
            return "block_size_mismatch"  # R-APP-7
        elif m.kinds.get(group) is None and ev.kv_cache_spec_kind is not None:
            m.set_kind(group, ev.kv_cache_spec_kind)
        if ev.kv_cache_spec_sliding_window is not None:
            _note_window(m, group, ev)
        wg = w.groups.get(group)
        if wg is None:
            wg = w.groups[group] = WorkerGroup()
        ph = ev.parent_block_hash
        parent: Node | None
        if ph is None:
            parent = tree.root
        else:
            parent = wg.map.get(ph)
            if parent is None or parent.parent is DEAD:
                return self._orphan(wg, ph, ev, tid)
        outcome = self._insert(tree, wg, w, tid, parent, ev)
        if wg.orphans and outcome.startswith("applied"):
            self._adopt(tree, wg, w, hashes)
        if tree.stamps is not None and tree.nodes > self.max_nodes:  # type: ignore[operator]  # capped: an int
            self._cap(m, tree)
        return outcome

    def _apply_later(self, w: WorkerState) -> None:
        """Apply the window events held to the end of the batch, in their order."""
        items = self._later[:]
        self._later.clear()
        self._first_pass = False
        try:
            ev_counts = self._events
            for ev in items:
                outcome = self._on_store(w, ev) if ev.kind == STORED else self._on_remove(w, ev)
                c = ev_counts[ev.kind]
                c[outcome] = c.get(outcome, 0) + 1
        finally:
            self._first_pass = True

    def _on_window_store(self, w: WorkerState, ev: StoredEvent, group: int) -> str:
        """R-APP-12: a sliding-window group's GPU store that leaves out its null blocks.

        vLLM lists only the blocks inside the window (``block_hashes``, the tail of the
        range) with the token ids of the whole range, and the parent hash of a block
        this group may never have held. Its block hashes are the full-attention group's
        for the same blocks (vLLM hashes tokens, not groups), so each block is placed
        on the path of its full-attention twin, mirrored into this group's tree; a block
        whose twin the worker does not map (evicted already) is left out."""
        m = self._models[w.model]
        bs = ev.block_size
        tree = m.trees.get(group)
        if tree is not None and tree.block_size != bs:
            w.dropped["block_size_mismatch"] = w.dropped.get("block_size_mismatch", 0) + 1
            return "block_size_mismatch"  # R-APP-7
        if group not in m.window_groups:
            m.window_groups.add(group)  # its kind is set with its tree, once a block is placed
        twins = [w.groups[g].map for g in m.default_groups() if g != group and g in w.groups]
        if self._first_pass and not all(any((n := t.get(h)) is not None and n.parent is not DEAD for t in twins)
                                        for h in ev.block_hashes):
            self._later.append(ev)  # its twins may come later in this batch
            return DEFERRED
        wg = w.groups.get(group)
        wmap: Any = wg.map if wg is not None else {}
        bit = w.bit
        placed = new = 0
        for h in ev.block_hashes:
            node = wmap.get(h)
            if node is None or node.parent is DEAD:
                node = None
                for t in twins:
                    twin = t.get(h)
                    if twin is not None and twin.parent is not DEAD:
                        if tree is None:  # the group's first placed block makes its tree
                            tree = m.trees[group] = Tree(group, bs, self.max_nodes is not None)
                            m.set_kind(group, ev.kv_cache_spec_kind)
                        if wg is None:
                            wg = w.groups[group] = WorkerGroup()
                            wmap = wg.map
                        node = _mirror(tree, twin)
                        break
                if node is None:
                    continue
                wmap[h] = node
            assert tree is not None and wg is not None  # a mapped or mirrored node has both
            placed += 1
            if tree.stamps is not None:
                tree.touch(node)
            if node.gpu & bit:
                dup_add(node, (w.wid << 5) | GPU)
            else:
                node.gpu |= bit
                new += 1
        if placed == 0 or wg is None or tree is None:
            return "window_unplaced"
        wg.res[GPU] += new
        _note_window(m, group, ev)
        if tree.stamps is not None and tree.nodes > self.max_nodes:  # type: ignore[operator]  # capped: an int
            self._cap(m, tree)  # mirrored ancestors count too (R-APP-9)
        if placed < len(ev.block_hashes):
            return "window_partial"
        return "applied" if new == placed else "applied_with_duplicates"
