"""The snapshot's hot loops: the compiled twins (``indexer._native._core.dump_tree``,
``dump_map``, ``node_index``, ``translate``, ``load_tree``, ``load_map``) against the
pure ones in snapshot.py.

* On random trees (fan-out 0..5, chains up to 3,000 deep, masks up to 2**200,
  tiers and dups on some nodes) both dumps give the same bytes (node addresses
  included: CPython's ``id()`` is the address), masks and extra indices, and their
  ``node_index`` tables agree on every node; worker maps with int, bytes, negative
  and huge hashes dump and translate to the same columns and ``other``;
* a load of the columns rebuilds the same tree (same keys, masks and shape under
  every node; siblings may come back in another order, so a second dump can list
  them differently), and both loaders build it identically;
* bad columns are a ValueError or an IndexError, never a crash; refcounts and
  memory stay flat over repeated dumps and loads.

The C-vs-pure tests skip when the core is not compiled; the round trips and the
error cases run against whichever twins exist.
"""

from __future__ import annotations

import gc
import struct
import sys
import tracemalloc
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.store import snapshot
from indexer._native import COMPILED
from indexer._native import core as _core
from indexer.store.tree import Kids, Node

needs_core = pytest.mark.skipif(not COMPILED, reason="the compiled core is not built (or KVI_PURE_PYTHON=1)")

PURE = (snapshot._py_dump_tree, snapshot._py_dump_map, snapshot._py_load_tree, snapshot._py_load_map,
        snapshot._py_node_index, snapshot._py_translate)
TWINS = [pytest.param(PURE, id="pure")]
if _core is not None:
    TWINS.append(pytest.param((_core.dump_tree, _core.dump_map, _core.load_tree, _core.load_map, _core.node_index,
                               _core.translate), id="compiled"))
COMPILED_TWINS: Any = TWINS[-1].values[0]

U64 = 2**64 - 1


# ---------------------------------------------------------------- building trees


def link(parent: Any, node: Any) -> None:
    """Put ``node`` under ``parent`` the way the index does (tree.Tree.add_child)."""
    kids = parent.kids
    if kids is None:
        parent.kids = node
    elif kids.__class__ is Kids:
        kids[node.key] = node
    else:
        parent.kids = Kids(((kids.key, kids), (node.key, node)))


def child_keys(node: Any) -> set[int]:
    kids = node.kids
    if kids is None:
        return set()
    if kids.__class__ is Kids:
        return set(kids.keys())
    return {kids.key}


def unlink(root: Any) -> None:
    """Break the parent <-> child cycles (iteratively, as Tree.clear) so the nodes are freed."""
    stack = [root]
    while stack:
        node = stack.pop()
        kids = node.kids
        if kids is not None:
            stack.extend(kids.values() if kids.__class__ is Kids else (kids,))
        node.kids = node.parent = node.tiers = node.dup = None


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 120) -> tuple[Any, list[Any]]:
    """A random tree: ``(root, nodes)`` with the root first."""
    masks = draw(st.lists(st.one_of(st.integers(0, 7), st.integers(0, 2**200)), min_size=1, max_size=6))
    small = draw(st.booleans())  # small keys: many collisions in the children's tables
    key = st.integers(0, 12) if small else st.integers(0, U64)
    root = Node(None, None)
    nodes = [root]
    fan = [0]
    for raw, k, mi, extra in draw(st.lists(st.tuples(st.integers(0, 10**9), key, st.integers(0, 5),
                                                     st.integers(0, 9)), max_size=max_nodes)):
        # a parent with room for one more child (fan-out at most 5) and no child with this key
        for j in range(len(nodes)):
            p = (raw + j) % len(nodes)
            if fan[p] < 5 and k not in child_keys(nodes[p]):
                break
        else:
            continue
        node = Node(k, nodes[p], None, masks[mi % len(masks)])
        if extra == 0:
            node.tiers = {1: masks[mi % len(masks)] | 1, -1: 1}
        elif extra == 1:
            node.dup = {(3 << 5) | 0: 2}
        elif extra == 2:
            node.tiers, node.dup = {2: 4}, {1: 1}
        link(nodes[p], node)
        nodes.append(node)
        fan[p] += 1
        fan.append(0)
    # a deep chain under one node: the walks are iterative
    depth = draw(st.sampled_from([0, 0, 1, 40, 3000]))
    at = nodes[draw(st.integers(0, len(nodes) - 1))]
    if depth and len(child_keys(at)) < 5:
        first = next(k for k in range(U64, 0, -1) if k not in child_keys(at))
        for d in range(depth):
            node = Node((d * 0x9E3779B97F4A7C15) & U64 if d else first, at, None, masks[d % len(masks)])
            link(at, node)
            nodes.append(node)
            at = node
    return root, nodes


