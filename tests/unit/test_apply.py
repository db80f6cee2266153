"""Contract section 4 (R-APP-1 .. R-APP-11) plus the sequence rules R-STR-1 / R-STR-5.

Every payload is built with :func:`indexer.producer.events.encode_batch` (the bytes vLLM
publishes) or read from the golden vLLM payloads (``tests/golden.py``). The
important cases run over both wire layouts: "0.33" (maps) and "0.23" (arrays).

Engine hashes are simulated as vLLM chains them: one 64-bit value per token
prefix (xxh64 of the repr of the namespace and the prefix), so a block's hash
depends on every token before it, like vLLM's ``hash(parent, tokens, extra)``.

The OffloadingConnector scenarios of vLLM's own ``test_events.py`` (reference
§3.5) are the tests whose docstring names the vLLM test they mirror.
"""

from __future__ import annotations

import random

import pytest

import golden
from indexer import PrefixIndex
from indexer.producer.events import Cleared, Stored, encode_batch

from evkit import (
    ENGINE, FA, GOLDEN_DIRS, WIRE, FakeClock, apply, chunks, counter, ehashes, ev, golden_events,
    gpu_evictions, placeholder, removed, store, tiers, toks, total, winfo, wm,
)


# ------------------------------------------------------------------ R-APP-1


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_store_creates_one_node_per_block(ver):
    idx = PrefixIndex()
    t = toks(100, 4, 16)
    assert apply(idx, [store(t, 16, 0, 4)], ver) == "applied"
    s = idx.stats()
    assert s["nodes"] == 4
    assert s["resident_entries"] == 4
    assert ev(idx, "BlockStored", "applied") == 1
    w = wm(idx, t)
    assert w.tiers == {"GPU": 4}
    assert w.total_blocks == 4 and w.total_tokens == 64
    assert winfo(idx)["resident_blocks"] == {"GPU": 4}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_store_in_two_steps_continues_the_chain(ver):
    idx = PrefixIndex()
    t = toks(100, 5, 16)
    apply(idx, [store(t, 16, 0, 3)], ver)
    apply(idx, [store(t, 16, 3, 5)], ver)
    assert idx.stats()["nodes"] == 5
    assert tiers(idx, t) == {"GPU": 5}
    assert idx.stats()["orphans"] == 0


@pytest.mark.parametrize("vdir", GOLDEN_DIRS)
def test_R_APP_1_golden_gpu_chain(vdir):
    idx = PrefixIndex()
    assert idx.apply(ENGINE, golden.payload(vdir, "gpu_chain_1")) == "applied"
    assert idx.apply(ENGINE, golden.payload(vdir, "gpu_chain_2")) == "applied"
    assert idx.stats()["nodes"] == 5
    t = list(range(1000, 1080))
    w = wm(idx, t)
    assert w.tiers == {"GPU": 5} and w.total_blocks == 5 and w.total_tokens == 80
    # Only the first step's blocks: 3.
    assert tiers(idx, list(range(1000, 1048))) == {"GPU": 3}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_chunked_cpu_store_covers_every_block(ver):
    idx = PrefixIndex()
    t = toks(7, 3, 4)
    assert apply(idx, [store(t, 4, 0, 3, medium="CPU")], ver) == "applied"
    assert idx.stats()["nodes"] == 3
    assert tiers(idx, t) == {"CPU": 3}
    assert winfo(idx)["resident_blocks"] == {"CPU": 3}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_shape_mismatch_ignored_and_counted(ver):
    idx = PrefixIndex()
    t = toks(7, 4, 4)
    hs = ehashes(t, 4)
    too_many_tokens = Stored(block_hashes=hs[:2], token_ids=t[:12], block_size=4, kv_cache_spec_kind=FA)
    too_few_tokens = Stored(block_hashes=hs[:3], token_ids=t[:8], block_size=4, kv_cache_spec_kind=FA)
    apply(idx, [too_many_tokens, too_few_tokens], ver)
    assert ev(idx, "BlockStored", "shape_mismatch") == 2
    assert idx.stats()["nodes"] == 0
    assert idx.match(t).workers == []


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_parent_none_means_sequence_starts_at_token_zero(ver):
    idx = PrefixIndex()
    t = toks(0, 2, 4)
    hs = ehashes(t, 4)
    # Block 1's tokens announced with parent None: they are the start of a sequence.
    apply(idx, [Stored(block_hashes=[hs[1]], parent_block_hash=None, token_ids=t[4:8], block_size=4)], ver)
    assert tiers(idx, t[4:8]) == {"GPU": 1}
    assert tiers(idx, t) == {}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_tier_names_from_medium(ver):
    idx = PrefixIndex()
    t = toks(0, 2, 4)
    apply(idx, [store(t, 4, 0, 2, medium=None), store(t, 4, 0, 2, medium="cpu"),
                store(t, 4, 0, 2, medium="nvme")], ver)
    assert tiers(idx, t) == {"GPU": 2, "CPU": 2, "NVME": 2}
    assert idx.stats()["nodes"] == 2


def test_R_APP_1_ownership_kvcr_tier_name():
    """vLLM ``…kvcr…`` events: ownership "kvcr" makes the tier "CPU:kvcr" (0.33 map layout)."""
    idx = PrefixIndex()
    t = toks(0, 2, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 2, medium="CPU", ownership="kvcr", locality="LOCAL")])
    assert "CPU:kvcr" in idx.stats()["tiers"]
    assert winfo(idx)["resident_blocks"] == {"CPU:kvcr": 2}
    assert tiers(idx, t) == {"CPU:kvcr": 2}
    # A plain CPU removal does not touch the kvcr-owned copy...
    apply(idx, [removed(hs, medium="CPU")])
    assert ev(idx, "BlockRemoved", "unknown_hash") == 1
    assert tiers(idx, t) == {"CPU:kvcr": 2}
    # ...the kvcr removal does.
    apply(idx, [removed(hs, medium="CPU", ownership="kvcr")])
    assert ev(idx, "BlockRemoved", "applied") == 1
    assert idx.stats()["nodes"] == 0


