"""Replicas on a shared event log, NATS JetStream (contract R-DUR-10..14).

Everything is real: a ``nats-server -js`` with file storage (:mod:`natsd`), engines
speaking vLLM's wire protocol over ZMQ (:class:`VllmPublisher`, with replay), relays
(:class:`indexer.ingest.relay.Relay`, in this process or as ``kv-indexer relay`` processes) and
replicas (:class:`indexer.ingest.jetstream.JetStreamIngest`, or ``kv-indexer serve --nats``).
Traffic flows throughout each scenario (a thread publishing a seeded mix of stores and
removals on every worker, an engine restart included). The expected state is always a
``PrefixIndex`` fed every batch each engine incarnation sent, directly (``reference``);
a replica must equal it in every ``match`` answer of every prompt and in each worker's
block set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats
import pytest
import zmq
from nats.js import api

from evkit import ehashes, removed, store, toks
from indexer import PrefixIndex
from indexer.wire.engines import EngineConfig
from indexer.ingest.eventlog import H_RESTART, SNAPSHOT_OBJECT, headers, msg_id
from indexer.ingest.jetstream import JetStreamIngest
from indexer.producer.events import encode_batch
from indexer.producer.publisher import VllmPublisher
from indexer.ingest.relay import Relay
from natsd import NatsServer
from svc import ROOT, Child, PortHold, bind_ranks, endpoint_port, probe_until_received, sample, wait_until
from test_ingest import Rec, answers, reference

BS = 4
MODELS = ("default", "m2")  # e1 serves the first, e2 (two DP ranks) the second
# 6 families of 4 prompts: 3 shared blocks, then 3 of their own.
PROMPTS = [toks(10_000 * (f + 1), 3, BS) + toks(10_000 * (f + 1) + 1_000 * (j + 1), 3, BS)
           for f in range(6) for j in range(4)]


def batch_events(rng: random.Random) -> list:
    p = rng.choice(PROMPTS)
    r = rng.random()
    if r < 0.6:
        return [store(p, BS, 0, rng.randint(1, 6))]
    if r < 0.75:
        return [store(p, BS, 0, rng.randint(1, 6), medium="CPU")]
    hs = ehashes(p, BS)
    return [removed(hs[rng.randint(1, 5):], medium=rng.choice(("GPU", "GPU", "CPU")))]


class Fleet:
    """Engine e1 (one rank, model "default") and e2 (DP ranks 0 and 1 on offset ports, "m2")."""

    def __init__(self) -> None:
        e1 = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True)
        e2 = bind_ranks(VllmPublisher, 2)
        base, rbase = endpoint_port(e2[0].live_endpoint), endpoint_port(e2[0].bound_replay_endpoint)
        self.pubs = [e1, *e2]
        self.recs = [Rec(e1, "e1"), Rec(e2[0], "e2", 0, "m2"), Rec(e2[1], "e2", 1, "m2")]
        self.configs = [
            EngineConfig(id="e1", endpoint=e1.live_endpoint, replay_endpoint=e1.bound_replay_endpoint),
            EngineConfig(id="e2", endpoint=f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{rbase}",
                         dp_size=2, model="m2"),
        ]

    def specs(self) -> list[str]:
        return [f"{c.id}={c.endpoint},replay_endpoint={c.replay_endpoint},dp_size={c.dp_size},model={c.model}"
                for c in self.configs]

    def close(self) -> None:
        for p in self.pubs:
            p.close()


class Traffic:
    """Publish a seeded mix of batches round-robin over the workers at ``rate`` per second
    until stopped; ``restart_at`` {n: rec}: that engine restarts before batch n."""

    def __init__(self, recs: list[Rec], rate: float = 400.0, seed: int = 1, restart_at: dict | None = None) -> None:
        self.recs = recs
        self.rate = rate
        self.rng = random.Random(seed)
        self.restart_at = restart_at or {}
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            if self.sent in self.restart_at:
                self.restart_at[self.sent].restart()  # seq back to 0, replay buffer empty
            self.recs[self.sent % len(self.recs)].send(batch_events(self.rng))
            self.sent += 1
            ahead = t0 + self.sent / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)  # pacing: the traffic's rate, not a wait

    def wait_sent(self, n: int, timeout: float = 30.0) -> None:
        wait_until(lambda: self.sent >= n, timeout, msg=f"{n} batches sent")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class RelayProc(Child):
    """``kv-indexer relay`` as a child process (really killed by :meth:`kill`)."""

    def __init__(self, url: str, fleet: Fleet, log: Path) -> None:
        cmd = ["relay", "--nats", url, "--log-level", "info"]
        for s in fleet.specs():
            cmd += ["--engine", s]
        super().__init__(cmd, log)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def js_call(url: str, fn):
    """Run ``fn(js)`` on a connection of its own (the test's view of the server)."""

    async def main():
        nc = await nats.connect(url)
        try:
            return await fn(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(main())


def stream_state(url: str, stream: str = "KVI_EVENTS") -> api.StreamState:
    async def info(js):
        return (await js.stream_info(stream)).state

    return js_call(url, info)


def put_object(url: str, data: bytes, nats_seq: int, bucket: str = "kvi-snapshots") -> None:
    async def put(js):
        try:
            obs = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            obs = await js.create_object_store(bucket, storage=api.StorageType.FILE)
        await obs.put(SNAPSHOT_OBJECT, data, meta=api.ObjectMeta(name=SNAPSHOT_OBJECT,
                                                                   description=f"nats_seq={nats_seq}"))

    js_call(url, put)


def get_object(url: str, bucket: str = "kvi-snapshots") -> bytes | None:
    """The stored snapshot's bytes; None when there is none (or it was replaced while
    being read: a get then waits for chunks that are gone, so it is bounded)."""
    async def get(js):
        try:
            obs = await js.object_store(bucket)
            return (await asyncio.wait_for(obs.get(SNAPSHOT_OBJECT), 5.0)).data
        except (nats.js.errors.NotFoundError, asyncio.TimeoutError):
            return None

    return js_call(url, get)


def blocks(ix: PrefixIndex) -> dict:
    """Each worker's block set: the engine hashes it holds per KV-cache group, and its
    resident entries per tier."""
    out = {}
    for (e, r), w in sorted(ix._workers.items()):
        out[(e, r)] = {g: sorted(wg.map) for g, wg in w.groups.items() if wg.map}
    res = {(w["engine"], w["dp_rank"]): w["resident_blocks"] for w in ix.workers()}
    return {"hashes": out, "resident": res}


def assert_same(ix: PrefixIndex, ref: PrefixIndex) -> None:
    for m in MODELS:
        assert answers(ix, PROMPTS, m) == answers(ref, PROMPTS, m), f"model {m}"
    assert blocks(ix) == blocks(ref)
    assert ix.stats()["resident_entries"] == ref.stats()["resident_entries"]


def caught_up(rep: JetStreamIngest, recs: list[Rec]) -> bool:
    ws = {(w["engine"], w["dp_rank"]): w["last_seq"] for w in rep.index.workers()}
    return all(ws.get((r.engine, r.rank)) == r.pub.next_seq - 1 for r in recs)


def wait_caught_up(reps: list[JetStreamIngest], fleet: Fleet, timeout: float = 30.0) -> None:
    for rep in reps:
        wait_until(lambda: caught_up(rep, fleet.recs), timeout,
                   msg=lambda: f"{rep.name} caught up: seq {rep.seq}, {rep.counters}, "
                   f"{[(w['engine'], w['dp_rank'], w['last_seq']) for w in rep.index.workers()]} vs "
                   f"{[r.pub.next_seq - 1 for r in fleet.recs]}")


@pytest.fixture
def fleet():
    f = Fleet()
    yield f
    f.close()


@pytest.fixture
def closing():
    """``closing(x)`` registers a relay or replica (anything with ``stop()``) to stop after the test."""
    made: list = []

    def add(x):
        made.append(x)
        return x

    yield add
    for x in reversed(made):
        x.stop()


def replica(url: str, name: str, **kw) -> JetStreamIngest:
    kw.setdefault("heartbeat_s", 0.5)
    kw.setdefault("keep_behind", 0)
    rep = JetStreamIngest(url, name=name, **kw)
    rep.start()
    return rep


def relay(url: str, fleet: Fleet, **kw) -> Relay:
    kw.setdefault("reconnect_ivl_max_ms", 500)
    r = Relay(fleet.configs, url=url, **kw)
    r.start()
    return r


# ------------------------------------------------------------- the rule, alone


def _rec(engine: str, seq: int, events, ts: float, rank: int = 0) -> tuple:
    return (engine, rank, "default", seq, encode_batch(events, ts=ts, dp_rank=rank))


def test_R_DUR_10_R_DUR_11_replica_rule_is_the_sequencers_with_gaps_marked_stale():
    """R-DUR-10/11 on the rule alone (no server): in order applies, a repeat is skipped,
    an older seq with a newer ts is a restart, a forward gap and a late first batch apply
    but mark the worker stale naming the missing seqs, seq 0 clears it; Kvi-Restart turns
    an apparent duplicate (an engine clock behind) into a restart; Kvi-Stale carries the
    relay's reason. Two replicas fed the same records end identical."""
    p0, p1, p2 = PROMPTS[0], PROMPTS[5], PROMPTS[9]
    recs = [
        (_rec("e1", 0, [store(p0, BS, 0, 6)], 100.0), {}),
        (_rec("e1", 1, [store(p1, BS, 0, 6)], 101.0), {}),
        (_rec("e1", 1, [store(p1, BS, 0, 6)], 101.0), {}),  # duplicate
        (_rec("e1", 4, [store(p2, BS, 0, 6)], 102.0), {}),  # gap: 2..3 missing
        (_rec("e2", 3, [store(p0, BS, 0, 2)], 100.0), {}),  # first batch past 0: 0..2 missing
        (_rec("e1", 0, [store(p2, BS, 0, 3)], 200.0), {}),  # newer ts: restart, fresh again
        (_rec("e2", 0, [store(p1, BS, 0, 3)], 50.0), {"restart_after": 100.0}),  # clock behind, relay proved it
        (_rec("e2", 1, [store(p1, BS, 0, 4)], 51.0), {"stale": "continuity after seq 0 unproven: x"}),
        # A copy of that flagged batch re-sent much later (a relay that lagged): its
        # restart_after is not e2's last ts any more: a duplicate.
        (_rec("e2", 0, [store(p1, BS, 0, 3)], 50.0), {"restart_after": 100.0}),
    ]
    reps = [JetStreamIngest("nats://127.0.0.1:1", name=f"r{i}") for i in range(2)]  # never started
    trace, outs = [], []
    for r, kw in recs:
        outs.append(reps[0].apply_record(*r, **kw))
        trace.append({w["engine"]: (w["stale"], w["stale_reason"]) for w in reps[0].index.workers()})
    assert outs == [reps[1].apply_record(*r, **kw) for r, kw in recs]
    assert outs == ["applied", "applied", "duplicate", "applied", "applied", "applied", "applied", "applied",
                    "duplicate"]
    ix = reps[0].index
    assert trace[3]["e1"] == (True, "event log: batch(es) 2..3 of e1/0 missing")
    assert trace[4]["e2"] == (True, "event log: batch(es) 0..2 of e2/0 missing")
    assert trace[5]["e1"] == (False, None)  # the restart's seq 0 clears it
    assert trace[6]["e2"] == (False, None)  # Kvi-Restart: a restart at seq 0, not a duplicate
    assert trace[7]["e2"] == (True, "relay: continuity after seq 0 unproven: x")
    # After the restarts, only the new incarnations' blocks are there.
    assert ix.match(p0).worker("e1") is None and ix.match(p2).worker("e1").total_blocks == 3
    assert ix.match(p0).worker("e2") is None and ix.match(p1).worker("e2").total_blocks == 4
    assert reps[0].counters == reps[1].counters
    assert reps[0].counters["restarts"] == 2 and reps[0].counters["duplicates"] == 2
    assert blocks(reps[0].index) == blocks(reps[1].index)


def test_R_DUR_13_message_id_is_engine_rank_seq_and_payload_digest():
    """R-DUR-13: one id per batch whichever relay sends it; a new incarnation's seq 0 is
    another message than the old one's (the digest differs)."""
    a = encode_batch([store(PROMPTS[0], BS, 0, 2)], ts=1.0)
    b = encode_batch([store(PROMPTS[0], BS, 0, 2)], ts=2.0)
    assert msg_id("e1", 0, 0, a) == msg_id("e1", 0, 0, a) != msg_id("e1", 0, 0, b)
    assert msg_id("e1", 0, 0, a).startswith("e1/0/0/")
    h = headers("e1", 1, "m\r\nx", 7, a, restart_after=1767225600.123456)
    assert h["Kvi-Rank"] == "1" and h["Kvi-Seq"] == "7" and "\n" not in h["Kvi-Model"]
    assert float(h[H_RESTART]) == 1767225600.123456  # exact: repr round-trips


# ---------------------------------------------------------- over a real server


def test_R_DUR_13_two_relays_active_active_one_killed_replicas_equal_the_reference(natsd, fleet, closing, tmp_path):
    """R-DUR-13 (and R-DUR-10): two ``kv-indexer relay`` processes publish the same
    engines; one is SIGKILLed mid-stream and the other carries on. The stream holds each
    batch exactly once, and two replicas equal the reference."""
    relays = [RelayProc(natsd.url, fleet, tmp_path / f"relay{i}.log") for i in range(2)]
    try:
        reps = [closing(replica(natsd.url, f"r{i}")) for i in range(2)]
        traffic = Traffic(fleet.recs, rate=400, restart_at={700: fleet.recs[1]}).start()
        try:
            traffic.wait_sent(400)
            wait_until(lambda: reps[0].seq > 100, 20, msg=lambda: f"the log flows: {reps[0].counters}")
            relays[0].kill()
            at_kill = stream_state(natsd.url).last_seq
            traffic.wait_sent(1100)
        finally:
            traffic.stop()
        wait_caught_up(reps, fleet)
        st = stream_state(natsd.url)
        assert st.last_seq > at_kill  # the survivor kept the log going
        assert st.messages == traffic.sent, "each batch exactly once in the stream"
        ref = reference(fleet.recs)
        for rep in reps:
            assert_same(rep.index, ref)
            assert rep.counters["gaps"] == 0 and rep.counters["restarts"] == 1, rep.counters
            assert not any(w["stale"] for w in rep.index.workers())
        assert "relay:" in relays[1].output() or relays[1].proc.poll() is None
    finally:
        for r in relays:
            r.stop()


def test_R_DUR_12_replica_killed_new_one_starts_from_the_object_store_snapshot(natsd, fleet, closing, serve):
    """R-DUR-12 (and R-DUR-10): a ``kv-indexer serve --nats`` replica writes snapshots to
    the object store; it is SIGKILLed; a new replica loads the snapshot, follows the
    stream from its ``nats_seq + 1`` and equals the reference. The service refuses engine
    registrations with 409 (engines belong to the relay)."""
    rl = closing(relay(natsd.url, fleet))
    srv = serve("--nats", natsd.url, "--snapshot-interval-s", "0.2")
    traffic = Traffic(fleet.recs, rate=400).start()
    try:
        traffic.wait_sent(500)
        wait_until(lambda: get_object(natsd.url) is not None, 20, msg="a snapshot in the object store")
        c = srv.client
        st, ws = c.get("/v1/workers")
        assert st == 200 and {(w["engine"], w["dp_rank"]) for w in ws} == {("e1", 0), ("e2", 0), ("e2", 1)}
        assert all(w["health"] in ("ok", "stale") and w["connected"] for w in ws), ws
        st, body = c.post("/v1/engines", {"id": "e9", "endpoint": "tcp://127.0.0.1:5999"})
        assert st == 409 and "register engines with the relay" in body["detail"], body
        st, body = c.delete("/v1/engines/e1")
        assert st == 409 and "register engines with the relay" in body["detail"], body
        st, body = c.get("/v1/snapshot")  # a replica's snapshots are in the object store (R-DUR-12)
        assert st == 409 and "object store" in body["detail"], body
        m = c.metrics()
        assert sample(m, "kvi_jetstream_messages_total", outcome="applied") > 0, [k for k in m if "jetstream" in k[0]]
        srv.proc.kill()  # a crash: no snapshot on the way out
        srv.proc.wait(10)
        traffic.wait_sent(900)
    finally:
        traffic.stop()
    from indexer.store.snapshot import loads

    n = loads(get_object(natsd.url)).meta["nats_seq"]
    assert n > 0
    rep = closing(replica(natsd.url, "fresh"))
    wait_caught_up([rep], fleet)
    assert rep.counters["snapshots_loaded"] == 1 and rep.snapshot_seq == n
    assert rep.counters["messages"] == stream_state(natsd.url).last_seq - n  # only what follows the snapshot
    assert_same(rep.index, reference(fleet.recs))
    assert rl.counters["acked"] == rl.counters["published"] == traffic.sent


def test_R_DUR_14_nats_server_restart_mid_stream_relays_and_replicas_resume(natsd, fleet, closing):
    """R-DUR-14: nats-server (file storage) restarts while engines publish: the relays
    retry the same messages until acked, the replicas recreate their consumers after the
    last stream seq they applied; both replicas equal the reference."""
    rls = [closing(relay(natsd.url, fleet, publish_timeout_s=0.5)) for _ in range(2)]
    reps = [closing(replica(natsd.url, f"r{i}")) for i in range(2)]
    traffic = Traffic(fleet.recs, rate=400, restart_at={600: fleet.recs[0]}).start()
    try:
        traffic.wait_sent(300)
        wait_until(lambda: all(r.seq > 50 for r in reps), 20, msg="the log flows")
        natsd.stop()
        down = traffic.sent
        traffic.wait_sent(down + 200)  # engines keep publishing into the outage (~0.5 s of traffic)
        natsd.start()
        traffic.wait_sent(1000)
    finally:
        traffic.stop()
    wait_caught_up(reps, fleet)
    assert stream_state(natsd.url).messages == traffic.sent
    ref = reference(fleet.recs)
    for rep in reps:
        assert_same(rep.index, ref)
        assert rep.counters["consumers"] >= 2, rep.counters  # recreated after the restart
    assert sum(r.counters["retries"] for r in rls) > 0
    assert all(r.counters["dropped"] == 0 and r.counters["restarts"] == 1 for r in rls)


def test_R_DUR_12_stream_trimmed_behind_the_snapshot(natsd, fleet, closing):
    """R-DUR-12: a replica writing snapshots purges the stream below the stored
    snapshot's ``nats_seq + 1`` (``keep_behind=0``); a new replica from snapshot plus
    trimmed stream equals the reference."""
    closing(relay(natsd.url, fleet))
    writer = closing(replica(natsd.url, "writer", snapshot_interval_s=0.2))
    traffic = Traffic(fleet.recs, rate=400).start()
    try:
        traffic.wait_sent(200)
        wait_until(lambda: writer.counters["purges"] >= 2, 20, msg=lambda: f"purges: {writer.counters}")
        traffic.wait_sent(600)
    finally:
        traffic.stop()
    wait_caught_up([writer], fleet)
    wait_until(lambda: writer._snap_task is None or writer._snap_task.done(), 10, msg="last snapshot stored")
    from indexer.store.snapshot import loads

    n = loads(get_object(natsd.url)).meta["nats_seq"]
    st = stream_state(natsd.url)
    assert n == writer.snapshot_seq and 0 < n < st.last_seq
    assert st.first_seq == n + 1 and st.messages == st.last_seq - n
    fresh = closing(replica(natsd.url, "fresh"))
    wait_caught_up([fresh], fleet)
    assert fresh.counters["snapshots_loaded"] == 1 and fresh.counters["stream_lost"] == 0
    ref = reference(fleet.recs)
    assert_same(fresh.index, ref)
    assert_same(writer.index, ref)


@pytest.mark.parametrize("damage", ["checksum", "magic"])
def test_R_DUR_12_corrupt_snapshot_refused_counted_replica_follows_the_whole_stream(natsd, fleet, closing,
                                                                                     damage):
    """R-DUR-12: a snapshot that does not load (a flipped byte, or not a snapshot at all)
    is refused, logged and counted by reason; the replica follows the stream from its
    first message and equals the reference."""
    from indexer.store.snapshot import dumps

    good = dumps(reference(fleet.recs), meta={"nats_seq": 3})
    bad = good[:-7] + bytes([good[-7] ^ 0xFF]) + good[-6:] if damage == "checksum" else b"not a snapshot" * 9
    put_object(natsd.url, bad, 3)
    closing(relay(natsd.url, fleet))
    traffic = Traffic(fleet.recs, rate=400).start()
    try:
        traffic.wait_sent(300)
    finally:
        traffic.stop()
    rep = closing(replica(natsd.url, "r"))
    wait_caught_up([rep], fleet)
    assert rep.counters["snapshots_refused"] == 1 and rep.refused == {damage: 1}
    assert rep.counters["snapshots_loaded"] == 0 and rep.counters["messages"] == traffic.sent
    assert_same(rep.index, reference(fleet.recs))


def test_R_DUR_11_trimmed_stream_and_corrupt_snapshot_workers_stale_naming_the_loss(natsd, fleet, closing):
    """R-DUR-11/12: the stream was trimmed behind a snapshot that turns out corrupt: the
    replica refuses it once, accepts the loss (counted) and marks every worker stale with
    the seqs its first batch shows missing; it never pretends to be complete."""
    closing(relay(natsd.url, fleet))
    writer = replica(natsd.url, "writer", snapshot_interval_s=0.2)
    traffic = Traffic(fleet.recs, rate=400).start()
    try:
        traffic.wait_sent(200)
        wait_until(lambda: writer.counters["purges"] >= 1, 20, msg="purged")
    finally:
        traffic.stop()
        writer.stop()
    good = get_object(natsd.url)
    put_object(natsd.url, good[:100], 10**9)  # truncated
    lost = stream_state(natsd.url).first_seq - 1
    rep = closing(replica(natsd.url, "r"))
    wait_until(lambda: rep.counters["stream_lost"], 10, msg=lambda: f"the loss accepted: {rep.counters}")
    more = Traffic(fleet.recs, rate=400, seed=2).start()
    try:
        more.wait_sent(30)
    finally:
        more.stop()
    wait_caught_up([rep], fleet)
    assert rep.counters["snapshots_refused"] == 1 and rep.refused == {"truncated": 1}, rep.counters
    assert rep.counters["stream_lost"] == lost > 0
    for w in rep.index.workers():
        assert w["stale"] and w["stale_reason"].startswith("event log: batch(es) 0"), w


def test_R_DUR_10_restart_behind_a_reconnect_with_a_clock_behind_reaches_replicas(natsd, closing):
    """R-DUR-10 with R-STR-7: an engine restarts on the same ports while the relay is
    disconnected, its clock behind, and its first batches are lost (the next seq the
    relay sees is exactly last + 1). Neither seq nor ts shows the restart; the relay
    proves it by replay and rebuilds from 0, marking the first batch with the ts of the
    batch it replaced. The replica drops the old incarnation and equals the reference."""
    # Fixed ports: the engine restarts on the same ones. Held for the test (bound, never
    # listening: see svc.PortHold) so no other process takes them while it is down.
    hold, rhold = PortHold(), PortHold()
    port, rport = hold.port, rhold.port

    def try_bind() -> VllmPublisher | None:
        try:
            return VllmPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", bind=True)
        except zmq.ZMQError:
            return None

    def bind() -> VllmPublisher:
        return wait_until(try_bind, 5, msg=f"the engine's ports {port} and {rport} free again")

    closing(hold)
    closing(rhold)
    pub = bind()
    rec = Rec(pub, "e1")
    cfg = EngineConfig(id="e1", endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    rl = closing(Relay([cfg], url=natsd.url, reconnect_ivl_max_ms=200))
    rl.start()
    rep = closing(replica(natsd.url, "r"))
    wait_until(lambda: rl.workers()[0]["connected"], 5, msg="SUB connected")
    probe_until_received(lambda: pub.send_raw([b""]), lambda: rl.workers()[0]["messages"], "the relay's SUB")
    for i in range(3):
        rec.send([store(PROMPTS[i], BS, 0, 6)], ts=2000.0 + i)
    wait_until(lambda: rep.seq == 3, 10, msg=lambda: f"old incarnation in the log: {rep.counters}")
    pub.close()
    rec.pub = pub = bind()
    rec.log = []
    try:
        for i in range(3):  # nobody subscribed yet: lost on the live socket, kept for replay
            rec.send([store(PROMPTS[10 + i], BS, 0, 6)], drop=True, ts=1000.0 + i)
        wait_until(lambda: rl.workers()[0]["connects"] >= 2 and rl.workers()[0]["connected"], 10, msg="reconnected")
        probe_until_received(lambda: pub.send_raw([b""]), lambda: rl.workers()[0]["messages"], "the relay's new SUB")
        rec.send([store(PROMPTS[20], BS, 0, 6)], ts=1003.0)  # seq 3: looks like the next one
        wait_until(lambda: caught_up(rep, [rec]) and rep.counters["messages"] >= 7, 10,
                   msg=lambda: f"new incarnation in the log: {rep.counters}, {rl.counters}")
        assert rl.counters["restarts"] == 1
        assert rep.counters["restarts"] == 1 and not rep.index.workers()[0]["stale"], rep.counters
        assert rep.index.match(PROMPTS[0]).worker("e1") is None
        ref = reference([rec])
        assert answers(rep.index, PROMPTS) == answers(ref, PROMPTS) and blocks(rep.index) == blocks(ref)
    finally:
        rl.stop()
        pub.close()


def test_R_DUR_13_relay_buffer_bounded_drops_counted_replicas_see_the_gap(fleet, closing, tmp_path):
    """R-DUR-13: NATS unreachable: a relay queues ``max_pending`` batches per worker and
    drops (counts) the rest; once NATS is up the queue is published in order, and the
    next batch shows replicas the gap: the worker is stale naming exactly the lost seqs."""
    # The relay is given NATS's address before the server exists: the port is held for the
    # test (bound, never listening: refused like a server that is down; see svc.PortHold)
    # and nats-server binds it later.
    hold = closing(PortHold())
    url = f"nats://127.0.0.1:{hold.port}"
    rl = closing(Relay(fleet.configs[:1], url=url, max_pending=5, reconnect_ivl_max_ms=500))
    rl.start()
    rec = fleet.recs[0]
    wait_until(lambda: rl.workers()[0]["connected"], 5, msg="SUB connected")
    probe_until_received(lambda: rec.pub.send_raw([b""]), lambda: rl.workers()[0]["messages"], "the relay's SUB")
    for _ in range(20):
        rec.send(batch_events(random.Random(7)))
    wait_until(lambda: rl.counters["dropped"] == 15, 10, msg=lambda: f"{rl.counters}")
    srv = NatsServer(tmp_path / "late", port=hold.port)
    # Stopped in reverse order, the server last: the replica only once it exists, so that a
    # failure before it is reported as itself (not as an unbound name in a finally).
    with contextlib.ExitStack() as stop:
        stop.callback(srv.stop)
        stop.callback(rl.stop)
        wait_until(lambda: rl.counters["acked"] == 5, 20, msg=lambda: f"queue published: {rl.counters}")
        rec.send(batch_events(random.Random(8)))  # seq 20
        rep = replica(url, "r")
        stop.callback(rep.stop)
        wait_until(lambda: rep.counters["messages"] == 6, 10, msg=lambda: f"{rep.counters}")
        w = rep.index.workers()[0]
        assert w["last_seq"] == 20 and w["stale"], w
        assert w["stale_reason"] == "event log: batch(es) 5..19 of e1/0 missing", w


def test_relay_and_replica_modules_stay_off_the_default_import_path():
    """nats is imported only by indexer.ingest.jetstream / indexer.ingest.relay, which nothing on the
    library's or the service's default path imports."""
    code = ("import sys, indexer, indexer.ingest.live, indexer.transport.discovery, api.app, api.cli; "
            "bad = [m for m in ('nats', 'indexer.ingest.jetstream', 'indexer.ingest.relay', 'indexer.ingest.eventlog') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
