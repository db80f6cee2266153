/* reader.h: a msgpack reader over bytes, with no Python object: what events.c
 * (scan_gpu_batch, tokens_from_msgpack) and recframe.c (a recording's payloads, read
 * without the GIL) parse vLLM's events with, and the one rule of a plain GPU store both
 * take (scan_plain_store). Header-only, every function static inline
 * (the decode's hottest loops keep them inlined). Needs core.h first. */
#ifndef KVI_READER_H
#define KVI_READER_H

/* A msgpack reader over [p, end): each rd_* consumes one value of its kind and
 * returns 1, or returns 0 and consumes nothing when the next value is another kind
 * (or truncated). */
typedef struct {
    const unsigned char *p, *end;
} Rd;

static inline int
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

static inline int
rd_nil(Rd *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

static inline int
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
static inline int
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

/* A batch's ts (a float64, a float32 or an int) at r as a double: 1, r past it; 0 for
 * anything else, or a NaN or infinite one (decode_batch refuses those batches). */
static inline int
rd_ts(Rd *r, double *ts)
{
    if (r->p >= r->end)
        return 0;
    unsigned char c = *r->p;
    if (c == 0xcb && r->end - r->p >= 9) {
        uint64_t u = be(r->p + 1, 8);
        memcpy(ts, &u, 8);
        r->p += 9;
    }
    else if (c == 0xca && r->end - r->p >= 5) {
        uint32_t u = (uint32_t)be(r->p + 1, 4);
        float fl;
        memcpy(&fl, &u, 4);
        *ts = fl;
        r->p += 5;
    }
    else {
        uint64_t v;
        int neg;
        if (!rd_int(r, &v, &neg))
            return 0;
        *ts = neg ? (double)(int64_t)v : (double)v;
    }
    return *ts - *ts == 0.0;
}

/* ``n`` ints in [0, 2**32) (an array's elements, its header read) at r as little-endian
 * uint32 into ``o`` (4 n bytes): 1, r past them; 0 for anything else (r somewhere
 * inside). No Python object: callable without the GIL. */
static inline int
rd_token_values(Rd *r, unsigned char *o, uint32_t n)
{
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
            if (!rd_int(r, &v, &neg) || neg || v > 0xffffffffULL)
                return 0;
            p = r->p;
            t = (uint32_t)v;
        }
        put_le32(q, t);
        i++;
    }
    r->p = p;
    r->p = p;
    return 1;
}

static inline int
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

/* The K_* bit of a BlockStored field's name; 0 for a field we do not know. Lengths
 * are compared first (a load and a compare per entry: this runs per field of every
 * event applied). */
