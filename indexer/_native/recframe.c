/* recframe.c: a recording's frames (indexer/ingest/recfile.py: length, checksum,
 * msgpack body) made here, most of it without the GIL.
 *
 * Why: the recording's writer thread shares the GIL with the thread that applies
 * batches and answers queries. In Python, a batch's record (its token ids cut out and
 * hashed to block keys in ``hashed`` mode, the record encoded, framed and checksummed)
 * held the GIL ~6 us for a batch the index applies in ~10: what the writer held, the
 * hot paths waited for. Here the GIL is held only to read each record's fields (a few
 * pointers and numbers); the payload is scanned, its keys hashed, the body encoded,
 * checksummed and written to the segment's file with the GIL released, for a whole run
 * of records at a time.
 *
 *   frame_run(run, start, hashed, seed, fd) -> (next, written)
 *   frame_many(bodies) -> frames
 *
 * A run is the journal's ApplyRun (applyrun.c): applies laid out in one buffer, read
 * here with no GIL at all. An apply's body is what recops.encode_call and encode_result
 * make of the journal's tuple for it, ``[op, wall, times, [engine, payload, model,
 * dp_rank, seq], [outcome, ts]]``, with the payload as recprivacy.strip_payload keeps
 * it: whole, or in ``hashed`` mode each plain GPU store's token_ids replaced by its
 * block keys (uint64 LE bytes, bin). In ``hashed`` mode a batch that is not of the
 * plain GPU shape (the one scan_gpu_batch reads) stops the framing: ``next`` is its
 * index and the caller encodes ``run.item(next)`` in Python. */
#include "mpwrite.h"
#include "reader.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

/* ------------------------------------------------------------------ checksum */

/* A frame's checksum (recfile.py, KVIREC2): the low 32 bits of the body's xxh3-64,
 * seed 0. It was zlib's crc32 (KVIREC1), a quarter of this file's time per batch; xxh3
 * checks a 1.3 KB body ~10x faster, and Python reads it with the xxhash package. */
KVI_HIDDEN uint32_t
kvi_rec_checksum(const unsigned char *p, size_t n)
{
    return (uint32_t)kvi_xxh3_64(p, n, 0);
}

/* ------------------------------------------------------------------ hashed payloads */

/* strip_store's sink: ``ctx`` is the scratch, an Out for each of PS_HASHES, PS_TOKENS. */
static unsigned char *
strip_room(void *ctx, int which, size_t bytes)
{
    Out *c = (Out *)ctx + which;
    c->len = 0;
    return room(c, bytes) ? c->buf : NULL;
}

/* One BlockStored map of the plain GPU shape (reader.h's scan_plain_store, the rule
 * scan_gpu_batch applies; and a block size of at least 2, as recprivacy's _plain_gpu)
 * copied to ``o`` with its token_ids value replaced by the block keys. ``scratch``: two
 * Outs (strip_room). 1 done, 0 another shape, -1 out of memory. */
static int
strip_store(Rd *r, Out *o, Out *scratch, uint64_t seed)
{
    const unsigned char *from = r->p;
    PlainSink sink = {strip_room, scratch};
    PlainStore st;
    int got = scan_plain_store(r, &st, &sink);
    if (got <= 0)
        return got;
    if (st.bs < 2)
        return 0;
    for (uint32_t i = 0; i < st.kind_n; i++)
        if ((unsigned char)st.kind[i] >= 0x80)
            return 0; /* not ASCII: the general path, which checks UTF-8 as the decoder does */
    if (!put(o, from, (size_t)(st.tok_at - from)) || !w_bin_head(o, (size_t)st.nblocks * 8) ||
        !room(o, st.nblocks * 8))
        return -1;
    size_t step = (size_t)st.bs * 4;
    for (uint64_t i = 0; i < st.nblocks; i++) {
        put_le64(o->buf + o->len, kvi_xxh3_64(scratch[PS_TOKENS].buf + i * step, step, seed));
        o->len += 8;
    }
    return put(o, st.tok_end, (size_t)(r->p - st.tok_end)) ? 1 : -1;
}

