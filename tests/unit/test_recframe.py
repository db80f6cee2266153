"""The compiled journal's runs of applies (journal.c, applyrun.c) and their framer
(recframe.c) against the Python encoder they stand in for (``Recorder._encode`` and
``recfile.frame``): the same records, byte for byte where both keep a payload, over plain
GPU batches and every shape the framer must leave to Python (docs/record.md); a run's
records read back as the tuples the journal queues for any other call. The references
are the xxhash package's xxh3-64, msgspec's decoder and the arguments as applied, not
the framer's own code."""

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


def _frame(run, start, hashed, path) -> tuple[bytes, int]:
    """What frame_run writes from ``start`` (to a new file at ``path``) and its next."""
    with open(path, "wb", buffering=0) as f:
        nxt, written = core.frame_run(run, start, hashed, KEY_SEED, f.fileno())
    with open(path, "rb") as f:
        data = f.read()
    assert written == len(data)
    return data, nxt


def _journal(tmp_path, batches, tokens="hashed") -> tuple[Recorder, list]:
    """An index recorded in ``tokens`` mode (no writer thread) that applied ``batches``;
    its queued runs (the base taken out)."""
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path), tokens=tokens)
    rec.attach(idx)
    for s, (engine, payload, rank) in enumerate(batches):
        idx.apply_sequenced(engine, payload, seq=s, dp_rank=rank)
    rec.journal.seal()
    runs = [r for r in rec.journal.records if not isinstance(r, tuple)]
    return rec, runs


def _shapes(rnd: random.Random) -> list:
    t = toks(0, 6, BS)
    u = toks(900, 3, BS)
    big = [rnd.randrange(0, 1 << 32) for _ in range(16 * BS)]
    return [
        ("e0", encode_batch([store(t, BS, 0, 3)], dp_rank=0), 0),  # plain, one store
        ("e0", encode_batch([store(t, BS, 3, 6), store(u, BS, 0, 3)], dp_rank=None), None),  # two, no rank
        ("e1", encode_batch([store(big, BS, 0, 16)], ts=12.5, dp_rank=3), 3),  # ids of every width
        ("e1", encode_batch([store(toks(5000, 40, BS), BS, 0, 40)], dp_rank=3), 3),  # 320 B of keys: a bin 16
        ("e1", encode_batch([store(t, BS, 0, 2, lora_name="ad")]), 0),  # LoRA: Python's
        ("e1", encode_batch([store(t, BS, 0, 2, medium="CPU")]), 0),  # CPU tier: Python's
        ("e1", encode_batch([removed([1, 2])]), 0),  # a removal: Python's
        ("e1", encode_batch([store(t, BS, 0, 2)], version="0.23"), 0),  # positional: Python's
        ("e1", encode_batch([store(toks(5, 2, 1), 1, 0, 2)]), 0),  # block size 1: Python's
        ("e1", b"\x93\x01\x02", 0),  # not a batch: refused, recorded
        ("e0", encode_batch([store(t, BS, 0, 6)], ts=float("inf")), 0),  # a non-finite ts: Python's
        ("é", encode_batch([store(u, BS, 0, 3)]), 0),  # a non-ASCII engine name
    ]


def test_a_run_holds_each_apply_as_the_journal_queues_it(tmp_path):
    batches = _shapes(random.Random(4)) * 2
    _, runs = _journal(tmp_path, batches, "full")
    assert len(runs) == 1 and len(runs[0]) == len(batches)
    run = runs[0]
    for i in [*range(len(batches)), 3, 0, len(batches) - 1]:  # the cursor goes back too
        engine, payload, rank = batches[i]
        op, wall, args, result, times = run.item(i)
        assert op == J.APPLY_SEQUENCED and isinstance(wall, float)
        assert args == (engine, payload, "default", rank, i, False)
        assert result[0] in ("applied", "applied_with_duplicates", "dropped") or result[0] == "applied"
        assert isinstance(times, tuple) and all(isinstance(t, float) for t in times)
    with pytest.raises(IndexError):
        run.item(len(batches))


