"""Snapshots: the whole index as one versioned file, and back (R-DUR-1..4).

A snapshot holds everything :class:`~indexer.PrefixIndex` keeps (models, trees with
every node's residency, chunk ends and reference counts, each worker's engine-hash
map, orphans, per-worker last seq and batch ts, stale marks) plus what its owner
adds: the engine registry and a ``meta`` map (e.g. the JetStream sequence the
snapshot covers). What routing has in flight (predictions, load) is not kept: it
lives seconds and the engines' announcements replace it.

The file (format in ``docs/snapshot.md``)::

    magic  b"KVISNAP\\0"      8 bytes
    version                  uint32 big-endian (FORMAT_VERSION)
    flags                    uint32 big-endian (0)
    body length              uint64 big-endian
    body xxh64 (seed 0)      uint64 big-endian
    body                     msgpack of :class:`Body`

A tree is columnar: its nodes in preorder (a parent before its children), node 0
the root, as little-endian arrays of parent index (uint32), block key (uint64) and
GPU-mask id (uint32, into a table of distinct masks). Worker maps name nodes by
index. So a load is one pass that creates each node under an already created
parent, and a dump is one walk: no per-node msgpack object either way.

:func:`dumps` reads the index under its lock (one consistent cut: no batch is
half applied); :func:`loads` checks the header and the checksum before it decodes
anything, and raises :class:`SnapshotError` with a bounded ``reason``.
"""

from __future__ import annotations

import os
import struct
import time
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash
from msgspec import Struct

from indexer.store import columns
from indexer.store.columns import (
    U32,
    U64C,
    col,
    dump_map,
    dump_tree,
    le,
    load_map,
    load_tree,
    mask_bytes,
    mask_int,
    node_index,
    translate,
)
from indexer.store.state import ModelState, RestoredState, WorkerGroup, WorkerState
from indexer.store.tree import Node, Tree
from indexer.wire.decode import decode_stored, encode_stored

if TYPE_CHECKING:
    from indexer.store.state import IndexState
    from indexer.wire.decode import StoredEvent
    from indexer.wire.events import Hash

__all__ = ["FORMAT_VERSION", "MAGIC", "Snapshot", "SnapshotError", "dumps", "loads", "write_atomic"]

MAGIC = b"KVISNAP\0"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">8sIIQQ")  # magic, version, flags, body length, body xxh64
HEADER_SIZE = _HEAD.size

# The pure twins of the column loops, by the names the snapshot tests and the compiled
# core's docstrings hold the compiled ones to.
_py_dump_tree = columns.py_dump_tree
_py_dump_map = columns.py_dump_map
_py_node_index = columns.py_node_index
_py_translate = columns.py_translate
_py_load_tree = columns.py_load_tree
_py_load_map = columns.py_load_map


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded; ``reason`` is one of ``magic``, ``truncated``,
    ``checksum``, ``version``, ``corrupt`` (bounded: a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"snapshot refused ({reason}): {detail}")
        self.reason = reason


class TreeSnap(Struct, array_like=True, frozen=True):
    group: int
    block_size: int
    kind: str | None
    parents: bytes  # uint32 per node but the root: parent's index (0 = the root)
    keys: bytes  # uint64 per node but the root
    mask_ids: bytes  # uint32 per node but the root: index into masks
    masks: list[bytes]  # distinct GPU masks, little-endian unsigned (b"" = 0)
    # (node index, tiers {tid or -tid: mask bytes} or None, dup {key: count} or None)
    extras: list[tuple[int, list[tuple[int, bytes]] | None, list[tuple[int, int]] | None]]
    stamps: bytes | None  # capped trees: uint64 store stamp per node but the root (0 = none)
    clock: int


