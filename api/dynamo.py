"""NVIDIA Dynamo's standalone indexer routes (``python -m dynamo.indexer``, 1.6.1), with
its request and response shapes, so a router written for that service works against
ours unchanged. Shapes were recorded from the real service (``tests/data/dynamo``).

Mapping: Dynamo's ``instance_id`` is our engine id (its decimal string); a
``(model_name, routing_group)`` partition is our model ``model_name`` (routing group
``default``) or ``model_name:routing_group``; each ``/register`` (one DP rank, its own
endpoint, no port offset) is one engine config covering that rank.

Deliberate differences: errors are always JSON ``{"error": ...}`` (Dynamo answers
shape errors in plain text); ``block_size`` 0 is refused (422); ``medium`` strings are
our tiers (any string is a tier, not dropped); ``cpu`` is the GPU prefix continued
through whole resident CPU chunks (Dynamo: through any resident block), ``disk`` and
``longest_matched`` are our ``total``.
"""

from __future__ import annotations

import time

import msgspec

from api import schemas, surface
from api.common import ENC, HTTPError, u64_keys
from indexer.wire.engines import EngineConfig

OK = b'{"status":"ok"}'
# Dynamo's routes: errors there are {"error": ...}, 405 and 401/403 included.
PATHS = frozenset({"/register", "/unregister", "/query", "/query_by_hash", "/workers", "/health"})


def error_key(path: str) -> str:
    """The member an error body on ``path`` says its message in: Dynamo's or ours."""
    return "error" if path in PATHS else "detail"
DEFAULT_GROUP = "default"
_DP = tuple(str(i) for i in range(64))  # dp ranks as JSON keys, made once
# The compiled answer of the plain door (none without api._surface: the door is then shut).
_dynamo_answer = surface.dynamo_answer


