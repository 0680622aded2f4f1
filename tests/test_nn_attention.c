/* The transformer operations of the nn layer (ddp_conv1d, ddp_bmm, ddp_permute, ddp_narrow,
 * ddp_scale, broadcasting ddp_add, ddp_split_heads, ddp_to_heads, ddp_merge_heads,
 * ddp_attention, ddp_causal_lm_loss): every input gradient against central finite
 * differences in f64; attention's masking, dropout (determinism, the same draws as
 * ddp_dropout, forward and backward using one mask) and its equality with the same
 * computation composed of separate ops; the causal-LM loss against ddp_cross_entropy on
 * shifted rows; error cases; forward and gradients against PyTorch 1.13 in f64 and f32
 * (tools/torch/nn_oracle.py, skipped without torch); and the time of attention at GPT-2 124M's
 * shape (printed, with a loose bound). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "opcheck.h"
#include "parity.h"

#define F(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, true }
#define FC(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, false }
#define PAD(b, t) \
  { 2, {b, t}, DDP_TEST_IN_PAD, 0, false }
#define DMASK(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_MASK, 0, false }

#define INV_SQRT3 0.57735026918962576451

/* ---------------------------------------------------------------- finite differences */

static ddp_status_t b_conv1d(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_conv1d(c, in[0], in[1], in[2], o);
}
static ddp_status_t b_conv1d_nb(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_conv1d(c, in[0], in[1], NULL, o);
}
static ddp_status_t b_bmm(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_bmm(c, in[0], in[1], false, o);
}
static ddp_status_t b_bmm_t(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_bmm(c, in[0], in[1], true, o);
}
static ddp_status_t b_permute(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  const int perm[3] = {2, 0, 1};
  return ddp_permute(c, in[0], perm, o);
}
static ddp_status_t b_permute4(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  const int perm[4] = {0, 2, -3, 3};
  return ddp_permute(c, in[0], perm, o);
}
static ddp_status_t b_narrow(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_narrow(c, in[0], 1, 1, 3, o);
}
static ddp_status_t b_narrow_neg(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_narrow(c, in[0], -1, -3, 2, o);
}
static ddp_status_t b_scale(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_scale(c, in[0], 0.37, o);
}
static ddp_status_t b_add(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_add(c, in[0], in[1], o);
}
/* q, k, v stacked along dim 0, so that one loss weighs all three. */
static ddp_status_t b_split(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  ddp_var_t *qkv[3];
  ddp_status_t st = ddp_split_heads(c, in[0], 2, &qkv[0], &qkv[1], &qkv[2]);
  if (st) return st;
  return ddp_concat(c, 3, qkv, 0, o);
}
static ddp_status_t b_to_heads(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_to_heads(c, in[0], 3, o);
}
static ddp_status_t b_merge(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_merge_heads(c, in[0], o);
}
static ddp_status_t b_attn(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[1], in[2], NULL, false, INV_SQRT3, 0, true, o);
}
static ddp_status_t b_attn_causal(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[1], in[2], NULL, true, INV_SQRT3, 0, true, o);
}
static ddp_status_t b_attn_pad(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[1], in[2], in[3], false, INV_SQRT3, 0, true, o);
}
static ddp_status_t b_attn_both(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[1], in[2], in[3], true, INV_SQRT3, 0, true, o);
}
static ddp_status_t b_attn_drop(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[1], in[2], in[3], true, INV_SQRT3, 0.3, true, o);
}
/* The same tensor as q, k and v (self-attention on one input): gradients add up. */
static ddp_status_t b_attn_self(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_attention(c, in[0], in[0], in[0], NULL, true, 0.5, 0, true, o);
}
static ddp_status_t b_lm(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_causal_lm_loss(c, in[0], in[1], -100, o);
}

/* Attention inputs [B=3, H=2, T=4, D=3]; the padding mask pads the last two keys of batch 1
 * and the first two of batch 2 (with causal: queries 0 and 1 of batch 2 see no key). */
#define QKV F(4, 3, 2, 4, 3), F(4, 3, 2, 4, 3), F(4, 3, 2, 4, 3)

