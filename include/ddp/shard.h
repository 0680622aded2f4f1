/* libddp shard layer: sharded data parallelism beside the reducer. This first slice is
 * ZeRO stages 1 and 2 (docs/sharding.md):
 *
 *   stage 1  optimizer state sharded (PyTorch ZeroRedundancyOptimizer): gradients are averaged
 *            by the DDP reducer as in plain DDP; each rank steps only the parameters it owns
 *            with the ordinary optimizers (src/optim); each owner broadcasts them.
 *   stage 2  gradients sharded too: each bucket of the ranks' local gradients is reduced to
 *            the ranks that own its parameters (rank-order sums, DDP's divide) as backward
 *            finishes it, each rank keeps only its shard of gradients and optimizer state,
 *            and each owner broadcasts the updated parameters.
 *
 * The partition is ZeroRedundancyOptimizer's (1.13 `_partition_parameters`): per parameter
 * group in order, the group's parameters sorted by numel, largest first (a stable sort), each
 * to the rank with the smallest total so far (the first such rank), the totals shared across
 * groups; a parameter is never split.
 *
 * Numerics: both stages end with DDP's parameters bit for bit (same job, same W): the
 * gradient each owner steps on is DDP's averaged gradient, and clipping uses the global norm
 * summed over the per-tensor norms in parameter order whatever the shards.
 *
 * One handle per rank, used by one thread; every call below that communicates is collective:
 * every rank calls it in the same order. */
#ifndef DDP_SHARD_H
#define DDP_SHARD_H

#include "ddp/hooks.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/pg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP_ZERO_MAX_GROUPS 8

/* Where the gradient reduction divides by W: each framework's own arithmetic, per element
 * (docs/sharding.md, "Framework arithmetic"). g_r is rank r's local gradient, the sum is
 * libddp's, in rank order; f32 operations round once each, as PyTorch's CPU kernels do.
 *
 *   DDP          g_r * fl(1/W) (g_r / W with divide_in_place), then SUM: PyTorch DDP's
 *                reducer, the default, what every sharded mode's bits are promised to be
 *   FSDP1        g_r / f, SUM, then / (W / f) when W / f > 1; f = 1 doubled while
 *                W % f == 0 and W / f > f (FSDP1's gradient pre/post-divide factors)
 *   FSDP2        SUM, then / W (fully_shard in f32 with a SUM-only backend; NCCL's AVG
 *                is DDP's arithmetic)
 *   DEEPSPEED    g_r / W, then SUM (ZeRO-1/2 average_tensor; ZeRO-3's
 *                reduce_scatter_coalesced divides its chunks the same way)
 *   DEEPSPEED_ALLREDUCE  SUM, then * fl(1/W) (ZeRO-1/2 with "reduce_scatter": false) */
typedef enum ddp_grad_arith {
  DDP_GRAD_ARITH_DDP = 0,
  DDP_GRAD_ARITH_FSDP1,
  DDP_GRAD_ARITH_FSDP2,
  DDP_GRAD_ARITH_DEEPSPEED,
  DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE,
} ddp_grad_arith_t;

#define DDP_GRAD_ARITH_CHOICES "ddp, fsdp1, fsdp2, deepspeed, deepspeed_allreduce"

/* "ddp", "fsdp1", ...; parse returns false for any other name (out unchanged). */
DDP_API const char *ddp_grad_arith_name(ddp_grad_arith_t a);
DDP_API bool ddp_grad_arith_parse(const char *name, ddp_grad_arith_t *out);
/* The divisors before and after the sum at world size `world` (1: none; DDP's pre is W,
 * applied as a multiply by fl(1/W) unless divide_in_place; DEEPSPEED_ALLREDUCE's post is
 * W, applied as a multiply by fl(1/W)). */
DDP_API void ddp_grad_arith_factors(ddp_grad_arith_t a, int world, double *pre, double *post);
/* dst[k] = src[k] divided as arithmetic a does before the sum (dst == src allowed); n
 * elements of dt (DDP_F32 or DDP_F64). */
DDP_API void ddp_grad_arith_pre(ddp_grad_arith_t a, int world, bool divide_in_place, void *dst,
                                const void *src, size_t n, ddp_dtype_t dt);
/* buf[k] divided as arithmetic a does after the sum, in place. */
DDP_API void ddp_grad_arith_post(ddp_grad_arith_t a, int world, void *buf, size_t n,
                                 ddp_dtype_t dt);
