/* The operations Llama adds to GPT-2's (Transformers' modeling_llama.py and
 * modeling_rope_utils.py): RMSNorm, rotary position embeddings with their inverse
 * frequencies (the rope_scaling variants) and repeat_kv for grouped-query attention. SiLU is
 * an activation of ops.c; the gated MLP and the attention are composed in llama.c from
 * ddp_linear, ddp_activation, ddp_mul and ddp_attention. */
#include <math.h>
#include <string.h>

#include "nn/ops_common.h"

/* ---------------------------------------------------------------- RMSNorm --------- */

/* Saved per row: rstd = 1 / sqrt(mean(x^2) + eps), in double. With r = rstd and
 * xh = x r: y = w xh, dy/dx = r (g w - xh mean(g w xh)), dw += g xh. */
static ddp_status_t bw_rms_norm(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *w = n->ins[1];
  int64_t d = last_dim(x), rows = d ? x->value.numel / d : 0;
  void *gx = NULL, *gw = NULL;
  if (x->requires_grad && !(gx = ddp__grad(c, x))) return OOM(c, n->name);
  if (w && w->requires_grad && !(gw = ddp__grad(c, w))) return OOM(c, n->name);
  const double *rstd = n->saved;
  DISPATCH(x->value.dtype, {
    const T *xx = x->value.data, *g = n->out->grad.data, *ww = w ? w->value.data : NULL;
    T *dx = gx, *dw = gw;
    for (int64_t r = 0; r < rows; r++) {
      const T *xr = xx + r * d, *gr = g + r * d;
      double s = 0;
      for (int64_t j = 0; j < d; j++) {
        double xh = (double)xr[j] * rstd[r];
        s += (double)gr[j] * (ww ? (double)ww[j] : 1.0) * xh;
        if (dw) dw[j] += (T)((double)gr[j] * xh);
      }
      if (!dx) continue;
      s /= (double)d;
      for (int64_t j = 0; j < d; j++) {
        double xh = (double)xr[j] * rstd[r];
        dx[r * d + j] += (T)(rstd[r] * ((double)gr[j] * (ww ? (double)ww[j] : 1.0) - xh * s));
      }
    }
  });
  return DDP_OK;
}

ddp_status_t ddp_rms_norm(ddp_ctx_t *c, ddp_var_t *x, ddp_var_t *w, double eps, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "rms_norm", x));
  int64_t d = last_dim(x), rows = d ? x->value.numel / d : 0;
  if (x->value.ndim < 1 || (w && (w->value.numel != d || w->value.dtype != x->value.dtype)))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "rms_norm: weight must have %lld elements of %s", (long long)d,
                          ddp_dtype_name(x->value.dtype));
  if (!(eps >= 0) || !isfinite(eps))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "rms_norm: eps must be a finite non-negative number (got %g)", eps);
  ddp_var_t *ins[2] = {x, w};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "rms_norm", bw_rms_norm, x->value.dtype, x->value.ndim, x->value.shape,
                         2, ins, y, &n));
  double *rstd = ddp__arena_alloc(c, (size_t)(rows + 1) * sizeof(double));
  if (!rstd) return OOM(c, "rms_norm");
  if (n) n->saved = rstd;
  DISPATCH(x->value.dtype, {
    const T *xx = x->value.data, *ww = w ? w->value.data : NULL;
    T *o = (*y)->value.data;
    for (int64_t r = 0; r < rows; r++) {
      const T *xr = xx + r * d;
      double s = 0;
      for (int64_t j = 0; j < d; j++) s += (double)xr[j] * (double)xr[j];
      rstd[r] = 1.0 / sqrt(s / (double)d + eps);
      for (int64_t j = 0; j < d; j++)
        o[r * d + j] = (T)((double)xr[j] * rstd[r] * (ww ? (double)ww[j] : 1.0));
    }
  });
  return DDP_OK;
}

