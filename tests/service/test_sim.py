"""The fleet simulator: engines behave like vLLM's caches where it matters, publish the
events vLLM would, and the index fed by them agrees with what each engine really holds
(in-process and over real ZMQ)."""

from __future__ import annotations

import random

import pytest

from indexer import PrefixIndex
from indexer.ingest.live import Indexer
from indexer.producer.sim import (
    Fleet, IndexRouter, LeastLoaded, Oracle, Request, RoundRobin, SimClock, SimEngine, compare_policies, engine_hashes,
    fleet_engines, simulate, synthetic_requests, trace_requests, versus,
)
from indexer.query.route import Load
from indexer.producer.events import Cleared, Removed, Stored
from svc import wait_for

BS = 16


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(65536) for _ in range(n)]


def test_gpu_cache_stores_with_parents_and_evicts_lru_leaves_first():
    got: list = []
    e = SimEngine("e", sink=got.append, block_size=BS, gpu_blocks=8)
    a = toks(1, 6 * BS)
    assert e.serve(a) == (6, 0, 0, 1)
    (st,) = got.pop()
    hs = engine_hashes(a, BS)
    assert isinstance(st, Stored) and st.block_hashes == hs and st.parent_block_hash is None
    assert st.token_ids == a and st.block_size == BS and st.medium == "GPU"
    # The same prompt plus 2 blocks: 6 hit, the 2 new ones chained to block 5.
    a2 = a + toks(2, 2 * BS)
    assert e.serve(a2)[:3] == (8, 6, 0)
    (st,) = got.pop()
    assert st.parent_block_hash == hs[5] and st.token_ids == a2[6 * BS :]
    # A new 3-block prompt needs room: the LRU end holds a2's leaves, evicted first.
    b = toks(3, 3 * BS)
    e.serve(b)
    rem, st = got.pop()
    assert isinstance(rem, Removed) and rem.block_hashes == engine_hashes(a2, BS)[-1:-4:-1]
    assert e.probe(a2) == (5, 0) and e.probe(b) == (3, 0)
    e.reset()
    assert isinstance(got.pop()[0], Cleared) and e.probe(b) == (0, 0)


def test_cpu_tier_offloads_aligned_self_describing_chunks_and_loads_them_back():
    got: list = []
    e = SimEngine("e", sink=got.append, block_size=BS, gpu_blocks=8, cpu_blocks=12, blocks_per_chunk=4)
    a = toks(1, 6 * BS)  # 6 blocks: one whole chunk (0-3), the rest is not a chunk
    e.serve(a)
    gpu_store, cpu_store = got.pop()
    hs = engine_hashes(a, BS)
    assert cpu_store.medium == "CPU" and cpu_store.block_hashes == hs[:4] and cpu_store.parent_block_hash is None
    assert cpu_store.token_ids == a[: 4 * BS] and cpu_store.block_size == BS
    # Push a out of the GPU with a 8-block prompt; a's chunk stays in the CPU tier.
    b = toks(2, 8 * BS)
    e.serve(b)
    assert e.probe(a) == (0, 4)
    assert e.serve(a)[:3] == (6, 0, 4)  # 4 blocks loaded from CPU, 2 computed
    # Hash-only CPU events when not self-describing.
    got.clear()
    e2 = SimEngine("e", sink=got.append, block_size=BS, gpu_blocks=8, cpu_blocks=8, blocks_per_chunk=4,
                   self_describing=False)
    e2.serve(a)
    cpu_store = got.pop()[1]
    assert cpu_store.token_ids == [] and cpu_store.block_size == 0 and cpu_store.block_hashes == hs[:4]


def agree(index: PrefixIndex, engines: list[SimEngine], prompts: list[list[int]], model: str = "default") -> int:
    """Assert the index reports, for every prompt and worker, exactly what the engine would
    find (GPU prefix, and GPU + whole CPU chunks as ``total``); returns blocks checked."""
    checked = 0
    for p in prompts:
        res = index.match(p, model=model)
        for e in engines:
            g, c = e.probe(p)
            w = res.worker(e.engine, e.dp_rank)
            got = (0, 0) if w is None else (w.tiers.get("GPU", 0), w.total_blocks - w.tiers.get("GPU", 0))
            assert got == (g, c), (e.name, got, (g, c))
            checked += g + c
    return checked


def replay_requests(workload: str, n: int, request) -> list[Request]:
    """The first ``n`` requests of the Mooncake trace (cut to 4,096 tokens; the test is
    skipped without the trace), or ``n`` synthetic ones of that size: a shared
    2,048-token prefix, then 2,048 tokens of their own."""
    if workload == "trace":
        return list(trace_requests(request.getfixturevalue("mooncake_trace"), limit=n, max_tokens=4096))
    return list(synthetic_requests(n, prefix_tokens=2048, suffix_tokens=2048))


