"""What the index routed and has not seen announced yet: predicted prefixes
and in-flight load, per worker.

vLLM announces a request's blocks when its prefill ends, so between a routing decision
and that announcement the prefix it will cache is in no tree, and the queue it joins
is invisible. :class:`InFlight` keeps both, apart from the announced trees:

* **Predictions**: per model, a trie of block keys (the headline group's, as a query
  hashes them). Every node a routed prompt passes counts, per worker, the open
  requests through it. A query walks the trie along its own keys (after ending what
  is due); a mark at depth ``d`` means that worker will hold the first ``d`` blocks.
  Marks share nodes: a popular prefix costs its depth once, not once per request.
* **Load**: per worker, the prefill tokens routed there and not yet announced (the
  uncached part, as estimated at routing time) and the decode blocks of requests not
  yet done (``max_tokens``, when the caller says).

A request ends its prefill when the worker announces every block of its prompt on GPU
(checked after each applied batch of that worker), or after ``prefill_ttl_s``; its
decode when the caller says it is done, or after ``decode_ttl_s``. A worker's removal,
restart or cache clear ends all of its requests. At most ``max_in_flight`` requests are
kept: beyond, the oldest goes (counted).

Not thread-safe by itself: :class:`indexer.PrefixIndex` calls it under its lock.
"""

from __future__ import annotations

import heapq
import os
from array import array
from bisect import insort
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

from indexer.store.flight import NO_KEYS, FlightListener, NoListener, WorkerKey
from indexer.store.flight import FlightRequest as _Req
from indexer.store.peerflight import PeerFlight

__all__ = ["FlightListener", "InFlight", "NoListener", "WorkerKey"]


def _take(totals: dict[WorkerKey, int], w: WorkerKey, n: int) -> None:
    """Subtract ``n`` from ``totals[w]``, dropping the entry at 0 (the maps stay as small
    as the workers with something in flight)."""
    left = totals.get(w, 0) - n
    if left > 0:
        totals[w] = left
    else:
        totals.pop(w, None)


def _common(edge: array[int], keys: Sequence[int], i: int) -> int:
    """How many keys of ``edge`` equal ``keys[i:]``, from the start."""
    n = min(len(edge), len(keys) - i)
    if edge[:n] == array("Q", keys[i:i + n]):  # the common case: all of it (in C)
        return n
    m = 0
    while m < n and edge[m] == keys[i + m]:
        m += 1
    return m

_ROUTED_AT = attrgetter("t")  # a request's routing time: the pending queue's order

# Announcement checks per applied batch and worker: FIFO engines announce in routing
# order, so the oldest few pending requests are the ones that can have ended.
_CHECKS_PER_BATCH = 8


class _PNode:
    """A radix-trie node: the edge from its parent (block keys), its children by their
    edge's first key, and per worker the open requests whose prompt covers the edge."""

    __slots__ = ("edge", "kids", "marks")

    def __init__(self, edge: array[int]) -> None:
        self.edge = edge
        self.kids: dict[int, _PNode] | None = None
        self.marks: dict[WorkerKey, int] | None = None

    def split(self, at: int) -> None:
        """Cut the edge after ``at`` keys: the rest becomes this node's one child (which
        takes the children and the marks: they cover the whole old edge)."""
        low = _PNode(self.edge[at:])
        low.kids, low.marks = self.kids, dict(self.marks) if self.marks else None
        self.edge = self.edge[:at]
        self.kids = {low.edge[0]: low}


