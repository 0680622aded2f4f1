/* The process-group API: the per-group queue and progress thread, work handles, failure
 * state, and group creation from options (launch.c: from a launcher's environment, or for a
 * set of threads). The collectives' entry points, with the argument checks, are issue.c.
 *
 * Life of a collective: the entry point validates its arguments, stamps the collective with
 * the group's next sequence number (its fingerprint: seq, kind, op, dtype, count, root,
 * algorithm), and queues it. Queued work runs one item at a time in issue order with a
 * deadline of now + timeout, through the algorithms of the backend's family (src/algo), on
 * the progress thread or, when the caller waits for it while nothing else runs, on the
 * caller's own thread (ddp_work_wait; this saves two thread hand-offs per small
 * collective; a blocking call on an idle group runs there without being queued). The first
 * failure fails the group: its message names the collective and the rank(s) at fault;
 * queued and later work fails with the same status without running. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

/* pg drives the algorithms and looks backends up in the registry: both are layers below it
 * (docs/design.md), so these private headers are downward edges. No backend includes
 * algo.h; the backends and the algorithms meet only in ddp/backend.h. */
#include "algo/algo.h"
#include "backend/backends.h"
#include "ddp/pg.h"
#include "pg/fault.h"
#include "pg/flight_recorder.h"
#include "pg/pg_internal.h"

static bool peers_failed(ddp_pg_t *pg);

/* w's error record, made on its first failure; NULL when even that allocation fails (the
 * status is still set, the message is then only in the log). */
static ddp_error_t *work_err(ddp_work_t *w) {
  if (!w->err && (w->err = ddp__malloc(sizeof *w->err))) ddp__error_clear(w->err);
  return w->err;
}

static ddp_status_t parse_algorithm(const char *s, ddp_algorithm_t *out, ddp_error_t *err) {
  static const ddp_algorithm_t all[] = {DDP_ALGO_AUTO, DDP_ALGO_CANONICAL, DDP_ALGO_RING,
                                        DDP_ALGO_SMALL};
  for (size_t i = 0; i < DDP_ARRAY_LEN(all); i++) {
    if (strcasecmp(s, ddp_algorithm_name(all[i])) == 0) {
      *out = all[i];
      return DDP_OK;
    }
  }
  return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                    "DDP_ALGORITHM=\"%s\" is not one of auto, canonical, ring, small", s);
}

/* ---------------------------------------------------------------- progress thread -- */

static void work_release(ddp_work_t *w) {
  if (atomic_fetch_sub(&w->refs, 1) == 1) {
    w->magic = 0;
    ddp__free(w->err);
    ddp__free(w);
  }
}

/* msg without a leading "rank <this rank>: ", which a message quoted inside this rank's
 * own message would otherwise repeat. */
static const char *own_rank_stripped(const ddp_pg_t *pg, const char *msg) {
  char own[24];
  int n = snprintf(own, sizeof own, "rank %d: ", pg->rank);
  return strncmp(msg, own, (size_t)n) == 0 ? msg + n : msg;
}

