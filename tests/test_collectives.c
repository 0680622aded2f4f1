/* Collectives on every backend (suite coll).
 *
 * Matrix: backend (threads, shm, tcp) x world {1,2,3,4,7,8} x count {0, 1, W-1, W+1, 1000,
 * 65539} x dtype, for allreduce (SUM, AVG, MIN, MAX, PRODUCT; in place and out of place),
 * broadcast, allgather, reduce_scatter, alltoall, barrier and send/recv. The data are small
 * integers whose sums and products are exact in every dtype, so each rank computes the exact
 * expected value independently (a closed formula over the ranks) and reports mismatches;
 * the parent asserts. Forked worlds use fewer dtypes to stay quick on two cores.
 *
 * Determinism (D2): random fp32/fp16/bf16 data give allreduce results bitwise equal to a
 * serial rank-order fold computed in the test (fp16/bf16 rounded after each addition), on
 * every backend, through the direct and the staged shm paths, at several segment sizes;
 * and the hashes of the results agree across backends.
 *
 * API: ddp_spawn_threads, argument errors (returned at once, group still usable), work
 * handle states, blocking calls (work == NULL: results, issue order behind queued work, no
 * allocation on an idle group, the failure's message), ddp_pg_create_from_env under torchrun-style
 * variables (tcp, shm), the DDP_ALGORITHM override and the INFO line of the size table, and no
 * leaked allocations. */
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "ddp/backend.h"
#include "ddp/pg.h"
#include "ddp/store.h"
#include "harness.h"

/* The group's last error, copied out under its lock (ddp_pg_last_error_copy); the message
 * of the returned value lives to the end of the caller's full expression. */
static ddp_error_t pg_err(const ddp_pg_t *pg) {
  ddp_error_t e;
  ddp_pg_last_error_copy(pg, &e);
  return e;
}
#include "colldata.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

typedef struct cfg {
  const char *backend;
  ddp_test_mode_t mode;
  int world;
  const ddp_dtype_t *dtypes;
  int ndtypes;
  ddp_algorithm_t algo;
  size_t segment_bytes;
  bool pg_alloc;      /* use ddp_pg_alloc buffers (shm: direct, zero copy) */
  ddp_store_t *store; /* thread mode: shared in-process store */
} cfg_t;

static const ddp_dtype_t all_dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16,
                                         DDP_I32, DDP_I64, DDP_U8};
static const ddp_dtype_t fork_dtypes[] = {DDP_F32, DDP_BF16, DDP_I64, DDP_U8};

/* A rank's check state; coll first, so that say() can find tr. */
typedef struct ctx {
  ddp_test_coll_t coll;
  ddp_test_rank_t *tr;
} ctx_t;

static void say_tr(ddp_test_coll_t *c, const char *msg) {
  ddp_test_say(((ctx_t *)c)->tr, "%s", msg);
}

static ctx_t make_ctx(ddp_test_rank_t *tr, const cfg_t *cfg, ddp_pg_t *pg) {
  ctx_t c = {{pg, ddp_test_rank(tr), ddp_test_world_size(tr), cfg->pg_alloc, say_tr, 0, ""}, tr};
  return c;
}

/* This rank's group for cfg (see ddp_test_pg_create; a failure is said as "create: ..."). */
static ddp_status_t make_pg(ddp_test_rank_t *tr, const cfg_t *cfg, ddp_store_t **store,
                            ddp_pg_t **pg, int64_t timeout_ms) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = cfg->backend;
  o.store = cfg->store;
  o.timeout_ms = timeout_ms;
  o.algorithm = cfg->algo;
  o.segment_bytes = cfg->segment_bytes;
  o.shm_heap_bytes = 16u << 20;
  return ddp_test_pg_create(tr, &o, "create", store, pg);
}

static int matrix_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  ddp_store_t *store = NULL;
  ctx_t c = make_ctx(tr, cfg, NULL);
  ddp_status_t st = make_pg(tr, cfg, &store, &c.coll.pg, 20000);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  size_t W = (size_t)c.coll.W;
  /* 17 and 34 reach the shared family's stamped lines (25-136 bytes) for every element
   * size, up to the last byte (f32 34, f64 17) */
  size_t counts[] = {0, 1, W - 1, W + 1, 17, 34, 1000, 65539};
  for (size_t k = 0; k < ARRAY_LEN(counts) && st == DDP_OK; k++)
    for (int d = 0; d < cfg->ndtypes && st == DDP_OK; d++) {
      st = ddp_test_check_allreduce(&c.coll, cfg->dtypes[d], counts[k]);
      if (st == DDP_OK) st = ddp_test_check_others(&c.coll, cfg->dtypes[d], counts[k]);
    }
  ddp_pg_destroy(c.coll.pg);
  ddp_store_destroy(store);
  if (st != DDP_OK) return st;
  if (c.coll.bad) {
    ddp_test_say(tr, "%ld mismatches; first: %s", c.coll.bad, c.coll.first);
    return DDP_ERR_INTERNAL;
  }
  return DDP_OK;
}

/* matrix_rank where rank 1 alone passes private buffers and the others ddp_pg_alloc ones:
 * the shared family's AUTO allreduce (above 512 bytes, up to 16 KiB) then folds rank 1's
 * box with the others' buffers, and those ranks fold into scratch and copy out after a
 * barrier (src/algo/shared.c, allreduce_auto). */
static int mixed_rank(ddp_test_rank_t *tr, void *arg) {
  cfg_t cfg = *(const cfg_t *)arg;
  cfg.pg_alloc = ddp_test_rank(tr) != 1;
  return matrix_rank(tr, &cfg);
}

/* Spawns cfg's world running fn on every rank (thread ranks share an in-memory store) and
 * asserts that every rank returned DDP_OK. */
