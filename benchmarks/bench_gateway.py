"""The gateway in front of real vLLM engines, against vllm-router and round robin.

Real engines: vLLM's CPU build (the real-engine tier's ``.venv-engine``), the tier's tiny
random-weight Llama (block size 32, ``--num-gpu-blocks-override`` small enough that the
workload does not fit in one engine), on 127.0.0.1. The same requests go through each
front, on caches emptied before each run (``POST /reset_prefix_cache``, fronts restarted):

* ``kvi``: ``kv-indexer serve`` with the engines' ``api_url`` (the gateway), routing by the
  index with no load from the caller;
* ``vllm-router cache_aware`` and ``round_robin`` (PyPI ``vllm-router``, its defaults),
  and ``kv_aware`` fed by the engines' ZMQ events (its closest mode to ours);
* ``direct round robin``: the client itself alternating over the engines (no proxy).

The requests: the Mooncake conversation trace's multi-turn conversations
(``../shared/data/mooncake``) scaled down to the fleet: ``--active`` of them in progress at a
time, their turns in turn (``prompts``), each ``hash_id`` a fixed run of ``--words`` words
(text prompts: vllm-router's tree is over text), at most ``--max-hashes`` per prompt, sent closed-loop by ``--concurrency`` clients with the official ``openai``
client, streamed with ``include_usage``. Reported per front, median of ``--runs`` runs
(min-max): the delivered cached share (the engines' own ``cached_tokens`` / prompt
tokens), mean and p90 time to first token, and the front's added latency: the median
of ``--latency-n`` sequential one-token requests through it minus the same sent to the
engine directly.

    .venv/bin/python benchmarks/bench_gateway.py [--engines 2] [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT / "tests" / "e2e" / "real")]

import openai  # noqa: E402
from _report import header, table  # noqa: E402
from svc import Server, wait_until  # noqa: E402
from vllm_engine import VllmEngine, free_port  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "KV", "caches", "hold", "keys", "and", "values", "of", "every", "prompt", "token", "routing", "by", "prefix", "reuses", "them", "helpful", "assistant", "answer", "briefly", "precisely", "user", "system", "tool", "zebra", "quantum", "lattice", "orbit", "vector"]
MODEL = "tiny"


def engine_python() -> str:
    venv = Path(os.environ.get("KVI_ENGINE_VENV", ROOT / ".venv-engine"))
    if not (venv / ".kvi-engine-env-ok").exists():
        sys.exit(f"no engine venv at {venv}: bash tests/e2e/real/engine_env.sh {venv}")
    return str(venv / "bin" / "python")


def router_bin() -> str:
    """vllm-router from PyPI, in a venv of its own (made once)."""
    venv = ROOT / ".venv-router"
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "vllm-router==0.1.17"], check=True)
    return str(exe)


def prompts(n: int, words: int, max_hashes: int, active: int) -> list[str]:
    """``n`` turns of the trace's multi-turn conversations (those whose first hash after the
    shared system prompt comes back), scaled down to this fleet: ``active`` conversations at
    a time, their turns taken in turn, a finished one replaced by the trace's next. The
    trace's own turns come minutes apart, long after a small cache has evicted the last one;
    here a conversation's next turn comes after the other active ones' turns, so whether it
    finds its earlier turns cached depends on where it is sent."""
    with open(TRACE) as f:
        reqs = [json.loads(line) for line in f]
    convs: dict[int, list[list[int]]] = {}
    for r in reqs:
        h = r["hash_ids"]
        if len(h) > 1:
            convs.setdefault(h[1], []).append(h[:max_hashes])
    queue = [turns for turns in convs.values() if len(turns) >= 2]
    chunk: dict[int, str] = {}

    def text(h: list[int]) -> str:
        for x in h:
            if x not in chunk:
                rng = random.Random(x)
                chunk[x] = " ".join(rng.choice(WORDS) for _ in range(words))
        return " ".join(chunk[x] for x in h)

    live = [queue.pop(0) for _ in range(min(active, len(queue)))]
    out = []
    while live and len(out) < n:
        for i in range(len(live)):
            if len(out) == n:
                break
            out.append(text(live[i].pop(0)))
            if not live[i] and queue:
                live[i] = queue.pop(0)
        live = [c for c in live if c]
    return out


class Front:
    """A proxy in front of the engines (or none): its base URL, started and stopped."""

    def __init__(self, name: str, engines: list[VllmEngine], model_dir: str, logdir: Path) -> None:
        self.name, self.engines, self.model_dir, self.logdir = name, engines, model_dir, logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.srv: Server | None = None
        self.url = ""

    def start(self) -> None:
        if self.name == "kvi":
            args = [a for e in self.engines for a in ("--engine", f"{e.config()},api_url={e.url}")]
            self.srv = Server(*args, "--tokenizer", f"{MODEL}={self.model_dir}")
            wait_until(lambda: all(w.get("connected") for w in self.srv.client.get("/v1/workers")[1]), 30)
            self.url = f"http://127.0.0.1:{self.srv.port}"
            return
        if self.name == "direct":
            return
        policy = self.name.split()[-1]
        port = free_port()
        cmd = [router_bin(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *[e.url for e in self.engines], "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for e in self.engines:
                cmd += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{e.zmq_port}",
                        "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{e.replay_port}"]
            cmd += ["--kv-event-block-size", "32", "--kv-event-model", MODEL]
        log = open(self.logdir / f"router-{policy}.log", "wb")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                    "PYTHONHASHSEED": "0"})
        self.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(self.url + "/v1/models"), 60, 0.1, msg=f"vllm-router {policy} up")

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.srv = None
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


async def drive(front: Front, texts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Every prompt once, ``concurrency`` at a time; TTFT and usage per request."""
    engines = front.engines
    clients = {e.url: openai.AsyncOpenAI(base_url=f"{e.url}/v1", api_key="x", max_retries=0, timeout=300)
               for e in engines}
    through = None if front.name == "direct" else openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x",
                                                                     max_retries=0, timeout=300)
    queue = list(enumerate(texts))
    ttft: list[float] = []
    prompt_tokens = cached = 0

    async def one(i: int, text: str) -> None:
        nonlocal prompt_tokens, cached
        oc = through or clients[engines[i % len(engines)].url]
        t0 = time.perf_counter()
        first = None
        stream = await oc.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        async for c in stream:
            if first is None and c.choices:
                first = time.perf_counter() - t0
            if c.usage is not None:
                prompt_tokens += c.usage.prompt_tokens
                d = c.usage.prompt_tokens_details
                cached += (d.cached_tokens or 0) if d is not None else 0
        ttft.append(first if first is not None else time.perf_counter() - t0)

    async def worker() -> None:
        while queue:
            i, text = queue.pop(0)
            await one(i, text)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    for oc in [*clients.values(), *([through] if through else [])]:
        await oc.close()
    ttft.sort()
    return {"cached_share": cached / prompt_tokens if prompt_tokens else 0.0, "ttft_mean": statistics.fmean(ttft),
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "wall_s": wall}


