/* Normalisation ops: layer norm (statistics in double; F32 with weight and bias vectorized
 * over four fixed lanes) and batch norm (F32 reproduces PyTorch 1.13's CPU float kernels bit
 * for bit; F64 in double). docs/nn.md's ops table states each op's arithmetic. */
#include <math.h>
#include <string.h>

#include "nn/ops_common.h"
#include "nn/ops_vexp.h"
/* ---------------------------------------------------------------- normalisation --- */

/* Shared backward of layer norm (groups = rows, over the last dim) and batch norm in
 * training (groups = channels, over the batch): with xhat = (x - mean) * rstd and
 * dxhat = gy * w, dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)). The
 * element j of group g sits at x[g * gs + j * es]. */
static void norm_backward(ddp_dtype_t dt, const void *x, const void *gy, const void *w,
                          const double *mean, const double *rstd, void *gx, void *gw, void *gb,
                          int64_t groups, int64_t len, int64_t gs, int64_t es, bool w_per_elem) {
  DISPATCH(dt, {
    const T *xx = x, *g = gy, *ww = w;
    T *dx = gx, *dw = gw, *db = gb;
    for (int64_t q = 0; q < groups; q++) {
      double s1 = 0, s2 = 0;
      for (int64_t j = 0; j < len; j++) {
        int64_t k = q * gs + j * es;
        double xh = ((double)xx[k] - mean[q]) * rstd[q];
        double wj = ww ? (double)ww[w_per_elem ? j : q] : 1.0;
        double dxh = (double)g[k] * wj;
        s1 += dxh;
        s2 += dxh * xh;
        if (dw) dw[w_per_elem ? j : q] += (T)((double)g[k] * xh);
        if (db) db[w_per_elem ? j : q] += g[k];
      }
      if (!dx) continue;
      s1 /= (double)len;
      s2 /= (double)len;
      for (int64_t j = 0; j < len; j++) {
        int64_t k = q * gs + j * es;
        double xh = ((double)xx[k] - mean[q]) * rstd[q];
        double wj = ww ? (double)ww[w_per_elem ? j : q] : 1.0;
        dx[k] += (T)(rstd[q] * ((double)g[k] * wj - s1 - xh * s2));
      }
    }
  });
}

/* Layer norm in F32 with a weight and a bias (GPT-2's 25 per step), one row of d elements
 * at a time, in loops that vectorize: the per-element arithmetic is norm_backward's and
 * the forward's, in double; the row sums (mean, variance, and backward's two) are taken
 * with four accumulators over j mod 4, then added as (a0 + a1) + (a2 + a3): a fixed order,
 * so deterministic, but not the sequential order of the generic code (a sequential sum of
 * doubles cannot vectorize, and was most of layer norm's time). */
static double sum4(const double *a) { return (a[0] + a[1]) + (a[2] + a[3]); }

DDP__VEC_KERNEL static void ln_row_f32(const float *x, const float *w, const float *b, float *o,
                                       int64_t d, double eps, double *mean, double *rstd) {
  double a[4] = {0, 0, 0, 0}, v[4] = {0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 4 <= d; j += 4)
    for (int l = 0; l < 4; l++) a[l] += x[j + l];
  for (; j < d; j++) a[0] += x[j];
  double m = sum4(a) / (double)d;
  for (j = 0; j + 4 <= d; j += 4)
    for (int l = 0; l < 4; l++) v[l] += ((double)x[j + l] - m) * ((double)x[j + l] - m);
  for (; j < d; j++) v[0] += ((double)x[j] - m) * ((double)x[j] - m);
  double rs = 1.0 / sqrt(sum4(v) / (double)d + eps);
  for (j = 0; j < d; j++) o[j] = (float)(((double)x[j] - m) * rs * (double)w[j] + (double)b[j]);
  *mean = m;
  *rstd = rs;
}

