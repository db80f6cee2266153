"""Routing under real timing over HTTP, on a real ``kv-indexer serve`` and real vLLM-wire publishers: a route
records its decision (R-Q-6, R-Q-7); the prediction shows apart in /v1/match and ends when
the engine announces the blocks; in-flight load in /v1/workers and /metrics; the done
route; a dry run; bad input."""

from __future__ import annotations

import pytest

from evkit import store, toks
from svc import Server, sample, wait_for, wait_subscribed

BS = 16


@pytest.fixture(scope="module")
def server():
    s = Server("--prefill-ttl-s", "20", "--decode-ttl-s", "60")
    try:
        yield s
    finally:
        s.stop()


def worker(api, engine):
    return next(w for w in api.get("/v1/workers")[1] if w["engine"] == engine)


def test_R_Q_6_R_Q_7_a_route_is_recorded_until_the_engine_announces_it(server, pubs):
    api = server.client
    pa, pb = pubs(), pubs()
    for name, p in (("ra", pa), ("rb", pb)):
        assert api.post("/v1/engines", {"id": name, "endpoint": p.live_endpoint, "model": "rt"})[0] == 201
        wait_subscribed(api, p, name)
    # The engines announced something of another prompt: the block size is known.
    pa.publish([store(toks(1, 1, BS), BS, 0, 1)])
    wait_for(lambda: worker(api, "ra")["last_seq"] == 0, what="ra's first batch")
    m0 = api.metrics()

    prompt = toks(500, 6, BS)
    st, r = api.post("/v1/route", {"token_ids": prompt, "model": "rt", "max_tokens": 40})
    assert st == 200 and r["request_id"]
    chosen = r["engine"]
    other = "rb" if chosen == "ra" else "ra"
    top = r["ranked"][0]
    assert (top["cached_blocks"], top["predicted_blocks"]) == (0, 0)

    # Apart from what was announced: /v1/match lists it under "predicted" only.
    st, m = api.post("/v1/match", {"token_ids": prompt, "model": "rt"})
    assert st == 200 and m["workers"] == [] and m["best"] is None
    assert m["predicted"] == [{"engine": chosen, "dp_rank": 0, "predicted_blocks": 6, "score": 6.0}]
    w = worker(api, chosen)
    decode = -(-(6 * BS + 40) // BS)
    assert w["in_flight"] == {"requests": 1, "prefill_tokens": 6 * BS, "decode_blocks": decode}
    assert worker(api, other)["in_flight"] == {"requests": 0, "prefill_tokens": 0, "decode_blocks": 0}
    mm = api.metrics()
    assert sample(mm, "kvi_worker_in_flight_prefill_tokens", engine=chosen, dp_rank="0") == 6 * BS
    assert sample(mm, "kvi_in_flight_requests") == 1

    # The same prompt again, as a dry run: on the chosen worker, its queue (6 blocks) and
    # nothing to compute (all predicted) plus the first request's decode blocks; 6 blocks
    # to compute on the other. The other wins; the dry run records nothing.
    st, r2 = api.post("/v1/route", {"token_ids": prompt, "model": "rt", "record": False})
    assert r2["request_id"] is None and r2["engine"] == other
    mine = next(x for x in r2["ranked"] if x["engine"] == chosen)
    assert (mine["predicted_blocks"], mine["cost"]) == (6, 6 + 6 - 6 + decode)
    assert mine["load"] == {"prefill_tokens": 6 * BS, "decode_blocks": decode, "source": "index"}
    assert worker(api, chosen)["in_flight"]["requests"] == 1
    # Without the decode estimate (the caller's own load for it), the (predicted) cache
    # wins the tie of 6 against 6.
    st, r3 = api.post("/v1/route", {"token_ids": prompt, "model": "rt", "record": False,
                                    "load": {chosen: {"active_prefill_tokens": 6 * BS}}})
    assert r3["engine"] == chosen and r3["ranked"][0]["load"]["source"] == "caller"

    # The engine announces the prompt (its prefill ended): prediction and prefill load end.
    pub = pa if chosen == "ra" else pb
    pub.publish([store(prompt, BS, 0, 6)])
    wait_for(lambda: worker(api, chosen)["in_flight"]["prefill_tokens"] == 0, what="the prefill to end")
    st, m = api.post("/v1/match", {"token_ids": prompt, "model": "rt"})
    assert m["predicted"] == [] and m["best"]["engine"] == chosen and m["workers"][0]["total_blocks"] == 6
    assert worker(api, chosen)["in_flight"] == {"requests": 1, "prefill_tokens": 0, "decode_blocks": decode}

    # Done: the decode load goes; a second done releases nothing; an id never issued is a 404.
    st, body = api.post(f"/v1/route/{r['request_id']}/done", {})
    assert (st, body) == (200, {"request_id": r["request_id"], "released": True})
    assert worker(api, chosen)["in_flight"] == {"requests": 0, "prefill_tokens": 0, "decode_blocks": 0}
    st, body = api.post(f"/v1/route/{r['request_id']}/done", {})
    assert (st, body) == (200, {"request_id": r["request_id"], "released": False})  # nothing left
    st, body = api.post("/v1/route/nope/done", {})
    assert st == 404 and "nope" in body["detail"]
    m1 = api.metrics()
    for outcome, n in (("recorded", 1), ("announced", 1), ("done", 1)):
        assert sample(m1, "kvi_route_records_total", outcome=outcome) - \
            sample(m0, "kvi_route_records_total", outcome=outcome) == n, outcome
    for e in ("ra", "rb"):
        api.delete(f"/v1/engines/{e}")


@pytest.mark.parametrize("body,what", [
    ({"token_ids": [1, 2], "max_tokens": -1}, "max_tokens"),
    ({"token_ids": [1, 2], "max_tokens": 1.5}, "max_tokens"),
    ({"token_ids": [1, 2], "record": "yes"}, "record"),
])
def test_R_BAD_1_bad_route_fields_get_422(server, body, what):
    st, res = server.client.post("/v1/route", body)
    assert st == 422 and what in res["detail"]


def test_R_BAD_1_a_request_id_too_long_gets_a_4xx(server):
    st, _ = server.client.post("/v1/route/" + "x" * 65 + "/done", {})
    assert st == 422


def test_R_BAD_1_a_ttl_at_or_below_zero_stops_the_service_with_a_message():
    import os
    import subprocess
    import sys

    from svc import ROOT

    for flag in ("--prefill-ttl-s", "--decode-ttl-s"):
        r = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--check", flag, "0"], cwd=ROOT,
                           env=dict(os.environ), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and flag[2:].replace("-", "_") in r.stderr and "> 0" in r.stderr
