"""The commands besides ``serve``: ``relay`` (engines in, the JetStream event log out),
``decode`` (one vLLM batch payload printed as JSON), and the demo's ``demo-prompt``,
``demo-offline`` and ``simulate`` (run by :mod:`api.demo`, the one module that imports
the producer side)."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import sys
from typing import Any, TextIO

import msgspec

from api.cli.serve import fd_limit, log_config, settings_of
from api.settings import Settings, SettingsError
from indexer.wire.decode import DecodeError, decode_batch, decode_tokens


def cmd_demo_prompt(args: argparse.Namespace) -> int:
    from api import demo

    req, from_trace, trace = demo.prompt(args.n)
    if req is None:
        print(f"{args.prog}: the trace at {trace} has fewer than {args.n + 1} requests", file=sys.stderr)
        return 2
    if not from_trace:
        print(f"{args.prog}: no trace at {trace}: request {args.n} of the synthetic requests the demo fleet "
              "replays without it", file=sys.stderr)
    tokens = req.tokens if args.max_tokens is None else req.tokens[: args.max_tokens]
    print(json.dumps({"token_ids": tokens}))
    return 0


def cmd_demo_offline(args: argparse.Namespace) -> int:
    from api import demo

    if getattr(args, "deprecated", None):
        print(f"{args.prog}: '{args.deprecated}' is deprecated, it is now 'demo-offline' "
              "(the live demo fleet is 'serve --demo')", file=sys.stderr)
    demo.offline()
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    return decode(args.file)


def decode(path: str, out: TextIO = sys.stdout) -> int:
    """Print the batch payload in file ``path`` as one JSON line to ``out``; the exit code
    (2: unreadable, 1: not a batch)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        out.write(json.dumps({"error": f"cannot read {path}: {e.strerror}"}) + "\n")
        return 2
    try:
        b = decode_batch(data)
    except DecodeError as e:
        out.write(json.dumps({"error": str(e), "reason": e.reason}) + "\n")
        return 1
    events = []
    for ev in b.events:
        d = {f: getattr(ev, f) for f in ev.__struct_fields__}
        d["type"] = type(ev).__struct_config__.tag
        if "token_ids" in d:
            d["token_ids"] = decode_tokens(d["token_ids"])
        events.append(d)
    doc = {"ts": b.ts, "dp_rank": b.dp_rank, "layout": b.layout, "ignored": b.issues, "events": events}
    out.write(msgspec.json.encode(doc, enc_hook=lambda o: o.hex() if isinstance(o, bytes) else str(o)).decode() + "\n")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from api import demo

    sums, what = demo.simulate(args.requests, args.speedup, lambda msg: print(f"{args.prog}: {msg}", file=sys.stderr),
                               engines=args.engines, policies=args.policies, dp_size=args.dp_size,
                               prefill_tps=args.prefill_tps, gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                               blocks_per_chunk=args.blocks_per_chunk, event_delay_s=args.event_delay_s)
    if args.json:
        print(json.dumps(sums, indent=2))
        return 0
    print(f"{what} requests, {args.engines} engines x {args.dp_size} DP, GPU {args.gpu_blocks} blocks, "
          f"CPU {args.cpu_blocks} blocks")
    print(f"{'policy':<18}{'hit':>8}{'GPU hit':>9}{'CPU hit':>9}{'saved tokens':>15}{'imbalance':>11}"
          f"{'TTFT mean':>11}{'TTFT p90':>10}{'TTFT p99':>10}")
    for s in sums:
        print(f"{s['policy']:<18}{s['hit_rate']:>8.1%}{s['gpu_hit_rate']:>9.1%}{s['cpu_hit_rate']:>9.1%}"
              f"{s['prefill_tokens_saved']:>15,}{s['load_imbalance']:>11.2f}{s['ttft_mean_s']:>10.2f}s"
              f"{s['ttft_p90_s']:>9.2f}s{s['ttft_p99_s']:>9.2f}s")
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """``kv-indexer relay``: engines in (ZMQ), the JetStream event log out, until SIGTERM/SIGINT."""
    overrides: dict[str, Any] = {"nats_url": args.nats_url, "log_level": args.log_level,
                                 "log_json": args.log_json, "allowed_endpoints": args.allowed_endpoint,
                                 "replay_timeout_s": args.replay_timeout_s}

    def needs_nats(s: Settings) -> None:
        if not s.nats_url:
            raise SettingsError("relay needs a NATS server: --nats URL (or nats_url, KVI_NATS_URL)")

    settings = settings_of(args, overrides, needs_nats)
    if not isinstance(settings, Settings):
        return settings
    import signal
    import threading

    from indexer.ingest.relay import Relay  # nats is imported here only

    cfg = log_config(settings)
    cfg["loggers"]["indexer"] = {"handlers": ["stderr"], "level": settings.log_level.upper(), "propagate": False}
    logging.config.dictConfig(cfg)
    log = logging.getLogger("kv_indexer.relay")
    fd_limit(settings.max_workers)
    url = settings.nats_url or ""  # needs_nats checked it is set
    relay = Relay(settings.engines, url=url, stream=settings.nats_stream, subject=settings.nats_subject,
                  replay_timeout_s=settings.replay_timeout_s, max_workers=settings.max_workers,
                  rcvhwm=settings.rcvhwm, endpoint_policy=settings.endpoint_policy(),
                  metrics_interval_s=settings.metrics_interval_s)
    from api.discovery import discovery_for

    discovery = discovery_for(settings, relay)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    relay.start()
    discovery.start()
    log.info("relay: %d engine(s) configured%s, publishing to stream %s (subject %s)", len(settings.engines),
             f", discovering {discovery.name}" if discovery.name else "", settings.nats_stream, settings.nats_subject)
    rc = 0
    while not done.wait(1.0):
        if not relay.running:
            log.error("relay: ingest stopped: %s", relay.error)
            rc = 1
            break
    discovery.stop()
    relay.stop()
    log.info("relay stopped: %s", relay.counters)
    return rc
