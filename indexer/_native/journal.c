/* journal.c: JournalCore, the half of a recording's journal (indexer/store/journal.py)
 * that runs on the hot paths: run(op, fn, args) wraps every journaled call of a
 * recording index (each query, each change) and clock() every reading of the index's
 * clock inside one; run_apply(op, fn, *args) wraps a batch applied.
 *
 * Why in C: in Python the wrapper cost ~0.45 us a call and its record (a tuple, a list
 * of clock readings) was garbage the cyclic collector walked while it waited in the
 * queue, ~0.4 us more: together ~10% of a batch the index applies in ~10 us. Here a
 * record is one tuple, its clock readings a tuple of floats, both untracked by the
 * collector (they hold no container that could close a cycle through them: strings,
 * bytes, numbers, and the call's own arguments and result, which stay tracked if
 * they are containers). A batch applied is not even that: run_apply copies it into the
 * open ApplyRun (applyrun.c says why), which goes on the queue whole, in order: before
 * any other record is queued, and when it is full. */
#include "journal.h"

#include <time.h>

KVI_HIDDEN KeySink kvi_sink;

/* A new collections.deque in ``*dq`` and its append in ``*app`` (what they held before
 * released): 0, or -1 with an error set. */
static int
new_deque(PyObject *coll, PyObject **dq, PyObject **app)
{
    PyObject *d = PyObject_CallMethod(coll, "deque", NULL);
    PyObject *a = d == NULL ? NULL : PyObject_GetAttrString(d, "append");
    if (a == NULL) {
        Py_XDECREF(d);
        return -1;
    }
    Py_XSETREF(*dq, d);
    Py_XSETREF(*app, a);
    return 0;
}

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
    int ok = new_deque(coll, &self->records, &self->append) == 0 &&
             new_deque(coll, &self->apart, &self->apart_append) == 0;
    Py_DECREF(coll);
    if (!ok)
        return -1;
    Py_INCREF(raw);
    Py_XSETREF(self->raw, raw);
    self->max_pending = max_pending;
    self->wake_every = 1024;
    self->since_wake = 0;
    self->wake_bytes = 32 << 20;
    self->keep = 4;
    self->active = self->overflowed = 0;
    self->nt = 0;
    return 0;
}

static int
jc_traverse(JournalCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->records);
    Py_VISIT(self->append);
    Py_VISIT(self->apart);
    Py_VISIT(self->apart_append);
    Py_VISIT(self->raw);
    Py_VISIT(self->values);
    Py_VISIT(self->wake);
    Py_VISIT(self->open);
    Py_VISIT(self->raised);
    Py_VISIT(self->kinds);
    return 0;
}

static int
jc_clear(JournalCore *self)
{
    Py_CLEAR(self->records);
    Py_CLEAR(self->append);
    Py_CLEAR(self->apart);
    Py_CLEAR(self->apart_append);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->values);
    Py_CLEAR(self->wake);
    Py_CLEAR(self->open);
    Py_CLEAR(self->raised);
    Py_CLEAR(self->kinds);
    return 0;
}

