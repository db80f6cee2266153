"""Live ingest over real ZMQ sockets (contract §5 R-STR-1..6, R-DEC-3, R-BAD-3).

Every socket is on 127.0.0.1; every wait is a bounded poll (``wait_until``); every
publisher, indexer and raw socket is closed by the ``rig`` fixture. Publishers are
:class:`indexer.producer.publisher.VllmPublisher` (vLLM's wire protocol, checked byte for
byte against the golden captures first), and where a test must hold a replay
open at a precise moment it answers the replay itself with a bare ROUTER
(``ManualReplay``), exactly in vLLM's reply layouts.

The expected index is always rebuilt independently: a fresh ``PrefixIndex`` fed,
in sequence order, exactly the payloads each publisher incarnation sent
(``reference``), compared through ``match()`` answers and resident-entry counts.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

import golden
from evkit import chunks, ehashes, gpu_evictions, removed, store, toks, total
from indexer import PrefixIndex
from indexer.wire.engines import EngineConfig
from indexer.ingest.live import Indexer
from indexer.wire.keys import block_keys
from indexer.producer.publisher import END_SEQ, VllmPublisher
from indexer.producer.events import Cleared, encode_batch
from svc import PortHold, bind_ranks, endpoint_port, probe_until_received, wait_until

LOCAL = "tcp://127.0.0.1:*"
BS = 4


# ----------------------------------------------------------------- helpers


def seq8(s: int) -> bytes:
    return s.to_bytes(8, "big")


class Rec:
    """A publisher plus the log of what its current incarnation sent (for ``reference``)."""

    def __init__(self, pub: VllmPublisher, engine: str, rank: int = 0, model: str = "default") -> None:
        self.pub, self.engine, self.rank, self.model = pub, engine, rank, model
        self.log: list[tuple[int, bytes]] = []
        self.restarts = 0
        self.live_sent = 0  # messages really sent on the live socket (all incarnations)

    def encode(self, events, ts: float | None = None) -> bytes:
        return encode_batch(events, ts=time.time() if ts is None else ts, dp_rank=self.pub.dp_rank,
                            version=self.pub.version)

    def send(self, events, *, drop: bool = False, ts: float | None = None) -> int:
        return self.send_payload(self.encode(events, ts), drop=drop)

    def send_payload(self, payload: bytes, *, drop: bool = False) -> int:
        if drop:
            self.pub.drop.add(self.pub.next_seq)
        seq = self.pub.publish_payload(payload)
        self.live_sent += not drop
        self.log.append((seq, payload))
        return seq

    def restart(self) -> None:
        self.pub.restart()
        self.log = []
        self.restarts += 1


def reference(recs) -> PrefixIndex:
    ref = PrefixIndex()
    for r in recs:
        for seq, p in r.log:
            ref.apply(r.engine, p, model=r.model, dp_rank=r.rank, seq=seq)
    return ref


def answers(index, prompts, model: str = "default") -> list:
    out = []
    for p in prompts:
        d = index.match(p, model=model).to_dict()
        for w in d["workers"]:
            w.pop("last_event_age_s", None)
        out.append(d)
    return out


def assert_same_index(ix: Indexer, ref: PrefixIndex, prompts, model: str = "default") -> None:
    assert answers(ix.index, prompts, model) == answers(ref, prompts, model)
    assert ix.stats()["resident_entries"] == ref.stats()["resident_entries"]


def cfg(pub: VllmPublisher, engine: str, *, replay: bool = True, **kw) -> EngineConfig:
    return EngineConfig(
        id=engine,
        endpoint=pub.live_endpoint,
        replay_endpoint=pub.bound_replay_endpoint if replay else None,
        topic=pub.topic.decode(),
        **kw,
    )


# The publisher bound last on each live endpoint (``Rig.pub``): where ``ready`` and
# ``flush`` send their probes to a worker.
_PUBS: dict[str, VllmPublisher] = {}
# What those probes added to a worker's counters, per (indexer, engine, rank): the
# subscription they went through (a new one counts from zero), its messages, the
# worker's and the index's drop counters. ``wi`` and ``dropped_payloads`` take it back out.
_PROBES: dict[tuple[int, str, int], tuple[object, Counter]] = {}


def _raw_wi(ix: Indexer, engine: str, rank: int = 0) -> dict:
    for w in ix.workers():
        if w["engine"] == engine and w["dp_rank"] == rank:
            return w
    raise AssertionError(f"no worker {engine}/{rank} in {[(w['engine'], w['dp_rank']) for w in ix.workers()]}")


def _less(counts: dict, probes: Counter, prefix: str) -> dict:
    """``counts`` minus the probes' share (keys ``prefix + reason``); a count the probes
    would take below zero stays negative, so that an assertion shows it."""
    out = dict(counts)
    for k, n in probes.items():
        if k.startswith(prefix):
            reason = k[len(prefix):]
            out[reason] = out.get(reason, 0) - n
            if out[reason] == 0:
                del out[reason]
    return out


def _probes(ix: Indexer, engine: str, rank: int) -> Counter:
    got = _PROBES.get((id(ix), engine, rank))
    if got is None or ix._subs.get((engine, rank)) is not got[0]:
        return Counter()
    return got[1]


def wi(ix: Indexer, engine: str, rank: int = 0) -> dict:
    """The worker's status as ``ix.workers()`` says, less what ``ready``/``flush`` probes added."""
    w = _raw_wi(ix, engine, rank)
    pr = _probes(ix, engine, rank)
    if pr:
        w["messages"] -= pr["messages"]
        w["dropped"] = _less(w["dropped"], pr, "worker:")
    return w


def dropped_payloads(ix: Indexer) -> dict:
    """``ix.stats()["dropped_payloads"]``, less what ``ready``/``flush`` probes added."""
    out = ix.stats()["dropped_payloads"]
    for (i, engine, rank) in list(_PROBES):
        if i == id(ix):
            out = _less(out, _probes(ix, engine, rank), "index:")
    return out


def _probing(ix: Indexer, engine: str, rank: int, timeout: float, probe) -> None:
    """Run ``probe(pub, topic, raw_worker)`` against the worker's publisher, then send
    a fence (3 frames, a 5-byte seq: a ``bad_seq_frame`` drop) and wait until the index
    counts it: one connection keeps its order, so every earlier message has then been
    handled. Whatever the probes and the fence added to the counters is recorded."""
    sub = ix._subs.get((engine, rank))
    assert sub is not None, f"{engine}/{rank} is not subscribed"
    pub = _PUBS.get(sub.endpoint)
    assert pub is not None, f"no publisher of this rig is bound on {sub.endpoint} ({engine}/{rank})"
    before_w, before_ix = _raw_wi(ix, engine, rank), Counter(ix.stats()["dropped_payloads"])
    probe(pub, sub.topic, lambda: _raw_wi(ix, engine, rank))
    pub.send_raw([sub.topic, b"fence", b""])
    wait_until(lambda: ix.stats()["dropped_payloads"].get("bad_seq_frame", 0) > before_ix["bad_seq_frame"], timeout,
               msg=f"{engine}/{rank} to handle the fence message")
    after_w, after_ix = _raw_wi(ix, engine, rank), Counter(ix.stats()["dropped_payloads"])
    add = Counter({"messages": after_w["messages"] - before_w["messages"]})
    add.update({f"worker:{k}": n for k, n in (Counter(after_w["dropped"]) - Counter(before_w["dropped"])).items()})
    add.update({f"index:{k}": n for k, n in (after_ix - before_ix).items()})
    prev = _PROBES.get((id(ix), engine, rank))
    total_ = prev[1] + add if prev is not None and prev[0] is sub else add
    _PROBES[(id(ix), engine, rank)] = (sub, total_)


def ready(ix: Indexer, *engines: str, timeout: float = 5.0) -> None:
    """Wait until the engines' SUB sockets are connected and their subscriptions live: a
    PUB drops what it sends before the subscription reaches it, which happens after the
    connect, at the end of the ZMTP handshake. Each worker gets one-frame probes (a
    ``bad_frame_count`` drop, never sequenced) until one arrives, then a fence (see
    ``_probing``); ``wi`` and ``dropped_payloads`` leave their counts out."""
    def ok():
        ws = [w for w in ix.workers() if not engines or w["engine"] in engines]
        return ws and all(w.get("connected") for w in ws)

    wait_until(ok, timeout, msg=f"SUB connected to {engines or 'all'}")

    def probe(pub, topic, raw):
        probe_until_received(lambda: pub.send_raw([topic]), lambda: raw()["messages"], "the SUB", timeout)

    for w in [w for w in ix.workers() if not engines or w["engine"] in engines]:
        _probing(ix, w["engine"], w["dp_rank"], timeout, probe)