/* pg_internal.h. Also what run_blocking (issue.c) runs. */
bool ddp__pg_run_one(ddp_pg_t *pg, ddp_work_t *w, ddp_status_t failed) {
  char name[192];         /* the collective's name, formatted only for a failure */
  if (failed != DDP_OK) { /* fail_err is fixed once failed is set */
    ddp__fp_str(&w->coll.fp, name, sizeof name);
    ddp_error_t *e = work_err(w);
    w->status = e ? ddp__error_quiet(e, failed, "rank %d: %s not run: the group had failed: %s",
                                     pg->rank, name, own_rank_stripped(pg, pg->fail_err.msg))
                  : failed;
    return false;
  }
  ddp_error_t detail; /* not zeroed: 8 KiB per collective; a failure fills it */
  ddp__error_clear(&detail);
  pg->comm.deadline_ns = pg->ops->family == DDP_BACKEND_SHARED && !pg->ops->run
                             ? DDP__DEADLINE_LAZY
                             : ddp_deadline_from(ddp_now_ns(), pg->timeout_ms);
  ddp_status_t st = DDP_ERR_UNSUPPORTED;
  if (pg->ops->run) {
    const ddp__coll_t *k = &w->coll;
    ddp_backend_coll_t bc = {k->kind, k->send, k->recv, k->count, k->dt, k->op, k->root, k->algo};
    st = pg->ops->run(pg->state, &bc, pg->comm.deadline_ns, &detail);
  }
  if (st == DDP_ERR_UNSUPPORTED)
    st = pg->ops->family == DDP_BACKEND_SHARED ? ddp__run_shared(&pg->comm, &w->coll, &detail)
                                               : ddp__run_link(&pg->comm, &w->coll, &detail);
  /* Work running when the group is aborted ends ABORTED (ddp_pg_abort's contract), also
   * when its data completed meanwhile: on tcp a peer may send its part after this rank's
   * abort, and that peer then fails on this rank's closed stream, so an OK here would be
   * the only success of the collective (seen in the soak: test_abort_unblocks). */
  if (atomic_load(&pg->comm.aborted) && st != DDP_ERR_DESYNC && st != DDP_ERR_ABORTED) {
    if (st == DDP_OK)
      ddp__error_quiet(&detail, DDP_ERR_ABORTED, "the group was aborted on rank %d", pg->rank);
    st = DDP_ERR_ABORTED;
  }
  if (st == DDP_OK) {
    w->status = DDP_OK;
    return false;
  }
  ddp__fp_str(&w->coll.fp, name, sizeof name);
  ddp_error_t spare, *e = work_err(w);
  w->status = ddp__error(e ? e : &spare, pg->rank, st, "rank %d: %s on backend %s: %s", pg->rank,
                         name, pg->ops->name, detail.msg);
  if (!e) e = &spare;
  if (pg->ops->family == DDP_BACKEND_LINK && pg->ops->fail) pg->ops->fail(pg->state);
  pthread_mutex_lock(&pg->mu);
  ddp__fr_end(pg->fr, w->fr_id, st);
  bool first = pg->failed == DDP_OK;
  if (first) {
    pg->failed = st;
    pg->fail_err = *e;
  }
  pthread_mutex_unlock(&pg->mu);
  if (first) ddp__fr_on_failure(pg->fr, st, e->msg); /* the dump, at the moment it fails */
  return true;
}

/* Takes the head of the queue and runs it; called with pg->mu held and pg->running false,
 * returns with pg->mu held. Whoever runs work (the progress thread, or a thread waiting in
 * ddp_work_wait) holds `running` for the duration, so work still runs one item at a time in
 * issue order. When it finishes and more is queued, the progress thread is signalled in case
 * the finisher was a waiter that now leaves. */
static void run_head(ddp_pg_t *pg) {
  ddp_work_t *w = pg->head;
  pg->head = w->next;
  if (!pg->head) pg->tail = NULL;
  pg->running = true;
  pg->lazy = false;
  ddp_status_t failed = pg->failed; /* then w is not run, and the recorder shows it unstarted */
  if (failed == DDP_OK) ddp__fr_start(pg->fr, w->fr_id, ddp__fr_now(pg->fr));
  pthread_mutex_unlock(&pg->mu);
  bool ended = ddp__pg_run_one(pg, w, failed);
  pthread_mutex_lock(&pg->mu);
  if (!ended) ddp__fr_end(pg->fr, w->fr_id, w->status);
  atomic_store(&w->done, 1);
  pg->running = false;
  pthread_cond_broadcast(&pg->cv_done);
  if (pg->head) pthread_cond_signal(&pg->cv_queue);
  work_release(w); /* may free w: no lock of its own, so under pg->mu is fine */
}

/* The progress thread. While the group is active (work queued in the last
 * LAZY_ACTIVE_NS) it sleeps in slices of LAZY_POLL_NS, so work queued lazily (without a
 * wake-up) starts within a slice even if its caller never waits for it; after that it
 * sleeps until woken, and submit wakes it. Blocking calls that run on their caller's
 * thread queue nothing and do not count: a loop of them (MPI_Allreduce style) would
 * otherwise wake this thread a thousand times a second on every rank for nothing. */
