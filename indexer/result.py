"""Match results: the value types a query returns (frozen, JSON-shaped by ``to_dict``)."""

from __future__ import annotations

from msgspec import Struct

__all__ = ["MatchResult", "WorkerMatch"]


class WorkerMatch(Struct, frozen=True, gc=False):
    """One worker's answer (R-Q-2): blocks per tier and group, ``total``, score, freshness.

    ``tiers`` and ``total_blocks`` are the headline figures: the minimum over the
    model's default groups (R-APP-10), in blocks of the headline block size.
    """

    engine: str
    dp_rank: int
    tiers: dict
    groups: dict
    total_blocks: int
    total_tokens: int
    score: float
    stale: bool
    stale_reason: str | None
    last_seq: int | None
    last_event_age_s: float | None

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "dp_rank": self.dp_rank,
            "tiers": dict(self.tiers),
            "groups": {g: dict(v) for g, v in self.groups.items()},
            "total_blocks": self.total_blocks,
            "total_tokens": self.total_tokens,
            "score": self.score,
            "stale": self.stale,
            "stale_reason": self.stale_reason,
            "last_seq": self.last_seq,
            "last_event_age_s": self.last_event_age_s,
        }


class MatchResult(Struct, frozen=True, gc=False):
    """The answer to one query: every matching worker, best first, and the best one."""

    model: str
    block_size: int | None
    query_blocks: int
    workers: list
    best: WorkerMatch | None

    def worker(self, engine: str, dp_rank: int = 0) -> WorkerMatch | None:
        """The entry of one worker, or None when it matched nothing."""
        for w in self.workers:
            if w.engine == engine and w.dp_rank == dp_rank:
                return w
        return None

    def to_dict(self) -> dict:
        """Exactly the JSON body of ``POST /v1/match``."""
        b = self.best
        return {
            "model": self.model,
            "block_size": self.block_size,
            "query_blocks": self.query_blocks,
            "workers": [w.to_dict() for w in self.workers],
            "best": None if b is None else {"engine": b.engine, "dp_rank": b.dp_rank, "score": b.score},
        }