static const ddp_test_gcase_t gcases[] = {
    {"conv1d", 3, {F(3, 2, 3, 5), F(2, 5, 4), F(1, 4)}, b_conv1d},
    {"conv1d_nobias", 2, {F(2, 3, 5), F(2, 5, 4)}, b_conv1d_nb},
    {"bmm", 2, {F(4, 2, 3, 4, 5), F(4, 2, 3, 5, 2)}, b_bmm},
    {"bmm_trans_b", 2, {F(3, 3, 4, 5), F(3, 3, 2, 5)}, b_bmm_t},
    {"bmm_2d", 2, {F(2, 4, 5), F(2, 5, 3)}, b_bmm},
    {"permute", 1, {F(3, 2, 3, 4)}, b_permute},
    {"permute_4d", 1, {F(4, 2, 3, 2, 4)}, b_permute4},
    {"narrow", 1, {F(3, 3, 5, 2)}, b_narrow},
    {"narrow_negative", 1, {F(3, 3, 2, 5)}, b_narrow_neg},
    {"scale", 1, {F(2, 3, 4)}, b_scale},
    {"add_broadcast", 2, {F(3, 2, 3, 4), F(2, 3, 4)}, b_add},
    {"add_broadcast_leading_1", 2, {F(3, 2, 3, 4), F(2, 1, 4)}, b_add},
    {"split_heads", 1, {F(3, 2, 3, 12)}, b_split},
    {"to_heads", 1, {F(3, 2, 3, 6)}, b_to_heads},
    {"merge_heads", 1, {F(4, 2, 3, 4, 2)}, b_merge},
    {"attention", 3, {QKV}, b_attn},
    {"attention_causal", 3, {QKV}, b_attn_causal},
    {"attention_padding", 4, {QKV, PAD(3, 4)}, b_attn_pad},
    {"attention_causal_padding", 4, {QKV, PAD(3, 4)}, b_attn_both},
    {"attention_dropout", 4, {QKV, PAD(3, 4)}, b_attn_drop},
    {"attention_self", 1, {F(4, 2, 2, 5, 4)}, b_attn_self},
    {"causal_lm_loss", 2, {F(3, 2, 4, 5), {2, {2, 4}, DDP_TEST_IN_TARGETS, 5, false}}, b_lm},
};

/* Every new op's input gradients match central differences: max|a - n| / max|n| < 1e-6.
 * The dropout case passes only if backward applies the mask forward drew. */
static void test_gradcheck(void **state) {
  (void)state;
  double worst = ddp_test_gradcheck(gcases, sizeof gcases / sizeof gcases[0], 1e-6);
  print_message("finite differences, %zu cases: max rel err %.3g\n",
                sizeof gcases / sizeof gcases[0], worst);
}

/* ---------------------------------------------------------------- helpers --------- */

/* ddp_test_rand_var under a short name (the cases below hold several on a line). */
static ddp_var_t *rand_var(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                           uint64_t seed, bool rg) {
  return ddp_test_rand_var(c, dt, ndim, shape, seed, rg);
}

static double at(const ddp_tensor_t *t, int64_t k) {
  return t->dtype == DDP_F32 ? ((const float *)t->data)[k] : ((const double *)t->data)[k];
}

/* Fails unless max|a - b| / max(max|b|, 1e-12) <= tol, printing the worst pair. */
static void expect_close(const char *what, const ddp_tensor_t *a, const ddp_tensor_t *b,
                         double tol) {
  assert_int_equal(a->numel, b->numel);
  double md = 0, mr = 0, wa = 0, wb = 0;
  for (int64_t k = 0; k < a->numel; k++) {
    double d = fabs(at(a, k) - at(b, k));
    if (d > md || isnan(d)) {
      md = isnan(d) ? INFINITY : d;
      wa = at(a, k);
      wb = at(b, k);
    }
    mr = fmax(mr, fabs(at(b, k)));
  }
  if (!(md / fmax(mr, 1e-12) <= tol))
    fail_msg("%s: rel err %.3g > %.3g (worst: %.17g vs %.17g)", what, md / fmax(mr, 1e-12), tol, wa,
             wb);
}

static void expect_bits(const char *what, const ddp_tensor_t *a, const ddp_tensor_t *b) {
  assert_int_equal(a->numel, b->numel);
  size_t n = ddp_tensor_nbytes(a);
  if (memcmp(a->data, b->data, n) != 0) {
    int64_t k = 0;
    while (k < a->numel && at(a, k) == at(b, k)) k++;
    fail_msg("%s: not bitwise equal (element %lld: %.17g vs %.17g)", what, (long long)k,
             k < a->numel ? at(a, k) : 0.0, k < a->numel ? at(b, k) : 0.0);
  }
}

/* A malloc'd copy of a tensor's data, as a tensor. */
static ddp_tensor_t keep(const ddp_tensor_t *t) {
  ddp_tensor_t k;
  assert_int_equal(ddp_tensor_alloc(&k, t->dtype, t->ndim, t->shape), DDP_OK);
  memcpy(k.data, t->data, ddp_tensor_nbytes(t));
  return k;
}

/* Seeds backward with the sum of y * w for a fixed random w (an arbitrary output gradient). */
static void backward_weighted(ddp_ctx_t *c, ddp_var_t *y) {
  ddp_var_t *w, *p, *l;
  w = rand_var(c, y->value.dtype, y->value.ndim, y->value.shape, 77, false);
  assert_int_equal(ddp_mul(c, y, w, &p), DDP_OK);
  assert_int_equal(ddp_sum(c, p, &l), DDP_OK);
  assert_int_equal(ddp_backward(c, l), DDP_OK);
}

/* ---------------------------------------------------------------- attention ------- */

typedef struct attn_run {
  ddp_tensor_t y, gq, gk, gv;
} attn_run_t;

static void attn_run_free(attn_run_t *r) {
  ddp_tensor_free(&r->y);
  ddp_tensor_free(&r->gq);
  ddp_tensor_free(&r->gk);
  ddp_tensor_free(&r->gv);
}

/* One forward + backward of attention ([2, 3, 5, 4] inputs) either fused (ddp_attention) or
 * composed of ddp_bmm, ddp_scale, ddp_softmax, ddp_dropout and ddp_bmm, from the dropout
 * state (seed 11, rank 0, step) with `before` dropout calls made first. */
