/* The backward side of a step (§3.2-3.5, §4): arming a backward at post-forward (with
 * find_unused_parameters' graph search for unused parameters), the gradient-ready hook,
 * mark_variable_ready (the averaged copy into the bucket slot), the strictly in-order
 * bucket launch while backward still runs, and static_graph's delayed allreduce at the
 * end of its first backward. The end of the backward is finalize.c's.
 *
 * The hook cannot return a status: the first error is kept in hook_status and reported by
 * ddp_ddp_backward (and by the next forward, as PyTorch's unfinished reduction). */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* ---------------------------------------------------------------- arming ---------- */

static void visit_used(void *user, ddp_param_t *p) {
  ddp_ddp_t *d = user;
  size_t i = p->index < d->nmodel ? d->mindex[p->index] : SIZE_MAX;
  if (i != SIZE_MAX) d->visited[i] = true;
}

/* §4.1: the parameters the graph from the outputs does not reach are this backward's
 * unused set, marked ready at its first hook. */
static void search_unused(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n, ddp_var_t *const *outputs) {
  memset(d->visited, 0, d->P * sizeof *d->visited);
  ddp_graph_visit_params(ctx, n, outputs, visit_used, d);
  d->nunused = 0;
  d->unused_bytes = 0;
  for (size_t i = 0; i < d->P; i++) {
    d->unused[i] = !d->visited[i];
    if (d->unused[i]) {
      d->unused_list[d->nunused++] = i;
      d->unused_bytes += (int64_t)ddp__ddp_pbytes(d->params[i]);
      ddp__log(d->rank, DDP_LOG_DETAIL, "Parameter %s at index %zu is marked as unused.",
               d->params[i]->name, i);
    }
  }
  if (d->prev_unused_valid && memcmp(d->prev_unused, d->unused, d->P * sizeof(bool)) != 0)
    d->unused_changed = true;
  memcpy(d->prev_unused, d->unused, d->P * sizeof(bool));
  d->prev_unused_valid = true;
  if (d->nunused == 0 && !d->warned_no_unused) {
    d->warned_no_unused = true;
    ddp__log(d->rank, DDP_LOG_WARN,
             "find_unused_parameters=True was specified in DDP constructor, but did not find "
             "any unused parameters in the forward pass. This flag results in an extra "
             "traversal of the autograd graph every iteration,  which can adversely affect "
             "performance. If your model indeed never has any unused parameters in the "
             "forward pass, consider turning this flag off. Note that this warning may be a "
             "false positive if your model has flow control causing later iterations to have "
             "unused parameters.");
  }
}

void ddp__ddp_prepare_backward(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n, ddp_var_t *const *outputs) {
  d->expect_hooks = true;
  d->first_hook_seen = false;
  d->marked_unused = false;
  d->finalize_queued = false;
  d->nready_order = 0;
  d->next_bucket = 0;
  d->t_comm_start = 0;
  memset(d->ready, 0, d->P * sizeof *d->ready);
  for (size_t b = 0; b < d->nbuckets; b++) d->buckets[b].pending = d->buckets[b].nvars;
  if (!d->has_rebuilt) d->nrebuilt = 0;
  if (d->opts.static_graph && d->static_first_done)
    memcpy(d->fire_left, d->fire_expected, d->P * sizeof *d->fire_left);
  if (d->opts.find_unused_parameters && !d->opts.static_graph) search_unused(d, ctx, n, outputs);
}

/* ---------------------------------------------------------------- launch ---------- */

/* Launching means one allreduce SUM of the whole flat buffer (no comm hook: the copy-in
 * already multiplied by 1/W), or a call of the registered comm hook. Buckets go strictly
 * in index order (§3.5): a ready bucket waits for every lower-indexed one. */
static ddp_status_t launch_ready(ddp_ddp_t *d) {
  while (d->next_bucket < d->nbuckets && d->buckets[d->next_bucket].pending == 0) {
    ddp__bucket_t *b = &d->buckets[d->next_bucket];
    if (d->t_comm_start == 0) d->t_comm_start = ddp_now_ns();
    b->t_launch = ddp_now_ns();
    /* invariant mode: the previous bucket's SUM goes first, so the tag is this bucket's */
    if (d->inv_k) DDP_CHECK(ddp__inv_poll(d, true));
    ddp__ddp_tag_bucket(d, d->next_bucket);
    if (d->has_comm_hook || d->inv_k) {
      DDP_CHECK(d->inv_k ? ddp__inv_launch(d, d->next_bucket)
                         : ddp__ddp_run_comm_hook(d, d->next_bucket));
      d->next_bucket++;
      continue;
    }
    if (d->next_bucket == 0) d->comm_bytes_step = 0;
    d->comm_bytes_step += (int64_t)(b->numel * ddp_dtype_size(b->dtype));
    d->comm_numel_total += (int64_t)b->numel;
    ddp_status_t st = ddp_allreduce(d->pg, b->buf, b->buf, b->numel, b->dtype, DDP_OP_SUM,
                                    &b->work);
    if (st != DDP_OK) /* the group logged why */
      return ddp__ddp_carry(d, st, "DDP: launching the allreduce of bucket %zu failed: %s",
                            d->next_bucket, ddp__ddp_pg_error(d));
    d->next_bucket++;
  }
  return DDP_OK;
}

