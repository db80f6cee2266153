/* snapshot.c: a snapshot's columns (store/snapshot.py), dumped and loaded with no
 * Python object per node or entry: dump_tree, dump_map, node_index (and its NodeIndex
 * table), translate, load_tree, load_map. */
#include "core.h"

/* snapshot.py's four hot loops. A tree is dumped as little-endian columns in
 * preorder (node 0 the root): parent index (uint32), key (uint64), GPU-mask id
 * (uint32); a worker's map as (uint64 hash, uint32 node index) columns. The
 * pure twins, snapshot._py_dump_tree and friends, are the reference: same
 * visiting order, so the same bytes. */

/* NodeIndex: a node's address -> its uint32 index in a dumped tree (node_index).
 * The addresses are what dump_tree and dump_map read under the index lock; the
 * table is built and asked after it, so it holds no node and reads none: only
 * integers. Open addressing, 16-byte slots, load at most 3/4: at 10^7 nodes a
 * few hundred MB less than a dict of int objects. */

typedef struct {
    uint64_t addr; /* 0: empty slot (no object lives at address 0) */
    uint32_t idx;
} IdxSlot;

typedef struct {
    PyObject_HEAD
    IdxSlot *slots;  /* NULL while cap == 0 */
    Py_ssize_t cap;  /* a power of two, or 0 */
    Py_ssize_t used;
} NodeIndex;

/* Nodes are 48-byte objects and a tree's chains are mostly allocated in a row:
 * a / 48 numbers the nodes of one allocator pool consecutively (they sit at
 * pool start + 48 * i), so four neighbours in memory hash to one 64-byte line of
 * four slots and a preorder fill misses the cache about once per line, not per
 * node. The lines themselves are spread by mix64. (a >> 6 alone, right for the
 * old 64-byte nodes, gives two of every five 48-byte neighbours the same slot.) */
static inline size_t
ptr_slot(uint64_t a, size_t mask)
{
    uint64_t q = a / sizeof(Node);
    return (size_t)((mix64(q >> 2) << 2) | (q & 3)) & mask;
}

