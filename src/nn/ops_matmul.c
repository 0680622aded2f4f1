/* Products on the tape: ddp_linear (x @ w^T + b), ddp_matmul (2-D), ddp_conv1d (x @ w + b,
 * Transformers' Conv1D), ddp_bmm (batched over leading dims) and ddp_scale (x * s). Every
 * matrix product goes through ddp_gemm (the tensor layer owns BLAS); backward kernels
 * accumulate (+=) into the inputs' gradients. */
#include <string.h>

#include "nn/ops_common.h"

/* ---------------------------------------------------------------- linear, matmul -- */

/* The bias's gradient of linear and conv1d: gb[j] += the column sum of gy [rows, out], rows
 * in order. */
static ddp_status_t bias_grad(ddp_ctx_t *c, ddp_node_t *n, ddp_var_t *b, int64_t rows, int64_t out,
                              const void *gy) {
  void *gb = ddp__grad(c, b);
  if (!gb) return OOM(c, n->name);
  DISPATCH(b->value.dtype, {
    T *g = gb;
    const T *d = gy;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t j = 0; j < out; j++) g[j] += d[r * out + j];
  });
  return DDP_OK;
}

/* The forward of linear (w [out, in], trans_w) and conv1d (w [in, out]), x, w and b already
 * checked: y [..., out] gets the bias copied into every row, then one gemm with beta 1
 * (beta 0 without a bias). The parameters fire in reverse (bias first). */
static ddp_status_t affine_forward(ddp_ctx_t *c, const char *op, ddp__backward_fn bw, ddp_var_t *x,
                                   ddp_var_t *w, ddp_var_t *b, bool trans_w, ddp_var_t **y) {
  ddp_dtype_t dt = x->value.dtype;
  int64_t in = w->value.shape[trans_w ? 1 : 0], out = w->value.shape[trans_w ? 0 : 1];
  int64_t rows = in ? x->value.numel / in : 0;
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, x->value.shape, sizeof shape);
  shape[x->value.ndim - 1] = out;
  ddp_var_t *ins[3] = {x, w, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_as(c, op, bw, dt, x->value.ndim, shape, b ? 3 : 2, ins, b || in > 0, y, &n));
  if (n) n->fire_reverse = true;
  void *yd = (*y)->value.data;
  if (b) {
    DISPATCH(dt, {
      T *o = yd;
      const T *bb = b->value.data;
      for (int64_t r = 0; r < rows; r++) memcpy(o + r * out, bb, (size_t)out * sizeof(T));
    });
  }
  if (in == 0) return DDP_OK;
  return gemm(c, op, dt, false, trans_w, rows, out, in, x->value.data, in, w->value.data,
              trans_w ? in : out, b ? 1.0 : 0.0, yd, out);
}

static ddp_status_t bw_linear(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *w = n->ins[1], *b = n->nin > 2 ? n->ins[2] : NULL;
  ddp_dtype_t dt = x->value.dtype;
  int64_t in = w->value.shape[1], out = w->value.shape[0];
  int64_t rows = in ? x->value.numel / in : 0;
  const void *gy = n->out->grad.data;
  if (x->requires_grad) {
    void *gx = ddp__grad(c, x);
    if (!gx) return OOM(c, n->name);
    DDP_CHECK(
        gemm(c, n->name, dt, false, false, rows, in, out, gy, out, w->value.data, in, 1.0, gx, in));
  }
  if (w->requires_grad) {
    void *gw = ddp__grad(c, w);
    if (!gw) return OOM(c, n->name);
    DDP_CHECK(
        gemm(c, n->name, dt, true, false, out, in, rows, gy, out, x->value.data, in, 1.0, gw, in));
  }
  if (b && b->requires_grad) return bias_grad(c, n, b, rows, out, gy);
  return DDP_OK;
}

ddp_status_t ddp_linear(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && x && w && y);
  const char *op = "linear";
  DDP_CHECK(check_float(c, op, x));
  DDP_CHECK(check_float(c, op, w));
  ddp_dtype_t dt = x->value.dtype;
  if (w->value.ndim != 2 || w->value.dtype != dt || x->value.ndim < 1 ||
      last_dim(x) != w->value.shape[1] ||
      (b &&
       (b->value.dtype != dt || b->value.ndim != 1 || b->value.shape[0] != w->value.shape[0]))) {
    char sx[128], sw[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "linear: mat1 and mat2 shapes cannot be multiplied: x %s, weight %s%s",
                          ddp_tensor_describe(&x->value, sx, sizeof sx),
                          ddp_tensor_describe(&w->value, sw, sizeof sw),
                          b ? " (or the bias does not match the weight)" : "");
  }
  return affine_forward(c, op, bw_linear, x, w, b, true, y);
}