static ddp_status_t finalize_cb(void *user) { return ddp__ddp_finalize(user); }

/* Every bucket is launched: under dynamic find_unused start the used-map allreduce, and
 * queue the finalize at the end of backward (static_graph's delayed allreduce finalizes
 * itself). */
static ddp_status_t queue_finalize(ddp_ddp_t *d) {
  if (d->opts.find_unused_parameters && !d->opts.static_graph) {
    d->used_waited = false;
    ddp_status_t st = ddp_allreduce(d->pg, d->local_used, d->global_used, d->P, DDP_I32, DDP_OP_SUM,
                                    &d->used_work);
    if (st != DDP_OK)
      return ddp__ddp_carry(d, st, "DDP: launching the used-parameter allreduce failed: %s",
                            ddp__ddp_pg_error(d));
  }
  d->finalize_queued = true;
  if (d->in_delayed) return DDP_OK;
  ddp_status_t st = ddp_ctx_queue_callback(d->ctx, finalize_cb, d);
  if (st != DDP_OK) /* the context logged it */
    return ddp__ddp_carry(d, st, "[rank %d] DDP: %s", d->rank, ddp__ddp_ctx_error(d, d->ctx));
  return DDP_OK;
}

/* ---------------------------------------------------------------- readiness ------- */

static ddp_status_t marked_twice(ddp_ddp_t *d, size_t i) {
  enum { CAP = DDP_ERROR_MSG_MAX };
  char buf[CAP];
  snprintf(buf, sizeof buf,
           "Expected to mark a variable ready only once. This error is caused by one of the "
           "following reasons: 1) Use of a module parameter outside the `forward` function. "
           "Please make sure model parameters are not shared across multiple concurrent "
           "forward-backward passes. or try to use _set_static_graph() as a workaround if "
           "this module graph does not change during training loop.2) Reused parameters in "
           "multiple reentrant backward passes. For example, if you use multiple `checkpoint` "
           "functions to wrap the same part of your model, it would result in the same set of "
           "parameters been used by different reentrant backward passes multiple times, and "
           "hence marking a variable ready multiple times. DDP does not support such use "
           "cases in default. You can try to use _set_static_graph() as a workaround if your "
           "module graph does not change over iterations.");
  size_t len = strlen(buf);
  if (d->marked_unused)
    len += (size_t)snprintf(
        buf + len, sizeof buf - len,
        "\n3) Incorrect unused parameter detection. The return value of the `forward` "
        "function is inspected by the distributed data parallel wrapper to figure out if any "
        "of the module's parameters went unused. For unused parameters, DDP would not expect "
        "gradients from then. However, if an unused parameter becomes part of the autograd "
        "graph at a later point in time (e.g., in a reentrant backward when using "
        "`checkpoint`), the gradient will show up unexpectedly. If all parameters in the "
        "model participate in the backward pass, you can disable unused parameter detection "
        "by passing the keyword argument `find_unused_parameters=False` to "
        "`torch.nn.parallel.DistributedDataParallel`. If unused parameters in the model do "
        "not change over iterations, You can try to use _set_static_graph() as a workaround "
        "if this module graph does not change over iterations.");
  snprintf(buf + DDP_MIN(len, sizeof buf - 1), sizeof buf - DDP_MIN(len, sizeof buf - 1),
           "\nParameter at index %zu with name %s has been marked as ready twice. This means "
           "that multiple autograd engine  hooks have fired for this particular parameter "
           "during this iteration. (rank %d)",
           i, d->params[i]->name, d->rank);
  return ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE, "%s", buf);
}

/* The divisor of this backward, fixed at its first ready parameter: W, or under join()
 * with divide_by_initial_world_size=false the number of ranks not yet joined, from this
 * iteration's forward allreduce. */
