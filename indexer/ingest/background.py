"""What both ingests (:class:`~.ingest.Indexer`, the JetStream replica
:class:`~.jetstream.JetStreamIngest`) offer alike: besides ``start``/``stop``, ``running``,
the asyncio twins and the context manager (:class:`Background`); the queries they
forward to their index (:class:`Queries`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from indexer.query.answers import MatchResult
    from indexer.query.index import PrefixIndex


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


class Queries:
    """The index's queries, forwarded (a mixin over ``self.index`` and ``self.link``)."""

    index: PrefixIndex
    link: dict[tuple[str, int], tuple[bool, bool]]

    def match(self, token_ids: Sequence[int], **kw: Any) -> MatchResult:
        """Same as :meth:`PrefixIndex.match`."""
        return self.index.match(token_ids, **kw)

    def match_by_keys(self, keys: Sequence[int], **kw: Any) -> MatchResult:
        """Same as :meth:`PrefixIndex.match_by_keys`."""
        return self.index.match_by_keys(keys, **kw)

    def route(self, token_ids: Sequence[int], **kw: Any) -> dict[str, Any]:
        """:meth:`PrefixIndex.route` with what the transport knows: a worker that never
        connected ranks last. Records the decision (``record=False``: a dry run)."""
        kw.setdefault("link", self.link)
        return self.index.route(token_ids, **kw)

    def route_done(self, request_id: str) -> bool | None:
        """Same as :meth:`PrefixIndex.route_done`."""
        return self.index.route_done(request_id)

    def stats(self) -> dict[str, Any]:
        return self.index.stats()
