"""Time in the fleet simulator (:mod:`indexer.producer.sim`): :func:`simulate`, the
replay of requests through simulated engines on the trace's own clock, its
:class:`Report`, and :class:`Oracle`, the policy that sees every engine's cache and queue.

The model: each worker prefills FIFO at ``prefill_tps`` tokens/s, one request at a time;
a request's prefill starts at ``max(arrival, the worker's previous prefill end)`` and
computes what the worker's cache does not hold; its TTFT is its prefill end minus its
arrival. Its KV events reach the engine's sink ``event_delay_s`` after its prefill ends,
as vLLM announces blocks once they are computed (a router learns of them only then); the
GPU evictions it causes, ``event_delay_s`` after its prefill starts (when it takes its
blocks). Decode (``output_length / decode_tps`` s after the prefill) holds blocks that a
load-aware router sees, and does not slow prefill.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from indexer.producer.events import Removed
from indexer.query.route import Load

if TYPE_CHECKING:
    from msgspec import Struct

    from indexer.producer.routers import Router
    from indexer.producer.sim import Request, SimEngine

__all__ = ["SimClock", "Oracle", "Report", "simulate", "versus"]


class SimClock:
    """The simulation's time in seconds of trace time: a callable, so a
    ``PrefixIndex(clock=...)`` ages what it holds on the trace's clock."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Busy:
    """The load model of one worker: FIFO prefill, then decode (seconds of sim time)."""

    __slots__ = ("busy_until", "decoding", "decode_blocks")

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.decoding: list[tuple[float, int]] = []  # heap of (finish time, blocks)
        self.decode_blocks = 0

    def load(self, now: float, prefill_tps: float) -> Load:
        d = self.decoding
        while d and d[0][0] <= now:
            self.decode_blocks -= heapq.heappop(d)[1]
        return Load(round(max(0.0, self.busy_until - now) * prefill_tps), self.decode_blocks)


class Oracle:
    """Sees every engine's cache (:meth:`SimEngine.probe`) and queue: picks the worker
    where this request's TTFT is least, ``backlog + (prompt tokens - hit tokens) /
    prefill_tps``; ties to more hit tokens, then the worker's name. The backlog is the
    simulator's (``loads``: the queued prefill tokens). Greedy: best for the request at
    hand, not for the ones after it."""

    name = "oracle"

    def __init__(self, engines: Iterable[SimEngine]) -> None:
        self.engines = {e.name: e for e in engines}

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        hashes: dict[int, list[int]] = {}
        best: tuple[int, int, str] | None = None
        for w in workers:
            e = self.engines[w]
            hs = hashes.get(e.block_size)
            if hs is None:
                hs = hashes[e.block_size] = e.hashes(tokens)
            g, c = e.probe(tokens, hs)
            hit = (g + c) * e.block_size
            key = (loads[w][0] + len(tokens) - hit, -hit, w)
            if best is None or key < best:
                best = key
        if best is None:
            raise LookupError("no workers to route to")
        return best[2]


# ------------------------------------------------------------------ simulate


class Report(NamedTuple):
    policy: str
    requests: int
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    per_worker: dict[str, dict[str, int]]  # worker -> {"requests", "prompt_tokens", "computed_tokens", "hit_tokens"}
    ttft_s: list[float]  # per request, in request order
    timeline: list[tuple[float, int, int]]  # (t, prompt tokens, hit tokens) per request

    @property
    def hit_rate(self) -> float:
        """The cached share: hit tokens (GPU and CPU) / prompt tokens."""
        return (self.gpu_hit_tokens + self.cpu_hit_tokens) / max(1, self.prompt_tokens)

    def summary(self) -> dict[str, Any]:
        """The figures a routing team asks for, JSON-able."""
        computed = [w["computed_tokens"] for w in self.per_worker.values()]
        mean = sum(computed) / max(1, len(computed))
        tt = sorted(self.ttft_s)

        def pct(q: float) -> float | None:
            return tt[min(len(tt) - 1, max(0, math.ceil(q * len(tt)) - 1))] if tt else None

        p = max(1, self.prompt_tokens)
        return {
            "policy": self.policy,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "gpu_hit_rate": self.gpu_hit_tokens / p,
            "cpu_hit_rate": self.cpu_hit_tokens / p,
            "hit_rate": self.hit_rate,
            "prefill_tokens_saved": self.gpu_hit_tokens + self.cpu_hit_tokens,
            "prefill_tokens_computed": self.prompt_tokens - self.gpu_hit_tokens - self.cpu_hit_tokens,
            "load_imbalance": (max(computed) / mean) if mean else None,
            "ttft_mean_s": sum(tt) / len(tt) if tt else None,
            "ttft_p50_s": pct(0.5),
            "ttft_p90_s": pct(0.9),
            "ttft_p99_s": pct(0.99),
            "per_worker": self.per_worker,
        }


def versus(reports: Iterable[Report], reference: str = "oracle") -> dict[str, dict[str, float | None]]:
    """Each policy against ``reference``: ``{policy: {"ttft_mean_ratio", "ttft_p90_ratio",
    "cached_share_ratio"}}`` (policy's figure / reference's; None where the reference's is 0)."""
    sums = {r.policy: r.summary() for r in reports}
    ref = sums[reference]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {p: {"ttft_mean_ratio": ratio(s["ttft_mean_s"], ref["ttft_mean_s"]),
                "ttft_p90_ratio": ratio(s["ttft_p90_s"], ref["ttft_p90_s"]),
                "cached_share_ratio": ratio(s["hit_rate"], ref["hit_rate"])} for p, s in sums.items()}


