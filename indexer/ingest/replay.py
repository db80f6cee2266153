"""Replay a recording (:mod:`.record`): rebuild the index call by call and check that
every recorded answer comes out again, exactly (``docs/record.md``).

Each segment starts from its base (the recorded index's state, in-flight view included,
with the clock's exact readings); every journaled call is made again on the replay index
under its lock, the clock handing it the readings the recorded call made, in order. A
call whose result differs (an answer, a batch's outcome, a count), or which reads the
clock more or fewer times, or needs a prompt the recording does not hold, is a
mismatch: the replay stops there and reports the first differing answer and the calls
since the last answer that agreed. A damaged segment (truncated, a checksum that does not
match) is reported with its offset; the replay then drops its state and goes on from the
next segment's base (``strict``: stops).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from indexer.ingest.recfile import Damage, read_segment, segments
from indexer.ingest.recops import JSON_ANSWER, Divergence, encode_result, replay_call, same_result
from indexer.ingest.recprivacy import KeyedReplayIndex
from indexer.query.index import PrefixIndex
from indexer.store import journal as J
from indexer.store.flightstate import load_flight
from indexer.store.journal import Raised
from indexer.store.snapshot import loads

__all__ = ["Mismatch", "ReplayReport", "replay", "describe"]

_SINCE = 200  # calls kept since the last agreeing answer, for a mismatch's report


class _Clock:
    """The replay index's clock: inside a replayed call, the readings the recorded call
    made, in order; outside, the last of them."""

    __slots__ = ("last", "q", "i")

    def __init__(self, t: float) -> None:
        self.last = t
        self.q: list[float] | None = None
        self.i = 0

    def __call__(self) -> float:
        q = self.q
        if q is None:
            return self.last
        if self.i >= len(q):
            raise Divergence(f"the call reads the clock more than the {len(q)} time(s) it did when recorded")
        t = self.last = q[self.i]
        self.i += 1
        return t


@dataclass
class Mismatch:
    """The first replayed call whose result differs from the recorded one."""

    op_number: int
    op: str
    wall: float
    recorded: Any
    replayed: Any
    why: str
    since: list[str]  # the calls since the last answer that agreed, oldest first

    def report(self) -> str:
        lines = [f"MISMATCH at call #{self.op_number} ({self.op}, {_iso(self.wall)}): {self.why}",
                 f"  recorded: {_show(self.recorded)}", f"  replayed: {_show(self.replayed)}",
                 f"  the {len(self.since)} call(s) since the last answer that agreed:"]
        lines += [f"    {s}" for s in self.since]
        return "\n".join(lines)


@dataclass
class ReplayReport:
    """What a replay found (see :func:`replay`)."""

    tokens: str = "hashed"
    segments: int = 0
    calls: int = 0
    answers: int = 0
    reproduced: int = 0
    checked: bool = True
    mismatch: Mismatch | None = None
    damage: list[Damage] = field(default_factory=list)
    index: PrefixIndex | None = None  # the state where the replay stopped
    at_op: int = -1  # the last call replayed
    at_wall: float = 0.0
    until_reached: bool = False
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=100))
    first_wall: float = 0.0

    @property
    def ok(self) -> bool:
        return self.mismatch is None and not self.damage


def replay(directory: str, *, until_op: int | None = None, until_wall: float | None = None, check: bool = True,
           strict: bool = False, on_call: Callable[[str], None] | None = None,
           nearest_base: bool = False) -> ReplayReport:
    """Rebuild the index recorded in ``directory`` and check its answers.

    Stops before the first call numbered above ``until_op`` or made after ``until_wall``
    (unix seconds), at the first mismatch (``check``), or at the first damaged segment
    when ``strict``. ``on_call`` is told a one-line summary of each call replayed. With
    ``nearest_base`` and ``until_wall``, starts from the last segment begun by then (its
    base holds everything before it: quicker, and checks only what follows). The
    report's ``index`` is the state there (None when nothing could be rebuilt)."""
    rep = ReplayReport(checked=check)
    since: deque[str] = deque(maxlen=_SINCE)
    clock: _Clock | None = None
    idx: PrefixIndex | None = None
    op_n = -1
    segs = segments(directory)
    if nearest_base and until_wall is not None:
        started = [i for i, (_, ms, _) in enumerate(segs) if ms <= until_wall * 1000]
        segs = segs[started[-1]:] if started else segs[:1]
    for _, _, path in segs:
        rep.segments += 1
        base_seen = False
        for item in read_segment(path):
            if isinstance(item, Damage):
                rep.damage.append(item)
                idx = None  # what followed is lost: the next segment's base starts again
                if strict:
                    rep.index = None
                    return rep
                break
            _, rec = item
            kind = rec[0]
            if kind == "base":
                head, snap, flight, exact = rec[1], rec[2], rec[3], rec[4]
                rep.tokens = head["tokens"]
                base_seen = True
                op_n = head.get("ops", op_n + 1) - 1
                if rep.first_wall == 0.0:
                    rep.first_wall = head["wall"]
                if until_wall is not None and head["wall"] > until_wall and idx is not None:
                    return _until(rep, idx, op_n)
                if idx is None or rep.tokens == "none":
                    idx, clock = _build(head, snap, flight, exact)
                    since.append(f"(state taken from segment {head.get('segment')}'s base)")
                continue
            if not base_seen or idx is None or clock is None:
                continue
            if kind == "note":
                _, wall, what, engine, rank, detail = rec
                since.append(f"{_iso(wall)} note {what} {engine}/{rank}" + ("" if detail is None else f" {detail}"))
                continue
            op, wall, times, args, result = rec
            op_n += 1
            if (until_op is not None and op_n > until_op) or (until_wall is not None and wall > until_wall):
                return _until(rep, idx, op_n - 1)
            rep.calls += 1
            rep.at_op, rep.at_wall = op_n, wall
            is_answer = op in J.QUERIES
            if rep.tokens == "none":
                if is_answer:
                    rep.answers += 1
                    _decision(rep, op, wall, result)
                since.append(_summary(op_n, op, wall, args, result))
                continue
            got, why = _call(idx, clock, op, args, times)
            line = _summary(op_n, op, wall, args, result)
            if on_call is not None:
                on_call(line)
            if is_answer:
                rep.answers += 1
                _decision(rep, op, wall, result)
            if why is None and check and not same_result(result, got):
                why = "the answer differs" if is_answer else "the call's result differs"
            if why is not None and check:
                rep.mismatch = Mismatch(op_n, J.OPS.get(op, str(op)), wall, _body(result), _body(got), why,
                                        list(since))
                rep.index = idx
                return rep
            if is_answer:
                rep.reproduced += 1
                since.clear()
            else:
                since.append(line)
    rep.index = idx
    return rep


