/* The test harness: spawns W ranks as threads or forked processes under a watchdog.
 * Ranks never assert (CMocka's assertions longjmp, which is lost in a thread or a child);
 * they return a status, a message and values, and the parent asserts on the results.
 *
 * Every rank's report lives in one MAP_SHARED|MAP_ANONYMOUS region, so forked children
 * write it directly. A rank that runs past the timeout is reported as hung: in fork mode
 * it is killed (SIGKILL) and the test goes on; in thread mode it cannot be killed, so the
 * harness prints what it knows and ends the test process with a failure. Either way the
 * test fails within its timeout and never hangs CI. */
#ifndef DDP_TEST_HARNESS_H
#define DDP_TEST_HARNESS_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ddp/common.h"
#include "ddp/nn.h"
#include "ddp/pg.h"
#include "ddp/store.h"

#include "asserts.h"
#include "cleanup.h"

typedef enum ddp_test_mode { DDP_TEST_THREADS = 0, DDP_TEST_FORK = 1 } ddp_test_mode_t;

/* Special statuses recorded by the harness itself (beyond ddp_status_t's range). */
#define DDP_TEST_HUNG 1001    /* ran past the timeout */
#define DDP_TEST_CRASHED 1002 /* fork mode: died by a signal or exited without reporting */

/* What one rank reported. */
typedef struct ddp_test_result {
  int status;            /* the rank function's return value, or DDP_TEST_HUNG/CRASHED */
  int term_signal;       /* fork mode: the signal that ended the child, else 0 */
  int exit_code;         /* fork mode: the child's exit code */
  bool reported;         /* the rank function returned */
  double elapsed_ms;     /* wall time from spawn to the rank's return */
  char msg[1024];        /* free text (ddp_test_say), typically a ddp_error_t message */
  size_t nvalues;        /* bytes of values written (ddp_test_put) */
  unsigned char *values; /* points into the shared region; valid until results_free */
} ddp_test_result_t;

typedef struct ddp_test_rank ddp_test_rank_t;

/* Runs in each rank. Returns 0 (DDP_OK) or a ddp_status_t. */
typedef int (*ddp_test_fn)(ddp_test_rank_t *r, void *arg);

typedef struct ddp_test_opts {
  int world; /* 1..64 */
  ddp_test_mode_t mode;
  int timeout_ms;     /* watchdog per spawn; default 20000 */
  size_t value_bytes; /* per-rank value area; default 64 KiB */
  /* Fault injection from the parent (fork mode only): send kill_signal to kill_rank
   * kill_after_ms after the spawn, or, with kill_after_ready, kill_after_ms after every rank
   * has called ddp_test_ready (so a loaded machine's slow start cannot put the kill inside
   * the group's creation). kill_rank < 0 disables it. A rank stopped with SIGSTOP is killed,
   * and reported as the watchdog reports it, once every other rank has exited. */
  int kill_rank;
  int kill_after_ms;
  int kill_signal;
  bool kill_after_ready;
} ddp_test_opts_t;

#define DDP_TEST_OPTS_INIT \
  { 1, DDP_TEST_THREADS, 20000, 65536, -1, 0, 9, false }

typedef struct ddp_test_results ddp_test_results_t;

/* Spawns, waits for every rank (or the watchdog) and returns the reports. Never NULL. */
ddp_test_results_t *ddp_test_spawn(const ddp_test_opts_t *opts, ddp_test_fn fn, void *arg);
const ddp_test_result_t *ddp_test_result(const ddp_test_results_t *res, int rank);
int ddp_test_world(const ddp_test_results_t *res);
/* When the parent sent kill_signal (CLOCK_MONOTONIC ns, as ddp_now_ns); 0 if it never did. */
int64_t ddp_test_kill_time_ns(const ddp_test_results_t *res);
void ddp_test_results_free(ddp_test_results_t *res);

/* Inside a rank. */
int ddp_test_rank(const ddp_test_rank_t *r);
int ddp_test_world_size(const ddp_test_rank_t *r);
ddp_test_mode_t ddp_test_mode(const ddp_test_rank_t *r);
/* A per-spawn scratch directory (mkdtemp, removed with the results), for file stores and
 * for ranks to exchange files. Same path on every rank. */
