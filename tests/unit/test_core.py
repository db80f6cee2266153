"""The compiled core (``indexer/_native/*.c``) against its pure-Python references.

* ``U64Map`` behaves as a dict for every key an engine can send (u64 ints in the
  table; bytes, negative and huge ints in its side dict), through growth,
  backward-shift deletion and shrinking;
* ``Node``, ``insert_gpu``, ``walk`` and ``answers`` do what their pure twins in
  tree.py and result.py do;
* ``block_keys`` is xxh3-64 of each block (R-KEY-2); the token reader (an
  event's msgpack array) accepts exactly the plain uint32 arrays and declines
  everything else;
* the pure-Python build (``KVI_PURE_PYTHON=1``) still passes the index's tests.

The service's compiled formats (a request's JSON body, Dynamo's /query body) are
tested in test_surface.py.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from indexer.store import tree

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("KVI_PURE_PYTHON", "") not in ("", "0"):
    pytest.skip("the pure-Python build: nothing compiled to compare", allow_module_level=True)


def test_the_compiled_core_is_built_and_used() -> None:
    """The install builds it (a missing compiler only warns: this catches that)."""
    from indexer.query import answers as result
    from indexer.wire import keys

    assert tree.COMPILED and tree.Node.__module__ == "indexer._native._core"
    assert keys._c_block_keys is not None and result.gpu_answers.__module__ == "indexer._native._core"


from indexer._native import _core as core  # noqa: E402  (after the check above names what is missing)

# Keys an engine can send: u64 ints (dense and sparse), and what the side dict takes.
KEYS = st.one_of(
    st.integers(0, 64),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), -1),
    st.integers(2**64, 2**70),
    st.binary(min_size=0, max_size=4),
)


class MapVsDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = core.U64Map()
        self.d: dict = {}

    @rule(k=KEYS, v=st.integers())
    def put(self, k, v) -> None:
        self.m[k] = v
        self.d[k] = v

    @rule(k=KEYS)
    def delete(self, k) -> None:
        if k in self.d:
            del self.m[k]
            del self.d[k]
        else:
            with pytest.raises(KeyError):
                del self.m[k]

    @rule(k=KEYS)
    def pop(self, k) -> None:
        assert self.m.pop(k, "absent") == self.d.pop(k, "absent")

    @rule(n=st.integers(1, 300), base=st.integers(0, 2**64 - 301))
    def bulk_then_drain(self, n, base) -> None:
        # Grows through several resizes, then deletes most (shrinks) in a scattered order.
        ks = list(range(base, base + n))
        for k in ks:
            self.m[k] = k
            self.d[k] = k
        random.Random(n).shuffle(ks)
        for k in ks[: n - n // 10]:
            del self.m[k]
            del self.d[k]

    @rule(k=KEYS)
    def lookups(self, k) -> None:
        assert (k in self.m) == (k in self.d)
        assert self.m.get(k) == self.d.get(k)
        assert self.m.get(k, "x") == self.d.get(k, "x")
        if k in self.d:
            assert self.m[k] == self.d[k]
        else:
            with pytest.raises(KeyError):
                self.m[k]

    @rule()
    def clear_sometimes(self) -> None:
        if len(self.d) > 200:
            self.m.clear()
            self.d.clear()

    @invariant()
    def same_content(self) -> None:
        assert len(self.m) == len(self.d)
        assert sorted(self.m.items(), key=repr) == sorted(self.d.items(), key=repr)
        assert sorted(self.m.keys(), key=repr) == sorted(self.d, key=repr)
        assert sorted(list(self.m), key=repr) == sorted(self.d, key=repr)
        assert sorted(self.m.values()) == sorted(self.d.values())
        assert bool(self.m) == bool(self.d)


TestMapVsDict = MapVsDict.TestCase
TestMapVsDict.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_map_construction_and_errors() -> None:
    m = core.U64Map({1: "a", b"h": "b"})
    assert sorted(m.items(), key=repr) == sorted({1: "a", b"h": "b"}.items(), key=repr)
    assert dict(core.U64Map(((2, "x"), (3, "y"))).items()) == {2: "x", 3: "y"}
    with pytest.raises(TypeError):
        m[[1]] = 1  # unhashable, as for a dict
    with pytest.raises(TypeError):
        core.U64Map(1, 2)
    assert m.__sizeof__() > 0 and "U64Map" in repr(m)


def test_map_shrinks_after_evictions() -> None:
    # A worker's engine-hash map follows its cache down (dicts never shrink).
    m = core.U64Map()
    for k in range(100_000):
        m[k * 7919] = None
    big = m.__sizeof__()
    for k in range(99_000):
        del m[k * 7919]
    assert len(m) == 1_000
    assert m.__sizeof__() < big / 20
    assert all(m.get(k * 7919, 1) is None for k in range(99_000, 100_000))


def test_big_tables_keep_every_entry_through_growth_shrink_and_clear() -> None:
    # Tables of 2 MiB and more are mapped apart from the heap (slots_alloc): every
    # resize across that size, up and down, and a clear must keep or free exactly.
    vals = [object() for _ in range(300_000)]
    ref0 = sys.getrefcount(vals[0])
    m = core.U64Map()
    for k, v in enumerate(vals):
        m[k * 2654435761 % 2**64] = v
    assert m.__sizeof__() > 2**21
    held = sys.getrefcount(vals[0])  # (outside the assert: pytest's rewriting holds its operands)
    assert held == ref0 + 1
    assert all(m[k * 2654435761 % 2**64] is v for k, v in enumerate(vals))
    for k in range(0, 300_000, 2):
        del m[k * 2654435761 % 2**64]
    for k in range(1, 300_000, 2):
        m[(k * 2654435761 + 1) % 2**64] = vals[k]  # grow again while half is gone
    assert len(m) == 300_000
    assert all(m[(k * 2654435761 + 1) % 2**64] is vals[k] for k in range(1, 300_000, 2))
    m.clear()
    held = sys.getrefcount(vals[1])
    assert len(m) == 0 and held == ref0


def test_node_fields_and_key_range() -> None:
    n = core.Node(2**64 - 1, None)
    assert (n.key, n.parent, n.kids, n.gpu, n.tiers, n.dup) == (2**64 - 1, None, None, 0, None, None)
    c = core.Node(5, n, None, 8, {1: 2}, {3: 4})
    assert (c.key, c.parent, c.gpu, c.tiers, c.dup) == (5, n, 8, {1: 2}, {3: 4})
    c.gpu = 2**300  # masks are Python ints: any number of workers
    assert c.gpu == 2**300
    assert core.Node(None, None).key == 0  # the root's key is never read
    for bad in (-1, 2**64, "k"):
        with pytest.raises((OverflowError, TypeError)):
            core.Node(bad, None)
    with pytest.raises(TypeError):
        core.Node(1)
    with pytest.raises(TypeError):
        core.Node(1, None, kids=None)
    with pytest.raises(AttributeError):
        n.key = 3
    assert core.DEAD is tree.DEAD and tree.COMPILED


def test_node_is_48_bytes() -> None:
    """CPython's allocator rounds to 16-byte classes: 48 is what a node must be to take
    less than 64 (56 would still take 64). tiers and dup live in a side block only
    while one of them is set, and __sizeof__ counts it then."""
    assert core.Node.__basicsize__ == 48
    n = core.Node(7, None, None, 5)
    assert sys.getsizeof(n) == 48
    n.tiers = {1: 5}
    assert sys.getsizeof(n) > 48
    n.tiers = None
    assert sys.getsizeof(n) == 48
    assert sys.getsizeof(core.Node(7, None, None, 5, None, None)) == 48  # None passed: no side block


def test_R_APP_2_R_APP_4_tiers_and_dup_through_the_side_block() -> None:
    """Other tiers' residency (R-APP-2: on the GPU store's node) and announcement counts
    (R-APP-4) move into a side block when set and out when both are None again; every
    read gives back the very object stored and no reference is gained or lost."""
    gpu, gpu2 = int("1" * 30), int("2" * 30)  # heap ints (not cached): their counts are exact
    tiers, dup = {1: gpu}, {(3 << 5) | 1: 2}
    counts = [sys.getrefcount(o) for o in (gpu, gpu2, tiers, dup)]
    n = core.Node(9, None, None, gpu)
    n.tiers = tiers  # the side block is made; the mask moves into it
    assert n.gpu is gpu and n.tiers is tiers and n.dup is None
    n.dup = dup
    assert n.gpu is gpu and n.tiers is tiers and n.dup is dup
    n.tiers[-1] = 4  # in place, as the tier loops write chunk ends (R-APP-5)
    n.dup[7] = 1
    assert n.tiers == {1: gpu, -1: 4} and n.dup == {97: 2, 7: 1}
    n.gpu = gpu2  # a mask set while the side block exists
    assert n.gpu is gpu2 and n.tiers is tiers and n.dup is dup
    n.tiers = None
    assert n.gpu is gpu2 and n.tiers is None and n.dup is dup
    n.dup = None  # both None: back to the mask alone
    assert n.gpu is gpu2 and n.tiers is None and n.dup is None and sys.getsizeof(n) == 48
    n.gpu = gpu
    n.dup = dup  # dup alone makes it too
    assert n.gpu is gpu and n.tiers is None and n.dup is dup
    n.tiers = tiers
    n.dup = None
    assert n.gpu is gpu and n.tiers is tiers and n.dup is None
    n.tiers = {}  # an empty dict is not None: kept, and the side block with it
    assert n.tiers == {} and n.gpu is gpu and sys.getsizeof(n) > 48
    for attr in ("gpu", "tiers", "dup"):
        with pytest.raises(AttributeError):
            delattr(n, attr)
    m = core.Node(10, n, None, gpu2, tiers, dup)  # made with both: freed with its side block
    assert (m.gpu, m.tiers, m.dup) == (gpu2, tiers, dup)
    n.tiers = None
    del m, n
    assert [sys.getrefcount(o) for o in (gpu, gpu2, tiers, dup)] == counts


def test_side_blocks_are_freed() -> None:
    """Making and folding the side block many times leaves no memory behind."""
    import tracemalloc

    n = core.Node(1, None, None, 3)
    tiers, dup = {1: 1}, {2: 2}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            n.tiers = tiers
            n.dup = dup
            n.tiers = None
            n.dup = None
            n.dup = dup
            core.Node(2, None, None, 1, tiers, dup)  # freed at once with its side block
            n.dup = None
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000  # a leaked block a round would be 24 bytes x 20,000 x 2


def _chain(chain):
    """Engine hashes chained as vLLM chains them (each names its whole prefix) and
    block keys from a small alphabet, so chains share prefixes, branch and repeat."""
    hashes, h = [], 0
    for sym in chain:
        h = hash((h, sym)) & (2**64 - 1)
        hashes.append(h)
    return hashes, [sym * 1000 + 1 for sym in chain]


def _build(insert, stores, bits):
    """Apply ``stores`` [(worker, chain)] with ``insert`` (the compiled loop or its
    pure twin, on the same node type); return the tree as {key path: (gpu, dup)},
    the per-call results and each worker's hash map."""
    root = tree.Node(None, None)
    maps = {w: tree.Kids() for w in bits}
    results = []
    for w, chain in stores:
        hashes, keys = _chain(chain)
        last, created, added = insert(maps[w], root, hashes, keys, bits[w], w << 5)
        results.append((last.key, created, added))
    out = {}
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        if path:
            out[path] = (node.gpu, node.dup)
        kids = node.kids
        if kids is None:
            continue
        for kid in (kids.values() if kids.__class__ is tree.Kids else [kids]):
            stack.append((kid, path + (kid.key,)))
    return root, (out, results, {w: sorted((k, v.key) for k, v in m.items()) for w, m in maps.items()})


