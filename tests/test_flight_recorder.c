/* The flight recorder and its analyzer (docs/errors.md, "Flight recorder"), suite coll.
 *
 *  - the ring keeps the last N collectives with their sequence numbers, sizes, dtypes,
 *    states and times, and wraps (DDP_FR_BUFFER_SIZE, TORCH_NCCL_TRACE_BUFFER_SIZE, 0 = off);
 *  - work the group never ran, because it had failed, stays "scheduled";
 *  - a stalled rank (threads, shm, tcp; 1.5 s timeout): every rank leaves a dump, the stalled
 *    one from the trigger file while it still stands outside the collective, and
 *    tools/programs/ddp-fr-trace names it and the collective number it never entered;
 *  - a mismatched collective (desync): the analyzer names the rank whose #k differs;
 *  - a killed rank (shm): the analyzer names the rank that left no dump, also when a slow
 *    survivor issued the collective only after the group had failed (written dumps);
 *  - SIGUSR1 dumps while the job runs (a forked rank on shm; every group of a threads job),
 *    and the job goes on;
 *  - DDP's bucket allreduce carries the bucket index and its parameter names; with
 *    world_size_invariant_shards so do both of the bucket's collectives (MAX, then SUM);
 *  - ddp-train --ddp_trace FILE writes every rank's Perfetto/Chrome timeline.
 * Every case runs in a fresh /tmp/ddp-test-fr-* directory, removed afterwards. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <ftw.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/nn.h"
#include "ddp/pg.h"
#include "ddp/reducer.h"
#include "ddp/store.h"
#include "harness.h"
#include "proc.h"

/* ---------------------------------------------------------------- helpers --------- */

static void make_dir(char *buf, size_t n) {
  snprintf(buf, n, "/tmp/ddp-test-fr-XXXXXX");
  ddp_test_mkdtemp(buf); /* removed at exit, also on failure */
}

static int remove_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(p);
}

/* Removes dir and everything under it. */
static void remove_dir(const char *dir) { nftw(dir, remove_one, 16, FTW_DEPTH | FTW_PHYS); }

static cJSON *read_json(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    print_error("cannot open %s\n", path);
    return NULL;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *text = malloc((size_t)n + 1);
  assert_non_null(text);
  size_t got = fread(text, 1, (size_t)n, f);
  fclose(f);
  text[got] = 0;
  cJSON *j = cJSON_Parse(text);
  if (!j) print_error("%s does not parse as JSON\n", path);
  free(text);
  return j;
}

static int64_t jint(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsNumber(v)) {
    print_error("field \"%s\" is not a number\n", key);
    fail();
  }
  return (int64_t)v->valuedouble;
}

static const char *jstr(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsString(v)) {
    print_error("field \"%s\" is not a string\n", key);
    fail();
  }
  return v->valuestring;
}

#define assert_str(a, b)                                          \
  do {                                                            \
    const char *a_ = (a), *b_ = (b);                              \
    if (strcmp(a_, b_) != 0) {                                    \
      print_error("%s is \"%s\", expected \"%s\"\n", #a, a_, b_); \
      fail();                                                     \
    }                                                             \
  } while (0)

/* Runs tools/programs/ddp-fr-trace --json on dir; NULL (the test skips) without /usr/bin/python3.
 */
static cJSON *analyze(const char *dir) {
  const char *root = ddp_test_source_root();
  if (access("/usr/bin/python3", X_OK) != 0 || !root) return NULL;
  char cmd[1024], errp[600];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/tools/programs/ddp-fr-trace --json %s", root, dir);
  snprintf(errp, sizeof errp, "%s/analyzer.stderr", dir);
  char *out = NULL;
  int rc = ddp_test_proc_run(cmd, errp, 60, &out);
  if (rc != 0) {
    print_error("ddp-fr-trace exited %d; stdout:\n%s\n", rc, out ? out : "");
    free(out);
    fail();
  }
  cJSON *j = cJSON_Parse(out);
  if (!j) print_error("ddp-fr-trace --json printed no JSON:\n%s\n", out);
  free(out);
  assert_non_null(j);
  printf("# ddp-fr-trace: %s\n", jstr(j, "verdict"));
  return j;
}

/* The analyzer said `kind` at collective k with exactly these culprits. */
static void expect_verdict(const cJSON *v, const char *kind, int64_t k, int64_t last_all,
                           const int *culprits, int nc) {
  assert_str(jstr(v, "kind"), kind);
  assert_int_equal(jint(v, "collective"), k);
  assert_int_equal(jint(v, "last_completed_by_all"), last_all);
  const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "culprits");
  assert_int_equal(cJSON_GetArraySize(c), nc);
  for (int i = 0; i < nc; i++)
    assert_int_equal((int)cJSON_GetArrayItem(c, i)->valuedouble, culprits[i]);
}

