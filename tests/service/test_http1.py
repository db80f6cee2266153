"""The hot routes answered by the HTTP protocol itself (api/http1.py), against a real
``kv-indexer serve``: pipelined requests keep their order, chunked bodies are read,
an oversized body is a counted 413 that leaves the connection usable, a token is
still required, and a handler that waits finishes in a Task (R-BAD-1, R-BAD-2)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import pytest

from api import http1
from api.http1 import _Outbox, _Resumed

from svc import Server, sample, wait_until

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
    # Nothing is ever indexed on this module's server: no model "m", a 404 that names it.
    assert (first[0], json.loads(first[2])) == (404, {"detail": "unknown model 'm'"}), first
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
        await asyncio.sleep(0.01)  # the point: a handler that waits (yields to the loop)
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


class _Transport:
    """A connection's protocol (its loop, whether an answer of it is held) and transport,
    recording what a response writer does to it (a closing one refuses writes, as
    uvloop's does)."""

    def __init__(self, log: list, name: str, closing: bool = False, fail: bool = False) -> None:
        self.log, self.name, self.closing, self.fail = log, name, closing, fail
        self.transport, self.loop, self.out_held = self, asyncio.get_running_loop(), False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        if self.closing or self.fail:
            raise RuntimeError(f"{self.name}: write refused")
        self.log.append((self.name, data))

    def close(self) -> None:
        self.closing = True
        self.log.append((self.name, "closed"))


def test_outbox_writes_a_turns_first_answer_then_the_rest_together_in_order():
    """A turn's first answer is written at once; the others are held until the turn ends,
    then written in the order they were answered (a connection's pipelined answers too); a
    connection closed meanwhile gets nothing; one whose write fails does not stop the
    others; a close asked for comes after its answer. The next turn starts over."""

    async def main() -> tuple[list, list, list, list]:
        log: list = []
        box = _Outbox()
        a, b, gone, bad = (_Transport(log, "a"), _Transport(log, "b"), _Transport(log, "gone"),
                           _Transport(log, "bad", fail=True))
        box.put(a, b"a1", False)
        box.put(bad, b"x", False)
        box.put(b, b"b1", True)
        box.put(gone, b"g1", False)
        box.put(a, b"a2", False)
        gone.closing = True  # the client went away before the turn ended
        first = list(log)
        held = [t.out_held for t in (a, b, gone, bad)]
        await asyncio.sleep(0)  # the turn ends: the callback the first answer scheduled runs
        turn = list(log)
        box.put(a, b"a3", False)  # a new turn: written at once again
        return first, held, turn, log

    first, held, turn, log = asyncio.run(main())
    assert first == [("a", b"a1")]
    assert held == [True, True, True, True]  # a: a2 held (a1 was not)
    assert turn == first + [("b", b"b1"), ("b", "closed"), ("a", b"a2")]
    assert log == turn + [("a", b"a3")]


def test_outbox_writes_as_soon_as_its_bound_is_held(monkeypatch):
    monkeypatch.setattr(http1, "OUTBOX_MAX", 3)

    async def main() -> tuple[list, list]:
        log: list = []
        box = _Outbox()
        t = _Transport(log, "t")
        for i in range(5):
            box.put(t, b"%d" % i, False)
        early = list(log)  # the first at once, then 1-3 when the third was held
        await asyncio.sleep(0)
        return early, log

    early, log = asyncio.run(main())
    assert early == [("t", b"0"), ("t", b"1"), ("t", b"2"), ("t", b"3")]
    assert log == early + [("t", b"4")]


def test_many_clients_at_once_each_get_their_own_answer(open_server):
    """Requests that one wake-up of the loop reads are answered, then written together:
    each connection gets the answer to its own request (nothing indexed: each answer
    names the model its request asked for), twice over."""
    conns = [_conn(open_server) for _ in range(24)]
    try:
        for turn in range(2):
            for i, (s, _) in enumerate(conns):
                s.sendall(_post("/query", {"token_ids": [7] * 16, "model_name": f"m{i}-{turn}"}, token=None))
            for i, (_, f) in enumerate(conns):
                status, _, body = _read_response(f)
                assert (status, json.loads(body)) == (404, {"error": f"no indexer for model=m{i}-{turn} "
                                                                     "routing_group=default"})
    finally:
        for s, _ in conns:
            s.close()


def test_R_BAD_1_an_answer_held_for_its_turn_goes_out_before_the_parsers_400(open_server):
    """A pipelined hot request and then bytes that are not HTTP, in one read, on many
    connections at once (so that most answers are held for the end of their turn): each
    connection gets its answer, then the parser's 400 for the rest, then is closed; an
    answer held when the parser wrote its 400 and closed the connection would be lost."""
    conns = [_conn(open_server) for _ in range(24)]
    try:
        for i, (s, _) in enumerate(conns):
            s.sendall(_post("/query", {"token_ids": [7] * 16, "model_name": f"p{i}"}, token=None) + b"\x00\x01 junk\r\n\r\n")
        for i, (_, f) in enumerate(conns):
            status, _, body = _read_response(f)
            assert (status, json.loads(body)) == (404, {"error": f"no indexer for model=p{i} routing_group=default"})
            status, _, _ = _read_response(f)
            assert status == 400
            assert f.read(1) == b""  # closed
    finally:
        for s, _ in conns:
            s.close()


# ------------------------------------------------- whole requests read without the parser


@pytest.fixture(scope="module")
def open_server():
    """No token: a whole hot request in one read is answered without the parser (_raw)."""
    s = Server(env={"KVI_MAX_REQUEST_BYTES": str(MAX_BYTES)})
    yield s
    s.stop()


def _exchange(server, pieces: list[bytes], answers: int = 1) -> list[tuple[int, dict, bytes]]:
    """Send ``pieces`` as separate writes (a pause between them) and read ``answers`` responses."""
    s, f = _conn(server)
    try:
        for i, p in enumerate(pieces):
            if i:
                # Its own read on the server: no probe says the server has read a piece, so a
                # pause; the pieces answer alike either way, the split is what is exercised.
                time.sleep(0.05)
            s.sendall(p)
        return [_read_response(f) for _ in range(answers)]
    finally:
        s.close()


def _errors(server) -> float:
    m = server.client.metrics()
    return sum(v for (name, labels), v in m.items() if name == "kvi_api_errors_total"
               and dict(labels).get("route") == "/v1/match")


@pytest.mark.parametrize("doc", [
    {"token_ids": list(range(40)), "model": "m"},
    {"token_ids": "not a list", "model": "m"},
    {"token_ids": [1, 2.5], "model": "m"},
    {"token_ids": [1] * 16, "model": "m", "cache_salt": 7},
])
def test_R_BAD_1_one_read_and_split_reads_answer_alike(open_server, doc):
    """The same request whole in one read (read without the parser) and cut in three reads
    (the parser's callbacks): the same status and body, and errors counted both times."""
    req = _post("/v1/match", doc, token=None)
    before = _errors(open_server)
    (s1, h1, b1), = _exchange(open_server, [req])
    cut = req.index(b"\r\n") + 5
    (s2, h2, b2), = _exchange(open_server, [req[:cut], req[cut:-3], req[-3:]])
    assert (s1, b1) == (s2, b2)
    assert h1["content-type"] == h2["content-type"] == "application/json"
    errors = _errors(open_server) - before
    assert errors == (0 if s1 == 200 else 2), (s1, b1)


@pytest.mark.parametrize("doc", [
    {"token_ids": list(range(400)), "model": "m"},  # a body of 2,000 bytes or more: http.client's two writes
    {"token_ids": [1, 2.5], "model": "m"},
    {"token_ids": [1] * 16, "model": "m", "cache_salt": 7},
])
def test_R_BAD_1_a_body_after_its_head_answers_as_one_read(open_server, doc):
    """A whole head, then the body in one or more later reads (held, not parsed): the same
    status and body as the request in one read, and errors counted both times."""
    req = _post("/v1/match", doc, token=None)
    head = req.index(b"\r\n\r\n") + 4
    before = _errors(open_server)
    (s1, _, b1), = _exchange(open_server, [req])
    (s2, h2, b2), = _exchange(open_server, [req[:head], req[head:]])
    (s3, _, b3), = _exchange(open_server, [req[:head + 3], req[head + 3:-2], req[-2:]])
    assert (s1, b1) == (s2, b2) == (s3, b3)
    assert h2["content-type"] == "application/json"
    assert _errors(open_server) - before == (0 if s1 == 200 else 3), (s1, b1)


def test_R_BAD_1_a_held_request_then_a_pipelined_one_answer_in_order(open_server):
    """The read that completes a held body also brings the next request: both answered, in
    order (the parser reads the two from the start)."""
    first = _post("/v1/match", {"token_ids": [3] * 16, "model": "m"}, token=None)
    second = _post("/v1/match", {"token_ids": "x", "model": "m"}, token=None)
    head = first.index(b"\r\n\r\n") + 4
    alone = _exchange(open_server, [first])[0]
    a, b = _exchange(open_server, [first[:head + 5], first[head + 5:] + second], answers=2)
    assert a[::2] == alone[::2] and b[0] == 422


def test_R_BAD_1_a_request_cut_off_after_its_head_leaves_the_server_serving(open_server):
    req = _post("/v1/match", {"token_ids": [3] * 16, "model": "m"}, token=None)
    s, _ = _conn(open_server)
    s.sendall(req[:req.index(b"\r\n\r\n") + 6])
    time.sleep(0.05)  # read by the server before the close (no probe says a server has read bytes)
    s.close()
    assert _exchange(open_server, [req])[0][0] == 404  # nothing indexed: the handler's answer


def test_R_BAD_1_a_held_request_is_answered_through_a_graceful_shutdown():
    """SIGTERM while a request's body is still coming: the body is read and answered, the
    connection then closed, and the server exits (as uvicorn does for a body it reads)."""
    srv = Server(env={"KVI_MAX_REQUEST_BYTES": str(MAX_BYTES)})
    try:
        req = _post("/v1/match", {"token_ids": [3] * 16, "model": "m"}, token=None)
        cut = req.index(b"\r\n\r\n") + 6
        s, f = _conn(srv)
        try:
            s.sendall(req[:cut])
            # Read (held) by the server before the SIGTERM: no probe says a server has read
            # bytes, so a pause; were it not read, uvicorn would close the connection as
            # idle and not wait for it below.
            time.sleep(0.2)
            srv.proc.terminate()
            wait_until(lambda: "Waiting for connections to close" in srv.output(), 10,
                       msg=lambda: f"uvicorn to wait for the held request's connection: {srv.output()}")
            assert srv.proc.poll() is None  # still waiting for the held request
            s.sendall(req[cut:])
            status, _, body = _read_response(f)
            assert status == 404 and b"unknown model" in body  # nothing indexed: the handler's answer
            s.settimeout(2)  # well inside the 5 s keep-alive timeout, which would close it too
            assert f.read(1) == b""  # then closed
        finally:
            s.close()
        # It exits by itself (uvicorn re-raises the SIGTERM it caught once shut down).
        assert srv.proc.wait(10) == -signal.SIGTERM
        assert "Shutting down" in srv.output()
    finally:
        srv.stop()


def test_R_BAD_1_framing_and_connection_headers_go_to_the_parser(open_server):
    body = json.dumps({"token_ids": [3] * 16, "model": "m"}).encode()
    head = "POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    ok = _exchange(open_server, [_post("/v1/match", {"token_ids": [3] * 16, "model": "m"}, token=None)])[0]
    assert ok[0] == 404 and b"unknown model" in ok[2]  # nothing indexed: the handler's own answer
    # Chunked: the parser reads the body (the raw path would have seen no Content-Length).
    chunked = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    assert _exchange(open_server, [chunked])[0][::2] == ok[::2]
    # A space before the colon, or two lengths: the parser refuses the request (400).
    for bad in (f"Content-Length : {len(body)}\r\n", f"Content-Length: {len(body)}\r\nContent-Length: {len(body)}\r\n"):
        assert _exchange(open_server, [(head + bad + "\r\n").encode() + body])[0][0] == 400
    # Connection: close is honoured: the answer, then the server closes.
    s, f = _conn(open_server)
    try:
        s.sendall((head + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        assert _read_response(f)[::2] == ok[::2]
        s.settimeout(2)  # well inside the 5 s keep-alive timeout, which would close it too
        assert f.read(1) == b""
    finally:
        s.close()
    # Two whole requests in one read: both answered, in order.
    two = _post("/v1/match", {"token_ids": [3] * 16, "model": "m"}, token=None) + \
        _post("/v1/match", {"token_ids": "x", "model": "m"}, token=None)
    first, second = _exchange(open_server, [two], answers=2)
    assert first[::2] == ok[::2] and second[0] == 422


def _handled(svc, route, body: bytes):
    """The route's handler's (status, body) for ``body``, driven as the protocol drives it."""
    coro = svc.endpoints.serve_body(route, body)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError(f"the {route.path} handler waited")


def test_R_Q_2_dynamo_query_plain_door_answers_as_the_handler_or_declines():
    """/query's plain door (api/dynamo.py query_plain) gives the handler's exact bytes for
    the common request and declines (None) everything else, which the handler then answers."""
    from api.app import create_app
    from evkit import apply, store, toks
    from indexer import PrefixIndex
    from indexer.producer.events import Stored

    idx = PrefixIndex()
    t = toks(5, 40, 16)
    apply(idx, [store(t, 16, 0, 40)], engine="7")
    apply(idx, [store(t, 16, 0, 12)], engine="9", dp_rank=1)
    apply(idx, [Stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=t[:32], block_size=16,
                       medium="GPU", group_idx=0)], engine="8", model="other")
    app = create_app(index=idx)
    svc = app.state.service
    route = svc.endpoints.routes["/query"]

    def handler(b: bytes):
        return _handled(svc, route, b)

    def body(**kw) -> bytes:
        return json.dumps({"model_name": "default", **kw}).encode()

    for n in (1, 16, 100, 16 * 12, 16 * 40, 16 * 40 + 3):
        b = body(token_ids=t[:n])
        plain = route.plain(route, b)
        assert plain is not None and (200, plain) == handler(b), n
    assert b'"7":{"longest_matched":640' in route.plain(route, body(token_ids=t))
    nothing = b'{"scores":{},"frequencies":[],"instances":{}}'  # Dynamo's answer when nothing matches
    declined = [  # (body, the handler's status, and its body or a part of it)
        (body(token_ids=[]), 200, nothing),                      # an empty query matches nothing
        (body(token_ids=t, lora_name="a"), 200, nothing),        # other keys: the blocks were stored without LoRA
        (body(token_ids=t, cache_salt="s"), 200, nothing),       # ... and without a salt
        (body(token_ids=[1.5]), 422, b"Expected `int`, got `float`"),
        (body(token_ids=t[:1] * (svc.settings.max_request_tokens + 1)), 413, b"exceed the limit"),
        (b"{not json", 400, b"not valid JSON"),
        (json.dumps({"model_name": "nope", "token_ids": t}).encode(), 404, b"no indexer for model=nope"),
        (body(token_ids="x"), 422, b"Expected `array`, got `str`"),
    ]
    for b, status, says in declined:
        assert route.plain(route, b) is None, b[:60]
        got = handler(b)
        assert got[0] == status and (got[1] == says if status == 200 else says in got[1]), (b[:60], got)


def test_R_Q_2_match_plain_door_answers_as_the_handler_or_declines():
    """/v1/match's plain door (Service.match_plain): the handler's exact bytes for the
    common request; None (the handler's turn) for text, LoRA, salt, an unknown model,
    bad bodies."""
    from api.app import create_app
    from evkit import FakeClock, apply, store, toks
    from indexer import PrefixIndex

    idx = PrefixIndex(clock=FakeClock())  # answers carry ages: a fixed clock compares them
    t = toks(6, 30, 16)
    apply(idx, [store(t, 16, 0, 30)], engine="a")
    apply(idx, [store(t, 16, 0, 9)], engine="b", dp_rank=2)
    app = create_app(index=idx)
    svc = app.state.service
    route = svc.endpoints.routes["/v1/match"]

    def handler(b: bytes):
        return _handled(svc, route, b)

    for n in (1, 16, 16 * 9, 16 * 30 + 5):
        for doc in ({"token_ids": t[:n]}, {"token_ids": t[:n], "model": "default"}):
            b = json.dumps(doc).encode()
            plain = route.plain(route, b)
            assert plain is not None and (200, plain) == handler(b), (n, doc)
    whole = route.plain(route, json.dumps({"token_ids": t}).encode())
    assert b'"engine":"a","dp_rank":0,"tiers":{"GPU":30}' in whole and b'"engine":"b","dp_rank":2,"tiers":{"GPU":9}' in whole
    apply(idx, [store(t, 16, 0, 2)], engine="c", model="other")
    b = json.dumps({"token_ids": t}).encode()  # two models, none named: "default" (R-Q-1)
    assert (200, route.plain(route, b)) == handler(b)
    for doc, status, says in (
        ({"token_ids": t, "lora_name": "x"}, 200, b'"workers":[],"best":null'),  # stored without LoRA: no match
        ({"token_ids": t, "cache_salt": "s"}, 200, b'"workers":[],"best":null'),  # ... and without a salt
        ({"token_ids": t, "prompt": "hi"}, 422, b"give exactly one of token_ids, prompt"),
        ({"token_ids": t, "model": "nope"}, 404, b"unknown model 'nope'"),
        ({"prompt": "hi"}, 404, b"has no tokenizer"),  # no tokenizer configured: 404 saying how to configure one
        ({"token_ids": []}, 422, b"length >= 1"),
    ):
        b = json.dumps(doc).encode()
        assert route.plain(route, b) is None, doc
        got = handler(b)
        assert got[0] == status and says in got[1], (doc, got)
    assert route.plain(route, json.dumps({"token_ids": t, "model": "other"}).encode()) is not None


def test_a_uvicorn_without_the_driven_internals_is_refused_at_import(monkeypatch):
    """api/http1.py drives uvicorn's protocol internals: one missing is an ImportError naming it."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from api import http1

    http1._check_uvicorn()  # the installed uvicorn has all of it
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    with pytest.raises(ImportError, match=r"lacks HttpToolsProtocol\._start_asgi_task"):
        http1._check_uvicorn()