static void *progress_main(void *arg) {
  ddp_pg_t *pg = arg;
  pthread_mutex_lock(&pg->mu);
  for (;;) {
    if (pg->head && !pg->running) {
      run_head(pg);
      continue;
    }
    if (pg->stop) break;
    int64_t now = ddp_now_ns();
    if (now - pg->last_submit_ns >= LAZY_ACTIVE_NS) {
      pg->deep_sleep = true;
      pthread_cond_wait(&pg->cv_queue, &pg->mu);
      pg->deep_sleep = false;
    } else {
      int64_t t = now + LAZY_POLL_NS;
      struct timespec ts = {(time_t)(t / 1000000000LL), (long)(t % 1000000000LL)};
      pthread_cond_timedwait(&pg->cv_queue, &pg->mu, &ts);
    }
  }
  pthread_mutex_unlock(&pg->mu);
  return NULL;
}

/* ---------------------------------------------------------------- create / destroy -- */

static void pg_free(ddp_pg_t *pg) {
  if (pg->state) pg->ops->destroy(pg->state);
  ddp__free(pg->comm.scratch);
  ddp__free(pg->comm.tmp);
  ddp__free(pg->comm.p2p_tx);
  ddp__free(pg->comm.p2p_rx);
  ddp__free(pg->p2p_send_seq);
  ddp__free(pg->p2p_recv_seq);
  /* the recorder first: the watcher thread may be dumping it, under pg->mu */
  ddp__fr_destroy(pg->fr);
  pthread_mutex_destroy(&pg->mu);
  pthread_cond_destroy(&pg->cv_queue);
  pthread_cond_destroy(&pg->cv_done);
  ddp_store_destroy(pg->owned_store);
  ddp__free((char *)pg->opts.job_token);
  pg->magic = 0;
  ddp__free(pg);
}

/* ddp_pg_create, step 1: the caller's options (ddp__opts_read), completed from the
 * environment (DDP_BACKEND, DDP_TIMEOUT, DDP_ALGORITHM) and checked; *ops is the backend
 * they name. */
static ddp_status_t resolve_options(const ddp_pg_options_t *in, ddp_pg_options_t *o,
                                    const ddp_backend_ops_t **ops, ddp_error_t *err) {
  ddp__opts_read(o, sizeof *o, in);
  int rank = o->rank;
  if (o->world < 1 || o->world > DDP_PG_MAX_WORLD)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "world size %d is not in [1, %d]",
                      o->world, DDP_PG_MAX_WORLD);
  if (rank < 0 || rank >= o->world)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "rank %d is not in [0, %d)", rank,
                      o->world);
  const char *bname = o->backend ? o->backend : ddp_env_get(DDP_ENV_BACKEND);
  if (!bname[0]) bname = "threads";
  *ops = ddp_backend_find(bname);
  if (!*ops)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "unknown backend \"%s\"; the choices are %s", bname, ddp_backend_names());
  if ((*ops)->abi_version != DDP_BACKEND_ABI_VERSION)
    return ddp__error(err, rank, DDP_ERR_UNSUPPORTED,
                      "backend %s has ABI version %u, this library needs %u", (*ops)->name,
                      (*ops)->abi_version, DDP_BACKEND_ABI_VERSION);
  if (o->timeout_ms < 0) {
    int64_t s;
    DDP_CHECK(ddp_env_int(DDP_ENV_TIMEOUT, 0, INT64_MAX / 1000, &s, err));
    o->timeout_ms = s * 1000;
  }
  if (o->algorithm == DDP_ALGO_AUTO)
    DDP_CHECK(parse_algorithm(ddp_env_get(DDP_ENV_ALGORITHM), &o->algorithm, err));
  if (o->algorithm > DDP_ALGO_SMALL)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "algorithm %d is not a ddp_algorithm_t",
                      (int)o->algorithm);
  if (!o->job_token) o->job_token = ddp_env_get(DDP_ENV_JOB_TOKEN);
  return DDP_OK;
}

