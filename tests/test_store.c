/* Tests of the store layer (src/store): every operation on the in-memory, file and TCP
 * stores with values checked; exact totals under concurrent add() from threads and from
 * forked processes; wait timeouts that name the key and end on time; cancellation; connect
 * retry; hostile bytes on the TCP server; prefix isolation; no leaked fds or allocations. */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/store.h"
#include "harness.h"
#include "store/store_internal.h" /* the wire parser, tested directly */

/* ---------------------------------------------------------------- helpers --------- */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  assert_non_null(d);
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (de->d_name[0] != '.') n++;
  }
  closedir(d);
  return n - 1; /* the directory stream's own fd */
}

/* The last error of handle s, copied out (ddp_store_last_error_copy) into this thread's
 * buffer, valid until this thread's next call. */
static const char *last_msg(const ddp_store_t *s) {
  static _Thread_local ddp_error_t e;
  ddp_store_last_error_copy(s, &e);
  return e.msg;
}

/* Log capture: the store logs through the library's sink; tests read what it said. */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[65536];
static size_t log_len;

static void capture_sink(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  (void)level;
  fprintf(stderr, "%s\n", line);
  pthread_mutex_lock(&log_mu);
  size_t n = strlen(line);
  if (log_len + n + 2 < sizeof log_buf) {
    memcpy(log_buf + log_len, line, n);
    log_len += n;
    log_buf[log_len++] = '\n';
    log_buf[log_len] = '\0';
  }
  pthread_mutex_unlock(&log_mu);
}

static void log_reset(void) {
  pthread_mutex_lock(&log_mu);
  log_len = 0;
  log_buf[0] = '\0';
  pthread_mutex_unlock(&log_mu);
}

static bool log_has(const char *needle) {
  pthread_mutex_lock(&log_mu);
  bool r = strstr(log_buf, needle) != NULL;
  pthread_mutex_unlock(&log_mu);
  return r;
}

static char tmp_template[64];

static const char *make_tmpdir(void) {
  /* mkdtemp's template ends in six 'X' */
  int n = snprintf(tmp_template, sizeof tmp_template, "/tmp/ddp-store-test-");
  memset(tmp_template + n, 'X', 6);
  tmp_template[n + 6] = '\0';
  ddp_test_mkdtemp(tmp_template); /* removed at exit, also on failure */
  return tmp_template;
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  char path[4200];
  while ((de = readdir(d)) != NULL) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

static ddp_store_options_t opts_ms(int64_t timeout_ms, const char *token) {
  ddp_store_options_t o = DDP_STORE_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  o.job_token = token;
  return o;
}

enum kind { K_MEMORY, K_FILE, K_TCP };
static const char *const kind_names[] = {"memory", "file", "tcp"};

/* A store of each kind; for TCP a server (and its own client) on an ephemeral port. */
static ddp_store_t *make_store(enum kind k, const char *dir, int64_t timeout_ms) {
  ddp_store_options_t o = opts_ms(timeout_ms, "test-token");
  ddp_store_t *s = NULL;
  ddp_status_t st = DDP_OK;
  switch (k) {
    case K_MEMORY: st = ddp_store_create_memory(&o, &s, NULL); break;
    case K_FILE: st = ddp_store_create_file(dir, &o, &s, NULL); break;
    case K_TCP: st = ddp_store_create_tcp("127.0.0.1", 0, true, &o, &s, NULL); break;
  }
  assert_int_equal(st, DDP_OK);
  assert_non_null(s);
  return s;
}

/* ---------------------------------------------------------------- every op -------- */

static void expect_get(ddp_store_t *s, const char *key, const void *want, size_t n) {
  void *v = NULL;
  size_t len = 99;
  assert_int_equal(ddp_store_get(s, key, &v, &len), DDP_OK);
  assert_int_equal(len, n);
  if (n) assert_memory_equal(v, want, n);
  ddp_free(v);
}

/* Runs every operation and checks every value against what the sequence of calls implies.
 * `nkeys` counts the keys this function creates, for num_keys. */
static void exercise_ops(ddp_store_t *s) {
  int64_t nkeys = 0, n = -1;
  assert_int_equal(ddp_store_num_keys(s, &n), DDP_OK);
  assert_int_equal(n, 0);

  /* set / get, binary values with zero bytes, overwrite, the empty value */
  unsigned char bin[256];
  for (int i = 0; i < 256; i++) bin[i] = (unsigned char)(255 - i);
  assert_int_equal(ddp_store_set(s, "bin", bin, sizeof bin), DDP_OK);
  nkeys++;
  expect_get(s, "bin", bin, sizeof bin);
  assert_int_equal(ddp_store_set(s, "bin", "xy", 2), DDP_OK);
  expect_get(s, "bin", "xy", 2);
  assert_int_equal(ddp_store_set(s, "empty", NULL, 0), DDP_OK);
  nkeys++;
  expect_get(s, "empty", "", 0);

  /* awkward key names: separators, escapes, dots, non-ASCII, and a 4000-byte key */
  const char *odd[] = {"a/b/c", "%41%", "..", ".", "key with spaces\t", "\xc3\xa9t\xc3\xa9"};
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
    char val[32];
    int vl = snprintf(val, sizeof val, "odd-%zu", i);
    assert_int_equal(ddp_store_set(s, odd[i], val, (size_t)vl), DDP_OK);
    nkeys++;
  }
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
    char val[32];
    int vl = snprintf(val, sizeof val, "odd-%zu", i);
    expect_get(s, odd[i], val, (size_t)vl);
  }
  char *longkey = malloc(4001);
  char *longkey2 = malloc(4001);
  memset(longkey, 'L', 4000);
  longkey[4000] = '\0';
  memcpy(longkey2, longkey, 4001);
  longkey2[3999] = 'M'; /* differs only at the end: long names must not collide */
  assert_int_equal(ddp_store_set(s, longkey, "one", 3), DDP_OK);
  assert_int_equal(ddp_store_set(s, longkey2, "two", 3), DDP_OK);
  nkeys += 2;
  expect_get(s, longkey, "one", 3);
  expect_get(s, longkey2, "two", 3);

  /* a key over the limit and a value over the limit are refused, nothing stored */
  char *toolong = malloc(DDP_STORE_MAX_KEY + 2);
  memset(toolong, 'k', DDP_STORE_MAX_KEY + 1);
  toolong[DDP_STORE_MAX_KEY + 1] = '\0';
  assert_int_equal(ddp_store_set(s, toolong, "v", 1), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(last_msg(s), "limit"));
  free(toolong);
  assert_int_equal(ddp_store_set(s, "big", bin, (size_t)DDP_STORE_MAX_VALUE + 1),
                   DDP_ERR_INVALID_ARGUMENT);

  /* a 1 MiB value with a counter pattern */
  size_t big_n = 1u << 20;
  unsigned char *big = malloc(big_n);
  for (size_t i = 0; i < big_n; i++) big[i] = (unsigned char)(i * 2654435761u >> 24);
  assert_int_equal(ddp_store_set(s, "big", big, big_n), DDP_OK);
  nkeys++;
  expect_get(s, "big", big, big_n);
  free(big);

  /* add: missing counts as 0; the result is the running sum; the value is decimal text */
  int64_t r = 0, sum = 0;
  const int64_t deltas[] = {5, -12, 1000000000000LL, 0, 7};
  for (size_t i = 0; i < sizeof deltas / sizeof deltas[0]; i++) {
    sum += deltas[i];
    assert_int_equal(ddp_store_add(s, "ctr", deltas[i], &r), DDP_OK);
    assert_int_equal(r, sum);
  }
  nkeys++;
  char text[32];
  int tl = snprintf(text, sizeof text, "%lld", (long long)sum);
  expect_get(s, "ctr", text, (size_t)tl);
  /* add on a non-integer value is an error naming the key */
  assert_int_equal(ddp_store_add(s, "bin", 1, &r), DDP_ERR_INVALID_USAGE);
  assert_non_null(strstr(last_msg(s), "bin"));
  /* overflow is refused and leaves the counter as it was */
  assert_int_equal(ddp_store_set(s, "max", "9223372036854775807", 19), DDP_OK);
  nkeys++;
  assert_int_equal(ddp_store_add(s, "max", 1, &r), DDP_ERR_INVALID_ARGUMENT);
  expect_get(s, "max", "9223372036854775807", 19);

  /* check and wait */
  bool all = false;
  const char *have[] = {"bin", "ctr", longkey};
  const char *partly[] = {"bin", "nope"};
  assert_int_equal(ddp_store_check(s, have, 3, &all), DDP_OK);
  assert_true(all);
  assert_int_equal(ddp_store_check(s, partly, 2, &all), DDP_OK);
  assert_false(all);
  assert_int_equal(ddp_store_check(s, NULL, 0, &all), DDP_OK);
  assert_true(all);
  assert_int_equal(ddp_store_wait(s, have, 3, 1000), DDP_OK);

  /* compare_set: match swaps, mismatch keeps, missing + empty expected creates, missing +
   * non-empty expected leaves it missing */
  void *act = NULL;
  size_t an = 0;
  assert_int_equal(ddp_store_set(s, "cas", "old", 3), DDP_OK);
  nkeys++;
  assert_int_equal(ddp_store_compare_set(s, "cas", "old", 3, "new", 3, &act, &an), DDP_OK);
  assert_int_equal(an, 3);
  assert_memory_equal(act, "new", 3);
  ddp_free(act);
  assert_int_equal(ddp_store_compare_set(s, "cas", "old", 3, "zzz", 3, &act, &an), DDP_OK);
  assert_int_equal(an, 3);
  assert_memory_equal(act, "new", 3);
  ddp_free(act);
  expect_get(s, "cas", "new", 3);
  assert_int_equal(ddp_store_compare_set(s, "cas2", NULL, 0, "first", 5, &act, &an), DDP_OK);
  nkeys++;
  assert_int_equal(an, 5);
  assert_memory_equal(act, "first", 5);
  ddp_free(act);
  assert_int_equal(ddp_store_compare_set(s, "cas3", "x", 1, "y", 1, &act, &an), DDP_OK);
  assert_int_equal(an, 0);
  ddp_free(act);
  const char *cas3[] = {"cas3"};
  assert_int_equal(ddp_store_check(s, cas3, 1, &all), DDP_OK);
  assert_false(all);

  /* num_keys counts what was created */
  assert_int_equal(ddp_store_num_keys(s, &n), DDP_OK);
  assert_int_equal(n, nkeys);

  /* delete: true once, then false; the key is gone */
  bool deleted = false;
  assert_int_equal(ddp_store_delete(s, "cas", &deleted), DDP_OK);
  assert_true(deleted);
  assert_int_equal(ddp_store_delete(s, "cas", &deleted), DDP_OK);
  assert_false(deleted);
  assert_int_equal(ddp_store_delete(s, longkey2, &deleted), DDP_OK);
  assert_true(deleted);
  expect_get(s, longkey, "one", 3);
  nkeys -= 2;
  assert_int_equal(ddp_store_num_keys(s, &n), DDP_OK);
  assert_int_equal(n, nkeys);
  free(longkey);
  free(longkey2);
}

