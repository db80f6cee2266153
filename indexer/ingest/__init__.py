"""The ingests: what feeds a ``PrefixIndex`` from outside, each an ``Ingest``.

``base`` (``Ingest``: the protocol both offer), ``live`` (``Indexer``: ZMQ transport →
sequencer → index, one thread), ``jetstream`` (``JetStreamIngest``: a replica applying
the shared event log) with ``replica_snapshots`` (its snapshots in the object store),
``relay`` (the engines' sequenced batches published to that log), ``eventlog`` (the
log's messages and set-up) and ``background`` (the thread, ``with`` and ``astart``
both share).
"""

from indexer._compat import package_getattr

# ``indexer.ingest`` was the ``Indexer`` module before it became this package.
__getattr__ = package_getattr(__name__, "indexer.ingest", "indexer.ingest.live", ("Indexer",))
