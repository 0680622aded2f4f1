/* The dataset handle (a table of functions plus a per-sample layout), sample and batch
 * access, and the in-memory sources: tensors given by the caller and a safetensors file. */
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"
#include "ddp/io.h"

#define DATASET_MAGIC 0x44534554u /* "DSET" */

static ddp_status_t shape_numel(int ndim, const int64_t *shape, ddp_dtype_t dt, const char *what,
                                int64_t *numel, ddp_error_t *err) {
  if (!ddp_dtype_valid((int)dt))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "dataset: %s dtype %d is not valid", what,
                      (int)dt);
  if (ndim < 0 || ndim > DDP_MAX_DIMS ||
      ddp_shape_numel(ndim, shape, ddp_dtype_size(dt), numel) != DDP_OK)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "dataset: %s shape is not valid", what);
  return DDP_OK;
}

ddp_status_t ddp__sample_spec_sizes(const ddp_sample_spec_t *spec, int64_t *fnumel, int64_t *lnumel,
                                    ddp_error_t *err) {
  DDP_CHECK(shape_numel(spec->feature_ndim, spec->feature_shape, spec->feature_dtype, "feature",
                        fnumel, err));
  DDP_CHECK(
      shape_numel(spec->label_ndim, spec->label_shape, spec->label_dtype, "label", lnumel, err));
  return DDP_OK;
}

ddp_status_t ddp_dataset_create(const ddp_dataset_ops_t *ops, void *self,
                                const ddp_sample_spec_t *spec, ddp_dataset_t **out,
                                ddp_error_t *err) {
  DDP_REQUIRE(ops && spec && out);
  DDP_REQUIRE(ops->length && ops->get);
  *out = NULL;
  ddp_status_t st;
  int64_t fn = 0, ln = 0;
  if (ops->version != DDP_DATASET_OPS_VERSION) {
    st = ddp__error(err, -1, DDP_ERR_UNSUPPORTED,
                    "dataset '%s': ops version %u, this library speaks version %d",
                    ops->name ? ops->name : "?", ops->version, DDP_DATASET_OPS_VERSION);
    goto fail;
  }
  DDP_CHECK_GOTO(ddp__sample_spec_sizes(spec, &fn, &ln, err), st, fail);
  ddp_dataset_t *ds = ddp__calloc(1, sizeof *ds);
  if (!ds) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  ds->magic = DATASET_MAGIC;
  ds->ops = ops;
  ds->self = self;
  ds->spec = *spec;
  ds->feature_numel = fn;
  ds->label_numel = ln;
  ds->feature_bytes = (size_t)fn * ddp_dtype_size(spec->feature_dtype);
  ds->label_bytes = (size_t)ln * ddp_dtype_size(spec->label_dtype);
  *out = ds;
  return DDP_OK;
fail:
  if (ops->destroy) ops->destroy(self);
  return st;
}

void ddp_dataset_destroy(ddp_dataset_t *ds) {
  if (!ds) return;
  DDP_REQUIRE(ds->magic == DATASET_MAGIC);
  if (ds->ops->destroy) ds->ops->destroy(ds->self);
  ds->magic = 0;
  ddp__free(ds);
}

#define CHECK_DS(ds) DDP_REQUIRE((ds) && (ds)->magic == DATASET_MAGIC)

int64_t ddp_dataset_length(const ddp_dataset_t *ds) {
  CHECK_DS(ds);
  return ds->ops->length(ds->self);
}

const ddp_sample_spec_t *ddp_dataset_spec(const ddp_dataset_t *ds) {
  CHECK_DS(ds);
  return &ds->spec;
}

const char *ddp_dataset_name(const ddp_dataset_t *ds) {
  CHECK_DS(ds);
  return ds->ops->name ? ds->ops->name : "dataset";
}

int64_t ddp_dataset_feature_numel(const ddp_dataset_t *ds) {
  CHECK_DS(ds);
  return ds->feature_numel;
}

int64_t ddp_dataset_label_numel(const ddp_dataset_t *ds) {
  CHECK_DS(ds);
  return ds->label_numel;
}