def _until(rep: ReplayReport, idx: PrefixIndex, op_n: int) -> ReplayReport:
    rep.until_reached = True
    rep.index = idx
    return rep


def _build(head: dict[str, Any], snap: bytes | None, flight: dict[str, Any],
           exact: dict[str, Any]) -> tuple[PrefixIndex, _Clock]:
    """A replay index holding a base's state, with its clock at the base's reading."""
    clock = _Clock(head["t"])
    cls = KeyedReplayIndex if head["tokens"] == "hashed" else PrefixIndex
    opts = dict(head["options"])
    idx = cls(clock=clock, **opts)
    if snap is not None:
        loads(snap).restore(idx, downtime=False)
        with idx.lock:
            for engine, rank, last_apply in exact["workers"]:
                w = idx.worker_state(engine, rank)
                if w is not None:
                    w.last_apply = last_apply
                    w.refresh()
            q = idx._orphan_queue
            idx._orphan_queue = deque((t, wg, ph, e) for t, (_, wg, ph, e) in zip(exact["orphans"], q))
    with idx.lock:
        load_flight(idx.inflight, flight)
        idx.tie_slot = (head["tie_slot"][0], head["tie_slot"][1])
    return idx, clock


def _call(idx: PrefixIndex, clock: _Clock, op: int, args: list[Any], times: list[float]) -> tuple[Any, str | None]:
    """Make one recorded call again; ``(encoded result, why it cannot compare or None)``."""
    with idx.lock:
        clock.q, clock.i = times, 0
        try:
            r = replay_call(idx, op, args)
        except Divergence as e:
            return None, str(e)
        except Exception as e:  # the recorded call may have raised the same (an unknown model, say)
            r = Raised(e)
        finally:
            n, clock.q = clock.i, None
    if n != len(times):
        return encode_result(op, r), f"the call read the clock {n} time(s), {len(times)} when recorded"
    return encode_result(op, r), None


