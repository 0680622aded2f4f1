/* The flight recorder (flight_recorder.h, docs/errors.md "Flight recorder").
 *
 * Entries live in a ring of N slots allocated with the group; record id i sits in slot
 * i % N, so the ring always holds the last N collectives. Times are wall-clock nanoseconds
 * (CLOCK_REALTIME, as PyTorch's dumps), comparable between ranks of one host.
 *
 * Dumps: one JSON object per file, the group's configuration, status and entries, written
 * through the one atomic writer (src/common/file.c: a temporary beside the dump, fsync,
 * rename), so a reader sees the old dump or the new one, never a torn file. Where a dump goes:
 * DDP_FR_DUMP_DIR/fr_rank_<r>.json, else <TORCH_FR_DUMP_TEMP_FILE><r>, else
 * <TORCH_NCCL_DEBUG_INFO_TEMP_FILE><r> (PyTorch's prefix semantics), else nowhere (dumps on request
 * only).
 *
 * The job-wide dump: a rank whose group fails writes its dump, then the trigger file beside
 * it (fr_trigger in the directory, or <prefix>trigger). Every process with a recorder polls
 * that file's modification time every FR_POLL_MS and dumps its recorders when it is newer
 * than the group and than the last one it acted on. So a stalled rank, which has no reason
 * of its own to dump, leaves its history too (PyTorch has its watchdogs signal one another
 * through the store; libddp's groups do not keep the store). Its dump must then stay the one
 * that shows where it stood: a recorder that already dumped while outside any collective does
 * not overwrite that dump at its own later failure.
 *
 * Process-wide state: the SIGUSR1 handler can only reach static storage, so the registry of
 * recorders that have a dump location, the semaphore the handler posts (sem_post is
 * async-signal-safe; the handler does nothing else) and the watcher thread that serves both
 * are the one static object of this layer. The thread starts with the first such recorder
 * and then lives as long as the process, blocked on the semaphore while no recorder is
 * registered. The handler is installed only over SIGUSR1's default action (a program's own
 * handler is left alone), and stays: once a group with a dump location existed, SIGUSR1 no
 * longer terminates the process. */
#include "pg/flight_recorder.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <x86intrin.h>
#endif
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FR_TAG_BYTES 256
#define FR_POLL_MS 100
#define FR_MAX_ENTRIES 1000000

enum { FR_SCHEDULED = 0, FR_STARTED = 1, FR_COMPLETED = 2 };

typedef struct fr_entry {
  uint64_t record_id;
  uint64_t seq; /* collective_seq_id, or the pair's p2p_seq_id */
  uint64_t count;
  uint8_t kind, dtype, op, algo, state;
  int32_t root;
  ddp_status_t status; /* DDP_OK until it ends otherwise */
  bool ended;
  int64_t t_created, t_started, t_ended; /* recorder ticks (ddp__fr_now); 0 = not yet */
  int64_t bucket;                        /* -1: not a DDP bucket */
  char tag[FR_TAG_BYTES];
} fr_entry_t;

struct ddp__fr {
  pthread_mutex_t *mu; /* the group's lock (info.lock): guards everything below except the
                        * immutable configuration */
  ddp__fr_info_t info;
  char backend[32];
  size_t cap;  /* entries a dump shows (DDP_FR_BUFFER_SIZE) */
  size_t mask; /* the ring holds mask + 1 >= cap entries, a power of two: record id's slot
                * is id & mask, since a division per lookup (three per collective) costs as
                * much as a tenth of a small collective's bookkeeping */
  fr_entry_t *ring;
  uint64_t next_id;
  uint64_t sent_xw; /* W times the bytes this rank sent, in ring_sent_xw's model, over every
                     * recorded collective */
  int64_t last_enqueued, last_started, last_completed; /* collective seq, -1 = none */
  int64_t inflight;                                    /* recorded and not yet ended */
  int64_t tag_bucket;
  char tag[FR_TAG_BYTES];
  ddp_status_t failed;
  char fail_msg[DDP_ERROR_MSG_MAX];
  int64_t fail_ns;
  bool failure_dumped; /* a dump at a failure (own or another rank's) was written */
  bool dumped_inside;  /* ... while a collective was in flight */
  int64_t created_ns;
  int64_t mono_to_wall; /* CLOCK_REALTIME - CLOCK_MONOTONIC at creation, ns: every time in
                         * the dump is CLOCK_MONOTONIC plus this, one timebase per process */
  bool tsc;             /* ticks are the invariant TSC; else CLOCK_MONOTONIC ns */
  int64_t tick0, mono0; /* a tick and CLOCK_MONOTONIC read together at creation */
  double ns_per_tick;   /* measured from (tick0, mono0) to the latest dump */
  int64_t trigger_seen_ns;
  char path[PATH_MAX]; /* "" = no dump location */
  char trigger[PATH_MAX];
  struct ddp__fr *next; /* registry */
};

