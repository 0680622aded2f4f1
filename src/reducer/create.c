/* Construction and destruction of the DDP handle (§1): the options, the managed
 * parameters (those requiring grad, in registration order) and their per-parameter
 * arrays, the shape check across ranks (_verify_param_shape_across_processes), the initial
 * broadcast from rank 0 (broadcast.c), the initial buckets (buckets.c) and the model's
 * grad-ready hooks. destroy undoes it: the gradients leave the bucket views for the
 * model's own storage.
 *
 * The per-parameter arrays are carved from one block, as llm.c carves its parameters:
 * carve_param_arrays lays every array out once, measuring the block on a first pass and
 * pointing into it on a second, so create makes one allocation and destroy one free. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* ---------------------------------------------------------------- parameters ------ */

/* Reserves n elements of field's type at the end of the block: every array holds scalars
 * (bool, int, int32_t, size_t, pointers), whose alignment is their size. With base NULL
 * only the size is measured. */
#define CARVE(field, n)                          \
  do {                                           \
    size_t es_ = sizeof *d->field;               \
    size_t off_ = (total + es_ - 1) / es_ * es_; \
    if (base) d->field = (void *)(base + off_);  \
    total = off_ + (n)*es_;                      \
  } while (0)

/* The per-parameter arrays of struct ddp_ddp (those marked [P] and [nmodel]). Returns the
 * block's size. */
static size_t carve_param_arrays(ddp_ddp_t *d, char *base) {
  size_t total = 0, P = d->P;
  CARVE(params, P);
  CARVE(mindex, d->nmodel);
  CARVE(param_bucket, P);
  CARVE(param_offset, P);
  CARVE(ready, P);
  CARVE(ready_order, P);
  CARVE(prev_ready_order, P);
  CARVE(unused, P);
  CARVE(unused_list, P);
  CARVE(visited, P);
  CARVE(local_used, P);
  CARVE(prev_unused, P);
  CARVE(fire_expected, P);
  CARVE(fire_left, P);
  CARVE(rebuilt, P);
  CARVE(reached, P);
  return total;
}

#undef CARVE

/* Checks the model's parameters and counts the managed ones into d->P. */
static ddp_status_t count_params(ddp_ddp_t *d) {
  for (size_t i = 0; i < d->nmodel; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    if (p->index != i)
      return ddp__ddp_fail(d, DDP_ERR_INTERNAL, "[rank %d] DDP: parameter %zu has index %zu",
                           d->rank, i, p->index);
    if (!p->requires_grad) continue;
    if (p->value.dtype != DDP_F32 && p->value.dtype != DDP_F64)
      return ddp__ddp_fail(d, DDP_ERR_UNSUPPORTED,
                           "[rank %d] DDP: parameter %s has dtype %s; DDP reduces F32 and F64 "
                           "gradients",
                           d->rank, p->name, ddp_dtype_name(p->value.dtype));
    d->P++;
  }
  if (d->P == 0)
    return ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                         "DistributedDataParallel is not needed when a module doesn't have any "
                         "parameter that requires a gradient.");
  return DDP_OK;
}

