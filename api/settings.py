"""Service settings: defaults < YAML file < environment (``KVI_*``) < command-line flags.

Read once at start (``load_settings``) and validated there, so a bad value stops the
service with a message naming the setting, never a traceback later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import msgspec.inspect
from msgspec import Meta

from indexer.wire.engines import EndpointPolicy, EngineConfig

ENV_PREFIX = "KVI_"


class SettingsError(ValueError):
    """A setting is missing, of the wrong type or out of range; the message says which."""


class Discovery(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Engines found by DNS: every address of ``dns_name`` (a headless Service) is an engine."""

    dns_name: str
    port: int = 5557
    replay_port: int | None = None
    # vLLM's HTTP port on each address: its /metrics correct the in-flight load estimate.
    metrics_port: int | None = None
    api_port: int | None = None  # vLLM's OpenAI server: the gateway forwards there
    dp_size: int = 1
    model: str = "default"
    topic: str = ""
    interval_s: float = 10.0
    grace_s: float = 60.0

    def __post_init__(self) -> None:
        # msgspec names the setting ("setting 'discovery': ..."); these say the field.
        if not self.dns_name:
            raise SettingsError("dns_name must not be empty")
        for name in ("port", "replay_port"):
            v = getattr(self, name)
            if v is not None and not 1 <= v + self.dp_size - 1 <= 65535:
                raise SettingsError(f"{name}: ports {v}..{v + self.dp_size - 1} must be 1..65535")
        for name in ("metrics_port", "api_port"):
            v = getattr(self, name)
            if v is not None and not 1 <= v <= 65535:
                raise SettingsError(f"{name} must be 1..65535, got {v}")
        if not 1 <= self.dp_size <= 1024:
            raise SettingsError(f"dp_size must be 1..1024, got {self.dp_size}")
        if not self.interval_s > 0 or self.grace_s < 0:
            raise SettingsError("interval_s must be > 0 and grace_s >= 0")


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything the service can be told. Each field's ``Meta(description=...)`` is its
    one help text: ``--help``, the environment table and the flags read it (``FIELDS``)."""

    host: Annotated[str, Meta(description="listen address")] = "127.0.0.1"
    port: Annotated[int, Meta(description="listen port")] = 8080
    engines: Annotated[tuple[EngineConfig, ...], Meta(description=(
        "engines to subscribe to at start (list of {id, endpoint, model, replay_endpoint, topic, dp_size, "
        "metrics_url})"))] = ()
    # Engines found by DNS (a Kubernetes headless Service), besides the static list.
    discovery: Annotated[Discovery | None, Meta(description=(
        "engines by DNS: {dns_name, port, replay_port, metrics_port, api_port, dp_size, model, topic, interval_s, "
        "grace_s}"))] = None
    # Score credit per block served from each tier (contract R-Q-3).
    credits: Annotated[dict[str, float], Meta(description=(
        "score credit per block per tier (JSON object in the environment)"))] = msgspec.field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
    )
    stale_factor: Annotated[float, Meta(description="multiplier on a stale worker's score when ranking, 0..1")] = 0.5
    max_orphans: Annotated[int, Meta(description="stores waiting for their parent, at most (the oldest go first)")] \
        = 10_000
    orphan_ttl_s: Annotated[float, Meta(description="seconds a store may wait for its parent")] = 30.0
    # One tree per model and KV-cache group.
    max_nodes: Annotated[int, Meta(description="node cap per prefix tree (model x KV-cache group); 0 = no cap")] = 0
    max_request_tokens: Annotated[int, Meta(description=(
        "tokens (or block keys) per query, at most; more gets 413"))] = 1_000_000
    max_request_bytes: Annotated[int, Meta(description="request body bytes, at most; more gets 413")] \
        = 16 * 1024 * 1024
    replay_timeout_s: Annotated[float, Meta(description=(
        "seconds a replay may take before the worker is marked stale"))] = 5.0
    # What a burst may queue in this process between a worker's socket and the tree:
    # past it the engine keeps the backlog (its send queue, then its replay buffer).
    rcvhwm: Annotated[int, Meta(description=(
        "live batches queued per worker's socket before they are applied, at most (ZMQ RCVHWM); past it the "
        "engine holds the backlog and a batch it drops is replayed; 0 = no bound"))] = 64
    # 0 (the default): ready once ingest runs, so one unreachable engine never takes
    # the pod out of its Service; per-worker health is in /v1/workers and /metrics.
    ready_fraction: Annotated[float, Meta(description=(
        "/readyz: share of subscribed workers that must be connected and not replaying, 0..1 "
        "(0: ready once ingest runs; per-worker health is in /v1/workers and kvi_worker_health)"))] = 0.0
    api_token: Annotated[str | None, Meta(description=(
        "bearer token the mutating routes need (engine register/unregister); unset = open. "
        "Prefer the environment or a file to a flag"))] = None
    # Read once at start.
    api_token_file: Annotated[str | None, Meta(description=(
        "a file holding the token (e.g. a mounted Secret), read at start"))] = None
    auth_reads: Annotated[bool, Meta(description=(
        "every route needs the token, not only the mutating ones (probes excepted)"))] = False
    allowed_endpoints: Annotated[tuple[str, ...], Meta(description=(
        "hosts engines may be at (names, *.DOMAIN, IPs, CIDRs), checked before any connect; "
        "empty = any; engines are tcp:// only (comma-separated or a JSON list in the environment)"))] = ()
    # Sockets and file descriptors grow with it.
    max_workers: Annotated[int, Meta(description=(
        "engine DP ranks subscribed at once, at most (each holds up to 4 sockets)"))] = 2048
    # /v1/route: cost = prefill_load_scale * uncached prefill blocks + decode blocks.
    prefill_load_scale: Annotated[float, Meta(description="/v1/route cost weight of uncached prefill blocks")] = 1.0
    # 1.0: a FIFO engine will hold the block by the time a later request's prefill starts.
    predicted_credit: Annotated[float, Meta(description=(
        "score credit of a predicted block (routed to a worker, prefill not announced yet)"))] = 1.0
    # A routed request's prediction and prefill load end when its worker announces the
    # blocks, or after this (a request that never announces: aborted, evicted, lost).
    prefill_ttl_s: Annotated[float, Meta(description=(
        "seconds a route's prediction and prefill load last when its worker never announces the blocks"))] = 30.0
    decode_ttl_s: Annotated[float, Meta(description=(
        "seconds a route's decode load (max_tokens) lasts without POST /v1/route/{id}/done"))] = 300.0
    # Replicas that route in the same instant cannot see each other's decisions; each
    # starting ties at its own place spreads a burst as one router would (no herding).
    replica_slot: Annotated[str, Meta(description=(
        "this router's place among N replicas routing the same fleet, SLOT/N with 0 <= SLOT < N: where "
        "/v1/route starts a tie on cost and score (0/1 = one router: engine id, then rank)"))] = "0/1"
    # Beyond it, the oldest is forgotten (counted).
    max_in_flight: Annotated[int, Meta(description=(
        "routed requests kept in flight at most (the oldest beyond are forgotten, counted)"))] = 20_000
    metrics_interval_s: Annotated[float, Meta(description=(
        "seconds between scrapes of engines' vLLM /metrics (engines with a metrics_url)"))] = 2.0
    # The gateway (docs/gateway.md): /v1/completions and /v1/chat/completions forwarded to
    # the engines' api_url. A CPU engine's first token can take a minute under load.
    gateway_connect_timeout_s: Annotated[float, Meta(description=(
        "gateway: seconds to connect to an engine (a refusal or timeout is retried once on the next worker)"))] = 5.0
    gateway_first_token_timeout_s: Annotated[float, Meta(description=(
        "gateway: seconds an engine may take to its response headers and first chunk"))] = 300.0
    gateway_idle_timeout_s: Annotated[float, Meta(description=(
        "gateway: seconds an engine may stay silent between two chunks of a stream"))] = 120.0
    # Beyond it the next-ranked worker with room takes the request; none has room: 429.
    gateway_max_per_worker: Annotated[int, Meta(description=(
        "gateway: requests in flight to one worker at most; the next-ranked worker takes the rest, and when "
        "every worker is full the client gets 429"))] = 256
    # Warm restarts: a mounted volume.
    state_dir: Annotated[str | None, Meta(description=(
        "directory of the index's snapshot (warm restart: loaded at start, written every "
        "snapshot_interval_s and on SIGTERM); unset = start empty"))] = None
    snapshot_interval_s: Annotated[float, Meta(description=(
        "seconds between snapshots to the state dir or the object store; 0 = only on SIGTERM"))] = 60.0
    # Record and replay (docs/record.md): every call that changes an answer, and every answer.
    record_dir: Annotated[str | None, Meta(description=(
        "directory to record the index to (rotating segments; kv-indexer replay DIR reproduces every "
        "answer); unset = no recording"))] = None
    record_max_bytes: Annotated[int, Meta(description=(
        "bytes of recording kept at most; beyond, the oldest segments are deleted"))] = 1 << 30
    record_max_age_s: Annotated[float, Meta(description=(
        "seconds of recording kept at most (older segments deleted); 0 = no age cap"))] = 0.0
    record_segment_bytes: Annotated[int, Meta(description=(
        "a recording segment is closed once what follows its base passes this size (each begins with the "
        "index's state, not counted: at 10^7 entries that base is ~265 MB)"))] = 64 << 20
    record_segment_s: Annotated[float, Meta(description=(
        "a recording segment is closed past this age, in seconds"))] = 600.0
    record_tokens: Annotated[str, Meta(description=(
        "what the recording keeps of prompts and token ids: hashed (block keys only), full, or none"))] = "hashed"
    # http://HOST:PORT; the engine registry comes with the snapshot, then the engines are
    # followed from the snapshot's seqs.
    bootstrap_from: Annotated[str | None, Meta(description=(
        "a peer's base URL: copy its state (GET /v1/snapshot) at start, then follow the engines"))] = None
    # Snapshots then live in JetStream's object store; unset = subscribe to the engines directly.
    nats_url: Annotated[str | None, Meta(description=(
        "NATS server: consume the relay's JetStream event log instead of the engines' ZMQ"))] = None
    nats_stream: Annotated[str, Meta(description="JetStream stream of the event log")] = "KVI_EVENTS"
    nats_subject: Annotated[str, Meta(description="subject the relay publishes batches on")] = "kvi.events"
    nats_bucket: Annotated[str, Meta(description="JetStream object-store bucket of snapshots")] = "kvi-snapshots"
    # Core NATS is enough: decisions, ends and heartbeats are messages, not a log.
    route_sync: Annotated[str | None, Meta(description=(
        "NATS server shared by router replicas: each replica's routing decisions and their ends reach the "
        "others, so every /v1/route sees the whole fleet's in flight (docs/state.md); unset = this replica's "
        "own view"))] = None
    route_sync_subject: Annotated[str, Meta(description=(
        "subject prefix of route sync (replicas of one fleet share it)"))] = "kvi.route"
    route_sync_token: Annotated[str | None, Meta(description=(
        "route sync's NATS auth token (prefer route_sync_token_file or the environment)"))] = None
    route_sync_token_file: Annotated[str | None, Meta(description="a file holding route_sync_token")] = None
    route_sync_creds: Annotated[str | None, Meta(description=(
        "route sync's NATS credentials file (.creds: user JWT and NKey seed)"))] = None
    # A peer silent for three heartbeats is gone: its requests leave within 4 heartbeats.
    route_sync_heartbeat_s: Annotated[float, Meta(description=(
        "seconds between route sync heartbeats; a replica silent for 3 of them is dropped with its requests"))] = 1.0
    # Measured: ~1 ms over NATS on loopback plus a route of a few ms on a busy 2-core host.
    route_sync_window_ms: Annotated[float, Meta(description=(
        "milliseconds another replica's routing decision can go unseen here (its trip over route sync plus one "
        "route); while other replicas route at that pace, a route without load weighs the decisions they are "
        "likely taking at the same instant, so replicas spread a burst as one router would (0: off)"))] = 5.0
    route_sync_join_timeout_s: Annotated[float, Meta(description=(
        "seconds /readyz waits for route sync to reach NATS and fetch the other replicas' requests; then ready "
        "on this replica's own view"))] = 5.0
    log_level: Annotated[str, Meta(description="critical, error, warning, info or debug")] = "info"
    log_json: Annotated[bool, Meta(description="log one JSON object per line")] = False
    access_log: Annotated[bool, Meta(description="log every HTTP request")] = False
    # Same handlers either way (api/http1.py), ~50 us less a call.
    fast_path: Annotated[bool, Meta(description=(
        "answer the query routes ahead of FastAPI's middleware (same answers, less latency)"))] = True
    # The demo: a simulated fleet (engines x DP ranks, GPU + CPU tier) replaying the
    # Mooncake trace at this speed-up, routed by the index; its engines are added.
    demo: Annotated[bool, Meta(description=(
        "also run the live demo fleet: simulated engines on 127.0.0.1 publishing over ZMQ, replaying the "
        "Mooncake trace (synthetic requests without it); its engines are added"))] = False
    demo_engines: Annotated[int, Meta(description="demo: simulated engines")] = 4
    demo_dp_size: Annotated[int, Meta(description="demo: DP ranks per engine")] = 2
    demo_speedup: Annotated[float, Meta(description=(
        "demo: divide the trace's timestamps by this (synthetic requests: 3.3 x this per second)"))] = 10.0
    # Hugging Face tokenizer directories: tokenizer.json, and tokenizer_config.json with its chat_template.
    tokenizers: Annotated[dict[str, str], Meta(description=(
        "per model, a Hugging Face tokenizer directory ({MODEL: DIR}; JSON in the environment): "
        "requests may send a prompt or chat messages instead of token ids (needs the text extra)"))] = \
        msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise SettingsError(f"setting {name!r}: {msg}")

        if not self.host:
            bad("host", "must not be empty")
        if not 0 <= self.port <= 65535:
            bad("port", f"must be 0..65535, got {self.port}")
        for name in ("max_orphans", "max_request_tokens", "max_request_bytes", "max_workers"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.rcvhwm < 0:
            bad("rcvhwm", f"must be >= 0 (0 = no bound), got {self.rcvhwm}")
        if self.max_nodes < 0:
            bad("max_nodes", f"must be >= 0 (0 = no cap), got {self.max_nodes}")
        for name in ("orphan_ttl_s", "replay_timeout_s"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.ready_fraction <= 1:
            bad("ready_fraction", f"must be in [0, 1], got {self.ready_fraction}")
        if not 0 <= self.stale_factor <= 1:
            bad("stale_factor", f"must be in [0, 1], got {self.stale_factor}")
        if not 1 <= self.demo_engines <= 64 or not 1 <= self.demo_dp_size <= 8:
            bad("demo_engines", "demo fleets are 1-64 engines of 1-8 DP ranks")
        if not self.demo_speedup > 0:
            bad("demo_speedup", f"must be > 0, got {self.demo_speedup}")
        if self.prefill_load_scale < 0:
            bad("prefill_load_scale", f"must be >= 0, got {self.prefill_load_scale}")
        if self.predicted_credit < 0:
            bad("predicted_credit", f"must be >= 0, got {self.predicted_credit}")
        for name in ("prefill_ttl_s", "decode_ttl_s"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("gateway_connect_timeout_s", "gateway_first_token_timeout_s", "gateway_idle_timeout_s"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.gateway_max_per_worker < 1:
            bad("gateway_max_per_worker", f"must be >= 1, got {self.gateway_max_per_worker}")
        if not self.metrics_interval_s > 0:
            bad("metrics_interval_s", f"must be > 0, got {self.metrics_interval_s}")
        if self.snapshot_interval_s < 0:
            bad("snapshot_interval_s", f"must be >= 0 (0 = only on SIGTERM), got {self.snapshot_interval_s}")
        if self.state_dir is not None and not self.state_dir:
            bad("state_dir", "must not be empty")
        if self.record_dir is not None and not self.record_dir:
            bad("record_dir", "must not be empty")
        if self.record_tokens not in ("none", "hashed", "full"):
            bad("record_tokens", f"must be none, hashed or full, got {self.record_tokens!r}")
        if self.record_segment_bytes < 4096 or self.record_max_bytes < self.record_segment_bytes:
            bad("record_segment_bytes", "must be >= 4096 and <= record_max_bytes")
        if self.record_max_age_s < 0 or not self.record_segment_s > 0:
            bad("record_max_age_s", "record_max_age_s must be >= 0 and record_segment_s > 0")
        if self.bootstrap_from is not None and not self.bootstrap_from.startswith(("http://", "https://")):
            bad("bootstrap_from", f"must be an http:// or https:// URL, got {self.bootstrap_from!r}")
        if self.nats_url is not None and not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            bad("nats_url", f"must be a nats://, tls://, ws:// or wss:// URL, got {self.nats_url!r}")
        if self.route_sync is not None and not self.route_sync.startswith(("nats://", "tls://", "ws://", "wss://")):
            bad("route_sync", f"must be a nats://, tls://, ws:// or wss:// URL, got {self.route_sync!r}")
        if not self.route_sync_subject or any(c.isspace() or c in "*>" for c in self.route_sync_subject):
            bad("route_sync_subject", f"must be a NATS subject without wildcards, got {self.route_sync_subject!r}")
        if not 0 <= self.route_sync_window_ms < 60_000:
            bad("route_sync_window_ms", f"must be >= 0 and < 60000, got {self.route_sync_window_ms}")
        for name in ("route_sync_heartbeat_s", "route_sync_join_timeout_s"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.route_sync_token is not None and self.route_sync_creds is not None:
            bad("route_sync_token", "set route_sync_token or route_sync_creds, not both")
        for name in ("nats_stream", "nats_bucket"):
            v = getattr(self, name)
            if not v or not all(c.isalnum() or c in "-_" for c in v):
                bad(name, f"must be letters, digits, '-' and '_', got {v!r}")
        if not self.nats_subject or any(c.isspace() or c in "*>" for c in self.nats_subject):
            bad("nats_subject", f"must be a NATS subject without wildcards, got {self.nats_subject!r}")
        try:
            self.tie_slot()
        except ValueError as err:
            bad("replica_slot", str(err))
        if self.max_in_flight < 1:
            bad("max_in_flight", f"must be >= 1, got {self.max_in_flight}")
        for tier, c in self.credits.items():
            if not tier or c < 0:
                bad("credits", f"tier names must be non-empty and credits >= 0, got {tier!r}: {c}")
        if self.api_token is not None and (len(self.api_token) < 16 or not self.api_token.isprintable()
                                           or any(c.isspace() for c in self.api_token)):
            bad("api_token", "must be at least 16 printable characters without blanks")
        if self.auth_reads and self.api_token is None:
            bad("auth_reads", "needs api_token (or api_token_file)")
        try:
            EndpointPolicy(self.allowed_endpoints)
        except ValueError as err:
            bad("allowed_endpoints", str(err).removeprefix("allowed_endpoints: "))
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
            bad("log_level", f"must be one of critical, error, warning, info, debug; got {self.log_level!r}")
        for model, path in self.tokenizers.items():
            # Read in full when the app is built (indexer.text.tokenizer); what is missing is said here.
            if not model:
                bad("tokenizers", "model names must not be empty")
            if not os.path.isdir(path):
                bad("tokenizers", f"model {model!r}: {path} is not a directory")
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                bad("tokenizers", f"model {model!r}: no tokenizer.json in {path} (a Hugging Face tokenizer directory)")
        seen: dict[tuple[str, int], str] = {}
        for e in self.engines:
            for r in e.ranks:
                if (e.id, r) in seen:
                    bad("engines", f"engine {e.id!r} DP rank {r} is configured twice")
                seen[(e.id, r)] = e.model

    def index_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`indexer.PrefixIndex`."""
        return {
            "credits": dict(self.credits),
            "stale_factor": self.stale_factor,
            "max_orphans": self.max_orphans,
            "orphan_ttl_s": self.orphan_ttl_s,
            "max_nodes": self.max_nodes or None,
            "predicted_credit": self.predicted_credit,
            "prefill_ttl_s": self.prefill_ttl_s,
            "decode_ttl_s": self.decode_ttl_s,
            "max_in_flight": self.max_in_flight,
            # Only other replicas' decisions can go unseen: alone, there is nothing to weigh.
            "contention_window_s": self.route_sync_window_ms / 1000 if self.route_sync else 0.0,
        }

    def tie_slot(self) -> tuple[int, int]:
        """``replica_slot`` as ``(slot, of)`` (``PrefixIndex.set_tie_slot``'s arguments).

        Raises
        ------
        ValueError
            Unless it is ``SLOT/N``, ASCII digits, with ``0 <= SLOT < N``.
        """
        slot, sep, of = self.replica_slot.strip().partition("/")
        if not (sep and slot.strip().isdigit() and of.strip().isdigit() and slot.isascii() and of.isascii()):
            raise ValueError(f"must be SLOT/N (e.g. 0/3), got {self.replica_slot!r}")
        if not int(slot) < int(of):
            raise ValueError(f"must be SLOT/N with 0 <= SLOT < N, got {self.replica_slot!r}")
        return int(slot), int(of)

    def endpoint_policy(self) -> EndpointPolicy:
        """What the service may connect to: tcp only, within ``allowed_endpoints``."""
        return EndpointPolicy(self.allowed_endpoints)

    def redacted(self) -> dict[str, Any]:
        """These settings as JSON-able builtins, the token hidden (for printing and logs)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        for name in ("api_token", "route_sync_token"):
            if out.get(name) is not None:
                out[name] = "<redacted>"
        return out


# Every setting's name -> its help text (the field's description): the one declaration
# ``--help``, its environment table and the CLI flags read.
FIELDS: dict[str, str] = {
    f.name: (f.type.extra_json_schema or {}).get("description", "") if isinstance(f.type, msgspec.inspect.Metadata)
    else "" for f in msgspec.inspect.type_info(Settings).fields  # type: ignore[attr-defined]
}
# Settings whose environment value is JSON (the rest are scalars, parsed by type).
_JSON_FIELDS = ("engines", "credits", "discovery", "tokenizers")


def _token_from_file(merged: dict[str, Any], token: str, file: str) -> None:
    """Read setting ``token`` from the file setting ``file`` names, when it names one."""
    path = merged.get(file)
    if not path:
        return
    if merged.get(token):
        raise SettingsError(f"set {token} or {file}, not both")
    try:
        with open(path, encoding="utf-8") as f:
            merged[token] = f.read().strip()
    except (OSError, UnicodeError) as e:
        raise SettingsError(f"{file} {path}: {getattr(e, 'strerror', None) or e}") from None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in _JSON_FIELDS or (name == "allowed_endpoints" and raw.lstrip().startswith("[")):
            try:
                out[name] = json.loads(raw)
            except ValueError as e:
                raise SettingsError(f"{ENV_PREFIX}{name.upper()}: not valid JSON ({e})") from None
        else:
            out[name] = raw
    return out


def _read_file(path: str) -> dict[str, Any]:
    import yaml  # only the service reads YAML

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"config file {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def load_settings(
    config_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the sources (later wins) and validate.

    ``config_file`` defaults to ``$KVI_CONFIG``; ``overrides`` are command-line values
    (``None`` means "not given"). Raises :class:`SettingsError`.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        merged.update(_read_file(path))
    merged.update(_from_env(env))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(merged) - set(FIELDS))
    if unknown:
        raise SettingsError(f"unknown setting(s): {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    if isinstance(merged.get("allowed_endpoints"), str):  # KVI_ALLOWED_ENDPOINTS=a,b (JSON lists work too)
        merged["allowed_endpoints"] = [x.strip() for x in merged["allowed_endpoints"].split(",") if x.strip()]
    for token, file in (("api_token", "api_token_file"), ("route_sync_token", "route_sync_token_file")):
        _token_from_file(merged, token, file)
    try:
        # str_values: environment values arrive as text ("8080", "true").
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise SettingsError(_settings_message(str(e))) from None
    except ValueError as e:  # __post_init__ of Settings or of an engine
        raise SettingsError(str(e)) from None


def _settings_message(msg: str) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.port`": name the setting.
    if " - at `$." in msg:
        what, where = msg.rsplit(" - at `$.", 1)
        return f"setting {where.rstrip('`')!r}: {what}"
    return msg


def parse_engine_spec(spec: str) -> dict[str, Any]:
    """``ID=ENDPOINT[,key=value...]`` (the ``--engine`` flag) -> engine fields."""
    head, _, rest = spec.partition(",")
    eid, eq, endpoint = head.partition("=")
    if not eq or not eid or not endpoint:
        raise SettingsError(f"--engine {spec!r}: expected ID=tcp://HOST:PORT[,model=M,replay_endpoint=...,dp_size=N]")
    out: dict[str, Any] = {"id": eid, "endpoint": endpoint}
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq:
            raise SettingsError(f"--engine {spec!r}: expected key=value, got {kv!r}")
        out[k.strip()] = v.strip()
    return out
