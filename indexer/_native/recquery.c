/* recquery.c: the body of a journaled query's record (and of the small records a
 * recording keeps beside it: notes, a route's end, a registration) written here, byte
 * for byte what record.py's Python encoder makes of the journal's tuple (the reference:
 * recops.encode_call and encode_result, then msgspec), or None: a shape left to it.
 *
 *   encode_record(item, kind, hashed, seed, raised) -> bytes | None
 *
 * ``kind`` is what record.py read off the op: NOTE, GENERIC (the arguments as a list, a
 * scalar result), GENERIC_NONE (the same with no result kept: a registration),
 * MATCH_PLAIN (/query, /v1/match), ROUTE (a route: its ranking as the compiled core wrote
 * it as JSON, /v1/route, or as dicts, the library's route()), MATCH (the library's
 * match(), a prompt with no namespace) or MATCH_BY_KEYS (its match_by_keys()).
 * ``hashed``: the prompt kept as its block keys (hashed mode), else as its length (none
 * mode; full mode is the Python encoder's).
 * ``raised``: journal.Raised, whose records the Python encoder keeps. The journal calls
 * kvi_lay_record with the call's parts, no tuple made (journal.c's encoded).
 *
 * Why: the writer thread shares the GIL with the requests. Encoded in Python, a /query
 * record held it ~4.3 us (a MatchResult's msgpack, its digest, the keys, ~20 frames) and
 * a /v1/route record ~4.5 us; a service answering thousands a second gave that to the
 * writer while requests waited. Here, on the calling thread: ~1.5 us a match's record,
 * ~3 us a route's (the values: recvalue.c). */
#include "journal.h"
#include "mpwrite.h"

#define MAX_KEPT_ANSWER 8192 /* recops.MAX_KEPT_ANSWER: an answer kept whole up to this size */

enum { K_NOTE, K_GENERIC, K_GENERIC_NONE, K_MATCH_PLAIN = KVI_REC_MATCH_PLAIN, K_ROUTE = KVI_REC_ROUTE,
       K_MATCH = KVI_REC_MATCH, K_MATCH_BY_KEYS = KVI_REC_MATCH_BY_KEYS };

/* ------------------------------------------------------------------ values */

static int
w_u64(Out *o, uint64_t u)
{
    return u <= (uint64_t)INT64_MAX ? w_int(o, (int64_t)u) : put_be(o, 0xcf, u, 8);
}

/* ------------------------------------------------------------------ prompts */

/* recops._query of a prompt with no namespace (seed ``seed``): ``{"n": ntok, "k": {bs:
 * keys}}`` for each of the ``nsz`` block sizes ``bss``, or ``{"n": ntok}`` unless
 * ``hashed``. 1, 0, -1 as kvi_w_obj. */
static int
w_prompt(Out *o, PyObject *buf, const Py_ssize_t *bss, Py_ssize_t nsz, int hashed, uint64_t seed)
{
    if (!PyBytes_CheckExact(buf))
        return 0;
    Py_ssize_t ntok = PyBytes_GET_SIZE(buf) / 4;
    if (!w_map(o, hashed ? 2 : 1) || !w_str(o, "n", 1) || !w_int(o, ntok))
        return -1;
    if (!hashed)
        return 1;
    if (!w_str(o, "k", 1) || !w_map(o, (uint32_t)nsz))
        return -1;
    const char *p = PyBytes_AS_STRING(buf);
    for (Py_ssize_t i = 0; i < nsz; i++) {
        Py_ssize_t bs = bss[i], n = ntok / bs;
        size_t step = (size_t)bs * 4;
        if (!w_int(o, bs) || !w_bin_head(o, (size_t)n * 8) || !room(o, (size_t)n * 8))
            return -1;
        const KeyMemo *km = &kvi_key_memo; /* the keys the query made, if it made them */
        Py_ssize_t j = 0;
        if (km->buf == buf && km->bs == bs && km->seed == seed) {
            j = n < km->m ? n : km->m;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            memcpy(o->buf + o->len, km->keys, (size_t)j * 8); /* native order is the record's */
            o->len += (size_t)j * 8;
#else
            for (Py_ssize_t i = 0; i < j; i++) {
                put_le64(o->buf + o->len, km->keys[i]);
                o->len += 8;
            }
#endif
        }
        for (; j < n; j++) {
            put_le64(o->buf + o->len, kvi_xxh3_64(p + (size_t)j * step, step, seed));
            o->len += 8;
        }
    }
    return 1;
}