@pytest.mark.parametrize("version", ["0.33", "0.23"])
@pytest.mark.parametrize("workload", ["trace", "synthetic"])
def test_the_index_agrees_with_every_engine_after_a_trace_replay(workload, version, request):
    idx = PrefixIndex()
    engines = fleet_engines(4, 2, index=idx, version=version, gpu_blocks=2048, cpu_blocks=4096, blocks_per_chunk=16)
    reqs = replay_requests(workload, 300, request)
    rep = simulate(reqs, engines, IndexRouter(idx))
    assert rep.requests == 300 and rep.gpu_hit_tokens > 0 and rep.cpu_hit_tokens > 0
    # Evictions happened in both tiers, so agreement is not just "everything is there".
    assert idx.stats()["events"]["BlockRemoved"]["applied"] > 0
    prompts = [r.tokens for r in reqs[::7]]
    assert agree(idx, engines, prompts) > 1000


def test_policies_report_hit_rates_and_the_index_wins_on_shared_prefixes():
    reqs = list(synthetic_requests(400, prefixes=12, prefix_tokens=1024, suffix_tokens=256, rate=50))
    reports = compare_policies(reqs, 4, gpu_blocks=300)
    by = {r.policy: r.summary() for r in reports}
    assert set(by) == {"round_robin", "least_loaded", "index"}
    for s in by.values():
        assert s["requests"] == 400 and s["prompt_tokens"] == sum(len(r.tokens) for r in reqs)
        assert s["prefill_tokens_saved"] + s["prefill_tokens_computed"] == s["prompt_tokens"]
        assert sum(w["requests"] for w in s["per_worker"].values()) == 400
    # Cache-aware routing keeps each prefix on few engines: more hits than either blind policy.
    assert by["index"]["hit_rate"] > by["round_robin"]["hit_rate"] + 0.1
    assert by["index"]["hit_rate"] > by["least_loaded"]["hit_rate"] + 0.1
    assert RoundRobin().choose([], ["a", "b"], {}) == "a"
    assert LeastLoaded().choose([], ["a", "b"], {"a": (1600, 0), "b": (0, 50)}) == "b"


@pytest.mark.parametrize("workload", ["trace", "synthetic"])
def test_R_STR_the_index_agrees_with_a_fleet_over_real_zmq(workload, request):
    reqs = replay_requests(workload, 80, request)
    fleet = Fleet(2, 2, gpu_blocks=1024, cpu_blocks=2048, blocks_per_chunk=16)
    ix = Indexer(fleet.engine_configs())
    ix.start()
    try:
        wait_for(lambda: all(w.get("connected") for w in ix.workers()), what="SUBs connected")
        router = IndexRouter(ix.index)
        # Late joiners and slow joiners are repaired by replay: no need to wait first.
        simulate(reqs, fleet.sims, router)
        last = {(p.dp_rank, s.engine): p.next_seq - 1 for s, p in zip(fleet.sims, fleet.pubs)}
        wait_for(lambda: all(w["last_seq"] == last[(w["dp_rank"], w["engine"])] and not w["replaying"]
                             for w in ix.workers()), timeout=20, what="every batch applied")
        assert agree(ix.index, fleet.sims, [r.tokens for r in reqs[::5]]) > 500
        assert not any(w["stale"] for w in ix.workers())
    finally:
        ix.stop()
        fleet.close()


def test_realtime_replay_stops_on_request():
    import threading

    stop = threading.Event()
    stop.set()
    rep = simulate([Request(5.0, [1] * 32, 1)], [SimEngine("e")], RoundRobin(), realtime=True, stop=stop)
    assert rep.requests == 0


def test_the_http_router_routes_a_fleet_through_a_running_service(serve):
    import json

    from indexer.producer.sim import HttpRouter

    fleet = Fleet(2, 1, gpu_blocks=1024)
    try:
        s = serve(env={"KVI_ENGINES": json.dumps(fleet.engine_configs())})
        # Ready since ingest runs (ready_fraction 0); no reasons = every worker connected.
        wait_for(lambda: s.client.get("/readyz")[1]["reasons"] == [], what="the fleet connected")
        reqs = list(synthetic_requests(40, prefixes=2, prefix_tokens=512, suffix_tokens=64, rate=1000))
        router = HttpRouter(f"http://127.0.0.1:{s.port}")
        try:
            rep = simulate(reqs, fleet.sims, router)
        finally:
            router.close()
        assert rep.requests == 40 and sum(w["requests"] for w in rep.per_worker.values()) == 40
        assert rep.gpu_hit_tokens > 0  # the service saw the fleet's events and routed to the caches
        m = s.client.metrics()
        assert m[("kvi_query_duration_seconds_count", frozenset({("route", "/v1/route")}))] == 40
    finally:
        fleet.close()


