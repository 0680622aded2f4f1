/* libddp's GPT-2 and BERT against their PyTorch twins (tools/torch/hf_models.py under
 * /usr/bin/python3, torch 1.13): the same weights on both sides (libddp's Transformers init
 * written by save_pretrained and loaded by PyTorch with strict=True, or PyTorch's init loaded
 * by libddp's from_pretrained), then one training step with dropout 0: logits, loss, every
 * parameter's gradient, the gradient-ready hook order (PyTorch's recorded with hooks on
 * AccumulateGrad) and the parameter names, in f32 and f64; and PyTorch's wording for the
 * checkpoints it refuses. Skips (cmocka skip) when torch or numpy is absent. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "opcheck.h"
#include "transformers.h"

static char g_dir[256];     /* empty when torch is absent */
static const char *g_shard; /* weights(): save_pretrained's max_shard_size ("": one file) */
static double g_worst[2];   /* largest relative error seen: [0] f32, [1] f64 */

#define NEED_TORCH()                                                              \
  do {                                                                            \
    if (!g_dir[0]) {                                                              \
      print_message("torch or numpy (under /usr/bin/python3) absent: skipped\n"); \
      skip();                                                                     \
    }                                                                             \
  } while (0)

/* max|a - b| / max(max|b|, floor) over n values of dtype dt. */
static double rel_err(const void *a, const void *b, ddp_dtype_t dt, int64_t n, double floor) {
  double md = 0, mb = 0;
  for (int64_t k = 0; k < n; k++) {
    md = fmax(md, fabs(getv(a, dt, k) - getv(b, dt, k)));
    mb = fmax(mb, fabs(getv(b, dt, k)));
  }
  return md / fmax(mb, floor);
}

/* The parameter names in order.json ("names": PyTorch's named_parameters()) and its hook
 * order ("order"), compared with libddp's. */
static void expect_names_and_order(const char *dir, ddp_model_t *m, const order_t *o) {
  char p[512];
  snprintf(p, sizeof p, "%s/order.json", dir);
  FILE *f = fopen(p, "rb");
  assert_non_null(f);
  static char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  cJSON *j = cJSON_Parse(text);
  assert_non_null(j);
  cJSON *names = cJSON_GetObjectItem(j, "names"), *order = cJSON_GetObjectItem(j, "order");
  assert_int_equal(cJSON_GetArraySize(names), ddp_model_num_params(m));
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    const char *tn = cJSON_GetArrayItem(names, (int)i)->valuestring;
    if (strcmp(tn, ddp_model_param(m, i)->name))
      fail_msg("parameter %zu: libddp %s, PyTorch %s", i, ddp_model_param(m, i)->name, tn);
  }
  if (cJSON_GetArraySize(order) != o->n)
    fail_msg("%d hooks fired in PyTorch, %d in libddp", cJSON_GetArraySize(order), o->n);
  for (int i = 0; i < o->n; i++) {
    size_t t = (size_t)cJSON_GetArrayItem(order, i)->valuedouble;
    if (t != o->idx[i])
      fail_msg("hook %d: libddp fired %s, PyTorch %s", i, ddp_model_param(m, o->idx[i])->name,
               ddp_model_param(m, t)->name);
  }
  cJSON_Delete(j);
}

/* Weights for one comparison, in dir/model: libddp's init saved by save_pretrained (PyTorch
 * then loads them strictly), or PyTorch's init loaded by libddp's from_pretrained. */
