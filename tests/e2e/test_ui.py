"""The live page (``GET /ui``) in a real headless Chromium (Debian's ``chromium``, driven
by Playwright), against a real ``kv-indexer serve --demo`` process: the demo fleet's
simulated engines publish over ZMQ, and two engines of the test's own (model ``probe``,
publishers it controls) hold blocks it chose, so what the page must show is known from
what was published, never from the code that shows it.

Chromium: ``/usr/bin/chromium`` (``.ci/run`` installs Debian's package), or ``$KVI_CHROMIUM``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from evkit import chunks, store, toks
from indexer.producer.publisher import VllmPublisher
from svc import Client, Server, wait_for, wait_subscribed

BS = 16
P = toks(50_000, 12, BS)  # the probe prompt: 12 blocks of 16 tokens
EXPLAINED = 10  # blocks of P the explain test asks about (its last CPU chunk is cut)
R = toks(70_000, 3, BS)  # published while the page watches
CHROMIUM = os.environ.get("KVI_CHROMIUM", "/usr/bin/chromium")
SIM_WORKERS = {f"sim-{e}/{r}" for e in range(4) for r in range(2)}  # serve --demo: 4 engines x 2 DP ranks


def worker(client: Client, name: str) -> dict:
    for w in client.get("/v1/workers")[1]:
        if f"{w['engine']}/{w['dp_rank']}" == name:
            return w
    raise AssertionError(f"no worker {name}")


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install chromium, as .ci/run "
                    "does) or point KVI_CHROMIUM at one")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def fleet():
    """``serve --demo`` plus engines probe-a (with a replay endpoint) and probe-b (without:
    a gap it cannot repair makes it stale). probe-a holds P's blocks 0-3 on GPU and all of
    P in CPU chunks of 4 blocks; probe-b holds blocks 0-1 on GPU, then loses a batch."""
    pa = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True)
    pb = VllmPublisher("tcp://127.0.0.1:*", bind=True)
    srv = None
    try:
        srv = Server("--demo", "--replay-timeout-s", "2",
                     "--engine", f"probe-a={pa.live_endpoint},replay_endpoint={pa.bound_replay_endpoint},model=probe",
                     "--engine", f"probe-b={pb.live_endpoint},model=probe")
        c = srv.client
        wait_subscribed(c, pa, "probe-a")
        wait_subscribed(c, pb, "probe-b")
        pa.publish([store(P, BS, 0, 4)])  # seq 0: GPU blocks 0-3
        pa.publish(chunks(P, BS, 4, medium="CPU"))  # seq 1: CPU chunks 0-3, 4-7, 8-11
        pb.publish([store(P, BS, 0, 2)])  # seq 0: GPU blocks 0-1
        wait_for(lambda: worker(c, "probe-a/0")["last_seq"] == 1 and worker(c, "probe-b/0")["last_seq"] == 0,
                 what="the probes' batches applied")
        pb.drop = {1}
        pb.publish([store(toks(90_000, 1, BS), BS, 0, 1)])  # seq 1: lost on the wire
        pb.publish([store(toks(91_000, 1, BS), BS, 0, 1)])  # seq 2: a gap no replay can repair
        wait_for(lambda: worker(c, "probe-b/0")["stale"], what="probe-b stale after an unrepairable gap")
        yield srv, pa, pb
    finally:
        if srv is not None:
            srv.stop()
        pa.close()
        pb.close()


@pytest.fixture
def page(browser, fleet):
    srv = fleet[0]
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(f"http://127.0.0.1:{srv.port}/ui")
    yield pg
    ctx.close()
    assert not errors, errors  # no script error on the page


def cell_text(page, name: str, field: str) -> str:
    return page.locator(f'#workers tr[data-worker="{name}"] [data-field="{field}"]').inner_text()


def test_workers_appear_and_their_counts_follow_the_events(page, fleet):
    _, pa, _ = fleet
    page.wait_for_selector('#workers tr[data-worker="sim-3/1"]', timeout=15_000)
    names = set(page.locator("#workers tbody tr").evaluate_all("rows => rows.map(r => r.dataset.worker)"))
    assert names == SIM_WORKERS | {"probe-a/0", "probe-b/0"}
    # The demo's engines keep publishing: the page's figures move without a reload.
    before = {n: cell_text(page, n, "last_seq") for n in sorted(SIM_WORKERS)}
    wait_for(lambda: any(cell_text(page, n, "last_seq") != s for n, s in before.items()), 20,
             "a demo worker's last seq to change on the page")
    # Blocks the test publishes show up as they are applied: GPU 4 (P) + 3 (R), CPU 12.
    blocks = '#workers tr[data-worker="probe-a/0"] [data-field="blocks"]'
    page.wait_for_selector(f'{blocks} [data-tier="CPU"]')
    assert page.locator(f'{blocks} [data-tier="GPU"] b').inner_text() == "4"
    assert page.locator(f'{blocks} [data-tier="CPU"] b').inner_text() == "12"
    pa.publish([store(R, BS, 0, 3)])
    page.wait_for_function(f"""() => document.querySelector('{blocks} [data-tier="GPU"] b').textContent === "7" """,
                           timeout=10_000)
    assert cell_text(page, "probe-a/0", "last_seq") == "2"
    # The over-time charts are drawn from the samples (not blank canvases).
    page.wait_for_function("() => Number(document.body.dataset.polls) >= 3", timeout=10_000)
    inked = page.evaluate("""() => {
        const c = document.querySelector('#chart-ingest'), g = c.getContext('2d');
        const d = g.getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 200 || d[i + 1] < 200 || d[i + 2] < 200) n++;
        return n; }""")
    assert inked > 500, inked


def test_a_stale_worker_is_shown_stale_with_its_reason(page, fleet):
    srv = fleet[0]
    row = '#workers tr[data-worker="probe-b/0"]'
    page.wait_for_selector(f'{row} [data-field="health"][data-health="stale"]', timeout=15_000)
    reason = worker(srv.client, "probe-b/0")["stale_reason"]
    assert reason and page.locator(f'{row} [data-field="stale_reason"]').inner_text() == reason
    assert "stale" in page.locator(row).get_attribute("class")
    # The healthy probe is not.
    assert page.locator('#workers tr[data-worker="probe-a/0"] [data-field="health"]').get_attribute(
        "data-health") == "ok"


def test_explain_shows_the_grid_of_a_known_prompt(page, fleet):
    page.fill("#explain-tokens", json.dumps({"token_ids": P[: EXPLAINED * BS]}))
    page.fill("#explain-model", "probe")
    page.click("#explain-go")
    page.wait_for_selector('#explain-out .xrow[data-worker="probe-b/0"]', timeout=10_000)
    rows = page.locator("#explain-out .xrow").evaluate_all("""rows => rows.map(r => ({
        worker: r.dataset.worker, total: Number(r.dataset.total), reason: r.dataset.reason, stale: r.dataset.stale,
        loaded: [...r.querySelectorAll('[data-block]')].map(c => c.dataset.loaded),
        held: [...r.querySelectorAll('[data-block]')].map(c => c.dataset.held ? c.dataset.held.split(',').sort() : [])
    }))""")
    # What was published, block by block: probe-a GPU 0-3 and CPU chunks [0-3] [4-7] [8-11]
    # (of which the prompt, 10 blocks, cuts the last); probe-b GPU 0-1, then stale.
    a_held = [["CPU", "GPU"]] * 4 + [["CPU"]] * (EXPLAINED - 4)
    a_loaded = ["GPU"] * 4 + ["CPU"] * 4 + [""] * (EXPLAINED - 8)
    b_held = [["GPU"]] * 2 + [[]] * (EXPLAINED - 2)
    b_loaded = ["GPU"] * 2 + [""] * (EXPLAINED - 2)
    assert rows == [
        {"worker": "probe-a/0", "total": 8, "reason": "cpu_chunk_boundary", "stale": "false", "loaded": a_loaded,
         "held": a_held},
        {"worker": "probe-b/0", "total": 2, "reason": "missing_block", "stale": "true", "loaded": b_loaded,
         "held": b_held},
    ]
    assert page.locator('#explain-out [data-field="query_blocks"]').inner_text() == str(EXPLAINED)
    assert "stale:" in page.locator('#explain-out .xrow[data-worker="probe-b/0"] [data-field="stale"]').inner_text()
    # The whole prompt: probe-a's last chunk is whole now, every block counts.
    page.fill("#explain-tokens", " ".join(map(str, P)))
    page.click("#explain-go")
    page.wait_for_selector('#explain-out .xrow[data-worker="probe-a/0"][data-reason="end_of_prompt"]')
    assert page.locator('#explain-out .xrow[data-worker="probe-a/0"]').get_attribute("data-total") == "12"
    # A bad input gets the service's message, not a broken page.
    page.fill("#explain-tokens", "[1, 2, -3]")
    page.click("#explain-go")
    page.wait_for_selector("#explain-error:not([hidden])")
    assert page.locator("#explain-out .xrow").count() == 0


def test_a_routing_decision_shows_the_chosen_worker_and_its_cost_split(page, fleet):
    srv = fleet[0]
    st, r = srv.client.post("/v1/route", {"token_ids": P[: EXPLAINED * BS], "model": "probe"})
    assert st == 200 and r["worker"] == "probe-a/0", r
    page.wait_for_selector('#decisions-model option[value="probe"]', state="attached", timeout=10_000)
    page.select_option("#decisions-model", "probe")  # the demo fleet routes ~30 a second besides
    row = f'#decisions tr[data-decision="{r["request_id"]}"]'
    page.wait_for_selector(row, timeout=10_000)
    text = page.locator(row).inner_text()
    # probe-a: 4 blocks cached on GPU, 4 more loaded from CPU, 2 of the 10 uncached; probe-b runs up.
    assert page.locator(f'{row} [data-field="chosen"]').inner_text() == "probe-a/0"
    assert "longest_cached_prefix" in text and "cached GPU 4 + CPU 4" in text and "uncached 2" in text, text
    assert "probe-b/0" in text


def test_with_auth_reads_the_page_asks_for_the_token_and_sends_it(browser, tmp_path):
    token = "ui-test-token-0123456789"
    tf = tmp_path / "token"
    tf.write_text(token)
    srv = Server("--api-token-file", str(tf), "--auth-reads")
    try:
        assert srv.client.get("/ui/state")[0] == 401  # the data needs the token
        ctx = browser.new_context()
        pg = ctx.new_page()
        pg.goto(f"http://127.0.0.1:{srv.port}/ui")  # the page itself does not
        pg.wait_for_selector("#token-form:not([hidden])", timeout=10_000)
        pg.fill("#token", "not-the-token-000000")
        pg.click("#token-form button")
        pg.wait_for_selector("#token-form:not([hidden])")
        deadline = time.monotonic() + 10
        while "refused" not in pg.locator("#token-form .hint").inner_text():
            assert time.monotonic() < deadline, "no refusal shown for a wrong token"
            time.sleep(0.05)
        pg.fill("#token", token)
        pg.click("#token-form button")
        pg.wait_for_selector('#status[data-state="live"]', timeout=10_000)
        assert pg.locator("#token-form").is_hidden()
        ctx.close()
    finally:
        srv.stop()


def test_the_time_slider_shows_the_fleet_as_the_recording_had_it(browser, tmp_path):
    """serve --record: the page's time machine replays the recording to the slider's moment.
    At the right end the worker holds the 4 blocks published; at the left end, before the
    store, it holds none; a route made is listed with the worker it chose."""
    pub = VllmPublisher("tcp://127.0.0.1:*", bind=True)
    srv = Server("--record", str(tmp_path / "rec"), "--engine", f"tm-a={pub.live_endpoint}")
    try:
        c = srv.client
        wait_subscribed(c, pub, "tm-a")
        pub.publish([store(P, BS, 0, 4)])
        wait_for(lambda: worker(c, "tm-a/0")["last_seq"] == 0, what="the store applied")
        st, r = c.post("/v1/route", {"token_ids": P})
        assert st == 200 and r["worker"] == "tm-a/0"
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(f"http://127.0.0.1:{srv.port}/ui")
        pg.wait_for_selector("#timemachine-section:not([hidden])", timeout=10_000)

        def moment(value: int) -> None:
            n = int(pg.evaluate("Number(document.body.dataset.moments || 0)"))
            pg.evaluate(f"(() => {{ const s = document.querySelector('#tm-slider'); s.value = '{value}'; "
                        "s.dispatchEvent(new Event('input')); })()")
            pg.wait_for_function(f"Number(document.body.dataset.moments || 0) > {n}", timeout=10_000)

        moment(900)  # now: the store and the route are in the recording
        row = pg.locator('#tm-workers tr[data-worker="tm-a/0"]')
        assert "GPU 4" in row.inner_text()
        assert "tm-a/0" in pg.locator("#tm-decisions tbody").inner_text()
        moment(0)  # the recording's start: the worker registered, nothing stored yet
        assert "GPU" not in pg.locator('#tm-workers tr[data-worker="tm-a/0"]').inner_text()
        assert pg.locator("#tm-decisions tbody tr").count() == 0
        ctx.close()
        assert not errors, errors
    finally:
        srv.stop()
        pub.close()
