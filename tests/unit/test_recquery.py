"""The compiled encoder of the records a recording keeps beside its applies (recquery.c:
queries, notes, a route's end, a registration) against what the Python encoder makes of
the same journal tuples: byte for byte, over the service's two query doors (``/query``'s
``match_plain``, ``/v1/route``'s ``route_body``) in every argument shape they take, and
None (left to Python) for every shape it does not write. The reference is recops'
``encode_call`` / ``encode_result`` and msgspec, not the encoder's own code."""

from __future__ import annotations

import msgspec
import pytest

from evkit import FakeClock, store, toks
from indexer import PrefixIndex
from indexer._native import core
from indexer.ingest import record as R
from indexer.ingest.record import Recorder
from indexer.ingest.recfile import frame
from indexer.ingest.recops import encode_call, encode_result
from indexer.producer.events import encode_batch
from indexer.query.route import Load
from indexer.store import journal as J
from indexer.store.journal import Raised
from indexer.wire.keys import KEY_SEED, block_keys, tokens_to_bytes

pytestmark = pytest.mark.skipif(core is None or not hasattr(core, "encode_record"),
                                reason="the compiled core is not built")

BS = 4
_enc = msgspec.msgpack.Encoder()


def _reference(item: tuple, mode: str) -> bytes:
    if item[0] == "note":
        return _enc.encode(list(item))
    op, wall, args, result, times = item
    return _enc.encode([op, wall, times, encode_call(op, args, result, mode), encode_result(op, result)])


def _compiled(item: tuple, mode: str) -> bytes | None:
    kind = R._KINDS.get(item[0])
    assert kind is not None, item[0]
    return core.encode_record(item, kind, mode == "hashed", KEY_SEED, Raised)


def _fleet(tmp_path) -> tuple[PrefixIndex, Recorder]:
    """Six workers of one model, holding different prefixes of one prompt (one of them
    stale, one a second rank), recorded with no writer thread."""
    idx = PrefixIndex(clock=FakeClock())
    t = toks(0, 40, BS)
    for w, n in enumerate((40, 30, 20, 12, 3, 1)):
        rank = 1 if w == 5 else 0
        idx.apply_sequenced(f"e{w}", encode_batch([store(t, BS, 0, n)], dp_rank=rank), seq=0, dp_rank=rank)
    idx.mark_stale("e3", 0, "gap")
    rec = Recorder(str(tmp_path), tokens="hashed")
    rec.attach(idx)
    rec.journal.encode = False  # the records queued as tuples, for the encoder under test
    return idx, rec


def _queued(rec: Recorder) -> list[tuple]:
    rec.journal.seal()
    return [r for r in rec.journal.records if isinstance(r, tuple) and r[0] not in ("base", "flush")]


