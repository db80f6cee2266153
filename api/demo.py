"""The demo side of the service: the simulated fleet of ``serve --demo``, its router, the
prompts ``demo-prompt`` prints, ``simulate`` and ``demo-offline``.

The one module of ``api/`` that imports the producer side (``indexer.producer``: the
simulated engines, their publisher and routers); every import of it is made inside a
function, when a demo command runs, so the service's own path never loads it.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from api.settings import Settings

log = logging.getLogger("kv_indexer.demo")


def start_fleet(settings: Settings) -> tuple[Settings, Any, Any, Any]:
    """A simulated fleet on 127.0.0.1 replaying the trace (routed by this index), its
    engines added to the settings. Returns (settings, index, fleet, router); the caller
    sets ``router.svc`` once the app exists and closes the fleet."""
    from indexer import PrefixIndex
    from indexer.producer.sim import Fleet
    from indexer.wire.engines import EngineConfig

    if settings.state_dir or settings.bootstrap_from:
        # Its engines are new processes on new ports at every start: a snapshot of the
        # last run's would name engines that are gone.
        log.warning("demo: state_dir and bootstrap_from are ignored: the demo fleet is new (other ports, empty "
                    "caches) at every start")
        settings = msgspec.structs.replace(settings, state_dir=None, bootstrap_from=None)
    # A replay ring of 200 batches per worker covers the start-up (a late join is repaired
    # from it) without holding ~90 KB per served request for long.
    fleet = Fleet(settings.demo_engines, settings.demo_dp_size, gpu_blocks=4096, cpu_blocks=32768,
                  blocks_per_chunk=16, buffer_steps=200)
    engines = settings.engines + tuple(EngineConfig(**c) for c in fleet.engine_configs())
    settings = msgspec.structs.replace(settings, engines=engines)
    settings = _demo_tokenizer(settings, {c.model for c in engines})
    index = PrefixIndex(**settings.index_options())
    for c in engines:  # known before the first event, so the router can pick them
        for r in c.ranks:
            index.register_worker(c.id, r, model=c.model)
    source, what, _ = demo_requests(settings.demo_speedup)
    router = demo_router(index)
    fleet.run(source, router, loop=True)
    log.info("demo: %d simulated engines x %d DP ranks replaying %s", settings.demo_engines, settings.demo_dp_size,
             what)
    return settings, index, fleet, router


def _demo_tokenizer(settings: Settings, models: set[str]) -> Settings:
    """The demo's models get a small tokenizer built now (indexer/producer/tokenizer.py),
    so prompt and messages requests work against it; not without the text extra."""
    from indexer.producer import tokenizer

    missing = sorted(models - set(settings.tokenizers))
    if not missing:
        return settings
    path = tokenizer.build(os.path.join(tempfile.mkdtemp(prefix="kvi-demo-"), "tokenizer"))
    if path is None:
        log.info("demo: no tokenizer (install the text extra for prompt/messages requests): token_ids only")
        return settings
    log.info("demo: tokenizer for model(s) %s built at %s (prompt and messages requests work)",
             ", ".join(missing), path)
    return msgspec.structs.replace(settings, tokenizers={**settings.tokenizers, **dict.fromkeys(missing, path)})


def demo_requests(speedup: float = 10.0) -> tuple[Callable[[], Iterator[Any]], str, bool]:
    """What the demo fleet replays: ``(source, description, from_trace)``, ``source()``
    giving a fresh iterator of requests. The Mooncake trace (``$KVI_TRACE``) if it exists,
    else synthetic requests at the trace's mean rate (3.3/s) times ``speedup``; their
    prompts do not depend on ``speedup`` (``demo-prompt`` relies on it)."""
    from indexer.producer.sim import TRACE, synthetic_requests, trace_requests

    if TRACE.exists():
        return (lambda: trace_requests(TRACE, speedup=speedup)), f"the Mooncake trace at {speedup:g}x", True
    return ((lambda: synthetic_requests(10**9, rate=3.3 * speedup)), f"synthetic requests (no trace at {TRACE})",
            False)


def demo_router(index: Any) -> Any:
    """The demo fleet's router: the index's route with the simulator's queued prefill as
    load (``IndexRouter``'s ``"load"`` mode), each decision recorded for the page and
    timed as route ``demo`` in ``kvi_query_duration_seconds`` once ``svc`` is set (the
    fleet starts before the app exists)."""
    from indexer.producer.routers import IndexRouter
    from indexer.query.route import Load

    class DemoRouter(IndexRouter):
        svc: Any = None

        def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
            t0 = time.perf_counter()
            out = self.index.route(tokens, model=self.model, load={w: Load(ld[0], 0) for w, ld in loads.items()},
                                   candidates=workers, prefill_load_scale=self.scale)
            svc = self.svc
            if svc is not None:  # None until the app is built
                svc.metrics.observe("demo", time.perf_counter() - t0, out["ranked"][0]["cached_blocks"])
                svc.decisions.add(t0, len(tokens), out)
            worker: str = out["worker"]
            return worker

    return DemoRouter(index)


def prompt(n: int) -> tuple[Any, bool, str]:
    """Request ``n`` of what the fleet replays: ``(the request or None past the end,
    whether it came from the trace, where the trace is looked for)``."""
    from indexer.producer.sim import TRACE

    source, _, from_trace = demo_requests()
    return next(itertools.islice(source(), n, None), None), from_trace, str(TRACE)


def offline() -> None:
    """``demo-offline``: an index built in this process from simulated events, printed."""
    from indexer.producer.offline import demo

    demo()


def simulate(requests: int, speedup: float, warn: Callable[[str], None], **fleet: Any) -> tuple[list[dict], str]:
    """``simulate``: the policies compared on simulated engines; ``(their summaries, what
    requests were replayed: "trace" or "synthetic")``. ``warn`` says when there is no trace."""
    from indexer.producer.sim import TRACE, compare_policies, synthetic_requests, trace_requests

    if TRACE.exists():
        reqs = list(trace_requests(TRACE, limit=requests or None, speedup=speedup))
        kind = "trace"
    else:
        n = requests or 2000
        warn(f"no trace at {TRACE} (set KVI_TRACE): {n} synthetic requests")
        reqs = list(synthetic_requests(n, rate=3.3 * speedup))
        kind = "synthetic"
    reports = compare_policies(reqs, **fleet)
    return [r.summary() for r in reports], f"{len(reqs)} {kind}"
