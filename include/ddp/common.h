/* libddp common layer: status codes, errors, logging, allocator, environment, clocks,
 * counter-based RNG and fp16/bf16 conversion.
 *
 * Every other layer builds on this header. Nothing here blocks; everything here is
 * thread-safe unless a comment says otherwise. */
#ifndef DDP_COMMON_H
#define DDP_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DDP_API __attribute__((visibility("default")))
#define DDP_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define DDP_API
#define DDP_PRINTF(f, a)
#endif

/* ---------------------------------------------------------------- status codes ---- */

/* One list generates the error codes (DDP_ERR_<name>), ddp_status_name() and
 * ddp_status_str(), so the three cannot drift apart; DDP_OK (0) is the only other value.
 * REMOTE, TIMEOUT, DESYNC and ABORTED leave a process group failed: re-create it
 * (docs/errors.md). */
#define DDP_STATUS_MAP(XX)                           \
  XX(INVALID_ARGUMENT, "invalid argument")           \
  XX(INVALID_USAGE, "invalid usage")                 \
  XX(INVALID_DATA, "invalid or corrupt data")        \
  XX(NO_MEMORY, "out of memory")                     \
  XX(SYSTEM, "system call failed")                   \
  XX(REMOTE, "remote peer failed")                   \
  XX(TIMEOUT, "timed out")                           \
  XX(DESYNC, "collectives out of sync across ranks") \
  XX(UNSUPPORTED, "unsupported operation")           \
  XX(NOT_FOUND, "not found")                         \
  XX(ABORTED, "aborted")                             \
  XX(INTERNAL, "internal error")

typedef enum ddp_status {
  DDP_OK = 0,
/* The list expands to enumerators, which clang-format cannot see. */
/* clang-format off */
#define DDP_STATUS_ENUM_(name, text) DDP_ERR_##name,
  DDP_STATUS_MAP(DDP_STATUS_ENUM_)
#undef DDP_STATUS_ENUM_
  DDP_STATUS_COUNT_
  /* clang-format on */
} ddp_status_t;

/* "DDP_ERR_TIMEOUT"-style name, or "DDP_ERR_UNKNOWN" for a value outside the list. */
DDP_API const char *ddp_status_name(ddp_status_t s);
/* Generic human text ("timed out"). The specific message lives on the handle. */
DDP_API const char *ddp_status_str(ddp_status_t s);

/* ---------------------------------------------------------------- errors ---------- */

/* Room for PyTorch's longest texts: "Expected to mark a variable ready only once ..." is
 * about 2 KB before the parameter's name, and the unfinished-reduction error lists every
 * parameter that received no gradient (the reducer keeps its last error in a ddp_error_t). */
#define DDP_ERROR_MSG_MAX 8192

/* The last error of one handle (or of one call that has no handle yet, such as an open).
 * Handles embed one; functions without a handle take an optional ddp_error_t * (NULL is
 * allowed and means "log only"). The message names what a user needs: the rank, the peer,
 * the syscall and errno, the collective, the file offset, the parameter. */
typedef struct ddp_error {
  ddp_status_t status;
  char msg[DDP_ERROR_MSG_MAX];
} ddp_error_t;

/* ---------------------------------------------------------------- logging --------- */

typedef enum ddp_log_level {
  DDP_LOG_ERROR = 0, /* always printed */
  DDP_LOG_WARN = 1,  /* always printed (PyTorch prints warnings at OFF too) */
  DDP_LOG_INFO = 2,  /* DDP_DEBUG=INFO or DETAIL */
  DDP_LOG_DETAIL = 3 /* DDP_DEBUG=DETAIL */
} ddp_log_level_t;

/* The debug level from DDP_DEBUG, else TORCH_DISTRIBUTED_DEBUG: OFF (default) -> WARN,
 * INFO -> INFO, DETAIL -> DETAIL. Read from the environment at each call. */
DDP_API ddp_log_level_t ddp_log_level_from_env(void);

