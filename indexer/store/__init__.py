"""Layer 4, store: the only mutable state, one room per concern.

``tree`` (nodes, the hot loops, C or pure), ``state`` (``IndexState``: models, trees,
workers, counters, the model and tier look-ups), ``inflight`` (routed, not yet
announced), ``removal`` (removals, clears, the node cap), ``lifecycle`` (workers,
stats), ``place`` (stores, placeholders, orphans), ``apply`` (a batch, event by
event), ``snapshot`` (the whole state as one file and back) and ``columns`` (a
snapshot's trees and maps as arrays).

The rooms are mixins stacked in that order, each over the ones before it:
``IndexState`` ← ``Removal`` ← ``Lifecycle`` ← ``Placement`` ← ``Store``. A room
calls only what it or a room below it defines.
"""

from indexer._compat import package_getattr

# ``indexer.store`` was the ``Store`` module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.store", "indexer.store.apply", ("Store",))
