/* Llama's operations and configuration (src/nn/ops_llama.c, src/nn/llama.c, hf_config.c):
 * every input gradient of ddp_rms_norm, ddp_rotary (each rope_scaling variant's
 * frequencies), ddp_repeat_kv, SiLU and the gated MLP against central finite differences in
 * f64; the same operations forward and backward against PyTorch 1.13 in f32 (rel 1e-5) and
 * f64 (rel 1e-10) through tools/torch/nn_oracle.py, which computes them with
 * tools/torch/hf_llama.py's functions (RMSNorm with and without weight, rotary with no,
 * linear, dynamic and llama3 rope_scaling, repeat_kv, SiLU, the gated MLP with and without
 * mlp_bias, grouped-query attention with the causal mask and padding, with and without
 * rotary); the rope_scaling variants' inverse frequencies against their formulas; the model's
 * names, parameters() order and no-decay set; config.json round trips; and the bad inputs the
 * issue names (KV heads not dividing the heads, hidden_size not divisible, an unknown
 * rope_scaling type, a token id beyond the vocabulary), each naming the key. The model
 * against PyTorch is tests/test_transformers_torch.c. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "opcheck.h"
#include "parity.h"
#include "transformers.h"

#define F(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, true }
#define PAD(b, t) \
  { 2, {b, t}, DDP_TEST_IN_PAD, 0, false }

/* ---------------------------------------------------------------- finite differences */

static float g_freq[4][4]; /* head_dim 8: default, linear, dynamic (T 6 > max 4), llama3 */

static ddp_status_t b_rms(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_rms_norm(c, in[0], in[1], 1e-6, o);
}
static ddp_status_t b_rms_nw(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_rms_norm(c, in[0], NULL, 0.1, o);
}
static ddp_status_t rot(ddp_ctx_t *c, ddp_var_t **in, int k, ddp_var_t **o) {
  return ddp_rotary(c, in[0], g_freq[k], o);
}
static ddp_status_t b_rot0(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) { return rot(c, in, 0, o); }
static ddp_status_t b_rot1(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) { return rot(c, in, 1, o); }
static ddp_status_t b_rot2(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) { return rot(c, in, 2, o); }
static ddp_status_t b_rot3(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) { return rot(c, in, 3, o); }
static ddp_status_t b_rep(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_repeat_kv(c, in[0], 3, o);
}
static ddp_status_t b_silu(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_SILU, in[0], o);
}
/* down(silu(gate(x)) * up(x)), Llama's MLP. */
static ddp_status_t b_mlp(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  ddp_var_t *g, *u;
  ddp_status_t st = ddp_linear(c, in[0], in[1], NULL, &g);
  if (!st) st = ddp_activation(c, DDP_ACT_SILU, g, &g);
  if (!st) st = ddp_linear(c, in[0], in[2], NULL, &u);
  if (!st) st = ddp_mul(c, g, u, &g);
  return st ? st : ddp_linear(c, g, in[3], NULL, o);
}
/* GQA: q [1, 4, 5, 6] against k, v [1, 2, 5, 6] repeated, rotary on q and k, causal. */
static ddp_status_t b_gqa(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  float f[3];
  ddp_rope_inv_freq(10000, 6, NULL, 32, 5, f);
  ddp_var_t *q, *k, *v;
  ddp_status_t st = ddp_rotary(c, in[0], f, &q);
  if (!st) st = ddp_rotary(c, in[1], f, &k);
  if (!st) st = ddp_repeat_kv(c, k, 2, &k);
  if (!st) st = ddp_repeat_kv(c, in[2], 2, &v);
  return st ? st : ddp_attention(c, q, k, v, NULL, true, 1 / sqrt(6.0), 0, true, o);
}

static void set_freqs(void) {
  ddp_rope_scaling_t lin = {DDP_ROPE_LINEAR, 4, 0, 0, 0}, dyn = {DDP_ROPE_DYNAMIC, 2, 0, 0, 0};
  ddp_rope_scaling_t l3 = {DDP_ROPE_LLAMA3, 8, 64, 1, 4};
  ddp_rope_inv_freq(10000, 8, NULL, 4, 6, g_freq[0]);
  ddp_rope_inv_freq(10000, 8, &lin, 4, 6, g_freq[1]);
  ddp_rope_inv_freq(10000, 8, &dyn, 4, 6, g_freq[2]);
  ddp_rope_inv_freq(10, 8, &l3, 4, 6, g_freq[3]);
}

