/* libddp backend interface (for backend authors only): a versioned table of functions.
 *
 * A backend is a transport, not a set of algorithms. The collective algorithms live once in
 * src/algo and drive a backend through one of two families of primitives:
 *
 *  - shared: every rank maps a common control block and per-rank staging areas, and can
 *    read buffers that peers publish (threads: any pointer; shm: pointers inside the
 *    segment). The backend supplies the memory, a liveness probe and pointer translation;
 *    the algorithms do their own synchronisation inside the control block with atomics and
 *    futexes.
 *  - link: the backend moves bytes between pairs of ranks. xfer() runs a batch of sends and
 *    receives (at most one of each per peer) concurrently and returns when all are done,
 *    the deadline passes, a peer fails, or the group is aborted.
 *
 * Tables are static consts in src/backend/registry.c. A NULL member means "unsupported"
 * (DDP_ERR_UNSUPPORTED). Contracts of every member are next to it. abi_version must equal
 * DDP_BACKEND_ABI_VERSION; a table with another version is refused at create. */
#ifndef DDP_BACKEND_H
#define DDP_BACKEND_H

#include "ddp/common.h"
#include "ddp/store.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 5: a send may carry a tail (ddp_xfer_t), which stream backends must send. */
#define DDP_BACKEND_ABI_VERSION 5u

/* The vocabulary of collectives, shared by the algorithm layer, the backends and the
 * process-group API (include/ddp/pg.h): kinds and algorithms here, reduction ops
 * (ddp_redop_t) and dtypes in ddp/tensor.h. A backend author needs no other header. */

/* Largest world a group accepts. */
#define DDP_PG_MAX_WORLD 256

/* What a collective does (include/ddp/pg.h has one entry point per kind). The values are
 * stable: fingerprints and the flight recorder carry them. */
typedef enum ddp_coll_kind {
  DDP_COLL_ALLREDUCE = 1,
  DDP_COLL_BROADCAST = 2,
  DDP_COLL_ALLGATHER = 3,
  DDP_COLL_REDUCE_SCATTER = 4,
  DDP_COLL_ALLTOALL = 5,
  DDP_COLL_BARRIER = 6,
  DDP_COLL_SEND = 7,
  DDP_COLL_RECV = 8
} ddp_coll_kind_t;

typedef enum ddp_algorithm {
  DDP_ALGO_AUTO = 0,      /* the size table: small below a threshold, canonical above */
  DDP_ALGO_CANONICAL = 1, /* owner folds its slice in rank order, then all-gather (D2) */
  DDP_ALGO_RING = 2,      /* the fast mode (D1 only): gloo-style segmented ring on tcp;
                           * MPI_Iallreduce on mpi; ncclAllReduce on nccl */
  DDP_ALGO_SMALL = 3      /* every rank folds everything in rank order (D2, latency-bound) */
} ddp_algorithm_t;

/* The canonical algorithm's slices: a balanced partition of n elements into parts, part j
 * being [*lo, *lo + *len); rank j owns part j, wherever canonical runs (src/algo, nccl). */
static inline void ddp_coll_part(size_t n, int parts, int j, size_t *lo, size_t *len) {
  size_t q = n / (size_t)parts, r = n % (size_t)parts, jj = (size_t)j;
  *lo = jj * q + (jj < r ? jj : r);
  *len = q + (jj < r ? 1 : 0);
}

/* "allreduce", "broadcast", ...; SEND is "send/recv", the name of a point-to-point pair
 * (both sides of a pair fingerprint as SEND); "?" outside the list. */
DDP_API const char *ddp_coll_kind_name(ddp_coll_kind_t k);
DDP_API const char *ddp_algorithm_name(ddp_algorithm_t a);

/* ---- the backends libddp knows: one list, in the registry's order. The registry
 * (ddp_backend_find, ddp_backend_names), the launcher (ddprun --backend), ddp-bench and
 * ddp-train read it. It is header-only, so a tool that does not link libddp (ddprun) reads
 * the same list. ---- */

