"""What the route modules share: the client-error exception and error bodies, block-key
checks and the off-loop helper for ingest commands."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

ENC = msgspec.json.Encoder()
JSON = "application/json"
_U64 = (1 << 64) - 1


def error_body(detail: str, key: str = "detail") -> bytes:
    """An error answer's JSON body: ``{key: detail}`` ("detail" ours and FastAPI's, "error" Dynamo's)."""
    return ENC.encode({key: detail})


_OAI_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 422: "BadRequestError",
              429: "RateLimitError", 501: "NotImplementedError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
              504: "GatewayTimeoutError"}


def oai_error(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    """An error answer shaped as vLLM's OpenAI server shapes its own (the gateway's routes):
    ``{"error": {"message", "type", "param", "code"}}``."""
    from fastapi.responses import Response

    body = {"error": {"message": message, "type": _OAI_TYPES.get(status, "InternalServerError"), "param": None,
                      "code": status}}
    return Response(ENC.encode(body), status_code=status, media_type=JSON, headers=headers)


class HTTPError(Exception):
    """A client error: ``status`` and a message for the error body."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def u64_keys(keys: list[int]) -> list[int]:
    """Block keys as u64 (signed i64 wraps, as Dynamo sends them); 422 above 2^64-1."""
    if max(keys, default=0) > _U64:
        raise HTTPError(422, "invalid request: a block key exceeds 2^64-1")
    return [k & _U64 for k in keys]


async def off_loop(fn, *args):
    """Run a blocking ingest command (it waits for the ingest thread) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
