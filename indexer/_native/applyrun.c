/* applyrun.c: ApplyRun, a run of applies a recording journaled, laid out in one buffer
 * of the C allocator's: a head (ARec, core.h) and the bytes of each, with no Python
 * object per batch. Here too: how JournalCore.run_apply (journal.c) lays a batch in the
 * open run (kvi_lay_apply, stripped with the key sink's keys in hashed mode), and the
 * runs' buffers it keeps (kvi_journal_stock, kvi_journal_release).
 *
 * Why: as a tuple of its arguments, result and clock readings, each batch's record made
 * ~8 objects on the thread that applies batches and kept the payload alive until the
 * writer thread took it; the writer then needed the GIL to read every record and to free
 * it. Both threads paid: ingest ran ~15% slower while recorded, ~2 us a batch of it spent
 * in GIL handoffs and the allocator. Laid out here, a batch costs a copy of its payload
 * (freed at once, so the next one reuses warm memory), and the writer frames a whole run
 * without the GIL (recframe.c's frame_run) and takes the GIL once a run.
 *
 * The other journaled calls' records are laid in the run too, already encoded (kvi_lay_body,
 * from recquery.c's kvi_lay_record): the payload is the record's body, which frame_run frames.
 * A record queued apart for the writer to encode has its place here (kvi_lay_apart), so
 * it does not seal the run.
 *
 * From Python a run is a sequence of its records' count: ``len(run)``; ``run.item(i)``
 * is record i as the journal's tuple ``(op, wall, args, result, times)``, for what the
 * compiled framer leaves to the Python encoder (never a record laid stripped, whose
 * payload is already as ``hashed`` mode keeps it: that is the payload it gives), a
 * record's frame (bytes) when it was laid encoded, or None in the place of a record queued
 * apart. */
#include "journal.h"

#include <sys/mman.h>

/* ------------------------------------------------------------------ buffers */

#define HUGE_PAGE ((size_t)2 << 20)

/* A run's buffer of ``cap`` bytes: a mapping of its own, 2 MiB-aligned and asked for
 * in transparent huge pages (MADV_HUGEPAGE: THP's "madvise" mode, a common default),
 * so 4 MiB faults in as 2 pages, not 1,024 of 4 KiB (2-4 us each on this VM, ~4% of a
 * burst's ingest when buffers were made as it needed them). Without THP it is an
 * ordinary mapping. NULL: out of memory. */
