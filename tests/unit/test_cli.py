"""The command line: ``kv-indexer`` and ``python -m indexer`` are one parser (every
option documented), the offline demo and the payload decoder, ``demo-prompt`` and
``simulate`` without the trace."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import golden
from api.cli import build_parser
from api.cli.tools import decode
from api.demo import demo_requests
from indexer.producer.offline import demo

ROOT = Path(__file__).resolve().parents[2]
NO_TRACE = {"KVI_TRACE": "/nonexistent/conversation_trace.jsonl"}


def run(*cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def commands(help_text: str) -> list[str]:
    """The subcommands a --help lists (indented 4 under "commands:")."""
    return re.findall(r"^ {4}([a-z][a-z-]*)\b", help_text, re.M)


def test_demo_answers_like_a_router_expects():
    out = io.StringIO()
    report = demo(out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(report))
    doc0 = report["document 0 (GPU 20 blocks, CPU to 32)"]
    best = doc0["workers"][0]
    assert best["engine"] == "vllm-0" and best["tiers"] == {"GPU": 20, "CPU": 32}
    assert best["score"] == 20 + 12 * 0.75 == doc0["best"]["score"]
    assert report["unknown prompt"]["best"] is None
    assert report["stats"]["orphans"] == 0


def test_decode_prints_layout_and_events(tmp_path):
    out = io.StringIO()
    assert decode(str(golden.GOLDEN / "v0.23.0" / "dp_rank_1.msgpack"), out) == 0
    doc = json.loads(out.getvalue())
    assert doc["layout"] == "array" and doc["dp_rank"] == 1
    assert doc["events"][0]["type"] == "BlockStored" and len(doc["events"][0]["token_ids"]) == 32
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x00garbage")
    out = io.StringIO()
    assert decode(str(bad), out) == 1 and json.loads(out.getvalue())["reason"] == "bad_payload"
    out = io.StringIO()
    assert decode(str(tmp_path / "missing"), out) == 2 and "cannot read" in out.getvalue()


def test_module_entry_point_runs_the_offline_demo_and_the_old_name_still_works():
    r = run(sys.executable, "-m", "indexer", "demo-offline")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["workers"] == 4 and r.stderr == ""
    old = run(sys.executable, "-m", "indexer", "demo")  # hidden, deprecated alias
    assert old.returncode == 0 and json.loads(old.stdout)["stats"] == json.loads(r.stdout)["stats"]
    assert "'demo' is deprecated, it is now 'demo-offline'" in old.stderr


def test_one_parser_behind_every_entry_point():
    expected = ["serve", "relay", "demo-prompt", "demo-offline", "replay", "decode", "simulate"]
    module = run(sys.executable, "-m", "indexer", "--help")
    assert module.returncode == 0 and module.stdout.startswith("usage: python -m indexer ")
    assert commands(module.stdout) == expected
    script = Path(sys.executable).parent / "kv-indexer"  # the console script of this install
    if not script.exists():
        pytest.skip("kv-indexer console script not installed next to this interpreter")
    r = run(str(script), "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: kv-indexer ")
    assert commands(r.stdout) == expected
    assert r.stdout.split("options:", 1)[1] == module.stdout.split("options:", 1)[1]
    # No command: the help, exit 2.
    none = run(sys.executable, "-m", "indexer")
    assert none.returncode == 2 and commands(none.stderr) == expected


def _walk(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, action) for every option and argument; hidden commands apart."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            yield path, a
            listed = {c.dest: c for c in a._choices_actions}
            for name, sp in a.choices.items():
                yield from _walk(sp, f"{path} {name}".strip())
                yield (f"{path} {name}".strip(), listed.get(name))
        else:
            yield path, a


def test_every_command_and_option_has_help():
    actions = list(_walk(build_parser()))
    hidden = [p for p, a in actions if a is None]
    assert hidden == ["demo"]  # the deprecated alias, out of the list on purpose
    assert build_parser()._subparsers._group_actions[0].choices["demo"].description
    missing = [(p, a.option_strings or a.dest) for p, a in actions
               if a is not None and (not a.help or not a.help.strip() or a.help == argparse.SUPPRESS)]
    assert missing == []
    names = {p for p, _ in actions}
    assert {"serve", "demo-prompt", "demo-offline", "decode", "simulate"} <= names
    assert sum(1 for p, a in actions if p == "simulate" and a is not None and a.option_strings) >= 10


def test_decode_stays_light(tmp_path):
    """`python -m indexer decode FILE` never imports the web stack (only `serve` does)."""
    r = run(sys.executable, "-X", "importtime", "-m", "indexer", "decode",
            str(golden.GOLDEN / "v0.23.0" / "dp_rank_1.msgpack"))
    assert r.returncode == 0 and json.loads(r.stdout)["layout"] == "array"
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert "indexer" in imported and "api" in imported
    assert not imported & {"fastapi", "uvicorn", "starlette", "yaml", "prometheus_client"}, imported


def test_demo_prompt_without_the_trace_is_what_the_demo_fleet_replays():
    r = run(sys.executable, "-m", "indexer", "demo-prompt", "3", env=NO_TRACE)
    assert r.returncode == 0, r.stderr
    assert "no trace at /nonexistent" in r.stderr and "synthetic" in r.stderr
    tokens = json.loads(r.stdout)["token_ids"]
    # The demo fleet's source when the trace is missing (serve --demo at any speed-up).
    from indexer.producer import sim

    real = sim.TRACE
    try:
        sim.TRACE = Path(NO_TRACE["KVI_TRACE"])
        for speedup in (10.0, 20.0, 0.5):
            source, what, from_trace = demo_requests(speedup)
            assert not from_trace and "synthetic" in what
            fleet = source()
            assert [next(fleet).tokens for _ in range(4)][3] == tokens
    finally:
        sim.TRACE = real
    assert len(tokens) == 2560  # a shared 2,048-token prefix, then its own 512 tokens
    short = run(sys.executable, "-m", "indexer", "demo-prompt", "3", "--max-tokens", "100", env=NO_TRACE)
    assert json.loads(short.stdout)["token_ids"] == tokens[:100]
    bad = run(sys.executable, "-m", "indexer", "demo-prompt", "-1", env=NO_TRACE)
    assert bad.returncode == 2 and "must be >= 0" in bad.stderr


def test_simulate_runs_without_the_trace():
    r = run(sys.executable, "-m", "indexer", "simulate", "--requests", "60", "--engines", "2", "--gpu-blocks", "1000",
            "--policies", "round_robin", "index", "--json", env=NO_TRACE)
    assert r.returncode == 0, r.stderr
    assert "60 synthetic requests" in r.stderr
    out = json.loads(r.stdout)
    assert [s["policy"] for s in out] == ["round_robin", "index"] and all(s["requests"] == 60 for s in out)
    r = run(sys.executable, "-m", "indexer", "simulate", "--requests", "20", "--engines", "2", env=NO_TRACE)
    assert r.returncode == 0 and r.stdout.startswith("20 synthetic requests, 2 engines"), r.stderr