static inline unsigned
field_bit(const char *k, uint32_t kl)
{
    static const struct {
        const char *name;
        uint32_t len;
        unsigned bit;
    } fields[] = {
        {"type", 4, K_TYPE},
        {"block_hashes", 12, K_HASHES},
        {"parent_block_hash", 17, K_PARENT},
        {"token_ids", 9, K_TOKENS},
        {"block_size", 10, K_BS},
        {"lora_id", 7, K_LORA_ID},
        {"medium", 6, K_MEDIUM},
        {"lora_name", 9, K_LORA_NAME},
        {"extra_keys", 10, K_EXTRA},
        {"group_idx", 9, K_GROUP},
        {"kv_cache_spec_kind", 18, K_KIND},
        {"kv_cache_spec_sliding_window", 28, K_SWA},
        {"locality", 8, K_LOCALITY},
        {"ownership", 9, K_OWNERSHIP},
        {"session_id", 10, K_SESSION},
        {"lookahead_token_ids", 19, K_LOOKAHEAD},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (kl == fields[i].len && memcmp(k, fields[i].name, kl) == 0)
            return fields[i].bit;
    return 0;
}

/* ------------------------------------------------- a plain GPU BlockStored */

/* Where scan_plain_store writes a store's block hashes (uint64 LE, 8 bytes a block) and
 * its token ids (uint32 LE): room(ctx, which, bytes) returns a buffer of that many
 * bytes for PS_HASHES or PS_TOKENS, or NULL (out of memory; then the scan returns -1). */
enum { PS_HASHES = 0, PS_TOKENS = 1 };
typedef struct {
    unsigned char *(*room)(void *ctx, int which, size_t bytes);
    void *ctx;
} PlainSink;

/* What scan_plain_store read of one store, besides what it wrote to its sink. */
typedef struct {
    const unsigned char *tok_at, *tok_end; /* the token_ids value's bytes */
    uint64_t nblocks, bs, parent, group;
    int has_parent, has_group, group_neg;
    const char *kind; /* kv_cache_spec_kind's bytes (not checked as UTF-8), or NULL: nil or absent */
    uint32_t kind_n;
} PlainStore;

/* One BlockStored map at r of the plain GPU shape: int hashes (at least one),
 * block_size > 0, token ids for every block, medium GPU or absent, no LoRA, extra keys,
 * locality, ownership or lookahead tokens, and no field the decoder does not know
 * (events.c's scan_gpu_batch, recframe.c's hashed payloads: one rule for both). 1, r
 * past the map, *st set and the hashes and tokens written to the sink; 0 any other
 * shape (r somewhere inside); -1 the sink had no room. No Python object is made. */
static inline int
scan_plain_store(Rd *r, PlainStore *st, const PlainSink *sink)
{
    uint32_t nk;
    if (!rd_len(r, 0x80, 0x8f, 0xde, 0xdf, &nk))
        return 0;
    unsigned seen = 0;
    uint64_t ntok = 0;
    *st = (PlainStore){0};
    for (uint32_t f = 0; f < nk; f++) {
        const char *k, *sv;
        uint32_t kl, sl, n;
        uint64_t v;
        int neg;
        unsigned char *o;
        if (!rd_str(r, &k, &kl))
            return 0;
        unsigned bitv = field_bit(k, kl);
        if (bitv == 0 || (seen & bitv))
            return 0; /* a field we do not know (the decoder counts it), or one twice */
        seen |= bitv;
        switch (bitv) {
        case K_TYPE:
            if (!rd_str(r, &sv, &sl) || !str_is(sv, sl, "BlockStored"))
                return 0;
            break;
        case K_HASHES:
            if (!rd_len(r, 0x90, 0x9f, 0xdc, 0xdd, &n) || n == 0 || n > (uint64_t)(r->end - r->p))
                return 0;
            if ((o = sink->room(sink->ctx, PS_HASHES, (size_t)n * 8)) == NULL)
                return -1;
            for (uint32_t i = 0; i < n; i++) {
                if (!rd_int(r, &v, &neg) || neg)
                    return 0; /* bytes digests, negative ints: the decoder's path */
                put_le64(o + (size_t)i * 8, v);
            }
            st->nblocks = n;
            break;
        case K_PARENT:
            if (rd_nil(r))
                break;
            if (!rd_int(r, &v, &neg) || neg)
                return 0;
            st->parent = v;
            st->has_parent = 1;
            break;
        case K_TOKENS:
            st->tok_at = r->p;
            if (!rd_len(r, 0x90, 0x9f, 0xdc, 0xdd, &n) || n > (uint64_t)(r->end - r->p))
                return 0; /* every element takes at least one byte */
            if ((o = sink->room(sink->ctx, PS_TOKENS, (size_t)n * 4)) == NULL)
                return -1;
            if (!rd_token_values(r, o, n))
                return 0;
            ntok = n;
            st->tok_end = r->p;
            break;
        case K_BS:
            if (!rd_int(r, &v, &neg) || neg || v == 0 || v > 0x7fffffff)
                return 0; /* 0 (a placeholder) or a bad size: the general path */
            st->bs = v;
            break;
        case K_LORA_ID: /* not part of a key (lora_name is) */
        case K_SWA:
            if (!rd_nil(r) && !rd_int(r, &v, &neg))
                return 0;
            break;
        case K_MEDIUM:
            if (!rd_nil(r) && (!rd_str(r, &sv, &sl) || !str_is(sv, sl, "GPU")))
                return 0;
            break;
        case K_LORA_NAME:
        case K_EXTRA:
        case K_LOCALITY:
        case K_OWNERSHIP:
        case K_LOOKAHEAD:
            if (!rd_nil(r))
                return 0;
            break;
        case K_GROUP:
            if (rd_nil(r))
                break;
            if (!rd_int(r, &v, &neg))
                return 0;
            st->group = v;
            st->group_neg = neg;
            st->has_group = 1;
            break;
        case K_KIND:
            if (rd_nil(r))
                break;
            if (!rd_str(r, &sv, &sl))
                return 0;
            st->kind = sv;
            st->kind_n = sl;
            break;
        case K_SESSION:
            if (!rd_nil(r) && !rd_str(r, &sv, &sl))
                return 0;
            break;
        }
    }
    return (seen & K_TYPE) && (seen & K_HASHES) && (seen & K_TOKENS) && (seen & K_BS) && ntok == st->nblocks * st->bs;
}

#endif /* KVI_READER_H */
