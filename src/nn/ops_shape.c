/* Layout operations on the tape: ddp_reshape (a view), and contiguous copies that move
 * elements without arithmetic: ddp_concat, ddp_permute, ddp_narrow and the attention-head
 * layouts ddp_split_heads, ddp_to_heads and ddp_merge_heads. Each backward adds the output's
 * gradient back at the positions the forward read from (+=). */
#include <string.h>

#include "nn/ops_common.h"

/* ---------------------------------------------------------------- reshape, concat - */

static ddp_status_t bw_copy_through(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data;
    for (int64_t k = 0; k < x->value.numel; k++) gx[k] += gy[k];
  });
  return DDP_OK;
}

ddp_status_t ddp_reshape(ddp_ctx_t *c, ddp_var_t *x, int ndim, const int64_t *shape,
                         ddp_var_t **y) {
  DDP_REQUIRE(c && x && y && (ndim == 0 || shape));
  if (ndim < 0 || ndim > DDP_MAX_DIMS)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "reshape: ndim %d", ndim);
  int64_t sh[DDP_MAX_DIMS];
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < ndim; i++) {
    sh[i] = shape[i];
    if (shape[i] == -1 && infer < 0) {
      infer = i;
    } else if (shape[i] < 0) {
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "reshape: invalid dim %lld",
                            (long long)shape[i]);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) sh[infer] = known ? x->value.numel / known : 0;
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) numel *= sh[i];
  if (numel != x->value.numel) {
    char s[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "reshape: shape is invalid for input %s (%lld elements requested)",
                          ddp_tensor_describe(&x->value, s, sizeof s), (long long)numel);
  }
  ddp_var_t *v = ddp__arena_zalloc(c, sizeof *v);
  if (!v) return OOM(c, "reshape");
  ddp_tensor_view(&v->value, x->value.dtype, ndim, sh, x->value.data);
  if (is_float(x->value.dtype) && ddp__needs_grad(c, 1, &x)) {
    if (!ddp__node_new(c, "reshape", bw_copy_through, v, 1, &x)) return OOM(c, "reshape");
  }
  *y = v;
  return DDP_OK;
}

/* The output is outer blocks, each the concatenation of every input's block of
 * shape[dim] * inner elements. */
static ddp_status_t bw_concat(ddp_ctx_t *c, ddp_node_t *n) {
  int dim = (int)n->i0;
  const ddp_tensor_t *yv = &n->out->value;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= yv->shape[i];
  for (int i = dim + 1; i < yv->ndim; i++) inner *= yv->shape[i];
  size_t es = ddp_dtype_size(yv->dtype);
  int64_t yrow = yv->shape[dim] * inner, off = 0;
  for (size_t k = 0; k < n->nin; k++) {
    ddp_var_t *x = n->ins[k];
    int64_t blk = x->value.shape[dim] * inner;
    if (x->requires_grad) {
      void *g = ddp__grad(c, x);
      if (!g) return OOM(c, n->name);
      DISPATCH(yv->dtype, {
        T *gx = g;
        const T *gy = n->out->grad.data;
        for (int64_t o = 0; o < outer; o++)
          for (int64_t j = 0; j < blk; j++) gx[o * blk + j] += gy[o * yrow + off + j];
      });
    }
    off += blk;
  }
  (void)es;
  return DDP_OK;
}

ddp_status_t ddp_concat(ddp_ctx_t *c, size_t nx, ddp_var_t *const *xs, int dim, ddp_var_t **y) {
  DDP_REQUIRE(c && xs && y && nx > 0);
  const ddp_tensor_t *x0 = &xs[0]->value;
  DDP_CHECK(check_float(c, "concat", xs[0]));
  if (dim < 0) dim += x0->ndim;
  if (dim < 0 || dim >= x0->ndim)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "concat: dim %d out of range for %dD", dim,
                          x0->ndim);
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, x0->shape, sizeof shape);
  shape[dim] = 0;
  for (size_t k = 0; k < nx; k++) {
    const ddp_tensor_t *t = &xs[k]->value;
    bool ok = t->dtype == x0->dtype && t->ndim == x0->ndim;
    for (int i = 0; ok && i < t->ndim; i++) ok = i == dim || t->shape[i] == x0->shape[i];
    if (!ok)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "concat: sizes of tensors must match except in dimension %d "
                            "(tensor %zu differs)",
                            dim, k);
    shape[dim] += t->shape[dim];
  }
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "concat", bw_concat, x0->dtype, x0->ndim, shape, nx, xs, y, &n));
  if (n) n->i0 = dim;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= shape[i];
  for (int i = dim + 1; i < x0->ndim; i++) inner *= shape[i];
  size_t es = ddp_dtype_size(x0->dtype);
  int64_t yrow = shape[dim] * inner, off = 0;
  for (size_t k = 0; k < nx; k++) {
    int64_t blk = xs[k]->value.shape[dim] * inner;
    for (int64_t o = 0; o < outer; o++)
      memcpy((char *)(*y)->value.data + (size_t)(o * yrow + off) * es,
             (const char *)xs[k]->value.data + (size_t)(o * blk) * es, (size_t)blk * es);
    off += blk;
  }
  return DDP_OK;
}

