"""Cost of ``route`` as the fleet grows: 8, 64 and 256 workers all holding the prompt.

``route`` answers with every candidate ranked, so its cost grows with the fleet, not
with the prompt. Measured in process, single thread, ``time.perf_counter_ns`` around
each call, ``--calls`` calls after ``--warmup``, median and p99, on the anchor workload
(``workload.py``, ``--seqs`` sequences per worker) with a 1,024-token prompt every worker
holds whole (``full``):

* ``idle``: nothing in flight; ``idle+load``: the caller's load for half the workers;
* ``busy``: ``--in-flight`` requests recorded first (random prompts on random workers:
  in-flight load on most of a large fleet); ``busy+load``: with the caller's load too;
* each as a dry run (``route(record=False)``); ``busy`` also recorded (``route``), and
  ``idle`` as the service asks it (``route_response``, when the checkout has it);
* ``idle bytes``: the answer's JSON bytes as the service makes them (``route_body``, or
  ``route_response`` encoded by msgspec in a checkout without it): the row to compare
  across checkouts.

``--src DIR`` measures another checkout's ``indexer`` (a ``git worktree`` of the base
commit, its compiled core built there). Alternate the two for the spread::

    git worktree add /tmp/base HEAD~3   # then build its C extensions in place
    for i in 1 2 3; do
      .venv/bin/python benchmarks/bench_route_fleet.py --src /tmp/base --json >> /tmp/base.jsonl
      .venv/bin/python benchmarks/bench_route_fleet.py --json >> /tmp/new.jsonl
    done
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=None, help="another checkout whose indexer/ to measure")
    ap.add_argument("--workers", default="8,64,256", help="fleet sizes, comma-separated")
    ap.add_argument("--seqs", type=int, default=20, help="anchor sequences per worker")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--in-flight", type=int, default=300, help="requests in flight for the busy rows")
    ap.add_argument("--json", action="store_true", help="one JSON line of medians and p99s")
    args = ap.parse_args()
    # The measured tree first: --src, else this checkout (not whatever the venv installed).
    sys.path.insert(0, str(Path(args.src).resolve() if args.src else HERE.parent))
    import msgspec  # noqa: PLC0415
    import indexer  # noqa: PLC0415
    from indexer.query.route import Load  # noqa: PLC0415

    sys.path.insert(0, str(HERE))
    import workload as wl  # noqa: PLC0415
    from _report import lat_stats_us  # noqa: PLC0415
    from bench_match import build  # noqa: PLC0415

    def timed(fn: Any) -> tuple[float, float]:
        for _ in range(args.warmup):
            fn()
        ns = []
        pc = time.perf_counter_ns
        for _ in range(args.calls):
            t0 = pc()
            fn()
            ns.append(pc() - t0)
        s = lat_stats_us(ns)
        return round(s["median_us"], 1), round(s["p99_us"], 1)

    src = str(Path(indexer.__file__).resolve().parent.parent)
    enc = msgspec.json.Encoder()
    rows: dict[str, tuple[float, float]] = {}
    for n in (int(x) for x in args.workers.split(",")):
        p = wl.Params(workers=n, seqs=args.seqs)
        idx = build(wl.anchor_events(p), p.block_size)
        q = wl.anchor_queries(p, 1024)["full"]
        rng = random.Random(1)
        engines = [w["engine"] for w in idx.workers()]
        load = {f"{e}/0": Load(rng.randrange(5000), rng.randrange(50)) for e in engines[: max(1, n // 2)]}
        rows[f"{n} idle dry"] = timed(lambda: idx.route(q, record=False))
        rows[f"{n} idle+load dry"] = timed(lambda: idx.route(q, record=False, load=load))
        if hasattr(idx, "route_response"):
            rows[f"{n} idle response"] = timed(lambda: idx.route_response(q, record=False))
            if hasattr(idx, "route_body"):
                rows[f"{n} idle bytes"] = timed(lambda: idx.route_body(q, record=False).body)
            else:
                rows[f"{n} idle bytes"] = timed(lambda: enc.encode(idx.route_response(q, record=False)))
        for _ in range(args.in_flight):
            idx.route([rng.randrange(2**31) for _ in range(1024)], candidates=[rng.choice(engines)])
        rows[f"{n} busy dry"] = timed(lambda: idx.route(q, record=False))
        rows[f"{n} busy+load dry"] = timed(lambda: idx.route(q, record=False, load=load))
        rows[f"{n} busy record"] = timed(lambda: idx.route(q))
    if args.json:
        print(json.dumps({"src": src, **{k: list(v) for k, v in rows.items()}}))
        return
    print(f"indexer from {src}; {args.calls} calls per row")
    for k, (med, p99) in rows.items():
        print(f"{k:<24} median {med:8.1f} us   p99 {p99:8.1f} us")


if __name__ == "__main__":
    main()
