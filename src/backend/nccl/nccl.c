/* The nccl backend: collectives on NVIDIA GPUs through NCCL, on device buffers and on host
 * buffers staged through the device.
 *
 * Setup. Each rank picks device LOCAL_RANK (else OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
 * the group rank) modulo the visible device count. The ranks meet in the store first
 * (bounded, naming missing ranks); rank 0 then creates the NCCL unique id and publishes it
 * under "nccl/uid", and every rank creates a non-blocking communicator with it, polling
 * ncclCommGetAsyncError until it is ready or the deadline passes.
 *
 * Collectives run whole, through the backend table's `run` member, on one stream per group:
 *  - Every collective first all-gathers (kind, count, dtype, op) with ncclAllGather, so a
 *    mismatched collective is DESYNC on every rank instead of a hang.
 *  - canonical / small allreduce and reduce_scatter keep D2: rank r receives slice r of
 *    every rank's input with grouped ncclSend/ncclRecv (ncclGroupStart/End), folds the W
 *    contributions in rank order with the ordered reduction kernel (fold.cu, the device twin
 *    of ddp_reduce_fold with the same arithmetic; builds without nvcc copy the slice to the
 *    host and fold it with ddp_reduce_fold itself), and allreduce then all-gathers
 *    the slices with grouped send/recv. Results are bitwise equal to threads, shm, tcp, mpi.
 *  - ring allreduce is NCCL's own ncclAllReduce (NCCL's ring or tree, its rounding; D1 at
 *    best): the fast mode. reduce_scatter is always canonical (src/pg resolves algorithms
 *    for allreduce only), and so is an integer AVG (ncclAvg is for floating point).
 *  - broadcast, allgather, alltoall (grouped send/recv), send/recv move bytes (ncclUint8);
 *    barrier is a one-element ncclAllReduce.
 * A buffer that cudaPointerGetAttributes does not report as device or managed memory is
 * host memory: it is copied into a device staging buffer before and out after.
 *
 * Waiting. Work is enqueued on the stream and the progress thread polls cudaStreamQuery and
 * ncclCommGetAsyncError, sleeping 50 us between polls, until done, the deadline, or an
 * abort; then the communicator is aborted (ncclCommAbort), which releases the device, and
 * the group fails with TIMEOUT or ABORTED. CUDA and NCCL errors become statuses with
 * cudaGetErrorString and ncclGetErrorString plus ncclGetLastError. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend/backends.h"
#include "backend/nccl/nccl.h"

#define FP_INTS 4

typedef struct nccl_state {
  int rank;
  int size;
  int device;
  ncclComm_t comm;
  cudaStream_t stream;
  bool stream_ok;
  void *dstage[2]; /* device staging for host inputs / outputs */
  size_t dstage_bytes[2];
  void *dscr; /* device scratch: W slices, or the fingerprints */
  size_t dscr_bytes;
  unsigned char *hscr; /* host copy of the W slices for the fold */
  size_t hscr_bytes;
  unsigned char *tmp; /* DDP_REDUCE_TMP_BYTES for ddp_reduce_fold */
  atomic_bool aborted;
  bool comm_dead; /* aborted by us: no further NCCL call on comm */
} nccl_state_t;

/* ---------------------------------------------------------------- errors ---------- */

ddp_status_t ddp__cuda_status(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return DDP_OK;
    case cudaErrorMemoryAllocation: return DDP_ERR_NO_MEMORY;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorCallRequiresNewerDriver: return DDP_ERR_UNSUPPORTED;
    default: return DDP_ERR_SYSTEM;
  }
}

ddp_status_t ddp__nccl_status(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return DDP_OK;
    case ncclSystemError:
    case ncclRemoteError: return DDP_ERR_REMOTE;
    case ncclInvalidArgument: return DDP_ERR_INVALID_ARGUMENT;
    case ncclInvalidUsage: return DDP_ERR_INVALID_USAGE;
    case ncclUnhandledCudaError: return DDP_ERR_SYSTEM;
    default: return DDP_ERR_INTERNAL;
  }
}