static ddp_status_t allreduce_n(ddp_pg_t *pg, float *buf, size_t n) {
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(pg, buf, buf, n, DDP_F32, DDP_OP_SUM, &w);
  return st == DDP_OK ? ddp_work_wait_free(w) : st;
}

static bool wait_file(const char *path, int ms) {
  for (int i = 0; i < ms / 10; i++) {
    if (access(path, F_OK) == 0) return true;
    usleep(10000);
  }
  return access(path, F_OK) == 0;
}

typedef struct scen {
  const char *backend;
  int kind; /* 0 ring, 1 stall rank 1, 2 rank 2's #5 has count 101, 3 stream, 4 signal self */
  int64_t timeout_ms;
  ddp_store_t *store; /* threads */
  const char *dir;
  int64_t inv_shards; /* the DDP scenario: world_size_invariant_shards (0: off) */
} scen_t;

static ddp_status_t open_group(ddp_test_rank_t *tr, const scen_t *sc, ddp_store_t **store,
                               ddp_pg_t **pg) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = sc->backend;
  o.timeout_ms = sc->timeout_ms;
  o.shm_heap_bytes = 1u << 20;
  o.store = sc->store;
  ddp_status_t st = ddp_test_pg_create(tr, &o, "create", store, pg);
  if (st != DDP_OK) ddp_store_destroy(*store);
  return st;
}

