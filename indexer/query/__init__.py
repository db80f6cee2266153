"""Layer 5, query: reads of the store and the answers built from them.

``match`` (``Query``: the lock, the block keys, predictions and routes),
``prefixes`` (one model's longest prefixes per tier and group), ``answers`` (answer types
and ranking), ``route`` (best replica under load), ``explain`` (one prompt block by
block) and ``index`` (``PrefixIndex``: the store and the queries as one object).
"""

from indexer._compat import package_getattr

# ``indexer.query`` was the ``Query`` module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.query", "indexer.query.match", ("Query",))
