"""Record an index: every call that can change an answer, and every answer, to rotating
segment files that :func:`indexer.ingest.replay.replay` turns back into the same index
and the same answers (``docs/record.md``).

:class:`Recorder` attaches a :class:`~indexer.store.journal.Journal` to a
:class:`~indexer.PrefixIndex`: each journaled call (a batch applied, a worker registered,
removed, reset or marked stale, a route, a match, a done, a load correction, a peer's
in-flight news) is queued under the index lock with its clock readings, at the cost of a
tuple and a deque append; a background thread encodes the queue (prompts and payloads as
the privacy mode keeps them, :mod:`.recprivacy`) and appends it to the current segment:
the batches applied, laid out in runs by the compiled journal, through the compiled framer
(``indexer/_native/recframe.c``, the GIL released while it strips, hashes, encodes, checks
and writes), the rest here.
A segment starts with a *base*, the index's whole state at that point (its snapshot, the
in-flight view, the exact clock values), so the oldest segments can go (size and age caps)
and what is left still replays.

A write that fails (disk full, directory gone or unwritable) or a writer that falls
``max_pending`` records behind stops the recording: the journal is detached, the reason
counted and logged, and the index goes on serving as if never recorded.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import IO, Any

import msgspec

from indexer._native import core as _core
from indexer.ingest.recfile import MAGIC, frame, segment_name, segments
from indexer.ingest.recops import encode_call, encode_result
from indexer.ingest.recprivacy import MODES, strip_event
from indexer.query.index import PrefixIndex
from indexer.query.match import KeySource, _LazyKeys
from indexer.store import journal as J
from indexer.store.flightstate import dump_flight
from indexer.store.journal import Journal, Raised
from indexer.store.snapshot import cut_locked, finish
from indexer.wire.keys import KEY_SEED

__all__ = ["Recorder", "FORMAT"]

log = logging.getLogger("indexer.ingest.record")

FORMAT = 1
_enc = msgspec.msgpack.Encoder()
# Records (and runs) the writer takes from the queue at a time.
_CHUNK = 512
# What the writer holds before a write: each write lets go of the GIL and takes it back,
# which costs the threads on the hot paths a switch; one a drain is enough.
_WRITE_BYTES = 8 << 20
# The calls are calm while the writer writes less than this a second (a running mean over
# its drains; ~200 k blocks/s): a segment full or old is closed then, not in the middle of
# a burst. Its next base is the whole index dumped under its lock (~1 s of CPU at 4·10^6
# entries): dumped while a burst was applied, it cost that burst's ingest ~25%
# (bench_record.py --service --entries 4000000).
_CALM_RATE = 4 << 20
# How long the writer holds the GIL between two hand-overs while it encodes records (a
# query's is ~2.5 us compiled, recquery.c, ~3-7 us in Python, and its objects' freeing
# ~1.6 us more, cold from the queue). A request that needs the GIL meanwhile waits for the
# switch interval (0.2 ms in the service) unless the writer lets go: encoded 1,024 at a
# time without, the service's /query and /v1/route p99 were +50-80% while recorded
# (bench_record.py --service). The hand-over is time.sleep(0): ~75 us off the GIL on this
# VM, time for a waiting thread to wake and take it. os.sched_yield (~1 us) gives it back
# before the waiter is up, which then waits out the interval anyway: a thread probing
# the GIL every 50 us waited 2.4-3.3 ms at p99 during a drain, against 0.3 ms with sleep.
# Records are freed one by one as they are written: a chunk of 512 freed at once held the
# GIL ~0.8 ms (the same probe: 0.7 ms at p99 before, 0.3 ms after).
_HOLD_S = 50e-6
# Buffers one writev takes at most: the system's IOV_MAX (Linux's: 1,024), at least
# POSIX's 16. In ``none`` mode each record laid encoded in a run is a frame of its own.
_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16, 1024))
# What the compiled encoder (recquery.c) writes of each record, by op: the arguments as a
# list and a scalar result (GENERIC), the same with no result (a registration), /query's
# match_plain, a route, the library's match() and match_by_keys(). Every other op (and full
# mode) is the Python encoder's.
_NOTE, _GENERIC, _GENERIC_NONE, _MATCH_PLAIN, _ROUTE, _MATCH, _MATCH_BY_KEYS = range(7)
_KINDS: dict[Any, int] = {op: _GENERIC for op in (
    J.DROP_WORKER, J.DROP_ENGINE, J.RESET_WORKER, J.CLEAR_ENGINE, J.MARK_STALE, J.CLEAR_STALE, J.COUNT,
    J.COUNT_DROPPED, J.ROUTE_DONE, J.TIE_SLOT, J.DROP_PEER, J.EXPIRE, J.CLOSE)}
_KINDS.update({"note": _NOTE, J.REGISTER: _GENERIC_NONE, J.MATCH_PLAIN: _MATCH_PLAIN, J.ROUTE: _ROUTE,
               J.MATCH: _MATCH, J.MATCH_BY_KEYS: _MATCH_BY_KEYS})
_encode_record: Any = getattr(_core, "encode_record", None)
# The same, for the journal (journal.c's kinds): byte op is the op's kind + 1, or 0.
_KIND_TABLE = bytes(_KINDS[op] + 1 if op in _KINDS else 0 for op in range(max(J.OPS) + 1))


def _frames_py(bodies: list[bytes]) -> bytes:
    return b"".join(frame(b) for b in bodies)


# What a query's record may hold and the journal untrack (journal.c: values made per
# query, never handed out, never in a cycle).
_VALUES = frozenset({KeySource, _LazyKeys})

# The compiled framer (recframe.c) when built: the same frames, made with the GIL released,
# of the runs of applies the compiled journal queues (journal.c; none without it).
_frame_run: Any = _core.frame_run if _core is not None else None
_Run: Any = _core.ApplyRun if _core is not None else None
_frames: Any = _core.frame_many if _core is not None else _frames_py


class _Pace:
    """When the writer writes and when it begins a segment: the policy, apart from the
    writing (:class:`Recorder`)."""

    def __init__(self, defer_s: float) -> None:
        self.defer_s = defer_s
        self.held: float | None = None  # when the backlog a timer's wake left began
        self.drained_at = time.monotonic()
        self.rate = 0.0  # bytes written a second, a running mean over the drains
        self.seg_start = time.monotonic()

    def defer(self, j: Journal | None) -> bool:
        """Whether a timer's wake leaves what is queued for later (``defer_s``): a burst
        is written when it is over, not while it competes with the ingest for the GIL and
        the cores (written as it came, ~6% of a saturated ingest on this 2-core VM)."""
        if j is None or self.defer_s <= 0:
            return False
        if not j.records and j.run_bytes == 0:  # nothing queued: the wait starts with a backlog
            self.held = None
            return True
        now = time.monotonic()
        if self.held is None:
            self.held = now
        return now - self.held < self.defer_s

    def drained(self, wrote: int) -> bool:
        """A drain wrote ``wrote`` bytes: whether the calls are calm now (_CALM_RATE)."""
        now = time.monotonic()
        self.held = None
        self.rate = (self.rate + wrote / max(now - self.drained_at, 1e-3)) / 2
        self.drained_at = now
        return self.rate < _CALM_RATE

    def due(self, calm: bool, seg_bytes: int, limit: int, segment_s: float) -> bool:
        """Whether to begin a new segment: this one past ``limit`` bytes or ``segment_s``
        old once the calls are ``calm``, or anyway at 4 times the size or twice the age."""
        age = time.monotonic() - self.seg_start
        return ((calm and (seg_bytes >= limit or age >= segment_s))
                or seg_bytes >= 4 * limit or age >= 2 * segment_s)


class Recorder:
    """Records one index to ``directory`` (see the module).

    Parameters
    ----------
    directory:
        Where the segments go (made if missing).
    max_bytes, max_age_s:
        Caps on the whole recording: beyond, the oldest segments are deleted (counted);
        ``max_age_s`` 0 keeps segments of any age. The current segment is never deleted.
    segment_bytes, segment_s:
        A segment is closed and the next one (with its own base) begun once what follows
        its base passes ``segment_bytes`` and the base's own size (a base is the whole
        index, dumped under its lock: docs/record.md), or past ``segment_s``.
    tokens:
        ``"hashed"`` (default), ``"full"`` or ``"none"``: what is kept of prompts and of
        the payloads' token ids (:mod:`.recprivacy`).
    flush_s:
        How often the writer wakes to write what was queued.
    wake_every, wake_bytes:
        And it is woken every this many records queued (a query's record holds its
        objects), and when the batches applied and not written yet (copies, in the
        journal's runs) hold this many bytes (128 MiB: ~6·10^6 blocks in ``hashed`` mode;
        a larger burst is written while it is applied). Held in memory until written.
    defer_s:
        A timer's wake leaves what is queued this long: a burst is written when it is
        over, not while it competes with the ingest (:meth:`_Pace.defer`). 0: written at every
        wake. What is not written yet is lost if the process dies.
    max_pending:
        Records queued at most while the writer is behind; beyond, the recording stops.
    """

    def __init__(self, directory: str, *, max_bytes: int = 1 << 30, max_age_s: float = 0.0,
                 segment_bytes: int = 64 << 20, segment_s: float = 600.0, tokens: str = "hashed",
                 flush_s: float = 0.2, max_pending: int = 1_000_000, wake_every: int = 1024,
                 wake_bytes: int = 128 << 20, defer_s: float = 1.0) -> None:
        if tokens not in MODES:
            raise ValueError(f"tokens must be one of {', '.join(MODES)}, not {tokens!r}")
        if segment_bytes < 4096 or max_bytes < segment_bytes:
            raise ValueError("record_segment_bytes must be >= 4096 and <= record_max_bytes")
        self.directory = directory
        self.max_bytes = int(max_bytes)
        self.max_age_s = float(max_age_s)
        self.segment_bytes = int(segment_bytes)
        self.segment_s = float(segment_s)
        self.tokens = tokens
        self.flush_s = float(flush_s)
        self.wake_every = max(1, int(wake_every))
        self.wake_bytes = max(1, int(wake_bytes))
        self._pace = _Pace(float(defer_s))
        self._compiled = _encode_record is not None and tokens != "full"
        self.journal: Journal | None = None
        self.index: PrefixIndex | None = None
        self._max_pending = int(max_pending)
        self._file: IO[bytes] | None = None
        self._seg_n = -1
        self._seg_bytes = 0
        self._base_bytes = 0
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._halt = False
        self._want_base = False
        self.stopped: str | None = None  # why the recording stopped (None: recording, or never started)
        # Counters (the service exports them as kvi_record_*).
        self.records = 0
        self.bytes_written = 0
        self.segments_started = 0
        self.segments_dropped: dict[str, int] = {"size": 0, "age": 0}
        self.errors: dict[str, int] = {}
        self.answers = 0

    # ------------------------------------------------------------------ attach

    def attach(self, index: PrefixIndex) -> None:
        """Start recording ``index`` from its state now: its clock is journaled from here
        on and the first segment's base is this state. Raises OSError when the directory
        cannot be made or written (nothing attached), ValueError when ``index`` is being
        recorded already. Routes in flight from before are part of the base (replayed as
        they were routed)."""
        os.makedirs(self.directory, exist_ok=True)
        if not os.access(self.directory, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable", self.directory)
        existing = segments(self.directory)
        self._seg_n = existing[-1][0] if existing else -1
        with index.lock:
            if index.journal is not None:
                raise ValueError("this index is being recorded already")
            j = Journal(index._raw_clock, self._max_pending)
            j.on_restore = self._base_locked
            j.values = _VALUES
            # Hashed mode: the compiled journal lays a plain GPU batch with the keys its
            # apply made in place of its token ids (core.h's key sink), not the writer.
            j.strip = self.tokens == "hashed"
            j.seed = KEY_SEED
            if self._compiled:  # records encoded on the calling thread, laid in runs (journal.c's encoded)
                j.raised = Raised
                j.kinds = _KIND_TABLE
                j.encode = True
            # Buffers for 16 MiB of runs, touched now and kept between bursts; a burst makes
            # the rest as it goes (huge pages: applyrun.c's kvi_run_buf).
            j.stock(16 << 20)
            self.journal = j
            self.index = index
            index._rec = j
            index._clock = j.clock
            index.inflight.clock = j.clock
            self._base_locked()
        self.stopped = None

    def detach(self) -> None:
        """Stop journaling (the index's clock is its own again); what was queued is still
        written by :meth:`stop`."""
        index = self.index
        if index is None:
            return
        with index.lock:
            if index._rec is self.journal:
                index._rec = None
                index._clock = index._raw_clock
                index.inflight.clock = index._raw_clock

    def _base_locked(self) -> None:
        """Queue a base (the caller holds the index lock): the next segment starts here."""
        index, j = self.index, self.journal
        assert index is not None and j is not None
        cut = cut_locked(index)
        exact = {"workers": [[w.engine, w.dp_rank, w.last_apply] for w in index.worker_states()],
                 "orphans": [t for t, _, _, _ in index.orphan_entries()]}
        head = {"format": FORMAT, "tokens": self.tokens, "options": index.options(), "tie_slot": list(index.tie_slot),
                "t": cut["now"], "wall": time.time(), "empty": index.is_empty()}
        j.mark(("base", head, cut, dump_flight(index.inflight), exact))

    def note(self, kind: str, engine: str, rank: int, detail: Any = None) -> None:
        """Queue a note (a sequencer's decision about a worker): shown by a replay, no state."""
        j = self.journal
        if j is not None and self.stopped is None:
            j.note(kind, engine, rank, detail)

    # ------------------------------------------------------------------ the writer

    def start(self) -> None:
        """Start the writer thread: woken every ``flush_s``, every ``wake_every`` records
        queued and at ``wake_bytes`` of applies (journal.c says why)."""
        if self._thread is None:
            self._halt = False
            j = self.journal
            if j is not None:
                j.wake = self._wake.set
                j.wake_every = self.wake_every
                j.wake_bytes = self.wake_bytes
            self._thread = threading.Thread(target=self._run, name="kvidx-record", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Detach, write what is queued and close the segment."""
        self.detach()
        t = self._thread
        if t is not None:
            self._halt = True
            self._wake.set()
            t.join(timeout=30)
            self._thread = None
        else:
            self._drain()
        self._close_file()
        if self.journal is not None:
            self.journal.stock(0)  # the runs' buffers go back
        if self.stopped is None:
            self.stopped = "stopped"

    def flush(self) -> None:
        """Write what is queued now (on the caller's thread when no writer runs)."""
        if self._thread is None:
            self._drain()
        else:
            done = threading.Event()
            j = self.journal
            if j is not None:
                j.seal()
                j.records.append(("flush", done))
                self._wake.set()
                done.wait(10)
        if self._file is not None:
            self._file.flush()

    def _run(self) -> None:
        while not self._halt:
            woken = self._wake.wait(self.flush_s)
            self._wake.clear()
            pace = self._pace
            if not woken and pace.defer(self.journal):
                continue
            before = self.bytes_written
            self._drain()
            calm = pace.drained(self.bytes_written - before)
            if self._file is not None and self.stopped is None and pace.due(
                    calm, self._seg_bytes, max(self.segment_bytes, self._base_bytes), self.segment_s):
                self.rotate()
        self._drain()

    def _drain(self) -> None:
        j = self.journal
        if j is None:
            return
        j.seal()  # what was applied since the last run went (a timer's wake)
        q = j.records
        out: list[bytes] = []  # frames not written yet: one write a drain (or each _WRITE_BYTES)
        chunk: list[Any] = []
        try:
            while q:
                chunk = []
                while q and len(chunk) < _CHUNK:
                    chunk.append(q.popleft())
                self._frame_chunk(chunk, out)
                if sum(map(len, out)) >= _WRITE_BYTES:
                    self._write(out)
            self._write(out)
            if j.overflowed and self.stopped is None:
                self._stop_recording("overflow", f"the writer fell {self._max_pending} records behind")
        except OSError as e:
            self._stop_recording("disk_full" if e.errno == errno.ENOSPC else "io_error", str(e), chunk)

    def _frame_chunk(self, chunk: list[Any], out: list[bytes]) -> None:
        """Frame ``chunk`` (records, runs of applies and markers, in order) onto ``out``; a
        marker writes what is before it first. A run goes to the compiled framer, which
        takes the GIL only to start and end; the rest is encoded here."""
        bodies: list[bytes] = []  # encoded here, not framed yet

        def framed() -> None:  # the bodies encoded so far onto out, in order
            if bodies:
                out.append(_frames(bodies))
                bodies.clear()

        clock = time.perf_counter
        due = clock() + _HOLD_S
        for i, item in enumerate(chunk):
            chunk[i] = None  # freed once written, not the whole chunk at once (see _HOLD_S)
            if item.__class__ is _Run:
                if self.stopped is None:
                    self._frame_run(item, bodies, framed, out)
                continue
            kind = item[0]
            if kind == "flush" or kind == "base":
                framed()
                self._write(out)
                if kind == "flush":
                    item[1].set()
                elif self.stopped is None:
                    self._new_segment(item)
                continue
            if self.stopped is None:  # stopped: what was queued after the stop is not written
                bodies.append(self._encode(item))
                if clock() >= due:
                    time.sleep(0)  # the GIL to a request waiting for it, now (see _HOLD_S)
                    due = clock() + _HOLD_S
        framed()

    def _frame_run(self, run: Any, bodies: list[bytes], framed: Any, out: list[bytes]) -> None:
        """Frame the records of ``run`` (applies, records laid encoded, the places of records
        queued apart): by the compiled framer straight to the file, but for what it leaves
        to the Python encoder (a payload not of the plain GPU shape in ``hashed`` mode; every
        one in ``none`` mode; a record queued apart, taken from the journal's ``apart``)."""
        self.answers += run.answers
        apart = self.journal.apart if self.journal is not None else None
        i, n = 0, len(run)
        fast = self.tokens != "none" and self._file is not None
        hashed = self.tokens == "hashed"
        while i < n:
            if fast:
                framed()
                self._write(out)  # what is before goes first: the framer writes to the file itself
                assert self._file is not None
                nxt, written = _frame_run(run, i, hashed, KEY_SEED, self._file.fileno())
                self._seg_bytes += written
                self.bytes_written += written
                self.records += nxt - i
                i = nxt
                if i == n:
                    break
            item = run.item(i)
            if item is None and apart is not None:  # the place of a record queued apart (journal.c)
                item = apart.popleft()
            if item.__class__ is bytes:  # a record laid encoded, framed by item()
                framed()
                out.append(item)
                self.records += 1
            else:
                bodies.append(self._encode(item))
            i += 1

    def _encode(self, item: tuple[Any, ...]) -> bytes:
        kind = _KINDS.get(item[0])
        if kind is not None and self._compiled:
            body = _encode_record(item, kind, self.tokens == "hashed", KEY_SEED, Raised)
            if body is not None:
                if kind != _NOTE:
                    self.records += 1
                    if kind >= _MATCH_PLAIN and item[3] is not None:
                        self.answers += 1
                return body  # type: ignore[no-any-return]
        if item[0] == "note":
            return _enc.encode(list(item))
        op, wall, args, result, times = item
        self.records += 1
        res = encode_result(op, result)
        body = _enc.encode([op, wall, times, encode_call(op, args, result, self.tokens), res])
        if isinstance(res, list) and len(res) == 3 and isinstance(res[1], int):
            self.answers += 1
        return body

    def _write(self, frames: list[bytes]) -> None:
        """Write ``frames`` and empty the list (dropped when the recording stopped)."""
        if not frames or self._file is None or self.stopped is not None:
            frames.clear()
            return
        n = _write_all(self._file, frames)  # unbuffered: straight to the file, as the compiled framer writes
        frames.clear()
        self._seg_bytes += n
        self.bytes_written += n

    def _new_segment(self, base: tuple[Any, ...]) -> None:
        _, head, cut, flight, exact = base
        if self.tokens != "full":
            cut["orphans"] = [msgspec.structs.replace(o, event=_strip_orphan(o.event, self.tokens))
                              for o in cut["orphans"]]
        snap = None if head["empty"] else finish(cut)
        self._close_file()
        self._seg_n += 1
        wall = head["wall"]
        path = os.path.join(self.directory, segment_name(self._seg_n, int(wall * 1000)))
        # Unbuffered: the compiled framer writes runs of applies to its descriptor between
        # the writes made here, so nothing may wait in a Python buffer.
        f = open(path, "wb", buffering=0)  # noqa: SIM115  # kept open across writes; closed by _close_file
        self._file = f
        self._pace.seg_start = time.monotonic()
        self._seg_bytes = 0  # what follows the base (the base is counted in bytes_written only)
        self.segments_started += 1
        self._want_base = False
        head = dict(head, segment=self._seg_n, ops=self.records)
        self._base_bytes = n = _write_all(f, [MAGIC, frame(_enc.encode(["base", head, snap, flight, exact]))])
        self.bytes_written += n
        _drop_old(self.directory, self.max_bytes, self.max_age_s, self.segments_dropped)

    def rotate(self) -> None:
        """Begin a new segment (with a base of the state now) at the next write."""
        index = self.index
        if self._want_base or index is None or index.journal is None:
            return
        self._want_base = True
        with index.lock:
            self._base_locked()

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as e:
                self._count_error("io_error", str(e))

    def _stop_recording(self, reason: str, detail: str, taken: list[Any] | None = None) -> None:
        """Stop for good (the index keeps serving): detach, count, log. ``taken``: records the
        writer took off the queue and did not write."""
        self.stopped = reason
        self._count_error(reason, detail)
        log.error("recording to %s stopped (%s): %s; the service goes on without it", self.directory, reason, detail)
        self.detach()
        j = self.journal
        if j is not None:
            j.stock(0)  # the runs' buffers go back
            j.apart.clear()
            q = j.records  # what is in it now is not written; a flush waiting on it returns
            for item in (*(taken or ()), *(q.popleft() for _ in range(len(q)))):
                if item is not None and item.__class__ is not _Run and item[0] == "flush":
                    item[1].set()
        try:
            self._close_file()
        except OSError:
            pass

    def _count_error(self, reason: str, detail: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def stats(self) -> dict[str, Any]:
        """The recording's counters (the service's ``kvi_record_*``), JSON-able."""
        j = self.journal
        return {
            "directory": self.directory, "tokens": self.tokens, "recording": self.stopped is None and j is not None,
            "stopped": self.stopped, "records": self.records, "answers": self.answers,
            "bytes_written": self.bytes_written, "segments_started": self.segments_started,
            "segments_dropped": dict(self.segments_dropped), "errors": dict(self.errors),
            "pending": j.pending if j is not None else 0, "segment": self._seg_n,
        }


def _strip_orphan(event: bytes, mode: str) -> bytes:
    return _enc.encode(strip_event(msgspec.msgpack.decode(event), mode))


def _write_all(f: IO[bytes], frames: list[bytes]) -> int:
    """All of ``frames``, in order, to the unbuffered file ``f`` (a raw write may take part
    of it); returns the bytes written. ``frames`` is left partly consumed. One writev, not
    a join: joining a drain's frames (~1.5 MB for 1,024 queries) was a copy made holding
    the GIL, ~0.2 ms a request that arrived meanwhile waited. Walked by index, the frames
    whole: a memoryview of each and ``pop(0)`` made 10,000 queries' frames cost 1.8 us
    each to write, against 0.3 for the writev itself."""
    total = sum(map(len, frames))
    if not hasattr(os, "writev"):  # Windows: one write of the frames joined
        frames[:] = [b"".join(frames)]
    fd, i, n = f.fileno(), 0, len(frames)
    while i < n:
        w = os.writev(fd, frames[i:i + _IOV_MAX]) if hasattr(os, "writev") else f.write(frames[i]) or 0
        while i < n and w >= len(frames[i]):
            w -= len(frames[i])
            i += 1
        if w:  # a frame written in part: its rest next
            frames[i] = memoryview(frames[i])[w:]  # type: ignore[call-overload]
    return total


def _drop_old(directory: str, max_bytes: int, max_age_s: float, dropped: dict[str, int]) -> None:
    """Delete the oldest segments of ``directory`` (never the newest) while the whole is
    past ``max_bytes`` or a segment ended more than ``max_age_s`` ago (0: any age);
    counts each in ``dropped`` by why."""
    segs = segments(directory)
    if len(segs) <= 1:
        return
    sizes = {p: _size(p) for _, _, p in segs}
    total = sum(sizes.values())
    now_ms = time.time() * 1000
    for i, (_, _, path) in enumerate(segs[:-1]):
        ended_ms = segs[i + 1][1]  # a segment ends where the next begins
        if total > max_bytes:
            why = "size"
        elif max_age_s > 0 and now_ms - ended_ms > max_age_s * 1000:
            why = "age"
        else:
            break
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        total -= sizes[path]
        dropped[why] += 1


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
