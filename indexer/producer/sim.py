"""A trace-driven fleet of simulated vLLM engines (no GPU): prefix caches that fill, evict
and offload like vLLM's, publishing exactly the KV events vLLM would.

* :class:`SimEngine`: one engine DP rank. A GPU prefix cache of ``gpu_blocks`` blocks with
  LRU eviction, and optionally an OffloadingConnector-like CPU tier: chunks of
  ``blocks_per_chunk`` blocks aligned to the start of the sequence, offloaded after the GPU
  store, with their own capacity and LRU; self-describing CPU events (token ids, block size,
  parent hash) or hash-only ones. Events go to a *sink*: a :class:`~indexer.producer.publisher.VllmPublisher`
  (real ZMQ, replay socket, any wire layout) or a callable (in-process).
* Requests: the Mooncake conversation trace (each ``hash_id`` is 512 deterministic token ids)
  or a synthetic generator, timed by the trace's timestamps at a chosen speed-up.
* Routers: round robin, least loaded, or the index (``indexer.route``: cached prefix
  against load; in-process or over HTTP with :class:`HttpRouter`).
* A load model per worker: prefill runs FIFO at ``prefill_tps`` tokens/s, then the request
  decodes for ``output_length / decode_tps`` s; that gives the queued prefill tokens and
  decode blocks a load-aware router sees, and a time to first token per request.

:func:`simulate` replays requests through a fleet with one router and returns the
report a routing team wants: hit rates (GPU, CPU, total), prefill tokens saved, load
balance and TTFT per engine. ``python -m indexer.producer.sim`` prints it for each policy.

Simplifications (stated, not hidden): a request's blocks are freed (evictable) as soon as
it is admitted; a cache touches a prompt's blocks tail first, so the LRU end is always a
leaf and eviction never cuts a chain in the middle (vLLM's free queue has the same
tail-first order); blocks loaded from the CPU tier are stored on the GPU again.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import xxhash

from ..engines import parse_worker
from ..route import Load, route
from .events import Cleared, Removed, Stored, encode_batch

if TYPE_CHECKING:
    from msgspec import Struct

    from ..index import PrefixIndex
    from .publisher import VllmPublisher

__all__ = [
    "SimEngine", "Request", "trace_requests", "synthetic_requests", "RoundRobin", "LeastLoaded",
    "IndexRouter", "HttpRouter", "simulate", "Fleet", "TRACE", "fleet_engines", "compare_policies", "index_sink",
    "engine_hashes", "trace_tokens",
]

TRACE = Path(os.environ.get(
    "KVI_TRACE", Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"))
TRACE_BLOCK = 512  # tokens per trace hash_id
_ENGINE_SEED = 0x6B76  # engines of one fleet share their hash seed (vLLM with a fixed seed)
_xxh = xxhash.xxh3_64_intdigest
_q = struct.Struct("<Q").pack


class Request(NamedTuple):
    t: float  # arrival, seconds from the start
    tokens: list[int]
    output_length: int


# ------------------------------------------------------------------ requests


def trace_tokens(hash_ids: Iterable[int], n: int, seed: int = 0) -> list[int]:
    """The first ``n`` token ids of a trace prompt: each hash_id is 512 deterministic ids."""
    out = array("H")
    for hid in hash_ids:
        if len(out) >= n:
            break
        out.frombytes(random.Random(_xxh(b"kvi-trace" + _q(seed) + _q(hid))).randbytes(2 * TRACE_BLOCK))
    return out[:n].tolist()


def trace_requests(path: Path | str = TRACE, *, limit: int | None = None, speedup: float = 1.0,
                   max_tokens: int | None = None, seed: int = 0) -> Iterator[Request]:
    """Requests of the Mooncake trace in order (timestamps in ms, divided by ``speedup``)."""
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            d = json.loads(line)
            n = d["input_length"] if max_tokens is None else min(d["input_length"], max_tokens)
            yield Request(d["timestamp"] / 1000.0 / speedup, trace_tokens(d["hash_ids"], n, seed),
                          d["output_length"])


def synthetic_requests(n: int, *, prefixes: int = 16, prefix_tokens: int = 2048, suffix_tokens: int = 512,
                       rate: float = 10.0, output_length: int = 128, seed: int = 0) -> Iterator[Request]:
    """``n`` requests at ``rate``/s: one of ``prefixes`` shared prefixes (Zipf-like
    popularity), then a unique suffix."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(prefixes)]
    heads = [trace_tokens([10_000_000 + i], prefix_tokens, seed) if prefix_tokens <= TRACE_BLOCK else
             trace_tokens(range(10_000_000 + i * 64, 10_000_000 + i * 64 + math.ceil(prefix_tokens / 512)),
                          prefix_tokens, seed) for i in range(prefixes)]
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        head = heads[rng.choices(range(prefixes), weights)[0]]
        tail = [rng.randrange(65536) for _ in range(suffix_tokens)]
        yield Request(t, head + tail, output_length)


