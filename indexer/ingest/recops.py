"""One journaled call as a recording keeps it, and the same call made again on a replay
index: arguments (prompts as the privacy mode keeps them, :mod:`.recprivacy`) and
results (answers encoded so two of them compare byte for byte)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import msgspec
import xxhash

from indexer._native import core as _core
from indexer.ingest.recprivacy import keys_bytes, strip_payload
from indexer.query.index import PrefixIndex
from indexer.query.match import KeySource
from indexer.query.route import Load
from indexer.store import journal as J
from indexer.store.journal import Raised
from indexer.store.peerflight import PeerEntry
from indexer.wire.keys import block_keys

__all__ = ["Divergence", "encode_call", "encode_result", "replay_call"]

_enc = msgspec.msgpack.Encoder()
# The first item of a route answer kept as its head and its entries' JSON (replay shows
# the JSON decoded).
JSON_ANSWER = "json"
# An answer up to this size is kept whole (a mismatch then shows both); a larger one as
# its digest and a summary.
MAX_KEPT_ANSWER = 8192


class Divergence(Exception):
    """A replayed call needs what the recording does not hold (a block size the query did
    not use then, a clock reading it did not make): the index already answers otherwise."""


# ------------------------------------------------------------------ prompts


def _query(src: KeySource, mode: str, sizes: list[int]) -> dict[str, Any]:
    if mode == "full":
        return {"n": src.ntok, "t": src.buf, "l": src.lora_name, "s": src.cache_salt, "x": src.extra_keys}
    if mode == "none":
        return {"n": src.ntok}
    keys = {}
    for bs in sizes:
        n = src.ntok // bs
        keys[bs] = _packed_keys(src.buf, bs, src.seed(n), n)
    return {"n": src.ntok, "k": keys}


def _packed_keys_py(buf: bytes, bs: int, seed: Any, n: int) -> bytes:
    return keys_bytes(block_keys(buf, bs, seed, n))


# A query's keys as the recording keeps them (uint64 LE bytes): in the compiled core
# straight to bytes, with no int object per key (a third of a hashed match's record).
_packed_keys: Any = (lambda buf, bs, seed, n: _core.block_keys(buf, bs, seed, n, 0, True)) \
    if _core is not None else _packed_keys_py


class RecordedKeys:
    """A query's key source rebuilt from a hashed recording: the keys per block size, in
    the chunks :class:`~indexer.query.match.KeySource` hands out."""

    __slots__ = ("ntok", "keys")

    def __init__(self, q: dict[Any, Any]) -> None:
        self.ntok: int = q["n"]
        self.keys = {int(bs): array("Q", b).tolist() for bs, b in q["k"].items()}

    def __call__(self, bs: int) -> Iterator[list[int]]:
        ks = self.keys.get(bs)
        if ks is None:
            raise Divergence(f"the query now needs block size {bs}, which it did not use when recorded")
        i, size = 0, 64
        while i < len(ks):
            yield ks[i:i + size]
            i += size
            size <<= 3


def _source(q: dict[Any, Any]) -> Any:
    if "t" in q:
        return KeySource(q["t"], q["l"], q["s"], q["x"])
    if "k" in q:
        return RecordedKeys(q)
    raise Divergence("the recording keeps no prompt (--record-tokens none)")


# ------------------------------------------------------------------ calls


def encode_call(op: int, args: tuple[Any, ...], result: Any, mode: str) -> list[Any]:
    """``op``'s arguments as the recording keeps them (msgpack-able)."""
    if op in (J.APPLY, J.APPLY_SEQUENCED):
        engine, payload, model, dp_rank, seq, _ = args
        return [engine, strip_payload(payload, mode), model, dp_rank, seq]
    if op == J.ROUTE:
        src, model, load, cands, scale, record, max_tokens, link, structs = args
        bs = list(src.sizes or src.cache)
        return [_query(src, mode, bs), model,
                None if load is None else {k: [v[0], v[1]] for k, v in load.items()},
                None if cands is None else list(cands), scale, record, max_tokens,
                None if link is None else [[e, r, c[0], c[1]] for (e, r), c in link.items()], structs]
    if op == J.MATCH:
        src, model = args
        return [_query(src, mode, list(src.cache)), model]
    if op == J.MATCH_PLAIN:
        buf, model, _ = args
        src = KeySource(buf, None, None, None)
        return [_query(src, mode, [] if result is None or isinstance(result, Raised) else [result.block_size]),
                model]
    if op == J.MATCH_BY_KEYS:
        keys, model = args
        return [keys_bytes(keys) if mode != "none" else b"", len(keys), model]
    if op == J.ADOPT_PEER:
        origin, entries = args
        return [origin, [[e.rid, e.model, e.engine, e.dp_rank, e.keys.tobytes() if mode != "none" else b"",
                          e.prefill_tokens, e.decode_blocks, e.prefill_open, e.decode_open, e.age] for e in entries]]
    if op == J.END_PEER:
        return [[[rid, whole] for rid, whole in args[0]]]
    if op == J.FORGET_PEER_WORKER:
        return [list(args[0])]
    if op == J.CORRECT_LOAD:
        w, waiting, running, t = args
        return [list(w), waiting, running, t]
    if op == J.REGISTER:
        return list(args)
    return list(args)