ddp_status_t ddp__cuda_error(ddp_error_t *err, cudaError_t e, const char *what) {
  return ddp__error_quiet(err, ddp__cuda_status(e), "%s: CUDA error %d (%s): %s", what, (int)e,
                          cudaGetErrorName(e), cudaGetErrorString(e));
}

ddp_status_t ddp__nccl_error(ddp_error_t *err, ncclResult_t r, ncclComm_t comm, const char *what) {
  const char *last = ncclGetLastError(comm);
  return ddp__error_quiet(err, ddp__nccl_status(r), "%s: NCCL error %d: %s%s%s%s", what, (int)r,
                          ncclGetErrorString(r), last && last[0] ? " (" : "", last ? last : "",
                          last && last[0] ? ")" : "");
}

#define CUDA_TRY(s, call, what)                                     \
  do {                                                              \
    cudaError_t e_ = (call);                                        \
    if (e_ != cudaSuccess) return ddp__cuda_error(err, e_, (what)); \
  } while (0)

/* An NCCL call on a non-blocking communicator may answer ncclInProgress: its outcome then
 * arrives through ncclCommGetAsyncError. */
static ddp_status_t nccl_settle(nccl_state_t *s, ncclResult_t r, const char *what,
                                int64_t deadline_ns, ddp_error_t *err) {
  while (r == ncclInProgress) {
    if (atomic_load(&s->aborted) || ddp_now_ns() >= deadline_ns) break;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
    if (ncclCommGetAsyncError(s->comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) return DDP_OK;
  if (r == ncclInProgress) {
    bool ab = atomic_load(&s->aborted);
    ncclCommAbort(s->comm);
    s->comm_dead = true;
    return ddp__error_quiet(err, ab ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT, "%s %s", what,
                            ab ? "was aborted" : "timed out (NCCL communicator aborted)");
  }
  return ddp__nccl_error(err, r, s->comm, what);
}

#define NCCL_TRY(s, call, what, dl)                                 \
  do {                                                              \
    ddp_status_t st_ = nccl_settle((s), (call), (what), (dl), err); \
    if (st_ != DDP_OK) return st_;                                  \
  } while (0)

/* Polls the stream until the enqueued work is done, a CUDA or NCCL error, the deadline, or
 * an abort (the last two abort the communicator). */
static ddp_status_t wait_stream(nccl_state_t *s, const char *what, int64_t deadline_ns,
                                ddp_error_t *err) {
  for (int polls = 0;; polls++) {
    cudaError_t e = cudaStreamQuery(s->stream);
    if (e == cudaSuccess) return DDP_OK;
    if (e != cudaErrorNotReady) return ddp__cuda_error(err, e, what);
    ncclResult_t ae = ncclSuccess;
    if (ncclCommGetAsyncError(s->comm, &ae) == ncclSuccess && ae != ncclSuccess &&
        ae != ncclInProgress) {
      ddp_status_t st = ddp__nccl_error(err, ae, s->comm, what);
      ncclCommAbort(s->comm);
      s->comm_dead = true;
      return st;
    }
    bool ab = atomic_load(&s->aborted);
    if (ab || ddp_now_ns() >= deadline_ns) {
      ncclCommAbort(s->comm);
      s->comm_dead = true;
      return ddp__error_quiet(err, ab ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT, "%s %s", what,
                              ab ? "was aborted" : "timed out (NCCL communicator aborted)");
    }
    if (polls > 100) {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, NULL);
    }
  }
}

/* ---------------------------------------------------------------- memory ---------- */

static ddp_status_t dgrow(nccl_state_t *s, void **p, size_t *cap, size_t bytes, ddp_error_t *err) {
  if (bytes <= *cap) return DDP_OK;
  if (*p) cudaFree(*p);
  *p = NULL;
  *cap = 0;
  CUDA_TRY(s, cudaMalloc(p, bytes), "cudaMalloc of a staging buffer");
  *cap = bytes;
  return DDP_OK;
}

static ddp_status_t hgrow(nccl_state_t *s, size_t bytes, ddp_error_t *err) {
  if (bytes <= s->hscr_bytes) return DDP_OK;
  ddp__free(s->hscr);
  s->hscr = ddp__malloc(bytes);
  s->hscr_bytes = s->hscr ? bytes : 0;
  if (!s->hscr)
    return ddp__error_quiet(err, DDP_ERR_NO_MEMORY, "out of memory for %zu bytes of host scratch",
                            bytes);
  return DDP_OK;
}

static bool is_device(const void *p) {
  struct cudaPointerAttributes a;
  if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError(); /* clear the sticky-free error of an unknown pointer */
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* ---------------------------------------------------------------- create ---------- */

static void nccl_destroy(void *state) {
  nccl_state_t *s = state;
  if (!s) return;
  if (s->comm) {
    if (!s->comm_dead) ncclCommFinalize(s->comm);
    ncclCommDestroy(s->comm);
  }
  for (int i = 0; i < 2; i++)
    if (s->dstage[i]) cudaFree(s->dstage[i]);
  if (s->dscr) cudaFree(s->dscr);
  if (s->stream_ok) cudaStreamDestroy(s->stream);
  ddp__free(s->hscr);
  ddp__free(s->tmp);
  ddp__free(s);
}

/* A CUDA or NCCL failure of create, filled quietly into e by the helpers above: logged here,
 * once, with this rank. (In a collective the group logs the failure instead.) */
static ddp_status_t create_failed(ddp_error_t *err, int rank, const ddp_error_t *e) {
  return ddp__error(err, rank, e->status, "rank %d: %s", rank, e->msg);
}

static int local_rank(int rank) {
  static const ddp_env_id_t ids[] = {DDP_ENV_LOCAL_RANK, DDP_ENV_OMPI_LOCAL_RANK,
                                     DDP_ENV_SLURM_LOCALID};
  for (size_t i = 0; i < DDP_ARRAY_LEN(ids); i++) {
    int64_t v;
    if (ddp_env_is_set(ids[i]) && ddp_env_int(ids[i], 0, 1 << 20, &v, NULL) == DDP_OK)
      return (int)v;
  }
  return rank;
}

static ddp_status_t exchange_uid(const ddp_backend_init_t *in, ncclUniqueId *uid,
                                 ddp_error_t *err) {
  int rank = in->rank;
  const char *key = "nccl/uid";
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(uid);
    if (r != ncclSuccess) {
      ddp_error_t e;
      ddp__nccl_error(&e, r, NULL, "ncclGetUniqueId");
      return create_failed(err, rank, &e);
    }
    if (ddp_store_set(in->store, key, uid, sizeof *uid) != DDP_OK)
      return ddp__backend_store_failed(in->store, DDP_ERR_REMOTE, err, "rank 0: store set %s", key);
    return DDP_OK;
  }
  const char *keys[1] = {key};
  ddp_status_t st = ddp_store_wait(in->store, keys, 1, in->timeout_ms);
  if (st != DDP_OK)
    return ddp__backend_store_failed(in->store, st, err,
                                     "rank %d: waiting for rank 0's NCCL unique id (%s)", rank,
                                     key);
  void *v = NULL;
  size_t n = 0;
  st = ddp_store_get(in->store, key, &v, &n);
  if (st == DDP_OK && n == sizeof *uid) memcpy(uid, v, sizeof *uid);
  ddp_free(v);
  if (st != DDP_OK)
    return ddp__backend_store_failed(in->store, st, err, "rank %d: reading the NCCL unique id",
                                     rank);
  if (n != sizeof *uid)
    return ddp__error(err, rank, DDP_ERR_INVALID_DATA,
                      "rank %d: the NCCL unique id in the store is %zu bytes, expected %zu", rank,
                      n, sizeof *uid);
  return DDP_OK;
}

static ddp_status_t nccl_create(const ddp_backend_init_t *in, void **out, ddp_error_t *err) {
  int rank = in->rank, W = in->size, ndev = 0;
  *out = NULL;
  int64_t deadline = ddp_deadline_after_ms(in->timeout_ms);
  ddp_error_t ce; /* CUDA and NCCL failures, filled quietly, then logged by create_failed */
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess) {
    ddp__cuda_error(&ce, e, "backend nccl: cudaGetDeviceCount (no usable GPU)");
    return create_failed(err, rank, &ce);
  }
  if (ndev == 0)
    return ddp__error(err, rank, DDP_ERR_UNSUPPORTED, "rank %d: backend nccl: no CUDA device",
                      rank);
  if (!in->store)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: backend nccl needs a store to exchange the NCCL unique id", rank);
  nccl_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "backend nccl state");
  s->rank = rank;
  s->size = W;
  s->device = local_rank(rank) % ndev;
  atomic_init(&s->aborted, false);
  ddp_status_t st = DDP_OK;
  char what[96];
  s->tmp = ddp__malloc(DDP_REDUCE_TMP_BYTES);
  if (!s->tmp) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "backend nccl scratch");
    goto fail;
  }
  snprintf(what, sizeof what, "cudaSetDevice(%d)", s->device);
  if ((e = cudaSetDevice(s->device)) != cudaSuccess) {
    ddp__cuda_error(&ce, e, what);
    st = create_failed(err, rank, &ce);
    goto fail;
  }
  if ((e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)) != cudaSuccess) {
    ddp__cuda_error(&ce, e, "cudaStreamCreateWithFlags");
    st = create_failed(err, rank, &ce);
    goto fail;
  }
  s->stream_ok = true;
  st = ddp__backend_join(in->store, "nccl", rank, W, in->timeout_ms, NULL, err);
  if (st != DDP_OK) goto fail;
  ncclUniqueId uid;
  st = exchange_uid(in, &uid, err);
  if (st != DDP_OK) goto fail;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&s->comm, W, uid, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    ddp__nccl_error(&ce, r, s->comm, "ncclCommInitRankConfig");
    st = create_failed(err, rank, &ce);
    goto fail;
  }
  if (nccl_settle(s, r, "ncclCommInitRankConfig", deadline, &ce) != DDP_OK) {
    st = create_failed(err, rank, &ce);
    goto fail;
  }
  ddp__log(rank, DDP_LOG_INFO, "backend nccl: rank %d on CUDA device %d of %d, NCCL %d.%d", rank,
           s->device, ndev, NCCL_MAJOR, NCCL_MINOR);
  *out = s;
  return DDP_OK;
