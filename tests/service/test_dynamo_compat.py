"""NVIDIA Dynamo's standalone indexer routes, checked against exchanges recorded from the
real service (``tests/data/dynamo/recorded.json``: ai-dynamo-runtime 1.6.1, fed by the
same vLLM-compatible publisher). The test replays the recorded scenario against a real
``kv-indexer serve`` and compares status codes and bodies exactly, except where noted
(ports differ; JSON map order is free in both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from indexer.producer.publisher import VllmPublisher
from indexer.producer.events import Stored
from svc import Client, Server, bind_ranks, wait_for, wait_subscribed

REC = json.loads((Path(__file__).resolve().parents[1] / "data" / "dynamo" / "recorded.json").read_text())["exchanges"]
BS = 16
TOK = list(range(1000, 1000 + BS * 8))
B = [TOK[i * BS : (i + 1) * BS] for i in range(8)]


def flat(blocks):
    return [t for b in blocks for t in b]


def signed_local_hash(tokens) -> int:
    import struct

    h = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)
    return h - (1 << 64) if h >= 1 << 63 else h


@pytest.fixture(scope="module")
def dyn():
    s = Server()
    try:
        yield s
    finally:
        s.stop()


def rank_pair(pubs) -> tuple[VllmPublisher, VllmPublisher]:
    """Publishers of DP ranks 0 and 1 of one engine (ports p and p+1), made by the
    ``pubs`` fixture: rank 0 binds an ephemeral port, rank 1 the next one (retried
    when that one is taken, see ``svc.bind_ranks``)."""
    p0, p1 = bind_ranks(lambda ep, rep, **kw: pubs(ep, replay_endpoint=rep, **kw), 2, replay=False)
    return p0, p1


def replay(api: Client, name: str, **override):
    """Send the recorded request (with ``override`` fields) and return (status, body)."""
    ex = REC[name]
    if ex["method"] == "GET":
        return api.get(ex["path"])
    return api.post(ex["path"], {**ex["request"], **override})


def same(api: Client, name: str, **override) -> None:
    st, body = replay(api, name, **override)
    ex = REC[name]
    assert (st, body) == (ex["status"], ex["response"]), name


def test_dynamo_routes_match_the_recorded_service(dyn, pubs):
    api = dyn.client
    st, body = api.get("/health")
    assert (st, body) == (200, "")
    same(api, "query_before_any_register")  # 404 {"error": "no indexer for model=m ..."}

    p1, p1b = rank_pair(pubs)
    p2 = pubs(dp_rank=1)
    same(api, "register_w1", endpoint=p1.live_endpoint)
    same(api, "register_same_again_same_endpoint", endpoint=p1.live_endpoint)
    same(api, "register_same_again_different_endpoint")
    same(api, "register_same_instance_other_model")
    same(api, "register_conflicting_block_size")
    # Worker 2 only on DP rank 1, with its own endpoint (no port offset, as in Dynamo).
    same(api, "register_w2_dp_rank_1", endpoint=p2.live_endpoint)

    st, workers = api.get("/workers")
    rec = REC["workers_2_workers_one_dp1"]["response"]
    assert st == 200 and len(workers) == len(rec)
    for ours, theirs in zip(workers, rec):
        assert set(ours) == set(theirs)
        assert {k: ours[k] for k in ("instance_id", "source", "model_name", "routing_group", "block_size")} == \
            {k: theirs[k] for k in ("instance_id", "source", "model_name", "routing_group", "block_size")}
        assert set(ours["endpoints"]) == set(theirs["endpoints"]) == set(ours["listeners"])
    assert workers[1]["endpoints"] == {"1": p2.live_endpoint}
    same(api, "workers_filter_model_unknown")
    wait_for(lambda: all(w["status"] == "active" for w in api.get("/workers")[1]), what="listeners active")
    wait_subscribed(api, p1, "1", 0)
    wait_subscribed(api, p2, "2", 1)

    # The recorded event sequence, then the recorded answers.
    p1.publish([Stored([101, 102], None, flat(B[0:2]), 16, medium=None)])
    p1.publish([Stored([103, 104], 102, flat(B[2:4]), 16, medium="GPU")])
    wait_for(lambda: _gpu(api, "1") == 64, what="w1 GPU blocks")
    same(api, "query_w1_gpu_4_blocks_full_8_block_prompt")
    p1.publish([Stored([105, 106], 104, flat(B[4:6]), 16, medium="CPU")])
    wait_for(lambda: _instances(api).get("1", {}).get("cpu") == 96, what="w1 CPU blocks")
    same(api, "query_w1_gpu4_cpu2")
    p2.publish([Stored([201, 202], None, flat(B[0:2]), 16, medium="GPU")])
    wait_for(lambda: "2" in _instances(api), what="w2 blocks")
    same(api, "query_w1_gpu4_cpu2__w2dp1_gpu2")

    same(api, "register_w1_dp_rank_1", endpoint=p1b.live_endpoint)
    same(api, "register_w1_dp_rank_1_again", endpoint=p1b.live_endpoint)
    wait_subscribed(api, p1b, "1", 1)
    p1b.publish([Stored([151], None, flat(B[0:1]), 16, medium="GPU")])
    wait_for(lambda: _instances(api).get("1", {}).get("dp", {}).get("1") == 16, what="w1 dp1 block")
    same(api, "query_plus_w1dp1_gpu1")

    for name in ("query_15_tokens_less_than_block", "query_empty_token_ids", "query_mismatch_first_block",
                 "query_unknown_model", "query_routing_group_unknown", "query_by_hash_empty",
                 "query_by_hash_unknown_model", "query_by_hash_with_cache_salt"):
        same(api, name)
    # By hash: Dynamo's local hashes as signed i64 give the same answer as the tokens.
    st, by_hash = api.post("/query_by_hash", {"block_hashes": [signed_local_hash(b) for b in B], "model_name": "m"})
    assert (st, by_hash) == (200, api.post("/query", {"token_ids": TOK, "model_name": "m"})[1])

    for name in ("unregister_unknown_instance", "unregister_wrong_model", "unregister_wrong_routing_group",
                 "unregister_unknown_dp_rank_with_group"):
        same(api, name)
    # dp_rank with routing_group: only that listener goes.
    same(api, "unregister_w1_dp_rank_1_with_routing_group")
    st, workers = api.get("/workers?model_name=m")
    assert {w["instance_id"]: set(w["endpoints"]) for w in workers} == {1: {"0"}, 2: {"1"}}
    assert _instances(api)["1"]["dp"] == {"0": 64}
    # dp_rank without routing_group: the whole instance goes (Dynamo's rule).
    same(api, "unregister_w2_dp_rank_1_without_routing_group")
    st, workers = api.get("/workers?model_name=m")
    assert [w["instance_id"] for w in workers] == [1]
    assert "2" not in _instances(api)


def test_dynamo_errors_are_json_and_clear(dyn):
    api = dyn.client
    # Shape errors: Dynamo answers 422 in plain text; we answer 422 with {"error": ...}.
    for name, doc in [
        ("missing model_name", {"token_ids": [1]}),
        ("negative token", {"token_ids": [-1], "model_name": "m"}),
        ("token above u32", {"token_ids": [2**32], "model_name": "m"}),
        ("token_ids not a list", {"token_ids": 5, "model_name": "m"}),
    ]:
        st, body = api.post("/query", doc)
        assert st == 422 and body["error"], name
    st, body = api.call("POST", "/register", b"not json")
    assert st == 400 and "JSON" in body["error"]
    st, body = api.post("/register", {"instance_id": 77, "endpoint": "garbage", "model_name": "v", "block_size": 16})
    assert st == 400 and "garbage" in body["error"]
    st, body = api.post("/query_by_hash", {"block_hashes": [2**64], "model_name": "m"})
    assert st == 422
    st, body = api.post("/unregister", {"instance_id": "2", "model_name": "m"})
    assert st == 422


def _instances(api: Client) -> dict:
    st, body = api.post("/query", {"token_ids": TOK, "model_name": "m"})
    assert st == 200, body
    return body["instances"]


def _gpu(api: Client, inst: str) -> int:
    return _instances(api).get(inst, {}).get("gpu", 0)



