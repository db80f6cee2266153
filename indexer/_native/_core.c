/* indexer._core: the compiled storage of the prefix index.
 *
 * Why it exists: in pure Python every block costs a 64-byte node plus a 40-byte
 * int object for its key, and every (worker, block) residency a dict slot plus a
 * 40-byte int object for the engine's hash: ~180 bytes per resident entry. Here
 * a node carries its key as a uint64 inside the object and its rarely set tiers
 * and dup outside it (48 bytes in all, see Side) and the engine-hash and child
 * maps are open-addressing tables of (uint64, object) slots (16 bytes each, no
 * key objects).
 *
 * What it holds:
 *   Node        one block: key (uint64), parent, kids, gpu, tiers, dup. The
 *               drop-in twin of the msgspec ``Node`` in tree.py (same
 *               constructor, same attributes); tiers and dup live in a Side
 *               made only while one of them is set.
 *   U64Map      a dict-like map whose int keys in [0, 2**64) live in the table;
 *               any other key (a bytes hash, a negative int) goes to a plain
 *               dict inside, so every key a vLLM engine can send works.
 *   DEAD        the sentinel parent of freed nodes.
 *   insert_gpu  the hot loop of a GPU store (tree.insert_gpu is its reference).
 *   remove_gpu  the loop of a GPU removal in an uncapped tree, with the freeing
 *               of unheld nodes (PrefixIndex._remove_one and Tree.free_up are
 *               its reference: the pure build runs them).
 *   walk        the GPU walk of a query (tree.walk is its reference).
 *   answers     the ranked per-worker answers of a GPU-only, one-group match
 *               (result.gpu_answers is its reference).
 *   block_keys  xxh3-64 of each block of little-endian uint32 tokens (keys.py
 *               documents the key; keys._py_block_keys is the reference).
 *   dump_tree, dump_map, load_tree, load_map
 *               a snapshot's columns (snapshot.py): a tree walked to
 *               little-endian parent / key / mask-id arrays and back, a
 *               worker's map to hash / node-index arrays and back, with no
 *               Python object per node or entry on the way (the
 *               snapshot._py_* twins are the reference, byte for byte).
 *   NodeIndex   dump_tree's node -> index table (16-byte slots over node
 *               pointers, for dump_map and the rest of the cut).
 *   tokens_from_msgpack, split_tokens_json
 *               token ids (an event's msgpack array, a request's JSON body)
 *               straight to little-endian uint32 bytes, with no Python int per
 *               token; None for anything but plain arrays of uint32, so the
 *               caller's typed decoder can say what is wrong.
 *
 * Neither Node nor U64Map is tracked by the cycle collector: millions of them
 * would make every collection pass slow. Parent <-> child cycles are broken by
 * hand (Tree.free_up, Tree.clear), as with the pure-Python nodes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* xxHash 0.8.4 (BSD-2-Clause, vendor/LICENSE.xxhash): the version the `xxhash`
 * wheel bundles, so keys are bit-identical to xxhash.xxh3_64_intdigest. */
#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

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

static PyTypeObject U64MapType;
static PyTypeObject NodeType;

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

/* Byte orders on the wire: msgpack is big-endian, our packed columns little-endian. */
static inline void
put_le32(unsigned char *o, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(o, &v, 4); /* one store */
#else
    o[0] = (unsigned char)v;
    o[1] = (unsigned char)(v >> 8);
    o[2] = (unsigned char)(v >> 16);
    o[3] = (unsigned char)(v >> 24);
#endif
}

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
    for (int i = 0; i < 8; i++)
        o[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t
get_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t
get_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
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

/* A table of cap slots, zeroed. A big one (a worker's map at 10^6 entries is 32 MiB) is
 * mapped with MAP_POPULATE: calloc's fresh pages fault twice each on the rehash below
 * (a read maps the zero page, the write copies it), one page at a time; populated, the
 * kernel fills them in one call. slots_free must be given the same cap. */
#if defined(__linux__)
#define BIG_TABLE ((size_t)1 << 21)
#endif

static Slot *
slots_alloc(Py_ssize_t cap)
{
#ifdef BIG_TABLE
    size_t bytes = (size_t)cap * sizeof(Slot);
    if (bytes >= BIG_TABLE) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
#endif
    return PyMem_Calloc((size_t)cap, sizeof(Slot));
}

static void
slots_free(Slot *slots, Py_ssize_t cap)
{
#ifdef BIG_TABLE
    if (slots != NULL && (size_t)cap * sizeof(Slot) >= BIG_TABLE) {
        munmap(slots, (size_t)cap * sizeof(Slot));
        return;
    }
#endif
    PyMem_Free(slots);
}

static int
map_resize(U64Map *m, Py_ssize_t newcap)
{
    Slot *ns = slots_alloc(newcap);
    if (ns == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = (size_t)newcap - 1;
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        Slot *s = &m->slots[j];
        if (s->val == NULL)
            continue;
        size_t i = (size_t)mix64(s->key) & mask;
        while (ns[i].val != NULL)
            i = (i + 1) & mask;
        ns[i] = *s;
    }
    slots_free(m->slots, m->cap);
    m->slots = ns;
    m->cap = newcap;
    return 0;
}

/* Hint the cache with the home slot of each int key in items[0:n] (others skipped). */
static inline void
map_prefetch(U64Map *m, PyObject *const *items, Py_ssize_t n)
{
    if (m->cap == 0)
        return;
    size_t mask = (size_t)m->cap - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyLong_CheckExact(k))
            continue;
        unsigned long long v = PyLong_AsUnsignedLongLong(k);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or too big: map_lookup sends it to the dict */
            continue;
        }
        __builtin_prefetch(&m->slots[(size_t)mix64((uint64_t)v) & mask]);
    }
}

/* Store (k, v) (a new reference is taken); replaces an existing value. */
static int
map_put(U64Map *m, uint64_t k, PyObject *v)
{
    Py_ssize_t i = map_find(m, k);
    if (i >= 0) {
        PyObject *old = m->slots[i].val;
        Py_INCREF(v);
        m->slots[i].val = v;
        Py_DECREF(old);
        return 0;
    }
    /* Load factor at most 3/4; the smallest table has 4 slots (a 2-child node). */
    if ((m->used + 1) * 4 > m->cap * 3) {
        if (map_resize(m, m->cap ? m->cap * 2 : 4) < 0)
            return -1;
    }
    size_t mask = (size_t)m->cap - 1;
    size_t j = (size_t)mix64(k) & mask;
    while (m->slots[j].val != NULL)
        j = (j + 1) & mask;
    Py_INCREF(v);
    m->slots[j].key = k;
    m->slots[j].val = v;
    m->used++;
    return 0;
}

/* Remove slot i (backward-shift deletion: no tombstones under churn) and return
 * its value (the caller owns the reference). Shrinks a table that went sparse,
 * so a worker's map follows its cache down after evictions. */
static PyObject *
map_take(U64Map *m, size_t i)
{
    PyObject *v = m->slots[i].val;
    size_t mask = (size_t)m->cap - 1;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot *s = &m->slots[j];
        if (s->val == NULL)
            break;
        size_t h = (size_t)mix64(s->key) & mask;
        if (((j - h) & mask) >= ((j - i) & mask)) {
            m->slots[i] = *s;
            i = j;
        }
    }
    m->slots[i].val = NULL;
    m->used--;
    if (m->cap > 16 && m->used * 8 < m->cap) {
        Py_ssize_t nc = 4;
        while (nc * 3 < m->used * 8) /* land at a load of at most 3/8 */
            nc *= 2;
        if (map_resize(m, nc) < 0)
            PyErr_Clear(); /* keep the bigger table: still correct */
    }
    return v;
}

static Py_ssize_t
map_len(U64Map *m)
{
    Py_ssize_t n = m->used;
    if (m->other != NULL)
        n += PyDict_GET_SIZE(m->other);
    return n;
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

static int
map_store(U64Map *m, PyObject *key, PyObject *v)
{
    uint64_t k;
    int r = as_u64(key, &k);
    if (r > 0)
        return map_put(m, k, v);
    if (r < 0)
        return -1;
    if (m->other == NULL && (m->other = PyDict_New()) == NULL)
        return -1;
    return PyDict_SetItem(m->other, key, v);
}

/* New reference to the removed value; NULL with KeyError set when absent. */
static PyObject *
map_pop(U64Map *m, PyObject *key)
{
    uint64_t k;
    int r = as_u64(key, &k);
    if (r > 0) {
        Py_ssize_t i = map_find(m, k);
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return NULL;
        }
        return map_take(m, (size_t)i);
    }
    if (r < 0)
        return NULL;
    PyObject *v = m->other == NULL ? NULL : PyDict_GetItemWithError(m->other, key);
    if (v == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(v);
    if (PyDict_DelItem(m->other, key) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

static void
map_clear_all(U64Map *m)
{
    Slot *slots = m->slots;
    Py_ssize_t cap = m->cap;
    PyObject *other = m->other;
    m->slots = NULL;
    m->cap = 0;
    m->used = 0;
    m->other = NULL;
    for (Py_ssize_t j = 0; j < cap; j++)
        Py_XDECREF(slots[j].val);
    slots_free(slots, cap);
    Py_XDECREF(other);
}

static U64Map *
map_new(void)
{
    U64Map *m = PyObject_New(U64Map, &U64MapType);
    if (m == NULL)
        return NULL;
    m->slots = NULL;
    m->cap = 0;
    m->used = 0;
    m->other = NULL;
    return m;
}

static PyObject *
U64Map_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if ((kwds != NULL && PyDict_GET_SIZE(kwds)) || PyTuple_GET_SIZE(args) > 1) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes at most one mapping or iterable of pairs");
        return NULL;
    }
    U64Map *m = map_new();
    if (m == NULL)
        return NULL;
    if (PyTuple_GET_SIZE(args) == 1) {
        PyObject *src = PyTuple_GET_ITEM(args, 0);
        PyObject *d = PyDict_New();
        if (d == NULL || PyDict_Merge(d, src, 1) < 0) {
            /* not a mapping: an iterable of pairs */
            if (d != NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                if (PyDict_MergeFromSeq2(d, src, 1) == 0)
                    goto fill;
            }
            Py_XDECREF(d);
            Py_DECREF(m);
            return NULL;
        }
    fill:;
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(d, &pos, &k, &v)) {
            if (map_store(m, k, v) < 0) {
                Py_DECREF(d);
                Py_DECREF(m);
                return NULL;
            }
        }
        Py_DECREF(d);
    }
    return (PyObject *)m;
}

static void
U64Map_dealloc(U64Map *m)
{
    map_clear_all(m);
    PyObject_Free(m);
}

static Py_ssize_t
U64Map_length(U64Map *m)
{
    return map_len(m);
}

static PyObject *
U64Map_subscript(U64Map *m, PyObject *key)
{
    int err;
    PyObject *v = map_lookup(m, key, &err);
    if (v == NULL) {
        if (!err)
            PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

static int
U64Map_ass_subscript(U64Map *m, PyObject *key, PyObject *v)
{
    if (v != NULL)
        return map_store(m, key, v);
    PyObject *old = map_pop(m, key);
    if (old == NULL)
        return -1;
    Py_DECREF(old);
    return 0;
}

static int
U64Map_contains(U64Map *m, PyObject *key)
{
    int err;
    PyObject *v = map_lookup(m, key, &err);
    return err ? -1 : v != NULL;
}

static PyObject *
U64Map_get(U64Map *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get() takes 1 or 2 arguments");
        return NULL;
    }
    int err;
    PyObject *v = map_lookup(m, args[0], &err);
    if (v == NULL) {
        if (err)
            return NULL;
        v = nargs == 2 ? args[1] : Py_None;
    }
    Py_INCREF(v);
    return v;
}

static PyObject *
U64Map_pop(U64Map *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop() takes 1 or 2 arguments");
        return NULL;
    }
    PyObject *v = map_pop(m, args[0]);
    if (v == NULL && nargs == 2 && PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyErr_Clear();
        v = args[1];
        Py_INCREF(v);
    }
    return v;
}

/* kind 0: keys, 1: values, 2: (key, value) pairs. A list (a snapshot), so the
 * map may change while the caller walks it. */
static PyObject *
map_list(U64Map *m, int kind)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        Slot *s = &m->slots[j];
        if (s->val == NULL)
            continue;
        PyObject *item;
        if (kind == 1) {
            item = s->val;
            Py_INCREF(item);
        }
        else {
            PyObject *k = PyLong_FromUnsignedLongLong(s->key);
            if (k == NULL)
                goto fail;
            if (kind == 0)
                item = k;
            else {
                item = PyTuple_Pack(2, k, s->val);
                Py_DECREF(k);
                if (item == NULL)
                    goto fail;
            }
        }
        int r = PyList_Append(out, item);
        Py_DECREF(item);
        if (r < 0)
            goto fail;
    }
    if (m->other != NULL) {
        PyObject *rest = kind == 0 ? PyDict_Keys(m->other)
                         : kind == 1 ? PyDict_Values(m->other) : PyDict_Items(m->other);
        if (rest == NULL)
            goto fail;
        Py_ssize_t n = PyList_GET_SIZE(out);
        int r = PyList_SetSlice(out, n, n, rest);
        Py_DECREF(rest);
        if (r < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *
U64Map_keys(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return map_list(m, 0);
}

static PyObject *
U64Map_values(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return map_list(m, 1);
}

static PyObject *
U64Map_items(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return map_list(m, 2);
}

static PyObject *
U64Map_clear(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    map_clear_all(m);
    Py_RETURN_NONE;
}

static PyObject *
U64Map_iter(U64Map *m)
{
    PyObject *keys = map_list(m, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
U64Map_repr(U64Map *m)
{
    PyObject *items = map_list(m, 2);
    if (items == NULL)
        return NULL;
    PyObject *d = PyDict_New();
    if (d == NULL || PyDict_MergeFromSeq2(d, items, 1) < 0) {
        Py_DECREF(items);
        Py_XDECREF(d);
        return NULL;
    }
    Py_DECREF(items);
    PyObject *r = PyUnicode_FromFormat("U64Map(%R)", d);
    Py_DECREF(d);
    return r;
}

static PyObject *
U64Map_sizeof(U64Map *m, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(U64Map) + m->cap * (Py_ssize_t)sizeof(Slot));
}

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))U64Map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "A list of the keys."},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "A list of the values."},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "A list of (key, value) pairs."},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "Remove every entry."},
    {"__sizeof__", (PyCFunction)U64Map_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods U64Map_as_mapping = {
    (lenfunc)U64Map_length,
    (binaryfunc)U64Map_subscript,
    (objobjargproc)U64Map_ass_subscript,
};

static PySequenceMethods U64Map_as_sequence = {
    .sq_contains = (objobjproc)U64Map_contains,
};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.U64Map",
    .tp_doc = "A dict-like map, compact for int keys in [0, 2**64) (block keys, engine hashes).",
    .tp_basicsize = sizeof(U64Map),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = U64Map_tp_new,
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_mapping = &U64Map_as_mapping,
    .tp_as_sequence = &U64Map_as_sequence,
    .tp_methods = U64Map_methods,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_repr = (reprfunc)U64Map_repr,
    .tp_hash = PyObject_HashNotImplemented,
};

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

