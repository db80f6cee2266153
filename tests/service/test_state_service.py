"""Warm restarts and peer bootstrap of the real service (R-DUR-1..4), events flowing.

Two engines (vLLM's wire protocol, with replay) publish stores and removals from a
background thread for the whole test. The three restart scenarios run twice: with this
project's mirror of vLLM's publisher (``VllmPublisher``) and with vLLM's own
``ZmqEventPublisher`` (release 0.33.0, :mod:`vendor.vllm_kv_events`; skipped where the
``vllm`` package's files are not installed), whose sent batches a recorder SUB logs. A service that never stops (``steady``) and
the in-process ``reference`` (every payload applied in order) are what the restarted
service must equal once the flow stops and everyone has caught up:

* a SIGTERM restart (``--state-dir``): the snapshot written at shutdown, the engines
  registered over the API restored, the batches published while it was down replayed;
* a ``kill -9`` after a periodic snapshot: the batches after that snapshot replayed;
* a new replica ``--bootstrap-from`` a peer: its state, registry included, copied.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from evkit import ehashes, removed, toks
from indexer.producer.publisher import VllmPublisher
from svc import Client, Server, sample, wait_for, wait_subscribed
from test_ingest import Rec, gpu, reference
from test_vllm_publisher import SUBSCRIBE_S, OwnEngine, kv, needs_vllm

BS = 4
PROMPTS = [toks(1 + 1000 * i, 6, BS) for i in range(12)]
TOKEN = "state-test-token-0123456789"
# The engines' replay ring: it covers the seconds a restart takes, not the history (a
# late join's replay from 0 would fail), so only the snapshot can bring the rest back.
BUFFER = 150
# Batches each engine publishes before the restart: more than the ring holds, so that
# replay alone could not rebuild the index.
RUN = BUFFER + 10
# While a service is away (down, or not yet bootstrapped), each engine publishes at most
# CAP more batches until it has caught up: under load a restart can take seconds, and the
# ring must still hold everything it missed. The margin (BUFFER - CAP) covers the batches
# the service had not applied yet when it went away.
CAP = 100
# The publisher the engines run: this project's mirror, or vLLM's own code.
PUBLISHERS = ["mirror", pytest.param("vllm", marks=needs_vllm)]


def _next_seq(r) -> int:
    return r.next_seq if isinstance(r, OwnEngine) else r.pub.next_seq


class Flow:
    """Engines publishing from a thread until ``stop()``: stores, re-stores, removals."""

    def __init__(self, publisher: str = "mirror", n: int = 2, buffer_steps: int = BUFFER) -> None:
        self.publisher = publisher
        self.recs: list = []
        for i in range(n):
            if publisher == "vllm":  # vLLM's ZmqEventPublisher, recorded as it sends
                self.recs.append(OwnEngine(f"e{i}", buffer_steps=buffer_steps, settle=False))
                continue
            pub = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True, version="0.33",
                                buffer_steps=buffer_steps)
            self.recs.append(Rec(pub, f"e{i}"))
        if publisher == "vllm":
            # The recorders' subscriptions, once for all: vLLM's PUB sends from its own thread,
            # so no probe can go through it; a batch a recorder missed fails settle().
            time.sleep(SUBSCRIBE_S)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.rng = random.Random(7)
        self.thread: threading.Thread | None = None
        self._cap: int | None = None
        self.mark: dict[str, int] = {}

    def engine_specs(self) -> list[dict]:
        eps = [r if isinstance(r, OwnEngine) else r.pub for r in self.recs]
        return [{"id": r.engine, "endpoint": e.live_endpoint, "replay_endpoint": e.bound_replay_endpoint}
                for r, e in zip(self.recs, eps)]

    def cap(self, n: int = CAP) -> None:
        """From now on each engine publishes at most ``n`` more batches, until ``uncap()``."""
        with self.lock:
            self.mark, self._cap = self.history(), n

    def uncap(self) -> None:
        with self.lock:
            self._cap = None

    def step(self) -> None:
        rec = self.rng.choice(self.recs)
        p = self.rng.choice(PROMPTS)
        with self.lock:
            if self._cap is not None and _next_seq(rec) - self.mark[rec.engine] >= self._cap:
                return
            if self.rng.random() < 0.25:
                rec.send([removed(ehashes(p, BS)[self.rng.randrange(6):])])
            else:
                rec.send(gpu(p, 6))

    def start(self, rate_hz: float = 150.0) -> None:
        def run():
            while not self._stop.wait(1 / rate_hz):
                self.step()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop publishing; with vLLM's publisher, also wait until its thread has sent
        every queued batch and the recorder holds them all."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join()
        for r in self.recs:
            if isinstance(r, OwnEngine):
                r.settle()

    def history(self) -> dict[str, int]:
        return {r.engine: _next_seq(r) for r in self.recs}

    def close(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join()
        # vLLM's own shutdown() (it drains its queue, then joins its thread), all at once.
        closing = [threading.Thread(target=r.close if isinstance(r, OwnEngine) else r.pub.close) for r in self.recs]
        for t in closing:
            t.start()
        for t in closing:
            t.join()


def _answers(client: Client) -> list:
    out = []
    for p in PROMPTS:
        status, d = client.post("/v1/match", {"token_ids": p})
        assert status == 200, d
        for w in d["workers"]:
            w.pop("last_event_age_s", None)
        out.append(d)
    return out


def _ref_answers(flow: Flow) -> list:
    ref = reference(flow.recs)
    out = []
    for p in PROMPTS:
        d = ref.match(p).to_dict()
        for w in d["workers"]:
            w.pop("last_event_age_s", None)
        out.append(d)
    return out


def _caught_up(client: Client, flow: Flow) -> None:
    want = {r.engine: _next_seq(r) - 1 for r in flow.recs}

    def ok():
        ws = {w["engine"]: w for w in client.get("/v1/workers")[1]}
        return all(e in ws and ws[e]["last_seq"] == s and not ws[e]["replaying"] for e, s in want.items())

    wait_for(ok, timeout=20, what=f"caught up to {want}: {client.get('/v1/workers')[1]}")


def _register(client: Client, flow: Flow, token: str | None = None) -> None:
    """Register the flow's engines over the API and wait until the service's subscriptions
    are live: probed through our mirror's publisher (one-frame messages, dropped and
    counted). vLLM's own publisher sends from its thread, so there only the connect is
    seen; a batch sent before its PUB took the subscription in comes back by replay (the
    ring holds the start of the flow)."""
    h = {"authorization": f"Bearer {token}"} if token else {}
    for spec in flow.engine_specs():
        import json

        status, body = client.call("POST", "/v1/engines", json.dumps(spec).encode(), h)
        assert status == 201, body
    for r in flow.recs:
        if isinstance(r, OwnEngine):
            wait_for(lambda: any(w["engine"] == r.engine and w["connected"] for w in client.get("/v1/workers")[1]),
                     what=f"{r.engine} connected")
        else:
            wait_subscribed(client, r.pub, r.engine)


def _run(flow: Flow) -> None:
    """Let the flow run until every engine has published ``RUN`` batches."""
    wait_for(lambda: min(flow.history().values()) >= RUN, timeout=60, what=f"{RUN} batches from every engine")


def _published_more(flow: Flow, n: int) -> None:
    """Wait until every engine has published ``n`` more batches than now (or reached the
    cap ``flow.cap()`` set): the flow goes on meanwhile, e.g. while a service is away."""
    now = flow.history()
    want = {e: now[e] + n if flow._cap is None else min(now[e] + n, flow.mark[e] + flow._cap) for e in now}
    wait_for(lambda: all(flow.history()[e] >= k for e, k in want.items()), timeout=30,
             what=f"{n} more batches from every engine ({want})")


@pytest.fixture
def flow(request, caplog):
    """The engines (``Flow``); ``"mirror"`` unless parametrized (indirectly) with
    ``"vllm"``. vLLM's publisher must log no warning or error (a failed send, a bad
    replay request, a queue left unsent at shutdown)."""
    f = Flow(getattr(request, "param", "mirror"))
    try:
        yield f
    finally:
        f.close()
    if f.publisher == "vllm":
        name = kv.__name__
        bad = [r for r in caplog.get_records("call") + caplog.get_records("teardown")
               if r.name == name and r.levelno >= 30]
        assert not bad, [r.getMessage() for r in bad]


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(*args, **kw) -> Server:
        s = Server(*args, **kw)
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def _back(client: Client, flow: Flow) -> None:
    """Wait until ``client``'s service has applied a batch published after ``flow.cap()``
    from every engine (so it got everything before it: snapshot plus replay), without
    going stale; then let the flow run free again."""
    def ok():
        ws = {w["engine"]: w for w in client.get("/v1/workers")[1]}
        for w in ws.values():
            assert not w["stale"], w  # a replay that came too late: the test, not the service
        return all(e in ws and ws[e]["last_seq"] >= s and not ws[e]["replaying"] for e, s in flow.mark.items())

    wait_for(ok, timeout=30, what=f"past {flow.mark}: {client.get('/v1/workers')[1]}")
    flow.uncap()


def _replayed(client: Client) -> None:
    """What it missed came from the engines' replay sockets, and no replay failed."""
    m = client.metrics()
    assert sample(m, "kvi_replays_total", outcome="ok") >= 1 and sample(m, "kvi_replays_total", outcome="failed") == 0


