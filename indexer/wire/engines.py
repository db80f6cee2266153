"""What the consumer knows of a vLLM engine before any event: its configuration and
vLLM's addressing rules (contract §1 Engine, Worker).

* :class:`EngineConfig`: one engine (id, model, live and replay endpoints, topic, DP
  ranks), validated when built;
* :func:`offset_endpoint`: vLLM's DP rule, rank ``r`` publishes on the ports plus ``r``;
* ``END_SEQ``: the sequence frame that ends a replay (``-1`` as 8 signed big-endian bytes);
* :func:`check_metrics_url`: what an engine's metrics URL may be;
* :func:`check_engine_id`, :func:`parse_worker`: engine ids and ``engine/rank`` worker
  names, one rule for every surface;
* :class:`EndpointPolicy`: what a service may connect to (tcp only, an allowlist of
  hosts and CIDRs), checked before any connect.

Both the consumer (transport) and the producer side (``indexer.producer``) import from
here; nothing here imports either.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import msgspec

__all__ = ["EngineConfig", "END_SEQ", "EndpointPolicy", "EndpointRefused", "check_endpoint", "check_engine_id",
           "check_metrics_url", "offset_endpoint", "parse_worker", "as_config"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Engine ids (contract §1): ASCII letters, digits and ``. _ : -``, starting with a letter,
# digit or ``_``; 1-128 characters. No ``/`` (worker names are ``engine/rank``), no blanks
# or control characters (they end up in logs, metric labels and URLs). ``:`` admits
# discovery's IPv6 addresses. ``\Z``, not ``$``: ``$`` also matches before a final newline.
ENGINE_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}\Z")
MAX_DP_RANK = 1023
_RANK_RE = re.compile(r"(?:0|[1-9][0-9]{0,3})\Z")  # ASCII digits only: str.isdigit() takes '³' and '١'


def check_engine_id(engine_id: object) -> str:
    """``engine_id`` when it is a valid engine id; ValueError saying the rule otherwise."""
    if not isinstance(engine_id, str) or ENGINE_ID_RE.match(engine_id) is None:
        raise ValueError(f"engine id {engine_id!r} is invalid: 1-128 ASCII letters, digits, '.', '_', ':' or '-', "
                         "not starting with '.', ':' or '-'")
    return engine_id


def parse_worker(name: str) -> tuple[str, int | None]:
    """``"engine/rank"`` -> ``(engine, rank)``, ``"engine"`` -> ``(engine, None)``.

    ValueError when the engine part is not a valid id or the rank is not ASCII digits in
    0..1023 (``'³'``, ``'١'``, ``'+1'`` and ``'01'`` included)."""
    engine, slash, rank_s = name.partition("/")
    check_engine_id(engine)
    if not slash:
        return engine, None
    if _RANK_RE.match(rank_s) is None or int(rank_s) > MAX_DP_RANK:
        raise ValueError(f"worker {name!r} is invalid: expected ENGINE/RANK with RANK 0..{MAX_DP_RANK} in ASCII digits")
    return engine, int(rank_s)


_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's DP rule: tcp ports shift by the rank (port 0 stays 0); inproc gets ``_dp<rank>``."""
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{host}:{int(port) + rank}"
    return endpoint


def check_endpoint(endpoint: str, what: str) -> None:
    """Raise ValueError unless ``endpoint`` is something a SUB/DEALER can connect to."""
    if endpoint.startswith("tcp://"):
        m = _TCP.match(endpoint)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{what}: expected tcp://HOST:PORT with a port 1-65535, got {endpoint!r}")
    elif endpoint.startswith(("ipc://", "inproc://")):
        if endpoint.endswith("//"):
            raise ValueError(f"{what}: empty address in {endpoint!r}")
    else:
        raise ValueError(f"{what}: endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")


MAX_URL_CHARS = 2048


