"""The wall-clock pieces of ``bench_live_routing.py``: simulated vLLM engines that prefill
FIFO on the wall clock behind real ZMQ publishers, ``kv-indexer serve`` child processes,
a throwaway ``nats-server``, and a keep-alive HTTP pool. Not a benchmark.

:class:`LiveFleet` models each engine as ``indexer.producer.fleet_time.simulate`` does,
on ``loop.time()`` instead of the trace's clock: a request admitted at *t* starts its
prefill at max(*t*, the engine's previous prefill end), computes what the engine's cache
lacks at ``tps`` tokens/s, and the engine publishes (``VllmPublisher``, vLLM 0.33
payloads) the GPU evictions it causes when it starts and the blocks it stores when it
ends, in the engine's own order. Nothing is delayed on purpose: what the index learns
late, it learns late through ZMQ, its ingest and HTTP.
"""

from __future__ import annotations

import asyncio
import heapq
import http.client
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from natsd import NatsServer  # noqa: E402

from indexer.producer.events import Removed
from indexer.producer.publisher import VllmPublisher
from indexer.producer.sim import SimEngine
from indexer.query.route import Load

ROOT = Path(__file__).resolve().parents[1]
RUNNING = re.compile(r"Uvicorn running on https?://[^\s:/\"]+:(\d+)")


class LiveFleet:
    """``n`` simulated engines ``sim-0/0`` .. on 127.0.0.1, each with a PUB and a replay
    ROUTER; their queues on the wall clock of ``loop``. ``tps``: prefill tokens/s (wall),
    ``decode_tps``: decode tokens/s (wall)."""

    def __init__(self, n: int, *, tps: float, decode_tps: float, gpu_blocks: int) -> None:
        self.tps, self.decode_tps = tps, decode_tps
        self.pubs = [VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True, buffer_steps=2000)
                     for _ in range(n)]
        self.captured: dict[str, list[list[Any]]] = {}
        self.sims: list[SimEngine] = []
        for i in range(n):
            got: list[list[Any]] = []
            self.sims.append(SimEngine(f"sim-{i}", 0, sink=got.append, gpu_blocks=gpu_blocks))
            self.captured[self.sims[-1].name] = got
        self.names = [s.name for s in self.sims]
        self.by_name = dict(zip(self.names, self.sims))
        self.pub_of = dict(zip(self.names, self.pubs))
        self.busy_until = dict.fromkeys(self.names, 0.0)
        self.decoding: dict[str, list[tuple[float, int]]] = {n_: [] for n_ in self.names}
        self.decode_blocks = dict.fromkeys(self.names, 0)
        self.outbox: dict[str, deque[tuple[float, list[Any]]]] = {n_: deque() for n_ in self.names}
        self.pending_publish = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    def engine_flags(self) -> list[str]:
        out = []
        for s, p in zip(self.sims, self.pubs):
            out += ["--engine", f"{s.engine}={p.live_endpoint},replay_endpoint={p.bound_replay_endpoint}"]
        return out

    def loads(self, now: float) -> dict[str, Load]:
        """Per engine: queued prefill tokens (the real backlog) and blocks decoding."""
        out = {}
        for n in self.names:
            d = self.decoding[n]
            while d and d[0][0] <= now:
                self.decode_blocks[n] -= heapq.heappop(d)[1]
            out[n] = Load(round(max(0.0, self.busy_until[n] - now) * self.tps), self.decode_blocks[n])
        return out

    def admit(self, name: str, tokens: list[int], output_length: int, now: float) -> tuple[float, int, float]:
        """Queue a request on engine ``name`` at wall time ``now``: (prefill end, hit tokens,
        decode end). Its events are published when due (:meth:`_flush`)."""
        eng = self.by_name[name]
        got = eng.serve(tokens)
        hit = (got.gpu_hit + got.cpu_hit) * eng.block_size
        begin = max(now, self.busy_until[name])
        done = begin + (len(tokens) - hit) / self.tps
        self.busy_until[name] = done
        cap = self.captured[name]
        if cap:
            events = cap.pop()
            early = [isinstance(ev, Removed) and getattr(ev, "medium", None) == "GPU" for ev in events]
            if any(early):
                self._post(name, begin, [ev for ev, e in zip(events, early) if e])
                events = [ev for ev, e in zip(events, early) if not e]
            if events:
                self._post(name, done, events)
        end = done + output_length / self.decode_tps
        blocks = math.ceil((len(tokens) + output_length) / eng.block_size)
        heapq.heappush(self.decoding[name], (end, blocks))
        self.decode_blocks[name] += blocks
        return done, hit, end

    def _post(self, name: str, at: float, events: list[Any]) -> None:
        box = self.outbox[name]
        box.append((at, events))
        self.pending_publish += 1
        if len(box) == 1:
            assert self.loop is not None
            self.loop.call_at(at, self._flush, name)

    def _flush(self, name: str) -> None:
        """Publish the engine's due batches in order, then wait for its next one."""
        assert self.loop is not None
        box, pub = self.outbox[name], self.pub_of[name]
        now = self.loop.time()
        while box and box[0][0] <= now + 0.0005:
            pub.publish(box.popleft()[1])
            self.pending_publish -= 1
        if box:
            self.loop.call_at(box[0][0], self._flush, name)

    def close(self) -> None:
        for p in self.pubs:
            p.close()


class HttpPool:
    """Blocking keep-alive JSON calls from a thread pool: one connection per thread and port."""

    def __init__(self) -> None:
        self.local = threading.local()

    def call(self, port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        conns = getattr(self.local, "conns", None)
        if conns is None:
            conns = self.local.conns = {}
        for attempt in (0, 1):
            c = conns.get(port)
            if c is None:
                c = conns[port] = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                c.request(method, path, body, {"content-type": "application/json"})
                r = c.getresponse()
                data = r.read()
                return r.status, json.loads(data) if data else None
            except (http.client.HTTPException, ConnectionError):
                c.close()
                conns.pop(port, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")


class Service:
    """``kv-indexer serve --port 0`` from this checkout, as a child process; ``port`` is what
    uvicorn says it bound. ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], label: str = "serve") -> None:
        fd, path = tempfile.mkstemp(prefix="kvi-live-", suffix=".log")
        os.close(fd)
        self.log_path = path
        self.log = open(path, "w+")  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                                      *args], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            m = RUNNING.search(self.output())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                out = self.output()
                self.stop()
                raise RuntimeError(f"{label} exited {self.proc.returncode} before listening:\n{out[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{label} did not listen within 60 s")
            time.sleep(0.05)

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
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log_path)


def wait_subscribed(pool: HttpPool, ports: list[int], fleet: LiveFleet, timeout: float = 60.0) -> None:
    """Until every service has received a frame from every engine (a PUB drops what it
    sends before a subscription is live): one-frame probes, counted there as bad frames."""
    deadline = time.monotonic() + timeout
    want = {(s.engine, 0) for s in fleet.sims}
    for port in ports:
        while True:
            for p in fleet.pubs:
                p.send_raw([b"probe"])
            st, ws = pool.call(port, "GET", "/v1/workers")
            seen = {(w["engine"], w["dp_rank"]) for w in ws or []
                    if w.get("messages") or w.get("dropped") or w.get("batches")}
            if st == 200 and want <= seen:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"service on port {port} did not receive every engine: {ws}")
            time.sleep(0.1)


class Nats:
    """A throwaway ``nats-server -js`` on 127.0.0.1 (the tests' :class:`natsd.NatsServer`, a
    port of its choosing, in a directory of its own); ``url``."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvi-live-nats-")
        self.server = NatsServer(self.dir)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