static void run_cfg(cfg_t *cfg, int (*fn)(ddp_test_rank_t *, void *)) {
  if (cfg->mode == DDP_TEST_THREADS) {
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = 20000;
    assert_int_equal(ddp_store_create_memory(&so, &cfg->store, NULL), DDP_OK);
  }
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = cfg->world;
  o.mode = cfg->mode;
  o.timeout_ms = 60000;
  ddp_test_results_t *res = ddp_test_spawn(&o, fn, cfg);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  ddp_store_destroy(cfg->store);
  cfg->store = NULL;
}

/* DDP_TEST_MAX_WORLD (tools/test.sh --tsan): the matrices stop at that world size. Under
 * ThreadSanitizer 7 and 8 forked ranks on two cores took most of this test's 90 s; W = 4
 * already runs every algorithm with concurrent peers, and the normal and ASan runs keep 7
 * and 8 (arrays sized by W). */
static int max_world(void) {
  const char *e = getenv("DDP_TEST_MAX_WORLD");
  return e && atoi(e) > 0 ? atoi(e) : INT_MAX;
}

static void run_matrix(const char *backend, ddp_test_mode_t mode, const int *worlds, int nworlds,
                       bool pg_alloc, size_t segment) {
  for (int k = 0; k < nworlds; k++) {
    if (worlds[k] > max_world()) continue;
    cfg_t cfg = {backend,
                 mode,
                 worlds[k],
                 mode == DDP_TEST_THREADS ? all_dtypes : fork_dtypes,
                 mode == DDP_TEST_THREADS ? 7 : 4,
                 DDP_ALGO_AUTO,
                 segment,
                 pg_alloc,
                 NULL};
    run_cfg(&cfg, matrix_rank);
  }
}

static const int worlds_all[] = {1, 2, 3, 4, 7, 8};

static void test_threads_matrix(void **state) {
  run_matrix("threads", DDP_TEST_THREADS, worlds_all, 6, false, 0);
}

static void test_shm_matrix_staged(void **state) {
  /* ordinary buffers: copied through staging areas of 4 KiB, so large counts take many
   * chunks */
  run_matrix("shm", DDP_TEST_FORK, worlds_all, 6, false, 4096);
}

static void test_shm_matrix_mixed(void **state) {
  static const int w[] = {2, 3};
  for (int k = 0; k < 2; k++) {
    cfg_t cfg = {"shm", DDP_TEST_FORK, w[k], fork_dtypes, 4, DDP_ALGO_AUTO, 0, false, NULL};
    run_cfg(&cfg, mixed_rank);
  }
}

static void test_shm_matrix_direct(void **state) {
  /* buffers from ddp_pg_alloc: peers read them in place */
  static const int w[] = {2, 3, 8};
  run_matrix("shm", DDP_TEST_FORK, w, 3, true, 0);
}

static void test_tcp_matrix(void **state) {
  run_matrix("tcp", DDP_TEST_FORK, worlds_all, 6, false, 0);
}

/* Blocking calls (work == NULL). Each rank: exact sums from blocking allreduces of a small
 * and a large count, a blocking broadcast; no allocation at all over 50 blocking 4-byte
 * allreduces between two blocking barriers (the idle group's path has no work handle: every
 * rank is inside that window at once, so the process-wide counters must not move); and a
 * blocking allreduce issued behind a large asynchronous one returns only after it (issue
 * order), with both results exact. */
static int blocking_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t st = make_pg(tr, cfg, &store, &pg, 20000);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  size_t big = 300000; /* above the lazy limits: the progress thread runs the async one */
  int32_t *a = malloc(big * sizeof *a), *b = malloc(big * sizeof *b);
  const char *what = "";
  if (!a || !b) {
    st = DDP_ERR_NO_MEMORY;
    what = "malloc";
  }
  int32_t want = W * (W - 1) / 2; /* sum over ranks of r */
  for (size_t n = 1; st == DDP_OK && n <= big; n += big - 1) {
    for (size_t i = 0; i < n; i++) a[i] = r + (int32_t)(i % 7);
    what = "blocking allreduce";
    st = ddp_allreduce(pg, a, a, n, DDP_I32, DDP_OP_SUM, NULL);
    for (size_t i = 0; st == DDP_OK && i < n; i++)
      if (a[i] != want + W * (int32_t)(i % 7)) {
        ddp_test_say(tr, "blocking allreduce of %zu: [%zu] = %d, want %d", n, i, a[i],
                     want + W * (int32_t)(i % 7));
        st = DDP_ERR_INTERNAL;
      }
  }
  if (st == DDP_OK) {
    what = "blocking broadcast";
    a[0] = r == W - 1 ? 4242 : -1;
    st = ddp_broadcast(pg, a, 1, DDP_I32, W - 1, NULL);
    if (st == DDP_OK && a[0] != 4242) {
      ddp_test_say(tr, "blocking broadcast gave %d, want 4242", a[0]);
      st = DDP_ERR_INTERNAL;
    }
  }
  ddp_alloc_stats_t s0 = {0}, s1 = {0};
  if (st == DDP_OK) {
    what = "blocking barrier";
    st = ddp_barrier(pg, NULL);
  }
  ddp_alloc_stats(&s0);
  for (int k = 0; k < 50 && st == DDP_OK; k++) {
    what = "blocking 4-byte allreduce";
    a[0] = r;
    st = ddp_allreduce(pg, a, a, 1, DDP_I32, DDP_OP_SUM, NULL);
    if (st == DDP_OK && a[0] != want) {
      ddp_test_say(tr, "blocking 4-byte allreduce %d gave %d, want %d", k, a[0], want);
      st = DDP_ERR_INTERNAL;
    }
  }
  if (st == DDP_OK) st = ddp_barrier(pg, NULL);
  ddp_alloc_stats(&s1);
  if (st == DDP_OK) st = ddp_barrier(pg, NULL); /* nobody allocates before all have read */
  if (st == DDP_OK && s1.allocs != s0.allocs) {
    ddp_test_say(tr, "%llu allocations during 50 blocking allreduces on an idle group, want 0",
                 (unsigned long long)(s1.allocs - s0.allocs));
    st = DDP_ERR_INTERNAL;
  }
  ddp_work_t *w = NULL;
  if (st == DDP_OK) {
    what = "async allreduce, then a blocking one behind it";
    for (size_t i = 0; i < big; i++) b[i] = r;
    a[0] = 1;
    st = ddp_allreduce(pg, b, b, big, DDP_I32, DDP_OP_SUM, &w);
    if (st == DDP_OK) st = ddp_allreduce(pg, a, a, 1, DDP_I32, DDP_OP_SUM, NULL);
    bool done = false;
    if (st == DDP_OK) st = ddp_work_test(w, &done);
    if (st == DDP_OK && !done) {
      ddp_test_say(tr, "the blocking allreduce returned before the async one queued before it");
      st = DDP_ERR_INTERNAL;
    }
    if (st == DDP_OK && (a[0] != W || b[0] != want || b[big - 1] != want)) {
      ddp_test_say(tr, "behind queued work: %d, %d, %d, want %d, %d, %d", a[0], b[0], b[big - 1], W,
                   want, want);
      st = DDP_ERR_INTERNAL;
    }
  }
  if (w) {
    ddp_status_t ws = ddp_work_wait_free(w);
    if (st == DDP_OK) st = ws;
  }
  if (st != DDP_OK && st != DDP_ERR_INTERNAL)
    ddp_test_say(tr, "%s: %s: %s", what, ddp_status_name(st), pg_err(pg).msg);
  free(a);
  free(b);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_blocking_calls(void **state) {
  static const struct {
    const char *backend;
    ddp_test_mode_t mode;
    int world;
  } runs[] = {{"threads", DDP_TEST_THREADS, 3},
              {"shm", DDP_TEST_FORK, 2},
              {"tcp", DDP_TEST_FORK, 3}};
  for (size_t k = 0; k < ARRAY_LEN(runs); k++) {
    cfg_t cfg = {runs[k].backend, runs[k].mode, runs[k].world, NULL, 0, DDP_ALGO_AUTO, 0,
                 false,           NULL};
    run_cfg(&cfg, blocking_rank);
  }
}

