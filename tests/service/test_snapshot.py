"""Snapshots (R-DUR-1..4): the file, its refusals, and a warm restart through real sockets.

The restored index is held to one that never stopped: the same payloads applied to a
fresh :class:`PrefixIndex` (``reference``), before and after more batches arrive. The
stateful test (``test_stateful.py``, ``SnapshotMachine``) holds restores to the
contract's model; the service-level restarts are in ``test_state_service.py``.
"""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from evkit import chunks, ehashes, placeholder, removed, store, toks
from indexer import PrefixIndex
from indexer.wire.engines import EngineConfig
from indexer.producer.events import Cleared, encode_batch
from indexer.store.snapshot import FORMAT_VERSION, SnapshotError, dumps, loads, write_atomic
from svc import wait_until
from test_ingest import BS, P, Rec, assert_same_index, cfg, gpu, ready, reference, rig, wait_applied, wi  # noqa: F401

TS = 1767225600.0


def _prompts():
    return [toks(1 + 1000 * i, 6, 4) for i in range(6)]


def _feed(idx: PrefixIndex, log: list, engine: str, events, seq: int, *, ver="0.33", model="default", rank=0):
    payload = encode_batch(events, ts=TS + seq, dp_rank=rank, version=ver)
    log.append((engine, rank, model, seq, payload))
    idx.apply(engine, payload, model=model, dp_rank=rank, seq=seq)


def _rich(idx: PrefixIndex) -> list:
    """Every kind of state: GPU runs shared by workers, announcements counted twice,
    CPU chunks, placeholders, STORAGE, an orphan, bytes hashes, two models, a stale
    worker, an idle model (its last worker dropped)."""
    log: list = []
    ps = _prompts()
    _feed(idx, log, "a", [store(ps[0], 4, 0, 6), store(ps[1], 4, 0, 3)], 0)
    _feed(idx, log, "b", [store(ps[0], 4, 0, 4), store(ps[0], 4, 0, 4)], 0, ver="0.23")  # counted twice
    _feed(idx, log, "a", chunks(ps[0], 4, 2) + [placeholder(ehashes(ps[1], 4)[:2])], 1)
    _feed(idx, log, "a", [store(ps[2], 4, 0, 4, medium="STORAGE")], 2)
    _feed(idx, log, "b", [store(ps[3], 4, 2, 5)], 1)  # parent unknown: an orphan
    bh = [xxhash.xxh64_digest(bytes([i])) * 4 for i in range(3)]
    _feed(idx, log, "c", [store(ps[4], 4, 0, 3, hashes=bh)], 0, model="m2")
    _feed(idx, log, "d", [store(ps[5], 4, 0, 2)], 0, model="m3")
    idx.drop_worker("d", 0)
    idx.mark_stale("c", 0, "a test said so")
    return log


def _follow_up(idx: PrefixIndex) -> None:
    """Batches that read what a snapshot must have kept: the orphan's parent arrives,
    one of two announcements goes, CPU chunks and the STORAGE tier are evicted."""
    ps = _prompts()
    idx.apply("b", encode_batch([store(ps[3], 4, 0, 2)], ts=TS + 50, dp_rank=0), seq=2)
    idx.apply("b", encode_batch([removed(ehashes(ps[0], 4)[:4])], ts=TS + 51, dp_rank=0), seq=3)
    idx.apply("a", encode_batch([removed(ehashes(ps[0], 4)[2:4], medium="CPU")], ts=TS + 52, dp_rank=0), seq=3)
    idx.apply("a", encode_batch([Cleared()], ts=TS + 53, dp_rank=0), seq=4)


def _answers(idx: PrefixIndex) -> list:
    out = []
    for model in ("default", "m2"):
        for p in _prompts():
            d = idx.match(p, model=model).to_dict()
            for w in d["workers"]:
                w.pop("last_event_age_s", None)
            out.append(d)
    return out


