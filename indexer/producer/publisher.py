"""A vLLM-compatible KV-event publisher, for tests, benchmarks, simulators and demos.

It speaks vLLM's ``ZmqEventPublisher`` wire protocol (reference §2), so an indexer
cannot tell it from a real engine:

* live: a PUB socket sending ``[topic, seq (8 bytes big-endian), payload]``, with
  ``seq`` counting from 0, one per batch;
* replay: a ROUTER socket (always bound) answering a DEALER's
  ``[b"", start_seq]`` with every buffered batch whose seq is ``>= start_seq``,
  oldest first, then an end marker. The buffer is a bounded ring of
  ``buffer_steps`` batches: asked for a seq it no longer holds, it silently starts
  at the oldest one it has, as vLLM does. Reply layout: ``[b"", topic, seq,
  payload]`` and end ``[b"", b"", END, b""]`` from vLLM 0.26 on,
  ``[b"", seq, payload]`` and ``[b"", END, b""]`` before;
* DP ranks: rank ``r`` publishes on the configured ports plus ``r``.

Knobs a real engine does not have: ``drop`` (sequence numbers to skip on the live
socket, still buffered for replay, like a PUB high-water-mark loss), ``restart()``
(sequence back to 0, empty replay buffer, like a restarted engine) and
``send_raw()`` (any frames, for garbage).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import zmq

from indexer.producer.events import encode_batch
from indexer.wire.engines import END_SEQ, offset_endpoint

if TYPE_CHECKING:
    import msgspec

__all__ = ["VllmPublisher", "END_SEQ", "offset_endpoint"]

def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class VllmPublisher:
    """One engine DP rank's event publisher.

    Parameters
    ----------
    endpoint, replay_endpoint:
        Base endpoints, as in vLLM's ``KVEventsConfig`` (``tcp://*:5557``); the
        rank offset is applied here. ``replay_endpoint=None`` disables replay.
    topic:
        Frame 0 of every live message.
    buffer_steps:
        Replay ring size in batches (vLLM default 10,000).
    version:
        Wire layout of payloads built by :meth:`publish` (``"0.23"``, ``"0.24"``,
        ``"0.33"``) and of replay replies (topic frame from 0.26 on).
    hwm:
        PUB send high-water mark (0 = unbounded: no silent loss in tests).
    bind:
        ``None`` follows vLLM (bind when the endpoint has ``*`` or ``::`` or is
        ipc/inproc, else connect); ``True`` always binds, e.g. to
        ``tcp://127.0.0.1:5557`` so that DP-rank port offsets can be tested.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        version: str = "0.33",
        hwm: int = 0,
        bind: bool | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.version = version
        self.replay_has_topic = version not in ("0.23", "0.24")
        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, dp_rank) if replay_endpoint else None
        self.drop: set[int] = set()
        self.replays_served = 0
        self._ctx = context or zmq.Context.instance()
        self._buf: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        binds = _binds(self.endpoint) if bind is None else bind
        try:
            if binds:
                self._pub.bind(self.endpoint)
                self.live_endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                self._pub.connect(self.endpoint)
                self.live_endpoint = self.endpoint
        except zmq.ZMQError:
            # A port taken, say: the socket is closed here, not left to the garbage collector.
            self._pub.close(0)
            raise
        self._stop = threading.Event()
        self._thread = None
        self.bound_replay_endpoint = None
        if self.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._router.setsockopt(zmq.LINGER, 0)
            try:
                self._router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                self._router.close(0)
                self._pub.close(0)
                raise
            self.bound_replay_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve_replay, name="vllm-publisher-replay", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- live

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[msgspec.Struct], *, ts: float | None = None) -> int:
        """Encode ``events`` (:mod:`indexer.producer.events` producer events) and publish them.

        Returns the batch's sequence number.
        """
        payload = encode_batch(events, ts=time.time() if ts is None else ts, dp_rank=self.dp_rank,
                               version=self.version)
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        """Publish an already encoded batch payload under the next sequence number."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buf.append((seq, payload))
        if seq not in self.drop:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        return seq

    def publish_many(self, payloads: Iterable[bytes]) -> int:
        """Publish pre-encoded payloads back to back; returns the last sequence number."""
        seq = -1
        for p in payloads:
            seq = self.publish_payload(p)
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the live socket (garbage, wrong frame counts...)."""
        self._pub.send_multipart(frames)

    def restart(self) -> None:
        """Behave like a restarted engine: sequence from 0, empty replay buffer."""
        with self._lock:
            self._seq = 0
            self._buf.clear()
        self.drop = set()

    # --------------------------------------------------------------- replay

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores any other request shape: no reply
            client, _, start = frames
            if len(start) != 8:
                continue
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buf if s >= start_seq]
            for s, p in batches:
                if self.replay_has_topic:
                    self._router.send_multipart((client, b"", self.topic, s.to_bytes(8, "big"), p))
                else:
                    self._router.send_multipart((client, b"", s.to_bytes(8, "big"), p))
            if self.replay_has_topic:
                self._router.send_multipart((client, b"", b"", END_SEQ, b""))
            else:
                self._router.send_multipart((client, b"", END_SEQ, b""))
            self.replays_served += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._router.close(0)
        self._pub.close(0)

    def __enter__(self) -> VllmPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