/* Step 2: the group's memory, locks and algorithm state, before the backend exists. */
static ddp_status_t pg_new(const ddp_pg_options_t *o, const ddp_backend_ops_t *ops, ddp_pg_t **out,
                           ddp_error_t *err) {
  int rank = o->rank;
  ddp_pg_t *pg = ddp__calloc(1, sizeof *pg);
  if (!pg) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "process group");
  pg->magic = PG_MAGIC;
  pg->rank = rank;
  pg->size = o->world;
  pg->ops = ops;
  pg->algo = o->algorithm;
  pg->timeout_ms = o->timeout_ms;
  pg->small_max = ops->family == DDP_BACKEND_SHARED ? SMALL_SHARED
                  : ops->stream && o->world == 2    ? SMALL_STREAM_PAIR
                                                    : SMALL_LINK;
  pg->log_detail = ddp__log_enabled(DDP_LOG_DETAIL); /* read once: it reads the environment */
  pg->lazy_max = o->defer_start                      ? SIZE_MAX
                 : ops->family == DDP_BACKEND_SHARED ? LAZY_SHARED
                                                     : LAZY_LINK;
  pthread_mutex_init(&pg->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&pg->cv_queue, &ca);
  pthread_cond_init(&pg->cv_done, &ca);
  pthread_condattr_destroy(&ca);
  *out = pg;

  ddp__comm_t *c = &pg->comm;
  c->rank = rank;
  c->size = o->world;
  c->ops = ops;
  c->segment_bytes = o->segment_bytes;
  c->check_fp = true;
  c->timeout_ms = o->timeout_ms;
  atomic_init(&c->aborted, false);
  c->scratch_bytes = ops->family == DDP_BACKEND_SHARED
                         ? DDP__SHARED_BOX_BYTES
                         : (size_t)o->world * DDP_MAX(2 * o->segment_bytes, pg->small_max);
  c->scratch = ddp__malloc(c->scratch_bytes);
  c->tmp = ddp__malloc(DDP_REDUCE_TMP_BYTES);
  c->p2p_tx = ddp__calloc((size_t)o->world, sizeof(uint64_t));
  c->p2p_rx = ddp__calloc((size_t)o->world, sizeof(uint64_t));
  pg->p2p_send_seq = ddp__calloc((size_t)o->world, sizeof(uint64_t));
  pg->p2p_recv_seq = ddp__calloc((size_t)o->world, sizeof(uint64_t));
  if (!c->scratch || !c->tmp || !c->p2p_tx || !c->p2p_rx || !pg->p2p_send_seq || !pg->p2p_recv_seq)
    return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "process group buffers");
  static const ddp__pg_fault_ops_t fault_ops = {peers_failed, ddp_pg_status, ddp_pg_abort_reason};
  const ddp_backend_info_t *bi = ddp_backend_info(ddp_pg_backend_name(pg));
  bool threads = bi && bi->ranks == DDP_RANKS_THREADS;
  return ddp__pg_fault_init(&pg->fault, rank, threads, &fault_ops, err);
}

/* Step 3: the backend joins the group. Each group gets its own key space: the k-th group
 * a rank creates on a store uses the prefix "ddp_pg/<k>" (*k), so re-creating a group
 * after a failure (docs/errors.md) never reads the previous group's rendezvous keys. Ranks
 * create groups in the same order, so they agree on k without talking. */
static ddp_status_t join_backend(ddp_pg_t *pg, const ddp_pg_options_t *o, size_t staging,
                                 int64_t *k, ddp_error_t *err) {
  int rank = pg->rank;
  ddp_backend_init_t init = {sizeof init,      rank,
                             o->world,         o->store,
                             o->timeout_ms,    o->job_token,
                             staging,          ddp__shared_ctl_bytes(o->world),
                             o->shm_heap_bytes};
  ddp_store_t *view = NULL;
  *k = 0;
  if (o->store) {
    char key[64];
    ddp_error_t se = {DDP_OK, ""};
    snprintf(key, sizeof key, "ddp_pg/created/%d", rank);
    ddp_status_t st = ddp_store_add(o->store, key, 1, k);
    if (st != DDP_OK) {
      ddp_store_last_error_copy(o->store, &se);
    } else {
      snprintf(key, sizeof key, "ddp_pg/%lld", (long long)*k);
      st = ddp_store_create_prefix(o->store, key, &view, &se);
    }
    /* the store has logged it */
    if (st != DDP_OK) return ddp__error_quiet(err, st, "rank %d: store: %s", rank, se.msg);
    init.store = view;
  }
  ddp_status_t st = pg->ops->create(&init, &pg->state, err);
  ddp_store_destroy(view);
  if (st == DDP_OK) pg->comm.state = pg->state;
  return st;
}