# ------------------------------------------------------------------- engines


def engine_hashes(tokens: list[int], block_size: int) -> list[int]:
    """vLLM-like block hashes: chained over the parent hash and the block's token ids."""
    buf = array("I", tokens).tobytes()
    step = 4 * block_size
    h = 0
    out = []
    for i in range(0, len(buf) - step + 1, step):
        h = _xxh(_q(h) + buf[i : i + step], _ENGINE_SEED)
        out.append(h)
    return out


class Served(NamedTuple):
    blocks: int  # full blocks of the prompt
    gpu_hit: int  # blocks found in the GPU prefix cache
    cpu_hit: int  # blocks loaded from the CPU tier after the GPU prefix
    events: int  # events published


class SimEngine:
    """One vLLM engine DP rank: its caches and the events it publishes.

    ``sink(events)`` receives one batch (a list of :mod:`indexer.producer.events` events) per
    served request; a :class:`~indexer.producer.publisher.VllmPublisher` works as is
    (``publisher.publish``).
    """

    def __init__(self, engine: str, dp_rank: int = 0, *, sink: Callable[[list[Struct]], Any] | None = None,
                 block_size: int = 16, gpu_blocks: int = 16384, cpu_blocks: int = 0,
                 blocks_per_chunk: int = 16, self_describing: bool = True, group: int = 0) -> None:
        if gpu_blocks < 1 or cpu_blocks < 0 or blocks_per_chunk < 1 or block_size < 1:
            raise ValueError("capacities, chunk and block sizes must be positive")
        self.engine = engine
        self.dp_rank = dp_rank
        self.sink = sink
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.blocks_per_chunk = blocks_per_chunk
        self.self_describing = self_describing
        self.group = group
        self.gpu: OrderedDict[int, None] = OrderedDict()  # hash -> None; LRU first
        # chunk's last hash -> the chunk's hashes; LRU first
        self.cpu: OrderedDict[int, list[int]] = OrderedDict()
        self.cpu_held: set[int] = set()  # hashes of blocks in resident CPU chunks
        self.lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"{self.engine}/{self.dp_rank}"

    def serve(self, tokens: list[int]) -> Served:
        """Admit one prompt: hit, load from CPU, compute, store, evict, offload; publish."""
        bs = self.block_size
        hs = engine_hashes(tokens, bs)
        n = len(hs)
        with self.lock:
            gpu = self.gpu
            # The GPU prefix, then the CPU continuation: whole resident chunks, as the
            # connector loads them.
            g, cpu_hit = self._hits(hs)
            events: list[Struct] = []
            # Loaded from CPU or computed, the rest lands in the GPU cache (as much as fits
            # beside the prefix it extends).
            new = hs[g : g + max(0, self.gpu_blocks - g)]
            for j in range(g - 1, -1, -1):  # tail first: the prefix is protected, leaves go first
                gpu.move_to_end(hs[j])
            over = len(gpu) + len(new) - self.gpu_blocks
            if over > 0:
                events.append(Removed([gpu.popitem(last=False)[0] for _ in range(over)], medium="GPU",
                                      group_idx=self.group))
            if new:
                events.append(Stored(new, hs[g - 1] if g else None, tokens[g * bs : (g + len(new)) * bs], bs,
                                     medium="GPU", group_idx=self.group))
                for h in reversed(new):
                    gpu[h] = None
                for j in range(g - 1, -1, -1):
                    gpu.move_to_end(hs[j])
            hs = hs[: g + len(new)]
            if self.cpu_blocks:
                self._offload(hs, tokens, events)
            if events and self.sink is not None:
                self.sink(events)
        return Served(n, g, cpu_hit, len(events))

    def probe(self, tokens: list[int]) -> tuple[int, int]:
        """What the engine would find for ``tokens`` right now, changing nothing:
        (GPU prefix blocks, CPU continuation blocks after it) — the ground truth an
        index's ``tiers["GPU"]`` and ``total_blocks`` should match."""
        hs = engine_hashes(tokens, self.block_size)
        with self.lock:
            return self._hits(hs)

    def _hits(self, hs: list[int]) -> tuple[int, int]:
        n = len(hs)
        g = 0
        while g < n and hs[g] in self.gpu:
            g += 1
        c = g
        k = self.blocks_per_chunk
        if self.cpu_blocks:
            while c < n:
                end = (c // k + 1) * k
                if end > n or hs[end - 1] not in self.cpu:
                    break
                c = end
        return g, c - g

    def _offload(self, hs: list[int], tokens: list[int], events: list[Struct]) -> None:
        k, bs, cpu = self.blocks_per_chunk, self.block_size, self.cpu
        for end in range(k, len(hs) + 1, k):
            last = hs[end - 1]
            if last in cpu:
                cpu.move_to_end(last)
                continue
            chunk = hs[end - k : end]
            while cpu and len(self.cpu_held) + k > self.cpu_blocks:
                _, old = cpu.popitem(last=False)
                self.cpu_held.difference_update(old)
                events.append(Removed(old, medium="CPU", group_idx=self.group))
            if k > self.cpu_blocks:
                return
            cpu[last] = chunk
            self.cpu_held.update(chunk)
            parent = hs[end - k - 1] if end > k else None
            if self.self_describing:
                events.append(Stored(chunk, parent, tokens[(end - k) * bs : end * bs], bs, medium="CPU",
                                     group_idx=self.group))
            else:
                events.append(Stored(chunk, parent, [], 0, medium="CPU", group_idx=self.group))

    def reset(self) -> None:
        """Drop every cached block, as a cache reset does: one ``AllBlocksCleared``."""
        with self.lock:
            self.gpu.clear()
            self.cpu.clear()
            self.cpu_held.clear()
            if self.sink is not None:
                self.sink([Cleared()])


def index_sink(
    index: PrefixIndex, engine: str, dp_rank: int = 0, model: str = "default", version: str = "0.33"
) -> Callable[[list[Struct]], None]:
    """A sink that applies each batch to an in-process index, encoded as vLLM encodes it."""
    seq = [0]

    def sink(events: list[Struct]) -> None:
        index.apply(engine, encode_batch(events, ts=time.time(), dp_rank=dp_rank, version=version),
                    model=model, dp_rank=dp_rank, seq=seq[0])
        seq[0] += 1

    return sink


# -------------------------------------------------------------------- routers


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
        return Load(int(max(0.0, self.busy_until - now) * prefill_tps), self.decode_blocks)


class Router(Protocol):
    """What :func:`simulate` asks of a routing policy (its ``name``, if any, labels the report)."""

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.i = -1

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        self.i += 1
        return workers[self.i % len(workers)]


class LeastLoaded:
    """Fewest queued prefill blocks plus decode blocks (the route cost with nothing cached)."""

    name = "least_loaded"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        bs = self.block_size
        return min(workers, key=lambda w: (math.ceil(loads[w][0] / bs) + loads[w][1], w))


class IndexRouter:
    """The index's answer (``indexer.route``) over an in-process :class:`PrefixIndex`;
    ``use_load=False`` routes on the cached prefix alone (ties: engine order)."""

    def __init__(self, index: PrefixIndex, model: str = "default", prefill_load_scale: float = 1.0,
                 use_load: bool = True) -> None:
        self.index = index
        self.model = model
        self.scale = prefill_load_scale
        self.use_load = use_load
        self.name = "index" if use_load else "index_cache_only"

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        res = self.index.match(tokens, model=self.model)
        # The workers are the candidates: parsed once here, not again as ``candidates``.
        known = [(e, r or 0, False) for e, r in map(parse_worker, workers)]
        worker: str = route(res, known, load=loads if self.use_load else None, prefill_load_scale=self.scale)["worker"]
        return worker


class HttpRouter:
    """The service's ``POST /v1/route`` answer (keep-alive connection)."""

    name = "index_http"

    def __init__(self, url: str, model: str = "default") -> None:
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)  # type: ignore[arg-type]  # no host: fails here
        self.model = model

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        body = json.dumps({"token_ids": tokens, "model": self.model, "candidates": workers,
                           "load": {w: {"active_prefill_tokens": a, "active_decode_blocks": b}
                                    for w, (a, b) in loads.items()}}).encode()
        self.conn.request("POST", "/v1/route", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        doc = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"/v1/route answered {r.status}: {doc}")
        worker: str = doc["worker"]
        return worker


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
            "ttft_p50_s": pct(0.5),
            "ttft_p99_s": pct(0.99),
            "per_worker": self.per_worker,
        }


