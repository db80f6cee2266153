"""Block keys: the indexer's own name for one block of tokens (contract §2, R-KEY).

A block key is ``xxh3_64`` of the block's token ids as little-endian uint32, seed
1337: the value NVIDIA Dynamo calls a *local block hash*. It never depends on the
engine's hash, the process or the platform (R-KEY-2), so callers can compute keys
themselves and query with ``match_by_keys``.

Namespaces (R-KEY-1). A block's namespace is the LoRA name plus the *other* parts
of its vLLM ``extra_keys`` entry (cache salt, multimodal identifiers,
prompt-embedding digests). vLLM repeats the LoRA name as the first part of each
per-block ``extra_keys`` tuple when a LoRA is active; CPU-tier events carry no
``extra_keys`` at all, only ``lora_name``. Normalizing to
``(lora_name, other parts)`` gives a LoRA block the same key from a GPU or a CPU
event. A namespace is folded into the *seed*:

    seed = xxh3_64(b"kvpi-ns1" + msgpack([lora_name, [parts...]]), seed=1337)

and the block key is ``xxh3_64(tokens_le_u32, seed)``. Without a namespace the
seed is exactly 1337, so plain keys equal Dynamo's.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import xxhash

from indexer._native import core as _core

__all__ = [
    "KEY_SEED",
    "block_keys",
    "namespace_seed",
    "seeds_for_blocks",
    "tokens_to_bytes",
]

KEY_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.Encoder().encode
_NS_PREFIX = b"kvpi-ns1"

# array('I') is native-endian uint32; the key is defined on little-endian bytes.
_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


_structs: dict[int, struct.Struct] = {}


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes.

    Raises
    ------
    OverflowError
        When a token id is negative or above 2**32-1.
    TypeError
        When a token id is not an int.
    """
    n = len(token_ids)
    st = _structs.get(n)
    if st is None and n <= 65536:
        # A precompiled '<nI' packs ~20% faster than array(); cache a bounded set.
        if len(_structs) >= 256:
            _structs.clear()
        st = _structs[n] = struct.Struct(f"<{n}I")
    if st is not None:
        try:
            return st.pack(*token_ids)
        except struct.error:
            pass  # out of range or not ints: array() below raises the precise error
    a = array(_TYPECODE, token_ids)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def namespace_seed(lora_name: str | None, parts: Sequence[Any] | None) -> int:
    """The xxh3 seed for a block in namespace ``(lora_name, parts)``.

    ``parts`` are the block's extra-key parts other than the LoRA name (salt, mm
    pairs, prompt-embeds digest). No LoRA and no parts gives the plain seed 1337.
    """
    if not lora_name and not parts:
        return KEY_SEED
    ns = [lora_name or None, list(parts) if parts else []]
    try:
        packed = _encode(ns)
    except (TypeError, msgspec.EncodeError):
        packed = repr(ns).encode()
    return _xxh3(_NS_PREFIX + packed, KEY_SEED)


def _normalized_parts(entry: Any, lora_name: str | None) -> list[Any] | None:
    if entry is None:
        return None
    parts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if lora_name and parts and parts[0] == lora_name:
        parts = parts[1:]
    return parts or None


def seeds_for_blocks(
    n_blocks: int,
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
) -> list[int] | int:
    """Per-block seeds for a store or a query.

    Returns a single int when every block shares one seed (the common case),
    otherwise a list of ``n_blocks`` seeds. ``extra_keys`` is vLLM's per-block list
    (one entry per block, ``None`` for a block without extra keys).
    """
    base = namespace_seed(lora_name, None)
    if not extra_keys:
        return base
    seeds: list[int] | None = None
    for i in range(min(n_blocks, len(extra_keys))):
        parts = _normalized_parts(extra_keys[i], lora_name)
        if parts is None:
            continue
        if seeds is None:
            seeds = [base] * n_blocks
        seeds[i] = namespace_seed(lora_name, parts)
    return base if seeds is None else seeds


def block_keys(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    seed: int | Sequence[int] = KEY_SEED,
    limit: int | None = None,
    start: int = 0,
) -> list[int]:
    """Block keys of the full blocks ``start`` .. ``limit`` (default: all) of ``token_ids``.

    A trailing partial block is ignored. ``token_ids`` may already be
    little-endian uint32 bytes. ``seed`` is one seed for all blocks or one per
    block, indexed from block 0 (see :func:`seeds_for_blocks`).
    """
    buf = token_ids if isinstance(token_ids, (bytes, bytearray)) else tokens_to_bytes(token_ids)
    if _c_block_keys is not None:
        return _c_block_keys(buf, block_size, seed, -1 if limit is None else limit, start)
    step = block_size * 4
    n = len(buf) // step
    if limit is not None and limit < n:
        n = limit
    if n <= start:
        return []
    if isinstance(seed, int):
        # Slicing bytes (a 64-byte copy) beats a memoryview slice object here.
        return [_xxh3(buf[i : i + step], seed) for i in range(start * step, n * step, step)]
    return [_xxh3(buf[j * step : (j + 1) * step], seed[j]) for j in range(start, n)]


# (buf, block_size, seed, limit (-1: all), start): indexer/_core.pyi
_c_block_keys: Callable[[bytes | bytearray, int, int | Sequence[int], int, int], list[int]] | None = (
    _core.block_keys if _core is not None else None
)


def query_extra_keys(
    n_blocks: int,
    cache_salt: str | None,
    extra_keys: Iterable[Any] | None,
) -> list[Any] | None:
    """vLLM-shaped per-block extra keys for a query: the salt rides on block 0."""
    ek: list[Any] | None = list(extra_keys) if extra_keys is not None else None
    if cache_salt is None:
        return ek
    ek = (ek or []) + [None] * max(0, n_blocks - len(ek or []))
    first = ek[0] if ek else None
    first_parts = list(first) if isinstance(first, (list, tuple)) else ([] if first is None else [first])
    if ek:
        ek[0] = first_parts + [cache_salt]
    return ek
