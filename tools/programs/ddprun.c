/* ddprun: the libddp launcher. Starts the ranks of one node of a job as child processes,
 * torchrun style, watches them, and restarts the whole group after a failure when asked.
 *
 *   ddprun --nproc_per_node N [--nnodes K --node_rank R --master_addr A --master_port P |
 *          --rdzv_endpoint A[:P] | --standalone] [--max_restarts M] [--backend B]
 *          [--timeout S] [--grace_period S] [-m | --no_python | --run_path] prog args...
 *
 * Contract (docs/launcher.md is the user-facing copy):
 * - Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
 *   MASTER_PORT, DDP_JOB_TOKEN, TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS,
 *   plus DDP_BACKEND and DDP_TIMEOUT when the flags are given, and the rest of torchrun's
 *   worker environment (ROLE_*, GROUP_WORLD_SIZE, TORCHELASTIC_RUN_ID; OMP_NUM_THREADS=1
 *   when unset and N > 1). The token is taken from the environment, else drawn from
 *   /dev/urandom once per job.
 * - Node 0 reserves the store's port before starting anything (bind and listen; port 0 =
 *   chosen by the OS) and hands the socket to global rank 0: a port another job's store
 *   holds fails the launch at once, and the port stays this job's across restarts.
 * - Every line a rank writes to stdout or stderr comes out on ddprun's stdout or stderr with
 *   "[rankN]: " in front, whole lines only, each written by one write call.
 * - SIGINT and SIGTERM sent to ddprun are forwarded to every rank and end the job.
 * - The first rank seen to fail (non-zero exit or killed by a signal) ends the attempt: the
 *   others get SIGTERM, then SIGKILL after the grace period, and what a stopped shm rank 0
 *   left in /dev/shm is removed. With restarts left, every rank is started again with
 *   TORCHELASTIC_RESTART_COUNT one higher; else ddprun names the failed rank of every
 *   attempt and exits with the last attempt's status: the failed rank's exit code, or
 *   128 + its signal.
 * - With --redirects or --tee, the streams they name are also (or only) written to
 *   per-rank log files, torchrun's layout (ddprun_log.c).
 * - Usage errors exit 2; a launch that could not start every rank exits 1.
 *
 * Each rank runs in its own process group, so a signal sent to the group reaches whatever
 * the rank started (a shell's children), and a terminal's Ctrl-C reaches only ddprun, which
 * forwards it once. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/backend.h" /* DDP_BACKEND_LIST */

#ifndef DDPRUN_PYTHON /* tools/meson.build: a Python that imports torch, or python3 */
#define DDPRUN_PYTHON "python3"
#endif
#include "ddprun.h"

__attribute__((format(printf, 1, 2), noreturn)) static void usage_error(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  say("%s\nddprun: run 'ddprun --help' for usage", buf);
  exit(EXIT_USAGE);
}

/* ------------------------------------------------------------------ options --------- */

/* libddp's backends (DDP_BACKEND_LIST). Those that make sense for processes started by
 * ddprun are the ones whose ranks are processes, of one host or of any: threads runs all
 * ranks in one process, and mpi ranks are started by mpirun or srun. */
static const struct {
  const char *name, *alias;
  ddp_backend_ranks_t ranks;
} backends[] = {
#define DDPRUN_BACKEND_(name, alias, ranks, optional) {name, alias, ranks},
    DDP_BACKEND_LIST(DDPRUN_BACKEND_)
#undef DDPRUN_BACKEND_
};

static bool launchable(ddp_backend_ranks_t r) {
  return r == DDP_RANKS_ONE_HOST || r == DDP_RANKS_ANY_HOST;
}

/* The names --backend accepts, aliases after their backend, joined by ", " with `last`
 * before the final one: "shm, tcp, gloo or nccl". */
static const char *backend_choices(char *buf, size_t cap, const char *last) {
  const char *names[2 * sizeof backends / sizeof backends[0]];
  size_t n = 0, o = 0;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
    if (!launchable(backends[i].ranks)) continue;
    names[n++] = backends[i].name;
    if (backends[i].alias[0]) names[n++] = backends[i].alias;
  }
  buf[0] = '\0';
  for (size_t i = 0; i < n && o < cap; i++)
    o += (size_t)snprintf(buf + o, cap - o, "%s%s",
                          i == 0       ? ""
                          : i + 1 == n ? last
                                       : ", ",
                          names[i]);
  return buf;
}