def _decision(rep: ReplayReport, op: int, wall: float, result: Any) -> None:
    if op == J.ROUTE and isinstance(result, list) and len(result) == 3 and result[2]:
        rid, worker, reason, score, cost = result[2]
        rep.decisions.append({"t": wall, "request_id": rid, "worker": worker, "reason": reason, "score": score,
                              "cost": cost})


def _body(result: Any) -> Any:
    """An encoded result made readable: a kept answer decoded, else its summary."""
    if isinstance(result, list) and len(result) == 3 and isinstance(result[1], int):
        if result[0] is not None:
            v = msgspec.msgpack.decode(result[0])
            if isinstance(v, list) and v and v[0] == JSON_ANSWER:  # a route's head, its entries as JSON
                v[-1] = msgspec.json.decode(v[-1])
            return v
        return {"digest": result[1], "summary": result[2]}
    return result


def _summary(n: int, op: int, wall: float, args: list[Any], result: Any) -> str:
    name = J.OPS.get(op, str(op))
    head = f"#{n} {_iso(wall)} {name}"
    if op in (J.APPLY, J.APPLY_SEQUENCED):
        res = result if isinstance(result, list) else [result]
        return f"{head} {args[0]}/{args[3]} seq={args[4]} -> {res[0]} ts={res[1] if len(res) > 1 else None}"
    if op == J.ROUTE and isinstance(result, list) and len(result) == 3 and result[2]:
        return f"{head} -> {result[2][1]} ({result[2][2]}, request {result[2][0]})"
    if op in J.QUERIES and isinstance(result, list) and len(result) == 3:
        return f"{head} -> best {result[2][0] if result[2] else None}"
    shown = [a for a in args if not isinstance(a, (bytes, list, dict))]
    return f"{head} {' '.join(map(str, shown))} -> {result}"


def describe(rep: ReplayReport) -> str:
    """A replay's outcome in a few lines (what ``kv-indexer replay`` prints)."""
    lines = [f"{rep.segments} segment(s), {rep.calls} call(s), {rep.answers} recorded answer(s); tokens {rep.tokens}"]
    for d in rep.damage:
        lines.append(f"DAMAGED: {d}; went on from the next segment's base")
    if rep.tokens == "none":
        lines.append("recorded with --record-tokens none: the index cannot be rebuilt; answers listed, not checked")
    elif rep.mismatch is not None:
        lines.append(rep.mismatch.report())
    elif rep.checked:
        lines.append(f"all {rep.reproduced} answer(s) reproduced exactly")
    if rep.until_reached:
        lines.append(f"stopped at call #{rep.at_op} ({_iso(rep.at_wall)})")
    return "\n".join(lines)


def _iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall * 1000) % 1000:03d}Z"


def _show(v: Any) -> str:
    s = msgspec.json.encode(v, enc_hook=repr).decode() if not isinstance(v, str) else v
    return s if len(s) < 4000 else s[:4000] + "..."
