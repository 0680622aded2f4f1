/* Scaled dot-product attention as one op on the tape (ddp_attention), for GPT-2 and BERT.
 *
 * For every (batch b, head h), with q, k, v the [T, D] slices of that head:
 *
 *   S = scale * q @ k^T                        one gemm
 *   S[i, j] = lowest finite value              where key j is masked for query i
 *   P = softmax over j, max subtracted         exp and sums in double, P rounded to the dtype
 *   Pd = P * M                                 dropout (training, p > 0): M = 0 or 1/(1-p)
 *   y = Pd @ v                                 one gemm
 *
 * Key j is masked for query i when causal and j > i, or when key_mask[b, j] == 0. A row whose
 * keys are all masked has all scores equal, so its probabilities are uniform over all T keys
 * (what torch.where(mask, scores, finfo.min) followed by softmax gives). The dropout mask is
 * drawn exactly as ddp_dropout would draw it for a [B, H, T, T] tensor: one call of the
 * step's dropout counter, Philox stream (seed, DDP_RNG_DROPOUT, rank, step) from block
 * (call << 32), one uniform per element in [b, h, i, j] order.
 *
 * Saved for backward: P only ([B, H, T, T]), plus the key mask as bytes and the dropout
 * call's coordinates; the dropout mask is drawn again in backward (a few ns per element)
 * rather than stored. Backward per (b, h), with g the output's gradient:
 *
 *   gv += Pd^T @ g;   dPd = g @ v^T;   dP = dPd * M
 *   dS[i, j] = scale * P[i, j] * (dP[i, j] - sum_j' dP[i, j'] P[i, j'])   (0 where masked)
 *   gq += dS @ k;     gk += dS^T @ q
 *
 * All matrix work is gemm calls on [T, T] and [T, D] blocks through ddp_gemm. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "nn/ops_common.h"
#include "nn/ops_vexp.h"

typedef struct attn_saved {
  void *probs;   /* [B, H, T, T] softmax probabilities, before dropout */
  uint8_t *keep; /* [B, T]: 1 attend, 0 padding; NULL when there is no key mask */
  bool causal;
  double scale;
  double dropout_p; /* 0: no dropout was applied */
  uint64_t rng_seed, rng_step, dropout_call;
  uint32_t rng_rank;
} attn_saved_t;

typedef struct attn_geom {
  int64_t B, H, nt, hd; /* batch, heads, sequence length T, head size D */
} attn_geom_t;

static bool masked(const attn_saved_t *s, const attn_geom_t *g, int64_t b, int64_t i, int64_t j) {
  return (s->causal && j > i) || (s->keep && !s->keep[b * g->nt + j]);
}

/* The dropout generator positioned where this op's call starts. */
static void dropout_rng(const attn_saved_t *s, ddp_rng_t *r) {
  ddp_rng_init(r, s->rng_seed, ddp_rng_stream(DDP_RNG_DROPOUT, s->rng_rank, s->rng_step));
  ddp_rng_seek(r, s->dropout_call << 32);
}

/* Fills m (nt*nt) with the next block of the dropout mask: 1/(1-p) kept, 0 dropped, drawn as
 * ddp_dropout draws. */
static void dropout_block(ddp_dtype_t dt, ddp_rng_t *r, double p, int64_t count, void *m) {
  double keep = 1.0 - p;
  DISPATCH(dt, {
    T *mm = m;
    T scale = keep > 0 ? (T)(1.0 / keep) : 0;
    for (int64_t k = 0; k < count; k++) mm[k] = ddp_rng_uniform_f64(r) < keep ? scale : 0;
  });
}

/* One F32 row: row[j] = exp(row[j] - mx) / sum, the exponentials and their sum from
 * ddp__sum_expf (e is n floats of scratch). */
static void softmax_row_f32(float *row, int64_t n, float mx, float *e) {
  double sum = ddp__sum_expf(row, n, mx, e);
  for (int64_t j = 0; j < n; j++) row[j] = (float)((double)e[j] / sum);
}

/* Masks and softmaxes the nt x nt scores of (b, h) in place; e is nt doubles of scratch.
 * F32 takes its exponentials from ddp__vexpf (softmax_row_f32), F64 from libm. */
static void masked_softmax(ddp_dtype_t dt, const attn_saved_t *s, const attn_geom_t *g, int64_t b,
                           void *scores, double *e) {
  int64_t nt = g->nt;
  DISPATCH(dt, {
    const T lowest = dt == DDP_F32 ? (T)-FLT_MAX : (T)-DBL_MAX;
    for (int64_t i = 0; i < nt; i++) {
      T *row = (T *)scores + i * nt;
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < nt; j++) {
        if (masked(s, g, b, i, j)) row[j] = lowest;
        mx = row[j] > mx ? row[j] : mx;
      }
      if (dt == DDP_F32) {
        softmax_row_f32((float *)row, nt, (float)mx, (float *)e);
        continue;
      }
      for (int64_t j = 0; j < nt; j++) {
        e[j] = exp((double)row[j] - mx);
        sum += e[j];
      }
      for (int64_t j = 0; j < nt; j++) row[j] = (T)(e[j] / sum);
    }
  });
}

