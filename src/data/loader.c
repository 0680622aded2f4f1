/* Per-rank batch loader: walks the sampler's indices for the epoch (or 0..N-1) in chunks of
 * batch_size, as torch's DataLoader over a BatchSampler does, and gathers each chunk into
 * two loader-owned buffers allocated once at create. The last chunk is short unless
 * drop_last, which drops it. */
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

#define LOADER_MAGIC 0x4c4f4144u /* "LOAD" */

struct ddp_loader {
  uint32_t magic;
  const ddp_dataset_t *ds;
  ddp_sampler_t *sampler; /* NULL: sequential */
  ddp_loader_options_t opts;
  int64_t *seq;           /* sequential indices when sampler is NULL */
  const int64_t *indices; /* the epoch's indices */
  int64_t count;          /* entries in indices */
  int64_t pos;            /* next index position */
  int64_t batch_no;
  bool started;
  ddp_tensor_t features, labels; /* [batch_size, ...] owned buffers */
};

ddp_status_t ddp_loader_create(const ddp_dataset_t *ds, ddp_sampler_t *sampler,
                               const ddp_loader_options_t *in, ddp_loader_t **out,
                               ddp_error_t *err) {
  DDP_REQUIRE(ds && in && out);
  *out = NULL;
  ddp_loader_options_t o = DDP_LOADER_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, in);
  const ddp_loader_options_t *opts = &o;
  if (opts->batch_size < 1 || opts->batch_size > ((int64_t)1 << 31))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "loader: batch_size should be a positive integer value, but got "
                      "batch_size=%lld",
                      (long long)opts->batch_size);
  if (sampler && ddp_sampler_dataset_len(sampler) != ddp_dataset_length(ds))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "loader: the sampler was made for %lld samples but dataset '%s' has %lld",
                      (long long)ddp_sampler_dataset_len(sampler), ddp_dataset_name(ds),
                      (long long)ddp_dataset_length(ds));
  ddp_loader_t *l = ddp__calloc(1, sizeof *l);
  if (!l) return DDP_ERR_NO_MEMORY;
  l->magic = LOADER_MAGIC;
  l->ds = ds;
  l->sampler = sampler;
  l->opts = *opts;
  ddp_status_t st;
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  int64_t fshape[DDP_MAX_DIMS + 1], lshape[DDP_MAX_DIMS + 1];
  if (sp->feature_ndim + 1 > DDP_MAX_DIMS || sp->label_ndim + 1 > DDP_MAX_DIMS) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                    "loader: samples with %d-d features or %d-d labels leave no room for the "
                    "batch dimension (max %d)",
                    sp->feature_ndim, sp->label_ndim, DDP_MAX_DIMS);
    goto fail;
  }
  fshape[0] = lshape[0] = opts->batch_size;
  memcpy(fshape + 1, sp->feature_shape, (size_t)sp->feature_ndim * sizeof(int64_t));
  memcpy(lshape + 1, sp->label_shape, (size_t)sp->label_ndim * sizeof(int64_t));
  DDP_CHECK_GOTO(ddp_tensor_alloc(&l->features, sp->feature_dtype, sp->feature_ndim + 1, fshape),
                 st, fail);
  DDP_CHECK_GOTO(ddp_tensor_alloc(&l->labels, sp->label_dtype, sp->label_ndim + 1, lshape), st,
                 fail);
  if (!sampler) {
    int64_t n = ddp_dataset_length(ds);
    l->seq = ddp__malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!l->seq) {
      st = DDP_ERR_NO_MEMORY;
      goto fail;
    }
    for (int64_t i = 0; i < n; i++) l->seq[i] = i;
  }
  *out = l;
  return DDP_OK;
fail:
  ddp_loader_destroy(l);
  return st;
}

void ddp_loader_destroy(ddp_loader_t *l) {
  if (!l) return;
  DDP_REQUIRE(l->magic == LOADER_MAGIC);
  ddp_tensor_free(&l->features);
  ddp_tensor_free(&l->labels);
  ddp__free(l->seq);
  l->magic = 0;
  ddp__free(l);
}

#define CHECK_L(l) DDP_REQUIRE((l) && (l)->magic == LOADER_MAGIC)

ddp_status_t ddp_loader_set_epoch(ddp_loader_t *l, int64_t epoch, ddp_error_t *err) {
  CHECK_L(l);
  if (l->sampler) {
    ddp_sampler_set_epoch(l->sampler, epoch);
    DDP_CHECK(ddp_sampler_indices(l->sampler, &l->indices, &l->count));
  } else {
    l->indices = l->seq;
    l->count = ddp_dataset_length(l->ds);
  }
  l->pos = 0;
  l->batch_no = 0;
  l->started = true;
  return DDP_OK;
}

ddp_status_t ddp_loader_seek(ddp_loader_t *l, int64_t epoch, int64_t batch, ddp_error_t *err) {
  CHECK_L(l);
  int64_t cur = l->sampler ? ddp_sampler_epoch(l->sampler) : 0;
  if (!l->started || epoch != cur) DDP_CHECK(ddp_loader_set_epoch(l, epoch, err));
  if (batch < 0 || batch >= ddp_loader_num_batches(l))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "loader: batch %lld is outside epoch %lld's %lld batches", (long long)batch,
                      (long long)epoch, (long long)ddp_loader_num_batches(l));
  l->pos = batch * l->opts.batch_size;
  l->batch_no = batch;
  return DDP_OK;
}

int64_t ddp_loader_num_batches(const ddp_loader_t *l) {
  CHECK_L(l);
  int64_t n = l->sampler ? ddp_sampler_len(l->sampler) : ddp_dataset_length(l->ds);
  int64_t b = l->opts.batch_size;
  return l->opts.drop_last ? n / b : (n + b - 1) / b;
}

ddp_status_t ddp_loader_next(ddp_loader_t *l, ddp_batch_t *batch, bool *has_batch,
                             ddp_error_t *err) {
  CHECK_L(l);
  DDP_REQUIRE(batch && has_batch);
  *has_batch = false;
  if (!l->started)
    DDP_CHECK(ddp_loader_set_epoch(l, l->sampler ? ddp_sampler_epoch(l->sampler) : 0, err));
  int64_t left = l->count - l->pos;
  int64_t n = DDP_MIN(left, l->opts.batch_size);
  if (n <= 0 || (l->opts.drop_last && n < l->opts.batch_size)) {
    l->pos = l->count;
    return DDP_OK;
  }
  const int64_t *idx = l->indices + l->pos;
  DDP_CHECK(ddp_dataset_get_batch(l->ds, idx, n, &l->features, &l->labels, err));
  const ddp_sample_spec_t *sp = ddp_dataset_spec(l->ds);
  int64_t fshape[DDP_MAX_DIMS], lshape[DDP_MAX_DIMS];
  fshape[0] = lshape[0] = n;
  memcpy(fshape + 1, sp->feature_shape, (size_t)sp->feature_ndim * sizeof(int64_t));
  memcpy(lshape + 1, sp->label_shape, (size_t)sp->label_ndim * sizeof(int64_t));
  DDP_CHECK(ddp_tensor_view(&batch->features, sp->feature_dtype, sp->feature_ndim + 1, fshape,
                            l->features.data));
  DDP_CHECK(
      ddp_tensor_view(&batch->labels, sp->label_dtype, sp->label_ndim + 1, lshape, l->labels.data));
  batch->indices = idx;
  batch->size = n;
  batch->index = l->batch_no++;
  l->pos += n;
  *has_batch = true;
  return DDP_OK;
}
