"""Hot-path cost of routing under real timing: ``match`` and ``route`` before and
after the index learned to record its decisions.

What is measured, single thread, ``time.perf_counter_ns`` around each call, ``--calls``
calls after ``--warmup``, median and p99: on the anchor workload (``workload.py``: 8
workers x 2,000 sequences), 1,024-token prompts of four kinds (full hit on all workers,
one-worker hit, prefix-only hit, miss):

* ``match``: the announced prefix per worker;
* ``route(record=False)``: match + ranking against load (a dry run);
* ``route(record=True)``: the same, plus recording the decision (predicted blocks, in-flight
  load), with ``--in-flight`` requests already in flight (predictions on random workers).

``--src DIR`` runs the same calls on another checkout's ``indexer`` (e.g. a ``git worktree``
of a commit from before decisions were recorded, with this tree's compiled core copied in); there ``route``
has no ``record`` and is measured as the dry run. Run both, alternating, and compare::

    git worktree add /tmp/before 37507e0 && cp indexer/_core*.so /tmp/before/indexer/
    for i in 1 2 3; do
      .venv/bin/python benchmarks/bench_route.py --src /tmp/before --json >> /tmp/before.jsonl
      .venv/bin/python benchmarks/bench_route.py --json >> /tmp/after.jsonl
    done
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=None, help="another checkout whose indexer/ to measure")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--seqs", type=int, default=2000)
    ap.add_argument("--in-flight", type=int, default=1000, help="requests in flight before route(record=True)")
    ap.add_argument("--json", action="store_true", help="one JSON line of medians and p99s")
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, str(Path(args.src).resolve()))
    import indexer  # noqa: PLC0415  # first: workload.py puts this tree on sys.path

    sys.path.insert(0, str(HERE))
    import workload as wl  # noqa: PLC0415
    from _report import lat_stats_us  # noqa: PLC0415
    from bench_match import build  # noqa: PLC0415

    src = str(Path(indexer.__file__).resolve().parent.parent)
    ap2 = argparse.ArgumentParser()
    wl.add_arguments(ap2)
    wargs = ap2.parse_args([])
    wargs.workers, wargs.seqs = 8, args.seqs
    p = wl.params_from_args(wargs, long_blocks=0)
    idx = build(wl.load_events("anchor", p), p.block_size)
    queries = wl.anchor_queries(p, 1024)
    try:
        idx.route(queries["miss"], record=False)
        has_record = True
    except TypeError:
        has_record = False

    def timed(fn, arg) -> dict:
        for _ in range(args.warmup):
            fn(arg)
        ns = []
        pc = time.perf_counter_ns
        for _ in range(args.calls):
            t0 = pc()
            fn(arg)
            ns.append(pc() - t0)
        return lat_stats_us(ns)

    rows = {}
    for kind, toks in queries.items():
        rows[f"match {kind}"] = timed(idx.match, toks)
        if has_record:
            rows[f"route dry {kind}"] = timed(lambda t: idx.route(t, record=False), toks)
        else:
            rows[f"route dry {kind}"] = timed(idx.route, toks)
    if has_record:
        rng = random.Random(1)
        workers = [(w["engine"], w["dp_rank"]) for w in idx.workers()]
        for _ in range(args.in_flight):  # predictions elsewhere in the trie, and load
            e, _r = rng.choice(workers)
            idx.route([rng.randrange(2**31) for _ in range(1024)], candidates=[e])
        for kind, toks in queries.items():
            rows[f"route record {kind}"] = timed(idx.route, toks)
    if args.json:
        print(json.dumps({"src": src, "record": has_record,
                          **{k: [round(v["median_us"], 2), round(v["p99_us"], 2)] for k, v in rows.items()}}))
        return
    print(f"indexer from {src}; route records: {has_record}; {args.calls} calls per row")
    for k, v in rows.items():
        print(f"{k:<28} median {v['median_us']:8.2f} us   p99 {v['p99_us']:8.2f} us")


if __name__ == "__main__":
    main()