static void run_ops(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 5000);
  exercise_ops(s);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* Every op on the in-memory store. */
static void test_ops_memory(void **state) {
  (void)state;
  run_ops(K_MEMORY);
}
/* Every op on the file store (short, escaped and hashed file names). */
static void test_ops_file(void **state) {
  (void)state;
  run_ops(K_FILE);
}
/* Every op on the TCP store, through the server's own client. */
static void test_ops_tcp(void **state) {
  (void)state;
  run_ops(K_TCP);
}

/* A TCP client other than the server's sees the same keys, and a file store opened twice
 * on one directory shares them. */
static void test_second_handle_sees_keys(void **state) {
  (void)state;
  ddp_store_options_t o = opts_ms(5000, "test-token");
  ddp_store_t *srv = make_store(K_TCP, NULL, 5000), *cli = NULL;
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &o, &cli, NULL),
                   DDP_OK);
  assert_int_equal(ddp_store_port(cli), -1);
  assert_int_equal(ddp_store_set(cli, "from-client", "c", 1), DDP_OK);
  expect_get(srv, "from-client", "c", 1);
  assert_int_equal(ddp_store_timeout_ms(cli), 5000);
  ddp_store_destroy(cli);
  ddp_store_destroy(srv);

  const char *dir = make_tmpdir();
  ddp_store_t *f1 = make_store(K_FILE, dir, 5000);
  ddp_store_t *f2 = make_store(K_FILE, dir, 5000);
  assert_int_equal(ddp_store_set(f1, "shared", "s", 1), DDP_OK);
  expect_get(f2, "shared", "s", 1);
  ddp_store_destroy(f1);
  ddp_store_destroy(f2);
  remove_dir(dir);
}

/* ---------------------------------------------------------------- concurrency ----- */

#define ADDS_PER_RANK 200

typedef struct add_arg {
  enum kind kind;
  ddp_store_t *shared; /* threads share one handle (memory) or make their own */
  const char *dir;
  int port;
} add_arg_t;

/* Each rank adds rank+1, ADDS_PER_RANK times, and reports the largest result it saw. */
static int add_rank(ddp_test_rank_t *r, void *argp) {
  add_arg_t *a = argp;
  int me = ddp_test_rank(r);
  ddp_store_options_t o = opts_ms(10000, "test-token");
  ddp_store_t *s = a->shared;
  ddp_status_t st = DDP_OK;
  if (!s) {
    if (a->kind == K_FILE)
      st = ddp_store_create_file(a->dir, &o, &s, NULL);
    else
      st = ddp_store_create_tcp("127.0.0.1", a->port, false, &o, &s, NULL);
    if (st != DDP_OK) {
      ddp_test_say(r, "create failed: %s", ddp_status_name(st));
      return st;
    }
  }
  int64_t maxr = 0, res = 0;
  for (int i = 0; i < ADDS_PER_RANK && st == DDP_OK; i++) {
    st = ddp_store_add(s, "total", me + 1, &res);
    if (res > maxr) maxr = res;
  }
  if (st != DDP_OK) ddp_test_say(r, "add: %s", last_msg(s));
  ddp_test_put(r, &maxr, sizeof maxr);
  if (!a->shared) ddp_store_destroy(s);
  return st;
}

static void check_total(ddp_store_t *s, ddp_test_results_t *res, int world) {
  ddp_test_expect_ok(res);
  int64_t want = 0;
  for (int k = 0; k < world; k++) {
    for (int i = 0; i < ADDS_PER_RANK; i++) want += k + 1;
  }
  int64_t seen_max = 0;
  for (int k = 0; k < world; k++) {
    const ddp_test_result_t *r = ddp_test_result(res, k);
    int64_t m;
    assert_int_equal(r->nvalues, sizeof m);
    memcpy(&m, r->values, sizeof m);
    if (m > seen_max) seen_max = m;
  }
  /* The last add anyone made returned the exact total. */
  assert_int_equal(seen_max, want);
  int64_t total = 0;
  assert_int_equal(ddp_store_add(s, "total", 0, &total), DDP_OK);
  assert_int_equal(total, want);
}

