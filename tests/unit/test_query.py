"""Contract section 6 (R-Q-1 .. R-Q-5): what a query takes and answers.

Payloads are built with :func:`indexer.producer.events.encode_batch` over both wire
layouts ("0.33" maps, "0.23" arrays) or taken from the golden vLLM payloads.
Engine hashes are a chained 64-bit value per token prefix (see test_apply.py).
"""

from __future__ import annotations

import sys
import threading

import pytest

import golden
from indexer import PrefixIndex
from indexer.wire.keys import block_keys
from indexer.producer.events import Removed, encode_batch

from evkit import ENGINE, WIRE, FakeClock, apply, chunks, ehashes, gpu_evictions, store, toks, wm


def issue_example(ver="0.33", **kw) -> tuple[PrefixIndex, list[int]]:
    """The issue's example: GPU holds 40 blocks, CPU chunks (8 blocks each) hold 64."""
    kw.setdefault("clock", FakeClock())  # fixed clock: answers compare equal
    idx = PrefixIndex(**kw)
    t = toks(10, 64, 16)
    apply(idx, [store(t, 16, 0, 40)] + chunks(t, 16, 8), ver)
    return idx, t


# ------------------------------------------------------------------ R-Q-1


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_1_trailing_partial_block_ignored(ver):
    idx = PrefixIndex()
    t = toks(1, 4, 16)
    apply(idx, [store(t, 16, 0, 4)], ver)
    r = idx.match(t + [5, 6, 7])
    assert r.query_blocks == 4 and r.block_size == 16
    assert r.worker(ENGINE, 0).tiers == {"GPU": 4}
    r = idx.match(t[:63])
    assert r.query_blocks == 3
    assert r.worker(ENGINE, 0).tiers == {"GPU": 3}
    r = idx.match(t[:15])
    assert r.query_blocks == 0 and r.workers == [] and r.best is None


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_1_match_by_keys_equals_match(ver):
    idx, t = issue_example(ver)
    for q in (t, t[:100], t[:40 * 16 + 3], t[:16 * 20] + [7] * 64):
        keys = block_keys(q, 16)
        assert idx.match_by_keys(keys).to_dict() == idx.match(q).to_dict()
    assert idx.match_by_keys([]).workers == []


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_1_model_optional_with_one_model_required_with_two(ver):
    idx = PrefixIndex()
    t = toks(1, 2, 16)
    apply(idx, [store(t, 16, 0, 2)], ver, model="llama")
    assert idx.match(t, model=None).worker(ENGINE, 0).tiers == {"GPU": 2}
    assert idx.match(t, model=None).model == "llama"
    assert idx.match_by_keys(block_keys(t, 16), model=None).worker(ENGINE, 0).tiers == {"GPU": 2}
    with pytest.raises(KeyError):
        idx.match(t, model="nope")
    with pytest.raises(KeyError):
        idx.match(t)  # "default" is not indexed
    with pytest.raises(KeyError):
        idx.match_by_keys(block_keys(t, 16), model="nope")
    apply(idx, [store(t, 16, 0, 1)], ver, engine="e2", model="qwen")
    with pytest.raises(KeyError):
        idx.match(t, model=None)
    with pytest.raises(KeyError):
        idx.match_by_keys(block_keys(t, 16), model=None)
    assert idx.match(t, model="qwen").worker("e2", 0).tiers == {"GPU": 1}
    assert idx.match(t, model="qwen").worker(ENGINE, 0) is None
    assert idx.match(t, model="llama").worker(ENGINE, 0).tiers == {"GPU": 2}


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_1_lora_and_extra_keys_namespace(ver):
    idx = PrefixIndex()
    t = toks(1, 3, 16)
    plain = toks(1, 3, 16)
    hs = ehashes(t, 16, ns="lora")
    apply(idx, [store(t, 16, 0, 3, hashes=hs, lora_name="ad",
                      extra_keys=[("ad", "salt"), ("ad",), ("ad", ("img", 0))])], ver)
    apply(idx, [store(plain, 16, 0, 3)], ver, engine="e2")
    r = idx.match(t, lora_name="ad", cache_salt="salt", extra_keys=[None, None, [("img", 0)]])
    assert r.worker(ENGINE, 0).tiers == {"GPU": 3}
    assert r.worker("e2", 0) is None
    # Without the mm key on block 2: blocks 0-1 only.
    r = idx.match(t, lora_name="ad", cache_salt="salt")
    assert r.worker(ENGINE, 0).tiers == {"GPU": 2}
    # Without the salt (block 0): nothing for e1; the plain query finds e2 only.
    assert idx.match(t, lora_name="ad").worker(ENGINE, 0) is None
    r = idx.match(t)
    assert r.worker(ENGINE, 0) is None and r.worker("e2", 0).tiers == {"GPU": 3}


