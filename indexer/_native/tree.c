/* tree.c: the loops that change or read a tree for the GPU tier, one call per event
 * or query instead of one Python frame per block: insert_gpu and insert_gpu_raw (a
 * GPU store; store/tree.py's insert_gpu is the reference), walk (a query's GPU walk;
 * tree.walk is the reference) and remove_gpu (a GPU removal in an uncapped tree,
 * with the freeing of unheld nodes; _remove_one in store/removal.py and
 * Tree.free_up are the reference). The map probes and node reads they make per
 * block are core.h's static inline helpers. */
#include "core.h"

/* The node a worker's map names under hash h (borrowed), or NULL; *err is set on
 * an error, including a value that is not a node. */
static inline Node *
mapped_node(U64Map *wmap, PyObject *h, int *err)
{
    PyObject *v = map_lookup(wmap, h, err);
    if (v != NULL && !IS_NODE(v)) {
        PyErr_SetString(PyExc_TypeError, "a worker's hash map holds nodes only");
        *err = 1;
        return NULL;
    }
    return (Node *)v;
}

/* R-APP-4: one more announcement of a block the worker already holds. */
static int
dup_add(Node *n, PyObject *dupkey)
{
    PyObject *d = node_dup(n);
    if (d == Py_None) {
        d = PyDict_New();
        if (d == NULL)
            return -1;
        PyObject *one = PyLong_FromLong(1);
        int r = one == NULL ? -1 : PyDict_SetItem(d, dupkey, one);
        Py_XDECREF(one);
        if (r < 0) {
            Py_DECREF(d);
            return -1;
        }
        r = node_set_dup(n, d);
        Py_DECREF(d);
        return r;
    }
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "Node.dup must be None or a dict");
        return -1;
    }
    PyObject *c = PyDict_GetItemWithError(d, dupkey);
    long v = 0;
    if (c != NULL) {
        v = PyLong_AsLong(c);
        if (v == -1 && PyErr_Occurred())
            return -1;
    }
    else if (PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLong(v + 1);
    if (nv == NULL)
        return -1;
    int r = PyDict_SetItem(d, dupkey, nv);
    Py_DECREF(nv);
    return r;
}

PyDoc_STRVAR(insert_gpu_doc,
"insert_gpu(wmap, parent, hashes, keys, bit, dupkey) -> (last, created, new)\n\n"
"Attach a GPU store's blocks under `parent` for one worker: a hash the worker\n"
"already maps keeps its node (R-APP-2); a new block reuses the child with its key\n"
"or gets a new node born holding `bit`; a block the worker already holds counts\n"
"one more announcement under `dupkey` in node.dup (R-APP-4). Changes the tree,\n"
"`wmap` and the nodes' gpu and dup. Returns the last node, the nodes created\n"
"and the residencies added. Same steps as tree.insert_gpu.");

/* Room for n uint64 values, plus n flag bytes after them with `flags`: `stack` (SCRATCH
 * words) when that fits, else the heap (free it when it is not `stack`); NULL with
 * MemoryError set when the heap has none. */
#define SCRATCH 144
static uint64_t *
scratch(uint64_t *stack, Py_ssize_t n, int flags)
{
    size_t need = (size_t)n * sizeof(uint64_t) + (flags ? (size_t)n : 0);
    if (need <= SCRATCH * sizeof(uint64_t))
        return stack;
    uint64_t *p = PyMem_Malloc(need);
    if (p == NULL)
        PyErr_NoMemory();
    return p;
}

/* The loop of a GPU store (tree.insert_gpu is its reference): n blocks with hashes
 * hv[i] (ok NULL: all are uint64s; ok[i] = 0: not one, look hashes[i] up through the
 * map's dict) and keys
 * either keys[i] (a list of ints) or, with keys NULL, the xxh3-64 with `seed` of block
 * i of the little-endian uint32 `tokens` (block_size tokens a block), computed only
 * for the blocks that are new. Returns (last node, created, added). */
