/* libddp reducer layer: DistributedDataParallel over a model and a process group.
 *
 * A ddp_ddp_t wraps one rank's replica of a model (ddp_model_t) and a process group, and
 * reproduces PyTorch's DistributedDataParallel (docs/ddp.md, spec/ddp-semantics.md §0-6,
 * 9.2, 10, 12): the construction-time shape check and broadcast from rank 0, gradient buckets
 * (compute_bucket_assignment_by_size, one bucket in iteration 1, one rebuild from the ready
 * order with rank 0's layout), bucket allreduces launched strictly in index order from the
 * gradient-ready hooks while backward still runs, averaging by a pre-multiply with fl(1/W),
 * the end-of-backward finalize, no_sync, broadcast_buffers, find_unused_parameters,
 * static_graph, gradient_as_bucket_view, join() for uneven inputs, get_ddp_logging_data's
 * statistics and a Chrome-trace timeline.
 *
 * (The wrapper is ddp_ddp_create rather than PyTorch-like "ddp_model_create" because the
 * nn layer already names its model constructor that.)
 *
 * A training step:
 *     ddp_ddp_forward(ddp, ctx, x, flags, &y);     // or pre_forward + own forward + post_forward
 *     ... loss from y ...
 *     ddp_ddp_backward(ddp, ctx, loss);            // buckets reduce while backward runs
 *     ddp_optim_step(...); ddp_optim_zero_grad(...); ddp_ctx_reset(ctx);
 *
 * Errors PyTorch raises (shape check, "Expected to have finished reduction in the prior
 * iteration ...", "Expected to mark a variable ready only once ...") come back as statuses
 * from the same call as in PyTorch, with PyTorch's text in ddp_ddp_last_error_copy(), extended
 * with the parameter names and the rank. Not thread-safe: one thread drives one handle. */
#ifndef DDP_REDUCER_H
#define DDP_REDUCER_H

#include "ddp/hooks.h"
#include "ddp/nn.h"
#include "ddp/pg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- bucket assignment */

/* The result of compute_bucket_assignment_by_size: bucket b holds the tensor indices
 * indices[offsets[b] .. offsets[b+1]) in the order they were added, and was built under
 * limits[b] bytes (SIZE_MAX = no limit). Free with ddp_bucket_assignment_free. */
typedef struct ddp_bucket_assignment {
  size_t nbuckets;
  size_t *offsets; /* nbuckets + 1 */
  size_t *indices; /* offsets[nbuckets] entries */
  size_t *limits;  /* nbuckets */
} ddp_bucket_assignment_t;

/* PyTorch's compute_bucket_assignment_by_size (spec §2.1), a pure function. Tensor i has
 * bytes[i] bytes and group key keys[i] (its dtype; one accumulator per key);
 * expect_sparse (NULL = none) makes a tensor a bucket of its own with no limit. Each key
 * closes its bucket when the accumulated bytes reach its current limit, then moves on to
 * the next limit (the last one repeats). order (NULL = 0..n-1) is the visiting order; when
 * it is NULL the buckets are sorted by their smallest index, else kept in production
 * order. Trailing partial buckets follow in the order their keys were first seen. */
DDP_API ddp_status_t ddp_compute_bucket_assignment_by_size(
    size_t n, const size_t *bytes, const int *keys, const bool *expect_sparse, const size_t *limits,
    size_t nlimits, const size_t *order, ddp_bucket_assignment_t *out);
DDP_API void ddp_bucket_assignment_free(ddp_bucket_assignment_t *a);

/* ---------------------------------------------------------------- options --------- */

/* bucket_cap_mb left at this value means PyTorch's None: 25 MiB buckets with a 1 MiB first
 * bucket. An explicit value sets both caps (newer PyTorch; docs/ddp.md). */
#define DDP_BUCKET_CAP_UNSET (-1.0)
/* PyTorch's broadcast_bucket_size and default caps. */
#define DDP_BROADCAST_BUCKET_BYTES ((size_t)250 * 1024 * 1024)
#define DDP_DEFAULT_BUCKET_CAP_MB 25.0
#define DDP_DEFAULT_FIRST_BUCKET_BYTES ((int64_t)1024 * 1024)

