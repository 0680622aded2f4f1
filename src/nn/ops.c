/* Operations on the tape: forward kernels, and backward kernels that accumulate (+=) into
 * their inputs' gradients. Float kernels are written once for float and double through
 * DISPATCH, which binds T to the element type. Transcendentals are evaluated in double and
 * rounded to T. This file holds the elementwise ops, activations, softmax, dropout,
 * normalisation, embedding, reductions and losses; matrix products are in ops_matmul.c,
 * layout copies in ops_shape.c, attention in ops_attention.c, the causal-LM loss in
 * ops_lm_loss.c. */
#include <math.h>
#include <string.h>

#include "nn/ops_common.h"
#include "nn/ops_vexp.h"

/* ---------------------------------------------------------------- add, mul, bias -- */

/* b may be broadcast (fewer elements than the output): its gradient sums the output's
 * gradient over the repeated rows, in row order. */
static ddp_status_t bw_add(ddp_ctx_t *c, ddp_node_t *n) {
  for (size_t i = 0; i < 2; i++) {
    ddp_var_t *v = n->ins[i];
    if (!v->requires_grad) continue;
    void *g = ddp__grad(c, v);
    if (!g) return OOM(c, n->name);
    int64_t bn = v->value.numel, rows = bn ? n->out->value.numel / bn : 0;
    DISPATCH(v->value.dtype, {
      T *d = g;
      const T *s = n->out->grad.data;
      for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < bn; k++) d[k] += s[r * bn + k];
    });
  }
  return DDP_OK;
}

/* Whether b broadcasts against a: b's shape, without leading dims of size 1, equals the
 * trailing dims of a's shape. */
static bool add_broadcasts(const ddp_tensor_t *a, const ddp_tensor_t *b) {
  int lead = 0;
  while (lead < b->ndim && b->shape[lead] == 1) lead++;
  if (b->ndim > a->ndim || a->dtype != b->dtype) return false;
  for (int i = lead; i < b->ndim; i++)
    if (b->shape[i] != a->shape[a->ndim - b->ndim + i]) return false;
  return true;
}

ddp_status_t ddp_add(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && a && b && y);
  if (!ddp_tensor_same_shape(&a->value, &b->value) && is_float(a->value.dtype) &&
      is_float(b->value.dtype) && add_broadcasts(&a->value, &b->value)) {
    ddp_var_t *ins[2] = {a, b};
    ddp_node_t *n;
    DDP_CHECK(make_out_raw(c, "add", bw_add, a->value.dtype, a->value.ndim, a->value.shape, 2,
                           ins, y, &n));
    int64_t bn = b->value.numel, rows = bn ? a->value.numel / bn : 0;
    DISPATCH(a->value.dtype, {
      T *o = (*y)->value.data;
      const T *x0 = a->value.data, *x1 = b->value.data;
      for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < bn; k++) o[r * bn + k] = x0[r * bn + k] + x1[k];
    });
    return DDP_OK;
  }
  DDP_CHECK(check_same(c, "add", a, b));
  ddp_var_t *ins[2] = {a, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "add", bw_add, a->value.dtype, a->value.ndim, a->value.shape, 2, ins,
                         y, &n));
  DISPATCH(a->value.dtype, {
    T *o = (*y)->value.data;
    const T *x0 = a->value.data, *x1 = b->value.data;
    for (int64_t k = 0; k < a->value.numel; k++) o[k] = x0[k] + x1[k];
  });
  return DDP_OK;
}

static ddp_status_t bw_mul(ddp_ctx_t *c, ddp_node_t *n) {
  for (size_t i = 0; i < 2; i++) {
    ddp_var_t *v = n->ins[i], *other = n->ins[1 - i];
    if (!v->requires_grad) continue;
    void *g = ddp__grad(c, v);
    if (!g) return OOM(c, n->name);
    DISPATCH(v->value.dtype, {
      T *d = g;
      const T *s = n->out->grad.data, *o = other->value.data;
      for (int64_t k = 0; k < v->value.numel; k++) d[k] += s[k] * o[k];
    });
  }
  return DDP_OK;
}

