/* Fault injection end to end (suite ddp; docs/errors.md, "Fault injection"): for each kind
 * and backend (threads, shm, tcp) a 3-rank ddp-train job on the shipped digits, rank 1 the
 * culprit, and what the survivors (ranks 0 and 2) say and when:
 *
 *  - crash: every survivor exits 1 naming rank 1 within 1 s of the injection (the time the
 *    injector logs, "fault injection: crash on rank 1 at step 3 (t=... s, CLOCK_MONOTONIC)",
 *    against the survivor's "fault injection: rank R failed at t=..." line);
 *  - hang, and slow by more than the timeout: every survivor fails at the 3 s timeout
 *    (+-10%, the wait its message reports) naming rank 1, and not before 2.7 s after the
 *    injection;
 *  - skip_backward, wrong_shape: DESYNC on every survivor naming rank 1's collective;
 *  - corrupt_bucket:after: the replica check fails on every survivor naming rank 1;
 *  - corrupt_bucket (before the allreduce): nothing fails, since every rank receives the
 *    same corrupted average; the final parameters differ from a clean run's (divergence);
 *  - slow below the timeout: the job succeeds;
 *  - a bad spec (flag or DDP_FAULT): exit 2 naming the field.
 *
 * Process ranks are started directly with torchrun's variables (RANK, WORLD_SIZE,
 * MASTER_ADDR, MASTER_PORT), not under ddprun, which would stop the survivors the moment
 * the culprit dies, before they report. A kind's jobs on the three backends run at the same
 * time (run_jobs), so the hangs' timeouts overlap and each job runs under the others' load. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "proc.h"

#define WORLD 3
#define CULPRIT 1
#define TIMEOUT_S 3
/* A survivor enters the collective that times out only after its own step's forward and
 * backward, which the injection does not delay: up to 0.4 s under the soak's load with a
 * kind's three jobs at once (the survivors failed 3.40 s after the injection, reporting
 * 3.04 s waits), and 2.38 s when two copies of the whole suite ran at once (the soak's pair
 * round: failed 5.38 s after the injection, reporting 3.00 s waits). So the timeout is
 * checked on the wait the message reports, and the time from the injection only against
 * this much slack. */
#define REACH_MS 4000.0

typedef struct job {
  const char *backend, *spec; /* spec NULL: no fault */
  char dir[256];
  int rc[WORLD];         /* exit status per rank (threads: the process's, for every rank) */
  double t_inject;       /* the injector's CLOCK_MONOTONIC seconds; < 0 when not logged */
  double t_fail[WORLD];  /* each rank's failure time; < 0 when it did not fail */
  char msg[WORLD][2048]; /* each rank's failure message */
  char hash[WORLD][32];  /* "every rank holds parameters X" of a successful run */
  char fr_verdict[2048]; /* tools/programs/ddp-fr-trace's verdict on the flight-recorder dumps */
  int fr_culprits[WORLD + 1], fr_n; /* the ranks it names; fr_n < 0: it did not run */
  char *log;                        /* every rank's stderr, concatenated */
} job_t;

/* The file's text; "" when it is missing. */
static char *slurp(const char *path) {
  char *b = ddp_test_read_file(path, NULL);
  return b ? b : calloc(1, 1);
}

static void rm_tree(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) print_message("could not remove %s\n", dir);
}

/* Reads the fault lines of one rank's log text into j. */
static void parse_log(job_t *j, const char *text) {
  for (const char *line = text; line && *line;) {
    const char *nl = strchr(line, '\n');
    size_t len = nl ? (size_t)(nl - line) : strlen(line);
    char buf[4096];
    snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf - 1 ? len : sizeof buf - 1), line);
    const char *p = strstr(buf, "libddp WARN: fault injection: ");
    int r;
    double t;
    if (p) {
      p += strlen("libddp WARN: fault injection: ");
      const char *at = strstr(p, " (t=");
      if (sscanf(p, "rank %d failed at t=%lf s", &r, &t) == 2 && r >= 0 && r < WORLD) {
        const char *m = strstr(p, "(CLOCK_MONOTONIC): ");
        j->t_fail[r] = t;
        snprintf(j->msg[r], sizeof j->msg[r], "%s", m ? m + 19 : p);
      } else if (at && strstr(p, " on rank 1 at ") && j->t_inject < 0) {
        j->t_inject = strtod(at + 4, NULL);
      }
    }
    const char *h = strstr(buf, "every rank holds parameters ");
    if (h) snprintf(j->hash[0], sizeof j->hash[0], "%.16s", h + 28);
    line = nl ? nl + 1 : NULL;
  }
}