# ------------------------------------------- vLLM test_events.py scenarios (§3.5)


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_1_offload_by_block_chain_across_batches(ver):
    """vLLM test_take_events_publishes_routable_block_stored: 6 keys in two batches."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    hs = ehashes(t, 4)
    evs = chunks(t, 4, 1)  # by-block mode: 1 hash, 4 tokens, block_size 4 each
    assert [e.parent_block_hash for e in evs] == [None] + hs[:5]
    apply(idx, evs[:3], ver, seq=0)
    apply(idx, evs[3:], ver, seq=1)  # first parent = batch 1's last hash
    s = idx.stats()
    assert s["nodes"] == 6 and s["orphans"] == 0
    assert ev(idx, "BlockStored", "applied") == 6
    w = wm(idx, t)
    assert w.tiers == {"CPU": 6} and w.total_blocks == 6 and w.score == pytest.approx(4.5)
    # By-block: every block is retrievable on its own.
    assert tiers(idx, t[:20]) == {"CPU": 5}


@pytest.mark.parametrize("gpu_holds", [False, True])
@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_5_offload_chunk_store_and_remove(ver, gpu_holds):
    """vLLM test_take_events_factor_gt_1_chunk_store_and_remove: factor 3, 2 chunks."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    hs = ehashes(t, 4)
    if gpu_holds:
        apply(idx, [store(t, 4, 0, 6)], ver)
    evs = chunks(t, 4, 3)
    assert [len(e.token_ids) for e in evs] == [12, 12]
    assert evs[1].parent_block_hash == hs[2]  # previous chunk's tail
    apply(idx, evs, ver)
    assert idx.stats()["nodes"] == 6
    assert tiers(idx, t) == ({"GPU": 6, "CPU": 6} if gpu_holds else {"CPU": 6})
    apply(idx, [removed(hs, medium="CPU")], ver)  # one removal, all 6 hashes
    assert ev(idx, "BlockRemoved", "applied") == 1
    if gpu_holds:
        assert tiers(idx, t) == {"GPU": 6}
        assert idx.stats()["nodes"] == 6
        assert winfo(idx)["resident_blocks"] == {"GPU": 6}
    else:
        assert wm(idx, t) is None
        assert idx.stats()["nodes"] == 0
        assert idx.stats()["resident_entries"] == 0


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_offload_store_is_order_independent(ver):
    """vLLM …factor_gt_1_store_is_order_independent: keys [chunk1, unknown, chunk0]."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    c0, c1 = chunks(t, 4, 3)
    unknown = placeholder([0xDEADBEEF])
    apply(idx, [c1, unknown, c0], ver)
    s = idx.stats()
    assert s["orphans"] == 0
    assert s["nodes"] == 6
    assert ev(idx, "BlockStored", "orphaned") == 1
    assert ev(idx, "BlockStored", "placeholder_ignored") == 1
    assert counter(idx, "orphans_adopted") == 1
    assert tiers(idx, t) == {"CPU": 6}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_6_offload_opt_out_placeholders_create_nothing(ver):
    """vLLM test_take_events_opt_out_keeps_placeholders: 3 tail-hash placeholders, 1 removal."""
    idx = PrefixIndex()
    t = toks(1, 9, 4)
    hs = ehashes(t, 4)
    tails = [hs[2], hs[5], hs[8]]
    apply(idx, [placeholder([h]) for h in tails], ver)
    assert ev(idx, "BlockStored", "placeholder_ignored") == 3
    assert idx.stats()["nodes"] == 0 and idx.stats()["orphans"] == 0
    apply(idx, [removed(tails, medium="CPU")], ver)
    assert ev(idx, "BlockRemoved", "unknown_hash") == 1
    s = idx.stats()
    assert s["nodes"] == 0 and s["resident_entries"] == 0
    assert idx.match(t).workers == []


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_6_offload_opt_out_placeholders_attach_to_gpu_known_nodes(ver):
    idx = PrefixIndex()
    t = toks(1, 9, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 9)], ver)
    tails = [hs[2], hs[5], hs[8]]
    apply(idx, [placeholder([h]) for h in tails], ver)
    assert ev(idx, "BlockStored", "placeholder_attached") == 3
    assert idx.stats()["nodes"] == 9
    assert winfo(idx)["resident_blocks"] == {"GPU": 9, "CPU": 3}
    w = wm(idx, t)
    assert w.tiers["GPU"] == 9 and w.total_blocks == 9
    apply(idx, [removed(tails, medium="CPU")], ver)
    assert ev(idx, "BlockRemoved", "applied") == 1
    assert winfo(idx)["resident_blocks"] == {"GPU": 9}
    assert idx.stats()["nodes"] == 9
    assert tiers(idx, t) == {"GPU": 9}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_6_by_block_placeholders_give_cpu_residency_on_known_nodes(ver):
    idx = PrefixIndex()
    t = toks(1, 3, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 3)], ver)
    apply(idx, [placeholder([h]) for h in hs], ver)  # by-block mode: a chunk of one block
    apply(idx, gpu_evictions(reversed(hs)), ver)
    assert idx.stats()["nodes"] == 3
    w = wm(idx, t)
    assert w.tiers == {"CPU": 3} and w.total_blocks == 3


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_10_offload_sliding_window_group_not_in_headline(ver):
    """vLLM test_record_store_skips_sliding_window_group (+ a well-formed SWA store)."""
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 2)], ver)  # group 0 full attention: 2 blocks
    # SWA GPU store skipping null blocks: 2 hashes over 4 blocks of tokens.
    swa_skip = Stored(block_hashes=hs[2:4], parent_block_hash=hs[1], token_ids=t, block_size=4,
                      group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8)
    # The connector's SWA placeholder.
    swa_ph = placeholder([hs[3]], group=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8)
    apply(idx, [swa_skip, swa_ph], ver)
    # R-APP-12: its blocks are placed by their full-attention twins, which this worker
    # does not hold (group 0 stored 2 blocks): nothing placed, no tree made.
    assert ev(idx, "BlockStored", "window_unplaced") == 1 and ev(idx, "BlockStored", "shape_mismatch") == 0
    assert ev(idx, "BlockStored", "placeholder_ignored") == 1
    assert idx.stats()["nodes"] == 2
    assert set(idx.stats()["models"]["default"]["groups"]) == {"0"}
    # A well-formed SWA store is indexed under its own group, outside the headline.
    apply(idx, [store(t, 4, 0, 4, group=1, kind="sliding_window", kv_cache_spec_sliding_window=8)], ver)
    w = wm(idx, t)
    assert w.groups["1"] == {"GPU": 4, "total_blocks": 4}
    assert w.groups["0"] == {"GPU": 2, "total_blocks": 2}
    assert w.tiers == {"GPU": 2} and w.total_blocks == 2 and w.score == pytest.approx(2.0)
    g1 = idx.stats()["models"]["default"]["groups"]["1"]
    assert g1["kind"] == "sliding_window" and g1["nodes"] == 4


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_10_offload_removals_one_event_per_group(ver):
    """vLLM test_take_events_groups_removed_hashes_by_kv_group: one BlockRemoved per group."""
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)  # the same engine hashes appear in every group
    apply(idx, [store(t, 4, 0, 2, medium="CPU", group=0), store(t, 4, 0, 2, medium="CPU", group=1)], ver)
    w = wm(idx, t)
    assert w.groups["0"]["CPU"] == 2 and w.groups["1"]["CPU"] == 2
    assert w.tiers == {"CPU": 2}
    assert idx.stats()["nodes"] == 4  # one tree per group
    apply(idx, [removed(hs, medium="CPU", group=0)], ver)
    w = wm(idx, t)
    assert set(w.groups) == {"1"}
    # The headline is the minimum over both full-attention groups: group 0 holds nothing.
    assert w.total_blocks == 0 and w.tiers == {}
    assert idx.match(t).best is None
    apply(idx, [removed(hs, medium="CPU", group=1)], ver)
    assert ev(idx, "BlockRemoved", "applied") == 2
    assert idx.stats()["nodes"] == 0
    assert idx.match(t).workers == []


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_4_offload_restore_after_eviction_with_new_tokens(ver):
    """vLLM test_take_events_supports_restore_after_eviction: the re-store's tokens win."""
    idx = PrefixIndex()
    old = toks(1, 2, 4)
    new = toks(500, 2, 4)
    hs = ehashes(old, 4)
    apply(idx, [store(old, 4, 0, 2, medium="CPU")], ver)
    assert tiers(idx, old) == {"CPU": 2}
    apply(idx, [removed(hs, medium="CPU")], ver)
    assert idx.stats()["nodes"] == 0
    # Same key, re-recorded from a new request: carries the new tokens.
    apply(idx, [store(new, 4, 0, 2, medium="CPU", hashes=hs)], ver)
    assert tiers(idx, old) == {}
    assert tiers(idx, new) == {"CPU": 2}
    assert idx.stats()["nodes"] == 2
    apply(idx, [removed(hs, medium="CPU")], ver)
    assert idx.stats()["nodes"] == 0


