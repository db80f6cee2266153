/* rankout.c: a route's ranking (ranking.c) written out, entry by entry, in one of two
 * forms: the entries as objects (dicts, or the caller's struct classes), or the
 * answer's "ranked" array as JSON bytes, the very bytes msgspec makes of those entries.
 *
 * Why JSON here: a fleet's answer lists every candidate (53 KB at 256 workers), and as
 * objects each entry is two structs, a name, two floats, then msgspec walks them all
 * again to encode them; written from the C values, no object is made per candidate.
 * Whatever this writer cannot write exactly as msgspec would (a string to escape, a
 * value of another type) makes it decline, and the caller encodes the objects. */
#include "core.h"
#include <limits.h>
#include <math.h>

/* Keys of an entry and of its "load", interned once: the dicts an answer lists are
 * copies of a template with these keys in the answer's order (a copy of a dict with
 * string keys clones its key table, no insertion and no resize per key). */
static const char *const ENTRY_KEYS[] = {"worker", "engine", "dp_rank", "score", "cached_blocks",
                                         "predicted_blocks", "cost", "stale", "connected", "load"};
static const char *const LOAD_KEYS[] = {"prefill_tokens", "decode_blocks", "source"};
#define N_ENTRY 10
#define N_LOAD 3
static PyObject *entry_keys[N_ENTRY], *load_keys[N_LOAD], *entry_tpl, *load_tpl;
KVI_HIDDEN PyObject *kvi_src_caller, *kvi_src_index;

KVI_HIDDEN int
kvi_rankout_init(void)
{
    if (entry_tpl != NULL)
        return 0;
    PyObject *et = PyDict_New(), *lt = PyDict_New();
    kvi_src_caller = kvi_src_caller ? kvi_src_caller : PyUnicode_InternFromString("caller");
    kvi_src_index = kvi_src_index ? kvi_src_index : PyUnicode_InternFromString("index");
    if (et == NULL || lt == NULL || kvi_src_caller == NULL || kvi_src_index == NULL)
        goto fail;
    for (int i = 0; i < N_ENTRY; i++) {
        if (entry_keys[i] == NULL && (entry_keys[i] = PyUnicode_InternFromString(ENTRY_KEYS[i])) == NULL)
            goto fail;
        if (PyDict_SetItem(et, entry_keys[i], Py_None) < 0)
            goto fail;
    }
    for (int i = 0; i < N_LOAD; i++) {
        if (load_keys[i] == NULL && (load_keys[i] = PyUnicode_InternFromString(LOAD_KEYS[i])) == NULL)
            goto fail;
        if (PyDict_SetItem(lt, load_keys[i], Py_None) < 0)
            goto fail;
    }
    entry_tpl = et;
    load_tpl = lt;
    return 0;
fail:
    Py_XDECREF(et);
    Py_XDECREF(lt);
    return -1;
}

/* ------------------------------------------------------------------ as objects */

/* A dict with `keys` (the template's, in its order) set to `vals`; NULL on error. */
static PyObject *
filled(PyObject *tpl, PyObject *const *keys, PyObject *const *vals, int n)
{
    PyObject *d = PyDict_Copy(tpl);
    if (d == NULL)
        return NULL;
    for (int i = 0; i < n; i++)
        if (PyDict_SetItem(d, keys[i], vals[i]) < 0) {
            Py_DECREF(d);
            return NULL;
        }
    return d;
}

/* Writes r in decimal at p, two digits a step; returns the number of digits. */
static int
put_digits(char *p, unsigned long long r)
{
    static const char pairs[] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                "8081828384858687888990919293949596979899";
    int n = 1;
    for (unsigned long long t = r; t >= 10; t /= 10)
        n++;
    char *q = p + n;
    while (r >= 100) {
        q -= 2;
        memcpy(q, pairs + 2 * (r % 100), 2);
        r /= 100;
    }
    if (r >= 10)
        memcpy(q - 2, pairs + 2 * r, 2);
    else
        q[-1] = (char)('0' + r);
    return n;
}