static int scen_rank(ddp_test_rank_t *tr, void *arg) {
  const scen_t *sc = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t cs = open_group(tr, sc, &store, &pg);
  if (cs != DDP_OK) return cs;
  ddp_test_ready(tr); /* the parent's kill or signal comes after this (spawn) */
  int r = ddp_test_rank(tr);
  float buf[128] = {0};
  ddp_status_t st = DDP_OK;
  if (sc->kind == 0) { /* ring: 10 allreduces of 10..19 elements, the last one tagged with
                        * 40 names (over the 255 bytes kept), then a dump */
    for (int i = 0; i < 10 && st == DDP_OK; i++) {
      if (i == 9) {
        char names[1024] = "";
        for (int k = 0; k < 40; k++)
          snprintf(names + strlen(names), sizeof names - strlen(names), "%slayer.%02d.weight",
                   k ? "," : "", k);
        ddp_pg_set_next_collective_tag(pg, 7, names);
      }
      st = allreduce_n(pg, buf, 10 + (size_t)i);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/ring_%d.json", sc->dir, r);
    ddp_error_t err = {DDP_OK, ""};
    if (st == DDP_OK) st = ddp_pg_dump_flight_recorder(pg, path, &err);
    ddp_test_say(tr, "%s%s", ddp_pg_flight_recorder_enabled(pg) ? "on: " : "off: ", err.msg);
  } else if (sc->kind == 1 || sc->kind == 2) { /* #0..#4 agree, then #5 goes wrong */
    for (int i = 0; i < 5 && st == DDP_OK; i++) st = allreduce_n(pg, buf, 100);
    if (st == DDP_OK) {
      if (sc->kind == 1 && r == 1) usleep((useconds_t)(2 * sc->timeout_ms + 1000) * 1000);
      st = allreduce_n(pg, buf, sc->kind == 2 && r == 2 ? 101 : 100);
    }
    ddp_test_say_pg_error(tr, pg);
  } else { /* 2000 allreduces 1 ms apart (over 2 s; 3: a kill ends them); 4: rank 0
            * signals its own process after the 4th */
    for (int i = 0; st == DDP_OK && i < 2000; i++) {
      st = allreduce_n(pg, buf, 100);
      if (sc->kind == 4 && r == 0 && i == 3) kill(getpid(), SIGUSR1);
      usleep(1000);
    }
    ddp_test_say_pg_error(tr, pg);
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

static ddp_test_results_t *spawn(int world, ddp_test_mode_t mode, scen_t *sc, int kill_rank,
                                 int kill_after_ms, int sig) {
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = world;
  o.mode = mode;
  o.timeout_ms = 30000;
  o.kill_rank = kill_rank;
  o.kill_after_ms = kill_after_ms;
  o.kill_signal = sig;
  o.kill_after_ready = true;
  if (mode == DDP_TEST_THREADS) sc->store = ddp_test_memory_store();
  ddp_test_results_t *res = ddp_test_spawn(&o, scen_rank, sc);
  ddp_store_destroy(sc->store);
  sc->store = NULL;
  return res;
}

static void clear_env(void) {
  unsetenv("DDP_FR_BUFFER_SIZE");
  unsetenv("TORCH_NCCL_TRACE_BUFFER_SIZE");
  unsetenv("DDP_FR_DUMP_DIR");
  unsetenv("TORCH_FR_DUMP_TEMP_FILE");
  unsetenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE");
}

/* ---------------------------------------------------------------- ring ------------ */

/* The dump of rank 0 after 10 allreduces (counts 10..19) holds the last `want` of them. */
static void check_ring(const char *dir, int want) {
  char path[512];
  snprintf(path, sizeof path, "%s/ring_0.json", dir);
  cJSON *j = read_json(path);
  assert_non_null(j);
  assert_int_equal(jint(j, "rank"), 0);
  assert_int_equal(jint(j, "world_size"), 2);
  assert_str(jstr(j, "dump_reason"), "request");
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(j, "pg_status"),
      jstr(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "pg_config"), 0), "name"));
  assert_non_null(st);
  assert_int_equal(jint(st, "last_enqueued_collective"), 9);
  assert_int_equal(jint(st, "last_completed_collective"), 9);
  const cJSON *es = cJSON_GetObjectItemCaseSensitive(j, "entries");
  assert_int_equal(cJSON_GetArraySize(es), want);
  for (int i = 0; i < want; i++) {
    const cJSON *e = cJSON_GetArrayItem(es, i);
    int64_t k = 10 - want + i;
    assert_int_equal(jint(e, "record_id"), k);
    assert_int_equal(jint(e, "collective_seq_id"), k);
    assert_str(jstr(e, "profiling_name"), "threads:all_reduce");
    assert_str(jstr(e, "state"), "completed");
    assert_str(jstr(e, "ddp_op"), "SUM");
    assert_str(jstr(e, "ddp_status"), "DDP_OK");
    assert_int_equal(jint(e, "ddp_count"), 10 + k);
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(e, "input_sizes");
    assert_int_equal((int64_t)cJSON_GetArrayItem(cJSON_GetArrayItem(in, 0), 0)->valuedouble,
                     10 + k);
    assert_str(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(e, "input_dtypes"), 0)
                   ->valuestring,
               "Float");
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(e, "ddp_params");
    if (k < 9) {
      assert_null(cJSON_GetObjectItemCaseSensitive(e, "ddp_bucket"));
    } else { /* whole names while they fit in 255 bytes, then "..." */
      assert_int_equal(jint(e, "ddp_bucket"), 7);
      int np = cJSON_GetArraySize(params);
      if (np != 15 + 1) {
        char *t = cJSON_PrintUnformatted(params);
        print_error("ddp_params has %d items, expected 15 names and \"...\": %s\n", np, t);
        free(t);
        fail();
      }
      for (int q = 0; q < np - 1; q++) {
        char want[32];
        snprintf(want, sizeof want, "layer.%02d.weight", q);
        assert_str(cJSON_GetArrayItem(params, q)->valuestring, want);
      }
      assert_str(cJSON_GetArrayItem(params, np - 1)->valuestring, "...");
    }
    int64_t c = jint(e, "time_created_ns"), s = jint(e, "time_discovered_started_ns"),
            d = jint(e, "time_discovered_completed_ns");
    if (!(c > 0 && c <= s && s <= d)) {
      print_error("entry %d: created %lld, started %lld, completed %lld are out of order\n", i,
                  (long long)c, (long long)s, (long long)d);
      fail();
    }
    /* wall-clock times (CLOCK_MONOTONIC plus the offset taken at creation), so within the
     * test's own run of now */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    int64_t wall = (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (c > wall || wall - c > 600LL * 1000000000LL) {
      print_error("entry %d: time_created_ns %lld is not within 10 minutes before now, %lld\n", i,
                  (long long)c, (long long)wall);
      fail();
    }
  }
  cJSON_Delete(j);
}

/* The dump's times follow the clock: two collectives issued 100 ms apart on one rank are
 * 100 ms apart in the dump, and no further apart than the test saw around both (a wrong
 * tick rate stretches or shrinks every interval since the group's creation). */
typedef struct clock_case {
  const char *path;
  int64_t t0, t3; /* CLOCK_REALTIME before the first call and after the second */
} clock_case_t;

static int64_t wall_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static ddp_status_t clock_fn(ddp_pg_t *pg, void *arg) {
  clock_case_t *cc = arg;
  float x = 1;
  cc->t0 = wall_now_ns();
  ddp_status_t st = ddp_allreduce(pg, &x, &x, 1, DDP_F32, DDP_OP_SUM, NULL);
  struct timespec left = {0, 100 * 1000000L};
  while (nanosleep(&left, &left) != 0) {
  }
  if (st == DDP_OK) st = ddp_allreduce(pg, &x, &x, 1, DDP_F32, DDP_OP_SUM, NULL);
  cc->t3 = wall_now_ns();
  if (st == DDP_OK) st = ddp_pg_dump_flight_recorder(pg, cc->path, NULL);
  return st;
}