DDP__VEC_KERNEL static void ln_row_bwd_f32(const float *x, const float *g, const float *w, double m,
                                           double rs, float *dx, float *dw, float *db, int64_t d) {
  if (dw)
    for (int64_t j = 0; j < d; j++) dw[j] += (float)((double)g[j] * (((double)x[j] - m) * rs));
  if (db)
    for (int64_t j = 0; j < d; j++) db[j] += g[j];
  if (!dx) return;
  double a1[4] = {0, 0, 0, 0}, a2[4] = {0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 4 <= d; j += 4)
    for (int l = 0; l < 4; l++) {
      double dxh = (double)g[j + l] * (double)w[j + l];
      a1[l] += dxh;
      a2[l] += dxh * (((double)x[j + l] - m) * rs);
    }
  for (; j < d; j++) {
    double dxh = (double)g[j] * (double)w[j];
    a1[0] += dxh;
    a2[0] += dxh * (((double)x[j] - m) * rs);
  }
  double s1 = sum4(a1) / (double)d, s2 = sum4(a2) / (double)d;
  for (j = 0; j < d; j++)
    dx[j] += (float)(rs * ((double)g[j] * (double)w[j] - s1 - (((double)x[j] - m) * rs) * s2));
}

static ddp_status_t bw_layer_norm(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *w = n->ins[1], *b = n->ins[2];
  int64_t d = last_dim(x), rows = d ? x->value.numel / d : 0;
  void *gx = NULL, *gw = NULL, *gb = NULL;
  if (x->requires_grad && !(gx = ddp__grad(c, x))) return OOM(c, n->name);
  if (w && w->requires_grad && !(gw = ddp__grad(c, w))) return OOM(c, n->name);
  if (b && b->requires_grad && !(gb = ddp__grad(c, b))) return OOM(c, n->name);
  const double *st = n->saved;
  if (x->value.dtype == DDP_F32 && w && b) {
    const float *xx = x->value.data, *gy = n->out->grad.data;
    for (int64_t r = 0; r < rows; r++)
      ln_row_bwd_f32(xx + r * d, gy + r * d, w->value.data, st[r], st[rows + r],
                     gx ? (float *)gx + r * d : NULL, gw, gb, d);
    return DDP_OK;
  }
  norm_backward(x->value.dtype, x->value.data, n->out->grad.data, w ? w->value.data : NULL, st,
                st + rows, gx, gw, gb, rows, d, d, 1, true);
  return DDP_OK;
}

ddp_status_t ddp_layer_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b, double eps,
                            ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "layer_norm", x));
  int64_t d = last_dim(x), rows = d ? x->value.numel / d : 0;
  if (x->value.ndim < 1 || (w && (w->value.numel != d || w->value.dtype != x->value.dtype)) ||
      (b && (b->value.numel != d || b->value.dtype != x->value.dtype)))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "layer_norm: weight/bias must have %lld elements of %s", (long long)d,
                          ddp_dtype_name(x->value.dtype));
  ddp_var_t *ins[3] = {x, w, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "layer_norm", bw_layer_norm, x->value.dtype, x->value.ndim,
                         x->value.shape, 3, ins, y, &n));
  double *st = ddp__arena_alloc(c, (size_t)(2 * rows + 1) * sizeof(double));
  if (!st) return OOM(c, "layer_norm");
  if (n) n->saved = st;
  if (x->value.dtype == DDP_F32 && w && b) {
    const float *xx = x->value.data;
    float *o = (*y)->value.data;
    for (int64_t r = 0; r < rows; r++)
      ln_row_f32(xx + r * d, w->value.data, b->value.data, o + r * d, d, eps, &st[r],
                 &st[rows + r]);
    return DDP_OK;
  }
  DISPATCH(x->value.dtype, {
    const T *xx = x->value.data;
    const T *ww = w ? w->value.data : NULL, *bb = b ? b->value.data : NULL;
    T *o = (*y)->value.data;
    for (int64_t r = 0; r < rows; r++) {
      const T *xr = xx + r * d;
      double m = 0, v = 0;
      for (int64_t j = 0; j < d; j++) m += xr[j];
      m /= (double)d;
      for (int64_t j = 0; j < d; j++) v += ((double)xr[j] - m) * ((double)xr[j] - m);
      v /= (double)d;
      double rs = 1.0 / sqrt(v + eps);
      st[r] = m;
      st[rows + r] = rs;
      for (int64_t j = 0; j < d; j++) {
        double h = ((double)xr[j] - m) * rs;
        if (ww) h *= (double)ww[j];
        if (bb) h += (double)bb[j];
        o[r * d + j] = (T)h;
      }
    }
  });
  return DDP_OK;
}

