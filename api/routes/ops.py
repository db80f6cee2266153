"""The operations routes: probes (``/healthz``, ``/readyz``), ``/metrics``, and what the
index holds (``/v1/workers``, ``/v1/stats``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.common import ENC, JSON
from api.jsonroutes import service_of
from api.routesync import RouteSyncLike
from api.settings import Settings
from indexer.ingest.base import Ingest

router = APIRouter()


def readiness(settings: Settings, ingest: Ingest, route_sync: RouteSyncLike) -> tuple[bool, list[str]]:
    """Ready when ingest runs, route sync (if any) has caught up with the other replicas
    (or given up waiting for NATS), and at least ``ready_fraction`` of the subscribed
    workers (all, by default) are connected and not replaying; the reasons name the others."""
    fatal = []
    if not ingest.running:
        fatal.append(f"ingest thread is not running ({ingest.error or 'not started'})")
    if not route_sync.ready:
        fatal.append("route sync: joining the other router replicas")
    reasons = []
    subscribed = 0
    for w in ingest.workers():
        name = f"{w['engine']}/{w['dp_rank']}"
        if "connected" not in w:
            continue
        subscribed += 1
        if not w["connected"]:
            reasons.append(f"{name}: not connected to {w['endpoint']}")
        elif w["replaying"]:
            reasons.append(f"{name}: replaying")
    ok = not fatal and (subscribed - len(reasons)) >= settings.ready_fraction * subscribed
    return ok, fatal + reasons


@router.get("/v1/workers", tags=["indexer"],
            summary="Per-worker health, freshness, sizes, in-flight load and transport status")
async def workers(request: Request) -> Response:
    return Response(ENC.encode(service_of(request).ingest.workers()), media_type=JSON)


@router.get("/v1/stats", tags=["indexer"], summary="Index sizes per model, tier and group, and event counters")
async def stats(request: Request) -> Response:
    svc = service_of(request)
    st = svc.index.stats()
    st["api_errors"] = {f"{p} {s}": n for (p, s), n in sorted(svc.api_errors.items())}
    st["discovery"] = svc.discovery.status()
    st["route_sync"] = svc.route_sync.stats()
    return Response(ENC.encode(st), media_type=JSON)


@router.get("/healthz", tags=["ops"], summary="Process alive (HEAD too)")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type=JSON)


@router.get("/readyz", tags=["ops"],
            summary="Ingest running (and, with ready_fraction > 0, that share of workers connected and not "
            "replaying); 503 otherwise. The reasons name every worker that is not healthy. HEAD too.",
            responses={503: {"description": "Not ready"}})
async def readyz(request: Request) -> Response:
    svc = service_of(request)
    ok, reasons = readiness(svc.settings, svc.ingest, svc.route_sync)
    return Response(ENC.encode({"ready": ok, "reasons": reasons}), status_code=200 if ok else 503, media_type=JSON)


# Probes may use HEAD (same answer, no body); one operation per path in the schema.
router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", tags=["ops"], summary="Prometheus metrics (text format)", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    return Response(generate_latest(service_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
