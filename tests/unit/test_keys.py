"""Contract §2 (R-KEY-1, R-KEY-2): block keys and namespaces."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from golden import VERSIONS, payload

from indexer import PrefixIndex
from indexer.wire.keys import (
    KEY_SEED,
    block_keys,
    namespace_seed,
    query_extra_keys,
    seeds_for_blocks,
    tokens_to_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def dynamo_local_hash(tokens) -> int:
    """NVIDIA Dynamo's local block hash: xxh3-64 of LE uint32 tokens, seed 1337."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)


# ------------------------------------------------------------------------ R-KEY-2


def test_R_KEY_2_plain_key_is_dynamo_local_block_hash():
    assert KEY_SEED == 1337
    got = block_keys(list(range(32)), 16)
    assert got == [
        xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(16)), seed=1337),
        xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(16, 32)), seed=1337),
    ]
    toks = [0, 1, 2**31, 2**32 - 1, 123456, 7, 99999, 42]
    assert block_keys(toks, 4) == [dynamo_local_hash(toks[:4]), dynamo_local_hash(toks[4:])]
    assert block_keys(toks, 8) == [dynamo_local_hash(toks)]


def test_R_KEY_2_trailing_partial_block_ignored():
    assert block_keys(list(range(40)), 16) == block_keys(list(range(32)), 16)
    assert len(block_keys(list(range(47)), 16)) == 2
    assert block_keys(list(range(15)), 16) == []
    assert block_keys([], 16) == []


def test_R_KEY_2_bytes_input_equals_token_list():
    toks = list(range(1000, 1064))
    assert tokens_to_bytes(toks) == struct.pack("<64I", *toks)
    assert block_keys(tokens_to_bytes(toks), 16) == block_keys(toks, 16)


def test_R_KEY_2_keys_are_prefix_free_of_position():
    # A key names one block's tokens; the tree position gives the prefix context,
    # so the same block content has the same key wherever it sits.
    a = list(range(16))
    b = list(range(100, 116))
    assert block_keys(a + b, 16)[1] == block_keys(b, 16)[0]


_SNIPPET = (
    "from indexer.wire.keys import block_keys, namespace_seed, seeds_for_blocks;"
    "print(block_keys(list(range(32)), 16));"
    "print(namespace_seed('adapter-a', ['tenant-a']));"
    "print(seeds_for_blocks(3, 'adapter-a', [['adapter-a', 'tenant-a'], ['adapter-a'], None]))"
)


def _run_with_hashseed(seed: str) -> str:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=20,
        check=True,
    )
    return out.stdout


def test_R_KEY_2_stable_across_processes_and_hash_seeds():
    a = _run_with_hashseed("0")
    b = _run_with_hashseed("4242")
    assert a == b
    here = "\n".join([
        str(block_keys(list(range(32)), 16)),
        str(namespace_seed("adapter-a", ["tenant-a"])),
        str(seeds_for_blocks(3, "adapter-a", [["adapter-a", "tenant-a"], ["adapter-a"], None])),
    ]) + "\n"
    assert a == here


# ------------------------------------------------------------------------ R-KEY-1


def test_R_KEY_1_no_namespace_is_plain_seed():
    assert namespace_seed(None, None) == KEY_SEED
    assert namespace_seed(None, []) == KEY_SEED
    assert seeds_for_blocks(3, None, None) == KEY_SEED
    assert seeds_for_blocks(3, None, [None, None, None]) == KEY_SEED


def test_R_KEY_1_lora_and_salt_change_keys():
    toks = list(range(32))
    plain = block_keys(toks, 16)
    lora = block_keys(toks, 16, seeds_for_blocks(2, "a", None))
    other_lora = block_keys(toks, 16, seeds_for_blocks(2, "b", None))
    salted = block_keys(toks, 16, seeds_for_blocks(2, None, query_extra_keys(2, "s", None)))
    assert len({tuple(plain), tuple(lora), tuple(other_lora)}) == 3
    assert all(x != y for x, y in zip(plain, lora))
    # The salt rides on block 0 only: block 1 keeps the plain key.
    assert salted[0] != plain[0]
    assert salted[1] == plain[1]
    # LoRA + salt differs from LoRA alone on block 0 only.
    both = block_keys(toks, 16, seeds_for_blocks(2, "a", query_extra_keys(2, "s", None)))
    assert both[0] != lora[0] and both[0] != salted[0]
    assert both[1] == lora[1]


