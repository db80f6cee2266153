"""``kv-indexer serve``: settings from the file, the environment and the flags, logging,
then the service under uvicorn (one worker: the index lives in this process's memory).

FastAPI and uvicorn are imported only when the service runs: the other commands stay light.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import logging.config
import sys
import time
from collections.abc import Callable
from typing import Any

from api.settings import Settings, SettingsError, load_settings, parse_engine_spec


def cmd_serve(args: argparse.Namespace) -> int:
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
        "replica_slot": args.replica_slot,
        "prefill_ttl_s": args.prefill_ttl_s,
        "decode_ttl_s": args.decode_ttl_s,
        "max_in_flight": args.max_in_flight,
        "state_dir": args.state_dir,
        "snapshot_interval_s": args.snapshot_interval_s,
        "bootstrap_from": args.bootstrap_from,
        "nats_url": args.nats_url,
        "route_sync": args.route_sync,
        "route_sync_token_file": args.route_sync_token_file,
        "route_sync_creds": args.route_sync_creds,
    }
    if args.tokenizer:
        pairs = [t.partition("=") for t in args.tokenizer]
        bad = [t for t, (m, eq, d) in zip(args.tokenizer, pairs) if not (m and eq and d)]
        if bad:
            print(f"{args.prog}: --tokenizer {bad[0]!r}: expected MODEL=DIR", file=sys.stderr)
            return 2
        overrides["tokenizers"] = {m: d for m, _, d in pairs}
    settings = settings_of(args, overrides)
    if not isinstance(settings, Settings):
        return settings
    serve(settings)  # FastAPI and uvicorn are imported here, not before
    return 0


def settings_of(args: argparse.Namespace, overrides: dict[str, Any],
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


def serve(settings: Settings) -> None:
    """Run the service (and, with ``demo``, the simulated fleet) until uvicorn stops."""
    import uvicorn

    from api.app import create_app

    logging.config.dictConfig(log_config(settings))
    fd_limit(settings.max_workers)
    fleet = router = None
    index = None
    if settings.demo:
        from api.demo import start_fleet

        settings, index, fleet, router = start_fleet(settings)
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


SWITCH_INTERVAL_S = 0.0002
# pymalloc arenas (1 MiB each) kept faulted in ahead of use (indexer/_prefault.c): 4 MiB
# of RSS (up to 8 when pymalloc frees arenas), ~80 ms of growth at 10^6 blocks/s (an arena
# holds ~21k nodes): the thread refills in ~0.5 ms each.
PREFAULT_ARENAS = 4


def _run(uvicorn, app, settings: Settings) -> None:
    # Everything loaded so far (modules, the app, settings) lives as long as the
    # process: out of the cycle collector's view, a full collection walks only what
    # requests and ingest create (the index's nodes and maps are never tracked).
    http: Any = "auto"  # uvicorn's own choice
    if settings.fast_path:
        try:  # the hot routes answered by the HTTP protocol itself (api/http1.py)
            from api.http1 import bind

            http = bind(app)
        except ModuleNotFoundError as e:  # no httptools; a uvicorn http1 does not fit raises its own ImportError
            if e.name != "httptools":
                raise
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


def fd_limit(max_workers: int) -> None:
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
