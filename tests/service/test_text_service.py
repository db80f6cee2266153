"""Text prompts through a real ``kv-indexer serve`` (R-TXT-3, R-TXT-4, R-TXT-5, R-TXT-6).

Two models with test-built tokenizers (ChatML; Llama 3 with BOS), two engines each,
publishing over real ZMQ the blocks of token ids that transformers' reference (called as
vLLM calls it) gives for a conversation and a prompt. ``/v1/route`` and ``/v1/match`` with
the text must answer exactly what they answer with those ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import textkit
from evkit import store
from indexer.producer.publisher import VllmPublisher
from svc import ROOT, Server, sample, wait_for, wait_subscribed

pytest.importorskip("tokenizers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

BS = 16
FAMILIES = ("chatml", "llama3")
CHAT = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."},
        {"role": "user", "content": "KV caches hold the keys and values of every prompt token; routing by prefix "
                                    "reuses them. Grüße aus Köln! 日本語のテキスト 😀🚀. How are you today?"}]
PROMPT = ("The quick brown fox jumps over the lazy dog. def route(prompt, workers): return max(workers) "
          "Emoji 😀🚀🎉 and math ∑∫√∞ ≤ ≥ ≠ and arrows → ← ↔. Tabs\tand  double  spaces,\nnew lines")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tok"))
    dirs = {f: textkit.build(f, root) for f in FAMILIES}
    refs = {f: transformers.AutoTokenizer.from_pretrained(d) for f, d in dirs.items()}
    args = [a for f, d in dirs.items() for a in ("--tokenizer", f"{f}={d}")]
    s = Server(*args)
    pubs = {}
    try:
        for f in FAMILIES:
            for e in ("a", "b"):
                pub = pubs[(f, e)] = VllmPublisher("tcp://127.0.0.1:*", hwm=0)
                st, body = s.client.post("/v1/engines", {"id": f"{e}-{f}", "endpoint": pub.live_endpoint, "model": f})
                assert st == 201, body
                wait_subscribed(s.client, pub, f"{e}-{f}")
        yield s, dirs, refs, pubs
    finally:
        for p in pubs.values():
            p.close()
        s.stop()


def chat_ids(ref, messages):
    # vLLM: apply_chat_template(..., tokenize=True, return_dict=False) on its conversation
    # (string content for these templates).
    return list(ref.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True))


def publish_blocks(s, pub, engine, ids, nblocks):
    before = s.client.get("/v1/stats")[1]["resident_entries"]
    pub.publish([store(ids, BS, 0, nblocks)])
    wait_for(lambda: s.client.get("/v1/stats")[1]["resident_entries"] == before + nblocks, what="the blocks")


@pytest.mark.parametrize("family", FAMILIES)
def test_R_TXT_6_route_by_messages_or_prompt_picks_the_worker_of_the_reference_ids(world, family):
    s, dirs, refs, pubs = world
    ref = refs[family]
    cids = chat_ids(ref, CHAT)
    pids = ref.encode(PROMPT, add_special_tokens=True)
    assert len(cids) >= 3 * BS and len(pids) >= 3 * BS
    # Engine b holds the whole conversation; engine a holds only its first block, plus the
    # prompt's blocks (so each text picks a different worker, and a mistokenized one loses).
    publish_blocks(s, pubs[(family, "b")], f"b-{family}", cids, len(cids) // BS)
    publish_blocks(s, pubs[(family, "a")], f"a-{family}", pids, len(pids) // BS)

    for body, ids, want in (({"messages": CHAT}, cids, f"b-{family}/0"), ({"prompt": PROMPT}, pids,
                                                                            f"a-{family}/0")):
        st, by_text = s.client.post("/v1/route", {"model": family, "record": False, **body})
        assert st == 200, by_text
        st, by_ids = s.client.post("/v1/route", {"model": family, "record": False, "token_ids": ids})
        assert st == 200, by_ids
        assert by_text["worker"] == by_ids["worker"] == want
        assert by_text["ranked"] == by_ids["ranked"]
        assert by_text["ranked"][0]["cached_blocks"] == len(ids) // BS
        st, m_text = s.client.post("/v1/match", {"model": family, **body})
        st2, m_ids = s.client.post("/v1/match", {"model": family, "token_ids": ids})
        assert st == st2 == 200
        for m in (m_text, m_ids):
            for w in m["workers"]:
                w.pop("last_event_age_s")
        assert m_text == m_ids and m_text["query_blocks"] == len(ids) // BS

    # /v1/tokenize shows what was tokenized.
    st, tok = s.client.post("/v1/tokenize", {"model": family, "messages": CHAT})
    assert st == 200 and tok["token_ids"] == cids and tok["count"] == len(cids) and not tok["add_special_tokens"]
    assert tok["text"] == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    st, tok = s.client.post("/v1/tokenize", {"model": family, "prompt": PROMPT})
    assert st == 200 and tok["token_ids"] == pids and tok["text"] == PROMPT and tok["add_special_tokens"]
    # Text parts are joined as vLLM joins them (a newline) for these string-content templates.
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    st, tok = s.client.post("/v1/tokenize", {"model": family, "messages": parts, "add_generation_prompt": False})
    assert st == 200 and tok["token_ids"] == list(ref.apply_chat_template(
        [{"role": "user", "content": "one\ntwo"}], tokenize=True, return_dict=False))


def test_R_TXT_3_R_TXT_4_clear_counted_client_errors(world):
    s, _, _, _ = world
    m0 = s.client.metrics()
    cases = [
        # A model without a tokenizer: 404 that says how to configure one.
        ("/v1/route", {"model": "other", "prompt": "hi"}, 404, "tokenizers: {MODEL: DIR}"),
        ("/v1/match", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "KVI_TOKENIZERS"),
        # Multimodal content parts are refused, saying so and where.
        ("/v1/route", {"model": "chatml", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         422, "'image_url' part"),
        # Exactly one of token_ids, prompt and messages.
        ("/v1/route", {"model": "chatml", "prompt": "hi", "token_ids": [1, 2]}, 422, "exactly one"),
        ("/v1/match", {"model": "chatml"}, 422, "exactly one"),
        ("/v1/match", {"model": "chatml", "prompt": "hi", "add_generation_prompt": True}, 422, "only apply to messages"),
        # The template's own refusal, and kwargs that would change tokenization.
        ("/v1/match", {"model": "chatml", "messages": [{"role": "user", "content": "x"}],
                       "chat_template_kwargs": {"tokenize": True}}, 422, "may not set tokenize"),
        ("/v1/tokenize", {"model": "chatml"}, 422, "exactly one"),
    ]
    for path, body, status, text in cases:
        st, out = s.client.post(path, body)
        assert st == status and text in out["detail"], (path, body, st, out)
    m1 = s.client.metrics()
    for path, n404, n422 in (("/v1/route", 1, 2), ("/v1/match", 1, 3), ("/v1/tokenize", 0, 1)):
        for status, n in ((404, n404), (422, n422)):
            key = dict(route=path, status=str(status))
            assert sample(m1, "kvi_api_errors_total", **key) - sample(m0, "kvi_api_errors_total", **key) == n, key


def test_R_TXT_3_the_schema_says_exactly_one_of_the_three(world):
    s, _, _, _ = world
    spec = s.client.get("/openapi.json")[1]
    for name in ("MatchRequest", "RouteRequest"):
        req = spec["components"]["schemas"][name]
        assert [alt["required"] for alt in req["oneOf"]] == [["token_ids"], ["prompt"], ["messages"]]
    assert "/v1/tokenize" in spec["paths"]


def test_R_TXT_5_a_missing_or_broken_tokenizer_stops_the_start_naming_the_model(tmp_path):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "api.cli", "serve", "--port", "0", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    out = serve("--tokenizer", f"llama-x={tmp_path / 'nowhere'}")
    assert out.returncode == 2 and "llama-x" in out.stderr and "not a directory" in out.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{broken")
    out = serve("--tokenizer", f"qwen-y={bad}")
    assert out.returncode == 2 and "qwen-y" in out.stderr and "tokenizer.json cannot be read" in out.stderr
    out = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "KVI_TOKENIZERS": json.dumps({"z": str(bad)})})
    assert out.returncode == 0 and json.loads(out.stdout)["tokenizers"] == {"z": str(bad)}


def test_R_TXT_7_tokenizing_leaves_the_event_loop_free(world):
    """R-TXT-7: while a very long prompt is tokenized, another request is answered first.

    The long request is sent whole, then the server is seen working on it (its CPU time
    grows: ~1 M tokens take seconds) before /healthz goes out on a second connection.
    Tokenized on the event loop, the long prompt would hold /healthz until it finished;
    off the loop, /healthz comes back first."""
    import socket
    import threading

    s, _, _, _ = world
    body = json.dumps({"model": "chatml", "prompt": "token routing prefix cache " * 250_000}).encode()
    done: list[str] = []

    def long_request() -> None:
        with socket.create_connection(("127.0.0.1", s.port), timeout=120) as c:
            c.sendall(b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sent.set()
            assert c.recv(64).startswith(b"HTTP/1.1 ")
            done.append("long")

    sent = threading.Event()
    t = threading.Thread(target=long_request)
    t.start()
    assert sent.wait(60)

    def cpu_s() -> float:  # the server's CPU time so far (utime + stime, /proc/PID/stat)
        with open(f"/proc/{s.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # The server reads the body and tokenizes it: it is busy with it once it has spent
    # CPU time on it (the test sends nothing else meanwhile).
    busy = cpu_s() + 0.3
    wait_for(lambda: cpu_s() >= busy or done, timeout=60, what="the server to work on the long prompt")
    assert not done, "the long prompt was answered before it could be overtaken: make it longer"
    assert s.client.get("/healthz")[0] == 200
    done.append("healthz")
    t.join(120)
    assert done == ["healthz", "long"]