def flush(ix: Indexer, engine: str, rank: int = 0, timeout: float = 5.0) -> None:
    """Wait until the worker has handled every live message its publisher sent so far
    (a fence behind them, see ``_probing``): ``messages`` counts a message before the
    ingest thread has acted on it."""
    _probing(ix, engine, rank, timeout, lambda *a: None)


def caught_up(ix: Indexer, engine: str, rank: int, seq: int) -> bool:
    w = wi(ix, engine, rank)
    return w["last_seq"] == seq and not w["replaying"]


def wait_applied(ix: Indexer, rec: Rec, timeout: float = 5.0) -> None:
    """Wait until every live message ``rec`` sent has been received, the worker's last
    applied seq is the publisher's last one and no replay runs."""
    last = rec.pub.next_seq - 1

    def ok():
        w = wi(ix, rec.engine, rec.rank)
        return w["messages"] >= rec.live_sent and w["last_seq"] == last and not w["replaying"]

    wait_until(ok, timeout,
               msg=lambda: f"{rec.engine}/{rec.rank} applied up to seq {last}: {wi(ix, rec.engine, rec.rank)}")


def try_bind(rig, port: int, rport: int | None = None) -> VllmPublisher | None:
    """A publisher bound on ``port`` (and replay ``rport``): a restarted engine on its
    fixed ports, or one coming up on a port held for it (``Rig.hold``). None while the
    old process's port is not free yet."""
    try:
        return rig.pub(f"tcp://127.0.0.1:{port}", None if rport is None else f"tcp://127.0.0.1:{rport}", bind=True)
    except zmq.ZMQError:
        return None


@contextmanager
def streaming(rec: Rec, prompts) -> Iterator[None]:
    """``rec`` publishes a batch every ~2 ms (cycling over ``prompts``) on a thread of its
    own until the block ends: a worker that keeps the ingest thread's hot poll busy."""
    stop = threading.Event()

    def stream() -> None:
        i = 0
        while not stop.is_set():
            rec.send(gpu(prompts[i % len(prompts)], 1 + i % 4))
            i += 1
            time.sleep(0.002)  # pacing: a batch every ~2 ms, not a wait

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


class Rig:
    """Owns every publisher, indexer and raw socket of a test; closes them all."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.pubs: list[VllmPublisher] = []
        self.ixs: list[Indexer] = []
        self.socks: list = []
        self.holds: list[PortHold] = []

    def pub(self, endpoint: str = LOCAL, replay_endpoint: str | None = LOCAL, **kw) -> VllmPublisher:
        p = VllmPublisher(endpoint, replay_endpoint, **kw)
        self.pubs.append(p)
        _PUBS[p.live_endpoint] = p
        return p

    def hold(self) -> PortHold:
        """A port held for the test (see ``svc.PortHold``): an engine that is down, or
        one that comes up, or back, later on a port the indexer was given up front."""
        h = PortHold()
        self.holds.append(h)
        return h

    def indexer(self, engines=(), *, start: bool = True, **kw) -> Indexer:
        kw.setdefault("reconnect_ivl_max_ms", 500)
        ix = Indexer(engines, **kw)
        self.ixs.append(ix)
        if start:
            ix.start()
        return ix

    def sock(self, kind):
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        self.socks.append(s)
        return s

    def close(self) -> None:
        dead = [ix.error for ix in self.ixs if ix.error]  # the ingest thread crashed
        for ix in self.ixs:
            th = ix._thread  # a dead thread never answers stop(): clean up around it
            if th is not None and not th.is_alive():
                ix._thread = None
                if ix._wake_tx is not None:
                    ix._wake_tx.close(0)
                    ix._wake_tx = None
                continue
            try:
                if ix._wake_tx is not None:  # bound a stop() that would block forever on its wake-up send
                    ix._wake_tx.setsockopt(zmq.SNDTIMEO, 3000)
                ix.stop()
            except Exception:  # pragma: no cover - keep closing the rest
                pass
        for p in self.pubs:
            try:
                p.close()
            except Exception:  # pragma: no cover
                pass
        for s in self.socks:
            s.close(0)
        for h in self.holds:
            h.close()
        for ep, p in list(_PUBS.items()):
            if p in self.pubs:
                del _PUBS[ep]
        for k in [k for k in _PROBES if k[0] in {id(ix) for ix in self.ixs}]:
            del _PROBES[k]
        assert not dead, f"the ingest thread died during the test: {dead}"


@pytest.fixture
def rig():
    r = Rig()
    try:
        yield r
    finally:
        r.close()


class ManualReplay:
    """A replay endpoint answered by the test (a bare ROUTER), in vLLM's layouts."""

    def __init__(self, rig: Rig) -> None:
        self.sock = rig.sock(zmq.ROUTER)
        self.sock.bind(LOCAL)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def request(self, timeout: float = 5.0) -> tuple[bytes, int]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError("no replay request arrived")
        client, empty, start = self.sock.recv_multipart()
        assert empty == b"" and len(start) == 8
        return client, int.from_bytes(start, "big")

    def no_request(self, wait: float = 0.1) -> bool:
        return not self.sock.poll(int(wait * 1000))

    def answer(self, client: bytes, batches, *, with_topic: bool = True, topic: bytes = b"") -> None:
        for s, p in batches:
            head = [client, b"", topic] if with_topic else [client, b""]
            self.sock.send_multipart(head + [seq8(s), p])
        self.sock.send_multipart([client, b"", b"", END_SEQ, b""] if with_topic else [client, b"", END_SEQ, b""])

    def relay(self, rig: Rig, client: bytes, start: int, pub: VllmPublisher) -> None:
        """Forward one request to a real publisher's replay endpoint, relay its answer verbatim."""
        d = rig.sock(zmq.DEALER)
        d.connect(pub.bound_replay_endpoint)
        d.send_multipart([b"", seq8(start)])
        while True:
            assert d.poll(5000), "real publisher did not answer the relayed replay"
            frames = d.recv_multipart()
            self.sock.send_multipart([client] + frames)
            if frames[-1] == b"":
                return


P = [toks(1 + 1000 * i, 4, BS) for i in range(8)]  # 8 distinct 4-block prompts


def gpu(p, k=4):
    return [store(p, BS, 0, k)]


# ------------------------------------------------- publisher fidelity (golden)


@pytest.mark.parametrize("vdir", sorted(golden.VERSIONS))
def test_publisher_reproduces_golden_vllm_frames(rig, vdir):
    fr = golden.frames(vdir)
    ver = golden.VERSIONS[vdir]
    assert fr["buffer_steps"] == 2
    live = [[bytes.fromhex(x) for x in m] for m in fr["live_frames_hex"]]
    pub = rig.pub(topic=fr["topic"], version=ver, buffer_steps=fr["buffer_steps"])
    assert pub.live_endpoint.startswith("tcp://127.0.0.1:") and pub.bound_replay_endpoint.startswith("tcp://127.0.0.1:")

    sub = rig.sock(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.live_endpoint)
    # Numbered probes (no sequence number consumed) until the subscription is live.
    n = 0
    got_probe = -1
    deadline = time.monotonic() + 5
    while got_probe < 0:
        assert time.monotonic() < deadline, "raw SUB never received a probe"
        pub.send_raw([b"probe", str(n).encode()])
        n += 1
        if sub.poll(20):
            got_probe = int(sub.recv_multipart()[1])
    while got_probe < n - 1:  # drain the probes still in flight
        assert sub.poll(2000)
        got_probe = int(sub.recv_multipart()[1])

    for m in live:  # the same events re-encoded by the publisher, byte for byte
        ts, events, rank = msgspec.msgpack.decode(m[2])
        assert rank == 0
        pub.publish(golden.as_events(events), ts=ts)
    got = []
    for _ in live:
        assert sub.poll(2000)
        got.append(sub.recv_multipart())
    assert got == live
    assert not sub.poll(50)

    dealer = rig.sock(zmq.DEALER)
    dealer.connect(pub.bound_replay_endpoint)

    def exchange(request):
        dealer.send_multipart(request)
        out = []
        while True:
            assert dealer.poll(2000), "no replay reply"
            f = dealer.recv_multipart()
            out.append(f)
            if f[-1] == b"" and END_SEQ in f:
                return out

    req0 = [bytes.fromhex(x) for x in fr["replay_request_from_0_hex"]]
    assert req0 == [b"", seq8(0)]
    key0 = next(k for k in fr if k.startswith("replay_reply_from_0_hex"))
    want0 = [[bytes.fromhex(x) for x in m] for m in fr[key0]]
    assert exchange(req0) == want0  # buffer_steps=2: silently starts at 1, then the end marker
    want2 = [[bytes.fromhex(x) for x in m] for m in fr["replay_reply_from_2_hex"]]
    assert exchange([b"", seq8(2)]) == want2
    wait_until(lambda: pub.replays_served == 2, msg="replays_served counted")


