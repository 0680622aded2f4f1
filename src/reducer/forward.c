/* The forward side of a step (§3.2, §5, §6): DDP's _pre_forward (the unfinished-reduction
 * check, a pending bucket rebuild, the buffer broadcast and, under join(), the join
 * collectives), _post_forward (arming the next backward, or not under no_sync) and
 * no_sync itself. The decision whether a backward synchronises is taken here, at forward,
 * as in PyTorch. */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* PyTorch's text for an unfinished reduction, without the parameter lists. */
static size_t unfinished_text(const ddp_ddp_t *d, char *buf, size_t cap) {
  if (d->opts.static_graph)
    return (size_t)snprintf(buf, cap,
                            "Expected to have finished reduction in the prior iteration before "
                            "starting a new one. This error indicates that your training graph "
                            "has changed in this iteration, e.g., one parameter is used in first "
                            "iteration, but then got unused in the second iteration. this is not "
                            "compatible with static_graph set to True.");
  return (size_t)snprintf(
      buf, cap,
      "Expected to have finished reduction in the prior iteration before starting a new "
      "one. This error indicates that your module has parameters that were not used in "
      "producing loss. %s\nIf you already have done the above, then the distributed data "
      "parallel module wasn't able to locate the output tensors in the return value of your "
      "module's `forward` function. Please include the loss function and the structure of "
      "the return value of `forward` of your module when reporting this issue (e.g. list, "
      "dict, iterable).",
      d->opts.find_unused_parameters
          ? "Since `find_unused_parameters=True` is enabled, this likely  means that not all "
            "`forward` outputs participate in computing loss. You can fix this by making "
            "sure all `forward` function outputs participate in calculating loss. "
          : "You can enable unused parameter detection by passing the keyword argument "
            "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, "
            "and by \nmaking sure all `forward` function outputs participate in calculating "
            "loss. ");
}

/* The previous synchronised backward left parameters unready: PyTorch's error, with the
 * indices and names of the parameters that received no gradient. */
static ddp_status_t ensure_prior_reduction_finished(ddp_ddp_t *d) {
  if (!d->require_finalize) return DDP_OK;
  enum { CAP = DDP_ERROR_MSG_MAX };
  size_t *idx = ddp__calloc(d->P + 1, sizeof *idx);
  size_t n = 0;
  if (!idx) return ddp__ddp_oom(d);
  for (size_t i = 0; i < d->P; i++)
    if (!d->ready[i]) idx[n++] = i;
  char *buf = ddp__malloc(CAP);
  if (!buf) {
    ddp__free(idx);
    return ddp__ddp_oom(d);
  }
  size_t len = unfinished_text(d, buf, CAP);
  len += (size_t)snprintf(buf + len, CAP - DDP_MIN(len, CAP),
                          "\nParameter indices which did not receive grad for rank %d:", d->rank);
  for (size_t k = 0; k < n && len < CAP; k++)
    len += (size_t)snprintf(buf + len, CAP - len, " %zu", idx[k]);
  if (len < CAP)
    len += (size_t)snprintf(buf + len, CAP - len,
                            "\nParameters which did not receive grad for rank %d: ", d->rank);
  if (len < CAP) ddp__ddp_append_names(buf, CAP, d, idx, n, ", ");
  for (size_t k = 0; k < n; k++)
    ddp__log(d->rank, DDP_LOG_INFO,
             "Parameter %s (index %zu) did not get gradient in backwards pass.",
             d->params[idx[k]]->name, idx[k]);
  ddp_status_t st = ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE, "%s", buf);
  ddp__free(buf);
  ddp__free(idx);
  return st;
}

ddp_status_t ddp_ddp_pre_forward(ddp_ddp_t *d, ddp_ctx_t *ctx) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && ctx);
  /* A hook error was returned by that backward; like PyTorch, the unfinished reduction is
   * what the next forward reports. */
  d->hook_status = DDP_OK;
  ddp__ddp_error_clear(d);
  bool grad = ddp_ctx_grad_enabled(ctx);
  d->ctx = ctx;
  d->t_pre_forward = ddp_now_ns();
  if (grad && d->require_backward_grad_sync) {
    d->num_iterations++;
    d->t_fwd_start = ddp_now_ns();
  }
  if (d->join_enabled) DDP_CHECK(ddp__ddp_join_notify(d));
  if (grad) {
    DDP_CHECK(ensure_prior_reduction_finished(d));
    DDP_CHECK(ddp__ddp_rebuild_buckets(d));
    if (d->inv_k) DDP_CHECK(ddp__inv_begin_shard(d));
  }
  if (d->require_forward_param_sync && d->opts.broadcast_buffers &&
      ddp_model_num_buffers(d->model) > 0) {
    int root = 0;
    if (d->join_enabled) DDP_CHECK(ddp__ddp_join_buffers_root(d, &root));
    DDP_CHECK(ddp__ddp_sync_buffers(d, root));
  }
  if (d->join_enabled) DDP_CHECK(ddp__ddp_join_sync_flag(d));
  return DDP_OK;
}

ddp_status_t ddp_ddp_post_forward(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n,
                                  ddp_var_t *const *outputs) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && ctx);
  d->ctx = ctx;
  ddp__ddp_trace(d, "forward", d->t_pre_forward, ddp_now_ns(), 0, -1, 0);
  if (ddp_ctx_grad_enabled(ctx) && d->require_backward_grad_sync) {
    if (d->inv_k) DDP_CHECK(ddp__inv_check_sync(d));
    d->require_forward_param_sync = true;
    d->t_fwd_end = ddp_now_ns();
    ddp__ddp_prepare_backward(d, ctx, n, outputs);
  } else {
    d->require_forward_param_sync = false;
  }
  return DDP_OK;
}

ddp_status_t ddp_ddp_forward(ddp_ddp_t *d, ddp_ctx_t *ctx, ddp_var_t *x, uint64_t flags,
                             ddp_var_t **y) {
  DDP_CHECK(ddp_ddp_pre_forward(d, ctx));
  ddp_status_t st = ddp_model_forward(d->model, ctx, x, flags, y);
  if (st != DDP_OK) /* the context logged it */
    return ddp__ddp_carry(d, st, "[rank %d] DDP forward: %s", d->rank, ddp__ddp_ctx_error(d, ctx));
  return ddp_ddp_post_forward(d, ctx, 1, y);
}

bool ddp_ddp_set_sync(ddp_ddp_t *d, bool sync) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  bool old = d->require_backward_grad_sync;
  d->require_backward_grad_sync = sync;
  return old;
}
