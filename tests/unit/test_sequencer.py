"""The sequencer alone (contract R-STR-1..5, R-STR-7): its decisions, case by case, and
an adversarial soak against an independent model (tests/seqsim.py).

The transport here is the harness's (no sockets): the same ``Stream`` runs behind real
ZMQ in tests/service/test_continuity.py. Being fast, these tests are also what the mutation
run exercises (docs/mutation.md).
"""

from __future__ import annotations

import pytest

import seqsim
from evkit import ehashes, toks
from indexer import PrefixIndex
from indexer.producer.events import Stored, encode_batch
from indexer.sequence.sequencer import DUPLICATE, GAP, NEXT, RESTART, Stream, classify, peek_ts

BS = 4
P = [toks(1 + 1000 * i, 3, BS) for i in range(8)]


def batch(i: int, ts: float) -> bytes:
    return encode_batch([Stored(ehashes(P[i], BS), None, P[i], BS, kv_cache_spec_kind="full_attention")], ts=ts)


# ------------------------------------------------------------- classify


@pytest.mark.parametrize(
    "last, last_ts, seq, ts, want",
    [
        (None, None, 0, 5.0, NEXT),  # the very first batch
        (None, None, 3, 5.0, GAP),  # late join: a gap from 0 (R-STR-3)
        (4, 1.0, 5, 2.0, NEXT),
        (4, 1.0, 6, 2.0, GAP),
        (4, 1.0, 4, 1.0, DUPLICATE),  # the same batch again
        (4, 1.0, 2, 0.5, DUPLICATE),  # older seq, older ts: replay overlap
        (4, 1.0, 4, 1.5, RESTART),  # same seq, newer ts: a new incarnation (R-STR-5)
        (4, 1.0, 0, 1.5, RESTART),
        (4, 1.0, 0, 1.0, DUPLICATE),  # ts not newer: never a restart
        (4, None, 0, 9.0, DUPLICATE),  # nothing to compare with: not proven
        (4, 1.0, 0, None, DUPLICATE),
    ],
)
def test_R_STR_5_classify_is_the_one_restart_rule(last, last_ts, seq, ts, want):
    assert classify(last, last_ts, seq, ts) == want


def test_R_STR_5_library_apply_uses_the_same_rule():
    """PrefixIndex.apply(seq=) decides with classify: a backwards seq with an older ts is
    a duplicate (skipped), with a newer ts a restart (residency dropped first)."""
    ix = PrefixIndex()
    assert ix.apply("e", batch(0, 10.0), seq=0) == "applied"
    assert ix.apply("e", batch(1, 11.0), seq=1) == "applied"
    assert ix.apply("e", batch(2, 9.0), seq=0) == "duplicate"
    assert ix.match(P[1]).worker("e").total_blocks == 3
    assert ix.apply("e", batch(2, 12.0), seq=0) == "applied"  # restart
    assert ix.match(P[1]).worker("e") is None and ix.match(P[2]).worker("e").total_blocks == 3
    assert ix.stats()["counters"]["restarts"] == 1


def test_peek_ts_reads_the_batch_ts_and_declines_garbage():
    assert peek_ts(batch(0, 123.5)) == 123.5
    assert peek_ts(b"\x93") is None and peek_ts(b"") is None


# ----------------------------------------------------- single scenarios


class Harness:
    """One worker: a Stream over a real PrefixIndex, replays answered by the test."""

    def __init__(self, replay: bool = True) -> None:
        self.index = PrefixIndex()
        self.replay = replay
        self.requests: list[int] = []
        self.stream = Stream(self, replay_timeout_s=1.0, clock=lambda: self.now)
        self.now = 0.0
        self.index.register_worker("e")

    # the Sink. The service's sink finds the worker through the stream it is given
    # (indexer/ingest.py), so every call must name this one.
    def apply_batch(self, stream, seq, payload):
        assert stream is self.stream
        return self.index.apply_sequenced("e", payload, seq=seq)

    def reset_worker(self, stream):
        assert stream is self.stream
        self.index.reset_worker("e")

    def request_replay(self, stream, start):
        assert stream is self.stream
        if not self.replay:
            return "no replay endpoint"
        self.requests.append(start)
        return None

    def cancel_replay(self, stream):
        assert stream is self.stream
        self.requests.append(-1)

    def mark_stale(self, stream, reason):
        assert stream is self.stream
        self.index.mark_stale("e", 0, reason)

    def mark_fresh(self, stream):
        assert stream is self.stream
        self.index.clear_stale("e")

    def count(self, stream, name):
        assert stream is self.stream
        self.index.count(name)

    # probes
    def held(self) -> dict[int, int]:
        out = {}
        for i, p in enumerate(P):
            w = self.index.match(p).worker("e")
            if w is not None:
                out[i] = w.total_blocks
        return out

    def worker(self) -> dict:
        return self.index.workers()[0]

    def counter(self, name: str) -> int:
        return self.index.stats()["counters"].get(name, 0)


