"""Contract §3 (R-DEC-1..4): decoding vLLM KV-event batches, and the producer mirror.

Golden payloads are read from ``tests/data/vllm-golden`` (see tests/golden.py).
"""

from __future__ import annotations

import msgspec
import pytest
from golden import GOLDEN, VERSIONS, as_events, entries, payload, unhex

from indexer import PrefixIndex
from indexer.producer.events import Cleared, Removed, Stored, encode_batch
from indexer.wire.decode import CLEARED, REMOVED, STORED, DecodeError, decode_batch, decode_tokens

U64_MAX = 2**64 - 1

# vLLM field order (reference §1.3 / §1.4); the positional layout stops after the window.
STORED_FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
]
STORED_MAP_ONLY = ["locality", "ownership", "session_id", "lookahead_token_ids"]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx"]
REMOVED_MAP_ONLY = ["locality", "ownership"]
KIND = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": CLEARED}

CASES = [(vdir, e["file"][: -len(".msgpack")]) for vdir in VERSIONS for e in entries(vdir)]
CASE_IDS = [f"{v}-{n}" for v, n in CASES]


def _entry(vdir: str, name: str) -> dict:
    for e in entries(vdir):
        if e["file"] == f"{name}.msgpack":
            return e
    raise KeyError(name)


def _expected_events(decoded_events: list) -> list[tuple[str, dict]]:
    """index.json events (either layout) as (tag, {field: value}) with bytes restored."""
    out = []
    for e in unhex(decoded_events):
        if isinstance(e, list):
            tag, vals = e[0], e[1:]
            names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, [])
            assert len(vals) <= len(names), "golden array event longer than the known fields"
            out.append((tag, dict(zip(names, vals))))
        else:
            e = dict(e)
            out.append((e.pop("type"), e))
    return out


def _tokens(n0: int, n: int) -> list[int]:
    return list(range(n0, n0 + n))


# ---------------------------------------------------------------------------- golden


def test_golden_cases_cover_every_version_and_scenario():
    assert GOLDEN.is_dir()
    assert {v for v, _ in CASES} == set(VERSIONS)
    for vdir in VERSIONS:
        names = {n for v, n in CASES if v == vdir}
        assert {"gpu_chain_1", "bytes_hashes", "dp_rank_1", "lora_and_salt", "removals_and_clear"} <= names
    assert ("v0.33.0", "locality_ownership") in CASES


@pytest.mark.parametrize("vdir,name", CASES, ids=CASE_IDS)
def test_R_DEC_1_golden_payload_decodes_to_index_json(vdir, name):
    raw = payload(vdir, name)
    ts, events, dp = _entry(vdir, name)["decoded"]
    batch = decode_batch(raw)

    assert batch.layout == ("array" if VERSIONS[vdir] == "0.23" else "map")
    assert batch.ts == ts
    assert batch.dp_rank == dp
    assert batch.issues == {}
    expected = _expected_events(events)
    assert len(batch.events) == len(expected)
    array_layout = batch.layout == "array"
    for ev, (tag, exp) in zip(batch.events, expected):
        assert ev.kind == KIND[tag], (tag, ev)
        if tag == "BlockStored":
            fields = STORED_FIELDS if array_layout else STORED_FIELDS + STORED_MAP_ONLY
        elif tag == "BlockRemoved":
            fields = REMOVED_FIELDS if array_layout else REMOVED_FIELDS + REMOVED_MAP_ONLY
        else:
            fields = []
        for f in fields:
            got = getattr(ev, f)
            if f == "token_ids":
                got = decode_tokens(got)
            assert got == exp.get(f), (f, got, exp.get(f))
        # Both layouts expose locality/ownership (None in the positional layout).
        if tag != "AllBlocksCleared":
            assert ev.locality == exp.get("locality")
            assert ev.ownership == exp.get("ownership")


