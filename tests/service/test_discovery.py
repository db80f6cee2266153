"""Engine discovery by DNS (a headless Service): addresses become engines, vanished ones go
after a grace period, resolution failures change nothing. An injected resolver and clock
drive it; the service test resolves a real name (localhost) with the standard library."""

from __future__ import annotations

import socket

import pytest

from evkit import store, toks
from indexer.transport.discovery import DnsDiscovery, resolve_addresses
from indexer.ingest.live import Indexer
from svc import endpoint_port, wait_for, wait_subscribed


class Fake:
    def __init__(self) -> None:
        self.addrs: set[str] | Exception = set()
        self.t = 0.0

    def resolve(self, name: str):
        assert name == "vllm.ns.svc"
        if isinstance(self.addrs, Exception):
            raise self.addrs
        return set(self.addrs)

    def clock(self) -> float:
        return self.t


@pytest.fixture
def disco():
    f = Fake()
    ix = Indexer([{"id": "static", "endpoint": "tcp://127.0.0.1:7000"}])
    d = DnsDiscovery(ix, "vllm.ns.svc", port=5557, replay_port=5600, dp_size=2, model="llama", grace_s=30,
                     resolver=f.resolve, clock=f.clock)
    return f, ix, d


def engines(ix: Indexer) -> dict:
    return {c.id: c for c in ix.engines()}


def test_addresses_become_engines_with_the_configured_ports(disco):
    f, ix, d = disco
    f.addrs = {"10.0.0.5", "10.0.0.6", "fd00::7"}
    assert d.poll_once() == (["10.0.0.5", "10.0.0.6", "fd00::7"], [])
    e = engines(ix)
    assert set(e) == {"static", "10.0.0.5", "10.0.0.6", "fd00::7"}
    c = e["10.0.0.5"]
    assert (c.endpoint, c.replay_endpoint, c.dp_size, c.model) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", 2, "llama")
    assert e["fd00::7"].endpoint == "tcp://[fd00::7]:5557"
    assert [(w["engine"], w["dp_rank"], w["endpoint"]) for w in ix.workers() if w["engine"] == "10.0.0.6"] == [
        ("10.0.0.6", 0, "tcp://10.0.0.6:5557"), ("10.0.0.6", 1, "tcp://10.0.0.6:5558")]
    assert d.poll_once() == ([], [])  # nothing changed
    assert ix.index.counter("discovery_added") == 3


def test_vanished_addresses_go_after_the_grace_period_and_come_back(disco):
    f, ix, d = disco
    f.addrs = {"10.0.0.5", "10.0.0.6"}
    d.poll_once()
    f.addrs = {"10.0.0.5"}
    f.t = 10
    assert d.poll_once() == ([], [])  # missing for 0 s
    assert d.status()["missing"] == {"10.0.0.6": 0.0}
    f.t = 39
    assert d.poll_once() == ([], [])  # 29 s < 30 s grace
    f.t = 40
    assert d.poll_once() == ([], ["10.0.0.6"])
    assert set(engines(ix)) == {"static", "10.0.0.5"}  # static engines are never touched
    # Back within the grace period: the clock restarts.
    f.addrs = {"10.0.0.5", "10.0.0.6"}
    assert d.poll_once() == (["10.0.0.6"], [])
    f.addrs = {"10.0.0.5"}
    f.t = 50
    d.poll_once()
    f.addrs = {"10.0.0.5", "10.0.0.6"}
    f.t = 75
    d.poll_once()
    f.t = 200
    assert d.poll_once() == ([], []) and "10.0.0.6" in engines(ix)
    assert ix.index.counter("discovery_removed") == 1


def test_a_failed_resolution_changes_nothing_and_is_counted(disco):
    f, ix, d = disco
    f.addrs = {"10.0.0.5"}
    d.poll_once()
    f.addrs = socket.gaierror(-2, "Name or service not known")
    f.t = 1000
    assert d.poll_once() == ([], [])
    assert "10.0.0.5" in engines(ix) and d.errors == 1 and "cannot resolve vllm.ns.svc" in d.status()["last_error"]
    assert ix.index.counter("discovery_errors") == 1
    f.addrs = set()  # an empty answer is an answer: the grace period starts
    assert d.poll_once() == ([], []) and d.status()["last_error"] is None


def test_max_workers_and_bad_settings_are_reported_not_fatal():
    f = Fake()
    ix = Indexer(max_workers=2)
    d = DnsDiscovery(ix, "vllm.ns.svc", dp_size=2, resolver=f.resolve, clock=f.clock)
    f.addrs = {"10.0.0.1", "10.0.0.2"}
    added, _ = d.poll_once()
    assert added == ["10.0.0.1"] and d.errors == 1 and "max_workers" in d.last_error
    with pytest.raises(ValueError):
        DnsDiscovery(ix, "", resolver=f.resolve)


def test_the_standard_resolver_and_the_service_discover_localhost(pubs, serve):
    assert "127.0.0.1" in resolve_addresses("localhost")
    pub = pubs()  # an ephemeral port, bound by the publisher itself
    port = endpoint_port(pub.live_endpoint)
    s = serve(env={"KVI_DISCOVERY": f'{{"dns_name": "localhost", "port": {port}, "interval_s": 0.2}}'})
    api = s.client
    wait_for(lambda: any(e["id"] == "127.0.0.1" for e in api.get("/v1/engines")[1]), what="discovered engine")
    wait_subscribed(api, pub, "127.0.0.1")
    t = toks(5, 4, 16)
    pub.publish([store(t, 16, 0, 4)])
    wait_for(lambda: api.post("/v1/match", {"token_ids": t})[1].get("best"), what="the blocks")
    st = api.get("/v1/stats")[1]
    assert "127.0.0.1" in st["discovery"]["engines"] and st["counters"]["discovery_added"] >= 1


def test_R_DUR_2_engines_a_snapshot_restored_are_discoverys_own(disco):
    """A restart from a snapshot re-subscribes the engines discovery had added; discovery
    adopts them (same id and configuration), so an address gone while the service was
    down is still removed after the grace period. Static engines stay."""
    from indexer.store.snapshot import loads

    f, ix, d = disco
    f.addrs = {"10.0.0.1", "10.0.0.2"}
    d.poll_once()
    data = ix.snapshot()
    again = Indexer([{"id": "static", "endpoint": "tcp://127.0.0.1:7000"}], snapshot=loads(data))
    assert sorted(c.id for c in again.engines()) == ["10.0.0.1", "10.0.0.2", "static"]
    d2 = DnsDiscovery(again, "vllm.ns.svc", port=5557, replay_port=5600, dp_size=2, model="llama", grace_s=30,
                      resolver=f.resolve, clock=f.clock)
    f.addrs = {"10.0.0.1"}
    assert d2.poll_once() == ([], [])
    f.t += 31
    assert d2.poll_once() == ([], ["10.0.0.2"])
    assert sorted(c.id for c in again.engines()) == ["10.0.0.1", "static"]
    other = DnsDiscovery(again, "vllm.ns.svc", port=5558, resolver=f.resolve, clock=f.clock)
    assert other.known == {}  # another port: not what this discovery would have added