@pytest.mark.parametrize("vdir", sorted(golden.VERSIONS))
def test_R_Q_1_golden_lora_and_salt_query(vdir):
    idx = PrefixIndex()
    idx.apply(ENGINE, golden.payload(vdir, "lora_and_salt"))
    t = list(range(20000, 20048))
    w = idx.match(t, lora_name="adapter-a", cache_salt="tenant-a").worker(ENGINE, 0)
    assert w.tiers == {"GPU": 3, "CPU": 3}
    assert idx.match(t, cache_salt="tenant-a").workers == []


def test_R_Q_1_bad_token_ids_raise():
    idx, t = issue_example()
    with pytest.raises((OverflowError, ValueError)):
        idx.match([1, 2, -1] + t)
    with pytest.raises((OverflowError, ValueError)):
        idx.match([2**32] + t)
    with pytest.raises(TypeError):
        idx.match(["a"] + t)


# ------------------------------------------------------------------ R-Q-2


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_2_issue_example_gpu_40_cpu_to_64(ver):
    idx, t = issue_example(ver)
    r = idx.match(t)
    w = r.worker(ENGINE, 0)
    assert w.tiers == {"GPU": 40, "CPU": 64}
    assert w.total_blocks == 64
    assert w.total_tokens == 1024
    assert w.score == pytest.approx(58.0)
    assert w.groups == {"0": {"GPU": 40, "CPU": 64, "total_blocks": 64}}
    d = r.to_dict()
    assert d["model"] == "default" and d["block_size"] == 16 and d["query_blocks"] == 64
    assert d["best"] == {"engine": ENGINE, "dp_rank": 0, "score": pytest.approx(58.0)}
    wd = d["workers"][0]
    assert set(wd) == {"engine", "dp_rank", "tiers", "groups", "total_blocks", "total_tokens",
                       "score", "stale", "stale_reason", "last_seq", "last_event_age_s"}
    assert wd["tiers"] == {"GPU": 40, "CPU": 64} and wd["total_tokens"] == 1024


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_2_total_chain_gpu_cpu_storage(ver):
    idx = PrefixIndex()
    t = toks(1, 8, 4)
    apply(idx, [store(t, 4, 0, 2)] + chunks(t, 4, 2)[:2] + chunks(t, 4, 2, medium="STORAGE")[:3], ver)
    w = wm(idx, t)
    assert w.tiers == {"GPU": 2, "CPU": 4, "STORAGE": 6}
    assert w.total_blocks == 6 and w.total_tokens == 24
    assert w.score == pytest.approx(2 + 2 * 0.75 + 2 * 0.25)


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_2_cpu_chunk_not_continuing_gpu_prefix_does_not_count(ver):
    """GPU holds blocks 0-1; CPU holds only the chunk of blocks 4-5: the engine loads 2."""
    idx = PrefixIndex()
    t = toks(1, 6, 4)
    hs = ehashes(t, 4)
    apply(idx, [store(t, 4, 0, 6), store(t, 4, 4, 6, medium="CPU")], ver)
    apply(idx, gpu_evictions(hs[2:6]), ver)
    w = wm(idx, t)
    assert w.tiers == {"GPU": 2}  # the CPU alone holds no prefix from block 0
    assert w.total_blocks == 2
    assert w.score == pytest.approx(2.0)


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_2_freshness_fields(ver):
    clock = FakeClock()
    idx = PrefixIndex(clock=clock)
    t = toks(1, 2, 4)
    apply(idx, [store(t, 4, 0, 2)], ver, seq=0)
    apply(idx, [], ver, seq=1)
    apply(idx, [], ver, seq=2)
    w = wm(idx, t)
    assert w.last_seq == 2
    assert w.last_event_age_s == pytest.approx(0.0)
    assert w.stale is False and w.stale_reason is None
    clock.t += 7.5
    w = wm(idx, t)
    assert w.last_event_age_s == pytest.approx(7.5)
    idx.mark_stale(ENGINE, 0, "replay_timeout")
    w = wm(idx, t)
    assert w.stale is True and w.stale_reason == "replay_timeout"
    assert idx.match(t).to_dict()["workers"][0]["stale_reason"] == "replay_timeout"
    assert idx.stats()["stale_workers"] == 1
    idx.clear_stale(ENGINE, 0)
    w = wm(idx, t)
    assert w.stale is False and w.stale_reason is None
    apply(idx, [], ver, seq=3)
    w = wm(idx, t)
    assert w.last_seq == 3 and w.last_event_age_s == pytest.approx(0.0)


