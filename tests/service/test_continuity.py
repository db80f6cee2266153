"""A restart hidden behind a reconnect, through real sockets (R-STR-5, R-STR-7).

The engine here restarts as a real one does: its publisher's sockets close and a new
process binds the same ports, so the indexer's SUB sees a disconnect and a reconnect,
and ZMQ PUB drops the new incarnation's first batches while nobody is subscribed. The
expected state is the new incarnation's own log, through ``reference`` (an index fed
only that log): the old prompts must be gone, or the worker stale with a reason.
"""

from __future__ import annotations

import random
import time

import pytest

from evkit import ehashes, removed
from indexer.wire.engines import EngineConfig
from indexer.ingest.live import Indexer
from indexer.producer.publisher import VllmPublisher
from seqsim import Model
from svc import wait_until
from test_ingest import BS, P, ManualReplay, Rec, assert_same_index, gpu, ready, reference, rig, total, try_bind, wi  # noqa: F401 (rig: the fixture)


class Engine:
    """A vLLM engine rank on fixed ports that can die and come back."""

    def __init__(self, rig, replay: bool = True) -> None:
        self.rig = rig
        # Fixed ports: the engine comes back on the same ones. Held for the test (bound,
        # never listening: see svc.PortHold), so no other process takes them meanwhile.
        self.port = rig.hold().port
        self.rport = rig.hold().port if replay else None
        self.rec = Rec(self._bind(), "e1")

    def _bind(self) -> VllmPublisher:
        # The old process's ports may take a moment to free.
        return wait_until(lambda: try_bind(self.rig, self.port, self.rport), 5,
                          msg=f"the engine's ports {self.port}, {self.rport} bound again")

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(id="e1", endpoint=f"tcp://127.0.0.1:{self.port}",
                            replay_endpoint=f"tcp://127.0.0.1:{self.rport}" if self.rport else None)

    def restart(self, lost: int, prompts) -> None:
        """Die, come back on the same ports, and publish ``lost`` batches nobody gets."""
        self.rec.pub.close()
        self.rig.pubs.remove(self.rec.pub)
        self.rec.pub = self._bind()
        self.rec.log = []
        self.rec.restarts += 1
        for i in range(lost):
            self.rec.send(gpu(prompts[i % len(prompts)]), drop=True)  # PUB: no subscriber yet


def reconnected(ix, n: int, engine: str = "e1") -> None:
    """Wait for the ``n``-th reconnect of the worker's SUB (its ``n + 1``-th connect)."""
    wait_until(lambda: wi(ix, engine)["connects"] > n and wi(ix, engine)["connected"],
               timeout=10, msg=lambda: f"SUB reconnected: {wi(ix, engine)}")
    ready(ix, engine)  # and its subscription live: probed (the ZMTP handshake carries it)


def old_then_restart(rig, lost: int, replay: bool = True):
    eng = Engine(rig, replay)
    ix = rig.indexer([eng.config], replay_timeout_s=30.0)  # a loaded CI machine must not time out
    ready(ix)
    for i in range(3):  # seqs 0-2: P0-P2 on the GPU
        eng.rec.send(gpu(P[i]))
    wait_until(lambda: wi(ix, "e1")["last_seq"] == 2, msg="old incarnation applied")
    assert all(total(ix, P[i], "e1") == 4 for i in range(3))
    eng.restart(lost, P[3:6])
    reconnected(ix, 1)
    eng.rec.send(gpu(P[6]))  # seq `lost`: the first batch the indexer sees
    return eng, ix


@pytest.mark.parametrize("lost", [0, 1, 3, 4, 7])
def test_R_STR_7_issue_scenario_restart_behind_a_gap_drops_the_old_prompts(rig, lost):
    """vLLM 0.33's publisher with replay: seqs 0-2 (P0-P2), the engine restarts, its
    first ``lost`` batches are lost, the next one arrives. With lost == 3 it is seq 3,
    exactly what a gap-free stream would send next. Every time, P0-P2 are gone and
    the worker ends equal to what the new incarnation published, not stale."""
    eng, ix = old_then_restart(rig, lost)
    wait_until(lambda: wi(ix, "e1")["last_seq"] == lost and not wi(ix, "e1")["replaying"],
               timeout=10, msg=lambda: f"new incarnation applied: {wi(ix, 'e1')}")
    w = wi(ix, "e1")
    assert [total(ix, P[i], "e1") for i in range(3)] == [0, 0, 0], w
    assert total(ix, P[6], "e1") == 4 and w["restarts"] == 1 and not w["stale"], w
    assert_same_index(ix, reference([eng.rec]), P)