static void print_help(void) {
  char choices[128];
  static const char text[] =
      "usage: ddprun [options] prog [args...]\n"
      "\n"
      "Starts the ranks of one node of a libddp job and watches them (torchrun's contract).\n"
      "Flags accept '-' or '_' (--nproc-per-node) and '--flag value' or '--flag=value'.\n"
      "prog is a program, or, as under torchrun, a *.py script or (-m) a module, which\n"
      "run as 'PYTHON -u [-m] prog args': PYTHON is $PYTHON_EXEC if set, else " DDPRUN_PYTHON "\n"
      "(found when ddprun was built: the Python that imports torch).\n"
      "\n"
      "  --nproc_per_node N   ranks on this node, 1..1024, or 'cpu'/'auto' (online CPUs) [1]\n"
      "  --nnodes K           nodes in the job [1]\n"
      "  --node_rank R        this node, 0..K-1 [0]\n"
      "  --master_addr A      host of the TCP store; required when K > 1 [127.0.0.1]\n"
      "  --master_port P      port of the TCP store, 1..65535; 0 = a free one [29500]\n"
      "  --rdzv_endpoint A[:P] the same as --master_addr A --master_port P [P: 29400]\n"
      "  --standalone         one node, a free port chosen by the OS\n"
      "  --max_restarts M     restart the whole group up to M times after a failure [0]\n"
      "  --no_reserve_port    do not hold the store port for rank 0 (a rank 0 that is not\n"
      "                       libddp binds it itself, e.g. PyTorch's TCPStore)\n"
      "  --backend B          sets DDP_BACKEND: %s\n"
      "  --timeout S          sets DDP_TIMEOUT, the collective timeout in seconds\n"
      "  --grace_period S     after a failure, seconds between SIGTERM and SIGKILL [3]\n"
      "  -m, --module         prog is a Python module\n"
      "  --no_python          run prog itself, even a *.py file\n"
      "  --run_path           run prog with Python whatever its name\n"
      "  --rdzv_backend B     c10d or static: the ranks meet at ddprun's store either way\n"
      "  --rdzv_id ID         sets TORCHELASTIC_RUN_ID [none]\n"
      "  --role R             sets ROLE_NAME [default]\n"
      "  --rdzv_conf, --monitor_interval, --start_method: accepted, no effect\n"
      "  -r, --redirects V    send streams to log files only: 0 none, 1 stdout, 2 stderr,\n"
      "                       3 both, or per local rank 0:3,1:2 [0]\n"
      "  -t, --tee V          also write streams to log files, the same values [0]\n"
      "  --log_dir D          where the log files go [a new directory in $TMPDIR]\n"
      "  -h, --help           this text\n"
      "\n"
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT and DDP_JOB_TOKEN, and torchrun's ROLE_*, GROUP_WORLD_SIZE and\n"
      "TORCHELASTIC_* variables; with N > 1, OMP_NUM_THREADS=1 unless it is set. A multi-node\n"
      "job needs the same DDP_JOB_TOKEN exported on every node. Output lines are prefixed\n"
      "with [rankN]. When a rank fails, the others are stopped; with restarts left all are\n"
      "started again (TORCHELASTIC_RESTART_COUNT counts them), else ddprun exits with the\n"
      "first failed rank's code (128+signal).\n";
  /* text holds one %s, the backend choices: written in three pieces (no printf of text) */
  const char *at = strstr(text, "%s");
  backend_choices(choices, sizeof choices, " or ");
  write_all(STDOUT_FILENO, text, (size_t)(at - text));
  write_all(STDOUT_FILENO, choices, strlen(choices));
  write_all(STDOUT_FILENO, at + 2, strlen(at + 2));
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

/* --backend: a launchable backend of the list (shm only with one node). */
static void check_backend(const char *b, int nnodes) {
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
    bool alias = backends[i].alias[0] && strcmp(b, backends[i].alias) == 0;
    if (strcmp(b, backends[i].name) != 0 && !alias) continue;
    switch (backends[i].ranks) {
      case DDP_RANKS_ONE_HOST:
        if (nnodes > 1)
          usage_error("--backend %s works within one host; use tcp (or gloo) with --nnodes %d", b,
                      nnodes);
        return;
      case DDP_RANKS_ANY_HOST: return;
      case DDP_RANKS_THREADS:
        usage_error("--backend %s runs ranks as threads of one process, not under ddprun; "
                    "use shm or tcp",
                    b);
      case DDP_RANKS_MPI:
        usage_error("--backend %s: MPI ranks are started by mpirun or srun, not by ddprun", b);
    }
  }
  char choices[128];
  usage_error("--backend: unknown backend '%s' (choices: %s)", b,
              backend_choices(choices, sizeof choices, ", "));
}

