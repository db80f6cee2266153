"""Route sync: several router replicas, one view of what is in flight (core NATS).

Each replica's index records its own routing decisions (:mod:`indexer.store.inflight`).
:class:`RouteSync` publishes them, and every end of one, to the other replicas, and
applies theirs, so each replica's ``route`` sees the whole fleet's predicted prefixes
and in-flight load. Subjects (``subject`` is ``kvi.route`` by default):

* ``<subject>.ev``: every replica's news, in :class:`~indexer.wire.routesync.Envelope`
  messages (decisions, ends, workers forgotten, heartbeats, goodbyes). NATS keeps one
  publisher's messages in order, so a heartbeat follows every message sent before it.
* ``<subject>.who``: a joining replica asks who is there; each replica answers.
* ``<subject>.state.<origin>``: the open requests of replica ``origin``, in as many
  messages as they need, the last one a ``StateEnd``.

What holds it together:

* **Ids and origins.** A request id is ``<origin>-<n>``; a replica never applies its
  own messages (the connection is ``no_echo``, and the origin is checked).
* **Same TTLs.** A peer's request is held as routed ``age`` s ago (its age on the
  sender, plus the message's lag), and expires by this replica's TTLs.
* **Heartbeats and a digest.** Every ``heartbeat_s`` each replica sends how many of its
  own requests it has told of and not ended, and the xor of their ids' xxh64. A peer
  whose sum of what it heard differs (a lost message: NATS restarted, a slow consumer)
  asks for the list and reconciles: requests the origin no longer has end, missing ones
  are adopted. So no load stays behind a lost "done", and none goes missing.
* **Peers that leave.** A goodbye drops a peer's requests at once; a peer silent for
  ``peer_timeout_s`` (3 heartbeats by default) is dropped then: its requests leave the
  others within ``peer_timeout_s + heartbeat_s`` (4 s with the defaults).
* **Joining.** A new replica asks who is there, fetches each one's requests, and only
  then is :attr:`ready`. Alone (no responders) it is ready at once; when NATS cannot be
  reached within ``join_timeout_s`` it is ready on its own view, and joins when it can.
* **NATS down.** Each replica routes on its own view (peers time out, their requests
  are dropped), counts it and keeps trying; on reconnecting it joins again, and the
  digests bring every peer current.

Bad input (too large, undecodable, another version, invalid fields) is counted by
reason and dropped. Only ``serve --route-sync`` imports this module (and ``nats``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from indexer.ingest.background import Background
from indexer.ingest.eventlog import connect
from indexer.ingest.syncpeers import LAG_BUCKETS, Peer, PeerViews, rid_hash
from indexer.wire.routesync import (
    MAX_MESSAGE_BYTES,
    VERSION,
    Bye,
    End,
    Entry,
    Envelope,
    Forget,
    Heartbeat,
    Item,
    StateEnd,
    encode,
)

if TYPE_CHECKING:
    from indexer.query.index import PrefixIndex

__all__ = ["RouteSync", "SYNC_COUNTERS", "LAG_BUCKETS"]

log = logging.getLogger("indexer.ingest.routesync")

# Counters (RouteSync.counters), exported as kvi_route_sync_* (api/metrics.py).
SYNC_COUNTERS = ("messages_out", "messages_in", "items_out", "items_in", "unsent_items", "resyncs", "joins",
                 "join_timeouts", "peers_joined", "peers_lost", "peers_left", "disconnects", "adopted", "ended",
                 "dropped_requests")
# Ends every replica sees for itself (the engine announced, a TTL passed, room was
# needed): a peer's request ending so is not told again. A "done" or an engine's own
# report reaches only the replica asked, so those are told whoever routed the request.
_SEEN_BY_ALL = frozenset({"announced", "prefill_expired", "decode_expired", "evicted", "forgotten"})
_STATE_PART_BYTES = MAX_MESSAGE_BYTES // 2  # a state answer's messages stay well below max_payload


class RouteSync(Background):
    """Shares ``index``'s in-flight view with the other router replicas on NATS ``url``
    (see the module). Thread-safe; runs its own thread and event loop.

    Parameters
    ----------
    token, user_credentials:
        NATS auth: a token, or a ``.creds`` file (user JWT and NKey seed).
    name:
        Shown to peers and on their pages (host:port).
    on_members:
        Called with ``(slot, of)`` whenever the set of live replicas changes: this
        replica's place among them (sorted by origin), for tie-breaking.
    """

    def __init__(self, index: PrefixIndex, url: str, *, subject: str = "kvi.route", heartbeat_s: float = 1.0,
                 peer_timeout_s: float | None = None, join_timeout_s: float = 5.0, join_wait_s: float = 0.25,
                 token: str | None = None, user_credentials: str | None = None, name: str = "",
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 on_members: Callable[[int, int], None] | None = None) -> None:
        if not heartbeat_s > 0:
            raise ValueError("heartbeat_s must be > 0")
        self.index = index
        self.url = url
        self.subject = subject
        self.heartbeat_s = float(heartbeat_s)
        self.peer_timeout_s = float(peer_timeout_s) if peer_timeout_s is not None else 3 * self.heartbeat_s
        self.join_timeout_s = float(join_timeout_s)
        self.join_wait_s = float(join_wait_s)
        self.name = name
        self.max_message_bytes = int(max_message_bytes)
        self.on_members = on_members
        self._auth: dict[str, Any] = {}
        if token:
            self._auth["token"] = token
        if user_credentials:
            self._auth["user_credentials"] = user_credentials
        self.origin = index.origin
        self.counters: dict[str, int] = dict.fromkeys(SYNC_COUNTERS, 0)
        self.views = PeerViews(index, self.counters, peer_timeout_s=self.peer_timeout_s,
                               max_message_bytes=int(max_message_bytes), on_mismatch=self._mismatch,
                               on_members=on_members)
        self.connected = False
        self.joined = threading.Event()  # joined once, or gave up waiting (ready on its own view)
        self._out: deque[Item] = deque()
        self._wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: Client | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ listener (index lock)

    def recorded(self, rid: str, model: str, worker: tuple[str, int], keys: array[int], prefill_tokens: int,
                 decode_blocks: int, prefill_open: bool) -> None:
        self._out.append(Entry(rid, model, worker[0], worker[1], keys.tobytes(), prefill_tokens, decode_blocks,
                               prefill_open, decode_blocks > 0, 0.0))
        self._wake()

    def ended(self, rid: str, origin: str, why: str, whole: bool) -> None:
        if origin and why in _SEEN_BY_ALL:
            return
        self._out.append(End(rid, origin, whole, why))
        self._wake()

    def forgot(self, worker: tuple[str, int]) -> None:
        self._out.append(Forget(worker[0], worker[1]))
        self._wake()

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not self._wake_pending:
            self._wake_pending = True
            try:
                loop.call_soon_threadsafe(self._flush_soon)
            except RuntimeError:  # the loop closed (stopping)
                pass

    # ------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        """Joined the other replicas (or found none, or gave up waiting for NATS)."""
        return self.joined.is_set()

    def stats(self) -> dict[str, Any]:
        """Connection, peers and counters (no walk of the index)."""
        now = time.monotonic()
        return {"url": self.url, "origin": self.origin, "connected": self.connected, "ready": self.ready,
                "slot": list(self.views.members),
                "peers": {o: {"name": p.name, "last_seen_s": round(now - p.seen, 3), "told": len(p.heard.ids)}
                          for o, p in sorted(self.views.peers.items())},
                "held": self.index.held_by_origin(), "counters": dict(self.counters), "bad": dict(self.views.bad),
                "lag_mean_ms": round(self.views.lag_sum / max(1, sum(self.views.lag)) * 1000, 3)}

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Connect, join the other replicas and keep in step, on a thread of its own; from
        now on the index tells this object of its decisions."""
        if self._thread is not None:
            return
        self.index.set_flight_listener(self)
        self._thread = threading.Thread(target=self._run, name="kvidx-route-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Say goodbye (peers drop this replica's requests at once), disconnect, stop."""
        t = self._thread
        if t is None:
            return
        self.index.set_flight_listener(None)
        self._stopping = True
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass
        t.join(timeout)
        self._thread = None

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except Exception:  # never expected: logged, and this replica routes on its own view
            log.exception("route sync stopped")
        finally:
            self._loop = None
            self.connected = False
            self.joined.set()
            pending = asyncio.all_tasks(loop)  # NATS's own readers and our sends: ended, not abandoned
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stop = asyncio.Event()
        self._loop = loop
        if self._out:
            self._wake()
        timer = loop.call_later(self.join_timeout_s, self._join_timed_out)
        nc = await connect(self.url, f"kv-indexer route sync {self.name}".strip(), lambda: self._stopping,
                           on_state=self._on_state, no_echo=True, **self._auth)
        if nc is None:
            return
        self._nc = nc
        s = self.subject
        await nc.subscribe(f"{s}.ev", cb=self._on_event)
        await nc.subscribe(f"{s}.who", cb=self._on_who)
        await nc.subscribe(f"{s}.state.{self.origin}", cb=self._on_state_request)
        await self._join()
        timer.cancel()
        beat = self._spawn(self._beat())
        await self._stop.wait()
        beat.cancel()
        try:
            self._flush()
            await nc.publish(f"{s}.ev", self._envelope([Bye()]))
            await nc.flush(timeout=1)
        except (nats.errors.Error, asyncio.TimeoutError, OSError):
            pass
        await nc.close()

    def _join_timed_out(self) -> None:
        if not self.joined.is_set():
            self.counters["join_timeouts"] += 1
            log.warning("route sync: NATS at %s not reached in %.1f s; routing on this replica's own view until "
                        "it is", self.url, self.join_timeout_s)
            self.joined.set()

    def _on_state(self, up: bool) -> None:
        was, self.connected = self.connected, up
        if was and not up:
            self.counters["disconnects"] += 1
        if up and not was and self._nc is not None:
            self._spawn(self._join())  # a reconnection: catch up with every peer again

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ sending

    def _envelope(self, items: list[Any]) -> bytes:
        return encode(Envelope(VERSION, self.origin, time.time(), items))

    def _flush_soon(self) -> None:
        self._wake_pending = False
        self._flush()

    def _flush(self) -> None:
        """Publish what the index told since the last flush, in order, in envelopes below
        the size bound; keep this replica's own sum in step even when disconnected."""
        out, views = self._out, self.views
        if not out:
            return
        batch: list[Any] = []
        size = 0
        while out:
            it = out.popleft()
            if isinstance(it, Entry):
                views.own.add(it.rid)
                size += 64 + len(it.keys)
            else:
                size += 64
                if isinstance(it, End) and it.whole:
                    views.told_end(it.origin, it.rid)
            batch.append(it)
            if size >= _STATE_PART_BYTES:
                self._publish(batch)
                batch, size = [], 0
        if batch:
            self._publish(batch)

    def _publish(self, items: list[Any]) -> None:
        nc = self._nc
        if nc is None or not self.connected:
            self.counters["unsent_items"] += len(items)  # the digests make the peers catch up
            return
        self._spawn(self._send(f"{self.subject}.ev", self._envelope(items), len(items)))

    async def _send(self, subject: str, data: bytes, n: int) -> None:
        try:
            await self._nc.publish(subject, data)  # type: ignore[union-attr]
        except (nats.errors.Error, OSError):
            self.counters["unsent_items"] += n
            return
        self.counters["messages_out"] += 1
        self.counters["items_out"] += n

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._flush()
            own = self.views.own
            self._publish([Heartbeat(len(own.ids), own.digest, self.name)])
            self.views.sweep()

    async def _on_event(self, msg: Msg) -> None:
        self.views.receive(msg.data)

    def _mismatch(self, peer: Peer) -> None:
        """A peer's heartbeat disagrees with what it told us: fetch its list."""
        self._spawn(self._resync(peer))

    # ------------------------------------------------------------ joining, reconciling

    async def _join(self) -> None:
        """Find the other replicas and fetch each one's requests; then ready."""
        nc = self._nc
        assert nc is not None
        found: set[str] = set()
        try:
            first = await nc.request(f"{self.subject}.who", b"", timeout=self.join_timeout_s)
        except nats.errors.NoRespondersError:
            first = None  # alone
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            log.warning("route sync: asking who is there failed (%r); routing on this replica's own view", e)
            self.joined.set()
            return
        if first is not None:
            env = self.views.read(first.data)
            if env is not None:
                found.add(env.origin)
            inbox = nc.new_inbox()

            async def collect(msg: Msg) -> None:
                e = self.views.read(msg.data)
                if e is not None:
                    found.add(e.origin)

            sub = await nc.subscribe(inbox, cb=collect)
            await nc.publish(f"{self.subject}.who", b"", reply=inbox)
            await asyncio.sleep(self.join_wait_s)  # answers come within a round trip each
            await sub.unsubscribe()
        await asyncio.gather(*(self._resync(self.views.peer(o)) for o in found - {self.origin}))
        self.counters["joins"] += 1
        self.joined.set()

    async def _on_who(self, msg: Msg) -> None:
        if msg.reply:
            own = self.views.own
            await self._reply(msg.reply, self._envelope([Heartbeat(len(own.ids), own.digest, self.name)]))

    async def _reply(self, subject: str, data: bytes) -> None:
        try:
            await self._nc.publish(subject, data)  # type: ignore[union-attr]
        except (nats.errors.Error, OSError):
            pass

    async def _on_state_request(self, msg: Msg) -> None:
        """Answer a peer's request for our open requests: as many messages as they need,
        the last ending with a StateEnd."""
        if not msg.reply:
            return
        self._flush()  # what we told so far, before the list that supersedes it
        parts: list[list[Any]] = [[]]
        size = 0
        count, digest = 0, 0
        for e in self.index.own_requests():
            item = Entry(e.rid, e.model, e.engine, e.dp_rank, e.keys.tobytes(), e.prefill_tokens, e.decode_blocks,
                         e.prefill_open, e.decode_open, e.age)
            size += 64 + len(item.keys)
            if size > _STATE_PART_BYTES:
                parts.append([])
                size = 64 + len(item.keys)
            parts[-1].append(item)
            count += 1
            digest ^= rid_hash(e.rid)
        parts[-1].append(StateEnd(len(parts), count, digest))
        for p in parts:
            await self._reply(msg.reply, self._envelope(p))

    async def _resync(self, peer: Peer) -> None:
        """Fetch ``peer``'s open requests and make our view of them exactly that."""
        nc = self._nc
        if nc is None or not self.views.begin_resync(peer):
            return
        got: list[Envelope] = []
        done = asyncio.Event()
        expect = [0]

        async def part(msg: Msg) -> None:
            env = self.views.read(msg.data)
            if env is None or env.origin != peer.origin:
                return
            got.append(env)
            if env.items and isinstance(env.items[-1], StateEnd):
                expect[0] = env.items[-1].messages
            if expect[0] and len(got) >= expect[0]:
                done.set()

        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox, cb=part)
            await nc.publish(f"{self.subject}.state.{peer.origin}", b"", reply=inbox)
            await asyncio.wait_for(done.wait(), timeout=max(self.join_timeout_s, 1.0))
            await sub.unsubscribe()
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            log.info("route sync: fetching %s's requests failed (%r); the next heartbeat retries", peer.origin, e)
            self.views.reconcile(peer, None)
            return
        self.views.reconcile(peer, got)
