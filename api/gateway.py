"""The OpenAI-compatible gateway: ``POST /v1/completions``, ``POST /v1/chat/completions``
and ``GET /v1/models`` in front of the engines, routed by the index (docs/gateway.md).

For each request: the body is read (bounded) and parsed; its prompt or chat messages are
tokenized with the model's tokenizer (the text path, :mod:`api.text`); the index routes
the token ids exactly as ``POST /v1/route`` would, over the workers whose engine names an
``api_url`` and has room; the original body goes to that engine (its DP rank named by
vLLM's ``X-data-parallel-rank`` header), and the answer comes back as it is, a stream
event by event as the engine sends them.

In-flight bookkeeping comes from the stream itself: the first chunk ends the request's
prefill load, the last chunk (or the whole answer) its decode load, so no ``done`` call is
needed; a client that leaves closes the upstream connection (vLLM aborts the request).

Failures: a refused or timed-out connect, or a 5xx before the first byte, is retried once
on the next-ranked worker (counted); after bytes went to the client nothing is retried.
Bad bodies get vLLM-shaped errors (``{"error": {"message", "type", "param", "code"}}``).
Each worker takes at most ``gateway_max_per_worker`` requests at once: beyond, the next
ranked worker with room takes the request, and when none has room the client gets 429
(queueing here would hide the wait from the index and from other gateways; vLLM queues
behind its own scheduler anyway).

Predicted against delivered: the answer's headers name the worker and the cached tokens
the index predicted; the engine's ``usage.prompt_tokens_details.cached_tokens`` is read
from the answer (in a stream, ``stream_options.include_usage`` is added upstream when the
client did not ask, and that usage chunk is then not passed on), and both go to the
:class:`~api.ledger.Ledger`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httpx
import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from api.auth import Auth
from api.common import HTTPError, oai_error
from api.ledger import Ledger
from api.settings import Settings
from api.text import Texts
from indexer import PrefixIndex
from indexer.ingest.base import Ingest
from indexer.store.state import ModelRequiredError

__all__ = ["Gateway"]

_JSON = msgspec.json.Decoder()
_ENC = msgspec.json.Encoder()
H_WORKER, H_PREDICTED, H_REQUEST = "x-kvi-worker", "x-kvi-predicted-cached-tokens", "x-kvi-request-id"
# Headers of the engine's answer that are the connection's, not the answer's.
_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


class _Target(NamedTuple):
    url: str  # the engine's api_url, no trailing slash
    dp_size: int


class _Stream:
    """What a stream told so far: whether a chunk came back yet, and the usage."""

    __slots__ = ("first", "cached", "strip_usage")

    def __init__(self, strip_usage: bool) -> None:
        self.first = True
        self.cached: int | None = None
        self.strip_usage = strip_usage


class Gateway:
    """Forwards OpenAI requests to the engine the index picks (see the module)."""

    def __init__(self, settings: Settings, index: PrefixIndex, ingest: Ingest, texts: Texts, ledger: Ledger,
                 decisions: Any, auth: Auth) -> None:
        self.settings = settings
        self.auth = auth
        self.index = index
        self.ingest = ingest
        self.texts = texts
        self.ledger = ledger
        self.decisions = decisions  # the live page's recent routing decisions
        self._client: httpx.AsyncClient | None = None
        self._targets: dict[str, _Target] = {}  # engine id -> its api_url
        self._version = -1

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the app's loop, on first use
            s = self.settings
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.gateway_first_token_timeout_s, connect=s.gateway_connect_timeout_s),
                # vLLM's server (uvicorn) closes an idle connection after 5 s: ours go first.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def targets(self) -> dict[str, _Target]:
        """Engine id -> where its OpenAI server is, rebuilt when the registry changed."""
        v = sum(self.ingest.changes.values())
        if v != self._version:
            self._targets = {c.id: _Target(c.api_url.rstrip("/"), c.dp_size)
                             for c in self.ingest.engines() if c.api_url}
            self._version = v
        return self._targets

    # ------------------------------------------------------------------ requests

    async def models(self) -> Response:
        """``GET /v1/models``: the engines' own lists, merged by model id."""
        urls = sorted({t.url for t in self.targets().values()})
        if not urls:
            return oai_error(503, "no engine has an api_url: configure engines' api_url (or discovery's api_port)")

        async def one(url: str) -> list[dict[str, Any]]:
            try:
                r = await self.client.get(f"{url}/v1/models", timeout=self.settings.gateway_connect_timeout_s)
                return list(r.json().get("data", [])) if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                return []

        merged: dict[str, dict[str, Any]] = {}
        for data in await asyncio.gather(*(one(u) for u in urls)):
            for m in data:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    merged.setdefault(m["id"], m)
        if not merged:
            return oai_error(503, "no engine answered GET /v1/models")
        return Response(_ENC.encode({"object": "list", "data": list(merged.values())}), media_type="application/json")

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        """One completion or chat request, routed and forwarded (see the module)."""
        t_in = time.perf_counter()
        try:
            body, raw = await self._body(request)
            model, tokens = await self._tokens(body, chat)
        except HTTPError as e:
            self.ledger.rejected["no_tokenizer" if e.status == 404 else "bad_request"] += 1
            return oai_error(e.status, e.detail)
        stream = body.get("stream") is True
        upstream = raw
        strip_usage = False
        if stream:
            so = body.get("stream_options")
            if not (isinstance(so, dict) and so.get("include_usage") is True):
                body = {**body, "stream_options": {**(so if isinstance(so, dict) else {}), "include_usage": True}}
                upstream = _ENC.encode(body)
                strip_usage = True
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        headers = {"content-type": "application/json"}
        auth = request.headers.get("authorization")
        if auth and not self.auth.needs_token("POST", path):
            headers["authorization"] = auth  # the engine's own --api-key (ours, when enforced here, stays here)
        tried: set[str] = set()
        for attempt in (0, 1):
            try:
                out, target = self._route(model, tokens, salt, tried)
            except HTTPError as e:
                self.ledger.rejected["saturated" if e.status == 429 else "no_engine"] += 1
                return oai_error(e.status, e.detail, {"retry-after": "1"} if e.status == 429 else None)
            worker, rid = out.worker, out.request_id
            assert rid is not None  # recorded
            bs = self.index.headline_block_size(out.model)
            predicted = min(out.ranked[0].cached_blocks + out.ranked[0].predicted_blocks, (len(tokens) - 1) // bs) * bs
            h = dict(headers)
            if target.dp_size > 1:
                h["x-data-parallel-rank"] = str(out.dp_rank)
            ours = {H_WORKER: worker, H_PREDICTED: str(max(predicted, 0)), H_REQUEST: rid}
            self.ledger.active[worker] = self.ledger.active.get(worker, 0) + 1
            self.ledger.overhead.observe(time.perf_counter() - t_in)
            t0 = time.perf_counter()
            try:
                resp = await self.client.send(self.client.build_request("POST", target.url + path, content=upstream,
                                                                        headers=h), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self._release(worker, rid, "upstream_failed")
                if attempt == 0:
                    self.ledger.retries["connect"] += 1
                    tried.add(worker)
                    continue
                return oai_error(502, f"engine {worker} at {target.url} could not be reached: {e!r}")
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                # A kept-alive connection the engine had closed: nothing was answered, so the
                # request is asked again on a new connection (routed anew: the same worker, most
                # likely).
                self._release(worker, rid, "upstream_failed")
                if attempt == 0:
                    self.ledger.retries["connection_closed"] += 1
                    continue
                return oai_error(502, f"engine {worker}: {e!r}")
            except httpx.TimeoutException:
                self._release(worker, rid, "timeout")
                return oai_error(504, f"engine {worker} did not answer within "
                                      f"{self.settings.gateway_first_token_timeout_s} s")
            except httpx.HTTPError as e:
                self._release(worker, rid, "upstream_failed")
                return oai_error(502, f"engine {worker}: {e!r}")
            if resp.status_code >= 500 and attempt == 0:  # nothing went to the client yet
                await resp.aclose()
                self._release(worker, rid, "engine_error")
                self.ledger.retries["engine_5xx"] += 1
                tried.add(worker)
                continue
            passed = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            passed.update(ours)
            if stream and resp.status_code == 200:
                return StreamingResponse(self._relay(resp, worker, rid, len(tokens), predicted, t0,
                                                     _Stream(strip_usage)),
                                         status_code=200, headers=passed)
            return await self._whole(resp, worker, rid, len(tokens), predicted, t0, passed)
        raise AssertionError("unreachable: the second attempt returns")

    async def _body(self, request: Request) -> tuple[dict[str, Any], bytes]:
        limit = self.settings.max_request_bytes
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise HTTPError(413, f"request body exceeds {limit} bytes")
        raw = bytes(buf)
        try:
            body = _JSON.decode(raw)
        except msgspec.DecodeError as e:
            raise HTTPError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body, raw

    async def _tokens(self, body: dict[str, Any], chat: bool) -> tuple[str, list[int]]:
        """The request's model and the token ids the engine will see (a batch of prompts is
        routed by its first)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HTTPError(400, "model must be a string")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise HTTPError(400, "messages must be a non-empty list of objects")
            kw = body.get("chat_template_kwargs")
            agp, cfm = body.get("add_generation_prompt"), body.get("continue_final_message")
            model, out = await self.texts.tokenize_plain(
                model, None, msgs, agp if isinstance(agp, bool) else None, cfm if isinstance(cfm, bool) else None,
                kw if isinstance(kw, dict) else None)
            return model, list(out.token_ids)
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            if model is None:
                model = self.texts.tokenizer(None)[0] if self.texts.tokenizers else None
            return (model or self._default_model()), p
        if not isinstance(p, str) or not p:
            raise HTTPError(400, "prompt must be a non-empty string or a list of token ids")
        model, out = await self.texts.tokenize_plain(model, p, None)
        return model, list(out.token_ids)

    def _default_model(self) -> str:
        models = self.index.models()
        return models[0] if len(models) == 1 else "default"

    def _route(self, model: str, tokens: list[int], salt: str | None, tried: set[str]) -> tuple[Any, _Target]:
        """The index's decision over the workers with an api_url and room (recorded), and
        where to send it; HTTPError 503 (none has an api_url) or 429 (none has room)."""
        targets = self.targets()
        if not targets:
            raise HTTPError(503, "no engine has an api_url: configure engines' api_url (or discovery's api_port)")
        cap = self.settings.gateway_max_per_worker
        active = self.ledger.active
        try:
            workers = self.index.model_workers(model)
        except (KeyError, ModelRequiredError):
            raise HTTPError(404, f"model {model!r} is not served by any engine the index knows") from None
        cands = [f"{e}/{r}" for e, r, _ in workers if e in targets]
        if not cands:
            raise HTTPError(503, f"no engine of model {model!r} has an api_url")
        room = [c for c in cands if c not in tried and active.get(c, 0) < cap]
        if not room:
            if tried:
                raise HTTPError(503, "no other engine to retry on")
            raise HTTPError(429, f"every engine of model {model!r} has {cap} requests in flight through this gateway")
        t0 = time.perf_counter()
        # No max_tokens: a request's load is its prefill, until its first token (measured: decode
        # blocks counted one for one with queued prefill blocks turn routing into "fewest
        # decoding requests" and lose the cache, while a decoding request costs a newcomer's
        # prefill little; docs/routing.md, Live). The stream still ends the request.
        out = self.index.route_response(tokens, model=model, cache_salt=salt,
                                        candidates=None if len(room) == len(workers) else room,
                                        prefill_load_scale=self.settings.prefill_load_scale, link=self.ingest.link)
        self.decisions.add(t0, len(tokens), out)
        return out, targets[out.engine]

    def _release(self, worker: str, rid: str, outcome: str) -> None:
        """The request is over on ``worker``: its in-flight load ends, the outcome is counted."""
        self.index.route_done(rid)
        n = self.ledger.active.get(worker, 1) - 1
        if n > 0:
            self.ledger.active[worker] = n
        else:
            self.ledger.active.pop(worker, None)
        self.ledger.outcome(worker, outcome)

    async def _whole(self, resp: httpx.Response, worker: str, rid: str, ntok: int, predicted: int, t0: float,
                     headers: dict[str, str]) -> Response:
        """A whole (not streamed) answer, passed through with its status."""
        try:
            content = await resp.aread()
        except httpx.TimeoutException:
            self._release(worker, rid, "timeout")
            return oai_error(504, f"engine {worker} did not finish its answer in time")
        except httpx.HTTPError as e:
            self._release(worker, rid, "upstream_failed")
            return oai_error(502, f"engine {worker}: {e!r}")
        finally:
            await resp.aclose()
        self.ledger.ttft.observe(time.perf_counter() - t0)
        ok = resp.status_code == 200
        if ok:
            self.ledger.usage(worker, rid, ntok, predicted, _cached(content))
        self._release(worker, rid, "ok" if ok else "engine_error")
        return Response(content, status_code=resp.status_code, headers=headers)

    async def _relay(self, resp: httpx.Response, worker: str, rid: str, ntok: int, predicted: int, t0: float,
                     st: _Stream) -> AsyncIterator[bytes]:
        """The engine's SSE events as they come (each whole event at once), noting the first
        chunk (prefill over) and the usage; the injected usage chunk is not passed on."""
        s = self.settings
        it = resp.aiter_raw()
        buf = b""
        outcome = "client_aborted"  # unless the stream ends
        try:
            while True:
                wait = s.gateway_first_token_timeout_s if st.first else s.gateway_idle_timeout_s
                try:
                    part = await asyncio.wait_for(it.__anext__(), wait)
                except StopAsyncIteration:
                    outcome = "ok"
                    break
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    outcome = "timeout"
                    break
                except httpx.HTTPError:
                    outcome = "upstream_failed"
                    break
                buf += part
                while True:
                    cut = buf.find(b"\n\n")
                    if cut < 0:
                        break
                    event, buf = buf[:cut], buf[cut + 2:]
                    if self._note(event, st, rid, t0):
                        yield event + b"\n\n"
            if buf:
                yield buf
        finally:
            await resp.aclose()  # a client that left: the engine sees the connection close and aborts
            if outcome == "ok":
                self.ledger.usage(worker, rid, ntok, predicted, st.cached)
            self._release(worker, rid, outcome)

    def _note(self, event: bytes, st: _Stream, rid: str, t0: float) -> bool:
        """Read one SSE event: the first one ends the prefill; a usage chunk gives the
        cached tokens. False for the usage chunk the client did not ask for."""
        if st.first and event.startswith(b"data: {"):
            st.first = False
            self.index.route_first_token(rid)
            self.ledger.ttft.observe(time.perf_counter() - t0)
        if b'"usage":{' in event or b'"usage": {' in event:
            try:
                obj = _JSON.decode(event[5:].strip())
            except msgspec.DecodeError:
                return True
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                st.cached = _cached_of(obj["usage"])
                if st.strip_usage and not obj.get("choices"):
                    return False
        return True


def _cached_of(usage: dict[str, Any]) -> int | None:
    d = usage.get("prompt_tokens_details")
    v = d.get("cached_tokens") if isinstance(d, dict) else None
    return v if isinstance(v, int) else None


def _cached(content: bytes) -> int | None:
    try:
        obj = _JSON.decode(content)
    except msgspec.DecodeError:
        return None
    u = obj.get("usage") if isinstance(obj, dict) else None
    return _cached_of(u) if isinstance(u, dict) else None
