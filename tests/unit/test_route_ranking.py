"""R-Q-3, R-Q-6, R-Q-7: the route's ranking (compiled ``rank``, its Python twin, the
struct answer and the service's JSON body written by the core) held to a straightforward
reference over randomized fleets.

The reference is the ranking as first written: one loop over the candidates asking the
in-flight estimate of each, one sort of whole tuples, the answer's dicts built at the
end. It shares no code with :mod:`indexer.query.route` beyond ``parse_worker``. Two
indexes get the same events, the same clock and the same decisions; one answers with
``PrefixIndex.route`` / ``route_response``, the other with the reference, and every
answer (and its JSON) must be the same. The body the core writes (``route_body``) is
also held byte for byte to msgspec's encoding of the pure-Python answer over fleets of 1,
8 and 256 workers with every kind of value an entry can hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import indexer.query.route as route_mod
from evkit import FakeClock, apply, chunks, store, toks
from indexer import PrefixIndex
from indexer._native import core
from indexer.query.route import Load, LoadOut, RankedOut, RouteBody
from indexer.wire.engines import parse_worker

BS = 4
ENC = msgspec.json.Encoder()


def reference_route(res: Any, known: Iterable[tuple[str, int, bool]], *, load: Mapping[str, Any] | None = None,
                    candidates: Iterable[str] | None = None, prefill_load_scale: float = 1.0,
                    link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None,
                    in_flight: Callable[[tuple[str, int]], tuple[int, int]] | None = None,
                    index_load: bool = False) -> dict[str, Any]:
    load = load or {}
    known = list(known)
    bad = []
    for k in load:
        try:
            parse_worker(k)
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
        if pred is not None and key in pred:
            pblocks = pred[key][0]
            score += pred[key][1]
        name = f"{engine}/{rank}"
        ld = (0, 0, "index" if in_flight is not None or index_load else "none")
        got = load.get(name)
        if got is not None:
            used.add(name)
        else:
            got = load.get(engine)
            if got is not None:
                used.add(engine)
        if got is not None:
            ld = (got[0], got[1], "caller")
        elif in_flight is not None:
            f = in_flight(key)
            if f[0] or f[1]:
                ld = (f[0], f[1], "index")
        prefill = -(-ld[0] // bs) if bs else 0
        cost = prefill_load_scale * max(prefill + res.query_blocks - score, 0.0) + ld[1]
        lk = link.get(key) if link is not None else None
        connected = lk[0] if lk is not None else (None if link is not None else True)
        never = lk is not None and not lk[1]
        ranked.append((never, cost, -score, engine, rank, name, wm, stale.get(key, False), connected, pblocks, ld))
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
        "model": res.model, "worker": best[5], "engine": best[3], "dp_rank": best[4], "score": -best[2] + 0.0,
        "cost": best[1], "reason": reason, "tiers": best[6].tiers if best[6] is not None else {},
        "ranked": [
            {"worker": name, "engine": e, "dp_rank": r, "score": -ns + 0.0,
             "cached_blocks": wm.total_blocks if wm is not None else 0, "predicted_blocks": pb, "cost": cost,
             "stale": st_, "connected": conn,
             "load": {"prefill_tokens": ld[0], "decode_blocks": ld[1], "source": ld[2]}}
            for _, cost, ns, e, r, name, wm, st_, conn, pb, ld in ranked
        ],
        "unused_load": sorted(set(load) - used),
    }


def reference_index_route(idx: PrefixIndex, tokens: list[int], *, load: Any = None, candidates: Any = None,
                          prefill_load_scale: float = 1.0, record: bool = True, max_tokens: int | None = None,
                          link: Any = None) -> dict[str, Any]:
    """``PrefixIndex.route`` as first written, over the reference ranking."""
    res, keys_for, ntok = idx._match_tokens(tokens, "default", None, None)
    if res.block_size is None:
        dbs = idx.default_block_size
        res = res._replace(block_size=dbs, query_blocks=ntok // dbs)
    known = idx.model_workers(res.model)
    inf = idx.inflight
    inf.expire(idx._clock())
    busy = inf.prefill or inf.decode or inf.engine_extra
    out = reference_route(res, known, load=load, candidates=candidates, prefill_load_scale=prefill_load_scale,
                          link=link, in_flight=inf.load if busy else None, index_load=True)
    rid = None
    bs = res.block_size
    if record:
        top = out["ranked"][0]
        held = (top["cached_blocks"] + top["predicted_blocks"]) * bs
        decode = -(-(ntok + max_tokens) // bs) if max_tokens else 0
        rid = inf.record(res.model, (out["engine"], out["dp_rank"]), chain.from_iterable(keys_for(bs)), ntok - held,
                         decode, predict=top["cached_blocks"] < ntok // bs)
    out["request_id"] = rid
    return out


def same_rid(a: str | None, b: str | None) -> bool:
    """Request ids of two indexes: the same count after each one's random prefix."""
    return (a is None and b is None) or (a is not None and b is not None and a.split("-")[1] == b.split("-")[1])


