"""``/metrics`` of a real ``kv-indexer serve`` process, read with prometheus_client's own
text parser: which label values a scrape can carry (bounded, R-BAD-3), and the stream
continuity counters of R-STR-7 (proven, restarted, unproven; reconnects), moved by real
vLLM-compatible publishers over ZMQ on 127.0.0.1."""

from __future__ import annotations


import zmq
from prometheus_client.parser import text_string_to_metric_families

from evkit import store, toks
from svc import Client, PortHold, wait_for, wait_subscribed

BS = 16


def scrape(c: Client) -> dict:
    """``{family name: Metric}`` of one scrape, parsed by prometheus_client."""
    st, text = c.get("/metrics")
    assert st == 200
    return {f.name: f for f in text_string_to_metric_families(text)}


def model_labels(fams: dict) -> set[str]:
    """Every value of a ``model`` label in a scrape, whichever family carries it."""
    return {s.labels["model"] for f in fams.values() for s in f.samples if "model" in s.labels}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    """One sample's value; the family and the sample must be present."""
    assert family in fams, f"no metric family {family!r} in the scrape"
    want = {k: str(v) for k, v in labels.items()}
    got = [s.value for s in fams[family].samples if s.name == sample and s.labels == want]
    assert len(got) == 1, (family, sample, labels, fams[family].samples)
    return got[0]


def worker(c: Client, engine: str) -> dict:
    (w,) = [w for w in c.get("/v1/workers")[1] if w["engine"] == engine]
    return w


# ------------------------------------------------------------------ model labels


def test_R_BAD_3_model_labels_of_api_registered_engines_stay_within_max_workers(serve, request):
    """Engines registered over ``POST /v1/engines`` bring their model as a label value;
    ``max_workers`` bounds how many engines (DP ranks) are subscribed at once, so it
    bounds the model label values too: one engine past the bound is refused with a 4xx
    and adds no label, and unregistered engines' models leave the scrape, so
    registering and unregistering engines with ever new model names never grows it."""
    bound = 3
    s = serve(env={"KVI_MAX_WORKERS": str(bound)})
    c = s.client
    assert model_labels(scrape(c)) == set()
    live: dict[str, str] = {}  # engine id -> model

    def register(eid: str, model: str) -> tuple[int, dict]:
        down = PortHold()  # an engine that is down: held, never listening, for the test
        request.addfinalizer(down.close)
        return c.post("/v1/engines", {"id": eid, "model": model, "endpoint": down.endpoint})

    for i in range(bound):
        st, res = register(f"e{i}", f"api-model-{i}")
        assert st == 201, res
        live[f"e{i}"] = f"api-model-{i}"
        fams = scrape(c)
        assert model_labels(fams) == set(live.values())
        # The per-model orphan gauge names every registered model, even before any event.
        assert {x.labels["model"] for x in fams["kvi_orphans"].samples} == set(live.values())

    st, res = register("one-too-many", "api-model-x")
    assert 400 <= st < 500 and "max_workers" in res["detail"], (st, res)
    assert model_labels(scrape(c)) == set(live.values())
    assert "one-too-many" not in {e["id"] for e in c.get("/v1/engines")[1]}

    # Churn: every new engine has a new model; the bound holds throughout.
    for i in range(bound, bound + 4):
        old = sorted(live)[0]
        assert c.delete(f"/v1/engines/{old}")[0] == 200
        del live[old]
        st, res = register(f"e{i}", f"api-model-{i}")
        assert st == 201, res
        live[f"e{i}"] = f"api-model-{i}"
        labels = model_labels(scrape(c))
        assert len(labels) <= bound, labels
        assert labels == set(live.values())


# ------------------------------------------------------------- continuity (R-STR-7)