/* "engine/rank" as f"{engine}/{rank}" makes it. */
KVI_HIDDEN PyObject *
kvi_worker_name(PyObject *engine, PyObject *rank, long long r)
{
    if (r < 0 || !PyUnicode_IS_ASCII(engine))
        return PyUnicode_FromFormat("%U/%S", engine, rank);
    char digits[24];
    int nd = put_digits(digits, (unsigned long long)r);
    Py_ssize_t ne = PyUnicode_GET_LENGTH(engine);
    PyObject *s = PyUnicode_New(ne + 1 + nd, 127);
    if (s == NULL)
        return NULL;
    char *p = (char *)PyUnicode_DATA(s);
    memcpy(p, PyUnicode_DATA(engine), (size_t)ne);
    p[ne] = '/';
    memcpy(p + ne + 1, digits, (size_t)nd);
    return s;
}

/* A float of value v (bit for bit): *last when it is one, else a new one kept in *last.
 * Floats are immutable and a fleet's scores and costs repeat (every worker holding the
 * same prefix, idle): the entries share them. A new reference; NULL on error. */
static PyObject *
same_float(double v, PyObject **last)
{
    if (*last != NULL) {
        double w = PyFloat_AS_DOUBLE(*last);
        if (memcmp(&v, &w, sizeof v) == 0) {
            Py_INCREF(*last);
            return *last;
        }
    }
    PyObject *f = PyFloat_FromDouble(v);
    if (f != NULL) {
        Py_XSETREF(*last, f);
        Py_INCREF(f);
    }
    return f;
}

KVI_HIDDEN void
kvi_shared_clear(KviShared *sh)
{
    Py_CLEAR(sh->last_score);
    Py_CLEAR(sh->last_cost);
    Py_CLEAR(sh->idle_ld);
}

KVI_HIDDEN PyObject *
kvi_rank_entry(const KviCand *c, PyObject *entry_cls, PyObject *load_cls, PyObject *idle, KviShared *sh)
{
    PyObject *name = kvi_worker_name(c->engine, c->rk, c->rank), *score = NULL, *cost = NULL, *cached = NULL;
    PyObject *ld = NULL, *entry = NULL;
    if (name == NULL)
        return NULL;
    if (c->wm != NULL)
        cached = PyNumber_Negative(PyTuple_GET_ITEM(c->wm, 1));
    else
        cached = Py_NewRef(kvi_ZERO);
    if (cached == NULL || (score = same_float(-c->negscore + 0.0, &sh->last_score)) == NULL ||
        (cost = same_float(c->cost, &sh->last_cost)) == NULL)
        goto done;
    PyObject *lvals[N_LOAD] = {c->ld0, c->ld1, c->src};
    /* The struct path's load of an idle worker is shared (frozen); a dict could be
     * changed, so each has its own. */
    int is_idle = c->src == idle && c->ld0 == kvi_ZERO && c->ld1 == kvi_ZERO;
    if (load_cls != NULL && is_idle && sh->idle_ld != NULL) {
        ld = Py_NewRef(sh->idle_ld);
    } else {
        ld = load_cls != NULL ? PyObject_Vectorcall(load_cls, lvals, N_LOAD, NULL)
                              : filled(load_tpl, load_keys, lvals, N_LOAD);
        if (ld != NULL && load_cls != NULL && is_idle)
            sh->idle_ld = Py_NewRef(ld);
    }
    if (ld == NULL)
        goto done;
    PyObject *vals[N_ENTRY] = {name, c->engine, c->rk, score, cached, c->pb, cost, c->st, c->conn, ld};
    entry = entry_cls != NULL ? PyObject_Vectorcall(entry_cls, vals, N_ENTRY, NULL)
                              : filled(entry_tpl, entry_keys, vals, N_ENTRY);
done:
    Py_DECREF(name);
    Py_XDECREF(score);
    Py_XDECREF(cost);
    Py_XDECREF(cached);
    Py_XDECREF(ld);
    return entry;
}

/* --------------------------------------------------------------------- as JSON */

/* A double as msgspec writes it (the shortest digits that read back as it, placed
 * as msgspec's ryu.h format_double places them): "null" when not finite; an integral
 * value below 2**53 as its integer and ".0" (its shortest digits are those of the
 * integer: its neighbours are at most 1 apart); any other from the digits of repr(),
 * which are the same shortest, nearest digits. At most 32 bytes at p; returns how
 * many, or -1 with an exception set. */