def _settle(flow: Flow, *clients: Client) -> None:
    flow.stop()
    for c in clients:
        _caught_up(c, flow)


@pytest.mark.parametrize("flow", PUBLISHERS, indirect=True)
def test_R_DUR_2_sigterm_restart_equals_a_service_that_never_stopped(flow, servers, tmp_path):
    """R-DUR-2: a SIGTERM'd service with ``--state-dir`` comes back from the snapshot
    written at shutdown (registry included), the engines' replay fills what it missed
    while down, and it ends with the answers of a service that never stopped."""
    steady = servers()
    svc = servers("--state-dir", str(tmp_path), "--snapshot-interval-s", "0")
    _register(steady.client, flow)
    _register(svc.client, flow)  # over the API: the registry must survive too
    flow.start()
    _run(flow)
    flow.cap()
    svc.proc.send_signal(signal.SIGTERM)
    svc.proc.wait(20)
    assert svc.proc.returncode == -signal.SIGTERM, svc.output()  # uvicorn re-raises the signal
    assert "wrote" in svc.output() and os.path.exists(tmp_path / "index.snap")
    _published_more(flow, 20)  # the flow goes on while it is down: these batches must come from replay
    down = flow.history()
    again = servers("--state-dir", str(tmp_path))
    assert [e["id"] for e in again.client.get("/v1/engines")[1]] == ["e0", "e1"]
    assert all(down[e] > s for e, s in flow.mark.items()), (flow.mark, down)  # published while it was down
    _back(again.client, flow)
    _published_more(flow, 10)  # and on after it is back
    _settle(flow, again.client, steady.client)
    assert _answers(again.client) == _answers(steady.client) == _ref_answers(flow)
    _replayed(again.client)
    m = again.client.metrics()
    assert sample(m, "kvi_snapshot_loads_total", source="state_dir", outcome="ok", reason="") == 1
    assert sample(m, "kvi_engine_changes_total", op="register", via="snapshot") == 2
    assert not any(w["stale"] for w in again.client.get("/v1/workers")[1])


