"""Our service and NVIDIA Dynamo's standalone indexer, side by side, as their users run them.

Both servers are started as users start them: ``kv-indexer serve`` (``python -m api.cli
serve``: one uvicorn worker, defaults) and ``python -m dynamo.indexer`` from
``.venv-dynamo`` (ai-dynamo-runtime, its defaults: 4 indexer threads), neither pinned
to a CPU. Each run starts both in fresh processes, one after the other (odd runs in
reverse order): each ingests alone (the other idle), then both answer the latency queries
in alternating slices. Same frames, same queries.

**Workload** (``--entries`` N, ``--workers`` W, 64 blocks of 16 tokens a sequence): each
of W engines caches N / (64 W) sequences of 1,024 tokens; every 10th sequence is
identical on all engines, the others are the engine's own. One engine publishes each
sequence as one vLLM 0.33 ``BlockStored`` batch of 64 blocks with its token ids (no
parent), one event per message, as an engine that computed a whole prompt in one step
does. Engine block hashes are arbitrary 64-bit values (neither side uses them for
matching). Token ids are uniform in [0, 32000). Frames go out over real ZMQ PUB sockets
on 127.0.0.1 (one per engine, vLLM's three frames), round robin over the engines.

**What is measured** (``--mode ingest``, the default), per server and run:

* *ingest*: from the first frame sent until every engine's **last** sequence is fully
  matched through the server's own query route (``POST /query``, polled one engine at a
  time with pauses of 2% of the elapsed time; an answer, not a counter). blocks/s =
  stored blocks / that time.
* *CPU*: user + system CPU time of the server's process tree (all threads) over the
  ingest, per block: what the ingest costs whatever else shares the machine.
* *memory*: RSS growth of the server's whole process tree (the process and its
  children, from ``/proc``) from just before the first frame, per resident (engine,
  block) entry, twice: *peak*, the highest RSS sampled every 10 ms from a thread while
  the burst is received and applied (what a pod is sized for: the backlog waiting in
  receive queues counts), and *settled*, 1 s after the last sequence matched.
* *query*: ``--calls`` keep-alive ``POST /query`` of 1,024 tokens that every engine
  holds whole (the most work per answer) over one ``http.client`` connection per server,
  after ``--warmup``, in 10 slices alternating between the two servers (round-trip times
  on this VM drift by 10-15% over minutes; sequential runs put that drift into the
  ratio): median and p99 of the round trip. Both servers get the same body on
  the same route (ours implements Dynamo's ``/query``; ``--our-route /v1/match``
  measures our native route instead).
* *answers*: ``--agree`` queries (full hits on shared and own sequences, a shared
  512-token prefix then a new tail, misses), each engine's matched GPU tokens compared
  between the servers: they must be identical.

Figures are medians over ``--runs`` (default 3) fresh runs with min-max, and the ratio
ours/Dynamo of the medians. ``--json FILE`` also writes every run's figures.

``--mode load``: query latency under sustained ingest. Each server gets the workload
first (as above), then ``--rates`` paced ingest rates (blocks/s over all engines, new
sequences) while one client sends ``/query`` back to back for ``--seconds``, in 5 slices
alternating between the two servers (the other one idle): p50, p90, p99 and p99.9, and each run's own p99 ratio.

Many engines: ``--workers 256`` (the query prompt is held whole by every engine, so each
answer names all 256).

    .venv/bin/python benchmarks/bench_services.py --entries 1500000 --runs 3
    .venv/bin/python benchmarks/bench_services.py --mode load --entries 1000000 --rates 50000 150000 300000
    .venv/bin/python benchmarks/bench_services.py --workers 256 --entries 1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _report import DYNAMO_PY, ROOT, machine, peer_available, percentile, table  # noqa: E402
from bench_http import Client, free_port, latency, timed_calls, wait_http  # noqa: E402

from indexer.producer.events import Stored, encode_batch  # noqa: E402
from indexer.producer.publisher import VllmPublisher  # noqa: E402

BLOCKS, BLOCK_SIZE, VOCAB = 64, 16, 32000
TOKENS = BLOCKS * BLOCK_SIZE


# ----------------------------------------------------------------------- workload


class Workload:
    """Per engine, its sequences' token rows and vLLM payloads (built once, reused by every run)."""

    def __init__(self, entries: int, workers: int, seed: int = 7) -> None:
        self.workers = workers
        self.seqs = max(2, entries // (BLOCKS * workers))
        self.entries = self.seqs * workers * BLOCKS
        rng = np.random.default_rng(seed)
        self.shared = rng.integers(0, VOCAB, size=(self.seqs // 10 + 1, TOKENS), dtype=np.uint16)
        self.own = [np.random.default_rng((seed, w)).integers(0, VOCAB, size=(self.seqs, TOKENS), dtype=np.uint16)
                    for w in range(workers)]
        self.payloads: list[list[bytes]] = []
        for w in range(workers):
            pls = []
            for s in range(self.seqs):
                shared = s % 10 == 0
                toks = self.tokens(w, s)
                base = (1 << 62) | (s << 7) if shared else ((w + 1) << 40) | (s << 7)
                ev = Stored(block_hashes=list(range(base, base + BLOCKS)), parent_block_hash=None, token_ids=toks,
                            block_size=BLOCK_SIZE, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")
                pls.append(encode_batch([ev], ts=1767225600.0 + s, dp_rank=0, version="0.33"))
            self.payloads.append(pls)
        # The last sequence of each engine is its own (never a shared one), so "matched" means
        # that engine's last batch is applied.
        self.last = self.seqs - 1 if (self.seqs - 1) % 10 else self.seqs - 2

    def tokens(self, w: int, s: int) -> list[int]:
        return (self.shared[s // 10] if s % 10 == 0 else self.own[w][s]).tolist()

    def interleaved(self):
        """(engine, payload), round robin over the engines."""
        for s in range(self.seqs):
            for w in range(self.workers):
                yield w, self.payloads[w][s]

    def agreement_queries(self, n: int, seed: int = 11) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        out = []
        for k in range(n):
            kind = k % 4
            w, s = int(rng.integers(self.workers)), int(rng.integers(self.seqs))
            if kind == 0:
                out.append(self.shared[s // 10].tolist())
            elif kind == 1:
                out.append(self.tokens(w, s))
            elif kind == 2:
                out.append(self.tokens(w, s)[:512] + rng.integers(0, VOCAB, 512).tolist())
            else:
                out.append(rng.integers(0, VOCAB, TOKENS).tolist())
        return out


# ----------------------------------------------------------------------- servers


def start(kind: str, port: int, state_dir: str | None = None) -> subprocess.Popen:
    """A server as its users start it: defaults, no CPU pinning (ours with ``state_dir``:
    snapshots there, loaded at start)."""
    if kind == "ours":
        env = dict(os.environ, KVI_LOG_LEVEL="warning")
        if state_dir is not None:
            env["KVI_STATE_DIR"] = state_dir
        p = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)], cwd=ROOT, env=env)
        wait_http(port, "/healthz")
    else:
        p = subprocess.Popen([str(DYNAMO_PY), "-m", "dynamo.indexer", "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(port, "/health")
    return p


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by ``pid`` and its descendants."""
    ticks = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and all its descendants, bytes."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class PeakRss:
    """The highest RSS of a process tree, sampled every ``interval_s`` from a thread
    while the ``with`` block runs (``peak``, bytes).

    The tree is read once at the start (a server forks no workers during ingest), and
    each sample reads ``/proc/PID/statm`` only: walking ``/proc`` every 10 ms would cost
    the machine's two cores more than the sampling is worth."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self.pids = _tree(pid)
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def sample(self) -> int:
        total = 0
        for p in self.pids:
            try:
                with open(f"/proc/{p}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.sample())
            self.samples += 1
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


@contextmanager
def serving(kind: str, workers: int, our_route: str, state_dir: str | None = None):
    """A fresh server of ``kind`` with ``workers`` publishers registered and subscribed:
    yields (server process, client, publishers, query path); stops them all after."""
    port = free_port()
    srv = start(kind, port, state_dir)
    pubs = [VllmPublisher("tcp://127.0.0.1:*", hwm=0) for _ in range(workers)]
    try:
        c = Client(port)
        register(c, pubs)
        time.sleep(1.0)  # the SUB sockets connect before the first frame (PUB drops otherwise)
        yield srv, c, pubs, our_route if kind == "ours" else "/query"
    finally:
        for pub in pubs:
            pub.close()
        srv.terminate()
        srv.wait(30)


def query_body(tokens: list[int]) -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": "default"}).encode()


def matched(client: Client, path: str, body: bytes) -> dict[int, int]:
    """Matched GPU tokens per engine (instance id) for one query."""
    status, raw = client.call("POST", path, body)
    if status != 200:
        raise RuntimeError(f"{path} answered {status}: {raw[:200]!r}")
    doc = json.loads(raw)
    if "instances" in doc:  # Dynamo's /query shape (ours on /query too)
        return {int(k): v["gpu"] for k, v in doc["instances"].items() if v["gpu"]}
    return {int(w["engine"]): w["tiers"].get("GPU", 0) * BLOCK_SIZE for w in doc["workers"] if w["tiers"].get("GPU")}


def register(client: Client, pubs: list[VllmPublisher]) -> None:
    for i, pub in enumerate(pubs):
        body = json.dumps({"instance_id": i, "endpoint": pub.live_endpoint, "model_name": "default",
                           "block_size": BLOCK_SIZE}).encode()
        status, raw = client.call("POST", "/register", body)
        if status >= 300:
            raise RuntimeError(f"/register answered {status}: {raw!r}")


def latency_us(client: Client, path: str, body: bytes, calls: int, warmup: int) -> tuple[float, float]:
    """Median and p99 of ``calls`` round trips (bench_http.latency), microseconds."""
    r = latency(client, path, body, calls, warmup)
    return r["median_us"], r["p99_us"]


def ingest(client: Client, pubs: list[VllmPublisher], wl: Workload, path: str, timeout: float = 900) -> float:
    """Publish the whole workload; seconds until every engine's last sequence fully matches.

    One query at a time, for the first engine not yet matched, then a pause of 2% of the
    time so far (1-10 ms): the polling costs the server ~1% of a core, and the clock's
    resolution is ~2% of the figure. (Polling every engine every 2 ms kept a third of a
    core busy answering.)"""
    pending = [(w, query_body(wl.tokens(w, wl.last))) for w in range(wl.workers)]
    t0 = time.perf_counter()
    for w, payload in wl.interleaved():
        pubs[w].publish_payload(payload)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        w, body = pending[0]
        if matched(client, path, body).get(w) == TOKENS:
            pending.pop(0)
            continue
        time.sleep(min(0.01, max(0.001, (time.perf_counter() - t0) / 50)))
    if pending:
        raise RuntimeError(f"engines {[w for w, _ in pending]} not fully matched after {timeout} s")
    return time.perf_counter() - t0


# ----------------------------------------------------------------------- modes


def interleaved_latency(clients: dict[str, tuple[Client, str]], body: bytes, calls: int, warmup: int,
                        rounds: int = 10) -> dict[str, tuple[float, float]]:
    """Median and p99 (us) per server of ``calls`` round trips, taken in ``rounds`` slices that
    alternate between the servers (the first server of each round alternates too): latency on
    this VM drifts by 10-15% over minutes, and alternating puts both under the same drift."""
    for c, path in clients.values():
        for _ in range(warmup):
            c.call("POST", path, body)
    ns: dict[str, list[int]] = {k: [] for k in clients}
    order = list(clients)
    per = max(1, calls // rounds)
    for r in range(rounds):
        for kind in (order if r % 2 == 0 else order[::-1]):
            c, path = clients[kind]
            timed_calls(c, path, body, per, ns[kind])
    return {k: (statistics.median(v) / 1e3, percentile(sorted(v), 99) / 1e3) for k, v in ns.items()}


def warm_memory(entries: int) -> None:
    """Touch and free ~400 B per entry (at least 256 MiB) just before a server ingests.

    Why: on this VM (Firecracker) the kernel hands free 2 MiB blocks back to the host
    (free page reporting: virtio_balloon, page_reporting_order 9), and the host backs
    such a page again on its first touch at several times the cost of a fault. Memory
    a process freed a moment ago is still backed; the rest is not. So whichever server
    ingested first, right after this script built the workload and freed its scratch
    memory, got backed pages and the other one did not: the same build read 1.6-2.0 M
    blocks/s first and 1.1-1.2 M second at 10^7 entries, whatever the server. Freeing a
    backed region right before each ingest gives both servers the same start (on an
    ordinary host it only costs the touch)."""
    n = max(256 << 20, 400 * entries)
    buf = np.ones(n // 8, dtype=np.int64)  # every page written
    del buf


def run_ingest(args, wl: Workload, kinds: list[str]) -> dict:
    body = query_body(wl.shared[0].tolist())  # sequence 0 is shared: held whole by every engine
    agree = [query_body(t) for t in wl.agreement_queries(args.agree)]
    route_body = json.dumps({"token_ids": wl.shared[0].tolist(), "model": "default"}).encode()
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    answers: dict[str, list] = {}
    for r in range(args.runs):
        with ExitStack() as up:
            live: dict[str, tuple[Client, str]] = {}
            figs: dict[str, dict] = {}
            procs: dict[str, tuple[subprocess.Popen, int, list]] = {}
            state_dir = up.enter_context(tempfile.TemporaryDirectory()) if args.restart else None
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                # Each server ingests alone (the other one, if up, is idle: no frames, no queries).
                srv, c, pubs, path = up.enter_context(serving(kind, wl.workers, args.our_route,
                                                              state_dir if kind == "ours" else None))
                gc.collect()
                warm_memory(wl.entries)
                rss0, cpu0 = tree_rss(srv.pid), tree_cpu(srv.pid)
                with PeakRss(srv.pid) as peak:
                    secs = ingest(c, pubs, wl, path)
                cpu = tree_cpu(srv.pid) - cpu0
                time.sleep(1.0)
                grown = tree_rss(srv.pid) - rss0
                got = [matched(c, path, b) for b in agree]
                base = answers.setdefault("first", got)
                same = sum(a == b for a, b in zip(got, base))
                figs[kind] = {"ingest_s": secs, "blocks_per_s": wl.entries / secs, "rss_growth": grown,
                              "cpu_us_per_block": cpu / wl.entries * 1e6,
                              "bytes_per_entry": grown / wl.entries,
                              "peak_bytes_per_entry": (peak.peak - rss0) / wl.entries, "answers_equal": same, "answers": len(agree)}
                if kind == "ours":  # routing (cache, in-flight load, predictions): no Dynamo twin
                    figs[kind]["route_median_us"], figs[kind]["route_p99_us"] = latency_us(
                        c, "/v1/route", route_body, args.calls, args.warmup)
                live[kind] = (c, path)
                procs[kind] = (srv, rss0, got)
            lat = interleaved_latency(live, body, args.calls, args.warmup)
            if state_dir is not None:
                srv, rss0, got = procs["ours"]
                figs["ours"].update(restart(srv, state_dir, agree, got, rss0, wl.entries, live["ours"][1]))
            for kind, (med, p99) in lat.items():
                fig = figs[kind]
                fig["query_median_us"], fig["query_p99_us"] = med, p99
                runs[kind].append(fig)
                print(f"[run {r + 1} {kind:6}] ingest {fig['ingest_s']:6.2f} s ({fig['blocks_per_s']:,.0f} blocks/s), "
                      f"peak {fig['peak_bytes_per_entry']:.1f} settled {fig['bytes_per_entry']:.1f} B/entry, query median {med:.1f} us p99 {p99:.1f} us, "
                      f"answers equal {fig['answers_equal']}/{fig['answers']}", flush=True)
    return runs


def restart(srv: subprocess.Popen, state_dir: str, agree: list[bytes], before: list, rss0: int, entries: int,
            path: str) -> dict:
    """Stop our server (SIGTERM: it writes its snapshot), start a new one on the same state
    directory and time it: the stop, the start until /healthz answers, until the ``agree``
    queries give the answers they gave before. Also the snapshot's size and the new
    process's RSS over the first one's before ingest, per entry."""
    t = time.perf_counter()
    srv.send_signal(signal.SIGTERM)
    srv.wait(600)
    stop_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in Path(state_dir).rglob("*") if f.is_file())
    port = free_port()
    t = time.perf_counter()
    new = start("ours", port, state_dir)  # returns once /healthz answers
    up_s = time.perf_counter() - t
    try:
        c = Client(port)
        while [matched(c, path, b) for b in agree] != before:
            if time.perf_counter() - t > 600:
                raise RuntimeError("the restarted server did not give the same answers within 600 s")
            time.sleep(0.05)
        answers_s = time.perf_counter() - t
        time.sleep(1.0)
        rss = tree_rss(new.pid)
    finally:
        new.terminate()
        new.wait(60)
    print(f"[restart] stop {stop_s:.2f} s (snapshot {size / entries:.1f} B/entry), up {up_s:.2f} s, "
          f"same answers {answers_s:.2f} s, {(rss - rss0) / entries:.1f} B/entry", flush=True)
    return {"restart_stop_s": stop_s, "restart_up_s": up_s, "restart_answers_s": answers_s,
            "snapshot_bytes_per_entry": size / entries, "restored_bytes_per_entry": (rss - rss0) / entries}


def summarize(runs: dict[str, list[dict]], keys: list[tuple[str, str]]) -> list[list]:
    """Rows: figure, per server median [min-max], ratio ours/Dynamo of the medians."""
    rows = []
    for key, label in keys:
        row = [label]
        meds = {}
        for kind, figs in runs.items():
            xs = [f[key] for f in figs if key in f]
            if not xs:
                row.append("-")
                continue
            meds[kind] = statistics.median(xs)
            row.append(f"{_num(meds[kind])} [{_num(min(xs))}-{_num(max(xs))}]")
        if "ours" in meds and "dynamo" in meds and meds["dynamo"]:
            row.append(f"{meds['ours'] / meds['dynamo']:.2f}x")
        rows.append(row)
    return rows


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _paced(pubs: list[VllmPublisher], payloads: list[tuple[int, bytes]], rate_blocks: float, stop) -> int:
    """Publish ``payloads`` round robin at ``rate_blocks`` blocks/s until done or ``stop``; returns batches sent."""
    per_s = rate_blocks / BLOCKS
    t0 = time.perf_counter()
    for n, (w, payload) in enumerate(payloads):
        if stop.is_set():
            return n
        due = t0 + n / per_s
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        pubs[w].publish_payload(payload)
    return len(payloads)


def _loaded_slice(c: Client, path: str, body: bytes, pubs: list[VllmPublisher], chunk: list, rate: float,
                  seconds: float, ns: list[int]) -> None:
    """Publish ``chunk`` at ``rate`` blocks/s while sending ``body`` back to back for ``seconds``;
    the round trips (ns) are appended to ``ns``."""
    stop = threading.Event()
    t = threading.Thread(target=_paced, args=(pubs, chunk, rate, stop), daemon=True)
    pc = time.perf_counter_ns
    for _ in range(20):
        c.call("POST", path, body)
    t.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and t.is_alive():
        t0 = pc()
        c.call("POST", path, body)
        ns.append(pc() - t0)
    stop.set()
    t.join()


def run_load(args, wl: Workload, extra: Workload, kinds: list[str], slices: int = 5) -> dict:
    """Query p50/p99 while ``extra``'s sequences stream in at each rate (after ``wl`` is loaded).

    Both servers are up (each loaded ``wl`` alone); each rate's ``--seconds`` are cut in
    ``slices`` that alternate between the servers, each slice streaming the next sequences
    into that server only (the other one idle): as for the idle latency, the VM's drift
    lands on both."""
    body = query_body(wl.shared[0].tolist())
    out: dict[str, dict[int, list[tuple[float, float, float]]]] = {k: {} for k in kinds}
    stream = list(extra.interleaved())
    for r in range(args.runs):
        with ExitStack() as up:
            live = {}
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                _, c, pubs, path = up.enter_context(serving(kind, wl.workers, args.our_route))
                ingest(c, pubs, wl, path)
                live[kind] = (c, path, pubs)
            pos = dict.fromkeys(kinds, 0)
            for rate in args.rates:
                n = int(rate / BLOCKS * args.seconds / slices)
                ns: dict[str, list[int]] = {k: [] for k in kinds}
                for sl in range(slices):
                    for kind in (kinds if (r + sl) % 2 == 0 else kinds[::-1]):
                        c, path, pubs = live[kind]
                        _loaded_slice(c, path, body, pubs, stream[pos[kind]:pos[kind] + n], rate,
                                      args.seconds / slices, ns[kind])
                        pos[kind] += n
                        time.sleep(0.2)  # the slice's last batches applied before the other server's turn
                for kind in kinds:
                    v = sorted(ns[kind])
                    got = (percentile(v, 50) / 1000, percentile(v, 99) / 1000, len(v),
                           percentile(v, 90) / 1000, percentile(v, 99.9) / 1000)
                    out[kind].setdefault(rate, []).append(got)
                    print(f"[run {r + 1} {kind:6}] ingest {rate:,} blocks/s: query p50 {got[0]:.1f} us "
                          f"p90 {got[3]:.1f} us p99 {got[1]:.1f} us p99.9 {got[4]:.1f} us ({got[2]} queries)",
                          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["ingest", "load"], default="ingest")
    ap.add_argument("--entries", type=float, nargs="+", default=[1.5e6])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--agree", type=int, default=400)
    ap.add_argument("--our-route", default="/query", help="our query route: /query (Dynamo's shape) or /v1/match")
    ap.add_argument("--rates", type=int, nargs="+", default=[50_000, 150_000, 300_000, 600_000])
    ap.add_argument("--seconds", type=float, default=5.0, help="--mode load: seconds per rate")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--restart", action="store_true",
                    help="ours with a state directory: after each run, a restart from its snapshot, timed")
    ap.add_argument("--json", help="write every run's figures to this file")
    args = ap.parse_args()
    kinds = ["ours"] + ([] if args.no_peer or not peer_available() else ["dynamo"])
    print(f"# services side by side: {', '.join(kinds)}; {machine()}")
    print(f"# command: {' '.join([Path(sys.executable).name] + sys.argv)}")
    print("# ours: python -m api.cli serve --port P (defaults); Dynamo: python -m dynamo.indexer --port P "
          "(defaults: --threads 4); neither pinned\n", flush=True)
    gc.freeze()
    report: dict = {"mode": args.mode, "machine": machine(), "argv": sys.argv, "results": []}
    for entries in args.entries:
        t = time.perf_counter()
        wl = Workload(int(entries), args.workers)
        print(f"## {wl.entries:,} entries: {args.workers} engines x {wl.seqs:,} sequences x {BLOCKS} blocks, "
              f"one 64-block BlockStored per message (workload built in {time.perf_counter() - t:.1f} s)", flush=True)
        if args.mode == "load":
            rate_total = sum(args.rates) * args.seconds * 1.2
            extra = Workload(int(rate_total), args.workers, seed=99)
            res = run_load(args, wl, extra, kinds)
            rows = []
            for rate in args.rates:
                row: list = [f"{rate:,}"]
                meds = {}
                for kind in kinds:
                    got = res[kind][rate]
                    p50, p90, p999 = (statistics.median(g[i] for g in got) for i in (0, 3, 4))
                    p99s = [g[1] for g in got]
                    meds[kind] = statistics.median(p99s)
                    row += [f"{p50:.1f}", f"{p90:.1f}", f"{meds[kind]:.1f} [{min(p99s):.1f}-{max(p99s):.1f}]",
                            f"{p999:.1f}"]
                if len(kinds) == 2:
                    # The ratio of the medians, and each run's own ratio (both servers measured in
                    # the same run, alternating slices): how often ours is the lower p99.
                    per_run = [a[1] / b[1] for a, b in zip(res["ours"][rate], res["dynamo"][rate])]
                    row += [f"{meds['ours'] / meds['dynamo']:.2f}x",
                            " ".join(f"{x:.2f}" for x in per_run) + f" (median {statistics.median(per_run):.2f})"]
                rows.append(row)
            heads = ["ingest blocks/s"] + [h for k in kinds for h in (f"{k} p50 us", f"{k} p90 us",
                                                                      f"{k} p99 us [min-max]", f"{k} p99.9 us")]
            print(table(heads + (["p99 ours/Dynamo", "per run"] if len(kinds) == 2 else []), rows,
                        f"query latency under paced ingest, medians of {args.runs} runs"), flush=True)
            report["results"].append({"entries": wl.entries, "load": {k: {str(r): v for r, v in d.items()}
                                                                      for k, d in res.items()}})
            continue
        runs = run_ingest(args, wl, kinds)
        keys = [("blocks_per_s", "ingest blocks/s"), ("peak_bytes_per_entry", "peak RSS during the burst B/entry"),
                ("bytes_per_entry", "settled RSS (1 s after) B/entry"),
                ("query_median_us", "query median us"), ("query_p99_us", "query p99 us"),
                ("ingest_s", "ingest s"),
                ("cpu_us_per_block", "server CPU us per block ingested")]
        if args.calls:
            keys += [("route_median_us", "our /v1/route median us"),
                     ("route_p99_us", "our /v1/route p99 us")]
        if args.restart:
            keys += [("restart_stop_s", "our stop (writes the snapshot) s"),
                     ("snapshot_bytes_per_entry", "our snapshot B/entry"),
                     ("restart_up_s", "our restart until /healthz s"),
                     ("restart_answers_s", "our restart until the same answers s"),
                     ("restored_bytes_per_entry", "our RSS after restart B/entry")]
        print(table(["figure"] + [f"{k} median [min-max]" for k in kinds] + (["ours/Dynamo"] if len(kinds) == 2
                                                                               else []),
                    summarize(runs, keys), f"{wl.entries:,} entries, {args.workers} engines, medians of "
                    f"{args.runs} runs; answers equal on {min(f['answers_equal'] for v in runs.values() for f in v)}"
                    f"/{args.agree} queries in every run"), flush=True)
        report["results"].append({"entries": wl.entries, "workers": args.workers, "runs": runs})
        del wl
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
