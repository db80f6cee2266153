"""How many entries fit in one process: a synthetic fleet streamed into one ``PrefixIndex``.

The workload of ``bench_services.py`` (W engines, each caching sequences of 64 blocks of 16
tokens, every 10th sequence identical on all engines, token ids uniform in [0, 32000),
one vLLM 0.33 ``BlockStored`` of 64 blocks per payload), but generated a chunk at a time
and applied in process with ``PrefixIndex.apply``, so that nothing but the index grows:
at 10^8 entries the payloads alone would take ~5 GB. At every ``--every`` entries it
prints the RSS growth per resident (engine, block) entry, the highest RSS so far
(VmHWM, over the same baseline) and the apply rate so far.

It stops early, saying so, when the process's RSS passes ``--max-rss-gb`` or the
machine's available memory falls below ``--min-available-gb`` (the machine is shared:
the run must never push it into the OOM killer).

    .venv/bin/python benchmarks/bench_huge.py --entries 1e8 --every 1e7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _report import machine, rss_bytes  # noqa: E402

from indexer import PrefixIndex  # noqa: E402
from indexer.producer.events import Stored, encode_batch  # noqa: E402

BLOCKS, BLOCK_SIZE, VOCAB = 64, 16, 32000
TOKENS = BLOCKS * BLOCK_SIZE
CHUNK = 512  # sequences per engine generated at a time


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def peak_rss_bytes() -> int:
    """The process's highest RSS so far (VmHWM): a hash table that doubles holds its old
    and new arrays at once, between two reports."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def payload(tokens: list[int], base: int, s: int) -> bytes:
    ev = Stored(block_hashes=list(range(base, base + BLOCKS)), parent_block_hash=None, token_ids=tokens,
                block_size=BLOCK_SIZE, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")
    return encode_batch([ev], ts=1767225600.0 + s, dp_rank=0, version="0.33")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=float, default=1e8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--every", type=float, default=1e7, help="report every this many entries")
    ap.add_argument("--max-rss-gb", type=float, default=14.0)
    ap.add_argument("--min-available-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    w_n = args.workers
    seqs = max(2, int(args.entries) // (BLOCKS * w_n))
    print(f"# bench_huge: {w_n} engines x {seqs:,} sequences x {BLOCKS} blocks = {seqs * w_n * BLOCKS:,} entries; "
          f"{machine()}")
    print(f"# command: {' '.join([Path(sys.executable).name] + sys.argv)}\n", flush=True)
    names = [f"engine-{w}" for w in range(w_n)]
    rng = np.random.default_rng(args.seed)
    idx = PrefixIndex()
    apply = idx.apply
    rss0 = rss_bytes()
    every, next_report = int(args.every), int(args.every)
    applied_s = 0.0
    entries = 0
    stop = None
    print(f"{'entries':>13}  {'RSS GiB':>8}  {'B/entry':>8}  {'peak GiB':>8}  {'peak B/entry':>12}  "
          f"{'apply blocks/s':>14}  {'nodes':>13}", flush=True)
    for s0 in range(0, seqs, CHUNK):
        n = min(CHUNK, seqs - s0)
        # Shared sequences: one token row for all engines; the others: a row per engine.
        rows = rng.integers(0, VOCAB, size=(w_n, n, TOKENS), dtype=np.uint16)
        batch: list[tuple[str, int, bytes]] = []
        for s in range(s0, s0 + n):
            for w in range(w_n):
                shared = s % 10 == 0
                toks = (rows[0] if shared else rows[w])[s - s0].tolist()
                base = (1 << 62) | (s << 7) if shared else ((w + 1) << 40) | (s << 7)
                batch.append((names[w], s, payload(toks, base, s)))
        del rows
        t = time.perf_counter()
        for eng, seq, pl in batch:
            apply(eng, pl, seq=seq)
        applied_s += time.perf_counter() - t
        entries += len(batch) * BLOCKS
        del batch
        if entries >= next_report or s0 + n >= seqs:
            next_report += every
            rss = rss_bytes()
            st = idx.stats()
            assert st["resident_entries"] == entries, (st["resident_entries"], entries)
            peak = peak_rss_bytes()
            print(f"{entries:>13,}  {rss / 2**30:>8.2f}  {(rss - rss0) / entries:>8.1f}  {peak / 2**30:>8.2f}  "
                  f"{(peak - rss0) / entries:>12.1f}  {entries / applied_s:>14,.0f}  {st['nodes']:>13,}", flush=True)
        if rss_bytes() > args.max_rss_gb * 2**30:
            stop = f"RSS passed {args.max_rss_gb} GiB"
        elif available_bytes() < args.min_available_gb * 2**30:
            stop = f"the machine's available memory fell below {args.min_available_gb} GiB"
        if stop:
            break
    if stop:
        print(f"\nstopped at {entries:,} entries: {stop}")
    else:
        print(f"\nall {entries:,} entries in one process: RSS {rss_bytes() / 2**30:.2f} GiB, "
              f"{(rss_bytes() - rss0) / entries:.1f} B/entry; peak {peak_rss_bytes() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