static PyObject *DEAD; /* module attribute; one reference held by the module */
static PyObject *ZERO;

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

/* Set tiers (dup: dup) to v (borrowed): makes the Side when v is not None, frees
 * it when tiers and dup are both None afterwards. -1 with MemoryError when no
 * Side could be made (the node is unchanged). */
static int
node_set_side(Node *n, int dup, PyObject *v)
{
    if (!HAS_SIDE(n)) {
        if (v == Py_None)
            return 0;
        Side *s = PyMem_Malloc(sizeof(Side));
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->gpu = n->gs; /* the node's reference moves to the Side */
        Py_INCREF(Py_None);
        s->tiers = Py_None;
        Py_INCREF(Py_None);
        s->dup = Py_None;
        n->gs = (PyObject *)((uintptr_t)s | 1);
    }
    Side *s = SIDE(n);
    PyObject **slot = dup ? &s->dup : &s->tiers;
    PyObject *old = *slot;
    Py_INCREF(v);
    *slot = v;
    if (s->tiers == Py_None && s->dup == Py_None) { /* fold back: gs is the mask again */
        n->gs = s->gpu;
        Py_DECREF(Py_None);
        Py_DECREF(Py_None);
        PyMem_Free(s);
    }
    Py_DECREF(old); /* last: the node is whole if this runs a finalizer */
    return 0;
}

#define node_set_tiers(n, v) node_set_side((n), 0, (v))
#define node_set_dup(n, v) node_set_side((n), 1, (v))

static Node *
node_make(uint64_t key, PyObject *parent, PyObject *gpu)
{
    Node *n = PyObject_New(Node, &NodeType);
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

static PyObject *
Node_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if ((kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || nargs < 2 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError,
                        "Node(key, parent, kids=None, gpu=0, tiers=None, dup=None) takes 2 to 6 positional arguments");
        return NULL;
    }
    uint64_t key = 0;
    if (args[0] != Py_None) {
        int r = as_u64(args[0], &key);
        if (r <= 0) {
            if (r == 0)
                PyErr_SetString(PyExc_OverflowError, "a Node key is an int in [0, 2**64) or None");
            return NULL;
        }
    }
    Node *n = node_make(key, args[1], nargs > 3 ? args[3] : ZERO);
    if (n == NULL)
        return NULL;
    if (nargs > 2)
        NODE_SET(n->kids, args[2]);
    if ((nargs > 4 && node_set_tiers(n, args[4]) < 0) || (nargs > 5 && node_set_dup(n, args[5]) < 0)) {
        Py_DECREF(n);
        return NULL;
    }
    return (PyObject *)n;
}

static PyObject *
Node_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Node() takes positional arguments only");
        return NULL;
    }
    return Node_vectorcall((PyObject *)type, &PyTuple_GET_ITEM(args, 0), (size_t)PyTuple_GET_SIZE(args), NULL);
}

static void
Node_dealloc(Node *n)
{
    Py_XDECREF(n->parent);
    Py_XDECREF(n->kids);
    if (HAS_SIDE(n)) {
        Side *s = SIDE(n);
        PyObject *gpu = s->gpu, *tiers = s->tiers, *dup = s->dup;
        PyMem_Free(s);
        Py_DECREF(gpu);
        Py_DECREF(tiers);
        Py_DECREF(dup);
    }
    else
        Py_XDECREF(n->gs);
    PyObject_Free(n);
}

static PyObject *
Node_get_key(Node *n, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(n->key);
}

static PyObject *
Node_repr(Node *n)
{
    return PyUnicode_FromFormat("Node(key=%llu, gpu=%R)", (unsigned long long)n->key, node_gpu(n));
}

/* gpu, tiers and dup from Python: the objects stored (so node.tiers[t] = m
 * changes the node's own dict), writable, not deletable (nothing the index
 * runs deletes them, and the C loops read them without a NULL check). */
static PyObject *
Node_get_gpu(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_gpu(n));
}

static PyObject *
Node_get_tiers(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_tiers(n));
}

static PyObject *
Node_get_dup(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_dup(n));
}

static int
Node_no_delete(PyObject *v, const char *name)
{
    if (v != NULL)
        return 0;
    PyErr_Format(PyExc_AttributeError, "Node.%s cannot be deleted", name);
    return -1;
}

static int
Node_set_gpu(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    if (Node_no_delete(v, "gpu") < 0)
        return -1;
    node_set_gpu(n, v);
    return 0;
}

static int
Node_set_tiers(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    return Node_no_delete(v, "tiers") < 0 ? -1 : node_set_tiers(n, v);
}

static int
Node_set_dup(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    return Node_no_delete(v, "dup") < 0 ? -1 : node_set_dup(n, v);
}

/* The node and its Side, if it has one. */
static PyObject *
Node_sizeof(Node *n, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(Node) + (HAS_SIDE(n) ? (Py_ssize_t)sizeof(Side) : 0));
}

static PyMethodDef Node_methods[] = {
    {"__sizeof__", (PyCFunction)Node_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Node_getset[] = {
    {"key", (getter)Node_get_key, NULL, "The block key (read-only).", NULL},
    {"gpu", (getter)Node_get_gpu, (setter)Node_set_gpu, "Bit mask of the workers holding the block on GPU.", NULL},
    {"tiers", (getter)Node_get_tiers, (setter)Node_set_tiers, "None or {tid: mask} for the other tiers.", NULL},
    {"dup", (getter)Node_get_dup, (setter)Node_set_dup, "None or {(wid << 5) | tid: extra announcements}.", NULL},
    {NULL},
};

static PyMemberDef Node_members[] = {
    {"parent", T_OBJECT, offsetof(Node, parent), 0, NULL},
    {"kids", T_OBJECT, offsetof(Node, kids), 0, NULL},
    {NULL},
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.Node",
    .tp_doc = "One block of a prefix tree (see tree.py).",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Node_tp_new,
    .tp_vectorcall = Node_vectorcall,
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_getset = Node_getset,
    .tp_members = Node_members,
    .tp_methods = Node_methods,
    .tp_repr = (reprfunc)Node_repr,
};

#define IS_NODE(o) (Py_TYPE(o) == &NodeType)
#define IS_MAP(o) (Py_TYPE(o) == &U64MapType)

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

/* The node a worker's map names under hash h (borrowed), or NULL; *err is set on
 * an error, including a value that is not a node. */
static inline Node *
mapped_node(U64Map *wmap, PyObject *h, int *err)
{
    PyObject *v = map_lookup(wmap, h, err);
    if (v != NULL && !IS_NODE(v)) {
        PyErr_SetString(PyExc_TypeError, "a worker's hash map holds nodes only");
        *err = 1;
        return NULL;
    }
    return (Node *)v;
}

/* R-APP-4: one more announcement of a block the worker already holds. */
static int
dup_add(Node *n, PyObject *dupkey)
{
    PyObject *d = node_dup(n);
    if (d == Py_None) {
        d = PyDict_New();
        if (d == NULL)
            return -1;
        PyObject *one = PyLong_FromLong(1);
        int r = one == NULL ? -1 : PyDict_SetItem(d, dupkey, one);
        Py_XDECREF(one);
        if (r < 0) {
            Py_DECREF(d);
            return -1;
        }
        r = node_set_dup(n, d);
        Py_DECREF(d);
        return r;
    }
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "Node.dup must be None or a dict");
        return -1;
    }
    PyObject *c = PyDict_GetItemWithError(d, dupkey);
    long v = 0;
    if (c != NULL) {
        v = PyLong_AsLong(c);
        if (v == -1 && PyErr_Occurred())
            return -1;
    }
    else if (PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLong(v + 1);
    if (nv == NULL)
        return -1;
    int r = PyDict_SetItem(d, dupkey, nv);
    Py_DECREF(nv);
    return r;
}

PyDoc_STRVAR(insert_gpu_doc,
"insert_gpu(wmap, parent, hashes, keys, bit, dupkey) -> (last, created, new)\n\n"
"Attach a GPU store's blocks under `parent` for one worker: a hash the worker\n"
"already maps keeps its node (R-APP-2); a new block reuses the child with its key\n"
"or gets a new node born holding `bit`; a block the worker already holds counts\n"
"one more announcement under `dupkey` in node.dup (R-APP-4). Changes the tree,\n"
"`wmap` and the nodes' gpu and dup. Returns the last node, the nodes created\n"
"and the residencies added. Same steps as tree.insert_gpu.");

/* Room for n uint64 values, plus n flag bytes after them with `flags`: `stack` (SCRATCH
 * words) when that fits, else the heap (free it when it is not `stack`); NULL with
 * MemoryError set when the heap has none. */
#define SCRATCH 144
static uint64_t *
scratch(uint64_t *stack, Py_ssize_t n, int flags)
{
    size_t need = (size_t)n * sizeof(uint64_t) + (flags ? (size_t)n : 0);
    if (need <= SCRATCH * sizeof(uint64_t))
        return stack;
    uint64_t *p = PyMem_Malloc(need);
    if (p == NULL)
        PyErr_NoMemory();
    return p;
}

/* The loop of a GPU store (tree.insert_gpu is its reference): n blocks with hashes
 * hv[i] (ok NULL: all are uint64s; ok[i] = 0: not one, look hashes[i] up through the
 * map's dict) and keys
 * either keys[i] (a list of ints) or, with keys NULL, the xxh3-64 with `seed` of block
 * i of the little-endian uint32 `tokens` (block_size tokens a block), computed only
 * for the blocks that are new. Returns (last node, created, added). */
static PyObject *
insert_loop(U64Map *wmap, Node *parent, Py_ssize_t n, const uint64_t *hv, const char *ok, PyObject *hashes,
            PyObject *keys, const unsigned char *tokens, Py_ssize_t block_size, uint64_t seed, PyObject *bit,
            PyObject *dupkey)
{
    Py_ssize_t created = 0, added = 0;
    /* The worker's map is the one table this loop probes per block, at a random
     * slot each time (a cache miss on any map past a few MB): grow it once for the
     * whole event, then prefetch every block's home slot, so the misses overlap
     * instead of stalling one after the other. */
    if ((wmap->used + n) * 4 > wmap->cap * 3) {
        Py_ssize_t nc = wmap->cap ? wmap->cap : 4;
        while ((wmap->used + n) * 4 > nc * 3)
            nc *= 2;
        if (map_resize(wmap, nc) < 0)
            return NULL;
    }
    {
        size_t mask = (size_t)wmap->cap - 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (ok == NULL || ok[i])
                __builtin_prefetch(&wmap->slots[(size_t)mix64(hv[i]) & mask]);
    }
    size_t step = (size_t)block_size * 4;
    Py_INCREF(parent);
    for (Py_ssize_t i = 0; i < n; i++) {
        int err = 0;
        Node *node;
        int u64 = ok == NULL || ok[i];
        if (u64) {
            Py_ssize_t j = map_find(wmap, hv[i]);
            node = j < 0 ? NULL : (Node *)wmap->slots[j].val;
            if (node != NULL && !IS_NODE(node)) {
                PyErr_SetString(PyExc_TypeError, "a worker's hash map holds nodes only");
                goto fail;
            }
        }
        else {
            node = mapped_node(wmap, PyList_GET_ITEM(hashes, i), &err);
            if (err)
                goto fail;
        }
        if (node == NULL || node->parent == DEAD) {
            uint64_t k;
            if (keys != NULL) {
                int r = as_u64(PyList_GET_ITEM(keys, i), &k);
                if (r <= 0) {
                    if (r == 0)
                        PyErr_SetString(PyExc_OverflowError, "a block key is an int in [0, 2**64)");
                    goto fail;
                }
            }
            else
                k = XXH3_64bits_withSeed(tokens + (size_t)i * step, step, seed);
            node = (Node *)child_of(parent, k);
            if (node == NULL) {
                /* A new block: born holding the worker's bit. */
                Node *nn = node_make(k, (PyObject *)parent, bit);
                if (nn == NULL)
                    goto fail;
                PyObject *kids = parent->kids;
                int st = 0;
                if (kids == Py_None) {
                    NODE_SET(parent->kids, (PyObject *)nn);
                }
                else if (IS_MAP(kids)) {
                    st = map_put((U64Map *)kids, k, (PyObject *)nn);
                }
                else if (!IS_NODE(kids)) {
                    PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
                    st = -1;
                }
                else { /* one child with another key: the node branches */
                    U64Map *km = map_new();
                    if (km == NULL || map_put(km, ((Node *)kids)->key, kids) < 0 ||
                        map_put(km, k, (PyObject *)nn) < 0) {
                        Py_XDECREF(km);
                        st = -1;
                    }
                    else {
                        NODE_SET(parent->kids, (PyObject *)km);
                        Py_DECREF(km);
                    }
                }
                if (st < 0 || (u64 ? map_put(wmap, hv[i], (PyObject *)nn)
                                     : map_store(wmap, PyList_GET_ITEM(hashes, i), (PyObject *)nn)) < 0) {
                    Py_DECREF(nn); /* out of memory, or a tree that is not one */
                    goto fail;
                }
                created++;
                Py_DECREF(parent);
                parent = nn; /* owns the reference from node_make */
                continue;
            }
            if ((u64 ? map_put(wmap, hv[i], (PyObject *)node)
                       : map_store(wmap, PyList_GET_ITEM(hashes, i), (PyObject *)node)) < 0)
                goto fail;
        }
        PyObject *m = node_gpu(node);
        PyObject *x = PyNumber_And(m, bit);
        if (x == NULL)
            goto fail;
        int held = PyObject_IsTrue(x);
        Py_DECREF(x);
        if (held < 0)
            goto fail;
        if (held) {
            if (dup_add(node, dupkey) < 0)
                goto fail;
        }
        else {
            PyObject *nm = PyNumber_Or(m, bit);
            if (nm == NULL)
                goto fail;
            node_set_gpu(node, nm); /* releases m */
            Py_DECREF(nm);
            added++;
        }
        Py_INCREF(node);
        Py_DECREF(parent);
        parent = node;
    }
    return Py_BuildValue("(Nnn)", (PyObject *)parent, created, added + created);
fail:
    Py_DECREF(parent);
    return NULL;
}

static PyObject *
insert_gpu(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyList_Check(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "insert_gpu(U64Map, Node, list, list, int, int)");
        return NULL;
    }
    PyObject *hashes = args[2], *keys = args[3];
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (PyList_GET_SIZE(keys) < n) {
        PyErr_SetString(PyExc_ValueError, "fewer keys than hashes");
        return NULL;
    }
    /* Each hash read once as a uint64 (hv; ok[i] = 0 for a bytes or out-of-range
     * hash, which goes through the map's dict): a 64-bit int is several digits, and
     * converting it costs as much as the probe it feeds. */
    uint64_t stack[SCRATCH];
    uint64_t *hv = scratch(stack, n, 1);
    if (hv == NULL)
        return NULL;
    char *ok = (char *)(hv + n);
    PyObject *res = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = as_u64(PyList_GET_ITEM(hashes, i), &hv[i]);
        if (r < 0)
            goto done;
        ok[i] = (char)r;
    }
    res = insert_loop((U64Map *)args[0], (Node *)args[1], n, hv, ok, hashes, keys, NULL, 0, 0, args[4], args[5]);
