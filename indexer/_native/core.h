/* core.h: what the files of indexer._native._core share. The storage structs
 * (U64Map, Node and its Side), the module's objects and type objects, the byte-order
 * and hash-table helpers the hot loops call per block (static inline here, so a loop
 * in one file pays no call for a helper kept in another), and the prototypes of the
 * functions one file calls in another, all named kvi_*.
 *
 * Every name that crosses files is hidden (KVI_HIDDEN): the extension exports
 * PyInit__core only, and a call or a read between its files is a direct one, not
 * one through the PLT or the GOT as for a symbol another library could interpose.
 *
 * Which file holds what:
 *   u64map.c    U64Map, the open-addressing table of (uint64, object) slots
 *   node.c      Node, one block of a tree, and its Side
 *   tree.c      the GPU loops over a tree: insert_gpu, insert_gpu_raw, walk, remove_gpu
 *   keys.c      block_keys (xxh3-64 of each block of tokens) and that hash
 *   events.c    vLLM's msgpack events: tokens_from_msgpack, scan_gpu_batch (reader.h reads msgpack)
 *   journal.c   JournalCore: a recording's journal on the hot paths (run, run_apply, clock;
 *               journal.h: its struct)
 *   applyrun.c  ApplyRun: the applies a journal lays out in one buffer, no object each
 *   recframe.c  a recording's frames, built without the GIL: frame_run, frame_many
 *   recquery.c  a recording's query records (and notes, ends, registrations): encode_record
 *               (mpwrite.h: the msgpack writer both share)
 *   recvalue.c  a Python value as msgspec encodes it, for recquery.c
 *   snapshot.c  a snapshot's columns: NodeIndex, dump_*, node_index, translate, load_*
 *   answers.c   the ranked answers of a GPU-only match
 *   ranking.c   a route's ranking of its candidates
 *   rankout.c   a ranking written out: its entries as objects, or as the answer's JSON
 *   _core.c     the module: its method tables, types and objects put together
 */
#ifndef KVI_CORE_H
#define KVI_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "bytes.h"

#if defined(__GNUC__) || defined(__clang__)
#define KVI_HIDDEN __attribute__((visibility("hidden")))
#else
#define KVI_HIDDEN
#endif

/* ------------------------------------------------------------------ U64Map */

typedef struct {
    uint64_t key;
    PyObject *val; /* NULL: empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;     /* NULL while cap == 0 */
    Py_ssize_t cap;  /* a power of two, or 0 */
    Py_ssize_t used; /* slots in use */
    PyObject *other; /* dict of keys that are not ints in [0, 2**64), or NULL */
} U64Map;

/* The module's types (u64map.c, node.c, snapshot.c). */
extern KVI_HIDDEN PyTypeObject kvi_U64MapType;
extern KVI_HIDDEN PyTypeObject kvi_NodeType;
extern KVI_HIDDEN PyTypeObject kvi_NodeIndexType;
extern KVI_HIDDEN PyTypeObject kvi_JournalCoreType; /* journal.c */
extern KVI_HIDDEN PyTypeObject kvi_ApplyRunType;    /* applyrun.c */

/* ------------------------------------------------------------------ ApplyRun */

/* One journaled apply as JournalCore.run_apply lays it in an ApplyRun's buffer (native
 * byte order, 8-byte aligned): this head, then its clock readings (nt doubles), then the
 * UTF-8 of its engine, model and outcome and the payload's bytes, padded to 8. */
typedef struct {
    uint32_t size; /* the whole record, padded */
    uint8_t op, has_rank, has_seq, has_ts, decide;
    uint8_t stripped; /* the payload as ``hashed`` mode keeps it already (the key sink's) */
    uint8_t pad_[2];
    uint32_t nt, engine_n, model_n, outcome_n;
    uint64_t payload_n;
    int64_t dp_rank, seq;
    double wall, ts;
} ARec;

/* The op of a record laid encoded (recquery.c's kvi_lay_record); its payload is the
 * record's body, which the writer frames (recframe.c); nothing else is set. The
 * journal's ops are 1 and up. */
#define AREC_ENCODED 0
/* The op of the place of a record queued apart, in the journal's ``apart`` queue (the
 * writer takes it from there); nothing else is set. */
#define AREC_APART 255

