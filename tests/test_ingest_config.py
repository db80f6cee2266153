"""Engine configuration (contract §1) and the Indexer's own status, without sockets."""

from __future__ import annotations

import pytest

from indexer import EngineConfig, Indexer
from indexer.producer.publisher import offset_endpoint


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:notaport", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://:5557",
    "udp://127.0.0.1:5557", "127.0.0.1:5557", "ipc://", "tcp://127.0.0.1:*",
])
def test_bad_endpoints_are_rejected_with_a_message(endpoint):
    with pytest.raises(ValueError, match="endpoint"):
        EngineConfig(id="e", endpoint=endpoint)
    with pytest.raises(ValueError, match="replay_endpoint"):
        EngineConfig(id="e", endpoint="tcp://127.0.0.1:5557", replay_endpoint=endpoint)


def test_dp_ranks_must_fit_the_port_range():
    with pytest.raises(ValueError):
        EngineConfig(id="e", endpoint="tcp://127.0.0.1:65535", dp_size=2)
    assert EngineConfig(id="e", endpoint="tcp://127.0.0.1:65534", dp_size=2).dp_size == 2


def test_config_fields_defaults_and_unknown_fields():
    c = EngineConfig(id="e", endpoint="tcp://vllm-0.vllm:5557")
    assert (c.model, c.replay_endpoint, c.topic, c.dp_size) == ("default", None, "", 1)
    ix = Indexer()
    with pytest.raises(ValueError, match="bad engine configuration"):
        ix.add_engine(id="e", endpoint="tcp://h:5557", colour="blue")
    with pytest.raises(ValueError):
        ix.add_engine(id="", endpoint="tcp://h:5557")
    assert ix.engines() == []


def test_vllm_dp_port_rule():
    assert offset_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert offset_endpoint("tcp://h:5557", 3) == "tcp://h:5560"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"  # ephemeral stays ephemeral
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_engines_registered_before_start_are_workers_and_conflicts_raise():
    ix = Indexer([{"id": "a", "endpoint": "tcp://127.0.0.1:5557", "dp_size": 2}])
    assert [(w["engine"], w["dp_rank"], w["endpoint"]) for w in ix.workers()] == [
        ("a", 0, "tcp://127.0.0.1:5557"), ("a", 1, "tcp://127.0.0.1:5558")]
    assert ix.add_engine(id="a", endpoint="tcp://127.0.0.1:5557", dp_size=2).id == "a"  # same: no-op
    with pytest.raises(ValueError, match="already registered"):
        ix.add_engine(id="a", endpoint="tcp://127.0.0.1:6000")
    assert ix.remove_engine("a") is True and ix.workers() == []
    assert ix.remove_engine("a") is False


def test_running_reports_the_ingest_thread():
    ix = Indexer()
    assert ix.running is False and ix.error is None
    with ix:
        assert ix.running is True
    assert ix.running is False


def test_a_config_may_cover_a_dp_rank_range_with_its_own_endpoint():
    ix = Indexer([{"id": "a", "endpoint": "tcp://127.0.0.1:7000"}])
    # Rank 1 of the same engine, on its own endpoint (no port offset from rank 0's).
    ix.add_engine(id="a", endpoint="tcp://127.0.0.1:9100", dp_rank_start=1, dp_size=2)
    assert [(w["dp_rank"], w["endpoint"]) for w in ix.workers()] == [
        (0, "tcp://127.0.0.1:7000"), (1, "tcp://127.0.0.1:9100"), (2, "tcp://127.0.0.1:9101")]
    with pytest.raises(ValueError, match="already registered"):  # overlaps rank 2
        ix.add_engine(id="a", endpoint="tcp://127.0.0.1:9200", dp_rank_start=2)
    with pytest.raises(ValueError, match="already registered"):  # another model
        ix.add_engine(id="a", endpoint="tcp://127.0.0.1:9200", dp_rank_start=3, model="other")
    assert ix.remove_engine("a", dp_rank=2) is True  # the config holding rank 2: ranks 1-2
    assert [w["dp_rank"] for w in ix.workers()] == [0]
    assert ix.remove_engine("a", dp_rank=5) is False
    with pytest.raises(ValueError, match="dp_rank_start"):
        EngineConfig(id="a", endpoint="tcp://h:1", dp_rank_start=-1)


def test_R_BAD_3_max_workers_bounds_subscriptions():
    ix = Indexer([{"id": "a", "endpoint": "tcp://127.0.0.1:7000", "dp_size": 3}], max_workers=4)
    with pytest.raises(ValueError, match="max_workers=4"):
        ix.add_engine(id="b", endpoint="tcp://127.0.0.1:8000", dp_size=2)
    assert [w["engine"] for w in ix.workers()] == ["a", "a", "a"]
    ix.add_engine(id="b", endpoint="tcp://127.0.0.1:8000")
    assert len(ix.workers()) == 4
