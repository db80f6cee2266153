"""Chat templates rendered as vLLM 0.33.0 renders them (through transformers 5.x).

vLLM's chat endpoint (``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils``) turns the
OpenAI ``messages`` into a *conversation* (content as one string, or as a list of text
parts when the template iterates over content parts), filters ``chat_template_kwargs``
to what the template or ``apply_chat_template`` accepts, and calls transformers'
``apply_chat_template``, which renders the Jinja template in a sandbox with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, its own
``tojson`` and the tokenizer's special tokens as variables
(``transformers/utils/chat_template_utils.py``: ``_compile_jinja_template``,
``render_jinja_template``). This module does the same without importing either; only
``jinja2`` (the ``text`` extra), imported when a template is first compiled.

Text only: content parts other than text are refused before this module sees them;
``tool_calls``, ``reasoning`` and multimodal placeholders are not carried.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

# apply_chat_template's own parameters (transformers 5.20): vLLM lets a request's
# chat_template_kwargs through when they name one of these, or a variable the template
# reads. Those that change tokenization itself (truncation, padding, tensors, the
# return type) we refuse instead: the answer would not be one token list.
_HF_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
REFUSED_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# vLLM drops this attribution line from system prompts (its value changes every request).
_BILLING_HEADER = "x-anthropic-billing-header"


class ChatError(ValueError):
    """A conversation the template cannot render: the template raised (``raise_exception``),
    a refused or clashing ``chat_template_kwargs`` key, no template. The message says why."""


# ----------------------------------------------------------------- the environment


@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    """The Jinja template of ``source``, compiled as transformers compiles chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # transformers' AssistantTracker: {% generation %}...{% endgeneration %} renders its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' own filter: no HTML escaping, unlike Jinja's.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads without defining them (vLLM's
    ``_resolve_chat_template_kwargs``)."""
    import jinja2.meta

    tpl = compile_template(source)
    return frozenset(jinja2.meta.find_undeclared_variables(tpl.environment.parse(source)))


# ------------------------------------------------- content format (vLLM's detection)
# Ported from vLLM 0.33.0 vllm/renderers/hf.py (_is_var_access ... _detect_content_format,
# Apache-2.0): a template that loops over a message's content gets content as a list of
# {"type": "text", "text": ...} parts ("openai"); any other gets one string ("string").


def _is_var_access(node: Any, varname: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return bool(node.ctx == "load" and node.name == varname)
    if isinstance(node, nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return bool(node.attr == attr and _is_var_access(node.node, base))
    return False


def _is_attr_access(node: Any, varname: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_var_access(node.node, varname) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return bool(_is_var_access(node.node, varname) and node.attr == key)
    return False


def _is_var_or_elems_access(node: Any, varname: str, key: str | None = None) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _dotted(node: Any) -> str | None:
    from jinja2 import nodes

    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases_of(root: Any, varname: str) -> Iterator[str]:
    from jinja2 import nodes

    yield varname
    seen = {varname}
    todo = deque([varname])
    while todo:
        related = todo.popleft()
        for assign in root.find_all(nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, nodes.Name) and _is_var_or_elems_access(rhs, related):
                yield lhs.name
                if lhs.name != related and lhs.name not in seen:
                    seen.add(lhs.name)
                    todo.append(lhs.name)
            aliases: list[str] = []
            if (isinstance(lhs, nodes.Name) and isinstance(rhs, nodes.Call) and isinstance(rhs.node, nodes.Name)
                    and rhs.node.name == "namespace"):
                aliases = [f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _is_var_or_elems_access(kw.value, related)]
            elif isinstance(lhs, (nodes.Getattr, nodes.NSRef)) and _is_var_or_elems_access(rhs, related):
                d = _dotted(lhs)
                aliases = [d] if d is not None else []
            for alias in aliases:
                yield alias
                if alias != related and alias not in seen:
                    seen.add(alias)
                    todo.append(alias)


def _message_vars(root: Any) -> list[str]:
    from jinja2 import nodes

    names = list(_aliases_of(root, "messages"))
    out = []
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems_access(loop.iter, n) for n in names) and isinstance(loop.target, nodes.Name):
            out.append(loop.target.name)
    return out


def _loops_over_content(root: Any) -> bool:
    from jinja2 import nodes

    message_vars = _message_vars(root)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_var_or_elems_access(arg, v, "content") for v in message_vars):
                        params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if (isinstance(kw, nodes.Keyword) and kw.key in names
                            and any(_is_var_or_elems_access(kw.value, v, "content") for v in message_vars)):
                        params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if any(_is_var_or_elems_access(it, v, "content") for v in message_vars):
            return True
        bound = params_by_loop.get(id(loop))
        if isinstance(it, nodes.Name) and bound is not None and it.name in bound:
            return True
        if id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content":
            return True
    return False


@lru_cache(maxsize=32)
def content_format(source: str) -> str:
    """``"openai"`` when the template iterates over a message's content parts, else
    ``"string"`` (also when it cannot be parsed: vLLM's default)."""
    try:
        root = compile_template(source).environment.parse(source)
        return "openai" if _loops_over_content(root) else "string"
    except Exception:
        return "string"


# ------------------------------------------------------------------ conversation


def conversation(messages: Sequence[Mapping[str, Any]], fmt: str, source: str) -> list[dict[str, Any]]:
    """vLLM's conversation of text ``messages`` (each ``role``, ``content``: a string,
    None or a list of text parts ``{"type": "text", "text": ...}``, optional ``name``).

    Content becomes one string (parts joined with a newline) or, for an ``"openai"``
    template, a list of text parts; a tool message's parts are always joined; a
    ``developer`` message becomes ``system`` when the template never names the role
    (system messages are then merged into one, first)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        content = m.get("content")
        texts: list[str]
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = [p["text"] for p in content if p.get("text") is not None]
        if role == "system":
            texts = _strip_billing_header(texts)
        msg: dict[str, Any] = {"role": role}
        if fmt == "openai" and role != "tool":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        out.append(msg)
    if any(m["role"] == "developer" for m in out) and '"developer"' not in source and "'developer'" not in source:
        out = _merge_system([{**m, "role": "system"} if m["role"] == "developer" else m for m in out])
    return out


def _strip_billing_header(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        if t.startswith(_BILLING_HEADER):
            t = t.partition("\n")[2]
            if not t:
                continue
        out.append(t)
    return out


def _merge_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # vLLM's _consolidate_system_messages: only when a system message is not alone at 0.
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    needed = False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            if i > 0 or system:
                needed = True
            c = m.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] for p in c if isinstance(p, dict) and "text" in p)
            if c:
                system.append(c)
        else:
            rest.append(m)
    if not needed:
        return conv
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


# ----------------------------------------------------------------------- render


def pick_template(templates: str | Mapping[str, str] | None, tools: Any) -> str:
    """transformers' ``get_chat_template``: one template, or a named set (``tool_use``
    when tools are given and it exists, else ``default``)."""
    if templates is None:
        raise ChatError("this tokenizer has no chat template (tokenizer_config.json chat_template, or "
                        "chat_template.jinja): only prompt and token_ids requests work")
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatError(f"the tokenizer has several chat templates and none is named default: {sorted(templates)}")


def render(source: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str], *,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The text vLLM's chat endpoint renders ``messages`` to (before tokenizing it
    without adding special tokens). Raises :class:`ChatError` with the template's reason."""
    import jinja2

    kwargs = dict(chat_template_kwargs or {})
    refused = sorted(REFUSED_KWARGS & kwargs.keys())
    if refused:
        raise ChatError(f"chat_template_kwargs may not set {', '.join(refused)}")
    # The request's own fields win over chat_template_kwargs (vLLM's merge_kwargs).
    kwargs["add_generation_prompt"] = add_generation_prompt
    kwargs["continue_final_message"] = continue_final_message
    accepted = template_variables(source) | _HF_PARAMS
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt"))
    continue_final_message = bool(kwargs.pop("continue_final_message"))
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatError("chat_template_kwargs.tools must be a list of JSON schemas (objects)")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise ChatError("chat_template_kwargs.documents must be a list of objects")
    if continue_final_message and add_generation_prompt:
        raise ChatError("continue_final_message and add_generation_prompt cannot both be true")
    conv = conversation(messages, content_format(source), source)
    final = None
    if continue_final_message:
        final = _mark_final(conv, source)
    variables = {**special_tokens, **kwargs}
    try:
        text = compile_template(source).render(messages=conv, tools=tools, documents=documents,
                                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:  # raise_exception, undefined, sandbox
        raise ChatError(f"the chat template refused the messages: {e}") from None
    except Exception as e:  # vLLM answers any template failure as a client error (400) too
        raise ChatError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
    if final is not None:
        text = _cut_at_tag(text, final)
    return str(text)


def _mark_final(conv: list[dict[str, Any]], source: str) -> str:
    """Append transformers' continue tag to the last message's text; its text before."""
    if not conv:
        raise ChatError("continue_final_message needs a final message")
    last = conv[-1]
    content = last.get("content")
    if "content" not in source:
        raise ChatError('continue_final_message: the chat template never reads "content"')
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                final = str(part["text"])
                part["text"] = final + _CONTINUE_TAG
                return final
        raise ChatError("continue_final_message: the final message has no text to continue")
    final = str(content)
    last["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatError("continue_final_message: the chat template drops part of the final message")
    at = text.rindex(tag)
    if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