#define AREC_TIMES(r) ((const double *)((const unsigned char *)(r) + sizeof(ARec)))
#define AREC_ENGINE(r) ((const char *)(AREC_TIMES(r) + (r)->nt))
#define AREC_MODEL(r) (AREC_ENGINE(r) + (r)->engine_n)
#define AREC_OUTCOME(r) (AREC_MODEL(r) + (r)->model_n)
#define AREC_PAYLOAD(r) ((const unsigned char *)AREC_OUTCOME(r) + (r)->outcome_n)

typedef struct {
    PyObject_HEAD
    PyObject *journal;   /* the JournalCore that laid it out (kvi_journal_release), or NULL */
    unsigned char *buf;  /* the C allocator's */
    size_t len, cap;
    Py_ssize_t count;    /* records in buf */
    Py_ssize_t answers;  /* the queries' answers among the records laid encoded (op AREC_ENCODED) */
    Py_ssize_t at_i;     /* a cursor: record at_i begins at byte at_off */
    size_t at_off;
} ApplyRun;

/* The key sink: what a batch's apply already knows of it, kept for a recording in
 * ``hashed`` mode, which keeps each plain GPU store's block keys in place of its token
 * ids. Reading the token ids a second time and hashing them on the writer's thread was
 * most of what recording a batch cost (~2.6 us of ~21 for 64 blocks, on a machine whose
 * two cores the ingest and its publishers already fill); the apply has both in hand.
 *
 * JournalCore.run_apply opens it for its own thread around the call; scan_gpu_batch
 * notes each store's token_ids span in the payload (and the tokens bytes object it made
 * for it), insert_gpu_raw each store's keys, found by that object (a store that takes
 * another path gets none). The journal then lays the batch stripped only if every store
 * has its keys; else as received, and the writer strips it as before. */
typedef struct {
    uint32_t tok_at, tok_end; /* the token_ids value's bytes in the payload */
    uint32_t nblocks, keys_at; /* its keys: keys[keys_at : keys_at + nblocks] */
    const PyObject *tokens;    /* the tokens bytes scan_gpu_batch made for it (identity only) */
    int keyed;
} SinkStore;

typedef struct {
    PyThreadState *owner; /* the thread whose apply it notes; NULL: closed */
    uint64_t seed;        /* the seed keys must be made with */
    int scanned;          /* 1: the batch was scanned whole, every store plain and of block size >= 2
                             with an ASCII kind (recframe.c's rule); 0 not; -1 spoiled */
    uint32_t nstores, cap;
    SinkStore *stores;
    uint64_t *keys;
    size_t nkeys, kcap;
} KeySink;

extern KVI_HIDDEN KeySink kvi_sink; /* journal.c */

/* The sink noting nothing yet: a new batch (scan_gpu_batch), or a new apply (run_apply). */
static inline void
sink_reset(KeySink *ks)
{
    ks->scanned = 0;
    ks->nstores = 0;
    ks->nkeys = 0;
}

/* The sink if it is open for this thread, else NULL. */
static inline KeySink *
sink_here(void)
{
    return kvi_sink.owner != NULL && kvi_sink.owner == PyThreadState_Get() ? &kvi_sink : NULL;
}

/* Record ``i`` of ``run`` (0 <= i < count; moves the cursor; no GIL needed). */
KVI_HIDDEN const ARec *kvi_run_rec(ApplyRun *run, Py_ssize_t i);
/* A run is done with: its journal counts ``count`` fewer pending records (``len`` fewer
 * bytes) and may keep ``buf`` for its next run (else it is freed). */
KVI_HIDDEN void kvi_journal_release(PyObject *journal, Py_ssize_t count, size_t len, unsigned char *buf, size_t cap);

/* Made by the module's init (_core.c), one reference held there. */
extern KVI_HIDDEN PyObject *kvi_DEAD;     /* the sentinel parent of freed nodes; module attribute DEAD */
extern KVI_HIDDEN PyObject *kvi_ZERO;     /* 0, a new node's GPU mask */
extern KVI_HIDDEN PyObject *kvi_GPU_NAME; /* "GPU", interned */

/* A tuple whose items are all untracked by the cyclic collector (strings, numbers,
 * such tuples) cannot be in a cycle: untracked now, as the collector would itself at its
 * next pass, so it never walks the answers a query builds (or a recording keeps).
 * NULL or anything else: nothing. */
static inline void
untrack_atomic(PyObject *t)
{
    if (t == NULL || !PyTuple_Check(t) || !PyObject_GC_IsTracked(t))
        return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        if (PyObject_IS_GC(x) && PyObject_GC_IsTracked(x))
            return;
    }
    PyObject_GC_UnTrack(t);
}

