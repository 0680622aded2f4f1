/* libddp hooks layer: the built-in DDP communication hooks (spec/ddp-semantics.md §7) and
 * Accelerate's comm_hook / comm_wrapper / comm_state_option configuration.
 *
 * Every hook has the reducer's signature (ddp_comm_hook_fn). ddp_hooks_create builds one
 * from Accelerate's names and the caller registers it with ddp_ddp_register_comm_hook
 * (ddp/reducer.h, the layer above; this header includes nothing of it):
 *
 *     ddp_comm_hook_t hook;
 *     ddp_error_t err;
 *     if (ddp_hooks_create("power_sgd", "fp16", "{\"matrix_approximation_rank\": 4}", rank,
 *                          &hook, &err) == DDP_OK && hook.fn &&
 *         ddp_ddp_register_comm_hook(ddp, &hook, &err) != DDP_OK)
 *       hook.free_state(hook.state); // not registered: still the caller's
 *
 * The maths follow PyTorch's hooks operation by operation (docs/hooks.md): the allreduce
 * hook divides by W and then sums; the fp16/bf16 hooks cast, divide in low precision and
 * sum in low precision (the group's canonical fold adds in fp32 and rounds after every
 * addition, D2), then widen; PowerSGD keeps error feedback and warm-start P/Q memories per
 * bucket and issues exactly 3 allreduces per bucket (1 during warm-up). Not thread-safe: a
 * hook state belongs to one DDP handle. */
#ifndef DDP_HOOKS_H
#define DDP_HOOKS_H

#include "ddp/nn.h"
#include "ddp/pg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- interface ------- */

/* A communication hook replaces a bucket's built-in allreduce (spec §7.1). The reducer
 * (ddp/reducer.h, above this header) knows nothing about specific hooks: it calls the registered
 * function once per bucket, in bucket order, when the bucket is ready, and at finalize
 * resolves the returned work, in bucket order, to a buffer of the bucket's element count,
 * which it converts to the gradient dtype and copies into the gradients. With a hook the
 * reducer does not divide by the world size: the hook does. Hooks are not called during
 * no_sync steps; under join() a joined rank calls the hook with zero-filled buckets. */

/* What a hook sees: PyTorch's GradBucket. Owned by the reducer, valid until the bucket's
 * work has been resolved. buffer() holds the undivided local gradients; set_buffer
 * replaces what buffer() returns (the element count stays). */
typedef struct ddp_grad_bucket {
  size_t index; /* 0-based position in the reduction order */
  bool is_last; /* index == number of buckets - 1 */
  void *buffer; /* buffer(): numel elements of dtype */
  size_t numel;
  ddp_dtype_t dtype;
  size_t nparams;
  ddp_param_t *const *params; /* parameters(), in bucket order */
  const size_t *offsets;      /* element offset of parameter k's gradient in buffer */
} ddp_grad_bucket_t;

/* set_buffer(t): data (borrowed; it must live until the work resolves) becomes buffer(). */
DDP_API void ddp_grad_bucket_set_buffer(ddp_grad_bucket_t *b, void *data, ddp_dtype_t dt);
/* gradients()[k]: a view of params[k]->value.numel elements into the current buffer(),
 * with the parameter's shape (params[k]->value.shape). */
DDP_API void *ddp_grad_bucket_gradient(const ddp_grad_bucket_t *b, size_t k);

/* The future a hook returns: a set of pending collectives, an optional continuation that
 * runs once they have all completed (it may launch more collectives and set a new
 * continuation), and the buffer the future resolves to. Collectives launched from a
 * continuation run when the reducer resolves the work, in bucket order, identically on
 * every rank. Not thread-safe; one owner. */
typedef struct ddp_comm_work ddp_comm_work_t;
typedef ddp_status_t (*ddp_comm_then_fn)(void *user, ddp_comm_work_t *w);