def test_R_APP_11_remote_locality_ignored():
    """vLLM …forwards_locality_to_{rich_store,placeholder_store,remove} (0.26+ map layout)."""
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 2, medium="STORAGE", locality="REMOTE"),
                placeholder(hs, medium="STORAGE", locality="REMOTE")])
    assert ev(idx, "BlockStored", "remote_ignored") == 2
    assert idx.stats()["nodes"] == 0
    apply(idx, [store(t, 4, 0, 2, medium="STORAGE", locality="LOCAL")])
    assert tiers(idx, t) == {"STORAGE": 2}
    apply(idx, [removed(hs, medium="STORAGE", locality="REMOTE")])
    assert ev(idx, "BlockRemoved", "remote_ignored") == 1
    assert tiers(idx, t) == {"STORAGE": 2}
    apply(idx, [removed(hs, medium="STORAGE", locality="LOCAL")])
    assert idx.stats()["nodes"] == 0


def test_R_APP_11_golden_locality_ownership():
    idx = PrefixIndex()
    assert idx.apply(ENGINE, golden.payload("v0.33.0", "locality_ownership")) == "applied"
    assert ev(idx, "BlockStored", "remote_ignored") == 1
    t = list(range(40000, 40032))
    w = wm(idx, t)
    assert w.tiers == {"CPU:kvcr": 2, "STORAGE": 2}
    assert "CPU" not in w.tiers
    assert winfo(idx)["resident_blocks"] == {"CPU:kvcr": 2, "STORAGE": 2}
    assert idx.stats()["nodes"] == 2


# ------------------------------------------------------------------ R-APP-2


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_2_cpu_store_of_gpu_known_hashes_attaches_same_nodes(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 4)], ver)
    # The CPU event's tokens are deliberately different: known hashes must win.
    wrong = [x + 1 for x in t]
    apply(idx, [store(wrong, 4, 0, 4, medium="CPU", hashes=hs)], ver)
    assert idx.stats()["nodes"] == 4
    assert tiers(idx, t) == {"GPU": 4, "CPU": 4}
    assert tiers(idx, wrong) == {}
    # The CPU residency lives on the GPU nodes: dropping the GPU copy keeps the nodes.
    apply(idx, gpu_evictions(reversed(hs)), ver)
    assert idx.stats()["nodes"] == 4
    assert tiers(idx, t) == {"CPU": 4}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_2_salted_lora_gpu_store_then_cpu_store_with_lora_name_only(ver):
    idx = PrefixIndex()
    t = toks(1, 3, 4)
    hs = ehashes(t, 4, ns="adapter-x/salt-1")
    gpu = store(t, 4, 0, 3, hashes=hs, lora_id=3, lora_name="adapter-x",
                extra_keys=[("adapter-x", "salt-1"), ("adapter-x",), ("adapter-x",)])
    cpu = store(t, 4, 0, 3, hashes=hs, medium="CPU", lora_id=3, lora_name="adapter-x", extra_keys=None)
    apply(idx, [gpu], ver)
    apply(idx, [cpu], ver)
    assert idx.stats()["nodes"] == 3
    assert tiers(idx, t, lora_name="adapter-x", cache_salt="salt-1") == {"GPU": 3, "CPU": 3}
    # The CPU copy is on the salted path only.
    assert tiers(idx, t, lora_name="adapter-x") == {}
    assert tiers(idx, t) == {}


@pytest.mark.parametrize("vdir", GOLDEN_DIRS)
def test_R_APP_2_golden_lora_and_salt(vdir):
    idx = PrefixIndex()
    idx.apply(ENGINE, golden.payload(vdir, "lora_and_salt"))
    assert idx.stats()["nodes"] == 3
    t = list(range(20000, 20048))
    w = wm(idx, t, lora_name="adapter-a", cache_salt="tenant-a")
    assert w.tiers == {"GPU": 3, "CPU": 3} and w.total_blocks == 3
    assert tiers(idx, t) == {}
    assert tiers(idx, t, lora_name="adapter-a") == {}


