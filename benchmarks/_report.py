"""Helpers shared by the benchmark scripts: tables, percentiles, targets, the Dynamo peer.

Not a benchmark. ``peer(...)`` runs ``peer_dynamo.py`` inside ``.venv-dynamo``
(``ai-dynamo-runtime==1.6.1``) and returns its JSON figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DYNAMO_PY = ROOT / ".venv-dynamo" / "bin" / "python"

# The project's targets (printed next to the figures).
TARGET_APPLY_BLOCKS_S = 1_000_000
TARGET_MATCH_1K_8W_US = 20.0
TARGET_BYTES_PER_ENTRY = 150


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A plain-text table; numbers right-aligned, text left-aligned."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    numeric = [all(_is_num(r[i]) for r in rows if i < len(r) and r[i] not in (None, "")) for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        if abs(x) >= 10:
            return f"{x:.2f}"
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def percentile(sorted_vals: list, q: float):
    """Nearest-rank percentile of an already sorted list (q in [0, 100])."""
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def lat_stats_us(ns: list[int]) -> dict:
    s = sorted(ns)
    return {"median_us": percentile(s, 50) / 1000.0, "p99_us": percentile(s, 99) / 1000.0, "n": len(s)}


def spread(xs: list[float]) -> dict:
    """Median, min and max of several runs' figures (the runs kept too)."""
    s = sorted(xs)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return {"median": med, "min": s[0], "max": s[-1], "runs": xs}


def drop_cache(path: str) -> None:
    """Drop ``path``'s pages from the page cache (the file is clean: written, fsync'd), so
    the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def load_note() -> str:
    try:
        with open("/proc/loadavg") as f:
            la = f.read().split()[:3]
    except OSError:
        return "load average unknown"
    return "load average " + " ".join(la)


def pin(cpu: int | None) -> str:
    """Pin this process (and threads it starts later) to one CPU; -1/None = no pin."""
    if cpu is None or cpu < 0 or not hasattr(os, "sched_setaffinity"):
        return "not pinned"
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def header(what: str, args) -> None:
    print(f"# {what}")
    print(f"# machine: {machine()}; {load_note()} at start")
    print(f"# command: {' '.join([Path(sys.executable).name] + sys.argv)}")
    if hasattr(args, "cpu"):
        print(f"# affinity: {pin(args.cpu)} (the Dynamo peer runs with the same --cpu)")
    print()


def add_cpu_argument(parser) -> None:
    parser.add_argument(
        "--cpu", type=int, default=-1,
        help="pin ours and the Dynamo peer to this CPU (default -1: no pinning, as users run both). "
             "Dynamo's binding hops to a background thread per call: pinned to one CPU, that thread "
             "and the caller share it, which handicaps the peer; unpinned peer figures can be bimodal "
             "(~35 us more when the thread wakes on another CPU), so use medians of several runs",
    )


def peer_available() -> bool:
    return DYNAMO_PY.exists()


def peer(mode: str, args: list[str], timeout: float = 1800, quiet: bool = False) -> dict | None:
    """Run ``peer_dynamo.py --mode MODE --json ARGS`` in .venv-dynamo; None when unavailable.

    The peer prints its own table on stderr and one JSON line on stdout.
    """
    if not peer_available():
        print(f"[peer] {DYNAMO_PY} not found: Dynamo peer skipped", file=sys.stderr)
        return None
    cmd = [str(DYNAMO_PY), str(HERE / "peer_dynamo.py"), "--mode", mode, "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if proc.returncode != 0:
        print(f"[peer] failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}", file=sys.stderr)
        return None
    peer_table = proc.stderr.strip()
    if peer_table and not quiet:
        print(peer_table)
        print()
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"[peer] no JSON in output:\n{proc.stdout[-2000:]}", file=sys.stderr)
    return None


def workload_args(args) -> list[str]:
    """The workload options of ``args`` as a command line for the peer."""
    out = [
        "--cpu", str(getattr(args, "cpu", -1)),
        "--workload", args.workload, "--workers", str(args.workers), "--seqs", str(args.seqs),
        "--blocks", str(args.blocks), "--prefix-blocks", str(args.prefix_blocks),
        "--prefixes", str(args.prefixes), "--shared-frac", str(args.shared_frac),
        "--block-size", str(args.block_size), "--seed", str(args.seed),
        "--capacity", str(args.capacity),
    ]
    if args.requests is not None:
        out += ["--requests", str(args.requests)]
    return out


def rss_bytes() -> int:
    """Resident set size of this process (from /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
