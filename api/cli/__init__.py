"""``kv-indexer``: the one command line (``python -m indexer`` runs the same parser).

* ``serve``: the HTTP service (uvicorn, one worker: the index lives in this process's
  memory); ``serve --demo`` adds the live demo fleet (simulated engines publishing over ZMQ).
* ``relay --nats URL``: subscribe to the engines and publish their batches to a NATS
  JetStream event log that ``serve --nats URL`` replicas follow (``docs/jetstream.md``).
* ``demo-prompt N``: a ``/v1/match`` body with the prompt of the demo fleet's request N.
* ``demo-offline``: no service, an index built in this process from simulated events.
* ``decode FILE``: one vLLM batch payload as JSON.
* ``simulate``: routing policies compared on simulated engines (``indexer.producer.sim``).

The parser and ``main`` are here; ``serve`` is :mod:`api.cli.serve`, the other commands
:mod:`api.cli.tools` (the demo's through :mod:`api.demo`). FastAPI and uvicorn are
imported only on the ``serve`` path: the other commands stay light. Each serve and relay
option's help is its setting's (``api.settings.FIELDS``).
"""

from __future__ import annotations

import argparse
import json
import sys

from api.cli import tools
from api.cli.serve import cmd_serve
from api.settings import ENV_PREFIX, FIELDS, Settings

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
    for name, help_text in FIELDS.items():
        default = getattr(d, name)
        shown = json.dumps(default) if name in ("credits", "engines") else default
        if name == "engines":
            shown = "[]"
        if name in ("discovery", "api_token", "api_token_file"):
            shown = "none"
        if name == "allowed_endpoints":
            shown = "[] (any host)"
        lines.append(f"  {ENV_PREFIX + name.upper():<24} {help_text} (default {shown})")
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
    s.set_defaults(func=cmd_serve)
    s.add_argument("--config", metavar="FILE", help="YAML settings file (default $KVI_CONFIG)")
    s.add_argument("--host", help=FIELDS["host"] + " (default 127.0.0.1)")
    s.add_argument("--port", type=int, help=FIELDS["port"] + " (default 8080)")
    s.add_argument("--engine", action="append", metavar="ID=ENDPOINT[,k=v...]",
                   help="an engine to subscribe to, e.g. vllm-0=tcp://10.0.0.5:5557,replay_endpoint="
                   "tcp://10.0.0.5:5558,model=llama,dp_size=2 (repeatable; replaces the configured list)")
    s.add_argument("--log-level", help=FIELDS["log_level"])
    s.add_argument("--log-json", action="store_true", default=None, help=FIELDS["log_json"])
    s.add_argument("--access-log", action="store_true", default=None, help=FIELDS["access_log"])
    s.add_argument("--api-token-file", metavar="FILE", help=FIELDS["api_token_file"])
    s.add_argument("--auth-reads", action="store_true", default=None, help=FIELDS["auth_reads"])
    s.add_argument("--allowed-endpoint", action="append", metavar="HOST|*.DOMAIN|CIDR",
                   help="may be given several times: " + FIELDS["allowed_endpoints"])
    s.add_argument("--ready-fraction", type=float, help=FIELDS["ready_fraction"])
    s.add_argument("--predicted-credit", type=float, help=FIELDS["predicted_credit"])
    s.add_argument("--replica-slot", metavar="SLOT/N", help=FIELDS["replica_slot"])
    s.add_argument("--prefill-ttl-s", type=float, help=FIELDS["prefill_ttl_s"])
    s.add_argument("--decode-ttl-s", type=float, help=FIELDS["decode_ttl_s"])
    s.add_argument("--max-in-flight", type=int, help=FIELDS["max_in_flight"])
    s.add_argument("--max-request-tokens", type=int, help=FIELDS["max_request_tokens"])
    s.add_argument("--max-nodes", type=int, help=FIELDS["max_nodes"])
    s.add_argument("--replay-timeout-s", type=float, help=FIELDS["replay_timeout_s"])
    s.add_argument("--state-dir", metavar="DIR", help=FIELDS["state_dir"])
    s.add_argument("--snapshot-interval-s", type=float, metavar="S", help=FIELDS["snapshot_interval_s"])
    s.add_argument("--bootstrap-from", metavar="URL", help=FIELDS["bootstrap_from"])
    s.add_argument("--nats", dest="nats_url", metavar="URL", help=FIELDS["nats_url"])
    s.add_argument("--route-sync", metavar="URL", help=FIELDS["route_sync"])
    s.add_argument("--route-sync-token-file", metavar="FILE", help=FIELDS["route_sync_token_file"])
    s.add_argument("--route-sync-creds", metavar="FILE", help=FIELDS["route_sync_creds"])
    s.add_argument("--demo", action="store_true", default=None, help=FIELDS["demo"])
    s.add_argument("--demo-speedup", type=float, help=FIELDS["demo_speedup"])
    s.add_argument("--tokenizer", action="append", metavar="MODEL=DIR",
                   help="may be given several times (replaces the configured map): " + FIELDS["tokenizers"])
    s.add_argument("--check", action="store_true", help="validate the settings, print them as JSON and exit")

    r = sub.add_parser(
        "relay", help="subscribe to the engines and publish their batches to a NATS JetStream event log",
        description="Subscribe to the engines (the same settings as serve: --config, --engine, the environment, "
        "discovery) and publish every batch the sequencer applies to a JetStream stream, for replicas "
        "(serve --nats URL) to follow. Two relays may run side by side: the stream keeps one copy of each batch. "
        "Runs until SIGTERM or SIGINT (docs/jetstream.md).")
    r.set_defaults(func=tools.cmd_relay)
    r.add_argument("--config", metavar="FILE", help="YAML settings file (default $KVI_CONFIG)")
    r.add_argument("--engine", action="append", metavar="ID=ENDPOINT[,k=v...]",
                   help="an engine to subscribe to (repeatable; replaces the configured list), as for serve")
    r.add_argument("--nats", dest="nats_url", metavar="URL", help="NATS server (required here: flag, nats_url or "
                   "KVI_NATS_URL)")
    r.add_argument("--allowed-endpoint", action="append", metavar="HOST|*.DOMAIN|CIDR",
                   help="may be given several times: " + FIELDS["allowed_endpoints"])
    r.add_argument("--replay-timeout-s", type=float, help=FIELDS["replay_timeout_s"])
    r.add_argument("--log-level", help=FIELDS["log_level"])
    r.add_argument("--log-json", action="store_true", default=None, help=FIELDS["log_json"])
    r.add_argument("--check", action="store_true", help="validate the settings, print them as JSON and exit")

    q = sub.add_parser(
        "demo-prompt", help="print a /v1/match body: the prompt of request N of the live demo fleet",
        description="Print {\"token_ids\": [...]}: the prompt of request N of what the live demo fleet "
        "(serve --demo) replays: the Mooncake trace ($KVI_TRACE), or without it the same synthetic "
        "requests the fleet falls back to.")
    q.set_defaults(func=tools.cmd_demo_prompt)
    q.add_argument("n", type=_natural, metavar="N", help="which request, counting from 0")
    q.add_argument("--max-tokens", type=int, default=None, metavar="T",
                   help="only the first T tokens of the prompt (default: all)")

    o = sub.add_parser(
        "demo-offline", help="no service: index simulated vLLM events in this process and print answers",
        description="Build an index in this process from simulated vLLM events (4 engines, GPU and a CPU "
        "offload tier, shared prefixes, encoded exactly as vLLM encodes them), then print the /v1/match "
        "answer for a few prompts and the index stats. No service, no sockets.")
    o.set_defaults(func=tools.cmd_demo_offline)
    # The old name, hidden (no help: argparse leaves it out of the command list).
    old = sub.add_parser("demo", description="Deprecated: the old name of demo-offline.")
    old.set_defaults(func=tools.cmd_demo_offline, deprecated="demo")

    d = sub.add_parser("decode", help="decode one vLLM batch payload file and print it as JSON",
                       description="Decode one vLLM batch payload (frame 3 of a live message) and print it as "
                       "JSON: which wire layout, which events, what was ignored.")
    d.set_defaults(func=tools.cmd_decode)
    d.add_argument("file", metavar="FILE", help="the payload, raw msgpack bytes")

    m = sub.add_parser(
        "simulate", help="compare routing policies on simulated engines (hit rates, TTFT)",
        description="Replay requests through a fresh fleet of simulated engines once per routing policy and "
        "print, per policy: hit rates (GPU, CPU, total), prefill tokens saved, load imbalance and time to "
        "first token. Requests: the Mooncake trace ($KVI_TRACE), or synthetic ones without it.")
    m.set_defaults(func=tools.cmd_simulate)
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


def main(argv: list[str] | None = None, prog: str = "kv-indexer") -> int:
    """``kv-indexer`` (the console script) and ``python -m indexer`` (``prog``)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    args.prog = prog
    return args.func(args)
