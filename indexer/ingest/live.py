"""Live ingest: subscribe to vLLM engines over ZMQ and keep a PrefixIndex exact.

:class:`Indexer` wires the layers together, left to right: the transport
(:mod:`.transport`: one thread owns every ZMQ socket), one sequencer
:class:`~.sequencer.Stream` per worker (every seq, gap, restart, replay and
continuity decision, R-STR-1..7), and the :class:`PrefixIndex` (decode and store).
:class:`WorkerStream` is a worker's subscription (its sockets, and its Stream state);
:class:`IndexSink` is what its Stream calls: the index and the replay socket (a relay's
sink, :mod:`.relay`, publishes instead).

Threads. Batches are applied on the ingest thread under the index lock, one at a
time. Queries run on the caller's thread and take the same lock, so they never see
a half-applied batch (R-Q-5) and never wait behind more than one batch. One thread
is enough: decoding and applying are CPU-bound Python, so more threads would only
fight over the GIL, and a single owner needs no locking around sequence state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import msgspec
import zmq

from indexer.ingest.background import Background, Queries
from indexer.query.index import PrefixIndex
from indexer.sequence.sequencer import Stream
from indexer.store.snapshot import Snapshot, dumps
from indexer.transport.engine_metrics import EngineLoad, MetricsScraper
from indexer.transport.sockets import Sub, ZmqTransport
from indexer.wire.engines import EndpointPolicy, EngineConfig, as_config, offset_endpoint

__all__ = ["EngineConfig", "Indexer", "IndexSink", "WorkerStream"]

log = logging.getLogger("indexer.ingest.live")

class WorkerStream(Stream):
    """One worker's subscription: its sockets and its :class:`Stream` (sequencing)."""

    __slots__ = ("engine", "rank", "model", "endpoint", "replay_endpoint", "topic", "sock", "mon", "dealer",
                 "connected", "messages", "connects")

    def __init__(self, cfg: EngineConfig, rank: int, sink: IndexSink, ingest: Indexer) -> None:
        # IndexSink's methods take the WorkerStream that calls them (a Stream passes
        # itself), not any Stream.
        super().__init__(sink, max_buffered=ingest.max_buffered,  # type: ignore[arg-type]
                         replay_timeout_s=ingest.replay_timeout_s)
        self.engine = cfg.id
        self.rank = rank
        self.model = cfg.model
        off = rank - cfg.dp_rank_start
        self.endpoint = offset_endpoint(cfg.endpoint, off)
        self.replay_endpoint = offset_endpoint(cfg.replay_endpoint, off) if cfg.replay_endpoint else None
        self.topic = cfg.topic.encode()
        self.sock: zmq.Socket[bytes] | None = None
        self.mon: zmq.Socket[bytes] | None = None
        self.dealer: zmq.Socket[bytes] | None = None
        self.connected = False
        self.messages = 0
        self.connects = 0  # live-socket connects seen by the monitor (1 = never reconnected)


class IndexSink:
    """What the sequencer of each worker calls: the index and the replay sockets."""

    __slots__ = ("ingest", "index")

    def __init__(self, ingest: Indexer) -> None:
        self.ingest = ingest
        self.index = ingest.index

    def apply_batch(self, sub: WorkerStream, seq: int, payload: bytes) -> float | None:
        index = self.index
        if sub.replaying and index.journal is not None:
            index.journal.note("replayed", sub.engine, sub.rank, seq)  # the batch came by replay, not live
        ts = index.apply_sequenced(sub.engine, payload, model=sub.model, dp_rank=sub.rank, seq=seq)
        if index.readers_waiting:
            _yield_gil()
        return ts

    def reset_worker(self, sub: WorkerStream) -> None:
        self.index.reset_worker(sub.engine, sub.rank)

    def request_replay(self, sub: WorkerStream, start: int) -> str | None:
        if sub.dealer is None:
            if sub.replay_endpoint is None:
                return f"batches from {start} lost and no replay endpoint"
            return "replay socket not open"
        sub.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        if self.index.journal is not None:
            self.index.journal.note("replay_requested", sub.engine, sub.rank, start)
        self.ingest._replay_on(sub)
        return None

    def cancel_replay(self, sub: WorkerStream) -> None:
        # A new DEALER, so late answers to this replay cannot reach the next one.
        self.ingest._reopen_dealer(sub)
        self.ingest._replay_off(sub)

    def mark_stale(self, sub: WorkerStream, reason: str) -> None:
        self.index.mark_stale(sub.engine, sub.rank, reason)
        log.warning("worker %s/%d stale: %s", sub.engine, sub.rank, reason)

    def mark_fresh(self, sub: WorkerStream) -> None:
        self.index.clear_stale(sub.engine, sub.rank)

    def count(self, sub: WorkerStream, name: str) -> None:
        if self.index.journal is not None:
            self.index.journal.note(name, sub.engine, sub.rank)  # the sequencer's decision, with its worker
        self.index.count(name)


