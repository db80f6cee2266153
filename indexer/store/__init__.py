"""Layer 4, store: the only mutable state, one room per concern.

``tree`` (nodes, the hot loops, C or pure), ``state`` (``IndexState``: models, trees,
workers, counters), ``inflight`` (routed, not yet announced), ``apply`` (stores,
placeholders, orphans), ``removal`` (removals, clears, the node cap), ``lifecycle``
(workers, stats) and ``snapshot`` (the whole state as one file and back).
"""

from indexer._compat import package_getattr

# ``indexer.store`` was the ``Store`` module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.store", "indexer.store.apply", ("Store",))
