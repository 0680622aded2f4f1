/* Gradient synchronisation as the trainer sees it: one small interface between the training
 * loop and whatever keeps the replicas' gradients equal (private to src/train).
 *
 * The loop calls, per optimizer step of N micro-batches, for each micro-batch k:
 *     ddp__sync_pre_forward(s, ctx, k == N - 1);  forward -> y;
 *     ddp__sync_post_forward(s, ctx, y);          loss from y;
 *     ddp__sync_backward(s, ctx, loss, scale, &comm_ns);
 * so a forward is "synchronising" (HF: outside no_sync) only for the last micro-batch of a
 * window, and the decision is taken at forward, as in DDP. The backward computes the
 * gradient of scale * loss (scale = 1/N, Accelerate's loss scaling; NULL = 1) and, after a
 * synchronising forward, leaves every gradient averaged over the ranks.
 * ddp__sync_begin() runs once before training (after a checkpoint is loaded) and makes
 * every rank hold rank 0's parameters and buffers.
 *
 * Two implementations (sync.c): the DDP reducer with the HF-named options, and a flat
 * one-bucket allreduce kept as the reference; ddp_train's ddp_reducer argument picks. */
#ifndef DDP_TRAIN_SYNC_H
#define DDP_TRAIN_SYNC_H

#include "ddp/hooks.h"
#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "ddp/train.h"

typedef struct ddp__sync ddp__sync_t;

/* --sharding_arithmetic parsed and checked against the flags it does not combine with
 * (world_size_invariant_shards, a comm_hook); an error names the flag and value. */
ddp_status_t ddp__sync_grad_arith(const ddp_train_args_t *a, int rank, ddp_grad_arith_t *out,
                                  ddp_error_t *err);

ddp_status_t ddp__sync_create(ddp_pg_t *pg, ddp_model_t *model, const ddp_train_args_t *args,
                              bool use_reducer, ddp__sync_t **out, ddp_error_t *err);
void ddp__sync_destroy(ddp__sync_t *s);
/* Reducer mode, before ddp__sync_begin: the comm hook begin would register (the
 * --sharding_arithmetic hook, --comm_hook's, or none: inner NULL) is handed to fn, which
 * takes its state and returns the hook to register instead (ZeRO-1's hook_with_zero_step,
 * src/train/zero.c); a failure's message goes to err. */
typedef ddp_status_t (*ddp__sync_hook_wrap_fn)(void *user, const ddp_comm_hook_t *inner,
                                               ddp_comm_hook_t *out, ddp_error_t *err);
void ddp__sync_set_hook_wrap(ddp__sync_t *s, ddp__sync_hook_wrap_fn fn, void *user);
/* Rank 0's parameters and buffers to every rank (DDP's constructor broadcast; the
 * reducer's handle is created here). */
ddp_status_t ddp__sync_begin(ddp__sync_t *s, ddp_error_t *err);
/* Before a forward: sync is false inside no_sync. */
ddp_status_t ddp__sync_pre_forward(ddp__sync_t *s, ddp_ctx_t *ctx, bool sync, ddp_error_t *err);
/* After the forward that produced y. */
ddp_status_t ddp__sync_post_forward(ddp__sync_t *s, ddp_ctx_t *ctx, ddp_var_t *y, ddp_error_t *err);
/* Backward of scale * loss (scale: a scalar of loss's dtype, or NULL for 1), then the
 * gradient communication; adds the nanoseconds spent communicating to *comm_ns. */
ddp_status_t ddp__sync_backward(ddp__sync_t *s, ddp_ctx_t *ctx, ddp_var_t *loss,
                                const ddp_tensor_t *scale, int64_t *comm_ns, ddp_error_t *err);
/* Observes each gradient of a synchronising backward before it is communicated
 * (ddp_ddp_set_local_grad_fn's contract; flat mode: every trainable parameter, just before
 * the allreduce). Reducer mode needs ddp__sync_begin to have run. */
void ddp__sync_set_local_grad_fn(ddp__sync_t *s, ddp_local_grad_fn fn, void *user);
/* A ddp_local_grad_fn that records p's gradient into the dump `user` (a ddp_dump_t):
 * ddp_dump_local_grad(user, p->index, p->grad.data). */
void ddp__train_dump_local(void *user, const ddp_param_t *p);
/* Which implementation runs ("reducer" or "flat-allreduce"), for logs and metrics. */
const char *ddp__sync_name(const ddp__sync_t *s);
/* The reducer's handle (reducer mode, after ddp__sync_begin), else NULL. */
struct ddp_ddp *ddp__sync_reducer(ddp__sync_t *s);
/* The PowerSGD comm hook's state (comm_hook power_sgd / batched_power_sgd, after
 * ddp__sync_begin), else NULL: for power_sgd_init_q, which serves PyTorch's Q draws. */
ddp_powersgd_state_t *ddp__sync_powersgd(ddp__sync_t *s);
/* Whether the registered comm hook keeps state across steps (ddp_comm_hook_t.save_state /
 * load_state; after ddp__sync_begin). Checkpoints save and restore it per rank through the
 * two calls below, whatever the hook. */
bool ddp__sync_hook_has_state(const ddp__sync_t *s);
ddp_status_t ddp__sync_hook_save(ddp__sync_t *s, const char *path, ddp_error_t *err);
ddp_status_t ddp__sync_hook_load(ddp__sync_t *s, const char *path, ddp_error_t *err);
/* Payload bytes this rank all-reduced in the last synchronised step and the compression
 * rate of the comm hook (1 without compression). */
void ddp__sync_comm_stats(ddp__sync_t *s, int64_t *bytes, double *rate);
/* Average backward compute/communication overlap per synchronised step (ns; 0 for flat). */
double ddp__sync_overlap_ns(ddp__sync_t *s);

#endif /* DDP_TRAIN_SYNC_H */
