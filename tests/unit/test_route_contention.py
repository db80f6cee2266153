"""R-SYNC-8: router replicas that route in the same instant cannot see each other's
decisions. While the replicas ranked before one route at the pace of its blindness
window, its routes without load weigh the decisions those replicas are likely taking
unseen, so the replicas of a burst take the workers one router would have taken, in
slot order. Quiet replicas weigh nothing; alone, a replica routes as it always did.

Also here: a peer's decision that reaches a replica after its engine announced the
prompt is not held as load, and a peer's request queues in routing order.
"""

from __future__ import annotations

from array import array

import pytest

from evkit import FakeClock, apply, store, toks
from indexer import PrefixIndex
from indexer.store.flightstate import dump_flight, load_flight
from indexer.store.peerflight import PeerEntry
from indexer.wire.keys import block_keys

BS = 16
ENGINES = ("e0", "e1", "e2", "e3")
QUEUED = {"e0": 0, "e1": 2, "e2": 4, "e3": 6}  # blocks another, quiet replica routed to each
WINDOW = 0.005


def entry(rid: str, engine: str, prompt: list[int] | None, age: float) -> PeerEntry:
    """A peer's decision as route sync carries it: ``prompt`` None for one whose engine
    has announced it already (nothing open: only its time is news)."""
    if prompt is None:
        return PeerEntry(rid, "default", engine, 0, array("Q"), 0, 0, False, False, age)
    return PeerEntry(rid, "default", engine, 0, array("Q", block_keys(prompt, BS)), len(prompt), 0, True, False,
                     age)


def replica(origin: str, clock: FakeClock, heard: list[str], window: float = WINDOW) -> PrefixIndex:
    """A replica named ``origin`` over engines e0..e3 that has heard: the queued load of
    replica ``r9`` (QUEUED; ranked after every replica here, routing nothing now) and,
    from each replica in ``heard``, two decisions 4 and 2 ms ago, announced since."""
    idx = PrefixIndex(clock=clock, contention_window_s=window)
    idx.inflight.origin, idx.inflight._prefix = origin, origin + "-"
    for e in ENGINES:
        idx.register_worker(e, 0)
    background = [entry(f"r9-{i}", e, toks(50_000 + 1000 * i, n, BS), 1.0)
                  for i, (e, n) in enumerate(QUEUED.items()) if n]
    assert idx.adopt_peer("r9", background) == len(background)
    for o in heard:
        idx.adopt_peer(o, [entry(f"{o}-1", "e3", None, 0.004), entry(f"{o}-2", "e3", None, 0.002)])
    return idx


def one_router(n: int, prompt_blocks: int) -> list[str]:
    """Where one router that sees every decision sends ``n`` unrelated prompts of
    ``prompt_blocks`` blocks, nothing cached anywhere: each to the least queued engine
    (queue + the prompt, first in name order on a tie), whose queue then grows by it."""
    q = dict(QUEUED)
    out = []
    for _ in range(n):
        best = min(sorted(q), key=lambda e: q[e] + prompt_blocks)
        out.append(best)
        q[best] += prompt_blocks
    return out


PROMPTS = [toks(1000 * (i + 1), 8, BS) for i in range(3)]  # unrelated, 8 blocks each


def test_R_SYNC_8_three_replicas_routing_in_the_same_instant_take_the_workers_one_router_would():
    clock = FakeClock(1000.0)
    reps = [replica("r0", clock, []), replica("r1", clock, ["r0"]), replica("r2", clock, ["r0", "r1"])]
    # The same instant: each routes its own prompt without seeing the others' decisions.
    got = [r.route(p)["engine"] for r, p in zip(reps, PROMPTS)]
    assert got == one_router(3, 8) == ["e0", "e1", "e2"]
    # The first replica weighed nothing; the later ones each ranked once more.
    assert [r.inflight.counters["spread"] for r in reps] == [0, 1, 1]
    # The weighed decisions show as load where they were placed. r2 asking again (its own
    # decision queued on e2) weighs one request like this one on e0, then one on e1, and
    # takes e3, as one router's fourth decision would.
    again = reps[2].route(toks(5000, 8, BS), record=False)
    ranked = {e["worker"]: e["load"]["prefill_tokens"] for e in again["ranked"]}
    assert again["worker"] == "e3/0" == one_router(4, 8)[3] + "/0"
    assert ranked == {"e0/0": 8 * BS, "e1/0": (2 + 8) * BS, "e2/0": (4 + 8) * BS, "e3/0": 6 * BS}


def test_R_SYNC_8_without_the_window_the_same_replicas_herd_onto_one_worker():
    clock = FakeClock(1000.0)
    reps = [replica("r0", clock, [], 0.0), replica("r1", clock, ["r0"], 0.0), replica("r2", clock, ["r0", "r1"], 0.0)]
    assert [r.route(p)["engine"] for r, p in zip(reps, PROMPTS)] == ["e0", "e0", "e0"]


