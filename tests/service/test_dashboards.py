"""The operators' kit in the chart: the Grafana dashboard (a ConfigMap with the sidecar's
label) and the PrometheusRule render as docs/deploy.md shows them, and every metric they
name is one a live ``kv-indexer serve`` exports (a real process, its ``/metrics`` read with
prometheus_client's parser): a renamed metric cannot leave a dashboard or an alert silently
empty."""

from __future__ import annotations

import json
import re

import pytest

from prometheus_client.parser import text_string_to_metric_families

from svc import Server, wait_for
from test_deploy import CHART, comparable, monitoring_examples, one, render

DASHBOARD = CHART / "dashboards" / "kv-prefix-indexer.json"
MONITORING = {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}
TOKEN = "dashboards-test-token-0123456789"
# Labels Prometheus adds to every scraped series (the target's), not the service.
TARGET_LABELS = {"pod", "namespace", "job", "instance"}


def exprs() -> list[str]:
    """Every PromQL expression of the dashboard and of the rules (with a token: all of them)."""
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    kinds, _ = render({**MONITORING, "auth": {"token": TOKEN}})
    out += [r["expr"] for g in one(kinds, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    return out


def test_the_chart_renders_the_documented_dashboard_and_rules():
    kinds, _ = render(MONITORING)
    dashboards = [d for d in kinds["ConfigMap"] if d["metadata"]["name"].endswith("-dashboard")]
    assert len(dashboards) == 1
    (doc_dash,) = [d for d in monitoring_examples() if d["kind"] == "ConfigMap"]
    (doc_rule,) = [d for d in monitoring_examples() if d["kind"] == "PrometheusRule"]
    got = dashboards[0]
    assert got["metadata"] == doc_dash["metadata"] and got["metadata"]["labels"]["grafana_dashboard"] == "1"
    # The ConfigMap carries the chart's JSON file as it is.
    assert json.loads(got["data"]["kv-prefix-indexer.json"]) == json.loads(DASHBOARD.read_text())
    assert comparable(one(kinds, "PrometheusRule")) == comparable(doc_rule)
    alerts = {r["alert"] for r in doc_rule["spec"]["groups"][0]["rules"]}
    assert {"KvIndexerWorkerStale", "KvIndexerIngestStalled", "KvIndexerReplayFailures", "KvIndexerOrphansNearCap",
            "KvIndexerSlowQueries"} <= alerts
    # The thresholds are the values': a changed value changes the rule.
    kinds, _ = render({**MONITORING, "prometheusRule": {"enabled": True, "staleFor": "2m", "queryP99Seconds": 0.01},
                       "config": {"max_orphans": 500}})
    rules = {r["alert"]: r for r in one(kinds, "PrometheusRule")["spec"]["groups"][0]["rules"]}
    assert rules["KvIndexerWorkerStale"]["for"] == "2m" and rules["KvIndexerSlowQueries"]["expr"].endswith("> 0.01")
    assert rules["KvIndexerOrphansNearCap"]["expr"].endswith("> 0.8 * 500")
    assert "KvIndexerWrongToken" not in rules  # only with a token: kvi_auth_failures_total needs one
    # Off by default: nothing of the kit renders.
    kinds, _ = render()
    assert "PrometheusRule" not in kinds and not any(d["metadata"]["name"].endswith("-dashboard")
                                                       for d in kinds["ConfigMap"])
    # Every alert is documented with what to check first.
    text = (CHART.parents[1] / "docs" / "deploy.md").read_text()
    for a in alerts | {"KvIndexerWrongToken"}:
        assert re.search(rf"^\| `{a}` \| .+ \| .+ \|$", text, re.M), a


def test_the_dashboard_is_a_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "pod"}
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].count("(") == t["expr"].count(")"), t


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """One scrape of a demo service with a token, after a match and a route (histograms)."""
    tf = tmp_path_factory.mktemp("tok") / "token"
    tf.write_text(TOKEN)
    srv = Server("--demo", "--api-token-file", str(tf))
    try:
        c = srv.client
        wait_for(lambda: c.get("/v1/stats")[1]["counters"].get("batches_applied", 0) > 0, 20, "demo batches")
        tokens = list(range(1000, 1064))
        assert c.post("/v1/match", {"token_ids": tokens})[0] == 200
        assert c.post("/v1/route", {"token_ids": tokens, "record": False})[0] == 200
        assert c.call("POST", "/v1/engines", b"{}", {"authorization": "Bearer wrong-token-0000000000"})[0] == 403
        status, text = c.get("/metrics")
        assert status == 200
        yield text
    finally:
        srv.stop()


def exported(text: str) -> dict[str, set[str] | None]:
    """The series names a scrape declares, with the label names of their samples (None: a
    family declared with no sample yet, e.g. a drop counter before any drop)."""
    out: dict[str, set[str] | None] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for fam in text_string_to_metric_families(text):
        for suffix in suffixes.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, None)
        for s in fam.samples:
            got = out.get(s.name)
            out[s.name] = (got or set()) | set(s.labels)
    return out


def test_every_metric_the_dashboard_and_the_rules_name_is_exported(scrape):
    samples = exported(scrape)
    checked = 0
    for e in exprs():
        names = set(re.findall(r"\bkvi_[a-z0-9_]+\b", e))
        assert names, e
        for n in names:
            assert n in samples, f"{n} (in {e!r}) is not in a live /metrics scrape"
            checked += 1
        for n, sel in re.findall(r"\b(kvi_[a-z0-9_]+)\{([^}]*)\}", e):
            if samples[n] is None:
                continue  # no series yet: no labels to hold it to
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel):
                assert label in samples[n] | TARGET_LABELS, f"{n} has no label {label!r} (in {e!r})"
        # Grouping labels exist on some series of the expression.
        if any(samples[n] is None for n in names):
            continue
        have = set().union(*(samples[n] or set() for n in names)) | TARGET_LABELS
        for group in re.findall(r"\bby \(([^)]*)\)", e):
            for label in (x.strip() for x in group.split(",")):
                assert label in have, f"by ({label}) names no label of {sorted(names)} (in {e!r})"
    assert checked >= 40, checked


def test_a_wrong_name_would_be_caught(scrape):
    """The check above can fail: a name the service does not export is not in the scrape."""
    names = set(exported(scrape))
    assert "kvi_stale_workers" in names and "kvi_stale_worker" not in names
    assert "kvi_query_duration_seconds_bucket" in names and "kvi_query_duration_bucket" not in names
