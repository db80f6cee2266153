"""Deterministic KV-event workloads shared by the benchmarks (not a benchmark itself).

Two workloads, both built as plain events first (:class:`Event`), then encoded
either as vLLM batch payloads (``indexer.producer.events.encode_batch``, vLLM 0.33 map
layout) for our index or as NVIDIA Dynamo ``KvCacheEvent`` JSON for its
``RadixTree`` (``peer_dynamo.py``), so both sides see the same stream.

**Anchor workload** (the shape of Dynamo's own indexer benchmark), default parameters:

* ``workers`` (8) engines, each caching ``seqs`` (2000) sequences of ``blocks`` (64)
  blocks of ``block_size`` (16) tokens;
* ``prefixes`` (64) shared prefixes of ``prefix_blocks`` (16) blocks; sequence
  ``i`` starts with prefix ``i % prefixes``;
* ``shared_frac`` (10%) of each worker's sequences are identical on every worker,
  the rest are unique to the worker;
* vLLM-shaped events: a worker stores a prefix once, as one 16-block event,
  just before its first sequence that uses it; each sequence is then one
  48-block store whose ``parent_block_hash`` is the prefix's last block.

Totals at the defaults: 16,512 store events, 776,192 (worker, block) entries,
701,824 distinct blocks, as in Dynamo's run. Token ids are uniform in
``[0, 65536)`` from a generator seeded by (``seed``, content id). Engine block
hashes chain like vLLM's: ``h_i = xxh3_64(le64(h_{i-1}) + le32 tokens, seed)``,
so the same content has the same hash on every worker; values use all 64 bits.

``long_blocks > 0`` (used by ``bench_match.py`` for 8,192-token prompts) adds two
long sequences per worker at the end: one identical on all workers and one
unique to the worker, each prefix + ``long_blocks - prefix_blocks`` blocks.

**Mooncake workload** (:func:`mooncake_events`): the FAST'25 conversation trace
(``../shared/data/mooncake/conversation_trace.jsonl`` beside the checkout, read in place). Request ``r``
goes to worker ``r % workers``; each ``hash_id`` expands to 512 deterministic
tokens (32 blocks of 16). Each worker is an LRU prefix cache of
``capacity_blocks`` blocks (Dynamo's mock engine has 16,384): a request stores
only the blocks the worker does not hold (one store with a parent), after a
``BlockRemoved`` for the leaves it had to evict.

Generated workloads are cached (pickle) under ``benchmarks/results/cache/``
(git-ignored); ``KVPI_BENCH_NOCACHE=1`` turns that off.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import struct
import sys
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import xxhash

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from indexer.producer.events import Removed, Stored, encode_batch  # noqa: E402

MOONCAKE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
CACHE_DIR = Path(__file__).resolve().parent / "results" / "cache"
GENERATOR_VERSION = 2  # bump when the generated streams change

_xxh3 = xxhash.xxh3_64_intdigest
_ENGINE_SEED = 0x5EED_CAFE
_pack_q = struct.Struct("<Q").pack
QUERY_KINDS = ("full", "one", "prefix", "miss")
QUERY_LABELS = {
    "full": "full hit, all workers",
    "one": "one-worker hit (others: prefix)",
    "prefix": "prefix-only hit",
    "miss": "miss",
}


class Event(NamedTuple):
    """One KV event of one worker. ``kind`` is "store" or "remove"."""

    kind: str
    hashes: list
    parent: int | None = None
    tokens: list | None = None


@dataclass(frozen=True)
class Params:
    """Anchor-workload parameters (defaults = Dynamo's §4.3 run)."""

    workers: int = 8
    seqs: int = 2000
    blocks: int = 64
    prefix_blocks: int = 16
    prefixes: int = 64
    shared_frac: float = 0.1
    block_size: int = 16
    seed: int = 0
    long_blocks: int = 0


def add_arguments(parser, *, workers=8, seqs=2000) -> None:
    """The anchor parameters as command-line options (same names as Dynamo's run)."""
    d = Params()
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--seqs", type=int, default=seqs)
    parser.add_argument("--blocks", type=int, default=d.blocks)
    parser.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks)
    parser.add_argument("--prefixes", type=int, default=d.prefixes)
    parser.add_argument("--shared-frac", type=float, default=d.shared_frac)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--seed", type=int, default=d.seed)


