"""Snapshots: size, write and restore time at 10^6 and 10^7 resident entries, and NVIDIA
Dynamo's own snapshot path (``RadixTree.dump_tree_as_events``) on the same events.

What is measured, per size (``--sizes``, resident (worker, block) entries over 8 workers,
the anchor workload scaled as ``bench_scale.py`` does), each step in a fresh process
pinned to ``--cpu``:

* **build** (not timed into any figure): the vLLM 0.33 payloads (16 events a batch)
  applied with ``PrefixIndex.apply``, the workers round robin; then nodes, resident
  entries, snapshot bytes and bytes per entry;
* **write**, ``--runs`` times: ``snapshot.dumps(index)`` (*lock held*: the time the
  index lock is held inside it, taken by wrapping the index's lock; *dumps*: the whole
  call, the msgpack encoding and the checksum included) + ``snapshot.write_atomic``
  into a temporary directory on the local disk (``--dir``): *total*;
* **restore**, ``--runs`` times, in another fresh process: read the file (its pages
  dropped from the page cache first with ``posix_fadvise(DONTNEED)``, so the read is
  from the disk; ``--warm-read`` keeps them) + ``snapshot.loads`` + ``Snapshot.restore``
  into a new ``PrefixIndex`` (the previous one freed with ``close()`` first, untimed).
  After the first restore the restored index must answer every check query exactly as
  the original did (``match(q).to_dict()`` without ``last_event_age_s``) and have the
  same ``stats()`` nodes, resident entries and per-model figures, or the script fails;
* **memory**: RSS growth of the build process over the build, and of the restore
  process over its first restore (the file's bytes and the decoded snapshot freed), per
  entry; the restore process's peak RSS (VmHWM) over its baseline as well;
* **the peer** (``peer_dynamo.py --mode snapshot``, in ``.venv-dynamo``): the same
  events as Dynamo ``KvCacheEvent`` JSON into a ``RadixTree``, then
  ``dump_tree_as_events()`` (*dump*), the dump written as JSON lines with the same
  ``write_atomic`` (*write*), and restore = the file read, each dumped ``RouterEvent``
  decoded and its ``event`` passed to ``apply_event`` of a fresh tree (*restore*);
  its restore is checked the same way (``find_matches`` scores on the same queries).

Times are the median of ``--runs`` with the min-max; ratios ours/Dynamo are ratios of
the medians, with the extremes (fastest ours / slowest Dynamo .. slowest ours / fastest
Dynamo) beside them.

The workload is generated one worker at a time (events, then payloads and Dynamo JSON,
written to per-worker files and freed) and cached under ``benchmarks/results/cache/``, so
10^7 entries never hold the whole workload's token ids in one process; the generator is
``workload.anchor_events``'s loop for one worker (``--quick`` checks it yields the same
events). The build streams the files. ``bench_jetstream.py`` measures replica lag.

    .venv/bin/python benchmarks/bench_snapshot.py [--quick] [--sizes 1e6 1e7] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload as wl  # noqa: E402
from _report import drop_cache, header, peer, peer_available, pin, rss_bytes, spread, table  # noqa: E402
from bench_scale import seqs_for  # noqa: E402

EPB = 16
FILES_VERSION = 1  # bump when the per-worker files change
_LEN = struct.Struct("<I")


# ------------------------------------------------------------------ the workload


def worker_events(c: wl._Content, p: wl.Params, w: int) -> list[wl.Event]:
    """Worker ``w``'s events of ``workload.anchor_events(p)`` (the same loop, one worker)."""
    n_shared = int(round(p.seqs * p.shared_frac))
    suffix_blocks = p.blocks - p.prefix_blocks
    order = list(range(p.seqs))
    random.Random(wl._xxh3(repr((p.seed, "order", w)).encode())).shuffle(order)
    seen: set[int] = set()
    evs: list[wl.Event] = []
    for i in order:
        j = i % p.prefixes
        if j not in seen:
            seen.add(j)
            toks, hs = c.prefix_of(j)
            evs.append(wl.Event("store", hs, None, toks))
        if i < n_shared:
            toks, hs = c.suffix(c.shared, ("shared", i), j, suffix_blocks)
        else:
            toks, hs = c.suffix(None, ("unique", w, i), j, suffix_blocks)
        evs.append(wl.Event("store", hs, c.prefix_of(j)[1][-1], toks))
    return evs