static ddp_status_t bw_matmul(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *a = n->ins[0], *b = n->ins[1];
  ddp_dtype_t dt = a->value.dtype;
  int64_t m = a->value.shape[0], k = a->value.shape[1], nn = b->value.shape[1];
  const void *gy = n->out->grad.data;
  if (a->requires_grad) {
    void *ga = ddp__grad(c, a);
    if (!ga) return OOM(c, n->name);
    DDP_CHECK(gemm(c, n->name, dt, false, true, m, k, nn, gy, nn, b->value.data, nn, 1.0, ga, k));
  }
  if (b->requires_grad) {
    void *gb = ddp__grad(c, b);
    if (!gb) return OOM(c, n->name);
    DDP_CHECK(gemm(c, n->name, dt, true, false, k, nn, m, a->value.data, k, gy, nn, 1.0, gb, nn));
  }
  return DDP_OK;
}

ddp_status_t ddp_matmul(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && a && b && y);
  DDP_CHECK(check_float(c, "matmul", a));
  DDP_CHECK(check_float(c, "matmul", b));
  if (a->value.ndim != 2 || b->value.ndim != 2 || a->value.dtype != b->value.dtype ||
      a->value.shape[1] != b->value.shape[0]) {
    char sa[128], sb[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "matmul: shapes cannot be multiplied: %s @ %s",
                          ddp_tensor_describe(&a->value, sa, sizeof sa),
                          ddp_tensor_describe(&b->value, sb, sizeof sb));
  }
  int64_t shape[2] = {a->value.shape[0], b->value.shape[1]};
  ddp_var_t *ins[2] = {a, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_as(c, "matmul", bw_matmul, a->value.dtype, 2, shape, 2, ins,
                        a->value.shape[1] > 0, y, &n));
  if (a->value.shape[1] == 0) return DDP_OK;
  return gemm(c, "matmul", a->value.dtype, false, false, shape[0], shape[1], a->value.shape[1],
              a->value.data, a->value.shape[1], b->value.data, shape[1], 0.0, (*y)->value.data,
              shape[1]);
}

/* ---------------------------------------------------------------- conv1d ---------- */

/* As bw_linear, with w [in, out]. */
static ddp_status_t bw_conv1d(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *w = n->ins[1], *b = n->nin > 2 ? n->ins[2] : NULL;
  ddp_dtype_t dt = x->value.dtype;
  int64_t in = w->value.shape[0], out = w->value.shape[1];
  int64_t rows = in ? x->value.numel / in : 0;
  const void *gy = n->out->grad.data;
  if (x->requires_grad) {
    void *gx = ddp__grad(c, x);
    if (!gx) return OOM(c, n->name);
    DDP_CHECK(
        gemm(c, n->name, dt, false, true, rows, in, out, gy, out, w->value.data, out, 1.0, gx, in));
  }
  if (w->requires_grad) {
    void *gw = ddp__grad(c, w);
    if (!gw) return OOM(c, n->name);
    DDP_CHECK(
        gemm(c, n->name, dt, true, false, in, out, rows, x->value.data, in, gy, out, 1.0, gw, out));
  }
  if (b && b->requires_grad) return bias_grad(c, n, b, rows, out, gy);
  return DDP_OK;
}

/* Like ddp_linear: the bias is copied into the output, then one gemm with beta 1 (PyTorch's
 * addmm, which Conv1D calls). The parameters fire bias first, then weight: addmm's edges are
 * (bias, x, weight), and PyTorch's engine reaches the AccumulateGrad nodes in that order. */
ddp_status_t ddp_conv1d(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, ddp_var_t *b, ddp_var_t **y) {
  DDP_REQUIRE(c && x && w && y);
  const char *op = "conv1d";
  DDP_CHECK(check_float(c, op, x));
  DDP_CHECK(check_float(c, op, w));
  ddp_dtype_t dt = x->value.dtype;
  if (w->value.ndim != 2 || w->value.dtype != dt || x->value.ndim < 1 ||
      last_dim(x) != w->value.shape[0] ||
      (b &&
       (b->value.dtype != dt || b->value.ndim != 1 || b->value.shape[0] != w->value.shape[1]))) {
    char sx[128], sw[128], sb[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "conv1d: x %s, weight %s [in, out] and bias %s do not match",
                          ddp_tensor_describe(&x->value, sx, sizeof sx),
                          ddp_tensor_describe(&w->value, sw, sizeof sw),
                          b ? ddp_tensor_describe(&b->value, sb, sizeof sb) : "(none)");
  }
  return affine_forward(c, op, bw_conv1d, x, w, b, false, y);
}

/* ---------------------------------------------------------------- bmm ------------- */

/* Batch i of a is a + i*m*k, of b is b + i*k*n, of y is y + i*m*n (elements); i0 = trans_b.
 * Per batch: ga += gy @ op(b)^T and gb += a^T @ gy (gy^T @ a when b is transposed). */
