/* events.c: vLLM's KV-cache events (msgpack) read with no Python object per block or
 * token: a msgpack reader, tokens_from_msgpack (an event's token_ids array as
 * little-endian uint32 bytes) and scan_gpu_batch (a batch of plain GPU stores in one
 * pass). Both return None for any other shape, so wire.decode_batch's typed decoder
 * decides and says what is wrong. */
#include "core.h"

/* A msgpack reader over [p, end): each rd_* consumes one value of its kind and
 * returns 1, or returns 0 and consumes nothing when the next value is another kind
 * (or truncated). */
typedef struct {
    const unsigned char *p, *end;
} Rd;

static int
rd_len(Rd *r, unsigned char fix_lo, unsigned char fix_hi, unsigned char c16, unsigned char c32, uint32_t *n)
{
    if (r->p >= r->end)
        return 0;
    unsigned char c = *r->p;
    if (c >= fix_lo && c <= fix_hi) {
        *n = c & (fix_hi - fix_lo);
        r->p += 1;
        return 1;
    }
    if (c == c16 && r->end - r->p >= 3) {
        *n = (uint32_t)be(r->p + 1, 2);
        r->p += 3;
        return 1;
    }
    if (c == c32 && r->end - r->p >= 5) {
        *n = (uint32_t)be(r->p + 1, 4);
        r->p += 5;
        return 1;
    }
    return 0;
}