class GroupSnap(Struct, array_like=True, frozen=True):
    """One worker in one KV-cache group."""

    group: int
    hashes: bytes  # uint64 engine hashes in [0, 2**64)
    nodes: bytes  # uint32 node index of each of ``hashes``
    other: list[tuple[Any, int]]  # (any other hash: bytes or an int outside uint64, node index)
    res: list[int]  # resident entries per tier id
    ends: list[tuple[int, bytes, bytes]]  # (tier id, uint32 node indices, uint32 chunk lengths)


class WorkerSnap(Struct, array_like=True, frozen=True):
    wid: int
    engine: str
    dp_rank: int
    model: str
    last_seq: int | None
    last_ts: float | None
    age_s: float | None  # seconds between its last applied batch and the snapshot
    stale: bool
    stale_reason: str | None
    batches: int
    restarts: int
    gaps: int
    dropped: dict[str, int]
    groups: list[GroupSnap]


class ModelSnap(Struct, array_like=True, frozen=True):
    name: str
    trees: list[TreeSnap]
    tiered: bool
    idle: bool  # its last worker left (kept for its groups and block sizes)


class OrphanSnap(Struct, array_like=True, frozen=True):
    wid: int
    group: int
    parent_hash: Any
    age_s: float
    event: bytes  # the BlockStored as a one-event map-layout msgpack (wire.encode_stored)
    tier: int


class Body(Struct, frozen=True, kw_only=True):
    created: float  # wall clock (time.time()) at the cut
    tier_names: list[str]
    next_wid: int
    free_wids: list[int]
    models: list[ModelSnap]
    workers: list[WorkerSnap]
    orphans: list[OrphanSnap]  # in arrival order (the oldest is dropped first)
    engines: list[dict[str, Any]] = []  # the owner's engine registry (EngineConfig fields)
    meta: dict[str, Any] = {}


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Body)


# ------------------------------------------------------------------ the file


def _frame(body: bytes) -> bytes:
    return _HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(body), xxhash.xxh64_intdigest(body)) + body


def dumps(index: IndexState, *, engines: Iterable[dict[str, Any]] = (), meta: dict[str, Any] | None = None) -> bytes:
    """The whole index (plus ``engines`` and ``meta``) as snapshot bytes. Holds the
    index lock while it reads the columns (one consistent cut), not while node
    addresses become indices or the body is encoded; changes nothing."""
    with index.lock:
        cut = _cut(index)
    return _frame(_enc.encode(_assemble(cut, list(engines), dict(meta or {}))))


def cut_locked(index: IndexState) -> dict[str, Any]:
    """What :func:`dumps` reads under the index lock, for a caller that holds it already
    (a recording's segment base, taken between two journaled calls); :func:`finish`
    makes the bytes without the lock. ``cut["now"]`` is the clock reading ages are from,
    ``cut["orphans"]`` the orphans (their ``event`` may be rewritten before finishing).
    Changes nothing."""
    return _cut(index)


def finish(cut: dict[str, Any], *, engines: Iterable[dict[str, Any]] = (), meta: dict[str, Any] | None = None) -> bytes:
    """Snapshot bytes from a :func:`cut_locked` cut (no lock needed)."""
    return _frame(_enc.encode(_assemble(cut, list(engines), dict(meta or {}))))


class Snapshot:
    """A checked, decoded snapshot: :meth:`restore` puts it into an empty index."""

    def __init__(self, body: Body, size: int) -> None:
        self.body = body
        self.size = size
        self.meta = body.meta
        self.engines = body.engines
        self.created = body.created

    def restore(self, index: IndexState, *, replace: bool = False, downtime: bool = True) -> None:
        """Rebuild the snapshot's state in ``index``, which must hold no worker yet unless
        ``replace`` (then what it holds goes first). Its own settings (credits, caps,
        bounds) stay; node caps apply from here on. A snapshot that cannot be restored
        leaves the index empty (SnapshotError ``corrupt``). ``downtime=False`` does not age
        the workers' last apply by the wall time since the cut (a replay's clock resumes
        at the cut's own reading)."""
        index.restore_state(lambda: _build(index, self.body, downtime), replace=replace)

    def workers(self) -> list[tuple[str, int, str, int | None]]:
        """(engine, dp_rank, model, last_seq) of every worker in the snapshot."""
        return [(w.engine, w.dp_rank, w.model, w.last_seq) for w in self.body.workers]


