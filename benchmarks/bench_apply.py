"""Apply throughput of ``PrefixIndex.apply`` from raw vLLM payload bytes (decode included).

What is measured, single thread, GC enabled as normal:

* **apply**: the whole workload (``workload.py``; default the Dynamo anchor
  workload: 8 workers x 2000 sequences x 64 blocks, 16,512 store batches,
  776,192 (worker, block) entries), one vLLM 0.33 batch payload per call of
  ``PrefixIndex.apply(engine, payload, seq=n)``, workers interleaved round robin.
  Blocks/s (stored + removed blocks) and batches/s, best of ``--runs`` runs, each
  on a fresh index. The time spent in the cyclic GC during the best run is shown
  separately (``gc.callbacks``).
* **remove**: removal of everything every worker holds (one ``BlockRemoved``
  batch per store it made, leaves first) on the index just built; best of the
  same runs. The index must end with 0 nodes and 0 resident entries.
* ``--events-per-batch N`` (or a list, e.g. ``1,16``) packs N consecutive events
  of a worker in one batch payload.
* ``--peer``: the same stream on NVIDIA Dynamo's in-process ``RadixTree``
  (``peer_dynamo.py`` in ``.venv-dynamo``), with the ratio ours/Dynamo.
* ``--profile``: one extra run under cProfile, top functions by own time.

Target: apply >= 1,000,000 blocks/s.

    .venv/bin/python benchmarks/bench_apply.py [--quick] [--peer] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402
from _report import (  # noqa: E402
    TARGET_APPLY_BLOCKS_S, add_cpu_argument, header, peer, peer_available, ratio, table, workload_args,
)

from indexer import PrefixIndex  # noqa: E402


class GcTimer:
    """Wall time spent inside the cyclic GC while active (via ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.collections = 0
        self._t0 = 0.0

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0
            self.collections += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def prepare(events, block_size: int, epb: int):
    names = [wl.engine_name(w) for w in range(len(events))]
    per_worker = wl.encode_payloads(events, block_size, epb)
    items = [(names[w], seq, pl) for w, seq, pl in wl.interleave(per_worker)]
    rem_per_worker = wl.encode_payloads(wl.removal_events(events), block_size, epb)
    offset = [len(x) for x in per_worker]
    rem = [(names[w], offset[w] + seq, pl) for w, seq, pl in wl.interleave(rem_per_worker)]
    return items, rem


def run_once(items, rem):
    idx = PrefixIndex()
    apply = idx.apply
    bad = 0
    with GcTimer() as g:
        t0 = time.perf_counter()
        for eng, seq, pl in items:
            if apply(eng, pl, seq=seq) != "applied":
                bad += 1
        t1 = time.perf_counter()
    after_apply = idx.stats()
    with GcTimer() as g2:
        t2 = time.perf_counter()
        for eng, seq, pl in rem:
            if apply(eng, pl, seq=seq) != "applied":
                bad += 1
        t3 = time.perf_counter()
    after_remove = idx.stats()
    return {
        "apply_s": t1 - t0, "apply_gc_s": g.total, "apply_gcs": g.collections,
        "remove_s": t3 - t2, "remove_gc_s": g2.total,
        "after_apply": after_apply, "after_remove": after_remove, "not_applied": bad,
    }


def breakdown(items, block_size: int, total_s: float) -> None:
    """Wall time of the stages of apply, timed alone without a profiler."""
    from indexer import decode_batch
    from indexer.wire.keys import block_keys

    try:
        from indexer.wire.decode import decode_tokens
    except ImportError:  # a checkout older than decode_tokens (the --src comparisons)
        decode_tokens = None
    t0 = time.perf_counter()
    batches = [decode_batch(pl) for _, _, pl in items]
    t1 = time.perf_counter()
    n_keys = 0
    t2 = t3 = 0.0
    if decode_tokens is not None:
        stores = [ev for b in batches for ev in b.events if getattr(ev, "token_ids", None) is not None]
        t2 = time.perf_counter()
        for ev in stores:
            n_keys += len(block_keys(decode_tokens(ev.token_ids), block_size))
        t3 = time.perf_counter()
    rows = [["decode_batch (msgpack -> structs)", t1 - t0, 100 * (t1 - t0) / total_s]]
    if decode_tokens is not None:
        rows.append([f"decode tokens + block_keys ({n_keys:,} keys)", t3 - t2, 100 * (t3 - t2) / total_s])
    rest = total_s - sum(r[1] for r in rows)
    rows.append(["rest: tree insert, worker maps, counters", rest, 100 * rest / total_s])
    print(table(["stage of apply (timed alone)", "s", "% of best apply"], rows,
                title=f"## where apply time goes (best apply run {total_s:.3f} s; stages re-timed separately)"))
    print()


def profile_apply(items, top: int) -> None:
    import cProfile
    import pstats

    idx = PrefixIndex()
    pr = cProfile.Profile()
    pr.enable()
    for eng, seq, pl in items:
        idx.apply(eng, pl, seq=seq)
    pr.disable()
    print(f"## cProfile of one apply run (top {top} by own time; cProfile inflates per-call costs)")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload (200 seqs/worker), fast")
    ap.add_argument("--workload", choices=("anchor", "mooncake"), default="anchor")
    ap.add_argument("--requests", type=int, default=None, help="mooncake: first N requests (3000; quick 500)")
    ap.add_argument("--capacity", type=int, default=16384, help="mooncake: LRU blocks per worker")
    ap.add_argument("--events-per-batch", default="1", help="events per batch payload, e.g. 1 or 1,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer", action="store_true", help="also run Dynamo's RadixTree (.venv-dynamo)")
    ap.add_argument("--profile", action="store_true", help="cProfile one extra apply run")
    ap.add_argument("--top", type=int, default=20)
    add_cpu_argument(ap)
    wl.add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.seqs = min(args.seqs, 200)
    if args.workload == "mooncake" and args.requests is None:
        args.requests = 500 if args.quick else 3000
    header("bench_apply: PrefixIndex.apply throughput from raw vLLM payloads", args)

    p = wl.params_from_args(args)
    events = wl.load_events(args.workload, p, mooncake_requests_n=args.requests, capacity_blocks=args.capacity)
    summ = wl.summarize(events)
    print(table(["workload", "value"], [[k, v] for k, v in summ.items()],
                title=f"## workload: {args.workload} {p if args.workload == 'anchor' else ''}"))
    print()

    rows = []
    results = {}
    ops = summ["stored_blocks"] + summ["removed_blocks"]
    for epb in [int(x) for x in args.events_per_batch.split(",")]:
        items, rem = prepare(events, p.block_size, epb)
        rem_blocks = summ["resident_entries"]
        best = None
        best_rem = None
        for _ in range(args.runs):
            gc.collect()
            r = run_once(items, rem)
            if best is None or r["apply_s"] < best["apply_s"]:
                best = r
            if best_rem is None or r["remove_s"] < best_rem["remove_s"]:
                best_rem = r
            last = r
        st, st2 = last["after_apply"], last["after_remove"]
        ok_apply = st["resident_entries"] == summ["resident_entries"] and st["nodes"] == summ["distinct_blocks"]
        ok_rem = st2["nodes"] == 0 and st2["resident_entries"] == 0
        results[epb] = {"apply": best, "remove": best_rem, "items": len(items), "rem_items": len(rem)}
        rows.append([f"apply ({epb} ev/batch)", ops / best["apply_s"], len(items) / best["apply_s"],
                     best["apply_s"], best["apply_gc_s"], f"{st['nodes']:,} nodes, {st['resident_entries']:,} entries"
                     + ("" if ok_apply else " (MISMATCH with workload)")
                     + (f", {last['not_applied']} not applied" if last["not_applied"] else ""),
                     f">= {TARGET_APPLY_BLOCKS_S:,}"])
        rows.append([f"remove all ({epb} ev/batch)", rem_blocks / best_rem["remove_s"],
                     len(rem) / best_rem["remove_s"], best_rem["remove_s"], best_rem["remove_gc_s"],
                     f"ends with {st2['nodes']} nodes, {st2['resident_entries']} entries" + ("" if ok_rem else " (NOT EMPTY)"),
                     ""])
    print(table(["ours: PrefixIndex", "blocks/s", "batches/s", "best s", "of which GC s", "check", "target"], rows,
                title=f"## ours (best of {args.runs} fresh runs; blocks = stored + removed blocks)"))
    print()

    if args.peer:
        if not peer_available():
            print("## peer: .venv-dynamo not found; run: python3 -m venv .venv-dynamo && "
                  ".venv-dynamo/bin/pip install ai-dynamo-runtime==1.6.1 msgspec xxhash")
        else:
            prow = []
            for epb, r in results.items():
                d = peer("apply", workload_args(args) + ["--events-per-batch", str(epb), "--runs", str(args.runs)])
                if d is None:
                    continue
                ours = ops / r["apply"]["apply_s"]
                ours_rem = summ["resident_entries"] / r["remove"]["remove_s"]
                prow.append([f"apply ({epb} ev/batch)", ours, d["vllm_in"]["blocks_s"],
                             ratio(ours, d["vllm_in"]["blocks_s"]), d["json_in"]["blocks_s"],
                             ratio(ours, d["json_in"]["blocks_s"])])
                prow.append([f"remove all ({epb} ev/batch)", ours_rem, None, None, d["remove"]["blocks_s"],
                             ratio(ours_rem, d["remove"]["blocks_s"])])
            if prow:
                print(table(["blocks/s", "ours", "Dynamo vLLM-in", "ours/Dyn", "Dynamo JSON-in", "ours/Dyn JSON"],
                            prow, title="## ours vs Dynamo RadixTree (same stream, same process model: one caller)"))
                print()

    if args.profile:
        epb = int(args.events_per_batch.split(",")[0])
        items, _ = prepare(events, p.block_size, epb)
        breakdown(items, p.block_size, results[epb]["apply"]["apply_s"])
        profile_apply(items, args.top)


if __name__ == "__main__":
    main()
