"""What an ingest with one background thread offers besides ``start``/``stop``: ``running``,
the asyncio twins and the context manager (:class:`~.ingest.Indexer`, the JetStream
replica :class:`~.jetstream.JetStreamIngest`)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Background:
    """A mixin over ``start()``, ``stop()`` and ``self._thread``."""

    _thread: threading.Thread | None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """True while the background thread is alive (False after ``stop()`` or a crash)."""
        return self._thread is not None and self._thread.is_alive()

    async def astart(self) -> None:
        self.start()

    async def astop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