/* ddp_pg_options_t.defer_start: asynchronous work above the start-at-once limits, in a
 * group created with it, gives exact sums when waited for (on the waiting thread), and
 * work nobody waits for or tests still ends: its status is polled (ddp_work_status, which
 * starts nothing) until it is done, within 30 s. */
static int defer_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = cfg->backend;
  o.store = cfg->store;
  o.timeout_ms = 20000;
  o.defer_start = true;
  ddp_status_t st = ddp_test_pg_create(tr, &o, "create", &store, &pg);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  int32_t want = W * (W - 1) / 2;
  size_t big = 600000; /* 2.4 MB: above 1 MiB (shm) and 256 KiB (links) */
  int32_t *a = malloc(big * sizeof *a);
  ddp_work_t *w = NULL;
  if (!a) st = DDP_ERR_NO_MEMORY;
  for (int round = 0; round < 2 && st == DDP_OK; round++) {
    for (size_t i = 0; i < big; i++) a[i] = r;
    st = ddp_allreduce(pg, a, a, big, DDP_I32, DDP_OP_SUM, &w);
    if (st != DDP_OK) break;
    if (round == 0) {
      st = ddp_work_wait(w, -1);
    } else {
      int64_t give_up = ddp_now_ns() + 30 * 1000000000LL;
      while (ddp_work_status(w) == DDP_ERR_INVALID_USAGE && ddp_now_ns() < give_up) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
      }
      if (ddp_work_status(w) == DDP_ERR_INVALID_USAGE) {
        ddp_test_say(tr, "deferred work nobody waited for had not ended after 30 s");
        st = DDP_ERR_INTERNAL;
      } else {
        st = ddp_work_wait(w, -1);
      }
    }
    ddp_status_t ws = ddp_work_wait_free(w);
    w = NULL;
    if (st == DDP_OK) st = ws;
    if (st == DDP_OK && (a[0] != want || a[big - 1] != want)) {
      ddp_test_say(tr, "deferred allreduce (%s): %d, %d, want %d",
                   round ? "not waited for" : "waited for", a[0], a[big - 1], want);
      st = DDP_ERR_INTERNAL;
    }
  }
  if (st != DDP_OK && st != DDP_ERR_INTERNAL)
    ddp_test_say(tr, "deferred allreduce: %s: %s", ddp_status_name(st), pg_err(pg).msg);
  free(a);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_defer_start(void **state) {
  (void)state;
  cfg_t threads = {"threads", DDP_TEST_THREADS, 3, NULL, 0, DDP_ALGO_AUTO, 0, false, NULL};
  cfg_t shm = {"shm", DDP_TEST_FORK, 2, NULL, 0, DDP_ALGO_AUTO, 0, false, NULL};
  cfg_t tcp = {"tcp", DDP_TEST_FORK, 2, NULL, 0, DDP_ALGO_AUTO, 0, false, NULL};
  run_cfg(&threads, defer_rank);
  run_cfg(&shm, defer_rank);
  run_cfg(&tcp, defer_rank);
}

/* ddp_pg_split (hybrid sharding's node and replica groups): W = 4 ranks split by r / 2
 * (two "nodes") and by r % 2 (two replica groups), twice in a row (the second split gets its
 * own key space): each sub-group has 2 ranks in parent order, and a sum over it is the sum
 * of its members' ranks; a negative color is refused naming it. */