static const ddp_test_gcase_t gcases[] = {
    {"rms_norm", 2, {F(3, 2, 3, 7), F(1, 7)}, b_rms},
    {"rms_norm_no_weight", 1, {F(2, 4, 5)}, b_rms_nw},
    {"rotary_default", 1, {F(4, 2, 3, 6, 8)}, b_rot0},
    {"rotary_linear", 1, {F(4, 2, 3, 6, 8)}, b_rot1},
    {"rotary_dynamic", 1, {F(4, 2, 3, 6, 8)}, b_rot2},
    {"rotary_llama3", 1, {F(4, 2, 3, 6, 8)}, b_rot3},
    {"repeat_kv", 1, {F(4, 2, 2, 3, 4)}, b_rep},
    {"silu", 1, {F(2, 3, 5)}, b_silu},
    {"gated_mlp", 4, {F(3, 2, 3, 5), F(2, 7, 5), F(2, 7, 5), F(2, 5, 7)}, b_mlp},
    {"gqa_attention", 3, {F(4, 1, 4, 5, 6), F(4, 1, 2, 5, 6), F(4, 1, 2, 5, 6)}, b_gqa},
};

/* Every input gradient matches central differences: max|a - n| / max|n| < 1e-6. */
static void test_gradcheck(void **state) {
  (void)state;
  set_freqs();
  double worst = ddp_test_gradcheck(gcases, NELEM(gcases), 1e-6);
  print_message("finite differences, %zu cases: max rel err %.3g\n", NELEM(gcases), worst);
}

/* ---------------------------------------------------------------- against PyTorch -- */

/* Each op forward and backward against tools/torch/nn_oracle.py, which computes it with
 * tools/torch/hf_llama.py's functions (Transformers' modeling_llama.py): rms_norm is
 * LlamaRMSNorm, rotary is LlamaRotaryEmbedding's tables applied by apply_rotary_pos_emb
 * (libddp's inverse frequencies from ddp_rope_inv_freq, torch's from hf_llama.inv_freq),
 * gqa_attention is eager_attention_forward after the projections (repeat_kv, the additive
 * causal mask with padding from _prepare_4d_causal_attention_mask_with_cache_position). */
#define ROPE_L3                                                                               \
  "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, " \
  "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 64}"
#define QKV F(4, 2, 4, 5, 6), F(4, 2, 2, 5, 6), F(4, 2, 2, 5, 6)
#define SCALING "\"scaling\": 0.40824829046386296" /* 6 ** -0.5 */

static const ddp_test_tcase_t tcases[] = {
    {"rms_norm", "rms_norm", "{\"eps\": 1e-6}", 2, {F(3, 2, 3, 7), F(1, 7)}},
    {"rms_norm_eps", "rms_norm", "{\"eps\": 0.1}", 2, {F(2, 4, 5), F(1, 5)}},
    {"rms_norm_no_weight", "rms_norm", "{\"eps\": 1e-5}", 1, {F(2, 4, 5)}},
    {"rotary_default", "rotary", "{\"theta\": 10000.0}", 1, {F(4, 2, 3, 6, 8)}},
    {"rotary_linear",
     "rotary",
     "{\"theta\": 10000.0, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}}",
     1,
     {F(4, 2, 3, 6, 8)}},
    /* T 6 beyond max_position_embeddings 4: the rescaled base. */
    {"rotary_dynamic",
     "rotary",
     "{\"theta\": 10000.0, \"max_position_embeddings\": 4, \"rope_scaling\": {\"rope_type\": "
     "\"dynamic\", \"factor\": 2.0}}",
     1,
     {F(4, 2, 3, 6, 8)}},
    /* head_dim 8, theta 10000: wavelengths 6.3, 63, 628, 6283 against the bands 16 and 64. */
    {"rotary_llama3", "rotary", "{\"theta\": 10000.0, " ROPE_L3 "}", 1, {F(4, 2, 3, 6, 8)}},
    {"repeat_kv", "repeat_kv", "{\"n_rep\": 3}", 1, {F(4, 2, 2, 3, 4)}},
    {"silu", "silu", "{}", 1, {F(3, 2, 3, 5)}},
    {"gated_mlp", "gated_mlp", "{}", 4, {F(3, 2, 3, 5), F(2, 7, 5), F(2, 7, 5), F(2, 5, 7)}},
    {"gated_mlp_bias",
     "gated_mlp",
     "{}",
     7,
     {F(3, 2, 3, 5), F(2, 7, 5), F(2, 7, 5), F(2, 5, 7), F(1, 7), F(1, 7), F(1, 5)}},
    {"gqa_causal", "gqa_attention", "{" SCALING "}", 3, {QKV}},
    {"gqa_causal_padding",
     "gqa_attention",
     "{" SCALING ", \"key_mask\": true}",
     4,
     {QKV, PAD(2, 5)}},
    {"gqa_rotary_llama3_padding",
     "gqa_attention",
     "{" SCALING ", \"key_mask\": true, \"rope\": true, \"theta\": 100.0, " ROPE_L3 "}",
     4,
     {QKV, PAD(2, 5)}},
};

