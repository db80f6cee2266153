"""Routing on the Mooncake conversation trace replayed on its own clock: time to first token
and cached share per policy, against an oracle that sees every engine's cache and queue
(``indexer.producer.sim``; docs/routing.md).

What is simulated: the trace's requests (each ``hash_id`` is 512 deterministic tokens)
arrive at their timestamps at a fleet of ``--engines`` simulated vLLM engines (GPU prefix
cache of ``--gpu-blocks`` blocks of 16 tokens, LRU). Each engine prefills FIFO, one
request at a time, at ``prefill_tps`` tokens/s, computing what its cache does not hold;
TTFT = prefill end - arrival. A request's KV events (vLLM 0.33 payloads) reach the
in-process ``PrefixIndex`` ``--event-delay`` s after its prefill ends; the index runs on
the trace's clock. Policies, each on a fresh fleet and index:

* ``round_robin``, ``least_loaded`` (fewest queued prefill + decode blocks);
* ``index``: ``PrefixIndex.route`` with the caller's load, each engine's queued prefill
  tokens (its backlog);
* ``index_no_load``: ``PrefixIndex.route`` with no load (the index's own bookkeeping of
  what it routed and what the engines announced);
* ``oracle``: the least TTFT for the request at hand, from every engine's real cache and
  queue.

Held-back split: the first ``--split`` of the requests (by arrival; default 50%) calibrate,
the rest are the figures. Calibration sets ``prefill_tps`` so that the oracle keeps the
fleet ``--utilization`` busy (default 0.6: busy, not saturated) on the calibration part;
nothing else is tuned (the event delay is a deployment figure, the index runs on its
defaults). The held-back part is replayed alone on fresh fleets (cold caches, its own
timestamps), then again in ``--slices`` consecutive slices, each alone, for the spread.
Printed: the table per policy (mean and p90 TTFT, cached share, ratios to the oracle) and
whether ``index`` and ``index_no_load`` reach the issue-13 targets (mean TTFT <= 1.15x the
oracle's, cached share >= 0.95x). The plot (``--plot``, default docs/img/routing_ttft.png):
TTFT CDF and TTFT over trace time per policy, held-back part.

``--hit-rates`` adds the older comparison (hit rates on GPU-only and GPU + CPU tier fleets,
``--hit-plot`` docs/img/routing_hit_rate.png).

    .venv/bin/python benchmarks/bench_routing.py [--quick] [--jobs 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import ROOT, header, table  # noqa: E402

from indexer.producer.sim import Report, compare_policies, trace_requests, versus  # noqa: E402

TIMED = ("round_robin", "least_loaded", "index", "index_no_load", "oracle")
HIT_POLICIES = ("round_robin", "least_loaded", "index", "index_cache_only")
TARGET_TTFT, TARGET_SHARE = 1.15, 0.95
_REQS: list = []  # the requests the pool's forked workers replay


def _one(job: tuple[str, dict[str, Any]]) -> Report:
    policy, kw = job
    return compare_policies(_REQS, policies=[policy], **kw)[0]


def run(reqs: list, policies: tuple[str, ...], jobs: int, **kw: Any) -> list[Report]:
    """The policies on ``reqs`` (one fresh fleet each), ``jobs`` at a time in forked processes."""
    global _REQS
    _REQS = reqs
    todo = [(p, kw) for p in policies]
    if jobs <= 1:
        return [_one(j) for j in todo]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as ex:
        return list(ex.map(_one, todo))


def calibrate(cal: list, engines: int, utilization: float, **kw: Any) -> tuple[float, list[str]]:
    """The prefill rate at which the oracle keeps the fleet ``utilization`` busy on ``cal``:
    computed tokens / (engines x rate x span) (a few fixed-point steps)."""
    span = cal[-1].t - cal[0].t
    tps, log = 10_000.0, []
    for _ in range(4):
        s = compare_policies(cal, engines, policies=["oracle"], prefill_tps=tps, **kw)[0].summary()
        util = s["prefill_tokens_computed"] / (engines * tps * span)
        log.append(f"  oracle at {tps:,.0f} tokens/s: utilization {util:.1%}, mean TTFT {s['ttft_mean_s']:.2f} s, "
                   f"cached share {s['hit_rate']:.1%}")
        new = round(s["prefill_tokens_computed"] / (engines * span * utilization), -2)
        if abs(new - tps) <= 100:
            break
        tps = new
    return tps, log


def rows_for(reports: list[Report]) -> list[list]:
    vs = versus(reports)
    rows = []
    for r in reports:
        s, v = r.summary(), vs[r.policy]
        target = None
        if r.policy.startswith("index"):
            target = bool(v["ttft_mean_ratio"] <= TARGET_TTFT and v["cached_share_ratio"] >= TARGET_SHARE)
        rows.append([r.policy, s["ttft_mean_s"], s["ttft_p90_s"], f"{s['hit_rate']:.2%}",
                     f"{v['ttft_mean_ratio']:.2f}x", f"{v['ttft_p90_ratio']:.2f}x", f"{v['cached_share_ratio']:.3f}x",
                     round(s["load_imbalance"], 2), target])
    return rows


STYLE: dict[str, dict[str, Any]] = {
    "round_robin": {"color": "tab:blue"}, "least_loaded": {"color": "tab:orange"},
    "index": {"color": "tab:green", "linewidth": 2.5}, "index_no_load": {"color": "tab:red"},
    "oracle": {"color": "black", "linestyle": "--", "linewidth": 1.2},
}
HEAD = ["policy", "mean TTFT s", "p90 TTFT s", "cached share", "mean TTFT / oracle", "p90 / oracle",
        "cached share / oracle", "imbalance", "target met"]


def plot_ttft(path: str, reports: list[Report], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    for r in reports:
        tt = sorted(r.ttft_s)
        n = len(tt)
        st = STYLE.get(r.policy, {})
        a.plot(tt, [(i + 1) / n for i in range(n)], label=r.policy.replace("_", " "), **st)
        xs, ys = windows(r, 120.0)
        b.plot(xs, ys, label=r.policy.replace("_", " "), **st)
    a.set_xscale("log")
    a.set_xlim(left=0.02)
    a.set_xlabel("TTFT (s, log scale)")
    a.set_ylabel("share of requests")
    a.set_title("TTFT CDF", fontsize=10)
    b.set_yscale("log")
    b.set_xlabel("trace time (minutes)")
    b.set_ylabel("mean TTFT per 2-minute window (s, log scale)")
    b.set_title("TTFT over trace time", fontsize=10)
    b.yaxis.set_major_formatter(ScalarFormatter())
    b.yaxis.set_minor_formatter(ScalarFormatter())
    for ax in (a, b):
        ax.grid(alpha=0.3, which="both")
    a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def windows(r: Report, width_s: float) -> tuple[list[float], list[float]]:
    """Mean TTFT per window of arrival time: (window centre in minutes, mean TTFT)."""
    acc: dict[int, list[float]] = {}
    for (t, _, _), ttft in zip(r.timeline, r.ttft_s):
        acc.setdefault(int(t // width_s), []).append(ttft)
    keys = sorted(acc)
    return [(k + 0.5) * width_s / 60 for k in keys], [sum(acc[k]) / len(acc[k]) for k in keys]


def hit_rates(reqs: list, args: argparse.Namespace) -> None:
    """The older comparison: hit rates on two fleets (GPU only, GPU + CPU tier)."""
    fleets = [("GPU only", 0), (f"GPU + CPU tier ({args.cpu_blocks:,} blocks, 16-block chunks)", args.cpu_blocks)]
    curves = {}
    for label, cpu in fleets:
        t0 = time.perf_counter()
        reports = run(reqs, HIT_POLICIES, args.jobs, engines=args.engines, gpu_blocks=args.gpu_blocks,
                      cpu_blocks=cpu, blocks_per_chunk=16, prefill_tps=20_000.0, event_delay_s=args.event_delay)
        rows = []
        base = reports[0].summary()["prefill_tokens_saved"]
        for r in reports:
            s = r.summary()
            rows.append([s["policy"], f"{s['gpu_hit_rate']:.1%}", f"{s['cpu_hit_rate']:.1%}", f"{s['hit_rate']:.1%}",
                         s["prefill_tokens_saved"], f"{s['prefill_tokens_saved'] / base:.2f}x" if base else "-",
                         round(s["load_imbalance"], 2), round(s["ttft_p50_s"], 2), round(s["ttft_p99_s"], 2)])
            acc: dict[int, list[int]] = {}
            for t, ntok, hit in r.timeline:
                a = acc.setdefault(int(t // 120), [0, 0])
                a[0] += ntok
                a[1] += hit
            curves[(label, s["policy"])] = ([(k + 0.5) * 2 for k in sorted(acc)],
                                            [acc[k][1] / acc[k][0] * 100 for k in sorted(acc)])
        print(table(["policy", "GPU hit", "CPU hit", "hit", "prefill tokens saved", "vs RR", "imbalance",
                     "TTFT p50 s", "TTFT p99 s"], rows,
                    f"{label}, prefill 20,000 tokens/s ({time.perf_counter() - t0:.0f} s to simulate)"))
        print()
    if args.hit_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(fleets), figsize=(12, 4.2), sharey=True)
        for ax, (label, _) in zip(axes, fleets):
            for pol in HIT_POLICIES:
                xs, ys = curves[(label, pol)]
                ax.plot(xs, ys, label=pol.replace("_", " "))
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("trace time (minutes)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        axes[0].legend()
        fig.suptitle(f"Mooncake conversation trace, {len(reqs):,} requests, {args.engines} simulated engines")
        fig.tight_layout()
        fig.savefig(args.hit_plot, dpi=110)
        print(f"plot: {args.hit_plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 2,000 requests, no slices")
    ap.add_argument("--requests", type=int, default=0, help="first N trace requests (0 = all 12,031)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=16384, help="per engine (Dynamo's mock engine default)")
    ap.add_argument("--split", type=float, default=0.5, help="share of the requests (by arrival) that calibrate")
    ap.add_argument("--utilization", type=float, default=0.6,
                    help="the fleet's utilization under the oracle that calibration aims at")
    ap.add_argument("--prefill-tps", type=float, default=0.0, help="skip the calibration: this prefill rate")
    ap.add_argument("--event-delay", type=float, default=0.05, help="s from prefill end to the index")
    ap.add_argument("--slices", type=int, default=3, help="the held-back part also in N slices (0: none)")
    ap.add_argument("--jobs", type=int, default=2, help="policies simulated at once (processes)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "routing_ttft.png"))
    ap.add_argument("--hit-rates", action="store_true", help="also the hit-rate comparison of two fleets")
    ap.add_argument("--cpu-blocks", type=int, default=65536, help="per engine, for --hit-rates' CPU-tier fleet")
    ap.add_argument("--hit-plot", default=str(ROOT / "docs" / "img" / "routing_hit_rate.png"))
    args = ap.parse_args()
    if args.quick:
        args.requests = args.requests or 2000
        args.slices = 0
    header("Routing on the Mooncake trace, on its own clock (indexer.producer.sim)", argparse.Namespace())
    reqs = list(trace_requests(limit=args.requests or None))
    cut = int(len(reqs) * args.split)
    cal, held = reqs[:cut], reqs[cut:]
    print(f"{len(reqs):,} requests, {sum(len(r.tokens) for r in reqs):,} prompt tokens, "
          f"{reqs[-1].t / 60:.1f} trace minutes; {args.engines} engines, GPU {args.gpu_blocks:,} blocks "
          f"of 16 tokens each; events reach the index {args.event_delay * 1000:.0f} ms after the prefill ends")
    print(f"calibration: requests 0-{cut - 1:,} (t {cal[0].t:.0f}-{cal[-1].t:.0f} s); "
          f"held back: requests {cut:,}-{len(reqs) - 1:,} (t {held[0].t:.0f}-{held[-1].t:.0f} s)\n")
    kw = {"engines": args.engines, "gpu_blocks": args.gpu_blocks, "event_delay_s": args.event_delay}
    t0 = time.perf_counter()
    if args.prefill_tps:
        tps = args.prefill_tps
        print(f"prefill rate: {tps:,.0f} tokens/s per engine (given)\n")
    else:
        tps, log = calibrate(cal, args.engines, args.utilization, gpu_blocks=args.gpu_blocks,
                             event_delay_s=args.event_delay)
        print("\n".join(log))
        print(f"prefill rate: {tps:,.0f} tokens/s per engine (oracle utilization {args.utilization:.0%} on the "
              f"calibration part; {time.perf_counter() - t0:.0f} s)\n")
    kw["prefill_tps"] = tps
    t0 = time.perf_counter()
    reports = run(held, TIMED, args.jobs, **kw)
    print(table(HEAD, rows_for(reports), f"held back: {len(held):,} requests, replayed alone from cold caches "
                f"({time.perf_counter() - t0:.0f} s to simulate)"))
    print()
    if args.slices:
        per: dict[str, list[dict[str, Any]]] = {}
        step = len(held) // args.slices
        for i in range(args.slices):
            part = held[i * step : (i + 1) * step if i < args.slices - 1 else len(held)]
            for p, v in versus(run(part, TIMED, args.jobs, **kw)).items():
                per.setdefault(p, []).append(v)
        rows = []
        for p in TIMED:
            t = [v["ttft_mean_ratio"] for v in per[p]]
            c = [v["cached_share_ratio"] for v in per[p]]
            rows.append([p, f"{statistics.median(t):.2f}x", f"{min(t):.2f}-{max(t):.2f}x",
                         f"{statistics.median(c):.3f}x", f"{min(c):.3f}-{max(c):.3f}x"])
        print(table(["policy", "mean TTFT / oracle, median", "range", "cached share / oracle, median", "range"], rows,
                    f"held back in {args.slices} slices of ~{step:,} requests, each replayed alone"))
        print()
    if args.plot:
        plot_ttft(args.plot, reports, f"Mooncake trace, held-back {len(held):,} requests, {args.engines} engines, "
                  f"prefill {tps:,.0f} tokens/s, events +{args.event_delay * 1000:.0f} ms")
        print(f"plot: {args.plot}\n")
    if args.hit_rates:
        hit_rates(reqs, args)


if __name__ == "__main__":
    main()
