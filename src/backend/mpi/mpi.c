/* The mpi backend: ranks are the processes of an MPI job (mpirun, srun), and bytes move
 * over MPI point-to-point messages, so whatever fabric the MPI library drives (shared
 * memory, TCP, InfiniBand through UCX) carries the group's traffic.
 *
 * Family. mpi is a link backend: xfer() posts one MPI_Isend/MPI_Irecv per transfer of the
 * batch and polls them with MPI_Testsome. The collectives are therefore the link algorithms
 * of src/algo/link.c: canonical = an all-to-all of slices (each rank sends every peer the
 * part of its input that peer owns), a fold of the W contributions of the owned slice in
 * rank order, then an all-gather of the slices; small = every rank folds everything. The
 * bytes and the fold are those of the tcp backend, so canonical results are bitwise equal to
 * threads, shm and tcp (D2), for every dtype including fp16/bf16 (sent as bytes, folded by
 * our kernels, never by MPI's reduction operators). The fast mode, allreduce with algorithm
 * ring, is MPI's own MPI_Iallreduce through the table's `run` member (mpi_run) for the
 * dtypes MPI has a type for; fp16/bf16 take link.c's gloo-style ring.
 *
 * Initialisation. MPI is process-wide. If the application has not initialised MPI, create
 * calls MPI_Init_thread asking for MPI_THREAD_MULTIPLE (the group's progress thread makes
 * the MPI calls, and several groups may exist at once) and registers an atexit handler that
 * finalises MPI once the process ends; MPI cannot be initialised twice, so destroying a
 * group never finalises it. If the application initialised MPI itself, it keeps ownership,
 * and the thread level it chose must be at least MPI_THREAD_SERIALIZED (then at most one
 * mpi group may be active at a time: this library does not serialise across groups). Each
 * group runs on its own communicator, MPI_Comm_split(MPI_COMM_WORLD) keyed by the group
 * rank, with MPI_ERRORS_RETURN so failures come back as statuses with MPI_Error_string.
 * The group's world must equal MPI_COMM_WORLD's size.
 *
 * Deadlines. MPI operations cannot be bounded by a timeout, only polled. xfer polls its
 * requests until the deadline or an abort; it then cancels every pending request and waits
 * up to a second for the cancellations. Receives cancel; a send that the MPI library has
 * already handed to the peer's rendezvous protocol may not. Returning while MPI may still
 * read or write the caller's buffer would corrupt memory the caller is about to free, so in
 * that case the backend calls MPI_Abort on the job, with a message that says why. Group
 * creation on MPI_COMM_WORLD (MPI_Comm_split) cannot be bounded either: when a store is
 * given, create first waits for every rank in the store (bounded, naming missing ranks),
 * so the blocking split only starts once all ranks are there.
 *
 * Failure. A failed group keeps its communicator until the process ends (see mpi_destroy:
 * freeing it would let its stray messages reach the next group). MPI has no way to tell
 * peers that a rank gave up short of MPI_Abort, so fail() does nothing: peers of a failed
 * rank end at their own deadline (TIMEOUT) unless the launcher kills the job first (mpirun
 * does when a rank exits with an error). */
#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backends.h"
#include "common/common.h"

/* Largest single MPI message: counts are int. Larger transfers go as several messages of
 * the same tag, which MPI delivers in order between a pair. */
#define CHUNK_MAX (1u << 30)
#define TAG 0x64d

typedef struct mpi_state {
  int rank;
  int size;
  MPI_Comm comm;
  MPI_Request *reqs; /* grown to the largest batch */
  int *idx;          /* MPI_Testsome's output, same capacity */
  size_t nreqs_cap;
  atomic_bool aborted;
  bool broken; /* an operation failed: messages of this group may still be in flight */
} mpi_state_t;

static void finalize_at_exit(void) {
  int fin = 0, init = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Finalize();
}

static void mpi_text(int rc, char msg[MPI_MAX_ERROR_STRING + 1]) {
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  msg[len] = '\0';
}