static PyObject *
insert_loop(U64Map *wmap, Node *parent, Py_ssize_t n, const uint64_t *hv, const char *ok, PyObject *hashes,
            PyObject *keys, const unsigned char *tokens, Py_ssize_t block_size, uint64_t seed, PyObject *bit,
            PyObject *dupkey, uint64_t *kout)
{
    Py_ssize_t created = 0, added = 0;
    /* The worker's map is the one table this loop probes per block, at a random
     * slot each time (a cache miss on any map past a few MB): grow it once for the
     * whole event, then prefetch every block's home slot, so the misses overlap
     * instead of stalling one after the other. */
    if ((wmap->used + n) * 4 > wmap->cap * 3) {
        Py_ssize_t nc = wmap->cap ? wmap->cap : 4;
        while ((wmap->used + n) * 4 > nc * 3)
            nc *= 2;
        if (kvi_map_resize(wmap, nc) < 0)
            return NULL;
    }
    {
        size_t mask = (size_t)wmap->cap - 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (ok == NULL || ok[i])
                __builtin_prefetch(&wmap->slots[(size_t)mix64(hv[i]) & mask]);
    }
    size_t step = (size_t)block_size * 4;
    Py_INCREF(parent);
    for (Py_ssize_t i = 0; i < n; i++) {
        int err = 0;
        Node *node;
        int u64 = ok == NULL || ok[i];
        if (u64) {
            Py_ssize_t j = map_find(wmap, hv[i]);
            node = j < 0 ? NULL : (Node *)wmap->slots[j].val;
            if (node != NULL && !IS_NODE(node)) {
                PyErr_SetString(PyExc_TypeError, "a worker's hash map holds nodes only");
                goto fail;
            }
        }
        else {
            node = mapped_node(wmap, PyList_GET_ITEM(hashes, i), &err);
            if (err)
                goto fail;
        }
        if (node == NULL || node->parent == kvi_DEAD) {
            uint64_t k;
            if (keys != NULL) {
                int r = as_u64(PyList_GET_ITEM(keys, i), &k);
                if (r <= 0) {
                    if (r == 0)
                        PyErr_SetString(PyExc_OverflowError, "a block key is an int in [0, 2**64)");
                    goto fail;
                }
            }
            else
                k = kvi_xxh3_64(tokens + (size_t)i * step, step, seed);
            if (kout != NULL)
                kout[i] = k;
            node = (Node *)child_of(parent, k);
            if (node == NULL) {
                /* A new block: born holding the worker's bit. */
                Node *nn = node_make(k, (PyObject *)parent, bit);
                if (nn == NULL)
                    goto fail;
                PyObject *kids = parent->kids;
                int st = 0;
                if (kids == Py_None) {
                    NODE_SET(parent->kids, (PyObject *)nn);
                }
                else if (IS_MAP(kids)) {
                    st = kvi_map_put((U64Map *)kids, k, (PyObject *)nn);
                }
                else if (!IS_NODE(kids)) {
                    PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
                    st = -1;
                }
                else { /* one child with another key: the node branches */
                    U64Map *km = map_new();
                    if (km == NULL || kvi_map_put(km, ((Node *)kids)->key, kids) < 0 ||
                        kvi_map_put(km, k, (PyObject *)nn) < 0) {
                        Py_XDECREF(km);
                        st = -1;
                    }
                    else {
                        NODE_SET(parent->kids, (PyObject *)km);
                        Py_DECREF(km);
                    }
                }
                if (st < 0 || (u64 ? kvi_map_put(wmap, hv[i], (PyObject *)nn)
                                     : kvi_map_store(wmap, PyList_GET_ITEM(hashes, i), (PyObject *)nn)) < 0) {
                    Py_DECREF(nn); /* out of memory, or a tree that is not one */
                    goto fail;
                }
                created++;
                Py_DECREF(parent);
                parent = nn; /* owns the reference from node_make */
                continue;
            }
            if ((u64 ? kvi_map_put(wmap, hv[i], (PyObject *)node)
                       : kvi_map_store(wmap, PyList_GET_ITEM(hashes, i), (PyObject *)node)) < 0)
                goto fail;
        }
        else if (kout != NULL) {
            /* A block the worker maps already: its key is not needed here, but a
             * recording keeps what its tokens hash to (kout: the key sink, core.h). */
            kout[i] = kvi_xxh3_64(tokens + (size_t)i * step, step, seed);
        }
        PyObject *m = node_gpu(node);
        PyObject *x = PyNumber_And(m, bit);
        if (x == NULL)
            goto fail;
        int held = PyObject_IsTrue(x);
        Py_DECREF(x);
        if (held < 0)
            goto fail;
        if (held) {
            if (dup_add(node, dupkey) < 0)
                goto fail;
        }
        else {
            PyObject *nm = PyNumber_Or(m, bit);
            if (nm == NULL)
                goto fail;
            node_set_gpu(node, nm); /* releases m */
            Py_DECREF(nm);
            added++;
        }
        Py_INCREF(node);
        Py_DECREF(parent);
        parent = node;
    }
    return Py_BuildValue("(Nnn)", (PyObject *)parent, created, added + created);
fail:
    Py_DECREF(parent);
    return NULL;
}

