"""Request and response types of the HTTP API (msgspec: one typed decode per request,
and the same types give the OpenAPI schema, so docs and validation cannot drift)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from indexer.query.answers import BestOut, MatchResponse, WorkerMatchOut  # noqa: F401  (response schema)
from indexer.query.route import LoadOut, RankedOut, RouteResponse  # noqa: F401  (response schema)

TokenId = Annotated[int, Meta(ge=0, le=2**32 - 1, description="a token id (uint32)")]
# msgspec bounds stop at int64, so the u64 top is checked by the handler (check_keys).
BlockKey = Annotated[int, Meta(ge=-(2**63), description="xxh3-64 block key (u64; a signed i64 is taken mod 2^64)")]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
# What the service connects to: tcp only (indexer.wire.engines.EndpointPolicy), the same rule
# as indexer.wire.engines.check_endpoint, so a schema-valid endpoint is one the service
# accepts (ports 1-65535) unless allowed_endpoints says otherwise.
_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
Endpoint = Annotated[str, Meta(
    pattern=r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):" + _PORT + r"$",
    max_length=256, description="tcp://HOST:PORT",
)]
# indexer.wire.engines.ENGINE_ID_RE (which also refuses a final newline, that "$" lets by).
EngineId = Annotated[str, Meta(
    pattern=r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}$", min_length=1, max_length=128,
    description="ASCII letters, digits, '.', '_', ':' and '-', not starting with '.', ':' or '-'",
)]
# Bounded, like every string a client sends (vLLM's cache_salt is a short tenant secret).
CacheSalt = Annotated[str, Meta(max_length=1024)]
DpRank = Annotated[int, Meta(ge=0, le=1023)]


# Subclasses inherit ``frozen``; they repeat it for type checkers (dataclass_transform).
class _Req(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


# --- Text prompts (R-TXT-3): a request carries exactly one of token_ids,
# prompt and messages; the text ones are tokenized with the model's tokenizer (api/text.py).
TEXT_FIELDS = ("prompt", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
TEXT_PART_TYPES = ("text",)


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    """One part of a message's content. Other fields are let through to the check below, so a
    non-text part (image_url, input_audio, ...) gets a 422 saying so, not "unknown field"."""

    type: Annotated[str, Meta(max_length=64)]
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An OpenAI chat message with text content: a string, null, or text parts."""

    role: Name
    content: str | list[ContentPart] | None = None
    name: Name | None = None

    def __post_init__(self) -> None:
        if isinstance(self.content, list):
            for i, p in enumerate(self.content):
                if p.type not in TEXT_PART_TYPES:
                    raise ValueError(f"content[{i}] is a {p.type!r} part: only text parts "
                                     "({\"type\": \"text\", \"text\": ...}) are supported, multimodal prompts are not")


class _TextReq(_Req, frozen=True):
    """The text members of a request that takes a prompt or chat messages (R-TXT)."""

    # A completions prompt (tokenized with special tokens, as vLLM's /v1/completions does).
    prompt: Annotated[str, Meta(min_length=1)] | None = None
    # Chat messages (rendered with the model's chat template, as vLLM's /v1/chat/completions).
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None  # messages only; default false
    chat_template_kwargs: dict[str, Any] | None = None  # messages only: extra template variables


def _chat_options_need_messages(q: _TextReq) -> None:
    if q.messages is None:
        extra = [n for n in TEXT_FIELDS[2:] if getattr(q, n) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply to messages")


def _one_prompt(q: Any) -> None:
    given = [n for n in ("token_ids", "prompt", "messages") if getattr(q, n) is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of token_ids, prompt (text) and messages (chat)"
                         + (f", not {' and '.join(given)}" if given else ""))
    _chat_options_need_messages(q)


class MatchRequest(_TextReq, frozen=True):
    """Longest-prefix match of a prompt (contract R-Q-1): token ids, or text (R-TXT)."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    model: Name | None = None
    lora_name: Name | None = None
    cache_salt: CacheSalt | None = None

    def __post_init__(self) -> None:
        _one_prompt(self)


class MatchByKeysRequest(_Req, frozen=True):
    """The same with precomputed block keys (R-KEY-2)."""

    block_keys: Annotated[list[BlockKey], Meta(min_length=1)]
    model: Name | None = None


class WorkerLoad(_Req, frozen=True):
    active_prefill_tokens: Count = 0
    active_decode_blocks: Count = 0


class RouteRequest(_TextReq, frozen=True):
    """Best replica for a request: the match, plus optional load and candidates."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    model: Name | None = None
    lora_name: Name | None = None
    cache_salt: CacheSalt | None = None
    load: dict[Name, WorkerLoad] = {}
    # "ENGINE" or "ENGINE/RANK" (RANK in ASCII digits); a malformed one is a 422 naming it.
    candidates: Annotated[list[Name], Meta(min_length=1)] | None = None
    # False: a dry run; nothing is recorded (no prediction, no in-flight load, no request_id).
    record: bool = True
    # Tokens the request may generate: its decode blocks count as load until
    # POST /v1/route/{request_id}/done (or decode_ttl_s).
    max_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None

    def __post_init__(self) -> None:
        _one_prompt(self)


class TokenizeRequest(_TextReq, frozen=True):
    """Tokenize a prompt or chat messages as the model's vLLM would (for debugging)."""

    model: Name | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) and messages (chat)")
        _chat_options_need_messages(self)


