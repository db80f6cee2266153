"""Other routers' requests in this replica's in-flight view: those other router replicas
tell of (route sync), and those an engine reports beyond ours (:meth:`PeerFlight.correct`).

Route sync (:mod:`indexer.ingest.routesync`) tells every replica what the others routed
and what ended. :class:`PeerFlight` is the part of :class:`~.inflight.InFlight` that
takes that news: a peer's request is held exactly like one routed here (its predicted
prefix, its load, the same TTLs counted from when it was routed), tagged with its
origin, and ends like one (announced, done, expired), except that nothing applied from
a peer is told back to the listener, so no message echoes between replicas.

A request id names its origin (``<origin>-<n>``), so a peer's end of a request that
has not reached us yet is remembered among the ended ids and its record, arriving
late, is ignored.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from indexer.store.flight import FlightListener, FlightRequest, WorkerKey

__all__ = ["PeerEntry", "PeerFlight"]

_FAR = 1e9  # the gap before a replica's first decision heard: none yet


class PeerEntry(NamedTuple):
    """One open request as route sync carries it: ``age`` is seconds since it was routed
    (on the sender's clock), ``keys`` its predicted prompt blocks (empty once announced)."""

    rid: str
    model: str
    engine: str
    dp_rank: int
    keys: array[int]
    prefill_tokens: int
    decode_blocks: int
    prefill_open: bool
    decode_open: bool
    age: float


class PeerFlight:
    """Adopting, ending and dropping other replicas' requests (a mixin of
    :class:`~.inflight.InFlight`; the attributes are its own)."""

    if TYPE_CHECKING:
        clock: Callable[[], float]
        contention_window_s: float
        peer_pace: dict[str, tuple[float, float]]
        prefill_ttl_s: float
        decode_ttl_s: float
        requests: dict[str, FlightRequest]
        engine_extra: dict[WorkerKey, tuple[int, int, float]]
        _mean_prefill: float
        _mean_decode: float
        by_origin: dict[str, dict[str, FlightRequest]]
        by_worker: dict[WorkerKey, dict[str, FlightRequest]]
        counters: dict[str, int]
        origin: str
        listener: FlightListener
        _ended: dict[str, None]
        _quiet: bool
        max_in_flight: int

        def expire(self, now: float | None = None) -> None: ...
        def forget_worker(self, worker: WorkerKey) -> int: ...
        def _open(self, req: FlightRequest, decode_deadline: float) -> bool: ...
        def _end(self, req: FlightRequest, why: str) -> None: ...
        def _prefill_ended(self, req: FlightRequest, why: str) -> None: ...

    def adopt(self, origin: str, e: PeerEntry,
              resident: Callable[[Sequence[int]], bool] | None = None) -> bool:
        """Hold peer ``origin``'s request ``e`` as if routed here ``e.age`` s ago (its TTLs
        count from then). False, changing nothing, when it is known, ended already, ours,
        or nothing of it is still open by our TTLs.

        ``resident`` (keys -> on the worker's GPU): its prefill is over when the worker
        has announced its blocks already. A decision can reach us after its engine's
        announcement (a short prefill, a lagging bus), and no batch of that worker may
        come for a while to end it; held open, it would count as queued load."""
        rid = e.rid
        if rid in self.requests or rid in self._ended or origin == self.origin or not origin:
            return False
        now = self.clock()
        self.expire(now)
        t = now - max(0.0, e.age)
        if self.contention_window_s and e.age < 1.0:  # a decision told as taken, not a list fetched later
            pace = self.peer_pace.get(origin)
            if pace is None:
                self.peer_pace[origin] = (t, _FAR)
            elif t > pace[0]:
                self.peer_pace[origin] = (t, t - pace[0])
        prefill_open = e.prefill_open and len(e.keys) > 0 and t + self.prefill_ttl_s > now
        if prefill_open and resident is not None and resident(e.keys):
            prefill_open = False
            self.counters["adopted_announced"] += 1
        decode_open = e.decode_open and e.decode_blocks > 0 and t + self.decode_ttl_s > now
        if not (prefill_open or decode_open):
            return False
        req = FlightRequest(rid, e.model, (e.engine, e.dp_rank), e.keys, max(0, e.prefill_tokens),
                   max(0, e.decode_blocks) if decode_open else 0, t, t + self.prefill_ttl_s, prefill_open)
        req.origin = origin
        quiet, self._quiet = self._quiet, True
        try:
            opened = self._open(req, t + self.decode_ttl_s)
        finally:
            self._quiet = quiet
        if opened:
            self.counters["adopted"] += 1
        return opened

    def unseen(self, now: float) -> list[float]:
        """How many decisions each other replica before this one (in origin order, the
        order of their tie slots) is likely taking right now, unseen here: ``window /
        max(its last gap between decisions, time since its last one, window)``, at most
        1, for those above 0.05. Empty with no window or no such replica. Reads only.

        Replicas that route in the same instant cannot see each other's decisions: in
        a burst each would send its request to the worker that is best before any of
        them, where one router would have spread the burst. A route that weighs, for
        each replica ranked before it, that many requests like its own placed on the
        best workers first (:func:`indexer.query.route.spread_unseen`) makes the
        replicas of a burst take the workers one router would, in slot order. A replica
        that routed its last request a while ago, or routes far apart, weighs ~0."""
        w = self.contention_window_s
        if not w or not self.peer_pace:
            return []
        own = self.origin
        out = []
        for origin, (last, gap) in sorted(self.peer_pace.items()):
            if origin >= own:
                break
            e = w / max(gap, now - last, w)
            if e > 0.05:
                out.append(e)
        return out

    def correct(self, worker: WorkerKey, waiting: float, running: float, t: float) -> None:
        """Correct ``worker``'s estimate with what its engine reported at ``t``: ``waiting``
        and ``running`` requests (vLLM's gauges; a request in prefill is running).

        Our requests routed to it before ``t`` that the engine no longer has (more of them
        open than it reports) have finished: the oldest end ("engine_done"). Requests it
        has beyond ours are other routers': they count as load, in units of a mean routed
        request, until the next report (or ``engine_max_age_s``)."""
        mine = [r for r in self.by_worker.get(worker, {}).values() if r.t <= t
                and (r.prefill_open or r.decode_open)]
        present = max(0, int(waiting)) + max(0, int(running))
        for r in mine[: max(0, len(mine) - present)]:  # oldest first (dict order)
            self._end(r, "engine_done")
        n_mine = min(len(mine), present)
        extra_waiting = max(0, int(waiting) - n_mine)
        extra_running = max(0, present - n_mine - extra_waiting)
        if extra_waiting or extra_running:
            self.engine_extra[worker] = (int(extra_waiting * self._mean_prefill),
                                         int((extra_waiting + extra_running) * self._mean_decode), t)
        else:
            self.engine_extra.pop(worker, None)

    def end_peer(self, rid: str, whole: bool) -> bool:
        """A peer says request ``rid`` ended (its prefill only, unless ``whole``): end it
        here too, quietly. An unknown id is remembered as ended (its record may still be
        on the way). True when something open ended."""
        req = self.requests.get(rid)
        if req is None:
            if whole and rid not in self._ended:
                self._ended[rid] = None
                if len(self._ended) > self.max_in_flight:
                    del self._ended[next(iter(self._ended))]
            return False
        quiet, self._quiet = self._quiet, True
        try:
            if whole:
                self._end(req, "peer_ended")
            elif req.prefill_open:
                self._prefill_ended(req, "peer_ended")
            else:
                return False
        finally:
            self._quiet = quiet
        return True

    def forget_peer_worker(self, worker: WorkerKey) -> int:
        """A peer saw ``worker`` removed, restarted or cleared: end its requests here too
        (whoever routed them), quietly. Returns how many."""
        quiet, self._quiet = self._quiet, True
        try:
            return self.forget_worker(worker)
        finally:
            self._quiet = quiet

    def drop_origin(self, origin: str, keep: Iterable[str] | None = None) -> int:
        """End peer ``origin``'s requests here, quietly, except those named in ``keep``
        (a reconciliation with the peer's own list); all of them when the peer left or
        died. Returns how many ended."""
        if keep is None:
            self.peer_pace.pop(origin, None)
        theirs = self.by_origin.get(origin)
        if not theirs:
            return 0
        kept = set(keep) if keep is not None else set()
        gone = [r for rid, r in theirs.items() if rid not in kept]
        quiet, self._quiet = self._quiet, True
        try:
            for r in gone:
                self._end(r, "peer_dropped")
        finally:
            self._quiet = quiet
        return len(gone)

    def own_entries(self) -> Iterator[PeerEntry]:
        """This replica's own open requests, oldest first, as a joining or reconciling peer
        asks for them (reads only)."""
        now = self.clock()
        for r in self.requests.values():
            if not r.origin:
                yield PeerEntry(r.id, r.model, r.worker[0], r.worker[1], r.keys if r.prefill_open else array("Q"),
                                r.prefill_tokens, r.decode_blocks, r.prefill_open, r.decode_open, now - r.t)

    def held_by_origin(self) -> dict[str, int]:
        """Open requests per origin (``""``: this replica's own), from the maps' sizes."""
        out: dict[str, Any] = {o: len(m) for o, m in self.by_origin.items()}
        out[""] = len(self.requests) - sum(out.values())
        return out