/* A DDP comm hook (ddp_ddp_register_comm_hook) that reduces each bucket with arithmetic a:
 * pre, allreduce SUM in place, post (FSDP1's NO_SHARD allreduce_hook, DeepSpeed's
 * allreduce). The DDP handle owns the state once registered (free_state). */
DDP_API ddp_status_t ddp_grad_arith_hook(ddp_grad_arith_t a, ddp_comm_hook_t *out);

/* Each framework's clipping (docs/sharding.md, "Framework arithmetic"), the 2-norm only.
 * Every norm below is libddp's kernel: the squares summed in f64 in element order, the
 * square root rounded to the gradients' dtype (ddp_grad_norms), or, where DeepSpeed takes
 * `g.double().norm(2)`, left in f64. The coefficient and the scaling of the gradients
 * follow each framework's tensor operations, each rounded once.
 *
 * ddp_grad_arith_norm: the 2-norm of x[0..n) (f64: not rounded to dt).
 * ddp_grad_arith_param_norm: the norm of the part of the full gradient g that rank owns
 * in the framework's own layout, as its clipping takes it: FSDP2 the parameter's dim-0
 * shard (torch.chunk, ceil(rows / W) rows a rank), DeepSpeed (both arithmetics) ZeRO-3's
 * partition (ceil(numel / W) elements a rank, f64), any other the whole gradient. */
DDP_API double ddp_grad_arith_norm(const void *x, size_t n, ddp_dtype_t dt, bool f64);
DDP_API double ddp_grad_arith_param_norm(ddp_grad_arith_t a, int rank, int world,
                                         const ddp_tensor_t *g);
/* Collective. FSDP1's FullyShardedDataParallel.clip_grad_norm_ (local[k]: the norms of
 * this rank's flat gradient shards, one per unit) and FSDP2's clip_grad_norm_ over DTensor
 * shards (local[k]: each parameter's shard norm, _NormPartial): this rank's norm is the
 * norm of its m norms, its square (in dt) is all-reduced (SUM, rank order), the total is
 * the square root, and the n grads are multiplied by clip_grad_norm_'s coefficient
 * (max_norm / (total + 1e-6), clamped to 1). *total_norm: the total. */
DDP_API ddp_status_t ddp_grad_arith_clip_sharded(ddp_pg_t *pg, const double *local, size_t m,
                                                 ddp_tensor_t *const *grads, size_t n,
                                                 ddp_dtype_t dt, double max_norm,
                                                 double *total_norm, ddp_error_t *err);
/* Collective. DeepSpeed ZeRO-1/2 (stage_1_and_2.py scaled_global_norm,
 * get_grad_norm_direct, unscale_and_clip_grads): grads[i] is every parameter's gradient
 * (global order; groups of group_n[g]), holder[i] the one rank whose grads[i] counts (NULL:
 * every rank holds every gradient). Each group's flat buffer is padded to a multiple of 2 W
 * and cut into W partitions; each rank's pieces' f64 norms are squared and summed in f64,
 * rounded to f32, summed over the ranks in rank order, square-rooted: the group's norm;
 * the total is the norm of the groups' norms; the grads in scale[0..n) are multiplied by
 * 1 / max(1, (total + 1e-6) / max_norm). */
DDP_API ddp_status_t ddp_grad_arith_clip_deepspeed(ddp_pg_t *pg, ddp_tensor_t *const *grads,
                                                   const int *holder, const size_t *group_n,
                                                   size_t ngroups, ddp_tensor_t *const *scale,
                                                   ddp_dtype_t dt, double max_norm,
                                                   double *total_norm, ddp_error_t *err);
/* Collective. DeepSpeed ZeRO-3 (stage3.py get_grad_norm_direct): sq[g] is this rank's sum,
 * in f64, of the squared f64 norms of its partitions of group g's parameters (ngroups,
 * overwritten); the sums are all-reduced in f64, each group's norm is their square root,
 * the total the f64 norm of those, and the n grads are multiplied by the coefficient above
 * computed in f64 and rounded to their dtype. */
DDP_API ddp_status_t ddp_grad_arith_clip_deepspeed3(ddp_pg_t *pg, double *sq, size_t ngroups,
                                                    ddp_tensor_t *const *grads, size_t n,
                                                    double max_norm, double *total_norm,
                                                    ddp_error_t *err);