static struct {
  pthread_mutex_t mu; /* guards the fields below but `signalled` */
  sem_t sem;
  pid_t watcher_pid; /* the process whose watcher runs (0: none; a forked child starts its own) */
  bool atfork;
  ddp__fr_t *head;
  atomic_int signalled;
} g_fr = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int64_t wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Recorder ticks. Three stamps per collective sit on a small collective's path; on x86-64
 * with an invariant TSC (CPUID 0x80000007 EDX bit 8: constant rate, running in every
 * C-state, the same on every core) a stamp is one rdtsc, 11 ns on the development VM against
 * 27 ns for clock_gettime (kvm-clock). Ticks become CLOCK_MONOTONIC ns only in a dump, by
 * the rate measured from the recorder's creation to the dump, which a constant-rate counter
 * makes exact but for the two clock reads' own jitter. Elsewhere a tick is a nanosecond. */
static bool invariant_tsc(void) {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a, b, c, d;
  return __get_cpuid(0x80000007u, &a, &b, &c, &d) && (d & (1u << 8));
#else
  return false;
#endif
}

int64_t ddp__fr_now(const ddp__fr_t *fr) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (fr && fr->tsc) return (int64_t)__rdtsc();
#endif
  return fr ? ddp_now_ns() : 0;
}

/* A tick and CLOCK_MONOTONIC taken together: the clock read between two ticks, paired with
 * their midpoint, retried while the thread was interrupted between them (a preemption there
 * would skew the measured rate by its length over the recorder's lifetime). */
static void clock_pair(const ddp__fr_t *fr, int64_t *tick, int64_t *mono) {
  for (int i = 0; i < 8; i++) {
    int64_t a = ddp__fr_now(fr);
    *mono = ddp_now_ns();
    int64_t b = ddp__fr_now(fr);
    *tick = a + (b - a) / 2;
    if (b - a < 20000) return; /* 20000 ticks: a few microseconds at GHz rates */
  }
}

/* Measures the tick rate against CLOCK_MONOTONIC now (before a dump; *fr->mu held). */
static void calibrate(ddp__fr_t *fr) {
  if (!fr->tsc) return;
  int64_t t, m;
  clock_pair(fr, &t, &m);
  if (t > fr->tick0 && m > fr->mono0)
    fr->ns_per_tick = (double)(m - fr->mono0) / (double)(t - fr->tick0);
}

/* A recorder stamp as CLOCK_REALTIME ns (0 stays 0: not yet). */
static int64_t wall_of(const ddp__fr_t *fr, int64_t t) {
  if (!t) return 0;
  return fr->mono0 + (int64_t)((double)(t - fr->tick0) * fr->ns_per_tick) + fr->mono_to_wall;
}

/* ---------------------------------------------------------------- configuration ---- */

static ddp_status_t buffer_size(size_t *out, ddp_error_t *err) {
  int64_t n = 0;
  ddp_env_id_t id = !ddp_env_is_set(DDP_ENV_FR_BUFFER_SIZE) &&
                            ddp_env_is_set(DDP_ENV_TORCH_FR_BUFFER_SIZE)
                        ? DDP_ENV_TORCH_FR_BUFFER_SIZE
                        : DDP_ENV_FR_BUFFER_SIZE;
  DDP_CHECK(ddp_env_int(id, 0, FR_MAX_ENTRIES, &n, err));
  *out = (size_t)n;
  return DDP_OK;
}

