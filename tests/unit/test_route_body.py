"""R-Q-3: the ``POST /v1/route`` body the compiled core writes (``route_body``: the ranked
entries straight from the ranking, no struct per worker) is byte for byte msgspec's
encoding of the pure-Python answer, over fleets of 1, 8 and 256 workers and every kind of
value an entry holds: cached and CPU tiers, stale workers, the caller's load (ints and a
float), in-flight load and predictions, links never or not connected, candidates the
index does not know, fractional costs, LoRA and salted prompts, rotated ties. Where the
writer cannot be exact (a string JSON escapes) it declines and msgspec writes the same.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import msgspec
import pytest

import indexer.query.route as route_mod
from evkit import FakeClock, apply, chunks, store, toks
from indexer import PrefixIndex
from indexer._native import core
from indexer.query.route import Load, RouteBody

BS = 4
ENC = msgspec.json.Encoder()
PROMPT = toks(1000, 8, BS)
LORA_PROMPT = toks(3000, 6, BS)


def fleet(n: int, engines: list[str] | None = None) -> PrefixIndex:
    """``n`` workers (two ranks per engine past 8) holding prefixes of PROMPT of a few
    lengths (ties on cost and score), some with CPU chunks, some stale, some a LoRA's."""
    idx = PrefixIndex(clock=FakeClock(1000.0))
    names = engines or [f"w{i}" for i in range((n + 1) // 2 if n > 8 else n)]
    workers = [(e, r) for r in range(2 if n > 8 else 1) for e in names][:n]
    for i, (e, r) in enumerate(workers):
        idx.register_worker(e, r)
        held = (0, 3, 8, 8, 5)[i % 5]
        evs = [store(PROMPT, BS, 0, held)] if held else []
        if i % 7 == 3:
            evs += chunks(PROMPT, BS, 2, first=held + held % 2)
        if i % 4 == 1:
            evs.append(store(LORA_PROMPT, BS, 0, 4, lora_name="ad"))
        if evs:
            apply(idx, evs, engine=e, dp_rank=r, seq=1)
        if i % 6 == 5:
            idx.mark_stale(e, r)
    return idx


def asks(idx: PrefixIndex) -> list[dict[str, Any]]:
    """What a route may be asked with, for this fleet."""
    ws = [(w["engine"], w["dp_rank"]) for w in idx.workers()]
    rng = random.Random(len(ws))
    half = ws[: max(1, len(ws) // 2)]
    load = {f"{e}/{r}": Load(rng.randrange(40), rng.randrange(4)) for e, r in half}
    load[f"{ws[-1][0]}"] = Load(9, 2.5)  # an engine's load, a float decode term
    link = {w: (rng.random() < 0.5, rng.random() < 0.7) for w in ws[::2]}
    cands = [f"{e}/{r}" for e, r in ws[::3]] + ["zz/3", ws[0][0]]
    return [
        {}, {"load": load}, {"link": link}, {"candidates": cands}, {"prefill_load_scale": 0.5},
        {"prefill_load_scale": 1.3, "load": load, "link": link}, {"lora_name": "ad"}, {"cache_salt": "s"},
        {"tokens": PROMPT[: 3 * BS]}, {"tokens": toks(9000, 4, BS)},
    ]


def same_body(idx: PrefixIndex, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> RouteBody:
    kw = dict(kw)
    tokens = kw.pop("tokens", LORA_PROMPT if "lora_name" in kw else PROMPT)
    got = idx.route_body(tokens, record=False, **kw)
    compiled = idx.route_response(tokens, record=False, **kw)
    with monkeypatch.context() as m:  # the pure-Python ranking: the reference
        m.setattr(route_mod, "_core", None)
        want = idx.route_response(tokens, record=False, **kw)
        pure = idx.route_body(tokens, record=False, **kw)
    assert got.body == ENC.encode(want) == ENC.encode(compiled) == pure.body
    assert got.ranked == want.ranked[:2] == pure.ranked
    assert (got.model, got.reason, got.tiers, got.request_id) == (want.model, want.reason, want.tiers, None)
    return got


@pytest.mark.parametrize("n", [1, 8, 256])
def test_R_Q_3_the_core_writes_msgspecs_bytes_for_the_pure_answer(n, monkeypatch):
    idx = fleet(n)
    for kw in asks(idx):
        same_body(idx, kw, monkeypatch)
    # In flight: routes recorded with decode tokens (load on the workers chosen, predicted
    # blocks beyond what they announced), then engine reports (load from other routers).
    for i in range(min(n, 12)):
        idx.route(PROMPT[: (2 + i % 6) * BS], max_tokens=7 * i)
    w = idx.workers()[0]
    idx.correct_load((w["engine"], w["dp_rank"]), 3.0, 2.0, 1000.0)
    for kw in asks(idx):
        same_body(idx, kw, monkeypatch)
    idx.set_tie_slot(1, 3)  # ties rotated for router replica 1 of 3
    for kw in asks(idx):
        same_body(idx, kw, monkeypatch)


def test_R_Q_3_a_recorded_route_body_is_the_same_answer(monkeypatch):
    idx, ref = fleet(8), fleet(8)
    for i in range(6):
        got = idx.route_body(PROMPT[: (3 + i) * BS], max_tokens=5)
        with monkeypatch.context() as m:
            m.setattr(route_mod, "_core", None)
            want = ref.route_response(PROMPT[: (3 + i) * BS], max_tokens=5)
        assert got.request_id is not None and want.request_id is not None
        assert got.body == ENC.encode(msgspec.structs.replace(want, request_id=got.request_id))


@pytest.mark.parametrize("engines", [["é", "a"], ['q"x', "a"], ["a\\b", "c"], ["tab\there", "c"]])
def test_a_name_json_escapes_is_written_by_msgspec(engines, monkeypatch):
    idx = fleet(4, engines)
    for kw in ({}, {"load": {f"{engines[1]}/0": Load(5, 1)}}, {"link": {(engines[0], 0): (False, True)}}):
        same_body(idx, kw, monkeypatch)


@pytest.mark.skipif(core is None, reason="no compiled core")
def test_the_compiled_rank_writes_what_its_python_twin_encodes():
    idx = fleet(8)
    res = idx.match(PROMPT)
    cands = [(w["engine"], w["dp_rank"], w["engine"] == "w1") for w in idx.workers()]
    for over in ({}, {"keep": 0}, {"keep": 100}, {"entry_cls": None, "load_cls": None}):
        kw = {"keep": 2, "entry_cls": route_mod.RankedOut, "load_cls": route_mod.LoadOut, **over}
        args = [cands, res.workers, None, {"w2/0": (9, 1)}, set(), {("w3", 0): (4, 0)},
                {("w4", 0): (False, True)}, res.query_blocks, BS, 0.75, "index", kw["entry_cls"], kw["load_cls"],
                0, 1, kw["keep"]]
        got, want = core.rank(*args), route_mod._py_rank(*args)
        assert got is not None
        assert got[0] == want[0] and got[1:3] == want[1:3]
        assert got[3] == want[3] and len(got[3]) == min(kw["keep"], len(cands))


@pytest.mark.skipif(core is None, reason="no compiled core")
def test_the_writers_floats_are_msgspecs():
    rng = random.Random(7)
    edges = [0.0, -0.0, 1.0, 0.1, 1e16, 1e15, 2.0**53, 2.0**53 + 2, 1e-5, 1e-4, 1.5e-7, 123456789012345.6,
             5e-324, 1.7976931348623157e308, float("inf"), -float("inf"), 1e22, 4503599627370497.0]
    bits = (struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(200_000))
    near = (rng.randrange(-10**6, 10**6) / 2 ** rng.randrange(0, 30) for _ in range(100_000))
    for v in (*edges, *bits, *near):
        if v == v:  # NaN: never a cost or score (the ranking declines it)
            assert core.json_double(v) == msgspec.json.encode(v), v