static void run_concurrent(enum kind k, ddp_test_mode_t mode, int world, bool shared) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 10000);
  add_arg_t a = {k, shared ? s : NULL, dir, k == K_TCP ? ddp_store_port(s) : -1};
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = world;
  o.mode = mode;
  o.timeout_ms = 40000;
  double t0 = now_ms();
  ddp_test_results_t *res = ddp_test_spawn(&o, add_rank, &a);
  double dt = now_ms() - t0;
  check_total(s, res, world);
  printf("# %s store, %d %s%s: %d adds in %.0f ms (%.0f adds/s)\n", kind_names[k], world,
         mode == DDP_TEST_FORK ? "processes" : "threads", shared ? " on one handle" : "",
         world * ADDS_PER_RANK, dt, world * ADDS_PER_RANK / (dt / 1000.0));
  ddp_test_results_free(res);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* 8 threads add to one in-memory store: exact total. */
static void test_concurrent_add_threads_memory(void **state) {
  (void)state;
  run_concurrent(K_MEMORY, DDP_TEST_THREADS, 8, true);
}

/* 8 threads on one TCP handle (pooled connections) and 8 threads with their own clients. */
static void test_concurrent_add_threads_tcp(void **state) {
  (void)state;
  run_concurrent(K_TCP, DDP_TEST_THREADS, 8, true);
  run_concurrent(K_TCP, DDP_TEST_THREADS, 8, false);
}

/* 8 threads, each with its own file store handle on one directory (flock between them). */
static void test_concurrent_add_threads_file(void **state) {
  (void)state;
  run_concurrent(K_FILE, DDP_TEST_THREADS, 8, false);
}

/* 4 forked processes add through file stores on one directory: exact total. */
static void test_concurrent_add_fork_file(void **state) {
  (void)state;
  run_concurrent(K_FILE, DDP_TEST_FORK, 4, false);
}

/* 4 forked processes add through TCP clients to the parent's server: exact total. */
static void test_concurrent_add_fork_tcp(void **state) {
  (void)state;
  run_concurrent(K_TCP, DDP_TEST_FORK, 4, false);
}

/* ---------------------------------------------------------------- timeouts -------- */

#define TIMEOUT_MS 300
/* Allowed past a deadline: 700 ms on an idle machine, more under load (cleanup.h). */
#define TOLERANCE_MS DDP_TEST_BOUND_MS(700)

static void run_timeout(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, TIMEOUT_MS);
  assert_int_equal(ddp_store_set(s, "present", "p", 1), DDP_OK);
  const char *keys[] = {"present", "never-set-key"};
  double t0 = now_ms();
  assert_int_equal(ddp_store_wait(s, keys, 2, TIMEOUT_MS), DDP_ERR_TIMEOUT);
  double dt = now_ms() - t0;
  assert_true(dt >= TIMEOUT_MS - 5);
  assert_true(dt <= TIMEOUT_MS + TOLERANCE_MS);
  const char *msg = last_msg(s);
  assert_non_null(strstr(msg, "'never-set-key'"));
  assert_null(strstr(msg, "'present'"));
  if (k == K_TCP) {
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", ddp_store_port(s));
    assert_non_null(strstr(msg, addr));
  }
  if (k == K_FILE) assert_non_null(strstr(msg, dir));
  /* get() on a missing key uses the store's timeout */
  void *v = NULL;
  size_t n = 0;
  t0 = now_ms();
  assert_int_equal(ddp_store_get(s, "absent-get", &v, &n), DDP_ERR_TIMEOUT);
  dt = now_ms() - t0;
  assert_true(dt >= TIMEOUT_MS - 5 && dt <= TIMEOUT_MS + TOLERANCE_MS);
  assert_null(v);
  assert_non_null(strstr(last_msg(s), "'absent-get'"));
  /* the handle still works after a timeout */
  expect_get(s, "present", "p", 1);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* wait()/get() time out within timeout+tolerance, naming the missing key and the store. */
static void test_timeout_memory(void **state) {
  (void)state;
  run_timeout(K_MEMORY);
}
static void test_timeout_file(void **state) {
  (void)state;
  run_timeout(K_FILE);
}
static void test_timeout_tcp(void **state) {
  (void)state;
  run_timeout(K_TCP);
}

/* ---------------------------------------------------------------- wake-ups -------- */

typedef struct setter_arg {
  ddp_store_t *s;
  ddp_status_t st;
} setter_arg_t;

/* Sets k1 after 100 ms, k2 after 200 ms, then "val" after 250 ms. */
static void *late_setter(void *p) {
  setter_arg_t *a = p;
  sleep_ms(100);
  a->st = ddp_store_set(a->s, "k1", "1", 1);
  sleep_ms(100);
  if (a->st == DDP_OK) a->st = ddp_store_set(a->s, "k2", "2", 1);
  sleep_ms(50);
  if (a->st == DDP_OK) a->st = ddp_store_set(a->s, "val", "late", 4);
  return NULL;
}

static void run_wake(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 5000);
  ddp_store_t *other = s;
  ddp_store_options_t o = opts_ms(5000, "test-token");
  /* the setter uses a second handle where the kind has one */
  if (k == K_FILE) assert_int_equal(ddp_store_create_file(dir, &o, &other, NULL), DDP_OK);
  if (k == K_TCP) {
    assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(s), false, &o, &other, NULL),
                     DDP_OK);
  }
  setter_arg_t a = {other, DDP_OK};
  pthread_t th;
  double t0 = now_ms();
  assert_int_equal(pthread_create(&th, NULL, late_setter, &a), 0);
  const char *keys[] = {"k1", "k2"};
  assert_int_equal(ddp_store_wait(s, keys, 2, 5000), DDP_OK);
  double dt = now_ms() - t0;
  assert_true(dt >= 190 && dt < DDP_TEST_BOUND_MS(1500));
  expect_get(s, "val", "late", 4); /* get blocks until the set 50 ms later */
  dt = now_ms() - t0;
  assert_true(dt >= 240 && dt < DDP_TEST_BOUND_MS(1500));
  pthread_join(th, NULL);
  assert_int_equal(a.st, DDP_OK);
  if (other != s) ddp_store_destroy(other);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* wait() and get() return as soon as another handle sets the keys. */
static void test_wake_memory(void **state) {
  (void)state;
  run_wake(K_MEMORY);
}
static void test_wake_file(void **state) {
  (void)state;
  run_wake(K_FILE);
}
static void test_wake_tcp(void **state) {
  (void)state;
  run_wake(K_TCP);
}

/* With opts.job_token NULL, server and clients take DDP_JOB_TOKEN from the environment;
 * an explicit token that differs is rejected, and so is "" against a set token. */
static void test_token_from_env(void **state) {
  (void)state;
  setenv("DDP_JOB_TOKEN", "env-token-123", 1);
  ddp_store_options_t o = opts_ms(3000, NULL);
  ddp_store_t *srv = NULL, *cli = NULL;
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", 0, true, &o, &srv, NULL), DDP_OK);
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &o, &cli, NULL),
                   DDP_OK);
  assert_int_equal(ddp_store_set(cli, "via-env", "ok", 2), DDP_OK);
  expect_get(srv, "via-env", "ok", 2);
  ddp_store_destroy(cli);
  cli = NULL;
  ddp_store_options_t wrong = opts_ms(3000, "env-token-12");
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &wrong, &cli,
                                        NULL),
                   DDP_ERR_INVALID_USAGE);
  ddp_store_options_t empty = opts_ms(3000, "");
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &empty, &cli,
                                        NULL),
                   DDP_ERR_INVALID_USAGE);
  assert_null(cli);
  unsetenv("DDP_JOB_TOKEN");
  ddp_store_destroy(srv);
}

/* The address a backend publishes (ddp__store_local_addr): the local end of the
 * connection to the server, i.e. the address that reaches it. Loopback for a server or
 * client on 127.0.0.1 (also through a view), a host address for a client of that address,
 * and nothing for a wildcard server's own client or for a memory store. */