/* f32 batch norm reproduces PyTorch 1.13's CPU kernels for a contiguous float [N, C] input
 * on one thread (PyTorch runs an [N, C] input through its channels-last kernels), bit for bit:
 * - statistics: s = float sum of the column in row order; mean = (float)((double)s / N);
 *   q = float sum of fma(d, d, q) with d = x - mean in float; var = q / N in float;
 *   invstd = (float)(1 / sqrt((double)var + eps));
 * - running stats (m = (float)momentum, om = 1 - m in float):
 *   mean_r = m * mean + om * mean_r in float; var_r = (float)((double)m * (q / (N - 1))
 *   + (om * var_r)) where q / (N - 1) and om * var_r round in float;
 * - output: alpha = invstd * w, beta = fma(-mean, alpha, b), y = fma(x, alpha, beta), where
 *   eval mode uses mean_r and invstd = 1 / sqrtf(var_r + (float)eps), all in float;
 * - backward: sum = float sum of dy, dotp = float sum of fma(x - mean, dy, dotp), in row
 *   order; dw += dotp * invstd; db += sum; training: k = dotp * invstd * invstd / N and
 *   dx += fma(-(x - mean), k, dy - sum / N) * invstd * w; eval: dx += dy * invstd * w, with
 *   invstd = (float)(1 / sqrt((double)var_r + eps)) (the backward's double, unlike the
 *   forward's float).
 * The fused multiply-adds are those the AVX2 build of PyTorch contracts; fmaf is exact
 * either way, and the FMA clone only makes it an instruction rather than a libm call. */

/* Training statistics of x [N, C] (N > 1) into mean, invstd and q (the float sum of squared
 * deviations), each [C]; zeroed scratch s [C]. */
DDP_FMA_CLONES static void bn_stats_f32(const float *x, int64_t N, int64_t C, double eps, float *s,
                                        float *mean, float *invstd, float *q) {
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) s[j] += x[i * C + j];
  for (int64_t j = 0; j < C; j++) {
    mean[j] = (float)((double)s[j] / (double)N);
    q[j] = 0;
  }
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) {
      float d = x[i * C + j] - mean[j];
      q[j] = fmaf(d, d, q[j]);
    }
  for (int64_t j = 0; j < C; j++) invstd[j] = (float)(1.0 / sqrt((double)(q[j] / (float)N) + eps));
}

/* y = fma(x, alpha, beta) per channel, alpha = invstd * w, beta = fma(-mean, alpha, b). */
DDP_FMA_CLONES static void bn_affine_f32(const float *x, const float *w, const float *b,
                                         const float *mean, const float *invstd, int64_t N,
                                         int64_t C, float *alpha, float *beta, float *y) {
  for (int64_t j = 0; j < C; j++) {
    alpha[j] = w ? invstd[j] * w[j] : invstd[j];
    beta[j] = fmaf(-mean[j], alpha[j], b ? b[j] : 0.0f);
  }
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) y[i * C + j] = fmaf(x[i * C + j], alpha[j], beta[j]);
}

/* Backward of f32 batch norm (see above); st holds mean [C] and invstd [C] as doubles;
 * zeroed scratch sum, dotp [C]. Gradients accumulate (+=). */
