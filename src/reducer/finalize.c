/* finalize_backward (§3.6), run at the end of a synchronised backward: wait for every
 * bucket in index order (resolving comm-hook futures), copy the averaged gradients back
 * into the parameters (or check that they still are the bucket views), and skip
 * parameters unused on every rank, whose gradients stay untouched (§4.3).
 *
 * A failed bucket is recorded once, with its index, its parameters and the hint about
 * unused parameters, into the last error without logging (the group logged the failure).
 * From there on nothing is copied back and no collective is issued; works still in flight
 * (later buckets, the used-map allreduce started at the end of backward) are drained. */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Waits for bucket b's allreduce or hook; records the first failure. */
static ddp_status_t wait_bucket(ddp_ddp_t *d, size_t b, ddp_status_t first) {
  ddp__bucket_t *x = &d->buckets[b];
  bool hooked = x->cwork != NULL; /* the resolve sets its own message */
  ddp_status_t st;
  if (hooked)
    st = ddp__ddp_resolve_comm_hook(d, b, first == DDP_OK);
  else if (x->work)
    st = ddp_work_wait(x->work, -1);
  else
    st = DDP_ERR_INTERNAL;
  ddp__ddp_trace(d, "allreduce bucket", x->t_launch, ddp_now_ns(), 1, (int64_t)b,
                 (int64_t)(x->numel * ddp_dtype_size(x->dtype)));
  if (st != DDP_OK && first == DDP_OK && !hooked) {
    char names[2048] = "";
    ddp__ddp_append_names(names, sizeof names, d, x->vars, x->nvars, ", ");
    if (!x->work)
      ddp__ddp_fail(d, st,
                    "[rank %d] DDP: allreduce of bucket %zu (%zu parameters: %s) was not "
                    "launched",
                    d->rank, b, x->nvars, names);
    else
      ddp__ddp_carry(d, st,
                     "DDP: allreduce of bucket %zu (%zu parameters: %s) failed: %s. If a "
                     "rank's loss did not use one of these parameters, that rank never "
                     "launches this bucket: its next forward names the parameter; "
                     "find_unused_parameters=True handles it.",
                     b, x->nvars, names,
                     ddp_work_error(x->work)[0] ? ddp_work_error(x->work) : ddp__ddp_pg_error(d));
  }
  if (x->work) ddp_work_free(x->work);
  x->work = NULL;
  return st;
}

/* Copies bucket x's averages back into its parameters' gradients. need_used: skip the
 * parameters unused on every rank (waiting for the used map the first time one is
 * locally unused). A gradient that is not its bucket view (gradient_as_bucket_view) is
 * PyTorch's error; the other parameters of the bucket are still handled. */
static ddp_status_t copy_back(ddp_ddp_t *d, ddp__bucket_t *x, bool need_used) {
  ddp_status_t first = DDP_OK;
  for (size_t k = 0; k < x->nvars; k++) {
    size_t i = x->vars[k];
    ddp_param_t *p = d->params[i];
    void *slot = (char *)x->buf + x->offsets[k] * ddp_dtype_size(x->dtype);
    if (need_used && !d->local_used[i]) {
      if (!d->used_waited && d->used_work) {
        ddp_status_t st = ddp__ddp_wait(d, &d->used_work, "allreduce of the used-parameter map");
        if (st != DDP_OK) return st;
        d->used_waited = true;
      }
      if (d->global_used[i] == 0) {
        /* its bucket view, if it is one, holds the (zero) sum as in every other mode */
        if (d->inv_k && p->grad.data == slot) ddp__inv_result(d, x, k, slot);
        continue;
      }
    }
    if (!d->opts.gradient_as_bucket_view) {
      if (!p->grad.data) ddp_param_set_grad_data(p, NULL);
      if (d->inv_k) /* the mean is made straight in the gradient: the slot was never used */
        ddp__inv_result(d, x, k, p->grad.data);
      else
        memcpy(p->grad.data, slot, ddp__ddp_pbytes(p));
    } else if (p->grad.data != slot || d->inv_k) {
      /* invariant mode never copied the gradient into the slot: the mean goes there now */
      if (!p->grad.data || d->inv_k) {
        if (d->inv_k) ddp__inv_result(d, x, k, slot);
        ddp_param_set_grad_data(p, slot);
      } else if (first == DDP_OK) {
        first = ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                              "Detected at least one parameter gradient is not the expected DDP "
                              "bucket view with gradient_as_bucket_view=True. This may happen "
                              "(for example) if multiple allreduce hooks were registered onto "
                              "the same parameter. If you hit this error, please file an issue "
                              "with a minimal repro. (parameter %zu, %s, rank %d)",
                              i, p->name, d->rank);
      }
    }
  }
  return first;
}

ddp_status_t ddp__ddp_finalize(ddp_ddp_t *d) {
  d->t_bwd_compute_end = ddp_now_ns();
  d->expect_hooks = false;
  d->require_finalize = false;
  d->div_factor = 0;
  ddp_status_t first = DDP_OK;
  bool need_used = d->opts.find_unused_parameters || d->opts.static_graph;
  if (d->inv_k) first = ddp__inv_poll(d, true); /* normally done at the last bucket's launch */
  for (size_t b = 0; b < d->nbuckets; b++) {
    ddp_status_t st = wait_bucket(d, b, first);
    if (first == DDP_OK) first = st;
    if (first == DDP_OK) first = copy_back(d, &d->buckets[b], need_used);
  }
  if (d->used_work) {
    if (first == DDP_OK)
      first = ddp__ddp_wait(d, &d->used_work, "allreduce of the used-parameter map");
    else /* the failure is recorded: only wait */
      ddp__ddp_drain(&d->used_work);
    d->used_waited = true;
  }
  if (d->opts.find_unused_parameters && !d->opts.static_graph)
    memset(d->local_used, 0, d->P * sizeof *d->local_used);
  ddp__inv_end_step(d);
  d->t_comm_end = ddp_now_ns();
  memcpy(d->prev_ready_order, d->ready_order, d->nready_order * sizeof(size_t));
  d->nprev_ready_order = d->nready_order;
  ddp__ddp_trace(d, "finalize", d->t_bwd_compute_end, d->t_comm_end, 0, -1, 0);
  if (first == DDP_OK) ddp__ddp_stats_sample_end(d);
  return first;
}