KVI_HIDDEN unsigned char *
kvi_run_buf(size_t cap)
{
    if (cap <= SMALL_RUN_MAX)
        return malloc(cap);
    size_t span = cap + HUGE_PAGE;
    unsigned char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uintptr_t at = ((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    unsigned char *buf = (unsigned char *)at;
    size_t head = (size_t)(buf - m), end = (cap + 4095) & ~(size_t)4095;
    if (head)
        munmap(m, head);
    if (span - head > end)
        munmap(buf + end, span - head - end);
#ifdef MADV_HUGEPAGE
    madvise(buf, end, MADV_HUGEPAGE);
#endif
    return buf;
}

KVI_HIDDEN void
kvi_run_buf_free(unsigned char *buf, size_t cap)
{
    if (buf != NULL && cap <= SMALL_RUN_MAX)
        free(buf);
    else if (buf != NULL)
        munmap(buf, (cap + 4095) & ~(size_t)4095);
}

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

/* ------------------------------------------------------------------ laying applies */

KVI_HIDDEN void
kvi_journal_release(PyObject *journal, Py_ssize_t count, size_t len, unsigned char *buf, size_t cap)
{
    JournalCore *self = (JournalCore *)journal;
    self->in_runs -= count;
    self->run_bytes -= (Py_ssize_t)len;
    if (self->wake_at > self->run_bytes + self->wake_bytes)
        self->wake_at = self->run_bytes + self->wake_bytes;
    if (self->open == NULL || self->open->buf != buf) /* a run queued (the open one is dropped unqueued only with the journal) */
        self->sealed--;
    if (buf != NULL && self->nspare < self->keep && cap == RUN_BYTES)
        self->spare[self->nspare++] = buf;
    else
        kvi_run_buf_free(buf, cap);
}

/* The open run, with room for ``need`` more bytes (the one before queued if it has
 * not), or NULL with an error set. */
static ApplyRun *
open_run(JournalCore *self, size_t need)
{
    ApplyRun *run = self->open;
    if (run != NULL && run->len + need > run->cap) {
        size_t want = run->len + need, cap = 2 * run->cap > want ? 2 * run->cap : want;
        if (run->cap < SMALL_RUN_MAX && want <= SMALL_RUN_MAX) { /* a small run grows */
            cap = cap < SMALL_RUN_MAX ? cap : SMALL_RUN_MAX;
            unsigned char *nb = realloc(run->buf, cap);
            if (nb == NULL) {
                PyErr_NoMemory();
                return NULL;
            }
            run->buf = nb;
            run->cap = cap;
            return run;
        }
        if (kvi_seal(self) < 0)
            return NULL;
        self->burst = 1;
    }
    run = self->open;
    if (run == NULL) {
        run = PyObject_GC_New(ApplyRun, &kvi_ApplyRunType);
        if (run == NULL)
            return NULL;
        /* A kept buffer; else one in huge pages while runs fill up (a burst); else a small
         * one that grows: a run sealed after a record or two (a record queued apart is
         * queued after the open run) cost a 4 MiB mapping and its first fault, ~0.2 ms. */
        size_t cap = need > RUN_BYTES ? need : RUN_BYTES;
        if (cap == RUN_BYTES && self->nspare == 0 && !self->burst)
            cap = need > SMALL_RUN ? need : SMALL_RUN;
        unsigned char *buf = cap == RUN_BYTES && self->nspare > 0 ? self->spare[--self->nspare] : kvi_run_buf(cap);
        if (buf == NULL) {
            PyObject_GC_Del(run);
            PyErr_NoMemory();
            return NULL;
        }
        Py_INCREF(self);
        run->journal = (PyObject *)self;
        run->buf = buf;
        run->cap = cap;
        run->len = 0;
        run->count = run->at_i = run->answers = 0;
        run->at_off = 0;
        PyObject_GC_Track(run);
        self->open = run;
    }
    return run;
}

/* An int that fits int64, or None: 1 (``*has`` says which); 0 anything else. */
static int
opt_i64(PyObject *o, int64_t *v, uint8_t *has)
{
    *has = o != Py_None;
    if (!*has)
        return 1;
    if (!PyLong_CheckExact(o))
        return 0;
    int of;
    *v = PyLong_AsLongLongAndOverflow(o, &of);
    if (*v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !of;
}

static size_t
pad8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

/* A record of ``need`` bytes written at the end of the open ``run``: counted in it and in
 * its journal. */
static void
laid(JournalCore *self, ApplyRun *run, size_t need)
{
    run->len += need;
    self->run_bytes += (Py_ssize_t)need;
    run->count++;
    self->in_runs++;
}

/* The apply whose arguments are ``a`` (engine, payload, model, dp_rank, seq, decide) and
 * result ``r`` laid in the open run (``sink``: this call opened the key sink, stripped
 * when it holds every store's keys): 1; 0 not of the shape a run holds (the caller
 * queues it as a tuple); -1 out of memory. */
KVI_HIDDEN int
kvi_lay_apply(JournalCore *self, long op, PyObject *const *a, PyObject *r, Py_ssize_t base, int sink)
{
    if (!PyUnicode_CheckExact(a[0]) || !PyBytes_CheckExact(a[1]) || !PyUnicode_CheckExact(a[2]) ||
        !PyBool_Check(a[5]) || !PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 2)
        return 0;
    PyObject *outcome = PyTuple_GET_ITEM(r, 0), *ts = PyTuple_GET_ITEM(r, 1);
    if (!PyUnicode_CheckExact(outcome) || !(ts == Py_None || PyFloat_CheckExact(ts)))
        return 0;
    ARec h;
    memset(&h, 0, sizeof h);
    if (!opt_i64(a[3], &h.dp_rank, &h.has_rank) || !opt_i64(a[4], &h.seq, &h.has_seq))
        return 0;
    Py_ssize_t en, mn, on;
    const char *engine = PyUnicode_AsUTF8AndSize(a[0], &en), *model = PyUnicode_AsUTF8AndSize(a[2], &mn),
               *out = PyUnicode_AsUTF8AndSize(outcome, &on);
    if (engine == NULL || model == NULL || out == NULL) {
        PyErr_Clear(); /* a lone surrogate: the tuple's encoder says what it says */
        return 0;
    }
    size_t pn = (size_t)PyBytes_GET_SIZE(a[1]), nt = (size_t)(self->nt - base);
    /* Stripped (the key sink, core.h): each store's token_ids value (a msgpack array)
     * becomes a bin of its keys, 8 bytes a block, as recprivacy.strip_payload makes it. */
    KeySink *ks = &kvi_sink;
    int stripped = sink && ks->scanned == 1 && ks->nstores > 0;
    for (uint32_t i = 0; stripped && i < ks->nstores; i++)
        stripped = ks->stores[i].keyed;
    if (stripped) {
        for (uint32_t i = 0; i < ks->nstores; i++) {
            size_t kb = (size_t)ks->stores[i].nblocks * 8;
            pn = pn - (ks->stores[i].tok_end - ks->stores[i].tok_at) + put_bin_head(NULL, kb) + kb;
        }
    }
    size_t need = pad8(sizeof(ARec) + nt * 8 + (size_t)en + (size_t)mn + (size_t)on + pn);
    if (need > UINT32_MAX)
        return 0;
    ApplyRun *run = open_run(self, need);
    if (run == NULL)
        return -1;
    h.size = (uint32_t)need;
    h.op = (uint8_t)op;
    h.decide = a[5] == Py_True;
    h.has_ts = ts != Py_None;
    h.ts = h.has_ts ? PyFloat_AS_DOUBLE(ts) : 0.0;
    h.wall = kvi_wall_now();
    h.nt = (uint32_t)nt;
    h.engine_n = (uint32_t)en;
    h.model_n = (uint32_t)mn;
    h.outcome_n = (uint32_t)on;
    h.payload_n = pn;
    h.stripped = (uint8_t)stripped;
    unsigned char *p = run->buf + run->len;
    memcpy(p, &h, sizeof h);
    p += sizeof h;
    memcpy(p, self->times + base, nt * 8);
    p += nt * 8;
    memcpy(p, engine, (size_t)en);
    p += en;
    memcpy(p, model, (size_t)mn);
    p += mn;
    memcpy(p, out, (size_t)on);
    p += on;
    const unsigned char *src = (const unsigned char *)PyBytes_AS_STRING(a[1]);
    if (!stripped)
        memcpy(p, src, pn);
    else {
        size_t from = 0;
        for (uint32_t i = 0; i < ks->nstores; i++) {
            const SinkStore *ss = &ks->stores[i];
            size_t kb = (size_t)ss->nblocks * 8;
            memcpy(p, src + from, ss->tok_at - from);
            p += ss->tok_at - from;
            p += put_bin_head(p, kb);
            for (uint32_t k = 0; k < ss->nblocks; k++, p += 8)
                put_le64(p, ks->keys[ss->keys_at + k]);
            from = ss->tok_end;
        }
        memcpy(p, src + from, (size_t)PyBytes_GET_SIZE(a[1]) - from);
    }
    laid(self, run, need);
    return 1;
}

/* A record with no fields but ``op`` and ``n`` bytes of payload laid in the open run: 1,
 * or -1 with an error set. */
static int
lay_bare(JournalCore *self, uint8_t op, const unsigned char *payload, size_t n, int answer)
{
    size_t need = pad8(sizeof(ARec) + n);
    ApplyRun *run = need <= UINT32_MAX ? open_run(self, need) : NULL;
    if (run == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    ARec h;
    memset(&h, 0, sizeof h);
    h.size = (uint32_t)need;
    h.op = op;
    h.payload_n = n;
    memcpy(run->buf + run->len, &h, sizeof h);
    if (n)
        memcpy(run->buf + run->len + sizeof h, payload, n);
    run->answers += answer;
    laid(self, run, need);
    return 1;
}

KVI_HIDDEN int
kvi_lay_body(JournalCore *self, const unsigned char *body, size_t n, int answer)
{
    return lay_bare(self, AREC_ENCODED, body, n, answer);
}

KVI_HIDDEN int
kvi_lay_apart(JournalCore *self)
{
    return lay_bare(self, AREC_APART, NULL, 0, 0);
}

KVI_HIDDEN int
kvi_journal_stock(JournalCore *self, Py_ssize_t bytes)
{
    Py_ssize_t n = bytes <= 0 ? 0 : (bytes + RUN_BYTES - 1) / RUN_BYTES;
    self->keep = n > SPARE_MAX ? SPARE_MAX : (int)n;
    while (self->nspare > self->keep) /* 0: the recording ended, its buffers go */
        kvi_run_buf_free(self->spare[--self->nspare], RUN_BYTES);
    while (self->nspare < self->keep) {
        unsigned char *buf = kvi_run_buf(RUN_BYTES);
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(buf, 0xA5, RUN_BYTES); /* each page faulted in now */
        self->spare[self->nspare++] = buf;
    }
    return 0;
}

/* ------------------------------------------------------------------ the type */

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
        kvi_run_buf_free(self->buf, self->cap);
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
    if (r->op == AREC_ENCODED) { /* framed as recfile.frame frames it: length, checksum, body */
        size_t n = (size_t)r->payload_n;
        PyObject *f = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 + n));
        if (f != NULL) {
            unsigned char *p = (unsigned char *)PyBytes_AS_STRING(f);
            put_frame_head(p, AREC_PAYLOAD(r), n);
            memcpy(p + 8, AREC_PAYLOAD(r), n);
        }
        return f;
    }
    if (r->op == AREC_APART)
        Py_RETURN_NONE;
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

static PyMemberDef ar_members[] = {
    {"answers", T_PYSSIZET, offsetof(ApplyRun, answers), READONLY, "the queries' answers among the records laid encoded"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef ar_methods[] = {
    {"item", (PyCFunction)ar_item, METH_O,
     "item(i) -> record i as the journal's tuple (op, wall, args, result, times), or its frame\n"
     "(bytes) when it was laid encoded, or None in the place of the next record queued apart\n"
     "(the journal's ``apart``)."},
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
    .tp_members = ar_members,
    .tp_as_sequence = &ar_as_sequence,
};
