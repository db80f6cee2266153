"""Engine load read from the engines themselves: a scraper of vLLM's Prometheus ``/metrics``.

A router sees only its own routing decisions; with several router replicas, none of
them knows an engine's whole load. vLLM publishes it: per engine core (DP rank) the
gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc``. :class:`MetricsScraper` GETs each configured metrics
URL every ``interval_s`` and hands each DP rank's :class:`EngineLoad` to a callback
(the in-flight estimate corrects itself with it).

* :func:`check_metrics_url` (from :mod:`.engines`): what a metrics URL may be (``http://`` or
  ``https://``);
* :func:`parse_vllm_metrics`: Prometheus text -> ``{dp_rank: RankLoad}`` plus an error
  string; never raises;
* :class:`MetricsScraper`: the daemon thread (targets added and removed at run time).

The wire facts (vLLM ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``):

* every V1 metric has the labels ``["model_name", "engine"]``; a rank's series is
  ``metric.labels(served_model_name, str(engine_idx))`` (``make_per_engine``), so
  ``engine`` is the engine index as decimal ASCII (``engine="0"``, ``engine="1"``);
* the engine indexes are the API server's ``engine_core.engine_ranks_managed``
  (``vllm/v1/engine/core_client.py``): ``range(dp_rank, dp_rank + n)``, global DP
  ranks (an external-LB server started with ``--data-parallel-rank 3`` labels its one
  engine ``engine="3"``); they are the ``dp_rank`` of the KV events;
* V0 (and V1 before the DP labels) had ``model_name`` only: no ``engine`` label means
  rank 0. An empty label value is the same as no label in Prometheus, so ``engine=""``
  is rank 0 too;
* ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` are gauges with
  ``multiprocess_mode="mostrecent"`` (one series per rank even with several API
  server processes); ``vllm:kv_cache_usage_perc`` is a gauge, 0..1 ("1 means 100
  percent usage"), ``mostrecent`` in current vLLM but the default mode ``all`` in
  0.9-0.10, which adds a ``pid`` label per process under multiprocess mode;
* ``vllm:kv_cache_usage_perc`` replaced ``vllm:gpu_cache_usage_perc`` in 0.9 (the old
  name kept as deprecated, then hidden): the old name is read when the new is absent.

So per rank: ``waiting`` and ``running`` are summed over the other labels (several
``model_name`` series); ``kv_usage`` is the maximum (a fraction of one cache: summed
``pid`` series would count it once per process).

Layer: transport (it does I/O); imports only :mod:`.engines`. Standard library HTTP
(``urllib``), ``prometheus_client``'s text parser.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from indexer.wire.engines import MAX_DP_RANK, check_engine_id, check_metrics_url

__all__ = ["EngineLoad", "RankLoad", "Parsed", "ScrapeResult", "ScrapeStats", "MetricsScraper",
           "check_metrics_url", "parse_vllm_metrics", "WAITING", "RUNNING", "KV_USAGE", "GPU_CACHE_USAGE"]

log = logging.getLogger("indexer.transport.engine_metrics")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # the name of KV_USAGE before vLLM 0.9
_NAMES = (WAITING, RUNNING, KV_USAGE, GPU_CACHE_USAGE)
_NAME_PREFIXES = tuple(n.encode() for n in _NAMES)  # what the scraper keeps of a body, line by line

MAX_BODY_BYTES = 4 << 20  # default cap on the bytes read from one response
MAX_COUNT = 1e7  # more waiting or running requests than this on one rank is not a real engine
_MAX_LINE = 16_384  # a sample line of ours longer than this is junk (the parser is Python, per char)
_MAX_LINES = 16_384  # sample lines of ours parsed per exposition, at most
_MAX_ISSUES = 5  # issues spelled out in an error string; the rest are counted
_RANK_RE = re.compile(r"(?:0|[1-9][0-9]{0,3})\Z")  # ASCII digits only, no sign, no leading zero


class RankLoad(NamedTuple):
    """One DP rank's load as its engine reports it (``kv_usage`` None when not exposed)."""

    waiting: float
    running: float
    kv_usage: float | None


class EngineLoad(NamedTuple):
    """One DP rank's load and ``t``, the scraper's clock when the request was queued (at
    or just before it was sent): the engine rendered the values at some instant after
    ``t``, within the request's duration (at most about twice ``timeout_s``)."""

    waiting: float
    running: float
    kv_usage: float | None
    t: float


class Parsed(NamedTuple):
    """What :func:`parse_vllm_metrics` could read, and what was wrong (None: nothing)."""

    loads: dict[int, RankLoad]
    error: str | None


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


# ------------------------------------------------------------------ URLs


# --------------------------------------------------------------- parsing


