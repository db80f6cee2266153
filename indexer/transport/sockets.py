"""The transport: one thread that owns every ZMQ socket of the fleet.

Per worker, a SUB on the live endpoint (frames ``[topic, seq (8 bytes big-endian),
payload]``), its socket monitor (connects and disconnects: a reconnect is evidence
the sequencer needs, R-STR-7), and a DEALER on the replay endpoint (request
``[b"", start as 8 bytes big-endian]``; replies ``[b"", topic, seq, payload]`` from
vLLM 0.26 on, ``[b"", seq, payload]`` before; the end is an empty payload or seq
-1). An inproc PAIR wakes the thread for commands.

Two pollers. ``zmq_poll`` asks every socket it is given for its state on every call
(pyzmq builds the item array with the GIL held), and under paced ingest most
wake-ups bring one message: with all three sockets of every worker in one poll, a
poll cost 18 us at 8 workers and 454 us at 256 (``poll(0)`` over idle sockets, 2-vCPU
VM), against 7 and 161 us for the hot set alone. So the hot poller holds
the wake-up PAIR, the live SUBs and the DEALERs of workers that are replaying; the
monitors and idle DEALERs are swept every ``SWEEP_S`` and whenever the hot poll
times out. A live socket's monitor is read right before its messages, so a
reconnect is always seen before what came over the new connection (R-STR-7).

What the frames mean is not decided here: each is handed to the worker's
subscription object (a :class:`~.sequencer.Stream`, by duck typing: ``live``,
``apply``, ``replayed``, ``replay_end``, ``reconnected``, ``check_timeout``), so this
module imports nothing to its right.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import zmq

from indexer.wire.engines import END_SEQ

__all__ = ["ZmqTransport"]


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere).

    Why: what a burst allocates on its way to the tree (the frames ZMQ's I/O thread
    reads, the bytes handed to the decoder, a replay's answers) is freed once applied,
    and glibc keeps those pages in its arenas. With the live queues unbounded that kept
    RSS near twice the index itself (1.5M entries: 185 B per entry against 85 B after a
    trim; benchmarks/bench_services.py); with them bounded (``rcvhwm``) the trim still
    returns a replay's and a burst's leftovers. ctypes releases the GIL during the call."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


# Messages received since the last trim before an idle moment trims again: a
# trim walks the arenas (~1-10 ms), so never after every small burst.
TRIM_AFTER = 256
# The longest time between trims while messages keep arriving.
TRIM_EVERY_S = 30.0
# How often the monitors and idle DEALERs are swept while live sockets keep the hot
# poll busy: how late a silent worker's disconnect shows in its link state, at most.
SWEEP_S = 0.1

log = logging.getLogger("indexer.ingest.live")


class Sub(Protocol):
    """What the transport needs of a worker's subscription (``ingest.Sub``)."""

    engine: str
    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sock: Any
    mon: Any
    dealer: Any
    connected: bool
    messages: int
    connects: int
    last: int | None
    replaying: bool
    unproven: bool

    def apply(self, seq: int, payload: bytes) -> None: ...
    def live(self, seq: int, payload: bytes) -> None: ...
    def replayed(self, seq: int, payload: bytes) -> None: ...
    def replay_end(self) -> None: ...
    def reconnected(self) -> None: ...
    def check_timeout(self, now: float) -> None: ...


