"""Memory per resident (worker, block) entry and per node of ``PrefixIndex``.

What is measured: each figure in a fresh subprocess, so nothing else lives in
the heap. The parent writes the workload's payloads to a temporary file; the
child reads them (kept alive throughout), collects garbage, measures, applies
every payload with ``PrefixIndex.apply``, collects garbage and measures again:

* **RSS** (``/proc/self/statm``) delta: what the process really grew by;
* **tracemalloc** delta (separate child, tracing only around the apply loop):
  bytes Python allocated and still holds, the index's own footprint.

Each delta is divided by ``stats()["resident_entries"]`` (per entry) and by
``stats()["nodes"]`` (per node). Default workload: the Dynamo anchor workload
(776,192 entries, 701,824 nodes); ``--workers/--seqs`` change it,
``--workload mooncake`` replays the trace.

``--peer`` measures NVIDIA Dynamo's ``RadixTree`` the same way (RSS only: its
memory is Rust heap, invisible to tracemalloc) on the same events as JSON, and
prints the ratio ours/Dynamo.

Target: <= 150 bytes per resident entry.

    .venv/bin/python benchmarks/bench_memory.py [--quick] [--peer]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload as wl  # noqa: E402
from _report import (  # noqa: E402
    TARGET_BYTES_PER_ENTRY, add_cpu_argument, header, peer, peer_available, ratio, rss_bytes, table,
    workload_args,
)


def child(kind: str, path: str) -> None:
    """Runs in the fresh subprocess: one measurement, one JSON line on stdout."""
    from indexer import PrefixIndex

    with open(path, "rb") as f:
        items = pickle.load(f)
    gc.collect()
    if kind == "tracemalloc":
        import tracemalloc

        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
    else:
        before = rss_bytes()
    idx = PrefixIndex()
    bad = 0
    for eng, seq, pl in items:
        if idx.apply(eng, pl, seq=seq) != "applied":
            bad += 1
    gc.collect()
    if kind == "tracemalloc":
        import tracemalloc

        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    else:
        after = rss_bytes()
    st = idx.stats()
    print(json.dumps({"kind": kind, "before": before, "after": after, "delta": after - before,
                      "nodes": st["nodes"], "entries": st["resident_entries"], "not_applied": bad}))


def run_child(kind: str, path: str, cpu: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-file", path, "--cpu", str(cpu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {kind} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload (200 seqs/worker)")
    ap.add_argument("--workload", choices=("anchor", "mooncake"), default="anchor")
    ap.add_argument("--requests", type=int, default=None, help="mooncake: first N requests (3000; quick 500)")
    ap.add_argument("--capacity", type=int, default=16384, help="mooncake: LRU blocks per worker")
    ap.add_argument("--repeat", type=int, default=1, help="RSS children per figure (median reported)")
    ap.add_argument("--peer", action="store_true", help="also measure Dynamo's RadixTree (.venv-dynamo)")
    ap.add_argument("--child", choices=("rss", "tracemalloc"), help=argparse.SUPPRESS)
    ap.add_argument("--child-file", help=argparse.SUPPRESS)
    add_cpu_argument(ap)
    wl.add_arguments(ap)
    args = ap.parse_args()
    if args.child:
        from _report import pin

        pin(args.cpu)
        child(args.child, args.child_file)
        return
    if args.quick:
        args.seqs = min(args.seqs, 200)
    if args.workload == "mooncake" and args.requests is None:
        args.requests = 500 if args.quick else 3000
    header("bench_memory: bytes per resident (worker, block) entry", args)

    p = wl.params_from_args(args)
    events = wl.load_events(args.workload, p, mooncake_requests_n=args.requests, capacity_blocks=args.capacity)
    summ = wl.summarize(events)
    names = [wl.engine_name(w) for w in range(len(events))]
    items = [(names[w], seq, pl) for w, seq, pl in wl.interleave(wl.encode_payloads(events, p.block_size))]
    with tempfile.TemporaryDirectory(prefix="kvpi-mem-") as tmp:
        ours_file = os.path.join(tmp, "payloads.pkl")
        with open(ours_file, "wb") as f:
            pickle.dump(items, f, protocol=pickle.HIGHEST_PROTOCOL)
        del items
        rss = sorted((run_child("rss", ours_file, args.cpu) for _ in range(args.repeat)), key=lambda r: r["delta"])
        rss = rss[len(rss) // 2]
        tm = run_child("tracemalloc", ours_file, args.cpu)
        entries, nodes = rss["entries"], rss["nodes"]
        check = "" if (entries == summ["resident_entries"] and nodes == summ["distinct_blocks"]) else " (MISMATCH with workload)"
        rows = [
            ["ours: RSS delta", rss["delta"], rss["delta"] / entries, rss["delta"] / nodes, f"<= {TARGET_BYTES_PER_ENTRY}"],
            ["ours: tracemalloc delta", tm["delta"], tm["delta"] / entries, tm["delta"] / nodes, f"<= {TARGET_BYTES_PER_ENTRY}"],
        ]
        dyn = None
        if args.peer:
            if not peer_available():
                print("## peer: .venv-dynamo not found; skipped\n")
            else:
                from indexer.wire.keys import block_keys

                dyn_file = os.path.join(tmp, "dynamo.jsonl")
                with open(dyn_file, "wb") as f:
                    per_worker = [wl.dynamo_json(evs, block_keys, p.block_size) for evs in events]
                    for w, _seq, j in wl.interleave(per_worker):
                        f.write(b"%d\t%s\n" % (w, j))
                    del per_worker
                runs = [peer("memory", workload_args(args) + ["--events-file", dyn_file])
                        for _ in range(args.repeat)]
                runs = sorted((r for r in runs if r), key=lambda r: r["rss_delta"])
                if runs:
                    dyn = runs[len(runs) // 2]
                    d = dyn["rss_delta"]
                    rows.append(["Dynamo RadixTree: RSS delta", d, d / summ["resident_entries"],
                                 d / summ["distinct_blocks"], ""])
                    rows.append(["ratio ours/Dynamo (RSS)", None, ratio(rss["delta"], d), ratio(rss["delta"], d), ""])
    print(table(["workload", "value"], [[k, v] for k, v in summ.items()],
                title=f"## workload: {args.workload} {p if args.workload == 'anchor' else ''}"))
    print()
    print(table(["measurement", "bytes", "B/entry", "B/node", "target"], rows,
                title=f"## memory ({entries:,} resident entries, {nodes:,} nodes in our index{check}; "
                      f"one fresh process per figure)"))


if __name__ == "__main__":
    main()
