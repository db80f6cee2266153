"""kv-prefix-indexer core library: vLLM KV events in, longest-prefix matches out.

No web framework here: routers embed this package directly, the service in
``api/`` wraps it. ``Indexer``, ``EngineConfig`` and ``VllmPublisher`` (live ZMQ
ingest) load pyzmq on first use, so an embedding that only needs
``PrefixIndex`` never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .index import DEFAULT_CREDITS, PrefixIndex
from .keys import KEY_SEED, block_keys, namespace_seed
from .result import MatchResult, WorkerMatch
from .wire import DecodeError, decode_batch

if TYPE_CHECKING:  # loaded on first use by __getattr__ below
    from .engines import EngineConfig
    from .ingest import Indexer
    from .producer.publisher import VllmPublisher

__all__ = [
    "DEFAULT_CREDITS",
    "KEY_SEED",
    "DecodeError",
    "EngineConfig",
    "Indexer",
    "MatchResult",
    "PrefixIndex",
    "VllmPublisher",
    "WorkerMatch",
    "block_keys",
    "decode_batch",
    "namespace_seed",
]

_LAZY = {"Indexer": "ingest", "EngineConfig": "engines", "VllmPublisher": "producer.publisher"}


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'indexer' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
