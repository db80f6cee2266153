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
        unsigned bitv = field_bit(k, kl);
        if (bitv == 0)
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
    if (!rd_ts(&r, &ts))
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

KVI_HIDDEN PyMethodDef kvi_events_methods[] = {
    {"tokens_from_msgpack", (PyCFunction)tokens_from_msgpack, METH_O, tokens_from_msgpack_doc},
    {"scan_gpu_batch", (PyCFunction)scan_gpu_batch, METH_O, scan_gpu_batch_doc},
    {NULL, NULL, 0, NULL},
};