DDP_FMA_CLONES static void bn_backward_f32(const float *x, const float *dy, const float *w,
                                           const double *st, int64_t N, int64_t C, bool train,
                                           float *sum, float *dotp, float *dx, float *dw,
                                           float *db) {
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) {
      float g = dy[i * C + j];
      sum[j] += g;
      dotp[j] = fmaf(x[i * C + j] - (float)st[j], g, dotp[j]);
    }
  for (int64_t j = 0; j < C; j++) {
    if (dw) dw[j] += dotp[j] * (float)st[C + j];
    if (db) db[j] += sum[j];
  }
  if (!dx) return;
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) {
      float m = (float)st[j], is = (float)st[C + j], wj = w ? w[j] : 1.0f, g = dy[i * C + j];
      float v;
      if (train) {
        float k = dotp[j] * is * is / (float)N;
        v = fmaf(-(x[i * C + j] - m), k, g - sum[j] / (float)N) * is * wj;
      } else {
        v = g * is * wj;
      }
      dx[i * C + j] += v;
    }
}

static ddp_status_t bw_batch_norm(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *w = n->ins[1], *b = n->ins[2];
  int64_t N = x->value.shape[0], C = x->value.shape[1];
  void *gx = NULL, *gw = NULL, *gb = NULL;
  if (x->requires_grad && !(gx = ddp__grad(c, x))) return OOM(c, n->name);
  if (w && w->requires_grad && !(gw = ddp__grad(c, w))) return OOM(c, n->name);
  if (b && b->requires_grad && !(gb = ddp__grad(c, b))) return OOM(c, n->name);
  const double *st = n->saved;
  if (x->value.dtype == DDP_F32) {
    float *acc = ddp__arena_zalloc(c, (size_t)(2 * C) * sizeof(float));
    if (!acc) return OOM(c, n->name);
    bn_backward_f32(x->value.data, n->out->grad.data, w ? w->value.data : NULL, st, N, C,
                    n->i0 != 0, acc, acc + C, gx, gw, gb);
    return DDP_OK;
  }
  if (n->i0) { /* training: statistics depend on x */
    norm_backward(x->value.dtype, x->value.data, n->out->grad.data, w ? w->value.data : NULL, st,
                  st + C, gx, gw, gb, C, N, 1, C, false);
    return DDP_OK;
  }
  /* f64 eval: y = (x - rm) * rstd * w + b, an affine map of x */
  const double *xx = x->value.data, *g = n->out->grad.data, *ww = w ? w->value.data : NULL;
  double *dx = gx, *dw = gw, *db = gb;
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < C; j++) {
      int64_t k = i * C + j;
      double xh = (xx[k] - st[j]) * st[C + j];
      if (dx) dx[k] += g[k] * st[C + j] * (ww ? ww[j] : 1.0);
      if (dw) dw[j] += g[k] * xh;
      if (db) db[j] += g[k];
    }
  return DDP_OK;
}

static double tensor_get(const ddp_tensor_t *t, int64_t i) {
  return t->dtype == DDP_F32 ? ((const float *)t->data)[i] : ((const double *)t->data)[i];
}

static void tensor_set(ddp_tensor_t *t, int64_t i, double v) {
  if (t->dtype == DDP_F32)
    ((float *)t->data)[i] = (float)v;
  else
    ((double *)t->data)[i] = v;
}

/* f32 forward (arithmetic above bn_stats_f32): batch or running statistics, the running-stat
 * update (update implies use_batch), y, and in st the mean and the backward's invstd. */
static ddp_status_t bn_forward_f32(ddp_ctx_t *c, const ddp_var_t *x, const ddp_var_t *w,
                                   const ddp_var_t *b, ddp_tensor_t *rmean, ddp_tensor_t *rvar,
                                   bool use_batch, bool update, double momentum, double eps,
                                   double *st, float *y) {
  int64_t N = x->value.shape[0], C = x->value.shape[1];
  float *f = ddp__arena_zalloc(c, (size_t)(5 * C) * sizeof(float));
  if (!f) return OOM(c, "batch_norm");
  float *mean = f, *invstd = f + C, *q = f + 2 * C, *s = f + 3 * C;
  if (use_batch) bn_stats_f32(x->value.data, N, C, eps, s, mean, invstd, q);
  if (update) {
    const float m = (float)momentum, om = 1.0f - m;
    for (int64_t j = 0; j < C; j++) {
      float rm = (float)tensor_get(rmean, j), rv = (float)tensor_get(rvar, j);
      tensor_set(rmean, j, m * mean[j] + om * rm);
      tensor_set(rvar, j, (float)((double)m * (double)(q[j] / (float)(N - 1)) + (double)(om * rv)));
    }
  }
  for (int64_t j = 0; j < C; j++) {
    if (!use_batch) { /* the forward's invstd in float; the backward's through double */
      float rv = (float)tensor_get(rvar, j);
      mean[j] = (float)tensor_get(rmean, j);
      invstd[j] = 1.0f / sqrtf(rv + (float)eps);
      q[j] = (float)(1.0 / sqrt((double)rv + eps));
    }
    st[j] = mean[j];
    st[C + j] = use_batch ? invstd[j] : q[j];
  }
  bn_affine_f32(x->value.data, w ? w->value.data : NULL, b ? b->value.data : NULL, mean, invstd, N,
                C, s, f + 4 * C, y);
  return DDP_OK;
}

