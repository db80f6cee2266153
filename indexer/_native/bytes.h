/* Byte-level helpers shared by the two extensions that write packed bytes: the index's
 * compiled core (core.h includes this) and the service's wire formats (api/_surface.c,
 * built with this folder on its include path). Header-only, every function static
 * inline: the hot loops of each module keep them inlined. Needs <Python.h> first. */
#ifndef KVI_BYTES_H
#define KVI_BYTES_H

#include <stdint.h>
#include <string.h>

/* Our packed columns are little-endian uint32 (the token columns block_keys reads). */
static inline void
put_le32(unsigned char *o, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(o, &v, 4); /* one store */
#else
    o[0] = (unsigned char)v;
    o[1] = (unsigned char)(v >> 8);
    o[2] = (unsigned char)(v >> 16);
    o[3] = (unsigned char)(v >> 24);
#endif
}

/* Room in ``*buf`` (``*cap`` bytes, ``len`` used) for ``more`` bytes, grown by ``re``
 * (a realloc) to ``first`` and then by doubling: 1, or 0 out of memory (nothing changed). */
static inline int
grow_room(unsigned char **buf, size_t *cap, size_t len, size_t more, size_t first, void *(*re)(void *, size_t))
{
    if (len + more <= *cap)
        return 1;
    size_t nc = *cap ? *cap : first;
    while (nc < len + more)
        nc *= 2;
    unsigned char *nb = re(*buf, nc);
    if (nb == NULL)
        return 0;
    *buf = nb;
    *cap = nc;
    return 1;
}

/* A growable byte buffer (a snapshot column, an HTTP body), PyMem-allocated. */
typedef struct {
    unsigned char *buf;
    size_t len, cap;
} Col;

/* Room for ``more`` bytes past ``len``: doubles from 4 KiB. -1 with MemoryError set. */
static inline int
col_room(Col *c, size_t more)
{
    if (grow_room(&c->buf, &c->cap, c->len, more, 4096, PyMem_Realloc))
        return 0;
    PyErr_NoMemory();
    return -1;
}

#endif /* KVI_BYTES_H */
