"""Best replica for a request: a match answer combined with per-worker load (R-Q-3).

Read-only over a :class:`~indexer.query.answers.MatchResult`; used by ``PrefixIndex.route``,
the service's ``POST /v1/route`` and the fleet simulator's index policy.

The answer lists every candidate (hundreds in a large fleet), so the per-candidate work
is one pass in the compiled core (``indexer/_native/ranking.c``; :func:`_py_rank` is its
pure-Python twin and the fallback): cost, sort key and the ranked entry, built once,
either as the library's dicts, as msgspec structs (the same JSON), or written straight
to the answer's JSON bytes (``rankout.c``; :meth:`Ranking.body`), which is what the
service sends: at 256 workers the structs and their encoding were most of a route.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec
from msgspec import Raw, Struct

from indexer._native import core as _core
from indexer.query.answers import MatchResult, Row, WorkerMatch
from indexer.wire.engines import parse_worker

__all__ = ["Load", "LoadOut", "RankedOut", "RouteBody", "RouteResponse", "Ranking", "rank", "route", "spread_unseen"]

# How a ranking writes its entries (``Query._route_keys``' ``form``): the library's dicts,
# msgspec structs, or the answer's JSON bytes with only the first KEEP entries as structs.
# A recording keeps the form as it kept the bool "structs" before (False, True: 0, 1).
DICTS, STRUCTS, BODY = 0, 1, 2
# The entries a caller of the JSON form still reads as structs (the chosen worker and the
# runner-up: the service's metrics and its decisions page).
KEEP = 2
_encode = msgspec.json.encode


class Load(NamedTuple):
    """What a worker is busy with: prefill tokens queued or running, decode blocks held."""

    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0


# The JSON body of ``POST /v1/route`` as msgspec structs, encoded to exactly the bytes of
# the library's dict answer (fields in the same order). They are also the response
# schema: api/schemas.py publishes these classes in the OpenAPI document.
class LoadOut(Struct, gc=False, frozen=True):
    """The load a worker was weighed with: the caller's (``caller``), the index's own
    in-flight estimate (``index``), or none."""

    prefill_tokens: int
    decode_blocks: int
    source: str


class RankedOut(Struct, gc=False, frozen=True):
    worker: str
    engine: str
    dp_rank: int
    # Announced prefix (credit-weighted) plus predicted blocks (predicted_credit each).
    score: float
    # Announced blocks (GPU, then whole CPU chunks, then STORAGE).
    cached_blocks: int
    # Blocks routed prompts will add beyond the announced ones (not yet announced).
    predicted_blocks: int
    cost: float
    stale: bool
    # The live socket's state now; null for a candidate the index does not subscribe to.
    connected: bool | None
    load: LoadOut


class RouteResponse(Struct, gc=False, frozen=True):
    model: str
    worker: str
    engine: str
    dp_rank: int
    score: float
    cost: float
    reason: str
    # The chosen worker's announced blocks per tier (as /v1/match's "tiers").
    tiers: dict[str, int]
    ranked: list[RankedOut]
    # Keys of "load" that named no candidate (well-formed, but no such worker).
    unused_load: list[str]
    # Names this decision (POST /v1/route/{request_id}/done releases it); null for a dry run.
    request_id: str | None


# RouteResponse with its "ranked" already written as JSON (the same fields in the same
# order, so the same bytes): what Ranking.body encodes around the compiled core's array.
class _RouteRaw(Struct, gc=False, frozen=True):
    model: str
    worker: str
    engine: str
    dp_rank: int
    score: float
    cost: float
    reason: str
    tiers: dict[str, int]
    ranked: Raw
    unused_load: list[str]
    request_id: str | None


class RouteBody(NamedTuple):
    """The ``POST /v1/route`` answer as the JSON bytes the service sends
    (``PrefixIndex.route_body``), with what a caller reads of it without decoding it."""

    body: bytes
    model: str
    reason: str
    tiers: dict[str, int]
    ranked: list[RankedOut]  # the first KEEP entries of the body's "ranked" (all when fewer)
    request_id: str | None


class Ranking(NamedTuple):
    """A route's decision before it is written out: the ranked entries, best first
    (dicts, or :class:`RankedOut` when asked for structs), and what the answer's head
    says. Read-only. With ``json`` (``rank(..., body=True)``) the entries are already
    written as the answer's JSON array and ``ranked`` holds only the first :data:`KEEP`
    of them: write it out with :meth:`body`."""

    model: str
    ranked: list[Any]
    best: WorkerMatch | None  # the chosen worker's match (None: nothing cached there)
    top_score: float  # the highest score of any candidate
    unused_load: list[str]
    structs: bool
    json: bytes | None = None

    def head(self) -> tuple[str, str, int, float, float, int, int]:
        """``(worker, engine, dp_rank, score, cost, cached_blocks, predicted_blocks)`` of
        the chosen worker."""
        t = self.ranked[0]
        if self.structs:
            return t.worker, t.engine, t.dp_rank, t.score, t.cost, t.cached_blocks, t.predicted_blocks
        return (t["worker"], t["engine"], t["dp_rank"], t["score"], t["cost"], t["cached_blocks"],
                t["predicted_blocks"])

    def reason(self) -> str:
        score = self.ranked[0].score if self.structs else self.ranked[0]["score"]
        if self.top_score <= 0:
            return "no_cached_prefix_least_loaded"
        if score >= self.top_score:
            return "longest_cached_prefix"
        return "load_outweighs_cached_prefix"

    def answer(self) -> dict[str, Any]:
        """The ``/v1/route`` body as the library's dict (``ranked``: dicts), without its
        ``request_id`` (the caller adds it)."""
        self._whole()
        worker, engine, rank_, score, cost, _, _ = self.head()
        return {
            "model": self.model,
            "worker": worker,
            "engine": engine,
            "dp_rank": rank_,
            "score": score,
            "cost": cost,
            "reason": self.reason(),
            # The chosen worker's announced blocks per tier (as /v1/match's "tiers"): the
            # cached part of the cost split (one small dict: the tiers the worker holds).
            "tiers": self.best.tiers if self.best is not None else {},
            "ranked": self.ranked,
            "unused_load": self.unused_load,
        }

    def response(self, request_id: str | None = None) -> RouteResponse:
        """The same body as :meth:`answer`, as structs (``rank(..., structs=True)``)."""
        self._whole()
        worker, engine, rank_, score, cost, _, _ = self.head()
        return RouteResponse(self.model, worker, engine, rank_, score, cost, self.reason(),
                             self.best.tiers if self.best is not None else {}, self.ranked, self.unused_load,
                             request_id)

    def body(self, request_id: str | None = None) -> bytes:
        """The ``/v1/route`` body's JSON bytes: those of :meth:`response` (or of
        :meth:`answer` with ``request_id``), whatever form the entries are in."""
        if self.json is None:
            return _encode(self.response(request_id))
        worker, engine, rank_, score, cost, _, _ = self.head()
        return _encode(_RouteRaw(self.model, worker, engine, rank_, score, cost, self.reason(),
                                 self.best.tiers if self.best is not None else {}, Raw(self.json),
                                 self.unused_load, request_id))

    def route_body(self, request_id: str | None = None) -> RouteBody:
        """:meth:`body` with what a caller reads of it (:class:`RouteBody`)."""
        return RouteBody(self.body(request_id), self.model, self.reason(),
                         self.best.tiers if self.best is not None else {}, self.ranked[:KEEP], request_id)

    def _whole(self) -> None:
        if self.json is not None:
            raise ValueError("this ranking is written as JSON already: only body() writes it out")


def route(
    res: MatchResult,
    known: Iterable[tuple[str, int, bool]],
    *,
    load: Mapping[str, Load] | None = None,
    candidates: Iterable[str] | None = None,
    prefill_load_scale: float = 1.0,
    link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None,
    in_flight: Mapping[tuple[str, int], tuple[int, int]] | None = None,
    index_load: bool = False,
    tie_slot: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Rank the candidates by cost, lowest first; the ``/v1/route`` body.

    ``known`` is ``(engine, dp_rank, stale)`` of the model's workers
    (``PrefixIndex.model_workers``); ``candidates`` restricts them (``"engine/rank"``,
    or ``"engine"`` for all its known ranks; an unknown one is ranked with nothing
    cached); ``load`` is keyed ``"engine/rank"`` or ``"engine"``; ``link`` is the
    transport's ``(connected now, ever connected)`` per worker (None: all connected);
    ``in_flight`` is the index's own ``(prefill tokens, decode blocks)`` estimate of the
    workers it has load on (``InFlight.loads``; a worker it does not name has none),
    used where ``load`` names none (a caller's load replaces it); ``index_load`` says
    the index estimates load even when ``in_flight`` is None (it has nothing in flight:
    every worker's estimate is 0). For each candidate:

        score = credit-weighted announced prefix (stale already discounted)
                + the score of the predicted blocks beyond it (``res.predicted``)
        cost = prefill_load_scale * max(queued prefill blocks + prompt blocks - score, 0)
               + decode blocks

    A worker that never connected ranks after every other one, whatever its cost; then
    ties go to the higher score; candidates tied on all three are in (engine id, rank)
    order, rotated for router replica ``tie_slot = (slot, of)`` (:func:`_rotate_ties`:
    replicas that cannot see each other's decisions start a tie at different workers;
    ``(0, 1)``, one router, is no rotation). Load keys that name no candidate are listed
    in ``unused_load``.

    Raises
    ------
    ValueError
        When a candidate or load key is malformed (not ``ENGINE`` or ``ENGINE/RANK``
        with an engine id and ASCII rank digits); the message names every bad key.
    LookupError
        When there is no candidate at all.
    """
    return rank(res, known, load=load, candidates=candidates, prefill_load_scale=prefill_load_scale, link=link,
                in_flight=in_flight, index_load=index_load, tie_slot=tie_slot).answer()