STORES = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), min_size=1, max_size=6)),
    min_size=1, max_size=25,
)


@given(STORES)
@settings(max_examples=150, deadline=None)
def test_insert_gpu_matches_pure_python(stores) -> None:
    bits = {w: 1 << (w * 40) for w in range(4)}  # masks past 64 bits too
    assert _build(core.insert_gpu, stores, bits)[1] == _build(tree._py_insert_gpu, stores, bits)[1]


@given(STORES, st.lists(st.integers(0, 5), max_size=8), st.booleans(), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_walk_matches_pure_python(stores, query, keep, chunk) -> None:
    root, _ = _build(core.insert_gpu, stores, {w: 1 << w for w in range(4)})
    keys = _chain(query)[1]
    chunks = [keys[i : i + chunk] for i in range(0, len(keys), chunk)]
    d0, stops0, active0, path0 = tree._py_walk(root, iter(chunks), keep)
    d1, stops1, active1, path1 = core.walk(root, iter(chunks), keep)
    assert (d1, stops1, active1) == (d0, stops0, active0)
    assert path1 == path0  # the same node objects, or both None
    # The same keys packed (little-endian uint64 bytes, what /query's plain door walks),
    # alone or mixed with int chunks.
    packed = [b"".join(struct.pack("<Q", k) for k in c) if i % 2 == 0 else c for i, c in enumerate(chunks)]
    assert core.walk(root, iter(packed), keep) == (d0, stops0, active0, path0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 20), st.integers(-1, 12),
       st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_packed_block_keys_are_the_keys_as_uint64(toks, bs, limit, seed) -> None:
    buf = struct.pack(f"<{len(toks)}I", *toks)
    want = [xxhash.xxh3_64_intdigest(buf[j * bs * 4:(j + 1) * bs * 4], seed) for j in range(len(toks) // bs)]
    want = want if limit < 0 else want[:limit]
    assert core.block_keys(buf, bs, seed, limit, 0, True) == struct.pack(f"<{len(want)}Q", *want)


@st.composite
def _rows(draw):
    """A model's rows: (engine, dp_rank, freshness, position) or None, with positions
    the (engine, dp_rank) order as _Model.rank gives them, and unique workers."""
    n = draw(st.integers(0, 140))
    present = [i for i in range(n) if draw(st.booleans())]
    names = draw(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 40)), min_size=len(present),
                          max_size=len(present), unique=True))
    order = {x: i for i, x in enumerate(sorted(names))}
    stale = draw(st.lists(st.booleans(), min_size=len(present), max_size=len(present)))
    rows: list = [None] * n
    for wid, (e, r), s in zip(present, names, stale):
        rows[wid] = (e, r, (s, None, None, None), order[(e, r)])
    return rows


