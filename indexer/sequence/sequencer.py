"""The sequencer: the one place that decides what a batch's sequence number means.

vLLM numbers each worker's batches from 0 (per process: a restarted engine starts at 0
again, with empty caches) and sends no publisher id (through 0.33). ZMQ PUB drops what
it sends while a subscriber is disconnected, so a restart can hide behind a reconnect
and resume at any sequence number, even exactly ``last + 1``. The evidence that is
there: each batch's ``ts`` (vLLM's ``time.time()`` at the step, element 0 of the
payload), the subscriber's reconnects, and the replay buffer.

Two entry points, one rule:

* :func:`classify` is the restart rule (R-STR-1, R-STR-2, R-STR-5) on one batch given
  the last applied ``(seq, ts)``. :meth:`indexer.PrefixIndex.apply` with ``seq`` uses it
  as it is (a library caller has no replay socket).
* :class:`Stream` is one worker's live sequencing for the service and :class:`Indexer`:
  the same rule, plus replay (R-STR-2, R-STR-3) and continuity proofs (R-STR-7). It
  never trusts continuity it has not seen: after a reconnect, and after any gap, it
  asks the replay endpoint from the last *applied* sequence number (the anchor) and
  compares that batch's ``ts`` with the one it applied. Same ts: one incarnation, so
  it applies what follows. Another ts: the engine restarted, so it drops the worker's
  residency and rebuilds from a replay from 0. No proof possible (no replay endpoint,
  a replay that fails, times out or starts past the anchor): the worker is stale with
  the reason (R-STR-4), never silently kept.

A :class:`Stream` does no I/O: it calls its :class:`Sink` (the transport plus the
index) to apply, reset, replay, mark stale or fresh, and count. That keeps every
decision here, testable without sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from msgspec import Raw, Struct

__all__ = [
    "NEXT", "GAP", "DUPLICATE", "RESTART", "classify", "peek_ts", "Sink", "Stream",
]

# Verdicts of classify().
NEXT = 0  # apply: the batch after the last one (or the very first, seq 0)
GAP = 1  # apply after repairing (or accepting) the batches missing before it
DUPLICATE = 2  # skip: already applied (replay overlap)
RESTART = 3  # drop the worker's residency, then handle the batch as a first one


def classify(last_seq: int | None, last_ts: float | None, seq: int, ts: float | None) -> int:
    """The restart rule (R-STR-5) and the order rules (R-STR-1/2) for one batch.

    A batch whose seq is not newer than the last applied one is a restart only when
    its ``ts`` is newer than the last applied batch's; otherwise it is a duplicate.
    """
    if last_seq is None:
        return NEXT if seq == 0 else GAP
    if seq == last_seq + 1:
        return NEXT
    if seq > last_seq:
        return GAP
    if ts is not None and last_ts is not None and ts > last_ts:
        return RESTART
    return DUPLICATE


class _TsOnly(Struct, array_like=True, gc=False):
    # A batch is [ts, events, data_parallel_rank]; the events are skipped, not decoded.
    ts: float
    events: Raw
    data_parallel_rank: Any = None


_ts_only = msgspec.msgpack.Decoder(_TsOnly)


def peek_ts(payload: bytes) -> float | None:
    """The batch timestamp alone (events are skipped, not decoded); None if unreadable."""
    try:
        return _ts_only.decode(payload).ts
    except (msgspec.DecodeError, RecursionError):
        return None


class Sink(Protocol):
    """What a :class:`Stream` asks of the transport and the index (one worker each)."""

    def apply_batch(self, stream: Stream, seq: int, payload: bytes) -> float | None:
        """Decode and apply one batch; return its ts, or None when it did not decode."""

    def reset_worker(self, stream: Stream) -> None:
        """Drop the worker's residency in every tier (R-STR-5)."""

    def request_replay(self, stream: Stream, start: int) -> str | None:
        """Ask the replay endpoint for every batch from ``start``; the reason it cannot, or None."""

    def cancel_replay(self, stream: Stream) -> None:
        """Forget a replay in flight: its late answers must never reach the next one."""

    def mark_stale(self, stream: Stream, reason: str) -> None:
        """Mark the worker stale with ``reason`` (its index is kept)."""

    def mark_fresh(self, stream: Stream) -> None:
        """Clear the worker's stale mark (it holds the engine's whole history again)."""

    def count(self, stream: Stream, name: str) -> None:
        """Add one to the counter ``name``."""


