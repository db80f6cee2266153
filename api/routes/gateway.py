"""The gateway's routes: vLLM's OpenAI server's ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /v1/models``, forwarded to the engine the index
picks (:mod:`api.gateway`), and ``GET /v1/gateway``: predicted against delivered cached
tokens per worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.common import ENC, JSON
from api.jsonroutes import service_of
from api.ledger import Ledger

if TYPE_CHECKING:
    from api.auth import Auth
    from api.settings import Settings
    from api.text import Texts
    from indexer import PrefixIndex
    from indexer.ingest.base import Ingest

class GatewayLike(Protocol):
    """What the routes ask of the gateway."""

    async def forward(self, request: Request, path: str, chat: bool) -> Response: ...

    async def models(self) -> Response: ...

    async def close(self) -> None: ...


class NoGateway:
    """The gateway without its HTTP client installed: every request is told how to get it."""

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        return self._refuse()

    async def models(self) -> Response:
        return self._refuse()

    async def close(self) -> None:
        pass

    @staticmethod
    def _refuse() -> Response:
        from api.common import oai_error

        return oai_error(501, "the gateway needs httpx: pip install 'kv-prefix-indexer[gateway]'")


def gateway_for(settings: Settings, index: PrefixIndex, ingest: Ingest, texts: Texts, ledger: Ledger, decisions: Any,
                auth: Auth) -> GatewayLike:
    """The gateway, or :class:`NoGateway` when httpx (the gateway extra) is not installed."""
    try:
        from api.gateway import Gateway
    except ImportError:
        return NoGateway()
    return Gateway(settings, index, ingest, texts, ledger, decisions, auth)


router = APIRouter()
_OPENAI = {"description": "What the chosen engine answered (vLLM's OpenAI server), streamed when asked, with "
           "x-kvi-worker, x-kvi-request-id and x-kvi-predicted-cached-tokens headers; vLLM-shaped errors."}


@router.post("/v1/completions", tags=["gateway"], summary="A completion, routed by the index to the engine "
             "holding the longest prefix (OpenAI API, forwarded; docs/gateway.md)", responses={200: _OPENAI})
async def completions(request: Request) -> Response:
    return await service_of(request).gateway.forward(request, "/v1/completions", False)


@router.post("/v1/chat/completions", tags=["gateway"], summary="A chat completion, routed by the index "
             "(OpenAI API, forwarded; docs/gateway.md)", responses={200: _OPENAI})
async def chat_completions(request: Request) -> Response:
    return await service_of(request).gateway.forward(request, "/v1/chat/completions", True)


@router.get("/v1/models", tags=["gateway"], summary="The engines' models (their /v1/models, merged)")
async def models(request: Request) -> Response:
    return await service_of(request).gateway.models()


@router.get("/v1/gateway", tags=["gateway"], summary="Per worker: requests through the gateway, cached tokens "
            "predicted by the index against those the engine reported, retries and refusals")
async def gateway(request: Request) -> Response:
    return Response(ENC.encode(service_of(request).ledger.summary()), media_type=JSON)