static int split_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL, *node = NULL, *rep = NULL;
  ddp_status_t st = make_pg(tr, cfg, &store, &pg, 20000);
  int r = st == DDP_OK ? ddp_pg_rank(pg) : -1;
  ddp_error_t e = {DDP_OK, ""};
  for (int round = 0; round < 2 && st == DDP_OK; round++) {
    st = ddp_pg_split(pg, r / 2, &node, &e);
    if (st == DDP_OK) st = ddp_pg_split(pg, r % 2, &rep, &e);
    if (st != DDP_OK) {
      ddp_test_say(tr, "split %d: %s: %s", round, ddp_status_name(st), e.msg);
      break;
    }
    int32_t a = r, b = r;
    st = ddp_allreduce(node, &a, &a, 1, DDP_I32, DDP_OP_SUM, NULL);
    if (st == DDP_OK) st = ddp_allreduce(rep, &b, &b, 1, DDP_I32, DDP_OP_SUM, NULL);
    int32_t wa = (r / 2) * 4 + 1, wb = 2 * (r % 2) + 2;
    if (st == DDP_OK &&
        (ddp_pg_size(node) != 2 || ddp_pg_rank(node) != r % 2 || ddp_pg_size(rep) != 2 ||
         ddp_pg_rank(rep) != r / 2 || a != wa || b != wb)) {
      ddp_test_say(tr,
                   "split %d: node rank %d of %d sum %d, replica rank %d of %d sum %d; want "
                   "%d of 2 sum %d, %d of 2 sum %d",
                   round, ddp_pg_rank(node), ddp_pg_size(node), a, ddp_pg_rank(rep),
                   ddp_pg_size(rep), b, r % 2, wa, r / 2, wb);
      st = DDP_ERR_INTERNAL;
    }
    ddp_pg_destroy(node);
    ddp_pg_destroy(rep);
    node = rep = NULL;
  }
  if (st == DDP_OK && ddp_pg_split(pg, -1, &node, &e) != DDP_ERR_INVALID_ARGUMENT) {
    ddp_test_say(tr, "color -1 accepted");
    st = DDP_ERR_INTERNAL;
  } else if (st == DDP_OK && !strstr(e.msg, "color -1 is negative")) {
    ddp_test_say(tr, "color -1: \"%s\"", e.msg);
    st = DDP_ERR_INTERNAL;
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_split(void **state) {
  (void)state;
  static const struct {
    const char *backend;
    ddp_test_mode_t mode;
  } runs[] = {{"threads", DDP_TEST_THREADS}, {"shm", DDP_TEST_FORK}, {"tcp", DDP_TEST_FORK}};
  for (size_t k = 0; k < ARRAY_LEN(runs); k++) {
    cfg_t cfg = {runs[k].backend, runs[k].mode, 4, NULL, 0, DDP_ALGO_AUTO, 0, false, NULL};
    run_cfg(&cfg, split_rank);
  }
}

/* A blocking call on a failed group returns the failure, and the message is the group's:
 * rank 1 aborts, the others' blocking allreduce fails naming it. */
static ddp_status_t blocking_fail_fn(ddp_pg_t *pg, void *arg) {
  (void)arg;
  float x = 1;
  if (ddp_pg_rank(pg) == 1) {
    ddp_pg_abort_reason(pg, "blocking test");
    return ddp_allreduce(pg, &x, &x, 1, DDP_F32, DDP_OP_SUM, NULL) == DDP_ERR_ABORTED
               ? DDP_OK
               : DDP_ERR_INTERNAL;
  }
  ddp_status_t st = ddp_allreduce(pg, &x, &x, 1, DDP_F32, DDP_OP_SUM, NULL);
  ddp_error_t e = pg_err(pg);
  if (st != DDP_ERR_REMOTE || e.status != DDP_ERR_REMOTE ||
      !strstr(e.msg, "rank 1 aborted the group: blocking test")) {
    print_error("rank %d: blocking allreduce on an aborted group: %s, message \"%s\"\n",
                ddp_pg_rank(pg), ddp_status_name(st), e.msg);
    return DDP_ERR_INTERNAL;
  }
  return DDP_OK;
}

static void test_blocking_on_failed_group(void **state) {
  (void)state;
  assert_int_equal(ddp_spawn_threads(3, NULL, blocking_fail_fn, NULL), DDP_OK);
}

static void test_tcp_ring_small_segments(void **state) {
  static const int w[] = {2, 3, 5};
  for (int k = 0; k < 3; k++) {
    cfg_t cfg = {"tcp", DDP_TEST_FORK, w[k], fork_dtypes, 4, DDP_ALGO_RING, 1024, false, NULL};
    run_cfg(&cfg, matrix_rank);
  }
}

/* ---- D2: bitwise rank-order fold on random data ---- */

static int d2_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t st = make_pg(tr, cfg, &store, &pg, 20000);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  ctx_t c = make_ctx(tr, cfg, pg);
  uint64_t h = 0;
  st = ddp_test_d2_run(&c.coll, &h);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  ddp_test_put(tr, &h, sizeof h);
  if (st != DDP_OK) return st;
  if (c.coll.bad) {
    ddp_test_say(tr, "%ld bitwise mismatches against the rank-order fold; first: %s", c.coll.bad,
                 c.coll.first);
    return DDP_ERR_INTERNAL;
  }
  return DDP_OK;
}

static uint64_t run_d2(const char *backend, ddp_test_mode_t mode, int world, bool pg_alloc,
                       size_t segment, ddp_algorithm_t algo) {
  cfg_t cfg = {backend, mode, world, NULL, 0, algo, segment, pg_alloc, NULL};
  if (mode == DDP_TEST_THREADS) {
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = 20000;
    assert_int_equal(ddp_store_create_memory(&so, &cfg.store, NULL), DDP_OK);
  }
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = world;
  o.mode = mode;
  o.timeout_ms = 60000;
  ddp_test_results_t *res = ddp_test_spawn(&o, d2_rank, &cfg);
  ddp_test_expect_ok(res);
  uint64_t h0 = 0;
  for (int r = 0; r < world; r++) {
    const ddp_test_result_t *x = ddp_test_result(res, r);
    assert_int_equal(x->nvalues, sizeof(uint64_t));
    uint64_t h;
    memcpy(&h, x->values, sizeof h);
    if (r == 0) h0 = h;
    DDP_ASSERT_EQ(h, h0); /* every rank holds the same bits */
  }
  ddp_test_results_free(res);
  ddp_store_destroy(cfg.store);
  return h0;
}