static ddp_status_t fix_div_factor(ddp_ddp_t *d) {
  d->div_factor = d->world;
  if (d->join_work) {
    DDP_CHECK(ddp__ddp_wait(d, &d->join_work, "join: allreduce of the not-joined count"));
    if (!d->join_divide_initial && d->join_count[0] > 0) d->div_factor = d->join_count[0];
  }
  return DDP_OK;
}

/* The F32 bucket copies, in every variant (DDP_VEC_CLONES): a lane computes what the
 * scalar loop does. */
DDP_VEC_CLONES static void mul_f32(float *restrict s, const float *restrict g, float r, size_t n) {
  for (size_t k = 0; k < n; k++) s[k] = g[k] * r;
}

DDP_VEC_CLONES static void div_f32(float *s, float w, size_t n) {
  for (size_t k = 0; k < n; k++) s[k] /= w;
}

/* Parameter i's gradient into its slot: grad * fl(1/W) (or divided in place when the grad
 * already is the slot); with a comm hook undivided, the hook divides (spec §7.1). */
static void copy_into_slot(ddp_ddp_t *d, ddp_param_t *p, void *slot) {
  size_t n = (size_t)p->value.numel;
  if (!p->grad.data) {
    memset(slot, 0, ddp__ddp_pbytes(p));
  } else if (d->has_comm_hook) {
    if (p->grad.data != slot) memcpy(slot, p->grad.data, ddp__ddp_pbytes(p));
    if (d->opts.gradient_as_bucket_view) ddp_param_set_grad_data(p, slot);
  } else if (p->grad.data == slot) {
    /* Bucket-view path: upstream divides in place (true division). */
    if (p->value.dtype == DDP_F32) {
      div_f32(slot, (float)d->div_factor, n);
    } else {
      double *s = slot;
      for (size_t k = 0; k < n; k++) s[k] /= (double)d->div_factor;
    }
  } else {
    /* One multiply by the reciprocal, computed in double and rounded to the dtype. */
    if (p->value.dtype == DDP_F32) {
      mul_f32(slot, p->grad.data, (float)(1.0 / d->div_factor), n);
    } else {
      double r = 1.0 / d->div_factor;
      double *s = slot;
      const double *g = p->grad.data;
      for (size_t k = 0; k < n; k++) s[k] = g[k] * r;
    }
    if (d->opts.gradient_as_bucket_view) ddp_param_set_grad_data(p, slot);
  }
}

/* mark_variable_ready (§3.4): copy into the slot, count the bucket down, launch what is
 * ready, and once the last bucket is launched queue the finalize. */
static ddp_status_t mark_ready(ddp_ddp_t *d, size_t i) {
  if (d->ready[i]) return marked_twice(d, i);
  if (d->div_factor == 0) DDP_CHECK(fix_div_factor(d));
  d->ready[i] = true;
  d->require_finalize = true;
  ddp_param_t *p = d->params[i];
  if (!d->inv_k) { /* invariant mode: the shards were stored by the hook */
    if (d->local_fn && (d->reached[i] || !p->grad.data)) {
      d->local_fn(d->local_user, p);
    } else if (d->local_fn) { /* zeros left by zero_grad(set_to_none=False): None locally */
      ddp_param_t none = *p;
      none.grad.data = NULL;
      d->local_fn(d->local_user, &none);
    }
    copy_into_slot(d, p, ddp__ddp_slot(d, i));
  }
  d->reached[i] = false;
  ddp__bucket_t *b = &d->buckets[d->param_bucket[i]];
  b->pending--;
  DDP_CHECK(launch_ready(d));
  if (d->next_bucket == d->nbuckets && !d->finalize_queued) return queue_finalize(d);
  return DDP_OK;
}

static void mark_unused_ready(ddp_ddp_t *d) {
  if (d->marked_unused) return;
  d->marked_unused = true;
  for (size_t k = 0; k < d->nunused && d->hook_status == DDP_OK; k++)
    d->hook_status = mark_ready(d, d->unused_list[k]);
}

/* static_graph, backward 1 (§4.6): runs at the end of backward. The used map is reduced,
 * parameters that never fired become the unused set, then every parameter is marked ready
 * in index order (launching buckets as they fill) and the backward is finalized. */
