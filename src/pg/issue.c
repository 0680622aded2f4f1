/* The collectives' entry points (include/ddp/pg.h): every call's arguments are checked in
 * one place (check_args, the NCCL way), the algorithm resolved from the size table, the
 * fingerprint stamped with the group's next sequence number, and the work queued, or, for
 * a blocking call on an idle group, run at once on the caller's thread (run_blocking). The
 * queue itself, the progress thread and work handles are pg.c's. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pg/pg_internal.h"

static bool dtype_ok(ddp_dtype_t dt) {
  return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16 || dt == DDP_I32 ||
         dt == DDP_I64 || dt == DDP_U8;
}

static bool overlap(const void *a, size_t na, const void *b, size_t nb) {
  const char *x = a, *y = b;
  return na && nb && x < y + nb && y < x + na;
}

static ddp_status_t arg_error(ddp_pg_t *pg, const char *what, const char *fmt, ...)
    DDP_PRINTF(3, 4);
static ddp_status_t arg_error(ddp_pg_t *pg, const char *what, const char *fmt, ...) {
  char detail[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&pg->mu);
  ddp_status_t st = ddp__error(&pg->arg_err, pg->rank, DDP_ERR_INVALID_ARGUMENT, "rank %d: %s: %s",
                               pg->rank, what, detail);
  pthread_mutex_unlock(&pg->mu);
  return st;
}

/* Fault injection (fault.h): the sequence number the collective will get, then the hook. */
static ddp_status_t fault_hook(ddp_pg_t *pg, ddp__coll_t *c) {
  pthread_mutex_lock(&pg->mu);
  int64_t seq = c->kind == DDP_COLL_SEND || c->kind == DDP_COLL_RECV ? -1 : (int64_t)pg->seq;
  pthread_mutex_unlock(&pg->mu);
  /* A failure has aborted the group, so ddp_pg_last_error_copy quotes it. */
  return ddp__pg_fault_submit(pg, &pg->fault, seq, c, pg->timeout_ms, NULL);
}

ddp_status_t ddp_pg_inject_fault(ddp_pg_t *pg, const ddp_fault_t *f, const char *where,
                                 ddp_error_t *err) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC && f && where);
  return ddp__pg_fault_fire(pg, &pg->fault, f, where, pg->timeout_ms, err);
}

/* submit, step 1: the arguments every kind shares, then those of each kind; an
 * argument error (arg_error) names the collective. */
