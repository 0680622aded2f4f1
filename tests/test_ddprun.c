/* Tests of the launcher tools/ddprun, run as a program on small /bin/sh ranks: the
 * environment each rank gets, [rankN] prefixes on whole lines, exit-code propagation and
 * naming of the first failed rank, teardown after a rank is killed, SIGKILL after the
 * grace period, SIGINT/SIGTERM forwarding, and usage errors. Ranks that would sleep 30 s
 * are always stopped by ddprun, and each test asserts that this happened quickly. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cleanup.h" /* DDP_TEST_BOUND_MS: bounds that grow with the load */
#include "proc.h"    /* ddp_test_free_port */

/* ---------------------------------------------------------------- runner ---------- */

#define RUN_TIMEOUT_MS 20000
#define MAX_ENV 4

typedef struct run_opts {
  const char *env[MAX_ENV][2]; /* set in ddprun's environment (name, value) */
  /* Send `signal` to ddprun once its stdout holds `wait_count` copies of `wait_for`. */
  const char *wait_for;
  int wait_count;
  int signal;
} run_opts_t;

typedef struct run_result {
  int exit_code; /* -1 when killed by a signal */
  int term_sig;
  bool timed_out;
  double elapsed_ms;
  char *out, *err; /* NUL-terminated, malloc'd */
  size_t out_len, err_len;
} run_result_t;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static const char *ddprun_path(void) {
  static char path[4096];
  const char *root = getenv("DDP_BUILD_ROOT");
  assert_non_null(root);
  snprintf(path, sizeof path, "%s/tools/ddprun", root);
  assert_int_equal(access(path, X_OK), 0);
  return path;
}

static void append(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
  if (*len + n + 1 > *cap) {
    while (*len + n + 1 > *cap) *cap = *cap ? 2 * *cap : 4096;
    *buf = realloc(*buf, *cap);
    assert_non_null(*buf);
  }
  memcpy(*buf + *len, p, n);
  *len += n;
  (*buf)[*len] = '\0';
}

