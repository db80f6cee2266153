"""Query throughput and latency with many concurrent keep-alive clients: our service and
NVIDIA Dynamo's standalone indexer, side by side, at their defaults.

Both servers are started and fed as ``bench_services.py`` starts and feeds them (the same
workload: ``--entries`` over 8 engines' real ZMQ PUB sockets; ours ``kv-indexer serve``,
one event loop; Dynamo ``python -m dynamo.indexer`` from ``.venv-dynamo``, 4 threads). Then
the load generator is ``wrk`` (Debian's package: compiled, event-driven, one connection per
client kept alive), ``--threads`` threads, for ``--seconds`` per point, POSTing the same
1,024-token body every engine holds whole (the most work per answer):

* ``/query`` on both (Dynamo's route; ours implements it), and ``/v1/route`` on ours (the
  full route, dry: ``record`` false, so the in-flight view stays empty);
* at ``--clients`` concurrent connections (default 1, 16, 64, 256).

Reported per point: requests/s, wrk's p50 and p99 latency, and wrk's own CPU (user + system
over the run, % of one core): on this 2-vCPU VM wrk shares the cores with the server, so its
CPU says how much of the machine the load itself took. Each point is the median of
``--runs`` (default 3) runs, the two servers alternating within a run, with [min-max].
Figures are reported, never asserted.

    apt-get install wrk
    .venv/bin/python benchmarks/bench_concurrency.py [--entries 1000000] [--runs 3] [--clients 1 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_services as bs  # noqa: E402
from _report import header, peer_available, table  # noqa: E402

_UNIT = {"us": 1.0, "ms": 1e3, "s": 1e6}


def wrk(port: int, path: str, body: bytes, clients: int, threads: int, seconds: float) -> dict:
    """One wrk run: requests/s, p50 and p99 (us), wrk's CPU (% of one core)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(body.decode())}\n")
        script = f.name
    try:
        cmd = ["wrk", "-t", str(min(threads, clients)), "-c", str(clients), "-d", f"{seconds:g}s", "--latency",
               "-s", script, f"http://127.0.0.1:{port}{path}"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.perf_counter()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out = p.stdout.read() if p.stdout else ""
        p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        os.unlink(script)
    if p.returncode != 0:
        raise RuntimeError(f"wrk failed: {out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if errors:
        raise RuntimeError(f"{path} answered {errors.group(1)} errors at {clients} clients")
    pct = {int(m.group(1)): float(m.group(2)) * _UNIT[m.group(3)]
           for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    return {"rps": rps, "p50_us": pct[50], "p99_us": pct[99],
            "wrk_cpu_pct": (ru.ru_utime + ru.ru_stime) / wall * 100}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=float, default=1e6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--threads", type=int, default=2, help="wrk threads (at most one per client)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    header("query throughput with concurrent keep-alive clients (wrk), ours and Dynamo", args)
    w = bs.Workload(int(args.entries), 8)
    body = bs.query_body(w.shared[0].tolist())
    route = json.dumps({"token_ids": w.shared[0].tolist(), "model": "default", "record": False}).encode()
    kinds = ["ours"] + ([] if args.no_peer or not peer_available() else ["dynamo"])
    points = [(k, "/query", body) for k in kinds] + [("ours", "/v1/route", route)]
    res: dict[tuple[str, str, int], list[dict]] = {}
    for r in range(args.runs):
        with ExitStack() as up:
            ports = {}
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                srv, c, pubs, path = up.enter_context(bs.serving(kind, w.workers, "/query"))
                bs.ingest(c, pubs, w, path)
                ports[kind] = c.conn.port
            for clients in args.clients:
                for kind, path, req in (points if r % 2 == 0 else points[::-1]):
                    fig = wrk(ports[kind], path, req, clients, args.threads, args.seconds)
                    res.setdefault((kind, path, clients), []).append(fig)
                    print(f"[run {r + 1}] {kind:6} {path:10} {clients:4} clients: {fig['rps']:9,.0f} req/s, "
                          f"p50 {fig['p50_us']:8.0f} us, p99 {fig['p99_us']:8.0f} us, wrk CPU {fig['wrk_cpu_pct']:.0f}%",
                          flush=True)

    def med(kind: str, path: str, clients: int, key: str) -> tuple[float, str]:
        xs = [f[key] for f in res.get((kind, path, clients), [])]
        if not xs:
            return float("nan"), "-"
        m = statistics.median(xs)
        return m, f"{m:,.0f} [{min(xs):,.0f}-{max(xs):,.0f}]"

    rows = []
    for clients in args.clients:
        o, os_ = med("ours", "/query", clients, "rps")
        d, ds = med("dynamo", "/query", clients, "rps")
        op, ops = med("ours", "/query", clients, "p99_us")
        dp, dps = med("dynamo", "/query", clients, "p99_us")
        _, rts = med("ours", "/v1/route", clients, "rps")
        _, rtp = med("ours", "/v1/route", clients, "p99_us")
        _, cpu = med("ours", "/query", clients, "wrk_cpu_pct")
        rows.append([clients, os_, ds, f"{o / d:.2f}x" if d == d else "-", ops, dps,
                     f"{op / dp:.2f}x" if dp == dp else "-", rts, rtp, cpu])
    print(table(["clients", "ours /query req/s", "Dynamo /query req/s", "ratio", "ours p99 us", "Dynamo p99 us",
                 "p99 ratio", "ours /v1/route req/s", "/v1/route p99 us", "wrk CPU % (ours /query)"], rows,
                title=f"## {w.entries:,} entries, 8 engines, wrk -t {args.threads}, {args.seconds:g} s a point, "
                      f"medians of {args.runs} runs [min-max]"))


if __name__ == "__main__":
    main()