static ddp_status_t check_args(ddp_pg_t *pg, const ddp__coll_t *c, const char *what) {
  if (c->kind != DDP_COLL_BARRIER) {
    if (!dtype_ok(c->dt))
      return arg_error(pg, what, "dtype %d is not one of F32 F64 F16 BF16 I32 I64 U8", (int)c->dt);
    if (c->count > (SIZE_MAX / 8) / (size_t)pg->size)
      return arg_error(pg, what, "count %zu is too large", c->count);
  }
  if ((c->kind == DDP_COLL_ALLREDUCE || c->kind == DDP_COLL_REDUCE_SCATTER) &&
      ((unsigned)c->op > DDP_OP_PRODUCT))
    return arg_error(pg, what, "reduction op %d is not a ddp_redop_t", (int)c->op);
  if (c->count > 0 && c->kind != DDP_COLL_BARRIER && (!c->recv && c->kind != DDP_COLL_SEND))
    return arg_error(pg, what, "the output buffer is NULL with count %zu", c->count);
  if (c->count > 0 &&
      (c->kind == DDP_COLL_SEND || c->kind == DDP_COLL_ALLREDUCE || c->kind == DDP_COLL_ALLGATHER ||
       c->kind == DDP_COLL_REDUCE_SCATTER || c->kind == DDP_COLL_ALLTOALL) &&
      !c->send)
    return arg_error(pg, what, "the input buffer is NULL with count %zu", c->count);
  size_t es = ddp_dtype_size(c->dt), W = (size_t)pg->size, n = c->count;
  switch (c->kind) {
    case DDP_COLL_BROADCAST:
      if (c->root < 0 || c->root >= pg->size)
        return arg_error(pg, what, "root %d is not in [0, %d)", c->root, pg->size);
      break;
    case DDP_COLL_SEND:
    case DDP_COLL_RECV:
      if (c->root < 0 || c->root >= pg->size || c->root == pg->rank)
        return arg_error(pg, what, "peer %d is not another rank of [0, %d)", c->root, pg->size);
      break;
    case DDP_COLL_ALLREDUCE:
      if (c->send != c->recv && overlap(c->send, n * es, c->recv, n * es))
        return arg_error(pg, what, "input and output overlap without being the same buffer");
      break;
    case DDP_COLL_ALLGATHER:
      if (c->send != (char *)c->recv + pg->rank * n * es &&
          overlap(c->send, n * es, c->recv, W * n * es))
        return arg_error(pg, what, "input overlaps the output other than at block %d", pg->rank);
      break;
    case DDP_COLL_REDUCE_SCATTER:
      if (c->recv != (const char *)c->send + pg->rank * n * es &&
          overlap(c->send, W * n * es, c->recv, n * es))
        return arg_error(pg, what, "output overlaps the input other than at block %d", pg->rank);
      break;
    case DDP_COLL_ALLTOALL:
      if (overlap(c->send, W * n * es, c->recv, W * n * es))
        return arg_error(pg, what, "input and output overlap");
      break;
    default: break;
  }
  return DDP_OK;
}

/* Step 2: the algorithm an allreduce runs (the size table for AUTO; what the family and
 * the scratch space allow); every other kind runs canonical. */
static ddp_algorithm_t resolve_algo(const ddp_pg_t *pg, const ddp__coll_t *c) {
  if (c->kind != DDP_COLL_ALLREDUCE) return DDP_ALGO_CANONICAL;
  bool link = pg->ops->family == DDP_BACKEND_LINK;
  size_t bytes = c->count * ddp_dtype_size(c->dt), W = (size_t)pg->size;
  ddp_algorithm_t a = pg->algo;
  /* Shared family, from the small bound to the box's size: AUTO stays, and the run decides
   * from the buffers every rank publishes (src/algo/shared.c). */
  if (a == DDP_ALGO_AUTO && !link && bytes > pg->small_max && bytes <= DDP__SHARED_BOX_BYTES)
    return DDP_ALGO_AUTO;
  if (a == DDP_ALGO_AUTO) a = bytes <= pg->small_max ? DDP_ALGO_SMALL : DDP_ALGO_CANONICAL;
  if (a == DDP_ALGO_RING && !link) a = DDP_ALGO_CANONICAL;
  /* small needs the whole vector (link: W of them) in scratch */
  if (a == DDP_ALGO_SMALL && bytes > pg->comm.scratch_bytes / (link ? W : 1))
    a = DDP_ALGO_CANONICAL;
  return a;
}

/* Step 3 (pg->mu held): the fingerprint, with the group's next sequence number (a
 * point-to-point pair's own counter for send and recv). */
static void stamp_fp(ddp_pg_t *pg, ddp__coll_t *c) {
  ddp__fp_t *fp = &c->fp;
  bool reduces = c->kind == DDP_COLL_ALLREDUCE || c->kind == DDP_COLL_REDUCE_SCATTER;
  memset(fp, 0, sizeof *fp);
  fp->kind = (uint8_t)(c->kind == DDP_COLL_RECV ? DDP_COLL_SEND : c->kind);
  fp->count = c->count;
  fp->dtype = (uint8_t)(c->kind == DDP_COLL_BARRIER ? 0 : c->dt);
  fp->op = (uint8_t)(reduces ? c->op : 0);
  fp->algo = (uint8_t)(c->kind == DDP_COLL_ALLREDUCE ? c->algo : 0);
  fp->root = -1;
  if (pg->ops->family == DDP_BACKEND_LINK && reduces) fp->segment = pg->comm.segment_bytes;
  if (c->kind == DDP_COLL_BROADCAST) fp->root = c->root;
  if (c->kind == DDP_COLL_SEND) {
    fp->root = pg->rank;
    fp->seq = pg->p2p_send_seq[c->root]++;
  } else if (c->kind == DDP_COLL_RECV) {
    fp->root = c->root;
    fp->seq = pg->p2p_recv_seq[c->root]++;
  } else {
    fp->seq = pg->seq++;
  }
}