static double jnum(const cJSON *o, const char *key, double dflt) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(x) ? x->valuedouble : cJSON_IsBool(x) ? cJSON_IsTrue(x) : dflt;
}

/* The inverse frequencies of a case's attrs, as llama.c computes them from config.json. */
static void case_inv_freq(const cJSON *a, int64_t head_dim, int64_t seq_len, float *f) {
  ddp_rope_scaling_t s = {DDP_ROPE_DEFAULT, 1, 0, 1, 1};
  const cJSON *rs = cJSON_GetObjectItemCaseSensitive(a, "rope_scaling");
  if (cJSON_IsObject(rs)) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!t) t = cJSON_GetObjectItemCaseSensitive(rs, "type");
    assert_true(cJSON_IsString(t));
    s.type = !strcmp(t->valuestring, "linear")    ? DDP_ROPE_LINEAR
             : !strcmp(t->valuestring, "dynamic") ? DDP_ROPE_DYNAMIC
             : !strcmp(t->valuestring, "llama3")  ? DDP_ROPE_LLAMA3
                                                  : DDP_ROPE_DEFAULT;
    s.factor = jnum(rs, "factor", 1);
    s.original_max_position_embeddings = (int64_t)jnum(rs, "original_max_position_embeddings", 0);
    s.low_freq_factor = jnum(rs, "low_freq_factor", 1);
    s.high_freq_factor = jnum(rs, "high_freq_factor", 1);
  }
  ddp_rope_inv_freq(jnum(a, "theta", 10000), head_dim, &s,
                    (int64_t)jnum(a, "max_position_embeddings", 2048), seq_len, f);
}

static ddp_status_t run_case(ddp_ctx_t *c, const ddp_test_tcase_t *tc, const cJSON *a,
                             ddp_var_t **in, ddp_var_t **y) {
  const char *op = tc->op;
  if (!strcmp(op, "rms_norm"))
    return ddp_rms_norm(c, in[0], tc->nin > 1 ? in[1] : NULL, jnum(a, "eps", 0), y);
  if (!strcmp(op, "rotary") || !strcmp(op, "gqa_attention")) {
    float f[64];
    int64_t D = in[0]->value.shape[3], T = in[0]->value.shape[2];
    assert_true(D / 2 <= 64);
    case_inv_freq(a, D, T, f);
    if (!strcmp(op, "rotary")) return ddp_rotary(c, in[0], f, y);
    ddp_var_t *q = in[0], *k = in[1], *v = in[2];
    int64_t rep = q->value.shape[1] / k->value.shape[1];
    ddp_status_t st = DDP_OK;
    if (jnum(a, "rope", 0)) st = ddp_rotary(c, q, f, &q);
    if (!st && jnum(a, "rope", 0)) st = ddp_rotary(c, k, f, &k);
    if (!st) st = ddp_repeat_kv(c, k, rep, &k);
    if (!st) st = ddp_repeat_kv(c, v, rep, &v);
    return st ? st
              : ddp_attention(c, q, k, v, jnum(a, "key_mask", 0) ? in[3] : NULL, true,
                              jnum(a, "scaling", 0), 0, true, y);
  }
  if (!strcmp(op, "repeat_kv")) return ddp_repeat_kv(c, in[0], (int64_t)jnum(a, "n_rep", 1), y);
  if (!strcmp(op, "silu")) return ddp_activation(c, DDP_ACT_SILU, in[0], y);
  if (!strcmp(op, "gated_mlp")) {
    bool b = tc->nin > 4;
    ddp_var_t *g, *u;
    ddp_status_t st = ddp_linear(c, in[0], in[1], b ? in[4] : NULL, &g);
    if (!st) st = ddp_activation(c, DDP_ACT_SILU, g, &g);
    if (!st) st = ddp_linear(c, in[0], in[2], b ? in[5] : NULL, &u);
    if (!st) st = ddp_mul(c, g, u, &g);
    return st ? st : ddp_linear(c, g, in[3], b ? in[6] : NULL, y);
  }
  fail_msg("unknown op %s", op);
  return DDP_ERR_INTERNAL;
}

