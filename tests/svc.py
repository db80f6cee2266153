"""Helpers for the HTTP tests: a real ``kv-indexer serve`` process on 127.0.0.1, a
keep-alive JSON client, and ``/metrics`` parsed with prometheus_client's own parser."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


# uvicorn's start-up line names the port it bound (with --port 0 too: uvicorn.Server
# reads it back from the listening socket); JSON logs carry the same text in "msg".
RUNNING = re.compile(r"Uvicorn running on https?://(?:\[[^\]]+\]|[^\s:/\"]+):(\d+)")


class PortHold:
    """A 127.0.0.1 port held by this process: a socket bound (SO_REUSEADDR) and never
    listening. Nobody else can bind the port meanwhile, a connect to it is refused (an
    engine that is down), and a listener of ours or of a child that sets SO_REUSEADDR too
    (ZMQ, uvicorn, Go's nats-server) can still bind it: the engine coming up later on a
    port the index was told about up front, without a window where another process
    could take it. ``close()`` (or the ``with`` block) lets it go."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()

    stop = close  # for helpers that stop what they are given

    def __enter__(self) -> PortHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def endpoint_port(endpoint: str) -> int:
    """The port of a bound ``tcp://host:port`` endpoint (a ZMQ ``LAST_ENDPOINT``)."""
    return int(endpoint.rsplit(":", 1)[1])


def bind_ranks(make, n: int = 2, *, replay: bool = True, **kw) -> list:
    """Publishers of DP ranks 0..n-1 of one engine: rank r on the live (and replay) port
    base + r, as vLLM binds them. Rank 0 binds ephemeral ports itself and the others
    the ports right after; when one of those is taken the whole set is closed and
    tried again. ``make(endpoint, replay_endpoint, dp_rank=r, bind=True, **kw)`` makes
    one (``rig.pub``, or a wrapper around the ``pubs`` fixture)."""
    import zmq

    for _ in range(50):
        p0 = make("tcp://127.0.0.1:*", "tcp://127.0.0.1:*" if replay else None, dp_rank=0, bind=True, **kw)
        base = p0.live_endpoint
        rbase = p0.bound_replay_endpoint
        made = [p0]
        try:
            for r in range(1, n):
                made.append(make(base, rbase, dp_rank=r, bind=True, **kw))
            return made
        except zmq.ZMQError:
            for p in made:
                p.close()
    raise RuntimeError(f"no {n} consecutive free ports after 50 tries")


class Child:
    """A ``kv-indexer`` command as a child process, its output in ``log``; ``stop()`` ends it
    (SIGTERM, then SIGKILL after 10 s) and closes the log."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None, preexec_fn=None) -> None:
        self.log = open(log_path, "w+")  # noqa: SIM115 - open for the child's lifetime; stop() closes it
        self.proc = subprocess.Popen([sys.executable, "-m", "api.cli", *cmd], cwd=ROOT,
                                     env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_fn)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def bound_port(output, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> int:
    """The port a child's uvicorn bound, read from its start-up line in ``output()``
    (the child binds port 0 itself: no port is chosen here and bound later by someone
    else). Fails if the child exits or does not say within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = RUNNING.search(output())
        if m:
            return int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode} before listening: {output()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not log its listening port within {timeout}s (the start-up line "
                               f"'Uvicorn running on ...' is logged at level info): {output()}")
        time.sleep(0.02)


class Server(Child):
    """``kv-indexer serve`` as a child process on ``--port 0``: the child binds an
    ephemeral port itself and ``port`` is the one uvicorn says it bound; answering
    /healthz once built."""

    def __init__(self, *args: str, env: dict | None = None, preexec_fn=None) -> None:
        fd, log = tempfile.mkstemp(prefix="kvi-serve-", suffix=".log", dir=os.environ.get("TMPDIR"))
        os.close(fd)
        super().__init__(["serve", "--host", "127.0.0.1", "--port", "0", *args], Path(log), env, preexec_fn)
        try:
            self.port = bound_port(self.output, self.proc, "kv-indexer serve")
        except BaseException:
            super().stop()  # nobody else holds this server yet: its process and log end here
            raise
        self.client = Client(self.port)  # one connection for the probes and the test after

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv-indexer serve exited {self.proc.returncode}: {self.output()}")
            try:
                return self.client.get("/healthz")[0] == 200
            except OSError:
                return False

        try:
            wait_until(healthy, 30, 0.05, msg=lambda: f"kv-indexer serve to answer /healthz: {self.output()}")
        except BaseException:
            self.stop()  # its process, log and socket end here
            raise

    def stop(self) -> None:
        super().stop()
        self.client.close()


class Client:
    """One keep-alive connection; every call returns ``(status, parsed JSON or text)``.
    Every client made during a test has its connection closed after it (tests/conftest.py);
    a client kept longer reconnects on its next call."""

    opened: list[Client] = []

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        Client.opened.append(self)

    def close(self) -> None:
        self.conn.close()

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        h = {"content-type": "application/json", **(headers or {})}
        try:
            self.conn.request(method, path, body, h)
            r = self.conn.getresponse()
        except (http.client.HTTPException, ConnectionError):
            # The server may close a connection after an error: reconnect once.
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
            self.conn.request(method, path, body, h)
            r = self.conn.getresponse()
        data = r.read()
        ctype = r.getheader("content-type") or ""
        if ctype.startswith("application/json"):
            return r.status, json.loads(data)
        return r.status, data.decode("utf-8", "replace")

    def get(self, path: str):
        return self.call("GET", path)

    def post(self, path: str, doc) -> tuple[int, object]:
        return self.call("POST", path, json.dumps(doc).encode())

    def delete(self, path: str):
        return self.call("DELETE", path)

    def metrics(self) -> dict:
        """``{(sample name, frozenset(labels)): value}`` of one scrape."""
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out


def sample(m: dict, name: str, **labels) -> float:
    """One sample of a scrape, 0 when absent (a counter that never moved)."""
    return m.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def wait_until(cond, timeout: float = 5.0, interval: float = 0.005, msg=""):
    """Poll ``cond`` until it returns a truthy value; fail after ``timeout`` seconds
    (``msg`` may be a callable, evaluated only then)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {(msg() if callable(msg) else msg) or cond}")
        time.sleep(interval)


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    """``wait_until`` for the HTTP tests: a longer default and a gentler poll."""
    return wait_until(pred, timeout, 0.02, what)


def probe_until_received(send, received, what: str, timeout: float = 10.0, pause: float = 0.05) -> None:
    """A SUB's subscription is live once a message sent after it arrives (a PUB drops
    what it sends before): call ``send()`` (one probe) and wait up to ``pause`` seconds
    for ``received()`` to grow, again and again, failing after ``timeout`` seconds."""
    before = received()
    deadline = time.monotonic() + timeout
    while True:
        send()
        try:
            wait_until(lambda: received() > before, pause, 0.002)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} to receive a probe") from None


def wait_subscribed(client: Client, pub, engine: str, rank: int = 0) -> None:
    """Wait until the service's subscription to ``engine``/``rank`` is live (a PUB drops
    what it sends before that): one-frame probes, counted as ``bad_frame_count`` drops,
    until the service has received one."""

    def got():
        pub.send_raw([b"probe"])
        return any(w["engine"] == engine and w["dp_rank"] == rank and w.get("messages")
                   for w in client.get("/v1/workers")[1])

    wait_for(got, what=f"{engine}/{rank} to receive a probe")