@pytest.mark.parametrize("mode", ["hashed", "none"])
def test_query_records_are_the_python_encoders(tmp_path, mode):
    idx, rec = _fleet(tmp_path)
    prompt = tokens_to_bytes(toks(0, 40, BS))
    other = tokens_to_bytes(toks(5000, 9, BS) + [7, 7])  # cached nowhere, not whole blocks
    link = {(f"e{w}", 1 if w == 5 else 0): (w != 2, True) for w in range(6)}
    for p in (prompt, other, prompt[: 4 * 13]):
        idx.match_plain(p, "default")
        idx.match(p)  # the library's door: a KeySource, predictions once routes are recorded
        keys = block_keys(p, BS, KEY_SEED, len(p) // (4 * BS))
        idx.match_by_keys(keys)
        idx.match_by_keys([k + (1 << 63) if k < (1 << 63) else k for k in keys[:3]] + [0, 5])  # misses, small keys
        idx.route_body(p, model="default", load={}, link=link)
        idx.route_body(p, model="default", load={"e1/0": Load(400, 3), "e2": Load(0, 90)},
                       candidates=["e1/0", "e2", "e9"], link=None, record=False)
        idx.route_body(p, model="default", load={"e0": Load(1 << 40, 1)}, candidates=("e0", "e4/0"),
                       prefill_load_scale=2, max_tokens=17)
        r = idx.route(p, max_tokens=8)  # dicts: Python's
        idx.route_done(r["request_id"])
        idx.route_done("nobody")
    idx.journal.note("replayed", "e1", 0, 12)
    idx.journal.note("restart", "é", 3, {"from": [1, 2.5, None, True]})
    idx.match(toks(0, 40, BS))  # token ids as a list
    items = _queued(rec)
    ops = {it[0] for it in items}
    assert {J.MATCH_PLAIN, J.MATCH, J.MATCH_BY_KEYS, J.ROUTE, J.ROUTE_DONE, "note"} <= ops
    assert any(it[0] == J.MATCH and it[3].predicted for it in items)  # an answer with predictions
    dicts = 0
    for it in items:
        assert _compiled(it, mode) == _reference(it, mode), it[0]
        dicts += it[0] == J.ROUTE and it[3][0].json is None  # a ranking of dicts (route()): RouteResponse's map
    assert dicts == 3


def test_answers_past_the_kept_size_keep_their_digest_only(tmp_path):
    idx = PrefixIndex(clock=FakeClock())
    t = toks(0, 8, BS)
    for w in range(150):  # an answer of 150 workers: ~12 KB
        idx.apply_sequenced(f"engine-{w:03d}", encode_batch([store(t, BS, 0, 1 + w % 8)]), seq=0)
    rec = Recorder(str(tmp_path), tokens="hashed")
    rec.attach(idx)
    rec.journal.encode = False
    idx.match_plain(tokens_to_bytes(t), "default")
    idx.route_body(tokens_to_bytes(t), model="default", load={}, link=None)
    items = _queued(rec)
    assert len(items) == 2
    for it in items:
        got = _compiled(it, "hashed")
        assert got == _reference(it, "hashed")
    body = msgspec.msgpack.decode(_compiled(items[0], "hashed"))
    assert body[4][0] is None and isinstance(body[4][1], int)  # too big to keep: the digest


def test_shapes_it_does_not_write_are_left_to_python(tmp_path):
    idx, rec = _fleet(tmp_path)
    prompt = toks(0, 40, BS)
    idx.route_body(prompt, model="default", lora_name="ad", load={}, link=None)  # a namespaced prompt
    idx.route_body(prompt, model="default", load={}, candidates={"e1/0"}, link=None)  # a set of candidates
    idx.journal.note("odd", "e0", 0, {1, 2})  # a set in a note
    with pytest.raises(KeyError):
        idx.match_plain(tokens_to_bytes(prompt), "no-such-model")
    idx.match(prompt, cache_salt="s")  # a namespaced prompt
    idx.match(prompt, extra_keys=[("img", 1)])
    items = _queued(rec)
    assert [it[0] for it in items] == [J.ROUTE, J.ROUTE, "note", J.MATCH_PLAIN, J.MATCH, J.MATCH]
    assert isinstance(items[3][3], Raised)
    for it in items:
        assert _compiled(it, "hashed") is None, it[0]


def test_generic_records(tmp_path):
    """Other calls' records: the arguments as a list, a scalar result kept (a subclass of
    one left to Python), a registration's result never."""
    for item in [
        (J.ROUTE_DONE, 5.5, ("rid-1",), True, (1.0, 2.0)),
        (J.COUNT, 5.5, ("e1", 0, "dropped", -3), 12, ()),
        (J.DROP_WORKER, 1.0, ("e1", 2), 0.25, (7.0,)),
        (J.EXPIRE, 1.0, (), "x" * 40, ()),
        (J.TIE_SLOT, 1.0, (0, 3), {"a": 1}, ()),  # not a scalar: kept as nil
        (J.REGISTER, 1.0, ("e1", "m", 16, [0, 1], b"\x00" * 300), 3, ()),
        (J.CLEAR_STALE, 1.0, ("e1", 1 << 63), None, ()),
    ]:
        assert _compiled(item, "hashed") == _reference(item, "hashed"), item
    for op, kind in R._KINDS.items():  # what the compiled encoder writes as a list is one for Python too
        if kind in (R._GENERIC, R._GENERIC_NONE):
            assert encode_call(op, ("a", 1), None, "hashed") == ["a", 1], op
            assert encode_result(op, 5) == (None if kind == R._GENERIC_NONE else 5), op
    assert _compiled((J.COUNT, 1.0, (), J.ROUTE, ()), "hashed") == _reference((J.COUNT, 1.0, (), J.ROUTE, ()), "hashed")
    assert _compiled((J.COUNT, 1.0, (frozenset(),), 1, ()), "hashed") is None
    for bad in ([-1], [1 << 64], [1.0]):  # keys array("Q") refuses: the Python encoder's error
        assert _compiled((J.MATCH_BY_KEYS, 1.0, (bad, "default"), None, ()), "hashed") is None
    assert _compiled((J.COUNT, 1.0, (-(1 << 63) - 1,), 1, ()), "hashed") is None


def test_the_writer_counts_what_it_writes_either_way(tmp_path):
    idx, rec = _fleet(tmp_path)
    prompt = tokens_to_bytes(toks(0, 40, BS))
    idx.match_plain(prompt, "default")
    r = idx.route_body(prompt, model="default", load={}, link=None)
    idx.route_done(r.request_id)
    items = _queued(rec)
    rec._compiled = True
    fast = [rec._encode(it) for it in items]
    counts = rec.records, rec.answers
    rec._compiled = False
    slow = [rec._encode(it) for it in items]
    assert fast == slow
    assert counts == (3, 2) and (rec.records, rec.answers) == (6, 4)


def _calls(idx: PrefixIndex) -> None:
    prompt = tokens_to_bytes(toks(0, 40, BS))
    link = {(f"e{w}", 1 if w == 5 else 0): (w != 2, True) for w in range(6)}
    idx.match_plain(prompt, "default")
    idx.match(toks(0, 40, BS))  # the library's door
    idx.match_plain(tokens_to_bytes(toks(5000, 9, BS)), "default")  # a miss
    r = idx.route_body(prompt, model="default", load={"e1/0": Load(400, 3)}, link=link, max_tokens=9)
    idx.route_done(r.request_id)
    # Long prompts, whose keys the walk hashes in chunks (64, then 512 blocks) as it goes
    # (the key memo, keys.c): one that misses after 40 blocks, one that misses at once.
    long = toks(0, 40, BS) + toks(7000, 600, BS)
    idx.match_plain(tokens_to_bytes(long), "default")
    idx.route_body(tokens_to_bytes(long), model="default", load={}, link=None)
    idx.route_body(tokens_to_bytes(toks(9000, 700, BS)), model="default", load={}, link=None)
    idx.route(toks(0, 40, BS), max_tokens=8)  # a ranking of dicts
    idx.route(toks(0, 40, BS), lora_name="ad")  # a namespaced prompt: left to the writer
    with pytest.raises(KeyError):
        idx.match_plain(prompt, "no-such-model")  # raised: left to the writer


@pytest.mark.parametrize("mode", ["hashed", "none"])
def test_queries_are_queued_encoded_as_the_writer_would(tmp_path, mode):
    """With the compiled encoder, a recording's match_plain, route and other records it
    writes are encoded, framed and laid in the journal's run on the calling thread
    (journal.c's ``encoded``):
    the same body the Python encoder makes of the tuple the writer would have had, but
    for the wall clock. What it leaves to Python is queued as a tuple; the writer counts
    both alike."""
    queues = []
    for encode in (True, False):
        idx, rec = _fleet(tmp_path / str(encode))
        rec.tokens = mode
        rec.journal.strip = mode == "hashed"
        rec.journal.encode = encode
        idx.inflight._prefix = "0d0d0d0d-"  # the request ids alike in both
        _calls(idx)
        rec.journal.seal()
        flat = []  # runs (the applies' and the queries' frames) opened up, in order
        apart = iter(list(rec.journal.apart))
        for r in rec.journal.records:
            if isinstance(r, tuple):
                flat += [r] if r[0] not in ("base", "flush") else []
            else:  # a record queued apart is in its place (None) in the run
                flat += [r.item(i) if r.item(i) is not None else next(apart) for i in range(len(r))]
        queues.append((rec, flat))
    (rec, fast), (_, slow) = queues
    assert [type(x).__name__ for x in fast] == ["bytes"] * 9 + ["tuple"] * 2  # route_done's too
    assert all(isinstance(x, tuple) for x in slow)

    def unwalled(body: bytes) -> list:
        rec_ = msgspec.msgpack.decode(body)
        rec_[1] = None
        return rec_

    for got, it in zip(fast, slow):
        if isinstance(got, bytes):
            assert frame(got[8:]) == got  # framed: its length and checksum, then the body
            assert unwalled(got[8:]) == unwalled(_reference(it, mode)), it[0]
    rec.flush()  # no writer thread: drained here
    assert (rec.records, rec.answers) == (11, 9)  # nine laid (eight answers), the LoRA route, the raised one
    for r, _ in queues:
        r.stop()


def test_values_read_in_place_are_the_python_encoders():
    """Ints of one digit and ASCII strings are read in place (recquery.c's small_long and
    w_leaf), the rest through Python's functions: every width and sign on both sides of
    each boundary, in a list, a tuple and a dict, writes what msgspec writes."""
    ints = [0, 1, -1, 31, -32, -33, 127, 128, 255, 256, (1 << 15) - 1, 1 << 15, (1 << 16), (1 << 30) - 1, 1 << 30,
            -(1 << 30) + 1, -(1 << 30), (1 << 31), -(1 << 31) - 1, (1 << 32), (1 << 62), (1 << 63) - 1, -(1 << 63),
            1 << 63, (1 << 64) - 1]
    strs = ["", "a", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "é", "engine-é", "\u4e16\u754c"]
    values = [ints, tuple(ints), {str(i): i for i in ints}, strs, {s: s for s in strs}, [1.5, -0.0, None, True, False]]
    for v in values:
        item = (J.COUNT, 1.0, ("e1", v), None, ())
        assert _compiled(item, "hashed") == _reference(item, "hashed"), v
    for past in (1 << 64, -(1 << 63) - 1):  # msgspec refuses them: left to Python
        assert _compiled((J.COUNT, 1.0, ("e1", [past]), None, ()), "hashed") is None


def test_tuples_an_answer_repeats_are_written_alike():
    """A small tuple holding a tuple that a record repeats (an answer's tier and group
    items, shared by the workers of a stop) is written again from its first bytes
    (recquery.c's memo): right wherever it recurs, also after the buffer grew between the
    two, and a tuple with the same contents at another address is encoded on its own."""
    shared = (("GPU", 5),)
    twin = (("GPU", 5),)
    group = (("0", shared, 5),)
    rows = [(float(i), -i, f"w{i}", i % 3, shared, group, 16 * i, (False, None, i, 0.5), 2.0) for i in range(3000)]
    rows.insert(7, (1.0, 2, "w", 0, twin, (("0", twin, 5),), 3, (True, "gap", None, None), 2.0))
    for v in (rows[:9], rows):
        item = (J.COUNT, 1.0, ("e1", [v, shared, [group, shared]]), None, ())
        assert _compiled(item, "hashed") == _reference(item, "hashed")