ddp_status_t ddp_mul(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && a && b && y);
  DDP_CHECK(check_same(c, "mul", a, b));
  ddp_var_t *ins[2] = {a, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "mul", bw_mul, a->value.dtype, a->value.ndim, a->value.shape, 2, ins,
                         y, &n));
  DISPATCH(a->value.dtype, {
    T *o = (*y)->value.data;
    const T *x0 = a->value.data, *x1 = b->value.data;
    for (int64_t k = 0; k < a->value.numel; k++) o[k] = x0[k] * x1[k];
  });
  return DDP_OK;
}

static ddp_status_t bw_bias_add(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *b = n->ins[1];
  int64_t d = b->value.numel, rows = d ? x->value.numel / d : 0;
  if (x->requires_grad) {
    void *g = ddp__grad(c, x);
    if (!g) return OOM(c, n->name);
    DISPATCH(x->value.dtype, {
      T *gx = g;
      const T *s = n->out->grad.data;
      for (int64_t k = 0; k < x->value.numel; k++) gx[k] += s[k];
    });
  }
  if (b->requires_grad) {
    void *g = ddp__grad(c, b);
    if (!g) return OOM(c, n->name);
    DISPATCH(x->value.dtype, {
      T *gb = g;
      const T *s = n->out->grad.data;
      for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < d; j++) gb[j] += s[r * d + j];
    });
  }
  return DDP_OK;
}

ddp_status_t ddp_bias_add(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && x && b && y);
  DDP_CHECK(check_float(c, "bias_add", x));
  DDP_CHECK(check_float(c, "bias_add", b));
  if (b->value.ndim != 1 || x->value.ndim < 1 || b->value.shape[0] != last_dim(x) ||
      b->value.dtype != x->value.dtype)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "bias_add: bias of %lld elements for a last dim of %lld",
                          (long long)b->value.numel, (long long)last_dim(x));
  ddp_var_t *ins[2] = {x, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "bias_add", bw_bias_add, x->value.dtype, x->value.ndim, x->value.shape,
                         2, ins, y, &n));
  int64_t d = b->value.numel, rows = d ? x->value.numel / d : 0;
  DISPATCH(x->value.dtype, {
    T *o = (*y)->value.data;
    const T *xx = x->value.data, *bb = b->value.data;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t j = 0; j < d; j++) o[r * d + j] = xx[r * d + j] + bb[j];
  });
  return DDP_OK;
}

/* ---------------------------------------------------------------- activations ----- */

#define GELU_K0 0.7978845608028654  /* sqrt(2 / pi) */
#define GELU_K1 0.044715
#define INV_SQRT2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327

static double act_fwd(ddp_act_t a, double x) {
  switch (a) {
    case DDP_ACT_RELU: return x > 0 ? x : 0;
    case DDP_ACT_GELU: return 0.5 * x * (1.0 + erf(x * INV_SQRT2));
    case DDP_ACT_GELU_TANH: return 0.5 * x * (1.0 + tanh(GELU_K0 * (x + GELU_K1 * x * x * x)));
    case DDP_ACT_TANH: return tanh(x);
    case DDP_ACT_SIGMOID: return 1.0 / (1.0 + exp(-x));
  }
  return x;
}

