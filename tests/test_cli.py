"""``python -m indexer``: the demo the README runs and the payload decoder."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import golden
from indexer.__main__ import decode, demo


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


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "indexer", "demo"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["workers"] == 4
