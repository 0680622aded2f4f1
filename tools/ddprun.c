/* ddprun: the libddp launcher. Starts the ranks of one node of a job as child processes,
 * torchrun style, and watches them.
 *
 *   ddprun --nproc_per_node N [--nnodes K --node_rank R --master_addr A --master_port P]
 *          [--backend B] [--timeout S] [--grace_period S] prog args...
 *
 * Contract (docs/launcher.md is the user-facing copy):
 * - Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
 *   MASTER_PORT and DDP_JOB_TOKEN, plus DDP_BACKEND and DDP_TIMEOUT when the flags are given.
 *   The token is taken from the environment, else drawn from /dev/urandom once per job.
 * - Every line a rank writes to stdout or stderr comes out on ddprun's stdout or stderr with
 *   "[rankN]: " in front, whole lines only, each written by one write call.
 * - SIGINT and SIGTERM sent to ddprun are forwarded to every rank.
 * - The first rank seen to fail (non-zero exit or killed by a signal) stops the job: the
 *   others get SIGTERM, then SIGKILL after the grace period. ddprun names that rank and
 *   exits with its exit code, or 128 + its signal.
 * - Usage errors exit 2; a launch that could not start every rank exits 1.
 *
 * Only libc is used. Each rank runs in its own process group, so a signal sent to the
 * group reaches whatever the rank started (a shell's children), and a terminal's Ctrl-C
 * reaches only ddprun, which forwards it once. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
  EXIT_LAUNCH = 1,           /* ddprun could not start the job */
  EXIT_USAGE = 2,            /* bad command line */
  MAX_LOCAL_RANKS = 1024,    /* two pipes each must fit the usual 4096-descriptor limit */
  LINE_CAP = 65536,          /* a longer line is passed on in pieces of this size */
  BATCH_LINES = 256,         /* lines per writev (two iovecs each, under IOV_MAX) */
  DRAIN_MS = 2000,           /* after the last rank exits: wait this long for pipe EOF */
  REAP_MS = 10000,           /* after SIGKILL: wait this long for ranks to go */
  TOKEN_BYTES = 16
};

#define DEFAULT_MASTER_ADDR "127.0.0.1"
#define DEFAULT_MASTER_PORT 29500
#define DEFAULT_GRACE_MS 3000

/* ------------------------------------------------------------------ messages -------- */