@st.composite
def worker_maps(draw: st.DrawFn, nodes: list[Any]) -> Any:
    """A worker's engine-hash map naming some of ``nodes`` (and a few nodes of no tree)."""
    wmap = Kids()
    stray = [Node(5, None), Node(6, None)]
    hashes = st.one_of(st.integers(0, 64), st.integers(0, U64), st.integers(-(2**70), -1),
                       st.integers(2**64, 2**80), st.binary(max_size=8))
    for h, i in draw(st.lists(st.tuples(hashes, st.integers(0, 10**9)), max_size=80)):
        pool = nodes if i % 10 else stray
        wmap[h] = pool[i % len(pool)]
    return wmap


def canon(parents: bytes, keys: bytes, mask_ids: bytes, masks: list[int], intern: dict[Any, int]) -> int:
    """An id for the tree the columns describe, blind to sibling order: equal trees
    (same keys and masks under every node) get the same id from one ``intern``."""
    par, ks, mids = array("I", parents), array("Q", keys), array("I", mask_ids)
    below: list[list[int]] = [[] for _ in range(len(par) + 1)]
    for i in range(len(par), 0, -1):  # preorder reversed: every child before its parent
        sig = (ks[i - 1], masks[mids[i - 1]], tuple(sorted(below[i])))
        below[par[i - 1]].append(intern.setdefault(sig, len(intern)))
    return intern.setdefault(("root", tuple(sorted(below[0]))), len(intern))


def kids_list(node: Any) -> list[Any]:
    kids = node.kids
    return [] if kids is None else kids.values() if kids.__class__ is Kids else [kids]


def indexed(twins: Any, root: Any) -> tuple[Any, ...]:
    """dump_tree's columns, its addresses turned into ``where`` (address -> index)."""
    parents, keys, mids, masks, extra, addrs = twins[0](root)
    return parents, keys, mids, masks, extra, twins[4](addrs)


def map_cols(twins: Any, wmap: Any, where: Any) -> tuple[bytes, bytes, list[tuple[Any, int]]]:
    """A worker map as snapshot columns: dump_map, then translate (what snapshot._assemble does)."""
    hashes, addrs, other = twins[1](wmap)
    h, i = twins[5](where, hashes, addrs)
    return h, i, [(x, where.get(a)) for x, a in other if where.get(a) is not None]


# ---------------------------------------------------------------- C == pure


@needs_core
@given(trees(), st.data())
@settings(max_examples=120, deadline=None)
def test_compiled_dump_is_byte_identical_to_the_pure_one(tree: tuple[Any, list[Any]], data: st.DataObject) -> None:
    root, nodes = tree
    try:
        p = snapshot._py_dump_tree(root)
        c = _core.dump_tree(root)
        assert c[:3] == p[:3]  # parents, keys, mask_ids: the same bytes
        assert c[3] == p[3] and all(a is b for a, b in zip(c[3], p[3]))  # the same mask objects
        assert [(i, n) for i, n in c[4]] == [(i, n) for i, n in p[4]]
        assert all(a is b for (_, a), (_, b) in zip(c[4], p[4]))
        assert c[5] == p[5] and sorted(array("Q", c[5])) == sorted(id(n) for n in nodes)
        cw, pw = _core.node_index(c[5]), snapshot._py_node_index(p[5])
        assert type(cw).__name__ == "NodeIndex" and len(cw) == len(pw) == len(nodes)
        for n in nodes:
            assert cw.get(id(n)) == pw[id(n)] and id(n) in cw
        outsider = Node(1, None)
        assert cw.get(id(outsider)) is None and cw.get(id(outsider), -1) == -1 and id(outsider) not in cw
        assert cw.get(-1) is None and cw.get(2**70) is None and cw.get(0) is None
        for _ in range(3):
            wmap = data.draw(worker_maps(nodes))
            pm = snapshot._py_dump_map(wmap)
            cm = _core.dump_map(wmap)
            assert cm == pm
            assert _core.translate(cw, cm[0], cm[1]) == snapshot._py_translate(pw, pm[0], pm[1])
            assert _core.translate(_core.node_index(b""), cm[0], cm[1]) == (b"", b"")
    finally:
        unlink(root)