/* The dump and trigger paths for this rank; "" when no location is configured. */
static void dump_location(ddp__fr_t *fr) {
  int r = fr->info.rank;
  if (ddp_env_is_set(DDP_ENV_FR_DUMP_DIR)) {
    const char *d = ddp_env_get(DDP_ENV_FR_DUMP_DIR);
    if (mkdir(d, 0777) != 0 && errno != EEXIST)
      ddp__log(r, DDP_LOG_WARN, "flight recorder: cannot create DDP_FR_DUMP_DIR %s: %s", d,
               strerror(errno));
    snprintf(fr->path, sizeof fr->path, "%s/fr_rank_%d.json", d, r);
    snprintf(fr->trigger, sizeof fr->trigger, "%s/fr_trigger", d);
    return;
  }
  ddp_env_id_t ids[] = {DDP_ENV_TORCH_FR_DUMP_TEMP_FILE, DDP_ENV_TORCH_NCCL_DEBUG_INFO_TEMP_FILE};
  for (size_t i = 0; i < DDP_ARRAY_LEN(ids); i++) {
    if (!ddp_env_is_set(ids[i])) continue;
    snprintf(fr->path, sizeof fr->path, "%s%d", ddp_env_get(ids[i]), r);
    snprintf(fr->trigger, sizeof fr->trigger, "%strigger", ddp_env_get(ids[i]));
    return;
  }
}

/* ---------------------------------------------------------------- the dump --------- */

static const char *torch_dtype(uint8_t dt) {
  switch ((ddp_dtype_t)dt) {
    case DDP_F32: return "Float";
    case DDP_F64: return "Double";
    case DDP_F16: return "Half";
    case DDP_BF16: return "BFloat16";
    case DDP_I32: return "Int";
    case DDP_I64: return "Long";
    case DDP_U8: return "Byte";
    case DDP_BOOL: return "Bool";
    default: return "?";
  }
}

static const char *torch_op(uint8_t kind) {
  switch ((ddp_coll_kind_t)kind) {
    case DDP_COLL_ALLREDUCE: return "all_reduce";
    case DDP_COLL_BROADCAST: return "broadcast";
    case DDP_COLL_ALLGATHER: return "all_gather";
    case DDP_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case DDP_COLL_ALLTOALL: return "all_to_all";
    case DDP_COLL_BARRIER: return "barrier";
    case DDP_COLL_SEND: return "send";
    case DDP_COLL_RECV: return "recv";
  }
  return "?";
}

static const char *state_name(uint8_t s) {
  return s == FR_COMPLETED ? "completed" : s == FR_STARTED ? "started" : "scheduled";
}

static void add_i64(cJSON *o, const char *key, int64_t v) {
  char num[32];
  snprintf(num, sizeof num, "%lld", (long long)v);
  cJSON_AddRawToObject(o, key, num);
}

static void add_ns_or_null(cJSON *o, const char *key, int64_t v) {
  if (v) {
    add_i64(o, key, v);
  } else {
    cJSON_AddNullToObject(o, key);
  }
}

/* [[n]] (one tensor of n elements), or [] for a barrier. */
static cJSON *sizes(const fr_entry_t *e, uint64_t n) {
  cJSON *a = cJSON_CreateArray();
  if (e->kind == DDP_COLL_BARRIER) return a;
  cJSON *t = cJSON_CreateArray();
  char num[32];
  snprintf(num, sizeof num, "%llu", (unsigned long long)n);
  cJSON_AddItemToArray(t, cJSON_CreateRaw(num));
  cJSON_AddItemToArray(a, t);
  return a;
}

static cJSON *dtypes(const fr_entry_t *e) {
  cJSON *a = cJSON_CreateArray();
  if (e->kind != DDP_COLL_BARRIER)
    cJSON_AddItemToArray(a, cJSON_CreateString(torch_dtype(e->dtype)));
  return a;
}

/* W times the bytes one rank sends in a collective of `count` elements of `esz` bytes under
 * the bandwidth-optimal ring algorithms, whatever algorithm the backend ran (nccl-tests' bus
 * bytes; the Ultra-Scale Playbook's accounting), so ranks and backends count alike: all-reduce
 * 2(W-1)/W S, all-gather and reduce-scatter (W-1)/W of the full buffer, broadcast (W-1)/W S
 * (a pipelined ring: every rank but the last forwards S; the mean), all-to-all (W-1)/W of the
 * buffer, send S; receive and barrier nothing. Times W so the sum stays an exact integer. */
