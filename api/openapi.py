"""The hand-written part of the OpenAPI document, all of it.

FastAPI generates the document from the routes (paths, operations, parameters, tags,
summaries). What it cannot generate is here: the request and response bodies are
msgspec structs (one typed decode in C; FastAPI's models are pydantic), so

* a JSON route's request body and responses are ``$ref``\\ s (:func:`request_body`,
  :func:`responses`) to components that msgspec's own schema generator writes
  (:func:`components`), merged into FastAPI's document once (:func:`install`);
* rules msgspec's schema cannot state are added to those components: the configured
  size bound (R-BAD-2), the u64 top of block keys, exactly one of ``token_ids``,
  ``prompt`` and ``messages`` (R-TXT-3);
* the bearer scheme and each guarded operation's 401 and 403 follow the configured
  token (:func:`_document_auth`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI

from api import dynamo, schemas
from api.auth import Auth
from api.common import JSON
from api.settings import Settings


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def request_body(rtype: type[msgspec.Struct] | None) -> dict | None:
    """A JSON route's required body: its msgspec struct's component."""
    if rtype is None:
        return None
    return {"requestBody": {"required": True, "content": {JSON: {"schema": ref(rtype.__name__)}}}}


def responses(ok: str | None, ok_status: int = 200, errors: tuple[int, ...] = (400, 404, 413, 422),
              error_schema: str = "ErrorResponse", also_ok: int | None = None) -> dict:
    """A route's responses: ``ok`` (a component name, or no body) at ``ok_status`` (and
    ``also_ok``), ``error_schema`` at each of ``errors``."""
    out: dict = {}
    for status in (ok_status, also_ok):
        if status is not None:
            out[status] = {"description": "OK"}
            if ok is not None:
                out[status]["content"] = {JSON: {"schema": ref(ok)}}
    for s in errors:
        out[s] = {"description": "Error", "content": {JSON: {"schema": ref(error_schema)}}}
    return out


def components(settings: Settings) -> dict[str, Any]:
    """msgspec's schemas of every request and response struct, with the rules it cannot state."""
    types = list(schemas.REQUEST_TYPES.values()) + list(schemas.RESPONSE_TYPES.values())
    _, out = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    # The configured size bound (R-BAD-2) is part of the schema: larger lists get 413.
    for name, field in (("MatchRequest", "token_ids"), ("RouteRequest", "token_ids"), ("DynQuery", "token_ids"),
                        ("MatchByKeysRequest", "block_keys"), ("DynQueryByHash", "block_hashes")):
        out[name]["properties"][field]["maxItems"] = settings.max_request_tokens
        if field != "token_ids":  # msgspec bounds stop at int64; u64_keys checks the top
            out[name]["properties"][field]["items"]["maximum"] = 2**64 - 1
    _text_rules(out)
    return out


def _text_rules(components: dict[str, Any]) -> None:
    """Exactly one of token_ids, prompt and messages (the chat fields only with messages),
    text parts only, refused template kwargs (R-TXT-3)."""
    from indexer.text.chat import REFUSED_KWARGS

    # A field sent as null counts as not sent (msgspec's None), so "absent" is {"type": "null"}.
    null = {"type": "null"}
    chat_only = {n: null for n in schemas.TEXT_FIELDS[2:]}
    tokens, prompt, messages = {"type": "array"}, {"type": "string"}, {"type": "array"}
    # continue_final_message needs add_generation_prompt false (it defaults to true), as in vLLM.
    continuing_and_prompting = {"required": ["continue_final_message"], "properties": {
        "continue_final_message": {"const": True}, "add_generation_prompt": {"not": {"const": False}}}}
    for name in ("MatchRequest", "RouteRequest"):
        # token_ids may be null: the size bound belongs on the array.
        prop = components[name]["properties"]["token_ids"]
        if "maxItems" in prop and "anyOf" in prop:
            bound = prop.pop("maxItems")
            for alt in prop["anyOf"]:
                if alt.get("type") == "array":
                    alt["maxItems"] = bound
        components[name]["oneOf"] = [
            {"required": ["token_ids"], "properties": {"token_ids": tokens, "prompt": null, "messages": null,
                                                       **chat_only}},
            {"required": ["prompt"], "properties": {"prompt": prompt, "token_ids": null, "messages": null,
                                                    **chat_only}},
            {"required": ["messages"], "properties": {"messages": messages, "token_ids": null, "prompt": null},
             "not": continuing_and_prompting},
        ]
    components["TokenizeRequest"]["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": prompt, "messages": null, **chat_only}},
        {"required": ["messages"], "properties": {"messages": messages, "prompt": null},
         "not": continuing_and_prompting},
    ]
    components["ContentPart"]["properties"]["type"] = {"const": "text"}
    components["ContentPart"]["properties"]["text"] = {"type": "string"}
    for name in ("MatchRequest", "RouteRequest", "TokenizeRequest"):
        props = components[name]["properties"]
        kw = props["chat_template_kwargs"]
        for alt in kw.get("anyOf", [kw]):
            if alt.get("type") == "object":
                alt["propertyNames"] = {"not": {"enum": sorted(REFUSED_KWARGS)}}


def _document_auth(spec: dict, auth: Auth) -> None:
    """Declare the bearer token, and its 401 and 403, on every operation that needs it."""
    guarded = False
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            concrete = path.replace("{engine_id}", "x")
            if not auth.needs_token(method.upper(), concrete):
                continue
            guarded = True
            op["security"] = [{"bearer": []}]
            schema = ref("DynErrorResponse" if path in dynamo.PATHS else "ErrorResponse")
            for status, what in (("401", "No bearer token"), ("403", "Wrong bearer token")):
                op.setdefault("responses", {})[status] = {"description": what, "content": {JSON: {"schema": schema}}}
    if guarded:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}


def install(app: FastAPI, settings: Settings, auth: Auth) -> None:
    """Serve FastAPI's document of ``app`` with the parts above merged in (built once)."""
    comps = components(settings)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(comps)
            _document_auth(spec, auth)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