@needs_core
@given(trees())
@settings(max_examples=80, deadline=None)
def test_compiled_load_builds_what_the_pure_load_builds(tree: tuple[Any, list[Any]]) -> None:
    root, nodes = tree
    r1, r2 = Node(None, None), Node(None, None)
    try:
        cols = snapshot._py_dump_tree(root)[:4]
        n1 = snapshot._py_load_tree(r1, *cols)
        n2 = _core.load_tree(r2, *cols)
        assert len(n1) == len(n2) == len(nodes) and n2[0] is r2
        at1 = {id(n): i for i, n in enumerate(n1)}
        at2 = {id(n): i for i, n in enumerate(n2)}
        for a, b in zip(n1[1:], n2[1:]):
            assert a.key == b.key and a.gpu is b.gpu and b.tiers is None and b.dup is None
            assert at1[id(a.parent)] == at2[id(b.parent)]
        # the same tables in the same order: the two rebuilt trees dump alike
        d1, d2 = indexed(PURE, r1), indexed(COMPILED_TWINS, r2)
        assert d1[:4] == d2[:4]
        for a, b in zip(n1, n2):
            assert [d1[5][id(x)] for x in kids_list(a)] == [d2[5].get(id(x)) for x in kids_list(b)]
        wmap = Kids()
        for i, n in enumerate(nodes):
            wmap[(i * 0x9E3779B97F4A7C15) & U64] = n
        hashes, idx, _ = map_cols(PURE, wmap, indexed(PURE, root)[5])
        m1, m2 = Kids(), Kids()
        snapshot._py_load_map(m1, hashes, idx, n1)
        _core.load_map(m2, hashes, idx, n2)
        # The same entries; the C load sizes its table once, the pure one grows it, so
        # their slot orders (and the dumps' entry orders) may differ.
        assert len(m1) == len(m2) == len(nodes)
        assert {k: at1[id(m1[k])] for k in m1} == {k: at2[id(m2[k])] for k in m2}
        e1, e2 = map_cols(PURE, m1, d1[5]), map_cols(COMPILED_TWINS, m2, d2[5])

        def pairs(cols):
            return sorted(zip(array("Q", cols[0]), array("I", cols[1])))

        assert pairs(e1) == pairs(e2) and e1[2] == e2[2]
    finally:
        unlink(root)
        unlink(r1)
        unlink(r2)


# ---------------------------------------------------------------- round trips (both twins)


@pytest.mark.parametrize("twins", TWINS)
@given(tree=trees())
@settings(max_examples=60, deadline=None)
def test_load_of_a_dump_rebuilds_the_same_tree(twins: Any, tree: tuple[Any, list[Any]]) -> None:
    dump_tree, dump_map, load_tree, load_map = twins[:4]
    root, nodes = tree
    back = Node(None, None)
    try:
        parents, keys, mids, masks, extra, where = indexed(twins, root)
        assert len(parents) == 4 * (len(nodes) - 1) and len(keys) == 8 * (len(nodes) - 1)
        rebuilt = load_tree(back, parents, keys, mids, masks)
        assert len(rebuilt) == len(nodes) and rebuilt[0] is back
        # node i is what column i says, under the node its parent index names
        for i, (p, k, mi) in enumerate(zip(array("I", parents), array("Q", keys), array("I", mids)), 1):
            n = rebuilt[i]
            assert n.parent is rebuilt[p] and n.key == k and n.gpu == masks[mi]
            assert n in kids_list(rebuilt[p])
        again = dump_tree(back)
        intern: dict[Any, int] = {}
        assert canon(*again[:4], intern) == canon(parents, keys, mids, masks, intern)
        assert sorted(again[3]) == sorted(masks)  # the same distinct masks (first use may differ)
        # the extras name the same nodes: tiers and dups put back by index restore them
        assert {where.get(id(n)) for _, n in extra} == {i for i, _ in extra}
        assert all(n.tiers is not None or n.dup is not None for _, n in extra)
        # a worker map over the original nodes comes back naming the rebuilt ones
        wmap = Kids()
        for i, n in enumerate(nodes):
            wmap[i] = n
        hashes, idx, other = map_cols(twins, wmap, where)
        assert other == []
        back_map = Kids()
        load_map(back_map, hashes, idx, rebuilt)
        assert sorted(back_map.keys()) == list(range(len(nodes)))
        for h in range(len(nodes)):
            assert back_map[h] is rebuilt[where.get(id(nodes[h]))]
    finally:
        unlink(root)
        unlink(back)


