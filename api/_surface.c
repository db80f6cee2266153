/* api._surface: the HTTP service's wire formats in C, for the service's hot doors.
 * Neither is the index's concern: the index (indexer._native._core) takes token ids
 * and keys and gives matches, whatever body carried them or will carry the answer.
 *
 *   split_tokens_json  a request's JSON body split into its token_ids array (as
 *                      little-endian uint32 bytes, no Python int per token) and its
 *                      other members (verbatim, for the route's typed decoder).
 *   dynamo_answer      Dynamo's /query body (JSON) from a match's WorkerMatch tuples,
 *                      the same bytes msgspec makes of api.dynamo's document.
 *
 * Optional like the core: without it the service runs the pure-Python paths
 * (api/surface.py), with the same answers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "bytes.h" /* indexer/_native/, on this extension's include path */

static PyObject *GPU_NAME; /* "GPU", interned: the core's tier name is this same object */


/* ------------------------------------------------------- a request's token_ids */

static inline int
json_ws(unsigned char c)
{
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

/* The JSON array [first, last] (*first == '[', *last == ']') of integers in
 * [0, 2**32) into `o` as little-endian uint32 (room for (last - first) / 2 + 1
 * tokens); returns how many, or -1 for anything else (signs, fractions,
 * exponents, leading zeros, other values). The closing ']' is neither a digit, a
 * blank nor a comma: it stops every scan, so the loops need no bounds checks.
 * A number's digits are read with no check per digit: nine or fewer cannot pass
 * 2**32, and a longer run is bounded by its length (20 digits can pass 2**64). */
static Py_ssize_t
parse_u32_array(const unsigned char *p, const unsigned char *last, unsigned char *o)
{
    Py_ssize_t n = 0;
    p++;
    while (json_ws(*p))
        p++;
    if (p == last)
        return 0;
    for (;;) {
        const unsigned char *s = p;
        unsigned d = (unsigned)*p - '0';
        if (d > 9)
            return -1;
        uint64_t v = d;
        p++;
        while ((d = (unsigned)*p - '0') <= 9) {
            v = v * 10 + d;
            p++;
        }
        if (p - s > 9 && (p - s > 10 || v > 0xffffffffULL))
            return -1;
        if (*s == '0' && p - s > 1)
            return -1; /* a leading zero is not JSON */
        put_le32(o + n * 4, (uint32_t)v);
        n++;
        while (json_ws(*p))
            p++;
        if (*p == ',') {
            p++;
            while (json_ws(*p))
                p++;
            continue;
        }
        return p == last ? n : -1;
    }
}

/* Past the JSON string at p (*p == '"'), or NULL. */
static const unsigned char *
skip_string(const unsigned char *p, const unsigned char *end)
{
    for (p++; p < end; p++) {
        if (*p == '"')
            return p + 1;
        if (*p == '\\')
            p++;
    }
    return NULL;
}

/* Past the JSON value at p, or NULL. Only finds where it ends (strings, nesting);
 * its content is copied verbatim and validated by the decoder that reads it. */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end)
{
    if (*p == '"')
        return skip_string(p, end);
    if (*p != '[' && *p != '{') { /* a number or a literal */
        const unsigned char *q = p;
        while (q < end && *q != ',' && *q != '}' && *q != ']' && !json_ws(*q))
            q++;
        return q > p ? q : NULL;
    }
    int depth = 0;
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') {
            if ((p = skip_string(p, end)) == NULL)
                return NULL;
            continue;
        }
        if (c == '[' || c == '{')
            depth++;
        else if ((c == ']' || c == '}') && --depth == 0)
            return p + 1;
        p++;
    }
    return NULL;
}

PyDoc_STRVAR(split_tokens_json_doc,
"split_tokens_json(body) -> (rest, tokens) | None\n\n"
"A request body, a JSON object with a \"token_ids\" array of integers in\n"
"[0, 2**32), split in one pass into the object's other members (verbatim, as a\n"
"JSON object, for a typed decoder to read and validate) and the tokens as\n"
"little-endian uint32 bytes, with no Python int per token. None for anything\n"
"else (no such array, an empty one, a value it does not take, escaped keys,\n"
"malformed JSON): the caller's typed decoder then reads the body and says what\n"
"is wrong.");