def test_R_Q_2_only_matching_workers_listed():
    idx = PrefixIndex()
    t = toks(1, 2, 4)
    apply(idx, [store(t, 4, 0, 2)])
    apply(idx, [store(toks(900, 2, 4), 4, 0, 2)], engine="e2")
    idx.register_worker("e3", 0)
    r = idx.match(t)
    assert [(w.engine, w.dp_rank) for w in r.workers] == [(ENGINE, 0)]


# ------------------------------------------------------------------ R-Q-3


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_3_credits_configurable(ver):
    idx, t = issue_example(ver, credits={"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.0})
    assert wm(idx, t).score == pytest.approx(40 + 24 * 0.5)
    idx, t = issue_example(ver, credits={"GPU": 2.0})  # a tier without a credit scores 0
    w = wm(idx, t)
    assert w.score == pytest.approx(80.0) and w.total_blocks == 64


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_3_stale_discount(ver):
    idx, t = issue_example(ver, stale_factor=0.25)
    idx.mark_stale(ENGINE, 0, "gap")
    assert wm(idx, t).score == pytest.approx(58.0 * 0.25)
    idx.clear_stale(ENGINE, 0)
    assert wm(idx, t).score == pytest.approx(58.0)
    # Default factor 0.5: a stale worker ranks below a fresh one with a lower raw score.
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, [store(t, 4, 0, 4)], engine="a")
    apply(idx, [store(t, 4, 0, 3)], engine="b")
    idx.mark_stale("a", 0, "gap")
    r = idx.match(t)
    assert [w.engine for w in r.workers] == ["b", "a"]
    assert r.worker("a", 0).score == pytest.approx(2.0)
    assert r.best.engine == "b"


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_3_ties_broken_by_engine_then_rank(ver):
    idx = PrefixIndex()
    t = toks(1, 3, 4)
    for engine in ("zeta", "alpha", "mid"):
        for rank in (2, 0, 1):
            apply(idx, [store(t, 4, 0, 3)], ver, engine=engine, dp_rank=rank)
    r = idx.match(t)
    order = [(w.engine, w.dp_rank) for w in r.workers]
    assert order == [(e, k) for e in ("alpha", "mid", "zeta") for k in (0, 1, 2)]
    assert (r.best.engine, r.best.dp_rank) == ("alpha", 0)
    assert r.to_dict()["best"] == {"engine": "alpha", "dp_rank": 0, "score": pytest.approx(3.0)}


def test_R_Q_3_ranking_holds_as_workers_join_leave_and_go_stale():
    """Answers come out in ranking order without a full sort when they can (workers kept
    in (engine, rank) order per model): that order must follow workers that join after
    a query, leave, or go stale, at several depths at once."""
    idx = PrefixIndex()
    t = toks(1, 4, 4)

    def ranked():
        r = idx.match(t)
        assert list(r.workers) == sorted(r.workers)  # tuple order is the ranking
        return [(w.engine, w.dp_rank, w.total_blocks) for w in r.workers]

    for i, (engine, n) in enumerate([("w9", 4), ("w10", 4), ("w1", 2), ("w5", 4), ("w3", 2)]):
        apply(idx, [store(t, 4, 0, n)], engine=engine, dp_rank=i % 2)
    assert ranked() == [("w10", 1, 4), ("w5", 1, 4), ("w9", 0, 4), ("w1", 0, 2), ("w3", 0, 2)]
    apply(idx, [store(t, 4, 0, 4)], engine="w0", dp_rank=3)  # joins after a query
    assert ranked()[0] == ("w0", 3, 4)
    assert idx.drop_worker("w5", 1)
    # Stale: 4 blocks at half credit score 2.0, as the 2-block workers do; more blocks
    # break the tie, so it drops behind w9 and stays ahead of w1 and w3.
    idx.mark_stale("w10", 1, reason="replay_timeout")
    assert ranked() == [("w0", 3, 4), ("w9", 0, 4), ("w10", 1, 4), ("w1", 0, 2), ("w3", 0, 2)]
    r = idx.match(t)
    assert [w.score for w in r.workers] == sorted((w.score for w in r.workers), reverse=True)
    assert r.worker("w10", 1).stale and r.worker("w10", 1).score == pytest.approx(2.0)


@pytest.mark.parametrize("vdir", sorted(golden.VERSIONS))
def test_R_Q_3_golden_dp_rank_tie(vdir):
    idx = PrefixIndex()
    idx.apply("e", golden.payload(vdir, "dp_rank_1"))  # the batch says rank 1
    t = list(range(40000, 40032))
    hs = [9114870688517213765, 13981731434992632520]
    apply(idx, [store(t, 16, 0, 2, hashes=hs)], golden.VERSIONS[vdir], engine="e", dp_rank=0)
    r = idx.match(t)
    assert [(w.engine, w.dp_rank) for w in r.workers] == [("e", 0), ("e", 1)]
    assert r.worker("e", 1).tiers == {"GPU": 2}
    assert (r.best.engine, r.best.dp_rank) == ("e", 0)


def test_R_Q_3_best_is_none_when_nothing_matches():
    idx, t = issue_example()
    r = idx.match(toks(999_000, 4, 16))
    assert r.best is None and r.workers == []
    assert r.to_dict()["best"] is None and r.to_dict()["workers"] == []
    assert idx.match([]).best is None


def test_R_Q_3_workers_sorted_best_first():
    idx = PrefixIndex()
    t = toks(1, 4, 4)
    apply(idx, chunks(t, 4, 2), engine="a")  # CPU 4: 3.0
    apply(idx, [store(t, 4, 0, 4)], engine="z")  # GPU 4: 4.0
    apply(idx, [store(t, 4, 0, 1)], engine="m")  # GPU 1: 1.0
    apply(idx, [store(t, 4, 0, 2)] + chunks(t, 4, 2), engine="b")  # GPU 2 + CPU 2: 3.5
    r = idx.match(t)
    assert [w.engine for w in r.workers] == ["z", "b", "a", "m"]
    scores = [w.score for w in r.workers]
    assert scores == sorted(scores, reverse=True)
    assert scores == pytest.approx([4.0, 3.5, 3.0, 1.0])
    assert r.best.engine == "z"


# ------------------------------------------------------------------ R-Q-4


@pytest.mark.parametrize("ver", WIRE)
def test_R_Q_4_match_is_read_only(ver):
    clock = FakeClock()
    idx = PrefixIndex(clock=clock, max_nodes=1000)
    t = toks(10, 64, 16)
    apply(idx, [store(t, 16, 0, 40)] + chunks(t, 16, 8), ver, seq=0)
    apply(idx, [store(t, 16, 40, 48, hashes=ehashes(t, 16, ns="x"))], ver, seq=1)  # an orphan
    apply(idx, [store(t, 16, 0, 4)], ver, engine="e2", seq=0)
    stats_before = idx.stats()
    workers_before = idx.workers()
    first = idx.match(t).to_dict()
    for q in (t, t[:100], toks(5, 9, 16), t[:16 * 20] + [7] * 64, []):
        idx.match(q)
        idx.match(q, lora_name="x", cache_salt="s")
        idx.match_by_keys(block_keys(q, 16))
    assert idx.stats() == stats_before
    assert idx.workers() == workers_before
    assert idx.match(t).to_dict() == first


# ------------------------------------------------------------------ R-Q-5


def test_R_Q_5_no_half_applied_batch_visible():
    """Each batch stores (or removes) a chain as two events: blocks 0-1, then blocks
    2-3 under block 1, so a half-applied batch shows 2 blocks (and a node count that is
    not a multiple of 4). One writer applies the batches in a fixed schedule while two
    readers query; around every call the writer counts batches started and finished,
    and around every query a reader reads ``finished`` before and ``started`` after.

    The reference is the schedule itself (written here, not derived from the index):
    after ``n`` whole batches, prompt ``i`` holds 4 blocks when ``i < n % 8 <= i + 4``
    and 0 otherwise. A query that ran between ``finished == f`` and ``started == s``
    may see the state after any whole batch ``f .. s``, and nothing else. The test
    also proves that queries really ran while batches were being applied: many
    queries overlapped an apply call, and some saw the effect of a batch that was
    still in progress when they started."""
    idx = PrefixIndex()
    idx.register_worker(ENGINE, 0)  # the model is known before a reader's first query
    nprompts = 4
    prompts = [toks(10_000 * (i + 1), 4, 4) for i in range(nprompts)]
    store_batches = [encode_batch([store(p, 4, 0, 2), store(p, 4, 2, 4)]) for p in prompts]
    remove_batches = [
        encode_batch([Removed(block_hashes=ehashes(p, 4)[2:4][::-1], medium="GPU"),
                      Removed(block_hashes=ehashes(p, 4)[0:2][::-1], medium="GPU")])
        for p in prompts
    ]
    schedule = store_batches + remove_batches  # one round: store 0..3, then remove 0..3
    period = len(schedule)

    def blocks_after(i: int, n: int) -> int:
        return 4 if i < n % period <= i + nprompts else 0

    def nodes_after(n: int) -> int:
        return 4 * sum(blocks_after(i, n) == 4 for i in range(nprompts))

    rounds = 1500
    progress = [0, 0]  # [batches started, batches finished], written by the writer only
    stop = threading.Event()
    mid_seen: list = []  # appended by a reader on a query that saw a batch land mid-query
    seen: list = []  # (prompt index or "nodes", answer, finished before, started after)
    errors: list = []

    def writer():
        try:
            done = 0
            # At least ``rounds`` rounds; more (bounded) until a reader has seen a batch
            # land while its query was waiting, which a loaded machine can delay.
            while done < rounds or (not mid_seen and done < 10 * rounds):
                done += 1
                for payload in schedule:
                    progress[0] += 1
                    idx.apply(ENGINE, payload)
                    progress[1] += 1
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    def reader():
        try:
            while not stop.is_set():
                for i, p in enumerate(prompts):
                    f0 = progress[1]
                    w = idx.match(p).worker(ENGINE, 0)
                    s1 = progress[0]
                    got = 0 if w is None else w.total_blocks
                    seen.append((i, got, f0, s1))
                    if s1 > f0 and got != blocks_after(i, f0):
                        mid_seen.append(None)
                f0 = progress[1]
                n = idx.stats()["nodes"]
                s1 = progress[0]
                seen.append(("nodes", n, f0, s1))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not any(th.is_alive() for th in threads), "a thread did not finish"
    assert not errors, errors
    assert progress[0] == progress[1] and progress[0] % period == 0 and progress[0] >= rounds * period
    assert seen, "the readers never ran"

    bad = []
    overlapped = 0  # queries whose interval met an apply call
    mid_batch = 0  # queries that saw a batch which had not finished when they started
    for who, got, f0, s1 in seen:
        want = nodes_after if who == "nodes" else (lambda n, i=who: blocks_after(i, n))
        allowed = {want(n) for n in range(f0, s1 + 1)}
        if got not in allowed:
            bad.append((who, got, f0, s1, sorted(allowed)))
        if s1 > f0:
            overlapped += 1
            if got != want(f0):
                mid_batch += 1
    assert not bad, f"{len(bad)} answers no whole-batch boundary allows, e.g. {bad[:5]}"
    assert overlapped > 0 and mid_batch > 0, (overlapped, mid_batch, len(seen))
    answers = [got for who, got, _, _ in seen if who != "nodes"]
    assert 2 not in answers and {0, 4} <= set(answers)
    assert idx.stats()["nodes"] == 0


def test_R_Q_2_encoded_body_is_the_same_json():
    """body() (what the service encodes) gives exactly the JSON of to_dict()."""
    import msgspec

    from evkit import apply, chunks, store, toks

    idx = PrefixIndex()
    t = toks(10, 8, 16)
    enc = msgspec.json.encode
    for e in ("a", "b", "c"):
        apply(idx, [store(t, 16, 0, 6), *chunks(t, 16, 4, medium="CPU")], engine=e)
    apply(idx, [store(t, 16, 0, 2)], engine="d")
    idx.mark_stale("d", reason="replay_timeout")
    res = idx.match(t)
    assert len(res.workers) == 4
    assert enc(res.body()) == enc(res.to_dict())
    body = res.body()
    assert body.workers[0].tiers is body.workers[1].tiers  # a, b and c share one answer
    miss = idx.match(toks(99, 2, 16))
    assert miss.best is None and enc(miss.body()) == enc(miss.to_dict())


def test_R_Q_1_model_may_be_omitted_when_one_model_has_workers():
    from indexer.query.index import ModelRequiredError

    idx = PrefixIndex()
    t = toks(10, 2, 16)
    apply(idx, [store(t, 16, 0, 2)], engine="a", model="m1")
    idx.register_worker("b", 0, model="other")
    with pytest.raises(ModelRequiredError, match="several models"):
        idx.match(t, model=None)
    idx.drop_worker("b")  # "other" has no worker left: the query is no longer ambiguous
    assert idx.match(t, model=None).best.engine == "a"
    with pytest.raises(KeyError, match="unknown model"):
        idx.match(t, model="nope")


def test_R_Q_1_an_omitted_model_means_default_when_another_model_joins():
    idx = PrefixIndex()
    t = toks(10, 2, 16)
    apply(idx, [store(t, 16, 0, 2)], engine="a")  # model "default"
    apply(idx, [store(t, 16, 0, 1)], engine="b", model="other")
    res = idx.match(t, model=None)
    assert res.model == "default" and [w.engine for w in res.workers] == ["a"]
    assert idx.match(t, model="other").best.engine == "b"
    idx.drop_worker("a")  # the default pool is empty: "other" is the one model left
    assert idx.match(t, model=None).model == "other"


def test_R_Q_1_match_plain_answers_as_match_or_declines():
    """The one-frame door: the same answer as match for a GPU-only, one-group model (short
    and long prompts, partial blocks), None where the model has another shape (CPU tier,
    predictions), KeyError for an unknown model, as match."""
    from indexer.wire.keys import tokens_to_bytes

    idx = PrefixIndex(clock=FakeClock())
    t = toks(3, 200, 16)
    apply(idx, [store(t, 16, 0, 150)])
    for n in (0, 15, 16, 16 * 64, 16 * 64 + 7, 16 * 65, 16 * 150, 16 * 200):
        got = idx.match_plain(tokens_to_bytes(t[:n]), "default")
        assert got is not None and got == idx.match(t[:n]), n
    assert idx.match_plain(tokens_to_bytes(t), "default").worker(ENGINE, 0).tiers == {"GPU": 150}
    with pytest.raises(KeyError):
        idx.match_plain(tokens_to_bytes(t), "other")
    idx.route(t[:16 * 160], model="default")  # a recorded route: predictions for this model
    assert idx.match_plain(tokens_to_bytes(t), "default") is None
    tiered, t2 = issue_example()
    assert tiered.match_plain(tokens_to_bytes(t2), "default") is None
