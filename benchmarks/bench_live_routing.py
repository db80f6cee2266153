"""Routing on the Mooncake conversation trace replayed LIVE: real ``kv-indexer serve``
processes subscribed over real ZMQ to simulated engines that prefill on the wall clock,
asked over HTTP; time to first token and cached share per policy, against an oracle run
in the same wall-clock harness (docs/routing.md has the in-process replay,
``bench_routing.py``).

What runs: ``--engines`` simulated vLLM engines in this process (``_live_fleet.LiveFleet``:
``SimEngine`` caches of ``--gpu-blocks`` blocks of 16 tokens, LRU, each behind a real
``VllmPublisher`` PUB + replay ROUTER on 127.0.0.1). Each prefills FIFO on the wall clock at
``prefill_tps x speedup`` tokens/s, computing what its cache lacks, publishes the GPU
evictions a request causes when its prefill starts and the blocks it stores when it ends
(vLLM 0.33 payloads), then decodes ``output_length`` tokens at ``40 x speedup`` tokens/s.
TTFT = prefill end - arrival, arrival being the request's scaled trace time; it includes
the routing round trip. Figures are in trace seconds (wall seconds x speedup).

The trace's timestamps are divided by ``--speedup`` (default 10: the held-back half's 27.6
trace minutes in ~166 s; ``--quick``, 1,500 requests, 48 s). A mean prefill then lasts
~140 ms of wall time and the shortest ~11 ms, against ~1-2 ms from a prefill's end to the
service applying its blocks, and a route round trip of ~3 ms alone or ~15 ms for the last
of a burst (the trace's timestamps come in steps of ~3 s, ~11 requests each; a service
routes them one after the other). The round trip counts in the TTFT, x speedup: at 20,
the HTTP policies pay ~0.15 s of trace time more than the in-process oracle. Held-back split as in bench_routing: calibration sets prefill_tps
on the first ``--split`` of the requests (oracle keeps the fleet ``--utilization`` busy,
in-process simulation, as bench_routing does), the rest is replayed live, from cold caches
and a fresh service, once per policy and run.

Policies:

* ``oracle``: in-process, sees every engine's cache and queue (``fleet_time.Oracle``);
* ``round_robin``;
* ``index``: ``POST /v1/route`` with the caller's load (each engine's queued prefill tokens);
* ``index_no_load``: ``POST /v1/route`` with no load (recorded): the service's own in-flight
  estimate, asked as bench_routing's ``index_no_load`` asks it (no ``max_tokens``);
* ``index_no_load_decode``: the same with ``max_tokens`` (the output length), and ``POST
  /v1/route/{id}/done`` when the decode ends: the service then counts the request's decode
  blocks as load, which these engines' decode never puts on a prefill;
* ``replicas3_no_load``: the same over 3 independent services, request k to replica k % 3;
* ``replicas3_sync``: the same with ``--route-sync URL|auto`` passed to every service
  (``auto``: a nats-server of our own). Needs a ``kv-indexer serve`` that has the flag.

Printed: per policy the median over ``--runs`` runs (policies interleaved within a run) and
the range [min-max] of mean and p90 TTFT, cached share (cached prompt tokens / prompt
tokens) and their ratios to the same run's oracle; the route round trip; for the no-load
policies, the service's estimate of each candidate's queued prefill tokens at each
decision against the engine's true queue when the answer arrives.

    .venv/bin/python benchmarks/bench_live_routing.py [--quick] [--runs 3] [--route-sync auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from array import array
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _live_fleet import HttpPool, LiveFleet, Nats, Service, wait_subscribed  # noqa: E402
from _report import header, percentile, spread, table  # noqa: E402

from indexer.producer.fleet_time import Oracle  # noqa: E402
from indexer.producer.sim import TRACE, trace_tokens  # noqa: E402

POLICIES = ("oracle", "round_robin", "index", "index_no_load", "index_no_load_decode", "replicas3_no_load")
HTTP = {"index": 1, "index_no_load": 1, "index_no_load_decode": 1, "replicas3_no_load": 3, "replicas3_sync": 3}
NO_LOAD = ("index_no_load", "index_no_load_decode", "replicas3_no_load", "replicas3_sync")
DECODE = ("index_no_load_decode",)  # send max_tokens, and /done when the decode ends
TARGET_TTFT, TARGET_SHARE = 1.15, 0.95
DECODE_TPS = 40.0  # trace time, as bench_routing's simulator


class Item(NamedTuple):
    t: float  # arrival, trace seconds
    hash_ids: list[int]
    n: int  # prompt tokens
    output_length: int


class Prepared(NamedTuple):
    """A request made before the replay, so the driver only sends it: its tokens (2 bytes
    each) and the start of its /v1/route body (``{"token_ids":[...]``)."""

    t: float
    tokens: array[int]
    output_length: int
    body_head: bytes


def prepare(items: list[Item]) -> list[Prepared]:
    out = []
    for it in items:
        tok = trace_tokens(it.hash_ids, it.n)
        out.append(Prepared(it.t, array("H", tok), it.output_length,
                            b'{"token_ids":' + json.dumps(tok, separators=(",", ":")).encode()))
    return out


def load_trace(limit: int | None) -> list[Item]:
    """The trace's requests, tokens made when needed (the whole trace's token lists would
    take ~5 GB)."""
    out = []
    with open(TRACE) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            d = json.loads(line)
            out.append(Item(d["timestamp"] / 1000.0, d["hash_ids"], d["input_length"], d["output_length"]))
    return out


def _calibrate(args: tuple[int, int, int, float]) -> tuple[float, list[str]]:
    from bench_routing import calibrate

    from indexer.producer.sim import trace_requests

    cut, engines, gpu_blocks, utilization = args
    cal = list(trace_requests(limit=cut))
    return calibrate(cal, engines, utilization, gpu_blocks=gpu_blocks, event_delay_s=0.05)


def calibrate_tps(cut: int, args: argparse.Namespace) -> tuple[float, list[str]]:
    """bench_routing's calibration of the calibration part, in a child (its token lists
    are large; the memory goes back when it exits)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as ex:
        return ex.submit(_calibrate, (cut, args.engines, args.gpu_blocks, args.utilization)).result()


