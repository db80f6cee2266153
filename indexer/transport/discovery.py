"""Engine discovery by DNS: a Kubernetes headless Service resolves to one address per vLLM
pod; every address becomes an engine (the configured ports, DP size and model), and an
address that disappears is removed after a grace period (a pod restarting keeps its index
meanwhile; one that is gone for good stops being routed to).

The resolver is injectable (tests); the default is the standard library's
``socket.getaddrinfo``. A failed resolution changes nothing (a DNS hiccup must not drop
a fleet) and is counted.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from indexer.wire.engines import EngineConfig

if TYPE_CHECKING:
    from indexer.query.index import PrefixIndex

__all__ = ["DnsDiscovery", "Registry", "resolve_addresses"]


class Registry(Protocol):
    """What discovery changes: the engines of an ingest (``Indexer`` is one), and the
    counters of its index. Discovery sits below the ingests and names only this."""

    index: PrefixIndex

    def engines(self) -> list[EngineConfig]: ...

    def add_engine(self, engine: Any = None, *, via: str = "library", **fields: Any) -> EngineConfig: ...

    def remove_engine(self, engine_id: str, dp_rank: int | None = None, *, via: str = "library") -> bool: ...

log = logging.getLogger("kv_indexer.discovery")


def resolve_addresses(name: str) -> set[str]:
    """Every address ``name`` resolves to (A and AAAA records), as strings."""
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    return {str(info[4][0]) for info in infos}


class DnsDiscovery:
    """Keep ``indexer``'s engines in step with the addresses behind ``name``.

    Engines it adds are named ``{id_prefix}{address}`` and only those are ever removed
    by it; static and API-registered engines are left alone.
    """

    def __init__(
        self,
        indexer: Registry,
        name: str,
        *,
        port: int = 5557,
        replay_port: int | None = None,
        dp_size: int = 1,
        model: str = "default",
        topic: str = "",
        metrics_port: int | None = None,
        api_port: int | None = None,
        interval_s: float = 10.0,
        grace_s: float = 60.0,
        id_prefix: str = "",
        resolver: Callable[[str], Iterable[str]] = resolve_addresses,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not name:
            raise ValueError("discovery needs a DNS name")
        if interval_s <= 0 or grace_s < 0:
            raise ValueError("discovery interval must be > 0 and grace >= 0")
        self.indexer = indexer
        self.name = name
        self.port = port
        self.replay_port = replay_port
        self.metrics_port = metrics_port  # vLLM's HTTP port: /metrics there (in-flight load)
        self.api_port = api_port  # vLLM's OpenAI server (the gateway forwards there); usually the same port
        self.dp_size = dp_size
        self.model = model
        self.topic = topic
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.id_prefix = id_prefix
        self.resolver = resolver
        self.clock = clock
        self.known: dict[str, str] = {}  # address -> engine id
        self.missing_since: dict[str, float] = {}  # address -> when it was first missing
        self.errors = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Engines already subscribed that this discovery would add itself (a snapshot
        # restored them, R-DUR-2) are its own: removed when their address stays gone.
        for cfg in indexer.engines():
            addr = cfg.id[len(id_prefix):] if cfg.id.startswith(id_prefix) else ""
            try:
                ipaddress.ip_address(addr)
            except ValueError:
                continue
            if cfg == self.config_for(addr):
                self.known[addr] = cfg.id

    def config_for(self, address: str) -> EngineConfig:
        host = f"[{address}]" if ":" in address else address  # IPv6 in a ZMQ endpoint
        return EngineConfig(
            id=f"{self.id_prefix}{address}",
            endpoint=f"tcp://{host}:{self.port}",
            replay_endpoint=f"tcp://{host}:{self.replay_port}" if self.replay_port else None,
            metrics_url=f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port else None,
            api_url=f"http://{host}:{self.api_port}" if self.api_port else None,
            model=self.model,
            topic=self.topic,
            dp_size=self.dp_size,
        )

    def poll_once(self) -> tuple[list[str], list[str]]:
        """Resolve once and reconcile: returns (engine ids added, engine ids removed)."""
        try:
            now_addrs = set(self.resolver(self.name))
        except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
            self.errors += 1
            self.last_error = f"cannot resolve {self.name}: {e}"
            self.indexer.index.count("discovery_errors")
            return [], []
        self.last_error = None
        added, removed = [], []
        now = self.clock()
        for addr in sorted(now_addrs):
            self.missing_since.pop(addr, None)
            if addr in self.known:
                continue
            try:
                cfg = self.config_for(addr)
                self.indexer.add_engine(cfg, via="discovery")
            except ValueError as e:  # a bad address or max_workers reached: say so, go on
                self.errors += 1
                self.last_error = f"cannot add {addr}: {e}"
                self.indexer.index.count("discovery_errors")
                continue
            self.known[addr] = cfg.id
            added.append(cfg.id)
        for addr in sorted(set(self.known) - now_addrs):
            first = self.missing_since.setdefault(addr, now)
            if now - first >= self.grace_s:
                eid = self.known.pop(addr)
                self.missing_since.pop(addr, None)
                self.indexer.remove_engine(eid, via="discovery")
                removed.append(eid)
        if added:
            self.indexer.index.count("discovery_added", len(added))
            log.info("discovery %s: added %s", self.name, ", ".join(added))
        if removed:
            self.indexer.index.count("discovery_removed", len(removed))
            log.info("discovery %s: removed %s (gone for %gs)", self.name, ", ".join(removed), self.grace_s)
        return added, removed

    def start(self) -> None:
        """Poll every ``interval_s`` in a background thread (the first poll at once)."""
        if self._thread is not None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.poll_once()
                except Exception:  # never let discovery die silently
                    self.errors += 1
                    log.exception("discovery %s failed", self.name)
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=run, name="kvidx-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "engines": sorted(self.known.values()),
            "missing": {self.known[a]: round(self.clock() - t, 3) for a, t in self.missing_since.items()},
            "errors": self.errors,
            "last_error": self.last_error,
        }
