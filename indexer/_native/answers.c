/* answers.c: the ranked per-worker answers of a GPU-only, one-group match
 * (query/answers.py's _py_gpu_answers is the reference), built as the result's tuples
 * with no Python frame per worker. */
#include "core.h"

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

/* Orders ranked[0..k) by position. A stop that many of the model's rows share (a
 * prompt a whole fleet holds) is placed by position in one pass over a table of
 * nrows slots (*tab, grown as needed, left all zero), when every position is a
 * distinct slot below nrows; anything else is sorted. glibc's qsort moves these
 * 16-byte items with a memcpy call each: a tenth of a 256-worker route. -1 with
 * MemoryError set. */
static int
order_by_pos(Ranked *ranked, Py_ssize_t k, Py_ssize_t nrows, Py_ssize_t **tab, Py_ssize_t *tcap)
{
    if (k < 2)
        return 0;
    if (k * 4 < nrows) {
        qsort(ranked, (size_t)k, sizeof(Ranked), by_pos);
        return 0;
    }
    if (*tcap < nrows) {
        Py_ssize_t *t = PyMem_Calloc((size_t)nrows, sizeof(Py_ssize_t));
        if (t == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(*tab);
        *tab = t;
        *tcap = nrows;
    }
    Py_ssize_t *t = *tab, i = 0;
    for (; i < k; i++) {
        Py_ssize_t p = ranked[i].pos;
        if (p < 0 || p >= nrows || t[p] != 0)
            break;
        t[p] = ranked[i].wid + 1; /* 0: empty */
    }
    if (i < k) { /* not one slot each: undo, and sort */
        for (Py_ssize_t j = 0; j < i; j++)
            t[ranked[j].pos] = 0;
        qsort(ranked, (size_t)k, sizeof(Ranked), by_pos);
        return 0;
    }
    Py_ssize_t j = 0;
    for (Py_ssize_t p = 0; p < nrows && j < k; p++) {
        if (t[p] != 0) {
            ranked[j].pos = p;
            ranked[j].wid = t[p] - 1;
            t[p] = 0;
            j++;
        }
    }
    return 0;
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
    Py_ssize_t *wids = NULL, cap = 0, rcap = 0, *tab = NULL, tcap = 0;
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
        if (order_by_pos(ranked, k, nrows, &tab, &tcap) < 0)
            goto fail;
        double w = (double)g * cg;
        PyObject *pair = PyTuple_Pack(2, kvi_GPU_NAME, depth);
        PyObject *tier_items = pair ? PyTuple_Pack(1, pair) : NULL;
        PyObject *gtrip = tier_items ? PyTuple_Pack(3, gname, tier_items, depth) : NULL;
        PyObject *group_items = gtrip ? PyTuple_Pack(1, gtrip) : NULL;
        PyObject *negw = PyFloat_FromDouble(-w), *negws = PyFloat_FromDouble(-w * sf);
        PyObject *negt = PyLong_FromSsize_t(-g), *tokens = PyLong_FromSsize_t(g * bs);
        untrack_atomic(pair);
        untrack_atomic(tier_items);
        untrack_atomic(gtrip);
        untrack_atomic(group_items);
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
            /* Its items are numbers, strings and the tuples above; the row's freshness
             * tuple decides (untracked once the collector, or a recording, has met it). */
            if (!PyObject_GC_IsTracked(fresh))
                PyObject_GC_UnTrack(t);
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
    PyMem_Free(tab);
    if (need_sort && PyList_Sort(out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
fail:
    PyMem_Free(wids);
    PyMem_Free(ranked);
    PyMem_Free(tab);
    Py_DECREF(out);
    return NULL;
}

KVI_HIDDEN PyMethodDef kvi_answers_methods[] = {
    {"answers", (PyCFunction)(void (*)(void))answers, METH_FASTCALL, answers_doc},
    {NULL, NULL, 0, NULL},
};
