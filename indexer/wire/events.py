"""vLLM's KV events, declared once: each event's fields in wire order, per release.

The decoder (:mod:`indexer.wire.decode`) and the producer mirror
(:mod:`indexer.producer.events`) build all their msgspec structs from the tables
below, so a field is added, retyped or reordered here and nowhere else. This
module holds declarations only (no producer code, no decoding).

Wire facts (``vllm/distributed/kv_events.py``; reference §1.2-1.5):

* msgspec encodes fields in declaration order: in the positional layout
  (vLLM <= 0.23) the order *is* the format; in the map layout (>= 0.24) it is the
  key order after ``"type"``.
* vLLM's fields without a default are always sent (even when None); fields with a
  default are omitted when they equal it (``omit_defaults``).
* The positional layout ends at ``kv_cache_spec_sliding_window``; the later fields
  (``locality`` 0.26, ``ownership`` 0.29, ``session_id`` 0.30,
  ``lookahead_token_ids`` 0.33) exist only in the map layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

__all__ = [
    "STORED", "REMOVED", "CLEARED", "REQUIRED", "Hash", "Field", "Event",
    "BLOCK_STORED", "BLOCK_REMOVED", "ALL_BLOCKS_CLEARED", "EVENTS", "BATCH",
    "MAP_LAYOUT_SINCE", "release", "sent_by",
]

STORED = 0
REMOVED = 1
CLEARED = 2

REQUIRED = msgspec.NODEFAULT  # "no default": vLLM always sends it / a decoder needs it

Hash = int | bytes  # uint64 (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or a raw digest

# The first release that sends events as maps tagged by "type" (positional arrays before).
MAP_LAYOUT_SINCE = (0, 24)


class Field(NamedTuple):
    """One field of a vLLM event, in wire order.

    ``type`` and ``default`` are vLLM's own declaration (``REQUIRED``: no default,
    always sent). ``since`` is the first release that sends it; ``(0, 23)`` means it
    is part of the positional layout (older releases sent a prefix of that array).
    ``absent`` is what a decoded event holds when the producer did not send the
    field, and the producer mirror's default (``REQUIRED``: a decoder needs it too).
    ``decoded`` is the decoder's type when it differs from vLLM's; ``mirror`` the
    producer mirror's default when it differs from ``absent`` (``...``: it does not).
    """

    name: str
    type: Any
    default: Any = REQUIRED
    since: tuple[int, ...] = (0, 23)
    absent: Any = None
    decoded: Any = None
    mirror: Any = ...


class Event(NamedTuple):
    """One event type: its wire tag (vLLM's class name), its ``kind`` and its fields."""

    tag: str
    kind: int
    fields: tuple[Field, ...]


BLOCK_STORED = Event("BlockStored", STORED, (
    Field("block_hashes", list[Hash], absent=REQUIRED),
    Field("parent_block_hash", Hash | None),
    # Kept as raw msgpack by the decoder, decoded only when block keys are needed.
    Field("token_ids", list[int], absent=[], decoded=msgspec.Raw),
    Field("block_size", int, absent=0),
    Field("lora_id", int | None),
    Field("medium", str | None, mirror="GPU"),
    Field("lora_name", str | None),
    Field("extra_keys", list[tuple[Any, ...] | None] | None, None, decoded=list[Any] | None),
    Field("group_idx", int | None, None, mirror=0),
    Field("kv_cache_spec_kind", str | None, None),
    Field("kv_cache_spec_sliding_window", int | None, None),
    Field("locality", str | None, None, since=(0, 26)),
    Field("ownership", str | None, None, since=(0, 29)),
    Field("session_id", str | None, None, since=(0, 30)),
    Field("lookahead_token_ids", list[list[int]] | None, None, since=(0, 33)),
))

BLOCK_REMOVED = Event("BlockRemoved", REMOVED, (
    Field("block_hashes", list[Hash], absent=REQUIRED),
    Field("medium", str | None, mirror="GPU"),
    Field("group_idx", int | None, None, mirror=0),
    Field("locality", str | None, None, since=(0, 26)),
    Field("ownership", str | None, None, since=(0, 29)),
))

ALL_BLOCKS_CLEARED = Event("AllBlocksCleared", CLEARED, ())

EVENTS = (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)  # indexed by kind

# The batch envelope, always a 3-element array (``array_like``) in every release.
# ``events`` is typed by each user (the decoder narrows it to its event union).
BATCH = (
    Field("ts", float, absent=REQUIRED),
    Field("events", list[Any], absent=REQUIRED),
    Field("data_parallel_rank", int | None, None),
)


def release(version: str) -> tuple[int, ...]:
    """``"0.24"`` -> ``(0, 24)``."""
    return tuple(int(p) for p in version.split("."))


def sent_by(event: Event, version: tuple[int, ...] | None = None) -> tuple[Field, ...]:
    """The fields of ``event`` that release ``version`` sends (None: every release)."""
    if version is None:
        return event.fields
    return tuple(f for f in event.fields if f.since <= version)