static attn_run_t attn_once(ddp_ctx_t *c, ddp_dtype_t dt, bool fused, double p, bool training,
                            uint64_t step, int before) {
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 11, 0, step);
  int64_t sh[4] = {2, 3, 5, 4};
  ddp_var_t *q = rand_var(c, dt, 4, sh, 1, true), *k = rand_var(c, dt, 4, sh, 2, true);
  ddp_var_t *v = rand_var(c, dt, 4, sh, 3, true), *y, *t;
  for (int i = 0; i < before; i++) assert_int_equal(ddp_dropout(c, v, 0.5, true, &t), DDP_OK);
  if (fused) {
    assert_int_equal(ddp_attention(c, q, k, v, NULL, false, 0.5, p, training, &y), DDP_OK);
  } else {
    ddp_var_t *s, *ss, *pr, *pd;
    assert_int_equal(ddp_bmm(c, q, k, true, &s), DDP_OK);
    assert_int_equal(ddp_scale(c, s, 0.5, &ss), DDP_OK);
    assert_int_equal(ddp_softmax(c, ss, &pr), DDP_OK);
    assert_int_equal(ddp_dropout(c, pr, p, training, &pd), DDP_OK);
    assert_int_equal(ddp_bmm(c, pd, v, false, &y), DDP_OK);
  }
  backward_weighted(c, y);
  attn_run_t r = {keep(&y->value), keep(&q->grad), keep(&k->grad), keep(&v->grad)};
  return r;
}

/* The fused op equals the same computation written with separate ops (scale 0.5 is exact,
 * so the composed scores equal the fused ones bit for bit), dropout included: the fused op
 * draws its mask as ddp_dropout does, and its backward applies that mask. */
static void test_attention_matches_composition(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  const ddp_dtype_t dts[2] = {DDP_F64, DDP_F32};
  const double ps[3] = {0, 0.3, 1.0};
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < 3; i++)
      for (int before = 0; before < 2; before++) {
        attn_run_t a = attn_once(c, dts[d], true, ps[i], true, 4, before);
        attn_run_t b = attn_once(c, dts[d], false, ps[i], true, 4, before);
        double tol = dts[d] == DDP_F64 ? 1e-13 : 1e-5;
        char what[96];
        snprintf(what, sizeof what, "%s p=%.1f forward", ddp_dtype_name(dts[d]), ps[i]);
        expect_close(what, &a.y, &b.y, tol);
        snprintf(what, sizeof what, "%s p=%.1f grad q", ddp_dtype_name(dts[d]), ps[i]);
        expect_close(what, &a.gq, &b.gq, tol);
        snprintf(what, sizeof what, "%s p=%.1f grad k", ddp_dtype_name(dts[d]), ps[i]);
        expect_close(what, &a.gk, &b.gk, tol);
        snprintf(what, sizeof what, "%s p=%.1f grad v", ddp_dtype_name(dts[d]), ps[i]);
        expect_close(what, &a.gv, &b.gv, tol);
        attn_run_free(&a);
        attn_run_free(&b);
      }
  ddp_ctx_destroy(c);
}

/* Dropout in attention is deterministic (same seed, rank, step and call index: same bits),
 * changes with the step and with the call index, leaves eval and p = 0 identical to no
 * dropout, and takes one dropout call (a later ddp_dropout draws what a second call would). */
static void test_attention_dropout_determinism(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  attn_run_t a = attn_once(c, DDP_F32, true, 0.3, true, 4, 0);
  attn_run_t b = attn_once(c, DDP_F32, true, 0.3, true, 4, 0);
  expect_bits("rerun forward", &a.y, &b.y);
  expect_bits("rerun grad q", &a.gq, &b.gq);
  expect_bits("rerun grad k", &a.gk, &b.gk);
  expect_bits("rerun grad v", &a.gv, &b.gv);
  attn_run_t s5 = attn_once(c, DDP_F32, true, 0.3, true, 5, 0);
  attn_run_t k1 = attn_once(c, DDP_F32, true, 0.3, true, 4, 1);
  assert_memory_not_equal(a.y.data, s5.y.data, ddp_tensor_nbytes(&a.y));
  assert_memory_not_equal(a.y.data, k1.y.data, ddp_tensor_nbytes(&a.y));
  attn_run_t e = attn_once(c, DDP_F32, true, 0.3, false, 4, 0);
  attn_run_t z = attn_once(c, DDP_F32, true, 0.0, true, 4, 0);
  expect_bits("eval vs p = 0 forward", &e.y, &z.y);
  expect_bits("eval vs p = 0 grad q", &e.gq, &z.gq);
  assert_memory_not_equal(a.y.data, e.y.data, ddp_tensor_nbytes(&a.y));

  /* The call counter: attention then dropout draws what dropout then dropout draws. */
  int64_t sh[4] = {2, 3, 5, 4}, n = 64;
  ddp_var_t *ones, *y1, *y2, *t;
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 11, 0, 4);
  assert_int_equal(ddp_var_new(c, DDP_F32, 1, &n, NULL, false, &ones), DDP_OK);
  for (int64_t i = 0; i < n; i++) ((float *)ones->value.data)[i] = 1;
  ddp_var_t *q = rand_var(c, DDP_F32, 4, sh, 1, false);
  assert_int_equal(ddp_attention(c, q, q, q, NULL, false, 0.5, 0.3, true, &t), DDP_OK);
  assert_int_equal(ddp_dropout(c, ones, 0.3, true, &y1), DDP_OK);
  ddp_tensor_t m1 = keep(&y1->value);
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 11, 0, 4);
  assert_int_equal(ddp_var_new(c, DDP_F32, 1, &n, NULL, false, &ones), DDP_OK);
  for (int64_t i = 0; i < n; i++) ((float *)ones->value.data)[i] = 1;
  assert_int_equal(ddp_dropout(c, ones, 0.3, true, &t), DDP_OK);
  assert_int_equal(ddp_dropout(c, ones, 0.3, true, &y2), DDP_OK);
  expect_bits("dropout after attention", &m1, &y2->value);
  ddp_tensor_free(&m1);
  attn_run_free(&a);
  attn_run_free(&b);
  attn_run_free(&s5);
  attn_run_free(&k1);
  attn_run_free(&e);
  attn_run_free(&z);
  ddp_ctx_destroy(c);
}