def rank(
    res: MatchResult,
    known: Iterable[tuple[str, int, bool]] | list[Row | None],
    *,
    load: Mapping[str, Load] | None = None,
    candidates: Iterable[str] | None = None,
    prefill_load_scale: float = 1.0,
    link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None,
    in_flight: Mapping[tuple[str, int], tuple[int, int]] | None = None,
    index_load: bool = False,
    structs: bool = False,
    tie_slot: tuple[int, int] = (0, 1),
    body: bool = False,
    head: int = KEEP,
) -> Ranking:
    """:func:`route`'s decision as a :class:`Ranking` (its entries as :class:`RankedOut`
    with ``structs``), for the caller to write out with or without a request id. With
    ``body`` the entries are written as the answer's JSON array at once (structs for the
    first :data:`KEEP` only): :meth:`Ranking.body` then writes the answer. Raises as
    :func:`route` does (and ValueError for a ``tie_slot`` not ``0 <= slot < of``);
    changes nothing.

    ``known`` may also be a model's rows (``ModelState.rows``: ``(engine, dp_rank,
    freshness, position)``, None for a removed worker), read as they are: the index's
    own table of its workers, with no list made per route. ``head``: with ``body``, how
    many entries are kept as structs (at least :data:`KEEP`)."""
    slot, of = tie_slot
    if not 0 <= slot < of:
        raise ValueError(f"tie_slot must be (slot, of) with 0 <= slot < of, not {tie_slot!r}")
    load = load or {}
    bad = [k for k in load if not _valid_name(k)]
    if candidates is None:
        cands: list[Any] = known if known.__class__ is list else list(known)
    else:
        stale: dict[tuple[str, int], bool] = {}
        ranks: dict[str, list[int]] = {}
        for t in known:
            if t is not None:
                e, r = t[0], t[1]
                stale[(e, r)] = t[2] if len(t) == 3 else t[2][0]  # a row: its freshness
                ranks.setdefault(e, []).append(r)
        picked: list[tuple[str, int]] = []
        for c in candidates:
            try:
                engine, rank_ = parse_worker(c)
            except ValueError:
                bad.append(c)
                continue
            if rank_ is not None:
                picked.append((engine, rank_))
            else:
                picked.extend((engine, r) for r in ranks.get(engine, [0]))
        cands = [(e, r, stale.get((e, r), False)) for e, r in sorted(set(picked))]
    if bad:
        raise ValueError("malformed worker name(s) in candidates or load: "
                         f"{', '.join(repr(b) for b in bad)} (expected ENGINE or ENGINE/RANK, RANK in ASCII digits)")
    pred = {(e, r): (n, s) for e, r, n, s in res.predicted} if res.predicted else None
    idle = "index" if in_flight is not None or index_load else "none"
    structs = structs or body
    entry_cls, load_cls = (RankedOut, LoadOut) if structs else (None, None)
    used: set[str] = set()
    args: tuple[Any, ...] = (cands, res.workers, pred, load or None, used, in_flight or None, link,
                             res.query_blocks, res.block_size or 0, prefill_load_scale, idle, entry_cls, load_cls,
                             slot, of, max(head, KEEP) if body else None)
    got = _core.rank(*args) if _core is not None else None
    if got is None:  # no compiled core, or a value only Python ranks exactly (see ranking.c)
        used.clear()
        got = _py_rank(*args)
    if body:
        json, top_score, best, ranked = got
    else:
        json = None
        ranked, top_score, best = got
    if not ranked:
        raise LookupError(f"no workers to route to for model {res.model!r}")
    return Ranking(res.model, ranked, best, top_score, sorted(set(load) - used) if load else [], structs, json)


