"""Hardening, end to end on real ``kv-indexer serve`` processes: the API token
(R-SEC-1), the endpoint policy checked before any connect (R-SEC-2), engine ids and
worker names (R-SEC-3), readiness and per-worker health (R-OPS-1), never-connected
workers in routing (R-Q-3), and Dynamo's shapes on the edges (405, ``/workers``)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys

import pytest

from evkit import store, toks
from svc import ROOT, Client, PortHold, Server, sample, wait_for, wait_subscribed

BS = 16
TOKEN = "s3cret-token-for-the-tests-0123456789"


def raw(port: int, method: str, path: str, doc=None, token: str | None = None, headers: dict | None = None):
    """One request on a new connection: ``(status, parsed body or text, headers)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    h = {"content-type": "application/json", **(headers or {})}
    if token is not None:
        h["authorization"] = f"Bearer {token}"
    conn.request(method, path, None if doc is None else json.dumps(doc).encode(), h)
    r = conn.getresponse()
    data = r.read()
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    conn.close()
    if hdrs.get("content-type", "").startswith("application/json") and data:
        return r.status, json.loads(data), hdrs
    return r.status, data.decode("utf-8", "replace"), hdrs


@pytest.fixture(scope="module")
def secured():
    """A server with a token, engines allowed on 127.0.0.1 only, and room for 8 workers."""
    s = Server("--allowed-endpoint", "127.0.0.1", "--replay-timeout-s", "1",
               env={"KVI_API_TOKEN": TOKEN, "KVI_MAX_WORKERS": "8"})
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def sec(secured):
    """The secured server; engines a test registers are removed after it."""
    yield secured
    for e in secured.client.get("/v1/engines")[1]:
        raw(secured.port, "DELETE", f"/v1/engines/{e['id']}", token=TOKEN)


# ----------------------------------------------------------------------- the token


def test_R_SEC_1_mutating_routes_need_the_token_and_reads_do_not(sec, pubs):
    port = sec.port
    p = pubs()
    eng = {"id": "tok-a", "endpoint": p.live_endpoint}
    m0 = sec.client.metrics()
    st, body, h = raw(port, "POST", "/v1/engines", eng)
    assert st == 401 and "Bearer" in body["detail"] and h["www-authenticate"].startswith("Bearer")
    st, body, h = raw(port, "POST", "/v1/engines", eng, token="not-" + TOKEN)
    assert st == 403 and body["detail"] and 'error="invalid_token"' in h["www-authenticate"]
    st, _, _ = raw(port, "POST", "/v1/engines", eng, headers={"authorization": f"Basic {TOKEN}"})
    assert st == 403  # the right secret in the wrong scheme is still wrong
    assert sec.client.get("/v1/engines")[1] == []  # nothing was registered
    st, body, _ = raw(port, "POST", "/v1/engines", eng, token=TOKEN)
    assert st == 201 and body["id"] == "tok-a"

    # Reads stay open.
    wait_subscribed(sec.client, p, "tok-a")
    p.publish([store(toks(1, 2, BS), BS, 0, 2)])
    wait_for(lambda: sec.client.post("/v1/match", {"token_ids": toks(1, 2, BS)})[1]["workers"], what="the blocks")
    for path in ("/v1/engines", "/v1/workers", "/v1/stats", "/metrics", "/workers", "/healthz", "/readyz"):
        assert raw(port, "GET", path)[0] == 200, path
    assert raw(port, "POST", "/v1/route", {"token_ids": toks(1, 2, BS)})[0] == 200

    # Deleting needs it too; the engine survives the refused attempts.
    assert raw(port, "DELETE", "/v1/engines/tok-a")[0] == 401
    assert raw(port, "DELETE", "/v1/engines/tok-a", token="x" * 40)[0] == 403
    assert [e["id"] for e in sec.client.get("/v1/engines")[1]] == ["tok-a"]
    st, body, _ = raw(port, "DELETE", "/v1/engines/tok-a", token=TOKEN)
    assert (st, body) == (200, {"removed": "tok-a", "workers": 1})

    m1 = sec.client.metrics()

    def moved(name, **labels):
        return sample(m1, name, **labels) - sample(m0, name, **labels)

    assert moved("kvi_auth_failures_total", reason="missing") == 2
    assert moved("kvi_auth_failures_total", reason="wrong") == 3
    assert moved("kvi_engine_changes_total", op="register", via="api") == 1
    assert moved("kvi_engine_changes_total", op="unregister", via="api") == 1
    log = sec.output()
    assert "engine tok-a registered via api by 127.0.0.1:" in log and "with the token" in log
    assert f"endpoint={p.live_endpoint}" in log
    assert "engine tok-a unregistered via api by 127.0.0.1:" in log
    assert "refused POST /v1/engines from 127.0.0.1:" in log
    assert TOKEN not in log  # the secret is never logged