static void test_d2_across_backends(void **state) {
  /* W = 2 on tcp runs small up to 128 KiB (SMALL_STREAM_PAIR): 1000 f32 follows its
   * fingerprint on the stream, 16384 f32 (64 KiB) waits for the fingerprints' verdict. */
  for (int world = 2; world <= 4; world++) {
    uint64_t h = run_d2("threads", DDP_TEST_THREADS, world, false, 0, DDP_ALGO_AUTO);
    DDP_ASSERT_EQ(run_d2("threads", DDP_TEST_THREADS, world, false, 0, DDP_ALGO_CANONICAL), h);
    DDP_ASSERT_EQ(run_d2("shm", DDP_TEST_FORK, world, false, 4096, DDP_ALGO_AUTO), h);
    DDP_ASSERT_EQ(run_d2("shm", DDP_TEST_FORK, world, true, 0, DDP_ALGO_AUTO), h);
    DDP_ASSERT_EQ(run_d2("tcp", DDP_TEST_FORK, world, false, 0, DDP_ALGO_AUTO), h);
    DDP_ASSERT_EQ(run_d2("tcp", DDP_TEST_FORK, world, false, 4096, DDP_ALGO_CANONICAL), h);
    DDP_ASSERT_EQ(run_d2("tcp", DDP_TEST_THREADS, world, false, 0, DDP_ALGO_SMALL), h);
  }
}

/* ---- the link backends' receive tail (ddp_xfer_t.tail), on tcp ---- */

/* Rank 0 sends a 32-byte header followed by PAYLOAD bytes to rank 1, in two sends of
 * 32 + first and PAYLOAD - first bytes with a barrier between them; rank 1 receives the
 * header with the payload as its tail between the two barriers, then the rest itself. A
 * send of at most 32 + 4 KiB is one segment on loopback, so rank 1's receive sees all of
 * it or none: tail_done must be exactly `first` (the bytes already there, and never a wait
 * for the rest, which rank 0 sends only after rank 1's receive returned). */
#define TAIL_PAYLOAD 4096

typedef struct tail_case {
  ddp_store_t *store;
  pthread_barrier_t bar;
  size_t first;                         /* payload bytes in rank 0's first send */
  ddp_status_t st[2];                   /* create and transfers, per rank */
  ddp_error_t err[2];                   /* the first error, per rank */
  size_t tail_done;                     /* rank 1: what its header receive took into the tail */
  unsigned char got[32 + TAIL_PAYLOAD]; /* rank 1: header, then payload */
} tail_case_t;

typedef struct tail_rank {
  tail_case_t *tc;
  int rank;
} tail_rank_t;

static unsigned char tail_byte(size_t i) { return (unsigned char)(i * 131u + 7u); }

/* Rank `rank` of a two-rank tcp backend on store, without a process group: the xfer tests
 * drive the backend's table directly. */
typedef struct tcp_pair {
  const ddp_backend_ops_t *ops;
  void *state;
  ddp_status_t st;
  ddp_error_t err;
  int64_t deadline;
} tcp_pair_t;

static void tcp_pair_open(tcp_pair_t *p, ddp_store_t *store, int rank) {
  p->ops = ddp_backend_find("tcp");
  ddp_backend_init_t in = {sizeof in, rank, 2, store, 20000, "", 0, 0, 0};
  p->state = NULL;
  p->err = (ddp_error_t){0};
  p->st = p->ops->create(&in, &p->state, &p->err);
  p->deadline = ddp_now_ns() + 20000LL * 1000000LL;
}

/* One transfer (a batch of one) unless an earlier step failed; the first failure stays. */
static void tcp_pair_xfer(tcp_pair_t *p, ddp_xfer_t *x) {
  if (p->st == DDP_OK) p->st = p->ops->xfer(p->state, x, 1, NULL, p->deadline, &p->err);
}

/* Hands the rank's outcome to the test and destroys the backend. */
static void tcp_pair_close(tcp_pair_t *p, ddp_status_t *st, ddp_error_t *err) {
  *st = p->st;
  *err = p->err;
  if (p->state) p->ops->destroy(p->state);
}

static void *tail_rank_main(void *arg) {
  tail_rank_t *tr = arg;
  tail_case_t *tc = tr->tc;
  tcp_pair_t p;
  tcp_pair_open(&p, tc->store, tr->rank);
  unsigned char msg[32 + TAIL_PAYLOAD];
  for (size_t i = 0; i < sizeof msg; i++) msg[i] = tail_byte(i);
  if (tr->rank == 0) {
    ddp_xfer_t a = {.peer = 1, .is_send = true, .buf = msg, .bytes = 32 + tc->first};
    tcp_pair_xfer(&p, &a);
    pthread_barrier_wait(&tc->bar);
    pthread_barrier_wait(&tc->bar);
    ddp_xfer_t b = {.peer = 1,
                    .is_send = true,
                    .buf = msg + a.bytes,
                    .bytes = sizeof msg - a.bytes};
    if (b.bytes) tcp_pair_xfer(&p, &b);
  } else {
    pthread_barrier_wait(&tc->bar);
    ddp_xfer_t h = {.peer = 0,
                    .buf = tc->got,
                    .bytes = 32,
                    .tail = tc->got + 32,
                    .tail_bytes = TAIL_PAYLOAD};
    tcp_pair_xfer(&p, &h);
    tc->tail_done = h.tail_done;
    pthread_barrier_wait(&tc->bar);
    ddp_xfer_t rest = {.peer = 0,
                       .buf = tc->got + 32 + h.tail_done,
                       .bytes = TAIL_PAYLOAD - h.tail_done};
    if (rest.bytes) tcp_pair_xfer(&p, &rest);
  }
  tcp_pair_close(&p, &tc->st[tr->rank], &tc->err[tr->rank]);
  return NULL;
}