static uint64_t ring_sent_xw(int kind, uint64_t count, uint64_t esz, uint64_t W) {
  uint64_t S = count * esz;
  if (W < 2 && kind != DDP_COLL_SEND) return 0;
  switch (kind) {
    case DDP_COLL_ALLREDUCE: return 2 * (W - 1) * S;
    case DDP_COLL_ALLGATHER: /* count is one rank's part */
    case DDP_COLL_REDUCE_SCATTER:
    case DDP_COLL_ALLTOALL: return W * (W - 1) * S;
    case DDP_COLL_BROADCAST: return (W - 1) * S;
    case DDP_COLL_SEND: return W * S;
    default: return 0;
  }
}

static cJSON *entry_json(const ddp__fr_t *fr, const fr_entry_t *e, const char *pg_name) {
  uint64_t W = (uint64_t)fr->info.world, n = e->count;
  uint64_t in = n, out = n;
  if (e->kind == DDP_COLL_ALLGATHER) out = W * n;
  if (e->kind == DDP_COLL_REDUCE_SCATTER) in = W * n;
  if (e->kind == DDP_COLL_ALLTOALL) in = out = W * n;
  bool p2p = e->kind == DDP_COLL_SEND || e->kind == DDP_COLL_RECV;
  cJSON *o = cJSON_CreateObject();
  add_i64(o, "record_id", (int64_t)e->record_id);
  add_i64(o, "pg_id", fr->info.pg_id);
  cJSON *pgn = cJSON_AddArrayToObject(o, "process_group");
  cJSON_AddItemToArray(pgn, cJSON_CreateString(pg_name));
  cJSON_AddItemToArray(pgn, cJSON_CreateString("default_pg"));
  add_i64(o, "collective_seq_id", p2p ? 0 : (int64_t)e->seq);
  add_i64(o, "p2p_seq_id", p2p ? (int64_t)e->seq : 0);
  add_i64(o, "op_id", (int64_t)e->record_id);
  char prof[64];
  snprintf(prof, sizeof prof, "%s:%s", fr->backend, torch_op(e->kind));
  cJSON_AddStringToObject(o, "profiling_name", prof);
  add_i64(o, "time_created_ns", wall_of(fr, e->t_created));
  add_i64(o, "timeout_ms", fr->info.timeout_ms);
  cJSON_AddItemToObject(o, "input_sizes", sizes(e, in));
  cJSON_AddItemToObject(o, "input_dtypes", dtypes(e));
  cJSON_AddItemToObject(o, "output_sizes", sizes(e, out));
  cJSON_AddItemToObject(o, "output_dtypes", dtypes(e));
  cJSON_AddStringToObject(o, "state", state_name(e->state));
  add_ns_or_null(o, "time_discovered_started_ns", wall_of(fr, e->t_started));
  add_ns_or_null(o, "time_discovered_completed_ns",
                 e->state == FR_COMPLETED ? wall_of(fr, e->t_ended) : 0);
  if (e->state == FR_COMPLETED && e->t_started) {
    cJSON_AddNumberToObject(o, "duration_ms",
                            (double)(e->t_ended - e->t_started) * fr->ns_per_tick / 1e6);
  } else {
    cJSON_AddNullToObject(o, "duration_ms");
  }
  cJSON_AddBoolToObject(o, "retired", e->ended);
  cJSON_AddBoolToObject(o, "is_p2p", p2p);
  cJSON_AddArrayToObject(o, "frames");
  /* libddp's own fields */
  cJSON_AddStringToObject(o, "ddp_op",
                          e->kind == DDP_COLL_ALLREDUCE || e->kind == DDP_COLL_REDUCE_SCATTER
                              ? ddp_redop_name((ddp_redop_t)e->op)
                              : "");
  cJSON_AddStringToObject(o, "ddp_dtype",
                          e->kind == DDP_COLL_BARRIER ? "" : ddp_dtype_name((ddp_dtype_t)e->dtype));
  add_i64(o, "ddp_count", (int64_t)e->count);
  cJSON_AddNumberToObject(o, "ddp_sent_bytes",
                          (double)ring_sent_xw(e->kind, e->count,
                                               ddp_dtype_size((ddp_dtype_t)e->dtype), W) /
                              (double)W);
  cJSON_AddStringToObject(o, "ddp_algorithm", ddp_algorithm_name((ddp_algorithm_t)e->algo));
  add_i64(o, "ddp_root", e->root);
  cJSON_AddStringToObject(o, "ddp_status", ddp_status_name(e->status));
  if (e->bucket >= 0) {
    add_i64(o, "ddp_bucket", e->bucket);
    cJSON *names = cJSON_AddArrayToObject(o, "ddp_params");
    const char *s = e->tag;
    while (*s) {
      const char *c = strchr(s, ',');
      size_t len = c ? (size_t)(c - s) : strlen(s);
      char name[FR_TAG_BYTES];
      memcpy(name, s, len);
      name[len] = 0;
      cJSON_AddItemToArray(names, cJSON_CreateString(name));
      s += len + (c ? 1 : 0);
    }
  } else if (e->tag[0]) {
    cJSON_AddStringToObject(o, "ddp_tag", e->tag);
  }
  return o;
}

