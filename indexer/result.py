"""Match results: the value types a query returns (immutable; JSON-shaped by ``to_dict``)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MatchResult", "WorkerMatch"]


class WorkerMatch(NamedTuple):
    """One worker's answer (R-Q-2): blocks per tier and group, ``total``, score, freshness.

    ``tiers`` and ``total_blocks`` are the headline figures: the minimum over the
    model's default groups (R-APP-10), in blocks of the headline block size.
    ``groups`` maps the group index (as a string) to that group's blocks per tier
    and ``total_blocks``. Both dicts are built on access from compact tuples, so a
    router that only reads ``best`` never pays for them.
    """

    engine: str
    dp_rank: int
    tier_items: tuple  # ((tier name, blocks), ...)
    group_items: tuple  # ((group name, ((tier name, blocks), ...), total_blocks), ...)
    total_blocks: int
    total_tokens: int
    score: float
    stale: bool
    stale_reason: str | None
    last_seq: int | None
    last_event_age_s: float | None

    @property
    def tiers(self) -> dict:
        return {name: b for name, b in self.tier_items if b}

    @property
    def groups(self) -> dict:
        out = {}
        for name, tiers, total in self.group_items:
            d = {t: b for t, b in tiers if b}
            d["total_blocks"] = total
            out[name] = d
        return out

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "dp_rank": self.dp_rank,
            "tiers": self.tiers,
            "groups": self.groups,
            "total_blocks": self.total_blocks,
            "total_tokens": self.total_tokens,
            "score": self.score,
            "stale": self.stale,
            "stale_reason": self.stale_reason,
            "last_seq": self.last_seq,
            "last_event_age_s": self.last_event_age_s,
        }


class MatchResult(NamedTuple):
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