def test_hashed_mode_lays_the_keys_the_apply_made(tmp_path):
    """In hashed mode a batch whose every store the compiled apply inserted is laid with
    those keys for its token ids (the key sink): the payload recprivacy.strip_payload
    makes from the tokens. A batch any store of which took another path (a parent the
    worker does not map, a LoRA store, a store of block size 1, a removal) is laid whole,
    for the writer to strip."""
    from indexer.ingest.recprivacy import strip_payload

    t = toks(0, 8, BS)
    batches = [
        ("e0", encode_batch([store(t, BS, 0, 2), store(t, BS, 2, 3)]), 0),  # new blocks: keyed
        ("e0", encode_batch([store(t, BS, 0, 3)]), 0),  # the same blocks again: keyed too (duplicates)
        ("e0", encode_batch([store(t, BS, 3, 5), store(toks(70, 2, BS), BS, 0, 2)]), 0),  # two stores
        ("e0", encode_batch([msgspec.structs.replace(store(t, BS, 6, 8), parent_block_hash=999)]), 0),  # not mapped
        ("e0", encode_batch([store(t, BS, 5, 6), store(t, BS, 0, 2, lora_name="ad")]), 0),  # one not plain
        ("e1", encode_batch([store(toks(5, 2, 1), 1, 0, 2)]), 0),  # block size 1
        ("e0", encode_batch([removed([1, 2])]), 0),
    ]
    first = ("e0", encode_batch([store(toks(50, 1, BS), BS, 0, 1)]), 0)  # a tree's first store: the slow path
    _, (run,) = _journal(tmp_path, [first, *batches])
    laid = [run.item(i)[2][1] for i in range(1, len(run))]
    assert run.item(0)[2][1] == first[1]
    for i in (0, 1, 2):
        assert laid[i] == strip_payload(batches[i][1], "hashed") != batches[i][1], i
    for i in (3, 4, 5, 6):
        assert laid[i] == batches[i][1], i


@pytest.mark.parametrize("mode", ["hashed", "full"])
def test_frame_run_writes_what_the_python_encoder_writes(tmp_path, mode):
    batches = _shapes(random.Random(3)) * 3
    rec, runs = _journal(tmp_path, batches, mode)
    (run,) = runs
    # The reference: the Python encoder of each batch as applied (not as laid).
    want = []
    for k, (engine, payload, _) in enumerate(batches):
        op, wall, args, result, times = run.item(k)
        assert args[0] == engine
        want.append(msgspec.msgpack.decode(rec._encode((op, wall, (engine, payload, *args[2:]), result, times))))
    laid_stripped = sum(run.item(k)[2][1] != batches[k][1] for k in range(len(run)))
    assert laid_stripped >= (8 if mode == "hashed" else 0) and (mode == "hashed" or laid_stripped == 0)
    got, i = [], 0
    out = tmp_path / "frames"
    while i < len(run):
        frames, nxt = _frame(run, i, mode == "hashed", out)
        got += [msgspec.msgpack.decode(b) for b in _unframe(frames)]
        if nxt < len(run) and nxt == i:  # left to Python
            got.append(msgspec.msgpack.decode(rec._encode(run.item(i))))
            nxt += 1
        i = nxt
    assert got == want
    # The compiled framer took the plain batches: not every record fell to Python.
    firsts = [_frame(run, k, mode == "hashed", out)[1] - k for k in range(len(run))]
    assert sum(1 for d in firsts if d > 0) >= 12
    if mode == "full":
        assert _frame(run, 0, False, out)[1] == len(run)  # every payload kept whole
    with pytest.raises(IndexError):
        _frame(run, len(run) + 1, True, out)


def test_a_run_is_queued_before_any_other_record(tmp_path):
    """Order: the applies (and the records laid with them) before a note or a flush go
    first, each run whole; a record the writer encodes (a ranking of dicts) has its place
    in the run and waits in the journal's ``apart`` queue."""
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path))
    rec.attach(idx)
    t = toks(0, 6, BS)
    idx.apply_sequenced("e0", encode_batch([store(t, BS, 0, 3)]), seq=0)
    idx.apply_sequenced("e0", encode_batch([store(t, BS, 3, 6)]), seq=1)
    rec.note("replayed", "e0", 0, 1)
    idx.apply_sequenced("e0", encode_batch([removed([1])]), seq=2)
    idx.route_done("nothing")  # encoded and laid in the run, after the apply (journal.c's encoded)
    idx.route(t, lora_name="ad")  # a namespaced prompt: queued apart for the writer, its place in the run
    idx.apply_sequenced("e0", encode_batch([removed([2])]), seq=3)  # the same run goes on
    rec.journal.seal()
    kinds = [("run", len(r)) if not isinstance(r, tuple) else r[0] for r in rec.journal.records]
    assert kinds == ["base", ("run", 2), "note", ("run", 4)]
    run = rec.journal.records[-1]
    assert [type(run.item(i)).__name__ for i in range(4)] == ["tuple", "bytes", "NoneType", "tuple"]
    assert [r[0] for r in rec.journal.apart] == [J.ROUTE]
    assert rec.journal.pending == 8
    rec.stop()


