/* libddp process-group layer: groups of ranks, asynchronous collectives, work handles.
 *
 * A process group (ddp_pg_t) is W ranks that run the same sequence of collectives. Every
 * collective is asynchronous: the call checks its arguments, queues the operation and
 * returns a ddp_work_t at once; queued operations run one at a time in issue order, on the
 * group's progress thread, or on the caller's thread when it waits on an idle group (no
 * thread handoff for small messages). Caller buffers belong to the library from the call until the
 * work completes (ddp_work_wait/ddp_work_test says so); reading or writing them before that is a
 * data race.
 *
 * Blocking calls: with work == NULL a collective returns only when it has ended, with its
 * status (PyTorch's async_op=False). On an idle group it runs on the calling thread with no
 * work handle and no queue, the cheapest path for small messages; behind queued work it
 * waits as ddp_work_wait_free would. Its failure message is the group's failure
 * (ddp_pg_last_error_copy), since any failed collective fails the group.
 *
 * Determinism (docs/backends.md): with the default algorithm every reduction folds the
 * ranks' contributions in rank order, ((x0 + x1) + x2) + ..., in the element's dtype (fp16
 * and bf16 add in fp32 and round after every addition), so results are bitwise identical on
 * every backend and for every segment size. algorithm=ring trades that for gloo's ring.
 *
 * Failures: every wait has a deadline (the group's timeout). A dead peer, a timeout, a
 * mismatched collective (DESYNC) or an abort fails the group: the failing call and every
 * pending and later call return DDP_ERR_REMOTE / TIMEOUT / DESYNC / ABORTED with a message
 * (ddp_pg_last_error_copy, ddp_work_error) naming the collective and the ranks at fault. A failed
 * group cannot recover: destroy it and create a new one (docs/errors.md).
 *
 * Thread safety: issuing calls on one group from several threads is allowed (they are
 * ordered by issue), but ranks must issue the same sequence. ddp_pg_abort may be called
 * from any thread at any time. */
#ifndef DDP_PG_H
#define DDP_PG_H

#include "ddp/backend.h"
#include "ddp/common.h"
#include "ddp/store.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_pg ddp_pg_t;
typedef struct ddp_work ddp_work_t;

typedef struct ddp_pg_options {
  size_t struct_size;        /* sizeof(ddp_pg_options_t) */
  const char *backend;       /* "threads", "shm", "tcp" ("gloo" = tcp), and where built "mpi"
                              * (docs/mpi.md) and "nccl" (docs/nccl.md); NULL = DDP_BACKEND
                              * env, else threads. mpi needs no store; nccl needs one. */
  int rank;                  /* 0..world-1 */
  int world;                 /* 1..DDP_PG_MAX_WORLD */
  ddp_store_t *store;        /* rendezvous; borrowed, must outlive create (not the group),
                              * and every ddp_pg_split of the group */
  int64_t timeout_ms;        /* every wait; <0 = DDP_TIMEOUT env (default 1800 s) */
  ddp_algorithm_t algorithm; /* AUTO = DDP_ALGORITHM env, else the size table */
  size_t segment_bytes;      /* pipelining segment of ring/canonical; 0 = the default */
  const char *job_token;     /* tcp: presented on every peer connection; NULL = DDP_JOB_TOKEN */
  size_t shm_heap_bytes;     /* shm: per-rank area for ddp_pg_alloc; 0 = the host's physical
                              * memory (address space only: each block is reserved in
                              * /dev/shm when ddp_pg_alloc hands it out) */
  bool no_flight_recorder;   /* true: this group records nothing and never dumps (helper groups
                              * beside a job's own, such as the torch backend's point-to-point
                              * channels, whose dumps would take their ranks' file names) */
  bool defer_start;          /* true: work of any size, issued while the group is idle, waits
                              * for its caller (ddp_work_wait runs it on the caller's thread;
                              * ddp_work_test starts it in the background) instead of waking
                              * the progress thread, which otherwise takes work above 1 MiB
                              * (shm) or 256 KiB (links) at once. For callers that usually wait
                              * at once (torch.distributed's synchronous calls): it saves two
                              * thread hand-offs a call. Work nobody waits for or tests starts
                              * within 1 ms, at the progress thread's next look. */
} ddp_pg_options_t;

/* segment_bytes 0: 256 KiB. On loopback with 2 ranks, 4-64 MiB allreduces ran 1.3-2x
 * faster than with 1 MiB segments; 128 KiB and 512 KiB were not better (docs/benchmarks.md). */
