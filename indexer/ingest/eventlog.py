"""The JetStream event log's wire facts, shared by the relay (:mod:`.relay`) and the
replicas (:mod:`.jetstream`): the stream and bucket names, one message per batch (its
headers and ``Nats-Msg-Id``), and the connection, stream and object-store set-up.
Imports ``nats``: only the relay and ``serve --nats`` load it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
import xxhash
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

__all__ = [
    "DEFAULT_BUCKET", "DEFAULT_STREAM", "DEFAULT_SUBJECT", "DUPLICATE_WINDOW_S", "H_ENGINE", "H_MODEL", "H_RANK",
    "H_RESTART", "H_SEQ", "H_STALE", "KEEP_BEHIND", "MSG_ID", "REPLICA_REFUSES", "SNAPSHOT_OBJECT", "ack_fields",
    "connect", "ensure_stream", "headers", "msg_id", "object_store",
]

log = logging.getLogger("indexer.ingest.jetstream")

DEFAULT_STREAM = "KVI_EVENTS"
DEFAULT_SUBJECT = "kvi.events"
DEFAULT_BUCKET = "kvi-snapshots"
DUPLICATE_WINDOW_S = 120.0  # JetStream's default; see docs/jetstream.md (a late relay's replay)
SNAPSHOT_OBJECT = "index.snapshot"
# Messages kept below the stored snapshot when the stream is purged: room for replicas
# that lag behind the one that wrote it (each needs the messages after what it applied).
KEEP_BEHIND = 10_000

# Message headers (values are text; ids and ranks are checked ASCII, R-SEC-3).
H_ENGINE = "Kvi-Engine"
H_RANK = "Kvi-Rank"
H_MODEL = "Kvi-Model"
H_SEQ = "Kvi-Seq"
# The relay's sequencer dropped the worker's residency before this batch: the value is the
# ts (repr) of the last batch it had applied then, i.e. which incarnation was replaced.
H_RESTART = "Kvi-Restart"
H_STALE = "Kvi-Stale"  # the relay holds the worker stale: its reason
MSG_ID = "Nats-Msg-Id"

REPLICA_REFUSES = "this replica follows the JetStream event log; register engines with the relay"

_CTL = re.compile(r"[\x00-\x1f\x7f]")


def msg_id(engine: str, rank: int, seq: int, payload: bytes) -> str:
    """``engine/rank/seq/xxh64(payload)``: one id per batch, whichever relay sends it."""
    return f"{engine}/{rank}/{seq}/{xxhash.xxh64_hexdigest(payload)}"


def _text(v: str) -> str:
    return _CTL.sub(" ", v)  # a header value is one line


def headers(engine: str, rank: int, model: str, seq: int, payload: bytes, *, restart_after: float | None = None,
            stale: str | None = None) -> dict[str, str]:
    """The headers of one batch's message (the payload is the batch as vLLM sent it)."""
    h = {MSG_ID: msg_id(engine, rank, seq, payload), H_ENGINE: engine, H_RANK: str(rank), H_MODEL: _text(model),
         H_SEQ: str(seq)}
    if restart_after is not None:
        h[H_RESTART] = repr(restart_after)
    if stale is not None:
        h[H_STALE] = _text(stale)[:512]
    return h


# How often a connection attempt looks at its owner's stopping().
_STOP_POLL_S = 0.05


async def connect(url: str, name: str, stopping: Callable[[], bool], *,
                  on_state: Callable[[bool], None] | None = None, **options: Any) -> Client | None:
    """A NATS connection that reconnects for ever; retried until it first connects
    (None when ``stopping()`` turns true first). ``on_state(connected)`` follows it.
    ``options`` go to ``nats.connect`` (credentials, ``no_echo``...)."""

    async def disconnected() -> None:
        if on_state is not None:
            on_state(False)
        if not stopping():
            log.warning("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        if on_state is not None:
            on_state(True)
        log.info("%s: reconnected to NATS", name)

    async def error(e: Exception) -> None:
        log.debug("%s: NATS: %r", name, e)

    delay = 0.1
    while not stopping():
        # nats.connect itself retries for ever when the server refuses the connection (a
        # wrong token: max_reconnect_attempts -1 holds for the first connect too), so it
        # is watched, and cancelled once stopping() turns true: a replica with wrong
        # credentials otherwise never stopped (its thread outlived stop()'s join).
        attempt = asyncio.ensure_future(nats.connect(
            url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=2,
            allow_reconnect=True, disconnected_cb=disconnected, reconnected_cb=reconnected, error_cb=error,
            **options))
        while not attempt.done() and not stopping():
            await asyncio.wait({attempt}, timeout=_STOP_POLL_S)
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
            return None
        try:
            nc = attempt.result()
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("%s: cannot connect to NATS (%r); retrying", name, e)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
            continue
        if on_state is not None:
            on_state(True)
        return nc
    return None


async def ensure_stream(js: JetStreamContext, stream: str, subject: str,
                        duplicate_window_s: float = DUPLICATE_WINDOW_S) -> api.StreamInfo:
    """The event log's stream, created when missing: file storage, ``subject`` only,
    a duplicate window (relays' copies of one batch are one message)."""
    try:
        return await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        pass
    try:
        return await js.add_stream(api.StreamConfig(
            name=stream, subjects=[subject], storage=api.StorageType.FILE, retention=api.RetentionPolicy.LIMITS,
            duplicate_window=duplicate_window_s, description="kv-prefix-indexer: vLLM KV event batches"))
    except nats.js.errors.BadRequestError:  # created meanwhile by another relay or replica
        return await js.stream_info(stream)


async def object_store(js: JetStreamContext, bucket: str) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(bucket, storage=api.StorageType.FILE,
                                            description="kv-prefix-indexer snapshots")
    except nats.js.errors.BadRequestError:
        return await js.object_store(bucket)


def ack_fields(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) from a JetStream delivery's reply subject:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`` (9
    tokens) or the 12-token form with domain and account hash."""
    t = reply.split(".")
    if len(t) == 9:
        return int(t[5]), int(t[8])
    if len(t) >= 11:
        return int(t[7]), int(t[10])
    raise ValueError(f"not a JetStream delivery: {reply!r}")