/* One block for the per-parameter arrays, then the managed index of each parameter. */
static ddp_status_t alloc_params(ddp_ddp_t *d) {
  d->param_mem = ddp__calloc(1, carve_param_arrays(d, NULL));
  d->global_used = ddp_pg_alloc(d->pg, d->P * sizeof(int32_t));
  d->join_count = ddp_pg_alloc(d->pg, 2 * sizeof(int32_t));
  if (!d->param_mem || !d->global_used || !d->join_count) return ddp__ddp_oom(d);
  carve_param_arrays(d, d->param_mem);
  size_t P = 0;
  for (size_t i = 0; i < d->nmodel; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    d->mindex[i] = SIZE_MAX;
    if (!p->requires_grad) continue;
    d->mindex[i] = P;
    d->params[P++] = p;
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- shape check ----- */

static void fmt_shape(char *buf, size_t cap, const int64_t *v, int n) {
  size_t len = 0;
  len += (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < n && len < cap; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%" PRId64, i ? ", " : "", v[i]);
  if (len < cap) snprintf(buf + len, cap - len, "]");
}

/* Every rank manages the same number of parameters (an allgather of the counts). */
static ddp_status_t verify_count(ddp_ddp_t *d) {
  int64_t mine = (int64_t)d->P;
  int64_t *all = ddp__calloc((size_t)d->world, sizeof *all);
  ddp_work_t *w = NULL;
  if (!all) return ddp__ddp_oom(d);
  ddp_status_t st = ddp_allgather(d->pg, &mine, all, 1, DDP_I64, &w);
  if (st == DDP_OK)
    st = ddp__ddp_wait(d, &w, "allgather of the parameter count");
  else
    ddp__ddp_carry(d, st, "DDP: allgather of the parameter count: %s", ddp__ddp_pg_error(d));
  for (int i = 0; st == DDP_OK && i < d->world; i++)
    if (all[i] != mine)
      st = ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                         "DDP expects same model across all ranks, but Rank %d has %" PRId64
                         " params, while rank %d has inconsistent %" PRId64 " params.",
                         d->rank, mine, i, all[i]);
  ddp__free(all);
  return st;
}

/* Each parameter's sizes then its contiguous strides, concatenated, into meta. */
static void shape_meta(const ddp_ddp_t *d, int64_t *meta) {
  size_t pos = 0;
  for (size_t i = 0; i < d->P; i++) {
    const ddp_tensor_t *t = &d->params[i]->value;
    int64_t stride = 1;
    for (int k = 0; k < t->ndim; k++) meta[pos + (size_t)k] = t->shape[k];
    for (int k = t->ndim - 1; k >= 0; k--) {
      meta[pos + (size_t)t->ndim + (size_t)k] = stride;
      stride *= t->shape[k];
    }
    pos += 2 * (size_t)t->ndim;
  }
}

/* _verify_param_shape_across_processes (§1.3): the counts, then rank 0's sizes and strides
 * against this rank's, with PyTorch's texts. */
static ddp_status_t verify_shapes(ddp_ddp_t *d) {
  DDP_CHECK(verify_count(d));
  size_t len = 0;
  for (size_t i = 0; i < d->P; i++) len += 2 * (size_t)d->params[i]->value.ndim;
  int64_t *meta = ddp__calloc(len + 1, sizeof *meta);
  int64_t *mine_meta = ddp__calloc(len + 1, sizeof *meta);
  ddp_work_t *w = NULL;
  if (!meta || !mine_meta) {
    ddp__free(meta);
    ddp__free(mine_meta);
    return ddp__ddp_oom(d);
  }
  shape_meta(d, mine_meta);
  memcpy(meta, mine_meta, len * sizeof *meta);
  ddp_status_t st = ddp_broadcast(d->pg, meta, len, DDP_I64, 0, &w);
  if (st == DDP_OK)
    st = ddp__ddp_wait(d, &w, "broadcast of parameter shapes");
  else
    ddp__ddp_carry(d, st, "DDP: broadcast of parameter shapes: %s", ddp__ddp_pg_error(d));
  size_t pos = 0;
  for (size_t i = 0; st == DDP_OK && i < d->P; i++) {
    int nd = d->params[i]->value.ndim;
    char sizes[256];
    fmt_shape(sizes, sizeof sizes, d->params[i]->value.shape, nd);
    if (memcmp(meta + pos, mine_meta + pos, (size_t)nd * sizeof *meta) != 0)
      st = ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                         "[%d]: params[%zu] in this process with sizes %s appears not to match "
                         "sizes of the same param in process 0. (parameter %s)",
                         d->rank, i, sizes, d->params[i]->name);
    else if (memcmp(meta + pos + nd, mine_meta + pos + nd, (size_t)nd * sizeof *meta) != 0)
      st = ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                         "params[%zu] in this process with sizes %s appears not to match "
                         "strides of the same param in process 0. (parameter %s, rank %d)",
                         i, sizes, d->params[i]->name, d->rank);
    pos += 2 * (size_t)nd;
  }
  ddp__free(meta);
  ddp__free(mine_meta);
  return st;
}

/* ---------------------------------------------------------------- create ---------- */

/* The handle with its options, before anything that can fail on its own. */
static ddp_ddp_t *new_handle(ddp_model_t *model, ddp_pg_t *pg, const ddp_ddp_options_t *o) {
  ddp_ddp_t *d = ddp__calloc(1, sizeof *d);
  if (!d) return NULL;
  d->magic = DDP__DDP_MAGIC;
  d->model = model;
  d->pg = pg;
  d->opts = *o;
  d->opts.trace_path = NULL; /* d->trace_path is the handle's copy */
  d->rank = ddp_pg_rank(pg);
  d->world = ddp_pg_size(pg);
  d->nmodel = ddp_model_num_params(model);
  d->require_backward_grad_sync = true;
  d->require_forward_param_sync = true;
  d->bcast_bytes = o->broadcast_bucket_bytes ? o->broadcast_bucket_bytes
                                             : DDP_BROADCAST_BUCKET_BYTES;
  bool unset = o->bucket_cap_mb == DDP_BUCKET_CAP_UNSET;
  double cap_mb = unset ? DDP_DEFAULT_BUCKET_CAP_MB : o->bucket_cap_mb;
  d->bucket_bytes_cap = (size_t)(int64_t)(cap_mb * 1024.0 * 1024.0);
  d->first_bucket_bytes_cap = o->first_bucket_bytes >= 0
                                  ? (size_t)o->first_bucket_bytes
                                  : (unset ? (size_t)DDP_DEFAULT_FIRST_BUCKET_BYTES
                                           : d->bucket_bytes_cap);
  return d;
}