/* Step 4, once the group runs: what rank 0 says about it at INFO. */
static void log_created(const ddp_pg_t *pg) {
  if (pg->rank != 0 || !ddp__log_enabled(DDP_LOG_INFO)) return;
  const ddp_backend_ops_t *ops = pg->ops;
  if (pg->algo == DDP_ALGO_AUTO && ops->family == DDP_BACKEND_SHARED)
    ddp__log(pg->rank, DDP_LOG_INFO,
             "process group: backend %s, world %d, timeout %lld ms; allreduce algorithm: "
             "small up to %zu bytes, then up to %u bytes canonical where every rank's buffers "
             "are in shared memory and small otherwise, canonical above (DDP_ALGORITHM=auto)",
             ops->name, pg->size, (long long)pg->timeout_ms, pg->small_max, DDP__SHARED_BOX_BYTES);
  else if (pg->algo == DDP_ALGO_AUTO)
    ddp__log(pg->rank, DDP_LOG_INFO,
             "process group: backend %s, world %d, timeout %lld ms; allreduce algorithm: "
             "small up to %zu bytes, canonical above (DDP_ALGORITHM=auto)",
             ops->name, pg->size, (long long)pg->timeout_ms, pg->small_max);
  else
    ddp__log(pg->rank, DDP_LOG_INFO,
             "process group: backend %s, world %d, timeout %lld ms; allreduce algorithm: %s "
             "for every size%s",
             ops->name, pg->size, (long long)pg->timeout_ms, ddp_algorithm_name(pg->algo),
             pg->algo == DDP_ALGO_RING && ops->family == DDP_BACKEND_SHARED
                 ? " (ring is a link algorithm: shared-memory backends run canonical)"
                 : "");
}

ddp_status_t ddp_pg_create(const ddp_pg_options_t *opts, ddp_pg_t **out, ddp_error_t *err) {
  DDP_REQUIRE(opts && out);
  *out = NULL;
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  const ddp_backend_ops_t *ops = NULL;
  DDP_CHECK(resolve_options(opts, &o, &ops, err));
  /* The pipelining segment: DDP_PG_SEGMENT_BYTES_DEFAULT unless set, rounded up to 64 bytes. shm
   * staging is the segment size when the caller set one (tests reach the chunked path with small
   * messages), else 4 MiB per rank. */
  size_t seg_requested = o.segment_bytes;
  if (o.segment_bytes == 0) o.segment_bytes = DDP_PG_SEGMENT_BYTES_DEFAULT;
  o.segment_bytes = DDP_MAX((o.segment_bytes + 63) & ~(size_t)63, 64u);
  size_t staging = seg_requested ? DDP_MAX(o.segment_bytes, 64u * (size_t)o.world) : (4u << 20);

  ddp_pg_t *pg = NULL;
  int64_t k = 0;
  ddp_status_t st = pg_new(&o, ops, &pg, err);
  if (st == DDP_OK) st = join_backend(pg, &o, staging, &k, err);
  if (st == DDP_OK) { /* for ddp_pg_split (split.c) */
    pg->store = o.store;
    pg->store_k = k;
    pg->opts = o;
    pg->opts.segment_bytes = seg_requested;
    pg->opts.job_token = o.job_token ? ddp__strdup(o.job_token) : NULL;
    if (o.job_token && !pg->opts.job_token)
      st = ddp__error(err, o.rank, DDP_ERR_NO_MEMORY, "process group: job token");
  }
  if (st == DDP_OK && !o.no_flight_recorder) {
    ddp__fr_info_t fri = {o.rank, o.world, ops->name, k, o.timeout_ms, &pg->mu};
    st = ddp__fr_create(&fri, &pg->fr, err);
  }
  if (st == DDP_OK && ops->family == DDP_BACKEND_SHARED) {
    pg->comm.sh = ops->shared(pg->state);
    ddp__shared_attach(&pg->comm, (int)getpid());
  }
  if (st == DDP_OK && pthread_create(&pg->thread, NULL, progress_main, pg) != 0)
    st = ddp__error(err, o.rank, DDP_ERR_SYSTEM, "pthread_create of the progress thread failed");
  if (st != DDP_OK) {
    if (pg) pg_free(pg);
    return st;
  }
  log_created(pg);
  *out = pg;
  return DDP_OK;
}

