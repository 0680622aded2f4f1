/* Process-group failures (suite coll): every fault ends in a clear error within its bound,
 * on every rank, and leaves nothing behind.
 *
 *  - kill -9 of a rank in the middle of a stream of allreduces (harness kill injection):
 *    the survivors fail with an error naming the dead rank within 1 s (shm, tcp).
 *  - a SIGSTOPped rank: the survivors fail at the 2 s timeout, within +-10% (shm, tcp).
 *  - a rank that never joins: create fails at the timeout naming that rank (shm, tcp).
 *  - mismatched counts, ops, point-to-point sizes or tcp segment sizes: DESYNC on every
 *    rank, with both fingerprints in the message (threads, shm, tcp); a group re-created on
 *    the same store afterwards works.
 *  - ddp_pg_abort from another thread unblocks a collective at once; the peer then fails
 *    fast with REMOTE (threads, shm, tcp).
 *  - a tcp peer presenting the wrong job token is refused.
 *  - DDP_SOCKET_IFNAME / GLOO_SOCKET_IFNAME naming no interface fails create at once.
 *  - no /dev/shm entries and no file descriptors are left behind. */
#include <dirent.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/pg.h"
#include "ddp/store.h"
#include "harness.h"

typedef struct fcfg {
  const char *backend;
  ddp_test_mode_t mode;
  int64_t timeout_ms;
  int variant;         /* test-specific */
  ddp_store_t *store;  /* thread mode */
  const char *const *token; /* per-rank job token, or NULL for DDP_JOB_TOKEN */
} fcfg_t;

static ddp_status_t make_pg(ddp_test_rank_t *tr, const fcfg_t *cfg, ddp_store_t **store,
                            ddp_pg_t **pg, ddp_error_t *err) {
  *store = NULL;
  *pg = NULL;
  ddp_store_t *s = cfg->store;
  if (cfg->mode == DDP_TEST_FORK) {
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = cfg->timeout_ms;
    so.rank = ddp_test_rank(tr);
    ddp_status_t st = ddp_store_create_file(ddp_test_dir(tr), &so, store);
    if (st != DDP_OK) return st;
    s = *store;
  }
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = cfg->backend;
  o.rank = ddp_test_rank(tr);
  o.world = ddp_test_world_size(tr);
  o.store = s;
  o.timeout_ms = cfg->timeout_ms;
  o.shm_heap_bytes = 1u << 20;
  o.job_token = cfg->token ? cfg->token[ddp_test_rank(tr)] : NULL;
  if (cfg->variant == 3 && ddp_test_rank(tr) == 1) o.segment_bytes = 4096;
  return ddp_pg_create(&o, pg, err);
}

/* make_pg; a failure is said through the harness ("create: ...") and leaves no store. */
static ddp_status_t open_pg(ddp_test_rank_t *tr, const fcfg_t *cfg, ddp_store_t **store,
                            ddp_pg_t **pg) {
  ddp_error_t err = {0};
  ddp_status_t st = make_pg(tr, cfg, store, pg, &err);
  if (st != DDP_OK) {
    ddp_test_say(tr, "create: %s", err.msg);
    ddp_store_destroy(*store);
    *store = NULL;
  }
  return st;
}

/* One in-place SUM allreduce of n floats, waited for; its error is said through the
 * harness. */
static ddp_status_t allreduce_wait(ddp_test_rank_t *tr, ddp_pg_t *pg, float *buf, size_t n) {
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(pg, buf, buf, n, DDP_F32, DDP_SUM, &w);
  if (st == DDP_OK) {
    st = ddp_work_wait(w, -1);
    ddp_test_say(tr, "%s", ddp_work_error(w));
    ddp_work_free(w);
  }
  return st;
}

static ddp_store_t *memory_store(void) {
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = 10000;
  ddp_store_t *s = NULL;
  assert_int_equal(ddp_store_create_memory(&so, &s), DDP_OK);
  return s;
}

static int count_shm_entries(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "ddp-%u-", (unsigned)getuid());
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) n++;
  closedir(d);
  return n;
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d))) n++;
  closedir(d);
  return n;
}

/* Reports (status, time of failure, time the failing work was issued) in ns. */
typedef struct report {
  int64_t t_fail;
  int64_t t_issue;
} report_t;

