"""Worker lifecycle in the library (drop, restart, stale marks, freshness) and the
publisher-side bounds of R-BAD-3 that the core index enforces."""

from __future__ import annotations

import msgspec
import pytest

from evkit import WIRE, FakeClock, apply, chunks, counter, ev, placeholder, store, tiers, toks, winfo
from indexer import PrefixIndex


def _fleet(ver="0.33", clock=None):
    """Two engines; e1 has DP ranks 0 and 1; everyone holds the same 4-block prompt
    in GPU and in CPU (2-block chunks)."""
    idx = PrefixIndex(clock=clock or FakeClock())
    t = toks(1, 4, 4)
    for engine, rank in (("e1", 0), ("e1", 1), ("e2", 0)):
        apply(idx, [store(t, 4, 0, 4)] + chunks(t, 4, 2), ver, engine=engine, dp_rank=rank)
    return idx, t


def _who(idx, t):
    return sorted((w.engine, w.dp_rank) for w in idx.match(t).workers)


@pytest.mark.parametrize("ver", WIRE)
def test_drop_worker_removes_only_that_worker_and_frees_nodes(ver):
    idx, t = _fleet(ver)
    nodes = idx.stats()["nodes"]
    assert idx.drop_worker("e1", 1) is True
    assert _who(idx, t) == [("e1", 0), ("e2", 0)]
    assert idx.stats()["nodes"] == nodes  # others still hold every block
    assert idx.stats()["resident_entries"] == 2 * 8
    assert idx.drop_worker("e1", 1) is False
    idx.drop_worker("e1", 0)
    idx.drop_worker("e2", 0)
    s = idx.stats()
    assert s["nodes"] == 0 and s["resident_entries"] == 0 and s["workers"] == 0


def test_drop_engine_drops_every_dp_rank():
    idx, t = _fleet()
    assert idx.drop_engine("e1") == 2
    assert _who(idx, t) == [("e2", 0)]
    assert [w["engine"] for w in idx.workers()] == ["e2"]
    assert idx.drop_engine("nope") == 0


def test_dropped_worker_id_is_reused_without_leaking_old_residency():
    idx, t = _fleet()
    idx.drop_worker("e1", 1)
    other = toks(900, 2, 4)
    apply(idx, [store(other, 4, 0, 2)], engine="e3")
    # e3 may get e1/1's old bit: it must not inherit e1/1's blocks.
    assert tiers(idx, t, engine="e3") == {}
    assert tiers(idx, other, engine="e3") == {"GPU": 2}


def test_reset_worker_keeps_it_known_with_no_residency():
    idx, t = _fleet()
    assert idx.reset_worker("e2", 0) is True
    info = winfo(idx, "e2", 0)
    assert info["resident_blocks"] == {} and info["restarts"] == 1
    assert ("e2", 0) not in _who(idx, t)
    assert counter(idx, "restarts") == 1


def test_stale_mark_has_reason_and_clears():
    idx, t = _fleet()
    idx.mark_stale("e2", 0, "replay buffer overrun at seq 17")
    info = winfo(idx, "e2", 0)
    assert info["stale"] is True and info["stale_reason"] == "replay buffer overrun at seq 17"
    w = idx.match(t).worker("e2", 0)
    assert w.stale and w.stale_reason == "replay buffer overrun at seq 17"
    assert idx.stats()["stale_workers"] == 1
    idx.clear_stale("e2", 0)
    assert winfo(idx, "e2", 0)["stale"] is False
    assert idx.match(t).worker("e2", 0).stale is False
    assert idx.stats()["counters"]["stale_marked"] == 1 and idx.stats()["counters"]["stale_cleared"] == 1


def test_freshness_last_seq_and_age():
    clock = FakeClock(100.0)
    idx = PrefixIndex(clock=clock)
    idx.register_worker("e1", 0)
    assert winfo(idx)["last_seq"] is None and winfo(idx)["last_event_age_s"] is None
    t = toks(1, 2, 4)
    apply(idx, [store(t, 4, 0, 2)], seq=0)
    clock.t += 2.5
    apply(idx, [store(t, 4, 0, 2)], seq=1)
    clock.t += 4.0
    info = winfo(idx)
    assert info["last_seq"] == 1 and info["last_event_age_s"] == pytest.approx(4.0)
    assert info["batches"] == 2
    w = idx.match(t).worker("e1", 0)
    assert w.last_seq == 1 and w.last_event_age_s == pytest.approx(4.0)


def test_sequence_gap_and_late_join_are_counted():
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    apply(idx, [store(t, 4, 0, 1)], seq=5)  # late join: first batch is not seq 0
    apply(idx, [store(t, 4, 1, 2)], seq=9)  # gap 6..8
    assert winfo(idx)["gaps"] == 2
    assert counter(idx, "sequence_gaps") == 2
    assert tiers(idx, t) == {"GPU": 2}  # the library applies; replay is the ingest layer's job


# ----------------------------------------------------------------- R-BAD-3