def added_latency(front: Front, n: int) -> float | None:
    """Median one-token request through the front minus the same sent to the engine
    that served it (a cached prompt: the engine's own time is the same both ways)."""
    if front.name == "direct":
        return None
    text = " ".join(WORDS[:40])
    oc = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0, timeout=60)
    raw = oc.completions.with_raw_response.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    worker = raw.headers.get("x-kvi-worker")
    eng = next((e for e in front.engines if worker and worker.startswith(e.name + "/")), front.engines[0])
    direct = openai.OpenAI(base_url=f"{eng.url}/v1", api_key="x", max_retries=0, timeout=60)

    def med(c: openai.OpenAI) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    # Interleaved halves: drift on the machine hits both alike.
    a = [med(oc), med(direct), med(oc), med(direct)]
    oc.close()
    direct.close()
    # A front without routing by prefix may send it to the other engine (uncached there once).
    return (a[0] + a[2]) / 2 - (a[1] + a[3]) / 2


def reset(engines: list[VllmEngine]) -> None:
    for e in engines:
        e.call("/reset_prefix_cache", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--words", type=int, default=40, help="words per hash_id (~2 blocks of 32 tokens)")
    ap.add_argument("--max-hashes", type=int, default=10)
    ap.add_argument("--active", type=int, default=17,
                    help="conversations in progress at once (more than one engine's cache holds; odd, so that "
                    "round robin does not send a conversation's turns to one engine by accident)")
    ap.add_argument("--gpu-blocks", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--latency-n", type=int, default=40)
    ap.add_argument("--fronts", default="kvi,vllm-router cache_aware,vllm-router kv_aware,vllm-router round_robin,direct")
    ap.add_argument("--quick", action="store_true", help="1 run of 60 requests")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.runs, a.requests, a.latency_n = 1, 120, 15
    if not TRACE.exists():
        sys.exit(f"the trace is not at {TRACE}")
    py = engine_python()
    work = Path(tempfile.mkdtemp(prefix="kvi-bench-gw-"))
    model = work / "model"
    subprocess.run([py, str(ROOT / "tests" / "e2e" / "real" / "make_model.py"), str(model)], check=True,
                   capture_output=True)
    texts = prompts(a.requests, a.words, a.max_hashes, a.active)
    engines = [VllmEngine(py, str(model), f"e{i}", work, gpu_blocks=a.gpu_blocks, max_model_len=1024)
               for i in range(a.engines)]
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_up()
        fronts = [Front(n.strip(), engines, str(model), work) for n in a.fronts.split(",")]
        for run in range(a.runs):
            for f in fronts:
                reset(engines)
                f.start()
                try:
                    got = asyncio.run(drive(f, texts, a.concurrency, a.max_tokens))
                    got["added_s"] = added_latency(f, a.latency_n)
                    if f.srv is not None:  # the gateway's own time per request, by its metric
                        m = f.srv.client.metrics()
                        n = m.get(("kvi_gateway_overhead_seconds_count", frozenset()), 0)
                        got["own_s"] = m.get(("kvi_gateway_overhead_seconds_sum", frozenset()), 0) / n if n else None
                except Exception as e:  # a front that cannot run here is reported, not hidden
                    got = {"error": repr(e)[:200]}
                finally:
                    f.stop()
                results.setdefault(f.name, []).append(got)
                print(f"run {run + 1} {f.name}: {got}", file=sys.stderr, flush=True)
    finally:
        for e in engines:
            e.kill()
        shutil.rmtree(work, ignore_errors=True)
    report(results, a)


def _med(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3g} ({min(vals):.3g}-{max(vals):.3g})"


def report(results: dict[str, list[dict[str, Any]]], a: argparse.Namespace) -> None:
    header(f"gateway vs vllm-router on {a.engines} real CPU engines: {a.requests} Mooncake requests, "
           f"concurrency {a.concurrency}, {a.runs} run(s)", a)
    rr = [r["cached_share"] for r in results.get("direct", []) if "cached_share" in r]
    rows = []
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append([name, runs[0].get("error", "?"), "", "", "", "", ""])
            continue
        share = [r["cached_share"] for r in ok]
        vs_rr = _med([s / statistics.median(rr) for s in share]) if rr and statistics.median(rr) else "-"
        added = [r["added_s"] * 1e3 for r in ok if r.get("added_s") is not None]
        own = [r["own_s"] * 1e3 for r in ok if r.get("own_s") is not None]
        rows.append([name, _med(share), vs_rr, _med([r["ttft_mean"] * 1e3 for r in ok]),
                     _med([r["ttft_p90"] * 1e3 for r in ok]), _med(added), _med(own)])
    print(table(["front", "cached share", "x direct RR", "TTFT mean ms", "TTFT p90 ms", "added ms/request",
                 "own ms/request"], rows))
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