/* Keys are hashes already, but tests and some engines send small ints: mix. */
static inline uint64_t
mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Byte orders on the wire: msgpack is big-endian (be() below), our packed columns
 * little-endian (put_le32, in bytes.h). */

static inline uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static inline void
put_le64(unsigned char *o, uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(o, &v, 8); /* one store: GCC -O2 kept the byte loop below a loop (scan_gpu_batch's hashes, a recording's keys) */
#else
    for (int i = 0; i < 8; i++)
        o[i] = (unsigned char)(v >> (8 * i));
#endif
}

/* A msgpack bin header for ``n`` bytes at ``o``: bin 8, 16 or 32, the smallest (as
 * msgspec writes it); its length (2, 3 or 5), and with ``o`` NULL only that. */
static inline size_t
put_bin_head(unsigned char *o, size_t n)
{
    size_t w = n < 256 ? 1 : n < 65536 ? 2 : 4;
    if (o != NULL) {
        o[0] = w == 1 ? 0xc4 : w == 2 ? 0xc5 : 0xc6;
        for (size_t i = 0; i < w; i++)
            o[1 + i] = (unsigned char)(n >> (8 * (w - 1 - i)));
    }
    return w + 1;
}

static inline uint32_t
get_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t
get_le64(const unsigned char *p)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8); /* one load: the loop below was ~9 instructions a key (a walk's packed keys) */
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

/* 1: *out holds the key; 0: not an int in [0, 2**64) (use the dict); -1: error. */
static inline int
as_u64(PyObject *k, uint64_t *out)
{
    if (!PyLong_Check(k))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(k);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 1;
}