/* What the masks mean: a query's output ignores the values of keys it may not see (future
 * keys when causal, padded keys always), and a query that sees no key at all averages every
 * value uniformly (all its scores equal the lowest finite value), with no gradient to q or k. */
static void test_attention_masking(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  enum { B = 3, H = 2, T = 4, D = 3 };
  int64_t sh[4] = {B, H, T, D}, msh[2] = {B, T};
  int64_t mask[B * T] = {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1};
  ddp_tensor_t y0 = {0};
  for (int pass = 0; pass < 2; pass++) {
    ddp_ctx_reset(c);
    ddp_var_t *q = rand_var(c, DDP_F64, 4, sh, 1, true), *k = rand_var(c, DDP_F64, 4, sh, 2, true);
    ddp_var_t *v = rand_var(c, DDP_F64, 4, sh, 3, true), *m, *y;
    if (pass == 1) { /* change every value and key a query must not see */
      double *vv = v->value.data, *kk = k->value.data;
      for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
          for (int64_t j = 0; j < T; j++)
            if (!mask[b * T + j])
              for (int64_t d = 0; d < D; d++) {
                vv[((b * H + h) * T + j) * D + d] += 5;
                kk[((b * H + h) * T + j) * D + d] -= 3;
              }
    }
    assert_int_equal(ddp_var_new(c, DDP_I64, 2, msh, mask, false, &m), DDP_OK);
    assert_int_equal(ddp_attention(c, q, k, v, m, true, 0.5, 0, true, &y), DDP_OK);
    const double *yy = y->value.data, *vv = v->value.data;
    /* Batch 2, queries 0 and 1 see no key: the mean of all four values. */
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < 2; i++)
        for (int64_t d = 0; d < D; d++) {
          double mean = 0;
          for (int64_t j = 0; j < T; j++) mean += vv[((2 * H + h) * T + j) * D + d] / T;
          double got = yy[((2 * H + h) * T + i) * D + d];
          if (fabs(got - mean) > 1e-14)
            fail_msg("uniform row h=%lld i=%lld d=%lld: %.17g vs %.17g", (long long)h, (long long)i,
                     (long long)d, got, mean);
        }
    /* Query 0 of batch 0 sees key 0 only: its output is v[0]. */
    for (int64_t d = 0; d < D; d++)
      if (fabs(yy[d] - vv[d]) > 1e-15)
        fail_msg("causal row 0 d=%lld: %.17g vs %.17g", (long long)d, yy[d], vv[d]);
    if (pass == 0) {
      y0 = keep(&y->value);
      backward_weighted(c, y);
      const double *gq = q->grad.data, *gk = k->grad.data;
      for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) {
          for (int64_t i = 0; i < 2; i++) { /* fully masked queries: no gradient */
            double g = gq[((2 * H + h) * T + i) * D + d];
            if (g != 0)
              fail_msg("grad q of fully masked query %lld: %.17g, expected 0", (long long)i, g);
          }
          for (int64_t j = 0; j < 2; j++) { /* padded keys: no gradient to k */
            double g = gk[((2 * H + h) * T + j) * D + d];
            if (g != 0) fail_msg("grad k of padded key %lld: %.17g, expected 0", (long long)j, g);
          }
        }
    } else {
      /* Rows that see a key do not depend on what they cannot see. */
      for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
          for (int64_t i = 0; i < T; i++) {
            if (b == 2 && i < 2) continue;
            for (int64_t d = 0; d < D; d++) {
              int64_t o = ((b * H + h) * T + i) * D + d;
              if (((double *)y0.data)[o] != yy[o])
                fail_msg("b=%lld h=%lld i=%lld: output moved with masked keys: %.17g vs %.17g",
                         (long long)b, (long long)h, (long long)i, ((double *)y0.data)[o], yy[o]);
            }
          }
    }
  }
  ddp_tensor_free(&y0);
  ddp_ctx_destroy(c);
}