/* Step 4 (pg->mu held): appends w to the queue. Lazy start: small work (work of any size
 * in a group created with defer_start) that finds the group idle is queued without waking
 * the progress thread, because its caller usually waits for it next and then runs it
 * itself (ddp_work_wait); the wake-up would cost a futex call here and a context switch
 * that competes for the CPU the collective needs. If the caller does not wait, the
 * progress thread's next poll slice starts it (progress_main). */
static void enqueue(ddp_pg_t *pg, ddp_work_t *w, int64_t now) {
  bool idle = !pg->head && !pg->running;
  if (pg->tail) {
    pg->tail->next = w;
  } else {
    pg->head = w;
  }
  pg->tail = w;
  pg->last_submit_ns = now;
  if (idle && !pg->deep_sleep && w->coll.count * ddp_dtype_size(w->coll.dt) <= pg->lazy_max) {
    pg->lazy = true;
  } else {
    pg->lazy = false;
    pthread_cond_signal(&pg->cv_queue);
  }
}

/* Runs w, which nobody else can see (a blocking call's own work, on its stack), on the
 * calling thread; called with pg->mu held, pg->running false and the queue empty, returns
 * without the lock and with w's status. The same steps as run_head, less the queue and the
 * hand-off to waiters. */
static ddp_status_t run_blocking(ddp_pg_t *pg, ddp_work_t *w, int64_t stamp) {
  pg->running = true;
  pg->lazy = false;
  ddp__fr_start(pg->fr, w->fr_id, stamp);
  pthread_mutex_unlock(&pg->mu);
  bool ended = ddp__pg_run_one(pg, w, DDP_OK); /* submit saw the group OK */
  pthread_mutex_lock(&pg->mu);
  if (!ended) ddp__fr_end(pg->fr, w->fr_id, w->status);
  pg->running = false;
  if (pg->head) pthread_cond_signal(&pg->cv_queue); /* queued meanwhile by another thread */
  pthread_mutex_unlock(&pg->mu);
  ddp__free(w->err); /* the message is the group's failure (ddp_pg_last_error_copy) */
  return w->status;
}

static void log_queued(const ddp_pg_t *pg, const ddp__coll_t *c) {
  char name[192];
  ddp__fp_str(&c->fp, name, sizeof name);
  ddp__log(pg->rank, DDP_LOG_DETAIL, "queued %s, algorithm %s", name, ddp_algorithm_name(c->algo));
}

/* Every entry point: checks, stamps the fingerprint and queues. With out == NULL the call
 * blocks: on an idle group the work runs on this thread at once, with no handle allocated
 * and no queue (what a blocking caller would otherwise pay for every small collective:
 * about a third of its bookkeeping); behind queued work it is queued and waited for. */
