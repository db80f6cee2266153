"""Route sync's messages between router replicas (msgpack; :mod:`indexer.ingest.routesync`
sends them over NATS).

One NATS message is an :class:`Envelope`: the format version, the sender's origin (its
request ids' prefix), its wall clock at sending, and a list of items:

* :class:`Entry`: a request the sender routed and has open (a decision, or a line of
  its state when a peer asks for it); ``age`` is seconds since it was routed.
* :class:`End`: a request ended (``whole``), or only its prefill (announced).
* :class:`Forget`: the sender saw a worker removed, restarted or cleared.
* :class:`Heartbeat`: the sender is alive; ``count`` and ``digest`` (xor of
  xxh64 of the ids) sum up the own requests it has told of and not ended, so a peer
  that lost a message notices and asks for the list.
* :class:`Bye`: the sender is leaving; drop its requests now.
* :class:`StateEnd`: the last message of a state answer: how many messages it had.

Everything is bounded (:data:`MAX_MESSAGE_BYTES`, field lengths) and validated by the
decoder; :func:`decode` raises :class:`BadMessage` with a reason to count.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

__all__ = ["VERSION", "MAX_MESSAGE_BYTES", "BadMessage", "Bye", "End", "Entry", "Envelope", "Forget", "Heartbeat",
           "Item", "StateEnd", "decode", "encode"]

VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # NATS's default max_payload; a sender splits below it
MAX_KEYS = 1 << 16  # blocks of one prompt (a 1M-token prompt at block size 16)

_Id = Annotated[str, Meta(min_length=1, max_length=80)]
_Name = Annotated[str, Meta(max_length=256)]
_Count = Annotated[int, Meta(ge=0, le=(1 << 62))]
_U64 = Annotated[int, Meta(ge=0)]  # msgpack uint64 (msgspec bounds stop at int64)
_Age = Annotated[float, Meta(ge=0.0, le=1e7)]


class Entry(Struct, tag="e", array_like=True, frozen=True, gc=False):
    rid: _Id
    model: _Name
    engine: _Name
    dp_rank: Annotated[int, Meta(ge=0, le=1 << 20)]
    keys: Annotated[bytes, Meta(max_length=8 * MAX_KEYS)]  # uint64 little-endian block keys
    prefill_tokens: _Count
    decode_blocks: _Count
    prefill_open: bool
    decode_open: bool
    age: _Age


class End(Struct, tag="x", array_like=True, frozen=True, gc=False):
    rid: _Id
    origin: Annotated[str, Meta(max_length=80)]  # the request's ("": the sender's own)
    whole: bool
    why: Annotated[str, Meta(max_length=32)]


class Forget(Struct, tag="f", array_like=True, frozen=True, gc=False):
    engine: _Name
    dp_rank: Annotated[int, Meta(ge=0, le=1 << 20)]


class Heartbeat(Struct, tag="h", array_like=True, frozen=True, gc=False):
    count: _Count
    digest: _U64
    name: _Name  # for people: the sender's host and port


class Bye(Struct, tag="b", array_like=True, frozen=True, gc=False):
    pass


class StateEnd(Struct, tag="s", array_like=True, frozen=True, gc=False):
    messages: Annotated[int, Meta(ge=1, le=1 << 20)]  # of the answer, this one included
    count: _Count
    digest: _U64


Item = Entry | End | Forget | Heartbeat | Bye | StateEnd


class Envelope(Struct, array_like=True, frozen=True):
    v: int
    origin: _Id
    sent: float  # the sender's wall clock (time.time()), for the lag
    items: Annotated[list[Item], Meta(max_length=1 << 17)]


class _Head(Struct, array_like=True, frozen=True):
    """An envelope's version alone: read first, so that another version's items are
    refused as such, not as malformed."""

    v: int


class BadMessage(ValueError):
    """A message refused; ``reason`` is what is counted: ``too_large``, ``malformed``,
    ``version``, ``invalid``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_ENC = msgspec.msgpack.Encoder()
_HEAD = msgspec.msgpack.Decoder(_Head)
_DEC = msgspec.msgpack.Decoder(Envelope)


def encode(env: Envelope) -> bytes:
    return _ENC.encode(env)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Envelope:
    """The envelope in ``data``, validated; raises :class:`BadMessage`."""
    if len(data) > max_bytes:
        raise BadMessage("too_large", f"{len(data)} bytes > {max_bytes}")
    try:
        v = _HEAD.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage("malformed", str(e)) from None
    if v != VERSION:
        raise BadMessage("version", f"version {v}, this replica speaks {VERSION}")
    try:
        env = _DEC.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage("malformed", str(e)) from None
    if not math.isfinite(env.sent):
        raise BadMessage("invalid", "sent is not a finite time")
    for it in env.items:
        if it.__class__ is Entry and (len(it.keys) & 7 or not math.isfinite(it.age)):
            raise BadMessage("invalid", f"entry {it.rid!r}: keys not whole uint64s, or age not finite")
    return env
