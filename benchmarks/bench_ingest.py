"""End-to-end live ingest: publisher processes -> loopback ZMQ -> Indexer -> PrefixIndex.

What is measured:

* ``--publishers`` separate processes (default: one per worker of the workload),
  each a :class:`indexer.producer.publisher.VllmPublisher` (vLLM's frames, sequence
  numbers and replay socket) that sends its worker's pre-encoded vLLM 0.33 batch
  payloads back to back, all at once, over ``tcp://127.0.0.1``;
* one :class:`indexer.ingest.live.Indexer` in this process, subscribed to all of them;
* the clock runs from the "go" signal to the moment the index has applied every
  batch (``stats()`` batch counter and resident entries equal to the stream's),
  with no loss (publisher HWM unbounded; any gap would trigger a replay, counted).
* ``--queries``: a second thread issues ``match`` calls (1,024-token prompts) at
  ``--qps`` per second the whole time and reports their latency (median, p99,
  max) under that load, and the ingest figure with queries running.

Target: >= 1,000,000 blocks/s end to end on this 2-core machine.

    .venv/bin/python benchmarks/bench_ingest.py [--quick] [--events-per-batch N] [--queries]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402
from _report import header, table  # noqa: E402

from indexer.ingest.live import Indexer  # noqa: E402
from indexer.producer.publisher import VllmPublisher  # noqa: E402

TARGET = 1_000_000


def _publisher(payloads: list, conn, replay: bool, cpu: int) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    pub = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*" if replay else None, hwm=0)
    conn.send((pub.live_endpoint, pub.bound_replay_endpoint))
    conn.recv()  # go
    pub.publish_many(payloads)
    conn.send("sent")
    conn.recv()  # done: keep the sockets open until the indexer has everything
    pub.close()


def run(per_worker: list[list[bytes]], total_blocks: int, queries: list[list[int]] | None,
        qps: float = 2000.0, timeout: float = 120.0, pub_cpu: int = -1):
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for payloads in per_worker:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_publisher, args=(payloads, b, True, pub_cpu), daemon=True)
        p.start()
        conns.append(a)
        procs.append(p)
    endpoints = [c.recv() for c in conns]
    ix = Indexer(rcvhwm=0)
    for w, (live, replay) in enumerate(endpoints):
        ix.add_engine(id=wl.engine_name(w), endpoint=live.replace("0.0.0.0", "127.0.0.1"),
                      replay_endpoint=replay.replace("0.0.0.0", "127.0.0.1"))
    ix.start()
    deadline = time.monotonic() + 10
    while not all(w.get("connected") for w in ix.workers()):
        if time.monotonic() > deadline:
            raise RuntimeError("publishers did not connect")
        time.sleep(0.01)
    time.sleep(0.2)  # let the SUB subscriptions reach every PUB (slow joiner)
    n_batches = sum(len(x) for x in per_worker)
    lat: list[int] = []
    stop_q = threading.Event()

    def query_loop() -> None:
        # Paced at ``qps`` (a router's request rate), not back to back: latency is
        # what a request sees while ingest runs flat out.
        i = 0
        period = 1.0 / qps
        nxt = time.perf_counter()
        while not stop_q.is_set():
            q = queries[i % len(queries)]
            i += 1
            t = time.perf_counter_ns()
            try:
                ix.match(q)
            except KeyError:  # the model is not known before the first batch
                pass
            lat.append(time.perf_counter_ns() - t)
            nxt += period
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    qt = threading.Thread(target=query_loop, daemon=True) if queries else None
    t0 = time.perf_counter()
    for c in conns:
        c.send("go")
    if qt:
        qt.start()
    done_at = None
    counter = ix.index.counter  # lock-free: polling stats() would compete with ingest
    while time.perf_counter() - t0 < timeout:
        if counter("batches_applied") >= n_batches:
            done_at = time.perf_counter()
            break
        time.sleep(0.002)
    stop_q.set()
    if qt:
        qt.join()
    for c in conns:
        c.recv()
        c.send("done")
    for p in procs:
        p.join(5)
    s = ix.stats()
    ws = ix.workers()
    ix.stop()
    ix.index.close()
    if done_at is None:
        raise RuntimeError(f"timed out: {s['counters'].get('batches_applied', 0)} of {n_batches} batches applied")
    dt = done_at - t0
    return {
        "seconds": dt,
        "blocks_s": total_blocks / dt,
        "batches_s": n_batches / dt,
        "entries": s["resident_entries"],
        "replays": sum(w.get("replays_ok", 0) + w.get("replays_failed", 0) for w in ws),
        "stale": sum(1 for w in ws if w["stale"]),
        "lat": sorted(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_arguments(ap)
    ap.add_argument("--quick", action="store_true", help="a small workload (8 x 200 sequences), one run")
    ap.add_argument("--cpu", type=int, default=-1, help="pin this process to a CPU (-1: no pinning)")
    ap.add_argument("--events-per-batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--queries", action="store_true", help="also run a query thread during ingest")
    ap.add_argument("--qps", type=float, default=2000.0, help="query rate of that thread (default 2000/s)")
    ap.add_argument("--split-cpus", action="store_true",
                    help="publisher processes pinned to CPU 1 and the indexer to CPU 0 (as if the engines ran "
                         "elsewhere)")
    ap.add_argument("--pin-publishers", action="store_true",
                    help="publisher processes pinned to CPU 1, the indexer free to use both CPUs")
    args = ap.parse_args()
    if args.quick:
        args.seqs, args.runs = 200, 1
    pub_cpu = -1
    if args.split_cpus:
        os.sched_setaffinity(0, {0})
    if args.split_cpus or args.pin_publishers:
        pub_cpu = 1
    p = wl.params_from_args(args)
    header("bench_ingest: end-to-end live ingest over loopback ZMQ", args)
    events = wl.load_events("anchor", p)
    per_worker = wl.encode_payloads(events, p.block_size, args.events_per_batch)
    summary = wl.summarize(events)
    total_blocks = summary["stored_blocks"] + summary["removed_blocks"]
    queries = list(wl.anchor_queries(p, 1024).values()) if args.queries else None
    rows = []
    best = None
    for mode in (["ingest only"] + (["ingest + queries"] if queries else [])):
        results = [run(per_worker, total_blocks, queries if mode != "ingest only" else None, args.qps,
                       pub_cpu=pub_cpu)
                   for _ in range(args.runs)]
        r = max(results, key=lambda x: x["blocks_s"])
        lat = r["lat"]
        med = statistics.median(lat) / 1000 if lat else None
        p99 = lat[int(len(lat) * 0.99)] / 1000 if lat else None
        rows.append([mode, round(r["blocks_s"]), round(r["batches_s"]), round(r["seconds"], 3), r["entries"],
                     r["replays"], r["stale"], len(lat) or None, med, p99, (lat[-1] / 1000) if lat else None,
                     f">= {TARGET:,}"])
        best = best or r
    print(f"## {len(per_worker)} publisher processes, {sum(len(x) for x in per_worker):,} batches "
          f"({args.events_per_batch} event(s) each), {total_blocks:,} blocks")
    print(table(["mode", "blocks/s", "batches/s", "s", "entries", "replays", "stale", "queries",
                 "q med us", "q p99 us", "q max us", "target"], rows))


if __name__ == "__main__":
    main()