/* The slot of `addr`, or -1. */
static inline Py_ssize_t
nidx_find(NodeIndex *w, uint64_t addr)
{
    if (w->cap == 0 || addr == 0)
        return -1;
    size_t mask = (size_t)w->cap - 1;
    size_t i = ptr_slot(addr, mask);
    for (;;) {
        IdxSlot *s = &w->slots[i];
        if (s->addr == 0)
            return -1;
        if (s->addr == addr)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

static NodeIndex *
nidx_new(Py_ssize_t n)
{
    Py_ssize_t cap = 64;
    while (n * 4 > cap * 3)
        cap *= 2;
    NodeIndex *w = PyObject_New(NodeIndex, &kvi_NodeIndexType);
    if (w == NULL)
        return NULL;
    w->slots = PyMem_Calloc((size_t)cap, sizeof(IdxSlot));
    w->cap = cap;
    w->used = 0;
    if (w->slots == NULL) {
        w->cap = 0;
        Py_DECREF(w);
        PyErr_NoMemory();
        return NULL;
    }
    return w;
}

/* Add addr -> idx (the table is sized for every address already). 1: added; 0: the
 * address is there already. */
static int
nidx_add(NodeIndex *w, uint64_t addr, uint32_t idx)
{
    size_t mask = (size_t)w->cap - 1;
    size_t i = ptr_slot(addr, mask);
    while (w->slots[i].addr != 0) {
        if (w->slots[i].addr == addr)
            return 0;
        i = (i + 1) & mask;
    }
    w->slots[i].addr = addr;
    w->slots[i].idx = idx;
    w->used++;
    return 1;
}

static void
NodeIndex_dealloc(NodeIndex *w)
{
    PyMem_Free(w->slots);
    PyObject_Free(w);
}

static Py_ssize_t
NodeIndex_length(NodeIndex *w)
{
    return w->used;
}

/* An address from Python: an int in [0, 2**64); -1 with an error otherwise. */
static int
addr_of(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a node's address is an int");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        *out = 0; /* negative or too large: no node lives there */
        return 0;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
NodeIndex_get(NodeIndex *w, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get() takes 1 or 2 arguments");
        return NULL;
    }
    uint64_t a;
    if (addr_of(args[0], &a) < 0)
        return NULL;
    Py_ssize_t i = nidx_find(w, a);
    if (i < 0) {
        PyObject *d = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(d);
        return d;
    }
    return PyLong_FromUnsignedLong(w->slots[i].idx);
}

static int
NodeIndex_contains(NodeIndex *w, PyObject *o)
{
    uint64_t a;
    if (addr_of(o, &a) < 0)
        return -1;
    return nidx_find(w, a) >= 0;
}

static PyObject *
NodeIndex_sizeof(NodeIndex *w, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(NodeIndex) + w->cap * (Py_ssize_t)sizeof(IdxSlot));
}

static PyMethodDef NodeIndex_methods[] = {
    {"get", (PyCFunction)(void (*)(void))NodeIndex_get, METH_FASTCALL,
     "get(address, default=None): the index of the node at that address"},
    {"__sizeof__", (PyCFunction)NodeIndex_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods NodeIndex_as_mapping = {
    .mp_length = (lenfunc)NodeIndex_length,
};

static PySequenceMethods NodeIndex_as_sequence = {
    .sq_contains = (objobjproc)NodeIndex_contains,
};

KVI_HIDDEN PyTypeObject kvi_NodeIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.NodeIndex",
    .tp_doc = "Node (by identity) -> its index in a dump_tree walk; made by dump_tree only.",
    .tp_basicsize = sizeof(NodeIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)NodeIndex_dealloc,
    .tp_as_mapping = &NodeIndex_as_mapping,
    .tp_as_sequence = &NodeIndex_as_sequence,
    .tp_methods = NodeIndex_methods,
};

typedef struct {
    PyObject *node; /* a strong reference */
    uint32_t parent;
} Frame;

typedef struct {
    Frame *items;
    size_t n, cap;
} Stack;

/* Push `child` (a new reference is taken) with its parent's index. */
static int
stack_push(Stack *s, PyObject *child, uint32_t parent)
{
    if (!IS_NODE(child)) {
        PyErr_SetString(PyExc_TypeError, "a node's children are nodes");
        return -1;
    }
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 256;
        Frame *ni = PyMem_Realloc(s->items, nc * sizeof(Frame));
        if (ni == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = ni;
        s->cap = nc;
    }
    Py_INCREF(child);
    s->items[s->n].node = child;
    s->items[s->n].parent = parent;
    s->n++;
    return 0;
}

/* Push the children of `n` in the order U64Map.values() lists them (the table's
 * slots, then the side dict's values), so they pop LIFO as in the pure twin. */
static int
push_kids(Stack *s, Node *n, uint32_t idx)
{
    PyObject *kids = n->kids;
    if (kids == Py_None)
        return 0;
    if (IS_NODE(kids))
        return stack_push(s, kids, idx);
    if (!IS_MAP(kids)) {
        PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
        return -1;
    }
    U64Map *km = (U64Map *)kids;
    for (Py_ssize_t j = 0; j < km->cap; j++) {
        PyObject *v = km->slots[j].val;
        if (v != NULL && stack_push(s, v, idx) < 0)
            return -1;
    }
    if (km->other != NULL) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(km->other, &pos, &k, &v)) { /* nothing in the loop runs Python code */
            if (stack_push(s, v, idx) < 0)
                return -1;
        }
    }
    return 0;
}

/* Col and col_room (a growable byte column): bytes.h. */

PyDoc_STRVAR(dump_tree_doc,
"dump_tree(root) -> (parents, keys, mask_ids, masks, extra, addrs)\n\n"
"Walk one tree in preorder (iterative; node 0 is the root): the little-endian\n"
"uint32 parent indices, uint64 keys and uint32 GPU-mask ids of every node but the\n"
"root, the distinct GPU masks in order of first use, (index, node) of the nodes\n"
"with tiers or dups, and `addrs`: the uint64 address of every node, the root\n"
"first (node_index turns them into an address -> index table, after the lock).\n"
"Read-only. Same bytes as snapshot._py_dump_tree (which uses id()).");

