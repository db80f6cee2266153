"""The routing policies the fleet simulator (:mod:`indexer.producer.sim`) compares.

* :class:`RoundRobin`, :class:`LeastLoaded`: blind to caches.
* :class:`IndexRouter`: the index's answer over an in-process
  :class:`~indexer.query.index.PrefixIndex`, asked one of three ways (``mode``): with the
  caller's load (``"load"``, the policy ``index``), with no load at all, so the index's
  own in-flight bookkeeping stands in for it (``"no_load"``, ``index_no_load``), or on the
  cached prefix alone (``"cache_only"``, ``index_cache_only``: nothing recorded).
* :class:`HttpRouter`: the service's ``POST /v1/route``.

The oracle, which needs the simulated engines themselves, is
:class:`indexer.producer.sim.Oracle`.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Protocol

from indexer.query.route import Load, route
from indexer.wire.engines import parse_worker

if TYPE_CHECKING:
    from indexer.query.index import PrefixIndex

__all__ = ["Router", "RoundRobin", "LeastLoaded", "IndexRouter", "HttpRouter"]


class Router(Protocol):
    """What :func:`~indexer.producer.sim.simulate` asks of a routing policy (its ``name``,
    if any, labels the report). ``loads`` holds, per worker, its queued prefill tokens
    (the exact backlog at the routing time) and the blocks of the requests decoding."""

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.i = -1

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        self.i += 1
        return workers[self.i % len(workers)]


class LeastLoaded:
    """Fewest queued prefill blocks plus decode blocks (the route cost with nothing cached)."""

    name = "least_loaded"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        bs = self.block_size
        return min(workers, key=lambda w: (math.ceil(loads[w][0] / bs) + loads[w][1], w))


class IndexRouter:
    """The index's answer over an in-process :class:`~indexer.query.index.PrefixIndex`.

    ``mode``:

    * ``"load"`` (policy ``index``): ``PrefixIndex.route`` with the caller's load, the
      simulator's backlog per worker: its queued prefill tokens, and with ``decode_load``
      its decode blocks too (off by default: in the simulator decoding does not slow
      prefill, so decode blocks in the cost would only mislead it about the TTFT). The
      index records its choice as it does for any route.
    * ``"no_load"`` (``index_no_load``): ``PrefixIndex.route`` with no load: the index's
      own bookkeeping of what it routed and what the engines announced since.
    * ``"cache_only"`` (``index_cache_only``): the cached prefix alone
      (:func:`indexer.query.route.route` without load, over :meth:`~indexer.query.index.PrefixIndex.match`;
      the index records nothing). ``use_load=False`` is this mode.

    The simulator's workers are passed as the candidates in every mode.
    """

    NAMES = {"load": "index", "no_load": "index_no_load", "cache_only": "index_cache_only"}

    def __init__(self, index: PrefixIndex, model: str = "default", prefill_load_scale: float = 1.0,
                 use_load: bool = True, *, mode: str | None = None, decode_load: bool = False) -> None:
        mode = mode or ("load" if use_load else "cache_only")
        if mode not in self.NAMES:
            raise ValueError(f"unknown mode {mode!r}: one of {', '.join(self.NAMES)}")
        self.index = index
        self.model = model
        self.scale = prefill_load_scale
        self.mode = mode
        self.decode_load = decode_load
        self.name = self.NAMES[mode]

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        worker: str
        if self.mode == "cache_only":
            res = self.index.match(tokens, model=self.model)
            known = [(e, r or 0, False) for e, r in map(parse_worker, workers)]
            worker = route(res, known, prefill_load_scale=self.scale)["worker"]
            return worker
        load = None
        if self.mode == "load":
            load = loads if self.decode_load else {w: Load(ld[0], 0) for w, ld in loads.items()}
        worker = self.index.route(tokens, model=self.model, load=load, candidates=workers,
                                  prefill_load_scale=self.scale)["worker"]
        return worker


class HttpRouter:
    """The service's ``POST /v1/route`` answer (keep-alive connection)."""

    name = "index_http"

    def __init__(self, url: str, model: str = "default") -> None:
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)  # type: ignore[arg-type]  # no host: fails here
        self.model = model

    def choose(self, tokens: list[int], workers: list[str], loads: dict[str, Load]) -> str:
        body = json.dumps({"token_ids": tokens, "model": self.model, "candidates": workers,
                           "load": {w: {"active_prefill_tokens": a, "active_decode_blocks": b}
                                    for w, (a, b) in loads.items()}}).encode()
        self.conn.request("POST", "/v1/route", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        doc = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"/v1/route answered {r.status}: {doc}")
        worker: str = doc["worker"]
        return worker

    def close(self) -> None:
        self.conn.close()
