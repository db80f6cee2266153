"""The service's composition root: :class:`Service` builds every collaborator of one app
from the settings (ingest, state keeper, auth, metrics, tokenizers, the page's
records, discovery, the route handlers), holds them, and starts and stops them with
the app. A collaborator the settings leave out is a null object (:class:`~api.discovery.NoDiscovery`,
:class:`~api.auth.OpenAuth`, :class:`~api.state.NoStateDir`), so nothing here or in
the routes asks whether one exists.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

from api import text
from api.auth import Auth, OpenAuth
from api.common import off_loop
from api.discovery import NoDiscovery, discovery_for
from api.dynamo import Dynamo
from api.jsonroutes import Endpoints, JsonSpec
from api.ledger import Ledger
from api.metrics import Metrics
from api.recording import recording_for
from api.routes.admin import EngineAdmin
from api.routes.gateway import GatewayLike, gateway_for
from api.routes.query import Queries
from api.routesync import RouteSyncLike, route_sync_for
from api.settings import Settings
from api.state import NoStateDir, StateKeeper
from api.ui import Decisions, Sampler
from indexer import PrefixIndex
from indexer.ingest.base import Ingest
from indexer.ingest.live import Indexer
from indexer.store.snapshot import SnapshotError
from indexer.transport.discovery import DnsDiscovery

log = logging.getLogger("kv_indexer.api")


class Service:
    """The collaborators behind one app's routes (see the module)."""

    def __init__(self, settings: Settings, index: PrefixIndex, routes: Iterable[JsonSpec]) -> None:
        self.settings = settings
        self.index = index
        self.ingest: Ingest
        self.state: StateKeeper
        self.discovery: DnsDiscovery | NoDiscovery
        if settings.nats_url:  # a replica of the relay's JetStream event log (only then is nats imported)
            from indexer.ingest.jetstream import JetStreamIngest

            self.state = NoStateDir(settings)  # its snapshots are in the relay's object store
            self.ingest = JetStreamIngest(settings.nats_url, index, stream=settings.nats_stream,
                                          subject=settings.nats_subject, bucket=settings.nats_bucket,
                                          snapshot_interval_s=settings.snapshot_interval_s)
            self.discovery = NoDiscovery()  # a replica's engines are the relay's
        else:
            self.state = StateKeeper(settings)
            self.ingest = zmq = self._indexer(settings, index)
            self.discovery = discovery_for(settings, zmq)
        # Other router replicas' decisions into this index's in-flight view (NoRouteSync: none).
        self.route_sync: RouteSyncLike = route_sync_for(settings, index)
        # The recording (record_dir), attached before anything is served: its first base is
        # the state the service starts from (a restored snapshot included).
        self.recording = recording_for(settings, index)
        self.auth = Auth(settings.api_token, settings.auth_reads) if settings.api_token else OpenAuth()
        self.api_errors: dict[tuple[str, int], int] = {}
        self.ledger = Ledger()  # the gateway's predicted against delivered cached tokens
        self.metrics = Metrics(index, self.ingest, self.api_errors, self.auth, self.state,
                               (self.route_sync, self.ledger, self.recording))
        # Each model's tokenizer (prompt / messages requests), loaded now: a bad directory stops the start.
        self.text = text.Texts(dict(settings.tokenizers), settings.max_request_tokens, index)
        self.decisions = Decisions()  # recent routing decisions, for the page (api/ui.py)
        self.ui_sampler = Sampler()
        self.queries: Queries = Queries(settings, index, self.ingest, self.metrics, self.text, self.decisions)
        self.admin: EngineAdmin = EngineAdmin(settings, index, self.ingest)
        self.dynamo: Dynamo = Dynamo(self)
        # The OpenAI gateway in front of the engines.
        self.gateway: GatewayLike = gateway_for(settings, index, self.ingest, self.text, self.ledger, self.decisions,
                                                self.auth)
        self.endpoints: Endpoints = Endpoints((spec.bind(self) for spec in routes), settings.max_request_bytes,
                                   self.api_errors, settings.fast_path)

    def _indexer(self, settings: Settings, index: PrefixIndex) -> Indexer:
        """The ZMQ ingest, started from the state dir's snapshot or a peer's when there
        is one (R-DUR-2); a snapshot that cannot be restored is counted and skipped."""
        kw: dict[str, Any] = dict(index=index, replay_timeout_s=settings.replay_timeout_s, rcvhwm=settings.rcvhwm,
                                  max_workers=settings.max_workers, endpoint_policy=settings.endpoint_policy(),
                                  metrics_interval_s=settings.metrics_interval_s)
        snap = self.state.initial()
        if snap is not None:
            try:
                ingest = Indexer(settings.engines, snapshot=snap, **kw)
            except SnapshotError as e:
                log.error("state: %s; starting empty", e)
                self.state.restored(False, e.reason)
            except ValueError as e:  # e.g. an index handed in that already holds workers
                log.error("state: snapshot not restored: %s; starting without it", e)
                self.state.restored(False, "not_empty")
            else:
                self.state.restored(True)
                st = index.stats()
                log.info("state: restored %d workers, %d nodes, %d entries", st["workers"], st["nodes"],
                         st["resident_entries"])
                return ingest
        return Indexer(settings.engines, **kw)

    def snapshot(self) -> bytes | None:
        """The index and the engine registry as snapshot bytes (GET /v1/snapshot, the state
        dir); None where the ingest keeps its snapshots elsewhere (a JetStream replica)."""
        return self.ingest.snapshot()

    def state_version(self) -> tuple[int, ...]:
        """Changes whenever a snapshot would differ: batches applied or dropped, workers'
        stale marks and restarts, engines registered or removed (from stats(): counters,
        no tree walk; once a snapshot interval)."""
        st = self.index.stats()
        c = st["counters"]
        return (c.get("batches_applied", 0), c.get("stale_marked", 0), c.get("stale_cleared", 0),
                c.get("restarts", 0), sum(self.ingest.changes.values()), st["workers"],
                sum(st["dropped_payloads"].values()))

    def start(self) -> None:
        """Start the ingest thread, route sync, the snapshot writer and discovery (the app's startup)."""
        s = self.settings
        if not self.auth.enforced and not _is_loopback(s.host):
            log.warning("SECURITY: listening on %s without an API token: anyone who can reach port %d can register "
                        "engines (the index then connects where they say) and delete them. Set KVI_API_TOKEN or "
                        "api_token_file, and allowed_endpoints (docs/deploy.md, Security).", s.host, s.port)
        self.recording.start()
        self.ingest.start()
        self.route_sync.start()
        self.state.start(self.snapshot, self.state_version)
        self.discovery.start()
        log.info("kv-indexer ready: %d engine(s) configured%s", len(s.engines),
                 f", discovering {self.discovery.name}" if self.discovery.name else "")

    async def stop(self) -> None:
        """Stop discovery, route sync and ingest, close the tokenizers' pool, write the last state
        (the app's shutdown)."""
        await off_loop(self.discovery.stop)
        await self.route_sync.astop()  # its goodbye: the other replicas drop our requests now
        await self.gateway.close()
        await self.ingest.astop()
        await off_loop(self.recording.stop)  # after ingest stopped: every call it made is written
        self.text.close()
        await off_loop(self.state.final)  # after ingest stopped: the last state exactly


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or 0.0.0.0 / :: (every interface)
