/* u64map.c: U64Map, the dict-like map of the index (a node's children, a worker's
 * engine hash -> node). Int keys in [0, 2**64) live in an open-addressing table of
 * 16-byte (uint64, object) slots, no key object; any other key (a bytes hash, a
 * negative int) goes to a plain dict inside, so every key a vLLM engine can send works.
 * The probe (map_find) and lookup are static inline in core.h for the loops of
 * tree.c and snapshot.c; the growing and shrinking are here. */
#include "core.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

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

KVI_HIDDEN int
kvi_map_resize(U64Map *m, Py_ssize_t newcap)
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

/* Store (k, v) (a new reference is taken); replaces an existing value. */
KVI_HIDDEN int
kvi_map_put(U64Map *m, uint64_t k, PyObject *v)
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
        if (kvi_map_resize(m, m->cap ? m->cap * 2 : 4) < 0)
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
KVI_HIDDEN PyObject *
kvi_map_take(U64Map *m, size_t i)
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
        if (kvi_map_resize(m, nc) < 0)
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

KVI_HIDDEN int
kvi_map_store(U64Map *m, PyObject *key, PyObject *v)
{
    uint64_t k;
    int r = as_u64(key, &k);
    if (r > 0)
        return kvi_map_put(m, k, v);
    if (r < 0)
        return -1;
    if (m->other == NULL && (m->other = PyDict_New()) == NULL)
        return -1;
    return PyDict_SetItem(m->other, key, v);
}

/* New reference to the removed value; NULL with KeyError set when absent. */
KVI_HIDDEN PyObject *
kvi_map_pop(U64Map *m, PyObject *key)
{
    uint64_t k;
    int r = as_u64(key, &k);
    if (r > 0) {
        Py_ssize_t i = map_find(m, k);
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return NULL;
        }
        return kvi_map_take(m, (size_t)i);
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
            if (kvi_map_store(m, k, v) < 0) {
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
        return kvi_map_store(m, key, v);
    PyObject *old = kvi_map_pop(m, key);
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
    PyObject *v = kvi_map_pop(m, args[0]);
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

KVI_HIDDEN PyTypeObject kvi_U64MapType = {
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
