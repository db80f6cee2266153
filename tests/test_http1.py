"""The hot routes answered by the HTTP protocol itself (api/http1.py), against a real
``kv-indexer serve``: pipelined requests keep their order, chunked bodies are read,
an oversized body is a counted 413 that leaves the connection usable, a token is
still required, and a handler that waits finishes in a Task (R-BAD-1, R-BAD-2)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from api.http1 import _Resumed

from svc import Server, sample

MAX_BYTES = 4096
TOKEN = "t0ken-for-the-http1-tests"


@pytest.fixture(scope="module")
def server():
    s = Server(env={"KVI_MAX_REQUEST_BYTES": str(MAX_BYTES), "KVI_API_TOKEN": TOKEN, "KVI_AUTH_READS": "true"})
    yield s
    s.stop()


def _read_response(f) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response from a socket file: status, headers, body (content-length)."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    body = f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def _post(path: str, doc: dict, token: str | None = TOKEN) -> bytes:
    body = json.dumps(doc).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _scrape(server) -> dict:
    """One /metrics scrape with the token (reads need it here), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    s, f = _conn(server)
    try:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        status, _, body = _read_response(f)
    finally:
        s.close()
    assert status == 200
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(body.decode()) for smp in fam.samples}


def _conn(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return s, s.makefile("rb")


def test_pipelined_requests_answered_in_order(server):
    """R-BAD-1: three requests in one segment (two hot, one not) get three answers in order."""
    s, f = _conn(server)
    try:
        s.sendall(_post("/v1/match", {"token_ids": [1] * 32, "model": "m"})
                  + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                  + _post("/v1/match", {"token_ids": "not a list", "model": "m"}))
        first = _read_response(f)
        second = _read_response(f)
        third = _read_response(f)
    finally:
        s.close()
    assert first[0] in (200, 404), first  # no such model yet: a 404 that names it
    assert second[0] == 200 and json.loads(second[2]) == {"status": "ok"}
    assert third[0] == 422 and "token_ids" in json.loads(third[2])["detail"]


def test_chunked_body_is_read(server):
    body = json.dumps({"token_ids": [5] * 16, "model": "nope"}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    req = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Authorization: Bearer " + TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    s, f = _conn(server)
    try:
        s.sendall(req)
        status, headers, out = _read_response(f)
    finally:
        s.close()
    assert status == 404, out  # the whole body was decoded: the unknown model is named
    assert "nope" in json.loads(out)["detail"]
    assert headers["content-type"] == "application/json"


def test_oversized_body_413_and_connection_still_usable(server):
    """R-BAD-2: a body past max_request_bytes is a counted 413; the next request on the
    same connection is answered."""
    before = sample(_scrape(server), "kvi_api_errors_total", route="/v1/match", status=413)
    s, f = _conn(server)
    try:
        s.sendall(_post("/v1/match", {"token_ids": list(range(2000)), "model": "m"}))
        status, _, out = _read_response(f)
        assert status == 413 and str(MAX_BYTES) in json.loads(out)["detail"]
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(f)[0] == 200
    finally:
        s.close()
    after = sample(_scrape(server), "kvi_api_errors_total", route="/v1/match", status=413)
    assert after == before + 1


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 403)])
def test_hot_route_still_needs_the_token(server, token, status):
    s, f = _conn(server)
    try:
        s.sendall(_post("/v1/match", {"token_ids": [1] * 16, "model": "m"}, token=token))
        got, headers, out = _read_response(f)
    finally:
        s.close()
    assert got == status, out
    assert headers["www-authenticate"].startswith("Bearer")


def test_resumed_handler_finishes_in_a_task():
    """A handler that waits (work off the loop) is driven by hand until it yields, then a
    Task finishes it with the future it yielded; an error inside comes out of the await."""

    async def handler(fail: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.01)
        got = await asyncio.get_running_loop().run_in_executor(None, lambda: 21 * 2)
        if fail:
            raise ValueError("boom")
        return 200, str(got).encode()

    async def main() -> None:
        coro = handler(False)
        first = coro.send(None)  # what the protocol does inside data_received
        assert await asyncio.get_running_loop().create_task(_wrap(_Resumed(coro, first))) == (200, b"42")
        coro = handler(True)
        first = coro.send(None)
        with pytest.raises(ValueError, match="boom"):
            await asyncio.get_running_loop().create_task(_wrap(_Resumed(coro, first)))

    async def _wrap(r: _Resumed):
        return await r

    asyncio.run(main())