def test_R_STR_7_an_idle_engine_restarted_on_its_ports_is_dropped_before_it_publishes(rig):
    """A real vLLM engine killed with -9 and started again publishes nothing until its
    first request: the proof must run on the reconnect alone. The engine is down long
    enough for the SUB's reconnect backoff to reach its cap (the library's default),
    comes back on the same ports and stays silent: P0-P2 go, the worker is fresh and
    holds nothing, within a bound of the new sockets binding (the cap plus the proof)."""
    eng = Engine(rig)
    ix = Indexer([eng.config], replay_timeout_s=30.0)
    rig.ixs.append(ix)
    ix.start()
    ready(ix)
    for i in range(3):
        eng.rec.send(gpu(P[i]))
    wait_until(lambda: wi(ix, "e1")["last_seq"] == 2, msg="old incarnation applied")
    eng.rec.pub.close()
    rig.pubs.remove(eng.rec.pub)
    wait_until(lambda: not wi(ix, "e1")["connected"], msg="disconnect seen")
    time.sleep(1.5)  # an outage: the backoff grows to its cap meanwhile
    eng.rec.pub = eng._bind()
    up = time.monotonic()
    wait_until(lambda: all(total(ix, P[i], "e1") == 0 for i in range(3)), timeout=5,
               msg=lambda: f"old prompts dropped with no batch published: {wi(ix, 'e1')}")
    took = time.monotonic() - up
    w = wi(ix, "e1")
    assert w["restarts"] == 1 and not w["stale"] and ix.index.stats()["counters"]["continuity_restart"] == 1, w
    assert took < 2.0, took  # the reconnect cap (250 ms) and one replay, with room for a loaded machine
    eng.rec.log = []
    eng.rec.send(gpu(P[6]))  # its first step: seq 0
    wait_until(lambda: total(ix, P[6], "e1") == 4, msg=lambda: f"new incarnation applied: {wi(ix, 'e1')}")


@pytest.mark.parametrize("lost", [1, 3, 5])
def test_R_STR_7_without_a_replay_endpoint_the_worker_is_stale_with_the_reason(rig, lost):
    """No replay endpoint: continuity after the reconnect cannot be proven (lost == 3
    even looks in order). The worker must not be trusted silently: it is stale, and
    says why."""
    eng, ix = old_then_restart(rig, lost, replay=False)
    wait_until(lambda: wi(ix, "e1")["messages"] == eng.rec.live_sent, msg="live batch received")
    wait_until(lambda: wi(ix, "e1")["stale"], msg=lambda: f"stale: {wi(ix, 'e1')}")
    reason = wi(ix, "e1")["stale_reason"]
    assert "continuity after seq 2 unproven" in reason or "no replay endpoint" in reason, reason
    old = ix.match(P[0]).worker("e1")
    assert old is None or old.stale  # P0 gone (a restart proven by a newer ts), or flagged
    # The next restart the indexer sees at seq 0 recovers it (R-STR-4).
    eng.restart(0, P)
    reconnected(ix, 2)
    eng.rec.send(gpu(P[7]))
    wait_until(lambda: not wi(ix, "e1")["stale"], msg=lambda: f"recovered: {wi(ix, 'e1')}")
    assert [total(ix, P[i], "e1") for i in range(3)] == [0, 0, 0]
    assert_same_index(ix, reference([eng.rec]), P)


def test_R_STR_7_restart_during_a_replay(rig):
    """A gap makes the indexer ask for a replay (held open by a ROUTER we answer
    ourselves); the engine restarts before it is answered, losing its first batches.
    The request is then answered by the new incarnation (relayed from its real
    replay socket): the proof sees another ts at the anchor, and the worker is rebuilt
    from the new incarnation; P0 and P2 are gone."""
    eng = Engine(rig)
    man = ManualReplay(rig)
    ix = rig.indexer([EngineConfig(id="e1", endpoint=f"tcp://127.0.0.1:{eng.port}", replay_endpoint=man.endpoint)],
                     replay_timeout_s=5.0)
    ready(ix)
    eng.rec.send(gpu(P[0]))
    eng.rec.send(gpu(P[1]), drop=True)
    eng.rec.send(gpu(P[2]))  # gap: replay from the anchor 0
    client, start = man.request()
    assert start == 0
    eng.restart(4, P[3:6])
    reconnected(ix, 1)
    eng.rec.send(gpu(P[6]))  # seq 4, buffered while the replay is open
    wait_until(lambda: wi(ix, "e1")["messages"] == eng.rec.live_sent, msg="live batch received")
    man.relay(rig, client, start, eng.rec.pub)  # answered by the engine as it is now
    while True:  # the rebuild asks again, from 0: relay every request until it settles
        if man.no_request(0.3) and not wi(ix, "e1")["replaying"]:
            break
        client, start = man.request()
        man.relay(rig, client, start, eng.rec.pub)
    w = wi(ix, "e1")
    assert [total(ix, P[i], "e1") for i in (0, 2)] == [0, 0], w
    assert not w["stale"] and w["last_seq"] == 4, w
    assert_same_index(ix, reference([eng.rec]), P)


