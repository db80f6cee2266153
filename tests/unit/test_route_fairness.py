"""R-Q-3 fairness under contention: router replicas that route in the same instant,
each with its own index and no sight of the other's decisions, spread a burst as one
router would, instead of herding onto the first worker of a tie.

Every route here is run twice, on the compiled ranking and on its Python twin.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import indexer.query.route as route_mod
from api.settings import Settings, SettingsError, load_settings
from evkit import FakeClock, apply, store, toks
from indexer import PrefixIndex
from indexer._native import core

BS = 4
PROMPT = toks(1000, 8, BS)  # 8 blocks
COMPILED = [True, False] if core is not None else [False]


@pytest.fixture(params=COMPILED, ids=lambda c: "compiled" if c else "python")
def twin(request, monkeypatch):
    if not request.param:
        monkeypatch.setattr(route_mod, "_core", None)
    return request.param


def fleet(n: int, cached: tuple[int, ...] = (), slot: tuple[int, int] | None = None,
          reported: int = 0) -> PrefixIndex:
    """Engines e0..e{n-1} (rank 0); those in ``cached`` hold PROMPT's first 4 blocks;
    each engine reports ``reported`` waiting requests none of which this index routed
    (other routers', identical on every replica)."""
    idx = PrefixIndex(clock=FakeClock())
    if slot is not None:
        idx.set_tie_slot(*slot)
    for i in range(n):
        idx.register_worker(f"e{i}", 0)
        if i in cached:
            apply(idx, [store(PROMPT, BS, 0, 4)], engine=f"e{i}")
        if reported:
            idx.correct_load((f"e{i}", 0), reported, 0, 1000.0)
    return idx


def burst(idx: PrefixIndex, k: int, max_tokens: int | None = 16) -> Counter[str]:
    """Route ``k`` copies of PROMPT, recorded (each sees the ones before): per engine, how many."""
    return Counter(idx.route(PROMPT, max_tokens=max_tokens)["engine"] for _ in range(k))


def replicas(n: int, k: int, slots: list[tuple[int, int]], **kw: Any) -> Counter[str]:
    """The combined placement of replicas, one per slot, each routing ``k`` prompts
    over the same fleet with no knowledge of the others (the same instant)."""
    mt = kw.pop("max_tokens", 16)
    total: Counter[str] = Counter()
    for slot in slots:
        total += burst(fleet(n, slot=slot, **kw), k, mt)
    return total


# ------------------------------------------------------------ (a) default: today's order

def reference_order(held: dict[str, int], loads: dict[str, tuple[int, int]], qb: int) -> list[str]:
    """The ranking as R-Q-3 states it, from the fleet as built: score = blocks held
    (GPU, credit 1), cost = max(ceil(prefill / BS) + qb - score, 0) + decode; lowest
    cost, then the higher score, then engine id, then rank."""
    rows = []
    for e, n in held.items():
        pre, dec = loads.get(e, (0, 0))
        cost = max(-(-pre // BS) + qb - n, 0) + dec
        rows.append((cost, -n, e, 0))
    return [f"{e}/{r}" for _, _, e, r in sorted(rows)]


@settings(max_examples=40, deadline=None)
@given(held=st.dictionaries(st.sampled_from(["a", "b", "c", "aa", "b1", "z", "y"]), st.integers(0, 8),
                            min_size=1, max_size=7),
       loads=st.dictionaries(st.sampled_from(["a", "b", "c", "aa", "b1", "z", "y"]),
                             st.tuples(st.integers(0, 3 * BS), st.integers(0, 2)), max_size=7),
       compiled=st.sampled_from(COMPILED), slot0_of=st.integers(1, 5))
def test_R_Q_3_the_default_slot_and_slot_0_keep_the_engine_then_rank_order(held, loads, compiled, slot0_of):
    saved = route_mod._core
    try:
        if not compiled:
            route_mod._core = None
        idx = PrefixIndex()
        for e, n in held.items():
            idx.register_worker(e, 0)
            if n:
                apply(idx, [store(PROMPT, BS, 0, n)], engine=e)
        load = {f"{e}/0": route_mod.Load(*v) for e, v in loads.items() if e in held}
        want = reference_order(held, {e: v for e, v in loads.items() if e in held}, 8)
        got = [t["worker"] for t in idx.route(PROMPT, load=load, record=False)["ranked"]]
        assert got == want
        idx.set_tie_slot(0, 1)
        assert [t["worker"] for t in idx.route(PROMPT, load=load, record=False)["ranked"]] == want
        # Slot 0 of any number of replicas starts every tie where one router does.
        idx.set_tie_slot(0, slot0_of)
        assert [t["worker"] for t in idx.route(PROMPT, load=load, record=False)["ranked"]] == want
    finally:
        route_mod._core = saved


# ------------------------------------------------------------ (b) two replicas, one burst

@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (8, 4), (8, 8), (8, 12), (4, 2), (5, 3), (6, 6)])
@pytest.mark.parametrize("reported", [0, 2], ids=["idle", "engine-reports"])
def test_R_Q_3_two_replicas_spread_a_cold_burst_as_one_router_does(twin, n, k, reported):
    one = replicas(n, 2 * k, [(0, 1)], reported=reported)
    two = replicas(n, k, [(0, 2), (1, 2)], reported=reported)
    herd = replicas(n, k, [(0, 1), (0, 1)], reported=reported)
    assert sum(two.values()) == sum(one.values()) == 2 * k
    # The same per-engine counts as one router (so no engine gets more).
    assert sorted(two.values()) == sorted(one.values())
    assert max(two.values()) <= max(one.values())
    # Both replicas as one router (0/1): the first of each burst lands on e0 twice; the
    # check above would catch it while a burst fits the fleet.
    if k <= n // 2:
        assert herd["e0"] == 2 and max(herd.values()) > max(one.values())


@pytest.mark.parametrize("n,cached", [(4, (1, 3)), (4, (0, 1)), (6, (4, 5)), (5, (0, 4)), (8, (2, 3))])
def test_R_Q_3_two_replicas_split_a_prefix_cached_on_two_engines(twin, n, cached):
    one = replicas(n, 2, [(0, 1)], cached=cached)
    two = replicas(n, 1, [(0, 2), (1, 2)], cached=cached)
    herd = replicas(n, 1, [(0, 1), (0, 1)], cached=cached)
    # One router sends the first two to the two engines holding the prefix, one each.
    assert one == Counter({f"e{i}": 1 for i in cached})
    assert two == one
    assert herd == Counter({f"e{cached[0]}": 2})  # what the check above would catch


@pytest.mark.parametrize("cached", [(1, 3), (0, 1)])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_burst_that_follows_the_cache_is_never_piled_higher_by_two_replicas(twin, cached, k):
    # Without max_tokens a prompt's own prediction makes its engine the cheapest for the
    # next copy: one router piles the whole burst there; two replicas split it.
    one = replicas(4, 2 * k, [(0, 1)], cached=cached, max_tokens=None)
    two = replicas(4, k, [(0, 2), (1, 2)], cached=cached, max_tokens=None)
    assert max(two.values()) <= max(one.values())
    assert set(two) == {f"e{i}" for i in cached}


@pytest.mark.parametrize("of", [3, 4])
def test_more_replicas_take_disjoint_arcs_of_a_cold_fleet(twin, of):
    n, k = 12, 12 // of
    got = replicas(n, k, [(s, of) for s in range(of)])
    assert got == Counter({f"e{i}": 1 for i in range(n)})


# ------------------------------------------------------------ (c) the twins agree with slots

@pytest.mark.skipif(core is None, reason="no compiled core")
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_compiled_rank_rotates_ties_as_its_python_twin(data):
    engines = data.draw(st.lists(st.tuples(st.sampled_from(["a", "b", "aa", "b1", "w9", "w10", "é", "z"]),
                                           st.integers(0, 2)), min_size=1, max_size=12, unique=True))
    idx = PrefixIndex()
    for e, r in engines:
        idx.register_worker(e, r)
        n = data.draw(st.sampled_from([0, 0, 2, 4]))
        if n:
            apply(idx, [store(PROMPT, BS, 0, n)], engine=e, dp_rank=r)
    res = idx.match(PROMPT)
    cands = [(e, r, False) for e, r in data.draw(st.permutations(engines))]
    in_flight = data.draw(st.dictionaries(st.sampled_from(engines), st.tuples(st.sampled_from([0, BS, 2 * BS]),
                                                                              st.sampled_from([0, 1]))))
    link = data.draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(engines),
                                                          st.tuples(st.booleans(), st.booleans()))))
    of = data.draw(st.integers(1, 6))
    slot = data.draw(st.integers(0, of - 1))

    def args(keep: int | None = None) -> list[Any]:
        return [cands, res.workers, None, None, set(), in_flight or None, link, res.query_blocks, BS, 1.0,
                "index", None, None, slot, of, keep]

    got = core.rank(*args())
    want = route_mod._py_rank(*args())
    assert got is not None
    assert [t["worker"] for t in got[0]] == [t["worker"] for t in want[0]]
    assert got[0] == want[0] and got[1:] == want[1:]
    # The same order written as the answer's JSON (the service's body); a name JSON
    # would escape is declined (msgspec writes it then).
    got_json = core.rank(*args(2))
    if got_json is None:
        assert any(not e.isascii() for e, _, _ in cands)
    else:
        assert got_json[0] == route_mod._py_rank(*args(2))[0] == msgspec.json.encode(want[0])
    # A rotation only reorders a tie: the (never, cost, -score) sequence is the default's.
    base = route_mod._py_rank(*args()[:13])
    assert [(t["cost"], -t["score"]) for t in want[0]] == [(t["cost"], -t["score"]) for t in base[0]]
    assert sorted(t["worker"] for t in want[0]) == sorted(t["worker"] for t in base[0])


