/* Private to src/reducer: the DDP handle (struct ddp_ddp) and the functions its files share.
 * Not installed.
 *
 * The reducer is split by concept, one file each (docs/ddp.md):
 *   create.c     construction: options, managed parameters, their arrays, the shape check,
 *                destroy and the plain accessors
 *   broadcast.c  coalesced broadcasts from one rank: module states and buffers
 *   buckets.c    bucket buffers: the initial layout, initialize_buckets, the one rebuild
 *   forward.c    pre/post forward, the unfinished-reduction check, no_sync
 *   backward.c   arming a backward (with the unused-parameter search), the grad-ready hook,
 *                mark_variable_ready, the in-order launch, static_graph's delayed allreduce
 *   finalize.c   the end of backward: wait for every bucket, copy the averages back
 *   join.c       join() for uneven inputs
 *   comm_hook.c  registering a comm hook, running it on a bucket, resolving its future
 *   stats.c      get_ddp_logging_data, comm statistics, the sampled timings and INFO lines
 *   trace.c      the Chrome-trace timeline and the flight recorder's bucket tags
 *   error.c      the handle's last error, waits on works, message helpers
 * Beside them, assign.c is the bucket rule (a pure function) and dump.c the per-step dump
 * writer; both use only the public header.
 *
 * One thread drives a handle (reducer.h), so nothing here is locked. Section numbers (§)
 * refer to spec/ddp-semantics.md. */
#ifndef DDP_SRC_REDUCER_INTERNAL_H
#define DDP_SRC_REDUCER_INTERNAL_H

#include "common/common.h"
#include "ddp/reducer.h"

#define DDP__DDP_MAGIC 0x44445052u /* "DDPR" */

/* The handle's last error: the same ddp_error_t as every handle (DDP_ERROR_MSG_MAX has
 * room for PyTorch's longest texts). */
typedef ddp_error_t ddp__ddp_error_t;

/* One gradient bucket: managed parameters vars[] at element offsets[] of one flat buffer
 * from ddp_pg_alloc (so the shm backend reduces it in place). */
typedef struct ddp__bucket {
  ddp_dtype_t dtype;
  size_t nvars;
  size_t *vars;
  size_t *offsets;
  size_t numel;
  size_t limit;
  void *buf;
  size_t pending; /* variables not yet ready in this backward */
  ddp_work_t *work;
  int64_t t_launch;
  /* with a comm hook: what the hook sees and what it returned */
  ddp_grad_bucket_t gb;
  ddp_param_t **gb_params;
  ddp_comm_work_t *cwork;
  struct ddp__inv_bucket *inv; /* world_size_invariant_shards (invariant.c); NULL: off */
} ddp__bucket_t;

/* One complete ("X") event of the Chrome trace. */
typedef struct ddp__trace_ev {
  const char *name;
  int64_t ts, dur; /* ns */
  int tid;         /* 0 compute, 1 communication */
  int64_t bucket;  /* -1 when not a bucket */
  int64_t bytes;
} ddp__trace_ev_t;

/* A bucket layout as get_ddp_logging_data reports it (sizes in bytes, limits INT64_MAX for
 * none, per-bucket parameter indices). */
typedef struct ddp__layout {
  size_t nb;
  int64_t *sizes;  /* nb */
  int64_t *limits; /* nb */
  size_t *offs;    /* nb + 1 */
  size_t *idx;     /* offs[nb] */
} ddp__layout_t;

struct ddp_ddp {
  uint32_t magic;
  ddp_model_t *model;     /* borrowed */
  ddp_pg_t *pg;           /* borrowed */
  ddp_ddp_options_t opts; /* opts.trace_path is NULL: trace_path below is the copy */
  int rank, world;
  size_t bucket_bytes_cap, first_bucket_bytes_cap;
  size_t bcast_bytes; /* chunk limit of the coalesced broadcasts */

  /* Managed parameters (create.c). The per-parameter arrays below, marked [P] or
   * [nmodel], are carved from the one block param_mem. */
  size_t P;             /* managed parameters */
  size_t nmodel;        /* parameters of the model, frozen ones included */
  void *param_mem;      /* the block every per-parameter array points into */
  ddp_param_t **params; /* [P] managed index -> model parameter */
  size_t *mindex;       /* [nmodel] model index -> managed index, SIZE_MAX when frozen */

