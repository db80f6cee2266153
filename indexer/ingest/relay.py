"""The relay: vLLM engines (ZMQ) in, the JetStream event log out (``kv-indexer relay``).

:class:`Relay` is an :class:`~.ingest.Indexer` whose sink publishes instead of applying:
the transport and the sequencer are the same (gap repair by replay, restarts and
continuity proven, R-STR-1..7), and every batch the sequencer decides to apply becomes
one message of the stream (:func:`~.eventlog.headers`). Its own index only keeps the
workers' status (stale marks, counters), no residency.

Order. Each worker has a lane: a bounded queue drained by one asyncio task that awaits
each publish's ack before the next, retrying the same message (same ``Nats-Msg-Id``)
through a NATS outage until it is acked. So a worker's batches enter the stream in
sequence order, each once, and two relays can run side by side: JetStream keeps the
first copy of each batch (R-DUR-13). Past ``max_pending`` queued batches a worker's
new batches are dropped (counted); the next one published shows replicas the gap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from indexer.ingest.eventlog import DEFAULT_STREAM, DEFAULT_SUBJECT, DUPLICATE_WINDOW_S, connect, ensure_stream, headers
from indexer.ingest.live import Indexer, IndexSink, WorkerStream
from indexer.sequence.sequencer import peek_ts
from indexer.wire.engines import EngineConfig

__all__ = ["Relay", "RELAY_COUNTERS"]

log = logging.getLogger("indexer.ingest.relay")

# published: batches handed to a lane; acked: acks (duplicates among them: the stream had
# the batch already, from another relay or an earlier try); retries: publishes tried again;
# dropped: batches a full lane refused; stale/fresh/restarts: the sequencer's worker events.
RELAY_COUNTERS = ("published", "acked", "duplicates", "retries", "dropped", "stale", "fresh", "restarts")


class _Lane:
    """One worker's queue to the stream and the state of its drain task."""

    __slots__ = ("key", "q", "idle", "wake", "task", "dropped")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.q: deque[tuple[dict[str, str], bytes]] = deque()
        self.idle = True  # the drain task waits (or is about to) for ``wake``
        self.wake: asyncio.Event | None = None  # made on the loop's thread
        self.task: asyncio.Task[None] | None = None
        self.dropped = 0


class _RelaySink(IndexSink):
    """The sequencer's sink of a relay: applied batches go to the stream."""

    __slots__ = ()

    def apply_batch(self, sub: WorkerStream, seq: int, payload: bytes) -> float | None:
        relay = self.ingest
        assert isinstance(relay, Relay)
        relay._enqueue(sub, seq, payload)
        return peek_ts(payload)

    def reset_worker(self, sub: WorkerStream) -> None:
        relay = self.ingest
        assert isinstance(relay, Relay)
        if sub.anchor_ts is not None:  # which incarnation the next batch replaces
            relay._restart_next[(sub.engine, sub.rank)] = sub.anchor_ts
        relay.counters["restarts"] += 1
        log.info("worker %s/%d: engine restart; the next batch carries the reset", sub.engine, sub.rank)
        super().reset_worker(sub)

    def mark_stale(self, sub: WorkerStream, reason: str) -> None:
        relay = self.ingest
        assert isinstance(relay, Relay)
        relay._stale[(sub.engine, sub.rank)] = reason
        relay.counters["stale"] += 1
        super().mark_stale(sub, reason)  # logs it

    def mark_fresh(self, sub: WorkerStream) -> None:
        relay = self.ingest
        assert isinstance(relay, Relay)
        if relay._stale.pop((sub.engine, sub.rank), None) is not None:
            relay.counters["fresh"] += 1
            log.info("worker %s/%d fresh again", sub.engine, sub.rank)
        super().mark_fresh(sub)


