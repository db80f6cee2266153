"""Instruction counts of recording (valgrind callgrind), which wall clocks on a shared
2-core VM cannot resolve to a few percent: run this under callgrind with each mode and
compare the "Collected" totals (every thread's instructions, the writer's included).

    python benchmarks/cg_record.py MODE N Q
    # MODE: off | on (recorded, hashed, everything written by the end); N: batches applied,
    # then Q queries (match_plain and route_body of 1,024 tokens, in turn).
    for m in off on; do for a in "0 0" "4000 0" "4000 2000"; do
        valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
            benchmarks/cg_record.py $m $a 2>&1 | grep Collected; done; done
    # ingest: (on 4000 0 - on 0 0) / (off 4000 0 - off 0 0) - 1; queries alike, over Q

The workload: the anchor workload of bench_record.py (8 workers x 500 sequences x 64
blocks, one event per vLLM 0.33 payload), applied with ``apply_sequenced`` as the live
ingest applies it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402

from indexer import PrefixIndex  # noqa: E402
from indexer.ingest.record import Recorder  # noqa: E402
from indexer.wire.keys import tokens_to_bytes  # noqa: E402


def main() -> None:
    mode, n, nq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ap = argparse.ArgumentParser()
    wl.add_arguments(ap)
    p = wl.params_from_args(ap.parse_args(["--seqs", "500"]))
    events = wl.load_events("anchor", p)
    names = [wl.engine_name(w) for w in range(len(events))]
    items = [(names[w], seq, pl) for w, seq, pl in wl.interleave(wl.encode_payloads(events, p.block_size, 1))]
    prompts = [tokens_to_bytes(t) for t in wl.anchor_queries(p, 1024).values()]
    idx = PrefixIndex()
    with tempfile.TemporaryDirectory(prefix="kvi-cg-rec-") as d:
        rec = Recorder(d) if mode == "on" else None
        if rec is not None:
            rec.attach(idx)
            rec.start()
        for eng, seq, pl in items[:n]:
            idx.apply_sequenced(eng, pl, seq=seq)
        for i in range(nq):
            q = prompts[i % len(prompts)]
            if i % 2:
                idx.route_done(idx.route_body(q, model="default", load={}, link=None).request_id)
            else:
                idx.match_plain(q, "default")
        if rec is not None:
            rec.stop()


if __name__ == "__main__":
    main()
