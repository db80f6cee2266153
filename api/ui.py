"""The live page of the fleet: ``GET /ui`` (static HTML, JS and CSS from
``api/static/``, no build step, no CDN), the data it polls (``GET /ui/state``) and
``POST /v1/explain`` (one prompt, block by block). The routes are declared in
``api/routes/ui.py`` and ``api/routes/query.py``; this module holds what they read.

What the page costs the service:

* ``/ui/state`` reads what the metrics read (``stats()``, ``workers()``: counters,
  per-worker and per-group sizes, never a tree), the query histograms and the ring of
  recent routing decisions. It also takes the over-time samples: at most one per
  :data:`SAMPLE_S`, when a page polls (shared by every open page; nothing runs while
  no page is open), :data:`SAMPLES` kept.
* A routing decision costs the route one tuple appended to a bounded deque
  (:meth:`Decisions.add`); it is formatted only when a page asks.
* ``/v1/explain`` walks the tree for the one prompt it is given, like ``/v1/match``.

Polling, not server-sent events: the page must send the API token as a header when
reads need it (``auth_reads``), and ``EventSource`` cannot send headers (a token in the
URL would end up in access logs and browser history); a poll a second is one small
request, works through any proxy, and its answer is the same counters whatever the
fleet's event rate.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from indexer.query.route import RouteBody, RouteResponse

STATIC = Path(__file__).with_name("static")
# The page's files: path -> (file, content type). Static, holding no data: served
# without the token (a browser cannot send one on a navigation); see api/auth.py.
ASSETS = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
SAMPLE_S = 1.0  # at most one over-time sample a second
SAMPLES = 600  # ... the last 10 minutes of them
DECISIONS = 200  # routing decisions kept (the page shows the newest)
SHOWN_DECISIONS = 12
# Routes whose answers are queries (the over-time query rate and latency).
QUERY_ROUTES = ("/v1/match", "/v1/match_by_keys", "/v1/route", "/query", "/query_by_hash", "demo")


class Decisions:
    """The last :data:`DECISIONS` routing decisions, appended where routes are answered
    (``/v1/route`` and the demo fleet's router): one tuple each, thread-safe (a deque
    appends atomically), formatted only when read. Keeps the top two ranked entries of
    each (not the whole ranking: bounded whatever the fleet's size)."""

    __slots__ = ("ring",)

    def __init__(self, size: int = DECISIONS) -> None:
        self.ring: deque[tuple] = deque(maxlen=size)

    def add(self, t0: float, ntok: int, out: dict | RouteResponse | RouteBody) -> None:
        """Record one answer of ``indexer.query.route.route`` (``t0``: its perf_counter time):
        the library's dict, a :class:`~indexer.query.route.RouteResponse`, or the service's
        :class:`~indexer.query.route.RouteBody` (its ``ranked``: the first two entries)."""
        if out.__class__ is dict:
            d: Any = out
            self.ring.append((t0, ntok, d["model"], d["reason"], d["tiers"], d["ranked"][:2], d["request_id"]))
        else:
            r: Any = out
            self.ring.append((t0, ntok, r.model, r.reason, r.tiers, r.ranked[:2], r.request_id))

    def since(self, t0: float) -> list[tuple]:
        """The decisions recorded after perf_counter time ``t0``, oldest first."""
        return [d for d in list(self.ring) if d[0] > t0]


def split(d: tuple, block_size: int | None) -> dict[str, Any]:
    """One decision as the page shows it: the chosen worker, why, and its cost split in
    blocks (cached per tier, predicted, the prompt's uncached rest, queued prefill, decode)."""
    t0, ntok, model, reason, tiers, ranked, rid = d
    ranked = [r if r.__class__ is dict else msgspec.to_builtins(r) for r in ranked]  # RankedOut: as the dict
    top = ranked[0]
    bs = block_size or 16
    cached = top["cached_blocks"]
    gpu = min(tiers.get("GPU", 0), cached)
    # Loaded after the GPU prefix: CPU chunks, then STORAGE (the index's total chain).
    cpu = cached - gpu if "STORAGE" not in tiers else max(0, min(cached, max(gpu, tiers.get("CPU", 0))) - gpu)
    cached_split = {"GPU": gpu, "CPU": cpu, "STORAGE": cached - gpu - cpu}
    qb = ntok // bs
    ld = top["load"]
    out = {
        "t0": t0, "model": model, "worker": top["worker"], "reason": reason, "request_id": rid,
        "prompt_tokens": ntok, "block_size": block_size, "prompt_blocks": qb, "score": top["score"],
        "cost": top["cost"], "stale": top["stale"],
        "split": {"cached": {k: v for k, v in cached_split.items() if v}, "predicted": top["predicted_blocks"],
                  "uncached": max(qb - cached - top["predicted_blocks"], 0),
                  "queued_prefill": -(-ld["prefill_tokens"] // bs), "decode": ld["decode_blocks"],
                  "load_source": ld["source"]},
        "runner_up": None,
    }
    if len(ranked) > 1:
        r = ranked[1]
        out["runner_up"] = {"worker": r["worker"], "cost": r["cost"], "cached_blocks": r["cached_blocks"],
                            "predicted_blocks": r["predicted_blocks"]}
    return out


class Sampler:
    """Over-time samples of counters (no tree is walked), taken when the page polls."""

    def __init__(self) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES)
        self.last_decision = 0.0  # perf_counter time of the last decision folded in
        # Running totals of routed prompts: tokens, and cached tokens per tier / predicted.
        self.routed: dict[str, int] = {"tokens": 0, "GPU": 0, "CPU": 0, "STORAGE": 0, "predicted": 0}

    def maybe_sample(self, svc: Any, st: dict, workers: list[dict], block_sizes: dict[str, int | None]) -> None:
        now = time.time()
        if self.samples and now - self.samples[-1]["t"] < SAMPLE_S:
            return
        for d in svc.decisions.since(self.last_decision):
            self.last_decision = d[0]
            s = split(d, block_sizes.get(d[2]))
            bs = s["block_size"] or 16
            self.routed["tokens"] += s["prompt_tokens"]
            for tier, n in s["split"]["cached"].items():
                self.routed[tier] = self.routed.get(tier, 0) + n * bs
            self.routed["predicted"] += s["split"]["predicted"] * bs
        hist: list[int] = []
        queries = 0
        for route, (counts, _) in list(svc.metrics.query_seconds.routes.items()):
            if route not in QUERY_ROUTES:
                continue
            c = list(counts)
            hist = [a + b for a, b in zip(hist, c)] if hist else c
            queries += sum(c)
        by_model: dict[str, int] = {}
        for w in workers:
            if "model" in w:
                by_model[w["model"]] = by_model.get(w["model"], 0) + w.get("batches", 0)
        self.samples.append({
            "t": now,
            "events": sum(n for outcomes in st["events"].values() for n in outcomes.values()),
            "batches": st["counters"].get("batches_applied", 0),
            "queries": queries,
            "hist": hist,
            "model_batches": by_model,
            "routed": dict(self.routed),
        })

    def series(self, bounds: tuple[float, ...]) -> list[dict[str, Any]]:
        """Rates between consecutive samples: events/s, batches/s (per model too),
        queries/s, latency percentiles of the queries answered in the interval (from the
        histogram's buckets, interpolated as Prometheus' histogram_quantile does) and the
        share of routed prompt tokens cached per tier."""
        out = []
        s = list(self.samples)
        for a, b in zip(s, s[1:]):
            dt = b["t"] - a["t"]
            if dt <= 0:
                continue
            dh = [y - x for x, y in zip(a["hist"] or [0] * len(b["hist"]), b["hist"])]
            ra, rb = a["routed"], b["routed"]
            tokens = rb["tokens"] - ra["tokens"]
            out.append({
                "t": b["t"],
                "events_s": (b["events"] - a["events"]) / dt,
                "batches_s": (b["batches"] - a["batches"]) / dt,
                "queries_s": (b["queries"] - a["queries"]) / dt,
                "model_batches_s": {m: (n - a["model_batches"].get(m, 0)) / dt for m, n in b["model_batches"].items()},
                "latency_us": {q: _quantile(q / 100, dh, bounds) for q in (50, 90, 99)} if sum(dh) else None,
                "cached_share": {k: (rb[k] - ra.get(k, 0)) / tokens for k in rb if k != "tokens"} if tokens else None,
            })
        return out


def _quantile(q: float, counts: list[int], bounds: tuple[float, ...]) -> float | None:
    """The q-quantile in microseconds of a histogram's bucket counts (the last: +Inf)."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    acc = 0
    for i, n in enumerate(counts):
        if acc + n >= rank and n:
            if i >= len(bounds):  # +Inf: the highest finite bound, as Prometheus does
                return bounds[-1] * 1e6
            lo = bounds[i - 1] if i else 0.0
            return (lo + (bounds[i] - lo) * (rank - acc) / n) * 1e6
        acc += n
    return bounds[-1] * 1e6


def state(svc: Any, decisions_model: str | None = None) -> dict[str, Any]:
    """What ``GET /ui/state`` answers (counters only); the recent decisions of
    ``decisions_model`` only, when given."""
    st = svc.index.stats()
    workers = svc.ingest.workers()
    models = st["models"]
    block_sizes = {}
    for name, m in models.items():
        heads = [g for g in m["groups"].values() if g.get("default")] or list(m["groups"].values())
        block_sizes[name] = heads[0]["block_size"] if heads else None
    sampler: Sampler = svc.ui_sampler
    sampler.maybe_sample(svc, st, workers, block_sizes)
    by_model: dict[str, list[dict]] = {}
    for w in workers:
        by_model.setdefault(w.get("model", "?"), []).append(w)
    recent = [d for d in list(svc.decisions.ring) if decisions_model is None or d[2] == decisions_model]
    recent = recent[-SHOWN_DECISIONS:]
    now_perf, now = time.perf_counter(), time.time()
    decisions = []
    for d in reversed(recent):
        s = split(d, block_sizes.get(d[2]))
        s["t"] = now - (now_perf - s.pop("t0"))
        decisions.append(s)
    return {
        "now": now,
        "poll_s": SAMPLE_S,
        "ingest": {"running": bool(svc.ingest.running), "error": svc.ingest.error},
        "totals": {k: st[k] for k in ("nodes", "resident_entries", "orphans", "workers", "stale_workers")},
        "max_orphans": svc.settings.max_orphans,
        "in_flight": st["in_flight"],
        "models": {name: {**m, "block_size": block_sizes.get(name), "live_workers": len(by_model.get(name, []))}
                   for name, m in models.items()},
        "workers": workers,
        "series": sampler.series(svc.metrics.query_seconds.bounds),
        "decisions": decisions,
        "decisions_kept": len(svc.decisions.ring),
        "discovery": svc.discovery.status(),
        "route_sync": svc.route_sync.stats(),
        "gateway": svc.ledger.summary() if svc.ledger.workers else None,
        "record": svc.recording.stats(),  # None without record_dir: the page hides its time slider
        "auth_reads": svc.auth.auth_reads,
    }

