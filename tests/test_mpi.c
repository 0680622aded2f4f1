/* The mpi backend under a real mpirun (suite coll).
 *
 * Run plainly (by meson), this program is the parent: for W in {2, 3, 4} it starts
 * `mpirun --allow-run-as-root --oversubscribe -np W <itself>` with DDP_TEST_MPI_OUT naming
 * a fresh directory, and each MPI rank (this same program, seeing that variable) writes
 * one result file there; only the parent asserts. Without mpirun on PATH, or without the
 * mpi backend built, it exits 77 (skipped).
 *
 * What each rank checks, with exact expected values computed independently:
 *  - ddp_pg_create_from_env with nothing but mpirun's environment (no RANK, MASTER_ADDR,
 *    MASTER_PORT or DDP_BACKEND) picks the mpi backend, with rank and size from
 *    OMPI_COMM_WORLD_*;
 *  - every collective (allreduce SUM/AVG/MIN/MAX/PRODUCT in place and out of place,
 *    broadcast, allgather, reduce_scatter, alltoall, barrier, send/recv) on every dtype and
 *    counts {0, 1, W+1, 1000, 65539}, with small integers whose results are exact, so each
 *    rank computes the expected value by a closed formula over the ranks;
 *  - a second group (ddp_pg_create, backend "mpi", no store) with algorithm ring and with
 *    a 4 KiB segment under canonical (multi-segment paths), exact data again;
 *  - D2: random fp32/fp16/bf16 data (the generator of tests/test_collectives.c) allreduced
 *    with the default algorithm are bitwise equal to a serial rank-order fold done in the
 *    test; every rank reports a hash of its results;
 *  - a collective that peers never join ends with DDP_ERR_TIMEOUT by its deadline, and with
 *    DDP_ERR_ABORTED soon after ddp_pg_abort from another thread;
 *  - an allreduce whose count differs on one rank is DESYNC on every rank.
 * The parent asserts every rank passed, that all ranks' D2 hashes agree, and that they equal
 * the hash of the same D2 run on the threads backend in this process (so mpi is bitwise
 * equal to threads, which test_collectives ties to shm and tcp). */
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/backend.h"
#include "ddp/pg.h"
#include "harness.h"
#include "colldata.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define OUT_ENV "DDP_TEST_MPI_OUT"

static const ddp_dtype_t all_dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16,
                                         DDP_I32, DDP_I64, DDP_U8};

/* A rank's check state; coll first, so that say() can reach fail. */
typedef struct ctx {
  ddp_test_coll_t coll;
  char fail[1024]; /* first failed call's message */
} ctx_t;

static void say_first(ddp_test_coll_t *c, const char *msg) {
  ctx_t *x = (ctx_t *)c;
  if (!x->fail[0]) snprintf(x->fail, sizeof x->fail, "%s", msg);
}

static ctx_t make_ctx(ddp_pg_t *pg, int r, int W) {
  ctx_t c = {{pg, r, W, false, say_first, 0, ""}, ""};
  return c;
}

/* ---- one MPI rank ---- */

static ddp_status_t rank_matrix(ctx_t *c, const size_t *counts, size_t ncounts,
                                const ddp_dtype_t *dts, size_t ndts, bool others) {
  ddp_status_t st = DDP_OK;
  for (size_t k = 0; k < ncounts && st == DDP_OK; k++)
    for (size_t d = 0; d < ndts && st == DDP_OK; d++) {
      st = ddp_test_check_allreduce(&c->coll, dts[d], counts[k]);
      if (st == DDP_OK && others) st = ddp_test_check_others(&c->coll, dts[d], counts[k]);
    }
  return st;
}

/* A second mpi group of the same ranks (no store); a failure is recorded as `what`. */
static ddp_status_t mpi_group(ctx_t *c, ddp_algorithm_t algo, size_t segment, int64_t timeout_ms,
                              const char *what, ddp_pg_t **pg) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = "mpi";
  o.rank = c->coll.r;
  o.world = c->coll.W;
  o.timeout_ms = timeout_ms;
  o.algorithm = algo;
  o.segment_bytes = segment;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_pg_create(&o, pg, &err);
  if (st != DDP_OK) snprintf(c->fail, sizeof c->fail, "%s group: %.900s", what, err.msg);
  return st;
}

