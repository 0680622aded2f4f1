/* Private interface of the algorithm layer: the collective descriptor the process-group
 * layer hands down and the per-group communicator the algorithms run on. Algorithms are
 * written once per backend family (ddp/backend.h): shared.c for backends whose ranks map
 * common memory, link.c for backends that move bytes between pairs of ranks. They drive a
 * backend through its public table only, and reduce with the tensor layer's kernels
 * (ddp_reduce_* in ddp/tensor.h); no backend includes this header. */
#ifndef DDP_SRC_ALGO_H
#define DDP_SRC_ALGO_H

#include <stdatomic.h>

#include "common/common.h"
#include "ddp/backend.h"
#include "ddp/tensor.h"

/* Shared family: each rank's box for the one-barrier small allreduce, per sequence parity.
 * Allreduces above the size table's small bound and up to this size run AUTO: every rank
 * publishes its buffers' handles and, when they are not in shared memory, fills its box,
 * and the run takes canonical when every rank's buffers are shared, the boxes otherwise
 * (src/algo/shared.c). The group's scratch holds at least this much. */
#define DDP__SHARED_BOX_BYTES (16u * 1024u)

/* The fingerprint every collective carries: ranks compare them before any data moves
 * (always on). Point-to-point pairs carry kind DDP_COLL_SEND on both sides, root = sender,
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
  ddp_coll_kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ddp_dtype_t dt;
  ddp_redop_t op;
  int root;             /* broadcast root; p2p peer */
  ddp_algorithm_t algo; /* resolved: never AUTO */
  ddp__fp_t fp;
} ddp__coll_t;

/* comm.deadline_ns before a shared-family operation's first wait: the operation's start and
 * its first wait are microseconds apart, and a small collective that never waits then needs
 * no clock read for it (a fifth of its bookkeeping). */
#define DDP__DEADLINE_LAZY INT64_MIN

/* The shared family's waiting policy (wait_policy.c): the budgets of a wait's phases, PAUSE
 * polling then sched_yield polling, before it sleeps on the futex; adapted from how earlier
 * waits ended. Zero-initialised is the starting state. */
typedef enum ddp__wait_phase {
  DDP__WAIT_SPUN,    /* the wait ended while polling with PAUSE */
  DDP__WAIT_YIELDED, /* while polling with sched_yield */
  DDP__WAIT_SLEPT,   /* it went to sleep */
} ddp__wait_phase_t;
typedef struct ddp__wait_policy {
  int64_t spin_ns;       /* the next wait's PAUSE budget; 0 = the least */
  int64_t after_wake_ns; /* the yield budget after waking a sleeper; 0 = the least */
  bool woke_sleeper;     /* this rank woke a sleeping peer since its last wait that polled */
} ddp__wait_policy_t;
/* The budgets (wait_policy.c says why): PAUSE polling between the two spin bounds, yield
 * polling up to DDP__WAIT_YIELD_NS, or after waking a sleeper between the after-wake
 * bounds. */
#define DDP__WAIT_SPIN_MIN_NS 200
#define DDP__WAIT_SPIN_MAX_NS 1500
#define DDP__WAIT_YIELD_NS (50 * 1000)
#define DDP__WAIT_AFTER_WAKE_MIN_NS (1000 * 1000)
#define DDP__WAIT_AFTER_WAKE_MAX_NS (8 * 1000 * 1000)
/* The budgets of the next wait that polls, from its start. */
int64_t ddp__wait_spin_ns(const ddp__wait_policy_t *p);
int64_t ddp__wait_yield_ns(const ddp__wait_policy_t *p);
/* This rank has just woken a sleeping peer. */
void ddp__wait_woke(ddp__wait_policy_t *p);
/* A wait that polled ended in `phase` after waited_ns (SLEPT: when it went to sleep). */
void ddp__wait_ended(ddp__wait_policy_t *p, ddp__wait_phase_t phase, int64_t waited_ns);

/* Per-group state of the algorithms. Owned by the thread running the group's current work
 * (the progress thread or a waiter, never two at once), except `aborted` (any thread). */
typedef struct ddp__comm {
  int rank;
  int size;
  const ddp_backend_ops_t *ops;
  void *state;
  const ddp_backend_shared_t *sh; /* shared family */
  size_t segment_bytes;           /* link family: pipelining segment */
  unsigned char *scratch;         /* link family: size * max(2 segments, small) bytes */
  size_t scratch_bytes;
  unsigned char *tmp;      /* DDP_REDUCE_TMP_BYTES, fold accumulator */
  uint64_t barriers;       /* shared: barriers this rank has entered */
  int par;                 /* shared: the running collective's sequence number & 1 */
  uint64_t *p2p_tx;        /* shared: chunks posted to each peer */
  uint64_t *p2p_rx;        /* shared: chunks taken from each peer */
  int64_t deadline_ns;     /* of the running operation; DDP__DEADLINE_LAZY: shared family,
                            * set from the first wait's clock read (shared.c, wait_for) */
  int64_t timeout_ms;      /* the group's, for a lazy deadline */
  ddp__wait_policy_t wait; /* shared: how the next wait polls (wait_policy.c) */
  size_t box_dirty[2];     /* shared: bytes of this rank's box of each parity that peers read
                            * since enter() last took them back (shared.c) */
  size_t ext_dirty[2];     /* shared: the same for its stamped lines, in lines */
  bool check_fp;           /* compare fingerprints (false only for ddp-bench) */
  atomic_bool aborted;
} ddp__comm_t;

/* Control-block bytes the shared algorithms need for a world of `size` (the backend hands
 * them over zeroed: ddp_backend_shared_t.ctl); and per-rank attach (records the pid for
 * messages). */
size_t ddp__shared_ctl_bytes(int size);
void ddp__shared_attach(ddp__comm_t *c, int pid);

/* Runs one operation. On failure err holds the detail (without the collective's name,
 * which the caller prefixes) and the status is returned. */
ddp_status_t ddp__run_shared(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err);
ddp_status_t ddp__run_link(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err);
/* Shared family, from any thread and outside any collective: DDP_OK while no rank has
 * failed or aborted the group, else that failure (REMOTE naming the rank). A rank that waits
 * without running a collective (a fault's hang) polls it to learn that the others gave up. */
ddp_status_t ddp__shared_group_failed(ddp__comm_t *c, ddp_error_t *err);

/* From any thread: makes the running and later operations fail (ABORTED here, REMOTE on
 * peers). */
void ddp__shared_poison(ddp__comm_t *c, ddp_status_t st, const char *msg);
/* Marks this rank as gone (its group is being destroyed; nothing runs): peers whose waits
 * still need it fail with REMOTE naming it, as when a process rank exits. */
void ddp__shared_leave(ddp__comm_t *c);

/* "allreduce #12 (SUM, F32, count 1000)"-style text of a fingerprint. */
void ddp__fp_str(const ddp__fp_t *fp, char *buf, size_t n);
bool ddp__fp_equal(const ddp__fp_t *a, const ddp__fp_t *b);

#endif /* DDP_SRC_ALGO_H */