# ------------------------------------------------------------------ R-STR-1


def test_R_STR_1_live_batches_applied_in_order_each_once(rig):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    h0 = ehashes(P[0], BS)
    rec.send(gpu(P[0]))                     # 0: store P0 (4 blocks)
    rec.send(gpu(P[1], 2))                  # 1: store P1[0:2]
    rec.send(gpu_evictions(h0[2:]))         # 2: evict P0 blocks 2, 3 (order matters)
    rec.send(gpu(P[0]))                     # 3: re-store P0 (blocks 0, 1 now counted twice)
    rec.send(gpu_evictions(h0))             # 4: one eviction each: 0, 1 still held once, 2, 3 gone
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["batches"] == 5 and w["last_seq"] == 4
    assert w["gaps"] == 0 and w["replays_ok"] == 0 and w["replays_failed"] == 0 and not w["stale"]
    assert total(ix, P[0], "e1") == 2 and total(ix, P[1], "e1") == 2
    assert_same_index(ix, reference([rec]), P[:2])


def test_R_STR_1_replay_overlap_already_applied_batches_are_skipped(rig):
    """The replay answer repeats batches already applied (seq 0) and batches that
    were buffered live during the replay (2, 3): each is applied exactly once."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)])
    ready(ix)
    h1 = ehashes(P[1], BS)
    rec.send(gpu(P[0]))                             # 0: live
    rec.send(gpu(P[1]), drop=True)                  # 1: lost live
    rec.send(gpu(P[2]))                             # 2: live -> gap, replay from the anchor 0
    rec.send(gpu_evictions(h1))                     # 3: live, buffered during the replay
    client, start = man.request()
    assert start == 0  # R-STR-7: from the anchor, the last applied seq
    wait_until(lambda: wi(ix, "e1")["messages"] == 3, msg="live 2 and 3 received")
    # Overlapping answer: seq 0 (applied), 1 (missing), 2 and 3 (buffered) and 0 again.
    man.answer(client, rec.log + [rec.log[0]])
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["batches"] == 4, w                      # 0, 1, 2, 3 once each
    assert w["replays_ok"] == 1 and not w["stale"]
    assert total(ix, P[1], "e1") == 0               # store (1) then eviction (3), once each
    assert total(ix, P[0], "e1") == 4 and total(ix, P[2], "e1") == 4
    assert ix.stats()["resident_entries"] == 8       # not doubled
    assert_same_index(ix, reference([rec]), P[:3])


def test_R_STR_1_live_batch_already_applied_by_replay_is_skipped(rig):
    """vLLM answers a replay with everything it buffers from the requested seq, so the
    reply often holds batches still in flight on the live socket. When such a batch
    then arrives live (seq <= last applied) it was already applied: skip it. It is not
    an engine restart: the worker keeps its residency, nothing is replayed again."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)],
                     replay_timeout_s=1.0)
    ready(ix)
    rec.send(gpu(P[0]))                             # 0: live
    rec.send(gpu(P[1]), drop=True)                  # 1: lost live
    rec.send(gpu(P[2]))                             # 2: live -> gap, replay from the anchor 0
    client, start = man.request()
    assert start == 0  # R-STR-7: from the anchor, the last applied seq
    # 3 is published before the engine answers, so the answer carries 1, 2 and 3, but
    # its live copy is read after the answer (still queued behind the SUB socket: here
    # made deterministic by sending it live once the answer has been applied).
    p3 = rec.encode(gpu(P[3]))
    man.answer(client, rec.log + [(3, p3)])
    wait_until(lambda: caught_up(ix, "e1", 0, 3), msg="replay applied 1..3")
    assert wi(ix, "e1")["replays_ok"] == 1
    assert rec.send_payload(p3) == 3                # live copy of 3
    rec.send(gpu(P[4]))                             # 4: next live batch
    wait_until(lambda: wi(ix, "e1")["messages"] == rec.live_sent, msg="live 3 and 4 received")
    second = not man.no_request(0.2)
    w = wi(ix, "e1")
    got = [total(ix, P[i], "e1") for i in range(5)]
    assert (w["restarts"], second, got) == (0, False, [4, 4, 4, 4, 4]), (
        f"live seq 3 after replayed seq 3: restarts={w['restarts']}, second replay requested={second}, "
        f"blocks of P0..P4={got}, worker={w}")
    assert w["batches"] == 5 and w["replays_ok"] == 1 and not w["stale"] and w["last_seq"] == 4
    assert_same_index(ix, reference([rec]), P[:5])


