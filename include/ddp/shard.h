/* libddp shard layer: sharded data parallelism beside the reducer. This first slice is
 * ZeRO stages 1 and 2 (docs/sharding.md):
 *
 *   stage 1  optimizer state sharded (PyTorch ZeroRedundancyOptimizer): gradients are averaged
 *            by the DDP reducer as in plain DDP; each rank steps only the parameters it owns
 *            with the ordinary optimizers (src/optim); each owner broadcasts them.
 *   stage 2  gradients sharded too: the ranks' local gradients are reduce-scattered (rank-order
 *            sums, DDP's divide), each rank keeps only its shard of gradients and optimizer
 *            state, and the updated parameters are all-gathered.
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

#include "ddp/optim.h"
#include "ddp/pg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP_ZERO_MAX_GROUPS 8

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
   * by W (gradient_as_bucket_view). Equal for W a power of two. */
  bool divide_in_place;
} ddp_zero_options_t;

#define DDP_ZERO_OPTIONS_INIT \
  { sizeof(ddp_zero_options_t), 1, false }

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

/* Stage 2, collective: the local gradients (each the sum of this rank's micro-batches) are
 * divided as DDP divides, reduce-scattered in rank order over the owners' segments, and
 * written into the owned gradients; the others become None (data NULL). Stage 1: nothing
 * (the DDP reducer has averaged every gradient). */
DDP_API ddp_status_t ddp_zero_reduce_grads(ddp_zero_t *z, ddp_error_t *err);
/* Collective: clip_grad_norm_ (norm 2) over the whole model's averaged gradients: each rank
 * computes the norms of the gradients it owns, the norms are all-reduced (exact: every slot
 * has one nonzero contribution), the total is summed in parameter order, and each rank
 * scales its own gradients. *total_norm gets the norm before clipping, equal on all ranks
 * and equal bit for bit to ddp_clip_grad_norm over the full gradients. */
DDP_API ddp_status_t ddp_zero_clip_grad_norm(ddp_zero_t *z, double max_norm, double *total_norm,
                                             ddp_error_t *err);
/* Collective: every rank steps the parameters it owns at learning rate lr, then the owners
 * send them to every rank (stage 1: a broadcast per parameter from its owner, rank by rank,
 * as ZeroRedundancyOptimizer._sync_params; stage 2: one all-gather of the owners' flat
 * segments). */
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

#ifdef __cplusplus
}
#endif
#endif /* DDP_SHARD_H */
