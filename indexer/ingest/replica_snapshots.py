"""A replica's snapshots in the stream's object store (R-DUR-12): the stored one loaded
at start and when the stream was purged past the replica, and one stored every
``snapshot_interval_s`` (and at the stop) with the stream purged behind it. The
consumer is :class:`~.jetstream.JetStreamIngest`; ``docs/jetstream.md`` has the story.

The object (``SNAPSHOT_OBJECT``) is a snapshot file (:mod:`indexer.store.snapshot`)
whose ``meta`` names the stream sequence it covers (``nats_seq``); its description
says the same (``nats_seq=N``), so a replica reads which one is stored without
fetching it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from indexer.ingest.eventlog import SNAPSHOT_OBJECT
from indexer.store.snapshot import SnapshotError, dumps, loads

if TYPE_CHECKING:
    from indexer.query.index import PrefixIndex

__all__ = ["BucketSnapshots"]

log = logging.getLogger("indexer.ingest.jetstream")


class BucketSnapshots:
    """A mixin over the replica's index, stream position and counters: its snapshots."""

    # The replica's (JetStreamIngest.__init__ sets them all).
    index: PrefixIndex
    name: str
    stream: str
    bucket: str
    seq: int  # the last stream sequence applied (or covered by the snapshot loaded)
    snapshot_seq: int | None  # the stream sequence of the last snapshot loaded or written
    snapshot_interval_s: float
    keep_behind: int
    counters: dict[str, int]
    refused: dict[str, int]
    link: dict[tuple[str, int], tuple[bool, bool]]
    _obs: ObjectStore | None
    _js: JetStreamContext | None
    _snap_t: float
    _snap_task: asyncio.Task[None] | None
    _bad_digest: str | None

    async def _load_snapshot(self, only_newer: bool = False) -> bool:
        """Restore the bucket's snapshot into the index (emptied first when it is newer
        than what the index holds). False when there is none, it is refused (corrupt:
        logged and counted) or not newer."""
        assert self._obs is not None
        res = None
        for _ in range(3):
            try:
                info = await self._obs.get_info(SNAPSHOT_OBJECT)
                if info.digest is not None and info.digest == self._bad_digest:
                    return False  # the one refused already: counted once
                # A get waits for every chunk: one replaced meanwhile (its chunks purged by
                # the new put) never completes. Bounded, then read again.
                res = await asyncio.wait_for(self._obs.get(SNAPSHOT_OBJECT), 10.0 + (info.size or 0) / 20e6)
                break
            except nats.js.errors.ObjectNotFoundError:
                return False
            except asyncio.TimeoutError:
                log.warning("%s: reading snapshot %s/%s timed out; again", self.name, self.bucket, SNAPSHOT_OBJECT)
            except nats.js.errors.Error as e:  # a chunk missing, a digest mismatch: as corrupt
                return self._refuse("object", repr(e))
        if res is None:
            self.counters["snapshot_errors"] += 1
            return False
        self._bad_digest = res.info.digest
        data = res.data or b""
        try:
            snap = loads(data)
            n = snap.meta.get("nats_seq")
            if not isinstance(n, int) or n < 0:
                raise SnapshotError("meta", f"no nats_seq in its meta ({snap.meta!r})")
        except SnapshotError as e:
            return self._refuse(e.reason, str(e))
        if only_newer and n <= self.seq:
            return False
        ix = self.index
        try:
            snap.restore(ix, replace=True)  # a reload replaces what the index holds
        except SnapshotError as e:
            return self._refuse(e.reason, str(e))
        self._bad_digest = None
        self.seq = self.snapshot_seq = n
        self.link = {(w["engine"], w["dp_rank"]): (True, True) for w in ix.workers()}
        self.counters["snapshots_loaded"] += 1
        log.info("%s: snapshot loaded (stream seq %d, %d bytes)", self.name, n, len(data))
        return True

    def _refuse(self, reason: str, detail: str) -> bool:
        self.counters["snapshots_refused"] += 1
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.error("%s: snapshot %s/%s refused: %s; following the stream from its start",
                  self.name, self.bucket, SNAPSHOT_OBJECT, detail)
        return False

    def _maybe_snapshot(self) -> None:
        """Between two applied messages: the snapshot covers exactly stream seq ``seq``."""
        if self.snapshot_interval_s <= 0 or time.monotonic() - self._snap_t < self.snapshot_interval_s:
            return
        if self._snap_task is not None and not self._snap_task.done():
            return
        self._snap_t = time.monotonic()
        data = self._dump()
        if data is not None:
            self._snap_task = asyncio.get_running_loop().create_task(self._store(data, self.seq))

    def _dump(self) -> bytes | None:
        try:
            return dumps(self.index, meta={"nats_seq": self.seq, "stream": self.stream})
        except Exception as e:  # a snapshot that fails costs the snapshot, never the replica
            self.counters["snapshot_errors"] += 1
            log.exception("%s: snapshot failed: %r", self.name, e)
            return None

    async def _stored_seq(self) -> int | None:
        assert self._obs is not None
        try:
            info = await self._obs.get_info(SNAPSHOT_OBJECT)
        except nats.js.errors.ObjectNotFoundError:
            return None
        m = re.search(r"nats_seq=(\d+)", info.description or "")
        return int(m.group(1)) if m else None

    async def _store(self, data: bytes, n: int) -> None:
        """Put the snapshot of stream seq ``n`` (unless the stored one is as new), then
        purge the stream below ``n + 1 - keep_behind`` (R-DUR-12)."""
        assert self._obs is not None
        try:
            stored = await self._stored_seq()
            if stored is not None and stored >= n:
                return
            meta = api.ObjectMeta(name=SNAPSHOT_OBJECT, description=f"kv-prefix-indexer snapshot nats_seq={n}")
            await self._obs.put(SNAPSHOT_OBJECT, data, meta=meta)
            self.counters["snapshots_written"] += 1
            self.snapshot_seq = n
            # Another replica may have put an older one over it meanwhile: purge only
            # behind the snapshot that is there now.
            if await self._stored_seq() == n and n + 1 - self.keep_behind > 1:
                assert self._js is not None
                await self._js.purge_stream(self.stream, seq=n + 1 - self.keep_behind)
                self.counters["purges"] += 1
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            self.counters["snapshot_errors"] += 1
            log.warning("%s: snapshot of stream seq %d not stored: %r", self.name, n, e)

    async def _final_snapshot(self) -> None:
        if self._snap_task is not None:
            await _quietly(self._snap_task, 5.0)
        if self.snapshot_interval_s > 0 and self._obs is not None and self.seq > (self.snapshot_seq or 0):
            data = self._dump()
            if data is not None:
                await _quietly(self._store(data, self.seq), 5.0)


async def _quietly(aw: Awaitable[None], timeout: float) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
