"""``kv-indexer``: the one command line (``python -m indexer`` runs the same parser).

* ``serve``: the HTTP service (uvicorn, one worker: the index lives in this process's
  memory); ``serve --demo`` adds the live demo fleet (simulated engines publishing over ZMQ).
* ``relay --nats URL``: subscribe to the engines and publish their batches to a NATS
  JetStream event log that ``serve --nats URL`` replicas follow (``docs/jetstream.md``).
* ``demo-prompt N``: a ``/v1/match`` body with the prompt of the demo fleet's request N.
* ``demo-offline``: no service, an index built in this process from simulated events.
* ``decode FILE``: one vLLM batch payload as JSON.
* ``simulate``: routing policies compared on simulated engines (``indexer.producer.sim``).

FastAPI and uvicorn are imported only on the ``serve`` path: the other commands stay light.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import logging.config
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from api.settings import ENV_PREFIX, FIELDS, Settings, SettingsError, load_settings, parse_engine_spec

_HELP = {
    "host": "listen address",
    "port": "listen port",
    "engines": "engines to subscribe to at start (list of {id, endpoint, model, replay_endpoint, topic, dp_size, "
    "metrics_url})",
    "discovery": "engines by DNS: {dns_name, port, replay_port, metrics_port, dp_size, model, topic, interval_s, "
    "grace_s}",
    "credits": "score credit per block per tier (JSON object in the environment)",
    "stale_factor": "multiplier on a stale worker's score when ranking, 0..1",
    "max_orphans": "stores waiting for their parent, at most (the oldest go first)",
    "orphan_ttl_s": "seconds a store may wait for its parent",
    "max_nodes": "node cap per prefix tree (model x KV-cache group); 0 = no cap",
    "max_request_tokens": "tokens (or block keys) per query, at most; more gets 413",
    "max_request_bytes": "request body bytes, at most; more gets 413",
    "replay_timeout_s": "seconds a replay may take before the worker is marked stale",
    "max_workers": "engine DP ranks subscribed at once, at most (each holds up to 4 sockets)",
    "ready_fraction": "/readyz: share of subscribed workers that must be connected and not replaying, 0..1 "
    "(0: ready once ingest runs; per-worker health is in /v1/workers and kvi_worker_health)",
    "api_token": "bearer token the mutating routes need (engine register/unregister); unset = open. "
    "Prefer the environment or a file to a flag",
    "api_token_file": "a file holding the token (e.g. a mounted Secret), read at start",
    "auth_reads": "every route needs the token, not only the mutating ones (probes excepted)",
    "allowed_endpoints": "hosts engines may be at (names, *.DOMAIN, IPs, CIDRs), checked before any connect; "
    "empty = any; engines are tcp:// only (comma-separated or a JSON list in the environment)",
    "prefill_load_scale": "/v1/route cost weight of uncached prefill blocks",
    "predicted_credit": "score credit of a predicted block (routed to a worker, prefill not announced yet)",
    "prefill_ttl_s": "seconds a route's prediction and prefill load last when its worker never announces the blocks",
    "decode_ttl_s": "seconds a route's decode load (max_tokens) lasts without POST /v1/route/{id}/done",
    "max_in_flight": "routed requests kept in flight at most (the oldest beyond are forgotten, counted)",
    "metrics_interval_s": "seconds between scrapes of engines' vLLM /metrics (engines with a metrics_url)",
    "state_dir": "directory of the index's snapshot (warm restart: loaded at start, written every "
    "snapshot_interval_s and on SIGTERM); unset = start empty",
    "snapshot_interval_s": "seconds between snapshots to the state dir or the object store; 0 = only on SIGTERM",
    "bootstrap_from": "a peer's base URL: copy its state (GET /v1/snapshot) at start, then follow the engines",
    "nats_url": "NATS server: consume the relay's JetStream event log instead of the engines' ZMQ",
    "nats_stream": "JetStream stream of the event log",
    "nats_subject": "subject the relay publishes batches on",
    "nats_bucket": "JetStream object-store bucket of snapshots",
    "log_level": "critical, error, warning, info or debug",
    "log_json": "log one JSON object per line",
    "access_log": "log every HTTP request",
    "fast_path": "answer the query routes ahead of FastAPI's middleware (same answers, less latency)",
    "demo": "also run the live demo fleet: simulated engines on 127.0.0.1 publishing over ZMQ, replaying the "
    "Mooncake trace (synthetic requests without it); its engines are added",
    "demo_engines": "demo: simulated engines",
    "demo_dp_size": "demo: DP ranks per engine",
    "demo_speedup": "demo: divide the trace's timestamps by this (synthetic requests: 3.3 x this per second)",
    "tokenizers": "per model, a Hugging Face tokenizer directory ({MODEL: DIR}; JSON in the environment): "
    "requests may send a prompt or chat messages instead of token ids (needs the text extra)",
}

_EPILOG = """\
Settings come from, later winning: defaults < the YAML file (--config or $KVI_CONFIG)
< environment variables < flags. Every setting has an environment variable:

