"""Real Hugging Face tokenizer directories, built by the tests (no download): a small
BPE trained with ``tokenizers`` on text written here, saved as ``tokenizer.json`` with a
``tokenizer_config.json`` holding one of the common chat-template families.

Families (what each exercises):
- ``chatml``: ChatML (``<|im_start|>role\\n...<|im_end|>``), byte-level BPE, no BOS.
- ``llama3``: Llama 3 headers, BOS added by the post-processor *and* written by the
  template (so the chat path must not add it twice), ``| trim`` on content.
- ``sysdefault``: Qwen 2.5 style: a default system prompt when the conversation has none.
- ``gemma``: iterates over content parts (vLLM passes content as a list of text parts),
  ``raise_exception`` on roles out of turn, BOS from the template, a Metaspace
  (SentencePiece-like) pre-tokenizer with an NFKC normalizer and an ``<unk>``.
"""

from __future__ import annotations

import json
import os

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "KV caches hold the keys and values of every prompt token; routing by prefix reuses them.",
    "def route(prompt, workers):\n    return max(workers, key=lambda w: w.cached(prompt))\n",
    "Grüße aus Köln! Ça va? Ñandú, smørrebrød, æøå, İstanbul, straße.",
    "日本語のテキストとカタカナ、ひらがな。中文也可以。한국어 문장입니다.",
    "Emoji 😀🚀🎉 and math ∑∫√∞ ≤ ≥ ≠ and arrows → ← ↔.",
    "Tabs\tand  double  spaces,\nnew lines\n\n and trailing spaces   ",
    "You are a helpful assistant. Answer briefly and precisely.",
    "user assistant system tool developer: hello there, how are you today?",
] * 20

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SYSDEFAULT = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\n' + (default_system | default('You are a helpful assistant.')) + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# family -> (template, content format vLLM gives it, template variables the tests may set)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "sysdefault": SYSDEFAULT, "gemma": GEMMA}
OPENAI_FORMAT = {"gemma"}
FAMILIES = tuple(TEMPLATES)


def build(family: str, root: str, *, vocab_size: int = 600) -> str:
    """Train the family's tokenizer in ``root/family`` and write its directory."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    path = os.path.join(root, family)
    os.makedirs(path, exist_ok=True)
    if family == "gemma":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    else:
        if family == "llama3":
            specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"]
        else:
            specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[family],
                    "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False}
    if family == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
        config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    elif family == "gemma":
        bos = tok.token_to_id("<bos>")
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
        config.update(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config.update(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    return path