def _publisher_on(pubs, port: int, rport: int):
    """A publisher bound to fixed live and replay ports (the old one's may take a moment to free)."""
    def bind():
        try:
            return pubs(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
        except zmq.ZMQError:
            return None

    return wait_for(bind, timeout=4, what=f"127.0.0.1:{port} and :{rport} bound again")


def _register(c: Client, pub, engine: str, **fields) -> None:
    st, res = c.post("/v1/engines", {"id": engine, "endpoint": pub.live_endpoint, **fields})
    assert st == 201, res
    wait_subscribed(c, pub, engine)


def _applied_through(c: Client, engine: str, seq: int) -> None:
    wait_for(lambda: worker(c, engine)["last_seq"] == seq and not worker(c, engine)["replaying"],
             what=f"{engine} to apply seq {seq}")


def test_R_STR_7_continuity_outcomes_and_reconnects_are_exported(serve, pubs, request):
    """``kvi_continuity_total{outcome}`` (proven, restarted, unproven) and
    ``kvi_reconnects_total`` are in every scrape, with help text, and count what real
    publishers did (each outcome a different number of times, so none can stand in for
    another): gaps replayed from an engine that still holds the anchor (proven, 3),
    gaps on an engine without a replay endpoint (unproven, 2), and an engine that dies
    and comes back on the same ports, its first batches lost (one reconnect; the replay
    from the anchor shows another ts there: restarted)."""
    s = serve("--replay-timeout-s", "2")
    c = s.client
    fams = scrape(c)
    assert fams["kvi_continuity"].type == "counter" and fams["kvi_continuity"].documentation
    assert fams["kvi_reconnects"].type == "counter" and fams["kvi_reconnects"].documentation
    for outcome in ("proven", "restarted", "unproven"):
        assert value(fams, "kvi_continuity", "kvi_continuity_total", outcome=outcome) == 0
    assert value(fams, "kvi_reconnects", "kvi_reconnects_total") == 0
    assert {x.labels["outcome"] for x in fams["kvi_continuity"].samples} == {"proven", "restarted", "unproven"}

    # Proven, three times: a batch lost on the wire each time; the replay from the anchor
    # (the last applied seq) shows the same ts there.
    p = pubs(replay_endpoint="tcp://127.0.0.1:*")
    _register(c, p, "prov", replay_endpoint=p.bound_replay_endpoint)
    p.publish([store(toks(100, 1, BS), BS, 0, 1)])
    _applied_through(c, "prov", 0)
    for k in range(3):
        p.drop.add(p.next_seq)
        p.publish([store(toks(200 + 100 * k, 1, BS), BS, 0, 1)])
        seq = p.publish([store(toks(2000 + 100 * k, 1, BS), BS, 0, 1)])
        _applied_through(c, "prov", seq)
    assert not worker(c, "prov")["stale"]

    # Unproven, twice: the same losses, with no replay endpoint to ask.
    q = pubs()
    _register(c, q, "unprov")
    q.publish([store(toks(400, 1, BS), BS, 0, 1)])
    _applied_through(c, "unprov", 0)
    for k in range(2):
        q.drop.add(q.next_seq)
        q.publish([store(toks(500 + 100 * k, 1, BS), BS, 0, 1)])
        seq = q.publish([store(toks(5000 + 100 * k, 1, BS), BS, 0, 1)])
        _applied_through(c, "unprov", seq)
    assert worker(c, "unprov")["stale"]

    # Restarted: seqs 0-2, then the engine dies and comes back on the same ports; its
    # seqs 0-2 are lost (no subscriber yet), its seq 3 is the first the indexer sees.
    # Fixed ports: the engine comes back on the same ones. Held for the test (bound, never
    # listening: see svc.PortHold), so no other process takes them while it is down.
    hold, rhold = PortHold(), PortHold()
    request.addfinalizer(hold.close)
    request.addfinalizer(rhold.close)
    port, rport = hold.port, rhold.port
    r1 = _publisher_on(pubs, port, rport)
    _register(c, r1, "rest", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    for i in range(3):
        r1.publish([store(toks(1000 * (i + 1), 1, BS), BS, 0, 1)])
    _applied_through(c, "rest", 2)
    connects = worker(c, "rest")["connects"]
    r1.close()
    r2 = _publisher_on(pubs, port, rport)
    r2.drop.update({0, 1, 2})
    for i in range(3):
        r2.publish([store(toks(50_000 + 1000 * i, 1, BS), BS, 0, 1)])
    wait_for(lambda: worker(c, "rest")["connects"] > connects and worker(c, "rest")["connected"],
             timeout=15, what="rest's SUB to reconnect")
    seen = worker(c, "rest")["messages"]

    def probe_arrived():
        r2.send_raw([b"probe"])  # one frame: dropped and counted, never sequenced
        return worker(c, "rest")["messages"] > seen

    wait_for(probe_arrived, what="rest's new subscription to carry messages")
    r2.publish([store(toks(90_000, 1, BS), BS, 0, 1)])  # seq 3
    wait_for(lambda: worker(c, "rest")["restarts"] == 1, what="rest's restart to be proven")
    _applied_through(c, "rest", 3)

    fams = scrape(c)
    st, stats = c.get("/v1/stats")
    counters = stats["counters"]
    got = {o: value(fams, "kvi_continuity", "kvi_continuity_total", outcome=o)
           for o in ("proven", "restarted", "unproven")}
    assert got == {"proven": 3, "restarted": 1, "unproven": 2}, (got, counters)
    assert got == {"proven": counters.get("continuity_proven", 0),
                   "restarted": counters.get("continuity_restart", 0),
                   "unproven": counters.get("continuity_unproven", 0)}
    # Reconnects: only rest's SUB ever reconnected (a first connect is none).
    reconnects = sum(max(0, w["connects"] - 1) for w in c.get("/v1/workers")[1])
    assert reconnects >= 1
    assert value(fams, "kvi_reconnects", "kvi_reconnects_total") == reconnects == counters.get("reconnects", 0)