ENGINES = ["a", "b", "aa", "ab", "b1", "w10", "w9", "z"]
PROMPT = toks(1000, 8, BS)


@st.composite
def fleets(draw: Any) -> dict[str, Any]:
    workers = draw(st.lists(st.tuples(st.sampled_from(ENGINES), st.integers(0, 2)), min_size=1, max_size=10,
                            unique=True))
    held = {w: draw(st.tuples(st.integers(0, 8), st.booleans())) for w in workers}
    stale = draw(st.sets(st.sampled_from(workers)))
    # Removed workers leave holes in the model's rows (the table a route reads).
    dropped = draw(st.sets(st.sampled_from(workers), max_size=len(workers) - 1))
    return {"workers": [w for w in workers if w not in dropped], "held": held, "stale": stale - dropped,
            "dropped": dropped, "all": workers}


def names_of(workers: list[tuple[str, int]]) -> list[str]:
    return [f"{e}/{r}" for e, r in workers] + sorted({e for e, _ in workers}) + ["zz/3", "zz", "a/1"]


@st.composite
def asks(draw: Any, workers: list[tuple[str, int]]) -> dict[str, Any]:
    names = names_of(workers)
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["candidates"] = draw(st.lists(st.sampled_from(names), min_size=1, max_size=6))
    if draw(st.booleans()):
        kw["load"] = draw(st.dictionaries(st.sampled_from(names), st.builds(
            Load, st.integers(0, 6 * BS), st.integers(0, 3)), max_size=6))
    if draw(st.booleans()):
        kw["link"] = draw(st.dictionaries(st.sampled_from(workers), st.tuples(st.booleans(), st.booleans())))
    kw["prefill_load_scale"] = draw(st.sampled_from([1.0, 0.0, 0.5, 2.0, 1]))
    kw["max_tokens"] = draw(st.sampled_from([None, 0, 7, 40]))
    kw["record"] = draw(st.booleans())
    n = draw(st.integers(1, 10))
    kw["tokens"] = draw(st.sampled_from([PROMPT[: n * BS], toks(5000, n, BS), PROMPT[: 3 * BS] + toks(7000, 4, BS)]))
    return kw


def build(fleet: dict[str, Any], clock: FakeClock) -> PrefixIndex:
    idx = PrefixIndex(clock=clock)
    for e, r in fleet["all"]:
        n, cpu = fleet["held"][(e, r)]
        idx.register_worker(e, r)
        evs = [store(PROMPT, BS, 0, n)] if n else []
        if cpu and n < 8:
            evs += chunks(PROMPT, BS, 2, first=n + n % 2)
        if evs:
            apply(idx, evs, engine=e, dp_rank=r)
    for e, r in fleet["stale"]:
        idx.mark_stale(e, r)
    for e, r in fleet["dropped"]:
        idx.drop_worker(e, r)
    return idx


def check(got: Any, want: dict[str, Any]) -> None:
    if isinstance(got, RouteBody):  # the service's body, written by the core
        assert same_rid(got.request_id, want["request_id"])
        assert got.body == ENC.encode(dict(want, request_id=got.request_id))
        assert [msgspec.to_builtins(r) for r in got.ranked] == want["ranked"][:2]
        assert (got.model, got.reason, got.tiers) == (want["model"], want["reason"], want["tiers"])
        return
    if not isinstance(got, dict):  # structs: the bytes the service sent before route_body
        assert same_rid(got.request_id, want["request_id"])
        assert ENC.encode(msgspec.structs.replace(got, request_id=want["request_id"])) == ENC.encode(want)
        got = msgspec.to_builtins(got)
        got["request_id"] = want["request_id"]
    else:
        assert same_rid(got["request_id"], want["request_id"])
        got = dict(got, request_id=want["request_id"])
    assert got == want
    assert ENC.encode(got) == ENC.encode(want)
    # Same types too (an int where the reference has a float would encode differently).
    assert [(type(a["score"]), type(a["cost"])) for a in got["ranked"]] == [(float, float)] * len(want["ranked"])