/* ---------------------------------------------------------------- rotary ---------- */

/* Transformers' _compute_default_rope_parameters and the scalings of
 * _compute_{linear_scaling,dynamic_ntk,llama3}_parameters, in double. */
void ddp_rope_inv_freq(double theta, int64_t head_dim, const ddp_rope_scaling_t *s,
                       int64_t max_position_embeddings, int64_t seq_len, float *inv_freq) {
  DDP_REQUIRE(head_dim >= 2 && head_dim % 2 == 0 && inv_freq);
  double d = (double)head_dim, base = theta;
  ddp_rope_type_t type = s ? s->type : DDP_ROPE_DEFAULT;
  if (type == DDP_ROPE_DYNAMIC && seq_len > max_position_embeddings)
    base = theta *
           pow(s->factor * (double)seq_len / (double)max_position_embeddings - (s->factor - 1.0),
               d / (d - 2.0));
  for (int64_t i = 0; i < head_dim / 2; i++) {
    double f = 1.0 / pow(base, (double)(2 * i) / d);
    if (type == DDP_ROPE_LINEAR) f /= s->factor;
    if (type == DDP_ROPE_LLAMA3) {
      double old = (double)s->original_max_position_embeddings;
      double low_wl = old / s->low_freq_factor, high_wl = old / s->high_freq_factor;
      double wl = 6.283185307179586 / f;
      if (wl > low_wl) {
        f /= s->factor;
      } else if (wl >= high_wl) { /* the middle band: smooth interpolation */
        double sm = (old / wl - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
        f = (1.0 - sm) * f / s->factor + sm * f;
      }
    }
    inv_freq[i] = (float)f;
  }
}

/* cos and sin tables [T, D/2] as floats: Transformers' float32 freqs = inv_freq * t (one
 * rounding), then cos and sin of that float, rounded to float. */
typedef struct rope_saved {
  float *cs; /* [T][h] cos, then [T][h] sin */
  int64_t nT, h;
} rope_saved_t;

static ddp_status_t bw_rotary(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  const rope_saved_t *rs = n->saved;
  void *gxv = ddp__grad(c, x);
  if (!gxv) return OOM(c, n->name);
  int64_t nT = rs->nT, h = rs->h, D = 2 * h, BH = x->value.numel / (nT * D);
  const float *cs = rs->cs, *sn = rs->cs + nT * h;
  /* y1 = x1 c - x2 s, y2 = x2 c + x1 s: dx1 = g1 c + g2 s, dx2 = g2 c - g1 s. */
  DISPATCH(x->value.dtype, {
    const T *g = n->out->grad.data;
    T *gx = gxv;
    for (int64_t b = 0; b < BH; b++)
      for (int64_t t = 0; t < nT; t++) {
        const T *gr = g + (b * nT + t) * D;
        T *dr = gx + (b * nT + t) * D;
        for (int64_t j = 0; j < h; j++) {
          T cj = (T)cs[t * h + j], sj = (T)sn[t * h + j];
          dr[j] += gr[j] * cj + gr[j + h] * sj;
          dr[j + h] += gr[j + h] * cj - gr[j] * sj;
        }
      }
  });
  return DDP_OK;
}

ddp_status_t ddp_rotary(ddp_ctx_t *c, ddp_var_t *x, const float *inv_freq, ddp_var_t **y) {
  DDP_REQUIRE(c && x && inv_freq && y);
  DDP_CHECK(check_float(c, "rotary", x));
  char sx[128];
  if (x->value.ndim != 4 || x->value.shape[3] % 2 != 0 || x->value.shape[3] == 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "rotary: x must be [B, H, T, D] with D even (got %s)",
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  int64_t nT = x->value.shape[2], D = x->value.shape[3], h = D / 2;
  int64_t BH = x->value.shape[0] * x->value.shape[1];
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "rotary", bw_rotary, x->value.dtype, 4, x->value.shape, 1, &x, y, &n));
  rope_saved_t *rs = ddp__arena_alloc(c, sizeof *rs);
  float *cs = ddp__arena_alloc(c, (size_t)(2 * nT * h + 1) * sizeof(float));
  if (!rs || !cs) return OOM(c, "rotary");
  float *sn = cs + nT * h;
  for (int64_t t = 0; t < nT; t++)
    for (int64_t j = 0; j < h; j++) {
      float f = inv_freq[j] * (float)t;
      cs[t * h + j] = (float)cos((double)f);
      sn[t * h + j] = (float)sin((double)f);
    }
  *rs = (rope_saved_t){cs, nT, h};
  if (n) n->saved = rs;
  /* Transformers: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1); each product
   * and the sum rounded in the dtype. */
  DISPATCH(x->value.dtype, {
    const T *xx = x->value.data;
    T *o = (*y)->value.data;
    for (int64_t b = 0; b < BH; b++)
      for (int64_t t = 0; t < nT; t++) {
        const T *xr = xx + (b * nT + t) * D;
        T *orow = o + (b * nT + t) * D;
        for (int64_t j = 0; j < h; j++) {
          T cj = (T)cs[t * h + j], sj = (T)sn[t * h + j];
          T a = xr[j] * cj, bb = -xr[j + h] * sj;
          T a2 = xr[j + h] * cj, b2 = xr[j] * sj;
          orow[j] = a + bb;
          orow[j + h] = a2 + b2;
        }
      }
  });
  return DDP_OK;
}