static ddp_model_t *weights(const char *dir, const char *cfg_json, ddp_dtype_t dt,
                            bool torch_init) {
  char mdir[512];
  snprintf(mdir, sizeof mdir, "%s/model", dir);
  ddp_error_t err = {0};
  ddp_model_t *m;
  if (!torch_init) {
    m = model_of(cfg_json, dt);
    assert_int_equal(ddp_model_init(m, 17), DDP_OK);
    int64_t cap = DDP_MAX_SHARD_SIZE_DEFAULT;
    if (g_shard) assert_int_equal(ddp_parse_file_size(g_shard, "max_shard_size", &cap, NULL), 0);
    if (ddp_model_save_pretrained_sharded(m, mdir, cap, &err) != DDP_OK) fail_msg("%s", err.msg);
    return m;
  }
  ddp_hf_config_t cfg;
  assert_int_equal(ddp_hf_config_parse(cfg_json, NULL, &cfg, NULL), DDP_OK);
  cfg.torch_dtype = dt;
  mkdirs(mdir);
  char path[600];
  snprintf(path, sizeof path, "%s/config.json", mdir);
  assert_int_equal(ddp_hf_config_write(&cfg, path, NULL), DDP_OK);
  char args[600];
  snprintf(args, sizeof args, "init '%s' 7 %s", mdir, g_shard ? g_shard : "");
  assert_true(ddp_test_run_tool("hf_models.py", args));
  if (ddp_model_from_pretrained(mdir, dt, &m, &err) != DDP_OK) fail_msg("%s", err.msg);
  return m;
}

/* One step on both sides; every value within tol (relative). */
static void compare(const char *tag, const char *cfg_json, ddp_dtype_t dt, const batch_t *b,
                    bool torch_init, double tol) {
  NEED_TORCH();
  char dir[400];
  snprintf(dir, sizeof dir, "%s/%s", g_dir, tag);
  assert_int_equal(mkdir(dir, 0700), 0);
  ddp_model_t *m = weights(dir, cfg_json, dt, torch_init);
  const char *dts = dt == DDP_F32 ? "f32" : "f64";
  size_t es = ddp_dtype_size(dt);
  int64_t xn = b->shape[0] * b->shape[1] * (b->nd == 3 ? b->shape[2] : 1);
  int64_t ln = b->lshape[0] * (b->lnd == 2 ? b->lshape[1] : 1);
  ddp_test_write_bin(dir, "x.bin", b->x, (size_t)xn * 8);
  ddp_test_write_bin(dir, "labels.bin", &b->labels, (size_t)ln * 8);
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "dtype", dts);
  cJSON *xs = cJSON_AddArrayToObject(j, "x_shape");
  for (int d = 0; d < b->nd; d++) cJSON_AddItemToArray(xs, cJSON_CreateNumber((double)b->shape[d]));
  cJSON_AddStringToObject(j, "labels_dtype", b->ldt == DDP_I64 ? "i64" : "f64");
  cJSON *ls = cJSON_AddArrayToObject(j, "labels_shape");
  for (int d = 0; d < b->lnd; d++)
    cJSON_AddItemToArray(ls, cJSON_CreateNumber((double)b->lshape[d]));
  cJSON_AddBoolToObject(j, "train", true);
  char *run = cJSON_PrintUnformatted(j);
  cJSON_Delete(j);
  ddp_test_write_bin(dir, "run.json", run, strlen(run));
  cJSON_free(run);
  char args[600];
  snprintf(args, sizeof args, "step '%s'", dir);
  assert_true(ddp_test_run_tool("hf_models.py", args));

  order_t o = {{0}, 0};
  ddp_model_set_hook(m, on_ready, &o);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  ddp_var_t *logits, *loss = step(m, c, b, true, &logits);
  void *ref = malloc((size_t)logits->value.numel * es);
  ddp_test_read_bin(dir, "logits.bin", ref, (size_t)logits->value.numel * es);
  double e_logits = rel_err(logits->value.data, ref, dt, logits->value.numel, 0);
  free(ref);
  double lref;
  ddp_test_read_bin(dir, "loss.bin", &lref, es);
  double l = getv(loss->value.data, dt, 0), lr = getv(&lref, dt, 0);
  double e_loss = fabs(l - lr) / fabs(lr);
  ddp_tensor_t gf = ddp_model_flat_grads(m, dt);
  ref = malloc(ddp_tensor_nbytes(&gf));
  ddp_test_read_bin(dir, "grads.bin", ref, ddp_tensor_nbytes(&gf));
  /* Each parameter relative to its own largest gradient, with a floor of 1e-3 of the model's
   * largest: a gradient that is zero in exact arithmetic (the key bias: softmax ignores a
   * shift of every score of a row) is rounding noise on both sides. */
  double gmax = 0, e_grad = 0;
  for (int64_t k = 0; k < gf.numel; k++) gmax = fmax(gmax, fabs(getv(ref, dt, k)));
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    double e = rel_err(p->grad.data, (char *)ref + (size_t)p->offset * es, dt, p->value.numel,
                       1e-3 * gmax);
    if (getenv("HF_VERBOSE")) print_message("  %s %.3g\n", p->name, e);
    if (!(e <= tol)) fail_msg("%s: gradient of %s: rel err %.3g > %.g", tag, p->name, e, tol);
    e_grad = fmax(e_grad, e);
  }
  free(ref);
  print_message("%s (%s): max rel err vs PyTorch: logits %.3g, loss %.3g, gradients %.3g\n", tag,
                dts, e_logits, e_loss, e_grad);
  if (!(e_logits <= tol)) fail_msg("%s: logits rel err %.3g > %.g", tag, e_logits, tol);
  if (!(e_loss <= tol)) fail_msg("%s: loss %.17g vs PyTorch %.17g", tag, l, lr);
  double *w = &g_worst[dt == DDP_F64];
  *w = fmax(*w, fmax(e_logits, fmax(e_loss, e_grad)));
  expect_names_and_order(dir, m, &o);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

