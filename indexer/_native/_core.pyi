"""Type stub for the compiled core (``indexer/_native/*.c``, one file per concern).

The C module has no pure-Python source, so this file is what type checkers see.
Every name here exists at runtime and nothing else does; ``mypy.stubtest`` checks
that (``python -m mypy.stubtest indexer._native._core``). The pure-Python twins the C is
held to are ``tree._PyNode``, ``tree._py_insert_gpu``, ``tree._py_walk``,
``result._py_gpu_answers``, ``route._py_rank``, ``keys._py_block_keys`` and ``snapshot._py_dump_tree``,
``_py_dump_map``, ``_py_load_tree``, ``_py_load_map``.

Conventions the C follows:

* Block keys and engine hashes that are ints in ``[0, 2**64)`` live in the
  compact tables; a ``U64Map`` also takes any other hashable key (a ``bytes``
  hash, a negative int) and keeps it in a plain dict inside.
* Worker masks (``Node.gpu``, the masks in ``Node.tiers``, ``bit``, ``active``)
  are Python ints, one bit per worker id; ``-1`` is "every worker".
* Every function takes positional arguments only.
"""

from _typeshed import SupportsKeysAndGetItem
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Final, Literal, TypeAlias, TypeVar, final, overload

from typing_extensions import Buffer

_T = TypeVar("_T")
# The answer type: a tuple subclass (result.WorkerMatch in the index).
_W = TypeVar("_W", bound=tuple[Any, ...])

# A store's or removal's engine hashes (wire.Hash is int | bytes); a list, not any sequence.
_Hashes: TypeAlias = list[int] | list[bytes] | list[int | bytes]

# (stale, stale_reason, last_seq, last_apply): a worker's freshness (result.WorkerMatch[7]).
_Fresh: TypeAlias = tuple[bool, str | None, int | None, float | None]
# (engine, dp_rank, freshness, position): one worker's row in a model's ``rows``.
_Row: TypeAlias = tuple[str, int, _Fresh, int]