static PyObject *
dump_tree(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dump_tree(Node)");
        return NULL;
    }
    Node *root = (Node *)args[0];
    Stack stack = {NULL, 0, 0};
    Col par = {NULL, 0, 0}, keys = {NULL, 0, 0}, mids = {NULL, 0, 0}, addrs = {NULL, 0, 0};
    PyObject *mask_ids = PyDict_New(), *masks = PyList_New(0), *extra = PyList_New(0);
    PyObject *last_mask = NULL; /* a strong reference: the mask whose id is last_mid */
    uint32_t last_mid = 0;
    PyObject *cols[4] = {NULL, NULL, NULL, NULL};
    if (mask_ids == NULL || masks == NULL || extra == NULL)
        goto fail;
    if (col_room(&addrs, 8) < 0 || push_kids(&stack, root, 0) < 0)
        goto fail;
    put_le64(addrs.buf, (uint64_t)(uintptr_t)root);
    addrs.len = 8;
    uint32_t i = 0;
    while (stack.n) {
        Frame f = stack.items[--stack.n];
        Node *node = (Node *)f.node; /* the stack's reference, released below */
        if (i == UINT32_MAX) {
            Py_DECREF(node);
            PyErr_SetString(PyExc_OverflowError, "more than 2**32 - 1 nodes in one tree");
            goto fail;
        }
        i++;
        if (col_room(&par, 4) < 0 || col_room(&keys, 8) < 0 || col_room(&mids, 4) < 0 || col_room(&addrs, 8) < 0) {
            Py_DECREF(node);
            goto fail;
        }
        put_le32(par.buf + par.len, f.parent);
        par.len += 4;
        put_le64(keys.buf + keys.len, node->key);
        keys.len += 8;
        put_le64(addrs.buf + addrs.len, (uint64_t)(uintptr_t)node);
        addrs.len += 8;
        PyObject *m = node_gpu(node);
        if (m != last_mask) {
            PyObject *v = PyDict_GetItemWithError(mask_ids, m);
            if (v != NULL)
                last_mid = (uint32_t)PyLong_AsUnsignedLong(v); /* an id this loop made */
            else {
                if (PyErr_Occurred()) {
                    Py_DECREF(node);
                    goto fail;
                }
                Py_ssize_t nm = PyList_GET_SIZE(masks);
                PyObject *id = PyLong_FromSsize_t(nm);
                if (id == NULL) {
                    Py_DECREF(node);
                    goto fail;
                }
                int e = PyDict_SetItem(mask_ids, m, id);
                Py_DECREF(id);
                if (e < 0 || PyList_Append(masks, m) < 0) {
                    Py_DECREF(node);
                    goto fail;
                }
                last_mid = (uint32_t)nm;
            }
            Py_INCREF(m);
            Py_XSETREF(last_mask, m);
        }
        put_le32(mids.buf + mids.len, last_mid);
        mids.len += 4;
        if (HAS_SIDE(node)) { /* tiers or dup is set */
            PyObject *t = Py_BuildValue("(kO)", (unsigned long)i, (PyObject *)node);
            if (t == NULL || PyList_Append(extra, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(node);
                goto fail;
            }
            Py_DECREF(t);
        }
        int r = push_kids(&stack, node, i);
        Py_DECREF(node);
        if (r < 0)
            goto fail;
        if (stack.n)
            __builtin_prefetch(stack.items[stack.n - 1].node); /* the walk's cache miss: start it now */
    }
    cols[0] = PyBytes_FromStringAndSize((const char *)par.buf, (Py_ssize_t)par.len);
    cols[1] = PyBytes_FromStringAndSize((const char *)keys.buf, (Py_ssize_t)keys.len);
    cols[2] = PyBytes_FromStringAndSize((const char *)mids.buf, (Py_ssize_t)mids.len);
    cols[3] = PyBytes_FromStringAndSize((const char *)addrs.buf, (Py_ssize_t)addrs.len);
    if (cols[0] == NULL || cols[1] == NULL || cols[2] == NULL || cols[3] == NULL)
        goto fail;
    PyObject *out = PyTuple_Pack(6, cols[0], cols[1], cols[2], masks, extra, cols[3]);
    if (out == NULL)
        goto fail;
    for (int j = 0; j < 4; j++)
        Py_DECREF(cols[j]);
    Py_DECREF(masks);
    Py_DECREF(extra);
    Py_DECREF(mask_ids);
    Py_XDECREF(last_mask);
    PyMem_Free(par.buf);
    PyMem_Free(keys.buf);
    PyMem_Free(mids.buf);
    PyMem_Free(addrs.buf);
    PyMem_Free(stack.items);
    return out;
fail:
    for (size_t j = 0; j < stack.n; j++)
        Py_DECREF(stack.items[j].node);
    PyMem_Free(stack.items);
    PyMem_Free(par.buf);
    PyMem_Free(keys.buf);
    PyMem_Free(mids.buf);
    PyMem_Free(addrs.buf);
    for (int j = 0; j < 4; j++)
        Py_XDECREF(cols[j]);
    Py_XDECREF(last_mask);
    Py_XDECREF(mask_ids);
    Py_XDECREF(masks);
    Py_XDECREF(extra);
    return NULL;
}

