"""Engine load read from the engines themselves: a scraper of vLLM's Prometheus ``/metrics``.

A router sees only its own routing decisions; with several router replicas, none of
them knows an engine's whole load. vLLM publishes it: per engine core (DP rank) the
gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc``. :class:`MetricsScraper` GETs each configured metrics
URL every ``interval_s`` and hands each DP rank's :class:`EngineLoad` to a callback
(the in-flight estimate corrects itself with it).

* :func:`check_metrics_url` (from :mod:`.engines`): what a metrics URL may be (``http://`` or
  ``https://``);
* :func:`parse_vllm_metrics` (from :mod:`.vllm_metrics`, with the wire facts it reads by):
  Prometheus text -> ``{dp_rank: RankLoad}`` plus an error string; never raises;
* :class:`MetricsScraper`: the daemon thread (targets added and removed at run time).

Layer: transport (it does I/O); imports only :mod:`.vllm_metrics` and
:mod:`indexer.wire.engines`. Standard library HTTP (``urllib``).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from indexer.transport.vllm_metrics import (
    GPU_CACHE_USAGE,
    KV_USAGE,
    MAX_LINE,
    NAMES,
    RUNNING,
    WAITING,
    Parsed,
    RankLoad,
    parse_vllm_metrics,
)
from indexer.wire.engines import MAX_DP_RANK, check_engine_id, check_metrics_url

__all__ = ["EngineLoad", "RankLoad", "Parsed", "ScrapeResult", "ScrapeStats", "MetricsScraper",
           "check_metrics_url", "parse_vllm_metrics", "WAITING", "RUNNING", "KV_USAGE", "GPU_CACHE_USAGE"]

log = logging.getLogger("indexer.transport.engine_metrics")

_NAME_PREFIXES = tuple(n.encode() for n in NAMES)  # what the scraper keeps of a body, line by line

MAX_BODY_BYTES = 4 << 20  # default cap on the bytes read from one response


class EngineLoad(NamedTuple):
    """One DP rank's load and ``t``, the scraper's clock when the request was queued (at
    or just before it was sent): the engine rendered the values at some instant after
    ``t``, within the request's duration (at most about twice ``timeout_s``)."""

    waiting: float
    running: float
    kv_usage: float | None
    t: float


class ScrapeResult(NamedTuple):
    """One target's scrape: the loads delivered (ranks outside the target's left out)
    and the error (None when the scrape was complete and clean)."""

    engine_id: str
    url: str
    loads: dict[int, EngineLoad]
    error: str | None


class ScrapeStats(NamedTuple):
    """An engine's scrape counters (over all its targets, since it was first set)."""

    scrapes: int  # scrapes finished, failed ones included
    errors: int  # scrapes that failed or were partial (``on_error`` was called)
    last_error: str | None  # the reason of the latest error (kept after later successes)
    last_ok: float | None  # the clock at the latest clean scrape


# ------------------------------------------------------------------ HTTP


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are refused (a 3xx is an error): the URL that was checked is the one read."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        return None