static ddp_status_t explicit_group(ctx_t *c, ddp_algorithm_t algo, size_t segment) {
  ctx_t g = make_ctx(NULL, c->coll.r, c->coll.W);
  ddp_status_t st = mpi_group(c, algo, segment, 30000, ddp_algorithm_name(algo), &g.coll.pg);
  if (st != DDP_OK) return st;
  static const size_t counts[] = {1, 1000, 65539};
  static const ddp_dtype_t dts[] = {DDP_F32, DDP_BF16, DDP_I64};
  st = rank_matrix(&g, counts, ARRAY_LEN(counts), dts, ARRAY_LEN(dts), segment != 0);
  ddp_pg_destroy(g.coll.pg);
  if (g.coll.bad && !c->coll.bad) {
    c->coll.bad = g.coll.bad;
    snprintf(c->coll.first, sizeof c->coll.first, "%s group: %.200s", ddp_algorithm_name(algo),
             g.coll.first);
  }
  if (g.fail[0] && !c->fail[0]) snprintf(c->fail, sizeof c->fail, "%s", g.fail);
  return st;
}

/* A barrier only rank 0 issues: it must end with TIMEOUT near its 400 ms deadline. Peers
 * meanwhile wait on a barrier of their own group, long enough for rank 0 to give up. */
static ddp_status_t check_timeout(ctx_t *c, long *elapsed_ms) {
  ddp_pg_t *pg = NULL;
  ddp_status_t st = mpi_group(c, DDP_ALGO_AUTO, 0, 400, "timeout", &pg);
  if (st != DDP_OK) return st;
  *elapsed_ms = 0;
  if (c->coll.r == 0) {
    ddp_work_t *w = NULL;
    int64_t t0 = ddp_now_ns();
    st = ddp_barrier(pg, &w);
    ddp_status_t got = st == DDP_OK ? ddp_work_wait(w, 10000) : st;
    *elapsed_ms = (long)((ddp_now_ns() - t0) / 1000000);
    if (got != DDP_ERR_TIMEOUT) {
      snprintf(c->fail, sizeof c->fail, "barrier without peers returned %s (%s), not TIMEOUT",
               ddp_status_name(got), w ? ddp_work_error(w) : "");
      st = DDP_ERR_INTERNAL;
    } else if (!strstr(ddp_work_error(w), "timed out")) {
      snprintf(c->fail, sizeof c->fail, "TIMEOUT message lacks the detail: %s", ddp_work_error(w));
      st = DDP_ERR_INTERNAL;
    } else {
      st = DDP_OK;
    }
    ddp_work_free(w);
  }
  ddp_pg_destroy(pg);
  /* Line the ranks up again before the next phase, on the main group. */
  ddp_work_t *w = NULL;
  ddp_status_t st2 = ddp_test_run(&c->coll, ddp_barrier(c->coll.pg, &w), &w,
                                  "barrier after the timeout check");
  return st != DDP_OK ? st : st2;
}

static void *abort_later(void *arg) {
  struct timespec ts = {0, 200000000};
  nanosleep(&ts, NULL);
  ddp_pg_abort(arg);
  return NULL;
}

/* ddp_pg_abort from another thread ends rank 0's unjoined barrier with ABORTED long before
 * its 30 s deadline; and a collective whose count differs on one rank is DESYNC on every
 * rank, naming both fingerprints. */
static ddp_status_t check_abort_desync(ctx_t *c, long *abort_ms) {
  ddp_pg_t *pg = NULL;
  ddp_status_t st = mpi_group(c, DDP_ALGO_AUTO, 0, 30000, "desync", &pg);
  if (st != DDP_OK) return st;
  /* DESYNC first, while the group is healthy */
  float x[8] = {0};
  ddp_work_t *w = NULL;
  size_t n = c->coll.r == c->coll.W - 1 ? 7 : 6;
  st = ddp_allreduce(pg, x, x, n, DDP_F32, DDP_OP_SUM, &w);
  ddp_status_t got = st == DDP_OK ? ddp_work_wait(w, 20000) : st;
  if (got != DDP_ERR_DESYNC || !strstr(ddp_work_error(w), "mismatched collectives") ||
      !strstr(ddp_work_error(w), "count 7") || !strstr(ddp_work_error(w), "count 6")) {
    snprintf(c->fail, sizeof c->fail, "mismatched allreduce returned %s: %s", ddp_status_name(got),
             w ? ddp_work_error(w) : "");
    ddp_work_free(w);
    ddp_pg_destroy(pg);
    return DDP_ERR_INTERNAL;
  }
  ddp_work_free(w);
  ddp_pg_destroy(pg);
  /* abort: a fresh group, rank 0 alone in a barrier */
  st = mpi_group(c, DDP_ALGO_AUTO, 0, 30000, "abort", &pg);
  if (st != DDP_OK) return st;
  *abort_ms = 0;
  if (c->coll.r == 0) {
    pthread_t t;
    int64_t t0 = ddp_now_ns();
    st = ddp_barrier(pg, &w);
    pthread_create(&t, NULL, abort_later, pg);
    got = st == DDP_OK ? ddp_work_wait(w, 20000) : st;
    *abort_ms = (long)((ddp_now_ns() - t0) / 1000000);
    pthread_join(t, NULL);
    st = DDP_OK;
    if (got != DDP_ERR_ABORTED) {
      snprintf(c->fail, sizeof c->fail, "aborted barrier returned %s: %s", ddp_status_name(got),
               ddp_work_error(w));
      st = DDP_ERR_INTERNAL;
    }
    ddp_work_free(w);
  }
  ddp_pg_destroy(pg);
  w = NULL;
  ddp_status_t st2 = ddp_test_run(&c->coll, ddp_barrier(c->coll.pg, &w), &w,
                                  "barrier after the abort check");
  return st != DDP_OK ? st : st2;
}

