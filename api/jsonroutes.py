"""The JSON POST routes: how one is declared, bound to a service, and answered.

Every JSON POST route is one handler ``(parsed request) -> (status, body)``, decoded and
validated by msgspec (one typed pass, in C) and encoded by msgspec. A route module
declares its routes on a :class:`JsonRouter` (a FastAPI ``APIRouter``: the route is in
the OpenAPI document and FastAPI serves it); the service binds each declaration to its
collaborators once (:meth:`JsonSpec.bind`) and keeps the bound routes in
:class:`Endpoints`, which both entry paths call (FastAPI's endpoint, and
``api/http1.py`` for the hot routes): same decoding, errors and counters either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api import openapi, schemas
from api.common import ENC, JSON, HTTPError, error_body
from api.surface import split_json_tokens
from indexer.query.index import ModelRequiredError

if TYPE_CHECKING:
    from api.service import Service

log = logging.getLogger("kv_indexer.api")

Handler = Callable[[Any], Awaitable[tuple[int, Any]]]
# (route, body) -> the 200 answer of the common request in few frames, or None: then the
# handler serves it (api/http1.py tries this first on the hot routes).
Plain = Callable[[Any, bytes], "bytes | None"]


class JsonRoute:
    """One JSON POST route bound to a service: its request type, decoders and handler."""

    __slots__ = ("path", "rtype", "decoder", "rest_decoder", "handler", "hot", "error_key", "plain")

    def __init__(self, path: str, rtype: type[msgspec.Struct] | None, handler: Handler, hot: bool,
                 error_key: str, plain: Plain | None = None) -> None:
        self.path = path
        self.rtype = rtype
        self.decoder: msgspec.json.Decoder[Any] | None = msgspec.json.Decoder(rtype) if rtype is not None else None
        twin = schemas.tokens_twin(rtype) if rtype is not None else None
        self.rest_decoder: msgspec.json.Decoder[Any] | None = msgspec.json.Decoder(twin) if twin is not None else None
        self.handler = handler
        self.hot = hot
        self.error_key = error_key  # "detail" (ours, FastAPI's) or "error" (Dynamo's)
        self.plain = plain


class JsonSpec:
    """A route as its module declares it: the handler (and plain door) named by a function
    of the service, so one declaration serves every app built."""

    __slots__ = ("path", "rtype", "handler", "hot", "error_key", "plain")

    def __init__(self, path: str, rtype: type[msgspec.Struct] | None, handler: Callable[[Service], Handler],
                 hot: bool, error_key: str, plain: Callable[[Service], Plain] | None) -> None:
        self.path = path
        self.rtype = rtype
        self.handler = handler
        self.hot = hot
        self.error_key = error_key
        self.plain = plain

    def bind(self, svc: Service) -> JsonRoute:
        """This route with the handlers of ``svc`` (bound methods: no frame added per call)."""
        return JsonRoute(self.path, self.rtype, self.handler(svc), self.hot, self.error_key,
                         self.plain(svc) if self.plain is not None else None)


class JsonRouter(APIRouter):
    """An ``APIRouter`` that also keeps its JSON POST routes' declarations (``specs``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.specs: list[JsonSpec] = []

    def json(self, path: str, rtype: type[msgspec.Struct] | None, handler: Callable[[Service], Handler], *,
             hot: bool = False, plain: Callable[[Service], Plain] | None = None, ok: str | None = None,
             ok_status: int = 200, also_ok: int | None = None, errors: tuple[int, ...] = (400, 404, 413, 422),
             summary: str = "", tags: tuple[str, ...] = ("indexer",), error_key: str = "detail") -> None:
        """Declare ``POST path``: ``hot`` routes are also answered by ``api/http1.py``;
        ``ok`` names the response schema, ``errors`` the documented error statuses."""
        self.specs.append(JsonSpec(path, rtype, handler, hot, error_key, plain))

        async def endpoint(request: Request) -> Response:
            endpoints: Endpoints = request.app.state.service.endpoints
            status, body = await endpoints.serve_json(endpoints.routes[path], request.scope, request.receive)
            return Response(body, status_code=status, media_type=JSON)

        self.add_api_route(path, endpoint, methods=["POST"], summary=summary, tags=list(tags),
                           openapi_extra=openapi.request_body(rtype), status_code=ok_status,
                           responses=openapi.responses(ok, ok_status, errors,
                                                       "DynErrorResponse" if error_key == "error" else "ErrorResponse",
                                                       also_ok),
                           name=path)


