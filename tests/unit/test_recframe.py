"""The compiled framer of a recording's applies (recframe.c) against the Python encoder
it stands in for (``Recorder._encode`` and ``recfile.frame``): the same records, byte for
byte where both keep a payload, over plain GPU batches and every shape it must leave to
Python (docs/record.md). The references are the xxhash package's xxh3-64 and msgspec's
decoder, not the framer's own code."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest
import xxhash

from evkit import FakeClock, removed, store, toks
from indexer import PrefixIndex
from indexer._native import core
from indexer.ingest.recfile import frame
from indexer.ingest.record import Recorder
from indexer.producer.events import encode_batch
from indexer.store import journal as J
from indexer.wire.keys import KEY_SEED

pytestmark = pytest.mark.skipif(core is None, reason="the compiled core is not built")

BS = 4


def _unframe(data: bytes) -> list:
    """Frames as recfile documents them: the check is the low 32 bits of xxh3-64."""
    out, pos = [], 0
    while pos < len(data):
        n, crc = struct.unpack_from("<II", data, pos)
        body = data[pos + 8 : pos + 8 + n]
        assert len(body) == n
        assert xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF == crc
        out.append(body)
        pos += 8 + n
    return out


def _frame(items, start, hashed, path) -> tuple[bytes, int]:
    """What frame_applies writes from ``start`` (to a new file at ``path``) and its next."""
    with open(path, "wb", buffering=0) as f:
        nxt, written = core.frame_applies(items, start, hashed, KEY_SEED, f.fileno())
    with open(path, "rb") as f:
        data = f.read()
    assert written == len(data)
    return data, nxt


def _journal(tmp_path, batches) -> tuple[Recorder, list]:
    """A recorded index (no writer thread) that applied ``batches``; its queued records."""
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path))
    rec.attach(idx)
    for s, (engine, payload, rank) in enumerate(batches):
        idx.apply_sequenced(engine, payload, seq=s, dp_rank=rank)
    items = [r for r in rec.journal.records if r[0] != "base"]
    return rec, items


def _shapes(rnd: random.Random) -> list:
    t = toks(0, 6, BS)
    u = toks(900, 3, BS)
    big = [rnd.randrange(0, 1 << 32) for _ in range(16 * BS)]
    return [
        ("e0", encode_batch([store(t, BS, 0, 3)], dp_rank=0), 0),  # plain, one store
        ("e0", encode_batch([store(t, BS, 3, 6), store(u, BS, 0, 3)], dp_rank=None), None),  # two, no rank
        ("e1", encode_batch([store(big, BS, 0, 16)], ts=12.5, dp_rank=3), 3),  # ids of every width
        ("e1", encode_batch([store(t, BS, 0, 2, lora_name="ad")]), 0),  # LoRA: Python's
        ("e1", encode_batch([store(t, BS, 0, 2, medium="CPU")]), 0),  # CPU tier: Python's
        ("e1", encode_batch([removed([1, 2])]), 0),  # a removal: Python's
        ("e1", encode_batch([store(t, BS, 0, 2)], version="0.23"), 0),  # positional: Python's
        ("e1", encode_batch([store(toks(5, 2, 1), 1, 0, 2)]), 0),  # block size 1: Python's
        ("e1", b"\x93\x01\x02", 0),  # not a batch: refused, recorded
        ("e0", encode_batch([store(t, BS, 0, 6)], ts=float("inf")), 0),  # a non-finite ts: Python's
        ("é", encode_batch([store(u, BS, 0, 3)]), 0),  # a non-ASCII engine name
    ]


@pytest.mark.parametrize("mode", ["hashed", "full"])
def test_frame_applies_writes_what_the_python_encoder_writes(tmp_path, mode):
    rec, items = _journal(tmp_path, _shapes(random.Random(3)) * 3)
    rec.tokens = mode
    want = [msgspec.msgpack.decode(rec._encode(it)) for it in items]
    got, i = [], 0
    out = tmp_path / "frames"
    while i < len(items):
        frames, nxt = _frame(items, i, mode == "hashed", out)
        if nxt == i:  # left to Python
            got.append(msgspec.msgpack.decode(rec._encode(items[i])))
            i += 1
            continue
        got += [msgspec.msgpack.decode(b) for b in _unframe(frames)]
        i = nxt
    assert got == want
    # The compiled framer took the plain batches: not every record fell to Python.
    firsts = [_frame(items, k, mode == "hashed", out)[1] - k for k in range(len(items))]
    assert sum(1 for d in firsts if d > 0) >= 12


def test_frame_applies_stops_at_what_is_not_an_apply(tmp_path):
    rec, items = _journal(tmp_path, _shapes(random.Random(1))[:2])
    mixed = [items[0], ("note", 1.0, "replayed", "e0", 0, None), items[1], (J.ROUTE_DONE, 1.0, ("r",), None, [])]
    out = tmp_path / "frames"
    assert _frame(mixed, 0, True, out)[1] == 1
    assert _frame(mixed, 1, True, out) == (b"", 1)
    assert _frame(mixed, 2, True, out)[1] == 3
    assert _frame(mixed, 3, True, out) == (b"", 3)
    with pytest.raises(IndexError):
        _frame(mixed, 5, True, out)


def test_a_full_disk_is_an_oserror(tmp_path):
    _, items = _journal(tmp_path, _shapes(random.Random(2))[:3])
    with open("/dev/full", "wb", buffering=0) as f, pytest.raises(OSError) as e:
        core.frame_applies(items, 0, True, KEY_SEED, f.fileno())
    assert e.value.errno == 28  # ENOSPC


def test_frame_many_is_recfile_frame(tmp_path):
    rnd = random.Random(5)
    bodies = [rnd.randbytes(rnd.randrange(0, 70)) for _ in range(200)] + [rnd.randbytes(5000)]
    assert core.frame_many(bodies) == b"".join(frame(b) for b in bodies)
    assert core.frame_many([]) == b""
    with pytest.raises(TypeError):
        core.frame_many([b"x", "y"])


def test_a_query_record_leaves_the_collector_nothing_to_walk_but_the_callers_own(tmp_path):
    """The journal untracks the values a query hands its record (journal.c), never an
    object the caller still holds: the caller's load map stays tracked, and so does the
    arguments' tuple that holds it."""
    import gc

    from indexer.query.route import Load

    idx = PrefixIndex(clock=FakeClock())
    t = toks(0, 6, BS)
    idx.apply_sequenced("e0", encode_batch([store(t, BS, 0, 6)]), seq=0)
    rec = Recorder(str(tmp_path))
    rec.attach(idx)
    load = {"e0/0": Load(3, 1)}
    idx.match_plain(bytes(__import__("array").array("I", t)), "default")
    r = idx.route(t, load=load, max_tokens=8)
    idx.route_done(r["request_id"])
    records = [x for x in rec.journal.records if x[0] in (J.MATCH_PLAIN, J.ROUTE)]
    assert [x[0] for x in records] == [J.MATCH_PLAIN, J.ROUTE]

    def tracked(o, seen):
        if id(o) in seen or isinstance(o, type):
            return []
        seen.add(id(o))
        out = [o] if gc.is_tracked(o) else []
        for x in gc.get_referents(o):
            if not isinstance(x, type):
                out += tracked(x, seen)
        return out

    for x in records:
        left = [o for o in tracked(x, set())
                if o is not load and o not in load.values() and not (isinstance(o, tuple) and load in o)]
        assert left == [], (x[0], [type(o).__name__ for o in left])
    assert gc.is_tracked(load)
    rec.stop()