/* The whole dump as text (caller frees with cJSON_free); NULL when out of memory. Takes
 * *fr->mu. */
static char *dump_text(ddp__fr_t *fr, const char *reason) {
  cJSON *root = cJSON_CreateObject();
  char pg_name[32];
  snprintf(pg_name, sizeof pg_name, "%lld", (long long)fr->info.pg_id);
  cJSON_AddStringToObject(root, "version", "2.4");
  cJSON_AddStringToObject(root, "comm_lib_version", "libddp");
  add_i64(root, "rank", fr->info.rank);
  add_i64(root, "world_size", fr->info.world);
  cJSON_AddStringToObject(root, "backend", fr->backend);
  cJSON_AddStringToObject(root, "dump_reason", reason);
  add_i64(root, "dump_time_ns", ddp_now_ns() + fr->mono_to_wall);
  add_i64(root, "pid", (int64_t)getpid());
  cJSON *cfg = cJSON_AddObjectToObject(root, "pg_config");
  cJSON *me = cJSON_AddObjectToObject(cfg, pg_name);
  cJSON_AddStringToObject(me, "name", pg_name);
  cJSON_AddStringToObject(me, "desc", "default_pg");
  size_t rl = 8 + (size_t)fr->info.world * 6, len = 0;
  char *ranks = malloc(rl);
  if (ranks) {
    len += (size_t)snprintf(ranks, rl, "[");
    for (int r = 0; r < fr->info.world; r++)
      len += (size_t)snprintf(ranks + len, rl - len, "%s%d", r ? ", " : "", r);
    snprintf(ranks + len, rl - len, "]");
    cJSON_AddStringToObject(me, "ranks", ranks);
    free(ranks);
  }
  pthread_mutex_lock(fr->mu);
  calibrate(fr);
  cJSON *status = cJSON_AddObjectToObject(root, "pg_status");
  cJSON *st = cJSON_AddObjectToObject(status, pg_name);
  add_i64(st, "last_enqueued_collective", fr->last_enqueued);
  add_i64(st, "last_started_collective", fr->last_started);
  add_i64(st, "last_completed_collective", fr->last_completed);
  if (fr->failed != DDP_OK) {
    cJSON *f = cJSON_AddObjectToObject(root, "ddp_failure");
    cJSON_AddStringToObject(f, "status", ddp_status_name(fr->failed));
    cJSON_AddStringToObject(f, "message", fr->fail_msg);
    add_i64(f, "time_ns", fr->fail_ns);
  } else {
    cJSON_AddNullToObject(root, "ddp_failure");
  }
  cJSON *entries = cJSON_AddArrayToObject(root, "entries");
  uint64_t first = fr->next_id > fr->cap ? fr->next_id - fr->cap : 0;
  for (uint64_t id = first; id < fr->next_id; id++)
    cJSON_AddItemToArray(entries, entry_json(fr, &fr->ring[id & fr->mask], pg_name));
  pthread_mutex_unlock(fr->mu);
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  return text;
}

static ddp_status_t write_atomically(const char *path, const char *text, int rank,
                                     ddp_error_t *err) {
  ddp__afile_t f;
  DDP_CHECK(ddp__afile_open(&f, path, rank, "flight recorder", err));
  ddp__afile_write(&f, text, strlen(text));
  ddp__afile_write(&f, "\n", 1);
  return ddp__afile_commit(&f, 0644);
}