/* An MPI call of create failed: logged here, where it starts. */
static ddp_status_t mpi_create_err(ddp_error_t *err, int rank, ddp_status_t st, int rc,
                                   const char *what) {
  char msg[MPI_MAX_ERROR_STRING + 1];
  mpi_text(rc, msg);
  return ddp__error(err, rank, st, "rank %d: %s failed: MPI error %d: %s", rank, what, rc, msg);
}

/* An MPI call of a collective failed (peer < 0: not a point-to-point call): filled only,
 * since the group logs the failed collective once, with its name and this rank. */
static ddp_status_t mpi_run_err(ddp_error_t *err, ddp_status_t st, int rc, const char *what,
                                int peer) {
  char msg[MPI_MAX_ERROR_STRING + 1];
  mpi_text(rc, msg);
  if (peer >= 0)
    return ddp__error_quiet(err, st, "%s with rank %d failed: MPI error %d: %s", what, peer, rc,
                            msg);
  return ddp__error_quiet(err, st, "%s failed: MPI error %d: %s", what, rc, msg);
}

/* Initialises MPI unless the application has; checks the thread level either way. */
static ddp_status_t ensure_init(int rank, ddp_error_t *err) {
  int init = 0, fin = 0, level = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin)
    return ddp__error(err, rank, DDP_ERR_INVALID_USAGE,
                      "rank %d: backend mpi: MPI has already been finalised in this process "
                      "(MPI cannot be initialised again)",
                      rank);
  if (!init) {
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level);
    if (rc != MPI_SUCCESS) return mpi_create_err(err, rank, DDP_ERR_SYSTEM, rc, "MPI_Init_thread");
    atexit(finalize_at_exit);
    ddp__log(rank, DDP_LOG_INFO, "backend mpi: initialised MPI, thread level %d (multiple = %d)",
             level, MPI_THREAD_MULTIPLE);
  } else {
    MPI_Query_thread(&level);
  }
  if (level < MPI_THREAD_SERIALIZED)
    return ddp__error(err, rank, DDP_ERR_UNSUPPORTED,
                      "rank %d: backend mpi: MPI provides thread level %d, but the group's "
                      "progress thread needs MPI_THREAD_SERIALIZED (%d) or better; initialise "
                      "MPI with MPI_Init_thread",
                      rank, level, MPI_THREAD_SERIALIZED);
  return DDP_OK;
}

static void mpi_destroy(void *state) {
  mpi_state_t *s = state;
  if (!s) return;
  /* A failed group's communicator is kept, not freed: MPI reuses the context id of a freed
   * communicator, and a message a peer sent on this group before it failed (a fingerprint,
   * a segment) would then match a receive of the next group. Kept, it stays addressed to a
   * communicator no one listens to. The cost is one communicator per failed group. */
  if (s->comm != MPI_COMM_NULL && !s->broken) MPI_Comm_free(&s->comm);
  ddp__free(s->reqs);
  ddp__free(s->idx);
  ddp__free(s);
}

static ddp_status_t mpi_create(const ddp_backend_init_t *in, void **out, ddp_error_t *err) {
  int rank = in->rank, W = in->size, n = 0, me = -1;
  *out = NULL;
  DDP_CHECK(ensure_init(rank, err));
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != W)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: backend mpi: the group has %d ranks but MPI_COMM_WORLD has %d "
                      "processes (start one process per rank with mpirun -np %d or srun -n %d)",
                      rank, W, n, W, W);
  /* Bounded rendezvous first, so the unbounded MPI_Comm_split below starts only once every
   * rank is known to be there. */
  if (in->store) DDP_CHECK(ddp__backend_join(in->store, "mpi", rank, W, in->timeout_ms, NULL, err));
  mpi_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "backend mpi state");
  s->rank = rank;
  s->size = W;
  s->comm = MPI_COMM_NULL;
  atomic_init(&s->aborted, false);
  ddp_status_t st = DDP_OK;
  int rc = MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &s->comm);
  if (rc != MPI_SUCCESS) {
    st = mpi_create_err(err, rank, DDP_ERR_SYSTEM, rc, "MPI_Comm_split of MPI_COMM_WORLD");
    goto fail;
  }
  MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(s->comm, &me);
  if (me != rank) {
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                    "rank %d: backend mpi: MPI process %d was given group rank %d, but another "
                    "process claims the same rank (each rank must appear once)",
                    rank, wr, rank);
    goto fail;
  }
  *out = s;
  return DDP_OK;
