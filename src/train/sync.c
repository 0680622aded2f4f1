/* Gradient synchronisation for the trainer (contract in sync.h), two implementations:
 *
 *  - "reducer": the DDP reducer (include/ddp/reducer.h) with the HF-named options: buckets
 *    (ddp_bucket_cap_mb), allreduces launched from the gradient-ready hooks while backward
 *    runs, find_unused_parameters, static_graph, gradient_as_bucket_view, broadcast_buffers
 *    and no_sync, with Accelerate's comm_hook / comm_wrapper / comm_state_option registered
 *    through the hooks layer. The loss scale enters as a multiplication on the tape (d(c*L) = c*dL:
 * the same gradient a seed of c gives).
 *  - "flat": DDP with one bucket and no overlap. After a synchronising backward the model's
 *    flat gradient buffer (one per dtype) is all-reduced with AVG (sum in rank order, then
 *    divided by W); after a no_sync backward nothing is communicated. Buffers are broadcast
 *    from rank 0 before each synchronising forward. A None gradient enters the sum as
 *    zeros; a used-map allreduce (MAX) then leaves None exactly the gradients that are None
 *    on every rank and defines the others, as the reducer with find_unused_parameters=True
 *    does. Kept as the reference the reducer is tested against (tests/test_train.c). */
#include "train/sync.h"

#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/hooks.h"
#include "ddp/reducer.h"

struct ddp__sync {
  ddp_pg_t *pg;          /* borrowed */
  ddp_model_t *model;    /* borrowed */
  ddp_train_args_t args; /* copy */
  bool use_reducer;
  ddp_ddp_t *ddp;             /* reducer mode, from ddp__sync_begin on */
  ddp_comm_hook_t hook;       /* the registered comm hook (state owned by ddp); fn NULL: none */
  bool armed;                 /* flat mode: the last forward was a synchronising one */
  ddp_local_grad_fn local_fn; /* ddp__sync_set_local_grad_fn; NULL: none */
  void *local_user;
  int64_t syncs;               /* synchronised backwards so far */
  ddp__sync_hook_wrap_fn wrap; /* ddp__sync_set_hook_wrap; NULL: none */
  void *wrap_user;
};

static const ddp_dtype_t float_dtypes[] = {DDP_F32, DDP_F64};

static ddp_status_t wait_op(ddp__sync_t *s, ddp_status_t st, ddp_work_t *w, const char *what,
                            ddp_error_t *err) {
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st != DDP_OK) { /* logged by the group where it started; context added here */
    ddp_error_t pe;
    ddp_pg_last_error_copy(s->pg, &pe);
    return ddp__error_quiet(err, st, "gradient sync: %s: %s", what, pe.msg);
  }
  return DDP_OK;
}

/* A reducer failure, which the reducer (or the group below it) logged where it started. */
static ddp_status_t reducer_error(ddp__sync_t *s, ddp_status_t st, const char *what,
                                  ddp_error_t *err) {
  ddp_error_t de = {0};
  if (s->ddp) ddp_ddp_last_error_copy(s->ddp, &de);
  return ddp__error_quiet(err, st, "DDP %s: %s", what, de.msg);
}

/* An op's failure with the message it left (and logged) on the context. */
static ddp_status_t ctx_error(ddp_ctx_t *ctx, ddp_status_t st, const char *what, ddp_error_t *err) {
  ddp_error_t ce;
  ddp_ctx_last_error_copy(ctx, &ce);
  return ddp__error_quiet(err, st, "%s: %s", what, ce.msg);
}

ddp_status_t ddp__sync_create(ddp_pg_t *pg, ddp_model_t *model, const ddp_train_args_t *args,
                              bool use_reducer, ddp__sync_t **out, ddp_error_t *err) {
  DDP_REQUIRE(pg && model && args && out);
  *out = NULL;
  ddp__sync_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, ddp_pg_rank(pg), DDP_ERR_NO_MEMORY, "gradient sync: no memory");
  s->pg = pg;
  s->model = model;
  s->args = *args;
  s->use_reducer = use_reducer;
  *out = s;
  return DDP_OK;
}

void ddp__sync_destroy(ddp__sync_t *s) {
  if (!s) return;
  ddp_ddp_destroy(s->ddp);
  ddp__free(s);
}

const char *ddp__sync_name(const ddp__sync_t *s) {
  return s->use_reducer ? "reducer" : "flat-allreduce";
}

struct ddp_ddp *ddp__sync_reducer(ddp__sync_t *s) {
  return s->ddp;
}

ddp_powersgd_state_t *ddp__sync_powersgd(ddp__sync_t *s) {
  return s->hook.fn ? ddp_hooks_powersgd(&s->hook) : NULL;
}