# ------------------------------------------------------------------ time


class _Recorder:
    """Routes to ``to`` (or the first worker), noting at each decision the blocks the
    index knows for the prompt on that worker and the load the simulator passed."""

    name = "recorder"

    def __init__(self, index: PrefixIndex, to: str | None = None) -> None:
        self.index, self.to, self.seen, self.loads = index, to, [], []

    def choose(self, tokens, workers, loads):
        w = self.to or workers[0]
        e, r = w.split("/")
        wm = self.index.match(tokens).worker(e, int(r))
        self.seen.append(0 if wm is None else wm.total_blocks)
        self.loads.append(dict(loads))
        return w


def test_events_reach_the_index_at_prefill_end_plus_the_delay_on_the_sim_clock():
    clock = SimClock()
    idx = PrefixIndex(clock=clock)
    stamps: list[float] = []
    engines = fleet_engines(2, index=idx, clock=clock, block_size=BS, gpu_blocks=1000)
    inner = engines[0].sink
    engines[0].sink = lambda ev: (stamps.append(clock()), inner(ev))
    a = toks(1, 10 * BS)  # 160 tokens at 1,000 tokens/s: prefill 0 -> 0.16, announced at 0.21
    reqs = [Request(0.0, a, 1), Request(0.2, a, 1), Request(0.22, a, 1), Request(0.3, a + toks(2, BS), 1)]
    rec = _Recorder(idx)
    rep = simulate(reqs, engines, rec, prefill_tps=1000.0, event_delay_s=0.05, clock=clock)
    # 0.2: the engine holds a (it hit all 10 blocks) but the index has not heard; at 0.22 it has.
    assert rec.seen == [0, 0, 10, 10]
    assert [h for _, _, h in rep.timeline] == [0, 160, 160, 160]
    # The first batch was applied at its delivery time on the sim clock; the 4th request's
    # (prefill 0.3 -> 0.316) is delivered after the last request, at 0.366.
    assert stamps[0] == pytest.approx(0.21) and stamps[-1] == pytest.approx(0.366)
    assert clock() == pytest.approx(0.366)
    # The backlog the router saw: at 0.2 none (a's prefill ended at 0.16).
    assert rec.loads[1]["sim-0/0"][0] == 0
    # With no delay at all (event_delay_s=None) the index knows at once.
    idx2 = PrefixIndex()
    rec2 = _Recorder(idx2)
    simulate(reqs, fleet_engines(2, index=idx2, block_size=BS, gpu_blocks=1000), rec2, prefill_tps=1000.0,
             event_delay_s=None)
    assert rec2.seen == [0, 10, 10, 10]
    # The engines' own sinks are back after the run.
    assert engines[1].sink is not None and engines[1].sink.__name__ == "sink"


def test_evictions_reach_the_index_when_the_evicting_prefill_starts():
    clock = SimClock()
    idx = PrefixIndex(clock=clock)
    engines = fleet_engines(1, index=idx, clock=clock, block_size=BS, gpu_blocks=12)
    a, b = toks(1, 10 * BS), toks(2, 10 * BS)
    # a: prefill 0 -> 0.16, stored at 0.21. b queues behind it: starts at 0.16 and evicts 8
    # of a's blocks (leaves first), removed at 0.21 too, after a's store (publish order).
    reqs = [Request(0.0, a, 1), Request(0.05, b, 1), Request(0.2, a, 1), Request(0.22, a, 1)]
    rec = _Recorder(idx)
    simulate(reqs, engines, rec, prefill_tps=1000.0, event_delay_s=0.05, clock=clock)
    assert rec.seen == [0, 0, 0, 2]
    assert agree(idx, engines, [a, b]) > 0  # and all is told in the end


def test_ttft_is_fifo_prefill_of_the_uncached_tokens_by_hand():
    a = toks(1, 10 * BS)
    reqs = [
        Request(0.0, a, 1),                   # computes 160: 0 -> 0.16
        Request(0.1, a + toks(2, 2 * BS), 1),  # hits a's 10 blocks (160), computes 32: waits, 0.16 -> 0.192
        Request(0.15, toks(3, 40), 1),         # 2 blocks + 8 tokens, no hit: 0.192 -> 0.232
        Request(1.0, toks(4, 3 * BS), 1),      # idle worker: 1.0 -> 1.048
    ]
    e = SimEngine("e", block_size=BS, gpu_blocks=1000)
    rep = simulate(reqs, [e], RoundRobin(), prefill_tps=1000.0)
    assert rep.ttft_s == pytest.approx([0.16, 0.092, 0.082, 0.048])
    s = rep.summary()
    assert s["ttft_mean_s"] == pytest.approx((0.16 + 0.092 + 0.082 + 0.048) / 4)
    assert s["ttft_p90_s"] == pytest.approx(0.16) and s["ttft_p50_s"] == pytest.approx(0.082)
    assert s["hit_rate"] == pytest.approx(160 / (160 + 192 + 40 + 48))
    # Two workers, round robin: each its own FIFO queue.
    rep2 = simulate(reqs, [SimEngine("a", block_size=BS), SimEngine("b", block_size=BS)], RoundRobin(),
                    prefill_tps=1000.0)
    # a: 0 -> 0.16, then the 3rd 0.16 -> 0.2; b: the 2nd computes all 192, 0.1 -> 0.292; the 4th 1.0 -> 1.048
    assert rep2.ttft_s == pytest.approx([0.16, 0.192, 0.05, 0.048])