static PyObject *
insert_gpu(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyList_Check(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "insert_gpu(U64Map, Node, list, list, int, int)");
        return NULL;
    }
    PyObject *hashes = args[2], *keys = args[3];
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (PyList_GET_SIZE(keys) < n) {
        PyErr_SetString(PyExc_ValueError, "fewer keys than hashes");
        return NULL;
    }
    /* Each hash read once as a uint64 (hv; ok[i] = 0 for a bytes or out-of-range
     * hash, which goes through the map's dict): a 64-bit int is several digits, and
     * converting it costs as much as the probe it feeds. */
    uint64_t stack[SCRATCH];
    uint64_t *hv = scratch(stack, n, 1);
    if (hv == NULL)
        return NULL;
    char *ok = (char *)(hv + n);
    PyObject *res = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = as_u64(PyList_GET_ITEM(hashes, i), &hv[i]);
        if (r < 0)
            goto done;
        ok[i] = (char)r;
    }
    res = insert_loop((U64Map *)args[0], (Node *)args[1], n, hv, ok, hashes, keys, NULL, 0, 0, args[4], args[5], NULL);
done:
    if (hv != stack)
        PyMem_Free(hv);
    return res;
}

PyDoc_STRVAR(insert_gpu_raw_doc,
"insert_gpu_raw(wmap, parent, hashes, tokens, block_size, seed, bit, dupkey) -> (last, created, new)\n\n"
"insert_gpu for a store read by scan_gpu_batch: `hashes` the little-endian uint64\n"
"engine hashes (bytes), `tokens` the little-endian uint32 token ids (bytes, block_size\n"
"a block, at least as many blocks as hashes); each new block's key is the xxh3-64 of\n"
"its tokens with `seed` (keys.block_keys), computed only for blocks that are new.");