/* A send's tail (ddp_xfer_t): rank 0 sends `head` bytes from buf and the rest of a
 * 40 MiB pattern as the tail, more than the socket buffers hold, so tcp's sendmsg returns
 * short and resumes inside buf, across the join and inside the tail; rank 1 starts
 * receiving only after 20 ms, in one plain receive, and must see the pattern whole and in
 * order. */
#define SEND_TAIL_BYTES (40u << 20)

typedef struct send_tail_case {
  ddp_store_t *store;
  size_t head;
  unsigned char *data[2]; /* rank 0's pattern, rank 1's receive */
  ddp_status_t st[2];
  ddp_error_t err[2];
} send_tail_case_t;

typedef struct send_tail_rank {
  send_tail_case_t *tc;
  int rank;
} send_tail_rank_t;

static void *send_tail_main(void *arg) {
  send_tail_rank_t *tr = arg;
  send_tail_case_t *tc = tr->tc;
  tcp_pair_t p;
  tcp_pair_open(&p, tc->store, tr->rank);
  unsigned char *d = tc->data[tr->rank];
  ddp_xfer_t x = {.peer = 1, .is_send = true, .buf = d, .bytes = tc->head};
  if (tr->rank == 0) {
    x.tail = d + tc->head;
    x.tail_bytes = SEND_TAIL_BYTES - tc->head;
  } else {
    x = (ddp_xfer_t){.peer = 0, .buf = d, .bytes = SEND_TAIL_BYTES};
    struct timespec ts = {0, 20 * 1000000L};
    nanosleep(&ts, NULL);
  }
  tcp_pair_xfer(&p, &x);
  if (p.st == DDP_OK && tr->rank == 0 && x.tail_done != x.tail_bytes) {
    p.st = DDP_ERR_INTERNAL;
    snprintf(p.err.msg, sizeof p.err.msg, "tail_done %zu of %zu", x.tail_done, x.tail_bytes);
  }
  tcp_pair_close(&p, &tc->st[tr->rank], &tc->err[tr->rank]);
  return NULL;
}

static void test_tcp_xfer_send_tail(void **state) {
  (void)state;
  const size_t heads[] = {0, 32, 3u << 20};
  for (size_t k = 0; k < ARRAY_LEN(heads); k++) {
    send_tail_case_t tc = {.head = heads[k]};
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = 20000;
    assert_int_equal(ddp_store_create_memory(&so, &tc.store, NULL), DDP_OK);
    tc.data[0] = malloc(SEND_TAIL_BYTES);
    tc.data[1] = calloc(1, SEND_TAIL_BYTES);
    assert_non_null(tc.data[0]);
    assert_non_null(tc.data[1]);
    for (size_t i = 0; i < SEND_TAIL_BYTES; i++) tc.data[0][i] = tail_byte(i);
    pthread_t th[2];
    send_tail_rank_t tr[2] = {{&tc, 0}, {&tc, 1}};
    for (int r = 0; r < 2; r++)
      assert_int_equal(pthread_create(&th[r], NULL, send_tail_main, &tr[r]), 0);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 2; r++) {
      if (tc.st[r] != DDP_OK) print_message("head %zu rank %d: %s\n", tc.head, r, tc.err[r].msg);
      assert_int_equal(tc.st[r], DDP_OK);
    }
    size_t i = 0;
    while (i < SEND_TAIL_BYTES && tc.data[1][i] == tail_byte(i)) i++;
    if (i < SEND_TAIL_BYTES)
      print_message("head %zu: byte %zu is %u, expected %u\n", tc.head, i, tc.data[1][i],
                    tail_byte(i));
    DDP_ASSERT_EQ(i, (size_t)SEND_TAIL_BYTES);
    free(tc.data[0]);
    free(tc.data[1]);
    ddp_store_destroy(tc.store);
  }
}

static void test_tcp_xfer_tail(void **state) {
  (void)state;
  const size_t firsts[] = {0, 1, 1000, TAIL_PAYLOAD};
  for (size_t k = 0; k < ARRAY_LEN(firsts); k++) {
    tail_case_t tc = {.first = firsts[k]};
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = 20000;
    assert_int_equal(ddp_store_create_memory(&so, &tc.store, NULL), DDP_OK);
    pthread_barrier_init(&tc.bar, NULL, 2);
    pthread_t th[2];
    tail_rank_t tr[2] = {{&tc, 0}, {&tc, 1}};
    for (int r = 0; r < 2; r++)
      assert_int_equal(pthread_create(&th[r], NULL, tail_rank_main, &tr[r]), 0);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&tc.bar);
    ddp_store_destroy(tc.store);
    for (int r = 0; r < 2; r++) {
      if (tc.st[r] != DDP_OK) print_error("first %zu, rank %d: %s\n", tc.first, r, tc.err[r].msg);
      DDP_ASSERT_EQ((int)tc.st[r], (int)DDP_OK);
    }
    DDP_ASSERT_EQ(tc.tail_done, tc.first);
    for (size_t i = 0; i < sizeof tc.got; i++) {
      if (tc.got[i] != tail_byte(i)) print_error("first %zu: byte %zu differs\n", tc.first, i);
      DDP_ASSERT_EQ(tc.got[i], tail_byte(i));
    }
  }
}

/* ---- API: spawn_threads, argument checks, work handles, create_from_env, no leaks ---- */

/* A failed check of spawn_fn, said on stderr (the parent sees only the status). */
static ddp_status_t spawn_check_failed(const ddp_pg_t *pg, const char *what) {
  fprintf(stderr, "spawn_fn rank %d of %d: %s\n", ddp_pg_rank(pg), ddp_pg_size(pg), what);
  return DDP_ERR_INTERNAL;
}