fail:
  nccl_destroy(s);
  return st;
}

/* ---------------------------------------------------------------- collectives ----- */

static ncclDataType_t nccl_type(ddp_dtype_t dt) {
  switch (dt) {
    case DDP_F32: return ncclFloat32;
    case DDP_F64: return ncclFloat64;
    case DDP_F16: return ncclFloat16;
    case DDP_BF16: return ncclBfloat16;
    case DDP_I32: return ncclInt32;
    case DDP_I64: return ncclInt64;
    default: return ncclUint8;
  }
}

static ncclRedOp_t nccl_op(ddp_redop_t op) {
  switch (op) {
    case DDP_OP_AVG: return ncclAvg;
    case DDP_OP_MIN: return ncclMin;
    case DDP_OP_MAX: return ncclMax;
    case DDP_OP_PRODUCT: return ncclProd;
    default: return ncclSum;
  }
}

/* All ranks compare (kind, count, dtype, op) before any payload moves. */
static ddp_status_t check_fps(nccl_state_t *s, const ddp_backend_coll_t *c, int64_t dl,
                              ddp_error_t *err) {
  int64_t mine[FP_INTS] = {c->kind, (int64_t)c->count, c->dt, c->op};
  size_t bytes = sizeof mine * (size_t)s->size;
  DDP_CHECK(dgrow(s, &s->dscr, &s->dscr_bytes, bytes + sizeof mine, err));
  DDP_CHECK(hgrow(s, bytes, err));
  unsigned char *d = s->dscr;
  CUDA_TRY(s, cudaMemcpyAsync(d + bytes, mine, sizeof mine, cudaMemcpyHostToDevice, s->stream),
           "cudaMemcpyAsync of the fingerprint");
  NCCL_TRY(s, ncclAllGather(d + bytes, d, sizeof mine, ncclUint8, s->comm, s->stream),
           "ncclAllGather of the fingerprints", dl);
  CUDA_TRY(s, cudaMemcpyAsync(s->hscr, d, bytes, cudaMemcpyDeviceToHost, s->stream),
           "cudaMemcpyAsync of the fingerprints");
  DDP_CHECK(wait_stream(s, "the fingerprint exchange", dl, err));
  const int64_t *all = (const int64_t *)s->hscr;
  for (int j = 0; j < s->size; j++)
    if (memcmp(&all[FP_INTS * j], mine, sizeof mine) != 0)
      return ddp__error_quiet(err, DDP_ERR_DESYNC,
                              "mismatched collectives: rank %d runs %s (count %llu, %s, %s), "
                              "rank %d runs %s (count %lld, dtype %lld, op %lld)",
                              s->rank, ddp_coll_kind_name(c->kind), (unsigned long long)c->count,
                              ddp_dtype_name(c->dt), ddp_redop_name(c->op), j,
                              ddp_coll_kind_name((ddp_coll_kind_t)all[FP_INTS * j]),
                              (long long)all[FP_INTS * j + 1], (long long)all[FP_INTS * j + 2],
                              (long long)all[FP_INTS * j + 3]);
  return DDP_OK;
}