#define TOL_F32 1e-5
#define TOL_F64 1e-10

/* GPT-2 (tied head) on libddp's weights. */
static void test_gpt2_f32(void **state) {
  (void)state;
  batch_t b;
  gpt2_batch(&b, 3, 16, 1);
  compare("gpt2_f32", cfg_text(GPT2_JSON, NULL), DDP_F32, &b, false, TOL_F32);
}

static void test_gpt2_f64(void **state) {
  (void)state;
  batch_t b;
  gpt2_batch(&b, 3, 16, 2);
  compare("gpt2_f64", cfg_text(GPT2_JSON, NULL), DDP_F64, &b, false, TOL_F64);
}

/* GPT-2 on PyTorch's weights (its init, loaded by from_pretrained), with the untied head,
 * n_inner, erf GELU and layer-index attention scaling. */
static void test_gpt2_torch_init_untied(void **state) {
  (void)state;
  batch_t b;
  gpt2_batch(&b, 2, 24, 3);
  const char *cfg = cfg_text(GPT2_JSON, ", \"tie_word_embeddings\": false, \"n_inner\": 96, "
                                        "\"activation_function\": \"gelu\", "
                                        "\"scale_attn_by_inverse_layer_idx\": true");
  compare("gpt2_untied_f64", cfg, DDP_F64, &b, true, TOL_F64);
  compare("gpt2_untied_f32", cfg, DDP_F32, &b, true, TOL_F32);
}

/* BERT with padding ([B, 3, T]: ids, attention_mask, token_type_ids) and without ([B, T]). */
static void test_bert_f32(void **state) {
  (void)state;
  batch_t b;
  bert_batch(&b, 4, 12, 3, true, false, 4);
  compare("bert_pad_f32", cfg_text(BERT_JSON, NULL), DDP_F32, &b, false, TOL_F32);
  bert_batch(&b, 4, 12, 1, false, false, 5);
  compare("bert_nopad_f32", cfg_text(BERT_JSON, NULL), DDP_F32, &b, false, TOL_F32);
}

static void test_bert_f64(void **state) {
  (void)state;
  batch_t b;
  bert_batch(&b, 4, 12, 3, true, false, 6);
  compare("bert_pad_f64", cfg_text(BERT_JSON, NULL), DDP_F64, &b, false, TOL_F64);
  bert_batch(&b, 4, 12, 2, false, false, 7);
  compare("bert_nopad_f64", cfg_text(BERT_JSON, NULL), DDP_F64, &b, false, TOL_F64);
}

/* BERT on PyTorch's weights; regression heads (num_labels 1, and problem_type "regression"
 * with 2 outputs: MSE). */
