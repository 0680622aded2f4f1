/* libddp hooks layer: the built-in DDP communication hooks (spec/ddp-semantics.md §7) and
 * Accelerate's comm_hook / comm_wrapper / comm_state_option configuration.
 *
 * Every hook has the reducer's signature (ddp_comm_hook_fn) and is registered with
 * ddp_ddp_register_comm_hook, or all at once with ddp_hooks_configure:
 *
 *     ddp_error_t err;
 *     ddp_hooks_configure(ddp, "power_sgd", "fp16", "{\"matrix_approximation_rank\": 4}", &err);
 *
 * The maths follow PyTorch's hooks operation by operation (docs/hooks.md): the allreduce
 * hook divides by W and then sums; the fp16/bf16 hooks cast, divide in low precision and
 * sum in low precision (the group's canonical fold adds in fp32 and rounds after every
 * addition, D2), then widen; PowerSGD keeps error feedback and warm-start P/Q memories per
 * bucket and issues exactly 3 allreduces per bucket (1 during warm-up). Not thread-safe: a
 * hook state belongs to one DDP handle. */
#ifndef DDP_HOOKS_H
#define DDP_HOOKS_H

#include "ddp/reducer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Byte and element counters the simple hooks keep when their state points at one (state
 * may be NULL, as in PyTorch). bytes_step is reset by bucket 0 of every step. */
typedef struct ddp_hook_counters {
  int64_t numel_before;
  int64_t numel_after;
  int64_t bytes_step;
} ddp_hook_counters_t;

/* The stats callback for a ddp_hook_counters_t state (ddp_comm_hook_t.stats). */
DDP_API void ddp_hook_counters_stats(void *state, ddp_comm_hook_stats_t *out);

/* allreduce_hook: buffer /= W (true division in the buffer's dtype), then allreduce SUM in
 * place; resolves to buffer(). state: NULL or a ddp_hook_counters_t. */
DDP_API ddp_status_t ddp_allreduce_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                        ddp_comm_work_t **out);
/* fp16_compress_hook / bf16_compress_hook: c = cast(buffer); c /= W in the low dtype;
 * allreduce SUM of c in the low dtype; buffer = widen(c); resolves to buffer(). */
DDP_API ddp_status_t ddp_fp16_compress_hook(void *state, ddp_pg_t *pg,
                                            ddp_grad_bucket_t *bucket, ddp_comm_work_t **out);
DDP_API ddp_status_t ddp_bf16_compress_hook(void *state, ddp_pg_t *pg,
                                            ddp_grad_bucket_t *bucket, ddp_comm_work_t **out);

/* fp16_compress_wrapper(hook) / bf16_compress_wrapper(hook): set_buffer(cast(buffer)), run
 * the inner hook on the low-precision bucket, copy its result (cast to the low dtype) into
 * that low-precision buffer and resolve to it; the reducer widens it. state is a
 * ddp_compress_wrapper_t, borrowed for as long as the hook is registered. */
typedef struct ddp_compress_wrapper {
  ddp_dtype_t dtype; /* DDP_F16 or DDP_BF16 */
  ddp_comm_hook_fn inner;
  void *inner_state;
} ddp_compress_wrapper_t;
DDP_API ddp_status_t ddp_compress_wrapper_hook(void *state, ddp_pg_t *pg,
                                               ddp_grad_bucket_t *bucket, ddp_comm_work_t **out);

/* ---------------------------------------------------------------- PowerSGD -------- */

/* PowerSGDState's keyword arguments with PyTorch's defaults. */
typedef struct ddp_powersgd_options {
  size_t struct_size;
  int64_t matrix_approximation_rank;   /* 1 */
  int64_t start_powerSGD_iter;         /* 1000 */
  double min_compression_rate;         /* 2 */
  bool use_error_feedback;             /* true */
  bool warm_start;                     /* true */
  double orthogonalization_epsilon;    /* 0 */
  uint64_t random_seed;                /* 0 */
  int64_t compression_stats_logging_frequency; /* 10000 (values < 1 mean 1) */
  bool batch_tensors_with_same_shape;  /* false */
  /* Not in PyTorch: when set, replaces the random start of Q (for parity runs that inject
   * PyTorch's Q). Called with the draw number k (0, 1, ...: one per random initialisation,
   * see docs/hooks.md) and the n values of every Q of the bucket, in layout order, each
   * row-major m x r; it fills them. NULL: the counter-based generator. */
  void (*init_q)(void *user, uint64_t draw, size_t bucket_index, float *q, size_t n);
  void *init_q_user;
} ddp_powersgd_options_t;

#define DDP_POWERSGD_OPTIONS_INIT \
  {sizeof(ddp_powersgd_options_t), 1, 1000, 2.0, true, true, 0.0, 0, 10000, false, NULL, NULL}

typedef struct ddp_powersgd_state ddp_powersgd_state_t;

/* PowerSGDState(...). Fails (DDP_ERR_INVALID_ARGUMENT, PyTorch's ValueError text) when
 * error feedback or warm start is on and start_powerSGD_iter <= 1, or when the rank is < 1.
 * rank is only used to prefix log lines. */