/* dP (nt x nt) becomes dS: scale * P * (dP - rowsum(dP * P)), 0 where masked. */
static void softmax_grad(ddp_dtype_t dt, const attn_saved_t *s, const attn_geom_t *g, int64_t b,
                         const void *probs, void *dp) {
  int64_t nt = g->nt;
  DISPATCH(dt, {
    const T *P = probs;
    T *d = dp;
    for (int64_t i = 0; i < nt; i++) {
      const T *pr = P + i * nt;
      T *dr = d + i * nt;
      double dot = 0;
      for (int64_t j = 0; j < nt; j++) dot += (double)dr[j] * pr[j];
      for (int64_t j = 0; j < nt; j++)
        dr[j] = masked(s, g, b, i, j) ? 0 : (T)(s->scale * pr[j] * ((double)dr[j] - dot));
    }
  });
}

/* Elementwise a *= m over count elements. */
static void mul_inplace(ddp_dtype_t dt, void *a, const void *m, int64_t count) {
  DISPATCH(dt, {
    T *aa = a;
    const T *mm = m;
    for (int64_t k = 0; k < count; k++) aa[k] *= mm[k];
  });
}

static ddp_status_t bw_attention(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *q = n->ins[0], *k = n->ins[1], *v = n->ins[2];
  const attn_saved_t *s = n->saved;
  ddp_dtype_t dt = q->value.dtype;
  const int64_t *sh = q->value.shape;
  attn_geom_t g = {sh[0], sh[1], sh[2], sh[3]};
  int64_t nt = g.nt, hd = g.hd, tt = nt * nt, td = nt * hd;
  size_t es = ddp_dtype_size(dt);
  char *gq = NULL, *gk = NULL, *gv = NULL;
  if (q->requires_grad && !(gq = ddp__grad(c, q))) return OOM(c, n->name);
  if (k->requires_grad && !(gk = ddp__grad(c, k))) return OOM(c, n->name);
  if (v->requires_grad && !(gv = ddp__grad(c, v))) return OOM(c, n->name);
  bool drop = s->dropout_p > 0;
  char *pd = NULL, *mk = NULL, *dp = ddp__arena_alloc(c, (size_t)tt * es);
  if (!dp) return OOM(c, n->name);
  ddp_rng_t rng;
  if (drop) {
    pd = ddp__arena_alloc(c, (size_t)tt * es);
    mk = ddp__arena_alloc(c, (size_t)tt * es);
    if (!pd || !mk) return OOM(c, n->name);
    dropout_rng(s, &rng);
  }
  const char *qd = q->value.data, *kd = k->value.data, *vd = v->value.data;
  const char *gy = n->out->grad.data, *probs = s->probs;
  for (int64_t bh = 0; bh < g.B * g.H; bh++) {
    int64_t b = bh / g.H;
    size_t po = (size_t)(bh * tt) * es, xo = (size_t)(bh * td) * es;
    const char *P = probs + po, *Pd = P;
    if (drop) {
      dropout_block(dt, &rng, s->dropout_p, tt, mk);
      memcpy(pd, P, (size_t)tt * es);
      mul_inplace(dt, pd, mk, tt);
      Pd = pd;
    }
    if (gv)
      DDP_CHECK(
          gemm(c, n->name, dt, true, false, nt, hd, nt, Pd, nt, gy + xo, hd, 1.0, gv + xo, hd));
    if (!gq && !gk) continue;
    DDP_CHECK(gemm(c, n->name, dt, false, true, nt, nt, hd, gy + xo, hd, vd + xo, hd, 0.0, dp, nt));
    if (drop) mul_inplace(dt, dp, mk, tt);
    softmax_grad(dt, s, &g, b, P, dp);
    if (gq)
      DDP_CHECK(
          gemm(c, n->name, dt, false, false, nt, hd, nt, dp, nt, kd + xo, hd, 1.0, gq + xo, hd));
    if (gk)
      DDP_CHECK(
          gemm(c, n->name, dt, true, false, nt, hd, nt, dp, nt, qd + xo, hd, 1.0, gk + xo, hd));
  }
  return DDP_OK;
}