const char *ddp_test_dir(const ddp_test_rank_t *r);
/* Process ids of all ranks (fork mode; in thread mode all equal getpid()). */
pid_t ddp_test_pid(const ddp_test_rank_t *r, int rank);
/* Sets the rank's message (printf-style; later calls replace it). */
void ddp_test_say(ddp_test_rank_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* ddp_test_say with the group's last error (copied out under its lock). */
void ddp_test_say_pg_error(ddp_test_rank_t *r, const ddp_pg_t *pg);
/* Marks this rank ready (its group is up); see ddp_test_opts_t.kill_after_ready. */
void ddp_test_ready(ddp_test_rank_t *r);
/* Appends bytes to the rank's value area. Returns false when the area is full. */
bool ddp_test_put(ddp_test_rank_t *r, const void *data, size_t n);
/* Creates the rank's group from *o, filling in o->rank, o->world and, forked, o->store: a
 * file store in ddp_test_dir (timeout o->timeout_ms) returned in *store, which the caller
 * destroys after the group, also on failure. In thread mode *store = NULL and o->store (the
 * shared in-process store) is used. A failure is said as "file store: <error>" or
 * "<what>: <error>". */
ddp_status_t ddp_test_pg_create(ddp_test_rank_t *tr, ddp_pg_options_t *o, const char *what,
                                ddp_store_t **store, ddp_pg_t **pg);

/* A new in-memory store (timeout 10 s) for thread-mode ranks; fails the test when creation
 * does. The caller destroys it. */
ddp_store_t *ddp_test_memory_store(void);

/* Parent-side CMocka helpers: fail (printing every rank's status and message) unless each
 * rank returned `expected`. */
void ddp_test_expect_all(const ddp_test_results_t *res, int expected);
#define ddp_test_expect_ok(res) ddp_test_expect_all((res), 0)

/* Allocator routing. cmocka's test_malloc is not thread-safe: use it only around
 * single-threaded code; the counting allocator is thread-safe and lets a test assert that
 * every allocation was freed (live == 0) or that a code path allocated nothing. */
void ddp_test_use_cmocka_allocator(void);
void ddp_test_use_default_allocator(void);
/* allocs - frees since process start, from ddp_alloc_stats. */
int64_t ddp_test_live_allocs(void);

/* The /usr/bin/python3 that has Debian's torch; tests that need it skip (exit 77 or
 * cmocka skip) when it is absent. Returns NULL when not found. */
const char *ddp_test_python(void);
/* The source tree's root directory (from the DDP_SOURCE_ROOT env that meson sets for
 * tests, else the path compiled into the harness). NULL when neither is known. */
const char *ddp_test_source_root(void);
/* "<build>/tools/<name>": a program of the build tree (DDP_BUILD_ROOT, which meson sets for
 * tests; "." when unset). The result lives until four more calls. */
const char *ddp_test_tool(const char *name);
/* The whole file at path, malloc'd and NUL-terminated (*len: its size, when len is not
 * NULL); NULL when it cannot be opened. Free with free(). */
char *ddp_test_read_file(const char *path, size_t *len);

/* Parent side: runs tools/torch/<script> <args> (an oracle of the PyTorch side) with
 * /usr/bin/python3 (one BLAS thread). False when the interpreter or the source root is
 * missing or the script exits 77 (what it needs is absent: the test skips); any other
 * failure fails the test. */
bool ddp_test_run_tool(const char *script, const char *args);
/* Parent side: makes a fresh empty file /tmp/ddp_<suite>_<stem>_XXXXXX (mkstemp) and writes
 * its path into buf; the file is removed at exit if still there (cleanup.h). */
void ddp_test_tmp_file(char *buf, size_t len, const char *suite, const char *stem);

/* "DDP_TEST_HUNG", "DDP_TEST_CRASHED", or ddp_status_name() of a status, for messages. */
const char *ddp_test_status_name(int status);

/* ---- pieces several test files share ---- */

/* The bits of a float, and the float with given bits. */
uint32_t ddp_test_fbits(float f);
float ddp_test_bitsf(uint32_t u);

/* A batch for the 784-input, 10-class MLP at batch 64: returns x (64 x 784 floats, uniform
 * from ddp_rng_init(1, 1); the caller frees it) and sets t[i] = i % 10. */
float *ddp_test_mlp_batch(int64_t t[64]);
/* Parent side: one forward + backward of m (cross entropy against t) on that batch in c,
 * then resets c. */
void ddp_test_mlp_step(ddp_model_t *m, ddp_ctx_t *c, const float *x, const int64_t *t);

#endif /* DDP_TEST_HARNESS_H */
