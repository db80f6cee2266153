"""Both ingests offer :class:`indexer.ingest.base.Ingest`, the one surface the service
holds: the live ZMQ ingest, the relay (a live ingest that publishes) and the JetStream
replica. Nothing here connects anywhere: building an ingest opens no socket.

mypy holds the classes to the protocol statically (``_both_are_ingests`` in
``indexer/ingest/base.py``, and the annotated assignment below when a test file is
type-checked); this holds the objects to it at run time.
"""

from __future__ import annotations

import pytest

from indexer import PrefixIndex
from indexer.ingest.base import Ingest
from indexer.ingest.live import Indexer

jetstream = pytest.importorskip("indexer.ingest.jetstream")  # needs nats-py


def test_both_ingests_are_ingests() -> None:
    live = Indexer()
    replica = jetstream.JetStreamIngest("nats://127.0.0.1:1")
    ingests: list[Ingest] = [live, replica]
    for ing in ingests:
        assert isinstance(ing, Ingest), type(ing).__name__
        assert isinstance(ing.index, PrefixIndex)
        assert ing.error is None and not ing.running
        assert isinstance(ing.counters, dict) and ing.link == {} and ing.changes == {}


def test_the_live_ingest_has_no_counters_and_snapshots_its_index() -> None:
    live = Indexer()
    assert live.counters == {}
    data = live.snapshot({"k": 1})
    assert isinstance(data, bytes) and data[:8] == b"KVISNAP\0"


def test_a_replica_snapshots_to_its_object_store_not_to_its_caller() -> None:
    replica = jetstream.JetStreamIngest("nats://127.0.0.1:1")
    assert replica.snapshot() is None and replica.snapshot({"k": 1}) is None
    assert replica.counters == dict.fromkeys(jetstream.REPLICA_COUNTERS, 0)


def test_a_relay_is_an_ingest_and_keeps_its_own_counters() -> None:
    from indexer.ingest.relay import RELAY_COUNTERS, Relay

    relay = Relay(url="nats://127.0.0.1:1")
    assert isinstance(relay, Ingest)
    assert relay.counters == dict.fromkeys(RELAY_COUNTERS, 0)
