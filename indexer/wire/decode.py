"""Decoding of vLLM KV-event batch payloads (frame 3 of a live ZMQ message).

Wire facts (vLLM's ``vllm/distributed/kv_events.py``, the publisher's side):

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

from collections.abc import Callable, Iterable
from typing import Any, Protocol, Union

import msgspec
from msgspec import Raw, Struct

from indexer._native import core as _core
from indexer.wire.events import BATCH, CLEARED, EVENTS, MAP_LAYOUT_SINCE, REMOVED, REQUIRED, STORED, Event, Field, Hash
from indexer.wire.keys import tokens_to_bytes

__all__ = [
    "STORED",
    "REMOVED",
    "CLEARED",
    "DecodeError",
    "DecodedBatch",
    "decode_batch",
    "raw_array_len",
    "decode_tokens",
    "token_bytes",
    "encode_stored",
    "decode_stored",
    "decode_event",
    "scan_gpu_batch",
]

# Every struct below is built from the one declaration of vLLM's events in
# :mod:`indexer.wire.events` (fields, types, wire order, which release sends what).


def _spec(fields: Iterable[Field]) -> list[tuple[Any, ...]]:
    """``defstruct`` fields as the decoder reads them: every field vLLM may leave out
    has a default (its value when absent), ``decoded`` types override vLLM's."""
    spec: list[tuple[Any, ...]] = []
    for f in fields:
        typ = f.type if f.decoded is None else f.decoded
        if f.absent is REQUIRED:
            spec.append((f.name, typ))
        elif typ is Raw:
            spec.append((f.name, typ, Raw(msgspec.msgpack.encode(f.absent))))
        else:
            spec.append((f.name, typ, f.absent))
    return spec


def _event_struct(ev: Event, array: bool, strict: bool) -> type[Struct]:
    """The decoder struct of one event type in one layout.

    Map layout (vLLM >= 0.24): every field of any map release. Positional layout
    (vLLM <= 0.23): the tag is element 0, then the fields in wire order; older
    producers send fewer trailing fields (defaults apply). The map-only fields are
    class attributes of their absent value (None), so both layouts expose the same
    attributes to the applier. ``strict`` (``forbid_unknown_fields``) makes the
    fast path fail on a field, or extra trailing element, we do not know, so the
    slow path can count it and decode the same bytes with the lenient twin.
    """
    fields = [f for f in ev.fields if not array or f.since < MAP_LAYOUT_SINCE]
    ns = {"kind": ev.kind}
    ns.update((f.name, f.absent) for f in ev.fields if f not in fields)
    name = f"_{'' if strict else 'Lenient'}{'Arr' if array else 'Map'}{ev.tag}"
    return msgspec.defstruct(name, _spec(fields), module=__name__, namespace=ns, tag=ev.tag,
                             array_like=array, forbid_unknown_fields=strict, gc=False)


def _batch_struct(name: str, events_type: Any) -> type[Struct]:
    spec = _spec(BATCH)
    spec[[f.name for f in BATCH].index("events")] = ("events", events_type)
    return msgspec.defstruct(name, spec, module=__name__, array_like=True, gc=False)


_MAP = {ev.tag: _event_struct(ev, False, True) for ev in EVENTS}
_ARR = {ev.tag: _event_struct(ev, True, True) for ev in EVENTS}
_LENIENT_MAP = {ev.tag: _event_struct(ev, False, False) for ev in EVENTS}
_LENIENT_ARR = {ev.tag: _event_struct(ev, True, False) for ev in EVENTS}

_ARR_FIELDS = {tag: len(cls.__struct_fields__) for tag, cls in _ARR.items()}
_MAP_FIELDS = {tag: frozenset(cls.__struct_fields__) for tag, cls in _MAP.items()}

# Unions of the classes built above, made at import: values to msgspec, no static types.
MapEvent: Any = Union[tuple(_MAP.values())]  # noqa: UP007 - a union built from a tuple
ArrEvent: Any = Union[tuple(_ARR.values())]  # noqa: UP007 - a union built from a tuple

_MapBatch = _batch_struct("_MapBatch", list[MapEvent])
_ArrBatch = _batch_struct("_ArrBatch", list[ArrEvent])
_RawBatch = _batch_struct("_RawBatch", list[Raw])


