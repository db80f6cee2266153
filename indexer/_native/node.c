/* node.c: Node, one block of a prefix tree, the drop-in twin of the msgspec Node in
 * store/tree.py (same constructor, same attributes): the key as a uint64 inside the
 * object, tiers and dup in a Side made only while one of them is set (core.h says
 * why a node is 48 bytes). Node is not tracked by the cycle collector: parent <->
 * child cycles are broken by hand (Tree.free_up, Tree.clear). */
#include "core.h"

/* Set tiers (dup: dup) to v (borrowed): makes the Side when v is not None, frees
 * it when tiers and dup are both None afterwards. -1 with MemoryError when no
 * Side could be made (the node is unchanged). */
KVI_HIDDEN int
kvi_node_set_side(Node *n, int dup, PyObject *v)
{
    if (!HAS_SIDE(n)) {
        if (v == Py_None)
            return 0;
        Side *s = PyMem_Malloc(sizeof(Side));
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->gpu = n->gs; /* the node's reference moves to the Side */
        Py_INCREF(Py_None);
        s->tiers = Py_None;
        Py_INCREF(Py_None);
        s->dup = Py_None;
        n->gs = (PyObject *)((uintptr_t)s | 1);
    }
    Side *s = SIDE(n);
    PyObject **slot = dup ? &s->dup : &s->tiers;
    PyObject *old = *slot;
    Py_INCREF(v);
    *slot = v;
    if (s->tiers == Py_None && s->dup == Py_None) { /* fold back: gs is the mask again */
        n->gs = s->gpu;
        Py_DECREF(Py_None);
        Py_DECREF(Py_None);
        PyMem_Free(s);
    }
    Py_DECREF(old); /* last: the node is whole if this runs a finalizer */
    return 0;
}

static PyObject *
Node_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if ((kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || nargs < 2 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError,
                        "Node(key, parent, kids=None, gpu=0, tiers=None, dup=None) takes 2 to 6 positional arguments");
        return NULL;
    }
    uint64_t key = 0;
    if (args[0] != Py_None) {
        int r = as_u64(args[0], &key);
        if (r <= 0) {
            if (r == 0)
                PyErr_SetString(PyExc_OverflowError, "a Node key is an int in [0, 2**64) or None");
            return NULL;
        }
    }
    Node *n = node_make(key, args[1], nargs > 3 ? args[3] : kvi_ZERO);
    if (n == NULL)
        return NULL;
    if (nargs > 2)
        NODE_SET(n->kids, args[2]);
    if ((nargs > 4 && node_set_tiers(n, args[4]) < 0) || (nargs > 5 && node_set_dup(n, args[5]) < 0)) {
        Py_DECREF(n);
        return NULL;
    }
    return (PyObject *)n;
}

static PyObject *
Node_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Node() takes positional arguments only");
        return NULL;
    }
    return Node_vectorcall((PyObject *)type, &PyTuple_GET_ITEM(args, 0), (size_t)PyTuple_GET_SIZE(args), NULL);
}

static void
Node_dealloc(Node *n)
{
    Py_XDECREF(n->parent);
    Py_XDECREF(n->kids);
    if (HAS_SIDE(n)) {
        Side *s = SIDE(n);
        PyObject *gpu = s->gpu, *tiers = s->tiers, *dup = s->dup;
        PyMem_Free(s);
        Py_DECREF(gpu);
        Py_DECREF(tiers);
        Py_DECREF(dup);
    }
    else
        Py_XDECREF(n->gs);
    PyObject_Free(n);
}

static PyObject *
Node_get_key(Node *n, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(n->key);
}

static PyObject *
Node_repr(Node *n)
{
    return PyUnicode_FromFormat("Node(key=%llu, gpu=%R)", (unsigned long long)n->key, node_gpu(n));
}

/* gpu, tiers and dup from Python: the objects stored (so node.tiers[t] = m
 * changes the node's own dict), writable, not deletable (nothing the index
 * runs deletes them, and the C loops read them without a NULL check). */
static PyObject *
Node_get_gpu(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_gpu(n));
}

static PyObject *
Node_get_tiers(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_tiers(n));
}

static PyObject *
Node_get_dup(Node *n, void *Py_UNUSED(closure))
{
    return Py_NewRef(node_dup(n));
}

static int
Node_no_delete(PyObject *v, const char *name)
{
    if (v != NULL)
        return 0;
    PyErr_Format(PyExc_AttributeError, "Node.%s cannot be deleted", name);
    return -1;
}

static int
Node_set_gpu(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    if (Node_no_delete(v, "gpu") < 0)
        return -1;
    node_set_gpu(n, v);
    return 0;
}

static int
Node_set_tiers(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    return Node_no_delete(v, "tiers") < 0 ? -1 : node_set_tiers(n, v);
}

static int
Node_set_dup(Node *n, PyObject *v, void *Py_UNUSED(closure))
{
    return Node_no_delete(v, "dup") < 0 ? -1 : node_set_dup(n, v);
}

/* The node and its Side, if it has one. */
static PyObject *
Node_sizeof(Node *n, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(Node) + (HAS_SIDE(n) ? (Py_ssize_t)sizeof(Side) : 0));
}

static PyMethodDef Node_methods[] = {
    {"__sizeof__", (PyCFunction)Node_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Node_getset[] = {
    {"key", (getter)Node_get_key, NULL, "The block key (read-only).", NULL},
    {"gpu", (getter)Node_get_gpu, (setter)Node_set_gpu, "Bit mask of the workers holding the block on GPU.", NULL},
    {"tiers", (getter)Node_get_tiers, (setter)Node_set_tiers, "None or {tid: mask} for the other tiers.", NULL},
    {"dup", (getter)Node_get_dup, (setter)Node_set_dup, "None or {(wid << 5) | tid: extra announcements}.", NULL},
    {NULL},
};

static PyMemberDef Node_members[] = {
    {"parent", T_OBJECT, offsetof(Node, parent), 0, NULL},
    {"kids", T_OBJECT, offsetof(Node, kids), 0, NULL},
    {NULL},
};

KVI_HIDDEN PyTypeObject kvi_NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._core.Node",
    .tp_doc = "One block of a prefix tree (see tree.py).",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Node_tp_new,
    .tp_vectorcall = Node_vectorcall,
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_getset = Node_getset,
    .tp_members = Node_members,
    .tp_methods = Node_methods,
    .tp_repr = (reprfunc)Node_repr,
};