DDP_API ddp_status_t ddp_powersgd_state_create(const ddp_powersgd_options_t *opts, int rank,
                                               ddp_powersgd_state_t **out, ddp_error_t *err);
DDP_API void ddp_powersgd_state_destroy(ddp_powersgd_state_t *s);
/* The synchronised backward passes counted so far (PowerSGDState.iter). */
DDP_API int64_t ddp_powersgd_iter(const ddp_powersgd_state_t *s);
/* Allreduces issued by the hooks on this state since it was created. */
DDP_API int64_t ddp_powersgd_num_allreduces(const ddp_powersgd_state_t *s);
/* Random Q initialisations made so far: the draw number the next one gets (restored by
 * ddp_powersgd_state_load). */
DDP_API uint64_t ddp_powersgd_draws(const ddp_powersgd_state_t *s);
/* Replaces the init_q callback (and its user pointer) the state was created with, for a
 * state that ddp_hooks_configure_state built from names; NULL returns to the generator.
 * Takes effect from the next random initialisation. */
DDP_API void ddp_powersgd_set_init_q(ddp_powersgd_state_t *s,
                                     void (*init_q)(void *user, uint64_t draw,
                                                    size_t bucket_index, float *q, size_t n),
                                     void *init_q_user);
/* The stats callback: total_numel_before/after_compression and the last step's bytes. */
DDP_API void ddp_powersgd_stats(void *state, ddp_comm_hook_stats_t *out);

/* The state's rank-local contents (iteration count, random draws so far, compression
 * counters, and per bucket the error feedback and the warm-start P/Q memories) to a
 * safetensors file, written atomically (ddp_st_write): tensors "bucket.<b>.error",
 * "bucket.<b>.p", "bucket.<b>.q" (f32, present when they exist), counters and the shaping
 * options in the metadata (format "libddp-powersgd-1"). Error feedback differs per rank:
 * each rank saves its own. */
DDP_API ddp_status_t ddp_powersgd_state_save(const ddp_powersgd_state_t *s, const char *path,
                                             ddp_error_t *err);
/* Replaces s's contents with a saved state, so that the hooks continue bit for bit as the
 * saved state would have. The state must have been created with the same
 * matrix_approximation_rank, start_powerSGD_iter, random_seed, use_error_feedback and
 * warm_start (else DDP_ERR_INVALID_ARGUMENT naming both); a missing file is
 * DDP_ERR_NOT_FOUND, a malformed one DDP_ERR_INVALID_DATA. On failure s is unchanged. */
DDP_API ddp_status_t ddp_powersgd_state_load(ddp_powersgd_state_t *s, const char *path,
                                             ddp_error_t *err);

/* powerSGD_hook(state, bucket), spec §7.6. Buckets of f32, f16 and bf16 (inside a
 * wrapper); the low-rank factors are computed in f32. Resolves to an f32 buffer. */
DDP_API ddp_status_t ddp_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                       ddp_comm_work_t **out);
/* batched_powerSGD_hook(state, bucket), spec §7.7: the whole bucket padded to s x s,
 * s = ceil(sqrt(numel)); 2 allreduces per bucket. */
DDP_API ddp_status_t ddp_batched_powersgd_hook(void *state, ddp_pg_t *pg,
                                               ddp_grad_bucket_t *bucket,
                                               ddp_comm_work_t **out);

/* ---------------------------------------------------------------- configuration --- */

/* Accelerate's DistributedDataParallelKwargs comm fields. comm_hook is one of no, fp16,
 * bf16, power_sgd, batched_power_sgd, or allreduce (PyTorch's allreduce_hook, which
 * Accelerate does not name: the numbers of no hook, but a wrapper can go around it);
 * comm_wrapper one of no, fp16, bf16 (NULL = "no");
 * comm_state_option a JSON object of PowerSGDState keys (NULL or "" = {}). Unlike
 * Accelerate, unknown names, unknown keys, values of the wrong type or range, a wrapper
 * without a hook, and state options for a hook that takes none are errors
 * (DDP_ERR_INVALID_ARGUMENT) whose message lists the valid choices. */
DDP_API ddp_status_t ddp_hooks_validate(const char *comm_hook, const char *comm_wrapper,
                                        const char *comm_state_option, ddp_error_t *err);
/* Validates, builds the hook and its state, and registers it on ddp (which then owns the
 * state). comm_hook "no" registers nothing. */
DDP_API ddp_status_t ddp_hooks_configure(ddp_ddp_t *ddp, const char *comm_hook,
                                         const char *comm_wrapper,
                                         const char *comm_state_option, ddp_error_t *err);

/* ddp_hooks_configure that also hands back the PowerSGD state it registered (NULL for a
 * hook without one, or comm_hook "no"), for ddp_powersgd_state_save/load. The state is
 * owned by ddp and lives as long as it. */
DDP_API ddp_status_t ddp_hooks_configure_state(ddp_ddp_t *ddp, const char *comm_hook,
                                               const char *comm_wrapper,
                                               const char *comm_state_option,
                                               ddp_powersgd_state_t **psgd, ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_HOOKS_H */