# The batch structs are built at import (see _batch_struct): their fields are Any to mypy.
_map_batch: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_MapBatch)
_arr_batch: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_ArrBatch)
_raw_batch: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_RawBatch)
_map_event: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_LENIENT_MAP.values())]  # noqa: UP007 - a union built from a tuple
)
_arr_event: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_LENIENT_ARR.values())]  # noqa: UP007 - a union built from a tuple
)
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
    events: list[Any]
    dp_rank: int | None
    layout: str
    issues: dict[str, int]


# What the applier reads of the decoded events (the structs above, built at import:
# mypy sees their instances as Any). Fields a layout does not send are class
# attributes holding their absent value, so every attribute exists in both layouts.
class StoredEvent(Protocol):
    """A decoded ``BlockStored`` (vllm_events.BLOCK_STORED; ``token_ids`` kept raw)."""

    kind: int
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    locality: str | None
    ownership: str | None


class RemovedEvent(Protocol):
    """A decoded ``BlockRemoved`` (vllm_events.BLOCK_REMOVED)."""

    kind: int
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None
    locality: str | None
    ownership: str | None


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload in either wire layout.

    Raises
    ------
    DecodeError
        When the bytes are not a 3-element batch array at all, nest deeper than
        Python's recursion limit, or carry a ts that is not a finite number (it orders
        restarts and proves continuity: R-STR-5, R-STR-7).
    """
    try:
        try:
            b = _map_batch.decode(payload)
            out = DecodedBatch(b.ts, b.events, b.data_parallel_rank, "map", {})
        except msgspec.DecodeError:
            try:
                b = _arr_batch.decode(payload)
                out = DecodedBatch(b.ts, b.events, b.data_parallel_rank, "array", {})
            except msgspec.DecodeError:
                out = _decode_slow(payload)
    except RecursionError:  # msgspec's answer to a payload nested thousands deep
        raise DecodeError("bad_payload", "nested too deeply") from None
    ts = out.ts
    if ts - ts != 0.0:  # NaN or +-inf (x - x is NaN for both)
        raise DecodeError("bad_payload", f"batch ts {ts!r} is not a finite number")
    return out


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


def _bump(d: dict[str, int], k: str) -> None:
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
    if memoryview(raw)[:1] == b"\xc0":  # type: ignore[comparison-overlap]  # compares contents
        return []
    return _tokens.decode(raw)


_c_tokens: Callable[[Raw], bytes | None] | None = _core.tokens_from_msgpack if _core is not None else None

# (payload) -> (ts, dp_rank, [(hashes u64 LE bytes, parent hash | None, tokens u32 LE bytes, block_size,
# group_idx | None, kv_cache_spec_kind | None, start, end), ...]) | None: indexer/_core.pyi
scan_gpu_batch: Callable[[bytes], tuple[float, int | None, list[tuple[Any, ...]]] | None] | None = (
    getattr(_core, "scan_gpu_batch", None) if _core is not None else None
)


def decode_event(raw: bytes) -> StoredEvent:
    """One map-layout event's bytes (a ``scan_gpu_batch`` store's ``payload[start:end]``)
    decoded as :func:`decode_batch` decodes it (raises ``msgspec.DecodeError``)."""
    ev: StoredEvent = _map_event.decode(raw)
    return ev


def token_bytes(raw: Raw) -> bytes:
    """A raw ``token_ids`` array as little-endian uint32 bytes (the compiled core reads
    it with no Python int per token). Raises like :func:`decode_tokens`, and
    ``OverflowError`` for a token outside ``[0, 2**32-1]``."""
    if _c_tokens is not None:
        b = _c_tokens(raw)
        if b is not None:
            return b
    return tokens_to_bytes(decode_tokens(raw))


_STORED_TAG = next(ev.tag for ev in EVENTS if ev.kind == STORED)
_STORED_FIELDS = tuple(_LENIENT_MAP[_STORED_TAG].__struct_fields__)
_stored_map: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_LENIENT_MAP[_STORED_TAG])


def encode_stored(ev: StoredEvent) -> bytes:
    """One decoded store, of either layout, as a map-layout ``BlockStored`` (what a
    snapshot keeps of an orphan); :func:`decode_stored` reads it back."""
    d: dict[str, Any] = {"type": _STORED_TAG}
    for f in _STORED_FIELDS:
        d[f] = getattr(ev, f)
    return msgspec.msgpack.encode(d)


def decode_stored(data: bytes) -> StoredEvent:
    """The store :func:`encode_stored` wrote (raises ``msgspec.DecodeError``)."""
    ev: StoredEvent = _stored_map.decode(data)
    return ev