/* Append (h, i) to `other`. */
static int
other_append(PyObject *other, PyObject *h, PyObject *i)
{
    PyObject *t = PyTuple_Pack(2, h, i);
    if (t == NULL)
        return -1;
    int r = PyList_Append(other, t);
    Py_DECREF(t);
    return r;
}

PyDoc_STRVAR(dump_map_doc,
"dump_map(wmap) -> (hashes, addrs, other)\n\n"
"A worker's engine-hash map (a U64Map) as little-endian uint64 hashes and the\n"
"uint64 addresses of their nodes, in the map's order; `other` gets (hash,\n"
"address) of the entries whose hash is not an int in [0, 2**64). Reads the map's\n"
"table only, never a node: the cheap half under the index lock (translate does\n"
"the rest after it). Same as snapshot._py_dump_map.");

static PyObject *
dump_map(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !IS_MAP(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dump_map(U64Map)");
        return NULL;
    }
    U64Map *m = (U64Map *)args[0];
    PyObject *items = NULL, *hb = NULL, *ab = NULL, *other = NULL;
    Py_ssize_t n = 0;
    if (m->other != NULL && (items = PyDict_Items(m->other)) == NULL)
        goto fail;
    hb = PyBytes_FromStringAndSize(NULL, m->used * 8);
    ab = PyBytes_FromStringAndSize(NULL, m->used * 8);
    other = PyList_New(0);
    if (hb == NULL || ab == NULL || other == NULL)
        goto fail;
    unsigned char *hp = (unsigned char *)PyBytes_AS_STRING(hb), *ap = (unsigned char *)PyBytes_AS_STRING(ab);
    for (Py_ssize_t j = 0; j < m->cap; j++) {
        Slot *s = &m->slots[j];
        if (s->val == NULL)
            continue;
        put_le64(hp + n * 8, s->key);
        put_le64(ap + n * 8, (uint64_t)(uintptr_t)s->val);
        n++;
    }
    Py_ssize_t ni = items == NULL ? 0 : PyList_GET_SIZE(items);
    for (Py_ssize_t j = 0; j < ni; j++) {
        PyObject *pair = PyList_GET_ITEM(items, j);
        PyObject *iv = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)PyTuple_GET_ITEM(pair, 1));
        if (iv == NULL || other_append(other, PyTuple_GET_ITEM(pair, 0), iv) < 0) {
            Py_XDECREF(iv);
            goto fail;
        }
        Py_DECREF(iv);
    }
    /* On failure _PyBytes_Resize frees the object and sets the pointer to NULL. */
    if (_PyBytes_Resize(&hb, n * 8) < 0 || _PyBytes_Resize(&ab, n * 8) < 0)
        goto fail;
    Py_XDECREF(items);
    return Py_BuildValue("(NNN)", hb, ab, other);
fail:
    Py_XDECREF(items);
    Py_XDECREF(hb);
    Py_XDECREF(ab);
    Py_XDECREF(other);
    return NULL;
}

static int column(PyObject *obj, Py_buffer *view, int width, const char *what);

PyDoc_STRVAR(node_index_doc,
"node_index(addrs) -> NodeIndex\n\n"
"The table address -> index of the uint64 little-endian addresses dump_tree\n"
"wrote (index = position). An address twice (not a tree) is a ValueError. Reads\n"
"no node. Same as snapshot._py_node_index.");

