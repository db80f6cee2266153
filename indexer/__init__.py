"""kv-prefix-indexer core library: vLLM KV events in, longest-prefix matches out.

No web framework here: routers embed this package directly, the service in
``api/`` wraps it.
"""

from .index import DEFAULT_CREDITS, PrefixIndex
from .ingest import EngineConfig, Indexer
from .publisher import VllmPublisher
from .keys import KEY_SEED, block_keys, namespace_seed
from .result import MatchResult, WorkerMatch
from .wire import DecodeError, decode_batch

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
