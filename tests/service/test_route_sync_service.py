"""Route sync with real ``kv-indexer serve --route-sync`` processes and a real
``nats-server`` (R-SYNC-1, -3, -4, -5): three replicas share one in-flight view, request k
asked of replica k % 3; a replica killed with SIGKILL leaves the others' views within the
bound; a new replica is current when ``/readyz`` first says ready; a NATS restart mid-run
ends with every replica holding exactly what is open (no phantom load)."""

from __future__ import annotations

import time


from natsd import NatsServer
from svc import PortHold, Server, sample, wait_for

HB = 0.3


def serve(url: str, engines: list[PortHold]) -> Server:
    args = [a for i, h in enumerate(engines) for a in ("--engine", f"e{i}={h.endpoint}")]
    return Server(*args, "--route-sync", url, "--ready-fraction", "0",
                  env={"KVI_ROUTE_SYNC_HEARTBEAT_S": str(HB)})


def held(s: Server) -> dict[str, int]:
    """Open requests per origin in ``s``'s view (its own under its origin)."""
    rs = s.client.get("/v1/stats")[1]["route_sync"]
    return {(o or rs["origin"]): n for o, n in rs["held"].items() if n}


def origin(s: Server) -> str:
    return s.client.get("/v1/stats")[1]["route_sync"]["origin"]


def test_R_SYNC_1_R_SYNC_3_R_SYNC_4_R_SYNC_5_three_serve_replicas_one_view_kill_join_and_nats_restart(tmp_path):
    with NatsServer(tmp_path / "nats") as ns, PortHold() as h0, PortHold() as h1, PortHold() as h2:
        engines = [h0, h1, h2]
        reps = [serve(ns.url, engines) for _ in range(3)]
        try:
            names = [origin(s) for s in reps]
            rids: dict[str, list[str]] = {n: [] for n in names}
            placed: dict[str, int] = {}
            for k in range(12):
                s = reps[k % 3]
                st, out = s.client.post("/v1/route", {"token_ids": list(range(1000 * k, 1000 * k + 64)),
                                                      "max_tokens": 16})
                assert st == 200, out
                rids[names[k % 3]].append(out["request_id"])
                placed[out["worker"]] = placed.get(out["worker"], 0) + 1
            want = {n: 4 for n in names}
            for s in reps:
                wait_for(lambda s=s: held(s) == want, 5, what=f"every replica holds 4 of each: {held(s)}")
            # One view, so the 12 unrelated prompts spread as one router spreads them: 4 per engine.
            assert sorted(placed.values()) == [4, 4, 4], placed
            for s in reps:
                ws = {f"{w['engine']}/{w['dp_rank']}": w["in_flight"]["requests"] for w in s.client.get("/v1/workers")[1]}
                assert ws == placed

            # SIGKILL: no goodbye. The others drop its 4 within peer timeout + one heartbeat.
            dead = reps.pop()
            t0 = time.monotonic()
            dead.proc.kill()
            dead.proc.wait()
            dead.stop()
            for s in reps:
                wait_for(lambda s=s: names[2] not in held(s), 10, what="the killed replica's requests to leave")
            assert time.monotonic() - t0 <= 4 * HB + 2.0
            m = reps[0].client.metrics()
            assert sample(m, "kvi_route_sync_peer_events_total", event="lost") == 1
            assert sample(m, "kvi_route_sync_peers") == 1

            # A new replica: current at the moment /readyz first answers 200.
            new = serve(ns.url, engines)
            reps.append(new)
            wait_for(lambda: new.client.get("/readyz")[0] == 200, 15, what="the new replica to be ready")
            assert held(new) == {names[0]: 4, names[1]: 4}

            # NATS restarted mid-run; meanwhile replica 0 finishes two of its requests (told
            # to nobody). After it: every replica holds exactly what is open.
            ns.stop()
            wait_for(lambda: sample(reps[0].client.metrics(), "kvi_route_sync_connected") == 0, 10,
                     what="replica 0 to see NATS down")
            for rid in rids[names[0]][:2]:
                assert reps[0].client.post(f"/v1/route/{rid}/done", {})[1]["released"] is True
            # Each falls back to its own view once the others are silent.
            for s, own in ((reps[0], {names[0]: 2}), (reps[1], {names[1]: 4}), (new, {})):
                wait_for(lambda s=s, own=own: held(s) == own, 10, what=f"own view only: {held(s)}")
            ns.start()
            for s in reps:
                wait_for(lambda s=s: sample(s.client.metrics(), "kvi_route_sync_connected") == 1, 15,
                         what="reconnected")
            want = {names[0]: 2, names[1]: 4}
            for s in reps:
                wait_for(lambda s=s: held(s) == want, 15, what=f"convergence after the restart: {held(s)}")
        finally:
            for s in reps:
                s.stop()
