"""What recording costs (``docs/record.md``): ingest throughput and query latency of one
index, recorded and not.

* **ingest**: the anchor workload (``workload.py``; default 8 workers x 500 sequences x
  64 blocks) applied as the live ingest applies it, ``PrefixIndex.apply_sequenced`` per
  vLLM 0.33 payload, on a fresh index; batches/s. Recorded: a :class:`Recorder` attached
  and its writer thread running (encoding, hashing the payloads' token ids away in
  ``hashed`` mode, writing to a temporary directory) for the whole run; the time to write
  what is still queued when the last batch is applied is shown apart (``drain``).
* **match** (the service's ``/v1/match`` door, ``match_plain``) and **route** (``route``
  with ``max_tokens``, then its ``route_done``): per-call latency of 1,024-token prompts
  on the index just built, median and p99 per run.

The GIL switch interval is the service's (0.2 ms) unless ``--switch-interval`` says. Runs alternate off/on (``--runs`` each, default 3); each figure is the median of the
runs with their min-max spread, and the cost is (on - off) / off of the medians. Figures
are reported, never asserted.

    .venv/bin/python benchmarks/bench_record.py [--runs 3] [--seqs 500] [--tokens hashed|full|none]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402
from _report import header, lat_stats_us, spread, table  # noqa: E402

from indexer import PrefixIndex  # noqa: E402
from indexer.ingest.record import Recorder  # noqa: E402


def ingest(items, recorded: bool, tokens: str) -> dict:
    idx = PrefixIndex()
    rec = None
    with tempfile.TemporaryDirectory(prefix="kvi-bench-rec-") as d:
        if recorded:
            rec = Recorder(d, tokens=tokens)
            rec.attach(idx)
            rec.start()
        apply = idx.apply_sequenced
        t0 = time.perf_counter()
        for eng, seq, pl in items:
            apply(eng, pl, seq=seq)
        t1 = time.perf_counter()
        drain = 0.0
        written = 0
        if rec is not None:
            rec.flush()
            drain = time.perf_counter() - t1
            rec.stop()
            written = rec.bytes_written
    return {"idx": idx, "batches_s": len(items) / (t1 - t0), "drain_s": drain, "bytes": written}


def queries(idx: PrefixIndex, prompts: list[bytes], recorded: bool, tokens: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvi-bench-rec-") as d:
        rec = None
        if recorded:
            rec = Recorder(d, tokens=tokens)
            rec.attach(idx)
            rec.start()
            rec.flush()  # the first segment's base (this whole index) written: a service's is, at its start
        ns_match, ns_route = [], []
        clock = time.perf_counter_ns
        for p in prompts:
            t0 = clock()
            idx.match_plain(p, "default")
            t1 = clock()
            r = idx.route(p, max_tokens=64)
            t2 = clock()
            idx.route_done(r["request_id"])
            ns_match.append(t1 - t0)
            ns_route.append(t2 - t1)
        if rec is not None:
            rec.stop()
    return {"match": lat_stats_us(ns_match), "route": lat_stats_us(ns_route)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_arguments(ap, seqs=500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--tokens", choices=["hashed", "full", "none"], default="hashed")
    ap.add_argument("--switch-interval", type=float, default=0.0002,
                    help="the GIL switch interval (default: the service's, api/cli/serve.py; Python's own is 0.005)")
    args = ap.parse_args()
    # As the service runs: a thread holding the GIL is asked to let go after 0.2 ms, so the
    # recording's writer never holds a query long; the price is more handoffs between threads.
    sys.setswitchinterval(args.switch_interval)
    header("recording cost: ingest throughput and query latency, recorded vs not", args)
    p = wl.params_from_args(args)
    events = wl.load_events("anchor", p)
    names = [wl.engine_name(w) for w in range(len(events))]
    items = [(names[w], seq, pl) for w, seq, pl in wl.interleave(wl.encode_payloads(events, p.block_size, 1))]
    from indexer.wire.keys import tokens_to_bytes

    qs = wl.anchor_queries(p, 1024)
    prompts = [tokens_to_bytes(t) for t in list(qs.values())[: args.queries]]
    while len(prompts) < args.queries:
        prompts += prompts[: args.queries - len(prompts)]
    res: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    extra = {"drain": [], "bytes": []}
    for _ in range(args.runs):
        for on in (False, True):
            r = ingest(items, on, args.tokens)
            res[on].setdefault("ingest", []).append(r["batches_s"])
            if on:
                extra["drain"].append(r["drain_s"])
                extra["bytes"].append(r["bytes"])
            q = queries(r["idx"], prompts, on, args.tokens)
            for k in ("match", "route"):
                res[on].setdefault(f"{k}_med", []).append(q[k]["median_us"])
                res[on].setdefault(f"{k}_p99", []).append(q[k]["p99_us"])
            r["idx"].close()
    rows = []
    for key, what, unit in (("ingest", "ingest (apply_sequenced)", "batches/s"),
                            ("match_med", "match_plain 1,024 tokens, median", "us"),
                            ("match_p99", "match_plain 1,024 tokens, p99", "us"),
                            ("route_med", "route 1,024 tokens, median", "us"),
                            ("route_p99", "route 1,024 tokens, p99", "us")):
        off, on = spread(res[False][key]), spread(res[True][key])
        cost = (on["median"] - off["median"]) / off["median"] * 100
        if key == "ingest":
            cost = -cost  # lower throughput is the cost
        rows.append([what, unit, f"{off['median']:.1f} ({off['min']:.1f}-{off['max']:.1f})",
                     f"{on['median']:.1f} ({on['min']:.1f}-{on['max']:.1f})", f"{cost:+.1f}%"])
    print(table(["figure", "unit", "not recorded: median (min-max)", f"recorded ({args.tokens})", "cost"], rows,
                title=f"## {len(items):,} batches, {args.queries:,} queries, {args.runs} runs each, alternating"))
    d = spread(extra["drain"])
    b = spread(extra["bytes"])
    print(f"\nafter the last batch, the writer needed {d['median'] * 1000:.0f} ms (median; "
          f"{d['min'] * 1000:.0f}-{d['max'] * 1000:.0f}) to write what was queued; "
          f"{b['median'] / 1e6:.1f} MB recorded for the ingest run")


if __name__ == "__main__":
    main()
