/* Tests of the test harness itself: reports from thread and fork ranks reach the parent,
 * and a hung, killed, crashing or failing rank is reported as such within the timeout. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Each rank reports rank*1000+i for i < 100, its pid, the world size and a message. */
static int report_values(ddp_test_rank_t *r, void *arg) {
  int me = ddp_test_rank(r);
  for (int i = 0; i < 100; i++) {
    int64_t v = (int64_t)me * 1000 + i;
    if (!ddp_test_put(r, &v, sizeof v)) return DDP_ERR_INTERNAL;
  }
  pid_t pid = getpid();
  ddp_test_put(r, &pid, sizeof pid);
  int w = ddp_test_world_size(r);
  ddp_test_put(r, &w, sizeof w);
  int mode = (int)ddp_test_mode(r);
  ddp_test_put(r, &mode, sizeof mode);
  /* The pid table names this rank's own process. */
  if (ddp_test_pid(r, me) != pid) return DDP_ERR_INTERNAL;
  ddp_test_say(r, "first");
  ddp_test_say(r, "rank %d of %d says %s", me, w, (const char *)arg);
  return DDP_OK;
}

static void check_values(ddp_test_mode_t mode, int world) {
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = world;
  o.mode = mode;
  ddp_test_results_t *res = ddp_test_spawn(&o, report_values, "hello");
  ddp_test_expect_ok(res);
  assert_int_equal(ddp_test_world(res), world);
  pid_t first_pid = 0;
  for (int k = 0; k < world; k++) {
    const ddp_test_result_t *r = ddp_test_result(res, k);
    assert_non_null(r);
    assert_true(r->reported);
    assert_int_equal(r->term_signal, 0);
    assert_int_equal(r->exit_code, 0);
    assert_true(r->elapsed_ms >= 0.0);
    assert_int_equal(r->nvalues, 100 * sizeof(int64_t) + sizeof(pid_t) + 2 * sizeof(int));
    for (int i = 0; i < 100; i++) {
      int64_t v;
      memcpy(&v, r->values + (size_t)i * sizeof v, sizeof v);
      assert_int_equal(v, (int64_t)k * 1000 + i);
    }
    pid_t pid;
    int w, m;
    memcpy(&pid, r->values + 800, sizeof pid);
    memcpy(&w, r->values + 800 + sizeof pid, sizeof w);
    memcpy(&m, r->values + 800 + sizeof pid + sizeof w, sizeof m);
    assert_int_equal(w, world);
    assert_int_equal(m, (int)mode);
    if (mode == DDP_TEST_THREADS) {
      assert_int_equal(pid, getpid());
    } else {
      assert_int_not_equal(pid, getpid());
      if (k > 0) assert_int_not_equal(pid, first_pid);
    }
    if (k == 0) first_pid = pid;
    char want[64];
    snprintf(want, sizeof want, "rank %d of %d says hello", k, world);
    assert_string_equal(r->msg, want);
  }
  assert_null(ddp_test_result(res, world));
  assert_null(ddp_test_result(res, -1));
  ddp_test_results_free(res);
}

/* Values, messages and identities reported by thread ranks reach the parent. */
static void test_thread_values(void **state) {
  (void)state;
  check_values(DDP_TEST_THREADS, 1);
  check_values(DDP_TEST_THREADS, 7);
}

/* The same through forked children writing into the shared region. */
static void test_fork_values(void **state) {
  (void)state;
  check_values(DDP_TEST_FORK, 1);
  check_values(DDP_TEST_FORK, 5);
}

/* The value area refuses a put past its capacity and keeps what fit. */
static int fill_area(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  unsigned char b[100];
  memset(b, 0xab, sizeof b);
  int n = 0;
  while (ddp_test_put(r, b, sizeof b)) n++;
  ddp_test_put(r, b, 0);
  ddp_test_say(r, "%d", n);
  return DDP_OK;
}

static void test_value_capacity(void **state) {
  (void)state;
  for (int mode = 0; mode < 2; mode++) {
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 2;
    o.mode = (ddp_test_mode_t)mode;
    o.value_bytes = 1000;
    ddp_test_results_t *res = ddp_test_spawn(&o, fill_area, NULL);
    ddp_test_expect_ok(res);
    for (int k = 0; k < 2; k++) {
      const ddp_test_result_t *r = ddp_test_result(res, k);
      assert_string_equal(r->msg, "10");
      assert_int_equal(r->nvalues, 1000);
      /* The neighbouring rank's area was not overwritten. */
      for (size_t i = 0; i < r->nvalues; i++) assert_int_equal(r->values[i], 0xab);
    }
    ddp_test_results_free(res);
  }
}