@pytest.mark.parametrize("vdir", list(VERSIONS))
def test_R_DEC_2_golden_hashes_keep_full_uint64_and_bytes(vdir):
    # uint64 hashes above 2**63 (would be negative as int64) come back unchanged.
    b = decode_batch(payload(vdir, "removals_and_clear"))
    hashes = [h for ev in b.events if ev.kind == REMOVED for h in ev.block_hashes]
    assert max(hashes) > 2**63
    assert 17491412362975673814 in hashes
    assert all(isinstance(h, int) and 0 <= h <= U64_MAX for h in hashes)
    # bytes hashes stay 32-byte bytes.
    b = decode_batch(payload(vdir, "bytes_hashes"))
    (ev,) = b.events
    assert [type(h) for h in ev.block_hashes] == [bytes, bytes]
    assert ev.block_hashes[0] == bytes.fromhex("66f9ec1bd3a869568a7b2d8bbee51b4e89ceb80dc323f99d7e7e86993ab04e45")
    assert all(len(h) == 32 for h in ev.block_hashes)


def test_R_DEC_1_locality_ownership_session_decoded_0_33():
    b = decode_batch(payload("v0.33.0", "locality_ownership"))
    assert b.layout == "map"
    stored = [ev for ev in b.events if ev.kind == STORED]
    assert [ev.locality for ev in stored][:2] == ["REMOTE", "LOCAL"]
    assert stored[1].ownership == "kvcr"
    assert stored[1].session_id == "sess-1"
    assert any(ev.medium == "STORAGE" for ev in stored)


@pytest.mark.parametrize("vdir", list(VERSIONS))
def test_R_DEC_1_golden_hybrid_and_lora_fields(vdir):
    b = decode_batch(payload(vdir, "hybrid_groups"))
    groups = [(ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) for ev in b.events]
    assert (0, "full_attention", None) in groups
    assert (1, "sliding_window", 32) in groups
    assert any(g == 2 for g, _, _ in groups)
    b = decode_batch(payload(vdir, "lora_and_salt"))
    gpu, cpu = b.events
    assert (gpu.medium, gpu.lora_name, gpu.lora_id) == ("GPU", "adapter-a", 1)
    assert gpu.extra_keys == [["adapter-a", "tenant-a"], ["adapter-a"], ["adapter-a"]]
    assert (cpu.medium, cpu.lora_name, cpu.extra_keys) == ("CPU", "adapter-a", None)
    assert decode_tokens(cpu.token_ids) == _tokens(20000, 48)


# ------------------------------------------------------------------ producer mirror


@pytest.mark.parametrize("vdir,name", CASES, ids=CASE_IDS)
def test_encode_batch_reproduces_golden_bytes(vdir, name):
    ts, events, dp = _entry(vdir, name)["decoded"]
    got = encode_batch(as_events(unhex(events)), ts=ts, dp_rank=dp, version=VERSIONS[vdir])
    assert got == payload(vdir, name)


def test_encode_batch_reference_hex_vector():
    # vllm-kv-events.md §1.8: a byte-exact tiny 0.33 batch.
    want = bytes.fromhex(
        "93cb3ff00000000000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107"
        "a66d656469756da3435055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
    )
    got = encode_batch([Removed(block_hashes=[7], medium="CPU", group_idx=0), Cleared()], ts=1.0, dp_rank=0)
    assert got == want
    b = decode_batch(want)
    assert b.layout == "map" and b.dp_rank == 0 and b.ts == 1.0
    assert [ev.kind for ev in b.events] == [REMOVED, CLEARED]
    assert (b.events[0].block_hashes, b.events[0].medium, b.events[0].group_idx) == ([7], "CPU", 0)


def test_encode_batch_reference_array_form_0_23():
    # vllm-kv-events.md §1.8: the <=0.23 array form of a store.
    want = [1.5, [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0, None, None],
                  ["BlockRemoved", [1], "GPU", None], ["AllBlocksCleared"]], 0]
    got = encode_batch(
        [Stored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2, medium="GPU", group_idx=0),
         Removed(block_hashes=[1], medium="GPU", group_idx=None), Cleared()],
        ts=1.5, dp_rank=0, version="0.23",
    )
    assert got == msgspec.msgpack.encode(want)
    assert msgspec.msgpack.decode(got) == want