/* One parameter group: its optimizer's options and its (parameter, gradient) pairs, which
 * stay the caller's. Parameters of all groups are indexed globally: group 0's, then group
 * 1's, ... (torch.optim's state-dict indices). */
typedef struct ddp_zero_group {
  ddp_optim_options_t opts;
  const ddp_optim_param_t *params;
  size_t n;
} ddp_zero_group_t;

typedef struct ddp_zero_options {
  size_t struct_size;
  int stage; /* 1 or 2 */
  /* Stage 2: how each local gradient is divided by W before the rank-order sum, as the DDP
   * reducer it replaces does: false multiplies by float(1/W) (DDP's default), true divides
   * by W from the second reduction on (gradient_as_bucket_view with gradients that stay
   * bucket views, zero_grad(set_to_none=False): the reducer multiplies the first backward's
   * gradients into its buckets and divides later ones in place). Equal for W a power of
   * two. */
  bool divide_in_place;
  /* Stage 2: where the reduction to the owners divides (DDP: as above). Stage 1 uses the DDP
   * reducer's gradients: register ddp_grad_arith_hook there for another arithmetic. Both
   * stages: DEEPSPEED and DEEPSPEED_ALLREDUCE clip as DeepSpeed ZeRO-1/2 does
   * (ddp_grad_arith_clip_deepspeed); the others in DDP's order. */
  ddp_grad_arith_t arith;
  /* Stage 1: ZeroRedundancyOptimizer's parameters_as_bucket_view (false). Each rank's
   * parameters are copied into one flat bucket per rank (per group in order, the group's
   * parameters in the partition's order: numel descending) and the parameters' data point
   * into it; ddp_zero_step then broadcasts one bucket per rank instead of one tensor per
   * parameter (an empty rank's bucket is one zero element, as torch.zeros(1)). The same
   * bits; ddp_zero_destroy copies the values back and points the parameters at their
   * former storage. Stage 2: DDP_ERR_INVALID_ARGUMENT. */
  bool parameters_as_bucket_view;
} ddp_zero_options_t;

#define DDP_ZERO_OPTIONS_INIT \
  { sizeof(ddp_zero_options_t), 1, false, DDP_GRAD_ARITH_DDP, false }

typedef struct ddp_zero ddp_zero_t;

/* ZeroRedundancyOptimizer's partition of parameters with these element counts (numel[i],
 * global index i; groups of group_n[g] parameters in order) over `world` ranks: owner[i]
 * receives parameter i's rank. */
DDP_API void ddp_zero_partition(const int64_t *numel, const size_t *group_n, size_t ngroups,
                                int world, int *owner);

/* Partitions the parameters and creates this rank's optimizers over the parameters it owns
 * (one per group, with the group's options). Parameters and gradients are all f32 or all
 * f64. An unknown stage is DDP_ERR_INVALID_ARGUMENT naming it. */
DDP_API ddp_status_t ddp_zero_create(ddp_pg_t *pg, const ddp_zero_options_t *opts,
                                     const ddp_zero_group_t *groups, size_t ngroups,
                                     ddp_zero_t **out, ddp_error_t *err);
DDP_API void ddp_zero_destroy(ddp_zero_t *z);

DDP_API int ddp_zero_stage(const ddp_zero_t *z);
DDP_API size_t ddp_zero_num_params(const ddp_zero_t *z);
/* The rank that owns (steps, and holds the state of) global parameter i. */
DDP_API int ddp_zero_owner(const ddp_zero_t *z, size_t i);

/* Stage 2's buckets: DDP's default caps (25 MiB, the first 1 MiB). */
#define DDP_ZERO_BUCKET_BYTES ((size_t)25 * 1024 * 1024)
#define DDP_ZERO_FIRST_BUCKET_BYTES ((size_t)1024 * 1024)

/* Stage 2 over a model's backward (docs/sharding.md, "ZeRO-2"): the handle's parameters
 * must be model's (param == &p->value, grad == &p->grad, any order). Sets the model's
 * gradient-ready hooks (held until destroy; not with a DDP reducer on the same model),
 * lays out buckets in reverse model order (bucket_cap_mb <= 0: DDP's 25 MiB with a 1 MiB
 * first bucket; else both caps), and makes the gradients of parameters other ranks own
 * None, their pages returned (ddp_param_release_grad). Then, in a backward after
 * ddp_zero_set_sync(z, true), each bucket is reduced to its owners as soon as backward has
 * finished it, and the non-owned gradients go back to None as their buckets complete;
 * ddp_zero_reduce_grads ends the reduction. A handle of stage 1 is DDP_ERR_INVALID_USAGE. */
