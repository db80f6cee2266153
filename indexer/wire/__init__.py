"""Layer 3, decode, and the foundations beside it: what vLLM sends and how we key it.

``events`` declares every event field once; ``engines`` the engine addressing facts
(endpoints, the DP port rule, the replay end marker, the endpoint allowlist);
``decode`` turns a batch payload into typed events; ``keys`` hashes prompts into the
block keys the trees are keyed by. Imports nothing of ours but ``indexer._native``.
"""

from indexer._compat import package_getattr

# ``indexer.wire`` was the decoder module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.wire", "indexer.wire.decode", (
    "STORED", "REMOVED", "CLEARED", "DecodeError", "DecodedBatch", "decode_batch", "raw_array_len", "decode_tokens",
    "token_bytes", "encode_stored", "decode_stored", "decode_event", "scan_gpu_batch",
))