def old_engine(h: Harness, n: int = 3) -> list[tuple[int, bytes]]:
    """An engine that published P[0..n-1] as seqs 0..n-1, all applied."""
    log = [(s, batch(s, 100.0 + s)) for s in range(n)]
    for s, p in log:
        h.stream.live(s, p)
    return log


@pytest.mark.parametrize("lost", [0, 1, 2, 3, 4, 6])
def test_R_STR_7_restart_behind_a_reconnect_is_found_whatever_was_lost(lost):
    """Issue scenario: seqs 0-2 applied; the engine restarts while we are disconnected
    and its first ``lost`` batches go nowhere; its next batch arrives (seq ``lost``,
    which is 3 = last + 1 when lost == 3). The proof replay from the anchor (2) shows
    another ts, or nothing at all: a restart. P0-P2 are gone; the new ones are held."""
    h = Harness()
    old_engine(h)
    new = [(s, batch(3 + s % 5, 200.0 + s)) for s in range(lost + 1)]
    h.stream.reconnected()
    h.stream.live(*new[-1])
    answered = 0
    while h.stream.replaying:  # the new engine answers from its own ring
        start = h.requests[-1]
        for f in new:
            if f[0] >= start:
                h.stream.replayed(*f)
                if not h.stream.replaying or h.requests[-1] != start:
                    break
        else:
            h.stream.replay_end()
        answered += 1
        assert answered < 5
    # The reconnect asks for the proof from the anchor (2) at once, before any batch.
    if lost >= 3:
        # seq >= last + 1: only the proof replay can tell; it shows another ts at 2 (or
        # nothing from 2 on), and the rebuild replays from 0.
        assert h.requests == [2, -1, 0] and h.counter("continuity_restart") == 1
    elif lost:
        # seq 1 or 2 with a newer ts, arriving before the proof's answer: a restart
        # plain to see (R-STR-5); the proof is given up, then a late join from 0.
        assert h.requests == [2, -1, 0] and h.counter("continuity_restart") == 0
    else:
        assert h.requests == [2, -1]  # seq 0 with a newer ts: the proof is given up
    got = h.held()
    assert not any(i in got for i in (0, 1, 2)), got
    assert {3 + s % 5 for s, _ in new} <= set(got)
    w = h.worker()
    assert (w["restarts"], w["stale"], w["last_seq"]) == (1, False, lost)


def test_R_STR_7_reconnect_without_restart_is_proven_and_keeps_everything():
    h = Harness()
    log = old_engine(h)
    h.stream.reconnected()
    nxt = (3, batch(3, 103.0))
    h.stream.live(*nxt)  # in order, but after a reconnect: held until proven
    assert h.requests == [2] and 3 not in h.held()
    for f in log[2:] + [nxt]:
        h.stream.replayed(*f)
    h.stream.replay_end()
    assert h.held() == {0: 3, 1: 3, 2: 3, 3: 3}
    assert h.counter("continuity_proven") == 1 and h.counter("restarts") == 0
    assert not h.worker()["stale"]


def test_R_STR_7_reconnect_proves_at_once_and_an_idle_new_incarnation_is_dropped():
    """A real vLLM engine killed and started again on the same ports publishes nothing
    until its first step, so no batch may be needed to start the proof: the reconnect
    itself asks for a replay from the anchor. The new incarnation's ring is empty (the
    end marker alone): a restart, proven, and P0-P2 go before any batch arrives."""
    h = Harness()
    old_engine(h)
    h.stream.reconnected()
    assert h.requests == [2] and h.stream.replaying  # no batch arrived: the proof is asked anyway
    assert h.held() == {0: 3, 1: 3, 2: 3}  # held until the proof answers, for ms
    h.stream.replay_end()  # the restarted engine holds no batch at all
    assert h.held() == {} and h.counter("continuity_restart") == 1
    assert h.requests == [2, -1, 0]  # the rebuild from 0
    h.stream.replay_end()  # still nothing: the worker is empty and fresh, awaiting seq 0
    w = h.worker()
    assert not w["stale"] and w["restarts"] == 1 and not h.stream.replaying, w
    h.stream.live(0, batch(5, 300.0))
    assert h.held() == {5: 3}


