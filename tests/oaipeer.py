"""A scripted OpenAI-compatible HTTP server on 127.0.0.1 for the gateway's failure modes
that a real vLLM engine cannot be made to show on demand (a 5xx before the first byte, a
stream that stalls, a slow first token). It runs real uvicorn on a real socket in a
thread of the test process; what it does is chosen per request by the body's standard
``user`` field (vLLM ignores it):

* ``"ok"`` (default): answers like vLLM's OpenAI server (3 chunks when streamed, the usage
  chunk when ``stream_options.include_usage``), ``cached_tokens`` = the body's
  ``prompt_cached`` extra field, or 0;
* ``"fail500"``: 500 with a vLLM-shaped error, before any byte of an answer;
* ``"stall"``: streams one chunk, then nothing for 30 s;
* ``"hold"``: waits until released (``release()``), then answers.

``force`` (an attribute) overrides the body's mode for this peer alone.

Every request is logged (``seen``) with whether the client went away (``aborted``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


class OpenAIPeer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.aborted = 0
        self.holding = 0
        self.force: str | None = None
        self._release = threading.Event()
        app = Starlette(routes=[Route("/v1/completions", self._completions, methods=["POST"]),
                                Route("/v1/chat/completions", self._completions, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the OpenAI peer did not start")
            time.sleep(0.01)
        self._sock = sock

    def release(self) -> None:
        self._release.set()

    def stop(self) -> None:
        self._release.set()
        self.server.should_exit = True
        self.thread.join(10)
        self._sock.close()

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "default", "object": "model", "owned_by": self.name}]})

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        p = body.get("prompt")
        n = len(p) if isinstance(p, list) else 7
        return {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                "prompt_tokens_details": {"cached_tokens": int(body.get("prompt_cached", 0))}}

    async def _completions(self, request: Request) -> Any:
        body = await request.json()
        mode = self.force or body.get("user", "ok")
        self.seen.append({"body": body, "headers": dict(request.headers)})
        if mode == "fail500":
            return JSONResponse({"error": {"message": "engine dead", "type": "InternalServerError", "param": None,
                                           "code": 500}}, status_code=500)
        if mode == "hold":
            self.holding += 1
            await asyncio.get_running_loop().run_in_executor(None, self._release.wait, 30)
            self.holding -= 1
        rid = f"cmpl-{self.name}-{len(self.seen)}"
        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "text_completion", "model": body.get("model", "default"),
                                 "choices": [{"index": 0, "text": f"{self.name} says hi", "finish_reason": "length"}],
                                 "usage": self._usage(body)})

        async def events():
            try:
                for i, word in enumerate((self.name, " says", " hi")):
                    chunk = {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": word}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if mode == "stall" and i == 0:
                        await asyncio.sleep(30)
                so = body.get("stream_options") or {}
                if so.get("include_usage"):
                    yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': self._usage(body)})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.aborted += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")