STOPS = st.lists(st.tuples(st.integers(0, 600), st.integers(0, 2**150)), max_size=5, unique_by=lambda s: s[0])


@given(_rows(), STOPS, st.booleans(), st.floats(-1, 2), st.floats(0, 1))
@settings(max_examples=300, deadline=None)
def test_answers_match_pure_python(rows, stops, ascending, credit, stale_factor) -> None:
    from indexer.query.answers import WorkerMatch, _py_gpu_answers

    stops = sorted(stops) if ascending else stops  # the walk's are ascending; others are ranked outright
    args = (stops, rows, "0", 16, credit, stale_factor, 12.5, WorkerMatch)
    got = core.answers(*args)
    assert got == _py_gpu_answers(*args)
    assert got == sorted(got)  # in ranking order, whether it had to sort or not
    assert all(type(w) is WorkerMatch for w in got)
    if got:  # workers at one depth share their items (the body builds their dicts once)
        same = [w for w in got if w.total_blocks == got[0].total_blocks]
        assert all(w.tier_items is same[0].tier_items for w in same)


def test_R_KEY_2_compiled_block_keys_are_xxh3_of_each_block() -> None:
    r = random.Random(7)
    for bs in (1, 2, 16, 33, 64):
        toks = [r.randrange(2**32) for _ in range(bs * 9 + 5)]
        buf = struct.pack(f"<{len(toks)}I", *toks)
        n = len(toks) // bs
        for seed in (1337, 0, 2**64 - 1):
            want = [xxhash.xxh3_64_intdigest(buf[i * bs * 4 : (i + 1) * bs * 4], seed) for i in range(n)]
            assert core.block_keys(buf, bs, seed) == want
            assert core.block_keys(buf, bs, seed, 4, 2) == want[2:4]
            assert core.block_keys(buf, bs, seed, 0) == []
        seeds = [r.randrange(2**64) for _ in range(n)]
        assert core.block_keys(buf, bs, seeds) == [
            xxhash.xxh3_64_intdigest(buf[i * bs * 4 : (i + 1) * bs * 4], seeds[i]) for i in range(n)
        ]
    with pytest.raises(ValueError):
        core.block_keys(b"\0" * 64, 0, 1337)
    with pytest.raises(ValueError):
        core.block_keys(b"\0" * 128, 16, [1])  # fewer seeds than blocks


