"""vLLM's load gauges read from its Prometheus ``/metrics`` text, per DP rank:
:func:`parse_vllm_metrics` (text -> ``{dp_rank: RankLoad}`` plus an error string;
never raises). :mod:`.engine_metrics` fetches the text and reports the loads.

The wire facts (vLLM ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``):

* every V1 metric has the labels ``["model_name", "engine"]``; a rank's series is
  ``metric.labels(served_model_name, str(engine_idx))`` (``make_per_engine``), so
  ``engine`` is the engine index as decimal ASCII (``engine="0"``, ``engine="1"``);
* the engine indexes are the API server's ``engine_core.engine_ranks_managed``
  (``vllm/v1/engine/core_client.py``): ``range(dp_rank, dp_rank + n)``, global DP
  ranks (an external-LB server started with ``--data-parallel-rank 3`` labels its one
  engine ``engine="3"``); they are the ``dp_rank`` of the KV events;
* V0 (and V1 before the DP labels) had ``model_name`` only: no ``engine`` label means
  rank 0. An empty label value is the same as no label in Prometheus, so ``engine=""``
  is rank 0 too;
* ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` are gauges with
  ``multiprocess_mode="mostrecent"`` (one series per rank even with several API
  server processes); ``vllm:kv_cache_usage_perc`` is a gauge, 0..1 ("1 means 100
  percent usage"), ``mostrecent`` in current vLLM but the default mode ``all`` in
  0.9-0.10, which adds a ``pid`` label per process under multiprocess mode;
* ``vllm:kv_cache_usage_perc`` replaced ``vllm:gpu_cache_usage_perc`` in 0.9 (the old
  name kept as deprecated, then hidden): the old name is read when the new is absent.

So per rank: ``waiting`` and ``running`` are summed over the other labels (several
``model_name`` series); ``kv_usage`` is the maximum (a fraction of one cache: summed
``pid`` series would count it once per process).

Layer: transport (what the scraper reads); imports only :mod:`indexer.wire.engines`.
``prometheus_client``'s text parser reads one sample line at a time.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from indexer.wire.engines import MAX_DP_RANK

__all__ = ["RankLoad", "Parsed", "parse_vllm_metrics", "WAITING", "RUNNING", "KV_USAGE", "GPU_CACHE_USAGE", "NAMES",
           "MAX_COUNT", "MAX_LINE"]

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # the name of KV_USAGE before vLLM 0.9
NAMES = (WAITING, RUNNING, KV_USAGE, GPU_CACHE_USAGE)

MAX_COUNT = 1e7  # more waiting or running requests than this on one rank is not a real engine
MAX_LINE = 16_384  # a sample line of ours longer than this is junk (the parser is Python, per char)
_MAX_LINES = 16_384  # sample lines of ours parsed per exposition, at most
_MAX_ISSUES = 5  # issues spelled out in an error string; the rest are counted
_RANK_RE = re.compile(r"(?:0|[1-9][0-9]{0,3})\Z")  # ASCII digits only, no sign, no leading zero


class RankLoad(NamedTuple):
    """One DP rank's load as its engine reports it (``kv_usage`` None when not exposed)."""

    waiting: float
    running: float
    kv_usage: float | None


class Parsed(NamedTuple):
    """What :func:`parse_vllm_metrics` could read, and what was wrong (None: nothing)."""

    loads: dict[int, RankLoad]
    error: str | None


def _our_line(line: str) -> str | None:
    """The metric name when ``line`` is a sample line of one of ours, else None."""
    if not line.startswith("vllm:"):
        return None
    for name in NAMES:
        n = len(name)
        if line.startswith(name) and len(line) > n and line[n] in "{ \t":
            return name
    return None


