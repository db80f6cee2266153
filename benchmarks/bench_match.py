"""Query latency of ``PrefixIndex.match``, ``match_by_keys`` and ``indexer.wire.keys.block_keys``.

What is measured, single thread, GC enabled as normal, ``time.perf_counter_ns``
around each call, ``--calls`` (2000) calls after ``--warmup`` (200) calls, median
and p99 per query:

* indexes: the anchor workload (``workload.py``) over 8 workers (2000 sequences
  each) and over 64 workers (250 sequences each, so the index stays about the
  same size), plus two 512-block sequences per worker (one on every worker, one
  on this worker only) so that 8,192-token prompts can hit in full;
* prompts of 1,024 and 8,192 tokens of four kinds: full hit on all workers;
  one-worker hit (the other workers hold its 16-block prefix); prefix-only hit
  (a shared 16-block prefix, then unheld tokens); miss;
* ``match(tokens)`` (keys + walk + per-worker result), ``match_by_keys(keys)``
  (walk + result; the keys computed beforehand) and ``block_keys(tokens, 16)``
  alone.

``--peer`` runs the same queries on NVIDIA Dynamo's ``RadixTree``
(``peer_dynamo.py``): ``compute_block_hash_for_seq`` + ``find_matches`` against
our ``match``, ``find_matches`` against ``match_by_keys``, and its hash against
``block_keys``; it also checks that both report the same matched blocks per
worker and prints every mismatch. ``--profile`` prints a cProfile of ``match``.
``--workload mooncake`` uses the trace replay instead (queries: trace prompts).

Target: ``match`` of 1,024 tokens over 8 workers <= 20 us median.

    .venv/bin/python benchmarks/bench_match.py [--quick] [--peer] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402
from _report import (  # noqa: E402
    TARGET_MATCH_1K_8W_US, add_cpu_argument, header, lat_stats_us, peer, peer_available, ratio, table,
    workload_args,
)

from indexer import PrefixIndex  # noqa: E402
from indexer.wire.keys import block_keys  # noqa: E402

LONG_BLOCKS = 512


def build(events, block_size: int) -> PrefixIndex:
    idx = PrefixIndex()
    names = [wl.engine_name(w) for w in range(len(events))]
    for w, seq, pl in wl.interleave(wl.encode_payloads(events, block_size)):
        idx.apply(names[w], pl, seq=seq)
    return idx


def time_calls(fn, arg, calls: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn(arg)
    ns = []
    append = ns.append
    pc = time.perf_counter_ns
    for _ in range(calls):
        t0 = pc()
        fn(arg)
        append(pc() - t0)
    return lat_stats_us(ns)


def blocks_per_worker(res) -> dict[str, int]:
    """Matched GPU blocks per worker, keyed by Dynamo's worker id (``w3`` -> "3")."""
    return {w.engine[1:]: w.total_blocks for w in res.workers if w.total_blocks}


def configs(args):
    if args.workload == "mooncake":
        return [(args.workers, args.seqs)]
    if args.config:
        return [tuple(int(x) for x in c.split("x")) for c in args.config]
    if args.quick:
        return [(8, 200), (64, 25)]
    return [(8, 2000), (64, 250)]


