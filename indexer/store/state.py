"""The index's state: every mutable thing the store changes and the query reads.

``IndexState`` holds the models (:class:`ModelState`: trees per KV-cache group), the
workers (:class:`WorkerState`, and per group :class:`WorkerGroup`: engine-hash map,
orphans, resident counts, chunk ends), tier names and the counters, and builds them
empty; it looks up a model and an event's tier and group, the helpers every room
uses. The rooms that change or read it are mixins over it, one concern each, each
calling only what it or a room below defines: :mod:`.removal`, :mod:`.lifecycle`,
:mod:`.place` (stores, placeholders, orphans), :mod:`.apply` (a batch), then the
queries (:mod:`indexer.query.prefixes`, :mod:`indexer.query.match`);
:class:`indexer.PrefixIndex` is their sum. Mixins, not separate objects, because the
hot paths (apply a batch, match a prompt) reach the state through ``self`` with no
extra indirection. What reads or rebuilds the state as a whole from outside the
rooms (snapshots, explain) uses the public methods at the end of :class:`IndexState`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence, ValuesView
from typing import TYPE_CHECKING, Any, NamedTuple

from indexer.store.inflight import InFlight
from indexer.store.journal import CLOSE, COUNT, COUNT_DROPPED, Journal
from indexer.store.tree import MAX_TIERS, Kids, Node, Tree

if TYPE_CHECKING:
    from indexer.query.answers import Freshness, Row
    from indexer.wire.decode import RemovedEvent, StoredEvent
    from indexer.wire.events import Hash

__all__ = ["IndexState", "ModelState", "WorkerState", "WorkerGroup", "DEFAULT_CREDITS", "DEFAULT_GROUP_KINDS",
           "ModelRequiredError", "RestoredState"]

DEFAULT_CREDITS = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
# R-APP-10: groups whose headline figures count. None stands for "unknown".
DEFAULT_GROUP_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "unknown", None}
)
GPU = 0  # tier id of "GPU", fixed

_now = time.monotonic


class WorkerGroup:
    """One worker's state in one KV-cache group: its engine-hash map, orphans, resident
    counts and chunk ends."""

    __slots__ = ("map", "orphans", "res", "ends")

    def __init__(self) -> None:
        self.map = Kids()  # engine hash -> Node (R-APP-2 / R-APP-3 resolution)
        # missing parent hash -> [pending (store event, tier id), ...]
        self.orphans: dict[Hash, list[tuple[StoredEvent, int]]] = {}
        self.res = [0] * MAX_TIERS  # resident entries per tier id
        # tier id -> {chunk-end node: blocks in that chunk} (R-APP-5: the blocks
        # of one event form a chunk, whatever size each event has)
        self.ends: dict[int, dict[Node, int]] = {}

    def mark_end(self, tiers: dict[int, int], tid: int, bit: int, node: Node, nblocks: int) -> None:
        """Record ``node`` as the last block of an ``nblocks`` chunk in tier ``tid``."""
        tiers[-tid] = tiers.get(-tid, 0) | bit
        ends = self.ends.get(tid)
        if ends is None:
            ends = self.ends[tid] = {}
        ends[node] = nblocks

    def clear_end(self, tiers: dict[int, int], tid: int, bit: int, node: Node) -> None:
        """Forget ``node`` as a chunk end of this worker in tier ``tid`` (if it was one)."""
        e = tiers.get(-tid, 0)
        if e & bit:
            e ^= bit
            if e:
                tiers[-tid] = e
            else:
                del tiers[-tid]
            self.ends[tid].pop(node, None)


class WorkerState:
    """One worker (an engine's DP rank): its place in its model, its stream position,
    freshness and counters, and its state per KV-cache group."""

    __slots__ = (
        "wid", "bit", "engine", "dp_rank", "model", "groups", "last_seq", "last_ts",
        "last_apply", "stale", "stale_reason", "dropped", "batches", "restarts", "gaps", "fresh", "rows", "pos",
    )

    def __init__(self, wid: int, engine: str, dp_rank: int, model: str, rows: list[Row | None]) -> None:
        self.wid = wid
        self.bit = 1 << wid
        self.engine = engine
        self.dp_rank = dp_rank
        self.model = model
        self.groups: dict[int, WorkerGroup] = {}
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.last_apply: float | None = None
        self.stale = False
        self.stale_reason: str | None = None
        self.dropped: dict[str, int] = {}
        self.batches = 0
        self.restarts = 0
        self.gaps = 0
        self.rows = rows  # the model's rows: wid -> (engine, dp_rank, freshness, position)
        self.pos = 0  # this worker's place in its model's (engine, dp_rank) order (ModelState.rank)
        if len(rows) <= wid:
            rows.extend([None] * (wid + 1 - len(rows)))
        self.refresh()

    def refresh(self) -> None:
        """Snapshot the freshness fields a query reports (one tuple, shared by answers)
        into ``fresh`` and the model's row of this worker."""
        self.fresh: Freshness = (self.stale, self.stale_reason, self.last_seq, self.last_apply)
        self.rows[self.wid] = (self.engine, self.dp_rank, self.fresh, self.pos)


class ModelState:
    """One model: its trees and their kinds per KV-cache group, its workers, and what
    a query's answers read of them (``rows``)."""

    __slots__ = ("name", "trees", "kinds", "windows", "window_groups", "workers", "rows", "ranked", "_defaults",
                 "tiered")

    def __init__(self, name: str) -> None:
        self.name = name
        self.trees: dict[int, Tree] = {}
        self.kinds: dict[int, str | None] = {}
        # group -> sliding window in tokens, for the sliding-window groups whose stores
        # were placed (R-APP-12): their hit rule caps the headline (R-APP-10).
        self.windows: dict[int, int] = {}
        # The groups whose kind is a sliding window (set_kind): their stores never take
        # the raw insert (they leave out null blocks), and may wait for their batch's end.
        self.window_groups: set[int] = set()
        self.workers: dict[int, WorkerState] = {}
        # wid -> (engine, dp_rank, freshness, position) or None: what a query's answers
        # need of each worker, in one list the compiled answers() reads by index.
        self.rows: list[Row | None] = []
        # Whether every worker's position is its place in (engine, dp_rank) order: a
        # new worker clears it, the next query ranks again (a leaving one keeps it).
        self.ranked = True
        self._defaults: list[int] | None = None
        # Set once any non-GPU residency was stored: GPU-only fleets skip the
        # per-tier chunk scan on every query.
        self.tiered = False

    def rank(self) -> None:
        """Give every worker its place in (engine, dp_rank) order, in its row."""
        for i, w in enumerate(sorted(self.workers.values(), key=_engine_rank)):
            w.pos = i
            w.refresh()
        self.ranked = True

    def set_kind(self, group: int, kind: str | None) -> None:
        self.kinds[group] = kind
        self._defaults = None
        if kind is not None and kind.startswith(WINDOW_KIND):
            self.window_groups.add(group)
        else:
            self.window_groups.discard(group)

    def default_groups(self) -> list[int]:
        """R-APP-10 default groups (all groups when none qualifies); cached."""
        d = self._defaults
        if d is None:
            gs = [g for g in self.trees if self.kinds.get(g) in DEFAULT_GROUP_KINDS]
            d = self._defaults = sorted(gs) if gs else sorted(self.trees)
        return d


_EVENT_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")

# kv_cache_spec_kind of a sliding-window group (vLLM: "sliding_window"; R-APP-12).
WINDOW_KIND = "sliding_window"


def _engine_rank(w: WorkerState) -> tuple[str, int]:
    return w.engine, w.dp_rank


class RestoredState(NamedTuple):
    """A whole state, built apart, for :meth:`IndexState.restore_state` to install."""

    tier_names: list[str]  # by tier id
    models: list[tuple[ModelState, bool]]  # (model, idle: its last worker left)
    workers: list[WorkerState]  # each of a model above; wid and (engine, dp_rank) unique
    # (age in seconds, worker group, missing parent hash, (store, tier id)), oldest first;
    # each entry already in its group's ``orphans``
    orphans: list[tuple[float, WorkerGroup, Hash, tuple[StoredEvent, int]]]
    next_wid: int
    free_wids: list[int]


class ModelRequiredError(KeyError):
    """A query named no model while several are indexed (a client error, not a missing model)."""



MAX_IDLE_MODELS = 64


class IndexState:
    """Empty state, the bounds and the counters (see :class:`indexer.PrefixIndex`
    for the parameters)."""

    def __init__(
        self,
        *,
        credits: dict[str, float] | None = None,
        total_chain: Sequence[str] = ("GPU", "CPU", "STORAGE"),
        stale_factor: float = 0.5,
        max_orphans: int = 10_000,
        orphan_ttl_s: float = 30.0,
        max_nodes: int | None = None,
        max_dp_rank: int = 1023,
        max_groups: int = 64,
        max_tiers: int = MAX_TIERS,
        predicted_credit: float = 1.0,
        prefill_ttl_s: float = 30.0,
        decode_ttl_s: float = 300.0,
        max_in_flight: int = 20_000,
        default_block_size: int = 16,
        contention_window_s: float = 0.0,
        clock: Callable[[], float] = _now,
    ) -> None:
        self.credits = {k.upper(): float(v) for k, v in (DEFAULT_CREDITS if credits is None else credits).items()}
        self.total_chain = tuple(t.upper() for t in total_chain)
        self.stale_factor = float(stale_factor)
        self.max_orphans = int(max_orphans)
        self.orphan_ttl_s = float(orphan_ttl_s)
        self.max_nodes = max_nodes
        self.max_dp_rank = int(max_dp_rank)
        self.max_groups = int(max_groups)
        self.max_tiers = min(int(max_tiers), MAX_TIERS)
        self._clock = clock
        # The clock as given: what reads outside the index's calls use (now()), and what
        # _clock goes back to when a recording ends (a Journal wraps it meanwhile).
        self._raw_clock = clock
        # The recording's journal (indexer.ingest.record), or None: every call that can
        # change an answer hands itself to it under the lock.
        self._rec: Journal | None = None
        self._lock = threading.Lock()
        # What the index routed and has not seen announced (predictions, in-flight load).
        self.predicted_credit = float(predicted_credit)
        # The block size predictions are keyed at before a model's first store says its own
        # (vLLM's default); a model that turns out otherwise just finds no prediction.
        self.default_block_size = int(default_block_size)
        self.inflight = InFlight(prefill_ttl_s=prefill_ttl_s, decode_ttl_s=decode_ttl_s, max_in_flight=max_in_flight,
                                 contention_window_s=contention_window_s, clock=clock)
        # This router's place among the replicas routing the same fleet, (slot, of): where a
        # route's ties start (PrefixIndex.set_tie_slot); (0, 1) is one router.
        self.tie_slot = (0, 1)
        # Queries about to take the lock: a writer thread yields the GIL after a
        # batch when this is not empty, so a query waits for one batch, not for the
        # interpreter's 5 ms switch interval. A deque because append/pop are atomic
        # under the GIL, where `+= 1` from several query threads could drift.
        self.readers_waiting: deque[None] = deque()
        self._models: dict[str, ModelState] = {}
        # Models whose last worker left, oldest first: kept (their groups and block sizes
        # are what the next engine of the model will have), up to MAX_IDLE_MODELS.
        self._idle_models: dict[str, None] = {}
        self._workers: dict[tuple[str, int], WorkerState] = {}
        self._free_wids: list[int] = []
        self._next_wid = 0
        # Tier names <-> ids; GPU is 0 (set by _clear). The cache maps raw (medium,
        # ownership) to an id.
        self._tier_names: list[str] = []
        self._tier_ids: dict[str, int] = {}
        self._tier_cache: dict[Any, int] = {}  # medium or (medium, ownership) -> tier id
        # (t, wg, parent_hash, entry) in arrival order
        self._orphan_queue: deque[tuple[float, WorkerGroup, Hash, tuple[StoredEvent, int]]] = deque()
        self._orphans = 0
        # Sliding-window events held to the end of their batch (R-APP-12), and whether
        # the batch's first pass runs (a store deferred once is placed as it can be).
        self._later: list[Any] = []
        self._first_pass = True
        self._clear()
        self._counters: dict[str, int] = {}
        # {event type: {outcome: n}}; index 3 collects what the decoder ignored.
        self._events: list[dict[str, int]] = [{}, {}, {}, {}]
        self._dropped: dict[str, int] = {}
        self._credits_cache: list[float] = []

    def close(self) -> None:
        """Free the whole index now (nodes are outside the cycle collector)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(CLOSE, self._clear, ())
            else:
                self._clear()

    def _clear(self) -> None:
        """Make the state empty, as built (the caller holds the lock): every tree freed, no
        model, worker, orphan or tier but GPU, worker ids from 0. Counters are kept."""
        for m in self._models.values():
            for tree in m.trees.values():
                tree.clear()
        self._models.clear()
        self._idle_models.clear()
        self._workers.clear()
        self._free_wids.clear()
        self._next_wid = 0
        self._tier_names[:] = ["GPU"]
        self._tier_ids.clear()
        self._tier_ids["GPU"] = GPU
        self._tier_cache.clear()
        self._tier_cache[None] = GPU
        self._orphan_queue.clear()
        self._orphans = 0

    def __del__(self) -> None:
        try:
            for m in self._models.values():
                for tree in m.trees.values():
                    tree.clear()
        except Exception:  # interpreter shutdown: nothing left to free
            pass

    # ------------------------------------------------------------ counters

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _drop(self, engine: str, model: str, dp_rank: int | None, reason: str) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        w = self._workers.get((engine, dp_rank or 0))
        if w is not None:
            w.dropped[reason] = w.dropped.get(reason, 0) + 1

    def counter(self, name: str) -> int:
        """One counter of ``stats()["counters"]`` (e.g. ``"batches_applied"``), cheaply:
        no lock and no copy, for pollers that must not slow ingest down."""
        return self._counters.get(name, 0)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one of ``stats()["counters"]`` (for the transport's own events)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(COUNT, self._count, (name, n))
            else:
                self._count(name, n)

    def count_dropped(self, engine: str, dp_rank: int | None, reason: str) -> None:
        """Count a message the transport dropped before decoding (R-DEC-3)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(COUNT_DROPPED, self._drop, (engine, "", dp_rank, reason))
            else:
                self._drop(engine, "", dp_rank, reason)

    # ------------------------------------------------------- models and tiers

    def model_state(self, model: str | None) -> ModelState:
        """The state of ``model``; None names the one model with workers (or
        ``"default"`` among several). The caller holds :attr:`lock`. Changes nothing.

        Raises KeyError for an unknown model, :class:`ModelRequiredError` for None
        while several models have workers and none is ``"default"``."""
        if model is None:
            # The one model with workers (a model whose engines all left does not count).
            live = [m for m in self._models.values() if m.workers] or list(self._models.values())
            if len(live) == 1:
                return live[0]
            if not live:
                raise KeyError("no model is indexed yet")
            # Engines register under "default" unless told otherwise: a query without a
            # model keeps meaning that pool when another model joins.
            d = self._models.get("default")
            if d is not None and d.workers:
                return d
            names = ", ".join(sorted(m.name for m in live))
            raise ModelRequiredError(f"model is required: several models are indexed ({names})")
        m = self._models.get(model)
        if m is None:
            raise KeyError(f"unknown model {model!r}")
        return m

    def _tier(self, medium: object, ownership: object, create: bool = True) -> int:
        """Tier id of an event (contract §1 Tier); -1 once ``max_tiers`` are in use, or,
        with ``create`` False (a removal: nothing can be resident in a tier never
        stored to), when the tier is not in use yet. A new tier takes the next id."""
        ck = medium if ownership is None else (medium, ownership)
        tid = self._tier_cache.get(ck)
        if tid is not None:
            return tid
        if not isinstance(medium, (str, type(None))) or not isinstance(ownership, (str, type(None))):
            return -1
        name = (medium or "GPU").upper()
        if ownership is not None:
            name = f"{name}:{ownership}"
        tid = self._tier_ids.get(name)
        if tid is None:
            if not create or len(self._tier_names) >= self.max_tiers:
                return -1
            tid = len(self._tier_names)
            self._tier_names.append(name)
            self._tier_ids[name] = tid
        if len(self._tier_cache) < 4 * self.max_tiers:
            self._tier_cache[ck] = tid
        return tid

    def _group(self, ev: StoredEvent | RemovedEvent) -> int:
        """The event's KV-cache group (0 when it names none); -1 past ``max_groups``."""
        g = ev.group_idx
        if g is None:
            return 0
        if g < 0 or g >= self.max_groups:
            return -1
        return g

    # ------------------------------------------ the whole state, read and restored
    #
    # What reads or rebuilds the state as a whole (snapshots, explain) goes through
    # these, under ``lock`` where they say so; the rooms above reach the fields directly.

    @property
    def lock(self) -> threading.Lock:
        """The index lock: every public method takes it once; hold it to read the state."""
        return self._lock

    def now(self) -> float:
        """The index's clock (monotonic unless one was given); a recording does not
        note this reading (it is not part of any call the index journals)."""
        return self._raw_clock()

    @property
    def journal(self) -> Journal | None:
        """The recording's journal while one is attached (:mod:`indexer.ingest.record`)."""
        return self._rec

    def options(self) -> dict[str, Any]:
        """The settings an index was built with, as keyword arguments of its constructor
        (a replay builds its index from them). Changes nothing."""
        inf = self.inflight
        return {"credits": dict(self.credits), "total_chain": list(self.total_chain),
                "stale_factor": self.stale_factor, "max_orphans": self.max_orphans,
                "orphan_ttl_s": self.orphan_ttl_s, "max_nodes": self.max_nodes, "max_dp_rank": self.max_dp_rank,
                "max_groups": self.max_groups, "max_tiers": self.max_tiers,
                "predicted_credit": self.predicted_credit, "prefill_ttl_s": inf.prefill_ttl_s,
                "decode_ttl_s": inf.decode_ttl_s, "max_in_flight": inf.max_in_flight,
                "default_block_size": self.default_block_size, "contention_window_s": inf.contention_window_s}

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Tier names by tier id (GPU is 0)."""
        return tuple(self._tier_names)

    def tier_id(self, name: str) -> int | None:
        """The id of the tier named ``name``, None while nothing was stored to it."""
        return self._tier_ids.get(name)

    def model_states(self) -> Iterator[tuple[ModelState, bool]]:
        """Every model with whether it is idle (its last worker left); under :attr:`lock`."""
        idle = self._idle_models
        for name, m in self._models.items():
            yield m, name in idle

    def worker_states(self) -> ValuesView[WorkerState]:
        """Every worker, in registration order; under :attr:`lock`."""
        return self._workers.values()

    def worker_state(self, engine: str, dp_rank: int = 0) -> WorkerState | None:
        """One worker, or None when unknown; under :attr:`lock`, or on the one thread that
        applies batches (a replica's)."""
        return self._workers.get((engine, dp_rank))

    def orphan_entries(self) -> Iterator[tuple[float, WorkerGroup, Hash, tuple[StoredEvent, int]]]:
        """``(buffered at, worker group, missing parent hash, (store, tier id))`` of every
        orphan still buffered, oldest first; under :attr:`lock`."""
        for t, wg, ph, entry in self._orphan_queue:
            lst = wg.orphans.get(ph)
            if lst is not None and any(e is entry for e in lst):  # else adopted or dropped already
                yield t, wg, ph, entry

    def wids(self) -> tuple[int, list[int]]:
        """``(next new worker id, free worker ids)``, a copy; under :attr:`lock`."""
        return self._next_wid, list(self._free_wids)

    def is_empty(self) -> bool:
        """No model and no worker (a restore's precondition)."""
        return not self._workers and not self._models

    def restore_state(self, build: Callable[[], RestoredState], *, replace: bool = False) -> None:
        """Make the state the one ``build`` returns (:mod:`indexer.store.snapshot` builds
        it from a snapshot), under the lock: what the index held goes first with
        ``replace`` (before ``build`` runs: the two never take memory at once); without
        it, a ValueError unless the index is empty. Settings and counters stay. When
        ``build`` raises, the index is left empty and the exception goes on (``build``
        frees the trees it made)."""
        with self._lock:
            if replace:
                self._clear()
            elif not self.is_empty():
                raise ValueError("restore needs an empty index")
            try:
                st = build()
            except BaseException:
                self._clear()
                raise
            self._tier_names[:] = st.tier_names
            self._tier_ids.clear()
            self._tier_ids.update((n, i) for i, n in enumerate(st.tier_names))
            self._tier_cache.clear()
            self._tier_cache[None] = GPU
            for m, idle in st.models:
                self._models[m.name] = m
                if idle:
                    self._idle_models[m.name] = None
            for w in st.workers:
                self._workers[(w.engine, w.dp_rank)] = w
                mo = self._models[w.model]
                mo.workers[w.wid] = w
                mo.ranked = False
            self._next_wid = st.next_wid
            self._free_wids[:] = st.free_wids
            t0 = self._clock()
            q = self._orphan_queue
            for age_s, wg, ph, entry in st.orphans:
                q.append((t0 - age_s, wg, ph, entry))
            self._orphans += len(st.orphans)
            if self._rec is not None and self._rec.on_restore is not None:
                self._rec.on_restore()  # a state not made by journaled calls: the recording starts again here