def test_R_STR_7_reconnect_during_a_replay_proves_when_the_replay_ends():
    """The reconnect came while a gap's replay was in flight; nothing arrives after it.
    The proof is asked once the replay ends, not at the next batch, which an idle
    restarted engine never sends."""
    h = Harness()
    log = old_engine(h, 2)
    more = [(s, batch(s, 100.0 + s)) for s in range(2, 5)]
    h.stream.live(*more[-1])  # seq 4: a gap, replay from the anchor 1
    assert h.requests == [1]
    h.stream.reconnected()  # the engine restarts before the answer is read
    serve(h, log[1:] + more)  # the old engine's answer (sent before it died)
    assert h.requests == [1, 4] and h.stream.replaying  # the proof from the new anchor
    h.stream.replay_end()  # the new incarnation has published nothing
    assert h.held() == {} and h.counter("continuity_restart") == 1, h.held()


def test_R_STR_7_reconnect_with_no_replay_endpoint_is_stale_at_once():
    """No replay endpoint, no proof: the worker is stale as soon as the live socket
    reconnects, not only once the engine's next batch arrives."""
    h = Harness(replay=False)
    old_engine(h)
    h.stream.reconnected()
    w = h.worker()
    assert w["stale"] and "continuity after seq 2 unproven" in w["stale_reason"], w


def test_R_STR_7_gap_with_same_ts_at_the_anchor_applies_what_was_missing():
    h = Harness()
    log = old_engine(h, 2)
    more = [(s, batch(s, 100.0 + s)) for s in range(2, 5)]
    h.stream.live(*more[-1])  # seq 4: 2 and 3 lost
    assert h.requests == [1]
    for f in log[1:] + more:
        h.stream.replayed(*f)
    h.stream.replay_end()
    assert set(h.held()) == {0, 1, 2, 3, 4}
    assert not h.worker()["stale"] and h.stream.gaps == 1 and h.worker()["gaps"] == 0  # seen, repaired


def test_R_STR_7_no_replay_endpoint_after_a_reconnect_means_stale_with_the_reason():
    h = Harness(replay=False)
    old_engine(h)
    h.stream.reconnected()
    h.stream.live(3, batch(5, 300.0))
    w = h.worker()
    assert w["stale"] and "continuity after seq 2 unproven" in w["stale_reason"], w
    assert h.counter("continuity_unproven") == 1
    # A later restart observed at seq 0 recovers (R-STR-4).
    h.stream.live(0, batch(6, 400.0))
    assert not h.worker()["stale"] and h.held() == {6: 3}


def test_R_STR_7_overrun_buffer_cannot_prove_so_stale():
    h = Harness()
    old_engine(h)
    h.stream.live(9, batch(5, 109.0))  # gap: 3..8 lost
    assert h.requests == [2]
    h.stream.replayed(6, batch(6, 106.0))  # the ring no longer holds 2
    w = h.worker()
    assert w["stale"] and "unproven" in w["stale_reason"] and "overrun" in w["stale_reason"], w
    assert h.counter("continuity_unproven") == 1


def test_R_STR_7_replay_timeout_during_a_proof_is_stale_then_pending_applies():
    h = Harness()
    old_engine(h)
    h.stream.reconnected()
    h.stream.live(3, batch(3, 103.0))
    h.now = 5.0
    h.stream.check_timeout(h.now)
    w = h.worker()
    assert w["stale"] and "timed out" in w["stale_reason"]
    assert h.counter("continuity_unproven") == 1
    assert 3 in h.held()  # the buffered batch still applied, under a stale mark


def test_R_STR_5_restart_seen_live_during_a_replay_drops_what_was_buffered():
    h = Harness()
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))  # gap -> replay from 2, 5 buffered
    h.stream.live(0, batch(6, 500.0))  # a new incarnation's seq 0, newer ts
    assert h.requests == [2, -1]  # the replay was given up
    assert h.held() == {6: 3}
    assert h.worker()["restarts"] == 1 and not h.worker()["stale"]


def test_R_STR_1_live_copy_of_a_replayed_batch_is_no_suspicion():
    """A live batch the replay already applied is a duplicate; it does not make the next
    batch prove continuity again (no second replay)."""
    h = Harness()
    log = old_engine(h, 2)
    more = [(s, batch(s, 100.0 + s)) for s in range(2, 5)]
    h.stream.live(*more[1])  # seq 3: 2 lost
    for f in log[1:] + more:
        h.stream.replayed(*f)
    h.stream.replay_end()
    h.stream.live(*more[2])  # live copy of replayed seq 4
    h.stream.live(5, batch(5, 105.0))
    assert h.requests == [1] and 5 in h.held()
    assert h.counter("batches_duplicate") == 2  # the buffered 3 (replayed too) and the live 4