static ddp_status_t run_op(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_var_t **in,
                           ddp_var_t **y) {
  (void)user;
  cJSON *a = cJSON_Parse(tc->attrs);
  assert_non_null(a);
  ddp_status_t st = run_case(c, tc, a, in, y);
  cJSON_Delete(a);
  return st;
}

static char g_scratch[256];

static int setup(void **state) {
  (void)state;
  return ddp_test_make_scratch(g_scratch, sizeof g_scratch, "ddp_llama_ops") ? 0 : 1;
}

static int teardown(void **state) {
  (void)state;
  return ddp_test_remove_scratch(g_scratch, true);
}

static void ops_vs_torch(ddp_dtype_t dt, double tol) {
  ddp_test_torch_ops_t o = {.cases = tcases, .n = NELEM(tcases), .run = run_op};
  ddp_test_ops_vs_torch(&o, g_scratch, dt, tol, NULL);
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

/* SiLU in F32 (its vectorized float path) against the same model in F64 (libm's exp): the
 * value within 4e-7 relative (a few float ulps) plus 1e-30 absolute (far below -87, where
 * exp(-x) overflows a float, both are tiny); the input gradient (output gradient 1.5) within
 * 4e-7 relative plus 2e-7 absolute (about an ulp of 1.5: near x = -1.28 the derivative
 * crosses zero as the difference of two terms of order 1, in float as in PyTorch's), over
 * 1003 points of [-100, 100] (not a multiple of any vector width) and the edges. */
static void test_silu_f32(void **state) {
  (void)state;
  enum { N = 1003 };
  static float xf[N];
  static double xd[N];
  for (int k = 0; k < N; k++) xd[k] = xf[k] = (float)(-100.0 + 200.0 * k / (N - 1) + 1e-3 * k);
  xd[0] = xf[0] = 0.0f;
  xd[1] = xf[1] = -1e-30f;
  xd[2] = xf[2] = 1e-30f;
  xd[3] = xf[3] = -87.0f;
  double worst = 0;
  ddp_ctx_t *cf, *cd;
  assert_int_equal(ddp_ctx_create(&cf), DDP_OK);
  assert_int_equal(ddp_ctx_create(&cd), DDP_OK);
  int64_t shape[1] = {N};
  ddp_var_t *vf, *vd, *yf, *yd;
  assert_int_equal(ddp_var_new(cf, DDP_F32, 1, shape, xf, true, &vf), DDP_OK);
  assert_int_equal(ddp_var_new(cd, DDP_F64, 1, shape, xd, true, &vd), DDP_OK);
  assert_int_equal(ddp_activation(cf, DDP_ACT_SILU, vf, &yf), DDP_OK);
  assert_int_equal(ddp_activation(cd, DDP_ACT_SILU, vd, &yd), DDP_OK);
  float gf[N];
  double gd[N];
  for (int k = 0; k < N; k++) gd[k] = gf[k] = 1.5f;
  ddp_tensor_t tgf, tgd;
  ddp_tensor_view(&tgf, DDP_F32, 1, shape, gf);
  ddp_tensor_view(&tgd, DDP_F64, 1, shape, gd);
  assert_int_equal(ddp_backward_multi(cf, 1, &yf, &tgf), DDP_OK);
  assert_int_equal(ddp_backward_multi(cd, 1, &yd, &tgd), DDP_OK);
  for (int k = 0; k < N; k++) {
    const double pairs[2][2] = {{((float *)yf->value.data)[k], ((double *)yd->value.data)[k]},
                                {((float *)vf->grad.data)[k], ((double *)vd->grad.data)[k]}};
    for (int j = 0; j < 2; j++) {
      double a = pairs[j][0], b = pairs[j][1], e = fabs(a - b);
      if (!(e <= 4e-7 * fabs(b) + (j ? 2e-7 : 1e-30)))
        fail_msg("silu %s at x = %.9g: f32 %.9g, f64 %.17g", j ? "gradient" : "value", xd[k], a, b);
      if (fabs(b) > 1e-20) worst = fmax(worst, e / fabs(b));
    }
  }
  print_message("silu f32 against f64: max rel err %.3g\n", worst);
  ddp_ctx_destroy(cf);
  ddp_ctx_destroy(cd);
}

/* ---------------------------------------------------------------- frequencies ----- */

/* Each variant against its formula (modeling_rope_utils.py), and dynamic equal to the
 * default up to max_position_embeddings. */
static void test_inv_freq(void **state) {
  (void)state;
  float def[8], f[8];
  ddp_rope_inv_freq(10000, 16, NULL, 32, 16, def);
  for (int i = 0; i < 8; i++) assert_float_equal(def[i], (float)pow(10000, -i / 8.0), 0);
  ddp_rope_scaling_t lin = {DDP_ROPE_LINEAR, 4, 0, 0, 0};
  ddp_rope_inv_freq(10000, 16, &lin, 32, 16, f);
  for (int i = 0; i < 8; i++) assert_float_equal(f[i], (float)(pow(10000, -i / 8.0) / 4), 0);
  ddp_rope_scaling_t dyn = {DDP_ROPE_DYNAMIC, 2, 0, 0, 0};
  ddp_rope_inv_freq(10000, 16, &dyn, 32, 32, f);
  assert_memory_equal(f, def, sizeof f);
  ddp_rope_inv_freq(10000, 16, &dyn, 32, 40, f);
  double base = 10000 * pow(2.0 * 40 / 32 - 1, 16.0 / 14);
  for (int i = 0; i < 8; i++) assert_float_equal(f[i], (float)pow(base, -i / 8.0), 0);
  /* llama3 with original 64, low 1, high 4: wavelengths above 64 divided by 8, below 16
   * kept, between interpolated. */
  ddp_rope_scaling_t l3 = {DDP_ROPE_LLAMA3, 8, 64, 1, 4};
  ddp_rope_inv_freq(10000, 16, &l3, 32, 16, f);
  int bands[3] = {0, 0, 0};
  for (int i = 0; i < 8; i++) {
    double fr = pow(10000, -i / 8.0), wl = 2 * M_PI / fr, want = fr;
    if (wl > 64) {
      want = fr / 8;
      bands[2]++;
    } else if (wl >= 16) {
      double s = (64 / wl - 1) / 3;
      want = (1 - s) * fr / 8 + s * fr;
      bands[1]++;
    } else {
      bands[0]++;
    }
    assert_float_equal(f[i], (float)want, 0);
  }
  assert_true(bands[0] > 0 && bands[1] > 0 && bands[2] > 0);
}

/* ---------------------------------------------------------------- model ----------- */

/* Transformers' names in parameters() order; RMSNorm weights are the no-decay set. */
static void test_names(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(LLAMA_JSON, NULL), DDP_F32);
  const char *want[] = {
      "model.embed_tokens.weight",
      "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.layers.0.input_layernorm.weight",
      "model.layers.0.post_attention_layernorm.weight",
  };
  for (size_t i = 0; i < NELEM(want); i++)
    assert_string_equal(ddp_model_param(m, i)->name, want[i]);
  assert_int_equal(ddp_model_num_params(m), 1 + 2 * 9 + 2);
  assert_string_equal(ddp_model_param(m, 19)->name, "model.norm.weight");
  assert_string_equal(ddp_model_param(m, 20)->name, "lm_head.weight");
  assert_int_equal(ddp_model_param(m, 2)->value.shape[0], 32); /* k_proj: 2 KV heads x 16 */
  assert_int_equal(ddp_model_param(m, 5)->value.shape[0], 172);
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    bool norm = strstr(ddp_model_param(m, i)->name, "norm") != NULL;
    assert_int_equal(ddp_model_param_in_layer_norm(m, i), norm);
  }
  assert_int_equal(ddp_model_task(m), DDP_TASK_CAUSAL_LM);
  ddp_model_destroy(m);
  m = model_of(cfg_text(LLAMA_JSON, ", \"tie_word_embeddings\": true, \"attention_bias\": true"),
               DDP_F32);
  assert_int_equal(ddp_model_num_params(m), 1 + 2 * 13 + 1);
  assert_string_equal(ddp_model_param(m, 2)->name, "model.layers.0.self_attn.q_proj.bias");
  ddp_model_destroy(m);
}