# ------------------------------------------------------------------ R-APP-3


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_waits_then_attaches_when_parent_arrives(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 2, 4)], ver)
    assert ev(idx, "BlockStored", "orphaned") == 1
    s = idx.stats()
    assert s["orphans"] == 1 and s["nodes"] == 0
    assert winfo(idx)["orphans"] == 1
    assert idx.match(t).workers == []
    apply(idx, [store(t, 4, 0, 2)], ver)
    s = idx.stats()
    assert s["orphans"] == 0 and s["nodes"] == 4
    assert tiers(idx, t) == {"GPU": 4}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_chain_grandchild_first(ver):
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    apply(idx, [store(t, 4, 4, 6)], ver)
    apply(idx, [store(t, 4, 2, 4)], ver)
    assert idx.stats()["orphans"] == 2 and idx.stats()["nodes"] == 0
    apply(idx, [store(t, 4, 0, 2)], ver)
    assert idx.stats()["orphans"] == 0
    assert tiers(idx, t) == {"GPU": 6}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_never_attached_at_root(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 2, 4), store(t, 4, 2, 4, medium="CPU")], ver)
    assert idx.stats()["nodes"] == 0
    # Neither the orphan's own tokens from the root, nor the full prompt, match.
    assert idx.match(t[8:16]).workers == []
    assert idx.match(t).workers == []


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_whose_parent_is_gone_at_adoption_is_dropped_not_rooted(ver):
    """Stores arrive child first: C (blocks 4-5, parent block 3), then B (blocks 2-3,
    parent block 1) whose tokens do not fit uint32, then A (blocks 0-1). A's arrival
    adopts B, which is dropped as bad (R-BAD-3) and so never gets its nodes; C, waiting
    under B's last hash, finds its parent gone at adoption time. It is dropped and
    counted as ``orphans_dropped_parent_gone``, never hung at the root (R-APP-3), and
    it does not come back when blocks 2-3 are stored correctly later."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    c = store(t, 4, 4, 6)
    b = store(t[:15] + [2**40] + t[16:], 4, 2, 4, hashes=ehashes(t, 4))  # block 3's last token
    apply(idx, [c], ver)
    apply(idx, [b], ver)
    assert ev(idx, "BlockStored", "orphaned") == 2
    assert idx.stats()["orphans"] == 2 and idx.stats()["nodes"] == 0
    apply(idx, [store(t, 4, 0, 2)], ver)
    s = idx.stats()
    assert s["counters"].get("orphans_dropped_bad", 0) == 1
    assert s["counters"].get("orphans_dropped_parent_gone", 0) == 1
    assert s["counters"].get("orphans_adopted", 0) == 0
    assert s["orphans"] == 0 and winfo(idx)["orphans"] == 0
    assert s["nodes"] == 2 and s["resident_entries"] == 2  # A's blocks only
    assert tiers(idx, t) == {"GPU": 2}
    # Nothing of C (or B) hangs at the root: their tokens from token 0 match nothing.
    assert idx.match(t[16:24]).workers == []
    assert idx.match(t[8:24]).workers == []
    # C was dropped, not kept waiting: a correct B later brings blocks 2-3 only.
    apply(idx, [store(t, 4, 2, 4)], ver)
    assert tiers(idx, t) == {"GPU": 4}
    assert idx.stats()["nodes"] == 4


def test_R_APP_3_orphan_adopted_when_parent_store_has_duplicates():
    """A child chunk arrives before its parent chunk, and the parent chunk re-announces
    blocks the worker already holds in that tier (two chunks sharing a non-aligned
    prefix, reference §3.4): the child must still be attached."""
    idx = PrefixIndex()
    a = toks(1, 3, 4)
    b = a[:8] + toks(900, 4, 4)  # shares blocks 0-1 with ``a``, 6 blocks
    apply(idx, [store(a, 4, 0, 3, medium="CPU")])  # chunk A: blocks 0-2 of a
    c, d = chunks(b, 4, 3)  # chunk C: blocks 0-2 of b (0,1 shared), D: blocks 3-5 of b
    apply(idx, [d, c])  # child first
    assert idx.stats()["orphans"] == 0
    assert tiers(idx, b) == {"CPU": 6}
    assert tiers(idx, a) == {"CPU": 3}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_count_bound_drops_oldest(ver):
    idx = PrefixIndex(max_orphans=2)
    seqs = [toks(1000 * (i + 1), 4, 4) for i in range(3)]
    for t in seqs:
        apply(idx, [store(t, 4, 2, 4)], ver)
    s = idx.stats()
    assert s["orphans"] == 2
    assert s["counters"]["orphan_overflow"] == 1
    # The oldest orphan is gone: its parent arriving does not bring it back.
    apply(idx, [store(seqs[0], 4, 0, 2)], ver)
    assert tiers(idx, seqs[0]) == {"GPU": 2}
    # The newest one is still waiting and gets attached.
    apply(idx, [store(seqs[2], 4, 0, 2)], ver)
    assert tiers(idx, seqs[2]) == {"GPU": 4}
    assert idx.stats()["orphans"] == 1


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_3_orphan_age_bound_expires(ver):
    clock = FakeClock()
    idx = PrefixIndex(orphan_ttl_s=30.0, clock=clock)
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 2, 4)], ver)
    clock.t += 10
    apply(idx, [store(toks(5000, 1, 4), 4, 0, 1)], ver)  # unrelated batch
    assert idx.stats()["orphans"] == 1
    clock.t += 25  # 35 s old
    apply(idx, [store(toks(6000, 1, 4), 4, 0, 1)], ver)
    s = idx.stats()
    assert s["orphans"] == 0
    assert s["counters"]["orphan_expired"] == 1
    apply(idx, [store(t, 4, 0, 2)], ver)
    assert tiers(idx, t) == {"GPU": 2}


def test_R_APP_3_orphan_older_than_ttl_not_adopted_by_late_parent():
    """An orphan that outlived ``orphan_ttl_s`` is dropped even when the next batch
    is the one that brings its parent."""
    clock = FakeClock()
    idx = PrefixIndex(orphan_ttl_s=30.0, clock=clock)
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 2, 4)])
    clock.t += 100
    apply(idx, [store(t, 4, 0, 2)])
    assert tiers(idx, t) == {"GPU": 2}
    assert counter(idx, "orphan_expired") == 1


# ------------------------------------------------------------------ R-APP-4


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_4_duplicate_store_never_doubles_and_removal_counts_down(ver):
    idx = PrefixIndex()
    t = toks(1, 3, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 3)], ver)
    before = wm(idx, t)
    apply(idx, [store(t, 4, 0, 3)], ver)  # physical duplicate, announced twice
    assert ev(idx, "BlockStored", "applied_with_duplicates") == 1
    after = wm(idx, t)
    assert idx.stats()["nodes"] == 3
    assert after.score == before.score == pytest.approx(3.0)
    assert after.tiers == {"GPU": 3}
    assert winfo(idx)["resident_blocks"] == {"GPU": 3}
    # First removal of each hash: the other copy keeps the blocks.
    apply(idx, gpu_evictions(reversed(hs)), ver)
    assert tiers(idx, t) == {"GPU": 3}
    assert idx.stats()["nodes"] == 3
    # Second removal: gone.
    apply(idx, gpu_evictions(reversed(hs)), ver)
    assert idx.stats()["nodes"] == 0
    assert idx.match(t).workers == []
    # Third removal: below zero, ignored and counted.
    apply(idx, gpu_evictions(hs), ver)
    assert ev(idx, "BlockRemoved", "unknown_hash") == 3
    assert ev(idx, "BlockRemoved", "applied") == 6
    assert idx.stats()["resident_entries"] == 0


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_4_removal_of_unknown_hash_ignored_and_counted(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)
    apply(idx, [removed([12345])], ver)  # worker knows nothing yet
    apply(idx, [store(t, 4, 0, 2)], ver)
    apply(idx, [removed([777]), removed([hs[1], 888], medium="GPU"), removed([hs[0]], medium="CPU")], ver)
    assert ev(idx, "BlockRemoved", "unknown_hash") == 3  # 12345, 777, CPU copy never stored
    assert ev(idx, "BlockRemoved", "applied_partial") == 1
    assert tiers(idx, t) == {"GPU": 1}
    assert idx.stats()["nodes"] == 1


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_4_bytes_hashes_reference_counted(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 16)
    hs = [bytes([i]) * 32 for i in (1, 2)]
    ev_ = store(t, 16, 0, 2, hashes=hs)
    apply(idx, [ev_, ev_], ver)
    assert idx.stats()["nodes"] == 2
    apply(idx, gpu_evictions(hs), ver)
    assert tiers(idx, t) == {"GPU": 2}
    apply(idx, gpu_evictions(hs[::-1]), ver)
    assert idx.stats()["nodes"] == 0


@pytest.mark.parametrize("vdir", GOLDEN_DIRS)
def test_R_APP_4_golden_cpu_chunks_shared_prefix_refcount(vdir):
    idx = PrefixIndex()
    ver = golden.VERSIONS[vdir]
    idx.apply(ENGINE, golden.payload(vdir, "cpu_chunks"))
    main = list(range(5000, 5128))  # 8 blocks: GPU, and CPU chunks A (0-3) + B (4-7)
    other = list(range(5000, 5048)) + list(range(9000, 9016))  # chunk C: 3 shared blocks + 1
    assert idx.stats()["nodes"] == 9
    w = wm(idx, main)
    assert w.tiers == {"GPU": 8, "CPU": 8} and w.total_blocks == 8 and w.score == pytest.approx(8.0)
    w = wm(idx, other)
    assert w.tiers == {"GPU": 3, "CPU": 4} and w.total_blocks == 4 and w.score == pytest.approx(3.75)
    # The golden removals: GPU evicts blocks 8 and 7, the CPU evicts chunk C.
    evs = golden_events(vdir, "removals_and_clear")
    assert isinstance(evs[-1], Cleared)
    apply(idx, evs[:-1], ver)
    # Chunk C's shared blocks were announced twice; chunk A still holds them.
    w = wm(idx, main)
    assert w.tiers == {"GPU": 6, "CPU": 8} and w.total_blocks == 8
    w = wm(idx, other)
    assert w.tiers == {"GPU": 3} and w.total_blocks == 3
    assert idx.stats()["nodes"] == 8
    apply(idx, evs[-1:], ver)
    assert idx.stats()["nodes"] == 0
    assert idx.stats()["resident_entries"] == 0


@pytest.mark.parametrize("vdir", GOLDEN_DIRS)
def test_R_APP_4_golden_removals_and_clear_whole_payload(vdir):
    idx = PrefixIndex()
    idx.apply(ENGINE, golden.payload(vdir, "cpu_chunks"))
    assert idx.apply(ENGINE, golden.payload(vdir, "removals_and_clear")) == "applied"
    assert ev(idx, "BlockRemoved", "applied") == 3
    assert ev(idx, "AllBlocksCleared", "applied") == 1
    assert idx.stats()["nodes"] == 0


# ------------------------------------------------------------------ R-APP-5


def _gpu4_cpu_2chunks(ver):
    """6 blocks of 4 tokens: GPU holds blocks 0-3, CPU chunks [0-2] and [3-5]."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    apply(idx, [store(t, 4, 0, 4)] + chunks(t, 4, 3), ver)
    return idx, t


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_5_chunk_missing_one_block_does_not_count(ver):
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    hs = ehashes(t, 4)
    apply(idx, chunks(t, 4, 3), ver)
    assert tiers(idx, t) == {"CPU": 6}
    apply(idx, [removed([hs[4]], medium="CPU")], ver)  # the middle of chunk 1
    assert tiers(idx, t) == {"CPU": 3}
    apply(idx, [removed([hs[0]], medium="CPU")], ver)  # the head of chunk 0
    assert tiers(idx, t) == {}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_5_match_never_ends_inside_a_chunk(ver):
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    apply(idx, chunks(t, 4, 3), ver)
    diverge_at_4 = t[:16] + [99999] * 8
    assert tiers(idx, diverge_at_4) == {"CPU": 3}
    diverge_at_2 = t[:8] + [99999] * 16
    assert tiers(idx, diverge_at_2) == {}
    assert tiers(idx, t[:20]) == {"CPU": 3}  # only 5 full blocks in the query
    assert tiers(idx, t[:23]) == {"CPU": 3}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_5_issue_57159_prefix_of_a_chunk_gets_no_cpu_hit(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, chunks(t, 4, 4), ver)
    q = t[:12] + [77777] * 4  # matches h1..h3, diverges at h4
    assert wm(idx, q) is None or wm(idx, q).total_blocks == 0
    assert tiers(idx, q) == {}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_5_gpu_counts_block_by_block(ver):
    idx, t = _gpu4_cpu_2chunks(ver)
    w = wm(idx, t)
    assert w.tiers == {"GPU": 4, "CPU": 6}
    assert w.total_blocks == 6
    assert w.score == pytest.approx(4 + 2 * 0.75)
    # Diverging inside chunk 1 (at block 5): GPU still counts its 4 blocks.
    q = t[:20] + [99999] * 4
    w = wm(idx, q)
    assert w.tiers == {"GPU": 4, "CPU": 3} and w.total_blocks == 4
    assert w.score == pytest.approx(4.0)
    # Diverging at block 3: GPU 3.
    q = t[:12] + [99999] * 12
    w = wm(idx, q)
    assert w.tiers == {"GPU": 3, "CPU": 3} and w.total_blocks == 3


