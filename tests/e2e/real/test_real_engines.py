"""The index held to real vLLM engines: the engine's own ``cached_tokens`` is the truth.

One fleet of two engines at block size 32 with a small cache (64 blocks: evictions),
each engine with another hash set-up (sha256 with int hashes, sha256_cbor with bytes
hashes: what the index keys on must not depend on either, R-KEY-2). Requests are
token ids, salted token ids (vLLM's ``cache_salt``), text prompts and chat messages,
routed by ``/v1/route`` without load; see ``fleet.py`` for the claim. Then, on the same
fleet: the engines' own ``/metrics`` read by the scraper, ``kill -9`` and a new
incarnation on the same ports (with the index up, and with the index down and warm
restarted from its snapshot), a reset prefix cache told through
``POST /v1/engines/{id}/clear``, and an engine that never comes back.
"""

from __future__ import annotations

import time

import pytest

from fleet import Tally, Workload, held_blocks, report, routed_request, run_routed, start_engines, start_index
from svc import Server, wait_until
from vllm_engine import VllmEngine

MODEL = "tiny"
KINDS = {"tokens": 50, "salt": 15, "prompt": 15, "messages": 20}


@pytest.fixture(scope="module")
def fleet(engine_python, tiny_model, engine_logs):
    engines = [VllmEngine(engine_python, tiny_model, "e1", engine_logs, hash_algo="sha256", int_hashes=True),
               VllmEngine(engine_python, tiny_model, "e2", engine_logs, hash_algo="sha256_cbor", int_hashes=False)]
    try:
        start_engines(engines)
        yield {e.name: e for e in engines}
    finally:
        for e in engines:
            e.kill()