def _opener() -> urllib.request.OpenerDirector:
    # No proxies from the environment (the engines are scraped directly, as Prometheus
    # does) and no redirects.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _fetch(opener: urllib.request.OpenerDirector, url: str, timeout_s: float,
           max_bytes: int) -> tuple[str, str | None]:
    """``(our sample lines, error)``: the lines of :data:`~.vllm_metrics.NAMES` in the response, and
    what went wrong (None: a whole 200 response). Never raises. Each socket operation
    waits at most ``timeout_s``, and reading stops once ``timeout_s`` has passed since
    the start (a server trickling bytes): at most about twice ``timeout_s`` in all, DNS
    resolution aside (``getaddrinfo`` cannot be timed out)."""
    start = time.monotonic()
    kept: list[bytes] = []
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity",
                                               "User-Agent": "kv-prefix-indexer"})
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            if resp.status != 200:
                return "", f"HTTP {resp.status}"
            enc = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
            if enc != "identity":
                return "", f"unsupported Content-Encoding {enc[:40]!r}"
            length = resp.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > max_bytes:
                return "", f"body of {int(length)} bytes is over the {max_bytes}-byte cap"
            total = 0
            rest = b""
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                total += len(chunk)
                if total > max_bytes:
                    # The complete lines read so far are kept: their values are exact.
                    chunk = chunk[:len(chunk) - (total - max_bytes)]
                    _keep(rest + chunk, kept, final=False)
                    return _text(kept), f"body over the {max_bytes}-byte cap"
                rest = _keep(rest + chunk, kept, final=False)
                if time.monotonic() - start > timeout_s:
                    return _text(kept), f"timed out after {timeout_s:g} s reading the body"
            _keep(rest, kept, final=True)
            return _text(kept), None
    except urllib.error.HTTPError as e:
        e.close()
        return "", f"HTTP {e.code}"
    except urllib.error.URLError as e:
        return "", _reason(e.reason)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return "", _reason(e)
    except Exception as e:  # never out of here: the scraper's thread must survive any server
        return "", f"unexpected {type(e).__name__}: {str(e)[:120]}"


def _keep(buf: bytes, kept: list[bytes], *, final: bool) -> bytes:
    """Append the complete lines of ``buf`` that are ours to ``kept``; return the partial
    last line (or, when ``final``, keep it too)."""
    if final:
        lines, rest = buf.split(b"\n"), b""
    else:
        lines = buf.split(b"\n")
        rest = lines.pop()
        if len(rest) > MAX_LINE:  # junk (parse_vllm_metrics would skip it): drop it up to its end
            rest = b"\x00"  # a line starting so is never kept
    kept.extend(ln for ln in lines if ln.startswith(_NAME_PREFIXES))
    return rest


def _text(kept: list[bytes]) -> str:
    return b"\n".join(kept).decode("utf-8", "replace")


def _reason(e: object) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    s = str(e) or type(e).__name__
    return f"{type(e).__name__}: {s[:160]}" if isinstance(e, BaseException) else s[:160]


# ---------------------------------------------------------------- scraper


class _Target:
    __slots__ = ("engine_id", "url", "ranks")

    def __init__(self, engine_id: str, url: str, ranks: frozenset[int] | None) -> None:
        self.engine_id = engine_id
        self.url = url
        self.ranks = ranks


class _Counters:
    __slots__ = ("scrapes", "errors", "last_error", "last_ok", "failing")

    def __init__(self) -> None:
        self.scrapes = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_ok: float | None = None
        self.failing = False  # the latest scrape had an error (warn once per failing stretch)


def _overlap(a: frozenset[int] | None, b: frozenset[int] | None) -> bool:
    return a is None or b is None or not a.isdisjoint(b)