def _our_line(line: str) -> str | None:
    """The metric name when ``line`` is a sample line of one of ours, else None."""
    if not line.startswith("vllm:"):
        return None
    for name in _NAMES:
        n = len(name)
        if line.startswith(name) and len(line) > n and line[n] in "{ \t":
            return name
    return None


def parse_vllm_metrics(text: str) -> Parsed:
    """Per DP rank, the load in a vLLM ``/metrics`` exposition (Prometheus text format).

    Only the sample lines of ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
    ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` when absent) are read, each
    on its own: a malformed line elsewhere, or one of ours, costs that line only. A rank is
    in the result when both counts are; ``kv_usage`` is None when neither cache metric is.
    Never raises: a bad value (NaN, inf, negative, implausibly large), a bad ``engine``
    label, a duplicate series or a rank with one count only is left out and named in the
    error string."""
    issues: list[str] = []
    n_issues = 0

    def issue(msg: str) -> None:
        nonlocal n_issues
        n_issues += 1
        if len(issues) < _MAX_ISSUES:
            issues.append(msg)

    sums: dict[str, dict[int, float]] = {name: {} for name in _NAMES}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    lines = 0
    try:
        for raw in text.split("\n"):
            name = _our_line(raw)
            if name is None:
                continue
            lines += 1
            if lines > _MAX_LINES:
                issue(f"more than {_MAX_LINES} sample lines of vllm load metrics; the rest ignored")
                break
            if len(raw) > _MAX_LINE:
                issue(f"{name}: a line of {len(raw)} characters ignored")
                continue
            try:
                samples = [s for fam in text_string_to_metric_families(raw.rstrip("\r") + "\n") for s in fam.samples]
            except Exception as e:  # the parser raises ValueError, IndexError, ... on junk
                issue(f"{name}: malformed line ({type(e).__name__})")
                continue
            for s in samples:
                if s.name != name:
                    continue
                key = (name, frozenset(s.labels.items()))
                if key in seen:
                    issue(f"{name}: duplicate series {_labels(s.labels)}")
                    continue
                seen.add(key)
                engine = s.labels.get("engine", "")
                if engine == "":
                    rank = 0
                elif _RANK_RE.match(engine) is None or int(engine) > MAX_DP_RANK:
                    issue(f"{name}: engine label {engine[:20]!r} is not a DP rank 0..{MAX_DP_RANK}")
                    continue
                else:
                    rank = int(engine)
                try:
                    v = float(s.value)
                except (TypeError, ValueError):
                    issue(f"{name}{{engine={engine[:20]!r}}}: value is not a number")
                    continue
                bad = _bad_value(name, v)
                if bad:
                    issue(f"{name}{{engine={engine[:20]!r}}}: {bad}")
                    continue
                per_rank = sums[name]
                if name in (WAITING, RUNNING):
                    per_rank[rank] = per_rank.get(rank, 0.0) + v
                else:
                    per_rank[rank] = max(per_rank.get(rank, 0.0), v)
    except Exception as e:  # never out: whatever went wrong, return what was read
        issue(f"internal parse error ({type(e).__name__})")

    loads: dict[int, RankLoad] = {}
    waiting, running = sums[WAITING], sums[RUNNING]
    for rank in sorted(waiting.keys() | running.keys()):
        if rank not in waiting or rank not in running:
            missing = WAITING if rank not in waiting else RUNNING
            issue(f"rank {rank}: {missing} missing")
            continue
        kv = sums[KV_USAGE].get(rank, sums[GPU_CACHE_USAGE].get(rank))
        loads[rank] = RankLoad(waiting[rank], running[rank], kv)
    if not loads and not n_issues:
        issue(f"no {WAITING} and {RUNNING} samples")
    if not n_issues:
        return Parsed(loads, None)
    more = f" (+{n_issues - len(issues)} more)" if n_issues > len(issues) else ""
    return Parsed(loads, "; ".join(issues) + more)


def _bad_value(name: str, v: float) -> str | None:
    if not math.isfinite(v):
        return f"non-finite value {v}"
    if v < 0:
        return f"negative value {v:g}"
    if name in (WAITING, RUNNING):
        if v > MAX_COUNT:
            return f"implausible request count {v:g}"
    elif v > 1.0:
        return f"usage {v:g} is over 1 (a fraction 0..1)"
    return None


def _labels(labels: dict[str, str]) -> str:
    s = ",".join(f"{k}={v!r}" for k, v in sorted(labels.items()))
    return "{" + (s if len(s) <= 80 else s[:77] + "...") + "}"


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
    """``(our sample lines, error)``: the lines of :data:`_NAMES` in the response, and
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
        if len(rest) > _MAX_LINE:  # junk (parse_vllm_metrics would skip it): drop it up to its end
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