/* dy/dx from the input x and the output y. */
static double act_bwd(ddp_act_t a, double x, double y) {
  switch (a) {
    case DDP_ACT_RELU: return x > 0 ? 1 : 0;
    case DDP_ACT_GELU:
      return 0.5 * (1.0 + erf(x * INV_SQRT2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x);
    case DDP_ACT_GELU_TANH: {
      double t = tanh(GELU_K0 * (x + GELU_K1 * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K0 * (1.0 + 3.0 * GELU_K1 * x * x);
    }
    case DDP_ACT_TANH: return 1.0 - y * y;
    case DDP_ACT_SIGMOID: return y * (1.0 - y);
  }
  return 1;
}

/* gelu_new in F32, the MLP activation of GPT-2 (9.4M elements per step at 124M, batch
 * 4 x 64): with s = sigmoid(2u), u = K0 (x + K1 x^3), gelu_new(x) = 0.5 x (1 + tanh(u)) =
 * x s, and its derivative 0.5 (1 + t) + 0.5 x (1 - t^2) K0 (1 + 3 K1 x^2) =
 * s + 2 x s (1 - s) K0 (1 + 3 K1 x^2), where 1 - s = e s with e = exp(-2u). Written this
 * way neither needs tanh nor subtracts nearly equal numbers (1 + t for t near -1), and the
 * loops vectorize through ddp__vexpf. Float throughout: within a few ulps of the double
 * evaluation, as close to it as PyTorch's own float evaluation of the same formula. */
DDP__VEC_KERNEL static void gelu_tanh_f32(const float *x, float *y, int64_t n) {
  const float k0 = (float)GELU_K0, k1 = (float)GELU_K1;
  for (int64_t k = 0; k < n; k++) {
    float xk = x[k], u = k0 * (xk + k1 * (xk * xk * xk));
    y[k] = xk / (1.0f + ddp__vexpf(-2.0f * u));
  }
}

DDP__VEC_KERNEL static void gelu_tanh_bwd_f32(const float *x, const float *gy, float *gx,
                                              int64_t n) {
  const float k0 = (float)GELU_K0, k1 = (float)GELU_K1, k3 = (float)(3.0 * GELU_K1);
  for (int64_t k = 0; k < n; k++) {
    float xk = x[k], x2 = xk * xk, u = k0 * (xk + k1 * (x2 * xk));
    float e = ddp__vexpf(-2.0f * u), s = 1.0f / (1.0f + e);
    float d = s + (2.0f * xk) * (s * (e * s)) * (k0 * (1.0f + k3 * x2));
    gx[k] += gy[k] * d;
  }
}

static ddp_status_t bw_act(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  ddp_act_t a = (ddp_act_t)n->i0;
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  if (a == DDP_ACT_GELU_TANH && x->value.dtype == DDP_F32) {
    gelu_tanh_bwd_f32(x->value.data, n->out->grad.data, g, x->value.numel);
    return DDP_OK;
  }
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data, *xx = x->value.data, *yy = n->out->value.data;
    if (a == DDP_ACT_RELU) {
      for (int64_t k = 0; k < x->value.numel; k++)
        if (xx[k] > 0) gx[k] += gy[k];
    } else {
      for (int64_t k = 0; k < x->value.numel; k++)
        gx[k] += (T)(gy[k] * act_bwd(a, xx[k], yy[k]));
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_activation(ddp_ctx_t *c, ddp_act_t a, ddp_var_t *x, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_REQUIRE(a >= DDP_ACT_RELU && a <= DDP_ACT_SIGMOID);
  DDP_CHECK(check_float(c, "activation", x));
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "activation", bw_act, x->value.dtype, x->value.ndim, x->value.shape, 1,
                         &x, y, &n));
  if (n) n->i0 = a;
  if (a == DDP_ACT_GELU_TANH && x->value.dtype == DDP_F32) {
    gelu_tanh_f32(x->value.data, (*y)->value.data, x->value.numel);
    return DDP_OK;
  }
  DISPATCH(x->value.dtype, {
    T *o = (*y)->value.data;
    const T *xx = x->value.data;
    if (a == DDP_ACT_RELU) {
      for (int64_t k = 0; k < x->value.numel; k++) o[k] = xx[k] > 0 ? xx[k] : 0;
    } else {
      for (int64_t k = 0; k < x->value.numel; k++) o[k] = (T)act_fwd(a, xx[k]);
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_relu(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  return ddp_activation(c, DDP_ACT_RELU, x, y);
}

/* ---------------------------------------------------------------- softmax --------- */

/* Row-wise (last dim) softmax or log-softmax with the max subtracted first. */
static void softmax_rows(ddp_dtype_t dt, const void *x, void *y, int64_t rows, int64_t d, bool log_) {
  DISPATCH(dt, {
    const T *xx = x;
    T *yy = y;
    for (int64_t r = 0; r < rows; r++) {
      const T *xr = xx + r * d;
      T *yr = yy + r * d;
      double mx = -INFINITY;
      for (int64_t j = 0; j < d; j++) mx = xr[j] > mx ? xr[j] : mx;
      double s = 0;
      for (int64_t j = 0; j < d; j++) s += exp((double)xr[j] - mx);
      if (log_) {
        double ls = log(s);
        for (int64_t j = 0; j < d; j++) yr[j] = (T)((double)xr[j] - mx - ls);
      } else {
        for (int64_t j = 0; j < d; j++) yr[j] = (T)(exp((double)xr[j] - mx) / s);
      }
    }
  });
}

static ddp_status_t bw_softmax(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  bool log_ = n->i0 != 0;
  int64_t d = last_dim(x), rows = d ? x->value.numel / d : 0;
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data, *yy = n->out->value.data;
    for (int64_t r = 0; r < rows; r++) {
      const T *gr = gy + r * d, *yr = yy + r * d;
      T *xr = gx + r * d;
      double s = 0;
      if (log_) {
        for (int64_t j = 0; j < d; j++) s += gr[j];
        for (int64_t j = 0; j < d; j++) xr[j] += (T)(gr[j] - exp((double)yr[j]) * s);
      } else {
        for (int64_t j = 0; j < d; j++) s += (double)gr[j] * yr[j];
        for (int64_t j = 0; j < d; j++) xr[j] += (T)(yr[j] * (gr[j] - s));
      }
    }
  });
  return DDP_OK;
}

static ddp_status_t softmax_op(ddp_ctx_t *c, ddp_var_t *x, bool log_, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  const char *op = log_ ? "log_softmax" : "softmax";
  DDP_CHECK(check_float(c, op, x));
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, op, bw_softmax, x->value.dtype, x->value.ndim, x->value.shape, 1, &x,
                         y, &n));
  if (n) n->i0 = log_;
  int64_t d = last_dim(x);
  softmax_rows(x->value.dtype, x->value.data, (*y)->value.data, d ? x->value.numel / d : 0, d, log_);
  return DDP_OK;
}

ddp_status_t ddp_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) { return softmax_op(c, x, false, y); }
ddp_status_t ddp_log_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) { return softmax_op(c, x, true, y); }

/* ---------------------------------------------------------------- dropout --------- */

static ddp_status_t bw_dropout(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data, *m = n->saved;
    for (int64_t k = 0; k < x->value.numel; k++) gx[k] += gy[k] * m[k];
  });
  return DDP_OK;
}

