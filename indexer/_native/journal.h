/* journal.h: JournalCore, the hot half of a recording's journal, as journal.c (its type,
 * run, clock, the queue) and applyrun.c (the runs batches are laid in) share it. */
#ifndef KVI_JOURNAL_H
#define KVI_JOURNAL_H

#include "core.h"

/* Buffers for runs, kept: a new run's buffer faults in on first touch on the thread
 * that applies batches. In 4 KiB pages that was ~5,000 faults for 10^6 blocks (2-4 us
 * each on this VM), ~4% of a burst's ingest; a buffer is now asked for in huge pages
 * (applyrun.c's kvi_run_buf), 2 faults each. stock() makes and touches a few once,
 * when the recording starts, and a run written hands its buffer back while fewer than
 * that are kept. */
#define SPARE_MAX 256

typedef struct {
    PyObject_HEAD
    PyObject *records; /* a collections.deque of records, taken by the writer thread */
    PyObject *append;  /* records.append */
    PyObject *apart;   /* with encode: a deque of the records queued apart, each in its place in a run */
    PyObject *apart_append;
    PyObject *raw;     /* the index's own clock */
    PyObject *values;  /* a frozenset of types whose instances a record may untrack (untrack_graph), or NULL */
    PyObject *wake;    /* called with no argument every wake_every records queued (the writer's event), or NULL */
    Py_ssize_t wake_every, since_wake;
    Py_ssize_t wake_bytes; /* and when the runs not written yet hold this many bytes */
    Py_ssize_t run_bytes;  /* what the runs not released yet hold */
    Py_ssize_t wake_at;    /* run_bytes at which the writer is woken next (once a wake_bytes' worth) */
    Py_ssize_t max_pending;
    char active, overflowed;
    double *times; /* the clock readings of the calls running (nested ones after the outer's) */
    Py_ssize_t nt, tcap;
    ApplyRun *open;       /* the run run_apply lays applies in, not queued yet, or NULL */
    unsigned char *spare[SPARE_MAX]; /* buffers (RUN_BYTES each) for the next runs */
    int nspare, keep;                 /* how many are there, and kept at most */
    Py_ssize_t in_runs;   /* applies in runs not released yet (open or queued) */
    Py_ssize_t sealed;    /* runs queued and not released yet */
    char strip;           /* lay plain GPU stores with their keys for token ids (hashed mode) */
    unsigned long long seed; /* the keys' seed (wire/keys.py's KEY_SEED) */
    char burst;           /* the last run was sealed full: the next is a large one */
    char encode;          /* records laid in runs encoded (journal.c's encoded says why) */
    PyObject *raised;     /* journal.Raised, for the encoder */
    PyObject *kinds;      /* bytes: kinds[op] - 1 is recquery.c's kind of op's record (0: Python's) */
} JournalCore;

/* A run's buffer: a run is queued when the next apply does not fit (or one bigger than
 * this has a run of its own): ~2,000 stripped batches of 64 blocks. Fewer, larger runs
 * are fewer GIL hand-overs for the writer, which takes the GIL once a run. */
#define RUN_BYTES (4u << 20)
/* A run begun while none is full yet starts this small (the C allocator's) and grows up
 * to SMALL_RUN_MAX before it is sealed; a run's buffer at most that large is malloc's,
 * a larger one a mapping of its own (kvi_run_buf). */
#define SMALL_RUN (64u << 10)
#define SMALL_RUN_MAX (1u << 20)

/* A run's buffer of ``cap`` bytes, in huge pages where the kernel gives them, or NULL;
 * and its release (applyrun.c). */
KVI_HIDDEN unsigned char *kvi_run_buf(size_t cap);
KVI_HIDDEN void kvi_run_buf_free(unsigned char *buf, size_t cap);
/* The open run queued (journal.c): 0, or -1 with an error set. */
KVI_HIDDEN int kvi_seal(JournalCore *self);
/* time.time() (journal.c). */
KVI_HIDDEN double kvi_wall_now(void);
/* The apply whose arguments are ``a`` and result ``r`` laid in the open run (applyrun.c):
 * 1; 0 not of the shape a run holds; -1 out of memory. */
KVI_HIDDEN int kvi_lay_apply(JournalCore *self, long op, PyObject *const *a, PyObject *r, Py_ssize_t base, int sink);
/* A record's body, encoded (``n`` bytes at ``body``; ``answer``: a query's answer,
 * counted), laid in the open run (applyrun.c): 1, or -1 out of memory. */
KVI_HIDDEN int kvi_lay_body(JournalCore *self, const unsigned char *body, size_t n, int answer);
/* The place of a record queued apart (``apart``) laid in the open run (applyrun.c): 1,
 * or -1 out of memory. */
KVI_HIDDEN int kvi_lay_apart(JournalCore *self);
/* A journaled call as the journal has it: its op, arguments and result, and its wall
 * clock and clock readings either as the journal's tuple holds them (``wall_o``,
 * ``times_o``) or, those NULL, as doubles. */
typedef struct {
    PyObject *op, *args, *result;
    PyObject *wall_o, *times_o;
    double wall;
    const double *times;
    Py_ssize_t nt;
} KviCall;
/* The call ``c``'s record of recquery.c's ``kind`` encoded as the writer would and laid in
 * the open run, its frame's head the writer's (recquery.c): 1; 0 a shape left to the
 * writer; -1 error set. */
KVI_HIDDEN int kvi_lay_record(JournalCore *self, const KviCall *c, int kind);
/* Buffers kept for runs holding ``bytes`` (applyrun.c): 0, or -1 out of memory. */
KVI_HIDDEN int kvi_journal_stock(JournalCore *self, Py_ssize_t bytes);

#endif