static void test_local_addr(void **state) {
  (void)state;
  ddp_store_options_t o = opts_ms(3000, NULL);
  ddp_store_t *srv = NULL, *cli = NULL, *view = NULL, *mem = NULL, *any = NULL;
  char a[80];
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", 0, true, &o, &srv, NULL), DDP_OK);
  assert_true(ddp_store_local_addr(srv, a, sizeof a));
  assert_string_equal(a, "127.0.0.1");
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &o, &cli, NULL),
                   DDP_OK);
  assert_int_equal(ddp_store_create_prefix(cli, "pg0", &view, NULL), DDP_OK);
  assert_true(ddp_store_local_addr(view, a, sizeof a));
  assert_string_equal(a, "127.0.0.1");
  assert_false(ddp_store_local_addr(view, a, 4)); /* does not fit */
  assert_string_equal(a, "");
  assert_int_equal(ddp_store_create_memory(&o, &mem, NULL), DDP_OK);
  assert_false(ddp_store_local_addr(mem, a, sizeof a));
  assert_int_equal(ddp_store_create_tcp(NULL, 0, true, &o, &any, NULL), DDP_OK);
  assert_false(ddp_store_local_addr(any, a, sizeof a));
  /* A client of the wildcard server through this host's first non-loopback IPv4 address
   * (where there is one) learns that address. */
  struct ifaddrs *ifs = NULL;
  char host[INET_ADDRSTRLEN] = "";
  if (getifaddrs(&ifs) == 0) {
    for (struct ifaddrs *i = ifs; i && !host[0]; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !(i->ifa_flags & IFF_LOOPBACK) &&
          (i->ifa_flags & IFF_UP))
        inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, host, sizeof host);
    freeifaddrs(ifs);
  }
  if (host[0]) {
    ddp_store_t *far = NULL;
    assert_int_equal(ddp_store_create_tcp(host, ddp_store_port(any), false, &o, &far, NULL),
                     DDP_OK);
    assert_true(ddp_store_local_addr(far, a, sizeof a));
    assert_string_equal(a, host);
    ddp_store_destroy(far);
  } else {
    print_message("no non-loopback IPv4 interface: host-address case not run\n");
  }
  ddp_store_destroy(any);
  ddp_store_destroy(mem);
  ddp_store_destroy(view);
  ddp_store_destroy(cli);
  ddp_store_destroy(srv);
}

/* wait() and check() on many keys: 300 present keys (more than 255, the field count's
 * byte on the wire), one missing among them, and more than the limit. */
static void run_many_keys(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 3000);
  enum { NK = 300 };
  static char names[NK + 1][24];
  const char *keys[NK + 1];
  for (int i = 0; i <= NK; i++) {
    snprintf(names[i], sizeof names[i], "many-%d", i);
    keys[i] = names[i];
    if (i < NK) assert_int_equal(ddp_store_set(s, names[i], &i, sizeof i), DDP_OK);
  }
  bool all = false;
  assert_int_equal(ddp_store_check(s, keys, NK, &all), DDP_OK);
  assert_true(all);
  assert_int_equal(ddp_store_wait(s, keys, NK, 1000), DDP_OK);
  assert_int_equal(ddp_store_check(s, keys, NK + 1, &all), DDP_OK);
  assert_false(all);
  assert_int_equal(ddp_store_wait(s, keys, NK + 1, 100), DDP_ERR_TIMEOUT);
  assert_non_null(strstr(last_msg(s), "'many-300'"));
  assert_null(strstr(last_msg(s), "'many-0'"));
  int64_t n = 0;
  assert_int_equal(ddp_store_num_keys(s, &n), DDP_OK);
  assert_int_equal(n, NK);
  const char **lots = calloc(DDP_STORE_MAX_WAIT_KEYS + 1, sizeof *lots);
  for (int i = 0; i <= DDP_STORE_MAX_WAIT_KEYS; i++) lots[i] = "x";
  assert_int_equal(ddp_store_wait(s, lots, DDP_STORE_MAX_WAIT_KEYS + 1, 10),
                   DDP_ERR_INVALID_ARGUMENT);
  free(lots);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

static void test_many_keys_memory(void **state) {
  (void)state;
  run_many_keys(K_MEMORY);
}
static void test_many_keys_file(void **state) {
  (void)state;
  run_many_keys(K_FILE);
}
static void test_many_keys_tcp(void **state) {
  (void)state;
  run_many_keys(K_TCP);
}

/* ---------------------------------------------------------------- cancel ---------- */

typedef struct cancel_arg {
  ddp_store_t *s;
  ddp_status_t st;
  atomic_int started;
  double t_start, t_end; /* around the get, in now_ms() time */
  double elapsed;        /* from the cancel to the get's return */
  char msg[DDP_ERROR_MSG_MAX];
} cancel_arg_t;

static void *blocked_get(void *p) {
  cancel_arg_t *a = p;
  void *v = NULL;
  size_t n = 0;
  a->t_start = now_ms();
  atomic_store(&a->started, 1);
  a->st = ddp_store_get(a->s, "never", &v, &n);
  a->t_end = now_ms();
  snprintf(a->msg, sizeof a->msg, "%s", last_msg(a->s));
  ddp_free(v);
  return NULL;
}

/* Cancels `target` while a get through `getter` is blocked (it has been running for
 * 150 ms); returns how the get ended and how long after the cancel. */
static void cancel_while_blocked(ddp_store_t *getter, ddp_store_t *target, cancel_arg_t *a) {
  memset(a, 0, sizeof *a);
  a->s = getter;
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, blocked_get, a), 0);
  while (!atomic_load(&a->started)) sleep_ms(1);
  sleep_ms(150);
  double t_cancel = now_ms();
  ddp_store_cancel(target);
  pthread_join(th, NULL);
  a->elapsed = a->t_end - t_cancel;
  /* the get was blocked until the cancel, then returned promptly */
  assert_true(a->t_end >= t_cancel);
  assert_true(a->elapsed < DDP_TEST_BOUND_MS(1000));
}

static void run_cancel(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 20000);
  /* cancelling a view ends a get through the view and leaves the base usable */
  ddp_store_t *view = NULL;
  assert_int_equal(ddp_store_create_prefix(s, "grp", &view, NULL), DDP_OK);
  cancel_arg_t a;
  cancel_while_blocked(view, view, &a);
  assert_int_equal(a.st, DDP_ERR_ABORTED);
  assert_non_null(strstr(a.msg, "cancel"));
  assert_int_equal(ddp_store_set(view, "x", "1", 1), DDP_ERR_ABORTED);
  assert_int_equal(ddp_store_set(s, "after-view-cancel", "ok", 2), DDP_OK);
  expect_get(s, "after-view-cancel", "ok", 2);
  ddp_store_destroy(view);
  /* cancelling the base ends a get through a view over it, and later calls */
  assert_int_equal(ddp_store_create_prefix(s, "grp2", &view, NULL), DDP_OK);
  cancel_while_blocked(view, s, &a);
  assert_int_equal(a.st, DDP_ERR_ABORTED);
  void *v = NULL;
  size_t n = 0;
  assert_int_equal(ddp_store_get(s, "after-view-cancel", &v, &n), DDP_ERR_ABORTED);
  ddp_store_destroy(view);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* ddp_store_cancel from another thread unblocks a waiting get with DDP_ERR_ABORTED. */
static void test_cancel_memory(void **state) {
  (void)state;
  run_cancel(K_MEMORY);
}
static void test_cancel_file(void **state) {
  (void)state;
  run_cancel(K_FILE);
}
static void test_cancel_tcp(void **state) {
  (void)state;
  run_cancel(K_TCP);
}

/* A client blocked in get() when its server goes away fails promptly with DDP_ERR_REMOTE;
 * its next call retries connecting until its timeout and says so. */