/* Each dropout call of a step owns 2^32 Philox blocks of the step's stream, starting at
 * block (call index << 32), so its mask depends only on (seed, rank, step, call index). */
ddp_status_t ddp_dropout(ddp_ctx_t *c, ddp_var_t *x, double p, bool training, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "dropout", x));
  if (!(p >= 0 && p <= 1))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "dropout probability has to be between 0 and 1, but got %g", p);
  if (!training || p == 0) {
    *y = x;
    return DDP_OK;
  }
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "dropout", bw_dropout, x->value.dtype, x->value.ndim, x->value.shape, 1,
                         &x, y, &n));
  void *mask = ddp__arena_alloc(c, (size_t)x->value.numel * ddp_dtype_size(x->value.dtype));
  if (!mask) return OOM(c, "dropout");
  ddp_rng_t r;
  ddp_rng_init(&r, c->rng_seed, ddp_rng_stream(DDP_RNG_DROPOUT, c->rng_rank, c->rng_step));
  ddp_rng_seek(&r, c->dropout_ctr++ << 32);
  double keep = 1.0 - p;
  DISPATCH(x->value.dtype, {
    T *m = mask, *o = (*y)->value.data;
    const T *xx = x->value.data;
    T scale = keep > 0 ? (T)(1.0 / keep) : 0;
    for (int64_t k = 0; k < x->value.numel; k++) {
      m[k] = ddp_rng_uniform_f64(&r) < keep ? scale : 0;
      o[k] = xx[k] * m[k];
    }
  });
  if (n) n->saved = mask;
  return DDP_OK;
}

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

