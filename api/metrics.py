"""Prometheus metrics: a collector that reads the index's counters at scrape time
(``PrefixIndex.stats()`` walks workers and groups, never a tree) plus the query
histograms the app observes. Every label set is bounded:

* routes, statuses, outcomes and reasons are fixed sets in the code;
* tiers and groups are capped by the index (``max_tiers``, ``max_groups``);
* models come from the engines subscribed now, whoever registered them: the
  configuration, ``POST /v1/engines`` or DNS discovery. ``max_workers`` caps the
  workers (DP ranks) subscribed at once, so at most that many models are exported. A
  model is exported only while it has a worker: the index keeps a model after its
  last engine is removed, and exporting those would let register/unregister cycles
  with new model names grow the label set without bound.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from api.auth import Auth
    from api.state import StateKeeper
    from indexer.ingest.base import Ingest

NS = "kvi"

# Query latency: 2.5 us .. ~80 ms (a 1,024-token match and its body take ~10 us in the handler).
_LATENCY_BUCKETS = tuple(2.5e-6 * 2**k for k in range(16))
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Counters of ``stats()["counters"]`` exported one-to-one (name -> help).
_COUNTERS = {
    "batches_applied": "Event batches applied.",
    "batches_duplicate": "Batches seen twice (already applied by a replay) and skipped.",
    "wire_gaps": "Sequence gaps seen on the wire (then repaired by replay, or the worker marked stale).",
    "sequence_gaps": "Sequence gaps that reached the index unrepaired.",
    "restarts": "Engine restarts detected (sequence went backwards).",
    "reconnects": "Reconnects of a worker's live socket; each one's continuity must then be proven (R-STR-7).",
    "orphans_adopted": "Stores that waited for their parent and were then applied.",
    "removed_unknown_blocks": "Removed blocks the index did not hold.",
    "cap_evicted_nodes": "Nodes evicted by the per-tree node cap.",
    "clears_requested": "Engines' caches cleared by POST /v1/engines/{id}/clear (an operator's reset, told at once).",
    "stale_marked": "Times a worker was marked stale.",
    "stale_cleared": "Times a stale worker recovered.",
    "discovery_added": "Engines added by DNS discovery.",
    "discovery_removed": "Engines removed by DNS discovery (gone longer than the grace period).",
    "discovery_errors": "DNS discovery failures (resolution or registration); nothing is removed on a failure.",
}


class _Histograms:
    """Per-route histograms observed on the event-loop thread (:meth:`Metrics.observe`):
    one ``bisect`` and two additions a query (prometheus_client's ``Histogram.observe``
    takes a lock and walks the buckets: ~1 us each, two per query); exported in the
    same format."""

    def __init__(self, name: str, doc: str, bounds: tuple) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in bounds)
        self.les = histogram_les(self.bounds)
        self.routes: dict[str, list] = {}  # route -> [per-bucket counts (last: +Inf), sum]

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=["route"])
        for route, (counts, total) in list(self.routes.items()):
            fam.add_metric([route], cumulative(self.les, counts), total)
        return fam


def histogram_les(bounds: tuple[float, ...]) -> list[str]:
    """The ``le`` labels of ``bounds`` and +Inf, as Prometheus writes them."""
    return [floatToGoString(b) for b in bounds] + ["+Inf"]


def cumulative(les: list[str], counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts (the last: above every bound) as Prometheus's cumulative buckets."""
    acc = 0
    out = []
    for le, n in zip(les, list(counts)):
        acc += n
        out.append((le, acc))
    return out


class Families(Protocol):
    """Something that adds its own metric families to a scrape (read from its counters)."""

    def families(self) -> Iterator[Any]: ...


