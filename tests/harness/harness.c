/* The test harness: runs W ranks of a test function as threads or forked processes under a
 * watchdog and hands their reports to the parent, the only place that asserts.
 *
 * Memory layout. One MAP_SHARED|MAP_ANONYMOUS region holds, for every rank, a slot (its
 * ddp_test_result_t plus a phase word), then the pid table, then the value areas. A forked
 * child inherits the mapping at the same address, so the `values` pointers stored in the
 * results are valid in the parent and in every child, and a child's writes are visible to
 * the parent without any copying. The region, the scratch directory and the bookkeeping are
 * released by ddp_test_results_free.
 *
 * Watchdog. The parent waits until a single deadline (spawn time + timeout_ms). In fork mode
 * it polls the children with waitpid(WNOHANG) at a millisecond period, sends the injected
 * fault when its time comes, and at the deadline SIGKILLs every child still alive and marks
 * it DDP_TEST_HUNG. In thread mode a hung thread cannot be stopped, so the parent prints
 * every rank's state and ends the process with _exit(1): the test fails by its timeout
 * instead of hanging CI.
 *
 * The harness allocates with libc directly, never through ddp_set_allocator's allocator,
 * so that a test may route the library through CMocka's leak checker around a spawn. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define DEFAULT_TIMEOUT_MS 20000
#define DEFAULT_VALUE_BYTES 65536
#define MAX_WORLD 64
#define POLL_PERIOD_NS 1000000L

/* Rank progress, written by the rank and read by the watchdog. */
enum { PHASE_NOT_STARTED = 0, PHASE_RUNNING = 1, PHASE_RETURNED = 2 };

typedef struct slot {
  ddp_test_result_t r;
  _Atomic int phase;
  _Atomic int ready; /* ddp_test_ready was called */
} slot_t;

struct ddp_test_rank {
  int rank;
  int world;
  ddp_test_mode_t mode;
  const char *dir;
  const pid_t *pids; /* in the shared region */
  slot_t *slot;      /* in the shared region */
  size_t cap;        /* bytes of the value area */
  int64_t t0_ns;     /* spawn time, CLOCK_MONOTONIC */
  int read_fd;       /* fork mode: start gate (EOF once every child exists) */
  ddp_test_fn fn;
  void *arg;
};

struct ddp_test_results {
  int world;
  ddp_test_mode_t mode;
  void *shm;
  size_t shm_size;
  slot_t *slots;
  char dir[256];
  ddp_test_rank_t *ranks;
  int64_t kill_ns; /* when kill_signal was sent; 0 = never */
};

/* ---------------------------------------------------------------- small helpers --- */

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Harness failures (bad options, fork or mmap failing) are not what a test checks: they
 * end the process with a message, like a contract failure. */
_Noreturn static void harness_die(const char *what) {
  fprintf(stderr, "test harness: %s\n", what);
  fflush(stderr);
  _exit(1);
}

const char *ddp_test_status_name(int status) {
  if (status == DDP_TEST_HUNG) return "DDP_TEST_HUNG";
  if (status == DDP_TEST_CRASHED) return "DDP_TEST_CRASHED";
  return ddp_status_name((ddp_status_t)status);
}

/* ---------------------------------------------------------------- rank side ------- */

static void rank_finish(ddp_test_rank_t *r, int status) {
  r->slot->r.status = status;
  r->slot->r.elapsed_ms = (double)(mono_ns() - r->t0_ns) / 1e6;
  r->slot->r.reported = true;
  atomic_store(&r->slot->phase, PHASE_RETURNED);
}

static void *thread_main(void *p) {
  ddp_test_rank_t *r = p;
  atomic_store(&r->slot->phase, PHASE_RUNNING);
  rank_finish(r, r->fn(r, r->arg));
  return NULL;
}

_Noreturn static void child_main(ddp_test_rank_t *r) {
  /* A child outlives nothing: if the test process dies, the kernel kills the child. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  char c;
  /* Wait until the parent has forked every rank, so the pid table is complete. */
  while (read(r->read_fd, &c, 1) < 0 && errno == EINTR) {
  }
  close(r->read_fd);
  atomic_store(&r->slot->phase, PHASE_RUNNING);
  int st = r->fn(r, r->arg);
  rank_finish(r, st);
  fflush(stdout);
  fflush(stderr);
  /* _exit: the parent's atexit handlers and CMocka's state belong to the parent. */
  _exit(0);
}