DDP_API ddp_status_t ddp_zero_attach_model(ddp_zero_t *z, ddp_model_t *model, double bucket_cap_mb,
                                           ddp_error_t *err);
/* Before each forward of an attached stage-2 handle: whether its backward reduces (true:
 * the last micro-batch of a window; false: no_sync, the gradients accumulate locally at
 * full size). Nothing at stage 1. */
DDP_API void ddp_zero_set_sync(ddp_zero_t *z, bool sync);
/* Stage 2, collective: the local gradients (each the sum of this rank's micro-batches) are
 * divided as DDP divides, summed over the ranks in rank order bucket by bucket (a
 * reduce-scatter over the owners' segments, or an allreduce where padding would cost more),
 * and written into the owned gradients; the others become None (data NULL).
 * Attached and armed: the buckets the backward's hooks launched are completed and the rest
 * launched (a parameter no backward reached contributes zeros); otherwise every bucket is
 * reduced here. Stage 1: nothing (the DDP reducer has averaged every gradient). */
DDP_API ddp_status_t ddp_zero_reduce_grads(ddp_zero_t *z, ddp_error_t *err);
/* Collective: clip_grad_norm_ (norm 2) over the whole model's averaged gradients: each rank
 * computes the norms of the gradients it owns, the norms are all-reduced (exact: every slot
 * has one nonzero contribution), the total is summed in parameter order, and each rank
 * scales its own gradients. *total_norm gets the norm before clipping, equal on all ranks
 * and equal bit for bit to ddp_clip_grad_norm over the full gradients. */
DDP_API ddp_status_t ddp_zero_clip_grad_norm(ddp_zero_t *z, double max_norm, double *total_norm,
                                             ddp_error_t *err);
/* Collective: every rank steps the parameters it owns at learning rate lr, then the owners
 * send them to every rank: a broadcast per parameter from its owner, rank by rank, as
 * ZeroRedundancyOptimizer._sync_params (both stages), or at stage 1 with
 * parameters_as_bucket_view one broadcast of each rank's bucket. */
DDP_API ddp_status_t ddp_zero_step(ddp_zero_t *z, double lr, ddp_error_t *err);
/* zero_grad over every present gradient (set_to_none as ddp_optim_zero_grad). */
DDP_API void ddp_zero_zero_grad(ddp_zero_t *z, bool set_to_none);

/* The bytes this rank holds now, in libddp's accounting for f32 AdamW (docs/sharding.md):
 * parameters (all, replicated in stages 1 and 2), gradients present (stage 2 after
 * reduce_grads: the owned ones) and per-element optimizer state (step counters excluded).
 * NULL outputs are skipped. */
DDP_API void ddp_zero_state_bytes(const ddp_zero_t *z, size_t *param_bytes, size_t *grad_bytes,
                                  size_t *optim_bytes);

/* Checkpoints (docs/sharding.md). ddp_zero_optim_save writes this rank's shard of group
 * `group`'s optimizer state (ddp_optim_save's layout, each parameter under its index in
 * the group, so the shards of a group are disjoint pieces of one torch.optim state dict);
 * every rank writes its own, in parallel. ddp_zero_consolidate merges the shard files of
 * one group (any number, any order) into `out`: the group's state dict in index order,
 * byte for byte what ddp_optim_save of an unsharded optimizer with the same state writes
 * (a duplicate entry, a tensor that is not optimizer state, or shards of different
 * optimizers are DDP_ERR_INVALID_DATA naming the files). ddp_zero_optim_load loads this
 * rank's parameters of group `group` from such a full file (consolidated, or a DDP
 * checkpoint's), whatever the world size that wrote it. Not collective. */
DDP_API ddp_status_t ddp_zero_optim_save(const ddp_zero_t *z, size_t group, const char *path,
                                         ddp_error_t *err);
DDP_API ddp_status_t ddp_zero_consolidate(const char *const *shards, size_t nshards,
                                          const char *out, ddp_error_t *err);
DDP_API ddp_status_t ddp_zero_optim_load(ddp_zero_t *z, size_t group, const char *path,
                                         ddp_error_t *err);

/* ------------------------------------------------- ZeRO-1 overlapped with DDP ---- */

