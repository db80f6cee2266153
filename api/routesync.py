"""Route sync between router replicas (:class:`indexer.ingest.routesync.RouteSync`), or
:class:`NoRouteSync` when the settings name no NATS server for it: both are started,
stopped and asked the same way."""

from __future__ import annotations

import socket
from typing import Any, Protocol

from api.settings import Settings
from indexer import PrefixIndex


class RouteSyncLike(Protocol):
    """What the service asks of route sync."""

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    async def astop(self) -> None: ...

    def stats(self) -> dict[str, Any] | None: ...


class NoRouteSync:
    """A replica alone: its own view, always ready."""

    ready = True

    def start(self) -> None:
        pass

    async def astop(self) -> None:
        pass

    def stats(self) -> None:
        return None


def route_sync_for(settings: Settings, index: PrefixIndex) -> RouteSyncLike:
    """Route sync on ``settings.route_sync`` for ``index``, or :class:`NoRouteSync` (only
    then is ``nats`` not imported)."""
    if not settings.route_sync:
        return NoRouteSync()
    from indexer.ingest.routesync import RouteSync

    return RouteSync(index, settings.route_sync, subject=settings.route_sync_subject,
                     heartbeat_s=settings.route_sync_heartbeat_s, join_timeout_s=settings.route_sync_join_timeout_s,
                     token=settings.route_sync_token, user_credentials=settings.route_sync_creds,
                     name=f"{socket.gethostname()}:{settings.port}")
