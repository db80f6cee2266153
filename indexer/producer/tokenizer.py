"""A small tokenizer for the demo fleet's model (``serve --demo``), built at start.

A byte-level BPE trained with ``tokenizers`` on a few kilobytes of text written here,
saved as a Hugging Face directory with a ChatML chat template, so text requests work
against the demo (``curl -d '{"prompt": "..."}' .../v1/route``). Nothing is downloaded.
Needs the ``text`` extra; :func:`build` returns None without it.
"""

from __future__ import annotations

import json
import os

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV-aware router sends each request to the replica that already holds the longest prefix of its prompt.",
    "vLLM engines publish the blocks they store and remove; the indexer rebuilds each engine's prefix tree.",
    "You are a helpful assistant. Summarize the following document in three sentences.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Grüße, ça va? 日本語のテキスト。 Emoji 😀🚀 and numbers 0123456789.",
    "system user assistant tool: hello, how are you today? I am fine, thank you.",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build(path: str, vocab_size: int = 2000, texts: list[str] | None = None) -> str | None:
    """Write the demo tokenizer to ``path`` (created), trained on ``texts`` (default: the
    demo's own text); None when ``tokenizers`` is missing."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError:
        return None
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT * 50 if texts is None else texts, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "model_max_length": 131072}, f, indent=1)
    return path