def spread_unseen(ranked: list[Any], structs: bool, unseen: list[float], query_blocks: int, block_size: int,
                  scale: float) -> dict[tuple[str, int], int]:
    """The prefill tokens to add to the load of some of ``ranked``'s first entries (a
    ranking with no caller load, best first) so that its best is where this request
    would go after the decisions other replicas are likely taking unseen right now
    (``InFlight.unseen``: per replica ranked before this one, how many). Each such
    decision is taken as one like this request's, on the best worker at that point,
    adding its uncached blocks there (times its weight); empty when the best stays the
    best. Only the first ``len(unseen) + 1`` entries can be chosen, so only they are
    read. Changes nothing."""
    n = min(len(ranked), len(unseen) + 1)
    if n < 2:
        return {}
    top = ranked[:n]
    if structs:
        cost = [e.cost for e in top]
        uncached = [max(query_blocks - e.score, 0.0) for e in top]
        never = [e.connected is False for e in top]
    else:
        cost = [e["cost"] for e in top]
        uncached = [max(query_blocks - e["score"], 0.0) for e in top]
        never = [e["connected"] is False for e in top]
    if any(never):
        return {}  # a worker that is not connected: not a place to spread to
    added = [0.0] * n
    for weight in unseen:
        i = min(range(n), key=cost.__getitem__)  # the first of equals: the ranking's order
        cost[i] += scale * weight * uncached[i]
        added[i] += weight * uncached[i]
    if min(range(n), key=cost.__getitem__) == 0:
        return {}
    out = {}
    for e, a in zip(top, added):
        if a:
            key = (e.engine, e.dp_rank) if structs else (e["engine"], e["dp_rank"])
            out[key] = round(a * block_size)
    return out


