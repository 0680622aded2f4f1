/* The per-step dump writer: docs/dumps.md's layout ("libddp-dump-1"), the one
 * tools/torch/torch_reference.py writes for PyTorch, so that tools/ddp-compare can set a libddp
 * run beside a PyTorch one tensor by tensor and compare the reducers' bucket layouts.
 *
 * Each rank owns one handle and writes only DIR/rank{r}/ (rank 0 also DIR/meta.json), so
 * ranks never contend for a file. Tensor files go through ddp_st_write, which replaces its
 * target atomically; the JSON files are written the same way here (a temporary file in the
 * target's directory, fsync, rename, fsync of the directory: src/common/file.c), so a
 * reader sees either the old file or the whole new one.
 *
 * What PyTorch's reducer reports and libddp's ddp_ddp_get_logging_data gives are mapped
 * key by key: bucket indices in ddp.json refer to the reducer's parameter list (parameters
 * requiring grad, in registration order), which is DDP 1.13's _build_params_for_reducer
 * order for the models the nn layer builds. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "ddp/reducer.h"

#define DUMP_FORMAT "libddp-dump-1"
#define DUMP_PRODUCER "libddp"
#define DUMP_MAGIC 0x44445044u /* "DDPD" */

/* One growing input column (input.x, input.y or input.index): rows of a fixed dtype and
 * per-row shape, appended per micro-batch. */
typedef struct dump_col {
  bool set;
  ddp_dtype_t dtype;
  int ndim; /* of a whole micro-batch: 1 + the per-row dims */
  int64_t row_shape[DDP_MAX_DIMS];
  size_t row_bytes;
  int64_t rows;
  unsigned char *data;
  size_t cap;
} dump_col_t;

struct ddp_dump {
  uint32_t magic;
  char *dir;      /* DIR */
  char *rank_dir; /* DIR/rank{r} */
  int rank, world;
  int64_t planned_steps, written_steps;
  char *producer_version;
  cJSON *config, *model_json;
  ddp_model_t *model;
  ddp_ddp_t *ddp;
  size_t np, nb;
  char **pnames, **gnames, **bnames;
  ddp_tensor_t *grads; /* the copy made by ddp_dump_grads */
  bool have_grads;
  bool *none;           /* [np]: the gradient was None (or frozen) at ddp_dump_grads */
  char **lnames;        /* [np]: "local_grad.<name>" */
  ddp_tensor_t *lgrads; /* [np]: ddp_dump_local_grad's copies this step */
  bool *lset, *lnone;   /* [np]: recorded this step; recorded as None */
  bool have_local;
  dump_col_t x, y, idx;
  cJSON *initial;   /* construction-time layout, recorded at ddp_dump_init */
  cJSON *partition; /* ddp_dump_set_partition's {name: owner}, or NULL */
  ddp_error_t err;
};

/* ---------------------------------------------------------------- files ----------- */

static ddp_status_t mkdir_p(ddp_dump_t *d, const char *path) {
  return ddp__mkdirs(path, d->rank, "dump", &d->err);
}

/* Writes text to dir/name atomically (src/common/file.c): readers see the old file or the
 * complete new one, never a prefix. */
static ddp_status_t write_atomic(ddp_dump_t *d, const char *dir, const char *name,
                                 const char *text) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return ddp__file_write_atomic(path, text, strlen(text), 0644, d->rank, "dump", &d->err);
}

static ddp_status_t write_json(ddp_dump_t *d, const char *dir, const char *name, cJSON *o) {
  char *text = o ? cJSON_Print(o) : NULL;
  if (!text) return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: cannot format %s", name);
  size_t n = strlen(text);
  char *withnl = ddp__malloc(n + 2);
  ddp_status_t st;
  if (!withnl) {
    st = ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: cannot format %s", name);
  } else {
    memcpy(withnl, text, n);
    withnl[n] = '\n';
    withnl[n + 1] = 0;
    st = write_atomic(d, dir, name, withnl);
    ddp__free(withnl);
  }
  cJSON_free(text);
  return st;
}

/* ---------------------------------------------------------------- meta.json ------- */

