/* --dump_dir: the per-step record of a training run in the layout of docs/dumps.md
 * ("libddp-dump-1"), so that ddp-compare can set it beside a torch_reference.py run.
 *
 * Every rank writes its own directory rank{r}/: init.safetensors after the initial broadcast,
 * then one step{NNNNNN}.safetensors per optimizer step holding the step's inputs (the
 * micro-batches concatenated), the averaged gradients as they were before clipping, and the
 * parameters and buffers after the optimizer step. Rank 0 writes meta.json. With the
 * reducer, every rank also writes ddp.json at the end (parameter lists, the construction-time
 * and rebuilt bucket layouts, the last ready order, the logging data). weights.safetensors
 * is optional in the format and not written. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "ddp/reducer.h"
#include "ddp_config.h"
#include "train/train_internal.h"

struct ddp__dump {
  char dir[DDP_TRAIN_STR_MAX + 32]; /* DIR/rank{r} */
  ddp_model_t *model;
  int rank;
  size_t np, nb;
  char **pnames, **gnames, **bnames; /* "param.<n>", "grad.<n>", "buffer.<n>" */
  ddp_tensor_t *grads;               /* snapshot of the averaged gradients */
  ddp_tensor_t x, y, idx;            /* the step's inputs, rows appended per micro-batch */
  int64_t rows, cap_rows, frow, lrow; /* rows used, rows allocated, elements per row */
  cJSON *initial, *initial_sizes;     /* the construction-time layout (reducer mode) */
};

static char *prefixed(const char *prefix, const char *name) {
  size_t n = strlen(prefix) + strlen(name) + 1;
  char *s = ddp__malloc(n);
  if (s) snprintf(s, n, "%s%s", prefix, name);
  return s;
}

void ddp__dump_close(ddp__dump_t *d) {
  if (!d) return;
  for (size_t i = 0; i < d->np; i++) {
    if (d->pnames) ddp__free(d->pnames[i]);
    if (d->gnames) ddp__free(d->gnames[i]);
    if (d->grads) ddp_tensor_free(&d->grads[i]);
  }
  for (size_t i = 0; d->bnames && i < d->nb; i++) ddp__free(d->bnames[i]);
  ddp__free(d->pnames);
  ddp__free(d->gnames);
  ddp__free(d->bnames);
  ddp__free(d->grads);
  ddp_tensor_free(&d->x);
  ddp_tensor_free(&d->y);
  ddp_tensor_free(&d->idx);
  cJSON_Delete(d->initial);
  cJSON_Delete(d->initial_sizes);
  ddp__free(d);
}

ddp_status_t ddp__dump_open(const char *root, ddp_model_t *model, int rank,
                            const ddp_sample_spec_t *spec, int64_t rows_per_step,
                            const char *meta_json, ddp__dump_t **out, ddp_error_t *err) {
  *out = NULL;
  ddp__dump_t *d = ddp__calloc(1, sizeof *d);
  if (!d) return DDP_ERR_NO_MEMORY;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  d->model = model;
  d->rank = rank;
  d->np = ddp_model_num_params(model);
  d->nb = ddp_model_num_buffers(model);
  snprintf(d->dir, sizeof d->dir, "%s/rank%d", root, rank);
  d->pnames = ddp__calloc(d->np + 1, sizeof(char *));
  d->gnames = ddp__calloc(d->np + 1, sizeof(char *));
  d->bnames = ddp__calloc(d->nb + 1, sizeof(char *));
  d->grads = ddp__calloc(d->np + 1, sizeof(ddp_tensor_t));
  if (!d->pnames || !d->gnames || !d->bnames || !d->grads) goto fail;
  for (size_t i = 0; i < d->np; i++) {
    ddp_param_t *p = ddp_model_param(model, i);
    d->pnames[i] = prefixed("param.", p->name);
    d->gnames[i] = prefixed("grad.", p->name);
    if (!d->pnames[i] || !d->gnames[i]) goto fail;
    if ((st = ddp_tensor_alloc(&d->grads[i], p->value.dtype, p->value.ndim, p->value.shape)) !=
        DDP_OK) {
      goto fail;
    }
  }
  for (size_t i = 0; i < d->nb; i++) {
    d->bnames[i] = prefixed("buffer.", ddp_model_buffer(model, i)->name);
    if (!d->bnames[i]) goto fail;
  }
  int64_t fs[DDP_MAX_DIMS + 1], ls[DDP_MAX_DIMS + 1];
  fs[0] = ls[0] = d->cap_rows = rows_per_step;
  memcpy(fs + 1, spec->feature_shape, sizeof(int64_t) * (size_t)spec->feature_ndim);
  memcpy(ls + 1, spec->label_shape, sizeof(int64_t) * (size_t)spec->label_ndim);
  if ((st = ddp_tensor_alloc(&d->x, spec->feature_dtype, spec->feature_ndim + 1, fs)) != DDP_OK ||
      (st = ddp_tensor_alloc(&d->y, spec->label_dtype, spec->label_ndim + 1, ls)) != DDP_OK ||
      (st = ddp_tensor_alloc(&d->idx, DDP_I64, 1, fs)) != DDP_OK) {
    goto fail;
  }
  d->frow = d->x.numel / rows_per_step;
  d->lrow = d->y.numel / rows_per_step;
  if ((st = ddp__train_mkdirs(d->dir, err)) != DDP_OK) goto fail;
  if (rank == 0 && meta_json) {
    char path[DDP_TRAIN_STR_MAX + 32];
    snprintf(path, sizeof path, "%s/meta.json", root);
    if ((st = ddp__train_write_atomic(path, meta_json, strlen(meta_json), err)) != DDP_OK) {
      goto fail;
    }
  }
  *out = d;
  return DDP_OK;
fail:
  ddp__dump_close(d);
  return st;
}