/* PyTorch 1.13's ZeroRedundancyOptimizer(overlap_with_ddp=True) with the DDP comm hook
 * hook_with_zero_step or hook_with_zero_step_interleaved (ddp_zero_hook.py;
 * docs/sharding.md, "ZeRO-1 overlapped with DDP"). The optimizer step runs inside DDP's
 * comm hook; the caller never steps.
 *
 *   warm-up    until DDP has rebuilt its buckets (has_rebuilt_buckets: after the first
 *              synchronised iteration, the second with static_graph) the hook only runs
 *              the inner hook. In the first iteration after the rebuild it records each
 *              bucket's parameters. At bucket 0 of the next iteration it partitions the
 *              buckets, flattens each assignment's parameters into one tensor (the
 *              parameters become views into it) and creates this rank's optimizers. So
 *              the first 2 synchronised iterations (3 with static_graph) update nothing;
 *              DDP with find_unused_parameters and no static_graph never rebuilds, so the
 *              hook never updates (as in PyTorch).
 *   partition  bucket i to rank i % W whole (shard_buckets false), or PyTorch's
 *              shard_buckets: buckets by increasing size, each cut into runs of parameters
 *              below total / W, each run to the least-loaded rank not yet holding a run of
 *              that bucket. Not ZeroRedundancyOptimizer's greedy partition (ddp_zero_partition).
 *   STEP       when the last bucket's hook runs (all gradients computed), for every bucket
 *              in order: its owners wait for its reduction, step its parameters with the
 *              reduced gradients, then every rank issues the broadcast of the bucket's
 *              assignments from their owners (in rank order); all broadcasts are waited
 *              for before the hook returns.
 *   INTERLEAVED each bucket's work gets a continuation (run when the reducer resolves the
 *              bucket, in bucket order): the owners step the bucket's parameters, every
 *              rank broadcasts them; the last bucket's continuation waits for all.
 *
 * The step uses the inner hook's result as the gradient, the bits DDP with that hook copies
 * into .grad: with the default inner (DDP's own arithmetic, fl(1/W) pre-multiply, or / W
 * with divide_in_place) an iteration after the warm-up updates every parameter bit for bit
 * as DDP followed by the same optimizer does. Not PyTorch's limits: any number of parameter
 * groups (each parameter keeps its group's options; PyTorch asserts one group), and any
 * backend (PyTorch refuses all but NCCL/HCCL, because gloo may hang: pytorch#62300). No
 * gradient clipping is possible (the step runs before every gradient is reduced). */
typedef enum ddp_zero_hook_kind {
  DDP_ZERO_HOOK_STEP = 0,         /* hook_with_zero_step */
  DDP_ZERO_HOOK_STEP_INTERLEAVED, /* hook_with_zero_step_interleaved */
} ddp_zero_hook_kind_t;

typedef struct ddp_zero_overlap_options {
  size_t struct_size;
  ddp_zero_hook_kind_t kind;
  bool shard_buckets; /* false: each bucket wholly to rank index % W */
  /* DDP's _has_rebuilt_buckets, asked at every bucket (the reducer is a layer above: the
   * caller answers, e.g. from ddp_ddp_get_logging_data). Required. */
  bool (*has_rebuilt_buckets)(void *user);
  void *user;
  /* The default inner hook's divide (inner NULL): false multiplies by fl(1/W) (DDP's
   * default), true divides by W (DDP with gradient_as_bucket_view). */
  bool divide_in_place;
} ddp_zero_overlap_options_t;

#define DDP_ZERO_OVERLAP_OPTIONS_INIT \
  { sizeof(ddp_zero_overlap_options_t), DDP_ZERO_HOOK_STEP, false, NULL, NULL, false }

typedef struct ddp_zero_overlap ddp_zero_overlap_t;

/* "hook_with_zero_step", "hook_with_zero_step_interleaved"; parse: false for other names. */
DDP_API const char *ddp_zero_hook_kind_name(ddp_zero_hook_kind_t k);
DDP_API bool ddp_zero_hook_kind_parse(const char *name, ddp_zero_hook_kind_t *out);

/* groups: the optimizer groups over the trainable parameters (each pair's param is a
 * ddp_param_t's value, so that the buckets' parameters are found in them); f32 or f64.
 * inner: PyTorch's `hook` argument (the overlap handle owns its state from here, also on
 * failure); NULL: DDP's own arithmetic (above). Registered through ddp_zero_overlap_hook;
 * the handle outlives the DDP handle it is registered with. */
