"""The one-pass reader of plain GPU batches (``_core.scan_gpu_batch``, ``Store._on_scanned_store``)
against the typed decoder and the general store path it short-cuts (R-DEC-1, R-APP-1,
R-APP-2, R-APP-3, R-APP-4, R-BAD-3).

The reference is the general path itself, run on a second index with the scanner turned
off: after every batch of a generated stream, both indexes hold the same counters, sizes
and answers, whatever mix of plain stores, duplicates, orphans, groups, LoRA, CPU stores,
removals, unknown fields and malformed values the stream has.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import PrefixIndex
from indexer.store import apply as store_mod
from indexer.wire import decode as wire
from indexer._native import core

pytestmark = pytest.mark.skipif(core is None or wire.scan_gpu_batch is None, reason="needs the compiled core")

BS = 4
enc = msgspec.msgpack.encode


def stored(hashes, tokens, parent=None, **extra) -> dict:
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
          "kv_cache_spec_kind": "full_attention"}
    ev.update(extra)
    return ev


def batch(events, ts=1767225600.0, dp=0) -> bytes:
    return enc([ts, events, dp])


def test_scan_reads_what_the_decoder_reads():
    """R-DEC-1: hashes, parent, tokens, block size, group and kind as the typed decoder has them."""
    evs = [stored([1, 2**64 - 1], list(range(8)), parent=None),
           stored([7], [0, 1, 2**32 - 1, 5], parent=2**63, group_idx=None, kv_cache_spec_kind=None, medium=None),
           stored([9, 10, 11], list(range(12)), session_id="s", kv_cache_spec_sliding_window=128, lora_id=3)]
    payload = batch(evs, ts=5, dp=None)
    ts, dp, stores = core.scan_gpu_batch(payload)
    ref = wire.decode_batch(payload)
    assert (ts, dp) == (ref.ts, ref.dp_rank) and len(stores) == len(ref.events)
    for (hb, parent, tb, bs, group, kind, start, end), ev in zip(stores, ref.events):
        n = len(hb) // 8
        assert [int.from_bytes(hb[i * 8:i * 8 + 8], "little") for i in range(n)] == ev.block_hashes
        assert parent == ev.parent_block_hash and bs == ev.block_size
        assert group == ev.group_idx and kind == ev.kv_cache_spec_kind
        assert tb == wire.token_bytes(ev.token_ids)
        alone = wire.decode_event(payload[start:end])
        for f in ev.__struct_fields__:
            a, b = getattr(alone, f), getattr(ev, f)
            assert (bytes(a) if f == "token_ids" else a) == (bytes(b) if f == "token_ids" else b), f


@pytest.mark.parametrize("event", [
    stored([1], [1, 2, 3, 4], medium="CPU"),             # another tier
    stored([1], [1, 2, 3, 4], medium="gpu"),             # the tier name, spelled otherwise
    stored([1], [1, 2, 3, 4], lora_name="a"),            # a LoRA's key namespace
    stored([1], [1, 2, 3, 4], extra_keys=[["salt"]]),    # extra keys
    stored([1], [1, 2, 3, 4], locality="LOCAL"),
    stored([1], [1, 2, 3, 4], ownership="kvcr"),
    stored([1], [1, 2, 3, 4], lookahead_token_ids=[[1]]),
    stored([1], [1, 2, 3, 4], block_size=0),             # a placeholder
    stored([1], [1, 2, 3]),                              # tokens that do not fill the blocks
    stored([1], [1, 2, 3, 2**32]),                       # a token past uint32
    stored([-1], [1, 2, 3, 4]),                          # a negative hash
    stored([b"\x01" * 32], [1, 2, 3, 4]),                # a bytes digest
    stored([], []),                                      # no blocks
    stored([1], [1, 2, 3, 4], novel_field=1),            # a field the decoder does not know
    stored([1], [1, 2, 3, 4], lora_id="x"),              # a mistyped field
    {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
])
def test_scan_declines_every_other_shape(event):
    """Anything but a plain GPU store is left to the typed decoder (None), never guessed."""
    assert core.scan_gpu_batch(batch([event])) is None


@pytest.mark.parametrize("payload", [
    enc([float("nan"), [], 0]), enc([1.0, [], 0, "extra"]), enc([1.0]), enc({"ts": 1.0}),
    batch([stored([1], [1, 2, 3, 4])]) + b"\x00", batch([stored([1], [1, 2, 3, 4])])[:-3], b"", b"\xc1",
])
def test_scan_declines_malformed_batches(payload):
    assert core.scan_gpu_batch(payload) is None


# ---------------------------------------------------------------- differential

HASHES = st.integers(1, 40)  # few distinct hashes: duplicates, known parents and orphans happen often


@st.composite
def events(draw):
    n = draw(st.integers(1, 4))
    hashes = draw(st.lists(HASHES, min_size=n, max_size=n))
    tokens = [draw(st.integers(0, 6)) for _ in range(n * BS)]  # few token values: shared keys across hashes
    parent = draw(st.one_of(st.none(), HASHES))
    kind = draw(st.sampled_from(["plain"] * 6 + ["group", "cpu", "lora", "remove", "clear", "novel", "badtok",
                                                   "bs", "nokind"]))
    if kind == "remove":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    if kind == "clear":
        return {"type": "AllBlocksCleared"}
    extra: dict = {}
    if kind == "group":
        extra["group_idx"] = draw(st.integers(0, 2))
    elif kind == "cpu":
        extra["medium"] = "CPU"
    elif kind == "lora":
        extra["lora_name"] = "adapter"
    elif kind == "novel":
        extra["novel_field"] = 1
    elif kind == "badtok":
        tokens[0] = 2**32
    elif kind == "bs":
        extra["block_size"] = BS * 2
        tokens = tokens * 2
    elif kind == "nokind":
        extra["kv_cache_spec_kind"] = None
    return stored(hashes, tokens, parent=parent, **extra)


def _state(index: PrefixIndex, queries) -> tuple:
    st_ = index.stats()
    answers = []
    for q in queries:
        try:
            res = index.match(q, model="m")
        except KeyError:
            answers.append(None)
            continue
        answers.append([(w.engine, w.dp_rank, w.tiers, w.groups, w.total_blocks) for w in res.workers])
    return st_, answers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["e0", "e1"]), st.lists(events(), min_size=0, max_size=4)),
                min_size=1, max_size=12),
       st.lists(st.lists(st.integers(0, 6), min_size=BS, max_size=4 * BS), min_size=3, max_size=3))
def test_scanned_batches_leave_the_index_as_the_general_path_does(stream, queries):
    """R-APP-1..4: the same stream into an index reading plain GPU batches in one pass and
    into one that decodes every batch: the same counters, sizes and answers after each batch."""
    fast, slow = PrefixIndex(max_groups=2), PrefixIndex(max_groups=2)
    seqs = {"e0": 0, "e1": 0}
    saved = store_mod.scan_gpu_batch
    for engine, evs in stream:
        payload = batch(evs, ts=1767225600.0 + seqs[engine])
        seq = seqs[engine]
        seqs[engine] += 1
        assert fast.apply(engine, payload, model="m", seq=seq) == "applied"
        store_mod.scan_gpu_batch = None
        try:
            assert slow.apply(engine, payload, model="m", seq=seq) == "applied"
        finally:
            store_mod.scan_gpu_batch = saved
        assert _state(fast, queries) == _state(slow, queries)
