"""uvicorn's httptools protocol, with the hot JSON POST routes answered by the protocol itself.

Why: on this project's 2-vCPU VM a keep-alive round trip to a bare httptools server
costs ~150 us (client and kernel); through uvicorn and an ASGI shortcut ahead of
FastAPI it cost ~300 us, the index's own work being ~15 us of it. The rest is
uvicorn's per-request machinery: a scope dict, a ``RequestResponseCycle``, an asyncio
Task, ASGI receive/send message dicts, two ``transport.write`` calls (status line
and headers, then the body: two TCP segments), the proxy-headers middleware.

Here a POST to a hot route (``Endpoints.hot``) on a keep-alive HTTP/1.1
connection is read by the parser callbacks, handed to ``Endpoints.serve_body`` (the
same handler FastAPI's endpoint calls: same decoding, auth, errors and counters) and,
when the handler finishes without waiting (every ``token_ids`` query), answered
with one write, inside the same ``data_received`` call. A handler that does wait
(a text prompt tokenized off the loop) goes on in a Task, and a pipelined request
behind it waits its turn (uvicorn's own pipeline). Everything else (other methods
and routes, ``Expect: 100-continue``, HTTP/1.0, ``Connection: close``, upgrades, an
access log, a concurrency limit) is uvicorn's, unchanged.

When no token is configured (so no header is read per request), a read that is
exactly one whole hot request with a plain ``Content-Length`` body is answered before
the parser sees it (``_raw``: no parser callbacks, no scope dict; ~14 us less server
CPU per query). A read that is such a request's whole head and part of its body is
held until the rest comes (``_more``): clients write a large body after the head
(Python's http.client does from 2,000 bytes), so most 1,024-token queries come in two
reads. Any other read, and every header that changes the framing or the connection,
goes to the parser as above; so does everything held, should a read bring more than
the held request.

A hot route's answers go out once per turn of the event loop (``_Outbox``): the first
answer of a turn is written at once, the others that the same wake-up of the loop reads
and answers are held and written back to back when the turn ends (at most ``OUTBOX_MAX``
held). Written one at a time, each response woke its client's thread (on a 2-vCPU VM, an
interprocessor interrupt each: an eighth of the server's CPU at 64 clients); back to back,
the first wakes it and the rest find it awake. At 64 keep-alive clients that was ~30% more
queries a second and half the p99 (benchmarks/bench_concurrency.py); a lone client's
answer is written as before, and the turn's end costs one loop callback after it.

Not seen on the hot routes: ``X-Forwarded-For`` (uvicorn's proxy-headers
middleware), which only named the client in a refused-token log line there.

This subclasses uvicorn's protocol and drives its internals (the parser callbacks, the
keep-alive timer, the pipeline, ``STATUS_LINE``): pyproject.toml bounds uvicorn to the
minor versions this was checked against, and importing this module raises ImportError
naming what is missing when a uvicorn lacks any of it (``_check_uvicorn``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Coroutine, Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.common import error_body

log = logging.getLogger("kv_indexer.api")

__all__ = ["bind"]

# What this module calls or overrides on uvicorn's protocol, and the instance attributes
# it reads and sets (assigned in the methods named).
_METHODS = ("data_received", "shutdown", "on_message_begin", "on_headers_complete", "on_body",
            "on_message_complete", "on_response_complete", "_start_asgi_task", "timeout_keep_alive_handler",
            "_unset_keepalive_if_required", "send_400_response", "handle_websocket_upgrade")
_ATTRIBUTES = {
    "__init__": ("access_log", "limit_concurrency", "timeout_keep_alive_task", "timeout_keep_alive", "server_state",
                 "tasks", "pipeline", "cycle", "loop", "parser", "transport", "flow"),
    "connection_made": ("transport", "flow"),
    "on_message_begin": ("url", "scope", "expect_100_continue"),
}


def _check_uvicorn() -> None:
    """Raise ImportError naming what this uvicorn's httptools protocol lacks of what the
    fast path drives (a uvicorn outside the pinned range)."""
    missing = [f"HttpToolsProtocol.{n}" for n in _METHODS if not callable(getattr(HttpToolsProtocol, n, None))]
    for method, names in _ATTRIBUTES.items():
        fn = getattr(HttpToolsProtocol, method, None)
        assigned = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
        missing += [f"self.{n} (in {method})" for n in names if n not in assigned]
    if not isinstance(getattr(httptools_impl, "STATUS_LINE", None), dict):
        missing.append("httptools_impl.STATUS_LINE")
    if missing:
        raise ImportError(f"api.http1: uvicorn {uvicorn.__version__}'s httptools protocol lacks {', '.join(missing)}; "
                          "the hot-route protocol was written against the uvicorn range pinned in pyproject.toml: "
                          "install a uvicorn in that range, or set fast_path: false")


_check_uvicorn()
STATUS_LINE: dict[int, bytes] = httptools_impl.STATUS_LINE

_JSON_HEADERS = b"content-type: application/json\r\ncontent-length: "
# Header lines as RFC 9110 allows them (a token, a colon, visible characters, spaces
# and tabs); anything else (obs-fold, bare CR or LF, NUL) is left to the parser.
_HEADERS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*").fullmatch
# Headers that change a request's framing or its connection: the parser's to handle
# (Connection: keep-alive excepted, the default of HTTP/1.1 anyway).
_REFRAME = frozenset((b"transfer-encoding", b"connection", b"expect", b"upgrade"))


class _NoEvent:
    """What uvicorn calls on a cycle's ``message_event`` (a fast request has no ASGI receive)."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