done:
    if (hv != stack)
        PyMem_Free(hv);
    return res;
}

PyDoc_STRVAR(insert_gpu_raw_doc,
"insert_gpu_raw(wmap, parent, hashes, tokens, block_size, seed, bit, dupkey) -> (last, created, new)\n\n"
"insert_gpu for a store read by scan_gpu_batch: `hashes` the little-endian uint64\n"
"engine hashes (bytes), `tokens` the little-endian uint32 token ids (bytes, block_size\n"
"a block, at least as many blocks as hashes); each new block's key is the xxh3-64 of\n"
"its tokens with `seed` (keys.block_keys), computed only for blocks that are new.");

static PyObject *
insert_gpu_raw(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyBytes_Check(args[2]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "insert_gpu_raw(U64Map, Node, bytes, bytes, int, int, int, int)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[4]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[5]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t hlen = PyBytes_GET_SIZE(args[2]), tlen = PyBytes_GET_SIZE(args[3]);
    Py_ssize_t n = hlen / 8;
    if (bs <= 0 || hlen % 8 || tlen < n * bs * 4) {
        PyErr_SetString(PyExc_ValueError, "insert_gpu_raw: hashes must be 8-byte values and tokens cover every block");
        return NULL;
    }
    uint64_t stack[SCRATCH];
    uint64_t *hv = scratch(stack, n, 0);
    if (hv == NULL)
        return NULL;
    const unsigned char *hb = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    for (Py_ssize_t i = 0; i < n; i++)
        hv[i] = get_le64(hb + i * 8);
    PyObject *res = insert_loop((U64Map *)args[0], (Node *)args[1], n, hv, NULL, NULL, NULL,
                                (const unsigned char *)PyBytes_AS_STRING(args[3]), bs, (uint64_t)seed, args[6],
                                args[7]);
    if (hv != stack)
        PyMem_Free(hv);
    return res;
}

PyDoc_STRVAR(walk_doc,
"walk(root, chunks, keep_path) -> (depth, stops, active, path)\n\n"
"Follow the query's block keys (an iterable of lists) down from `root` while a\n"
"child matches. `active` starts as every worker (-1) and narrows to the workers\n"
"whose GPU run is unbroken; `stops` gets (depth, mask) where runs end. Without\n"
"`keep_path` the walk also stops when no worker is left; with it, `path` lists\n"
"the nodes passed (for the other tiers' chunk scan). A chunk may also be bytes of\n"
"little-endian uint64 keys (block_keys with packed). Read-only. Same steps as\n"
"tree.walk.");

static PyObject *
walk(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "walk(Node, iterable of lists, bool)");
        return NULL;
    }
    Node *node = (Node *)args[0];
    int keep = PyObject_IsTrue(args[2]);
    if (keep < 0)
        return NULL;
    PyObject *stops = PyList_New(0);
    PyObject *path = keep ? PyList_New(0) : (Py_INCREF(Py_None), Py_None);
    PyObject *active = PyLong_FromLong(-1);
    PyObject *it = NULL, *chunk = NULL;
    Py_ssize_t d = 0;
    if (stops == NULL || path == NULL || active == NULL)
        goto fail;
    it = PyObject_GetIter(args[1]);
    if (it == NULL)
        goto fail;
    int done = 0;
    while (!done && (chunk = PyIter_Next(it)) != NULL) {
        /* A bytes chunk is packed keys (block_keys with packed): no int object per key. */
        const unsigned char *packed = NULL;
        PyObject *seq;
        Py_ssize_t n;
        PyObject **items = NULL;
        if (PyBytes_CheckExact(chunk)) {
            seq = chunk;
            packed = (const unsigned char *)PyBytes_AS_STRING(chunk);
            n = PyBytes_GET_SIZE(chunk) / 8;
        }
        else {
            seq = PySequence_Fast(chunk, "walk: key chunks must be sequences");
            Py_DECREF(chunk);
            if (seq == NULL) {
                chunk = NULL;
                goto fail;
            }
            n = PySequence_Fast_GET_SIZE(seq);
            items = PySequence_Fast_ITEMS(seq);
        }
        chunk = NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k;
            int r = packed != NULL ? (k = get_le64(packed + 8 * i), 1) : as_u64(items[i], &k);
            if (r < 0) {
                Py_DECREF(seq);
                goto fail;
            }
            Node *next = r ? (Node *)child_of(node, k) : NULL;
            if (next == NULL) {
                done = 1;
                break;
            }
            node = next;
            if (keep) {
                if (PyList_Append(path, (PyObject *)node) < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
            }
            else {
                int t = PyObject_IsTrue(active);
                if (t < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
                if (!t) {
                    done = 1;
                    break;
                }
            }
            PyObject *nm = PyNumber_And(active, node_gpu(node));
            if (nm == NULL) {
                Py_DECREF(seq);
                goto fail;
            }
            int same = nm == active ? 1 : PyObject_RichCompareBool(nm, active, Py_EQ);
            if (same < 0) {
                Py_DECREF(nm);
                Py_DECREF(seq);
                goto fail;
            }
            if (!same) {
                if (d) {
                    PyObject *gone = PyNumber_Xor(active, nm);
                    PyObject *st = gone == NULL ? NULL : Py_BuildValue("(nN)", d, gone);
                    if (st == NULL || PyList_Append(stops, st) < 0) {
                        Py_XDECREF(st);
                        Py_DECREF(nm);
                        Py_DECREF(seq);
                        goto fail;
                    }
                    Py_DECREF(st);
                }
                Py_DECREF(active);
                active = nm;
            }
            else
                Py_DECREF(nm);
            d++;
        }
        Py_DECREF(seq);
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    return Py_BuildValue("(nNNN)", d, stops, active, path);
fail:
    Py_XDECREF(it);
    Py_XDECREF(stops);
    Py_XDECREF(path);
    Py_XDECREF(active);
    return NULL;
}


/* ------------------------------------------------------ keys and token ids */

PyDoc_STRVAR(block_keys_doc,
"block_keys(buf, block_size, seed, limit=-1, start=0, packed=False) -> list[int] | bytes\n\n"
"xxh3-64 of each full block `start` .. `limit` (-1: all) of `buf`, little-endian\n"
"uint32 token ids; `seed` is one int or one per block, indexed from block 0.\n"
"With `packed`, the keys as little-endian uint64 bytes, 8 per block: what walk\n"
"reads without an int object per key.");

static PyObject *
block_keys(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "block_keys(buf, block_size, seed, limit=-1, start=0, packed=False)");
        return NULL;
    }
    /* packed: why a query's keys come as bytes. As ints they are 64 allocations of
     * pymalloc's 48-byte class, the class the tree's nodes live in, freed again at once
     * (Query.match_plain warm at 10^6 entries: 7.8 us with them, 5.3 us packed). */
    int packed = nargs > 5 ? PyObject_IsTrue(args[5]) : 0;
    if (packed < 0)
        return NULL;
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    Py_ssize_t limit = -1, start = 0;
    if (nargs > 3 && args[3] != Py_None && ((limit = PyLong_AsSsize_t(args[3])) == -1 && PyErr_Occurred()))
        return NULL;
    if (nargs > 4 && ((start = PyLong_AsSsize_t(args[4])) == -1 && PyErr_Occurred()))
        return NULL;
    uint64_t seed = 0;
    PyObject *seeds = NULL; /* a sequence: one seed per block */
    if (PyLong_Check(args[2])) {
        if (as_u64(args[2], &seed) <= 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "seed must be in [0, 2**64)");
            return NULL;
        }
    }
    else {
        seeds = PySequence_Fast(args[2], "seed must be an int or a sequence of ints");
        if (seeds == NULL)
            return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        Py_XDECREF(seeds);
        return NULL;
    }
    size_t step = (size_t)bs * 4;
    Py_ssize_t n = (Py_ssize_t)((size_t)view.len / step);
    if (limit >= 0 && limit < n)
        n = limit;
    if (start < 0)
        start = 0;
    if (seeds != NULL && PySequence_Fast_GET_SIZE(seeds) < n) {
        PyErr_SetString(PyExc_ValueError, "fewer seeds than blocks");
        goto fail;
    }
    Py_ssize_t nk = n > start ? n - start : 0;
    PyObject *out = packed ? PyBytes_FromStringAndSize(NULL, nk * 8) : PyList_New(nk);
    if (out == NULL)
        goto fail;
    const char *p = (const char *)view.buf;
    for (Py_ssize_t j = start; j < n; j++) {
        uint64_t sj = seed;
        if (seeds != NULL && as_u64(PySequence_Fast_GET_ITEM(seeds, j), &sj) <= 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "seed must be in [0, 2**64)");
            Py_DECREF(out);
            goto fail;
        }
        uint64_t key = XXH3_64bits_withSeed(p + (size_t)j * step, step, sj);
        if (packed) {
            put_le64((unsigned char *)PyBytes_AS_STRING(out) + 8 * (j - start), key);
            continue;
        }
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (k == NULL) {
            Py_DECREF(out);
            goto fail;
        }
        PyList_SET_ITEM(out, j - start, k);
    }
    PyBuffer_Release(&view);
    Py_XDECREF(seeds);
    return out;
fail:
    PyBuffer_Release(&view);
    Py_XDECREF(seeds);
    return NULL;
}


/* A msgpack reader over [p, end): each rd_* consumes one value of its kind and
 * returns 1, or returns 0 and consumes nothing when the next value is another kind
 * (or truncated). */
typedef struct {
    const unsigned char *p, *end;
} Rd;

static int
rd_len(Rd *r, unsigned char fix_lo, unsigned char fix_hi, unsigned char c16, unsigned char c32, uint32_t *n)
{
    if (r->p >= r->end)
        return 0;
    unsigned char c = *r->p;
    if (c >= fix_lo && c <= fix_hi) {
        *n = c & (fix_hi - fix_lo);
        r->p += 1;
        return 1;
    }
    if (c == c16 && r->end - r->p >= 3) {
        *n = (uint32_t)be(r->p + 1, 2);
        r->p += 3;
        return 1;
    }
    if (c == c32 && r->end - r->p >= 5) {
        *n = (uint32_t)be(r->p + 1, 4);
        r->p += 5;
        return 1;
    }
    return 0;
}