/* One message = one write, so ddprun's own lines never split the ranks' lines. */
static void write_all(int fd, const char *p, size_t n);

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...) {
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

__attribute__((format(printf, 1, 2), noreturn)) static void usage_error(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  say("%s\nddprun: run 'ddprun --help' for usage", buf);
  exit(EXIT_USAGE);
}

static const char *signal_name(int sig) {
  static const struct {
    int sig;
    const char *name;
  } names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGCHLD, "SIGCHLD"},
      {SIGCONT, "SIGCONT"}, {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"}, {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"}, {SIGURG, "SIGURG"},   {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"},
      {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"}, {SIGSYS, "SIGSYS"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (names[i].sig == sig) return names[i].name;
  return "unknown signal";
}

/* ------------------------------------------------------------------ options --------- */

typedef struct options {
  int nproc_per_node;
  int nnodes;
  int node_rank;
  const char *master_addr;
  bool master_addr_given;
  int master_port;
  const char *backend;   /* NULL: DDP_BACKEND is left as inherited */
  long timeout_s;        /* 0: DDP_TIMEOUT is left as inherited */
  int64_t grace_ms;
  char **prog_argv;      /* NULL-terminated, points into argv */
} options_t;

static void print_help(void) {
  static const char text[] =
      "usage: ddprun [options] prog [args...]\n"
      "\n"
      "Starts the ranks of one node of a libddp job and watches them (torchrun's contract).\n"
      "Flags accept '-' or '_' (--nproc-per-node) and '--flag value' or '--flag=value'.\n"
      "\n"
      "  --nproc_per_node N   ranks on this node, 1..1024, or 'cpu'/'auto' (online CPUs) [1]\n"
      "  --nnodes K           nodes in the job [1]\n"
      "  --node_rank R        this node, 0..K-1 [0]\n"
      "  --master_addr A      host of the TCP store; required when K > 1 [127.0.0.1]\n"
      "  --master_port P      port of the TCP store, 1..65535 [29500]\n"
      "  --backend B          sets DDP_BACKEND: tcp, gloo, shm or nccl\n"
      "  --timeout S          sets DDP_TIMEOUT, the collective timeout in seconds\n"
      "  --grace_period S     after a failure, seconds between SIGTERM and SIGKILL [3]\n"
      "  -h, --help           this text\n"
      "\n"
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT and DDP_JOB_TOKEN. A multi-node job needs the same DDP_JOB_TOKEN exported\n"
      "on every node. Output lines are prefixed with [rankN]. When a rank fails, the others\n"
      "are stopped and ddprun exits with the first failed rank's code (128+signal if killed).\n";
  write_all(STDOUT_FILENO, text, sizeof text - 1);
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || errno != 0 || v < lo || v > hi)
    usage_error("--%s: '%s' is not an integer in [%ld, %ld]", flag, s, lo, hi);
  return v;
}

static int64_t parse_seconds_ms(const char *flag, const char *s, double hi) {
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (*s == '\0' || *end != '\0' || errno != 0 || !isfinite(v) || v < 0 || v > hi)
    usage_error("--%s: '%s' is not a number of seconds in [0, %g]", flag, s, hi);
  return (int64_t)(v * 1000.0 + 0.5);
}

/* Backends that make sense for processes started by ddprun. threads runs all ranks in one
 * process, and mpi ranks are started by mpirun or srun. */
static void check_backend(const char *b, int nnodes) {
  static const char *const ok[] = {"tcp", "gloo", "shm", "nccl"};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    if (strcmp(b, ok[i]) != 0) continue;
    if (strcmp(b, "shm") == 0 && nnodes > 1)
      usage_error("--backend shm works within one host; use tcp (or gloo) with --nnodes %d",
                  nnodes);
    return;
  }
  if (strcmp(b, "threads") == 0)
    usage_error("--backend threads runs ranks as threads of one process, not under ddprun; "
                "use shm or tcp");
  if (strcmp(b, "mpi") == 0)
    usage_error("--backend mpi: MPI ranks are started by mpirun or srun, not by ddprun");
  usage_error("--backend: unknown backend '%s' (choices: tcp, gloo, shm, nccl)", b);
}

typedef enum flag_id {
  F_NPROC, F_NNODES, F_NODE_RANK, F_MASTER_ADDR, F_MASTER_PORT, F_BACKEND, F_TIMEOUT,
  F_GRACE, F_HELP
} flag_id_t;

static const struct {
  const char *name; /* canonical spelling, '_' between words */
  flag_id_t id;
  bool takes_value;
} flag_table[] = {
    {"nproc_per_node", F_NPROC, true},     {"nnodes", F_NNODES, true},
    {"node_rank", F_NODE_RANK, true},      {"master_addr", F_MASTER_ADDR, true},
    {"master_port", F_MASTER_PORT, true},  {"backend", F_BACKEND, true},
    {"timeout", F_TIMEOUT, true},          {"grace_period", F_GRACE, true},
    {"help", F_HELP, false},
};

/* Parses argv up to the program. Options end at the first argument that does not start
 * with '-', or after "--". Any usage error exits 2 with a message naming the argument. */