ANY_INTS = st.lists(st.integers(-(2**40), 2**40), max_size=40)


@given(ANY_INTS)
@settings(max_examples=300, deadline=None)
def test_token_reader_takes_exactly_plain_uint32_arrays(toks) -> None:
    ok = all(0 <= t <= 2**32 - 1 for t in toks)
    packed = struct.pack(f"<{len(toks)}I", *toks) if ok else None
    assert core.tokens_from_msgpack(msgspec.msgpack.encode(toks)) == packed


# Mostly uint16 (how vLLM's token ids are packed: the reader takes runs of four in one
# step), broken up by every other width msgpack has, and by what is not a uint32.
TOKEN_RUNS = st.lists(st.one_of(st.integers(256, 65535), st.integers(256, 65535), st.integers(256, 65535),
                                st.integers(0, 255), st.integers(65536, 2**32 - 1), st.integers(2**32, 2**34),
                                st.integers(-300, -1)), max_size=60)


@given(TOKEN_RUNS, st.integers(1, 13))
@settings(max_examples=500, deadline=None)
def test_token_reader_reads_uint16_runs_and_whatever_breaks_them(toks, cut) -> None:
    """R-BAD-3, R-DEC-3: the event reader takes exactly the uint32 arrays and refuses the rest
    (the typed decoder then says what is wrong), never reading past a truncated array."""
    raw = msgspec.msgpack.encode(toks)
    ok = all(0 <= t <= 2**32 - 1 for t in toks)
    assert core.tokens_from_msgpack(raw) == (struct.pack(f"<{len(toks)}I", *toks) if ok else None)
    if len(raw) > cut:  # an array whose bytes end early: refused, never read past the end
        assert core.tokens_from_msgpack(raw[:-cut]) is None