def test_the_writer_is_woken_once_a_wake_bytes_of_applies(tmp_path):
    """Past wake_bytes of applies not written, the journal wakes the writer once and
    again only after another wake_bytes (not at every apply while the writer has not
    released them yet: each wake queues the open run, and runs of one batch each were
    fresh buffers faulted in on the ingest's thread)."""
    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path))
    rec.attach(idx)
    j = rec.journal
    wakes = []
    j.wake = lambda: wakes.append(j.run_bytes)
    j.wake_bytes = 4096
    for s in range(400):
        idx.apply_sequenced("e0", encode_batch([store(toks(1000 * s, 4, BS), BS, 0, 4)]), seq=s)
    laid = j.run_bytes
    assert laid > 20 * 4096
    assert all(b - a >= 4096 for a, b in zip(wakes, wakes[1:]))  # one each 4 KiB laid
    assert laid // (4096 + 512) <= len(wakes) <= laid // 4096  # a record (~340 B) past each
    j.seal()
    runs = [r for r in j.records if not isinstance(r, tuple)]
    assert sum(map(len, runs)) == 400 and len(runs) <= len(wakes) + 1
    assert min(len(r) for r in runs[:-1]) > 10  # no run of one batch
    rec.stop()


def test_a_full_disk_is_an_oserror(tmp_path):
    _, (run,) = _journal(tmp_path, _shapes(random.Random(2))[:3])
    with open("/dev/full", "wb", buffering=0) as f, pytest.raises(OSError) as e:
        core.frame_run(run, 0, True, KEY_SEED, f.fileno())
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
    rec.journal.encode = False  # queued as tuples (a shape left to the writer is untracked alike)
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


@pytest.mark.parametrize("tokens", ["hashed", "none"])
def test_records_laid_between_applies_replay_in_order(tmp_path, tokens):
    """Queries and route ends laid encoded in the runs (a small run that grows, then runs
    sealed full), between applies and records queued apart in their places: written in
    order by the compiled framer (hashed) or record by record (none), and replayed to the
    same answers."""
    from indexer.ingest.replay import replay
    from indexer.wire.keys import tokens_to_bytes

    idx = PrefixIndex(clock=FakeClock())
    rec = Recorder(str(tmp_path), tokens=tokens)
    rec.attach(idx)
    rec.journal.stock(0)  # no kept buffers: runs begin small
    n = calls = 0
    for s in range(40):
        t = toks(100 * s, 32, BS)
        idx.apply_sequenced(f"e{s % 3}", encode_batch([store(t, BS, 0, 32)]), seq=s // 3)
        for k in range(60):
            # None (no answer) once a LoRA route's predictions are in flight: match's to give
            plain = idx.match_plain(tokens_to_bytes(t[: BS * (1 + k % 32)]), "default")
            r = idx.route_body(tokens_to_bytes(t), model="default", load={}, link=None)
            idx.route_done(r.request_id)
            n += 1 + (plain is not None)
            calls += 3
        if s % 10 == 9:
            idx.route(t)  # a ranking of dicts
            idx.route(t, lora_name="ad")  # queued apart, in its place in the run
            n += 2
            calls += 2
    rec.stop()
    assert (rec.records, rec.answers) == (40 + calls, n)
    rep = replay(str(tmp_path))
    queries = 40 * 60 * 2 + 4 * 2  # a replay checks the match_plain that answered None too
    assert rep.answers == queries and not rep.damage
    assert rep.reproduced == (queries if tokens == "hashed" else 0)