static void test_times_follow_the_clock(void **state) {
  char path[512];
  snprintf(path, sizeof path, "%s/clock.json", (const char *)*state);
  clear_env();
  clock_case_t cc = {path, 0, 0};
  assert_int_equal(ddp_spawn_threads(1, NULL, clock_fn, &cc), DDP_OK);
  cJSON *j = read_json(path);
  assert_non_null(j);
  const cJSON *es = cJSON_GetObjectItemCaseSensitive(j, "entries");
  assert_int_equal(cJSON_GetArraySize(es), 2);
  const cJSON *a = cJSON_GetArrayItem(es, 0), *b = cJSON_GetArrayItem(es, 1);
  int64_t ca = jint(a, "time_created_ns"), cb = jint(b, "time_created_ns");
  int64_t db = jint(b, "time_discovered_completed_ns");
  int64_t seen = cc.t3 - cc.t0, slack = 2000000; /* the conversion's jitter, generously */
  if (cb - ca < 100000000LL - slack || db - ca > seen + slack) {
    print_error("created %lld and %lld, completed %lld: %lld ns apart in the dump, the test saw "
                "%lld ns around both and slept 100 ms between them\n",
                (long long)ca, (long long)cb, (long long)db, (long long)(db - ca), (long long)seen);
    fail();
  }
  double ms = cJSON_GetObjectItemCaseSensitive(b, "duration_ms")->valuedouble;
  if (!(ms >= 0 && ms * 1e6 <= (double)(seen + slack))) {
    print_error("duration_ms %.6f of the second allreduce, the test saw %lld ns\n", ms,
                (long long)seen);
    fail();
  }
  cJSON_Delete(j);
}

static void test_ring_wraps(void **state) {
  (void)state;
  const char *dir = *state;
  scen_t sc = {"threads", 0, 5000, NULL, dir, 0};
  clear_env();
  setenv("DDP_FR_BUFFER_SIZE", "4", 1);
  ddp_test_results_t *res = spawn(2, DDP_TEST_THREADS, &sc, -1, 0, 0);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  check_ring(dir, 4);
  /* PyTorch's variable when libddp's is unset */
  clear_env();
  setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "3", 1);
  res = spawn(2, DDP_TEST_THREADS, &sc, -1, 0, 0);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  check_ring(dir, 3);
  /* the default keeps all ten */
  clear_env();
  res = spawn(2, DDP_TEST_THREADS, &sc, -1, 0, 0);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  check_ring(dir, 10);
  /* 0 turns it off: nothing recorded, a dump request is refused */
  setenv("DDP_FR_BUFFER_SIZE", "0", 1);
  res = spawn(2, DDP_TEST_THREADS, &sc, -1, 0, 0);
  const ddp_test_result_t *r0 = ddp_test_result(res, 0);
  assert_int_equal(r0->status, DDP_ERR_INVALID_USAGE);
  if (strncmp(r0->msg, "off: ", 5) != 0 || !strstr(r0->msg, "DDP_FR_BUFFER_SIZE=0")) {
    print_error("rank 0 said \"%s\", expected off and DDP_FR_BUFFER_SIZE=0\n", r0->msg);
    fail();
  }
  ddp_test_results_free(res);
  clear_env();
}

/* ---------------------------------------------------------------- failures -------- */

/* Work the group never ran stays "scheduled": rank 0 queues allreduces #0 and #1, then lets
 * rank 1 abort; #0 fails waiting for rank 1, #1 is not run. Rank 0's dump shows #1
 * scheduled (ended, with the failure's status) and #0 as the last started collective. */
typedef struct not_run_arg {
  atomic_int queued;
  char path[300];
} not_run_arg_t;

static ddp_status_t not_run_fn(ddp_pg_t *pg, void *argp) {
  not_run_arg_t *a = argp;
  float x[2] = {1, 2};
  if (ddp_pg_rank(pg) == 1) {
    while (!atomic_load(&a->queued)) usleep(1000);
    ddp_pg_abort_reason(pg, "not-run test");
    return DDP_OK;
  }
  ddp_work_t *w0 = NULL, *w1 = NULL;
  ddp_status_t s0 = ddp_allreduce(pg, &x[0], &x[0], 1, DDP_F32, DDP_OP_SUM, &w0);
  ddp_status_t s1 = ddp_allreduce(pg, &x[1], &x[1], 1, DDP_F32, DDP_OP_SUM, &w1);
  atomic_store(&a->queued, 1);
  if (s0 != DDP_OK || s1 != DDP_OK) return DDP_ERR_INTERNAL;
  s0 = ddp_work_wait_free(w0);
  s1 = ddp_work_wait_free(w1);
  ddp_error_t err = {0};
  if (s0 != DDP_ERR_REMOTE || s1 != DDP_ERR_REMOTE ||
      ddp_pg_dump_flight_recorder(pg, a->path, &err) != DDP_OK) {
    print_error("rank 0: %s, %s, dump: %s\n", ddp_status_name(s0), ddp_status_name(s1), err.msg);
    return DDP_ERR_INTERNAL;
  }
  return DDP_OK;
}