void ddp__sync_set_hook_wrap(ddp__sync_t *s, ddp__sync_hook_wrap_fn fn, void *user) {
  DDP_REQUIRE(s && !s->ddp);
  s->wrap = fn;
  s->wrap_user = user;
}

bool ddp__sync_hook_has_state(const ddp__sync_t *s) {
  return s->hook.fn && s->hook.save_state && s->hook.load_state;
}

ddp_status_t ddp__sync_hook_save(ddp__sync_t *s, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(ddp__sync_hook_has_state(s) && path);
  return s->hook.save_state(s->hook.state, path, err);
}

ddp_status_t ddp__sync_hook_load(ddp__sync_t *s, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(ddp__sync_hook_has_state(s) && path);
  return s->hook.load_state(s->hook.state, path, err);
}

void ddp__sync_set_local_grad_fn(ddp__sync_t *s, ddp_local_grad_fn fn, void *user) {
  DDP_REQUIRE(s);
  s->local_fn = fn;
  s->local_user = user;
  if (s->ddp) ddp_ddp_set_local_grad_fn(s->ddp, fn, user);
}

void ddp__train_dump_local(void *user, const ddp_param_t *p) {
  /* Only out of memory can fail here; the step's dump then lacks this tensor and
   * ddp-compare names it as missing. */
  (void)ddp_dump_local_grad(user, p->index, p->grad.data);
}

/* Flat mode, before the allreduce: None gradients hold zeros in the flat buffer (and stay
 * None), the local observer sees every gradient, and used[i] says whether parameter i's
 * gradient is defined here. */
static void flat_prepare(ddp__sync_t *s, int32_t *used) {
  for (size_t i = 0; i < ddp_model_num_params(s->model); i++) {
    ddp_param_t *p = ddp_model_param(s->model, i);
    if (!p->requires_grad) continue;
    if (s->local_fn) s->local_fn(s->local_user, p);
    used[i] = p->grad.data != NULL;
    if (used[i]) continue;
    ddp_param_set_grad_data(p, NULL);
    memset(p->grad.data, 0, ddp_tensor_nbytes(&p->value));
    ddp_param_set_grad_none(p);
  }
}

void ddp__sync_comm_stats(ddp__sync_t *s, int64_t *bytes, double *rate) {
  *bytes = 0;
  *rate = 1.0;
  if (s->ddp) {
    ddp_ddp_comm_stats_t cs;
    ddp_ddp_get_comm_stats(s->ddp, &cs);
    *bytes = cs.bytes_last_step;
    *rate = cs.rate;
    return;
  }
  for (size_t i = 0; i < DDP_ARRAY_LEN(float_dtypes); i++) {
    ddp_tensor_t g = ddp_model_flat_grads(s->model, float_dtypes[i]);
    if (g.numel) *bytes += (int64_t)ddp_tensor_nbytes(&g);
  }
}

double ddp__sync_overlap_ns(ddp__sync_t *s) {
  if (!s->ddp) return 0;
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(s->ddp, &ld);
  return (double)ld.avg_backward_compute_comm_overlap_time;
}

static ddp_status_t broadcast_buffers(ddp__sync_t *s, ddp_error_t *err) {
  for (size_t i = 0; i < ddp_model_num_buffers(s->model); i++) {
    ddp_buffer_t *b = ddp_model_buffer(s->model, i);
    if (b->value.numel == 0) continue;
    ddp_work_t *w = NULL;
    ddp_status_t st = ddp_broadcast(s->pg, b->value.data, (size_t)b->value.numel, b->value.dtype, 0,
                                    &w);
    DDP_CHECK(wait_op(s, st, w, "buffer broadcast", err));
  }
  return DDP_OK;
}

ddp_status_t ddp__sync_grad_arith(const ddp_train_args_t *a, int rank, ddp_grad_arith_t *out,
                                  ddp_error_t *err) {
  if (ddp_grad_arith_parse(a->sharding_arithmetic, out)) {
    if (*out != DDP_GRAD_ARITH_DDP && a->world_size_invariant_shards > 0)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "--sharding_arithmetic %s does not combine with "
                        "--world_size_invariant_shards (its bits are DDP's for any world size)",
                        a->sharding_arithmetic);
    if (*out != DDP_GRAD_ARITH_DDP && strcmp(a->comm_hook, "no") != 0)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "--sharding_arithmetic %s does not combine with --comm_hook %s (both "
                        "decide how the gradients are reduced)",
                        a->sharding_arithmetic, a->comm_hook);
    return DDP_OK;
  }
  return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                    "--sharding_arithmetic '%s' is not one of " DDP_GRAD_ARITH_CHOICES,
                    a->sharding_arithmetic);
}