/* torchrun's HOST[:PORT] ([v6]:PORT for an IPv6 address); no port means 29400. */
static void parse_endpoint(const char *v, options_t *o) {
  const char *host = v, *colon = strrchr(v, ':');
  size_t hlen = strlen(v);
  if (v[0] == '[') {
    const char *close = strchr(v, ']');
    if (!close || (close[1] != '\0' && close[1] != ':'))
      usage_error("--rdzv_endpoint '%s': expected HOST[:PORT] or [IPv6]:PORT", v);
    host = v + 1;
    hlen = (size_t)(close - host);
    colon = close[1] == ':' ? close + 1 : NULL;
  } else if (colon && strchr(v, ':') != colon) {
    colon = NULL; /* a bare IPv6 address */
  } else if (colon) {
    hlen = (size_t)(colon - v);
  }
  if (hlen == 0 || hlen >= sizeof o->rdzv_host)
    usage_error("--rdzv_endpoint '%s': expected HOST[:PORT]", v);
  memcpy(o->rdzv_host, host, hlen);
  o->rdzv_host[hlen] = '\0';
  o->master_addr = o->rdzv_host;
  o->master_addr_given = true;
  o->master_port = colon ? (int)parse_long("rdzv_endpoint port", colon + 1, 0, 65535)
                         : DEFAULT_RDZV_PORT;
  o->master_port_given = true;
}

typedef enum flag_id {
  F_NPROC,
  F_NNODES,
  F_NODE_RANK,
  F_MASTER_ADDR,
  F_MASTER_PORT,
  F_BACKEND,
  F_TIMEOUT,
  F_GRACE,
  F_HELP,
  F_MAX_RESTARTS,
  F_STANDALONE,
  F_RDZV_ENDPOINT,
  F_NO_RESERVE,
  F_MODULE,
  F_NO_PYTHON,
  F_RUN_PATH,
  F_RDZV_BACKEND,
  F_RDZV_ID,
  F_RDZV_CONF,
  F_ROLE,
  F_MONITOR,
  F_START_METHOD,
  F_LOG_DIR,
  F_REDIRECTS,
  F_TEE
} flag_id_t;

static const struct {
  const char *name; /* canonical spelling, '_' between words */
  flag_id_t id;
  bool takes_value;
} flag_table[] = {
    {"nproc_per_node", F_NPROC, true},
    {"nnodes", F_NNODES, true},
    {"node_rank", F_NODE_RANK, true},
    {"master_addr", F_MASTER_ADDR, true},
    {"master_port", F_MASTER_PORT, true},
    {"backend", F_BACKEND, true},
    {"timeout", F_TIMEOUT, true},
    {"grace_period", F_GRACE, true},
    {"help", F_HELP, false},
    {"max_restarts", F_MAX_RESTARTS, true},
    {"standalone", F_STANDALONE, false},
    {"rdzv_endpoint", F_RDZV_ENDPOINT, true},
    {"no_reserve_port", F_NO_RESERVE, false},
    /* torchrun's other flags: how the program runs, and rendezvous settings that ddprun's
     * own store makes moot (accepted so that torchrun's command lines run unchanged) */
    {"module", F_MODULE, false},
    {"no_python", F_NO_PYTHON, false},
    {"run_path", F_RUN_PATH, false},
    {"rdzv_backend", F_RDZV_BACKEND, true},
    {"rdzv_id", F_RDZV_ID, true},
    {"rdzv_conf", F_RDZV_CONF, true},
    {"role", F_ROLE, true},
    {"monitor_interval", F_MONITOR, true},
    {"start_method", F_START_METHOD, true},
    {"log_dir", F_LOG_DIR, true},
    {"redirects", F_REDIRECTS, true},
    {"tee", F_TEE, true},
};