def test_R_STR_1_unexplained_duplicate_is_proven_at_once():
    """A batch not newer than the last one, with an older ts, that no replay explains:
    PUB never repeats, so it may be a restarted engine whose clock is behind. The
    sequencer asks for a proof at once; the engine's ring shows another ts at the
    anchor, so it rebuilds from 0."""
    h = Harness()
    old_engine(h)
    new = [(0, batch(6, 50.0)), (1, batch(7, 51.0)), (2, batch(5, 52.0))]
    h.stream.live(*new[1])  # seq 1, ts 51 < 102: by R-STR-5 not a restart...
    assert h.requests == [2]  # ... but not explained either: proof from the anchor
    h.stream.replayed(*new[2])  # the ring holds another batch at seq 2
    assert h.requests == [2, -1, 0] and h.counter("continuity_restart") == 1
    for f in new:
        h.stream.replayed(*f)
    h.stream.replay_end()
    assert h.held() == {5: 3, 6: 3, 7: 3} and not h.worker()["stale"]


def test_R_STR_1_unexplained_duplicate_of_the_same_engine_costs_one_proof():
    """The same incarnation repeating a batch (no real vLLM does; a faulty proxy
    might): the proof holds, the batch is a duplicate, nothing is asked again."""
    h = Harness()
    log = old_engine(h)
    h.stream.live(*log[1])
    assert h.requests == [2]
    h.stream.replayed(*log[2])
    h.stream.replay_end()
    h.stream.live(3, batch(3, 103.0))
    assert h.requests == [2] and h.held() == {0: 3, 1: 3, 2: 3, 3: 3}
    assert h.counter("continuity_proven") == 1 and h.counter("batches_duplicate") == 1


def test_R_STR_4_replay_that_ends_before_its_target_is_stale():
    h = Harness()
    log = old_engine(h, 2)
    h.stream.live(6, batch(6, 106.0))
    for f in log[1:] + [(2, batch(2, 102.0))]:
        h.stream.replayed(*f)
    h.stream.replay_end()  # 3..5 never came
    w = h.worker()
    assert w["stale"] and "before batch 6" in w["stale_reason"], w
    assert 6 in h.held()


def test_R_STR_2_live_batches_past_max_buffered_abandon_the_replay():
    h = Harness()
    h.stream.max_buffered = 2
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    h.stream.live(6, batch(6, 106.0))
    h.stream.live(7, batch(7, 107.0))  # a third: over the bound
    w = h.worker()
    assert w["stale"] and "more than 2 live batches" in w["stale_reason"]
    assert not h.stream.replaying and {5, 6, 7} <= set(h.held())


# ------------------------------------- decisions the mutation run pins down
#
# Each test below kills mutants of indexer/sequencer.py that the tests above let
# survive (docs/mutation.md): the restart rule and the gap, replay and proof decisions.

GARBAGE = b"\xc1"  # never valid MessagePack: a batch that does not decode (no ts)


def serve(h: Harness, ring: list[tuple[int, bytes]], end: bool = True) -> None:
    """The engine answers the latest replay request from its ring (every batch from the
    start asked for), then the end marker; it stops when the stream cancels or asks again."""
    n = len(h.requests)
    start = h.requests[-1]
    for f in ring:
        if f[0] >= start:
            h.stream.replayed(*f)
            if len(h.requests) != n:
                return
    if end:
        h.stream.replay_end()


def test_R_STR_5_seq_equal_to_the_last_with_a_newer_ts_during_a_replay_is_a_restart():
    """A restart whose first batch seen has exactly the last applied seq, arriving while
    a replay is in flight: the replay and what was buffered are the old incarnation's."""
    h = Harness()
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))  # gap -> replay from 2, 5 buffered
    h.stream.live(2, batch(6, 500.0))  # seq 2 = last, ts newer: a restart (R-STR-5)
    assert h.requests == [2, -1, 0]  # given up; the new one's seq 2 is a late join
    assert h.held() == {} and h.worker()["restarts"] == 1
    serve(h, [(0, batch(3, 498.0)), (1, batch(4, 499.0)), (2, batch(6, 500.0))])
    assert h.held() == {3: 3, 4: 3, 6: 3} and not h.worker()["stale"]


def test_R_STR_1_live_copies_during_a_replay_are_duplicates_not_restarts():
    """The replay outruns the live socket: live batches it already applied arrive while
    it is still in flight. They are duplicates (R-STR-1), applied once, no restart."""
    h = Harness()
    log = old_engine(h)
    ring = log + [(s, batch(s, 100.0 + s)) for s in range(3, 7)]
    h.stream.live(*ring[4])  # seq 4: 3 lost
    serve(h, ring, end=False)  # 2 proves, 3..6 applied
    h.stream.live(*ring[5])
    h.stream.live(*ring[6])
    h.stream.replay_end()
    assert h.requests == [2] and h.stream.restarts == 0 and h.worker()["restarts"] == 0
    assert h.held() == {i: 3 for i in range(7)} and not h.worker()["stale"]
    assert h.counter("batches_applied") == 7 and h.counter("batches_duplicate") == 3


