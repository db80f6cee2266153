"""Routing under real timing, in the library: routing decisions recorded as predicted prefixes and
in-flight load (R-Q-6, R-Q-7), ended by announcement, TTL, completion or the worker's
removal, restart or clear; bounded; and an independent model of the predictions."""

from __future__ import annotations

import os
import random

import pytest

from evkit import FakeClock, abc_fleet, apply, store, toks
from indexer import PrefixIndex
from indexer.producer.events import Cleared
from indexer.query.route import Load

BS = 16
OPS = int(os.environ.get("KVI_INFLIGHT_OPS", "300"))  # raise it for a longer local run


@pytest.fixture
def clock():
    return FakeClock(1000.0)


fleet = abc_fleet


def test_R_Q_6_a_routed_prompt_is_predicted_on_its_worker_until_announced(clock):
    idx = fleet(clock)
    p = toks(100, 8, BS)
    r1 = idx.route(p)
    assert r1["worker"] == "a/0" and r1["reason"] == "no_cached_prefix_least_loaded"
    assert r1["request_id"]
    # The match shows it apart from what was announced (nothing yet).
    res = idx.match(p + [1, 2, 3])
    assert res.workers == [] and res.predicted == (("a", 0, 8, 8.0),)
    assert res.to_dict()["predicted"] == [{"engine": "a", "dp_rank": 0, "predicted_blocks": 8, "score": 8.0}]
    # a has 8 blocks of prefill queued (FIFO). The same prompt again costs 8 there (wait,
    # then all cached) and 8 on b (compute): the tie goes to the (predicted) cache. A
    # prompt sharing 6 blocks costs 8 + 2 on a, 8 on b: b. So does an unrelated one.
    r2 = idx.route(p, record=False)
    top = r2["ranked"][0]
    assert (r2["worker"], top["predicted_blocks"], top["cached_blocks"], top["cost"]) == ("a/0", 8, 0, 8.0)
    assert top["load"] == {"prefill_tokens": 8 * BS, "decode_blocks": 0, "source": "index"}
    r3 = idx.route(p[: 6 * BS] + toks(900, 2, BS), record=False)
    assert r3["worker"] == "b/0" and r3["ranked"][1]["worker"] == "c/0" and r3["ranked"][2]["cost"] == 10.0
    assert idx.route(toks(5000, 8, BS), record=False)["worker"] == "b/0"
    # a announces the blocks (its prefill ended): the prediction and the load end.
    apply(idx, [store(p, BS, 0, 8)], engine="a")
    res = idx.match(p)
    assert res.predicted == () and res.best.engine == "a" and res.best.total_blocks == 8
    assert idx.inflight.load(("a", 0)) == (0, 0) and idx.inflight.nodes == 0
    assert idx.inflight.counters["announced"] == 1


def test_R_Q_6_a_partly_cached_prompt_counts_only_its_uncached_tokens(clock):
    idx = fleet(clock)
    p = toks(100, 8, BS)
    apply(idx, [store(p, BS, 0, 5)], engine="b")
    r = idx.route(p + [7] * 5)  # 5 of 8 blocks cached on b, plus a partial block
    assert r["worker"] == "b/0"
    assert idx.inflight.load(("b", 0)) == (3 * BS + 5, 0)
    assert idx.match(p).predicted == (("b", 0, 3, 3.0),)
    # Fully cached: nothing to prefill, nothing predicted, no load.
    apply(idx, [store(p, BS, 0, 8)], engine="c")
    r = idx.route(p, candidates=["c"])
    assert r["worker"] == "c/0" and idx.inflight.load(("c", 0)) == (0, 0)


def test_R_Q_4_R_Q_6_predictions_and_prefill_load_end_after_their_ttl(clock):
    idx = fleet(clock, prefill_ttl_s=10.0)
    p = toks(100, 4, BS)
    idx.route(p)
    clock.advance(9.9)
    assert idx.match(p).predicted[0][:3] == ("a", 0, 4)
    clock.advance(0.2)
    assert idx.match(p).predicted == ()  # a dead mark no longer counts, even before cleanup
    idx.route(toks(7, 1, BS), record=False)  # a route expires what is due
    assert idx.inflight.load(("a", 0)) == (0, 0) and idx.inflight.nodes == 0
    assert idx.inflight.counters["prefill_expired"] == 1