static void test_bert_torch_init_regression(void **state) {
  (void)state;
  batch_t b;
  bert_batch(&b, 3, 10, 2, true, false, 8);
  compare("bert_torch_init_f32", cfg_text(BERT_JSON, ", \"hidden_act\": \"relu\""), DDP_F32, &b,
          true, TOL_F32);
  bert_batch(&b, 3, 10, 3, true, true, 9);
  const char *reg = "{\"model_type\": \"bert\", \"num_hidden_layers\": 2, \"hidden_size\": 32, "
                    "\"num_attention_heads\": 2, \"intermediate_size\": 48, \"vocab_size\": 256, "
                    "\"max_position_embeddings\": 16, \"num_labels\": 1, \"pad_token_id\": 0, "
                    "\"hidden_dropout_prob\": 0, \"attention_probs_dropout_prob\": 0}";
  compare("bert_regression_f64", reg, DDP_F64, &b, true, TOL_F64);
  /* problem_type "regression" with two outputs: MSE against [B, 2] float labels. */
  b.lnd = 2;
  b.lshape[1] = 2;
  for (int k = 0; k < 6; k++) b.labels.f[k] = 0.25 * k - 0.6;
  const char *reg2 = "{\"model_type\": \"bert\", \"num_hidden_layers\": 2, \"hidden_size\": 32, "
                     "\"num_attention_heads\": 2, \"intermediate_size\": 48, \"vocab_size\": 256, "
                     "\"max_position_embeddings\": 16, \"id2label\": {\"0\": \"x\", \"1\": \"y\"}, "
                     "\"problem_type\": \"regression\", \"hidden_dropout_prob\": 0, "
                     "\"attention_probs_dropout_prob\": 0}";
  compare("bert_regression2_f32", reg2, DDP_F32, &b, false, TOL_F32);
}

/* Llama (LlamaForCausalLM): each rope_scaling variant, tied and untied heads, GQA (4 heads, 2
 * KV heads), on libddp's weights and on PyTorch's. The dynamic case runs 40 tokens past
 * max_position_embeddings 32, where its base changes; llama3's bands are placed so that
 * head_dim 16's wavelengths fall in all three. */
static const char *llama_variants[][2] = {
    {"none", ""},
    {"linear", ", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 4.0}"},
    {"dynamic", ", \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 2.0}"},
    {"llama3", ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
               "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
               "\"original_max_position_embeddings\": 64}"},
};

static void llama_case(const char *variant, const char *extra, ddp_dtype_t dt, bool torch_init,
                       bool tied, int64_t T, uint64_t seed) {
  char ex[512], tag[64];
  snprintf(ex, sizeof ex, "%s%s", extra, tied ? ", \"tie_word_embeddings\": true" : "");
  snprintf(tag, sizeof tag, "llama_%s_%s%s%s", variant, dt == DDP_F32 ? "f32" : "f64",
           tied ? "_tied" : "", torch_init ? "_torch_init" : "");
  batch_t b;
  gpt2_batch(&b, 2, T, seed);
  compare(tag, cfg_text(LLAMA_JSON, ex), dt, &b, torch_init, dt == DDP_F32 ? TOL_F32 : TOL_F64);
}

static void test_llama_f32(void **state) {
  (void)state;
  for (size_t i = 0; i < NELEM(llama_variants); i++)
    llama_case(llama_variants[i][0], llama_variants[i][1], DDP_F32, false, false,
               !strcmp(llama_variants[i][0], "dynamic") ? 40 : 16, 20 + i);
}

static void test_llama_f64(void **state) {
  (void)state;
  for (size_t i = 0; i < NELEM(llama_variants); i++)
    llama_case(llama_variants[i][0], llama_variants[i][1], DDP_F64, false, false,
               !strcmp(llama_variants[i][0], "dynamic") ? 40 : 16, 30 + i);
}

/* Tied head, biases on and a padding row, on PyTorch's initialisation (from_pretrained). */
static void test_llama_tied_torch_init(void **state) {
  (void)state;
  const char *ex = ", \"attention_bias\": true, \"mlp_bias\": true, \"pad_token_id\": 0";
  llama_case("bias", ex, DDP_F64, true, true, 12, 40);
  llama_case("bias", ex, DDP_F32, true, true, 12, 41);
  llama_case("none", "", DDP_F32, false, true, 16, 42);
}

