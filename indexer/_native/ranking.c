/* ranking.c: a route's ranking of its candidates (query/route.py's _py_rank is the
 * reference), one pass with no Python frame per candidate: the cost of each into a C
 * record (no object made), one sort of those, then the answer written out from them
 * (rankout.c: the entries as objects, or as JSON). A large fleet lists hundreds of
 * candidates in every answer; this is their loop. */
#include "core.h"
#include <math.h>

/* Exactly representable in a double: what Python's int + float does without loss. */
#define EXACT (1LL << 53)

/* 1: *out is the int `o` (|o| < 2**53); 0: not such an int (the caller declines); -1: error. */
static int
small_int(PyObject *o, long long *out)
{
    if (!PyLong_Check(o))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v >= EXACT || v <= -EXACT)
        return 0;
    *out = v;
    return 1;
}

/* 1: *out is the float or small int `o` as a double; 0: neither; -1: error. */
static int
as_double(PyObject *o, double *out)
{
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 1;
    }
    long long v;
    int got = small_int(o, &v);
    if (got == 1)
        *out = (double)v;
    return got;
}

/* Python's a // b for b != 0 (rounding toward minus infinity). */
static long long
floordiv(long long a, long long b)
{
    long long q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0)))
        q--;
    return q;
}

/* Item i of a sequence (a tuple without a call): a new reference, NULL on error. */
static PyObject *
item(PyObject *seq, Py_ssize_t i)
{
    if (PyTuple_Check(seq) && i < PyTuple_GET_SIZE(seq)) {
        PyObject *o = PyTuple_GET_ITEM(seq, i);
        Py_INCREF(o);
        return o;
    }
    return PySequence_GetItem(seq, i);
}

/* Equal str objects (the same code points): same kind and length, same bytes. */
static int
str_eq(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    int kind = PyUnicode_KIND(a);
    return n == PyUnicode_GET_LENGTH(b) && kind == PyUnicode_KIND(b) &&
           memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * (size_t)kind) == 0;
}

/* The match's workers by (engine, dp_rank): open addressing over borrowed WorkerMatch
 * tuples, hashed by the engine's cached str hash and the rank, so no key object is made
 * per worker (the answer's engines are the very objects of the model's rows). */
typedef struct {
    PyObject *engine; /* NULL: empty */
    long long rank;
    PyObject *wm;
} MSlot;

typedef struct {
    MSlot *slots;
    size_t mask;
} MTable;

/* The slot of (engine, rank): its own, or the empty one where it would go; NULL on error. */
static MSlot *
mt_slot(MTable *t, PyObject *engine, long long rank)
{
    Py_hash_t h = PyObject_Hash(engine); /* a str caches it */
    if (h == -1)
        return NULL;
    size_t i = (size_t)mix64((uint64_t)h ^ ((uint64_t)rank * 0x9E3779B97F4A7C15ULL)) & t->mask;
    for (;;) {
        MSlot *sl = &t->slots[i];
        if (sl->engine == NULL || (sl->rank == rank && str_eq(sl->engine, engine)))
            return sl;
        i = (i + 1) & t->mask;
    }
}

typedef KviCand Cand;

/* (engine, rank) order: engine ids in code point order, as str's <, then the rank. */
static int
worker_cmp(PyObject *e, long long er, PyObject *f, long long fr)
{
    /* Most ids are ASCII (one byte a code point, where memcmp is that order); a tie on
     * cost and score over a whole fleet compares them in every step of the sort. */
    int c;
    if (PyUnicode_KIND(e) == PyUnicode_1BYTE_KIND && PyUnicode_KIND(f) == PyUnicode_1BYTE_KIND) {
        Py_ssize_t ne = PyUnicode_GET_LENGTH(e), nf = PyUnicode_GET_LENGTH(f);
        c = memcmp(PyUnicode_DATA(e), PyUnicode_DATA(f), (size_t)(ne < nf ? ne : nf));
        if (c == 0)
            c = (ne > nf) - (ne < nf);
    } else {
        c = PyUnicode_Compare(e, f); /* exact str: never fails */
    }
    if (c != 0)
        return c;
    return (er > fr) - (er < fr);
}