@pytest.mark.skipif(core is None, reason="no compiled core")
def test_the_compiled_rank_declines_a_slot_count_it_cannot_rank_exactly():
    idx = PrefixIndex()
    apply(idx, [store(PROMPT, BS, 0, 5)], engine="a")
    res = idx.match(PROMPT)
    args = [[("a", 0, False), ("b", 0, False)], res.workers, None, None, set(), None, None, res.query_blocks, BS,
            1.0, "index", None, None, 1, 2**40, None]
    assert core.rank(*args) is None
    assert route_mod._py_rank(*args)[0][0]["worker"] == "a/0"


# ------------------------------------------------------------ (d) bad slots

@pytest.mark.parametrize("slot,of", [(1, 1), (2, 2), (-1, 2), (0, 0), (3, 2), (True, 2), (0, 2.0), ("0", 2)])
def test_a_bad_tie_slot_is_refused_and_changes_nothing(slot, of):
    idx = PrefixIndex()
    idx.set_tie_slot(1, 3)
    with pytest.raises(ValueError, match="tie slot"):
        idx.set_tie_slot(slot, of)
    assert idx.tie_slot == (1, 3)


def test_route_refuses_a_bad_tie_slot():
    idx = fleet(2)
    res = idx.match(PROMPT)
    with pytest.raises(ValueError, match="tie_slot"):
        route_mod.route(res, idx.model_workers("default"), tie_slot=(2, 2))


@pytest.mark.parametrize("raw", ["3/3", "1", "-1/2", "a/b", "1/0", "0/", "/2", "1/2/3", "٣/٤"])
def test_the_replica_slot_setting_names_itself_when_bad(raw):
    with pytest.raises(SettingsError, match=r"setting 'replica_slot': must be SLOT/N"):
        load_settings(None, {"replica_slot": raw}, env={})
    with pytest.raises(SettingsError, match="replica_slot"):
        load_settings(None, {}, env={"KVI_REPLICA_SLOT": raw})


def test_the_replica_slot_setting_reaches_the_index():
    from api.app import create_app

    assert Settings().tie_slot() == (0, 1)
    s = load_settings(None, {}, env={"KVI_REPLICA_SLOT": " 2/3 "})
    assert s.tie_slot() == (2, 3)
    app = create_app(s)
    assert app.state.service.index.tie_slot == (2, 3)
    mine = PrefixIndex()
    mine.set_tie_slot(1, 2)
    assert create_app(Settings(), mine).state.service.index.tie_slot == (1, 2)  # the default sets nothing
