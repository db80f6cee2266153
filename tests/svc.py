"""Helpers for the HTTP tests: a real ``kv-indexer serve`` process on 127.0.0.1, a
keep-alive JSON client, and ``/metrics`` parsed with prometheus_client's own parser."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Server(Child):
    """``kv-indexer serve`` as a child process, answering /healthz once built."""

    def __init__(self, *args: str, env: dict | None = None, preexec_fn=None) -> None:
        self.port = free_port()
        super().__init__(["serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
                         Path(os.environ.get("TMPDIR", "/tmp")) / f"kvi-serve-{self.port}.log", env, preexec_fn)
        deadline = time.monotonic() + 30
        self.client = Client(self.port)  # one connection for the probes and the test after
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kv-indexer serve exited {self.proc.returncode}: {self.output()}")
                try:
                    if self.client.get("/healthz")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kv-indexer serve did not answer: {self.output()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()  # nobody else holds this server yet: its process, log and socket end here
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


def wait_subscribed(client: Client, pub, engine: str, rank: int = 0) -> None:
    """Wait until the service's subscription to ``engine``/``rank`` is live (a PUB drops
    what it sends before that): one-frame probes, counted as ``bad_frame_count`` drops,
    until the service has received one."""

    def got():
        pub.send_raw([b"probe"])
        return any(w["engine"] == engine and w["dp_rank"] == rank and w.get("messages")
                   for w in client.get("/v1/workers")[1])

    wait_for(got, what=f"{engine}/{rank} to receive a probe")