def test_R_APP_5_chunk_length_follows_each_groups_block_size():
    """One connector chunk of 16 tokens is 4 blocks in a 4-token group and 2 blocks
    in an 8-token group: each group's chunks count whole."""
    idx = PrefixIndex()
    t = toks(1, 8, 4)  # 32 tokens
    h8 = ehashes(t, 8, ns="g1")
    apply(idx, chunks(t, 4, 4, group=0) + chunks(t, 8, 2, group=1, hashes=h8))
    w = wm(idx, t)
    assert w.groups["0"]["CPU"] == 8
    assert w.groups["1"]["CPU"] == 4
    assert w.total_tokens == 32


# ------------------------------------------------------------------ R-APP-6


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_6_placeholder_never_creates_a_node(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)
    evs = [
        placeholder(hs),  # block_size 0, no tokens
        Stored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=4, medium="CPU"),
        Stored(block_hashes=hs, parent_block_hash=None, token_ids=t, block_size=0, medium="CPU"),
        Stored(block_hashes=hs[1:], parent_block_hash=hs[0], token_ids=[], block_size=0, medium="GPU"),
    ]
    apply(idx, evs, ver)
    assert ev(idx, "BlockStored", "placeholder_ignored") == 4
    s = idx.stats()
    assert s["nodes"] == 0 and s["orphans"] == 0 and s["resident_entries"] == 0


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_6_placeholder_partially_known(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 2)], ver)
    apply(idx, [placeholder([hs[0], 4242])], ver)
    assert ev(idx, "BlockStored", "placeholder_partial") == 1
    assert idx.stats()["nodes"] == 2
    assert winfo(idx)["resident_blocks"] == {"GPU": 2, "CPU": 1}


