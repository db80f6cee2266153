"""Record and replay in process: a recorded index replays to the same answers, call by
call (docs/record.md). The reference for "the same answer" is what the recorded index
itself answered, captured here by the test (not by the recorder) and compared with the
replay's index queried again at the same point."""

from __future__ import annotations

import os
import random
import threading
import time

import msgspec
import pytest

from evkit import FakeClock, apply, removed, store, toks
from indexer import PrefixIndex
from indexer.ingest.recfile import read_segment, segments
from indexer.ingest.record import Recorder
from indexer.ingest.replay import describe, replay
from indexer.producer.events import Cleared, encode_batch

BS = 4


def _drive(idx: PrefixIndex, clock: FakeClock, *, layout: str = "0.33", seed: int = 7) -> list:
    """A small fleet's life: stores, removals, a restart, a removal, routes with load and
    done, matches (hit, miss, LoRA, salt, unknown model); returns the answers given."""
    rnd = random.Random(seed)
    seqs = {("e0", 0): 0, ("e0", 1): 0, ("e1", 0): 0}
    prompts = [toks(1000 * i, 6, BS) for i in range(4)]
    answers = []

    def batch(engine, rank, events, ts=None):
        clock.t += 0.01
        s = seqs[(engine, rank)]
        seqs[(engine, rank)] = s + 1
        payload = encode_batch(events, version=layout, dp_rank=rank, ts=ts or 1767225600.0 + s)
        return idx.apply_sequenced(engine, payload, seq=s, dp_rank=rank)

    for e, r in seqs:
        idx.register_worker(e, r)
    for step in range(30):
        e, r = rnd.choice(list(seqs))
        p = rnd.choice(prompts)
        k = rnd.randint(1, 6)
        batch(e, r, [store(p, BS, 0, k)])
        if step % 7 == 3:
            batch(e, r, [removed([store(p, BS, 0, 1).block_hashes[0]])])
        clock.t += 0.5
        out = idx.route(rnd.choice(prompts)[: rnd.randint(4, 24)], max_tokens=rnd.choice([None, 32]))
        answers.append(out)
        if step % 3 == 0:
            answers.append(idx.route_done(out["request_id"]))
        answers.append(idx.match(rnd.choice(prompts)).to_dict())
        if step == 10:
            idx.reset_worker("e1", 0)  # a restart
            seqs[("e1", 0)] = 0
        if step == 20:
            idx.drop_engine("e0")  # an engine removal, then it comes back
            idx.register_worker("e0", 0)
            seqs[("e0", 0)] = seqs[("e0", 1)] = 0
            seqs.pop(("e0", 1))
        if step == 25:
            batch("e1", 0, [Cleared()])
            idx.mark_stale("e1", 0, "replay failed")
        clock.t += 40.0 if step == 15 else 0.2  # past the prefill TTL once
    answers.append(idx.match(prompts[0], lora_name="a").to_dict())
    answers.append(idx.match(prompts[0], cache_salt="s").to_dict())
    answers.append(idx.match_by_keys([1, 2, 3]).to_dict())
    answers.append(idx.match_plain(bytes(msgspec.msgpack.encode(0))[:0] + bytes(64), None))
    with pytest.raises(KeyError):
        idx.match(prompts[0], model="nope")
    answers.append(idx.workers())
    return answers


def _all_bytes(d) -> bytes:
    out = b""
    for _, _, p in segments(str(d)):
        with open(p, "rb") as f:
            out += f.read()
    return out


def _record(tmp_path, tokens="hashed", layout="0.33", **kw):
    clock = FakeClock()
    idx = PrefixIndex(clock=clock, prefill_ttl_s=30.0)
    rec = Recorder(str(tmp_path), tokens=tokens, **kw)
    rec.attach(idx)
    answers = _drive(idx, clock, layout=layout)
    rec.stop()
    return idx, rec, answers