class EngineRequest(_Req, frozen=True):
    """Register an engine (contract §1). Rank r publishes on the endpoints' ports + r."""

    id: EngineId
    endpoint: Endpoint
    model: Name = "default"
    replay_endpoint: Endpoint | None = None
    topic: Annotated[str, Meta(max_length=256)] = ""
    dp_size: Annotated[int, Meta(ge=1, le=1024)] = 1
    # vLLM's Prometheus /metrics (http:// or https://): scraped to correct the in-flight load.
    metrics_url: Annotated[str, Meta(max_length=2048, pattern=r"^https?://[^\s@/]+(/\S*)?$")] | None = None
    # Its OpenAI-compatible server (http://HOST:PORT): the gateway forwards requests there.
    api_url: Annotated[str, Meta(max_length=2048, pattern=r"^https?://[^\s@/]+/?$")] | None = None


# --- Dynamo standalone indexer (``python -m dynamo.indexer``) request shapes.


class _DynReq(msgspec.Struct, frozen=True, kw_only=True):
    # Dynamo ignores fields it does not know (e.g. the old tenant_id): so do we.
    pass


class DynRegister(_DynReq, frozen=True):
    instance_id: Annotated[int, Meta(ge=0)]
    # Not pattern-checked here: Dynamo answers a bad endpoint with 400 and a message.
    endpoint: Name
    model_name: Name
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    routing_group: Name | None = None
    dp_rank: DpRank | None = None
    replay_endpoint: Name | None = None


class DynUnregister(_DynReq, frozen=True):
    instance_id: Annotated[int, Meta(ge=0)]
    model_name: Name
    routing_group: Name | None = None
    dp_rank: DpRank | None = None


class DynQuery(_DynReq, frozen=True):
    token_ids: list[TokenId]
    model_name: Name
    routing_group: Name | None = None
    lora_name: Name | None = None
    cache_salt: CacheSalt | None = None


class DynQueryByHash(_DynReq, frozen=True):
    block_hashes: list[BlockKey]
    model_name: Name
    routing_group: Name | None = None
    cache_salt: CacheSalt | None = None  # refused with 400, as Dynamo does: hashes carry the salt


# --- Response shapes (documentation; the handlers build them from the index).
# The match and route bodies' structs are the ones the index writes its answers with
# (indexer.query.answers: MatchResult.body; indexer.query.route: Query.route_response),
# imported, not repeated: the schema is msgspec's, not pydantic's
# (api/app.py merges msgspec.json.schema_components into FastAPI's document), so the
# encoding classes serve as they are.


class DoneOut(msgspec.Struct):
    request_id: str
    released: bool


class ClearedOut(msgspec.Struct):
    """An engine's cache cleared in the index (POST /v1/engines/{engine_id}/clear)."""

    cleared: str
    workers: int


class EngineOut(msgspec.Struct):
    """A registered engine's configuration (ranks ``dp_rank_start`` .. + ``dp_size`` - 1)."""

    id: str
    endpoint: str
    model: str
    replay_endpoint: str | None
    topic: str
    dp_size: int
    dp_rank_start: int
    metrics_url: str | None
    api_url: str | None


class TokenizeResponse(msgspec.Struct):
    model: str
    token_ids: list[int]
    count: int
    # The text that was encoded: the rendered chat template, or the prompt.
    text: str
    # Whether the tokenizer added its special tokens (prompt: yes; messages: no, the template writes them).
    add_special_tokens: bool


class ErrorResponse(msgspec.Struct):
    detail: str


class DynErrorResponse(msgspec.Struct):
    error: str


class DynInstance(msgspec.Struct):
    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class DynQueryResponse(msgspec.Struct):
    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, DynInstance]


def tokens_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct] | None:
    """``cls`` without its ``token_ids`` (None when it has none), for the rest of a body
    whose token array was read in C (:func:`api.surface.split_json_tokens`). Every other
    field is validated exactly as by ``cls``; ``token_ids`` stays as an attribute,
    defaulting to None, that the handler fills with the tokens' bytes (not frozen)."""
    fields = msgspec.structs.fields(cls)
    if not any(f.name == "token_ids" for f in fields):
        return None
    spec: list = [("token_ids", Any, None)]
    for f in fields:
        if f.name == "token_ids":
            continue
        if f.name in TEXT_FIELDS:
            # Null only: a body with token_ids and a text field fails the twin and goes the
            # typed way, whose _one_prompt refuses it with the full message.
            spec.append((f.name, None, None))
            continue
        if f.default is not msgspec.NODEFAULT:
            spec.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            spec.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            spec.append((f.name, f.type))
    forbid = cls.__struct_config__.forbid_unknown_fields
    return msgspec.defstruct(cls.__name__ + "Rest", spec, kw_only=True, forbid_unknown_fields=forbid)


REQUEST_TYPES: dict[str, Any] = {
    "MatchRequest": MatchRequest,
    "MatchByKeysRequest": MatchByKeysRequest,
    "RouteRequest": RouteRequest,
    "TokenizeRequest": TokenizeRequest,
    "EngineRequest": EngineRequest,
    "DynRegister": DynRegister,
    "DynUnregister": DynUnregister,
    "DynQuery": DynQuery,
    "DynQueryByHash": DynQueryByHash,
}
RESPONSE_TYPES: dict[str, Any] = {
    "MatchResponse": MatchResponse,
    "RouteResponse": RouteResponse,
    "DoneOut": DoneOut,
    "ClearedOut": ClearedOut,
    "TokenizeResponse": TokenizeResponse,
    "ErrorResponse": ErrorResponse,
    "EngineOut": EngineOut,
    "DynQueryResponse": DynQueryResponse,
    "DynErrorResponse": DynErrorResponse,
}