ddp_status_t ddp__sync_begin(ddp__sync_t *s, ddp_error_t *err) {
  DDP_REQUIRE(s);
  if (s->use_reducer) {
    ddp_ddp_options_t o = DDP_DDP_OPTIONS_INIT;
    o.broadcast_buffers = ddp_train_broadcast_buffers(&s->args);
    o.bucket_cap_mb = s->args.ddp_bucket_cap_mb > 0 ? (double)s->args.ddp_bucket_cap_mb
                                                    : DDP_BUCKET_CAP_UNSET;
    if (s->args.ddp_first_bucket_mb > 0) {
      o.first_bucket_bytes = (int64_t)(s->args.ddp_first_bucket_mb * 1024 * 1024);
    }
    o.find_unused_parameters = ddp_train_find_unused(&s->args);
    o.gradient_as_bucket_view = s->args.gradient_as_bucket_view;
    o.static_graph = ddp_train_static_graph(&s->args);
    if (s->args.ddp_trace[0]) o.trace_path = s->args.ddp_trace;
    o.world_size_invariant_shards = s->args.world_size_invariant_shards;
    ddp_error_t e = {0};
    ddp_status_t st = ddp_ddp_create(s->model, s->pg, &o, &s->ddp, &e);
    if (st != DDP_OK) {
      return ddp__error_quiet(err, st, "DDP create: %s", e.msg); /* logged by the reducer */
    }
    /* --sharding_arithmetic (docs/sharding.md): another framework's divide placement, as a
     * comm hook around the reducer's allreduce (DDP and ZeRO-1; ZeRO-2/3 do it in shard) */
    ddp_grad_arith_t arith = DDP_GRAD_ARITH_DDP;
    DDP_CHECK(ddp__sync_grad_arith(&s->args, ddp_pg_rank(s->pg), &arith, err));
    /* world_size_invariant_shards sums with its own allreduce: "allreduce" is that one */
    if (s->args.world_size_invariant_shards > 0) return DDP_OK;
    ddp_comm_hook_t hook = {0};
    char what[DDP_TRAIN_STR_MAX + 48] = "DDP comm hook";
    if (arith != DDP_GRAD_ARITH_DDP) {
      st = ddp_grad_arith_hook(arith, &hook);
      snprintf(what, sizeof what, "--sharding_arithmetic %s: comm hook",
               s->args.sharding_arithmetic);
    } else {
      /* Accelerate's comm_hook / comm_wrapper / comm_state_option ("no" registers nothing).
       * The layer that failed has logged; the message is carried up quietly. */
      st = ddp_hooks_create(s->args.comm_hook, s->args.comm_wrapper, s->args.comm_state_option,
                            ddp_pg_rank(s->pg), &hook, &e);
    }
    if (st == DDP_OK && s->wrap) { /* the wrapper owns the inner hook's state from here */
      ddp_comm_hook_t outer = {0};
      st = s->wrap(s->wrap_user, hook.fn ? &hook : NULL, &outer, &e);
      hook = st == DDP_OK ? outer : (ddp_comm_hook_t){0};
      snprintf(what, sizeof what, "--zero_comm_hook %s", s->args.zero_comm_hook);
    }
    if (st == DDP_OK && hook.fn) {
      st = ddp_ddp_register_comm_hook(s->ddp, &hook, &e);
      if (st != DDP_OK && hook.free_state) hook.free_state(hook.state); /* still ours */
    }
    if (st != DDP_OK) return ddp__error_quiet(err, st, "%s: %s", what, e.msg);
    s->hook = hook;
    return DDP_OK;
  }
  for (size_t i = 0; i < DDP_ARRAY_LEN(float_dtypes); i++) {
    ddp_tensor_t p = ddp_model_flat_params(s->model, float_dtypes[i]);
    if (p.numel == 0) continue;
    ddp_work_t *w = NULL;
    ddp_status_t st = ddp_broadcast(s->pg, p.data, (size_t)p.numel, p.dtype, 0, &w);
    DDP_CHECK(wait_op(s, st, w, "initial parameter broadcast", err));
  }
  return broadcast_buffers(s, err);
}

ddp_status_t ddp__sync_pre_forward(ddp__sync_t *s, ddp_ctx_t *ctx, bool sync, ddp_error_t *err) {
  DDP_REQUIRE(s && ctx);
  if (s->ddp) {
    ddp_ddp_set_sync(s->ddp, sync);
    ddp_status_t st = ddp_ddp_pre_forward(s->ddp, ctx);
    return st == DDP_OK ? DDP_OK : reducer_error(s, st, "pre-forward", err);
  }
  s->armed = sync;
  if (sync && s->args.ddp_broadcast_buffers != DDP_FALSE && ddp_pg_size(s->pg) > 1) {
    return broadcast_buffers(s, err);
  }
  return DDP_OK;
}