def test_R_STR_1_replay_overlap_skipped_after_many_replays(rig):
    """The same overlap as above, again and again, with more batches lost each round
    (small ``max_buffered``: at most 2 live batches wait during a replay here, and
    only 1 does): every live copy of a replayed batch is skipped, never taken for a
    restart, however many replays came before and however long the replay is."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)],
                     max_buffered=2, replay_timeout_s=1.0)
    ready(ix)
    rec.send(gpu(P[0]))
    wait_applied(ix, rec)
    for rnd in range(6):
        lost = 1 + rnd
        ps = [toks(50_000 + 1000 * rnd + 10 * j, 1, BS) for j in range(lost + 3)]
        first = rec.pub.next_seq
        for j in range(lost):
            rec.send(gpu(ps[j], 1), drop=True)      # lost
        rec.send(gpu(ps[lost], 1))                  # gap -> replay from `first`
        client, start = man.request()
        assert start == first - 1  # R-STR-7: from the anchor
        nxt = first + lost + 1
        pn = rec.encode(gpu(ps[lost + 1], 1))
        man.answer(client, rec.log[-(lost + 2):] + [(nxt, pn)])   # ... and one not yet read live
        wait_until(lambda: caught_up(ix, "e1", 0, nxt), msg=lambda: f"round {rnd}: replay applied {wi(ix, 'e1')}")
        rec.send_payload(pn)                        # live copy of a replayed batch
        rec.send(gpu(ps[lost + 2], 1))              # in order
        wait_until(lambda: wi(ix, "e1")["messages"] == rec.live_sent, msg="live received")
        flush(ix, "e1")                             # ... and handled
        w = wi(ix, "e1")
        assert (w["restarts"], w["last_seq"], w["replaying"], w["stale"]) == (0, nxt + 1, False, False), (
            f"round {rnd} ({lost} lost): live copy of replayed seq {nxt}: {w}")
        assert man.no_request(0.01)
    assert_same_index(ix, reference([rec]), [P[0]])   # and the same resident entries (4 + 4..9)


BURST = 2000
ROUNDS = 3


def test_R_STR_1_live_backlog_behind_a_replay_is_not_a_restart(rig):
    """Real publisher, no tricks: one batch lost, then a burst. vLLM answers a replay
    with everything it buffers from the lost seq on, so the answer can overtake the
    live backlog: live batches then arrive that the replay already applied. They must
    be skipped; the worker keeps its residency and stays fresh. The ring
    (buffer_steps=BURST + 50) always holds the lost seq but no longer seq 0, so a
    correct indexer passes every round; a spurious restart here cannot even be
    repaired by a replay from 0. Whether the answer overtakes the backlog depends on
    thread timing, so the scenario runs up to 5 rounds (fresh publisher and indexer)."""
    prompts = [toks(100_000 + 100 * i, 2, BS) for i in range(100 + BURST)]
    events = [[store(p, BS, 0, 2)] for p in prompts]
    for rnd in range(ROUNDS):
        pub = rig.pub(buffer_steps=BURST + 50)
        rec = Rec(pub, "e1")
        ix = rig.indexer([cfg(pub, "e1")])
        ready(ix)
        for i in range(100):
            rec.send(events[i])
        wait_applied(ix, rec)
        for i in range(100, 100 + BURST):                      # the burst, every 100th lost
            rec.send(events[i], drop=i % 100 == 0 and i < BURST)
        wait_applied(ix, rec, timeout=10)
        w = wi(ix, "e1")
        got = (w["restarts"], w["stale"], w["stale_reason"], ix.stats()["resident_entries"])
        assert got == (0, False, None, 2 * (100 + BURST)), (
            f"round {rnd}: (restarts, stale, reason, resident entries) = {got}; worker {w}")
        assert w["replays_ok"] >= 1 and w["batches"] == 100 + BURST
        assert_same_index(ix, reference([rec]), prompts[::97])
        ix.stop()
        pub.close()


# ------------------------------------------------------------------ R-STR-2


@pytest.mark.parametrize("ver", ["0.33", "0.24"])  # reply with and without the topic frame
def test_R_STR_2_dropped_batches_repaired_by_replay(rig, ver):
    pub = rig.pub(version=ver, topic="kv")
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    drops = {3, 4, 9, 15, 16, 17}
    for i in range(24):
        p = P[i % len(P)]
        h = ehashes(p, BS)
        events = gpu(p, 1 + i % 4) if i % 3 else gpu_evictions(h[i % 4:]) + chunks(p, BS, 2)
        rec.send(events, drop=i in drops)
        if i in (5, 12):  # the gaps so far repaired before more traffic: three rounds of repair
            wait_applied(ix, rec)
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["replays_ok"] >= 1 and w["gaps"] >= 1 and w["replays_failed"] == 0
    assert not w["stale"] and w["stale_reason"] is None
    assert w["batches"] == 24 and w["last_seq"] == 23
    wait_until(lambda: pub.replays_served == w["replays_ok"], msg="every replay served once")
    assert_same_index(ix, reference([rec]), P)


@pytest.mark.parametrize("with_topic", [True, False], ids=["0.26+topic", "pre0.26"])
def test_R_STR_2_live_batches_buffered_during_replay_applied_after(rig, with_topic):
    pub = rig.pub(replay_endpoint=None, topic="kv")
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint, topic="kv")])
    ready(ix)
    h1 = ehashes(P[1], BS)
    rec.send(gpu(P[0]))                       # 0
    rec.send(gpu(P[1]), drop=True)            # 1: lost; stores P1
    rec.send(gpu_evictions(h1[1:]))           # 2: evicts P1 blocks 1..3 (only right after 1)
    rec.send(gpu(P[2]))                       # 3
    client, start = man.request()
    assert start == 0  # R-STR-7: from the anchor, the last applied seq
    wait_until(lambda: wi(ix, "e1")["messages"] == 3, msg="live 2 and 3 received")
    flush(ix, "e1")                           # ... and handled (buffered, not applied)
    w = wi(ix, "e1")
    assert w["replaying"] and w["last_seq"] == 0
    assert total(ix, P[2], "e1") == 0, "a live batch was applied before the missing ones"
    man.answer(client, rec.log, with_topic=with_topic, topic=b"kv")
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["replays_ok"] == 1 and w["replays_failed"] == 0 and not w["stale"]
    assert w["batches"] == 4
    assert total(ix, P[1], "e1") == 1            # stored by 1, then 2 evicted blocks 1..3
    assert total(ix, P[2], "e1") == 4
    assert man.no_request()
    assert_same_index(ix, reference([rec]), P[:3])


# ------------------------------------------------------------------ R-STR-3


@pytest.mark.parametrize("how", ["before_start", "before_add_engine"])
def test_R_STR_3_late_join_replays_from_0(rig, how):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    for i in range(3):                         # nobody listens yet
        rec.send(gpu(P[i]))
    rec.live_sent = 0
    if how == "before_start":
        ix = rig.indexer([cfg(pub, "e1")])
    else:
        ix = rig.indexer([])
        ix.add_engine(cfg(pub, "e1"))
    ready(ix)
    assert total(ix, P[0], "e1") == 0
    rec.send(gpu(P[3]))                        # first batch seen: seq 3 > 0
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert not w["stale"] and w["replays_ok"] == 1 and w["replays_failed"] == 0
    assert w["batches"] == 4
    assert_same_index(ix, reference([rec]), P[:4])


def test_R_STR_3_late_join_without_replay_endpoint_is_stale(rig):
    pub = rig.pub(replay_endpoint=None)
    rec = Rec(pub, "e1")
    for i in range(3):
        rec.send(gpu(P[i]))
    rec.live_sent = 0                          # nobody listened
    ix = rig.indexer([cfg(pub, "e1", replay=False)])
    ready(ix)
    rec.send(gpu(P[3]))
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["stale"] and "no replay endpoint" in w["stale_reason"], w
    assert total(ix, P[3], "e1") == 4 and total(ix, P[0], "e1") == 0
    m = ix.match(P[3]).worker("e1", 0)
    assert m.stale and m.stale_reason == w["stale_reason"]
    assert ix.stats()["stale_workers"] == 1


# ------------------------------------------------------------------ R-STR-4


def test_R_STR_4_replay_buffer_overrun_is_stale_then_restart_recovers(rig):
    pub = rig.pub(buffer_steps=3)
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    rec.send(gpu(P[0]))                            # 0: applied
    for i in range(1, 6):
        rec.send(gpu(P[i]), drop=True)             # 1..5 lost; the ring keeps only 3 batches
    rec.send(gpu(P[6]))                            # 6: gap, replay from 1 starts at 4
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["stale"] and "overrun" in w["stale_reason"], w
    assert w["replays_failed"] == 1
    reason = w["stale_reason"]
    assert total(ix, P[0], "e1") == 4              # index kept
    assert [total(ix, P[i], "e1") for i in range(1, 7)] == [0, 0, 0, 4, 4, 4]
    rec.send(gpu(P[7]))                            # later batches still applied
    wait_applied(ix, rec)
    assert total(ix, P[7], "e1") == 4
    w = wi(ix, "e1")
    assert w["stale"] and w["stale_reason"] == reason
    assert ix.match(P[7]).worker("e1", 0).stale

    # Documented recovery: the engine restarts (seq 0 again, empty caches).
    rec.restart()
    rec.send(gpu(P[1], 3))
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert not w["stale"] and w["stale_reason"] is None and w["restarts"] == 1
    assert total(ix, P[0], "e1") == 0 and total(ix, P[1], "e1") == 3
    assert_same_index(ix, reference([rec]), P)


def test_R_STR_4_gap_without_replay_endpoint_is_stale(rig):
    pub = rig.pub(replay_endpoint=None)
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1", replay=False)])
    ready(ix)
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]), drop=True)
    rec.send(gpu(P[2]))
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["stale"] and "no replay endpoint" in w["stale_reason"], w
    assert total(ix, P[0], "e1") == 4 and total(ix, P[1], "e1") == 0 and total(ix, P[2], "e1") == 4
    rec.send(gpu(P[3]))
    wait_applied(ix, rec)
    assert total(ix, P[3], "e1") == 4 and wi(ix, "e1")["stale"]


def test_R_STR_4_replay_timeout_is_stale_then_resync_recovers(rig):
    """The replay endpoint never answers (a ROUTER we bind ourselves): stale "timed
    out" after replay_timeout_s, the buffered live batch is still applied. Then
    ``resync()`` is answered by the real publisher, which still holds seq 0."""
    pub = rig.pub()                                 # real replay endpoint, used via the relay
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)],
                     replay_timeout_s=0.5)
    ready(ix)
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]), drop=True)
    t0 = time.monotonic()
    rec.send(gpu(P[2]))
    client, start = man.request()
    assert start == 0  # R-STR-7: from the anchor, the last applied seq                               # ... and never answered
    wait_until(lambda: wi(ix, "e1")["stale"], timeout=3, msg="stale after the replay timeout")
    assert time.monotonic() - t0 >= 0.45
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert "timed out" in w["stale_reason"] and w["replays_failed"] == 1, w
    assert total(ix, P[0], "e1") == 4 and total(ix, P[1], "e1") == 0 and total(ix, P[2], "e1") == 4
    assert ix.match(P[2]).worker("e1", 0).stale

    ix.resync("e1")
    client, start = man.request()
    assert start == 0
    man.relay(rig, client, start, pub)              # the real publisher's answer, verbatim
    wait_until(lambda: not wi(ix, "e1")["stale"], msg="stale cleared by resync")
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["stale_reason"] is None and w["replays_ok"] == 1
    assert total(ix, P[1], "e1") == 4
    assert_same_index(ix, reference([rec]), P[:3])
    rec.send(gpu(P[3]))
    wait_applied(ix, rec)
    assert not wi(ix, "e1")["stale"]
    assert_same_index(ix, reference([rec]), P[:4])


def test_R_STR_4_resync_against_real_publisher_clears_stale(rig):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]))
    wait_applied(ix, rec)
    ix.index.mark_stale("e1", 0, "lost track")      # whatever made it stale
    assert wi(ix, "e1")["stale"]
    ix.resync("e1")
    wait_until(lambda: not wi(ix, "e1")["stale"] and wi(ix, "e1")["replays_ok"] == 1, msg="resync done")
    wait_applied(ix, rec)
    wait_until(lambda: pub.replays_served == 1, msg="one replay served")
    assert wi(ix, "e1")["batches"] >= 2
    assert_same_index(ix, reference([rec]), P[:2])


# ------------------------------------------------------------------ R-STR-5


def test_R_STR_5_restart_drops_old_residency_before_new_batches(rig):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    rec.send(gpu(P[0]) + chunks(P[0], BS, 2))
    rec.send(gpu(P[1]))
    wait_applied(ix, rec)
    assert total(ix, P[0], "e1") == 4
    rec.restart()
    rec.send(gpu(P[0], 2) + gpu(P[2]))             # new incarnation re-stores 2 blocks of P0
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    assert w["restarts"] == 1 and w["last_seq"] == 0 and not w["stale"]
    assert total(ix, P[1], "e1") == 0               # old prompt gone
    assert total(ix, P[2], "e1") == 4               # new one there
    assert ix.match(P[0]).worker("e1", 0).tiers == {"GPU": 2}  # no CPU, not 4 blocks
    assert ix.stats()["resident_entries"] == 6       # 2 + 4, nothing doubled
    assert ix.stats()["counters"].get("restarts") == 1
    rec.restart()
    rec.send(gpu(P[3]))
    wait_applied(ix, rec)
    assert wi(ix, "e1")["restarts"] == 2
    assert_same_index(ix, reference([rec]), P[:4])


def test_R_STR_5_restart_while_replaying_is_detected(rig):
    """The engine restarts while the indexer waits for a replay: its new seq 0 arrives
    live after the old seq 2 (the sequence went backwards on the wire). The restart
    must drop the old residency and the new batch must apply."""
    pub = rig.pub(replay_endpoint=None)
    man = ManualReplay(rig)
    rec = Rec(pub, "e1")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=pub.live_endpoint, replay_endpoint=man.endpoint)],
                     replay_timeout_s=2.0)
    ready(ix)
    rec.send(gpu(P[0]))                     # 0
    rec.send(gpu(P[1]), drop=True)          # 1: lost
    rec.send(gpu(P[2]))                     # 2: gap -> replay from the anchor 0
    client, start = man.request()
    assert start == 0  # R-STR-7: from the anchor, the last applied seq
    old = list(rec.log)
    rec.restart()
    rec.send(gpu(P[5]))                     # new incarnation, seq 0
    wait_until(lambda: wi(ix, "e1")["messages"] == 3, msg="new seq 0 received during the replay")
    man.answer(client, old)                 # the old engine's buffer from 0 (0, 1, 2)
    wait_until(lambda: not wi(ix, "e1")["replaying"], msg="replay finished")
    flush(ix, "e1")                         # the live batches behind the replay handled too
    got = {i: total(ix, P[i], "e1") for i in (0, 1, 2, 5)}
    assert got == {0: 0, 1: 0, 2: 0, 5: 4}, f"after a restart seen during a replay: {got}, worker {wi(ix, 'e1')}"


def test_R_STR_5_R_STR_7_restart_with_an_engine_clock_behind_is_proven_by_replay(rig):
    """The engine comes back (seq 0 again, same socket: no reconnect to see) on a host
    whose clock is a minute behind the old one, so its batches carry older timestamps.
    By R-STR-5 its seq 0 is no restart (ts not newer). But PUB never repeats a batch
    that no replay applied, so continuity must be proven at once (R-STR-7): the replay
    from the anchor (2) finds nothing from 2 on in the new engine's ring (or another ts
    at 2), so the restart is proven, the old residency dropped, the new one rebuilt."""
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")])
    ready(ix)
    t = time.time()
    for i in range(3):
        rec.send(gpu(P[i]), ts=t + i)
    wait_applied(ix, rec)
    rec.restart()
    for i in (5, 6, 7, 4):
        rec.send(gpu(P[i]), ts=t - 65 + i)  # new incarnation: seqs 0..3, clock behind
    wait_applied(ix, rec)
    w = wi(ix, "e1")
    got = {i: total(ix, P[i], "e1") for i in (0, 1, 2, 4, 5, 6, 7)}
    assert got == {0: 0, 1: 0, 2: 0, 4: 4, 5: 4, 6: 4, 7: 4}, (got, w)
    assert w["restarts"] == 1 and not w["stale"], w
    assert ix.stats()["counters"].get("continuity_restart") == 1
    assert_same_index(ix, reference([rec]), P)


# --------------------------------------------------------------- DP ranks


def test_R_DEC_4_dp_ranks_on_offset_ports_are_independent_workers(rig):
    pubs = bind_ranks(rig.pub, 2)
    base, rbase = endpoint_port(pubs[0].live_endpoint), endpoint_port(pubs[0].bound_replay_endpoint)
    assert [p.live_endpoint for p in pubs] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    assert [p.bound_replay_endpoint for p in pubs] == [f"tcp://127.0.0.1:{rbase}", f"tcp://127.0.0.1:{rbase + 1}"]
    recs = [Rec(p, "dp", r) for r, p in enumerate(pubs)]
    ix = rig.indexer([EngineConfig(id="dp", endpoint=f"tcp://127.0.0.1:{base}",
                                   replay_endpoint=f"tcp://127.0.0.1:{rbase}", dp_size=2)])
    ready(ix)
    w0, w1 = wi(ix, "dp", 0), wi(ix, "dp", 1)
    assert (w0["endpoint"], w1["endpoint"]) == (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")
    assert (w0["replay_endpoint"], w1["replay_endpoint"]) == (
        f"tcp://127.0.0.1:{rbase}", f"tcp://127.0.0.1:{rbase + 1}")
    recs[0].send(gpu(P[0]))
    recs[1].send(gpu(P[1]))
    recs[1].send(gpu(P[0], 2))
    recs[1].send(gpu(P[2]), drop=True)               # rank 1 only: repaired from port rbase+1
    recs[1].send(gpu(P[3]))
    recs[0].send(gpu_evictions(ehashes(P[0], BS)[3:]))
    for r in recs:
        wait_applied(ix, r)
    wait_until(lambda: pubs[1].replays_served == 1, msg="rank 1 served its replay")
    assert pubs[0].replays_served == 0
    m = ix.match(P[0])
    assert m.worker("dp", 0).total_blocks == 3 and m.worker("dp", 1).total_blocks == 2
    assert total(ix, P[1], "dp", 0) == 0 and total(ix, P[1], "dp", 1) == 4
    assert total(ix, P[2], "dp", 1) == 4 and total(ix, P[3], "dp", 1) == 4
    w0, w1 = wi(ix, "dp", 0), wi(ix, "dp", 1)
    assert (w0["last_seq"], w1["last_seq"]) == (1, 3)
    assert (w0["replays_ok"], w1["replays_ok"]) == (0, 1) and not w0["stale"] and not w1["stale"]
    assert_same_index(ix, reference(recs), P[:4])
    # A restart of rank 1 leaves rank 0 alone.
    recs[1].restart()
    recs[1].send(gpu(P[4]))
    wait_applied(ix, recs[1])
    assert total(ix, P[0], "dp", 0) == 3 and total(ix, P[0], "dp", 1) == 0
    assert (wi(ix, "dp", 0)["restarts"], wi(ix, "dp", 1)["restarts"]) == (0, 1)
    assert_same_index(ix, reference(recs), P[:5])


# ------------------------------------------------------------------ R-STR-6


def test_R_STR_6_engines_added_and_removed_at_run_time(rig):
    pa, pb = rig.pub(), rig.pub(version="0.23")
    ra, rb = Rec(pa, "a"), Rec(pb, "b")
    ix = rig.indexer([cfg(pa, "a")])
    ready(ix)
    ra.send(gpu(P[0]))
    wait_applied(ix, ra)

    cb = cfg(pb, "b")
    assert ix.add_engine(cb) == cb                  # while running
    assert {e.id for e in ix.engines()} == {"a", "b"}
    ready(ix, "b")
    rb.send(gpu(P[0]) + gpu(P[1]))
    wait_applied(ix, rb)
    assert {w.engine for w in ix.match(P[0]).workers} == {"a", "b"}

    with pytest.raises(ValueError):
        ix.add_engine(id="b", endpoint=pb.live_endpoint, model="other")
    with pytest.raises(ValueError):
        ix.add_engine(dict(id="a", endpoint="tcp://127.0.0.1:1"))
    assert ix.add_engine(**msgspec.structs.asdict(cb)) == cb   # identical: a no-op
    assert len([w for w in ix.workers() if w["engine"] == "b"]) == 1
    assert wi(ix, "b")["connected"] and total(ix, P[1], "b") == 4
    rb.send(gpu(P[2]))
    wait_applied(ix, rb)
    assert wi(ix, "b")["batches"] == 2 and wi(ix, "b")["replays_ok"] == 0

    entries_a = 4
    assert ix.remove_engine("b") is True
    assert [w["engine"] for w in ix.workers()] == ["a"]
    assert {w.engine for w in ix.match(P[0]).workers} == {"a"}
    assert ix.stats()["resident_entries"] == entries_a
    assert ix.remove_engine("b") is False
    rb.send(gpu(P[3]))                              # no longer subscribed
    ra.send(gpu(P[3]))
    wait_applied(ix, ra)
    time.sleep(0.1)  # nothing may arrive from b (no SUB left to probe): a sleep, not a probe
    assert [w["engine"] for w in ix.workers()] == ["a"]
    assert total(ix, P[3], "b") == 0
    assert ix.stats()["resident_entries"] == entries_a + 4


def test_R_STR_6_publisher_up_later_is_picked_up_and_down_one_blocks_nobody(rig):
    port = rig.hold().port  # the late engine binds it later (the indexer knows it up front)
    dead = rig.hold().port  # held, never listening: nobody ever answers there
    good = rig.pub()
    rg = Rec(good, "good")
    ix = rig.indexer([
        EngineConfig(id="late", endpoint=f"tcp://127.0.0.1:{port}"),
        EngineConfig(id="down", endpoint=f"tcp://127.0.0.1:{dead}"),  # nobody ever listens
        cfg(good, "good"),
    ])
    ready(ix, "good")
    rg.send(gpu(P[0]))
    wait_applied(ix, rg)
    assert not wi(ix, "late")["connected"] and not wi(ix, "down")["connected"]

    late = rig.pub(f"tcp://127.0.0.1:{port}", None, bind=True)   # the engine comes up now
    rl = Rec(late, "late")
    ready(ix, "late")
    rl.send(gpu(P[1]))
    rg.send(gpu(P[2]))
    wait_applied(ix, rl)
    wait_applied(ix, rg)
    assert total(ix, P[1], "late") == 4 and total(ix, P[2], "good") == 4
    assert not wi(ix, "late")["stale"]
    assert not wi(ix, "down")["connected"] and wi(ix, "down")["last_seq"] is None

    # The late engine goes away: the others keep flowing; it comes back (a new
    # process, seq from 0) and is picked up again, its old residency dropped.
    late.close()
    wait_until(lambda: not wi(ix, "late")["connected"], msg="late disconnected")
    rg.send(gpu(P[3]))
    wait_applied(ix, rg)
    assert total(ix, P[3], "good") == 4
    assert total(ix, P[1], "late") == 4             # index kept while it is away

    late2 = wait_until(lambda: try_bind(rig, port), msg="rebind the late engine's port")
    rl2 = Rec(late2, "late")
    rl2.live_sent = rl.live_sent               # same worker, its messages count on
    ready(ix, "late")
    rl2.send(gpu(P[4]))
    wait_until(lambda: total(ix, P[4], "late") == 4, msg="restarted late engine's batch applied")
    wait_applied(ix, rl2)
    assert total(ix, P[4], "late") == 4 and total(ix, P[1], "late") == 0
    assert wi(ix, "late")["restarts"] == 1
    assert_same_index(ix, reference([rl2, rg]), P[:5])


BAD_ENDPOINT = dict(id="bad", endpoint="tcp://127.0.0.1:notaport")  # libzmq refuses it (EINVAL)


def test_R_STR_6_add_engine_with_unusable_endpoint_raises_ValueError_and_registers_nothing(rig):
    good = rig.pub()
    rg = Rec(good, "good")
    ix = rig.indexer([cfg(good, "good")])
    ready(ix)
    with pytest.raises(ValueError):
        ix.add_engine(**BAD_ENDPOINT)
    assert [e.id for e in ix.engines()] == ["good"], "a rejected engine stays registered"
    assert [w["engine"] for w in ix.workers()] == ["good"]
    rg.send(gpu(P[0]))
    wait_applied(ix, rg)


def test_R_STR_6_unusable_endpoint_in_configuration_blocks_nobody(rig):
    """Rejected at construction (ValueError), or at least the other engines are served."""
    good = rig.pub()
    rg = Rec(good, "good")
    try:
        ix = rig.indexer([cfg(good, "good"), BAD_ENDPOINT])
    except ValueError:
        return
    assert ix.running
    ready(ix, "good", timeout=2)
    rg.send(gpu(P[1]))
    wait_applied(ix, rg, timeout=2)


# ---------------------------------------------------------- R-DEC-3 / R-BAD-3


def test_R_DEC_3_R_BAD_3_garbage_frames_counted_per_worker_and_stream_continues(rig):
    pub = rig.pub()
    other = rig.pub()
    rec, ro = Rec(pub, "e1"), Rec(other, "e2")
    ix = rig.indexer([cfg(pub, "e1"), cfg(other, "e2")])
    ready(ix)
    rec.send(gpu(P[0]))                                      # seq 0
    wait_applied(ix, rec)
    good = encode_batch(gpu(P[7]), ts=time.time())
    pub.send_raw([b"", seq8(1)])                             # 2 frames
    pub.send_raw([b"", seq8(1), good, b"extra"])             # 4 frames
    pub.send_raw([b"only one frame"])                        # 1 frame
    pub.send_raw([b"", b"\x00" * 7, good])                   # 7-byte seq
    pub.send_raw([b"", b"\x00" * 9, good])                   # 9-byte seq
    pub.publish_payload(b"\xc1 this is not msgpack")         # seq 1: undecodable payload
    rec.log.append((1, b"\xc1 this is not msgpack"))
    pub.publish_payload(msgspec.msgpack.encode({"not": "a batch"}))  # seq 2: decodes, not a batch
    rec.log.append((2, msgspec.msgpack.encode({"not": "a batch"})))
    rec.send(gpu(P[1]))                                      # seq 3: a good batch after them
    ro.send(gpu(P[2]))
    wait_until(lambda: total(ix, P[1], "e1") == 4, msg="good batch after the garbage applied")
    wait_applied(ix, ro)
    w = wi(ix, "e1")
    assert w["dropped"] == {"bad_frame_count": 3, "bad_seq_frame": 2, "bad_payload": 2}, w["dropped"]
    assert dropped_payloads(ix) == w["dropped"]
    assert wi(ix, "e2")["dropped"] == {}
    assert not w["stale"] and w["restarts"] == 0 and w["replays_failed"] == 0
    assert w["last_seq"] == 3 and total(ix, P[0], "e1") == 4 and total(ix, P[7], "e1") == 0

    # A burst of random garbage (never a well-formed 3-frame message) changes nothing.
    rng = random.Random(7)
    sent = 0
    for _ in range(200):
        kind = rng.choice(["count", "seq"])
        if kind == "count":
            n = rng.choice([1, 2, 4, 5])
            pub.send_raw([rng.randbytes(rng.randrange(0, 40)) for _ in range(n)])
        else:
            pub.send_raw([b"", rng.randbytes(rng.choice([0, 1, 4, 7, 9, 16])), rng.randbytes(30)])
        sent += 1
    rec.send(gpu(P[3]))
    wait_until(lambda: total(ix, P[3], "e1") == 4, msg="good batch after the burst")
    w = wi(ix, "e1")
    assert sum(w["dropped"].values()) == 7 + sent
    assert sum(dropped_payloads(ix).values()) == 7 + sent
    assert not w["stale"] and w["restarts"] == 0
    assert total(ix, P[0], "e1") == 4 and total(ix, P[1], "e1") == 4 and total(ix, P[2], "e2") == 4


# ------------------------------------------------------------- embedding


def test_embedding_indexer_inside_asyncio(rig):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = rig.indexer([cfg(pub, "e1")], start=False)

    async def until(cond, timeout=5.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    async def main():
        await ix.astart()
        assert ix.running
        try:
            await until(lambda: wi(ix, "e1")["connected"])
            deadline = time.monotonic() + 5  # the subscription is live once a probe arrives
            while wi(ix, "e1")["messages"] == 0:
                assert time.monotonic() < deadline, "e1's SUB never received a probe"
                pub.send_raw([b""])  # one frame: dropped and counted, never sequenced
                await asyncio.sleep(0.02)
            rec.send(gpu(P[0]))
            await until(lambda: caught_up(ix, "e1", 0, 0))
            r = ix.match(P[0])
            assert r.best.engine == "e1" and r.worker("e1", 0).total_blocks == 4
            byk = ix.match_by_keys(block_keys(P[0], BS))
            assert byk.worker("e1", 0).total_blocks == 4
            # The embedding API's route records too (R-Q-6): P[1] is predicted on e1
            # until e1 announces it, and done releases the decode load.
            r = ix.route(P[1], max_tokens=16)
            assert r["worker"] == "e1/0" and r["ranked"][0]["connected"] is True
            assert ix.match(P[1]).predicted[0][:3] == ("e1", 0, 4)
            rec.send(gpu(P[1]))
            await until(lambda: ix.match(P[1]).predicted == ())
            assert ix.route_done(r["request_id"]) and not ix.route_done(r["request_id"])
        finally:
            await ix.astop()
        assert not ix.running and ix.error is None
        assert not wi(ix, "e1")["connected"]

    asyncio.run(asyncio.wait_for(main(), 10))
    assert total(ix, P[0], "e1") == 4                # the index outlives the ingest thread
    ix.stop()                                        # idempotent


def test_embedding_stop_is_prompt_while_batches_arrive(rig):
    """stop() (and so astop() and leaving the ``with`` block) while engines keep
    publishing returns promptly and without error. 8 rounds: the outcome depends on
    where the ingest thread is when stop() is called. (A ``zmq.Again`` below means the
    wake-up send found nobody to receive it: without the SNDTIMEO set here, stop()
    would block forever.)"""
    for rnd in range(8):
        pubs = [rig.pub(replay_endpoint=None) for _ in range(3)]
        ix = rig.indexer([cfg(p, f"e{i}", replay=False) for i, p in enumerate(pubs)])
        ready(ix)
        halt = threading.Event()
        payload = encode_batch(gpu(P[rnd % len(P)]), ts=time.time())

        def flood(pub):
            while not halt.is_set():
                pub.publish_payload(payload)
                time.sleep(0)  # yield the GIL between sends, not a wait

        ths = [threading.Thread(target=flood, args=(p,), daemon=True) for p in pubs]
        for th in ths:
            th.start()
        try:
            wait_until(lambda: all(w["messages"] > 200 for w in ix.workers()), msg="traffic flowing")
            ix._wake_tx.setsockopt(zmq.SNDTIMEO, 3000)  # turn a would-be endless block into an error
            t0 = time.monotonic()
            err = None
            try:
                ix.stop()
            except Exception as e:  # noqa: BLE001 - reported below
                err = e
            took = time.monotonic() - t0
        finally:
            halt.set()
            for th in ths:
                th.join(2)
        assert err is None and took < 2.0, f"round {rnd}: stop() under traffic took {took:.1f}s, raised {err!r}"
        assert not ix.running
        assert total(ix, P[rnd % len(P)], "e0") == 4        # the index is kept
        for p in pubs:
            p.close()


def test_embedding_indexer_as_context_manager(rig):
    pub = rig.pub()
    rec = Rec(pub, "e1")
    ix = Indexer([cfg(pub, "e1")])
    rig.ixs.append(ix)
    with ix as running:
        assert running is ix
        ready(ix)
        rec.send(gpu(P[0]))
        wait_applied(ix, rec)
        assert ix.match(P[0]).worker("e1", 0).total_blocks == 4
        assert ix.running
    assert not ix.running and ix.error is None
    assert not wi(ix, "e1")["connected"]
    rec.send(gpu(P[1]))                              # not subscribed any more
    time.sleep(0.1)  # nothing may arrive (no SUB left to probe): a sleep, not a probe
    assert total(ix, P[1], "e1") == 0 and total(ix, P[0], "e1") == 4


# ------------------------------------------------------------------ soak


def test_R_STR_soak_drops_restarts_dp_ranks_final_index_exact(rig):
    """3 engines (c with dp_size 2, so 4 publishers, 3 wire versions), random stores
    and removals in GPU and CPU chunks, random live drops (repaired by replay) and
    occasional restarts. At the end the index equals a fresh PrefixIndex fed
    exactly what each publisher's current incarnation sent."""
    rng = random.Random(20260101)
    pa = rig.pub(version="0.33")
    pb = rig.pub(version="0.23", topic="kvb")
    pcs = bind_ranks(rig.pub, 2, version="0.24")
    base, rbase = endpoint_port(pcs[0].live_endpoint), endpoint_port(pcs[0].bound_replay_endpoint)
    recs = [Rec(pa, "a"), Rec(pb, "b"), Rec(pcs[0], "c", 0), Rec(pcs[1], "c", 1)]
    ix = rig.indexer([
        cfg(pa, "a"),
        cfg(pb, "b"),
        EngineConfig(id="c", endpoint=f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{rbase}",
                     dp_size=2),
    ])
    ready(ix)
    shared = toks(1, 2, BS)
    prompts = [shared + toks(10_000 * (i + 1), 4, BS) for i in range(6)] + [toks(90_000 + 100 * i, 6, BS)
                                                                            for i in range(4)]
    hashes = [ehashes(p, BS) for p in prompts]
    fresh = {id(r): True for r in recs}  # current incarnation has published nothing live yet

    def batch():
        evs = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(prompts))
            p, h = prompts[i], hashes[i]
            x = rng.random()
            if x < 0.35:
                evs.append(store(p, BS, 0, rng.randint(1, 6)))
            elif x < 0.55:
                n = rng.choice([2, 4, 6])
                evs.extend(chunks(p[: n * BS], BS, 2))
            elif x < 0.8:
                a = rng.randrange(6)
                evs.extend(gpu_evictions(h[a:a + rng.randint(1, 3)]))
            elif x < 0.97:
                a = rng.choice([0, 2, 4])
                evs.append(removed(h[a:a + 2], medium="CPU"))
            else:
                evs.append(Cleared())
        return evs

    t_end = time.monotonic() + 7.0
    steps = restarts = drops = 0
    while steps < 5000 and time.monotonic() < t_end:
        steps += 1
        r = rng.choice(recs)
        if rng.random() < 0.01 and not fresh[id(r)]:
            # Restart only once the indexer has seen this incarnation's last batch
            # (a vLLM restart is only visible as seq going backwards).
            if r.pub.next_seq - 1 in r.pub.drop:
                r.send(batch())
            wait_applied(ix, r)
            r.restart()
            restarts += 1
            fresh[id(r)] = True
            continue
        # Mostly one batch; now and then a burst (the live backlog then trails the
        # replays, which overlap it).
        for _ in range(rng.randint(60, 150) if rng.random() < 0.02 else 1):
            drop = rng.random() < 0.12 and not (fresh[id(r)] and r.restarts)
            drops += drop
            r.send(batch(), drop=drop)
            if not drop:
                fresh[id(r)] = False
        if steps % 4 == 0:
            time.sleep(0.005)  # pacing (the ingest thread keeps up now and then), not a wait
    for r in recs:  # make every stream's last batch visible (no heartbeats in vLLM)
        if not r.log or r.pub.next_seq - 1 in r.pub.drop:
            r.send(batch())
    for r in recs:
        wait_applied(ix, r, timeout=10)

    ws = {(w["engine"], w["dp_rank"]): w for w in ix.workers()}
    assert not any(w["stale"] for w in ws.values()), [w for w in ws.values() if w["stale"]]
    assert sum(w["replays_failed"] for w in ws.values()) == 0
    replays = sum(w["replays_ok"] for w in ws.values())
    sent = sum(r.pub.next_seq for r in recs)
    print(f"soak: {steps} steps, {sent} batches in the final incarnations, {drops} dropped live, "
          f"{restarts} restarts, {replays} replays")
    assert replays >= 10 and drops >= 50 and restarts >= 3, (steps, drops, restarts, replays)
    for r in recs:
        assert ws[(r.engine, r.rank)]["last_seq"] == r.pub.next_seq - 1
    ref = reference(recs)
    assert_same_index(ix, ref, prompts)
    for p in prompts:  # every prefix length too (chunk ends, partial GPU runs)
        for k in (1, 2, 3, 5):
            assert answers(ix.index, [p[: k * BS]]) == answers(ref, [p[: k * BS]])
    got = {(w["engine"], w["dp_rank"]): w["resident_blocks"] for w in ix.index.workers()}
    want = {(w["engine"], w["dp_rank"]): w["resident_blocks"] for w in ref.workers()}
    assert got == want
    assert ix.stats()["nodes"] == ref.stats()["nodes"]
    # Every restart seen, and only those (a replayed batch arriving live later is no restart).
    seen = {(r.engine, r.rank): ws[(r.engine, r.rank)]["restarts"] for r in recs}
    assert seen == {(r.engine, r.rank): r.restarts for r in recs}, (steps, drops)