def params_from_args(args, **override) -> Params:
    kw = dict(
        workers=args.workers, seqs=args.seqs, blocks=args.blocks, prefix_blocks=args.prefix_blocks,
        prefixes=args.prefixes, shared_frac=args.shared_frac, block_size=args.block_size, seed=args.seed,
    )
    kw.update(override)
    return Params(**kw)


# ----------------------------------------------------------------- content


def tokens_for(seed: int, *content_id, n: int) -> list[int]:
    """``n`` deterministic token ids in [0, 65536) for one piece of content."""
    key = repr((seed,) + content_id).encode()
    rng = random.Random(_xxh3(key))
    return array("H", rng.randbytes(2 * n)).tolist()


def chain_hashes(parent: int | None, tokens: list[int], block_size: int) -> list[int]:
    """Engine (vLLM-like) block hashes: chained over the parent hash and each block's tokens."""
    buf = array("I", tokens).tobytes()
    step = 4 * block_size
    h = 0 if parent is None else parent
    out = []
    for i in range(0, len(buf) - step + 1, step):
        h = _xxh3(_pack_q(h) + buf[i : i + step], _ENGINE_SEED)
        out.append(h)
    return out


class _Content:
    """Tokens and hashes of every distinct piece of anchor content, built once."""

    def __init__(self, p: Params) -> None:
        self.p = p
        self.prefix: dict[int, tuple[list, list]] = {}
        self.shared: dict[int, tuple[list, list]] = {}

    def prefix_of(self, j: int) -> tuple[list, list]:
        got = self.prefix.get(j)
        if got is None:
            p = self.p
            toks = tokens_for(p.seed, "prefix", j, n=p.prefix_blocks * p.block_size)
            got = self.prefix[j] = (toks, chain_hashes(None, toks, p.block_size))
        return got

    def suffix(self, cache: dict | None, key: tuple, prefix_j: int, nblocks: int) -> tuple[list, list]:
        got = cache.get(key) if cache is not None else None
        if got is None:
            p = self.p
            toks = tokens_for(p.seed, *key, n=nblocks * p.block_size)
            parent = self.prefix_of(prefix_j)[1][-1]
            got = (toks, chain_hashes(parent, toks, p.block_size))
            if cache is not None:
                cache[key] = got
        return got


def anchor_events(p: Params) -> list[list[Event]]:
    """Per worker, the ordered store events of the anchor workload."""
    c = _Content(p)
    n_shared = int(round(p.seqs * p.shared_frac))
    suffix_blocks = p.blocks - p.prefix_blocks
    if suffix_blocks <= 0:
        raise ValueError("blocks must exceed prefix_blocks")
    out = []
    for w in range(p.workers):
        order = list(range(p.seqs))
        random.Random(_xxh3(repr((p.seed, "order", w)).encode())).shuffle(order)
        seen: set[int] = set()
        evs: list[Event] = []

        def seq_events(j: int, key: tuple, cache, nblocks: int) -> None:
            if j not in seen:
                seen.add(j)
                toks, hs = c.prefix_of(j)
                evs.append(Event("store", hs, None, toks))
            toks, hs = c.suffix(cache, key, j, nblocks)
            evs.append(Event("store", hs, c.prefix_of(j)[1][-1], toks))

        for i in order:
            j = i % p.prefixes
            if i < n_shared:
                seq_events(j, ("shared", i), c.shared, suffix_blocks)
            else:
                seq_events(j, ("unique", w, i), None, suffix_blocks)
        if p.long_blocks > p.prefix_blocks:
            lb = p.long_blocks - p.prefix_blocks
            seq_events(0, ("long-shared",), c.shared, lb)
            seq_events(1 % p.prefixes, ("long-unique", w), None, lb)
        out.append(evs)
    return out