static PyObject *
insert_gpu_raw(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyBytes_Check(args[2]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "insert_gpu_raw(U64Map, Node, bytes, bytes, int, int, int, int)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[4]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[5]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t hlen = PyBytes_GET_SIZE(args[2]), tlen = PyBytes_GET_SIZE(args[3]);
    Py_ssize_t n = hlen / 8;
    if (bs <= 0 || hlen % 8 || tlen < n * bs * 4) {
        PyErr_SetString(PyExc_ValueError, "insert_gpu_raw: hashes must be 8-byte values and tokens cover every block");
        return NULL;
    }
    uint64_t stack[SCRATCH];
    uint64_t *hv = scratch(stack, n, 0);
    if (hv == NULL)
        return NULL;
    const unsigned char *hb = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    for (Py_ssize_t i = 0; i < n; i++)
        hv[i] = get_le64(hb + i * 8);
    /* The key sink (core.h), if a recording's journal opened it: this store's keys go
     * there, found by the tokens bytes scan_gpu_batch made for it. */
    KeySink *ks = sink_here();
    SinkStore *ss = NULL;
    if (ks != NULL && ks->scanned == 1 && (uint64_t)seed == ks->seed) {
        for (uint32_t j = 0; j < ks->nstores && ss == NULL; j++)
            if (ks->stores[j].tokens == args[3] && ks->stores[j].nblocks == (uint64_t)n && !ks->stores[j].keyed)
                ss = &ks->stores[j];
    }
    PyObject *res = insert_loop((U64Map *)args[0], (Node *)args[1], n, hv, NULL, NULL, NULL,
                                (const unsigned char *)PyBytes_AS_STRING(args[3]), bs, (uint64_t)seed, args[6],
                                args[7], ss != NULL ? ks->keys + ss->keys_at : NULL);
    if (ss != NULL && res != NULL)
        ss->keyed = 1;
    if (hv != stack)
        PyMem_Free(hv);
    return res;
}

PyDoc_STRVAR(walk_doc,
"walk(root, chunks, keep_path) -> (depth, stops, active, path)\n\n"
"Follow the query's block keys (an iterable of lists) down from `root` while a\n"
"child matches. `active` starts as every worker (-1) and narrows to the workers\n"
"whose GPU run is unbroken; `stops` gets (depth, mask) where runs end. Without\n"
"`keep_path` the walk also stops when no worker is left; with it, `path` lists\n"
"the nodes passed (for the other tiers' chunk scan). A chunk may also be bytes of\n"
"little-endian uint64 keys (block_keys with packed). Read-only. Same steps as\n"
"tree.walk.");

static PyObject *
walk(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "walk(Node, iterable of lists, bool)");
        return NULL;
    }
    Node *node = (Node *)args[0];
    int keep = PyObject_IsTrue(args[2]);
    if (keep < 0)
        return NULL;
    PyObject *stops = PyList_New(0);
    PyObject *path = keep ? PyList_New(0) : (Py_INCREF(Py_None), Py_None);
    PyObject *active = PyLong_FromLong(-1);
    PyObject *it = NULL, *chunk = NULL;
    Py_ssize_t d = 0;
    if (stops == NULL || path == NULL || active == NULL)
        goto fail;
    it = PyObject_GetIter(args[1]);
    if (it == NULL)
        goto fail;
    int done = 0;
    while (!done && (chunk = PyIter_Next(it)) != NULL) {
        /* A bytes chunk is packed keys (block_keys with packed): no int object per key. */
        const unsigned char *packed = NULL;
        PyObject *seq;
        Py_ssize_t n;
        PyObject **items = NULL;
        if (PyBytes_CheckExact(chunk)) {
            seq = chunk;
            packed = (const unsigned char *)PyBytes_AS_STRING(chunk);
            n = PyBytes_GET_SIZE(chunk) / 8;
        }
        else {
            seq = PySequence_Fast(chunk, "walk: key chunks must be sequences");
            Py_DECREF(chunk);
            if (seq == NULL) {
                chunk = NULL;
                goto fail;
            }
            n = PySequence_Fast_GET_SIZE(seq);
            items = PySequence_Fast_ITEMS(seq);
        }
        chunk = NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k;
            int r = packed != NULL ? (k = get_le64(packed + 8 * i), 1) : as_u64(items[i], &k);
            if (r < 0) {
                Py_DECREF(seq);
                goto fail;
            }
            Node *next = r ? (Node *)child_of(node, k) : NULL;
            if (next == NULL) {
                done = 1;
                break;
            }
            node = next;
            if (keep) {
                if (PyList_Append(path, (PyObject *)node) < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
            }
            else {
                int t = PyObject_IsTrue(active);
                if (t < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
                if (!t) {
                    done = 1;
                    break;
                }
            }
            PyObject *nm = PyNumber_And(active, node_gpu(node));
            if (nm == NULL) {
                Py_DECREF(seq);
                goto fail;
            }
            int same = nm == active ? 1 : PyObject_RichCompareBool(nm, active, Py_EQ);
            if (same < 0) {
                Py_DECREF(nm);
                Py_DECREF(seq);
                goto fail;
            }
            if (!same) {
                if (d) {
                    PyObject *gone = PyNumber_Xor(active, nm);
                    PyObject *st = gone == NULL ? NULL : Py_BuildValue("(nN)", d, gone);
                    if (st == NULL || PyList_Append(stops, st) < 0) {
                        Py_XDECREF(st);
                        Py_DECREF(nm);
                        Py_DECREF(seq);
                        goto fail;
                    }
                    Py_DECREF(st);
                }
                Py_DECREF(active);
                active = nm;
            }
            else
                Py_DECREF(nm);
            d++;
        }
        Py_DECREF(seq);
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    return Py_BuildValue("(nNNN)", d, stops, active, path);
fail:
    Py_XDECREF(it);
    Py_XDECREF(stops);
    Py_XDECREF(path);
    Py_XDECREF(active);
    return NULL;
}

/* Does the worker (bit) hold `n` in a tier other than GPU? (tiers: {tid: mask},
 * chunk-end masks under -tid) */
static int
holds_other(Node *n, PyObject *bit)
{
    PyObject *t = node_tiers(n), *k, *v;
    Py_ssize_t pos = 0;
    if (t == Py_None)
        return 0;
    if (!PyDict_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "Node.tiers must be None or a dict");
        return -1;
    }
    while (PyDict_Next(t, &pos, &k, &v)) {
        long tid = PyLong_AsLong(k);
        if (tid == -1 && PyErr_Occurred())
            return -1;
        if (tid <= 0)
            continue;
        PyObject *x = PyNumber_And(v, bit);
        if (x == NULL)
            return -1;
        int r = PyObject_IsTrue(x);
        Py_DECREF(x);
        if (r != 0)
            return r;
    }
    return 0;
}