/* --nnodes K, or torchrun's MIN:MAX when MIN == MAX (a fixed size; ddprun has no elastic
 * membership). */
static int parse_nnodes(const char *v) {
  const char *colon = strchr(v, ':');
  if (!colon) return (int)parse_long("nnodes", v, 1, 1 << 16);
  char lo[32];
  size_t n = (size_t)(colon - v);
  if (n >= sizeof lo) usage_error("--nnodes '%s': expected K or K:K", v);
  memcpy(lo, v, n);
  lo[n] = '\0';
  int a = (int)parse_long("nnodes", lo, 1, 1 << 16),
      b = (int)parse_long("nnodes", colon + 1, 1, 1 << 16);
  if (a != b)
    usage_error("--nnodes %s: ddprun runs a fixed number of nodes (no elastic membership); give "
                "one count, such as --nnodes %d",
                v, b);
  return a;
}

/* Parses argv up to the program. Options end at the first argument that does not start
 * with '-', or after "--". Any usage error exits 2 with a message naming the argument. */
static void parse_args(int argc, char **argv, options_t *o) {
  *o = (options_t){.nproc_per_node = 1,
                   .nnodes = 1,
                   .node_rank = 0,
                   .master_addr = DEFAULT_MASTER_ADDR,
                   .master_port = DEFAULT_MASTER_PORT,
                   .grace_ms = DEFAULT_GRACE_MS};
  bool node_rank_given = false, no_python = false, run_path = false;
  o->role = "default";
  o->run_id = "none";
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
    if (strcmp(a, "-m") == 0) {
      o->module = true;
      i++;
      continue;
    }
    if (strcmp(a, "-r") == 0 || strcmp(a, "-t") == 0) { /* torchrun's short forms */
      if (i + 1 >= argc) usage_error("%s needs a value", a);
      *(a[1] == 'r' ? &o->redirects : &o->tee) = argv[i + 1];
      i += 2;
      continue;
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
      case F_NNODES: o->nnodes = parse_nnodes(val); break;
      case F_NODE_RANK:
        o->node_rank = (int)parse_long(name, val, 0, (1 << 16) - 1);
        node_rank_given = true;
        break;
      case F_MASTER_ADDR:
        if (*val == '\0') usage_error("--master_addr: empty address");
        o->master_addr = val;
        o->master_addr_given = true;
        break;
      case F_MASTER_PORT:
        o->master_port = (int)parse_long(name, val, 0, 65535);
        o->master_port_given = true;
        break;
      case F_MAX_RESTARTS: o->max_restarts = (int)parse_long(name, val, 0, 1000000); break;
      case F_STANDALONE: o->standalone = true; break;
      case F_NO_RESERVE: o->no_reserve = true; break;
      case F_RDZV_ENDPOINT: parse_endpoint(val, o); break;
      case F_BACKEND: o->backend = val; break;
      case F_TIMEOUT: o->timeout_s = parse_long(name, val, 1, INT32_MAX); break;
      case F_GRACE: o->grace_ms = parse_seconds_ms(name, val, 3600.0); break;
      case F_HELP: print_help(); exit(0);
      case F_MODULE: o->module = true; break;
      case F_NO_PYTHON: no_python = true; break;
      case F_RUN_PATH: run_path = true; break;
      case F_RDZV_BACKEND:
        if (strcmp(val, "c10d") != 0 && strcmp(val, "static") != 0)
          usage_error("--rdzv_backend %s: ddprun's ranks meet at its own store (node 0 serves "
                      "it at --master_addr/--rdzv_endpoint); use c10d or static",
                      val);
        break;
      case F_RDZV_ID:
        if (*val == '\0') usage_error("--rdzv_id: empty id");
        o->run_id = val;
        break;
      case F_RDZV_CONF:
        break; /* torchrun's rendezvous timeouts: ddprun's ranks wait at the
                  store up to the collective timeout instead */
      case F_ROLE:
        if (*val == '\0') usage_error("--role: empty name");
        o->role = val;
        break;
      case F_MONITOR: parse_seconds_ms(name, val, 3600.0); break; /* exits are seen at once */
      case F_START_METHOD:
        if (strcmp(val, "spawn") != 0 && strcmp(val, "fork") != 0 && strcmp(val, "forkserver") != 0)
          usage_error("--start_method '%s': expected spawn, fork or forkserver", val);
        break; /* as with torchrun for a program: every rank is a new process either way */
      case F_LOG_DIR:
        if (*val == '\0') usage_error("--log_dir: empty path");
        o->log_dir = val;
        break;
      case F_REDIRECTS: o->redirects = val; break;
      case F_TEE: o->tee = val; break;
    }
  }
  if (i >= argc) usage_error("no program to run (usage: ddprun [options] prog [args...])");
  o->prog_argv = argv + i;
  if (no_python && o->module)
    usage_error("--no_python and -m/--module: a module runs in Python; drop one of them");
  if (no_python && run_path) usage_error("--no_python and --run_path: drop one of them");
  const char *specs[2][2] = {{"redirects", o->redirects}, {"tee", o->tee}};
  for (int k = 0; k < 2; k++)
    if (specs[k][1] && !parse_std_spec(specs[k][1], o->nproc_per_node, NULL))
      usage_error("--%s '%s': expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every "
                  "rank or per local rank as LOCAL:V,LOCAL:V (local ranks 0..%d)",
                  specs[k][0], specs[k][1], o->nproc_per_node - 1);
  size_t plen = strlen(o->prog_argv[0]);
  bool py_file = plen > 3 && strcmp(o->prog_argv[0] + plen - 3, ".py") == 0;
  if (o->module || run_path || (py_file && !no_python)) {
    const char *exe = getenv("PYTHON_EXEC");
    o->python = exe && *exe ? exe : DDPRUN_PYTHON;
  }

  if (o->node_rank >= o->nnodes)
    usage_error("--node_rank %d is out of range for --nnodes %d (0..%d)", o->node_rank, o->nnodes,
                o->nnodes - 1);
  if ((int64_t)o->nnodes * o->nproc_per_node > INT32_MAX)
    usage_error("--nnodes %d x --nproc_per_node %d is too many ranks", o->nnodes,
                o->nproc_per_node);
  if (o->nnodes > 1 && !o->master_addr_given)
    usage_error("--nnodes %d needs --master_addr (the address of node 0, where the store "
                "runs)",
                o->nnodes);
  if (node_rank_given && o->nnodes == 1 && o->node_rank != 0)
    usage_error("--node_rank %d without --nnodes", o->node_rank);
  if (o->backend) check_backend(o->backend, o->nnodes);
  if (o->standalone) {
    if (o->nnodes > 1) usage_error("--standalone is a one-node job; drop --nnodes %d", o->nnodes);
    if (o->master_port_given || o->master_addr_given)
      usage_error("--standalone chooses the address (127.0.0.1) and a free port itself; drop "
                  "--master_addr, --master_port and --rdzv_endpoint");
    o->master_port = 0;
  }
  o->port_auto = o->master_port == 0;
  /* libddp's rule for the dump location (src/pg/flight_recorder.c): the first one set. */
  const char *d = getenv("DDP_FR_DUMP_DIR"), *p = getenv("TORCH_FR_DUMP_TEMP_FILE");
  if (!p || !*p) p = getenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE");
  o->fr_dir = d && *d ? d : "";
  o->fr_prefix = o->fr_dir[0] || !p ? "" : p;
  if (o->master_port == 0 && o->nnodes > 1)
    usage_error("--master_port 0 (a port chosen by the OS) works with one node only: the "
                "other nodes could not know it");
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