/* The construction steps after the handle exists, in PyTorch's order. */
static ddp_status_t construct(ddp_ddp_t *d, const ddp_ddp_options_t *o) {
  if (o->trace_path) DDP_CHECK(ddp__ddp_trace_open(d, o->trace_path));
  DDP_CHECK(count_params(d));
  DDP_CHECK(alloc_params(d));
  DDP_CHECK(ddp__inv_init(d));
  ddp__ddp_describe_dtypes(d);
  if (o->init_sync) {
    DDP_CHECK(verify_shapes(d));
    DDP_CHECK(ddp__ddp_sync_module_states(d, 0));
  }
  if (o->static_graph && o->find_unused_parameters)
    ddp__log(d->rank, DDP_LOG_WARN,
             "You passed find_unused_parameters=true to DistributedDataParallel, "
             "`_set_static_graph` will detect unused parameters automatically, so you do not "
             "need to set find_unused_parameters=true, just be sure these unused parameters "
             "will not change during training loop while calling `_set_static_graph`.");
  DDP_CHECK(ddp__ddp_init_initial_buckets(d));
  ddp_model_set_hook(d->model, ddp__ddp_grad_hook, d);
  d->hooks_set = true;
  ddp__ddp_log_initialized(d);
  return DDP_OK;
}

ddp_status_t ddp_ddp_create(ddp_model_t *model, ddp_pg_t *pg, const ddp_ddp_options_t *opts,
                            ddp_ddp_t **out, ddp_error_t *err) {
  DDP_REQUIRE(model && pg && out);
  *out = NULL;
  int rank = ddp_pg_rank(pg);
  ddp_ddp_options_t o = DDP_DDP_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  if (!ddp_model_finalized(model))
    return ddp__error(err, rank, DDP_ERR_INVALID_USAGE,
                      "DDP: the model must be finalized (ddp_model_finalize) before wrapping");
  if (o.bucket_cap_mb != DDP_BUCKET_CAP_UNSET && !(o.bucket_cap_mb >= 0))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "DDP: bucket_cap_mb must be >= 0 (got %g)", o.bucket_cap_mb);
  ddp_ddp_t *d = new_handle(model, pg, &o);
  if (!d) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "DDP: out of memory");
  ddp_status_t st = construct(d, &o);
  if (st != DDP_OK) {
    ddp__ddp_error_copy(d, st, err);
    ddp_ddp_destroy(d);
    return st;
  }
  *out = d;
  return DDP_OK;
}

/* ---------------------------------------------------------------- destroy --------- */

void ddp_ddp_destroy(ddp_ddp_t *d) {
  if (!d) return;
  DDP_REQUIRE(d->magic == DDP__DDP_MAGIC);
  ddp__ddp_trace_close(d);
  ddp__ddp_drain(&d->used_work);
  if (d->hooks_set) ddp_model_set_hook(d->model, NULL, NULL);
  if (d->buckets) /* gradients in bucket views go back to the model's storage */
    for (size_t i = 0; i < d->P; i++) {
      ddp_param_t *p = d->params[i];
      if (p->grad.data && p->grad.data == ddp__ddp_slot(d, i)) {
        void *slot = p->grad.data;
        ddp_param_set_grad_data(p, NULL);
        memcpy(p->grad.data, slot, ddp__ddp_pbytes(p));
      }
    }
  ddp__ddp_free_buckets(d, d->buckets, d->nbuckets);
  ddp__inv_free(d);
  if (d->has_comm_hook && d->comm_hook.free_state) d->comm_hook.free_state(d->comm_hook.state);
  ddp__free(d->comm_hook_name);
  ddp__ddp_drain(&d->join_work);
  if (d->global_used) ddp_pg_free(d->pg, d->global_used);
  if (d->join_count) ddp_pg_free(d->pg, d->join_count);
  ddp__ddp_layout_free(&d->initial);
  ddp__ddp_layout_free(&d->rebuilt_stats);
  ddp__free(d->param_mem);
  d->magic = 0;
  ddp__free(d);
}

/* ---------------------------------------------------------------- accessors ------- */

ddp_param_t *ddp_ddp_param(ddp_ddp_t *d, size_t i) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && i < d->P);
  return d->params[i];
}

size_t ddp_ddp_num_params(const ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  return d->P;
}

ddp_model_t *ddp_ddp_model(ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  return d->model;
}