@pytest.mark.parametrize("flow", PUBLISHERS, indirect=True)
def test_R_DUR_2_kill_9_after_a_snapshot_replays_the_rest(flow, servers, tmp_path):
    """R-DUR-2: ``kill -9`` loses nothing a periodic snapshot holds: the restarted
    service loads the last one and replays the batches after it. The engines' replay
    rings (``BUFFER``) are shorter than their history, so only the snapshot can bring
    back the beginning."""
    steady = servers()
    svc = servers("--state-dir", str(tmp_path), "--snapshot-interval-s", "0.3")
    _register(steady.client, flow)
    _register(svc.client, flow)
    flow.start()
    _run(flow)
    flow.cap()
    # Two more periodic snapshots: the second one began after the cap.
    n = sample(svc.client.metrics(), "kvi_snapshot_writes_total", outcome="ok")
    assert n >= 2, n  # RUN batches take many snapshot intervals
    wait_for(lambda: sample(svc.client.metrics(), "kvi_snapshot_writes_total", outcome="ok") >= n + 2,
             what="two periodic snapshots after the cap")
    _published_more(flow, 5)  # batches after the last snapshot: the restarted service must replay them
    svc.proc.send_signal(signal.SIGKILL)
    svc.proc.wait(10)
    _published_more(flow, 20)  # and while it is down
    down = flow.history()
    again = servers("--state-dir", str(tmp_path))
    assert all(down[e] > s for e, s in flow.mark.items()), (flow.mark, down)  # published after the snapshot
    _back(again.client, flow)
    _published_more(flow, 10)
    _settle(flow, again.client, steady.client)
    assert min(flow.history().values()) > BUFFER, flow.history()  # replay alone could not rebuild it
    assert _answers(again.client) == _answers(steady.client) == _ref_answers(flow)
    _replayed(again.client)
    assert not any(w["stale"] for w in again.client.get("/v1/workers")[1])