/* Rank 1 hangs; the others return at once. */
static int hang_rank1(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  if (ddp_test_rank(r) == 1) {
    ddp_test_say(r, "about to hang");
    for (;;) pause();
  }
  return DDP_OK;
}

/* A hung fork rank is SIGKILLed and reported HUNG within the timeout; the others keep
 * their reports. */
static void test_fork_hang(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 3;
  o.mode = DDP_TEST_FORK;
  o.timeout_ms = 1500;
  double t0 = now_ms();
  ddp_test_results_t *res = ddp_test_spawn(&o, hang_rank1, NULL);
  double took = now_ms() - t0;
  assert_true(took >= 1500.0);
  assert_true(took < 1500.0 + DDP_TEST_BOUND_MS(1000.0));
  const ddp_test_result_t *h = ddp_test_result(res, 1);
  assert_int_equal(h->status, DDP_TEST_HUNG);
  assert_false(h->reported);
  assert_int_equal(h->term_signal, SIGKILL);
  assert_string_equal(h->msg, "about to hang");
  for (int k = 0; k < 3; k += 2) {
    assert_int_equal(ddp_test_result(res, k)->status, DDP_OK);
    assert_true(ddp_test_result(res, k)->reported);
  }
  ddp_test_results_free(res);
}

/* Every rank waits; the parent kills rank 2 with the injected signal. */
static int wait_for_kill(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  if (ddp_test_rank(r) != 2) return DDP_OK;
  sleep(10);
  return DDP_OK;
}

static void test_fork_kill_injection(void **state) {
  (void)state;
  int sigs[] = {SIGKILL, SIGTERM};
  for (size_t s = 0; s < 2; s++) {
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 5000;
    o.kill_rank = 2;
    o.kill_after_ms = 200;
    o.kill_signal = sigs[s];
    double t0 = now_ms();
    ddp_test_results_t *res = ddp_test_spawn(&o, wait_for_kill, NULL);
    double took = now_ms() - t0;
    assert_true(took >= 200.0);
    assert_true(took < DDP_TEST_BOUND_MS(3000.0));
    const ddp_test_result_t *k = ddp_test_result(res, 2);
    assert_int_equal(k->status, DDP_TEST_CRASHED);
    assert_false(k->reported);
    assert_int_equal(k->term_signal, sigs[s]);
    assert_int_equal(ddp_test_result(res, 0)->status, DDP_OK);
    assert_int_equal(ddp_test_result(res, 1)->status, DDP_OK);
    ddp_test_results_free(res);
  }
}

/* Rank 1 becomes ready only after 400 ms (a slow start), rank 0 at once; both report when
 * they did, then wait. */
static int slow_ready(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  if (ddp_test_rank(r) == 1) {
    struct timespec ts = {0, 400 * 1000000L};
    nanosleep(&ts, NULL);
  }
  int64_t t = ddp_now_ns();
  ddp_test_put(r, &t, sizeof t);
  ddp_test_ready(r);
  sleep(10);
  return DDP_OK;
}

/* kill_after_ready: the kill comes kill_after_ms after the last rank is ready, not after the
 * spawn (the spawn-timed kill would land at 100 ms, inside rank 1's slow start). */
static void test_fork_kill_after_ready(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 2;
  o.mode = DDP_TEST_FORK;
  o.timeout_ms = 5000;
  o.kill_rank = 0;
  o.kill_after_ms = 100;
  o.kill_signal = SIGKILL;
  o.kill_after_ready = true;
  ddp_test_results_t *res = ddp_test_spawn(&o, slow_ready, NULL);
  int64_t ready1;
  assert_int_equal(ddp_test_result(res, 1)->nvalues, sizeof ready1);
  memcpy(&ready1, ddp_test_result(res, 1)->values, sizeof ready1);
  int64_t killed = ddp_test_kill_time_ns(res);
  print_message("rank 1 ready at %lld ns, the kill %.1f ms after it\n", (long long)ready1,
                (double)(killed - ready1) / 1e6);
  assert_int_equal(ddp_test_result(res, 0)->term_signal, SIGKILL);
  assert_true(killed >= ready1 + 100 * 1000000LL);
  ddp_test_results_free(res);
}

