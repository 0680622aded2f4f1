/* join() for uneven inputs (§9.2): Join's context manager with DDP's join hook, as a
 * begin/end pair. While join is on, each forward of a rank with data adds the join
 * collectives (ddp__ddp_join_notify, _buffers_root, _sync_flag, called by forward.c); a
 * rank out of data calls ddp_ddp_join_end, which shadows the other ranks' iterations with
 * the same collectives in the same order (zeros for its gradients) until every rank has
 * joined, then broadcasts the last joiner's parameters and buffers to all. */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* A one-element int32 allreduce, waited for: the join protocol's counters and votes. */
static ddp_status_t small_allreduce(ddp_ddp_t *d, int32_t v, ddp_redop_t op, const char *what,
                                    int32_t *out) {
  int32_t *buf = d->join_count + 1;
  buf[0] = v;
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(d->pg, buf, buf, 1, DDP_I32, op, &w);
  if (st != DDP_OK) return ddp__ddp_carry(d, st, "DDP %s: %s", what, ddp__ddp_pg_error(d));
  DDP_CHECK(ddp__ddp_wait(d, &w, what));
  *out = buf[0];
  return DDP_OK;
}

/* _find_common_rank: the largest rank whose condition holds (allreduce MAX). */
static ddp_status_t find_common_rank(ddp_ddp_t *d, int rank, bool cond, int *out) {
  int32_t r;
  DDP_CHECK(
      small_allreduce(d, cond ? rank : -1, DDP_OP_MAX, "join: allreduce of the common rank", &r));
  if (r < 0)
    return ddp__ddp_fail(d, DDP_ERR_INTERNAL,
                         "BUG! Expected rank_cond to be true for at least one process. (rank %d)",
                         d->rank);
  *out = r;
  return DDP_OK;
}

/* With throw_on_early_termination a vote that fails every rank once one is out of data,
 * then the asynchronous "not joined" count whose sum is the divide factor when
 * divide_by_initial_world_size is false. */
ddp_status_t ddp__ddp_join_notify(ddp_ddp_t *d) {
  if (d->join_throw) {
    int32_t out;
    DDP_CHECK(small_allreduce(d, 0, DDP_OP_SUM, "join: early-termination vote", &out));
    if (out > 0)
      return ddp__ddp_fail(d, DDP_ERR_ABORTED,
                           "Detected at least one rank that exhausted inputs. Throwing across all "
                           "ranks. (rank %d)",
                           d->rank);
  }
  DDP_CHECK(ddp__ddp_wait(d, &d->join_work, "join: allreduce of the not-joined count"));
  d->join_count[0] = 1;
  ddp_status_t st = ddp_allreduce(d->pg, d->join_count, d->join_count, 1, DDP_I32, DDP_OP_SUM,
                                  &d->join_work);
  if (st != DDP_OK) return ddp__ddp_carry(d, st, "DDP join: %s", ddp__ddp_pg_error(d));
  return DDP_OK;
}

ddp_status_t ddp__ddp_join_buffers_root(ddp_ddp_t *d, int *root) {
  return find_common_rank(d, d->rank, true, root);
}

ddp_status_t ddp__ddp_join_sync_flag(ddp_ddp_t *d) {
  int32_t flag;
  return small_allreduce(d, d->require_backward_grad_sync ? 1 : 0, DDP_OP_SUM,
                         "join: backward-sync flag", &flag);
}

ddp_status_t ddp_ddp_join_begin(ddp_ddp_t *d, bool divide_by_initial_world_size,
                                bool throw_on_early_termination) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  if (d->opts.static_graph)
    return ddp__ddp_fail(d, DDP_ERR_UNSUPPORTED,
                         "[rank %d] DDP: join() with static_graph is not supported by libddp",
                         d->rank);
  if (d->inv_k) /* uneven inputs change the set of shards, which the mode fixes */
    return ddp__ddp_fail(d, DDP_ERR_UNSUPPORTED,
                         "[rank %d] DDP: join() is refused with world_size_invariant_shards: the "
                         "mode needs every rank to run its K / W shards in every step",
                         d->rank);
  d->join_enabled = true;
  d->join_divide_initial = divide_by_initial_world_size;
  d->join_throw = throw_on_early_termination;
  return DDP_OK;
}

/* The shadow of a synchronising backward: one allreduce (or comm hook) of zeros per bucket
 * in order, then, under find_unused_parameters, the used map. After a failure no further
 * collective starts; those in flight are drained. */
