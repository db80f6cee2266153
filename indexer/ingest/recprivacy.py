"""What a recording keeps of prompts and token ids (``--record-tokens``).

* ``full``: payloads exactly as received, query prompts as token ids (with LoRA name,
  cache salt, extra keys). A replay runs the very same code on the very same input.
* ``hashed`` (the default): no token id is kept. A query is kept as its block keys
  (xxh3 of each block's tokens in its namespace, R-KEY-1: what the index itself keys
  by), one list per block size the query used, plus its token count. In a payload, each
  ``BlockStored``'s ``token_ids`` (GPU and CPU-tier events alike) are replaced by
  *key-carrying* ids: block ``i``'s ``block_size`` ids become ``[low 32 bits of its key,
  high 32 bits, 0, ...]``, the count unchanged, so every shape check decides as before
  and a replay index (:class:`KeyedReplayIndex`) reads the keys back instead of hashing;
  ids that are not valid uint32 become ``-1`` (refused again as bad tokens); a store the
  index does not key (a sliding-window tail, a shape mismatch) keeps only zeros.
  ``lookahead_token_ids`` is dropped. Everything else in the payload stays as sent.
* ``none``: no token id and no block key. Payloads keep their events with
  ``token_ids`` emptied and queries only their token count: the recording tells which
  batches arrived, in which order, what the sequencer decided and what each query was
  answered, but a replay cannot rebuild the index (it lists instead of checking).

Engine block hashes (which vLLM derives from tokens with its own seed) are kept in every
mode: the index maps them, and they cannot be turned back into tokens.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from indexer._native import core as _core
from indexer.query.index import PrefixIndex
from indexer.wire.decode import decode_event, decode_tokens, scan_gpu_batch
from indexer.wire.keys import KEY_SEED, block_keys, seeds_for_blocks, tokens_to_bytes

__all__ = ["MODES", "KeyedReplayIndex", "expand_payload", "strip_payload", "strip_event"]

MODES = ("none", "hashed", "full")
_STORED = "BlockStored"
# Positional layout (vLLM <= 0.23): [tag, block_hashes, parent, token_ids, block_size,
# lora_id, medium, lora_name, extra_keys, ...] (indexer.wire.events, BLOCK_STORED).
_P_HASHES, _P_TOKENS, _P_BS, _P_LORA, _P_EXTRA = 1, 3, 4, 7, 8


def _keyed_tokens(tokens: Any, n: int, bs: int, lora: Any, extra: Any, packed: bool) -> list[int] | bytes:
    """What stands for ``tokens`` (see the module): the block keys as uint64 bytes when
    ``packed`` (a recorded payload: :func:`expand_payload` makes the ids at replay), else
    the key-carrying ids themselves."""
    ntok = len(tokens)
    if bs <= 0 or ntok == 0:
        return list(tokens)  # a placeholder: nothing keyed, nothing to hide
    try:
        buf = tokens_to_bytes(tokens)
    except (OverflowError, TypeError, ValueError):
        return [-1] * ntok
    if n == 0 or ntok != n * bs or bs < 2:
        return [0] * ntok
    seed = KEY_SEED if (not lora and not extra) else seeds_for_blocks(n, lora, extra)
    keys = block_keys(buf, bs, seed)
    return array("Q", keys).tobytes() if packed else _carrying(keys, bs)


def _carrying(keys: Any, bs: int) -> list[int]:
    """Key-carrying ids: block i's ``bs`` ids are [low 32 bits of key i, high 32 bits, 0...]."""
    out = [0] * (len(keys) * bs)
    for i, k in enumerate(keys):
        out[i * bs] = k & 0xFFFFFFFF
        out[i * bs + 1] = k >> 32
    return out


def strip_event(ev: Any, mode: str, packed: bool = False) -> Any:
    """One event (decoded msgpack, either layout) as ``mode`` keeps it; others unchanged.
    ``packed``: a store's keys as uint64 bytes (see :func:`_keyed_tokens`)."""
    if isinstance(ev, dict):
        if ev.get("type") != _STORED:
            return ev
        ev = dict(ev)
        ev.pop("lookahead_token_ids", None)
        toks = ev.get("token_ids")
        if isinstance(toks, list) and toks:
            hashes = ev.get("block_hashes")
            ev["token_ids"] = [] if mode == "none" else _keyed_tokens(
                toks, len(hashes) if isinstance(hashes, list) else 0, _int(ev.get("block_size")),
                ev.get("lora_name"), ev.get("extra_keys"), packed)
        return ev
    if isinstance(ev, list) and len(ev) > _P_TOKENS and ev[0] == _STORED:
        ev = list(ev)
        toks = ev[_P_TOKENS]
        if isinstance(toks, list) and toks:
            hashes = ev[_P_HASHES]
            ev[_P_TOKENS] = [] if mode == "none" else _keyed_tokens(
                toks, len(hashes) if isinstance(hashes, list) else 0,
                _int(ev[_P_BS]) if len(ev) > _P_BS else 0,
                ev[_P_LORA] if len(ev) > _P_LORA else None, ev[_P_EXTRA] if len(ev) > _P_EXTRA else None, packed)
        return ev
    return ev


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def strip_payload(payload: bytes, mode: str) -> bytes:
    """A batch payload as ``mode`` keeps it (``full``: itself). In ``hashed`` and
    ``none``, a payload that is not a batch (the index did not decode it either) is kept
    as one byte that never decodes: its bytes could be anything, token ids included."""
    if mode == "full":
        return payload
    if mode == "hashed":
        fast = _plain_gpu(payload)
        if fast is not None:
            return fast
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return _UNDECODABLE
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        return _UNDECODABLE
    batch = list(batch)
    batch[1] = [strip_event(ev, mode, True) for ev in batch[1]]
    return msgspec.msgpack.encode(batch)