def loads(data: bytes | bytearray | memoryview) -> Snapshot:
    """Check and decode snapshot bytes. Raises :class:`SnapshotError`."""
    data = memoryview(data)
    if len(data) < HEADER_SIZE:
        if bytes(data[: len(MAGIC)]) != MAGIC[: len(data)]:
            raise SnapshotError("magic", "not a kv-prefix-indexer snapshot")
        raise SnapshotError("truncated", f"{len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, _flags, length, digest = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("magic", "not a kv-prefix-indexer snapshot")
    if version > FORMAT_VERSION or version < 1:
        raise SnapshotError("version", f"format version {version}; this build reads 1..{FORMAT_VERSION}")
    body = data[HEADER_SIZE:]
    if len(body) != length:
        raise SnapshotError("truncated" if len(body) < length else "corrupt",
                            f"body is {len(body)} bytes, the header says {length}")
    if xxhash.xxh64_intdigest(body) != digest:
        raise SnapshotError("checksum", "the body's xxh64 does not match the header")
    try:
        return Snapshot(_dec.decode(body), len(data))
    except msgspec.DecodeError as e:
        raise SnapshotError("corrupt", str(e)) from None


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory,
    fsync'd, renamed over ``path``, then the directory fsync'd. A crash leaves the
    old file or the new one, never a mix."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the cut


# What the index lock is held for: every column read, node references replaced by
# their addresses (plain ints). Turning those into node indices (_assemble) needs no
# node, so it runs after the lock is released: it was most of a dump's time.


def _cut(index: IndexState) -> dict[str, Any]:
    """Read everything a snapshot holds (under the index lock); changes nothing."""
    now = index.now()
    models = []
    for mo, idle in index.model_states():
        trees = []
        for g, tree in mo.trees.items():
            parents, keys, mids, masks, extra, addrs = dump_tree(tree.root)
            extras = [(i,
                       None if n.tiers is None else [(t, mask_bytes(v)) for t, v in n.tiers.items()],
                       None if n.dup is None else list(n.dup.items())) for i, n in extra]
            stamps = None if tree.stamps is None else [(id(n), st) for n, st in tree.stamps.items()]
            trees.append((g, tree.block_size, mo.kinds.get(g), parents, keys, mids, masks, extras, addrs, stamps,
                          tree.clock))
        models.append((mo.name, trees, mo.tiered, idle))
    workers = []
    wg_of: dict[int, tuple[int, int]] = {}  # id(WorkerGroup) -> (wid, group)
    for w in index.worker_states():
        groups = []
        for g, wg in w.groups.items():
            wg_of[id(wg)] = (w.wid, g)
            hashes, addrs, other = dump_map(wg.map)
            ends = [(tid, [id(n) for n in em], list(em.values())) for tid, em in wg.ends.items()]
            groups.append((g, hashes, addrs, other, list(wg.res), ends))
        # The worker's record now (its fields change with the next batch); its groups'
        # columns are translated to node indices after the lock.
        workers.append((WorkerSnap(
            w.wid, w.engine, w.dp_rank, w.model, w.last_seq, w.last_ts,
            None if w.last_apply is None else max(0.0, now - w.last_apply), w.stale, w.stale_reason,
            w.batches, w.restarts, w.gaps, dict(w.dropped), []), groups))
    orphans: list[OrphanSnap] = []
    for t, wg, ph, entry in index.orphan_entries():
        owner = wg_of.get(id(wg))
        if owner is None:
            continue  # its worker is gone
        wid, g = owner
        orphans.append(OrphanSnap(wid, g, ph, max(0.0, now - t), encode_stored(entry[0]), entry[1]))
    next_wid, free_wids = index.wids()
    return {"now": now, "models": models, "orphans": orphans, "created": time.time(),
            "tier_names": list(index.tier_names), "next_wid": next_wid, "free_wids": free_wids, "workers": workers}


def _assemble(cut: dict[str, Any], engines: list[dict[str, Any]], meta: dict[str, Any]) -> Body:
    """The snapshot's body from what :func:`_cut` read: addresses become node indices.
    Reads no node (the index lock is not held)."""
    models: list[ModelSnap] = []
    where: dict[tuple[str, int], Any] = {}  # (model, group) -> address -> node index
    for name, trees_raw, tiered, idle in cut["models"]:
        trees = []
        for g, block_size, kind, parents, keys, mids, masks, extras, addrs, stamps_raw, clock in trees_raw:
            pos = where[(name, g)] = node_index(addrs)
            stamps = None
            if stamps_raw is not None:
                st = array(U64C, bytes(2 * len(parents)))  # 8 bytes per node: parents has 4
                get = pos.get
                for a, stamp in stamps_raw:
                    i = get(a)
                    if i:
                        st[i - 1] = stamp
                stamps = le(st)
            trees.append(TreeSnap(g, block_size, kind, parents, keys, mids, [mask_bytes(m) for m in masks], extras,
                                  stamps, clock))
        models.append(ModelSnap(name, trees, tiered, idle))
    workers: list[WorkerSnap] = []
    for ws, groups_raw in cut["workers"]:
        model = ws.model
        groups = []
        for g, hashes, addrs, other_raw, res, ends_raw in groups_raw:
            pos = where.get((model, g))
            if pos is None:  # no tree (only orphans so far): no node to name
                hashes = idx = b""
                other: list[tuple[Any, int]] = []
                ends: list[tuple[int, bytes, bytes]] = []
            else:
                hashes, idx = translate(pos, hashes, addrs)
                get = pos.get
                other = [(h, i) for h, i in ((h, get(a)) for h, a in other_raw) if i is not None]
                ends = []
                for tid, end_addrs, blocks in ends_raw:
                    ni, nb = array(U32), array(U32)
                    for a, n in zip(end_addrs, blocks):
                        i = get(a)
                        if i is not None:
                            ni.append(i)
                            nb.append(n)
                    ends.append((tid, le(ni), le(nb)))
            groups.append(GroupSnap(g, hashes, idx, other, res, ends))
        workers.append(msgspec.structs.replace(ws, groups=groups))
    return Body(created=cut["created"], tier_names=cut["tier_names"], next_wid=cut["next_wid"],
                free_wids=cut["free_wids"], models=models, workers=workers, orphans=cut["orphans"],
                engines=engines, meta=meta)


# ---------------------------------------------------------------- the restore


def _build(index: IndexState, body: Body, downtime: bool = True) -> RestoredState:
    """The snapshot's state, built for ``index`` (its node cap and tier bound, its clock):
    every tree, worker and orphan. Raises SnapshotError ``corrupt`` when the body does
    not make one (the trees made so far freed first)."""
    trees: list[Tree] = []
    try:
        return _make(index, body, trees, downtime)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, msgspec.DecodeError) as e:
        for tree in trees:
            tree.clear()
        raise SnapshotError("corrupt", f"{type(e).__name__}: {e}") from None
    except BaseException:
        for tree in trees:
            tree.clear()
        raise