@given(st.binary(max_size=300))
@settings(max_examples=1000, deadline=None)
def test_token_reader_survives_any_bytes(raw) -> None:
    """Whatever a publisher sends reaches this reader: never a crash."""
    b = core.tokens_from_msgpack(raw)
    assert b is None or (isinstance(b, bytes) and len(b) % 4 == 0)


def test_malformed_trees_raise_instead_of_crashing() -> None:
    """Only the index builds trees, but a stray value is a TypeError, never a bad read."""
    root = core.Node(None, None)
    wmap = core.U64Map({1: "not a node"})
    with pytest.raises(TypeError):
        core.insert_gpu(wmap, root, [1], [5], 1, 0)
    with pytest.raises(TypeError):
        core.remove_gpu(wmap, root, [1], 1, 0)
    root.kids = 7
    with pytest.raises(TypeError):
        core.insert_gpu(core.U64Map(), root, [2], [5], 1, 0)
    root.kids = core.U64Map({5: "not a node"})
    assert core.walk(root, [[5]], False) == (0, [], -1, None)  # not a child: no match
    with pytest.raises(TypeError):
        core.answers([(1, 1)], [("e", 0)], "0", 16, 1.0, 0.5, 0.0, tree.Node)  # not a tuple type
    with pytest.raises(TypeError):
        core.answers([(1, 1)], [("e", 0, "not fresh", 0)], "0", 16, 1.0, 0.5, 0.0, tuple)


def test_pure_python_build_passes_the_index_tests() -> None:
    """The fallback (no compiled core) is a supported build: it runs the same tests."""
    env = dict(os.environ, KVI_PURE_PYTHON="1", KVI_FUZZ_EXAMPLES="20")
    probe = subprocess.run([sys.executable, "-c", "import indexer.store.tree as t; print(t.COMPILED, t.Node.__module__)"],
                           env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    assert probe.stdout.split() == ["False", "indexer.store.tree"]
    tests = ["test_apply.py", "test_query.py", "test_stateful.py", "test_lifecycle.py", "test_keys.py",
             "test_decode.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                       env=env, capture_output=True, text=True, cwd=ROOT / "tests" / "unit", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