/* tools/programs/ddp-fr-trace --json on the job's dumps: its verdict and culprits. */
static void fr_trace(job_t *j) {
  j->fr_n = -1;
  if (access("/usr/bin/python3", X_OK) != 0) return;
  char cmd[1024], err[300], *out = NULL;
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s/tools/programs/ddp-fr-trace' --json '%s/fr'",
           ddp_test_source_root(), j->dir);
  snprintf(err, sizeof err, "%s/fr.err", j->dir);
  int rc = ddp_test_proc_run(cmd, err, 30, &out);
  const char *v = out ? strstr(out, "\"verdict\": \"") : NULL;
  if (v) {
    v += 12;
    size_t n = strcspn(v, "\"");
    snprintf(j->fr_verdict, sizeof j->fr_verdict, "%.*s", (int)n, v);
  } else {
    snprintf(j->fr_verdict, sizeof j->fr_verdict, "(exit %d, no verdict)", rc);
  }
  const char *c = out ? strstr(out, "\"culprits\": [") : NULL;
  if (c) {
    j->fr_n = 0;
    for (c += 13; *c && *c != ']' && j->fr_n <= WORLD;) {
      char *end;
      long x = strtol(c, &end, 10);
      if (end != c) {
        j->fr_culprits[j->fr_n++] = (int)x;
        c = end;
      } else {
        c++;
      }
    }
  }
  free(out);
}

/* A job on `backend` with fault spec `spec` (NULL: none), in a fresh directory; not run
 * yet. */
static job_t *job_new(const char *backend, const char *spec) {
  job_t *j = calloc(1, sizeof *j);
  j->backend = backend;
  j->spec = spec;
  j->t_inject = -1;
  for (int r = 0; r < WORLD; r++) j->t_fail[r] = -1, j->rc[r] = -1;
  snprintf(j->dir, sizeof j->dir, "/tmp/ddp-test-faults-XXXXXX");
  ddp_test_mkdtemp(j->dir); /* removed at exit, also on failure */
  return j;
}

/* The shell command that runs the job: threads through the --ddp_fault flag, processes
 * through DDP_FAULT, each rank's output and exit status in files of the job's directory. */
static void job_command(const job_t *j, char *cmd, size_t cap) {
  char args[2048];
  snprintf(args, sizeof args,
           "--data '%s/tests/data/digits.safetensors' --max_steps 8 --logging_steps 4 "
           "--save_strategy no --ddp_timeout %d --disable_tqdm true "
           "--ddp_find_unused_parameters false --learning_rate 1e-3",
           ddp_test_source_root(), TIMEOUT_S);
  const char *exe = ddp_test_tool("ddp-train"), *spec = j->spec;
  if (!strcmp(j->backend, "threads")) {
    snprintf(cmd, cap,
             "DDP_FR_DUMP_DIR='%s/fr' '%s' --threads %d %s --output_dir '%s/o' %s%s%s "
             ">'%s/out0' 2>'%s/err0'; echo $? >'%s/rc0'",
             j->dir, exe, WORLD, args, j->dir, spec ? "--ddp_fault '" : "", spec ? spec : "",
             spec ? "'" : "", j->dir, j->dir, j->dir);
  } else {
    snprintf(cmd, cap,
             "for r in 0 1 2; do (RANK=$r LOCAL_RANK=$r WORLD_SIZE=%d LOCAL_WORLD_SIZE=%d "
             "MASTER_ADDR=127.0.0.1 MASTER_PORT=%d DDP_BACKEND=%s DDP_FAULT='%s' "
             "DDP_FR_DUMP_DIR='%s/fr' '%s' %s --output_dir '%s/o'$r >'%s/out'$r "
             "2>'%s/err'$r; echo $? >'%s/rc'$r) & done; wait",
             WORLD, WORLD, ddp_test_free_port(), j->backend, spec ? spec : "", j->dir, exe, args,
             j->dir, j->dir, j->dir, j->dir);
  }
}

/* Whether rank 0 could not bind the store's port (another process took the free port). */
static bool job_port_taken(const job_t *j) {
  char p[320];
  snprintf(p, sizeof p, "%s/err0", j->dir);
  char *e0 = slurp(p);
  bool taken = strstr(e0, "Address already in use") != NULL;
  free(e0);
  return taken;
}