static void parse_args(int argc, char **argv, options_t *o) {
  *o = (options_t){.nproc_per_node = 1, .nnodes = 1, .node_rank = 0,
                   .master_addr = DEFAULT_MASTER_ADDR, .master_port = DEFAULT_MASTER_PORT,
                   .grace_ms = DEFAULT_GRACE_MS};
  bool node_rank_given = false;
  int i = 1;
  while (i < argc) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) {
      i++;
      break;
    }
    if (a[0] != '-') break;
    if (strcmp(a, "-h") == 0) {
      print_help();
      exit(0);
    }
    if (a[1] != '-' || a[2] == '\0') usage_error("unknown flag '%s'", a);

    /* Normalise the name: the part before '=', with '-' read as '_'. */
    const char *eq = strchr(a + 2, '=');
    size_t nlen = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
    char name[32];
    if (nlen >= sizeof name) usage_error("unknown flag '%s'", a);
    for (size_t k = 0; k < nlen; k++) name[k] = a[2 + k] == '-' ? '_' : a[2 + k];
    name[nlen] = '\0';
    int f = -1;
    for (size_t k = 0; k < sizeof flag_table / sizeof flag_table[0]; k++)
      if (strcmp(name, flag_table[k].name) == 0) f = (int)k;
    if (f < 0) usage_error("unknown flag '%.*s'", (int)(nlen + 2), a);

    const char *val = NULL;
    if (flag_table[f].takes_value) {
      if (eq) {
        val = eq + 1;
      } else {
        if (i + 1 >= argc) usage_error("--%s needs a value", name);
        val = argv[++i];
      }
    } else if (eq) {
      usage_error("--%s takes no value", name);
    }
    i++;

    switch (flag_table[f].id) {
    case F_NPROC:
      if (strcmp(val, "cpu") == 0 || strcmp(val, "auto") == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        o->nproc_per_node = n < 1 ? 1 : n > MAX_LOCAL_RANKS ? MAX_LOCAL_RANKS : (int)n;
      } else {
        o->nproc_per_node = (int)parse_long(name, val, 1, MAX_LOCAL_RANKS);
      }
      break;
    case F_NNODES: o->nnodes = (int)parse_long(name, val, 1, 1 << 16); break;
    case F_NODE_RANK:
      o->node_rank = (int)parse_long(name, val, 0, (1 << 16) - 1);
      node_rank_given = true;
      break;
    case F_MASTER_ADDR:
      if (*val == '\0') usage_error("--master_addr: empty address");
      o->master_addr = val;
      o->master_addr_given = true;
      break;
    case F_MASTER_PORT: o->master_port = (int)parse_long(name, val, 1, 65535); break;
    case F_BACKEND: o->backend = val; break;
    case F_TIMEOUT: o->timeout_s = parse_long(name, val, 1, INT32_MAX); break;
    case F_GRACE: o->grace_ms = parse_seconds_ms(name, val, 3600.0); break;
    case F_HELP: print_help(); exit(0);
    }
  }
  if (i >= argc) usage_error("no program to run (usage: ddprun [options] prog [args...])");
  o->prog_argv = argv + i;

  if (o->node_rank >= o->nnodes)
    usage_error("--node_rank %d is out of range for --nnodes %d (0..%d)", o->node_rank,
                o->nnodes, o->nnodes - 1);
  if ((int64_t)o->nnodes * o->nproc_per_node > INT32_MAX)
    usage_error("--nnodes %d x --nproc_per_node %d is too many ranks", o->nnodes,
                o->nproc_per_node);
  if (o->nnodes > 1 && !o->master_addr_given)
    usage_error("--nnodes %d needs --master_addr (the address of node 0, where the store "
                "runs)", o->nnodes);
  if (node_rank_given && o->nnodes == 1 && o->node_rank != 0)
    usage_error("--node_rank %d without --nnodes", o->node_rank);
  if (o->backend) check_backend(o->backend, o->nnodes);
}

/* ------------------------------------------------------------------ job token ------- */

/* The token every connection of the job presents. A multi-node job cannot draw it here,
 * because each node would draw a different one: it must come from the environment. */