/* ---------------------------------------------------------------- other values ---- */

/* The causal-LM loss equals ddp_cross_entropy on the shifted rows (logits[:, :-1] against
 * labels[:, 1:]), forward and gradient; labels[:, 0] is never read; all ignored gives NaN.
 * Broadcast add of b [C] equals ddp_bias_add bit for bit. */
static void test_values_vs_existing_ops(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  enum { B = 2, T = 5, V = 7 };
  int64_t lsh[3] = {B, T, V}, labsh[2] = {B, T};
  int64_t labels[B * T] = {999, 3, -100, 6, 0, -5, 1, 2, -100, 4};
  ddp_var_t *x = rand_var(c, DDP_F64, 3, lsh, 9, true), *lab, *loss;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, labels, false, &lab), DDP_OK);
  assert_int_equal(ddp_causal_lm_loss(c, x, lab, -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  double l1 = ((double *)loss->value.data)[0];
  ddp_tensor_t g1 = keep(&x->grad);
  /* The same rows through cross_entropy. */
  int64_t rows = B * (T - 1), rsh[2] = {rows, V}, tsh = rows, tg[B * (T - 1)];
  ddp_var_t *x2, *t2, *l2;
  assert_int_equal(ddp_var_new(c, DDP_F64, 2, rsh, NULL, true, &x2), DDP_OK);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t + 1 < T; t++) {
      memcpy((double *)x2->value.data + (b * (T - 1) + t) * V,
             (double *)x->value.data + (b * T + t) * V, V * sizeof(double));
      tg[b * (T - 1) + t] = labels[b * T + t + 1];
    }
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &tsh, tg, false, &t2), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, x2, t2, -100, &l2), DDP_OK);
  assert_int_equal(ddp_backward(c, l2), DDP_OK);
  double l2v = ((double *)l2->value.data)[0];
  if (!(fabs(l1 - l2v) <= 1e-14 * fabs(l2v)))
    fail_msg("loss %.17g vs cross_entropy %.17g", l1, l2v);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < V; j++) {
        double a = ((double *)g1.data)[(b * T + t) * V + j];
        double e = t + 1 < T ? ((double *)x2->grad.data)[(b * (T - 1) + t) * V + j] : 0;
        if (!(fabs(a - e) <= 1e-15))
          fail_msg("grad [%lld, %lld, %lld]: %.17g vs %.17g", (long long)b, (long long)t,
                   (long long)j, a, e);
      }
  ddp_tensor_free(&g1);
  /* Every label ignored: NaN, as PyTorch's mean over no element. */
  int64_t ign[B * T];
  for (int i = 0; i < B * T; i++) ign[i] = -100;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, ign, false, &lab), DDP_OK);
  assert_int_equal(ddp_causal_lm_loss(c, x, lab, -100, &loss), DDP_OK);
  if (!isnan(((double *)loss->value.data)[0]))
    fail_msg("all labels ignored: loss %.17g, expected NaN", ((double *)loss->value.data)[0]);

  /* add with b [C] broadcast is bias_add, bit for bit, forward and gradients. */
  int64_t ash[3] = {2, 3, 4}, bsh = 4;
  ddp_tensor_t r[2][3];
  for (int way = 0; way < 2; way++) {
    ddp_ctx_reset(c);
    ddp_var_t *a = rand_var(c, DDP_F32, 3, ash, 5, true),
              *bb = rand_var(c, DDP_F32, 1, &bsh, 6, true), *y;
    if (way == 0)
      assert_int_equal(ddp_add(c, a, bb, &y), DDP_OK);
    else
      assert_int_equal(ddp_bias_add(c, a, bb, &y), DDP_OK);
    backward_weighted(c, y);
    r[way][0] = keep(&y->value);
    r[way][1] = keep(&a->grad);
    r[way][2] = keep(&bb->grad);
  }
  expect_bits("add broadcast vs bias_add forward", &r[0][0], &r[1][0]);
  expect_bits("add broadcast vs bias_add grad a", &r[0][1], &r[1][1]);
  expect_bits("add broadcast vs bias_add grad b", &r[0][2], &r[1][2]);
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 3; j++) ddp_tensor_free(&r[i][j]);
  ddp_ctx_destroy(c);
}

/* ---------------------------------------------------------------- errors ---------- */

static void expect_error(ddp_ctx_t *c, ddp_status_t st, const char *needle) {
  if (st != DDP_ERR_INVALID_ARGUMENT)
    fail_msg("expected DDP_ERR_INVALID_ARGUMENT (%s), got %s", needle, ddp_status_name(st));
  ddp_error_t e;
  ddp_ctx_last_error_copy(c, &e);
  if (!strstr(e.msg, needle)) fail_msg("message \"%s\" lacks \"%s\"", e.msg, needle);
}

/* Mismatched shapes, n_head not dividing C, out-of-range labels and arguments are
 * DDP_ERR_INVALID_ARGUMENT with a message that names what is wrong. */