def _sizes(idx: PrefixIndex) -> dict:
    s = idx.stats()
    return {k: s[k] for k in ("nodes", "resident_entries", "orphans", "workers", "stale_workers", "tiers")} | {
        "models": {m: {k: v for k, v in d.items()} for m, d in s["models"].items()}}


@pytest.mark.parametrize("capped", [False, True])
def test_R_DUR_1_restored_index_answers_as_one_that_never_stopped(capped):
    kw = {"max_nodes": 1000} if capped else {}
    live = PrefixIndex(**kw)
    _rich(live)
    snap = loads(dumps(live, meta={"k": 1}))
    restored = PrefixIndex(**kw)
    snap.restore(restored)
    assert _answers(restored) == _answers(live)
    assert _sizes(restored) == _sizes(live)
    assert restored.models() == live.models()
    assert {(w["engine"], w["dp_rank"]): (w["last_seq"], w["stale"], w["stale_reason"]) for w in restored.workers()} \
        == {(w["engine"], w["dp_rank"]): (w["last_seq"], w["stale"], w["stale_reason"]) for w in live.workers()}
    _follow_up(live)
    _follow_up(restored)
    assert _answers(restored) == _answers(live)
    assert _sizes(restored) == _sizes(live)
    assert restored.stats()["counters"].get("orphans_adopted") == 1


def test_R_DUR_1_the_follow_up_reads_what_the_snapshot_kept():
    """The follow-up is not vacuous: it changes the answers, so a restore that lost the
    orphan, the second announcement or the chunks would differ."""
    live = PrefixIndex()
    _rich(live)
    before = _answers(live)
    _follow_up(live)
    assert _answers(live) != before


def test_R_DUR_1_duplicate_seq_and_restart_rules_hold_after_restore():
    live = PrefixIndex()
    log = _rich(live)
    restored = PrefixIndex()
    loads(dumps(live)).restore(restored)
    engine, rank, model, seq, payload = log[0]
    assert restored.apply(engine, payload, model=model, dp_rank=rank, seq=seq) == "duplicate"
    # seq 0 again with a newer ts: the engine restarted (R-STR-5), its old blocks go
    held = {w["engine"] for w in restored.match(_prompts()[0]).to_dict()["workers"] if w["total_blocks"]}
    assert "a" in held
    assert restored.apply("a", encode_batch([], ts=TS + 99, dp_rank=0), seq=0) == "applied"
    held = {w["engine"] for w in restored.match(_prompts()[0]).to_dict()["workers"] if w["total_blocks"]}
    assert "a" not in held and restored.stats()["counters"]["restarts"] == 1


def test_R_DUR_1_empty_index_round_trips():
    restored = PrefixIndex()
    loads(dumps(PrefixIndex())).restore(restored)
    assert restored.stats()["nodes"] == 0 and restored.workers() == []


def test_R_DUR_1_restore_needs_an_empty_index():
    live = PrefixIndex()
    _rich(live)
    with pytest.raises(ValueError, match="empty"):
        loads(dumps(live)).restore(live)


def test_R_DUR_1_restore_with_replace_drops_what_the_index_held_first():
    """A JetStream replica reloading a newer snapshot: what it held goes, all of it."""
    live = PrefixIndex()
    _rich(live)
    snap = loads(dumps(live))
    other = PrefixIndex()
    _feed(other, [], "z", [store(toks(7001, 6, 4), 4, 0, 6, medium="CPU")], 0, model="mz")
    snap.restore(other, replace=True)
    assert _answers(other) == _answers(live) and _sizes(other) == _sizes(live)
    assert "mz" not in other.models() and {w["engine"] for w in other.workers()} == {"a", "b", "c"}


# ------------------------------------------------------------------ the file


def _header(data: bytes) -> tuple:
    # The layout docs/snapshot.md gives, read here by hand (not through the module).
    return struct.unpack(">8sIIQQ", data[:32])