ddp_status_t ddp_dataset_get(const ddp_dataset_t *ds, int64_t index, ddp_tensor_t *feature,
                             ddp_tensor_t *label, ddp_error_t *err) {
  CHECK_DS(ds);
  DDP_REQUIRE(feature && label);
  int64_t n = ds->ops->length(ds->self);
  if (index < 0 || index >= n)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "dataset '%s': index %lld out of range [0, %lld)", ddp_dataset_name(ds),
                      (long long)index, (long long)n);
  if (feature->dtype != ds->spec.feature_dtype || feature->numel != ds->feature_numel ||
      label->dtype != ds->spec.label_dtype || label->numel != ds->label_numel ||
      (!feature->data && feature->numel) || (!label->data && label->numel))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "dataset '%s': sample tensors must be %s[%lld] and %s[%lld]",
                      ddp_dataset_name(ds), ddp_dtype_name(ds->spec.feature_dtype),
                      (long long)ds->feature_numel, ddp_dtype_name(ds->spec.label_dtype),
                      (long long)ds->label_numel);
  return ds->ops->get(ds->self, index, feature->data, label->data, err);
}

ddp_status_t ddp_dataset_get_batch(const ddp_dataset_t *ds, const int64_t *indices, int64_t n,
                                   ddp_tensor_t *features, ddp_tensor_t *labels, ddp_error_t *err) {
  CHECK_DS(ds);
  DDP_REQUIRE(features && labels && (indices || n == 0) && n >= 0);
  if (features->dtype != ds->spec.feature_dtype || labels->dtype != ds->spec.label_dtype ||
      features->numel < n * ds->feature_numel || labels->numel < n * ds->label_numel ||
      (n > 0 && (!features->data || !labels->data)))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "dataset '%s': a batch of %lld needs %s[>= %lld] features and %s[>= "
                      "%lld] labels",
                      ddp_dataset_name(ds), (long long)n, ddp_dtype_name(ds->spec.feature_dtype),
                      (long long)(n * ds->feature_numel), ddp_dtype_name(ds->spec.label_dtype),
                      (long long)(n * ds->label_numel));
  int64_t len = ds->ops->length(ds->self);
  unsigned char *f = features->data, *l = labels->data;
  for (int64_t k = 0; k < n; k++) {
    if (indices[k] < 0 || indices[k] >= len)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "dataset '%s': batch row %lld has index %lld, out of range [0, %lld)",
                        ddp_dataset_name(ds), (long long)k, (long long)indices[k], (long long)len);
    DDP_CHECK(ds->ops->get(ds->self, indices[k], f + (size_t)k * ds->feature_bytes,
                           l + (size_t)k * ds->label_bytes, err));
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- in memory ------- */

typedef struct memory_ds {
  int64_t n;
  size_t fbytes, lbytes;
  unsigned char *features; /* [n * fbytes], ddp__aligned_alloc */
  unsigned char *labels;   /* [n * lbytes] */
} memory_ds_t;

static int64_t memory_length(void *self) { return ((memory_ds_t *)self)->n; }

static ddp_status_t memory_get(void *self, int64_t i, void *feature, void *label,
                               ddp_error_t *err) {
  memory_ds_t *m = self;
  memcpy(feature, m->features + (size_t)i * m->fbytes, m->fbytes);
  memcpy(label, m->labels + (size_t)i * m->lbytes, m->lbytes);
  return DDP_OK;
}

static void memory_destroy(void *self) {
  memory_ds_t *m = self;
  if (!m) return;
  ddp__aligned_free(m->features);
  ddp__aligned_free(m->labels);
  ddp__free(m);
}

/* One ops table per name, so ddp_dataset_name says where the data came from. */
static const ddp_dataset_ops_t memory_ops = {DDP_DATASET_OPS_VERSION, "tensors", memory_length,
                                             memory_get, memory_destroy};
static const ddp_dataset_ops_t safetensors_ops = {DDP_DATASET_OPS_VERSION, "safetensors",
                                                  memory_length, memory_get, memory_destroy};
static const ddp_dataset_ops_t csv_ops = {DDP_DATASET_OPS_VERSION, "csv", memory_length, memory_get,
                                          memory_destroy};
static const ddp_dataset_ops_t text_csv_ops = {DDP_DATASET_OPS_VERSION, "text_csv", memory_length,
                                               memory_get, memory_destroy};

