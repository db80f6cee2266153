"""R-Q-3 routing: the cached prefix (credit-weighted score) against load; deterministic ties."""

from __future__ import annotations

import pytest

from evkit import apply, chunks, store, toks
from indexer import PrefixIndex
from indexer.query.route import Load

BS = 16


@pytest.fixture
def idx():
    i = PrefixIndex()
    t = toks(100, 8, BS)
    apply(i, [store(t, BS, 0, 8)], engine="a")                                   # 8 GPU blocks
    apply(i, [store(t, BS, 0, 2), *chunks(t, BS, 4, medium="CPU")], engine="b")  # 2 GPU, CPU to 8
    i.register_worker("c", 0)                                                    # nothing cached
    i.t = t
    return i


def test_R_Q_3_cache_first_then_load_then_ties(idx):
    t = idx.t
    r = idx.route(t, record=False)
    assert (r["worker"], r["reason"], r["score"], r["cost"]) == ("a/0", "longest_cached_prefix", 8.0, 0.0)
    assert [(x["worker"], x["score"], x["cached_blocks"]) for x in r["ranked"]] == [
        ("a/0", 8.0, 8), ("b/0", 2 + 6 * 0.75, 8), ("c/0", 0.0, 0)]
    # 6.5 blocks of cache on b, 0 on c: queued prefill on a (in tokens) and decode blocks count.
    r = idx.route(t, load={"a/0": Load(active_prefill_tokens=5 * BS)}, record=False)
    assert (r["worker"], r["reason"], r["cost"]) == ("b/0", "load_outweighs_cached_prefix", 8 - 6.5)
    r = idx.route(t, load={"a": Load(0, 10), "b": Load(0, 10)}, record=False)
    assert r["worker"] == "c/0" and r["cost"] == 8.0
    r = idx.route(t, prefill_load_scale=0.0, load={"a": Load(0, 1)}, record=False)
    assert r["worker"] == "b/0" and r["ranked"][0]["cost"] == 0.0  # b and c cost 0: b's higher score wins
    assert [x["worker"] for x in r["ranked"][:2]] == ["b/0", "c/0"]  # equal cost: higher score first
    # Nothing cached anywhere: least loaded, then engine id.
    r = idx.route([7] * 64, load={"a/0": Load(0, 3)}, record=False)
    assert (r["worker"], r["reason"]) == ("b/0", "no_cached_prefix_least_loaded")
    r = idx.route([7] * 64, candidates=["c", "zz/3"], record=False)
    assert [x["worker"] for x in r["ranked"]] == ["c/0", "zz/3"]
    with pytest.raises(LookupError):
        idx.route(t, candidates=[], record=False)


def test_R_Q_3_a_worker_that_never_connected_ranks_after_every_connected_one(idx):
    from indexer.query.route import route

    t = idx.t
    res = idx.match([7] * 64)  # nothing cached anywhere: before, "a" won on its id
    known = idx.model_workers()
    link = {("a", 0): (False, False), ("b", 0): (False, True), ("c", 0): (True, True)}
    r = route(res, known, link=link, load={"c/0": Load(0, 5)})
    # b (connected once, down now) and c (up, though loaded) both beat a; c costs more than b.
    assert [(x["worker"], x["connected"]) for x in r["ranked"]] == [("b/0", False), ("c/0", True), ("a/0", False)]
    # Even the longest cached prefix does not make a never-connected worker win.
    r = route(idx.match(t), known, link=link)
    assert r["worker"] == "b/0" and r["ranked"][-1]["worker"] == "a/0" and r["ranked"][-1]["cached_blocks"] == 8
    # With no transport (the library), every worker counts as connected.
    assert all(x["connected"] is True for x in idx.route(t, record=False)["ranked"])
    # Only when every candidate never connected does one of them win.
    r = route(res, known, link={k: (False, False) for k in link})
    assert r["worker"] == "a/0"


@pytest.mark.parametrize("key", ["a/³", "a/١", "a/０", "a/01", "a//0", "a/0/0", "", "a b", "a\x00", "/0", "a/1024"])
def test_R_BAD_4_malformed_candidates_and_load_keys_are_refused_by_name(idx, key):
    with pytest.raises(ValueError, match="malformed worker name") as e:
        idx.route(idx.t, candidates=["b/0", key], record=False)
    assert repr(key) in str(e.value)
    with pytest.raises(ValueError, match="malformed worker name") as e:
        idx.route(idx.t, load={key: Load(1, 1), "b/0": Load(0, 0)}, record=False)
    assert repr(key) in str(e.value)


def test_R_BAD_4_load_for_no_candidate_is_reported_unused(idx):
    r = idx.route(idx.t, load={"a": Load(0, 1), "c/0": Load(0, 1), "nobody/0": Load(0, 9), "a/7": Load(0, 9)},
                  record=False)
    assert r["unused_load"] == ["a/7", "nobody/0"]
    r = idx.route(idx.t, candidates=["b"], load={"a": Load(0, 1), "b/0": Load(0, 1)}, record=False)
    assert r["unused_load"] == ["a"]