#define SIZES_MAX 16

/* The block sizes of ``sizes`` (a tuple of ints, or a dict's int keys) to ``bss``: their
 * count; -1 a size not a positive int or more than SIZES_MAX (the Python encoder's). */
static Py_ssize_t
sizes_of(PyObject *sizes, Py_ssize_t bss[SIZES_MAX])
{
    Py_ssize_t n = 0, pos = 0;
    PyObject *bs_o, *ignored;
    int tuple = PyTuple_Check(sizes);
    for (;;) {
        if (tuple) {
            if (n >= PyTuple_GET_SIZE(sizes))
                break;
            bs_o = PyTuple_GET_ITEM(sizes, n);
        }
        else if (!PyDict_Next(sizes, &pos, &bs_o, &ignored))
            break;
        Py_ssize_t bs = n < SIZES_MAX && PyLong_CheckExact(bs_o) ? PyLong_AsSsize_t(bs_o) : -1;
        if (bs <= 0) {
            PyErr_Clear();
            return -1;
        }
        bss[n++] = bs;
    }
    return n;
}

/* ------------------------------------------------------------------ answers */

/* recops._answer: ``[body, xxh64(body), summary]`` (body nil past MAX_KEPT_ANSWER), the
 * summary already written to ``sum``. -1 out of memory, else 1. */
static int
w_answer(Out *o, const Out *body, const Out *sum)
{
    if (!w_arr(o, 3))
        return -1;
    if (!(body->len <= MAX_KEPT_ANSWER ? w_bin(o, body->buf, body->len) : w_nil(o)) ||
        !w_u64(o, kvi_xxh64(body->buf, body->len, 0)) || !put(o, sum->buf, sum->len))
        return -1;
    return 1;
}

/* The attribute and key names a record reads, interned once: PyObject_GetAttrString and
 * PyDict_GetItemString made, hashed and looked up a new string at each call (~4k of a
 * route record's ~50k instructions). */
enum { N_LORA, N_SALT, N_EXTRA, N_BUF, N_SIZES, N_CACHE, N_SCORE, N_WORKER, N_ENGINE, N_DP_RANK, N_COST, N_NAMES };
static const char *const name_str[N_NAMES] = {"lora_name", "cache_salt", "extra_keys", "buf", "sizes", "cache",
                                              "score", "worker", "engine", "dp_rank", "cost"};
static PyObject *name_obj[N_NAMES];

static PyObject *
name(int i)
{
    if (name_obj[i] == NULL)
        name_obj[i] = PyUnicode_InternFromString(name_str[i]);
    return name_obj[i];
}

/* ``o.<name i>``: a new reference, or NULL with an error set. */
static PyObject *
attr(PyObject *o, int i)
{
    PyObject *n = name(i);
    return n == NULL ? NULL : PyObject_GetAttr(o, n);
}

/* The answer's summary of its best worker (a WorkerMatch): ``[f"{engine}/{dp_rank}",
 * best.score]``. 1, 0, -1 as kvi_w_obj. */