DDP_API ddp_status_t ddp_zero_overlap_create(ddp_pg_t *pg, const ddp_zero_overlap_options_t *opts,
                                             const ddp_zero_group_t *groups, size_t ngroups,
                                             const ddp_comm_hook_t *inner, ddp_zero_overlap_t **out,
                                             ddp_error_t *err);
/* Copies the parameters back to their former storage (the model's flat buffer) and points
 * them there again; frees the optimizers and the inner hook's state. NULL: no-op. */
DDP_API void ddp_zero_overlap_destroy(ddp_zero_overlap_t *z);
/* The hook to register (ddp_ddp_register_comm_hook): state is z, free_state NULL (z stays
 * the caller's); stats and save/load_state are the inner hook's. */
DDP_API void ddp_zero_overlap_hook(ddp_zero_overlap_t *z, ddp_comm_hook_t *out);
/* The learning rate of the next update (before the backward that runs it). */
DDP_API void ddp_zero_overlap_set_lr(ddp_zero_overlap_t *z, double lr);
/* Iterations that updated the parameters so far (0 during the warm-up). */
DDP_API int64_t ddp_zero_overlap_updates(const ddp_zero_overlap_t *z);
/* The rank that steps global parameter i; -1 before the delayed initialisation. */
DDP_API int ddp_zero_overlap_owner(const ddp_zero_overlap_t *z, size_t i);
/* Bytes of this rank's optimizer state (ddp_optim_state_bytes of its optimizers). */
DDP_API size_t ddp_zero_overlap_optim_bytes(const ddp_zero_overlap_t *z);

/* ---------------------------------------------------------------- ZeRO-3 / FSDP ---- */

/* ZeRO-3, FSDP's FULL_SHARD (docs/sharding.md): the model's parameters are cut into units
 * by the wrap policy (one per block the policy names, ddp_model_block; everything else in
 * the root unit). Each unit's parameters are one flat buffer (registration order, padded
 * to a multiple of W); rank r keeps elements [r S, (r + 1) S) of it (S = padded / W) as
 * its parameter shard, its gradient shard and, through ordinary optimizers over the
 * pieces of parameters in its shard, its optimizer state. The model's own storage is
 * freed (ddp_model_release_storage).
 *
 * Per micro-batch: ddp_fsdp_begin all-gathers the root unit; each block unit is
 * all-gathered before its forward and freed after it (reshard_after_forward), all-gathered
 * again when backward reaches it, and, when its backward is done, on a synchronising
 * micro-batch its full local gradient is divided as DDP divides (x * float(1/W), or / W)
 * and reduce-scattered in rank order (the sum DDP's allreduce computes); on the others
 * (no_sync) the full local gradient is kept and accumulated, as FSDP's no_sync does, so
 * the accumulated gradient is summed in DDP's order. ddp_fsdp_end_backward finishes the
 * root unit (and any unit whose input needed no gradient). Each reduced shard is then
 * all-gathered once into the unit's freed gradient buffer to take every parameter's
 * gradient norm on the full gradient (clipping's norm in DDP's order, whatever W).
 * So ZeRO-3 ends with DDP's parameters bit for bit.
 *
 * The hooks run inside the model's forward and backward (ddp_model_set_block_hooks, set
 * by create); every call is collective in the same order on every rank. With the flight
 * recorder on, each collective is tagged (its dump's ddp_tag) with the unit, what it is
 * for and the unit's first parameter names: "fsdp unit 2 all_gather (forward prefetch),
 * 12 params: transformer.h.1.ln_1.weight,...". */
typedef enum ddp_fsdp_prefetch {
  DDP_FSDP_NO_PREFETCH = 0, /* Transformers' NO_PREFETCH, FSDP's backward_prefetch=None */
  DDP_FSDP_BACKWARD_PRE,
  DDP_FSDP_BACKWARD_POST,
} ddp_fsdp_prefetch_t;