static int count_of(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

/* Runs ddprun with args (NULL-terminated) and collects its output, exit status and wall
 * time. ddprun is killed after RUN_TIMEOUT_MS, which fails the calling test. */
/* True when args name the store's port or the nodes (or ask for help): run_ddprun leaves
 * those alone. */
static bool names_port_or_nodes(const char *const *args) {
  for (int i = 0; args[i]; i++)
    if (strstr(args[i], "master_port") || strstr(args[i], "master-port") ||
        strstr(args[i], "nnodes") || strcmp(args[i], "--help") == 0)
      return true;
  return false;
}

/* Runs ddprun with args; a job that names no port or node runs with --standalone, since
 * ddprun reserves the default port 29500 on this machine, which another job may hold. */
static void run_ddprun(const char *const *args, const run_opts_t *o, run_result_t *res) {
  static const run_opts_t none = {0};
  if (!o) o = &none;
  memset(res, 0, sizeof *res);
  const char *argv[64];
  int n = 0;
  argv[n++] = ddprun_path();
  if (!names_port_or_nodes(args)) argv[n++] = "--standalone";
  for (int i = 0; args[i]; i++) argv[n++] = args[i];
  argv[n] = NULL;

  int po[2], pe[2];
  assert_int_equal(pipe2(po, O_CLOEXEC), 0);
  assert_int_equal(pipe2(pe, O_CLOEXEC), 0);
  double t0 = now_ms();
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    dup2(po[1], STDOUT_FILENO);
    dup2(pe[1], STDERR_FILENO);
    unsetenv("DDP_JOB_TOKEN");
    unsetenv("DDP_BACKEND");
    unsetenv("DDP_TIMEOUT");
    for (int i = 0; i < MAX_ENV && o->env[i][0]; i++) setenv(o->env[i][0], o->env[i][1], 1);
    execv(argv[0], (char *const *)argv);
    _exit(126);
  }
  close(po[1]);
  close(pe[1]);

  size_t ocap = 0, ecap = 0;
  append(&res->out, &res->out_len, &ocap, "", 0);
  append(&res->err, &res->err_len, &ecap, "", 0);
  bool sent = false;
  int fds[2] = {po[0], pe[0]};
  while (fds[0] >= 0 || fds[1] >= 0) {
    double left = RUN_TIMEOUT_MS - (now_ms() - t0);
    if (left <= 0) {
      res->timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    struct pollfd p[2] = {{.fd = fds[0], .events = POLLIN}, {.fd = fds[1], .events = POLLIN}};
    int k = poll(p, 2, (int)left + 1);
    if (k < 0 && errno == EINTR) continue;
    assert_true(k >= 0);
    for (int j = 0; j < 2; j++) {
      if (fds[j] < 0 || !(p[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[8192];
      ssize_t r = read(fds[j], buf, sizeof buf);
      if (r > 0) {
        if (j == 0)
          append(&res->out, &res->out_len, &ocap, buf, (size_t)r);
        else
          append(&res->err, &res->err_len, &ecap, buf, (size_t)r);
      } else if (r == 0 || errno != EINTR) {
        close(fds[j]);
        fds[j] = -1;
      }
    }
    if (o->signal && !sent && count_of(res->out, o->wait_for) >= o->wait_count) {
      kill(pid, o->signal);
      sent = true;
    }
  }
  for (int j = 0; j < 2; j++)
    if (fds[j] >= 0) close(fds[j]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  res->elapsed_ms = now_ms() - t0;
  res->exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  res->term_sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  if (o->signal) assert_true(sent);
  if (res->timed_out)
    fail_msg("ddprun did not finish in %d ms; stderr:\n%s", RUN_TIMEOUT_MS, res->err);
}

static void run_free(run_result_t *res) {
  free(res->out);
  free(res->err);
}

/* The value of KEY in a line of space-separated KEY=VALUE words, copied into buf. */
static const char *kv(const char *line, const char *key, char *buf, size_t cap) {
  char pat[32];
  snprintf(pat, sizeof pat, " %s=", key);
  const char *p = strstr(line, pat);
  if (!p) fail_msg("no %s= in line: %.200s", key, line);
  p += strlen(pat);
  size_t n = strcspn(p, " \n");
  if (n >= cap) n = cap - 1;
  memcpy(buf, p, n);
  buf[n] = '\0';
  return buf;
}

static void assert_contains(const char *hay, const char *needle) {
  if (!strstr(hay, needle)) fail_msg("expected \"%s\" in:\n%s", needle, hay);
}

/* ---------------------------------------------------------------- environment ----- */

#define PRINT_ENV                                                                      \
  "echo \"ENV R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK " \
  "A=$MASTER_ADDR P=$MASTER_PORT B=${DDP_BACKEND-unset} TO=${DDP_TIMEOUT-unset} "      \
  "T=$DDP_JOB_TOKEN\""

typedef struct env_expect {
  int nproc, nnodes, node_rank, port;
  const char *addr, *backend, *timeout, *token; /* token NULL: 32 hex digits, shared */
} env_expect_t;

/* Checks one line per rank with the right prefix and values; returns the shared token. */
static void check_env_lines(const run_result_t *res, const env_expect_t *e, char *token_out) {
  assert_int_equal(res->exit_code, 0);
  assert_string_equal(res->err, "");
  int seen[64] = {0};
  char token[128] = "";
  int lines = 0;
  for (const char *line = res->out; *line; line = strchr(line, '\n') + 1) {
    assert_non_null(strchr(line, '\n'));
    int prefix_rank = -1, off = 0;
    assert_int_equal(sscanf(line, "[rank%d]: ENV%n", &prefix_rank, &off), 1);
    assert_true(off > 0);
    char v[128];
    int rank = atoi(kv(line, "R", v, sizeof v));
    int local = atoi(kv(line, "L", v, sizeof v));
    assert_int_equal(prefix_rank, rank);
    assert_int_equal(rank, e->node_rank * e->nproc + local);
    assert_true(local >= 0 && local < e->nproc);
    seen[local]++;
    assert_int_equal(atoi(kv(line, "W", v, sizeof v)), e->nnodes * e->nproc);
    assert_int_equal(atoi(kv(line, "LW", v, sizeof v)), e->nproc);
    assert_int_equal(atoi(kv(line, "G", v, sizeof v)), e->node_rank);
    assert_string_equal(kv(line, "A", v, sizeof v), e->addr);
    assert_int_equal(atoi(kv(line, "P", v, sizeof v)), e->port);
    assert_string_equal(kv(line, "B", v, sizeof v), e->backend);
    assert_string_equal(kv(line, "TO", v, sizeof v), e->timeout);
    kv(line, "T", v, sizeof v);
    if (e->token) {
      assert_string_equal(v, e->token);
    } else {
      assert_int_equal(strlen(v), 32);
      assert_int_equal(strspn(v, "0123456789abcdef"), 32);
    }
    if (token[0])
      assert_string_equal(v, token); /* one token per job */
    else
      strcpy(token, v);
    lines++;
  }
  assert_int_equal(lines, e->nproc);
  for (int i = 0; i < e->nproc; i++) assert_int_equal(seen[i], 1);
  if (token_out) strcpy(token_out, token);
}

/* One node: '-' and '=' spellings, every variable, and a fresh random token per job. */
static void test_env_single_node(void **state) {
  (void)state;
  /* A port from the kernel: ddprun reserves it (binds it) before starting the ranks, so a
   * fixed number here would fail whenever another job on this machine holds it. */
  char port_arg[32];
  int port = ddp_test_free_port();
  snprintf(port_arg, sizeof port_arg, "--master_port=%d", port);
  const char *args[] = {"--nproc-per-node=3",
                        port_arg,
                        "--backend",
                        "gloo",
                        "--timeout=77",
                        "/bin/sh",
                        "-c",
                        PRINT_ENV,
                        NULL};
  env_expect_t e = {3, 1, 0, port, "127.0.0.1", "gloo", "77", NULL};
  char t1[128], t2[128];
  run_result_t res;
  run_ddprun(args, NULL, &res);
  check_env_lines(&res, &e, t1);
  run_free(&res);
  run_ddprun(args, NULL, &res);
  check_env_lines(&res, &e, t2);
  run_free(&res);
  assert_string_not_equal(t1, t2);

  /* Defaults: the port 29500 and DDP_BACKEND and DDP_TIMEOUT left alone, seen on node 1 of
   * 2 (only node 0 reserves the port, so nothing binds 29500 here); the address 127.0.0.1,
   * seen on a one-node run that names no address (run_ddprun adds --standalone). */
  const char *dflt[] = {"--nnodes",  "2",       "--node_rank", "1",       "--master_addr",
                        "127.0.0.1", "/bin/sh", "-c",          PRINT_ENV, NULL};
  run_opts_t o = {.env = {{"DDP_JOB_TOKEN", "defaults-token"}}};
  env_expect_t d = {1, 2, 1, 29500, "127.0.0.1", "unset", "unset", "defaults-token"};
  run_ddprun(dflt, &o, &res);
  check_env_lines(&res, &d, NULL);
  run_free(&res);
  const char *one[] = {"/bin/sh", "-c", PRINT_ENV, NULL};
  run_ddprun(one, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  assert_non_null(strstr(res.out, " A=127.0.0.1 "));
  run_free(&res);
}

/* Second node of two: global ranks continue after node 0's; the token comes from the env. */
static void test_env_multi_node(void **state) {
  (void)state;
  const char *args[] = {"--nnodes",
                        "2",
                        "--node_rank",
                        "1",
                        "--nproc_per_node",
                        "2",
                        "--master_addr",
                        "10.0.0.7",
                        "--master-port",
                        "29712",
                        "--",
                        "/bin/sh",
                        "-c",
                        PRINT_ENV,
                        NULL};
  run_opts_t o = {.env = {{"DDP_JOB_TOKEN", "shared-token-42"}}};
  env_expect_t e = {2, 2, 1, 29712, "10.0.0.7", "unset", "unset", "shared-token-42"};
  run_result_t res;
  run_ddprun(args, &o, &res);
  check_env_lines(&res, &e, NULL);
  run_free(&res);

  /* Without a shared token each node would draw its own: refused. */
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 2);
  assert_contains(res.err, "DDP_JOB_TOKEN");
  assert_string_equal(res.out, "");
  run_free(&res);
}

/* ---------------------------------------------------------------- output ---------- */

/* Lines of both streams get the rank's prefix; an unfinished last line is flushed. */
static void test_prefix_lines(void **state) {
  (void)state;
  const char *args[] = {"--nproc_per_node",
                        "2",
                        "/bin/sh",
                        "-c",
                        "echo a; echo b; echo e$RANK >&2; printf tail$RANK",
                        NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  for (int r = 0; r < 2; r++) {
    /* Per rank, in order: its three stdout lines; and its stderr line. */
    char want[3][32];
    snprintf(want[0], sizeof want[0], "[rank%d]: a\n", r);
    snprintf(want[1], sizeof want[1], "[rank%d]: b\n", r);
    snprintf(want[2], sizeof want[2], "[rank%d]: tail%d\n", r, r);
    const char *p = res.out;
    for (int k = 0; k < 3; k++) {
      const char *q = strstr(p, want[k]);
      if (!q) fail_msg("missing or out of order: %s in\n%s", want[k], res.out);
      p = q + strlen(want[k]);
    }
    char e[32];
    snprintf(e, sizeof e, "[rank%d]: e%d\n", r, r);
    assert_contains(res.err, e);
  }
  assert_int_equal(res.out_len, 2 * (strlen("[rank0]: a\n") * 2 + strlen("[rank0]: tail0\n")));
  assert_int_equal(res.err_len, 2 * strlen("[rank0]: e0\n"));
  run_free(&res);
}

/* Long lines written in pieces by four ranks at once never mix: every output line is one
 * rank's prefix followed by exactly that rank's 3000 digits. */
static void test_lines_do_not_interleave(void **state) {
  (void)state;
  enum { NPROC = 4, LINES = 150, WIDTH = 3000 };
  const char *args[] = {"--nproc_per_node",
                        "4",
                        "/bin/sh",
                        "-c",
                        "s=$(printf '%3000s' '' | tr ' ' \"$RANK\"); i=0; "
                        "while [ $i -lt 150 ]; do echo \"$s\"; echo \"$s\" >&2; i=$((i+1)); done",
                        NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  const char *streams[2] = {res.out, res.err};
  for (int s = 0; s < 2; s++) {
    int per_rank[NPROC] = {0};
    for (const char *line = streams[s]; *line;) {
      const char *end = strchr(line, '\n');
      assert_non_null(end);
      int r = -1, off = 0;
      assert_int_equal(sscanf(line, "[rank%d]: %n", &r, &off), 1);
      assert_true(r >= 0 && r < NPROC && off > 0);
      assert_int_equal(end - (line + off), WIDTH);
      for (const char *c = line + off; c < end; c++)
        if (*c != '0' + r) fail_msg("rank %d's line holds '%c' at %td", r, *c, c - line);
      per_rank[r]++;
      line = end + 1;
    }
    for (int r = 0; r < NPROC; r++) assert_int_equal(per_rank[r], LINES);
  }
  run_free(&res);

  /* A line longer than ddprun's 64 KiB line buffer comes out in prefixed pieces, whole. */
  const char *big[] = {"/bin/sh", "-c", "printf '%70000s\\n' '' | tr ' ' x", NULL};
  run_ddprun(big, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  size_t payload = 0;
  int pieces = 0;
  for (const char *line = res.out; *line; pieces++) {
    const char *end = strchr(line, '\n');
    assert_non_null(end);
    assert_memory_equal(line, "[rank0]: ", 9);
    assert_int_equal(strspn(line + 9, "x"), (size_t)(end - line - 9));
    payload += (size_t)(end - line - 9);
    line = end + 1;
  }
  assert_int_equal(payload, 70000);
  assert_int_equal(pieces, 2);
  run_free(&res);
}

/* ---------------------------------------------------------------- failures -------- */

/* A rank exiting 3 makes ddprun exit 3, naming that rank; the others (one sleeping, one
 * that exits 4 when told to stop) are stopped at once and are not reported as first. */
static void test_exit_code_propagates(void **state) {
  (void)state;
  const char *args[] = {"--nproc_per_node",
                        "3",
                        "/bin/sh",
                        "-c",
                        "case $RANK in 1) exit 3;; 2) trap 'exit 4' TERM; sleep 30 & wait;; "
                        "*) sleep 30;; esac",
                        NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 3);
  assert_contains(res.err, "ddprun: rank 1 (pid ");
  assert_contains(res.err, "failed first: exited with code 3");
  assert_int_equal(count_of(res.err, "failed first"), 1);
  assert_true(res.elapsed_ms < DDP_TEST_BOUND_MS(5000));
  run_free(&res);

  /* All ranks exit 0 -> 0, and nothing from ddprun itself. */
  const char *ok[] = {"--nproc_per_node", "3", "/bin/true", NULL};
  run_ddprun(ok, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  assert_string_equal(res.err, "");
  assert_string_equal(res.out, "");
  run_free(&res);
}

/* Rank 1 kills itself with SIGKILL while rank 0 sleeps 30 s: rank 0 is torn down within
 * 5 s and ddprun exits 128 + 9, naming the rank and the signal. */
static void test_killed_rank_tears_down(void **state) {
  (void)state;
  const char *args[] = {"--nproc_per_node",
                        "2",
                        "/bin/sh",
                        "-c",
                        "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 30",
                        NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 128 + SIGKILL);
  assert_contains(res.err, "ddprun: rank 1 (pid ");
  assert_contains(res.err, "failed first: killed by signal 9 (SIGKILL)");
  assert_true(res.elapsed_ms < DDP_TEST_BOUND_MS(5000));
  run_free(&res);
}

/* A rank that ignores SIGTERM is killed when the grace period (0.5 s) ends: the run takes
 * at least the grace period and far less than the rank's 30 s sleep. */
static void test_grace_period_then_sigkill(void **state) {
  (void)state;
  /* mkdtemp's template: the last six characters are replaced. */
  char dir[] = "/tmp/ddprun-test-......";
  memset(dir + strlen(dir) - 6, 'X', 6);
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  const char *args[] = {"--nproc_per_node",
                        "2",
                        "--grace-period",
                        "0.5",
                        "/bin/sh",
                        "-c",
                        "if [ $RANK = 0 ]; then trap '' TERM; touch \"$T_DIR/ready\"; sleep 30; "
                        "else while [ ! -e \"$T_DIR/ready\" ]; do sleep 0.02; done; exit 1; fi",
                        NULL};
  run_opts_t o = {.env = {{"T_DIR", dir}}};
  run_result_t res;
  run_ddprun(args, &o, &res);
  char ready[64];
  snprintf(ready, sizeof ready, "%s/ready", dir);
  unlink(ready);
  rmdir(dir);
  assert_int_equal(res.exit_code, 1);
  assert_contains(res.err, "failed first: exited with code 1");
  assert_contains(res.err, "sending SIGKILL");
  assert_true(res.elapsed_ms >= 500);
  assert_true(res.elapsed_ms < DDP_TEST_BOUND_MS(5000));
  run_free(&res);
}

/* A program that cannot be executed: the rank exits 127 and ddprun says why. */
static void test_exec_failure(void **state) {
  (void)state;
  const char *args[] = {"/nonexistent/ddprun-test-prog", NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 127);
  assert_contains(res.err, "[rank0]: ddprun: cannot execute '/nonexistent/ddprun-test-prog'");
  assert_contains(res.err, "rank 0 (pid ");
  run_free(&res);
}

/* A file of `text` at dir/name, made executable. */
static void write_exec(const char *dir, const char *name, const char *text, char *path,
                       size_t cap) {
  snprintf(path, cap, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  assert_int_equal(fclose(f), 0);
  assert_int_equal(chmod(path, 0755), 0);
}

/* torchrun's command forms: a *.py file and -m/--module run through `python -u [-m]`
 * ($PYTHON_EXEC, here a stand-in that prints its arguments), --no_python runs the file
 * itself, --run_path any name through Python; --role and --rdzv_id reach ROLE_NAME and
 * TORCHELASTIC_RUN_ID, torchrun's other rendezvous flags are accepted; a program in the
 * current directory but not on PATH gets a hint. */
static void test_python_programs(void **state) {
  (void)state;
  char dir[] = "/tmp/ddprun-test-py-XXXXXX", py[256], script[256], other[256];
  assert_non_null(mkdtemp(dir));
  write_exec(dir, "fakepy", "#!/bin/sh\necho \"py $* role=$ROLE_NAME run=$TORCHELASTIC_RUN_ID\"\n",
             py, sizeof py);
  write_exec(dir, "train.py", "#!/bin/sh\necho \"self $*\"\n", script, sizeof script);
  write_exec(dir, "train", "#!/bin/sh\necho \"self $*\"\n", other, sizeof other);
  run_opts_t o = {.env = {{"PYTHON_EXEC", py}}};
  char want[512];
  static const char *const mod_flags[] = {"--nproc_per_node",
                                          "2",
                                          "--module",
                                          "--role",
                                          "trainer",
                                          "--rdzv_id",
                                          "job7",
                                          "--rdzv_backend",
                                          "c10d",
                                          "--monitor_interval",
                                          "1",
                                          "--start_method",
                                          "fork",
                                          "--rdzv_conf",
                                          "join_timeout=5",
                                          "pkg.mod",
                                          NULL};
  struct {
    const char *args[8];
    const char *line; /* what each of the 2 ranks prints; %s: the script's path */
  } cases[] = {
      {{"--nproc_per_node", "2", script, "x", NULL}, "py -u %s x role=default run=none"},
      {{"--nproc_per_node", "2", "-m", "pkg.mod", "y", NULL}, "py -u -m pkg.mod y role=default"},
      {{"--nproc_per_node", "2", "--no_python", script, "z", NULL}, "self z"},
      {{"--nproc_per_node", "2", "--run_path", other, NULL}, "py -u %s role=default"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    run_result_t res;
    run_ddprun(cases[i].args, &o, &res);
    snprintf(want, sizeof want, cases[i].line, i == 3 ? other : script);
    if (res.exit_code != 0 || count_of(res.out, want) != 2)
      fail_msg("case %zu: exit %d, stdout:\n%s(expected 2 lines with \"%s\")", i, res.exit_code,
               res.out, want);
    run_free(&res);
  }
  run_result_t res;
  run_ddprun(mod_flags, &o, &res);
  assert_int_equal(res.exit_code, 0);
  assert_int_equal(count_of(res.out, "py -u -m pkg.mod role=trainer run=job7\n"), 2);
  run_free(&res);

  char cwd[4096];
  assert_non_null(getcwd(cwd, sizeof cwd));
  assert_int_equal(chdir(dir), 0);
  const char *rel[] = {"train", NULL};
  run_ddprun(rel, NULL, &res);
  assert_int_equal(chdir(cwd), 0);
  assert_int_equal(res.exit_code, 127);
  assert_contains(res.err, "'train' is in the current directory but not on PATH: run it as "
                           "'./train'");
  run_free(&res);
  unlink(py);
  unlink(script);
  unlink(other);
  rmdir(dir);
}

/* The whole content of a file, or "" when it cannot be read; malloc'd. */
static char *slurp(const char *path) {
  char *buf = calloc(1, 1);
  size_t len = 0, cap = 1;
  FILE *f = fopen(path, "r");
  if (f) {
    char chunk[512];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) append(&buf, &len, &cap, chunk, k);
    fclose(f);
  }
  return buf;
}

/* torchrun's --log_dir, --redirects and --tee: each logged stream in
 * <dir>/<run_id>_<pid>/attempt_<n>/<local_rank>/std{out,err}.log, byte for byte; redirected
 * streams only there, teed ones also on ddprun's output; a restart writes attempt_1. */
static void test_log_files(void **state) {
  (void)state;
  char dir[] = "/tmp/ddprun-test-logs-XXXXXX";
  assert_non_null(mkdtemp(dir));
  /* Rank 1 fails in attempt 0, once rank 0's stdout has reached its log file (ddprun's pid is
   * the rank's parent): failing at once, it had ddprun stop rank 0 before rank 0 wrote. */
  char script[1024];
  snprintf(script, sizeof script,
           "echo \"err $RANK\" >&2; echo \"out $RANK $TORCHELASTIC_RESTART_COUNT\"; "
           "if [ \"$TORCHELASTIC_RESTART_COUNT$RANK\" = 01 ]; then "
           "f=%s/job9_$PPID/attempt_0/0/stdout.log; i=0; "
           "while [ ! -s $f ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi",
           dir);
  const char *args[] = {"--nproc_per_node", "2",    "--log_dir",      dir,
                        "--redirects",      "1",    "--tee",          "0:2",
                        "--rdzv_id",        "job9", "--max_restarts", "1",
                        "/bin/sh",          "-c",   script,           NULL};
  run_result_t res;
  run_ddprun(args, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  /* where: "rank logs in <dir>/job9_<pid> (" */
  const char *at = strstr(res.err, "rank logs in ");
  assert_non_null(at);
  at += strlen("rank logs in ");
  const char *end = strstr(at, " (");
  assert_non_null(end);
  char run[512];
  snprintf(run, sizeof run, "%.*s", (int)(end - at), at);
  char want_prefix[128];
  snprintf(want_prefix, sizeof want_prefix, "%s/job9_", dir);
  assert_int_equal(strncmp(run, want_prefix, strlen(want_prefix)), 0);
  static const struct {
    const char *file, *content; /* "" = must not exist */
  } files[] = {
      {"attempt_0/0/stdout.log", "out 0 0\n"}, {"attempt_0/0/stderr.log", "err 0\n"},
      {"attempt_0/1/stdout.log", "out 1 0\n"}, {"attempt_0/1/stderr.log", ""},
      {"attempt_1/0/stdout.log", "out 0 1\n"}, {"attempt_1/1/stdout.log", "out 1 1\n"},
  };
  char path[1024];
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    snprintf(path, sizeof path, "%s/%s", run, files[i].file);
    char *got = slurp(path);
    if (strcmp(got, files[i].content) != 0 || (!files[i].content[0] && access(path, F_OK) == 0))
      fail_msg("%s: got \"%s\", want \"%s\"", files[i].file, got, files[i].content);
    free(got);
  }
  /* stdout redirected on both ranks: nothing of it on ddprun's; stderr teed on rank 0 and
   * left alone on rank 1: both on ddprun's stderr */
  assert_int_equal(count_of(res.out, "out "), 0);
  assert_int_equal(count_of(res.err, "[rank0]: err 0\n"), 2);
  assert_int_equal(count_of(res.err, "[rank1]: err 1\n"), 2);
  run_free(&res);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

/* ---------------------------------------------------------------- signals --------- */

/* SIGTERM and SIGINT sent to ddprun reach every rank (which trap it and say so); ddprun
 * then exits 128 + the signal. */
static void test_signals_forwarded(void **state) {
  (void)state;
  const int sigs[2] = {SIGTERM, SIGINT};
  const char *names[2] = {"TERM", "INT"};
  for (int k = 0; k < 2; k++) {
    char script[256];
    snprintf(script, sizeof script, "trap 'echo got-%s; exit 0' %s; echo ready; sleep 30 & wait",
             names[k], names[k]);
    const char *args[] = {"--nproc_per_node", "2", "/bin/sh", "-c", script, NULL};
    run_opts_t o = {.wait_for = "ready\n", .wait_count = 2, .signal = sigs[k]};
    run_result_t res;
    run_ddprun(args, &o, &res);
    char want[64];
    for (int r = 0; r < 2; r++) {
      snprintf(want, sizeof want, "[rank%d]: got-%s\n", r, names[k]);
      assert_contains(res.out, want);
    }
    snprintf(want, sizeof want, "received SIG%s; forwarding it", names[k]);
    assert_contains(res.err, want);
    assert_int_equal(res.exit_code, 128 + sigs[k]);
    assert_int_equal(count_of(res.err, "failed first"), 0);
    assert_true(res.elapsed_ms < DDP_TEST_BOUND_MS(5000));
    run_free(&res);
  }
}

/* ---------------------------------------------------------------- usage ----------- */

/* Bad flags and values exit 2 with a message naming the problem; --help exits 0. */
static void test_usage_errors(void **state) {
  (void)state;
  static const struct {
    const char *args[8];
    const char *msg;
  } cases[] = {
      {{"--bogus", "true"}, "unknown flag '--bogus'"},
      {{"--bogus=1", "true"}, "unknown flag '--bogus'"},
      {{"-x", "true"}, "unknown flag '-x'"},
      {{"--nproc_per_node", "0", "true"}, "--nproc_per_node: '0'"},
      {{"--nproc-per-node=abc", "true"}, "--nproc_per_node: 'abc'"},
      {{"--nproc_per_node"}, "--nproc_per_node needs a value"},
      {{"--master_port", "70000", "true"}, "--master_port: '70000'"},
      {{"--backend", "xccl", "true"}, "unknown backend 'xccl' (choices: shm, tcp, gloo, nccl)"},
      {{"--backend", "threads", "true"}, "--backend threads"},
      {{"--nnodes", "2", "--node_rank", "2", "--master_addr", "h", "true"}, "--node_rank 2"},
      {{"--nnodes", "2", "true"}, "needs --master_addr"},
      {{"--grace-period", "-1", "true"}, "--grace_period: '-1'"},
      {{"--timeout", "0", "true"}, "--timeout: '0'"},
      {{"--nproc_per_node", "2"}, "no program to run"},
      {{"--nnodes", "1:2", "true"}, "--nnodes 1:2: ddprun runs a fixed number of nodes"},
      {{"--rdzv_backend", "etcd", "true"}, "--rdzv_backend etcd"},
      {{"--no_python", "-m", "mod"}, "--no_python and -m/--module"},
      {{"--start_method", "thread", "true"}, "--start_method 'thread'"},
      {{"--log_dir=", "true"}, "--log_dir: empty path"},
      {{"-r", "9", "true"}, "--redirects '9': expected 0 (none)"},
      {{"--nproc_per_node", "2", "--tee", "0:1,2:3", "true"}, "(local ranks 0..1)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    run_result_t res;
    run_ddprun(cases[i].args, NULL, &res);
    if (res.exit_code != 2 || !strstr(res.err, cases[i].msg))
      fail_msg("case %zu: exit %d, stderr:\n%s(expected exit 2 and \"%s\")", i, res.exit_code,
               res.err, cases[i].msg);
    assert_string_equal(res.out, "");
    run_free(&res);
  }
  const char *help[] = {"--help", NULL};
  run_result_t res;
  run_ddprun(help, NULL, &res);
  assert_int_equal(res.exit_code, 0);
  assert_contains(res.out, "usage: ddprun");
  run_free(&res);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env_single_node),
      cmocka_unit_test(test_env_multi_node),
      cmocka_unit_test(test_prefix_lines),
      cmocka_unit_test(test_lines_do_not_interleave),
      cmocka_unit_test(test_exit_code_propagates),
      cmocka_unit_test(test_killed_rank_tears_down),
      cmocka_unit_test(test_grace_period_then_sigkill),
      cmocka_unit_test(test_exec_failure),
      cmocka_unit_test(test_python_programs),
      cmocka_unit_test(test_log_files),
      cmocka_unit_test(test_signals_forwarded),
      cmocka_unit_test(test_usage_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