/* Defaults (LlamaConfig's), and save_pretrained's config.json read back equal. */
static void test_config(void **state) {
  (void)state;
  ddp_hf_config_t c, c2;
  ddp_error_t err = {0};
  assert_int_equal(ddp_hf_config_parse("{\"model_type\": \"llama\"}", NULL, &c, &err), DDP_OK);
  assert_int_equal(c.model_type, DDP_HF_LLAMA);
  assert_int_equal(c.llama.hidden_size, 4096);
  assert_int_equal(c.llama.intermediate_size, 11008);
  assert_int_equal(c.llama.num_key_value_heads, 32);
  assert_float_equal(c.llama.rms_norm_eps, 1e-6, 0);
  assert_float_equal(c.llama.rope_theta, 10000, 0);
  assert_false(c.llama.tie_word_embeddings);
  assert_int_equal(c.llama.pad_token_id, -1);
  assert_int_equal(c.llama.bos_token_id, 1);
  assert_int_equal(c.llama.eos_token_id, 2);
  const char *l3 = ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                   "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                   "\"original_max_position_embeddings\": 8192}, \"pad_token_id\": 3";
  assert_int_equal(ddp_hf_config_parse(cfg_text(LLAMA_JSON, l3), NULL, &c, &err), DDP_OK);
  char dir[] = "/tmp/ddp_llama_cfg_XXXXXX", path[64];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/config.json", dir);
  assert_int_equal(ddp_hf_config_write(&c, path, &err), DDP_OK);
  FILE *f = fopen(path, "rb");
  char text[4096];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  assert_non_null(strstr(text, "\"LlamaForCausalLM\""));
  assert_int_equal(ddp_hf_config_parse(text, path, &c2, &err), DDP_OK);
  c.llama.head_dim = 16; /* written explicitly */
  assert_memory_equal(&c.llama, &c2.llama, sizeof c.llama);
  remove(path);
  rmdir(dir);
}