{env}

Example config file (YAML):

  host: 0.0.0.0
  port: 8080
  engines:
    - id: vllm-0
      model: llama-3-8b
      endpoint: tcp://10.0.0.5:5557          # vLLM kv_events_config.endpoint
      replay_endpoint: tcp://10.0.0.5:5558   # kv_events_config.replay_endpoint
      dp_size: 2                             # rank r publishes on port + r
  discovery:                                 # or: every address of a headless Service
    dns_name: vllm-engines.default.svc.cluster.local
    port: 5557
    replay_port: 5600
  credits: {{GPU: 1.0, CPU: 0.75, STORAGE: 0.25}}
  max_nodes: 2000000
  max_request_tokens: 1000000
  log_json: true

"""


def _env_table() -> str:
    d = Settings()
    lines = []
    for name in FIELDS:
        default = getattr(d, name)
        shown = json.dumps(default) if name in ("credits", "engines") else default
        if name == "engines":
            shown = "[]"
        if name in ("discovery", "api_token", "api_token_file"):
            shown = "none"
        if name == "allowed_endpoints":
            shown = "[] (any host)"
        lines.append(f"  {ENV_PREFIX + name.upper():<24} {_HELP.get(name, '')} (default {shown})")
    return "\n".join(lines)


_COMMANDS_EPILOG = """\
The live demo is `kv-indexer serve --demo` (simulated engines publishing over ZMQ on
127.0.0.1, indexed by the service); `kv-indexer demo-prompt N | curl -d @- ...` asks it
about a prompt it served. `demo-offline` runs everything in this process and prints.
`python -m indexer` runs this same command line.
"""


def _natural(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def build_parser(prog: str = "kv-indexer") -> argparse.ArgumentParser:
    """The one command line: ``kv-indexer`` and ``python -m indexer`` (same parser)."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="KV-aware routing index for vLLM fleets: subscribes to the engines' KV-cache events\n"
        "and answers which replica holds the longest prefix of a prompt, in which tier.",
        epilog=_COMMANDS_EPILOG,
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands",
                           help="one of the commands below; COMMAND --help for its options")
    s = sub.add_parser(
        "serve", help="run the HTTP service (--demo: with a live simulated fleet)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the HTTP service (REST API, Dynamo-compatible routes, /metrics). With --demo, also "
        "a live demo fleet: simulated vLLM engines on 127.0.0.1 publishing KV events over real ZMQ.",
        epilog=_EPILOG.format(env=_env_table()),
    )
    s.set_defaults(func=_cmd_serve)
    s.add_argument("--config", metavar="FILE", help="YAML settings file (default $KVI_CONFIG)")
    s.add_argument("--host", help=_HELP["host"] + " (default 127.0.0.1)")
    s.add_argument("--port", type=int, help=_HELP["port"] + " (default 8080)")
    s.add_argument("--engine", action="append", metavar="ID=ENDPOINT[,k=v...]",
                   help="an engine to subscribe to, e.g. vllm-0=tcp://10.0.0.5:5557,replay_endpoint="
                   "tcp://10.0.0.5:5558,model=llama,dp_size=2 (repeatable; replaces the configured list)")
    s.add_argument("--log-level", help=_HELP["log_level"])
    s.add_argument("--log-json", action="store_true", default=None, help=_HELP["log_json"])
    s.add_argument("--access-log", action="store_true", default=None, help=_HELP["access_log"])
    s.add_argument("--api-token-file", metavar="FILE", help=_HELP["api_token_file"])
    s.add_argument("--auth-reads", action="store_true", default=None, help=_HELP["auth_reads"])
    s.add_argument("--allowed-endpoint", action="append", metavar="HOST|*.DOMAIN|CIDR",
                   help="may be given several times: " + _HELP["allowed_endpoints"])
    s.add_argument("--ready-fraction", type=float, help=_HELP["ready_fraction"])
    s.add_argument("--predicted-credit", type=float, help=_HELP["predicted_credit"])
    s.add_argument("--prefill-ttl-s", type=float, help=_HELP["prefill_ttl_s"])
    s.add_argument("--decode-ttl-s", type=float, help=_HELP["decode_ttl_s"])
    s.add_argument("--max-in-flight", type=int, help=_HELP["max_in_flight"])
    s.add_argument("--max-request-tokens", type=int, help=_HELP["max_request_tokens"])
    s.add_argument("--max-nodes", type=int, help=_HELP["max_nodes"])
    s.add_argument("--replay-timeout-s", type=float, help=_HELP["replay_timeout_s"])
    s.add_argument("--state-dir", metavar="DIR", help=_HELP["state_dir"])
    s.add_argument("--snapshot-interval-s", type=float, metavar="S", help=_HELP["snapshot_interval_s"])
    s.add_argument("--bootstrap-from", metavar="URL", help=_HELP["bootstrap_from"])
    s.add_argument("--nats", dest="nats_url", metavar="URL", help=_HELP["nats_url"])
    s.add_argument("--demo", action="store_true", default=None, help=_HELP["demo"])
    s.add_argument("--demo-speedup", type=float, help=_HELP["demo_speedup"])
    s.add_argument("--tokenizer", action="append", metavar="MODEL=DIR",
                   help="may be given several times (replaces the configured map): " + _HELP["tokenizers"])
    s.add_argument("--check", action="store_true", help="validate the settings, print them as JSON and exit")

    r = sub.add_parser(
        "relay", help="subscribe to the engines and publish their batches to a NATS JetStream event log",
        description="Subscribe to the engines (the same settings as serve: --config, --engine, the environment, "
        "discovery) and publish every batch the sequencer applies to a JetStream stream, for replicas "
        "(serve --nats URL) to follow. Two relays may run side by side: the stream keeps one copy of each batch. "
        "Runs until SIGTERM or SIGINT (docs/jetstream.md).")
    r.set_defaults(func=_cmd_relay)
    r.add_argument("--config", metavar="FILE", help="YAML settings file (default $KVI_CONFIG)")
    r.add_argument("--engine", action="append", metavar="ID=ENDPOINT[,k=v...]",
                   help="an engine to subscribe to (repeatable; replaces the configured list), as for serve")
    r.add_argument("--nats", dest="nats_url", metavar="URL", help="NATS server (required here: flag, nats_url or "
                   "KVI_NATS_URL)")
    r.add_argument("--allowed-endpoint", action="append", metavar="HOST|*.DOMAIN|CIDR",
                   help="may be given several times: " + _HELP["allowed_endpoints"])
    r.add_argument("--replay-timeout-s", type=float, help=_HELP["replay_timeout_s"])
    r.add_argument("--log-level", help=_HELP["log_level"])
    r.add_argument("--log-json", action="store_true", default=None, help=_HELP["log_json"])
    r.add_argument("--check", action="store_true", help="validate the settings, print them as JSON and exit")

    q = sub.add_parser(
        "demo-prompt", help="print a /v1/match body: the prompt of request N of the live demo fleet",
        description="Print {\"token_ids\": [...]}: the prompt of request N of what the live demo fleet "
        "(serve --demo) replays: the Mooncake trace ($KVI_TRACE), or without it the same synthetic "
        "requests the fleet falls back to.")
    q.set_defaults(func=_cmd_demo_prompt)
    q.add_argument("n", type=_natural, metavar="N", help="which request, counting from 0")
    q.add_argument("--max-tokens", type=int, default=None, metavar="T",
                   help="only the first T tokens of the prompt (default: all)")

    o = sub.add_parser(
        "demo-offline", help="no service: index simulated vLLM events in this process and print answers",
        description="Build an index in this process from simulated vLLM events (4 engines, GPU and a CPU "
        "offload tier, shared prefixes, encoded exactly as vLLM encodes them), then print the /v1/match "
        "answer for a few prompts and the index stats. No service, no sockets.")
    o.set_defaults(func=_cmd_demo_offline)
    # The old name, hidden (no help: argparse leaves it out of the command list).
    old = sub.add_parser("demo", description="Deprecated: the old name of demo-offline.")
    old.set_defaults(func=_cmd_demo_offline, deprecated="demo")

    d = sub.add_parser("decode", help="decode one vLLM batch payload file and print it as JSON",
                       description="Decode one vLLM batch payload (frame 3 of a live message) and print it as "
                       "JSON: which wire layout, which events, what was ignored.")
    d.set_defaults(func=_cmd_decode)
    d.add_argument("file", metavar="FILE", help="the payload, raw msgpack bytes")

    m = sub.add_parser(
        "simulate", help="compare routing policies on simulated engines (hit rates, TTFT)",
        description="Replay requests through a fresh fleet of simulated engines once per routing policy and "
        "print, per policy: hit rates (GPU, CPU, total), prefill tokens saved, load imbalance and time to "
        "first token. Requests: the Mooncake trace ($KVI_TRACE), or synthetic ones without it.")
    m.set_defaults(func=_cmd_simulate)
    m.add_argument("--engines", type=int, metavar="N", default=8, help="simulated engines (default %(default)s)")
    m.add_argument("--dp-size", type=int, metavar="N", default=1, help="DP ranks per engine (default %(default)s)")
    m.add_argument("--requests", type=_natural, metavar="N", default=2000,
                   help="first N requests (default %(default)s; 0 = the whole trace, 12,031)")
    m.add_argument("--speedup", type=float, metavar="X", default=1.0,
                   help="divide the requests' timestamps by this (default %(default)s)")
    m.add_argument("--gpu-blocks", type=int, metavar="N", default=16384,
                   help="GPU prefix cache per DP rank, in blocks (default %(default)s)")
    m.add_argument("--cpu-blocks", type=int, metavar="N", default=0,
                   help="CPU tier per DP rank, in blocks (default 0: no CPU tier)")
    m.add_argument("--blocks-per-chunk", type=int, metavar="N", default=16,
                   help="blocks per CPU offload chunk (default %(default)s)")
    m.add_argument("--prefill-tps", type=float, metavar="TPS", default=20_000.0,
                   help="prefill speed of a worker in tokens/s, for the load model (default %(default)g)")
    m.add_argument("--policies", nargs="+", default=["round_robin", "least_loaded", "index", "index_no_load",
                                                      "oracle"],
                   choices=["round_robin", "least_loaded", "index", "index_no_load", "index_cache_only", "oracle"],
                   metavar="POLICY",
                   help="routing policies to compare: round_robin, least_loaded, index (with the backlog as load), "
                   "index_no_load (the index's own bookkeeping), index_cache_only, oracle (sees every cache and "
                   "queue) (default: all but index_cache_only)")
    m.add_argument("--event-delay-s", type=float, metavar="S", default=0.05,
                   help="a request's KV events reach the index this long after its prefill ends (default %(default)s)")
    m.add_argument("--json", action="store_true", help="print the reports as JSON")
    return p


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def log_config(settings: Settings) -> dict[str, Any]:
    """A logging dictConfig for our loggers and uvicorn's, plain or JSON lines."""
    fmt = {"()": _JsonFormatter} if settings.log_json else {
        "format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    level = settings.log_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": fmt},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}},
        "loggers": {
            "kv_indexer": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["stderr"], "level": level, "propagate": False},
        },
    }