static ddp_status_t spawn_fn(ddp_pg_t *pg, void *arg) {
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  int64_t x = r + 1;
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(pg, &x, &x, 1, DDP_I64, DDP_OP_SUM, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st == DDP_OK && x != (int64_t)W * (W + 1) / 2) st = spawn_check_failed(pg, "wrong sum");
  /* argument errors: returned at once, the group stays usable */
  float f[4] = {0};
  if (ddp_allreduce(pg, f, f, 4, DDP_BOOL, DDP_OP_SUM, &w) != DDP_ERR_INVALID_ARGUMENT ||
      ddp_allreduce(pg, f, f, 4, DDP_F32, (ddp_redop_t)9, &w) != DDP_ERR_INVALID_ARGUMENT ||
      ddp_broadcast(pg, f, 4, DDP_F32, W, &w) != DDP_ERR_INVALID_ARGUMENT ||
      ddp_send(pg, f, 4, DDP_F32, r, &w) != DDP_ERR_INVALID_ARGUMENT ||
      ddp_allreduce(pg, f, f + 1, 2, DDP_F32, DDP_OP_SUM, &w) != DDP_ERR_INVALID_ARGUMENT ||
      ddp_allreduce(pg, NULL, NULL, 4, DDP_F32, DDP_OP_SUM, &w) != DDP_ERR_INVALID_ARGUMENT ||
      strstr(pg_err(pg).msg, "allreduce") == NULL)
    st = spawn_check_failed(pg, "an argument error was not returned at once");
  if (st == DDP_OK && ddp_pg_status(pg) != DDP_OK)
    st = spawn_check_failed(pg, "argument errors left the group failed");
  /* work handles: test/status while queued behind a barrier, free before completion */
  ddp_work_t *b = NULL, *a = NULL;
  if (st == DDP_OK) st = ddp_barrier(pg, &b);
  if (st == DDP_OK) st = ddp_allreduce(pg, f, f, 4, DDP_F32, DDP_OP_MAX, &a);
  if (st == DDP_OK) {
    ddp_work_free(b); /* released when it ends */
    bool done = false;
    ddp_work_test(a, &done);
    /* Still running: INVALID_USAGE; the progress thread may finish it between the two calls
     * (seen under load), and then the final status is the answer. */
    ddp_status_t mid = done ? DDP_OK : ddp_work_status(a);
    if (mid != DDP_ERR_INVALID_USAGE && mid != DDP_OK)
      st = spawn_check_failed(pg, "status of running work is not INVALID_USAGE");
    if (mid == DDP_OK && !done && (ddp_work_test(a, &done), !done))
      st = spawn_check_failed(pg, "status OK before the work completed");
    if (ddp_work_wait(a, 10000) != DDP_OK || ddp_work_status(a) != DDP_OK)
      st = spawn_check_failed(pg, "the queued allreduce did not end OK");
    ddp_work_test(a, &done);
    if (!done) st = spawn_check_failed(pg, "ddp_work_test says not done after the wait");
    ddp_work_free(a);
  }
  return st;
}

static void test_spawn_threads_and_arguments(void **state) {
  int64_t live = ddp_test_live_allocs();
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.timeout_ms = 10000;
  for (int W = 1; W <= 4; W++) assert_int_equal(ddp_spawn_threads(W, &o, spawn_fn, NULL), DDP_OK);
  assert_int_equal(ddp_spawn_threads(3, NULL, spawn_fn, NULL), DDP_OK);
  /* every allocation of the groups, works and stores was returned */
  assert_int_equal(ddp_test_live_allocs(), live);
  /* a bad backend name lists the choices */
  ddp_pg_options_t bad = DDP_PG_OPTIONS_INIT;
  bad.backend = "xccl";
  ddp_pg_t *pg = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_pg_create(&bad, &pg, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "shm"));
  bad.backend = "gloo";
  bad.world = 0;
  assert_int_equal(ddp_pg_create(&bad, &pg, &err), DDP_ERR_INVALID_ARGUMENT);
}

/* The one list of backends (DDP_BACKEND_LIST) agrees with the registry: every built table is
 * in it under its name, ddp_backend_find takes the list's aliases, and the names in messages
 * come from it. The capabilities that replaced identity checks are where the layers above
 * expect them; every table has the ABI version the library was built with. */
static void test_backend_list(void **state) {
  (void)state;
  static const ddp_backend_info_t all[] = {
#define TEST_BACKEND_(name, alias, ranks, optional) {name, alias, ranks, optional},
      DDP_BACKEND_LIST(TEST_BACKEND_)
#undef TEST_BACKEND_
  };
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    const ddp_backend_info_t *b = ddp_backend_info(all[i].name);
    assert_non_null(b);
    assert_string_equal(b->name, all[i].name);
    const ddp_backend_ops_t *ops = ddp_backend_find(all[i].name);
    if (!all[i].optional) assert_non_null(ops);
    if (!ops) continue;
    assert_string_equal(ops->name, all[i].name);
    assert_int_equal(ops->abi_version, DDP_BACKEND_ABI_VERSION);
    assert_non_null(strstr(ddp_backend_names(), all[i].name));
    if (all[i].alias[0]) assert_ptr_equal(ddp_backend_find(all[i].alias), ops);
  }
  assert_string_equal(ddp_backend_info("gloo")->name, "tcp");
  assert_int_equal(ddp_backend_info("threads")->ranks, DDP_RANKS_THREADS);
  assert_null(ddp_backend_info("xccl"));
  assert_null(ddp_backend_info(""));
  assert_null(ddp_backend_find("xccl"));
  assert_int_equal(strncmp(ddp_backend_names(), "threads, shm, tcp (alias gloo)", 30), 0);
  assert_true(ddp_backend_find("tcp")->stream);
  assert_false(ddp_backend_find("shm")->stream);
  assert_non_null(ddp_backend_find("shm")->alloc_error);
  assert_string_equal(ddp_coll_kind_name(DDP_COLL_SEND), "send/recv");
  assert_string_equal(ddp_coll_kind_name(DDP_COLL_REDUCE_SCATTER), "reduce_scatter");
  assert_string_equal(ddp_redop_name(DDP_OP_PRODUCT), "PRODUCT");
}

