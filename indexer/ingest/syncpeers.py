"""Route sync's receiving side: what each other router replica told, applied to the
index (:class:`PeerViews`; :mod:`.routesync` does the talking).

Per peer it keeps the ids of the requests the peer told of and has not ended
(:class:`Told`: their count and the xor of their ids' xxh64), the sum the peer's
heartbeats are checked against: a difference means a message was lost, and the peer's
list is fetched (``on_mismatch``) and reconciled (:meth:`PeerViews.reconcile`).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING

import xxhash

from indexer.store.peerflight import PeerEntry
from indexer.wire.routesync import BadMessage, Bye, End, Entry, Envelope, Forget, Heartbeat, decode

if TYPE_CHECKING:
    from indexer.query.index import PrefixIndex

__all__ = ["LAG_BUCKETS", "Peer", "PeerViews", "Told", "rid_hash"]

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def rid_hash(rid: str) -> int:
    return xxhash.xxh64_intdigest(rid.encode())


class Told:
    """Ids a replica has told of and not ended, with their count and xor digest."""

    __slots__ = ("ids", "digest")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.digest = 0

    def add(self, rid: str) -> None:
        if rid not in self.ids:
            h = self.ids[rid] = rid_hash(rid)
            self.digest ^= h

    def remove(self, rid: str) -> None:
        h = self.ids.pop(rid, None)
        if h is not None:
            self.digest ^= h

    def reset(self, rids: set[str]) -> None:
        self.ids = {r: rid_hash(r) for r in rids}
        d = 0
        for h in self.ids.values():
            d ^= h
        self.digest = d


class Peer:
    """Another replica as heard: its name, when it last spoke, what it told."""

    __slots__ = ("origin", "name", "seen", "heard", "resyncing", "since_added", "since_ended")

    def __init__(self, origin: str, now: float) -> None:
        self.origin = origin
        self.name = ""
        self.seen = now  # monotonic time of its last message
        self.heard = Told()
        self.resyncing = False
        self.since_added: set[str] = set()  # told while its list was being fetched
        self.since_ended: set[str] = set()


class PeerViews:
    """The other replicas and what they told, applied to ``index`` (see the module).
    Used from route sync's event loop only."""

    def __init__(self, index: PrefixIndex, counters: dict[str, int], *, peer_timeout_s: float,
                 max_message_bytes: int, on_mismatch: Callable[[Peer], None],
                 on_members: Callable[[int, int], None] | None) -> None:
        self.index = index
        self.origin = index.origin
        self.counters = counters
        self.peer_timeout_s = peer_timeout_s
        self.max_message_bytes = max_message_bytes
        self.on_mismatch = on_mismatch
        self.on_members = on_members
        self.peers: dict[str, Peer] = {}
        self.own = Told()  # what this replica told of its own requests
        self.bad: dict[str, int] = {}  # messages refused, by reason
        self.lag = [0] * (len(LAG_BUCKETS) + 1)  # messages by lag bucket (the last: above)
        self.lag_sum = 0.0
        self.members: tuple[int, int] = (0, 1)

    def peer(self, origin: str) -> Peer:
        """``origin``'s record, made (and the members changed) when it is new."""
        p = self.peers.get(origin)
        if p is None:
            p = self.peers[origin] = Peer(origin, time.monotonic())
            self.counters["peers_joined"] += 1
            self._members_changed()
        return p

    def read(self, data: bytes) -> Envelope | None:
        """The envelope in ``data`` (counted, its lag too), or None: refused (counted by
        reason) or our own."""
        try:
            env = decode(data, self.max_message_bytes)
        except BadMessage as e:
            self.bad[e.reason] = self.bad.get(e.reason, 0) + 1
            return None
        if env.origin == self.origin:
            return None
        lag = max(0.0, time.time() - env.sent)
        self.lag_sum += lag
        self.lag[bisect_left(LAG_BUCKETS, lag)] += 1  # Prometheus buckets are "<= le"
        self.counters["messages_in"] += 1
        self.counters["items_in"] += len(env.items)
        return env

    def receive(self, data: bytes) -> None:
        """A message on the events subject: a goodbye drops its sender, anything else is
        applied and keeps the sender alive."""
        env = self.read(data)
        if env is None:
            return
        if env.items and isinstance(env.items[-1], Bye):
            if env.origin in self.peers:
                self.drop(env.origin, "peers_left")
            return
        peer = self.peer(env.origin)
        peer.seen = time.monotonic()
        self.apply(peer, env)

    def apply(self, peer: Peer, env: Envelope) -> None:
        """Apply ``peer``'s items in order, consecutive entries and ends in one call each."""
        lag = min(max(0.0, time.time() - env.sent), self.peer_timeout_s)
        entries: list[PeerEntry] = []
        ends: list[tuple[str, bool]] = []
        for it in env.items:
            if isinstance(it, Entry):
                if ends:
                    self._end(ends)
                keys = array("Q")
                keys.frombytes(it.keys)  # little-endian uint64 (both hosts' order)
                entries.append(PeerEntry(it.rid, it.model, it.engine, it.dp_rank, keys, it.prefill_tokens,
                                         it.decode_blocks, it.prefill_open, it.decode_open, it.age + lag))
                peer.heard.add(it.rid)
                if peer.resyncing:
                    peer.since_added.add(it.rid)
                continue
            if entries:
                self._adopt(peer.origin, entries)
            if isinstance(it, End):
                ends.append((it.rid, it.whole))
                if it.whole:
                    self._heard_end(it.origin or peer.origin, it.rid)
                continue
            if ends:
                self._end(ends)
            if isinstance(it, Forget):
                self.index.forget_peer_worker((it.engine, it.dp_rank))
            elif isinstance(it, Heartbeat):
                peer.name = it.name
                if not peer.resyncing and (len(peer.heard.ids), peer.heard.digest) != (it.count, it.digest):
                    self.on_mismatch(peer)
        if entries:
            self._adopt(peer.origin, entries)
        if ends:
            self._end(ends)

    def _adopt(self, origin: str, entries: list[PeerEntry]) -> None:
        self.counters["adopted"] += self.index.adopt_peer(origin, entries)
        entries.clear()

    def _end(self, ends: list[tuple[str, bool]]) -> None:
        self.counters["ended"] += self.index.end_peer(ends)
        ends.clear()

    def _heard_end(self, origin: str, rid: str) -> None:
        if origin == self.origin:
            self.own.remove(rid)  # a peer ended our request (a "done" asked of it)
            return
        p = self.peers.get(origin)
        if p is not None:
            p.heard.remove(rid)
            if p.resyncing:
                p.since_ended.add(rid)

    def told_end(self, origin: str, rid: str) -> None:
        """We told the others that request ``rid`` (``origin``'s; ``""``: ours) ended."""
        if origin:
            p = self.peers.get(origin)
            if p is not None:
                p.heard.remove(rid)
        else:
            self.own.remove(rid)

    def begin_resync(self, peer: Peer) -> bool:
        """Start fetching ``peer``'s list; False when a fetch is under way already."""
        if peer.resyncing:
            return False
        peer.resyncing = True
        peer.since_added.clear()
        peer.since_ended.clear()
        self.counters["resyncs"] += 1
        return True

    def reconcile(self, peer: Peer, answer: list[Envelope] | None) -> None:
        """Make our view of ``peer``'s requests its ``answer`` (its list), plus what it
        told since it was asked, less what it ended since; None: the fetch failed."""
        peer.resyncing = False
        if answer is None:
            return
        entries = [it for env in answer for it in env.items if isinstance(it, Entry)]
        rids = ({it.rid for it in entries} | peer.since_added) - peer.since_ended
        self.counters["dropped_requests"] += self.index.drop_peer(peer.origin, keep=rids)
        self.apply(peer, Envelope(answer[-1].v, peer.origin, answer[-1].sent, list(entries)))
        peer.heard.reset(rids)

    def sweep(self) -> None:
        """Drop the peers silent for ``peer_timeout_s`` (their requests with them)."""
        now = time.monotonic()
        for o in [o for o, p in self.peers.items() if now - p.seen > self.peer_timeout_s]:
            self.drop(o, "peers_lost")

    def drop(self, origin: str, why: str) -> None:
        """Forget peer ``origin`` and end its requests here (``why``: the counter)."""
        self.peers.pop(origin, None)
        self.counters[why] += 1
        self.counters["dropped_requests"] += self.index.drop_peer(origin)
        self._members_changed()

    def _members_changed(self) -> None:
        everyone = sorted([self.origin, *self.peers])
        m = (everyone.index(self.origin), len(everyone))
        if m != self.members:
            self.members = m
            if self.on_members is not None:
                self.on_members(*m)