static void test_not_run_stays_scheduled(void **state) {
  not_run_arg_t a = {0};
  snprintf(a.path, sizeof a.path, "%s/not_run.json", (const char *)*state);
  clear_env();
  assert_int_equal(ddp_spawn_threads(2, NULL, not_run_fn, &a), DDP_OK);
  cJSON *j = read_json(a.path);
  assert_non_null(j);
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(j, "pg_status"),
      jstr(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "pg_config"), 0), "name"));
  assert_non_null(st);
  assert_int_equal(jint(st, "last_enqueued_collective"), 1);
  assert_int_equal(jint(st, "last_started_collective"), 0);
  assert_int_equal(jint(st, "last_completed_collective"), -1);
  const cJSON *entries = cJSON_GetObjectItemCaseSensitive(j, "entries");
  assert_int_equal(cJSON_GetArraySize(entries), 2);
  const cJSON *e0 = cJSON_GetArrayItem(entries, 0), *e1 = cJSON_GetArrayItem(entries, 1);
  assert_str(jstr(e0, "state"), "started");
  assert_str(jstr(e1, "state"), "scheduled");
  assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(e1, "time_discovered_started_ns")));
  assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e1, "retired")));
  assert_str(jstr(e1, "ddp_status"), "DDP_ERR_REMOTE");
  cJSON_Delete(j);
}

/* Every rank in [0, world) failed (not OK) and left fr_rank_<r>.json, except skip. */
static void expect_dumps(const ddp_test_results_t *res, const char *dir, int world, int skip) {
  for (int r = 0; r < world; r++) {
    if (r == skip) continue;
    const ddp_test_result_t *x = ddp_test_result(res, r);
    if (x->status == DDP_OK) {
      print_error("rank %d succeeded; every rank should have failed\n", r);
      fail();
    }
    char path[512];
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, r);
    if (!wait_file(path, 3000)) {
      print_error("rank %d (%s: %s) left no dump %s\n", r, ddp_test_status_name(x->status), x->msg,
                  path);
      fail();
    }
  }
}

static void run_stall(const char *dir, const char *backend, ddp_test_mode_t mode) {
  clear_env();
  setenv("DDP_FR_DUMP_DIR", dir, 1);
  scen_t sc = {backend, 1, 1500, NULL, dir, 0};
  ddp_test_results_t *res = spawn(3, mode, &sc, -1, 0, 0);
  clear_env();
  expect_dumps(res, dir, 3, -1);
  ddp_test_results_free(res);
  cJSON *v = analyze(dir);
  if (!v) {
    skip();
  }
  int culprit[] = {1};
  expect_verdict(v, "not_entered", 5, 4, culprit, 1);
  cJSON_Delete(v);
}

static void test_stall_threads(void **state) { run_stall(*state, "threads", DDP_TEST_THREADS); }
static void test_stall_shm(void **state) { run_stall(*state, "shm", DDP_TEST_FORK); }
static void test_stall_tcp(void **state) { run_stall(*state, "tcp", DDP_TEST_FORK); }

static void run_desync(const char *dir, const char *backend, ddp_test_mode_t mode) {
  clear_env();
  setenv("DDP_FR_DUMP_DIR", dir, 1);
  scen_t sc = {backend, 2, 5000, NULL, dir, 0};
  ddp_test_results_t *res = spawn(3, mode, &sc, -1, 0, 0);
  clear_env();
  expect_dumps(res, dir, 3, -1);
  for (int r = 0; r < 3; r++) assert_int_equal(ddp_test_result(res, r)->status, DDP_ERR_DESYNC);
  ddp_test_results_free(res);
  cJSON *v = analyze(dir);
  if (!v) {
    skip();
  }
  int culprit[] = {2};
  expect_verdict(v, "mismatch", 5, 4, culprit, 1);
  if (!strstr(jstr(v, "verdict"), "count 101") || !strstr(jstr(v, "verdict"), "count 100")) {
    print_error("the verdict does not quote both counts: %s\n", jstr(v, "verdict"));
    fail();
  }
  cJSON_Delete(v);
}

static void test_desync_threads(void **state) { run_desync(*state, "threads", DDP_TEST_THREADS); }
static void test_desync_tcp(void **state) { run_desync(*state, "tcp", DDP_TEST_FORK); }

/* kill -9 of rank 1 mid-stream: the survivors dump at the failure, the analyzer names the
 * rank without a dump. */