/* Rank 0 dereferences NULL, rank 1 aborts, rank 2 calls exit(3) without returning. */
static int crash(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  switch (ddp_test_rank(r)) {
    case 0: {
      struct sigaction sa = {0};
      sa.sa_handler = SIG_DFL;
      sigaction(SIGSEGV, &sa, NULL); /* CMocka's handler would otherwise catch it */
      raise(SIGSEGV);
      return DDP_OK;
    }
    case 1: {
      signal(SIGABRT, SIG_DFL);
      abort();
    }
    case 2: _exit(3);
    default: return DDP_OK;
  }
}

/* A child that dies without reporting is CRASHED, with its signal or exit code. */
static void test_fork_crash(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 4;
  o.mode = DDP_TEST_FORK;
  o.timeout_ms = 5000;
  ddp_test_results_t *res = ddp_test_spawn(&o, crash, NULL);
  const ddp_test_result_t *r0 = ddp_test_result(res, 0), *r1 = ddp_test_result(res, 1),
                          *r2 = ddp_test_result(res, 2), *r3 = ddp_test_result(res, 3);
  assert_int_equal(r0->status, DDP_TEST_CRASHED);
  assert_int_equal(r0->term_signal, SIGSEGV);
  assert_int_equal(r1->status, DDP_TEST_CRASHED);
  assert_int_equal(r1->term_signal, SIGABRT);
  assert_int_equal(r2->status, DDP_TEST_CRASHED);
  assert_int_equal(r2->term_signal, 0);
  assert_int_equal(r2->exit_code, 3);
  assert_int_equal(r3->status, DDP_OK);
  assert_true(r3->reported);
  ddp_test_results_free(res);
}

/* Odd ranks fail with a status and a message. */
static int fail_odd(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  if (ddp_test_rank(r) % 2 == 0) return DDP_OK;
  ddp_test_say(r, "rank %d: peer 0 timed out after %d ms", ddp_test_rank(r), 42);
  return DDP_ERR_TIMEOUT;
}

static void test_failing_status(void **state) {
  (void)state;
  for (int mode = 0; mode < 2; mode++) {
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 4;
    o.mode = (ddp_test_mode_t)mode;
    ddp_test_results_t *res = ddp_test_spawn(&o, fail_odd, NULL);
    for (int k = 0; k < 4; k++) {
      const ddp_test_result_t *r = ddp_test_result(res, k);
      assert_true(r->reported);
      if (k % 2 == 0) {
        assert_int_equal(r->status, DDP_OK);
        assert_string_equal(r->msg, "");
      } else {
        char want[64];
        snprintf(want, sizeof want, "rank %d: peer 0 timed out after 42 ms", k);
        assert_int_equal(r->status, DDP_ERR_TIMEOUT);
        assert_string_equal(r->msg, want);
      }
    }
    assert_string_equal(ddp_test_status_name(DDP_TEST_HUNG), "DDP_TEST_HUNG");
    assert_string_equal(ddp_test_status_name(DDP_TEST_CRASHED), "DDP_TEST_CRASHED");
    assert_string_equal(ddp_test_status_name(DDP_ERR_TIMEOUT), "DDP_ERR_TIMEOUT");
    ddp_test_results_free(res);
  }
}

static int always_timeout(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  ddp_test_say(r, "rank %d timed out", ddp_test_rank(r));
  return DDP_ERR_TIMEOUT;
}

/* ddp_test_expect_all accepts a spawn where every rank returned the expected status. */
static void test_expect_all_matches(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 3;
  ddp_test_results_t *res = ddp_test_spawn(&o, always_timeout, NULL);
  ddp_test_expect_all(res, DDP_ERR_TIMEOUT);
  ddp_test_results_free(res);
  o.world = 1;
  res = ddp_test_spawn(&o, fail_odd, NULL);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
}

/* Every rank writes a file into the shared scratch directory; all are visible
 * in the parent; the directory is gone after results_free. */
