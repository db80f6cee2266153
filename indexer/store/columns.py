"""A snapshot's columns: a tree's nodes and a worker's engine-hash map as little-endian
arrays, and back (the format is in ``docs/snapshot.md``; :mod:`.snapshot` frames them).

A tree is dumped in preorder (a parent before its children, node 0 the root) as
uint32 parent indices, uint64 block keys and uint32 GPU-mask ids; a worker map as
uint64 hashes and the uint32 index of each one's node. These are the loops that run
once per node or entry, so each has a compiled twin in :mod:`indexer._native` that
gives the same bytes and nodes; ``dump_tree`` ... ``load_map`` are the compiled ones
when the core has them (an older build, or ``KVI_PURE_PYTHON=1``: the pure ones).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from indexer._native import core as _core
from indexer.store.tree import Kids, Node, link_child

__all__ = ["U32", "U64C", "le", "col", "mask_bytes", "mask_int", "dump_tree", "dump_map", "node_index", "translate",
           "load_tree", "load_map", "py_dump_tree", "py_dump_map", "py_node_index", "py_translate", "py_load_tree",
           "py_load_map"]

U64_MAX = (1 << 64) - 1

# array typecodes of the widths the format fixes (C's unsigned int / long long)
U32, U64C = "I", "Q"
assert array(U32).itemsize == 4 and array(U64C).itemsize == 8
_SWAP = sys.byteorder != "little"  # the columns are little-endian on every host


def le(a: array[int]) -> bytes:
    """An array's bytes, little-endian."""
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def col(code: str, data: bytes) -> array[int]:
    """A little-endian column as an array (``bytes(data)``: an array reads a memoryview
    one byte at a time)."""
    a = array(code, bytes(data))
    if _SWAP:
        a.byteswap()
    return a