def test_R_KEY_1_lora_name_repeated_in_extra_keys_is_normalized():
    n = 2
    event_seeds = seeds_for_blocks(n, "a", [["a", "s"], ["a"]])
    query_seeds = seeds_for_blocks(n, "a", query_extra_keys(n, "s", None))
    assert event_seeds == query_seeds
    assert event_seeds[0] == namespace_seed("a", ["s"])
    assert event_seeds[1] == namespace_seed("a", None)
    # A CPU event (lora_name only, no extra_keys) gets the same seed as a GPU block
    # whose extra_keys only repeat the LoRA name.
    assert seeds_for_blocks(3, "a", [["a"], ["a"], ["a"]]) == seeds_for_blocks(3, "a", None)
    # Without the LoRA active, a first part equal to some string is a real part.
    assert seeds_for_blocks(1, None, [["a"]]) != seeds_for_blocks(1, None, None)


def _readme_msgpack(obj) -> bytes:
    """The MessagePack bytes of docs/design.md's ``[lora, [parts...]]`` for short strings:
    written out by hand from the MessagePack spec (fixarray 0x90|n, fixstr 0xa0|len,
    nil 0xc0), so the reference shares no encoder with ``indexer.wire.keys``."""
    if obj is None:
        return b"\xc0"
    if isinstance(obj, str):
        raw = obj.encode()
        assert len(raw) < 32
        return bytes([0xA0 | len(raw)]) + raw
    assert isinstance(obj, list) and len(obj) < 16
    return bytes([0x90 | len(obj)]) + b"".join(_readme_msgpack(x) for x in obj)


def _readme_seed(lora, parts) -> int:
    """docs/design.md, block keys: ``seed = xxh3_64(b"kvpi-ns1" + msgpack([lora, parts]), 1337)``."""
    return xxhash.xxh3_64_intdigest(b"kvpi-ns1" + _readme_msgpack([lora, list(parts)]), seed=1337)