# ------------------------------------------------------------------ R-APP-7


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_7_block_size_learned_per_model_group_and_mismatch_rejected_per_worker(ver):
    idx = PrefixIndex()
    t16 = toks(1, 2, 16)
    t32 = toks(1, 2, 32)
    apply(idx, [store(t16, 16, 0, 2)], ver, engine="e1")
    assert idx.block_size() == 16
    apply(idx, [store(t32, 32, 0, 2)], ver, engine="e2")
    assert ev(idx, "BlockStored", "block_size_mismatch") == 1
    assert winfo(idx, "e2")["dropped"] == {"block_size_mismatch": 1}
    assert winfo(idx, "e1")["dropped"] == {}
    assert idx.stats()["nodes"] == 2
    assert idx.match(t32).worker("e2", 0) is None
    # Same worker, same group: rejected too, counted again for that worker.
    apply(idx, [store(t32, 32, 0, 2)], ver, engine="e1")
    assert winfo(idx, "e1")["dropped"] == {"block_size_mismatch": 1}
    # Another group and another model learn their own block size.
    apply(idx, [store(t32, 32, 0, 2, group=1)], ver, engine="e2")
    apply(idx, [store(t32, 32, 0, 2)], ver, engine="e3", model="other")
    assert ev(idx, "BlockStored", "block_size_mismatch") == 2
    groups = idx.stats()["models"]["default"]["groups"]
    assert groups["0"]["block_size"] == 16 and groups["1"]["block_size"] == 32
    assert idx.block_size("other") == 32
    assert tiers(idx, t32, engine="e3", model="other") == {"GPU": 2}


# ------------------------------------------------------------------ R-APP-8


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_8_cleared_drops_gpu_and_cpu_keeps_storage(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 4)] + chunks(t, 4, 2) + chunks(t, 4, 4, medium="STORAGE"), ver)
    apply(idx, [store(t, 4, 0, 4)], ver, engine="e2")
    assert tiers(idx, t) == {"GPU": 4, "CPU": 4, "STORAGE": 4}
    assert apply(idx, [Cleared()], ver) == "applied"
    assert ev(idx, "AllBlocksCleared", "applied") == 1
    w = wm(idx, t)
    assert w.tiers == {"STORAGE": 4} and w.total_blocks == 4 and w.score == pytest.approx(1.0)
    assert winfo(idx)["resident_blocks"] == {"STORAGE": 4}
    # Another worker is untouched.
    assert tiers(idx, t, engine="e2") == {"GPU": 4}
    assert idx.stats()["nodes"] == 4


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_8_cleared_frees_nodes_only_gpu_cpu_held(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 4)] + chunks(t, 4, 2), ver)
    apply(idx, [Cleared()], ver)
    s = idx.stats()
    assert s["nodes"] == 0 and s["resident_entries"] == 0
    # A later removal of a cleared hash is harmless.
    apply(idx, gpu_evictions(ehashes(t, 4)), ver)
    assert idx.stats()["nodes"] == 0