def test_R_BAD_3_an_internal_error_costs_one_message_not_the_ingest_thread():
    """A batch that trips a bug in apply is dropped and counted ("internal_error");
    the ingest thread lives on, the lost seq marks the worker stale, later batches apply."""
    pub = VllmPublisher(LOCAL, None)
    ix = Indexer([{"id": "e", "endpoint": pub.live_endpoint}])
    orig = ix.index.apply_sequenced
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug")
        return orig(*a, **kw)

    ix.index.apply_sequenced = flaky
    try:
        ix.start()
        wait_until(lambda: wi(ix, "e")["connected"], msg="connected")
        probe_until_received(lambda: pub.send_raw([b""]), lambda: wi(ix, "e")["messages"], "e/0's SUB")
        t = toks(1, 3, BS)
        for a in range(3):
            pub.publish([store(t, BS, a, a + 1)])
        wait_until(lambda: wi(ix, "e")["last_seq"] == 2, msg=lambda: f"applied: {wi(ix, 'e')}")
        w = wi(ix, "e")
        assert ix.running and ix.error is None
        assert w["dropped"].get("internal_error") == 1
        assert w["stale"] is True
        assert ix.match(t).worker("e").tiers == {"GPU": 1}  # block 0; block 1 was lost, 2 is orphaned
    finally:
        ix.stop()
        pub.close()