static PyObject *
node_index(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "node_index(addrs)");
        return NULL;
    }
    Py_buffer av;
    if (column(args[0], &av, 8, "addrs") < 0)
        return NULL;
    Py_ssize_t n = av.len / 8;
    NodeIndex *w = NULL;
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more than 2**32 - 1 nodes in one tree");
        goto done;
    }
    if ((w = nidx_new(n)) == NULL)
        goto done;
    const unsigned char *ap = av.buf;
    Py_ssize_t bad = -1;
    /* Integers only (no Python object is touched): other threads, the queries among
     * them, run meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a = get_le64(ap + i * 8);
        if (a == 0 || nidx_add(w, a, (uint32_t)i) == 0) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_SetString(PyExc_ValueError, "node_index: an address twice, or 0 (not a tree)");
        Py_CLEAR(w);
    }
done:
    PyBuffer_Release(&av);
    return (PyObject *)w;
}

PyDoc_STRVAR(translate_doc,
"translate(where, hashes, addrs) -> (hashes, idx)\n\n"
"dump_map's columns with each address replaced by its node's uint32 index in\n"
"`where` (a NodeIndex); entries whose address `where` does not know (a node the\n"
"cap freed) are left out. Same as snapshot._py_translate.");

static PyObject *
translate(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || Py_TYPE(args[0]) != &kvi_NodeIndexType) {
        PyErr_SetString(PyExc_TypeError, "translate(NodeIndex, hashes, addrs)");
        return NULL;
    }
    NodeIndex *w = (NodeIndex *)args[0];
    Py_buffer hv, av;
    if (column(args[1], &hv, 8, "hashes") < 0)
        return NULL;
    if (column(args[2], &av, 8, "addrs") < 0) {
        PyBuffer_Release(&hv);
        return NULL;
    }
    PyObject *hb = NULL, *ib = NULL, *res = NULL;
    Py_ssize_t n = hv.len / 8, k = 0;
    if (av.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd hashes, %zd addresses", n, av.len / 8);
        goto done;
    }
    hb = PyBytes_FromStringAndSize(NULL, n * 8);
    ib = PyBytes_FromStringAndSize(NULL, n * 4);
    if (hb == NULL || ib == NULL)
        goto done;
    unsigned char *ho = (unsigned char *)PyBytes_AS_STRING(hb), *io = (unsigned char *)PyBytes_AS_STRING(ib);
    const unsigned char *hp = hv.buf, *ap = av.buf;
    size_t wmask = w->cap ? (size_t)w->cap - 1 : 0;
    enum { PREFETCH = 16 };
    /* Integers only: other threads run meanwhile (`where` and the buffers are held
     * by this call's arguments and results). */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + PREFETCH < n && w->cap)
            __builtin_prefetch(&w->slots[ptr_slot(get_le64(ap + (j + PREFETCH) * 8), wmask)]);
        Py_ssize_t s = nidx_find(w, get_le64(ap + j * 8));
        if (s < 0)
            continue;
        memcpy(ho + k * 8, hp + j * 8, 8);
        put_le32(io + k * 4, w->slots[s].idx);
        k++;
    }
    Py_END_ALLOW_THREADS
    if (_PyBytes_Resize(&hb, k * 8) < 0 || _PyBytes_Resize(&ib, k * 4) < 0)
        goto done;
    res = Py_BuildValue("(OO)", hb, ib);
done:
    Py_XDECREF(hb);
    Py_XDECREF(ib);
    PyBuffer_Release(&hv);
    PyBuffer_Release(&av);
    return res;
}

/* A read-only view of a column of `width`-byte items; -1 with ValueError when its
 * length is not a multiple of the width. */
static int
column(PyObject *obj, Py_buffer *view, int width, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % width) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, not a whole number of %d-byte items", what, view->len,
                     width);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Link `node` under `parent` as the pure twin does: kids None -> the node, a Node
 * -> a U64Map of both (the old child first), a U64Map -> one more entry. */