static ddp_status_t bw_bmm(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *a = n->ins[0], *b = n->ins[1];
  ddp_dtype_t dt = a->value.dtype;
  bool tb = n->i0 != 0;
  int nd = a->value.ndim;
  int64_t m = a->value.shape[nd - 2], k = a->value.shape[nd - 1];
  int64_t nn = n->out->value.shape[nd - 1];
  int64_t batch = m * k != 0 ? a->value.numel / (m * k) : 0;
  size_t es = ddp_dtype_size(dt);
  const char *gy = n->out->grad.data;
  char *ga = NULL, *gb = NULL;
  if (a->requires_grad && !(ga = ddp__grad(c, a))) return OOM(c, n->name);
  if (b->requires_grad && !(gb = ddp__grad(c, b))) return OOM(c, n->name);
  const char *av = a->value.data, *bv = b->value.data;
  for (int64_t i = 0; i < batch; i++) {
    const char *gyi = gy + (size_t)(i * m * nn) * es;
    size_t ao = (size_t)(i * m * k) * es, bo = (size_t)(i * k * nn) * es;
    if (ga)
      DDP_CHECK(gemm(c, n->name, dt, false, !tb, m, k, nn, gyi, nn, bv + bo, tb ? k : nn, 1.0,
                     ga + ao, k));
    if (gb && !tb)
      DDP_CHECK(gemm(c, n->name, dt, true, false, k, nn, m, av + ao, k, gyi, nn, 1.0, gb + bo, nn));
    if (gb && tb)
      DDP_CHECK(gemm(c, n->name, dt, true, false, nn, k, m, gyi, nn, av + ao, k, 1.0, gb + bo, k));
  }
  return DDP_OK;
}

ddp_status_t ddp_bmm(ddp_ctx_t *c, ddp_var_t *a, ddp_var_t *b, bool trans_b, ddp_var_t **y) {
  DDP_REQUIRE(c && a && b && y);
  DDP_CHECK(check_float(c, "bmm", a));
  DDP_CHECK(check_float(c, "bmm", b));
  const ddp_tensor_t *av = &a->value, *bv = &b->value;
  int nd = av->ndim;
  bool ok = nd >= 2 && bv->ndim == nd && av->dtype == bv->dtype;
  for (int i = 0; ok && i < nd - 2; i++) ok = av->shape[i] == bv->shape[i];
  if (ok) ok = av->shape[nd - 1] == bv->shape[trans_b ? nd - 1 : nd - 2];
  if (!ok) {
    char sa[128], sb[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "bmm: shapes cannot be multiplied: %s @ %s%s (leading dims must be "
                          "equal)",
                          ddp_tensor_describe(av, sa, sizeof sa),
                          ddp_tensor_describe(bv, sb, sizeof sb), trans_b ? "^T" : "");
  }
  int64_t m = av->shape[nd - 2], k = av->shape[nd - 1];
  int64_t nn = bv->shape[trans_b ? nd - 2 : nd - 1];
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, av->shape, sizeof shape);
  shape[nd - 1] = nn;
  ddp_var_t *ins[2] = {a, b};
  ddp_node_t *n;
  DDP_CHECK(make_out_as(c, "bmm", bw_bmm, av->dtype, nd, shape, 2, ins, k > 0, y, &n));
  if (n) n->i0 = trans_b;
  int64_t batch = 1;
  for (int i = 0; i < nd - 2; i++) batch *= av->shape[i];
  size_t es = ddp_dtype_size(av->dtype);
  const char *ad = av->data, *bd = bv->data;
  char *yd = (*y)->value.data;
  if (k == 0) return DDP_OK; /* the zero-filled output is the empty sum */
  for (int64_t i = 0; i < batch; i++)
    DDP_CHECK(gemm(c, "bmm", av->dtype, false, trans_b, m, nn, k, ad + (size_t)(i * m * k) * es, k,
                   bd + (size_t)(i * k * nn) * es, trans_b ? k : nn, 0.0,
                   yd + (size_t)(i * m * nn) * es, nn));
  return DDP_OK;
}

/* ---------------------------------------------------------------- scale ----------- */

/* a0 = s. */
static ddp_status_t bw_scale(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  DISPATCH(x->value.dtype, {
    T *gx = g, s = (T)n->a0;
    const T *gy = n->out->grad.data;
    for (int64_t k = 0; k < x->value.numel; k++) gx[k] += gy[k] * s;
  });
  return DDP_OK;
}

/* s is rounded to the dtype first, as PyTorch does with a Python scalar. */
ddp_status_t ddp_scale(ddp_ctx_t *c, ddp_var_t *x, double s, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "scale", x));
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "scale", bw_scale, x->value.dtype, x->value.ndim, x->value.shape, 1, &x,
                         y, &n));
  if (n) n->a0 = s;
  DISPATCH(x->value.dtype, {
    T *o = (*y)->value.data, ts = (T)s;
    const T *xx = x->value.data;
    for (int64_t k = 0; k < x->value.numel; k++) o[k] = xx[k] * ts;
  });
  return DDP_OK;
}