static void test_server_gone(void **state) {
  (void)state;
  ddp_store_t *srv = make_store(K_TCP, NULL, 3000), *cli = NULL;
  ddp_store_options_t o = opts_ms(400, "test-token");
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &o, &cli, NULL),
                   DDP_OK);
  cancel_arg_t a;
  memset(&a, 0, sizeof a);
  a.s = cli;
  pthread_t th;
  /* the client's own timeout is 400 ms: destroy the server well before */
  assert_int_equal(pthread_create(&th, NULL, blocked_get, &a), 0);
  while (!atomic_load(&a.started)) sleep_ms(1);
  sleep_ms(100);
  double t0 = now_ms();
  ddp_store_destroy(srv);
  pthread_join(th, NULL);
  assert_int_equal(a.st, DDP_ERR_REMOTE);
  assert_true(a.t_end - t0 < DDP_TEST_BOUND_MS(250));
  assert_non_null(strstr(a.msg, "closed the connection"));
  t0 = now_ms();
  assert_int_equal(ddp_store_set(cli, "k", "v", 1), DDP_ERR_TIMEOUT);
  assert_true(now_ms() - t0 < 400 + TOLERANCE_MS);
  assert_non_null(strstr(last_msg(cli), "could not connect"));
  ddp_store_destroy(cli);
}

/* A process that holds the file store's lock delays add() only until the deadline
 * (DDP_ERR_TIMEOUT naming the lock file); once that process dies the kernel drops its
 * lock and add() proceeds. The holder is a plain child process that asserts nothing. */
static void test_file_lock_holder_dies(void **state) {
  (void)state;
  const char *dir = make_tmpdir();
  ddp_store_t *s = make_store(K_FILE, dir, 200);
  int pfd[2];
  assert_int_equal(pipe(pfd), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    char path[4200];
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) _exit(1);
    ssize_t w = write(pfd[1], "L", 1);
    (void)w;
    for (;;) pause();
  }
  close(pfd[1]);
  char c = 0;
  assert_int_equal(read(pfd[0], &c, 1), 1);
  close(pfd[0]);
  int64_t r = 0;
  double t0 = now_ms();
  assert_int_equal(ddp_store_add(s, "ctr", 1, &r), DDP_ERR_TIMEOUT);
  double dt = now_ms() - t0;
  assert_true(dt >= 195 && dt <= 200 + TOLERANCE_MS);
  assert_non_null(strstr(last_msg(s), ".lock"));
  kill(pid, SIGKILL);
  int wst;
  assert_int_equal(waitpid(pid, &wst, 0), pid);
  assert_int_equal(ddp_store_add(s, "ctr", 1, &r), DDP_OK);
  assert_int_equal(r, 1);
  ddp_store_destroy(s);
  remove_dir(dir);
}

typedef struct hammer {
  const char *dir;
  atomic_bool stop;
  atomic_long adds;
  ddp_status_t st;
} hammer_t;

/* Adds in a tight loop, so the lock is free only between one release and the next take. */
static void *hammer_adds(void *p) {
  hammer_t *h = p;
  ddp_store_options_t o = opts_ms(10000, "test-token");
  ddp_store_t *s = NULL;
  h->st = ddp_store_create_file(h->dir, &o, &s, NULL);
  int64_t r;
  while (h->st == DDP_OK && !atomic_load(&h->stop)) {
    h->st = ddp_store_add(s, "hot", 1, &r);
    atomic_fetch_add(&h->adds, 1);
  }
  if (s) ddp_store_destroy(s);
  return NULL;
}

/* A waiter for the file store's lock is not starved by a thread that re-takes it in a
 * loop: 2 such threads run while this thread does 30 adds with a 1 s timeout each. Found in
 * the soak (test_concurrent_add_threads_file under load: one of 8 threads timed out after
 * 10 s); with the lock polled with a backoff, the first add here timed out. */
static void test_file_lock_no_starvation(void **state) {
  (void)state;
  const char *dir = make_tmpdir();
  ddp_store_t *s = make_store(K_FILE, dir, 1000);
  hammer_t h[2];
  pthread_t t[2];
  for (int i = 0; i < 2; i++) {
    h[i].dir = dir;
    h[i].st = DDP_OK;
    atomic_init(&h[i].stop, false);
    atomic_init(&h[i].adds, 0);
    assert_int_equal(pthread_create(&t[i], NULL, hammer_adds, &h[i]), 0);
  }
  while (atomic_load(&h[0].adds) < 20 || atomic_load(&h[1].adds) < 20)
    usleep(1000); /* both hammering */
  double worst = 0;
  int ok = 0;
  ddp_status_t st = DDP_OK;
  for (int i = 0; i < 30 && st == DDP_OK; i++) {
    int64_t r;
    double t0 = now_ms();
    st = ddp_store_add(s, "mine", 1, &r);
    double dt = now_ms() - t0;
    if (dt > worst) worst = dt;
    if (st == DDP_OK)
      ok++;
    else
      print_message("add %d: %s\n", i, last_msg(s));
  }
  for (int i = 0; i < 2; i++) {
    atomic_store(&h[i].stop, true);
    pthread_join(t[i], NULL);
    assert_int_equal(h[i].st, DDP_OK);
  }
  printf("# file store: %d of 30 adds beside 2 looping writers (%ld, %ld adds); slowest "
         "%.1f ms\n",
         ok, atomic_load(&h[0].adds), atomic_load(&h[1].adds), worst);
  assert_int_equal(ok, 30);
  ddp_store_destroy(s);
  remove_dir(dir);
}

/* ---------------------------------------------------------------- prefix ---------- */

static void run_prefix(enum kind k) {
  const char *dir = k == K_FILE ? make_tmpdir() : NULL;
  ddp_store_t *s = make_store(k, dir, 2000);
  ddp_store_t *a = NULL, *b = NULL, *ax = NULL;
  assert_int_equal(ddp_store_create_prefix(s, "a", &a, NULL), DDP_OK);
  assert_int_equal(ddp_store_create_prefix(s, "b", &b, NULL), DDP_OK);
  assert_int_equal(ddp_store_create_prefix(a, "x", &ax, NULL), DDP_OK);
  assert_int_equal(ddp_store_set(a, "k", "in-a", 4), DDP_OK);
  assert_int_equal(ddp_store_set(b, "k", "in-b", 4), DDP_OK);
  assert_int_equal(ddp_store_set(ax, "k", "in-ax", 5), DDP_OK);
  int64_t r = 0;
  assert_int_equal(ddp_store_add(a, "n", 3, &r), DDP_OK);
  assert_int_equal(ddp_store_add(b, "n", 4, &r), DDP_OK);
  assert_int_equal(r, 4);
  expect_get(a, "k", "in-a", 4);
  expect_get(b, "k", "in-b", 4);
  expect_get(ax, "k", "in-ax", 5);
  /* the base sees the full names */
  expect_get(s, "a/k", "in-a", 4);
  expect_get(s, "b/k", "in-b", 4);
  expect_get(s, "a/x/k", "in-ax", 5);
  expect_get(s, "a/n", "3", 1);
  /* a key of one view is invisible in another */
  bool all = true;
  assert_int_equal(ddp_store_set(a, "only-a", "1", 1), DDP_OK);
  const char *oa[] = {"only-a"};
  assert_int_equal(ddp_store_check(b, oa, 1, &all), DDP_OK);
  assert_false(all);
  assert_int_equal(ddp_store_wait(b, oa, 1, 50), DDP_ERR_TIMEOUT);
  assert_non_null(strstr(last_msg(b), "'b/only-a'"));
  bool deleted = true;
  assert_int_equal(ddp_store_delete(b, "only-a", &deleted), DDP_OK);
  assert_false(deleted);
  expect_get(a, "only-a", "1", 1);
  ddp_store_destroy(ax);
  ddp_store_destroy(a);
  ddp_store_destroy(b);
  ddp_store_destroy(s);
  if (dir) remove_dir(dir);
}