def test_R_APP_8_clear_needs_the_token_drops_the_engines_blocks_and_keeps_its_stream(sec, pubs):
    """POST /v1/engines/{id}/clear: an operator's reset told at once. It needs the token,
    drops the engine's blocks (and no other engine's), is counted and audit-logged, keeps
    the worker's sequence position (the next batch applies in order), and names an
    unknown engine with a 404."""
    port = sec.port
    pa, pb = pubs(), pubs()
    for eid, p in (("clr-a", pa), ("clr-b", pb)):
        assert raw(port, "POST", "/v1/engines", {"id": eid, "endpoint": p.live_endpoint}, token=TOKEN)[0] == 201
        wait_subscribed(sec.client, p, eid)
    a, b = toks(7000, 3, BS), toks(9000, 2, BS)
    pa.publish([store(a, BS, 0, 3)])
    pb.publish([store(a, BS, 0, 3)])
    held = lambda eid, t: {w["engine"]: w["total_blocks"] for w in sec.client.post("/v1/match", {"token_ids": t})[1]["workers"]}.get(eid, 0)  # noqa: E731
    wait_for(lambda: held("clr-a", a) == 3 and held("clr-b", a) == 3, what="both engines' blocks")
    m0 = sec.client.metrics()
    assert raw(port, "POST", "/v1/engines/clr-a/clear", {})[0] == 401
    assert held("clr-a", a) == 3  # refused: nothing changed
    st, body, _ = raw(port, "POST", "/v1/engines/clr-a/clear", {}, token=TOKEN)
    assert (st, body) == (200, {"cleared": "clr-a", "workers": 1})
    assert held("clr-a", a) == 0 and held("clr-b", a) == 3
    assert raw(port, "POST", "/v1/engines/nope/clear", {}, token=TOKEN)[0] == 404
    assert sample(sec.client.metrics(), "kvi_clears_requested_total") - sample(m0, "kvi_clears_requested_total") == 1
    assert "engine clr-a cleared by 127.0.0.1:" in sec.output()
    w = next(w for w in sec.client.get("/v1/workers")[1] if w["engine"] == "clr-a")
    assert w["last_seq"] == 0 and not w["stale"] and w["restarts"] == 0, w
    pa.publish([store(b, BS, 0, 2)])  # seq 1: in order, applied
    wait_for(lambda: held("clr-a", b) == 2, what="the next batch after the clear")


def test_R_SEC_1_dynamo_register_and_unregister_need_the_token_with_dynamos_error_shape(sec, pubs):
    port = sec.port
    p = pubs()
    reg = {"instance_id": 7, "endpoint": p.live_endpoint, "model_name": "dyn", "block_size": BS}
    st, body, _ = raw(port, "POST", "/register", reg)
    assert st == 401 and set(body) == {"error"}
    st, body, _ = raw(port, "POST", "/register", reg, token="y" * 32)
    assert st == 403 and set(body) == {"error"}
    assert raw(port, "POST", "/register", reg, token=TOKEN)[:2] == (201, {"status": "ok"})
    unreg = {"instance_id": 7, "model_name": "dyn"}
    assert raw(port, "POST", "/unregister", unreg)[0] == 401
    assert raw(port, "GET", "/workers")[1][0]["instance_id"] == 7  # still there
    assert raw(port, "POST", "/unregister", unreg, token=TOKEN)[:2] == (200, {"status": "ok"})
    m = sec.client.metrics()
    assert sample(m, "kvi_engine_changes_total", op="register", via="dynamo") == 1
    assert sample(m, "kvi_engine_changes_total", op="unregister", via="dynamo") == 1


