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
* Routers (:mod:`indexer.producer.routers`): round robin, least loaded, the index
  (with the caller's load, with none, or on the cached prefix alone; in-process or over
  HTTP with :class:`HttpRouter`), and :class:`Oracle`, which sees every engine's cache
  and queue.
* Time (:mod:`indexer.producer.fleet_time`), on the trace's own clock (:class:`SimClock`,
  which an index can take as its ``clock``): each worker prefills FIFO at ``prefill_tps`` tokens/s (a request starts
  when it arrives or when the worker's previous prefill ends, whichever is later, and
  computes what its worker's cache does not hold), then decodes for
  ``output_length / decode_tps`` s. That gives the queued prefill tokens and decode
  blocks a load-aware router sees, and a time to first token (prefill end - arrival).
  A request's stored blocks reach the engine's sink ``event_delay_s`` after its prefill
  ends (vLLM announces blocks once computed), so a router learns of them only then; the
  GPU evictions it causes, ``event_delay_s`` after its prefill starts.

:func:`simulate` replays requests through a fleet with one router and returns the
report a routing team wants: hit rates (GPU, CPU, total), prefill tokens saved, load
balance and TTFT (mean, percentiles) per engine; :func:`versus` sets policies against
the oracle. ``python -m indexer.producer.sim`` prints it for each policy.

Simplifications (stated, not hidden): a request's blocks are freed (evictable) as soon as
it is admitted; a cache touches a prompt's blocks tail first, so the LRU end is always a
leaf and eviction never cuts a chain in the middle (vLLM's free queue has the same
tail-first order); blocks loaded from the CPU tier are stored on the GPU again. An engine
serves a request's cache lookup when the request is routed, not when its prefill starts:
a worker's cache changes only through its own requests, in FIFO order, so the lookup sees
exactly the cache the prefill would find. Prefills do not overlap on a worker (no
chunked-prefill batching), and decoding does not slow prefill.
"""

from __future__ import annotations

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
from typing import TYPE_CHECKING, Any, NamedTuple

import xxhash

from indexer.producer.events import Cleared, Removed, Stored, encode_batch
from indexer.producer.fleet_time import Oracle, Report, SimClock, simulate, versus
from indexer.producer.routers import HttpRouter, IndexRouter, LeastLoaded, RoundRobin, Router

if TYPE_CHECKING:
    from msgspec import Struct

    from indexer.producer.publisher import VllmPublisher
    from indexer.query.index import PrefixIndex

__all__ = [
    "SimEngine", "Request", "trace_requests", "synthetic_requests", "RoundRobin", "LeastLoaded",
    "IndexRouter", "HttpRouter", "Oracle", "Router", "SimClock", "simulate", "versus", "Fleet", "TRACE",
    "fleet_engines", "compare_policies", "index_sink", "engine_hashes", "trace_tokens", "POLICIES",
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

    def hashes(self, tokens: list[int]) -> list[int]:
        """The prompt's block hashes as this engine computes them (:func:`engine_hashes`)."""
        return engine_hashes(tokens, self.block_size)

    def probe(self, tokens: list[int], hashes: list[int] | None = None) -> tuple[int, int]:
        """What the engine would find for ``tokens`` right now, changing nothing:
        (GPU prefix blocks, CPU continuation blocks after it) — the ground truth an
        index's ``tiers["GPU"]`` and ``total_blocks`` should match. ``hashes``: the
        prompt's :func:`engine_hashes` at this engine's block size, if already known."""
        hs = engine_hashes(tokens, self.block_size) if hashes is None else hashes
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
    index: PrefixIndex, engine: str, dp_rank: int = 0, model: str = "default", version: str = "0.33",
    clock: Callable[[], float] = time.time,
) -> Callable[[list[Struct]], None]:
    """A sink that applies each batch to an in-process index, encoded as vLLM encodes it
    (the batch's ``ts`` from ``clock``)."""
    seq = [0]

    def sink(events: list[Struct]) -> None:
        index.apply(engine, encode_batch(events, ts=clock(), dp_rank=dp_rank, version=version),
                    model=model, dp_rank=dp_rank, seq=seq[0])
        seq[0] += 1

    return sink


# --------------------------------------------------------------------- fleets


class Fleet:
    """Simulated engines behind real vLLM-compatible publishers on 127.0.0.1 (the demo).

    ``engines`` x ``dp_size`` workers, each with its own PUB and replay ROUTER on
    ephemeral ports; :meth:`engine_configs` gives the indexer's engine configs (one per
    rank, ``dp_rank_start``, since ephemeral ports are not consecutive).
    """

    def __init__(self, engines: int = 4, dp_size: int = 2, *, model: str = "default", version: str = "0.33",
                 buffer_steps: int = 1000, **engine_options: Any) -> None:
        from indexer.producer.publisher import VllmPublisher

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
                  version: str = "0.33", clock: Callable[[], float] = time.time,
                  **engine_options: Any) -> list[SimEngine]:
    """In-process engines; with ``index``, each publishes straight into it (encoded as
    vLLM does, batch timestamps from ``clock``)."""
    out = []
    for e in range(engines):
        for r in range(dp_size):
            sink = None
            if index is not None:
                index.register_worker(f"sim-{e}", r, model=model)
                sink = index_sink(index, f"sim-{e}", r, model, version, clock)
            out.append(SimEngine(f"sim-{e}", r, sink=sink, **engine_options))
    return out


POLICIES = ("round_robin", "least_loaded", "index", "index_no_load", "index_cache_only", "oracle")


def compare_policies(requests: list[Request], engines: int = 8, *,
                     policies: Iterable[str] = ("round_robin", "least_loaded", "index"),
                     dp_size: int = 1, prefill_tps: float = 20_000.0, decode_tps: float = 40.0,
                     event_delay_s: float | None = 0.05, index_options: dict[str, Any] | None = None,
                     decode_load: bool = False, prefill_load_scale: float = 1.0,
                     **engine_options: Any) -> list[Report]:
    """One fresh fleet per policy (:data:`POLICIES`), the same requests: the reports, in
    ``policies`` order. Each fleet publishes into its own ``PrefixIndex(**index_options)``
    that runs on the simulation's clock; ``decode_load`` passes the ``index`` policy the
    decode blocks besides the queued prefill tokens (:class:`IndexRouter`)."""
    from indexer.query.index import PrefixIndex

    out = []
    for name in policies:
        clock = SimClock(requests[0].t if requests else 0.0)
        idx = PrefixIndex(clock=clock, **(index_options or {}))
        fleet = fleet_engines(engines, dp_size, index=idx, clock=clock, **engine_options)
        router: Router
        if name == "round_robin":
            router = RoundRobin()
        elif name == "least_loaded":
            router = LeastLoaded()
        elif name in ("index", "index_no_load", "index_cache_only"):
            router = IndexRouter(idx, mode={"index": "load", "index_no_load": "no_load"}.get(name, "cache_only"),
                                 decode_load=decode_load, prefill_load_scale=prefill_load_scale)
        elif name == "oracle":
            router = Oracle(fleet)
        else:
            raise ValueError(f"unknown policy {name!r}")
        out.append(simulate(requests, fleet, router, prefill_tps=prefill_tps, decode_tps=decode_tps,
                            event_delay_s=event_delay_s, clock=clock))
        idx.close()
    return out