typedef struct ddp_ddp_options {
  size_t struct_size;           /* sizeof(ddp_ddp_options_t) */
  bool broadcast_buffers;       /* true: buffers from rank 0 before each synced forward */
  double bucket_cap_mb;         /* DDP_BUCKET_CAP_UNSET = 25 with a 1 MiB first bucket */
  int64_t first_bucket_bytes;   /* < 0: 1 MiB when bucket_cap_mb is unset, else the cap */
  bool find_unused_parameters;  /* false */
  bool gradient_as_bucket_view; /* false */
  bool static_graph;            /* false */
  bool init_sync;               /* true: shape check and broadcast at create */
  /* Chrome trace (chrome://tracing, Perfetto): when non-NULL, every rank records forward,
   * backward, each bucket's allreduce and the finalize, and appends them to this file at
   * destroy (rank 0 truncates it at create; one process per rank, pid = rank). The
   * string is copied. */
  const char *trace_path;
  /* Chunk size of the parameter and buffer broadcasts; 0 = 250 MiB (PyTorch's
   * broadcast_bucket_size). */
  size_t broadcast_bucket_bytes;
  /* World-size-invariant mode (docs/ddp.md): K > 0 virtual shards per synchronised step
   * over all ranks (W must divide K). Each rank then runs K / W forward/backward passes
   * per step, one per shard, the last one synchronising (the others under no_sync); each
   * shard's gradients are kept apart and the K shard gradients are summed with the
   * pre-rounded reproducible sum (ddp_rsum_* in ddp/tensor.h) and divided by K, so the
   * averaged gradients are the same bits for any W and any split of the shards into
   * passes. Comm hooks and join() are refused. 0 = off. */
  int64_t world_size_invariant_shards;
} ddp_ddp_options_t;

#define DDP_DDP_OPTIONS_INIT                                                                       \
  {                                                                                                \
    sizeof(ddp_ddp_options_t), true, DDP_BUCKET_CAP_UNSET, -1, false, false, false, true, NULL, 0, \
        0                                                                                          \
  }

typedef struct ddp_ddp ddp_ddp_t;

/* Wraps a finalized model. Collective on every rank of pg (spec §1.5): allgather of the
 * managed parameter count, broadcast of sizes and strides from rank 0 and the check against
 * them, broadcast of every parameter (frozen ones too) and, with broadcast_buffers, every
 * buffer from rank 0 in coalesced chunks of at most 250 MiB, at most 2 in flight. Both model
 * and pg are borrowed and must outlive the handle; the model's grad-ready hooks belong to
 * the handle until destroy. err (optional) receives the message on failure. */
DDP_API ddp_status_t ddp_ddp_create(ddp_model_t *model, ddp_pg_t *pg, const ddp_ddp_options_t *opts,
                                    ddp_ddp_t **out, ddp_error_t *err);
/* Frees the buckets (waiting for any in flight), restores every gradient to the model's
 * flat gradient buffer (copying values out of bucket views) and removes the hooks. NULL is
 * a no-op. */
DDP_API void ddp_ddp_destroy(ddp_ddp_t *ddp);

/* Copies into *out the error of the last failed call (status DDP_OK and "" if none; up to
 * 8 KiB: PyTorch's texts with parameter lists). The handle is single-owner (one thread at a
 * time), so no lock is needed. A failure the reducer detects is also logged once at ERROR;
 * one carried from the process group (a timeout, a peer that died), logged there, is only
 * recorded here with the reducer's context (which bucket, its parameters). */
DDP_API void ddp_ddp_last_error_copy(const ddp_ddp_t *ddp, ddp_error_t *out);
DDP_API ddp_model_t *ddp_ddp_model(ddp_ddp_t *ddp);

/* ---------------------------------------------------------------- a step ---------- */

/* DDP's _pre_forward (spec §3.2): with grad enabled, checks that the previous reduction
 * finished (PyTorch's "Expected to have finished reduction ..." error), applies a pending
 * bucket rebuild, and, when the previous forward synchronised, broadcasts the buffers from
 * rank 0. ctx is the context the forward and backward will use. */
DDP_API ddp_status_t ddp_ddp_pre_forward(ddp_ddp_t *ddp, ddp_ctx_t *ctx);
/* DDP's _post_forward: with grad enabled and sync on, arms the next backward
 * (prepare_for_backward) and, under find_unused_parameters, searches the graph from the n
 * outputs for unused parameters. Otherwise the next backward communicates nothing. */
DDP_API ddp_status_t ddp_ddp_post_forward(ddp_ddp_t *ddp, ddp_ctx_t *ctx, size_t n,
                                          ddp_var_t *const *outputs);