@pytest.mark.parametrize("seed", [1, 2])
def test_R_STR_7_soak_over_real_sockets(rig, seed):
    """A short seeded soak through real publishers: stores and evictions, restarts with
    0-5 lost first batches, live losses. Once settled, every worker equals what its
    engine's current incarnation holds by an independent model (tests/seqsim.py: a few
    dicts, no PrefixIndex), and none is stale: every engine has a replay endpoint
    whose ring holds its whole history. The long run is benchmarks/soak_sequencer.py."""
    rng = random.Random(seed)
    engines = [Engine(rig) for _ in range(2)]
    models = [Model() for _ in engines]
    hashes = [ehashes(p, BS) for p in P]
    for k, e in enumerate(engines):
        e.rec.engine = f"e{k}"
    ix = rig.indexer([EngineConfig(id=f"e{k}", endpoint=f"tcp://127.0.0.1:{e.port}",
                                   replay_endpoint=f"tcp://127.0.0.1:{e.rport}") for k, e in enumerate(engines)],
                     replay_timeout_s=30.0)  # a replay timing out on a loaded machine would be stale
    ready(ix)
    restarts = [0, 0]
    for _ in range(40):
        k = rng.randrange(2)
        e, m = engines[k], models[k]
        r = rng.random()
        if r < 0.1:
            # Not while a replay is open: a request the dying engine took with it is
            # lost, and the worker is then stale after the replay timeout (R-STR-4),
            # which this soak does not expect (test_R_STR_7_restart_during_a_replay does).
            wait_until(lambda: wi(ix, f"e{k}")["messages"] >= e.rec.live_sent and not wi(ix, f"e{k}")["replaying"],
                       timeout=10, msg="every live batch read and no replay open before a restart")
            lost = rng.randint(0, 5)
            m.clear()
            for j in range(lost):  # what restart() publishes, lost on the wire
                m.store(hashes[j % len(P)])
            e.restart(lost, P)
            restarts[k] += 1
            reconnected(ix, restarts[k], f"e{k}")
        elif r < 0.4:
            hs = hashes[rng.randrange(len(P))][-rng.randint(1, 4):][::-1]
            m.remove(hs)
            e.rec.send([removed(hs)], drop=rng.random() < 0.1)
        else:
            i = rng.randrange(len(P))
            m.store(hashes[i])
            e.rec.send(gpu(P[i]), drop=rng.random() < 0.1)
    for k, e in enumerate(engines):
        models[k].store(hashes[0])
        e.rec.send(gpu(P[0]))  # one last batch each, never lost
    for k, e in enumerate(engines):
        last = e.rec.pub.next_seq - 1
        wait_until(lambda: wi(ix, f"e{k}")["last_seq"] == last and not wi(ix, f"e{k}")["replaying"], timeout=10,
                   msg=lambda: f"e{k} settled: {wi(ix, f'e{k}')}")
    for k, m in enumerate(models):
        w = wi(ix, f"e{k}")
        assert not w["stale"], w
        assert w["resident_blocks"].get("GPU", 0) == len(m.count), (w, len(m.count))
        assert [total(ix, p, f"e{k}") for p in P] == [m.prefix(h) for h in hashes]


def test_R_STR_2_replay_abandoned_after_max_buffered_live_batches(rig):
    """The replay is never answered while the engine keeps publishing: past
    ``max_buffered`` live batches the replay is given up (stale, with the reason) rather
    than buffering without bound (R-BAD-3), and the buffered batches still apply."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)],
                     max_buffered=3, replay_timeout_s=30.0)
    ready(ix)
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]), drop=True)
    rec.send(gpu(P[2]))  # gap: replay asked, never answered
    assert man.request()[1] == 0
    for i in (3, 4, 5):
        rec.send(gpu(P[i]))  # the third one over the bound of 3 buffered
    wait_until(lambda: wi(ix, "e1")["stale"] and not wi(ix, "e1")["replaying"],
               msg=lambda: f"replay abandoned: {wi(ix, 'e1')}")
    w = wi(ix, "e1")
    assert "more than 3 live batches arrived during replay" in w["stale_reason"], w
    assert w["last_seq"] == 5 and w["replays_failed"] == 1
    assert [total(ix, P[i], "e1") for i in range(6)] == [4, 0, 4, 4, 4, 4]


@pytest.mark.parametrize("frames", [
    [b"", b"x", b"y", b"z", b"w"],  # five frames: no reply layout has them
    [b"", b"\x00\x01", b"payload"],  # a 2-byte seq frame
], ids=["bad_frame_count", "bad_seq_length"])
def test_R_DEC_3_malformed_replay_frames_are_dropped_and_counted(rig, frames):
    """A replay reply the indexer cannot read costs that frame, counted per worker as
    ``bad_replay_frame``; the rest of the answer still repairs the gap."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)])
    ready(ix)
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]), drop=True)
    rec.send(gpu(P[2]))
    client, start = man.request()
    man.sock.send_multipart([client] + frames)
    man.answer(client, rec.log)
    wait_until(lambda: wi(ix, "e1")["last_seq"] == 2 and not wi(ix, "e1")["replaying"],
               msg=lambda: f"repaired: {wi(ix, 'e1')}")
    w = wi(ix, "e1")
    assert w["dropped"] == {"bad_replay_frame": 1} and not w["stale"], w
    assert [total(ix, P[i], "e1") for i in range(3)] == [4, 4, 4]
