"""The query routes: ``/v1/match``, ``/v1/match_by_keys``, ``/v1/route`` (and its
``/done``), ``/v1/explain`` and ``/v1/tokenize``; :class:`Queries` answers them.

Queries run on the event loop thread: a match takes the index lock for ~5-10 us, and
the ingest thread yields between batches when a query waits (see ``PrefixIndex``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from fastapi import Path, Request
from fastapi.responses import Response

from api import openapi, schemas
from api.common import ENC, JSON, HTTPError, u64_keys
from api.jsonroutes import JsonRoute, JsonRouter, answer, service_of
from api.metrics import Metrics
from api.settings import Settings
from api.surface import split_json_tokens
from api.text import Texts
from api.ui import Decisions
from indexer import PrefixIndex
from indexer.ingest.base import Ingest
from indexer.query.explain import explain
from indexer.query.index import ModelRequiredError
from indexer.query.route import Load


class Queries:
    """The query handlers of one service: the index read, timed and counted."""

    def __init__(self, settings: Settings, index: PrefixIndex, ingest: Ingest, metrics: Metrics, text: Texts,
                 decisions: Decisions) -> None:
        self.settings = settings
        self.index = index
        self.ingest = ingest
        self.metrics = metrics
        self.text = text
        self.decisions = decisions

    def check_tokens(self, items: Any) -> None:
        """413 when a request carries more token ids (a list, or their uint32 bytes) or
        block keys than ``max_request_tokens`` (R-BAD-2)."""
        n = len(items) >> 2 if items.__class__ is bytes else len(items)
        if n > self.settings.max_request_tokens:
            raise HTTPError(413, f"{n} tokens exceed the limit of {self.settings.max_request_tokens} per request")

    def observe(self, path: str, t0: float, res: Any) -> None:
        """Count one answered query in the histograms (time since ``t0``, best prefix)."""
        self.metrics.observe(path, time.perf_counter() - t0, res.workers[0].total_blocks if res.workers else 0)

    def answer(self, path: str, t0: float, res: Any) -> tuple[int, bytes]:
        """The ``/v1/match`` body of ``res``, counted."""
        out = ENC.encode(res.body())
        self.observe(path, t0, res)
        return 200, out

    async def match(self, q: schemas.MatchRequest) -> tuple[int, bytes]:
        if q.token_ids is None:  # a prompt or messages (R-TXT): tokenized off the loop
            q = await self.text.resolve(q)
        self.check_tokens(q.token_ids)
        t0 = time.perf_counter()
        res = self.index.match(q.token_ids, model=q.model, lora_name=q.lora_name,  # type: ignore[arg-type]  # set above
                               cache_salt=q.cache_salt)
        return self.answer("/v1/match", t0, res)

    def plain_request(self, route: JsonRoute, body: bytes) -> tuple[Any, bytes] | None:
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

    def match_plain(self, route: JsonRoute, body: bytes) -> bytes | None:
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

    async def match_by_keys(self, q: schemas.MatchByKeysRequest) -> tuple[int, bytes]:
        self.check_tokens(q.block_keys)
        t0 = time.perf_counter()
        res = self.index.match_by_keys(u64_keys(q.block_keys), model=q.model)
        return self.answer("/v1/match_by_keys", t0, res)

    async def route(self, q: schemas.RouteRequest) -> tuple[int, Any]:
        if q.token_ids is None:  # a prompt or messages (R-TXT): tokenized off the loop
            q = await self.text.resolve(q)
        self.check_tokens(q.token_ids)
        t0 = time.perf_counter()
        try:
            out = self.index.route_body(
                q.token_ids, model=q.model, lora_name=q.lora_name,  # type: ignore[arg-type]  # set above
                cache_salt=q.cache_salt,
                load={k: Load(v.active_prefill_tokens, v.active_decode_blocks) for k, v in q.load.items()},
                candidates=q.candidates, prefill_load_scale=self.settings.prefill_load_scale, link=self.ingest.link,
                record=q.record, max_tokens=q.max_tokens)
        except ValueError as e:  # a malformed candidate or load key, named
            raise HTTPError(422, str(e)) from None
        except KeyError:
            raise  # an unknown model: serve_body's 404 / 422
        except LookupError as e:  # no candidate at all
            raise HTTPError(404, str(e)) from None
        self.metrics.observe("/v1/route", time.perf_counter() - t0, out.ranked[0].cached_blocks)
        toks: Any = q.token_ids  # list, or their uint32 bytes (the fast decode)
        self.decisions.add(t0, len(toks) >> 2 if toks.__class__ is bytes else len(toks), out)
        return 200, out.body  # written by the index (route_body): msgspec's bytes for the same answer

    async def route_done(self, request_id: str) -> tuple[int, Any]:
        got = self.index.route_done(request_id)
        if got is None:
            raise HTTPError(404, f"unknown request_id {request_id!r} (never issued, or ended long ago)")
        # False: it had ended already (announced with nothing to decode, done, expired).
        return 200, {"request_id": request_id, "released": got}

    async def explain(self, q: schemas.MatchRequest) -> tuple[int, Any]:
        if q.token_ids is None:  # a text prompt: the model's tokenizer
            q = await self.text.resolve(q)
        tokens: Any = q.token_ids  # a list, or their uint32 bytes (the fast decode)
        self.check_tokens(tokens)
        return 200, explain(self.index, tokens, model=q.model, lora_name=q.lora_name, cache_salt=q.cache_salt)

    async def tokenize(self, q: schemas.TokenizeRequest) -> tuple[int, Any]:
        model, out, special = await self.text.tokenize(q)
        return 200, schemas.TokenizeResponse(model=model, token_ids=out.token_ids, count=len(out.token_ids),
                                             text=out.text, add_special_tokens=special)


router = JsonRouter()
router.json("/v1/match", schemas.MatchRequest, lambda s: s.queries.match, hot=True, ok="MatchResponse",
            plain=lambda s: s.queries.match_plain, summary="Longest cached prefix per worker for a prompt")
router.json("/v1/match_by_keys", schemas.MatchByKeysRequest, lambda s: s.queries.match_by_keys, hot=True,
            ok="MatchResponse", summary="The same, with precomputed block keys")
router.json("/v1/route", schemas.RouteRequest, lambda s: s.queries.route, hot=True, ok="RouteResponse",
            summary="Best replica for a request (cache and load)")


router.json("/v1/explain", schemas.MatchRequest, lambda s: s.queries.explain, ok=None,
            summary="One prompt block by block: per worker, the tiers holding each block, the tier it would be "
            "loaded from, where the match ends and why (missing block, CPU chunk boundary, stale)")
router.json("/v1/tokenize", schemas.TokenizeRequest, lambda s: s.queries.tokenize, ok="TokenizeResponse",
            summary="Token ids of a prompt or chat messages, as the model's vLLM tokenizes them (debugging)")


@router.post("/v1/route/{request_id}/done", tags=["indexer"],
             summary="A routed request finished: release its in-flight load (404 when unknown or expired)",
             responses={200: {"content": {JSON: {"schema": openapi.ref("DoneOut")}}},
                        **openapi.responses(None, errors=(404,))})
async def route_done(request: Request, request_id: Annotated[str, Path(max_length=64)]) -> Response:
    return await answer(service_of(request).queries.route_done(request_id))