def simulate(requests: Iterable[Request], engines: list[SimEngine], router: Router, *, prefill_tps: float = 20_000.0,
             decode_tps: float = 40.0, realtime: bool = False, stop: threading.Event | None = None,
             event_delay_s: float | None = 0.05, clock: SimClock | None = None) -> Report:
    """Serve ``requests`` on ``engines``, each to the worker ``router`` picks.

    Each request is routed at its arrival time, with every worker's backlog as ``loads``
    (:class:`Router`). Its prefill starts at ``max(arrival, the worker's previous prefill
    end)`` and ends ``(prompt tokens - hit tokens) / prefill_tps`` later; its TTFT is
    that end minus its arrival. The engine's events for the request (the batch its
    sink would get) are held: the GPU evictions until the prefill start plus
    ``event_delay_s`` (a batch of their own), the rest until the prefill end plus
    ``event_delay_s``; held batches are delivered in time order (a worker's in the
    order it published them) before the next routing decision that comes later, and
    all of them after the last request. ``event_delay_s=None``: the batch is delivered
    whole when the request is routed (an index that knows at once).

    ``clock`` (a :class:`SimClock`) is set to the simulated time: the arrival of the
    request being routed, or the delivery time of the batch being delivered.
    ``realtime`` sleeps until each arrival and delivery (the demo); otherwise the replay
    runs as fast as it can, on the trace's own clock.
    """
    names = [e.name for e in engines]
    by_name = dict(zip(names, engines))
    busy = {n: _Busy() for n in names}
    per = {n: {"requests": 0, "prompt_tokens": 0, "computed_tokens": 0, "hit_tokens": 0} for n in names}
    gpu_hit = cpu_hit = total = count = 0
    ttft: list[float] = []
    timeline: list[tuple[float, int, int]] = []
    clk = clock if clock is not None else SimClock()
    # Held batches: (delivery time, order served, sink, events). A worker's prefills end
    # in FIFO order, so its batches come out in the order it published them.
    held: list[tuple[float, int, Callable[[list[Struct]], Any], list[Struct]]] = []
    captured: list[list[Struct]] = []
    sinks: dict[str, Callable[[list[Struct]], Any]] = {}
    if event_delay_s is not None:
        for e in engines:
            if e.sink is not None:
                sinks[e.name], e.sink = e.sink, captured.append
    start = time.monotonic()

    def wait_until(t: float) -> bool:  # False: stopped
        if realtime:
            delay = t - (time.monotonic() - start)
            if delay > 0:
                if stop is not None:
                    return not stop.wait(delay)
                time.sleep(delay)
        return stop is None or not stop.is_set()

    def advance(t: float) -> bool:  # deliver what is due by t, then move the clock to t
        while held and held[0][0] <= t:
            due = held[0][0]
            if not wait_until(due):
                return False
            _, _, sink, events = heapq.heappop(held)
            clk.now = max(clk.now, due)
            sink(events)
        if not wait_until(t):
            return False
        clk.now = max(clk.now, t)
        return True

    try:
        for req in requests:
            if (stop is not None and stop.is_set()) or not advance(req.t):
                break
            now = req.t
            loads = {n: busy[n].load(now, prefill_tps) for n in names}
            w = router.choose(req.tokens, names, loads)
            eng = by_name[w]
            got = eng.serve(req.tokens)
            bs = eng.block_size
            hit_tok = (got.gpu_hit + got.cpu_hit) * bs
            ntok = len(req.tokens)
            computed = ntok - hit_tok
            b = busy[w]
            begin = max(now, b.busy_until)
            done = begin + computed / prefill_tps
            b.busy_until = done
            if captured:
                assert event_delay_s is not None
                events = captured.pop()
                # The GPU evictions when the prefill takes its blocks, the rest when it ends.
                early = [isinstance(ev, Removed) and getattr(ev, "medium", None) == "GPU" for ev in events]
                if any(early):
                    heapq.heappush(held, (begin + event_delay_s, 2 * count, sinks[w],
                                          [ev for ev, e in zip(events, early) if e]))
                    events = [ev for ev, e in zip(events, early) if not e]
                if events:
                    heapq.heappush(held, (done + event_delay_s, 2 * count + 1, sinks[w], events))
            blocks = math.ceil((ntok + req.output_length) / bs)
            heapq.heappush(b.decoding, (done + req.output_length / decode_tps, blocks))
            b.decode_blocks += blocks
            ttft.append(done - now)
            pw = per[w]
            pw["requests"] += 1
            pw["prompt_tokens"] += ntok
            pw["computed_tokens"] += computed
            pw["hit_tokens"] += hit_tok
            gpu_hit += got.gpu_hit * bs
            cpu_hit += got.cpu_hit * bs
            total += ntok
            count += 1
            timeline.append((now, ntok, hit_tok))
        if held and (stop is None or not stop.is_set()):
            advance(max(h[0] for h in held))
    finally:
        for n, sink in sinks.items():
            by_name[n].sink = sink
    return Report(getattr(router, "name", type(router).__name__), count, total, gpu_hit, cpu_hit, per, ttft, timeline)