def simulate(requests: Iterable[Request], engines: list[SimEngine], router: Router, *, prefill_tps: float = 20_000.0,
             decode_tps: float = 40.0, realtime: bool = False, stop: threading.Event | None = None) -> Report:
    """Serve ``requests`` on ``engines``, each to the worker ``router`` picks.

    ``realtime`` sleeps until each request's arrival time (the demo); otherwise the
    replay runs as fast as it can, on the trace's own clock.
    """
    names = [e.name for e in engines]
    by_name = dict(zip(names, engines))
    busy = {n: _Busy() for n in names}
    per = {n: {"requests": 0, "prompt_tokens": 0, "computed_tokens": 0, "hit_tokens": 0} for n in names}
    gpu_hit = cpu_hit = total = count = 0
    ttft: list[float] = []
    timeline: list[tuple[float, int, int]] = []
    start = time.monotonic()
    for req in requests:
        if stop is not None and stop.is_set():
            break
        if realtime:
            delay = req.t - (time.monotonic() - start)
            # (time.sleep's None: go on)
            if delay > 0 and (stop.wait(delay) if stop is not None else time.sleep(delay)):  # type: ignore[func-returns-value]
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
        done = max(now, b.busy_until) + computed / prefill_tps
        b.busy_until = done
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
    return Report(getattr(router, "name", type(router).__name__), count, total, gpu_hit, cpu_hit, per, ttft, timeline)