# ------------------------------------------------------------------ R-APP-9


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_9_after_every_removal_the_index_holds_no_nodes(ver):
    rnd = random.Random(7)
    idx = PrefixIndex()
    shared = toks(1, 3, 4)
    prompts = [shared + toks(1000 * (i + 1), 3, 4) for i in range(4)]  # a branching tree
    removals: list = []
    for e in ("e1", "e2"):
        for p in prompts:
            hs = ehashes(p, 4)
            gpu = [store(p, 4, 0, 3), store(p, 4, 3, 6)]
            cpu = chunks(p, 4, 3)
            evs = gpu[::-1] + cpu[::-1]  # child first: orphans adopted later in the batch
            apply(idx, evs, ver, engine=e)
            removals.append((e, gpu_evictions(hs)))
            removals.append((e, [removed(hs, medium="CPU")]))
    assert idx.stats()["orphans"] == 0
    assert idx.stats()["nodes"] == 3 + 4 * 3
    rnd.shuffle(removals)
    for e, evs in removals:
        apply(idx, evs, ver, engine=e)
    s = idx.stats()
    assert s["nodes"] == 0
    assert s["resident_entries"] == 0
    assert s["models"]["default"]["nodes"] == 0
    assert all(w["resident_blocks"] == {} for w in idx.workers())


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_9_node_cap_evicts_least_recently_stored_leaves(ver):
    """Cap 4; chain a (4 blocks) then chain b (2 blocks, one event): the least
    recently stored leaves are a's blocks 3 and then 2, not b's fresh block 1."""
    idx = PrefixIndex(max_nodes=4)
    a = toks(1, 4, 4)
    b = toks(5000, 2, 4)
    apply(idx, [store(a, 4, 0, 4)], ver)
    assert idx.stats()["nodes"] == 4
    apply(idx, [store(b, 4, 0, 2)], ver)
    s = idx.stats()
    assert s["nodes"] == 4
    assert s["counters"]["cap_evicted_nodes"] == 2
    assert tiers(idx, b) == {"GPU": 2}
    assert tiers(idx, a) == {"GPU": 2}  # a's two deepest blocks went
    assert winfo(idx)["resident_blocks"] == {"GPU": 4}


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_9_removal_after_cap_eviction_is_harmless(ver):
    idx = PrefixIndex(max_nodes=2)
    xs = [toks(1000 * (i + 1), 1, 4) for i in range(3)]
    for x in xs:
        apply(idx, [store(x, 4, 0, 1)], ver)
    s = idx.stats()
    assert s["nodes"] == 2
    assert s["counters"]["cap_evicted_nodes"] == 1
    assert tiers(idx, xs[0]) == {}  # the least recently stored leaf went
    assert tiers(idx, xs[1]) == {"GPU": 1} and tiers(idx, xs[2]) == {"GPU": 1}
    assert winfo(idx)["resident_blocks"] == {"GPU": 2}
    # A later removal of the evicted hash is harmless: nothing else changes.
    assert apply(idx, gpu_evictions(ehashes(xs[0], 4)), ver) == "applied"
    assert idx.stats()["nodes"] == 2
    assert tiers(idx, xs[1]) == {"GPU": 1} and tiers(idx, xs[2]) == {"GPU": 1}
    # The evicted block can be stored again (evicting the next oldest).
    apply(idx, [store(xs[0], 4, 0, 1)], ver)
    assert tiers(idx, xs[0]) == {"GPU": 1}
    assert idx.stats()["nodes"] == 2
    # Removing everything still held frees every node.
    for x in xs:
        apply(idx, gpu_evictions(ehashes(x, 4)), ver)
    s = idx.stats()
    assert s["nodes"] == 0 and s["resident_entries"] == 0


# ------------------------------------------------------------------ R-APP-10


@pytest.mark.parametrize("vdir", GOLDEN_DIRS)
def test_R_APP_10_golden_hybrid_headline_over_default_groups(vdir):
    idx = PrefixIndex()
    assert idx.apply(ENGINE, golden.payload(vdir, "hybrid_groups")) == "applied"
    # Group 1 (sliding window 32, block size 16, null blocks skipped: blocks 2-3 of 4)
    # is placed by its full-attention twins (R-APP-12): 2 held nodes, 2 mirrored
    # ancestors; group 2 (mamba) is a placeholder for a hash group 2 never stored.
    assert ev(idx, "BlockStored", "applied") == 2 and ev(idx, "BlockStored", "shape_mismatch") == 0
    assert ev(idx, "BlockStored", "placeholder_ignored") == 1
    assert idx.stats()["nodes"] == 8
    t = list(range(30000, 30064))
    # A longer prompt: vLLM takes the full-attention hit (4 blocks) and the window
    # group holds the 2 blocks it needs (ceil(31 / 16)) ending there: 4 blocks.
    w = wm(idx, t + [1])
    assert w.tiers == {"GPU": 4} and w.total_blocks == 4 and w.total_tokens == 64
    assert set(w.groups) == {"0"}
    # The 64 tokens alone: vLLM reuses at most len - 1 tokens (3 blocks), and the window
    # ending at block 3 needs blocks 1-2, of which the group holds only 2; no run of 2
    # from the start either: nothing is reused, and the headline says so.
    w = wm(idx, t)
    assert w.total_blocks == 0 and w.groups["0"] == {"GPU": 4, "total_blocks": 4}