def test_R_DUR_3_header_is_the_documented_layout():
    live = PrefixIndex()
    _rich(live)
    data = dumps(live)
    magic, version, flags, length, digest = _header(data)
    assert magic == b"KVISNAP\0" and version == FORMAT_VERSION == 1 and flags == 0
    assert length == len(data) - 32
    assert digest == xxhash.xxh64_intdigest(data[32:])


def _reframe(body: bytes, version: int = FORMAT_VERSION) -> bytes:
    return struct.pack(">8sIIQQ", b"KVISNAP\0", version, 0, len(body), xxhash.xxh64_intdigest(body)) + body


@pytest.mark.parametrize("mangle, reason", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: d[:20], "truncated"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    (lambda d: b"PK\x03\x04" + d[4:], "magic"),
    (lambda d: b"", "truncated"),
    (lambda d: b"{}", "magic"),
    (lambda d: _reframe(d[32:], FORMAT_VERSION + 1), "version"),
    (lambda d: _reframe(b"\x93\x01\x02\x03"), "corrupt"),
    (lambda d: d + b"x", "corrupt"),
])
def test_R_DUR_3_bad_snapshots_are_refused_with_a_reason(mangle, reason):
    live = PrefixIndex()
    _rich(live)
    with pytest.raises(SnapshotError) as e:
        loads(mangle(dumps(live)))
    assert e.value.reason == reason


def test_R_DUR_3_a_well_framed_body_that_lies_is_refused_and_leaves_the_index_empty():
    import msgspec

    live = PrefixIndex()
    _rich(live)
    body = msgspec.msgpack.decode(dumps(live)[32:])
    body["workers"][0][-1][0][2] = body["workers"][0][-1][0][2] + b"\x00\x00\x01\x00"  # a node past the end
    snap = loads(_reframe(msgspec.msgpack.encode(body)))
    idx = PrefixIndex()
    with pytest.raises(SnapshotError) as e:
        snap.restore(idx)
    assert e.value.reason == "corrupt"
    assert idx.workers() == [] and idx.stats()["nodes"] == 0


def test_R_DUR_3_write_is_atomic(tmp_path):
    path = str(tmp_path / "index.snap")
    write_atomic(path, b"old")
    write_atomic(path, b"new")
    with open(path, "rb") as f:
        assert f.read() == b"new"
    assert os.listdir(tmp_path) == ["index.snap"]


# --------------------------------------------------------- warm restart, live


def _restart_rig(rig, *, replay=True, buffer_steps=10_000):
    pub = rig.pub(buffer_steps=buffer_steps)
    rec = Rec(pub, "e1")
    conf = cfg(pub, "e1", replay=replay)
    ix = rig.indexer([conf])
    ready(ix)  # connected, and the subscription probed
    for i in range(3):
        rec.send(gpu(P[i]))
    rec.send([removed(ehashes(P[0], BS)[2:])])
    wait_applied(ix, rec)
    data = ix.snapshot(meta={"why": "test"})
    ix.stop()
    return pub, rec, conf, data


def _resumed(rig, data, engines=()):
    ix = rig.indexer(list(engines), snapshot=loads(data), replay_timeout_s=10.0)
    return ix


def test_R_DUR_2_restart_replays_what_it_missed_and_equals_a_service_that_never_stopped(rig):
    pub, rec, conf, data = _restart_rig(rig)
    for i in range(3, 6):  # published while the index is down: PUB drops them
        rec.send(gpu(P[i]), drop=True)
    ix = _resumed(rig, data)  # the engine comes from the snapshot's registry
    assert [c.id for c in ix.engines()] == ["e1"]
    wait_until(lambda: wi(ix, "e1")["last_seq"] == rec.pub.next_seq - 1 and not wi(ix, "e1")["replaying"],
               msg=lambda: f"replayed the missed batches: {wi(ix, 'e1')}")
    assert not wi(ix, "e1")["stale"]
    assert_same_index(ix, reference([rec]), P)
    assert ix.index.counter("continuity_proven") == 1
    rec.send(gpu(P[6]))  # and live batches go on
    wait_until(lambda: wi(ix, "e1")["last_seq"] == rec.pub.next_seq - 1, msg="live again")
    assert_same_index(ix, reference([rec]), P)