/* ddp_pg_last_error_copy: empty on a fresh group, then the argument error, copied. */
static ddp_status_t last_error_fn(ddp_pg_t *pg, void *arg) {
  (void)arg;
  ddp_error_t e = {DDP_ERR_INTERNAL, "stale"};
  ddp_pg_last_error_copy(pg, &e);
  if (e.status != DDP_OK || e.msg[0]) return DDP_ERR_INTERNAL;
  float f = 0;
  ddp_work_t *w = NULL;
  if (ddp_broadcast(pg, &f, 1, DDP_F32, 99, &w) != DDP_ERR_INVALID_ARGUMENT)
    return DDP_ERR_INTERNAL;
  ddp_pg_last_error_copy(pg, &e);
  if (e.status != DDP_ERR_INVALID_ARGUMENT || !strstr(e.msg, "root 99")) return DDP_ERR_INTERNAL;
  return DDP_OK;
}

static void test_last_error_copy(void **state) {
  (void)state;
  assert_int_equal(ddp_spawn_threads(2, NULL, last_error_fn, NULL), DDP_OK);
}

typedef struct env_arg {
  const char *backend;
  int port;
} env_arg_t;

static int env_rank(ddp_test_rank_t *tr, void *arg) {
  const env_arg_t *a = arg;
  char v[32];
  snprintf(v, sizeof v, "%d", ddp_test_rank(tr));
  setenv("RANK", v, 1);
  snprintf(v, sizeof v, "%d", ddp_test_world_size(tr));
  setenv("WORLD_SIZE", v, 1);
  snprintf(v, sizeof v, "%d", a->port);
  setenv("MASTER_PORT", v, 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("DDP_BACKEND", a->backend, 1);
  setenv("DDP_TIMEOUT", "20", 1);
  ddp_pg_t *pg = NULL;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_pg_create_from_env(NULL, &pg, &err);
  if (st != DDP_OK) {
    ddp_test_say(tr, "%s", err.msg);
    return st;
  }
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  double x = r;
  ddp_work_t *w = NULL;
  st = ddp_allreduce(pg, &x, &x, 1, DDP_F64, DDP_OP_SUM, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st == DDP_OK && (x != W * (W - 1) / 2.0 || strcmp(ddp_pg_backend_name(pg), a->backend)))
    st = DDP_ERR_INTERNAL;
  ddp_pg_destroy(pg);
  return st;
}

static void test_create_from_env(void **state) {
  static const char *backends[] = {"tcp", "shm"};
  for (int b = 0; b < 2; b++) {
    /* an ephemeral port for the store server (rank 0) */
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    ddp_store_t *probe = NULL;
    assert_int_equal(ddp_store_create_tcp("127.0.0.1", 0, true, &so, &probe, NULL), DDP_OK);
    env_arg_t a = {backends[b], ddp_store_port(probe)};
    ddp_store_destroy(probe);
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 30000;
    ddp_test_results_t *res = ddp_test_spawn(&o, env_rank, &a);
    ddp_test_expect_ok(res);
    ddp_test_results_free(res);
  }
}

/* ---- the algorithm table: env override and the INFO log line ---- */

typedef struct log_capture {
  char lines[8][512];
  int n;
} log_capture_t;

static void capture_sink(void *user, ddp_log_level_t level, const char *line) {
  log_capture_t *c = user;
  if (c->n < 8) snprintf(c->lines[c->n++], sizeof c->lines[0], "%s", line);
}

static ddp_status_t noop_fn(ddp_pg_t *pg, void *arg) { return DDP_OK; }

static bool captured(const log_capture_t *c, const char *needle) {
  for (int i = 0; i < c->n; i++)
    if (strstr(c->lines[i], needle)) return true;
  return false;
}

static void test_algorithm_table_env(void **state) {
  log_capture_t cap = {0};
  ddp_set_log_sink(capture_sink, &cap);
  setenv("DDP_DEBUG", "INFO", 1);
  assert_int_equal(ddp_spawn_threads(2, NULL, noop_fn, NULL), DDP_OK);
  assert_true(captured(&cap, "small up to 512 bytes, then up to 16384 bytes canonical where every "
                             "rank's buffers are in shared memory and small otherwise, canonical "
                             "above (DDP_ALGORITHM=auto)"));
  cap.n = 0;
  setenv("DDP_ALGORITHM", "ring", 1);
  assert_int_equal(ddp_spawn_threads(2, NULL, noop_fn, NULL), DDP_OK);
  assert_true(captured(&cap, "ring for every size (ring is a link algorithm"));
  setenv("DDP_ALGORITHM", "fastest", 1);
  assert_int_equal(ddp_spawn_threads(2, NULL, noop_fn, NULL), DDP_ERR_INVALID_ARGUMENT);
  unsetenv("DDP_ALGORITHM");
  unsetenv("DDP_DEBUG");
  ddp_set_log_sink(NULL, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_threads_matrix),
      cmocka_unit_test(test_shm_matrix_staged),
      cmocka_unit_test(test_shm_matrix_direct),
      cmocka_unit_test(test_shm_matrix_mixed),
      cmocka_unit_test(test_tcp_matrix),
      cmocka_unit_test(test_tcp_ring_small_segments),
      cmocka_unit_test(test_blocking_calls),
      cmocka_unit_test(test_defer_start),
      cmocka_unit_test(test_split),
      cmocka_unit_test(test_blocking_on_failed_group),
      cmocka_unit_test(test_d2_across_backends),
      cmocka_unit_test(test_tcp_xfer_tail),
      cmocka_unit_test(test_tcp_xfer_send_tail),
      cmocka_unit_test(test_spawn_threads_and_arguments),
      cmocka_unit_test(test_backend_list),
      cmocka_unit_test(test_last_error_copy),
      cmocka_unit_test(test_create_from_env),
      cmocka_unit_test(test_algorithm_table_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