class ZmqTransport:
    """The socket half of :class:`indexer.Indexer` (a mixin: it shares the facade's
    context, subscriptions and command queue)."""

    index: Any
    _ctx: zmq.Context[Any]
    _subs: Mapping[tuple[str, int], Sub]
    _cmds: queue.Queue[tuple[str, Any, threading.Event, list[Any]]]  # (op, arg, done, box)
    _running: threading.Event
    _replaying: set[Sub]
    # (engine, rank) -> (connected now, ever connected): what routing reads per
    # request, kept up to date here so a route never walks the subscriptions.
    link: dict[tuple[str, int], tuple[bool, bool]]
    rcvhwm: int
    reconnect_ivl_ms: int
    reconnect_ivl_max_ms: int
    error: str | None
    received: int = 0  # live messages received, all workers (what the trim schedule counts)

    def _do(self, op: str, arg: Any) -> Any:  # the facade's command handler
        raise NotImplementedError

    # -------------------------------------------------------------- sockets

    def _open(self, sub: Sub) -> None:
        try:
            s = self._ctx.socket(zmq.SUB)
        except zmq.ZMQError as e:  # out of sockets or file descriptors: say so, keep going
            self.index.mark_stale(sub.engine, sub.rank, f"cannot open a socket for {sub.endpoint}: {e}")
            return
        try:
            self._subscribe(sub, s)
        except zmq.ZMQError as e:
            s.close(0)
            self.index.mark_stale(sub.engine, sub.rank, f"cannot open a socket for {sub.endpoint}: {e}")

    def _subscribe(self, sub: Sub, s: zmq.Socket[bytes]) -> None:
        s.setsockopt(zmq.RCVHWM, self.rcvhwm)
        s.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, sub.topic)
        sub.mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            s.connect(sub.endpoint)
        except zmq.ZMQError as e:  # e.g. a host name that does not resolve
            s.disable_monitor()
            sub.mon.close(0)
            s.close(0)
            sub.mon = None
            self.index.mark_stale(sub.engine, sub.rank, f"cannot connect to {sub.endpoint}: {e}")
            return
        sub.sock = s
        self._poller.register(s, zmq.POLLIN)
        self._cold.register(sub.mon, zmq.POLLIN)
        self._owner[s] = (sub, "live")
        self._owner[sub.mon] = (sub, "mon")
        if sub.replay_endpoint:
            self._open_dealer(sub)

    def _open_dealer(self, sub: Sub) -> None:
        try:
            d = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError:
            return  # as a failed connect below: gaps of this worker then make it stale
        d.setsockopt(zmq.LINGER, 0)
        # Unbounded, unlike the SUB: vLLM's ROUTER keeps ZMQ's default send high-water mark
        # (1,000) and drops past it, so a replay must drain as fast as it comes or it fails
        # (stale). What it can bring is bounded by the engine's replay buffer (buffer_steps).
        d.setsockopt(zmq.RCVHWM, 0)
        d.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        d.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        try:
            d.connect(sub.replay_endpoint)
        except zmq.ZMQError:
            d.close(0)
            return  # gaps of this worker are then unrecoverable (stale, with the reason)
        sub.dealer = d
        self._cold.register(d, zmq.POLLIN)  # late or stray answers are still read (and dropped)
        self._owner[d] = (sub, "replay")
        if sub in self._replaying:
            self._poller.register(d, zmq.POLLIN)

    def _close_dealer(self, sub: Sub) -> None:
        d = sub.dealer
        if d is not None:
            self._cold.unregister(d)
            if sub in self._replaying:
                self._poller.unregister(d)
            self._owner.pop(d, None)
            d.close(0)
            sub.dealer = None

    def _reopen_dealer(self, sub: Sub) -> None:
        """A new DEALER for ``sub``: it connects at once (no reconnect backoff to wait
        out), and no late answer to the old one can reach it."""
        if sub.dealer is not None:
            self._close_dealer(sub)
            self._open_dealer(sub)

    # A DEALER is in the hot poll exactly while its worker is in _replaying: these two
    # and _open_dealer / _close_dealer are the only places that change either.

    def _replay_on(self, sub: Sub) -> None:
        """``sub`` replays: its DEALER's answers are read on every wake-up until it ends."""
        if sub not in self._replaying:
            self._replaying.add(sub)
            if sub.dealer is not None:
                self._poller.register(sub.dealer, zmq.POLLIN)

    def _replay_off(self, sub: Sub) -> None:
        """``sub`` no longer replays: its DEALER goes back to the sweep."""
        if sub in self._replaying:
            self._replaying.discard(sub)
            if sub.dealer is not None:
                self._poller.unregister(sub.dealer)

    def _close(self, sub: Sub) -> None:
        if sub.sock is None:
            return
        self._poller.unregister(sub.sock)
        self._cold.unregister(sub.mon)
        for s in (sub.sock, sub.mon):
            self._owner.pop(s, None)
        sub.sock.disable_monitor()
        sub.mon.close(0)
        sub.sock.close(0)
        sub.sock = sub.mon = None
        self._close_dealer(sub)

    # ------------------------------------------------------------ the loop

    def _run(self, wake_rx: zmq.Socket[bytes]) -> None:
        self._poller = zmq.Poller()  # hot: wake_rx, live SUBs, DEALERs of replaying workers
        self._cold = zmq.Poller()  # monitors and DEALERs, swept (see the module's docstring)
        self._owner: dict[zmq.Socket[bytes], tuple[Sub, str]] = {}  # socket -> (sub, "live" | "mon" | "replay")
        self._poller.register(wake_rx, zmq.POLLIN)
        for sub in self._subs.values():
            self._open(sub)
        trim = _malloc_trim()
        trimmed_at, last_trim = 0, time.monotonic()
        next_sweep = 0.0
        try:
            while self._running.is_set():
                events = self._poller.poll(20 if self._replaying else 100)
                if trim is not None:
                    # After a burst, once idle (a poll that timed out), or now and then under load.
                    received = self.received
                    if received - trimmed_at >= TRIM_AFTER and (
                            not events or time.monotonic() - last_trim >= TRIM_EVERY_S):
                        trim(0)
                        trimmed_at, last_trim = received, time.monotonic()
                self._dispatch(events, wake_rx)
                now = time.monotonic()
                if not events or now >= next_sweep:
                    self._dispatch(self._cold.poll(0), wake_rx)
                    next_sweep = now + SWEEP_S
                self._check_timeouts()
        except Exception as e:  # a bug must not leave the thread dead silently
            self.error = f"ingest thread crashed: {e!r}"
            log.exception("ingest thread crashed")
            raise
        finally:
            for sub in self._subs.values():
                self._close(sub)
                sub.connected = False
                self.link[(sub.engine, sub.rank)] = (False, sub.connects > 0)
            wake_rx.close(0)

    def _dispatch(self, events: list[tuple[Any, int]], wake_rx: zmq.Socket[bytes]) -> None:
        """Read every socket that ``events`` says is readable (a socket closed meanwhile
        by an earlier one's command has no owner any more and is skipped)."""
        for sock, _ in events:
            if sock is wake_rx:
                self._drain_commands(wake_rx)
                continue
            owner = self._owner.get(sock)
            if owner is None:
                continue
            sub, kind = owner
            try:
                if kind == "live":
                    mon = sub.mon
                    if mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        # A (re)connect first: the monitor's event was queued before the
                        # first message over that connection (R-STR-7).
                        self._drain_monitor(sub, mon)
                    self._drain_live(sub, sock)
                elif kind == "replay":
                    self._drain_replay(sub, sock)
                else:
                    self._drain_monitor(sub, sock)
            except zmq.ZMQError:
                raise
            except Exception as e:
                # A message that trips a bug costs that message, counted
                # and logged, never the whole fleet's ingest.
                self._dropped(sub, "internal_error")
                log.exception("worker %s/%d: message dropped on an internal error: %r",
                              sub.engine, sub.rank, e)

    def _drain_commands(self, wake_rx: zmq.Socket[bytes]) -> None:
        while True:
            try:
                wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                op, arg, done, box = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                box.append(self._do(op, arg))
            except BaseException as e:  # handed back to the caller's thread
                box.append(e)
            done.set()

    def _drain_live(self, sub: Sub, sock: zmq.Socket[bytes], budget: int = 64) -> None:
        # A bounded number per wake-up so one busy engine cannot starve the others.
        recv = sock.recv
        for _ in range(budget):
            # Frames with .more instead of recv_multipart's RCVMORE getsockopt per
            # frame: ~1.7 us less per message on the hottest loop of ingest.
            try:
                f = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [f.bytes]
            while f.more:
                f = recv(0, copy=False)
                frames.append(f.bytes)
            sub.messages += 1
            self.received += 1
            if len(frames) != 3:
                self._dropped(sub, "bad_frame_count")
                continue
            seqb = frames[1]
            if len(seqb) != 8:
                self._dropped(sub, "bad_seq_frame")
                continue
            seq = int.from_bytes(seqb, "big")
            last = sub.last
            if last is not None and seq == last + 1 and not sub.replaying and not sub.unproven:
                sub.apply(seq, frames[2])  # in order: the common case
            else:
                sub.live(seq, frames[2])

    def _drain_monitor(self, sub: Sub, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = int.from_bytes(msg[0][:2], "little")
            sub.connected = event == zmq.EVENT_CONNECTED
            if sub.connected:
                sub.connects += 1
                if sub.connects > 1 and not sub.replaying:
                    # The proof below goes over the DEALER, whose own reconnect may be
                    # up to RECONNECT_IVL_MAX away from the SUB's: a new one connects now.
                    self._reopen_dealer(sub)
                sub.reconnected()  # R-STR-7: prove continuity now (a replay from the anchor)
            self.link[(sub.engine, sub.rank)] = (sub.connected, sub.connects > 0)

    def _drain_replay(self, sub: Sub, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not sub.replaying:
                continue  # a late answer to a replay we gave up on
            if frames and frames[0] == b"":
                frames = frames[1:]
            # >= 0.26: (topic, seq, payload); before: (seq, payload).
            if len(frames) == 3:
                seqb, payload = frames[1], frames[2]
            elif len(frames) == 2:
                seqb, payload = frames
            else:
                self._dropped(sub, "bad_replay_frame")
                continue
            if not payload or seqb == END_SEQ:
                sub.replay_end()
                if not sub.replaying:
                    self._replay_off(sub)
            elif len(seqb) != 8:
                self._dropped(sub, "bad_replay_frame")
            else:
                sub.replayed(int.from_bytes(seqb, "big"), payload)
            if sub.dealer is not sock:
                return  # the sequencer gave this replay up: its socket is closed

    def _check_timeouts(self) -> None:
        if not self._replaying:
            return
        now = time.monotonic()
        for sub in list(self._replaying):
            if not sub.replaying:
                self._replay_off(sub)
                continue
            sub.check_timeout(now)
            if not sub.replaying:
                self._replay_off(sub)

    # ---------------------------------------------------------------- status

    def _dropped(self, sub: Sub, reason: str) -> None:
        self.index.count_dropped(sub.engine, sub.rank, reason)