@pytest.mark.parametrize("tokens", ["hashed", "full"])
@pytest.mark.parametrize("layout", ["0.33", "0.23"])
def test_replay_reproduces_every_answer(tmp_path, tokens, layout):
    idx, rec, _ = _record(tmp_path, tokens, layout)
    assert rec.stats()["errors"] == {}
    rep = replay(str(tmp_path))
    assert rep.mismatch is None, describe(rep)
    assert rep.damage == []
    assert rep.answers > 60 and rep.reproduced == rep.answers
    # The replayed state answers a fresh prompt as the recorded index does.
    p = toks(2000, 6, BS)
    assert rep.index.match(toks(0, 6, BS)).to_dict() == idx.match(toks(0, 6, BS)).to_dict()
    assert rep.index.match(p).to_dict() == idx.match(p).to_dict()


def test_hashed_keeps_no_token_id(tmp_path):
    _record(tmp_path, "hashed")
    raw = _all_bytes(tmp_path)
    # Prompt tokens were 1000*i + j (i < 4, j < 24): as msgpack uint16 (0xcd) they would show.
    for t in (1001, 2005, 3010):
        assert b"\xcd" + t.to_bytes(2, "big") not in raw
    full = tmp_path / "full"
    _record(full, "full")
    raw_full = _all_bytes(full)
    assert b"\xcd" + (1001).to_bytes(2, "big") in raw_full  # the check above can fail


def test_none_lists_without_checking(tmp_path):
    _record(tmp_path, "none")
    rep = replay(str(tmp_path))
    assert rep.tokens == "none" and rep.answers > 60 and rep.reproduced == 0
    assert "cannot be rebuilt" in describe(rep)


def test_a_changed_answer_is_reported_with_the_calls_before_it(tmp_path):
    _record(tmp_path, "full")
    path = segments(str(tmp_path))[0][2]
    # Replay with a different credit: every cached-prefix score changes.
    from indexer.ingest import recfile
    data = _all_bytes(tmp_path)
    recs = [r for _, r in recfile.read_segment(path)]
    recs[0][1]["options"]["credits"]["GPU"] = 3.0
    out = recfile.MAGIC + b"".join(recfile.frame(msgspec.msgpack.encode(r)) for r in recs)
    assert out != data
    with open(path, "wb") as f:
        f.write(out)
    rep = replay(str(tmp_path))
    assert rep.mismatch is not None and rep.mismatch.op in ("route", "match")
    text = rep.mismatch.report()
    assert "recorded:" in text and "replayed:" in text and "apply_sequenced" in text


def test_damaged_segment_reported_with_offset_then_next_base(tmp_path):
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path), segment_bytes=4096, max_bytes=1 << 30, flush_s=0.01)
    rec.attach(idx)
    clock = idx._raw_clock
    _drive(idx, clock)
    rec.flush()
    rec.rotate()  # a new segment with its own base, then more calls
    _drive(idx, clock, seed=8)
    rec.stop()
    segs = segments(str(tmp_path))
    assert len(segs) >= 2
    first = segs[0][2]
    size = os.path.getsize(first)
    with open(first, "r+b") as f:  # flip a byte in the middle of the first segment
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = replay(str(tmp_path))
    assert len(rep.damage) == 1 and rep.damage[0].path == first
    assert 8 <= rep.damage[0].offset <= size // 2
    assert "corrupt" in rep.damage[0].reason
    assert rep.mismatch is None, describe(rep)
    assert rep.reproduced > 0 and "DAMAGED" in describe(rep)
    strict = replay(str(tmp_path), strict=True)
    assert strict.index is None and strict.damage
    os.truncate(segs[-1][2], os.path.getsize(segs[-1][2]) - 3)  # a torn last frame
    rep2 = replay(str(tmp_path))
    assert any("truncated" in d.reason and d.path == segs[-1][2] for d in rep2.damage)