def _plain_gpu(payload: bytes) -> bytes | None:
    """:func:`strip_payload` ``hashed`` of the common batch (plain GPU stores, map layout),
    with no Python object per token: each store's ``token_ids`` array is cut out of the
    payload and its block keys (hashed by the compiled core) put in its place. None for
    any other batch (the general path decides)."""
    if scan_gpu_batch is None or _core is None:
        return None
    sc = scan_gpu_batch(payload)
    if sc is None:
        return None
    out: list[bytes] = []
    pos = 0
    for hashes, _, tokens, bs, _, _, start, end in sc[2]:
        n = len(hashes) >> 3
        if bs < 2 or len(tokens) != 4 * n * bs:
            return None
        ev = payload[start:end]
        # vLLM sends fields in declaration order: token_ids, then block_size (always sent).
        # The array between them must read back as exactly the scanned tokens.
        j = ev.find(_TOKENS_KEY)
        k = ev.find(_BS_KEY, j)
        if j < 0 or k < 0:
            return None
        j += len(_TOKENS_KEY)
        if _core.tokens_from_msgpack(ev[j:k]) != tokens:
            raw = bytes(decode_event(ev).token_ids)  # another order: find the array itself
            j = ev.find(_TOKENS_KEY + raw)
            if j < 0:
                return None
            j += len(_TOKENS_KEY)
            k = j + len(raw)
        keys = _core.block_keys(tokens, bs, KEY_SEED, n, 0, True)
        out += (payload[pos:start], ev[:j], _bin(keys), ev[k:])
        pos = end
    out.append(payload[pos:])
    return b"".join(out)


_TOKENS_KEY = b"\xa9token_ids"  # the keys as msgpack (fixstr of 9, of 10)
_BS_KEY = b"\xaablock_size"


def _bin(b: bytes) -> bytes:
    n = len(b)
    if n < 256:
        return b"\xc4" + bytes((n,)) + b
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big") + b
    return b"\xc6" + n.to_bytes(4, "big") + b


def expand_payload(payload: bytes) -> bytes:
    """A ``hashed`` recording's payload made applicable again: each store's block keys
    (uint64 bytes) become its key-carrying ids. Other payloads unchanged."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return payload
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        return payload
    changed = False
    for i, ev in enumerate(batch[1]):
        if isinstance(ev, dict) and isinstance(ev.get("token_ids"), bytes):
            ev["token_ids"] = _carrying(array("Q", ev["token_ids"]).tolist(), _int(ev.get("block_size")))
            changed = True
        elif isinstance(ev, list) and len(ev) > _P_BS and isinstance(ev[_P_TOKENS], bytes):
            ev[_P_TOKENS] = _carrying(array("Q", ev[_P_TOKENS]).tolist(), _int(ev[_P_BS]))
            changed = True
        batch[1][i] = ev
    return msgspec.msgpack.encode(batch) if changed else payload


_UNDECODABLE = b"\xc1"  # a byte msgpack never uses: refused again as undecodable


class KeyedReplayIndex(PrefixIndex):
    """A :class:`PrefixIndex` that reads each store's block keys from the key-carrying
    ids of a ``hashed`` recording instead of hashing token ids; every other decision is
    the index's own. Batches take the typed decoder (the compiled scan would hash)."""

    _scan_gpu = None

    def _apply(self, engine: str, payload: bytes, model: str, dp_rank: int | None, seq: int | None,
               decide: bool) -> tuple[str, float | None]:
        return super()._apply(engine, expand_payload(payload), model, dp_rank, seq, decide)

    @staticmethod
    def _event_keys(ev: Any, block_size: int, n: int) -> list[int] | None:
        try:
            toks = decode_tokens(ev.token_ids)
        except msgspec.DecodeError:
            return None
        if len(toks) != n * block_size or any(t < 0 for t in toks[:2]):
            return None
        return [toks[i * block_size] | (toks[i * block_size + 1] << 32) for i in range(n)]


def keys_bytes(keys: Any) -> bytes:
    """Block keys as little-endian uint64 bytes (how a recording keeps them)."""
    return array("Q", keys).tobytes()
