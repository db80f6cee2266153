"""The gateway in front of real vLLM engines, with the official ``openai`` client.

Two engines of the tiny model behind ``kv-indexer serve`` whose engines name their
``api_url``: the gateway's completions (streamed and not, completions and chat) are the
engine's own, greedy; every request lands where a dry-run ``/v1/route`` says; the cached
tokens the gateway predicted (its ``x-kvi-predicted-cached-tokens`` header) equal what
the engine reports it reused (``usage.prompt_tokens_details.cached_tokens``, the truth);
and a killed engine costs no request that had not started streaming (refused, retried on
the other engine).
"""

from __future__ import annotations

import time

import openai
import pytest

from fleet import WORDS, Workload, held_blocks, start_engines
from svc import Server, sample, wait_until
from vllm_engine import VllmEngine

MODEL = "tiny"


@pytest.fixture(scope="module")
def fleet(engine_python, tiny_model, engine_logs):
    engines = [VllmEngine(engine_python, tiny_model, "e1", engine_logs),
               VllmEngine(engine_python, tiny_model, "e2", engine_logs)]
    try:
        start_engines(engines)
        yield {e.name: e for e in engines}
    finally:
        for e in engines:
            e.kill()


@pytest.fixture(scope="module")
def gw(fleet, tiny_model):
    engines = list(fleet.values())
    args = [a for e in engines for a in ("--engine", f"{e.config()},api_url={e.url}")]
    srv = Server(*args, "--tokenizer", f"{MODEL}={tiny_model}")
    wait_until(lambda: all(w.get("connected") for w in srv.client.get("/v1/workers")[1]), timeout=30,
               msg="index subscribed to every engine")
    srv.oc = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield srv
    srv.oc.close()
    srv.stop()


@pytest.fixture(scope="module")
def direct(fleet):
    made = {name: openai.OpenAI(base_url=f"{e.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for name, e in fleet.items()}
    yield made
    for oc in made.values():
        oc.close()


def _wait_held(srv: Server, body: dict, engine: str, n_tokens: int, bs: int = 32) -> None:
    deadline = time.monotonic() + 15
    while held_blocks(srv, MODEL, body, engine) < n_tokens // bs:
        assert time.monotonic() < deadline, f"index never showed the prompt on {engine}"
        time.sleep(0.01)


def test_the_gateway_answers_what_the_engine_answers_streamed_and_not(gw, direct):
    prompts = [list(range(20, 120)), " ".join(WORDS[:30]), [7] * 40 + list(range(200, 260))]
    for p in prompts:
        raw = gw.oc.completions.with_raw_response.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        ours = raw.parse()
        engine = raw.headers["x-kvi-worker"].split("/")[0]
        theirs = direct[engine].completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        assert ours.choices[0].text == theirs.choices[0].text and ours.usage.prompt_tokens == theirs.usage.prompt_tokens
        streamed = list(gw.oc.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == theirs.choices[0].text
        assert all(c.usage is None for c in streamed)  # the usage chunk the gateway asked for is not shown
    msgs = [{"role": "system", "content": " ".join(WORDS[5:25])}, {"role": "user", "content": "the quick fox"}]
    raw = gw.oc.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    engine = raw.headers["x-kvi-worker"].split("/")[0]
    theirs = direct[engine].chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert raw.parse().choices[0].message.content == theirs.choices[0].message.content
    streamed = list(gw.oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        theirs.choices[0].message.content
    assert streamed[-1].usage is not None and streamed[-1].usage.prompt_tokens == theirs.usage.prompt_tokens
    assert [m.id for m in gw.oc.models.list().data] == [MODEL]


def test_requests_land_where_route_says_and_delivered_cached_tokens_equal_the_prediction(gw):
    """Conversations that share system prompts and grow (token ids, text, chat), one at a
    time: each gateway request goes where a dry-run /v1/route said, and its predicted
    cached tokens equal the engine's own count for >= 99% of requests."""
    work = Workload(11, 32, 1024, {"tokens": 50, "prompt": 20, "messages": 30})
    n, exact, landed, reused = 100, 0, 0, 0
    misses = []
    for _ in range(n):
        kind, ix_body, _ = work.next()
        st, dry = gw.client.post("/v1/route", {"model": MODEL, "record": False, **ix_body})
        assert st == 200, dry
        if kind == "messages":
            raw = gw.oc.chat.completions.with_raw_response.create(model=MODEL, messages=ix_body["messages"],
                                                                  max_tokens=1, temperature=0)
        else:
            prompt = ix_body.get("token_ids") or ix_body["prompt"]
            raw = gw.oc.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        out = raw.parse()
        worker = raw.headers["x-kvi-worker"]
        landed += worker == dry["worker"]
        predicted = int(raw.headers["x-kvi-predicted-cached-tokens"])
        delivered = out.usage.prompt_tokens_details.cached_tokens
        reused += delivered
        if predicted == delivered:
            exact += 1
        else:
            misses.append((kind, worker, out.usage.prompt_tokens, predicted, delivered))
        _wait_held(gw, ix_body, worker.split("/")[0], out.usage.prompt_tokens)
    print(f"gateway real: {exact}/{n} exact, {landed}/{n} landed as routed, {reused} tokens reused; misses {misses}")
    assert landed == n
    assert exact >= 0.99 * n, misses
    assert reused > n * 32  # prefixes really were reused
    led = gw.client.get("/v1/gateway")[1]["workers"]
    assert sum(w["exact"] for w in led.values()) >= exact


def test_a_killed_engine_costs_no_request_that_had_not_started(gw, fleet, direct):
    # e2 holds a conversation's prefix (sent to it directly): the index routes its next
    # turn there. Then e2 dies: that turn, refused, goes to e1; nothing fails.
    p = list(range(300, 300 + 32 * 6))
    direct["e2"].completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0)
    _wait_held(gw, {"token_ids": p}, "e2", len(p))
    fleet["e2"].kill()
    before = sample(gw.client.metrics(), "kvi_gateway_retries_total", reason="connect")
    for k in range(6):
        raw = gw.oc.completions.with_raw_response.create(model=MODEL, prompt=p + [k] * 40, max_tokens=2,
                                                         temperature=0)
        assert raw.http_response.status_code == 200 and raw.headers["x-kvi-worker"] == "e1/0"
    streamed = list(gw.oc.completions.create(model=MODEL, prompt=p + [9] * 40, max_tokens=2, temperature=0,
                                             stream=True))
    assert streamed and streamed[0].choices
    assert sample(gw.client.metrics(), "kvi_gateway_retries_total", reason="connect") > before
