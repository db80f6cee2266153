/* recvalue.c: a Python value as msgspec encodes it, written by the compiled encoder of a
 * recording's records (recquery.c) on the calling thread: kvi_w_obj, for the types a
 * record holds, and its memo of the tuples a record repeats.
 *
 * Why so careful: a query's record is written while the query's caller waits, and most
 * of it is the answer's values (~220 for a match over 8 workers). Through PyLong's and
 * PyUnicode's functions and a byte at a time, each cost ~60-80 instructions, +75% of an
 * in-process match_plain's (benchmarks/cg_record.py); read in place, written in one
 * store, the commonest kinds first and inlined, and a stop's shared tuples copied, the
 * whole record is ~+36%. */
#include "mpwrite.h"

#define DEPTH_MAX 32

/* The tuples of this record's encoding that hold a tuple, with where their bytes are
 * (``o`` the buffer): an answer repeats its stop's tuples in each of its workers
 * (answers.c: the tier and group items), written again from here. The journal's objects
 * live while their record is encoded (the GIL held, no Python run), so an address is one
 * object; recquery.c's encode_in empties it (kvi_w_obj_reset). */
#define MEMO_N 16
static struct {
    const Out *o;
    unsigned n;
    PyObject *x[MEMO_N];
    size_t at[MEMO_N], len[MEMO_N];
} memo;

/* Whether the tuple ``x`` holds a tuple or a list. */
static inline int
nests(PyObject *x)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(x); i++) {
        PyTypeObject *t = Py_TYPE(PyTuple_GET_ITEM(x, i));
        if (t == &PyList_Type || PyType_FastSubclass(t, Py_TPFLAGS_TUPLE_SUBCLASS))
            return 1;
    }
    return 0;
}

/* ``x``'s bytes again when this record wrote it to ``o`` already: 1; 0 not; -1 out of memory. */
static int
memo_put(Out *o, PyObject *x)
{
    if (memo.o != o)
        return 0;
    unsigned n = memo.n < MEMO_N ? memo.n : MEMO_N;
    for (unsigned i = 0; i < n; i++)
        if (memo.x[i] == x) {
            size_t at = memo.at[i], len = memo.len[i];
            if (!room(o, len))
                return -1;
            memcpy(o->buf + o->len, o->buf + at, len); /* after room: the buffer may have moved */
            o->len += len;
            return 1;
        }
    return 0;
}

static void
memo_add(const Out *o, PyObject *x, size_t at)
{
    if (memo.o != o) {
        memo.o = o;
        memo.n = 0;
    }
    unsigned i = memo.n++ % MEMO_N;
    memo.x[i] = x;
    memo.at[i] = at;
    memo.len[i] = o->len - at;
}

/* ``x`` when it is a float, a one-digit int, None, a bool or an ASCII string (most of an
 * answer's values), written here, inlined in the loops: 1; 0 another kind (w_other's); -1
 * out of memory. */
static inline __attribute__((always_inline)) int
w_leaf(Out *o, PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    int64_t v;
    if (t == &PyFloat_Type)
        return w_f64(o, PyFloat_AS_DOUBLE(x)) ? 1 : -1;
    if (t == &PyLong_Type)
        return !small_long(x, &v) ? 0 : w_int(o, v) ? 1 : -1;
    if (t == &PyUnicode_Type)
        return !PyUnicode_IS_COMPACT_ASCII(x) ? 0
             : w_str(o, (const char *)((PyASCIIObject *)x + 1), (size_t)PyUnicode_GET_LENGTH(x)) ? 1 : -1;
    if (x == Py_None)
        return w_nil(o) ? 1 : -1;
    if (t == &PyBool_Type)
        return w_bool(o, x == Py_True) ? 1 : -1;
    return 0;
}

static int w_other(Out *o, PyObject *x, int depth);

/* ``x`` as msgspec encodes it: a leaf written inline, anything else by w_other. */
static inline __attribute__((always_inline)) int
w_value(Out *o, PyObject *x, int depth)
{
    int r = w_leaf(o, x);
    return r != 0 ? r : w_other(o, x, depth);
}

/* What w_leaf does not write: an int past one digit, a string not ASCII, bytes, tuples
 * (and their subclasses), lists and dicts. 1; 0 any other (the record is left to Python);
 * -1 out of memory. */
static int
w_other(Out *o, PyObject *x, int depth)
{
    PyTypeObject *t = Py_TYPE(x);
    if (t == &PyUnicode_Type) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(x, &n);
        if (s == NULL) {
            PyErr_Clear(); /* a lone surrogate: msgspec's error, in Python */
            return 0;
        }
        return w_str(o, s, (size_t)n) ? 1 : -1;
    }
    if (t == &PyLong_Type) {
        int of;
        long long v = PyLong_AsLongLongAndOverflow(x, &of);
        if (of == 0)
            return w_int(o, v) ? 1 : -1;
        if (of < 0)
            return 0;
        unsigned long long u = PyLong_AsUnsignedLongLong(x);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0; /* past uint64: msgspec refuses it, as the Python encoder would */
        }
        return put_be(o, 0xcf, u, 8) ? 1 : -1;
    }
    if (t == &PyBytes_Type)
        return w_bin(o, PyBytes_AS_STRING(x), (size_t)PyBytes_GET_SIZE(x)) ? 1 : -1;
    if (depth >= DEPTH_MAX)
        return 0;
    if (t == &PyList_Type || PyTuple_Check(x)) { /* a NamedTuple is an array to msgspec */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
        int shared = t != &PyList_Type && depth >= 2 && n <= 4 && nests(x); /* a stop's, not a worker's */
        if (shared) {
            int r = memo_put(o, x);
            if (r != 0)
                return r;
        }
        size_t at = o->len;
        if (!w_arr(o, (uint32_t)n))
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* a list's items are read again each time: a value's encoding runs no Python */
            int r = w_value(o, PySequence_Fast_GET_ITEM(x, i), depth + 1);
            if (r <= 0)
                return r;
        }
        if (shared)
            memo_add(o, x, at);
        return 1;
    }
    if (t == &PyDict_Type) {
        if (!w_map(o, (uint32_t)PyDict_GET_SIZE(x)))
            return -1;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(x, &pos, &k, &v)) {
            int r = w_value(o, k, depth + 1);
            if (r > 0)
                r = w_value(o, v, depth + 1);
            if (r <= 0)
                return r;
        }
        return 1;
    }
    return 0;
}

/* ``x`` as msgspec encodes it, for the types a record holds (None, bool, int, float,
 * str, bytes, tuples and their subclasses, lists, dicts): 1; 0 any other (the record
 * is left to Python); -1 out of memory. The commonest types are tried first, each by its
 * type's address; an int of one digit and an ASCII string are read in place (through
 * PyLong and PyUnicode's functions, each value of a route's answer cost ~60
 * instructions). */
KVI_HIDDEN int
kvi_w_obj(Out *o, PyObject *x, int depth)
{
    return w_value(o, x, depth);
}

KVI_HIDDEN void
kvi_w_obj_reset(void)
{
    memo.o = NULL;
}