def _fd_limit(max_workers: int) -> None:
    """Raise the soft open-files limit to what ``max_workers`` may need (up to 4 sockets
    a worker, plus HTTP connections), within the hard limit; warn when that is short."""
    import resource

    need = 4 * max_workers + 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    new = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        new = soft
    if new < need:
        logging.getLogger("kv_indexer.api").warning(
            "open files limited to %d (hard limit %s): max_workers=%d may need %d; lower max_workers or raise "
            "the limit", new, hard, max_workers, need)


def serve(settings: Settings) -> None:
    import uvicorn

    from api.app import create_app

    logging.config.dictConfig(log_config(settings))
    _fd_limit(settings.max_workers)
    fleet = router = None
    index = None
    if settings.demo:
        if settings.state_dir or settings.bootstrap_from:
            # Its engines are new processes on new ports at every start: a snapshot of the
            # last run's would name engines that are gone.
            logging.getLogger("kv_indexer.demo").warning(
                "demo: state_dir and bootstrap_from are ignored: the demo fleet is new (other ports, empty caches) "
                "at every start")
            import msgspec

            settings = msgspec.structs.replace(settings, state_dir=None, bootstrap_from=None)
        settings, index, fleet, router = start_demo(settings)
    from indexer.text.tokenizer import TokenizerLoadError

    try:
        app = create_app(settings, index)
    except TokenizerLoadError as e:  # a tokenizer directory that cannot be read: named, like a bad setting
        if fleet is not None:
            fleet.close()
        print(f"kv-indexer: setting 'tokenizers': {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if router is not None:
        router.svc = app.state.service  # its decisions and timings, for the live page (/ui)
    try:
        _run(uvicorn, app, settings)
    finally:
        if fleet is not None:
            fleet.close()


def start_demo(settings: Settings):
    """A simulated fleet on 127.0.0.1 replaying the trace (routed by this index), its
    engines added to the settings. Returns (settings, index, fleet, router)."""
    import msgspec

    from api.ui import demo_router
    from indexer import PrefixIndex
    from indexer.producer.sim import Fleet
    from indexer.wire.engines import EngineConfig

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
    logging.getLogger("kv_indexer.demo").info(
        "demo: %d simulated engines x %d DP ranks replaying %s", settings.demo_engines, settings.demo_dp_size, what)
    return settings, index, fleet, router


def _demo_tokenizer(settings: Settings, models: set[str]) -> Settings:
    """The demo's models get a small tokenizer built now (indexer/producer/tokenizer.py),
    so prompt and messages requests work against it; not without the text extra."""
    import msgspec

    from indexer.producer import tokenizer

    missing = sorted(models - set(settings.tokenizers))
    if not missing:
        return settings
    path = tokenizer.build(os.path.join(tempfile.mkdtemp(prefix="kvi-demo-"), "tokenizer"))
    log = logging.getLogger("kv_indexer.demo")
    if path is None:
        log.info("demo: no tokenizer (install the text extra for prompt/messages requests): token_ids only")
        return settings
    log.info("demo: tokenizer for model(s) %s built at %s (prompt and messages requests work)",
             ", ".join(missing), path)
    return msgspec.structs.replace(settings, tokenizers={**settings.tokenizers, **dict.fromkeys(missing, path)})


def demo_requests(speedup: float = 10.0):
    """What the demo fleet replays: ``(source, description, from_trace)``, ``source()``
    giving a fresh iterator of requests. The Mooncake trace (``$KVI_TRACE``) if it exists,
    else synthetic requests at the trace's mean rate (3.3/s) times ``speedup``; their
    prompts do not depend on ``speedup`` (``demo-prompt`` relies on it)."""
    from indexer.producer.sim import TRACE, synthetic_requests, trace_requests

    if TRACE.exists():
        return (lambda: trace_requests(TRACE, speedup=speedup)), f"the Mooncake trace at {speedup:g}x", True
    return ((lambda: synthetic_requests(10**9, rate=3.3 * speedup)), f"synthetic requests (no trace at {TRACE})",
            False)


SWITCH_INTERVAL_S = 0.0002
# pymalloc arenas (1 MiB each) kept faulted in ahead of use (indexer/_prefault.c): 4 MiB
# of RSS (up to 8 when pymalloc frees arenas), ~80 ms of growth at 10^6 blocks/s (an arena
# holds ~21k nodes): the thread refills in ~0.5 ms each.
PREFAULT_ARENAS = 4


def _run(uvicorn, app, settings: Settings) -> None:
    # Everything loaded so far (modules, the app, settings) lives as long as the
    # process: out of the cycle collector's view, a full collection walks only what
    # requests and ingest create (the index's nodes and maps are never tracked).
    try:  # the hot routes answered by the HTTP protocol itself (api/http1.py)
        from api.http1 import bind

        http: Any = bind(app)
    except ImportError:  # no httptools: uvicorn's own choice
        http = "auto"
    # Queries (the event loop thread) and ingest (its own thread) share the GIL. A thread
    # that wants it waits until the holder blocks or the switch interval (5 ms by
    # default) runs out: under sustained ingest that wait was the query p99 (2.7 ms at
    # 150k blocks/s, bench_services.py --mode load). 0.2 ms bounds it (p99 at 150k
    # blocks/s: 1.1 ms against 1.5 ms at 0.5 ms, two paired runs); the cost, a GIL handoff
    # per 0.2 ms while both threads run, is within noise for ingest.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from indexer._native import prefault_arenas

    prefault_arenas(PREFAULT_ARENAS)
    gc.freeze()
    uvicorn.run(
        app,
        http=http,
        host=settings.host,
        port=settings.port,
        workers=1,  # the index lives in this process
        log_config=log_config(settings),
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        server_header=False,
        timeout_graceful_shutdown=5,
    )


def _cmd_demo_prompt(args: argparse.Namespace) -> int:
    import itertools

    from indexer.producer.sim import TRACE

    source, _, from_trace = demo_requests()
    req = next(itertools.islice(source(), args.n, None), None)
    if req is None:
        print(f"{args.prog}: the trace at {TRACE} has fewer than {args.n + 1} requests", file=sys.stderr)
        return 2
    if not from_trace:
        print(f"{args.prog}: no trace at {TRACE}: request {args.n} of the synthetic requests the demo fleet "
              "replays without it", file=sys.stderr)
    tokens = req.tokens if args.max_tokens is None else req.tokens[: args.max_tokens]
    print(json.dumps({"token_ids": tokens}))
    return 0


def _cmd_demo_offline(args: argparse.Namespace) -> int:
    from indexer.producer.offline import demo

    if getattr(args, "deprecated", None):
        print(f"{args.prog}: '{args.deprecated}' is deprecated, it is now 'demo-offline' "
              "(the live demo fleet is 'serve --demo')", file=sys.stderr)
    demo()
    return 0


def _cmd_decode(args: argparse.Namespace) -> int:
    from .decode_tool import decode

    return decode(args.file)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from indexer.producer.sim import TRACE, compare_policies, synthetic_requests, trace_requests

    if TRACE.exists():
        reqs = list(trace_requests(TRACE, limit=args.requests or None, speedup=args.speedup))
        kind = "trace"
    else:
        n = args.requests or 2000
        print(f"{args.prog}: no trace at {TRACE} (set KVI_TRACE): {n} synthetic requests", file=sys.stderr)
        reqs = list(synthetic_requests(n, rate=3.3 * args.speedup))
        kind = "synthetic"
    reports = compare_policies(reqs, args.engines, policies=args.policies, dp_size=args.dp_size,
                               prefill_tps=args.prefill_tps, gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                               blocks_per_chunk=args.blocks_per_chunk, event_delay_s=args.event_delay_s)
    sums = [r.summary() for r in reports]
    if args.json:
        print(json.dumps(sums, indent=2))
        return 0
    print(f"{len(reqs)} {kind} requests, {args.engines} engines x {args.dp_size} DP, GPU {args.gpu_blocks} blocks, "
          f"CPU {args.cpu_blocks} blocks")
    print(f"{'policy':<18}{'hit':>8}{'GPU hit':>9}{'CPU hit':>9}{'saved tokens':>15}{'imbalance':>11}"
          f"{'TTFT mean':>11}{'TTFT p90':>10}{'TTFT p99':>10}")
    for s in sums:
        print(f"{s['policy']:<18}{s['hit_rate']:>8.1%}{s['gpu_hit_rate']:>9.1%}{s['cpu_hit_rate']:>9.1%}"
              f"{s['prefill_tokens_saved']:>15,}{s['load_imbalance']:>11.2f}{s['ttft_mean_s']:>10.2f}s"
              f"{s['ttft_p90_s']:>9.2f}s{s['ttft_p99_s']:>9.2f}s")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "log_json": args.log_json,
        "access_log": args.access_log,
        "max_request_tokens": args.max_request_tokens,
        "max_nodes": args.max_nodes,
        "replay_timeout_s": args.replay_timeout_s,
        "demo": args.demo,
        "demo_speedup": args.demo_speedup,
        "api_token_file": args.api_token_file,
        "auth_reads": args.auth_reads,
        "allowed_endpoints": args.allowed_endpoint,
        "ready_fraction": args.ready_fraction,
        "predicted_credit": args.predicted_credit,
        "prefill_ttl_s": args.prefill_ttl_s,
        "decode_ttl_s": args.decode_ttl_s,
        "max_in_flight": args.max_in_flight,
        "state_dir": args.state_dir,
        "snapshot_interval_s": args.snapshot_interval_s,
        "bootstrap_from": args.bootstrap_from,
        "nats_url": args.nats_url,
    }
    if args.tokenizer:
        pairs = [t.partition("=") for t in args.tokenizer]
        bad = [t for t, (m, eq, d) in zip(args.tokenizer, pairs) if not (m and eq and d)]
        if bad:
            print(f"{args.prog}: --tokenizer {bad[0]!r}: expected MODEL=DIR", file=sys.stderr)
            return 2
        overrides["tokenizers"] = {m: d for m, _, d in pairs}
    settings = _settings(args, overrides)
    if not isinstance(settings, Settings):
        return settings
    serve(settings)  # FastAPI and uvicorn are imported here, not before
    return 0


