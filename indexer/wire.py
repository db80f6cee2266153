"""Decoding of vLLM KV-event batch payloads (frame 3 of a live ZMQ message).

Wire facts (see ``shared/reference/vllm-kv-events.md`` §1):

* The batch is always a 3-element msgpack array ``[ts, events, data_parallel_rank]``.
* vLLM <= 0.23 encodes each event as a positional array whose first element is the
  class name (``["BlockStored", hashes, parent, tokens, ...]``); vLLM >= 0.24 encodes
  each event as a map tagged by ``"type"``. Fields are looked up by name in the map
  layout; fields with a default are omitted when they equal it.
* Block hashes are uint64 (up to 2**64-1, msgpack marker 0xcf) or raw ``bytes``
  digests when the engine runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

Decoding is two-speed. The fast path decodes the whole batch with one typed,
strict decoder (unknown fields or event types make it fail). Only then the slow
path decodes event by event, so unknown event types and unknown fields are
ignored *and counted*, and one malformed event costs that event, not the batch.

``token_ids`` are kept as :class:`msgspec.Raw` and decoded only when the block keys
must be computed: a store whose hashes the worker already holds (duplicates, CPU
offloads of GPU blocks) never pays for its tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

import msgspec
from msgspec import Raw, Struct

from ._compiled import core as _core
from .keys import tokens_to_bytes

__all__ = [
    "STORED",
    "REMOVED",
    "CLEARED",
    "DecodeError",
    "DecodedBatch",
    "decode_batch",
    "peek_ts",
    "raw_array_len",
    "decode_tokens",
    "token_bytes",
]

STORED = 0
REMOVED = 1
CLEARED = 2

Hash = Union[int, bytes]

# Map layout (vLLM >= 0.24). ``forbid_unknown_fields`` makes the fast path fail on a
# field we do not know, so the slow path can count it; the lenient twins below
# (``forbid_unknown_fields=False``) then decode the same bytes.


class _MapStored(Struct, tag="BlockStored", forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = STORED
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: Raw = Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapRemoved(Struct, tag="BlockRemoved", forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = REMOVED
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapCleared(Struct, tag="AllBlocksCleared", forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = CLEARED


class _LenientMapStored(_MapStored, tag="BlockStored", forbid_unknown_fields=False):
    pass


class _LenientMapRemoved(_MapRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    pass


class _LenientMapCleared(_MapCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


# Positional layout (vLLM <= 0.23): the tag is element 0, then the fields in
# declaration order. Older producers send fewer trailing fields (defaults apply).


class _ArrStored(Struct, tag="BlockStored", array_like=True, forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = STORED
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: Raw = Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # Not sent by any array-layout release; present so both layouts expose the
    # same attributes to the applier.
    locality: ClassVar[None] = None
    ownership: ClassVar[None] = None


class _ArrRemoved(Struct, tag="BlockRemoved", array_like=True, forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = REMOVED
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: ClassVar[None] = None
    ownership: ClassVar[None] = None


class _ArrCleared(Struct, tag="AllBlocksCleared", array_like=True, forbid_unknown_fields=True, gc=False):
    kind: ClassVar[int] = CLEARED


# With forbid_unknown_fields an array_like struct rejects extra trailing elements,
# so the fast path fails over to the slow one, which counts them and decodes with
# these lenient twins.
class _LenientArrStored(_ArrStored, tag="BlockStored", forbid_unknown_fields=False):
    pass


class _LenientArrRemoved(_ArrRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    pass


class _LenientArrCleared(_ArrCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


_ARR_FIELDS = {
    "BlockStored": len(_ArrStored.__struct_fields__),
    "BlockRemoved": len(_ArrRemoved.__struct_fields__),
    "AllBlocksCleared": 0,
}
_MAP_FIELDS = {
    "BlockStored": frozenset(_MapStored.__struct_fields__),
    "BlockRemoved": frozenset(_MapRemoved.__struct_fields__),
    "AllBlocksCleared": frozenset(),
}

MapEvent = Union[_MapStored, _MapRemoved, _MapCleared]
ArrEvent = Union[_ArrStored, _ArrRemoved, _ArrCleared]


class _MapBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class _ArrBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrEvent]
    data_parallel_rank: int | None = None


class _RawBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[Raw]
    data_parallel_rank: int | None = None


class _TsOnly(Struct, array_like=True, gc=False):
    ts: float
    events: Raw
    data_parallel_rank: Any = None


_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_ts_only = msgspec.msgpack.Decoder(_TsOnly)
_arr_batch = msgspec.msgpack.Decoder(_ArrBatch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_map_event = msgspec.msgpack.Decoder(Union[_LenientMapStored, _LenientMapRemoved, _LenientMapCleared])
_arr_event = msgspec.msgpack.Decoder(Union[_LenientArrStored, _LenientArrRemoved, _LenientArrCleared])
_any = msgspec.msgpack.Decoder()
_tokens = msgspec.msgpack.Decoder(list[int])


class DecodeError(ValueError):
    """The payload is not a vLLM event batch; ``reason`` is a bounded label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DecodedBatch(Struct, frozen=True, gc=False):
    """One decoded batch.

    ``events`` hold objects with a ``kind`` (``STORED``, ``REMOVED``, ``CLEARED``)
    and the vLLM field names as attributes, whichever layout they came in.
    ``issues`` counts what the slow path ignored: ``unknown_event_type``,
    ``unknown_field``, ``malformed_event``.
    """

    ts: float
    events: list
    dp_rank: int | None
    layout: str
    issues: dict


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload in either wire layout.

    Raises
    ------
    DecodeError
        When the bytes are not a 3-element batch array at all.
    """
    try:
        b = _map_batch.decode(payload)
        return DecodedBatch(b.ts, b.events, b.data_parallel_rank, "map", {})
    except msgspec.DecodeError:
        pass
    try:
        b = _arr_batch.decode(payload)
        return DecodedBatch(b.ts, b.events, b.data_parallel_rank, "array", {})
    except msgspec.DecodeError:
        pass
    return _decode_slow(payload)


def peek_ts(payload: bytes) -> float | None:
    """The batch timestamp alone (events are skipped, not decoded); None if unreadable."""
    try:
        return _ts_only.decode(payload).ts
    except msgspec.DecodeError:
        return None


def _decode_slow(payload: bytes) -> DecodedBatch:
    try:
        b = _raw_batch.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError("bad_payload", str(e)) from None
    issues: dict[str, int] = {}
    events = []
    layout = "map"
    for raw in b.events:
        try:
            generic = _any.decode(raw)
        except msgspec.DecodeError:
            _bump(issues, "malformed_event")
            continue
        if isinstance(generic, dict):
            tag = generic.get("type")
            known = _MAP_FIELDS.get(tag) if isinstance(tag, str) else None
            if known is None:
                _bump(issues, "unknown_event_type")
                continue
            extra = sum(1 for k in generic if k != "type" and k not in known)
            decoder = _map_event
        elif isinstance(generic, list) and generic:
            layout = "array"
            tag = generic[0]
            nfields = _ARR_FIELDS.get(tag) if isinstance(tag, str) else None
            if nfields is None:
                _bump(issues, "unknown_event_type")
                continue
            extra = max(0, len(generic) - 1 - nfields)
            decoder = _arr_event
        else:
            _bump(issues, "malformed_event")
            continue
        try:
            ev = decoder.decode(raw)
        except msgspec.DecodeError:
            _bump(issues, "malformed_event")
            continue
        if extra:
            issues["unknown_field"] = issues.get("unknown_field", 0) + extra
        events.append(ev)
    return DecodedBatch(b.ts, events, b.data_parallel_rank, layout, issues)


def _bump(d: dict, k: str) -> None:
    d[k] = d.get(k, 0) + 1


def raw_array_len(raw: Raw) -> int:
    """Number of elements of a msgpack array held as raw bytes, -1 if not an array.

    Reads only the header (fixarray 0x90-0x9f, array16 0xdc, array32 0xdd), so the
    shape check of a store costs nothing per token.
    """
    mv = memoryview(raw)
    if not mv:
        return -1
    b0 = mv[0]
    if 0x90 <= b0 <= 0x9F:
        return b0 & 0x0F
    if b0 == 0xDC and len(mv) >= 3:
        return (mv[1] << 8) | mv[2]
    if b0 == 0xDD and len(mv) >= 5:
        return int.from_bytes(mv[1:5], "big")
    if b0 == 0xC0:  # nil: a producer that sent token_ids=None
        return 0
    return -1


def decode_tokens(raw: Raw) -> list[int]:
    """Decode a raw ``token_ids`` array (raises ``msgspec.DecodeError`` when it is not ints)."""
    if memoryview(raw)[:1] == b"\xc0":
        return []
    return _tokens.decode(raw)


_c_tokens = _core.tokens_from_msgpack if _core is not None else None


def token_bytes(raw: Raw) -> bytes:
    """A raw ``token_ids`` array as little-endian uint32 bytes (the compiled core reads
    it with no Python int per token). Raises like :func:`decode_tokens`, and
    ``OverflowError`` for a token outside ``[0, 2**32-1]``."""
    if _c_tokens is not None:
        b = _c_tokens(raw)
        if b is not None:
            return b
    return tokens_to_bytes(decode_tokens(raw))