static void test_killed_rank_shm(void **state) {
  (void)state;
  const char *dir = *state;
  clear_env();
  setenv("DDP_FR_DUMP_DIR", dir, 1);
  scen_t sc = {"shm", 3, 5000, NULL, dir, 0};
  ddp_test_results_t *res = spawn(3, DDP_TEST_FORK, &sc, 1, 700, SIGKILL);
  clear_env();
  expect_dumps(res, dir, 3, 1);
  ddp_test_results_free(res);
  cJSON *v = analyze(dir);
  if (!v) {
    skip();
  }
  assert_str(jstr(v, "kind"), "no_dump");
  const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "culprits");
  assert_int_equal(cJSON_GetArraySize(c), 1);
  assert_int_equal((int)cJSON_GetArrayItem(c, 0)->valuedouble, 1);
  cJSON_Delete(v);
}

/* Writes rank r's dump of a 3-rank job in which rank 1 died before collective #11: #10
 * completed, #11 created at `created` (ns), the group's failure at `failed`. */
static void write_dump(const char *dir, int r, int64_t created, int64_t failed, const char *msg) {
  char path[512];
  snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, r);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  const char *entry =
      "{\"collective_seq_id\": %d, \"profiling_name\": \"libddp:all_reduce\", \"ddp_op\": "
      "\"SUM\", \"input_sizes\": [[100]], \"input_dtypes\": [\"Float\"], \"state\": "
      "\"%s\", \"time_created_ns\": %lld, \"is_p2p\": false}";
  fprintf(f, "{\"rank\": %d, \"world_size\": 3, \"dump_reason\": \"peer_failure\", \"entries\": [",
          r);
  fprintf(f, entry, 10, "completed", (long long)(created - 1000000));
  fputs(", ", f);
  fprintf(f, entry, 11, "started", (long long)created);
  fprintf(f,
          "], \"ddp_failure\": {\"status\": \"DDP_ERR_REMOTE\", \"message\": \"%s\", "
          "\"time_ns\": %lld}}\n",
          msg, (long long)failed);
  fclose(f);
}

/* Seen in the soak under load: rank 1 crashes; rank 0, in #11, finds it gone and fails the
 * group; rank 2, slowed by the load, issues #11 only afterwards. Being late for a group
 * that had already failed is a consequence: the analyzer still names rank 1 (it named rank 2
 * before). */
static void test_late_after_death(void **state) {
  const char *dir = *state;
  const int64_t t = 1700000000000000000LL; /* wall-clock ns */
  write_dump(dir, 0, t, t + 20000000LL,
             "rank 0: allreduce #11 (SUM, F32, count 100, canonical) on backend shm: rank 1 "
             "(pid 4869) has exited");
  write_dump(dir, 2, t + 25000000LL, t + 26000000LL,
             "rank 2: allreduce #11 (SUM, F32, count 100, canonical) on backend shm: rank 0 "
             "failed the group: rank 1 (pid 4869) has exited");
  cJSON *v = analyze(dir);
  if (!v) {
    skip();
  }
  const int one[] = {1};
  expect_verdict(v, "no_dump", 11, 10, one, 1);
  const char *verdict = jstr(v, "verdict");
  if (!strstr(verdict, "Rank 2 issued it only after the group had failed")) {
    print_error("the verdict does not say that rank 2 was late: %s\n", verdict);
    fail();
  }
  cJSON_Delete(v);
}

/* ---------------------------------------------------------------- SIGUSR1 --------- */

static void expect_signal_dump(const char *dir, int rank) {
  char path[512];
  snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, rank);
  cJSON *j = read_json(path);
  assert_non_null(j);
  assert_str(jstr(j, "dump_reason"), "signal");
  int n = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "entries"));
  if (n < 3) {
    print_error("rank %d's signal dump has %d entries, expected at least 3\n", rank, n);
    fail();
  }
  cJSON_Delete(j);
}

/* The launcher's way: SIGUSR1 to one process of a running shm job dumps that rank; the
 * job finishes normally. */
static void test_sigusr1_shm(void **state) {
  (void)state;
  const char *dir = *state;
  clear_env();
  setenv("DDP_FR_DUMP_DIR", dir, 1);
  scen_t sc = {"shm", 3, 10000, NULL, dir, 0};
  ddp_test_results_t *res = spawn(2, DDP_TEST_FORK, &sc, 1, 1000, SIGUSR1);
  clear_env();
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  expect_signal_dump(dir, 1);
  char other[512];
  snprintf(other, sizeof other, "%s/fr_rank_0.json", dir);
  if (access(other, F_OK) == 0) {
    print_error("rank 0 dumped though only rank 1 was signalled\n");
    fail();
  }
}

