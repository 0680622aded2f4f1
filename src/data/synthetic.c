/* Synthetic tasks drawn from the counter-based Philox generator (determinism contract D4).
 *
 * Keys: the task's fixed part (teacher weights, class centres) comes from the stream
 * ddp_rng_stream(DDP_RNG_DATA, 1, 0); sample i comes from ddp_rng_stream(DDP_RNG_DATA, 0, i),
 * both under the task's seed. A sample is therefore a pure function of (seed, i): it is
 * generated when asked for, nothing is stored per sample, and every rank sees the same
 * value for the same index whatever order it reads them in. */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

#define TEACHER_RANK 1u
#define SAMPLE_RANK 0u

/* Largest n: the sample index is the stream's 32-bit step field. */
#define SYNTH_MAX_N ((int64_t)1 << 32)

/* ---------------------------------------------------------------- regression ------ */

typedef struct regression {
  ddp_synth_regression_t cfg;
  float *w1, *b1, *w2, *b2; /* [hidden,in] [hidden] [out,hidden] [out] */
} regression_t;

static int64_t regression_length(void *self) { return ((regression_t *)self)->cfg.n; }

/* x ~ N(0, I) (in_dim draws), then noise (out_dim draws), in that order from the sample's
 * stream. The forward pass accumulates in double in index order and rounds once to f32. */
static ddp_status_t regression_get(void *self, int64_t i, void *feature, void *label,
                                   ddp_error_t *err) {
  regression_t *r = self;
  const ddp_synth_regression_t *c = &r->cfg;
  float *x = feature, *y = label;
  ddp_rng_t rng;
  ddp_rng_init(&rng, c->seed, ddp_rng_stream(DDP_RNG_DATA, SAMPLE_RANK, (uint64_t)i));
  for (int64_t k = 0; k < c->in_dim; k++) x[k] = ddp_rng_normal(&rng);
  for (int64_t o = 0; o < c->out_dim; o++) {
    double acc = r->b2[o];
    for (int64_t h = 0; h < c->hidden; h++) {
      double z = r->b1[h];
      for (int64_t k = 0; k < c->in_dim; k++) z += (double)r->w1[h * c->in_dim + k] * x[k];
      acc += (double)r->w2[o * c->hidden + h] * tanh(z);
    }
    y[o] = (float)acc;
  }
  for (int64_t o = 0; o < c->out_dim; o++) y[o] += c->noise_std * ddp_rng_normal(&rng);
  return DDP_OK;
}

static void regression_destroy(void *self) {
  regression_t *r = self;
  if (!r) return;
  ddp__free(r->w1);
  ddp__free(r);
}

const ddp_dataset_ops_t ddp__synth_regression_ops = {DDP_DATASET_OPS_VERSION,
                                                     "synthetic_regression", regression_length,
                                                     regression_get, regression_destroy};

static ddp_status_t check_n(int64_t n, const char *what, ddp_error_t *err) {
  if (n < 0 || n > SYNTH_MAX_N)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "%s: n = %lld outside [0, 2^32]", what,
                      (long long)n);
  return DDP_OK;
}

ddp_status_t ddp_dataset_synthetic_regression(const ddp_synth_regression_t *cfg,
                                              ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(cfg && out);
  *out = NULL;
  DDP_CHECK(check_n(cfg->n, "synthetic_regression", err));
  if (cfg->in_dim < 1 || cfg->hidden < 1 || cfg->out_dim < 1 || cfg->in_dim > (1 << 20) ||
      cfg->hidden > (1 << 20) || cfg->out_dim > (1 << 20) || !(cfg->noise_std >= 0.0f))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "synthetic_regression: in_dim %lld, hidden %lld, out_dim %lld must be in "
                      "[1, 2^20] and noise_std %g >= 0",
                      (long long)cfg->in_dim, (long long)cfg->hidden, (long long)cfg->out_dim,
                      cfg->noise_std);
  regression_t *r = ddp__calloc(1, sizeof *r);
  if (!r) return DDP_ERR_NO_MEMORY;
  r->cfg = *cfg;
  int64_t n1 = cfg->hidden * cfg->in_dim, n2 = cfg->out_dim * cfg->hidden;
  r->w1 = ddp__malloc((size_t)(n1 + cfg->hidden + n2 + cfg->out_dim) * sizeof(float));
  if (!r->w1) {
    ddp__free(r);
    return DDP_ERR_NO_MEMORY;
  }
  r->b1 = r->w1 + n1;
  r->w2 = r->b1 + cfg->hidden;
  r->b2 = r->w2 + n2;
  /* Teacher: W1, b1, W2, b2 in that order from one stream; weights scaled by
   * 1/sqrt(fan_in) so activations stay O(1). */
  ddp_rng_t rng;
  ddp_rng_init(&rng, cfg->seed, ddp_rng_stream(DDP_RNG_DATA, TEACHER_RANK, 0));
  float s1 = (float)(1.0 / sqrt((double)cfg->in_dim));
  float s2 = (float)(1.0 / sqrt((double)cfg->hidden));
  for (int64_t k = 0; k < n1; k++) r->w1[k] = s1 * ddp_rng_normal(&rng);
  for (int64_t k = 0; k < cfg->hidden; k++) r->b1[k] = ddp_rng_normal(&rng);
  for (int64_t k = 0; k < n2; k++) r->w2[k] = s2 * ddp_rng_normal(&rng);
  for (int64_t k = 0; k < cfg->out_dim; k++) r->b2[k] = ddp_rng_normal(&rng);

  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_F32;
  spec.feature_ndim = 1;
  spec.feature_shape[0] = cfg->in_dim;
  spec.label_dtype = DDP_F32;
  spec.label_ndim = 1;
  spec.label_shape[0] = cfg->out_dim;
  return ddp_dataset_create(&ddp__synth_regression_ops, r, &spec, out, err);
}