# Load keys already checked: a fleet's names repeat from one route to the next, and
# parse_worker costs ~1 us each. Bounded: cleared when it grows past _NAMES_MAX.
_valid_names: set[str] = set()
_NAMES_MAX = 65536


def _valid_name(k: str) -> bool:
    """Whether ``k`` is a well-formed worker name (remembered when it is)."""
    if k in _valid_names:
        return True
    try:
        parse_worker(k)
    except ValueError:
        return False
    if len(_valid_names) >= _NAMES_MAX:
        _valid_names.clear()
    _valid_names.add(k)
    return True


def _py_rank(cands: list[Any], workers: list[WorkerMatch],
             pred: dict[tuple[str, int], tuple[int, float]] | None, load: Mapping[str, Any] | None, used: set[str],
             in_flight: Mapping[tuple[str, int], tuple[int, int]] | None,
             link: Mapping[tuple[str, int], tuple[bool, bool]] | None, qb: int, bs: int, scale: float, idle: str,
             entry_cls: Any, load_cls: Any, slot: int = 0, of: int = 1,
             keep: int | None = None) -> tuple[Any, ...]:
    """The ranked entries of ``cands`` (``(engine, dp_rank, stale)``, or rows: see
    :func:`rank`), best first, the highest score and the best one's match; load keys
    found are added to ``used``. With ``keep``: ``(the entries as JSON, the highest score,
    the best one's match, the first keep entries)``. The compiled ``rank`` is its twin;
    this one also serves the values it declines."""
    by_key = {(w[2], w[3]): w for w in workers}
    keyed = []
    for c in cands:
        if c is None:
            continue  # a removed worker's row
        engine, rank_ = c[0], c[1]
        st = c[2] if len(c) == 3 else c[2][0]
        key = (engine, rank_)
        wm = by_key.get(key)
        score = -wm[0] + 0.0 if wm is not None else 0.0
        pblocks = 0
        if pred is not None:
            p = pred.get(key)
            if p is not None:
                pblocks = p[0]
                score += p[1]
        name = f"{engine}/{rank_}"
        ld: tuple[Any, Any, str] | None = None
        if load is not None:
            got = load.get(name)
            if got is not None:
                used.add(name)
            else:
                got = load.get(engine)
                if got is not None:
                    used.add(engine)
            if got is not None:
                ld = (got[0], got[1], "caller")
        if ld is None:
            f = in_flight.get(key) if in_flight is not None else None
            ld = (f[0], f[1], "index") if f is not None and (f[0] or f[1]) else (0, 0, idle)
        prefill = -(-ld[0] // bs) if bs else 0
        cost = scale * max(prefill + qb - score, 0.0) + ld[1]
        lk = link.get(key) if link is not None else None
        connected = lk[0] if lk is not None else (None if link is not None else True)
        cached = -wm[1] if wm is not None else 0
        if entry_cls is None:
            entry: Any = {"worker": name, "engine": engine, "dp_rank": rank_, "score": score + 0.0,
                          "cached_blocks": cached, "predicted_blocks": pblocks, "cost": cost, "stale": st,
                          "connected": connected,
                          "load": {"prefill_tokens": ld[0], "decode_blocks": ld[1], "source": ld[2]}}
        else:
            entry = entry_cls(name, engine, rank_, score + 0.0, cached, pblocks, cost, st, connected,
                              load_cls(*ld))
        keyed.append((lk is not None and not lk[1], cost, -score, engine, rank_, entry, wm))
    keyed.sort(key=_sort_key)  # (never connected, cost, -score, engine, rank) decide: (engine, rank) is unique
    if of > 1:
        _rotate_ties(keyed, slot, of)
    top = max((-t[2] for t in keyed), default=-math.inf)
    ranked = [t[5] for t in keyed]
    best = keyed[0][6] if keyed else None
    if keep is not None:
        return _encode(ranked), top, best, ranked[:keep]
    return ranked, top, best


def _sort_key(t: tuple[Any, ...]) -> tuple[Any, ...]:
    return t[:5]


def _rotate_ties(keyed: list[tuple[Any, ...]], slot: int, of: int) -> None:
    """Reorders ``keyed`` (sorted by :func:`_sort_key`) in place: each run tied on (never
    connected, cost, -score) starts where replica ``slot`` of ``of`` starts, and wraps.

    One router (``of`` 1) takes a tie in (engine, rank) order; replicas that take
    decisions in the same instant without seeing each other's would all take its first
    worker (herding). Here replica ``slot`` takes the whole (engine, rank) order of the
    ``k`` candidates rotated to start at position ``slot * k // of``: a fixed order per
    replica, so its next picks of a burst stay in its own arc of the fleet, as one router
    would spread them. A run that order would start at the same member for two slots (a
    run clustered in one arc, e.g. the two workers that hold a prefix) is rotated instead
    to start at its own member ``slot * m // of`` of its ``m``. The compiled twin is
    ``rotate_ties`` in ranking.c."""
    k = len(keyed)
    starts: list[tuple[str, int]] | None = None  # the whole order's worker at t * k // of, t = 1 .. of-1
    i = 0
    while i < k:
        never, cost, negscore = keyed[i][:3]
        j = i + 1
        # == per item, as the compiled twin compares (a tuple's == would take a NaN as itself)
        while j < k and keyed[j][0] == never and keyed[j][1] == cost and keyed[j][2] == negscore:
            j += 1
        m = j - i
        if m >= 2:
            start = slot * m // of
            if of <= m < k:
                if starts is None:
                    order = sorted(t[3:5] for t in keyed)
                    starts = [order[t * k // of] for t in range(1, of)]
                run = [t[3:5] for t in keyed[i:j]]
                at = [0] + [bisect_left(run, w) for w in starts]
                if all(a < b for a, b in zip(at, at[1:])) and at[-1] < m:
                    start = at[slot]
            if start:
                keyed[i:j] = keyed[i + start:j] + keyed[i:i + start]
        i = j