/* Sharded directories (100KB shards, as save_pretrained(max_shard_size="100KB") writes them)
 * both ways: PyTorch's sharded init loads in libddp and its step matches; libddp's sharded
 * save loads strictly in PyTorch, its step matches, and its tensors equal, bit for bit, those
 * PyTorch reads from libddp's single-file save of the same model. Llama (untied, tied) and
 * GPT-2 through the one code path. */
static void test_sharded(void **state) {
  (void)state;
  NEED_TORCH();
  g_shard = "100KB";
  batch_t b;
  gpt2_batch(&b, 2, 16, 50);
  compare("sharded_llama_torch_init", cfg_text(LLAMA_JSON, NULL), DDP_F32, &b, true, TOL_F32);
  compare("sharded_llama", cfg_text(LLAMA_JSON, NULL), DDP_F32, &b, false, TOL_F32);
  compare("sharded_llama_tied_f64", cfg_text(LLAMA_JSON, ", \"tie_word_embeddings\": true"),
          DDP_F64, &b, true, TOL_F64);
  g_shard = "30KB";
  compare("sharded_gpt2_torch_init", cfg_text(GPT2_JSON, NULL), DDP_F32, &b, true, TOL_F32);
  compare("sharded_gpt2", cfg_text(GPT2_JSON, NULL), DDP_F32, &b, false, TOL_F32);
  g_shard = NULL;
  char one[400], many[400], args[2000];
  snprintf(many, sizeof many, "%s/sharded_llama/model", g_dir);
  struct stat sb;
  char idx[600];
  snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", many);
  assert_int_equal(stat(idx, &sb), 0);
  ddp_model_t *m;
  ddp_error_t err = {0};
  if (ddp_model_from_pretrained(many, DDP_F32, &m, &err) != DDP_OK) fail_msg("%s", err.msg);
  snprintf(one, sizeof one, "%s/sharded_llama_one", g_dir);
  assert_int_equal(ddp_model_save_pretrained(m, one, &err), DDP_OK);
  snprintf(args, sizeof args, "same '%s' '%s' >/dev/null", one, many);
  assert_true(ddp_test_run_tool("hf_models.py", args));
  /* And the check can fail: one tensor's last bit differs. */
  float *w = ddp_model_param(m, 0)->value.data;
  uint32_t bits;
  memcpy(&bits, &w[0], 4);
  bits ^= 1;
  memcpy(&w[0], &bits, 4);
  assert_int_equal(ddp_model_save_pretrained(m, one, &err), DDP_OK);
  snprintf(args, sizeof args,
           "OMP_NUM_THREADS=1 /usr/bin/python3 %s/tools/torch/hf_models.py same '%s' '%s' "
           ">/dev/null 2>&1",
           ddp_test_source_root(), one, many);
  DDP_ASSERT_EXITED(system(args), 1);
  ddp_model_destroy(m);
  /* PyTorch's sharded directory: libddp's save of the same weights writes the same index,
   * byte for byte, and the same shard files. */
  snprintf(many, sizeof many, "%s/sharded_llama_torch_init/model", g_dir);
  if (ddp_model_from_pretrained(many, DDP_F32, &m, &err) != DDP_OK) fail_msg("%s", err.msg);
  snprintf(one, sizeof one, "%s/sharded_llama_again", g_dir);
  assert_int_equal(ddp_model_save_pretrained_sharded(m, one, 100000, &err), DDP_OK);
  snprintf(args, sizeof args,
           "cmp '%s/model.safetensors.index.json' '%s/model.safetensors.index.json' && "
           "test \"$(cd '%s' && ls model-*)\" = \"$(cd '%s' && ls model-*)\"",
           many, one, many, one);
  assert_int_equal(system(args), 0);
  ddp_model_destroy(m);
}

/* libddp's checkpoint directories load in PyTorch with strict=True, and a directory either
 * side refuses is refused by both in the same words. */