class Indexer(ZmqTransport, Background, Queries):
    """A :class:`PrefixIndex` fed live by ZMQ subscribers to a fleet of vLLM engines.

    Parameters
    ----------
    engines:
        :class:`EngineConfig` objects or dicts with the same fields.
    index:
        The index to feed (a new one by default, built with ``index_options``).
    replay_timeout_s:
        How long a replay may take before the worker is marked stale.
    max_buffered:
        Live batches buffered per worker while it replays; beyond, the replay is
        abandoned (stale) rather than growing memory.
    rcvhwm:
        Live batches a worker's SUB socket queues before they are applied, at most (ZMQ
        RCVHWM; 0 = no bound). What bounds the memory a burst takes between the socket
        and the tree: past it ZMQ stops reading the connection, so the backlog waits in
        the engine's PUB queue (vLLM's SNDHWM is 100,000), and what that queue drops is a
        gap the sequencer replays from the engine's buffer (R-STR-2). With the old bound
        of 1,000,000 a 1.5M-entry burst peaked at ~160 B/entry over ~73 settled; at 64,
        ~77 (``benchmarks/bench_services.py``), at the same ingest rate.
    reconnect_ivl_ms, reconnect_ivl_max_ms:
        ZMQ's reconnect backoff for the live and replay sockets (first interval, cap). The
        cap bounds how late a new engine incarnation on the same ports is seen, and so how
        long its predecessor's blocks can stay claimed (the reconnect proves continuity at
        once, R-STR-7); a refused connect to a down engine every 250 ms costs next to nothing.
    max_workers:
        Workers (engine DP ranks) subscribed at once, at most; each holds up to four
        sockets, so this bounds sockets and file descriptors (R-BAD-3).
    metrics_interval_s:
        How often the engines configured with a ``metrics_url`` are scraped.
    endpoint_policy:
        Checked before any engine is subscribed (:class:`~.engines.EndpointPolicy`:
        tcp only, an allowlist); None accepts every valid endpoint (ipc and inproc too).
    context:
        The ZMQ context; by default one of our own, sized for ``max_workers`` (libzmq's
        default of 1,023 sockets per context is ~250 workers).
    snapshot:
        Start from this snapshot (:func:`indexer.store.snapshot.loads`; the index must be
        empty): its state is restored, its engines are subscribed again besides
        ``engines`` (``engines`` win on a conflict), workers of no engine are dropped,
        and each worker proves continuity from its last seq on its first connect and
        replays what it missed (R-DUR-2).
    """

    # What each worker's Stream calls (a relay's publishes instead of applying).
    _sink_class: type[IndexSink] = IndexSink

    def __init__(
        self,
        engines: Iterable[EngineConfig | dict[str, Any]] = (),
        *,
        index: PrefixIndex | None = None,
        replay_timeout_s: float = 5.0,
        max_buffered: int = 100_000,
        rcvhwm: int = 64,
        max_workers: int = 2048,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 250,
        context: zmq.Context[Any] | None = None,
        endpoint_policy: EndpointPolicy | None = None,
        metrics_interval_s: float = 2.0,
        snapshot: Snapshot | None = None,
        **index_options: Any,
    ) -> None:
        self.index: PrefixIndex = index if index is not None else PrefixIndex(**index_options)
        self.replay_timeout_s = float(replay_timeout_s)
        self.max_buffered = int(max_buffered)
        self.rcvhwm = int(rcvhwm)
        self.reconnect_ivl_ms = int(reconnect_ivl_ms)
        self.reconnect_ivl_max_ms = int(reconnect_ivl_max_ms)
        self.max_workers = int(max_workers)
        # A context of our own is made by start() and ended by stop(), so an Indexer that
        # never started, or has stopped, holds no ZMQ I/O thread (nor an unclosed context).
        self._given_ctx = context
        self._engines: dict[tuple[str, int], EngineConfig] = {}  # (id, dp_rank_start)
        self._subs: dict[tuple[str, int], WorkerStream] = {}
        self._cmds: queue.Queue[tuple[str, Any, threading.Event, list[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = threading.Event()
        self._wake_addr = f"inproc://kvidx-wake-{id(self)}"
        self._wake_tx: zmq.Socket[bytes] | None = None
        self._replaying: set[Sub] = set()
        self.link: dict[tuple[str, int], tuple[bool, bool]] = {}
        self._sink = self._sink_class(self)
        self.error: str | None = None  # set if the ingest thread died (see ``running``)
        self.endpoint_policy = endpoint_policy
        # Engines' own load (vLLM /metrics), for those configured with a metrics_url.
        self.scraper = MetricsScraper(self._engine_load, interval_s=metrics_interval_s, clock=self.index.now)
        # Engine registrations and removals done, by (op, via): "register"/"unregister" x
        # who asked ("config", "api", "dynamo", "discovery", "library").
        self.changes: dict[tuple[str, str], int] = {}
        self.counters: dict[str, int] = {}  # Ingest's: the ZMQ ingest's counters are the index's
        self.engine_loads: dict[tuple[str, int], EngineLoad] = {}  # the last report per worker
        if snapshot is not None:
            snapshot.restore(self.index)
        for e in engines:
            self._add(self._checked(as_config(e)), "config")
        if snapshot is not None:
            self._resume(snapshot)

    def _resume(self, snapshot: Snapshot) -> None:
        """Subscribe the snapshot's engines (unless a configured one holds the id), drop
        the workers no engine covers, and let each restored worker resume its stream."""
        for e in snapshot.engines:
            try:
                self._add(self._checked(as_config(e)), "snapshot")
            except ValueError as err:  # taken by the configuration, or refused by the policy
                log.warning("snapshot engine %s not restored: %s", e.get("id") if isinstance(e, dict) else e, err)
        index = self.index
        for engine, rank, _model, _ in snapshot.workers():
            if (engine, rank) not in self._subs:
                index.drop_worker(engine, rank)
        for key, sub in self._subs.items():
            last = index.worker_position(*key)
            if last is not None and last[0] is not None:
                sub.resume(last[0], last[1], not last[2])

    def snapshot(self, meta: dict[str, Any] | None = None) -> bytes:
        """The index and the engine registry as snapshot bytes (:mod:`indexer.store.snapshot`);
        one consistent cut under the index lock. Changes nothing."""
        engines = [msgspec.to_builtins(c) for c in self.engines()]
        return dumps(self.index, engines=engines, meta=meta)

    # ------------------------------------------------------------- public API

    def start(self) -> None:
        """Start the ingest thread (returns at once; engines connect in the background)."""
        if self._thread is not None:
            return
        if self._given_ctx is not None:
            self._ctx = self._given_ctx
        else:
            self._ctx = zmq.Context()
            self._ctx.set(zmq.MAX_SOCKETS, 4 * self.max_workers + 64)
        wake_rx = self._ctx.socket(zmq.PAIR)
        wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.SNDTIMEO, 2000)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._running.set()
        self._thread = threading.Thread(target=self._run, args=(wake_rx,), name="kvidx-ingest", daemon=True)
        self._thread.start()
        self.scraper.start()

    def stop(self) -> None:
        """Stop the ingest thread and close every socket; the index is kept."""
        t = self._thread
        if t is None:
            return
        if t.is_alive():
            try:
                # The ingest thread clears its own running flag, between two
                # batches; clearing it from here could make it exit without
                # answering, and a send to a closed wake socket would block.
                self._call("halt")
            except TimeoutError:
                self._running.clear()
        t.join(timeout=5)
        self._thread = None
        self.scraper.stop()
        if self._wake_tx is not None:
            self._wake_tx.close(0)
            self._wake_tx = None
        if self._given_ctx is None and not t.is_alive():
            # The ingest thread has closed its sockets and ended: no socket is in use, and
            # destroy (not term) cannot wait forever on one a failed close left behind.
            self._ctx.destroy(linger=0)

    def add_engine(self, engine: EngineConfig | dict[str, Any] | None = None, *, via: str = "library",
                   **fields: Any) -> EngineConfig:
        """Subscribe to one more engine (all its DP ranks); ``via`` names who asked (counted
        in :attr:`changes`).

        Raises
        ------
        ValueError
            When the id is taken by a different configuration, or a field is bad;
            :class:`~.engines.EndpointRefused` (a ValueError) when the endpoint policy
            refuses an endpoint: nothing was connected.
        """
        cfg = self._checked(as_config(engine if engine is not None else fields))
        return cast(EngineConfig, self._call("add", (cfg, via)))

    def remove_engine(self, engine_id: str, dp_rank: int | None = None, *, via: str = "library") -> bool:
        """Unsubscribe from an engine and drop its workers' residency (R-STR-6): all of
        them, or only the config covering ``dp_rank``. Returns False when unknown."""
        return cast(bool, self._call("remove", (engine_id, dp_rank, via)))

    def _checked(self, cfg: EngineConfig) -> EngineConfig:
        if self.endpoint_policy is not None:
            self.endpoint_policy.check(cfg)
        return cfg

    def resync(self, engine_id: str) -> None:
        """Drop an engine's state and replay each worker from seq 0 (recovers stale workers
        whose engine still buffers its whole history)."""
        self._call("resync", engine_id)

    def engines(self) -> list[EngineConfig]:
        return list(self._engines.values())

    def workers(self) -> list[dict[str, Any]]:
        """Per-worker status: the index's freshness, sizes and drop counters plus the
        transport's view (connected, replaying, replays done and failed)."""
        by_key = {(w["engine"], w["dp_rank"]): w for w in self.index.workers()}
        subs = dict(list(self._subs.items()))  # one atomic copy under the GIL
        out: list[dict[str, Any]] = []
        for key in sorted(set(by_key) | set(subs)):
            w = dict(by_key.get(key) or {"engine": key[0], "dp_rank": key[1], "stale": False,
                                         "stale_reason": None, "last_seq": None, "dropped": {}})
            sub = subs.get(key)
            if sub is not None:
                w.update(
                    endpoint=sub.endpoint,
                    replay_endpoint=sub.replay_endpoint,
                    connected=sub.connected,
                    replaying=sub.replaying,
                    replays_ok=sub.replays_ok,
                    replays_failed=sub.replays_failed,
                    gaps=sub.gaps,  # seen on the wire, repaired or not
                    messages=sub.messages,
                    connects=sub.connects,
                )
            w["health"] = _health(w, sub)
            el = self.engine_loads.get(key)
            w["engine_load"] = None if el is None else {
                "waiting": el.waiting, "running": el.running, "kv_usage": el.kv_usage,
                "age_s": round(self.index.now() - el.t, 3)}
            out.append(w)
        return out

    # ---------------------------------------------------------- command path

    def _call(self, op: str, arg: Any = None) -> Any:
        """Run a command on the ingest thread (or inline when it is not running)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return self._do(op, arg)
        done = threading.Event()
        box: list[Any] = []
        self._cmds.put((op, arg, done, box))
        try:
            self._wake_tx.send(b"")  # type: ignore[union-attr]  # set while the thread runs
        except zmq.Again:
            raise TimeoutError(f"ingest thread did not take {op!r}") from None
        deadline = time.monotonic() + 10
        while not done.wait(0.1):
            if not self._thread.is_alive():
                raise TimeoutError(f"ingest thread is gone ({self.error or 'stopped'}); {op!r} not done")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ingest thread did not answer {op!r}")
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    def _do(self, op: str, arg: Any) -> Any:
        if op == "halt":
            self._running.clear()
            return None
        if op == "add":
            return self._add(*arg)
        if op == "remove":
            return self._remove(arg)
        if op == "resync":
            return self._resync(arg)
        return None

    def _engine_load(self, engine: str, rank: int, load: EngineLoad) -> None:
        """The scraper's callback: a worker's own report corrects the in-flight estimate."""
        self.index.correct_load((engine, rank), load.waiting, load.running, load.t)
        self.engine_loads[(engine, rank)] = load

    def _count(self, op: str, via: str) -> None:
        self.changes[(op, via)] = self.changes.get((op, via), 0) + 1

    def _add(self, cfg: EngineConfig, via: str) -> EngineConfig:
        for (eid, _), old in self._engines.items():
            if eid != cfg.id:
                continue
            if old == cfg:
                return old
            if old.model != cfg.model or set(old.ranks) & set(cfg.ranks):
                raise ValueError(f"engine {cfg.id!r} is already registered with another configuration")
        if len(self._subs) + cfg.dp_size > self.max_workers:
            raise ValueError(f"engine {cfg.id!r}: {cfg.dp_size} more worker(s) would exceed max_workers="
                             f"{self.max_workers} ({len(self._subs)} subscribed)")
        self._engines[(cfg.id, cfg.dp_rank_start)] = cfg
        if cfg.metrics_url is not None:
            self.scraper.set_target(cfg.id, cfg.metrics_url, cfg.ranks)
        for r in cfg.ranks:
            sub = WorkerStream(cfg, r, self._sink, self)
            self._subs[(cfg.id, r)] = sub
            self.link[(cfg.id, r)] = (False, False)
            self.index.register_worker(cfg.id, r, model=cfg.model)
            if self._thread is not None:
                self._open(sub)
        self._count("register", via)
        return cfg

    def _remove(self, arg: tuple[str, int | None, str]) -> bool:
        engine_id, dp_rank, via = arg
        gone = [k for k, c in self._engines.items()
                if k[0] == engine_id and (dp_rank is None or dp_rank in c.ranks)]
        if not gone:
            return False
        for k in gone:
            if self._engines[k].metrics_url is not None:
                self.scraper.remove_target(engine_id, self._engines[k].ranks)
            for r in self._engines.pop(k).ranks:
                sub = self._subs.pop((engine_id, r), None)
                self.link.pop((engine_id, r), None)
                self.engine_loads.pop((engine_id, r), None)
                if sub is not None:
                    self._close(sub)
                    self._replay_off(sub)
                self.index.drop_worker(engine_id, r)
        self._count("unregister", via)
        return True

    def _resync(self, engine_id: str) -> None:
        for (e, _), sub in list(self._subs.items()):
            if e == engine_id:
                sub.resync()


def _health(w: dict[str, Any], sub: WorkerStream | None) -> str:
    """One word for a worker: stale, replaying, never_connected, disconnected or ok."""
    if w["stale"]:
        return "stale"
    if sub is None:
        return "ok"  # known to the index only (applied in-process)
    if sub.replaying:
        return "replaying"
    if not sub.connected:
        return "disconnected" if sub.connects else "never_connected"
    return "ok"


def _yield_gil() -> None:
    # sleep(0) releases the GIL so a query blocked on it runs now.
    time.sleep(0)