/* In a threads job, one SIGUSR1 dumps every rank's group of the process. */
static void test_sigusr1_threads(void **state) {
  (void)state;
  const char *dir = *state;
  clear_env();
  setenv("DDP_FR_DUMP_DIR", dir, 1);
  scen_t sc = {"threads", 4, 10000, NULL, dir, 0};
  ddp_test_results_t *res = spawn(2, DDP_TEST_THREADS, &sc, -1, 0, 0);
  clear_env();
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  expect_signal_dump(dir, 0);
  expect_signal_dump(dir, 1);
}

/* ---------------------------------------------------------------- DDP tags -------- */

static const char *const MODEL =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 8},"
    " {\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 8, \"out\": 2}]}";

static int ddp_rank(ddp_test_rank_t *tr, void *arg) {
  const scen_t *sc = arg;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t cs = open_group(tr, sc, &store, &pg);
  if (cs != DDP_OK) return cs;
  ddp_model_t *m = NULL;
  ddp_ddp_t *ddp = NULL;
  ddp_ctx_t *ctx = NULL;
  ddp_error_t err = {DDP_OK, ""};
  ddp_ddp_options_t dopts = DDP_DDP_OPTIONS_INIT;
  dopts.world_size_invariant_shards = sc->inv_shards;
  ddp_status_t st = ddp_model_from_json(MODEL, &m, &err);
  if (st == DDP_OK) st = ddp_model_init(m, 7);
  if (st == DDP_OK) st = ddp_ddp_create(m, pg, &dopts, &ddp, &err);
  if (st == DDP_OK) st = ddp_ctx_create(&ctx);
  if (st == DDP_OK) {
    float x[3 * 4], y[3 * 2];
    for (int i = 0; i < 12; i++) x[i] = (float)(i % 5) * 0.25f - 0.5f;
    for (int i = 0; i < 6; i++) y[i] = (float)i * 0.1f;
    int64_t xs[2] = {3, 4}, ys[2] = {3, 2};
    ddp_var_t *vx, *vy, *out, *loss;
    st = ddp_var_new(ctx, DDP_F32, 2, xs, x, false, &vx);
    if (st == DDP_OK) st = ddp_var_new(ctx, DDP_F32, 2, ys, y, false, &vy);
    if (st == DDP_OK) st = ddp_ddp_forward(ddp, ctx, vx, 0, &out);
    if (st == DDP_OK) st = ddp_mse_loss(ctx, out, vy, &loss);
    if (st == DDP_OK) st = ddp_ddp_backward(ddp, ctx, loss);
  }
  if (st == DDP_OK) {
    char path[512];
    snprintf(path, sizeof path, "%s/ddp_%d.json", sc->dir, ddp_test_rank(tr));
    st = ddp_pg_dump_flight_recorder(pg, path, &err);
  }
  if (err.msg[0])
    ddp_test_say(tr, "%s", err.msg);
  else
    ddp_test_say_pg_error(tr, pg);
  ddp_ctx_destroy(ctx);
  ddp_ddp_destroy(ddp);
  ddp_model_destroy(m);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

/* The reducer's bucket tags: one bucket (the model is far below 1 MiB). Normal mode: one
 * allreduce of its 58 elements carries the tag. Invariant mode (K = W = 2): both the block
 * exponents' MAX (I32, one block per parameter) and the accumulators' SUM (I64, 58) carry
 * it, MAX first. Every tagged entry names the bucket's four parameters. */
static void expect_bucket_tags(const char *dir, int64_t inv_shards) {
  clear_env();
  scen_t sc = {"threads", 0, 10000, NULL, dir, inv_shards};
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 2;
  sc.store = ddp_test_memory_store();
  ddp_test_results_t *res = ddp_test_spawn(&o, ddp_rank, &sc);
  ddp_store_destroy(sc.store);
  ddp_test_expect_ok(res);
  ddp_test_results_free(res);
  const int want_n = inv_shards ? 2 : 1;
  const int64_t want_count[2][2] = {{4 * 8 + 8 + 8 * 2 + 2, 0}, {4, 4 * 8 + 8 + 8 * 2 + 2}};
  const char *want_dtype[2][2] = {{"Float", ""}, {"Int", "Long"}};
  for (int r = 0; r < 2; r++) {
    char path[512];
    snprintf(path, sizeof path, "%s/ddp_%d.json", dir, r);
    cJSON *j = read_json(path);
    assert_non_null(j);
    const cJSON *e;
    int ntagged = 0;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(j, "entries")) {
      if (!cJSON_GetObjectItemCaseSensitive(e, "ddp_bucket")) continue;
      if (ntagged >= want_n) fail_msg("rank %d: more than %d tagged entries", r, want_n);
      const cJSON *dts = cJSON_GetObjectItemCaseSensitive(e, "input_dtypes");
      const cJSON *dt0 = cJSON_IsArray(dts) ? cJSON_GetArrayItem(dts, 0) : NULL;
      assert_int_equal(jint(e, "ddp_bucket"), 0);
      assert_int_equal(jint(e, "ddp_count"), want_count[inv_shards != 0][ntagged]);
      assert_str(cJSON_IsString(dt0) ? dt0->valuestring : "", want_dtype[inv_shards != 0][ntagged]);
      assert_str(jstr(e, "state"), "completed");
      const cJSON *names = cJSON_GetObjectItemCaseSensitive(e, "ddp_params");
      const char *want[] = {"2.bias", "2.weight", "0.bias", "0.weight"};
      assert_int_equal(cJSON_GetArraySize(names), 4);
      for (int i = 0; i < 4; i++) {
        bool found = false;
        const cJSON *n;
        cJSON_ArrayForEach(n, names) found |= strcmp(n->valuestring, want[i]) == 0;
        if (!found) {
          char *txt = cJSON_PrintUnformatted(names);
          print_error("rank %d: ddp_params %s lacks %s\n", r, txt, want[i]);
          free(txt);
          fail();
        }
      }
      ntagged++;
    }
    assert_int_equal(ntagged, want_n);
    cJSON_Delete(j);
  }
}