static ddp_status_t write_meta(ddp_dump_t *d, int64_t steps) {
  cJSON *o = cJSON_CreateObject();
  bool ok = o && cJSON_AddStringToObject(o, "format", DUMP_FORMAT) &&
            cJSON_AddStringToObject(o, "producer", DUMP_PRODUCER) &&
            cJSON_AddStringToObject(o, "producer_version", d->producer_version) &&
            cJSON_AddNumberToObject(o, "world_size", d->world) &&
            cJSON_AddNumberToObject(o, "steps", (double)steps);
  cJSON *cfg = ok ? cJSON_Duplicate(d->config, true) : NULL;
  cJSON *mdl = ok ? cJSON_Duplicate(d->model_json, true) : NULL;
  ok = ok && cfg && mdl;
  if (ok) {
    cJSON_AddItemToObject(o, "config", cfg);
    cJSON_AddItemToObject(o, "model", mdl);
  } else {
    cJSON_Delete(cfg);
    cJSON_Delete(mdl);
  }
  ddp_status_t st = ok ? write_json(d, d->dir, "meta.json", o)
                       : ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY,
                                    "dump: out of memory building meta.json");
  cJSON_Delete(o);
  return st;
}

static ddp_status_t parse_object(ddp_dump_t *d, const char *text, const char *what, cJSON **out) {
  *out = cJSON_Parse(text ? text : "{}");
  if (!*out || !cJSON_IsObject(*out)) {
    cJSON_Delete(*out);
    *out = NULL;
    return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_ARGUMENT, "dump: %s is not a JSON object",
                      what);
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- open, close ----- */

static char *join(const char *a, const char *b) {
  size_t n = strlen(a) + strlen(b) + 1;
  char *s = ddp__malloc(n);
  if (s) snprintf(s, n, "%s%s", a, b);
  return s;
}

void ddp_dump_close(ddp_dump_t *d) {
  if (!d) return;
  DDP_REQUIRE(d->magic == DUMP_MAGIC);
  for (size_t i = 0; i < d->np; i++) {
    if (d->pnames) ddp__free(d->pnames[i]);
    if (d->gnames) ddp__free(d->gnames[i]);
    if (d->grads) ddp_tensor_free(&d->grads[i]);
    if (d->lnames) ddp__free(d->lnames[i]);
    if (d->lgrads) ddp_tensor_free(&d->lgrads[i]);
  }
  ddp__free(d->none);
  ddp__free(d->lnames);
  ddp__free(d->lgrads);
  ddp__free(d->lset);
  ddp__free(d->lnone);
  for (size_t i = 0; d->bnames && i < d->nb; i++) ddp__free(d->bnames[i]);
  ddp__free(d->pnames);
  ddp__free(d->gnames);
  ddp__free(d->bnames);
  ddp__free(d->grads);
  ddp__free(d->x.data);
  ddp__free(d->y.data);
  ddp__free(d->idx.data);
  cJSON_Delete(d->initial);
  cJSON_Delete(d->partition);
  cJSON_Delete(d->config);
  cJSON_Delete(d->model_json);
  ddp__free(d->producer_version);
  ddp__free(d->rank_dir);
  ddp__free(d->dir);
  d->magic = 0;
  ddp__free(d);
}

ddp_status_t ddp_dump_open(const char *dir, int rank, int world, const ddp_dump_options_t *opts,
                           ddp_dump_t **out, ddp_error_t *err) {
  DDP_REQUIRE(dir && out);
  *out = NULL;
  if (world < 1 || rank < 0 || rank >= world)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "dump: rank %d outside [0, %d) (world %d)", rank, world, world);
  ddp_dump_options_t o = DDP_DUMP_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  ddp_dump_t *d = ddp__calloc(1, sizeof *d);
  if (!d) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  d->magic = DUMP_MAGIC;
  d->rank = rank;
  d->world = world;
  d->planned_steps = o.steps;
  char rd[32];
  snprintf(rd, sizeof rd, "/rank%d", rank);
  d->dir = ddp__strdup(dir);
  d->rank_dir = join(dir, rd);
  d->producer_version = ddp__strdup(o.producer_version ? o.producer_version : DUMP_PRODUCER);
  ddp_status_t st = DDP_OK;
  if (!d->dir || !d->rank_dir || !d->producer_version)
    st = ddp__error(&d->err, rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  if (st == DDP_OK) st = parse_object(d, o.config_json, "config_json", &d->config);
  if (st == DDP_OK) st = parse_object(d, o.model_json, "model_json", &d->model_json);
  if (st == DDP_OK) st = mkdir_p(d, d->rank_dir);
  if (st == DDP_OK && rank == 0) st = write_meta(d, o.steps);
  if (st != DDP_OK) {
    if (err) *err = d->err;
    ddp_dump_close(d);
    return st;
  }
  *out = d;
  return DDP_OK;
}

void ddp_dump_last_error_copy(const ddp_dump_t *d, ddp_error_t *out) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && out);
  *out = d->err;
}