ddp_status_t ddp__fr_dump(ddp__fr_t *fr, const char *path, const char *reason, ddp_error_t *err) {
  if (!fr)
    return ddp__error(err, -1, DDP_ERR_INVALID_USAGE,
                      "the flight recorder is off (DDP_FR_BUFFER_SIZE=0)");
  if (!path || !path[0]) path = fr->path;
  if (!path[0])
    return ddp__error(err, fr->info.rank, DDP_ERR_INVALID_USAGE,
                      "flight recorder: no dump path given and none configured (set "
                      "DDP_FR_DUMP_DIR or TORCH_FR_DUMP_TEMP_FILE)");
  char *text = dump_text(fr, reason);
  if (!text)
    return ddp__error(err, fr->info.rank, DDP_ERR_NO_MEMORY, "flight recorder: the dump of %s",
                      path);
  ddp_status_t st = write_atomically(path, text, fr->info.rank, err);
  cJSON_free(text);
  if (st == DDP_OK)
    ddp__log(fr->info.rank, DDP_LOG_INFO, "flight recorder: dumped (%s) to %s", reason, path);
  return st;
}

/* ---------------------------------------------------------------- watcher ---------- */

static void on_sigusr1(int sig) {
  (void)sig;
  int e = errno;
  atomic_store(&g_fr.signalled, 1);
  sem_post(&g_fr.sem);
  errno = e;
}

/* A dump at another rank's failure, at most once per trigger (g_fr.mu held). */
static void poll_trigger(ddp__fr_t *fr) {
  struct stat sb;
  if (!fr->trigger[0] || stat(fr->trigger, &sb) != 0) return;
  int64_t m = (int64_t)sb.st_mtim.tv_sec * 1000000000LL + sb.st_mtim.tv_nsec;
  pthread_mutex_lock(fr->mu);
  bool act = m >= fr->created_ns && m != fr->trigger_seen_ns && !fr->failure_dumped;
  fr->trigger_seen_ns = m;
  if (act) {
    fr->failure_dumped = true;
    fr->dumped_inside = fr->inflight > 0;
  }
  pthread_mutex_unlock(fr->mu);
  if (act) {
    ddp_error_t e = {DDP_OK, ""};
    if (ddp__fr_dump(fr, NULL, "another_rank_dumped", &e) != DDP_OK)
      ddp__log(fr->info.rank, DDP_LOG_WARN, "%s", e.msg);
  }
}

static void *watcher_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&g_fr.mu);
    bool any = g_fr.head != NULL;
    pthread_mutex_unlock(&g_fr.mu);
    if (any) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += FR_POLL_MS * 1000000L;
      if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      sem_timedwait(&g_fr.sem, &ts);
    } else {
      sem_wait(&g_fr.sem);
    }
    bool sig = atomic_exchange(&g_fr.signalled, 0) != 0;
    pthread_mutex_lock(&g_fr.mu);
    for (ddp__fr_t *fr = g_fr.head; fr; fr = fr->next) {
      if (sig) {
        ddp_error_t e = {DDP_OK, ""};
        if (ddp__fr_dump(fr, NULL, "signal", &e) != DDP_OK)
          ddp__log(fr->info.rank, DDP_LOG_WARN, "%s", e.msg);
      } else {
        poll_trigger(fr);
      }
    }
    pthread_mutex_unlock(&g_fr.mu);
  }
  return NULL;
}

static void fork_prepare(void) { pthread_mutex_lock(&g_fr.mu); }
static void fork_release(void) { pthread_mutex_unlock(&g_fr.mu); }

/* Starts this process's watcher (g_fr.mu held). A forked child inherits the parent's
 * registry but not its thread: it starts afresh, with none of the parent's recorders. */
static bool watcher_start(void) {
  if (g_fr.watcher_pid == getpid()) return true;
  if (!g_fr.atfork && pthread_atfork(fork_prepare, fork_release, fork_release) == 0)
    g_fr.atfork = true;
  g_fr.head = NULL;
  if (sem_init(&g_fr.sem, 0, 0) != 0) return false;
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  /* the watcher never takes SIGUSR1 itself: a handler interrupting it gains nothing */
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  int rc = pthread_create(&t, &a, watcher_main, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&a);
  if (rc != 0) return false;
  g_fr.watcher_pid = getpid();
  struct sigaction cur;
  if (sigaction(SIGUSR1, NULL, &cur) == 0 && !(cur.sa_flags & SA_SIGINFO) &&
      cur.sa_handler == SIG_DFL) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigusr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
  }
  return true;
}

