"""NVIDIA Dynamo's standalone indexer routes (``/register``, ``/unregister``, ``/query``,
``/query_by_hash``, ``/workers``, ``/health``), answered by :class:`api.dynamo.Dynamo`;
errors are ``{"error": ...}`` like Dynamo's own."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from api import schemas
from api.common import ENC, JSON
from api.jsonroutes import JsonRouter, service_of

TAGS = ("dynamo-compatible",)

router = JsonRouter()
router.json("/register", schemas.DynRegister, lambda s: s.dynamo.register, ok=None, ok_status=201,
            errors=(400, 409, 413, 422), summary="Dynamo: register one worker DP rank", tags=TAGS, error_key="error")
router.json("/unregister", schemas.DynUnregister, lambda s: s.dynamo.unregister, ok=None,
            errors=(400, 404, 413, 422), summary="Dynamo: unregister a worker", tags=TAGS, error_key="error")
router.json("/query", schemas.DynQuery, lambda s: s.dynamo.query, hot=True, ok="DynQueryResponse",
            summary="Dynamo: overlap per instance for token ids", tags=TAGS, error_key="error",
            plain=lambda s: s.dynamo.query_plain)
router.json("/query_by_hash", schemas.DynQueryByHash, lambda s: s.dynamo.query_by_hash, hot=True,
            ok="DynQueryResponse", summary="Dynamo: overlap per instance for local block hashes (i64)", tags=TAGS,
            error_key="error")


@router.get("/workers", tags=list(TAGS), summary="Dynamo: registered workers and their listeners")
async def workers(request: Request) -> Response:
    qp = request.query_params
    return Response(ENC.encode(service_of(request).dynamo.workers(qp.get("model_name"), qp.get("routing_group"))),
                    media_type=JSON)


@router.get("/health", tags=list(TAGS), summary="Dynamo: process alive (empty 200)", response_class=Response,
            responses={200: {"description": "alive", "content": None}})
async def health() -> Response:
    return Response(b"", status_code=200)


router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
