/* ddprun's ranks of one attempt: starting them with the torchrun environment, relaying their
 * output line by line, noticing the first failure, stopping the rest (SIGTERM, then SIGKILL
 * after the grace period) and reaping them. The contract is in tools/programs/ddprun.c. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddprun.h"

/* ------------------------------------------------------------------ messages -------- */

/* One message = one write, so ddprun's own lines never split the ranks' lines. */
void say(const char *fmt, ...) {
  char buf[2048];
  int k = snprintf(buf, sizeof buf, "ddprun: ");
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + k, sizeof buf - (size_t)k - 1, fmt, ap);
  va_end(ap);
  size_t len = (size_t)k + (m < 0 ? 0 : (size_t)m);
  if (len > sizeof buf - 2) len = sizeof buf - 2;
  buf[len++] = '\n';
  write_all(STDERR_FILENO, buf, len);
}

const char *signal_name(int sig) {
  static const struct {
    int sig;
    const char *name;
  } names[] = {
      {SIGHUP, "SIGHUP"},       {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"},     {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"},     {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"},     {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGCHLD, "SIGCHLD"},
      {SIGCONT, "SIGCONT"},     {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"}, {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"},     {SIGURG, "SIGURG"},   {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"},
      {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"}, {SIGSYS, "SIGSYS"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (names[i].sig == sig) return names[i].name;
  return "unknown signal";
}

/* Signal handlers can only reach file-scope state; they record and the loop acts. */
static volatile sig_atomic_t g_got_chld, g_got_int, g_got_term;

static void on_signal(int sig) {
  if (sig == SIGCHLD)
    g_got_chld = 1;
  else if (sig == SIGINT)
    g_got_int = 1;
  else if (sig == SIGTERM)
    g_got_term = 1;
}

int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------ output ---------- */

/* Writes everything or gives up on a broken descriptor. ddprun's signals are blocked
 * outside ppoll, so EINTR is rare; a non-blocking stdout inherited from the caller is
 * waited on. */
static bool writev_all(int fd, struct iovec *iov, int n) {
  while (n > 0) {
    ssize_t k = writev(fd, iov, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        poll(&p, 1, 100);
        continue;
      }
      return false;
    }
    size_t left = (size_t)k;
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      iov++;
      n--;
    }
    if (n > 0) {
      iov->iov_base = (char *)iov->iov_base + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

void write_all(int fd, const char *p, size_t n) {
  struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
  (void)writev_all(fd, &iov, 1);
}

/* Passes on the complete lines at the front of s->buf, each behind the rank's prefix, and
 * keeps the unfinished rest. With `all`, the rest goes too, ended by a newline: at EOF, or
 * when a line has filled the buffer. Lines go out in batches, one writev per batch; a
 * line is never split between two ranks' output because ddprun is the only writer and
 * writes each batch to completion. */
static void emit_lines(launcher_t *L, rank_proc_t *r, line_stream_t *s, bool all) {
  static const char nl = '\n';
  if (s->len == 0) return;
  struct iovec iov[2 * BATCH_LINES + 1];
  int n = 0;
  size_t start = 0;
  bool dead = L->out_dead[s->out_fd];
  while (start < s->len) {
    char *p = memchr(s->buf + start, '\n', s->len - start);
    size_t end;
    if (p) {
      end = (size_t)(p - s->buf) + 1;
    } else if (all) {
      end = s->len;
    } else {
      break;
    }
    if (!dead) {
      iov[n++] = (struct iovec){.iov_base = r->prefix, .iov_len = r->prefix_len};
      iov[n++] = (struct iovec){.iov_base = s->buf + start, .iov_len = end - start};
      if (!p) iov[n++] = (struct iovec){.iov_base = (void *)&nl, .iov_len = 1};
      if (n >= 2 * BATCH_LINES - 1) {
        if (!writev_all(s->out_fd, iov, n)) dead = true;
        n = 0;
      }
    }
    start = end;
  }
  if (n > 0 && !dead && !writev_all(s->out_fd, iov, n)) dead = true;
  L->out_dead[s->out_fd] = dead;
  memmove(s->buf, s->buf + start, s->len - start);
  s->len -= start;
}

static void close_stream(launcher_t *L, rank_proc_t *r, line_stream_t *s) {
  close_stream_log(s);
  if (s->fd < 0) return;
  emit_lines(L, r, s, true);
  close(s->fd);
  s->fd = -1;
}

/* Reads once from a ready pipe (once, so that one chatty rank cannot starve the others). */
static void pump_stream(launcher_t *L, rank_proc_t *r, line_stream_t *s) {
  if (s->len == LINE_CAP) emit_lines(L, r, s, true);
  ssize_t k = read(s->fd, s->buf + s->len, LINE_CAP - s->len);
  if (k > 0) {
    /* the log file gets the bytes as written; a redirected stream goes nowhere else */
    if (s->log_fd >= 0) write_all(s->log_fd, s->buf + s->len, (size_t)k);
    if (s->quiet) return;
    s->len += (size_t)k;
    emit_lines(L, r, s, s->len == LINE_CAP);
  } else if (k == 0) {
    close_stream(L, r, s);
  } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
    say("reading the %s of rank %d: %s (errno %d)", s->out_fd == 1 ? "stdout" : "stderr", r->rank,
        strerror(errno), errno);
    close_stream(L, r, s);
  }
}

/* Waits up to timeout_ms (-1: until a signal or data) and pumps whatever is readable. */
static void poll_streams(launcher_t *L, int timeout_ms, const sigset_t *wait_mask) {
  int n = 0;
  for (int i = 0; i < L->nranks; i++) {
    line_stream_t *ss[2] = {&L->ranks[i].out, &L->ranks[i].err};
    for (int j = 0; j < 2; j++) {
      if (ss[j]->fd < 0) continue;
      L->pfds[n] = (struct pollfd){.fd = ss[j]->fd, .events = POLLIN};
      L->pranks[n] = &L->ranks[i];
      L->pstreams[n++] = ss[j];
    }
  }
  struct timespec ts, *tsp = NULL;
  if (timeout_ms >= 0) {
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000;
    tsp = &ts;
  }
  int k = ppoll(L->pfds, (nfds_t)n, tsp, wait_mask);
  if (k <= 0) return; /* timeout, or EINTR: a signal to handle */
  for (int i = 0; i < n; i++) {
    if (!(L->pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    pump_stream(L, L->pranks[i], L->pstreams[i]);
  }
}

/* ------------------------------------------------------------------ processes ------- */

void describe_exit(const rank_proc_t *r, char *buf, size_t cap) {
  if (r->how == CLD_EXITED)
    snprintf(buf, cap, "exited with code %d", r->status);
  else
    snprintf(buf, cap, "killed by signal %d (%s)%s", r->status, signal_name(r->status),
             r->how == CLD_DUMPED ? ", core dumped" : "");
}

bool rank_failed(const rank_proc_t *r) { return !(r->how == CLD_EXITED && r->status == 0); }

/* Sends sig to every rank's process group. A rank that has exited is still an unreaped
 * zombie, so its group id cannot have been reused, and what it left running goes too. */
static void signal_all(launcher_t *L, int sig) {
  for (int i = 0; i < L->nranks; i++) {
    rank_proc_t *r = &L->ranks[i];
    if (r->state == RANK_REAPED) continue;
    if (kill(-r->pid, sig) < 0 && r->state == RANK_RUNNING) kill(r->pid, sig);
  }
}

static void begin_stop(launcher_t *L, int sig) {
  signal_all(L, sig);
  if (!L->stopping) {
    L->stopping = true;
    L->kill_deadline_ns = now_ns() + L->opt.grace_ms * 1000000;
  }
}

/* ------------------------------------------------------------------ dumps ---------- */

static bool fr_configured(const options_t *o) { return o->fr_dir[0] || o->fr_prefix[0]; }

/* Whether rank r's flight-recorder dump was written since ddprun asked for it. File times
 * come from the kernel's coarse clock, which dump_asked is read from too. */
static bool dumped_since_asked(const launcher_t *L, const rank_proc_t *r) {
  char path[4096];
  if (L->opt.fr_dir[0])
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", L->opt.fr_dir, r->rank);
  else
    snprintf(path, sizeof path, "%s%d", L->opt.fr_prefix, r->rank);
  struct stat st;
  if (stat(path, &st) != 0) return false;
  const struct timespec *m = &st.st_mtim, *a = &L->dump_asked;
  return m->tv_sec > a->tv_sec || (m->tv_sec == a->tv_sec && m->tv_nsec >= a->tv_nsec);
}

/* The first failure, with flight recorders configured: the running ranks get SIGUSR1 first,
 * on which libddp's recorder dumps every group (docs/errors.md), and SIGTERM only when each
 * has written its dump, or has exited, or the grace period is over. Stopped at once, a rank
 * that is stalled (it never fails by itself) or that was still waiting out its timeout
 * leaves no dump, and the analysis can only call it dead. */
static void ask_for_dumps(launcher_t *L) {
  L->dumping = true;
  clock_gettime(CLOCK_REALTIME_COARSE, &L->dump_asked);
  L->dump_deadline_ns = now_ns() + L->opt.grace_ms * 1000000;
  for (int i = 0; i < L->nranks; i++) {
    rank_proc_t *r = &L->ranks[i];
    if (r->state == RANK_RUNNING) kill(r->pid, SIGUSR1);
  }
}

/* While dumps are awaited: SIGTERM once every running rank has dumped, or at the deadline
 * (saying which ranks did not dump). */
static void check_dumps(launcher_t *L) {
  if (!L->dumping || L->stopping) return;
  int missing = 0;
  char list[256] = "";
  size_t o = 0;
  for (int i = 0; i < L->nranks; i++) {
    const rank_proc_t *r = &L->ranks[i];
    if (r->state != RANK_RUNNING || dumped_since_asked(L, r)) continue;
    if (o < sizeof list)
      o += (size_t)snprintf(list + o, sizeof list - o, "%s%d", missing ? ", " : "", r->rank);
    missing++;
  }
  if (missing == 0) {
    begin_stop(L, SIGTERM);
    return;
  }
  if (now_ns() < L->dump_deadline_ns) return;
  say("no flight-recorder dump from rank(s) %s %.1f s after SIGUSR1; stopping them", list,
      (double)L->opt.grace_ms / 1000.0);
  begin_stop(L, SIGTERM);
}

/* Looks at every running rank without reaping it (WNOWAIT), so a rank's pid stays ours
 * until the end. The first failure seen before any interrupt is the job's failure. */
static void check_ranks(launcher_t *L) {
  int pick = -1; /* the failure this pass names: a rank killed by a signal, else the first */
  for (int i = 0; i < L->nranks; i++) {
    rank_proc_t *r = &L->ranks[i];
    if (r->state != RANK_RUNNING) continue;
    siginfo_t si;
    memset(&si, 0, sizeof si);
    if (waitid(P_PID, (id_t)r->pid, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid == 0)
      continue;
    r->state = RANK_EXITED;
    r->how = si.si_code;
    r->status = si.si_status;
    /* Ranks seen to fail at the same instant: one killed by a signal is the likelier cause
     * (its peers then fail on the lost connection), so it is named before a non-zero exit. */
    if (rank_failed(r) && (pick < 0 || (L->ranks[pick].how == CLD_EXITED && r->how != CLD_EXITED)))
      pick = i;
  }
  if (pick >= 0 && L->first_failed < 0 && L->interrupt_sig == 0 && !L->launch_failed) {
    rank_proc_t *r = &L->ranks[pick];
    L->first_failed = pick;
    L->failed_ns = now_ns();
    char what[96];
    describe_exit(r, what, sizeof what);
    int running = 0;
    for (int j = 0; j < L->nranks; j++) running += L->ranks[j].state == RANK_RUNNING;
    if (running > 0 && fr_configured(&L->opt)) {
      say("rank %d (pid %d) %s; asking the %d other running rank(s) for their flight-recorder "
          "dumps (SIGUSR1), then stopping them",
          r->rank, (int)r->pid, what, running);
      ask_for_dumps(L);
      return;
    }
    if (running > 0)
      say("rank %d (pid %d) %s; stopping the %d other running rank(s)", r->rank, (int)r->pid, what,
          running);
    begin_stop(L, SIGTERM);
  }
}

static void handle_signals(launcher_t *L) {
  if (g_got_chld) {
    g_got_chld = 0;
    check_ranks(L);
  }
  int sigs[2] = {g_got_int ? SIGINT : 0, g_got_term ? SIGTERM : 0};
  g_got_int = g_got_term = 0;
  for (int k = 0; k < 2; k++) {
    if (!sigs[k]) continue;
    if (L->interrupt_sig == 0) {
      L->interrupt_sig = sigs[k];
      say("received %s; forwarding it to the ranks", signal_name(sigs[k]));
    }
    begin_stop(L, sigs[k]);
  }
}

/* What a rank executes: its argv and its whole environment, built in ddprun before the fork.
 * The child of a multithreaded process (ddprun's store server runs in a thread) may not
 * allocate: a lock the other thread held at the fork stays held in the child, and under
 * AddressSanitizer's allocator a child that allocated hung before exec. */
typedef struct rank_exec {
  char **argv; /* prog and its arguments, after `python -u [-m]` when prog runs in Python */
  char **envp; /* ddprun's environment with the rank's variables set and removed */
  char *owned[MAX_RANK_VARS]; /* the "NAME=value" strings made here */
  int nowned;
} rank_exec_t;

static void free_rank_exec(rank_exec_t *x) {
  for (int i = 0; i < x->nowned; i++) free(x->owned[i]);
  free(x->argv);
  free(x->envp);
  memset(x, 0, sizeof *x);
}

static bool build_rank_exec(const launcher_t *L, int local_rank, rank_exec_t *x) {
  const options_t *o = &L->opt;
  memset(x, 0, sizeof *x);
  size_t nprog = 0;
  while (o->prog_argv[nprog]) nprog++;
  x->argv = malloc((nprog + 4) * sizeof *x->argv);
  size_t c = 0;
  if (x->argv && o->python) {
    x->argv[c++] = (char *)o->python;
    x->argv[c++] = (char *)"-u";
    if (o->module) x->argv[c++] = (char *)"-m";
  }
  if (x->argv) memcpy(x->argv + c, o->prog_argv, (nprog + 1) * sizeof *x->argv);

  char v[10][32];
  snprintf(v[0], sizeof v[0], "%d", o->node_rank * o->nproc_per_node + local_rank);
  snprintf(v[1], sizeof v[1], "%d", local_rank);
  snprintf(v[2], sizeof v[2], "%d", o->nnodes * o->nproc_per_node);
  snprintf(v[3], sizeof v[3], "%d", o->nproc_per_node);
  snprintf(v[4], sizeof v[4], "%d", o->node_rank);
  snprintf(v[5], sizeof v[5], "%d", o->master_port);
  snprintf(v[6], sizeof v[6], "%ld", o->timeout_s);
  snprintf(v[7], sizeof v[7], "%d", L->restart_count);
  snprintf(v[8], sizeof v[8], "%d", o->max_restarts);
  snprintf(v[9], sizeof v[9], "%d", o->nnodes);
  /* ddprun (node 0) serves the store: every rank, rank 0 too, connects to it as to
   * torchrun's agent store (ddprun_net.c). keep: an inherited value stays (and `value`, if
   * any, is set only when there is none); else `value` replaces it, or NULL removes it. */
  const struct {
    const char *name, *value;
    bool keep;
  } vars[] = {
      {"RANK", v[0], false},
      {"LOCAL_RANK", v[1], false},
      {"WORLD_SIZE", v[2], false},
      {"LOCAL_WORLD_SIZE", v[3], false},
      {"GROUP_RANK", v[4], false},
      {"MASTER_ADDR", o->master_addr, false},
      {"MASTER_PORT", v[5], false},
      {"DDP_JOB_TOKEN", L->token, false},
      {"DDP_BACKEND", o->backend, !o->backend}, /* inherited without --backend */
      {"DDP_TIMEOUT", o->timeout_s ? v[6] : NULL, !o->timeout_s},
      {"TORCHELASTIC_RESTART_COUNT", v[7], false},
      {"TORCHELASTIC_MAX_RESTARTS", v[8], false},
      /* the rest of what torchrun's agent gives a worker: one role */
      {"ROLE_RANK", v[0], false},
      {"ROLE_NAME", o->role, false},
      {"ROLE_WORLD_SIZE", v[2], false},
      {"GROUP_WORLD_SIZE", v[9], false},
      {"TORCHELASTIC_RUN_ID", o->run_id, false},
      {"NCCL_ASYNC_ERROR_HANDLING", "1", true},
      {"DDP_STORE_LISTEN_FD", NULL, false},
      {"TORCHELASTIC_USE_AGENT_STORE", agent_store(L) ? "True" : NULL, false},
  };
  enum { NVARS = sizeof vars / sizeof vars[0] };
  _Static_assert((int)NVARS <= (int)MAX_RANK_VARS, "MAX_RANK_VARS");
  bool present[NVARS] = {false};
  size_t nenv = 0;
  while (environ[nenv]) nenv++;
  x->envp = malloc((nenv + NVARS + 1) * sizeof *x->envp);
  if (!x->argv || !x->envp) goto oom;
  size_t e = 0;
  for (size_t i = 0; i < nenv; i++) {
    const char *kv = environ[i], *eq = strchr(kv, '=');
    size_t nlen = eq ? (size_t)(eq - kv) : strlen(kv);
    int k = -1;
    for (int j = 0; j < NVARS && k < 0; j++)
      if (strlen(vars[j].name) == nlen && strncmp(kv, vars[j].name, nlen) == 0) k = j;
    if (k >= 0 && !vars[k].keep) continue; /* ddprun sets or removes it */
    if (k >= 0) present[k] = true;         /* kept as inherited */
    x->envp[e++] = (char *)kv;
  }
  for (int j = 0; j < NVARS; j++) {
    if (!vars[j].value || (vars[j].keep && present[j])) continue;
    size_t len = strlen(vars[j].name) + strlen(vars[j].value) + 2;
    char *kv = malloc(len);
    if (!kv) goto oom;
    snprintf(kv, len, "%s=%s", vars[j].name, vars[j].value);
    x->owned[x->nowned++] = kv;
    x->envp[e++] = kv;
  }
  x->envp[e] = NULL;
  return true;
oom:
  say("cannot start rank %d: out of memory for its command and environment",
      o->node_rank * o->nproc_per_node + local_rank);
  free_rank_exec(x);
  return false;
}

/* Child side of fork: becomes the rank and never returns. It allocates nothing (see
 * rank_exec_t): setpgid, prctl, dup2, sigaction, exec, and on failure a message. */
__attribute__((noreturn)) static void exec_rank(const launcher_t *L, const rank_exec_t *x,
                                                int out_fd, int err_fd, pid_t parent,
                                                const sigset_t *orig_mask) {
  const options_t *o = &L->opt;
  setpgid(0, 0);
  /* If ddprun is killed outright, its ranks go with it. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(EXIT_LAUNCH);

  int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0 && devnull != STDIN_FILENO) {
    dup2(devnull, STDIN_FILENO);
    close(devnull);
  }
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);

  struct sigaction dfl = {.sa_handler = SIG_DFL};
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGINT, &dfl, NULL);
  sigaction(SIGTERM, &dfl, NULL);
  sigaction(SIGCHLD, &dfl, NULL);
  sigaction(SIGPIPE, &dfl, NULL);
  sigprocmask(SIG_SETMASK, orig_mask, NULL);

  char *const *cmd = x->argv;
  execvpe(cmd[0], cmd, x->envp);
  int e = errno;
  dprintf(STDERR_FILENO, "ddprun: cannot execute '%s': %s (errno %d)%s%s%s\n", cmd[0], strerror(e),
          e, o->python ? "; set PYTHON_EXEC to the Python that runs '" : "",
          o->python ? o->prog_argv[0] : "", o->python ? "'" : "");
  if (!o->python && e == ENOENT && !strchr(cmd[0], '/') && access(cmd[0], F_OK) == 0)
    dprintf(STDERR_FILENO,
            "ddprun: '%s' is in the current directory but not on PATH: run it as './%s', or "
            "through its interpreter (ddprun runs *.py files and -m modules in Python)\n",
            cmd[0], cmd[0]);
  _exit(e == ENOENT ? 127 : 126);
}

static bool start_rank(launcher_t *L, int local_rank, const sigset_t *orig_mask) {
  rank_proc_t *r = &L->ranks[local_rank];
  int po[2] = {-1, -1}, pe[2] = {-1, -1};
  if (!open_rank_logs(L, r, local_rank)) return false;
  if (pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0) {
    say("cannot start rank %d: pipe2: %s (errno %d)", r->rank, strerror(errno), errno);
    goto fail;
  }
  rank_exec_t x;
  if (!build_rank_exec(L, local_rank, &x)) goto fail;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    say("cannot start rank %d: fork: %s (errno %d)", r->rank, strerror(errno), errno);
    free_rank_exec(&x);
    goto fail;
  }
  if (pid == 0) exec_rank(L, &x, po[1], pe[1], parent, orig_mask);
  free_rank_exec(&x);
  /* Also set here, so the group exists before ddprun might signal it. */
  setpgid(pid, pid);
  close(po[1]);
  close(pe[1]);
  fcntl(po[0], F_SETFL, O_NONBLOCK);
  fcntl(pe[0], F_SETFL, O_NONBLOCK);
  r->pid = pid;
  r->state = RANK_RUNNING;
  r->out.fd = po[0];
  r->err.fd = pe[0];
  L->nranks = local_rank + 1;
  return true;
fail:
  for (int k = 0; k < 2; k++) {
    if (po[k] >= 0) close(po[k]);
    if (pe[k] >= 0) close(pe[k]);
  }
  close_stream_log(&r->out);
  close_stream_log(&r->err);
  return false;
}

static bool all_exited(const launcher_t *L) {
  for (int i = 0; i < L->nranks; i++)
    if (L->ranks[i].state == RANK_RUNNING) return false;
  return true;
}

static int ms_until(int64_t deadline_ns) {
  int64_t left = deadline_ns - now_ns();
  if (left <= 0) return 0;
  int64_t ms = (left + 999999) / 1000000;
  return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* The main loop: relay output, handle signals, notice exits, escalate to SIGKILL when the
 * grace period is over, and give up on ranks that outlive SIGKILL by REAP_MS. */
static void supervise(launcher_t *L, const sigset_t *wait_mask) {
  for (;;) {
    handle_signals(L);
    check_ranks(L);
    if (all_exited(L)) return;
    check_dumps(L);
    int64_t now = now_ns();
    if (L->stopping && !L->killed && now >= L->kill_deadline_ns) {
      int left = 0;
      for (int i = 0; i < L->nranks; i++) left += L->ranks[i].state == RANK_RUNNING;
      say("%d rank(s) still running %.1f s after being asked to stop; sending SIGKILL", left,
          (double)L->opt.grace_ms / 1000.0);
      signal_all(L, SIGKILL);
      L->killed = true;
      L->give_up_deadline_ns = now + (int64_t)REAP_MS * 1000000;
    }
    if (L->killed && now >= L->give_up_deadline_ns) {
      for (int i = 0; i < L->nranks; i++)
        if (L->ranks[i].state == RANK_RUNNING)
          say("rank %d (pid %d) is still alive %d s after SIGKILL; leaving it", L->ranks[i].rank,
              (int)L->ranks[i].pid, REAP_MS / 1000);
      L->gave_up = true;
      return;
    }
    int timeout = -1;
    if (L->dumping && !L->stopping)
      timeout = 10; /* the dumps are files: look again soon */
    else if (L->killed)
      timeout = ms_until(L->give_up_deadline_ns);
    else if (L->stopping)
      timeout = ms_until(L->kill_deadline_ns);
    poll_streams(L, timeout, wait_mask);
  }
}

/* After the last rank has exited: whatever the ranks left running is killed (their groups
 * are still ours, see signal_all), the pipes are drained to EOF or for DRAIN_MS, unfinished
 * last lines are flushed, and the ranks are reaped. */
static void finish(launcher_t *L, const sigset_t *wait_mask) {
  if (!L->gave_up) signal_all(L, SIGKILL);
  int64_t deadline = now_ns() + (int64_t)DRAIN_MS * 1000000;
  for (;;) {
    bool open = false;
    for (int i = 0; i < L->nranks; i++)
      open = open || L->ranks[i].out.fd >= 0 || L->ranks[i].err.fd >= 0;
    if (!open || now_ns() >= deadline) break;
    poll_streams(L, ms_until(deadline), wait_mask);
    g_got_chld = 0;
    if (g_got_int || g_got_term) handle_signals(L);
  }
  for (int i = 0; i < L->nranks; i++) {
    rank_proc_t *r = &L->ranks[i];
    close_stream(L, r, &r->out);
    close_stream(L, r, &r->err);
    if (r->state == RANK_EXITED) {
      remove_shm_leftovers(r); /* before reaping: the pid in the name is still this rank's */
      while (waitpid(r->pid, NULL, 0) < 0 && errno == EINTR) {
      }
      r->state = RANK_REAPED;
    }
  }
}

void install_signals(sigset_t *orig_mask, sigset_t *wait_mask) {
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, SIGCHLD);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigprocmask(SIG_BLOCK, &block, orig_mask);
  *wait_mask = *orig_mask;
  sigdelset(wait_mask, SIGCHLD);
  sigdelset(wait_mask, SIGINT);
  sigdelset(wait_mask, SIGTERM);
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGCHLD, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  struct sigaction ign = {.sa_handler = SIG_IGN};
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, NULL);
}

void run_attempt(launcher_t *L, const sigset_t *orig_mask, const sigset_t *wait_mask) {
  int n = L->opt.nproc_per_node;
  L->nranks = 0;
  L->first_failed = -1;
  L->dumping = L->stopping = L->killed = L->gave_up = false;
  L->start_ns = now_ns();
  L->failed_ns = 0;
  for (int i = 0; i < n; i++) {
    rank_proc_t *r = &L->ranks[i];
    r->pid = 0;
    r->state = RANK_REAPED;
    r->how = CLD_EXITED;
    r->status = 0;
    r->out.fd = r->err.fd = -1;
    r->out.len = r->err.len = 0;
  }
  for (int i = 0; i < n && L->interrupt_sig == 0; i++) {
    if (!start_rank(L, i, orig_mask)) {
      L->launch_failed = true;
      begin_stop(L, SIGKILL);
      L->killed = true;
      L->give_up_deadline_ns = now_ns() + (int64_t)REAP_MS * 1000000;
      break;
    }
  }
  supervise(L, wait_mask);
  finish(L, wait_mask);
  for (int i = 0; i < n; i++) { /* a stream that never ended (a rank that outlived SIGKILL) */
    close_stream_log(&L->ranks[i].out);
    close_stream_log(&L->ranks[i].err);
  }
}
