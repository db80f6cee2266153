"""Routing quality on the Mooncake conversation trace: index-driven routing vs round robin
vs least loaded (``indexer.producer.sim``).

What is measured: the trace's requests in order (``--requests``, all 12,031 by default;
each ``hash_id`` expands to 512 deterministic tokens) served by a fleet of ``--engines``
simulated vLLM engines (GPU prefix cache of ``--gpu-blocks`` blocks with LRU eviction; with
``--cpu-blocks``, an OffloadingConnector-like CPU tier of 16-block chunks), once per policy
with fresh caches, each engine publishing its real KV events into an in-process
``PrefixIndex`` (vLLM 0.33 payloads). Per policy: hit rate (GPU, CPU, total) as a share of
prompt tokens, prefill tokens saved, load imbalance (max / mean computed tokens per engine)
and time to first token from the simulator's load model (prefill at ``--prefill-tps``
tokens/s per engine, FIFO). Two fleets: GPU only, and GPU + CPU tier. The plot
(``--plot``, default ``docs/img/routing_hit_rate.png``) shows the hit rate over trace time
per policy (rolling windows of 2 trace minutes).

    .venv/bin/python benchmarks/bench_routing.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import ROOT, header, table  # noqa: E402

from indexer.producer.sim import compare_policies, trace_requests  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "index", "index_cache_only")


def windows(timeline: list, width_s: float) -> tuple[list, list]:
    """Hit rate per window of trace time: (window centre in minutes, hit rate)."""
    xs, ys = [], []
    if not timeline:
        return xs, ys
    end = timeline[-1][0]
    t0, i = 0.0, 0
    while t0 <= end:
        tot = hit = 0
        while i < len(timeline) and timeline[i][0] < t0 + width_s:
            tot += timeline[i][1]
            hit += timeline[i][2]
            i += 1
        if tot:
            xs.append((t0 + width_s / 2) / 60)
            ys.append(hit / tot)
        t0 += width_s
    return xs, ys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 2,000 requests")
    ap.add_argument("--requests", type=int, default=0, help="first N trace requests (0 = all)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=16384, help="per engine (Dynamo's mock engine default)")
    ap.add_argument("--cpu-blocks", type=int, default=65536, help="per engine, for the fleet with a CPU tier")
    ap.add_argument("--prefill-tps", type=float, default=20_000.0)
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "routing_hit_rate.png"))
    args = ap.parse_args()
    if args.quick and not args.requests:
        args.requests = 2000
    header("Routing quality on the Mooncake trace (indexer.producer.sim)", argparse.Namespace())
    reqs = list(trace_requests(limit=args.requests or None))
    print(f"{len(reqs):,} requests, {sum(len(r.tokens) for r in reqs):,} prompt tokens, "
          f"{reqs[-1].t / 60:.1f} trace minutes; {args.engines} engines, GPU {args.gpu_blocks:,} blocks each\n")
    # The trace's own ceiling: one engine that never evicts (no index needed).
    from indexer.producer.sim import RoundRobin, SimEngine, simulate

    bound = simulate(reqs, [SimEngine("bound", gpu_blocks=10**9)], RoundRobin(), prefill_tps=args.prefill_tps)
    print(f"ceiling (one engine, nothing ever evicted): hit rate {bound.hit_rate:.1%}, "
          f"{bound.gpu_hit_tokens:,} prefill tokens saved\n")
    fleets = [("GPU only", 0), (f"GPU + CPU tier ({args.cpu_blocks:,} blocks, 16-block chunks)", args.cpu_blocks)]
    curves = {}
    for label, cpu in fleets:
        t0 = time.perf_counter()
        reports = compare_policies(reqs, args.engines, policies=POLICIES, gpu_blocks=args.gpu_blocks, cpu_blocks=cpu,
                                   blocks_per_chunk=16, prefill_tps=args.prefill_tps)
        rows = []
        base = reports[0].summary()["prefill_tokens_saved"]
        for r in reports:
            s = r.summary()
            rows.append([s["policy"], f"{s['gpu_hit_rate']:.1%}", f"{s['cpu_hit_rate']:.1%}", f"{s['hit_rate']:.1%}",
                         s["prefill_tokens_saved"], f"{s['prefill_tokens_saved'] / base:.2f}x" if base else "-",
                         round(s["load_imbalance"], 2), round(s["ttft_p50_s"], 2), round(s["ttft_p99_s"], 2)])
            curves[(label, s["policy"])] = windows(r.timeline, 120.0)
        print(table(["policy", "GPU hit", "CPU hit", "hit", "prefill tokens saved", "vs RR", "imbalance",
                     "TTFT p50 s", "TTFT p99 s"], rows, f"{label} ({time.perf_counter() - t0:.0f} s to simulate)"))
        print()
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(fleets), figsize=(12, 4.2), sharey=True)
        for ax, (label, _) in zip(axes, fleets):
            for pol in POLICIES:
                xs, ys = curves[(label, pol)]
                ax.plot(xs, [y * 100 for y in ys], label=pol.replace("_", " "))
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("trace time (minutes)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        axes[0].legend()
        fig.suptitle(f"Mooncake conversation trace, {len(reqs):,} requests, {args.engines} simulated engines")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