void ddp_pg_set_desync_check(ddp_pg_t *pg, bool on) { pg->comm.check_fp = on; }

void ddp_pg_destroy(ddp_pg_t *pg) {
  if (!pg) return;
  DDP_REQUIRE(pg->magic == PG_MAGIC);
  pthread_mutex_lock(&pg->mu);
  pg->stop = true;
  pthread_cond_signal(&pg->cv_queue);
  pthread_mutex_unlock(&pg->mu);
  pthread_join(pg->thread, NULL);
  if (pg->comm.sh) ddp__shared_leave(&pg->comm);
  pg_free(pg);
}

void ddp_pg_abort(ddp_pg_t *pg) { ddp_pg_abort_reason(pg, NULL); }

void ddp_pg_abort_reason(ddp_pg_t *pg, const char *reason) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  if (atomic_exchange(&pg->comm.aborted, true)) return;
  char msg[DDP_ERROR_MSG_MAX];
  snprintf(msg, sizeof msg, "rank %d aborted the group%s%s", pg->rank,
           reason && reason[0] ? ": " : "", reason ? reason : "");
  pthread_mutex_lock(&pg->mu);
  bool first = pg->failed == DDP_OK;
  if (first) {
    pg->failed = DDP_ERR_ABORTED;
    ddp__error_quiet(&pg->fail_err, DDP_ERR_ABORTED, "%s (ddp_pg_abort)", msg);
  }
  pthread_mutex_unlock(&pg->mu);
  if (first) ddp__fr_on_failure(pg->fr, DDP_ERR_ABORTED, msg);
  if (pg->ops->family == DDP_BACKEND_SHARED) ddp__shared_poison(&pg->comm, DDP_ERR_ABORTED, msg);
  if (pg->ops->abort) pg->ops->abort(pg->state);
}

void ddp_pg_set_next_collective_tag(ddp_pg_t *pg, int64_t bucket, const char *text) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  ddp__fr_set_tag(pg->fr, bucket, text);
}

double ddp_pg_bytes_sent(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return pg->fr ? ddp__fr_sent_bytes(pg->fr) : -1.0;
}

bool ddp_pg_flight_recorder_enabled(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return pg->fr != NULL;
}

ddp_status_t ddp_pg_dump_flight_recorder(ddp_pg_t *pg, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return ddp__fr_dump(pg->fr, path, "request", err);
}

int ddp_pg_rank(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return pg->rank;
}

int ddp_pg_size(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return pg->size;
}

const char *ddp_pg_backend_name(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  return pg->ops->name;
}

void ddp_pg_last_error_copy(const ddp_pg_t *pg, ddp_error_t *out) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC && out);
  ddp_pg_t *m = (ddp_pg_t *)pg; /* the lock is not part of the logical state */
  pthread_mutex_lock(&m->mu);
  *out = m->failed != DDP_OK ? m->fail_err : m->arg_err;
  pthread_mutex_unlock(&m->mu);
}

void ddp__pg_own_store(ddp_pg_t *pg, ddp_store_t *store) { pg->owned_store = store; }

ddp_status_t ddp_pg_status(const ddp_pg_t *pg) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  ddp_pg_t *m = (ddp_pg_t *)pg;
  pthread_mutex_lock(&m->mu);
  ddp_status_t st = m->failed;
  pthread_mutex_unlock(&m->mu);
  return st;
}

void *ddp_pg_alloc(ddp_pg_t *pg, size_t bytes) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  void *p = pg->ops->mem_alloc ? pg->ops->mem_alloc(pg->state, bytes)
                               : ddp__aligned_alloc(bytes ? bytes : 1);
  if (p) return p;
  ddp_error_t why = {DDP_OK, ""};
  if (pg->ops->alloc_error) pg->ops->alloc_error(pg->state, &why);
  pthread_mutex_lock(&pg->mu);
  ddp__error_quiet(&pg->arg_err, DDP_ERR_NO_MEMORY,
                   "rank %d: ddp_pg_alloc of %zu bytes on "
                   "backend %s failed: %s",
                   pg->rank, bytes, pg->ops->name, why.msg[0] ? why.msg : "out of memory");
  pthread_mutex_unlock(&pg->mu);
  return NULL;
}