# ------------------------------------------------------------------ one replay


class Run:
    """One policy's live replay of ``items`` on a fresh fleet (and fresh services)."""

    def __init__(self, policy: str, items: list[Prepared], args: argparse.Namespace, tps: float,
                 route_sync: str | None) -> None:
        self.policy, self.items, self.args, self.route_sync = policy, items, args, route_sync
        self.speedup = args.speedup
        self.fleet = LiveFleet(args.engines, tps=tps * args.speedup, decode_tps=DECODE_TPS * args.speedup,
                               gpu_blocks=args.gpu_blocks)
        self.pool = HttpPool()
        self.threads = ThreadPoolExecutor(args.threads)
        self.ttft: list[float] = []
        self.prompt = self.hit = 0
        self.rtt: list[float] = []  # arrival -> admitted, wall s
        self.lag: list[float] = []  # scheduled arrival -> dispatched, wall s
        self.est_err: list[int] = []  # per decision and candidate: estimated - true queued prefill tokens
        self.errors = 0
        self.rr = -1

    # -- routing -------------------------------------------------------------

    def _http_route(self, port: int, item: Prepared, load: dict | None) -> dict:
        doc: dict[str, Any] = {"model": "default", "candidates": self.fleet.names}
        if load is not None:
            doc["load"] = {w: {"active_prefill_tokens": ld[0], "active_decode_blocks": 0} for w, ld in load.items()}
        else:
            if self.policy in DECODE:
                doc["max_tokens"] = item.output_length
        body = item.body_head + b"," + json.dumps(doc, separators=(",", ":")).encode()[1:]
        st, ans = self.pool.call(port, "POST", "/v1/route", body)
        if st != 200:
            raise RuntimeError(f"/v1/route answered {st}: {ans}")
        return ans

    def _done(self, port: int, rid: str) -> None:
        try:
            self.pool.call(port, "POST", f"/v1/route/{rid}/done", b"")
        except Exception:  # noqa: BLE001 - counted, the replay goes on
            self.errors += 1

    async def one(self, k: int, item: Prepared, at: float) -> None:
        loop = asyncio.get_running_loop()
        fleet, pol = self.fleet, self.policy
        port = rid = None
        tokens = item.tokens.tolist()
        if pol == "oracle":
            w = self.oracle.choose(tokens, fleet.names, fleet.loads(loop.time()))
        elif pol == "round_robin":
            self.rr += 1
            w = fleet.names[self.rr % len(fleet.names)]
        else:
            # One route at a time per service, each admitted before the next is asked: the
            # engines get the requests in the order the service decided them, and a caller's
            # load includes the request routed just before (a burst of the trace is ~11
            # requests with one timestamp), as in bench_routing.
            port = self.ports[k % len(self.ports)]
            async with self.locks[port]:
                load = fleet.loads(loop.time()) if pol == "index" else None
                ans = await loop.run_in_executor(self.threads, self._http_route, port, item, load)
                w, rid = ans["worker"], ans.get("request_id")
                now = loop.time()
                if pol in NO_LOAD:
                    true = fleet.loads(now)
                    self.est_err.extend(e["load"]["prefill_tokens"] - true[e["worker"]][0] for e in ans["ranked"])
                done, hit, end = fleet.admit(w, tokens, item.output_length, now)
        if port is None:
            now = loop.time()
            done, hit, end = fleet.admit(w, tokens, item.output_length, now)
        self.rtt.append(now - at)
        self.ttft.append((done - at) * self.speedup)
        self.prompt += len(tokens)
        self.hit += hit
        if rid is not None and pol in DECODE:
            loop.call_at(end, lambda: self.threads.submit(self._done, port, rid))

    async def replay(self) -> None:
        loop = asyncio.get_running_loop()
        self.fleet.loop = loop
        self.oracle = Oracle(self.fleet.sims)
        self.locks = {p: asyncio.Lock() for p in self.ports}
        base = self.items[0].t
        t0 = loop.time() + 0.2
        tasks = []
        for k, item in enumerate(self.items):
            at = t0 + (item.t - base) / self.speedup
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.lag.append(max(0.0, loop.time() - at))
            tasks.append(asyncio.ensure_future(self.one(k, item, at)))
        await asyncio.gather(*tasks)

    # -- the whole run -------------------------------------------------------

    def run(self) -> dict[str, Any]:
        with ExitStack() as stack:
            stack.callback(self.fleet.close)
            stack.callback(self.threads.shutdown, wait=False, cancel_futures=True)
            self.ports: list[int] = []
            n = HTTP.get(self.policy, 0)
            extra: list[str] = []
            if self.policy == "replicas3_sync":
                if not self.route_sync:
                    raise SystemExit("replicas3_sync needs --route-sync URL|auto")
                url = self.route_sync
                if url == "auto":
                    nats = Nats()
                    stack.callback(nats.stop)
                    url = nats.url
                extra = ["--route-sync", url]
            svcs = []
            for i in range(n):
                try:
                    s = Service([*self.fleet.engine_flags(), *extra, *self.args.serve_arg], f"serve #{i}")
                except RuntimeError as e:
                    if extra and "--route-sync" in str(e):
                        raise SystemExit("kv-indexer serve of this checkout does not take --route-sync (route "
                                         f"sync between replicas has not landed here):\n{e}") from None
                    raise
                stack.callback(s.stop)
                svcs.append(s)
            self.ports = [s.port for s in svcs]
            if svcs:
                wait_subscribed(self.pool, self.ports, self.fleet)
            t = time.perf_counter()
            asyncio.run(self.replay())
            wall = time.perf_counter() - t
            stats = self.figures()
            outcomes: dict[str, int] = {}
            lags: list[float] = []
            for port in self.ports:  # how the services' routed requests ended
                st, doc = self.pool.call(port, "GET", "/v1/stats")
                for k, v in ((doc or {}).get("in_flight") or {}).get("outcomes", {}).items():
                    outcomes[k] = outcomes.get(k, 0) + v
                sync = (doc or {}).get("route_sync")
                if sync:
                    lags.append(sync["lag_mean_ms"])
            if outcomes:
                stats["outcomes"] = outcomes
            if lags:
                stats["sync_lag_mean_ms"] = statistics.fmean(lags)
            stats["wall_s"] = wall
            if self.args.keep_logs:
                for s in svcs:
                    print(f"--- {s.log_path} (tail)\n{s.output()[-1500:]}")
            return stats

    def figures(self) -> dict[str, Any]:
        tt = sorted(self.ttft)
        rtt = sorted(self.rtt)
        out: dict[str, Any] = {
            "policy": self.policy, "requests": len(tt), "ttft_mean_s": statistics.fmean(tt),
            "ttft_p90_s": percentile(tt, 90), "cached_share": self.hit / max(1, self.prompt),
            "rtt_p50_ms": percentile(rtt, 50) * 1000, "rtt_p99_ms": percentile(rtt, 99) * 1000,
            "lag_p99_ms": percentile(sorted(self.lag), 99) * 1000, "errors": self.errors,
        }
        if self.est_err:
            e = sorted(self.est_err)
            out["est_err"] = {"mean": statistics.fmean(e), "mean_abs": statistics.fmean(abs(x) for x in e),
                              "p10": percentile(e, 10), "p50": percentile(e, 50), "p90": percentile(e, 90)}
        return out