static int job_token(const options_t *o, char *out, size_t cap) {
  const char *env = getenv("DDP_JOB_TOKEN");
  if (env && *env) {
    if (strlen(env) >= cap) {
      say("DDP_JOB_TOKEN is longer than %zu characters", cap - 1);
      return EXIT_USAGE;
    }
    strcpy(out, env);
    return 0;
  }
  if (o->nnodes > 1) {
    say("--nnodes %d: export the same DDP_JOB_TOKEN on every node before starting ddprun "
        "(for example DDP_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n'))",
        o->nnodes);
    return EXIT_USAGE;
  }
  unsigned char raw[TOKEN_BYTES];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    say("cannot open /dev/urandom for the job token: %s (errno %d)", strerror(errno), errno);
    return EXIT_LAUNCH;
  }
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t k = read(fd, raw + got, sizeof raw - got);
    if (k > 0) {
      got += (size_t)k;
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else {
      say("cannot read /dev/urandom for the job token: %s", k < 0 ? strerror(errno) : "EOF");
      close(fd);
      return EXIT_LAUNCH;
    }
  }
  close(fd);
  static const char hex[] = "0123456789abcdef";
  for (size_t k = 0; k < sizeof raw; k++) {
    out[2 * k] = hex[raw[k] >> 4];
    out[2 * k + 1] = hex[raw[k] & 15];
  }
  out[2 * sizeof raw] = '\0';
  return 0;
}

/* ------------------------------------------------------------------ state ----------- */

/* One output stream of one rank: the read end of its pipe and the bytes of a line that
 * has not ended yet. */
typedef struct line_stream {
  int fd;      /* read end; -1 once closed */
  int out_fd;  /* STDOUT_FILENO or STDERR_FILENO */
  size_t len;  /* bytes held in buf */
  char *buf;   /* LINE_CAP bytes */
} line_stream_t;

typedef enum rank_state {
  RANK_RUNNING,  /* not seen to exit */
  RANK_EXITED,   /* exit seen with WNOWAIT: still a zombie, so its pid and group id stay ours */
  RANK_REAPED
} rank_state_t;

typedef struct rank_proc {
  int rank;          /* global */
  pid_t pid;         /* also its process group id */
  rank_state_t state;
  int how;           /* si_code: CLD_EXITED, CLD_KILLED or CLD_DUMPED */
  int status;        /* exit code or signal */
  char prefix[32];   /* "[rankN]: " */
  size_t prefix_len;
  line_stream_t out, err;
} rank_proc_t;

typedef struct launcher {
  options_t opt;
  char token[256];
  rank_proc_t *ranks;
  int nranks;          /* ranks started */
  int first_failed;    /* index into ranks, -1 while none */
  int interrupt_sig;   /* first SIGINT/SIGTERM ddprun received, 0 if none */
  bool launch_failed;
  bool stopping;       /* SIGTERM (or the forwarded signal) has been sent */
  bool killed;         /* SIGKILL has been sent */
  bool gave_up;        /* ranks survived SIGKILL for REAP_MS */
  int64_t kill_deadline_ns;
  int64_t give_up_deadline_ns;
  bool out_dead[3];    /* writing to fd 1 or 2 failed: keep draining the ranks, drop output */
  struct pollfd *pfds;      /* poll set, 2 per rank, rebuilt every wait */
  line_stream_t **pstreams; /* the stream behind each pfds entry */
  rank_proc_t **pranks;     /* and its rank */
} launcher_t;

/* Signal handlers can only reach file-scope state; they record and the loop acts. */
static volatile sig_atomic_t g_got_chld, g_got_int, g_got_term;

static void on_signal(int sig) {
  if (sig == SIGCHLD) g_got_chld = 1;
  else if (sig == SIGINT) g_got_int = 1;
  else if (sig == SIGTERM) g_got_term = 1;
}