# ------------------------------------------- the two pollers (transport.py)


def test_R_STR_6_a_silent_workers_link_follows_its_socket_while_another_streams(rig):
    """Monitors are not in the hot poll: they are swept every SWEEP_S. While one engine
    streams without a pause (so the hot poll never times out), a silent engine's
    disconnect and its return must still show in its link state, within a bound."""
    port = rig.hold().port  # held: the silent engine comes back on it (a restart keeps its port)
    busy = rig.pub()
    rb = Rec(busy, "busy")
    quiet = rig.pub(f"tcp://127.0.0.1:{port}", None, bind=True)
    ix = rig.indexer([cfg(busy, "busy"), EngineConfig(id="quiet", endpoint=f"tcp://127.0.0.1:{port}")])
    ready(ix)
    with streaming(rb, P):
        wait_until(lambda: wi(ix, "busy")["messages"] > 50, msg="the busy engine streams")
        quiet.close()
        t0 = time.monotonic()
        wait_until(lambda: not wi(ix, "quiet")["connected"], timeout=3, msg="the silent engine's disconnect seen")
        assert time.monotonic() - t0 < 2.0
        again = wait_until(lambda: try_bind(rig, port), msg="rebind the silent engine's port")
        assert again is not None
        wait_until(lambda: wi(ix, "quiet")["connected"], timeout=5, msg="the silent engine's reconnect seen")
        assert wi(ix, "busy")["messages"] > 50  # the busy engine streamed throughout
    wait_applied(ix, rb)
    assert not wi(ix, "busy")["stale"] and wi(ix, "busy")["gaps"] == 0