def anchor_queries(p: Params, ntokens: int) -> dict[str, list[int]]:
    """Query prompts of ``ntokens`` tokens, one per kind of :data:`QUERY_KINDS`.

    * ``full``: a sequence every worker holds whole (a shared sequence, or the
      shared long sequence when ``ntokens`` needs more than ``blocks`` blocks);
    * ``one``: a sequence only worker 0 holds (other workers hold its prefix);
    * ``prefix``: a shared prefix followed by tokens nobody holds;
    * ``miss``: tokens nobody holds.

    When the stored sequence is shorter than ``ntokens`` the prompt is padded
    with unheld tokens (the match then stops at the stored length).
    """
    c = _Content(p)
    bs = p.block_size
    nb = ntokens // bs
    n_shared = int(round(p.seqs * p.shared_frac))
    suffix_blocks = p.blocks - p.prefix_blocks
    use_long = nb > p.blocks and p.long_blocks > p.prefix_blocks
    if use_long:
        lb = p.long_blocks - p.prefix_blocks
        full = c.prefix_of(0)[0] + c.suffix(None, ("long-shared",), 0, lb)[0]
        one = c.prefix_of(1 % p.prefixes)[0] + c.suffix(None, ("long-unique", 0), 1 % p.prefixes, lb)[0]
    else:
        i_full = 0 if n_shared > 0 else None
        i_one = n_shared  # first unique sequence of worker 0
        if i_full is None or i_one >= p.seqs:
            raise ValueError("anchor queries need at least one shared and one unique sequence")
        full = c.prefix_of(i_full % p.prefixes)[0] + c.suffix(None, ("shared", i_full), i_full % p.prefixes, suffix_blocks)[0]
        one = c.prefix_of(i_one % p.prefixes)[0] + c.suffix(None, ("unique", 0, i_one), i_one % p.prefixes, suffix_blocks)[0]
    prefix = c.prefix_of(2 % p.prefixes)[0]
    out = {"full": full, "one": one, "prefix": prefix, "miss": []}
    for k, toks in out.items():
        if len(toks) < ntokens:
            toks = toks + tokens_for(p.seed, "pad", k, ntokens, n=ntokens - len(toks))
        out[k] = toks[:ntokens]
    return out


# --------------------------------------------------------------- mooncake


def _id_tokens(seed: int, hash_id: int) -> list[int]:
    return tokens_for(seed, "mooncake", hash_id, n=512)


def mooncake_requests(path: Path = MOONCAKE, max_requests: int | None = None) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(out) >= max_requests:
                break
            out.append(json.loads(line))
    return out


def mooncake_prompt(req: dict, seed: int = 0, max_tokens: int | None = None) -> list[int]:
    """The token ids of one trace request (each hash_id -> 512 deterministic tokens)."""
    n = req["input_length"] if max_tokens is None else min(req["input_length"], max_tokens)
    toks: list[int] = []
    for hid in req["hash_ids"]:
        if len(toks) >= n:
            break
        toks.extend(_id_tokens(seed, hid))
    return toks[:n]


