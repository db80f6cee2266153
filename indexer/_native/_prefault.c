/* indexer._prefault: pymalloc arenas whose pages are faulted in ahead of use.
 *
 * Why it exists: growing an index to 10^7 entries, a third of the applying
 * thread's time went to the kernel zeroing fresh pages on first touch (perf:
 * clear_page under _PyObject_Malloc). Every node is a pymalloc block, and every
 * new 1 MiB arena pymalloc maps for them is 256 page faults, taken by the thread
 * that holds the GIL while it applies events. Here a thread of our own (plain
 * C, never holding the GIL) maps arenas ahead with MAP_POPULATE, which also
 * faults a whole arena in one call instead of 256, and keeps a small reserve the
 * applying thread takes them from. An arena pymalloc frees goes back to the
 * reserve while the reserve is below its cap (its pages stay faulted, for the
 * next growth), else to the kernel.
 *
 * pymalloc needs nothing of an arena but its size and that it stays mapped
 * until freed: it initialises every pool it carves, so a recycled arena's old
 * bytes are never read. Arenas mapped before install() (by the default
 * allocator, mmap too) are freed here the same way (munmap or the reserve).
 *
 * Linux (mmap, MAP_POPULATE, pthreads) only: elsewhere install() says False
 * and pymalloc keeps its own allocator.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__linux__)
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_setname_np */
#endif
#include <pthread.h>
#include <sys/mman.h>
#define PREFAULT 1
#else
#define PREFAULT 0
#endif

#if PREFAULT

#define MAX_RESERVE 256
/* The same allocator also maps the interpreter's frame stack chunks (16 KiB in 3.11):
 * only a size this big or more is taken for pymalloc's arena size (1 MiB in 3.11). */
#define MIN_ARENA ((size_t)256 << 10)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static void *reserve[MAX_RESERVE];
static int count;        /* arenas in the reserve */
static int target;       /* the filler keeps the reserve at this many */
static size_t arena_size; /* pymalloc's arena size (1 MiB in 3.11); 0 until its first arena */
static int installed;
/* Counters (read under the lock): arenas given from the reserve, mapped on the spot
 * because the reserve was empty, mapped by the filler, and taken back on free. */
static unsigned long long hits, misses, filled, recycled;

static void *
map_arena(size_t size, int populate)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0),
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void *
filler(void *unused)
{
    pthread_setname_np(pthread_self(), "kvi-prefault"); /* what ps and /proc/PID/task/TID/comm show */
    pthread_mutex_lock(&lock);
    for (;;) {
        while (arena_size == 0 || count >= target)
            pthread_cond_wait(&wake, &lock);
        size_t size = arena_size;
        pthread_mutex_unlock(&lock);
        void *p = map_arena(size, 1); /* the page faults happen here, off the GIL */
        pthread_mutex_lock(&lock);
        if (p == NULL) {
            /* Out of memory: the next alloc maps on its own and reports it to pymalloc. */
            pthread_cond_wait(&wake, &lock);
            continue;
        }
        if (count < MAX_RESERVE && size == arena_size) {
            reserve[count++] = p;
            filled++;
        }
        else
            munmap(p, size);
    }
    return NULL;
}

/* pymalloc's arena allocator (called with the GIL held). */
static void *
arena_alloc(void *ctx, size_t size)
{
    void *p = NULL;
    pthread_mutex_lock(&lock);
    if (arena_size == 0 && size >= MIN_ARENA)
        arena_size = size;
    if (size == arena_size && count > 0) {
        p = reserve[--count];
        hits++;
    }
    else
        misses++;
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    return p != NULL ? p : map_arena(size, 0);
}

static void
arena_free(void *ctx, void *ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    if (size == arena_size && count < 2 * target && count < MAX_RESERVE) {
        reserve[count++] = ptr;
        recycled++;
        ptr = NULL;
    }
    pthread_mutex_unlock(&lock);
    if (ptr != NULL)
        munmap(ptr, size);
}

#endif /* PREFAULT */

PyDoc_STRVAR(install_doc,
"install(reserve) -> bool\n\n"
"Give pymalloc arenas from a reserve of `reserve` (1..128) pre-faulted arenas,\n"
"kept full by a background thread; arenas freed later are kept while the reserve\n"
"holds fewer than 2 * `reserve`. Process-wide and for the life of the process: a\n"
"second call only changes the size of the reserve. False where unsupported (not\n"
"Linux) or when the thread cannot start.");

static PyObject *
install(PyObject *mod, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 1 || n > MAX_RESERVE / 2) {
        PyErr_SetString(PyExc_ValueError, "reserve is 1..128 arenas");
        return NULL;
    }
#if PREFAULT
    pthread_mutex_lock(&lock);
    target = (int)n;
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    if (!installed) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int err = pthread_create(&t, &attr, filler, NULL);
        pthread_attr_destroy(&attr);
        if (err != 0)
            Py_RETURN_FALSE;
        PyObjectArenaAllocator a = {NULL, arena_alloc, arena_free};
        PyObject_SetArenaAllocator(&a);
        installed = 1;
    }
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict\n\n"
"The reserve's state: installed, target, arenas held, arena size, and the counts\n"
"of arenas given from the reserve (hits), mapped on the spot (misses), mapped by\n"
"the background thread (filled) and taken back when pymalloc freed them (recycled).");

static PyObject *
stats(PyObject *mod, PyObject *unused)
{
#if PREFAULT
    pthread_mutex_lock(&lock);
    int inst = installed, tgt = target, cnt = count;
    size_t size = arena_size;
    unsigned long long h = hits, m = misses, f = filled, r = recycled;
    pthread_mutex_unlock(&lock);
    return Py_BuildValue("{s:O,s:i,s:i,s:n,s:K,s:K,s:K,s:K}", "installed", inst ? Py_True : Py_False, "target", tgt,
                         "held", cnt, "arena_size", (Py_ssize_t)size, "hits", h, "misses", m, "filled", f,
                         "recycled", r);
#else
    return Py_BuildValue("{s:O,s:i,s:i,s:n,s:i,s:i,s:i,s:i}", "installed", Py_False, "target", 0, "held", 0,
                         "arena_size", (Py_ssize_t)0, "hits", 0, "misses", 0, "filled", 0, "recycled", 0);
#endif
}

static PyMethodDef methods[] = {
    {"install", (PyCFunction)install, METH_O, install_doc},
    {"stats", (PyCFunction)stats, METH_NOARGS, stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer._native._prefault",
    "pymalloc arenas faulted in ahead of use by a background thread (see _prefault.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__prefault(void)
{
    return PyModule_Create(&module);
}