class Stream:
    """One worker's sequencing state. Every method is called on the ingest thread.

    ``last`` is the last sequence number accounted for (applied, or lost and
    accepted as such); ``anchor_seq``/``anchor_ts`` are the last batch actually
    applied with a readable ts: what a continuity proof compares against.
    """

    __slots__ = (
        "sink", "max_buffered", "replay_timeout_s", "clock", "last", "anchor_seq", "anchor_ts",
        "full_history", "unproven", "replaying", "proving", "replay_start", "replay_next",
        "replay_target", "replay_deadline", "replay_failed", "pending", "epoch", "restarts", "gaps",
        "replays_ok", "replays_failed", "reconnects", "replayed_lo", "replayed_hi", "resumed",
    )

    def __init__(self, sink: Sink, *, max_buffered: int = 100_000, replay_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink
        self.max_buffered = max_buffered
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.last: int | None = None
        self.anchor_seq: int | None = None
        self.anchor_ts: float | None = None
        self.full_history = False  # the index holds this worker's stream from seq 0
        self.unproven = False  # reconnected since the anchor: the next batch needs a proof
        self.replaying = False
        self.proving = False  # the replay in flight must first show the anchor
        self.replay_start = 0
        self.replay_next = 0
        self.replay_target: int | None = None  # the live seq that started the replay
        self.replay_deadline = 0.0
        self.replay_failed: str | None = None
        # Live batches buffered during a replay: (seq, payload, epoch), epoch being the
        # connection they came over (PUB keeps order per connection, not across them).
        self.pending: list[tuple[int, bytes, int]] = []
        self.epoch = 0  # connections of the live socket seen so far
        self.restarts = 0
        self.gaps = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.reconnects = 0
        # The seqs the latest replay applied: live copies of them are the only
        # duplicates PUB can deliver (it never repeats a message on a connection).
        self.replayed_lo = self.replayed_hi = -1
        self.resumed = False  # restored from a snapshot, not connected since

    def resume(self, last_seq: int, last_ts: float | None, full_history: bool) -> None:
        """Start from a snapshot: the index holds this worker's batches up to ``last_seq``
        (the last one's ts ``last_ts``). The first connect proves continuity from there
        at once (R-DUR-2: a replay from ``last_seq``, which then brings what was missed),
        rather than waiting for the engine's next batch: an idle engine that restarted
        while we were down must not keep its old cache in the index."""
        self.last = self.anchor_seq = last_seq
        self.anchor_ts = last_ts
        self.full_history = full_history
        self.unproven = True
        self.resumed = True

    # ------------------------------------------------------------------ live

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply a batch the rules allow. The transport's fast path calls this directly
        when ``seq == last + 1`` and neither a replay nor a proof is pending."""
        ts = self.sink.apply_batch(self, seq, payload)
        self.last = seq
        if ts is not None:
            self.anchor_seq = seq
            self.anchor_ts = ts

    def live(self, seq: int, payload: bytes, epoch: int | None = None) -> None:
        """Sequence one batch from the live socket (R-STR-1..5, R-STR-7); ``epoch`` is the
        connection it came over (the current one unless it waited in ``pending``)."""
        if epoch is None:
            epoch = self.epoch
        if self.replaying:
            if self.last is not None and seq <= self.last and self._is_restart(seq, payload):
                # PUB keeps per-connection order: what was buffered came before this
                # new incarnation's batch, so it is the old incarnation's. Drop it.
                self._cancel()
                self.pending = []
                self._restart()
                self.live(seq, payload, epoch)
                return
            if len(self.pending) >= self.max_buffered:
                self._fail(f"more than {self.max_buffered} live batches arrived during replay")
                self._cancel()
                self._finish()
                self.live(seq, payload, epoch)
                return
            self.pending.append((seq, payload, epoch))
            return
        last = self.last
        if last is None:
            if seq == 0:
                self._first(seq, payload)
            else:
                self._gap(0, seq, payload, epoch)  # R-STR-3: late join = a gap from 0
            return
        if seq > last:
            if self.unproven:
                self._prove(seq, payload, epoch)  # R-STR-7: the first new batch after a reconnect
            elif seq == last + 1:
                self.apply(seq, payload)
            else:
                self._gap(last + 1, seq, payload, epoch)  # R-STR-2
            return
        if self._is_restart(seq, payload):
            self._restart()  # R-STR-5
            self.live(seq, payload, epoch)
            return
        if not self.unproven and self.replayed_lo <= seq <= self.replayed_hi:
            self.sink.count(self, "batches_duplicate")  # R-STR-1: a live copy of a replayed batch
            return
        # PUB never repeats a batch, so this one, not newer, not a copy of a replayed
        # one (or arriving after a reconnect), may be another incarnation's, from an
        # engine whose clock is behind. Prove it before anything else is applied.
        self._prove(seq, payload, epoch)

    def reconnected(self) -> None:
        """The live socket (re)connected: prove at once, by a replay from the anchor,
        that the engine is the incarnation the index holds (R-STR-7), rather than at its
        next batch. A restarted vLLM engine publishes nothing until its first step, so
        an idle one would otherwise keep its old incarnation's cache in the index for as
        long as no request reaches it, and the router would send requests there on it.
        During a replay the proof waits for its end (its answer may be the previous
        incarnation's; :meth:`_finish` starts the proof). With nothing applied since the
        last reset there is nothing to protect, and no proof. A stream resumed from a
        snapshot proves on its first connect (:meth:`resume`)."""
        if self.resumed and not self.replaying:
            self.resumed = False
        elif self.last is not None or self.replaying:
            self.reconnects += 1
            self.sink.count(self, "reconnects")
        self.unproven = True
        self.epoch += 1
        if not self.replaying and self.anchor_seq is not None:
            self._replay(self.anchor_seq, None)

    def resync(self) -> None:
        """Drop everything and replay from seq 0 (recovers a stale worker whose engine
        still buffers its whole history)."""
        self._cancel()
        self.pending = []
        self.sink.reset_worker(self)
        self._forget()
        self._replay(0, None)

    # ---------------------------------------------------------------- replay

    def replayed(self, seq: int, payload: bytes) -> None:
        """One batch of the replay in flight (frames already parsed by the transport)."""
        if not self.replaying or seq < self.replay_next:
            return
        if self.proving:
            self.proving = False
            if seq == self.anchor_seq:
                if peek_ts(payload) == self.anchor_ts:
                    self.sink.count(self, "continuity_proven")
                    self.replay_next = seq + 1
                    return
                # The same seq with another ts: the engine restarted behind the gap.
                self.sink.count(self, "continuity_restart")
                self._rebuild()
                return
            self._unproven(f"replay from {self.replay_start} started at {seq} (engine buffer overrun)")
        elif seq > self.replay_next:
            # R-STR-4: the engine no longer holds what we asked for.
            self._fail(f"replay from {self.replay_next} started at {seq}: engine buffer overrun")
        self.replay_next = seq + 1
        last = self.last
        if last is not None and seq <= last:
            return  # between the anchor and the last seq: already accounted for
        if self.replay_start == 0 and seq == 0 and self.replay_failed is None:
            self.full_history = True
        if self.replayed_lo < 0:
            self.replayed_lo = seq
        self.replayed_hi = seq
        self.apply(seq, payload)

    def replay_end(self) -> None:
        """The replay's end marker arrived."""
        if not self.replaying:
            return
        if self.proving:
            # The engine holds nothing from the anchor on, yet an engine always holds its
            # latest batch (seq >= anchor): it has published fewer batches since it
            # (re)started than we applied. A restart, proven.
            self.sink.count(self, "continuity_restart")
            self._rebuild()
            return
        target = self.replay_target
        if self.replay_failed is None and target is not None and (self.last is None or self.last < target - 1):
            self._fail(f"replay ended at {self.last} before batch {target} that started it")
        self._finish()

    def check_timeout(self, now: float) -> None:
        """Give up a replay past its deadline (R-STR-4)."""
        if self.replaying and now > self.replay_deadline:
            if self.proving:
                self.sink.count(self, "continuity_unproven")
            self._fail(f"replay from {self.replay_start} timed out after {self.replay_timeout_s:g}s")
            self._cancel()
            self._finish()

    # ------------------------------------------------------------- internals

    def _is_restart(self, seq: int, payload: bytes) -> bool:
        return classify(self.last, self.anchor_ts, seq, peek_ts(payload)) == RESTART

    def _first(self, seq: int, payload: bytes) -> None:
        """A batch at seq 0 with nothing before it: the whole history from here on."""
        self.full_history = True
        self.unproven = False
        self.sink.mark_fresh(self)
        self.apply(seq, payload)

    def _forget(self) -> None:
        self.last = self.anchor_seq = self.anchor_ts = None
        self.full_history = False
        self.unproven = False

    def _restart(self) -> None:
        """R-STR-5: the engine restarted (vLLM starts again at 0 with empty caches)."""
        self.sink.reset_worker(self)
        self.restarts += 1
        self._forget()

    def _rebuild(self) -> None:
        """A restart proven by a replay: drop the worker's residency and replay from 0.
        Of the buffered live batches, those that came over the current connection stay
        (the new incarnation's: the rebuild must reach them, or the worker is stale);
        those from before the latest reconnect are the old incarnation's, and go."""
        keep = [p for p in self.pending if p[2] == self.epoch]
        self._cancel()
        self._restart()
        self.pending = keep
        self._replay(0, None)

    def _prove(self, seq: int, payload: bytes, epoch: int) -> None:
        """After a reconnect: hold ``seq`` until a replay from the anchor proves it."""
        if self.anchor_seq is None:
            # Nothing applied since the last reset: the index holds nothing to protect.
            self.unproven = False
            if self.last is not None and seq <= self.last:
                self.sink.count(self, "batches_duplicate")
            else:
                self.live(seq, payload, epoch)
            return
        self._replay(self.anchor_seq, (seq, payload, epoch))

    def _gap(self, start: int, seq: int, payload: bytes, epoch: int) -> None:
        self.gaps += 1
        self.sink.count(self, "wire_gaps")
        if start > 0 and self.anchor_seq is not None:
            start = self.anchor_seq  # R-STR-7: a gap may hide a restart; prove it did not
        self._replay(start, (seq, payload, epoch))

    def _replay(self, start: int, live: tuple[int, bytes, int] | None) -> None:
        if live is not None:
            self.pending.append(live)
        self.replay_target = self.pending[0][0] if self.pending else None
        self.replay_failed = None
        self.unproven = False
        self.replayed_lo = self.replayed_hi = -1
        self.proving = self.anchor_seq is not None and start == self.anchor_seq
        why = self.sink.request_replay(self, start)
        if why is not None:
            if self.proving:
                self.proving = False
                self._unproven(why)
            else:
                self._fail(why)
            self._finish()
            return
        self.replaying = True
        self.replay_start = self.replay_next = start
        self.replay_deadline = self.clock() + self.replay_timeout_s

    def _cancel(self) -> None:
        if self.replaying:
            self.sink.cancel_replay(self)
        self.replaying = False
        self.proving = False

    def _unproven(self, why: str) -> None:
        """R-STR-7: no proof of continuity can be had; the worker is stale, saying why."""
        self.sink.count(self, "continuity_unproven")
        self._fail(f"continuity after seq {self.anchor_seq} unproven: {why}")

    def _fail(self, reason: str) -> None:
        if self.replay_failed is None:
            self.replay_failed = reason
            self.replays_failed += 1
            self.sink.count(self, "replays_failed")
        self.full_history = False
        self.sink.mark_stale(self, reason)

    def _finish(self) -> None:
        """End a replay (done, failed or timed out), then sequence the buffered live
        batches again, in arrival order (duplicates, a restart, or another gap)."""
        ok = self.replay_failed is None
        if self.replaying and ok:
            self.replays_ok += 1
            self.sink.count(self, "replays_ok")
            if self.full_history:
                self.sink.mark_fresh(self)
        self.replaying = False
        self.proving = False
        items = self.pending
        self.pending = []
        if not ok and items:
            # Unrecoverable: accept the gap up to the first buffered batch (the worker
            # is stale) instead of asking again forever.
            first = items[0][0]
            if self.last is None or first > self.last + 1:
                self.last = first - 1
        for seq, payload, epoch in items:
            last = self.last
            if last is not None and seq <= last:
                # Covered by the replay (overlap), or what a proof was about. Never a
                # restart: the replay came from the engine as it is now, and a restart
                # after it shows as a reconnect, to be proven (R-STR-7). Taking a stale
                # batch with a newer ts (an old incarnation's, the new one's clock
                # behind) for a restart here would rebuild, and loop, forever.
                self.sink.count(self, "batches_duplicate")
                continue
            self.live(seq, payload, epoch)  # once replaying again, the rest re-buffers
        if self.unproven and not self.replaying and self.anchor_seq is not None:
            # A reconnect came during the replay, and no batch since asked for the proof.
            self._replay(self.anchor_seq, None)
