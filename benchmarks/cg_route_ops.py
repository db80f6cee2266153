"""Instruction counts of one query (valgrind callgrind): run this under callgrind twice,
with N calls and with 0, and divide the difference by N. Used for the before/after of
recorded routing decisions in docs/benchmarks.md, where wall-clock medians on a shared 2-core machine moved
by +-40% between runs of the same code.

    python benchmarks/cg_route_ops.py SRC OP N
    # SRC: a checkout whose indexer/ to load; OP: none | match | dry | record; N: calls.
    valgrind --tool=callgrind --callgrind-out-file=/tmp/a.out .venv/bin/python \\
        benchmarks/cg_route_ops.py . dry 400          # and again with 0: the "Collected :" lines

The index: the anchor workload, 8 workers x 200 sequences; the queries: the four 1,024-token
kinds of bench_match.py in turn; ``record`` first routes 200 random prompts (in flight), and
its baseline is ``record 0``. A checkout from before decisions were recorded has no ``record``: its ``dry``
is its plain ``route``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


def main() -> None:
    src, op, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, str(Path(src).resolve()))
    import indexer  # noqa: F401  # first: workload.py puts this tree on sys.path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import workload as wl
    from bench_match import build

    ap = argparse.ArgumentParser()
    wl.add_arguments(ap)
    a = ap.parse_args([])
    a.workers, a.seqs = 8, 200
    p = wl.params_from_args(a, long_blocks=0)
    idx = build(wl.load_events("anchor", p), p.block_size)
    qs = list(wl.anchor_queries(p, 1024).values())
    has_record = "record" in idx.route.__code__.co_varnames
    if op == "record" and has_record:
        rng = random.Random(1)
        for _ in range(200):
            idx.route([rng.randrange(2**31) for _ in range(1024)])
    for i in range(k):
        q = qs[i % 4]
        if op == "match":
            idx.match(q)
        elif op == "dry":
            if has_record:
                idx.route(q, record=False)
            else:
                idx.route(q)
        elif op == "record":
            idx.route(q)


if __name__ == "__main__":
    main()