static int64_t now_ns(void) {
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

static void write_all(int fd, const char *p, size_t n) {
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
    s->len += (size_t)k;
    emit_lines(L, r, s, s->len == LINE_CAP);
  } else if (k == 0) {
    close_stream(L, r, s);
  } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
    say("reading the %s of rank %d: %s (errno %d)", s->out_fd == 1 ? "stdout" : "stderr",
        r->rank, strerror(errno), errno);
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

static void describe_exit(const rank_proc_t *r, char *buf, size_t cap) {
  if (r->how == CLD_EXITED)
    snprintf(buf, cap, "exited with code %d", r->status);
  else
    snprintf(buf, cap, "killed by signal %d (%s)%s", r->status, signal_name(r->status),
             r->how == CLD_DUMPED ? ", core dumped" : "");
}

static bool rank_failed(const rank_proc_t *r) {
  return !(r->how == CLD_EXITED && r->status == 0);
}

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

/* Looks at every running rank without reaping it (WNOWAIT), so a rank's pid stays ours
 * until the end. The first failure seen before any interrupt is the job's failure. */
static void check_ranks(launcher_t *L) {
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
    if (rank_failed(r) && L->first_failed < 0 && L->interrupt_sig == 0 && !L->launch_failed) {
      L->first_failed = i;
      char what[96];
      describe_exit(r, what, sizeof what);
      int running = 0;
      for (int j = 0; j < L->nranks; j++) running += L->ranks[j].state == RANK_RUNNING;
      if (running > 0)
        say("rank %d (pid %d) %s; stopping the %d other running rank(s)", r->rank, (int)r->pid,
            what, running);
      begin_stop(L, SIGTERM);
    }
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

/* Child side of fork: becomes the rank and never returns. ddprun is single-threaded, so
 * the child may call setenv and stdio before exec. */
__attribute__((noreturn)) static void exec_rank(const launcher_t *L, int local_rank,
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

  char v[7][32];
  snprintf(v[0], sizeof v[0], "%d", o->node_rank * o->nproc_per_node + local_rank);
  snprintf(v[1], sizeof v[1], "%d", local_rank);
  snprintf(v[2], sizeof v[2], "%d", o->nnodes * o->nproc_per_node);
  snprintf(v[3], sizeof v[3], "%d", o->nproc_per_node);
  snprintf(v[4], sizeof v[4], "%d", o->node_rank);
  snprintf(v[5], sizeof v[5], "%d", o->master_port);
  snprintf(v[6], sizeof v[6], "%ld", o->timeout_s);
  bool ok = setenv("RANK", v[0], 1) == 0 && setenv("LOCAL_RANK", v[1], 1) == 0 &&
            setenv("WORLD_SIZE", v[2], 1) == 0 && setenv("LOCAL_WORLD_SIZE", v[3], 1) == 0 &&
            setenv("GROUP_RANK", v[4], 1) == 0 &&
            setenv("MASTER_ADDR", o->master_addr, 1) == 0 &&
            setenv("MASTER_PORT", v[5], 1) == 0 && setenv("DDP_JOB_TOKEN", L->token, 1) == 0 &&
            (!o->backend || setenv("DDP_BACKEND", o->backend, 1) == 0) &&
            (o->timeout_s == 0 || setenv("DDP_TIMEOUT", v[6], 1) == 0);
  if (!ok) {
    dprintf(STDERR_FILENO, "ddprun: setenv: %s\n", strerror(errno));
    _exit(EXIT_LAUNCH);
  }
  execvp(o->prog_argv[0], o->prog_argv);
  int e = errno;
  dprintf(STDERR_FILENO, "ddprun: cannot execute '%s': %s (errno %d)\n", o->prog_argv[0],
          strerror(e), e);
  _exit(e == ENOENT ? 127 : 126);
}

static bool start_rank(launcher_t *L, int local_rank, const sigset_t *orig_mask) {
  rank_proc_t *r = &L->ranks[local_rank];
  int po[2] = {-1, -1}, pe[2] = {-1, -1};
  if (pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0) {
    say("cannot start rank %d: pipe2: %s (errno %d)", r->rank, strerror(errno), errno);
    goto fail;
  }
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    say("cannot start rank %d: fork: %s (errno %d)", r->rank, strerror(errno), errno);
    goto fail;
  }
  if (pid == 0) exec_rank(L, local_rank, po[1], pe[1], parent, orig_mask);
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
          say("rank %d (pid %d) is still alive %d s after SIGKILL; leaving it",
              L->ranks[i].rank, (int)L->ranks[i].pid, REAP_MS / 1000);
      L->gave_up = true;
      return;
    }
    int timeout = -1;
    if (L->killed) timeout = ms_until(L->give_up_deadline_ns);
    else if (L->stopping) timeout = ms_until(L->kill_deadline_ns);
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
      while (waitpid(r->pid, NULL, 0) < 0 && errno == EINTR) {
      }
      r->state = RANK_REAPED;
    }
  }
}