void ddp_pg_free(ddp_pg_t *pg, void *ptr) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  if (!ptr) return;
  if (pg->ops->mem_free) {
    pg->ops->mem_free(pg->state, ptr);
  } else {
    ddp__aligned_free(ptr);
  }
}

/* The fault layer's peers_failed (fault.h). */
static bool peers_failed(ddp_pg_t *pg) {
  if (pg->ops->family != DDP_BACKEND_SHARED || !pg->comm.sh) return false;
  ddp_error_t e;
  return ddp__shared_group_failed(&pg->comm, &e) != DDP_OK;
}

/* ---------------------------------------------------------------- work handles ----- */

/* Wakes the progress thread for lazily queued work (pg->mu held): a caller that polls or
 * waits with a short timeout expects the work to progress in the background now. */
static void kick_lazy(ddp_pg_t *pg) {
  if (!pg->lazy) return;
  pg->lazy = false;
  pthread_cond_signal(&pg->cv_queue);
}

/* A waiter whose wait may last as long as the collective's own deadline (timeout_ms < 0 or
 * at least the group's timeout) runs the queue itself, up to and including its work, when
 * no one else is running work: the progress thread would otherwise wake, run it and wake
 * the waiter, two thread hand-offs that dominate a small collective's latency. Issue order,
 * fingerprints, deadlines and abort behave exactly as on the progress thread (the same
 * run_one). A waiter with a shorter timeout only waits, so it can return at its timeout
 * while the collective continues in the background. */
ddp_status_t ddp_work_wait(ddp_work_t *w, int64_t timeout_ms) {
  DDP_REQUIRE(w && w->magic == WORK_MAGIC);
  if (atomic_load(&w->done)) return w->status;
  ddp_pg_t *pg = w->pg;
  bool inline_ok = timeout_ms < 0 || timeout_ms >= pg->timeout_ms;
  pthread_mutex_lock(&pg->mu);
  while (inline_ok && !atomic_load(&w->done) && !pg->running && pg->head) run_head(pg);
  if (!atomic_load(&w->done)) {
    /* Read the clock only now: a small collective run above needs no deadline here. Work
     * run above had its own deadlines, so the wait's counts from here. */
    kick_lazy(pg);
    int64_t deadline = ddp_deadline_after_ms(timeout_ms < 0 ? pg->timeout_ms + 1000 : timeout_ms);
    struct timespec ts = {(time_t)(deadline / 1000000000LL), (long)(deadline % 1000000000LL)};
    while (!atomic_load(&w->done)) {
      if (pthread_cond_timedwait(&pg->cv_done, &pg->mu, &ts) != 0 && ddp_now_ns() >= deadline)
        break;
    }
  }
  pthread_mutex_unlock(&pg->mu);
  return atomic_load(&w->done) ? w->status : DDP_ERR_TIMEOUT;
}

ddp_status_t ddp_work_test(ddp_work_t *w, bool *done) {
  DDP_REQUIRE(w && w->magic == WORK_MAGIC && done);
  *done = atomic_load(&w->done) != 0;
  if (!*done) {
    pthread_mutex_lock(&w->pg->mu);
    kick_lazy(w->pg);
    pthread_mutex_unlock(&w->pg->mu);
  }
  return *done ? w->status : DDP_OK;
}

ddp_status_t ddp_work_status(const ddp_work_t *w) {
  DDP_REQUIRE(w && w->magic == WORK_MAGIC);
  return atomic_load(&((ddp_work_t *)w)->done) ? w->status : DDP_ERR_INVALID_USAGE;
}

const char *ddp_work_error(const ddp_work_t *w) {
  DDP_REQUIRE(w && w->magic == WORK_MAGIC);
  return atomic_load(&((ddp_work_t *)w)->done) && w->err ? w->err->msg : "";
}

void ddp_work_free(ddp_work_t *w) {
  if (!w) return;
  DDP_REQUIRE(w->magic == WORK_MAGIC);
  work_release(w);
}

ddp_status_t ddp_work_wait_free(ddp_work_t *w) {
  ddp_status_t st = ddp_work_wait(w, -1);
  ddp_work_free(w);
  return st;
}
