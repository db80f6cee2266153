"""Other router replicas' requests in one replica's in-flight view (R-SYNC-1, R-SYNC-2):
adopted like its own (predicted prefix, load, the same TTLs counted from when they were
routed), ended by their peer's word or by the same announcements, dropped with their
peer, and never told back to the listener."""

from __future__ import annotations

from array import array

import pytest

from evkit import FakeClock, apply, store, toks
from indexer import PrefixIndex
from indexer.producer.events import Cleared
from indexer.store.peerflight import PeerEntry
from indexer.wire.keys import block_keys

BS = 16


class Clock(FakeClock):
    def advance(self, s: float) -> None:
        self.t += s


class Told:
    """A listener that writes down what it is told."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def recorded(self, rid, model, worker, keys, prefill_tokens, decode_blocks, prefill_open):
        self.log.append(("recorded", rid, worker, len(keys), prefill_tokens, decode_blocks, prefill_open))

    def ended(self, rid, origin, why, whole):
        self.log.append(("ended", rid, origin, why, whole))

    def forgot(self, worker):
        self.log.append(("forgot", worker))


@pytest.fixture
def clock():
    return Clock(1000.0)


def fleet(clock, **kw) -> PrefixIndex:
    idx = PrefixIndex(clock=clock, **kw)
    for e in ("a", "b", "c"):
        idx.register_worker(e, 0)
    return idx


def entry(rid: str, prompt: list[int], engine: str, *, decode: int = 0, age: float = 0.0,
          prefill_open: bool = True) -> PeerEntry:
    """A peer's request as route sync carries it; its keys hashed here from the prompt with
    the key rule (vLLM's block hashing as the index applies it), not by the sender."""
    keys = array("Q", block_keys(prompt, BS) if prefill_open else [])
    return PeerEntry(rid, "default", engine, 0, keys, len(prompt), decode, prefill_open, decode > 0, age)


def test_R_SYNC_1_a_peers_request_weighs_in_this_replicas_route_like_its_own(clock):
    idx = fleet(clock)
    told = Told()
    idx.set_flight_listener(told)
    p = toks(100, 8, BS)
    assert idx.adopt_peer("peer1", [entry("peer1-1", p, "b")]) == 1
    # The same prompt now goes to b (predicted there, 8 blocks queued: cost 8 + 8 - 8 against 8
    # to compute elsewhere; the tie to the higher score), and b's load is the peer's request.
    r = idx.route(p, record=False)
    top = r["ranked"][0]
    assert (r["worker"], top["predicted_blocks"], top["cost"], top["load"]) == (
        "b/0", 8, 8.0, {"prefill_tokens": 8 * BS, "decode_blocks": 0, "source": "index"})
    # An unrelated prompt avoids b: its queue is the peer's 8 blocks.
    r = idx.route(toks(900, 8, BS), record=False)
    assert r["worker"] == "a/0" and r["ranked"][-1]["worker"] == "b/0" and r["ranked"][-1]["cost"] == 16.0
    # Decode blocks of a peer's request count as its load too.
    idx.adopt_peer("peer1", [entry("peer1-2", toks(3000, 4, BS), "c", decode=5)])
    r = idx.route(toks(900, 8, BS), record=False)
    assert [(e["worker"], e["cost"]) for e in r["ranked"]] == [("a/0", 8.0), ("b/0", 16.0), ("c/0", 4 + 8 + 5)]
    assert idx.held_by_origin() == {"peer1": 2, "": 0}
    # Nothing of the peer's was told to the listener: route sync never echoes.
    assert told.log == []
    # Our own decision is told, with its keys and load.
    mine = idx.route(toks(900, 8, BS), max_tokens=32)
    assert told.log == [("recorded", mine["request_id"], ("a", 0), 8, 8 * BS, -(-(8 * BS + 32) // BS), True)]
    assert [e.rid for e in idx.own_requests()] == [mine["request_id"]]


def test_R_SYNC_1_announcement_ends_a_peers_prefill_here_told_with_its_origin(clock):
    idx = fleet(clock)
    told = Told()
    idx.set_flight_listener(told)
    p = toks(100, 8, BS)
    idx.adopt_peer("peer1", [entry("peer1-1", p, "b")])
    apply(idx, [store(p, BS, 0, 8)], engine="b")
    assert idx.held_by_origin() == {"": 0}
    assert idx.match(p).predicted == ()
    # Told with the peer's origin: route sync does not pass such an end on (every replica
    # sees the announcement), but it does a "done" asked of this replica.
    assert told.log == [("ended", "peer1-1", "peer1", "announced", True)]


def test_R_SYNC_1_a_peers_end_releases_and_an_early_end_wins_over_a_late_record(clock):
    idx = fleet(clock)
    p = toks(100, 8, BS)
    idx.adopt_peer("peer1", [entry("peer1-1", p, "b", decode=4), entry("peer1-2", toks(300, 4, BS), "c", decode=2)])
    # The prefill alone ends: the prediction goes, the decode load stays.
    assert idx.end_peer([("peer1-1", False)]) == 1
    assert idx.match(p).predicted == ()
    assert idx.route(toks(5, 1, BS), record=False)["ranked"][-1]["load"]["decode_blocks"] in (2, 4)
    assert idx.end_peer([("peer1-1", True), ("peer1-2", True)]) == 2
    assert idx.held_by_origin() == {"": 0}
    # An end that overtook its record (two senders, no order between them): the record is refused.
    assert idx.end_peer([("peer1-9", True)]) == 0
    assert idx.adopt_peer("peer1", [entry("peer1-9", p, "a")]) == 0
    assert idx.held_by_origin() == {"": 0}


def test_R_SYNC_2_a_peers_request_expires_by_this_replicas_ttls_from_when_it_was_routed(clock):
    idx = fleet(clock, prefill_ttl_s=10.0, decode_ttl_s=60.0)
    p = toks(100, 8, BS)
    # Routed 8 s ago on the peer: its prediction has 2 s left here.
    idx.adopt_peer("peer1", [entry("peer1-1", p, "b", age=8.0)])
    assert idx.match(p).predicted == (("b", 0, 8, 8.0),)
    clock.advance(2.5)
    assert idx.match(p).predicted == ()
    assert idx.held_by_origin() == {"": 0}
    # Older than every TTL: nothing to adopt. A decode past the prefill TTL keeps only its decode.
    assert idx.adopt_peer("peer1", [entry("peer1-2", p, "b", decode=3, age=61.0)]) == 0
    assert idx.adopt_peer("peer1", [entry("peer1-3", p, "b", decode=3, age=30.0)]) == 1
    assert idx.match(p).predicted == ()
    assert idx.route(toks(900, 1, BS), record=False)["ranked"][-1]["load"]["decode_blocks"] == 3


def test_R_SYNC_3_dropping_a_peer_ends_its_requests_only_and_keeps_what_it_still_has(clock):
    idx = fleet(clock)
    idx.adopt_peer("peer1", [entry(f"peer1-{i}", toks(100 * i, 4, BS), "b") for i in range(1, 4)])
    idx.adopt_peer("peer2", [entry("peer2-1", toks(7000, 4, BS), "c")])
    mine = idx.route(toks(9000, 4, BS))["request_id"]
    assert idx.drop_peer("peer1", keep={"peer1-2"}) == 2
    assert idx.held_by_origin() == {"peer1": 1, "peer2": 1, "": 1}
    assert idx.drop_peer("peer1") == 1 and idx.drop_peer("peer2") == 1
    assert idx.held_by_origin() == {"": 1}
    assert [e.rid for e in idx.own_requests()] == [mine]


def test_R_SYNC_1_own_ends_and_forgotten_workers_are_told_peers_ends_with_their_origin(clock):
    idx = fleet(clock)
    told = Told()
    idx.set_flight_listener(told)
    p = toks(100, 8, BS)
    rid = idx.route(p, max_tokens=16)["request_id"]  # to a
    idx.adopt_peer("peer1", [entry("peer1-1", toks(500, 4, BS), "a", decode=2)])
    told.log.clear()
    apply(idx, [store(p, BS, 0, 8)], engine="a")  # our prefill announced: told (prefill only)
    assert told.log == [("ended", rid, "", "announced", False)]
    told.log.clear()
    apply(idx, [Cleared()], engine="a")  # the engine cleared its cache
    assert ("forgot", ("a", 0)) in told.log
    assert ("ended", rid, "", "forgotten", True) in told.log
    # The peer's request ended too (its worker's cache is gone), told with its origin.
    assert ("ended", "peer1-1", "peer1", "forgotten", True) in told.log
    assert idx.held_by_origin() == {"": 0}


def test_R_SYNC_1_a_peer_may_not_adopt_into_this_replicas_own_name(clock):
    idx = fleet(clock)
    assert idx.adopt_peer(idx.origin, [entry(f"{idx.origin}-77", toks(1, 4, BS), "a")]) == 0
    assert idx.adopt_peer("", [entry("x-1", toks(1, 4, BS), "a")]) == 0
    assert idx.held_by_origin() == {"": 0}