# ---------------------------------------------------------------- vLLM-shaped builders


def map_stored(hashes, tokens, *, parent=None, bs=16, medium="GPU", **more) -> dict:
    d = {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": bs, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    d.update(more)
    return d


def arr_stored(hashes, tokens, *, parent=None, bs=16, medium="GPU", extra=()) -> list:
    return ["BlockStored", hashes, parent, tokens, bs, None, medium, None, None, 0, "full_attention", None,
            *extra]


def map_removed(hashes, medium="GPU", **more) -> dict:
    d = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}
    d.update(more)
    return d


def arr_removed(hashes, medium="GPU", extra=()) -> list:
    return ["BlockRemoved", hashes, medium, 0, *extra]


def batch(events, ts=1767225600.0, dp=0) -> bytes:
    return msgspec.msgpack.encode([ts, events, dp])


A_TOK = _tokens(7000, 32)  # two blocks
B_TOK = _tokens(8000, 32)


def _events_with(layout: str, case: str) -> list:
    """Stores A (hashes 11, 12) and B (21, 22) plus the anomaly ``case``."""
    if layout == "map":
        a = map_stored([11, 12], A_TOK)
        b = map_stored([21, 22], B_TOK)
        if case in ("unknown_field", "both"):
            a["future_field"] = {"x": 1}
        unknown = {"type": "BlockSnapshot", "block_hashes": [99], "medium": "GPU"}
    else:
        a = arr_stored([11, 12], A_TOK, extra=("future-1", 2) if case in ("unknown_field", "both") else ())
        b = arr_stored([21, 22], B_TOK)
        unknown = ["BlockSnapshot", [99], "GPU"]
    evs = [a]
    if case in ("unknown_event_type", "both"):
        evs.append(unknown)
    evs.append(b)
    return evs


# ------------------------------------------------------------------------ R-DEC-1


def test_R_DEC_1_map_unknown_field_ignored_and_counted():
    p = batch([map_stored([11, 12], A_TOK, future_field=1, another=[1, 2]), map_removed([5], zzz=None)])
    b = decode_batch(p)
    assert b.layout == "map"
    assert b.issues.get("unknown_field") == 3
    st, rm = b.events
    assert st.kind == STORED and st.block_hashes == [11, 12] and decode_tokens(st.token_ids) == A_TOK
    assert st.block_size == 16 and st.medium == "GPU"
    assert rm.kind == REMOVED and rm.block_hashes == [5]


def test_R_DEC_1_map_fields_looked_up_by_name_not_order():
    ev = map_stored([11, 12], A_TOK)
    shuffled = dict(reversed(list(ev.items())))
    b = decode_batch(batch([shuffled]))
    (st,) = b.events
    assert st.block_hashes == [11, 12] and st.block_size == 16 and st.medium == "GPU"
    assert decode_tokens(st.token_ids) == A_TOK


def test_R_DEC_1_array_extra_trailing_elements_ignored_and_counted():
    # A positional event longer than the fields we know: the extra elements are
    # ignored (the event still decodes) and counted as unknown fields.
    p = batch([arr_stored([11, 12], A_TOK, extra=("future-1", 2)), arr_removed([5], extra=("x",))])
    b = decode_batch(p)
    assert b.layout == "array"
    st, rm = b.events
    assert st.kind == STORED and st.block_hashes == [11, 12] and decode_tokens(st.token_ids) == A_TOK
    assert rm.kind == REMOVED and rm.block_hashes == [5]
    assert b.issues.get("unknown_field") == 3