/* params (and with grads the gradient snapshot) and buffers, into one file. */
static ddp_status_t write_state(ddp__dump_t *d, const char *file, bool with_inputs,
                                const char *const *mk, const char *const *mv, size_t nmeta,
                                ddp_error_t *err) {
  size_t n = (with_inputs ? 3 + d->np : 0) + d->np + d->nb;
  ddp_st_entry_t *e = ddp__calloc(n + 1, sizeof *e);
  ddp_tensor_t *views = ddp__calloc(4, sizeof *views);
  if (!e || !views) {
    ddp__free(e);
    ddp__free(views);
    return DDP_ERR_NO_MEMORY;
  }
  size_t k = 0;
  if (with_inputs) {
    /* The first `rows` rows of the input buffers. */
    views[0] = d->x;
    views[0].shape[0] = d->rows;
    views[0].numel = d->rows * d->frow;
    views[0].owns = false;
    views[1] = d->y;
    views[1].shape[0] = d->rows;
    views[1].numel = d->rows * d->lrow;
    views[1].owns = false;
    views[2] = d->idx;
    views[2].shape[0] = d->rows;
    views[2].numel = d->rows;
    views[2].owns = false;
    e[k++] = (ddp_st_entry_t){"input.x", &views[0]};
    e[k++] = (ddp_st_entry_t){"input.y", &views[1]};
    e[k++] = (ddp_st_entry_t){"input.index", &views[2]};
    for (size_t i = 0; i < d->np; i++) e[k++] = (ddp_st_entry_t){d->gnames[i], &d->grads[i]};
  }
  for (size_t i = 0; i < d->np; i++) {
    e[k++] = (ddp_st_entry_t){d->pnames[i], &ddp_model_param(d->model, i)->value};
  }
  for (size_t i = 0; i < d->nb; i++) {
    e[k++] = (ddp_st_entry_t){d->bnames[i], &ddp_model_buffer(d->model, i)->value};
  }
  char path[DDP_TRAIN_STR_MAX + 64];
  snprintf(path, sizeof path, "%s/%s", d->dir, file);
  ddp_status_t st = ddp_st_write(path, e, k, mk, mv, nmeta, err);
  ddp__free(e);
  ddp__free(views);
  return st;
}

ddp_status_t ddp__dump_init(ddp__dump_t *d, ddp_error_t *err) {
  char rank[16];
  snprintf(rank, sizeof rank, "%d", d->rank);
  const char *mk[] = {"rank", "producer"}, *mv[] = {rank, "libddp"};
  return write_state(d, "init.safetensors", false, mk, mv, 2, err);
}

void ddp__dump_begin_step(ddp__dump_t *d) { d->rows = 0; }

ddp_status_t ddp__dump_add_batch(ddp__dump_t *d, const ddp_batch_t *b) {
  if (d->rows + b->size > d->cap_rows) return DDP_ERR_INTERNAL;
  size_t fe = ddp_dtype_size(d->x.dtype), le = ddp_dtype_size(d->y.dtype);
  memcpy((char *)d->x.data + (size_t)(d->rows * d->frow) * fe, b->features.data,
         (size_t)(b->size * d->frow) * fe);
  memcpy((char *)d->y.data + (size_t)(d->rows * d->lrow) * le, b->labels.data,
         (size_t)(b->size * d->lrow) * le);
  memcpy((int64_t *)d->idx.data + d->rows, b->indices, (size_t)b->size * sizeof(int64_t));
  d->rows += b->size;
  return DDP_OK;
}