/* ---------------------------------------------------------------- init ------------ */

static ddp_status_t write_init(ddp_dump_t *d) {
  size_t n = d->np + d->nb;
  ddp_st_entry_t *e = ddp__calloc(n ? n : 1, sizeof *e);
  if (!e) return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  for (size_t i = 0; i < d->np; i++) {
    e[i].name = d->pnames[i];
    e[i].tensor = &ddp_model_param(d->model, i)->value;
  }
  for (size_t i = 0; i < d->nb; i++) {
    e[d->np + i].name = d->bnames[i];
    e[d->np + i].tensor = &ddp_model_buffer(d->model, i)->value;
  }
  char rank_s[16], path[4200];
  snprintf(rank_s, sizeof rank_s, "%d", d->rank);
  snprintf(path, sizeof path, "%s/init.safetensors", d->rank_dir);
  const char *mk[2] = {"rank", "producer"}, *mv[2] = {rank_s, DUMP_PRODUCER};
  ddp_status_t st = ddp_st_write(path, e, n, mk, mv, 2, &d->err);
  ddp__free(e);
  return st;
}

ddp_status_t ddp_dump_init(ddp_dump_t *d, ddp_model_t *model, ddp_ddp_t *ddp) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && model && d->model == NULL);
  DDP_REQUIRE(ddp_model_finalized(model));
  d->model = model;
  d->ddp = ddp;
  d->np = ddp_model_num_params(model);
  d->nb = ddp_model_num_buffers(model);
  size_t np1 = d->np ? d->np : 1, nb1 = d->nb ? d->nb : 1;
  d->pnames = ddp__calloc(np1, sizeof(char *));
  d->gnames = ddp__calloc(np1, sizeof(char *));
  d->bnames = ddp__calloc(nb1, sizeof(char *));
  d->grads = ddp__calloc(np1, sizeof(ddp_tensor_t));
  d->none = ddp__calloc(np1, sizeof(bool));
  d->lnames = ddp__calloc(np1, sizeof(char *));
  d->lgrads = ddp__calloc(np1, sizeof(ddp_tensor_t));
  d->lset = ddp__calloc(np1, sizeof(bool));
  d->lnone = ddp__calloc(np1, sizeof(bool));
  bool ok = d->pnames && d->gnames && d->bnames && d->grads && d->none && d->lnames && d->lgrads &&
            d->lset && d->lnone;
  for (size_t i = 0; ok && i < d->np; i++) {
    const ddp_param_t *p = ddp_model_param(model, i);
    d->pnames[i] = join("param.", p->name);
    d->gnames[i] = join("grad.", p->name);
    d->lnames[i] = join("local_grad.", p->name);
    ok = d->pnames[i] && d->gnames[i] && d->lnames[i] &&
         ddp_tensor_alloc(&d->grads[i], p->value.dtype, p->value.ndim, p->value.shape) == DDP_OK;
  }
  for (size_t i = 0; ok && i < d->nb; i++) {
    d->bnames[i] = join("buffer.", ddp_model_buffer(model, i)->name);
    ok = d->bnames[i] != NULL;
  }
  if (!ok) return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  if (ddp) {
    /* The layout as constructed: the reducer rebuilds it at a later forward. */
    d->initial = cJSON_CreateArray();
    for (size_t b = 0; ok && d->initial && b < ddp_ddp_num_buckets(ddp); b++) {
      size_t n;
      const size_t *ix = ddp_ddp_bucket_params(ddp, b, &n);
      cJSON *arr = cJSON_CreateArray();
      ok = arr != NULL;
      for (size_t k = 0; ok && k < n; k++) {
        cJSON *v = cJSON_CreateNumber((double)ix[k]);
        ok = v != NULL;
        if (ok) cJSON_AddItemToArray(arr, v);
      }
      if (arr) cJSON_AddItemToArray(d->initial, arr);
    }
    if (!ok || !d->initial)
      return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  }
  return write_init(d);
}

/* ---------------------------------------------------------------- a step ---------- */