/* A log sink receives finished lines ("[rank3] libddp WARN: ..." without newline).
 * The default sink writes to stderr. The sink is process-wide, like libuv's allocator;
 * set it before creating handles. NULL restores the default. */
typedef void (*ddp_log_sink_fn)(void *user, ddp_log_level_t level, const char *line);
DDP_API void ddp_set_log_sink(ddp_log_sink_fn fn, void *user);

/* ---------------------------------------------------------------- allocator ------- */

/* A replaceable allocator (process-wide, like uv_replace_allocator). Set it before any
 * handle exists and restore it after the last is destroyed. All four must be non-NULL. */
typedef struct ddp_allocator {
  void *(*malloc_fn)(void *user, size_t size);
  void *(*calloc_fn)(void *user, size_t n, size_t size);
  void *(*realloc_fn)(void *user, void *ptr, size_t size);
  void (*free_fn)(void *user, void *ptr);
  void *user;
} ddp_allocator_t;

/* NULL restores the libc allocator. */
DDP_API void ddp_set_allocator(const ddp_allocator_t *a);

/* Counters kept by the library's allocation wrappers, whatever the allocator. They let a
 * test prove that a hot path (a training step, a collective) allocates nothing. */
typedef struct ddp_alloc_stats {
  uint64_t allocs; /* successful malloc/calloc/realloc(NULL, n) calls */
  uint64_t frees;  /* free calls on non-NULL pointers */
} ddp_alloc_stats_t;
DDP_API void ddp_alloc_stats(ddp_alloc_stats_t *out);

/* Memory for callers that hand buffers to the library and back (64-byte aligned). */
DDP_API void *ddp_malloc(size_t size);
DDP_API void ddp_free(void *ptr);

/* ---------------------------------------------------------------- environment ----- */

/* Every environment variable libddp reads, in one list (docs/environment.md mirrors it;
 * a test checks the two agree). X(id, name, default, description). */