def parse_vllm_metrics(text: str) -> Parsed:
    """Per DP rank, the load in a vLLM ``/metrics`` exposition (Prometheus text format).

    Only the sample lines of ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
    ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` when absent) are read, each
    on its own: a malformed line elsewhere, or one of ours, costs that line only. A rank is
    in the result when both counts are; ``kv_usage`` is None when neither cache metric is.
    Never raises: a bad value (NaN, inf, negative, implausibly large), a bad ``engine``
    label, a duplicate series or a rank with one count only is left out and named in the
    error string."""
    issues: list[str] = []
    n_issues = 0

    def issue(msg: str) -> None:
        nonlocal n_issues
        n_issues += 1
        if len(issues) < _MAX_ISSUES:
            issues.append(msg)

    sums: dict[str, dict[int, float]] = {name: {} for name in NAMES}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    lines = 0
    try:
        for raw in text.split("\n"):
            name = _our_line(raw)
            if name is None:
                continue
            lines += 1
            if lines > _MAX_LINES:
                issue(f"more than {_MAX_LINES} sample lines of vllm load metrics; the rest ignored")
                break
            if len(raw) > MAX_LINE:
                issue(f"{name}: a line of {len(raw)} characters ignored")
                continue
            try:
                samples = [s for fam in text_string_to_metric_families(raw.rstrip("\r") + "\n") for s in fam.samples]
            except Exception as e:  # the parser raises ValueError, IndexError, ... on junk
                issue(f"{name}: malformed line ({type(e).__name__})")
                continue
            for s in samples:
                if s.name != name:
                    continue
                key = (name, frozenset(s.labels.items()))
                if key in seen:
                    issue(f"{name}: duplicate series {_labels(s.labels)}")
                    continue
                seen.add(key)
                engine = s.labels.get("engine", "")
                if engine == "":
                    rank = 0
                elif _RANK_RE.match(engine) is None or int(engine) > MAX_DP_RANK:
                    issue(f"{name}: engine label {engine[:20]!r} is not a DP rank 0..{MAX_DP_RANK}")
                    continue
                else:
                    rank = int(engine)
                try:
                    v = float(s.value)
                except (TypeError, ValueError):
                    issue(f"{name}{{engine={engine[:20]!r}}}: value is not a number")
                    continue
                bad = _bad_value(name, v)
                if bad:
                    issue(f"{name}{{engine={engine[:20]!r}}}: {bad}")
                    continue
                per_rank = sums[name]
                if name in (WAITING, RUNNING):
                    per_rank[rank] = per_rank.get(rank, 0.0) + v
                else:
                    per_rank[rank] = max(per_rank.get(rank, 0.0), v)
    except Exception as e:  # never out: whatever went wrong, return what was read
        issue(f"internal parse error ({type(e).__name__})")

    loads: dict[int, RankLoad] = {}
    waiting, running = sums[WAITING], sums[RUNNING]
    for rank in sorted(waiting.keys() | running.keys()):
        if rank not in waiting or rank not in running:
            missing = WAITING if rank not in waiting else RUNNING
            issue(f"rank {rank}: {missing} missing")
            continue
        kv = sums[KV_USAGE].get(rank, sums[GPU_CACHE_USAGE].get(rank))
        loads[rank] = RankLoad(waiting[rank], running[rank], kv)
    if not loads and not n_issues:
        issue(f"no {WAITING} and {RUNNING} samples")
    if not n_issues:
        return Parsed(loads, None)
    more = f" (+{n_issues - len(issues)} more)" if n_issues > len(issues) else ""
    return Parsed(loads, "; ".join(issues) + more)


def _bad_value(name: str, v: float) -> str | None:
    if not math.isfinite(v):
        return f"non-finite value {v}"
    if v < 0:
        return f"negative value {v:g}"
    if name in (WAITING, RUNNING):
        if v > MAX_COUNT:
            return f"implausible request count {v:g}"
    elif v > 1.0:
        return f"usage {v:g} is over 1 (a fraction 0..1)"
    return None


def _labels(labels: dict[str, str]) -> str:
    s = ",".join(f"{k}={v!r}" for k, v in sorted(labels.items()))
    return "{" + (s if len(s) <= 80 else s[:77] + "...") + "}"