  /* buckets (buckets.c) */
  size_t *param_bucket; /* [P] managed index -> bucket */
  size_t *param_offset; /* [P] managed index -> element offset in its bucket */
  ddp__bucket_t *buckets;
  size_t nbuckets;
  size_t next_bucket; /* the next to launch (§3.5) */

  /* comm hook (comm_hook.c) */
  bool hooks_set;     /* the model's grad-ready hooks point here */
  bool has_comm_hook; /* a registered comm hook replaces the allreduce, no pre-divide */
  ddp_comm_hook_t comm_hook;
  char *comm_hook_name;
  int64_t comm_bytes_step;  /* payload bytes of the last synced step without a hook */
  int64_t comm_numel_total; /* elements all-reduced so far without a hook */

  /* per backward (backward.c, finalize.c) */
  ddp_ctx_t *ctx;
  bool expect_hooks;
  bool require_finalize;
  bool marked_unused; /* the unused set was marked ready at this backward's first hook */
  bool first_hook_seen;
  bool finalize_queued;
  bool *ready;         /* [P] */
  size_t *ready_order; /* [P] */
  size_t nready_order;
  size_t *prev_ready_order; /* [P] */
  size_t nprev_ready_order;
  ddp_status_t hook_status;
  ddp_local_grad_fn local_fn; /* ddp_ddp_set_local_grad_fn; NULL: none */
  void *local_user;
  bool *reached; /* [P] a gradient reached the parameter (its hook fired) since it was last
                  * marked ready: what local_fn calls None otherwise, as PyTorch's tensor
                  * hooks see no gradient, even when zero_grad left zeros in .grad */

  /* unused parameters (backward.c) */
  bool *unused;        /* [P] from the graph search (dynamic) or iteration 1 (static) */
  size_t *unused_list; /* [P] */
  size_t nunused;
  bool *visited;        /* [P] */
  int32_t *local_used;  /* [P] */
  int32_t *global_used; /* ddp_pg_alloc; result of the used-map allreduce */
  ddp_work_t *used_work;
  bool used_waited;
  bool warned_no_unused;
  bool prev_unused_valid;
  bool *prev_unused; /* [P] */
  bool unused_changed;

  /* static graph (backward.c) */
  int *fire_expected; /* [P] */
  int *fire_left;     /* [P] */
  bool static_first_done;
  bool in_delayed; /* delayed_all_reduce is marking: it finalizes itself */

  /* world_size_invariant_shards (invariant.c) */
  int64_t inv_k;      /* K; 0: off */
  int inv_s;          /* K / W: shards per rank and step */
  int inv_seen;       /* shards (forwards with grad) begun in this step */
  bool *inv_written;  /* [inv_s * P] shard s stored parameter i */
  size_t *inv_blk;    /* [P] parameter i's first block in its bucket's exps */
  size_t inv_pending; /* b + 1: bucket b's exponents allreduce is launched, its SUM not yet */

  /* sync state (§5, §6; forward.c) */
  bool require_backward_grad_sync;
  bool require_forward_param_sync;

  /* rebuild (§2.3; buckets.c) */
  bool has_rebuilt;
  size_t *rebuilt; /* [P] the recorded ready order */
  size_t nrebuilt;

  /* join() (§9.2; join.c) */
  bool join_enabled;
  bool join_divide_initial;
  bool join_throw;
  int32_t *join_count; /* ddp_pg_alloc: the not-joined count of this iteration */
  ddp_work_t *join_work;
  int div_factor; /* 0 = not fixed yet in this backward */

  /* statistics (stats.c) */
  int64_t num_iterations;
  char dtypes[64];
  ddp__layout_t initial, rebuilt_stats;
  int64_t t_fwd_start, t_fwd_end, t_bwd_start, t_bwd_compute_end, t_comm_start, t_comm_end;
  int64_t sum_fwd, sum_bwd, sum_comm, sum_overlap, nsamples;
  int64_t unused_bytes;

  /* timeline (trace.c) */
  char *trace_path;
  ddp__trace_ev_t *ev;
  size_t nev, cap_ev;
  int64_t t_pre_forward;

  ddp__ddp_error_t err; /* error.c */
  ddp_error_t pg_err;   /* error.c: the group's last error, copied out by ddp__ddp_pg_error */
  ddp_error_t ctx_err;  /* error.c: the context's last error, copied out by ddp__ddp_ctx_error */
};

