"""Shared test helpers: vLLM-shaped events, simulated engine hashes, index probes.

Engine hashes are simulated as vLLM chains them: one 64-bit value per token
prefix (xxh64 of the repr of the namespace and the prefix), so a block's hash
depends on every token before it, like vLLM's ``hash(parent, tokens, extra)``.
"""

from __future__ import annotations

import xxhash

import golden
from indexer.producer.events import Removed, Stored, encode_batch

WIRE = ["0.33", "0.23"]  # map layout and positional (array) layout
FA = "full_attention"
ENGINE = "e1"
GOLDEN_DIRS = sorted(golden.VERSIONS)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def abc_fleet(clock, **kw):
    """A PrefixIndex on ``clock`` with three workers a, b, c of the default model, nothing cached."""
    from indexer import PrefixIndex

    idx = PrefixIndex(clock=clock, **kw)
    for e in ("a", "b", "c"):
        idx.register_worker(e, 0)
    return idx


def toks(base: int, nblocks: int, bs: int) -> list[int]:
    return list(range(base, base + nblocks * bs))


def ehashes(tokens, bs: int, ns: str = "") -> list[int]:
    """Engine hashes: a chained 64-bit value per full-block prefix."""
    return [
        xxhash.xxh64_intdigest(repr((ns, tuple(tokens[: (i + 1) * bs]))).encode())
        for i in range(len(tokens) // bs)
    ]


def store(tokens, bs, a, b, *, medium="GPU", group=0, kind=FA, ns="", hashes=None, **kw) -> Stored:
    """A rich store of blocks [a, b) of ``tokens`` (parent = block a-1's hash)."""
    hs = ehashes(tokens, bs, ns) if hashes is None else hashes
    return Stored(
        block_hashes=hs[a:b],
        parent_block_hash=hs[a - 1] if a else None,
        token_ids=list(tokens[a * bs : b * bs]),
        block_size=bs,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
        **kw,
    )


def chunks(tokens, bs, per, *, medium="CPU", first=0, **kw) -> list[Stored]:
    """Self-describing connector stores: one event per chunk of ``per`` blocks."""
    n = len(tokens) // bs
    return [store(tokens, bs, a, a + per, medium=medium, **kw) for a in range(first, n - n % per, per)]


def placeholder(hashes, *, medium="CPU", group=0, **kw) -> Stored:
    """Flag-off / legacy connector store: hashes only, block_size 0, no tokens."""
    return Stored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=0,
        medium=medium, group_idx=group, **kw,
    )


def removed(hashes, *, medium="GPU", group=0, **kw) -> Removed:
    return Removed(block_hashes=list(hashes), medium=medium, group_idx=group, **kw)


def gpu_evictions(hashes, *, group=0) -> list[Removed]:
    """vLLM's GPU tier: one BlockRemoved per hash."""
    return [removed([h], medium="GPU", group=group) for h in hashes]


def apply(idx, events, ver="0.33", engine=ENGINE, dp_rank=0, ts=1767225600.0, **kw):
    return idx.apply(engine, encode_batch(events, version=ver, dp_rank=dp_rank, ts=ts), **kw)


def ev(idx, typ, outcome) -> int:
    return idx.stats()["events"].get(typ, {}).get(outcome, 0)


def counter(idx, name) -> int:
    return idx.stats()["counters"].get(name, 0)


def wm(idx, tokens, engine=ENGINE, rank=0, **kw):
    return idx.match(tokens, **kw).worker(engine, rank)


def tiers(idx, tokens, engine=ENGINE, rank=0, **kw) -> dict:
    w = wm(idx, tokens, engine, rank, **kw)
    return {} if w is None else dict(w.tiers)


def total(idx, tokens, engine=ENGINE, rank=0, **kw) -> int:
    w = wm(idx, tokens, engine, rank, **kw)
    return 0 if w is None else w.total_blocks


def winfo(idx, engine=ENGINE, rank=0) -> dict:
    for w in idx.workers():
        if w["engine"] == engine and w["dp_rank"] == rank:
            return w
    raise AssertionError(f"no worker {engine}/{rank}")


def golden_events(vdir: str, name: str) -> list:
    for f in golden.entries(vdir):
        if f["file"] == f"{name}.msgpack":
            return golden.as_events(golden.unhex(f["decoded"])[1])
    raise KeyError(name)