static void test_errors(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t s235[3] = {2, 3, 5}, s54[2] = {5, 4}, s45[2] = {4, 5}, s3[1] = {3};
  ddp_var_t *x = rand_var(c, DDP_F32, 3, s235, 1, true), *w = rand_var(c, DDP_F32, 2, s54, 2, true);
  ddp_var_t *wt = rand_var(c, DDP_F32, 2, s45, 3, true), *b3 = rand_var(c, DDP_F32, 1, s3, 4, true);
  ddp_var_t *y, *q, *k, *v;
  expect_error(c, ddp_conv1d(c, x, wt, NULL, &y), "weight F32[4, 5]");
  expect_error(c, ddp_conv1d(c, x, w, b3, &y), "bias F32[3]");
  int64_t a4[4] = {2, 3, 4, 5}, b4[4] = {2, 2, 5, 4};
  ddp_var_t *A = rand_var(c, DDP_F32, 4, a4, 5, true), *Bv = rand_var(c, DDP_F32, 4, b4, 6, true);
  expect_error(c, ddp_bmm(c, A, Bv, false, &y), "F32[2, 3, 4, 5] @ F32[2, 2, 5, 4]");
  expect_error(c, ddp_bmm(c, A, A, false, &y), "cannot be multiplied");
  const int dup[3] = {0, 1, 1}, oor[3] = {0, 3, 1};
  expect_error(c, ddp_permute(c, x, dup, &y), "perm[2] = 1");
  expect_error(c, ddp_permute(c, x, oor, &y), "perm[1] = 3");
  expect_error(c, ddp_narrow(c, x, 1, 2, 2, &y),
               "start (2) + length (2) exceeds dimension size (3)");
  expect_error(c, ddp_narrow(c, x, 3, 0, 1, &y), "dim 3 out of range");
  expect_error(c, ddp_add(c, x, w, &y), "operands differ");
  int64_t s2310[3] = {2, 3, 10}, s2312[3] = {2, 3, 12};
  ddp_var_t *x10 = rand_var(c, DDP_F32, 3, s2310, 7, true),
            *x12 = rand_var(c, DDP_F32, 3, s2312, 8, true);
  expect_error(c, ddp_to_heads(c, x10, 4, &y), "C = 10 is not divisible by n_head = 4");
  expect_error(c, ddp_split_heads(c, x12, 3, &q, &k, &v), "C = 4 is not divisible by n_head = 3");
  expect_error(c, ddp_split_heads(c, x10, 2, &q, &k, &v), "expected x [B, T, 3C]");
  expect_error(c, ddp_to_heads(c, x10, 0, &y), "n_head = 0");
  expect_error(c, ddp_merge_heads(c, x, &y), "expected x [B, H, T, D]");
  ddp_var_t *A2 = rand_var(c, DDP_F32, 4, b4, 9, true), *mask;
  expect_error(c, ddp_attention(c, A, A2, A, NULL, true, 1, 0, true, &y), "must share one shape");
  int64_t ms[2] = {2, 5};
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, ms, NULL, false, &mask), DDP_OK);
  expect_error(c, ddp_attention(c, A, A, A, mask, true, 1, 0, true, &y),
               "key_mask I64[2, 5] must be");
  expect_error(c, ddp_attention(c, A, A, A, NULL, true, 1, 1.5, true, &y),
               "between 0 and 1, but got 1.5");
  /* Labels: out of range (message as PyTorch's), wrong shape; labels[:, 0] is not checked. */
  int64_t lsh[3] = {2, 3, 5}, labsh[2] = {2, 3};
  ddp_var_t *logits = rand_var(c, DDP_F32, 3, lsh, 10, true), *lab;
  int64_t bad[6] = {0, 1, 2, 3, 7, -100};
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, bad, false, &lab), DDP_OK);
  expect_error(c, ddp_causal_lm_loss(c, logits, lab, -100, &y), "Target 7 is out of bounds");
  int64_t neg[6] = {0, 1, 2, 3, 4, -1};
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, neg, false, &lab), DDP_OK);
  expect_error(c, ddp_causal_lm_loss(c, logits, lab, -100, &y), "Target -1 is out of bounds");
  int64_t first[6] = {50, 1, 2, -7, 4, 0}; /* labels[:, 0] = 50, -7: never targets */
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, first, false, &lab), DDP_OK);
  assert_int_equal(ddp_causal_lm_loss(c, logits, lab, -100, &y), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, labsh, NULL, false, &lab), DDP_OK);
  expect_error(c, ddp_causal_lm_loss(c, logits, lab, -100, &y), "I64 labels [B, T]");
  ddp_ctx_destroy(c);
}

/* ---------------------------------------------------------------- against PyTorch -- */

#define ATT_QKV F(4, 3, 2, 4, 3), F(4, 3, 2, 4, 3), F(4, 3, 2, 4, 3)