/* Canonical order on device memory. Every rank j holds its contribution to rank r's slice at
 * in + off[r] (same offsets on every rank); rank r gathers the W contributions of its slice
 * [off[r], off[r] + len[r]) into device scratch with grouped send/recv, then folds them in
 * rank order into out_slice with the ordered reduction kernel (fold.cu), or, in builds
 * without nvcc, on the host with the library's fold before uploading the result. */
static ddp_status_t reduce_owned(nccl_state_t *s, const ddp_backend_coll_t *c,
                                 const unsigned char *in, const size_t *off, const size_t *len,
                                 unsigned char *out_slice, int64_t dl, ddp_error_t *err) {
  int W = s->size, r = s->rank;
  size_t es = ddp_dtype_size(c->dt), mine = len[r] * es;
  DDP_CHECK(dgrow(s, &s->dscr, &s->dscr_bytes, (size_t)W * mine + 64, err));
  DDP_CHECK(hgrow(s, (size_t)W * mine + 64, err));
  unsigned char *d = s->dscr;
  NCCL_TRY(s, ncclGroupStart(), "ncclGroupStart", dl);
  for (int j = 0; j < W; j++) {
    if (j == r) continue;
    if (len[j])
      NCCL_TRY(s, ncclSend(in + off[j] * es, len[j] * es, ncclUint8, j, s->comm, s->stream),
               "ncclSend of a slice", dl);
    if (mine)
      NCCL_TRY(s, ncclRecv(d + (size_t)j * mine, mine, ncclUint8, j, s->comm, s->stream),
               "ncclRecv of a slice", dl);
  }
  NCCL_TRY(s, ncclGroupEnd(), "ncclGroupEnd", dl);
  if (mine)
    CUDA_TRY(s,
             cudaMemcpyAsync(d + (size_t)r * mine, in + off[r] * es, mine, cudaMemcpyDeviceToDevice,
                             s->stream),
             "cudaMemcpyAsync of the own slice");
  if (mine && ddp__nccl_have_fold_kernel()) {
    CUDA_TRY(s,
             ddp__nccl_fold_launch((int)c->dt, (int)c->op, W, d, mine, out_slice, len[r],
                                   s->stream),
             "launch of the ordered reduction kernel");
    return wait_stream(s, "the slice exchange and ordered fold", dl, err);
  }
  if (mine)
    CUDA_TRY(s, cudaMemcpyAsync(s->hscr, d, (size_t)W * mine, cudaMemcpyDeviceToHost, s->stream),
             "cudaMemcpyAsync of the slices to the host");
  DDP_CHECK(wait_stream(s, "the slice exchange", dl, err));
  if (!mine) return DDP_OK;
  const void *srcs[DDP_PG_MAX_WORLD];
  for (int j = 0; j < W; j++) srcs[j] = s->hscr + (size_t)j * mine;
  /* fold into source 0's area (allowed: dst may alias a source), then upload */
  ddp_reduce_fold(c->dt, c->op, W, srcs, s->hscr, len[r], s->tmp, W);
  CUDA_TRY(s, cudaMemcpyAsync(out_slice, s->hscr, mine, cudaMemcpyHostToDevice, s->stream),
           "cudaMemcpyAsync of the folded slice");
  return wait_stream(s, "the folded slice upload", dl, err);
}

