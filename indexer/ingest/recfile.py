"""A recording's files: segments of framed, checksummed msgpack records (format in
``docs/record.md``).

A recording is a directory of segments ``seg-<n>-<unix ms>.kvr``, ``n`` growing from 0
(the newest segment has the highest ``n``). Each segment is::

    magic  b"KVIREC2\\n"                                 8 bytes
    frames, each:  length (uint32 LE) | checksum of the body (uint32 LE) | body

and a body is one msgpack record. The checksum is the low 32 bits of the body's xxh3-64
(seed 0); segments of the first format (magic ``KVIREC1``) carry zlib's crc32 there and
are read as well. A segment's first record is its *base* (the index's
whole state at the cut), so any segment, and every segment after it, replays on its own:
the oldest segments can be deleted (rotation) without the rest losing anything.

:func:`read_segment` yields records with their offsets and stops at the first damaged
frame (short, too long, a checksum that does not match, a body that does not decode)
with a :class:`Damage` naming the file and the offset; nothing after it in that segment
is trusted.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
import xxhash

__all__ = ["MAGIC", "Damage", "checksum", "frame", "read_segment", "segment_name", "segments"]

MAGIC = b"KVIREC2\n"
_MAGIC_CRC32 = b"KVIREC1\n"  # the first format: frames checked by zlib's crc32
_HEAD = struct.Struct("<II")
MAX_RECORD = 1 << 30  # a length beyond this is damage, not a record
_NAME = re.compile(r"^seg-(\d{8,})-(\d+)\.kvr$")
_dec = msgspec.msgpack.Decoder()


class Damage(NamedTuple):
    """Where a segment stops being readable: its file, the offset of the bad frame, why."""

    path: str
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: damaged at byte offset {self.offset}: {self.reason}"


def checksum(body: bytes) -> int:
    """A frame's checksum: the low 32 bits of the body's xxh3-64 (seed 0)."""
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


def frame(body: bytes) -> bytes:
    """One record's frame: length, checksum, body."""
    return _HEAD.pack(len(body), checksum(body)) + body


def segment_name(n: int, wall_ms: int) -> str:
    return f"seg-{n:08d}-{wall_ms}.kvr"


def segments(directory: str) -> list[tuple[int, int, str]]:
    """``(n, unix ms at its start, path)`` of every segment in ``directory``, oldest first."""
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), os.path.join(directory, name)))
    out.sort()
    return out


def read_segment(path: str) -> Iterator[tuple[int, Any] | Damage]:
    """Each record of the segment at ``path`` as ``(offset, record)``, in order; a
    :class:`Damage` (then nothing more) where the segment is truncated or corrupt. A
    segment still being written ends cleanly at its last whole frame only if that frame
    is complete: a partial last frame is reported as damage (truncated)."""
    with open(path, "rb") as f:
        data = f.read()
    check: Callable[[bytes], int]
    if data[:len(MAGIC)] == MAGIC:
        check, what = checksum, "checksum"
    elif data[:len(_MAGIC_CRC32)] == _MAGIC_CRC32:
        check, what = zlib.crc32, "crc32"
    else:
        yield Damage(path, 0, "not a kv-indexer recording segment (bad magic)")
        return
    off = len(MAGIC)
    end = len(data)
    while off < end:
        if end - off < _HEAD.size:
            yield Damage(path, off, f"truncated: {end - off} bytes, shorter than a frame header")
            return
        n, crc = _HEAD.unpack_from(data, off)
        if n > MAX_RECORD:
            yield Damage(path, off, f"corrupt: a record length of {n} bytes")
            return
        body = data[off + _HEAD.size: off + _HEAD.size + n]
        if len(body) < n:
            yield Damage(path, off, f"truncated: the record says {n} bytes, {len(body)} are there")
            return
        if check(body) != crc:
            yield Damage(path, off, f"corrupt: the record's {what} does not match")
            return
        try:
            rec = _dec.decode(body)
        except msgspec.DecodeError as e:
            yield Damage(path, off, f"corrupt: {e}")
            return
        yield off, rec
        off += _HEAD.size + n