/* pre_forward, ddp_model_forward(model, ctx, x, flags, y), post_forward. */
DDP_API ddp_status_t ddp_ddp_forward(ddp_ddp_t *ddp, ddp_ctx_t *ctx, ddp_var_t *x, uint64_t flags,
                                     ddp_var_t **y);
/* ddp_backward(ctx, loss), then reports an error a gradient-ready hook met (such as
 * "marked ready twice") or the finalize's. After a synchronised backward every managed
 * gradient holds the average over ranks (globally unused ones are left untouched). */
DDP_API ddp_status_t ddp_ddp_backward(ddp_ddp_t *ddp, ddp_ctx_t *ctx, ddp_var_t *loss);

/* Observes each managed parameter's local gradient in a synchronised backward: fn(user, p)
 * runs when p is marked ready, before its gradient is copied into (or divided in) its
 * bucket, so p->grad holds this rank's own accumulated gradient (data NULL: None, also when
 * no gradient reached p since its last sync and p->grad holds zero_grad's zeros, as
 * PyTorch's tensor hooks see nothing then). A locally unused parameter is observed when the
 * unused set is marked ready. NULL removes
 * the observer. For dumps (ddp_dump_local_grad). */
typedef void (*ddp_local_grad_fn)(void *user, const ddp_param_t *p);
DDP_API void ddp_ddp_set_local_grad_fn(ddp_ddp_t *ddp, ddp_local_grad_fn fn, void *user);

/* no_sync: sets require_backward_grad_sync and returns the previous value. Like PyTorch
 * the decision is taken at forward: a forward run with sync off is followed by a backward
 * that only accumulates locally. with ddp.no_sync(): is
 *     bool old = ddp_ddp_set_sync(ddp, false); ... ; ddp_ddp_set_sync(ddp, old); */
DDP_API bool ddp_ddp_set_sync(ddp_ddp_t *ddp, bool require_backward_grad_sync);

/* join() for uneven inputs (spec §9.2): ddp.join(divide_by_initial_world_size,
 * throw_on_early_termination) as a begin/end pair around the training loop:
 *     ddp_ddp_join_begin(ddp, true, false);
 *     for (each local batch) { forward; backward; step; }
 *     ddp_ddp_join_end(ddp);   // this rank is out of data
 * While join is on, each forward adds the join allreduces; join_end shadows the other
 * ranks' iterations (buffer broadcasts, zero bucket allreduces) until every rank has
 * joined, then broadcasts the last joiner's parameters and buffers to all. With
 * divide_by_initial_world_size=false gradients are averaged over the ranks still training.
 * With throw_on_early_termination every rank fails (DDP_ERR_ABORTED, PyTorch's texts) at
 * the first iteration where one rank is out of data. Not with static_graph. */
DDP_API ddp_status_t ddp_ddp_join_begin(ddp_ddp_t *ddp, bool divide_by_initial_world_size,
                                        bool throw_on_early_termination);
DDP_API ddp_status_t ddp_ddp_join_end(ddp_ddp_t *ddp);

/* ---------------------------------------------------------------- layout, stats --- */

/* The current bucket layout: bucket b holds the managed parameter indices
 * params[0..*n) (reducer indices: managed parameters in registration order, frozen
 * ones left out). Valid until the next forward. */
DDP_API size_t ddp_ddp_num_buckets(const ddp_ddp_t *ddp);
DDP_API const size_t *ddp_ddp_bucket_params(const ddp_ddp_t *ddp, size_t b, size_t *n);
/* The model parameter behind managed index i. */
DDP_API ddp_param_t *ddp_ddp_param(ddp_ddp_t *ddp, size_t i);
DDP_API size_t ddp_ddp_num_params(const ddp_ddp_t *ddp);

/* get_ddp_logging_data (spec §10.1). Arrays point into the handle and stay valid until the
 * next forward. Times are nanoseconds, averaged over the sampled iterations (1-10, then
 * every 100th). */