/* Tree.free_up for an uncapped tree: free `n` and then its ancestors while they
 * are leaves nobody holds (R-APP-9). Returns the nodes freed, -1 on error. */
static Py_ssize_t
free_up(Node *n, PyObject *root)
{
    Py_ssize_t freed = 0;
    Py_INCREF(n);
    while ((PyObject *)n != root && n->kids == Py_None && node_tiers(n) == Py_None) {
        int held = PyObject_IsTrue(node_gpu(n));
        if (held != 0) {
            if (held < 0)
                goto fail;
            break;
        }
        PyObject *p = n->parent;
        if (p == kvi_DEAD || !IS_NODE(p))
            break;
        Node *parent = (Node *)p;
        Py_INCREF(parent);
        PyObject *kids = parent->kids;
        if (kids == (PyObject *)n) {
            NODE_SET(parent->kids, Py_None);
        }
        else if (IS_MAP(kids)) {
            U64Map *km = (U64Map *)kids;
            Py_ssize_t i = map_find(km, n->key);
            if (i >= 0)
                Py_DECREF(kvi_map_take(km, (size_t)i));
            if (km->used == 1 && km->other == NULL) {
                for (Py_ssize_t j = 0; j < km->cap; j++) {
                    if (km->slots[j].val != NULL) {
                        PyObject *only = km->slots[j].val;
                        Py_INCREF(only);
                        NODE_SET(parent->kids, only); /* releases the map */
                        Py_DECREF(only);
                        break;
                    }
                }
            }
        }
        NODE_SET(n->parent, kvi_DEAD);
        node_set_dup(n, Py_None); /* frees the Side (tiers is None): cannot fail */
        freed++;
        Py_DECREF(n);
        n = parent;
    }
    Py_DECREF(n);
    return freed;
fail:
    Py_DECREF(n);
    return -1;
}

