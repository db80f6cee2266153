/* mpwrite.h: msgpack written to a growable buffer of the C allocator's (usable without
 * the GIL), in the smallest encodings: what msgspec writes, so a body made here is
 * byte for byte the Python encoder's. Shared by recframe.c (applies' frames) and
 * recquery.c (queries' records). */
#ifndef KVI_MPWRITE_H
#define KVI_MPWRITE_H

#include "core.h"

#include <stdlib.h>

/* A growable buffer of the C allocator's (usable without the GIL). */
typedef struct {
    unsigned char *buf;
    size_t len, cap;
} Out;

/* Room for ``more`` bytes past ``len``: doubles from 8 KiB. 0 out of memory (no error set:
 * the caller may not hold the GIL). */
static inline int
room(Out *o, size_t more)
{
    return grow_room(&o->buf, &o->cap, o->len, more, 8192, realloc);
}

static inline int
put(Out *o, const void *p, size_t n)
{
    if (!room(o, n))
        return 0;
    memcpy(o->buf + o->len, p, n);
    o->len += n;
    return 1;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define KVI_BE16(x) (x)
#define KVI_BE32(x) (x)
#define KVI_BE64(x) (x)
#else
#define KVI_BE16(x) __builtin_bswap16(x)
#define KVI_BE32(x) __builtin_bswap32(x)
#define KVI_BE64(x) __builtin_bswap64(x)
#endif

/* ``tag`` and the low ``w`` bytes (1, 2, 4 or 8) of ``v``, big-endian: one store each
 * (``w`` is a constant where it is inlined; a loop of shifts was a tenth of a query's
 * record). */
static inline int
put_be(Out *o, unsigned char tag, uint64_t v, int w)
{
    if (!room(o, 9))
        return 0;
    unsigned char *b = o->buf + o->len;
    b[0] = tag;
    if (w == 1)
        b[1] = (unsigned char)v;
    else if (w == 2) {
        uint16_t x = KVI_BE16((uint16_t)v);
        memcpy(b + 1, &x, 2);
    }
    else if (w == 4) {
        uint32_t x = KVI_BE32((uint32_t)v);
        memcpy(b + 1, &x, 4);
    }
    else {
        uint64_t x = KVI_BE64(v);
        memcpy(b + 1, &x, 8);
    }
    o->len += 1 + (size_t)w;
    return 1;
}

/* msgpack, smallest encodings (what msgspec writes; any encoding reads back the same). */

/* An array's or a map's head: its fix form (``fix`` | n) under 16, else 16 or 32 bits. */
static inline int
w_count(Out *o, uint32_t n, unsigned char fix, unsigned char t16, unsigned char t32)
{
    unsigned char c = (unsigned char)(fix | n);
    return n < 16 ? put(o, &c, 1) : n < 65536 ? put_be(o, t16, n, 2) : put_be(o, t32, n, 4);
}

static inline int
w_arr(Out *o, uint32_t n)
{
    return w_count(o, n, 0x90, 0xdc, 0xdd);
}

static inline int
w_int(Out *o, int64_t v)
{
    if (v >= 0) {
        uint64_t u = (uint64_t)v;
        unsigned char c = (unsigned char)u;
        return u < 128 ? put(o, &c, 1) : u < 256 ? put_be(o, 0xcc, u, 1) : u < 65536 ? put_be(o, 0xcd, u, 2)
             : u <= 0xffffffffULL ? put_be(o, 0xce, u, 4) : put_be(o, 0xcf, u, 8);
    }
    unsigned char c = (unsigned char)(int8_t)v;
    return v >= -32 ? put(o, &c, 1) : v >= -128 ? put_be(o, 0xd0, (uint8_t)v, 1)
         : v >= -32768 ? put_be(o, 0xd1, (uint16_t)v, 2) : v >= INT32_MIN ? put_be(o, 0xd2, (uint32_t)v, 4)
         : put_be(o, 0xd3, (uint64_t)v, 8);
}

static inline int
w_f64(Out *o, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    return put_be(o, 0xcb, u, 8);
}

static inline int
w_nil(Out *o)
{
    unsigned char c = 0xc0;
    return put(o, &c, 1);
}

/* A string's head, for ``n`` bytes of UTF-8 to follow. */
static inline int
w_str_head(Out *o, size_t n)
{
    unsigned char c = (unsigned char)(0xa0 | n);
    return n < 32 ? put(o, &c, 1) : n < 256 ? put_be(o, 0xd9, n, 1) : n < 65536 ? put_be(o, 0xda, n, 2)
         : put_be(o, 0xdb, n, 4);
}

static inline int
w_str(Out *o, const char *s, size_t n)
{
    if (!room(o, 5 + n))
        return 0;
    if (n >= 32)
        return w_str_head(o, n) && put(o, s, n);
    /* A short string (a key, a name: most of a record's) copied here in two overlapping
     * moves of a fixed width: a call of memcpy each was a tenth of a route's record, a
     * byte loop as much. */
    unsigned char *b = o->buf + o->len + 1;
    b[-1] = (unsigned char)(0xa0 | n);
    if (n >= 16) {
        memcpy(b, s, 16);
        memcpy(b + n - 16, s + n - 16, 16);
    }
    else if (n >= 8) {
        memcpy(b, s, 8);
        memcpy(b + n - 8, s + n - 8, 8);
    }
    else if (n >= 4) {
        memcpy(b, s, 4);
        memcpy(b + n - 4, s + n - 4, 4);
    }
    else
        for (size_t i = 0; i < n; i++)
            b[i] = (unsigned char)s[i];
    o->len += 1 + n;
    return 1;
}

static inline int
w_bin_head(Out *o, size_t n)
{
    unsigned char b[5];
    return put(o, b, put_bin_head(b, n));
}

static inline int
w_map(Out *o, uint32_t n)
{
    return w_count(o, n, 0x80, 0xde, 0xdf);
}

static inline int
w_bool(Out *o, int v)
{
    unsigned char c = v ? 0xc3 : 0xc2;
    return put(o, &c, 1);
}

static inline int
w_bin(Out *o, const void *p, size_t n)
{
    return w_bin_head(o, n) && put(o, p, n);
}

/* An exact int's value when it is one digit or none (counts, ranks, depths: most): 1;
 * else 0 (PyLong's own reading). */
static inline int
small_long(PyObject *x, int64_t *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)x))
        return 0;
    *v = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)x);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(x);
    if (size < -1 || size > 1)
        return 0;
    *v = size == 0 ? 0 : (int64_t)size * (int64_t)((PyLongObject *)x)->ob_digit[0]; /* zero's digit is not read */
    return 1;
#endif
}

/* recvalue.c. kvi_w_obj: ``x`` as msgspec encodes it (None, bool, int, float, str, bytes,
 * tuples and their subclasses, lists, dicts): 1; 0 any other (the record is left to
 * Python); -1 out of memory; the GIL held. kvi_w_obj_reset: forget the tuples written so
 * far (a new record). */
KVI_HIDDEN int kvi_w_obj(Out *o, PyObject *x, int depth);
KVI_HIDDEN void kvi_w_obj_reset(void);

#endif
