/* ddprun's parts, shared by tools/programs/ddprun.c (options, attempts, report), ddprun_proc.c (the
 * ranks of one attempt: start, relay output, watch, stop), ddprun_net.c (the store's port,
 * the store, and leftovers of a job) and ddprun_log.c (per-rank log files). ddprun's own loop is
 * single-threaded; on node 0, libddp's store server runs beside it in a thread of its own
 * (docs/launcher.md). */
#ifndef DDPRUN_H
#define DDPRUN_H

#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>

#include "ddp/store.h"

enum {
  EXIT_LAUNCH = 1,        /* ddprun could not start the job */
  EXIT_USAGE = 2,         /* bad command line */
  MAX_LOCAL_RANKS = 1024, /* two pipes each must fit the usual 4096-descriptor limit */
  LINE_CAP = 65536,       /* a longer line is passed on in pieces of this size */
  BATCH_LINES = 256,      /* lines per writev (two iovecs each, under IOV_MAX) */
  DRAIN_MS = 2000,        /* after the last rank exits: wait this long for pipe EOF */
  REAP_MS = 10000,        /* after SIGKILL: wait this long for ranks to go */
  TOKEN_BYTES = 16,
  MAX_RANK_VARS = 32 /* variables ddprun sets in a rank's environment (ddprun_proc.c) */
};

#define DEFAULT_MASTER_ADDR "127.0.0.1"
#define DEFAULT_MASTER_PORT 29500
#define DEFAULT_RDZV_PORT 29400 /* torchrun's port when --rdzv_endpoint names none */
#define DEFAULT_GRACE_MS 3000

typedef struct options {
  int nproc_per_node;
  int nnodes;
  int node_rank;
  const char *master_addr;
  bool master_addr_given;
  int master_port; /* 0: chosen by the OS (--standalone, --master_port 0) */
  bool master_port_given;
  bool standalone;
  bool no_reserve;     /* --no_reserve_port: rank 0 binds the port itself (a non-libddp store) */
  bool port_auto;      /* the port is the OS's choice: another one will do on a restart */
  int max_restarts;    /* restarts of the whole worker group after a failure */
  const char *backend; /* NULL: DDP_BACKEND is left as inherited */
  long timeout_s;      /* 0: DDP_TIMEOUT is left as inherited */
  int64_t grace_ms;
  /* Where the ranks' flight recorders dump (src/pg/flight_recorder.c's rule): rank r writes
   * <fr_dir>/fr_rank_<r>.json when fr_dir is set, else <fr_prefix><r>; both "": no dumps. */
  const char *fr_dir;
  const char *fr_prefix;
  char **prog_argv; /* NULL-terminated, points into argv */
  /* How prog runs, as torchrun runs it: through `python -u [-m]` (python: $PYTHON_EXEC,
   * else DDPRUN_PYTHON, a Python that imports torch) for -m, --run_path or a prog named *.py
   * unless --no_python; else prog itself. NULL: prog itself. */
  const char *python;
  bool module;           /* -m: prog is a module, run as `python -u -m prog` */
  const char *role;      /* --role: ROLE_NAME ["default"] */
  const char *run_id;    /* --rdzv_id: TORCHELASTIC_RUN_ID ["none"] */
  const char *log_dir;   /* --log_dir, or NULL */
  const char *redirects; /* --redirects, torchrun's spec ("3", "0:1,1:2"), or NULL */
  const char *tee;       /* --tee, the same */
  char rdzv_host[256];   /* --rdzv_endpoint's host, master_addr points here when given */
} options_t;

/* ------------------------------------------------------------------ state ----------- */

/* One output stream of one rank: the read end of its pipe and the bytes of a line that
 * has not ended yet. */
typedef struct line_stream {
  int fd;     /* read end; -1 once closed */
  int out_fd; /* STDOUT_FILENO or STDERR_FILENO */
  size_t len; /* bytes held in buf */
  char *buf;  /* LINE_CAP bytes */
  int log_fd; /* --redirects/--tee: the stream's log file (ddprun_log.c); -1: none */
  bool quiet; /* redirected: to the log file only, not to ddprun's stream */
} line_stream_t;

typedef enum rank_state {
  RANK_RUNNING, /* not seen to exit */
  RANK_EXITED,  /* exit seen with WNOWAIT: still a zombie, so its pid and group id stay ours */
  RANK_REAPED
} rank_state_t;

typedef struct rank_proc {
  int rank;  /* global */
  pid_t pid; /* also its process group id */
  rank_state_t state;
  int how;         /* si_code: CLD_EXITED, CLD_KILLED or CLD_DUMPED */
  int status;      /* exit code or signal */
  char prefix[32]; /* "[rankN]: " */
  size_t prefix_len;
  uint8_t redirects, tee; /* this local rank's --redirects and --tee: 1 stdout, 2 stderr */
  line_stream_t out, err;
} rank_proc_t;

