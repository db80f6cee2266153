"""Engine configuration (contract §1) and the Indexer's own status, without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer import EngineConfig, Indexer
from indexer.wire.engines import EndpointPolicy, EndpointRefused, check_engine_id, parse_worker
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


# --------------------------------------------- hardening: ids, worker names, policy

# Unicode digits (superscripts, Arabic-Indic, fullwidth) and control characters: what
# str.isdigit() and a careless split let through.
NASTY = st.sampled_from(["³", "١", "０", "²", "\x00", "\n", "\t", "\x7f", " ", "/", "é", "\u200b", "\U0001f600"])
ID_CHARS = "abcXYZ019._:-"


def _is_id(s: str) -> bool:  # the documented rule, restated independently of the regex
    return (0 < len(s) <= 128 and all(c in ID_CHARS or c.isascii() and c.isalnum() or c == "_" for c in s)
            and s[0] not in ".:-")


@given(st.text(alphabet=st.one_of(st.sampled_from(ID_CHARS), NASTY), max_size=12))
def test_R_SEC_3_engine_ids_follow_the_documented_character_set(s):
    if _is_id(s):
        assert check_engine_id(s) == s
    else:
        with pytest.raises(ValueError, match="engine id"):
            check_engine_id(s)


@given(st.sampled_from(["e", "vllm-0"]), st.text(alphabet=st.one_of(st.sampled_from("0123456789"), NASTY),
                                                 min_size=1, max_size=5))
def test_R_SEC_3_worker_ranks_are_ascii_digits_only(engine, rank):
    ok = rank.isascii() and rank.isdigit() and (rank == "0" or rank[0] != "0") and int(rank) <= 1023
    if ok:
        assert parse_worker(f"{engine}/{rank}") == (engine, int(rank))
    else:
        with pytest.raises(ValueError):
            parse_worker(f"{engine}/{rank}")


def test_R_SEC_3_engine_config_refuses_bad_ids_and_rank_ranges():
    for bad in ("a/0", "", " ", "a b", "a\n", "a\x00", "-a", "x" * 129):
        with pytest.raises(ValueError, match="engine id"):
            EngineConfig(id=bad, endpoint="tcp://h:1")
    with pytest.raises(ValueError, match="DP ranks outside"):
        EngineConfig(id="e", endpoint="tcp://h:1", dp_rank_start=1000, dp_size=30)


def _resolver(table):
    def resolve(host, port):
        if host not in table:
            raise OSError(f"unknown host {host}")
        return [(0, 0, 0, "", (a, 0)) for a in table[host]]
    return resolve


def test_R_SEC_2_endpoint_policy_tcp_only_and_allowlist():
    open_ = EndpointPolicy()
    open_.check(EngineConfig(id="e", endpoint="tcp://anywhere:1"))
    for ep in ("ipc:///etc/passwd", "inproc://x"):
        with pytest.raises(EndpointRefused, match="only tcp"):
            open_.check(EngineConfig(id="e", endpoint=ep))
    EndpointPolicy(tcp_only=False).check(EngineConfig(id="e", endpoint="ipc:///tmp/kv"))  # a library's choice

    pol = EndpointPolicy(["10.0.0.0/8", "*.vllm.svc.cluster.local", "Engine-Host", "fd00::/64"],
                         resolve=_resolver({"split": ["10.1.1.1", "192.168.0.1"], "inside": ["10.9.9.9"],
                                            "v6": ["fd00::5"]}))
    allowed = ["tcp://10.2.3.4:5557", "tcp://a.vllm.svc.cluster.local:5557", "tcp://engine-host:5557",
               "tcp://inside:5557", "tcp://[fd00::7]:5557", "tcp://v6:5557"]
    for ep in allowed:
        pol.check(EngineConfig(id="e", endpoint=ep))
    refused = ["tcp://11.0.0.1:5557", "tcp://vllm.svc.cluster.local:5557", "tcp://evil.com:5557",
               "tcp://a.vllm.svc.cluster.local.evil.com:5557", "tcp://split:5557", "tcp://[fd01::1]:5557",
               "tcp://169.254.169.254:80"]
    for ep in refused:
        with pytest.raises(EndpointRefused, match="allowed_endpoints"):
            pol.check(EngineConfig(id="e", endpoint=ep))
    with pytest.raises(EndpointRefused, match="replay_endpoint"):
        pol.check(EngineConfig(id="e", endpoint="tcp://10.0.0.1:1", replay_endpoint="tcp://11.0.0.1:2"))
    for bad in ("", "a b", "*.", "10.0.0.0/33"):
        with pytest.raises(ValueError, match="allowed_endpoints"):
            EndpointPolicy([bad])


def test_R_SEC_2_the_policy_is_checked_before_anything_is_subscribed():
    pol = EndpointPolicy(["10.0.0.0/8"])
    with pytest.raises(EndpointRefused):
        Indexer([{"id": "cfg", "endpoint": "tcp://11.0.0.1:1"}], endpoint_policy=pol)
    ix = Indexer(endpoint_policy=pol)
    with pytest.raises(EndpointRefused):
        ix.add_engine(id="x", endpoint="tcp://12.0.0.1:1")
    assert ix.engines() == [] and ix.workers() == [] and ix.link == {}
    ix.add_engine(id="y", endpoint="tcp://10.0.0.1:1", dp_size=2)
    assert ix.link == {("y", 0): (False, False), ("y", 1): (False, False)}
    assert ix.changes == {("register", "library"): 1}
    ix.remove_engine("y", via="api")
    assert ix.link == {} and ix.changes == {("register", "library"): 1, ("unregister", "api"): 1}