/* ---------------------------------------------------------------- permute --------- */

/* Walks y = x.permute(perm) in y's (row-major) order. xs[d] is x's stride along y's dim d
 * (x's stride of dim perm[d]). Forward: y[o] = x[i]; backward: gx[i] += gy[o]. */
static void permute_walk(ddp_dtype_t dt, int nd, const int64_t *yshape, const int64_t *xs,
                         int64_t numel, const void *src, void *dst, bool backward) {
  if (numel == 0) return;
  int64_t inner = nd ? yshape[nd - 1] : 1, st = nd ? xs[nd - 1] : 0;
  int64_t rows = numel / inner, idx[DDP_MAX_DIMS] = {0}, base = 0;
  DISPATCH(dt, {
    for (int64_t r = 0; r < rows; r++) {
      if (backward) {
        T *gx = dst;
        const T *gy = (const T *)src + r * inner;
        for (int64_t j = 0; j < inner; j++) gx[base + j * st] += gy[j];
      } else {
        T *y = (T *)dst + r * inner;
        const T *x = src;
        for (int64_t j = 0; j < inner; j++) y[j] = x[base + j * st];
      }
      for (int d = nd - 2; d >= 0; d--) {
        base += xs[d];
        if (++idx[d] < yshape[d]) break;
        base -= xs[d] * yshape[d];
        idx[d] = 0;
      }
    }
  });
}

/* x's strides along the output's dims, from saved = the normalised perm. */
static void permute_strides(const ddp_tensor_t *x, const int *perm, int64_t *xs) {
  int64_t stride[DDP_MAX_DIMS], s = 1;
  for (int d = x->ndim - 1; d >= 0; d--) {
    stride[d] = s;
    s *= x->shape[d];
  }
  for (int d = 0; d < x->ndim; d++) xs[d] = stride[perm[d]];
}

static ddp_status_t bw_permute(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  int64_t xs[DDP_MAX_DIMS];
  permute_strides(&x->value, n->saved, xs);
  permute_walk(x->value.dtype, x->value.ndim, n->out->value.shape, xs, x->value.numel,
               n->out->grad.data, g, true);
  return DDP_OK;
}

ddp_status_t ddp_permute(ddp_ctx_t *c, ddp_var_t *x, const int *perm, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y && (x->value.ndim == 0 || perm));
  DDP_CHECK(check_float(c, "permute", x));
  int nd = x->value.ndim, p[DDP_MAX_DIMS];
  bool seen[DDP_MAX_DIMS] = {false};
  for (int d = 0; d < nd; d++) {
    p[d] = perm[d] < 0 ? perm[d] + nd : perm[d];
    if (p[d] < 0 || p[d] >= nd || seen[p[d]]) {
      char sx[128];
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "permute: perm[%d] = %d: dims must be a permutation of 0..%d for %s "
                            "(out of range or repeated)",
                            d, perm[d], nd - 1, ddp_tensor_describe(&x->value, sx, sizeof sx));
    }
    seen[p[d]] = true;
  }
  int64_t shape[DDP_MAX_DIMS], xs[DDP_MAX_DIMS];
  for (int d = 0; d < nd; d++) shape[d] = x->value.shape[p[d]];
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "permute", bw_permute, x->value.dtype, nd, shape, 1, &x, y, &n));
  if (n) {
    int *saved = ddp__arena_alloc(c, sizeof p);
    if (!saved) return OOM(c, "permute");
    memcpy(saved, p, sizeof p);
    n->saved = saved;
  }
  permute_strides(&x->value, p, xs);
  permute_walk(x->value.dtype, nd, shape, xs, x->value.numel, x->value.data, (*y)->value.data,
               false);
  return DDP_OK;
}