typedef struct launcher {
  options_t opt;
  char token[256];
  rank_proc_t *ranks;
  int nranks;        /* ranks started */
  int first_failed;  /* index into ranks, -1 while none */
  int interrupt_sig; /* first SIGINT/SIGTERM ddprun received, 0 if none */
  bool launch_failed;
  bool dumping;  /* SIGUSR1 has been sent: waiting for the ranks' flight-recorder dumps */
  bool stopping; /* SIGTERM (or the forwarded signal) has been sent */
  bool killed;   /* SIGKILL has been sent */
  bool gave_up;  /* ranks survived SIGKILL for REAP_MS */
  int64_t dump_deadline_ns;   /* then SIGTERM, whether or not every dump was written */
  struct timespec dump_asked; /* CLOCK_REALTIME_COARSE when SIGUSR1 was sent (file times) */
  int64_t kill_deadline_ns;
  int64_t give_up_deadline_ns;
  int restart_count; /* this attempt: 0 first, then 1, 2, ... (TORCHELASTIC_RESTART_COUNT) */
  int listen_fd;     /* the store's listening socket (node 0); -1: none */
  ddp_store_server_t *store; /* this attempt's store, served by ddprun on listen_fd; or NULL */
  int64_t start_ns;          /* when this attempt started */
  int64_t failed_ns;         /* when its first failure was seen */
  bool out_dead[3];          /* writing to fd 1 or 2 failed: keep draining the ranks, drop output */
  char log_run_dir[4096];    /* where the rank logs go (ddprun_log.c); "" when none */
  struct pollfd *pfds;       /* poll set, 2 per rank, rebuilt every wait */
  line_stream_t **pstreams;  /* the stream behind each pfds entry */
  rank_proc_t **pranks;      /* and its rank */
} launcher_t;

/* One message = one write, so ddprun's own lines never split the ranks' lines. */
__attribute__((format(printf, 1, 2))) void say(const char *fmt, ...);
void write_all(int fd, const char *p, size_t n);
const char *signal_name(int sig);
int64_t now_ns(void);

/* ddprun_proc.c */
void describe_exit(const rank_proc_t *r, char *buf, size_t cap);
bool rank_failed(const rank_proc_t *r);
/* Blocks SIGCHLD, SIGINT and SIGTERM (they are taken only inside the wait) and installs the
 * handlers; orig_mask is what children get back, wait_mask what the wait unblocks. */
void install_signals(sigset_t *orig_mask, sigset_t *wait_mask);
/* Starts every local rank of one attempt, supervises them until all have exited (or
 * outlived SIGKILL), removes what they left in /dev/shm and reaps them. */
void run_attempt(launcher_t *L, const sigset_t *orig_mask, const sigset_t *wait_mask);

/* ddprun_net.c */
/* Node 0's store port: binds master_addr:master_port (port 0: any, chosen by the OS, which
 * is then written into o->master_port) and listens, so that the port is this job's from now
 * on; ddprun serves the store on it (serve_store). Returns 0, or ddprun's exit code after saying
 * why (a port that another job's store holds is refused here, before any rank starts). Not on other
 * nodes: *fd = -1. */
int reserve_port(options_t *o, int *fd);
/* Removes the /dev/shm/ddp-<uid>-<pid>-* segments of the rank with that pid (what the shm
 * backend's rank 0 names its segment), which a rank stopped before it unlinked leaves. */
void remove_shm_leftovers(const rank_proc_t *r);
/* Node 0 serves this attempt's store on the reserved socket: libddp's protocol (with the job
 * token) and PyTorch's TCPStore protocol (TORCHELASTIC_USE_AGENT_STORE=True). Takes the
 * socket over; returns 0, or ddprun's exit code after saying why. */
int serve_store(launcher_t *L);
/* Whether the ranks are told to connect to a store that a launcher serves. */
bool agent_store(const launcher_t *L);

/* ddprun_log.c: torchrun's --log_dir, --redirects, --tee */
/* Reads a --redirects/--tee value, "0".."3" for every local rank or "LOCAL:V,..." (the
 * others 0), into out[nproc] (NULL: only checks it). False when malformed. */
bool parse_std_spec(const char *v, int nproc, uint8_t *out);
/* Gives each rank its redirects and tee, and when any stream is logged makes the job's log
 * directory and says where it is. Returns 0, or ddprun's exit code after saying why. */
int prepare_logs(launcher_t *L);
/* Opens the log files this attempt's rank writes (none when it logs nothing). */
bool open_rank_logs(const launcher_t *L, rank_proc_t *r, int local_rank);
void close_stream_log(line_stream_t *s);

#endif