ddp_status_t ddp__dataset_memory(const char *name, const ddp_sample_spec_t *spec, int64_t n,
                                 void *features, void *labels, ddp_dataset_t **out,
                                 ddp_error_t *err) {
  int64_t fn, ln;
  ddp_status_t st = ddp__sample_spec_sizes(spec, &fn, &ln, err);
  memory_ds_t *m = NULL;
  if (st != DDP_OK) goto fail;
  m = ddp__calloc(1, sizeof *m);
  if (!m) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  m->n = n;
  m->fbytes = (size_t)fn * ddp_dtype_size(spec->feature_dtype);
  m->lbytes = (size_t)ln * ddp_dtype_size(spec->label_dtype);
  m->features = features;
  m->labels = labels;
  const ddp_dataset_ops_t *ops = &memory_ops;
  if (strcmp(name, "safetensors") == 0) ops = &safetensors_ops;
  if (strcmp(name, "csv") == 0) ops = &csv_ops;
  if (strcmp(name, "text_csv") == 0) ops = &text_csv_ops;
  return ddp_dataset_create(ops, m, spec, out, err);
fail:
  ddp__aligned_free(features);
  ddp__aligned_free(labels);
  return st;
}

/* Splits a [N, ...] tensor's shape into N and the per-sample shape. */
static ddp_status_t split_rows(const ddp_tensor_t *t, const char *what, int64_t *n, int *ndim,
                               int64_t *shape, ddp_error_t *err) {
  if (t->ndim < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "dataset: %s must have a leading sample dimension (got a scalar)", what);
  *n = t->shape[0];
  *ndim = t->ndim - 1;
  for (int d = 1; d < t->ndim; d++) shape[d - 1] = t->shape[d];
  return DDP_OK;
}

static ddp_status_t from_tensors(const char *name, const ddp_tensor_t *features,
                                 const ddp_tensor_t *labels, const char *where, ddp_dataset_t **out,
                                 ddp_error_t *err) {
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  int64_t nf = 0, nl = 0;
  DDP_CHECK(split_rows(features, "features", &nf, &spec.feature_ndim, spec.feature_shape, err));
  DDP_CHECK(split_rows(labels, "labels", &nl, &spec.label_ndim, spec.label_shape, err));
  if (nf != nl)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "dataset%s%s: features have %lld samples but labels have %lld",
                      where ? " " : "", where ? where : "", (long long)nf, (long long)nl);
  spec.feature_dtype = features->dtype;
  spec.label_dtype = labels->dtype;
  size_t fb = ddp_tensor_nbytes(features), lb = ddp_tensor_nbytes(labels);
  void *f = ddp__aligned_alloc(fb ? fb : 1), *l = ddp__aligned_alloc(lb ? lb : 1);
  if (!f || !l) {
    ddp__aligned_free(f);
    ddp__aligned_free(l);
    return DDP_ERR_NO_MEMORY;
  }
  if (fb) memcpy(f, features->data, fb);
  if (lb) memcpy(l, labels->data, lb);
  return ddp__dataset_memory(name, &spec, nf, f, l, out, err);
}

ddp_status_t ddp_dataset_from_tensors(const ddp_tensor_t *features, const ddp_tensor_t *labels,
                                      ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(features && labels && out);
  *out = NULL;
  return from_tensors("tensors", features, labels, NULL, out, err);
}

ddp_status_t ddp_dataset_from_safetensors(const char *path, const char *feature_name,
                                          const char *label_name, ddp_dataset_t **out,
                                          ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  if (!feature_name) feature_name = "features";
  if (!label_name) label_name = "labels";
  ddp_st_file_t *f = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, err));
  ddp_status_t st;
  size_t fi, li;
  ddp_tensor_t ft, lt;
  if (ddp_st_find(f, feature_name, &fi) != DDP_OK || ddp_st_find(f, label_name, &li) != DDP_OK) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "dataset %s: the file needs tensors '%s' and '%s'", path, feature_name,
                    label_name);
    goto out;
  }
  DDP_CHECK_GOTO(ddp_st_tensor(f, fi, &ft), st, out);
  DDP_CHECK_GOTO(ddp_st_tensor(f, li, &lt), st, out);
  DDP_CHECK_GOTO(ddp__data_check_finite(&ft, path, feature_name, err), st, out);
  DDP_CHECK_GOTO(ddp__data_check_finite(&lt, path, label_name, err), st, out);
  st = from_tensors("safetensors", &ft, &lt, path, out, err);
out:
  ddp_st_close(f);
  return st;
}
