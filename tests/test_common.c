/* Tests of the common layer: status names, error recording and logging, debug levels,
 * environment parsing and its documentation, the allocator and its counters, clocks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <limits.h>

#include <cmocka.h>

#include "common/common.h"
#include "ddp/tensor.h"
#include "harness.h"

/* ---------------------------------------------------------------- helpers --------- */

/* Saves and restores the variables the tests change, so no test leaks into the next. */
static const char *const touched_vars[] = {"DDP_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "DDP_TIMEOUT",
                                           "RANK", "MASTER_PORT"};
static char *saved_vars[DDP_ARRAY_LEN(touched_vars)];

static int save_env(void **state) {
  (void)state;
  for (size_t i = 0; i < DDP_ARRAY_LEN(touched_vars); i++) {
    const char *v = getenv(touched_vars[i]);
    saved_vars[i] = v ? strdup(v) : NULL;
    unsetenv(touched_vars[i]);
  }
  return 0;
}

static int restore_env(void **state) {
  (void)state;
  for (size_t i = 0; i < DDP_ARRAY_LEN(touched_vars); i++) {
    if (saved_vars[i]) {
      setenv(touched_vars[i], saved_vars[i], 1);
      free(saved_vars[i]);
      saved_vars[i] = NULL;
    } else {
      unsetenv(touched_vars[i]);
    }
  }
  return 0;
}

/* A log sink that keeps the lines it is given. */
typedef struct captured {
  int n;
  ddp_log_level_t level[16];
  char line[16][1024];
} captured_t;

static void capture_sink(void *user, ddp_log_level_t level, const char *line) {
  captured_t *c = user;
  if (c->n < 16) {
    c->level[c->n] = level;
    snprintf(c->line[c->n], sizeof c->line[c->n], "%s", line);
  }
  c->n++;
}

/* ---------------------------------------------------------------- status ---------- */

/* Every code of DDP_STATUS_MAP has its DDP_ERR_ name and its text; DDP_OK is "DDP_OK";
 * values outside the list have the unknown name and text. */