int ddp_test_rank(const ddp_test_rank_t *r) { return r->rank; }
void ddp_test_ready(ddp_test_rank_t *r) { atomic_store(&r->slot->ready, 1); }
int64_t ddp_test_kill_time_ns(const ddp_test_results_t *res) { return res->kill_ns; }
int ddp_test_world_size(const ddp_test_rank_t *r) { return r->world; }
ddp_test_mode_t ddp_test_mode(const ddp_test_rank_t *r) { return r->mode; }
const char *ddp_test_dir(const ddp_test_rank_t *r) { return r->dir; }

pid_t ddp_test_pid(const ddp_test_rank_t *r, int rank) {
  if (rank < 0 || rank >= r->world) return -1;
  return r->pids[rank];
}

void ddp_test_say(ddp_test_rank_t *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->slot->r.msg, sizeof r->slot->r.msg, fmt, ap);
  va_end(ap);
}

void ddp_test_say_pg_error(ddp_test_rank_t *r, const ddp_pg_t *pg) {
  ddp_error_t e;
  ddp_pg_last_error_copy(pg, &e);
  ddp_test_say(r, "%.1000s", e.msg);
}

bool ddp_test_put(ddp_test_rank_t *r, const void *data, size_t n) {
  ddp_test_result_t *res = &r->slot->r;
  if (n > r->cap - res->nvalues) return false;
  memcpy(res->values + res->nvalues, data, n);
  res->nvalues += n;
  return true;
}

ddp_store_t *ddp_test_memory_store(void) {
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = 10000;
  ddp_store_t *s = NULL;
  assert_int_equal(ddp_store_create_memory(&so, &s, NULL), DDP_OK);
  return s;
}

ddp_status_t ddp_test_pg_create(ddp_test_rank_t *tr, ddp_pg_options_t *o, const char *what,
                                ddp_store_t **store, ddp_pg_t **pg) {
  *store = NULL;
  o->rank = ddp_test_rank(tr);
  o->world = ddp_test_world_size(tr);
  if (ddp_test_mode(tr) == DDP_TEST_FORK) {
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    so.timeout_ms = o->timeout_ms;
    so.rank = o->rank;
    ddp_error_t se = {0};
    ddp_status_t st = ddp_store_create_file(ddp_test_dir(tr), &so, store, &se);
    if (st != DDP_OK) {
      ddp_test_say(tr, "file store: %s", se.msg);
      return st;
    }
    o->store = *store;
  }
  ddp_error_t err = {0};
  ddp_status_t st = ddp_pg_create(o, pg, &err);
  if (st != DDP_OK) ddp_test_say(tr, "%s: %s", what, err.msg);
  return st;
}

/* ---------------------------------------------------------------- parent side ----- */

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