/* ---------------------------------------------------------------- repeat_kv ------- */

static ddp_status_t bw_repeat_kv(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0];
  void *gxv = ddp__grad(c, x);
  if (!gxv) return OOM(c, n->name);
  int64_t B = x->value.shape[0], KV = x->value.shape[1], rep = n->i0;
  int64_t blk = x->value.shape[2] * x->value.shape[3];
  DISPATCH(x->value.dtype, {
    const T *g = n->out->grad.data;
    T *gx = gxv;
    for (int64_t b = 0; b < B; b++)
      for (int64_t k = 0; k < KV; k++) {
        T *dst = gx + (b * KV + k) * blk;
        for (int64_t r = 0; r < rep; r++) {
          const T *src = g + ((b * KV + k) * rep + r) * blk;
          for (int64_t e = 0; e < blk; e++) dst[e] += src[e];
        }
      }
  });
  return DDP_OK;
}

ddp_status_t ddp_repeat_kv(ddp_ctx_t *c, ddp_var_t *x, int64_t n_rep, ddp_var_t **y) {
  DDP_REQUIRE(c && x && y);
  DDP_CHECK(check_float(c, "repeat_kv", x));
  char sx[128];
  if (x->value.ndim != 4 || n_rep < 1)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "repeat_kv: x must be [B, KV, T, D] and n_rep >= 1 (got %s, n_rep %lld)",
                          ddp_tensor_describe(&x->value, sx, sizeof sx), (long long)n_rep);
  if (n_rep == 1) {
    *y = x;
    return DDP_OK;
  }
  int64_t B = x->value.shape[0], KV = x->value.shape[1];
  int64_t shape[4] = {B, KV * n_rep, x->value.shape[2], x->value.shape[3]};
  size_t blk = (size_t)(shape[2] * shape[3]) * ddp_dtype_size(x->value.dtype);
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, "repeat_kv", bw_repeat_kv, x->value.dtype, 4, shape, 1, &x, y, &n));
  if (n) n->i0 = n_rep;
  const char *src = x->value.data;
  char *dst = (*y)->value.data;
  for (int64_t bk = 0; bk < B * KV; bk++)
    for (int64_t r = 0; r < n_rep; r++)
      memcpy(dst + (size_t)(bk * n_rep + r) * blk, src + (size_t)bk * blk, blk);
  return DDP_OK;
}