@pytest.mark.parametrize("twins", TWINS)
def test_a_tree_of_only_the_root_and_empty_columns(twins: Any) -> None:
    dump_tree, dump_map, load_tree, load_map = twins[:4]
    root = Node(None, None)
    parents, keys, mids, masks, extra, where = indexed(twins, root)
    assert (parents, keys, mids, masks, extra) == (b"", b"", b"", [], [])
    assert len(where) == 1 and where.get(id(root)) == 0
    assert dump_map(Kids()) == (b"", b"", []) and map_cols(twins, Kids(), where) == (b"", b"", [])
    assert load_tree(root, b"", b"", b"", []) == [root] and root.kids is None
    wmap = Kids()
    assert load_map(wmap, b"", b"", []) is None and len(wmap) == 0
    wmap[b"x"] = root
    wmap[-1] = root
    wmap[3] = root
    assert map_cols(twins, wmap, where) == (struct.pack("<Q", 3), struct.pack("<I", 0), [(b"x", 0), (-1, 0)])
    assert dump_map(wmap)[2] == [(b"x", id(root)), (-1, id(root))]


@pytest.mark.parametrize("twins", TWINS)
def test_columns_are_little_endian_preorder(twins: Any) -> None:
    load_tree = twins[2]
    root = Node(None, None)
    a = Node(10, root, None, 1)
    link(root, a)
    b = Node(20, a, None, 2**130)
    link(a, b)
    b.dup = {1: 1}
    parents, keys, mids, masks, extra, where = indexed(twins, root)
    assert parents == struct.pack("<II", 0, 1) and keys == struct.pack("<QQ", 10, 20)
    assert mids == struct.pack("<II", 0, 1) and masks == [1, 2**130] and extra == [(2, b)]
    assert twins[0](root)[5] == struct.pack("<QQQ", id(root), id(a), id(b))
    assert (where.get(id(root)), where.get(id(a)), where.get(id(b))) == (0, 1, 2)
    # the root may already have children: new ones join them
    other = Node(None, None)
    c = Node(30, other)
    link(other, c)
    out = load_tree(other, parents, keys, mids, masks)
    assert sorted(other.kids.keys()) == [10, 30] and out[1] is other.kids[10] and out[2].parent is out[1]
    unlink(root)
    unlink(other)


# ---------------------------------------------------------------- bad columns


def _bad_load_cases() -> list[Any]:
    u32 = lambda *v: struct.pack(f"<{len(v)}I", *v)  # noqa: E731
    u64 = lambda *v: struct.pack(f"<{len(v)}Q", *v)  # noqa: E731
    return [
        pytest.param(u32(0, 0), u64(1), u32(0), [0], id="fewer-keys"),
        pytest.param(u32(0), u64(1, 2), u32(0), [0], id="more-keys"),
        pytest.param(u32(0), u64(1), b"", [0], id="no-mask-ids"),
        pytest.param(u32(1), u64(1), u32(0), [0], id="parent-not-created-yet"),
        pytest.param(u32(0, 2), u64(1, 2), u32(0, 0), [0], id="parent-is-itself"),
        pytest.param(u32(0, 0xFFFFFFFF), u64(1, 2), u32(0, 0), [0], id="parent-huge"),
        pytest.param(u32(0), u64(1), u32(1), [0], id="mask-id-out-of-range"),
        pytest.param(u32(0), u64(1), u32(0xFFFFFFFF), [0], id="mask-id-huge"),
        pytest.param(u32(0), u64(1), u32(0), [], id="no-masks"),
        pytest.param(b"\0\0\0", b"", b"", [0], id="parents-not-whole"),
        pytest.param(u32(0), u64(1) + b"\0", u32(0), [0], id="keys-not-whole"),
    ]