/* Removes the scratch directory and everything in it (no symlinks followed). */
static void remove_tree(const char *dir) {
  if (dir[0]) nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void print_states(const ddp_test_results_t *res, FILE *out) {
  for (int i = 0; i < res->world; i++) {
    const slot_t *s = &res->slots[i];
    int phase = atomic_load(&s->phase);
    const char *ph = phase == PHASE_RETURNED  ? "returned"
                     : phase == PHASE_RUNNING ? "running"
                                              : "not started";
    fprintf(out, "  rank %d: %s", i, ph);
    if (phase == PHASE_RETURNED || s->r.status == DDP_TEST_HUNG || s->r.status == DDP_TEST_CRASHED)
      fprintf(out, ", status %s", ddp_test_status_name(s->r.status));
    if (s->r.term_signal)
      fprintf(out, ", signal %d (%s)", s->r.term_signal, strsignal(s->r.term_signal));
    if (s->r.exit_code) fprintf(out, ", exit code %d", s->r.exit_code);
    if (s->r.msg[0]) fprintf(out, ": %.*s", (int)sizeof s->r.msg, s->r.msg);
    fputc('\n', out);
  }
  fflush(out);
}

static void spawn_threads(ddp_test_results_t *res, int64_t deadline) {
  pthread_t th[MAX_WORLD];
  for (int i = 0; i < res->world; i++) {
    int rc = pthread_create(&th[i], NULL, thread_main, &res->ranks[i]);
    if (rc != 0) harness_die("pthread_create failed");
  }
  /* Threads cannot be killed; a short poll keeps the watchdog simple and needs no signal
   * from the ranks. */
  for (;;) {
    int done = 0;
    for (int i = 0; i < res->world; i++)
      done += atomic_load(&res->slots[i].phase) == PHASE_RETURNED;
    if (done == res->world) break;
    if (mono_ns() >= deadline) {
      fprintf(stderr,
              "test harness: thread-mode spawn of %d ranks hung past its timeout; "
              "ending the test process (a hung thread cannot be killed). Rank states:\n",
              res->world);
      print_states(res, stderr);
      fflush(stdout);
      remove_tree(res->dir);
      _exit(1);
    }
    sleep_ns(POLL_PERIOD_NS);
  }
  for (int i = 0; i < res->world; i++) pthread_join(th[i], NULL);
}

/* Records how a reaped child ended. A child that did not return from the rank function
 * is CRASHED unless the watchdog already marked it HUNG. */
static void record_exit(slot_t *s, int wstatus) {
  ddp_test_result_t *r = &s->r;
  if (WIFSIGNALED(wstatus)) r->term_signal = WTERMSIG(wstatus);
  if (WIFEXITED(wstatus)) r->exit_code = WEXITSTATUS(wstatus);
  if (atomic_load(&s->phase) != PHASE_RETURNED) {
    r->reported = false;
    if (r->status != DDP_TEST_HUNG) r->status = DDP_TEST_CRASHED;
  }
}

static void spawn_forks(ddp_test_results_t *res, pid_t *pids, const ddp_test_opts_t *o, int64_t t0,
                        int64_t deadline) {
  int gate[2];
  if (pipe(gate) != 0) harness_die("pipe failed");
  /* Buffered output would otherwise be flushed again by every child. */
  fflush(NULL);
  for (int i = 0; i < res->world; i++) {
    res->ranks[i].read_fd = gate[0];
    pid_t p = fork();
    if (p < 0) {
      for (int j = 0; j < i; j++) kill(pids[j], SIGKILL);
      for (int j = 0; j < i; j++) waitpid(pids[j], NULL, 0);
      harness_die("fork failed");
    }
    if (p == 0) {
      close(gate[1]);
      child_main(&res->ranks[i]);
    }
    pids[i] = p;
  }
  close(gate[1]);
  close(gate[0]);

  bool alive[MAX_WORLD];
  int nalive = res->world;
  for (int i = 0; i < res->world; i++) alive[i] = true;
  bool kills = o->kill_rank >= 0 && o->kill_rank < res->world, kill_pending = kills;
  /* INT64_MAX: armed only once every rank is ready */
  int64_t kill_at = o->kill_after_ready ? INT64_MAX : t0 + (int64_t)o->kill_after_ms * 1000000;

  while (nalive > 0) {
    for (int i = 0; i < res->world; i++) {
      if (!alive[i]) continue;
      int ws;
      pid_t w = waitpid(pids[i], &ws, WNOHANG);
      if (w == pids[i]) {
        record_exit(&res->slots[i], ws);
        alive[i] = false;
        nalive--;
      } else if (w < 0 && errno != EINTR) {
        /* Reaped elsewhere (a test that waits for all children): nothing to learn. */
        record_exit(&res->slots[i], 0);
        alive[i] = false;
        nalive--;
      }
    }
    if (nalive == 0) break;
    int64_t now = mono_ns();
    if (kill_pending && kill_at == INT64_MAX) {
      int ready = 0;
      for (int i = 0; i < res->world; i++) ready += atomic_load(&res->slots[i].ready);
      if (ready == res->world) kill_at = now + (int64_t)o->kill_after_ms * 1000000;
    }
    if (kill_pending && now >= kill_at) {
      if (alive[o->kill_rank]) kill(pids[o->kill_rank], o->kill_signal);
      res->kill_ns = mono_ns();
      kill_pending = false;
    }
    /* A rank stopped with SIGSTOP cannot finish on its own: once it is the only one left,
     * the watchdog's verdict (hung, killed) is known, so it comes now instead of at the
     * deadline. */
    bool only_stopped = kills && !kill_pending && o->kill_signal == SIGSTOP && nalive == 1 &&
                        alive[o->kill_rank];
    if (now >= deadline || only_stopped) {
      for (int i = 0; i < res->world; i++) {
        if (!alive[i]) continue;
        if (atomic_load(&res->slots[i].phase) != PHASE_RETURNED)
          res->slots[i].r.status = DDP_TEST_HUNG;
        kill(pids[i], SIGKILL);
        int ws;
        while (waitpid(pids[i], &ws, 0) < 0 && errno == EINTR) {
        }
        record_exit(&res->slots[i], ws);
        alive[i] = false;
      }
      break;
    }
    sleep_ns(POLL_PERIOD_NS);
  }
  for (int i = 0; i < res->world; i++) res->slots[i].r.msg[sizeof res->slots[i].r.msg - 1] = 0;
}

ddp_test_results_t *ddp_test_spawn(const ddp_test_opts_t *opts, ddp_test_fn fn, void *arg) {
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  if (opts) o = *opts;
  if (o.world < 1 || o.world > MAX_WORLD) harness_die("world must be in 1..64");
  if (!fn) harness_die("NULL rank function");
  if (o.timeout_ms <= 0) o.timeout_ms = DEFAULT_TIMEOUT_MS;
  if (o.value_bytes == 0) o.value_bytes = DEFAULT_VALUE_BYTES;

  ddp_test_results_t *res = calloc(1, sizeof *res);
  if (!res) harness_die("out of memory");
  res->world = o.world;
  res->mode = o.mode;

  size_t slots_bytes = (size_t)o.world * sizeof(slot_t);
  size_t pids_off = (slots_bytes + 63) & ~(size_t)63;
  size_t vals_off = (pids_off + (size_t)o.world * sizeof(pid_t) + 63) & ~(size_t)63;
  size_t vbytes = (o.value_bytes + 63) & ~(size_t)63;
  res->shm_size = vals_off + (size_t)o.world * vbytes;
  res->shm = mmap(NULL, res->shm_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (res->shm == MAP_FAILED) harness_die("mmap of the report region failed");
  res->slots = (slot_t *)res->shm;
  pid_t *pids = (pid_t *)((unsigned char *)res->shm + pids_off);
  unsigned char *vals = (unsigned char *)res->shm + vals_off;

  const char *tmp = getenv("TMPDIR");
  if (!tmp || !tmp[0]) tmp = "/tmp";
  /* mkdtemp's template ends in six 'X' that it replaces. */
  int len = snprintf(res->dir, sizeof res->dir - 7, "%s/ddp-test-", tmp);
  if (len < 0 || (size_t)len >= sizeof res->dir - 7) harness_die("TMPDIR path too long");
  memset(res->dir + len, 'X', 6);
  res->dir[len + 6] = '\0';
  if (!mkdtemp(res->dir)) harness_die("mkdtemp of the scratch directory failed");
  ddp_test_remove_at_exit(res->dir); /* also when the test fails before results_free */

  res->ranks = calloc((size_t)o.world, sizeof *res->ranks);
  if (!res->ranks) harness_die("out of memory");
  int64_t t0 = mono_ns();
  int64_t deadline = t0 + (int64_t)o.timeout_ms * 1000000;
  for (int i = 0; i < o.world; i++) {
    slot_t *s = &res->slots[i];
    s->r.values = vals + (size_t)i * vbytes;
    atomic_store(&s->phase, PHASE_NOT_STARTED);
    pids[i] = getpid();
    res->ranks[i] = (ddp_test_rank_t){.rank = i,
                                      .world = o.world,
                                      .mode = o.mode,
                                      .dir = res->dir,
                                      .pids = pids,
                                      .slot = s,
                                      .cap = o.value_bytes,
                                      .t0_ns = t0,
                                      .read_fd = -1,
                                      .fn = fn,
                                      .arg = arg};
  }
  if (o.mode == DDP_TEST_FORK) {
    spawn_forks(res, pids, &o, t0, deadline);
  } else {
    spawn_threads(res, deadline);
  }
  return res;
}

const ddp_test_result_t *ddp_test_result(const ddp_test_results_t *res, int rank) {
  if (!res || rank < 0 || rank >= res->world) return NULL;
  return &res->slots[rank].r;
}

int ddp_test_world(const ddp_test_results_t *res) { return res ? res->world : 0; }

void ddp_test_results_free(ddp_test_results_t *res) {
  if (!res) return;
  ddp_test_remove_now(res->dir);
  munmap(res->shm, res->shm_size);
  free(res->ranks);
  free(res);
}

void ddp_test_expect_all(const ddp_test_results_t *res, int expected) {
  int bad = 0;
  for (int i = 0; i < res->world; i++) bad += res->slots[i].r.status != expected;
  if (bad == 0) return;
  fflush(stdout);
  fprintf(stderr, "%d of %d ranks did not return %s:\n", bad, res->world,
          ddp_test_status_name(expected));
  print_states(res, stderr);
  fail_msg("%d of %d ranks did not return %s", bad, res->world, ddp_test_status_name(expected));
}

/* ---------------------------------------------------------------- allocators ------ */

static void *cm_malloc(void *u, size_t n) {
  (void)u;
  return _test_malloc(n, "libddp", 0);
}
static void *cm_calloc(void *u, size_t n, size_t s) {
  (void)u;
  return _test_calloc(n, s, "libddp", 0);
}
static void *cm_realloc(void *u, void *p, size_t n) {
  (void)u;
  return _test_realloc(p, n, "libddp", 0);
}
static void cm_free(void *u, void *p) {
  (void)u;
  _test_free(p, "libddp", 0);
}

void ddp_test_use_cmocka_allocator(void) {
  static const ddp_allocator_t a = {cm_malloc, cm_calloc, cm_realloc, cm_free, NULL};
  ddp_set_allocator(&a);
}

void ddp_test_use_default_allocator(void) { ddp_set_allocator(NULL); }

int64_t ddp_test_live_allocs(void) {
  ddp_alloc_stats_t s;
  ddp_alloc_stats(&s);
  return (int64_t)(s.allocs - s.frees);
}

/* ---------------------------------------------------------------- environment ----- */

const char *ddp_test_python(void) {
  static const char *const py = "/usr/bin/python3";
  if (access(py, X_OK) != 0) return NULL;
  /* A plain check each call: no cached state that a fork could inherit half-made. */
  int rc = system("OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 -c 'import torch'"
                  " >/dev/null 2>&1");
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) return NULL;
  return py;
}

const char *ddp_test_source_root(void) {
  const char *r = getenv("DDP_SOURCE_ROOT");
  if (r && r[0]) return r;
#ifdef DDP_TEST_SOURCE_ROOT
  return DDP_TEST_SOURCE_ROOT;
#else
  return NULL;
#endif
}

const char *ddp_test_tool(const char *name) {
  static char buf[4][4096];
  static int k;
  k = (k + 1) % 4;
  const char *b = getenv("DDP_BUILD_ROOT");
  snprintf(buf[k], sizeof buf[k], "%s/tools/%s", b && b[0] ? b : ".", name);
  return buf[k];
}

char *ddp_test_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *b = malloc(n > 0 ? (size_t)n + 1 : 1);
  size_t got = b && n > 0 ? fread(b, 1, (size_t)n, f) : 0;
  fclose(f);
  if (b) b[got] = 0;
  if (len) *len = got;
  return b;
}

