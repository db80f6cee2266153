"""The OpenAI gateway of a real ``kv-indexer serve`` (docs/gateway.md), with the official
``openai`` client: requests land where ``/v1/route`` would send them, answers and streams
pass through (the usage chunk it added is not shown), in-flight load follows the stream,
and the failure modes: a 5xx before the first byte and a refused connection retried once
on the next worker, a stalled stream cut by the idle timeout, a full worker set answered
429, a client that leaves aborts the upstream, bad bodies get vLLM-shaped errors.

The engines' HTTP side is :class:`oaipeer.OpenAIPeer` (scripted: a real vLLM cannot be made
to fail on demand); the real engines' test is ``tests/e2e/real/test_gateway_real.py``."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from oaipeer import OpenAIPeer
from svc import PortHold, Server, sample, wait_for

PROMPT = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture
def peers():
    made = [OpenAIPeer("e0"), OpenAIPeer("e1")]
    yield made
    for p in made:
        p.stop()


def gateway(peers, holds, *extra: str, refused: PortHold | None = None) -> Server:
    args = []
    for i, (p, h) in enumerate(zip(peers, holds)):
        url = f"http://127.0.0.1:{refused.port}" if refused is not None and i == 0 else p.url
        args += ["--engine", f"e{i}={h.endpoint},api_url={url}"]
    return Server(*args, "--ready-fraction", "0", *extra)


@pytest.fixture
def client():
    """``client(server)``: the official OpenAI client pointed at the gateway (closed after the test)."""
    made: list[openai.OpenAI] = []

    def make(s: Server) -> openai.OpenAI:
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused", max_retries=0, timeout=30)
        made.append(oc)
        return oc

    yield make
    for oc in made:
        oc.close()


def test_requests_land_where_route_sends_them_and_answers_pass_through(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = gateway(peers, [h0, h1])
        try:
            oc = client(s)
            for k in range(4):
                prompt = [k * 1000 + t for t in PROMPT]
                st, dry = s.client.post("/v1/route", {"token_ids": prompt, "record": False})
                assert st == 200
                raw = oc.completions.with_raw_response.create(model="default", prompt=prompt, max_tokens=3)
                out = raw.parse()
                assert raw.headers["x-kvi-worker"] == dry["worker"]
                engine = dry["engine"]
                assert out.choices[0].text == f"{engine} says hi"
                # The original body reached that engine, untouched.
                assert peers[int(engine[1:])].seen[-1]["body"]["prompt"] == prompt
                assert raw.headers["x-kvi-predicted-cached-tokens"] == "0"
            # Decode load ended with each answer: nothing in flight.
            assert all(w["in_flight"]["requests"] == 0 for w in s.client.get("/v1/workers")[1])
            assert len(peers[0].seen) + len(peers[1].seen) == 4
            models = oc.models.list()
            assert [m.id for m in models.data] == ["default"]
        finally:
            s.stop()


def test_a_stream_passes_through_and_the_added_usage_chunk_is_not_shown(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = gateway(peers, [h0, h1])
        try:
            oc = client(s)
            chunks = list(oc.completions.create(model="default", prompt=PROMPT, max_tokens=3, stream=True,
                                                extra_body={"prompt_cached": 32}))
            assert "".join(c.choices[0].text for c in chunks).endswith(" says hi")
            assert all(c.usage is None for c in chunks)  # not asked: not shown
            up = next(p for p in peers if p.seen)
            assert up.seen[-1]["body"]["stream_options"] == {"include_usage": True}  # asked upstream
            chunks = list(oc.completions.create(model="default", prompt=PROMPT, max_tokens=3, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"prompt_cached": 32}))
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
            # The gateway books a stream's usage once it ended on its side: probe for it.
            wait_for(lambda: sum(v["reports"] for v in s.client.get("/v1/gateway")[1]["workers"].values()) == 2, 5,
                     what="both streams booked")
            w = s.client.get("/v1/gateway")[1]["workers"]
            assert sum(v["delivered"] for v in w.values()) == 64
            m = s.client.metrics()
            assert sum(sample(m, "kvi_gateway_delivered_cached_tokens_total", worker=k) for k in w) == 64
        finally:
            s.stop()


def test_a_5xx_before_the_first_byte_is_retried_once_on_the_next_worker(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = gateway(peers, [h0, h1])
        try:
            oc = client(s)
            st, dry = s.client.post("/v1/route", {"token_ids": PROMPT, "record": False})
            first = int(dry["engine"][1:])
            other = 1 - first
            peers[first].force = "fail500"
            raw = oc.completions.with_raw_response.create(model="default", prompt=PROMPT, max_tokens=3)
            assert raw.headers["x-kvi-worker"] == f"e{other}/0"
            assert raw.parse().choices[0].text == f"e{other} says hi"
            assert len(peers[first].seen) == 1 and len(peers[other].seen) == 1
            assert sample(s.client.metrics(), "kvi_gateway_retries_total", reason="engine_5xx") == 1
            # Both failing: the second engine's 500 is passed through as it came (no third try).
            peers[other].force = "fail500"
            with pytest.raises(openai.InternalServerError) as ei:
                oc.completions.create(model="default", prompt=[5] + PROMPT, max_tokens=3)
            assert ei.value.body["message"] == "engine dead"  # type: ignore[index]
            assert len(peers[first].seen) + len(peers[other].seen) == 4
            assert all(w["in_flight"]["requests"] == 0 for w in s.client.get("/v1/workers")[1])
        finally:
            s.stop()


def test_a_refused_connection_is_retried_on_the_next_worker(peers, client):
    with PortHold() as h0, PortHold() as h1, PortHold() as dead:
        s = gateway(peers, [h0, h1], refused=dead)  # e0's api_url: nothing listens there
        try:
            oc = client(s)
            for k in range(3):
                raw = oc.completions.with_raw_response.create(model="default", prompt=[k] + PROMPT, max_tokens=3)
                assert raw.headers["x-kvi-worker"] == "e1/0" and raw.parse().choices[0].text == "e1 says hi"
            m = s.client.metrics()
            # Tried on e0 whenever the index picked it (it ranks first when load is equal).
            assert sample(m, "kvi_gateway_retries_total", reason="connect") >= 1
            assert sample(m, "kvi_gateway_requests_total", worker="e0/0", outcome="upstream_failed") == \
                sample(m, "kvi_gateway_retries_total", reason="connect")
            assert all(w["in_flight"]["requests"] == 0 for w in s.client.get("/v1/workers")[1])
        finally:
            s.stop()


def test_bad_bodies_get_vllm_shaped_errors(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = gateway(peers, [h0, h1])
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{s.port}") as hc:
                for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": 5}', 400),
                                     (b'{"prompt": "text", "model": "default"}', 404),
                                     (b'{"messages": "hi"}', 400)):
                    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
                    r = hc.post(path, content=body, headers={"content-type": "application/json"})
                    assert r.status_code == status, (body, r.text)
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
            assert not peers[0].seen and not peers[1].seen
        finally:
            s.stop()


def test_full_workers_get_429_and_a_stalled_stream_is_cut_by_the_idle_timeout(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = Server("--engine", f"e0={h0.endpoint},api_url={peers[0].url}", "--engine",
                   f"e1={h1.endpoint},api_url={peers[1].url}", "--ready-fraction", "0",
                   env={"KVI_GATEWAY_MAX_PER_WORKER": "1", "KVI_GATEWAY_IDLE_TIMEOUT_S": "1"})
        try:
            oc = client(s)
            results: list = []

            def hold(k: int) -> None:
                results.append(oc.completions.create(model="default", prompt=[k] + PROMPT, max_tokens=3, user="hold"))

            threads = [threading.Thread(target=hold, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            wait_for(lambda: peers[0].holding + peers[1].holding == 2, 10, what="both engines holding one")
            assert peers[0].holding == 1 and peers[1].holding == 1  # the second went to the one with room
            with pytest.raises(openai.RateLimitError) as ei:
                oc.completions.create(model="default", prompt=PROMPT, max_tokens=3)
            assert ei.value.response.headers["retry-after"] == "1"
            for p in peers:
                p.release()
            for t in threads:
                t.join(30)
            assert len(results) == 2
            # A stream that stalls after its first chunk: cut after 1 s of silence.
            chunks = list(oc.completions.create(model="default", prompt=[7] + PROMPT, max_tokens=3, stream=True,
                                                user="stall"))
            assert len(chunks) == 1
            m = s.client.metrics()
            assert sum(sample(m, "kvi_gateway_requests_total", worker=w, outcome="timeout")
                       for w in ("e0/0", "e1/0")) == 1
            assert sample(m, "kvi_gateway_rejected_total", reason="saturated") == 1
        finally:
            s.stop()


def test_a_client_that_leaves_aborts_the_upstream_and_releases_its_load(peers, client):
    with PortHold() as h0, PortHold() as h1:
        s = gateway(peers, [h0, h1])
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{s.port}", timeout=10) as hc:
                body = json.dumps({"model": "default", "prompt": PROMPT, "max_tokens": 100, "stream": True,
                                   "user": "stall"})
                with hc.stream("POST", "/v1/completions", content=body,
                               headers={"content-type": "application/json"}) as r:
                    assert r.status_code == 200
                    worker = r.headers["x-kvi-worker"]
                    # The iterator is kept: dropped, it would close the stream (and the
                    # connection) at once, and the request would end before it is looked at.
                    chunks = r.iter_raw()
                    first = next(chunks)
                    assert b"data: " in first
                    wait_for(lambda: any(w["in_flight"]["requests"] for w in s.client.get("/v1/workers")[1]), 5,
                             what="the request in flight")
            # The client closed the connection mid-stream.
            wait_for(lambda: peers[int(worker[1])].aborted == 1, 10, what="the engine to see the abort")
            wait_for(lambda: all(w["in_flight"]["requests"] == 0 for w in s.client.get("/v1/workers")[1]), 10,
                     what="the load released")
            assert sample(s.client.metrics(), "kvi_gateway_requests_total", worker=worker,
                          outcome="client_aborted") == 1
        finally:
            s.stop()