def test_R_BAD_3_dp_rank_out_of_bounds_is_dropped_and_counted():
    idx = PrefixIndex(max_dp_rank=7)
    t = toks(1, 1, 4)
    assert apply(idx, [store(t, 4, 0, 1)], dp_rank=8) == "dropped"
    assert idx.stats()["dropped_payloads"] == {"bad_dp_rank": 1}
    assert idx.stats()["workers"] == 0
    assert apply(idx, [store(t, 4, 0, 1)], dp_rank=7) == "applied"


def test_R_BAD_3_group_out_of_bounds_is_ignored_and_counted():
    idx = PrefixIndex(max_groups=4)
    t = toks(1, 1, 4)
    apply(idx, [store(t, 4, 0, 1, group=4), store(t, 4, 0, 1, group=-1)])
    assert ev(idx, "BlockStored", "bad_group") == 2
    assert idx.stats()["nodes"] == 0


def test_R_BAD_3_tier_names_are_bounded():
    idx = PrefixIndex(max_tiers=3)  # GPU + 2 more
    t = toks(1, 1, 4)
    apply(idx, [store(t, 4, 0, 1)])
    for i in range(5):
        apply(idx, [store(t, 4, 0, 1, medium=f"TIER{i}")])
    assert ev(idx, "BlockStored", "tier_limit") == 3
    assert len(idx.stats()["tiers"]) == 3


def test_R_BAD_3_orphans_are_bounded_in_count():
    idx = PrefixIndex(max_orphans=50)
    for i in range(500):
        t = toks(10_000 + i * 8, 2, 4)
        apply(idx, [store(t, 4, 1, 2)])  # parent never arrives
    s = idx.stats()
    assert s["orphans"] == 50
    assert s["counters"]["orphan_overflow"] == 450
    assert s["nodes"] == 0


def test_R_BAD_3_placeholders_and_unknown_removals_allocate_nothing():
    idx = PrefixIndex()
    for i in range(1000):
        apply(idx, [placeholder([i * 7 + 1, i * 7 + 2])])
    s = idx.stats()
    assert s["nodes"] == 0 and s["resident_entries"] == 0
    assert ev(idx, "BlockStored", "placeholder_ignored") == 1000


def test_R_BAD_3_token_ids_out_of_uint32_do_not_apply_partially():
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    apply(idx, [store(t, 4, 0, 1)])
    bad = store(t, 4, 0, 2)
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": bad.block_hashes, "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4, 5, 6, 7, 2**40], "block_size": 4, "lora_id": None,
                "medium": "GPU", "lora_name": None, "group_idx": 0}], 0]
    )
    assert idx.apply("e1", raw) == "applied"
    assert ev(idx, "BlockStored", "bad_tokens") == 1
    # The known first block was not counted twice; the second never got attached.
    assert tiers(idx, t) == {"GPU": 1}
    assert idx.stats()["resident_entries"] == 1


def test_close_frees_everything():
    idx, t = _fleet()
    idx.close()
    assert idx.stats()["nodes"] == 0
    with pytest.raises(KeyError):
        idx.match(t)


def test_R_BAD_3_models_whose_last_worker_left_are_bounded():
    from indexer.store.state import MAX_IDLE_MODELS

    idx = PrefixIndex()
    n = MAX_IDLE_MODELS + 50
    for i in range(n):  # models come and go (registrations of many names): the table stays bounded
        apply(idx, [store(toks(i, 2, 16), 16, 0, 2)], engine=f"e{i}", model=f"m{i}")
        idx.drop_worker(f"e{i}")
    assert idx.models() == sorted(f"m{i}" for i in range(n - MAX_IDLE_MODELS, n))  # the newest idle ones
    with pytest.raises(KeyError, match="unknown model"):
        idx.match(toks(1, 2, 16), model="m0")
    # An idle model keeps its structure for its next engine; a worker back makes it live.
    idx.register_worker("back", 0, model=f"m{n - 1}")
    assert idx.block_size(f"m{n - 1}") == 16
    for i in range(MAX_IDLE_MODELS):
        apply(idx, [store(toks(i, 2, 16), 16, 0, 2)], engine=f"x{i}", model=f"x{i}")
        idx.drop_worker(f"x{i}")
    assert f"m{n - 1}" in idx.models()  # not idle: never evicted
    assert len(idx.models()) == MAX_IDLE_MODELS + 1


def test_R_STR_2_R_BAD_3_a_batch_dropped_for_its_dp_rank_used_its_seq():
    idx = PrefixIndex()
    apply(idx, [store(toks(1, 2, 16), 16, 0, 2)], seq=0)
    assert idx.apply("e1", msgspec.msgpack.encode([1767225601.0, [], -1]), seq=1) == "dropped"
    apply(idx, [store(toks(2, 2, 16), 16, 0, 2)], seq=2)
    assert counter(idx, "sequence_gaps") == 0  # seq 1 was used (by a bad batch): no gap before 2
    assert idx.workers()[0]["last_seq"] == 2 and idx.workers()[0]["dropped"] == {"bad_dp_rank": 1}