def encode_result(op: int, result: Any) -> Any:
    """``op``'s result as the recording keeps it; a replayed result encodes the same way,
    so equal answers are equal records."""
    if isinstance(result, Raised):
        return ["!", result.kind, result.message]
    if op in (J.APPLY, J.APPLY_SEQUENCED):
        return [result[0], result[1]]
    if op == J.ROUTE:
        ranking, rid = result
        worker, engine, rank_, score, cost, _, _ = ranking.head()
        reason = ranking.reason()
        if ranking.json is not None:
            # Entries the compiled core wrote as JSON (the service's /v1/route): those bytes
            # and the head, not structs made again (the route made none per worker).
            body = _enc.encode([JSON_ANSWER, ranking.model, worker, engine, rank_, score, cost, reason,
                                ranking.best.tiers if ranking.best is not None else {}, ranking.unused_load, rid,
                                ranking.json])
        else:
            body = _enc.encode(ranking.response(rid))
        return _answer(body, [rid, worker, reason, score, cost])
    if op in (J.MATCH, J.MATCH_BY_KEYS, J.MATCH_PLAIN):
        if result is None:
            return None
        body = _enc.encode(result)
        b = result.best
        return _answer(body, None if b is None else [f"{b.engine}/{b.dp_rank}", b.score])
    if op == J.REGISTER or result is None:
        return None
    if isinstance(result, (bool, int, float, str)):
        return result
    return None


def _answer(body: bytes, summary: Any) -> list[Any]:
    return [body if len(body) <= MAX_KEPT_ANSWER else None, xxhash.xxh64_intdigest(body), summary]


def same_result(recorded: Any, replayed: Any) -> bool:
    """Whether two encoded results are the same answer (whole, or by digest)."""
    if isinstance(recorded, list) and len(recorded) == 3 and isinstance(recorded[1], int) \
            and isinstance(replayed, list) and len(replayed) == 3:
        return bool(recorded[1] == replayed[1] and recorded[2] == replayed[2])
    return bool(recorded == replayed)


def replay_call(index: PrefixIndex, op: int, a: list[Any]) -> Any:
    """Make the recorded call ``op`` with arguments ``a`` on ``index`` (the caller holds its
    lock, as the recording index did); returns its result as the index returns it."""
    if op == J.APPLY or op == J.APPLY_SEQUENCED:
        return index._apply(a[0], a[1], a[2], a[3], a[4], op == J.APPLY)
    if op == J.ROUTE:
        q, model, load, cands, scale, record, max_tokens, link, structs = a
        return index._route_keys(_source(q), model, None if load is None else {k: Load(*v) for k, v in load.items()},
                                 cands, scale, record, max_tokens,
                                 None if link is None else {(e, r): (c, p) for e, r, c, p in link}, structs)
    if op == J.MATCH:
        return index._match_keys(_source(a[0]), a[1])
    if op == J.MATCH_PLAIN:
        q = a[0]
        src = _source(q) if ("k" in q and q["k"]) or "t" in q else None
        buf = bytes(4 * q["n"])  # only its length counts when the keys are given
        if src is not None and "t" in q:
            return index._match_plain(q["t"], a[1], None)
        return index._match_plain(buf, a[1], src)
    if op == J.MATCH_BY_KEYS:
        if a[1] and not a[0]:
            raise Divergence("the recording keeps no block keys (--record-tokens none)")
        return index._match_by_keys(array("Q", a[0]).tolist(), a[2])
    f = _CALLS.get(op)
    if f is None:
        raise Divergence(f"unknown op {op} (a recording of a newer version?)")
    return f(index, a)


def _adopt(index: PrefixIndex, a: list[Any]) -> Any:
    entries = []
    for rid, model, engine, rank, keys, pre, dec, popen, dopen, age in a[1]:
        arr = array("Q")
        arr.frombytes(keys)
        entries.append(PeerEntry(rid, model, engine, rank, arr, pre, dec, popen, dopen, age))
    return index._adopt_peer(a[0], entries)


_CALLS: dict[int, Any] = {
    J.DROP_WORKER: lambda ix, a: ix._drop_worker(*a),
    J.DROP_ENGINE: lambda ix, a: ix._drop_engine(*a),
    J.RESET_WORKER: lambda ix, a: ix._reset_worker(*a),
    J.CLEAR_ENGINE: lambda ix, a: ix._clear_engine(*a),
    J.REGISTER: lambda ix, a: ix._worker(*a),
    J.MARK_STALE: lambda ix, a: ix._mark_stale(*a),
    J.CLEAR_STALE: lambda ix, a: ix._clear_stale(*a),
    J.COUNT: lambda ix, a: ix._count(*a),
    J.COUNT_DROPPED: lambda ix, a: ix._drop(*a),
    J.ROUTE_DONE: lambda ix, a: ix.inflight.done(a[0]),
    J.CORRECT_LOAD: lambda ix, a: ix.inflight.correct((a[0][0], a[0][1]), a[1], a[2], a[3]),
    J.TIE_SLOT: lambda ix, a: ix._set_tie_slot(*a),
    J.ADOPT_PEER: _adopt,
    J.END_PEER: lambda ix, a: ix._end_peer([(rid, whole) for rid, whole in a[0]]),
    J.FORGET_PEER_WORKER: lambda ix, a: ix.inflight.forget_peer_worker((a[0][0], a[0][1])),
    J.DROP_PEER: lambda ix, a: ix.inflight.drop_origin(a[0], a[1]),
    J.EXPIRE: lambda ix, a: ix.inflight.expire(),
    J.CLOSE: lambda ix, a: ix._clear(),
}
