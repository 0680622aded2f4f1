/* Operations on the tape: forward kernels, and backward kernels that accumulate (+=) into
 * their inputs' gradients. Float kernels are written once for float and double through
 * DISPATCH, which binds T to the element type. Transcendentals are evaluated in double and
 * rounded to T. This file holds the elementwise ops, activations, softmax, dropout,
 * embedding, reductions and losses; normalisation is in ops_norm.c, matrix products in
 * ops_matmul.c, layout copies in ops_shape.c, attention in ops_attention.c, the causal-LM
 * loss in ops_lm_loss.c. */
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
    DDP_CHECK(make_out_raw(c, "add", bw_add, a->value.dtype, a->value.ndim, a->value.shape, 2, ins,
                           y, &n));
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
  DDP_CHECK(
      make_out_raw(c, "add", bw_add, a->value.dtype, a->value.ndim, a->value.shape, 2, ins, y, &n));
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
  DDP_CHECK(
      make_out_raw(c, "mul", bw_mul, a->value.dtype, a->value.ndim, a->value.shape, 2, ins, y, &n));
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

#define GELU_K0 0.7978845608028654 /* sqrt(2 / pi) */
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
    case DDP_ACT_SILU: return x / (1.0 + exp(-x));
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
    case DDP_ACT_SILU: {
      double sg = 1.0 / (1.0 + exp(-x));
      return sg * (1.0 + x * (1.0 - sg));
    }
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

/* SiLU in F32, the gated MLP's activation of Llama (6.3M elements per step at 124M, batch
 * 4 x 64): silu(x) = x s with s = sigmoid(x) = 1 / (1 + e), e = exp(-x), and its derivative
 * s (1 + x (1 - s)) = s + x s (e s), as 1 - s = e s (no subtraction of nearly equal
 * numbers). libm's double exp per element was 4% of a Llama step (perf); through ddp__vexpf
 * the loops vectorize. Float throughout: within a few ulps of the double evaluation, as
 * close to it as PyTorch's own float SiLU. */
DDP__VEC_KERNEL static void silu_f32(const float *x, float *y, int64_t n) {
  for (int64_t k = 0; k < n; k++) y[k] = x[k] / (1.0f + ddp__vexpf(-x[k]));
}

DDP__VEC_KERNEL static void silu_bwd_f32(const float *x, const float *gy, float *gx, int64_t n) {
  for (int64_t k = 0; k < n; k++) {
    float xk = x[k], e = ddp__vexpf(-xk), s = 1.0f / (1.0f + e);
    gx[k] += gy[k] * (s + xk * (s * (e * s)));
  }
}

/* ReLU's backward in F32: where x > 0 the output's gradient is added, elsewhere the
 * element is stored back unchanged (bitwise what a branch would do, -0.0 included). The
 * sign of x is as good as random, so a branch mispredicts about every other element (5%
 * of the MLP's single-rank step, perf); this select vectorizes. */
DDP__VEC_KERNEL static void relu_bwd_f32(const float *x, const float *gy, float *gx, int64_t n) {
  for (int64_t k = 0; k < n; k++) gx[k] = x[k] > 0 ? gx[k] + gy[k] : gx[k];
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
  if (a == DDP_ACT_RELU && x->value.dtype == DDP_F32) {
    relu_bwd_f32(x->value.data, n->out->grad.data, g, x->value.numel);
    return DDP_OK;
  }
  if (a == DDP_ACT_SILU && x->value.dtype == DDP_F32) {
    silu_bwd_f32(x->value.data, n->out->grad.data, g, x->value.numel);
    return DDP_OK;
  }
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data, *xx = x->value.data, *yy = n->out->value.data;
    if (a == DDP_ACT_RELU) {
      for (int64_t k = 0; k < x->value.numel; k++)
        if (xx[k] > 0) gx[k] += gy[k];
    } else {
      for (int64_t k = 0; k < x->value.numel; k++) gx[k] += (T)(gy[k] * act_bwd(a, xx[k], yy[k]));
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_activation(ddp_ctx_t *c, ddp_act_t a, ddp_var_t *x, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_REQUIRE(a >= DDP_ACT_RELU && a <= DDP_ACT_SILU);
  DDP_CHECK(check_float(c, "activation", x));
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "activation", bw_act, x->value.dtype, x->value.ndim, x->value.shape, 1,
                         &x, y, &n));
  if (n) n->i0 = a;
  if (a == DDP_ACT_GELU_TANH && x->value.dtype == DDP_F32) {
    gelu_tanh_f32(x->value.data, (*y)->value.data, x->value.numel);
    return DDP_OK;
  }
  if (a == DDP_ACT_SILU && x->value.dtype == DDP_F32) {
    silu_f32(x->value.data, (*y)->value.data, x->value.numel);
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
static void softmax_rows(ddp_dtype_t dt, const void *x, void *y, int64_t rows, int64_t d,
                         bool log_) {
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
  DDP_CHECK(
      make_out_raw(c, op, bw_softmax, x->value.dtype, x->value.ndim, x->value.shape, 1, &x, y, &n));
  if (n) n->i0 = log_;
  int64_t d = last_dim(x);
  softmax_rows(x->value.dtype, x->value.data, (*y)->value.data, d ? x->value.numel / d : 0, d,
               log_);
  return DDP_OK;
}

ddp_status_t ddp_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  return softmax_op(c, x, false, y);
}
ddp_status_t ddp_log_softmax(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  return softmax_op(c, x, true, y);
}

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
                            "num_embeddings %lld)",
                            (long long)id[i], (long long)i, (long long)V);
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, ids->value.shape, sizeof shape);
  shape[ids->value.ndim] = D;
  ddp_var_t *ins[2] = {ids, w};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "embedding", bw_embedding, w->value.dtype, ids->value.ndim + 1, shape,
                         2, ins, y, &n));
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

ddp_status_t ddp_sum(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  return reduce_op(c, x, false, y);
}
ddp_status_t ddp_mean(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  return reduce_op(c, x, true, y);
}

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