def _readme_key(tokens, seed) -> int:
    """docs/design.md: xxh3-64 of the block's token ids as little-endian uint32."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


def test_R_KEY_1_R_KEY_2_readme_namespace_seed_formula_is_what_the_index_uses():
    """A caller computing keys from docs/design.md alone (xxhash, MessagePack by hand,
    seed 1337) gets ``namespace_seed``'s seeds and the keys the index stores for a
    real vLLM LoRA + salt event, so ``match_by_keys`` with them finds every block."""
    # The hand encoder is right about the spec: a known vector.
    assert _readme_msgpack(["a", ["s"]]) == bytes([0x92, 0xA1, 0x61, 0x91, 0xA1, 0x73])
    assert _readme_msgpack([None, []]) == b"\x92\xc0\x90"
    for lora, parts in [("adapter-a", ["tenant-a"]), ("adapter-a", []), (None, ["tenant-a"]),
                        ("adapter-b", ["tenant-a", "mm-digest"])]:
        assert namespace_seed(lora, parts) == _readme_seed(lora, parts), (lora, parts)
    assert _readme_seed("adapter-a", ["tenant-a"]) != _readme_seed("adapter-a", [])

    # The golden vLLM 0.33 LoRA + salt store: 3 blocks of 16 tokens, extra_keys
    # [[lora, salt], [lora], [lora]] (the LoRA name repeated, stripped per R-KEY-1).
    idx = _lora_index("v0.33.0")
    bs = 16
    blocks = [TOK[i * bs:(i + 1) * bs] for i in range(3)]
    lora_salt, lora_only = _readme_seed("adapter-a", ["tenant-a"]), _readme_seed("adapter-a", [])
    keys = [_readme_key(blocks[0], lora_salt)] + [_readme_key(b, lora_only) for b in blocks[1:]]
    assert len(set(keys) | {_readme_key(b, 1337) for b in blocks}) == 6  # namespaced != plain
    # The query side: the keys the library computes for a LoRA + salted query.
    n = len(blocks)
    assert block_keys(TOK, bs, seeds_for_blocks(n, "adapter-a", query_extra_keys(n, "tenant-a", None))) == keys
    # The store side: the index holds exactly these keys.
    w = idx.match_by_keys(keys).worker("e", 0)
    assert w is not None and w.tiers == {"GPU": 3, "CPU": 3} and w.total_blocks == 3
    assert idx.match(TOK, lora_name="adapter-a", cache_salt="tenant-a").worker("e", 0).total_blocks == 3
    # Keys from the plain seed, or the LoRA seed on block 0, match nothing.
    assert idx.match_by_keys([_readme_key(b, 1337) for b in blocks]).worker("e", 0) is None
    assert idx.match_by_keys([_readme_key(blocks[0], lora_only)] + keys[1:]).worker("e", 0) is None


def test_R_KEY_1_query_extra_keys_salt_on_block_0():
    assert query_extra_keys(3, None, None) is None
    assert query_extra_keys(3, "s", None) == [["s"], None, None]
    assert query_extra_keys(2, "s", [[("mm1", 0)], None]) == [[("mm1", 0), "s"], None]


def _lora_index(vdir: str) -> PrefixIndex:
    idx = PrefixIndex()
    assert idx.apply("e", payload(vdir, "lora_and_salt")) == "applied"
    return idx


TOK = list(range(20000, 20048))


@pytest.mark.parametrize("vdir", ["v0.23.0", "v0.24.0", "v0.33.0"])
def test_R_KEY_1_lora_and_salt_match_end_to_end(vdir):
    assert vdir in VERSIONS
    idx = _lora_index(vdir)
    st = idx.stats()
    assert st["events"]["BlockStored"].get("applied") == 2
    assert st["orphans"] == 0
    # The CPU event (no extra_keys) lands on the GPU event's nodes: 3 nodes, not 6.
    assert st["nodes"] == 3

    r = idx.match(TOK, lora_name="adapter-a", cache_salt="tenant-a")
    w = r.worker("e", 0)
    assert w is not None
    assert w.tiers.get("GPU") == 3
    assert w.tiers.get("CPU") == 3
    assert w.total_blocks == 3
    (wi,) = idx.workers()
    assert wi["resident_blocks"] == {"GPU": 3, "CPU": 3}


@pytest.mark.parametrize("vdir", ["v0.23.0", "v0.33.0"])
@pytest.mark.parametrize(
    "query",
    [
        {},                                                   # neither
        {"lora_name": "adapter-a"},                           # no salt
        {"cache_salt": "tenant-a"},                           # no LoRA
        {"lora_name": "adapter-b", "cache_salt": "tenant-a"},  # wrong LoRA
        {"lora_name": "adapter-a", "cache_salt": "tenant-b"},  # wrong salt
    ],
    ids=["plain", "lora_only", "salt_only", "other_lora", "other_salt"],
)
def test_R_KEY_1_wrong_namespace_matches_nothing(vdir, query):
    idx = _lora_index(vdir)
    r = idx.match(TOK, **query)
    assert r.worker("e", 0) is None
    assert r.best is None


def test_R_KEY_1_cpu_event_alone_keeps_lora_namespace():
    # Only the CPU chunk (lora_name, no extra_keys): it is stored under the LoRA
    # namespace, so an un-LoRA'd query never matches it.
    from golden import as_events, entries, unhex

    from indexer.producer.events import encode_batch

    (entry,) = [e for e in entries("v0.33.0") if e["file"] == "lora_and_salt.msgpack"]
    ts, events, dp = entry["decoded"]
    cpu = as_events(unhex(events))[1]
    assert cpu.medium == "CPU" and cpu.extra_keys is None
    idx = PrefixIndex()
    assert idx.apply("e", encode_batch([cpu], ts=ts, dp_rank=dp)) == "applied"
    assert idx.match(TOK).worker("e", 0) is None
    w = idx.match(TOK, lora_name="adapter-a").worker("e", 0)
    assert w is not None and w.tiers.get("CPU") == 3


# ------------------------------------------------------------------- token range


@pytest.mark.parametrize("bad", [2**32, -1, 2**64])
def test_R_BAD_1_token_ids_out_of_uint32_range_raise_overflow(bad):
    assert tokens_to_bytes([0, 2**32 - 1]) == struct.pack("<2I", 0, 2**32 - 1)
    with pytest.raises(OverflowError):
        tokens_to_bytes([1, 2, bad])
    with pytest.raises(OverflowError):
        block_keys([bad] + list(range(15)), 16)
    idx = PrefixIndex()
    assert idx.apply("e", payload("v0.33.0", "gpu_chain_1")) == "applied"
    with pytest.raises(OverflowError):
        idx.match(list(range(1000, 1047)) + [bad])
    # A valid query still works afterwards.
    assert idx.match(list(range(1000, 1048))).worker("e", 0).tiers["GPU"] == 3


def test_R_BAD_1_max_uint32_token_is_accepted_by_match():
    idx = PrefixIndex()
    assert idx.apply("e", payload("v0.33.0", "gpu_chain_1")) == "applied"
    r = idx.match([2**32 - 1] * 16)
    assert r.worker("e", 0) is None
