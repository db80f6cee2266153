"""PrefixIndex: vLLM KV events in, longest-prefix matches out.

Contract sections 2-4 and 6 (``docs/contract.md``) in one object, the sum of one
room per concern over the state they share (:class:`~.state.IndexState`):

* :mod:`indexer.store.apply`: :meth:`PrefixIndex.apply` decodes one batch payload
  exactly as it came off the wire and applies it to the trees of the worker's model
  (:mod:`indexer.store.place`: stores, placeholders, orphans);
  :mod:`indexer.store.removal`: removals, clears, freeing, the node cap;
* :mod:`.match`: :meth:`PrefixIndex.match` / :meth:`PrefixIndex.match_by_keys`
  answer which worker holds the longest prefix of a prompt, per tier and group,
  with the engine-style ``total`` and a best-replica score (:mod:`.prefixes`
  walks the trees);
* :mod:`indexer.store.lifecycle`: workers (drop, reset, stale marks, freshness) and
  :meth:`PrefixIndex.stats`.

Sequencing is not decided here: :mod:`.sequencer` owns the rule, which
:meth:`PrefixIndex.apply` applies and :meth:`PrefixIndex.apply_sequenced` trusts.

Every public method takes one lock, so a query never sees a half-applied batch
(R-Q-5) and waits behind at most one batch. The lock is cheap; the ingest layer
decides which threads call in.
"""

from __future__ import annotations

from indexer.query.match import Query
from indexer.query.peers import Peers
from indexer.store.apply import Store
from indexer.store.journal import APPLY, APPLY_SEQUENCED
from indexer.store.state import DEFAULT_CREDITS, DEFAULT_GROUP_KINDS, ModelRequiredError

__all__ = ["PrefixIndex", "DEFAULT_CREDITS", "DEFAULT_GROUP_KINDS", "ModelRequiredError"]


class PrefixIndex(Query, Peers, Store):
    """The in-process prefix index (no I/O, no threads of its own).

    Parameters
    ----------
    credits:
        Tier credits for the score (R-Q-3). Defaults GPU 1.0, CPU 0.75, STORAGE 0.25;
        a tier without a credit scores 0.
    total_chain:
        The tiers the engine loads from, in order, for ``total`` (R-Q-2).
    stale_factor:
        Multiplier applied to a stale worker's score when ranking (R-Q-3).
    max_orphans, orphan_ttl_s:
        Bounds of the orphan buffer (R-APP-3): buffered stores, and their age.
    max_nodes:
        Per-tree node cap; ``None`` for none. When exceeded, the least recently
        stored leaves are evicted with all their residency (R-APP-9).
    max_dp_rank, max_groups, max_tiers:
        Bounds on what a publisher can make the index allocate (R-BAD-3).
    """

    def apply(
        self,
        engine: str,
        payload: bytes,
        *,
        model: str = "default",
        dp_rank: int | None = None,
        seq: int | None = None,
    ) -> str:
        """Decode and apply one batch payload (frame 3 of a vLLM live message).

        ``dp_rank=None`` takes the rank from the batch (R-DEC-4: the batch's rank
        wins when present). With ``seq`` the sequencer's rule applies
        (:func:`indexer.sequence.sequencer.classify`): an already applied sequence is skipped
        (R-STR-1); one that goes backwards with a newer batch timestamp is an engine
        restart and drops the worker's residency first (R-STR-5); a forward jump is
        counted as a gap.

        Returns ``"applied"``, ``"duplicate"`` or ``"dropped"`` (the payload did not
        decode: counted per worker and reason, nothing indexed is touched, R-DEC-3).
        """
        with self._lock:
            if self._rec is not None:
                return str(self._rec.run_apply(APPLY, self._apply, engine, payload, model, dp_rank, seq, True)[0])
            return self._apply(engine, payload, model, dp_rank, seq, True)[0]

    def apply_sequenced(
        self, engine: str, payload: bytes, *, model: str = "default", dp_rank: int | None = None, seq: int
    ) -> float | None:
        """Apply one batch that a :class:`~indexer.sequence.sequencer.Stream` already sequenced
        (no decision is made again here); record ``seq`` as the worker's last.

        Returns the batch's ts, or None when the payload did not decode.
        """
        with self._lock:
            if self._rec is not None:
                return self._rec.run_apply(APPLY_SEQUENCED, self._apply,  # type: ignore[no-any-return]
                                           engine, payload, model, dp_rank, seq, False)[1]
            return self._apply(engine, payload, model, dp_rank, seq, False)[1]