/* Reads the job's exit statuses, fault lines and logs, and runs the analyzer on its dumps. */
static void job_collect(job_t *j) {
  size_t cap = 1, len = 0;
  j->log = calloc(1, 1);
  for (int r = 0; r < WORLD; r++) {
    char p[320];
    bool threads = !strcmp(j->backend, "threads");
    snprintf(p, sizeof p, "%s/rc%d", j->dir, threads ? 0 : r);
    char *rc = slurp(p);
    j->rc[r] = rc[0] ? atoi(rc) : -1;
    free(rc);
    if (threads && r > 0) continue;
    for (int f = 0; f < 2; f++) {
      snprintf(p, sizeof p, "%s/%s%d", j->dir, f ? "out" : "err", r);
      char *text = slurp(p);
      parse_log(j, text);
      size_t n = strlen(text);
      j->log = realloc(j->log, cap += n);
      memcpy(j->log + len, text, n + 1);
      len += n;
      free(text);
    }
  }
  fr_trace(j);
}

/* Runs the n jobs at the same time, each in the background of one shell, and collects
 * them. The jobs are independent (own directories, ports, dump folders); running them
 * together puts each under the load of the others, and the timeouts they wait through
 * overlap. A job whose store port was taken meanwhile runs again with another. */
static void run_jobs(job_t **jobs, int n) {
  bool todo[16];
  for (int i = 0; i < n; i++) todo[i] = true;
  char sherr[300];
  snprintf(sherr, sizeof sherr, "%s/sh.err", jobs[0]->dir);
  for (int attempt = 0; attempt < 3; attempt++) {
    static char cmd[16 * 8192];
    size_t len = 0;
    for (int i = 0; i < n; i++) {
      if (!todo[i]) continue;
      char one[8192];
      job_command(jobs[i], one, sizeof one);
      len += (size_t)snprintf(cmd + len, sizeof cmd - len, "(%s) & ", one);
    }
    snprintf(cmd + len, sizeof cmd - len, "wait");
    int64_t t0 = ddp_now_ns();
    ddp_test_proc_run(cmd, sherr, 60, NULL);
    double s = (double)(ddp_now_ns() - t0) * 1e-9;
    bool again = false;
    for (int i = 0; i < n; i++) {
      if (!todo[i]) continue;
      print_message("[%s %s] ran in %.2f s (%d jobs at once)\n", jobs[i]->backend,
                    jobs[i]->spec ? jobs[i]->spec : "(no fault)", s, n);
      todo[i] = job_port_taken(jobs[i]);
      if (todo[i]) print_message("the store's port was taken; retrying with another\n");
      again |= todo[i];
    }
    if (!again) break;
  }
  for (int i = 0; i < n; i++) job_collect(jobs[i]);
}

static void job_free(job_t *j) {
  rm_tree(j->dir);
  free(j->log);
  free(j);
}

/* The last 3000 characters of the job's logs, for a failing assertion's context. */
static void dump_tail(const job_t *j) {
  size_t n = strlen(j->log);
  print_message("---- logs (tail) ----\n%s\n----\n", j->log + (n > 3000 ? n - 3000 : 0));
}

static const char *const backends[] = {"threads", "shm", "tcp"};

/* The wait a timeout message reports ("timed out after N ms"), or -1. */
static double reported_wait_ms(const char *msg) {
  const char *p = strstr(msg, "timed out after ");
  return p ? atof(p + strlen("timed out after ")) : -1;
}

/* Every survivor exits 1 with a message containing `want` (per backend), failing between
 * lo_ms and hi_ms after the injection; with `timeout`, the wait its message reports is
 * within [lo_ms, hi_ms] and the failure comes between lo_ms and hi_ms + REACH_MS after the
 * injection. */