static int
w_best(Out *sum, PyObject *best)
{
    if (!PyTuple_Check(best) || PyTuple_GET_SIZE(best) < 4)
        return 0;
    PyObject *engine = PyTuple_GET_ITEM(best, 2), *rank = PyTuple_GET_ITEM(best, 3);
    int64_t rv;
    if (!PyUnicode_CheckExact(engine) || !PyUnicode_IS_COMPACT_ASCII(engine) || !PyLong_CheckExact(rank) ||
        !small_long(rank, &rv))
        return 0; /* "%S/%S" of anything else: the Python encoder's */
    char digits[24]; /* str(dp_rank) */
    int nd = 0;
    uint64_t mag = rv < 0 ? 0 - (uint64_t)rv : (uint64_t)rv;
    do
        digits[sizeof digits - 1 - nd++] = (char)('0' + mag % 10);
    while ((mag /= 10) != 0);
    if (rv < 0)
        digits[sizeof digits - 1 - nd++] = '-';
    size_t ne = (size_t)PyUnicode_GET_LENGTH(engine);
    if (!w_arr(sum, 2) || !w_str_head(sum, ne + 1 + (size_t)nd) || !put(sum, (PyASCIIObject *)engine + 1, ne) ||
        !put(sum, "/", 1) || !put(sum, digits + sizeof digits - nd, (size_t)nd))
        return -1;
    PyObject *neg = PyTuple_GET_ITEM(best, 0);
    if (PyFloat_CheckExact(neg)) /* WorkerMatch.score, -self[0] + 0.0, with no Python frame (~900 instructions) */
        return w_f64(sum, -PyFloat_AS_DOUBLE(neg) + 0.0) ? 1 : -1;
    PyObject *score = attr(best, N_SCORE);
    int r = score == NULL ? -1 : kvi_w_obj(sum, score, 0);
    Py_XDECREF(score);
    return r;
}

/* A match's answer (recops.encode_result): nil without one, else a MatchResult's body,
 * digest and summary. 1, 0, -1 as kvi_w_obj. */
static int
w_match_answer(Out *o, Out *body, Out *sum, PyObject *result)
{
    if (result == Py_None)
        return w_nil(o) ? 1 : -1;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 6)
        return 0;
    int r = kvi_w_obj(body, result, 0);
    if (r <= 0)
        return r;
    PyObject *best = PyTuple_GET_ITEM(result, 4);
    if (best == Py_None ? !w_nil(sum) : (r = w_best(sum, best)) <= 0)
        return best == Py_None ? -1 : r;
    return w_answer(o, body, sum);
}

/* MATCH_PLAIN: ``args`` (buf, model, _), ``result`` a MatchResult or None. */
static int
w_match_plain(Out *o, Out *body, Out *sum, PyObject *args, PyObject *result, int hashed, uint64_t seed)
{
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 3)
        return 0;
    Py_ssize_t bs = 0;
    if (result != Py_None) {
        if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 6 || !PyLong_CheckExact(PyTuple_GET_ITEM(result, 1)))
            return 0;
        bs = PyLong_AsSsize_t(PyTuple_GET_ITEM(result, 1));
        if (bs <= 0) {
            PyErr_Clear();
            return 0;
        }
    }
    int r = w_arr(o, 2) ? w_prompt(o, PyTuple_GET_ITEM(args, 0), &bs, bs ? 1 : 0, hashed, seed) : -1;
    if (r > 0)
        r = kvi_w_obj(o, PyTuple_GET_ITEM(args, 1), 0);
    return r <= 0 ? r : w_match_answer(o, body, sum, result);
}

/* MATCH_BY_KEYS's keys (recops.encode_call): ``keys_bytes(keys), len(keys)`` as the start
 * of a 3-array (its model next), the bytes empty unless ``hashed``: array("Q")'s, native
 * order. 1; 0 a key not an int in [0, 2**64) (array's error, in Python); -1. */
static int
w_keys(Out *o, PyObject *keys, int hashed)
{
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (!w_arr(o, 3) || !w_bin_head(o, hashed ? (size_t)n * 8 : 0) || !room(o, hashed ? (size_t)n * 8 : 0))
        return -1;
    for (Py_ssize_t i = 0; hashed && i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        uint64_t u;
        if (!PyLong_CheckExact(k) || as_u64(k, &u) <= 0) { /* an exact int fails only by overflow */
            PyErr_Clear();
            return 0;
        }
        memcpy(o->buf + o->len, &u, 8);
        o->len += 8;
    }
    return w_int(o, n) ? 1 : -1;
}