class InFlight(PeerFlight):
    """Predicted prefixes and in-flight load (see the module docstring); other router
    replicas' requests come in through :class:`~.peerflight.PeerFlight`."""

    def __init__(self, *, prefill_ttl_s: float = 30.0, decode_ttl_s: float = 300.0,
                 max_in_flight: int = 20_000, contention_window_s: float = 0.0,
                 clock: Callable[[], float]) -> None:
        if not prefill_ttl_s > 0 or not decode_ttl_s > 0:
            raise ValueError("prefill_ttl_s and decode_ttl_s must be > 0")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if not 0 <= contention_window_s < 60:
            raise ValueError("contention_window_s must be >= 0 and < 60")
        # How long another replica's decision can go unseen here (its trip over route
        # sync plus one of our routes): see unseen().
        self.contention_window_s = float(contention_window_s)
        # Per other replica: (routing time of its latest decision, the gap before it).
        self.peer_pace: dict[str, tuple[float, float]] = {}
        self.prefill_ttl_s = float(prefill_ttl_s)
        self.decode_ttl_s = float(decode_ttl_s)
        self.max_in_flight = int(max_in_flight)
        self.clock = clock
        self.tries: dict[str, _PNode] = {}
        self.requests: dict[str, _Req] = {}  # by id, oldest first
        self.pending: dict[WorkerKey, list[_Req]] = {}  # prefill open, routing order
        self.prefill: dict[WorkerKey, int] = {}  # tokens
        self.decode: dict[WorkerKey, int] = {}  # blocks
        # The same requests by worker, oldest first: what a report, a restart or a count
        # of one worker reads, without a pass over every request in flight.
        self.by_worker: dict[WorkerKey, dict[str, _Req]] = {}
        # What an engine reported (its metrics) beyond the requests we routed there:
        # worker -> (extra prefill tokens, extra decode blocks, report time).
        self.engine_extra: dict[WorkerKey, tuple[int, int, float]] = {}
        self.engine_max_age_s = 10.0  # an older report no longer counts
        # Per worker: its prefill rate (tokens/s, learned from announcements) and when it
        # last announced a routed prompt: the request in prefill has done rate x (now -
        # max(its routing, that)) of its tokens, not nothing, until announced.
        self.rate: dict[WorkerKey, float] = {}
        self.last_announce: dict[WorkerKey, float] = {}
        self._ended: dict[str, None] = {}  # ids of the last ended requests, oldest first
        # Running means of what one routed request adds (the unit for other routers' requests).
        self._mean_prefill = 512.0
        self._mean_decode = 0.0
        self.nodes = 0  # trie nodes, all models
        self.counters = {"recorded": 0, "announced": 0, "prefill_expired": 0, "done": 0, "decode_expired": 0,
                         "evicted": 0, "forgotten": 0, "engine_done": 0, "adopted": 0,
                         "adopted_announced": 0, "peer_ended": 0, "peer_dropped": 0, "spread": 0}
        self._heap: list[tuple[float, int, bool, _Req]] = []  # (deadline, n, is_prefill, request)
        self._n = 0
        self._n_heap = 0  # tie-breaker of the deadline heap (peers' requests too)
        # This replica's name among router replicas, and the prefix of its request ids:
        # ids of another process never collide.
        self.origin = os.urandom(4).hex()
        self._prefix = self.origin + "-"
        self.listener: FlightListener = NoListener()
        self._quiet = False  # applying a peer's news: tell the listener nothing
        self.by_origin: dict[str, dict[str, _Req]] = {}  # other replicas' requests, by origin

    # ------------------------------------------------------------------ record

    def record(self, model: str, worker: WorkerKey, keys: Iterable[int], prefill_tokens: int,
               decode_blocks: int, predict: bool = True) -> str:
        """Record one routing decision; returns its request id.

        ``keys`` are the prompt's full blocks (headline group), marked as predicted for
        ``worker`` until it announces them, when ``predict`` (the worker has not
        announced them all yet); ``prefill_tokens`` is what it will compute (blocks
        an earlier routed prompt will cache first do not count).
        """
        now = self.clock()
        self.expire(now)
        self._n += 1
        rid = f"{self._prefix}{self._n:x}"
        arr = array("Q", keys)
        req = _Req(rid, model, worker, arr, max(0, prefill_tokens), max(0, decode_blocks), now,
                   now + self.prefill_ttl_s, predict and len(arr) > 0)
        self.counters["recorded"] += 1
        if self._open(req, now + self.decode_ttl_s):
            self.listener.recorded(rid, model, worker, arr if req.prefill_open else NO_KEYS, req.prefill_tokens,
                                   req.decode_blocks, req.prefill_open)
        return rid

    def _open(self, req: _Req, decode_deadline: float) -> bool:
        """Hold ``req`` (evicting the oldest request beyond ``max_in_flight``): its marks,
        load and deadlines. False when nothing of it is open (it ends at once, quietly)."""
        if len(self.requests) >= self.max_in_flight:
            self._end(next(iter(self.requests.values())), "evicted")
        rid, worker = req.id, req.worker
        self.requests[rid] = req
        self.by_worker.setdefault(worker, {})[rid] = req
        if req.origin:
            self.by_origin.setdefault(req.origin, {})[rid] = req
        self._mean_prefill += (req.prefill_tokens - self._mean_prefill) * 0.01
        self._mean_decode += (req.decode_blocks - self._mean_decode) * 0.01
        self._n_heap += 1
        if req.prefill_open:
            self._mark(req)
            self._queue(req)
            self.prefill[worker] = self.prefill.get(worker, 0) + req.prefill_tokens
            heapq.heappush(self._heap, (req.expiry, self._n_heap, True, req))
        if req.decode_open:
            self.decode[worker] = self.decode.get(worker, 0) + req.decode_blocks
        if not (req.prefill_open or req.decode_open):
            quiet, self._quiet = self._quiet, True
            try:  # all of it announced already, nothing to decode: over, and nobody to tell
                self._end(req, "announced")
            finally:
                self._quiet = quiet
            return False
        heapq.heappush(self._heap, (decode_deadline, self._n_heap, False, req))
        return True

    def _queue(self, req: _Req) -> None:
        """Put ``req`` among its worker's pending prefills, in routing order."""
        pend = self.pending.setdefault(req.worker, [])
        if pend and req.t < pend[-1].t:
            # A peer's decision, routed before ours that are here already: the engine
            # queues in arrival order, so the head (the one in prefill) is the oldest.
            insort(pend, req, key=_ROUTED_AT)
        else:
            pend.append(req)

    def _mark(self, req: _Req) -> None:
        """Count ``req`` on every node its keys cover, splitting edges where it diverges
        or ends inside one; its unshared rest becomes one new node."""
        root = self.tries.get(req.model)
        if root is None:
            root = self.tries[req.model] = _PNode(array("Q"))
        keys, n, w = req.keys, len(req.keys), req.worker
        node, i = root, 0
        while i < n:
            kid = node.kids.get(keys[i]) if node.kids else None
            if kid is None:
                kid = _PNode(keys[i:])
                if node.kids is None:
                    node.kids = {}
                node.kids[keys[i]] = kid
                self.nodes += 1
            else:
                e = kid.edge
                m = _common(e, keys, i)
                if m < len(e):
                    kid.split(m)
                    self.nodes += 1
            node = kid
            i += len(node.edge)
            marks = node.marks
            if marks is None:
                node.marks = {w: 1}
            else:
                marks[w] = marks.get(w, 0) + 1

    def _unmark(self, req: _Req) -> None:
        """Take ``req``'s counts away; free the nodes left with neither marks nor children."""
        root = self.tries.get(req.model)
        if root is None:
            return
        keys, n, w = req.keys, len(req.keys), req.worker
        path = [root]
        node, i = root, 0
        while i < n and node.kids:
            kid = node.kids.get(keys[i])
            if kid is None:
                break
            path.append(kid)
            node = kid
            i += len(kid.edge)
        for j in range(len(path) - 1, 0, -1):
            node = path[j]
            marks = node.marks
            if marks is not None:
                c = marks.get(w, 0) - 1
                if c > 0:
                    marks[w] = c
                else:
                    marks.pop(w, None)
                    if not marks:
                        node.marks = None
            if node.marks is None and not node.kids:
                parent = path[j - 1]
                del parent.kids[node.edge[0]]  # type: ignore[union-attr]  # node is one of them
                if not parent.kids:
                    parent.kids = None
                self.nodes -= 1
        if not root.kids:
            del self.tries[req.model]

    # ------------------------------------------------------------------ read

    def predicted(self, model: str, key_chunks: Iterable[Sequence[int]], now: float) -> dict[WorkerKey, int]:
        """``{worker: blocks}``: how much of a prompt (its block keys, in chunks) each
        worker is predicted to hold. Ends what is due at ``now`` first (the only write)."""
        self.expire(now)
        node = self.tries.get(model)
        if node is None:
            return {}
        out: dict[WorkerKey, int] = {}
        q: list[int] = []
        chunks = iter(key_chunks)
        d = 0
        while node.kids:
            if len(q) <= d:
                q.extend(next(chunks, ()))
                if len(q) <= d:
                    break
            kid = node.kids.get(q[d])
            if kid is None:
                break
            e = kid.edge
            while len(q) < d + len(e):  # enough of the query to compare the whole edge
                more = next(chunks, None)
                if more is None:
                    break
                q.extend(more)
            m = _common(e, q, d)
            d += m
            if kid.marks:
                for w in kid.marks:
                    out[w] = d
            if m < len(e):
                break
            node = kid
        return out

    def load(self, worker: WorkerKey) -> tuple[int, int]:
        """(prefill tokens, decode blocks) in flight on ``worker``: what we routed there,
        less what the request in prefill has done by now (at the worker's learned rate),
        plus what its engine reported beyond ours (other routers' requests)."""
        return self._loads((worker,), self.clock()).get(worker, (0, 0))

    def loads(self) -> dict[WorkerKey, tuple[int, int]]:
        """:meth:`load` of every worker whose load is not (0, 0), at one reading of the
        clock: a route's estimate for a whole fleet, asked only of the workers with
        something in flight or reported (every other one's is (0, 0)). Reads only."""
        prefill, decode, extra = self.prefill, self.decode, self.engine_extra
        keys = prefill.keys() | decode.keys() | extra.keys() if decode or extra else prefill.keys()
        return self._loads(keys, self.clock())

    def _loads(self, keys: Iterable[WorkerKey], now: float) -> dict[WorkerKey, tuple[int, int]]:
        """:meth:`load` at clock reading ``now`` of each of ``keys`` whose load is not
        (0, 0): one loop, no call per worker (a route asks it of a whole fleet)."""
        out: dict[WorkerKey, tuple[int, int]] = {}
        prefill, decode, extra, rate = self.prefill, self.decode, self.engine_extra, self.rate
        max_age = self.engine_max_age_s
        for w in keys:
            pre = prefill.get(w, 0)
            dec = decode.get(w, 0)
            r = rate.get(w) if pre else None
            if r is not None:
                for head in self.pending[w]:  # FIFO: the first with work is in prefill now
                    if head.prefill_tokens:
                        start = max(head.t, self.last_announce.get(w, head.t))
                        pre -= min(head.prefill_tokens, max(0, int(r * (now - start))))
                        break
            if extra:
                ex = extra.get(w)
                if ex is not None and not now - ex[2] > max_age:
                    pre += ex[0]
                    dec += ex[1]
            if pre or dec:
                out[w] = (pre, dec)
        return out

    def worker_requests(self, worker: WorkerKey) -> int:
        return len(self.by_worker.get(worker, ()))

    # ------------------------------------------------------------------ end

    def check_announced(self, worker: WorkerKey, resident: Callable[[Sequence[int]], bool]) -> None:
        """After a batch of ``worker`` was applied: end the prefill of its oldest pending
        requests whose every block ``resident`` now says is on the worker's GPU."""
        pend = self.pending.get(worker)
        if not pend:
            return
        done = [r for r in pend[:_CHECKS_PER_BATCH] if resident(r.keys)]
        if not done:
            return
        now = self.clock()
        for r in done:
            self._learn_rate(r, now)
            self._prefill_ended(r, "announced")

    def expire(self, now: float | None = None) -> None:
        """End what outlived its TTL (prefills, then whole requests)."""
        heap = self._heap
        if not heap:
            return
        if now is None:
            now = self.clock()
        while heap and heap[0][0] <= now:
            _, _, is_prefill, req = heapq.heappop(heap)
            if is_prefill:
                if req.prefill_open:
                    self._prefill_ended(req, "prefill_expired")
            elif self.requests.get(req.id) is req:
                self._end(req, "decode_expired")

    def done(self, rid: str) -> bool | None:
        """The caller says request ``rid`` finished: release all of it (True). False when it
        had ended already (announced without decode to wait for, done, expired: the last
        ``max_in_flight`` ended ids are remembered); None when unknown."""
        req = self.requests.get(rid)
        if req is None:
            return False if rid in self._ended else None
        self._end(req, "done")
        return True

    def first_token(self, rid: str) -> bool:
        """Request ``rid``'s first token came back (the gateway saw it): its prefill is
        over, so its prefill load ends now; its predicted prefix stays until the worker
        announces the blocks (or the TTL). False when it is not open in prefill."""
        req = self.requests.get(rid)
        if req is None or not req.prefill_open or not req.prefill_tokens:
            return False
        w = req.worker
        pend = self.pending.get(w)
        if pend and pend[0] is req:  # FIFO: the prefill that was running; a sample of the rate
            self._learn_rate(req, self.clock())
        _take(self.prefill, w, req.prefill_tokens)
        req.prefill_tokens = 0
        return True

    def _prefill_ended(self, req: _Req, why: str) -> None:
        """The prefill of ``req`` ended (``why``); with no decode to wait for, all of it."""
        if req.decode_open:
            self._close_prefill(req)
            self.counters[why] += 1
            if not self._quiet:
                self.listener.ended(req.id, req.origin, why, False)
        else:
            self._end(req, why)

    def _learn_rate(self, req: _Req, now: float) -> None:
        """A FIFO engine prefilled ``req`` from its arrival or the previous announcement,
        whichever came later, until ``now``: a sample of the worker's prefill rate."""
        w = req.worker
        start = max(req.t, self.last_announce.get(w, req.t))
        self.last_announce[w] = now
        dur = now - start
        if req.prefill_tokens > 0 and dur > 0:
            obs = req.prefill_tokens / dur
            old = self.rate.get(w)
            self.rate[w] = obs if old is None else old + (obs - old) * 0.2

    def forget_worker(self, worker: WorkerKey) -> int:
        """End every request of ``worker`` (removed, restarted or cleared: what it was
        going to cache is gone, and so is its queue). Returns how many."""
        mine = list(self.by_worker.get(worker, {}).values())
        if not self._quiet:
            self.listener.forgot(worker)
        for r in mine:
            self._end(r, "forgotten")
        self.engine_extra.pop(worker, None)
        self.rate.pop(worker, None)
        self.last_announce.pop(worker, None)
        return len(mine)

    def _close_prefill(self, req: _Req) -> None:
        req.prefill_open = False
        w = req.worker
        _take(self.prefill, w, req.prefill_tokens)
        pend = self.pending.get(w)
        if pend is not None:
            pend.remove(req)
            if not pend:
                del self.pending[w]
        self._unmark(req)

    def _end(self, req: _Req, why: str) -> None:
        self.counters[why] += 1
        if why != "peer_dropped":  # a peer's request we stopped following has not ended: it may come back
            ended = self._ended
            ended[req.id] = None
            if len(ended) > self.max_in_flight:
                del ended[next(iter(ended))]
        if req.prefill_open:
            self._close_prefill(req)
        if req.decode_open:
            req.decode_open = False
            _take(self.decode, req.worker, req.decode_blocks)
        if self.requests.pop(req.id, None) is not None:
            mine = self.by_worker[req.worker]
            del mine[req.id]
            if not mine:
                del self.by_worker[req.worker]
            if req.origin:
                theirs = self.by_origin[req.origin]
                del theirs[req.id]
                if not theirs:
                    del self.by_origin[req.origin]
            if not self._quiet:
                self.listener.ended(req.id, req.origin, why, True)