/* A batch (``[ts, events]`` or ``[ts, events, dp_rank]``) of plain GPU stores, each
 * stripped (strip_store), to ``o``: 1; 0 any other batch; -1 out of memory. */
static int
strip_batch(const unsigned char *p, size_t n, Out *o, Out *scratch, uint64_t seed)
{
    Rd r = {p, p + n};
    uint32_t nb, ne;
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &nb) || (nb != 2 && nb != 3) || r.p >= r.end)
        return 0;
    double ts;
    uint64_t v;
    int neg;
    if (!rd_ts(&r, &ts))
        return 0;
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &ne) || ne > (uint64_t)(r.end - r.p))
        return 0;
    if (!put(o, p, (size_t)(r.p - p)))
        return -1;
    for (uint32_t i = 0; i < ne; i++) {
        int st = strip_store(&r, o, scratch, seed);
        if (st <= 0)
            return st;
    }
    const unsigned char *tail = r.p;
    if (nb == 3 && !rd_nil(&r) && !rd_int(&r, &v, &neg))
        return 0;
    if (r.p != r.end)
        return 0;
    return put(o, tail, (size_t)(r.end - tail)) ? 1 : -1;
}

/* ------------------------------------------------------------------ records */

/* One apply's frame appended to ``out`` (its body written in place after the 8 bytes
 * of length and checksum): 1; 0 the payload is not of the plain shape (hashed mode),
 * ``out`` as it was; -1 out of memory. */
static int
frame_apply(const ARec *a, int hashed, uint64_t seed, Out *out, Out *pl, Out *scratch)
{
    const unsigned char *payload = AREC_PAYLOAD(a);
    size_t payload_n = (size_t)a->payload_n;
    if (a->op == AREC_ENCODED) { /* a record encoded when it was laid: its body, framed here */
        if (!room(out, 8 + payload_n))
            return -1;
        put_frame_head(out->buf + out->len, payload, payload_n);
        out->len += 8;
        return put(out, payload, payload_n) ? 1 : -1;
    }
    if (a->op == AREC_APART) /* a record queued apart: the writer's, in Python */
        return 0;
    if (hashed && !a->stripped) {
        pl->len = 0;
        int st = strip_batch(payload, payload_n, pl, scratch, seed);
        if (st <= 0)
            return st;
        payload = pl->buf;
        payload_n = pl->len;
    }
    size_t at = out->len;
    if (!room(out, 8))
        return -1;
    out->len += 8;
    const double *times = AREC_TIMES(a);
    int ok = w_arr(out, 5) && w_int(out, a->op) && w_f64(out, a->wall) && w_arr(out, a->nt);
    for (uint32_t i = 0; ok && i < a->nt; i++)
        ok = w_f64(out, times[i]);
    ok = ok && w_arr(out, 5) && w_str(out, AREC_ENGINE(a), a->engine_n) && w_bin_head(out, payload_n) &&
         put(out, payload, payload_n) && w_str(out, AREC_MODEL(a), a->model_n) &&
         (a->has_rank ? w_int(out, a->dp_rank) : w_nil(out)) && (a->has_seq ? w_int(out, a->seq) : w_nil(out)) &&
         w_arr(out, 2) && w_str(out, AREC_OUTCOME(a), a->outcome_n) && (a->has_ts ? w_f64(out, a->ts) : w_nil(out));
    if (!ok)
        return -1;
    size_t n = out->len - at - 8;
    put_frame_head(out->buf + at, out->buf + at + 8, n);
    return 1;
}

/* All of ``o`` to ``fd``: 0, or an errno. */
static int
write_all(int fd, Out *o)
{
    size_t done = 0;
    while (done < o->len) {
        ssize_t w = write(fd, o->buf + done, o->len - done);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        done += (size_t)w;
    }
    o->len = 0;
    return 0;
}

/* Frames a run is written in: past this, what is built goes to the file (one buffer
 * of the C allocator's, reused, whatever the run's length). */
#define WRITE_AT (256 * 1024)

