"""Best replica for a request: a match answer combined with per-worker load (R-Q-3).

Read-only over a :class:`~indexer.result.MatchResult`; used by ``PrefixIndex.route``,
the service's ``POST /v1/route`` and the fleet simulator's index policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from .engines import parse_worker
from .result import MatchResult

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
) -> dict[str, Any]:
    """Rank the candidates by cost, lowest first; the ``/v1/route`` body.

    ``known`` is ``(engine, dp_rank, stale)`` of the model's workers
    (``PrefixIndex.model_workers``); ``candidates`` restricts them (``"engine/rank"``,
    or ``"engine"`` for all its known ranks; an unknown one is ranked with nothing
    cached); ``load`` is keyed ``"engine/rank"`` or ``"engine"``; ``link`` is the
    transport's ``(connected now, ever connected)`` per worker (None: all connected);
    ``in_flight`` gives the index's own ``(prefill tokens, decode blocks)`` estimate of
    a worker, used where ``load`` names none (a caller's load replaces it). For each
    candidate:

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
    for engine, rank in cands:
        key = (engine, rank)
        wm = by_key.get(key)
        score = wm.score if wm is not None else 0.0
        pblocks = 0
        if pred is not None:
            p = pred.get(key)
            if p is not None:
                pblocks = p[0]
                score += p[1]
        name = f"{engine}/{rank}"
        ld = load.get(name)
        if ld is not None:
            used.add(name)
            source = "caller"
        else:
            ld = load.get(engine)
            if ld is not None:
                used.add(engine)
                source = "caller"
            elif in_flight is not None:
                ld = Load(*in_flight(key))
                source = "index"
            else:
                source = "none"
        prefill = decode = 0
        if ld is not None:
            prefill = math.ceil(ld[0] / bs) if bs else 0
            decode = ld[1]
        cost = prefill_load_scale * max(prefill + res.query_blocks - score, 0.0) + decode
        lk = link.get(key) if link is not None else None
        connected = lk[0] if lk is not None else (None if link is not None else True)
        never = lk is not None and not lk[1]
        ranked.append((never, cost, -score, engine, rank, name, wm, stale.get(key, False), connected, pblocks,
                       (ld[0], ld[1], source) if ld is not None else (0, 0, source)))
    ranked.sort(key=lambda t: t[:5])
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
        "ranked": [
            {"worker": name, "engine": e, "dp_rank": r, "score": -ns + 0.0,
             "cached_blocks": wm.total_blocks if wm is not None else 0, "predicted_blocks": pb, "cost": cost,
             "stale": st, "connected": conn,
             "load": {"prefill_tokens": ld[0], "decode_blocks": ld[1], "source": ld[2]}}
            for _, cost, ns, e, r, name, wm, st, conn, pb, ld in ranked
        ],
        "unused_load": sorted(set(load) - used),
    }