# ------------------------------------------------------------------ report


def fmt_spread(xs: list[float], f: str) -> tuple[str, str]:
    s = spread(xs)
    return format(s["median"], f), f"{format(s['min'], f)}-{format(s['max'], f)}"


def report(runs: list[dict[str, dict[str, Any]]], policies: list[str]) -> str:
    rows = []
    for p in policies:
        got = [r[p] for r in runs if p in r]
        refs = [r["oracle"] for r in runs if p in r and "oracle" in r]
        row: list[Any] = [p, len(got)]
        for key, f in (("ttft_mean_s", ".2f"), ("ttft_p90_s", ".2f"), ("cached_share", ".2%")):
            row += list(fmt_spread([g[key] for g in got], f))
        if len(refs) == len(got) and refs:
            t = [g["ttft_mean_s"] / o["ttft_mean_s"] for g, o in zip(got, refs)]
            t9 = [g["ttft_p90_s"] / o["ttft_p90_s"] for g, o in zip(got, refs)]
            c = [g["cached_share"] / o["cached_share"] if o["cached_share"] else float("nan")
                 for g, o in zip(got, refs)]
            row += [*fmt_spread(t, ".2f"), fmt_spread(t9, ".2f")[0], *fmt_spread(c, ".3f")]
            target = None
            if p.startswith(("index", "replicas")):
                target = spread(t)["median"] <= TARGET_TTFT and spread(c)["median"] >= TARGET_SHARE
            row.append(target)
        else:
            row += ["-"] * 5 + [None]
        row.append(round(spread([g["rtt_p99_ms"] for g in got])["median"], 1))
        rows.append(row)
    head = ["policy", "runs", "mean TTFT s", "range", "p90 TTFT s", "range", "cached share", "range",
            "mean/oracle", "range", "p90/oracle", "cached/oracle", "range", "target met", "route p99 ms"]
    out = [table(head, rows, "median of the runs, range [min-max]; TTFT in trace seconds")]
    est = [[p, *(round(spread([r[p]["est_err"][k] for r in runs if p in r])["median"])
                 for k in ("mean", "mean_abs", "p10", "p50", "p90"))]
           for p in policies if all("est_err" in r[p] for r in runs if p in r) and any(p in r for r in runs)]
    if est:
        out.append(table(["policy", "mean", "mean |err|", "p10", "p50", "p90"], est,
                         "\nservice's queued prefill estimate - the engine's true queue, tokens, per decision and "
                         "candidate (median of the runs)"))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 3,000 requests (1,500 replayed)")
    ap.add_argument("--requests", type=int, default=0, help="first N trace requests (0 = all 12,031)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=16384, help="per engine")
    ap.add_argument("--split", type=float, default=0.5, help="share of the requests (by arrival) that calibrate")
    ap.add_argument("--utilization", type=float, default=0.6, help="what calibration aims the oracle at")
    ap.add_argument("--prefill-tps", type=float, default=0.0, help="skip the calibration: this rate (trace time)")
    ap.add_argument("--speedup", type=float, default=10.0, help="trace time / wall time")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)}, replicas3_sync")
    ap.add_argument("--route-sync", metavar="URL|auto", help="adds replicas3_sync; auto: our own nats-server")
    ap.add_argument("--threads", type=int, default=16, help="HTTP client threads")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra argument for every serve")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    ap.add_argument("--keep-logs", action="store_true", help="print each service's log tail after its run")
    args = ap.parse_args()
    if args.quick:
        args.requests = args.requests or 3000
    policies = args.policies.split(",")
    if args.route_sync and "replicas3_sync" not in policies:
        policies.append("replicas3_sync")
    bad = [p for p in policies if p not in (*POLICIES, "replicas3_sync")]
    if bad:
        ap.error(f"unknown policy {bad[0]!r}")
    # The driver's threads (HTTP) and its event loop (engines, publishers) share the GIL: a
    # thread waiting for it would wait up to the 5 ms default switch interval per handoff.
    sys.setswitchinterval(0.0002)
    header("Routing on the Mooncake trace, live: kv-indexer serve over ZMQ and HTTP, wall clock", args)
    items = load_trace(args.requests or None)
    cut = int(len(items) * args.split)
    held_items = items[cut:]
    if args.prefill_tps:
        tps = args.prefill_tps
        print(f"prefill rate: {tps:,.0f} tokens/s per engine (given)")
    else:
        t0 = time.perf_counter()
        tps, log = calibrate_tps(cut, args)
        print("\n".join(log))
        print(f"prefill rate: {tps:,.0f} tokens/s per engine (oracle utilization {args.utilization:.0%} on the "
              f"calibration part, in-process; {time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    held = prepare(held_items)
    print(f"{len(held):,} requests prepared ({time.perf_counter() - t0:.0f} s)")
    span = held[-1].t - held[0].t
    print(f"held back: requests {cut:,}-{len(items) - 1:,}, {span:.0f} trace s; speed-up {args.speedup:g}: "
          f"{span / args.speedup:.0f} s per replay, prefill {tps * args.speedup:,.0f} tokens/s wall per engine, "
          f"decode {DECODE_TPS * args.speedup:g} tokens/s; {args.engines} engines, {args.runs} runs\n")
    runs: list[dict[str, dict[str, Any]]] = []
    for i in range(args.runs):
        got: dict[str, dict[str, Any]] = {}
        for p in policies:
            s = Run(p, held, args, tps, args.route_sync).run()
            got[p] = s
            ee = s.get("est_err")
            print(f"run {i + 1} {p:18} mean TTFT {s['ttft_mean_s']:.2f} s  p90 {s['ttft_p90_s']:.2f} s  cached "
                  f"{s['cached_share']:.2%}  route p50/p99 {s['rtt_p50_ms']:.1f}/{s['rtt_p99_ms']:.1f} ms  "
                  f"dispatch lag p99 {s['lag_p99_ms']:.1f} ms  ({s['wall_s']:.0f} s)"
                  + (f"  estimate-true mean {ee['mean']:+,.0f} p10/p90 {ee['p10']:+,}/{ee['p90']:+,}" if ee else "")
                  + (f"  sync lag mean {s['sync_lag_mean_ms']:.1f} ms" if "sync_lag_mean_ms" in s else "")
                  + ("  DISTURBED: the driver fell behind the trace (another process took the CPU?)"
                     if s["lag_p99_ms"] > 50 else ""), flush=True)
        runs.append(got)
    print()
    print(report(runs, policies))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "prefill_tps": tps, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