static void expect_survivors(const char *kind, const char *spec, const char *const want[3],
                             double lo_ms, double hi_ms, bool timeout, bool fr_names_culprit) {
  job_t *jobs[3];
  for (int b = 0; b < 3; b++) jobs[b] = job_new(backends[b], spec);
  run_jobs(jobs, 3);
  const char *failed = NULL; /* the first backend whose survivors missed */
  for (int b = 0; b < 3; b++) {
    job_t *j = jobs[b];
    bool ok = j->t_inject > 0;
    if (!ok) print_message("[%s %s] the injector logged no time\n", backends[b], kind);
    for (int r = 0; r < WORLD; r++) {
      if (r == CULPRIT) continue;
      double ms = (j->t_fail[r] - j->t_inject) * 1e3, hi = timeout ? hi_ms + REACH_MS : hi_ms;
      bool named = strstr(j->msg[r], want[b]) != NULL;
      print_message("[%s %s] rank %d: exit %d, failed %.1f ms after the injection "
                    "(expected %.0f..%.0f), names \"%s\": %s\n  %.600s\n",
                    backends[b], kind, r, j->rc[r], ms, lo_ms, hi, want[b], named ? "yes" : "NO",
                    j->msg[r]);
      ok &= j->rc[r] == 1 && j->t_fail[r] > 0 && named && ms >= lo_ms && ms <= hi;
      if (timeout) {
        double w = reported_wait_ms(j->msg[r]);
        print_message("[%s %s] rank %d: reported wait %.0f ms (expected %.0f..%.0f)\n", backends[b],
                      kind, r, w, lo_ms, hi_ms);
        ok &= w >= lo_ms && w <= hi_ms;
      }
    }
    /* The flight-recorder analyzer, from the dumps alone, names the same culprit. */
    bool fr_ok = j->fr_n == 1 && j->fr_culprits[0] == CULPRIT;
    print_message("[%s %s] ddp-fr-trace: culprits %s%d%s (%d named), expected %s: %s\n  %.500s\n",
                  backends[b], kind, j->fr_n > 0 ? "[" : "", j->fr_n > 0 ? j->fr_culprits[0] : -1,
                  j->fr_n > 0 ? "]" : "", j->fr_n, fr_names_culprit ? "[1]" : "none",
                  fr_ok == fr_names_culprit ? "yes" : "NO", j->fr_verdict);
    if (j->fr_n >= 0) ok &= fr_names_culprit ? fr_ok : j->fr_n == 0;
    if (!ok) dump_tail(j);
    job_free(j);
    if (!ok && !failed) failed = backends[b];
  }
  if (failed)
    fail_msg("[%s %s] a survivor or the analyzer did not blame rank 1 as expected (see above)",
             failed, kind);
}

static void test_crash(void **state) {
  (void)state;
  /* threads: the culprit aborts its group; shm: its pidfd; tcp: its closed connection. */
  static const char *const want[3] = {"rank 1 aborted the group", "rank 1 (pid", "rank 1 ("};
  expect_survivors("crash", "rank=1,step=3,kind=crash", want, 0, 1000, false, true);
}

static void test_hang(void **state) {
  (void)state;
  static const char *const want[3] = {"waiting for rank 1", "waiting for rank 1",
                                      "waiting for rank 1"};
  expect_survivors("hang", "rank=1,step=3,kind=hang", want, TIMEOUT_S * 900.0, TIMEOUT_S * 1100.0,
                   true, true);
}

static void test_slow_past_timeout(void **state) {
  (void)state;
  static const char *const want[3] = {"waiting for rank 1", "waiting for rank 1",
                                      "waiting for rank 1"};
  expect_survivors("slow:3600", "rank=1,step=3,kind=slow:3600", want, TIMEOUT_S * 900.0,
                   TIMEOUT_S * 1100.0, true, true);
}

static void test_skip_backward(void **state) {
  (void)state;
  static const char *const want[3] = {"but rank 1 runs allreduce", "but rank 1 runs allreduce",
                                      "but rank 1 runs allreduce"};
  expect_survivors("skip_backward", "rank=1,step=3,kind=skip_backward", want, 0, 1000, false, true);
}

static void test_wrong_shape(void **state) {
  (void)state;
  static const char *const want[3] = {"but rank 1 runs allreduce", "but rank 1 runs allreduce",
                                      "but rank 1 runs allreduce"};
  expect_survivors("wrong_shape", "rank=1,step=3,kind=wrong_shape", want, 0, 1000, false, true);
  /* The same at a collective number instead of a step: #12 is step 3's loss allreduce (count
   * 1 issued as 0). */
  expect_survivors("wrong_shape@#12", "rank=1,collective=12,kind=wrong_shape", want, 0, 1000, false,
                   true);
}

static void test_corrupt_after(void **state) {
  (void)state;
  static const char *const want[3] = {"rank 1 holds 0x", "rank 1 holds 0x", "rank 1 holds 0x"};
  expect_survivors("corrupt_bucket:after", "rank=1,step=3,kind=corrupt_bucket:after", want, 0, 1000,
                   false, false);
}