static PyObject *
split_tokens_json(PyObject *Py_UNUSED(mod), PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf, *end = p + view.len;
    PyObject *rest = NULL, *toks = NULL, *out = NULL;
    Py_ssize_t rn = 0, nt = -1;
    rest = PyBytes_FromStringAndSize(NULL, view.len + 2);
    if (rest == NULL)
        goto done;
    unsigned char *r = (unsigned char *)PyBytes_AS_STRING(rest);
    r[rn++] = '{';
    while (p < end && json_ws(*p))
        p++;
    if (p >= end || *p != '{')
        goto none;
    p++;
    for (;;) {
        while (p < end && json_ws(*p))
            p++;
        if (p >= end || *p != '"')
            goto none;
        const unsigned char *key = p, *kend = skip_string(p, end);
        if (kend == NULL || memchr(key, '\\', (size_t)(kend - key)) != NULL)
            goto none;
        p = kend;
        while (p < end && json_ws(*p))
            p++;
        if (p >= end || *p != ':')
            goto none;
        p++;
        while (p < end && json_ws(*p))
            p++;
        if (p >= end)
            goto none;
        if (kend - key == 11 && memcmp(key, "\"token_ids\"", 11) == 0) {
            if (toks != NULL || *p != '[')
                goto none;
            const unsigned char *close = memchr(p, ']', (size_t)(end - p));
            if (close == NULL)
                goto none;
            toks = PyBytes_FromStringAndSize(NULL, ((close - p) / 2 + 1) * 4);
            if (toks == NULL)
                goto done;
            nt = parse_u32_array(p, close, (unsigned char *)PyBytes_AS_STRING(toks));
            if (nt <= 0)
                goto none;
            p = close + 1;
        }
        else {
            const unsigned char *vend = skip_value(p, end);
            if (vend == NULL)
                goto none;
            if (rn > 1)
                r[rn++] = ',';
            memcpy(r + rn, key, (size_t)(kend - key));
            rn += kend - key;
            r[rn++] = ':';
            memcpy(r + rn, p, (size_t)(vend - p));
            rn += vend - p;
            p = vend;
        }
        while (p < end && json_ws(*p))
            p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') {
            p++;
            break;
        }
        goto none;
    }
    while (p < end && json_ws(*p))
        p++;
    if (p != end || toks == NULL)
        goto none;
    r[rn++] = '}';
    /* On failure _PyBytes_Resize frees the object and sets the pointer to NULL. */
    if (_PyBytes_Resize(&rest, rn) < 0 || _PyBytes_Resize(&toks, nt * 4) < 0)
        goto done;
    out = PyTuple_Pack(2, rest, toks);
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(rest);
    Py_XDECREF(toks);
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------- Dynamo's /query body */

/* Col and col_room (a growable byte buffer), and put_le32: the core's bytes.h. */

static int
col_put(Col *c, const char *s, size_t n)
{
    if (col_room(c, n) < 0)
        return -1;
    memcpy(c->buf + c->len, s, n);
    c->len += n;
    return 0;
}

/* A decimal integer, as "%lld" writes it: snprintf costs ~100 ns a call through
 * libc's format machinery, and a /query answer writes ~6 integers per worker. */
static int
col_int(Col *c, long long v)
{
    char t[24];
    char *e = t + sizeof t, *s = e;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--s = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--s = '-';
    return col_put(c, s, (size_t)(e - s));
}

/* A str as a JSON string, escaped as msgspec escapes it: " and \, \b \f \n \r \t, other
 * control characters as \u00XX; everything else (DEL, non-ASCII) as its UTF-8 bytes. */
