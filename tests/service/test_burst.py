"""A burst past the receive bound, through real sockets (R-BAD-3, R-STR-2).

A worker's SUB queues at most ``rcvhwm`` batches before they are applied. Past it
ZMQ stops reading the connection, so the backlog waits in the kernel's socket buffers
and then in the engine's PUB send queue; what that queue drops at its own high-water
mark is a gap, which the sequencer repairs from the engine's replay buffer. Here the
ingest thread is held (the test holds the index lock) while an engine publishes far
more than the SUB queue, loopback's socket buffers and a small PUB queue hold, so the
publisher must drop: every batch must still end up in the index, the worker fresh.
"""

from __future__ import annotations

from evkit import store, toks
from svc import wait_until
from test_ingest import Rec, assert_same_index, cfg, ready, reference, rig, wi  # noqa: F401 (rig: the fixture)

BS = 16
BLOCKS = 64
# ~3.4 kB a batch (1,024 token ids, 64 hashes): ~14 MB in all, well past what
# loopback's socket buffers take before the PUB queue fills and drops.
BURST = 4000
RCVHWM = 8
SNDHWM = 16


def batch(i: int) -> list:
    """Sequence ``i``: 64 blocks of its own tokens (hashes arbitrary, as vLLM's are to us)."""
    base = 1 + i * BLOCKS * BS
    return [store(toks(base, BLOCKS, BS), BS, 0, BLOCKS, hashes=list(range(base, base + BLOCKS)))]


def test_R_BAD_3_a_burst_past_the_receive_bound_is_replayed_whole(rig):
    pub = rig.pub(hwm=SNDHWM, buffer_steps=BURST + 100)
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")], rcvhwm=RCVHWM, replay_timeout_s=60.0)
    ready(ix)
    rec.send(batch(0))  # an anchor: the gap below is then proven from it (R-STR-7)
    wait_until(lambda: wi(ix, "e1")["last_seq"] == 0, msg=lambda: f"seq 0 applied: {wi(ix, 'e1')}")
    payloads = [rec.encode(batch(i)) for i in range(1, BURST + 1)]
    with ix.index.lock:  # the ingest thread stops at its next batch: the burst backs up
        for p in payloads:
            rec.send_payload(p)
    last = pub.next_seq - 1

    def caught_up() -> bool:
        w = wi(ix, "e1")
        return w["last_seq"] == last and not w["replaying"]

    wait_until(caught_up, 60, msg=lambda: f"every batch up to {last} applied: {wi(ix, 'e1')}")
    w = wi(ix, "e1")
    # The publisher dropped (what the bound moved to it), and the replay brought it all back.
    assert w["messages"] < BURST + 1 and w["gaps"] >= 1 and w["replays_ok"] >= 1, w
    assert not w["stale"] and w["replays_failed"] == 0, w
    assert_same_index(ix, reference([rec]), [toks(1 + i * BLOCKS * BS, BLOCKS, BS) for i in range(0, BURST + 1, 97)])