static inline Py_ssize_t
map_find(U64Map *m, uint64_t k)
{
    if (m->cap == 0)
        return -1;
    size_t mask = (size_t)m->cap - 1;
    size_t i = (size_t)mix64(k) & mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (s->val == NULL)
            return -1;
        if (s->key == k)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

/* Borrowed value for key, NULL when absent (*err set on a real error). */
static inline PyObject *
map_lookup(U64Map *m, PyObject *key, int *err)
{
    uint64_t k;
    int r = as_u64(key, &k);
    *err = 0;
    if (r > 0) {
        Py_ssize_t i = map_find(m, k);
        return i < 0 ? NULL : m->slots[i].val;
    }
    if (r < 0) {
        *err = 1;
        return NULL;
    }
    if (m->other == NULL)
        return NULL;
    PyObject *v = PyDict_GetItemWithError(m->other, key);
    if (v == NULL && PyErr_Occurred())
        *err = 1;
    return v;
}

/* A new, empty map (a node's children once it branches). */
static inline U64Map *
map_new(void)
{
    U64Map *m = PyObject_New(U64Map, &kvi_U64MapType);
    if (m == NULL)
        return NULL;
    m->slots = NULL;
    m->cap = 0;
    m->used = 0;
    m->other = NULL;
    return m;
}

/* keys.c: the block key's hash, xxh3-64 with a seed (the xxhash wheel's XXH3_64bits_withSeed). */
KVI_HIDDEN uint64_t kvi_xxh3_64(const void *data, size_t len, uint64_t seed);
KVI_HIDDEN uint64_t kvi_xxh64(const void *data, size_t len, uint64_t seed);

/* The key memo: the block keys block_keys made of one prompt (one block size, one seed,
 * blocks 0..m-1, made in one call or in contiguous chunks) while a recording's journaled
 * query runs, so the record's encoder (recquery.c's w_prompt, hashed mode) writes them
 * without hashing the prompt a second time (~60% of encoding a 1,024-token query's
 * record). Armed by the journal around the call (journal.c) and emptied after; ``buf``
 * is held, so an object at its address is that prompt. The GIL guards it. */
typedef struct {
    int armed;
    PyObject *buf;        /* the prompt's bytes (a reference held), or NULL */
    Py_ssize_t bs, m, cap;
    uint64_t seed;
    uint64_t *keys;       /* m keys, native order */
} KeyMemo;
extern KVI_HIDDEN KeyMemo kvi_key_memo;
/* Arm the memo (on) or disarm and empty it (0). */
KVI_HIDDEN void kvi_key_memo_arm(int on);

/* u64map.c. kvi_map_put stores (k, v) taking a new reference and replaces an existing
 * value; kvi_map_take removes slot i and returns its value (the caller owns it);
 * kvi_map_store and kvi_map_pop take any key (a non-u64 one goes to the side dict);
 * kvi_map_pop returns a new reference, NULL with KeyError set when absent. */
KVI_HIDDEN int kvi_map_resize(U64Map *m, Py_ssize_t newcap);
KVI_HIDDEN int kvi_map_put(U64Map *m, uint64_t k, PyObject *v);
KVI_HIDDEN PyObject *kvi_map_take(U64Map *m, size_t i);
KVI_HIDDEN int kvi_map_store(U64Map *m, PyObject *key, PyObject *v);
KVI_HIDDEN PyObject *kvi_map_pop(U64Map *m, PyObject *key);

/* -------------------------------------------------------------------- Node */

/* A node is 48 bytes: CPython's allocator hands out 16-byte size classes, so the
 * fields that matter on every block (header, key, parent, kids, GPU mask) fill
 * one class exactly, and a sixth pointer would cost 16 bytes, not 8, on every
 * node. `tiers` and `dup` are None on almost every node (only CPU-tier blocks
 * and repeated announcements set them), so they move to a Side, made when one
 * of them is set and freed when both are None again. `gs` is the GPU mask
 * itself while there is no Side, else the Side's address with its low bit set
 * (objects and PyMem blocks are at least 8-byte aligned, so a real object
 * pointer never has it): the hot loops read the mask with one test of that bit
 * and no extra load. A node with a Side costs 48 + 32 bytes (24 rounded to the
 * 32-byte class), 16 more than the old 64-byte node. */
typedef struct {
    PyObject *gpu;   /* int: bit mask of the workers holding the block on GPU */
    PyObject *tiers; /* None or {tid: mask} for the other tiers (tree.py) */
    PyObject *dup;   /* None or {(wid << 5) | tid: extra announcements} */
} Side;

typedef struct {
    PyObject_HEAD
    uint64_t key; /* the block key; 0 for the root and DEAD (their key is never read) */
    PyObject *parent;
    PyObject *kids; /* None, one Node, or a U64Map key -> Node */
    PyObject *gs;   /* the GPU mask, or (Side *) | 1: read it through node_gpu */
} Node;

#define HAS_SIDE(n) (((uintptr_t)(n)->gs) & 1)
#define SIDE(n) ((Side *)((uintptr_t)(n)->gs & ~(uintptr_t)1))

#define NODE_SET(field, v) do { PyObject *_o = (field); Py_INCREF(v); (field) = (v); Py_DECREF(_o); } while (0)

/* The GPU mask (borrowed). */
static inline PyObject *
node_gpu(Node *n)
{
    return __builtin_expect(HAS_SIDE(n), 0) ? SIDE(n)->gpu : n->gs;
}

/* tiers and dup (borrowed): None without a Side. */
static inline PyObject *
node_tiers(Node *n)
{
    return HAS_SIDE(n) ? SIDE(n)->tiers : Py_None;
}

static inline PyObject *
node_dup(Node *n)
{
    return HAS_SIDE(n) ? SIDE(n)->dup : Py_None;
}

/* Set the GPU mask to v (borrowed). */
static inline void
node_set_gpu(Node *n, PyObject *v)
{
    PyObject **slot = __builtin_expect(HAS_SIDE(n), 0) ? &SIDE(n)->gpu : &n->gs;
    PyObject *old = *slot;
    Py_INCREF(v);
    *slot = v;
    Py_DECREF(old); /* last: the node is whole if this runs a finalizer */
}

/* node.c: set tiers (dup: dup) to v (borrowed), making or freeing the Side. */
KVI_HIDDEN int kvi_node_set_side(Node *n, int dup, PyObject *v);

#define node_set_tiers(n, v) kvi_node_set_side((n), 0, (v))
#define node_set_dup(n, v) kvi_node_set_side((n), 1, (v))

/* A new leaf under `parent` with GPU mask `gpu` (both borrowed). */
static inline Node *
node_make(uint64_t key, PyObject *parent, PyObject *gpu)
{
    Node *n = PyObject_New(Node, &kvi_NodeType);
    if (n == NULL)
        return NULL;
    n->key = key;
    Py_INCREF(parent);
    n->parent = parent;
    Py_INCREF(Py_None);
    n->kids = Py_None;
    Py_INCREF(gpu);
    n->gs = gpu;
    return n;
}

#define IS_NODE(o) (Py_TYPE(o) == &kvi_NodeType)
#define IS_MAP(o) (Py_TYPE(o) == &kvi_U64MapType)

/* The child of `parent` keyed k (borrowed), or NULL. Only nodes count as
 * children: whatever else a map might hold is never treated as one. */
static inline PyObject *
child_of(Node *parent, uint64_t k)
{
    PyObject *kids = parent->kids;
    if (IS_NODE(kids))
        return ((Node *)kids)->key == k ? kids : NULL;
    if (IS_MAP(kids)) {
        Py_ssize_t i = map_find((U64Map *)kids, k);
        PyObject *v = i < 0 ? NULL : ((U64Map *)kids)->slots[i].val;
        return v != NULL && IS_NODE(v) ? v : NULL;
    }
    return NULL;
}

/* A record frame's checksum: the low 32 bits of the body's xxh3-64, seed 0 (recframe.c). */
KVI_HIDDEN uint32_t kvi_rec_checksum(const unsigned char *p, size_t n);
/* A frame's head at ``p`` (recfile.frame's: length, then checksum) for the ``n`` bytes of
 * body at ``body``. */
static inline void
put_frame_head(unsigned char *p, const unsigned char *body, size_t n)
{
    put_le32(p, (uint32_t)n);
    put_le32(p + 4, kvi_rec_checksum(body, n));
}
/* The kinds it writes of the queries' records (recquery.c's, record.py's _KINDS). */
#define KVI_REC_MATCH_PLAIN 3
#define KVI_REC_ROUTE 4
#define KVI_REC_MATCH 5
#define KVI_REC_MATCH_BY_KEYS 6

/* The functions each file adds to the module (_core.c puts them in). */
extern KVI_HIDDEN PyMethodDef kvi_tree_methods[];
extern KVI_HIDDEN PyMethodDef kvi_keys_methods[];
extern KVI_HIDDEN PyMethodDef kvi_events_methods[];
extern KVI_HIDDEN PyMethodDef kvi_recframe_methods[];
extern KVI_HIDDEN PyMethodDef kvi_recquery_methods[];
extern KVI_HIDDEN PyMethodDef kvi_snapshot_methods[];
extern KVI_HIDDEN PyMethodDef kvi_answers_methods[];
extern KVI_HIDDEN PyMethodDef kvi_ranking_methods[];
extern KVI_HIDDEN PyMethodDef kvi_rankout_methods[];

/* ------------------------------------------------- a route's ranking (ranking.c) */

/* One candidate of a route as ranking.c weighs it, for rankout.c to write out: its sort
 * key (never connected, cost, -score, engine, rank) and the other values of its entry.
 * No Python object is made per candidate until the entry is written. */
typedef struct {
    int never;
    double cost, negscore;
    PyObject *engine; /* borrowed from the candidate, as rk (its rank) and st (stale) */
    long long rank;
    PyObject *rk, *st;
    PyObject *wm;               /* borrowed from the match; NULL: nothing matched there */
    PyObject *pb;               /* predicted blocks: borrowed from `pred`, or kvi_ZERO */
    PyObject *ld0, *ld1, *conn; /* owned: the load weighed, the link's state now */
    PyObject *src;              /* borrowed: "caller", "index" or the idle source */
    long long pos;              /* its place in (engine, rank) order (a model's row), or -1 */
} KviCand;

/* What the entries of one answer share (immutable objects made once): the last score and
 * cost made, and an idle worker's load struct. Zeroed before, released by kvi_shared_clear. */
typedef struct {
    PyObject *last_score, *last_cost, *idle_ld;
} KviShared;

KVI_HIDDEN extern PyObject *kvi_src_caller, *kvi_src_index; /* "caller", "index", interned */
KVI_HIDDEN int kvi_rankout_init(void);
/* The entry of `c`: a dict, or entry_cls(..., load_cls(...)); a new reference, NULL on error. */
KVI_HIDDEN PyObject *kvi_rank_entry(const KviCand *c, PyObject *entry_cls, PyObject *load_cls, PyObject *idle,
                                    KviShared *sh);
KVI_HIDDEN void kvi_shared_clear(KviShared *sh);
/* "engine/rank" as f"{engine}/{rank}" makes it (r: rank's value); NULL on error. */
KVI_HIDDEN PyObject *kvi_worker_name(PyObject *engine, PyObject *rank, long long r);
/* The JSON array of the entries of cs[0..k), the bytes msgspec makes of them; NULL with
 * no error set when a value is one only msgspec writes exactly (the caller declines). */
KVI_HIDDEN PyObject *kvi_rank_json(const KviCand *cs, Py_ssize_t k);

#endif /* KVI_CORE_H */
