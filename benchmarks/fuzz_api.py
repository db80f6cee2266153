"""A long schemathesis run over the whole API of a real ``kv-indexer serve`` (R-BAD-1, R-BAD-2).

The short, bounded version runs in CI (tests/service/test_schemathesis.py: 40 examples per
operation). This one starts its own ``kv-indexer serve`` on 127.0.0.1 (a free port,
``--max-request-tokens 4096`` as in the test, engines allowed on loopback only:
``KVI_ALLOWED_ENDPOINTS=127.0.0.1``), registers one engine fed by a vLLM-wire publisher
over real ZMQ (so generated queries also reach the match path), loads the OpenAPI the
server serves (``/openapi.json``), and for every operation runs ``--examples`` generated
cases in each mode (positive: schema-valid data; negative: data the schema forbids),
seeded: the same ``--seed`` generates the same cases.

Any 5xx fails the run (exit 1), with the minimal case hypothesis shrinks it to and a
curl command that reproduces it. ``--validate`` adds the response checks of the CI test
(status codes and bodies as the schema declares them, with the same documented
exceptions). A summary lists every operation: cases, statuses seen.

``--token`` starts the server with ``KVI_API_TOKEN`` set (a random token, or the one
given) and sends ``Authorization: Bearer <token>`` with every case; then, for every
operation whose schema declares the bearer token, one case without it must get 401 and
one with a wrong token 403 (a server without the token feature ignores the variable:
that check then reports "token not enforced").

    .venv/bin/python benchmarks/fuzz_api.py                            # 1000 cases per operation and mode
    .venv/bin/python benchmarks/fuzz_api.py --examples 50 --seed 7     # a short run
    .venv/bin/python benchmarks/fuzz_api.py --token --validate         # with an API token, and the schema checks
    .venv/bin/python benchmarks/fuzz_api.py --only /v1/match --examples 5000

Needs the test extras (``pip install -e '.[test]'``); runs from any directory.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hyp_seed  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import negative_data_rejection, positive_data_acceptance  # noqa: E402

from evkit import store, toks  # noqa: E402
from indexer.producer.publisher import VllmPublisher  # noqa: E402
from svc import Server, wait_for, wait_subscribed  # noqa: E402

MAX_TOKENS = 4096
# As tests/service/test_schemathesis.py: operations whose rules a schema cannot state, answered
# with a documented 4xx, skip "schema-valid data is accepted" (an engine's ports <= 65535,
# worker names in a route's candidates and load, Dynamo's 400s); 413 is the documented
# size rejection (R-BAD-2).
SEMANTIC_4XX = {("POST", "/v1/engines"), ("POST", "/v1/route"), ("POST", "/register"), ("POST", "/query_by_hash")}


class ServerError(AssertionError):
    pass


def start(args: argparse.Namespace) -> tuple[Server, VllmPublisher, dict[str, str]]:
    env = {"KVI_LOG_LEVEL": "warning"}
    if not args.any_endpoint:
        env["KVI_ALLOWED_ENDPOINTS"] = "127.0.0.1"
    auth: dict[str, str] = {}
    if args.token:
        env["KVI_API_TOKEN"] = args.token
        auth = {"Authorization": f"Bearer {args.token}"}
    srv = Server("--max-request-tokens", str(MAX_TOKENS), env=env)
    pub = VllmPublisher("tcp://127.0.0.1:*", hwm=0)
    body = json.dumps({"id": "fuzz", "endpoint": pub.live_endpoint}).encode()
    st_, doc = srv.client.call("POST", "/v1/engines", body, auth)
    if st_ != 201:
        srv.stop()
        pub.close()
        raise SystemExit(f"registering the engine failed: {st_} {doc}")
    wait_subscribed(srv.client, pub, "fuzz")  # PUB drops what it sends before that
    pub.publish([store(toks(0, 4, 16), 16, 0, 4)])
    wait_for(lambda: srv.client.get("/v1/stats")[1].get("resident_entries") == 4, what="the blocks")
    return srv, pub, auth


def loopback(body: dict) -> None:
    """Point the endpoints of a generated engine registration at 127.0.0.1 (its port kept):
    random hosts are refused by ``allowed_endpoints`` (or, with ``--any-endpoint``, dialled),
    so without this the register-and-subscribe path is never reached."""
    for k in ("endpoint", "replay_endpoint"):
        v = body.get(k)
        if not isinstance(v, str):
            continue
        port = v.rsplit(":", 1)[-1]
        if not (v.startswith("tcp://") and port.isdigit()):
            port = str(20_000 + sum(v.encode()) % 40_000)  # Dynamo's /register: any name
        body[k] = f"tcp://127.0.0.1:{port}"


def needs_token(schema: dict, method: str, path: str) -> bool:
    op = schema.get("paths", {}).get(path, {}).get(method.lower(), {})
    return bool(op.get("security", schema.get("security")))


def fuzz_operation(op: Any, mode: GenerationMode, args: argparse.Namespace, base: str, session: requests.Session,
                   auth: dict[str, str], statuses: Counter[int]) -> tuple[int, str | None]:
    """Run one operation in one mode; returns (cases sent, failure report or None)."""
    try:
        strategy = op.as_strategy(generation_mode=mode)
    except Exception as e:  # e.g. nothing in the operation can be made invalid
        return 0, None if mode == GenerationMode.NEGATIVE else f"no strategy: {e!r}"
    sent = [0]
    last: list[Any] = [None, None]  # the latest failing case and its response

    @hyp_seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=strategy)
    def run(case: Any) -> None:
        if mode == GenerationMode.POSITIVE and sent[0] % 2 and isinstance(case.body, dict):
            loopback(case.body)  # every other positive case: an engine that may really register
        response = case.call(base_url=base, session=session, headers=auth, timeout=30)
        sent[0] += 1
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            last[:] = [case, response]
            raise ServerError(f"{response.status_code}: {response.text[:500]}")
        if args.validate:
            excluded = [positive_data_acceptance] if (case.method, case.path) in SEMANTIC_4XX else []
            if response.status_code == 413:
                excluded.append(negative_data_rejection)
            try:
                case.validate_response(response, excluded_checks=excluded, headers=auth)
            except Exception:
                last[:] = [case, response]
                raise

    try:
        run()
    except Unsatisfiable:
        # Nothing to vary in this mode (no parameters, or none the schema constrains):
        # nothing to send, not a failure.
        return sent[0], None
    except BaseException as e:  # schemathesis reports its checks as an exception group
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        case, response = last
        what = f"{type(e).__name__}: {str(e)[:2000]}"
        if case is not None:
            what += f"\n    reproduce: {case.as_curl_command(headers=auth, base_url=base)}"
            if response is not None:
                what += f"\n    status {response.status_code}, body: {response.text[:500]!r}"
        return sent[0], what
    return sent[0], None


def auth_checks(schema: dict, ops: list[Any], base: str, session: requests.Session) -> tuple[list[str], int]:
    """With a token: every operation declaring it answers 401 without it, 403 with a wrong one.
    Returns the failures and how many operations were checked."""
    bad: list[str] = []
    checked = 0
    for op in ops:
        if not needs_token(schema, op.method, op.path):
            continue
        checked += 1
        case = None

        @settings(max_examples=1, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(c=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
        def one(c: Any) -> None:
            nonlocal case
            case = c

        one()
        assert case is not None
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        for hdr, want in (({}, 401), ({"Authorization": "Bearer " + "x" * 32}, 403)):
            r = case.call(base_url=base, session=session, headers=hdr, timeout=30)
            if r.status_code != want:
                bad.append(f"{op.method} {op.path} with {hdr or 'no token'}: {r.status_code}, expected {want} "
                           f"(token not enforced?)\n    reproduce: {case.as_curl_command(headers=hdr, base_url=base)}")
    return bad, checked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="cases per operation and mode (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed: the same seed, the same cases (default 0)")
    ap.add_argument("--token", nargs="?", const=secrets.token_urlsafe(24), default=None, metavar="TOKEN",
                    help="start the server with KVI_API_TOKEN (random if no value) and send it as a bearer token")
    ap.add_argument("--validate", action="store_true", help="also check statuses and bodies against the schema")
    ap.add_argument("--modes", default="positive,negative", help="positive, negative or both (default)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="only operations whose 'METHOD /path' contains TEXT (repeatable)")
    ap.add_argument("--any-endpoint", action="store_true",
                    help="let registered engines point anywhere (default: 127.0.0.1 only)")
    args = ap.parse_args(argv)
    modes = [GenerationMode(m.strip()) for m in args.modes.split(",") if m.strip()]

    t0 = time.monotonic()
    srv, pub, auth = start(args)
    base = f"http://127.0.0.1:{srv.port}"
    failures: list[str] = []
    rows: list[tuple[str, str, int, Counter[int]]] = []
    total: Counter[int] = Counter()
    try:
        session = requests.Session()
        raw_schema = session.get(base + "/openapi.json", headers=auth, timeout=30).json()
        # Unsanitized output: by default schemathesis hides the values of keys such as
        # "token_ids" and "block_keys" in its reports, the very values a reproduction needs.
        config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
        schema = schemathesis.openapi.from_dict(raw_schema, config=config)
        ops = [r.ok() for r in schema.get_all_operations()]
        ops = [op for op in ops if not args.only or any(t in f"{op.method.upper()} {op.path}" for t in args.only)]
        print(f"kv-indexer serve on {base}; {len(ops)} operations x {len(modes)} modes x {args.examples} cases, "
              f"seed {args.seed}{', with an API token' if args.token else ''}", flush=True)
        for op in ops:
            for mode in modes:
                label = f"{op.method.upper()} {op.path}"
                st0 = time.monotonic()
                statuses: Counter[int] = Counter()
                n, failure = fuzz_operation(op, mode, args, base, session, auth, statuses)
                total.update(statuses)
                rows.append((label, mode.value, n, statuses))
                seen = " ".join(f"{s}x{c}" for s, c in sorted(statuses.items()))
                print(f"  {label:40s} {mode.value:8s} {n:6d} cases {time.monotonic() - st0:6.1f}s  {seen}",
                      flush=True)
                if failure:
                    failures.append(f"{label} ({mode.value}): {failure}")
                    print(f"    FAIL {failure}", flush=True)
                if srv.proc.poll() is not None:
                    failures.append(f"the server exited ({srv.proc.returncode}) during {label}")
                    raise SystemExit(1)
        if args.token:
            bad, checked = auth_checks(raw_schema, ops, base, session)
            print(f"token: {checked} operations declare it; each answered 401 without it and 403 with a wrong one"
                  if not bad else f"token: {len(bad)} of {2 * checked} refusals wrong")
            failures += bad
    finally:
        pub.close()
        log = srv.output() if failures else ""
        srv.stop()

    cases = sum(r[2] for r in rows)
    print(f"\n{len({r[0] for r in rows})} operations, {cases} cases in {time.monotonic() - t0:.0f}s; statuses seen: "
          + ", ".join(f"{s}: {c}" for s, c in sorted(total.items())))
    fivexx = sum(c for s, c in total.items() if s >= 500)
    print(f"5xx: {fivexx}")
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            print(f"- {f}")
        tail = "\n".join(log.splitlines()[-40:])
        print(f"\nlast server log lines:\n{tail}")
        return 1
    print("no failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