static ddp_status_t delayed_all_reduce(void *user) {
  ddp_ddp_t *d = user;
  if (d->hook_status != DDP_OK) return d->hook_status;
  d->used_waited = false;
  ddp_status_t st = ddp_allreduce(d->pg, d->local_used, d->global_used, d->P, DDP_I32, DDP_OP_SUM,
                                  &d->used_work);
  if (st == DDP_OK)
    st = ddp__ddp_wait(d, &d->used_work, "allreduce of the used-parameter map");
  else
    ddp__ddp_carry(d, st, "DDP: used-parameter allreduce: %s", ddp__ddp_pg_error(d));
  if (st != DDP_OK) return st;
  d->used_waited = true;
  d->nunused = 0;
  d->unused_bytes = 0;
  for (size_t i = 0; i < d->P; i++) {
    d->unused[i] = d->fire_expected[i] == 0;
    if (d->unused[i]) {
      d->unused_list[d->nunused++] = i;
      d->unused_bytes += (int64_t)ddp__ddp_pbytes(d->params[i]);
      ddp__log(d->rank, DDP_LOG_INFO, "DDP static_graph: parameter %s (index %zu) is unused",
               d->params[i]->name, i);
    }
  }
  d->static_first_done = true;
  d->marked_unused = true;
  d->in_delayed = true;
  for (size_t i = 0; i < d->P && st == DDP_OK; i++) st = mark_ready(d, i);
  d->in_delayed = false;
  if (st != DDP_OK) return st;
  return ddp__ddp_finalize(d);
}

/* static_graph's first backward only counts how often each parameter fires; the first
 * hook queues the delayed allreduce. */
static void count_static_fire(ddp_ddp_t *d, size_t i) {
  if (!d->expect_hooks) return;
  if (!d->first_hook_seen) {
    d->first_hook_seen = true;
    ddp_status_t st = ddp_ctx_queue_callback(d->ctx, delayed_all_reduce, d);
    if (st != DDP_OK) /* the context logged it */
      d->hook_status = ddp__ddp_carry(d, st, "[rank %d] DDP: %s", d->rank,
                                      ddp__ddp_ctx_error(d, d->ctx));
  }
  d->fire_expected[i]++;
}

/* The gradient-ready hook (§3.3). */
void ddp__ddp_grad_hook(void *user, ddp_param_t *p, int fire) {
  ddp_ddp_t *d = user;
  (void)fire;
  if (d->hook_status != DDP_OK) return;
  size_t i = p->index < d->nmodel ? d->mindex[p->index] : SIZE_MAX;
  if (i == SIZE_MAX) return;
  d->reached[i] = true;
  if (d->inv_k && (d->hook_status = ddp__inv_store(d, i)) != DDP_OK) return;
  bool static_first = d->opts.static_graph && !d->static_first_done;
  if ((d->opts.find_unused_parameters && !d->opts.static_graph) || static_first)
    if (p->grad.data) d->local_used[i] = 1;
  if (static_first) {
    count_static_fire(d, i);
    return;
  }
  if (!d->expect_hooks) return;
  if (!d->first_hook_seen) d->first_hook_seen = true;
  d->ready_order[d->nready_order < d->P ? d->nready_order++ : d->P - 1] = i;
  mark_unused_ready(d);
  if (d->hook_status != DDP_OK) return;
  if (d->opts.static_graph) {
    if (d->fire_left[i] == 0) {
      d->hook_status = ddp__ddp_fail(
          d, DDP_ERR_INVALID_USAGE,
          "Your training graph has changed in this iteration, e.g., one parameter is unused in "
          "first iteration, but then got used in the second iteration. this is not compatible "
          "with static_graph set to True. (parameter %zu, %s, rank %d)",
          i, d->params[i]->name, d->rank);
      return;
    }
    if (--d->fire_left[i] > 0) return;
  }
  if (ddp__ddp_should_rebuild(d) && d->nrebuilt < d->P) d->rebuilt[d->nrebuilt++] = i;
  d->hook_status = mark_ready(d, i);
}

/* ---------------------------------------------------------------- public ---------- */

ddp_status_t ddp_ddp_backward(ddp_ddp_t *d, ddp_ctx_t *ctx, ddp_var_t *loss) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && ctx && loss);
  d->ctx = ctx;
  d->t_bwd_start = ddp_now_ns();
  ddp_status_t st = ddp_backward(ctx, loss);
  ddp__ddp_trace(d, "backward", d->t_bwd_start, ddp_now_ns(), 0, -1, 0);
  if (d->hook_status != DDP_OK) return d->hook_status;
  if (st != DDP_OK && d->err.status == DDP_OK) /* the context's own failure, logged there */
    ddp__ddp_carry(d, st, "[rank %d] DDP backward: %s", d->rank, ddp__ddp_ctx_error(d, ctx));
  return st;
}

void ddp_ddp_set_local_grad_fn(ddp_ddp_t *d, ddp_local_grad_fn fn, void *user) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  d->local_fn = fn;
  d->local_user = user;
}