/* Runs collective c on device buffers din/dout. */
static ddp_status_t run_device(nccl_state_t *s, const ddp_backend_coll_t *c,
                               const unsigned char *din, unsigned char *dout, int64_t dl,
                               ddp_error_t *err) {
  int W = s->size, r = s->rank;
  size_t es = ddp_dtype_size(c->dt), n = c->count, nb = n * es;
  ncclComm_t m = s->comm;
  cudaStream_t q = s->stream;
  size_t off[DDP_PG_MAX_WORLD], len[DDP_PG_MAX_WORLD];
  /* NCCL's own allreduce is the fast mode; an integer AVG (truncating division) keeps the
   * canonical path, since ncclAvg is defined for floating-point types. */
  bool native = c->algo == DDP_ALGO_RING &&
                !(c->op == DDP_OP_AVG && c->dt != DDP_F32 && c->dt != DDP_F64 && c->dt != DDP_F16 &&
                  c->dt != DDP_BF16);
  switch (c->kind) {
    case DDP_COLL_ALLREDUCE:
      if (native) {
        NCCL_TRY(s, ncclAllReduce(din, dout, n, nccl_type(c->dt), nccl_op(c->op), m, q),
                 "ncclAllReduce", dl);
        break;
      }
      for (int j = 0; j < W; j++) ddp_coll_part(n, W, j, &off[j], &len[j]);
      DDP_CHECK(reduce_owned(s, c, din, off, len, dout + off[r] * es, dl, err));
      NCCL_TRY(s, ncclGroupStart(), "ncclGroupStart", dl);
      for (int j = 0; j < W; j++) {
        if (j == r) continue;
        if (len[r])
          NCCL_TRY(s, ncclSend(dout + off[r] * es, len[r] * es, ncclUint8, j, m, q),
                   "ncclSend of the reduced slice", dl);
        if (len[j])
          NCCL_TRY(s, ncclRecv(dout + off[j] * es, len[j] * es, ncclUint8, j, m, q),
                   "ncclRecv of a reduced slice", dl);
      }
      NCCL_TRY(s, ncclGroupEnd(), "ncclGroupEnd", dl);
      break;
    case DDP_COLL_REDUCE_SCATTER: /* always canonical: src/pg resolves algorithms for allreduce only
                                   */
      for (int j = 0; j < W; j++) {
        off[j] = (size_t)j * n;
        len[j] = n;
      }
      DDP_CHECK(reduce_owned(s, c, din, off, len, dout, dl, err));
      break;
    case DDP_COLL_BROADCAST:
      NCCL_TRY(s, ncclBroadcast(din, dout, nb, ncclUint8, c->root, m, q), "ncclBroadcast", dl);
      break;
    case DDP_COLL_ALLGATHER:
      NCCL_TRY(s, ncclAllGather(din, dout, nb, ncclUint8, m, q), "ncclAllGather", dl);
      break;
    case DDP_COLL_ALLTOALL:
      if (nb)
        CUDA_TRY(s,
                 cudaMemcpyAsync(dout + (size_t)r * nb, din + (size_t)r * nb, nb,
                                 cudaMemcpyDeviceToDevice, q),
                 "cudaMemcpyAsync of the own block");
      NCCL_TRY(s, ncclGroupStart(), "ncclGroupStart", dl);
      for (int j = 0; j < W && nb; j++) {
        if (j == r) continue;
        NCCL_TRY(s, ncclSend(din + (size_t)j * nb, nb, ncclUint8, j, m, q), "ncclSend", dl);
        NCCL_TRY(s, ncclRecv(dout + (size_t)j * nb, nb, ncclUint8, j, m, q), "ncclRecv", dl);
      }
      NCCL_TRY(s, ncclGroupEnd(), "ncclGroupEnd", dl);
      break;
    case DDP_COLL_BARRIER:
      DDP_CHECK(dgrow(s, &s->dscr, &s->dscr_bytes, 64, err));
      NCCL_TRY(s, ncclAllReduce(s->dscr, s->dscr, 1, ncclInt32, ncclSum, m, q),
               "ncclAllReduce (barrier)", dl);
      break;
    case DDP_COLL_SEND:
      if (nb) NCCL_TRY(s, ncclSend(din, nb, ncclUint8, c->root, m, q), "ncclSend", dl);
      break;
    case DDP_COLL_RECV:
      if (nb) NCCL_TRY(s, ncclRecv(dout, nb, ncclUint8, c->root, m, q), "ncclRecv", dl);
      break;
    default: DDP_REQUIRE(!"collective kind validated by src/pg");
  }
  return wait_stream(s, ddp_coll_kind_name(c->kind), dl, err);
}