static ddp_status_t col_append(ddp_dump_t *d, dump_col_t *c, const char *what, ddp_dtype_t dt,
                               int ndim, const int64_t *shape, const void *src) {
  if (ndim < 1)
    return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_ARGUMENT,
                      "dump: %s must have a batch dimension", what);
  size_t row = ddp_dtype_size(dt);
  for (int i = 1; i < ndim; i++) row *= (size_t)shape[i];
  if (!c->set) {
    c->set = true;
    c->dtype = dt;
    c->ndim = ndim;
    memcpy(c->row_shape, shape, sizeof(int64_t) * (size_t)ndim);
    c->row_bytes = row;
  } else {
    bool same = c->dtype == dt && c->ndim == ndim;
    for (int i = 1; same && i < ndim; i++) same = c->row_shape[i] == shape[i];
    if (!same)
      return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_ARGUMENT,
                        "dump: %s of this micro-batch differs in dtype or row shape from the "
                        "first micro-batch's",
                        what);
  }
  size_t add = row * (size_t)shape[0], need = c->row_bytes * (size_t)c->rows + add;
  if (need > c->cap) {
    size_t cap = c->cap ? c->cap : 4096;
    while (cap < need) cap *= 2;
    unsigned char *p = ddp__realloc(c->data, cap);
    if (!p) return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
    c->data = p;
    c->cap = cap;
  }
  if (add) memcpy(c->data + c->row_bytes * (size_t)c->rows, src, add);
  c->rows += shape[0];
  return DDP_OK;
}

ddp_status_t ddp_dump_input(ddp_dump_t *d, const ddp_tensor_t *x, const ddp_tensor_t *y,
                            const int64_t *indices) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && x && y);
  if (x->ndim < 1 || y->ndim < 1 || x->shape[0] != y->shape[0])
    return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_ARGUMENT,
                      "dump: inputs need one row per sample (x has %" PRId64 ", y %" PRId64 ")",
                      x->ndim ? x->shape[0] : 0, y->ndim ? y->shape[0] : 0);
  int64_t n = x->shape[0];
  int64_t *ix = ddp__malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
  if (!ix) return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  for (int64_t i = 0; i < n; i++) ix[i] = indices ? indices[i] : -1;
  ddp_status_t st = col_append(d, &d->x, "input.x", x->dtype, x->ndim, x->shape, x->data);
  if (st == DDP_OK) st = col_append(d, &d->y, "input.y", y->dtype, y->ndim, y->shape, y->data);
  if (st == DDP_OK) st = col_append(d, &d->idx, "input.index", DDP_I64, 1, &n, ix);
  ddp__free(ix);
  return st;
}

ddp_status_t ddp_dump_grads(ddp_dump_t *d) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && d->model);
  for (size_t i = 0; i < d->np; i++) {
    const ddp_param_t *p = ddp_model_param(d->model, i);
    size_t bytes = ddp_tensor_nbytes(&d->grads[i]);
    d->none[i] = !p->requires_grad || !p->grad.data;
    if (!d->none[i])
      memcpy(d->grads[i].data, p->grad.data, bytes);
    else
      memset(d->grads[i].data, 0, bytes);
  }
  d->have_grads = true;
  return DDP_OK;
}

ddp_status_t ddp_dump_local_grad(ddp_dump_t *d, size_t index, const void *grad) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && d->model && index < d->np);
  const ddp_param_t *p = ddp_model_param(d->model, index);
  ddp_tensor_t *t = &d->lgrads[index];
  if (!t->data && ddp_tensor_alloc(t, p->value.dtype, p->value.ndim, p->value.shape) != DDP_OK)
    return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  size_t bytes = ddp_tensor_nbytes(t);
  if (grad)
    memcpy(t->data, grad, bytes);
  else
    memset(t->data, 0, bytes);
  d->lset[index] = true;
  d->lnone[index] = grad == NULL;
  d->have_local = true;
  return DDP_OK;
}

/* A view over a column's rows; an unset column is an empty F32 [0]. */
static ddp_tensor_t col_view(const dump_col_t *c) {
  ddp_tensor_t t;
  memset(&t, 0, sizeof t);
  if (!c->set) {
    t.dtype = DDP_F32;
    t.ndim = 1;
    return t;
  }
  t.dtype = c->dtype;
  t.ndim = c->ndim;
  memcpy(t.shape, c->row_shape, sizeof(int64_t) * (size_t)c->ndim);
  t.shape[0] = c->rows;
  t.numel = c->rows;
  for (int i = 1; i < c->ndim; i++) t.numel *= c->row_shape[i];
  t.data = c->data;
  t.owns = false;
  return t;
}

