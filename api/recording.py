"""The service's recording (``record_dir``): a :class:`~indexer.ingest.record.Recorder`
attached to the index before the service serves, its ``kvi_record_*`` metrics, and what
the live page's time slider replays (``docs/record.md``). Without ``record_dir``,
:class:`NoRecording` (records nothing, exports nothing)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from api.settings import Settings
from indexer import PrefixIndex
from indexer.ingest.recfile import segments
from indexer.ingest.record import Recorder
from indexer.ingest.replay import replay

log = logging.getLogger("kv_indexer.api")

NS = "kvi"


class NoRecording:
    """No ``record_dir``: nothing recorded."""

    directory: str | None = None

    def at(self, wall: float) -> dict[str, Any] | None:
        return None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def stats(self) -> dict[str, Any] | None:
        return None

    def families(self) -> Iterator[Any]:
        return iter(())


class Recording:
    """``record_dir`` set: the index recorded from the service's start. A directory that
    cannot be made or written stops nothing but the recording (logged, counted as
    ``unwritable``)."""

    def __init__(self, settings: Settings, index: PrefixIndex) -> None:
        self.directory: str | None = settings.record_dir
        assert self.directory is not None
        self.recorder = Recorder(self.directory, max_bytes=settings.record_max_bytes,
                                 max_age_s=settings.record_max_age_s, segment_bytes=settings.record_segment_bytes,
                                 segment_s=settings.record_segment_s, tokens=settings.record_tokens)
        try:
            self.recorder.attach(index)
        except OSError as e:
            self.recorder.stopped = "unwritable"
            self.recorder.errors["unwritable"] = 1
            log.error("recording to %s not started (unwritable: %s); the service goes on without it",
                      self.directory, e)
        else:
            log.info("recording the index to %s (tokens %s)", self.directory, settings.record_tokens)

    def start(self) -> None:
        if self.recorder.stopped is None:
            self.recorder.start()

    def stop(self) -> None:
        self.recorder.stop()

    def stats(self) -> dict[str, Any] | None:
        """The recorder's counters, and since when the recording reaches back (unix s)."""
        st = self.recorder.stats()
        segs = segments(self.directory) if self.directory and os.path.isdir(self.directory) else []
        st["first_wall"] = segs[0][1] / 1000 if segs else None
        return st

    def at(self, wall: float) -> dict[str, Any]:
        """The fleet and the routing decisions as the recording has them at unix time
        ``wall`` (what the page's time slider shows): the recording so far, replayed up
        to there."""
        self.recorder.flush()
        rep = replay(self.directory, until_wall=wall, check=False,  # type: ignore[arg-type]  # set in __init__
                     nearest_base=True)
        idx = rep.index
        return {
            "t": wall, "at_call": rep.at_op, "at_wall": rep.at_wall, "first_wall": rep.first_wall, "now": time.time(),
            "workers": [] if idx is None else [
                {k: w[k] for k in ("engine", "dp_rank", "model", "stale", "stale_reason", "last_seq", "batches",
                                   "restarts", "resident_blocks", "in_flight")} for w in idx.workers()],
            "decisions": list(rep.decisions)[-20:],
            "damage": [str(d) for d in rep.damage],
        }

    def families(self) -> Iterator[Any]:
        s = self.recorder.stats()
        yield GaugeMetricFamily(f"{NS}_record_active", "1 while the index is being recorded (record_dir).",
                                value=1 if s["recording"] else 0)
        yield CounterMetricFamily(f"{NS}_record_calls", "Index calls recorded (batches, routes, matches, ...).",
                                  value=s["records"])
        yield CounterMetricFamily(f"{NS}_record_bytes", "Bytes written to the recording's segments.",
                                  value=s["bytes_written"])
        yield CounterMetricFamily(f"{NS}_record_segments", "Segments begun.", value=s["segments_started"])
        dropped = CounterMetricFamily(f"{NS}_record_segments_dropped", "Oldest segments deleted, by cap (size, age).",
                                      labels=["reason"])
        for why, n in sorted(s["segments_dropped"].items()):
            dropped.add_metric([why], n)
        yield dropped
        err = CounterMetricFamily(f"{NS}_record_errors", "Recording stopped, by reason (disk_full, io_error, "
                                  "unwritable, overflow); the service goes on serving.", labels=["reason"])
        for why in ("disk_full", "io_error", "unwritable", "overflow"):
            err.add_metric([why], s["errors"].get(why, 0))
        yield err
        yield GaugeMetricFamily(f"{NS}_record_pending", "Calls queued for the recording's writer.",
                                value=s["pending"])


def recording_for(settings: Settings, index: PrefixIndex) -> NoRecording | Recording:
    return Recording(settings, index) if settings.record_dir else NoRecording()
