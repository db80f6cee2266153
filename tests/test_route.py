"""R-Q-3 routing: the cached prefix (credit-weighted score) against load; deterministic ties."""

from __future__ import annotations

import pytest

from evkit import apply, chunks, store, toks
from indexer import PrefixIndex
from indexer.route import Load

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
    r = idx.route(t)
    assert (r["worker"], r["reason"], r["score"], r["cost"]) == ("a/0", "longest_cached_prefix", 8.0, 0.0)
    assert [(x["worker"], x["score"], x["cached_blocks"]) for x in r["ranked"]] == [
        ("a/0", 8.0, 8), ("b/0", 2 + 6 * 0.75, 8), ("c/0", 0.0, 0)]
    # 6.5 blocks of cache on b, 0 on c: queued prefill on a (in tokens) and decode blocks count.
    r = idx.route(t, load={"a/0": Load(active_prefill_tokens=5 * BS)})
    assert (r["worker"], r["reason"], r["cost"]) == ("b/0", "load_outweighs_cached_prefix", 8 - 6.5)
    r = idx.route(t, load={"a": Load(0, 10), "b": Load(0, 10)})
    assert r["worker"] == "c/0" and r["cost"] == 8.0
    r = idx.route(t, prefill_load_scale=0.0, load={"a": Load(0, 1)})
    assert r["worker"] in ("b/0", "c/0") and r["ranked"][0]["cost"] == 0.0
    assert [x["worker"] for x in r["ranked"][:2]] == ["b/0", "c/0"]  # equal cost: higher score first
    # Nothing cached anywhere: least loaded, then engine id.
    r = idx.route([7] * 64, load={"a/0": Load(0, 3)})
    assert (r["worker"], r["reason"]) == ("b/0", "no_cached_prefix_least_loaded")
    r = idx.route([7] * 64, candidates=["c", "zz/3"])
    assert [x["worker"] for x in r["ranked"]] == ["c/0", "zz/3"]
    with pytest.raises(LookupError):
        idx.route(t, candidates=[])