ddp_status_t ddp__sync_post_forward(ddp__sync_t *s, ddp_ctx_t *ctx, ddp_var_t *y,
                                    ddp_error_t *err) {
  DDP_REQUIRE(s && ctx && y);
  if (!s->ddp) return DDP_OK;
  ddp_status_t st = ddp_ddp_post_forward(s->ddp, ctx, 1, &y);
  return st == DDP_OK ? DDP_OK : reducer_error(s, st, "post-forward", err);
}

ddp_status_t ddp__sync_backward(ddp__sync_t *s, ddp_ctx_t *ctx, ddp_var_t *loss,
                                const ddp_tensor_t *scale, int64_t *comm_ns, ddp_error_t *err) {
  DDP_REQUIRE(s && ctx && loss);
  int rank = ddp_pg_rank(s->pg);
  ddp_status_t st;
  if (s->ddp) {
    ddp_var_t *root = loss;
    if (scale) {
      ddp_var_t *c;
      if ((st = ddp_var_new(ctx, scale->dtype, loss->value.ndim, loss->value.shape, scale->data,
                            false, &c)) != DDP_OK ||
          (st = ddp_mul(ctx, loss, c, &root)) != DDP_OK) {
        return ctx_error(ctx, st, "loss scaling", err);
      }
    }
    st = ddp_ddp_backward(s->ddp, ctx, root);
    if (st != DDP_OK) return reducer_error(s, st, "backward", err);
    /* The reducer's communication overlaps the backward; its sampled average per
     * synchronised backward is what a step spends communicating. */
    ddp_ddp_logging_data_t ld;
    ddp_ddp_get_logging_data(s->ddp, &ld);
    if (comm_ns && ld.iteration > s->syncs) *comm_ns += ld.avg_backward_comm_time;
    s->syncs = ld.iteration;
    return DDP_OK;
  }
  /* Seeding backward with `scale` gives exactly the gradient of scale * loss. */
  st = ddp_backward_multi(ctx, 1, &loss, scale);
  if (st != DDP_OK) {
    return ctx_error(ctx, st, "backward", err);
  }
  if (!s->armed) return DDP_OK;
  s->armed = false;
  int64_t t0 = ddp_now_ns();
  size_t np = ddp_model_num_params(s->model);
  int32_t *used = ddp__calloc(np ? np : 1, sizeof *used);
  if (!used) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "gradient sync: no memory");
  ddp_grad_arith_t arith = DDP_GRAD_ARITH_DDP;
  st = ddp__sync_grad_arith(&s->args, rank, &arith, err);
  if (st != DDP_OK) {
    ddp__free(used);
    return st;
  }
  flat_prepare(s, used);
  for (size_t i = 0; i < DDP_ARRAY_LEN(float_dtypes) && st == DDP_OK; i++) {
    ddp_tensor_t g = ddp_model_flat_grads(s->model, float_dtypes[i]);
    if (g.numel == 0) continue;
    ddp_work_t *w = NULL;
    if (arith == DDP_GRAD_ARITH_DDP) {
      st = ddp_allreduce(s->pg, g.data, g.data, (size_t)g.numel, g.dtype, DDP_OP_AVG, &w);
    } else { /* --sharding_arithmetic: pre-divide, SUM, post-divide */
      int W = ddp_pg_size(s->pg);
      ddp_grad_arith_pre(arith, W, true, g.data, g.data, (size_t)g.numel, g.dtype);
      st = ddp_allreduce(s->pg, g.data, g.data, (size_t)g.numel, g.dtype, DDP_OP_SUM, &w);
    }
    st = wait_op(s, st, w, "gradient allreduce", err);
    if (st == DDP_OK)
      ddp_grad_arith_post(arith, ddp_pg_size(s->pg), g.data, (size_t)g.numel, g.dtype);
  }
  if (st == DDP_OK && np) {
    ddp_work_t *w = NULL;
    st = ddp_allreduce(s->pg, used, used, np, DDP_I32, DDP_OP_MAX, &w);
    st = wait_op(s, st, w, "used-parameter allreduce", err);
  }
  for (size_t i = 0; i < np && st == DDP_OK; i++) {
    ddp_param_t *p = ddp_model_param(s->model, i);
    if (p->requires_grad && used[i] && !p->grad.data) ddp_param_set_grad_data(p, NULL);
  }
  ddp__free(used);
  if (st != DDP_OK) return st;
  if (comm_ns) *comm_ns += ddp_now_ns() - t0;
  return DDP_OK;
}
