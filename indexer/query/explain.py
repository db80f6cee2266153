"""Explain one prompt: per block and per worker, which tiers hold it, which tier the
engine would load it from, and where (and why) each worker's match ends.

A query (layer 5), like :meth:`PrefixIndex.match`: it takes the index lock once, walks
the tree of the model's headline group along the prompt's block keys (one walk, for
this prompt only) and reads residency off the nodes it passed. The totals are the
ones :meth:`PrefixIndex.match` answers (the same ``match_model`` under the same lock), so
the grid never disagrees with ``/v1/match``; what this adds is the per-block detail
and the reason each match stops. Nothing periodic calls it (``api/ui.py`` serves it on
demand, for one prompt).

Why a worker's match ends where it does (``end_reason``):

* ``end_of_prompt``: every block of the prompt counts;
* ``missing_block``: the worker holds the next block in no tier (or no worker does:
  the tree has no node for it);
* ``cpu_chunk_boundary``: the worker holds the next block in a non-GPU tier, but not
  its whole chunk (the chunk runs past the prompt's end, or part of it was evicted):
  a connector loads whole chunks only (R-APP-5);
* ``not_contiguous``: it holds the next block (e.g. on GPU) but the engine would not
  reach it: the run before it is broken.

``stale`` (with ``stale_reason``) is reported beside it: the index may be out of date
for that worker, whatever it holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from indexer.query.prefixes import tier_chunks
from indexer.store.state import GPU
from indexer.store.tree import walk
from indexer.wire.keys import KEY_SEED, block_keys, query_extra_keys, seeds_for_blocks, tokens_to_bytes

if TYPE_CHECKING:
    from indexer.query.match import Query
    from indexer.store.state import WorkerState

__all__ = ["explain", "MAX_EXPLAIN_BLOCKS"]

# Blocks shown at most (a grid wider than this is unreadable; the totals stay exact).
MAX_EXPLAIN_BLOCKS = 1024


def explain(index: Query, token_ids: Sequence[int] | bytes, *, model: str | None = "default",
            lora_name: str | None = None, cache_salt: str | None = None,
            max_blocks: int = MAX_EXPLAIN_BLOCKS) -> dict[str, Any]:
    """The grid of one prompt (read-only; see the module docstring).

    Returns ``{"model", "group", "block_size", "query_blocks", "shown_blocks", "tiers",
    "workers": [...]}``; each worker: ``engine``, ``dp_rank``, ``held`` (per shown
    block, the tier names holding it), ``loaded`` (per shown block, the tier it would
    be loaded from, or None), ``gpu_blocks``, ``total_blocks`` (in this group),
    ``headline_total_blocks`` (``/v1/match``'s ``total_blocks``), ``predicted_blocks``,
    ``end_reason``, ``stale``, ``stale_reason``. Raises KeyError for an unknown model,
    like :meth:`PrefixIndex.match`."""
    buf = token_ids if isinstance(token_ids, bytes) else tokens_to_bytes(token_ids)
    ntok = len(buf) // 4
    cache: dict[int, list[int]] = {}

    def keys_at(bs: int) -> list[int]:
        ks = cache.get(bs)
        if ks is None:
            n = ntok // bs
            if not lora_name and cache_salt is None:
                seed: Any = KEY_SEED
            else:
                seed = seeds_for_blocks(n, lora_name, query_extra_keys(n, cache_salt, None))
            ks = cache[bs] = block_keys(buf, bs, seed, n)
        return ks

    def keys_for(bs: int) -> Iterator[list[int]]:
        yield keys_at(bs)

    with index.lock:
        m = index.model_state(model)
        res = index.match_model(m, keys_for, ntok)
        head_total = {(w.engine, w.dp_rank): w.total_blocks for w in res.workers}
        workers = sorted(m.workers.values(), key=lambda w: (w.engine, w.dp_rank))
        names = index.tier_names
        base = {"model": m.name, "tiers": list(names)}
        if not m.trees:
            qb = ntok // index.default_block_size
            return {**base, "group": None, "block_size": None, "query_blocks": qb, "shown_blocks": 0,
                    "workers": [_row(w, [], [], 0, 0, 0, 0, "missing_block" if qb else "end_of_prompt")
                                for w in workers]}
        group = m.default_groups()[0]
        tree = m.trees[group]
        bs = tree.block_size
        keys = keys_at(bs)
        nq = len(keys)
        _, _, _, path = walk(tree.root, [keys], True)
        path = path or []
        other = tier_chunks(m, group, path) if m.tiered else {}
        inflight = index.inflight
        pred = inflight.predicted(m.name, iter([keys]), index.now()) if m.name in inflight.tries else {}
        chain = [index.tier_id(t) for t in index.total_chain]
        shown = min(nq, max_blocks)
        rows = []
        for w in workers:
            bit = w.bit
            held: list[list[str]] = []
            gpu_run = 0
            broken = False
            for d, node in enumerate(path):
                here = ["GPU"] if node.gpu & bit else []
                tiers = node.tiers
                if tiers:
                    here.extend(names[t] for t, mk in sorted(tiers.items()) if t > 0 and mk & bit)
                held.append(here)
                if not broken and node.gpu & bit:
                    gpu_run = d + 1
                else:
                    broken = True
            loaded: list[str | None] = ["GPU"] * gpu_run + [None] * (len(path) - gpu_run)
            pos = gpu_run
            for t in chain:
                if t is None or t == GPU:
                    continue
                for s, e in other.get(t, {}).get(w.wid, ()):
                    if s <= pos + 1 and e > pos:
                        for i in range(pos, e):
                            loaded[i] = names[t]
                        pos = e
            if pos >= nq:
                reason = "end_of_prompt"
            elif pos >= len(path) or not held[pos]:
                reason = "missing_block"
            elif any(t != "GPU" for t in held[pos]):
                reason = "cpu_chunk_boundary"
            else:
                reason = "not_contiguous"
            held += [[]] * (nq - len(held))
            loaded += [None] * (nq - len(loaded))
            rows.append(_row(w, held[:shown], loaded[:shown], gpu_run, pos,
                             head_total.get((w.engine, w.dp_rank), 0),
                             pred.get((w.engine, w.dp_rank), 0), reason))
        return {**base, "group": str(group), "block_size": bs, "query_blocks": nq, "shown_blocks": shown,
                "workers": rows}


def _row(w: WorkerState, held: list[list[str]], loaded: list[str | None], gpu: int, total: int, head: int,
         predicted: int, reason: str) -> dict[str, Any]:
    return {"engine": w.engine, "dp_rank": w.dp_rank, "worker": f"{w.engine}/{w.dp_rank}",
            "held": held, "loaded": loaded, "gpu_blocks": gpu, "total_blocks": total,
            "headline_total_blocks": head, "predicted_blocks": predicted, "end_reason": reason,
            "stale": w.stale, "stale_reason": w.stale_reason}
