"""The admin routes: engines registered, listed, removed and cleared
(``/v1/engines``), and the state snapshot (``GET /v1/snapshot``); :class:`EngineAdmin`
changes what the ingest subscribes to, each change in the audit log."""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

import msgspec
from fastapi import Path, Request
from fastapi.responses import Response

from api import openapi, schemas
from api.auth import CLIENT
from api.common import ENC, JSON, HTTPError, error_body, off_loop
from api.jsonroutes import JsonRouter, answer, service_of
from api.settings import Settings
from indexer import PrefixIndex
from indexer.ingest.base import Ingest
from indexer.wire.engines import EndpointRefused, EngineConfig

audit_log = logging.getLogger("kv_indexer.audit")


def engine_dict(cfg: EngineConfig) -> dict:
    return msgspec.to_builtins(cfg)


class EngineAdmin:
    """The engine registry's changes asked over the API (ours and Dynamo's)."""

    def __init__(self, settings: Settings, index: PrefixIndex, ingest: Ingest) -> None:
        self.settings = settings
        self.index = index
        self.ingest = ingest

    async def add_engine(self, q: schemas.EngineRequest) -> tuple[int, Any]:
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


router = JsonRouter()
router.json("/v1/engines", schemas.EngineRequest, lambda s: s.admin.add_engine, ok="EngineOut", ok_status=201,
            errors=(400, 409, 413, 422), also_ok=200,
            summary="Register an engine (subscribe to its events); 200 when already registered identically")


@router.get("/v1/engines", tags=["indexer"], summary="Configured engines")
async def list_engines(request: Request) -> Response:
    return Response(ENC.encode([engine_dict(c) for c in service_of(request).ingest.engines()]), media_type=JSON)


@router.delete("/v1/engines/{engine_id}", tags=["indexer"], summary="Unregister an engine and drop its state",
               responses=openapi.responses(None, errors=(404,)))
async def delete_engine(request: Request, engine_id: str) -> Response:
    return await answer(service_of(request).admin.remove_engine(engine_id))


@router.post("/v1/engines/{engine_id}/clear", tags=["indexer"],
             summary="The engine's prefix cache was reset (vLLM's /reset_prefix_cache): drop its GPU and CPU "
             "residency now, not at the engine's next step",
             responses={200: {"content": {JSON: {"schema": openapi.ref("ClearedOut")}}},
                        **openapi.responses(None, errors=(404,))})
async def clear_engine(request: Request, engine_id: Annotated[str, Path(max_length=256)]) -> Response:
    return await answer(service_of(request).admin.clear_engine(engine_id))


@router.get("/v1/snapshot", tags=["indexer"], response_class=Response,
            summary="The whole index and the engine registry as one snapshot file (docs/snapshot.md); "
            "needs the API token once one is configured",
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}})
async def snapshot(request: Request) -> Response:
    svc = service_of(request)
    data = await off_loop(svc.ingest.snapshot)
    if data is None:  # a JetStream replica: its snapshots are in the object store
        return Response(error_body("this replica follows the JetStream event log: its snapshots are in the "
                                   f"object store (bucket {svc.settings.nats_bucket!r}); start a new replica "
                                   "with --nats, not --bootstrap-from"), status_code=409, media_type=JSON)
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": 'attachment; filename="index.snap"'})
