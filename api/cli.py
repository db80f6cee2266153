"""``kv-indexer``: the service's command line.

``kv-indexer serve`` runs the HTTP service (uvicorn, one worker: the index lives in this
process's memory). ``kv-indexer demo`` and ``kv-indexer decode FILE`` are the core
library's tools (``python -m indexer``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import logging.config
import sys
import time
from typing import Any

from .settings import ENV_PREFIX, FIELDS, Settings, SettingsError, load_settings, parse_engine_spec

_HELP = {
    "host": "listen address",
    "port": "listen port",
    "engines": "engines to subscribe to at start (list of {id, endpoint, model, replay_endpoint, topic, dp_size})",
    "discovery": "engines by DNS: {dns_name, port, replay_port, dp_size, model, topic, interval_s, grace_s}",
    "credits": "score credit per block per tier (JSON object in the environment)",
    "stale_factor": "multiplier on a stale worker's score when ranking, 0..1",
    "max_orphans": "stores waiting for their parent, at most (the oldest go first)",
    "orphan_ttl_s": "seconds a store may wait for its parent",
    "max_nodes": "node cap per prefix tree (model x KV-cache group); 0 = no cap",
    "max_request_tokens": "tokens (or block keys) per query, at most; more gets 413",
    "max_request_bytes": "request body bytes, at most; more gets 413",
    "replay_timeout_s": "seconds a replay may take before the worker is marked stale",
    "max_workers": "engine DP ranks subscribed at once, at most (each holds up to 4 sockets)",
    "ready_fraction": "/readyz: share of subscribed workers that must be connected and not replaying, 0..1",
    "prefill_load_scale": "/v1/route cost weight of uncached prefill blocks",
    "log_level": "critical, error, warning, info or debug",
    "log_json": "log one JSON object per line",
    "access_log": "log every HTTP request",
    "fast_path": "answer the query routes ahead of FastAPI's middleware (same answers, less latency)",
    "demo": "also run a simulated fleet replaying the Mooncake trace (its engines are added)",
    "demo_engines": "demo: simulated engines",
    "demo_dp_size": "demo: DP ranks per engine",
    "demo_speedup": "demo: divide the trace's timestamps by this",
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
        if name == "discovery":
            shown = "none"
        lines.append(f"  {ENV_PREFIX + name.upper():<24} {_HELP.get(name, '')} (default {shown})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-indexer",
        description="KV-aware routing index for vLLM fleets: subscribes to the engines' KV-cache events "
        "and answers which replica holds the longest prefix of a prompt, in which tier.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    s = sub.add_parser(
        "serve", help="run the HTTP service", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the HTTP service (REST API, Dynamo-compatible routes, /metrics).",
        epilog=_EPILOG.format(env=_env_table()),
    )
    s.add_argument("--config", metavar="FILE", help="YAML settings file (default $KVI_CONFIG)")
    s.add_argument("--host", help=_HELP["host"] + " (default 127.0.0.1)")
    s.add_argument("--port", type=int, help=_HELP["port"] + " (default 8080)")
    s.add_argument("--engine", action="append", metavar="ID=ENDPOINT[,k=v...]",
                   help="an engine to subscribe to, e.g. vllm-0=tcp://10.0.0.5:5557,replay_endpoint="
                   "tcp://10.0.0.5:5558,model=llama,dp_size=2 (repeatable; replaces the configured list)")
    s.add_argument("--log-level", help=_HELP["log_level"])
    s.add_argument("--log-json", action="store_true", default=None, help=_HELP["log_json"])
    s.add_argument("--access-log", action="store_true", default=None, help=_HELP["access_log"])
    s.add_argument("--max-request-tokens", type=int, help=_HELP["max_request_tokens"])
    s.add_argument("--max-nodes", type=int, help=_HELP["max_nodes"])
    s.add_argument("--replay-timeout-s", type=float, help=_HELP["replay_timeout_s"])
    s.add_argument("--demo", action="store_true", default=None, help=_HELP["demo"])
    s.add_argument("--demo-speedup", type=float, help=_HELP["demo_speedup"])
    s.add_argument("--check", action="store_true", help="validate the settings, print them as JSON and exit")
    sub.add_parser("demo", help="build an index from simulated vLLM events and print what a router gets back")
    d = sub.add_parser("decode", help="decode one vLLM batch payload file and print it as JSON")
    d.add_argument("file")
    q = sub.add_parser("demo-prompt", help="print a /v1/match body with the prompt of trace request N "
                       "(what the demo fleet serves), e.g. | curl -d @- localhost:8080/v1/match")
    q.add_argument("n", type=int)
    q.add_argument("--max-tokens", type=int, default=None)
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


def serve(settings: Settings) -> None:
    import uvicorn

    from .app import create_app

    logging.config.dictConfig(log_config(settings))
    fleet = None
    index = None
    if settings.demo:
        settings, index, fleet = start_demo(settings)
    app = create_app(settings, index)
    try:
        _run(uvicorn, app, settings)
    finally:
        if fleet is not None:
            fleet.close()


def start_demo(settings: Settings):
    """A simulated fleet on 127.0.0.1 replaying the trace (routed by this index), its
    engines added to the settings. Returns (settings, index, fleet)."""
    import msgspec

    from indexer import PrefixIndex
    from indexer.engines import EngineConfig
    from indexer.producer.sim import TRACE, Fleet, IndexRouter, synthetic_requests, trace_requests

    # A replay ring of 200 batches per worker covers the start-up (a late join is repaired
    # from it) without holding ~90 KB per served request for long.
    fleet = Fleet(settings.demo_engines, settings.demo_dp_size, gpu_blocks=4096, cpu_blocks=32768,
                  blocks_per_chunk=16, buffer_steps=200)
    engines = settings.engines + tuple(EngineConfig(**c) for c in fleet.engine_configs())
    settings = msgspec.structs.replace(settings, engines=engines)
    index = PrefixIndex(**settings.index_options())
    for c in engines:  # known before the first event, so the router can pick them
        for r in c.ranks:
            index.register_worker(c.id, r, model=c.model)
    if TRACE.exists():
        source = lambda: trace_requests(speedup=settings.demo_speedup)  # noqa: E731
        what = f"the Mooncake trace at {settings.demo_speedup:g}x"
    else:
        source = lambda: synthetic_requests(10**9, rate=3.3 * settings.demo_speedup)  # noqa: E731
        what = f"synthetic requests (no trace at {TRACE})"
    fleet.run(source, IndexRouter(index), loop=True)
    logging.getLogger("kv_indexer.demo").info(
        "demo: %d simulated engines x %d DP ranks replaying %s", settings.demo_engines, settings.demo_dp_size, what)
    return settings, index, fleet


def _run(uvicorn, app, settings: Settings) -> None:
    # Everything loaded so far (modules, the app, settings) lives as long as the
    # process: out of the cycle collector's view, a full collection walks only what
    # requests and ingest create (the index's nodes and maps are never tracked).
    gc.freeze()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,  # the index lives in this process
        log_config=log_config(settings),
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        server_header=False,
        timeout_graceful_shutdown=5,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "demo-prompt":
        from indexer.producer.sim import TRACE, trace_requests

        if not TRACE.exists():
            print(f"kv-indexer: no trace at {TRACE} (set KVI_TRACE)", file=sys.stderr)
            return 2
        for i, req in enumerate(trace_requests(TRACE, limit=args.n + 1, max_tokens=args.max_tokens)):
            if i == args.n:
                print(json.dumps({"token_ids": req.tokens}))
                return 0
        print(f"kv-indexer: the trace has fewer than {args.n + 1} requests", file=sys.stderr)
        return 2
    if args.cmd in ("demo", "decode"):
        from indexer.__main__ import main as core_main

        return core_main([args.cmd] + ([args.file] if args.cmd == "decode" else []))
    if args.cmd != "serve":
        build_parser().print_help()
        return 2
    try:
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
        }
        if args.engine:
            overrides["engines"] = [parse_engine_spec(e) for e in args.engine]
        settings = load_settings(args.config, overrides)
    except SettingsError as e:
        print(f"kv-indexer: {e}", file=sys.stderr)
        return 2
    if args.check:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(settings)).decode())
        return 0
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