/* A KeySource's prompt (recops._query) with no namespace: its block sizes are its
 * ``sizes`` when it has any and ``sizes_first`` (a route's), else its cache's (a match's).
 * 1, 0 (not a KeySource, or a namespaced prompt: its seeds are the Python encoder's), -1. */
static int
w_source(Out *o, PyObject *src, int sizes_first, int hashed, uint64_t seed)
{
    PyObject *lora = attr(src, N_LORA), *salt = lora ? attr(src, N_SALT) : NULL,
             *extra = salt ? attr(src, N_EXTRA) : NULL, *buf = extra ? attr(src, N_BUF) : NULL,
             *sizes = buf ? attr(src, N_SIZES) : NULL, *cache = sizes ? attr(src, N_CACHE) : NULL;
    int r = -1;
    if (cache == NULL) {
        PyErr_Clear(); /* not a KeySource */
        r = 0;
        goto done;
    }
    int named = PyObject_IsTrue(lora), extras = PyObject_IsTrue(extra);
    if (named < 0 || extras < 0)
        goto done;
    r = 0;
    if (named || extras || salt != Py_None || !PyTuple_Check(sizes) || !PyDict_CheckExact(cache))
        goto done;
    Py_ssize_t bss[SIZES_MAX], nsz = sizes_of(sizes_first && PyTuple_GET_SIZE(sizes) ? sizes : cache, bss);
    if (nsz >= 0)
        r = w_prompt(o, buf, bss, nsz, hashed, seed);
done:
    Py_XDECREF(lora);
    Py_XDECREF(salt);
    Py_XDECREF(extra);
    Py_XDECREF(buf);
    Py_XDECREF(sizes);
    Py_XDECREF(cache);
    return r;
}

/* ROUTE's arguments (recops.encode_call): the prompt, the model, the load as [prefill,
 * decode] per key, the candidates, the scale, record, max_tokens, the link as [engine,
 * rank, connected, ever] rows, the form. Only a prompt with no namespace. */
static int
w_route_call(Out *o, PyObject *args, int hashed, uint64_t seed)
{
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 9)
        return 0;
    PyObject *src = PyTuple_GET_ITEM(args, 0), *load = PyTuple_GET_ITEM(args, 2),
             *cands = PyTuple_GET_ITEM(args, 3), *link = PyTuple_GET_ITEM(args, 7);
    if ((load != Py_None && !PyDict_CheckExact(load)) || (link != Py_None && !PyDict_CheckExact(link)) ||
        (cands != Py_None && !PyList_CheckExact(cands) && !PyTuple_CheckExact(cands)))
        return 0;
    int r = w_arr(o, 9) ? w_source(o, src, 1, hashed, seed) : -1;
    if (r <= 0 || (r = kvi_w_obj(o, PyTuple_GET_ITEM(args, 1), 0)) <= 0)
        return r;
    r = -1;
    if (load == Py_None) {
        if (!w_nil(o))
            goto done;
    }
    else {
        if (!w_map(o, (uint32_t)PyDict_GET_SIZE(load)))
            goto done;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(load, &pos, &k, &v)) {
            if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) < 2) {
                r = 0;
                goto done;
            }
            if ((r = kvi_w_obj(o, k, 0)) <= 0 || (r = w_arr(o, 2) ? 1 : -1) < 0 ||
                (r = kvi_w_obj(o, PyTuple_GET_ITEM(v, 0), 0)) <= 0 ||
                (r = kvi_w_obj(o, PyTuple_GET_ITEM(v, 1), 0)) <= 0)
                goto done;
            r = -1;
        }
    }
    for (int i = 3; i < 7; i++) /* the candidates (an array as list() makes them), scale, record, max_tokens */
        if ((r = kvi_w_obj(o, PyTuple_GET_ITEM(args, i), 0)) <= 0)
            goto done;
    r = -1;
    if (link == Py_None) {
        if (!w_nil(o))
            goto done;
    }
    else {
        if (!w_arr(o, (uint32_t)PyDict_GET_SIZE(link)))
            goto done;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(link, &pos, &k, &v)) {
            if (!PyTuple_Check(k) || PyTuple_GET_SIZE(k) != 2 || !PyTuple_Check(v) || PyTuple_GET_SIZE(v) < 2) {
                r = 0;
                goto done;
            }
            if (!w_arr(o, 4)) {
                r = -1;
                goto done;
            }
            PyObject *cols[4] = {PyTuple_GET_ITEM(k, 0), PyTuple_GET_ITEM(k, 1), PyTuple_GET_ITEM(v, 0),
                                 PyTuple_GET_ITEM(v, 1)};
            for (int c = 0; c < 4; c++)
                if ((r = kvi_w_obj(o, cols[c], 0)) <= 0)
                    goto done;
        }
    }
    r = kvi_w_obj(o, PyTuple_GET_ITEM(args, 8), 0);