def _make(index: IndexState, body: Body, made: list[Tree], downtime: bool = True) -> RestoredState:
    capped = index.max_nodes is not None
    nodes_of: dict[tuple[str, int], list[Node]] = {}
    models: dict[str, tuple[ModelState, bool]] = {}
    for ms in body.models:
        mo = ModelState(ms.name)
        models[ms.name] = (mo, ms.idle)
        mo.tiered = ms.tiered
        for ts in ms.trees:
            tree = Tree(ts.group, ts.block_size, capped)
            made.append(tree)
            masks = [mask_int(b) for b in ts.masks]
            nodes = load_tree(tree.root, ts.parents, ts.keys, ts.mask_ids, masks)
            tree.nodes = len(nodes) - 1
            for i, tiers, dup in ts.extras:
                node = nodes[i]
                if tiers is not None:
                    node.tiers = {t: mask_int(b) for t, b in tiers}
                if dup is not None:
                    node.dup = dict(dup)
            if capped:
                _restamp(tree, nodes, ts.stamps, ts.clock)
            mo.trees[ts.group] = tree
            mo.set_kind(ts.group, ts.kind)
            nodes_of[(ms.name, ts.group)] = nodes
    by_wid: dict[int, WorkerState] = {}
    keys: set[tuple[str, int]] = set()
    now = index.now()
    for ws in body.workers:
        got = models.get(ws.model)
        if got is None:
            got = models[ws.model] = (ModelState(ws.model), False)
        mo = got[0]
        w = WorkerState(ws.wid, ws.engine, ws.dp_rank, ws.model, mo.rows)
        w.last_seq, w.last_ts = ws.last_seq, ws.last_ts
        # Monotonic clocks do not survive a process: age the last apply by the downtime.
        down = max(0.0, time.time() - body.created) if downtime else 0.0
        w.last_apply = None if ws.age_s is None else now - ws.age_s - down
        w.stale, w.stale_reason = ws.stale, ws.stale_reason
        w.batches, w.restarts, w.gaps, w.dropped = ws.batches, ws.restarts, ws.gaps, dict(ws.dropped)
        for gs in ws.groups:
            nodes = nodes_of.get((ws.model, gs.group), [])
            w.groups[gs.group] = _load_group(gs, nodes, index.max_tiers)
        w.refresh()
        if (ws.engine, ws.dp_rank) in keys or ws.wid in by_wid:
            raise ValueError(f"worker {ws.engine}/{ws.dp_rank} (wid {ws.wid}) twice")
        keys.add((ws.engine, ws.dp_rank))
        by_wid[ws.wid] = w
    orphans: list[tuple[float, WorkerGroup, Hash, tuple[StoredEvent, int]]] = []
    for o in body.orphans:
        w = by_wid[o.wid]
        wg = w.groups.get(o.group)
        if wg is None:
            wg = w.groups[o.group] = WorkerGroup()
        entry = (decode_stored(o.event), o.tier)
        wg.orphans.setdefault(o.parent_hash, []).append(entry)
        orphans.append((o.age_s, wg, o.parent_hash, entry))
    return RestoredState(list(body.tier_names), list(models.values()), list(by_wid.values()), orphans,
                         body.next_wid, list(body.free_wids))


def _load_group(gs: GroupSnap, nodes: list[Node], max_tiers: int) -> WorkerGroup:
    wg = WorkerGroup()
    wmap = wg.map
    load_map(wmap, gs.hashes, gs.nodes, nodes)
    for h, i in gs.other:
        wmap[h] = nodes[i]
    res = list(gs.res)[:max_tiers]
    wg.res[: len(res)] = res
    for tid, ni, nb in gs.ends:
        ia, na = col(U32, ni), col(U32, nb)
        if len(ia) != len(na):
            raise ValueError(f"group {gs.group}: chunk ends of different lengths")
        wg.ends[tid] = {nodes[i]: n for i, n in zip(ia, na)}
    return wg


def _restamp(tree: Tree, nodes: list[Node], stamps: bytes | None, clock: int) -> None:
    """Capped trees: each node's store stamp (preorder when the snapshot had none), the
    leaves heap rebuilt from them."""
    st = tree.stamps
    assert st is not None
    if stamps is None:
        for i in range(1, len(nodes)):
            st[nodes[i]] = i
        tree.clock = len(nodes)
    else:
        for i, s in enumerate(col(U64C, stamps), 1):
            if s:
                st[nodes[i]] = s
        tree.clock = clock
    tree._rebuild_leaves()

