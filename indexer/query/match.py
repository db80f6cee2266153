"""Queries (contract §6): which worker holds the longest prefix of a prompt, per
tier and group, with the engine-style ``total`` and the best-replica score, and the
routes built on them. They take the index lock, make the prompt's block keys and
add what routing predicts; :mod:`.prefixes` walks the trees. The only state they
touch is the lazy ranking of a model's workers (``ModelState.rank``, a cache of the
(engine, dp_rank) order that answers come out in) and, for a route, the in-flight
record; never what the index holds (R-Q-4)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from indexer._native import core as _core
from indexer.query.answers import MatchResult
from indexer.query.prefixes import Prefixes
from indexer.query.route import (
    BODY,
    DICTS,
    KEEP,
    STRUCTS,
    Load,
    Ranking,
    RouteBody,
    RouteResponse,
    rank,
    spread_unseen,
)
from indexer.store.journal import (
    CORRECT_LOAD,
    MATCH,
    MATCH_BY_KEYS,
    MATCH_PLAIN,
    ROUTE,
    ROUTE_DONE,
    TIE_SLOT,
)
from indexer.wire.keys import (
    KEY_SEED,
    block_keys,
    query_extra_keys,
    seeds_for_blocks,
    tokens_to_bytes,
)

if TYPE_CHECKING:
    from indexer.query.prefixes import KeysFor

__all__ = ["KeySource", "Query"]


class Query(Prefixes):
    """Matches and routes."""

    def match(
        self,
        token_ids: Sequence[int],
        *,
        model: str | None = "default",
        lora_name: str | None = None,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> MatchResult:
        """Longest-prefix match of a prompt for every worker of ``model`` (R-Q-1, R-Q-2).

        ``token_ids`` are ints, or already their little-endian uint32 bytes (as
        the service's ``api.surface.split_json_tokens`` reads them from a request). Keys are computed
        for every full block at each group's block size; a trailing partial block
        is ignored. Changes nothing the index holds (R-Q-4); the first query after a
        worker joins re-ranks the model's workers (a cache of their (engine, dp_rank)
        order, under the lock), the only write a query makes.

        Raises
        ------
        KeyError
            When ``model`` is not indexed (or is None while several models are).
        OverflowError, TypeError
            When a token id is not an int in ``[0, 2**32-1]``.
        """
        return self._match_tokens(token_ids, model, lora_name, cache_salt, extra_keys)[0]

    def _match_tokens(self, token_ids: Sequence[int], model: str | None, lora_name: str | None,
                      cache_salt: str | None, extra_keys: Sequence[Any] | None = None
                      ) -> tuple[MatchResult, KeysFor, int]:
        """:meth:`match`, plus the query's key source and its token count (for a route
        to record). Predictions, when the model has any, come in ``predicted``."""
        src = KeySource(token_ids, lora_name, cache_salt, extra_keys)
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            if self._rec is not None:
                return self._rec.run(MATCH, self._match_keys, (src, model)), src, src.ntok
            return self._match_keys(src, model), src, src.ntok

    def _match_keys(self, keys_for: KeysFor, model: str | None) -> MatchResult:
        """:meth:`match` of a prompt given as its key source (the caller holds the lock):
        what a replay calls with the keys a recording kept."""
        m = self.model_state(model)
        res = self.match_model(m, keys_for, keys_for.ntok)  # type: ignore[attr-defined]  # a KeySource
        tries = self.inflight.tries
        if tries and m.name in tries:
            res = self._with_predictions(res, keys_for)
        return res

    def _with_predictions(self, res: MatchResult, keys_for: KeysFor) -> MatchResult:
        """``res`` with the blocks routed prompts will add beyond what each worker announced."""
        bs = res.block_size or self.default_block_size
        pred = self.inflight.predicted(res.model, keys_for(bs), self._clock())
        if not pred:
            return res
        totals = {(w[2], w[3]): -w[1] for w in res.workers}
        credit = self.predicted_credit
        extra = [(d - totals.get(k, 0), k) for k, d in pred.items() if d > totals.get(k, 0)]
        if not extra:
            return res
        extra.sort(key=lambda x: (-x[0], x[1]))
        return res._replace(predicted=tuple((k[0], k[1], n, n * credit) for n, k in extra))

    def route(self, token_ids: Sequence[int], *, model: str | None = "default", lora_name: str | None = None,
              cache_salt: str | None = None, load: Mapping[str, Load] | None = None,
              candidates: Iterable[str] | None = None, prefill_load_scale: float = 1.0, record: bool = True,
              max_tokens: int | None = None,
              link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None) -> dict[str, Any]:
        """The best worker for a prompt (:func:`indexer.query.route.route`; the ``POST
        /v1/route`` body): the announced prefix plus predicted blocks (credit
        ``predicted_credit``) against load: the caller's ``load`` for the workers it
        names, the index's own in-flight estimate for the others.

        With ``record`` (the default) the decision is recorded (:mod:`.inflight`): the
        chosen worker's prompt blocks become predicted and its uncached prefill tokens
        in-flight load until the worker announces them (or ``prefill_ttl_s``), plus
        decode blocks for ``max_tokens`` until :meth:`route_done` (or ``decode_ttl_s``).
        The answer's ``request_id`` names it (None without ``record``)."""
        ranking, rid = self._route(token_ids, model, lora_name, cache_salt, load, candidates, prefill_load_scale,
                                   record, max_tokens, link, DICTS)
        out = ranking.answer()
        out["request_id"] = rid
        return out

    def route_response(self, token_ids: Sequence[int], *, model: str | None = "default",
                       lora_name: str | None = None, cache_salt: str | None = None,
                       load: Mapping[str, Load] | None = None, candidates: Iterable[str] | None = None,
                       prefill_load_scale: float = 1.0, record: bool = True, max_tokens: int | None = None,
                       link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None) -> RouteResponse:
        """:meth:`route`, its answer as msgspec structs (:class:`~indexer.query.route.RouteResponse`,
        encoded to the same JSON as :meth:`route`'s dict): what the service writes out. A
        large fleet's answer lists hundreds of entries; as structs they cost about half as
        much to build and encode, and none is tracked by the cycle collector."""
        ranking, rid = self._route(token_ids, model, lora_name, cache_salt, load, candidates, prefill_load_scale,
                                   record, max_tokens, link, STRUCTS)
        return ranking.response(rid)

    def route_body(self, token_ids: Sequence[int], *, model: str | None = "default",
                   lora_name: str | None = None, cache_salt: str | None = None,
                   load: Mapping[str, Load] | None = None, candidates: Iterable[str] | None = None,
                   prefill_load_scale: float = 1.0, record: bool = True, max_tokens: int | None = None,
                   link: Mapping[tuple[str, int], tuple[bool, bool]] | None = None) -> RouteBody:
        """:meth:`route`, its answer as the JSON bytes the service sends (byte for byte
        :meth:`route_response` encoded by msgspec), with its first two ranked entries as
        structs (:class:`~indexer.query.route.RouteBody`). The compiled core writes the
        ranked entries straight from the ranking, no object per candidate: a fleet of
        hundreds of workers answered as structs spent most of the route making them and
        encoding them."""
        ranking, rid = self._route(token_ids, model, lora_name, cache_salt, load, candidates, prefill_load_scale,
                                   record, max_tokens, link, BODY)
        return ranking.route_body(rid)

    def _route(self, token_ids: Sequence[int], model: str | None, lora_name: str | None, cache_salt: str | None,
               load: Mapping[str, Load] | None, candidates: Iterable[str] | None, prefill_load_scale: float,
               record: bool, max_tokens: int | None, link: Mapping[tuple[str, int], tuple[bool, bool]] | None,
               form: int) -> tuple[Ranking, str | None]:
        """:meth:`route`'s decision and its request id (None without ``record``); records
        it with ``record``. The match, the ranking and the record are one section under
        the lock, so no batch lands between what the route saw and what it recorded."""
        src = KeySource(token_ids, lora_name, cache_salt, None)
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            if self._rec is not None:
                if candidates is not None and not isinstance(candidates, (list, tuple, set, frozenset)):
                    candidates = list(candidates)  # journaled as given, and still there to rank
                return self._rec.run(ROUTE, self._route_keys,  # type: ignore[no-any-return]
                                     (src, model, load, candidates, prefill_load_scale, record, max_tokens,
                                      None if link is None else dict(link), form))
            return self._route_keys(src, model, load, candidates, prefill_load_scale, record, max_tokens, link,
                                    form)

    def _route_keys(self, keys_for: KeysFor, model: str | None, load: Mapping[str, Load] | None,
                    candidates: Iterable[str] | None, prefill_load_scale: float, record: bool,
                    max_tokens: int | None, link: Mapping[tuple[str, int], tuple[bool, bool]] | None,
                    form: int) -> tuple[Ranking, str | None]:
        """:meth:`_route` of a prompt given as its key source (the caller holds the lock):
        what a replay calls with the keys a recording kept. With ``record`` the route's
        decision goes in flight. ``form`` is how the entries are written (DICTS, STRUCTS
        or BODY: :mod:`indexer.query.route`); a recording kept it as a bool before BODY
        (False, True: the same 0, 1)."""
        ntok: int = keys_for.ntok  # type: ignore[attr-defined]  # a KeySource
        res = self._match_keys(keys_for, model)
        if res.block_size is None:  # nothing stored yet: the prompt's size in default blocks
            dbs = self.default_block_size
            res = res._replace(block_size=dbs, query_blocks=ntok // dbs)
        m = self.model_state(res.model)
        if not m.ranked:
            m.rank()  # the rows' positions are the (engine, dp_rank) order the ranking ties by
        known = m.rows  # the workers' table
        inf = self.inflight
        now = self._clock()
        inf.expire(now)
        busy = inf.prefill or inf.decode or inf.engine_extra  # else: nothing to ask per worker
        in_flight = inf.loads() if busy else None
        unseen = inf.unseen(now) if not load and inf.peer_pace else None

        def ranked(in_flight: Mapping[tuple[str, int], tuple[int, int]] | None, head: int) -> Ranking:
            return rank(res, known, load=load, candidates=candidates, prefill_load_scale=prefill_load_scale,
                        link=link, in_flight=in_flight, index_load=True, structs=form >= STRUCTS,
                        tie_slot=self.tie_slot, body=form == BODY, head=head)

        ranking = ranked(in_flight, len(unseen) + 1 if unseen else KEEP)
        if unseen:
            # Other replicas are likely routing unseen at this instant: weigh their decisions
            # (InFlight.unseen), and rank again when that moves the best.
            extra = spread_unseen(ranking.ranked, ranking.structs, unseen, res.query_blocks,
                                  res.block_size, prefill_load_scale)  # type: ignore[arg-type]
            if extra:
                spread = dict(in_flight) if in_flight else {}
                for w, tok in extra.items():
                    pre, dec = spread.get(w, (0, 0))
                    spread[w] = (pre + tok, dec)
                inf.counters["spread"] += 1
                ranking = ranked(spread, KEEP)
        rid = None
        if record:
            bs: int = res.block_size  # type: ignore[assignment]  # set just above when None
            _, engine, dp_rank, _, _, cached, predicted = ranking.head()
            held = (cached + predicted) * bs
            decode = -(-(ntok + max_tokens) // bs) if max_tokens else 0
            keys = chain.from_iterable(keys_for(bs))  # InFlight copies them into one array
            rid = inf.record(res.model, (engine, dp_rank), keys, ntok - held, decode,
                             predict=cached < ntok // bs)
        if self._rec is not None and keys_for.__class__ is KeySource:
            keys_for.settle()  # before the record reaches the writer
        return ranking, rid

    def set_tie_slot(self, slot: int, of: int) -> None:
        """Make this index replica ``slot`` of ``of`` routers over the same fleet: sets
        where its routes start a tie on cost and score (:func:`indexer.query.route.route`,
        ``tie_slot``), so replicas that route in the same instant without seeing each
        other's decisions spread a burst as one router would, instead of all taking the
        first worker. ``(0, 1)``, the default, is one router: (engine id, rank) order.

        Raises
        ------
        ValueError
            Unless ``slot`` and ``of`` are ints with ``0 <= slot < of``.
        """
        if not (isinstance(slot, int) and isinstance(of, int)) or isinstance(slot, bool) or isinstance(of, bool):
            raise ValueError(f"tie slot must be ints, not {slot!r} of {of!r}")
        if not 0 <= slot < of:
            raise ValueError(f"tie slot must satisfy 0 <= slot < of, not {slot} of {of}")
        with self._lock:
            if self._rec is not None:
                self._rec.run(TIE_SLOT, self._set_tie_slot, (slot, of))
            else:
                self._set_tie_slot(slot, of)

    def _set_tie_slot(self, slot: int, of: int) -> None:
        self.tie_slot = (slot, of)

    def correct_load(self, worker: tuple[str, int], waiting: float, running: float, t: float) -> None:
        """A worker's engine reported its queue (vLLM metrics): correct the in-flight
        estimate (:meth:`indexer.store.inflight.InFlight.correct`)."""
        with self._lock:
            if self._rec is not None:
                self._rec.run(CORRECT_LOAD, self.inflight.correct, (tuple(worker), waiting, running, t))
            else:
                self.inflight.correct(worker, waiting, running, t)

    def route_first_token(self, request_id: str) -> bool:
        """Request ``request_id`` (a route's answer) returned its first token: its prefill
        load ends (its predicted prefix stays until announced). False when not in prefill."""
        with self._lock:
            return self.inflight.first_token(request_id)

    def headline_block_size(self, model: str | None) -> int:
        """The block size ``model``'s answers count in (its headline group's; the default
        block size before its first store). Raises KeyError for an unknown model."""
        with self._lock:
            m = self.model_state(model)
            return m.trees[m.default_groups()[0]].block_size if m.trees else self.default_block_size

    def route_done(self, request_id: str) -> bool | None:
        """Request ``request_id`` (a route's answer) finished: release its in-flight load
        (True). False when it had ended already (its prefill announced with no decode to
        wait for, done before, expired); None when the index does not know it."""
        with self._lock:
            if self._rec is not None:
                return self._rec.run(ROUTE_DONE, self.inflight.done, (request_id,))  # type: ignore[no-any-return]
            return self.inflight.done(request_id)

    def match_by_keys(self, block_keys_: Sequence[int], *, model: str | None = "default") -> MatchResult:
        """Like :meth:`match`, with the caller's block keys (R-Q-1, R-KEY-2).

        The keys apply to every group whose block size is the headline block size.
        """
        keys = list(block_keys_)
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            if self._rec is not None:
                return self._rec.run(MATCH_BY_KEYS, self._match_by_keys, (keys, model))  # type: ignore[no-any-return]
            return self._match_by_keys(keys, model)

    def _match_by_keys(self, keys: list[int], model: str | None) -> MatchResult:
        m = self.model_state(model)
        bs = m.trees[m.default_groups()[0]].block_size if m.trees else 0

        def keys_for(b: int) -> tuple[list[int], ...]:
            return (keys,) if b == bs else ()

        return self.match_model(m, keys_for, len(keys) * bs)

    def match_plain(self, buf: bytes, model: str | None) -> MatchResult | None:
        """:meth:`match` of ``buf`` (token ids as little-endian uint32 bytes, no LoRA, salt
        or extra keys) in one Python frame, when ``model`` has the common shape: one
        attention group, GPU only, no predictions. None for any other model (ask
        :meth:`match`). Raises as :meth:`match` does for an unknown model.

        Why a second door: on the 2-vCPU VM the service is measured on, a query runs with
        cold caches (the vCPU idles between requests), where each Python frame on the way
        costs ~4 us; :meth:`match` takes ~12 frames to the same three compiled calls."""
        self.readers_waiting.append(None)
        with self._lock:
            self.readers_waiting.pop()
            if self._rec is not None:
                return self._rec.run(MATCH_PLAIN, self._match_plain, (buf, model, None))  # type: ignore[no-any-return]
            return self._match_plain(buf, model, None)

    def _match_plain(self, buf: bytes, model: str | None, keys_for: KeysFor | None) -> MatchResult | None:
        """:meth:`match_plain` (the caller holds the lock); a replay gives the recorded
        keys as ``keys_for`` (then ``buf`` is only as long as the prompt)."""
        m = self._models.get(model) if model is not None else None
        if m is None:
            m = self.model_state(model)  # None, or unknown: match's answer (or KeyError)
        trees = m.trees
        if len(trees) != 1 or m.tiered:
            return None
        tries = self.inflight.tries
        if tries and m.name in tries:
            return None
        (g, tree), = trees.items()
        bs = tree.block_size
        ntok = len(buf) >> 2
        n = ntok // bs
        # Up to 64 blocks in one call (packed: no int per key); a longer prompt hashed
        # as the walk goes (_LazyKeys).
        chunks: Any = (
            keys_for(bs) if keys_for is not None else
            (_core.block_keys(buf, bs, KEY_SEED, n, 0, True) if _core is not None
             else block_keys(buf, bs, KEY_SEED, n),) if n <= 64 else _LazyKeys(buf, bs, KEY_SEED, n).chunks())
        return self._gpu_only(m, g, tree, chunks, ntok)


class KeySource:
    """A query's block keys by block size (``keys_for(bs)``: chunks of keys), each block
    size hashed as the walk asks (:class:`_LazyKeys`). Kept by a recording, which reads
    :attr:`cache` for the block sizes the query used."""

    __slots__ = ("buf", "ntok", "lora_name", "cache_salt", "extra_keys", "cache", "sizes")

    def __init__(self, token_ids: Sequence[int] | bytes, lora_name: str | None, cache_salt: str | None,
                 extra_keys: Sequence[Any] | None) -> None:
        buf = token_ids if token_ids.__class__ is bytes else tokens_to_bytes(token_ids)
        self.buf: bytes = buf
        self.ntok = len(buf) // 4
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.extra_keys = extra_keys
        self.cache: dict[int, _LazyKeys] = {}
        self.sizes: tuple[int, ...] = ()  # the block sizes asked, once settled

    def settle(self) -> None:
        """Keep which block sizes were asked (:attr:`sizes`) and let their hashed keys go:
        a recording holds a route's key source until its writer takes it, and the keys
        (an int object each) are what it does not need."""
        self.sizes = tuple(self.cache)
        self.cache = {}

    def seed(self, n: int) -> Any:
        """The key seed(s) of the prompt's first ``n`` blocks (its namespace, R-KEY-1)."""
        if not self.lora_name and self.cache_salt is None and not self.extra_keys:
            return KEY_SEED
        return seeds_for_blocks(n, self.lora_name, query_extra_keys(n, self.cache_salt, self.extra_keys))

    def __call__(self, bs: int) -> Iterator[list[int]]:
        ks = self.cache.get(bs)
        if ks is None:
            n = self.ntok // bs
            ks = self.cache[bs] = _LazyKeys(self.buf, bs, self.seed(n), n)
        return ks.chunks()


class _LazyKeys:
    """A query's block keys, hashed in growing chunks (64, 512, 4096 blocks) as the
    walk asks for them: a prompt that misses early hashes a few blocks, not all
    (64 blocks hash in ~1 us in the compiled core: one chunk for a 1,024-token prompt).
    Computed chunks are kept for the next group with the same block size."""

    __slots__ = ("buf", "block_size", "seed", "n", "done", "i")

    def __init__(self, buf: bytes, block_size: int, seed: int | Sequence[int], n: int) -> None:
        self.buf = buf
        self.block_size = block_size
        self.seed = seed
        self.n = n
        self.done: list[list[int]] = []
        self.i = 0

    def chunks(self) -> Iterator[list[int]]:
        if self.done:
            yield from self.done
        i = self.i
        size = 64 << (3 * len(self.done))
        while i < self.n:
            j = min(self.n, i + size)
            c = block_keys(self.buf, self.block_size, self.seed, j, i)
            self.done.append(c)
            self.i = i = j
            size <<= 3
            yield c