@pytest.mark.parametrize("layout", ["map", "array"])
def test_R_DEC_1_unknown_event_type_skipped_and_counted(layout):
    b = decode_batch(batch(_events_with(layout, "unknown_event_type")))
    assert b.layout == layout
    assert b.issues == {"unknown_event_type": 1}
    assert [ev.kind for ev in b.events] == [STORED, STORED]
    assert [ev.block_hashes for ev in b.events] == [[11, 12], [21, 22]]
    assert [decode_tokens(ev.token_ids) for ev in b.events] == [A_TOK, B_TOK]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_R_DEC_1_unknown_field_and_type_in_one_batch(layout):
    b = decode_batch(batch(_events_with(layout, "both")))
    assert b.issues.get("unknown_event_type") == 1
    assert b.issues.get("unknown_field") == (1 if layout == "map" else 2)
    assert [ev.block_hashes for ev in b.events] == [[11, 12], [21, 22]]


@pytest.mark.parametrize("case", ["unknown_field", "unknown_event_type", "both"])
@pytest.mark.parametrize("layout", ["map", "array"])
def test_R_DEC_1_index_counts_unknowns_and_applies_known_events(layout, case):
    idx = PrefixIndex()
    assert idx.apply("e", batch(_events_with(layout, case))) == "applied"
    unknown = idx.stats()["events"].get("unknown", {})
    n_fields = {"map": 1, "array": 2}[layout] if case in ("unknown_field", "both") else 0
    n_types = 1 if case in ("unknown_event_type", "both") else 0
    assert unknown.get("unknown_field", 0) == n_fields
    assert unknown.get("unknown_event_type", 0) == n_types
    assert idx.stats()["events"]["BlockStored"] == {"applied": 2}
    for toks in (A_TOK, B_TOK):
        w = idx.match(toks).worker("e", 0)
        assert w is not None and w.tiers.get("GPU") == 2 and w.total_blocks == 2


# ------------------------------------------------------------------------ R-DEC-2


@pytest.mark.parametrize("version", ["0.23", "0.24", "0.33"])
def test_R_DEC_2_uint64_max_hashes_end_to_end(version):
    h1, h2, h3 = U64_MAX, U64_MAX - 1, 2**63  # 2**63 is out of int64 range too
    toks = _tokens(100, 48)
    p1 = encode_batch([Stored(block_hashes=[h1, h2], token_ids=toks[:32], block_size=16)], version=version)
    p2 = encode_batch([Stored(block_hashes=[h3], parent_block_hash=h2, token_ids=toks[32:], block_size=16)],
                      version=version)
    assert decode_batch(p1).events[0].block_hashes == [h1, h2]
    assert decode_batch(p2).events[0].parent_block_hash == h2
    idx = PrefixIndex()
    assert idx.apply("e", p1) == "applied"
    assert idx.apply("e", p2) == "applied"
    assert idx.stats()["events"]["BlockStored"] == {"applied": 2}
    assert idx.stats()["orphans"] == 0
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 3
    assert idx.apply("e", encode_batch([Removed(block_hashes=[h3])], version=version)) == "applied"
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 2
    assert idx.apply("e", encode_batch([Removed(block_hashes=[h2]), Removed(block_hashes=[h1])],
                                       version=version)) == "applied"
    assert idx.stats()["events"]["BlockRemoved"] == {"applied": 3}
    assert idx.match(toks).worker("e", 0) is None
    assert idx.stats()["nodes"] == 0


@pytest.mark.parametrize("vdir", list(VERSIONS))
def test_R_DEC_2_bytes_hashes_end_to_end_and_chain(vdir):
    ev = _expected_events(_entry(vdir, "bytes_hashes")["decoded"][1])[0][1]
    d1, d2 = ev["block_hashes"]
    toks = _tokens(40000, 48)
    idx = PrefixIndex()
    assert idx.apply("e", payload(vdir, "bytes_hashes")) == "applied"
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 2
    d3 = bytes(range(32))
    child = encode_batch(
        [Stored(block_hashes=[d3], parent_block_hash=d2, token_ids=toks[32:], block_size=16)],
        version=VERSIONS[vdir],
    )
    assert decode_batch(child).events[0].parent_block_hash == d2
    assert idx.apply("e", child) == "applied"
    assert idx.stats()["orphans"] == 0
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 3
    # The chained block's key is position-dependent: the child alone does not match at the root.
    assert idx.match(toks[32:]).worker("e", 0) is None
    assert idx.apply("e", encode_batch([Removed(block_hashes=[d3])], version=VERSIONS[vdir])) == "applied"
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 2
    assert idx.apply("e", encode_batch([Removed(block_hashes=[d2, d1])], version=VERSIONS[vdir])) == "applied"
    assert idx.stats()["events"]["BlockRemoved"] == {"applied": 2}
    assert idx.match(toks).worker("e", 0) is None
    assert idx.stats()["nodes"] == 0