@pytest.mark.parametrize("flow", PUBLISHERS, indirect=True)
def test_R_DUR_4_a_new_replica_bootstrapped_from_a_peer_equals_it(flow, servers, tmp_path):
    """R-DUR-4: a new replica started ``--bootstrap-from`` a peer (token-guarded
    ``GET /v1/snapshot``) takes its state and registry, replays the rest from the
    engines, and ends with the peer's answers."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    peer = servers("--api-token-file", str(token_file))
    _register(peer.client, flow, TOKEN)
    flow.start()
    _run(flow)
    status, _ = peer.client.get("/v1/snapshot")
    assert status == 401  # the snapshot holds the registry: it needs the token
    flow.cap()
    new = servers("--api-token-file", str(token_file), "--bootstrap-from", f"http://127.0.0.1:{peer.port}")
    assert [e["id"] for e in new.client.get("/v1/engines")[1]] == ["e0", "e1"]
    _back(new.client, flow)
    _published_more(flow, 10)
    _settle(flow, new.client, peer.client)
    assert _answers(new.client) == _answers(peer.client) == _ref_answers(flow)
    _replayed(new.client)
    assert sample(new.client.metrics(), "kvi_snapshot_loads_total", source="peer", outcome="ok", reason="") == 1


def test_R_DUR_3_a_corrupt_state_file_is_set_aside_and_the_service_starts_empty(servers, tmp_path):
    (tmp_path / "index.snap").write_bytes(b"KVISNAP\0" + b"\0" * 10)
    svc = servers("--state-dir", str(tmp_path))
    assert svc.client.get("/v1/workers")[1] == []
    m = svc.client.metrics()
    assert sample(m, "kvi_snapshot_loads_total", source="state_dir", outcome="refused", reason="truncated") == 1
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 1 and names[0].startswith("index.snap.refused-")
    assert "snapshot refused (truncated)" in svc.output()


def test_R_DUR_4_a_peer_that_is_not_there_means_starting_empty(servers):
    svc = servers("--bootstrap-from", "http://127.0.0.1:9")
    assert svc.client.get("/v1/workers")[1] == []
    assert sample(svc.client.metrics(), "kvi_snapshot_loads_total", source="peer", outcome="error",
                  reason="connect") == 1


def test_R_DUR_1_get_snapshot_is_the_documented_file(flow, servers):
    svc = servers()
    _register(svc.client, flow)
    for _ in range(5):
        flow.step()
    _caught_up(svc.client, flow)
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=20)
    try:
        conn.request("GET", "/v1/snapshot")
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    assert r.status == 200 and r.getheader("content-type") == "application/octet-stream"
    assert data[:8] == b"KVISNAP\0" and int.from_bytes(data[8:12], "big") == 1
    assert int.from_bytes(data[16:24], "big") == len(data) - 32


def test_R_DUR_1_an_interval_with_nothing_new_writes_nothing(flow, servers, tmp_path):
    """The periodic snapshot holds the index lock while it reads: an interval where no
    batch, mark or registration changed anything skips it (counted as unchanged)."""
    svc = servers("--state-dir", str(tmp_path), "--snapshot-interval-s", "0.2")

    def writes(outcome):
        return sample(svc.client.metrics(), "kvi_snapshot_writes_total", outcome=outcome)

    wait_for(lambda: writes("unchanged") >= 3, what="idle intervals skipped")
    assert writes("ok") == 1  # the first one is always written
    _register(svc.client, flow)
    for _ in range(5):  # both engines publish (the flow's seeded choice), so both can catch up
        flow.step()
    _caught_up(svc.client, flow)
    wait_for(lambda: writes("ok") >= 2, what="a write after a change")
    # An interval that found nothing new: the last batch is in a written snapshot by then
    # (a write mid-flow may not have held it).
    idle = writes("unchanged")
    wait_for(lambda: writes("unchanged") > idle, what="an idle interval after the change")
    ok = writes("ok")
    idle = writes("unchanged")
    wait_for(lambda: writes("unchanged") >= idle + 4, what="four more idle intervals")
    assert writes("ok") == ok  # nothing new since: skipped again