DDP_API ddp_status_t ddp_comm_work_create(ddp_comm_work_t **out);
/* Adds a pending collective; the comm work owns it from here (also on failure). */
DDP_API ddp_status_t ddp_comm_work_add(ddp_comm_work_t *w, ddp_work_t *work);
/* The continuation; replaces the previous one. */
DDP_API void ddp_comm_work_then(ddp_comm_work_t *w, ddp_comm_then_fn fn, void *user);
/* The result (borrowed): count elements of dt at data. */
DDP_API void ddp_comm_work_set_result(ddp_comm_work_t *w, void *data, size_t count, ddp_dtype_t dt);
/* Called with user by ddp_comm_work_free (to release the hook's per-call memory). */
DDP_API void ddp_comm_work_on_free(ddp_comm_work_t *w, void (*fn)(void *), void *user);
/* Records a failure message for a continuation that fails (returned by _error). */
DDP_API void ddp_comm_work_set_error(ddp_comm_work_t *w, const char *msg);
/* Waits for the collectives (each bounded by its group's timeout), runs continuations
 * until none is left, and returns the result. The first failure is returned. */
DDP_API ddp_status_t ddp_comm_work_wait(ddp_comm_work_t *w, const void **data, size_t *count,
                                        ddp_dtype_t *dt);
DDP_API const char *ddp_comm_work_error(const ddp_comm_work_t *w);
/* Waits for anything still in flight, calls on_free, frees. NULL is a no-op. */
DDP_API void ddp_comm_work_free(ddp_comm_work_t *w);

/* hook(state, pg, bucket) -> work. A status other than DDP_OK fails the backward. */
typedef ddp_status_t (*ddp_comm_hook_fn)(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                         ddp_comm_work_t **out);

/* Communication statistics a hook reports (cumulative numel over all synchronised steps,
 * payload bytes handed to collectives by the last step on this rank). */
typedef struct ddp_comm_hook_stats {
  int64_t numel_before; /* elements that would have been all-reduced without compression */
  int64_t numel_after;  /* elements actually all-reduced instead */
  int64_t bytes_last_step;
} ddp_comm_hook_stats_t;

typedef struct ddp_comm_hook {
  ddp_comm_hook_fn fn;
  void *state;
  const char *name;                                       /* copied; logging's comm_hook */
  void (*stats)(void *state, ddp_comm_hook_stats_t *out); /* NULL: none */
  void (*free_state)(void *state); /* non-NULL: the DDP handle owns state once registered */
  /* A hook whose state carries over from step to step (PowerSGD's error feedback and
   * warm-start factors) saves and restores it through these, so that a checkpoint can hold
   * any hook's state without knowing the hook; NULL for a hook with nothing to keep.
   * save_state writes this rank's state to path (atomically); load_state replaces the state
   * with one saved by save_state, so that the hook continues bit for bit, and leaves it
   * unchanged on failure (a missing file is DDP_ERR_NOT_FOUND). */
  ddp_status_t (*save_state)(void *state, const char *path, ddp_error_t *err);
  ddp_status_t (*load_state)(void *state, const char *path, ddp_error_t *err);
} ddp_comm_hook_t;

/* ---------------------------------------------------------------- built-in hooks -- */

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
DDP_API ddp_status_t ddp_fp16_compress_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                            ddp_comm_work_t **out);
DDP_API ddp_status_t ddp_bf16_compress_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                            ddp_comm_work_t **out);

/* fp16_compress_wrapper(hook) / bf16_compress_wrapper(hook): set_buffer(cast(buffer)), run
 * the inner hook on the low-precision bucket, copy its result (cast to the low dtype) into
 * that low-precision buffer and resolve to it; the reducer widens it. state is a
 * ddp_compress_wrapper_t, borrowed for as long as the hook is registered. */
typedef struct ddp_compress_wrapper {
  ddp_dtype_t dtype; /* DDP_F16 or DDP_BF16 */
  ddp_comm_hook_fn inner;
  void *inner_state;
} ddp_compress_wrapper_t;
DDP_API ddp_status_t ddp_compress_wrapper_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                               ddp_comm_work_t **out);

/* ---------------------------------------------------------------- PowerSGD -------- */