/* ---------------------------------------------------------------- narrow ---------- */

/* x is outer blocks of shape[dim] * inner elements; y takes `length` rows of each block
 * from row `start`. i0 = dim, i1 = start. */
static ddp_status_t bw_narrow(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  int dim = (int)n->i0;
  int64_t outer = 1, inner = 1, size = x->value.shape[dim];
  int64_t len = n->out->value.shape[dim];
  for (int i = 0; i < dim; i++) outer *= x->value.shape[i];
  for (int i = dim + 1; i < x->value.ndim; i++) inner *= x->value.shape[i];
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *gy = n->out->grad.data;
    for (int64_t o = 0; o < outer; o++) {
      T *dst = gx + (o * size + n->i1) * inner;
      const T *src = gy + o * len * inner;
      for (int64_t k = 0; k < len * inner; k++) dst[k] += src[k];
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_narrow(ddp_ctx_t *c, ddp_var_t *x, int dim, int64_t start, int64_t length,
                        ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "narrow", x));
  int nd = x->value.ndim;
  if (dim < -nd || dim >= nd)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "narrow: dim %d out of range for a %d-D tensor", dim, nd);
  if (dim < 0) dim += nd;
  int64_t size = x->value.shape[dim];
  if (start < 0 && start >= -size) start += size;
  if (start < 0 || start > size || length < 0 || start + length > size)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "narrow: start (%lld) + length (%lld) exceeds dimension size (%lld) "
                          "of dim %d",
                          (long long)start, (long long)length, (long long)size, dim);
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, x->value.shape, sizeof shape);
  shape[dim] = length;
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "narrow", bw_narrow, x->value.dtype, nd, shape, 1, &x, y, &n));
  if (n) {
    n->i0 = dim;
    n->i1 = start;
  }
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= shape[i];
  for (int i = dim + 1; i < nd; i++) inner *= shape[i];
  size_t es = ddp_dtype_size(x->value.dtype), blk = (size_t)(length * inner) * es;
  for (int64_t o = 0; o < outer; o++)
    memcpy((char *)(*y)->value.data + o * blk,
           (const char *)x->value.data + (size_t)((o * size + start) * inner) * es, blk);
  return DDP_OK;
}

/* ---------------------------------------------------------------- heads ----------- */

/* The head layout: flat [B, T, W] holds, in columns [off, off + H*D), the heads
 * [B, H, T, D]: heads[b, h, t, :] = flat[b, t, off + h*D : off + (h+1)*D]. */
typedef struct heads_geom {
  int64_t B, T, H, D, W, off;
} heads_geom_t;

typedef enum heads_mode {
  FLAT_TO_HEADS,     /* heads = flat (to_heads, split_heads forward) */
  HEADS_TO_FLAT,     /* flat = heads (merge_heads forward) */
  ADD_HEADS_TO_FLAT, /* flat += heads (to_heads, split_heads backward) */
  ADD_FLAT_TO_HEADS  /* heads += flat (merge_heads backward) */
} heads_mode_t;

static void heads_walk(ddp_dtype_t dt, const heads_geom_t *g, void *flat, void *heads,
                       heads_mode_t mode) {
  DISPATCH(dt, {
    for (int64_t b = 0; b < g->B; b++)
      for (int64_t h = 0; h < g->H; h++)
        for (int64_t t = 0; t < g->T; t++) {
          T *f = (T *)flat + (b * g->T + t) * g->W + g->off + h * g->D;
          T *q = (T *)heads + ((b * g->H + h) * g->T + t) * g->D;
          switch (mode) {
            case FLAT_TO_HEADS: memcpy(q, f, (size_t)g->D * sizeof(T)); break;
            case HEADS_TO_FLAT: memcpy(f, q, (size_t)g->D * sizeof(T)); break;
            case ADD_HEADS_TO_FLAT:
              for (int64_t d = 0; d < g->D; d++) f[d] += q[d];
              break;
            case ADD_FLAT_TO_HEADS:
              for (int64_t d = 0; d < g->D; d++) q[d] += f[d];
              break;
          }
        }
  });
}