/* worker_cmp of two candidates: by their places when both are a model's rows (the
 * caller ranked the model: a place is the (engine, rank) order), else by name. A whole
 * fleet tied on cost and score sorted by comparing names was a fifth of a 256-worker
 * route. */
static int
cand_cmp(const Cand *x, const Cand *y)
{
    if (x->pos >= 0 && y->pos >= 0)
        return (x->pos > y->pos) - (x->pos < y->pos);
    return worker_cmp(x->engine, x->rank, y->engine, y->rank);
}

static int
by_key(const void *a, const void *b)
{
    const Cand *x = a, *y = b;
    if (x->never != y->never)
        return x->never - y->never;
    if (x->cost != y->cost)
        return x->cost < y->cost ? -1 : 1;
    if (x->negscore != y->negscore)
        return x->negscore < y->negscore ? -1 : 1;
    return cand_cmp(x, y);
}

static int
by_key_ptr(const void *a, const void *b)
{
    return by_key(*(Cand *const *)a, *(Cand *const *)b);
}

/* Sorts (*pcs)[0..k) by by_key: by pointer, then lays the candidates out in that order
 * in a new array that replaces *pcs. glibc's qsort moves an element wider than a word
 * with a memcpy call per move: sorting the candidates themselves was a sixth of a
 * 256-worker route. -1 with MemoryError set (*pcs unchanged). */
static int
sort_cands(Cand **pcs, Py_ssize_t k)
{
    if (k < 2)
        return 0;
    Cand **ord = PyMem_Malloc((size_t)k * sizeof(Cand *));
    Cand *out = PyMem_Malloc((size_t)k * sizeof(Cand));
    if (ord == NULL || out == NULL) {
        PyMem_Free(ord);
        PyMem_Free(out);
        PyErr_NoMemory();
        return -1;
    }
    Cand *cs = *pcs;
    for (Py_ssize_t i = 0; i < k; i++)
        ord[i] = &cs[i];
    qsort(ord, (size_t)k, sizeof(Cand *), by_key_ptr);
    for (Py_ssize_t i = 0; i < k; i++)
        out[i] = *ord[i];
    PyMem_Free(ord);
    PyMem_Free(cs);
    *pcs = out;
    return 0;
}

static int
by_worker(const void *a, const void *b)
{
    return cand_cmp(*(Cand *const *)a, *(Cand *const *)b);
}