static int
col_str(Col *c, PyObject *s)
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL || col_room(c, (size_t)n * 6 + 2) < 0)
        return -1;
    unsigned char *o = c->buf + c->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)u[i];
        if (ch >= 0x20 && ch != '"' && ch != '\\') {
            *o++ = ch;
            continue;
        }
        *o++ = '\\';
        switch (ch) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        default:
            o += sprintf((char *)o, "u%04x", ch);
        }
    }
    *o++ = '"';
    c->len = (size_t)(o - c->buf);
    return 0;
}

/* One worker's figures, and the instance (engine) it belongs to. */
typedef struct {
    long long total, gpu, cpu, dp;
    Py_ssize_t inst, next; /* next worker of the same instance, -1 at the end */
} DynW;

typedef struct {
    PyObject *eid; /* borrowed from the workers */
    long long longest, gpu, cpu, disk;
    Py_ssize_t head, tail; /* its workers, in order */
    int scored;            /* has a worker with GPU tokens */
} DynI;

PyDoc_STRVAR(dynamo_answer_doc,
"dynamo_answer(workers, block_size) -> bytes\n\n"
"Dynamo's /query body (JSON) from a match's ranked WorkerMatch tuples: per engine its\n"
"GPU tokens by dp rank ('scores', engines with any), and per engine longest_matched,\n"
"gpu, dp, cpu and disk (the most over its ranks; cpu is the whole match unless STORAGE\n"
"holds part, then at most the CPU prefix). The same bytes as api.dynamo.Dynamo.answer\n"
"encoded by msgspec, its reference.");

