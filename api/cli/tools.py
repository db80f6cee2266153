"""``kv-indexer decode FILE``: one vLLM batch payload (frame 3 of a live message)
printed as JSON: which wire layout, which events, what was ignored."""

from __future__ import annotations

import json
import sys
from typing import TextIO

import msgspec

from indexer.wire.decode import DecodeError, decode_batch, decode_tokens


def decode(path: str, out: TextIO = sys.stdout) -> int:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        out.write(json.dumps({"error": f"cannot read {path}: {e.strerror}"}) + "\n")
        return 2
    try:
        b = decode_batch(data)
    except DecodeError as e:
        out.write(json.dumps({"error": str(e), "reason": e.reason}) + "\n")
        return 1
    events = []
    for ev in b.events:
        d = {f: getattr(ev, f) for f in ev.__struct_fields__}
        d["type"] = type(ev).__struct_config__.tag
        if "token_ids" in d:
            d["token_ids"] = decode_tokens(d["token_ids"])
        events.append(d)
    doc = {"ts": b.ts, "dp_rank": b.dp_rank, "layout": b.layout, "ignored": b.issues, "events": events}
    out.write(msgspec.json.encode(doc, enc_hook=lambda o: o.hex() if isinstance(o, bytes) else str(o)).decode() + "\n")
    return 0