bool ddp_test_run_tool(const char *script, const char *args) {
  const char *root = ddp_test_source_root();
  if (!root || access("/usr/bin/python3", X_OK) != 0) return false;
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 %s/tools/torch/%s %s", root,
           script, args);
  int rc = system(cmd);
  if (rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 77) return false;
  DDP_ASSERT_EXITED(rc, 0);
  return true;
}

void ddp_test_tmp_file(char *buf, size_t len, const char *suite, const char *stem) {
  int k = snprintf(buf, len, "/tmp/ddp_%s_%s_", suite, stem);
  assert_true(k > 0 && (size_t)k + 7 <= len); /* room for mkstemp's six 'X' and the NUL */
  memset(buf + k, 'X', 6);
  buf[k + 6] = '\0';
  int fd = mkstemp(buf);
  assert_true(fd >= 0);
  close(fd);
  ddp_test_remove_at_exit(buf);
}

/* ---------------------------------------------------------------- shared pieces --- */

uint32_t ddp_test_fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

float ddp_test_bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float *ddp_test_mlp_batch(int64_t t[64]) {
  float *x = malloc(64 * 784 * sizeof(float));
  ddp_rng_t g;
  ddp_rng_init(&g, 1, 1);
  for (int i = 0; i < 64 * 784; i++) x[i] = ddp_rng_uniform(&g);
  for (int i = 0; i < 64; i++) t[i] = i % 10;
  return x;
}

void ddp_test_mlp_step(ddp_model_t *m, ddp_ctx_t *c, const float *x, const int64_t *t) {
  int64_t xs[2] = {64, 784}, n = 64;
  ddp_var_t *xv, *tv, *y, *loss;
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, xs, x, false, &xv), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &n, t, false, &tv), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, xv, 0, &y), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, y, tv, -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  ddp_ctx_reset(c);
}