def test_a_base_larger_than_a_segment_does_not_begin_a_segment_per_write(tmp_path):
    """A segment's size counts what follows its base: an index whose state alone is larger
    than a segment keeps one segment until its calls fill one (counted with the base, every
    write began a new segment with a whole dump of the index)."""
    idx = PrefixIndex(clock=FakeClock())
    for i in range(64):  # 1,024 blocks: a base of tens of KB
        apply(idx, [store(toks(10_000 * i, 16, BS), BS, 0, 16)], engine="e0")
    rec = Recorder(str(tmp_path), segment_bytes=8192, max_bytes=1 << 30, flush_s=0.001)
    rec.attach(idx)
    rec.start()  # the writer thread: it checks the segment's size after each wake
    for i in range(10):
        idx.match(toks(10_000 * i, 16, BS))
        rec.flush()  # written: a chance to rotate each time, and the writer wakes every 1 ms
    rec.stop()
    segs = segments(str(tmp_path))
    assert os.path.getsize(segs[0][2]) > 8192  # the base alone is larger than a segment
    assert rec.segments_started == 1 and len(segs) == 1
    rep = replay(str(tmp_path))
    assert rep.mismatch is None and rep.answers == 10 == rep.reproduced


def test_a_segment_holds_at_least_its_base_before_the_next_one(tmp_path):
    """A base is the whole index, dumped under its lock: a segment is closed once what
    follows its base passes both record_segment_bytes and the base's own size, so a large
    index is not dumped again every few MB of calls (each closed segment here: its base,
    then at least as much again)."""
    idx = PrefixIndex(clock=FakeClock())
    for i in range(64):  # 1,024 blocks: a base of tens of KB
        apply(idx, [store(toks(10_000 * i, 16, BS), BS, 0, 16)], engine="e0")
    rec = Recorder(str(tmp_path), segment_bytes=4096, max_bytes=1 << 30, flush_s=0.001)
    rec.attach(idx)
    rec.start()
    for i in range(150):
        idx.match(toks(10_000 * (i % 64), 16, BS))
        rec.flush()  # written, and the writer checks the segment's size
    rec.stop()
    segs = segments(str(tmp_path))
    assert len(segs) >= 2
    for _, _, path in segs[:-1]:
        offsets = [x[0] for x in read_segment(path)]
        base = offsets[1]  # where the record after the base begins
        after = os.path.getsize(path) - base
        assert base > 4096 and after >= base, (base, after)
    rep = replay(str(tmp_path))
    assert rep.mismatch is None and rep.answers == 150 == rep.reproduced


def test_until_stops_at_a_call(tmp_path):
    idx, rec, _ = _record(tmp_path, "hashed")
    full = replay(str(tmp_path))
    part = replay(str(tmp_path), until_op=40)
    assert part.until_reached and part.at_op == 40 and part.calls < full.calls
    assert part.mismatch is None


def test_unwritable_directory_stops_recording_and_index_keeps_serving(tmp_path):
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path / "rec"), flush_s=0.01)
    rec.attach(idx)
    rec.start()
    idx.register_worker("e0")
    rec.flush()
    for _, _, p in segments(str(tmp_path / "rec")):
        os.remove(p)
    os.rmdir(tmp_path / "rec")
    (tmp_path / "rec").write_text("a file where the directory was")
    rec.rotate()  # the next segment cannot be made
    # The flush that meets the failure returns once the recording stopped (it waited out
    # its 10 s timeout when the failing base and the flush were taken in one chunk).
    flusher = threading.Thread(target=rec.flush)
    flusher.start()
    flusher.join(5)
    assert not flusher.is_alive()
    assert rec.stopped == "io_error" and rec.stats()["errors"] == {"io_error": 1}
    assert idx.journal is None
    assert idx.match([1] * 16).best is None  # still answers
    rec.stop()


