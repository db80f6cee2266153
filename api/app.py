"""The FastAPI application: ``create_app(settings=None, index=None)``.

Every JSON POST route is one handler ``(parsed request) -> (status, body bytes)``,
decoded and validated by msgspec (one typed pass, in C) and encoded by msgspec. The
hot query routes are also answered before FastAPI's middleware stack and routing
(``Settings.fast_path``; about 50 us a call less); FastAPI still
declares them, so ``/openapi.json`` and ``/docs`` describe every route and the same
handler answers either way.

Queries run on the event loop thread: a match takes the index lock for ~5-10 us, and
the ingest thread yields between batches when a query waits (see ``PrefixIndex``).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, cast

import msgspec
from fastapi import FastAPI, Path, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import dynamo, schemas, text, ui
from api.auth import CLIENT, Auth, client_of, is_mutating
from api.common import ENC, JSON, HTTPError, off_loop, u64_keys
from api.metrics import Metrics
from api.settings import Settings
from api.state import StateKeeper
from api.surface import split_json_tokens
from indexer import PrefixIndex
from indexer.ingest.live import Indexer
from indexer.query.index import ModelRequiredError
from indexer.query.route import Load
from indexer.store.snapshot import SnapshotError
from indexer.transport.discovery import DnsDiscovery
from indexer.wire.engines import EndpointRefused, EngineConfig

log = logging.getLogger("kv_indexer.api")
audit_log = logging.getLogger("kv_indexer.audit")


def error_body(detail: str, key: str = "detail") -> bytes:
    return ENC.encode({key: detail})


Handler = Callable[[Any], Awaitable[tuple[int, Any]]]


class _Route:
    """One JSON POST route: its request type, decoder and handler."""

    __slots__ = ("path", "rtype", "decoder", "rest_decoder", "handler", "hot", "error_key", "plain")

    def __init__(self, path: str, rtype: type[msgspec.Struct] | None, handler: Handler, hot: bool,
                 error_key: str, plain: Callable[[Any, bytes], bytes | None] | None = None) -> None:
        self.path = path
        self.rtype = rtype
        self.decoder: msgspec.json.Decoder[Any] | None = msgspec.json.Decoder(rtype) if rtype is not None else None
        twin = schemas.tokens_twin(rtype) if rtype is not None else None
        self.rest_decoder: msgspec.json.Decoder[Any] | None = msgspec.json.Decoder(twin) if twin is not None else None
        self.handler = handler
        self.hot = hot
        self.error_key = error_key  # "detail" (ours, FastAPI's) or "error" (Dynamo's)
        # (route, body) -> the 200 answer of the common request in few frames, or None:
        # then the handler serves it (api/http1.py tries this first on the hot routes).
        self.plain = plain


class Service:
    """The state behind the routes: settings, index, ingest and metrics."""

    def __init__(self, settings: Settings, index: PrefixIndex) -> None:
        self.settings = settings
        self.index = index
        self.state = StateKeeper(settings)
        if settings.nats_url:  # a replica of the relay's JetStream event log (only then is nats imported)
            from indexer.ingest.jetstream import JetStreamIngest

            self.ingest: Any = JetStreamIngest(settings.nats_url, index, stream=settings.nats_stream,
                                               subject=settings.nats_subject, bucket=settings.nats_bucket,
                                               snapshot_interval_s=settings.snapshot_interval_s)
        else:
            self.ingest = self._indexer(settings, index)
        self.auth = Auth(settings.api_token, settings.auth_reads) if settings.api_token else None
        self.api_errors: dict[tuple[str, int], int] = {}
        self.metrics = Metrics(index, self.ingest, self.api_errors,
                               self.auth.failures if self.auth is not None else None, self.state)
        self.routes: dict[str, _Route] = {}
        # Each model's tokenizer (prompt / messages requests), loaded now: a bad directory stops the start.
        self.text = text.Texts(dict(settings.tokenizers), settings.max_request_tokens, index)
        self.decisions = ui.Decisions()  # recent routing decisions, for the page (api/ui.py)
        self.discovery = None
        d = settings.discovery
        if d is not None and not settings.nats_url:  # a replica's engines are the relay's
            self.discovery = DnsDiscovery(
                self.ingest, d.dns_name, port=d.port, replay_port=d.replay_port, metrics_port=d.metrics_port,
                dp_size=d.dp_size, model=d.model, topic=d.topic, interval_s=d.interval_s, grace_s=d.grace_s)

    def _indexer(self, settings: Settings, index: PrefixIndex) -> Indexer:
        """The ZMQ ingest, started from the state dir's snapshot or a peer's when there
        is one (R-DUR-2); a snapshot that cannot be restored is counted and skipped."""
        kw: dict[str, Any] = dict(index=index, replay_timeout_s=settings.replay_timeout_s,
                                  max_workers=settings.max_workers, endpoint_policy=settings.endpoint_policy(),
                                  metrics_interval_s=settings.metrics_interval_s)
        snap = self.state.initial()
        if snap is not None:
            try:
                ingest = Indexer(settings.engines, snapshot=snap, **kw)
            except SnapshotError as e:
                log.error("state: %s; starting empty", e)
                self.state.restored(False, e.reason)
            except ValueError as e:  # e.g. an index handed in that already holds workers
                log.error("state: snapshot not restored: %s; starting without it", e)
                self.state.restored(False, "not_empty")
            else:
                self.state.restored(True)
                st = index.stats()
                log.info("state: restored %d workers, %d nodes, %d entries", st["workers"], st["nodes"],
                         st["resident_entries"])
                return ingest
        return Indexer(settings.engines, **kw)

    def snapshot(self) -> bytes:
        """The index and the engine registry as snapshot bytes (GET /v1/snapshot, the state dir)."""
        return cast(bytes, self.ingest.snapshot())

    def state_version(self) -> tuple[int, ...]:
        """Changes whenever a snapshot would differ: batches applied or dropped, workers'
        stale marks and restarts, engines registered or removed (from stats(): counters,
        no tree walk; once a snapshot interval)."""
        st = self.index.stats()
        c = st["counters"]
        return (c.get("batches_applied", 0), c.get("stale_marked", 0), c.get("stale_cleared", 0),
                c.get("restarts", 0), sum(self.ingest.changes.values()), st["workers"],
                sum(st["dropped_payloads"].values()))

    # ------------------------------------------------------------- transport

    async def serve_json(self, route: _Route, scope: MutableMapping[str, Any], receive: Callable) -> tuple[int, bytes]:
        """Read, decode, handle and encode one request; every failure is a counted 4xx."""
        try:
            body = await _read_body(scope, receive, self.settings.max_request_bytes)
        except HTTPError as e:
            return self.refused(route, e.status, e.detail)
        return await self.serve_body(route, body)

    async def serve_body(self, route: _Route, body: bytes) -> tuple[int, bytes]:
        """Decode, handle and encode one request whose body is read; every failure is a counted 4xx."""
        try:
            req = _decode(route, body) if route.decoder is not None else None
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

    def refused(self, route: _Route, status: int, detail: str) -> tuple[int, bytes]:
        """Count an error answer of ``route`` and return its body."""
        key = (route.path, status)
        self.api_errors[key] = self.api_errors.get(key, 0) + 1
        return status, error_body(detail, route.error_key)

    def observe(self, path: str, t0: float, res) -> None:
        """Count one answered query in the histograms (time since ``t0``, best prefix)."""
        self.metrics.observe(path, time.perf_counter() - t0, res.workers[0].total_blocks if res.workers else 0)

    def answer(self, path: str, t0: float, res) -> tuple[int, bytes]:
        """The ``/v1/match`` body of ``res``, counted."""
        out = ENC.encode(res.body())
        self.observe(path, t0, res)
        return 200, out

    def check_tokens(self, items) -> None:
        """413 when a request carries more token ids (a list, or their uint32 bytes) or
        block keys than ``max_request_tokens`` (R-BAD-2)."""
        n = len(items) >> 2 if items.__class__ is bytes else len(items)
        if n > self.settings.max_request_tokens:
            raise HTTPError(413, f"{n} tokens exceed the limit of {self.settings.max_request_tokens} per request")

    # --------------------------------------------------------------- queries

    async def match(self, q: schemas.MatchRequest):
        if q.token_ids is None:  # a prompt or messages (R-TXT): tokenized off the loop
            q = await self.text.resolve(q)
        self.check_tokens(q.token_ids)
        t0 = time.perf_counter()
        res = self.index.match(q.token_ids, model=q.model, lora_name=q.lora_name,  # type: ignore[arg-type]  # set above
                               cache_salt=q.cache_salt)
        return self.answer("/v1/match", t0, res)

    def plain_request(self, route: _Route, body: bytes) -> tuple[Any, bytes] | None:
        """The body of a plain-door request read: ``(its other members, decoded by the
        route's twin type; the token ids as uint32 bytes)`` when it is the common request
        (token ids, no LoRA or salt, within ``max_request_tokens``); None for anything else,
        which the route's handler then answers (errors included: nothing is counted here)."""
        split = split_json_tokens(body)  # None without api._surface: the plain doors are then shut
        if split is None or route.rest_decoder is None:
            return None
        try:
            q = route.rest_decoder.decode(split[0])  # text fields must be null here (tokens_twin)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        buf = split[1]
        if q.lora_name is not None or q.cache_salt is not None or len(buf) >> 2 > self.settings.max_request_tokens:
            return None
        return q, buf

    def match_plain(self, route: _Route, body: bytes) -> bytes | None:
        """:meth:`match`'s answer to the common request (:meth:`plain_request`, a model of the
        common shape: :meth:`~indexer.query.match.Query.match_plain`) in few Python frames, from the
        body as read; None for any other request, which :meth:`match` then answers."""
        got = self.plain_request(route, body)
        if got is None:
            return None
        q, buf = got
        t0 = time.perf_counter()
        try:
            res = self.index.match_plain(buf, q.model)
        except (KeyError, ModelRequiredError):
            return None
        if res is None:
            return None
        out = ENC.encode(res.body())
        ws = res.workers  # a WorkerMatch's [1] is -total_blocks (no property frame)
        self.metrics.observe("/v1/match", time.perf_counter() - t0, -ws[0][1] if ws else 0)
        return out

    async def match_by_keys(self, q: schemas.MatchByKeysRequest):
        self.check_tokens(q.block_keys)
        t0 = time.perf_counter()
        res = self.index.match_by_keys(u64_keys(q.block_keys), model=q.model)
        return self.answer("/v1/match_by_keys", t0, res)

    async def route_request(self, q: schemas.RouteRequest):
        if q.token_ids is None:  # a prompt or messages (R-TXT): tokenized off the loop
            q = await self.text.resolve(q)
        self.check_tokens(q.token_ids)
        t0 = time.perf_counter()
        try:
            out = self.index.route(
                q.token_ids, model=q.model, lora_name=q.lora_name,  # type: ignore[arg-type]  # set above
                cache_salt=q.cache_salt,
                load={k: Load(v.active_prefill_tokens, v.active_decode_blocks) for k, v in q.load.items()},
                candidates=q.candidates, prefill_load_scale=self.settings.prefill_load_scale, link=self.ingest.link,
                record=q.record, max_tokens=q.max_tokens)
        except ValueError as e:  # a malformed candidate or load key, named
            raise HTTPError(422, str(e)) from None
        except KeyError:
            raise  # an unknown model: serve_json's 404 / 422
        except LookupError as e:  # no candidate at all
            raise HTTPError(404, str(e)) from None
        self.metrics.observe("/v1/route", time.perf_counter() - t0, out["ranked"][0]["cached_blocks"])
        toks: Any = q.token_ids  # list, or their uint32 bytes (the fast decode)
        self.decisions.add(t0, len(toks) >> 2 if toks.__class__ is bytes else len(toks), out)
        return 200, out

    async def route_done(self, request_id: str) -> tuple[int, Any]:
        got = self.index.route_done(request_id)
        if got is None:
            raise HTTPError(404, f"unknown request_id {request_id!r} (never issued, or ended long ago)")
        # False: it had ended already (announced with nothing to decode, done, expired).
        return 200, {"request_id": request_id, "released": got}

    # --------------------------------------------------------------- engines

    async def add_engine(self, q: schemas.EngineRequest):
        try:
            cfg = EngineConfig(**msgspec.structs.asdict(q))
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        for old in self.ingest.engines():
            if old.id == cfg.id:
                if old == cfg:
                    return 200, engine_dict(old)
                raise HTTPError(409, f"engine {cfg.id!r} is already registered with another configuration")
        await self.subscribe(cfg, "api")
        return 201, engine_dict(cfg)

    async def subscribe(self, cfg: EngineConfig, via: str, refused_status: int = 422) -> None:
        """Subscribe to ``cfg`` for an API caller, and say so in the audit log.

        ``refused_status`` for an endpoint the policy refuses (tcp only, allowlist), 422
        for dp_size over ``max_workers``, 409 when the id or the capacity is taken."""
        if cfg.dp_size > self.settings.max_workers:
            raise HTTPError(422, f"engine {cfg.id}: dp_size {cfg.dp_size} exceeds max_workers="
                                 f"{self.settings.max_workers}")
        try:
            await off_loop(functools.partial(self.ingest.add_engine, cfg, via=via))
        except EndpointRefused as e:
            audit_log.warning("refused to register engine %s for %s: %s", cfg.id, CLIENT.get(), e)
            raise HTTPError(refused_status, str(e)) from None
        except ValueError as e:
            raise HTTPError(409, str(e)) from None
        audit_log.info("engine %s registered via %s by %s: model=%s endpoint=%s replay_endpoint=%s ranks=%d..%d",
                       cfg.id, via, CLIENT.get(), cfg.model, cfg.endpoint, cfg.replay_endpoint,
                       cfg.dp_rank_start, cfg.dp_rank_start + cfg.dp_size - 1)

    async def unsubscribe(self, engine_id: str, via: str, dp_rank: int | None = None) -> bool:
        """Unsubscribe (all ranks, or the config covering ``dp_rank``), audit-logged."""
        try:
            gone = await off_loop(functools.partial(self.ingest.remove_engine, engine_id, dp_rank, via=via))
        except ValueError as e:  # a replica: engines are registered with the relay
            raise HTTPError(409, str(e)) from None
        if gone:
            audit_log.info("engine %s%s unregistered via %s by %s", engine_id,
                           "" if dp_rank is None else f" dp_rank {dp_rank}", via, CLIENT.get())
        return gone

    async def clear_engine(self, engine_id: str) -> tuple[int, Any]:
        n = self.index.clear_engine(engine_id)
        if not n:
            raise HTTPError(404, f"unknown engine {engine_id!r}")
        audit_log.info("engine %s cleared by %s (%d workers)", engine_id, CLIENT.get(), n)
        return 200, {"cleared": engine_id, "workers": n}

    async def remove_engine(self, engine_id: str) -> tuple[int, Any]:
        n = sum(c.dp_size for c in self.ingest.engines() if c.id == engine_id)
        if not await self.unsubscribe(engine_id, "api"):
            raise HTTPError(404, f"unknown engine {engine_id!r}")
        return 200, {"removed": engine_id, "workers": n}

    def index_block_size(self, model: str) -> int | None:
        return self.index.block_size(model)

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready when ingest runs and at least ``ready_fraction`` of the subscribed workers
        (all, by default) are connected and not replaying; the reasons name the others."""
        fatal = []
        if not self.ingest.running:
            fatal.append(f"ingest thread is not running ({self.ingest.error or 'not started'})")
        reasons = []
        subscribed = 0
        for w in self.ingest.workers():
            name = f"{w['engine']}/{w['dp_rank']}"
            if "connected" not in w:
                continue
            subscribed += 1
            if not w["connected"]:
                reasons.append(f"{name}: not connected to {w['endpoint']}")
            elif w["replaying"]:
                reasons.append(f"{name}: replaying")
        ok = not fatal and (subscribed - len(reasons)) >= self.settings.ready_fraction * subscribed
        return ok, fatal + reasons


async def _answer(call: Awaitable[tuple[int, Any]]) -> Response:
    """The JSON response of a handler outside ``serve_json`` (a path parameter): its
    ``(status, body)``, or its client error."""
    try:
        status, out = await call
    except HTTPError as e:
        return Response(error_body(e.detail), status_code=e.status, media_type=JSON)
    return Response(ENC.encode(out), status_code=status, media_type=JSON)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or 0.0.0.0 / :: (every interface)


def engine_dict(cfg: EngineConfig) -> dict:
    return msgspec.to_builtins(cfg)


def _decode(route: _Route, body: bytes):
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


def _ints_from_floats(obj) -> bool:
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


async def _read_body(scope: MutableMapping[str, Any], receive: Callable, limit: int) -> bytes:
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


_JSON_TYPE = (b"content-type", JSON.encode())


async def _send(send: Callable, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send one whole JSON response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON_TYPE, (b"content-length", str(len(body)).encode()), *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


class _App(FastAPI):
    """FastAPI, with POSTs to the hot routes answered before its middleware stack.

    The stack (error, telemetry, body-limit and exception middleware, then routing)
    costs ~4 us a request; the hot routes need none of it: ``Service.serve_json``
    reads the body within the size bound, answers every failure with a counted
    4xx and never raises. Everything else goes through FastAPI as usual."""

    fast_routes: dict | None = None  # path -> _Route, when Settings.fast_path
    service: Service | None = None
    auth: Auth | None = None  # set when an API token is configured

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            auth = self.auth
            if auth is not None:
                refused = auth.refuse(scope)
                if refused is not None:
                    status, msg, headers = refused
                    await _send(send, status, error_body(msg, dynamo.error_key(scope["path"])), headers)
                    return
            routes = self.fast_routes
            if routes is not None and scope["method"] == "POST":
                route = routes.get(scope["path"])
                if route is not None:
                    # (service is set with fast_routes)
                    status, body = await self.service.serve_json(route, scope, receive)  # type: ignore[union-attr]
                    await _send(send, status, body)
                    return
            if is_mutating(scope["method"], scope["path"]):
                # Who asked, for the audit log lines of the handler (this task only).
                CLIENT.set(f"{client_of(scope)} ({'with the token' if auth is not None else 'no token configured'})")
        await super().__call__(scope, receive, send)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_responses(ok: str | None, ok_status: int = 200, errors=(400, 404, 413, 422),
                    error_schema: str = "ErrorResponse", also_ok: int | None = None) -> dict:
    out: dict = {}
    for status in (ok_status, also_ok):
        if status is not None:
            out[status] = {"description": "OK"}
            if ok is not None:
                out[status]["content"] = {JSON: {"schema": _ref(ok)}}
    for s in errors:
        out[s] = {"description": "Error", "content": {JSON: {"schema": _ref(error_schema)}}}
    return out


def _document_auth(spec: dict, auth: Auth) -> None:
    """Declare the bearer token, and its 401 and 403, on every operation that needs it."""
    spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            concrete = path.replace("{engine_id}", "x")
            if not auth.needs_token(method.upper(), concrete):
                continue
            op["security"] = [{"bearer": []}]
            schema = _ref("DynErrorResponse" if path in dynamo.PATHS else "ErrorResponse")
            for status, what in (("401", "No bearer token"), ("403", "Wrong bearer token")):
                op.setdefault("responses", {})[status] = {"description": what, "content": {JSON: {"schema": schema}}}


def create_app(settings: Settings | None = None, index: PrefixIndex | None = None) -> FastAPI:
    """Build the app. ``settings`` default to :class:`Settings` defaults (no file or
    environment is read here: that is the CLI's job); ``index`` defaults to a new
    :class:`PrefixIndex` built from the settings. The ingest thread starts and stops
    with the app's lifespan."""
    settings = settings or Settings()
    index = index if index is not None else PrefixIndex(**settings.index_options())
    svc = Service(settings, index)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if svc.auth is None and not _is_loopback(settings.host):
            log.warning("SECURITY: listening on %s without an API token: anyone who can reach port %d can register "
                        "engines (the index then connects where they say) and delete them. Set KVI_API_TOKEN or "
                        "api_token_file, and allowed_endpoints (docs/deploy.md, Security).", settings.host,
                        settings.port)
        svc.ingest.start()
        if hasattr(svc.ingest, "snapshot"):
            svc.state.start(svc.snapshot, svc.state_version)
        if svc.discovery is not None:
            svc.discovery.start()
        log.info("kv-indexer ready: %d engine(s) configured%s", len(settings.engines),
                 f", discovering {svc.discovery.name}" if svc.discovery is not None else "")
        try:
            yield
        finally:
            if svc.discovery is not None:
                await off_loop(svc.discovery.stop)
            await svc.ingest.astop()
            svc.text.close()
            await off_loop(svc.state.final)  # after ingest stopped: the last state exactly

    app = _App(
        title="kv-prefix-indexer",
        version="0.1.0",
        summary="KV-aware routing index for vLLM fleets: which replica holds the longest prefix, in which tier.",
        lifespan=lifespan,
    )
    app.state.service = svc

    def json_route(path: str, rtype: type[msgspec.Struct] | None, handler: Handler, *, hot: bool = False,
                   ok: str | None = None, ok_status: int = 200, errors=(400, 404, 413, 422),
                   summary: str = "", tags=("indexer",), error_key: str = "detail",
                   also_ok: int | None = None, plain: Callable[[Any, bytes], bytes | None] | None = None) -> None:
        route = svc.routes[path] = _Route(path, rtype, handler, hot, error_key, plain)
        extra = None
        if rtype is not None:
            extra = {"requestBody": {"required": True, "content": {JSON: {"schema": _ref(rtype.__name__)}}}}

        async def endpoint(request: Request) -> Response:
            status, body = await svc.serve_json(route, request.scope, request.receive)
            return Response(body, status_code=status, media_type=JSON)

        app.add_api_route(path, endpoint, methods=["POST"], summary=summary, tags=list(tags),
                          openapi_extra=extra, status_code=ok_status,
                          responses=_json_responses(ok, ok_status, errors,
                                                    "DynErrorResponse" if error_key == "error" else "ErrorResponse",
                                                    also_ok),
                          name=path)

    json_route("/v1/match", schemas.MatchRequest, svc.match, hot=True, ok="MatchResponse",
               summary="Longest cached prefix per worker for a prompt", plain=svc.match_plain)
    json_route("/v1/match_by_keys", schemas.MatchByKeysRequest, svc.match_by_keys, hot=True,
               ok="MatchResponse", summary="The same, with precomputed block keys")
    json_route("/v1/route", schemas.RouteRequest, svc.route_request, hot=True, ok="RouteResponse",
               summary="Best replica for a request (cache and load)")
    json_route("/v1/engines", schemas.EngineRequest, svc.add_engine, ok="EngineOut", ok_status=201,
               errors=(400, 409, 413, 422), also_ok=200,
               summary="Register an engine (subscribe to its events); 200 when already registered identically")

    @app.get("/v1/engines", tags=["indexer"], summary="Configured engines")
    async def list_engines() -> Response:
        return Response(ENC.encode([engine_dict(c) for c in svc.ingest.engines()]), media_type=JSON)

    @app.delete("/v1/engines/{engine_id}", tags=["indexer"], summary="Unregister an engine and drop its state",
                responses=_json_responses(None, errors=(404,)))
    async def delete_engine(engine_id: str) -> Response:
        return await _answer(svc.remove_engine(engine_id))

    @app.post("/v1/engines/{engine_id}/clear", tags=["indexer"],
              summary="The engine's prefix cache was reset (vLLM's /reset_prefix_cache): drop its GPU and CPU "
              "residency now, not at the engine's next step",
              responses={200: {"content": {JSON: {"schema": _ref("ClearedOut")}}},
                         **_json_responses(None, errors=(404,))})
    async def clear_engine(engine_id: Annotated[str, Path(max_length=256)]) -> Response:
        return await _answer(svc.clear_engine(engine_id))

    @app.post("/v1/route/{request_id}/done", tags=["indexer"],
              summary="A routed request finished: release its in-flight load (404 when unknown or expired)",
              responses={200: {"content": {JSON: {"schema": _ref("DoneOut")}}}, **_json_responses(None, errors=(404,))})
    async def route_done(request_id: Annotated[str, Path(max_length=64)]) -> Response:
        return await _answer(svc.route_done(request_id))

    @app.get("/v1/snapshot", tags=["indexer"], response_class=Response,
             summary="The whole index and the engine registry as one snapshot file (docs/snapshot.md); "
             "needs the API token once one is configured",
             responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                   "format": "binary"}}}}})
    async def snapshot() -> Response:
        if not hasattr(svc.ingest, "snapshot"):  # a JetStream replica: its snapshots are in the object store
            return Response(error_body("this replica follows the JetStream event log: its snapshots are in the "
                                       f"object store (bucket {svc.settings.nats_bucket!r}); start a new replica "
                                       "with --nats, not --bootstrap-from"), status_code=409, media_type=JSON)
        data = await off_loop(svc.snapshot)
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="index.snap"'})

    @app.get("/v1/workers", tags=["indexer"],
             summary="Per-worker health, freshness, sizes, in-flight load and transport status")
    async def workers() -> Response:
        return Response(ENC.encode(svc.ingest.workers()), media_type=JSON)

    @app.get("/v1/stats", tags=["indexer"], summary="Index sizes per model, tier and group, and event counters")
    async def stats() -> Response:
        st = svc.index.stats()
        st["api_errors"] = {f"{p} {s}": n for (p, s), n in sorted(svc.api_errors.items())}
        st["discovery"] = svc.discovery.status() if svc.discovery is not None else None
        return Response(ENC.encode(st), media_type=JSON)

    @app.get("/healthz", tags=["ops"], summary="Process alive (HEAD too)")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    @app.get("/readyz", tags=["ops"],
             summary="Ingest running (and, with ready_fraction > 0, that share of workers connected and not "
             "replaying); 503 otherwise. The reasons name every worker that is not healthy. HEAD too.",
             responses={503: {"description": "Not ready"}})
    async def readyz() -> Response:
        ok, reasons = svc.readiness()
        return Response(ENC.encode({"ready": ok, "reasons": reasons}), status_code=200 if ok else 503,
                        media_type=JSON)

    # Probes may use HEAD (same answer, no body); one operation per path in the schema.
    app.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics (text format)", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    dynamo.add_routes(app, svc, json_route)
    text.add_routes(app, svc, json_route)
    ui.add_routes(app, svc, json_route)

    schema_types = list(schemas.REQUEST_TYPES.values()) + list(schemas.RESPONSE_TYPES.values())
    _, components = msgspec.json.schema_components(schema_types, ref_template="#/components/schemas/{name}")

    # The configured size bound (R-BAD-2) is part of the schema: larger lists get 413.
    for name, field in (("MatchRequest", "token_ids"), ("RouteRequest", "token_ids"), ("DynQuery", "token_ids"),
                        ("MatchByKeysRequest", "block_keys"), ("DynQueryByHash", "block_hashes")):
        components[name]["properties"][field]["maxItems"] = settings.max_request_tokens
        if field != "token_ids":  # msgspec bounds stop at int64; u64_keys checks the top
            components[name]["properties"][field]["items"]["maximum"] = 2**64 - 1
    text.document(components)  # exactly one of token_ids, prompt, messages (R-TXT-3)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
            if svc.auth is not None:
                _document_auth(spec, svc.auth)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path only; name all.
            path = request.url.path
            allowed = sorted({m for r in app.routes if getattr(r, "path_regex", None) is not None
                              and r.path_regex.match(path)  # type: ignore[attr-defined]  # checked just above
                              for m in (getattr(r, "methods", None) or ())})
            headers["Allow"] = ", ".join(allowed)
        key = dynamo.error_key(request.url.path)  # Dynamo's error shape on its routes
        return Response(error_body(str(exc.detail), key), status_code=exc.status_code, headers=headers,
                        media_type=JSON)

    app.auth = svc.auth
    if settings.fast_path:
        app.service = svc
        app.fast_routes = {p: r for p, r in svc.routes.items() if r.hot}
    return app