static void registry_add(ddp__fr_t *fr) {
  pthread_mutex_lock(&g_fr.mu);
  bool ok = watcher_start();
  if (ok) {
    fr->next = g_fr.head;
    g_fr.head = fr;
  }
  pthread_mutex_unlock(&g_fr.mu);
  if (!ok) {
    ddp__log(fr->info.rank, DDP_LOG_WARN,
             "flight recorder: no watcher thread: dumps on SIGUSR1 and at other ranks' "
             "failures are off");
    return;
  }
  sem_post(&g_fr.sem); /* the watcher starts polling */
}

static void registry_remove(ddp__fr_t *fr) {
  pthread_mutex_lock(&g_fr.mu);
  for (ddp__fr_t **p = &g_fr.head; *p; p = &(*p)->next) {
    if (*p == fr) {
      *p = fr->next;
      break;
    }
  }
  pthread_mutex_unlock(&g_fr.mu);
}

/* ---------------------------------------------------------------- recording -------- */

ddp_status_t ddp__fr_create(const ddp__fr_info_t *info, ddp__fr_t **out, ddp_error_t *err) {
  *out = NULL;
  size_t cap = 0;
  DDP_CHECK(buffer_size(&cap, err));
  if (cap == 0) return DDP_OK;
  size_t slots = 1;
  while (slots < cap) slots *= 2;
  ddp__fr_t *fr = ddp__calloc(1, sizeof *fr);
  fr_entry_t *ring = fr ? ddp__calloc(slots, sizeof *ring) : NULL;
  if (!ring) {
    ddp__free(fr);
    return ddp__error(err, info->rank, DDP_ERR_NO_MEMORY,
                      "flight recorder: %zu entries of %zu bytes (DDP_FR_BUFFER_SIZE %zu)", slots,
                      sizeof *ring, cap);
  }
  fr->mu = info->lock;
  fr->info = *info;
  snprintf(fr->backend, sizeof fr->backend, "%s", info->backend);
  fr->info.backend = fr->backend;
  fr->cap = cap;
  fr->mask = slots - 1;
  fr->ring = ring;
  fr->last_enqueued = fr->last_started = fr->last_completed = -1;
  fr->tag_bucket = -1;
  fr->created_ns = wall_ns();
  fr->mono0 = ddp_now_ns();
  fr->mono_to_wall = fr->created_ns - fr->mono0;
  fr->tsc = invariant_tsc();
  fr->tick0 = fr->mono0;
  if (fr->tsc) clock_pair(fr, &fr->tick0, &fr->mono0);
  fr->ns_per_tick = 1.0;
  dump_location(fr);
  if (fr->path[0]) registry_add(fr);
  *out = fr;
  return DDP_OK;
}

void ddp__fr_destroy(ddp__fr_t *fr) {
  if (!fr) return;
  if (fr->path[0]) registry_remove(fr);
  ddp__free(fr->ring);
  ddp__free(fr);
}

void ddp__fr_set_tag(ddp__fr_t *fr, int64_t bucket, const char *text) {
  if (!fr) return;
  pthread_mutex_lock(fr->mu);
  fr->tag_bucket = bucket;
  size_t n = text ? strlen(text) : 0;
  if (n < sizeof fr->tag) {
    memcpy(fr->tag, text ? text : "", n + 1);
  } else { /* whole names only, then "...": cut after the last comma that leaves room */
    size_t cut = sizeof fr->tag - 5;
    while (cut > 0 && text[cut] != ',') cut--;
    memcpy(fr->tag, text, cut);
    memcpy(fr->tag + cut, cut ? ",..." : "...", cut ? 5 : 4);
  }
  pthread_mutex_unlock(fr->mu);
}