DDP__VEC_KERNEL static void ln_row_bwd_f32(const float *x, const float *g, const float *w,
                                           double m, double rs, float *dx, float *dw, float *db,
                                           int64_t d) {
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
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define BN_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define BN_FMA_CLONES
#endif

/* Training statistics of x [N, C] (N > 1) into mean, invstd and q (the float sum of squared
 * deviations), each [C]; zeroed scratch s [C]. */
BN_FMA_CLONES static void bn_stats_f32(const float *x, int64_t N, int64_t C, double eps,
                                       float *s, float *mean, float *invstd, float *q) {
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
  for (int64_t j = 0; j < C; j++)
    invstd[j] = (float)(1.0 / sqrt((double)(q[j] / (float)N) + eps));
}

/* y = fma(x, alpha, beta) per channel, alpha = invstd * w, beta = fma(-mean, alpha, b). */
BN_FMA_CLONES static void bn_affine_f32(const float *x, const float *w, const float *b,
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
BN_FMA_CLONES static void bn_backward_f32(const float *x, const float *dy, const float *w,
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
  bn_affine_f32(x->value.data, w ? w->value.data : NULL, b ? b->value.data : NULL, mean, invstd,
                N, C, s, f + 4 * C, y);
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
                          "got input size [%lld, %lld]", (long long)N, (long long)C);
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

/* ---------------------------------------------------------------- embedding ------- */

static ddp_status_t bw_embedding(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *ids = n->ins[0], *w = n->ins[1];
  int64_t D = w->value.shape[1];
  void *g = ddp__grad(c, w);
  if (!g) return OOM(c, n->name);
  const int64_t *id = ids->value.data;
  DISPATCH(w->value.dtype, {
    T *gw = g;
    const T *gy = n->out->grad.data;
    for (int64_t i = 0; i < ids->value.numel; i++)
      for (int64_t j = 0; j < D; j++) gw[id[i] * D + j] += gy[i * D + j];
  });
  return DDP_OK;
}

ddp_status_t ddp_embedding(ddp_ctx_t *c, ddp_var_t *ids, ddp_var_t *w, ddp_var_t **y) {
  DDP_REQUIRE(c && ids && w && y);
  DDP_CHECK(check_float(c, "embedding", w));
  if (ids->value.dtype != DDP_I64 || w->value.ndim != 2 || ids->value.ndim >= DDP_MAX_DIMS)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "embedding: expected I64 ids and a 2D weight (got %s ids)",
                          ddp_dtype_name(ids->value.dtype));
  int64_t V = w->value.shape[0], D = w->value.shape[1];
  const int64_t *id = ids->value.data;
  for (int64_t i = 0; i < ids->value.numel; i++)
    if (id[i] < 0 || id[i] >= V)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "embedding: index out of range in self (id %lld at %lld, "
                            "num_embeddings %lld)", (long long)id[i], (long long)i, (long long)V);
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, ids->value.shape, sizeof shape);
  shape[ids->value.ndim] = D;
  ddp_var_t *ins[2] = {ids, w};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "embedding", bw_embedding, w->value.dtype, ids->value.ndim + 1,
                         shape, 2, ins, y, &n));
  size_t row = (size_t)D * ddp_dtype_size(w->value.dtype);
  for (int64_t i = 0; i < ids->value.numel; i++)
    memcpy((char *)(*y)->value.data + i * row, (const char *)w->value.data + id[i] * row, row);
  return DDP_OK;
}

/* ---------------------------------------------------------------- reductions ------ */

/* i0 = 1 for mean. */
static ddp_status_t bw_reduce(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  DISPATCH(x->value.dtype, {
    T *gx = g;
    T s = ((const T *)n->out->grad.data)[0];
    if (n->i0) s = (T)(s / (T)x->value.numel);
    for (int64_t k = 0; k < x->value.numel; k++) gx[k] += s;
  });
  return DDP_OK;
}

static ddp_status_t reduce_op(ddp_ctx_t *c, ddp_var_t *x, bool mean, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  const char *op = mean ? "mean" : "sum";
  DDP_CHECK(check_float(c, op, x));
  ddp_node_t *n;
  DDP_CHECK(make_out(c, op, bw_reduce, x->value.dtype, 0, NULL, 1, &x, y, &n));
  if (n) n->i0 = mean;
  DISPATCH(x->value.dtype, {
    const T *xx = x->value.data;
    double s = 0;
    for (int64_t k = 0; k < x->value.numel; k++) s += xx[k];
    if (mean) s /= (double)x->value.numel;
    ((T *)(*y)->value.data)[0] = (T)s;
  });
  return DDP_OK;
}

ddp_status_t ddp_sum(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) { return reduce_op(c, x, false, y); }
ddp_status_t ddp_mean(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) { return reduce_op(c, x, true, y); }

/* ---------------------------------------------------------------- losses ---------- */