def test_R_DUR_2_an_idle_engine_is_proven_at_once(rig):
    pub, rec, conf, data = _restart_rig(rig)
    ix = _resumed(rig, data, [conf])
    wait_until(lambda: ix.index.counter("continuity_proven") == 1, msg=lambda: f"proven: {wi(ix, 'e1')}")
    assert not wi(ix, "e1")["stale"]
    assert_same_index(ix, reference([rec]), P)


def test_R_DUR_2_an_engine_that_restarted_while_the_index_was_down_is_rebuilt(rig):
    pub, rec, conf, data = _restart_rig(rig)
    rec.restart()  # same ports, a new incarnation: seq 0 again, empty caches
    rec.send(gpu(P[5]), drop=True)  # nobody hears it; the replay has it
    ix = _resumed(rig, data, [conf])
    wait_until(lambda: ix.index.counter("continuity_restart") == 1 and not wi(ix, "e1")["replaying"],
               msg=lambda: f"restart proven: {wi(ix, 'e1')}")
    wait_until(lambda: wi(ix, "e1")["last_seq"] == 0, msg="rebuilt from 0")
    assert_same_index(ix, reference([rec]), P)  # P0..P2 gone, P5 there
    assert not wi(ix, "e1")["stale"]


def test_R_DUR_2_no_replay_endpoint_leaves_the_worker_stale_saying_why(rig):
    pub, rec, conf, data = _restart_rig(rig, replay=False)
    ix = _resumed(rig, data, [conf])
    wait_until(lambda: wi(ix, "e1")["stale"], msg=lambda: f"stale: {wi(ix, 'e1')}")
    assert "no replay endpoint" in wi(ix, "e1")["stale_reason"]
    held = [{w["engine"]: w["total_blocks"] for w in ix.index.match(p).to_dict()["workers"]} for p in P]
    assert held == [{w["engine"]: w["total_blocks"] for w in reference([rec]).match(p).to_dict()["workers"]} for p in P]
    assert held[1] == {"e1": 4}  # the index is kept, flagged


def test_R_DUR_2_a_replay_buffer_that_no_longer_covers_the_gap_makes_the_worker_stale(rig):
    pub, rec, conf, data = _restart_rig(rig, buffer_steps=3)
    for i in range(3, 8):
        rec.send(gpu(P[i % len(P)]), drop=True)  # more than the ring keeps
    ix = _resumed(rig, data, [conf])
    wait_until(lambda: wi(ix, "e1")["stale"] and not wi(ix, "e1")["replaying"], msg=lambda: f"stale: {wi(ix, 'e1')}")
    assert "overrun" in wi(ix, "e1")["stale_reason"]


def test_R_DUR_2_workers_of_no_engine_are_dropped_and_config_wins(rig):
    pub, rec, conf, data = _restart_rig(rig)
    other = EngineConfig(id="e1", endpoint=conf.endpoint, replay_endpoint=conf.replay_endpoint, model="m9")
    ix = _resumed(rig, data, [other])  # the configuration moved e1 to another model
    assert [(c.id, c.model) for c in ix.engines()] == [("e1", "m9")]
    assert ix.index.models() in (["m9"], ["default", "m9"])
    assert ix.index.match(P[1], model="m9").to_dict()["workers"] == [] or \
        all(w["total_blocks"] == 0 for w in ix.index.match(P[1], model="m9").to_dict()["workers"])


def test_R_DUR_1_indexer_snapshot_carries_the_registry(rig):
    pub, rec, conf, data = _restart_rig(rig)
    snap = loads(data)
    assert snap.meta == {"why": "test"}
    assert [e["id"] for e in snap.engines] == ["e1"]
    assert [EngineConfig(**e) for e in snap.engines] == [conf]
    assert snap.workers() == [("e1", 0, "default", 3)]
