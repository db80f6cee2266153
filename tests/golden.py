"""Access to the golden vLLM payloads in ``tests/data/vllm-golden`` (vendored from the
team's shared data, so the tests need nothing beside the repository; see its README)."""

from __future__ import annotations

import json
from pathlib import Path

from indexer.producer.events import Cleared, Removed, Stored

GOLDEN = Path(__file__).resolve().parent / "data" / "vllm-golden"
VERSIONS = {"v0.23.0": "0.23", "v0.24.0": "0.24", "v0.33.0": "0.33"}
_ARR_STORED = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
]
_ARR_REMOVED = ["block_hashes", "medium", "group_idx"]


def unhex(x):
    """Undo index.json's ``{"bytes_hex": ...}`` stand-in for msgpack ``bin``."""
    if isinstance(x, dict) and "bytes_hex" in x:
        return bytes.fromhex(x["bytes_hex"])
    if isinstance(x, list):
        return [unhex(i) for i in x]
    if isinstance(x, dict):
        return {k: unhex(v) for k, v in x.items()}
    return x


def payload(version_dir: str, name: str) -> bytes:
    return (GOLDEN / version_dir / f"{name}.msgpack").read_bytes()


def entries(version_dir: str) -> list[dict]:
    return json.loads((GOLDEN / version_dir / "index.json").read_text())["files"]


def frames(version_dir: str) -> dict:
    return json.loads((GOLDEN / version_dir / "frames.json").read_text())


def as_events(decoded_events: list) -> list:
    """index.json events (either layout) as :mod:`indexer.producer.events` producer events."""
    out = []
    for e in decoded_events:
        if isinstance(e, list):
            tag, vals = e[0], e[1:]
            if tag == "BlockStored":
                out.append(Stored(**dict(zip(_ARR_STORED, vals))))
            elif tag == "BlockRemoved":
                out.append(Removed(**dict(zip(_ARR_REMOVED, vals))))
            else:
                out.append(Cleared())
        else:
            e = dict(e)
            tag = e.pop("type")
            e.setdefault("group_idx", None)
            if tag == "BlockStored":
                out.append(Stored(**e))
            elif tag == "BlockRemoved":
                out.append(Removed(**e))
            else:
                out.append(Cleared())
    return out
