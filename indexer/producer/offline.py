"""The offline demo (``kv-indexer demo-offline``): no service, no sockets.

Builds an index in this process from simulated vLLM events (4 engines, GPU and a CPU
offload tier, shared prefixes) encoded exactly as vLLM encodes them, then prints the
``/v1/match`` body for a few prompts and the index stats.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any, TextIO

from indexer.producer.events import Removed, Stored, encode_batch
from indexer.query.index import PrefixIndex

BLOCK = 16


def _chain(tokens: list[int], salt: int) -> list[int]:
    """Engine-style block hashes: one 64-bit value per prefix (shared-seed engines agree)."""
    out, prev = [], salt
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        prev = hash((prev, tuple(tokens[i : i + BLOCK]))) & 0xFFFFFFFFFFFFFFFF
        out.append(prev)
    return out


def demo(out: TextIO = sys.stdout) -> dict[str, Any]:
    """Feed a small simulated fleet and print what a router would ask and get back."""
    rng = random.Random(7)
    system = [rng.randrange(1, 32000) for _ in range(BLOCK * 8)]  # shared system prompt
    docs = [[rng.randrange(1, 32000) for _ in range(BLOCK * 24)] for _ in range(4)]
    idx = PrefixIndex()
    seq = {}
    for e in range(4):
        engine = f"vllm-{e}"
        seq[engine] = 0
        prompt = system + docs[e]
        hashes = _chain(prompt, 0)
        events = [Stored(hashes[:8], None, prompt[: 8 * BLOCK], BLOCK, kv_cache_spec_kind="full_attention"),
                  Stored(hashes[8:], hashes[7], prompt[8 * BLOCK :], BLOCK, kv_cache_spec_kind="full_attention")]
        if e % 2 == 0:
            # CPU offload of the whole prompt in 4-block chunks (self-describing events).
            for c in range(0, len(hashes), 4):
                events.append(Stored(hashes[c : c + 4], hashes[c - 1] if c else None,
                                     prompt[c * BLOCK : (c + 4) * BLOCK], BLOCK, medium="CPU",
                                     kv_cache_spec_kind="full_attention"))
            # ... and the GPU later evicts the tail: the CPU tier still has it.
            events.append(Removed(hashes[20:][::-1], medium="GPU"))
        idx.apply(engine, encode_batch(events, version="0.33"), seq=0)
    results = {
        "shared system prompt": idx.match(system + [5] * 40),
        "document 0 (GPU 20 blocks, CPU to 32)": idx.match(system + docs[0]),
        "document 1 (GPU only)": idx.match(system + docs[1]),
        "unknown prompt": idx.match([9] * 256),
    }
    report = {name: r.to_dict() for name, r in results.items()}
    report["stats"] = {k: v for k, v in idx.stats().items()
                       if k in ("nodes", "resident_entries", "orphans", "workers", "events")}
    out.write(json.dumps(report, indent=2) + "\n")
    return report