PyDoc_STRVAR(frame_run_doc,
"frame_run(run, start, hashed, seed, fd) -> (next, written)\n\n"
"Write to file descriptor ``fd`` the frames of the run's records start..next-1, made\n"
"and written with the GIL released; ``written``: bytes. ``hashed``: each plain GPU\n"
"store's token ids replaced by its block keys (xxh3-64, ``seed``); a record that is not\n"
"of that shape stops it (next < len(run): the caller's, run.item(next)). OSError when\n"
"the write fails (what was written stays: a short frame at the end, which a reader\n"
"reports as damage).");

static PyObject *
frame_run(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !Py_IS_TYPE(args[0], &kvi_ApplyRunType)) {
        PyErr_SetString(PyExc_TypeError, "frame_run(run: ApplyRun, start, hashed, seed, fd)");
        return NULL;
    }
    ApplyRun *run = (ApplyRun *)args[0];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    int hashed = PyObject_IsTrue(args[2]);
    long fdl = PyLong_AsLong(args[4]);
    uint64_t seed;
    if ((start == -1 && PyErr_Occurred()) || hashed < 0 || (fdl == -1 && PyErr_Occurred()))
        return NULL;
    if (fdl < 0 || fdl > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "fd must be an open file descriptor");
        return NULL;
    }
    int fd = (int)fdl;
    if (as_u64(args[3], &seed) <= 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "seed must be in [0, 2**64)");
        return NULL;
    }
    if (start < 0 || start > run->count) {
        PyErr_SetString(PyExc_IndexError, "start out of range");
        return NULL;
    }
    Out out = {0}, pl = {0}, scratch[2] = {{0}};
    Py_ssize_t done = start;
    size_t written = 0;
    int st = 1, err = 0;
    /* The run is queued whole and no longer laid in (journal.c): its buffer does not
     * change, and only this thread moves its cursor. */
    Py_BEGIN_ALLOW_THREADS
    for (; done < run->count; done++) {
        st = frame_apply(kvi_run_rec(run, done), hashed, seed, &out, &pl, scratch);
        if (st <= 0)
            break;
        if (out.len >= WRITE_AT) {
            size_t len = out.len;
            if ((err = write_all(fd, &out)) != 0)
                break;
            written += len;
        }
    }
    if (st >= 0 && err == 0 && out.len) {
        size_t len = out.len;
        if ((err = write_all(fd, &out)) == 0)
            written += len;
    }
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    else if (st < 0)
        PyErr_NoMemory();
    else
        res = Py_BuildValue("(nn)", done, (Py_ssize_t)written);
    free(out.buf);
    free(pl.buf);
    free(scratch[0].buf);
    free(scratch[1].buf);
    return res;
}

PyDoc_STRVAR(frame_many_doc,
"frame_many(bodies) -> bytes\n\n"
"Each body (bytes) framed as recfile.frame frames it (length, checksum, body), all joined.");

static PyObject *
frame_many(PyObject *Py_UNUSED(mod), PyObject *bodies)
{
    if (!PyList_CheckExact(bodies)) {
        PyErr_SetString(PyExc_TypeError, "frame_many(bodies: list[bytes])");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(bodies);
    size_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        if (!PyBytes_CheckExact(b) || PyBytes_GET_SIZE(b) > 0xffffffffLL) {
            PyErr_SetString(PyExc_TypeError, "frame_many: each body must be bytes under 4 GiB");
            return NULL;
        }
        size += 8 + (size_t)PyBytes_GET_SIZE(b);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL)
        return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        size_t len = (size_t)PyBytes_GET_SIZE(b);
        put_frame_head(o, (const unsigned char *)PyBytes_AS_STRING(b), len);
        memcpy(o + 8, PyBytes_AS_STRING(b), len);
        o += 8 + len;
    }
    return out;
}

KVI_HIDDEN PyMethodDef kvi_recframe_methods[] = {
    {"frame_run", (PyCFunction)(void (*)(void))frame_run, METH_FASTCALL, frame_run_doc},
    {"frame_many", (PyCFunction)frame_many, METH_O, frame_many_doc},
    {NULL, NULL, 0, NULL},
};