static int rank_main(const char *outdir) {
  ctx_t c = make_ctx(NULL, -1, 0);
  ddp_error_t err = {0};
  uint64_t hash = 0;
  long timeout_ms = -1, abort_ms = -1;
  ddp_status_t st = ddp_pg_create_from_env(NULL, &c.coll.pg, &err);
  if (st != DDP_OK) {
    snprintf(c.fail, sizeof c.fail, "ddp_pg_create_from_env: %.900s", err.msg);
  } else {
    c.coll.r = ddp_pg_rank(c.coll.pg);
    c.coll.W = ddp_pg_size(c.coll.pg);
    const char *er = getenv("OMPI_COMM_WORLD_RANK");
    if (strcmp(ddp_pg_backend_name(c.coll.pg), "mpi") != 0 || !er || atoi(er) != c.coll.r) {
      snprintf(c.fail, sizeof c.fail, "from env: backend %s rank %d (OMPI_COMM_WORLD_RANK %s)",
               ddp_pg_backend_name(c.coll.pg), c.coll.r, er ? er : "unset");
      st = DDP_ERR_INTERNAL;
    }
    size_t W = (size_t)c.coll.W;
    const size_t counts[] = {0, 1, W + 1, 1000, 65539};
    if (st == DDP_OK)
      st = rank_matrix(&c, counts, ARRAY_LEN(counts), all_dtypes, ARRAY_LEN(all_dtypes), true);
    if (st == DDP_OK) st = ddp_test_d2_run(&c.coll, &hash);
    if (st == DDP_OK) st = explicit_group(&c, DDP_ALGO_RING, 0);
    if (st == DDP_OK) st = explicit_group(&c, DDP_ALGO_CANONICAL, 4096);
    if (st == DDP_OK) st = check_timeout(&c, &timeout_ms);
    if (st == DDP_OK) st = check_abort_desync(&c, &abort_ms);
    ddp_pg_destroy(c.coll.pg);
  }
  char path[4096];
  int r = c.coll.r >= 0
              ? c.coll.r
              : atoi(getenv("OMPI_COMM_WORLD_RANK") ? getenv("OMPI_COMM_WORLD_RANK") : "0");
  snprintf(path, sizeof path, "%s/rank%d", outdir, r);
  FILE *f = fopen(path, "w");
  if (!f) return 3;
  fprintf(f, "%d %ld %llu %ld %ld\n%s\n%s\n", (int)st, c.coll.bad, (unsigned long long)hash,
          timeout_ms, abort_ms, c.coll.first, c.fail);
  return fclose(f) == 0 ? 0 : 3;
}

/* ---- the parent ---- */

static const char *self_path;

typedef struct rank_out {
  int status;
  long bad;
  unsigned long long hash;
  long timeout_ms;
  long abort_ms;
  char first[300];
  char fail[1100];
} rank_out_t;

static bool read_out(const char *dir, int r, rank_out_t *o) {
  char path[4096];
  snprintf(path, sizeof path, "%s/rank%d", dir, r);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  memset(o, 0, sizeof *o);
  bool ok = fscanf(f, "%d %ld %llu %ld %ld\n", &o->status, &o->bad, &o->hash, &o->timeout_ms,
                   &o->abort_ms) == 5;
  if (ok && fgets(o->first, sizeof o->first, f)) o->first[strcspn(o->first, "\n")] = '\0';
  if (ok && fgets(o->fail, sizeof o->fail, f)) o->fail[strcspn(o->fail, "\n")] = '\0';
  fclose(f);
  unlink(path);
  return ok;
}