def test_R_STR_2_gap_after_undecodable_batches_fetches_every_missing_one():
    """Seq 0 did not decode (no ts, so nothing to prove): a gap asks from the first
    missing seq, and every batch in between is applied."""
    h = Harness()
    h.stream.live(0, GARBAGE)
    h.stream.live(3, batch(3, 103.0))
    assert h.requests == [1]
    serve(h, [(0, GARBAGE)] + [(s, batch(s, 100.0 + s)) for s in range(1, 4)])
    assert h.held() == {1: 3, 2: 3, 3: 3} and not h.worker()["stale"]


def test_R_STR_7_gap_after_seq_0_alone_is_proven_from_seq_0():
    """Only seq 0 applied; the engine restarts unseen and its seqs 0-1 are lost. Seq 2
    is a gap, and the proof replay starts at the anchor, 0: another ts, a restart."""
    h = Harness()
    old_engine(h, 1)
    new = [(0, batch(3, 200.0)), (1, batch(4, 200.5)), (2, batch(5, 201.0))]
    h.stream.live(*new[2])
    assert h.requests == [0]
    serve(h, new)  # seq 0 with ts 200, not 100: rebuild from 0
    assert h.requests == [0, -1, 0] and h.counter("continuity_restart") == 1
    serve(h, new)
    assert h.held() == {3: 3, 4: 3, 5: 3} and h.worker()["restarts"] == 1 and not h.worker()["stale"]


def test_R_STR_7_nothing_readable_applied_means_nothing_to_prove_after_a_reconnect():
    """No batch with a readable ts applied yet: no anchor, nothing in the index to
    protect. The first batch after a reconnect applies without a replay."""
    h = Harness()
    h.stream.live(0, GARBAGE)
    h.stream.reconnected()
    h.stream.live(1, batch(1, 101.0))
    assert h.requests == [] and h.held() == {1: 3}
    h.stream.live(2, batch(2, 102.0))  # the proof is not asked later either
    assert h.requests == [] and h.held() == {1: 3, 2: 3}


def test_R_STR_1_R_STR_5_not_newer_seq_with_nothing_readable_applied_is_a_duplicate():
    """After a reconnect, a batch not newer than the last seq, whose applied copy had no
    readable ts: no ts to be newer than, so not a restart (R-STR-5), and no anchor to
    prove: a duplicate, skipped (R-STR-1). The next batch applies."""
    h = Harness()
    h.stream.live(0, GARBAGE)
    h.stream.reconnected()
    h.stream.live(0, batch(0, 100.0))
    assert h.requests == [] and h.held() == {} and h.counter("batches_duplicate") == 1
    h.stream.live(1, batch(1, 101.0))
    assert h.requests == [] and h.held() == {1: 3} and h.worker()["restarts"] == 0


def test_R_STR_1_a_replay_applies_nothing_the_stream_already_accounted_for():
    """Seq 3 did not decode, so the anchor stays at 2 while last is 3. The proof replay
    from 2 delivers 3 again: it was accounted for, and is not applied a second time."""
    h = Harness()
    log = old_engine(h)
    h.stream.live(3, GARBAGE)
    ring = log + [(3, GARBAGE), (4, batch(4, 104.0)), (5, batch(5, 105.0))]
    h.stream.live(*ring[5])
    assert h.requests == [2]
    serve(h, ring)
    assert h.counter("continuity_proven") == 1
    assert sum(h.worker()["dropped"].values()) == 1  # seq 3, once
    assert h.held() == {0: 3, 1: 3, 2: 3, 4: 3, 5: 3} and not h.worker()["stale"]


def test_R_STR_4_R_STR_7_restart_proven_by_an_empty_answer_rebuilds_and_recovers():
    """A stale worker; its engine restarts on a host whose clock is behind and publishes
    seq 0 only. Its ring holds nothing from the anchor on: a restart, proven
    (continuity_restart). The rebuild's replay asked from 0 and answered from 0 is a
    recovery: stale is cleared (R-STR-4)."""
    h = Harness()
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    h.now = 5.0
    h.stream.check_timeout(h.now)  # stale; 5 applied
    assert h.worker()["stale"] and h.requests == [2, -1]
    new = [(0, batch(6, 50.0))]
    h.stream.reconnected()
    h.stream.live(*new[0])  # seq 0, ts older: not a restart by itself
    assert h.requests == [2, -1, 5]
    serve(h, new)  # nothing from 5 on
    assert h.requests == [2, -1, 5, -1, 0] and h.counter("continuity_restart") == 1
    serve(h, new)
    assert h.held() == {6: 3} and h.worker()["restarts"] == 1
    assert not h.worker()["stale"]


def test_R_STR_2_replay_that_ends_just_before_its_target_repairs_the_gap():
    """Every missing batch came; the live batch that started the replay was buffered."""
    h = Harness()
    log = old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    serve(h, log + [(3, batch(3, 103.0)), (4, batch(4, 104.0))])
    assert h.held() == {i: 3 for i in range(6)} and not h.worker()["stale"]
    assert h.stream.replays_ok == 1 and h.stream.replays_failed == 0


