"""HTTP latency and throughput of the running service (``kv-indexer serve``).

What is measured:

* a real ``kv-indexer serve`` process (uvicorn, one worker; pinned only with ``--cpu``) fed
  over real ZMQ by one ``VllmPublisher`` per engine with the anchor workload
  (``workload.py``: ``--workers`` engines x ``--seqs`` sequences, plus two 512-block
  sequences per engine so 8,192-token prompts hit in full), engines registered over
  ``POST /v1/engines``;
* latency: one keep-alive ``http.client`` connection (the client pinned to the other
  CPU), ``--calls`` calls after ``--warmup``, ``POST /v1/match`` with 1,024 and 8,192
  tokens (a prompt every engine holds whole: the most work per answer), median and
  p99 of the round trip, and the handler's own time from ``/metrics``;
* throughput: ``--clients`` processes, each with its own keep-alive connection,
  for ``--seconds``: requests per second of 1,024-token ``/v1/match`` in total;
* the alternatives: the same server with the ASGI fast path (default) and with plain
  FastAPI routing (``KVI_FAST_PATH=false``);
* ``--peer``: NVIDIA Dynamo's standalone indexer (``python -m dynamo.indexer`` from
  ``.venv-dynamo``, its defaults, never pinned) subscribed to the same publishers, ``POST /query`` with the same
  prompts through the same client, and the ratio;
* ``--rounds`` (default 3): the servers take turns, one at a time, ``--rounds``
  times (fresh process and ingest each turn; odd rounds in reverse order); each
  ingest and latency figure is the median over the rounds, so drift of this shared
  VM over minutes lands on every server alike instead of on whichever ran last.
  Throughput runs in the first round.

Target: 1,024-token ``/v1/match`` median <= 250 us.

    .venv/bin/python benchmarks/bench_http.py [--quick] [--peer]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload as wl  # noqa: E402
from _report import DYNAMO_PY, ROOT, header, lat_stats_us, peer_available, ratio, table  # noqa: E402

from indexer.producer.publisher import VllmPublisher  # noqa: E402

TARGET_HTTP_MATCH_1K_US = 250.0
LONG_BLOCKS = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """A keep-alive JSON client (http.client: the cheapest Python client per call)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"content-type": "application/json"}

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        try:
            self.conn.request(method, path, body, self.headers)
            r = self.conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed the idle connection (uvicorn's keep-alive timeout is 5 s;
            # publishing 10^7 entries takes longer): once more on a new one.
            self.conn.close()
            self.conn.request(method, path, body, self.headers)
            r = self.conn.getresponse()
        return r.status, r.read()

    def json(self, method: str, path: str, doc=None):
        status, body = self.call(method, path, None if doc is None else json.dumps(doc).encode())
        return status, json.loads(body) if body else None


def wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", path)
            if c.getresponse().status < 500:
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing answered on port {port}{path}")


def start_ours(port: int, cpu: int, fast: bool) -> subprocess.Popen:
    env = dict(os.environ, KVI_FAST_PATH="true" if fast else "false", KVI_LOG_LEVEL="warning")
    cmd = [sys.executable, "-m", "api.cli", "serve", "--port", str(port)]
    if cpu >= 0:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    p = subprocess.Popen(cmd, cwd=ROOT, env=env)
    wait_http(port, "/healthz")
    return p


def start_dynamo(port: int) -> subprocess.Popen:
    # As its users run it: its defaults (4 indexer threads), on every CPU. Pinning it to
    # one CPU with --threads 1 (as this script once did) removes its parallelism and
    # costs our GIL-bound server nothing: not a comparison.
    cmd = [str(DYNAMO_PY), "-m", "dynamo.indexer", "--port", str(port)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(port, "/health")
    return p


def feed(pubs, payloads, done, timeout: float = 300, poll: float = 0.01) -> float:
    """Publish every payload and wait until ``done()`` says the server applied them all;
    returns seconds."""
    t0 = time.perf_counter()
    for pub, pls in zip(pubs, payloads):
        pub.publish_many(pls)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return time.perf_counter() - t0
        time.sleep(poll)
    raise RuntimeError("the service did not apply every batch in time")


def gpu_tokens(client: Client, path: str, body: bytes, block_size: int) -> dict:
    """Matched GPU tokens per engine, from our /v1/match or Dynamo's /query."""
    _, raw = client.call("POST", path, body)
    doc = json.loads(raw)
    if path == "/query":
        return {wl.engine_name(int(k)): v["gpu"] for k, v in doc["instances"].items() if v["gpu"]}
    return {w["engine"]: w["tiers"].get("GPU", 0) * block_size for w in doc["workers"] if w["tiers"].get("GPU")}


def timed_calls(client: Client, path: str, body: bytes, calls: int, ns: list[int]) -> None:
    """``calls`` round trips of ``POST path``, each appended to ``ns`` (nanoseconds); a non-200 raises."""
    pc = time.perf_counter_ns
    for _ in range(calls):
        t0 = pc()
        status, _ = client.call("POST", path, body)
        ns.append(pc() - t0)
        if status != 200:
            raise RuntimeError(f"{path} answered {status}")


def latency(client: Client, path: str, body: bytes, calls: int, warmup: int) -> dict:
    for _ in range(warmup):
        client.call("POST", path, body)
    ns: list[int] = []
    timed_calls(client, path, body, calls, ns)
    return lat_stats_us(ns)


def _throughput_client(port: int, path: str, body: bytes, seconds: float, cpu: int, q) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    c = Client(port)
    c.call("POST", path, body)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c.call("POST", path, body)
        n += 1
    q.put(n)


def throughput(port: int, path: str, body: bytes, clients: int, seconds: float, cpu: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_throughput_client, args=(port, path, body, seconds, cpu, q)) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(q.get() for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def samples(client: Client):
    """Every sample of one ``/metrics`` scrape (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, body = client.call("GET", "/metrics")
    for fam in text_string_to_metric_families(body.decode()):
        yield from fam.samples


def handler_us(client: Client, route: str) -> float | None:
    """Mean handler time of ``route`` from the service's own histogram."""
    got = {smp.name: smp.value for smp in samples(client)
           if smp.name.startswith("kvi_query_duration_seconds_") and smp.labels.get("route") == route}
    c = got.get("kvi_query_duration_seconds_count")
    return None if not c else got["kvi_query_duration_seconds_sum"] / c * 1e6


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def dynamo_stored_events(client: Client) -> int:
    """Store events Dynamo's standalone indexer has applied (its own counter)."""
    return sum(int(smp.value) for smp in samples(client)
               if smp.name.startswith("dynamo_kvrouter_kv_cache_events_applied")
               and not smp.name.endswith("_created") and smp.labels.get("event_type") == "stored")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 sequences per engine, 1000 calls, 2 s throughput")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--events-per-batch", type=int, default=1, help="events per message (vLLM: one batch per engine step)")
    ap.add_argument("--cpu", type=int, default=-1,
                    help="pin our server to this CPU, clients and publishers to the other (default -1: nothing "
                         "pinned; Dynamo is never pinned)")
    ap.add_argument("--no-fastapi", action="store_true", help="skip the plain-FastAPI alternative")
    ap.add_argument("--peer", action="store_true", help="also measure Dynamo's standalone indexer")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every server; figures are medians over them")
    wl.add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.seqs = min(args.seqs, 200)
        args.calls, args.warmup, args.seconds = min(args.calls, 1000), min(args.warmup, 100), min(args.seconds, 2.0)
    header("HTTP services side by side: ours (kv-indexer serve) and Dynamo's standalone indexer "
           "(for the comparison as users run both, see bench_services.py)",
           argparse.Namespace())
    client_cpu = -1 if args.cpu < 0 else (args.cpu + 1) % (os.cpu_count() or 1)
    print(f"# affinity: our server on CPU {args.cpu}, clients and publishers on CPU {client_cpu}; Dynamo not pinned\n"
          if args.cpu >= 0 else "# affinity: not pinned\n")
    if client_cpu >= 0:
        os.sched_setaffinity(0, {client_cpu})

    p = wl.params_from_args(args, long_blocks=LONG_BLOCKS)
    events = wl.load_events("anchor", p)
    payloads = wl.encode_payloads(events, p.block_size, events_per_batch=args.events_per_batch)
    total = sum(len(x) for x in payloads)
    summ = wl.summarize(events)
    entries, stored_blocks = summ["resident_entries"], summ["stored_blocks"]
    store_events = sum(1 for evs in events for e in evs if e.kind == "store")
    # Agreement queries: every kind (full hit, one worker, shared prefix only, miss) at every length.
    queries = {(n, kind): toks for n in args.lengths for kind, toks in wl.anchor_queries(p, n).items()}
    bodies = {k: json.dumps({"token_ids": t}).encode() for k, t in queries.items()}
    dyn_bodies = {k: json.dumps({"token_ids": t, "model_name": "default"}).encode() for k, t in queries.items()}
    print(f"workload: {len(events)} engines, {p.seqs} sequences each, {entries:,} (worker, block) entries, "
          f"{total:,} batches of {args.events_per_batch} events\n")

    # One server at a time, alone on its CPU: an idle Dynamo process beside ours (its
    # runtime threads wake) was seen to add ~90 us to our median, and the reverse.
    modes = [("fast path", "ours", True)] + ([] if args.no_fastapi else [("FastAPI routes", "ours", False)])
    if args.peer and peer_available():
        modes.append(("Dynamo /query", "dynamo", None))
    rps_rows, answers = [], {}
    ingests: dict[str, list] = {}  # label -> [(seconds, RSS growth)] over rounds
    lats: dict[tuple, list] = {}  # (label, tokens) -> [(median, p99, handler)] over rounds
    # The client's workload (every token id a Python int) would make each full collection
    # of this process walk millions of objects, inside whichever call it lands on.
    gc.collect()
    gc.freeze()
    for rnd in range(args.rounds):
        # Odd rounds run the servers in reverse order: whatever a turn leaves behind on
        # this VM (freed memory, a cold CPU) falls on each server's next turn alike.
        for label, kind, fast in (modes if rnd % 2 == 0 else modes[::-1]):
            port = free_port()
            srv = start_ours(port, args.cpu, fast) if kind == "ours" else start_dynamo(port)
            pubs = [VllmPublisher("tcp://127.0.0.1:*", hwm=0) for _ in events]
            path, qbodies = ("/v1/match", bodies) if kind == "ours" else ("/query", dyn_bodies)
            try:
                c = Client(port)
                for i, pub in enumerate(pubs):
                    if kind == "ours":
                        st, body = c.json("POST", "/v1/engines", {"id": wl.engine_name(i), "endpoint": pub.live_endpoint})
                    else:
                        st, body = c.json("POST", "/register", {"instance_id": i, "endpoint": pub.live_endpoint,
                                                               "model_name": "default", "block_size": p.block_size})
                    assert st < 300, (st, body)
                time.sleep(1.0)  # SUB sockets connect before the first batch (PUB drops otherwise)
                rss0 = rss(srv.pid)
                if kind == "ours":
                    secs = feed(pubs, payloads,
                                lambda c=c: c.json("GET", "/v1/stats")[1]["counters"].get("batches_applied", 0) >= total)
                else:
                    secs = feed(pubs, payloads, lambda c=c: dynamo_stored_events(c) >= store_events)
                time.sleep(0.5)
                ingests.setdefault(label, []).append((secs, rss(srv.pid) - rss0))
                got = {k: gpu_tokens(c, path, qbodies[k], p.block_size) for k in queries}
                base = answers.setdefault("fast path", got)  # ours, fast path: the very first turn
                same = sum(got[k] == base[k] for k in queries)
                print(f"[round {rnd + 1}, {label}] applied {total:,} batches in {secs:.2f} s; answers equal to ours on "
                      f"{same}/{len(queries)} queries"
                      + ("" if same == len(queries) else f": {[k for k in queries if got[k] != base[k]]}"))
                for n in args.lengths:
                    r = latency(c, path, qbodies[(n, "full")], args.calls, args.warmup)
                    lats.setdefault((label, n), []).append(
                        (r["median_us"], r["p99_us"], handler_us(c, "/v1/match") if kind == "ours" else None))
                if rnd == 0:
                    for k in args.clients:
                        rps_rows.append([label, args.lengths[0], k, throughput(
                            port, path, qbodies[(args.lengths[0], "full")], k, args.seconds, client_cpu)])
            finally:
                for pub in pubs:
                    pub.close()
                srv.terminate()
                srv.wait(10)
    ingest_rows, rows, results = [], [], {}
    for label, _, _ in modes:
        secs = statistics.median(s for s, _ in ingests[label])
        grown = statistics.median(g for _, g in ingests[label])
        ingest_rows.append([label, secs, stored_blocks / secs, grown, grown / entries])
        for n in args.lengths:
            got = lats[(label, n)]
            med = statistics.median(m for m, _, _ in got)
            hs = [h for _, _, h in got if h is not None]
            results[(label, n)] = {"median_us": med}
            rows.append([label, n, med, statistics.median(q for _, q, _ in got),
                         statistics.median(hs) if hs else None, " ".join(f"{m:.0f}" for m, _, _ in got)])
    print()
    print(table(["server", "s to apply all", "blocks/s", "RSS growth B", "B/entry"], ingest_rows,
                f"ingest over loopback ZMQ until fully applied ({stored_blocks:,} blocks; {entries:,} resident entries); "
                f"medians over {args.rounds} rounds"))
    print()
    print(table(["server", "tokens", "median us", "p99 us", "handler us (mean)", "medians per round"], rows,
                "POST query round trip, one keep-alive http.client connection (prompt held whole by every engine); "
                f"medians over {args.rounds} rounds"))
    print()
    print(table(["server", "tokens", "clients", "requests/s"], rps_rows,
                f"throughput, keep-alive clients on one CPU, {args.seconds:g} s"))
    ours = results.get(("fast path", args.lengths[0]))
    if ours:
        print(f"\ntarget: 1,024-token /v1/match median <= {TARGET_HTTP_MATCH_1K_US:g} us: "
              f"{ours['median_us']:.1f} us ({'met' if ours['median_us'] <= TARGET_HTTP_MATCH_1K_US else 'MISSED'})")
    d_ing = [r for r in ingest_rows if r[0] == "Dynamo /query"]
    if d_ing:
        o_ing = ingest_rows[0]
        print("ratios ours/Dynamo: ingest blocks/s " f"{ratio(o_ing[2], d_ing[0][2]):.2f}x (>= 1 = ours faster), "
              f"memory per entry {ratio(o_ing[4], d_ing[0][4]):.2f}x (<= 1 = ours smaller), " + ", ".join(
                  f"{n}-token query median {ratio(results[('fast path', n)]['median_us'], results[('Dynamo /query', n)]['median_us']):.2f}x"
                  for n in args.lengths) + " (<= 1 = ours faster)")


if __name__ == "__main__":
    main()