static ddp_status_t submit(ddp_pg_t *pg, ddp__coll_t *c, ddp_work_t **out) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC);
  if (out) *out = NULL;
  const char *what = ddp_coll_kind_name(c->kind);
  ddp_status_t fst = ddp__pg_fault_active(&pg->fault) ? fault_hook(pg, c) : DDP_OK;
  if (fst != DDP_OK) return fst;
  DDP_CHECK(check_args(pg, c, what));
  c->algo = resolve_algo(pg, c);
  /* One recorder stamp (ddp__fr_now: cheaper than a clock read, which costs as much as a
   * fifth of a small collective's bookkeeping): its creation time and, run here, its start.
   * The deadline is the run's (ddp__pg_run_one); queued work also reads the clock for the
   * lazy start. */
  int64_t stamp = ddp__fr_now(pg->fr);
  ddp_work_t own, *w = &own;
  pthread_mutex_lock(&pg->mu);
  if (pg->failed != DDP_OK) {
    ddp_status_t st = pg->failed;
    pthread_mutex_unlock(&pg->mu);
    return st;
  }
  bool run_here = !out && !pg->head && !pg->running;
  if (!run_here && !(w = ddp__malloc(sizeof *w))) {
    pthread_mutex_unlock(&pg->mu);
    return arg_error(pg, what, "out of memory for the work handle");
  }
  memset(w, 0, sizeof *w);
  w->magic = WORK_MAGIC;
  w->pg = pg;
  atomic_init(&w->refs, 2);
  atomic_init(&w->done, 0);
  stamp_fp(pg, c);
  w->fr_id = ddp__fr_record(pg->fr, c, stamp);
  w->coll = *c;
  if (run_here) {
    if (pg->log_detail) log_queued(pg, c);
    return run_blocking(pg, w, stamp);
  }
  enqueue(pg, w, ddp_now_ns());
  pthread_mutex_unlock(&pg->mu);
  if (pg->log_detail) log_queued(pg, c);
  if (!out) return ddp_work_wait_free(w);
  *out = w;
  return DDP_OK;
}

/* The entry points below differ only in the operation they describe. Kinds without a
 * reduction pass DDP_OP_SUM: the field is in the fingerprint, so it must not vary. */
static ddp_status_t submit_op(ddp_pg_t *pg, ddp_coll_kind_t kind, const void *send, void *recv,
                              size_t count, ddp_dtype_t dt, ddp_redop_t op, int root,
                              ddp_work_t **work) {
  ddp__coll_t c =
      {.kind = kind, .send = send, .recv = recv, .count = count, .dt = dt, .op = op, .root = root};
  return submit(pg, &c, work);
}

ddp_status_t ddp_allreduce(ddp_pg_t *pg, const void *send, void *recv, size_t count, ddp_dtype_t dt,
                           ddp_redop_t op, ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_ALLREDUCE, send, recv, count, dt, op, -1, work);
}

ddp_status_t ddp_broadcast(ddp_pg_t *pg, void *buf, size_t count, ddp_dtype_t dt, int root,
                           ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_BROADCAST, buf, buf, count, dt, DDP_OP_SUM, root, work);
}

ddp_status_t ddp_allgather(ddp_pg_t *pg, const void *send, void *recv, size_t count, ddp_dtype_t dt,
                           ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_ALLGATHER, send, recv, count, dt, DDP_OP_SUM, -1, work);
}

ddp_status_t ddp_reduce_scatter(ddp_pg_t *pg, const void *send, void *recv, size_t count,
                                ddp_dtype_t dt, ddp_redop_t op, ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_REDUCE_SCATTER, send, recv, count, dt, op, -1, work);
}

ddp_status_t ddp_alltoall(ddp_pg_t *pg, const void *send, void *recv, size_t count, ddp_dtype_t dt,
                          ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_ALLTOALL, send, recv, count, dt, DDP_OP_SUM, -1, work);
}

ddp_status_t ddp_barrier(ddp_pg_t *pg, ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_BARRIER, NULL, NULL, 0, DDP_U8, DDP_OP_SUM, -1, work);
}

ddp_status_t ddp_send(ddp_pg_t *pg, const void *buf, size_t count, ddp_dtype_t dt, int peer,
                      ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_SEND, buf, NULL, count, dt, DDP_OP_SUM, peer, work);
}

ddp_status_t ddp_recv(ddp_pg_t *pg, void *buf, size_t count, ddp_dtype_t dt, int peer,
                      ddp_work_t **work) {
  return submit_op(pg, DDP_COLL_RECV, NULL, buf, count, dt, DDP_OP_SUM, peer, work);
}