static int
link_child(Node *parent, Node *node)
{
    PyObject *kids = parent->kids;
    if (kids == Py_None) {
        NODE_SET(parent->kids, (PyObject *)node);
        return 0;
    }
    if (IS_MAP(kids))
        return kvi_map_put((U64Map *)kids, node->key, (PyObject *)node);
    if (!IS_NODE(kids)) {
        PyErr_SetString(PyExc_TypeError, "Node.kids must be None, a Node or a U64Map");
        return -1;
    }
    U64Map *km = map_new();
    if (km == NULL || kvi_map_put(km, ((Node *)kids)->key, kids) < 0 || kvi_map_put(km, node->key, (PyObject *)node) < 0) {
        Py_XDECREF(km);
        return -1;
    }
    NODE_SET(parent->kids, (PyObject *)km);
    Py_DECREF(km);
    return 0;
}

PyDoc_STRVAR(load_tree_doc,
"load_tree(root, parents, keys, mask_ids, masks) -> list[Node]\n\n"
"Create every node of a dumped tree under `root` (the columns dump_tree wrote;\n"
"preorder: each parent before its children): node i is Node(keys[i-1],\n"
"nodes[parents[i-1]], None, masks[mask_ids[i-1]]), linked under its parent.\n"
"Returns the nodes, the root first. Columns of different lengths, a parent not\n"
"created yet or a mask id out of range are a ValueError. Same as\n"
"snapshot._py_load_tree.");

static PyObject *
load_tree(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !IS_NODE(args[0])) {
        PyErr_SetString(PyExc_TypeError, "load_tree(Node, parents, keys, mask_ids, masks)");
        return NULL;
    }
    Py_buffer pv, kv, mv;
    if (column(args[1], &pv, 4, "parents") < 0)
        return NULL;
    if (column(args[2], &kv, 8, "keys") < 0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    if (column(args[3], &mv, 4, "mask_ids") < 0) {
        PyBuffer_Release(&pv);
        PyBuffer_Release(&kv);
        return NULL;
    }
    PyObject *masks = NULL, *nodes = NULL;
    Py_ssize_t n = pv.len / 4;
    if (kv.len / 8 != n || mv.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "tree columns of different lengths");
        goto fail;
    }
    masks = PySequence_Fast(args[4], "masks must be a sequence");
    if (masks == NULL || (nodes = PyList_New(n + 1)) == NULL)
        goto fail;
    /* Unset items are NULL, which list_dealloc skips: a failure part-way frees what was made. */
    Py_INCREF(args[0]);
    PyList_SET_ITEM(nodes, 0, args[0]);
    const unsigned char *pp = pv.buf, *kp = kv.buf, *mp = mv.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t p = get_le32(pp + i * 4), mi = get_le32(mp + i * 4);
        if ((Py_ssize_t)p > i) {
            PyErr_Format(PyExc_ValueError, "node %zd names parent %lu, not created before it", i + 1,
                         (unsigned long)p);
            goto fail;
        }
        if ((Py_ssize_t)mi >= PySequence_Fast_GET_SIZE(masks)) {
            PyErr_Format(PyExc_ValueError, "node %zd names mask %lu of %zd", i + 1, (unsigned long)mi,
                         PySequence_Fast_GET_SIZE(masks));
            goto fail;
        }
        Node *parent = (Node *)PyList_GET_ITEM(nodes, p);
        Node *node = node_make(get_le64(kp + i * 8), (PyObject *)parent, PySequence_Fast_GET_ITEM(masks, mi));
        if (node == NULL)
            goto fail;
        PyList_SET_ITEM(nodes, i + 1, (PyObject *)node);
        if (link_child(parent, node) < 0)
            goto fail;
    }
    Py_DECREF(masks);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&mv);
    return nodes;
fail:
    Py_XDECREF(nodes);
    Py_XDECREF(masks);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&mv);
    return NULL;
}