static int
rd_nil(Rd *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

static int
rd_str(Rd *r, const char **s, uint32_t *n)
{
    Rd save = *r;
    if (r->p < r->end && *r->p == 0xd9 && r->end - r->p >= 2) { /* str8 */
        *n = r->p[1];
        r->p += 2;
    }
    else if (!rd_len(r, 0xa0, 0xbf, 0xda, 0xdb, n))
        return 0;
    if ((uint64_t)(r->end - r->p) < *n) {
        *r = save;
        return 0;
    }
    *s = (const char *)r->p;
    r->p += *n;
    return 1;
}

/* An integer of any msgpack encoding; *neg set for a negative one (then *v is its
 * two's complement as int64). */
static int
rd_int(Rd *r, uint64_t *v, int *neg)
{
    if (r->p >= r->end)
        return 0;
    unsigned char c = *r->p;
    *neg = 0;
    if (c <= 0x7f) {
        *v = c;
        r->p += 1;
        return 1;
    }
    if (c >= 0xe0) { /* negative fixint */
        *v = (uint64_t)(int64_t)(int8_t)c;
        *neg = 1;
        r->p += 1;
        return 1;
    }
    if (c >= 0xcc && c <= 0xcf) {
        int w = 1 << (c - 0xcc);
        if (r->end - r->p < 1 + w)
            return 0;
        /* Constant widths, so each read compiles to a load and a byte swap: an event's
         * block hashes are uint64 (0xcf), its token ids mostly uint16 (0xcd). */
        const unsigned char *q = r->p + 1;
        *v = w == 8 ? be(q, 8) : w == 2 ? be(q, 2) : w == 4 ? be(q, 4) : be(q, 1);
        r->p += 1 + w;
        return 1;
    }
    if (c >= 0xd0 && c <= 0xd3) {
        int w = 1 << (c - 0xd0);
        if (r->end - r->p < 1 + w)
            return 0;
        uint64_t u = be(r->p + 1, w);
        int shift = 64 - 8 * w;
        int64_t sv = shift ? (int64_t)(u << shift) >> shift : (int64_t)u;
        *v = (uint64_t)sv;
        *neg = sv < 0;
        r->p += 1 + w;
        return 1;
    }
    return 0;
}

static PyObject *
int_obj(uint64_t v, int neg)
{
    return neg ? PyLong_FromLongLong((long long)(int64_t)v) : PyLong_FromUnsignedLongLong(v);
}

/* A msgpack array of ints in [0, 2**32) at r as little-endian uint32 bytes (*out, a
 * new bytes object, and its length in *count): 1; 0 for anything else (*out NULL);
 * -1 on an error (memory). */
static int
rd_tokens(Rd *r, PyObject **out, uint32_t *count)
{
    uint32_t n;
    *out = NULL;
    if (!rd_len(r, 0x90, 0x9f, 0xdc, 0xdd, &n) || n > (uint64_t)(r->end - r->p))
        return 0; /* every element takes at least one byte */
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 4);
    if (b == NULL)
        return -1;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(b);
    const unsigned char *p = r->p, *end = r->end;
    uint32_t i = 0;
    while (i < n) {
        /* The two shapes a vLLM token id takes (a positive fixint below 128, a uint16
         * above) read inline: ~1,000 per event, the decode's hottest loop; four uint16
         * in a row (the common run) in one step. Anything else through rd_int, which
         * also refuses what is not a uint32. */
        unsigned char *q = o + (size_t)i * 4;
        if (n - i >= 4 && end - p >= 12 && p[0] == 0xcd && p[3] == 0xcd && p[6] == 0xcd && p[9] == 0xcd) {
            put_le32(q, (uint32_t)be(p + 1, 2));
            put_le32(q + 4, (uint32_t)be(p + 4, 2));
            put_le32(q + 8, (uint32_t)be(p + 7, 2));
            put_le32(q + 12, (uint32_t)be(p + 10, 2));
            p += 12;
            i += 4;
            continue;
        }
        uint32_t t;
        if (p < end && *p < 0x80)
            t = *p++;
        else if (end - p >= 3 && *p == 0xcd) {
            t = (uint32_t)be(p + 1, 2);
            p += 3;
        }
        else {
            uint64_t v;
            int neg;
            r->p = p;
            if (!rd_int(r, &v, &neg) || neg || v > 0xffffffffULL) {
                Py_DECREF(b);
                return 0;
            }
            p = r->p;
            t = (uint32_t)v;
        }
        put_le32(q, t);
        i++;
    }
    r->p = p;
    *out = b;
    *count = n;
    return 1;
}

PyDoc_STRVAR(tokens_from_msgpack_doc,
"tokens_from_msgpack(raw) -> bytes | None\n\n"
"A msgpack array of ints in [0, 2**32) (an event's token_ids) as little-endian\n"
"uint32 bytes; None for anything else (nil, other types, out of range, trailing bytes).");

static PyObject *
tokens_from_msgpack(PyObject *Py_UNUSED(mod), PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Rd r = {view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *out;
    uint32_t n;
    int st = rd_tokens(&r, &out, &n);
    PyBuffer_Release(&view);
    if (st < 0)
        return NULL;
    if (st == 0 || r.p != r.end) {
        Py_XDECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* ------------------------------------------------------- scan_gpu_batch */

static int
str_is(const char *s, uint32_t n, const char *lit)
{
    size_t m = strlen(lit);
    return n == m && memcmp(s, lit, m) == 0;
}

enum {
    K_TYPE = 1 << 0, K_HASHES = 1 << 1, K_PARENT = 1 << 2, K_TOKENS = 1 << 3, K_BS = 1 << 4, K_LORA_ID = 1 << 5,
    K_MEDIUM = 1 << 6, K_LORA_NAME = 1 << 7, K_EXTRA = 1 << 8, K_GROUP = 1 << 9, K_KIND = 1 << 10,
    K_SWA = 1 << 11, K_LOCALITY = 1 << 12, K_OWNERSHIP = 1 << 13, K_SESSION = 1 << 14, K_LOOKAHEAD = 1 << 15,
};

/* One BlockStored map of the plain GPU shape (see scan_gpu_batch) as a tuple, NULL
 * with no error set when it is of any other shape, NULL with an error set on a real
 * error (memory). */
static PyObject *
scan_store(Rd *r, const unsigned char *base)
{
    const unsigned char *start = r->p;
    uint32_t nk;
    if (!rd_len(r, 0x80, 0x8f, 0xde, 0xdf, &nk))
        return NULL;
    unsigned seen = 0;
    PyObject *hashes = NULL, *tokens = NULL, *parent = NULL, *group = NULL, *kind = NULL;
    uint64_t nblocks = 0, ntok = 0, bs = 0;
    for (uint32_t f = 0; f < nk; f++) {
        const char *k;
        uint32_t kl;
        if (!rd_str(r, &k, &kl))
            goto other;
        unsigned bitv;
        if (str_is(k, kl, "type"))
            bitv = K_TYPE;
        else if (str_is(k, kl, "block_hashes"))
            bitv = K_HASHES;
        else if (str_is(k, kl, "parent_block_hash"))
            bitv = K_PARENT;
        else if (str_is(k, kl, "token_ids"))
            bitv = K_TOKENS;
        else if (str_is(k, kl, "block_size"))
            bitv = K_BS;
        else if (str_is(k, kl, "lora_id"))
            bitv = K_LORA_ID;
        else if (str_is(k, kl, "medium"))
            bitv = K_MEDIUM;
        else if (str_is(k, kl, "lora_name"))
            bitv = K_LORA_NAME;
        else if (str_is(k, kl, "extra_keys"))
            bitv = K_EXTRA;
        else if (str_is(k, kl, "group_idx"))
            bitv = K_GROUP;
        else if (str_is(k, kl, "kv_cache_spec_kind"))
            bitv = K_KIND;
        else if (str_is(k, kl, "kv_cache_spec_sliding_window"))
            bitv = K_SWA;
        else if (str_is(k, kl, "locality"))
            bitv = K_LOCALITY;
        else if (str_is(k, kl, "ownership"))
            bitv = K_OWNERSHIP;
        else if (str_is(k, kl, "session_id"))
            bitv = K_SESSION;
        else if (str_is(k, kl, "lookahead_token_ids"))
            bitv = K_LOOKAHEAD;
        else
            goto other; /* a field we do not know: the decoder counts it */
        if (seen & bitv)
            goto other;
        seen |= bitv;
        const char *sv;
        uint32_t sl;
        uint64_t v;
        int neg;
        switch (bitv) {
        case K_TYPE:
            if (!rd_str(r, &sv, &sl) || !str_is(sv, sl, "BlockStored"))
                goto other;
            break;
        case K_HASHES: {
            uint32_t n;
            if (!rd_len(r, 0x90, 0x9f, 0xdc, 0xdd, &n) || n == 0 || n > (uint64_t)(r->end - r->p))
                goto other;
            hashes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 8);
            if (hashes == NULL)
                goto other;
            unsigned char *o = (unsigned char *)PyBytes_AS_STRING(hashes);
            for (uint32_t i = 0; i < n; i++) {
                if (!rd_int(r, &v, &neg) || neg)
                    goto other; /* bytes digests, negative ints: the decoder's path */
                put_le64(o + (size_t)i * 8, v);
            }
            nblocks = n;
            break;
        }
        case K_PARENT:
            if (rd_nil(r))
                break;
            if (!rd_int(r, &v, &neg) || neg)
                goto other;
            parent = PyLong_FromUnsignedLongLong(v);
            if (parent == NULL)
                goto other;
            break;
        case K_TOKENS: {
            uint32_t n;
            if (rd_tokens(r, &tokens, &n) <= 0)
                goto other; /* another shape, or out of memory (error set) */
            ntok = n;
            break;
        }
        case K_BS:
            if (!rd_int(r, &v, &neg) || neg || v == 0 || v > 0x7fffffff)
                goto other; /* 0 (a placeholder) or a bad size: the general path */
            bs = v;
            break;
        case K_LORA_ID: /* not part of a key (lora_name is) */
        case K_SWA:
            if (!rd_nil(r) && !rd_int(r, &v, &neg))
                goto other;
            break;
        case K_MEDIUM:
            if (rd_nil(r))
                break;
            if (!rd_str(r, &sv, &sl) || !str_is(sv, sl, "GPU"))
                goto other;
            break;
        case K_LORA_NAME:
        case K_EXTRA:
        case K_LOCALITY:
        case K_OWNERSHIP:
        case K_LOOKAHEAD:
            if (!rd_nil(r))
                goto other;
            break;
        case K_GROUP:
            if (rd_nil(r))
                break;
            if (!rd_int(r, &v, &neg))
                goto other;
            group = int_obj(v, neg);
            if (group == NULL)
                goto other;
            break;
        case K_KIND:
            if (rd_nil(r))
                break;
            if (!rd_str(r, &sv, &sl))
                goto other;
            kind = PyUnicode_DecodeUTF8(sv, sl, NULL);
            if (kind == NULL) {
                PyErr_Clear(); /* not UTF-8: the decoder says so */
                goto other;
            }
            break;
        case K_SESSION:
            if (!rd_nil(r) && !rd_str(r, &sv, &sl))
                goto other;
            break;
        }
    }
    if (!(seen & K_TYPE) || !(seen & K_HASHES) || !(seen & K_TOKENS) || !(seen & K_BS) || ntok != nblocks * bs)
        goto other;
    PyObject *out = Py_BuildValue("(NNNKNNnn)", hashes, parent ? parent : (Py_INCREF(Py_None), Py_None), tokens,
                                  (unsigned long long)bs, group ? group : (Py_INCREF(Py_None), Py_None),
                                  kind ? kind : (Py_INCREF(Py_None), Py_None), (Py_ssize_t)(start - base),
                                  (Py_ssize_t)(r->p - base));
    return out;
other: /* another shape (no error set) or out of memory (error set): the caller tells */
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(parent);
    Py_XDECREF(group);
    Py_XDECREF(kind);
    return NULL;
}

PyDoc_STRVAR(scan_gpu_batch_doc,
"scan_gpu_batch(payload) -> (ts, dp_rank, stores) or None\n\n"
"A vLLM map-layout batch whose every event is a plain GPU BlockStored, read in one\n"
"pass with no Python object per block or token: each store as (hashes: little-endian\n"
"uint64 bytes, parent hash or None, token ids: little-endian uint32 bytes, block_size,\n"
"group_idx or None, kv_cache_spec_kind or None, start, end), start:end its bytes in\n"
"the payload. Plain: int hashes, block_size > 0 and token ids for every block, medium\n"
"GPU or absent, no LoRA, extra keys, locality, ownership or lookahead tokens, and no\n"
"field the decoder does not know. None for anything else (wire.decode_batch decides).");

static PyObject *
scan_gpu_batch(PyObject *Py_UNUSED(mod), PyObject *payload)
{
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *base = view.buf;
    Rd r = {base, base + view.len};
    PyObject *stores = NULL, *dp = NULL, *res = NULL;
    uint32_t nb, ne;
    double ts;
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &nb) || (nb != 2 && nb != 3) || r.p >= r.end)
        goto none;
    unsigned char c = *r.p;
    if (c == 0xcb && r.end - r.p >= 9) {
        uint64_t u = be(r.p + 1, 8);
        memcpy(&ts, &u, 8);
        r.p += 9;
    }
    else if (c == 0xca && r.end - r.p >= 5) {
        uint32_t u = (uint32_t)be(r.p + 1, 4);
        float fl;
        memcpy(&fl, &u, 4);
        ts = fl;
        r.p += 5;
    }
    else {
        uint64_t v;
        int neg;
        if (!rd_int(&r, &v, &neg))
            goto none;
        ts = neg ? (double)(int64_t)v : (double)v;
    }
    if (!(ts - ts == 0.0)) /* NaN or infinite: decode_batch refuses the batch */
        goto none;
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &ne) || ne > (uint64_t)(r.end - r.p))
        goto none;
    stores = PyList_New(ne);
    if (stores == NULL)
        goto done;
    for (uint32_t i = 0; i < ne; i++) {
        PyObject *st = scan_store(&r, base);
        if (st == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto none;
        }
        PyList_SET_ITEM(stores, i, st);
    }
    if (nb == 3 && !rd_nil(&r)) {
        uint64_t v;
        int neg;
        if (!rd_int(&r, &v, &neg))
            goto none;
        dp = int_obj(v, neg);
        if (dp == NULL)
            goto done;
    }
    if (r.p != r.end)
        goto none; /* trailing bytes: the decoder refuses them */
    res = Py_BuildValue("(dNN)", ts, dp ? dp : (Py_INCREF(Py_None), Py_None), stores);
    dp = stores = NULL;
    goto done;
none:
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(dp);
    Py_XDECREF(stores);
    PyBuffer_Release(&view);
    return res;
}

static inline int
json_ws(unsigned char c)
{
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

/* The JSON array [first, last] (*first == '[', *last == ']') of integers in
 * [0, 2**32) into `o` as little-endian uint32 (room for (last - first) / 2 + 1
 * tokens); returns how many, or -1 for anything else (signs, fractions,
 * exponents, leading zeros, other values). The closing ']' is neither a digit, a
 * blank nor a comma: it stops every scan, so the loops need no bounds checks. */
static Py_ssize_t
parse_u32_array(const unsigned char *p, const unsigned char *last, unsigned char *o)
{
    Py_ssize_t n = 0;
    p++;
    while (json_ws(*p))
        p++;
    if (p == last)
        return 0;
    for (;;) {
        unsigned d = (unsigned)*p - '0';
        if (d > 9)
            return -1;
        uint64_t v = d;
        p++;
        if (v == 0 && (unsigned)*p - '0' <= 9)
            return -1; /* a leading zero is not JSON */
        while ((d = (unsigned)*p - '0') <= 9) {
            v = v * 10 + d;
            if (v > 0xffffffffULL)
                return -1;
            p++;
        }
        put_le32(o + n * 4, (uint32_t)v);
        n++;
        while (json_ws(*p))
            p++;
        if (*p == ',') {
            p++;
            while (json_ws(*p))
                p++;
            continue;
        }
        return p == last ? n : -1;
    }
}

/* Past the JSON string at p (*p == '"'), or NULL. */
static const unsigned char *
skip_string(const unsigned char *p, const unsigned char *end)
{
    for (p++; p < end; p++) {
        if (*p == '"')
            return p + 1;
        if (*p == '\\')
            p++;
    }
    return NULL;
}

/* Past the JSON value at p, or NULL. Only finds where it ends (strings, nesting);
 * its content is copied verbatim and validated by the decoder that reads it. */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end)
{
    if (*p == '"')
        return skip_string(p, end);
    if (*p != '[' && *p != '{') { /* a number or a literal */
        const unsigned char *q = p;
        while (q < end && *q != ',' && *q != '}' && *q != ']' && !json_ws(*q))
            q++;
        return q > p ? q : NULL;
    }
    int depth = 0;
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') {
            if ((p = skip_string(p, end)) == NULL)
                return NULL;
            continue;
        }
        if (c == '[' || c == '{')
            depth++;
        else if ((c == ']' || c == '}') && --depth == 0)
            return p + 1;
        p++;
    }
    return NULL;
}