done:
    return r;
}

/* Ranking.reason() of a ranking whose best entry scores ``score`` (route.py). */
static const char *
route_reason(PyObject *score, PyObject *top, int *err)
{
    PyObject *zero = PyLong_FromLong(0);
    int none = zero == NULL ? -1 : PyObject_RichCompareBool(top, zero, Py_LE);
    Py_XDECREF(zero);
    int longest = none != 0 ? 0 : PyObject_RichCompareBool(score, top, Py_GE);
    *err = none < 0 || longest < 0;
    return none ? "no_cached_prefix_least_loaded" : longest ? "longest_cached_prefix" : "load_outweighs_cached_prefix";
}

/* WorkerMatch.tiers of ``best`` (a WorkerMatch, or None: {}): {name: blocks} of its tier
 * items with blocks. 1, 0, -1 as kvi_w_obj. */
static int
w_tiers(Out *o, PyObject *best)
{
    if (best == Py_None)
        return w_map(o, 0) ? 1 : -1;
    PyObject *items = PyTuple_Check(best) && PyTuple_GET_SIZE(best) > 4 ? PyTuple_GET_ITEM(best, 4) : NULL;
    if (items == NULL || !PyTuple_Check(items))
        return 0;
    uint32_t n = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *it = PyTuple_GET_ITEM(items, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(it, 1)))
            return 0;
        n += PyObject_IsTrue(PyTuple_GET_ITEM(it, 1));
    }
    if (!w_map(o, n))
        return -1;
    int r;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *it = PyTuple_GET_ITEM(items, i);
        if (PyObject_IsTrue(PyTuple_GET_ITEM(it, 1)) &&
            ((r = kvi_w_obj(o, PyTuple_GET_ITEM(it, 0), 0)) <= 0 ||
             (r = kvi_w_obj(o, PyTuple_GET_ITEM(it, 1), 0)) <= 0))
            return r;
    }
    return 1;
}

/* ROUTE's answer (recops.encode_result): the summary ``[request_id, worker, reason, score,
 * cost]`` and the body, either
 * - of a ranking written as JSON (``json`` not None, struct entries): ``["json", model,
 *   worker, engine, dp_rank, score, cost, reason, tiers, unused_load, request_id, json]``;
 * - or of a ranking of dicts (the library's route()): RouteResponse as msgspec writes it,
 *   a map of its eleven fields in order, the entries the dicts as they are.
 * The head is Ranking.head(), the tiers WorkerMatch.tiers. */