@pytest.fixture(scope="module")
def index(fleet, tiny_model, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    srv = start_index(list(fleet.values()), tiny_model, "--state-dir", str(state), "--snapshot-interval-s", "0")
    srv.state_dir = state
    yield srv
    srv.stop()


def run(srv: Server, fleet, n: int, seed: int, tally: Tally | None = None) -> Tally:
    return run_routed(srv, fleet, MODEL, Workload(seed, 32, 1024, KINDS), n, tally)


def test_claims_equal_the_engines_cached_tokens_with_evictions_salt_text_and_chat(fleet, index):
    """240 routed requests over two engines whose caches hold 64 blocks each (the
    conversations outgrow them: evictions throughout). Every claim must equal what the
    engine reused: the index is exact in steady state, whatever the request's kind."""
    tally = run(index, fleet, 240, seed=1)
    report("bs32 steady (e1 sha256/int, e2 sha256_cbor/bytes)", tally)
    assert tally.total == 240 and set(tally.n) == set(KINDS)
    assert len(tally.routed) == 2, tally.routed  # both engines used
    assert tally.reused_tokens > 240 * 32, tally.line()  # the prefixes really were reused
    assert tally.misses == [], tally.misses[:5]
    c = index.client.metrics()
    evicted = sum(v for (name, labels), v in c.items()
                  if name == "kvi_events_total" and ("event_type", "BlockRemoved") in labels)
    assert evicted > 0, "the small caches evicted nothing: the case does not test evictions"


def test_text_and_chat_token_ids_equal_the_engines_own(fleet, index):
    """Our ``prompt`` and ``messages`` paths give the ids the engine's own tokenizer and
    chat path give (the engine's ``/tokenize``, with and without messages)."""
    w = Workload(7, 32, 1024, {"prompt": 1, "messages": 1})
    e = fleet["e1"]
    for _ in range(24):
        kind, ix_body, _ = w.next()
        st, ours = index.client.post("/v1/tokenize", {"model": MODEL, **ix_body})
        assert st == 200, ours
        theirs = e.call("/tokenize", {"model": MODEL, **ix_body})
        assert ours["token_ids"] == theirs["tokens"], (kind, ix_body)


def test_the_scraper_reads_a_real_engines_metrics(fleet, index):
    """The scraper reads each real engine's ``/metrics``: its waiting and running
    requests and KV usage reach ``/v1/workers`` (the figures of an idle engine: none
    waiting or running, usage in [0, 1])."""
    def loads():
        ws = index.client.get("/v1/workers")[1]
        return {w["engine"]: w["engine_load"] for w in ws}

    wait_until(lambda: all(v is not None for v in loads().values()), timeout=15, msg=lambda: f"scraped: {loads()}")
    for name, el in loads().items():
        assert el["waiting"] == 0 and el["running"] == 0, (name, el)
        assert 0.0 <= el["kv_usage"] <= 1.0 and el["age_s"] < 10, (name, el)


def _old_prompts_gone(index, bodies, engine: str) -> bool:
    return all(held_blocks(index, MODEL, b, engine) == 0 for b in bodies)


def _prompts_on(fleet, index, engine: str, n: int, seed: int) -> list[dict]:
    """Send ``n`` prompts straight to ``engine`` (not routed) and wait until indexed."""
    w = Workload(seed, 32, 1024, {"tokens": 1})
    bodies = []
    for _ in range(n):
        _, ix_body, eng_body = w.next()
        fleet[engine].complete(eng_body)
        bodies.append(ix_body)
    wait_until(lambda: all(held_blocks(index, MODEL, b, engine) > 0 for b in bodies), timeout=15,
               msg=f"prompts indexed on {engine}")
    return bodies


def test_kill9_and_a_new_incarnation_on_the_same_ports_drop_the_old_blocks_before_any_route(fleet, index):
    """kill -9 of e1, a new incarnation on the same ports. The new engine publishes
    nothing until its first request, yet the old blocks must be gone as soon as its
    sockets are up (the reconnect's proof finds an empty replay ring: a restart), before
    /health even answers. Then routing is exact again."""
    e1 = fleet["e1"]
    bodies = _prompts_on(fleet, index, "e1", 6, seed=11)
    e1.kill()
    wait_until(lambda: not _worker(index, "e1")["connected"], timeout=10, msg="disconnect seen")
    assert not _old_prompts_gone(index, bodies, "e1")  # kept while the engine is away (it may come back)
    e1.start()
    e1.wait_up()
    # /health answers well after the ZMQ sockets bind (the engine core binds them
    # before the model is warmed up), so nothing may be left by now.
    assert _old_prompts_gone(index, bodies, "e1"), _worker(index, "e1")
    w = _worker(index, "e1")
    assert w["restarts"] >= 1 and not w["stale"] and w["health"] == "ok", w
    c = index.client.metrics()
    assert c[("kvi_continuity_total", frozenset({("outcome", "restarted")}))] >= 1
    tally = run(index, fleet, 60, seed=2)
    report("bs32 after kill -9 + restart", tally)
    assert tally.misses == [], tally.misses[:5]


def test_an_engine_restarted_while_the_index_was_down(fleet, index):
    """The index stops (its snapshot written on SIGTERM); meanwhile e1 is killed and
    started again, e2 keeps running. The warm-restarted index proves each worker's
    continuity on its first connect: e1's old blocks go, e2's stay (proven, not
    dropped), and routing is exact."""
    on1 = _prompts_on(fleet, index, "e1", 4, seed=21)
    on2 = _prompts_on(fleet, index, "e2", 4, seed=22)
    index.stop()
    e1 = fleet["e1"]
    e1.kill()
    e1.start()
    e1.wait_up()
    srv = start_index(list(fleet.values()), None, "--state-dir", str(index.state_dir), "--snapshot-interval-s", "0",
                      "--tokenizer", f"{MODEL}={e1.model_dir}")
    try:
        wait_until(lambda: _old_prompts_gone(srv, on1, "e1"), timeout=10, msg=lambda: _worker(srv, "e1"))
        assert all(held_blocks(srv, MODEL, b, "e2") > 0 for b in on2), _worker(srv, "e2")
        assert not _worker(srv, "e2")["stale"] and not _worker(srv, "e1")["stale"]
        tally = run(srv, fleet, 40, seed=3)
        report("bs32 after a restart while the index was down", tally)
        assert tally.misses == [], tally.misses[:5]
    finally:
        srv.stop()
    index.__init__("--engine", fleet["e1"].config(), "--engine", fleet["e2"].config(),  # type: ignore[misc]
                   "--state-dir", str(index.state_dir), "--snapshot-interval-s", "0",
                   "--tokenizer", f"{MODEL}={e1.model_dir}")
    wait_until(lambda: all(w.get("connected") for w in index.client.get("/v1/workers")[1]), timeout=30)


def test_a_reset_prefix_cache_told_through_clear_is_never_claimed(fleet, index):
    """vLLM's /reset_prefix_cache queues AllBlocksCleared until its next step, so an
    idle engine keeps looking full. POST /v1/engines/e2/clear, sent with the reset,
    drops e2's blocks at once; the next requests are claimed exactly (the engine's
    own AllBlocksCleared, when it comes, changes nothing more)."""
    bodies = _prompts_on(fleet, index, "e2", 4, seed=31)
    e2 = fleet["e2"]
    e2.call("/reset_prefix_cache", {})
    time.sleep(0.5)  # what vLLM would publish now, it would have: it publishes nothing
    assert not _old_prompts_gone(index, bodies, "e2"), "the engine published its clear at once: the case is moot"
    st, out = index.client.post("/v1/engines/e2/clear", {})
    assert (st, out) == (200, {"cleared": "e2", "workers": 1})
    assert _old_prompts_gone(index, bodies, "e2")
    st, _ = index.client.post("/v1/engines/nope/clear", {})
    assert st == 404
    tally = Tally()
    w = Workload(31, 32, 1024, {"tokens": 1})  # the same prompts again, routed
    for _ in range(4):
        kind, ix_body, eng_body = w.next()
        routed_request(index, fleet, MODEL, kind, ix_body, eng_body, tally)
    tally = run(index, fleet, 30, seed=4, tally=tally)
    report("bs32 after reset_prefix_cache + clear", tally)
    assert tally.misses == [], tally.misses[:5]


def test_an_engine_that_never_comes_back_is_disconnected_with_its_age(fleet, index):
    e2 = fleet["e2"]
    e2.kill()
    wait_until(lambda: _worker(index, "e2")["health"] == "disconnected", timeout=10, msg=lambda: _worker(index, "e2"))
    a = _worker(index, "e2")["last_event_age_s"]
    wait_until(lambda: _worker(index, "e2")["last_event_age_s"] > a + 0.5, timeout=5)
    c = index.client.metrics()
    assert c[("kvi_worker_health", frozenset({("engine", "e2"), ("dp_rank", "0"), ("health", "disconnected")}))] == 1


def _worker(srv: Server, engine: str) -> dict:
    for w in srv.client.get("/v1/workers")[1]:
        if w["engine"] == engine:
            return w
    raise AssertionError(f"no worker {engine}")