/* Runs mpirun -np W on this program; returns its exit status (-1: killed after 50 s). */
static int run_mpirun(int W, const char *dir) {
  char np[16];
  snprintf(np, sizeof np, "%d", W);
  const char *argv[] = {"mpirun",
                        "--allow-run-as-root",
                        "--oversubscribe",
                        "--bind-to",
                        "none",
                        "-np",
                        np,
                        "-x",
                        OUT_ENV,
                        "-x",
                        "DDP_TIMEOUT",
                        self_path,
                        NULL};
  setenv(OUT_ENV, dir, 1);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  unsetenv(OUT_ENV);
  int64_t deadline = ddp_now_ns() + 50000000000LL;
  int ws = 0;
  for (;;) {
    pid_t p = waitpid(pid, &ws, WNOHANG);
    if (p == pid) break;
    if (ddp_now_ns() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &ws, 0);
      return -1;
    }
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

typedef struct threads_arg {
  uint64_t hash[8];
} threads_arg_t;

static ddp_status_t threads_d2(ddp_pg_t *pg, void *arg) {
  threads_arg_t *a = arg;
  ctx_t c = make_ctx(pg, ddp_pg_rank(pg), ddp_pg_size(pg));
  ddp_status_t st = ddp_test_d2_run(&c.coll, &a->hash[c.coll.r]);
  return st == DDP_OK && c.coll.bad ? DDP_ERR_INTERNAL : st;
}

static void test_mpi_worlds(void **state) {
  (void)state;
  char dir[] = "/tmp/ddp-test-mpi-XXXXXX";
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  for (int W = 2; W <= 4; W++) {
    int64_t t0 = ddp_now_ns();
    int rc = run_mpirun(W, dir);
    double secs = (double)(ddp_now_ns() - t0) / 1e9;
    uint64_t h0 = 0;
    for (int r = 0; r < W; r++) {
      rank_out_t o;
      bool ok = read_out(dir, r, &o);
      if (!ok) fail_msg("W=%d: rank %d wrote no result (mpirun exit %d)", W, r, rc);
      if (o.status != 0 || o.bad)
        fail_msg("W=%d rank %d: status %d, %ld mismatches (first: %s); %s", W, r, o.status, o.bad,
                 o.first, o.fail);
      if (r == 0) {
        h0 = o.hash;
        print_message("mpirun -np %d: %.2f s in all; unjoined barrier ended TIMEOUT after %ld ms "
                      "(timeout 400 ms), ABORTED %ld ms after issue (abort at 200 ms)\n",
                      W, secs, o.timeout_ms, o.abort_ms);
        assert_true(o.timeout_ms >= 390 && o.timeout_ms < DDP_TEST_BOUND_MS(3000));
        assert_true(o.abort_ms >= 190 && o.abort_ms < DDP_TEST_BOUND_MS(3000));
      }
      DDP_ASSERT_EQ(o.hash, h0); /* every rank holds the same bits */
    }
    assert_int_equal(rc, 0);
    /* ... and the same bits as the threads backend */
    threads_arg_t a = {{0}};
    assert_int_equal(ddp_spawn_threads(W, NULL, threads_d2, &a), DDP_OK);
    for (int r = 0; r < W; r++) DDP_ASSERT_EQ(a.hash[r], h0);
  }
  rmdir(dir);
}

/* Names mpirun on PATH, or NULL. */
static bool have_mpirun(void) {
  const char *path = getenv("PATH");
  if (!path) return false;
  char buf[4096];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *save = NULL, *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
    char p[4200];
    snprintf(p, sizeof p, "%s/mpirun", d);
    if (access(p, X_OK) == 0) return true;
  }
  return false;
}

int main(int argc, char **argv) {
  (void)argc;
  const char *out = getenv(OUT_ENV);
  if (out && out[0]) return rank_main(out);
  if (!ddp_backend_find("mpi")) {
    printf("skip: the mpi backend is not built (no MPI library at configure time)\n");
    return 77;
  }
  if (!have_mpirun()) {
    printf("skip: mpirun is not on PATH\n");
    return 77;
  }
  static char self[4096];
  self_path = realpath(argv[0], self) ? self : argv[0];
  /* The ranks must see mpirun's environment only: no torchrun/ddprun variables, no backend
   * choice (from_env must pick mpi by itself). Open MPI's own allocations are not ours to
   * leak-check in the ranks. */
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("DDP_BACKEND");
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  setenv("DDP_TIMEOUT", "30", 1);
  char asan[512];
  snprintf(asan, sizeof asan, "%s%sdetect_leaks=0",
           getenv("ASAN_OPTIONS") ? getenv("ASAN_OPTIONS") : "", getenv("ASAN_OPTIONS") ? ":" : "");
  setenv("ASAN_OPTIONS", asan, 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mpi_worlds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