static int
w_route_answer(Out *o, Out *body, Out *sum, PyObject *result)
{
    if (!PyTuple_CheckExact(result) || PyTuple_GET_SIZE(result) != 2)
        return 0;
    PyObject *ranking = PyTuple_GET_ITEM(result, 0), *rid = PyTuple_GET_ITEM(result, 1);
    if (!PyTuple_Check(ranking) || PyTuple_GET_SIZE(ranking) != 7 || !PyList_Check(PyTuple_GET_ITEM(ranking, 1)) ||
        PyList_GET_SIZE(PyTuple_GET_ITEM(ranking, 1)) == 0)
        return 0;
    int json = PyTuple_GET_ITEM(ranking, 6) != Py_None;
    if (PyTuple_GET_ITEM(ranking, 5) != (json ? Py_True : Py_False))
        return 0;
    PyObject *ranked = PyTuple_GET_ITEM(ranking, 1), *head = PyList_GET_ITEM(ranked, 0),
             *best = PyTuple_GET_ITEM(ranking, 2);
    if (!json && !PyDict_CheckExact(head))
        return 0;
    static const int names[5] = {N_WORKER, N_ENGINE, N_DP_RANK, N_SCORE, N_COST};
    PyObject *h[5] = {NULL, NULL, NULL, NULL, NULL};
    int r = 0, err = 0;
    for (int i = 0; i < 5; i++) {
        PyObject *n = name(names[i]);
        h[i] = n == NULL ? NULL : json ? PyObject_GetAttr(head, n) : Py_XNewRef(PyDict_GetItemWithError(head, n));
        if (h[i] == NULL) {
            r = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
    }
    r = -1;
    const char *reason = route_reason(h[3], PyTuple_GET_ITEM(ranking, 3), &err);
    if (err)
        goto done;
    if (json) {
        if (!w_arr(body, 12) || !w_str(body, "json", 4) || (r = kvi_w_obj(body, PyTuple_GET_ITEM(ranking, 0), 0)) <= 0)
            goto done;
        for (int i = 0; i < 5; i++)
            if ((r = kvi_w_obj(body, h[i], 0)) <= 0)
                goto done;
        r = -1;
        if (!w_str(body, reason, strlen(reason)) || (r = w_tiers(body, best)) <= 0 ||
            (r = kvi_w_obj(body, PyTuple_GET_ITEM(ranking, 4), 0)) <= 0 || (r = kvi_w_obj(body, rid, 0)) <= 0 ||
            (r = kvi_w_obj(body, PyTuple_GET_ITEM(ranking, 6), 0)) <= 0)
            goto done;
    }
    else {
        if (!w_map(body, 11) || !w_str(body, "model", 5) || (r = kvi_w_obj(body, PyTuple_GET_ITEM(ranking, 0), 0)) <= 0)
            goto done;
        for (int i = 0; i < 5; i++) {
            r = -1;
            if (!w_str(body, name_str[names[i]], strlen(name_str[names[i]])) || (r = kvi_w_obj(body, h[i], 0)) <= 0)
                goto done;
        }
        r = -1;
        if (!w_str(body, "reason", 6) || !w_str(body, reason, strlen(reason)) || !w_str(body, "tiers", 5) ||
            (r = w_tiers(body, best)) <= 0)
            goto done;
        r = -1;
        if (!w_str(body, "ranked", 6) || (r = kvi_w_obj(body, ranked, 0)) <= 0)
            goto done;
        r = -1;
        if (!w_str(body, "unused_load", 11) || (r = kvi_w_obj(body, PyTuple_GET_ITEM(ranking, 4), 0)) <= 0)
            goto done;
        r = -1;
        if (!w_str(body, "request_id", 10) || (r = kvi_w_obj(body, rid, 0)) <= 0)
            goto done;
    }
    r = -1;
    if (!w_arr(sum, 5))
        goto done;
    PyObject *cols[5] = {rid, h[0], NULL, h[3], h[4]};
    for (int i = 0; i < 5; i++) {
        if (i == 2 ? !w_str(sum, reason, strlen(reason)) : (r = kvi_w_obj(sum, cols[i], 0)) <= 0) {
            r = i == 2 ? -1 : r;
            goto done;
        }
    }
    r = w_answer(o, body, sum);
done:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(h[i]);
    return r;
}

/* ------------------------------------------------------------------ the record */

/* The call ``c``'s record, of kind ``kind`` (not a note), to ``o``: 1, 0, -1 as kvi_w_obj.
 * ``body`` and ``sum``: scratch for an answer. */
static int
w_call(Out *o, Out *body, Out *sum, const KviCall *c, int kind, int hashed, uint64_t seed, PyObject *raised)
{
    PyObject *args = c->args, *result = c->result;
    if (PyObject_TypeCheck(result, (PyTypeObject *)raised))
        return 0;
    int r;
    if (!w_arr(o, 5) || (r = kvi_w_obj(o, c->op, 0)) < 0)
        return -1;
    if (r == 0)
        return 0;
    if (c->wall_o != NULL) { /* the tuple's */
        if ((r = kvi_w_obj(o, c->wall_o, 0)) <= 0 || (r = kvi_w_obj(o, c->times_o, 0)) <= 0)
            return r;
    }
    else {
        int ok = w_f64(o, c->wall) && w_arr(o, (uint32_t)c->nt);
        for (Py_ssize_t i = 0; ok && i < c->nt; i++)
            ok = w_f64(o, c->times[i]);
        if (!ok)
            return -1;
    }
    switch (kind) {
    case K_MATCH_PLAIN:
        return w_match_plain(o, body, sum, args, result, hashed, seed);
    case K_ROUTE:
        if ((r = w_route_call(o, args, hashed, seed)) <= 0)
            return r;
        return w_route_answer(o, body, sum, result);
    case K_MATCH: /* args (src, model) */
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 2)
            return 0;
        if (!w_arr(o, 2))
            return -1;
        if ((r = w_source(o, PyTuple_GET_ITEM(args, 0), 0, hashed, seed)) <= 0 ||
            (r = kvi_w_obj(o, PyTuple_GET_ITEM(args, 1), 0)) <= 0)
            return r;
        return w_match_answer(o, body, sum, result);
    case K_MATCH_BY_KEYS: /* args (keys, model): the keys as uint64 bytes (none mode: none), their count */
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 2 || !PyList_CheckExact(PyTuple_GET_ITEM(args, 0)))
            return 0;
        if ((r = w_keys(o, PyTuple_GET_ITEM(args, 0), hashed)) <= 0 ||
            (r = kvi_w_obj(o, PyTuple_GET_ITEM(args, 1), 0)) <= 0)
            return r;
        return w_match_answer(o, body, sum, result);
    case K_GENERIC:
    case K_GENERIC_NONE:
        if (!PyTuple_CheckExact(args) || (r = kvi_w_obj(o, args, 0)) <= 0)
            return r;
        if (kind == K_GENERIC && result != Py_None) {
            if (PyLong_Check(result) || PyFloat_Check(result) || PyUnicode_Check(result))
                return kvi_w_obj(o, result, 0); /* a scalar kept as it is (a subclass: Python's) */
        }
        return w_nil(o) ? 1 : -1;
    }
    return 0;
}