ddp_status_t ddp_dump_step(ddp_dump_t *d, int64_t step, double loss, int micro_batches,
                           uint64_t flags) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && d->model);
  if (!d->have_grads)
    return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_USAGE,
                      "dump: step %" PRId64 " written without ddp_dump_grads", step);
  if (step < 0 || step > 999999)
    return ddp__error(&d->err, d->rank, DDP_ERR_INVALID_ARGUMENT,
                      "dump: step %" PRId64 " outside the six-digit file names", step);
  size_t n = 3 + 2 * d->np + d->nb;
  size_t nlocal = 0;
  for (size_t i = 0; d->have_local && i < d->np; i++) nlocal += d->lset[i];
  ddp_st_entry_t *e = ddp__calloc(n + nlocal, sizeof *e);
  size_t none_len = 1, lnone_len = 1;
  for (size_t i = 0; d->have_local && i < d->np; i++)
    if (d->lset[i] && d->lnone[i]) lnone_len += strlen(ddp_model_param(d->model, i)->name) + 1;
  char *lnone = ddp__malloc(lnone_len);
  for (size_t i = 0; i < d->np; i++)
    if (d->none[i]) none_len += strlen(ddp_model_param(d->model, i)->name) + 1;
  char *none = ddp__malloc(none_len);
  if (!e || !none || !lnone) {
    ddp__free(e);
    ddp__free(none);
    ddp__free(lnone);
    return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY, "dump: out of memory");
  }
  ddp_tensor_t x = col_view(&d->x), y = col_view(&d->y), ix = col_view(&d->idx);
  if (!d->idx.set) ix.dtype = DDP_I64;
  e[0] = (ddp_st_entry_t){"input.x", &x};
  e[1] = (ddp_st_entry_t){"input.y", &y};
  e[2] = (ddp_st_entry_t){"input.index", &ix};
  size_t k = 3;
  none[0] = 0;
  for (size_t i = 0; i < d->np; i++) {
    e[k++] = (ddp_st_entry_t){d->gnames[i], &d->grads[i]};
    const ddp_param_t *p = ddp_model_param(d->model, i);
    if (d->none[i]) {
      if (none[0]) strcat(none, ",");
      strcat(none, p->name);
    }
  }
  for (size_t i = 0; i < d->np; i++)
    e[k++] = (ddp_st_entry_t){d->pnames[i], &ddp_model_param(d->model, i)->value};
  for (size_t i = 0; i < d->nb; i++)
    e[k++] = (ddp_st_entry_t){d->bnames[i], &ddp_model_buffer(d->model, i)->value};
  lnone[0] = 0;
  for (size_t i = 0; d->have_local && i < d->np; i++) {
    if (!d->lset[i]) continue;
    e[k++] = (ddp_st_entry_t){d->lnames[i], &d->lgrads[i]};
    if (d->lnone[i]) {
      if (lnone[0]) strcat(lnone, ",");
      strcat(lnone, ddp_model_param(d->model, i)->name);
    }
  }
  char step_s[24], rank_s[16], loss_s[40], mb_s[16], flags_s[24], path[4200];
  snprintf(step_s, sizeof step_s, "%" PRId64, step);
  snprintf(rank_s, sizeof rank_s, "%d", d->rank);
  snprintf(loss_s, sizeof loss_s, "%.17g", loss);
  snprintf(mb_s, sizeof mb_s, "%d", micro_batches);
  snprintf(flags_s, sizeof flags_s, "%" PRIu64, flags);
  snprintf(path, sizeof path, "%s/step%06" PRId64 ".safetensors", d->rank_dir, step);
  const char *mk[7] =
      {"step", "rank", "loss", "micro_batches", "flags", "grads_none", "local_grads_none"};
  const char *mv[7] = {step_s, rank_s, loss_s, mb_s, flags_s, none, lnone};
  ddp_status_t st = ddp_st_write(path, e, k, mk, mv, d->have_local ? 7 : 6, &d->err);
  ddp__free(e);
  ddp__free(none);
  ddp__free(lnone);
  if (st != DDP_OK) return st;
  d->x.rows = d->y.rows = d->idx.rows = 0;
  d->have_grads = false;
  d->have_local = false;
  for (size_t i = 0; i < d->np; i++) d->lset[i] = false;
  if (step + 1 > d->written_steps) d->written_steps = step + 1;
  return DDP_OK;
}

/* ---------------------------------------------------------------- ddp.json -------- */

/* A JSON array of n integers; v holds int64_t (is_size false) or size_t values. */
static cJSON *num_array(const void *v, bool is_size, size_t n) {
  cJSON *a = cJSON_CreateArray();
  for (size_t i = 0; a && i < n; i++) {
    double d = is_size ? (double)((const size_t *)v)[i] : (double)((const int64_t *)v)[i];
    cJSON *x = cJSON_CreateNumber(d);
    if (!x) {
      cJSON_Delete(a);
      return NULL;
    }
    cJSON_AddItemToArray(a, x);
  }
  return a;
}

