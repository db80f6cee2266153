"""Replicas on a shared event log: NATS JetStream (the consumer side; the relay is
:mod:`.relay`). Only ``kv-indexer relay`` and ``serve --nats`` import this module (and
``nats``); nothing on the default path does.

The log. A relay (:class:`~.relay.Relay`) subscribes to the engines over ZMQ exactly as
:class:`~.ingest.Indexer` does (the same sequencer: gaps repaired by replay, restarts
proven) and publishes every batch its sequencer applies to one stream, one message a
batch: the payload is vLLM's batch payload as it came off the wire, the headers say
whose it is (:func:`headers`). ``Nats-Msg-Id`` is ``engine/rank/seq/xxh64(payload)``:
two relays publishing the same batch make one message (JetStream drops the second
within the stream's duplicate window), and a restarted engine's new seq 0 is another
message than its previous incarnation's seq 0.

A replica (:class:`JetStreamIngest`) reads the stream in order from a stream sequence
and applies each message to its :class:`PrefixIndex` by a rule that reads only the
message and the index (:meth:`JetStreamIngest.apply_record`), so every replica that
applied the same stream prefix holds the same index (R-DUR-10). Snapshots go to the
stream's object store; the stream is purged behind them (R-DUR-12,
:mod:`.replica_snapshots`). ``docs/jetstream.md``
has the whole story.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from indexer.ingest.background import Background, Queries
from indexer.ingest.eventlog import (
    DEFAULT_BUCKET,
    DEFAULT_STREAM,
    DEFAULT_SUBJECT,
    DUPLICATE_WINDOW_S,
    H_ENGINE,
    H_MODEL,
    H_RANK,
    H_RESTART,
    H_SEQ,
    H_STALE,
    KEEP_BEHIND,
    REPLICA_REFUSES,
    ack_fields,
    connect,
    ensure_stream,
    object_store,
)
from indexer.ingest.replica_snapshots import BucketSnapshots
from indexer.query.index import PrefixIndex
from indexer.sequence.sequencer import GAP, RESTART, classify, peek_ts
from indexer.wire.engines import EngineConfig

__all__ = ["JetStreamIngest"]

log = logging.getLogger("indexer.ingest.jetstream")

class _Behind(Exception):
    """The stream no longer holds the next message this replica needs (purged past it)."""


# Replica counters (``JetStreamIngest.counters``): exported as kvi_jetstream_* (api/metrics.py).
REPLICA_COUNTERS = ("messages", "applied", "duplicates", "gaps", "restarts", "relay_stale", "bad_messages",
                    "snapshots_written", "snapshots_loaded", "snapshots_refused", "snapshot_errors", "purges",
                    "reloads", "stream_lost", "consumers")


class JetStreamIngest(BucketSnapshots, Background, Queries):
    """A :class:`PrefixIndex` fed from the relay's JetStream event log (a replica).

    It offers what the service uses of :class:`~.ingest.Indexer` (``start``, ``astop``,
    ``running``, ``error``, ``link``, ``changes``, ``engines``, ``workers``, ``route``,
    ``match``...); engines are the relay's, so :meth:`add_engine` and
    :meth:`remove_engine` refuse with a ValueError.

    Parameters
    ----------
    url:
        The NATS server (``nats://host:4222``).
    index:
        The index to feed (a new one by default, built with ``index_options``).
    stream, subject, bucket:
        The event log's stream and subject, and the object-store bucket of snapshots.
    snapshot_interval_s:
        How often a snapshot is written to the bucket (0: never); also on ``stop()``.
    keep_behind:
        Messages kept in the stream below the stored snapshot when it is purged (a
        margin for replicas that lag behind the one that wrote it).
    heartbeat_s:
        The consumer's idle heartbeat; three missed ones and it is recreated.
    """

    def __init__(self, url: str, index: PrefixIndex | None = None, *, stream: str = DEFAULT_STREAM,
                 subject: str = DEFAULT_SUBJECT, bucket: str = DEFAULT_BUCKET, snapshot_interval_s: float = 0.0,
                 keep_behind: int = KEEP_BEHIND, heartbeat_s: float = 1.0,
                 duplicate_window_s: float = DUPLICATE_WINDOW_S, name: str = "kv-indexer-replica",
                 **index_options: Any) -> None:
        self.index: PrefixIndex = index if index is not None else PrefixIndex(**index_options)
        self.url = url
        self.stream = stream
        self.subject = subject
        self.bucket = bucket
        self.snapshot_interval_s = float(snapshot_interval_s)
        self.keep_behind = int(keep_behind)
        self.heartbeat_s = float(heartbeat_s)
        self.duplicate_window_s = float(duplicate_window_s)
        self.name = name
        self.seq = 0  # the last stream sequence applied (or covered by the snapshot loaded)
        self.stream_last = 0  # the stream's last sequence, as last seen
        self.counters: dict[str, int] = dict.fromkeys(REPLICA_COUNTERS, 0)
        self.refused: dict[str, int] = {}  # snapshots refused, by SnapshotError.reason
        self.snapshot_seq: int | None = None  # the stream sequence of the last snapshot loaded or written
        self.nats_connected = False
        self.link: dict[tuple[str, int], tuple[bool, bool]] = {}
        self.changes: dict[tuple[str, str], int] = {}
        self.engine_loads: dict[tuple[str, int], Any] = {}
        self.messages: dict[tuple[str, int], int] = {}
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._recreate = False
        self._ready = threading.Event()
        self._snap_t = time.monotonic()
        self._snap_task: asyncio.Task[None] | None = None
        self._obs: ObjectStore | None = None
        self._js: JetStreamContext | None = None
        self._bad_digest: str | None = None  # the stored snapshot refused last (not counted twice)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start consuming (returns at once; connects and catches up in the background)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="kvidx-jetstream", daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop consuming (a snapshot is written first when snapshots are on); the index is kept."""
        t = self._thread
        if t is None:
            return
        self._stopping = True
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the loop just ended
                pass
        t.join(timeout)
        self._thread = None

    @property
    def lag(self) -> int:
        """Messages in the stream not applied yet (as of the last delivery or check)."""
        return max(0, self.stream_last - self.seq)

    # ------------------------------------------------------- what Service uses

    def snapshot(self, meta: dict[str, Any] | None = None) -> None:
        """None: a replica's snapshots are written to the object store, not handed out."""
        return None

    def engines(self) -> list[EngineConfig]:
        return []  # the relay's; a replica knows workers (from the log), not endpoints

    def add_engine(self, engine: Any = None, *, via: str = "library", **fields: Any) -> EngineConfig:
        raise ValueError(REPLICA_REFUSES)

    def remove_engine(self, engine_id: str, dp_rank: int | None = None, *, via: str = "library") -> bool:
        raise ValueError(REPLICA_REFUSES)

    def resync(self, engine_id: str) -> None:
        raise ValueError(REPLICA_REFUSES)

    def workers(self) -> list[dict[str, Any]]:
        """The index's workers, each with its health and what the log carried of it."""
        out = []
        up = self.nats_connected
        for w in self.index.workers():
            key = (w["engine"], w["dp_rank"])
            w.update(endpoint=f"jetstream:{self.stream}", connected=up, connects=1, replaying=False,
                     messages=self.messages.get(key, 0), engine_load=None,
                     health="stale" if w["stale"] else "ok" if up else "disconnected")
            out.append(w)
        return out

    # ------------------------------------------------------------- the rule

    def apply_record(self, engine: str, rank: int, model: str, seq: int, payload: bytes, *,
                     restart_after: float | None = None, stale: str | None = None) -> str:
        """Apply one message of the log (R-DUR-10): a pure function of the message and
        the index, so replicas fed the same stream end identical.

        Per worker, the sequencer's rule (:func:`~.sequencer.classify`, as
        :meth:`PrefixIndex.apply` applies it): ``seq == last + 1`` applies; ``seq <=
        last`` with a newer batch ts is an engine restart (residency dropped, then
        applied), else a duplicate (skipped). Besides: the relay's ``Kvi-Restart`` makes
        a batch a restart that the ts alone cannot show (the relay proved it by replay: an
        engine clock behind, or a restart hidden behind a reconnect) when the batch it says
        was replaced (its ts, ``restart_after``) is the worker's last one here (a copy
        re-sent later by a relay that lagged is not); a forward gap, or a first batch past seq 0, applies and
        marks the worker stale naming the missing seqs; seq 0 (a fresh start) clears the
        mark; the relay's ``Kvi-Stale`` marks it stale with the relay's reason.

        Returns ``"applied"``, ``"duplicate"`` or ``"dropped"`` (did not decode).
        """
        ix = self.index
        w = ix.worker_state(engine, rank)  # read on the one thread that writes
        known = w is not None and w.model == model
        last = w.last_seq if known and w is not None else None
        last_ts = w.last_ts if known and w is not None else None
        verdict = classify(last, last_ts, seq, peek_ts(payload))
        if verdict != RESTART and restart_after is not None and restart_after == last_ts:
            ix.reset_worker(engine, rank)
            verdict = RESTART
        out = ix.apply(engine, payload, model=model, dp_rank=rank, seq=seq)
        key = (engine, rank)
        self.messages[key] = self.messages.get(key, 0) + 1
        if key not in self.link:
            self.link[key] = (True, True)
        c = self.counters
        if out == "duplicate":
            c["duplicates"] += 1
            return out
        c["applied"] += 1
        first = last is None or verdict == RESTART
        if verdict == RESTART:
            c["restarts"] += 1
        start = 0 if first or last is None else last + 1
        if seq > start:
            c["gaps"] += verdict == GAP or first
            missing = f"{start}" if seq == start + 1 else f"{start}..{seq - 1}"
            ix.mark_stale(engine, rank, f"event log: batch(es) {missing} of {engine}/{rank} missing")
        elif seq == 0:
            ix.clear_stale(engine, rank)
        if stale is not None:
            c["relay_stale"] += 1
            ix.mark_stale(engine, rank, f"relay: {stale}")
        return out

    def _apply_msg(self, msg: Msg) -> None:
        h = msg.headers or {}
        try:
            engine, rank, model, seq = h[H_ENGINE], int(h[H_RANK]), h.get(H_MODEL, "default"), int(h[H_SEQ])
        except (KeyError, ValueError):
            self.counters["bad_messages"] += 1
            return
        try:
            after = float(h[H_RESTART]) if H_RESTART in h else None
        except ValueError:
            after = None
        self.apply_record(engine, rank, model, seq, msg.data, restart_after=after, stale=h.get(H_STALE))
        if self.index.readers_waiting:
            time.sleep(0)  # a query waits for the lock: let it run now

    # ------------------------------------------------------------- the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # a bug must not leave the thread dead silently
            self.error = f"jetstream consumer crashed: {e!r}"
            log.exception("jetstream consumer crashed")
        finally:
            self._ready.set()
            self.nats_connected = False

    def _set_connected(self, up: bool) -> None:
        self.nats_connected = up
        if up:
            self._recreate = True  # the server may have restarted: consumers are recreated

    async def _sleep(self, s: float) -> None:
        assert self._stop is not None
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except asyncio.TimeoutError:
            pass

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stopping:
            return
        self._ready.set()
        nc = await connect(self.url, self.name, lambda: self._stopping, on_state=self._set_connected)
        if nc is None:
            return
        try:
            js = nc.jetstream()
            booted = False
            while not self._stop.is_set():
                try:
                    if not booted:
                        await ensure_stream(js, self.stream, self.subject, self.duplicate_window_s)
                        await self._boot(js)
                        booted = True
                    await self._consume(nc, js)
                except _Behind as e:
                    await self._catch_up(js, e.args[0])
                except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
                    if not self._stop.is_set():
                        log.warning("%s: %r; resuming after stream seq %d", self.name, e, self.seq)
                        await self._sleep(0.2)
            await self._final_snapshot()
        finally:
            await nc.close()

    async def _boot(self, js: JetStreamContext) -> None:
        """Load the stored snapshot (if any, and good), then follow the stream after it."""
        self._js = js
        self._obs = await object_store(js, self.bucket)
        await self._load_snapshot()

    async def _consume(self, nc: Client, js: JetStreamContext) -> None:
        """One ephemeral push consumer from ``seq + 1`` until it must be recreated (a
        reconnect, missed heartbeats, a hole in the deliveries) or the stop."""
        assert self._stop is not None
        si = await js.stream_info(self.stream)
        self.stream_last = si.state.last_seq
        if si.state.first_seq > self.seq + 1:
            raise _Behind(si.state.first_seq)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
        hb = self.heartbeat_s
        cfg = api.ConsumerConfig(
            deliver_subject=inbox, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.seq + 1,
            ack_policy=api.AckPolicy.NONE, filter_subject=self.subject, flow_control=True, idle_heartbeat=hb,
            mem_storage=True, inactive_threshold=max(10.0, 10 * hb), num_replicas=1)
        ci = None
        try:
            ci = await js.add_consumer(self.stream, cfg)
            self.counters["consumers"] += 1
            self._recreate = False
            seen = time.monotonic()
            while not self._stop.is_set() and not self._recreate:
                try:
                    msg = await sub.next_msg(timeout=hb)
                except nats.errors.TimeoutError:
                    if time.monotonic() - seen > 3 * hb:
                        log.warning("%s: no heartbeat for %.1fs: recreating the consumer", self.name, 3 * hb)
                        return
                    continue
                seen = time.monotonic()
                if not msg.reply or not msg.reply.startswith("$JS.ACK."):
                    if await self._control(nc, msg):
                        return
                    continue
                sseq, pending = ack_fields(msg.reply)
                if sseq <= self.seq:
                    continue
                if sseq != self.seq + 1:
                    info = await js.stream_info(self.stream)
                    if info.state.first_seq > self.seq + 1:
                        raise _Behind(info.state.first_seq)
                    log.warning("%s: delivery jumped from %d to %d: recreating the consumer", self.name,
                                self.seq, sseq)
                    return
                self.counters["messages"] += 1
                self._apply_msg(msg)
                self.seq = sseq
                self.stream_last = sseq + pending
                self._maybe_snapshot()
        finally:
            try:
                await sub.unsubscribe()
                if ci is not None and nc.is_connected:
                    await asyncio.wait_for(js.delete_consumer(self.stream, ci.name), 1.0)
            except (nats.errors.Error, asyncio.TimeoutError, nats.js.errors.Error):
                pass  # an ephemeral consumer goes by itself (inactive_threshold)

    async def _control(self, nc: Client, msg: Msg) -> bool:
        """A status message of the push consumer: answer flow control, check heartbeats.
        True when the consumer must be recreated (it delivered past what we have)."""
        h = msg.headers or {}
        if h.get("Status") != "100":
            return False
        if msg.reply:  # flow control request
            await nc.publish(msg.reply, b"")
            return False
        stalled = h.get("Nats-Consumer-Stalled")
        if stalled:
            await nc.publish(stalled, b"")
        last = h.get("Nats-Last-Stream")
        return last is not None and last.isdigit() and int(last) > self.seq

    async def _catch_up(self, js: JetStreamContext, first: int) -> None:
        """The stream starts at ``first`` > seq + 1: what this replica needs is purged.
        Reload the stored snapshot (newer, we hope: whoever purged wrote one); if it
        does not reach ``first - 1`` after a few tries, accept the loss (the workers'
        next batches show their gaps: stale, R-DUR-11)."""
        for _ in range(5):
            self.counters["reloads"] += 1
            if await self._load_snapshot(only_newer=True) and self.seq + 1 >= first:
                return
            info = await js.stream_info(self.stream)
            first = info.state.first_seq
            if self.seq + 1 >= first:
                return
            await self._sleep(0.2)
        log.warning("%s: stream seqs %d..%d are gone and no snapshot covers them", self.name, self.seq + 1, first - 1)
        self.counters["stream_lost"] += first - 1 - self.seq
        self.seq = first - 1