class _Instance(msgspec.Struct, gc=False):
    """One instance of Dynamo's ``/query`` answer (encodes to its JSON object, members in its order)."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class Dynamo:
    """The adapter: Dynamo's partitions and block sizes over our engines and models."""

    def __init__(self, svc) -> None:
        self.svc = svc
        self.partitions: dict[str, tuple[str, str]] = {}  # our model -> (model_name, routing_group)
        self.block_sizes: dict[str, int] = {}  # our model -> registered block size

    @staticmethod
    def model(model_name: str, group: str | None) -> str:
        return model_name if group in (None, DEFAULT_GROUP) else f"{model_name}:{group}"

    def partition(self, model: str) -> tuple[str, str]:
        return self.partitions.get(model, (model, DEFAULT_GROUP))

    def _configs(self, engine_id: str) -> list[EngineConfig]:
        return [c for c in self.svc.ingest.engines() if c.id == engine_id]

    # ------------------------------------------------------------------ routes

    async def register(self, q: schemas.DynRegister):
        model = self.model(q.model_name, q.routing_group)
        eid = str(q.instance_id)
        rank = q.dp_rank or 0
        try:
            cfg = EngineConfig(id=eid, endpoint=q.endpoint, model=model, replay_endpoint=q.replay_endpoint,
                               dp_size=1, dp_rank_start=rank)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        olds = self._configs(eid)
        for old in olds:
            if old.model != model:
                name, group = self.partition(old.model)
                raise HTTPError(409, f"instance {eid} is already registered for model={name} routing_group={group}")
        if any(rank in old.ranks for old in olds):
            raise HTTPError(409, f"instance {eid} dp_rank {rank} already registered")
        known = self.block_sizes.get(model) or self.svc.index.block_size(model)
        if known is not None and known != q.block_size:
            raise HTTPError(409, f"block_size mismatch for model={q.model_name} routing_group="
                                   f"{q.routing_group or DEFAULT_GROUP}: existing={known}, requested={q.block_size}")
        await self.svc.admin.subscribe(cfg, "dynamo", refused_status=400)  # Dynamo: a bad endpoint is 400
        self.partitions[model] = (q.model_name, q.routing_group or DEFAULT_GROUP)
        self.block_sizes[model] = q.block_size
        return 201, OK

    async def unregister(self, q: schemas.DynUnregister):
        eid = str(q.instance_id)
        cfgs = self._configs(eid)
        if not cfgs:
            raise HTTPError(404, f"instance {eid} not found")
        model = self.model(q.model_name, q.routing_group)
        mine = [c for c in cfgs if c.model == model] if q.routing_group is not None else \
            [c for c in cfgs if self.partition(c.model)[0] == q.model_name]
        if not mine:
            name, group = self.partition(cfgs[0].model)
            raise HTTPError(404, f"instance {eid} is registered for model={name} routing_group={group}")
        if q.routing_group is not None and q.dp_rank is not None:
            # Dynamo honours dp_rank only with routing_group: that one listener goes.
            if not any(q.dp_rank in c.ranks for c in mine):
                raise HTTPError(404, f"instance {eid} dp_rank {q.dp_rank} not found")
            await self.svc.admin.unsubscribe(eid, "dynamo", q.dp_rank)
        else:
            await self.svc.admin.unsubscribe(eid, "dynamo")
        live = {c.model for c in self.svc.ingest.engines()}
        for m in [m for m in self.partitions if m not in live]:  # bounded by the fleet, like the index's models
            self.partitions.pop(m, None)
            self.block_sizes.pop(m, None)
        return 200, OK

    async def query(self, q: schemas.DynQuery):
        self.svc.queries.check_tokens(q.token_ids)
        t0 = time.perf_counter()
        model = self.model(q.model_name, q.routing_group)
        try:
            res = self.svc.index.match(q.token_ids, model=model, lora_name=q.lora_name, cache_salt=q.cache_salt)
        except KeyError:  # the index's own lookup: no per-query scan of the models
            raise self.no_indexer(q.model_name, q.routing_group) from None
        out = self.answer(res)
        self.svc.queries.observe("/query", t0, res)
        return 200, out

    def query_plain(self, route, body: bytes) -> bytes | None:
        """:meth:`query`'s answer to the common request (``Queries.plain_request``, a model
        of the common shape: :meth:`~indexer.query.match.Query.match_plain`), from the body as
        read, in few Python frames (the calls below are compiled or inlined on purpose: see
        match_plain); None for any other request, which the caller then serves through
        :meth:`query` (errors included: nothing is counted here). Needs the compiled core."""
        if _dynamo_answer is None:
            return None
        svc = self.svc
        got = svc.queries.plain_request(route, body)
        if got is None:
            return None
        q, buf = got
        group = q.routing_group
        t0 = time.perf_counter()
        try:
            res = svc.index.match_plain(buf, q.model_name if group is None or group == DEFAULT_GROUP
                                        else f"{q.model_name}:{group}")
        except KeyError:
            return None
        if res is None:
            return None
        ws = res.workers
        out = _dynamo_answer(ws, res.block_size or 0)
        # Queries.observe's figures; a WorkerMatch's [1] is -total_blocks (no property frame).
        svc.metrics.observe("/query", time.perf_counter() - t0, -ws[0][1] if ws else 0)
        return out

    async def query_by_hash(self, q: schemas.DynQueryByHash):
        if q.cache_salt is not None:
            raise HTTPError(400, "cache_salt is not accepted by /query_by_hash; block_hashes must already "
                                 "include the intended cache salt")
        self.svc.queries.check_tokens(q.block_hashes)
        keys = u64_keys(q.block_hashes)  # the input is checked before the model is looked up
        t0 = time.perf_counter()
        model = self.model(q.model_name, q.routing_group)
        try:
            res = self.svc.index.match_by_keys(keys, model=model)
        except KeyError:
            raise self.no_indexer(q.model_name, q.routing_group) from None
        out = self.answer(res)
        self.svc.queries.observe("/query_by_hash", t0, res)
        return 200, out

    @staticmethod
    def no_indexer(model_name: str, group: str | None) -> HTTPError:
        """Dynamo's 404 for a (model, routing group) it has no index for."""
        return HTTPError(404, f"no indexer for model={model_name} routing_group={group or DEFAULT_GROUP}")

    @staticmethod
    def answer(res) -> bytes:
        """Dynamo's query body (JSON) from a MatchResult: tokens, GPU-only ``scores``, and per
        instance the cumulative ``gpu <= cpu <= disk = longest_matched``. Built by the
        compiled core when there is one (no dict or struct per engine);
        :meth:`answer_doc` is its reference."""
        if _dynamo_answer is not None:
            return _dynamo_answer(list(res.workers), res.block_size or 0)
        return ENC.encode(Dynamo.answer_doc(res))

    @staticmethod
    def answer_doc(res) -> dict:
        """:meth:`answer` as the document msgspec encodes.

        Reads each WorkerMatch's tuple fields directly (no property, no per-worker
        tiers dict): with 256 workers answering, that is 0.7 ms less per query."""
        bs = res.block_size or 0
        scores: dict[str, dict[str, int]] = {}
        inst: dict[str, _Instance] = {}
        dps = _DP
        for w in res.workers:
            # WorkerMatch: (-score, -total_blocks, engine, dp_rank, tier items, ...)
            total = -w[1] * bs
            gpu = cpu_t = 0
            storage = False
            for name, blocks in w[4]:
                if name == "GPU":
                    gpu = blocks * bs
                elif name == "CPU":
                    cpu_t = blocks * bs
                elif name == "STORAGE":
                    storage = True
            # Our total is GPU, then CPU, then STORAGE; without STORAGE residency the CPU
            # continuation is all of it, else the CPU prefix bounds it.
            cpu = max(gpu, min(total, cpu_t)) if storage else total
            eid, dp = w[2], w[3]
            dp = dps[dp] if dp < 64 else str(dp)
            if gpu:
                sc = scores.get(eid)
                if sc is None:
                    scores[eid] = {dp: gpu}
                else:
                    sc[dp] = gpu
            i = inst.get(eid)
            if i is None:
                inst[eid] = _Instance(total, gpu, {dp: gpu}, cpu, total)
            else:
                i.dp[dp] = gpu
                if gpu > i.gpu:
                    i.gpu = gpu
                if cpu > i.cpu:
                    i.cpu = cpu
                if total > i.disk:
                    i.disk = i.longest_matched = total
        return {"scores": scores, "frequencies": [], "instances": inst}

    def workers(self, model_name: str | None, group: str | None) -> list[dict]:
        by_engine: dict[str, list[EngineConfig]] = {}
        for c in self.svc.ingest.engines():
            by_engine.setdefault(c.id, []).append(c)
        subs = {(w["engine"], w["dp_rank"]): w for w in self.svc.ingest.workers()}
        out = []
        for eid, cfgs in sorted(by_engine.items()):
            if not (eid.isascii() and eid.isdigit()):
                continue  # not a Dynamo instance (registered by id over /v1/engines): instance_id is a u64
            name, grp = self.partition(cfgs[0].model)
            if (model_name is not None and name != model_name) or (group is not None and grp != group):
                continue
            endpoints, listeners = {}, {}
            for c in cfgs:
                for r in c.ranks:
                    w = subs.get((eid, r), {})
                    ep = w.get("endpoint", c.endpoint)
                    endpoints[str(r)] = ep
                    listeners[str(r)] = {"endpoint": ep, "status": "active" if w.get("connected") else "pending"}
            statuses = {x["status"] for x in listeners.values()}
            out.append({
                "instance_id": int(eid),
                "source": "zmq",
                "status": "pending" if "pending" in statuses else "active",
                "model_name": name,
                "routing_group": grp,
                "block_size": self.block_sizes.get(cfgs[0].model) or self.svc.index.block_size(cfgs[0].model),
                "endpoints": endpoints,
                "listeners": listeners,
            })
        return out