static const ddp_test_tcase_t tcases[] = {
    {"conv1d", "conv1d", "{}", 3, {F(3, 2, 3, 5), F(2, 5, 4), F(1, 4)}},
    {"conv1d_nobias", "conv1d", "{}", 2, {F(2, 3, 5), F(2, 5, 4)}},
    {"bmm", "bmm", "{\"trans_b\": false}", 2, {F(4, 2, 3, 4, 5), F(4, 2, 3, 5, 2)}},
    {"bmm_trans_b", "bmm", "{\"trans_b\": true}", 2, {F(3, 3, 4, 5), F(3, 3, 2, 5)}},
    {"permute", "permute", "{\"perm\": [2, 0, 1]}", 1, {F(3, 2, 3, 4)}},
    {"narrow", "narrow", "{\"dim\": 1, \"start\": 1, \"length\": 3}", 1, {F(3, 3, 5, 2)}},
    {"scale", "scale", "{\"s\": 0.37}", 1, {F(2, 3, 4)}},
    {"add_broadcast", "add", "{}", 2, {F(3, 2, 3, 4), F(2, 3, 4)}},
    {"split_heads", "split_heads", "{\"n_head\": 2}", 1, {F(3, 2, 3, 12)}},
    {"to_heads", "to_heads", "{\"n_head\": 3}", 1, {F(3, 2, 3, 6)}},
    {"merge_heads", "merge_heads", "{}", 1, {F(4, 2, 3, 4, 2)}},
    {"attention", "attention", "{\"inv_scale\": 1.7320508075688772}", 3, {ATT_QKV}},
    {"attention_causal",
     "attention",
     "{\"inv_scale\": 1.7320508075688772, \"causal\": true}",
     3,
     {ATT_QKV}},
    {"attention_padding",
     "attention",
     "{\"inv_scale\": 1.7320508075688772, \"key_mask\": true}",
     4,
     {ATT_QKV, PAD(3, 4)}},
    {"attention_causal_padding",
     "attention",
     "{\"inv_scale\": 1.7320508075688772, \"causal\": true, \"key_mask\": true}",
     4,
     {ATT_QKV, PAD(3, 4)}},
    {"attention_dropout",
     "attention",
     "{\"inv_scale\": 1.7320508075688772, \"causal\": true, \"key_mask\": true, \"dropout\": true, "
     "\"p\": 0.3}",
     5,
     {ATT_QKV, PAD(3, 4), DMASK(4, 3, 2, 4, 4)}},
    {"causal_lm_loss",
     "causal_lm_loss",
     "{\"ignore_index\": -100}",
     2,
     {F(3, 2, 4, 5), {2, {2, 4}, DDP_TEST_IN_TARGETS, 5, false}}},
};

static double attr_num(const char *attrs, const char *key, double dflt) {
  cJSON *j = cJSON_Parse(attrs);
  const cJSON *x = cJSON_GetObjectItem(j, key);
  double v = cJSON_IsNumber(x) ? x->valuedouble : cJSON_IsBool(x) ? cJSON_IsTrue(x) : dflt;
  cJSON_Delete(j);
  return v;
}

static ddp_status_t run_op(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_var_t **in,
                           ddp_var_t **y) {
  (void)user;
  const char *op = tc->op, *at = tc->attrs;
  if (!strcmp(op, "conv1d")) return ddp_conv1d(c, in[0], in[1], tc->nin > 2 ? in[2] : NULL, y);
  if (!strcmp(op, "bmm")) return ddp_bmm(c, in[0], in[1], attr_num(at, "trans_b", 0) != 0, y);
  if (!strcmp(op, "permute")) {
    const int perm[3] = {2, 0, 1};
    return ddp_permute(c, in[0], perm, y);
  }
  if (!strcmp(op, "narrow"))
    return ddp_narrow(c, in[0], (int)attr_num(at, "dim", 0), (int64_t)attr_num(at, "start", 0),
                      (int64_t)attr_num(at, "length", 0), y);
  if (!strcmp(op, "scale")) return ddp_scale(c, in[0], attr_num(at, "s", 1), y);
  if (!strcmp(op, "add")) return ddp_add(c, in[0], in[1], y);
  if (!strcmp(op, "split_heads")) {
    ddp_var_t *qkv[3];
    ddp_status_t st = ddp_split_heads(c, in[0], (int64_t)attr_num(at, "n_head", 1), &qkv[0],
                                      &qkv[1], &qkv[2]);
    return st ? st : ddp_concat(c, 3, qkv, 0, y);
  }
  if (!strcmp(op, "to_heads")) return ddp_to_heads(c, in[0], (int64_t)attr_num(at, "n_head", 1), y);
  if (!strcmp(op, "merge_heads")) return ddp_merge_heads(c, in[0], y);
  if (!strcmp(op, "attention"))
    return ddp_attention(c, in[0], in[1], in[2], attr_num(at, "key_mask", 0) ? in[3] : NULL,
                         attr_num(at, "causal", 0) != 0, 1.0 / attr_num(at, "inv_scale", 1),
                         attr_num(at, "p", 0), true, y);
  if (!strcmp(op, "causal_lm_loss")) return ddp_causal_lm_loss(c, in[0], in[1], -100, y);
  fail_msg("unknown op %s", op);
  return DDP_ERR_INTERNAL;
}

/* The dropout case: torch multiplies the probabilities by libddp's mask (input 4), which is
 * what ddp_dropout draws for a [B, H, T, T] tensor of ones as the step's first dropout call
 * (the driver sets the RNG to (3, 0, 0) before each run). */