#define DDP_ENV_MAP(X)                                                                             \
  X(DEBUG, "DDP_DEBUG", "OFF", "Log level: OFF (errors and warnings), INFO or DETAIL.")            \
  X(TORCH_DEBUG, "TORCH_DISTRIBUTED_DEBUG", "OFF",                                                 \
    "Read when DDP_DEBUG is unset; same values, as in PyTorch.")                                   \
  X(BLAS_THREADS, "DDP_BLAS_THREADS", "1",                                                         \
    "OpenBLAS threads per rank; set explicitly at first use of the BLAS wrapper.")                 \
  X(OPENBLAS_CORETYPE, "OPENBLAS_CORETYPE", "",                                                    \
    "OpenBLAS kernel set; when unset libddp replaces a pre-AVX2 fallback by SkylakeX or Haswell.") \
  X(TIMEOUT, "DDP_TIMEOUT", "1800",                                                                \
    "Default collective and rendezvous timeout in seconds (HF's ddp_timeout).")                    \
  X(ALGORITHM, "DDP_ALGORITHM", "auto",                                                            \
    "Collective algorithm: auto (the size table), canonical, ring or small.")                      \
  X(FR_BUFFER_SIZE, "DDP_FR_BUFFER_SIZE", "2000",                                                  \
    "Flight recorder: collectives kept per group; 0 turns it off.")                                \
  X(TORCH_FR_BUFFER_SIZE, "TORCH_NCCL_TRACE_BUFFER_SIZE", "",                                      \
    "Read when DDP_FR_BUFFER_SIZE is unset; the same meaning, as in PyTorch.")                     \
  X(FR_DUMP_DIR, "DDP_FR_DUMP_DIR", "",                                                            \
    "Flight recorder: directory of the dumps (fr_rank_<rank>.json).")                              \
  X(TORCH_FR_DUMP_TEMP_FILE, "TORCH_FR_DUMP_TEMP_FILE", "",                                        \
    "Read when DDP_FR_DUMP_DIR is unset: dump to <value><rank>, as in PyTorch.")                   \
  X(TORCH_NCCL_DEBUG_INFO_TEMP_FILE, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "",                        \
    "Read when both are unset; the older PyTorch name of TORCH_FR_DUMP_TEMP_FILE.")                \
  X(RANK, "RANK", "", "Global rank (torchrun, ddprun).")                                           \
  X(LOCAL_RANK, "LOCAL_RANK", "", "Rank on this host (torchrun, ddprun).")                         \
  X(WORLD_SIZE, "WORLD_SIZE", "", "Number of ranks (torchrun, ddprun).")                           \
  X(LOCAL_WORLD_SIZE, "LOCAL_WORLD_SIZE", "", "Ranks on this host (torchrun, ddprun).")            \
  X(MASTER_ADDR, "MASTER_ADDR", "127.0.0.1", "Host of the TCP store (torchrun, ddprun).")          \
  X(MASTER_PORT, "MASTER_PORT", "29500", "Port of the TCP store (torchrun, ddprun).")              \
  X(JOB_TOKEN, "DDP_JOB_TOKEN", "", "Job token presented on every store and peer connection.")     \
  X(STORE_LISTEN_FD, "DDP_STORE_LISTEN_FD", "",                                                    \
    "ddprun: the store's listening socket it reserved, inherited by global rank 0.")               \
  X(USE_AGENT_STORE, "TORCHELASTIC_USE_AGENT_STORE", "",                                           \
    "True: the launcher serves the store (torchrun's agent, ddprun); rank 0 connects to it.")      \
  X(RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT", "0",                                              \
    "Restarts of the worker group so far (torchrun, ddprun); ddp_train resumes when > 0.")         \
  X(SOCKET_IFNAME, "DDP_SOCKET_IFNAME", "",                                                        \
    "tcp backend: interfaces (comma-separated) whose address a rank publishes to its peers.")      \
  X(GLOO_SOCKET_IFNAME, "GLOO_SOCKET_IFNAME", "",                                                  \
    "Read when DDP_SOCKET_IFNAME is unset; the same meaning, as in PyTorch's gloo.")               \
  X(BACKEND, "DDP_BACKEND", "",                                                                    \
    "Backend for ddp_pg_create_from_env: threads, shm, tcp, gloo, mpi, nccl.")                     \
  X(OMPI_RANK, "OMPI_COMM_WORLD_RANK", "", "Rank under Open MPI's mpirun.")                        \
  X(OMPI_SIZE, "OMPI_COMM_WORLD_SIZE", "", "World size under Open MPI's mpirun.")                  \
  X(OMPI_LOCAL_RANK, "OMPI_COMM_WORLD_LOCAL_RANK", "", "Local rank under Open MPI.")               \
  X(SLURM_PROCID, "SLURM_PROCID", "", "Rank under Slurm's srun.")                                  \
  X(SLURM_NTASKS, "SLURM_NTASKS", "", "World size under Slurm's srun.")                            \
  X(SLURM_LOCALID, "SLURM_LOCALID", "", "Local rank under Slurm's srun.")                          \
  X(TRAIN_SAVE_PAUSE_MS, "DDP_TRAIN_SAVE_PAUSE_MS", "0",                                           \
    "Test hook: ddp_train sleeps this long between a checkpoint's files.")                         \
  X(FAULT, "DDP_FAULT", "",                                                                        \
    "Fault injection: rank=R,step=S|collective=K,kind=crash|hang|slow:MS|... (docs/errors.md).")

typedef enum ddp_env_id {
/* The list expands to enumerators, which clang-format cannot see. */
/* clang-format off */
#define DDP_ENV_ENUM_(id, name, def, doc) DDP_ENV_##id,
  DDP_ENV_MAP(DDP_ENV_ENUM_)
#undef DDP_ENV_ENUM_
  DDP_ENV_COUNT_
  /* clang-format on */
} ddp_env_id_t;

/* The variable's value, or its default when unset or empty (never NULL). */
DDP_API const char *ddp_env_get(ddp_env_id_t id);
/* True when the variable is set to a non-empty value. */
DDP_API bool ddp_env_is_set(ddp_env_id_t id);
/* Parses the value (or default) as an integer in [lo, hi]. A malformed or out-of-range value
 * is DDP_ERR_INVALID_ARGUMENT with a message naming the variable, its value and the range. */
DDP_API ddp_status_t ddp_env_int(ddp_env_id_t id, int64_t lo, int64_t hi, int64_t *out,
                                 ddp_error_t *err);
/* Name, default and description, for docs and --help. */
DDP_API const char *ddp_env_name(ddp_env_id_t id);
DDP_API const char *ddp_env_default(ddp_env_id_t id);
DDP_API const char *ddp_env_doc(ddp_env_id_t id);

/* ---------------------------------------------------------------- fault injection - */

/* Faults rehearsed on purpose (docs/errors.md, "Fault injection"): one rank misbehaves at
 * one optimizer step of ddp_train or at one collective of its process group. */
typedef enum ddp_fault_kind {
  DDP_FAULT_NONE = 0,
  DDP_FAULT_CRASH = 1,         /* process ranks: SIGKILL to itself; threads: the rank fails
                                * with DDP_ERR_ABORTED and aborts its group */
  DDP_FAULT_HANG = 2,          /* stops entering collectives (until its group fails, or for
                                * the group's timeout plus 1 s, then fails) */
  DDP_FAULT_SLOW = 3,          /* sleeps slow_ms before the step's first collective (or
                                * before collective K) */
  DDP_FAULT_SKIP_BACKWARD = 4, /* ddp_train only: forward without backward at the step */
  DDP_FAULT_WRONG_SHAPE = 5,   /* the next collective with a count > 0 has count - 1 */
  DDP_FAULT_CORRUPT_BUCKET = 6 /* bits flipped in the next floating-point allreduce's input
                                * (before) or, with :after, in the rank's reduced gradients */
} ddp_fault_kind_t;

typedef struct ddp_fault {
  ddp_fault_kind_t kind; /* NONE: no fault */
  int rank;              /* the culprit */
  int64_t step;          /* optimizer step (0-based, ddp_train), or -1 */
  int64_t collective;    /* collective sequence number (#K in messages), or -1 */
  int64_t slow_ms;       /* DDP_FAULT_SLOW */
  bool after;            /* DDP_FAULT_CORRUPT_BUCKET:after */
} ddp_fault_t;

/* Parses "rank=R,step=S,kind=K" (or collective=K instead of step; fields in any order,
 * spaces allowed; kinds crash, hang, slow:MS, skip_backward, wrong_shape,
 * corrupt_bucket[:before|:after]). "" is no fault. DDP_ERR_INVALID_ARGUMENT names the field
 * and the accepted values ("DDP_FAULT field 'kind': ..."). */
DDP_API ddp_status_t ddp_fault_parse(const char *spec, ddp_fault_t *out, ddp_error_t *err);
/* ddp_fault_parse of DDP_FAULT (no fault when unset). */
DDP_API ddp_status_t ddp_fault_from_env(ddp_fault_t *out, ddp_error_t *err);
/* "crash", "hang", "slow", ... ("none"). */
DDP_API const char *ddp_fault_kind_name(ddp_fault_kind_t k);

/* ---------------------------------------------------------------- clock ----------- */

/* CLOCK_MONOTONIC in nanoseconds. */
DDP_API int64_t ddp_now_ns(void);
/* now + ms, saturating; ms < 0 means "no deadline" (INT64_MAX). */
DDP_API int64_t ddp_deadline_after_ms(int64_t ms);
/* The same from a moment already read (now_ns from ddp_now_ns()). */
DDP_API int64_t ddp_deadline_from(int64_t now_ns, int64_t ms);
/* Milliseconds left until deadline, clamped to [0, INT32_MAX] (for poll()). */
DDP_API int ddp_ms_until(int64_t deadline_ns);

/* ---------------------------------------------------------------- RNG ------------- */

/* Philox4x32-10 (Salmon et al., SC'11): a counter-based generator. Output block i of a
 * stream is a pure function of (seed, stream, i), so draws do not depend on thread timing
 * or on which rank asks first (determinism contract D4). Use one stream per purpose, e.g.
 * ddp_rng_stream(DDP_RNG_DROPOUT, rank, step). */
typedef struct ddp_rng {
  uint64_t seed;
  uint64_t stream;
  uint64_t counter; /* next 128-bit block to generate */
  uint32_t buf[4];  /* current block */
  int used;         /* words of buf consumed; 4 = empty */
  int has_spare;    /* Box-Muller keeps its second normal */
  float spare;
} ddp_rng_t;

typedef enum ddp_rng_purpose {
  DDP_RNG_INIT = 1,
  DDP_RNG_SHUFFLE = 2,
  DDP_RNG_DROPOUT = 3,
  DDP_RNG_POWERSGD = 4,
  DDP_RNG_DATA = 5,
  DDP_RNG_TEST = 6,
  DDP_RNG_SAMPLE = 7 /* ddp_generate's top-k draws */
} ddp_rng_purpose_t;

/* Packs (purpose, rank, step) into one stream id: 8 bits purpose, 24 bits rank, 32 step. */
DDP_API uint64_t ddp_rng_stream(ddp_rng_purpose_t purpose, uint32_t rank, uint64_t step);
/* The raw block function: out = Philox4x32-10(key = seed, counter = (ctr, stream)). */
DDP_API void ddp_philox4x32_10(uint64_t seed, uint64_t stream, uint64_t ctr, uint32_t out[4]);
DDP_API void ddp_rng_init(ddp_rng_t *r, uint64_t seed, uint64_t stream);
/* Positions the stream at block `counter` (discarding buffered words). */
DDP_API void ddp_rng_seek(ddp_rng_t *r, uint64_t counter);
DDP_API uint32_t ddp_rng_u32(ddp_rng_t *r);
/* Uniform float in [0, 1): 24 random bits times 2^-24. */
DDP_API float ddp_rng_uniform(ddp_rng_t *r);
/* Uniform double in [0, 1): 53 random bits. */
DDP_API double ddp_rng_uniform_f64(ddp_rng_t *r);
/* Standard normal (Box-Muller on two uniforms in (0, 1]). */
DDP_API float ddp_rng_normal(ddp_rng_t *r);

/* ---------------------------------------------------------------- fp16 / bf16 ----- */

/* IEEE binary16 and bfloat16 stored as raw bits. Narrowing rounds to nearest, ties to even;
 * NaN stays NaN (quiet, sign and top payload bits kept), ±Inf and signed zero are exact,
 * subnormals are produced and consumed exactly. Widening is exact. */
typedef uint16_t ddp_f16_t;
typedef uint16_t ddp_bf16_t;

DDP_API ddp_f16_t ddp_f32_to_f16(float f);
DDP_API float ddp_f16_to_f32(ddp_f16_t h);
DDP_API ddp_bf16_t ddp_f32_to_bf16(float f);
DDP_API float ddp_bf16_to_f32(ddp_bf16_t h);
/* The same over n elements, with the same bits for every element (F16C where the CPU has
 * it). src and dst must not overlap. */
DDP_API void ddp_f32_to_f16_n(const float *src, ddp_f16_t *dst, size_t n);
DDP_API void ddp_f16_to_f32_n(const ddp_f16_t *src, float *dst, size_t n);
DDP_API void ddp_f32_to_bf16_n(const float *src, ddp_bf16_t *dst, size_t n);
DDP_API void ddp_bf16_to_f32_n(const ddp_bf16_t *src, float *dst, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* DDP_COMMON_H */