/* Prints the outcome and returns ddprun's exit code. */
static int report(const launcher_t *L) {
  char what[96];
  if (L->first_failed >= 0) {
    const rank_proc_t *f = &L->ranks[L->first_failed];
    describe_exit(f, what, sizeof what);
    int others = 0;
    for (int i = 0; i < L->nranks; i++)
      others += i != L->first_failed && rank_failed(&L->ranks[i]);
    char tail[96] = "";
    if (others > 0)
      snprintf(tail, sizeof tail, " (%d other rank(s) failed or were stopped%s)", others,
               L->killed ? ", SIGKILL was needed" : "");
    say("rank %d (pid %d) failed first: %s%s", f->rank, (int)f->pid, what, tail);
    return f->how == CLD_EXITED ? f->status : 128 + f->status;
  }
  if (L->interrupt_sig) {
    say("stopped by %s", signal_name(L->interrupt_sig));
    return 128 + L->interrupt_sig;
  }
  if (L->launch_failed || L->gave_up) return EXIT_LAUNCH;
  return 0;
}

int main(int argc, char **argv) {
  launcher_t L;
  memset(&L, 0, sizeof L);
  L.first_failed = -1;
  parse_args(argc, argv, &L.opt);
  int rc = job_token(&L.opt, L.token, sizeof L.token);
  if (rc != 0) return rc;

  int n = L.opt.nproc_per_node;
  L.ranks = calloc((size_t)n, sizeof *L.ranks);
  L.pfds = calloc((size_t)2 * n, sizeof *L.pfds);
  L.pstreams = calloc((size_t)2 * n, sizeof *L.pstreams);
  L.pranks = calloc((size_t)2 * n, sizeof *L.pranks);
  if (!L.ranks || !L.pfds || !L.pstreams || !L.pranks) {
    say("out of memory for %d ranks", n);
    free(L.ranks);
    free(L.pfds);
    free(L.pstreams);
    free(L.pranks);
    return EXIT_LAUNCH;
  }
  for (int i = 0; i < n; i++) {
    rank_proc_t *r = &L.ranks[i];
    r->rank = L.opt.node_rank * n + i;
    r->prefix_len = (size_t)snprintf(r->prefix, sizeof r->prefix, "[rank%d]: ", r->rank);
    r->out = (line_stream_t){.fd = -1, .out_fd = STDOUT_FILENO, .buf = malloc(LINE_CAP)};
    r->err = (line_stream_t){.fd = -1, .out_fd = STDERR_FILENO, .buf = malloc(LINE_CAP)};
    if (!r->out.buf || !r->err.buf) {
      say("out of memory for the output buffers of %d ranks", n);
      rc = EXIT_LAUNCH;
      goto out;
    }
  }

  /* Signals stay blocked except inside ppoll, so none is missed between a check and the
   * wait. Children restore the original mask and default handlers before exec. */
  sigset_t block, orig_mask, wait_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGCHLD);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigprocmask(SIG_BLOCK, &block, &orig_mask);
  wait_mask = orig_mask;
  sigdelset(&wait_mask, SIGCHLD);
  sigdelset(&wait_mask, SIGINT);
  sigdelset(&wait_mask, SIGTERM);
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGCHLD, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  struct sigaction ign = {.sa_handler = SIG_IGN};
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, NULL);

  for (int i = 0; i < n; i++) {
    if (!start_rank(&L, i, &orig_mask)) {
      L.launch_failed = true;
      begin_stop(&L, SIGKILL);
      L.killed = true;
      L.give_up_deadline_ns = now_ns() + (int64_t)REAP_MS * 1000000;
      break;
    }
  }
  supervise(&L, &wait_mask);
  finish(&L, &wait_mask);
  rc = report(&L);
out:
  for (int i = 0; i < n; i++) {
    free(L.ranks[i].out.buf);
    free(L.ranks[i].err.buf);
  }
  free(L.ranks);
  free(L.pfds);
  free(L.pstreams);
  free(L.pranks);
  return rc;
}