uint64_t ddp__fr_record(ddp__fr_t *fr, const ddp__coll_t *c, int64_t now) {
  if (!fr) return 0;
  uint64_t id = fr->next_id++;
  fr_entry_t *e = &fr->ring[id & fr->mask];
  e->record_id = id;
  e->seq = c->fp.seq;
  e->count = c->count;
  fr->sent_xw += ring_sent_xw(c->kind, c->count, ddp_dtype_size(c->dt), (uint64_t)fr->info.world);
  e->kind = (uint8_t)c->kind;
  e->dtype = (uint8_t)c->dt;
  e->op = (uint8_t)c->op;
  e->algo = (uint8_t)c->algo;
  e->root = c->root;
  e->state = FR_SCHEDULED;
  e->status = DDP_OK;
  e->ended = false;
  e->t_created = now;
  e->t_started = e->t_ended = 0;
  e->bucket = fr->tag_bucket;
  if (fr->tag_bucket >= 0 || fr->tag[0]) {
    memcpy(e->tag, fr->tag, sizeof e->tag);
    fr->tag_bucket = -1;
    fr->tag[0] = 0;
  } else {
    e->tag[0] = 0;
  }
  if (c->kind != DDP_COLL_SEND && c->kind != DDP_COLL_RECV) fr->last_enqueued = (int64_t)c->fp.seq;
  fr->inflight++;
  return id;
}

double ddp__fr_sent_bytes(ddp__fr_t *fr) {
  pthread_mutex_lock(fr->mu);
  double v = (double)fr->sent_xw / (double)(fr->info.world > 0 ? fr->info.world : 1);
  pthread_mutex_unlock(fr->mu);
  return v;
}

/* The live entry of record id, or NULL when the ring has moved past it (*fr->mu held). */
static fr_entry_t *entry(ddp__fr_t *fr, uint64_t id) {
  fr_entry_t *e = &fr->ring[id & fr->mask];
  return e->record_id == id && id < fr->next_id ? e : NULL;
}

static bool is_p2p(const fr_entry_t *e) {
  return e->kind == DDP_COLL_SEND || e->kind == DDP_COLL_RECV;
}

void ddp__fr_start(ddp__fr_t *fr, uint64_t id, int64_t now) {
  if (!fr) return;
  fr_entry_t *e = entry(fr, id);
  if (e) {
    e->state = FR_STARTED;
    e->t_started = now;
    if (!is_p2p(e)) fr->last_started = (int64_t)e->seq;
  }
}

void ddp__fr_end(ddp__fr_t *fr, uint64_t id, ddp_status_t st) {
  if (!fr) return;
  int64_t now = ddp__fr_now(fr);
  fr->inflight--;
  fr_entry_t *e = entry(fr, id);
  if (e) {
    e->ended = true;
    e->t_ended = now;
    e->status = st;
    if (st == DDP_OK) {
      e->state = FR_COMPLETED;
      if (!is_p2p(e)) fr->last_completed = (int64_t)e->seq;
    }
  }
}

void ddp__fr_on_failure(ddp__fr_t *fr, ddp_status_t st, const char *msg) {
  if (!fr) return;
  pthread_mutex_lock(fr->mu);
  bool first = fr->failed == DDP_OK;
  if (first) {
    fr->failed = st;
    snprintf(fr->fail_msg, sizeof fr->fail_msg, "%s", msg);
    fr->fail_ns = ddp_now_ns() + fr->mono_to_wall;
  }
  /* a dump taken while this rank stood outside every collective shows where it stalled:
   * keep it */
  bool write = first && fr->path[0] && (!fr->failure_dumped || fr->dumped_inside);
  if (write) fr->failure_dumped = true;
  pthread_mutex_unlock(fr->mu);
  if (!write) return;
  const char *reason = st == DDP_ERR_TIMEOUT   ? "timeout"
                       : st == DDP_ERR_DESYNC  ? "desync"
                       : st == DDP_ERR_REMOTE  ? "peer_failure"
                       : st == DDP_ERR_ABORTED ? "abort"
                                               : "failure";
  ddp_error_t e = {DDP_OK, ""};
  if (ddp__fr_dump(fr, NULL, reason, &e) != DDP_OK) {
    ddp__log(fr->info.rank, DDP_LOG_WARN, "%s", e.msg);
    return;
  }
  ddp__log(fr->info.rank, DDP_LOG_WARN, "flight recorder: dumped to %s (%s)", fr->path, reason);
  int fd = open(fr->trigger, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0 || futimens(fd, NULL) != 0)
    ddp__log(fr->info.rank, DDP_LOG_WARN, "flight recorder: cannot touch %s: %s", fr->trigger,
             strerror(errno));
  if (fd >= 0) close(fd);
}
