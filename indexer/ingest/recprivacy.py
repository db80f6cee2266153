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

from indexer.query.index import PrefixIndex
from indexer.wire.decode import decode_tokens
from indexer.wire.keys import KEY_SEED, block_keys, seeds_for_blocks, tokens_to_bytes

__all__ = ["MODES", "KeyedReplayIndex", "strip_payload", "strip_event"]

MODES = ("none", "hashed", "full")
_STORED = "BlockStored"
# Positional layout (vLLM <= 0.23): [tag, block_hashes, parent, token_ids, block_size,
# lora_id, medium, lora_name, extra_keys, ...] (indexer.wire.events, BLOCK_STORED).
_P_HASHES, _P_TOKENS, _P_BS, _P_LORA, _P_EXTRA = 1, 3, 4, 7, 8


def _keyed_tokens(tokens: Any, n: int, bs: int, lora: Any, extra: Any) -> list[int]:
    """The key-carrying ids that stand for ``tokens`` (see the module)."""
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
    out = [0] * ntok
    for i, k in enumerate(block_keys(buf, bs, seed)):
        out[i * bs] = k & 0xFFFFFFFF
        out[i * bs + 1] = k >> 32
    return out


def strip_event(ev: Any, mode: str) -> Any:
    """One event (decoded msgpack, either layout) as ``mode`` keeps it; others unchanged."""
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
                ev.get("lora_name"), ev.get("extra_keys"))
        return ev
    if isinstance(ev, list) and len(ev) > _P_TOKENS and ev[0] == _STORED:
        ev = list(ev)
        toks = ev[_P_TOKENS]
        if isinstance(toks, list) and toks:
            hashes = ev[_P_HASHES]
            ev[_P_TOKENS] = [] if mode == "none" else _keyed_tokens(
                toks, len(hashes) if isinstance(hashes, list) else 0,
                _int(ev[_P_BS]) if len(ev) > _P_BS else 0,
                ev[_P_LORA] if len(ev) > _P_LORA else None, ev[_P_EXTRA] if len(ev) > _P_EXTRA else None)
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
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return _UNDECODABLE
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        return _UNDECODABLE
    batch = list(batch)
    batch[1] = [strip_event(ev, mode) for ev in batch[1]]
    return msgspec.msgpack.encode(batch)


_UNDECODABLE = b"\xc1"  # a byte msgpack never uses: refused again as undecodable


class KeyedReplayIndex(PrefixIndex):
    """A :class:`PrefixIndex` that reads each store's block keys from the key-carrying
    ids of a ``hashed`` recording instead of hashing token ids; every other decision is
    the index's own. Batches take the typed decoder (the compiled scan would hash)."""

    _scan_gpu = None

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
