"""Prompts and chat messages to token ids, exactly as vLLM 0.33.0 tokenizes them.

A :class:`Tokenizer` is one Hugging Face tokenizer directory, read from disk (never
downloaded): ``tokenizer.json`` (the ``tokenizers`` library's file), and
``tokenizer_config.json`` with its ``chat_template`` (or ``chat_template.jinja``,
``additional_chat_templates/*.jinja``), special tokens and added tokens
(``special_tokens_map.json`` when the config has no ``added_tokens_decoder``).

What vLLM does, and so this does:

- completions ``prompt``: ``tokenizer.encode(prompt, add_special_tokens=True)``: the
  post-processor of ``tokenizer.json`` adds BOS (or whatever it declares);
- chat ``messages``: the template rendered (:mod:`indexer.text.chat`), then the text encoded
  with ``add_special_tokens=False``: the template writes BOS itself, never twice.

Loading mirrors transformers 5's ``TokenizersBackend`` on a generic
(``PreTrainedTokenizerFast``) tokenizer: tokenizer.json as it is, padding and truncation
off, the config's added tokens and every named special token it lacks added as special
tokens. Needs the ``text`` extra (``tokenizers``, ``jinja2``), imported only here.

In the library::

    from indexer.text import Tokenizer, match_text
    tok = Tokenizer.from_dir("/models/llama-3-8b")
    idx.match(tok.encode_prompt("Hello"), model="llama-3-8b")
    match_text(idx, tok, messages=[{"role": "user", "content": "Hi"}], model="llama-3-8b")
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from indexer.text import chat
from indexer.text.chat import ChatError

__all__ = ["ChatError", "TextError", "TokenizerLoadError", "Tokenized", "Tokenizer", "load_tokenizers",
           "match_text", "route_text"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a template sees as variables.
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
INSTALL_HINT = "pip install 'kv-prefix-indexer[text]' (tokenizers and jinja2)"


class TextError(ValueError):
    """A text request that cannot become token ids (the message says why)."""


class TokenizerLoadError(ValueError):
    """A tokenizer directory that is missing or cannot be read; the message names the model."""


class Tokenized(NamedTuple):
    """Token ids and the text they are the encoding of (the rendered chat, or the prompt)."""

    token_ids: list[int]
    text: str


def _token_text(v: Any) -> str | None:
    """A special token's string: a plain string or a serialized AddedToken's content."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """One model's tokenizer and chat template(s), read from ``path`` once.

    Thread-safe for encoding and rendering (nothing is changed after loading)."""

    def __init__(self, path: str, name: str | None = None) -> None:
        self.path = path
        self.name = name or os.path.basename(os.path.normpath(path))
        try:
            import tokenizers
        except ImportError:
            raise TokenizerLoadError(f"tokenizer of model {self.name!r}: the tokenizers library is not installed: "
                                     f"{INSTALL_HINT}") from None
        what = f"tokenizer of model {self.name!r} at {path}"
        if not os.path.isdir(path):
            raise TokenizerLoadError(f"{what}: no such directory")
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerLoadError(f"{what}: no tokenizer.json (a Hugging Face fast-tokenizer directory is needed)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # a Rust-side parse error: say which file
            raise TokenizerLoadError(f"{what}: tokenizer.json cannot be read: {e}") from None
        # transformers turns these off unless a call asks for them; vLLM's calls do not.
        self._tok.no_padding()
        self._tok.no_truncation()
        try:
            config = self._config(path)
        except (OSError, ValueError) as e:
            raise TokenizerLoadError(f"{what}: {e}") from None
        self.special_tokens: dict[str, str] = {}
        self.chat_templates: str | dict[str, str] | None = None
        try:
            self._apply_config(path, config, tokenizers)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TokenizerLoadError(f"{what}: {e}") from None
        if isinstance(self.chat_templates, str):
            self._check_template(self.chat_templates, what)
        elif self.chat_templates is not None:
            for t in self.chat_templates.values():
                self._check_template(t, what)

    @classmethod
    def from_dir(cls, path: str, name: str | None = None) -> Tokenizer:
        return cls(path, name)

    @staticmethod
    def _config(path: str) -> dict[str, Any]:
        p = os.path.join(path, "tokenizer_config.json")
        if not os.path.isfile(p):
            return {}
        try:
            data = _read_json(p)
        except ValueError as e:
            raise ValueError(f"tokenizer_config.json is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("tokenizer_config.json is not a JSON object")
        return data

    def _apply_config(self, path: str, config: dict[str, Any], tokenizers: Any) -> None:
        """Special tokens, added tokens and chat templates, as transformers 5 loads them."""
        added = config.get("added_tokens_decoder")
        named: dict[str, Any] = {k: config.get(k) for k in NAMED_SPECIAL if config.get(k) is not None}
        if added is None:  # legacy: special_tokens_map.json
            smap = os.path.join(path, "special_tokens_map.json")
            if os.path.isfile(smap):
                for k, v in _read_json(smap).items():
                    if k in NAMED_SPECIAL and v is not None:
                        named[k] = v
        # Model-specific *_token keys (e.g. image_token) are named special tokens too.
        extra_named = {k: v for k, v in config.items()
                       if k.endswith("_token") and k not in NAMED_SPECIAL and isinstance(v, (str, dict))}
        est = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        extra_list: list[Any] = []
        if isinstance(est, dict):
            extra_named.update(est)
        elif isinstance(est, list):
            extra_list = est
        for k, v in {**named, **extra_named}.items():
            s = _token_text(v)
            if s is not None:
                self.special_tokens[k] = s
        # Added tokens: the config's, then every special token the backend does not have.
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        to_add = []
        for _, spec in sorted(((int(i), t) for i, t in (added or {}).items()), key=lambda x: x[0]):
            if isinstance(spec, dict) and spec.get("content") not in have:
                kw = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
                to_add.append(tokenizers.AddedToken(spec["content"], **kw))
                have.add(spec["content"])
        for v in [*named.values(), *extra_named.values(), *extra_list]:
            s = _token_text(v)
            if s is None or s in have:
                continue
            kw = {k: v[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if isinstance(v, dict) and k in v}
            to_add.append(tokenizers.AddedToken(s, special=True, **kw))
            have.add(s)
        for t in to_add:
            if t.special:
                self._tok.add_special_tokens([t])
            else:
                self._tok.add_tokens([t])
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # Chat templates: chat_template.jinja and additional_chat_templates/ win over the config.
        templates: dict[str, str] = {}
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                templates["default"] = f.read()
        extra_dir = os.path.join(path, "additional_chat_templates")
        if os.path.isdir(extra_dir):
            for fn in sorted(os.listdir(extra_dir)):
                if fn.endswith(".jinja"):
                    with open(os.path.join(extra_dir, fn), encoding="utf-8") as f:
                        templates[fn.removesuffix(".jinja")] = f.read()
        if len(templates) == 1 and "default" in templates:
            self.chat_templates = templates["default"]
        elif templates:
            self.chat_templates = templates
        else:
            ct = config.get("chat_template")
            if isinstance(ct, list):  # [{"name": ..., "template": ...}]
                self.chat_templates = {str(t["name"]): str(t["template"]) for t in ct}
            elif isinstance(ct, str):
                self.chat_templates = ct
            elif ct is not None:
                raise ValueError("chat_template must be a string or a list of {name, template}")

    @staticmethod
    def _check_template(source: str, what: str) -> None:
        try:
            chat.compile_template(source)
        except ImportError:
            raise TokenizerLoadError(f"{what}: chat templates need jinja2: {INSTALL_HINT}") from None
        except Exception as e:  # a template syntax error, at start rather than per request
            raise TokenizerLoadError(f"{what}: the chat template does not compile: {e}") from None

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids (transformers' path: ``encode_batch``, which releases the GIL)."""
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt, as vLLM encodes it: special tokens added (BOS...)."""
        return self.encode(prompt, True)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat template's text for ``messages`` (vLLM's chat endpoint)."""
        source = chat.pick_template(self.chat_templates, (chat_template_kwargs or {}).get("tools"))
        return chat.render(source, messages, self.special_tokens, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> Tokenized:
        """Rendered, then encoded without adding special tokens (the template wrote them)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
        return Tokenized(self.encode(text, False), text)

    def tokenize(self, prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None, *,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> Tokenized:
        """Exactly one of ``prompt`` and ``messages``, tokenized as vLLM does."""
        if (prompt is None) == (messages is None):
            raise TextError("give exactly one of prompt and messages")
        if prompt is not None:
            return Tokenized(self.encode_prompt(prompt), prompt)
        assert messages is not None
        return self.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=chat_template_kwargs)


def load_tokenizers(dirs: Mapping[str, str]) -> dict[str, Tokenizer]:
    """``{model: Tokenizer}`` from ``{model: directory}``; the first bad one raises
    :class:`TokenizerLoadError` naming its model."""
    return {model: Tokenizer(path, model) for model, path in dirs.items()}


def _text_ids(tokenizer: Tokenizer, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
              add_generation_prompt: bool, continue_final_message: bool,
              chat_template_kwargs: Mapping[str, Any] | None) -> list[int]:
    t = tokenizer.tokenize(prompt, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
    if not t.token_ids:
        raise TextError("the text tokenizes to no tokens")
    return t.token_ids


def match_text(index: Any, tokenizer: Tokenizer, *, prompt: str | None = None,
               messages: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
               **match_kwargs: Any) -> Any:
    """``index.match`` (a ``PrefixIndex`` or an ``Indexer``) of a prompt or messages."""
    ids = _text_ids(tokenizer, prompt, messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
    return index.match(ids, **match_kwargs)


def route_text(index: Any, tokenizer: Tokenizer, *, prompt: str | None = None,
               messages: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
               **route_kwargs: Any) -> Any:
    """``index.route`` of a prompt or messages (the ``POST /v1/route`` body)."""
    ids = _text_ids(tokenizer, prompt, messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
    return index.route(ids, **route_kwargs)