static int
put_double(char *p, double v)
{
    if (!isfinite(v)) {
        memcpy(p, "null", 4);
        return 4;
    }
    int n = 0;
    if (signbit(v)) {
        p[n++] = '-';
        v = -v;
    }
    if (v < 9007199254740992.0 && v == floor(v)) {
        n += put_digits(p + n, (unsigned long long)v);
        memcpy(p + n, ".0", 2);
        return n + 2;
    }
    char *r = PyOS_double_to_string(v, 'r', 0, 0, NULL);
    if (r == NULL)
        return -1;
    char dig[24];
    int nd = 0, decpt = 0, point = 0; /* the value is 0.DIG * 10**decpt */
    const char *q = r;
    for (; *q && *q != 'e'; q++) {
        if (*q == '.') {
            point = 1;
        } else if (nd == 0 && *q == '0') {
            decpt -= point; /* a leading zero: after the point it moves the digits right */
        } else if (nd < (int)sizeof dig) {
            dig[nd++] = *q;
            decpt += !point;
        }
    }
    if (*q == 'e')
        decpt += atoi(q + 1);
    PyMem_Free(r);
    while (nd > 1 && dig[nd - 1] == '0')
        nd--;
    int k = decpt - nd; /* the value is DIG * 10**k */
    if (k >= 0 && decpt <= 16) {
        memcpy(p + n, dig, (size_t)nd);
        n += nd;
        memset(p + n, '0', (size_t)k);
        n += k;
        memcpy(p + n, ".0", 2);
        return n + 2;
    }
    if (decpt > 0 && decpt <= 16) {
        memcpy(p + n, dig, (size_t)decpt);
        p[n + decpt] = '.';
        memcpy(p + n + decpt + 1, dig + decpt, (size_t)(nd - decpt));
        return n + nd + 1;
    }
    if (decpt > -5 && decpt <= 0) {
        memcpy(p + n, "0.", 2);
        n += 2;
        memset(p + n, '0', (size_t)-decpt);
        n -= decpt;
        memcpy(p + n, dig, (size_t)nd);
        return n + nd;
    }
    p[n++] = dig[0];
    if (nd > 1) {
        p[n++] = '.';
        memcpy(p + n, dig + 1, (size_t)(nd - 1));
        n += nd - 1;
    }
    p[n++] = 'e';
    int e = decpt - 1;
    if (e < 0) {
        p[n++] = '-';
        e = -e;
    }
    return n + put_digits(p + n, (unsigned long long)e);
}

/* 1: *v is the int `o` (not a bool, within a long long but LLONG_MIN); 0: not such
 * an int (decline); -1: error. */
static int
ll_of(PyObject *o, long long *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (*v == -1 && PyErr_Occurred())
        return -1;
    return !overflow && *v != LLONG_MIN;
}

/* v in decimal at p, as msgspec writes an int; returns how many bytes. */
static int
put_ll(char *p, long long v)
{
    if (v < 0) {
        *p = '-';
        return 1 + put_digits(p + 1, (unsigned long long)-v);
    }
    return put_digits(p, (unsigned long long)v);
}

/* The int `o` at p: 1 (n bytes written), 0 (decline), -1 (error). */
static int
put_int(char *p, PyObject *o, int *n)
{
    if (o == kvi_ZERO) { /* an idle worker's load, no prediction: most entries */
        *p = '0';
        *n = 1;
        return 1;
    }
    long long v;
    int got = ll_of(o, &v);
    if (got > 0)
        *n = put_ll(p, v);
    return got;
}

/* A JSON string of `s` with nothing to escape (printable ASCII, no quote or
 * backslash): its bytes; NULL when anything would be escaped (then decline). */
static const char *
plain_str(PyObject *s, Py_ssize_t *len)
{
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s))
        return NULL;
    const unsigned char *d = PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++)
        if (d[i] < 0x20 || d[i] == '"' || d[i] == '\\' || d[i] == 0x7f)
            return NULL;
    *len = n;
    return (const char *)d;
}

#define PUT(lit) (memcpy(p, lit, sizeof(lit) - 1), p += sizeof(lit) - 1)

/* true / false / null of a bool (or None when `none` allows it); NULL: another value. */
static const char *
lit_of(PyObject *o, int none)
{
    return o == Py_True ? "true" : o == Py_False ? "false" : none && o == Py_None ? "null" : NULL;
}