def test_R_DEC_2_mixed_int_and_bytes_hashes_in_one_batch():
    toks = _tokens(500, 32)
    p = batch([map_stored([b"\x01" * 32], toks[:16]), map_stored([U64_MAX], toks[16:], parent=b"\x01" * 32)])
    b = decode_batch(p)
    assert [ev.block_hashes for ev in b.events] == [[b"\x01" * 32], [U64_MAX]]
    idx = PrefixIndex()
    assert idx.apply("e", p) == "applied"
    assert idx.match(toks).worker("e", 0).tiers["GPU"] == 2


# ------------------------------------------------------------------------ R-DEC-3

BAD_PAYLOADS = {
    "garbage": b"\xc1\xc1 this is not msgpack \x00\xff",
    "map_instead_of_batch": msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": 0}),
    "truncated": payload("v0.33.0", "gpu_chain_1")[:-7],
    "truncated_array": payload("v0.23.0", "gpu_chain_1")[:40],
    "empty": b"",
    "batch_too_short": msgspec.msgpack.encode([1.0]),
    "ts_not_a_number": msgspec.msgpack.encode(["yesterday", [], 0]),
    "events_not_a_list": msgspec.msgpack.encode([1.0, {"type": "AllBlocksCleared"}, 0]),
}


def test_R_DEC_3_bad_payloads_raise_decode_error():
    for name, p in BAD_PAYLOADS.items():
        with pytest.raises(DecodeError) as ei:
            decode_batch(p)
        assert isinstance(ei.value.reason, str) and ei.value.reason, name


def _snapshot(idx: PrefixIndex, toks):
    d = idx.match(toks).to_dict()
    for w in d["workers"]:
        w.pop("last_event_age_s")
    return d


@pytest.mark.parametrize("apply_rank", [None, 0])
@pytest.mark.parametrize("name", list(BAD_PAYLOADS))
def test_R_DEC_3_bad_payload_dropped_counted_index_unchanged(name, apply_rank):
    idx = PrefixIndex(clock=lambda: 1000.0)
    toks = _tokens(1000, 48)
    assert idx.apply("e", payload("v0.33.0", "gpu_chain_1"), dp_rank=apply_rank) == "applied"
    before = _snapshot(idx, toks)
    assert before["workers"][0]["tiers"]["GPU"] == 3
    nodes = idx.stats()["nodes"]
    dropped_before = sum(idx.stats()["dropped_payloads"].values())
    (w,) = idx.workers()
    wdropped_before = sum(w["dropped"].values())
    batches_before = w["batches"]

    assert idx.apply("e", BAD_PAYLOADS[name], dp_rank=apply_rank) == "dropped"

    st = idx.stats()
    assert sum(st["dropped_payloads"].values()) == dropped_before + 1
    assert all(isinstance(k, str) and k for k in st["dropped_payloads"])
    (w,) = idx.workers()
    assert (w["engine"], w["dp_rank"]) == ("e", 0)
    assert sum(w["dropped"].values()) == wdropped_before + 1
    assert w["batches"] == batches_before
    assert st["nodes"] == nodes
    assert _snapshot(idx, toks) == before
    # The index keeps working after the bad message.
    assert idx.apply("e", payload("v0.33.0", "gpu_chain_2"), dp_rank=apply_rank) == "applied"
    assert idx.match(_tokens(1000, 80)).worker("e", 0).tiers["GPU"] == 5