ddp_status_t ddp_batch_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b,
                            ddp_tensor_t *rmean, ddp_tensor_t *rvar, ddp_tensor_t *nbt,
                            bool training, double momentum, double eps, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "batch_norm", x));
  if (x->value.ndim != 2)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "batch_norm: expected 2D input [N, C] (got %dD input)", x->value.ndim);
  int64_t N = x->value.shape[0], C = x->value.shape[1];
  ddp_dtype_t dt = x->value.dtype;
  if ((w && (w->value.numel != C || w->value.dtype != dt)) ||
      (b && (b->value.numel != C || b->value.dtype != dt)) ||
      (rmean && (rmean->numel != C || !is_float(rmean->dtype))) ||
      (rvar && (rvar->numel != C || !is_float(rvar->dtype))) ||
      (nbt && (nbt->numel != 1 || nbt->dtype != DDP_I64)))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "batch_norm: weight, bias and running stats must have %lld elements",
                          (long long)C);
  bool use_batch = training || !rmean || !rvar;
  if (use_batch && N <= 1)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "batch_norm: Expected more than 1 value per channel when training, "
                          "got input size [%lld, %lld]",
                          (long long)N, (long long)C);
  ddp_var_t *ins[3] = {x, w, b};
  ddp_node_t *n;
  DDP_CHECK(make_out(c, "batch_norm", bw_batch_norm, dt, 2, x->value.shape, 3, ins, y, &n));
  double *st = ddp__arena_alloc(c, (size_t)(2 * C + 1) * sizeof(double));
  if (!st) return OOM(c, "batch_norm");
  bool update = training && rmean && rvar;
  if (dt == DDP_F32) {
    DDP_CHECK(bn_forward_f32(c, x, w, b, rmean, rvar, use_batch, update, momentum, eps, st,
                             (*y)->value.data));
  } else {
    const double *xx = x->value.data;
    for (int64_t j = 0; j < C; j++) {
      double m, v;
      if (use_batch) {
        m = 0;
        v = 0;
        for (int64_t i = 0; i < N; i++) m += xx[i * C + j];
        m /= (double)N;
        for (int64_t i = 0; i < N; i++) v += (xx[i * C + j] - m) * (xx[i * C + j] - m);
        if (update) {
          double unb = v / (double)(N - 1);
          tensor_set(rmean, j, (1.0 - momentum) * tensor_get(rmean, j) + momentum * m);
          tensor_set(rvar, j, (1.0 - momentum) * tensor_get(rvar, j) + momentum * unb);
        }
        v /= (double)N;
      } else {
        m = tensor_get(rmean, j);
        v = tensor_get(rvar, j);
      }
      st[j] = m;
      st[C + j] = 1.0 / sqrt(v + eps);
    }
    const double *ww = w ? w->value.data : NULL, *bb = b ? b->value.data : NULL;
    double *o = (*y)->value.data;
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < C; j++) {
        double h = (xx[i * C + j] - st[j]) * st[C + j];
        if (ww) h *= ww[j];
        if (bb) h += bb[j];
        o[i * C + j] = h;
      }
  }
  if (training && nbt) ((int64_t *)nbt->data)[0] += 1;
  if (n) {
    n->saved = st;
    n->i0 = use_batch;
  }
  return DDP_OK;
}