static ddp_status_t check_attention(ddp_ctx_t *c, const ddp_var_t *q, const ddp_var_t *k,
                                    const ddp_var_t *v, const ddp_var_t *key_mask,
                                    double dropout_p) {
  DDP_CHECK(check_float(c, "attention", q));
  DDP_CHECK(check_float(c, "attention", k));
  DDP_CHECK(check_float(c, "attention", v));
  if (q->value.ndim != 4 || !ddp_tensor_same_shape(&q->value, &k->value) ||
      !ddp_tensor_same_shape(&q->value, &v->value) || k->value.dtype != q->value.dtype ||
      v->value.dtype != q->value.dtype) {
    char sq[128], sk[128], sv[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "attention: q %s, k %s and v %s must share one shape [B, H, T, D] "
                          "and dtype",
                          ddp_tensor_describe(&q->value, sq, sizeof sq),
                          ddp_tensor_describe(&k->value, sk, sizeof sk),
                          ddp_tensor_describe(&v->value, sv, sizeof sv));
  }
  if (key_mask) {
    const ddp_tensor_t *m = &key_mask->value;
    if ((m->dtype != DDP_I64 && m->dtype != DDP_F32 && m->dtype != DDP_F64) || m->ndim != 2 ||
        m->shape[0] != q->value.shape[0] || m->shape[1] != q->value.shape[2]) {
      char sm[128];
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "attention: key_mask %s must be I64 or F32 [B, T] = [%lld, %lld]",
                            ddp_tensor_describe(m, sm, sizeof sm), (long long)q->value.shape[0],
                            (long long)q->value.shape[2]);
    }
  }
  if (!(dropout_p >= 0 && dropout_p <= 1))
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "attention: dropout probability has to be between 0 and 1, but got %g",
                          dropout_p);
  return DDP_OK;
}

/* key_mask as bytes (nonzero = attend). */
static uint8_t *keep_bytes(ddp_ctx_t *c, const ddp_var_t *key_mask) {
  const ddp_tensor_t *m = &key_mask->value;
  uint8_t *keep = ddp__arena_alloc(c, (size_t)m->numel);
  if (!keep) return NULL;
  for (int64_t i = 0; i < m->numel; i++) {
    if (m->dtype == DDP_I64)
      keep[i] = ((const int64_t *)m->data)[i] != 0;
    else if (m->dtype == DDP_F32)
      keep[i] = ((const float *)m->data)[i] != 0;
    else
      keep[i] = ((const double *)m->data)[i] != 0;
  }
  return keep;
}

ddp_status_t ddp_attention(ddp_ctx_t *c, ddp_var_t *q, ddp_var_t *k, ddp_var_t *v,
                           ddp_var_t *key_mask, bool causal, double scale, double dropout_p,
                           bool training, ddp_var_t **y) {
  DDP_REQUIRE(c && q && k && v && y);
  const char *op = "attention";
  DDP_CHECK(check_attention(c, q, k, v, key_mask, dropout_p));
  ddp_dtype_t dt = q->value.dtype;
  const int64_t *sh = q->value.shape;
  attn_geom_t g = {sh[0], sh[1], sh[2], sh[3]};
  int64_t nt = g.nt, hd = g.hd, tt = nt * nt, td = nt * hd;
  size_t es = ddp_dtype_size(dt);
  ddp_var_t *ins[3] = {q, k, v};
  ddp_node_t *n;
  DDP_CHECK(make_out_raw(c, op, bw_attention, dt, 4, sh, 3, ins, y, &n));
  attn_saved_t *s = ddp__arena_zalloc(c, sizeof *s);
  if (!s) return OOM(c, op);
  s->causal = causal;
  s->scale = scale;
  if (key_mask && !(s->keep = keep_bytes(c, key_mask))) return OOM(c, op);
  bool drop = training && dropout_p > 0;
  if (drop) {
    s->dropout_p = dropout_p;
    s->rng_seed = c->rng_seed;
    s->rng_rank = c->rng_rank;
    s->rng_step = c->rng_step;
    s->dropout_call = c->dropout_ctr++;
  }
  /* With a node the probabilities of every head are kept; without, one head's scratch. */
  size_t pbytes = (size_t)((n ? g.B * g.H : 1) * tt) * es;
  char *probs = ddp__arena_alloc(c, pbytes), *pd = NULL;
  double *e = ddp__arena_alloc(c, (size_t)nt * sizeof(double));
  if (!probs || !e) return OOM(c, op);
  ddp_rng_t rng;
  if (drop) {
    pd = ddp__arena_alloc(c, (size_t)tt * es);
    if (!pd) return OOM(c, op);
    dropout_rng(s, &rng);
  }
  const char *qd = q->value.data, *kd = k->value.data, *vd = v->value.data;
  char *yd = (*y)->value.data;
  for (int64_t bh = 0; bh < g.B * g.H; bh++) {
    char *P = probs + (n ? (size_t)(bh * tt) * es : 0);
    const char *Pd = P;
    size_t xo = (size_t)(bh * td) * es;
    if (hd == 0) memset(P, 0, (size_t)tt * es); /* empty dot products: scores 0 */
    DDP_CHECK(gemm_scaled(c, op, dt, false, true, nt, nt, hd, scale, qd + xo, hd, kd + xo, hd, 0.0,
                          P, nt));
    masked_softmax(dt, s, &g, bh / g.H, P, e);
    if (drop) {
      dropout_block(dt, &rng, dropout_p, tt, pd);
      mul_inplace(dt, pd, P, tt);
      Pd = pd;
    }
    DDP_CHECK(gemm(c, op, dt, false, false, nt, hd, nt, Pd, nt, vd + xo, hd, 0.0, yd + xo, hd));
  }
  if (n) {
    s->probs = probs;
    n->saved = s;
  }
  return DDP_OK;
}