static void
jc_dealloc(JournalCore *self)
{
    PyObject_GC_UnTrack(self);
    jc_clear(self);
    PyMem_Free(self->times);
    while (self->nspare > 0)
        kvi_run_buf_free(self->spare[--self->nspare], RUN_BYTES);
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

KVI_HIDDEN double
kvi_wall_now(void)
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

/* The open run queued (before any other record, in order): 0, or -1 with an error set. */
KVI_HIDDEN int
kvi_seal(JournalCore *self)
{
    if (self->open == NULL || self->open->count == 0)
        return 0;
    PyObject *run = (PyObject *)self->open;
    self->open = NULL;
    self->burst = 0; /* sealed before it was full (open_run says when it was) */
    PyObject *res = PyObject_CallOneArg(self->append, run);
    if (res != NULL)
        self->sealed++;
    Py_DECREF(run);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* Records queued and not written: the queue's, a run counted as its applies (one taken
 * off the queue still counts until it is released: ``sealed`` counts it then, the queue
 * no longer does), and the open run's. -1: error. */
static Py_ssize_t
pending(JournalCore *self)
{
    Py_ssize_t n = PyObject_Size(self->records);
    if (n < 0)
        return -1;
    n += self->in_runs - self->sealed;
    return n > self->in_runs ? n : self->in_runs;
}

/* Whether one more record may be queued; if not, the journal overflowed (the writer sees
 * it and stops the recording). -1: error. */
static int
has_room(JournalCore *self)
{
    Py_ssize_t n = pending(self);
    if (n < 0)
        return -1;
    if (n >= self->max_pending) {
        self->overflowed = 1;
        return 0;
    }
    return 1;
}

/* Every wake_every records the writer is woken rather than left to its timer: a record
 * queued apart keeps what its call was handed and returned alive until written, and a
 * record laid encoded (a query's) fills a run's buffer; at thousands of queries a second,
 * 0.2 s of either was memory no longer in any cache. The applies of a run are copies and
 * count by their bytes: the writer is
 * woken when the runs not written yet hold wake_bytes. Each wake costs the thread that
 * applies batches the GIL handoffs of the writer's drain; woken every 1024 applies
 * (~2 MB), a burst applied ~5% slower than woken by the timer and by the bytes
 * (bench_record.py --service). The open run is queued first, so the writer finds it.
 * ``run``: an apply laid in a run. 0, or -1 with an error set. */
static int
counted(JournalCore *self, int run)
{
    if (self->wake == NULL || self->wake == Py_None)
        return 0;
    if (run ? self->run_bytes < (self->wake_at ? self->wake_at : self->wake_bytes)
            : ++self->since_wake < self->wake_every)
        return 0;
    self->since_wake = 0;
    self->wake_at = self->run_bytes + self->wake_bytes; /* not again until another wake_bytes is laid */
    if (kvi_seal(self) < 0)
        return -1;
    PyObject *res = PyObject_CallNoArgs(self->wake);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* recquery.c's kind of op's record when it is laid encoded (``encode``, ``kinds``), else -1. */
static int
kind_of(JournalCore *self, PyObject *op)
{
    if (!self->encode || self->kinds == NULL || !PyBytes_Check(self->kinds) || !PyLong_CheckExact(op))
        return -1;
    long code = PyLong_AsLong(op);
    if (code < 0 || code >= PyBytes_GET_SIZE(self->kinds)) {
        PyErr_Clear();
        return -1;
    }
    return (int)((unsigned char *)PyBytes_AS_STRING(self->kinds))[code] - 1;
}

/* The record of the call ``op(*cargs)`` that returned ``r`` (``encode``, of an op
 * ``kinds`` names), its clock readings from ``base``, encoded and laid in the open run on
 * the calling thread, as applies are: 1 laid; 0 not (no room: dropped, the journal
 * overflowed; or queued as a tuple for the writer, as before); -1 error set.
 *
 * Why here and not on the writer: the writer encoded with the GIL held, ~2.5-7 us a
 * query's record and ~1.6 us more to free its objects, cold from the queue, and a
 * request that wanted the GIL meanwhile waited for the writer's next hand-over: with many
 * queries a second the service's /query and /v1/route p99 were +22-33% while recorded
 * (bench_record.py --service). Here the answer is warm, its objects are freed with the
 * caller's, the keys are the ones the query hashed (the key memo, core.h), and the
 * writer frames and writes the run without the GIL (recframe.c's frame_run), as it does
 * applies. Nothing is made for it but its body: not the journal's tuple of the call nor
 * a float per clock reading (~2k instructions of a ~35k match_plain), and the frame's
 * checksum is the writer's. Holding the answer instead (references laid in the run, the
 * body encoded by the writer without the GIL: the answer is tuples of numbers and strings)
 * was tried and was slower: the answer's objects were freed a run later, cold, ~1.5 us a
 * match, and the objects allocated with none freed for a run set off the cyclic collector.
 * The small records (a route's end, a count) go in the run too: each one queued apart
 * would seal the run the queries fill. A shape the compiled encoder leaves to Python, or
 * an error while encoding (cleared), leaves the record to the writer. */
static int
encoded(JournalCore *self, PyObject *op, PyObject *cargs, PyObject *r, Py_ssize_t base, int *room_)
{
    int kind = self->raised == NULL ? -1 : kind_of(self, op);
    if (kind < 0)
        return 0;
    if ((*room_ = has_room(self)) <= 0)
        return *room_;
    KviCall c = {op, cargs, r, NULL, NULL, kvi_wall_now(), self->times + base, self->nt - base};
    int laid = kvi_lay_record(self, &c, kind);
    if (laid < 0) {
        PyErr_Clear();
        return 0;
    }
    return laid;
}

/* Queue the call ``op(*cargs)`` that returned ``r`` (NULL: it raised, the error set) with
 * the clock readings from ``base``; returns ``r`` (a new reference) or NULL. */
static PyObject *
queue_call(JournalCore *self, PyObject *op, PyObject *cargs, PyObject *r, Py_ssize_t base)
{
    if (r != NULL) {
        int room_ = 1, laid = encoded(self, op, cargs, r, base, &room_);
        if (laid != 0 || room_ == 0) { /* laid (or an error), or no room: not queued */
            /* Counted as records, not bytes: the writer writes a thousand queries' records
             * while their run's buffer is still one of the kept ones, not a second later
             * from fresh mappings faulted in on the queries' thread. */
            self->nt = base;
            if (laid < 0 || room_ < 0 || (laid > 0 && counted(self, 0) < 0))
                Py_CLEAR(r);
            return r;
        }
    }
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
    double wall = kvi_wall_now();
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
    int room_ = has_room(self);
    if (room_ <= 0) {
        Py_DECREF(times);
        if (room_ < 0)
            Py_CLEAR(r);
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
    /* Queued apart, for the writer: with encode, its place laid in the run (which goes on
     * filling); else after the run, sealed. */
    if (self->encode ? kvi_lay_apart(self) < 0 : kvi_seal(self) < 0) {
        Py_DECREF(rec);
        Py_DECREF(r);
        return NULL;
    }
    untrack_values(self, cargs);
    untrack_values(self, r);
    PyObject_GC_UnTrack(rec); /* holds a cycle only if its args or result do: they stay tracked then */
    PyObject *res = PyObject_CallOneArg(self->encode ? self->apart_append : self->append, rec);
    Py_DECREF(rec);
    if (res == NULL || counted(self, 0) < 0) {
        Py_XDECREF(res);
        Py_DECREF(r);
        return NULL;
    }
    Py_DECREF(res);
    return r;
}

static PyObject *
jc_run(JournalCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "run(op, fn, args: tuple)");
        return NULL;
    }
    Py_ssize_t base = self->nt;
    char prev = self->active;
    self->active = 1;
    int memo = self->encode && self->strip && !kvi_key_memo.armed; /* the keys the query makes, for encoded() */
    if (memo)
        kvi_key_memo_arm(1);
    PyObject *r = PyObject_Call(args[1], args[2], NULL);
    self->active = prev;
    r = queue_call(self, args[0], args[2], r, base);
    if (memo)
        kvi_key_memo_arm(0);
    return r;
}

static PyObject *
jc_run_apply(JournalCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !PyLong_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run_apply(op: int, fn, engine, payload, model, dp_rank, seq, decide)");
        return NULL;
    }
    long op = PyLong_AsLong(args[0]);
    Py_ssize_t base = self->nt;
    char prev = self->active;
    self->active = 1;
    KeySink *ks = &kvi_sink;
    int sink = self->strip && ks->owner == NULL;
    if (sink) { /* opened for this thread: what the apply knows of the batch (core.h) */
        ks->owner = PyThreadState_Get();
        ks->seed = (uint64_t)self->seed;
        sink_reset(ks);
    }
    PyObject *r = PyObject_Vectorcall(args[1], args + 2, 6, NULL);
    self->active = prev;
    if (sink)
        ks->owner = NULL; /* what it noted is read by lay_apply next, the GIL held all along */
    if (r != NULL && (op == 1 || op == 2)) { /* the journal's APPLY and APPLY_SEQUENCED */
        int room_ = has_room(self);
        int laid = room_ > 0 ? kvi_lay_apply(self, op, args + 2, r, base, sink) : room_;
        if (laid != 0) {
            self->nt = base;
            if (laid < 0 || counted(self, 1) < 0) {
                Py_DECREF(r);
                return NULL;
            }
            return r;
        }
        if (!room_) {
            self->nt = base;
            return r;
        }
    }
    PyObject *cargs = PyTuple_New(6); /* raised, or of another shape: queued as run() queues */
    if (cargs == NULL) {
        Py_XDECREF(r);
        self->nt = base;
        return NULL;
    }
    for (int i = 0; i < 6; i++)
        PyTuple_SET_ITEM(cargs, i, Py_NewRef(args[2 + i]));
    PyObject *res = queue_call(self, args[0], cargs, r, base);
    Py_DECREF(cargs);
    return res;
}