def test_the_oracle_weighs_the_real_cache_against_the_real_queue():
    a = toks(1, 10 * BS)
    hot, cold = SimEngine("hot", block_size=BS), SimEngine("cold", block_size=BS)
    hot.serve(a)
    o = Oracle([hot, cold])
    q = a + toks(2, 2 * BS)  # 192 tokens, 160 cached on hot
    names = ["cold/0", "hot/0"]
    assert o.choose(q, names, {"cold/0": Load(0, 0), "hot/0": Load(0, 0)}) == "hot/0"  # 32 < 192
    assert o.choose(q, names, {"cold/0": Load(0, 0), "hot/0": Load(161, 0)}) == "cold/0"  # 193 > 192
    assert o.choose(q, names, {"cold/0": Load(0, 0), "hot/0": Load(160, 0)}) == "hot/0"  # a tie: more hits
    assert o.choose(toks(3, 64), names, {"cold/0": Load(0, 0), "hot/0": Load(0, 0)}) == "cold/0"  # tie: name
    assert hot.probe(q) == (10, 0)  # asking changed nothing


def test_the_oracle_beats_round_robin_and_the_index_with_load_comes_close():
    reqs = list(synthetic_requests(300, prefixes=12, prefix_tokens=1024, suffix_tokens=256, rate=40, seed=3))
    reports = compare_policies(reqs, 4, policies=["round_robin", "index", "oracle"], gpu_blocks=400,
                               prefill_tps=30_000.0)
    by = {r.policy: r.summary() for r in reports}
    vs = versus(reports)
    assert by["oracle"]["ttft_mean_s"] < by["round_robin"]["ttft_mean_s"]
    assert by["oracle"]["hit_rate"] > by["round_robin"]["hit_rate"]
    assert vs["oracle"] == {"ttft_mean_ratio": 1.0, "ttft_p90_ratio": 1.0, "cached_share_ratio": 1.0}
    assert vs["round_robin"]["ttft_mean_ratio"] > 1.2
    assert vs["index"]["ttft_mean_ratio"] < vs["round_robin"]["ttft_mean_ratio"]
    assert vs["index"]["cached_share_ratio"] > 0.9


def test_the_index_without_load_spreads_a_burst_by_its_own_bookkeeping():
    # 8 distinct prompts at once, nothing cached anywhere: with no load passed, only the
    # index's record of what it routed (not yet announced) can keep them apart.
    clock = SimClock()
    idx = PrefixIndex(clock=clock)
    engines = fleet_engines(4, index=idx, clock=clock, block_size=BS)
    reqs = [Request(0.0, toks(i, 32 * BS), 1) for i in range(8)]
    rep = simulate(reqs, engines, IndexRouter(idx, mode="no_load"), prefill_tps=1000.0, clock=clock)
    assert sorted(w["requests"] for w in rep.per_worker.values()) == [2, 2, 2, 2]
    idx2 = PrefixIndex()
    cache_only = simulate(reqs, fleet_engines(4, index=idx2, block_size=BS), IndexRouter(idx2, use_load=False),
                          prefill_tps=1000.0)
    assert cache_only.per_worker["sim-0/0"]["requests"] == 8
    with pytest.raises(ValueError, match="unknown mode"):
        IndexRouter(idx, mode="psychic")


def test_realtime_replay_delivers_held_events_on_time():
    import time

    got: list[float] = []
    start = time.monotonic()
    e = SimEngine("e", block_size=BS, sink=lambda ev: got.append(time.monotonic() - start))
    reqs = [Request(0.0, toks(1, 4 * BS), 1), Request(0.05, toks(2, 4 * BS), 1)]
    simulate(reqs, [e], RoundRobin(), prefill_tps=6400.0, realtime=True, event_delay_s=0.1)
    # prefill ends 0.01 and 0.06; events at 0.11 and 0.16 of wall time.
    assert len(got) == 2 and 0.1 <= got[0] < 0.16 and 0.15 <= got[1] < 0.3
