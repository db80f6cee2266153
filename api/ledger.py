"""Predicted against delivered: what the index said the chosen engine would reuse of each
prompt, and what the engine then said it reused (``usage.prompt_tokens_details.cached_tokens``).

The gateway (:mod:`api.gateway`) records one line per answered request; this keeps per
worker the sums Prometheus reads (``kvi_gateway_*``, counters only: a scrape walks no
request) and the last few requests for the live page. A growing gap between the two for
one worker says the index is wrong about that engine (its events lag, are lost, or hash
differently): the chart's rules alert on it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from api.metrics import cumulative, histogram_les

NS = "kvi_gateway"
RECENT = 50
# Seconds: the gateway's own time (tokenize + route, before the engine is asked), and the
# client's time to first token through it.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("ok", "engine_error", "client_error", "upstream_failed", "timeout", "client_aborted")


class _Hist:
    __slots__ = ("bounds", "les", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.les = histogram_les(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # Prometheus buckets are "<= le"
        self.total += v

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc)
        h.add_metric([], cumulative(self.les, self.counts), self.total)
        return h


class _Worker:
    __slots__ = ("requests", "prompt", "predicted", "delivered", "abs_error", "exact", "reports", "outcomes")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt = 0  # prompt tokens of the requests with a usage report
        self.predicted = 0
        self.delivered = 0
        self.abs_error = 0
        self.exact = 0
        self.reports = 0  # requests whose usage said cached_tokens
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)


class Ledger:
    """Per-worker sums of predicted and delivered cached tokens, the gateway's counters and
    its two latency histograms. Used from the event loop only."""

    def __init__(self) -> None:
        self.workers: dict[str, _Worker] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.retries: dict[str, int] = {"connect": 0, "engine_5xx": 0, "connection_closed": 0}
        self.rejected: dict[str, int] = {"bad_request": 0, "no_tokenizer": 0, "no_engine": 0, "saturated": 0}
        self.overhead = _Hist(OVERHEAD_BUCKETS)
        self.ttft = _Hist(TTFT_BUCKETS)
        self.active: dict[str, int] = {}  # requests in flight per worker

    def _w(self, worker: str) -> _Worker:
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = _Worker()
        return w

    def outcome(self, worker: str, outcome: str) -> None:
        w = self._w(worker)
        w.requests += 1
        w.outcomes[outcome] += 1

    def usage(self, worker: str, request_id: str, prompt_tokens: int, predicted: int, delivered: int | None) -> None:
        """One request's account: ``delivered`` None when the engine reported no cached
        tokens (``--enable-prompt-tokens-details`` off): counted, not compared."""
        w = self._w(worker)
        if delivered is not None:
            w.reports += 1
            w.prompt += prompt_tokens
            w.predicted += predicted
            w.delivered += delivered
            w.abs_error += abs(predicted - delivered)
            w.exact += predicted == delivered
        self.recent.append({"t": time.time(), "worker": worker, "request_id": request_id,
                            "prompt_tokens": prompt_tokens, "predicted": predicted, "delivered": delivered})

    def summary(self) -> dict[str, Any]:
        """Per worker: requests, predicted and delivered cached tokens, the delivered-hit
        ratio and the exact share; and the recent requests (the live page)."""
        out = {}
        for name, w in sorted(self.workers.items()):
            out[name] = {"requests": w.requests, "reports": w.reports, "prompt_tokens": w.prompt,
                         "predicted": w.predicted, "delivered": w.delivered, "abs_error": w.abs_error,
                         "exact": w.exact, "delivered_ratio": round(w.delivered / w.prompt, 4) if w.prompt else None,
                         "outcomes": dict(w.outcomes), "active": self.active.get(name, 0)}
        return {"workers": out, "recent": list(self.recent)[::-1], "retries": dict(self.retries),
                "rejected": dict(self.rejected)}

    def families(self) -> Iterator[Any]:
        ws = sorted(self.workers.items())
        req = CounterMetricFamily(f"{NS}_requests", "Requests forwarded, by worker and outcome (ok; engine_error: "
                                  "the engine's 4xx/5xx passed through; upstream_failed: no engine could be reached; "
                                  "timeout; client_aborted: the client left mid-stream).", labels=["worker", "outcome"])
        for name, w in ws:
            for o, n in w.outcomes.items():
                req.add_metric([name, o], n)
        yield req
        for attr, metric, doc in (
                ("prompt", "prompt_tokens", "Prompt tokens of the requests whose engine reported cached tokens."),
                ("predicted", "predicted_cached_tokens", "Cached prompt tokens the index predicted on the chosen "
                 "worker (announced + predicted blocks, as vLLM reuses them: at most (len - 1) rounded down)."),
                ("delivered", "delivered_cached_tokens", "Cached prompt tokens the engine reported "
                 "(usage.prompt_tokens_details.cached_tokens)."),
                ("abs_error", "prediction_error_tokens", "Sum of |predicted - delivered| cached tokens per request: "
                 "the index's error about the worker."),
                ("exact", "prediction_exact", "Requests whose delivered cached tokens equalled the prediction."),
                ("reports", "usage_reports", "Requests whose engine reported cached tokens.")):
            f = CounterMetricFamily(f"{NS}_{metric}", doc, labels=["worker"])
            for name, w in ws:
                f.add_metric([name], getattr(w, attr))
            yield f
        rt = CounterMetricFamily(f"{NS}_retries", "Requests retried once, by reason (connect: refused or timed "
                                 "out, on the next-ranked worker; engine_5xx: a 5xx before the first byte, the same; "
                                 "connection_closed: a kept-alive connection the engine had closed, nothing answered).",
                                 labels=["reason"])
        for k, n in self.retries.items():
            rt.add_metric([k], n)
        yield rt
        rj = CounterMetricFamily(f"{NS}_rejected", "Requests answered by the gateway itself, by reason "
                                 "(bad_request, no_tokenizer, no_engine: none with an api_url, saturated: 429).",
                                 labels=["reason"])
        for k, n in self.rejected.items():
            rj.add_metric([k], n)
        yield rj
        act = GaugeMetricFamily(f"{NS}_active_requests", "Requests in flight through the gateway per worker.",
                                labels=["worker"])
        for name, n in sorted(self.active.items()):
            act.add_metric([name], n)
        yield act
        yield self.overhead.family(f"{NS}_overhead_seconds", "The gateway's own time per request before the "
                                   "engine is asked (read, tokenize, route).")
        yield self.ttft.family(f"{NS}_time_to_first_token_seconds", "Time to the first streamed chunk (or the whole "
                               "answer when not streamed), through the gateway.")