def _vllm_window_hit(held: list[bool], fa_blocks: int, ntok: int, bs: int, window: int) -> int:
    """vLLM's hybrid hit, stated the other way round from the index's scan: the
    largest L within the full-attention hit and len - 1 tokens such that the window
    group holds the ``ceil((window - 1) / bs)`` blocks ending at L; with none, the run
    of held blocks from the start."""
    need = -(-(window - 1) // bs)
    mx = min(fa_blocks, (ntok - 1) // bs)
    held = held + [False] * max(0, mx - len(held))
    ends = [L for L in range(need, mx + 1) if all(held[L - need:L])]
    if ends:
        return max(ends)
    run = 0
    while run < mx and held[run]:
        run += 1
    return run


def test_R_APP_12_a_window_group_as_vllm_sends_it_caps_the_hybrid_headline():
    """vLLM's hybrid engines: group 0 sliding window (8 tokens, block size 4), group 1
    full attention; each step lists the window group's store first, leaving out null
    blocks (only the blocks inside the window, with the token ids of the whole range
    and the parent of a block the group never held). The headline is what vLLM's hit
    rule reuses of each prompt, checked against a reference stated another way."""
    bs, win = 4, 8
    idx = PrefixIndex()
    b = toks(1, 10, bs)  # 10 blocks: prompts of 6 and 9 blocks, and one token more
    hs = ehashes(b, bs)

    def window_store(a, c, keep):  # blocks [a, c) computed, the last `keep` held
        return Stored(block_hashes=hs[c - keep:c], parent_block_hash=hs[a - 1] if a else None,
                      token_ids=b[a * bs:c * bs], block_size=bs, group_idx=0,
                      kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=win)

    apply(idx, [window_store(0, 6, 2), store(b, bs, 0, 6, group=1)])
    assert ev(idx, "BlockStored", "applied") == 2
    held = [False] * 4 + [True] * 2

    def check(ntok, fa, held):
        want = _vllm_window_hit(held, fa, ntok, bs, win)
        assert total(idx, b[:ntok]) == want, (ntok, want)
        return want

    assert check(25, 6, held) == 6  # the window's 2 blocks end the full-attention hit
    assert check(24, 6, held) == 0  # len - 1 tokens: 5 blocks, and block 3 is not held
    assert check(17, 4, held) == 0  # a shorter prompt: its window blocks are not held
    # The next turn: blocks 6-8 computed, 7-8 inside the window, the parent block 5.
    apply(idx, [window_store(6, 9, 2), store(b, bs, 6, 9, group=1)], ts=1767225601.0)
    held = [False] * 4 + [True] * 2 + [False] + [True] * 2
    assert check(37, 9, held) == 9
    assert check(25, 6, held) == 6
    # The window group evicts blocks 7-8: the full-attention group still holds all 9,
    # but vLLM would reuse 6 (blocks 4-5 end a window): never the 9 it would not.
    apply(idx, gpu_evictions(hs[7:9], group=0), ts=1767225602.0)
    held[7] = held[8] = False
    assert check(37, 9, held) == 6
    w = wm(idx, b[:37])
    assert w.groups["1"] == {"GPU": 9, "total_blocks": 9} and w.tiers == {"GPU": 6}
    # Its removals free the mirrored path as they go (R-APP-9): only what is held stays.
    apply(idx, gpu_evictions(hs[4:6], group=0), ts=1767225603.0)
    assert idx.stats()["models"]["default"]["groups"]["0"]["nodes"] == 0
    assert check(37, 9, [False] * 9) == 0


def test_R_APP_9_R_APP_12_the_node_cap_bounds_a_window_group_and_its_mirrored_ancestors():
    """A window store mirrors its blocks' ancestors into the window group's tree: those
    count against the per-tree node cap like any node, and the cap evicts there too."""
    bs = 4
    idx = PrefixIndex(max_nodes=6)
    for i in range(3):
        b = toks(1000 * (i + 1), 6, bs)
        hs = ehashes(b, bs)
        sw = Stored(block_hashes=hs[4:6], parent_block_hash=None, token_ids=b, block_size=bs, group_idx=0,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8)
        apply(idx, [sw, store(b, bs, 0, 6, group=1)], ts=1767225600.0 + i)
        groups = idx.stats()["models"]["default"]["groups"]
        assert groups["0"]["nodes"] <= 6 and groups["1"]["nodes"] <= 6, groups
    assert counter(idx, "cap_evicted_nodes") > 0


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_10_two_full_attention_groups_headline_is_minimum(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 4, group=0), store(t, 4, 0, 2, group=1)], ver)
    w = wm(idx, t)
    assert w.groups["0"] == {"GPU": 4, "total_blocks": 4}
    assert w.groups["1"] == {"GPU": 2, "total_blocks": 2}
    assert w.tiers == {"GPU": 2} and w.total_blocks == 2 and w.total_tokens == 8
    assert w.score == pytest.approx(2.0)
    # The other way round, and with an unknown kind (a default group too).
    idx2 = PrefixIndex()
    apply(idx2, [store(t, 4, 0, 1, group=0), store(t, 4, 0, 3, group=1, kind=None)], ver)
    w = wm(idx2, t)
    assert w.tiers == {"GPU": 1} and w.total_blocks == 1 and w.score == pytest.approx(1.0)


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_10_headline_tiers_and_score_are_minimum_when_totals_tie(ver):
    """Group 0: GPU 4. Group 1: GPU 2 then CPU to 4. Both totals are 4, but group 1
    can only serve blocks 2-3 from CPU: the headline GPU is min(4, 2) = 2 and the
    score min(4.0, 2 + 2 * 0.75) = 3.5."""
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 4, group=0), store(t, 4, 0, 2, group=1)] + chunks(t, 4, 4, group=1), ver)
    w = wm(idx, t)
    assert w.groups["0"] == {"GPU": 4, "total_blocks": 4}
    assert w.groups["1"] == {"GPU": 2, "CPU": 4, "total_blocks": 4}
    assert w.total_blocks == 4
    assert w.score == pytest.approx(2 + 2 * 0.75)
    assert w.tiers.get("GPU") == 2


@pytest.mark.parametrize("ver", WIRE)
def test_R_APP_10_mamba_and_sliding_groups_reported_but_not_headline(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 1, group=0), store(t, 4, 0, 4, group=1, kind="mamba"),
                store(t, 4, 0, 4, group=2, kind="sliding_window")], ver)
    w = wm(idx, t)
    assert w.tiers == {"GPU": 1} and w.total_blocks == 1
    assert w.groups["1"]["total_blocks"] == 4 and w.groups["2"]["total_blocks"] == 4
    kinds = {g: d["kind"] for g, d in idx.stats()["models"]["default"]["groups"].items()}
    assert kinds == {"0": FA, "1": "mamba", "2": "sliding_window"}


# ------------------------------------------------------------- R-STR-1 / R-STR-5


@pytest.mark.parametrize("ver", WIRE)
def test_R_STR_1_already_applied_sequence_is_skipped(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    hs = ehashes(t, 4)
    batch = encode_batch([store(t, 4, 0, 2)], version=ver)
    assert idx.apply(ENGINE, batch, seq=0) == "applied"
    assert idx.apply(ENGINE, batch, seq=0) == "duplicate"
    assert counter(idx, "batches_duplicate") == 1
    assert winfo(idx)["last_seq"] == 0
    # Not counted twice: one removal per hash frees the blocks.
    assert idx.apply(ENGINE, encode_batch(gpu_evictions(hs), version=ver), seq=1) == "applied"
    assert idx.stats()["nodes"] == 0
    # An old sequence with the same batch ts is a duplicate too.
    assert idx.apply(ENGINE, batch, seq=1) == "duplicate"
    assert idx.stats()["nodes"] == 0


@pytest.mark.parametrize("ver", WIRE)
def test_R_STR_5_backwards_sequence_with_newer_ts_restarts_worker(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    u = toks(800, 2, 4)
    apply(idx, [store(t, 4, 0, 4)] + chunks(t, 4, 2) + chunks(t, 4, 4, medium="STORAGE"),
          ver, ts=100.0, seq=0)
    apply(idx, [store(t, 4, 0, 4)], ver, engine="e2", ts=100.0, seq=0)
    for s in range(1, 6):
        apply(idx, [], ver, ts=100.0 + s, seq=s)
    # The engine restarted: sequence 0 again, newer timestamp.
    assert apply(idx, [store(u, 4, 0, 2)], ver, ts=200.0, seq=0) == "applied"
    assert counter(idx, "restarts") == 1
    info = winfo(idx)
    assert info["restarts"] == 1 and info["last_seq"] == 0
    assert info["resident_blocks"] == {"GPU": 2}
    assert wm(idx, t) is None  # every tier dropped, STORAGE too
    assert tiers(idx, u) == {"GPU": 2}
    assert tiers(idx, t, engine="e2") == {"GPU": 4}
    assert idx.stats()["nodes"] == 4 + 2
    # And the sequence continues from the restart.
    assert apply(idx, [], ver, ts=201.0, seq=1) == "applied"
    assert counter(idx, "restarts") == 1
