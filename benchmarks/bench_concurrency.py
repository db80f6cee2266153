"""Query throughput and latency with many concurrent keep-alive clients: our service and
NVIDIA Dynamo's standalone indexer, side by side, at their defaults.

Both servers are started and fed as ``bench_services.py`` starts and feeds them (the same
workload: ``--entries`` over 8 engines' real ZMQ PUB sockets; ours ``kv-indexer serve``,
one event loop; Dynamo ``python -m dynamo.indexer`` from ``.venv-dynamo``, 4 threads). Then
a compiled load generator (``--tool``: ``h2load``, nghttp2's, by default, or ``wrk``; both
Debian packages, event-driven, one connection per client kept alive), ``--threads``
threads, for ``--seconds`` per point, POSTs the same 1,024-token body every engine holds
whole (the most work per answer):

* ``/query`` on both (Dynamo's route; ours implements it), and ``/v1/route`` on ours (the
  full route, dry: ``record`` false, so the in-flight view stays empty);
* at ``--clients`` concurrent connections (default 1, 16, 64, 256).

Reported per point: requests/s, p50 and p99 latency, and the load generator's own CPU
(user + system over the run, % of one core): on this 2-vCPU VM it shares the cores with the
server, so its CPU says how much of the machine the load itself took. h2load's latencies are
read from its per-request log (``--log-file``: every request of the measured period, after
a 1 s warm-up); wrk's from its ``--latency`` percentiles.

Each point also checks its latencies against Little's law: with every client keeping one
request outstanding, the mean latency is ``clients / (requests/s)``. The column ``mean /
law`` is the measured mean over that; far from 1.0, the tool's latencies are not the
server's. (wrk 4.1's, with two threads and 256 connections, read ~3x the law against our
server while its requests/s held: its p99 of 0.5-1.3 s there was wrk's, not the server's;
h2load's, on the same server and points, are within a few percent of it.)

Each point is the median of ``--runs`` (default 3) runs, the two servers alternating within a
run, with [min-max]. Figures are reported, never asserted.

    apt-get install nghttp2-client    # h2load; or wrk, with --tool wrk
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


def _run(cmd: list[str]) -> tuple[str, float]:
    """Run the load generator: its output and its CPU (user + system) as % of one core."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.perf_counter()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    out = p.stdout.read() if p.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[0]} failed: {out}")
    return out, (ru.ru_utime + ru.ru_stime) / wall * 100


def wrk(port: int, path: str, body: bytes, clients: int, threads: int, seconds: float) -> dict:
    """One wrk run: requests/s, mean, p50 and p99 (us), wrk's CPU (% of one core)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(body.decode())}\n")
        script = f.name
    try:
        out, cpu = _run(["wrk", "-t", str(min(threads, clients)), "-c", str(clients), "-d", f"{seconds:g}s",
                         "--latency", "-s", script, f"http://127.0.0.1:{port}{path}"])
    finally:
        os.unlink(script)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if errors:
        raise RuntimeError(f"{path} answered {errors.group(1)} errors at {clients} clients")
    pct = {int(m.group(1)): float(m.group(2)) * _UNIT[m.group(3)]
           for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    mean = re.search(r"^\s+Latency\s+([\d.]+)(us|ms|s)", out, re.M)
    return {"rps": rps, "mean_us": float(mean.group(1)) * _UNIT[mean.group(2)],  # type: ignore[union-attr]
            "p50_us": pct[50], "p99_us": pct[99], "tool_cpu_pct": cpu}


def h2load(port: int, path: str, body: bytes, clients: int, threads: int, seconds: float) -> dict:
    """One h2load run (HTTP/1.1): requests/s, mean, p50 and p99 (us) of every request of the
    measured period (its per-request log), h2load's CPU (% of one core)."""
    with tempfile.TemporaryDirectory(prefix="kvi-h2load-") as d:
        data, log = Path(d) / "body.json", Path(d) / "requests.log"
        data.write_bytes(body)
        out, cpu = _run(["h2load", "--h1", "-t", str(min(threads, clients)), "-c", str(clients),
                         "-D", f"{seconds:g}", "--warm-up-time=1", "-d", str(data),
                         "-H", "Content-Type: application/json", f"--log-file={log}",
                         f"http://127.0.0.1:{port}{path}"])
        # One line per request: start (us since the epoch), status, microseconds to its end.
        rows = [line.split("\t") for line in log.read_text().splitlines()]
    bad = sum(1 for r in rows if not r[1].startswith("2"))
    done = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded", out)
    if bad or done is None or done.group(2) != done.group(3):
        raise RuntimeError(f"{path} at {clients} clients: {bad} non-2xx answers; {out[-600:]}")
    lat = sorted(int(r[2]) for r in rows)
    n = len(lat)
    rps = float(re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
    return {"rps": rps, "mean_us": sum(lat) / n, "p50_us": float(lat[n // 2]),
            "p99_us": float(lat[min(n - 1, int(n * 0.99))]), "tool_cpu_pct": cpu}


TOOLS = {"h2load": h2load, "wrk": wrk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=float, default=1e6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--threads", type=int, default=2, help="load generator threads (at most one per client)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--tool", choices=sorted(TOOLS), default="h2load", help="the load generator")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    args = ap.parse_args()
    if shutil.which(args.tool) is None:
        sys.exit(f"{args.tool} not found: apt-get install {'nghttp2-client' if args.tool == 'h2load' else 'wrk'}")
    load = TOOLS[args.tool]
    header(f"query throughput with concurrent keep-alive clients ({args.tool}), ours and Dynamo", args)
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
                    fig = load(ports[kind], path, req, clients, args.threads, args.seconds)
                    fig["law"] = fig["mean_us"] / (clients / fig["rps"] * 1e6)
                    res.setdefault((kind, path, clients), []).append(fig)
                    print(f"[run {r + 1}] {kind:6} {path:10} {clients:4} clients: {fig['rps']:9,.0f} req/s, "
                          f"p50 {fig['p50_us']:8.0f} us, p99 {fig['p99_us']:8.0f} us, mean/law {fig['law']:.2f}, "
                          f"{args.tool} CPU {fig['tool_cpu_pct']:.0f}%", flush=True)

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
        _, cpu = med("ours", "/query", clients, "tool_cpu_pct")
        laws = (med(k, "/query", clients, "law")[0] for k in ("ours", "dynamo"))
        law = "/".join(f"{m:.2f}" if m == m else "-" for m in laws)  # nan: no such runs
        rows.append([clients, os_, ds, f"{o / d:.2f}x" if d == d else "-", ops, dps,
                     f"{op / dp:.2f}x" if dp == dp else "-", rts, rtp, cpu, law])
    print(table(["clients", "ours /query req/s", "Dynamo /query req/s", "ratio", "ours p99 us", "Dynamo p99 us",
                 "p99 ratio", "ours /v1/route req/s", "/v1/route p99 us", f"{args.tool} CPU % (ours /query)",
                 "mean / law (ours/Dynamo)"], rows,
                title=f"## {w.entries:,} entries, 8 engines, {args.tool} -t {args.threads}, {args.seconds:g} s a point, "
                      f"medians of {args.runs} runs [min-max]"))


if __name__ == "__main__":
    main()