static inline size_t ddp__ddp_esz(const ddp_param_t *p) { return ddp_dtype_size(p->value.dtype); }
static inline size_t ddp__ddp_pbytes(const ddp_param_t *p) {
  return (size_t)p->value.numel * ddp__ddp_esz(p);
}
/* Managed parameter i's slot in its bucket's flat buffer. */
static inline void *ddp__ddp_slot(ddp_ddp_t *d, size_t i) {
  ddp__bucket_t *b = &d->buckets[d->param_bucket[i]];
  return (char *)b->buf + d->param_offset[i] * ddp_dtype_size(b->dtype);
}

/* ---------------------------------------------------------------- error.c --------- */

/* A failure the reducer detects itself (a shape mismatch, a parameter marked twice, out of
 * memory): fills the last error and logs it once at ERROR. Returns st. */
ddp_status_t ddp__ddp_fail(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...) DDP_PRINTF(3, 4);
/* A failure carried up from a lower layer that has logged it (a collective, the autograd
 * context): fills the last error with the reducer's context, does not log. Returns st. */
ddp_status_t ddp__ddp_carry(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...) DDP_PRINTF(3, 4);
/* ddp__ddp_fail with "[rank r] DDP: out of memory". */
ddp_status_t ddp__ddp_oom(ddp_ddp_t *d);
void ddp__ddp_error_clear(ddp_ddp_t *d);
/* The process group's last error, copied out under the group's lock into the handle
 * (valid until the next call). */
const char *ddp__ddp_pg_error(ddp_ddp_t *d);
/* The autograd context's last error, copied out into the handle (valid until the next
 * call; the handle's scratch keeps 8 KiB off the hooks' stacks). */
const char *ddp__ddp_ctx_error(ddp_ddp_t *d, const ddp_ctx_t *ctx);
/* Copies the message into err (NULL:
 * nothing) with status st. */
void ddp__ddp_error_copy(const ddp_ddp_t *d, ddp_status_t st, ddp_error_t *err);
/* Waits for *w (NULL: nothing) and frees it. A failure is carried into the last error as
 * "DDP <what> failed: <the work's message>". */
ddp_status_t ddp__ddp_wait(ddp_ddp_t *d, ddp_work_t **w, const char *what);
/* Waits for *w (NULL: nothing) and frees it, ignoring its status: for works in flight
 * after an earlier failure, whose error is already recorded. */
void ddp__ddp_drain(ddp_work_t **w);
/* Appends the names of managed parameters idx[0..n) to the string in buf (cap bytes),
 * separated by sep, truncated at cap. */
void ddp__ddp_append_names(char *buf, size_t cap, const ddp_ddp_t *d, const size_t *idx, size_t n,
                           const char *sep);

/* ---------------------------------------------------------------- broadcast.c ----- */

/* _sync_module_states: every parameter and, with broadcast_buffers, every buffer from
 * root (§1.4). */
ddp_status_t ddp__ddp_sync_module_states(ddp_ddp_t *d, int root);
/* The buffers from root, before a synchronised forward (§5). */
ddp_status_t ddp__ddp_sync_buffers(ddp_ddp_t *d, int root);

/* ---------------------------------------------------------------- buckets.c ------- */

/* The construction-time layout (§2.2) and its buckets. */
ddp_status_t ddp__ddp_init_initial_buckets(ddp_ddp_t *d);
/* _rebuild_buckets (§2.3) when one is due; DDP_OK otherwise. */
ddp_status_t ddp__ddp_rebuild_buckets(ddp_ddp_t *d);
/* Whether this backward records the ready order for the one-time rebuild. */
bool ddp__ddp_should_rebuild(const ddp_ddp_t *d);
/* Frees n buckets, waiting for any work in flight, and the array itself. */
void ddp__ddp_free_buckets(ddp_ddp_t *d, ddp__bucket_t *b, size_t n);

/* ---------------------------------------------------------------- backward.c ------ */

/* The model's gradient-ready hook (§3.3); user is the handle. */
void ddp__ddp_grad_hook(void *user, ddp_param_t *p, int fire);
/* prepare_for_backward (§3.2) with the unused-parameter search of §4.1. */
void ddp__ddp_prepare_backward(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n, ddp_var_t *const *outputs);

/* ---------------------------------------------------------------- finalize.c ------ */

/* finalize_backward (§3.6). */
ddp_status_t ddp__ddp_finalize(ddp_ddp_t *d);

/* ---------------------------------------------------------------- join.c ---------- */

/* A forward's share of join() on a rank that has not joined (Join.notify_join_context):
 * the early-termination vote (with throw_on_early_termination) and the asynchronous
 * not-joined count; then the rank whose buffers are broadcast (the largest not joined);
 * then the backward-sync flag. */
