"""Workers come and go (R-STR-5, R-STR-6): registration, reset, removal, stale
marks, and what the index reports of them (``workers``, ``stats``). ``stats`` reads
counters kept up to date; it never walks a tree."""

from __future__ import annotations

from typing import Any

from indexer.store.journal import (
    CLEAR_ENGINE,
    CLEAR_STALE,
    DROP_ENGINE,
    DROP_WORKER,
    EXPIRE,
    MARK_STALE,
    REGISTER,
    RESET_WORKER,
)
from indexer.store.removal import Removal
from indexer.store.state import _EVENT_NAMES, DEFAULT_GROUP_KINDS, MAX_IDLE_MODELS, ModelState, WorkerState

__all__ = ["Lifecycle"]


class Lifecycle(Removal):
    """Worker lifecycle and reports."""

    def _worker(self, engine: str, rank: int, model: str) -> WorkerState:
        w = self._workers.get((engine, rank))
        if w is not None:
            if w.model == model:
                return w
            # The engine moved to another model pool: its old state is meaningless.
            self._remove_worker(w)
        if self._free_wids:
            wid = self._free_wids.pop()
        else:
            wid = self._next_wid
            self._next_wid += 1
        mo = self._models.get(model)
        if mo is None:
            mo = self._models[model] = ModelState(model)
        elif not mo.workers:
            self._idle_models.pop(model, None)
        w = WorkerState(wid, engine, rank, model, mo.rows)
        self._workers[(engine, rank)] = w
        mo.workers[wid] = w
        mo.ranked = False
        return w

    def _remove_worker(self, w: WorkerState) -> None:
        self._drop_worker_tiers(w, None)
        del self._workers[(w.engine, w.dp_rank)]
        mo = self._models[w.model]
        mo.workers.pop(w.wid, None)
        w.rows[w.wid] = None
        self._free_wids.append(w.wid)
        if not mo.workers:
            # Its last worker left (its nodes went with their residency). Models come
            # and go with registrations: past MAX_IDLE_MODELS idle ones, the oldest goes.
            idle = self._idle_models
            idle[w.model] = None
            if len(idle) > MAX_IDLE_MODELS:
                old = next(iter(idle))
                del idle[old]
                gone = self._models.pop(old)
                for tree in gone.trees.values():
                    tree.clear()

    def _restart(self, w: WorkerState) -> None:
        self._drop_worker_tiers(w, None)
        w.restarts += 1
        w.last_seq = None
        w.refresh()
        self._count("restarts")

    def drop_worker(self, engine: str, dp_rank: int = 0) -> bool:
        """Forget one worker and all its residency. Returns False when unknown."""
        with self._lock:
            if self._rec is not None:
                return bool(self._rec.run(DROP_WORKER, self._drop_worker, (engine, dp_rank)))
            return self._drop_worker(engine, dp_rank)

    def _drop_worker(self, engine: str, dp_rank: int) -> bool:
        w = self._workers.get((engine, dp_rank))
        if w is None:
            return False
        self._remove_worker(w)
        return True

    def drop_engine(self, engine: str) -> int:
        """Forget every DP rank of ``engine``; returns how many workers went."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(DROP_ENGINE, self._drop_engine, (engine,)))
            return self._drop_engine(engine)

    def _drop_engine(self, engine: str) -> int:
        ws = [w for (e, _), w in self._workers.items() if e == engine]
        for w in ws:
            self._remove_worker(w)
        return len(ws)

    def reset_worker(self, engine: str, dp_rank: int = 0) -> bool:
        """Drop one worker's residency but keep it known (an engine restart)."""
        with self._lock:
            if self._rec is not None:
                return bool(self._rec.run(RESET_WORKER, self._reset_worker, (engine, dp_rank)))
            return self._reset_worker(engine, dp_rank)

    def _reset_worker(self, engine: str, dp_rank: int) -> bool:
        w = self._workers.get((engine, dp_rank))
        if w is None:
            return False
        self._restart(w)
        return True

    def clear_engine(self, engine: str) -> int:
        """An operator's word that ``engine``'s prefix cache was reset (vLLM's
        ``POST /reset_prefix_cache``): every DP rank's GPU and CPU residency goes now, as
        the ``AllBlocksCleared`` would (R-APP-8) that vLLM publishes only with its next
        engine step, which an idle engine never takes. Sequence positions are kept: that
        event, when it comes, applies in order and clears nothing more. Returns how many
        workers were cleared (0: the engine is unknown)."""
        with self._lock:
            if self._rec is not None:
                return int(self._rec.run(CLEAR_ENGINE, self._clear_engine, (engine,)))
            return self._clear_engine(engine)

    def _clear_engine(self, engine: str) -> int:
        ws = [w for (e, _), w in self._workers.items() if e == engine]
        for w in ws:
            self._on_clear(w)
            w.refresh()
        if ws:
            self._count("clears_requested")
        return len(ws)

    def register_worker(self, engine: str, dp_rank: int = 0, *, model: str = "default") -> None:
        """Make a worker known before its first event (so freshness can report it)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(REGISTER, self._worker, (engine, dp_rank, model))
            else:
                self._worker(engine, dp_rank, model)

    def worker_position(self, engine: str, dp_rank: int = 0) -> tuple[int | None, float | None, bool] | None:
        """``(last_seq, last_ts, stale)`` of a worker (where its stream stands), or None."""
        with self._lock:
            w = self._workers.get((engine, dp_rank))
            return None if w is None else (w.last_seq, w.last_ts, w.stale)

    def mark_stale(self, engine: str, dp_rank: int = 0, reason: str = "stale") -> None:
        """Mark a worker stale with ``reason``; its index is kept and answers say so."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(MARK_STALE, self._mark_stale, (engine, dp_rank, reason))
            else:
                self._mark_stale(engine, dp_rank, reason)

    def _mark_stale(self, engine: str, dp_rank: int, reason: str) -> None:
        w = self._workers.get((engine, dp_rank))
        if w is not None:
            if not w.stale:
                self._count("stale_marked")
            w.stale = True
            w.stale_reason = reason
            w.refresh()

    def clear_stale(self, engine: str, dp_rank: int = 0) -> None:
        """Clear a worker's stale mark (after a successful recovery)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(CLEAR_STALE, self._clear_stale, (engine, dp_rank))
            else:
                self._clear_stale(engine, dp_rank)

    def _clear_stale(self, engine: str, dp_rank: int) -> None:
        w = self._workers.get((engine, dp_rank))
        if w is not None and w.stale:
            w.stale = False
            w.stale_reason = None
            w.refresh()
            self._count("stale_cleared")

    def _expire_due(self) -> None:
        """End what is due in flight (the caller holds the lock): a journaled call while
        recording, since what ends now changes later answers."""
        inf = self.inflight
        if not inf._heap:
            return
        if self._rec is not None:
            self._rec.run(EXPIRE, inf.expire, ())
        else:
            inf.expire(self._clock())

    def workers(self) -> list[dict[str, Any]]:
        """Per-worker freshness, sizes and in-flight load, sorted by engine then rank."""
        with self._lock:
            self._expire_due()
            now = self._clock()
            out = []
            for (engine, rank), w in sorted(self._workers.items()):
                res: dict[str, int] = {}
                by_group: dict[str, dict[str, int]] = {}
                for g, wg in w.groups.items():
                    gd = by_group[str(g)] = {}
                    for tid, c in enumerate(wg.res):
                        if c:
                            name = self._tier_names[tid]
                            res[name] = res.get(name, 0) + c
                            gd[name] = c
                out.append({
                    "engine": engine,
                    "dp_rank": rank,
                    "model": w.model,
                    "stale": w.stale,
                    "stale_reason": w.stale_reason,
                    "last_seq": w.last_seq,
                    "last_event_age_s": None if w.last_apply is None else round(now - w.last_apply, 6),
                    "batches": w.batches,
                    "gaps": w.gaps,
                    "restarts": w.restarts,
                    "dropped": dict(w.dropped),
                    "resident_blocks": res,
                    "resident_by_group": by_group,  # KV-cache group -> tier -> blocks
                    "orphans": sum(len(v) for wg in w.groups.values() for v in wg.orphans.values()),
                    "in_flight": self._in_flight_of((engine, rank)),
                })
            return out

    def _in_flight_stats(self) -> dict[str, Any]:
        """The routing bookkeeping's sizes and outcomes (counters only: no walk)."""
        inf = self.inflight
        self._expire_due()
        return {
            "requests": len(inf.requests),
            "prefill_tokens": sum(inf.prefill.values()),
            "decode_blocks": sum(inf.decode.values()),
            "predicted_nodes": inf.nodes,
            "outcomes": dict(inf.counters),
        }

    def _in_flight_of(self, key: tuple[str, int]) -> dict[str, int]:
        inf = self.inflight
        prefill, decode = inf.load(key)
        return {"requests": inf.worker_requests(key), "prefill_tokens": prefill, "decode_blocks": decode}

    def model_workers(self, model: str | None = "default") -> list[tuple[str, int, bool]]:
        """``(engine, dp_rank, stale)`` of every worker of ``model``, in no particular order
        (cheap: no sizes, no sort; ``indexer.query.route`` ranks them itself).

        Raises KeyError like :meth:`match` when the model is unknown."""
        with self._lock:
            m = self.model_state(model)
            return [(w.engine, w.dp_rank, w.stale) for w in m.workers.values()]

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def block_size(self, model: str = "default") -> int | None:
        """Block size of the model's headline group (None before its first rich store)."""
        with self._lock:
            m = self._models.get(model)
            if m is None or not m.trees:
                return None
            return m.trees[m.default_groups()[0]].block_size

    def stats(self) -> dict[str, Any]:
        """Sizes and counters, JSON-able; reads counters only (no tree walk)."""
        with self._lock:
            names = self._tier_names
            models: dict[str, dict[str, Any]] = {}
            tot_nodes = tot_entries = tot_orphans = 0
            for name, m in sorted(self._models.items()):
                groups: dict[str, dict[str, Any]] = {}
                m_entries = m_orphans = 0
                for g, tree in sorted(m.trees.items()):
                    groups[str(g)] = {
                        "kind": m.kinds.get(g),
                        "block_size": tree.block_size,
                        "default": m.kinds.get(g) in DEFAULT_GROUP_KINDS,
                        "nodes": tree.nodes,
                        "tiers": {},
                    }
                for w in m.workers.values():
                    for g, wg in w.groups.items():
                        gd = groups.setdefault(
                            str(g), {"kind": None, "block_size": None, "default": True, "nodes": 0, "tiers": {}}
                        )
                        o = sum(len(v) for v in wg.orphans.values())
                        m_orphans += o
                        for tid, c in enumerate(wg.res):
                            if c:
                                gd["tiers"][names[tid]] = gd["tiers"].get(names[tid], 0) + c
                                m_entries += c
                nodes = sum(t.nodes for t in m.trees.values())
                tiers: dict[str, int] = {}
                for gd in groups.values():
                    for t, c in gd["tiers"].items():
                        tiers[t] = tiers.get(t, 0) + c
                models[name] = {
                    "nodes": nodes,
                    "resident_entries": m_entries,
                    "orphans": m_orphans,
                    "workers": len(m.workers),
                    "tiers": tiers,
                    "groups": groups,
                }
                tot_nodes += nodes
                tot_entries += m_entries
                tot_orphans += m_orphans
            events = {
                name: dict(sorted(c.items()))
                for name, c in zip(_EVENT_NAMES + ("unknown",), self._events)
                if c
            }
            return {
                "nodes": tot_nodes,
                "resident_entries": tot_entries,
                "orphans": tot_orphans,
                "workers": len(self._workers),
                "stale_workers": sum(1 for w in self._workers.values() if w.stale),
                "models": models,
                "events": events,
                "dropped_payloads": dict(sorted(self._dropped.items())),
                "counters": dict(sorted(self._counters.items())),
                "tiers": list(names),
                "in_flight": self._in_flight_stats(),
            }