def test_R_STR_4_replay_that_ends_one_batch_short_of_its_target_is_stale():
    h = Harness()
    log = old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    serve(h, log + [(3, batch(3, 103.0))])  # 4 never came
    w = h.worker()
    assert w["stale"] and "ended at 3 before batch 5" in w["stale_reason"], w
    assert 4 not in h.held() and 5 in h.held()


def test_R_STR_2_replay_is_given_up_only_past_its_deadline():
    h = Harness()  # replay_timeout_s=1.0, clock at 0
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    h.stream.check_timeout(1.0)  # at the deadline: still waiting
    assert h.stream.replaying and not h.worker()["stale"]
    h.stream.check_timeout(1.001)
    assert not h.stream.replaying and "timed out" in h.worker()["stale_reason"]


def test_R_STR_7_reconnects_are_counted_after_a_first_batch_or_during_a_replay():
    """The first connect is no reconnect; one before any batch neither. A reconnect
    once something was applied, or while a late join's replay is in flight, is."""
    h = Harness()
    h.stream.reconnected()
    assert h.stream.reconnects == 0 and h.counter("reconnects") == 0
    ring = [(s, batch(s, 100.0 + s)) for s in range(4)]
    h.stream.live(*ring[2])  # late join: replay from 0, nothing applied yet
    h.stream.reconnected()
    assert h.stream.reconnects == 1 and h.counter("reconnects") == 1
    serve(h, ring[:3])
    h.stream.reconnected()
    assert h.stream.reconnects == 2 and h.counter("reconnects") == 2
    h.stream.live(*ring[3])  # proven from the anchor (2)
    assert h.requests == [0, 2]


def test_R_STR_2_gaps_and_replays_are_counted():
    h = Harness()
    ring = [(s, batch(s % 8, 100.0 + s)) for s in range(10)]
    for f in ring[:3]:
        h.stream.live(*f)
    h.stream.live(*ring[5])
    serve(h, ring[:6])
    h.stream.live(*ring[9])
    serve(h, ring)
    assert h.requests == [2, 5] and not h.worker()["stale"]
    assert h.stream.gaps == 2 and h.counter("wire_gaps") == 2
    assert h.stream.replays_ok == 2 and h.counter("replays_ok") == 2
    assert h.stream.replays_failed == 0 and h.counter("replays_failed") == 0


def test_R_STR_4_failed_replays_are_counted_and_never_counted_ok():
    """An overrun replay (it fails, then ends) and a gap without a replay endpoint."""
    h = Harness()
    old_engine(h)
    h.stream.live(9, batch(5, 109.0))
    serve(h, [(6, batch(6, 106.0)), (9, batch(5, 109.0))])  # the ring no longer holds 2
    assert h.worker()["stale"] and not h.stream.replaying
    h.replay = False
    h.stream.live(12, batch(7, 112.0))
    assert h.stream.replays_failed == 2 and h.counter("replays_failed") == 2
    assert h.stream.replays_ok == 0 and h.counter("replays_ok") == 0


def test_R_STR_5_each_restart_is_counted():
    h = Harness()
    old_engine(h)
    h.stream.live(0, batch(5, 500.0))
    h.stream.live(0, batch(6, 600.0))
    assert h.stream.restarts == 2 and h.worker()["restarts"] == 2
    assert h.held() == {6: 3}


def test_R_STR_2_buffered_batches_after_one_the_replay_covered_still_apply():
    h = Harness()
    log = old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    h.stream.live(6, batch(6, 106.0))  # buffered behind 5
    serve(h, log + [(s, batch(s, 100.0 + s)) for s in range(3, 6)])  # up to 5, not 6
    assert h.held() == {i: 3 for i in range(7)} and h.worker()["last_seq"] == 6
    assert h.counter("batches_duplicate") == 1 and not h.worker()["stale"]


def test_R_STR_1_failed_replay_that_covered_its_target_applies_it_once():
    """The replay from 2 starts at 4 (overrun: stale) but does deliver 5, the batch that
    started it. The buffered copy of 5 is a duplicate: 5 is applied once."""
    h = Harness()
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    serve(h, [(4, batch(4, 104.0)), (5, batch(5, 105.0))])
    assert h.worker()["stale"]
    assert h.counter("batches_applied") == 5 and h.counter("batches_duplicate") == 1  # 0-2, 4, 5