/* Allreduce in a loop until something fails (or 15 s pass). */
static int stream_rank(ddp_test_rank_t *tr, void *arg) {
  const fcfg_t *cfg = arg;
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_status_t st = open_pg(tr, cfg, &store, &pg);
  if (st != DDP_OK) return st;
  size_t n = 65539;
  float *buf = ddp_pg_alloc(pg, n * sizeof(float));
  for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
  report_t rep = {0, 0};
  int64_t end = ddp_now_ns() + 15000000000LL;
  while (ddp_now_ns() < end) {
    ddp_work_t *w = NULL;
    rep.t_issue = ddp_now_ns();
    st = ddp_allreduce(pg, buf, buf, n, DDP_F32, DDP_MAX, &w);
    if (st == DDP_OK) {
      st = ddp_work_wait(w, -1);
      if (st != DDP_OK) ddp_test_say(tr, "%s", ddp_work_error(w));
      ddp_work_free(w);
    } else {
      ddp_test_say(tr, "%s", ddp_pg_last_error(pg));
    }
    if (st != DDP_OK) break;
  }
  rep.t_fail = ddp_now_ns();
  ddp_test_put(tr, &rep, sizeof rep);
  ddp_pg_free(pg, buf);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_kill9_mid_allreduce(void **state) {
  static const char *backends[] = {"shm", "tcp"};
  int shm_before = count_shm_entries();
  for (int b = 0; b < 2; b++) {
    fcfg_t cfg = {backends[b], DDP_TEST_FORK, 20000, 0, NULL, NULL};
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 25000;
    o.kill_rank = 1;
    o.kill_after_ms = 700;
    o.kill_signal = SIGKILL;
    int64_t t0 = ddp_now_ns();
    ddp_test_results_t *res = ddp_test_spawn(&o, stream_rank, &cfg);
    int64_t kill_at = t0 + 700 * 1000000LL;
    assert_int_equal(ddp_test_result(res, 1)->term_signal, SIGKILL);
    for (int r = 0; r < 3; r += 2) {
      const ddp_test_result_t *x = ddp_test_result(res, r);
      print_message("%s rank %d: %s: %s\n", backends[b], r, ddp_status_name(x->status), x->msg);
      assert_int_equal(x->status, DDP_ERR_REMOTE);
      assert_non_null(strstr(x->msg, "rank 1"));
      report_t rep;
      assert_int_equal(x->nvalues, sizeof rep);
      memcpy(&rep, x->values, sizeof rep);
      double ms = (double)(rep.t_fail - kill_at) / 1e6;
      print_message("%s rank %d noticed the death %.1f ms after the kill\n", backends[b], r, ms);
      assert_true(ms > 0 && ms < DDP_TEST_BOUND_MS(1000));
    }
    ddp_test_results_free(res);
  }
  assert_int_equal(count_shm_entries(), shm_before);
}

static void test_sigstop_times_out(void **state) {
  static const char *backends[] = {"shm", "tcp"};
  for (int b = 0; b < 2; b++) {
    fcfg_t cfg = {backends[b], DDP_TEST_FORK, 2000, 0, NULL, NULL};
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 6000; /* the stopped rank is killed by the watchdog */
    o.kill_rank = 1;
    o.kill_after_ms = 700;
    o.kill_signal = SIGSTOP;
    ddp_test_results_t *res = ddp_test_spawn(&o, stream_rank, &cfg);
    int timeouts_naming = 0;
    for (int r = 0; r < 3; r += 2) {
      const ddp_test_result_t *x = ddp_test_result(res, r);
      print_message("%s rank %d: %s: %s\n", backends[b], r, ddp_status_name(x->status), x->msg);
      assert_true(x->status == DDP_ERR_TIMEOUT || x->status == DDP_ERR_REMOTE);
      if (x->status == DDP_ERR_TIMEOUT && strstr(x->msg, "rank 1")) timeouts_naming++;
      report_t rep;
      assert_int_equal(x->nvalues, sizeof rep);
      memcpy(&rep, x->values, sizeof rep);
      double ms = (double)(rep.t_fail - rep.t_issue) / 1e6;
      print_message("%s rank %d failed %.0f ms after issuing the stuck allreduce\n", backends[b],
                    r, ms);
      assert_true(ms >= 1800 && ms <= 2000 + DDP_TEST_BOUND_MS(200));
    }
    assert_true(timeouts_naming >= 1);
    ddp_test_results_free(res);
  }
}

static int late_rank(ddp_test_rank_t *tr, void *arg) {
  const fcfg_t *cfg = arg;
  if (ddp_test_rank(tr) == 2) return DDP_OK; /* never joins */
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_error_t err = {0};
  int64_t t = ddp_now_ns();
  ddp_status_t st = make_pg(tr, cfg, &store, &pg, &err);
  double ms = (double)(ddp_now_ns() - t) / 1e6;
  ddp_test_put(tr, &ms, sizeof ms);
  ddp_test_say(tr, "%s", err.msg);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_rank_never_joins(void **state) {
  static const char *backends[] = {"shm", "tcp"};
  int shm_before = count_shm_entries();
  for (int b = 0; b < 2; b++) {
    fcfg_t cfg = {backends[b], DDP_TEST_FORK, 2000, 0, NULL, NULL};
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 10000;
    ddp_test_results_t *res = ddp_test_spawn(&o, late_rank, &cfg);
    for (int r = 0; r < 2; r++) {
      const ddp_test_result_t *x = ddp_test_result(res, r);
      print_message("%s rank %d: %s: %s\n", backends[b], r, ddp_status_name(x->status), x->msg);
      assert_int_equal(x->status, DDP_ERR_TIMEOUT);
      assert_non_null(strstr(x->msg, "2"));
      double ms;
      memcpy(&ms, x->values, sizeof ms);
      assert_true(ms >= 1900 && ms <= 2000 + DDP_TEST_BOUND_MS(600));
    }
    ddp_test_results_free(res);
  }
  assert_int_equal(count_shm_entries(), shm_before);
}

/* variant 0: rank 1 uses count 1001; 1: rank 2 uses MAX; 2: p2p sizes differ; 3: rank 1
 * uses another segment size (tcp: differently framed bytes), caught at the first allreduce */
static int desync_rank(ddp_test_rank_t *tr, void *arg) {
  const fcfg_t *cfg = arg;
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_status_t st = open_pg(tr, cfg, &store, &pg);
  if (st != DDP_OK) return st;
  int r = ddp_test_rank(tr);
  float buf[1001] = {0};
  ddp_work_t *w = NULL;
  /* one good collective first, so the mismatch is not the first operation */
  st = ddp_allreduce(pg, buf, buf, 10, DDP_F32, DDP_SUM, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st != DDP_OK) ddp_test_say(tr, "%s", ddp_pg_last_error(pg));
  if (st == DDP_OK && cfg->variant == 3) st = DDP_ERR_INTERNAL; /* must not pass */
  if (st == DDP_OK) {
    if (cfg->variant == 2) {
      st = r == 0 ? ddp_send(pg, buf, 10, DDP_F32, 1, &w) : ddp_recv(pg, buf, 11, DDP_F32, 0, &w);
    } else {
      size_t n = cfg->variant == 0 && r == 1 ? 1001 : 1000;
      ddp_redop_t op = cfg->variant == 1 && r == 2 ? DDP_MAX : DDP_SUM;
      st = ddp_allreduce(pg, buf, buf, n, DDP_F32, op, &w);
    }
    if (st == DDP_OK) {
      st = ddp_work_wait(w, -1);
      ddp_test_say(tr, "%s", ddp_work_error(w));
      ddp_work_free(w);
    }
    /* later calls fail the same way */
    if (st != DDP_OK && ddp_allreduce(pg, buf, buf, 1, DDP_F32, DDP_SUM, &w) != st) st = DDP_ERR_INTERNAL;
  }
  ddp_pg_destroy(pg);
  /* recovery: a new group on the same store works (it does not see the old group's keys) */
  if (st == DDP_ERR_DESYNC) {
    ddp_pg_t *pg2 = NULL;
    ddp_error_t err = {0};
    ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
    o.backend = cfg->backend;
    o.rank = r;
    o.world = ddp_test_world_size(tr);
    o.store = store ? store : cfg->store;
    o.timeout_ms = cfg->timeout_ms;
    o.shm_heap_bytes = 1u << 20;
    ddp_status_t st2 = ddp_pg_create(&o, &pg2, &err);
    float one = 1;
    if (st2 == DDP_OK) st2 = ddp_allreduce(pg2, &one, &one, 1, DDP_F32, DDP_SUM, &w);
    if (st2 == DDP_OK) st2 = ddp_work_wait_free(w);
    if (st2 == DDP_OK && one != (float)ddp_test_world_size(tr)) st2 = DDP_ERR_INTERNAL;
    if (st2 != DDP_OK) {
      ddp_test_say(tr, "re-created group failed: %s", pg2 ? ddp_pg_last_error(pg2) : err.msg);
      st = DDP_ERR_INTERNAL;
    }
    ddp_pg_destroy(pg2);
  }
  ddp_store_destroy(store);
  return st;
}

static void test_desync(void **state) {
  static const char *backends[] = {"threads", "shm", "tcp"};
  static const char *needles[4][2] = {{"count 1000", "count 1001"}, {"SUM", "MAX"},
                                      {"count 10,", "count 11,"},
                                      {"segment 4096", "segment 1048576"}};
  for (int b = 0; b < 3; b++)
    for (int v = 0; v < (b == 2 ? 4 : 3); v++) {
      fcfg_t cfg = {backends[b], b == 0 ? DDP_TEST_THREADS : DDP_TEST_FORK, 5000, v, NULL, NULL};
      if (b == 0) cfg.store = memory_store();
      ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
      o.world = v == 2 ? 2 : 3;
      o.mode = cfg.mode;
      o.timeout_ms = 15000;
      ddp_test_results_t *res = ddp_test_spawn(&o, desync_rank, &cfg);
      for (int r = 0; r < o.world; r++) {
        const ddp_test_result_t *x = ddp_test_result(res, r);
        if (r == 0) print_message("%s: %s\n", backends[b], x->msg);
        assert_int_equal(x->status, DDP_ERR_DESYNC);
        assert_non_null(strstr(x->msg, needles[v][0]));
        assert_non_null(strstr(x->msg, needles[v][1]));
      }
      ddp_test_results_free(res);
      ddp_store_destroy(cfg.store);
    }
}

typedef struct abort_arg {
  ddp_pg_t *pg;
} abort_arg_t;

static void *aborter(void *p) {
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  ddp_pg_abort(((abort_arg_t *)p)->pg);
  return NULL;
}

/* Rank 0 waits in an allreduce that rank 1 never joins; another thread aborts rank 0's
 * group. Rank 1 then issues the allreduce and must fail fast with REMOTE. */
static int abort_rank(ddp_test_rank_t *tr, void *arg) {
  const fcfg_t *cfg = arg;
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_status_t st = open_pg(tr, cfg, &store, &pg);
  if (st != DDP_OK) return st;
  float buf[100] = {0};
  double ms = 0;
  if (ddp_test_rank(tr) == 0) {
    pthread_t th;
    abort_arg_t a = {pg};
    pthread_create(&th, NULL, aborter, &a);
    int64_t t = ddp_now_ns();
    st = allreduce_wait(tr, pg, buf, 100);
    ms = (double)(ddp_now_ns() - t) / 1e6;
    pthread_join(th, NULL);
  } else {
    struct timespec ts = {0, 600 * 1000000L};
    nanosleep(&ts, NULL);
    int64_t t = ddp_now_ns();
    st = allreduce_wait(tr, pg, buf, 100);
    ms = (double)(ddp_now_ns() - t) / 1e6;
  }
  ddp_test_put(tr, &ms, sizeof ms);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static void test_abort_unblocks(void **state) {
  static const char *backends[] = {"threads", "tcp", "shm"};
  for (int b = 0; b < 3; b++) {
    int fds_before = count_fds();
    fcfg_t cfg = {backends[b], DDP_TEST_THREADS, 10000, 0, memory_store(), NULL};
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 2;
    o.mode = DDP_TEST_THREADS;
    o.timeout_ms = 15000;
    ddp_test_results_t *res = ddp_test_spawn(&o, abort_rank, &cfg);
    const ddp_test_result_t *x0 = ddp_test_result(res, 0), *x1 = ddp_test_result(res, 1);
    print_message("%s rank 0: %s\n%s rank 1: %s\n", backends[b], x0->msg, backends[b], x1->msg);
    assert_int_equal(x0->status, DDP_ERR_ABORTED);
    assert_int_equal(x1->status, DDP_ERR_REMOTE);
    double ms0, ms1;
    memcpy(&ms0, x0->values, sizeof ms0);
    memcpy(&ms1, x1->values, sizeof ms1);
    assert_true(ms0 < 200 + DDP_TEST_BOUND_MS(800)); /* abort at 200 ms */
    assert_true(ms1 < DDP_TEST_BOUND_MS(500));
    assert_non_null(strstr(x1->msg, "rank 0"));
    ddp_test_results_free(res);
    ddp_store_destroy(cfg.store);
    assert_int_equal(count_fds(), fds_before);
  }
}

/* A tcp peer with the wrong job token is refused: it fails at once naming the token, and
 * the rank it tried keeps waiting for the real peer until its timeout. */
static void test_tcp_job_token(void **state) {
  static const char *const tokens[2] = {"secret-a", "secret-b"};
  fcfg_t cfg = {"tcp", DDP_TEST_FORK, 1500, 0, NULL, tokens};
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 2;
  o.mode = DDP_TEST_FORK;
  o.timeout_ms = 10000;
  ddp_test_results_t *res = ddp_test_spawn(&o, late_rank, &cfg);
  const ddp_test_result_t *x0 = ddp_test_result(res, 0), *x1 = ddp_test_result(res, 1);
  print_message("rank 0: %s\nrank 1: %s\n", x0->msg, x1->msg);
  assert_int_equal(x1->status, DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(x1->msg, "job token"));
  assert_int_equal(x0->status, DDP_ERR_TIMEOUT);
  assert_non_null(strstr(x0->msg, "rank(s) 1"));
  ddp_test_results_free(res);
}

/* One allreduce of rank + 1 over a group whose tcp addresses come from DDP_SOCKET_IFNAME or
 * GLOO_SOCKET_IFNAME; reports the sum. */
static int ifname_rank(ddp_test_rank_t *tr, void *arg) {
  const fcfg_t *cfg = arg;
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_status_t st = open_pg(tr, cfg, &store, &pg);
  if (st != DDP_OK) return st;
  float x = (float)(ddp_test_rank(tr) + 1);
  st = allreduce_wait(tr, pg, &x, 1);
  ddp_test_put(tr, &x, sizeof x);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

/* DDP_SOCKET_IFNAME (else GLOO_SOCKET_IFNAME) picks the interface whose address a tcp rank
 * publishes: the first listed one that exists is used; a list naming no interface fails
 * create at once on every rank, naming the variable and its value. */
static void test_tcp_socket_ifname(void **state) {
  (void)state;
  static const struct {
    const char *ddp, *gloo, *bad; /* bad: the variable a failure must name, NULL = works */
  } cases[] = {
      {"nosuch0,lo", NULL, NULL},
      {"lo", "nosuch1", NULL},
      {NULL, "lo", NULL},
      {"nosuch0", NULL, "DDP_SOCKET_IFNAME=\"nosuch0\""},
      {"", "nosuch1,nosuch2", "GLOO_SOCKET_IFNAME=\"nosuch1,nosuch2\""},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    if (cases[c].ddp) setenv("DDP_SOCKET_IFNAME", cases[c].ddp, 1);
    if (cases[c].gloo) setenv("GLOO_SOCKET_IFNAME", cases[c].gloo, 1);
    fcfg_t cfg = {"tcp", DDP_TEST_THREADS, 5000, 0, memory_store(), NULL};
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 2;
    o.mode = DDP_TEST_THREADS;
    o.timeout_ms = 10000;
    int64_t t = ddp_now_ns();
    ddp_test_results_t *res = ddp_test_spawn(&o, ifname_rank, &cfg);
    double ms = (double)(ddp_now_ns() - t) / 1e6;
    unsetenv("DDP_SOCKET_IFNAME");
    unsetenv("GLOO_SOCKET_IFNAME");
    for (int r = 0; r < 2; r++) {
      const ddp_test_result_t *x = ddp_test_result(res, r);
      print_message("case %zu rank %d (%.0f ms): %s %s\n", c, r, ms,
                    ddp_status_name(x->status), x->msg);
      if (cases[c].bad) {
        assert_int_equal(x->status, DDP_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(x->msg, cases[c].bad));
        assert_true(ms < DDP_TEST_BOUND_MS(2000)); /* at once, not at the 5 s timeout */
      } else {
        assert_int_equal(x->status, DDP_OK);
        float sum;
        memcpy(&sum, x->values, sizeof sum);
        assert_true(sum == 3.0f);
      }
    }
    ddp_test_results_free(res);
    ddp_store_destroy(cfg.store);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kill9_mid_allreduce),
      cmocka_unit_test(test_sigstop_times_out),
      cmocka_unit_test(test_rank_never_joins),
      cmocka_unit_test(test_desync),
      cmocka_unit_test(test_abort_unblocks),
      cmocka_unit_test(test_tcp_job_token),
      cmocka_unit_test(test_tcp_socket_ifname),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
