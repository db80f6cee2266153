/* journal.c: JournalCore, the half of a recording's journal (indexer/store/journal.py)
 * that runs on the hot paths: run(op, fn, args) wraps every journaled call of a
 * recording index (each batch applied, each query) and clock() every reading of the
 * index's clock inside one.
 *
 * Why in C: in Python the wrapper cost ~0.45 us a call and its record (a tuple, a list
 * of clock readings) was garbage the cyclic collector walked while it waited in the
 * queue, ~0.4 us more: together ~10% of a batch the index applies in ~10 us. Here a
 * record is one tuple, its clock readings a tuple of floats, both untracked by the
 * collector (they hold no container that could close a cycle through them: strings,
 * bytes, numbers, and the call's own arguments and result, which stay tracked if
 * they are containers). */
#include "core.h"

#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *records; /* a collections.deque of records, taken by the writer thread */
    PyObject *append;  /* records.append */
    PyObject *raw;     /* the index's own clock */
    PyObject *values;  /* a frozenset of types whose instances a record may untrack (untrack_graph), or NULL */
    PyObject *wake;    /* called with no argument every wake_every records queued (the writer's event), or NULL */
    Py_ssize_t wake_every, since_wake;
    Py_ssize_t max_pending;
    char active, overflowed;
    double *times; /* the clock readings of the calls running (nested ones after the outer's) */
    Py_ssize_t nt, tcap;
} JournalCore;

static int
jc_init(JournalCore *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"raw", "max_pending", NULL};
    PyObject *raw;
    Py_ssize_t max_pending = 1000000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|n", kw, &raw, &max_pending))
        return -1;
    PyObject *coll = PyImport_ImportModule("collections");
    if (coll == NULL)
        return -1;
    PyObject *dq = PyObject_CallMethod(coll, "deque", NULL);
    Py_DECREF(coll);
    if (dq == NULL)
        return -1;
    PyObject *app = PyObject_GetAttrString(dq, "append");
    if (app == NULL) {
        Py_DECREF(dq);
        return -1;
    }
    Py_XSETREF(self->records, dq);
    Py_XSETREF(self->append, app);
    Py_INCREF(raw);
    Py_XSETREF(self->raw, raw);
    self->max_pending = max_pending;
    self->wake_every = 1024;
    self->since_wake = 0;
    self->active = self->overflowed = 0;
    self->nt = 0;
    return 0;
}

static int
jc_traverse(JournalCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->records);
    Py_VISIT(self->append);
    Py_VISIT(self->raw);
    Py_VISIT(self->values);
    Py_VISIT(self->wake);
    return 0;
}

static int
jc_clear(JournalCore *self)
{
    Py_CLEAR(self->records);
    Py_CLEAR(self->append);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->values);
    Py_CLEAR(self->wake);
    return 0;
}

static void
jc_dealloc(JournalCore *self)
{
    PyObject_GC_UnTrack(self);
    jc_clear(self);
    PyMem_Free(self->times);
    Py_TYPE(self)->tp_free((PyObject *)self); /* a subclass's dealloc drops its type's reference */
}

static PyObject *
jc_clock(JournalCore *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *t = PyObject_CallNoArgs(self->raw);
    if (t == NULL || !self->active)
        return t;
    double v = PyFloat_AsDouble(t);
    if (v == -1.0 && PyErr_Occurred()) {
        Py_DECREF(t);
        return NULL;
    }
    if (self->nt == self->tcap) {
        Py_ssize_t nc = self->tcap ? self->tcap * 2 : 16;
        double *nb = PyMem_Realloc(self->times, (size_t)nc * sizeof(double));
        if (nb == NULL) {
            Py_DECREF(t);
            return PyErr_NoMemory();
        }
        self->times = nb;
        self->tcap = nc;
    }
    self->times[self->nt++] = v;
    return t;
}