ddp_status_t ddp__ddp_join_notify(ddp_ddp_t *d);
ddp_status_t ddp__ddp_join_buffers_root(ddp_ddp_t *d, int *root);
ddp_status_t ddp__ddp_join_sync_flag(ddp_ddp_t *d);

/* ---------------------------------------------------------------- invariant.c ----- */

/* world_size_invariant_shards: the options check and the per-shard arrays (create). */
ddp_status_t ddp__inv_init(ddp_ddp_t *d);
void ddp__inv_free(ddp_ddp_t *d);
/* A forward with grad begins shard inv_seen; more than K / W in a step is an error. */
ddp_status_t ddp__inv_begin_shard(ddp_ddp_t *d);
/* Arming the synchronising backward: it must be this step's last shard. */
ddp_status_t ddp__inv_check_sync(ddp_ddp_t *d);
/* The grad-ready hook's part: parameter i's gradient of this shard is stored apart (its
 * block exponents noted) and the gradient zeroed for the next shard. */
ddp_status_t ddp__inv_store(ddp_ddp_t *d, size_t i);
/* Bucket b is ready: its exponents' allreduce (MAX) is launched. Once it is done the
 * shards are deposited and the accumulators' allreduce (SUM) launched into b->work: at the
 * first grad-ready hook that finds it done (ddp__inv_poll), at the next bucket's launch
 * (so every rank issues MAX b, SUM b, MAX b + 1, ...) or at once for the last bucket. */
ddp_status_t ddp__inv_launch(ddp_ddp_t *d, size_t b);
/* The pending bucket's deposit and SUM, if its MAX is done (block: waiting for it). */
ddp_status_t ddp__inv_poll(ddp_ddp_t *d, bool block);
/* After bucket x's allreduce: the mean of its k-th parameter into out (that parameter's
 * gradient, or its slot of the bucket with gradient_as_bucket_view). */
void ddp__inv_result(ddp_ddp_t *d, const ddp__bucket_t *x, size_t k, void *out);
/* End of a synchronised step: the shard count starts again. */
void ddp__inv_end_step(ddp_ddp_t *d);
void ddp__inv_bucket_free(ddp_ddp_t *d, ddp__bucket_t *x);

/* ---------------------------------------------------------------- comm_hook.c ----- */

/* Calls the registered hook on bucket b. */
ddp_status_t ddp__ddp_run_comm_hook(ddp_ddp_t *d, size_t b);
/* Resolves bucket b's hook future into its flat buffer; report false when an earlier
 * failure is already recorded (the future is then only waited for and freed). */
ddp_status_t ddp__ddp_resolve_comm_hook(ddp_ddp_t *d, size_t b, bool report);

/* ---------------------------------------------------------------- stats.c --------- */

/* Fills d->dtypes ("F32" or "F32,F64"). */
void ddp__ddp_describe_dtypes(ddp_ddp_t *d);
/* The INFO lines of a constructed reducer. */
void ddp__ddp_log_initialized(const ddp_ddp_t *d);
/* Records a layout for get_ddp_logging_data; frees one. */
void ddp__ddp_layout_free(ddp__layout_t *ls);
void ddp__ddp_record_layout(ddp_ddp_t *d, ddp__layout_t *ls, const ddp_bucket_assignment_t *a);
/* The timings of a finalized backward, on sampled iterations. */
void ddp__ddp_stats_sample_end(ddp_ddp_t *d);

/* ---------------------------------------------------------------- trace.c --------- */

/* Copies path into the handle and, on rank 0, starts the file ("[\n"). */
ddp_status_t ddp__ddp_trace_open(ddp_ddp_t *d, const char *path);
/* Records one event [t0, t1] when tracing (best effort). */
void ddp__ddp_trace(ddp_ddp_t *d, const char *name, int64_t t0, int64_t t1, int tid, int64_t bucket,
                    int64_t bytes);
/* Appends the recorded events to the file and frees them. */
void ddp__ddp_trace_close(ddp_ddp_t *d);
/* The flight recorder's tag for the next collective: bucket b and its parameter names
 * (nothing when the recorder is off). Below both launch paths (backward.c's and
 * invariant.c's), so that neither calls the other for it. */
void ddp__ddp_tag_bucket(ddp_ddp_t *d, size_t b);

#endif /* DDP_SRC_REDUCER_INTERNAL_H */
