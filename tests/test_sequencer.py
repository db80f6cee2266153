"""The sequencer alone (contract R-STR-1..5, R-STR-7): its decisions, case by case, and
an adversarial soak against an independent model (tests/seqsim.py).

The transport here is the harness's (no sockets): the same ``Stream`` runs behind real
ZMQ in tests/test_continuity.py. Being fast, these tests are also what the mutation
run exercises (docs/mutation.md).
"""

from __future__ import annotations

import pytest

import seqsim
from evkit import ehashes, toks
from indexer import PrefixIndex
from indexer.producer.events import Stored, encode_batch
from indexer.sequencer import DUPLICATE, GAP, NEXT, RESTART, Stream, classify, peek_ts

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

    # the Sink
    def apply_batch(self, stream, seq, payload):
        return self.index.apply_sequenced("e", payload, seq=seq)

    def reset_worker(self, stream):
        self.index.reset_worker("e")

    def request_replay(self, stream, start):
        if not self.replay:
            return "no replay endpoint"
        self.requests.append(start)
        return None

    def cancel_replay(self, stream):
        self.requests.append(-1)

    def mark_stale(self, stream, reason):
        self.index.mark_stale("e", 0, reason)

    def mark_fresh(self, stream):
        self.index.clear_stale("e")

    def count(self, stream, name):
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
    if lost >= 3:
        # seq >= last + 1: only the proof replay from the anchor (2) can tell; it shows
        # another ts at 2 (or nothing from 2 on), and the rebuild replays from 0.
        assert h.requests == [2, -1, 0] and h.counter("continuity_restart") == 1
    elif lost:
        # seq 1 or 2 with a newer ts: a proven restart (R-STR-5), then a late join from 0.
        assert h.requests == [0] and h.counter("continuity_restart") == 0
    else:
        assert h.requests == []  # seq 0 with a newer ts: the restart is plain to see
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