/* Prefix views isolate sub-groups' keys on each kind. */
static void test_prefix_memory(void **state) {
  (void)state;
  run_prefix(K_MEMORY);
}
static void test_prefix_file(void **state) {
  (void)state;
  run_prefix(K_FILE);
}
static void test_prefix_tcp(void **state) {
  (void)state;
  run_prefix(K_TCP);
}

/* ---------------------------------------------------------------- connect retry --- */

typedef struct late_arg {
  int port;
  ddp_status_t st;
  double t_start, t_end; /* the client's creation call, from and to (now_ms) */
  ddp_store_t *s;
  atomic_int started;
} late_arg_t;

static void *late_client(void *p) {
  late_arg_t *a = p;
  ddp_store_options_t o = opts_ms(5000, "test-token");
  a->t_start = now_ms();
  atomic_store(&a->started, 1);
  a->st = ddp_store_create_tcp("127.0.0.1", a->port, false, &o, &a->s, NULL);
  a->t_end = now_ms();
  return NULL;
}

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  close(fd);
  return ntohs(sa.sin_port);
}

/* A client started 300 ms before its server connects once the server is up. The times
 * are taken where things happen (the client's start, the server's creation), not assumed
 * from the sleep: under load the client thread may start late. */
static void test_connect_retry(void **state) {
  (void)state;
  late_arg_t a = {.port = free_port(), .st = DDP_OK};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, late_client, &a), 0);
  while (!atomic_load(&a.started)) sleep_ms(1);
  sleep_ms(300);
  ddp_store_options_t o = opts_ms(5000, "test-token");
  ddp_store_t *srv = NULL;
  double t_server = now_ms();
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", a.port, true, &o, &srv, NULL), DDP_OK);
  pthread_join(th, NULL);
  assert_int_equal(a.st, DDP_OK);
  print_message("client from %.1f ms to %.1f ms, server created at %.1f ms (relative to the "
                "client's start)\n",
                0.0, a.t_end - a.t_start, t_server - a.t_start);
  assert_true(a.t_start + 250 <= t_server); /* the client did wait for a server */
  assert_true(a.t_end >= t_server);         /* and connected once it was up */
  assert_true(a.t_end - t_server < DDP_TEST_BOUND_MS(3000));
  assert_int_equal(ddp_store_set(a.s, "late", "yes", 3), DDP_OK);
  expect_get(srv, "late", "yes", 3);
  ddp_store_destroy(a.s);
  ddp_store_destroy(srv);

  /* with no server at all, creation fails with a timeout naming the address */
  ddp_store_options_t quick = opts_ms(300, "test-token");
  ddp_store_t *none = NULL;
  int port = free_port();
  log_reset();
  double t0 = now_ms();
  ddp_error_t cerr = {0};
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", port, false, &quick, &none, &cerr),
                   DDP_ERR_TIMEOUT);
  assert_true(now_ms() - t0 < 300 + TOLERANCE_MS);
  assert_null(none);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  assert_true(log_has(addr));
  assert_true(log_has("Connection refused"));
  assert_int_equal(cerr.status, DDP_ERR_TIMEOUT);
  assert_non_null(strstr(cerr.msg, addr));
  assert_non_null(strstr(cerr.msg, "attempts"));
}