class Relay(Indexer):
    """Subscribe to the engines and publish their sequenced batches to JetStream.

    Parameters
    ----------
    engines:
        As :class:`~.ingest.Indexer` (the same configs, discovery drives
        ``add_engine``/``remove_engine`` the same way).
    url, stream, subject:
        The NATS server, the stream (created when missing: file storage, a duplicate
        window of ``duplicate_window_s``) and the subject batches are published on.
    max_pending:
        Batches queued per worker while NATS does not ack; beyond, dropped and counted.
    publish_timeout_s:
        How long one publish waits for its ack before it is tried again.
    indexer_options:
        The rest of :class:`~.ingest.Indexer`'s parameters (replay timeout, endpoint
        policy, ...).
    """

    _sink_class = _RelaySink

    def __init__(self, engines: Iterable[EngineConfig | dict[str, Any]] = (), *, url: str,
                 stream: str = DEFAULT_STREAM, subject: str = DEFAULT_SUBJECT,
                 duplicate_window_s: float = DUPLICATE_WINDOW_S, max_pending: int = 100_000,
                 publish_timeout_s: float = 2.0, name: str = "kv-indexer-relay", **indexer_options: Any) -> None:
        self.url = url
        self.stream = stream
        self.subject = subject
        self.duplicate_window_s = float(duplicate_window_s)
        self.max_pending = int(max_pending)
        self.publish_timeout_s = float(publish_timeout_s)
        self.name = name
        self.nats_connected = False
        self._lanes: dict[tuple[str, int], _Lane] = {}
        # Workers whose next batch carries Kvi-Restart: the ts of the last batch before the reset.
        self._restart_next: dict[tuple[str, int], float] = {}
        self._stale: dict[tuple[str, int], str] = {}  # the sequencer's stale workers, with the reason
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closing = False
        self._js: JetStreamContext | None = None
        self._nc: Client | None = None
        self._up: asyncio.Event | None = None
        self._done = asyncio.Event()  # made again on the loop's thread
        super().__init__(engines, **indexer_options)
        # After Indexer's (which has none of its own): no batch reaches the sink before start().
        self.counters = dict.fromkeys(RELAY_COUNTERS, 0)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start publishing (the NATS connection is made in the background, batches
        queue meanwhile), then the ZMQ ingest."""
        if self._loop_thread is None:
            self._closing = False
            self._ready.clear()
            self._loop_thread = threading.Thread(target=self._run_loop, name="kvidx-relay-nats", daemon=True)
            self._loop_thread.start()
            self._ready.wait(5)
        super().start()

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Stop the ingest, publish what is queued (for up to ``flush_timeout_s``), close."""
        super().stop()
        t, loop = self._loop_thread, self._loop
        if t is None or loop is None:
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(flush_timeout_s), loop)
            fut.result(flush_timeout_s + 5)
        except Exception as e:  # a loop already gone: nothing left to flush
            log.debug("relay shutdown: %r", e)
        t.join(5)
        self._loop_thread = None
        self._loop = None
        self._lanes = {}  # their tasks and events belonged to that loop (what was left is logged)

    @property
    def pending(self) -> int:
        """Batches queued, not acked yet (all workers)."""
        return sum(len(lane.q) for lane in list(self._lanes.values()))

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as e:
            self.error = f"relay publisher crashed: {e!r}"
            log.exception("relay publisher crashed")
        finally:
            self._ready.set()
            self.nats_connected = False
            loop.close()

    async def _main(self) -> None:
        self._up = asyncio.Event()
        self._done = asyncio.Event()
        self._ready.set()
        nc = await connect(self.url, self.name, lambda: self._closing, on_state=self._set_connected)
        if nc is not None:
            self._nc = nc
            js = nc.jetstream()
            while not self._closing:
                try:
                    await ensure_stream(js, self.stream, self.subject, self.duplicate_window_s)
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as e:
                    log.warning("%s: stream %s not ready: %r", self.name, self.stream, e)
                    await asyncio.sleep(0.5)
            self._js = js
            self._up.set()
        await self._done.wait()
        if nc is not None:
            await nc.close()

    def _set_connected(self, up: bool) -> None:
        self.nats_connected = up

    async def _shutdown(self, flush_timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + flush_timeout_s
        while self.pending and loop.time() < deadline and self._js is not None:
            await asyncio.sleep(0.01)
        if self.pending:
            log.warning("%s: %d batch(es) not published at shutdown", self.name, self.pending)
        self._closing = True
        for lane in list(self._lanes.values()):
            if lane.task is not None:
                lane.task.cancel()
        self._done.set()

    # ------------------------------------------------------------- the lanes

    def _enqueue(self, sub: WorkerStream, seq: int, payload: bytes) -> None:
        """On the ingest thread: queue one applied batch on its worker's lane."""
        key = (sub.engine, sub.rank)
        restart = self._restart_next.get(key)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._open_lane, lane)
        if len(lane.q) >= self.max_pending:
            # The batch is lost to the stream (unless another relay has it); the next one
            # published shows replicas the gap. A reset it carried goes with the next one.
            self.counters["dropped"] += 1
            lane.dropped += 1
            if lane.dropped == 1 or lane.dropped % 10_000 == 0:
                log.error("worker %s/%d: %d batch(es) dropped, NATS does not ack (%d queued)", sub.engine,
                          sub.rank, lane.dropped, len(lane.q))
            return
        self._restart_next.pop(key, None)
        lane.q.append((headers(sub.engine, sub.rank, sub.model, seq, payload, restart_after=restart,
                               stale=self._stale.get(key)), payload))
        self.counters["published"] += 1
        if lane.idle and lane.wake is not None:
            lane.idle = False
            self._loop.call_soon_threadsafe(lane.wake.set)  # type: ignore[union-attr]  # set with the lane

    def _open_lane(self, lane: _Lane) -> None:
        lane.wake = asyncio.Event()
        lane.idle = False
        lane.task = asyncio.get_running_loop().create_task(self._drain(lane))

    async def _drain(self, lane: _Lane) -> None:
        assert lane.wake is not None and self._up is not None
        await self._up.wait()
        while True:
            while lane.q:
                hdrs, payload = lane.q[0]
                await self._publish(hdrs, payload)
                lane.q.popleft()
            lane.wake.clear()
            lane.idle = True
            if lane.q:  # appended after the last look: the producer saw us busy
                lane.idle = False
                continue
            await lane.wake.wait()

    async def _publish(self, hdrs: dict[str, str], payload: bytes) -> None:
        """Publish one batch and wait for its ack; the same message again until acked."""
        delay = 0.05
        while True:
            js = self._js
            assert js is not None
            try:
                ack = await js.publish(self.subject, payload, timeout=self.publish_timeout_s, headers=dict(hdrs))
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
                self.counters["retries"] += 1
                n = self.counters["retries"]
                if n == 1 or n % 100 == 0:
                    log.warning("%s: publish not acked (%r): retrying (%d retries so far)", self.name, e, n)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            self.counters["acked"] += 1
            if ack.duplicate:
                self.counters["duplicates"] += 1
            return

    # ---------------------------------------------------------------- status

    def workers(self) -> list[dict[str, Any]]:
        """:meth:`Indexer.workers`, with each worker's lane (queued, dropped)."""
        out = super().workers()
        for w in out:
            lane = self._lanes.get((w["engine"], w["dp_rank"]))
            w["queued"] = len(lane.q) if lane is not None else 0
            w["lane_dropped"] = lane.dropped if lane is not None else 0
        return out
