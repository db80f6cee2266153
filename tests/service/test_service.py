"""The HTTP service end to end: a real ``kv-indexer serve`` process on 127.0.0.1, engines
registered over the API, events from the vLLM-compatible publisher over real ZMQ, and
``/metrics`` read with prometheus_client's parser."""

from __future__ import annotations

import http.client
import json

import pytest

from evkit import chunks, ehashes, removed, store, toks
from indexer.producer.publisher import VllmPublisher
from svc import Client, PortHold, Server, sample, wait_for, wait_subscribed

BS = 16
MAX_TOKENS = 4096
MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def server():
    s = Server("--max-request-tokens", str(MAX_TOKENS), "--replay-timeout-s", "1",
               env={"KVI_MAX_REQUEST_BYTES": str(MAX_BYTES)})
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def api(server):
    """The module's server with a fresh connection; engines a test registers are removed after it."""
    c = Client(server.port)
    yield c
    for e in c.get("/v1/engines")[1]:
        c.delete(f"/v1/engines/{e['id']}")


def worker(api: Client, engine: str, rank: int = 0) -> dict:
    for w in api.get("/v1/workers")[1]:
        if w["engine"] == engine and w["dp_rank"] == rank:
            return w
    raise AssertionError(f"no worker {engine}/{rank}")


def applied_through(api: Client, engine: str, seq: int) -> None:
    wait_for(lambda: worker(api, engine)["last_seq"] == seq, what=f"{engine} to apply seq {seq}")


def connect(api: Client, engine: str, pub: VllmPublisher, **fields) -> None:
    """Register ``engine`` and wait until its subscription is live."""
    st, body = api.post("/v1/engines", {"id": engine, "endpoint": pub.live_endpoint, **fields})
    assert st == 201, body
    wait_subscribed(api, pub, engine)


# ----------------------------------------------------------------------------- ops