class _FastCycle:
    """Stands in for uvicorn's ``RequestResponseCycle`` while a hot request is answered:
    pipelining, ``connection_lost`` and ``shutdown`` read and set these."""

    __slots__ = ("response_complete", "disconnected", "keep_alive", "message_event")

    def __init__(self) -> None:
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True
        self.message_event = _NO_EVENT


class _Resumed:
    """The rest of a coroutine that already yielded ``first`` when it was driven by hand:
    awaiting this in a Task hands the Task that future, then the coroutine's next ones."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self.coro = coro
        self.first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, fut = self.coro, self.first
        while True:
            try:
                value = yield fut
            except BaseException as e:  # cancellation, or the future's error: into the coroutine
                try:
                    fut = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                fut = coro.send(value)
            except StopIteration as stop:
                return stop.value


# Responses held at most before they are written (see the module doc): 64 answers of a
# 1,024-token /query are ~1 ms of the loop, what the first held waits at most (16 held
# kept a third of the gain at 64 clients; 64 and 256, and no bound, were alike).
OUTBOX_MAX = 64


class _Outbox:
    """The hot routes' responses of one turn of the event loop: the turn's first written at
    once, the rest held and written together when the turn ends (a callback the first one
    schedules), or as soon as ``OUTBOX_MAX`` wait. One per event loop: bind() makes one
    for the server's protocol class."""

    __slots__ = ("items", "turn")

    def __init__(self) -> None:
        self.items: list[tuple[Any, bytes, bool]] = []
        self.turn = False  # a response went out in this turn: the next ones are held

    def put(self, proto: Any, data: bytes, close: bool) -> None:
        """Write ``data`` to ``proto``'s connection, or hold it till the turn ends (setting
        ``proto.out_held``); then close the connection when ``close``."""
        if self.turn:
            items = self.items
            items.append((proto, data, close))
            proto.out_held = True
            if len(items) >= OUTBOX_MAX:
                self._write()
            return
        self.turn = True
        proto.loop.call_soon(self.flush)
        _send(proto.transport, data, close)

    def flush(self) -> None:
        """End the turn: write what is held."""
        self.turn = False
        self._write()

    def _write(self) -> None:
        """Write what is held, in the order it was answered (a connection's pipelined
        answers in its requests' order); a connection closed meanwhile gets nothing."""
        items = self.items
        if not items:
            return
        self.items = []
        for proto, data, close in items:
            proto.out_held = False
            if not proto.transport.is_closing():
                _send(proto.transport, data, close)


def _send(transport: Any, data: bytes, close: bool) -> None:
    try:
        transport.write(data)
        if close:
            transport.close()
    except Exception:  # one connection's failure is not the others'
        log.exception("writing a response failed")


class FastHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` answering the hot routes of ``endpoints`` (see the module doc)."""

    # Set by bind(): the service's bound routes (``endpoints.hot``: the routes answered
    # here, None for none), its auth and its body bound.
    endpoints: Any = None
    auth: Any = None
    max_body = 0
    outbox: _Outbox = _Outbox()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._route: Any = None  # the hot route of the request being read, or None
        self._body: list[bytes] = []
        self._size = 0
        self._parsing = False  # the parser holds part of a request (between its begin and complete)
        # A hot request whose head came whole and whose body is still coming (_raw, _more):
        # (the reads so far, their length, the request's whole length, where its body
        # starts, the route).
        self._held: tuple[list[bytes], int, int, int, Any] | None = None
        self._closing = False  # shutdown came while a request was held
        self.out_held = False  # an answer of this connection waits in the outbox
        hot = self.endpoints.hot
        # Whole hot requests read without the parser (_raw): {raw path: route}, when nothing
        # per request needs what only the parser's callbacks give (auth reads the headers).
        self._raw_routes: dict[bytes, Any] | None = (
            {p.encode("latin-1"): r for p, r in hot.items()}
            if hot is not None and not self.auth.enforced and not self.access_log
            and self.limit_concurrency is None else None)

    def data_received(self, data: bytes) -> None:
        if self._held is not None:
            self._more(data)
            return
        if (data[:5] == b"POST " and self._raw_routes is not None and not self._parsing
                and (self.cycle is None or self.cycle.response_complete) and self._raw(data)):
            return
        super().data_received(data)

    # uvicorn writes at once in two places, inside the parser's read (data_received): a 400
    # (then a close) for bytes that are not HTTP, and the switch to a WebSocket. An answer
    # of this connection that the same read made and the outbox holds goes out first.
    def send_400_response(self, msg: str) -> None:
        if self.out_held:
            self.outbox.flush()
        super().send_400_response(msg)

    def handle_websocket_upgrade(self) -> None:
        if self.out_held:
            self.outbox.flush()
        super().handle_websocket_upgrade()

    def _more(self, data: bytes) -> None:
        """The next read of a held request: answer it once whole; hand everything read so
        far to the parser if more than the request came (a pipelined request behind it)."""
        reads, got, whole, body_at, route = self._held  # type: ignore[misc]
        reads.append(data)
        got += len(data)
        if got < whole:
            self._held = (reads, got, whole, body_at, route)
            return
        self._held = None
        raw = b"".join(reads)
        if got > whole:
            super().data_received(raw)  # the parser reads it all, as if never held
            return
        cycle = _FastCycle()
        cycle.keep_alive = not self._closing
        self.cycle = cycle  # type: ignore[assignment]
        self._serve(cycle, route, raw[body_at:])

    def shutdown(self) -> None:
        # What was answered goes out before uvicorn closes the connections it finds idle.
        self.outbox.flush()
        # As uvicorn does for a request whose body it is still reading: answered, then closed.
        if self._held is not None:
            self._closing = True
            return
        super().shutdown()

    def _raw(self, data: bytes) -> bool:
        """Answer ``data`` if it is exactly one whole POST to a hot route with a plain
        ``Content-Length`` body, or hold it if it is such a request's whole head and part
        of its body (:meth:`_more` reads the rest); False (nothing done) for anything else,
        which the parser then reads as usual: a partial head, a pipelined read, other
        headers that change the framing or the connection (Transfer-Encoding, Connection
        other than keep-alive, Expect, Upgrade), a body over the limit, a header the
        grammar does not allow."""
        line_end = data.find(b"\r\n")
        head_end = data.find(b"\r\n\r\n", line_end)
        if line_end < 0 or head_end < 0:
            return False
        line = data[5:line_end]
        if line[-9:] != b" HTTP/1.1":
            return False
        route = self._raw_routes.get(line[:-9])  # type: ignore[union-attr]
        if route is None:
            return False
        clen = -1
        if head_end > line_end:
            block = data[line_end + 2:head_end + 2]
            if _HEADERS(block) is None:
                return False
            for h in block[:-2].split(b"\r\n"):
                name, _, value = h.partition(b":")
                name = name.lower()
                if name == b"content-length":
                    value = value.strip(b" \t")
                    if clen >= 0 or not value.isdigit():
                        return False
                    clen = int(value)
                elif name in _REFRAME and (name != b"connection" or value.strip(b" \t").lower() != b"keep-alive"):
                    return False
        body = data[head_end + 4:]
        if len(body) > clen or clen > self.max_body:
            return False
        task = self.timeout_keep_alive_task  # _unset_keepalive_if_required, inlined
        if task is not None:
            task.cancel()
            self.timeout_keep_alive_task = None
        if len(body) < clen:
            # The head alone, or part of the body: clients write a large body after the
            # head (http.client does for bodies of 2,000 bytes or more), so a 1,024-token
            # query often comes in two reads. Held here, not given to the parser.
            self._held = ([data], len(data), head_end + 4 + clen, head_end + 4, route)
            return True
        cycle = _FastCycle()
        self.cycle = cycle  # type: ignore[assignment]
        self._serve(cycle, route, body)
        return True

    def on_response_complete(self) -> None:
        """uvicorn's (count the request; resume reading; start the next pipelined request,
        or arm the keep-alive timer) with its two helper calls inlined: it runs once per
        request, where a Python frame costs ~4 us with the caches cold."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        task = self.timeout_keep_alive_task
        if task is not None:
            task.cancel()
            self.timeout_keep_alive_task = None
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def on_message_begin(self) -> None:
        self._parsing = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        routes = self.endpoints.hot
        parser = self.parser
        cycle = self.cycle
        if (routes is not None and (cycle is None or cycle.response_complete) and not self.access_log
                and not self.expect_100_continue and self.limit_concurrency is None
                and parser.get_method() == b"POST" and parser.get_http_version() == "1.1"
                and parser.should_keep_alive() and not parser.should_upgrade()):
            url = self.url
            route = routes.get(url.decode("latin-1")) if url[:1] == b"/" else None
            if route is not None:  # a plain path: no query string or escapes would match a route's key
                scope = self.scope
                scope["method"] = "POST"
                scope["path"] = route.path
                scope["raw_path"] = url
                scope["query_string"] = b""
                self.cycle = _FastCycle()  # type: ignore[assignment]
                self._route = route
                self._body = []
                self._size = 0
                return
        self._route = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._route is None:
            super().on_body(body)
            return
        self._size += len(body)
        if self._size <= self.max_body:
            self._body.append(body)  # past the bound: read and dropped, answered 413 at the end

    def on_message_complete(self) -> None:
        self._parsing = False
        route = self._route
        if route is None:
            super().on_message_complete()
            return
        self._route = None
        cycle: _FastCycle = self.cycle  # type: ignore[assignment]
        refused = self.auth.refuse(self.scope)
        if refused is not None:
            status, msg, headers = refused
            self._respond(cycle, status, error_body(msg, route.error_key), headers)
            return
        limit = self.max_body
        if self._size > limit:
            status, out = self.endpoints.refused(route, 413, f"request body exceeds the limit of {limit} bytes")
            self._respond(cycle, status, out)
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._serve(cycle, route, body)

    def _serve(self, cycle: _FastCycle, route: Any, body: bytes) -> None:
        """Answer ``body``: the route's plain door when it takes the request, else its
        handler (now, or from a Task when it waits)."""
        plain = route.plain
        if plain is not None:
            out = plain(route, body)
            if out is not None:
                self._respond(cycle, 200, out)
                return
        coro = self.endpoints.serve_body(route, body)
        try:
            fut = coro.send(None)
        except StopIteration as done:
            status, out = done.value
            self._respond(cycle, status, out)
            return
        # The handler waits for something (work off the loop): finish in a Task.
        task = self.loop.create_task(self._finish(cycle, _Resumed(coro, fut)))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _finish(self, cycle: _FastCycle, rest: _Resumed) -> None:
        status, out = await rest
        self._respond(cycle, status, out)

    def _respond(self, cycle: _FastCycle, status: int, body: bytes,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Write the whole response at once, then let uvicorn go on (keep-alive, pipeline)."""
        cycle.response_complete = True
        if cycle.disconnected or self.transport.is_closing():
            return
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        for name, value in headers or ():
            parts += [name, b": ", value, b"\r\n"]
        parts += [_JSON_HEADERS, b"%d\r\n\r\n" % len(body), body]
        # Closed once written when the server is shutting down (not keep_alive).
        self.outbox.put(self, b"".join(parts), not cycle.keep_alive)
        self.on_response_complete()


def bind(app: Any) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=`` serving ``app`` (built by ``create_app``):
    its service's hot routes answered as above (none when ``fast_path`` is off: then
    everything is uvicorn's path)."""
    svc = app.state.service
    return type("KviHttpToolsProtocol", (FastHttpToolsProtocol,),
                {"endpoints": svc.endpoints, "auth": svc.auth, "max_body": svc.settings.max_request_bytes,
                 "outbox": _Outbox()})