def test_R_STR_2_the_hot_poll_holds_live_sockets_and_only_a_replaying_workers_dealer(rig):
    """The hot poll (asked on every wake-up) holds the wake-up socket and one live SUB
    per worker; a worker's DEALER joins it only while that worker replays, and leaves
    when the replay ends: the per-wake-up cost grows with workers, not with 3x them."""
    pubs = [rig.pub() for _ in range(3)]
    man = ManualReplay(rig)
    rec = Rec(pubs[0], "e0")
    ix = rig.indexer([EngineConfig(id="e0", endpoint=pubs[0].live_endpoint, replay_endpoint=man.endpoint)]
                     + [cfg(p, f"e{i}") for i, p in enumerate(pubs) if i])
    ready(ix)

    def hot() -> int:
        return len(ix._poller.sockets)

    assert hot() == 1 + 3                           # wake-up PAIR + 3 live SUBs
    rec.send(gpu(P[0]))
    rec.send(gpu(P[1]), drop=True)                  # a gap: e0 replays from its anchor
    rec.send(gpu(P[2]))
    client, start = man.request()
    assert start == 0
    wait_until(lambda: hot() == 1 + 3 + 1, msg="the replaying worker's DEALER in the hot poll")
    assert wi(ix, "e0")["replaying"]
    man.answer(client, [(s, p) for s, p in rec.log if s >= start])
    wait_applied(ix, rec)
    wait_until(lambda: hot() == 1 + 3, msg="the DEALER back out of the hot poll once the replay ended")
    assert wi(ix, "e0")["replays_ok"] == 1 and not wi(ix, "e0")["stale"]
    assert_same_index(ix, reference([rec]), P[:3])