static int use_dir(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  const char *d = ddp_test_dir(r);
  char path[512];
  snprintf(path, sizeof path, "%s/rank%d", d, ddp_test_rank(r));
  FILE *f = fopen(path, "w");
  if (!f) return DDP_ERR_SYSTEM;
  fprintf(f, "%d\n", ddp_test_rank(r));
  fclose(f);
  ddp_test_put(r, d, strlen(d) + 1);
  return DDP_OK;
}

static void test_scratch_dir(void **state) {
  (void)state;
  for (int mode = 0; mode < 2; mode++) {
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = 3;
    o.mode = (ddp_test_mode_t)mode;
    ddp_test_results_t *res = ddp_test_spawn(&o, use_dir, NULL);
    ddp_test_expect_ok(res);
    const char *d0 = (const char *)ddp_test_result(res, 0)->values;
    char dir[512];
    snprintf(dir, sizeof dir, "%s", d0);
    for (int k = 0; k < 3; k++) {
      assert_string_equal((const char *)ddp_test_result(res, k)->values, dir);
      char path[600];
      snprintf(path, sizeof path, "%s/rank%d", dir, k);
      struct stat st;
      assert_int_equal(stat(path, &st), 0);
    }
    ddp_test_results_free(res);
    struct stat st;
    assert_int_not_equal(stat(dir, &st), 0);
  }
}

/* Thread-mode hang, observed from outside: a fork rank runs a thread-mode spawn whose
 * rank 1 never returns. The inner watchdog must end that child with exit code 1 shortly
 * after its 300 ms timeout (it cannot kill a thread), so the outer spawn sees a CRASHED
 * rank with exit code 1 long before its own 10 s timeout. The inner scratch directory is
 * placed inside the outer one so that it is removed too. */
static int inner_hang(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  if (ddp_test_rank(r) == 1) {
    for (;;) pause();
  }
  return DDP_OK;
}

static int run_thread_hang(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  setenv("TMPDIR", ddp_test_dir(r), 1);
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 3;
  o.timeout_ms = 300;
  ddp_test_results_t *res = ddp_test_spawn(&o, inner_hang, NULL);
  ddp_test_results_free(res);
  ddp_test_say(r, "the thread-mode watchdog let a hung spawn return");
  return DDP_ERR_INTERNAL;
}

static void test_thread_hang_ends_process(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.mode = DDP_TEST_FORK;
  o.timeout_ms = 10000;
  double t0 = now_ms();
  ddp_test_results_t *res = ddp_test_spawn(&o, run_thread_hang, NULL);
  double took = now_ms() - t0;
  const ddp_test_result_t *r = ddp_test_result(res, 0);
  assert_int_equal(r->status, DDP_TEST_CRASHED);
  assert_int_equal(r->term_signal, 0);
  assert_int_equal(r->exit_code, 1);
  assert_true(took >= 300.0 && took < DDP_TEST_BOUND_MS(5000.0));
  ddp_test_results_free(res);
}

/* ddp_test_python finds /usr/bin/python3 with torch, or reports NULL; never another one.
 * Without it there is nothing to check: the test skips (it does not pass). */
static void test_python(void **state) {
  (void)state;
  const char *py = ddp_test_python();
  if (!py) {
    print_message("no /usr/bin/python3 with torch on this machine: skipped\n");
    skip();
  }
  assert_string_equal(py, "/usr/bin/python3");
  assert_int_equal(access(py, X_OK), 0);
}

/* The source root resolves to this tree (it holds tests/harness/harness.h). */
static void test_source_root(void **state) {
  (void)state;
  const char *root = ddp_test_source_root();
  assert_non_null(root);
  char path[1024];
  snprintf(path, sizeof path, "%s/tests/harness/harness.h", root);
  assert_int_equal(access(path, R_OK), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_thread_values),
      cmocka_unit_test(test_fork_values),
      cmocka_unit_test(test_value_capacity),
      cmocka_unit_test(test_fork_hang),
      cmocka_unit_test(test_fork_kill_injection),
      cmocka_unit_test(test_fork_kill_after_ready),
      cmocka_unit_test(test_fork_crash),
      cmocka_unit_test(test_failing_status),
      cmocka_unit_test(test_expect_all_matches),
      cmocka_unit_test(test_scratch_dir),
      cmocka_unit_test(test_source_root),
      cmocka_unit_test(test_thread_hang_ends_process),
      cmocka_unit_test(test_python),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
