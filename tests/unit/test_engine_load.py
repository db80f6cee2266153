"""Routing with the engines' own load: an engine's own queue (vLLM's Prometheus /metrics, scraped from a
real local HTTP server) corrects the index's in-flight estimate (R-Q-7): requests the
engine no longer has end, and requests other routers sent count as load."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evkit import toks
from indexer import Indexer
from indexer.producer.publisher import VllmPublisher

BS = 16


def exposition(waiting: int, running: int, usage: float) -> str:
    """vLLM's own lines for one engine core (rank 0), written out by hand."""
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
    )


class Engine:
    """A metrics endpoint whose figures the test sets."""

    def __init__(self) -> None:
        self.body = exposition(0, 0, 0.0)
        self.scrapes = 0  # GETs served (the scraper polls one at a time)
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.scrapes += 1
                data = outer.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/metrics"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def until(cond, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def rig():
    eng = Engine()
    pubs = [VllmPublisher("tcp://127.0.0.1:*", bind=True) for _ in range(2)]
    ix = Indexer([
        {"id": "busy", "endpoint": pubs[0].live_endpoint, "metrics_url": eng.url},
        {"id": "free", "endpoint": pubs[1].live_endpoint},
    ], metrics_interval_s=0.1)
    ix.start()
    try:
        until(lambda: all(w["connected"] for w in ix.workers()), what="both engines connected")
        yield ix, eng
    finally:
        ix.stop()
        for p in pubs:
            p.close()
        eng.close()


def test_R_Q_7_requests_the_engine_no_longer_has_end(rig):
    ix, eng = rig
    eng.body = exposition(3, 0, 0.1)  # our three requests wait there
    ids = [ix.route(toks(100 * i, 4, BS), candidates=["busy"])["request_id"] for i in range(3)]
    assert all(ids)
    w = next(x for x in ix.workers() if x["engine"] == "busy")
    assert w["in_flight"]["requests"] == 3
    until(lambda: next(x for x in ix.workers() if x["engine"] == "busy")["engine_load"] is not None,
          what="a scrape")
    seen = eng.scrapes
    until(lambda: eng.scrapes >= seen + 3, what="three more scrapes")  # the engine still has all three
    assert next(x for x in ix.workers() if x["engine"] == "busy")["in_flight"]["requests"] == 3
    # The engine finished them (their blocks were never announced: say, a lost event).
    eng.body = exposition(0, 0, 0.1)
    until(lambda: next(x for x in ix.workers() if x["engine"] == "busy")["in_flight"]["requests"] == 0,
          what="the engine's report to end them")
    st = ix.stats()["in_flight"]
    assert st["outcomes"]["engine_done"] == 3 and st["prefill_tokens"] == 0
    w = next(x for x in ix.workers() if x["engine"] == "busy")
    assert w["engine_load"]["waiting"] == 0 and w["engine_load"]["kv_usage"] == 0.1


def test_R_Q_7_other_routers_requests_count_as_load(rig):
    ix, eng = rig
    # Nothing routed by us, yet the engine has 6 waiting and 2 running (another router's).
    eng.body = exposition(6, 2, 0.9)
    def report():
        el = next(x for x in ix.workers() if x["engine"] == "busy")["engine_load"]
        return el is not None and (el["waiting"], el["running"], el["kv_usage"]) == (6.0, 2.0, 0.9)

    until(report, what="the report")
    r = ix.route(toks(7, 4, BS), record=False)
    by = {x["engine"]: x for x in r["ranked"]}
    assert r["engine"] == "free"  # "busy" sorts first and caches nothing either: its queue decides
    assert by["busy"]["load"]["source"] == "index" and by["busy"]["load"]["prefill_tokens"] > 0
    assert by["free"]["load"]["prefill_tokens"] == 0
    # The other router's requests are gone: "busy" is as good as "free" again.
    eng.body = exposition(0, 0, 0.0)
    until(lambda: all(x["load"]["prefill_tokens"] == 0 for x in ix.route(toks(7, 4, BS), record=False)["ranked"]),
          what="the queue to empty")
    assert ix.route(toks(7, 4, BS), record=False)["engine"] == "busy"


def test_R_SEC_2_a_metrics_url_outside_the_allowlist_is_refused():
    from indexer.wire.engines import EndpointPolicy, EndpointRefused

    ix = Indexer(endpoint_policy=EndpointPolicy(["127.0.0.1"]))
    with pytest.raises(EndpointRefused, match="metrics_url"):
        ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", metrics_url="http://169.254.169.254/metrics")
    with pytest.raises(ValueError, match="metrics_url"):
        ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", metrics_url="file:///etc/passwd")
    assert ix.engines() == []
    ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", metrics_url="http://127.0.0.1:8000/metrics")
    assert ix.scraper.targets() == {"x": [("http://127.0.0.1:8000/metrics", (0,))]}
    ix.remove_engine("x")
    assert ix.scraper.targets() == {}


def test_R_SEC_2_an_api_url_outside_the_allowlist_is_refused():
    """The gateway forwards requests to an engine's api_url: its host is checked like every
    endpoint, and it must be a plain http(s) URL without credentials."""
    from indexer.wire.engines import EndpointPolicy, EndpointRefused

    ix = Indexer(endpoint_policy=EndpointPolicy(["127.0.0.1"]))
    with pytest.raises(EndpointRefused, match="api_url"):
        ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", api_url="http://10.9.9.9:8000")
    for bad in ("file:///etc/passwd", "http://user:pw@127.0.0.1:8000", "http://127.0.0.1:0"):
        with pytest.raises(ValueError, match="api_url"):
            ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", api_url=bad)
    assert ix.engines() == []
    ix.add_engine(id="x", endpoint="tcp://127.0.0.1:5557", api_url="http://127.0.0.1:8000")
    assert [c.api_url for c in ix.engines()] == ["http://127.0.0.1:8000"]
