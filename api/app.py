"""The FastAPI application: ``create_app(settings=None, index=None)``.

A request reaches a handler by one of two entry paths:

* ``api/http1.py``: the hot JSON POST routes (``/v1/match``, ``/v1/match_by_keys``,
  ``/v1/route``, ``/query``, ``/query_by_hash``) answered inside uvicorn's httptools
  protocol, before any ASGI machinery: a query's server time is a few microseconds of
  index work, and uvicorn's per-request scope, task and messages were most of the rest.
* FastAPI, for everything else: every other route, and the hot routes whenever the
  protocol door does not take a request (``Settings.fast_path`` off, another HTTP
  implementation, an access log, HTTP/1.0, ``Expect``, ...). FastAPI also declares
  the hot routes, so ``/openapi.json`` and ``/docs`` describe every route.

Both call the same bound route (``api.jsonroutes.Endpoints``): same decoding, auth,
errors and counters, whichever path a request took.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from api import dynamo, openapi
from api.auth import CLIENT, Auth, client_of, is_mutating
from api.common import JSON, error_body
from api.routes import JSON_ROUTES, ROUTERS
from api.service import Service
from api.settings import Settings
from indexer import PrefixIndex


class _TokenCheck:
    """ASGI middleware ahead of routing: the bearer token (api/auth.py) on every request
    that needs it, and who asked, for the audit log lines of the mutating handlers."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            auth = self.auth
            refused = auth.refuse(scope)
            if refused is not None:
                status, msg, headers = refused
                body = error_body(msg, dynamo.error_key(scope["path"]))
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", JSON.encode()),
                                        (b"content-length", str(len(body)).encode()), *headers]})
                await send({"type": "http.response.body", "body": body})
                return
            if is_mutating(scope["method"], scope["path"]):
                CLIENT.set(f"{client_of(scope)} ({'with the token' if auth.enforced else 'no token configured'})")
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None, index: PrefixIndex | None = None) -> FastAPI:
    """Build the app. ``settings`` default to :class:`Settings` defaults (no file or
    environment is read here: that is the CLI's job); ``index`` defaults to a new
    :class:`PrefixIndex` built from the settings. ``replica_slot`` sets the index's tie slot
    (a given index's too, unless it is the default 0/1). The service (``app.state.service``)
    starts and stops with the app's lifespan."""
    settings = settings or Settings()
    index = index if index is not None else PrefixIndex(**settings.index_options())
    if settings.tie_slot() != (0, 1):  # else the index keeps its own (a new one's is 0/1)
        index.set_tie_slot(*settings.tie_slot())
    svc = Service(settings, index, JSON_ROUTES)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.start()
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(
        title="kv-prefix-indexer",
        version="0.1.0",
        summary="KV-aware routing index for vLLM fleets: which replica holds the longest prefix, in which tier.",
        lifespan=lifespan,
    )
    app.state.service = svc
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(_TokenCheck, auth=svc.auth)
    openapi.install(app, settings, svc.auth)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path only; name all. The
            # routers' own routes: an included router is one entry of app.routes, not its routes.
            path = request.url.path
            allowed = sorted({m for r in (*app.router.routes, *(r for rt in ROUTERS for r in rt.routes))
                              if getattr(r, "path_regex", None) is not None
                              and r.path_regex.match(path)  # type: ignore[attr-defined]  # checked just above
                              for m in (getattr(r, "methods", None) or ())})
            headers["Allow"] = ", ".join(allowed)
        key = dynamo.error_key(request.url.path)  # Dynamo's error shape on its routes
        return Response(error_body(str(exc.detail), key), status_code=exc.status_code, headers=headers,
                        media_type=JSON)

    return app