static PyObject *
jc_stock(JournalCore *self, PyObject *arg)
{
    Py_ssize_t bytes = PyLong_AsSsize_t(arg);
    if ((bytes == -1 && PyErr_Occurred()) || kvi_journal_stock(self, bytes) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
jc_seal(JournalCore *self, PyObject *Py_UNUSED(ignored))
{
    if (kvi_seal(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
jc_pending(JournalCore *self, void *Py_UNUSED(closure))
{
    Py_ssize_t n = pending(self);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyGetSetDef jc_getset[] = {
    {"pending", (getter)jc_pending, NULL, "records queued and not written yet (each apply of a run counted)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef jc_methods[] = {
    {"run", (PyCFunction)(void (*)(void))jc_run, METH_FASTCALL,
     "run(op, fn, args) -> fn(*args), the call queued with its result and clock readings (the caller holds the index lock)."},
    {"run_apply", (PyCFunction)(void (*)(void))jc_run_apply, METH_FASTCALL,
     "run_apply(op, fn, engine, payload, model, dp_rank, seq, decide) -> fn(engine, ..., decide), laid in the open run."},
    {"seal", (PyCFunction)jc_seal, METH_NOARGS, "Queue the open run (what was applied so far), if any."},
    {"stock", (PyCFunction)jc_stock, METH_O,
     "stock(bytes): keep buffers for runs holding that many bytes, made and touched now (0: none, freed)."},
    {"clock", (PyCFunction)jc_clock, METH_NOARGS, "The index's clock while recording: a reading inside a run is noted."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef jc_members[] = {
    {"records", T_OBJECT, offsetof(JournalCore, records), READONLY, "the queue (a deque) the writer takes from"},
    {"apart", T_OBJECT, offsetof(JournalCore, apart), READONLY,
     "with encode: the calls' records queued apart (a deque), each in its place in a run (None there)"},
    {"raw", T_OBJECT, offsetof(JournalCore, raw), READONLY, "the index's own clock"},
    {"wake", T_OBJECT, offsetof(JournalCore, wake), 0, "called every wake_every records queued (or None)"},
    {"wake_every", T_PYSSIZET, offsetof(JournalCore, wake_every), 0, "records between two calls of wake"},
    {"wake_bytes", T_PYSSIZET, offsetof(JournalCore, wake_bytes), 0,
     "and wake is called when the runs not written yet hold this many bytes"},
    {"run_bytes", T_PYSSIZET, offsetof(JournalCore, run_bytes), READONLY, "bytes the runs not written yet hold"},
    {"values", T_OBJECT, offsetof(JournalCore, values), 0,
     "a frozenset of types a record's values may be instances of and still be untracked (or None)"},
    {"max_pending", T_PYSSIZET, offsetof(JournalCore, max_pending), 0, "records queued at most"},
    {"active", T_BOOL, offsetof(JournalCore, active), 0, "a journaled call is running"},
    {"overflowed", T_BOOL, offsetof(JournalCore, overflowed), 0, "the writer fell max_pending records behind"},
    {"strip", T_BOOL, offsetof(JournalCore, strip), 0,
     "lay plain GPU stores with their block keys in place of their token ids (hashed mode)"},
    {"seed", T_ULONGLONG, offsetof(JournalCore, seed), 0, "the block keys' seed (with strip)"},
    {"encode", T_BOOL, offsetof(JournalCore, encode), 0,
     "lay the records of the ops kinds names encoded, on the calling thread (prompts as strip says)"},
    {"raised", T_OBJECT, offsetof(JournalCore, raised), 0, "journal.Raised, for the encoder (with encode)"},
    {"kinds", T_OBJECT, offsetof(JournalCore, kinds), 0,
     "bytes: kinds[op] - 1 is the encoder's kind of op's record, laid encoded (0: the writer's)"},
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
    .tp_getset = jc_getset,
    .tp_init = (initproc)jc_init,
    .tp_new = PyType_GenericNew,
};
