"""kv-prefix-indexer core library: vLLM KV events in, longest-prefix matches out.

No web framework here: routers embed this package directly, the service in
``api/`` wraps it. ``Indexer`` and ``EngineConfig`` (live ZMQ ingest) load pyzmq on
first use, so an embedding that only needs ``PrefixIndex`` never imports it. The
layers, one subpackage each, are drawn in ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer import _compat
from indexer.query.answers import MatchResult, WorkerMatch
from indexer.query.index import DEFAULT_CREDITS, PrefixIndex
from indexer.wire.decode import DecodeError, decode_batch
from indexer.wire.keys import KEY_SEED, block_keys, namespace_seed

_compat.install()

if TYPE_CHECKING:  # loaded on first use by __getattr__ below
    from indexer.ingest.live import Indexer
    from indexer.wire.engines import EngineConfig

__all__ = [
    "DEFAULT_CREDITS",
    "KEY_SEED",
    "DecodeError",
    "EngineConfig",
    "Indexer",
    "MatchResult",
    "PrefixIndex",
    "WorkerMatch",
    "block_keys",
    "decode_batch",
    "namespace_seed",
]

_LAZY = {"Indexer": "indexer.ingest.live", "EngineConfig": "indexer.wire.engines"}


def __getattr__(name: str) -> object:
    from importlib import import_module

    if name == "VllmPublisher":
        # The producer side is not part of the consumer's package surface any more; its
        # publisher stays reachable here for one release (CHANGELOG.md, Deprecated).
        import warnings

        warnings.warn("indexer.VllmPublisher moved to indexer.producer.publisher.VllmPublisher; "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return import_module("indexer.producer.publisher").VllmPublisher
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'indexer' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value
    return value