def test_R_STR_7_a_reconnect_is_seen_before_the_first_batch_over_it_while_the_hot_poll_is_busy(rig):
    """An engine restarts on the same port; the first batch of its new incarnation that
    reaches us is seq 1 (its seq 0 went out before we resubscribed), right after the
    old one's last seq 0: by its number alone it looks continuous. Only the reconnect
    says otherwise, so it must be handled before that batch, even while another engine
    keeps the hot poll busy (monitors are swept only every SWEEP_S there): the old
    incarnation's prompt must then be gone, or the worker stale with a reason."""
    port = rig.hold().port  # held: the new incarnation binds the same port (a restart keeps it)
    old = rig.pub(f"tcp://127.0.0.1:{port}", None, bind=True)
    rold = Rec(old, "e1")
    busy = rig.pub()
    rb = Rec(busy, "busy")
    ix = rig.indexer([EngineConfig(id="e1", endpoint=f"tcp://127.0.0.1:{port}"), cfg(busy, "busy")])
    ready(ix)
    rold.send(gpu(P[0]))                            # seq 0 of the old incarnation
    wait_applied(ix, rold)
    with streaming(rb, P[2:6]):
        old.close()
        wait_until(lambda: not wi(ix, "e1")["connected"], timeout=3, msg="the old incarnation's disconnect seen")
        new = wait_until(lambda: _try_xpub(rig, port), msg="the new incarnation binds the port")
        assert new.poll(5000), "the indexer never resubscribed"
        assert new.recv() == b"\x01"                # the subscription (topic ""): deliveries start now
        payload = encode_batch(gpu(P[1]), ts=time.time(), dp_rank=0, version="0.33")
        new.send_multipart([b"", seq8(1), payload])  # seq 0 of this incarnation was never delivered
        wait_until(lambda: wi(ix, "e1")["messages"] >= 2, msg="the new incarnation's batch received")
        new.send_multipart([b"", b"fence", b""])  # a bad_seq_frame drop behind it: once counted, the batch is handled
        wait_until(lambda: dropped_payloads(ix).get("bad_seq_frame", 0) >= 1, msg="the fence behind the batch handled")
    w = wi(ix, "e1")
    assert w["stale"] or total(ix, P[0], "e1") == 0, w
    if w["stale"]:
        assert w["stale_reason"], w


def _try_xpub(rig, port: int):
    s = rig.sock(zmq.XPUB)
    try:
        s.bind(f"tcp://127.0.0.1:{port}")
        return s
    except zmq.ZMQError:
        return None