class MetricsScraper:
    """A daemon thread that scrapes each target's vLLM ``/metrics`` every ``interval_s``.

    A target is an engine id, its metrics URL and the DP ranks to report (None: every
    rank the engine exposes). One engine may have several targets with disjoint ranks
    (one per DP rank, as Dynamo registers them); a new target replaces the engine's
    targets whose ranks overlap its own.

    Each round GETs every target at once (up to ``max_parallel`` at a time; each
    request bounded by ``timeout_s``, its body by ``max_bytes``), then, on the scraper's
    thread (or the caller's, for :meth:`scrape_once`) and one at a time:
    ``on_load(engine_id, dp_rank, EngineLoad)`` for each rank read, and
    ``on_error(engine_id, reason)`` when the scrape failed or was partial (a bad line,
    a configured rank missing, a body over the cap: the ranks read are still reported).
    A callback that raises is logged and does not stop the thread. Callbacks run
    without any lock of the scraper held: they may call :meth:`set_target` and
    :meth:`remove_target`. A target removed during a round gets no callback once its
    removal has returned, except one already being dispatched.
    """

    def __init__(self, on_load: Callable[[str, int, EngineLoad], None],
                 on_error: Callable[[str, str], None] | None = None, *,
                 interval_s: float = 2.0, timeout_s: float = 1.0, max_bytes: int = MAX_BODY_BYTES,
                 max_parallel: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        self.on_load = on_load
        self.on_error = on_error
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self.max_parallel = int(max_parallel)
        self.clock = clock
        self.error: str | None = None  # set if the scraper thread died (see ``running``)
        self.rounds = 0  # rounds finished (abandoned ones by stop() not counted)
        self.callback_errors = 0
        self._lock = threading.Lock()
        self._targets: dict[str, list[_Target]] = {}
        self._counters: dict[str, _Counters] = {}
        self._thread: threading.Thread | None = None  # the last one started (kept after stop: see running)
        self._stopping: cf.Future[None] | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._opener = _opener()

    # ------------------------------------------------------------ targets

    def set_target(self, engine_id: str, url: str, ranks: Iterable[int] | None = None) -> None:
        """Scrape ``url`` for ``engine_id``, reporting ``ranks`` (None: every rank found).

        Replaces the engine's targets whose ranks overlap ``ranks``. ValueError on a bad
        engine id, URL or rank (0..1023) or an empty ``ranks``."""
        check_engine_id(engine_id)
        check_metrics_url(url)
        rs: frozenset[int] | None = None
        if ranks is not None:
            rs = frozenset(ranks)
            if not rs:
                raise ValueError(f"engine {engine_id}: ranks is empty (None means every rank)")
            for r in rs:
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= MAX_DP_RANK:
                    raise ValueError(f"engine {engine_id}: DP rank {r!r} is not 0..{MAX_DP_RANK}")
        with self._lock:
            kept = [t for t in self._targets.get(engine_id, ()) if not _overlap(t.ranks, rs)]
            self._targets[engine_id] = [*kept, _Target(engine_id, url, rs)]
            self._counters.setdefault(engine_id, _Counters())

    def remove_target(self, engine_id: str, ranks: Iterable[int] | None = None) -> int:
        """Stop scraping the engine's targets whose ranks overlap ``ranks`` (None: all of
        them); the number removed. The engine's counters go with its last target."""
        rs = None if ranks is None else frozenset(ranks)
        with self._lock:
            old = self._targets.get(engine_id, [])
            kept = [t for t in old if not _overlap(t.ranks, rs)]
            if kept:
                self._targets[engine_id] = kept
            else:
                self._targets.pop(engine_id, None)
                self._counters.pop(engine_id, None)
            return len(old) - len(kept)

    def targets(self) -> dict[str, list[tuple[str, tuple[int, ...] | None]]]:
        """``{engine_id: [(url, ranks or None), ...]}``, a copy."""
        with self._lock:
            return {e: [(t.url, None if t.ranks is None else tuple(sorted(t.ranks))) for t in ts]
                    for e, ts in self._targets.items()}

    def stats(self) -> dict[str, ScrapeStats]:
        """Per engine with a target: scrapes, errors, the last error, the last clean scrape."""
        with self._lock:
            return {e: ScrapeStats(c.scrapes, c.errors, c.last_error, c.last_ok) for e, c in self._counters.items()}

    # ---------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        """The thread last started is alive (after a :meth:`stop` whose join timed out, still True)."""
        t = self._thread
        return t is not None and t.is_alive()

    def start(self) -> None:
        """Start the scraper thread (the first round at once); a no-op when started and not stopped."""
        with self._lock:
            if self._stopping is not None and not self._stopping.done():
                return
            self._stopping = cf.Future()
            self._thread = threading.Thread(target=self._run, args=(self._stopping,), name="kvidx-metrics",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread: it wakes at once, a round under way is abandoned (no more
        callbacks from it; its requests end on their own within their timeouts)."""
        with self._lock:
            t, stopping, pool = self._thread, self._stopping, self._pool
            self._pool = None
            if stopping is not None and not stopping.done():
                stopping.set_result(None)  # under the lock: no pool is made for its round after this
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def scrape_once(self) -> list[ScrapeResult]:
        """One round now, on the caller's thread (the callbacks too): what each target gave."""
        return self._round(None) or []

    # -------------------------------------------------------------- rounds

    def _run(self, stopping: cf.Future[None]) -> None:
        try:
            while not stopping.done():
                began = time.monotonic()
                self._round(stopping)
                delay = self.interval_s - (time.monotonic() - began)
                if delay > 0:
                    cf.wait([stopping], timeout=delay)
        except BaseException as e:  # pragma: no cover - a bug: say so where status is read
            self.error = f"{type(e).__name__}: {e}"
            log.exception("metrics scraper thread died")

    def _ensure_pool(self, stopping: cf.Future[None] | None) -> cf.ThreadPoolExecutor | None:
        with self._lock:
            if stopping is not None and stopping.done():
                return None
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.max_parallel, thread_name_prefix="kvidx-metrics-get")
            return self._pool

    def _round(self, stopping: cf.Future[None] | None) -> list[ScrapeResult] | None:
        with self._lock:
            targets = [t for ts in self._targets.values() for t in ts]
        if not targets:
            with self._lock:
                self.rounds += 1
            return []
        pool = self._ensure_pool(stopping)
        if pool is None:
            return None
        futs: dict[cf.Future[tuple[str, str | None]], tuple[_Target, float]] = {}
        try:
            for t in targets:
                t0 = self.clock()
                futs[pool.submit(_fetch, self._opener, t.url, self.timeout_s, self.max_bytes)] = (t, t0)
        except RuntimeError:  # the pool was shut down under us: stop() ran
            return None
        if stopping is None:
            cf.wait(futs)
        else:
            pending: set[cf.Future[Any]] = {*futs, stopping}
            while len(pending) > 1:  # more than ``stopping`` itself
                _, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                if stopping.done():
                    return None  # stop(): abandon the round
        results = []
        for fut, (target, t0) in futs.items():
            if stopping is not None and stopping.done():
                return None
            try:
                text, err = fut.result()
            except Exception as e:  # _fetch never raises; a cancelled future does
                text, err = "", f"{type(e).__name__}"
            results.append(self._deliver(target, t0, text, err))
        with self._lock:
            self.rounds += 1
        return results

    def _deliver(self, target: _Target, t0: float, text: str, fetch_err: str | None) -> ScrapeResult:
        eid = target.engine_id
        loads: dict[int, EngineLoad] = {}
        errors = [] if fetch_err is None else [fetch_err]
        # A failed request with nothing read is its own reason; a cut body (over the cap,
        # timed out) still gives the ranks it holds whole, and says what it lacks.
        if text or fetch_err is None:
            parsed = parse_vllm_metrics(text)
            for rank, rl in parsed.loads.items():
                if target.ranks is None or rank in target.ranks:
                    loads[rank] = EngineLoad(rl.waiting, rl.running, rl.kv_usage, t0)
            if fetch_err is None or parsed.loads:
                if parsed.error is not None:
                    errors.append(parsed.error)
                missing = sorted(target.ranks - loads.keys()) if target.ranks is not None else []
                if missing:
                    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                    errors.append(f"no load for DP ranks {shown}")
        err = "; ".join(errors) if errors else None
        with self._lock:
            if target not in self._targets.get(eid, ()):
                return ScrapeResult(eid, target.url, {}, err)  # removed or replaced meanwhile
            c = self._counters[eid]
            c.scrapes += 1
            newly_failing = err is not None and not c.failing
            c.failing = err is not None
            if err is None:
                c.last_ok = t0
            else:
                c.errors += 1
                c.last_error = err
        if err is not None:
            (log.warning if newly_failing else log.debug)("metrics of engine %s (%s): %s", eid, target.url, err)
        for rank in sorted(loads):
            self._call(self.on_load, eid, rank, loads[rank])
        if err is not None and self.on_error is not None:
            self._call(self.on_error, eid, err)
        return ScrapeResult(eid, target.url, loads, err)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            with self._lock:
                self.callback_errors += 1
            log.exception("metrics scraper callback %r failed", getattr(fn, "__name__", fn))