@pytest.mark.parametrize("twins", TWINS)
@pytest.mark.parametrize(("parents", "keys", "mids", "masks"), _bad_load_cases())
def test_bad_tree_columns_are_refused(twins: Any, parents: bytes, keys: bytes, mids: bytes, masks: list[int]) -> None:
    root = Node(None, None)
    with pytest.raises((ValueError, IndexError)):
        twins[2](root, parents, keys, mids, masks)
    unlink(root)


@needs_core
def test_compiled_load_tree_says_value_error_for_every_bad_column() -> None:
    for case in _bad_load_cases():
        root = Node(None, None)
        with pytest.raises(ValueError):
            _core.load_tree(root, *case.values)
        unlink(root)


@pytest.mark.parametrize("twins", TWINS)
def test_bad_map_columns_are_refused(twins: Any) -> None:
    load_map = twins[3]
    root = Node(None, None)
    wmap = Kids()
    with pytest.raises(ValueError):
        load_map(wmap, struct.pack("<QQ", 1, 2), struct.pack("<I", 0), [root])
    with pytest.raises(ValueError):
        load_map(wmap, b"\0" * 7, b"", [root])
    with pytest.raises(IndexError):
        load_map(wmap, struct.pack("<QQ", 1, 2), struct.pack("<II", 0, 1), [root])
    with pytest.raises(IndexError):
        load_map(wmap, struct.pack("<Q", 1), struct.pack("<I", 0), [])
    load_map(wmap, bytearray(struct.pack("<Q", U64)), bytearray(struct.pack("<I", 0)), [root])
    assert wmap[U64] is root
    if load_map is not snapshot._py_load_map:  # the compiled one reads any buffer
        load_map(wmap, memoryview(struct.pack("<Q", 5)), array("I", [0]), [root])
        assert wmap[5] is root


@needs_core
@given(st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=64), st.lists(st.integers(0, 3), max_size=3))
@settings(max_examples=400, deadline=None)
def test_compiled_load_tree_on_arbitrary_bytes_agrees_with_the_pure_one(
    parents: bytes, keys: bytes, mids: bytes, masks: list[int]
) -> None:
    r1, r2 = Node(None, None), Node(None, None)
    try:
        try:
            n1 = snapshot._py_load_tree(r1, parents, keys, mids, masks)
        except (ValueError, IndexError):
            n1 = None
        try:
            n2 = _core.load_tree(r2, parents, keys, mids, masks)
        except ValueError:
            n2 = None
        assert (n1 is None) == (n2 is None)
        if n1 is not None:
            assert snapshot._py_dump_tree(r1)[:4] == _core.dump_tree(r2)[:4]
    finally:
        unlink(r1)
        unlink(r2)


@needs_core
@given(st.binary(max_size=40), st.binary(max_size=24), st.integers(0, 4))
@settings(max_examples=300, deadline=None)
def test_compiled_load_map_on_arbitrary_bytes_agrees_with_the_pure_one(hashes: bytes, idx: bytes, n: int) -> None:
    nodes = [Node(i, None) for i in range(n)]
    m1, m2 = Kids(), Kids()
    outcome = []
    for load, m in ((snapshot._py_load_map, m1), (_core.load_map, m2)):
        try:
            load(m, hashes, idx, nodes)
            outcome.append(None)
        except (ValueError, IndexError) as e:
            outcome.append(type(e))
    assert outcome[0] == outcome[1]
    assert m1.keys() == m2.keys() and all(a is b for a, b in zip(m1.values(), m2.values()))


