"""Match results: the value types a query returns (immutable; JSON-shaped by ``to_dict``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from msgspec import Struct

from indexer._native import core as _core

__all__ = ["MatchResult", "WorkerMatch", "gpu_answers"]

# (stale, stale_reason, last_seq, last_apply): a worker's freshness, shared by its answers.
Freshness = tuple[bool, str | None, int | None, float | None]
# ((tier name, blocks), ...)
TierItems = tuple[tuple[str, int], ...]
# ((group, tier items, total blocks), ...)
GroupItems = tuple[tuple[str, TierItems, int], ...]
# (engine, dp_rank, freshness, position): one worker's row in a model's ``rows``.
Row = tuple[str, int, Freshness, int]

if TYPE_CHECKING:
    # WorkerMatch's items, for the type checker; at runtime its base is plain tuple.
    _WorkerTuple = tuple[float, int, str, int, TierItems, GroupItems, int, Freshness, float]
else:
    _WorkerTuple = tuple


# The JSON body of ``POST /v1/match`` as msgspec structs: encoded in C, to exactly the
# bytes of ``to_dict()`` (fields in the same order, None as null), ~2x faster to build.
# They are also the response schema: api/schemas.py publishes these very classes in
# the OpenAPI document (msgspec's JSON schema; the names are the component names).
class WorkerMatchOut(Struct, gc=False):
    engine: str
    dp_rank: int
    tiers: dict[str, int]
    groups: dict[str, dict[str, int]]
    total_blocks: int
    total_tokens: int
    score: float
    stale: bool
    stale_reason: str | None
    last_seq: int | None
    last_event_age_s: float | None


class BestOut(Struct, gc=False):
    engine: str
    dp_rank: int
    score: float


class PredictedOut(Struct, gc=False):
    """Blocks a worker is predicted to hold beyond what it announced (a prompt routed
    there whose prefill has not ended), and their credit-weighted score."""

    engine: str
    dp_rank: int
    predicted_blocks: int
    score: float


class MatchResponse(Struct, gc=False):
    model: str
    block_size: int | None
    query_blocks: int
    workers: list[WorkerMatchOut]
    best: BestOut | None
    predicted: list[PredictedOut]


# (engine, dp_rank, blocks beyond the announced total, their score), most blocks first.
Predicted = tuple[tuple[str, int, int, float], ...]


class WorkerMatch(_WorkerTuple):
    """One worker's answer (R-Q-2): blocks per tier and group, ``total``, score, freshness.

    ``tiers`` and ``total_blocks`` are the headline figures: the minimum over the
    model's default groups (R-APP-10), in blocks of the headline block size.
    ``groups`` maps the group index (as a string) to that group's blocks per tier
    and ``total_blocks``. Read-only.

    Laid out so that plain tuple order is the ranking (R-Q-3): negated score,
    negated total, engine id, rank; a query sorts its workers without a key
    function and builds nothing per worker beyond this tuple. The dicts and the
    freshness figures are made on access.
    """

    __slots__ = ()
    # (-score, -total_blocks, engine, dp_rank, tier_items, group_items,
    #  total_tokens, (stale, stale_reason, last_seq, last_apply), now)

    @property
    def score(self) -> float:
        return -self[0] + 0.0  # + 0.0: no "-0.0"

    @property
    def total_blocks(self) -> int:
        return -self[1]

    @property
    def engine(self) -> str:
        return self[2]

    @property
    def dp_rank(self) -> int:
        return self[3]

    @property
    def tier_items(self) -> TierItems:
        return self[4]

    @property
    def group_items(self) -> GroupItems:
        return self[5]

    @property
    def total_tokens(self) -> int:
        return self[6]

    @property
    def stale(self) -> bool:
        return self[7][0]

    @property
    def stale_reason(self) -> str | None:
        return self[7][1]

    @property
    def last_seq(self) -> int | None:
        return self[7][2]

    @property
    def last_event_age_s(self) -> float | None:
        t = self[7][3]
        return None if t is None else self[8] - t

    @property
    def tiers(self) -> dict[str, int]:
        return {name: b for name, b in self[4] if b}

    @property
    def groups(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, tiers, total in self[5]:
            d = {t: b for t, b in tiers if b}
            d["total_blocks"] = total
            out[name] = d
        return out

    def to_dict(self) -> dict[str, Any]:
        stale, reason, last_seq, _ = self[7]
        return {
            "engine": self[2],
            "dp_rank": self[3],
            "tiers": self.tiers,
            "groups": self.groups,
            "total_blocks": -self[1],
            "total_tokens": self[6],
            "score": self.score,
            "stale": stale,
            "stale_reason": reason,
            "last_seq": last_seq,
            "last_event_age_s": self.last_event_age_s,
        }

    def __repr__(self) -> str:
        return f"WorkerMatch({self.to_dict()!r})"


class MatchResult(NamedTuple):
    """The answer to one query: every matching worker, best first, and the best one
    (announced blocks only); ``predicted``: what routed prompts will add (apart)."""

    model: str
    block_size: int | None
    query_blocks: int
    workers: list[WorkerMatch]
    best: WorkerMatch | None
    predicted: Predicted = ()

    def worker(self, engine: str, dp_rank: int = 0) -> WorkerMatch | None:
        """The entry of one worker, or None when it matched nothing."""
        for w in self.workers:
            if w.engine == engine and w.dp_rank == dp_rank:
                return w
        return None

    def to_dict(self) -> dict[str, Any]:
        """Exactly the JSON body of ``POST /v1/match``."""
        b = self.best
        return {
            "model": self.model,
            "block_size": self.block_size,
            "query_blocks": self.query_blocks,
            "workers": [w.to_dict() for w in self.workers],
            "best": None if b is None else {"engine": b.engine, "dp_rank": b.dp_rank, "score": b.score},
            "predicted": [{"engine": e, "dp_rank": r, "predicted_blocks": n, "score": s}
                          for e, r, n, s in self.predicted],
        }

    def body(self) -> MatchResponse:
        """The same body as :meth:`to_dict` as msgspec structs, for ``msgspec`` to encode
        (byte for byte the same JSON, built faster). Workers with the same answer share
        their ``tiers`` and ``groups`` dicts, built once: not for mutation."""
        b = self.best
        memo: dict[tuple[TierItems, GroupItems], tuple[dict[str, int], dict[str, dict[str, int]]]] = {}
        out: list[WorkerMatchOut] = []
        append = out.append
        for w in self.workers:
            key = (w[4], w[5])
            tg = memo.get(key)
            if tg is None:
                tg = memo[key] = (w.tiers, w.groups)
            stale, reason, last_seq, t = w[7]
            append(WorkerMatchOut(w[2], w[3], tg[0], tg[1], -w[1], w[6], -w[0] + 0.0, stale, reason, last_seq,
                                  None if t is None else w[8] - t))
        return MatchResponse(self.model, self.block_size, self.query_blocks, out,
                             None if b is None else BestOut(b.engine, b.dp_rank, b.score),
                             [PredictedOut(*p) for p in self.predicted])


def _bits(mask: int) -> list[int]:
    """Indexes of the set bits of ``mask`` (worker ids), lowest first."""
    if mask.bit_count() <= 8:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    # Many bits (a shared prefix over a large fleet): scanning bin() is ~4x faster.
    b = bin(mask)[:1:-1]
    return [i for i, c in enumerate(b) if c == "1"]


def _py_gpu_answers(stops: list[tuple[int, int]], rows: list[Row | None], group: str, block_size: int,
                    credit: float, stale_factor: float, now: float,
                    cls: type[WorkerMatch] = WorkerMatch) -> list[WorkerMatch]:
    """The ranked answers of a GPU-only match in one group (read-only).

    For each ``(depth, mask)`` of ``stops`` (where workers' GPU runs end) and each
    worker id in ``mask`` with a row ``(engine, dp_rank, freshness, position)`` in
    ``rows``, one ``cls`` tuple; workers stopping at one depth share its tier and
    group items. In ranking order (tuple order, see :class:`WorkerMatch`): deepest
    stop first, each stop's workers by position (their ``(engine, dp_rank)`` order),
    sorted outright only when a stale worker or a negative credit can change that."""
    out: list[WorkerMatch] = []
    tnew = tuple.__new__
    nrows = len(rows)
    need_sort = credit < 0
    last = None
    for g, mask in reversed(stops):
        if last is not None and g >= last:
            need_sort = True  # stops not in increasing depth: rank outright
        last = g
        # (mypy does not narrow rows[wid] by the condition)
        here: list[Row] = [rows[wid] for wid in _bits(mask) if wid < nrows and rows[wid] is not None]  # type: ignore[misc]
        if not here:
            continue
        here.sort(key=_position)
        tier_items = (("GPU", g),)
        group_items = ((group, tier_items, g),)
        w = g * credit
        negw, negws, tokens = -w, -w * stale_factor, g * block_size
        for row in here:
            fresh = row[2]
            if fresh[0]:
                need_sort = True
            out.append(tnew(cls, (negws if fresh[0] else negw, -g, row[0], row[1], tier_items, group_items,
                                  tokens, fresh, now)))
    if need_sort:
        out.sort()
    return out


def _position(row: Row) -> int:
    return row[3]


gpu_answers: Callable[
    [list[tuple[int, int]], list[Row | None], str, int, float, float, float, type[WorkerMatch]], list[WorkerMatch]
] = _core.answers if _core is not None else _py_gpu_answers