@final
class U64Map:
    """A dict-like map, compact for int keys in [0, 2**64) (block keys, engine hashes).

    Used for a node's children (key -> Node, ``tree.Kids``) and for a worker's
    engine-hash map (hash -> Node). ``keys()``, ``values()``, ``items()`` and
    iteration return snapshots (lists), so the map may change while they are
    walked. Unhashable (``__hash__`` is None), like a dict.
    """

    # The C type sets tp_hash to PyObject_HashNotImplemented: __hash__ is None.
    __hash__: ClassVar[None]  # type: ignore[assignment]

    # tp_new takes one mapping or one iterable of (key, value) pairs, or nothing.
    @overload
    def __new__(cls) -> U64Map: ...
    @overload
    def __new__(cls, source: SupportsKeysAndGetItem[Any, Any] | Iterable[tuple[Any, Any]], /) -> U64Map: ...
    def __len__(self) -> int: ...
    def __getitem__(self, key: object, /) -> Any: ...
    def __setitem__(self, key: object, value: Any, /) -> None: ...
    def __delitem__(self, key: object, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __iter__(self) -> Iterator[Any]: ...
    @overload
    def get(self, key: object, /) -> Any | None: ...
    @overload
    def get(self, key: object, default: _T, /) -> Any | _T: ...
    @overload
    def pop(self, key: object, /) -> Any: ...
    @overload
    def pop(self, key: object, default: _T, /) -> Any | _T: ...
    def keys(self) -> list[Any]: ...
    def values(self) -> list[Any]: ...
    def items(self) -> list[tuple[Any, Any]]: ...
    def clear(self) -> None: ...


@final
class Node:
    """One block of a prefix tree (see tree.py).

    The drop-in twin of ``tree._PyNode``: same positional constructor, same
    attributes. ``key`` is stored as a uint64 and is read-only; the others are
    writable object fields the index writes freely (not deletable). ``tiers`` and
    ``dup`` read back the very dict stored, so changing it in place changes the
    node; while both are None the node is 48 bytes, else 48 plus a 32-byte side
    block (``__sizeof__`` counts it).
    """

    # Node(key, parent, kids=None, gpu=0, tiers=None, dup=None); positional only.
    # key: an int in [0, 2**64), or None for the root (read back as 0).
    def __new__(
        cls,
        key: int | None,
        parent: Node | None,
        kids: Node | U64Map | None = None,
        gpu: int = 0,
        tiers: dict[int, int] | None = None,
        dup: dict[int, int] | None = None,
        /,
    ) -> Node: ...
    @property
    def key(self) -> int:
        """The block key (read-only)."""
    # None for the root; DEAD once the node has been freed.
    parent: Node | None
    # None, the only child, or a U64Map key -> child.
    kids: Node | U64Map | None
    # Bit mask of the workers holding the block on GPU.
    gpu: int
    # None or {tid: mask} for the other tiers, chunk-end masks under -tid (R-APP-5).
    tiers: dict[int, int] | None
    # None or {(wid << 5) | tid: extra announcements} (R-APP-4).
    dup: dict[int, int] | None


# The parent of every freed node (key 0, parent None, gpu 0).
DEAD: Final[Node]


def insert_gpu(
    wmap: U64Map,
    parent: Node,
    hashes: _Hashes,
    keys: list[int],
    bit: int,
    dupkey: int,
    /,
) -> tuple[Node, int, int]:
    """Attach a GPU store's blocks under ``parent`` for one worker.

    Returns ``(last node, nodes created, residencies added)``. ``keys`` must have
    at least as many items as ``hashes``. Same steps as ``tree._py_insert_gpu``.
    """


def walk(
    root: Node,
    chunks: Iterable[Sequence[int] | bytes],
    keep_path: bool,
    /,
) -> tuple[int, list[tuple[int, int]], int, list[Node] | None]:
    """Follow a query's block keys down from ``root`` while a child matches.

    Returns ``(depth, stops, active, path)``: ``stops`` holds ``(depth, mask)``
    where workers' GPU runs end, ``active`` the workers whose run is unbroken,
    ``path`` the nodes passed (None unless ``keep_path``). A chunk may be bytes of
    little-endian uint64 keys (:func:`block_keys` with ``packed``). Read-only.
    """


def remove_gpu(
    wmap: U64Map,
    root: Node,
    hashes: _Hashes,
    bit: int,
    dupkey: int,
    /,
) -> tuple[int, int, int]:
    """One GPU ``BlockRemoved`` for one worker in an uncapped tree.

    Returns ``(residencies cleared, hashes not held, nodes freed)``.
    """


def answers(
    stops: list[tuple[int, int]],
    rows: list[_Row | None],
    group: str,
    block_size: int,
    credit: float,
    stale_factor: float,
    now: float,
    cls: type[_W],
    /,
) -> list[_W]:
    """The ranked answers of a GPU-only match in one group (read-only).

    One ``cls`` tuple per worker in ``stops`` with a row in ``rows`` (indexed by
    worker id; None for a worker of another model): ``(-score, -blocks, engine,
    dp_rank, tier items, group items, tokens, freshness, now)``, built without
    calling ``cls``. ``cls`` must be a tuple subclass. Same as
    ``result._py_gpu_answers``.
    """


def rank(
    cands: list[tuple[str, int, bool]],
    workers: list[Any],
    pred: dict[tuple[str, int], tuple[int, float]] | None,
    load: dict[str, Any] | None,
    used: set[str],
    in_flight: dict[tuple[str, int], tuple[int, int]] | None,
    link: dict[tuple[str, int], tuple[bool, bool]] | None,
    query_blocks: int,
    block_size: int,
    scale: float,
    idle_source: str,
    entry_cls: type | None,
    load_cls: type | None,
    slot: int,
    of: int,
    keep: int | None,
    /,
) -> tuple[Any, ...] | None:
    """A route's candidates ranked, best first: ``(entries, top score, the best one's
    match or None)``; load keys found are added to ``used``. Entries are dicts, or
    ``entry_cls(..., load_cls(...))``. Ties on cost and score are ordered for router
    replica ``slot`` of ``of`` (``route._rotate_ties``). With ``keep`` an int:
    ``(the entries as msgspec's JSON bytes, top score, best match, the first keep
    entries)``, no object made for the others. None when a value is one only Python
    ranks (or msgspec writes) exactly (a NaN, a load that is not an int below 2**53,
    ``of`` above 2**31, with ``keep`` a string JSON escapes, ...). Same as
    ``route._py_rank``.
    """


def json_double(x: float, /) -> bytes:
    """``x`` as the route's JSON writer writes it: ``msgspec.json.encode(x)``."""


@overload
def block_keys(
    buf: Buffer,
    block_size: int,
    seed: int | Sequence[int],
    limit: int | None = -1,
    start: int = 0,
    packed: Literal[False] = False,
    /,
) -> list[int]:
    """xxh3-64 of each full block ``start`` .. ``limit`` (-1 or None: all) of ``buf``.

    ``buf`` holds little-endian uint32 token ids; ``seed`` is one seed in
    [0, 2**64) or one per block, indexed from block 0. With ``packed``, the keys
    as little-endian uint64 bytes (8 per block): what :func:`walk` reads as a chunk.
    """


@overload
def block_keys(
    buf: Buffer,
    block_size: int,
    seed: int | Sequence[int],
    limit: int | None,
    start: int,
    packed: Literal[True],
    /,
) -> bytes: ...


def insert_gpu_raw(
    wmap: U64Map,
    parent: Node,
    hashes: bytes,
    tokens: bytes,
    block_size: int,
    seed: int,
    bit: int,
    dupkey: int,
    /,
) -> tuple[Node, int, int]:
    """insert_gpu with little-endian uint64 hashes and uint32 tokens (bytes); each new
    block's key is the xxh3-64 of its tokens with ``seed``."""


def scan_gpu_batch(
    payload: Buffer, /
) -> tuple[float, int | None, list[tuple[bytes, int | None, bytes, int, int | None, str | None, int, int]]] | None:
    """A batch of plain GPU stores read in one pass (see events.c); None for anything else."""


def tokens_from_msgpack(raw: Buffer, /) -> bytes | None:
    """A msgpack array of ints in [0, 2**32) as little-endian uint32 bytes; None otherwise."""



@final
class NodeIndex:
    """A node's address -> its index in a ``dump_tree`` walk (the root is 0).

    Made by ``node_index`` only (not instantiable) from the addresses ``dump_tree``
    read under the index lock: the compact twin of the pure ``dict[int, int]``
    (16-byte slots). Holds no node and reads none: addresses are plain integers.
    """

    def __len__(self) -> int: ...
    def __contains__(self, addr: object, /) -> bool: ...
    @overload
    def get(self, addr: int, /) -> int | None: ...
    @overload
    def get(self, addr: int, default: _T, /) -> int | _T: ...


def dump_tree(root: Node, /) -> tuple[bytes, bytes, bytes, list[int], list[tuple[int, Node]], bytes]:
    """Walk one tree in preorder (iterative; node 0 is the root).

    Returns ``(parents, keys, mask_ids, masks, extra, addrs)``: little-endian
    uint32 / uint64 / uint32 columns of every node but the root, the distinct GPU
    masks in order of first use, ``(index, node)`` of the nodes with tiers or
    dups, and the uint64 address of every node, the root first. Read-only. Same
    bytes as ``snapshot._py_dump_tree`` (addresses: ``id()``).
    """


def dump_map(wmap: U64Map, /) -> tuple[bytes, bytes, list[tuple[Any, int]]]:
    """A worker's map as ``(uint64 hashes, uint64 node addresses, other)``; ``other``
    holds ``(hash, address)`` of the hashes that are not ints in [0, 2**64). Reads
    the map only, no node. Same as ``snapshot._py_dump_map``.
    """


def node_index(addrs: Buffer, /) -> NodeIndex:
    """The table address -> position of ``dump_tree``'s addresses; an address twice
    (or 0) is a ValueError. Same as ``snapshot._py_node_index``."""


def translate(where: NodeIndex, hashes: Buffer, addrs: Buffer, /) -> tuple[bytes, bytes]:
    """``dump_map``'s columns with each address replaced by its uint32 index in
    ``where``; entries ``where`` does not know are left out. Same as
    ``snapshot._py_translate``."""


def load_tree(root: Node, parents: Buffer, keys: Buffer, mask_ids: Buffer, masks: Sequence[int], /) -> list[Node]:
    """Create every node of a dumped tree under ``root``; returns the nodes, the
    root first. Columns of different lengths, a parent not created yet or a mask
    id out of range are a ValueError. Same as ``snapshot._py_load_tree``.
    """


def load_map(wmap: U64Map, hashes: Buffer, idx: Buffer, nodes: list[Node], /) -> None:
    """Put ``hashes[i] -> nodes[idx[i]]`` into ``wmap``: ValueError for columns of
    different lengths, IndexError for an index past ``nodes``. Same as
    ``snapshot._py_load_map``.
    """



# ------------------------------------------------------------------ recording (journal.c, recframe.c)


class JournalCore:
    """The hot half of a recording's journal (``indexer.store.journal.Journal``)."""

    records: Any
    raw: Callable[[], float]
    max_pending: int
    active: bool
    overflowed: bool
    values: frozenset[type] | None
    wake: Callable[[], Any] | None
    wake_every: int
    wake_bytes: int
    run_bytes: int
    strip: bool
    seed: int
    encode: bool
    raised: type | None
    kinds: bytes | None
    apart: Any

    def __init__(self, raw: Callable[[], float], max_pending: int = 1000000) -> None: ...
    def run(self, op: int, fn: Callable[..., Any], args: tuple[Any, ...], /) -> Any:
        """``fn(*args)``, the call queued with its result and clock readings."""
    def clock(self) -> float:
        """The index's clock; a reading inside a run is noted."""
    def run_apply(self, op: int, fn: Callable[..., Any], engine: str, payload: bytes, model: str,
                  dp_rank: int | None, seq: int | None, decide: bool, /) -> Any:
        """``fn(engine, ..., decide)``, the batch laid in the open run (or queued as ``run`` does)."""
    def seal(self) -> None:
        """Queue the open run, if it holds any apply."""
    def stock(self, nbytes: int, /) -> None:
        """Keep buffers (made and touched now) for runs holding ``nbytes``."""
    @property
    def pending(self) -> int:
        """Records queued and not written yet (each apply of a run counted)."""


class ApplyRun:
    """Records a journal laid out in one buffer (applyrun.c): applies, and records laid
    already framed."""

    answers: int  # the queries' answers among the records laid framed

    def __len__(self) -> int: ...
    def item(self, i: int, /) -> tuple[Any, ...] | bytes | None:
        """Record ``i`` as the journal's tuple ``(op, wall, args, result, times)``, its
        frame when it was laid framed, or None in the place of a record queued apart."""


def frame_run(run: ApplyRun, start: int, hashed: bool, seed: int, fd: int, /) -> tuple[int, int]:
    """Write the frames of the run's records from ``start`` to ``fd``; (next, bytes written).
    The Python twin is ``Recorder._encode`` with ``recfile.frame``."""


def frame_many(bodies: list[bytes], /) -> bytes:
    """Each body framed as ``recfile.frame`` frames it, joined."""