def _settings(args: argparse.Namespace, overrides: dict[str, Any],
              check: Callable[[Settings], None] | None = None) -> Settings | int:
    """The settings of ``serve`` or ``relay`` (file, environment, flags), or the exit code:
    2 after printing why they are bad, 0 after printing them (``--check``)."""
    try:
        if args.engine:
            overrides["engines"] = [parse_engine_spec(e) for e in args.engine]
        settings = load_settings(args.config, overrides)
        if check is not None:
            check(settings)
    except SettingsError as e:
        print(f"{args.prog}: {e}", file=sys.stderr)
        return 2
    if args.check:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(settings.redacted())).decode())
        return 0
    return settings


def _cmd_relay(args: argparse.Namespace) -> int:
    """``kv-indexer relay``: engines in (ZMQ), the JetStream event log out, until SIGTERM/SIGINT."""
    overrides: dict[str, Any] = {"nats_url": args.nats_url, "log_level": args.log_level,
                                 "log_json": args.log_json, "allowed_endpoints": args.allowed_endpoint,
                                 "replay_timeout_s": args.replay_timeout_s}

    def needs_nats(s: Settings) -> None:
        if not s.nats_url:
            raise SettingsError("relay needs a NATS server: --nats URL (or nats_url, KVI_NATS_URL)")

    settings = _settings(args, overrides, needs_nats)
    if not isinstance(settings, Settings):
        return settings
    import signal
    import threading

    from indexer.ingest.relay import Relay  # nats is imported here only

    cfg = log_config(settings)
    cfg["loggers"]["indexer"] = {"handlers": ["stderr"], "level": settings.log_level.upper(), "propagate": False}
    logging.config.dictConfig(cfg)
    log = logging.getLogger("kv_indexer.relay")
    _fd_limit(settings.max_workers)
    url = settings.nats_url or ""  # needs_nats checked it is set
    relay = Relay(settings.engines, url=url, stream=settings.nats_stream, subject=settings.nats_subject,
                  replay_timeout_s=settings.replay_timeout_s, max_workers=settings.max_workers,
                  endpoint_policy=settings.endpoint_policy(), metrics_interval_s=settings.metrics_interval_s)
    discovery = None
    d = settings.discovery
    if d is not None:
        from indexer.transport.discovery import DnsDiscovery

        discovery = DnsDiscovery(relay, d.dns_name, port=d.port, replay_port=d.replay_port,
                                 metrics_port=d.metrics_port, dp_size=d.dp_size, model=d.model, topic=d.topic,
                                 interval_s=d.interval_s, grace_s=d.grace_s)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    relay.start()
    if discovery is not None:
        discovery.start()
    log.info("relay: %d engine(s) configured%s, publishing to stream %s (subject %s)", len(settings.engines),
             f", discovering {d.dns_name}" if d is not None else "", settings.nats_stream, settings.nats_subject)
    rc = 0
    while not done.wait(1.0):
        if not relay.running:
            log.error("relay: ingest stopped: %s", relay.error)
            rc = 1
            break
    if discovery is not None:
        discovery.stop()
    relay.stop()
    log.info("relay stopped: %s", relay.counters)
    return rc


def main(argv: list[str] | None = None, prog: str = "kv-indexer") -> int:
    """``kv-indexer`` (the console script) and ``python -m indexer`` (``prog``)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    args.prog = prog
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