static double
wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Untracking a record's values.
 *
 * A record holds its call's arguments and result until the writer takes it (up to
 * flush_s, 0.2 s). The ones a query hands over are small graphs of containers (a key
 * source and its chunks of keys, the answer's tuples, lists and dicts): while they wait,
 * the cyclic collector walked each of them at every collection of the generations they
 * were promoted through, which slowed a loop of queries by half (bench_record.py). None
 * of them can be part of a cycle: they are values made by the call, referring to
 * strings, bytes, numbers and each other, never back. So they are untracked here, as
 * the collector itself untracks a tuple of atomic values when it meets one; they are
 * freed by their reference counts as ever.
 *
 * What is untracked, once all its referents are: a tuple (immutable); a list or a dict
 * referred to by nothing but the record's graph (reference count 1: never the caller's
 * own, which it may yet link into a cycle); an instance of a type in ``values`` (the
 * index's key source, made per query and never handed out). At most UNTRACK_MAX objects
 * a record are visited, UNTRACK_DEPTH deep. */
#define UNTRACK_DEPTH 12
#define UNTRACK_MAX 1024

typedef struct {
    PyObject *values; /* a frozenset of types, or NULL */
    int budget, depth, blocked;
} Untrack;

static int untrack_child(PyObject *o, void *arg);

static void
untrack_graph(PyObject *o, Untrack *u)
{
    if (!PyObject_IS_GC(o) || !PyObject_GC_IsTracked(o) || PyType_Check(o)) {
        return;
    }
    PyTypeObject *tp = Py_TYPE(o);
    int ok = PyTuple_Check(o) ||
             ((PyList_CheckExact(o) || PyDict_CheckExact(o)) && Py_REFCNT(o) == 1) ||
             (u->values != NULL && PyAnySet_Check(u->values) && PySet_Contains(u->values, (PyObject *)tp) == 1);
    if (!ok || u->depth >= UNTRACK_DEPTH || --u->budget < 0 || tp->tp_traverse == NULL) {
        u->blocked = 1;
        return;
    }
    int outer = u->blocked;
    u->blocked = 0;
    u->depth++;
    tp->tp_traverse(o, untrack_child, u);
    u->depth--;
    if (!u->blocked)
        PyObject_GC_UnTrack(o);
    u->blocked |= outer;
}

static int
untrack_child(PyObject *o, void *arg)
{
    Untrack *u = arg;
    if (o == NULL || PyType_Check(o)) /* an instance's own type: not a value of the record */
        return 0;
    untrack_graph(o, u);
    if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o))
        u->blocked = 1;
    return 0;
}

static void
untrack_values(JournalCore *self, PyObject *o)
{
    Untrack u = {self->values, UNTRACK_MAX, 0, 0};
    untrack_graph(o, &u);
}