/* The record ``item`` (journal.py's tuple: ``(op, wall, args, result, times)``, or a
 * note's ``("note", wall, kind, engine, rank, detail)``) of kind ``kind`` to ``o``: 1, 0, -1
 * as kvi_w_obj. */
static int
w_record(Out *o, Out *body, Out *sum, PyObject *item, int kind, int hashed, uint64_t seed, PyObject *raised)
{
    if (kind == K_NOTE)
        return PyTuple_CheckExact(item) ? kvi_w_obj(o, item, 0) : 0;
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 5)
        return 0;
    KviCall c = {PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 2), PyTuple_GET_ITEM(item, 3),
                 PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 4), 0.0, NULL, 0};
    return w_call(o, body, sum, &c, kind, hashed, seed, raised);
}

PyDoc_STRVAR(encode_record_doc,
"encode_record(item, kind, hashed, seed, raised) -> bytes | None\n\n"
"The msgpack body of the journal's record `item` of `kind` (0 note, 1 generic,\n"
"2 generic with no result kept, 3 match_plain, 4 route, 5 match, 6 match_by_keys),\n"
"byte for byte the Python encoder's (record.py); None: a shape left to it. `hashed`: prompts\n"
"as block keys (seed `seed`), else as their length. `raised`: journal.Raised.");