static cJSON *int_array(const int64_t *v, size_t n) { return num_array(v, false, n); }
static cJSON *size_array(const size_t *v, size_t n) { return num_array(v, true, n); }

/* Appends to a growing string buffer; false when out of memory. */
typedef struct strbuf {
  char *s;
  size_t len, cap;
} strbuf_t;

static bool sb_add(strbuf_t *b, const char *fmt, ...) DDP_PRINTF(2, 3);
static bool sb_add(strbuf_t *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) return false;
    if (b->s && b->len + (size_t)n < b->cap) {
      b->len += (size_t)n;
      return true;
    }
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->len + (size_t)n + 1) cap *= 2;
    char *p = ddp__realloc(b->s, cap);
    if (!p) return false;
    b->s = p;
    b->cap = cap;
  }
}

/* PyTorch's string forms: "a, b, c" for sizes and orders; "3 2, 1 0" for per-bucket
 * indices. */
static bool add_joined(cJSON *o, const char *key, const int64_t *v, size_t n) {
  strbuf_t b = {0};
  bool ok = sb_add(&b, "%s", "");
  for (size_t i = 0; ok && i < n; i++) ok = sb_add(&b, "%s%" PRId64, i ? ", " : "", v[i]);
  ok = ok && cJSON_AddStringToObject(o, key, b.s) != NULL;
  ddp__free(b.s);
  return ok;
}

static bool add_joined_sz(cJSON *o, const char *key, const size_t *v, size_t n) {
  strbuf_t b = {0};
  bool ok = sb_add(&b, "%s", "");
  for (size_t i = 0; ok && i < n; i++) ok = sb_add(&b, "%s%zu", i ? ", " : "", v[i]);
  ok = ok && cJSON_AddStringToObject(o, key, b.s) != NULL;
  ddp__free(b.s);
  return ok;
}

static bool add_per_bucket(cJSON *o, const char *key, const size_t *offsets, const size_t *indices,
                           size_t nbuckets) {
  strbuf_t b = {0};
  bool ok = sb_add(&b, "%s", "");
  for (size_t k = 0; ok && k < nbuckets; k++)
    for (size_t j = offsets[k]; ok && j < offsets[k + 1]; j++)
      ok = sb_add(&b, "%s%zu", j > offsets[k] ? " " : (k ? ", " : ""), indices[j]);
  ok = ok && cJSON_AddStringToObject(o, key, b.s) != NULL;
  ddp__free(b.s);
  return ok;
}

/* get_ddp_logging_data's keys as PyTorch 1.13 returns them: flags and counts as
 * integers, lists as strings. */
static cJSON *logging_json(const ddp_ddp_logging_data_t *ld) {
  cJSON *o = cJSON_CreateObject();
  bool ok = o != NULL;
#define NUM(k, v) ok = ok && cJSON_AddNumberToObject(o, k, (double)(v)) != NULL
#define STR(k, v) ok = ok && cJSON_AddStringToObject(o, k, (v) ? (v) : "") != NULL
  NUM("world_size", ld->world_size);
  NUM("rank", ld->rank);
  NUM("iteration", ld->iteration);
  STR("backend_name", ld->backend_name);
  STR("module_name", ld->module_name);
  NUM("num_parameter_tensors", ld->num_parameter_tensors);
  NUM("total_parameter_size_bytes", ld->total_parameter_size_bytes);
  STR("dtypes", ld->dtypes);
  NUM("broadcast_buffers", ld->broadcast_buffers);
  NUM("find_unused_parameters", ld->find_unused_parameters);
  NUM("gradient_as_bucket_view", ld->gradient_as_bucket_view);
  NUM("static_graph", ld->static_graph);
  NUM("bucket_cap_bytes", ld->bucket_cap_bytes);
  ok = ok && add_joined(o, "bucket_sizes", ld->bucket_sizes, ld->num_initial_buckets);
  NUM("has_rebuilt_buckets", ld->has_rebuilt_buckets);
  if (ld->has_rebuilt_buckets) {
    ok = ok &&
         add_joined(o, "rebuilt_bucket_sizes", ld->rebuilt_bucket_sizes, ld->num_rebuilt_buckets);
    ok = ok &&
         add_per_bucket(o, "rebuilt_per_bucket_param_indices", ld->rebuilt_per_bucket_param_offsets,
                        ld->rebuilt_per_bucket_param_indices, ld->num_rebuilt_buckets);
  }
  ok = ok && add_joined_sz(o, "prev_iteration_grad_ready_order_indices",
                           ld->prev_iteration_grad_ready_order_indices, ld->num_prev_ready_order);
  NUM("unused_parameter_size", ld->unused_parameter_size);
  NUM("avg_forward_compute_time", ld->avg_forward_compute_time);
  NUM("avg_backward_compute_time", ld->avg_backward_compute_time);
  NUM("avg_backward_comm_time", ld->avg_backward_comm_time);
  NUM("avg_backward_compute_comm_overlap_time", ld->avg_backward_compute_comm_overlap_time);
  STR("comm_hook", ld->comm_hook);
  NUM("join_uneven_inputs", ld->join_uneven_inputs);
  NUM("can_set_static_graph", ld->can_set_static_graph);
#undef NUM
#undef STR
  if (!ok) {
    cJSON_Delete(o);
    return NULL;
  }
  return o;
}