static PyObject *
jc_run(JournalCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "run(op, fn, args: tuple)");
        return NULL;
    }
    PyObject *op = args[0], *fn = args[1], *cargs = args[2];
    Py_ssize_t base = self->nt;
    char prev = self->active;
    self->active = 1;
    PyObject *r = PyObject_Call(fn, cargs, NULL);
    self->active = prev;
    PyObject *times = PyTuple_New(self->nt - base);
    if (times == NULL) {
        Py_XDECREF(r);
        self->nt = base;
        return NULL;
    }
    for (Py_ssize_t i = base; i < self->nt; i++) {
        PyObject *f = PyFloat_FromDouble(self->times[i]);
        if (f == NULL) {
            Py_DECREF(times);
            Py_XDECREF(r);
            self->nt = base;
            return NULL;
        }
        PyTuple_SET_ITEM(times, i - base, f);
    }
    self->nt = base;
    PyObject_GC_UnTrack(times);
    double wall = wall_now();
    if (r == NULL) { /* the call raised: the Python half queues it (as a Raised), then it propagates */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        PyObject *w = PyFloat_FromDouble(wall);
        PyObject *ok = w == NULL ? NULL
                                 : PyObject_CallMethod((PyObject *)self, "_put_raised", "OOOOO", op, w, cargs,
                                                       ev ? ev : Py_None, times);
        Py_XDECREF(w);
        Py_DECREF(times);
        if (ok == NULL) { /* the queueing failed: that error wins, the call's is chained */
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(ok);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    Py_ssize_t pending = PyObject_Size(self->records);
    if (pending < 0) {
        Py_DECREF(times);
        Py_DECREF(r);
        return NULL;
    }
    if (pending >= self->max_pending) {
        self->overflowed = 1; /* the writer sees it and stops the recording */
        Py_DECREF(times);
        return r;
    }
    PyObject *rec = PyTuple_New(5);
    PyObject *w = PyFloat_FromDouble(wall);
    if (rec == NULL || w == NULL) {
        Py_XDECREF(rec);
        Py_XDECREF(w);
        Py_DECREF(times);
        Py_DECREF(r);
        return NULL;
    }
    Py_INCREF(op);
    Py_INCREF(cargs);
    Py_INCREF(r);
    PyTuple_SET_ITEM(rec, 0, op);
    PyTuple_SET_ITEM(rec, 1, w);
    PyTuple_SET_ITEM(rec, 2, cargs);
    PyTuple_SET_ITEM(rec, 3, r);
    PyTuple_SET_ITEM(rec, 4, times);
    untrack_values(self, cargs);
    untrack_values(self, r);
    PyObject_GC_UnTrack(rec); /* holds a cycle only if its args or result do: they stay tracked then */
    PyObject *res = PyObject_CallOneArg(self->append, rec);
    Py_DECREF(rec);
    if (res == NULL) {
        Py_DECREF(r);
        return NULL;
    }
    Py_DECREF(res);
    /* Every wake_every records the writer is woken rather than left to its timer: a
     * record keeps its payload alive until written, and at tens of thousands of batches
     * a second 0.2 s of them (tens of MB) meant every new payload was written to memory
     * no longer in any cache, on the thread that applies them. */
    if (self->wake != NULL && self->wake != Py_None && ++self->since_wake >= self->wake_every) {
        self->since_wake = 0;
        res = PyObject_CallNoArgs(self->wake);
        if (res == NULL) {
            Py_DECREF(r);
            return NULL;
        }
        Py_DECREF(res);
    }
    return r;
}

static PyMethodDef jc_methods[] = {
    {"run", (PyCFunction)(void (*)(void))jc_run, METH_FASTCALL,
     "run(op, fn, args) -> fn(*args), the call queued with its result and clock readings (the caller holds the index lock)."},
    {"clock", (PyCFunction)jc_clock, METH_NOARGS, "The index's clock while recording: a reading inside a run is noted."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef jc_members[] = {
    {"records", T_OBJECT, offsetof(JournalCore, records), READONLY, "the queue (a deque) the writer takes from"},
    {"raw", T_OBJECT, offsetof(JournalCore, raw), READONLY, "the index's own clock"},
    {"wake", T_OBJECT, offsetof(JournalCore, wake), 0, "called every wake_every records queued (or None)"},
    {"wake_every", T_PYSSIZET, offsetof(JournalCore, wake_every), 0, "records between two calls of wake"},
    {"values", T_OBJECT, offsetof(JournalCore, values), 0,
     "a frozenset of types a record's values may be instances of and still be untracked (or None)"},
    {"max_pending", T_PYSSIZET, offsetof(JournalCore, max_pending), 0, "records queued at most"},
    {"active", T_BOOL, offsetof(JournalCore, active), 0, "a journaled call is running"},
    {"overflowed", T_BOOL, offsetof(JournalCore, overflowed), 0, "the writer fell max_pending records behind"},
    {NULL, 0, 0, 0, NULL},
};

KVI_HIDDEN PyTypeObject kvi_JournalCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.JournalCore",
    .tp_basicsize = sizeof(JournalCore),
    .tp_dealloc = (destructor)jc_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot half of a recording's journal: run and clock (indexer/store/journal.py).",
    .tp_traverse = (traverseproc)jc_traverse,
    .tp_clear = (inquiry)jc_clear,
    .tp_methods = jc_methods,
    .tp_members = jc_members,
    .tp_init = (initproc)jc_init,
    .tp_new = PyType_GenericNew,
};