def queries_for(args, p):
    if args.workload == "mooncake":
        qs = wl.mooncake_queries(args.queries, args.max_query_tokens, p.seed, args.requests)
        return [(f"trace:{i}", q) for i, q in enumerate(qs)]
    out = []
    for n in args.lengths:
        for kind, toks in wl.anchor_queries(p, n).items():
            out.append((f"{n}:{kind}", toks))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small indexes (200 / 25 seqs), 300 calls")
    ap.add_argument("--workload", choices=("anchor", "mooncake"), default="anchor")
    ap.add_argument("--config", nargs="*", default=None, help="WORKERSxSEQS, e.g. 8x2000 64x250")
    ap.add_argument("--requests", type=int, default=None, help="mooncake: first N requests (3000; quick 500)")
    ap.add_argument("--capacity", type=int, default=16384, help="mooncake: LRU blocks per worker")
    ap.add_argument("--queries", type=int, default=32, help="mooncake: number of trace prompts")
    ap.add_argument("--max-query-tokens", type=int, default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--peer", action="store_true", help="also run Dynamo's RadixTree (.venv-dynamo)")
    ap.add_argument("--profile", action="store_true", help="cProfile match() on the first config")
    ap.add_argument("--top", type=int, default=20)
    add_cpu_argument(ap)
    wl.add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.calls = min(args.calls, 300)
        args.warmup = min(args.warmup, 50)
    if args.workload == "mooncake" and args.requests is None:
        args.requests = 500 if args.quick else 3000
    header("bench_match: PrefixIndex.match / match_by_keys / block_keys latency", args)
    if args.peer and not peer_available():
        print("## peer: .venv-dynamo not found; run: python3 -m venv .venv-dynamo && "
              ".venv-dynamo/bin/pip install ai-dynamo-runtime==1.6.1 msgspec xxhash\n")
        args.peer = False

    all_rows = []
    mismatches = []
    for workers, seqs in configs(args):
        args.workers, args.seqs = workers, seqs
        long_blocks = LONG_BLOCKS if args.workload == "anchor" and max(args.lengths) > args.blocks * args.block_size else 0
        p = wl.params_from_args(args, long_blocks=long_blocks)
        events = wl.load_events(args.workload, p, mooncake_requests_n=args.requests, capacity_blocks=args.capacity)
        summ = wl.summarize(events)
        idx = build(events, p.block_size)
        st = idx.stats()
        print(f"## index: {args.workload}, {workers} workers x {seqs} seqs (long_blocks={long_blocks}): "
              f"{st['nodes']:,} nodes, {st['resident_entries']:,} entries"
              + ("" if st["resident_entries"] == summ["resident_entries"] else
                 f" (workload says {summ['resident_entries']:,}: MISMATCH)"))
        bs = p.block_size
        qs = queries_for(args, p)
        ours = {}
        for name, toks in qs:
            keys = block_keys(toks, bs)
            res = idx.match(toks)
            ours[name] = {
                "match": time_calls(idx.match, toks, args.calls, args.warmup),
                "by_keys": time_calls(idx.match_by_keys, keys, args.calls, args.warmup),
                "keys": time_calls(lambda t: block_keys(t, bs), toks, args.calls, args.warmup),
                "blocks": blocks_per_worker(res),
                "tokens": len(toks),
            }
        dyn = None
        if args.peer:
            pargs = workload_args(args) + ["--long-blocks", str(long_blocks), "--calls", str(args.calls),
                                           "--warmup", str(args.warmup), "--lengths", *map(str, args.lengths),
                                           "--queries", str(args.queries)]
            if args.max_query_tokens:
                pargs += ["--max-query-tokens", str(args.max_query_tokens)]
            dyn = peer("match", pargs)
        for name, r in ours.items():
            ntok, kind = name.split(":")
            d = dyn["queries"].get(name) if dyn else None
            target = f"<= {TARGET_MATCH_1K_8W_US:g}" if (workers == 8 and ntok == "1024" and args.workload == "anchor") else ""
            label = wl.QUERY_LABELS.get(kind) or f"trace prompt #{kind}"
            all_rows.append([
                workers, r["tokens"], label,
                r["match"]["median_us"], r["match"]["p99_us"],
                r["by_keys"]["median_us"], r["by_keys"]["p99_us"],
                r["keys"]["median_us"], r["keys"]["p99_us"],
                d["hash_find"]["median_us"] if d else None,
                ratio(r["match"]["median_us"], d["hash_find"]["median_us"]) if d else None,
                d["find"]["median_us"] if d else None,
                ratio(r["by_keys"]["median_us"], d["find"]["median_us"]) if d else None,
                ratio(r["keys"]["median_us"], d["hash"]["median_us"]) if d else None,
                target,
            ])
            if d is not None and d["scores"] != r["blocks"]:
                mismatches.append((workers, name, r["blocks"], d["scores"]))
        if dyn:
            all_rows.append([workers, 0, "Dynamo find_matches([]) call floor", None, None, None, None, None, None,
                             None, None, dyn["floor"]["median_us"], None, None, ""])
            if dyn.get("keys_disagree"):
                mismatches.append((workers, "block keys", "indexer.wire.keys.block_keys",
                                   f"{dyn['keys_disagree']} prompts hash differently"))
        if args.profile and (workers, seqs) == configs(args)[0]:
            profile_match(idx, qs, args.top)
        del idx

    print(table(
        ["workers", "tokens", "query", "match med us", "p99", "by_keys med", "p99", "block_keys med", "p99",
         "Dyn hash+find med", "ours/Dyn", "Dyn find med", "by_keys/Dyn", "keys/Dyn hash", "target"],
        all_rows,
        title=f"## latency in microseconds ({args.calls} calls each after {args.warmup} warm-up; GC on)"
              + ("; Dyn = Dynamo RadixTree, ratios are ours/Dynamo medians (< 1 = ours faster)" if args.peer else ""),
    ))
    print()
    if args.peer:
        if mismatches:
            print(f"## agreement with Dynamo: {len(mismatches)} MISMATCHES (matched blocks per worker id)")
            for workers, name, a, b in mismatches:
                print(f"  {workers} workers, {name}: ours {a}  Dynamo {b}")
        else:
            print("## agreement with Dynamo: matched blocks per worker identical for every query")


def profile_match(idx, qs, top: int) -> None:
    import cProfile
    import pstats

    toks = dict(qs).get("1024:full") or qs[0][1]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        idx.match(toks)
    pr.disable()
    print("## cProfile of 2,000 match() calls, 1,024-token full hit (top by own time)")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