static ddp_status_t shadow_backward(ddp_ddp_t *d) {
  ddp_status_t st = DDP_OK;
  for (size_t b = 0; b < d->nbuckets && st == DDP_OK; b++) {
    ddp__bucket_t *x = &d->buckets[b];
    if (d->opts.gradient_as_bucket_view)
      for (size_t k = 0; k < x->nvars; k++) /* keep the grads, which live here */
        if (d->params[x->vars[k]]->grad.data) ddp_param_set_grad_data(d->params[x->vars[k]], NULL);
    memset(x->buf, 0, x->numel * ddp_dtype_size(x->dtype));
    if (d->has_comm_hook) {
      st = ddp__ddp_run_comm_hook(d, b);
      continue;
    }
    st = ddp_allreduce(d->pg, x->buf, x->buf, x->numel, x->dtype, DDP_OP_SUM, &x->work);
    if (st != DDP_OK) ddp__ddp_carry(d, st, "DDP join: bucket %zu: %s", b, ddp__ddp_pg_error(d));
  }
  for (size_t b = 0; b < d->nbuckets; b++) {
    ddp__bucket_t *x = &d->buckets[b];
    char what[64];
    snprintf(what, sizeof what, "join: shadow allreduce of bucket %zu", b);
    if (x->cwork) {
      ddp_status_t ws = ddp__ddp_resolve_comm_hook(d, b, st == DDP_OK);
      if (st == DDP_OK) st = ws;
    } else if (st == DDP_OK) {
      st = ddp__ddp_wait(d, &x->work, what);
    } else {
      ddp__ddp_drain(&x->work);
    }
  }
  if (st != DDP_OK || !d->opts.find_unused_parameters) return st;
  memset(d->global_used, 0, d->P * sizeof *d->global_used);
  st = ddp_allreduce(d->pg, d->global_used, d->global_used, d->P, DDP_I32, DDP_OP_SUM,
                     &d->used_work);
  if (st != DDP_OK)
    return ddp__ddp_carry(d, st, "DDP join: shadow used-map allreduce: %s", ddp__ddp_pg_error(d));
  return ddp__ddp_wait(d, &d->used_work, "join: shadow used-map allreduce");
}

/* One iteration of a rank still training, shadowed: the pending rebuild, the buffer
 * broadcast from the agreed rank, the backward-sync vote and, when they synchronise, the
 * backward's collectives. */
static ddp_status_t shadow_iteration(ddp_ddp_t *d) {
  DDP_CHECK(ddp__ddp_rebuild_buckets(d));
  if (d->require_forward_param_sync && d->opts.broadcast_buffers &&
      ddp_model_num_buffers(d->model) > 0) {
    int root = 0;
    DDP_CHECK(find_common_rank(d, d->rank, false, &root));
    DDP_CHECK(ddp__ddp_sync_buffers(d, root));
  }
  int32_t sync;
  DDP_CHECK(small_allreduce(d, 0, DDP_OP_SUM, "join: backward-sync flag", &sync));
  d->require_forward_param_sync = sync != 0;
  if (!sync) return DDP_OK;
  DDP_CHECK(shadow_backward(d));
  if (ddp__ddp_should_rebuild(d)) {
    for (size_t i = 0; i < d->P; i++) d->rebuilt[i] = i;
    d->nrebuilt = d->P;
  }
  return DDP_OK;
}

/* The joined rank's loop (Join.__exit__ with DDP's join hook): while any rank is still
 * training, shadow one iteration of theirs, then the last joiner's parameters and buffers
 * go to all. */
ddp_status_t ddp_ddp_join_end(ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  if (!d->join_enabled) return DDP_OK;
  ddp__ddp_error_clear(d);
  DDP_CHECK(ddp__ddp_wait(d, &d->join_work, "join: allreduce of the not-joined count"));
  if (d->join_throw) {
    int32_t out;
    d->join_enabled = false;
    DDP_CHECK(small_allreduce(d, 1, DDP_OP_SUM, "join: early-termination vote", &out));
    return ddp__ddp_fail(d, DDP_ERR_ABORTED, "Rank %d exhausted all inputs.", d->rank);
  }
  bool last = true;
  ddp_status_t st = DDP_OK;
  for (;;) {
    int32_t active;
    DDP_CHECK_GOTO(small_allreduce(d, 0, DDP_OP_SUM, "join: allreduce of the not-joined count",
                                   &active),
                   st, out);
    if (active == 0) break;
    last = false;
    DDP_CHECK_GOTO(shadow_iteration(d), st, out);
  }
  int root = 0;
  DDP_CHECK_GOTO(find_common_rank(d, d->rank, last, &root), st, out);
  DDP_CHECK_GOTO(ddp__ddp_sync_module_states(d, root), st, out);
out:
  d->join_enabled = false;
  return st;
}