/* The number of run[0..m) (in (engine, rank) order) before (e, r). */
static Py_ssize_t
count_before(const Cand *run, Py_ssize_t m, PyObject *e, long long r)
{
    Py_ssize_t lo = 0, hi = m;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (worker_cmp(run[mid].engine, run[mid].rank, e, r) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void
reverse(Cand *c, Py_ssize_t n)
{
    for (Py_ssize_t i = 0, j = n - 1; i < j; i++, j--) {
        Cand t = c[i];
        c[i] = c[j];
        c[j] = t;
    }
}

/* Rotates each run of cs[0..k) (sorted by by_key) tied on (never, cost, -score) for
 * replica `slot` of `of` (route._rotate_ties is the reference): the whole (engine,
 * rank) order rotated to start at position slot * k / of, when that starts the run at a
 * different member for every slot; else the run rotated to start at its own member
 * slot * m / of. Needs 0 <= slot < of <= 2**31 (the caller checks). -1: no memory. */
static int
rotate_ties(Cand *cs, Py_ssize_t k, long long slot, long long of)
{
    PyObject **te = NULL; /* the workers at positions t * k / of, t = 1 .. of-1, of the whole order */
    long long *tr = NULL;
    Py_ssize_t *at = NULL; /* the run's member each of those starts at */
    for (Py_ssize_t i = 0, j; i < k; i = j) {
        for (j = i + 1; j < k && cs[j].never == cs[i].never && cs[j].cost == cs[i].cost &&
                        cs[j].negscore == cs[i].negscore;
             j++)
            ;
        Py_ssize_t m = j - i;
        if (m < 2)
            continue;
        Py_ssize_t start = (Py_ssize_t)(slot * (long long)m / of); /* exact: slot < 2**31, m < 2**32 */
        if (m >= of && m < k) {
            if (te == NULL) {
                /* Read once, before a rotation moves anything: a sort of pointers. */
                Cand **ord = PyMem_Malloc((size_t)k * sizeof(Cand *));
                te = PyMem_Malloc((size_t)of * sizeof(PyObject *));
                tr = PyMem_Malloc((size_t)of * sizeof(long long));
                at = PyMem_Malloc((size_t)of * sizeof(Py_ssize_t));
                if (ord == NULL || te == NULL || tr == NULL || at == NULL) {
                    PyMem_Free(ord);
                    PyMem_Free(te);
                    PyMem_Free(tr);
                    PyMem_Free(at);
                    PyErr_NoMemory();
                    return -1;
                }
                for (Py_ssize_t x = 0; x < k; x++)
                    ord[x] = &cs[x];
                qsort(ord, (size_t)k, sizeof(Cand *), by_worker);
                for (long long t = 1; t < of; t++) {
                    Cand *w = ord[t * (long long)k / of];
                    te[t] = w->engine;
                    tr[t] = w->rank;
                }
                PyMem_Free(ord);
            }
            int distinct = 1;
            at[0] = 0;
            for (long long t = 1; t < of && distinct; t++) {
                at[t] = count_before(&cs[i], m, te[t], tr[t]);
                distinct = at[t] > at[t - 1] && at[t] < m;
            }
            if (distinct)
                start = at[slot];
        }
        if (start > 0) { /* rotate left by start: three reversals, in place */
            reverse(&cs[i], start);
            reverse(&cs[i + start], m - start);
            reverse(&cs[i], m);
        }
    }
    PyMem_Free(te);
    PyMem_Free(tr);
    PyMem_Free(at);
    return 0;
}

PyDoc_STRVAR(rank_doc,
"rank(cands, workers, pred, load, used, in_flight, link, query_blocks, block_size, scale,\n"
"     idle_source, entry_cls, load_cls, slot, of, keep) -> (entries, top_score, best_match)\n"
"     | (json, top_score, best_match, first_entries) | None\n\n"
"The ranked entries of a route's candidates, best first (route._py_rank is the\n"
"reference: same arguments, same answer). `cands` are (engine, dp_rank, stale)\n"
"tuples, or a model's rows (engine, dp_rank, freshness, position; None for a\n"
"removed worker, skipped; the model ranked: positions are its (engine, dp_rank) order); `workers` the match's WorkerMatch tuples; `pred`, `load`, `in_flight`, `link`\n"
"dicts or None; load keys found are added to the set `used`. Entries are dicts, or\n"
"entry_cls(..., load_cls(...)) when the classes are given. Ties on cost and score are\n"
"ordered for replica `slot` of `of` (route._rotate_ties). With `keep` an int, the\n"
"entries are written as the JSON array msgspec makes of them (bytes) and only the\n"
"first `keep` are made. None when a value is one only Python ranks (or msgspec\n"
"writes) exactly (a NaN cost or score, a load that is not an int below 2**53, an\n"
"engine that is not a str, a non-dict mapping; with `keep`, a string JSON escapes):\n"
"ask _py_rank then.");

#define DECLINE 1 /* a value outside what this loop ranks exactly: return None */

/* Candidate `c` weighed into *out (its references: KviCand's); 0, DECLINE or -1 (error).
 * `key` is the caller's (engine, rank) tuple, its items set here (borrowed). */
static int
weigh(PyObject *c, MTable *wms, PyObject *key, PyObject *pred, PyObject *load, PyObject *used,
      PyObject *in_flight, PyObject *link, long long qb, long long bs, double scale, PyObject *idle, Cand *out)
{
    Py_ssize_t size = PyTuple_Check(c) ? PyTuple_GET_SIZE(c) : 0;
    if ((size != 3 && size != 4) || !PyUnicode_CheckExact(PyTuple_GET_ITEM(c, 0)) ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(c, 1)) ||
        (size == 4 && (!PyTuple_Check(PyTuple_GET_ITEM(c, 2)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(c, 2)) < 1)))
        return DECLINE;
    PyObject *engine = PyTuple_GET_ITEM(c, 0), *rk = PyTuple_GET_ITEM(c, 1), *st = PyTuple_GET_ITEM(c, 2);
    if (size == 4)
        st = PyTuple_GET_ITEM(st, 0); /* a row: stale is its freshness' first item */
    long long r;
    int got = small_int(rk, &r);
    if (got <= 0)
        return got < 0 ? -1 : DECLINE;
    PyTuple_SET_ITEM(key, 0, engine);
    PyTuple_SET_ITEM(key, 1, rk);
    /* Made below and released on failure; kept in *out on success. */
    PyObject *name = NULL, *ld0 = NULL, *ld1 = NULL, *src = idle, *conn = NULL; /* ld0 NULL: idle so far */
    PyObject *pb = kvi_ZERO, *wm = NULL;
    double score = 0.0, d;
    int never = 0;
    MSlot *sl = mt_slot(wms, engine, r);
    if (sl == NULL)
        goto fail;
    wm = sl->wm; /* NULL: nothing matched there */
    if (wm != NULL) {
        if ((got = as_double(PyTuple_GET_ITEM(wm, 0), &d)) <= 0)
            goto bad;
        score = -d + 0.0;
    }
    if (pred != NULL) {
        PyObject *p = PyDict_GetItemWithError(pred, key);
        if (p == NULL && PyErr_Occurred())
            goto fail;
        if (p != NULL) {
            if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < 2 || (got = as_double(PyTuple_GET_ITEM(p, 1), &d)) <= 0)
                goto bad;
            pb = PyTuple_GET_ITEM(p, 0);
            score += d;
        }
    }
    if (load != NULL) {
        /* The name, else the engine (a None value: as if absent, like dict.get). The
         * name is made only here: the answer's entries write their own. */
        if ((name = kvi_worker_name(engine, rk, r)) == NULL)
            goto fail;
        PyObject *ld = PyDict_GetItemWithError(load, name), *hit = name;
        if ((ld == NULL && !PyErr_Occurred()) || ld == Py_None) {
            ld = PyDict_GetItemWithError(load, engine);
            hit = engine;
        }
        if (ld == NULL && PyErr_Occurred())
            goto fail;
        if (ld != NULL && ld != Py_None) {
            if (PySet_Add(used, hit) < 0 || (ld0 = item(ld, 0)) == NULL || (ld1 = item(ld, 1)) == NULL)
                goto fail;
            src = kvi_src_caller;
        }
        Py_CLEAR(name);
    }
    if (ld0 == NULL && in_flight != NULL) {
        PyObject *f = PyDict_GetItemWithError(in_flight, key);
        if (f == NULL && PyErr_Occurred())
            goto fail;
        if (f != NULL && f != Py_None) {
            if ((ld0 = item(f, 0)) == NULL || (ld1 = item(f, 1)) == NULL)
                goto fail;
            int t0 = PyObject_IsTrue(ld0), t1 = t0 ? 1 : PyObject_IsTrue(ld1);
            if (t0 < 0 || t1 < 0)
                goto fail;
            if (t0 || t1) {
                src = kvi_src_index;
            } else {
                Py_CLEAR(ld0);
                Py_CLEAR(ld1);
            }
        }
    }
    if (ld0 == NULL) {
        ld0 = Py_NewRef(kvi_ZERO);
        ld1 = Py_NewRef(kvi_ZERO);
    }
    long long pre = 0, p0;
    double dec;
    if (bs) {
        if ((got = small_int(ld0, &p0)) <= 0)
            goto bad;
        pre = -floordiv(-p0, bs);
    } else if (!PyLong_Check(ld0)) {
        got = 0;
        goto bad; /* the reference adds it nowhere, but an int is what it reports */
    }
    if ((got = as_double(ld1, &dec)) <= 0)
        goto bad;
    if (pre + qb >= EXACT || pre + qb <= -EXACT) {
        got = 0;
        goto bad;
    }
    double x = (double)(pre + qb) - score;
    double cost = scale * (0.0 > x ? 0.0 : x) + dec; /* max(x, 0.0): x unless 0.0 > x */
    if (isnan(cost) || isnan(score)) {
        got = 0;
        goto bad;
    }
    if (link != NULL) {
        PyObject *lk = PyDict_GetItemWithError(link, key);
        if (lk == NULL && PyErr_Occurred())
            goto fail;
        if (lk != NULL && lk != Py_None) {
            PyObject *ever = item(lk, 1);
            if (ever == NULL || (conn = item(lk, 0)) == NULL) {
                Py_XDECREF(ever);
                goto fail;
            }
            int t = PyObject_IsTrue(ever);
            Py_DECREF(ever);
            if (t < 0)
                goto fail;
            never = !t;
        } else {
            conn = Py_NewRef(Py_None);
        }
    } else {
        conn = Py_NewRef(Py_True);
    }
    long long pos = -1;
    if (size == 4 && small_int(PyTuple_GET_ITEM(c, 3), &pos) != 1)
        pos = -1; /* not a place: ordered by its name */
    *out = (Cand){never, cost, -score, engine, r, rk, st, wm, pb, ld0, ld1, conn, src, pos};
    return 0;
bad:
    got = got < 0 ? -1 : DECLINE;
    goto release;
fail:
    got = -1;
release:
    Py_XDECREF(name);
    Py_XDECREF(ld0);
    Py_XDECREF(ld1);
    Py_XDECREF(conn);
    return got;
}