def test_size_cap_drops_oldest_segments_and_the_rest_replays_from_its_base(tmp_path):
    clock = FakeClock()
    idx = PrefixIndex(clock=clock)
    cap = 96 * 1024
    rec = Recorder(str(tmp_path), segment_bytes=4096, max_bytes=cap, flush_s=0.005)
    rec.attach(idx)
    rec.start()
    for seed in range(8):
        rec.rotate()  # besides the writer's own rotation past segment_bytes
        _drive(idx, clock, seed=seed)
        rec.flush()
    rec.stop()
    st = rec.stats()
    segs = segments(str(tmp_path))
    assert st["segments_started"] >= 8 and st["segments_dropped"]["size"] >= 1
    assert segs[0][0] == st["segments_dropped"]["size"]  # the oldest went first, in order
    assert sum(os.path.getsize(p) for _, _, p in segs[:-1]) <= cap
    rep = replay(str(tmp_path))
    assert rep.mismatch is None, describe(rep)
    assert rep.damage == [] and rep.reproduced == rep.answers > 20


def test_age_cap_drops_segments_older_than_it(tmp_path):
    clock = FakeClock()
    idx = PrefixIndex(clock=clock)
    rec = Recorder(str(tmp_path), max_age_s=3600)
    rec.attach(idx)
    for seed in range(3):
        _drive(idx, clock, seed=seed)
        rec.rotate()
        rec.flush()
    segs = segments(str(tmp_path))
    assert len(segs) == 4 and rec.stats()["segments_dropped"]["age"] == 0
    # Make segments 0-3 two hours old (a segment's start is in its name): 0-2 ended two hours
    # ago (where their successors began), 3 ends at the next rotation, now.
    old_ms = int((time.time() - 7200) * 1000)
    for n, _, path in segs:
        os.rename(path, os.path.join(str(tmp_path), f"seg-{n:08d}-{old_ms + n}.kvr"))
    rec.rotate()
    rec.flush()
    assert rec.stats()["segments_dropped"]["age"] == 3
    assert [n for n, _, _ in segments(str(tmp_path))] == [3, 4]
    rec.stop()
    assert replay(str(tmp_path)).mismatch is None


def test_a_segment_of_the_first_format_replays(tmp_path):
    """Segments written with zlib's crc32 (magic KVIREC1) still read: the same recording,
    its frames checked by crc32 instead, replays to the same calls; a bad crc32 is damage."""
    import struct
    import zlib
    from pathlib import Path

    from indexer.ingest.recfile import MAGIC

    _record(tmp_path / "new", "hashed")
    want = replay(str(tmp_path / "new"))
    assert want.mismatch is None and want.reproduced > 0
    (tmp_path / "old").mkdir()
    for _, _, path in segments(str(tmp_path / "new")):
        data = Path(path).read_bytes()
        assert data.startswith(MAGIC)
        out, off = [b"KVIREC1\n"], len(MAGIC)
        while off < len(data):
            n, _ = struct.unpack_from("<II", data, off)
            body = data[off + 8 : off + 8 + n]
            out.append(struct.pack("<II", n, zlib.crc32(body)) + body)
            off += 8 + n
        (tmp_path / "old" / os.path.basename(path)).write_bytes(b"".join(out))
    got = replay(str(tmp_path / "old"))
    assert got.mismatch is None and not got.damage
    assert (got.calls, got.reproduced) == (want.calls, want.reproduced)
    first = segments(str(tmp_path / "old"))[0][2]
    data = bytearray(Path(first).read_bytes())
    data[12] ^= 0xFF  # the first frame's crc32
    Path(first).write_bytes(bytes(data))
    assert "crc32 does not match" in replay(str(tmp_path / "old")).damage[0].reason


def test_frames_are_written_whole_when_the_kernel_takes_part_of_each_write(tmp_path, monkeypatch):
    """A raw write may take part of what it is given: what is left is written next, in
    order, across frames."""
    from indexer.ingest import record as R

    real = os.writev
    monkeypatch.setattr(R.os, "writev", lambda fd, bufs: real(fd, [bytes(bufs[0])[:3]]))
    frames = [b"abcdefg", b"", b"hi", os.urandom(40), b"j" * 5]
    path = tmp_path / "w"
    with open(path, "wb", buffering=0) as f:
        assert R._write_all(f, list(frames)) == sum(map(len, frames))
        assert R._write_all(f, [b"tail"]) == 4
    assert path.read_bytes() == b"".join(frames) + b"tail"