/* ------------------------------------------------------------------ attempts -------- */

/* What one attempt came to, for the final report. */
typedef struct attempt {
  int rank; /* the first failed rank, -1 when none failed */
  int pid;
  char what[96];  /* how it ended ("killed by signal 9 (SIGKILL)") */
  int others;     /* other ranks that failed or were stopped */
  bool killed;    /* SIGKILL was needed */
  double seconds; /* from its start until its failure was seen (or its end) */
  int code;       /* its exit status */
} attempt_t;

/* The rank to blame for the attempt. The first failure seen can be a peer that exited on
 * the lost connection a moment before the killed rank became waitable: a process closes its
 * sockets while it is torn down, before its exit is reported, and under load a tcp peer can
 * exit in that window. A rank that ended by a signal ddprun did not send (SIGTERM to stop the
 * others, SIGKILL once the grace period ran out) is then the likelier cause, and is named. */
static int culprit(const launcher_t *L) {
  int f = L->first_failed;
  if (L->ranks[f].how != CLD_EXITED) return f;
  for (int i = 0; i < L->nranks; i++) {
    const rank_proc_t *r = &L->ranks[i];
    if (i == f || r->state == RANK_RUNNING || r->how == CLD_EXITED) continue;
    if (r->status != SIGTERM && !(L->killed && r->status == SIGKILL) &&
        !(L->dumping && r->status == SIGUSR1))
      return i;
  }
  return f;
}

