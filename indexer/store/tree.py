"""Prefix-tree nodes and per-(model, group) trees: the only mutable index state.

One :class:`Tree` per ``(model, KV-cache group)``. A :class:`Node` is one block,
keyed under its parent by its block key (position in the tree gives the prefix
context). Residency of every tier lives on the same node, so a CPU chunk attaches
to the node its GPU store created (R-APP-2).

Residency is stored as bit masks over worker ids (``wid``), one bit per worker:

* ``gpu``: workers holding the block in the GPU tier (the hot, common case).
* ``tiers``: ``None`` or ``{tid: mask}`` for the other tiers, plus chunk-end
  masks under ``-tid`` (R-APP-5: which workers stored this block as the last
  block of a chunk in that tier).
* ``dup``: ``None`` or ``{(wid << 5) | tid: extra}`` for reference counts above 1
  (R-APP-4); a count of 1 is just the bit.

``kids`` is ``None``, a single child :class:`Node`, or a :data:`Kids` map key ->
child: most nodes of a prefix tree have exactly one child.

Two implementations share this layout. The compiled core (``indexer/_native/*.c``)
keeps a node's key as a uint64 inside a 48-byte node (``tiers`` and ``dup``, rarely
set, in a 32-byte side block made while one of them is not ``None``) and its maps
(a worker's engine hash -> node, a node's key -> child) as tables of 16-byte slots,
with no Python object per key; its ``insert_gpu``, ``walk`` and ``remove_gpu`` run the hot
loops. The pure-Python twins below (a msgspec node, dicts, the same store and walk
loops; removals take ``PrefixIndex``'s general loop) are the fallback when the
module is not built and the reference the tests hold it to.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from indexer._native import COMPILED
from indexer._native import core as _core

__all__ = ["Node", "Tree", "DEAD", "MAX_TIERS", "Kids", "COMPILED", "dup_add", "insert_gpu", "insert_gpu_raw",
           "link_child", "remove_gpu", "walk"]

# Tier ids are packed into 5 bits of the ``dup`` keys.
MAX_TIERS = 32


class _PyNode(Struct, eq=False, gc=False):
    """One block (the pure-Python node; ``indexer._native._core.Node`` is its compiled twin).

    A msgspec Struct: its C-level constructor is ~2.5x faster than a ``__slots__``
    class with ``__init__``; ``eq=False`` keeps identity equality and hashing.
    ``gc=False`` leaves nodes out of the cycle collector: 16 bytes less per node
    and no collector passes over millions of nodes while an index grows (~15%
    of apply time). The parent <-> child cycles are broken by hand instead: when a
    node is freed (:meth:`Tree.free_up`) and when a tree goes (:meth:`Tree.clear`).
    """

    key: Any
    parent: Any
    kids: Any = None
    gpu: int = 0
    tiers: Any = None
    dup: Any = None


def dup_add(node: Node, dupkey: int) -> None:
    """Count one more announcement of a block its worker already holds (R-APP-4):
    ``dupkey`` is ``(wid << 5) | tier id``."""
    d = node.dup
    if d is None:
        node.dup = {dupkey: 1}
    else:
        d[dupkey] = d.get(dupkey, 0) + 1


def _py_insert_gpu(
    wmap: Kids, parent: Node, hashes: list[Any], keys: list[int], bit: int, dupkey: int
) -> tuple[Node, int, int]:
    """Attach a GPU store's blocks under ``parent`` for one worker.

    A hash the worker already maps keeps its node (R-APP-2); a new block reuses
    the child with its key or gets a new node born holding ``bit``; a block the
    worker already holds counts one more announcement under ``dupkey`` in
    ``node.dup`` (R-APP-4). Changes the tree, ``wmap`` and the nodes' ``gpu`` and
    ``dup``. Returns ``(last node, nodes created, residencies added)``.
    """
    get = wmap.get
    created = added = 0
    kids: Any  # None, a Node or a Kids map, told apart by __class__ (which mypy cannot narrow)
    for h, k in zip(hashes, keys):
        node = get(h)
        if node is None or node.parent is DEAD:
            kids = parent.kids
            if kids is None:
                parent.kids = wmap[h] = parent = Node(k, parent, None, bit)
                created += 1
                continue
            if kids.__class__ is Kids:
                node = kids.get(k)
                if node is None:
                    kids[k] = wmap[h] = parent = Node(k, parent, None, bit)
                    created += 1
                    continue
            elif kids.key == k:
                node = kids
            else:
                node = Node(k, parent, None, bit)
                parent.kids = Kids(((kids.key, kids), (k, node)))
                wmap[h] = parent = node
                created += 1
                continue
            wmap[h] = node
        m = node.gpu
        if m & bit:
            dup_add(node, dupkey)
        else:
            node.gpu = m | bit
            added += 1
        parent = node
    return parent, created, added + created


def _py_walk(
    node: Node, chunks: Iterable[Sequence[int]], keep: bool
) -> tuple[int, list[tuple[int, int]], int, list[Node] | None]:
    """Follow a query's block keys down from ``node`` while a child matches.

    ``chunks`` is an iterable of key lists (hashed lazily by the caller). Returns
    ``(depth, stops, active, path)``: ``active`` starts as every worker (-1) and
    narrows to the workers whose GPU run is unbroken; ``stops`` gets ``(depth,
    mask)`` where runs end. Without ``keep`` the walk also stops when no worker is
    left; with it, ``path`` lists the nodes passed. Read-only.
    """
    stops: list[tuple[int, int]] = []
    path: list[Node] | None = [] if keep else None
    active = -1
    d = 0
    kids: Any  # None, a Node or a Kids map, told apart by __class__ (which mypy cannot narrow)
    for chunk in chunks:
        for k in chunk:
            kids = node.kids
            if kids is None:
                break
            if kids.__class__ is Kids:
                node = kids.get(k)  # type: ignore[assignment]  # None ends the walk just below
                if node is None:
                    break
            elif kids.key == k:
                node = kids
            else:
                break
            if keep:
                path.append(node)  # type: ignore[union-attr]  # path is a list whenever keep
            elif not active:
                break
            nm = active & node.gpu
            if nm != active:
                if d:
                    stops.append((d, active ^ nm))
                active = nm
            d += 1
        else:
            continue
        break
    return d, stops, active, path


# Freed nodes point at DEAD: a worker's hash map may still name a node that the
# node cap evicted; lookups treat such a node as absent and drop the mapping.
if TYPE_CHECKING:
    # One name each for the type checker: the compiled core's (indexer/_core.pyi);
    # the pure-Python twins have the same layout and signatures.
    from indexer._native._core import DEAD, Node, _Hashes, insert_gpu, insert_gpu_raw, walk
    from indexer._native._core import U64Map as Kids

    remove_gpu: Callable[[Kids, Node, _Hashes, int, int], tuple[int, int, int]] | None
elif _core is not None:  # see _compiled.py
    Node = _core.Node
    Kids = _core.U64Map  # a node's children when it has several: key -> node
    DEAD = _core.DEAD
    insert_gpu = _core.insert_gpu
    insert_gpu_raw = _core.insert_gpu_raw  # only reached through wire.scan_gpu_batch: compiled too
    walk = _core.walk
    # No pure twin: without the core, removals take PrefixIndex's general loop.
    remove_gpu = _core.remove_gpu
else:
    Node = _PyNode
    Kids = dict
    DEAD = Node(None, None)
    insert_gpu = _py_insert_gpu
    insert_gpu_raw = None  # wire.scan_gpu_batch is None without the core: never called
    walk = _py_walk
    remove_gpu = None


def link_child(parent: Node, key: int, node: Node) -> None:
    """Put ``node`` under ``parent`` as its child keyed ``key`` (absent until now)."""
    kids: Any = parent.kids  # None, a Node or a Kids map (see _py_insert_gpu)
    if kids is None:
        parent.kids = node
    elif kids.__class__ is Kids:
        kids[key] = node
    else:
        parent.kids = Kids(((kids.key, kids), (key, node)))


class Tree:
    """One prefix tree: a root, a node count and, with a node cap, store order."""

    __slots__ = ("group", "block_size", "root", "nodes", "stamps", "leaves", "clock")

    def __init__(self, group: int, block_size: int, capped: bool) -> None:
        self.group = group
        self.block_size = block_size
        self.root = Node(None, None)
        self.nodes = 0
        # Only with a node cap: when each node was last stored, and a heap of
        # (stamp, id, node) over nodes that were leaves when pushed. Entries go
        # stale (the node got a child, was stored again or freed) and are skipped
        # when popped; a node that becomes a leaf again is pushed again.
        self.stamps: dict[Node, int] | None = {} if capped else None
        self.leaves: list[tuple[int, int, Node]] = []
        self.clock = 0

    def touch(self, node: Node) -> None:
        """Record that ``node`` was just stored (capped trees only)."""
        self.clock += 1
        self.stamps[node] = self.clock  # type: ignore[index]  # capped: stamps is a dict
        if node.kids is None:
            heapq.heappush(self.leaves, (self.clock, id(node), node))
        if len(self.leaves) > 4 * len(self.stamps) + 64:  # type: ignore[arg-type]  # capped: a dict
            self._rebuild_leaves()

    def _rebuild_leaves(self) -> None:
        stamps = self.stamps
        self.leaves = [(st, id(n), n) for n, st in stamps.items() if n.kids is None]  # type: ignore[union-attr]  # capped
        heapq.heapify(self.leaves)

    def oldest_leaf(self) -> Node | None:
        """Pop the least recently stored leaf (capped trees only); None when there is none."""
        leaves = self.leaves
        stamps = self.stamps
        while leaves:
            st, _, node = heapq.heappop(leaves)
            if node.kids is None and node.parent is not DEAD and stamps.get(node) == st:  # type: ignore[union-attr]  # capped
                return node
        return None

    def clear(self) -> None:
        """Unlink every node (iteratively) so reference counting frees them all."""
        stack = [self.root]
        kids: Any  # None, a Node or a Kids map, told apart by __class__ (which mypy cannot narrow)
        while stack:
            node = stack.pop()
            kids = node.kids
            if kids is not None:
                if kids.__class__ is Kids:
                    stack.extend(kids.values())
                else:
                    stack.append(kids)
            node.kids = None
            node.parent = None
            node.tiers = None
            node.dup = None
        self.nodes = 0
        if self.stamps is not None:
            self.stamps.clear()
            self.leaves.clear()

    def child(self, parent: Node, key: int) -> Node | None:
        """The child of ``parent`` keyed ``key``, or None (read-only)."""
        kids: Any = parent.kids  # None, a Node or a Kids map (see _py_insert_gpu)
        if kids is None:
            return None
        if kids.__class__ is Kids:
            return kids.get(key)
        return kids if kids.key == key else None

    def add_child(self, parent: Node, key: int) -> Node:
        """Create and link a new child of ``parent``; the caller checked it is absent."""
        node = Node(key, parent)
        link_child(parent, key, node)
        self.nodes += 1
        return node

    def free_up(self, node: Node) -> None:
        """Free ``node`` and then its ancestors while they are unheld leaves (R-APP-9).

        Iterative: a chain can be thousands of blocks deep.
        """
        root = self.root
        stamps = self.stamps
        kids: Any  # None, a Node or a Kids map (see _py_insert_gpu)
        while node is not root and node.kids is None and not node.gpu and node.tiers is None:
            parent = node.parent
            if parent is DEAD or parent is None:
                return
            kids = parent.kids
            if kids is node:
                parent.kids = None
            elif kids.__class__ is Kids:
                del kids[node.key]
                if len(kids) == 1:
                    for only in kids.values():
                        parent.kids = only
            node.parent = DEAD
            node.dup = None
            self.nodes -= 1
            if stamps is not None:
                stamps.pop(node, None)
            node = parent
        if stamps is not None and node.kids is None and node is not root:
            st = stamps.get(node)
            if st is not None:  # a held node that just became a leaf
                heapq.heappush(self.leaves, (st, id(node), node))