class Endpoints:
    """A service's bound JSON routes, and the one way a request becomes an answer."""

    def __init__(self, routes: Iterable[JsonRoute], max_request_bytes: int, api_errors: dict[tuple[str, int], int],
                 fast_path: bool = True) -> None:
        self.routes: dict[str, JsonRoute] = {r.path: r for r in routes}
        # The routes api/http1.py answers inside the HTTP protocol; None: it answers none.
        self.hot: dict[str, JsonRoute] | None = (
            {p: r for p, r in self.routes.items() if r.hot} if fast_path else None)
        self.max_request_bytes = max_request_bytes
        self.api_errors = api_errors  # {(path, status): n}, exported as kvi_api_errors

    async def serve_json(self, route: JsonRoute, scope: MutableMapping[str, Any],
                         receive: Callable) -> tuple[int, bytes]:
        """Read, decode, handle and encode one request; every failure is a counted 4xx."""
        try:
            body = await read_body(scope, receive, self.max_request_bytes)
        except HTTPError as e:
            return self.refused(route, e.status, e.detail)
        return await self.serve_body(route, body)

    async def serve_body(self, route: JsonRoute, body: bytes) -> tuple[int, bytes]:
        """Decode, handle and encode one request whose body is read; every failure is a counted 4xx."""
        try:
            req = decode(route, body) if route.decoder is not None else None
            status, out = await route.handler(req)
            return status, out if isinstance(out, bytes) else ENC.encode(out)
        except HTTPError as e:
            status, detail = e.status, e.detail
        except msgspec.ValidationError as e:
            status, detail = 422, f"invalid request: {e}"
        except msgspec.DecodeError as e:
            status, detail = 400, f"request body is not valid JSON: {e}"
        except ModelRequiredError as e:
            status, detail = 422, str(e.args[0])
        except KeyError as e:  # unknown model: the index says which
            status, detail = 404, str(e.args[0]) if e.args else "not found"
        except Exception:  # a bug: say so, count it, keep serving
            log.exception("internal error in %s", route.path)
            status, detail = 500, "internal error"
        return self.refused(route, status, detail)

    def refused(self, route: JsonRoute, status: int, detail: str) -> tuple[int, bytes]:
        """Count an error answer of ``route`` and return its body."""
        key = (route.path, status)
        self.api_errors[key] = self.api_errors.get(key, 0) + 1
        return status, error_body(detail, route.error_key)


def service_of(request: Request) -> Service:
    """The service an app's request is for (``create_app`` puts it in the app's state)."""
    return request.app.state.service


async def answer(call: Awaitable[tuple[int, Any]]) -> Response:
    """The JSON response of a handler outside the JSON routes (one with a path parameter):
    its ``(status, body)``, or its client error."""
    try:
        status, out = await call
    except HTTPError as e:
        return Response(error_body(e.detail), status_code=e.status, media_type=JSON)
    return Response(ENC.encode(out), status_code=status, media_type=JSON)


def decode(route: JsonRoute, body: bytes) -> Any:
    """One strict typed decode; on a type error, once more with integral floats (``58.0``)
    read as the integers JSON Schema says they are. Strings are never numbers.

    A body with ``token_ids`` is first split in C (the tokens read into uint32 bytes,
    the other members decoded and validated by the route's twin type). Anything the
    split declines (an empty array, a float, a token out of range, malformed JSON) or
    the twin refuses goes the typed way, so every answer and error is the typed
    decoder's."""
    rest = route.rest_decoder
    if rest is not None:
        split = split_json_tokens(body)
        if split is not None:
            try:
                q = rest.decode(split[0])
            except msgspec.DecodeError:
                q = None
            if q is not None:
                q.token_ids = split[1]
                return q
    try:
        return route.decoder.decode(body)  # type: ignore[union-attr]  # a route with a body type
    except msgspec.ValidationError:
        obj = msgspec.json.decode(body)
        if not _ints_from_floats(obj):
            raise
        return msgspec.convert(obj, route.rtype, strict=True)


def _ints_from_floats(obj: Any) -> bool:
    """Replace integral floats by ints in place, iteratively; True when any was found."""
    found = False
    stack = [obj]
    while stack:
        x = stack.pop()
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in list(items):
            if isinstance(v, float) and v.is_integer():
                x[k] = int(v)
                found = True
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return found


async def read_body(scope: MutableMapping[str, Any], receive: Callable, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes with 413 (R-BAD-2)
    before reading it when Content-Length says so, else as soon as it passes."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                raise HTTPError(400, "bad Content-Length") from None
            if n > limit:
                raise HTTPError(413, f"request body of {n} bytes exceeds the limit of {limit}")
            break
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected")
        chunk = msg.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
