"""Best replica for a request: a match answer combined with per-worker load (R-Q-3).

Read-only over a :class:`~indexer.query.answers.MatchResult`; used by ``PrefixIndex.route``,
the service's ``POST /v1/route`` and the fleet simulator's index policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from indexer.query.answers import MatchResult
from indexer.wire.engines import parse_worker

__all__ = ["Load", "route"]


class Load(NamedTuple):
    """What a worker is busy with: prefill tokens queued or running, decode blocks held."""

    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0


def route(
    res: MatchResult,
    known: Iterable[tuple[str, int, bool]],
    *,
    load: Mapping[str, Load] | None = None,
    candidates: Iterable[str] | None = None,
    prefill_load_scale: float = 1.0,
    link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None,
    in_flight: Callable[[tuple[str, int]], tuple[int, int]] | None = None,
    index_load: bool = False,
) -> dict[str, Any]:
    """Rank the candidates by cost, lowest first; the ``/v1/route`` body.

    ``known`` is ``(engine, dp_rank, stale)`` of the model's workers
    (``PrefixIndex.model_workers``); ``candidates`` restricts them (``"engine/rank"``,
    or ``"engine"`` for all its known ranks; an unknown one is ranked with nothing
    cached); ``load`` is keyed ``"engine/rank"`` or ``"engine"``; ``link`` is the
    transport's ``(connected now, ever connected)`` per worker (None: all connected);
    ``in_flight`` gives the index's own ``(prefill tokens, decode blocks)`` estimate of
    a worker, used where ``load`` names none (a caller's load replaces it); ``index_load``
    says the index estimates load even when ``in_flight`` is None (it has nothing in
    flight: every worker's estimate is 0). For each candidate:

        score = credit-weighted announced prefix (stale already discounted)
                + the score of the predicted blocks beyond it (``res.predicted``)
        cost = prefill_load_scale * max(queued prefill blocks + prompt blocks - score, 0)
               + decode blocks

    A worker that never connected ranks after every other one, whatever its cost; then
    ties go to the higher score, then engine id, then rank. Load keys that name no
    candidate are listed in ``unused_load``.

    Raises
    ------
    ValueError
        When a candidate or load key is malformed (not ``ENGINE`` or ``ENGINE/RANK``
        with an engine id and ASCII rank digits); the message names every bad key.
    LookupError
        When there is no candidate at all.
    """
    load = load or {}
    known = list(known)
    bad = []
    load_workers: dict[str, tuple[str, int | None]] = {}
    for k in load:
        try:
            load_workers[k] = parse_worker(k)
        except ValueError:
            bad.append(k)
    by_key = {(w.engine, w.dp_rank): w for w in res.workers}
    if candidates is None:
        cands = [(e, r) for e, r, _ in known]
    else:
        ranks: dict[str, list[int]] = {}
        for e, r, _ in known:
            ranks.setdefault(e, []).append(r)
        cands = []
        for c in candidates:
            try:
                engine, rank = parse_worker(c)
            except ValueError:
                bad.append(c)
                continue
            if rank is not None:
                cands.append((engine, rank))
            else:
                cands.extend((engine, r) for r in ranks.get(engine, [0]))
        cands = sorted(set(cands))
    if bad:
        raise ValueError("malformed worker name(s) in candidates or load: "
                         f"{', '.join(repr(b) for b in bad)} (expected ENGINE or ENGINE/RANK, RANK in ASCII digits)")
    if not cands:
        raise LookupError(f"no workers to route to for model {res.model!r}")
    bs = res.block_size or 0
    stale = {(e, r): s for e, r, s in known}
    pred = {(e, r): (n, s) for e, r, n, s in res.predicted} if res.predicted else None
    used: set[str] = set()
    ranked = []
    qb = res.query_blocks
    idle = (0, 0, "index" if in_flight is not None or index_load else "none")
    for engine, rank in cands:
        key = (engine, rank)
        wm = by_key.get(key)
        score = -wm[0] + 0.0 if wm is not None else 0.0  # (WorkerMatch.score, without the call)
        pblocks = 0
        if pred is not None:
            p = pred.get(key)
            if p is not None:
                pblocks = p[0]
                score += p[1]
        name = f"{engine}/{rank}"
        ld: tuple[int, int, str] = idle
        if load:
            got = load.get(name)
            if got is not None:
                used.add(name)
            else:
                got = load.get(engine)
                if got is not None:
                    used.add(engine)
            if got is not None:
                ld = (got[0], got[1], "caller")
        if ld is idle and in_flight is not None:
            f = in_flight(key)
            if f[0] or f[1]:
                ld = (f[0], f[1], "index")
        prefill = -(-ld[0] // bs) if bs else 0
        cost = prefill_load_scale * max(prefill + qb - score, 0.0) + ld[1]
        lk = link.get(key) if link is not None else None
        connected = lk[0] if lk is not None else (None if link is not None else True)
        ranked.append((lk is not None and not lk[1], cost, -score, engine, rank, name, wm, stale.get(key, False),
                       connected, pblocks, ld))
    ranked.sort()  # (never connected, cost, -score, engine, rank) decide: (engine, rank) is unique
    best = ranked[0]
    top_score = max(-t[2] for t in ranked)
    if top_score <= 0:
        reason = "no_cached_prefix_least_loaded"
    elif -best[2] >= top_score:
        reason = "longest_cached_prefix"
    else:
        reason = "load_outweighs_cached_prefix"
    return {
        "model": res.model,
        "worker": best[5],
        "engine": best[3],
        "dp_rank": best[4],
        "score": -best[2] + 0.0,
        "cost": best[1],
        "reason": reason,
        # The chosen worker's announced blocks per tier (as /v1/match's "tiers"): the
        # cached part of the cost split (one small dict: the tiers the worker holds).
        "tiers": best[6].tiers if best[6] is not None else {},
        "ranked": [
            {"worker": name, "engine": e, "dp_rank": r, "score": -ns + 0.0,
             "cached_blocks": wm.total_blocks if wm is not None else 0, "predicted_blocks": pb, "cost": cost,
             "stale": st, "connected": conn,
             "load": {"prefill_tokens": ld[0], "decode_blocks": ld[1], "source": ld[2]}}
            for _, cost, ns, e, r, name, wm, st, conn, pb, ld in ranked
        ],
        "unused_load": sorted(set(load) - used),
    }