static cJSON *shape_json(const ddp_tensor_t *t) { return int_array(t->shape, (size_t)t->ndim); }

/* param_names and param_shapes (the reducer's parameters), state_param_names and
 * buffer_names (the model's), in that order. */
static bool add_names(ddp_dump_t *d, cJSON *o) {
  ddp_ddp_t *ddp = d->ddp;
  cJSON *names = cJSON_CreateArray(), *shapes = cJSON_CreateArray();
  cJSON *snames = cJSON_CreateArray(), *bnames = cJSON_CreateArray();
  bool ok = names && shapes && snames && bnames;
  if (!ok) {
    cJSON_Delete(names);
    cJSON_Delete(shapes);
    cJSON_Delete(snames);
    cJSON_Delete(bnames);
    return false;
  }
  cJSON_AddItemToObject(o, "param_names", names);
  cJSON_AddItemToObject(o, "param_shapes", shapes);
  cJSON_AddItemToObject(o, "state_param_names", snames);
  cJSON_AddItemToObject(o, "buffer_names", bnames);
  size_t nm = ddp_ddp_num_params(ddp);
  for (size_t i = 0; ok && i < nm; i++) {
    ddp_param_t *p = ddp_ddp_param(ddp, i);
    cJSON *s = shape_json(&p->value), *nmj = cJSON_CreateString(p->name);
    ok = s && nmj;
    if (s) cJSON_AddItemToArray(shapes, s);
    if (nmj) cJSON_AddItemToArray(names, nmj);
  }
  for (size_t i = 0; ok && i < d->np; i++) {
    cJSON *s = cJSON_CreateString(ddp_model_param(d->model, i)->name);
    ok = s != NULL;
    if (s) cJSON_AddItemToArray(snames, s);
  }
  for (size_t i = 0; ok && i < d->nb; i++) {
    cJSON *s = cJSON_CreateString(ddp_model_buffer(d->model, i)->name);
    ok = s != NULL;
    if (s) cJSON_AddItemToArray(bnames, s);
  }
  return ok;
}

/* The rebuilt layout as arrays of parameter indices, or null when no rebuild happened (as
 * PyTorch reports it). */
static cJSON *rebuilt_layout(const ddp_ddp_logging_data_t *ld) {
  if (!ld->has_rebuilt_buckets) return cJSON_CreateNull();
  cJSON *reb = cJSON_CreateArray();
  for (size_t b = 0; reb && b < ld->num_rebuilt_buckets; b++) {
    size_t lo = ld->rebuilt_per_bucket_param_offsets[b];
    size_t hi = ld->rebuilt_per_bucket_param_offsets[b + 1];
    cJSON *arr = size_array(ld->rebuilt_per_bucket_param_indices + lo, hi - lo);
    if (!arr) {
      cJSON_Delete(reb);
      return NULL;
    }
    cJSON_AddItemToArray(reb, arr);
  }
  return reb;
}

/* Adds item under key to o; false (item freed) when it is NULL or o is. */
static bool add_item(cJSON *o, const char *key, cJSON *item) {
  if (!o || !item) {
    cJSON_Delete(item);
    return false;
  }
  cJSON_AddItemToObject(o, key, item);
  return true;
}

/* bucket_layouts, bucket_sizes and bucket_size_limits, each {initial, rebuilt}: the
 * initial layout recorded at ddp_dump_init, the rebuilt one from the logging data. */