def test_R_STR_4_resync_drops_everything_and_rebuilds_from_0():
    """Indexer.resync on a stale worker: the residency goes, a replay from 0 answered
    from 0 rebuilds it and clears stale; a live batch meanwhile is buffered."""
    h = Harness()
    log = old_engine(h)
    h.stream.live(9, batch(5, 109.0))
    serve(h, [(6, batch(6, 106.0))], end=False)  # overrun: stale
    assert h.worker()["stale"] and h.requests == [2]
    h.stream.resync()
    assert h.requests == [2, -1, 0] and h.held() == {}
    ring = log + [(s, batch(s, 100.0 + s)) for s in range(3, 8)]
    h.stream.live(*ring[7])  # arrives while the replay is in flight
    serve(h, ring[:7])
    assert h.held() == {i: 3 for i in range(8)} and not h.worker()["stale"]
    assert h.worker()["last_seq"] == 7 and h.counter("batches_applied") == 4 + 8  # 0-2 and 6, then 0-7


def test_R_STR_4_resync_answered_with_nothing_is_no_recovery():
    """A resync whose answer is the end marker alone proves no history: the worker stays
    stale, and a live batch at 3 is then a late join (a replay from 0), not applied on
    trust."""
    h = Harness(replay=False)
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))  # no replay endpoint: stale
    h.replay = True
    h.stream.resync()
    assert h.requests == [0]
    h.stream.live(3, batch(3, 303.0))
    h.stream.replay_end()
    assert h.worker()["stale"] and h.requests == [0, 0] and h.held() == {}


def test_R_STR_5_R_STR_7_restart_behind_an_older_ts_is_proven_after_a_repaired_gap():
    """A gap repaired (replay applied 2 and 3); then the engine restarts on a host whose
    clock is behind: its seq 1, ts older, was never replayed, so it is proven, not
    skipped, and the proof finds the restart."""
    h = Harness()
    log = old_engine(h, 2)
    ring = log + [(2, batch(2, 102.0)), (3, batch(3, 103.0))]
    h.stream.live(*ring[3])
    serve(h, ring)
    assert h.requests == [1] and h.held() == {0: 3, 1: 3, 2: 3, 3: 3}
    new = [(0, batch(5, 50.0)), (1, batch(6, 51.0))]
    h.stream.live(*new[1])
    assert h.requests == [1, 3]
    serve(h, new)  # nothing from 3 on: a restart
    assert h.requests == [1, 3, -1, 0]
    serve(h, new)
    assert h.held() == {5: 3, 6: 3} and h.worker()["restarts"] == 1 and not h.worker()["stale"]


def test_R_STR_1_live_copy_of_any_batch_a_replay_applied_is_a_plain_duplicate():
    """A late join's replay applied 0-2: a live copy of any of them, the first
    included, is skipped at once (no proof asked)."""
    h = Harness()
    ring = [(s, batch(s, 100.0 + s)) for s in range(4)]
    h.stream.live(*ring[2])
    serve(h, ring[:3])
    for f in ring[:3]:
        h.stream.live(*f)
    h.stream.live(*ring[3])
    assert h.requests == [0] and h.held() == {i: 3 for i in range(4)}
    assert h.counter("batches_duplicate") == 4  # the buffered 2, then 0, 1, 2


def test_R_STR_1_replay_answer_repeating_a_frame_is_no_overrun():
    """A replay answer with a frame twice (a faulty proxy) and a late frame after the
    end: the repeat and the late frame are ignored; nothing is lost, nothing is stale."""
    h = Harness()
    log = old_engine(h)
    more = [(s, batch(s, 100.0 + s)) for s in range(3, 7)]
    h.stream.live(*more[2])  # seq 5
    for f in log[2:] + more[:2] + [more[0]] + more[2:3]:  # 2, 3, 4, 3, 5
        h.stream.replayed(*f)
    h.stream.replay_end()
    h.stream.replayed(*more[3])  # seq 6, after the end
    assert h.held() == {i: 3 for i in range(6)} and not h.worker()["stale"]
    assert h.worker()["last_seq"] == 5


def test_R_STR_4_worker_reports_replaying_as_a_bool():
    """What Indexer.workers() shows as ``replaying``: False before, True during, False
    after a replay, also one given up for a restart seen live."""
    h = Harness()
    assert h.stream.replaying is False
    old_engine(h)
    h.stream.live(5, batch(5, 105.0))
    assert h.stream.replaying is True
    h.stream.live(0, batch(6, 500.0))  # a restart at seq 0: the replay is given up
    assert h.stream.replaying is False and h.held() == {6: 3}
    h.stream.live(3, batch(7, 503.0))
    assert h.stream.replaying is True
    serve(h, [(0, batch(6, 500.0)), (1, batch(1, 501.0)), (2, batch(2, 502.0)), (3, batch(7, 503.0))])
    assert h.stream.replaying is False and not h.worker()["stale"]


