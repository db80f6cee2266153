/* keys.c: block_keys, the xxh3-64 of each block of little-endian uint32 token ids
 * (wire/keys.py documents the key; its pure-Python path is the reference), as ints or
 * packed little-endian uint64 bytes for walk. */
#include "core.h"

/* xxHash 0.8.4 (BSD-2-Clause, vendor/LICENSE.xxhash): the version the `xxhash`
 * wheel bundles, so keys are bit-identical to xxhash.xxh3_64_intdigest. */
#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

/* The block hash and block_keys, whose loop calls it once a block, each start on a
 * 64-byte line. Their instructions are the same wherever the linker puts them, but not
 * their speed: over five placements, block_keys of 64 blocks (packed) took 1.00x to 1.26x
 * the time it took when the core was one file (the same instructions at other offsets
 * within cache lines); pinned to lines, 1.00x to 1.01x over four. The hash stays xxhash's
 * own function, out of line, with two callers here (block_keys, kvi_xxh3_64) as it had
 * in one file: inlined into the loop, or compiled inside a wrapper, its entry saved
 * three registers more on every call. */
#if defined(__GNUC__) || defined(__clang__)
#define KVI_LINE_ALIGNED __attribute__((aligned(64)))
static __typeof__(XXH3_64bits_withSeed) XXH3_64bits_withSeed KVI_LINE_ALIGNED;
#else
#define KVI_LINE_ALIGNED
#endif

/* The block hash for tree.c's insert loop (a jump to the copy above). */
KVI_HIDDEN uint64_t
kvi_xxh3_64(const void *data, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(data, len, seed);
}

/* xxh64 (not xxh3): a recorded answer's digest, xxhash.xxh64_intdigest's (recquery.c). */
KVI_HIDDEN uint64_t
kvi_xxh64(const void *data, size_t len, uint64_t seed)
{
    return XXH64(data, len, seed);
}

KVI_HIDDEN KeyMemo kvi_key_memo;

KVI_HIDDEN void
kvi_key_memo_arm(int on)
{
    KeyMemo *km = &kvi_key_memo;
    km->armed = on;
    km->m = 0;
    Py_CLEAR(km->buf);
}

/* Where block_keys writes keys start..n-1 of ``buf`` to the memo (indexed from 0), or
 * NULL: not armed, or not the blocks after those it holds (then it is left as it is). */
static uint64_t *
memo_room(PyObject *buf, Py_ssize_t bs, uint64_t seed, Py_ssize_t start, Py_ssize_t n)
{
    KeyMemo *km = &kvi_key_memo;
    if (!km->armed || !PyBytes_CheckExact(buf) || n <= start)
        return NULL;
    if (start == 0) {
        Py_INCREF(buf);
        Py_XSETREF(km->buf, buf);
        km->bs = bs;
        km->seed = seed;
        km->m = 0;
    }
    else if (km->buf != buf || km->bs != bs || km->seed != seed || km->m != start)
        return NULL;
    if (n > km->cap) {
        Py_ssize_t cap = n > 2 * km->cap ? n : 2 * km->cap;
        uint64_t *k = PyMem_Realloc(km->keys, (size_t)cap * sizeof(uint64_t));
        if (k == NULL) { /* no memo: the encoder hashes */
            kvi_key_memo_arm(1);
            return NULL;
        }
        km->keys = k;
        km->cap = cap;
    }
    km->m = n; /* the caller fills start..n-1 or fails (a seed error: none, no memo) */
    return km->keys;
}

PyDoc_STRVAR(block_keys_doc,
"block_keys(buf, block_size, seed, limit=-1, start=0, packed=False) -> list[int] | bytes\n\n"
"xxh3-64 of each full block `start` .. `limit` (-1: all) of `buf`, little-endian\n"
"uint32 token ids; `seed` is one int or one per block, indexed from block 0.\n"
"With `packed`, the keys as little-endian uint64 bytes, 8 per block: what walk\n"
"reads without an int object per key.");

static KVI_LINE_ALIGNED PyObject *
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
    uint64_t *mk = NULL;    /* where the keys go in the key memo too, or NULL */
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
    mk = seeds == NULL ? memo_room(args[0], bs, seed, start, n) : NULL;
    for (Py_ssize_t j = start; j < n; j++) {
        uint64_t sj = seed;
        if (seeds != NULL && as_u64(PySequence_Fast_GET_ITEM(seeds, j), &sj) <= 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "seed must be in [0, 2**64)");
            Py_DECREF(out);
            goto fail;
        }
        uint64_t key = XXH3_64bits_withSeed(p + (size_t)j * step, step, sj);
        if (mk != NULL)
            mk[j] = key;
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
    if (mk != NULL) /* keys start..n-1 not all made */
        kvi_key_memo.m = start;
    PyBuffer_Release(&view);
    Py_XDECREF(seeds);
    return NULL;
}


KVI_HIDDEN PyMethodDef kvi_keys_methods[] = {
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL, block_keys_doc},
    {NULL, NULL, 0, NULL},
};