static Py_ssize_t
gcd_ssize(Py_ssize_t a, Py_ssize_t b)
{
    while (b) {
        Py_ssize_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The step of load_map's order over n entries: 0x9E3779B97F4A7C15 mod n, moved up
 * to the next value coprime with n (1 for n <= 2). Same as snapshot._load_stride. */
static Py_ssize_t
load_stride(Py_ssize_t n)
{
    if (n <= 2)
        return 1;
    Py_ssize_t s = (Py_ssize_t)(0x9E3779B97F4A7C15ULL % (unsigned long long)n);
    if (s == 0)
        s = 1;
    while (gcd_ssize(s, n) != 1)
        s++;
    return s;
}

PyDoc_STRVAR(load_map_doc,
"load_map(wmap, hashes, idx, nodes) -> None\n\n"
"Put hashes[i] -> nodes[idx[i]] into a worker's map (the little-endian uint64 and\n"
"uint32 columns dump_map wrote). Columns of different lengths are a ValueError,\n"
"an index past `nodes` an IndexError. Same as snapshot._py_load_map.");

static PyObject *
load_map(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !IS_MAP(args[0]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "load_map(U64Map, hashes, idx, list)");
        return NULL;
    }
    U64Map *m = (U64Map *)args[0];
    PyObject *nodes = args[3];
    Py_buffer hv, iv;
    if (column(args[1], &hv, 8, "hashes") < 0)
        return NULL;
    if (column(args[2], &iv, 4, "idx") < 0) {
        PyBuffer_Release(&hv);
        return NULL;
    }
    Py_ssize_t n = hv.len / 8;
    PyObject *res = NULL;
    if (iv.len / 4 != n) {
        PyErr_Format(PyExc_ValueError, "%zd hashes, %zd node indices", n, iv.len / 4);
        goto done;
    }
    const unsigned char *hp = hv.buf, *ip = iv.buf;
    /* The columns come in the source table's slot order, i.e. sorted by a hash's
     * home slot: inserted in that order into a table that grows as it fills, they
     * pile up in a few long probe runs (quadratic: minutes at 10^7 entries). So the
     * table is sized once for all of them, and they go in a scattered order (a
     * stride coprime with n, the same order as snapshot._py_load_map). */
    Py_ssize_t cap = m->cap ? m->cap : 4;
    while ((m->used + n) * 4 > cap * 3)
        cap *= 2;
    if (cap > m->cap && kvi_map_resize(m, cap) < 0)
        goto done;
    Py_ssize_t stride = load_stride(n), j = 0, ja = 0;
    enum { AHEAD = 8 };
    for (Py_ssize_t i = 0; i < AHEAD && i < n; i++)
        ja = ja + stride >= n ? ja + stride - n : ja + stride;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            /* The random reads (the map's slot, the node's refcount and the columns
             * themselves) start AHEAD entries early. */
            uint32_t ka = get_le32(ip + ja * 4);
            __builtin_prefetch(&m->slots[(size_t)mix64(get_le64(hp + ja * 8)) & ((size_t)m->cap - 1)], 1);
            if ((Py_ssize_t)ka < PyList_GET_SIZE(nodes))
                __builtin_prefetch(PyList_GET_ITEM(nodes, ka), 1);
            ja = ja + stride >= n ? ja + stride - n : ja + stride;
        }
        uint32_t k = get_le32(ip + j * 4);
        /* Read each time: releasing a replaced value may run code that changes the list. */
        if ((Py_ssize_t)k >= PyList_GET_SIZE(nodes)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        if (kvi_map_put(m, get_le64(hp + j * 8), PyList_GET_ITEM(nodes, k)) < 0)
            goto done;
        j = j + stride >= n ? j + stride - n : j + stride;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&hv);
    PyBuffer_Release(&iv);
    return res;
}

KVI_HIDDEN PyMethodDef kvi_snapshot_methods[] = {
    {"dump_tree", (PyCFunction)(void (*)(void))dump_tree, METH_FASTCALL, dump_tree_doc},
    {"dump_map", (PyCFunction)(void (*)(void))dump_map, METH_FASTCALL, dump_map_doc},
    {"node_index", (PyCFunction)(void (*)(void))node_index, METH_FASTCALL, node_index_doc},
    {"translate", (PyCFunction)(void (*)(void))translate, METH_FASTCALL, translate_doc},
    {"load_tree", (PyCFunction)(void (*)(void))load_tree, METH_FASTCALL, load_tree_doc},
    {"load_map", (PyCFunction)(void (*)(void))load_map, METH_FASTCALL, load_map_doc},
    {NULL, NULL, 0, NULL},
};
