"""Record and replay end to end: a real ``kv-indexer serve --record DIR`` fed by
vLLM-compatible publishers over real ZMQ (an engine restart, a gap repaired by replay, an
engine removal, routes with their dones), then the real ``kv-indexer replay DIR``. The
reference is what the HTTP clients were answered, compared with what the recording holds;
the replay must reproduce every recorded answer (docs/record.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec

from evkit import store, toks
from indexer.ingest.recfile import read_segment, segments
from svc import Client, Server, sample, wait_for, wait_subscribed

BS = 16


def _worker(api: Client, engine: str) -> dict:
    return next(w for w in api.get("/v1/workers")[1] if w["engine"] == engine)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indexer", *args], capture_output=True, text=True, timeout=120)


def _recorded(directory) -> list:
    out = []
    for _, _, path in segments(str(directory)):
        out += [rec for _, rec in read_segment(path)]
    return out


def test_a_recorded_run_replays_to_every_answer(tmp_path, pubs):
    rec_dir = tmp_path / "rec"
    s = Server("--record", str(rec_dir), "--replay-timeout-s", "2")
    api = s.client
    answers = []  # what the clients were told, in order

    def route(body):
        st, r = api.post("/v1/route", body)
        assert st == 200, r
        answers.append(("route", r))
        return r

    def match(body):
        st, r = api.post("/v1/match", body)
        assert st == 200, r
        answers.append(("match", r))
        return r

    try:
        pa = pubs(replay_endpoint="tcp://127.0.0.1:*")
        pb = pubs(replay_endpoint="tcp://127.0.0.1:*")
        for name, p in (("ra", pa), ("rb", pb)):
            st, body = api.post("/v1/engines", {"id": name, "endpoint": p.live_endpoint,
                                                "replay_endpoint": p.bound_replay_endpoint})
            assert st == 201, body
            wait_subscribed(api, p, name)
        a, b, c = toks(100, 8, BS), toks(5000, 6, BS), toks(9000, 6, BS)
        pa.publish([store(a, BS, 0, 4)])
        pb.publish([store(b, BS, 0, 6)])
        wait_for(lambda: _worker(api, "ra")["batches"] >= 1 and _worker(api, "rb")["batches"] >= 1, what="batches")
        r1 = route({"token_ids": a, "max_tokens": 64})
        match({"token_ids": b})
        route({"token_ids": b})
        match({"token_ids": a, "cache_salt": "x"})

        # A gap repaired by replay: seq 2 of ra never reaches the live socket.
        pa.publish([store(a, BS, 4, 6)])
        pa.drop = {2}
        pa.publish([store(a, BS, 6, 8)])
        pa.publish([store(c, BS, 0, 2)])
        wait_for(lambda: _worker(api, "ra")["last_seq"] == 3, what="the gap repaired")
        assert _worker(api, "ra")["replays_ok"] >= 1
        match({"token_ids": a})
        route({"token_ids": c, "max_tokens": 32})
        assert api.post(f"/v1/route/{r1['request_id']}/done", {})[0] == 200

        # An engine restart: rb begins again at seq 0 with a newer ts.
        pb.restart()
        pb.publish([store(c, BS, 0, 3)])
        wait_for(lambda: _worker(api, "rb")["restarts"] == 1, what="the restart")
        match({"token_ids": b})
        route({"token_ids": c})

        # An engine removal.
        assert api.delete("/v1/engines/ra")[0] == 200
        route({"token_ids": a})
        match({"token_ids": c})
        wait_for(lambda: sample(api.metrics(), "kvi_record_calls_total") > 10, what="the writer to write")
        m = api.metrics()
        assert sample(m, "kvi_record_active") == 1 and sample(m, "kvi_record_bytes_total") > 1000
        assert sample(m, "kvi_record_errors_total", reason="disk_full") == 0
    finally:
        s.stop()  # SIGTERM: the service writes what its recording still queues

    # The recording holds exactly what the clients were told, in order.
    recs = _recorded(rec_dir)
    told = [msgspec.msgpack.decode(r[4][0]) for r in recs if r[0] in (12, 21, 23) and r[4] and r[4][0]]
    assert len(told) == len(answers)
    for (kind, got), kept in zip(answers, told):
        if kind == "route":
            # Kept as its head and the ranked entries' JSON, the bytes the service wrote
            # (recops: ["json", model, worker, engine, rank, score, cost, reason, tiers,
            # unused load, request id, entries]).
            assert kept[0] == "json" and kept[10] == got["request_id"] and kept[2] == got["worker"]
            assert msgspec.json.decode(kept[11]) == got["ranked"]
        else:
            # A match is kept as MatchResult's tuple: (model, block_size, query_blocks, workers,
            # best, predicted), a worker as (-score, -total, engine, rank, ...).
            kept_best = kept[4] and f"{kept[4][2]}/{kept[4][3]}"
            got_best = got["best"] and f"{got['best']['engine']}/{got['best']['dp_rank']}"
            assert kept_best == got_best
    notes = {(r[2], r[3]) for r in recs if r[0] == "note"}
    assert ("replay_requested", "ra") in notes and ("replayed", "ra") in notes

    # The real command replays it: every recorded answer reproduced, exit 0.
    out = _cli("replay", str(rec_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    # (a plain /v1/match asks match_plain first, then match when predictions are held:
    # both answers are recorded)
    queries = sum(1 for r in recs if r[0] in (12, 21, 22, 23))
    assert queries >= len(answers)
    assert f"all {queries} answer(s) reproduced exactly" in out.stdout

    # At a moment before the removal, ra still held a's prefix: the explain grid says so.
    removal = next(i for i, r in enumerate(x for x in recs if isinstance(x[0], int)) if r[0] == 4 or r[0] == 3)
    body = tmp_path / "prompt.json"
    body.write_text(json.dumps({"token_ids": a}))
    out = _cli("replay", str(rec_dir), "--until", str(removal - 1), "--explain", str(body))
    assert out.returncode == 0, out.stdout + out.stderr
    grid = json.loads(out.stdout[out.stdout.index("{"):])
    ra = next(w for w in grid["workers"] if w["engine"] == "ra")
    assert ra["gpu_blocks"] == 8
    out = _cli("replay", str(rec_dir), "--explain", str(body))  # and after it, ra is gone
    grid = json.loads(out.stdout[out.stdout.index("{"):])
    assert all(w["engine"] != "ra" for w in grid["workers"])

    # A torn recording (the last frame cut short, as a crash mid-write leaves it): the
    # command names the file and the offset, keeps what came before, and says so (exit 3).
    last = segments(str(rec_dir))[-1][2]
    size = (rec_dir / last).stat().st_size
    with open(last, "r+b") as f:
        f.truncate(size - 5)
    out = _cli("replay", str(rec_dir))
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"{last}: damaged at byte offset" in out.stdout and "truncated" in out.stdout


def test_an_unwritable_record_dir_is_counted_and_the_service_serves(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the recording directory should be")
    s = Server("--record", str(blocker / "rec"))
    try:
        m = s.client.metrics()
        assert sample(m, "kvi_record_errors_total", reason="unwritable") == 1
        assert sample(m, "kvi_record_active") == 0
        st, r = s.client.post("/v1/route", {"token_ids": list(range(64))})
        assert st in (200, 404), r  # served: no model yet is a 404 answer, not a failure
        assert s.client.get("/healthz")[0] == 200
        assert "recording to" in s.output() and "unwritable" in s.output()  # logged at start
    finally:
        s.stop()
