"""Route sync between router replicas (:class:`indexer.ingest.routesync.RouteSync`), or
:class:`NoRouteSync` when the settings name no NATS server for it: both are started,
stopped and asked the same way."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from api.metrics import cumulative, histogram_les
from api.settings import Settings
from indexer import PrefixIndex

if TYPE_CHECKING:
    from indexer.ingest.routesync import RouteSync

NS = "kvi_route_sync"


class RouteSyncLike(Protocol):
    """What the service asks of route sync."""

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    async def astop(self) -> None: ...

    def stats(self) -> dict[str, Any] | None: ...

    def families(self) -> Iterator[Any]: ...


class NoRouteSync:
    """A replica alone: its own view, always ready."""

    ready = True

    def start(self) -> None:
        pass

    async def astop(self) -> None:
        pass

    def stats(self) -> None:
        return None

    def families(self) -> Iterator[Any]:
        return iter(())


class SyncedRoutes:
    """The service's route sync: :class:`~indexer.ingest.routesync.RouteSync` and its
    metrics (``kvi_route_sync_*``, read from its counters on scrape)."""

    def __init__(self, sync: RouteSync) -> None:
        self.sync = sync

    @property
    def ready(self) -> bool:
        return self.sync.ready

    def start(self) -> None:
        self.sync.start()

    async def astop(self) -> None:
        await self.sync.astop()

    def stats(self) -> dict[str, Any]:
        return self.sync.stats()

    def families(self) -> Iterator[Any]:
        from indexer.ingest.syncpeers import LAG_BUCKETS

        rs = self.sync
        c, v = rs.counters, rs.views
        for name, doc in (("messages", "Route sync messages (envelopes) sent and received."),
                          ("items", "Decisions, ends, forgotten workers and heartbeats sent and received.")):
            m = CounterMetricFamily(f"{NS}_{name}", doc, labels=["direction"])
            m.add_metric(["out"], c[f"{name}_out"])
            m.add_metric(["in"], c[f"{name}_in"])
            yield m
        bad = CounterMetricFamily(f"{NS}_refused_messages", "Messages refused and dropped, by reason (too_large, "
                                  "malformed, version, invalid).", labels=["reason"])
        for reason in ("too_large", "malformed", "version", "invalid"):
            bad.add_metric([reason], v.bad.get(reason, 0))
        yield bad
        pe = CounterMetricFamily(f"{NS}_peer_events", "Other replicas seen joining, leaving (goodbye) and lost "
                                 "(silent for the peer timeout).", labels=["event"])
        for event in ("joined", "left", "lost"):
            pe.add_metric([event], c[f"peers_{event}"])
        yield pe
        for name, doc in (("unsent_items", "Items not sent while disconnected (the peers catch up by digest)."),
                          ("resyncs", "Peers' request lists fetched (joining, or a heartbeat's digest differed)."),
                          ("joins", "Joins completed (start and every reconnection)."),
                          ("join_timeouts", "Starts that went ready on this replica's own view: NATS not reached "
                           "within the join timeout."),
                          ("disconnects", "Connections to NATS lost."),
                          ("adopted", "Other replicas' requests taken into this view."),
                          ("ended", "Other replicas' ends applied to open requests here."),
                          ("dropped_requests", "Requests of replicas that left or were lost, or that their own "
                           "list no longer had.")):
            yield CounterMetricFamily(f"{NS}_{name}", doc, value=c[name])
        h = HistogramMetricFamily(f"{NS}_lag_seconds", "From a peer's send to this replica's receipt (wall "
                                  "clocks).")
        h.add_metric([], cumulative(histogram_les(LAG_BUCKETS), v.lag), v.lag_sum)
        yield h
        yield GaugeMetricFamily(f"{NS}_connected", "1 while connected to NATS.", value=int(rs.connected))
        yield GaugeMetricFamily(f"{NS}_peers", "Other replicas alive (heard within the peer timeout).",
                                value=len(v.peers))
        held = GaugeMetricFamily(f"{NS}_requests_held", "Open routed requests in this replica's view, by the "
                                 "replica that routed them (origin; self: this one).", labels=["origin"])
        for origin, k in sorted(rs.index.held_by_origin().items()):
            held.add_metric([origin or "self"], k)
        yield held


def route_sync_for(settings: Settings, index: PrefixIndex) -> RouteSyncLike:
    """Route sync on ``settings.route_sync`` for ``index``, or :class:`NoRouteSync` (only
    then is ``nats`` not imported)."""
    if not settings.route_sync:
        return NoRouteSync()
    from indexer.ingest.routesync import RouteSync

    return SyncedRoutes(RouteSync(index, settings.route_sync, subject=settings.route_sync_subject,
                     heartbeat_s=settings.route_sync_heartbeat_s, join_timeout_s=settings.route_sync_join_timeout_s,
                     token=settings.route_sync_token, user_credentials=settings.route_sync_creds,
                     name=f"{socket.gethostname()}:{settings.port}",
                     # Its place among the live replicas breaks ties (replica_slot's, kept up to date).
                     on_members=index.set_tie_slot))
