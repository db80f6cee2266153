"""Property-based API tests (schemathesis) against our own OpenAPI schema, on a real
``kv-indexer serve`` process: every operation, valid and invalid inputs generated from
the schema; no 5xx, every response in its declared status codes and schema (R-BAD-1).
Bounded examples per operation so CI stays fast."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, seed, settings

from api.app import create_app
from api.settings import Settings
import textkit
from evkit import store, toks
from indexer.producer.publisher import VllmPublisher
from svc import Server, wait_for, wait_subscribed

EXAMPLES = int(os.environ.get("KVI_FUZZ_EXAMPLES", "40"))  # raise it for a deeper local run
MAX_TOKENS = 4096
# The server runs with an API token, so the fuzzer also reaches the guarded routes'
# handlers (it sends the token) and the schema declares their 401 and 403.
TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    # The model has a tokenizer (a ChatML one built here), so generated prompt and messages
    # requests reach the text path too (R-TXT-3).
    tok = textkit.build("chatml", str(tmp_path_factory.mktemp("tok")))
    s = Server("--max-request-tokens", str(MAX_TOKENS), "--tokenizer", f"default={tok}", env={"KVI_API_TOKEN": TOKEN})
    pub = VllmPublisher("tcp://127.0.0.1:*", hwm=0)
    try:
        # One engine with blocks, so generated queries also reach the match path.
        st, _ = s.client.call("POST", "/v1/engines", json.dumps({"id": "fuzz", "endpoint": pub.live_endpoint}).encode(),
                              AUTH)
        assert st == 201
        wait_subscribed(s.client, pub, "fuzz")  # /readyz is 200 at once (ready_fraction 0)
        pub.publish([store(toks(0, 4, 16), 16, 0, 4)])
        wait_for(lambda: s.client.get("/v1/stats")[1]["resident_entries"] == 4, what="the blocks")
        yield f"http://127.0.0.1:{s.port}"
    finally:
        pub.close()
        s.stop()


# The schema the server serves, built by the same factory (schemathesis' lazy
# fixture loader does not run on pytest 9; the server's copy is checked equal below).
SETTINGS = Settings(max_request_tokens=MAX_TOKENS, api_token=TOKEN)
# The gateway's operations forward to an engine (its answers are vLLM's); their own errors
# are tested in tests/service/test_gateway.py, with engines behind them.
schema = schemathesis.openapi.from_dict(create_app(SETTINGS).openapi()).exclude(tag="gateway")


def test_the_served_schema_is_the_tested_one(base_url):
    import urllib.request

    with urllib.request.urlopen(base_url + "/openapi.json") as r:
        assert json.load(r) == create_app(SETTINGS).openapi()


# Operations with rules a schema cannot state, answered with a documented 4xx: an
# engine's DP ranks must keep its ports <= 65535 (422); a route's candidates and load
# keys must be worker names (R-BAD-4, 422); Dynamo's /register answers a bad endpoint
# with 400 and /query_by_hash a cache_salt with 400, as Dynamo does. They skip only the
# "schema-valid data is accepted" check.
ERROR_KEY = {"/query": "error", "/query_by_hash": "error", "/register": "error", "/unregister": "error"}
SEMANTIC_4XX = {("POST", "/v1/engines"), ("POST", "/v1/route"), ("POST", "/register"), ("POST", "/query_by_hash")}


@schema.parametrize()
@seed(15)  # the same cases every CI run; benchmarks/fuzz_api.py runs long with any seed
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_R_BAD_1_no_5xx_and_responses_match_the_schema(case, base_url):
    from schemathesis.checks import negative_data_rejection, positive_data_acceptance

    excluded = [positive_data_acceptance] if (case.method, case.path) in SEMANTIC_4XX else []
    response = case.call(base_url=base_url, headers=AUTH)
    if response.status_code == 413:
        # Over the size bound (R-BAD-2): 413 is the documented rejection, which
        # schemathesis does not count among the rejection codes it expects.
        assert "limit" in response.json()[ERROR_KEY.get(case.path, "detail")]
        excluded.append(negative_data_rejection)
    case.validate_response(response, excluded_checks=excluded)