@pytest.mark.parametrize("compiled", [True, False] if core is not None else [False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_R_Q_3_R_Q_7_route_matches_the_reference_over_random_fleets(compiled, data, monkeypatch):
    if not compiled:
        monkeypatch.setattr(route_mod, "_core", None)
    fleet = data.draw(fleets())
    clock = FakeClock(1000.0)
    new, ref = build(fleet, clock), build(fleet, clock)
    for step in range(data.draw(st.integers(1, 6))):
        kw = data.draw(asks(fleet["workers"]))
        tokens = kw.pop("tokens")
        try:
            want = reference_index_route(ref, tokens, **kw)
        except (ValueError, LookupError) as e:
            with pytest.raises(type(e), match=None) as got_e:
                new.route(tokens, **kw)
            assert str(got_e.value) == str(e)
            continue
        form = data.draw(st.sampled_from([new.route, new.route_response, new.route_body]))
        got = form(tokens, **kw)
        check(got, want)
        if data.draw(st.booleans()):  # in-flight load other routers add (the engine's report)
            w = data.draw(st.sampled_from(fleet["workers"]))
            waiting, running = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
            new.correct_load(w, waiting, running, clock.t)
            ref.correct_load(w, waiting, running, clock.t)
        if data.draw(st.booleans()):  # an announcement ends a prediction; time passes
            e, r = data.draw(st.sampled_from(fleet["workers"]))
            for ix in (new, ref):
                apply(ix, [store(PROMPT, BS, 0, 8)], engine=e, dp_rank=r, seq=100 + step)
        clock.t += data.draw(st.sampled_from([0.0, 1.0, 31.0]))


def py_rank_args(**over: Any) -> list[Any]:
    res = over.pop("res")
    args: dict[str, Any] = {
        "cands": [("a", 0, False), ("é", 1, True), ("b", 0, False)], "workers": res.workers, "pred": None,
        "load": None, "used": set(), "in_flight": None, "link": None, "qb": res.query_blocks, "bs": BS,
        "scale": 1.0, "idle": "index", "entry_cls": None, "load_cls": None, "slot": 0, "of": 1, "keep": None,
    }
    args.update(over)
    return list(args.values())


@pytest.mark.skipif(core is None, reason="no compiled core")
@pytest.mark.parametrize("over", [
    {},
    {"entry_cls": RankedOut, "load_cls": LoadOut},
    {"scale": -1.5},
    {"bs": 0},
    {"load": {"a/0": None, "a": (3, 1), "é/1": (5, 2)}},
    {"link": {("a", 0): None, ("b", 0): (False, False)}},
    {"in_flight": {("b", 0): (0, 0), ("a", 0): (9, 0)}},
    {"pred": {("b", 0): (2, 2.0)}},
    {"load": {"a/0": (2.5, 0)}},        # a float prefill: declined, Python ranks it
    {"load": {"a/0": (0, 2**60)}},      # beyond a double's exact ints: declined
    {"scale": math.nan},                # NaN costs: declined
])
def test_the_compiled_rank_is_its_python_twin_or_declines(over):
    idx = PrefixIndex()
    apply(idx, [store(PROMPT, BS, 0, 5)], engine="a")
    apply(idx, [store(PROMPT, BS, 0, 3)], engine="é", dp_rank=1)
    res = idx.match(PROMPT)
    c_args, py_args = py_rank_args(res=res, **over), py_rank_args(res=res, **over)
    got = core.rank(*c_args)
    want = route_mod._py_rank(*py_args)
    declined = any(isinstance(v, tuple) and (isinstance(v[0], float) or v[1] == 2**60)
                   for v in (over.get("load") or {}).values() if v) or math.isnan(over.get("scale", 0.0))
    if declined:
        assert got is None
        return
    assert got is not None
    assert ENC.encode(got[0]) == ENC.encode(want[0]) and got[0] == want[0]
    assert got[1:] == want[1:] and c_args[4] == py_args[4]  # top score, best match, load keys used