static void prepare_op(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_dtype_t dt,
                       double **data, const int64_t *numel, const ddp_var_t *y, const char *dir) {
  (void)user;
  (void)y;
  (void)dir;
  if (strcmp(tc->name, "attention_dropout") != 0) return;
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 3, 0, 0);
  ddp_var_t *ones, *m;
  assert_int_equal(ddp_var_new(c, dt, tc->in[4].ndim, tc->in[4].shape, NULL, false, &ones), DDP_OK);
  for (int64_t k = 0; k < ones->value.numel; k++) {
    if (dt == DDP_F32)
      ((float *)ones->value.data)[k] = 1;
    else
      ((double *)ones->value.data)[k] = 1;
  }
  assert_int_equal(ddp_dropout(c, ones, attr_num(tc->attrs, "p", 0), true, &m), DDP_OK);
  assert_int_equal(m->value.numel, numel[4]);
  int64_t dropped = 0;
  for (int64_t k = 0; k < numel[4]; k++) {
    data[4][k] = at(&m->value, k);
    dropped += data[4][k] == 0;
  }
  assert_true(dropped > 0 && dropped < numel[4]);
}

static char g_scratch[256];

static int setup(void **state) {
  (void)state;
  return ddp_test_make_scratch(g_scratch, sizeof g_scratch, "ddp_nn_attention") ? 0 : 1;
}

static int teardown(void **state) {
  (void)state;
  return ddp_test_remove_scratch(g_scratch, true);
}

static void ops_vs_torch(ddp_dtype_t dt, double tol) {
  ddp_test_torch_ops_t o = {.cases = tcases,
                            .n = sizeof tcases / sizeof tcases[0],
                            .run = run_op,
                            .prepare = prepare_op};
  ddp_test_torch_err_t e;
  ddp_test_ops_vs_torch(&o, g_scratch, dt, tol, &e);
}

/* Forward and every input gradient equal torch's in f64: rel 1e-10. */
static void test_torch_f64(void **state) {
  (void)state;
  ops_vs_torch(DDP_F64, 1e-10);
}

/* The same in f32: rel 1e-5. */
static void test_torch_f32(void **state) {
  (void)state;
  ops_vs_torch(DDP_F32, 1e-5);
}

/* ---------------------------------------------------------------- speed ----------- */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Attention at GPT-2 124M's training shape (B=4, H=12, T=64, D=64, f32, causal, dropout
 * 0.1) and the causal-LM loss at its vocabulary (B=4, T=64, V=50257): the best of three
 * forward+backward times is printed; a loose bound (1 s) catches only a pathological
 * slowdown (the attention does 2.4 GFLOP/s-scale work in about a millisecond). */
static void test_gpt2_shape_time(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t sh[4] = {4, 12, 64, 64}, lsh[3] = {4, 64, 50257}, labsh[2] = {4, 64};
  double best_a = INFINITY, best_l = INFINITY;
  int64_t *labels = malloc(4 * 64 * sizeof(int64_t));
  for (int i = 0; i < 4 * 64; i++) labels[i] = (i * 7919) % 50257;
  for (int it = 0; it < 3; it++) {
    ddp_ctx_reset(c);
    ddp_ctx_set_rng(c, 1, 0, (uint64_t)it);
    ddp_var_t *q = rand_var(c, DDP_F32, 4, sh, 1, true), *k = rand_var(c, DDP_F32, 4, sh, 2, true);
    ddp_var_t *v = rand_var(c, DDP_F32, 4, sh, 3, true), *y, *s;
    double t0 = now_ms();
    assert_int_equal(ddp_attention(c, q, k, v, NULL, true, 0.125, 0.1, true, &y), DDP_OK);
    assert_int_equal(ddp_sum(c, y, &s), DDP_OK);
    assert_int_equal(ddp_backward(c, s), DDP_OK);
    best_a = fmin(best_a, now_ms() - t0);
    ddp_var_t *x = rand_var(c, DDP_F32, 3, lsh, 4, true), *lab, *l;
    assert_int_equal(ddp_var_new(c, DDP_I64, 2, labsh, labels, false, &lab), DDP_OK);
    t0 = now_ms();
    assert_int_equal(ddp_causal_lm_loss(c, x, lab, -100, &l), DDP_OK);
    assert_int_equal(ddp_backward(c, l), DDP_OK);
    best_l = fmin(best_l, now_ms() - t0);
  }
  print_message("GPT-2 shape, 1 thread: attention fwd+bwd %.2f ms (B=4 H=12 T=64 D=64); "
                "causal_lm_loss fwd+bwd %.1f ms (V=50257)\n",
                best_a, best_l);
  double bound = DDP_TEST_BOUND_MS(1000); /* scaled by the load (cleanup.h) */
  if (!(best_a < bound)) fail_msg("attention fwd+bwd took %.1f ms (bound %.0f ms)", best_a, bound);
  free(labels);
  ddp_ctx_destroy(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gradcheck),
      cmocka_unit_test(test_attention_matches_composition),
      cmocka_unit_test(test_attention_dropout_determinism),
      cmocka_unit_test(test_attention_masking),
      cmocka_unit_test(test_values_vs_existing_ops),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_torch_f64),
      cmocka_unit_test(test_torch_f32),
      cmocka_unit_test(test_gpt2_shape_time),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