@needs_core
def test_compiled_twins_refuse_what_they_cannot_read() -> None:
    root = Node(None, None)
    with pytest.raises(TypeError):
        _core.dump_tree({})
    with pytest.raises(TypeError):
        _core.dump_tree()
    with pytest.raises(TypeError):
        _core.dump_map({})
    with pytest.raises(TypeError):
        _core.translate({}, b"", b"")
    with pytest.raises(ValueError):
        _core.translate(_core.node_index(b""), b"\0" * 8, b"")
    with pytest.raises(ValueError):
        _core.node_index(b"\0" * 7)
    with pytest.raises(TypeError):
        _core.load_tree(root, b"", b"", b"")
    with pytest.raises(TypeError):
        _core.load_tree(root, "", b"", b"", [])  # not a buffer
    with pytest.raises(TypeError):
        _core.load_map(Kids(), b"", b"", ())  # nodes must be a list
    with pytest.raises(TypeError):
        _core.NodeIndex()
    # a "tree" that is not one: a node under two parents is met twice, and its
    # addresses are refused by node_index (both twins)
    a = Node(1, root)
    link(root, a)
    b = Node(2, root)
    link(root, b)
    shared = Node(3, a)
    link(a, shared)
    link(b, shared)
    for dump, index in ((_core.dump_tree, _core.node_index), (snapshot._py_dump_tree, snapshot._py_node_index)):
        with pytest.raises(ValueError, match="twice"):
            index(dump(root)[5])
    a.kids = b.kids = None
    a.kids = 5  # kids that are neither a node nor a map
    with pytest.raises(TypeError):
        _core.dump_tree(root)
    a.kids = Kids({1: "not a node"})
    with pytest.raises(TypeError):
        _core.dump_tree(root)
    a.kids = None
    unlink(root)


# ---------------------------------------------------------------- references and memory


def _big_tree(n: int) -> tuple[Any, list[Any]]:
    root = Node(None, None)
    nodes = [root]
    masks = [1, 2, 3, 2**100]
    for i in range(1, n):
        p = nodes[(i * 7919) % len(nodes)] if i % 3 == 0 else nodes[-1]
        node = Node((i * 0x9E3779B97F4A7C15) & U64, p, None, masks[i % 4])
        if i % 50 == 0:
            node.dup = {1: 1}
        link(p, node)
        nodes.append(node)
    return root, nodes


@needs_core
def test_compiled_twins_hold_no_stray_references_and_leak_nothing() -> None:
    root, nodes = _big_tree(3000)
    wmap = Kids()
    for i, n in enumerate(nodes):
        wmap[i * 3] = n
    wmap[b"h"] = nodes[1]
    sample = nodes[:50] + [root]

    def cycle() -> None:
        parents, keys, mids, masks, extra, where = indexed(COMPILED_TWINS, root)
        hashes, idx, other = map_cols(COMPILED_TWINS, wmap, where)
        back = Node(None, None)
        rebuilt = _core.load_tree(back, parents, keys, mids, masks)
        m = Kids()
        _core.load_map(m, hashes, idx, rebuilt)
        for h, i in other:
            m[h] = rebuilt[i]
        unlink(back)

    for _ in range(3):
        cycle()
    gc.collect()
    refs = [sys.getrefcount(n) for n in sample]
    big = nodes[3].gpu  # 2**100: one object every fourth node shares
    mask_refs = sys.getrefcount(big)
    tracemalloc.start()
    try:
        cycle()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            cycle()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(n) for n in sample] == refs
    assert sys.getrefcount(big) == mask_refs
    assert grown < 64 * 1024, f"{grown} bytes more after 20 dump/load cycles"
    # a failed load frees what it made but the nodes already linked under the root
    back = Node(None, None)
    before_refs = sys.getrefcount(back)
    with pytest.raises(ValueError):
        _core.load_tree(back, struct.pack("<II", 0, 5), struct.pack("<QQ", 1, 2), struct.pack("<II", 0, 0), [7])
    assert sys.getrefcount(back) == before_refs + 1  # its one child's parent reference
    unlink(back)
    assert sys.getrefcount(back) == before_refs
    unlink(root)
