/* Private interface of the algorithm layer: the collective descriptor the process-group
 * layer hands down, the per-group communicator the algorithms run on, and the reduction
 * kernels. Algorithms are written once per backend family (ddp/backend.h): shared.c for
 * backends whose ranks map common memory, link.c for backends that move bytes between
 * pairs of ranks. */
#ifndef DDP_SRC_ALGO_H
#define DDP_SRC_ALGO_H

#include <stdatomic.h>

#include "common/common.h"
#include "ddp/backend.h"
#include "ddp/tensor.h"

typedef enum ddp__kind {
  DDP__ALLREDUCE = 1,
  DDP__BROADCAST = 2,
  DDP__ALLGATHER = 3,
  DDP__REDUCE_SCATTER = 4,
  DDP__ALLTOALL = 5,
  DDP__BARRIER = 6,
  DDP__SEND = 7,
  DDP__RECV = 8
} ddp__kind_t;

/* The fingerprint every collective carries: ranks compare them before any data moves
 * (always on). Point-to-point pairs carry kind DDP__SEND on both sides, root = sender,
 * seq = the pair's own counter. `algo` and `segment` are part of it because ranks that
 * chose different algorithms or segment sizes would exchange differently framed bytes.
 * 32 bytes, no padding holes. */
typedef struct ddp__fp {
  uint64_t seq;
  uint64_t count;
  uint8_t kind;
  uint8_t op;
  uint8_t dtype;
  uint8_t algo;
  int32_t root;
  uint64_t segment; /* link family: the pipelining segment in bytes; else 0 */
} ddp__fp_t;

/* One queued operation, as validated by src/pg. */
typedef struct ddp__coll {
  ddp__kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ddp_dtype_t dt;
  ddp_redop_t op;
  int root; /* broadcast root; p2p peer */
  ddp_algorithm_t algo; /* resolved: never AUTO */
  ddp__fp_t fp;
} ddp__coll_t;

/* The scratch block of the fold kernel. */
#define DDP__TMP_BYTES (64u * 1024u)

/* Per-group state of the algorithms. Owned by the thread running the group's current work
 * (the progress thread or a waiter, never two at once), except `aborted` (any thread). */
typedef struct ddp__comm {
  int rank;
  int size;
  const ddp_backend_ops_t *ops;
  void *state;
  const ddp_backend_shared_t *sh; /* shared family */
  size_t segment_bytes;           /* link family: pipelining segment */
  bool stream;                    /* link family: xfer moves one byte stream per pair (tcp),
                                     so one send may be read by several receives; message
                                     backends (mpi) match each send with one receive */
  unsigned char *scratch;         /* link family: size * max(segment, small) bytes */
  size_t scratch_bytes;
  unsigned char *tmp;             /* DDP__TMP_BYTES, fold accumulator */
  uint64_t barriers;              /* shared: barriers this rank has entered */
  uint64_t *p2p_tx;               /* shared: chunks posted to each peer */
  uint64_t *p2p_rx;               /* shared: chunks taken from each peer */
  int64_t deadline_ns;            /* of the running operation */
  bool check_fp;                  /* compare fingerprints (false only for ddp-bench) */
  atomic_bool aborted;
} ddp__comm_t;

/* Control-block bytes the shared algorithms need for a world of `size`. */
size_t ddp__shared_ctl_bytes(int size);
/* Zero-initialised control block fixups (call once, by the creating rank, before peers map
 * it); and per-rank attach (records the pid for messages). */
void ddp__shared_ctl_init(void *ctl, int size);
void ddp__shared_attach(ddp__comm_t *c, int pid);

/* Runs one operation. On failure err holds the detail (without the collective's name,
 * which the caller prefixes) and the status is returned. */
ddp_status_t ddp__run_shared(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err);
ddp_status_t ddp__run_link(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err);

/* From any thread: makes the running and later operations fail (ABORTED here, REMOTE on
 * peers). */
void ddp__shared_poison(ddp__comm_t *c, ddp_status_t st, const char *msg);
/* Marks this rank as gone (its group is being destroyed; nothing runs): peers whose waits
 * still need it fail with REMOTE naming it, as when a process rank exits. */
void ddp__shared_leave(ddp__comm_t *c);

/* Reduction kernels. acc: dst[i] = dst[i] op src[i] (AVG accumulates as SUM). fp16 and
 * bf16 compute in fp32 and round after every operation. */
void ddp__reduce_acc(ddp_dtype_t dt, ddp_redop_t op, void *dst, const void *src, size_t n);
/* dst[i] /= world, for AVG after the last addition. */
void ddp__reduce_avg(ddp_dtype_t dt, void *dst, size_t n, int world);
/* dst[i] = (((srcs[0][i] op srcs[1][i]) op srcs[2][i]) ...), the rank-order left fold over
 * nsrc sources, then the AVG division. dst may alias any source: each block of DDP__TMP_BYTES
 * is folded in tmp before it is written. */
void ddp__reduce_fold(ddp_dtype_t dt, ddp_redop_t op, int nsrc, const void *const *srcs,
                      void *dst, size_t n, unsigned char *tmp, int world);

/* Balanced partition of n elements into parts: part j is [lo, lo+len). */
static inline void ddp__part(size_t n, int parts, int j, size_t *lo, size_t *len) {
  size_t q = n / (size_t)parts, r = n % (size_t)parts, jj = (size_t)j;
  *lo = jj * q + (jj < r ? jj : r);
  *len = q + (jj < r ? 1 : 0);
}

const char *ddp__kind_name(ddp__kind_t k);
/* "allreduce #12 (SUM, F32, count 1000)"-style text of a fingerprint. */
void ddp__fp_str(const ddp__fp_t *fp, char *buf, size_t n);
bool ddp__fp_equal(const ddp__fp_t *a, const ddp__fp_t *b);

#endif /* DDP_SRC_ALGO_H */