/* Input and output sizes in bytes of a collective. */
static void io_bytes(const nccl_state_t *s, const ddp_backend_coll_t *c, size_t *in, size_t *out) {
  size_t nb = c->count * ddp_dtype_size(c->dt), W = (size_t)s->size;
  *in = *out = nb;
  switch (c->kind) {
    case DDP_COLL_ALLGATHER: *out = W * nb; break;
    case DDP_COLL_REDUCE_SCATTER: *in = W * nb; break;
    case DDP_COLL_ALLTOALL: *in = *out = W * nb; break;
    case DDP_COLL_BARRIER: *in = *out = 0; break;
    case DDP_COLL_SEND: *out = 0; break;
    case DDP_COLL_RECV: *in = 0; break;
    default: break;
  }
}

static ddp_status_t nccl_run(void *state, const ddp_backend_coll_t *c, int64_t dl,
                             ddp_error_t *err) {
  nccl_state_t *s = state;
  if (atomic_load(&s->aborted) || s->comm_dead)
    return ddp__error_quiet(err, DDP_ERR_ABORTED, "the NCCL communicator was aborted");
  CUDA_TRY(s, cudaSetDevice(s->device), "cudaSetDevice on the progress thread");
  if (c->kind != DDP_COLL_SEND && c->kind != DDP_COLL_RECV) DDP_CHECK(check_fps(s, c, dl, err));
  size_t inb, outb;
  io_bytes(s, c, &inb, &outb);
  /* Broadcast is in place: one buffer in both roles. */
  const void *hin = c->kind == DDP_COLL_BROADCAST ? c->recv : c->send;
  bool stage_in = inb && !is_device(hin), stage_out = outb && !is_device(c->recv);
  const unsigned char *din = hin;
  unsigned char *dout = c->recv;
  if (stage_in) {
    DDP_CHECK(dgrow(s, &s->dstage[0], &s->dstage_bytes[0], inb, err));
    CUDA_TRY(s, cudaMemcpyAsync(s->dstage[0], hin, inb, cudaMemcpyHostToDevice, s->stream),
             "cudaMemcpyAsync of a host input to the device");
    din = s->dstage[0];
  }
  if (stage_out) {
    /* in-place shapes stay in place on the device copy */
    if (c->kind == DDP_COLL_BROADCAST) {
      dout = (unsigned char *)din;
    } else {
      DDP_CHECK(dgrow(s, &s->dstage[1], &s->dstage_bytes[1], outb, err));
      dout = s->dstage[1];
      if (c->kind == DDP_COLL_ALLREDUCE && c->send == c->recv) dout = (unsigned char *)din;
    }
  }
  DDP_CHECK(run_device(s, c, din, dout, dl, err));
  if (stage_out) {
    CUDA_TRY(s, cudaMemcpyAsync(c->recv, dout, outb, cudaMemcpyDeviceToHost, s->stream),
             "cudaMemcpyAsync of the result to the host");
    DDP_CHECK(wait_stream(s, "the copy of the result to the host", dl, err));
  }
  return DDP_OK;
}

static void nccl_abort(void *state) {
  nccl_state_t *s = state;
  atomic_store(&s->aborted, true);
}

const ddp_backend_ops_t ddp__backend_nccl = {
    .abi_version = DDP_BACKEND_ABI_VERSION,
    .name = "nccl",
    .family = DDP_BACKEND_LINK,
    .create = nccl_create,
    .destroy = nccl_destroy,
    .abort = nccl_abort,
    .mem_alloc = NULL,
    .mem_free = NULL,
    .shared = NULL,
    .xfer = NULL,
    .fail = NULL,
    .run = nccl_run,
};
