/* applyrun.c: ApplyRun, a run of applies a recording journaled, laid out by
 * JournalCore.run_apply (journal.c) in one buffer of the C allocator's: a head (ARec,
 * core.h) and the bytes of each, with no Python object per batch.
 *
 * Why: as a tuple of its arguments, result and clock readings, each batch's record made
 * ~8 objects on the thread that applies batches and kept the payload alive until the
 * writer thread took it; the writer then needed the GIL to read every record and to free
 * it. Both threads paid: ingest ran ~15% slower while recorded, ~2 us a batch of it spent
 * in GIL handoffs and the allocator. Laid out here, a batch costs a copy of its payload
 * (freed at once, so the next one reuses warm memory), and the writer frames a whole run
 * without the GIL (recframe.c's frame_run) and takes the GIL once a run.
 *
 * From Python a run is a sequence of its records' count: ``len(run)``; ``run.item(i)``
 * is record i as the journal's tuple ``(op, wall, args, result, times)``, for what the
 * compiled framer leaves to the Python encoder (never a record laid stripped, whose
 * payload is already as ``hashed`` mode keeps it: that is the payload it gives). */
#include "core.h"

KVI_HIDDEN const ARec *
kvi_run_rec(ApplyRun *run, Py_ssize_t i)
{
    if (i < run->at_i) {
        run->at_i = 0;
        run->at_off = 0;
    }
    while (run->at_i < i) {
        run->at_off += ((const ARec *)(run->buf + run->at_off))->size;
        run->at_i++;
    }
    return (const ARec *)(run->buf + run->at_off);
}

static int
ar_traverse(ApplyRun *self, visitproc visit, void *arg)
{
    Py_VISIT(self->journal);
    return 0;
}

static int
ar_clear(ApplyRun *self)
{
    Py_CLEAR(self->journal);
    return 0;
}

static void
ar_dealloc(ApplyRun *self)
{
    PyObject_GC_UnTrack(self);
    if (self->journal != NULL)
        kvi_journal_release(self->journal, self->count, self->len, self->buf, self->cap);
    else
        free(self->buf);
    self->buf = NULL;
    ar_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
ar_len(ApplyRun *self)
{
    return self->count;
}

static PyObject *
opt_int64(int has, int64_t v)
{
    if (!has)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(v);
}

static PyObject *
ar_item(ApplyRun *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0 || i >= self->count) {
        PyErr_SetString(PyExc_IndexError, "record index out of range");
        return NULL;
    }
    const ARec *r = kvi_run_rec(self, i);
    PyObject *times = PyTuple_New(r->nt);
    if (times == NULL)
        return NULL;
    for (uint32_t k = 0; k < r->nt; k++) {
        PyObject *f = PyFloat_FromDouble(AREC_TIMES(r)[k]);
        if (f == NULL) {
            Py_DECREF(times);
            return NULL;
        }
        PyTuple_SET_ITEM(times, k, f);
    }
    PyObject *args = PyTuple_New(6), *res = PyTuple_New(2), *rec = PyTuple_New(5);
    if (args == NULL || res == NULL || rec == NULL)
        goto fail;
    PyTuple_SET_ITEM(rec, 2, args); /* each item set as made: the tuples own what is made so far */
    PyTuple_SET_ITEM(rec, 3, res);
    PyTuple_SET_ITEM(rec, 4, times);
    times = NULL;
    PyObject *v[] = {
        PyLong_FromLong(r->op), PyFloat_FromDouble(r->wall),
        PyUnicode_DecodeUTF8(AREC_ENGINE(r), r->engine_n, NULL),
        PyBytes_FromStringAndSize((const char *)AREC_PAYLOAD(r), (Py_ssize_t)r->payload_n),
        PyUnicode_DecodeUTF8(AREC_MODEL(r), r->model_n, NULL),
        opt_int64(r->has_rank, r->dp_rank), opt_int64(r->has_seq, r->seq), Py_NewRef(r->decide ? Py_True : Py_False),
        PyUnicode_DecodeUTF8(AREC_OUTCOME(r), r->outcome_n, NULL),
        r->has_ts ? PyFloat_FromDouble(r->ts) : Py_NewRef(Py_None),
    };
    PyTuple_SET_ITEM(rec, 0, v[0]);
    PyTuple_SET_ITEM(rec, 1, v[1]);
    for (int k = 0; k < 6; k++)
        PyTuple_SET_ITEM(args, k, v[2 + k]);
    PyTuple_SET_ITEM(res, 0, v[8]);
    PyTuple_SET_ITEM(res, 1, v[9]);
    for (int k = 0; k < 10; k++)
        if (v[k] == NULL)
            goto fail;
    return rec;
fail:
    Py_XDECREF(times);
    if (rec == NULL || PyTuple_GET_ITEM(rec, 2) == NULL) {
        Py_XDECREF(args);
        Py_XDECREF(res);
    }
    Py_XDECREF(rec);
    return NULL;
}

static PyMethodDef ar_methods[] = {
    {"item", (PyCFunction)ar_item, METH_O,
     "item(i) -> record i as the journal's tuple (op, wall, args, result, times)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ar_as_sequence = {
    .sq_length = (lenfunc)ar_len,
};

KVI_HIDDEN PyTypeObject kvi_ApplyRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.ApplyRun",
    .tp_basicsize = sizeof(ApplyRun),
    .tp_dealloc = (destructor)ar_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A run of journaled applies in one buffer (journal.c lays it out, recframe.c frames it).",
    .tp_traverse = (traverseproc)ar_traverse,
    .tp_clear = (inquiry)ar_clear,
    .tp_methods = ar_methods,
    .tp_as_sequence = &ar_as_sequence,
};
