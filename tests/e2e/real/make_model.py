"""Writes a tiny random-weight model directory a real vLLM engine serves (no download).

Run with the engine venv's Python (it has torch and transformers):
``python make_model.py OUT [--kind llama|hybrid]``. The tokenizer is the test suite's
own (``tests/textkit.py``, the Llama 3 family: a BOS added by the post-processor and
written by the chat template), trained here; the weights are random, which is all a
test of the prefix cache needs: vLLM's block hashes depend on token ids alone.

Sizes the CPU attention backend accepts: ``head_dim`` 64 (it refuses 16), and the
engine's block size a multiple of 32 (set by the server flags, not here).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import textkit  # noqa: E402 (the tests folder, put on the path above)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kind", choices=["llama", "hybrid"], default="llama")
    a = ap.parse_args()
    import torch
    import transformers
    from tokenizers import Tokenizer

    os.makedirs(a.out, exist_ok=True)
    tdir = textkit.build("llama3", a.out + ".tok")
    tok = Tokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    common = dict(vocab_size=max(vocab, 640), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                  bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|eot_id|>"),
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if a.kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        # Two KV-cache groups: a sliding-window layer and a full-attention one (Gemma 3's
        # text model interleaves them by layer_types).
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=64,
                                            layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(a.out)
    for name in os.listdir(tdir):
        with open(os.path.join(tdir, name), "rb") as src, open(os.path.join(a.out, name), "wb") as dst:
            dst.write(src.read())
    print(a.out)


if __name__ == "__main__":
    main()