static int
rd_nil(Rd *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

static int
rd_str(Rd *r, const char **s, uint32_t *n)
{
    Rd save = *r;
    if (r->p < r->end && *r->p == 0xd9 && r->end - r->p >= 2) { /* str8 */
        *n = r->p[1];
        r->p += 2;
    }
    else if (!rd_len(r, 0xa0, 0xbf, 0xda, 0xdb, n))
        return 0;
    if ((uint64_t)(r->end - r->p) < *n) {
        *r = save;
        return 0;
    }
    *s = (const char *)r->p;
    r->p += *n;
    return 1;
}

/* An integer of any msgpack encoding; *neg set for a negative one (then *v is its
 * two's complement as int64). */
static int
rd_int(Rd *r, uint64_t *v, int *neg)
{
    if (r->p >= r->end)
        return 0;
    unsigned char c = *r->p;
    *neg = 0;
    if (c <= 0x7f) {
        *v = c;
        r->p += 1;
        return 1;
    }
    if (c >= 0xe0) { /* negative fixint */
        *v = (uint64_t)(int64_t)(int8_t)c;
        *neg = 1;
        r->p += 1;
        return 1;
    }
    if (c >= 0xcc && c <= 0xcf) {
        int w = 1 << (c - 0xcc);
        if (r->end - r->p < 1 + w)
            return 0;
        /* Constant widths, so each read compiles to a load and a byte swap: an event's
         * block hashes are uint64 (0xcf), its token ids mostly uint16 (0xcd). */
        const unsigned char *q = r->p + 1;
        *v = w == 8 ? be(q, 8) : w == 2 ? be(q, 2) : w == 4 ? be(q, 4) : be(q, 1);
        r->p += 1 + w;
        return 1;
    }
    if (c >= 0xd0 && c <= 0xd3) {
        int w = 1 << (c - 0xd0);
        if (r->end - r->p < 1 + w)
            return 0;
        uint64_t u = be(r->p + 1, w);
        int shift = 64 - 8 * w;
        int64_t sv = shift ? (int64_t)(u << shift) >> shift : (int64_t)u;
        *v = (uint64_t)sv;
        *neg = sv < 0;
        r->p += 1 + w;
        return 1;
    }
    return 0;
}

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
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(b);
    const unsigned char *p = r->p, *end = r->end;
    uint32_t i = 0;
    while (i < n) {
        /* The two shapes a vLLM token id takes (a positive fixint below 128, a uint16
         * above) read inline: ~1,000 per event, the decode's hottest loop; four uint16
         * in a row (the common run) in one step. Anything else through rd_int, which
         * also refuses what is not a uint32. */
        unsigned char *q = o + (size_t)i * 4;
        if (n - i >= 4 && end - p >= 12 && p[0] == 0xcd && p[3] == 0xcd && p[6] == 0xcd && p[9] == 0xcd) {
            put_le32(q, (uint32_t)be(p + 1, 2));
            put_le32(q + 4, (uint32_t)be(p + 4, 2));
            put_le32(q + 8, (uint32_t)be(p + 7, 2));
            put_le32(q + 12, (uint32_t)be(p + 10, 2));
            p += 12;
            i += 4;
            continue;
        }
        uint32_t t;
        if (p < end && *p < 0x80)
            t = *p++;
        else if (end - p >= 3 && *p == 0xcd) {
            t = (uint32_t)be(p + 1, 2);
            p += 3;
        }
        else {
            uint64_t v;
            int neg;
            r->p = p;
            if (!rd_int(r, &v, &neg) || neg || v > 0xffffffffULL) {
                Py_DECREF(b);
                return 0;
            }
            p = r->p;
            t = (uint32_t)v;
        }
        put_le32(q, t);
        i++;
    }
    r->p = p;
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

static int
str_is(const char *s, uint32_t n, const char *lit)
{
    size_t m = strlen(lit);
    return n == m && memcmp(s, lit, m) == 0;
}

enum {
    K_TYPE = 1 << 0, K_HASHES = 1 << 1, K_PARENT = 1 << 2, K_TOKENS = 1 << 3, K_BS = 1 << 4, K_LORA_ID = 1 << 5,
    K_MEDIUM = 1 << 6, K_LORA_NAME = 1 << 7, K_EXTRA = 1 << 8, K_GROUP = 1 << 9, K_KIND = 1 << 10,
    K_SWA = 1 << 11, K_LOCALITY = 1 << 12, K_OWNERSHIP = 1 << 13, K_SESSION = 1 << 14, K_LOOKAHEAD = 1 << 15,
};

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
        unsigned bitv;
        if (str_is(k, kl, "type"))
            bitv = K_TYPE;
        else if (str_is(k, kl, "block_hashes"))
            bitv = K_HASHES;
        else if (str_is(k, kl, "parent_block_hash"))
            bitv = K_PARENT;
        else if (str_is(k, kl, "token_ids"))
            bitv = K_TOKENS;
        else if (str_is(k, kl, "block_size"))
            bitv = K_BS;
        else if (str_is(k, kl, "lora_id"))
            bitv = K_LORA_ID;
        else if (str_is(k, kl, "medium"))
            bitv = K_MEDIUM;
        else if (str_is(k, kl, "lora_name"))
            bitv = K_LORA_NAME;
        else if (str_is(k, kl, "extra_keys"))
            bitv = K_EXTRA;
        else if (str_is(k, kl, "group_idx"))
            bitv = K_GROUP;
        else if (str_is(k, kl, "kv_cache_spec_kind"))
            bitv = K_KIND;
        else if (str_is(k, kl, "kv_cache_spec_sliding_window"))
            bitv = K_SWA;
        else if (str_is(k, kl, "locality"))
            bitv = K_LOCALITY;
        else if (str_is(k, kl, "ownership"))
            bitv = K_OWNERSHIP;
        else if (str_is(k, kl, "session_id"))
            bitv = K_SESSION;
        else if (str_is(k, kl, "lookahead_token_ids"))
            bitv = K_LOOKAHEAD;
        else
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
    unsigned char c = *r.p;
    if (c == 0xcb && r.end - r.p >= 9) {
        uint64_t u = be(r.p + 1, 8);
        memcpy(&ts, &u, 8);
        r.p += 9;
    }
    else if (c == 0xca && r.end - r.p >= 5) {
        uint32_t u = (uint32_t)be(r.p + 1, 4);
        float fl;
        memcpy(&fl, &u, 4);
        ts = fl;
        r.p += 5;
    }
    else {
        uint64_t v;
        int neg;
        if (!rd_int(&r, &v, &neg))
            goto none;
        ts = neg ? (double)(int64_t)v : (double)v;
    }
    if (!(ts - ts == 0.0)) /* NaN or infinite: decode_batch refuses the batch */
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
