"""Text prompts in the HTTP API: ``prompt`` and ``messages`` in ``/v1/match`` and
``/v1/route``, and ``POST /v1/tokenize``.

Each configured model's tokenizer (setting ``tokenizers: {MODEL: DIR}``) is loaded once,
when the app is built. A text request is tokenized on a thread pool of its own, never on
the event loop: a 32k-token chat template renders for milliseconds, and the loop must keep
answering token-id queries meanwhile (the ``tokenizers`` library releases the GIL while it
encodes; the template runs in Python). The token-id path is untouched: one ``is None``
test in the handler.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from api.common import HTTPError
from indexer.text.tokenizer import ChatError, TextError, Tokenized, Tokenizer, load_tokenizers

CONFIGURE = ("configure one: the setting tokenizers: {MODEL: DIR} (DIR a Hugging Face tokenizer directory with "
             "tokenizer.json and tokenizer_config.json), KVI_TOKENIZERS='{\"MODEL\": \"DIR\"}' or "
             "--tokenizer MODEL=DIR; or send token_ids")


class Texts:
    """The models' tokenizers and the pool that runs them."""

    def __init__(self, dirs: dict[str, str], max_tokens: int, index: Any) -> None:
        # TokenizerLoadError names the model; the CLI turns it into exit 2.
        self.tokenizers: dict[str, Tokenizer] = load_tokenizers(dirs)
        self.max_tokens = max_tokens
        self.index = index
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvi-tokenize")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def tokenizer(self, model: str | None) -> tuple[str, Tokenizer]:
        """The request's model (as the index resolves a missing one) and its tokenizer; 404
        saying how to configure one when it has none."""
        if model is None:  # as the index picks: its one model, else "default"
            models = self.index.models()
            if len(models) == 1:
                model = models[0]
            elif "default" in models or (not models and len(self.tokenizers) != 1):
                model = "default"
            elif not models:
                model = next(iter(self.tokenizers))
            else:
                raise HTTPError(422, f"model is required: several models are indexed ({', '.join(models)})")
        tok = self.tokenizers.get(model)
        if tok is None:
            have = f" (tokenizers are configured for: {', '.join(sorted(self.tokenizers))})" if self.tokenizers else ""
            raise HTTPError(404, f"model {model!r} has no tokenizer, so prompt and messages cannot be tokenized"
                                 f"{have}; {CONFIGURE}")
        return model, tok

    async def tokenize(self, q: Any) -> tuple[str, Tokenized, bool]:
        """``(model, tokenized, special tokens added)`` of a request's prompt or messages, off the loop."""
        messages = None
        if q.messages is not None:
            messages = [msgspec.structs.asdict(m) for m in q.messages]
            for m in messages:
                if isinstance(m["content"], list):
                    m["content"] = [msgspec.structs.asdict(p) for p in m["content"]]
        model, out = await self.tokenize_plain(q.model, q.prompt, messages, q.add_generation_prompt,
                                               q.continue_final_message, q.chat_template_kwargs)
        return model, out, q.prompt is not None

    async def tokenize_plain(self, model: str | None, prompt: str | None, messages: list[dict[str, Any]] | None,
                             add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
                             chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, Tokenized]:
        """``(model, tokenized)`` of a prompt or of chat messages (plain dicts, as an OpenAI
        request carries them), off the loop; HTTPError 404 (no tokenizer), 422, 413."""
        model, tok = self.tokenizer(model)
        agp = True if add_generation_prompt is None else add_generation_prompt
        cfm = bool(continue_final_message)

        def run() -> Tokenized:
            return tok.tokenize(prompt, messages, add_generation_prompt=agp, continue_final_message=cfm,
                                chat_template_kwargs=chat_template_kwargs)

        try:
            out = await asyncio.get_running_loop().run_in_executor(self._executor(), run)
        except (ChatError, TextError) as e:
            raise HTTPError(422, f"{'messages' if messages is not None else 'prompt'}: {e}") from None
        n = len(out.token_ids)
        if n > self.max_tokens:
            raise HTTPError(413, f"{n} tokens exceed the limit of {self.max_tokens} per request")
        return model, out

    async def resolve(self, q: Any) -> Any:
        """``q`` with the token ids of its prompt or messages in ``token_ids`` (and ``model`` set)."""
        model, out, _ = await self.tokenize(q)
        if not out.token_ids:
            raise HTTPError(422, "the text tokenizes to no tokens")
        return msgspec.structs.replace(q, token_ids=out.token_ids, model=model, prompt=None, messages=None,
                                       add_generation_prompt=None, continue_final_message=None,
                                       chat_template_kwargs=None)