PyDoc_STRVAR(split_tokens_json_doc,
"split_tokens_json(body) -> (rest, tokens) | None\n\n"
"A request body, a JSON object with a \"token_ids\" array of integers in\n"
"[0, 2**32), split in one pass into the object's other members (verbatim, as a\n"
"JSON object, for a typed decoder to read and validate) and the tokens as\n"
"little-endian uint32 bytes, with no Python int per token. None for anything\n"
"else (no such array, an empty one, a value it does not take, escaped keys,\n"
"malformed JSON): the caller's typed decoder then reads the body and says what\n"
"is wrong.");

static PyObject *
split_tokens_json(PyObject *Py_UNUSED(mod), PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf, *end = p + view.len;
    PyObject *rest = NULL, *toks = NULL, *out = NULL;
    Py_ssize_t rn = 0, nt = -1;
    rest = PyBytes_FromStringAndSize(NULL, view.len + 2);
    if (rest == NULL)
        goto done;
    unsigned char *r = (unsigned char *)PyBytes_AS_STRING(rest);
    r[rn++] = '{';
    while (p < end && json_ws(*p))
        p++;
    if (p >= end || *p != '{')
        goto none;
    p++;
    for (;;) {
        while (p < end && json_ws(*p))
            p++;
        if (p >= end || *p != '"')
            goto none;
        const unsigned char *key = p, *kend = skip_string(p, end);
        if (kend == NULL || memchr(key, '\\', (size_t)(kend - key)) != NULL)
            goto none;
        p = kend;
        while (p < end && json_ws(*p))
            p++;
        if (p >= end || *p != ':')
            goto none;
        p++;
        while (p < end && json_ws(*p))
            p++;
        if (p >= end)
            goto none;
        if (kend - key == 11 && memcmp(key, "\"token_ids\"", 11) == 0) {
            if (toks != NULL || *p != '[')
                goto none;
            const unsigned char *close = memchr(p, ']', (size_t)(end - p));
            if (close == NULL)
                goto none;
            toks = PyBytes_FromStringAndSize(NULL, ((close - p) / 2 + 1) * 4);
            if (toks == NULL)
                goto done;
            nt = parse_u32_array(p, close, (unsigned char *)PyBytes_AS_STRING(toks));
            if (nt <= 0)
                goto none;
            p = close + 1;
        }
        else {
            const unsigned char *vend = skip_value(p, end);
            if (vend == NULL)
                goto none;
            if (rn > 1)
                r[rn++] = ',';
            memcpy(r + rn, key, (size_t)(kend - key));
            rn += kend - key;
            r[rn++] = ':';
            memcpy(r + rn, p, (size_t)(vend - p));
            rn += vend - p;
            p = vend;
        }
        while (p < end && json_ws(*p))
            p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') {
            p++;
            break;
        }
        goto none;
    }
    while (p < end && json_ws(*p))
        p++;
    if (p != end || toks == NULL)
        goto none;
    r[rn++] = '}';
    /* On failure _PyBytes_Resize frees the object and sets the pointer to NULL. */
    if (_PyBytes_Resize(&rest, rn) < 0 || _PyBytes_Resize(&toks, nt * 4) < 0)
        goto done;
    out = PyTuple_Pack(2, rest, toks);
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(rest);
    Py_XDECREF(toks);
    PyBuffer_Release(&view);
    return out;
}


/* Does the worker (bit) hold `n` in a tier other than GPU? (tiers: {tid: mask},
 * chunk-end masks under -tid) */
static int
holds_other(Node *n, PyObject *bit)
{
    PyObject *t = node_tiers(n), *k, *v;
    Py_ssize_t pos = 0;
    if (t == Py_None)
        return 0;
    if (!PyDict_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "Node.tiers must be None or a dict");
        return -1;
    }
    while (PyDict_Next(t, &pos, &k, &v)) {
        long tid = PyLong_AsLong(k);
        if (tid == -1 && PyErr_Occurred())
            return -1;
        if (tid <= 0)
            continue;
        PyObject *x = PyNumber_And(v, bit);
        if (x == NULL)
            return -1;
        int r = PyObject_IsTrue(x);
        Py_DECREF(x);
        if (r != 0)
            return r;
    }
    return 0;
}

/* Tree.free_up for an uncapped tree: free `n` and then its ancestors while they
 * are leaves nobody holds (R-APP-9). Returns the nodes freed, -1 on error. */
static Py_ssize_t
free_up(Node *n, PyObject *root)
{
    Py_ssize_t freed = 0;
    Py_INCREF(n);
    while ((PyObject *)n != root && n->kids == Py_None && node_tiers(n) == Py_None) {
        int held = PyObject_IsTrue(node_gpu(n));
        if (held != 0) {
            if (held < 0)
                goto fail;
            break;
        }
        PyObject *p = n->parent;
        if (p == DEAD || !IS_NODE(p))
            break;
        Node *parent = (Node *)p;
        Py_INCREF(parent);
        PyObject *kids = parent->kids;
        if (kids == (PyObject *)n) {
            NODE_SET(parent->kids, Py_None);
        }
        else if (IS_MAP(kids)) {
            U64Map *km = (U64Map *)kids;
            Py_ssize_t i = map_find(km, n->key);
            if (i >= 0)
                Py_DECREF(map_take(km, (size_t)i));
            if (km->used == 1 && km->other == NULL) {
                for (Py_ssize_t j = 0; j < km->cap; j++) {
                    if (km->slots[j].val != NULL) {
                        PyObject *only = km->slots[j].val;
                        Py_INCREF(only);
                        NODE_SET(parent->kids, only); /* releases the map */
                        Py_DECREF(only);
                        break;
                    }
                }
            }
        }
        NODE_SET(n->parent, DEAD);
        node_set_dup(n, Py_None); /* frees the Side (tiers is None): cannot fail */
        freed++;
        Py_DECREF(n);
        n = parent;
    }
    Py_DECREF(n);
    return freed;
fail:
    Py_DECREF(n);
    return -1;
}

PyDoc_STRVAR(remove_gpu_doc,
"remove_gpu(wmap, root, hashes, bit, dupkey) -> (cleared, unknown, freed)\n\n"
"One BlockRemoved of GPU blocks for one worker in an uncapped tree: each hash\n"
"the worker holds loses one announcement (R-APP-4: a count above one just goes\n"
"down); a block the worker no longer holds in any tier leaves `wmap`, and nodes\n"
"nobody holds are freed up the chain (R-APP-9). Changes the tree, `wmap` and the\n"
"nodes. Returns the residencies cleared (announcements counted down do not\n"
"count), the hashes not held, the nodes freed.\n"
"Same steps as PrefixIndex._remove_one with Tree.free_up.");

static PyObject *
remove_gpu(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "remove_gpu(U64Map, Node, list, int, int)");
        return NULL;
    }
    U64Map *wmap = (U64Map *)args[0];
    PyObject *root = args[1], *hashes = args[2], *bit = args[3], *dupkey = args[4];
    Py_ssize_t cleared = 0, unknown = 0, freed = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        int err;
        Node *n = mapped_node(wmap, h, &err);
        if (err)
            return NULL;
        if (n == NULL) {
            unknown++;
            continue;
        }
        Py_INCREF(n);
        if (n->parent == DEAD) { /* freed by the node cap: forget the mapping */
            PyObject *old = map_pop(wmap, h);
            Py_XDECREF(old);
            Py_DECREF(n);
            if (old == NULL)
                return NULL;
            unknown++;
            continue;
        }
        PyObject *x = PyNumber_And(node_gpu(n), bit);
        int held = x == NULL ? -1 : PyObject_IsTrue(x);
        Py_XDECREF(x);
        if (held <= 0) {
            Py_DECREF(n);
            if (held < 0)
                return NULL;
            unknown++;
            continue;
        }
        PyObject *dup = node_dup(n);
        if (dup != Py_None && PyDict_Check(dup)) {
            Py_INCREF(dup); /* setting node.dup to None below would free it */
            PyObject *c = PyDict_GetItemWithError(dup, dupkey);
            long v = c == NULL ? 0 : PyLong_AsLong(c);
            if (v > 0) { /* one of several announcements: the count goes down */
                int r;
                if (v == 1) {
                    r = PyDict_DelItem(dup, dupkey);
                    if (r == 0 && PyDict_GET_SIZE(dup) == 0)
                        r = node_set_dup(n, Py_None);
                }
                else {
                    PyObject *nv = PyLong_FromLong(v - 1);
                    r = nv == NULL ? -1 : PyDict_SetItem(dup, dupkey, nv);
                    Py_XDECREF(nv);
                }
                Py_DECREF(dup);
                Py_DECREF(n);
                if (r < 0)
                    return NULL;
                continue;
            }
            Py_DECREF(dup);
            if (PyErr_Occurred()) { /* the lookup, or a count that is not an int */
                Py_DECREF(n);
                return NULL;
            }
        }
        PyObject *nm = PyNumber_Xor(node_gpu(n), bit);
        if (nm == NULL) {
            Py_DECREF(n);
            return NULL;
        }
        node_set_gpu(n, nm);
        Py_DECREF(nm);
        cleared++;
        int other = holds_other(n, bit);
        if (other == 0) {
            PyObject *old = map_pop(wmap, h);
            Py_ssize_t f = old == NULL ? -1 : free_up(n, root);
            Py_XDECREF(old);
            if (f < 0) {
                Py_DECREF(n);
                return NULL;
            }
            freed += f;
        }
        Py_DECREF(n);
        if (other < 0)
            return NULL;
    }
    return Py_BuildValue("(nnn)", cleared, unknown, freed);
}


/* ------------------------------------------------------ snapshot columns */

/* snapshot.py's four hot loops. A tree is dumped as little-endian columns in
 * preorder (node 0 the root): parent index (uint32), key (uint64), GPU-mask id
 * (uint32); a worker's map as (uint64 hash, uint32 node index) columns. The
 * pure twins, snapshot._py_dump_tree and friends, are the reference: same
 * visiting order, so the same bytes. */


/* NodeIndex: a node's address -> its uint32 index in a dumped tree (node_index).
 * The addresses are what dump_tree and dump_map read under the index lock; the
 * table is built and asked after it, so it holds no node and reads none: only
 * integers. Open addressing, 16-byte slots, load at most 3/4: at 10^7 nodes a
 * few hundred MB less than a dict of int objects. */

typedef struct {
    uint64_t addr; /* 0: empty slot (no object lives at address 0) */
    uint32_t idx;
} IdxSlot;

typedef struct {
    PyObject_HEAD
    IdxSlot *slots;  /* NULL while cap == 0 */
    Py_ssize_t cap;  /* a power of two, or 0 */
    Py_ssize_t used;
} NodeIndex;

static PyTypeObject NodeIndexType;

/* Nodes are 48-byte objects and a tree's chains are mostly allocated in a row:
 * a / 48 numbers the nodes of one allocator pool consecutively (they sit at
 * pool start + 48 * i), so four neighbours in memory hash to one 64-byte line of
 * four slots and a preorder fill misses the cache about once per line, not per
 * node. The lines themselves are spread by mix64. (a >> 6 alone, right for the
 * old 64-byte nodes, gives two of every five 48-byte neighbours the same slot.) */
static inline size_t
ptr_slot(uint64_t a, size_t mask)
{
    uint64_t q = a / sizeof(Node);
    return (size_t)((mix64(q >> 2) << 2) | (q & 3)) & mask;
}

