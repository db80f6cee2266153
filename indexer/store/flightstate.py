"""The in-flight view (:class:`~.inflight.InFlight`) as plain data and back, exactly:
what a recording's segment starts from besides the snapshot (which leaves in-flight
state out, R-DUR-1), so a replay from that segment routes as the recorded index did.

Everything a later answer can depend on is kept: each open request with its deadlines
and origin, the deadline heap's order, the learned prefill rates, the engines' reports,
the running means, the ids of ended requests, the id counter and the origin (request ids
replay as they were). What is derived (per-worker totals, the prediction tries) is
rebuilt from the requests in their order.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any

from indexer.store.flight import FlightRequest
from indexer.store.inflight import InFlight

__all__ = ["dump_flight", "load_flight"]


def dump_flight(inf: InFlight) -> dict[str, Any]:
    """``inf``'s state as msgpack-able data (the caller holds the index lock). Changes nothing."""
    reqs = [[r.id, r.model, r.worker[0], r.worker[1], r.keys.tobytes(), r.prefill_tokens, r.decode_blocks, r.t,
             r.expiry, r.prefill_open, r.decode_open, r.origin] for r in inf.requests.values()]
    heap = [[d, n, p, r.id] for d, n, p, r in inf._heap
            if (r.prefill_open if p else inf.requests.get(r.id) is r)]
    return {
        "origin": inf.origin, "n": inf._n, "n_heap": inf._n_heap, "requests": reqs, "heap": heap,
        "engine_extra": [[w[0], w[1], a, b, t] for w, (a, b, t) in inf.engine_extra.items()],
        "engine_max_age_s": inf.engine_max_age_s,
        "rate": [[w[0], w[1], v] for w, v in inf.rate.items()],
        "last_announce": [[w[0], w[1], v] for w, v in inf.last_announce.items()],
        "pace": [[o, t, g] for o, (t, g) in inf.peer_pace.items()],
        "ended": list(inf._ended), "mean": [inf._mean_prefill, inf._mean_decode], "counters": dict(inf.counters),
    }


def load_flight(inf: InFlight, d: dict[str, Any]) -> None:
    """Make ``inf`` (empty, of an index nobody else uses yet) hold the state ``d``."""
    inf.origin = d["origin"]
    inf._prefix = inf.origin + "-"
    inf._n = d["n"]
    inf._n_heap = d["n_heap"]
    by_id: dict[str, FlightRequest] = {}
    for rid, model, engine, rank, keys, pre, dec, t, expiry, p_open, d_open, origin in d["requests"]:
        arr = array("Q")
        arr.frombytes(keys)
        r = FlightRequest(rid, model, (engine, rank), arr, pre, dec, t, expiry, p_open)
        r.decode_open = d_open
        r.origin = origin
        by_id[rid] = r
        inf.requests[rid] = r
        inf.by_worker.setdefault(r.worker, {})[rid] = r
        if origin:
            inf.by_origin.setdefault(origin, {})[rid] = r
        if p_open:
            inf._mark(r)
            inf._queue(r)
            inf.prefill[r.worker] = inf.prefill.get(r.worker, 0) + pre
        if d_open:
            inf.decode[r.worker] = inf.decode.get(r.worker, 0) + dec
    inf._heap = [(dl, n, p, by_id[rid]) for dl, n, p, rid in d["heap"]]
    heapq.heapify(inf._heap)
    inf.engine_extra = {(e, r): (a, b, t) for e, r, a, b, t in d["engine_extra"]}
    inf.engine_max_age_s = d["engine_max_age_s"]
    inf.rate = {(e, r): v for e, r, v in d["rate"]}
    inf.last_announce = {(e, r): v for e, r, v in d["last_announce"]}
    inf.peer_pace = {o: (t, g) for o, t, g in d.get("pace", ())}  # a recording before it: none
    inf._ended = dict.fromkeys(d["ended"])
    inf._mean_prefill, inf._mean_decode = d["mean"]
    inf.counters.update(d["counters"])