def test_R_SEC_1_the_openapi_document_declares_the_token(sec):
    spec = sec.client.get("/openapi.json")[1]
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    secured_ops = {(m.upper(), p) for p, ops in spec["paths"].items() for m, op in ops.items() if "security" in op}
    assert secured_ops == {("POST", "/v1/engines"), ("DELETE", "/v1/engines/{engine_id}"), ("GET", "/v1/snapshot"),
                           ("POST", "/v1/engines/{engine_id}/clear"), ("POST", "/register"),
                           ("POST", "/unregister")}
    for status in ("401", "403"):
        assert status in spec["paths"]["/v1/engines"]["post"]["responses"]


def test_R_SEC_1_auth_reads_and_a_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")  # a mounted Secret often ends with a newline
    s = Server("--api-token-file", str(f), "--auth-reads")
    try:
        port = s.port
        q = {"token_ids": [1, 2, 3]}
        # The hot query routes (answered ahead of FastAPI) are guarded as well.
        for method, path, doc in (("POST", "/v1/match", q), ("POST", "/v1/route", q), ("GET", "/v1/workers", None),
                                  ("GET", "/metrics", None), ("POST", "/query", {**q, "model_name": "m"}),
                                  ("GET", "/openapi.json", None)):
            assert raw(port, method, path, doc)[0] == 401, path
            assert raw(port, method, path, doc, token="z" * 20)[0] == 403, path
            assert raw(port, method, path, doc, token=TOKEN)[0] < 500, path
        assert raw(port, "GET", "/metrics", token=TOKEN)[0] == 200
        for path in ("/healthz", "/readyz", "/health"):  # probes: a kubelet sends no token
            assert raw(port, "GET", path)[0] == 200, path
    finally:
        s.stop()