ddp_status_t ddp_dataset_teacher(const ddp_dataset_t *ds, ddp_tensor_t *w1, ddp_tensor_t *b1,
                                 ddp_tensor_t *w2, ddp_tensor_t *b2) {
  DDP_REQUIRE(ds && w1 && b1 && w2 && b2);
  if (ds->ops != &ddp__synth_regression_ops) return DDP_ERR_INVALID_ARGUMENT;
  regression_t *r = ds->self;
  const ddp_synth_regression_t *c = &r->cfg;
  int64_t s_w1[2] = {c->hidden, c->in_dim}, s_b1[1] = {c->hidden};
  int64_t s_w2[2] = {c->out_dim, c->hidden}, s_b2[1] = {c->out_dim};
  DDP_CHECK(ddp_tensor_view(w1, DDP_F32, 2, s_w1, r->w1));
  DDP_CHECK(ddp_tensor_view(b1, DDP_F32, 1, s_b1, r->b1));
  DDP_CHECK(ddp_tensor_view(w2, DDP_F32, 2, s_w2, r->w2));
  DDP_CHECK(ddp_tensor_view(b2, DDP_F32, 1, s_b2, r->b2));
  return DDP_OK;
}

/* ---------------------------------------------------------------- mixture --------- */

typedef struct mixture {
  ddp_synth_mixture_t cfg;
  float *centers; /* [num_classes, dim] */
} mixture_t;

static int64_t mixture_length(void *self) { return ((mixture_t *)self)->cfg.n; }

static ddp_status_t mixture_get(void *self, int64_t i, void *feature, void *label,
                                ddp_error_t *err) {
  mixture_t *m = self;
  const ddp_synth_mixture_t *c = &m->cfg;
  ddp_rng_t rng;
  ddp_rng_init(&rng, c->seed, ddp_rng_stream(DDP_RNG_DATA, SAMPLE_RANK, (uint64_t)i));
  int64_t cls = (int64_t)(ddp_rng_u32(&rng) % (uint32_t)c->num_classes);
  float *x = feature;
  for (int64_t k = 0; k < c->dim; k++) x[k] = m->centers[cls * c->dim + k] + ddp_rng_normal(&rng);
  *(int64_t *)label = cls;
  return DDP_OK;
}

static void mixture_destroy(void *self) {
  mixture_t *m = self;
  if (!m) return;
  ddp__free(m->centers);
  ddp__free(m);
}

const ddp_dataset_ops_t ddp__synth_mixture_ops = {DDP_DATASET_OPS_VERSION, "synthetic_mixture",
                                                  mixture_length, mixture_get, mixture_destroy};

ddp_status_t ddp_dataset_synthetic_mixture(const ddp_synth_mixture_t *cfg, ddp_dataset_t **out,
                                           ddp_error_t *err) {
  DDP_REQUIRE(cfg && out);
  *out = NULL;
  DDP_CHECK(check_n(cfg->n, "synthetic_mixture", err));
  if (cfg->dim < 1 || cfg->dim > (1 << 20) || cfg->num_classes < 1 ||
      cfg->num_classes > (1 << 20) || !(cfg->separation >= 0.0f))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "synthetic_mixture: dim %lld and num_classes %lld must be in [1, 2^20], "
                      "separation %g >= 0",
                      (long long)cfg->dim, (long long)cfg->num_classes, cfg->separation);
  mixture_t *m = ddp__calloc(1, sizeof *m);
  if (!m) return DDP_ERR_NO_MEMORY;
  m->cfg = *cfg;
  m->centers = ddp__malloc((size_t)(cfg->num_classes * cfg->dim) * sizeof(float));
  if (!m->centers) {
    ddp__free(m);
    return DDP_ERR_NO_MEMORY;
  }
  ddp_rng_t rng;
  ddp_rng_init(&rng, cfg->seed, ddp_rng_stream(DDP_RNG_DATA, TEACHER_RANK, 0));
  for (int64_t k = 0; k < cfg->num_classes * cfg->dim; k++)
    m->centers[k] = cfg->separation * ddp_rng_normal(&rng);
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_F32;
  spec.feature_ndim = 1;
  spec.feature_shape[0] = cfg->dim;
  spec.label_dtype = DDP_I64;
  spec.label_ndim = 0;
  return ddp_dataset_create(&ddp__synth_mixture_ops, m, &spec, out, err);
}

ddp_status_t ddp_dataset_centers(const ddp_dataset_t *ds, ddp_tensor_t *centers) {
  DDP_REQUIRE(ds && centers);
  if (ds->ops != &ddp__synth_mixture_ops) return DDP_ERR_INVALID_ARGUMENT;
  mixture_t *m = ds->self;
  int64_t shape[2] = {m->cfg.num_classes, m->cfg.dim};
  return ddp_tensor_view(centers, DDP_F32, 2, shape, m->centers);
}