def mooncake_events(
    workers: int = 8,
    max_requests: int | None = None,
    capacity_blocks: int | None = 16384,
    block_size: int = 16,
    seed: int = 0,
    path: Path = MOONCAKE,
) -> list[list[Event]]:
    """Per worker, the store/remove events of the Mooncake trace replayed round robin."""
    if 512 % block_size:
        raise ValueError("block_size must divide 512")
    per_id = 512 // block_size
    caches = [OrderedDict() for _ in range(workers)]  # engine hash -> None, LRU (oldest first)
    out: list[list[Event]] = [[] for _ in range(workers)]
    for r, req in enumerate(mooncake_requests(path, max_requests)):
        w = r % workers
        cache = caches[w]
        nb = req["input_length"] // block_size
        if capacity_blocks is not None:
            nb = min(nb, capacity_blocks)
        # Hash chain of the request's blocks; the content of block j is (hash_id, sub-block).
        hs = []
        h = 0
        ids = req["hash_ids"]
        for j in range(nb):
            h = _xxh3(struct.pack("<QQI", h, ids[j // per_id], j % per_id), _ENGINE_SEED)
            hs.append(h)
        hit = 0
        while hit < nb and hs[hit] in cache:
            hit += 1
        move = cache.move_to_end
        # Parents are kept more recent than their children (touch leaf first), so the
        # LRU end always holds a leaf: eviction never cuts a chain in the middle.
        for j in range(hit - 1, -1, -1):
            move(hs[j])
        new = hs[hit:]
        if not new:
            continue
        if capacity_blocks is not None:
            over = len(cache) + len(new) - capacity_blocks
            if over > 0:
                evicted = [cache.popitem(last=False)[0] for _ in range(over)]
                out[w].append(Event("remove", evicted))
        for x in reversed(new):
            cache[x] = None
        for j in range(hit - 1, -1, -1):
            move(hs[j])
        # Tokens of the new blocks only.
        toks: list[int] = []
        id_cache: dict[int, list] = {}
        for j in range(hit, nb):
            hid = ids[j // per_id]
            t = id_cache.get(hid)
            if t is None:
                t = id_cache[hid] = _id_tokens(seed, hid)
            s = (j % per_id) * block_size
            toks.extend(t[s : s + block_size])
        out[w].append(Event("store", new, hs[hit - 1] if hit else None, toks))
    return out


def mooncake_queries(n: int = 64, max_tokens: int | None = None, seed: int = 0,
                     max_requests: int | None = None) -> list[list[int]]:
    """Prompts of ``n`` trace requests spread evenly over the replayed part."""
    reqs = mooncake_requests(MOONCAKE, max_requests)
    step = max(1, len(reqs) // n)
    return [mooncake_prompt(reqs[i], seed, max_tokens) for i in range(0, len(reqs), step)][:n]


# ---------------------------------------------------------------- encoding


def summarize(events: list[list[Event]]) -> dict:
    """Counts of a workload: events, stored/removed blocks, resident entries, distinct blocks."""
    stores = removes = sb = rb = 0
    resident: set = set()
    for w, evs in enumerate(events):
        for e in evs:
            if e.kind == "store":
                stores += 1
                sb += len(e.hashes)
                resident.update((w, h) for h in e.hashes)
            else:
                removes += 1
                rb += len(e.hashes)
                resident.difference_update((w, h) for h in e.hashes)
    distinct = len({h for _, h in resident})
    return {
        "workers": len(events), "store_events": stores, "remove_events": removes,
        "stored_blocks": sb, "removed_blocks": rb, "resident_entries": len(resident),
        "distinct_blocks": distinct,
    }


def to_vllm_events(evs: list[Event], block_size: int) -> list:
    out = []
    for e in evs:
        if e.kind == "store":
            out.append(Stored(block_hashes=e.hashes, parent_block_hash=e.parent, token_ids=e.tokens,
                              block_size=block_size, medium="GPU", group_idx=0,
                              kv_cache_spec_kind="full_attention"))
        else:
            out.append(Removed(block_hashes=e.hashes, medium="GPU", group_idx=0))
    return out


def encode_payloads(events: list[list[Event]], block_size: int, events_per_batch: int = 1,
                    version: str = "0.33", dp_rank: int = 0) -> list[list[bytes]]:
    """Per worker, vLLM batch payloads of ``events_per_batch`` consecutive events each."""
    out = []
    for evs in events:
        vev = to_vllm_events(evs, block_size)
        out.append([
            encode_batch(vev[i : i + events_per_batch], ts=1767225600.0 + i, dp_rank=dp_rank, version=version)
            for i in range(0, len(vev), events_per_batch)
        ])
    return out


def interleave(per_worker: list[list]) -> list[tuple[int, int, object]]:
    """Round robin over workers: ``(worker, seq, item)`` with per-worker seq from 0."""
    out = []
    longest = max((len(x) for x in per_worker), default=0)
    for i in range(longest):
        for w, items in enumerate(per_worker):
            if i < len(items):
                out.append((w, i, items[i]))
    return out


def removal_events(events: list[list[Event]]) -> list[list[Event]]:
    """Per worker, removals of everything the worker holds at the end, leaves first."""
    out = []
    for evs in events:
        held: dict = {}
        for e in evs:
            if e.kind == "store":
                for h in e.hashes:
                    held[h] = None
            else:
                for h in e.hashes:
                    held.pop(h, None)
        rem = []
        for e in reversed(evs):
            if e.kind != "store":
                continue
            hs = [h for h in reversed(e.hashes) if h in held]
            for h in hs:
                del held[h]
            if hs:
                rem.append(Event("remove", hs))
        out.append(rem)
    return out


def engine_name(w: int) -> str:
    return f"w{w}"


# ------------------------------------------------------------------ Dynamo


def dynamo_json(evs: list[Event], local_hashes, block_size: int, dp_rank: int = 0,
                first_id: int = 0) -> list[bytes]:
    """Dynamo ``KvCacheEvent`` JSON (what ``RadixTree.apply_event`` takes) for one worker.

    ``local_hashes(tokens, block_size)`` gives the router-side block hashes
    (``compute_block_hash_for_seq`` or ``indexer.wire.keys.block_keys``: equal).
    """
    out = []
    for i, e in enumerate(evs, first_id):
        if e.kind == "store":
            lh = local_hashes(e.tokens, block_size)
            data = {"stored": {"parent_hash": e.parent,
                               "blocks": [{"block_hash": h, "tokens_hash": k} for h, k in zip(e.hashes, lh)]}}
        else:
            data = {"removed": {"block_hashes": e.hashes}}
        out.append(json.dumps({"event_id": i, "data": data, "dp_rank": dp_rank}, separators=(",", ":")).encode())
    return out


# ------------------------------------------------------------------ caching


def cached(name: str, spec: dict, build):
    """``build()`` once per (name, spec), pickled under ``benchmarks/results/cache``."""
    if os.environ.get("KVPI_BENCH_NOCACHE"):
        return build()
    key = hashlib.sha256(repr((GENERATOR_VERSION, name, sorted(spec.items()))).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{name}-{key}.pkl"
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        pass
    value = build()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return value


def load_events(workload: str, p: Params | None = None, *, mooncake_requests_n: int | None = None,
                capacity_blocks: int | None = 16384) -> list[list[Event]]:
    """Events of ``workload`` ("anchor" with ``p``, or "mooncake"), cached."""
    if workload == "anchor":
        return cached("anchor-events", asdict(p), lambda: anchor_events(p))
    if workload == "mooncake":
        w = p.workers if p is not None else 8
        bs = p.block_size if p is not None else 16
        seed = p.seed if p is not None else 0
        spec = {"workers": w, "max_requests": mooncake_requests_n, "capacity": capacity_blocks,
                "block_size": bs, "seed": seed}
        return cached("mooncake-events", spec,
                      lambda: mooncake_events(w, mooncake_requests_n, capacity_blocks, bs, seed))
    raise ValueError(f"unknown workload {workload!r}")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Print the counts of a generated workload.")
    ap.add_argument("--workload", choices=("anchor", "mooncake"), default="anchor")
    ap.add_argument("--quick", action="store_true", help="small workload (seqs=200 / 1000 requests)")
    ap.add_argument("--requests", type=int, default=None, help="mooncake: first N requests")
    ap.add_argument("--capacity", type=int, default=16384, help="mooncake: blocks per worker")
    ap.add_argument("--long-blocks", type=int, default=0)
    add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.seqs = min(args.seqs, 200)
        args.requests = args.requests or 1000
    p = params_from_args(args, long_blocks=args.long_blocks)
    ev = load_events(args.workload, p, mooncake_requests_n=args.requests, capacity_blocks=args.capacity)
    s = summarize(ev)
    width = max(map(len, s))
    for k, v in s.items():
        print(f"{k:<{width}}  {v:>12,}")


if __name__ == "__main__":
    main()