#define DDP_PG_SEGMENT_BYTES_DEFAULT (256u * 1024u)

#define DDP_PG_OPTIONS_INIT \
  { sizeof(ddp_pg_options_t), NULL, 0, 1, NULL, -1, DDP_ALGO_AUTO, 0, NULL, 0, false, false }

/* Creates this rank's member of a group. Blocks until every rank has joined (rendezvous
 * through opts->store) or the timeout passes (DDP_ERR_TIMEOUT naming the missing ranks).
 * err (optional) receives the message on failure. Options are copied (read by struct_size: an
 * older caller gets defaults for the fields it lacks). */
DDP_API ddp_status_t ddp_pg_create(const ddp_pg_options_t *opts, ddp_pg_t **out, ddp_error_t *err);

/* Creates a group from a launcher's environment: RANK/WORLD_SIZE (torchrun, ddprun), else
 * OMPI_COMM_WORLD_RANK/SIZE (mpirun), else SLURM_PROCID/NTASKS (srun); MASTER_ADDR and
 * MASTER_PORT locate the TCP store, served by rank 0; DDP_BACKEND picks the backend (default
 * tcp, or mpi under Open MPI's mpirun when the mpi backend is built and RANK is unset). The
 * group owns that store. The mpi backend uses no store (and so needs no MASTER_*): MPI has
 * connected the ranks. opts may be NULL; its rank, world and store are ignored. */
DDP_API ddp_status_t ddp_pg_create_from_env(const ddp_pg_options_t *opts, ddp_pg_t **out,
                                            ddp_error_t *err);

/* Collective over pg (every rank calls it, in the same order as pg's collectives): a new
 * group of the ranks of pg that pass the same color (>= 0), ranked in their order in pg,
 * as NCCL's ncclCommSplit(color, key = rank) and torch.distributed.new_group do. It runs on
 * pg's backend with pg's options (timeout, algorithm, segment, job token) and meets through
 * the store pg was created on (ddp_pg_create_from_env's own, ddp_spawn_threads' or the
 * caller's, which must still be alive), in a key space of its own: the n-th split of a
 * group uses the prefix "ddp_pg/<k>/split/<n>/<color>" of that store. The new group records
 * no flight-recorder dump (its dumps would take its ranks' file names; no_flight_recorder).
 * Destroy it before pg. A negative color is DDP_ERR_INVALID_ARGUMENT; a group with no
 * store (the mpi backend) is DDP_ERR_UNSUPPORTED. */
DDP_API ddp_status_t ddp_pg_split(ddp_pg_t *pg, int color, ddp_pg_t **out, ddp_error_t *err);

/* Waits for queued work to finish (each bounded by the timeout), stops the progress thread
 * and frees everything. Work handles not yet freed stay valid until ddp_work_free. NULL is a
 * no-op. Leaving is visible to the peers, as a process rank's exit is: a peer waiting in a
 * collective or receive that still needs this rank fails at once (within about 10 ms) with
 * DDP_ERR_REMOTE naming it ("rank 1 left the group"), on every backend; waits this rank
 * already satisfied are unaffected. A rank that leaves because it failed should call
 * ddp_pg_abort_reason first, so peers quote why. */
DDP_API void ddp_pg_destroy(ddp_pg_t *pg);

/* Benchmarks only: ddp-bench --desync-cost times the fingerprint check by turning it off
 * and on between collectives of one group. Off, collectives skip the fingerprint exchange
 * and comparison, and mismatched collectives hang until the timeout or return wrong data
 * instead of DDP_ERR_DESYNC. Call it with no work queued, on every rank at the same point
 * of the sequence. The check is on from ddp_pg_create; never turn it off in a job. */
DDP_API void ddp_pg_set_desync_check(ddp_pg_t *pg, bool on);

/* Fails the group now from any thread: running and queued work end with DDP_ERR_ABORTED,
 * blocked waits return, peers are told (they see DDP_ERR_REMOTE quickly). Idempotent. */
DDP_API void ddp_pg_abort(ddp_pg_t *pg);
/* ddp_pg_abort for a local failure of this rank (bad data, an unwritable output directory,
 * any error outside the group): the same effect, and on the shared backends (threads, shm)
 * peers quote the reason ("rank 1 failed the group: rank 1 aborted the group: <reason>");
 * tcp peers see the connections closed. reason may be NULL. ddp_train calls it on every
 * local failure and ddp_spawn_threads for a rank function that returns an error, so one
 * rank's failure ends every rank at once in every launcher mode. Idempotent (the first
 * reason stays). */