void ddp__dump_grads(ddp__dump_t *d) {
  for (size_t i = 0; i < d->np; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    if (p->requires_grad && p->grad.data) {
      memcpy(d->grads[i].data, p->grad.data, ddp_tensor_nbytes(&d->grads[i]));
    } else {
      memset(d->grads[i].data, 0, ddp_tensor_nbytes(&d->grads[i]));
    }
  }
}

ddp_status_t ddp__dump_step(ddp__dump_t *d, int64_t step, double loss, int64_t micro,
                            ddp_error_t *err) {
  char file[64], s_step[32], s_rank[16], s_loss[40], s_micro[24], none[1024];
  snprintf(file, sizeof file, "step%06lld.safetensors", (long long)step);
  snprintf(s_step, sizeof s_step, "%lld", (long long)step);
  snprintf(s_rank, sizeof s_rank, "%d", d->rank);
  snprintf(s_loss, sizeof s_loss, "%.9g", loss);
  snprintf(s_micro, sizeof s_micro, "%lld", (long long)micro);
  size_t len = 0;
  none[0] = 0;
  for (size_t i = 0; i < d->np && len < sizeof none; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    if (p->requires_grad && p->grad.data) continue;
    len += (size_t)snprintf(none + len, sizeof none - len, "%s%s", len ? "," : "", p->name);
  }
  const char *mk[] = {"step", "rank", "loss", "micro_batches", "flags", "grads_none"};
  const char *mv[] = {s_step, s_rank, s_loss, s_micro, "0", none};
  return write_state(d, file, true, mk, mv, 6, err);
}

/* The reducer's current buckets as [[indices...], ...] and their sizes in bytes. */
static bool current_layout(ddp_ddp_t *ddp, cJSON **layout, cJSON **sizes) {
  *layout = cJSON_CreateArray();
  *sizes = cJSON_CreateArray();
  if (!*layout || !*sizes) return false;
  for (size_t b = 0; b < ddp_ddp_num_buckets(ddp); b++) {
    size_t n = 0;
    const size_t *idx = ddp_ddp_bucket_params(ddp, b, &n);
    cJSON *bucket = cJSON_CreateArray();
    double bytes = 0;
    if (!bucket) return false;
    for (size_t i = 0; i < n; i++) {
      ddp_param_t *p = ddp_ddp_param(ddp, idx[i]);
      bytes += (double)ddp_tensor_nbytes(&p->value);
      cJSON_AddItemToArray(bucket, cJSON_CreateNumber((double)idx[i]));
    }
    cJSON_AddItemToArray(*layout, bucket);
    cJSON_AddItemToArray(*sizes, cJSON_CreateNumber(bytes));
  }
  return true;
}

ddp_status_t ddp__dump_layout_begin(ddp__dump_t *d, ddp_ddp_t *ddp) {
  if (!ddp) return DDP_OK;
  return current_layout(ddp, &d->initial, &d->initial_sizes) ? DDP_OK : DDP_ERR_NO_MEMORY;
}

/* The limits a layout is computed with, as torch_reference.py records them: null for the
 * single unlimited bucket (sys.maxsize), else [first bucket bytes, bucket cap bytes]. */
static cJSON *limits_json(const ddp_ddp_logging_data_t *ld, bool initial) {
  for (size_t i = 0; initial && i < ld->num_initial_buckets; i++) {
    if (ld->initial_bucket_size_limits && ld->initial_bucket_size_limits[i] == INT64_MAX) {
      return cJSON_CreateNull();
    }
  }
  cJSON *a = cJSON_CreateArray();
  if (a) {
    cJSON_AddItemToArray(a, cJSON_CreateNumber((double)ld->first_bucket_bytes));
    cJSON_AddItemToArray(a, cJSON_CreateNumber((double)ld->bucket_cap_bytes));
  }
  return a;
}