typedef struct ddp_fsdp_options {
  size_t struct_size;
  /* Transformers' transformer_layer_cls_to_wrap: block classes (comma or space
   * separated) made units; "" none. */
  const char *wrap_cls;
  /* size_based_auto_wrap_policy: blocks with at least this many parameters are units;
   * 0 off. Both 0 / "": the whole model is the root unit. */
  int64_t min_num_params;
  bool reshard_after_forward; /* true (FULL_SHARD) */
  bool divide_in_place;       /* as ddp_zero_options_t */
  ddp_grad_arith_t arith;     /* as ddp_zero_options_t: pre-divide, reduce-scatter, post;
                               * and clipping: FSDP1, FSDP2 and DeepSpeed ZeRO-3's orders */
  /* Prefetch (docs/sharding.md, "Prefetch"): which unit's all-gather is issued early, as
   * an asynchronous collective that runs while this rank computes. They move collectives
   * in the group's issue order, never what they compute: every setting ends with the same
   * bits. backward_prefetch (PyTorch FSDP's BackwardPrefetch, default BACKWARD_PRE): PRE
   * issues the next unit in backward order (the one before in this iteration's forward
   * order) when a unit's backward starts, before its own gradient is computed; POST issues
   * it when the unit's backward is done, after its parameters are freed and before its
   * reduce-scatter; NONE gathers each unit when its backward starts. */
  ddp_fsdp_prefetch_t backward_prefetch;
  /* forward_prefetch: when a unit's forward starts, issue the next unit's all-gather (the
   * next in the previous iteration's forward order; none in the first). false. */
  bool forward_prefetch;
  /* limit_all_gathers: at most 2 units' all-gathers in flight (issued, not yet waited
   * for); an all-gather beyond them waits for the oldest first. true, as FSDP's. The
   * prefetches above look one unit ahead, so they never hold more than 2 (the unit's own
   * and the next): the limit is kept for the API and binds nothing today. */
  bool limit_all_gathers;
  /* DeepSpeed's stage3_param_persistence_threshold: a unit of fewer elements than this
   * stays gathered from its forward until its gradient is reduced (the window's last
   * micro-batch), as DeepSpeed keeps such parameters whole: no re-gather in backward or
   * between no_sync micro-batches. The bits do not change. 0 (off). */
  int64_t persistence_threshold;
  /* Hybrid sharding (FSDP's HYBRID_SHARD; with reshard_after_forward false,
   * _HYBRID_SHARD_ZERO2): the ranks per node L, a divisor of W. Ranks r with equal r / L
   * (a node) shard each unit over L ranks as FULL_SHARD does over W; ranks with equal r % L
   * hold the same shard (replicas). Parameters are all-gathered in the node only. The
   * gradient: by default one rank-order reduce-scatter over all W ranks and an all-gather
   * across nodes, so it stays DDP's bits; with arith FSDP1 or FSDP2, FSDP's order (reduce-
   * scatter in the node, all-reduce SUM across nodes). 0 or W: FULL_SHARD over every rank.
   * Create makes the node and replica groups with ddp_pg_split (pg needs its store). */
  int shard_size;
} ddp_fsdp_options_t;

#define DDP_FSDP_OPTIONS_INIT                                                                  \
  {                                                                                            \
    sizeof(ddp_fsdp_options_t), "", 0, true, false, DDP_GRAD_ARITH_DDP, DDP_FSDP_BACKWARD_PRE, \
        false, true, 0, 0                                                                      \
  }

typedef struct ddp_fsdp ddp_fsdp_t;

/* Shards model (finalised, parameters f32 or f64, equal on every rank) over pg. group[i]
 * is parameter i's optimizer group (< ngroups; -1: frozen, no optimizer), gopts[g] its
 * options. A wrap class naming no block of the model is DDP_ERR_INVALID_ARGUMENT naming
 * it and the model's block classes. */
DDP_API ddp_status_t ddp_fsdp_create(ddp_pg_t *pg, ddp_model_t *model,
                                     const ddp_fsdp_options_t *opts,
                                     const ddp_optim_options_t *gopts, const int *group,
                                     size_t ngroups, ddp_fsdp_t **out, ddp_error_t *err);
/* Restores nothing: the model's parameters stay unmaterialised (gather them with
 * ddp_fsdp_gather_all before destroying if they are needed). */
DDP_API void ddp_fsdp_destroy(ddp_fsdp_t *f);

DDP_API size_t ddp_fsdp_num_units(const ddp_fsdp_t *f);
/* Unit of parameter i (0: the root unit). */
DDP_API size_t ddp_fsdp_unit_of(const ddp_fsdp_t *f, size_t i);

/* Before a micro-batch's forward (sync: its backward reduces, as DDP's last micro-batch of
 * a window), or an evaluation forward (train false: nothing is kept for backward). */