/* The outcome of the attempt just finished, and its exit status. */
static attempt_t outcome(const launcher_t *L) {
  attempt_t a = {.rank = -1};
  int64_t end = L->first_failed >= 0 ? L->failed_ns : now_ns();
  a.seconds = (double)(end - L->start_ns) / 1e9;
  if (L->first_failed >= 0) {
    int c = culprit(L);
    const rank_proc_t *f = &L->ranks[c];
    a.rank = f->rank;
    a.pid = (int)f->pid;
    describe_exit(f, a.what, sizeof a.what);
    for (int i = 0; i < L->nranks; i++) a.others += i != c && rank_failed(&L->ranks[i]);
    a.killed = L->killed;
    a.code = f->how == CLD_EXITED ? f->status : 128 + f->status;
  } else if (L->interrupt_sig) {
    a.code = 128 + L->interrupt_sig;
  } else if (L->launch_failed || L->gave_up) {
    a.code = EXIT_LAUNCH;
  }
  return a;
}

static void describe_attempt(const attempt_t *a, char *buf, size_t cap) {
  char tail[96] = "";
  if (a->others > 0)
    snprintf(tail, sizeof tail, " (%d other rank(s) failed or were stopped%s)", a->others,
             a->killed ? ", SIGKILL was needed" : "");
  snprintf(buf, cap, "rank %d (pid %d) failed first: %s%s", a->rank, a->pid, a->what, tail);
}

/* Prints the outcome and returns ddprun's exit code: the last attempt's. Without restarts
 * the report is the failed rank's line alone; with them, one line per attempt. */
static int report(const launcher_t *L, const attempt_t *at, int n) {
  const attempt_t *last = &at[n - 1];
  char line[512];
  if (L->opt.max_restarts > 0 && (n > 1 || last->rank >= 0)) {
    for (int k = 0; k < n; k++) {
      if (at[k].rank >= 0)
        describe_attempt(&at[k], line, sizeof line);
      else
        snprintf(line, sizeof line, "%s",
                 at[k].code == 0 ? "every rank exited 0" : "stopped without a rank failing");
      say("attempt %d of %d (TORCHELASTIC_RESTART_COUNT=%d), %.2f s: %s", k + 1,
          L->opt.max_restarts + 1, k, at[k].seconds, line);
    }
    say("%d restart(s) used of --max_restarts %d; exit status %d (attempt %d's)", n - 1,
        L->opt.max_restarts, last->code, n);
  } else if (last->rank >= 0) {
    describe_attempt(last, line, sizeof line);
    say("%s", line);
  }
  if (L->interrupt_sig) say("stopped by %s", signal_name(L->interrupt_sig));
  return last->code;
}

