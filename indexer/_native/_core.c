/* indexer._native._core: the compiled storage of the prefix index; this file puts
 * the module together (the other files each hold one concern: core.h lists them).
 *
 * Why it exists: in pure Python every block costs a 64-byte node plus a 40-byte
 * int object for its key, and every (worker, block) residency a dict slot plus a
 * 40-byte int object for the engine's hash: ~180 bytes per resident entry. Here
 * a node carries its key as a uint64 inside the object and its rarely set tiers
 * and dup outside it (48 bytes in all, see Side) and the engine-hash and child
 * maps are open-addressing tables of (uint64, object) slots (16 bytes each, no
 * key objects).
 *
 * What it holds:
 *   Node        one block: key (uint64), parent, kids, gpu, tiers, dup. The
 *               drop-in twin of the msgspec ``Node`` in tree.py (same
 *               constructor, same attributes); tiers and dup live in a Side
 *               made only while one of them is set.                  (node.c)
 *   U64Map      a dict-like map whose int keys in [0, 2**64) live in the table;
 *               any other key (a bytes hash, a negative int) goes to a plain
 *               dict inside, so every key a vLLM engine can send works. (u64map.c)
 *   DEAD        the sentinel parent of freed nodes.                  (this file)
 *   insert_gpu  the hot loop of a GPU store (tree.insert_gpu is its reference).
 *   remove_gpu  the loop of a GPU removal in an uncapped tree, with the freeing
 *               of unheld nodes (PrefixIndex._remove_one and Tree.free_up are
 *               its reference: the pure build runs them).
 *   walk        the GPU walk of a query (tree.walk is its reference).  (tree.c)
 *   answers     the ranked per-worker answers of a GPU-only, one-group match
 *               (result.gpu_answers is its reference).              (answers.c)
 *   rank        a route's ranking: each candidate's cost and answer entry, then
 *               one sort (route._py_rank is its reference).         (ranking.c)
 *   block_keys  xxh3-64 of each block of little-endian uint32 tokens (keys.py
 *               documents the key).                                    (keys.c)
 *   dump_tree, dump_map, load_tree, load_map
 *               a snapshot's columns (snapshot.py): a tree walked to
 *               little-endian parent / key / mask-id arrays and back, a
 *               worker's map to hash / node-index arrays and back, with no
 *               Python object per node or entry on the way (the
 *               snapshot._py_* twins are the reference, byte for byte).
 *   NodeIndex   dump_tree's node -> index table (16-byte slots over node
 *               pointers, for dump_map and the rest of the cut). (snapshot.c)
 *   frame_run, frame_many, encode_record
 *               a recording's frames and records (recframe.c, recquery.c;
 *               record.py's Python encoder is the reference, byte for byte).
 *   tokens_from_msgpack, scan_gpu_batch
 *               an event's msgpack token ids straight to little-endian uint32
 *               bytes, and a batch of plain GPU stores read in one pass, with no
 *               Python object per block or token; None for any other shape, so
 *               the caller's typed decoder can say what is wrong.    (events.c)
 *
 * A request's JSON body and Dynamo's /query body are the HTTP service's formats,
 * not the index's: they are compiled in api/_surface.c (api._surface).
 *
 * Neither Node nor U64Map is tracked by the cycle collector: millions of them
 * would make every collection pass slow. Parent <-> child cycles are broken by
 * hand (Tree.free_up, Tree.clear), as with the pure-Python nodes.
 */
#include "core.h"

KVI_HIDDEN PyObject *kvi_DEAD; /* module attribute; one reference held by the module */
KVI_HIDDEN PyObject *kvi_ZERO;
KVI_HIDDEN PyObject *kvi_GPU_NAME;

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "indexer._native._core",
    .m_doc = "Compiled core of the prefix index: Node, U64Map, the hot loops, block keys, token parsing and snapshot columns.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&kvi_U64MapType) < 0 || PyType_Ready(&kvi_NodeType) < 0 || PyType_Ready(&kvi_NodeIndexType) < 0 ||
        PyType_Ready(&kvi_JournalCoreType) < 0 || PyType_Ready(&kvi_ApplyRunType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&core_module);
    if (mod == NULL)
        return NULL;
    /* Each file's functions: the same names and docstrings as when one table held them. */
    PyMethodDef *tables[] = {kvi_answers_methods, kvi_ranking_methods, kvi_rankout_methods, kvi_keys_methods, kvi_events_methods,
                             kvi_tree_methods, kvi_snapshot_methods, kvi_recframe_methods, kvi_recquery_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
        if (PyModule_AddFunctions(mod, tables[i]) < 0)
            goto fail;
    kvi_ZERO = PyLong_FromLong(0);
    kvi_GPU_NAME = PyUnicode_InternFromString("GPU");
    if (kvi_ZERO == NULL || kvi_GPU_NAME == NULL)
        goto fail;
    kvi_DEAD = (PyObject *)node_make(0, Py_None, kvi_ZERO);
    if (kvi_DEAD == NULL)
        goto fail;
    Py_INCREF(&kvi_U64MapType);
    Py_INCREF(&kvi_NodeType);
    Py_INCREF(&kvi_NodeIndexType);
    Py_INCREF(&kvi_JournalCoreType);
    Py_INCREF(&kvi_ApplyRunType);
    if (PyModule_AddObject(mod, "JournalCore", (PyObject *)&kvi_JournalCoreType) < 0 ||
        PyModule_AddObject(mod, "ApplyRun", (PyObject *)&kvi_ApplyRunType) < 0 ||
        PyModule_AddObject(mod, "U64Map", (PyObject *)&kvi_U64MapType) < 0 ||
        PyModule_AddObject(mod, "Node", (PyObject *)&kvi_NodeType) < 0 ||
        PyModule_AddObject(mod, "NodeIndex", (PyObject *)&kvi_NodeIndexType) < 0)
        goto fail;
    Py_INCREF(kvi_DEAD); /* one for the module attribute, one kept by this file */
    if (PyModule_AddObject(mod, "DEAD", kvi_DEAD) < 0)
        goto fail;
    return mod;
fail:
    Py_DECREF(mod);
    return NULL;
}
