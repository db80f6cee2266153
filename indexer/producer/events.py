"""Producer-side mirror of vLLM's KV-event structs, for tests, benchmarks and simulators.

These classes copy ``vllm/distributed/kv_events.py`` field for field, with the
same msgspec options, so :func:`encode_batch` yields the bytes vLLM publishes
(checked byte for byte against ``shared/data/vllm-golden``):

* ``version="0.23"``: events as positional arrays (``array_like``);
* ``version="0.24"`` and ``"0.33"``: events as maps tagged by ``"type"``
  (``omit_defaults`` drops optional fields that are None); 0.33 has the newer
  optional fields (``locality``, ``ownership``, ``session_id``, ...).

Users can feed their own routers with them; nothing here is used by the index.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

__all__ = ["Stored", "Removed", "Cleared", "encode_batch", "VERSIONS"]

Hash = int | bytes


class Stored(Struct, frozen=True):
    """A ``BlockStored`` as a producer describes it (every vLLM 0.33 field)."""

    block_hashes: list
    parent_block_hash: Any = None
    token_ids: list = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list | None = None


class Removed(Struct, frozen=True):
    block_hashes: list
    medium: str | None = "GPU"
    group_idx: int | None = 0
    locality: str | None = None
    ownership: str | None = None


class Cleared(Struct, frozen=True):
    pass


# --- vLLM's own struct shapes -------------------------------------------------


class _EventBatch(Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_MapEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_MapEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_MapEvent):
    pass


class _V24BlockStored(_MapEvent, tag="BlockStored"):
    # vLLM 0.24-0.25: the map layout before ``locality`` (fewer fields, so msgspec
    # writes a fixmap header where 0.33 writes map16).
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _V24BlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class _ArrEvent(Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrBlockStored(_ArrEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrBlockRemoved(_ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class _ArrAllBlocksCleared(_ArrEvent, tag="AllBlocksCleared"):
    pass


_encoder = msgspec.msgpack.Encoder()


def _to_wire(ev, version: str):
    arr = version == "0.23"
    v24 = version == "0.24"
    if isinstance(ev, Stored):
        extra = None if ev.extra_keys is None else [None if e is None else tuple(e) for e in ev.extra_keys]
        common = (
            list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), ev.block_size,
            ev.lora_id, ev.medium, ev.lora_name, extra, ev.group_idx, ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
        )
        if arr:
            return _ArrBlockStored(*common)
        if v24:
            return _V24BlockStored(*common)
        return BlockStored(
            *common, locality=ev.locality, ownership=ev.ownership,
            session_id=ev.session_id, lookahead_token_ids=ev.lookahead_token_ids,
        )
    if isinstance(ev, Removed):
        if arr:
            return _ArrBlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx)
        if v24:
            return _V24BlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx)
        return BlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx, ev.locality, ev.ownership)
    if isinstance(ev, Cleared):
        return _ArrAllBlocksCleared() if arr else AllBlocksCleared()
    raise TypeError(f"not an event: {ev!r}")


VERSIONS = ("0.23", "0.24", "0.33")


def encode_batch(
    events, *, ts: float = 1767225600.0, dp_rank: int | None = 0, version: str = "0.33"
) -> bytes:
    """The msgpack payload vLLM ``version`` would publish for ``events`` (frame 3).

    ``"0.23"`` is the positional (array) layout, ``"0.24"`` the first map layout,
    ``"0.33"`` the map layout with every newer optional field. Fields a version
    does not have are not sent.
    """
    if version not in VERSIONS:
        raise ValueError(f"unknown vLLM version {version!r}; one of {VERSIONS}")
    return _encoder.encode(_EventBatch(ts, [_to_wire(e, version) for e in events], dp_rank))