class Fleet:
    """Simulated engines behind real vLLM-compatible publishers on 127.0.0.1 (the demo).

    ``engines`` x ``dp_size`` workers, each with its own PUB and replay ROUTER on
    ephemeral ports; :meth:`engine_configs` gives the indexer's engine configs (one per
    rank, ``dp_rank_start``, since ephemeral ports are not consecutive).
    """

    def __init__(self, engines: int = 4, dp_size: int = 2, *, model: str = "default", version: str = "0.33",
                 buffer_steps: int = 1000, **engine_options: Any) -> None:
        from .publisher import VllmPublisher

        # The replay ring holds whole batches (a trace request's store is ~20 KB): vLLM's
        # default of 10,000 would hold ~200 MB per simulated worker.
        self.model = model
        self.sims: list[SimEngine] = []
        self.pubs: list[VllmPublisher] = []
        for e in range(engines):
            for r in range(dp_size):
                pub = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", dp_rank=r, version=version, bind=True,
                                    buffer_steps=buffer_steps)
                self.pubs.append(pub)
                self.sims.append(SimEngine(f"sim-{e}", r, sink=pub.publish, **engine_options))
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.report: Report | None = None

    def engine_configs(self) -> list[dict[str, Any]]:
        return [{"id": s.engine, "endpoint": p.live_endpoint, "replay_endpoint": p.bound_replay_endpoint,
                 "model": self.model, "dp_rank_start": s.dp_rank}
                for s, p in zip(self.sims, self.pubs)]

    def run(self, requests: Iterable[Request] | Callable[[], Iterable[Request]], router: Router, *,
            loop: bool = False, **kw: Any) -> None:
        """Replay in a background thread (in real time); ``loop`` starts over at the end."""

        def go() -> None:
            while not self.stop.is_set():
                self.report = simulate(requests() if callable(requests) else requests, self.sims, router,
                                       realtime=True, stop=self.stop, **kw)
                if not loop:
                    return

        self.thread = threading.Thread(target=go, name="kvidx-sim", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        for p in self.pubs:
            p.close()


def fleet_engines(engines: int, dp_size: int = 1, *, index: PrefixIndex | None = None, model: str = "default",
                  version: str = "0.33",
                  **engine_options: Any) -> list[SimEngine]:
    """In-process engines; with ``index``, each publishes straight into it (encoded as vLLM does)."""
    out = []
    for e in range(engines):
        for r in range(dp_size):
            sink = None
            if index is not None:
                index.register_worker(f"sim-{e}", r, model=model)
                sink = index_sink(index, f"sim-{e}", r, model, version)
            out.append(SimEngine(f"sim-{e}", r, sink=sink, **engine_options))
    return out


def compare_policies(requests: list[Request], engines: int = 8, *,
                     policies: Iterable[str] = ("round_robin", "least_loaded", "index"),
                     dp_size: int = 1, prefill_tps: float = 20_000.0, decode_tps: float = 40.0,
                     **engine_options: Any) -> list[Report]:
    """One fresh fleet per policy, the same requests: the reports, in ``policies`` order."""
    from ..index import PrefixIndex

    out = []
    for name in policies:
        idx = PrefixIndex()
        fleet = fleet_engines(engines, dp_size, index=idx, **engine_options)
        router: Router
        if name == "round_robin":
            router = RoundRobin()
        elif name == "least_loaded":
            router = LeastLoaded()
        elif name in ("index", "index_cache_only"):
            router = IndexRouter(idx, use_load=name == "index")
        else:
            raise ValueError(f"unknown policy {name!r}")
        out.append(simulate(requests, fleet, router, prefill_tps=prefill_tps, decode_tps=decode_tps))
        idx.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m indexer.producer.sim``: an alias of ``kv-indexer simulate`` (the same parser)."""
    import sys

    from api.cli import main as cli_main

    return cli_main(["simulate", *(sys.argv[1:] if argv is None else argv)], prog="python -m indexer.producer.sim")


if __name__ == "__main__":
    raise SystemExit(main())
