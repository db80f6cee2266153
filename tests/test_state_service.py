"""Warm restarts and peer bootstrap of the real service (R-DUR-1..4), events flowing.

Two engines (vLLM's wire protocol, with replay) publish stores and removals from a
background thread for the whole test. A service that never stops (``steady``) and
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
from svc import Client, Server, sample, wait_for
from test_ingest import Rec, gpu, reference

BS = 4
PROMPTS = [toks(1 + 1000 * i, 6, BS) for i in range(12)]
TOKEN = "state-test-token-0123456789"
# The engines' replay ring: it covers the seconds a restart takes, not the history (a
# late join's replay from 0 would fail), so only the snapshot can bring the rest back.
BUFFER = 150
RUN_S = 3.5  # ~130 batches per engine before the restart


class Flow:
    """Engines publishing from a thread until ``stop()``: stores, re-stores, removals."""

    def __init__(self, n: int = 2, buffer_steps: int = BUFFER) -> None:
        self.recs = []
        for i in range(n):
            pub = VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True, version="0.33",
                                buffer_steps=buffer_steps)
            self.recs.append(Rec(pub, f"e{i}"))
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.rng = random.Random(7)
        self.thread: threading.Thread | None = None

    def engine_specs(self) -> list[dict]:
        return [{"id": r.engine, "endpoint": r.pub.live_endpoint, "replay_endpoint": r.pub.bound_replay_endpoint}
                for r in self.recs]

    def step(self) -> None:
        rec = self.rng.choice(self.recs)
        p = self.rng.choice(PROMPTS)
        with self.lock:
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
        self._stop.set()
        if self.thread is not None:
            self.thread.join()

    def close(self) -> None:
        self.stop()
        for r in self.recs:
            r.pub.close()


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
    want = {r.engine: r.pub.next_seq - 1 for r in flow.recs}

    def ok():
        ws = {w["engine"]: w for w in client.get("/v1/workers")[1]}
        return all(e in ws and ws[e]["last_seq"] == s and not ws[e]["replaying"] for e, s in want.items())

    wait_for(ok, timeout=20, what=f"caught up to {want}: {client.get('/v1/workers')[1]}")


def _register(client: Client, flow: Flow, token: str | None = None) -> None:
    h = {"authorization": f"Bearer {token}"} if token else {}
    for spec in flow.engine_specs():
        import json

        status, body = client.call("POST", "/v1/engines", json.dumps(spec).encode(), h)
        assert status == 201, body


@pytest.fixture
def flow():
    f = Flow()
    try:
        yield f
    finally:
        f.close()


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


def _settle(flow: Flow, *clients: Client) -> None:
    flow.stop()
    for c in clients:
        _caught_up(c, flow)


def test_R_DUR_2_sigterm_restart_equals_a_service_that_never_stopped(flow, servers, tmp_path):
    steady = servers()
    svc = servers("--state-dir", str(tmp_path), "--snapshot-interval-s", "0")
    _register(steady.client, flow)
    _register(svc.client, flow)  # over the API: the registry must survive too
    time.sleep(0.3)  # both subscribed before the flow starts
    flow.start()
    time.sleep(RUN_S)
    svc.proc.send_signal(signal.SIGTERM)
    svc.proc.wait(20)
    assert svc.proc.returncode in (0, -signal.SIGTERM), svc.output()  # uvicorn re-raises the signal
    assert "wrote" in svc.output() and os.path.exists(tmp_path / "index.snap")
    time.sleep(0.7)  # the flow goes on while it is down: these batches must come from replay
    again = servers("--state-dir", str(tmp_path))
    assert [e["id"] for e in again.client.get("/v1/engines")[1]] == ["e0", "e1"]
    time.sleep(1.0)
    _settle(flow, again.client, steady.client)
    assert _answers(again.client) == _answers(steady.client) == _ref_answers(flow)
    m = again.client.metrics()
    assert sample(m, "kvi_snapshot_loads_total", source="state_dir", outcome="ok", reason="") == 1
    assert sample(m, "kvi_engine_changes_total", op="register", via="snapshot") == 2
    assert not any(w["stale"] for w in again.client.get("/v1/workers")[1])


def test_R_DUR_2_kill_9_after_a_snapshot_replays_the_rest(flow, servers, tmp_path):
    steady = servers()
    svc = servers("--state-dir", str(tmp_path), "--snapshot-interval-s", "0.3")
    _register(steady.client, flow)
    _register(svc.client, flow)
    time.sleep(0.3)
    flow.start()
    time.sleep(RUN_S)
    wait_for(lambda: sample(svc.client.metrics(), "kvi_snapshot_writes_total", outcome="ok") >= 2,
             what="two periodic snapshots")
    time.sleep(0.2)
    svc.proc.send_signal(signal.SIGKILL)
    svc.proc.wait(10)
    time.sleep(0.5)
    again = servers("--state-dir", str(tmp_path))
    time.sleep(1.0)
    _settle(flow, again.client, steady.client)
    assert _answers(again.client) == _answers(steady.client) == _ref_answers(flow)
    assert not any(w["stale"] for w in again.client.get("/v1/workers")[1])


def test_R_DUR_4_a_new_replica_bootstrapped_from_a_peer_equals_it(flow, servers, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    peer = servers("--api-token-file", str(token_file))
    _register(peer.client, flow, TOKEN)
    time.sleep(0.3)
    flow.start()
    time.sleep(RUN_S)
    status, _ = peer.client.get("/v1/snapshot")
    assert status == 401  # the snapshot holds the registry: it needs the token
    new = servers("--api-token-file", str(token_file), "--bootstrap-from", f"http://127.0.0.1:{peer.port}")
    assert [e["id"] for e in new.client.get("/v1/engines")[1]] == ["e0", "e1"]
    time.sleep(0.5)
    _settle(flow, new.client, peer.client)
    assert _answers(new.client) == _answers(peer.client) == _ref_answers(flow)
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
    time.sleep(0.3)
    for _ in range(5):
        flow.step()
    _caught_up(svc.client, flow)
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=20)
    conn.request("GET", "/v1/snapshot")
    r = conn.getresponse()
    data = r.read()
    assert r.status == 200 and r.getheader("content-type") == "application/octet-stream"
    assert data[:8] == b"KVISNAP\0" and int.from_bytes(data[8:12], "big") == 1
    assert int.from_bytes(data[16:24], "big") == len(data) - 32