/* ---------------------------------------------------------------- hostile bytes --- */

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  struct timeval tv = {3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

static void put32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Builds a request the way docs/rendezvous.md describes it (independently of wire.c). */
static size_t build_msg(unsigned char *buf, unsigned op, unsigned nf, const void *const *f,
                        const uint32_t *l) {
  size_t off = 12;
  for (unsigned i = 0; i < nf; i++) {
    put32(buf + off, l[i]);
    memcpy(buf + off + 4, f[i], l[i]);
    off += 4 + l[i];
  }
  memcpy(buf, "DDPS", 4);
  buf[4] = (unsigned char)op;
  buf[5] = (unsigned char)nf;
  buf[6] = buf[7] = 0;
  put32(buf + 8, (uint32_t)(off - 12));
  return off;
}

static void send_hello(int fd, const char *token) {
  unsigned char ver[4], buf[256];
  put32(ver, 1);
  const void *f[2] = {ver, token};
  uint32_t l[2] = {4, (uint32_t)strlen(token)};
  size_t n = build_msg(buf, 1, 2, f, l);
  assert_int_equal(send(fd, buf, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* Reads one reply; returns its status byte and copies its first field's text. */
static int read_reply(int fd, char *text, size_t cap) {
  unsigned char h[12];
  size_t got = 0;
  while (got < 12) {
    ssize_t r = recv(fd, h + got, 12 - got, 0);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  uint32_t body = (uint32_t)h[8] | (uint32_t)h[9] << 8 | (uint32_t)h[10] << 16 |
                  (uint32_t)h[11] << 24;
  unsigned char b[2048];
  if (body > sizeof b) return -2;
  got = 0;
  while (got < body) {
    ssize_t r = recv(fd, b + got, body - got, 0);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  text[0] = '\0';
  if (body >= 4) {
    size_t n = body - 4 < cap - 1 ? body - 4 : cap - 1;
    memcpy(text, b + 4, n);
    text[n] = '\0';
  }
  return h[4];
}

/* True when the server closes the connection (EOF or reset) within the receive timeout. */
static bool closed_by_server(int fd) {
  unsigned char b[256];
  for (;;) {
    ssize_t r = recv(fd, b, sizeof b, 0);
    if (r == 0) return true;
    if (r < 0) return errno == ECONNRESET;
  }
}

static int local_port(int fd) {
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  return ntohs(sa.sin_port);
}

/* The server still serves: its own client and a fresh one can set and get. */
static void expect_serving(ddp_store_t *srv, const char *key) {
  assert_int_equal(ddp_store_set(srv, key, key, strlen(key)), DDP_OK);
  ddp_store_options_t o = opts_ms(3000, "test-token");
  ddp_store_t *cli = NULL;
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", ddp_store_port(srv), false, &o, &cli, NULL),
                   DDP_OK);
  expect_get(cli, key, key, strlen(key));
  ddp_store_destroy(cli);
}

/* The server's warning names the peer (127.0.0.1:<its port>) and the reason. */
static void expect_logged(int peer_port, const char *reason) {
  char peer[64];
  snprintf(peer, sizeof peer, "127.0.0.1:%d", peer_port);
  double t0 = now_ms();
  while (!(log_has(peer) && log_has(reason)) && now_ms() - t0 < 2000) sleep_ms(5);
  assert_true(log_has(peer));
  assert_true(log_has(reason));
}

/* Garbage, an oversized length, an unknown op, a wrong token, a half-sent message: each
 * closes that connection only, with a log line naming the peer; a parked waiter and other
 * clients are served throughout. */
static void test_hostile_bytes(void **state) {
  (void)state;
  ddp_store_t *srv = make_store(K_TCP, NULL, 3000);
  int port = ddp_store_port(srv);

  /* a well-behaved client parked on a WAIT across all the abuse */
  int waiter = raw_connect(port);
  send_hello(waiter, "test-token");
  char text[1024];
  assert_int_equal(read_reply(waiter, text, sizeof text), DDP_OK);
  {
    unsigned char to[8] = {0x10, 0x27, 0, 0, 0, 0, 0, 0}; /* 10000 ms */
    const void *f[2] = {to, "late-key"};
    uint32_t l[2] = {8, 8};
    unsigned char buf[64];
    size_t n = build_msg(buf, 5, 2, f, l);
    assert_int_equal(send(waiter, buf, n, MSG_NOSIGNAL), (ssize_t)n);
  }

  /* 1. garbage before any hello */
  log_reset();
  int fd = raw_connect(port);
  unsigned char junk[64];
  memset(junk, 0xab, sizeof junk);
  assert_int_equal(send(fd, junk, sizeof junk, MSG_NOSIGNAL), (ssize_t)sizeof junk);
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "bad magic");
  close(fd);
  expect_serving(srv, "after-garbage");

  /* 2. an oversized length after a good hello: refused on the header alone */
  log_reset();
  fd = raw_connect(port);
  send_hello(fd, "test-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  unsigned char hdr[12];
  memcpy(hdr, "DDPS", 4);
  hdr[4] = 2; /* SET */
  hdr[5] = 2;
  hdr[6] = hdr[7] = 0;
  put32(hdr + 8, 0xfffffff0u);
  assert_int_equal(send(fd, hdr, sizeof hdr, MSG_NOSIGNAL), 12);
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "exceeds the limit");
  close(fd);

  /* a key length field larger than the key limit inside a small body */
  log_reset();
  fd = raw_connect(port);
  send_hello(fd, "test-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  {
    unsigned char m[64];
    memcpy(m, "DDPS", 4);
    m[4] = 8; /* DELETE */
    m[5] = 1;
    m[6] = m[7] = 0;
    put32(m + 8, 8);
    put32(m + 12, 5000); /* claims 5000 key bytes; body holds 4 */
    memcpy(m + 16, "abcd", 4);
    assert_int_equal(send(fd, m, 20, MSG_NOSIGNAL), 20);
  }
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "runs past the body end");
  close(fd);

  /* 3. an unknown op */
  log_reset();
  fd = raw_connect(port);
  send_hello(fd, "test-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  {
    unsigned char m[12];
    build_msg(m, 77, 0, NULL, NULL);
    assert_int_equal(send(fd, m, 12, MSG_NOSIGNAL), 12);
  }
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "unknown op 77");
  close(fd);
  expect_serving(srv, "after-oversize");

  /* 4. a wrong token: an error reply saying so, then the connection is closed */
  log_reset();
  fd = raw_connect(port);
  send_hello(fd, "wrong-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_ERR_INVALID_USAGE);
  assert_non_null(strstr(text, "rejected the job token"));
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "rejected the job token");
  close(fd);
  /* a request before hello is refused too */
  log_reset();
  fd = raw_connect(port);
  {
    const void *f[1] = {"k"};
    uint32_t l[1] = {1};
    unsigned char m[32];
    size_t n = build_msg(m, 8, 1, f, l);
    assert_int_equal(send(fd, m, n, MSG_NOSIGNAL), (ssize_t)n);
  }
  assert_true(closed_by_server(fd));
  expect_logged(local_port(fd), "not HELLO");
  close(fd);
  /* the library client with a wrong token: DDP_ERR_INVALID_USAGE, no retry loop */
  log_reset();
  ddp_store_options_t bad = opts_ms(3000, "not-the-token");
  ddp_store_t *cli = NULL;
  double t0 = now_ms();
  ddp_error_t cerr = {0};
  assert_int_equal(ddp_store_create_tcp("127.0.0.1", port, false, &bad, &cli, &cerr),
                   DDP_ERR_INVALID_USAGE);
  assert_true(now_ms() - t0 < DDP_TEST_BOUND_MS(1000));
  assert_null(cli);
  assert_true(log_has("rejected this client's job token"));
  assert_non_null(strstr(cerr.msg, "rejected this client's job token"));
  expect_serving(srv, "after-token");

  /* 5. half a message, then close */
  log_reset();
  fd = raw_connect(port);
  send_hello(fd, "test-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  {
    const void *f[2] = {"half-key", "value-value-value"};
    uint32_t l[2] = {8, 17};
    unsigned char m[64];
    size_t n = build_msg(m, 2, 2, f, l);
    assert_int_equal(send(fd, m, n - 10, MSG_NOSIGNAL), (ssize_t)(n - 10));
  }
  int lp = local_port(fd);
  sleep_ms(50);
  close(fd);
  expect_logged(lp, "mid-message");
  expect_serving(srv, "after-half");
  bool all = true;
  const char *hk[] = {"half-key"};
  assert_int_equal(ddp_store_check(srv, hk, 1, &all), DDP_OK);
  assert_false(all);

  /* 6. a valid request sent one byte at a time is served (fragmentation is not abuse) */
  fd = raw_connect(port);
  send_hello(fd, "test-token");
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  {
    const void *f[2] = {"slow-key", "slow-value"};
    uint32_t l[2] = {8, 10};
    unsigned char m[64];
    size_t n = build_msg(m, 2, 2, f, l);
    for (size_t i = 0; i < n; i++) {
      assert_int_equal(send(fd, m + i, 1, MSG_NOSIGNAL), 1);
      if (i % 8 == 0) sleep_ms(1);
    }
  }
  assert_int_equal(read_reply(fd, text, sizeof text), DDP_OK);
  close(fd);
  expect_get(srv, "slow-key", "slow-value", 10);

  /* the parked waiter is answered once its key arrives */
  assert_int_equal(ddp_store_set(srv, "late-key", "v", 1), DDP_OK);
  assert_int_equal(read_reply(waiter, text, sizeof text), DDP_OK);
  close(waiter);

  ddp_store_destroy(srv);
}

/* Requests pipelined behind a parked WAIT run once it is answered, and a key they set
 * wakes a waiter that connected later (one that the server visits earlier). */
static void test_pipelined_requests(void **state) {
  (void)state;
  ddp_store_t *srv = make_store(K_TCP, NULL, 3000);
  int port = ddp_store_port(srv);
  char text[1024];
  unsigned char to[8] = {0x10, 0x27, 0, 0, 0, 0, 0, 0}; /* 10000 ms */
  int p = raw_connect(port);
  send_hello(p, "test-token");
  assert_int_equal(read_reply(p, text, sizeof text), DDP_OK);
  int w = raw_connect(port);
  send_hello(w, "test-token");
  assert_int_equal(read_reply(w, text, sizeof text), DDP_OK);
  unsigned char buf[128];
  size_t n;
  {
    const void *f1[2] = {to, "p1"};
    uint32_t l1[2] = {8, 2};
    n = build_msg(buf, 5, 2, f1, l1); /* WAIT p1 */
    const void *f2[2] = {"p2", "two"};
    uint32_t l2[2] = {2, 3};
    n += build_msg(buf + n, 2, 2, f2, l2); /* then SET p2, in the same send */
    assert_int_equal(send(p, buf, n, MSG_NOSIGNAL), (ssize_t)n);
  }
  {
    const void *f[2] = {to, "p2"};
    uint32_t l[2] = {8, 2};
    n = build_msg(buf, 5, 2, f, l); /* WAIT p2 */
    assert_int_equal(send(w, buf, n, MSG_NOSIGNAL), (ssize_t)n);
  }
  sleep_ms(50);
  double t0 = now_ms();
  assert_int_equal(ddp_store_set(srv, "p1", "one", 3), DDP_OK);
  assert_int_equal(read_reply(p, text, sizeof text), DDP_OK); /* the WAIT */
  assert_int_equal(read_reply(p, text, sizeof text), DDP_OK); /* the SET behind it */
  assert_int_equal(read_reply(w, text, sizeof text), DDP_OK);
  assert_true(now_ms() - t0 < DDP_TEST_BOUND_MS(1000));
  expect_get(srv, "p2", "two", 3);
  close(p);
  close(w);
  ddp_store_destroy(srv);
}

/* ---------------------------------------------------------------- wire parser ----- */

/* Parses a whole request buffer with the server's two steps; true when accepted. Every
 * accepted field must lie inside the body. */
static bool parse_request(const unsigned char *buf, size_t n, ddp__wire_msg_t *m) {
  char why[200];
  ddp__wire_hdr_t h;
  if (n < DDP__WIRE_HDR || !ddp__wire_parse_request_hdr(buf, &h, why, sizeof why)) return false;
  if (n - DDP__WIRE_HDR < h.body_len) return false;
  if (!ddp__wire_parse_body(&h, buf + DDP__WIRE_HDR, true, m, why, sizeof why)) return false;
  const unsigned char *b0 = buf + DDP__WIRE_HDR, *b1 = b0 + h.body_len;
  for (unsigned i = 0; i < m->nfields; i++) {
    assert_true(m->field[i] >= b0 && m->field[i] + m->len[i] <= b1);
  }
  return true;
}

/* Valid requests of every op round-trip through build and parse; 20000 seeded mutations of
 * them are either refused or parse into fields inside the body (run it under ASan). */
static void test_wire_parser(void **state) {
  (void)state;
  unsigned char ver[4] = {1, 0, 0, 0}, to[8] = {100, 0, 0, 0, 0, 0, 0, 0};
  struct {
    unsigned op, nf;
    const void *f[3];
    uint32_t l[3];
  } reqs[] = {
      {DDP__OP_HELLO, 2, {ver, "tok"}, {4, 3}},
      {DDP__OP_SET, 2, {"key", "value"}, {3, 5}},
      {DDP__OP_GET, 2, {"key", to}, {3, 8}},
      {DDP__OP_ADD, 2, {"key", to}, {3, 8}},
      {DDP__OP_WAIT, 3, {to, "a", "bb"}, {8, 1, 2}},
      {DDP__OP_CHECK, 2, {"a", "bb"}, {1, 2}},
      {DDP__OP_CSET, 3, {"key", "", "new"}, {3, 0, 3}},
      {DDP__OP_DELETE, 1, {"key"}, {3}},
      {DDP__OP_NUMKEYS, 0, {NULL}, {0}},
  };
  ddp__wire_msg_t *m = malloc(sizeof *m);
  ddp_rng_t rng;
  ddp_rng_init(&rng, 1234, ddp_rng_stream(DDP_RNG_TEST, 0, 0));
  size_t accepted = 0, refused = 0;
  for (size_t k = 0; k < sizeof reqs / sizeof reqs[0]; k++) {
    unsigned char *buf;
    size_t n;
    assert_int_equal(ddp__wire_build(reqs[k].op, reqs[k].nf, reqs[k].f, reqs[k].l, &buf, &n),
                     DDP_OK);
    assert_true(parse_request(buf, n, m));
    assert_int_equal(m->op, reqs[k].op);
    assert_int_equal(m->nfields, reqs[k].nf);
    for (unsigned i = 0; i < reqs[k].nf; i++) {
      assert_int_equal(m->len[i], reqs[k].l[i]);
      if (reqs[k].l[i]) assert_memory_equal(m->field[i], reqs[k].f[i], reqs[k].l[i]);
    }
    /* a wrong field size for the op is refused (ADD's delta must be 8 bytes) */
    if (reqs[k].op == DDP__OP_ADD) {
      unsigned char *bad;
      size_t bn;
      uint32_t l2[2] = {3, 7};
      assert_int_equal(ddp__wire_build(DDP__OP_ADD, 2, reqs[k].f, l2, &bad, &bn), DDP_OK);
      assert_false(parse_request(bad, bn, m));
      ddp__free(bad);
    }
    unsigned char *mut = malloc(n + 16);
    for (int t = 0; t < 20000 / (int)(sizeof reqs / sizeof reqs[0]); t++) {
      memcpy(mut, buf, n);
      size_t mn = n;
      int edits = 1 + (int)(ddp_rng_u32(&rng) % 3);
      for (int e = 0; e < edits; e++) {
        uint32_t r = ddp_rng_u32(&rng);
        switch (r % 3) {
          case 0: mut[r / 3 % mn] = (unsigned char)(r >> 16); break; /* flip a byte */
          case 1:
            if (mn > 1) mn = 1 + (r / 3) % (mn - 1);
            break; /* truncate */
          default: mut[r / 3 % mn] ^= (unsigned char)(1u << (r >> 20) % 8); break;
        }
      }
      if (parse_request(mut, mn, m))
        accepted++;
      else
        refused++;
    }
    free(mut);
    ddp__free(buf);
  }
  printf("# wire parser mutations: %zu accepted, %zu refused\n", accepted, refused);
  assert_true(refused > 0);
  free(m);
}

/* ---------------------------------------------------------------- leaks ----------- */

/* Creating, using, cancelling and destroying every kind leaves no fd and no allocation. */
static void test_no_leaks(void **state) {
  (void)state;
  /* warm up lazily created process state (resolver, log) before counting */
  ddp_store_t *warm = make_store(K_TCP, NULL, 2000);
  ddp_store_destroy(warm);
  int fds0 = count_fds();
  int64_t live0 = ddp_test_live_allocs();
  for (int k = K_MEMORY; k <= K_TCP; k++) {
    const char *dir = k == K_FILE ? make_tmpdir() : NULL;
    ddp_store_t *s = make_store((enum kind)k, dir, 2000);
    ddp_store_t *v = NULL;
    assert_int_equal(ddp_store_create_prefix(s, "p", &v, NULL), DDP_OK);
    int64_t r;
    assert_int_equal(ddp_store_add(v, "c", 1, &r), DDP_OK);
    const char *keys[] = {"missing"};
    assert_int_equal(ddp_store_wait(v, keys, 1, 20), DDP_ERR_TIMEOUT);
    cancel_arg_t a;
    cancel_while_blocked(v, v, &a);
    assert_int_equal(a.st, DDP_ERR_ABORTED);
    ddp_store_destroy(v);
    ddp_store_destroy(s);
    if (dir) remove_dir(dir);
    printf("# %s store: fds %d -> %d, live allocations %lld -> %lld\n", kind_names[k], fds0,
           count_fds(), (long long)live0, (long long)ddp_test_live_allocs());
  }
  assert_int_equal(count_fds(), fds0);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

int main(void) {
  ddp_set_log_sink(capture_sink, NULL);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_memory),
      cmocka_unit_test(test_ops_file),
      cmocka_unit_test(test_ops_tcp),
      cmocka_unit_test(test_second_handle_sees_keys),
      cmocka_unit_test(test_concurrent_add_threads_memory),
      cmocka_unit_test(test_concurrent_add_threads_tcp),
      cmocka_unit_test(test_concurrent_add_threads_file),
      cmocka_unit_test(test_concurrent_add_fork_file),
      cmocka_unit_test(test_concurrent_add_fork_tcp),
      cmocka_unit_test(test_timeout_memory),
      cmocka_unit_test(test_timeout_file),
      cmocka_unit_test(test_timeout_tcp),
      cmocka_unit_test(test_wake_memory),
      cmocka_unit_test(test_wake_file),
      cmocka_unit_test(test_wake_tcp),
      cmocka_unit_test(test_token_from_env),
      cmocka_unit_test(test_local_addr),
      cmocka_unit_test(test_many_keys_memory),
      cmocka_unit_test(test_many_keys_file),
      cmocka_unit_test(test_many_keys_tcp),
      cmocka_unit_test(test_server_gone),
      cmocka_unit_test(test_file_lock_holder_dies),
      cmocka_unit_test(test_file_lock_no_starvation),
      cmocka_unit_test(test_cancel_memory),
      cmocka_unit_test(test_cancel_file),
      cmocka_unit_test(test_cancel_tcp),
      cmocka_unit_test(test_prefix_memory),
      cmocka_unit_test(test_prefix_file),
      cmocka_unit_test(test_prefix_tcp),
      cmocka_unit_test(test_connect_retry),
      cmocka_unit_test(test_hostile_bytes),
      cmocka_unit_test(test_pipelined_requests),
      cmocka_unit_test(test_wire_parser),
      cmocka_unit_test(test_no_leaks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