def test_R_SEC_1_a_bad_token_setting_stops_the_service_with_a_message(tmp_path):
    def serve(*args, env=None):
        import os

        return subprocess.run([sys.executable, "-m", "api.cli", "serve", "--check", *args], cwd=ROOT,
                              env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=60)

    r = serve(env={"KVI_API_TOKEN": "short"})
    assert r.returncode == 2 and "api_token" in r.stderr and "16" in r.stderr
    r = serve("--auth-reads")
    assert r.returncode == 2 and "auth_reads" in r.stderr
    r = serve("--api-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "api_token_file" in r.stderr
    r = serve(env={"KVI_API_TOKEN": TOKEN})
    assert r.returncode == 0 and json.loads(r.stdout)["api_token"] == "<redacted>" and TOKEN not in r.stdout
    r = serve("--allowed-endpoint", "not a host")
    assert r.returncode == 2 and "allowed_endpoints" in r.stderr


def test_R_SEC_1_listening_beyond_loopback_without_a_token_is_said_loudly():
    s = Server("--host", "0.0.0.0")
    try:
        wait_for(lambda: "SECURITY" in s.output(), what="the warning")
        assert "without an API token" in s.output()
    finally:
        s.stop()
    s = Server("--host", "0.0.0.0", env={"KVI_API_TOKEN": TOKEN})
    try:
        s.client.get("/healthz")
        assert "SECURITY" not in s.output()
    finally:
        s.stop()


# --------------------------------------------------------------- the endpoint policy


def test_R_SEC_2_a_refused_endpoint_is_never_connected(sec):
    # A listener on 127.0.0.2 (loopback, but not in allowed_endpoints): the service must
    # not even open a TCP connection to it.
    lst = socket.socket()
    lst.bind(("127.0.0.2", 0))
    lst.listen(8)
    lst.settimeout(1.5)
    port = lst.getsockname()[1]
    try:
        for ep in (f"tcp://127.0.0.2:{port}", "tcp://169.254.169.254:80", "tcp://metadata.invalid:80"):
            st, body, _ = raw(sec.port, "POST", "/v1/engines", {"id": "meta", "endpoint": ep}, token=TOKEN)
            assert st == 422 and "allowed_endpoints" in body["detail"], (ep, body)
        st, body, _ = raw(sec.port, "POST", "/v1/engines",
                          {"id": "meta", "endpoint": "tcp://127.0.0.1:5557",
                           "replay_endpoint": f"tcp://127.0.0.2:{port}"}, token=TOKEN)
        assert st == 422 and "replay_endpoint" in body["detail"]
        st, body, _ = raw(sec.port, "POST", "/register", {"instance_id": 3, "endpoint": f"tcp://127.0.0.2:{port}",
                                                          "model_name": "m", "block_size": BS}, token=TOKEN)
        assert st == 400 and "allowed_endpoints" in body["error"]
        with pytest.raises(TimeoutError):
            lst.accept()  # nobody connected
    finally:
        lst.close()
    assert sec.client.get("/v1/engines")[1] == []
    assert sec.client.get("/v1/workers")[1] == []
    assert "refused to register engine meta" in sec.output()


def test_R_SEC_2_dp_size_is_bounded_by_max_workers(sec):
    st, body, _ = raw(sec.port, "POST", "/v1/engines", {"id": "wide", "endpoint": "tcp://127.0.0.1:20000",
                                                        "dp_size": 9}, token=TOKEN)
    assert st == 422 and "max_workers=8" in body["detail"]
    ok = raw(sec.port, "POST", "/v1/engines", {"id": "w8", "endpoint": "tcp://127.0.0.1:20000", "dp_size": 8},
             token=TOKEN)
    assert ok[0] == 201
    st, body, _ = raw(sec.port, "POST", "/v1/engines", {"id": "one-more", "endpoint": "tcp://127.0.0.1:21000"},
                      token=TOKEN)
    assert st == 409 and "max_workers" in body["detail"]
    assert len(sec.client.get("/v1/workers")[1]) == 8


# ------------------------------------------------------------ ids and worker names


@pytest.mark.parametrize("eid", ["vllm-0", "pod.ns.svc", "10.0.0.5", "fd00::1", "_x", "A" * 128])
def test_R_SEC_3_every_registered_engine_can_be_deleted(sec, eid):
    st, body, _ = raw(sec.port, "POST", "/v1/engines", {"id": eid, "endpoint": "tcp://127.0.0.1:20000"}, token=TOKEN)
    assert st == 201, body
    assert [w["engine"] for w in sec.client.get("/v1/workers")[1]] == [eid]
    st, body, _ = raw(sec.port, "DELETE", f"/v1/engines/{eid}", token=TOKEN)
    assert (st, body) == (200, {"removed": eid, "workers": 1})
    assert sec.client.get("/v1/engines")[1] == []


def test_R_Q_3_a_worker_that_never_connected_never_wins_over_a_connected_one(sec, pubs, request):
    # "aaa" sorts first and has nothing cached, like "zzz": a tie on cost that the id
    # once broke in favour of the engine nobody could reach.
    dead = PortHold()  # held, never listening: refused, and nobody else's for the test
    request.addfinalizer(dead.close)
    assert raw(sec.port, "POST", "/v1/engines", {"id": "aaa", "endpoint": dead.endpoint},
               token=TOKEN)[0] == 201
    p = pubs()
    assert raw(sec.port, "POST", "/v1/engines", {"id": "zzz", "endpoint": p.live_endpoint}, token=TOKEN)[0] == 201
    wait_subscribed(sec.client, p, "zzz")
    q = {"token_ids": toks(77, 4, BS), "load": {"zzz/0": {"active_decode_blocks": 3}, "gone/0": {}}}
    st, r = sec.client.post("/v1/route", q)
    assert st == 200, r
    assert r["worker"] == "zzz/0" and r["reason"] == "no_cached_prefix_least_loaded"
    assert [(x["worker"], x["connected"]) for x in r["ranked"]] == [("zzz/0", True), ("aaa/0", False)]
    assert r["ranked"][0]["cost"] > r["ranked"][1]["cost"]  # it wins although it costs more
    assert r["unused_load"] == ["gone/0"]
    # A candidate the index does not subscribe to is ranked with nothing cached and an
    # unknown link; it is not a worker that never connected.
    st, r = sec.client.post("/v1/route", {"token_ids": toks(77, 4, BS), "candidates": ["aaa", "elsewhere/2"]})
    assert [(x["worker"], x["connected"]) for x in r["ranked"]] == [("elsewhere/2", None), ("aaa/0", False)]


# -------------------------------------------------------------- readiness, health


def test_R_OPS_1_ready_fraction_1_gates_readiness_on_every_engine(pubs):
    hold = PortHold()  # held (refused) until the publisher binds it: nobody else can take it meanwhile
    dead = hold.port
    s = Server("--ready-fraction", "1", "--engine", f"down=tcp://127.0.0.1:{dead}")
    try:
        st, body = s.client.get("/readyz")
        assert st == 503 and body["reasons"] == [f"down/0: not connected to tcp://127.0.0.1:{dead}"]
        pubs(f"tcp://127.0.0.1:{dead}")
        wait_for(lambda: s.client.get("/readyz")[0] == 200, what="ready once the engine is up")
        m = s.client.metrics()
        assert sample(m, "kvi_engine_changes_total", op="register", via="config") == 1
    finally:
        s.stop()
        hold.close()


def test_R_OPS_1_probes_answer_HEAD(sec):
    for path in ("/healthz", "/readyz", "/health"):
        st, body, _ = raw(sec.port, "HEAD", path)
        assert (st, body) == (200, ""), path


def test_dynamo_routes_answer_405_in_dynamos_error_shape(sec):
    st, body, h = raw(sec.port, "GET", "/register")
    assert st == 405 and set(body) == {"error"} and h["allow"] == "POST"
    st, body, _ = raw(sec.port, "DELETE", "/query")
    assert st == 405 and set(body) == {"error"}
    st, body, _ = raw(sec.port, "PUT", "/v1/match")
    assert st == 405 and set(body) == {"detail"}  # ours keep ours


def test_dynamo_workers_lists_instance_ids_as_integers_only(sec):
    for doc in ({"instance_id": 12, "endpoint": "tcp://127.0.0.1:20000", "model_name": "m", "block_size": BS},):
        assert raw(sec.port, "POST", "/register", doc, token=TOKEN)[0] == 201
    assert raw(sec.port, "POST", "/v1/engines", {"id": "named", "endpoint": "tcp://127.0.0.1:20010", "model": "m"},
               token=TOKEN)[0] == 201
    ws = raw(sec.port, "GET", "/workers")[1]
    assert [w["instance_id"] for w in ws] == [12]
    assert all(type(w["instance_id"]) is int for w in ws)


def test_a_query_without_model_keeps_meaning_default_when_a_second_model_joins(sec, pubs):
    p = pubs()
    assert raw(sec.port, "POST", "/v1/engines", {"id": "dflt", "endpoint": p.live_endpoint}, token=TOKEN)[0] == 201
    wait_subscribed(sec.client, p, "dflt")
    p.publish([store(toks(5, 2, BS), BS, 0, 2)])
    assert raw(sec.port, "POST", "/register", {"instance_id": 44, "endpoint": "tcp://127.0.0.1:20020",
                                               "model_name": "m2", "block_size": BS}, token=TOKEN)[0] == 201
    c = Client(sec.port)
    wait_for(lambda: c.post("/v1/match", {"token_ids": toks(5, 2, BS)})[1].get("workers"), what="the blocks")
    st, res = c.post("/v1/match", {"token_ids": toks(5, 2, BS)})
    assert st == 200 and res["model"] == "default" and res["best"]["engine"] == "dflt"


def _open_files_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_R_SEC_2_the_open_files_limit_is_raised_for_max_workers():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    s = Server(env={"KVI_MAX_WORKERS": "100"}, preexec_fn=low)  # needs 4 x 100 + 512
    try:
        assert _open_files_limit(s.proc.pid)[0] == min(912, hard)
    finally:
        s.stop()
    if hard != resource.RLIM_INFINITY and hard < 4 * 2048 + 512:
        s = Server(preexec_fn=low)  # the default 2048 workers cannot fit: said at start
        try:
            wait_for(lambda: "open files limited" in s.output(), what="the warning")
        finally:
            s.stop()
