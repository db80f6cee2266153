"""Cost of text prompts: tokens/s of the tokenizer and chat template, and what
tokenizing adds to a route, for ~1k- and ~32k-token prompts.

The tokenizer is a byte-level BPE trained here (``--vocab``, default 32,000 on ~4 MB of
generated multilingual text; nothing is downloaded) with a ChatML template, the shape of
Qwen's. Single thread, ``time.perf_counter_ns`` around each call, median and p99 of
``--calls`` calls after a warm-up:

* ``encode prompt``: ``Tokenizer.encode_prompt`` (vLLM's completions path);
* ``chat render``: the Jinja template alone, a 2-message chat (system + the prompt as user);
* ``chat render+encode``: ``Tokenizer.encode_chat`` (vLLM's chat path);
* ``route by ids``: ``PrefixIndex.route(ids, record=False)`` on an index where 8 workers
  hold the prompt's blocks (4 of them the whole prompt, 4 the first half);
* ``route by prompt`` / ``route by messages``: tokenize, then the same route; the
  difference to ``route by ids`` is what text adds to a route in the library (over HTTP
  the same work runs on the tokenizer pool, off the event loop).

    .venv/bin/python benchmarks/bench_text.py            # prints the table (~1 min)
    .venv/bin/python benchmarks/bench_text.py --quick    # smaller vocab, fewer calls
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

_WORDS = ("the a of to and in is for on with as by at from this that cache block prefix token route worker "
         "engine model request prompt key value hit miss load queue GPU CPU tier store remove event vLLM "
         "Grüße Köln straße café naïve 日本語 テキスト 中文 한국어 😀 🚀 ∑ √ → def return if else for while "
         "x = y + 1 ( ) [ ] { } : ; , . ! ? 0 1 2 3 42 1024 2048")
WORDS = _WORDS.split()


def corpus(n_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 40):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(40)) + rng.choice([".", "\n", "\n\n", "  "]))
    return lines


def build_tokenizer(root: str, vocab: int, n_words: int) -> str:
    from indexer.producer import tokenizer

    # Random words make few merges beyond them; add character n-grams so the vocabulary fills.
    lines = corpus(n_words, 1)
    rng = random.Random(2)
    lines += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzäöü") for _ in range(rng.randint(3, 9)))
              for _ in range(n_words // 4)]
    path = tokenizer.build(str(Path(root) / "tok"), vocab, lines)
    if path is None:
        raise SystemExit("bench_text needs the text extra: pip install -e '.[text]'")
    return path


def prompt_of(tok, n_tokens: int, seed: int) -> str:
    """Text of about ``n_tokens`` tokens (whole words)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(8, n_tokens // 4))]
        text = " ".join(words)
        if len(tok.encode_prompt(text)) >= n_tokens:
            return text


def timed(fn, calls: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    ns = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
    ns.sort()
    return {"median_us": statistics.median(ns) / 1000.0, "p99_us": ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1000.0}


def index_for(ids: list[int]):
    from indexer import PrefixIndex
    from indexer.producer.events import Stored, encode_batch

    bs = 16
    idx = PrefixIndex()
    nblocks = len(ids) // bs
    for w in range(8):
        n = nblocks if w < 4 else nblocks // 2
        hashes = [hash((w, i)) & ((1 << 63) - 1) for i in range(n)]
        ev = Stored(block_hashes=hashes, parent_block_hash=None, token_ids=ids[: n * bs], block_size=bs,
                    medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")
        idx.apply(f"vllm-{w}", encode_batch([ev], version="0.33", dp_rank=0, ts=1767225600.0 + w), seq=0)
    return idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sizes", default="1024,32768", help="prompt sizes in tokens")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.calls = 8000, 40
    from _report import machine, table  # noqa: PLC0415

    from indexer.text.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        path = build_tokenizer(root, args.vocab, 400_000 if not args.quick else 100_000)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = Tokenizer(path, "bench")
        loaded = time.perf_counter() - t0
        rows, out = [], {"machine": machine(), "vocab": tok._tok.get_vocab_size(), "build_s": built,
                         "load_s": loaded, "sizes": {}}
        for size in (int(s) for s in args.sizes.split(",")):
            text = prompt_of(tok, size, size)
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": text}]
            ids = tok.encode_prompt(text)
            chat_ids = tok.encode_chat(messages).token_ids
            idx = index_for(ids)
            calls = max(10, args.calls if size <= 4096 else args.calls // 4)
            warm = max(3, calls // 10)
            res = {
                "encode prompt": timed(lambda: tok.encode_prompt(text), calls, warm),
                "chat render": timed(lambda: tok.render(messages), calls, warm),
                "chat render+encode": timed(lambda: tok.encode_chat(messages), calls, warm),
                "route by ids": timed(lambda: idx.route(ids, record=False), calls, warm),
                "route by prompt": timed(lambda: idx.route(tok.encode_prompt(text), record=False), calls, warm),
                "route by messages": timed(lambda: idx.route(tok.encode_chat(messages).token_ids, record=False),
                                           calls, warm),
            }
            base = res["route by ids"]["median_us"]
            for name, r in res.items():
                n = len(chat_ids) if "messages" in name or "chat" in name else len(ids)
                r["tokens"] = n
                r["mtok_per_s"] = n / r["median_us"] if "route" not in name or name != "route by ids" else None
                r["added_us"] = r["median_us"] - base if name.startswith("route by ") and name != "route by ids" \
                    else None
                rows.append([f"{len(ids):,}", name, r["median_us"], r["p99_us"],
                             f"{r['mtok_per_s']:.2f}" if r["mtok_per_s"] is not None and "route" not in name else "",
                             f"{r['added_us']:.0f}" if r["added_us"] is not None else ""])
            out["sizes"][size] = res
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['machine']}; BPE vocab {out['vocab']:,} (trained in {built:.1f} s, loaded in {loaded * 1000:.0f} ms)")
    print(table(["prompt tokens", "what", "median us", "p99 us", "M tokens/s", "added to route us"], rows))


if __name__ == "__main__":
    main()