typedef struct ddp_ddp_logging_data {
  int world_size;
  int rank;
  int64_t iteration; /* synchronised forwards so far (num_iterations) */
  const char *backend_name;
  const char *module_name; /* "ddp_model" */
  size_t num_parameter_tensors;
  int64_t total_parameter_size_bytes;
  const char *dtypes; /* comma-separated, e.g. "F32" */
  bool broadcast_buffers;
  bool find_unused_parameters;
  bool gradient_as_bucket_view;
  bool static_graph;
  int64_t bucket_cap_bytes;
  int64_t first_bucket_bytes;
  /* construction-time layout */
  size_t num_initial_buckets;
  const int64_t *bucket_sizes;               /* bytes per bucket */
  const int64_t *initial_bucket_size_limits; /* INT64_MAX for "no limit" */
  /* rebuild */
  bool has_rebuilt_buckets;
  size_t num_rebuilt_buckets;
  const int64_t *rebuilt_bucket_sizes;
  const int64_t *rebuilt_bucket_size_limits;
  const size_t *rebuilt_per_bucket_param_offsets; /* num_rebuilt_buckets + 1 */
  const size_t *rebuilt_per_bucket_param_indices;
  size_t num_prev_ready_order;
  const size_t *prev_iteration_grad_ready_order_indices;
  /* runtime */
  int64_t unused_parameter_size; /* bytes of parameters unused in the last synced backward */
  int64_t avg_forward_compute_time;
  int64_t avg_backward_compute_time;
  int64_t avg_backward_comm_time;
  int64_t avg_backward_compute_comm_overlap_time;
  int64_t num_runtime_samples;
  const char *comm_hook; /* "" = none (builtin allreduce with pre-divide) */
  bool join_uneven_inputs;
  bool can_set_static_graph; /* find_unused and the unused set never changed */
} ddp_ddp_logging_data_t;

DDP_API void ddp_ddp_get_logging_data(ddp_ddp_t *ddp, ddp_ddp_logging_data_t *out);

/* ---------------------------------------------------------------- comm hooks ------ */

/* The hook interface (GradBucket, the future, ddp_comm_hook_t) is in ddp/hooks.h. */

/* register_comm_hook: once per handle, before the first synchronised forward. Errors
 * (DDP_ERR_INVALID_USAGE): a second call ("register_comm_hook or register_builtin_comm_hook
 * can only be called once."), a call after training started. On failure the caller keeps
 * state. */
DDP_API ddp_status_t ddp_ddp_register_comm_hook(ddp_ddp_t *ddp, const ddp_comm_hook_t *hook,
                                                ddp_error_t *err);

/* Communication statistics: with a hook, what it reports; without, the bucket element
 * counts (no compression) and their bytes. rate = before / after (PyTorch's
 * "compression rate"), 1 without compression. */
typedef struct ddp_ddp_comm_stats {
  int64_t numel_before;
  int64_t numel_after;
  double rate;
  int64_t bytes_last_step; /* payload bytes all-reduced by this rank in the last sync step */
} ddp_ddp_comm_stats_t;
DDP_API void ddp_ddp_get_comm_stats(ddp_ddp_t *ddp, ddp_ddp_comm_stats_t *out);

/* ---------------------------------------------------------------- dumps ----------- */

/* The per-step dump writer (docs/dumps.md, format "libddp-dump-1"): the layout
 * tools/torch/torch_reference.py writes, for tools/ddp-compare. One handle per rank, all ranks
 * writing into the same directory DIR:
 *     ddp_dump_open(DIR, rank, world, &o, &d, &err);   // rank 0 writes DIR/meta.json
 *     ddp_dump_init(d, model, ddp);                   // after ddp_ddp_create: init.safetensors
 *     per step: per micro-batch ddp_dump_input(d, x, y, idx); forward; backward;
 *               ddp_dump_grads(d);                    // averaged grads, before clipping/step
 *               optimizer step;
 *               ddp_dump_step(d, step, loss, micro_batches, flags);  // stepNNNNNN.safetensors
 *     ddp_dump_finish(d);                              // ddp.json; before ddp_ddp_destroy
 *     ddp_dump_close(d);
 * Every file is replaced atomically (a temporary file, fsync, rename). Errors are statuses
 * with the message in ddp_dump_last_error_copy(); a failed call leaves the handle usable. */
typedef struct ddp_dump ddp_dump_t;

typedef struct ddp_dump_options {
  size_t struct_size;           /* sizeof(ddp_dump_options_t) */
  int64_t steps;                /* meta.json "steps", the planned count; ddp_dump_finish
                                   rewrites it (rank 0) when a different count was written */
  const char *producer_version; /* meta.json "producer_version"; NULL = "libddp" */
  const char *config_json;      /* meta.json "config": JSON object text; NULL = {} */
  const char *model_json;       /* meta.json "model": the model file's text; NULL = {} */
} ddp_dump_options_t;