DDP_API ddp_status_t ddp_fsdp_begin(ddp_fsdp_t *f, bool train, bool sync, ddp_error_t *err);
/* After the backward (or, train false, after the forward): the units left (root). */
DDP_API ddp_status_t ddp_fsdp_end(ddp_fsdp_t *f, ddp_error_t *err);
/* clip_grad_norm_ (norm 2) over the reduced gradients: the norms taken at reduction,
 * summed in parameter order; equal bit for bit to ddp_clip_grad_norm over DDP's
 * gradients. With another arith, that framework's clipping (docs/sharding.md, "Clipping"):
 * FSDP1 over each unit's flat shard, FSDP2 over each parameter's dim-0 shard, DeepSpeed
 * (both arithmetics) over ZeRO-3's per-parameter partitions. */
DDP_API ddp_status_t ddp_fsdp_clip_grad_norm(ddp_fsdp_t *f, double max_norm, double *total_norm,
                                             ddp_error_t *err);
/* Steps this rank's shard at lr (no communication: the next forward gathers). */
DDP_API ddp_status_t ddp_fsdp_step(ddp_fsdp_t *f, double lr, ddp_error_t *err);
DDP_API void ddp_fsdp_zero_grad(ddp_fsdp_t *f);
/* Collective: every unit gathered into the parameters (summon_full_params), for a
 * parameter hash or a save; ddp_fsdp_free_all frees them again. */
DDP_API ddp_status_t ddp_fsdp_gather_all(ddp_fsdp_t *f, ddp_error_t *err);
DDP_API void ddp_fsdp_free_all(ddp_fsdp_t *f);
/* Collective, at the end of training: the model gets its own storage back holding the full
 * parameters (FULL_STATE_DICT), the hooks are removed; only destroy may follow. */
DDP_API ddp_status_t ddp_fsdp_unshard(ddp_fsdp_t *f, ddp_error_t *err);
/* This rank's sharded state (the real elements of its shards; the padding of each unit,
 * under W elements, not counted): parameters, gradients present, optimizer state; and
 * the largest full copy (parameters and gradients of the units gathered at once) held
 * since the last call, which resets it. */
DDP_API void ddp_fsdp_state_bytes(ddp_fsdp_t *f, size_t *param_bytes, size_t *grad_bytes,
                                  size_t *optim_bytes, size_t *peak_gathered_bytes);

/* ZeRO-3 checkpoints (docs/sharding.md, "Checkpoints").
 *
 * FULL_STATE_DICT: ddp_fsdp_gather_all gives the model its full parameters and
 * ddp_fsdp_optim_gather (collective) fills full[g], an ordinary optimizer over group g's
 * whole parameters (parameter i at position pos[i]; pos of a frozen parameter unused), with
 * the state gathered from every rank's pieces and the shards' lr; ddp_optim_save of full[g] then
 * writes, byte for byte, the file DDP's optimizer with the same state writes.
 * ddp_fsdp_optim_scatter (not collective) is the way back: this rank's pieces take their slices of
 * full[g]'s state and its lr (loaded from a FULL checkpoint written at any world size, or from
 * DDP's).
 *
 * SHARDED_STATE_DICT: ddp_fsdp_save_sharded (not collective: every rank in parallel) writes
 * this rank's flat shards, model_path "unit.<u>" (S elements of unit u's parameters) and
 * optim_path "unit.<u>.<key>" (S elements of each state key, zeros in the padding) with
 * "step" (F64 [nparams], -1 where a parameter has no state), the world size, the rank and
 * every unit's element count in the metadata. ddp_fsdp_load_sharded (not collective) reads
 * the `world` files of each kind written by ranks 0..world-1, at any world size: flat
 * positions do not depend on W, so each element of this rank's shards is copied from the
 * old shard that holds it. Files of another model or wrap policy, a missing tensor or a
 * shard of the wrong rank are DDP_ERR_INVALID_DATA naming the file. */
DDP_API ddp_status_t ddp_fsdp_optim_gather(ddp_fsdp_t *f, ddp_optim_t *const *full,
                                           const size_t *pos, ddp_error_t *err);
DDP_API ddp_status_t ddp_fsdp_optim_scatter(ddp_fsdp_t *f, ddp_optim_t *const *full,
                                            const size_t *pos, ddp_error_t *err);
DDP_API ddp_status_t ddp_fsdp_save_sharded(ddp_fsdp_t *f, const char *model_path,
                                           const char *optim_path, ddp_error_t *err);
DDP_API ddp_status_t ddp_fsdp_load_sharded(ddp_fsdp_t *f, const char *const *model_paths,
                                           const char *const *optim_paths, int world,
                                           ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_SHARD_H */
