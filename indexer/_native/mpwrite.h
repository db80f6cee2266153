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

static inline int
put_be(Out *o, unsigned char tag, uint64_t v, int w)
{
    unsigned char b[9];
    b[0] = tag;
    for (int i = 0; i < w; i++)
        b[1 + i] = (unsigned char)(v >> (8 * (w - 1 - i)));
    return put(o, b, (size_t)w + 1);
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

static inline int
w_str(Out *o, const char *s, size_t n)
{
    unsigned char c = (unsigned char)(0xa0 | n);
    int ok = n < 32 ? put(o, &c, 1) : n < 256 ? put_be(o, 0xd9, n, 1) : n < 65536 ? put_be(o, 0xda, n, 2)
           : put_be(o, 0xdb, n, 4);
    return ok && put(o, s, n);
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

#endif
