"""vLLM's own ``ZmqEventPublisher`` (release 0.33.0, loaded from the installed ``vllm``
package by :mod:`vendor.vllm_kv_events`) against the golden frames captured from a real
engine (``tests/data/vllm-golden/v0.33.0``): the code the restart tests run as "vLLM's
publisher" is shown to be the real thing before anything relies on it.

* live: ``[topic, seq (8 bytes big-endian), payload]``, seq from 0, byte for byte;
* replay (``buffer_steps=2``): a DEALER's ``[b"", seq]`` answered with
  ``[b"", topic, seq, payload]`` per held batch (from the oldest still held when asked
  for one it dropped) and the end marker ``[b"", b"", END, b""]``;
* every golden payload decodes into vLLM's ``KVEventBatch`` and re-encodes identically.

:class:`OwnEngine` (the publisher with a recorder of everything it sent live) is what
``test_state_service`` parametrizes its restart scenarios over.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import golden
from indexer.producer.events import encode_batch
from svc import wait_for
from vendor import vllm_kv_events

VDIR = "v0.33.0"
kv = vllm_kv_events.load()
needs_vllm = pytest.mark.skipif(kv is None, reason=vllm_kv_events.MISSING)


# After the handshake, for the SUBSCRIBE to reach the PUB's I/O thread. A sleep, not a
# probe: vLLM's PUB sends only from its publisher thread (nothing else may use that
# socket) and a SUB gets no acknowledgement; a recorder that missed a batch fails
# OwnEngine.settle(), loudly.
SUBSCRIBE_S = 0.3


def connected_sub(endpoint: str, ctx: zmq.Context | None = None, *, settle: bool = True) -> zmq.Socket:
    """A SUB (all topics) on ``endpoint`` whose subscription the PUB has had time to take
    in: vLLM's PUB has no probe to send, so wait for the handshake, then ``SUBSCRIBE_S``
    (unless ``settle`` is false: the caller sleeps once for several)."""
    ctx = ctx or zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    try:
        assert mon.poll(5000), f"no ZMTP handshake with {endpoint}"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sub.disable_monitor()
        mon.close(0)
    if settle:
        time.sleep(SUBSCRIBE_S)
    return sub


class OwnEngine:
    """One engine as vLLM runs it: its ``ZmqEventPublisher`` (bound on 127.0.0.1
    ephemeral ports, with replay) fed ``KVEventBatch`` objects, plus a recorder SUB,
    connected before anything is published, logging every live ``(seq, payload)``. The
    log is what vLLM sent, so ``test_ingest.reference`` can replay it exactly; the same
    attributes as ``test_ingest.Rec`` (``engine``, ``rank``, ``model``, ``log``)."""

    def __init__(self, engine: str, *, buffer_steps: int, topic: str = "", settle: bool = True) -> None:
        assert kv is not None, vllm_kv_events.MISSING
        self.engine, self.rank, self.model = engine, 0, "default"
        self.sent = 0
        self.log: list[tuple[int, bytes]] = []
        # tcp://*:0 is vLLM's "bind an ephemeral port on the node IP" (VLLM_HOST_IP: the
        # shim's 127.0.0.1); get_publisher_config() reports the endpoints it bound.
        self.pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                                        buffer_steps=buffer_steps, topic=topic)
        conf = self.pub.get_publisher_config()
        self.live_endpoint, self.bound_replay_endpoint = conf.endpoint, conf.replay_endpoint
        self._sub = connected_sub(self.live_endpoint, settle=settle)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._record, name=f"record-{engine}", daemon=True)
        self._thread.start()

    def _record(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                _topic, seq, payload = self._sub.recv_multipart()
                self.log.append((int.from_bytes(seq, "big"), payload))

    def send(self, events) -> None:
        """Publish producer events (:mod:`indexer.producer.events`) as vLLM's own
        structs: encoded once, decoded into vLLM's ``KVEventBatch``, handed to
        ``publish`` (which stamps the DP rank, queues it, and its thread encodes it)."""
        batch = msgspec.msgpack.decode(encode_batch(events, ts=time.time(), dp_rank=None, version="0.33"),
                                       type=kv.KVEventBatch)
        self.pub.publish(batch)
        self.sent += 1

    @property
    def next_seq(self) -> int:
        return self.sent

    def settle(self) -> None:
        """Wait until the recorder holds every batch published, and check it missed none."""
        wait_for(lambda: len(self.log) >= self.sent, what=f"{self.engine}: recorder got {self.sent} batches")
        assert [s for s, _ in self.log] == list(range(self.sent)), f"{self.engine}: recorder missed a batch"

    def close(self) -> None:
        self.pub.shutdown()
        self._stop.set()
        self._thread.join()
        self._sub.close(0)


def _hex(frames) -> list[bytes]:
    return [bytes.fromhex(x) for x in frames]


@needs_vllm
def test_vllm_own_publisher_reproduces_the_golden_frames():
    fr = golden.frames(VDIR)
    assert fr["vllm"] == vllm_kv_events.VERSION and fr["buffer_steps"] == 2
    live = [_hex(m) for m in fr["live_frames_hex"]]
    eng = OwnEngine("golden", buffer_steps=fr["buffer_steps"], topic=fr["topic"])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for m in live:  # the captured batches as vLLM's structs, published by vLLM's code
            eng.pub.publish(msgspec.msgpack.decode(m[2], type=kv.KVEventBatch))
            eng.sent += 1
        eng.settle()
        assert [[fr["topic"].encode(), s.to_bytes(8, "big"), p] for s, p in eng.log] == live

        dealer.connect(eng.bound_replay_endpoint)

        def exchange(request: list[bytes]) -> list[list[bytes]]:
            dealer.send_multipart(request)
            out = []
            while True:
                assert dealer.poll(5000), "no replay reply"
                f = dealer.recv_multipart()
                out.append(f)
                if f[2] == kv.ZmqEventPublisher.END_SEQ:
                    return out

        reply_0 = next(v for k, v in fr.items() if k.startswith("replay_reply_from_0_hex"))
        assert exchange(_hex(fr["replay_request_from_0_hex"])) == [_hex(m) for m in reply_0]
        assert exchange([b"", (2).to_bytes(8, "big")]) == [_hex(m) for m in fr["replay_reply_from_2_hex"]]
    finally:
        dealer.close(0)
        eng.close()


@needs_vllm
@pytest.mark.parametrize("name", [e["file"].removesuffix(".msgpack") for e in golden.entries(VDIR)])
def test_vllm_own_structs_reencode_every_golden_payload(name):
    """vLLM's event structs, field order and defaults included: decoding a golden payload
    into ``KVEventBatch`` and encoding it with vLLM's encoder gives the same bytes."""
    raw = golden.payload(VDIR, name)
    batch = msgspec.msgpack.decode(raw, type=kv.KVEventBatch)
    assert msgspec.msgpack.Encoder().encode(batch) == raw
    kinds = {type(e).__name__ for e in batch.events}
    assert kinds <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"} and kinds