/* A to-heads node: x [B, T, W] -> [B, H, T, W'/H]; i0 = off, i1 = H. */
static heads_geom_t to_heads_geom(const ddp_tensor_t *x, const ddp_tensor_t *y, int64_t off) {
  heads_geom_t g = {x->shape[0], x->shape[1], y->shape[1], y->shape[3], x->shape[2], off};
  return g;
}

static ddp_status_t bw_to_heads(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  heads_geom_t geo = to_heads_geom(&x->value, &n->out->value, n->i0);
  heads_walk(x->value.dtype, &geo, g, n->out->grad.data, ADD_HEADS_TO_FLAT);
  return DDP_OK;
}

/* y [B, H, T, C/H] from columns [off, off + C) of x [B, T, W]. */
static ddp_status_t heads_from(ddp_ctx_t *c, const char *op, ddp_var_t *x, int64_t n_head,
                               int64_t off, int64_t C, ddp_var_t **y) {
  int64_t shape[4] = {x->value.shape[0], n_head, x->value.shape[1], C / n_head};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, op, bw_to_heads, x->value.dtype, 4, shape, 1, &x, y, &n));
  if (n) {
    n->i0 = off;
    n->i1 = n_head;
  }
  heads_geom_t geo = to_heads_geom(&x->value, &(*y)->value, off);
  heads_walk(x->value.dtype, &geo, x->value.data, (*y)->value.data, FLAT_TO_HEADS);
  return DDP_OK;
}

/* x must be [B, T, parts * C] with C a multiple of n_head. */
static ddp_status_t check_heads_input(ddp_ctx_t *c, const char *op, const ddp_var_t *x,
                                      int64_t n_head, int64_t parts) {
  DDP_CHECK(check_float(c, op, x));
  char sx[128];
  if (x->value.ndim != 3 || x->value.shape[2] % parts != 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "%s: expected x [B, T, %s], got %s", op,
                          parts == 3 ? "3C" : "C", ddp_tensor_describe(&x->value, sx, sizeof sx));
  int64_t C = x->value.shape[2] / parts;
  if (n_head < 1)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "%s: n_head = %lld must be at least 1", op,
                          (long long)n_head);
  if (C % n_head != 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "%s: embedding size C = %lld is not divisible by n_head = %lld (x %s)",
                          op, (long long)C, (long long)n_head,
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  return DDP_OK;
}

ddp_status_t ddp_split_heads(ddp_ctx_t *c, ddp_var_t *x, int64_t n_head, ddp_var_t **q,
                             ddp_var_t **k, ddp_var_t **v) {
  DDP_REQUIRE(c && x && q && k && v);
  DDP_CHECK(check_heads_input(c, "split_heads", x, n_head, 3));
  int64_t C = x->value.shape[2] / 3;
  ddp_var_t *out[3];
  for (int i = 0; i < 3; i++) DDP_CHECK(heads_from(c, "split_heads", x, n_head, i * C, C, &out[i]));
  *q = out[0];
  *k = out[1];
  *v = out[2];
  return DDP_OK;
}

ddp_status_t ddp_to_heads(ddp_ctx_t *c, ddp_var_t *x, int64_t n_head, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_heads_input(c, "to_heads", x, n_head, 1));
  return heads_from(c, "to_heads", x, n_head, 0, x->value.shape[2], y);
}

static ddp_status_t bw_merge_heads(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  const int64_t *s = x->value.shape;
  heads_geom_t geo = {s[0], s[2], s[1], s[3], s[1] * s[3], 0};
  heads_walk(x->value.dtype, &geo, n->out->grad.data, g, ADD_FLAT_TO_HEADS);
  return DDP_OK;
}

ddp_status_t ddp_merge_heads(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "merge_heads", x));
  if (x->value.ndim != 4) {
    char sx[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "merge_heads: expected x [B, H, T, D], got %s",
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  }
  const int64_t *s = x->value.shape;
  int64_t shape[3] = {s[0], s[2], s[1] * s[3]};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "merge_heads", bw_merge_heads, x->value.dtype, 3, shape, 1, &x, y, &n));
  heads_geom_t geo = {s[0], s[2], s[1], s[3], s[1] * s[3], 0};
  heads_walk(x->value.dtype, &geo, (*y)->value.data, x->value.data, HEADS_TO_FLAT);
  return DDP_OK;
}