/* Where a backend's ranks run, which decides who can start them. */
typedef enum ddp_backend_ranks {
  DDP_RANKS_THREADS = 1,  /* threads of one process (ddp_spawn_threads) */
  DDP_RANKS_ONE_HOST = 2, /* processes of one host */
  DDP_RANKS_ANY_HOST = 3, /* processes on any hosts */
  DDP_RANKS_MPI = 4       /* the processes of an MPI job (mpirun, srun): MPI has connected
                           * them, so the group needs no store */
} ddp_backend_ranks_t;

/* X(name, alias, ranks, optional). alias: a second name accepted for it ("" = none; "gloo"
 * is Hugging Face's name for the tcp backend, DESIGN.md, Configuration). optional: built
 * only where its library was found (ddp_backend_find says whether this build has it). */
#define DDP_BACKEND_LIST(X)                   \
  X("threads", "", DDP_RANKS_THREADS, false)  \
  X("shm", "", DDP_RANKS_ONE_HOST, false)     \
  X("tcp", "gloo", DDP_RANKS_ANY_HOST, false) \
  X("mpi", "", DDP_RANKS_MPI, true)           \
  X("nccl", "", DDP_RANKS_ANY_HOST, true)

typedef struct ddp_backend_info {
  const char *name;
  const char *alias; /* "" = none */
  ddp_backend_ranks_t ranks;
  bool optional;
} ddp_backend_info_t;

typedef enum ddp_backend_family {
  DDP_BACKEND_SHARED = 1,
  DDP_BACKEND_LINK = 2
} ddp_backend_family_t;

/* What a backend is created with (copied from the group's options). */
typedef struct ddp_backend_init {
  size_t struct_size;
  int rank;
  int size;
  ddp_store_t *store;    /* rendezvous; may be NULL only for the threads backend */
  int64_t timeout_ms;    /* create must return by now + timeout */
  const char *job_token; /* "" = none */
  size_t staging_bytes;  /* shared family: per-rank staging area wanted */
  size_t ctl_bytes;      /* shared family: control block size the algorithms need */
  size_t heap_bytes;     /* shm: per-rank area for ddp_pg_alloc */
} ddp_backend_init_t;

/* Shared-family memory, valid from create to destroy. */
typedef struct ddp_backend_shared {
  void *ctl;               /* ctl_bytes, zero at create, mapped by every rank */
  unsigned char **staging; /* staging[r]: rank r's staging area as mapped here */
  size_t staging_bytes;
  /* A handle for p (n bytes) that peers can turn back into a pointer, or UINT64_MAX when
   * peers cannot read that memory (then the algorithms copy through staging). */
  uint64_t (*to_handle)(void *state, const void *p, size_t n);
  /* The local pointer for a handle published by a peer. */
  void *(*from_handle)(void *state, uint64_t h);
  /* Liveness of `peer`, or of every peer when peer < 0: DDP_OK, or DDP_ERR_REMOTE with a
   * message naming the dead rank. Called from slow waits, so it may cost a system call.
   * Waits name only the peers they depend on: a rank that finished its work and left is
   * not a failure for a point-to-point wait on someone else. NULL = peers cannot die alone
   * (threads). */
  ddp_status_t (*check_peers)(void *state, int peer, ddp_error_t *err);
} ddp_backend_shared_t;

/* One transfer of a link batch.
 *
 * A receive may name a tail: up to tail_bytes more bytes of the same stream that the
 * backend reads into `tail` when they have already arrived with the transfer's own bytes
 * (tcp: one recvmsg for both), and never waits for. tail_done says how many it read; the
 * caller receives the rest itself. It saves a small message one receive call when the
 * caller knows what follows (a fingerprint, then a payload of the agreed size). A backend
 * may ignore receive tails (tail_done stays 0). A send's tail is tail_bytes more bytes sent
 * right behind buf (tcp: one sendmsg for both, no copy to join them), and the send is done
 * when both are; the algorithms give sends tails only on stream backends (`stream`), which
 * must honour them. */
typedef struct ddp_xfer {
  int peer;
  bool is_send;
  void *buf; /* const for sends */
  size_t bytes;
  size_t done; /* progress, owned by the backend during xfer() */
  void *tail;  /* NULL = none; const for sends */
  size_t tail_bytes;
  size_t tail_done; /* owned by the backend during xfer() */
} ddp_xfer_t;