/* PowerSGDState's keyword arguments with PyTorch's defaults. */
typedef struct ddp_powersgd_options {
  size_t struct_size;
  int64_t matrix_approximation_rank;           /* 1 */
  int64_t start_powerSGD_iter;                 /* 1000 */
  double min_compression_rate;                 /* 2 */
  bool use_error_feedback;                     /* true */
  bool warm_start;                             /* true */
  double orthogonalization_epsilon;            /* 0 */
  uint64_t random_seed;                        /* 0 */
  int64_t compression_stats_logging_frequency; /* 10000 (values < 1 mean 1) */
  bool batch_tensors_with_same_shape;          /* false */
  /* Not in PyTorch: when set, replaces the random start of Q (for parity runs that inject
   * PyTorch's Q). Called with the draw number k (0, 1, ...: one per random initialisation,
   * see docs/hooks.md) and the n values of every Q of the bucket, in layout order, each
   * row-major m x r; it fills them. NULL: the counter-based generator. */
  void (*init_q)(void *user, uint64_t draw, size_t bucket_index, float *q, size_t n);
  void *init_q_user;
} ddp_powersgd_options_t;

#define DDP_POWERSGD_OPTIONS_INIT \
  { sizeof(ddp_powersgd_options_t), 1, 1000, 2.0, true, true, 0.0, 0, 10000, false, NULL, NULL }

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
 * state that ddp_hooks_create built from names (ddp_hooks_powersgd); NULL returns to the generator.
 * Takes effect from the next random initialisation. */
DDP_API void ddp_powersgd_set_init_q(ddp_powersgd_state_t *s,
                                     void (*init_q)(void *user, uint64_t draw, size_t bucket_index,
                                                    float *q, size_t n),
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
DDP_API ddp_status_t ddp_batched_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *bucket,
                                               ddp_comm_work_t **out);

/* ---------------------------------------------------------------- configuration --- */

/* Accelerate's DistributedDataParallelKwargs comm fields. comm_hook is one of no, fp16,
 * bf16, power_sgd, batched_power_sgd, or allreduce (PyTorch's allreduce_hook, which
 * Accelerate does not name: the numbers of no hook, but a wrapper can go around it);
 * comm_wrapper one of no, fp16, bf16 (NULL = "no");
 * comm_state_option a JSON object of PowerSGDState keys (NULL or "" = {}). Unlike
 * Accelerate, unknown names, unknown keys, values of the wrong type or range, a wrapper
 * without a hook, and state options for a hook that takes none are errors
 * (DDP_ERR_INVALID_ARGUMENT) whose message lists the valid choices; they are returned in
 * err, not logged: the caller reports them (as ddp-train does its other arguments). */
DDP_API ddp_status_t ddp_hooks_validate(const char *comm_hook, const char *comm_wrapper,
                                        const char *comm_state_option, ddp_error_t *err);

/* The hook those names choose (after ddp_hooks_validate's checks), with its state: the
 * built-in hook behind the optional wrapper, the stats callback, free_state, and for the
 * PowerSGD hooks save_state / load_state (ddp_powersgd_state_save / _load). rank only
 * prefixes log lines. comm_hook "no" (or NULL, "") fills *out with zeros (out->fn NULL):
 * there is nothing to register. Otherwise the caller registers *out with
 * ddp_ddp_register_comm_hook, which owns out->state from then on; a hook that is not
 * registered (or whose registration failed) is released with out->free_state(out->state).
 * out->name points into the state. On failure *out is zeros and nothing is allocated. */
DDP_API ddp_status_t ddp_hooks_create(const char *comm_hook, const char *comm_wrapper,
                                      const char *comm_state_option, int rank, ddp_comm_hook_t *out,
                                      ddp_error_t *err);

/* The PowerSGD state of a hook that ddp_hooks_create made for comm_hook power_sgd or
 * batched_power_sgd (for ddp_powersgd_set_init_q and the counters); NULL for any other hook.
 * It lives as long as hook->state. */
DDP_API ddp_powersgd_state_t *ddp_hooks_powersgd(const ddp_comm_hook_t *hook);

#ifdef __cplusplus
}
#endif
#endif /* DDP_HOOKS_H */
