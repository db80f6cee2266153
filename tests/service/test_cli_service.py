"""``kv-indexer``: settings from YAML, environment and flags, validated at start with
messages that name the setting; ``--help`` documents every setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from api.cli import main
from api.settings import FIELDS, Settings, SettingsError, load_settings, parse_engine_spec
from svc import ROOT


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


CONFIG = """\
host: 0.0.0.0
port: 9000
engines:
  - id: vllm-0
    model: llama
    endpoint: tcp://10.0.0.5:5557
    replay_endpoint: tcp://10.0.0.5:5558
    dp_size: 2
credits: {GPU: 1.0, CPU: 0.5}
max_nodes: 1000
log_json: true
"""


def test_sources_merge_in_order_file_env_flags(tmp_path):
    cfg = tmp_path / "kvi.yaml"
    cfg.write_text(CONFIG)
    s = load_settings(str(cfg), {"port": None}, env={})
    assert (s.host, s.port, s.max_nodes, s.log_json, s.credits) == ("0.0.0.0", 9000, 1000, True, {"GPU": 1.0, "CPU": 0.5})
    assert s.engines[0].id == "vllm-0" and s.engines[0].dp_size == 2 and s.engines[0].model == "llama"
    env = {"KVI_CONFIG": str(cfg), "KVI_PORT": "9001", "KVI_LOG_JSON": "false",
           "KVI_ENGINES": '[{"id": "x", "endpoint": "tcp://h:1"}]'}
    s = load_settings(None, {}, env=env)
    assert (s.port, s.log_json, [e.id for e in s.engines]) == (9001, False, ["x"])
    s = load_settings(None, {"port": 9002}, env=env)
    assert s.port == 9002
    assert load_settings(None, None, env={}) == Settings()
    assert s.index_options()["credits"] == {"GPU": 1.0, "CPU": 0.5}


@pytest.mark.parametrize("source,message", [
    ({"port": 70000}, "'port': must be 0..65535"),
    ({"port": "x"}, "'port'"),
    ({"colour": "blue"}, "unknown setting(s): colour"),
    ({"stale_factor": 2}, "'stale_factor'"),
    ({"log_level": "loud"}, "'log_level'"),
    ({"max_request_tokens": 0}, "'max_request_tokens': must be >= 1"),
    ({"rcvhwm": -1}, "'rcvhwm': must be >= 0"),
    ({"credits": {"GPU": -1}}, "'credits'"),
    ({"engines": [{"id": "a", "endpoint": "udp://h:1"}]}, "endpoint"),
    ({"engines": [{"id": "a", "endpoint": "tcp://h:1"}, {"id": "a", "endpoint": "tcp://h:2"}]}, "configured twice"),
])
def test_bad_settings_are_named(source, message):
    with pytest.raises(SettingsError) as e:
        load_settings(None, source, env={})
    assert message in str(e.value)


def test_bad_files_and_env_are_named(tmp_path):
    with pytest.raises(SettingsError, match="No such file"):
        load_settings(str(tmp_path / "missing.yaml"), env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(str(bad), env={})
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SettingsError, match="expected a mapping"):
        load_settings(str(bad), env={})
    with pytest.raises(SettingsError, match="KVI_ENGINES: not valid JSON"):
        load_settings(None, env={"KVI_ENGINES": "[{"})


def test_engine_flag_spec():
    assert parse_engine_spec("e=tcp://h:1,model=m,dp_size=2") == {
        "id": "e", "endpoint": "tcp://h:1", "model": "m", "dp_size": "2"}
    with pytest.raises(SettingsError):
        parse_engine_spec("tcp://h:1")
    with pytest.raises(SettingsError):
        parse_engine_spec("e=tcp://h:1,model")


def test_check_prints_the_effective_settings(tmp_path, capsys):
    cfg = tmp_path / "kvi.yaml"
    cfg.write_text(CONFIG)
    assert main(["serve", "--config", str(cfg), "--port", "9100", "--engine", "b=tcp://h:7,dp_size=3", "--check"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["port"] == 9100 and out["host"] == "0.0.0.0"
    assert [(e["id"], e["dp_size"]) for e in out["engines"]] == [("b", 3)]  # --engine replaces the list


def test_help_documents_every_setting_and_bad_settings_exit_2():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("serve", "demo-prompt", "demo-offline", "decode", "simulate"):
        assert f"\n    {cmd}" in r.stdout, cmd
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    for name in FIELDS:
        assert f"KVI_{name.upper()}" in r.stdout, name
    assert "--config" in r.stdout and "--host" in r.stdout and "--port" in r.stdout and "engines:" in r.stdout
    r = run_cli("serve", "--port", "99999")
    assert r.returncode == 2 and "'port': must be 0..65535" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("serve", "--check", env={"KVI_MAX_NODES": "lots"})
    assert r.returncode == 2 and "'max_nodes'" in r.stderr


def test_serve_logs_json_lines(tmp_path, serve):
    s = serve("--log-json", "--log-level", "info")
    assert s.client.get("/healthz")[0] == 200
    s.stop()
    with open(s.log.name) as f:
        out = f.read()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert any(x["msg"].startswith("kv-indexer ready") and x["level"] == "info" for x in lines), out


def test_the_demo_serves_real_answers_within_seconds(mooncake_trace, serve):
    """`kv-indexer serve --demo`: a simulated fleet replaying the trace, routed by the
    index, and the routes answer about it. Skipped without the trace; its twin is
    test_the_demo_without_the_trace_serves_what_demo_prompt_prints."""
    from svc import wait_for

    s = serve("--demo", "--demo-speedup", "20")
    api = s.client
    wait_for(lambda: len(api.get("/v1/workers")[1]) == 8 and api.get("/readyz")[1]["reasons"] == [],
             timeout=20, what="8 demo workers connected")
    wait_for(lambda: api.get("/v1/stats")[1]["resident_entries"] > 1000, timeout=20, what="demo blocks")
    prompt = json.loads(run_cli("demo-prompt", "0").stdout)
    st, res = api.post("/v1/match", prompt)
    assert st == 200 and res["best"] is not None and res["workers"][0]["total_blocks"] >= 32
    st, r = api.post("/v1/route", prompt)
    assert st == 200 and r["worker"].startswith("sim-") and len(r["ranked"]) == 8
    m = api.metrics()
    assert m[("kvi_events_total", frozenset({("event_type", "BlockStored"), ("outcome", "applied")}))] > 0
    assert {w["engine"] for w in api.get("/v1/workers")[1]} == {"sim-0", "sim-1", "sim-2", "sim-3"}
    s.stop()
    with open(s.log.name) as f:
        assert "demo: 4 simulated engines x 2 DP ranks replaying the Mooncake trace at 20x" in f.read()


def test_the_documented_config_example_is_complete_and_valid(tmp_path):
    import re

    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("A complete config file:", 1)[1]
    example = re.search(r"```yaml\n(.*?)```", block, re.S).group(1)
    cfg = tmp_path / "example.yaml"
    cfg.write_text(example)
    s = load_settings(str(cfg), env={})
    import yaml

    assert set(yaml.safe_load(example)) == set(FIELDS)  # every setting is shown
    assert s.engines[0].dp_size == 2 and s.discovery.replay_port == 5600


def test_the_demo_without_the_trace_serves_what_demo_prompt_prints(serve):
    """No trace (a plain clone): the demo fleet replays synthetic requests, and
    `demo-prompt N` prints request N of those, so the index holds every block of it."""
    from svc import wait_for

    no_trace = {"KVI_TRACE": "/nonexistent/conversation_trace.jsonl"}
    s = serve("--demo", "--demo-speedup", "20", env=no_trace)
    api = s.client
    r = run_cli("demo-prompt", "5", env=no_trace)
    assert r.returncode == 0, r.stderr
    prompt = json.loads(r.stdout)
    blocks = len(prompt["token_ids"]) // 16

    def whole_prompt_cached():
        st, res = api.post("/v1/match", prompt)
        return st == 200 and res["best"] is not None and res["workers"][0]["total_blocks"] == blocks

    wait_for(whole_prompt_cached, timeout=20, what="demo-prompt 5's blocks, all of them, in the index")
    st, r = api.post("/v1/route", prompt)
    assert st == 200 and r["worker"].startswith("sim-") and len(r["ranked"]) == 8
    s.stop()
    with open(s.log.name) as f:
        assert "replaying synthetic requests (no trace at /nonexistent/conversation_trace.jsonl)" in f.read()


def test_R_DUR_2_the_demo_ignores_a_state_dir_and_says_why(serve, tmp_path):
    """The demo's engines are new processes on new ports at every start: a snapshot of the
    last run would name engines that are gone, so the demo starts without it, saying so."""
    s = serve("--demo", "--state-dir", str(tmp_path), env={"KVI_TRACE": "/nonexistent/trace.jsonl"})
    assert "state_dir and bootstrap_from are ignored" in s.output()
    st, ws = s.client.get("/v1/workers")
    assert st == 200 and len(ws) == 8
    assert not (tmp_path / "index.snap").exists()
