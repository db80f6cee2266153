"""Engines found by DNS for an ingest (the service's, the relay's), or :class:`NoDiscovery`
when the settings name no DNS name: both are started and stopped the same way."""

from __future__ import annotations

from typing import Any

from api.settings import Settings
from indexer.transport.discovery import DnsDiscovery


class NoDiscovery:
    """No engines found by DNS (none configured, or a replica: its engines are the relay's)."""

    name = ""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def status(self) -> None:
        return None


def discovery_for(settings: Settings, ingest: Any) -> DnsDiscovery | NoDiscovery:
    """The discovery of ``settings.discovery`` adding engines to ``ingest`` (an ``Indexer``
    or a relay), or :class:`NoDiscovery` without one."""
    d = settings.discovery
    if d is None:
        return NoDiscovery()
    return DnsDiscovery(ingest, d.dns_name, port=d.port, replay_port=d.replay_port, metrics_port=d.metrics_port,
                        api_port=d.api_port,
                        dp_size=d.dp_size, model=d.model, topic=d.topic, interval_s=d.interval_s, grace_s=d.grace_s)
