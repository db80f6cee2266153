"""Scale: apply throughput, match latency and memory as the fleet grows (8, 64, 256 workers
at about the same index size) and as the index grows (10^5 .. 10^7 resident entries over 8
workers), ours and NVIDIA Dynamo's ``RadixTree`` (``--peer``) on the same workload.

What is measured, per configuration, each side in a fresh process pinned to ``--cpu``:

* the anchor workload (``workload.py``) with ``--workers`` x ``--seqs`` sequences;
* **apply**: every store payload (vLLM 0.33, 16 events per batch), blocks per second
  (ours: ``PrefixIndex.apply`` from raw bytes; Dynamo: the same payloads decoded and
  hashed in Python, then ``apply_event``, as in ``bench_apply.py``);
* **memory**: RSS growth over the apply divided by the resident (worker, block) entries
  (ours in the apply process; Dynamo in ``peer_dynamo.py --mode memory``);
* **match**: median of 1,000 calls, a 1,024-token prompt that every worker holds whole
  (ours ``match``; Dynamo ``compute_block_hash_for_seq`` + ``find_matches``).

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--peer] [--sizes 1e5 1e6 1e7]
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload as wl  # noqa: E402
from _report import header, lat_stats_us, peer, peer_available, pin, ratio, rss_bytes, table  # noqa: E402

EPB = 16


def seqs_for(entries: float, workers: int, p: wl.Params) -> int:
    """Sequences per worker giving about ``entries`` resident entries."""
    per_worker = entries / workers
    suffix = p.blocks - p.prefix_blocks
    return max(1, round((per_worker - p.prefixes * p.prefix_blocks) / suffix)) if per_worker > 2 * p.prefixes * p.prefix_blocks \
        else max(1, round(per_worker / p.blocks))


def child(path: str, cpu: int) -> None:
    """One configuration of ours, in this fresh process: JSON on stdout. The payloads come
    from a pickle the parent wrote, so no large temporary is freed just before the
    measurement (its freed arenas would hide the index's growth from RSS)."""
    pin(cpu)
    from indexer import PrefixIndex

    with open(path, "rb") as f:
        d = pickle.load(f)
    items, query, workers = d["items"], d["query"], d["workers"]
    gc.collect()
    before = rss_bytes()
    idx = PrefixIndex()
    apply = idx.apply
    t0 = time.perf_counter()
    for eng, seq, pl in items:
        apply(eng, pl, seq=seq)
    secs = time.perf_counter() - t0
    gc.collect()
    grown = rss_bytes() - before
    st = idx.stats()
    for _ in range(100):
        idx.match(query)
    ns = []
    pc = time.perf_counter_ns
    for _ in range(1000):
        t = pc()
        idx.match(query)
        ns.append(pc() - t)
    res = idx.match(query)
    print(json.dumps({
        "entries": st["resident_entries"], "nodes": st["nodes"], "expect_entries": d["entries"],
        "blocks_s": d["stored_blocks"] / secs, "rss": grown, "match": lat_stats_us(ns),
        "matched_workers": sum(1 for w in res.workers if w.total_blocks == 64) == workers,
    }))


def run_ours(workers: int, seqs: int, cpu: int) -> dict:
    p = wl.Params(workers=workers, seqs=seqs)
    events = wl.load_events("anchor", p)
    summ = wl.summarize(events)
    names = [wl.engine_name(w) for w in range(workers)]
    with tempfile.TemporaryDirectory(prefix="kvpi-scale-") as tmp:
        path = os.path.join(tmp, "ours.pkl")
        with open(path, "wb") as f:
            pickle.dump({"items": [(names[w], seq, pl) for w, seq, pl in
                                   wl.interleave(wl.encode_payloads(events, p.block_size, EPB))],
                         "query": wl.anchor_queries(p, 1024)["full"], "workers": workers,
                         "entries": summ["resident_entries"], "stored_blocks": summ["stored_blocks"]},
                        f, protocol=pickle.HIGHEST_PROTOCOL)
        del events
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path, "--cpu", str(cpu)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer(workers: int, seqs: int, cpu: int) -> dict | None:
    from indexer.wire.keys import block_keys

    wargs = ["--cpu", str(cpu), "--workers", str(workers), "--seqs", str(seqs)]
    app = peer("apply", wargs + ["--events-per-batch", str(EPB), "--runs", "1"], timeout=7200, quiet=True)
    mat = peer("match", wargs + ["--lengths", "1024", "--calls", "1000", "--warmup", "100"], timeout=7200, quiet=True)
    p = wl.Params(workers=workers, seqs=seqs)
    events = wl.load_events("anchor", p)
    with tempfile.TemporaryDirectory(prefix="kvpi-scale-") as tmp:
        path = os.path.join(tmp, "dynamo.jsonl")
        with open(path, "wb") as f:
            per_worker = [wl.dynamo_json(evs, block_keys, p.block_size) for evs in events]
            for w, _seq, j in wl.interleave(per_worker):
                f.write(b"%d\t%s\n" % (w, j))
            del per_worker, events
        mem = peer("memory", wargs + ["--events-file", path], timeout=7200, quiet=True)
    if not (app and mat and mem):
        return None
    return {"blocks_s": app["vllm_in"]["blocks_s"], "rss": mem["rss_delta"],
            "match": mat["queries"]["1024:full"]["hash_find"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fleet 8/64 at ~10^5 entries; sizes 10^5, 10^6")
    ap.add_argument("--fleets", type=int, nargs="*", default=[8, 64, 256])
    ap.add_argument("--fleet-entries", type=float, default=776_192)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.cpu)
        return
    if args.quick:
        args.fleets, args.fleet_entries, args.sizes = [8, 64], 1e5, [1e5, 1e6]
    header("bench_scale: apply, match and memory as the fleet and the index grow", argparse.Namespace())
    base = wl.Params()
    configs = [("fleet", w, seqs_for(args.fleet_entries, w, base)) for w in args.fleets]
    configs += [("index", 8, seqs_for(n, 8, base)) for n in args.sizes]
    rows = []
    for what, workers, seqs in configs:
        t0 = time.perf_counter()
        o = run_ours(workers, seqs, args.cpu)
        d = run_peer(workers, seqs, args.cpu) if args.peer and peer_available() else None
        e = o["entries"]
        ok = "" if (e == o["expect_entries"] and o["matched_workers"]) else " (CHECK FAILED)"
        rows.append([f"{what}: {workers} x {seqs}{ok}", e, o["blocks_s"], d and d["blocks_s"],
                     d and ratio(o["blocks_s"], d["blocks_s"]), o["match"]["median_us"],
                     d and d["match"]["median_us"], d and ratio(o["match"]["median_us"], d["match"]["median_us"]),
                     o["rss"] / e, d and d["rss"] / e, d and ratio(o["rss"], d["rss"])])
        print(f"  {what} {workers} workers x {seqs} seqs: {e:,} entries ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    print(table(["config (workers x seqs)", "entries", "apply blocks/s", "Dynamo", "ours/Dyn", "match 1k med us",
                 "Dynamo", "ours/Dyn", "RSS B/entry", "Dynamo", "ours/Dyn"], rows,
                "ours vs Dynamo RadixTree (apply: >1 = ours faster; match and memory: <1 = ours better)"))


if __name__ == "__main__":
    main()