static PyObject *
dynamo_answer(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dynamo_answer(workers: list, block_size: int)");
        return NULL;
    }
    long long bs = PyLong_AsLongLong(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    PyObject *ws = args[0];
    Py_ssize_t n = PyList_GET_SIZE(ws), ni = 0;
    DynW *w = PyMem_Malloc(sizeof(DynW) * (size_t)(n ? n : 1));
    DynI *in = PyMem_Malloc(sizeof(DynI) * (size_t)(n ? n : 1));
    Py_ssize_t *sorder = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    PyObject *seen = PyDict_New(), *out = NULL;
    Col c = {NULL, 0, 0};
    Py_ssize_t ns = 0;
    if (w == NULL || in == NULL || sorder == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyList_GET_ITEM(ws, k);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 5 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 2))) {
            PyErr_SetString(PyExc_TypeError, "a worker is a WorkerMatch tuple");
            goto done;
        }
        long long neg = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1));
        long long dp = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3));
        if ((neg == -1 || dp == -1) && PyErr_Occurred())
            goto done;
        long long total = -neg * bs, gpu = 0, cpu_t = 0;
        int storage = 0;
        PyObject *items = PyTuple_GET_ITEM(t, 4);
        if (!PyTuple_Check(items)) {
            PyErr_SetString(PyExc_TypeError, "a worker's tiers are a tuple of (name, blocks)");
            goto done;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(items); j++) {
            PyObject *it = PyTuple_GET_ITEM(items, j);
            if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(it, 0))) {
                PyErr_SetString(PyExc_TypeError, "a worker's tiers are a tuple of (name, blocks)");
                goto done;
            }
            PyObject *name = PyTuple_GET_ITEM(it, 0);
            long long blocks = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 1));
            if (blocks == -1 && PyErr_Occurred())
                goto done;
            if (name == GPU_NAME || PyUnicode_CompareWithASCIIString(name, "GPU") == 0)
                gpu = blocks * bs;
            else if (PyUnicode_CompareWithASCIIString(name, "CPU") == 0)
                cpu_t = blocks * bs;
            else if (PyUnicode_CompareWithASCIIString(name, "STORAGE") == 0)
                storage = 1;
        }
        long long cpu = total;
        if (storage) {
            cpu = cpu_t < total ? cpu_t : total;
            if (gpu > cpu)
                cpu = gpu;
        }
        PyObject *eid = PyTuple_GET_ITEM(t, 2);
        PyObject *idx = PyDict_GetItemWithError(seen, eid);
        Py_ssize_t i;
        if (idx == NULL) {
            if (PyErr_Occurred())
                goto done;
            i = ni++;
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyDict_SetItem(seen, eid, v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
            in[i] = (DynI){eid, total, gpu, cpu, total, k, k, 0};
        }
        else {
            i = PyLong_AsSsize_t(idx);
            DynI *d = &in[i];
            w[d->tail].next = k;
            d->tail = k;
            if (gpu > d->gpu)
                d->gpu = gpu;
            if (cpu > d->cpu)
                d->cpu = cpu;
            if (total > d->disk)
                d->disk = d->longest = total;
        }
        if (gpu && !in[i].scored) {
            in[i].scored = 1;
            sorder[ns++] = i;
        }
        w[k] = (DynW){total, gpu, cpu, dp, i, -1};
    }
    if (col_put(&c, "{\"scores\":{", 11) < 0)
        goto done;
    for (Py_ssize_t s = 0; s < ns; s++) {
        DynI *d = &in[sorder[s]];
        if ((s && col_put(&c, ",", 1) < 0) || col_str(&c, d->eid) < 0 || col_put(&c, ":{", 2) < 0)
            goto done;
        int first = 1;
        for (Py_ssize_t k = d->head; k >= 0; k = w[k].next) {
            if (!w[k].gpu)
                continue;
            if ((!first && col_put(&c, ",", 1) < 0) || col_put(&c, "\"", 1) < 0 || col_int(&c, w[k].dp) < 0 ||
                col_put(&c, "\":", 2) < 0 || col_int(&c, w[k].gpu) < 0)
                goto done;
            first = 0;
        }
        if (col_put(&c, "}", 1) < 0)
            goto done;
    }
    if (col_put(&c, "},\"frequencies\":[],\"instances\":{", 32) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < ni; i++) {
        DynI *d = &in[i];
        if ((i && col_put(&c, ",", 1) < 0) || col_str(&c, d->eid) < 0 || col_put(&c, ":{\"longest_matched\":", 20) < 0 ||
            col_int(&c, d->longest) < 0 || col_put(&c, ",\"gpu\":", 7) < 0 || col_int(&c, d->gpu) < 0 ||
            col_put(&c, ",\"dp\":{", 7) < 0)
            goto done;
        for (Py_ssize_t k = d->head; k >= 0; k = w[k].next) {
            if ((k != d->head && col_put(&c, ",", 1) < 0) || col_put(&c, "\"", 1) < 0 || col_int(&c, w[k].dp) < 0 ||
                col_put(&c, "\":", 2) < 0 || col_int(&c, w[k].gpu) < 0)
                goto done;
        }
        if (col_put(&c, "},\"cpu\":", 8) < 0 || col_int(&c, d->cpu) < 0 || col_put(&c, ",\"disk\":", 8) < 0 ||
            col_int(&c, d->disk) < 0 || col_put(&c, "}", 1) < 0)
            goto done;
    }
    if (col_put(&c, "}}", 2) < 0)
        goto done;
    out = PyBytes_FromStringAndSize((const char *)c.buf, (Py_ssize_t)c.len);
done:
    PyMem_Free(w);
    PyMem_Free(in);
    PyMem_Free(sorder);
    PyMem_Free(c.buf);
    Py_XDECREF(seen);
    return out;
}

static PyMethodDef surface_methods[] = {
    {"dynamo_answer", (PyCFunction)(void (*)(void))dynamo_answer, METH_FASTCALL, dynamo_answer_doc},
    {"split_tokens_json", (PyCFunction)split_tokens_json, METH_O, split_tokens_json_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef surface_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "api._surface",
    .m_doc = "The HTTP service's wire formats in C: a request's JSON token split and Dynamo's /query body.",
    .m_size = -1,
    .m_methods = surface_methods,
};

PyMODINIT_FUNC
PyInit__surface(void)
{
    PyObject *mod = PyModule_Create(&surface_module);
    if (mod == NULL)
        return NULL;
    GPU_NAME = PyUnicode_InternFromString("GPU");
    if (GPU_NAME == NULL) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