static bool add_layouts(ddp_dump_t *d, const ddp_ddp_logging_data_t *ld, cJSON *o) {
  cJSON *layouts = cJSON_AddObjectToObject(o, "bucket_layouts");
  cJSON *sizes = layouts ? cJSON_AddObjectToObject(o, "bucket_sizes") : NULL;
  cJSON *limits = sizes ? cJSON_AddObjectToObject(o, "bucket_size_limits") : NULL;
  if (!limits) return false;
  bool ok = add_item(layouts, "initial", cJSON_Duplicate(d->initial, true)) &&
            add_item(layouts, "rebuilt", rebuilt_layout(ld)) &&
            add_item(sizes, "initial", int_array(ld->bucket_sizes, ld->num_initial_buckets)) &&
            add_item(sizes, "rebuilt",
                     ld->has_rebuilt_buckets
                         ? int_array(ld->rebuilt_bucket_sizes, ld->num_rebuilt_buckets)
                         : cJSON_CreateNull());
  if (!ok) return false;
  /* Limits as PyTorch's _ddp_init_helper passes them: none (one bucket per dtype) or
   * [first bucket, cap]; the rebuild always uses [first bucket, cap]. */
  bool unlimited = true;
  for (size_t b = 0; b < ld->num_initial_buckets; b++)
    if (ld->initial_bucket_size_limits && ld->initial_bucket_size_limits[b] != INT64_MAX)
      unlimited = false;
  int64_t pair[2] = {ld->first_bucket_bytes, ld->bucket_cap_bytes};
  return add_item(limits, "initial", unlimited ? cJSON_CreateNull() : int_array(pair, 2)) &&
         add_item(limits, "rebuilt", int_array(pair, 2));
}

/* The recorded initial layout's bytes against the sizes the reducer reports. */
static bool initial_layout_verified(ddp_dump_t *d, const ddp_ddp_logging_data_t *ld) {
  size_t nm = ddp_ddp_num_params(d->ddp);
  bool verified = (size_t)cJSON_GetArraySize(d->initial) == ld->num_initial_buckets;
  for (size_t b = 0; verified && b < ld->num_initial_buckets; b++) {
    int64_t bytes = 0;
    const cJSON *ix;
    cJSON_ArrayForEach(ix, cJSON_GetArrayItem(d->initial, (int)b)) {
      size_t i = (size_t)ix->valuedouble;
      if (i >= nm) {
        verified = false;
        break;
      }
      const ddp_tensor_t *v = &ddp_ddp_param(d->ddp, i)->value;
      bytes += v->numel * (int64_t)ddp_dtype_size(v->dtype);
    }
    verified = verified && bytes == ld->bucket_sizes[b];
  }
  return verified;
}

static cJSON *ddp_json(ddp_dump_t *d) {
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(d->ddp, &ld);
  cJSON *o = cJSON_CreateObject();
  bool ok = o && add_names(d, o) && add_layouts(d, &ld, o);
  ok = ok && cJSON_AddBoolToObject(o, "initial_layout_verified", initial_layout_verified(d, &ld));
  ok = ok &&
       add_item(o, "grad_ready_order",
                ld.num_prev_ready_order ? size_array(ld.prev_iteration_grad_ready_order_indices,
                                                     ld.num_prev_ready_order)
                                        : cJSON_CreateNull());
  ok = ok && add_item(o, "logging_data", logging_json(&ld));
  ok = ok && (!d->partition || add_item(o, "zero_partition", cJSON_Duplicate(d->partition, true)));
  if (!ok) {
    cJSON_Delete(o);
    return NULL;
  }
  return o;
}

ddp_status_t ddp_dump_set_partition(ddp_dump_t *d, const char *const *names, const int *owner,
                                    size_t n) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC && (n == 0 || (names && owner)));
  cJSON *o = cJSON_CreateObject();
  for (size_t i = 0; o && i < n; i++)
    if (!cJSON_AddNumberToObject(o, names[i], owner[i])) {
      cJSON_Delete(o);
      o = NULL;
    }
  if (!o)
    return ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY,
                      "dump: out of memory recording the partition (%zu parameters)", n);
  cJSON_Delete(d->partition);
  d->partition = o;
  return DDP_OK;
}

ddp_status_t ddp_dump_finish(ddp_dump_t *d) {
  DDP_REQUIRE(d && d->magic == DUMP_MAGIC);
  ddp_status_t st = DDP_OK;
  if (d->ddp) {
    cJSON *o = ddp_json(d);
    st = o ? write_json(d, d->rank_dir, "ddp.json", o)
           : ddp__error(&d->err, d->rank, DDP_ERR_NO_MEMORY,
                        "dump: out of memory building ddp.json");
    cJSON_Delete(o);
  }
  if (st == DDP_OK && d->rank == 0 && d->written_steps != d->planned_steps)
    st = write_meta(d, d->written_steps);
  return st;
}