def check_metrics_url(url: object, what: str = "metrics URL") -> str:
    """``url`` when it is an ``http://`` or ``https://`` URL with a host; ValueError saying
    why otherwise. No credentials in it (they would end up in logs and error strings),
    no blanks or control characters, at most 2048 characters. ``what`` names it in errors."""
    if not isinstance(url, str):
        raise ValueError(f"{what} must be a string, got {type(url).__name__}")
    if not url or len(url) > MAX_URL_CHARS:
        raise ValueError(f"{what} must be 1-{MAX_URL_CHARS} characters, got {len(url)}")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url) or not url.isascii():
        raise ValueError(f"{what} {url[:100]!r} has blanks, control or non-ASCII characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not 0-65535 digits
    except ValueError as e:
        raise ValueError(f"{what} {url[:100]!r} is invalid: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{what} must be http:// or https://, got {url[:100]!r}")
    if not parts.hostname:
        raise ValueError(f"{what} {url[:100]!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{what} must not carry credentials (user:password@)")
    if port == 0:
        raise ValueError(f"{what} {url[:100]!r}: port must be 1-65535")
    return url


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM engine (contract §1): its DP rank ``r`` publishes on the ports plus ``r``.

    ``dp_rank_start`` lets one config cover ranks ``start .. start+dp_size-1`` only, the
    first of them on ``endpoint`` itself (Dynamo registers each DP rank with its own
    endpoint); configs of one id may then cover disjoint rank ranges.
    """

    id: str
    endpoint: str
    model: str = "default"
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1
    dp_rank_start: int = 0
    # vLLM's Prometheus /metrics of this engine (every DP rank behind it, told apart by
    # the ``engine`` label): scraped to correct the in-flight load estimate.
    metrics_url: str | None = None
    # The engine's OpenAI-compatible server (``http://HOST:8000``, no path): where the
    # gateway forwards requests routed to it (every DP rank behind it, picked by header).
    api_url: str | None = None

    @property
    def ranks(self) -> range:
        return range(self.dp_rank_start, self.dp_rank_start + self.dp_size)

    def __post_init__(self) -> None:
        check_engine_id(self.id)
        if not 1 <= self.dp_size <= 1024:
            raise ValueError(f"engine {self.id}: dp_size must be 1..1024, got {self.dp_size}")
        if not 0 <= self.dp_rank_start <= MAX_DP_RANK - self.dp_size + 1:
            raise ValueError(f"engine {self.id}: dp_rank_start {self.dp_rank_start} + dp_size {self.dp_size} puts"
                             f" DP ranks outside 0..{MAX_DP_RANK}")
        # Every DP rank's ports (base + rank) must be valid too.
        for r in (0, self.dp_size - 1):
            check_endpoint(offset_endpoint(self.endpoint, r), f"engine {self.id} endpoint")
            if self.replay_endpoint is not None:
                check_endpoint(offset_endpoint(self.replay_endpoint, r), f"engine {self.id} replay_endpoint")
        if self.metrics_url is not None:
            try:
                check_metrics_url(self.metrics_url)
            except ValueError as e:
                raise ValueError(f"engine {self.id} metrics_url: {e}") from None
        if self.api_url is not None:
            try:
                check_metrics_url(self.api_url, "api_url")
            except ValueError as e:
                raise ValueError(f"engine {self.id}: {e}") from None


class EndpointRefused(ValueError):
    """An endpoint the :class:`EndpointPolicy` does not allow (a client error, not a conflict)."""


class EndpointPolicy:
    """What a service may connect to, checked before any connect.

    Only ``tcp://HOST:PORT`` (``ipc://`` and ``inproc://`` reach the service's own
    machine: files and in-process sockets are no business of a remote caller). With an
    ``allowed`` list, HOST must match one entry: an exact host name (case-insensitive),
    ``*.suffix`` (any name ending in ``.suffix``), an IP address, or a CIDR. A host name
    matches a CIDR when every address it resolves to now lies in an allowed network
    (names are resolved at registration: pair the list with a network policy, which the
    cluster enforces at every connect)."""

    def __init__(self, allowed: Iterable[str] = (), *, tcp_only: bool = True,
                 resolve: Callable[[str, None], list[Any]] = socket.getaddrinfo) -> None:
        self.tcp_only = tcp_only
        self.names: set[str] = set()
        self.suffixes: list[str] = []
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._resolve = resolve
        for entry in allowed:
            e = entry.strip().lower()
            if not e:
                raise ValueError("allowed_endpoints: an entry is empty")
            if e.startswith("*."):
                if not _HOSTNAME.match(e[2:]):
                    raise ValueError(f"allowed_endpoints: {entry!r} is not *.DOMAIN")
                self.suffixes.append(e[1:])
                continue
            try:
                self.networks.append(ipaddress.ip_network(e, strict=False))
                continue
            except ValueError:
                pass
            if not _HOSTNAME.match(e):
                raise ValueError(f"allowed_endpoints: {entry!r} is not a host name, *.DOMAIN, IP address or CIDR")
            self.names.add(e)
        self.open = not (self.names or self.suffixes or self.networks)

    def check(self, cfg: EngineConfig) -> None:
        """Raise :class:`EndpointRefused` unless every endpoint of ``cfg`` is allowed."""
        if cfg.metrics_url is not None and not self.open:
            self._check_host(cfg.id, "metrics_url", urlsplit(cfg.metrics_url).hostname or "")
        if cfg.api_url is not None and not self.open:
            self._check_host(cfg.id, "api_url", urlsplit(cfg.api_url).hostname or "")
        for what, ep in (("endpoint", cfg.endpoint), ("replay_endpoint", cfg.replay_endpoint)):
            if ep is None:
                continue
            if not ep.startswith("tcp://"):
                if self.tcp_only:
                    raise EndpointRefused(f"engine {cfg.id} {what}: only tcp://HOST:PORT is accepted, got {ep!r}")
                continue
            if not self.open:
                self._check_host(cfg.id, what, ep[6:].rpartition(":")[0])

    def _check_host(self, eid: str, what: str, host: str) -> None:
        h = host.strip("[]").lower()
        if h in self.names or any(h.endswith(s) for s in self.suffixes):
            return
        try:
            addrs = {ipaddress.ip_address(h)}
        except ValueError:
            if not self.networks:
                raise EndpointRefused(f"engine {eid} {what}: host {host!r} is not in allowed_endpoints") from None
            try:
                addrs = {ipaddress.ip_address(ai[4][0].split("%")[0]) for ai in self._resolve(h, None)}
            except (OSError, UnicodeError):
                raise EndpointRefused(f"engine {eid} {what}: host {host!r} does not resolve, so it cannot be "
                                      "checked against allowed_endpoints") from None
        bad = sorted(str(a) for a in addrs if not any(a in n for n in self.networks))
        if bad or not addrs:
            raise EndpointRefused(f"engine {eid} {what}: host {host!r} ({', '.join(bad)}) is not in allowed_endpoints")


_HOSTNAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?\Z")


def as_config(e: EngineConfig | dict[str, Any]) -> EngineConfig:
    """``e`` as an :class:`EngineConfig`; ValueError naming the bad field otherwise."""
    if isinstance(e, EngineConfig):
        return e
    try:
        return msgspec.convert(e, EngineConfig)
    except msgspec.ValidationError as err:
        raise ValueError(f"bad engine configuration: {err}") from None