static void expect_bad_json(const char *json, ddp_status_t want, const char *msg) {
  ddp_hf_config_t c;
  ddp_error_t err = {0};
  assert_int_equal(ddp_hf_config_parse(json, "cfg/config.json", &c, &err), want);
  if (!strstr(err.msg, msg)) fail_msg("said \"%s\", expected \"%s\"", err.msg, msg);
}

static void expect_bad(const char *extra, ddp_status_t want, const char *msg) {
  expect_bad_json(cfg_text(LLAMA_JSON, extra), want, msg);
}

/* The bad inputs, each naming the file and key. */
static void test_errors(void **state) {
  (void)state;
  expect_bad_json("{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4, "
                  "\"num_key_value_heads\": 3}",
                  DDP_ERR_INVALID_ARGUMENT,
                  "cfg/config.json: \"num_attention_heads\" (4) must be divisible by "
                  "\"num_key_value_heads\" (3)");
  expect_bad_json("{\"model_type\": \"llama\", \"hidden_size\": 66, \"num_attention_heads\": 4}",
                  DDP_ERR_INVALID_ARGUMENT,
                  "\"hidden_size\" (66) must be divisible by \"num_attention_heads\" (4)");
  expect_bad(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2}", DDP_ERR_UNSUPPORTED,
             "\"rope_scaling\" has rope_type \"yarn\": libddp supports default, linear, dynamic "
             "and llama3");
  expect_bad(", \"rope_scaling\": {\"factor\": 2}", DDP_ERR_INVALID_ARGUMENT,
             "\"rope_scaling\" needs a string \"rope_type\"");
  expect_bad(", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 0.5}",
             DDP_ERR_INVALID_ARGUMENT, "\"rope_scaling\" needs a \"factor\" >= 1");
  /* A token id beyond the vocabulary, at forward. */
  ddp_model_t *m = model_of(cfg_text(LLAMA_JSON, NULL), DDP_F32);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t ids[4] = {1, 2, 256, 3}, shape[2] = {1, 4};
  ddp_var_t *x, *y;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, shape, ids, false, &x), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, x, 0, &y), DDP_ERR_INVALID_ARGUMENT);
  ddp_error_t e;
  ddp_ctx_last_error_copy(c, &e);
  assert_string_equal(e.msg, "llama: token id 256 at [0, 2] is out of range for vocab_size = 256");
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gradcheck), cmocka_unit_test(test_torch_f64),
      cmocka_unit_test(test_torch_f32), cmocka_unit_test(test_silu_f32),
      cmocka_unit_test(test_inv_freq),  cmocka_unit_test(test_names),
      cmocka_unit_test(test_config),    cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