def test_health_openapi_docs_and_metrics_path(api):
    assert api.get("/healthz") == (200, {"status": "ok"})
    st, spec = api.get("/openapi.json")
    assert st == 200
    for path in ("/v1/match", "/v1/match_by_keys", "/v1/route", "/v1/engines", "/v1/engines/{engine_id}",
                 "/v1/workers", "/v1/stats", "/healthz", "/readyz", "/metrics",
                 "/query", "/query_by_hash", "/register", "/unregister", "/workers", "/health"):
        assert path in spec["paths"], path
    # The request schema is the one the handler validates with.
    body = spec["paths"]["/v1/match"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/MatchRequest"}
    tok = spec["components"]["schemas"]["MatchRequest"]["properties"]["token_ids"]
    tok = next(a for a in tok.get("anyOf", [tok]) if a.get("type") == "array")  # or a prompt, messages (R-TXT-3)
    assert tok["maxItems"] >= 1  # max_request_tokens (R-BAD-2)
    assert tok["items"]["maximum"] == 2**32 - 1 and tok["minItems"] == 1
    st, html = api.get("/docs")
    assert st == 200 and "swagger" in html.lower()
    # /metrics at exactly that path: 200, no redirect, Prometheus text.
    api.conn.request("GET", "/metrics")
    r = api.conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
    r.read()


def test_readyz_by_default_stays_ready_and_names_an_engine_that_never_connected(api, pubs):
    assert api.get("/readyz") == (200, {"ready": True, "reasons": []})
    with PortHold() as hold:  # held until the publisher binds it: refused meanwhile, nobody else's
        port = hold.port
        st, _ = api.post("/v1/engines", {"id": "late", "endpoint": f"tcp://127.0.0.1:{port}"})
        assert st == 201
        # ready_fraction 0 (the default): one unreachable engine does not take the pod out
        # of its Service; the reasons, /v1/workers and the metrics say which one is down.
        st, body = api.get("/readyz")
        assert (st, body) == (200, {"ready": True, "reasons": [f"late/0: not connected to tcp://127.0.0.1:{port}"]})
        assert worker(api, "late")["health"] == "never_connected"
        assert sample(api.metrics(), "kvi_worker_health", engine="late", dp_rank="0", health="never_connected") == 1
        pubs(f"tcp://127.0.0.1:{port}")
    wait_for(lambda: api.get("/readyz")[1]["reasons"] == [], what="readyz reasons after the publisher bound")
    assert worker(api, "late")["health"] == "ok"
    assert sample(api.metrics(), "kvi_worker_health", engine="late", dp_rank="0", health="ok") == 1


# ------------------------------------------------------------------ the main flow


def test_R_Q_2_R_Q_3_register_publish_match_route_and_count(api, pubs):
    a, b = toks(1000, 8, BS), toks(5000, 4, BS)
    ha = ehashes(a, BS)
    pa = pubs(replay_endpoint="tcp://127.0.0.1:*")
    pb = pubs()
    connect(api, "svc-a", pa, replay_endpoint=pa.bound_replay_endpoint, model="m1")
    connect(api, "svc-b", pb, model="m1")
    m0 = api.metrics()

    # svc-a: GPU blocks 0-3, CPU chunks of 4 covering 0-7, then the GPU drops 2-3.
    pa.publish([store(a, BS, 0, 4)])
    pa.publish(chunks(a, BS, 4, medium="CPU"))
    pa.publish([removed(ha[2:4][::-1])])
    # svc-b: the first 2 blocks of the same prompt on its GPU.
    pb.publish([store(a, BS, 0, 2)])
    applied_through(api, "svc-a", 2)
    applied_through(api, "svc-b", 0)

    st, res = api.post("/v1/match", {"token_ids": a + [7] * 5, "model": "m1"})
    assert st == 200, res
    assert res["model"] == "m1" and res["block_size"] == BS and res["query_blocks"] == 8
    wa, wb = res["workers"]
    assert (wa["engine"], wa["tiers"], wa["total_blocks"], wa["total_tokens"]) == ("svc-a", {"GPU": 2, "CPU": 8}, 8, 128)
    assert wa["score"] == 2 + 6 * 0.75 and wa["stale"] is False and wa["last_seq"] == 2
    assert wa["groups"] == {"0": {"GPU": 2, "CPU": 8, "total_blocks": 8}}
    assert (wb["engine"], wb["tiers"], wb["score"]) == ("svc-b", {"GPU": 2}, 2.0)
    assert res["best"] == {"engine": "svc-a", "dp_rank": 0, "score": 6.5}

    # The same answer by block keys (signed i64, as Dynamo sends them, wraps to u64).
    from indexer.wire.keys import block_keys

    keys = block_keys(a, BS, 1337)
    signed = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]
    st, byk = api.post("/v1/match_by_keys", {"block_keys": signed, "model": "m1"})
    assert st == 200 and [(w["engine"], w["tiers"]) for w in byk["workers"]] == [
        ("svc-a", {"GPU": 2, "CPU": 8}), ("svc-b", {"GPU": 2})]

    # Route: cache first; load can outweigh it; candidates restrict; no match still answers.
    st, r = api.post("/v1/route", {"token_ids": a, "model": "m1"})
    assert st == 200 and (r["worker"], r["reason"]) == ("svc-a/0", "longest_cached_prefix")
    assert [x["worker"] for x in r["ranked"]] == ["svc-a/0", "svc-b/0"]
    assert r["ranked"][0]["cached_blocks"] == 8 and r["cost"] == 8 - 6.5
    st, r = api.post("/v1/route", {"token_ids": a, "model": "m1",
                                   "load": {"svc-a/0": {"active_decode_blocks": 100}}})
    assert (r["worker"], r["reason"]) == ("svc-b/0", "load_outweighs_cached_prefix")
    st, r = api.post("/v1/route", {"token_ids": a, "model": "m1", "candidates": ["svc-b"]})
    assert r["worker"] == "svc-b/0" and len(r["ranked"]) == 1
    st, r = api.post("/v1/route", {"token_ids": [3] * 64, "model": "m1",
                                   "load": {"svc-a": {"active_prefill_tokens": 160}}})
    assert st == 200 and (r["worker"], r["reason"]) == ("svc-b/0", "no_cached_prefix_least_loaded")

    # Counters moved by exactly what was published and asked.
    m1 = api.metrics()

    def moved(name, **labels):
        return sample(m1, name, **labels) - sample(m0, name, **labels)

    assert moved("kvi_events_total", event_type="BlockStored", outcome="applied") == 1 + 2 + 1
    assert moved("kvi_events_total", event_type="BlockRemoved", outcome="applied") == 1
    assert moved("kvi_batches_applied_total") == 4
    assert moved("kvi_query_duration_seconds_count", route="/v1/match") == 1
    assert moved("kvi_query_duration_seconds_count", route="/v1/route") == 4
    assert moved("kvi_query_matched_blocks_count", route="/v1/match_by_keys") == 1
    assert moved("kvi_query_matched_blocks_bucket", route="/v1/match", le="8.0") == 1
    assert moved("kvi_query_matched_blocks_bucket", route="/v1/match", le="4.0") == 0
    assert sample(m1, "kvi_resident_blocks", model="m1", tier="GPU", group="0") == 2 + 2
    assert sample(m1, "kvi_resident_blocks", model="m1", tier="CPU", group="0") == 8
    assert sample(m1, "kvi_nodes", model="m1", group="0") == 8
    assert sample(m1, "kvi_workers", state="connected") >= 2

    # Stats and workers agree.
    st, stats = api.get("/v1/stats")
    assert stats["models"]["m1"]["tiers"] == {"GPU": 4, "CPU": 8}
    w = worker(api, "svc-a")
    assert w["resident_blocks"] == {"GPU": 2, "CPU": 8} and w["model"] == "m1" and w["connected"]

    # A restarted engine: sequence back to 0. The metrics count it, the answers drop its state.
    pa.restart()
    b_store = store(b, BS, 0, 4)
    pa.publish([b_store])
    wait_for(lambda: worker(api, "svc-a")["restarts"] == 1, what="the restart")
    applied_through(api, "svc-a", 0)
    m2 = api.metrics()
    assert sample(m2, "kvi_restarts_total") - sample(m1, "kvi_restarts_total") == 1
    st, res = api.post("/v1/match", {"token_ids": a, "model": "m1"})
    assert [w["engine"] for w in res["workers"]] == ["svc-b"]
    st, res = api.post("/v1/match", {"token_ids": b, "model": "m1"})
    assert res["best"]["engine"] == "svc-a" and res["workers"][0]["tiers"] == {"GPU": 4}
    assert sample(m2, "kvi_resident_blocks", model="m1", tier="CPU", group="0") == 0

    # Unregistering drops the engine's state (R-STR-6).
    assert api.delete("/v1/engines/svc-a") == (200, {"removed": "svc-a", "workers": 1})
    st, res = api.post("/v1/match", {"token_ids": b, "model": "m1"})
    assert res["workers"] == []


