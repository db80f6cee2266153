"""Producer-side mirror of vLLM's KV-event structs, for tests, benchmarks and simulators.

These classes copy ``vllm/distributed/kv_events.py`` field for field, with the
same msgspec options, so :func:`encode_batch` yields the bytes vLLM publishes
(checked byte for byte against the golden payloads in ``tests/data/vllm-golden``):

* ``version="0.23"``: events as positional arrays (``array_like``);
* ``version="0.24"`` and ``"0.33"``: events as maps tagged by ``"type"``
  (``omit_defaults`` drops optional fields that are None); 0.33 has the newer
  optional fields (``locality``, ``ownership``, ``session_id``, ...).

Users can feed their own routers with them; nothing here is used by the index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

import msgspec

from indexer.wire.events import (
    ALL_BLOCKS_CLEARED,
    BATCH,
    BLOCK_REMOVED,
    BLOCK_STORED,
    EVENTS,
    MAP_LAYOUT_SINCE,
    REQUIRED,
    Event,
    Field,
    release,
    sent_by,
)

__all__ = ["Stored", "Removed", "Cleared", "encode_batch", "VERSIONS"]

# Every struct here is built from the one declaration of vLLM's events in
# :mod:`indexer.wire.events` (fields, types, wire order, which release sends what).

VERSIONS = ("0.23", "0.24", "0.33")


def _mirror(name: str, ev: Event, doc: str) -> type[msgspec.Struct]:
    """The producer-facing event: every field of the newest release, in wire order,
    each with a default but ``block_hashes`` (``mirror``, else the decoder's absent value)."""
    spec: list[tuple[Any, ...]] = []
    for f in ev.fields:
        default = f.absent if f.mirror is ... else f.mirror
        spec.append((f.name, f.type) if default is REQUIRED else (f.name, f.type, default))
    return msgspec.defstruct(name, spec, module=__name__, namespace={"__doc__": doc}, frozen=True)


Stored = _mirror("Stored", BLOCK_STORED, "A ``BlockStored`` as a producer describes it (every vLLM 0.33 field).")
Removed = _mirror("Removed", BLOCK_REMOVED, "A ``BlockRemoved`` as a producer describes it.")
Cleared = _mirror("Cleared", ALL_BLOCKS_CLEARED, "An ``AllBlocksCleared``.")


# --- vLLM's own struct shapes -------------------------------------------------
# ``EventBatch`` and ``KVCacheEvent``'s options: ``omit_defaults``, ``gc=False``, ``tag=True``
# (the class name, under "type"), plus ``array_like`` up to 0.23.


def _vllm_spec(fields: Iterable[Field]) -> list[tuple[Any, ...]]:
    return [(f.name, f.type) if f.default is REQUIRED else (f.name, f.type, f.default) for f in fields]


_EventBatch = msgspec.defstruct("_EventBatch", _vllm_spec(BATCH), module=__name__, array_like=True,
                                omit_defaults=True, gc=False)


def _vllm_struct(ev: Event, version: str) -> type[msgspec.Struct]:
    """vLLM ``version``'s struct for event ``ev`` (the fields that release sends)."""
    rel = release(version)
    name = ev.tag if version == VERSIONS[-1] else f"_{ev.tag}_{version.replace('.', '_')}"
    return msgspec.defstruct(name, _vllm_spec(sent_by(ev, rel)), module=__name__, tag=ev.tag,
                             array_like=rel < MAP_LAYOUT_SINCE, omit_defaults=True, gc=False)


def _extra_keys(v: list[Any] | None) -> list[tuple[Any, ...] | None] | None:
    return None if v is None else [None if e is None else tuple(e) for e in v]


# The values vLLM holds as its own types (``extra_keys`` entries are tuples there).
_AS_VLLM: dict[str, Callable[[Any], Any]] = {"block_hashes": list, "token_ids": list, "extra_keys": _extra_keys}


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``obj -> tuple`` of the attributes ``names`` (one C call from two names up)."""
    if len(names) > 1:
        return attrgetter(*names)
    return lambda obj: tuple(getattr(obj, n) for n in names)


# vLLM's struct, getter of the fields it sends, conversions ((field index, function), ...).
_WireEntry = tuple[type[msgspec.Struct], Callable[[Any], tuple[Any, ...]], tuple[tuple[int, Callable[[Any], Any]], ...]]


def _wire_table(version: str) -> dict[type[msgspec.Struct], _WireEntry]:
    """Producer class -> (vLLM ``version``'s struct, getter of the fields it sends, conversions)."""
    out: dict[type[msgspec.Struct], _WireEntry] = {}
    for ev, cls in zip(EVENTS, (Stored, Removed, Cleared)):
        vcls = _vllm_struct(ev, version)
        names = vcls.__struct_fields__
        fix = tuple((i, _AS_VLLM[n]) for i, n in enumerate(names) if n in _AS_VLLM)
        out[cls] = (vcls, _getter(names), fix)
    return out


_WIRE = {v: _wire_table(v) for v in VERSIONS}
# vLLM's newest structs under vLLM's names.
BlockStored, BlockRemoved, AllBlocksCleared = (_WIRE[VERSIONS[-1]][c][0] for c in (Stored, Removed, Cleared))

_encoder = msgspec.msgpack.Encoder()


def _to_wire(ev: msgspec.Struct, version: str) -> msgspec.Struct:
    wire = _WIRE[version]
    entry = wire.get(type(ev))
    if entry is None:
        entry = next((e for c, e in wire.items() if isinstance(ev, c)), None)
        if entry is None:
            raise TypeError(f"not an event: {ev!r}")
    cls, get, fix = entry
    if not fix:
        return cls(*get(ev))
    vals = list(get(ev))
    for i, fn in fix:
        vals[i] = fn(vals[i])
    return cls(*vals)


def encode_batch(
    events: Iterable[msgspec.Struct], *, ts: float = 1767225600.0, dp_rank: int | None = 0, version: str = "0.33"
) -> bytes:
    """The msgpack payload vLLM ``version`` would publish for ``events`` (frame 3).

    ``"0.23"`` is the positional (array) layout, ``"0.24"`` the first map layout,
    ``"0.33"`` the map layout with every newer optional field. Fields a version
    does not have are not sent.
    """
    if version not in VERSIONS:
        raise ValueError(f"unknown vLLM version {version!r}; one of {VERSIONS}")
    return _encoder.encode(_EventBatch(ts, [_to_wire(e, version) for e in events], dp_rank))
