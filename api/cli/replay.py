"""``kv-indexer replay DIR``: rebuild the index recorded by ``serve --record DIR`` (or a
:class:`~indexer.ingest.record.Recorder`) and check that every recorded answer comes out
again; ``--until`` stops at a moment, where ``--explain`` shows one prompt's block x
worker grid as it was, or ``--serve`` serves the read API on that state
(``docs/record.md``).

Exit status: 0 every answer reproduced; 1 a mismatch (the first differing answer and the
calls since the last agreement are printed); 3 a damaged segment (reported with its
offset; the replay went on from the next segment's base); 2 no recording or bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from typing import Any

from indexer.ingest.recfile import segments
from indexer.ingest.replay import describe, replay


def parse_until(text: str) -> tuple[int | None, float | None]:
    """``--until``: a call number (an integer), or a time (``@UNIX_SECONDS`` or ISO 8601,
    UTC unless it says otherwise). Raises ValueError."""
    if text.isdigit():
        return int(text), None
    if text.startswith("@"):
        return None, float(text[1:])
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return None, dt.timestamp()


def cmd_replay(args: argparse.Namespace) -> int:
    d = args.dir
    if not os.path.isdir(d) or not segments(d):
        print(f"{args.prog}: {d}: no recording segments (seg-*.kvr) there", file=sys.stderr)
        return 2
    try:
        until_op, until_wall = parse_until(args.until) if args.until else (None, None)
    except ValueError:
        print(f"{args.prog}: --until {args.until!r}: a call number, @UNIX_SECONDS or an ISO 8601 time",
              file=sys.stderr)
        return 2
    rep = replay(d, until_op=until_op, until_wall=until_wall, check=not args.no_check, strict=args.strict,
                 on_call=print if args.verbose else None)
    print(describe(rep))
    if args.explain is not None:
        if rep.index is None:
            print(f"{args.prog}: nothing to explain: no state could be rebuilt", file=sys.stderr)
            return 2
        body = _prompt(args.explain)
        from indexer.query.explain import explain

        try:
            grid = explain(rep.index, body["token_ids"], model=body.get("model", "default"),
                           lora_name=body.get("lora_name"), cache_salt=body.get("cache_salt"))
        except KeyError as e:
            print(f"{args.prog}: --explain: {e}", file=sys.stderr)
            return 2
        print(json.dumps(grid, indent=1))
    if args.serve:
        if rep.index is None:
            print(f"{args.prog}: nothing to serve: no state could be rebuilt", file=sys.stderr)
            return 2
        from api.cli.serve import serve
        from api.settings import Settings

        print(f"serving the replayed state on http://{args.host}:{args.port} (read API; Ctrl-C stops)")
        serve(Settings(host=args.host, port=args.port), index=rep.index)
    if rep.mismatch is not None:
        return 1
    return 3 if rep.damage else 0


def _prompt(path: str) -> dict[str, Any]:
    """A ``/v1/explain`` body (``{"token_ids": [...], ...}``) or a bare list of ids, from a
    file or ``-`` (stdin)."""
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    body = json.loads(text)
    return {"token_ids": body} if isinstance(body, list) else dict(body)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay", help="rebuild a recorded index and check every recorded answer (docs/record.md)",
        description="Rebuild the index recorded in DIR (serve --record DIR) call by call and check that every "
                    "recorded answer is reproduced exactly. Exit 0: all reproduced; 1: a mismatch; 3: a damaged "
                    "segment (skipped to the next segment's base); 2: no recording.")
    p.add_argument("dir", metavar="DIR", help="the recording directory")
    p.add_argument("--until", metavar="TIME|SEQ", help="stop before call number SEQ+1, or at TIME (@UNIX_SECONDS "
                   "or ISO 8601, UTC by default)")
    p.add_argument("--explain", metavar="FILE", help="then show this prompt's block x worker grid at that moment "
                   "(a /v1/explain JSON body or a list of token ids; - reads stdin)")
    p.add_argument("--serve", action="store_true", help="then serve the read API on that state")
    p.add_argument("--host", default="127.0.0.1", help="--serve: listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="--serve: port (default %(default)s)")
    p.add_argument("--strict", action="store_true", help="stop at a damaged segment instead of going on")
    p.add_argument("--no-check", action="store_true", help="rebuild only, do not compare answers")
    p.add_argument("--verbose", action="store_true", help="print each call replayed")
    p.set_defaults(func=cmd_replay)