static void test_status_names(void **state) {
  (void)state;
  int n = 1;
  assert_int_equal(DDP_OK, 0);
  assert_string_equal(ddp_status_name(DDP_OK), "DDP_OK");
  assert_string_equal(ddp_status_str(DDP_OK), "success");
#define CHECK_(name, text)                                     \
  do {                                                         \
    ddp_status_t s = DDP_ERR_##name;                           \
    assert_int_equal((int)s, n);                               \
    assert_string_equal(ddp_status_name(s), "DDP_ERR_" #name); \
    assert_string_equal(ddp_status_str(s), text);              \
    n++;                                                       \
  } while (0);
  DDP_STATUS_MAP(CHECK_)
#undef CHECK_
  assert_int_equal(n, DDP_STATUS_COUNT_);
  assert_string_equal(ddp_status_name(DDP_ERR_TIMEOUT), "DDP_ERR_TIMEOUT");
  assert_string_equal(ddp_status_str(DDP_ERR_TIMEOUT), "timed out");
  ddp_status_t bad[] = {DDP_STATUS_COUNT_, (ddp_status_t)-1, (ddp_status_t)999};
  for (size_t i = 0; i < DDP_ARRAY_LEN(bad); i++) {
    assert_string_equal(ddp_status_name(bad[i]), "DDP_ERR_UNKNOWN");
    assert_string_equal(ddp_status_str(bad[i]), "unknown status");
  }
}

/* ddp__error fills err, returns the status and logs exactly one line with the rank
 * prefix; the quiet variant fills without logging; clear resets. */
static void test_error_and_log_sink(void **state) {
  (void)state;
  captured_t cap = {0};
  ddp_set_log_sink(capture_sink, &cap);
  ddp_error_t err;
  ddp__error_clear(&err);
  assert_int_equal(err.status, DDP_OK);
  assert_string_equal(err.msg, "");

  ddp_status_t st = ddp__error(&err, 3, DDP_ERR_TIMEOUT, "recv from rank %d after %d ms", 1, 250);
  assert_int_equal(st, DDP_ERR_TIMEOUT);
  assert_int_equal(err.status, DDP_ERR_TIMEOUT);
  assert_string_equal(err.msg, "recv from rank 1 after 250 ms");
  assert_int_equal(cap.n, 1);
  assert_int_equal(cap.level[0], DDP_LOG_ERROR);
  assert_string_equal(cap.line[0],
                      "[rank3] libddp ERROR: DDP_ERR_TIMEOUT: recv from rank 1 after 250 ms");

  /* No handle: still logged once; no rank: no prefix. */
  st = ddp__error(NULL, -1, DDP_ERR_SYSTEM, "open(%s): %s", "/x", "No such file");
  assert_int_equal(st, DDP_ERR_SYSTEM);
  assert_int_equal(cap.n, 2);
  assert_string_equal(cap.line[1], "libddp ERROR: DDP_ERR_SYSTEM: open(/x): No such file");

  st = ddp__error_quiet(&err, DDP_ERR_NOT_FOUND, "key %s", "k");
  assert_int_equal(st, DDP_ERR_NOT_FOUND);
  assert_int_equal(err.status, DDP_ERR_NOT_FOUND);
  assert_string_equal(err.msg, "key k");
  assert_int_equal(cap.n, 2);
  assert_int_equal(ddp__error_quiet(NULL, DDP_ERR_NOT_FOUND, "x"), DDP_ERR_NOT_FOUND);

  /* A message longer than the buffer is truncated, terminated. */
  char big[DDP_ERROR_MSG_MAX * 2];
  memset(big, 'a', sizeof big - 1);
  big[sizeof big - 1] = 0;
  ddp__error(&err, 0, DDP_ERR_INTERNAL, "%s", big);
  assert_int_equal(strlen(err.msg), DDP_ERROR_MSG_MAX - 1);

  ddp__error_clear(&err);
  assert_int_equal(err.status, DDP_OK);
  assert_string_equal(err.msg, "");
  ddp__error_clear(NULL);
  ddp_set_log_sink(NULL, NULL);
}

/* Level parsing: OFF/unknown -> WARN, INFO, DETAIL (any case); DDP_DEBUG wins over
 * TORCH_DISTRIBUTED_DEBUG, which is read when DDP_DEBUG is unset or empty; the logger
 * filters INFO and DETAIL lines by the level. */
static void test_debug_levels(void **state) {
  (void)state;
  assert_int_equal(ddp_log_level_from_env(), DDP_LOG_WARN);
  static const struct {
    const char *v;
    ddp_log_level_t want;
  } cases[] = {{"OFF", DDP_LOG_WARN},      {"INFO", DDP_LOG_INFO},     {"info", DDP_LOG_INFO},
               {"DETAIL", DDP_LOG_DETAIL}, {"Detail", DDP_LOG_DETAIL}, {"bogus", DDP_LOG_WARN}};
  for (size_t i = 0; i < DDP_ARRAY_LEN(cases); i++) {
    setenv("DDP_DEBUG", cases[i].v, 1);
    assert_int_equal(ddp_log_level_from_env(), cases[i].want);
    unsetenv("DDP_DEBUG");
    setenv("TORCH_DISTRIBUTED_DEBUG", cases[i].v, 1);
    assert_int_equal(ddp_log_level_from_env(), cases[i].want);
    unsetenv("TORCH_DISTRIBUTED_DEBUG");
  }
  /* Precedence. */
  setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  setenv("DDP_DEBUG", "OFF", 1);
  assert_int_equal(ddp_log_level_from_env(), DDP_LOG_WARN);
  setenv("DDP_DEBUG", "INFO", 1);
  assert_int_equal(ddp_log_level_from_env(), DDP_LOG_INFO);
  setenv("DDP_DEBUG", "", 1);
  assert_int_equal(ddp_log_level_from_env(), DDP_LOG_DETAIL);

  /* Filtering through the sink. */
  captured_t cap = {0};
  ddp_set_log_sink(capture_sink, &cap);
  unsetenv("TORCH_DISTRIBUTED_DEBUG");
  unsetenv("DDP_DEBUG");
  ddp__log(0, DDP_LOG_INFO, "info %d", 1);
  ddp__log(0, DDP_LOG_DETAIL, "detail %d", 1);
  ddp__log(0, DDP_LOG_WARN, "warn %d", 1);
  assert_int_equal(cap.n, 1);
  assert_string_equal(cap.line[0], "[rank0] libddp WARN: warn 1");
  setenv("DDP_DEBUG", "INFO", 1);
  ddp__log(1, DDP_LOG_INFO, "info %d", 2);
  ddp__log(1, DDP_LOG_DETAIL, "detail %d", 2);
  assert_int_equal(cap.n, 2);
  assert_string_equal(cap.line[1], "[rank1] libddp INFO: info 2");
  setenv("DDP_DEBUG", "DETAIL", 1);
  ddp__log(2, DDP_LOG_DETAIL, "detail %d", 3);
  assert_int_equal(cap.n, 3);
  assert_string_equal(cap.line[2], "[rank2] libddp DETAIL: detail 3");
  assert_true(ddp__log_enabled(DDP_LOG_DETAIL));
  unsetenv("DDP_DEBUG");
  assert_false(ddp__log_enabled(DDP_LOG_INFO));
  assert_true(ddp__log_enabled(DDP_LOG_ERROR));
  ddp_set_log_sink(NULL, NULL);
}

/* ---------------------------------------------------------------- environment ----- */

/* Defaults, set values, and malformed or out-of-range values rejected with a message
 * naming the variable, its value and the range. */
static void test_env_int(void **state) {
  (void)state;
  captured_t cap = {0};
  ddp_set_log_sink(capture_sink, &cap);
  int64_t v = -7;
  ddp_error_t err;
  ddp__error_clear(&err);
  assert_int_equal(ddp_env_int(DDP_ENV_TIMEOUT, 1, 100000, &v, &err), DDP_OK);
  assert_int_equal(v, 1800);
  assert_false(ddp_env_is_set(DDP_ENV_TIMEOUT));
  assert_string_equal(ddp_env_get(DDP_ENV_TIMEOUT), "1800");
  setenv("DDP_TIMEOUT", "42", 1);
  assert_true(ddp_env_is_set(DDP_ENV_TIMEOUT));
  assert_int_equal(ddp_env_int(DDP_ENV_TIMEOUT, 1, 100000, &v, &err), DDP_OK);
  assert_int_equal(v, 42);
  setenv("DDP_TIMEOUT", "-5", 1);
  assert_int_equal(ddp_env_int(DDP_ENV_TIMEOUT, -10, 10, &v, &err), DDP_OK);
  assert_int_equal(v, -5);
  /* Empty means unset: the default. */
  setenv("DDP_TIMEOUT", "", 1);
  assert_false(ddp_env_is_set(DDP_ENV_TIMEOUT));
  assert_int_equal(ddp_env_int(DDP_ENV_TIMEOUT, 1, 100000, &v, &err), DDP_OK);
  assert_int_equal(v, 1800);

  static const char *const bad[] = {"abc",    "12x", "1.5", "0x10", "99999999999999999999",
                                    "100001", "0",   "-1"};
  for (size_t i = 0; i < DDP_ARRAY_LEN(bad); i++) {
    setenv("DDP_TIMEOUT", bad[i], 1);
    v = 1234;
    cap.n = 0;
    assert_int_equal(ddp_env_int(DDP_ENV_TIMEOUT, 1, 100000, &v, &err), DDP_ERR_INVALID_ARGUMENT);
    assert_int_equal(v, 1234); /* untouched */
    assert_int_equal(err.status, DDP_ERR_INVALID_ARGUMENT);
    char want[128];
    snprintf(want, sizeof want, "DDP_TIMEOUT=\"%s\"", bad[i]);
    assert_non_null(strstr(err.msg, want));
    assert_non_null(strstr(err.msg, "[1, 100000]"));
    assert_int_equal(cap.n, 1); /* logged once */
  }
  /* A variable with an empty default and no value is not an integer. */
  assert_int_equal(ddp_env_int(DDP_ENV_RANK, 0, 1000, &v, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "RANK"));
  setenv("RANK", "3", 1);
  assert_int_equal(ddp_env_int(DDP_ENV_RANK, 0, 1000, &v, NULL), DDP_OK);
  assert_int_equal(v, 3);
  /* Full int64 range. */
  setenv("MASTER_PORT", "9223372036854775807", 1);
  assert_int_equal(ddp_env_int(DDP_ENV_MASTER_PORT, INT64_MIN, INT64_MAX, &v, NULL), DDP_OK);
  assert_int_equal(v, INT64_MAX);
  ddp_set_log_sink(NULL, NULL);
}

/* Names, defaults and docs come from DDP_ENV_MAP. */
static void test_env_table(void **state) {
  (void)state;
  int n = 0;
#define CHECK_(id, name, def, doc)                           \
  do {                                                       \
    assert_int_equal(DDP_ENV_##id, n);                       \
    assert_string_equal(ddp_env_name(DDP_ENV_##id), name);   \
    assert_string_equal(ddp_env_default(DDP_ENV_##id), def); \
    assert_string_equal(ddp_env_doc(DDP_ENV_##id), doc);     \
    n++;                                                     \
  } while (0);
  DDP_ENV_MAP(CHECK_)
#undef CHECK_
  assert_int_equal(n, DDP_ENV_COUNT_);
}

/* docs/environment.md lists exactly the variables of DDP_ENV_MAP, with their defaults.
 * A table row is "| `NAME` | `default` or (none) | meaning |". */
static void test_env_documented(void **state) {
  (void)state;
  const char *root = ddp_test_source_root();
  assert_non_null(root);
  char path[1024];
  snprintf(path, sizeof path, "%s/docs/environment.md", root);
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("cannot open %s", path);
  bool seen[DDP_ENV_COUNT_] = {0};
  char line[2048];
  int rows = 0;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "| `", 3) != 0) continue;
    char name[128], def[128];
    const char *p = line + 3;
    const char *e = strchr(p, '`');
    assert_non_null(e);
    snprintf(name, sizeof name, "%.*s", (int)(e - p), p);
    const char *d = strchr(e, '|');
    assert_non_null(d);
    d++;
    while (*d == ' ') d++;
    if (strncmp(d, "(none)", 6) == 0) {
      def[0] = 0;
    } else {
      if (*d != '`') fail_msg("row %s: default not in backquotes", name);
      const char *de = strchr(d + 1, '`');
      assert_non_null(de);
      snprintf(def, sizeof def, "%.*s", (int)(de - d - 1), d + 1);
    }
    rows++;
    int found = -1;
    for (int i = 0; i < DDP_ENV_COUNT_; i++)
      if (strcmp(ddp_env_name((ddp_env_id_t)i), name) == 0) found = i;
    if (found < 0) fail_msg("docs/environment.md lists %s, which DDP_ENV_MAP lacks", name);
    if (seen[found]) fail_msg("docs/environment.md lists %s twice", name);
    seen[found] = true;
    if (strcmp(def, ddp_env_default((ddp_env_id_t)found)) != 0)
      fail_msg("%s: docs say default \"%s\", DDP_ENV_MAP says \"%s\"", name, def,
               ddp_env_default((ddp_env_id_t)found));
  }
  fclose(f);
  for (int i = 0; i < DDP_ENV_COUNT_; i++)
    if (!seen[i])
      fail_msg("DDP_ENV_MAP has %s, missing from docs/environment.md",
               ddp_env_name((ddp_env_id_t)i));
  assert_int_equal(rows, DDP_ENV_COUNT_);
}

/* ---------------------------------------------------------------- allocator ------- */

/* Tensor allocation and release through CMocka's allocator: a leak or a double free here
 * fails the test (CMocka checks its blocks at the end of each test). */
static void test_cmocka_allocator(void **state) {
  (void)state;
  ddp_test_use_cmocka_allocator();
  for (int i = 0; i < 20; i++) {
    ddp_tensor_t t;
    int64_t shape[2] = {i + 1, 37};
    assert_int_equal(ddp_tensor_alloc(&t, DDP_F32, 2, shape), DDP_OK);
    assert_int_equal((uintptr_t)t.data % 64, 0);
    ((float *)t.data)[t.numel - 1] = 1.0f;
    ddp_tensor_free(&t);
  }
  char *s = ddp__strdup("libddp");
  assert_string_equal(s, "libddp");
  s = ddp__realloc(s, 100);
  assert_string_equal(s, "libddp");
  ddp__free(s);
  void *p = ddp__calloc(0, 0);
  assert_non_null(p);
  ddp__free(p);
  ddp_test_use_default_allocator();
}

/* A replaced allocator sees every request and its counters move with them. */
typedef struct counting {
  int mallocs, callocs, reallocs, frees;
} counting_t;

static void *c_malloc(void *u, size_t n) {
  ((counting_t *)u)->mallocs++;
  return malloc(n);
}
static void *c_calloc(void *u, size_t n, size_t s) {
  ((counting_t *)u)->callocs++;
  return calloc(n, s);
}
static void *c_realloc(void *u, void *p, size_t n) {
  ((counting_t *)u)->reallocs++;
  return realloc(p, n);
}
static void c_free(void *u, void *p) {
  ((counting_t *)u)->frees++;
  free(p);
}

static void test_alloc_routing_and_stats(void **state) {
  (void)state;
  counting_t c = {0};
  ddp_allocator_t a = {c_malloc, c_calloc, c_realloc, c_free, &c};
  ddp_set_allocator(&a);
  ddp_alloc_stats_t s0, s1;
  ddp_alloc_stats(&s0);
  void *p = ddp__malloc(10);
  void *q = ddp__calloc(3, 4);
  void *r = ddp__realloc(NULL, 5); /* counts as an allocation */
  r = ddp__realloc(r, 500);        /* a resize: not a new allocation */
  void *al = ddp_malloc(100);
  ddp__free(NULL); /* not counted */
  ddp_alloc_stats(&s1);
  assert_int_equal(s1.allocs - s0.allocs, 4);
  assert_int_equal(s1.frees - s0.frees, 0);
  ddp__free(p);
  ddp__free(q);
  ddp__free(r);
  ddp_free(al);
  ddp_free(NULL);
  ddp_alloc_stats(&s1);
  assert_int_equal(s1.allocs - s0.allocs, 4);
  assert_int_equal(s1.frees - s0.frees, 4);
  ddp_set_allocator(NULL);
  assert_int_equal(c.mallocs, 3); /* malloc, realloc(NULL), aligned */
  assert_int_equal(c.callocs, 1);
  assert_int_equal(c.reallocs, 1);
  assert_int_equal(c.frees, 4);
  /* Restored: the counting allocator sees nothing more. */
  p = ddp__malloc(1);
  ddp__free(p);
  assert_int_equal(c.mallocs, 3);
  assert_int_equal(ddp_test_live_allocs(), (int64_t)(s1.allocs - s1.frees) + 0);
}

/* The counters are exact under concurrent use (8 threads x 5000 pairs). */
static int alloc_worker(ddp_test_rank_t *r, void *arg) {
  (void)r;
  (void)arg;
  for (int i = 0; i < 5000; i++) {
    void *p = ddp__malloc((size_t)(i % 100) + 1);
    if (!p) return DDP_ERR_NO_MEMORY;
    ddp__free(p);
  }
  return DDP_OK;
}

static void test_alloc_stats_threads(void **state) {
  (void)state;
  ddp_alloc_stats_t s0, s1;
  ddp_alloc_stats(&s0);
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 8;
  ddp_test_results_t *res = ddp_test_spawn(&o, alloc_worker, NULL);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  ddp_alloc_stats(&s1);
  assert_int_equal(s1.allocs - s0.allocs, 8 * 5000);
  assert_int_equal(s1.frees - s0.frees, 8 * 5000);
}

/* Aligned blocks are 64-byte aligned for every size, writable end to end (ASan checks the
 * bounds), and an impossible size is refused. */
static void test_aligned(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  for (size_t n = 0; n < 300; n++) {
    unsigned char *p = ddp_malloc(n);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    memset(p, 0x5a, n);
    unsigned char *q = ddp__aligned_alloc(n * 7 + 1);
    assert_int_equal((uintptr_t)q % 64, 0);
    memset(q, 0xa5, n * 7 + 1);
    for (size_t i = 0; i < n; i++) assert_int_equal(p[i], 0x5a);
    ddp__aligned_free(q);
    ddp_free(p);
  }
  assert_null(ddp__aligned_alloc(SIZE_MAX));
  assert_null(ddp__aligned_alloc(SIZE_MAX - 64));
  ddp__aligned_free(NULL);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- clock ----------- */

static int64_t ref_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ddp_now_ns is CLOCK_MONOTONIC (bracketed by direct reads) and never goes back. */
static void test_clock_monotonic(void **state) {
  (void)state;
  int64_t prev = ddp_now_ns();
  for (int i = 0; i < 100000; i++) {
    int64_t a = ref_now_ns();
    int64_t t = ddp_now_ns();
    int64_t b = ref_now_ns();
    assert_true(a <= t && t <= b);
    assert_true(t >= prev);
    prev = t;
  }
  int64_t t0 = ddp_now_ns();
  struct timespec ts = {0, 20 * 1000000};
  nanosleep(&ts, NULL);
  int64_t dt = ddp_now_ns() - t0;
  assert_true(dt >= 20 * 1000000);
}

/* Deadlines: negative = none (INT64_MAX, INT_MAX ms left), saturation, rounding up of the
 * remaining milliseconds, 0 once passed. */
static void test_deadlines(void **state) {
  (void)state;
  assert_int_equal(ddp_deadline_after_ms(-1), INT64_MAX);
  assert_int_equal(ddp_deadline_after_ms(INT64_MIN), INT64_MAX);
  assert_int_equal(ddp_ms_until(INT64_MAX), INT_MAX);
  assert_int_equal(ddp_deadline_after_ms(INT64_MAX), INT64_MAX);
  assert_int_equal(ddp_deadline_after_ms(INT64_MAX / 1000000), INT64_MAX);

  int64_t a = ref_now_ns();
  int64_t d = ddp_deadline_after_ms(60000);
  int64_t b = ref_now_ns();
  assert_true(d >= a + 60000 * 1000000LL && d <= b + 60000 * 1000000LL);
  int left = ddp_ms_until(d);
  assert_true(left > 0 && left <= 60000);

  int64_t z = ddp_deadline_after_ms(0);
  assert_true(z >= a && z <= ref_now_ns());
  assert_int_equal(ddp_ms_until(z), 0);
  assert_int_equal(ddp_ms_until(ref_now_ns() - 1000000000LL), 0);
  /* 1.5 ms ahead rounds up to 2 (poll() must not wake early and spin). */
  int up = ddp_ms_until(ref_now_ns() + 1500000);
  assert_in_range(up, 1, 2);
  /* Far future beyond INT_MAX ms clamps. */
  assert_int_equal(ddp_ms_until(ref_now_ns() + (int64_t)100 * 86400 * 1000000000LL), INT_MAX);
  /* The deadline expires. */
  int64_t e = ddp_deadline_after_ms(30);
  struct timespec ts = {0, 35 * 1000000};
  nanosleep(&ts, NULL);
  assert_int_equal(ddp_ms_until(e), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_names),
      cmocka_unit_test_setup_teardown(test_error_and_log_sink, save_env, restore_env),
      cmocka_unit_test_setup_teardown(test_debug_levels, save_env, restore_env),
      cmocka_unit_test_setup_teardown(test_env_int, save_env, restore_env),
      cmocka_unit_test(test_env_table),
      cmocka_unit_test(test_env_documented),
      cmocka_unit_test(test_cmocka_allocator),
      cmocka_unit_test(test_alloc_routing_and_stats),
      cmocka_unit_test(test_alloc_stats_threads),
      cmocka_unit_test(test_aligned),
      cmocka_unit_test(test_clock_monotonic),
      cmocka_unit_test(test_deadlines),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
