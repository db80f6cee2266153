"""The index's journal: every call that can change what the index answers, in the order
the index lock took them, with its arguments, its result and each reading of the index
clock it made.

A :class:`Journal` is what a recording index (``IndexState._rec``) hands each of those
calls to, under the index lock: :meth:`Journal.run` runs the call, notes the clock
readings it made (the index's clock is :meth:`Journal.clock` while one is attached) and
queues ``(op, wall time, args, result, clock readings)`` for a writer thread
(:mod:`indexer.ingest.record`). Nothing here encodes or writes: the hot paths pay a
tuple and a deque append (in the compiled core, ``indexer/_native/journal.c``, when
built), and a batch applied (:meth:`Journal.run_apply`) not even that: the compiled core
copies it into an ``ApplyRun``, a buffer of many, queued whole. Reads of the clock
outside a journaled call (a stats poll, a snapshot's cut, explain) are not noted, so a
replay feeds each call exactly the readings it made.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from indexer._native import core as _core

__all__ = ["Journal", "Raised", "OPS"]

_wall = time.time

# Op codes: the journal's vocabulary (kept stable: recordings name ops by these numbers).
APPLY = 1
APPLY_SEQUENCED = 2
DROP_WORKER = 3
DROP_ENGINE = 4
RESET_WORKER = 5
CLEAR_ENGINE = 6
REGISTER = 7
MARK_STALE = 8
CLEAR_STALE = 9
COUNT = 10
COUNT_DROPPED = 11
ROUTE = 12
ROUTE_DONE = 13
CORRECT_LOAD = 14
TIE_SLOT = 15
ADOPT_PEER = 16
END_PEER = 17
FORGET_PEER_WORKER = 18
DROP_PEER = 19
EXPIRE = 20  # a read that ends what is due in flight (workers, stats, own_requests)
MATCH = 21
MATCH_BY_KEYS = 22
MATCH_PLAIN = 23
CLOSE = 24

OPS = {v: k.lower() for k, v in dict(globals()).items() if k.isupper() and isinstance(v, int) and k != "OPS"}

# Queries (their answers are what a replay checks) and the rest (state changes).
QUERIES = frozenset({ROUTE, MATCH, MATCH_BY_KEYS, MATCH_PLAIN})


class Raised:
    """A journaled call that raised: its exception's type name and message."""

    __slots__ = ("kind", "message")

    def __init__(self, e: BaseException) -> None:
        self.kind = type(e).__name__
        self.message = str(e)


class _PyJournalCore:
    """:class:`Journal`'s hot half in Python (``indexer/_native/journal.c`` is the compiled
    one, used when built): the queue, the clock wrapper and :meth:`run`."""

    __slots__ = ("records", "times", "active", "raw", "max_pending", "overflowed", "values", "wake", "wake_every",
                 "wake_bytes", "run_bytes", "since_wake", "strip", "seed", "encode", "raised", "kinds", "apart")

    def __init__(self, raw: Callable[[], float], max_pending: int = 1_000_000) -> None:
        self.values: frozenset[type] | None = None  # untracked by the compiled twin only (journal.c)
        # Called every wake_every records (the writer's event): journal.c says why.
        self.wake: Callable[[], Any] | None = None
        self.wake_every = 1024
        self.wake_bytes = 32 << 20  # the compiled twin's runs (here every record counts)
        self.run_bytes = 0
        self.since_wake = 0
        self.strip = False  # the compiled twin's: lay batches stripped (hashed mode)
        self.seed = 0
        self.encode = False  # the compiled twin's: queries' records queued encoded (the writer encodes here)
        self.raised: type | None = None
        self.kinds: bytes | None = None
        self.records: deque[tuple[Any, ...]] = deque()
        self.apart: deque[tuple[Any, ...]] = deque()  # the compiled twin's (with encode)
        self.times: list[float] = []
        self.active = False
        self.raw = raw
        self.max_pending = max_pending
        self.overflowed = False

    def clock(self) -> float:
        """The index's clock while recording: a reading inside a journaled call is noted."""
        t = self.raw()
        if self.active:
            self.times.append(t)
        return t

    def run(self, op: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Call ``fn(*args)`` (the caller holds the index lock) and queue the call with its
        result or exception and its clock readings; returns what ``fn`` returns."""
        outer, prev = self.times, self.active
        self.active = True
        times = self.times = []
        try:
            r = fn(*args)
        except BaseException as e:
            self.active, self.times = prev, outer
            self._put_raised(op, _wall(), args, e, tuple(times))
            raise
        self.active, self.times = prev, outer
        q = self.records
        if len(q) < self.max_pending:
            q.append((op, _wall(), args, r, tuple(times)))
            self.since_wake += 1
            if self.since_wake >= self.wake_every and self.wake is not None:
                self.since_wake = 0
                self.wake()
        else:
            self.overflowed = True
        return r

    def run_apply(self, op: int, fn: Callable[..., Any], engine: str, payload: bytes, model: str,
                  dp_rank: int | None, seq: int | None, decide: bool) -> Any:
        """:meth:`run` of a batch applied (the compiled twin lays it in a run instead)."""
        return self.run(op, fn, (engine, payload, model, dp_rank, seq, decide))

    def seal(self) -> None:
        """Queue the open run: none here (the compiled twin's)."""

    def stock(self, nbytes: int) -> None:
        """Keep buffers for runs of ``nbytes``: none here (the compiled twin's)."""

    @property
    def pending(self) -> int:
        """Records queued and not written yet."""
        return len(self.records)

    def _put_raised(self, op: int, wall: float, args: tuple[Any, ...], e: BaseException,
                    times: tuple[float, ...]) -> None:
        raise NotImplementedError


if TYPE_CHECKING:
    _JournalCore = _PyJournalCore
else:
    _JournalCore = _core.JournalCore if _core is not None else _PyJournalCore


class Journal(_JournalCore):
    """The queue a recording index writes to (see the module). Not thread-safe by
    itself: :meth:`run` and :meth:`clock` are called under the index lock; the writer
    takes from :attr:`records` (a deque: append and popleft are atomic). A call's clock
    readings are a tuple; a journaled call made inside another (none is today) notes
    its own readings, and the outer call keeps those it made."""

    __slots__ = ("on_restore",)

    def __init__(self, raw: Callable[[], float], max_pending: int = 1_000_000) -> None:
        super().__init__(raw, max_pending)
        # Called under the lock when the index's whole state was replaced (a snapshot
        # restored): the recorder starts a segment with a new base there.
        self.on_restore: Callable[[], None] | None = None

    def _put_raised(self, op: int, wall: float, args: tuple[Any, ...], e: BaseException,
                    times: tuple[float, ...]) -> None:
        """Queue a journaled call that raised ``e`` (then it propagates)."""
        self._put((op, wall, args, Raised(e), times))

    def note(self, kind: str, engine: str, rank: int, detail: Any = None) -> None:
        """Queue a sequencer's decision about a worker (``replayed``, ``replay_requested``,
        a counted outcome): shown by a replay, no state of its own. Any thread."""
        self._put(("note", time.time(), kind, engine, rank, detail))

    def mark(self, item: tuple[Any, ...]) -> None:
        """Queue something that is not a call (a segment's base, a note), in order."""
        self._put(item)

    def _put(self, item: tuple[Any, ...]) -> None:
        self.seal()  # the applies before it go first
        q = self.records
        if len(q) >= self.max_pending:
            self.overflowed = True  # the writer sees it and stops the recording
            return
        q.append(item)