static PyObject *
rank(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 16 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PySet_Check(args[4]) ||
        !PyUnicode_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError, "rank(list, list, dict|None, dict|None, set, dict|None, dict|None, int, "
                                         "int, float, str, type|None, type|None, int, int, int|None)");
        return NULL;
    }
    PyObject *cands = args[0], *workers = args[1], *used = args[4], *idle = args[10];
    PyObject *pred = args[2] == Py_None ? NULL : args[2], *load = args[3] == Py_None ? NULL : args[3];
    PyObject *in_flight = args[5] == Py_None ? NULL : args[5], *link = args[6] == Py_None ? NULL : args[6];
    PyObject *entry_cls = args[11] == Py_None ? NULL : args[11], *load_cls = args[12] == Py_None ? NULL : args[12];
    if ((pred && !PyDict_CheckExact(pred)) || (load && !PyDict_CheckExact(load)) ||
        (in_flight && !PyDict_CheckExact(in_flight)) || (link && !PyDict_CheckExact(link)) ||
        (entry_cls == NULL) != (load_cls == NULL))
        Py_RETURN_NONE;
    long long qb = 0, bs = 0, slot = 0, of = 1, keep = -1; /* keep < 0: every entry as objects */
    double scale = 0.0;
    int ok1 = small_int(args[7], &qb), ok2 = small_int(args[8], &bs), ok3 = as_double(args[9], &scale);
    int ok4 = small_int(args[13], &slot), ok5 = small_int(args[14], &of);
    int ok6 = args[15] == Py_None ? 1 : small_int(args[15], &keep);
    if (ok1 < 0 || ok2 < 0 || ok3 < 0 || ok4 < 0 || ok5 < 0 || ok6 < 0)
        return NULL;
    /* A slot count past 2**31 keeps slot * m exact in a long long: beyond, Python ranks. */
    if (!ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || bs < 0 || isnan(scale) || slot < 0 || slot >= of ||
        of > (1LL << 31) || (args[15] != Py_None && keep < 0))
        Py_RETURN_NONE;
    if (kvi_rankout_init() < 0)
        return NULL;

    Py_ssize_t n = PyList_GET_SIZE(cands), nw = PyList_GET_SIZE(workers);
    /* The (engine, dp_rank) key each candidate is looked up by: one tuple whose items
     * are set (borrowed) per candidate, not one made and freed per candidate. Only
     * looked up with, never stored: its items are cleared before it is released. */
    PyObject *out = NULL, *json = NULL, *key = PyTuple_New(2);
    KviShared sh = {NULL, NULL, NULL};
    size_t cap = 8;
    while (cap < 2 * (size_t)nw)
        cap <<= 1;
    MTable wms = {PyMem_Calloc(cap, sizeof(MSlot)), cap - 1};
    Cand *cs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Cand)); /* each one used is set whole */
    Py_ssize_t k = 0; /* candidates weighed (a None row is none) */
    double top = -INFINITY;
    int err = 0;      /* 1: decline; -1: error */
    if (wms.slots == NULL || cs == NULL || key == NULL) {
        err = -1;
        if (wms.slots == NULL || cs == NULL)
            PyErr_NoMemory();
        goto done;
    }
    /* (engine, dp_rank) -> match, as by_key in the reference (the last one wins). */
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *w = PyList_GET_ITEM(workers, i);
        long long wr;
        int got;
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) < 4 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(w, 2)) ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(w, 3)) || (got = small_int(PyTuple_GET_ITEM(w, 3), &wr)) == 0) {
            err = DECLINE;
            goto done;
        }
        MSlot *sl = got < 0 ? NULL : mt_slot(&wms, PyTuple_GET_ITEM(w, 2), wr);
        if (sl == NULL) {
            err = -1;
            goto done;
        }
        *sl = (MSlot){PyTuple_GET_ITEM(w, 2), wr, w};
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyList_GET_ITEM(cands, i);
        if (c == Py_None)
            continue; /* a removed worker's row */
        if ((err = weigh(c, &wms, key, pred, load, used, in_flight, link, qb, bs, scale, idle, &cs[k])) != 0)
            goto done;
        k++;
    }
    if (sort_cands(&cs, k) < 0) {
        err = -1;
        goto done;
    }
    if (of > 1 && rotate_ties(cs, k, slot, of) < 0) {
        err = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++)
        if (-cs[i].negscore > top)
            top = -cs[i].negscore; /* max(): the first of equal ones (never a -0.0 here) */
    if (keep >= 0) {
        if ((json = kvi_rank_json(cs, k)) == NULL) {
            err = PyErr_Occurred() ? -1 : DECLINE;
            goto done;
        }
    }
    Py_ssize_t made = keep >= 0 && keep < k ? (Py_ssize_t)keep : k;
    if ((out = PyList_New(made)) == NULL) {
        err = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < made; i++) {
        PyObject *entry = kvi_rank_entry(&cs[i], entry_cls, load_cls, idle, &sh);
        if (entry == NULL) {
            err = -1;
            goto done;
        }
        PyList_SET_ITEM(out, i, entry);
    }
done:
    for (Py_ssize_t i = 0; cs != NULL && i < k; i++) {
        Py_XDECREF(cs[i].ld0);
        Py_XDECREF(cs[i].ld1);
        Py_XDECREF(cs[i].conn);
    }
    PyObject *res = NULL;
    if (err == 0) {
        PyObject *best = k > 0 && cs[0].wm != NULL ? cs[0].wm : Py_None;
        /* best is held by `workers`; N steals out and json */
        res = json != NULL ? Py_BuildValue("(NdON)", json, top, best, out) : Py_BuildValue("(NdO)", out, top, best);
        out = json = NULL;
    }
    Py_XDECREF(out);
    Py_XDECREF(json);
    kvi_shared_clear(&sh);
    PyMem_Free(wms.slots);
    if (key != NULL) {
        PyTuple_SET_ITEM(key, 0, NULL); /* borrowed: not released with the tuple */
        PyTuple_SET_ITEM(key, 1, NULL);
        Py_DECREF(key);
    }
    PyMem_Free(cs);
    if (err == DECLINE) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return res;
}

KVI_HIDDEN PyMethodDef kvi_ranking_methods[] = {
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL, rank_doc},
    {NULL, NULL, 0, NULL},
};