/* Work a link algorithm wants done while a batch waits on the network (the fold of the
 * previous segment). xfer() calls fn(arg) at most once, when the batch first has to wait,
 * and sets ran; when the batch never waits, the caller runs it after xfer() returns. */
typedef struct ddp_xfer_idle {
  void (*fn)(void *arg);
  void *arg;
  bool ran;
} ddp_xfer_idle_t;

/* One whole collective, for backends that run collectives with their own library (mpi's
 * MPI_Iallreduce, nccl). root = broadcast root or point-to-point peer; algo is resolved
 * (never AUTO). Buffers and counts are those of include/ddp/pg.h, already validated. */
typedef struct ddp_backend_coll {
  ddp_coll_kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ddp_dtype_t dt;
  ddp_redop_t op;
  int root;
  ddp_algorithm_t algo;
} ddp_backend_coll_t;

typedef struct ddp_backend_ops {
  uint32_t abi_version;
  const char *name;
  ddp_backend_family_t family;
  /* Joins the group; blocks until all ranks are connected or the timeout passes. */
  ddp_status_t (*create)(const ddp_backend_init_t *init, void **state, ddp_error_t *err);
  /* Frees everything; no call is running. */
  void (*destroy)(void *state);
  /* From any thread: wakes every blocked primitive (which returns DDP_ERR_ABORTED) and makes
   * peers fail fast. Idempotent. */
  void (*abort)(void *state);
  /* Communication memory (shm: inside the segment). NULL members = ddp_malloc. */
  void *(*mem_alloc)(void *state, size_t bytes);
  void (*mem_free)(void *state, void *p);
  /* Shared family: the memory description. */
  const ddp_backend_shared_t *(*shared)(void *state);
  /* Link family: runs the batch; all-or-error. The first failure names the peer. Transfers
   * with the same peer and direction complete in batch order, as one stream (tcp writes
   * them back to back; MPI's messages between a pair do not overtake). */
  ddp_status_t (*xfer)(void *state, ddp_xfer_t *ops, size_t nops, ddp_xfer_idle_t *idle,
                       int64_t deadline_ns, ddp_error_t *err);
  /* Link family: tells peers this rank has failed (they see DDP_ERR_REMOTE at once rather
   * than at their timeout). Data already sent is still delivered. */
  void (*fail)(void *state);
  /* Optional: runs a whole collective with the backend's own implementation, on the
   * progress thread, by deadline_ns. DDP_ERR_UNSUPPORTED means "not this one": the family's
   * algorithms (src/algo) run it instead. A native collective skips the fingerprint check
   * of the family algorithms unless the backend does its own. NULL = never. */
  ddp_status_t (*run)(void *state, const ddp_backend_coll_t *c, int64_t deadline_ns,
                      ddp_error_t *err);
  /* Capabilities: what the layers above may rely on, stated here so that they never compare
   * table identities. */
  /* Link family: xfer moves one byte stream per pair of ranks (tcp), so bytes one send
   * wrote may be read by several receives; false for message backends (mpi), which match
   * each send with exactly one receive. */
  bool stream;
  /* Optional: why the last mem_alloc on this state returned NULL (shm: /dev/shm cannot hold
   * the block, with the bytes needed and free; or the heap has no free range), for
   * ddp_pg_last_error_copy. NULL = plain "out of memory". */
  void (*alloc_error)(void *state, ddp_error_t *out);
} ddp_backend_ops_t;

/* The registered backend of that name or alias ("gloo" is tcp), or NULL: unknown, or an
 * optional backend this library was built without. */
DDP_API const ddp_backend_ops_t *ddp_backend_find(const char *name);
/* The DDP_BACKEND_LIST entry of that name or alias, built in this library or not; NULL for
 * a name the list does not have. */
DDP_API const ddp_backend_info_t *ddp_backend_info(const char *name);
/* Comma-separated list of the backends this library was built with, for error messages:
 * "threads, shm, tcp (alias gloo), mpi, nccl". */
DDP_API const char *ddp_backend_names(void);

#ifdef __cplusplus
}
#endif
#endif /* DDP_BACKEND_H */