def test_R_STR_4_R_STR_7_rebuild_answer_cut_short_is_stale_not_silently_partial():
    """A restart proven by the proof replay; the rebuild's answer from 0 ends after
    seq 1, though the new incarnation's seq 4 came live. The worker must be stale (as
    the same cut answer makes it without a restart) or hold all of seqs 0-4."""
    h = Harness()
    old_engine(h)
    h.stream.reconnected()
    new = [(s, batch(3 + s, 200.0 + s)) for s in range(5)]  # P3..P7 at seqs 0..4
    h.stream.live(*new[4])
    serve(h, new)  # seq 2 with another ts: rebuild from 0
    assert h.requests == [2, -1, 0]
    serve(h, new[:2])  # 0, 1, then the end marker
    w = h.worker()
    assert w["stale"] and "before batch 4" in w["stale_reason"], (w, h.held())


def test_R_STR_7_rebuild_keeps_what_came_over_the_new_connection_and_drops_the_old():
    """A gap opens a proof replay with the old incarnation's seq 4 buffered; the engine
    restarts (a reconnect) and its seq 5 arrives, buffered too. The proof shows another
    ts at the anchor: the rebuild from 0 must reach seq 5 (it came over the current
    connection) and must never apply the old seq 4 (it came over the old one)."""
    h = Harness()
    old_engine(h)
    h.stream.live(4, batch(4, 104.0))  # old incarnation, 3 lost: proof from 2
    assert h.requests == [2]
    h.stream.reconnected()  # the engine restarted meanwhile
    new = [(s, batch(s if s < 3 else s + 2, 200.0 + s)) for s in range(6)]  # P0 P1 P2 P5 P6 P7
    h.stream.live(*new[5])  # seq 5 of the new incarnation: buffered
    serve(h, new)  # seq 2 with another ts: a restart, rebuild from 0
    assert h.requests == [2, -1, 0] and h.stream.replay_target == 5
    serve(h, new)
    assert set(h.held()) == {0, 1, 2, 5, 6, 7} and 4 not in h.held(), h.held()
    assert not h.worker()["stale"] and h.worker()["last_seq"] == 5


def test_R_STR_7_a_batch_requeued_after_a_replay_keeps_the_connection_it_came_over():
    """The old incarnation's seq 4 waits through a proof replay (answered by the old
    engine) and a reconnect; re-sequenced after it, it asks for another proof, which the
    restarted engine answers with another ts. The rebuild must drop it (it came over the
    connection before the reconnect, however often it was re-queued): the worker ends
    fresh and equal to the new incarnation, P4 not held."""
    h = Harness()
    h.stream.reconnected()  # the first connect, as the transport reports it
    log = old_engine(h)
    old = log + [(3, batch(3, 103.0)), (4, batch(4, 104.0))]
    h.stream.live(*old[4])  # 3 lost: proof replay from 2, seq 4 buffered
    h.stream.reconnected()  # the engine restarts before the answer is read
    serve(h, old[2:4])  # the old engine's answer: 2 (same ts: proven), 3
    assert h.requests == [2, 3]  # the buffered 4, re-queued, asks for proof from 3
    new = [(s, batch(7 if s == 3 else s, 200.0 + s)) for s in range(4)]  # P0 P1 P2 P7
    serve(h, new)  # seq 3 with another ts: a restart; the rebuild replays from 0
    assert h.requests[-2:] == [-1, 0] and h.stream.replay_target is None
    serve(h, new)
    assert set(h.held()) == {0, 1, 2, 7} and not h.worker()["stale"], (h.held(), h.worker())


# ------------------------------------------------------------------ soak

HONEST = {"loss", "restart", "reconnect", "clock"}
ADVERSARIAL = HONEST | {"overrun", "mangle", "noreplay", "slow"}


@pytest.mark.parametrize("seed", range(12))
def test_R_STR_7_soak_honest_world_is_exact_and_never_stale(seed):
    """Restarts with lost first batches, reconnects, losses and clocks behind, with
    honest replay endpoints: every worker ends exactly equal to its model, never stale."""
    w = seqsim.World(seed, set(HONEST))
    for _ in range(600):
        w.step()
    w.settle()
    got = w.verdicts()
    assert all(not stale and exact for stale, _, exact in got.values()), got
    assert sum(e.incarnations for e in w.engines) > len(w.engines)  # restarts did happen
    assert w.requests > 0


@pytest.mark.parametrize("seed", range(24))
def test_R_STR_7_soak_adversarial_world_is_exact_or_stale_with_a_reason(seed):
    """Everything can go wrong: overrun rings, duplicated, reordered, cut or endless
    replay answers, an engine without a replay endpoint. Each worker ends exactly equal
    to its model, or stale with a reason: never silently wrong."""
    w = seqsim.World(1_000 + seed, set(ADVERSARIAL))
    for _ in range(600):
        w.step()
    w.settle()
    for name, (stale, reason, exact) in w.verdicts().items():
        assert exact or (stale and reason), (name, stale, reason)