static void test_ddp_bucket_tags(void **state) { expect_bucket_tags(*state, 0); }
static void test_ddp_bucket_tags_invariant(void **state) { expect_bucket_tags(*state, 2); }

/* ---------------------------------------------------------------- ddp-train ------- */

/* `ddp-train --ddp_trace FILE` writes the reducer's timeline of every rank: 2 ranks x 4
 * steps x (forward, backward, finalize, allreduce bucket 0). With --ddp_reducer false it is
 * refused. */
static void test_ddp_train_trace(void **state) {
  (void)state;
  const char *build = getenv("DDP_BUILD_ROOT");
  if (!build) skip();
  const char *dir = *state;
  char cmd[1024], errp[128], path[128];
  snprintf(path, sizeof path, "%s/trace.json", dir);
  snprintf(errp, sizeof errp, "%s/stderr", dir);
  snprintf(cmd, sizeof cmd,
           "%s/tools/ddp-train --threads 2 --max_steps 4 --logging_steps 2 --save_steps 100 "
           "--output_dir %s/out --ddp_trace %s",
           build, dir, path);
  int rc = ddp_test_proc_run(cmd, errp, 100, NULL);
  assert_int_equal(rc, 0);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  char *text = calloc(1, 1 << 20);
  assert_non_null(text);
  size_t n = fread(text, 1, (1 << 20) - 2, f);
  fclose(f);
  while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == ',')) n--; /* the open array */
  text[n] = ']';
  cJSON *j = cJSON_Parse(text);
  free(text);
  assert_non_null(j);
  int per[2][4] = {{0}};
  const char *names[4] = {"forward", "backward", "finalize", "allreduce bucket 0"};
  const cJSON *e;
  cJSON_ArrayForEach(e, j) {
    int pid = (int)jint(e, "pid");
    assert_in_range(pid, 0, 1);
    assert_str(jstr(e, "ph"), "X");
    for (int k = 0; k < 4; k++) per[pid][k] += strcmp(jstr(e, "name"), names[k]) == 0;
  }
  for (int r = 0; r < 2; r++)
    for (int k = 0; k < 4; k++) {
      if (per[r][k] != 4) {
        print_error("rank %d has %d \"%s\" events, expected 4\n", r, per[r][k], names[k]);
        fail();
      }
    }
  cJSON_Delete(j);
  snprintf(cmd, sizeof cmd,
           "%s/tools/ddp-train --threads 2 --max_steps 2 --ddp_reducer false --output_dir "
           "%s/out2 --ddp_trace %s",
           build, dir, path);
  rc = ddp_test_proc_run(cmd, errp, 100, NULL);
  assert_int_not_equal(rc, 0);
}

/* Every case gets a fresh /tmp/ddp-test-fr-* directory as its state, removed afterwards
 * whether it passed or failed. */
static int setup_dir(void **state) {
  char *dir = malloc(64);
  if (!dir) return -1;
  make_dir(dir, 64);
  *state = dir;
  return 0;
}

static int teardown_dir(void **state) {
  clear_env();
  remove_dir(*state);
  free(*state);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_ring_wraps, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_times_follow_the_clock, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_not_run_stays_scheduled, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_ddp_bucket_tags, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_ddp_bucket_tags_invariant, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_stall_threads, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_stall_shm, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_stall_tcp, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_desync_threads, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_desync_tcp, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_killed_rank_shm, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_late_after_death, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_sigusr1_shm, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_sigusr1_threads, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_ddp_train_trace, setup_dir, teardown_dir),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