PyDoc_STRVAR(remove_gpu_doc,
"remove_gpu(wmap, root, hashes, bit, dupkey) -> (cleared, unknown, freed)\n\n"
"One BlockRemoved of GPU blocks for one worker in an uncapped tree: each hash\n"
"the worker holds loses one announcement (R-APP-4: a count above one just goes\n"
"down); a block the worker no longer holds in any tier leaves `wmap`, and nodes\n"
"nobody holds are freed up the chain (R-APP-9). Changes the tree, `wmap` and the\n"
"nodes. Returns the residencies cleared (announcements counted down do not\n"
"count), the hashes not held, the nodes freed.\n"
"Same steps as PrefixIndex._remove_one with Tree.free_up.");

static PyObject *
remove_gpu(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !IS_MAP(args[0]) || !IS_NODE(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "remove_gpu(U64Map, Node, list, int, int)");
        return NULL;
    }
    U64Map *wmap = (U64Map *)args[0];
    PyObject *root = args[1], *hashes = args[2], *bit = args[3], *dupkey = args[4];
    Py_ssize_t cleared = 0, unknown = 0, freed = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        int err;
        Node *n = mapped_node(wmap, h, &err);
        if (err)
            return NULL;
        if (n == NULL) {
            unknown++;
            continue;
        }
        Py_INCREF(n);
        if (n->parent == kvi_DEAD) { /* freed by the node cap: forget the mapping */
            PyObject *old = kvi_map_pop(wmap, h);
            Py_XDECREF(old);
            Py_DECREF(n);
            if (old == NULL)
                return NULL;
            unknown++;
            continue;
        }
        PyObject *x = PyNumber_And(node_gpu(n), bit);
        int held = x == NULL ? -1 : PyObject_IsTrue(x);
        Py_XDECREF(x);
        if (held <= 0) {
            Py_DECREF(n);
            if (held < 0)
                return NULL;
            unknown++;
            continue;
        }
        PyObject *dup = node_dup(n);
        if (dup != Py_None && PyDict_Check(dup)) {
            Py_INCREF(dup); /* setting node.dup to None below would free it */
            PyObject *c = PyDict_GetItemWithError(dup, dupkey);
            long v = c == NULL ? 0 : PyLong_AsLong(c);
            if (v > 0) { /* one of several announcements: the count goes down */
                int r;
                if (v == 1) {
                    r = PyDict_DelItem(dup, dupkey);
                    if (r == 0 && PyDict_GET_SIZE(dup) == 0)
                        r = node_set_dup(n, Py_None);
                }
                else {
                    PyObject *nv = PyLong_FromLong(v - 1);
                    r = nv == NULL ? -1 : PyDict_SetItem(dup, dupkey, nv);
                    Py_XDECREF(nv);
                }
                Py_DECREF(dup);
                Py_DECREF(n);
                if (r < 0)
                    return NULL;
                continue;
            }
            Py_DECREF(dup);
            if (PyErr_Occurred()) { /* the lookup, or a count that is not an int */
                Py_DECREF(n);
                return NULL;
            }
        }
        PyObject *nm = PyNumber_Xor(node_gpu(n), bit);
        if (nm == NULL) {
            Py_DECREF(n);
            return NULL;
        }
        node_set_gpu(n, nm);
        Py_DECREF(nm);
        cleared++;
        int other = holds_other(n, bit);
        if (other == 0) {
            PyObject *old = kvi_map_pop(wmap, h);
            Py_ssize_t f = old == NULL ? -1 : free_up(n, root);
            Py_XDECREF(old);
            if (f < 0) {
                Py_DECREF(n);
                return NULL;
            }
            freed += f;
        }
        Py_DECREF(n);
        if (other < 0)
            return NULL;
    }
    return Py_BuildValue("(nnn)", cleared, unknown, freed);
}

KVI_HIDDEN PyMethodDef kvi_tree_methods[] = {
    {"insert_gpu", (PyCFunction)(void (*)(void))insert_gpu, METH_FASTCALL, insert_gpu_doc},
    {"insert_gpu_raw", (PyCFunction)(void (*)(void))insert_gpu_raw, METH_FASTCALL, insert_gpu_raw_doc},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"remove_gpu", (PyCFunction)(void (*)(void))remove_gpu, METH_FASTCALL, remove_gpu_doc},
    {NULL, NULL, 0, NULL},
};