def test_R_STR_3_a_gap_is_replayed_and_counted(api, pubs):
    t = toks(9000, 6, BS)
    p = pubs(replay_endpoint="tcp://127.0.0.1:*")
    connect(api, "gap", p, replay_endpoint=p.bound_replay_endpoint)
    m0 = api.metrics()
    p.publish([store(t, BS, 0, 2)])
    p.drop = {1}
    p.publish([store(t, BS, 2, 4)])
    p.publish([store(t, BS, 4, 6)])
    applied_through(api, "gap", 2)
    st, res = api.post("/v1/match", {"token_ids": t, "model": "default"})
    assert res["workers"][0]["tiers"] == {"GPU": 6}
    m1 = api.metrics()
    assert sample(m1, "kvi_wire_gaps_total") - sample(m0, "kvi_wire_gaps_total") == 1
    assert sample(m1, "kvi_sequence_gaps_total") - sample(m0, "kvi_sequence_gaps_total") == 0
    assert sample(m1, "kvi_replays_total", outcome="ok") - sample(m0, "kvi_replays_total", outcome="ok") == 1


def test_R_DEC_3_garbage_from_a_publisher_is_dropped_and_counted(api, pubs):
    p = pubs()
    connect(api, "junk", p)
    m0 = api.metrics()
    n0 = worker(api, "junk")["messages"]
    p.send_raw([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
    wait_for(lambda: worker(api, "junk")["messages"] == n0 + 1, what="the garbage to arrive")
    m1 = api.metrics()

    def dropped(m):
        return {dict(k[1])["reason"]: v for k, v in m.items() if k[0] == "kvi_payloads_dropped_total"}

    moved = {r: n - dropped(m0).get(r, 0) for r, n in dropped(m1).items() if n != dropped(m0).get(r, 0)}
    assert moved == {"bad_payload": 1}, moved
    # The worker is fine: the next batch applies.
    t = toks(7000, 2, BS)
    p.publish([store(t, BS, 0, 2)])
    applied_through(api, "junk", 0)
    assert api.get("/healthz")[0] == 200


# -------------------------------------------------------------------- bad input


BAD = [
    # (name, path, raw body, status)
    ("not json", "/v1/match", b"{token_ids: [1]", 400),
    ("not an object", "/v1/match", b"[1, 2]", 422),
    ("missing token_ids", "/v1/match", b"{}", 422),
    ("empty token_ids", "/v1/match", b'{"token_ids": []}', 422),
    ("negative token", "/v1/match", b'{"token_ids": [1, -1]}', 422),
    ("token above u32", "/v1/match", b'{"token_ids": [4294967296]}', 422),
    ("string token", "/v1/match", b'{"token_ids": ["1"]}', 422),
    ("float token", "/v1/match", b'{"token_ids": [1.5]}', 422),
    ("unknown field", "/v1/match", b'{"token_ids": [1], "tokens": [1]}', 422),
    ("model not a string", "/v1/match", b'{"token_ids": [1], "model": 3}', 422),
    ("unknown model", "/v1/match", b'{"token_ids": [1], "model": "nope"}', 404),
    ("model required", "/v1/match", b'{"token_ids": [1]}', 422),
    ("key above u64", "/v1/match_by_keys", b'{"block_keys": [18446744073709551616]}', 422),
    ("key below i64", "/v1/match_by_keys", b'{"block_keys": [-9223372036854775809]}', 422),
    ("empty keys", "/v1/match_by_keys", b'{"block_keys": []}', 422),
    ("negative load", "/v1/route", b'{"token_ids": [1], "load": {"x/0": {"active_decode_blocks": -1}}}', 422),
    ("load not an object", "/v1/route", b'{"token_ids": [1], "load": [1]}', 422),
    ("engine without endpoint", "/v1/engines", b'{"id": "x"}', 422),
    ("engine bad endpoint", "/v1/engines", b'{"id": "x", "endpoint": "http://h:1"}', 422),
    ("engine bad port", "/v1/engines", b'{"id": "x", "endpoint": "tcp://h:70000"}', 422),
    ("engine dp_size 0", "/v1/engines", b'{"id": "x", "endpoint": "tcp://h:1", "dp_size": 0}', 422),
    ("engine empty id", "/v1/engines", b'{"id": "", "endpoint": "tcp://h:1"}', 422),
    # Hardening: what once got a 500, was read wrongly, or was accepted and never deletable.
    ("candidate rank superscript", "/v1/route",
     '{"token_ids": [1], "model": "m1", "candidates": ["bad-input/³"]}'.encode(), 422),
    ("candidate rank arabic digit", "/v1/route",
     '{"token_ids": [1], "model": "m1", "candidates": ["bad-input/١"]}'.encode(), 422),
    ("candidate two slashes", "/v1/route", b'{"token_ids": [1], "model": "m1", "candidates": ["a/b/0"]}', 422),
    ("load key rank superscript", "/v1/route",
     '{"token_ids": [1], "model": "m1", "load": {"bad-input/³": {"active_decode_blocks": 1}}}'.encode(), 422),
    ("load key control char", "/v1/route", b'{"token_ids": [1], "model": "m1", "load": {"bad\\u0000input": {}}}', 422),
    ("engine id with slash", "/v1/engines", b'{"id": "a/0", "endpoint": "tcp://h:1"}', 422),
    ("engine id blank", "/v1/engines", b'{"id": " ", "endpoint": "tcp://h:1"}', 422),
    ("engine id inner blank", "/v1/engines", b'{"id": "a b", "endpoint": "tcp://h:1"}', 422),
    ("engine id newline", "/v1/engines", b'{"id": "a\\n", "endpoint": "tcp://h:1"}', 422),
    ("engine id NUL", "/v1/engines", b'{"id": "a\\u0000", "endpoint": "tcp://h:1"}', 422),
    ("engine id too long", "/v1/engines", b'{"id": "' + b"a" * 129 + b'", "endpoint": "tcp://h:1"}', 422),
    ("engine ipc endpoint", "/v1/engines", b'{"id": "x", "endpoint": "ipc:///etc/passwd"}', 422),
    ("engine inproc endpoint", "/v1/engines", b'{"id": "x", "endpoint": "inproc://x"}', 422),
    ("engine ipc replay endpoint", "/v1/engines",
     b'{"id": "x", "endpoint": "tcp://h:1", "replay_endpoint": "ipc:///tmp/x"}', 422),
    ("cache_salt too long", "/v1/match", b'{"token_ids": [1], "cache_salt": "' + b"s" * 1025 + b'"}', 422),
    ("lora_name too long", "/v1/match", b'{"token_ids": [1], "lora_name": "' + b"l" * 257 + b'"}', 422),
    ("dynamo cache_salt too long", "/query",
     b'{"token_ids": [1], "model_name": "m", "cache_salt": "' + b"s" * 1025 + b'"}', 422),
    ("dynamo register ipc endpoint", "/register",
     b'{"instance_id": 1, "endpoint": "ipc:///etc/passwd", "model_name": "m", "block_size": 16}', 400),
    ("dynamo query no model", "/query", b'{"token_ids": [1]}', 422),
    ("dynamo register bad block size", "/register",
     b'{"instance_id": 1, "endpoint": "tcp://h:1", "model_name": "m", "block_size": 0}', 422),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_R_BAD_1_bad_requests_get_a_clear_4xx(api, pubs, name, path, body, status):
    # Engines of two models with data (neither "default"), so "unknown model" is about the
    # model, not an empty index, and a query without a model is ambiguous.
    p = pubs()
    connect(api, "bad-input", p, model="m1")
    connect(api, "bad-input-2", pubs(), model="other")
    p.publish([store(toks(1, 2, BS), BS, 0, 2)])
    applied_through(api, "bad-input", 0)
    st, res = api.call("POST", path, body)
    assert st == status, res
    key = "detail" if path.startswith("/v1/") else "error"  # Dynamo's routes say "error"
    assert isinstance(res[key], str) and res[key]
    if name.startswith(("candidate", "load key")):
        assert res[key].startswith("malformed worker name") and "ASCII" in res[key]
    if name.startswith("engine id"):
        assert "engine id" in res[key] or "`$.id`" in res[key]
    assert api.get("/healthz")[0] == 200
    # Nothing indexed was lost, the engine is healthy, and nothing was registered.
    st, res = api.post("/v1/match", {"token_ids": toks(1, 2, BS), "model": "m1"})
    assert st == 200 and res["workers"][0]["total_blocks"] == 2
    assert worker(api, "bad-input")["health"] == "ok"
    assert sorted(e["id"] for e in api.get("/v1/engines")[1]) == ["bad-input", "bad-input-2"]


def test_R_BAD_2_oversized_requests_get_413(api):
    m0 = api.metrics()
    st, res = api.post("/v1/match", {"token_ids": [1] * (MAX_TOKENS + 1)})
    assert st == 413 and str(MAX_TOKENS) in res["detail"]
    st, res = api.post("/v1/match_by_keys", {"block_keys": [1] * (MAX_TOKENS + 1)})
    assert st == 413
    # A body over the byte bound is refused on its Content-Length, before it is parsed.
    st, res = api.call("POST", "/v1/match", b'{"token_ids": [' + b"1," * (MAX_BYTES // 2) + b"1]}")
    assert st == 413 and str(MAX_BYTES) in res["detail"]
    # At the bound: accepted, and answered by the handler (a model nothing indexed: its 404,
    # which comes after the bound is checked).
    st, res = api.post("/v1/match", {"token_ids": [1] * MAX_TOKENS, "model": "never-indexed"})
    assert (st, res) == (404, {"detail": "unknown model 'never-indexed'"})
    m1 = api.metrics()
    assert sample(m1, "kvi_api_errors_total", route="/v1/match", status=413) - \
        sample(m0, "kvi_api_errors_total", route="/v1/match", status=413) == 2


def chunked_post(port: int, path: str, parts: list[bytes]) -> tuple[int, dict, list[tuple[str, str]]]:
    """POST ``parts`` as a ``Transfer-Encoding: chunked`` body (no Content-Length) on a
    new raw connection; ``(status, JSON body, response headers)``. The server may answer
    before the body ends: sending stops quietly if it stops reading."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        try:
            for part in parts:
                conn.send(b"%x\r\n%s\r\n" % (len(part), part))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = conn.getresponse()
        return r.status, json.loads(r.read()), r.getheaders()
    finally:
        conn.close()


def _chunked_match_body(n_bytes: int, size: int = 16_384) -> list[bytes]:
    """A JSON match request of at least ``n_bytes``, cut into ``size``-byte chunks (for a
    model nothing indexes: read whole, it gets the handler's 404 naming it)."""
    body = b'{"token_ids": [' + b"1," * (n_bytes // 2) + b'1], "model": "never-indexed"}'
    return [body[i:i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "fastapi"])
def test_R_BAD_2_chunked_body_over_the_byte_limit_gets_413(server, serve, fast_path):
    """A body sent with ``Transfer-Encoding: chunked`` has no Content-Length to refuse
    it on: it is counted as it arrives and refused with 413 once past
    ``max_request_bytes``, on both the fast path and FastAPI's routing; the service
    answers normally afterwards, and a chunked body within the bound is read whole."""
    if fast_path:
        port = server.port
    else:
        port = serve(env={"KVI_FAST_PATH": "false", "KVI_MAX_REQUEST_BYTES": str(MAX_BYTES)}).port
    c = Client(port)
    m0 = c.metrics()
    parts = _chunked_match_body(MAX_BYTES + 50_000)
    assert len(parts) > 10 and sum(map(len, parts)) > MAX_BYTES + 50_000
    st, res, headers = chunked_post(port, "/v1/match", parts)
    assert st == 413, res
    assert str(MAX_BYTES) in res["detail"] and "limit" in res["detail"]
    # Within the bound, the same chunked framing is read whole and parsed: not a 413.
    small = _chunked_match_body(6_000, size=1_000)  # 3,001 tokens: under MAX_TOKENS too
    assert len(small) > 1
    st, res, _ = chunked_post(port, "/v1/match", small)
    assert (st, res) == (404, {"detail": "unknown model 'never-indexed'"})  # parsed and handled
    # Still serving, on new and old connections.
    assert c.get("/healthz") == (200, {"status": "ok"})
    assert Client(port).post("/v1/match", {"token_ids": [1] * BS, "model": "never-indexed"}) == (
        404, {"detail": "unknown model 'never-indexed'"})
    m1 = c.metrics()
    assert sample(m1, "kvi_api_errors_total", route="/v1/match", status=413) - \
        sample(m0, "kvi_api_errors_total", route="/v1/match", status=413) == 1


def test_R_BAD_1_engines_conflict_and_unknown(api, pubs):
    p = pubs()
    cfg = {"id": "dup", "endpoint": p.live_endpoint}
    assert api.post("/v1/engines", cfg)[0] == 201
    assert api.post("/v1/engines", cfg)[0] == 200  # the same again: idempotent
    st, res = api.post("/v1/engines", {**cfg, "model": "other"})
    assert st == 409 and "dup" in res["detail"]
    st, res = api.get("/v1/engines")
    assert [e["id"] for e in res] == ["dup"] and res[0]["endpoint"] == p.live_endpoint
    st, res = api.delete("/v1/engines/nope")
    assert st == 404 and "nope" in res["detail"]


def test_fast_path_and_fastapi_routes_answer_the_same(server, pubs, serve):
    """The hot routes bypass FastAPI's routing; a server without that gives byte-equal answers."""
    plain = serve("--max-request-tokens", str(MAX_TOKENS), env={"KVI_FAST_PATH": "false"})
    a, c = Client(server.port), plain.client
    p = pubs()
    for cl in (a, c):
        connect(cl, "both", p, model="fp")
    t = toks(300, 5, BS)
    p.publish([store(t, BS, 0, 5), *chunks(t, BS, 5, medium="CPU")])
    for cl in (a, c):
        applied_through(cl, "both", 0)
    reqs = [
        ("/v1/match", {"token_ids": t, "model": "fp"}),
        ("/v1/match", {"token_ids": t[:40], "cache_salt": "s", "model": "fp"}),
        ("/v1/match_by_keys", {"block_keys": [1, 2], "model": "fp"}),
        ("/v1/route", {"token_ids": t, "model": "fp", "load": {"both": {"active_decode_blocks": 3}}}),
        ("/v1/match", {"token_ids": [-1]}),
        ("/v1/match", {"token_ids": [1] * (MAX_TOKENS + 1)}),
        ("/v1/match", {"token_ids": t, "model": "nope"}),
        ("/query", {"token_ids": t, "model_name": "fp"}),
    ]
    for path, doc in reqs:
        sa, ra = a.post(path, doc)
        sc, rc = c.post(path, doc)
        for r in (ra, rc):
            for w in r.get("workers", []) if isinstance(r, dict) else []:
                w.pop("last_event_age_s")
            if isinstance(r, dict) and r.get("request_id"):
                r["request_id"] = "<per process>"  # ids are random per process
        assert (sa, ra) == (sc, rc), path
    a.delete("/v1/engines/both")


def test_stats_and_workers_shapes(api, pubs):
    p = pubs()
    connect(api, "shape", p, dp_size=1, model="shape-model")
    p.publish([store(toks(50, 3, BS), BS, 0, 3)])
    applied_through(api, "shape", 0)
    st, stats = api.get("/v1/stats")
    assert st == 200
    m = stats["models"]["shape-model"]
    assert m["nodes"] == 3 and m["resident_entries"] == 3 and m["workers"] == 1
    assert m["groups"]["0"]["block_size"] == BS and m["groups"]["0"]["tiers"] == {"GPU": 3}
    assert stats["events"]["BlockStored"]["applied"] >= 1
    assert "api_errors" in stats and "counters" in stats
    w = worker(api, "shape")
    for k in ("stale", "stale_reason", "last_seq", "last_event_age_s", "connected", "replaying",
              "replays_ok", "replays_failed", "gaps", "messages", "dropped", "resident_blocks", "endpoint"):
        assert k in w, k
    json.dumps(w)


def test_readyz_with_a_ready_fraction_tolerates_some_engines_down(pubs, serve):
    """With ready_fraction 0.5, one engine of two down keeps the replica ready (a Kubernetes
    readiness probe must not take every replica out because one engine died)."""
    s = serve(env={"KVI_READY_FRACTION": "0.5"})
    api = s.client
    p = pubs()
    connect(api, "up", p)
    with PortHold() as down, PortHold() as down2:  # held, never listening: engines that are down
        api.post("/v1/engines", {"id": "down", "endpoint": down.endpoint})
        st, body = api.get("/readyz")
        assert st == 200 and body["ready"] and body["reasons"][0].startswith("down/0: not connected")
        api.post("/v1/engines", {"id": "down2", "endpoint": down2.endpoint})
        st, body = api.get("/readyz")
        assert st == 503 and len(body["reasons"]) == 2