def test_R_DEC_3_bad_payload_for_unknown_worker_counted_without_creating_it():
    idx = PrefixIndex()
    assert idx.apply("ghost", b"", dp_rank=0) == "dropped"
    assert sum(idx.stats()["dropped_payloads"].values()) == 1
    assert idx.stats()["nodes"] == 0


@pytest.mark.parametrize("layout", ["map", "array"])
def test_R_DEC_3_malformed_event_skipped_rest_applied(layout):
    if layout == "map":
        bad = map_stored("not-a-list", _tokens(9000, 16))
        evs = [map_stored([11, 12], A_TOK), bad, map_stored([21, 22], B_TOK)]
    else:
        bad = arr_stored("not-a-list", _tokens(9000, 16))
        evs = [arr_stored([11, 12], A_TOK), bad, arr_stored([21, 22], B_TOK)]
    p = batch(evs)
    b = decode_batch(p)
    assert b.issues == {"malformed_event": 1}
    assert [ev.block_hashes for ev in b.events] == [[11, 12], [21, 22]]

    idx = PrefixIndex()
    assert idx.apply("e", p) == "applied"
    st = idx.stats()
    assert st["events"]["unknown"].get("malformed_event") == 1
    assert st["events"]["BlockStored"] == {"applied": 2}
    assert idx.match(A_TOK).worker("e", 0).tiers["GPU"] == 2
    assert idx.match(B_TOK).worker("e", 0).tiers["GPU"] == 2
    assert idx.match(_tokens(9000, 16)).worker("e", 0) is None


def test_R_DEC_3_malformed_event_shapes_each_counted():
    evs = [
        map_stored([11, 12], A_TOK),
        map_stored([1], _tokens(0, 16), block_size="sixteen"),   # wrong field type
        {"type": "BlockRemoved", "medium": "GPU"},                # required field missing
        42,                                                        # not an event at all
        [],                                                        # empty positional event
    ]
    b = decode_batch(batch(evs))
    assert b.issues.get("malformed_event") == 4
    assert [ev.block_hashes for ev in b.events] == [[11, 12]]


# ------------------------------------------------------------------------ R-DEC-4


@pytest.mark.parametrize("apply_rank", [None, 0])
@pytest.mark.parametrize("vdir", list(VERSIONS))
def test_R_DEC_4_batch_rank_wins(vdir, apply_rank):
    idx = PrefixIndex()
    assert idx.apply("e", payload(vdir, "dp_rank_1"), dp_rank=apply_rank) == "applied"
    assert [(w["engine"], w["dp_rank"]) for w in idx.workers()] == [("e", 1)]
    r = idx.match(_tokens(40000, 32))
    assert r.worker("e", 0) is None
    assert r.worker("e", 1).tiers["GPU"] == 2
    assert (r.best.engine, r.best.dp_rank) == ("e", 1)


@pytest.mark.parametrize("apply_rank,want", [(None, 0), (0, 0), (3, 3)])
@pytest.mark.parametrize("version", ["0.23", "0.24", "0.33"])
def test_R_DEC_4_batch_without_rank_uses_subscription_rank(version, apply_rank, want):
    toks = _tokens(600, 32)
    p = encode_batch([Stored(block_hashes=[1, 2], token_ids=toks, block_size=16)], dp_rank=None, version=version)
    assert decode_batch(p).dp_rank is None
    idx = PrefixIndex()
    assert idx.apply("e", p, dp_rank=apply_rank) == "applied"
    assert [(w["engine"], w["dp_rank"]) for w in idx.workers()] == [("e", want)]
    assert idx.match(toks).worker("e", want).tiers["GPU"] == 2


def test_R_DEC_4_two_element_batch_uses_subscription_rank():
    # [ts, events] without the rank element: the rank the subscription was opened for.
    toks = _tokens(600, 32)
    p = msgspec.msgpack.encode([1.0, [map_stored([1, 2], toks)]])
    assert decode_batch(p).dp_rank is None
    idx = PrefixIndex()
    assert idx.apply("e", p, dp_rank=2) == "applied"
    assert idx.match(toks).worker("e", 2).tiers["GPU"] == 2