/* Encode ``item`` (w_record), or the call ``c`` (w_call), in the kept buffers ``keep`` (or,
 * called again while they are in use, in ``local``): ``*out`` is where the body is;
 * release with done_with. 1, 0, -1 as w_record. */
static Out keep[3];
static int busy;

static int
encode_in(Out local[3], Out **out, PyObject *item, const KviCall *c, int kind, int hashed, uint64_t seed,
          PyObject *raised)
{
    /* The GIL held; no Python runs while the buffers are in use but attribute reads of
     * the index's own types. */
    Out *o = busy ? local : keep;
    busy = 1;
    for (int i = 0; i < 3; i++)
        o[i].len = 0;
    kvi_w_obj_reset(); /* another record's (or, nested, the outer one's: it is written again then) */
    *out = o;
    return c != NULL ? w_call(&o[0], &o[1], &o[2], c, kind, hashed, seed, raised)
                     : w_record(&o[0], &o[1], &o[2], item, kind, hashed, seed, raised);
}

static void
done_with(Out *o, Out local[3])
{
    if (o == keep) {
        busy = 0;
        for (int i = 0; i < 3; i++)
            if (o[i].cap > (1u << 20)) { /* a huge answer's buffer is not kept */
                free(o[i].buf);
                o[i].buf = NULL;
                o[i].cap = 0;
            }
    }
    else
        for (int i = 0; i < 3; i++)
            free(local[i].buf);
}

/* The body of ``item`` as encode_record makes it (the writer's, with the GIL held):
 * bytes, None (a shape left to Python), or NULL with an error set. */
static PyObject *
encode_bytes(PyObject *item, int kind, int hashed, uint64_t seed, PyObject *raised)
{
    Out local[3] = {{0}}, *o;
    int r = encode_in(local, &o, item, NULL, kind, hashed, seed, raised);
    PyObject *out = r > 0 ? PyBytes_FromStringAndSize((const char *)o[0].buf, (Py_ssize_t)o[0].len)
                  : r == 0 ? Py_NewRef(Py_None) : (PyErr_Occurred() ? NULL : PyErr_NoMemory());
    done_with(o, local);
    return out;
}

KVI_HIDDEN int
kvi_lay_record(JournalCore *j, const KviCall *c, int kind)
{
    Out local[3] = {{0}}, *o;
    int r = encode_in(local, &o, NULL, c, kind, j->strip, (uint64_t)j->seed, j->raised);
    if (r > 0) /* the body: the writer frames it (recframe.c) */
        r = kvi_lay_body(j, o[0].buf, o[0].len, kind >= K_MATCH_PLAIN && c->result != Py_None);
    else if (r < 0 && !PyErr_Occurred())
        PyErr_NoMemory();
    done_with(o, local);
    return r;
}

static PyObject *
encode_record(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyType_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "encode_record(item, kind, hashed, seed, raised)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[1]);
    int hashed = PyObject_IsTrue(args[2]);
    uint64_t seed;
    if ((kind == -1 && PyErr_Occurred()) || hashed < 0 || as_u64(args[3], &seed) <= 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "seed must be in [0, 2**64)");
        return NULL;
    }
    return encode_bytes(args[0], (int)kind, hashed, seed, args[4]);
}

KVI_HIDDEN PyMethodDef kvi_recquery_methods[] = {
    {"encode_record", (PyCFunction)(void (*)(void))encode_record, METH_FASTCALL, encode_record_doc},
    {NULL, NULL, 0, NULL},
};