def check_generator(p: wl.Params) -> None:
    """``worker_events`` must give exactly ``workload.anchor_events`` (checked with --quick)."""
    c = wl._Content(p)
    if [worker_events(c, p, w) for w in range(p.workers)] != wl.anchor_events(p):
        raise SystemExit("worker_events differs from workload.anchor_events")


def workload_dir(p: wl.Params) -> Path:
    """Per-worker files of the workload, generated once: ``w<i>.vllm`` (length-prefixed
    vLLM payloads), ``w<i>.jsonl`` (Dynamo JSON events), ``meta.json`` (counts)."""
    from indexer.wire.keys import block_keys

    key = hashlib.sha256(repr((wl.GENERATOR_VERSION, FILES_VERSION, EPB, sorted(asdict(p).items())))
                         .encode()).hexdigest()[:16]
    d = wl.CACHE_DIR / f"snapshot-{key}"
    if (d / "meta.json").exists():
        return d
    tmp = Path(f"{d}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    c = wl._Content(p)
    distinct: set[int] = set()
    entries = stored = batches = 0
    t0 = time.perf_counter()
    for w in range(p.workers):
        evs = worker_events(c, p, w)
        held: set[int] = set()
        for e in evs:
            held.update(e.hashes)
            stored += len(e.hashes)
        entries += len(held)
        distinct |= held
        del held
        with open(tmp / f"w{w}.vllm", "wb") as f:
            for pl in wl.encode_payloads([evs], p.block_size, EPB)[0]:
                f.write(_LEN.pack(len(pl)))
                f.write(pl)
                batches += 1
        with open(tmp / f"w{w}.jsonl", "wb") as f:
            for j in wl.dynamo_json(evs, block_keys, p.block_size):
                f.write(j)
                f.write(b"\n")
        del evs
        print(f"  workload {p.workers} x {p.seqs}: worker {w} written ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    meta = {"params": asdict(p), "resident_entries": entries, "distinct_blocks": len(distinct),
            "stored_blocks": stored, "batches": batches, "events_per_batch": EPB}
    (tmp / "meta.json").write_text(json.dumps(meta))
    os.replace(tmp, d)
    return d


def check_queries(p: wl.Params) -> list[dict]:
    """Prompts the restored index must answer as the original: the anchor kinds (1,024
    tokens), each worker's first and last unique sequence, shared sequences cut at
    several lengths, one with a changed token mid-way, and a shared prefix alone."""
    c = wl._Content(p)
    n_shared = int(round(p.seqs * p.shared_frac))
    sb = p.blocks - p.prefix_blocks
    bs = p.block_size

    def seq(kind: str, *key, i: int) -> list[int]:
        j = i % p.prefixes
        return c.prefix_of(j)[0] + c.suffix(None, (kind, *key, i), j, sb)[0]

    out = [{"name": f"anchor:{k}", "tokens": t} for k, t in wl.anchor_queries(p, 1024).items()]
    for w in range(p.workers):
        for i in (n_shared, p.seqs - 1):
            if n_shared <= i < p.seqs:
                out.append({"name": f"unique:w{w}:{i}", "tokens": seq("unique", w, i=i)})
    for i, nb in zip(range(min(4, n_shared)), (5, 17, 40, 64)):
        out.append({"name": f"shared:{i}:{nb}blocks", "tokens": seq("shared", i=i)[: nb * bs]})
    if n_shared:
        t = seq("shared", i=n_shared - 1)
        t[30 * bs + 3] = (t[30 * bs + 3] + 1) % 65536
        out.append({"name": "shared:changed-at-block-30", "tokens": t})
    out.append({"name": "prefix:1", "tokens": c.prefix_of(1 % p.prefixes)[0]})
    return out


def read_payloads(d: Path, workers: int):
    """``(engine, seq, payload)`` round robin over the workers (``workload.interleave``)."""
    names = [wl.engine_name(w) for w in range(workers)]
    with ExitStack() as stack:
        files = [stack.enter_context(open(d / f"w{w}.vllm", "rb")) for w in range(workers)]
        live = list(range(workers))
        seq = 0
        while live:
            nxt = []
            for w in live:
                head = files[w].read(4)
                if head:
                    (n,) = _LEN.unpack(head)
                    yield names[w], seq, files[w].read(n)
                    nxt.append(w)
            live = nxt
            seq += 1


# ------------------------------------------------------------------ figures


def ratio_spread(a: dict, b: dict) -> dict:
    """ours/Dynamo: the medians' ratio, and the extremes (min/max .. max/min)."""
    return {"median": a["median"] / b["median"], "min": a["min"] / b["max"], "max": a["max"] / b["min"]}


def answers(idx, queries: list[dict]) -> dict:
    out = {}
    for q in queries:
        d = idx.match(q["tokens"]).to_dict()
        for w in d["workers"]:
            w.pop("last_event_age_s", None)
        out[q["name"]] = d
    return out


def index_stats(idx) -> dict:
    st = idx.stats()
    return {"nodes": st["nodes"], "resident_entries": st["resident_entries"], "models": st["models"]}


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class TimedLock:
    """Wraps the index lock during ``dumps``: adds up the time it is held."""

    def __init__(self, lock) -> None:
        self.lock = lock
        self.held = 0.0
        self._t = 0.0

    def __enter__(self):
        self.lock.acquire()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.held += time.perf_counter() - self._t
        self.lock.release()


# ------------------------------------------------------------------ the children


def child_build(spec: dict) -> dict:
    """Build the index from the payload files, write the snapshot ``runs`` times."""
    from indexer import PrefixIndex, snapshot
    from indexer._native import COMPILED

    with open(spec["queries"]) as f:
        queries = json.load(f)
    gc.collect()
    rss0 = rss_bytes()
    idx = PrefixIndex()
    apply = idx.apply
    t0 = time.perf_counter()
    for eng, seq, pl in read_payloads(Path(spec["data"]), spec["workers"]):
        apply(eng, pl, seq=seq)
    build_s = time.perf_counter() - t0
    gc.collect()
    rss_build = rss_bytes() - rss0
    st = index_stats(idx)
    want = answers(idx, queries)
    with open(spec["expect"], "w") as f:
        json.dump({"stats": st, "answers": want}, f)
    path = spec["snap"]
    lock_s, dumps_s, total_s = [], [], []
    size = 0
    orig_lock = idx._lock
    for _ in range(spec["runs"]):
        gc.collect()
        tl = idx._lock = TimedLock(orig_lock)
        t0 = time.perf_counter()
        data = snapshot.dumps(idx)
        t1 = time.perf_counter()
        snapshot.write_atomic(path, data)
        t2 = time.perf_counter()
        idx._lock = orig_lock
        lock_s.append(tl.held)
        dumps_s.append(t1 - t0)
        total_s.append(t2 - t0)
        size = len(data)
        del data
    return {"compiled": COMPILED, "twins": {n: getattr(snapshot, n).__module__ or "builtin"
                                             for n in ("dump_tree", "dump_map", "node_index", "translate", "load_tree", "load_map")},
            "build_s": build_s, "rss_build": rss_build, "stats": {k: st[k] for k in ("nodes", "resident_entries")},
            "bytes": size, "lock_s": spread(lock_s), "dumps_s": spread(dumps_s), "write_s": spread(total_s),
            "answers": {k: [(w["engine"], w["total_blocks"]) for w in v["workers"]] for k, v in want.items()}}


def child_restore(spec: dict) -> dict:
    """Restore the snapshot file ``runs`` times into fresh indexes; check the first."""
    from indexer import PrefixIndex, snapshot

    with open(spec["queries"]) as f:
        queries = json.load(f)
    with open(spec["expect"]) as f:
        expect = json.load(f)
    path = spec["snap"]
    gc.collect()
    rss0 = rss_bytes()
    hwm0 = peak_rss()
    read_s, loads_s, restore_s, total_s = [], [], [], []
    idx = None
    rss_restore = peak = 0
    for r in range(spec["runs"]):
        if idx is not None:
            idx.close()
            del idx
        gc.collect()
        if not spec["warm_read"]:
            drop_cache(path)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        t1 = time.perf_counter()
        snap = snapshot.loads(data)
        t2 = time.perf_counter()
        idx = PrefixIndex()
        snap.restore(idx)
        t3 = time.perf_counter()
        read_s.append(t1 - t0)
        loads_s.append(t2 - t1)
        restore_s.append(t3 - t2)
        total_s.append(t3 - t0)
        del data, snap
        if r == 0:
            gc.collect()
            rss_restore = rss_bytes() - rss0
            peak = peak_rss() - max(hwm0, rss0)
            st = index_stats(idx)
            got = answers(idx, queries)
            bad = [k for k in expect["answers"] if got.get(k) != expect["answers"][k]]
            if st != expect["stats"] or bad or len(got) != len(expect["answers"]):
                print(f"RESTORE CHECK FAILED: stats equal {st == expect['stats']} (restored "
                      f"{st['nodes']:,} nodes / {st['resident_entries']:,} entries, original "
                      f"{expect['stats']['nodes']:,} / {expect['stats']['resident_entries']:,}); queries that "
                      f"differ: {bad}", file=sys.stderr)
                sys.exit(3)
    return {"read_s": spread(read_s), "loads_s": spread(loads_s), "restore_only_s": spread(restore_s),
            "restore_s": spread(total_s), "restore_mem_s": spread([a + b for a, b in zip(loads_s, restore_s)]),
            "rss_restore": rss_restore, "peak_over_base": peak, "checked_queries": len(queries)}


def run_child(kind: str, spec: dict, cpu: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec), "--cpu", str(cpu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the run


def run_size(n: float, args, tmp: str) -> dict:
    base = wl.Params(workers=args.workers)
    p = wl.Params(workers=args.workers, seqs=seqs_for(n, args.workers, base))
    t0 = time.perf_counter()
    d = workload_dir(p)
    meta = json.loads((d / "meta.json").read_text())
    qpath = os.path.join(tmp, "queries.json")
    with open(qpath, "w") as f:
        json.dump(check_queries(p), f)
    spec = {"data": str(d), "workers": p.workers, "queries": qpath, "expect": os.path.join(tmp, "expect.json"),
            "snap": os.path.join(tmp, "index.snap"), "runs": args.runs, "warm_read": args.warm_read}
    rspec = {**spec, "runs": args.restore_runs or args.runs}
    b = run_child("build", spec, args.cpu)
    st = b["stats"]
    if st["resident_entries"] != meta["resident_entries"] or st["nodes"] != meta["distinct_blocks"]:
        raise SystemExit(f"built index: {st}, the workload says {meta['resident_entries']:,} entries and "
                         f"{meta['distinct_blocks']:,} distinct blocks")
    r = run_child("restore", rspec, args.cpu)
    os.unlink(spec["snap"])
    out = {"size": n, "workers": p.workers, "seqs": p.seqs, "workload": meta, "ours": {**b, **r}}
    if args.peer and peer_available():
        dy = peer("snapshot", ["--cpu", str(args.cpu), "--workers", str(p.workers), "--seqs", str(p.seqs),
                               "--events-dir", str(d), "--queries-file", qpath, "--dir", tmp,
                               "--runs", str(args.runs)], timeout=7200, quiet=True)
        if dy is None:
            raise SystemExit("the Dynamo peer failed (see above)")
        ours_scores = {k: {e[1:]: nb for e, nb in v if nb} for k, v in b["answers"].items()}
        dy["agrees_with_ours"] = all({w: nb for w, nb in dy["scores"][k].items() if nb} == ours_scores[k]
                                     for k in ours_scores)
        if dy["events_applied"] and dy["dumped_blocks"] != meta["resident_entries"]:
            dy["note"] = f"dumped {dy['dumped_blocks']:,} blocks for {meta['resident_entries']:,} entries"
        out["dynamo"] = dy
        o = out["ours"]
        out["ratios"] = {
            "write": ratio_spread(o["write_s"], dy["write_s"]),
            "dump": ratio_spread(o["dumps_s"], dy["dump_s"]),
            "restore": ratio_spread(o["restore_s"], dy["restore_s"]),
            "restore_mem": ratio_spread(o["restore_mem_s"], dy["restore_mem_s"]),
            "bytes": o["bytes"] / dy["json_bytes"],
        }
    print(f"  {n:.0e}: {p.workers} x {p.seqs}, {st['resident_entries']:,} entries ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return out


def ms(s: dict) -> str:
    """``median [min-max]`` in ms (or s above 10 s)."""
    if s["median"] >= 10:
        return f"{s['median']:.2f} s [{s['min']:.2f}-{s['max']:.2f}]"
    return f"{s['median'] * 1e3:,.0f} [{s['min'] * 1e3:,.0f}-{s['max'] * 1e3:,.0f}]"


def rs(r: dict) -> str:
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def report(results: list[dict], args) -> str:
    tw = results[0]["ours"]["twins"]
    out = [f"# snapshot loops (dump_tree, dump_map, node_index, translate, load_tree, load_map) from: "
           f"{', '.join(sorted(set(tw.values())))}"]
    rows = []
    for x in results:
        o = x["ours"]
        e = o["stats"]["resident_entries"]
        rows.append([f"{x['workers']} x {x['seqs']}", o["stats"]["nodes"], e, o["bytes"], o["bytes"] / e,
                     ms(o["lock_s"]), ms(o["dumps_s"]), ms(o["write_s"])])
    out.append(table(["workers x seqs", "nodes", "entries", "snapshot bytes", "B/entry", "lock held ms",
                      "dumps ms", "write total ms"], rows,
                     f"## ours: size and write (median [min-max] of {args.runs} runs; total = dumps + write_atomic)"))
    rows = []
    for x in results:
        o = x["ours"]
        e = o["stats"]["resident_entries"]
        rows.append([f"{x['workers']} x {x['seqs']}", ms(o["read_s"]), ms(o["loads_s"]), ms(o["restore_only_s"]),
                     ms(o["restore_s"]), o["rss_build"] / e, o["rss_restore"] / e,
                     o["rss_restore"] / o["rss_build"], o["peak_over_base"] / e, f"{o['checked_queries']} ok"])
    out.append(table(["workers x seqs", "read ms", "loads ms", "restore ms", "total ms", "RSS B/entry built",
                      "restored", "restored/built", "peak B/entry", "check"], rows,
                     f"## ours: restore into a fresh PrefixIndex (median [min-max] of {args.restore_runs or args.runs} runs; read "
                     f"{'warm' if args.warm_read else 'cold: file pages dropped first'}; RSS growth per entry)"))
    if any("dynamo" in x for x in results):
        rows = []
        for x in results:
            dy = x.get("dynamo")
            if not dy:
                continue
            rows.append([f"{x['workers']} x {x['seqs']}", dy["dumped_events"], dy["json_bytes"],
                         dy["json_bytes"] / x["ours"]["stats"]["resident_entries"], ms(dy["dump_s"]),
                         ms(dy["write_s"]), ms(dy["read_s"]), ms(dy["convert_s"]), ms(dy["apply_s"]),
                         ms(dy["restore_s"]), "ok" if dy["check"]["scores_equal"] else "FAILED",
                         "yes" if dy["agrees_with_ours"] else "NO"])
        out.append(table(["workers x seqs", "dumped events", "JSON bytes", "B/entry", "dump ms", "write ms",
                          "read ms", "convert ms", "apply ms", "restore ms", "check", "= ours"], rows,
                         f"## Dynamo RadixTree ({results[0]['dynamo']['peer']}): dump_tree_as_events, written as "
                         f"JSON lines; restore = read + decode + apply_event into a fresh tree"))
        rows = []
        for x in results:
            r = x.get("ratios")
            if r:
                rows.append([f"{x['workers']} x {x['seqs']}", r["bytes"], rs(r["write"]), rs(r["dump"]),
                             rs(r["restore"]), rs(r["restore_mem"])])
        out.append(table(["workers x seqs", "bytes", "write (to disk)", "dump (in memory)", "restore (from disk)",
                          "restore (from memory)"], rows,
                         "## ours/Dynamo (< 1 = ours smaller or faster): ratio of the medians [extremes]"))
    return "\n\n".join(out)


def core_build() -> dict:
    """Which commit and which build of the compiled core this run measured."""
    root = HERE.parent

    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)

    import indexer._native as _compiled

    so = Path(_compiled.core.__file__) if _compiled.core is not None else None
    return {"head": git("rev-parse", "HEAD").stdout.strip(),
            "core_c_dirty": git("diff", "--quiet", "--", "indexer/_native").returncode != 0,
            "so": so.name if so else "none (pure Python)",
            "so_sha256": hashlib.sha256(so.read_bytes()).hexdigest() if so else "",
            "so_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(so.stat().st_mtime)) if so else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--quick", action="store_true", help="10^5 entries only (a smoke test); checks the generator")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--restore-runs", type=int, default=None, help="restores per size (default: --runs)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--cpu", type=int, default=0, help="pin every process to this CPU (-1: no pinning)")
    ap.add_argument("--dir", default=None, help="where the snapshot files go (default: a temporary directory)")
    ap.add_argument("--warm-read", action="store_true", help="keep the file's pages cached before a restore")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="skip Dynamo")
    ap.add_argument("--json", action="store_true", help="tables on stderr, one JSON line on stdout")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pin(args.cpu)
        fn = {"build": child_build, "restore": child_restore}[args.child[0]]
        print(json.dumps(fn(json.loads(args.child[1]))))
        return
    if args.quick:
        args.sizes = [1e5]
    real_stdout = sys.stdout
    sys.stdout.reconfigure(line_buffering=True)  # the tables and stderr's progress in order
    if args.json:
        sys.stdout = sys.stderr
    header("bench_snapshot: snapshot size, write and restore time, ours and Dynamo's", argparse.Namespace())
    print(f"# affinity: every process pinned to CPU {args.cpu}" if args.cpu >= 0 else "# affinity: not pinned")
    build = core_build()
    state = "with uncommitted changes" if build["core_c_dirty"] else "as committed"
    print(f"# tree: {build['head'][:12]}, indexer/_native {state}; compiled core {build['so']} "
          f"(sha256 {build['so_sha256'][:12]}, built {build['so_mtime']})")
    if args.peer and not peer_available():
        print("# peer: .venv-dynamo not found, Dynamo skipped")
    if args.quick:
        check_generator(wl.Params(workers=args.workers, seqs=seqs_for(1e5, args.workers, wl.Params())))
        print("# generator check: worker_events == workload.anchor_events at 10^5")
    print()
    results = []
    tmp = tempfile.mkdtemp(prefix="kvpi-snap-", dir=args.dir)
    try:
        for n in args.sizes:
            results.append(run_size(n, args, tmp))
            gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(results, args))
    if args.json:
        print(json.dumps({"build": build, "runs": args.runs, "restore_runs": args.restore_runs or args.runs, "cpu": args.cpu, "warm_read": args.warm_read, "sizes": results}),
              file=real_stdout)


if __name__ == "__main__":
    main()