/* The slot of `addr`, or -1. */
static inline Py_ssize_t
nidx_find(NodeIndex *w, uint64_t addr)
{
    if (w->cap == 0 || addr == 0)
        return -1;
    size_t mask = (size_t)w->cap - 1;
    size_t i = ptr_slot(addr, mask);
    for (;;) {
        IdxSlot *s = &w->slots[i];
        if (s->addr == 0)
            return -1;
        if (s->addr == addr)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

static NodeIndex *
nidx_new(Py_ssize_t n)
{
    Py_ssize_t cap = 64;
    while (n * 4 > cap * 3)
        cap *= 2;
    NodeIndex *w = PyObject_New(NodeIndex, &NodeIndexType);
    if (w == NULL)
        return NULL;
    w->slots = PyMem_Calloc((size_t)cap, sizeof(IdxSlot));
    w->cap = cap;
    w->used = 0;
    if (w->slots == NULL) {
        w->cap = 0;
        Py_DECREF(w);
        PyErr_NoMemory();
        return NULL;
    }
    return w;
}

/* Add addr -> idx (the table is sized for every address already). 1: added; 0: the
 * address is there already. */
static int
nidx_add(NodeIndex *w, uint64_t addr, uint32_t idx)
{
    size_t mask = (size_t)w->cap - 1;
    size_t i = ptr_slot(addr, mask);
    while (w->slots[i].addr != 0) {
        if (w->slots[i].addr == addr)
            return 0;
        i = (i + 1) & mask;
    }
    w->slots[i].addr = addr;
    w->slots[i].idx = idx;
    w->used++;
    return 1;
}

static void
NodeIndex_dealloc(NodeIndex *w)
{
    PyMem_Free(w->slots);
    PyObject_Free(w);
}

static Py_ssize_t
NodeIndex_length(NodeIndex *w)
{
    return w->used;
}

/* An address from Python: an int in [0, 2**64); -1 with an error otherwise. */
static int
addr_of(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a node's address is an int");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        *out = 0; /* negative or too large: no node lives there */
        return 0;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
NodeIndex_get(NodeIndex *w, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get() takes 1 or 2 arguments");
        return NULL;
    }
    uint64_t a;
    if (addr_of(args[0], &a) < 0)
        return NULL;
    Py_ssize_t i = nidx_find(w, a);
    if (i < 0) {
        PyObject *d = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(d);
        return d;
    }
    return PyLong_FromUnsignedLong(w->slots[i].idx);
}

static int
NodeIndex_contains(NodeIndex *w, PyObject *o)
{
    uint64_t a;
    if (addr_of(o, &a) < 0)
        return -1;
    return nidx_find(w, a) >= 0;
}

static PyObject *
NodeIndex_sizeof(NodeIndex *w, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(NodeIndex) + w->cap * (Py_ssize_t)sizeof(IdxSlot));
}

static PyMethodDef NodeIndex_methods[] = {
    {"get", (PyCFunction)(void (*)(void))NodeIndex_get, METH_FASTCALL,
     "get(address, default=None): the index of the node at that address"},
    {"__sizeof__", (PyCFunction)NodeIndex_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods NodeIndex_as_mapping = {
    .mp_length = (lenfunc)NodeIndex_length,
};

static PySequenceMethods NodeIndex_as_sequence = {
    .sq_contains = (objobjproc)NodeIndex_contains,
};

static PyTypeObject NodeIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.NodeIndex",
    .tp_doc = "Node (by identity) -> its index in a dump_tree walk; made by dump_tree only.",
    .tp_basicsize = sizeof(NodeIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)NodeIndex_dealloc,
    .tp_as_mapping = &NodeIndex_as_mapping,
    .tp_as_sequence = &NodeIndex_as_sequence,
    .tp_methods = NodeIndex_methods,
};

typedef struct {
    PyObject *node; /* a strong reference */
    uint32_t parent;
} Frame;

typedef struct {
    Frame *items;
    size_t n, cap;
} Stack;

/* Push `child` (a new reference is taken) with its parent's index. */
static int
stack_push(Stack *s, PyObject *child, uint32_t parent)
{
    if (!IS_NODE(child)) {
        PyErr_SetString(PyExc_TypeError, "a node's children are nodes");
        return -1;
    }
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 256;
        Frame *ni = PyMem_Realloc(s->items, nc * sizeof(Frame));
        if (ni == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = ni;
        s->cap = nc;
    }
    Py_INCREF(child);
    s->items[s->n].node = child;
    s->items[s->n].parent = parent;
    s->n++;
    return 0;
}

/* Push the children of `n` in the order U64Map.values() lists them (the table's
 * slots, then the side dict's values), so they pop LIFO as in the pure twin. */
static int
push_kids(Stack *s, Node *n, uint32_t idx)
{
    PyObject *kids = n->kids;
    if (kids == Py_None)
        return 0;
    if (IS_NODE(kids))
        return stack_push(s, kids, idx);
    if (!IS_MAP(kids)) {
        PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
        return -1;
    }
    U64Map *km = (U64Map *)kids;
    for (Py_ssize_t j = 0; j < km->cap; j++) {
        PyObject *v = km->slots[j].val;
        if (v != NULL && stack_push(s, v, idx) < 0)
            return -1;
    }
    if (km->other != NULL) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(km->other, &pos, &k, &v)) { /* nothing in the loop runs Python code */
            if (stack_push(s, v, idx) < 0)
                return -1;
        }
    }
    return 0;
}

/* A growable byte column. */
typedef struct {
    unsigned char *buf;
    size_t len, cap;
} Col;

static inline int
col_room(Col *c, size_t more)
{
    if (c->len + more <= c->cap)
        return 0;
    size_t nc = c->cap ? c->cap : 4096;
    while (nc < c->len + more)
        nc *= 2;
    unsigned char *nb = PyMem_Realloc(c->buf, nc);
    if (nb == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->buf = nb;
    c->cap = nc;
    return 0;
}

PyDoc_STRVAR(dump_tree_doc,
"dump_tree(root) -> (parents, keys, mask_ids, masks, extra, addrs)\n\n"
"Walk one tree in preorder (iterative; node 0 is the root): the little-endian\n"
"uint32 parent indices, uint64 keys and uint32 GPU-mask ids of every node but the\n"
"root, the distinct GPU masks in order of first use, (index, node) of the nodes\n"
"with tiers or dups, and `addrs`: the uint64 address of every node, the root\n"
"first (node_index turns them into an address -> index table, after the lock).\n"
"Read-only. Same bytes as snapshot._py_dump_tree (which uses id()).");

static PyObject *
dump_tree(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dump_tree(Node)");
        return NULL;
    }
    Node *root = (Node *)args[0];
    Stack stack = {NULL, 0, 0};
    Col par = {NULL, 0, 0}, keys = {NULL, 0, 0}, mids = {NULL, 0, 0}, addrs = {NULL, 0, 0};
    PyObject *mask_ids = PyDict_New(), *masks = PyList_New(0), *extra = PyList_New(0);
    PyObject *last_mask = NULL; /* a strong reference: the mask whose id is last_mid */
    uint32_t last_mid = 0;
    PyObject *cols[4] = {NULL, NULL, NULL, NULL};
    if (mask_ids == NULL || masks == NULL || extra == NULL)
        goto fail;
    if (col_room(&addrs, 8) < 0 || push_kids(&stack, root, 0) < 0)
        goto fail;
    put_le64(addrs.buf, (uint64_t)(uintptr_t)root);
    addrs.len = 8;
    uint32_t i = 0;
    while (stack.n) {
        Frame f = stack.items[--stack.n];
        Node *node = (Node *)f.node; /* the stack's reference, released below */
        if (i == UINT32_MAX) {
            Py_DECREF(node);
            PyErr_SetString(PyExc_OverflowError, "more than 2**32 - 1 nodes in one tree");
            goto fail;
        }
        i++;
        if (col_room(&par, 4) < 0 || col_room(&keys, 8) < 0 || col_room(&mids, 4) < 0 || col_room(&addrs, 8) < 0) {
            Py_DECREF(node);
            goto fail;
        }
        put_le32(par.buf + par.len, f.parent);
        par.len += 4;
        put_le64(keys.buf + keys.len, node->key);
        keys.len += 8;
        put_le64(addrs.buf + addrs.len, (uint64_t)(uintptr_t)node);
        addrs.len += 8;
        PyObject *m = node_gpu(node);
        if (m != last_mask) {
            PyObject *v = PyDict_GetItemWithError(mask_ids, m);
            if (v != NULL)
                last_mid = (uint32_t)PyLong_AsUnsignedLong(v); /* an id this loop made */
            else {
                if (PyErr_Occurred()) {
                    Py_DECREF(node);
                    goto fail;
                }
                Py_ssize_t nm = PyList_GET_SIZE(masks);
                PyObject *id = PyLong_FromSsize_t(nm);
                if (id == NULL) {
                    Py_DECREF(node);
                    goto fail;
                }
                int e = PyDict_SetItem(mask_ids, m, id);
                Py_DECREF(id);
                if (e < 0 || PyList_Append(masks, m) < 0) {
                    Py_DECREF(node);
                    goto fail;
                }
                last_mid = (uint32_t)nm;
            }
            Py_INCREF(m);
            Py_XSETREF(last_mask, m);
        }
        put_le32(mids.buf + mids.len, last_mid);
        mids.len += 4;
        if (HAS_SIDE(node)) { /* tiers or dup is set */
            PyObject *t = Py_BuildValue("(kO)", (unsigned long)i, (PyObject *)node);
            if (t == NULL || PyList_Append(extra, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(node);
                goto fail;
            }
            Py_DECREF(t);
        }
        int r = push_kids(&stack, node, i);
        Py_DECREF(node);
        if (r < 0)
            goto fail;
        if (stack.n)
            __builtin_prefetch(stack.items[stack.n - 1].node); /* the walk's cache miss: start it now */
    }
    cols[0] = PyBytes_FromStringAndSize((const char *)par.buf, (Py_ssize_t)par.len);
    cols[1] = PyBytes_FromStringAndSize((const char *)keys.buf, (Py_ssize_t)keys.len);
    cols[2] = PyBytes_FromStringAndSize((const char *)mids.buf, (Py_ssize_t)mids.len);
    cols[3] = PyBytes_FromStringAndSize((const char *)addrs.buf, (Py_ssize_t)addrs.len);
    if (cols[0] == NULL || cols[1] == NULL || cols[2] == NULL || cols[3] == NULL)
        goto fail;
    PyObject *out = PyTuple_Pack(6, cols[0], cols[1], cols[2], masks, extra, cols[3]);
    if (out == NULL)
        goto fail;
    for (int j = 0; j < 4; j++)
        Py_DECREF(cols[j]);
    Py_DECREF(masks);
    Py_DECREF(extra);
    Py_DECREF(mask_ids);
    Py_XDECREF(last_mask);
    PyMem_Free(par.buf);
    PyMem_Free(keys.buf);
    PyMem_Free(mids.buf);
    PyMem_Free(addrs.buf);
    PyMem_Free(stack.items);
    return out;
fail:
    for (size_t j = 0; j < stack.n; j++)
        Py_DECREF(stack.items[j].node);
    PyMem_Free(stack.items);
    PyMem_Free(par.buf);
    PyMem_Free(keys.buf);
    PyMem_Free(mids.buf);
    PyMem_Free(addrs.buf);
    for (int j = 0; j < 4; j++)
        Py_XDECREF(cols[j]);
    Py_XDECREF(last_mask);
    Py_XDECREF(mask_ids);
    Py_XDECREF(masks);
    Py_XDECREF(extra);
    return NULL;
}

/* Append (h, i) to `other`. */
static int
other_append(PyObject *other, PyObject *h, PyObject *i)
{
    PyObject *t = PyTuple_Pack(2, h, i);
    if (t == NULL)
        return -1;
    int r = PyList_Append(other, t);
    Py_DECREF(t);
    return r;
}

PyDoc_STRVAR(dump_map_doc,
"dump_map(wmap) -> (hashes, addrs, other)\n\n"
"A worker's engine-hash map (a U64Map) as little-endian uint64 hashes and the\n"
"uint64 addresses of their nodes, in the map's order; `other` gets (hash,\n"
"address) of the entries whose hash is not an int in [0, 2**64). Reads the map's\n"
"table only, never a node: the cheap half under the index lock (translate does\n"
"the rest after it). Same as snapshot._py_dump_map.");

static PyObject *
dump_map(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !IS_MAP(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dump_map(U64Map)");
        return NULL;
    }
    U64Map *m = (U64Map *)args[0];
    PyObject *items = NULL, *hb = NULL, *ab = NULL, *other = NULL;
    Py_ssize_t n = 0;
    if (m->other != NULL && (items = PyDict_Items(m->other)) == NULL)
        goto fail;
    hb = PyBytes_FromStringAndSize(NULL, m->used * 8);
    ab = PyBytes_FromStringAndSize(NULL, m->used * 8);
    other = PyList_New(0);
    if (hb == NULL || ab == NULL || other == NULL)
        goto fail;
    unsigned char *hp = (unsigned char *)PyBytes_AS_STRING(hb), *ap = (unsigned char *)PyBytes_AS_STRING(ab);
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        Slot *s = &m->slots[j];
        if (s->val == NULL)
            continue;
        put_le64(hp + n * 8, s->key);
        put_le64(ap + n * 8, (uint64_t)(uintptr_t)s->val);
        n++;
    }
    Py_ssize_t ni = items == NULL ? 0 : PyList_GET_SIZE(items);
    for (Py_ssize_t j = 0; j < ni; j++) {
        PyObject *pair = PyList_GET_ITEM(items, j);
        PyObject *iv = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)PyTuple_GET_ITEM(pair, 1));
        if (iv == NULL || other_append(other, PyTuple_GET_ITEM(pair, 0), iv) < 0) {
            Py_XDECREF(iv);
            goto fail;
        }
        Py_DECREF(iv);
    }
    /* On failure _PyBytes_Resize frees the object and sets the pointer to NULL. */
    if (_PyBytes_Resize(&hb, n * 8) < 0 || _PyBytes_Resize(&ab, n * 8) < 0)
        goto fail;
    Py_XDECREF(items);
    return Py_BuildValue("(NNN)", hb, ab, other);
fail:
    Py_XDECREF(items);
    Py_XDECREF(hb);
    Py_XDECREF(ab);
    Py_XDECREF(other);
    return NULL;
}

static int column(PyObject *obj, Py_buffer *view, int width, const char *what);

PyDoc_STRVAR(node_index_doc,
"node_index(addrs) -> NodeIndex\n\n"
"The table address -> index of the uint64 little-endian addresses dump_tree\n"
"wrote (index = position). An address twice (not a tree) is a ValueError. Reads\n"
"no node. Same as snapshot._py_node_index.");

