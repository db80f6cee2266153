"""Instruction counts of one ``/v1/route`` answer as the service makes it, at 8, 64 or 256
workers all holding the prompt (valgrind callgrind): run this under callgrind twice, with
N calls and with 0, and divide the difference by N (wall clock on a shared 2-core machine
moves too much to compare the two).

    python benchmarks/cg_route_fleet.py SRC WORKERS OP N
    # SRC: a checkout whose indexer/ to load; OP: response | body; N: calls.
    for n in 0 200; do valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n .venv/bin/python \\
        benchmarks/cg_route_fleet.py . 256 body $n 2>&1 | grep Collected; done

``response``: ``route_response`` encoded by msgspec (the service's answer before the core
wrote the JSON); ``body``: ``route_body`` (the bytes the service sends now; a checkout
without it measures ``response``). A dry run, nothing in flight: the index as
``bench_route_fleet.py`` builds it (anchor workload, 20 sequences per worker, the
1,024-token prompt every worker holds).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    src, workers, op, k = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    sys.path.insert(0, str(Path(src).resolve()))
    import indexer  # noqa: F401  # first: this tree's indexer, not another on sys.path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import msgspec
    import workload as wl
    from bench_match import build

    p = wl.Params(workers=workers, seqs=20)
    idx = build(wl.anchor_events(p), p.block_size)
    q = wl.anchor_queries(p, 1024)["full"]
    enc = msgspec.json.Encoder()
    if op == "body" and hasattr(idx, "route_body"):
        def call() -> bytes:
            return idx.route_body(q, record=False).body
    else:
        def call() -> bytes:
            return enc.encode(idx.route_response(q, record=False))
    for _ in range(5):  # first calls warm caches either way (the baseline makes them too)
        call()
    for _ in range(k):
        call()


if __name__ == "__main__":
    main()