ddp_status_t ddp__dump_finish(ddp__dump_t *d, ddp_ddp_t *ddp, ddp_error_t *err) {
  if (!ddp || !d->initial) return DDP_OK;
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(ddp, &ld);
  cJSON *o = cJSON_CreateObject();
  cJSON *names = cJSON_AddArrayToObject(o, "param_names");
  cJSON *shapes = cJSON_AddArrayToObject(o, "param_shapes");
  for (size_t i = 0; names && shapes && i < ddp_ddp_num_params(ddp); i++) {
    ddp_param_t *p = ddp_ddp_param(ddp, i);
    cJSON_AddItemToArray(names, cJSON_CreateString(p->name));
    cJSON *sh = cJSON_CreateArray();
    for (int k = 0; sh && k < p->value.ndim; k++) {
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)p->value.shape[k]));
    }
    cJSON_AddItemToArray(shapes, sh);
  }
  cJSON *sp = cJSON_AddArrayToObject(o, "state_param_names");
  for (size_t i = 0; sp && i < d->np; i++) {
    cJSON_AddItemToArray(sp, cJSON_CreateString(ddp_model_param(d->model, i)->name));
  }
  cJSON *bn = cJSON_AddArrayToObject(o, "buffer_names");
  for (size_t i = 0; bn && i < d->nb; i++) {
    cJSON_AddItemToArray(bn, cJSON_CreateString(ddp_model_buffer(d->model, i)->name));
  }
  cJSON *layouts = cJSON_AddObjectToObject(o, "bucket_layouts");
  cJSON *sizes = cJSON_AddObjectToObject(o, "bucket_sizes");
  cJSON *limits = cJSON_AddObjectToObject(o, "bucket_size_limits");
  if (layouts && sizes && limits) {
    cJSON_AddItemToObject(layouts, "initial", d->initial);
    cJSON_AddItemToObject(sizes, "initial", d->initial_sizes);
    d->initial = d->initial_sizes = NULL;
    cJSON_AddItemToObject(limits, "initial", limits_json(&ld, true));
    cJSON_AddItemToObject(limits, "rebuilt", limits_json(&ld, false));
    if (ld.has_rebuilt_buckets) {
      cJSON *rl = NULL, *rs = NULL;
      if (current_layout(ddp, &rl, &rs)) {
        cJSON_AddItemToObject(layouts, "rebuilt", rl);
        cJSON_AddItemToObject(sizes, "rebuilt", rs);
      } else {
        cJSON_Delete(rl);
        cJSON_Delete(rs);
      }
    } else {
      cJSON_AddNullToObject(layouts, "rebuilt");
      cJSON_AddNullToObject(sizes, "rebuilt");
    }
  }
  cJSON_AddTrueToObject(o, "initial_layout_verified");
  cJSON *ro = cJSON_AddArrayToObject(o, "grad_ready_order");
  for (size_t i = 0; ro && i < ld.num_prev_ready_order; i++) {
    cJSON_AddItemToArray(ro, cJSON_CreateNumber((double)ld.prev_iteration_grad_ready_order_indices[i]));
  }
  cJSON *lg = cJSON_AddObjectToObject(o, "logging_data");
  if (lg) {
    cJSON_AddNumberToObject(lg, "world_size", ld.world_size);
    cJSON_AddNumberToObject(lg, "rank", ld.rank);
    cJSON_AddNumberToObject(lg, "iteration", (double)ld.iteration);
    cJSON_AddStringToObject(lg, "backend_name", ld.backend_name ? ld.backend_name : "");
    cJSON_AddStringToObject(lg, "dtypes", ld.dtypes ? ld.dtypes : "");
    cJSON_AddNumberToObject(lg, "num_parameter_tensors", (double)ld.num_parameter_tensors);
    cJSON_AddNumberToObject(lg, "total_parameter_size_bytes", (double)ld.total_parameter_size_bytes);
    cJSON_AddNumberToObject(lg, "bucket_cap_bytes", (double)ld.bucket_cap_bytes);
    cJSON_AddNumberToObject(lg, "find_unused_parameters", ld.find_unused_parameters);
    cJSON_AddNumberToObject(lg, "broadcast_buffers", ld.broadcast_buffers);
    cJSON_AddNumberToObject(lg, "gradient_as_bucket_view", ld.gradient_as_bucket_view);
    cJSON_AddNumberToObject(lg, "static_graph", ld.static_graph);
    cJSON_AddNumberToObject(lg, "has_rebuilt_buckets", ld.has_rebuilt_buckets);
    cJSON_AddNumberToObject(lg, "unused_parameter_size", (double)ld.unused_parameter_size);
    cJSON_AddNumberToObject(lg, "avg_forward_compute_time", (double)ld.avg_forward_compute_time);
    cJSON_AddNumberToObject(lg, "avg_backward_compute_time", (double)ld.avg_backward_compute_time);
    cJSON_AddNumberToObject(lg, "avg_backward_comm_time", (double)ld.avg_backward_comm_time);
    cJSON_AddNumberToObject(lg, "avg_backward_compute_comm_overlap_time",
                            (double)ld.avg_backward_compute_comm_overlap_time);
  }
  char *text = cJSON_Print(o);
  cJSON_Delete(o);
  if (!text) return DDP_ERR_NO_MEMORY;
  char path[DDP_TRAIN_STR_MAX + 64];
  snprintf(path, sizeof path, "%s/ddp.json", d->dir);
  ddp_status_t st = ddp__train_write_atomic(path, text, strlen(text), err);
  cJSON_free(text);
  return st;
}