static PyObject *
node_index(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "node_index(addrs)");
        return NULL;
    }
    Py_buffer av;
    if (column(args[0], &av, 8, "addrs") < 0)
        return NULL;
    Py_ssize_t n = av.len / 8;
    NodeIndex *w = NULL;
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more than 2**32 - 1 nodes in one tree");
        goto done;
    }
    if ((w = nidx_new(n)) == NULL)
        goto done;
    const unsigned char *ap = av.buf;
    Py_ssize_t bad = -1;
    /* Integers only (no Python object is touched): other threads, the queries among
     * them, run meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a = get_le64(ap + i * 8);
        if (a == 0 || nidx_add(w, a, (uint32_t)i) == 0) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_SetString(PyExc_ValueError, "node_index: an address twice, or 0 (not a tree)");
        Py_CLEAR(w);
    }
done:
    PyBuffer_Release(&av);
    return (PyObject *)w;
}

PyDoc_STRVAR(translate_doc,
"translate(where, hashes, addrs) -> (hashes, idx)\n\n"
"dump_map's columns with each address replaced by its node's uint32 index in\n"
"`where` (a NodeIndex); entries whose address `where` does not know (a node the\n"
"cap freed) are left out. Same as snapshot._py_translate.");

static PyObject *
translate(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || Py_TYPE(args[0]) != &NodeIndexType) {
        PyErr_SetString(PyExc_TypeError, "translate(NodeIndex, hashes, addrs)");
        return NULL;
    }
    NodeIndex *w = (NodeIndex *)args[0];
    Py_buffer hv, av;
    if (column(args[1], &hv, 8, "hashes") < 0)
        return NULL;
    if (column(args[2], &av, 8, "addrs") < 0) {
        PyBuffer_Release(&hv);
        return NULL;
    }
    PyObject *hb = NULL, *ib = NULL, *res = NULL;
    Py_ssize_t n = hv.len / 8, k = 0;
    if (av.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd hashes, %zd addresses", n, av.len / 8);
        goto done;
    }
    hb = PyBytes_FromStringAndSize(NULL, n * 8);
    ib = PyBytes_FromStringAndSize(NULL, n * 4);
    if (hb == NULL || ib == NULL)
        goto done;
    unsigned char *ho = (unsigned char *)PyBytes_AS_STRING(hb), *io = (unsigned char *)PyBytes_AS_STRING(ib);
    const unsigned char *hp = hv.buf, *ap = av.buf;
    size_t wmask = w->cap ? (size_t)w->cap - 1 : 0;
    enum { PREFETCH = 16 };
    /* Integers only: other threads run meanwhile (`where` and the buffers are held
     * by this call's arguments and results). */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + PREFETCH < n && w->cap)
            __builtin_prefetch(&w->slots[ptr_slot(get_le64(ap + (j + PREFETCH) * 8), wmask)]);
        Py_ssize_t s = nidx_find(w, get_le64(ap + j * 8));
        if (s < 0)
            continue;
        memcpy(ho + k * 8, hp + j * 8, 8);
        put_le32(io + k * 4, w->slots[s].idx);
        k++;
    }
    Py_END_ALLOW_THREADS
    if (_PyBytes_Resize(&hb, k * 8) < 0 || _PyBytes_Resize(&ib, k * 4) < 0)
        goto done;
    res = Py_BuildValue("(OO)", hb, ib);
done:
    Py_XDECREF(hb);
    Py_XDECREF(ib);
    PyBuffer_Release(&hv);
    PyBuffer_Release(&av);
    return res;
}

/* A read-only view of a column of `width`-byte items; -1 with ValueError when its
 * length is not a multiple of the width. */
static int
column(PyObject *obj, Py_buffer *view, int width, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % width) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, not a whole number of %d-byte items", what, view->len,
                     width);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Link `node` under `parent` as the pure twin does: kids None -> the node, a Node
 * -> a U64Map of both (the old child first), a U64Map -> one more entry. */
static int
link_child(Node *parent, Node *node)
{
    PyObject *kids = parent->kids;
    if (kids == Py_None) {
        NODE_SET(parent->kids, (PyObject *)node);
        return 0;
    }
    if (IS_MAP(kids))
        return map_put((U64Map *)kids, node->key, (PyObject *)node);
    if (!IS_NODE(kids)) {
        PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
        return -1;
    }
    U64Map *km = map_new();
    if (km == NULL || map_put(km, ((Node *)kids)->key, kids) < 0 || map_put(km, node->key, (PyObject *)node) < 0) {
        Py_XDECREF(km);
        return -1;
    }
    NODE_SET(parent->kids, (PyObject *)km);
    Py_DECREF(km);
    return 0;
}

PyDoc_STRVAR(load_tree_doc,
"load_tree(root, parents, keys, mask_ids, masks) -> list[Node]\n\n"
"Create every node of a dumped tree under `root` (the columns dump_tree wrote;\n"
"preorder: each parent before its children): node i is Node(keys[i-1],\n"
"nodes[parents[i-1]], None, masks[mask_ids[i-1]]), linked under its parent.\n"
"Returns the nodes, the root first. Columns of different lengths, a parent not\n"
"created yet or a mask id out of range are a ValueError. Same as\n"
"snapshot._py_load_tree.");

static PyObject *
load_tree(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "load_tree(Node, parents, keys, mask_ids, masks)");
        return NULL;
    }
    Py_buffer pv, kv, mv;
    if (column(args[1], &pv, 4, "parents") < 0)
        return NULL;
    if (column(args[2], &kv, 8, "keys") < 0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    if (column(args[3], &mv, 4, "mask_ids") < 0) {
        PyBuffer_Release(&pv);
        PyBuffer_Release(&kv);
        return NULL;
    }
    PyObject *masks = NULL, *nodes = NULL;
    Py_ssize_t n = pv.len / 4;
    if (kv.len / 8 != n || mv.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "tree columns of different lengths");
        goto fail;
    }
    masks = PySequence_Fast(args[4], "masks must be a sequence");
    if (masks == NULL || (nodes = PyList_New(n + 1)) == NULL)
        goto fail;
    /* Unset items are NULL, which list_dealloc skips: a failure part-way frees what was made. */
    Py_INCREF(args[0]);
    PyList_SET_ITEM(nodes, 0, args[0]);
    const unsigned char *pp = pv.buf, *kp = kv.buf, *mp = mv.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t p = get_le32(pp + i * 4), mi = get_le32(mp + i * 4);
        if ((Py_ssize_t)p > i) {
            PyErr_Format(PyExc_ValueError, "node %zd names parent %lu, not created before it", i + 1,
                         (unsigned long)p);
            goto fail;
        }
        if ((Py_ssize_t)mi >= PySequence_Fast_GET_SIZE(masks)) {
            PyErr_Format(PyExc_ValueError, "node %zd names mask %lu of %zd", i + 1, (unsigned long)mi,
                         PySequence_Fast_GET_SIZE(masks));
            goto fail;
        }
        Node *parent = (Node *)PyList_GET_ITEM(nodes, p);
        Node *node = node_make(get_le64(kp + i * 8), (PyObject *)parent, PySequence_Fast_GET_ITEM(masks, mi));
        if (node == NULL)
            goto fail;
        PyList_SET_ITEM(nodes, i + 1, (PyObject *)node);
        if (link_child(parent, node) < 0)
            goto fail;
    }
    Py_DECREF(masks);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&mv);
    return nodes;
fail:
    Py_XDECREF(nodes);
    Py_XDECREF(masks);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&mv);
    return NULL;
}

static Py_ssize_t
gcd_ssize(Py_ssize_t a, Py_ssize_t b)
{
    while (b) {
        Py_ssize_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The step of load_map's order over n entries: 0x9E3779B97F4A7C15 mod n, moved up
 * to the next value coprime with n (1 for n <= 2). Same as snapshot._load_stride. */
static Py_ssize_t
load_stride(Py_ssize_t n)
{
    if (n <= 2)
        return 1;
    Py_ssize_t s = (Py_ssize_t)(0x9E3779B97F4A7C15ULL % (unsigned long long)n);
    if (s == 0)
        s = 1;
    while (gcd_ssize(s, n) != 1)
        s++;
    return s;
}

PyDoc_STRVAR(load_map_doc,
"load_map(wmap, hashes, idx, nodes) -> None\n\n"
"Put hashes[i] -> nodes[idx[i]] into a worker's map (the little-endian uint64 and\n"
"uint32 columns dump_map wrote). Columns of different lengths are a ValueError,\n"
"an index past `nodes` an IndexError. Same as snapshot._py_load_map.");

static PyObject *
load_map(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !IS_MAP(args[0]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "load_map(U64Map, hashes, idx, list)");
        return NULL;
    }
    U64Map *m = (U64Map *)args[0];
    PyObject *nodes = args[3];
    Py_buffer hv, iv;
    if (column(args[1], &hv, 8, "hashes") < 0)
        return NULL;
    if (column(args[2], &iv, 4, "idx") < 0) {
        PyBuffer_Release(&hv);
        return NULL;
    }
    Py_ssize_t n = hv.len / 8;
    PyObject *res = NULL;
    if (iv.len / 4 != n) {
        PyErr_Format(PyExc_ValueError, "%zd hashes, %zd node indices", n, iv.len / 4);
        goto done;
    }
    const unsigned char *hp = hv.buf, *ip = iv.buf;
    /* The columns come in the source table's slot order, i.e. sorted by a hash's
     * home slot: inserted in that order into a table that grows as it fills, they
     * pile up in a few long probe runs (quadratic: minutes at 10^7 entries). So the
     * table is sized once for all of them, and they go in a scattered order (a
     * stride coprime with n, the same order as snapshot._py_load_map). */
    Py_ssize_t cap = m->cap ? m->cap : 4;
    while ((m->used + n) * 4 > cap * 3)
        cap *= 2;
    if (cap > m->cap && map_resize(m, cap) < 0)
        goto done;
    Py_ssize_t stride = load_stride(n), j = 0, ja = 0;
    enum { AHEAD = 8 };
    for (Py_ssize_t i = 0; i < AHEAD && i < n; i++)
        ja = ja + stride >= n ? ja + stride - n : ja + stride;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            /* The random reads (the map's slot, the node's refcount and the columns
             * themselves) start AHEAD entries early. */
            uint32_t ka = get_le32(ip + ja * 4);
            __builtin_prefetch(&m->slots[(size_t)mix64(get_le64(hp + ja * 8)) & ((size_t)m->cap - 1)], 1);
            if ((Py_ssize_t)ka < PyList_GET_SIZE(nodes))
                __builtin_prefetch(PyList_GET_ITEM(nodes, ka), 1);
            ja = ja + stride >= n ? ja + stride - n : ja + stride;
        }
        uint32_t k = get_le32(ip + j * 4);
        /* Read each time: releasing a replaced value may run code that changes the list. */
        if ((Py_ssize_t)k >= PyList_GET_SIZE(nodes)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        if (map_put(m, get_le64(hp + j * 8), PyList_GET_ITEM(nodes, k)) < 0)
            goto done;
        j = j + stride >= n ? j + stride - n : j + stride;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&hv);
    PyBuffer_Release(&iv);
    return res;
}


/* --------------------------------------------------------- query answers */

static PyObject *GPU_NAME; /* "GPU" */

/* Append (wid) for every set bit of mask to *wids (a C array grown as needed). */
static int
mask_bits(PyObject *mask, Py_ssize_t **wids, Py_ssize_t *n, Py_ssize_t *cap)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(mask);
    unsigned char *bytes = NULL;
    Py_ssize_t nbytes = 8;
    PyObject *b = NULL;
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear(); /* more than 64 workers: read the mask's bytes */
        PyObject *nb = PyObject_CallMethod(mask, "bit_length", NULL);
        if (nb == NULL)
            return -1;
        nbytes = (PyLong_AsSsize_t(nb) + 7) / 8;
        Py_DECREF(nb);
        if (nbytes < 0)
            return -1;
        b = PyObject_CallMethod(mask, "to_bytes", "ns", nbytes, "little");
        if (b == NULL)
            return -1; /* a negative mask: never made by the index */
        bytes = (unsigned char *)PyBytes_AS_STRING(b);
    }
    for (Py_ssize_t i = 0; i < nbytes; i++) {
        unsigned int byte = bytes != NULL ? bytes[i] : (unsigned int)((v >> (8 * i)) & 0xff);
        while (byte) {
            int bit = __builtin_ctz(byte);
            byte &= byte - 1;
            if (*n == *cap) {
                Py_ssize_t nc = *cap ? *cap * 2 : 64;
                Py_ssize_t *nw = PyMem_Realloc(*wids, (size_t)nc * sizeof(Py_ssize_t));
                if (nw == NULL) {
                    Py_XDECREF(b);
                    PyErr_NoMemory();
                    return -1;
                }
                *wids = nw;
                *cap = nc;
            }
            (*wids)[(*n)++] = i * 8 + bit;
        }
    }
    Py_XDECREF(b);
    return 0;
}

PyDoc_STRVAR(answers_doc,
"answers(stops, rows, group, block_size, credit, stale_factor, now, cls) -> list\n\n"
"The ranked answers of a GPU-only match in one group: for each (depth, mask) of\n"
"`stops` and each worker id in `mask` with a row (engine, dp_rank, freshness,\n"
"position) in `rows`, one `cls` tuple (-score, -blocks, engine, dp_rank, tier\n"
"items, group items, tokens, freshness, now), in ranking order: deepest stop\n"
"first, each stop's workers by position (their (engine, dp_rank) order), sorted\n"
"outright only when a stale worker or a negative credit can change that order.\n"
"Read-only. Same as result._py_gpu_answers.");

typedef struct {
    Py_ssize_t pos;
    Py_ssize_t wid;
} Ranked;

static int
by_pos(const void *a, const void *b)
{
    Py_ssize_t x = ((const Ranked *)a)->pos, y = ((const Ranked *)b)->pos;
    return (x > y) - (x < y);
}

