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

``kids`` is ``None``, a single child :class:`Node`, or a ``dict`` key -> child:
most nodes of a prefix tree have exactly one child, and a one-entry dict costs
~200 bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from msgspec import Struct

__all__ = ["Node", "Tree", "DEAD", "MAX_TIERS"]

# Tier ids are packed into 5 bits of the ``dup`` keys.
MAX_TIERS = 32


class Node(Struct, eq=False):
    """One block. A msgspec Struct: its C-level constructor is ~2.5x faster than a
    ``__slots__`` class with ``__init__``, at the same 80 bytes; ``eq=False`` keeps
    identity equality and hashing."""

    key: Any
    parent: Any
    kids: Any = None
    gpu: int = 0
    tiers: Any = None
    dup: Any = None


# Freed nodes point at DEAD: a worker's hash map may still name a node that the
# node cap evicted; lookups treat such a node as absent and drop the mapping.
DEAD = Node(None, None)


class Tree:
    """One prefix tree: a root, a node count and, with a node cap, store order."""

    __slots__ = ("group", "block_size", "root", "nodes", "lru")

    def __init__(self, group: int, block_size: int, capped: bool) -> None:
        self.group = group
        self.block_size = block_size
        self.root = Node(None, None)
        self.nodes = 0
        # Store order of nodes, only kept when a node cap is configured
        # (an OrderedDict gives O(1) move-to-end and pop-oldest).
        self.lru: OrderedDict | None = OrderedDict() if capped else None

    def child(self, parent: Node, key):
        """The child of ``parent`` keyed ``key``, or None (read-only)."""
        kids = parent.kids
        if kids is None:
            return None
        if kids.__class__ is dict:
            return kids.get(key)
        return kids if kids.key == key else None

    def add_child(self, parent: Node, key) -> Node:
        """Create and link a new child of ``parent``; the caller checked it is absent."""
        node = Node(key, parent)
        kids = parent.kids
        if kids is None:
            parent.kids = node
        elif kids.__class__ is dict:
            kids[key] = node
        else:
            parent.kids = {kids.key: kids, key: node}
        self.nodes += 1
        return node

    def free_up(self, node: Node) -> None:
        """Free ``node`` and then its ancestors while they are unheld leaves (R-APP-9).

        Iterative: a chain can be thousands of blocks deep.
        """
        root = self.root
        lru = self.lru
        while node is not root and node.kids is None and not node.gpu and node.tiers is None:
            parent = node.parent
            if parent is DEAD or parent is None:
                return
            kids = parent.kids
            if kids is node:
                parent.kids = None
            elif kids.__class__ is dict:
                del kids[node.key]
                if len(kids) == 1:
                    for only in kids.values():
                        parent.kids = only
            node.parent = DEAD
            node.dup = None
            self.nodes -= 1
            if lru is not None:
                lru.pop(node, None)
            node = parent

    def walk(self, keys) -> list:
        """Nodes along ``keys`` from the root, as deep as the tree goes (read-only)."""
        path = []
        node = self.root
        append = path.append
        for k in keys:
            kids = node.kids
            if kids is None:
                break
            if kids.__class__ is dict:
                node = kids.get(k)
                if node is None:
                    break
            elif kids.key == k:
                node = kids
            else:
                break
            append(node)
        return path
