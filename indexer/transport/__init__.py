"""Layer 1, transport: sockets and pollers that bring bytes in and decide nothing.

``sockets`` holds the ZMQ SUB/DEALER pairs and the poll loop (frames to a ``Sub``);
``discovery`` resolves engines by DNS and tells a ``Registry`` what came and went;
``engine_metrics`` scrapes the engines' own ``/metrics`` for their load, which
``vllm_metrics`` reads per DP rank.
"""

from indexer._compat import package_getattr

# ``indexer.transport`` was the ZMQ module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.transport", "indexer.transport.sockets", ("ZmqTransport",))
