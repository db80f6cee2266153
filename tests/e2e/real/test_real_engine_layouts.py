"""The claims held to real engines in the other set-ups vLLM offers.

- Block size 128 (the CPU backend's default), with the two xxhash-based
  ``prefix_caching_hash_algo`` settings, one engine with int block hashes and one with
  bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``): four hash set-ups in this tier in
  all, with the two sha256 ones of test_real_engines.py.
- A hybrid model (Gemma 3's text model: a sliding-window layer and a full-attention
  layer, so two KV-cache groups): the index's engine-style total over both groups must
  be what the engine reuses (the window group's hit rule applied, R-APP-12).
"""

from __future__ import annotations

import pytest

from fleet import Tally, Workload, report, run_routed, start_engines, start_index
from vllm_engine import VllmEngine

MODEL = "tiny"


@pytest.fixture
def engines(engine_python, engine_logs):
    made: list[VllmEngine] = []

    def make(*specs: dict) -> dict[str, VllmEngine]:
        for spec in specs:
            spec = dict(spec)
            made.append(VllmEngine(engine_python, spec.pop("model_dir"), spec.pop("name"), engine_logs, **spec))
        start_engines(made)
        return {e.name: e for e in made}

    yield make
    for e in made:
        e.kill()


def claims(fleet: dict[str, VllmEngine], model_dir: str, work: Workload, name: str, n: int = 120) -> Tally:
    """``n`` routed requests of ``work`` on ``fleet`` behind a new index: both engines
    used, prefixes reused, and at least 99% of the claims exact."""
    srv = start_index(list(fleet.values()), model_dir)
    try:
        tally = run_routed(srv, fleet, MODEL, work, n)
    finally:
        srv.stop()
    report(name, tally)
    assert len(tally.routed) == 2 and tally.reused_tokens > 0, tally.line()
    assert tally.total_exact >= 0.99 * tally.total, tally.misses[:5]
    return tally


def test_block_size_128_with_xxhash_and_xxhash_cbor_int_and_bytes(engines, tiny_model):
    fleet = engines(dict(model_dir=tiny_model, name="x1", block_size=128, gpu_blocks=24, max_model_len=2048,
                         hash_algo="xxhash", int_hashes=True),
                    dict(model_dir=tiny_model, name="x2", block_size=128, gpu_blocks=24, max_model_len=2048,
                         hash_algo="xxhash_cbor", int_hashes=False))
    tally = claims(fleet, tiny_model, Workload(5, 128, 2048, {"tokens": 60, "salt": 15, "prompt": 10, "messages": 15}),
                   "bs128 (x1 xxhash/int, x2 xxhash_cbor/bytes)")
    assert tally.misses == [], tally.misses[:5]


def test_a_hybrid_models_engine_style_total_equals_cached_tokens(engines, hybrid_model):
    """Sliding window 64 tokens over 32-token blocks: vLLM reuses a prefix only when the
    full-attention group holds all of it and the window group holds its last window."""
    fleet = engines(dict(model_dir=hybrid_model, name="h1", block_size=32, gpu_blocks=128, max_model_len=1024),
                    dict(model_dir=hybrid_model, name="h2", block_size=32, gpu_blocks=128, max_model_len=1024))
    tally = claims(fleet, hybrid_model, Workload(9, 32, 1024, {"tokens": 70, "salt": 10, "prompt": 10, "messages": 10}),
                   "hybrid (sliding window 64 + full attention, bs32)")
    assert tally.misses == [], tally.misses[:5]
