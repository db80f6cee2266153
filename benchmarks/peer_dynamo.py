"""The same workloads and queries on NVIDIA Dynamo's in-process ``RadixTree`` (the peer).

Runs inside ``.venv-dynamo`` (``pip install ai-dynamo-runtime==1.6.1 msgspec xxhash``);
``bench_apply.py``, ``bench_match.py`` and ``bench_memory.py`` call it with
``--peer``. It can also be run alone::

    .venv-dynamo/bin/python benchmarks/peer_dynamo.py --mode apply --quick

What is measured (``dynamo.llm.RadixTree`` of ai-dynamo-runtime 1.6.1, single caller):

* ``--mode apply``: best of ``--runs`` fresh trees.
  *JSON in*: ``apply_event(worker_id, event_json)`` over pre-built ``KvCacheEvent``
  JSON (local block hashes already computed: tree work + JSON parse only; this
  is how Dynamo's own indexer benchmark measures it).
  *vLLM payload in*: the same vLLM msgpack payloads our index takes, decoded with
  msgspec, hashed with ``compute_block_hash_for_seq`` and re-encoded as JSON in
  Python before ``apply_event`` (the same work our ``PrefixIndex.apply`` does).
  Then removal of everything (pre-built JSON) and a check that
  ``dump_tree_as_events()`` is empty.
* ``--mode match``: ``find_matches(local_hashes)`` and
  ``compute_block_hash_for_seq(tokens, block_size)`` latency (median, p99, GC on)
  for the anchor query prompts, plus the ``find_matches([])`` call floor; the
  matched blocks per worker (``scores``) are returned for the agreement check.
* ``--mode memory``: RSS before/after applying JSON events read from
  ``--events-file`` (lines ``worker_id<TAB>json``), in this fresh process.
* ``--mode snapshot`` (``bench_snapshot.py``): Dynamo's own snapshot path. The tree
  is built from ``--events-dir`` (``w<i>.jsonl`` per worker, one ``KvCacheEvent``
  JSON a line, applied round robin like ``workload.interleave``; not timed). Then,
  ``--runs`` times each: *dump* = ``dump_tree_as_events()`` (a list of
  ``RouterEvent`` JSON strings); *write* = the dump, joined with newlines, UTF-8
  encoded and written with ``indexer.store.snapshot.write_atomic`` (temp file, fsync,
  rename, directory fsync) under ``--dir``; *restore* = read that file (its pages
  dropped from the page cache first, as for ours), split it into lines
  (*read*), decode each ``RouterEvent`` with msgspec keeping its ``event`` as raw
  JSON bytes (*convert*: ``apply_event`` takes ``(worker_id, KvCacheEvent JSON
  bytes)``, not a ``RouterEvent``), then ``apply_event`` of each into a fresh
  ``RadixTree`` (*apply*). After the first restore: ``find_matches`` scores on the
  ``--queries-file`` prompts and the number of dumped events must equal the
  original tree's, or it exits non-zero.

With ``--json`` the figures are printed as one JSON line on stdout and the table
goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402

import workload as wl  # noqa: E402
from _report import add_cpu_argument, drop_cache, lat_stats_us, pin, rss_bytes, spread, table  # noqa: E402

# Imported in main() after pinning, so Dynamo's runtime threads inherit the affinity.
RadixTree = compute_block_hash_for_seq = None

_dec = msgspec.msgpack.Decoder()
_jenc = msgspec.json.Encoder().encode


def dynamo_version() -> str:
    """The installed ai-dynamo-runtime version."""
    try:
        from importlib.metadata import version

        return "ai-dynamo-runtime " + version("ai-dynamo-runtime")
    except Exception:  # pragma: no cover
        return "ai-dynamo-runtime ?"


def local_hashes(tokens, block_size):
    return compute_block_hash_for_seq(tokens, block_size)


def apply_vllm_payload(tree, wid: int, payload: bytes, eid: int) -> int:
    """vLLM msgpack batch -> Dynamo JSON events -> apply_event (what a Python adapter does)."""
    _ts, events, dp = _dec.decode(payload)
    dp = dp or 0
    for ev in events:
        t = ev["type"]
        if t == "BlockStored":
            lh = compute_block_hash_for_seq(ev["token_ids"], ev["block_size"])
            data = {"stored": {"parent_hash": ev["parent_block_hash"],
                               "blocks": [{"block_hash": h, "tokens_hash": k}
                                          for h, k in zip(ev["block_hashes"], lh)]}}
        elif t == "BlockRemoved":
            data = {"removed": {"block_hashes": ev["block_hashes"]}}
        else:
            data = "cleared"
        tree.apply_event(wid, _jenc({"event_id": eid, "data": data, "dp_rank": dp}))
        eid += 1
    return eid


def params(args) -> wl.Params:
    return wl.params_from_args(args, long_blocks=getattr(args, "long_blocks", 0))


def load(args):
    p = params(args)
    return p, wl.load_events(args.workload, p, mooncake_requests_n=args.requests, capacity_blocks=args.capacity)


def mode_apply(args) -> dict:
    p, events = load(args)
    summ = wl.summarize(events)
    bs = p.block_size
    js = wl.interleave([wl.dynamo_json(evs, local_hashes, bs) for evs in events])
    rem_events = wl.removal_events(events)
    rem = wl.interleave([wl.dynamo_json(evs, local_hashes, bs, first_id=len(events[w]))
                         for w, evs in enumerate(rem_events)])
    payloads = wl.interleave(wl.encode_payloads(events, bs, args.events_per_batch))
    rem_blocks = sum(len(e.hashes) for evs in rem_events for e in evs)
    ops = summ["stored_blocks"] + summ["removed_blocks"]
    best_json = best_vllm = best_rem = float("inf")
    errors = 0
    empty_after_remove = None
    for _ in range(args.runs):
        tree = RadixTree()
        t0 = time.perf_counter()
        for w, _seq, b in js:
            tree.apply_event(w, b)
        t1 = time.perf_counter()
        best_json = min(best_json, t1 - t0)
        t0 = time.perf_counter()
        for w, _seq, b in rem:
            tree.apply_event(w, b)
        t1 = time.perf_counter()
        best_rem = min(best_rem, t1 - t0)
        empty_after_remove = len(tree.dump_tree_as_events()) == 0
        del tree
        tree = RadixTree()
        eids = [0] * len(events)
        t0 = time.perf_counter()
        for w, _seq, pl in payloads:
            try:
                eids[w] = apply_vllm_payload(tree, w, pl, eids[w])
            except ValueError:
                errors += 1
        t1 = time.perf_counter()
        best_vllm = min(best_vllm, t1 - t0)
        del tree
    out = {
        "peer": dynamo_version(),
        "workload": summ,
        "events_per_batch": args.events_per_batch,
        "json_in": {"s": best_json, "blocks_s": ops / best_json, "events_s": len(js) / best_json},
        "vllm_in": {"s": best_vllm, "blocks_s": ops / best_vllm, "batches_s": len(payloads) / best_vllm,
                    "errors": errors},
        "remove": {"s": best_rem, "blocks_s": rem_blocks / best_rem, "events_s": len(rem) / best_rem,
                   "empty_after": empty_after_remove},
    }
    rows = [
        ["apply, JSON in (apply_event)", out["json_in"]["blocks_s"], out["json_in"]["events_s"], best_json],
        ["apply, vLLM payload in (decode+hash+JSON+apply_event)", out["vllm_in"]["blocks_s"],
         out["vllm_in"]["batches_s"], best_vllm],
        ["remove everything, JSON in", out["remove"]["blocks_s"], out["remove"]["events_s"], best_rem],
    ]
    emit(args, out, table(["Dynamo RadixTree", "blocks/s", "events|batches/s", "best s"], rows,
                          title=f"## peer: {dynamo_version()} ({args.affinity}; best of {args.runs}; tree empty after "
                                f"removal: {empty_after_remove}; apply errors: {errors})"))
    return out


def time_calls(fn, arg, calls: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn(arg)
    ns = []
    pc = time.perf_counter_ns
    for _ in range(calls):
        t0 = pc()
        fn(arg)
        ns.append(pc() - t0)
    return lat_stats_us(ns)


def mode_match(args) -> dict:
    p, events = load(args)
    bs = p.block_size
    tree = RadixTree()
    errors = 0
    for w, _seq, b in wl.interleave([wl.dynamo_json(evs, local_hashes, bs) for evs in events]):
        try:
            tree.apply_event(w, b)
        except ValueError:
            errors += 1
    from indexer.wire.keys import block_keys

    queries = match_queries(args, p)
    res = {}
    keys_disagree = 0
    for name, toks in queries:
        lh = compute_block_hash_for_seq(toks, bs)
        if lh != block_keys(toks, bs):
            keys_disagree += 1
        find = time_calls(tree.find_matches, lh, args.calls, args.warmup)
        hsh = time_calls(lambda t: compute_block_hash_for_seq(t, bs), toks, args.calls, args.warmup)
        both = time_calls(lambda t: tree.find_matches(compute_block_hash_for_seq(t, bs)), toks,
                          args.calls, args.warmup)
        scores = {str(w): n for (w, _dp), n in tree.find_matches(lh).scores.items()}
        res[name] = {"find": find, "hash": hsh, "hash_find": both, "scores": scores}
    floor = time_calls(tree.find_matches, [], args.calls, args.warmup)
    out = {"peer": dynamo_version(), "queries": res, "floor": floor, "apply_errors": errors,
           "keys_disagree": keys_disagree}
    rows = [[n, r["hash_find"]["median_us"], r["hash_find"]["p99_us"], r["find"]["median_us"],
             r["find"]["p99_us"], r["hash"]["median_us"], r["hash"]["p99_us"]] for n, r in res.items()]
    rows.append(["find_matches([]) (call floor)", None, None, floor["median_us"], floor["p99_us"], None, None])
    emit(args, out, table(
        ["query", "hash+find med us", "p99", "find_matches med us", "p99", "compute_hash med us", "p99"], rows,
        title=f"## peer: {dynamo_version()}, {p.workers} workers ({args.affinity}; {args.calls} calls each; "
              f"apply errors {errors}; key disagreements with indexer.wire.keys: {keys_disagree})"))
    return out


def match_queries(args, p: wl.Params) -> list[tuple[str, list]]:
    """The query prompts, named ``"<tokens>:<kind>"`` (anchor) or ``"trace:<i>"`` (mooncake)."""
    if args.workload == "mooncake":
        return [(f"trace:{i}", q) for i, q in enumerate(
            wl.mooncake_queries(args.queries, args.max_query_tokens, p.seed, args.requests))]
    out = []
    for n in args.lengths:
        for kind, toks in wl.anchor_queries(p, n).items():
            out.append((f"{n}:{kind}", toks))
    return out


def mode_memory(args) -> dict:
    with open(args.events_file, "rb") as f:
        blob = f.read()
    items = []
    for line in blob.split(b"\n"):
        if line:
            w, _, j = line.partition(b"\t")
            items.append((int(w), j))
    del blob, line
    gc.collect()
    before = rss_bytes()
    tree = RadixTree()
    for w, j in items:
        tree.apply_event(w, j)
    gc.collect()
    after = rss_bytes()
    out = {"peer": dynamo_version(), "affinity": args.affinity, "rss_before": before, "rss_after": after, "rss_delta": after - before,
           "events": len(items)}
    emit(args, out, None)
    return out


class _RouterEvent(msgspec.Struct):
    """The two members of a dumped ``RouterEvent`` that ``apply_event`` needs (the
    others, ``storage_tier`` and ``residency_domain``, are "device" and "worker" for
    every event here and are not taken by ``apply_event``)."""

    worker_id: int
    event: msgspec.Raw


def _scores(tree, queries, bs: int) -> dict:
    out = {}
    for name, toks in queries:
        sc = tree.find_matches(compute_block_hash_for_seq(toks, bs)).scores
        out[name] = {str(w): n for (w, _dp), n in sorted(sc.items())}
    return out


def mode_snapshot(args) -> dict:
    from indexer.store.snapshot import write_atomic

    d = Path(args.events_dir)
    tree = RadixTree()
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    n_events = 0
    with ExitStack() as stack:
        live = [(w, stack.enter_context(open(d / f"w{w}.jsonl", "rb"))) for w in range(args.workers)]
        while live:
            nxt = []
            for w, f in live:
                line = f.readline()
                if line:
                    tree.apply_event(w, line.rstrip(b"\n"))
                    n_events += 1
                    nxt.append((w, f))
            live = nxt
    build_s = time.perf_counter() - t0
    gc.collect()
    rss_build = rss_bytes() - rss0
    with open(args.queries_file) as f:
        queries = [(q["name"], q["tokens"]) for q in json.load(f)]
    bs = args.block_size
    want = _scores(tree, queries, bs)
    path = os.path.join(args.dir, "dynamo-dump.jsonl")
    dump_s, write_s = [], []
    n_dump = size = 0
    dumped_blocks = 0
    for r in range(args.runs):
        gc.collect()
        t0 = time.perf_counter()
        dumped = tree.dump_tree_as_events()
        t1 = time.perf_counter()
        blob = "\n".join(dumped).encode()
        write_atomic(path, blob)
        t2 = time.perf_counter()
        dump_s.append(t1 - t0)
        write_s.append(t2 - t0)
        if r == 0:
            n_dump, size = len(dumped), len(blob)
            dumped_blocks = blob.count(b'"block_hash"')
        del dumped, blob
    read_s, convert_s, apply_s, restore_s = [], [], [], []
    dec = msgspec.json.Decoder(_RouterEvent).decode
    check = None
    tree2 = None
    for r in range(args.runs):
        del tree2
        gc.collect()
        drop_cache(path)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        t1 = time.perf_counter()
        evs = [dec(line) for line in lines]
        pairs = [(e.worker_id, bytes(e.event)) for e in evs]
        del evs
        t2 = time.perf_counter()
        tree2 = RadixTree()
        apply = tree2.apply_event
        for w, ev in pairs:
            apply(w, ev)
        t3 = time.perf_counter()
        read_s.append(t1 - t0)
        convert_s.append(t2 - t1)
        apply_s.append(t3 - t2)
        restore_s.append(t3 - t0)
        del data, lines, pairs
        if r == 0:
            got = _scores(tree2, queries, bs)
            n_again = len(tree2.dump_tree_as_events())
            check = {"scores_equal": got == want, "dumped_events_equal": n_again == n_dump,
                     "dumped_again": n_again}
            if not (check["scores_equal"] and check["dumped_events_equal"]):
                bad = [k for k in want if got.get(k) != want[k]]
                print(f"Dynamo restore differs from the original: {check}; queries {bad}", file=sys.stderr)
                sys.exit(3)
    os.unlink(path)
    out = {
        "peer": dynamo_version(), "affinity": args.affinity, "events_applied": n_events, "build_s": build_s,
        "rss_build": rss_build, "dumped_events": n_dump, "dumped_blocks": dumped_blocks, "json_bytes": size,
        "dump_s": spread(dump_s), "write_s": spread(write_s), "read_s": spread(read_s),
        "convert_s": spread(convert_s), "apply_s": spread(apply_s),
        "restore_mem_s": spread([c + a for c, a in zip(convert_s, apply_s)]), "restore_s": spread(restore_s),
        "check": check, "scores": want,
        "called": "RadixTree.dump_tree_as_events(); RadixTree().apply_event(worker_id, bytes(event)) per "
                  "dumped RouterEvent",
    }
    rows = [[k, out[k]["median"], out[k]["min"], out[k]["max"]]
            for k in ("dump_s", "write_s", "read_s", "convert_s", "apply_s", "restore_s")]
    emit(args, out, table(["Dynamo RadixTree snapshot", "median s", "min", "max"], rows,
                          title=f"## peer: {dynamo_version()} ({args.affinity}; {args.runs} runs; {n_dump:,} dumped "
                                f"events, {size:,} bytes of JSON; restore check {check})"))
    return out


def emit(args, out: dict, text: str | None) -> None:
    if args.json:
        if text:
            print(text, file=sys.stderr)
        print(json.dumps(out))
    elif text:
        print(text)
    else:
        print(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("apply", "match", "memory", "snapshot"), required=True)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workload", choices=("anchor", "mooncake"), default="anchor")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--capacity", type=int, default=16384)
    ap.add_argument("--long-blocks", type=int, default=0)
    ap.add_argument("--events-per-batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--max-query-tokens", type=int, default=None)
    ap.add_argument("--events-file", default=None)
    ap.add_argument("--events-dir", default=None, help="snapshot: w<i>.jsonl per worker")
    ap.add_argument("--queries-file", default=None, help="snapshot: JSON [{name, tokens}] to check the restore")
    ap.add_argument("--dir", default=None, help="snapshot: where the dump file is written")
    add_cpu_argument(ap)
    wl.add_arguments(ap)
    args = ap.parse_args()
    args.affinity = affinity = pin(args.cpu)
    global RadixTree, compute_block_hash_for_seq
    from dynamo.llm import RadixTree, compute_block_hash_for_seq
    if not args.json:
        print(f"# peer affinity: {affinity}")
    if args.quick:
        args.seqs = min(args.seqs, 200)
        args.calls = min(args.calls, 300)
    if args.workload == "mooncake" and args.requests is None:
        args.requests = 500 if args.quick else 3000
    {"apply": mode_apply, "match": mode_match, "memory": mode_memory, "snapshot": mode_snapshot}[args.mode](args)


if __name__ == "__main__":
    main()