/* Flipped bits in rank 1's bucket before the allreduce reach every rank through the average:
 * the replicas stay equal, so no check fires; the run ends with other parameters than a
 * clean one (that divergence is the only sign). A slow rank below the timeout only delays. */
static void test_undetected_kinds(void **state) {
  (void)state;
  for (int b = 0; b < 3; b++) {
    job_t *clean = job_new(backends[b], NULL);
    job_t *bad = job_new(backends[b], "rank=1,step=3,kind=corrupt_bucket");
    job_t *slow = job_new(backends[b], "rank=1,step=3,kind=slow:300");
    run_jobs((job_t *[]){clean, bad, slow}, 3);
    print_message("[%s] clean: exit %d, parameters %s; corrupt_bucket: exit %d, parameters %s, "
                  "injected: %s; slow:300: exit %d, parameters %s\n",
                  backends[b], clean->rc[0], clean->hash[0], bad->rc[0], bad->hash[0],
                  bad->t_inject > 0 ? "yes" : "NO", slow->rc[0], slow->hash[0]);
    bool ok = clean->rc[0] == 0 && bad->rc[0] == 0 && slow->rc[0] == 0 && bad->t_inject > 0 &&
              slow->t_inject > 0 && clean->hash[0][0] &&
              strcmp(clean->hash[0], bad->hash[0]) != 0 && !strcmp(clean->hash[0], slow->hash[0]);
    for (int r = 0; r < WORLD; r++) ok &= bad->rc[r] == 0 && slow->rc[r] == 0;
    if (!ok) {
      dump_tail(bad);
      dump_tail(slow);
    }
    job_free(clean);
    job_free(bad);
    job_free(slow);
    if (!ok) fail_msg("[%s] corrupt_bucket / slow:300 did not end as documented", backends[b]);
  }
}

/* A malformed spec: exit 2 and a message naming the field, from the flag and from
 * DDP_FAULT. */
static void test_bad_spec(void **state) {
  (void)state;
  struct {
    const char *spec, *field;
  } cases[] = {
      {"rank=1,step=3,kind=explode", "field 'kind'"},
      {"rank=x,step=3,kind=crash", "field 'rank'"},
      {"rank=1,step=-2,kind=crash", "field 'step'"},
      {"rank=1,kind=crash", "field 'step'"},
      {"rank=1,step=3,collective=4,kind=crash", "field 'collective'"},
      {"rank=1,step=3,kind=slow", "field 'kind'"},
      {"rank=1,step=3,kind=slow:abc", "field 'kind'"},
      {"rank=1,collective=3,kind=skip_backward", "field 'collective'"},
      {"rank=1,step=3,kind=crash,when=now", "field 'when'"},
      {"step=3,kind=crash", "field 'rank'"},
  };
  char dir[] = "/tmp/ddp-test-faults-XXXXXX";
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  char err[320];
  snprintf(err, sizeof err, "%s/err", dir);
  bool ok = true;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    for (int env = 0; env < 2; env++) {
      char cmd[4096];
      snprintf(cmd, sizeof cmd, "%s%s%s'%s' --max_steps 1 %s%s%s", env ? "DDP_FAULT='" : "",
               env ? cases[i].spec : "", env ? "' " : "", ddp_test_tool("ddp-train"),
               env ? "" : "--ddp_fault '", env ? "" : cases[i].spec, env ? "" : "'");
      int rc = ddp_test_proc_run(cmd, err, 30, NULL);
      char *text = slurp(err);
      bool good = rc == 2 && strstr(text, cases[i].field);
      print_message("%s \"%s\": exit %d, wants %s: %s", env ? "DDP_FAULT" : "--ddp_fault",
                    cases[i].spec, rc, cases[i].field, text);
      ok &= good;
      free(text);
    }
  }
  rm_tree(dir);
  if (!ok) fail_msg("a bad spec was not refused with exit 2 naming its field (see above)");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_spec),      cmocka_unit_test(test_crash),
      cmocka_unit_test(test_skip_backward), cmocka_unit_test(test_wrong_shape),
      cmocka_unit_test(test_corrupt_after), cmocka_unit_test(test_undetected_kinds),
      cmocka_unit_test(test_hang),          cmocka_unit_test(test_slow_past_timeout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