KVI_HIDDEN PyObject *
kvi_rank_json(const KviCand *cs, Py_ssize_t k)
{
    Py_ssize_t cap = 2 + k * 320, at = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    PyObject *last_src = NULL;
    const char *src = NULL;
    Py_ssize_t ns = 0;
    *p++ = '[';
    for (Py_ssize_t i = 0; i < k; i++) {
        const KviCand *c = &cs[i];
        Py_ssize_t ne;
        const char *e = plain_str(c->engine, &ne);
        if (c->src != last_src) { /* "caller", "index" or the idle one: checked once each */
            last_src = c->src;
            if ((src = plain_str(c->src, &ns)) == NULL)
                goto decline;
        }
        const char *stale = lit_of(c->st, 0), *conn = lit_of(c->conn, 1);
        if (e == NULL || stale == NULL || conn == NULL)
            goto decline;
        /* The most an entry takes: its keys and punctuation (< 200), the engine twice,
         * the source, five ints (< 21 each) and three doubles (< 33 each). */
        Py_ssize_t need = 200 + 2 * ne + ns + 5 * 21 + 3 * 33;
        at = p - PyBytes_AS_STRING(out);
        if (at + need + 1 > cap) {
            cap = 2 * cap + need;
            if (_PyBytes_Resize(&out, cap) < 0)
                return NULL;
            p = PyBytes_AS_STRING(out) + at;
        }
        int n, got;
        if (i)
            *p++ = ',';
        PUT("{\"worker\":\"");
        memcpy(p, e, (size_t)ne);
        p += ne;
        *p++ = '/';
        char *rank_at = p; /* c->rank is rk's value (an exact int, read by ranking.c) */
        n = put_ll(p, c->rank);
        p += n;
        PUT("\",\"engine\":\"");
        memcpy(p, e, (size_t)ne);
        p += ne;
        PUT("\",\"dp_rank\":");
        memcpy(p, rank_at, (size_t)n);
        p += n;
        PUT(",\"score\":");
        if ((n = put_double(p, -c->negscore + 0.0)) < 0)
            goto fail;
        p += n;
        PUT(",\"cached_blocks\":");
        if (c->wm != NULL) {
            long long v; /* -wm[1], as the objects' PyNumber_Negative makes it */
            if ((got = ll_of(PyTuple_GET_ITEM(c->wm, 1), &v)) <= 0)
                goto bad;
            p += put_ll(p, -v);
        } else {
            *p++ = '0';
        }
        PUT(",\"predicted_blocks\":");
        if ((got = put_int(p, c->pb, &n)) <= 0)
            goto bad;
        p += n;
        PUT(",\"cost\":");
        if ((n = put_double(p, c->cost)) < 0)
            goto fail;
        p += n;
        PUT(",\"stale\":");
        memcpy(p, stale, strlen(stale));
        p += strlen(stale);
        PUT(",\"connected\":");
        memcpy(p, conn, strlen(conn));
        p += strlen(conn);
        PUT(",\"load\":{\"prefill_tokens\":");
        if ((got = put_int(p, c->ld0, &n)) <= 0)
            goto bad;
        p += n;
        PUT(",\"decode_blocks\":");
        if (PyFloat_CheckExact(c->ld1)) {
            if ((n = put_double(p, PyFloat_AS_DOUBLE(c->ld1))) < 0)
                goto fail;
        } else if ((got = put_int(p, c->ld1, &n)) <= 0) {
            goto bad;
        }
        p += n;
        PUT(",\"source\":\"");
        memcpy(p, src, (size_t)ns);
        p += ns;
        PUT("\"}}");
        continue;
    bad:
        if (got == 0)
            goto decline;
    fail:
        Py_DECREF(out);
        return NULL;
    }
    *p++ = ']';
    if (_PyBytes_Resize(&out, p - PyBytes_AS_STRING(out)) < 0)
        return NULL;
    return out;
decline:
    Py_DECREF(out);
    return NULL; /* no error set: the caller declines */
}

PyDoc_STRVAR(json_double_doc,
"json_double(x) -> bytes\n\n"
"The float x as the route's JSON writer writes it: the bytes msgspec.json.encode(x)\n"
"makes. For the tests that hold the writer to msgspec.");

static PyObject *
json_double(PyObject *Py_UNUSED(mod), PyObject *arg)
{
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred())
        return NULL;
    char buf[40];
    int n = put_double(buf, v);
    return n < 0 ? NULL : PyBytes_FromStringAndSize(buf, n);
}

KVI_HIDDEN PyMethodDef kvi_rankout_methods[] = {
    {"json_double", (PyCFunction)json_double, METH_O, json_double_doc},
    {NULL, NULL, 0, NULL},
};