class Metrics:
    """The registry of one app: histograms observed per query, the rest read on scrape."""

    def __init__(self, index: Any, ingest: Ingest, api_errors: dict, auth: Auth, state: StateKeeper,
                 sources: tuple[Families, ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.query_seconds = _Histograms(
            f"{NS}_query_duration_seconds", "Time to answer a query route, in the handler.", _LATENCY_BUCKETS)
        self.matched_blocks = _Histograms(
            f"{NS}_query_matched_blocks", "Longest prefix (blocks, all tiers) of the best worker per query.",
            _BLOCK_BUCKETS)
        self.registry.register(_IndexCollector(index, ingest, api_errors, (self.query_seconds, self.matched_blocks),
                                               auth, state, sources))

    def observe(self, route: str, seconds: float, blocks: int) -> None:
        """Count one query of ``route`` in both histograms (one frame: it runs per query)."""
        for h, value in ((self.query_seconds, seconds), (self.matched_blocks, blocks)):
            r = h.routes.get(route)
            if r is None:
                r = h.routes[route] = [[0] * (len(h.bounds) + 1), 0.0]
            r[0][bisect_left(h.bounds, value)] += 1  # Prometheus buckets are "<= le"
            r[1] += value


class _IndexCollector:
    def __init__(self, index: Any, ingest: Ingest, api_errors: dict, histograms: tuple, auth: Auth,
                 state: StateKeeper, sources: tuple[Families, ...]) -> None:
        self.index = index
        self.sources = sources  # route sync's kvi_route_sync_*, the gateway's kvi_gateway_*
        self.state = state  # api.state.StateKeeper: snapshots loaded and written
        self.ingest = ingest
        self.api_errors = api_errors  # {(route path, status): n}, kept by the app
        self.histograms = histograms
        self.auth = auth  # its failures {"missing" | "wrong": n}, exported while a token is enforced

    def describe(self):
        return []

    def collect(self):
        st = self.index.stats()
        c = st["counters"]

        ev = CounterMetricFamily(f"{NS}_events", "KV events by type and outcome.", labels=["event_type", "outcome"])
        for etype, outcomes in st["events"].items():
            for outcome, n in outcomes.items():
                ev.add_metric([etype, outcome], n)
        yield ev

        dr = CounterMetricFamily(f"{NS}_payloads_dropped", "Messages dropped before or while decoding, by reason.",
                                 labels=["reason"])
        for reason, n in st["dropped_payloads"].items():
            dr.add_metric([reason], n)
        yield dr

        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"{NS}_{name}", doc, value=c.get(name, 0))

        rp = CounterMetricFamily(f"{NS}_replays", "Replays from an engine's replay socket, by outcome.",
                                 labels=["outcome"])
        rp.add_metric(["ok"], c.get("replays_ok", 0))
        rp.add_metric(["failed"], c.get("replays_failed", 0))
        yield rp

        ct = CounterMetricFamily(
            f"{NS}_continuity",
            "Continuity checks of a worker's stream after a reconnect or a gap (R-STR-7), by outcome: "
            "proven (the same engine incarnation sent both sides), restarted (the engine restarted: "
            "its residency dropped and rebuilt by a replay from 0), unproven (no proof possible: "
            "the worker is marked stale).",
            labels=["outcome"])
        for outcome, key in (("proven", "continuity_proven"), ("restarted", "continuity_restart"),
                             ("unproven", "continuity_unproven")):
            ct.add_metric([outcome], c.get(key, 0))
        yield ct

        od = CounterMetricFamily(f"{NS}_orphans_dropped", "Orphan stores dropped, by reason.", labels=["reason"])
        for reason, key in (("expired", "orphan_expired"), ("overflow", "orphan_overflow"),
                            ("parent_gone", "orphans_dropped_parent_gone"), ("bad", "orphans_dropped_bad")):
            od.add_metric([reason], c.get(key, 0))
        yield od

        nodes = GaugeMetricFamily(f"{NS}_nodes", "Tree nodes per model and KV-cache group.", labels=["model", "group"])
        res = GaugeMetricFamily(f"{NS}_resident_blocks", "Resident (worker, block) entries per model, tier and group.",
                                labels=["model", "tier", "group"])
        orph = GaugeMetricFamily(f"{NS}_orphans", "Stores waiting for their parent, per model.", labels=["model"])
        for model, m in st["models"].items():
            if not m["workers"]:
                continue  # no engine subscribed for it: not exported (bounded labels, see above)
            orph.add_metric([model], m["orphans"])
            for g, gd in m["groups"].items():
                nodes.add_metric([model, g], gd["nodes"])
                for tier, n in gd["tiers"].items():
                    res.add_metric([model, tier, g], n)
        yield nodes
        yield res
        yield orph

        states = {"connected": 0, "disconnected": 0, "never_connected": 0, "replaying": 0, "stale": 0}
        health = GaugeMetricFamily(f"{NS}_worker_health", "1 for each subscribed worker's health (ok, "
                                   "never_connected, disconnected, replaying, stale); see /v1/workers.",
                                   labels=["engine", "dp_rank", "health"])
        wpre = GaugeMetricFamily(f"{NS}_worker_in_flight_prefill_tokens", "Prefill tokens routed to a worker and "
                                 "not yet announced (the index's own estimate).", labels=["engine", "dp_rank"])
        wdec = GaugeMetricFamily(f"{NS}_worker_in_flight_decode_blocks", "Decode blocks of requests routed to a "
                                 "worker and not yet done (max_tokens given).", labels=["engine", "dp_rank"])
        for w in self.ingest.workers():
            if "connected" in w:
                states["connected" if w["connected"] else "disconnected"] += 1
                states["never_connected"] += not w["connects"]
                states["replaying"] += bool(w["replaying"])
                health.add_metric([w["engine"], str(w["dp_rank"]), w["health"]], 1)
                inf = w.get("in_flight")
                if inf is not None:
                    wpre.add_metric([w["engine"], str(w["dp_rank"])], inf["prefill_tokens"])
                    wdec.add_metric([w["engine"], str(w["dp_rank"])], inf["decode_blocks"])
        states["stale"] = st["stale_workers"]
        yield health
        yield wpre
        yield wdec
        fl = st["in_flight"]
        rr = CounterMetricFamily(f"{NS}_route_records", "Routing decisions recorded, and how each ended "
                                 "(announced, prefill_expired, done, decode_expired, evicted, forgotten, engine_done).",
                                 labels=["outcome"])
        for k, n in sorted(fl["outcomes"].items()):
            rr.add_metric([k], n)
        yield rr
        yield GaugeMetricFamily(f"{NS}_in_flight_requests", "Routed requests in flight (recorded, not ended).",
                                value=fl["requests"])
        yield GaugeMetricFamily(f"{NS}_predicted_nodes", "Nodes of the predicted-prefix tries (all models).",
                                value=fl["predicted_nodes"])
        ch = CounterMetricFamily(f"{NS}_engine_changes", "Engines registered and unregistered, by who asked "
                                 "(config, api, dynamo, discovery, library).", labels=["op", "via"])
        for (op, via), n in sorted(self.ingest.changes.items()):
            ch.add_metric([op, via], n)
        yield ch
        if self.auth.enforced:
            af = CounterMetricFamily(f"{NS}_auth_failures", "Requests refused for a missing (401) or wrong (403) "
                                     "bearer token.", labels=["reason"])
            for reason, n in sorted(self.auth.failures.items()):
                af.add_metric([reason], n)
            yield af
        ws = GaugeMetricFamily(f"{NS}_workers", "Workers by state (a worker can be in several).", labels=["state"])
        for k, n in states.items():
            ws.add_metric([k], n)
        yield ws
        yield GaugeMetricFamily(f"{NS}_stale_workers", "Workers whose answers may be out of date.",
                                value=st["stale_workers"])
        ae = CounterMetricFamily(f"{NS}_api_errors", "API requests answered with an error, by route and status.",
                                 labels=["route", "status"])
        for (route, status), n in list(self.api_errors.items()):
            ae.add_metric([route, str(status)], n)
        yield ae
        yield GaugeMetricFamily(f"{NS}_workers_known", "Workers the index knows.", value=st["workers"])
        for h in self.histograms:
            yield h.family()
        if self.ingest.counters:  # a JetStream replica's (indexer.ingest.jetstream); the ZMQ ingest has none
            yield from _jetstream(self.ingest)
        yield from _snapshots(self.state)
        for src in self.sources:
            yield from src.families()


def _snapshots(k: StateKeeper):
    """kvi_snapshot_*: the state keeper's counters (api.state), read at scrape time."""
    ld = CounterMetricFamily(f"{NS}_snapshot_loads", "Snapshots read at start, by source (state_dir, peer), "
                             "outcome (ok, refused, error) and reason (magic, truncated, checksum, version, "
                             "corrupt, io, connect, http, too_large).", labels=["source", "outcome", "reason"])
    for (source, outcome, reason), n in sorted(k.loads.items()):
        ld.add_metric([source, outcome, reason], n)
    yield ld
    wr = CounterMetricFamily(f"{NS}_snapshot_writes", "Snapshots written to the state dir, by outcome (ok, error; "
                             "unchanged: an interval with nothing new, not written).", labels=["outcome"])
    for outcome in ("ok", "error", "unchanged"):
        wr.add_metric([outcome], k.writes.get(outcome, 0))
    yield wr
    yield GaugeMetricFamily(f"{NS}_snapshot_bytes", "Size of the last snapshot written.", value=k.last_bytes)
    yield GaugeMetricFamily(f"{NS}_snapshot_dump_seconds", "Time the last snapshot took to read and encode "
                            "(the index lock is held for the read: see docs/state.md).", value=k.last_dump_s)
    yield GaugeMetricFamily(f"{NS}_snapshot_write_seconds", "Time the last snapshot's file write took.",
                            value=k.last_write_s)
    yield GaugeMetricFamily(f"{NS}_snapshot_last_success_timestamp_seconds",
                            "Unix time of the last snapshot written (0: none yet).", value=k.last_ok_unix)


def _jetstream(ing: Any):
    """kvi_jetstream_*: a replica's counters of the event log (read, never computed).
    ``ing`` is a ``JetStreamIngest`` (its stream position and NATS link are its own, not
    the ``Ingest`` protocol's); typed loosely so nats stays off the service's import path."""
    c = ing.counters
    m = CounterMetricFamily(f"{NS}_jetstream_messages", "Event-log messages, by outcome (applied, duplicate: "
                            "already applied per the sequencer's rule, bad: headers missing).", labels=["outcome"])
    for outcome, key in (("applied", "applied"), ("duplicate", "duplicates"), ("bad", "bad_messages")):
        m.add_metric([outcome], c[key])
    yield m
    for name, key, doc in (
            ("gaps", "gaps", "Workers' forward gaps in the log (the worker is then stale)."),
            ("restarts", "restarts", "Engine restarts read from the log (residency dropped)."),
            ("relay_stale", "relay_stale", "Messages the relay flagged stale (its own continuity verdict)."),
            ("purges", "purges", "Stream purges behind a stored snapshot."),
            ("reloads", "reloads", "Snapshot reloads after the stream was purged past this replica."),
            ("stream_lost", "stream_lost", "Stream messages gone before this replica read them, no snapshot "
             "covering them."),
            ("consumers", "consumers", "Consumers created (1 + reconnects, missed heartbeats, delivery holes).")):
        yield CounterMetricFamily(f"{NS}_jetstream_{name}", doc, value=c[key])
    sn = CounterMetricFamily(f"{NS}_jetstream_snapshots", "Object-store snapshots, by outcome.", labels=["outcome"])
    for outcome, key in (("written", "snapshots_written"), ("loaded", "snapshots_loaded"),
                         ("refused", "snapshots_refused"), ("error", "snapshot_errors")):
        sn.add_metric([outcome], c[key])
    yield sn
    rf = CounterMetricFamily(f"{NS}_jetstream_snapshots_refused_by_reason", "Snapshots refused, by reason "
                             "(magic, truncated, checksum, version, corrupt, meta, object).", labels=["reason"])
    for reason, n in sorted(ing.refused.items()):
        rf.add_metric([reason], n)
    yield rf
    yield GaugeMetricFamily(f"{NS}_jetstream_applied_seq", "Last stream sequence applied.", value=ing.seq)
    yield GaugeMetricFamily(f"{NS}_jetstream_lag_messages", "Stream messages not applied yet.", value=ing.lag)
    yield GaugeMetricFamily(f"{NS}_jetstream_connected", "1 while connected to NATS.", value=int(ing.nats_connected))