static PyObject *
answers(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyType_Check(args[7]) ||
        !PyType_IsSubtype((PyTypeObject *)args[7], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "answers(list, list, str, int, float, float, now, tuple subclass)");
        return NULL;
    }
    PyObject *stops = args[0], *rows = args[1], *gname = args[2], *now = args[6];
    PyTypeObject *cls = (PyTypeObject *)args[7];
    Py_ssize_t bs = PyLong_AsSsize_t(args[3]);
    double cg = PyFloat_AsDouble(args[4]), sf = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t *wids = NULL, cap = 0, rcap = 0;
    Ranked *ranked = NULL;
    if (out == NULL)
        return NULL;
    Py_ssize_t nrows = PyList_GET_SIZE(rows), last = -1;
    /* Deepest stop first, each by position: already the ranking unless a stale
     * worker's lower score or a negative credit reorders it. */
    int need_sort = cg < 0;
    for (Py_ssize_t s = PyList_GET_SIZE(stops) - 1; s >= 0; s--) {
        PyObject *st = PyList_GET_ITEM(stops, s);
        if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 2) {
            PyErr_SetString(PyExc_TypeError, "a stop is a (depth, mask) tuple");
            goto fail;
        }
        PyObject *depth = PyTuple_GET_ITEM(st, 0);
        Py_ssize_t g = PyLong_AsSsize_t(depth);
        if (g == -1 && PyErr_Occurred())
            goto fail;
        if (last >= 0 && g >= last)
            need_sort = 1; /* stops not in increasing depth: rank outright */
        last = g;
        Py_ssize_t n = 0, k = 0;
        if (mask_bits(PyTuple_GET_ITEM(st, 1), &wids, &n, &cap) < 0)
            goto fail;
        if (n > rcap) {
            Ranked *nr = PyMem_Realloc(ranked, (size_t)n * sizeof(Ranked));
            if (nr == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            ranked = nr;
            rcap = n;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *row = wids[i] < nrows ? PyList_GET_ITEM(rows, wids[i]) : Py_None;
            if (row == Py_None)
                continue; /* not a worker of this model */
            if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(row, 2)) ||
                PyTuple_GET_SIZE(PyTuple_GET_ITEM(row, 2)) < 1) {
                PyErr_SetString(PyExc_TypeError, "a row is (engine, dp_rank, (stale, ...), position)");
                goto fail;
            }
            Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 3));
            if (pos == -1 && PyErr_Occurred())
                goto fail;
            ranked[k].pos = pos;
            ranked[k].wid = wids[i];
            k++;
        }
        if (k == 0)
            continue;
        qsort(ranked, (size_t)k, sizeof(Ranked), by_pos);
        double w = (double)g * cg;
        PyObject *pair = PyTuple_Pack(2, GPU_NAME, depth);
        PyObject *tier_items = pair ? PyTuple_Pack(1, pair) : NULL;
        PyObject *gtrip = tier_items ? PyTuple_Pack(3, gname, tier_items, depth) : NULL;
        PyObject *group_items = gtrip ? PyTuple_Pack(1, gtrip) : NULL;
        PyObject *negw = PyFloat_FromDouble(-w), *negws = PyFloat_FromDouble(-w * sf);
        PyObject *negt = PyLong_FromSsize_t(-g), *tokens = PyLong_FromSsize_t(g * bs);
        Py_XDECREF(pair);
        Py_XDECREF(gtrip);
        int ok = group_items && negw && negws && negt && tokens;
        for (Py_ssize_t i = 0; ok && i < k; i++) {
            PyObject *row = PyList_GET_ITEM(rows, ranked[i].wid);
            PyObject *fresh = PyTuple_GET_ITEM(row, 2);
            int stale = PyObject_IsTrue(PyTuple_GET_ITEM(fresh, 0));
            PyObject *t = stale < 0 ? NULL : cls->tp_alloc(cls, 9);
            if (t == NULL) {
                ok = 0;
                break;
            }
            if (stale)
                need_sort = 1;
            PyObject *items[9] = {stale ? negws : negw, negt, PyTuple_GET_ITEM(row, 0), PyTuple_GET_ITEM(row, 1),
                                  tier_items, group_items, tokens, fresh, now};
            for (int j = 0; j < 9; j++) {
                Py_INCREF(items[j]);
                PyTuple_SET_ITEM(t, j, items[j]);
            }
            if (PyList_Append(out, t) < 0)
                ok = 0;
            Py_DECREF(t);
        }
        Py_XDECREF(tier_items);
        Py_XDECREF(group_items);
        Py_XDECREF(negw);
        Py_XDECREF(negws);
        Py_XDECREF(negt);
        Py_XDECREF(tokens);
        if (!ok)
            goto fail;
    }
    PyMem_Free(wids);
    PyMem_Free(ranked);
    if (need_sort && PyList_Sort(out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
fail:
    PyMem_Free(wids);
    PyMem_Free(ranked);
    Py_DECREF(out);
    return NULL;
}

/* ------------------------------------------------------- Dynamo's /query body */

static int
col_put(Col *c, const char *s, size_t n)
{
    if (col_room(c, n) < 0)
        return -1;
    memcpy(c->buf + c->len, s, n);
    c->len += n;
    return 0;
}

/* A decimal integer, as "%lld" writes it: snprintf costs ~100 ns a call through
 * libc's format machinery, and a /query answer writes ~6 integers per worker. */
static int
col_int(Col *c, long long v)
{
    char t[24];
    char *e = t + sizeof t, *s = e;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--s = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--s = '-';
    return col_put(c, s, (size_t)(e - s));
}

/* A str as a JSON string, escaped as msgspec escapes it: " and \, \b \f \n \r \t, other
 * control characters as \u00XX; everything else (DEL, non-ASCII) as its UTF-8 bytes. */
static int
col_str(Col *c, PyObject *s)
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL || col_room(c, (size_t)n * 6 + 2) < 0)
        return -1;
    unsigned char *o = c->buf + c->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)u[i];
        if (ch >= 0x20 && ch != '"' && ch != '\\') {
            *o++ = ch;
            continue;
        }
        *o++ = '\\';
        switch (ch) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        default:
            o += sprintf((char *)o, "u%04x", ch);
        }
    }
    *o++ = '"';
    c->len = (size_t)(o - c->buf);
    return 0;
}

/* One worker's figures, and the instance (engine) it belongs to. */
typedef struct {
    long long total, gpu, cpu, dp;
    Py_ssize_t inst, next; /* next worker of the same instance, -1 at the end */
} DynW;

typedef struct {
    PyObject *eid; /* borrowed from the workers */
    long long longest, gpu, cpu, disk;
    Py_ssize_t head, tail; /* its workers, in order */
    int scored;            /* has a worker with GPU tokens */
} DynI;

PyDoc_STRVAR(dynamo_answer_doc,
"dynamo_answer(workers, block_size) -> bytes\n\n"
"Dynamo's /query body (JSON) from a match's ranked WorkerMatch tuples: per engine its\n"
"GPU tokens by dp rank ('scores', engines with any), and per engine longest_matched,\n"
"gpu, dp, cpu and disk (the most over its ranks; cpu is the whole match unless STORAGE\n"
"holds part, then at most the CPU prefix). The same bytes as api.dynamo.Dynamo.answer\n"
"encoded by msgspec, its reference.");

static PyObject *
dynamo_answer(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dynamo_answer(workers: list, block_size: int)");
        return NULL;
    }
    long long bs = PyLong_AsLongLong(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    PyObject *ws = args[0];
    Py_ssize_t n = PyList_GET_SIZE(ws), ni = 0;
    DynW *w = PyMem_Malloc(sizeof(DynW) * (size_t)(n ? n : 1));
    DynI *in = PyMem_Malloc(sizeof(DynI) * (size_t)(n ? n : 1));
    Py_ssize_t *sorder = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    PyObject *seen = PyDict_New(), *out = NULL;
    Col c = {NULL, 0, 0};
    Py_ssize_t ns = 0;
    if (w == NULL || in == NULL || sorder == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyList_GET_ITEM(ws, k);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 5 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 2))) {
            PyErr_SetString(PyExc_TypeError, "a worker is a WorkerMatch tuple");
            goto done;
        }
        long long neg = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1));
        long long dp = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3));
        if ((neg == -1 || dp == -1) && PyErr_Occurred())
            goto done;
        long long total = -neg * bs, gpu = 0, cpu_t = 0;
        int storage = 0;
        PyObject *items = PyTuple_GET_ITEM(t, 4);
        if (!PyTuple_Check(items)) {
            PyErr_SetString(PyExc_TypeError, "a worker's tiers are a tuple of (name, blocks)");
            goto done;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(items); j++) {
            PyObject *it = PyTuple_GET_ITEM(items, j);
            if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(it, 0))) {
                PyErr_SetString(PyExc_TypeError, "a worker's tiers are a tuple of (name, blocks)");
                goto done;
            }
            PyObject *name = PyTuple_GET_ITEM(it, 0);
            long long blocks = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 1));
            if (blocks == -1 && PyErr_Occurred())
                goto done;
            if (name == GPU_NAME || PyUnicode_CompareWithASCIIString(name, "GPU") == 0)
                gpu = blocks * bs;
            else if (PyUnicode_CompareWithASCIIString(name, "CPU") == 0)
                cpu_t = blocks * bs;
            else if (PyUnicode_CompareWithASCIIString(name, "STORAGE") == 0)
                storage = 1;
        }
        long long cpu = total;
        if (storage) {
            cpu = cpu_t < total ? cpu_t : total;
            if (gpu > cpu)
                cpu = gpu;
        }
        PyObject *eid = PyTuple_GET_ITEM(t, 2);
        PyObject *idx = PyDict_GetItemWithError(seen, eid);
        Py_ssize_t i;
        if (idx == NULL) {
            if (PyErr_Occurred())
                goto done;
            i = ni++;
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyDict_SetItem(seen, eid, v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
            in[i] = (DynI){eid, total, gpu, cpu, total, k, k, 0};
        }
        else {
            i = PyLong_AsSsize_t(idx);
            DynI *d = &in[i];
            w[d->tail].next = k;
            d->tail = k;
            if (gpu > d->gpu)
                d->gpu = gpu;
            if (cpu > d->cpu)
                d->cpu = cpu;
            if (total > d->disk)
                d->disk = d->longest = total;
        }
        if (gpu && !in[i].scored) {
            in[i].scored = 1;
            sorder[ns++] = i;
        }
        w[k] = (DynW){total, gpu, cpu, dp, i, -1};
    }
    if (col_put(&c, "{\"scores\":{", 11) < 0)
        goto done;
    for (Py_ssize_t s = 0; s < ns; s++) {
        DynI *d = &in[sorder[s]];
        if ((s && col_put(&c, ",", 1) < 0) || col_str(&c, d->eid) < 0 || col_put(&c, ":{", 2) < 0)
            goto done;
        int first = 1;
        for (Py_ssize_t k = d->head; k >= 0; k = w[k].next) {
            if (!w[k].gpu)
                continue;
            if ((!first && col_put(&c, ",", 1) < 0) || col_put(&c, "\"", 1) < 0 || col_int(&c, w[k].dp) < 0 ||
                col_put(&c, "\":", 2) < 0 || col_int(&c, w[k].gpu) < 0)
                goto done;
            first = 0;
        }
        if (col_put(&c, "}", 1) < 0)
            goto done;
    }
    if (col_put(&c, "},\"frequencies\":[],\"instances\":{", 32) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < ni; i++) {
        DynI *d = &in[i];
        if ((i && col_put(&c, ",", 1) < 0) || col_str(&c, d->eid) < 0 || col_put(&c, ":{\"longest_matched\":", 20) < 0 ||
            col_int(&c, d->longest) < 0 || col_put(&c, ",\"gpu\":", 7) < 0 || col_int(&c, d->gpu) < 0 ||
            col_put(&c, ",\"dp\":{", 7) < 0)
            goto done;
        for (Py_ssize_t k = d->head; k >= 0; k = w[k].next) {
            if ((k != d->head && col_put(&c, ",", 1) < 0) || col_put(&c, "\"", 1) < 0 || col_int(&c, w[k].dp) < 0 ||
                col_put(&c, "\":", 2) < 0 || col_int(&c, w[k].gpu) < 0)
                goto done;
        }
        if (col_put(&c, "},\"cpu\":", 8) < 0 || col_int(&c, d->cpu) < 0 || col_put(&c, ",\"disk\":", 8) < 0 ||
            col_int(&c, d->disk) < 0 || col_put(&c, "}", 1) < 0)
            goto done;
    }
    if (col_put(&c, "}}", 2) < 0)
        goto done;
    out = PyBytes_FromStringAndSize((const char *)c.buf, (Py_ssize_t)c.len);
done:
    PyMem_Free(w);
    PyMem_Free(in);
    PyMem_Free(sorder);
    PyMem_Free(c.buf);
    Py_XDECREF(seen);
    return out;
}


static PyMethodDef core_methods[] = {
    {"answers", (PyCFunction)(void (*)(void))answers, METH_FASTCALL, answers_doc},
    {"dynamo_answer", (PyCFunction)(void (*)(void))dynamo_answer, METH_FASTCALL, dynamo_answer_doc},
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL, block_keys_doc},
    {"tokens_from_msgpack", (PyCFunction)tokens_from_msgpack, METH_O, tokens_from_msgpack_doc},
    {"split_tokens_json", (PyCFunction)split_tokens_json, METH_O, split_tokens_json_doc},
    {"insert_gpu", (PyCFunction)(void (*)(void))insert_gpu, METH_FASTCALL, insert_gpu_doc},
    {"insert_gpu_raw", (PyCFunction)(void (*)(void))insert_gpu_raw, METH_FASTCALL, insert_gpu_raw_doc},
    {"scan_gpu_batch", (PyCFunction)scan_gpu_batch, METH_O, scan_gpu_batch_doc},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"remove_gpu", (PyCFunction)(void (*)(void))remove_gpu, METH_FASTCALL, remove_gpu_doc},
    {"dump_tree", (PyCFunction)(void (*)(void))dump_tree, METH_FASTCALL, dump_tree_doc},
    {"dump_map", (PyCFunction)(void (*)(void))dump_map, METH_FASTCALL, dump_map_doc},
    {"node_index", (PyCFunction)(void (*)(void))node_index, METH_FASTCALL, node_index_doc},
    {"translate", (PyCFunction)(void (*)(void))translate, METH_FASTCALL, translate_doc},
    {"load_tree", (PyCFunction)(void (*)(void))load_tree, METH_FASTCALL, load_tree_doc},
    {"load_map", (PyCFunction)(void (*)(void))load_map, METH_FASTCALL, load_map_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "indexer._native._core",
    "Compiled core of the prefix index: Node, U64Map, the hot loops, block keys, token parsing and snapshot columns.", -1, core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&U64MapType) < 0 || PyType_Ready(&NodeType) < 0 || PyType_Ready(&NodeIndexType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&core_module);
    if (mod == NULL)
        return NULL;
    ZERO = PyLong_FromLong(0);
    GPU_NAME = PyUnicode_InternFromString("GPU");
    if (ZERO == NULL || GPU_NAME == NULL)
        goto fail;
    DEAD = (PyObject *)node_make(0, Py_None, ZERO);
    if (DEAD == NULL)
        goto fail;
    Py_INCREF(&U64MapType);
    Py_INCREF(&NodeType);
    Py_INCREF(&NodeIndexType);
    if (PyModule_AddObject(mod, "U64Map", (PyObject *)&U64MapType) < 0 ||
        PyModule_AddObject(mod, "Node", (PyObject *)&NodeType) < 0 ||
        PyModule_AddObject(mod, "NodeIndex", (PyObject *)&NodeIndexType) < 0)
        goto fail;
    Py_INCREF(DEAD); /* one for the module attribute, one kept by this file */
    if (PyModule_AddObject(mod, "DEAD", DEAD) < 0)
        goto fail;
    return mod;
fail:
    Py_DECREF(mod);
    return NULL;
}
