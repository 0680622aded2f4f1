/* Private interface between the files of the process-group layer: pg.c (groups, the queue,
 * the progress thread, work handles), issue.c (the collectives' entry points: argument
 * checks, fingerprints, queueing, blocking calls) and launch.c (groups from a launcher's
 * environment, groups of threads). Not installed. */
#ifndef DDP_SRC_PG_INTERNAL_H
#define DDP_SRC_PG_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "algo/algo.h"
#include "ddp/pg.h"
#include "pg/fault.h"
#include "pg/flight_recorder.h"

#define PG_MAGIC 0x70677270u
#define WORK_MAGIC 0x776f726bu
/* Shared family: small (the one-barrier exchange through lines and boxes) up to here, AUTO
 * (decided by the run from the buffers, src/algo/shared.c) up to DDP__SHARED_BOX_BYTES,
 * canonical above. At 1 KiB canonical over shared buffers already took 0.71-0.84 of the
 * box's time, at 512 B 1.09-1.18 (ddp-bench, W = 2, alternating runs). */
#define SMALL_SHARED 512u
#define SMALL_LINK (32u * 1024u)
/* Two ranks on a stream (tcp): small and canonical move the same bytes (the whole vector
 * each way, against half of it twice), and small's single exchange wins up to here
 * (loopback, W = 2, p50 of three runs: 64 KiB 19.0-19.2 against 21.2-21.4 us, 128 KiB
 * 27.1-27.3 against 31.2-31.3 us; at 256 KiB canonical wins, 41.8-42.4 against 45.7-46.8). */
#define SMALL_STREAM_PAIR (128u * 1024u)
/* Work up to this size is queued lazily (enqueue): a shared-memory allreduce of 1 MiB or a
 * loopback tcp one of 256 KiB takes about as long as waking the progress thread and the
 * context switch that follows, which on a machine whose CPUs the ranks keep busy delays a
 * rank by 10-30 us (bench_peers.sh, 2 ranks on 2 CPUs: p50 at 64 KiB 11-35 us woken, 4 us
 * run by the waiting caller; tcp 43 against 23 us). Larger work wakes the progress thread
 * at once, so that it overlaps the caller's computation (DDP's buckets). */
#define LAZY_SHARED (1024u * 1024u)
#define LAZY_LINK (256u * 1024u)
/* Lazy start of small work (see submit): how often the idle progress thread looks for
 * work it was not woken for, and for how long after the last submission it keeps looking
 * before it sleeps until woken. */
#define LAZY_POLL_NS (1000 * 1000LL)
#define LAZY_ACTIVE_NS (100 * 1000 * 1000LL)

struct ddp_work {
  uint32_t magic;
  ddp_pg_t *pg;
  ddp__coll_t coll;
  atomic_int done;
  atomic_int refs; /* the caller's handle + the queue */
  ddp_status_t status;
  uint64_t fr_id; /* its flight-recorder entry */
  struct ddp_work *next;
  /* The failure's message, allocated when the work fails: 8 KiB in every handle would make
   * allocating and freeing one cost more than a small allreduce itself. */
  ddp_error_t *err;
};

struct ddp_pg {
  uint32_t magic;
  int rank;
  int size;
  const ddp_backend_ops_t *ops;
  void *state;
  ddp__comm_t comm;     /* owned by whoever runs work (`running`) */
  ddp_algorithm_t algo; /* requested (AUTO = size table) */
  size_t small_max;     /* AUTO: allreduce at or below this many bytes uses SMALL */
  size_t lazy_max;      /* work at or below this many bytes is queued lazily (enqueue) */
  int64_t timeout_ms;
  pthread_mutex_t mu;      /* guards everything below */
  pthread_cond_t cv_queue; /* work queued or stop */
  pthread_cond_t cv_done;  /* some work completed (CLOCK_MONOTONIC) */
  ddp_work_t *head, *tail;
  bool running;    /* a work item is being run (progress thread or a waiter) */
  bool log_detail; /* DDP_DEBUG=DETAIL at create: every collective is logged as queued */
  bool lazy;       /* the queue holds work the progress thread was not woken for */
  bool deep_sleep; /* the progress thread waits without a timeout: wake it */
  int64_t last_submit_ns;
  bool stop;
  pthread_t thread;
  ddp_status_t failed; /* first failure of the group */
  ddp_error_t fail_err;
  ddp_error_t arg_err;    /* last argument error */
  uint64_t seq;           /* collectives issued */
  uint64_t *p2p_send_seq; /* per peer */
  uint64_t *p2p_recv_seq;
  ddp_store_t *owned_store; /* ddp_pg_create_from_env */
  ddp__pg_fault_t fault;    /* DDP_FAULT (fault.h) */
  ddp__fr_t *fr;            /* flight recorder; NULL when off */
  /* What ddp_pg_split (split.c) needs to create sub-groups as this one was created: the
   * store (borrowed, or owned_store), this group's key space on it ("ddp_pg/<store_k>"),
   * the resolved options (job_token a copy, owned), and the splits made so far. */
  ddp_store_t *store;
  int64_t store_k;
  ddp_pg_options_t opts;
  uint64_t nsplits;
};

/* Runs w (the group's `running` claimed by the caller, pg->mu not held), its deadline
 * counting from now (shared family: from its first wait, DDP__DEADLINE_LAZY); `failed` is the
 * group's failure as the caller read it under pg->mu when it took w (then w only gets that status,
 * "not run", and its recorder entry was not started). Returns true when it has ended w's
 * flight-recorder entry itself (a failure: the entry must show the end before the failure's dump is
 * taken); otherwise the caller ends it under the lock it takes next anyway. */
bool ddp__pg_run_one(ddp_pg_t *pg, ddp_work_t *w, ddp_status_t failed);

/* The group owns store from now on and destroys it with itself (ddp_pg_create_from_env). */
void ddp__pg_own_store(ddp_pg_t *pg, ddp_store_t *store);

#endif /* DDP_SRC_PG_INTERNAL_H */