static ddp_status_t bw_mse(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *a = n->ins[0], *b = n->ins[1];
  void *ga = NULL, *gb = NULL;
  if (a->requires_grad && !(ga = ddp__grad(c, a))) return OOM(c, n->name);
  if (b->requires_grad && !(gb = ddp__grad(c, b))) return OOM(c, n->name);
  DISPATCH(a->value.dtype, {
    const T *aa = a->value.data, *bb = b->value.data;
    T s = ((const T *)n->out->grad.data)[0];
    T scale = (T)(2.0 / (double)a->value.numel) * s;
    T *da = ga, *db = gb;
    for (int64_t k = 0; k < a->value.numel; k++) {
      T d = (aa[k] - bb[k]) * scale;
      if (da) da[k] += d;
      if (db) db[k] -= d;
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_mse_loss(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && a && b && y);
  DDP_CHECK(check_same(c, "mse_loss", a, b));
  ddp_var_t *ins[2] = {a, b};
  ddp_node_t *n;
  DDP_CHECK(make_out(c, "mse_loss", bw_mse, a->value.dtype, 0, NULL, 2, ins, y, &n));
  DISPATCH(a->value.dtype, {
    const T *aa = a->value.data, *bb = b->value.data;
    double s = 0;
    for (int64_t k = 0; k < a->value.numel; k++) {
      double d = (double)aa[k] - (double)bb[k];
      s += d * d;
    }
    ((T *)(*y)->value.data)[0] = (T)(s / (double)a->value.numel);
  });
  return DDP_OK;
}

/* saved = softmax probabilities [N, C]; a0 = number of counted targets. */
static ddp_status_t bw_cross_entropy(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *t = n->ins[1];
  int64_t N = x->value.shape[0], C = x->value.shape[1];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  const int64_t *tt = t->value.data;
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *p = n->saved;
    T s = (T)(((const T *)n->out->grad.data)[0] / (T)n->a0);
    for (int64_t i = 0; i < N; i++) {
      if (tt[i] == n->i0) continue;
      for (int64_t j = 0; j < C; j++) gx[i * C + j] += (p[i * C + j] - (j == tt[i] ? 1 : 0)) * s;
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_cross_entropy(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *t, int64_t ignore_index,
                               ddp_var_t **y) {
  DDP_REQUIRE(c && x && t && y);
  DDP_CHECK(check_float(c, "cross_entropy", x));
  if (x->value.ndim != 2 || t->value.dtype != DDP_I64 || t->value.ndim != 1 ||
      t->value.shape[0] != x->value.shape[0])
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "cross_entropy: expected logits [N, C] and I64 targets [N]");
  int64_t N = x->value.shape[0], C = x->value.shape[1];
  const int64_t *tt = t->value.data;
  int64_t count = 0;
  for (int64_t i = 0; i < N; i++) {
    if (tt[i] == ignore_index) continue;
    if (tt[i] < 0 || tt[i] >= C)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "cross_entropy: Target %lld is out of bounds (row %lld, %lld classes)",
                            (long long)tt[i], (long long)i, (long long)C);
    count++;
  }
  ddp_var_t *ins[2] = {x, t};
  ddp_node_t *n;
  DDP_CHECK(make_out(c, "cross_entropy", bw_cross_entropy, x->value.dtype, 0, NULL, 2, ins, y, &n));
  void *lsm = ddp__arena_alloc(c, (size_t)(N * C) * ddp_dtype_size(x->value.dtype) + 1);
  if (!lsm) return OOM(c, "cross_entropy");
  softmax_rows(x->value.dtype, x->value.data, lsm, N, C, true);
  DISPATCH(x->value.dtype, {
    T *l = lsm;
    double s = 0;
    for (int64_t i = 0; i < N; i++)
      if (tt[i] != ignore_index) s -= l[i * C + tt[i]];
    ((T *)(*y)->value.data)[0] = (T)(s / (double)count);
    /* The backward wants probabilities: exponentiate in place. */
    for (int64_t k = 0; k < N * C; k++) l[k] = (T)exp((double)l[k]);
  });
  if (n) {
    n->saved = lsm;
    n->a0 = (double)count;
    n->i0 = ignore_index;
  }
  return DDP_OK;
}