static void test_checkpoint_wording(void **state) {
  (void)state;
  NEED_TORCH();
  ddp_model_t *m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32), *m2 = NULL;
  assert_int_equal(ddp_model_init(m, 2), DDP_OK);
  char dir[400];
  snprintf(dir, sizeof dir, "%s/wording", g_dir);
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_save_pretrained(m, dir, &err), DDP_OK);
  char args[600];
  snprintf(args, sizeof args, "check '%s' >/dev/null", dir);
  assert_true(ddp_test_run_tool("hf_models.py", args));
  static float small[255 * 64];
  int64_t s1[2] = {32, 64}, s2[2] = {255, 64};
  ddp_tensor_t t1, t2;
  ddp_tensor_view(&t1, DDP_F32, 2, s1, small);
  ddp_tensor_view(&t2, DDP_F32, 2, s2, small);
  ddp_st_entry_t wpe = {"transformer.wpe.weight", &t1}, lm = {"lm_head.weight", &t2};
  ddp_st_entry_t extra = {"transformer.h.2.ln_1.weight", &ddp_model_param(m, 2)->value};
  struct {
    const char *drop;
    const ddp_st_entry_t *add;
    const char *want;
  } cases[] = {
      {"transformer.ln_f.bias", NULL, "Missing key(s) in state_dict: \"transformer.ln_f.bias\". "},
      {"transformer.wpe.weight", &wpe,
       "size mismatch for transformer.wpe.weight: copying a param with shape torch.Size([32, 64]) "
       "from checkpoint, the shape in current model is torch.Size([64, 64])."},
      {NULL, &lm,
       "size mismatch for lm_head.weight: copying a param with shape torch.Size([255, 64]) from "
       "checkpoint, the shape in current model is torch.Size([256, 64])."},
      {NULL, &extra, "Unexpected key(s) in state_dict: \"transformer.h.2.ln_1.weight\". "},
  };
  for (size_t i = 0; i < NELEM(cases); i++) {
    write_weights(dir, m, cases[i].drop, NULL, cases[i].add, cases[i].add ? 1 : 0);
    assert_int_equal(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA);
    if (!strstr(err.msg, cases[i].want)) fail_msg("libddp said \"%s\"", err.msg);
    char cmd[1400], errpath[512];
    snprintf(errpath, sizeof errpath, "%s/check_err.txt", g_dir);
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=1 /usr/bin/python3 %s/tools/torch/hf_models.py check '%s' >/dev/null "
             "2>'%s'",
             ddp_test_source_root(), dir, errpath);
    int rc = system(cmd);
    DDP_ASSERT_EXITED(rc, 3);
    FILE *f = fopen(errpath, "rb");
    assert_non_null(f);
    char text[4096];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    if (!strstr(text, cases[i].want))
      fail_msg("PyTorch said \"%s\", expected \"%s\"", text, cases[i].want);
  }
  ddp_model_destroy(m);
}

/* Prints the largest relative errors of the run (the figures docs/nn.md quotes). */
static void test_summary(void **state) {
  (void)state;
  NEED_TORCH();
  print_message("largest relative error vs PyTorch: f32 %.3g (tolerance %g), f64 %.3g "
                "(tolerance %g)\n",
                g_worst[0], TOL_F32, g_worst[1], TOL_F64);
}

static int setup(void **state) {
  (void)state;
  g_dir[0] = 0;
  if (!ddp_test_python() || !ddp_test_source_root()) return 0;
  if (system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") != 0) return 0;
  snprintf(g_dir, sizeof g_dir, "/tmp/ddp_transformers_torch_XXXXXX");
  if (!mkdtemp(g_dir)) g_dir[0] = 0;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (!g_dir[0] || getenv("HF_KEEP")) return 0;
  char line[512];
  snprintf(line, sizeof line, "rm -rf '%s'", g_dir);
  return system(line) == 0 ? 0 : 1;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpt2_f32),
      cmocka_unit_test(test_gpt2_f64),
      cmocka_unit_test(test_gpt2_torch_init_untied),
      cmocka_unit_test(test_bert_f32),
      cmocka_unit_test(test_bert_f64),
      cmocka_unit_test(test_bert_torch_init_regression),
      cmocka_unit_test(test_checkpoint_wording),
      cmocka_unit_test(test_llama_f32),
      cmocka_unit_test(test_llama_f64),
      cmocka_unit_test(test_llama_tied_torch_init),
      cmocka_unit_test(test_sharded),
      cmocka_unit_test(test_summary),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