DDP_API void ddp_pg_abort_reason(ddp_pg_t *pg, const char *reason);

/* Fault injection (docs/errors.md, "Fault injection"; ddp_train calls it for DDP_FAULT's
 * step=S faults, the group itself for collective=K ones). Runs f->kind now on this rank,
 * from the thread that issues the group's collectives, after logging "fault injection: KIND
 * on rank R at WHERE (t=... s, CLOCK_MONOTONIC)": CRASH kills this process with SIGKILL, or
 * on the threads backend aborts the group and returns DDP_ERR_ABORTED; HANG returns
 * DDP_ERR_ABORTED (after aborting the group) once the group has failed or the timeout plus
 * 1 s has passed; SLOW sleeps f->slow_ms; WRONG_SHAPE arms the next collective with a
 * count > 0 to run with count - 1 (DESYNC on every rank); CORRUPT_BUCKET arms the next
 * floating-point allreduce to have bits of its input flipped. Other kinds are
 * DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_status_t ddp_pg_inject_fault(ddp_pg_t *pg, const ddp_fault_t *f, const char *where,
                                         ddp_error_t *err);

/* ---- flight recorder (docs/errors.md, "Flight recorder"): every group keeps its last
 * DDP_FR_BUFFER_SIZE collectives (default 2000; 0 = off) and dumps them as JSON when it fails,
 * when another rank of the job dumped, and on SIGUSR1, where DDP_FR_DUMP_DIR or PyTorch's
 * TORCH_FR_DUMP_TEMP_FILE says. tools/programs/ddp-fr-trace reads every rank's dump. ---- */

/* The next collective issued on this group is recorded with `bucket` (a DDP bucket index, or
 * -1) and `text` (the bucket's parameter names, comma-separated; past 255 bytes the names
 * that fit, then "...").
 * DDP calls it before each bucket's allreduce or comm hook. No-op when recording is off. */
DDP_API void ddp_pg_set_next_collective_tag(ddp_pg_t *pg, int64_t bucket, const char *text);
/* The bytes this rank has sent in the collectives issued on this group so far, counted by
 * the flight recorder as the bandwidth-optimal ring algorithms send them, whatever algorithm
 * the backend ran (nccl-tests' bus bytes, the Ultra-Scale Playbook's accounting): per call
 * of S bytes (all-gather and reduce-scatter: S the full buffer), all-reduce 2(W-1)/W S,
 * all-gather, reduce-scatter, all-to-all and broadcast (W-1)/W S, send S, receive and
 * barrier 0; W = 1 sends nothing. The dump shows each entry's share (ddp_sent_bytes).
 * -1 when the group records nothing (DDP_FR_BUFFER_SIZE=0). Safe from any thread. */
DDP_API double ddp_pg_bytes_sent(const ddp_pg_t *pg);
/* True when this group records its collectives. */
DDP_API bool ddp_pg_flight_recorder_enabled(const ddp_pg_t *pg);
/* Writes the dump now, to path (NULL = the configured location), through a temporary file and
 * a rename. DDP_ERR_INVALID_USAGE when recording is off or no location is known. */
DDP_API ddp_status_t ddp_pg_dump_flight_recorder(ddp_pg_t *pg, const char *path, ddp_error_t *err);

DDP_API int ddp_pg_rank(const ddp_pg_t *pg);
DDP_API int ddp_pg_size(const ddp_pg_t *pg);
DDP_API const char *ddp_pg_backend_name(const ddp_pg_t *pg);
/* Copies into *out, under the group's lock, the group's first failure, or else its last
 * argument error (status DDP_OK and "" when there is neither). Safe from any thread. */
DDP_API void ddp_pg_last_error_copy(const ddp_pg_t *pg, ddp_error_t *out);
/* DDP_OK while the group is usable, else the status that failed it. */
DDP_API ddp_status_t ddp_pg_status(const ddp_pg_t *pg);

/* Communication buffers: 64-byte aligned. On shm they live in the shared segment, so
 * collectives on them read peers' data in place with no copy; elsewhere ordinary memory.
 * NULL when out of memory (on shm: /dev/shm cannot hold the block, or the heap has no free
 * range), with the reason in ddp_pg_last_error_copy (on shm it names /dev/shm, the bytes needed
 * and the bytes free). Free with ddp_pg_free on the same group before destroying it. */
DDP_API void *ddp_pg_alloc(ddp_pg_t *pg, size_t bytes);
DDP_API void ddp_pg_free(ddp_pg_t *pg, void *ptr);

