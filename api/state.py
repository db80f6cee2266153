"""The service's durable state: the snapshot in ``state_dir``, a peer's at start.

At start (:meth:`StateKeeper.initial`): the snapshot file ``STATE_DIR/index.snap`` if
there is one, else a peer's ``GET /v1/snapshot`` when ``bootstrap_from`` is set. A
snapshot that cannot be read is refused with one log line and a counted metric; the
file is moved aside (``index.snap.refused-<unix time>``) and the service starts
empty: it never fails to start because of its own state (R-DUR-3).

While running, a thread writes the snapshot every ``snapshot_interval_s`` (the index
lock is held while the index is read, not while the file is written), and
:meth:`StateKeeper.final` writes it once more at shutdown (SIGTERM), after ingest has
stopped, so it is the last state exactly. Writes are atomic (``write_atomic``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from api.settings import Settings
from indexer.store.snapshot import Snapshot, SnapshotError, loads, write_atomic

log = logging.getLogger("kv_indexer.state")

FILE = "index.snap"
# A peer's snapshot is read whole into memory; beyond this it is refused (a peer that
# streams forever must not exhaust ours). 10^7 entries are ~0.3 GB.
MAX_PEER_BYTES = 16 << 30


class StateKeeper:
    """Loads the state at start and writes it while the service runs (see the module)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.path = os.path.join(settings.state_dir, FILE) if settings.state_dir else None
        self.interval_s = settings.snapshot_interval_s
        self.dump: Callable[[], bytes | None] | None = None
        self.version: Callable[[], object] | None = None
        self._written: object = None  # version() at the last write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()  # the periodic and the final write never overlap
        # {(source, outcome, reason): n}; source "state_dir" | "peer"
        self.loads: dict[tuple[str, str, str], int] = {}
        self.writes: dict[str, int] = {}  # outcome "ok" | "error" -> n
        self.last_bytes = 0
        self.last_dump_s = 0.0  # read + encoded (the index lock is held for the read only)
        self.last_write_s = 0.0  # file written and renamed
        self.last_ok_unix = 0.0
        self.restored_from: str | None = None

    # --------------------------------------------------------------- start

    def initial(self) -> Snapshot | None:
        """The snapshot to start from (the state dir's, else a peer's), or None."""
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            snap = self._from_file(self.path)
            if snap is not None:
                return snap
        if self.settings.bootstrap_from:
            return self._from_peer(self.settings.bootstrap_from)
        return None

    def _count_load(self, source: str, outcome: str, reason: str = "") -> None:
        k = (source, outcome, reason)
        self.loads[k] = self.loads.get(k, 0) + 1

    def _from_file(self, path: str) -> Snapshot | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.error("state: cannot read %s (%s); starting empty", path, e.strerror or e)
            self._count_load("state_dir", "error", "io")
            return None
        t0 = time.perf_counter()
        try:
            snap = loads(data)
        except SnapshotError as e:
            aside = f"{path}.refused-{int(time.time())}"
            try:
                os.replace(path, aside)
            except OSError:
                aside = "(could not be moved aside)"
            log.error("state: %s: %s; kept as %s, starting empty", path, e, aside)
            self._count_load("state_dir", "refused", e.reason)
            return None
        log.info("state: read %s (%.1f MB, written %.0f s ago) in %.2f s", path, len(data) / 1e6,
                 max(0.0, time.time() - snap.created), time.perf_counter() - t0)
        self.restored_from = "state_dir"
        return snap

    def _from_peer(self, url: str) -> Snapshot | None:
        req = urllib.request.Request(url.rstrip("/") + "/v1/snapshot")
        if self.settings.api_token:
            req.add_header("Authorization", f"Bearer {self.settings.api_token}")
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - http(s) only, checked in settings
                data = r.read(MAX_PEER_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.error("state: bootstrap from %s failed (%s); starting empty", url, getattr(e, "reason", None) or e)
            self._count_load("peer", "error", "http" if isinstance(e, urllib.error.HTTPError) else "connect")
            return None
        if len(data) > MAX_PEER_BYTES:
            log.error("state: bootstrap from %s: more than %d bytes; starting empty", url, MAX_PEER_BYTES)
            self._count_load("peer", "refused", "too_large")
            return None
        try:
            snap = loads(data)
        except SnapshotError as e:
            log.error("state: bootstrap from %s: %s; starting empty", url, e)
            self._count_load("peer", "refused", e.reason)
            return None
        log.info("state: copied %s's state (%.1f MB) in %.2f s", url, len(data) / 1e6, time.perf_counter() - t0)
        self.restored_from = "peer"
        return snap

    def restored(self, ok: bool, reason: str = "") -> None:
        """Count how putting the snapshot into the index went."""
        if self.restored_from is not None:
            self._count_load(self.restored_from, "ok" if ok else "refused", reason)

    # ------------------------------------------------------------- running

    def start(self, dump: Callable[[], bytes | None], version: Callable[[], object] | None = None) -> None:
        """Write the snapshot every ``snapshot_interval_s`` (with a state dir and an interval).
        ``version()`` changes whenever the state may have: an interval where it did not
        skips the write (and the index lock it would hold)."""
        self.dump = dump
        self.version = version
        if self.path is None or self.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kvidx-snapshot", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.version is not None and self.writes.get("ok") and self.version() == self._written:
                self.writes["unchanged"] = self.writes.get("unchanged", 0) + 1
                continue
            self.write()

    def write(self) -> bool:
        """Dump the index and write the file atomically; False (logged, counted) on failure."""
        if self.path is None or self.dump is None:
            return False
        with self._write_lock:
            try:
                t0 = time.perf_counter()
                v = self.version() if self.version is not None else None  # before the cut: never newer
                data = self.dump()
                if data is None:  # this ingest keeps no snapshot of its own: nothing to write
                    return False
                t1 = time.perf_counter()
                write_atomic(self.path, data)
                t2 = time.perf_counter()
            except Exception as e:  # a full disk, a bug: say so, keep serving
                log.error("state: snapshot to %s failed: %s", self.path, e)
                self.writes["error"] = self.writes.get("error", 0) + 1
                return False
            self.writes["ok"] = self.writes.get("ok", 0) + 1
            self._written = v
            self.last_bytes, self.last_dump_s, self.last_write_s = len(data), t1 - t0, t2 - t1
            self.last_ok_unix = time.time()
            return True

    def final(self) -> None:
        """Stop the periodic writer and write the last state (call after ingest stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.path is not None and self.write():
            log.info("state: wrote %s (%.1f MB) at shutdown", self.path, self.last_bytes / 1e6)


class NoStateDir(StateKeeper):
    """The keeper of a service whose state is kept elsewhere (a JetStream replica: the
    relay's object store). Reads and writes nothing; its counters stay zero, so the
    metrics read it like any keeper."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.path = None

    def initial(self) -> Snapshot | None:
        return None

    def start(self, dump: Callable[[], bytes | None], version: Callable[[], object] | None = None) -> None:
        pass

    def final(self) -> None:
        pass
