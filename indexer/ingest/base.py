"""``Ingest``: what every ingest offers the code that embeds it (the service, a router).

Two implementations: :class:`~indexer.ingest.live.Indexer` (engines over ZMQ) and
:class:`~indexer.ingest.jetstream.JetStreamIngest` (a replica of the shared event log).
The service holds one as ``Service.ingest`` and never asks which it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from indexer.transport.discovery import Registry

if TYPE_CHECKING:
    from indexer.ingest.jetstream import JetStreamIngest
    from indexer.ingest.live import Indexer
    from indexer.query.answers import MatchResult
    from indexer.query.index import PrefixIndex

__all__ = ["Ingest"]


@runtime_checkable
class Ingest(Registry, Protocol):
    """One index fed from outside by a background thread: a discovery :class:`Registry`
    (``index``, ``engines``, ``add_engine``, ``remove_engine``) and the rest below."""

    index: PrefixIndex
    # (engine, dp_rank) -> (live socket connected, replay socket connected); a worker
    # that never connected ranks last in a route.
    link: dict[tuple[str, int], tuple[bool, bool]]
    # (operation, via) -> count of engines added and removed.
    changes: dict[tuple[str, str], int]
    # Why the background thread died, None while it runs or before it started.
    error: str | None
    # The ingest's own counters by name (empty where it has none), exported as metrics.
    counters: dict[str, int]

    @property
    def running(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def astart(self) -> None: ...

    async def astop(self) -> None: ...

    def resync(self, engine_id: str) -> None: ...

    def workers(self) -> list[dict[str, Any]]: ...

    def snapshot(self, meta: dict[str, Any] | None = None) -> bytes | None:
        """The whole index as snapshot bytes, or None where snapshots are kept elsewhere
        (a JetStream replica writes its own to the object store)."""
        ...

    def match(self, token_ids: Sequence[int], **kw: Any) -> MatchResult: ...

    def route(self, token_ids: Sequence[int], **kw: Any) -> dict[str, Any]: ...

    def route_done(self, request_id: str) -> bool | None: ...

    def stats(self) -> dict[str, Any]: ...


if TYPE_CHECKING:

    def _both_are_ingests(live: Indexer, replica: JetStreamIngest) -> tuple[Ingest, Ingest]:
        """Never called: mypy holds both ingests to the protocol here."""
        return live, replica