def mask_bytes(m: int) -> bytes:
    """A worker mask as little-endian unsigned bytes (b"" for 0)."""
    return m.to_bytes((m.bit_length() + 7) // 8, "little") if m else b""


def mask_int(b: bytes) -> int:
    """The mask :func:`mask_bytes` wrote."""
    return int.from_bytes(b, "little")


# ------------------------------------------------------------------ dumped


def py_dump_tree(root: Node) -> tuple[bytes, bytes, bytes, list[int], list[tuple[int, Node]], bytes]:
    """Walk one tree in preorder (iterative; node 0 is the root). Returns ``(parents,
    keys, mask_ids, masks, extra, addrs)``: the uint32/uint64/uint32 columns of every
    node but the root, the distinct GPU masks (ints) in order of first use, ``(index,
    node)`` of the nodes with tiers or dups, and the uint64 address (``id()``) of
    every node, the root first: :func:`py_node_index` turns them into node indices
    once the index lock is released. Read-only. ``_core.dump_tree`` is the compiled
    twin (the same bytes: CPython's ``id()`` is the address)."""
    addrs = array(U64C, [id(root)])
    parents = array(U32)
    keys = array(U64C)
    mids = array(U32)
    mask_ids: dict[int, int] = {}
    masks: list[int] = []
    extra: list[tuple[int, Node]] = []
    stack: list[tuple[Node, int]] = []
    kids: Any = root.kids
    if kids is not None:
        for child in (kids.values() if kids.__class__ is Kids else (kids,)):
            stack.append((child, 0))
    i = 0
    while stack:
        node, p = stack.pop()
        i += 1
        addrs.append(id(node))
        parents.append(p)
        keys.append(node.key)
        m = node.gpu
        mi = mask_ids.get(m)
        if mi is None:
            mi = mask_ids[m] = len(masks)
            masks.append(m)
        mids.append(mi)
        if node.tiers is not None or node.dup is not None:
            extra.append((i, node))
        kids = node.kids
        if kids is not None:
            if kids.__class__ is Kids:
                for child in kids.values():
                    stack.append((child, i))
            else:
                stack.append((kids, i))
    return le(parents), le(keys), le(mids), masks, extra, le(addrs)


def py_dump_map(wmap: Kids) -> tuple[bytes, bytes, list[tuple[Any, int]]]:
    """A worker's engine-hash map as ``(uint64 hashes, uint64 node addresses, other)``:
    ``other`` holds ``(hash, address)`` of the entries whose hash is not an int in
    [0, 2**64) (bytes digests). Reads the map, not its nodes. ``_core.dump_map`` is
    the compiled twin."""
    hashes = array(U64C)
    addrs = array(U64C)
    other: list[tuple[Any, int]] = []
    for h, node in wmap.items():
        if h.__class__ is int and 0 <= h <= U64_MAX:
            hashes.append(h)
            addrs.append(id(node))
        else:
            other.append((h, id(node)))
    return le(hashes), le(addrs), other


def py_node_index(addrs: bytes) -> dict[int, int]:
    """Address -> position of :func:`py_dump_tree`'s addresses (a ValueError when one
    is there twice: not a tree). ``_core.node_index`` is the compiled twin."""
    a = col(U64C, addrs)
    where = dict(zip(a, range(len(a))))
    if len(where) != len(a) or 0 in where:
        raise ValueError("node_index: an address twice, or 0 (not a tree)")
    return where


def py_translate(where: Any, hashes: bytes, addrs: bytes) -> tuple[bytes, bytes]:
    """:func:`py_dump_map`'s columns with each address replaced by its node's index in
    ``where``; entries it does not know (nodes the cap freed) are left out.
    ``_core.translate`` is the compiled twin."""
    hs, ads = col(U64C, hashes), col(U64C, addrs)
    if len(hs) != len(ads):
        raise ValueError(f"{len(hs)} hashes, {len(ads)} addresses")
    ho, io = array(U64C), array(U32)
    get = where.get
    for h, a in zip(hs, ads):
        i = get(a)
        if i is not None:
            ho.append(h)
            io.append(i)
    return le(ho), le(io)


# ------------------------------------------------------------------ loaded


def py_load_tree(root: Node, parents: bytes, keys: bytes, mask_ids: bytes, masks: Sequence[int]) -> list[Node]:
    """Create every node of a dumped tree under ``root`` (preorder: each parent exists
    before its children). Returns the nodes, the root first."""
    nodes: list[Node] = [root]
    append = nodes.append
    par = col(U32, parents)
    ks = col(U64C, keys)
    mids = col(U32, mask_ids)
    if not len(par) == len(ks) == len(mids):
        raise ValueError("tree columns of different lengths")
    n = len(nodes)
    for p, k, mi in zip(par, ks, mids):
        if p >= n:
            raise ValueError(f"node {n} names parent {p}, not created before it")
        parent = nodes[p]
        node = Node(k, parent, None, masks[mi])
        link_child(parent, k, node)
        append(node)
        n += 1
    return nodes


def py_load_map(wmap: Kids, hashes: bytes, idx: bytes, nodes: list[Node]) -> None:
    """Put ``hashes[i] -> nodes[idx[i]]`` into a worker's map (the columns
    :func:`py_dump_map` wrote). ``_core.load_map`` is the compiled twin."""
    hs, ix = col(U64C, hashes), col(U32, idx)
    n = len(hs)
    if n != len(ix):
        raise ValueError(f"{n} hashes, {len(ix)} node indices")
    # Scattered, not in the columns' order: that is the source table's slot order, which
    # piles inserts into long probe runs in a growing table (see _core.load_map).
    stride = load_stride(n)
    j = 0
    for _ in range(n):
        wmap[hs[j]] = nodes[ix[j]]
        j += stride
        if j >= n:
            j -= n


def load_stride(n: int) -> int:
    """The step of :func:`py_load_map`'s order: coprime with ``n``, so every entry comes once."""
    if n <= 2:
        return 1
    s = 0x9E3779B97F4A7C15 % n or 1
    while math.gcd(s, n) != 1:
        s += 1
    return s


# The snapshot tests hold both twins to the same bytes and nodes.
dump_tree = getattr(_core, "dump_tree", None) or py_dump_tree
dump_map = getattr(_core, "dump_map", None) or py_dump_map
node_index = getattr(_core, "node_index", None) or py_node_index
translate = getattr(_core, "translate", None) or py_translate
load_tree = getattr(_core, "load_tree", None) or py_load_tree
load_map = getattr(_core, "load_map", None) or py_load_map