#define DDP_DUMP_OPTIONS_INIT \
  { sizeof(ddp_dump_options_t), 0, NULL, NULL, NULL }

/* Creates DIR and DIR/rank{rank} (mkdir -p) and, on rank 0, writes DIR/meta.json. The
 * strings of opts are copied; config_json and model_json must parse as JSON objects
 * (DDP_ERR_INVALID_ARGUMENT). err (optional) receives the message on failure. */
DDP_API ddp_status_t ddp_dump_open(const char *dir, int rank, int world,
                                   const ddp_dump_options_t *opts, ddp_dump_t **out,
                                   ddp_error_t *err);
/* Binds the model (and the reducer, NULL when there is none) and writes
 * rank{r}/init.safetensors: every parameter as param.<name>, then every buffer as
 * buffer.<name>. Call it after ddp_ddp_create and before the first forward: it records
 * the construction-time bucket layout for ddp.json. Both handles are borrowed. */
DDP_API ddp_status_t ddp_dump_init(ddp_dump_t *d, ddp_model_t *model, ddp_ddp_t *ddp);
/* Appends one micro-batch to the step's inputs: features x [n, ...], labels y [n, ...]
 * and the dataset indices (n entries; NULL writes -1). Every micro-batch of a dump must
 * have the same dtypes and per-row shapes. */
DDP_API ddp_status_t ddp_dump_input(ddp_dump_t *d, const ddp_tensor_t *x, const ddp_tensor_t *y,
                                    const int64_t *indices);
/* Copies every parameter's gradient (state order; frozen ones as zeros): call it after
 * the last backward of the step, before gradient clipping and the optimizer. */
DDP_API ddp_status_t ddp_dump_grads(ddp_dump_t *d);
/* Records parameter `index`'s (state order) local gradient of this step: this rank's own
 * gradient after backward and before any communication (grad: numel elements of the
 * parameter's dtype, copied; NULL = None, written as zeros and listed in
 * local_grads_none). A later call for the same index this step replaces it. The trainer
 * calls it from the reducer's local-gradient observer (ddp_ddp_set_local_grad_fn). */
DDP_API ddp_status_t ddp_dump_local_grad(ddp_dump_t *d, size_t index, const void *grad);
/* Writes rank{r}/step{NNNNNN}.safetensors: input.x, input.y, input.index, the gradients
 * copied by ddp_dump_grads (required), the parameters and buffers as they are now (after
 * the optimizer step), then local_grad.<name> for each gradient ddp_dump_local_grad
 * recorded this step, with metadata step, rank, loss (%.17g), micro_batches, flags,
 * grads_none (the parameters whose gradient was None at ddp_dump_grads, frozen ones
 * included) and, when local gradients were recorded, local_grads_none. Then clears the
 * inputs, the gradient copy and the local gradients. */
DDP_API ddp_status_t ddp_dump_step(ddp_dump_t *d, int64_t step, double loss, int micro_batches,
                                   uint64_t flags);
/* Writes rank{r}/ddp.json (only with a reducer bound): the reducer's parameter list and
 * shapes, state parameter and buffer names, the initial layout recorded at ddp_dump_init
 * and the rebuilt one (null when none happened), bucket sizes and limits, the last
 * grad-ready order and the logging data under PyTorch's keys. Rank 0 rewrites meta.json
 * when the number of steps written differs from opts->steps. Call before ddp_ddp_destroy. */
DDP_API ddp_status_t ddp_dump_finish(ddp_dump_t *d);
/* Records a sharded optimizer's partition for ddp.json: "zero_partition", an object
 * {parameter name: owning rank} (as tools/torch/torch_reference.py --zero writes PyTorch
 * ZeroRedundancyOptimizer's). names[i] and owner[i] for n parameters, copied. */
DDP_API ddp_status_t ddp_dump_set_partition(ddp_dump_t *d, const char *const *names,
                                            const int *owner, size_t n);
/* Frees the handle. NULL is a no-op. */
DDP_API void ddp_dump_close(ddp_dump_t *d);
/* Copies into *out the error of the last failed call (status DDP_OK and "" if none). The
 * handle is single-owner (one thread at a time), so no lock is needed. */
DDP_API void ddp_dump_last_error_copy(const ddp_dump_t *d, ddp_error_t *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_REDUCER_H */