fail:
  mpi_destroy(s);
  return st;
}

/* Between two tests of a slow wait: yield until yield_until, then sleep 50 us. */
static void pause_poll(int64_t yield_until) {
  if (ddp_now_ns() < yield_until) {
    sched_yield();
  } else {
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

/* Cancels whatever is still pending and waits briefly for the cancellations to complete.
 * False if some request is still owned by MPI afterwards. */
static bool cancel_all(mpi_state_t *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s->reqs[i] != MPI_REQUEST_NULL) MPI_Cancel(&s->reqs[i]);
  int64_t until = ddp_now_ns() + 1000000000LL;
  for (;;) {
    int flag = 0;
    MPI_Testall((int)n, s->reqs, &flag, MPI_STATUSES_IGNORE);
    if (flag) return true;
    if (ddp_now_ns() >= until) return false;
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
}

/* Names the peers whose transfers are still pending ("" if none). */
static void pending_peers(mpi_state_t *s, const ddp_xfer_t *ops, size_t nops, const int *first,
                          char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (size_t k = 0; k < nops && o < len; k++) {
    size_t end = k + 1 < nops ? (size_t)first[k + 1] : (size_t)first[nops];
    bool open = false;
    for (size_t i = (size_t)first[k]; i < end; i++) open |= s->reqs[i] != MPI_REQUEST_NULL;
    if (open)
      o += (size_t)snprintf(buf + o, len - o, "%s%s rank %d (%zu bytes)", o ? ", " : "",
                            ops[k].is_send ? "send to" : "receive from", ops[k].peer, ops[k].bytes);
  }
}

static ddp_status_t mpi_xfer(void *state, ddp_xfer_t *ops, size_t nops, ddp_xfer_idle_t *idle,
                             int64_t deadline_ns, ddp_error_t *err) {
  mpi_state_t *s = state;
  if (atomic_load(&s->aborted))
    return ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d", s->rank);
  size_t need = 0;
  for (size_t k = 0; k < nops; k++)
    need += ops[k].bytes ? (ops[k].bytes + CHUNK_MAX - 1) / CHUNK_MAX : 1;
  if (need > s->nreqs_cap) {
    ddp__free(s->reqs);
    ddp__free(s->idx);
    s->reqs = ddp__malloc(need * sizeof *s->reqs);
    s->idx = ddp__malloc(need * sizeof *s->idx);
    s->nreqs_cap = s->reqs && s->idx ? need : 0;
    if (!s->nreqs_cap)
      return ddp__error_quiet(err, DDP_ERR_NO_MEMORY, "out of memory for %zu MPI requests", need);
  }
  /* first[k]: index of transfer k's first request; first[nops] = total. */
  int first_stack[2 * DDP_PG_MAX_WORLD + 1];
  int *first = nops < DDP_ARRAY_LEN(first_stack) ? first_stack
                                                 : ddp__malloc((nops + 1) * sizeof(int));
  if (!first) return ddp__error_quiet(err, DDP_ERR_NO_MEMORY, "out of memory for the xfer index");
  size_t nr = 0;
  ddp_status_t st = DDP_OK;
  for (size_t k = 0; k < nops; k++) {
    first[k] = (int)nr;
    unsigned char *p = ops[k].buf;
    size_t left = ops[k].bytes;
    do {
      int cnt = (int)DDP_MIN(left, (size_t)CHUNK_MAX);
      int rc = ops[k].is_send
                   ? MPI_Isend(p, cnt, MPI_BYTE, ops[k].peer, TAG, s->comm, &s->reqs[nr])
                   : MPI_Irecv(p, cnt, MPI_BYTE, ops[k].peer, TAG, s->comm, &s->reqs[nr]);
      if (rc != MPI_SUCCESS) {
        st = mpi_run_err(err, DDP_ERR_REMOTE, rc, ops[k].is_send ? "MPI_Isend" : "MPI_Irecv",
                         ops[k].peer);
        break;
      }
      nr++;
      p += cnt;
      left -= (size_t)cnt;
    } while (left > 0);
    if (st != DDP_OK) break;
  }
  first[nops] = (int)nr;
  /* Poll: spin briefly (latency), then yield the CPU between tests for up to 2 ms (MPI's
   * shared-memory rendezvous needs both sides to keep testing, and a yield lets an
   * oversubscribed peer run), then sleep 50 us between tests. MPI_Testsome nulls completed
   * requests, so on a timeout the message names exactly the transfers still pending. */
  int64_t yield_until = ddp_now_ns() + 2000000;
  for (int polls = 0; st == DDP_OK; polls++) {
    int outcount = 0;
    int rc = MPI_Testsome((int)nr, s->reqs, &outcount, s->idx, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
      st = mpi_run_err(err, DDP_ERR_REMOTE, rc, "MPI_Testsome", -1);
      break;
    }
    if (outcount == MPI_UNDEFINED) break; /* every request completed */
    if (outcount > 0) polls = 0;
    if (idle && !idle->ran) { /* the caller's fold, while MPI moves this batch */
      idle->ran = true;
      idle->fn(idle->arg);
      continue;
    }
    if (atomic_load(&s->aborted)) {
      st = ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d", s->rank);
    } else if (ddp_now_ns() >= deadline_ns) {
      char pend[256];
      pending_peers(s, ops, nops, first, pend, sizeof pend);
      st = ddp__error_quiet(err, DDP_ERR_TIMEOUT, "timed out; still pending: %s", pend);
    } else if (polls > 200) {
      pause_poll(yield_until);
    }
  }
  if (st != DDP_OK && nr > 0 && !cancel_all(s, nr)) {
    ddp__log(s->rank, DDP_LOG_ERROR,
             "rank %d: backend mpi: %s; MPI could not cancel a pending transfer and would keep "
             "using the caller's buffer, so the job is aborted (MPI_Abort)",
             s->rank, err ? err->msg : ddp_status_name(st));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (st != DDP_OK) s->broken = true;
  for (size_t k = 0; k < nops; k++) ops[k].done = st == DDP_OK ? ops[k].bytes : 0;
  if (first != first_stack) ddp__free(first);
  return st;
}

/* Polls one non-blocking collective to completion, the deadline or an abort. A started
 * MPI collective cannot be cancelled, and returning would leave MPI writing into the
 * caller's buffer, so a deadline or abort here ends the job with MPI_Abort. */
static ddp_status_t wait_coll(mpi_state_t *s, MPI_Request *req, const char *what,
                              int64_t deadline_ns, ddp_error_t *err) {
  int64_t yield_until = ddp_now_ns() + 2000000;
  for (int polls = 0;; polls++) {
    int flag = 0;
    int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_run_err(err, DDP_ERR_REMOTE, rc, what, -1);
    if (flag) return DDP_OK;
    bool ab = atomic_load(&s->aborted);
    if (ab || ddp_now_ns() >= deadline_ns) {
      ddp__log(s->rank, DDP_LOG_ERROR,
               "rank %d: backend mpi: %s %s; a running MPI collective cannot be cancelled, so "
               "the job is aborted (MPI_Abort)",
               s->rank, what, ab ? "was aborted" : "timed out");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (polls > 200) pause_poll(yield_until);
  }
}

static MPI_Datatype mpi_type(ddp_dtype_t dt) {
  switch (dt) {
    case DDP_F32: return MPI_FLOAT;
    case DDP_F64: return MPI_DOUBLE;
    case DDP_I32: return MPI_INT32_T;
    case DDP_I64: return MPI_INT64_T;
    case DDP_U8: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL; /* fp16/bf16: MPI has no standard type */
  }
}

/* The fast mode (algorithm = ring): allreduce by MPI_Iallreduce, whose reduction order is
 * the MPI library's (D1 at best, not D2). fp16/bf16 have no MPI type and take the link
 * ring instead. Ranks first compare (kind, count, dtype, op) with an MPI_Iallgather, so a
 * mismatched collective is DESYNC on every rank rather than undefined behaviour. */
static ddp_status_t run_native(mpi_state_t *s, const ddp_backend_coll_t *c, int64_t deadline_ns,
                               ddp_error_t *err) {
  if (c->kind != DDP_COLL_ALLREDUCE || c->algo != DDP_ALGO_RING) return DDP_ERR_UNSUPPORTED;
  MPI_Datatype t = mpi_type(c->dt);
  if (t == MPI_DATATYPE_NULL) return DDP_ERR_UNSUPPORTED;
  if (atomic_load(&s->aborted))
    return ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d", s->rank);
  int64_t mine[4] = {c->kind, (int64_t)c->count, c->dt, c->op};
  int64_t all[4 * DDP_PG_MAX_WORLD];
  MPI_Request req;
  int rc = MPI_Iallgather(mine, 4, MPI_INT64_T, all, 4, MPI_INT64_T, s->comm, &req);
  if (rc != MPI_SUCCESS) return mpi_run_err(err, DDP_ERR_REMOTE, rc, "MPI_Iallgather", -1);
  DDP_CHECK(wait_coll(s, &req, "MPI_Iallgather of the fingerprints", deadline_ns, err));
  for (int j = 0; j < s->size; j++)
    if (memcmp(&all[4 * j], mine, sizeof mine) != 0)
      return ddp__error_quiet(err, DDP_ERR_DESYNC,
                              "mismatched collectives: rank %d runs allreduce (%s, %s, count "
                              "%llu, native), rank %d runs kind %lld op %lld dtype %lld count %lld",
                              s->rank, ddp_redop_name(c->op), ddp_dtype_name(c->dt),
                              (unsigned long long)c->count, j, (long long)all[4 * j],
                              (long long)all[4 * j + 3], (long long)all[4 * j + 2],
                              (long long)all[4 * j + 1]);
  MPI_Op op = c->op == DDP_OP_MIN       ? MPI_MIN
              : c->op == DDP_OP_MAX     ? MPI_MAX
              : c->op == DDP_OP_PRODUCT ? MPI_PROD
                                        : MPI_SUM;
  size_t es = ddp_dtype_size(c->dt);
  for (size_t off = 0; off < c->count; off += CHUNK_MAX) {
    int n = (int)DDP_MIN((size_t)CHUNK_MAX, c->count - off);
    void *out = (unsigned char *)c->recv + off * es;
    const void *in = c->send == c->recv ? MPI_IN_PLACE : (const unsigned char *)c->send + off * es;
    rc = MPI_Iallreduce(in, out, n, t, op, s->comm, &req);
    if (rc != MPI_SUCCESS) return mpi_run_err(err, DDP_ERR_REMOTE, rc, "MPI_Iallreduce", -1);
    DDP_CHECK(wait_coll(s, &req, "MPI_Iallreduce", deadline_ns, err));
  }
  if (c->op == DDP_OP_AVG) ddp_reduce_avg(c->dt, c->recv, c->count, s->size);
  return DDP_OK;
}

static ddp_status_t mpi_run(void *state, const ddp_backend_coll_t *c, int64_t deadline_ns,
                            ddp_error_t *err) {
  mpi_state_t *s = state;
  ddp_status_t st = run_native(s, c, deadline_ns, err);
  if (st != DDP_OK && st != DDP_ERR_UNSUPPORTED) s->broken = true;
  return st;
}

static void mpi_abort(void *state) {
  mpi_state_t *s = state;
  atomic_store(&s->aborted, true);
}

/* MPI offers no way to tell a peer "I failed" other than MPI_Abort on the whole job. */
static void mpi_fail(void *state) { (void)state; }

const ddp_backend_ops_t ddp__backend_mpi = {
    .abi_version = DDP_BACKEND_ABI_VERSION,
    .name = "mpi",
    .family = DDP_BACKEND_LINK,
    .create = mpi_create,
    .destroy = mpi_destroy,
    .abort = mpi_abort,
    .mem_alloc = NULL,
    .mem_free = NULL,
    .shared = NULL,
    .xfer = mpi_xfer,
    .fail = mpi_fail,
    .run = mpi_run,
};
