"""The index's door for route sync: other router replicas' requests into the in-flight
view, this replica's own out, each call under the index's lock (a mixin of
:class:`indexer.PrefixIndex`; :mod:`indexer.store.peerflight` does the work)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from indexer.store.flight import FlightListener, NoListener
from indexer.store.journal import ADOPT_PEER, DROP_PEER, END_PEER, EXPIRE, FORGET_PEER_WORKER, Journal
from indexer.store.peerflight import PeerEntry

if TYPE_CHECKING:
    import threading

    from indexer.store.inflight import InFlight
    from indexer.store.state import WorkerState

__all__ = ["Peers"]


class Peers:
    """Route sync's calls into the index (see the module)."""

    if TYPE_CHECKING:
        _lock: threading.Lock
        inflight: InFlight
        _rec: Journal | None
        _workers: dict[tuple[str, int], WorkerState]

        def _resident_on(self, w: WorkerState) -> Callable[[Sequence[int]], bool] | None: ...

    @property
    def origin(self) -> str:
        """This index's name among router replicas (the prefix of its request ids)."""
        return self.inflight.origin

    def set_flight_listener(self, listener: FlightListener | None) -> None:
        """Tell ``listener`` of every decision this index records and every end of one
        from now on (None: tell nobody)."""
        with self._lock:
            self.inflight.listener = listener if listener is not None else NoListener()

    def adopt_peer(self, origin: str, entries: Iterable[PeerEntry]) -> int:
        """Hold peer ``origin``'s open requests (:meth:`~indexer.store.peerflight.PeerFlight.adopt`);
        returns how many were new."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(ADOPT_PEER, self._adopt_peer, (origin, list(entries))))
            return self._adopt_peer(origin, entries)

    def _adopt_peer(self, origin: str, entries: Iterable[PeerEntry]) -> int:
        adopt, workers = self.inflight.adopt, self._workers
        resident: dict[tuple[str, int], Callable[[Sequence[int]], bool] | None] = {}
        n = 0
        for e in entries:
            key = (e.engine, e.dp_rank)
            if key not in resident:
                w = workers.get(key)
                resident[key] = self._resident_on(w) if w is not None else None
            n += adopt(origin, e, resident[key])
        return n

    def end_peer(self, ends: Iterable[tuple[str, bool]]) -> int:
        """``(request id, whole)`` a peer says ended; returns how many were open here."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(END_PEER, self._end_peer, (list(ends),)))
            return self._end_peer(ends)

    def _end_peer(self, ends: Iterable[tuple[str, bool]]) -> int:
        end = self.inflight.end_peer
        return sum(end(rid, whole) for rid, whole in ends)

    def forget_peer_worker(self, worker: tuple[str, int]) -> int:
        """A peer saw ``worker`` removed, restarted or cleared: end its requests."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(FORGET_PEER_WORKER, self.inflight.forget_peer_worker, (tuple(worker),)))
            return self.inflight.forget_peer_worker(worker)

    def drop_peer(self, origin: str, keep: Iterable[str] | None = None) -> int:
        """End peer ``origin``'s requests but those in ``keep`` (all: it left)."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(DROP_PEER, self.inflight.drop_origin,
                                         (origin, None if keep is None else list(keep))))
            return self.inflight.drop_origin(origin, keep)

    def own_requests(self) -> list[PeerEntry]:
        """This index's own open requests, for a peer that asks."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(EXPIRE, self.inflight.expire, ())
            else:
                self.inflight.expire()
            return list(self.inflight.own_entries())

    def held_by_origin(self) -> dict[str, int]:
        """Open requests per origin (``""``: this index's own)."""
        with self._lock:
            return self.inflight.held_by_origin()
