"""What recording costs (``docs/record.md``): ingest throughput and query latency of one
index, recorded and not.

* **ingest**: the anchor workload (``workload.py``; default 8 workers x 500 sequences x
  64 blocks) applied as the live ingest applies it, ``PrefixIndex.apply_sequenced`` per
  vLLM 0.33 payload, on a fresh index; batches/s. Recorded: a :class:`Recorder` attached
  and its writer thread running (encoding, hashing the payloads' token ids away in
  ``hashed`` mode, writing to a temporary directory) for the whole run; the time to write
  what is still queued when the last batch is applied is shown apart (``drain``).
* **match_plain** (the service's ``/query`` and ``/v1/match`` door), **match** (the
  library's ``match()``, the prompt as a list of token ids) and **route** (the library's
  ``route()`` with ``max_tokens``, then its ``route_done``): per-call latency of 1,024-token
  prompts on the index just built, median and p99 per run.

The GIL switch interval is the service's (0.2 ms) unless ``--switch-interval`` says.

``--service``: the same question asked of ``kv-indexer serve`` as users run it, two
processes at their defaults, one with ``KVI_RECORD_DIR`` set (``--tokens`` as
``KVI_RECORD_TOKENS``), fed and queried as ``bench_services.py`` feeds and queries them
(``--entries``, default 10^6, over 8 engines' real ZMQ PUB sockets): *ingest* blocks/s
until every engine's last sequence matches, each server alone (the order alternating by
run); then *query* latency of ``/query`` (Dynamo's route, a match) and ``/v1/route`` of
1,024 tokens, in slices alternating between the two servers.

Runs alternate off/on (``--runs`` each, default 3); each figure is the median of the
runs with their min-max spread; the cost is (on - off) / off of the medians, and beside it
the median (and range) of each run's own cost, its recorded figure against the same run's
unrecorded one, which this VM's drift between runs moves less. Figures are reported,
never asserted.

    .venv/bin/python benchmarks/bench_record.py [--runs 3] [--seqs 500] [--tokens hashed|full|none]
    .venv/bin/python benchmarks/bench_record.py --service [--entries 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
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


def queries(idx: PrefixIndex, prompts: list[bytes], token_lists: list[list[int]], recorded: bool, tokens: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvi-bench-rec-") as d:
        rec = None
        if recorded:
            rec = Recorder(d, tokens=tokens)
            rec.attach(idx)
            rec.start()
            rec.flush()  # the first segment's base (this whole index) written: a service's is, at its start
        ns_plain, ns_match, ns_route = [], [], []
        clock = time.perf_counter_ns
        for p, t in zip(prompts, token_lists, strict=True):
            t0 = clock()
            idx.match_plain(p, "default")
            t1 = clock()
            idx.match(t)
            t2 = clock()
            r = idx.route(p, max_tokens=64)
            t3 = clock()
            idx.route_done(r["request_id"])
            ns_plain.append(t1 - t0)
            ns_match.append(t2 - t1)
            ns_route.append(t3 - t2)
        if rec is not None:
            rec.stop()
    return {"plain": lat_stats_us(ns_plain), "match": lat_stats_us(ns_match), "route": lat_stats_us(ns_route)}


def service(args) -> None:
    """``--service``: ingest and query latency of two ``serve`` processes, one recording."""
    import bench_services as bs

    w = bs.Workload(args.entries, 8)
    body = bs.query_body(w.shared[0].tolist())  # held whole by every engine
    route = json.dumps({"token_ids": w.shared[0].tolist(), "model": "default"}).encode()
    figs: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    written = []
    for r in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvi-bench-rec-", dir=args.dir) as d, bs.ExitStack() as up:
            live: dict[str, tuple] = {}
            for kind in (("off", "on") if r % 2 == 0 else ("on", "off")):
                env = {"KVI_RECORD_DIR": d, "KVI_RECORD_TOKENS": args.tokens} if kind == "on" else {}
                old = {k: os.environ.get(k) for k in ("KVI_RECORD_DIR", "KVI_RECORD_TOKENS")}
                os.environ.update(env)
                try:
                    srv, c, pubs, _ = up.enter_context(bs.serving("ours", w.workers, "/query"))
                finally:
                    for k, v in old.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                bs.warm_memory(w.entries)
                cpu0 = bs.tree_cpu(srv.pid)
                secs = bs.ingest(c, pubs, w, "/query")
                figs[kind].setdefault("ingest", []).append(w.entries / secs)
                figs[kind].setdefault("cpu", []).append((bs.tree_cpu(srv.pid) - cpu0) / w.entries * 1e6)
                live[kind] = (c, "/query")
                print(f"[run {r + 1} {kind:3}] ingest {w.entries / secs:,.0f} blocks/s", flush=True)
            for name, path, req in (("query", "/query", body), ("route", "/v1/route", route)):
                lat = bs.interleaved_latency({k: (c, path) for k, (c, _) in live.items()}, req, args.calls, 200)
                for kind, (med, p99) in lat.items():
                    figs[kind].setdefault(f"{name}_med", []).append(med)
                    figs[kind].setdefault(f"{name}_p99", []).append(p99)
            written.append(sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()))
    rows = []
    for key, what, unit in (("ingest", "ingest, 8 engines over ZMQ", "blocks/s"),
                            ("cpu", "server CPU during the ingest (all threads)", "us/block"),
                            ("query_med", "/query 1,024 tokens, median", "us"),
                            ("query_p99", "/query 1,024 tokens, p99", "us"),
                            ("route_med", "/v1/route 1,024 tokens, median", "us"),
                            ("route_p99", "/v1/route 1,024 tokens, p99", "us")):
        rows.append(_row(figs["off"][key], figs["on"][key], what, unit, key == "ingest", 3 if key == "cpu" else 1))
    print(table(["figure", "unit", "not recorded: median (min-max)", f"recorded ({args.tokens})", "cost",
                 "cost per run: median (min to max)"], rows,
                title=f"## serve, {w.entries:,} entries, {args.calls:,} calls a route, {args.runs} runs each"))
    print(f"\nrecorded {spread(written)['median'] / 1e6:.1f} MB a run (median)")


def _row(off_xs: list[float], on_xs: list[float], what: str, unit: str, higher_better: bool, digits: int = 1) -> list:
    off, on = spread(off_xs), spread(on_xs)
    cost = (on["median"] - off["median"]) / off["median"] * 100
    if higher_better:
        cost = -cost  # lower throughput is the cost
    f = f".{digits}f"
    # Paired: each run's on against the same run's off. This VM's speed drifts by 20-30%
    # between runs (medians of one server's runs spread 170-250 us); a run's two servers
    # share its drift, so the median of the per-run costs is the steadier figure.
    sign = -1 if higher_better else 1
    paired = spread([sign * (b - a) / a * 100 for a, b in zip(off_xs, on_xs, strict=True)])
    return [what, unit, f"{off['median']:{f}} ({off['min']:{f}}-{off['max']:{f}})",
            f"{on['median']:{f}} ({on['min']:{f}}-{on['max']:{f}})", f"{cost:+.1f}%",
            f"{paired['median']:+.1f}% ({paired['min']:+.1f} to {paired['max']:+.1f})"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_arguments(ap, seqs=500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--tokens", choices=["hashed", "full", "none"], default="hashed")
    ap.add_argument("--switch-interval", type=float, default=0.0002,
                    help="the GIL switch interval (default: the service's, api/cli/serve.py; Python's own is 0.005)")
    ap.add_argument("--service", action="store_true", help="measure two serve processes instead (see above)")
    ap.add_argument("--entries", type=int, default=1_000_000, help="--service: resident entries ingested")
    ap.add_argument("--calls", type=int, default=4000, help="--service: timed calls per route")
    ap.add_argument("--dir", default=None, help="--service: where the recording goes (default: the temp dir)")
    args = ap.parse_args()
    if args.service:
        header("recording cost: the service's ingest and query latency, recorded vs not", args)
        service(args)
        return
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
    token_lists = list(qs.values())[: args.queries]
    while len(token_lists) < args.queries:
        token_lists += token_lists[: args.queries - len(token_lists)]
    prompts = [tokens_to_bytes(t) for t in token_lists]
    res: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    extra = {"drain": [], "bytes": []}
    for _ in range(args.runs):
        for on in (False, True):
            r = ingest(items, on, args.tokens)
            res[on].setdefault("ingest", []).append(r["batches_s"])
            if on:
                extra["drain"].append(r["drain_s"])
                extra["bytes"].append(r["bytes"])
            q = queries(r["idx"], prompts, token_lists, on, args.tokens)
            for k in ("plain", "match", "route"):
                res[on].setdefault(f"{k}_med", []).append(q[k]["median_us"])
                res[on].setdefault(f"{k}_p99", []).append(q[k]["p99_us"])
            r["idx"].close()
    rows = []
    for key, what, unit in (("ingest", "ingest (apply_sequenced)", "batches/s"),
                            ("plain_med", "match_plain 1,024 tokens, median", "us"),
                            ("plain_p99", "match_plain 1,024 tokens, p99", "us"),
                            ("match_med", "match 1,024 tokens, median", "us"),
                            ("match_p99", "match 1,024 tokens, p99", "us"),
                            ("route_med", "route 1,024 tokens, median", "us"),
                            ("route_p99", "route 1,024 tokens, p99", "us")):
        rows.append(_row(res[False][key], res[True][key], what, unit, key == "ingest"))
    print(table(["figure", "unit", "not recorded: median (min-max)", f"recorded ({args.tokens})", "cost",
                 "cost per run: median (min to max)"], rows,
                title=f"## {len(items):,} batches, {args.queries:,} queries, {args.runs} runs each, alternating"))
    d = spread(extra["drain"])
    b = spread(extra["bytes"])
    print(f"\nafter the last batch, the writer needed {d['median'] * 1000:.0f} ms (median; "
          f"{d['min'] * 1000:.0f}-{d['max'] * 1000:.0f}) to write what was queued; "
          f"{b['median'] / 1e6:.1f} MB recorded for the ingest run")


if __name__ == "__main__":
    main()