def test_R_Q_7_decode_load_from_max_tokens_released_by_done_or_ttl(clock):
    idx = fleet(clock, decode_ttl_s=60.0)
    p = toks(100, 4, BS)
    r = idx.route(p, max_tokens=100)
    blocks = -(-(4 * BS + 100) // BS)
    assert idx.inflight.load(("a", 0)) == (4 * BS, blocks)
    # Decode blocks weigh on the next decision (cost adds them).
    r2 = idx.route(toks(5, 1, BS), record=False)
    assert r2["worker"] == "b/0"
    assert idx.route_done(r["request_id"]) is True
    assert idx.inflight.load(("a", 0)) == (0, 0)  # done ends the prefill too
    assert idx.route_done(r["request_id"]) is False  # once: then it had ended already
    assert idx.route_done("never-issued") is None
    r = idx.route(p, max_tokens=100)
    clock.advance(61)
    idx.inflight.expire()
    assert idx.inflight.load((r["engine"], 0)) == (0, 0) and idx.route_done(r["request_id"]) is False
    assert idx.inflight.counters["decode_expired"] == 1
    # Without max_tokens a request is over once its prefill is (nothing lingers).
    r = idx.route(toks(900, 2, BS))
    apply(idx, [store(toks(900, 2, BS), BS, 0, 2)], engine=r["engine"])
    assert r["request_id"] not in idx.inflight.requests and idx.route_done(r["request_id"]) is False


@pytest.mark.parametrize("how", ["drop", "restart", "clear"])
def test_R_Q_6_a_worker_removed_restarted_or_cleared_loses_its_predictions(clock, how):
    idx = fleet(clock)
    p = toks(100, 4, BS)
    apply(idx, [store(toks(1, 1, BS), BS, 0, 1)], engine="a", seq=0)
    r = idx.route(p, candidates=["a"], max_tokens=10)
    assert idx.match(p).predicted
    if how == "drop":
        idx.drop_worker("a")
    elif how == "restart":
        idx.reset_worker("a")
    else:
        apply(idx, [Cleared()], engine="a", seq=1)
    assert idx.match(p).predicted == () and idx.inflight.load(("a", 0)) == (0, 0)
    assert idx.route_done(r["request_id"]) is False and idx.inflight.counters["forgotten"] == 1
    assert idx.inflight.requests == {}


def test_R_Q_6_the_callers_load_replaces_the_index_estimate_for_that_worker_only(clock):
    idx = fleet(clock)
    idx.route(toks(100, 8, BS), candidates=["a"])
    idx.route(toks(200, 8, BS), candidates=["b"])
    r = idx.route(toks(300, 2, BS), load={"a/0": Load(0, 0)}, record=False)
    by = {x["worker"]: x["load"] for x in r["ranked"]}
    assert by["a/0"] == {"prefill_tokens": 0, "decode_blocks": 0, "source": "caller"}
    assert by["b/0"] == {"prefill_tokens": 8 * BS, "decode_blocks": 0, "source": "index"}
    assert r["worker"] == "a/0"  # the caller says a is idle; c ties on cost, a sorts first


def test_R_Q_6_a_dry_run_changes_nothing(clock):
    idx = fleet(clock)
    r = idx.route(toks(100, 8, BS), record=False)
    assert r["request_id"] is None and idx.inflight.requests == {} and idx.inflight.nodes == 0


def test_R_BAD_3_in_flight_state_is_bounded_and_evictions_counted(clock):
    idx = fleet(clock, max_in_flight=5)
    rng = random.Random(3)
    for _ in range(50):
        idx.route(toks(rng.randrange(10**6), 4, BS))
    inf = idx.inflight
    assert len(inf.requests) == 5 and inf.counters["evicted"] == 45
    assert inf.nodes <= 2 * 5
    assert sum(inf.prefill.values()) == sum(r.prefill_tokens for r in inf.requests.values())


def _edges(node) -> list[int]:
    out, stack = [], list((node.kids or {}).values())
    while stack:
        n = stack.pop()
        out.append(len(n.edge))
        stack.extend((n.kids or {}).values())
    return sorted(out)


def test_R_Q_6_a_shared_prefix_is_stored_once_and_edges_are_compressed(clock):
    idx = fleet(clock)
    p = toks(100, 32, BS)
    for _ in range(10):
        idx.route(p, candidates=["a"])
    root = idx.inflight.tries["default"]
    assert idx.inflight.nodes == 1 and _edges(root) == [32]  # ten requests, one 32-key edge
    idx.route(p[: 16 * BS] + toks(7, 4, BS), candidates=["b"])
    assert idx.inflight.nodes == 3 and _edges(root) == [4, 16, 16]
    idx.route(p[: 8 * BS], candidates=["c"])  # ends inside an edge: split there
    assert idx.inflight.nodes == 4 and _edges(root) == [4, 8, 8, 16]
    assert idx.match(p).predicted == (("a", 0, 32, 32.0), ("b", 0, 16, 16.0), ("c", 0, 8, 8.0))
    for rid in list(idx.inflight.requests):
        idx.route_done(rid)
    assert idx.inflight.nodes == 0 and "default" not in idx.inflight.tries


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_R_Q_6_predictions_agree_with_an_independent_model(clock, seed):
    """Random routes, announcements, expiries, completions and restarts; after each,
    the predicted blocks of random queries equal a brute-force model: per worker, the
    longest common prefix with any live recorded prompt, minus what it announced."""
    rng = random.Random(seed)
    idx = PrefixIndex(clock=clock, prefill_ttl_s=5.0)
    workers = ["a", "b", "c", "d"]
    for e in workers:
        idx.register_worker(e, 0)
    stems = [toks(1000 * i, 12, BS) for i in range(4)]
    live: list[tuple[str, list[int], float, str]] = []  # (worker, token blocks, expiry, id)
    announced: dict[str, list[list[int]]] = {w: [] for w in workers}
    seqs = dict.fromkeys(workers, 0)

    def blocks(t):
        return [tuple(t[i:i + BS]) for i in range(0, len(t) - len(t) % BS, BS)]

    def prompt():
        s = rng.choice(stems)
        cut = rng.randrange(1, 13) * BS
        return s[:cut] + toks(rng.randrange(10**6), rng.randrange(0, 3), BS)

    for _ in range(OPS):
        op = rng.random()
        if op < 0.5:
            p = prompt()
            w = rng.choice(workers)
            r = idx.route(p, candidates=[w])
            held = max([_lcp(blocks(p), blocks(a)) for a in announced[w]] or [0])
            if held < len(blocks(p)):
                live.append((w, p, clock() + 5.0, r["request_id"]))
        elif op < 0.7 and live:
            w, p, _, rid = live.pop(rng.randrange(len(live)))
            # The worker announces that prompt (its prefill ended).
            apply(idx, [store(p, BS, 0, len(p) // BS)], engine=w, seq=seqs[w])
            seqs[w] += 1
            announced[w].append(p[: len(p) // BS * BS])
            live = [x for x in live if not (x[0] == w and _lcp(blocks(x[1]), blocks(p)) == len(blocks(x[1])))]
        elif op < 0.8:
            clock.advance(rng.choice([0.5, 2.0, 6.0]))
            live = [x for x in live if x[2] > clock()]
        elif op < 0.85 and live:
            w, p, _, rid = live.pop(rng.randrange(len(live)))
            assert idx.route_done(rid)
        elif op < 0.88:
            w = rng.choice(workers)
            idx.reset_worker(w)
            announced[w] = []
            live = [x for x in live if x[0] != w]
        q = prompt()
        got = {(e, r): n for e, r, n, _ in idx.match(q).predicted}
        exp = {}
        for w in workers:
            pred = max([_lcp(blocks(q), blocks(p)) for ww, p, _, _ in live if ww == w] or [0])
            ann = max([_lcp(blocks(q), blocks(a)) for a in announced[w]] or [0])
            if pred > ann:
                exp[(w, 0)] = pred - ann
        assert got == exp


def test_R_Q_7_the_request_in_prefill_counts_only_what_is_left_of_it(clock):
    """A FIFO engine works on its oldest pending request: at the rate learned from its
    announcements, that one has done (now - its start) x rate of its tokens already."""
    idx = fleet(clock)
    p1, p2, p3 = toks(100, 8, BS), toks(900, 16, BS), toks(5000, 4, BS)
    idx.route(p1, candidates=["a"])
    assert idx.inflight.load(("a", 0)) == (128, 0)  # no rate learned yet: all of it
    clock.advance(2.0)
    apply(idx, [store(p1, BS, 0, 8)], engine="a")  # 128 tokens in 2 s: 64 tokens/s
    assert idx.inflight.rate[("a", 0)] == 64.0
    idx.route(p2, candidates=["a"])  # 256 tokens, starts now (the engine is idle)
    idx.route(p3, candidates=["a"])  # 64 tokens, waits behind it
    assert idx.inflight.load(("a", 0)) == (320, 0)
    clock.advance(1.0)
    assert idx.inflight.load(("a", 0)) == (320 - 64, 0)
    clock.advance(10.0)  # p2 should be done by now: at most all of it, never more
    assert idx.inflight.load(("a", 0)) == (64, 0)
    # p2 announced late (at 4x the time): the rate learns from it (EMA), p3 starts now.
    apply(idx, [store(p2, BS, 0, 16)], engine="a", seq=None)
    assert 64.0 > idx.inflight.rate[("a", 0)] > 40.0
    assert idx.inflight.load(("a", 0)) == (64, 0)