def test_R_SYNC_8_replicas_that_went_quiet_weigh_nothing():
    clock = FakeClock(1000.0)
    reps = [replica("r0", clock, []), replica("r1", clock, ["r0"]), replica("r2", clock, ["r0", "r1"])]
    clock.advance(0.5)  # their last decisions 0.5 s ago: ~1% of a request each, below the floor
    assert [r.route(p)["engine"] for r, p in zip(reps, PROMPTS)] == ["e0", "e0", "e0"]
    assert [r.inflight.unseen(clock()) for r in reps] == [[], [], []]


def test_R_SYNC_8_the_weight_is_the_window_over_the_peers_pace():
    clock = FakeClock(1000.0)
    idx = replica("r2", clock, ["r0", "r1"])
    assert idx.inflight.unseen(clock()) == [1.0, 1.0]  # 2 ms apart, the last 2 ms ago: within 5 ms
    clock.advance(0.018)  # the last decisions now 20 ms ago
    assert idx.inflight.unseen(clock()) == pytest.approx([0.25, 0.25])
    # A replica ranked after this one is never weighed: it weighs this one's decisions.
    assert replica("r0", clock, ["r1"]).inflight.unseen(clock()) == []
    # A replica that leaves takes its pace with it.
    idx.drop_peer("r0")
    assert idx.inflight.unseen(clock()) == pytest.approx([0.25])


def test_R_SYNC_8_a_prompt_with_its_prefix_cached_still_goes_where_it_is_cached():
    """The weighed decisions add what a request like this one computes there: on the worker
    that holds this prompt, little; the cache still wins."""
    clock = FakeClock(1000.0)
    reps = [replica("r0", clock, []), replica("r1", clock, ["r0"]), replica("r2", clock, ["r0", "r1"])]
    p = toks(7000, 8, BS)
    for r in reps:
        apply(r, [store(p, BS, 0, 8)], engine="e2")
    assert [r.route(p, record=False)["engine"] for r in reps] == ["e2", "e2", "e2"]


def test_R_SYNC_8_the_pace_is_part_of_the_in_flight_state_a_recording_starts_from():
    clock = FakeClock(1000.0)
    idx = replica("r2", clock, ["r0", "r1"])
    other = PrefixIndex(clock=clock, contention_window_s=WINDOW)
    load_flight(other.inflight, dump_flight(idx.inflight))
    assert other.inflight.peer_pace == idx.inflight.peer_pace
    assert other.inflight.unseen(clock()) == idx.inflight.unseen(clock()) == [1.0, 1.0]
    assert PrefixIndex(**idx.options()).inflight.contention_window_s == WINDOW


def test_R_SYNC_2_a_decision_heard_after_its_engine_announced_it_is_not_held_as_load():
    clock = FakeClock(1000.0)
    idx = replica("r1", clock, [])
    p = toks(9000, 8, BS)
    apply(idx, [store(p, BS, 0, 8)], engine="e0")  # e0 announced the prompt ...
    assert idx.adopt_peer("r0", [entry("r0-7", "e0", p, 0.003)]) == 0  # ... before r0's decision arrived
    assert idx.held_by_origin() == {"r9": 3, "": 0}
    assert idx.inflight.counters["adopted_announced"] == 1
    other = idx.route(toks(20_000, 8, BS), record=False)
    assert other["worker"] == "e0/0" and other["ranked"][0]["load"]["prefill_tokens"] == 0


def test_R_SYNC_2_a_peers_request_queues_before_later_ones_of_this_replica():
    clock = FakeClock(1000.0)
    idx = replica("r1", clock, [], 0.0)
    mine = idx.route(toks(30_000, 8, BS), candidates=["e0/0"])["request_id"]
    idx.adopt_peer("r0", [entry("r0-3", "e0", toks(40_000, 4, BS), 0.010)])  # routed 10 ms ago
    assert [r.id for r in idx.inflight.pending[("e0", 0)]] == ["r0-3", mine]


def test_R_SYNC_8_a_recording_of_a_replica_weighing_its_peers_replays_to_the_same_answers(tmp_path):
    from indexer.ingest.record import Recorder
    from indexer.ingest.replay import describe, replay

    clock = FakeClock(1000.0)
    idx = replica("r2", clock, ["r0", "r1"])  # its pace and load go in the recording's base
    rec = Recorder(str(tmp_path))
    rec.attach(idx)
    answers = []
    for i in range(8):
        clock.advance(0.002)
        for o in ("r0", "r1"):  # the others keep deciding, 2 ms apart
            idx.adopt_peer(o, [entry(f"{o}-{10 + i}", "e3", None, 0.0)])
        answers.append(idx.route(toks(60_000 + 1000 * i, 8, BS))["worker"])
    clock.advance(0.5)  # quiet: weighs nothing
    answers.append(idx.route(toks(90_000, 8, BS))["worker"])
    rec.stop()
    assert idx.inflight.counters["spread"] >= 4  # weighing changed where these went
    assert rec.stats()["errors"] == {}
    rep = replay(str(tmp_path))
    assert rep.mismatch is None, describe(rep)
    assert rep.answers == len(answers) and rep.reproduced == rep.answers
    assert rep.index.inflight.peer_pace == idx.inflight.peer_pace
