/* events.c: vLLM's KV-cache events (msgpack) read with no Python object per block or
 * token: a msgpack reader, tokens_from_msgpack (an event's token_ids array as
 * little-endian uint32 bytes) and scan_gpu_batch (a batch of plain GPU stores in one
 * pass). Both return None for any other shape, so wire.decode_batch's typed decoder
 * decides and says what is wrong. */
#include "core.h"
#include "reader.h"

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
    if (!rd_token_values(r, (unsigned char *)PyBytes_AS_STRING(b), n)) {
        Py_DECREF(b);
        return 0;
    }
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

/* scan_store's sink: each array a new bytes object. */
typedef struct {
    PyObject *col[2]; /* PS_HASHES, PS_TOKENS */
} ScanCols;

static unsigned char *
scan_room(void *ctx, int which, size_t bytes)
{
    ScanCols *c = ctx;
    Py_XSETREF(c->col[which], PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bytes));
    return c->col[which] == NULL ? NULL : (unsigned char *)PyBytes_AS_STRING(c->col[which]);
}

/* A store scanned, noted in the key sink ``ks`` (core.h): 0, or -1 out of memory. */
static int
sink_store(KeySink *ks, const PlainStore *st, const unsigned char *base, const PyObject *tokens)
{
    if (ks->scanned < 0)
        return 0;
    int plain = st->bs >= 2 && st->nblocks <= UINT32_MAX && st->tok_end - base <= UINT32_MAX;
    for (uint32_t i = 0; plain && i < st->kind_n; i++)
        plain = (unsigned char)st->kind[i] < 0x80;
    if (!plain) {
        ks->scanned = -1;
        return 0;
    }
    if (ks->nstores == ks->cap) {
        uint32_t nc = ks->cap ? ks->cap * 2 : 16;
        SinkStore *ns = realloc(ks->stores, nc * sizeof(SinkStore));
        if (ns == NULL)
            return -1;
        ks->stores = ns;
        ks->cap = nc;
    }
    if (ks->nkeys + st->nblocks > ks->kcap) {
        size_t nc = ks->kcap ? ks->kcap : 256;
        while (nc < ks->nkeys + st->nblocks)
            nc *= 2;
        uint64_t *nk = realloc(ks->keys, nc * 8);
        if (nk == NULL)
            return -1;
        ks->keys = nk;
        ks->kcap = nc;
    }
    ks->stores[ks->nstores++] = (SinkStore){(uint32_t)(st->tok_at - base), (uint32_t)(st->tok_end - base),
                                            (uint32_t)st->nblocks, (uint32_t)ks->nkeys, tokens, 0};
    ks->nkeys += st->nblocks;
    return 0;
}

/* One BlockStored map of the plain GPU shape (reader.h's scan_plain_store) as a tuple,
 * NULL with no error set when it is of any other shape, NULL with an error set on a real
 * error (memory). Noted in the key sink ``ks`` when it is open (NULL otherwise). */
static PyObject *
scan_store(Rd *r, const unsigned char *base, KeySink *ks)
{
    const unsigned char *start = r->p;
    ScanCols c = {{NULL, NULL}};
    PlainSink sink = {scan_room, &c};
    PlainStore st;
    PyObject *parent = NULL, *group = NULL, *kind = NULL, *out = NULL;
    if (scan_plain_store(r, &st, &sink) != 1)
        goto done; /* another shape, or out of memory (error set) */
    if ((st.has_parent && (parent = PyLong_FromUnsignedLongLong(st.parent)) == NULL) ||
        (st.has_group && (group = int_obj(st.group, st.group_neg)) == NULL))
        goto done;
    if (st.kind != NULL && (kind = PyUnicode_DecodeUTF8(st.kind, st.kind_n, NULL)) == NULL) {
        PyErr_Clear(); /* not UTF-8: the decoder says so */
        goto done;
    }
    if (ks != NULL && sink_store(ks, &st, base, c.col[PS_TOKENS]) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    out = Py_BuildValue("(OOOKOOnn)", c.col[PS_HASHES], parent ? parent : Py_None, c.col[PS_TOKENS],
                        (unsigned long long)st.bs, group ? group : Py_None, kind ? kind : Py_None,
                        (Py_ssize_t)(start - base), (Py_ssize_t)(r->p - base));
done:
    Py_XDECREF(c.col[PS_HASHES]);
    Py_XDECREF(c.col[PS_TOKENS]);
    Py_XDECREF(parent);
    Py_XDECREF(group);
    Py_XDECREF(kind);
    return out;
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
    KeySink *ks = sink_here();
    if (ks != NULL)
        sink_reset(ks);
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &nb) || (nb != 2 && nb != 3) || r.p >= r.end)
        goto none;
    if (!rd_ts(&r, &ts))
        goto none;
    if (!rd_len(&r, 0x90, 0x9f, 0xdc, 0xdd, &ne) || ne > (uint64_t)(r.end - r.p))
        goto none;
    stores = PyList_New(ne);
    if (stores == NULL)
        goto done;
    for (uint32_t i = 0; i < ne; i++) {
        PyObject *st = scan_store(&r, base, ks);
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
    if (ks != NULL && ks->scanned == 0 && res != NULL)
        ks->scanned = 1;
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

KVI_HIDDEN PyMethodDef kvi_events_methods[] = {
    {"tokens_from_msgpack", (PyCFunction)tokens_from_msgpack, METH_O, tokens_from_msgpack_doc},
    {"scan_gpu_batch", (PyCFunction)scan_gpu_batch, METH_O, scan_gpu_batch_doc},
    {NULL, NULL, 0, NULL},
};