int main(int argc, char **argv) {
  launcher_t L;
  memset(&L, 0, sizeof L);
  L.first_failed = -1;
  L.listen_fd = -1;
  parse_args(argc, argv, &L.opt);
  int rc = job_token(&L.opt, L.token, sizeof L.token);
  if (rc != 0) return rc;

  int n = L.opt.nproc_per_node;
  /* torchrun's default: several ranks on one node would each start a thread per core */
  if (n > 1 && !getenv("OMP_NUM_THREADS")) {
    if (setenv("OMP_NUM_THREADS", "1", 1) != 0) {
      say("setenv OMP_NUM_THREADS: %s", strerror(errno));
      return EXIT_LAUNCH;
    }
    say("OMP_NUM_THREADS is not set: each of the %d ranks gets OMP_NUM_THREADS=1, as under "
        "torchrun; export it to choose another count",
        n);
  }
  int max_attempts = L.opt.max_restarts + 1;
  L.ranks = calloc((size_t)n, sizeof *L.ranks);
  L.pfds = calloc((size_t)2 * n, sizeof *L.pfds);
  L.pstreams = calloc((size_t)2 * n, sizeof *L.pstreams);
  L.pranks = calloc((size_t)2 * n, sizeof *L.pranks);
  attempt_t *at = calloc((size_t)(max_attempts < 64 ? max_attempts : 64), sizeof *at);
  if (!L.ranks || !L.pfds || !L.pstreams || !L.pranks || !at) {
    say("out of memory for %d ranks", n);
    rc = EXIT_LAUNCH;
    goto out;
  }
  for (int i = 0; i < n; i++) {
    rank_proc_t *r = &L.ranks[i];
    r->rank = L.opt.node_rank * n + i;
    r->prefix_len = (size_t)snprintf(r->prefix, sizeof r->prefix, "[rank%d]: ", r->rank);
    r->out =
        (line_stream_t){.fd = -1, .log_fd = -1, .out_fd = STDOUT_FILENO, .buf = malloc(LINE_CAP)};
    r->err =
        (line_stream_t){.fd = -1, .log_fd = -1, .out_fd = STDERR_FILENO, .buf = malloc(LINE_CAP)};
    if (!r->out.buf || !r->err.buf) {
      say("out of memory for the output buffers of %d ranks", n);
      rc = EXIT_LAUNCH;
      goto out;
    }
  }
  if ((rc = prepare_logs(&L)) != 0) goto out;
  sigset_t orig_mask, wait_mask;
  install_signals(&orig_mask, &wait_mask);

  /* Attempts: the whole group each time; only the last 64 are kept for the report. */
  int kept = 0;
  for (int k = 0; k < max_attempts; k++) {
    if ((rc = reserve_port(&L.opt, &L.listen_fd)) != 0) {
      if (k == 0) goto out;
      at[kept < 64 ? kept++ : 63] = (attempt_t){.rank = -1, .code = rc};
      break;
    }
    /* A fresh store for each attempt, so nothing of the failed one is read again (PyTorch's
     * clients also prefix their keys with the attempt). */
    if ((rc = serve_store(&L)) != 0) {
      if (k == 0) goto out;
      at[kept < 64 ? kept++ : 63] = (attempt_t){.rank = -1, .code = rc};
      break;
    }
    L.restart_count = k;
    run_attempt(&L, &orig_mask, &wait_mask);
    ddp_store_server_stop(L.store);
    L.store = NULL;
    if (L.listen_fd >= 0) close(L.listen_fd);
    L.listen_fd = -1;
    if (kept == 64) memmove(at, at + 1, 63 * sizeof *at), kept = 63;
    at[kept++] = outcome(&L);
    const attempt_t *a = &at[kept - 1];
    if (a->rank < 0 || L.interrupt_sig || L.launch_failed || L.gave_up) break;
    if (k + 1 < max_attempts) {
      char line[512];
      describe_attempt(a, line, sizeof line);
      say("%s; restarting the worker group (restart %d of %d) %.2f s after the failure", line,
          k + 1, L.opt.max_restarts, (double)(now_ns() - L.failed_ns) / 1e9);
    }
  }
  rc = report(&L, at, kept);
out:
  if (L.ranks) {
    for (int i = 0; i < n; i++) {
      free(L.ranks[i].out.buf);
      free(L.ranks[i].err.buf);
    }
  }
  free(L.ranks);
  free(L.pfds);
  free(L.pstreams);
  free(L.pranks);
  free(at);
  return rc;
}