/* ---- collectives. Counts are in elements. send == recv means in place. Every rank must
 * issue the same collectives in the same order with the same count, dtype, op and root. ---- */

/* recv[i] = op over ranks of send[i]. */
DDP_API ddp_status_t ddp_allreduce(ddp_pg_t *pg, const void *send, void *recv, size_t count,
                                   ddp_dtype_t dt, ddp_redop_t op, ddp_work_t **work);
/* buf of count elements from root to every rank. */
DDP_API ddp_status_t ddp_broadcast(ddp_pg_t *pg, void *buf, size_t count, ddp_dtype_t dt, int root,
                                   ddp_work_t **work);
/* recv (W*count elements) = concatenation of every rank's send (count elements). In place
 * when send == recv + rank*count. */
DDP_API ddp_status_t ddp_allgather(ddp_pg_t *pg, const void *send, void *recv, size_t count,
                                   ddp_dtype_t dt, ddp_work_t **work);
/* recv (count elements) = op over ranks of send[rank*count .. (rank+1)*count) (send has
 * W*count elements). In place when recv == send + rank*count. */
DDP_API ddp_status_t ddp_reduce_scatter(ddp_pg_t *pg, const void *send, void *recv, size_t count,
                                        ddp_dtype_t dt, ddp_redop_t op, ddp_work_t **work);
/* recv block j (count elements) = rank j's send block rank. send and recv hold W*count
 * elements and must not overlap. */
DDP_API ddp_status_t ddp_alltoall(ddp_pg_t *pg, const void *send, void *recv, size_t count,
                                  ddp_dtype_t dt, ddp_work_t **work);
DDP_API ddp_status_t ddp_barrier(ddp_pg_t *pg, ddp_work_t **work);
/* Point to point. A send completes once the receiver has posted the matching receive and
 * the data is handed over (shared backends: copied by the receiver; tcp: written to the
 * connection). The pair must agree on count and dtype (else DESYNC on both). Each rank runs
 * its operations in issue order, so a ring of sends needs some ranks to receive first. */
DDP_API ddp_status_t ddp_send(ddp_pg_t *pg, const void *buf, size_t count, ddp_dtype_t dt, int peer,
                              ddp_work_t **work);
DDP_API ddp_status_t ddp_recv(ddp_pg_t *pg, void *buf, size_t count, ddp_dtype_t dt, int peer,
                              ddp_work_t **work);

/* ---- work handles ---- */

/* Waits until the work completes or timeout_ms passes (<0 = the group's timeout plus a
 * second; the work itself always ends by its own deadline). With timeout_ms < 0 or at least
 * the group's timeout, an idle group's queued work may run on this thread first, each item
 * bounded by its own deadline; timeout_ms then counts from the end of that. Returns the
 * work's status, or DDP_ERR_TIMEOUT if it is still running when this wait gives up (the
 * work stays valid). */
DDP_API ddp_status_t ddp_work_wait(ddp_work_t *work, int64_t timeout_ms);
/* *done = the work has completed; never blocks. */
DDP_API ddp_status_t ddp_work_test(ddp_work_t *work, bool *done);
/* DDP_ERR_INVALID_USAGE ("in progress") while running, else the final status. Note that
 * INVALID_USAGE is never a final status of queued work. */
DDP_API ddp_status_t ddp_work_status(const ddp_work_t *work);
/* The work's failure message ("" when it succeeded or is running). */
DDP_API const char *ddp_work_error(const ddp_work_t *work);
/* Frees the handle; if the work is still running, the handle is released when it ends (the
 * buffers stay in use until then). NULL is a no-op. */
DDP_API void ddp_work_free(ddp_work_t *work);
/* Convenience: wait with the default timeout, then free. */
DDP_API ddp_status_t ddp_work_wait_free(ddp_work_t *work);

/* Runs fn(pg, arg) on `world` threads, each with its own group on the threads backend over
 * a fresh in-memory store. opts may be NULL (defaults); its backend, rank, world and store
 * are ignored. The groups are created before fn runs and destroyed after it returns; a
 * rank whose fn returns an error aborts its group first (ddp_pg_abort_reason), so the
 * other ranks fail at once instead of at the timeout. Returns the first non-OK status of a
 * rank (or of group creation). */
typedef ddp_status_t (*ddp_thread_fn)(ddp_pg_t *pg, void *arg);
DDP_API ddp_status_t ddp_spawn_threads(int world, const ddp_pg_options_t *opts, ddp_thread_fn fn,
                                       void *arg);

#ifdef __cplusplus
}
#endif
#endif /* DDP_PG_H */
