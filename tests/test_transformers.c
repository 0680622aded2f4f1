/* Transformers' GPT-2 (GPT2LMHeadModel) and BERT (BertForSequenceClassification) in libddp,
 * without PyTorch: config.json parsing, defaults and errors; parameter names, order and
 * shapes; Transformers' initialisation; forward errors; checkpoint directories
 * (save_pretrained / from_pretrained, what loading tolerates and what it refuses); gradients
 * against finite differences in f64 and the tied weight's single hook. The comparison with
 * PyTorch is tests/test_transformers_torch.c. */
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
#include <dirent.h>
#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "transformers.h"

static char g_dir[256]; /* scratch directory */

/* Asserts status st and that err's message contains every string in the NULL-ended list. */
static void expect_err(ddp_status_t got, ddp_status_t want, const char *msg, ...) {
  if (got != want)
    fail_msg("status %s, expected %s (message: %s)", ddp_status_name(got), ddp_status_name(want),
             msg);
  va_list ap;
  va_start(ap, msg);
  for (const char *s; (s = va_arg(ap, const char *));)
    if (!strstr(msg, s)) fail_msg("message \"%s\" lacks \"%s\"", msg, s);
  va_end(ap);
}

/* expect_err for DDP_ERR_INVALID_ARGUMENT with the context's last error (copied out after
 * got's call has run), which must contain n1 and n2 (n2 may be NULL). */
static void expect_ctx_err(ddp_status_t got, const ddp_ctx_t *c, const char *n1, const char *n2) {
  ddp_error_t e;
  ddp_ctx_last_error_copy(c, &e);
  expect_err(got, DDP_ERR_INVALID_ARGUMENT, e.msg, n1, n2, NULL);
}

static ddp_status_t parse_err(const char *json, ddp_error_t *err) {
  ddp_hf_config_t cfg;
  memset(err, 0, sizeof *err);
  return ddp_hf_config_parse(json, "cfg.json", &cfg, err);
}

/* ---------------------------------------------------------------- config ---------- */

/* Absent keys take Transformers' defaults; given keys, aliases and id2label are read. */
static void test_config_defaults(void **state) {
  (void)state;
  ddp_hf_config_t c;
  assert_int_equal(ddp_hf_config_parse("{\"model_type\": \"gpt2\"}", NULL, &c, NULL), DDP_OK);
  assert_int_equal(c.model_type, DDP_HF_GPT2);
  assert_int_equal(c.gpt2.vocab_size, 50257);
  assert_int_equal(c.gpt2.n_positions, 1024);
  assert_int_equal(c.gpt2.n_embd, 768);
  assert_int_equal(c.gpt2.n_layer, 12);
  assert_int_equal(c.gpt2.n_head, 12);
  assert_int_equal(c.gpt2.n_inner, 0);
  assert_string_equal(c.gpt2.activation_function, "gelu_new");
  DDP_ASSERT_EQ(c.gpt2.resid_pdrop, 0.1);
  DDP_ASSERT_EQ(c.gpt2.embd_pdrop, 0.1);
  DDP_ASSERT_EQ(c.gpt2.attn_pdrop, 0.1);
  DDP_ASSERT_EQ(c.gpt2.layer_norm_epsilon, 1e-5);
  DDP_ASSERT_EQ(c.gpt2.initializer_range, 0.02);
  assert_true(c.gpt2.scale_attn_weights && c.gpt2.tie_word_embeddings);
  assert_int_equal(c.torch_dtype, DDP_F32);
  assert_int_equal(ddp_hf_config_parse("{\"model_type\": \"bert\"}", NULL, &c, NULL), DDP_OK);
  assert_int_equal(c.model_type, DDP_HF_BERT);
  assert_int_equal(c.bert.vocab_size, 30522);
  assert_int_equal(c.bert.hidden_size, 768);
  assert_int_equal(c.bert.num_hidden_layers, 12);
  assert_int_equal(c.bert.num_attention_heads, 12);
  assert_int_equal(c.bert.intermediate_size, 3072);
  assert_string_equal(c.bert.hidden_act, "gelu");
  DDP_ASSERT_EQ(c.bert.hidden_dropout_prob, 0.1);
  DDP_ASSERT_EQ(c.bert.attention_probs_dropout_prob, 0.1);
  assert_int_equal(c.bert.max_position_embeddings, 512);
  assert_int_equal(c.bert.type_vocab_size, 2);
  DDP_ASSERT_EQ(c.bert.layer_norm_eps, 1e-12);
  DDP_ASSERT_EQ(c.bert.initializer_range, 0.02);
  assert_int_equal(c.bert.pad_token_id, 0);
  assert_int_equal(c.bert.num_labels, 2);
  DDP_ASSERT_EQ(c.bert.classifier_dropout, -1);
  /* GPT2Config's attribute_map aliases, n_inner, torch_dtype; BERT's id2label. */
  assert_int_equal(ddp_hf_config_parse("{\"model_type\": \"gpt2\", \"hidden_size\": 32, "
                                       "\"n_head\": 4,"
                                       " \"n_inner\": 48, \"max_position_embeddings\": 8,"
                                       " \"torch_dtype\": \"float64\"}",
                                       NULL, &c, NULL),
                   DDP_OK);
  assert_int_equal(c.gpt2.n_embd, 32);
  assert_int_equal(c.gpt2.n_inner, 48);
  assert_int_equal(c.gpt2.n_positions, 8);
  assert_int_equal(c.torch_dtype, DDP_F64);
  assert_int_equal(ddp_hf_config_parse("{\"model_type\": \"bert\", \"id2label\": {\"0\": \"neg\", "
                                       "\"1\": \"neu\", \"2\": \"pos\"}, \"pad_token_id\": null, "
                                       "\"classifier_dropout\": 0.3}",
                                       NULL, &c, NULL),
                   DDP_OK);
  assert_int_equal(c.bert.num_labels, 3);
  assert_int_equal(c.bert.pad_token_id, -1);
  DDP_ASSERT_EQ(c.bert.classifier_dropout, 0.3);
}

/* Each bad config is refused with a message naming the key. */
static void test_config_errors(void **state) {
  (void)state;
  ddp_error_t e;
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_head\": 5}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "cfg.json", "\"n_embd\" (64)", "\"n_head\" (5)",
             NULL);
  expect_err(
      parse_err("{\"model_type\": \"bert\", \"hidden_size\": 60, \"num_attention_heads\": 8}", &e),
      DDP_ERR_INVALID_ARGUMENT, e.msg, "\"hidden_size\"", "\"num_attention_heads\"", NULL);
  expect_err(parse_err("{\"model_type\": \"t5\"}", &e), DDP_ERR_INVALID_ARGUMENT, e.msg,
             "model_type", "t5", "gpt2, bert, llama", NULL);
  expect_err(parse_err("{\"n_layer\": 2}", &e), DDP_ERR_INVALID_ARGUMENT, e.msg, "model_type",
             "missing", NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"n_layer\": \"2\"}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"n_layer\" must be an integer (got a string)",
             NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"n_layer\": 2.5}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"n_layer\"", NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"scale_attn_weights\": 1}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"scale_attn_weights\" must be true or false", NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"vocab_size\": 0}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"vocab_size\" must be a positive integer (got 0)",
             NULL);
  expect_err(parse_err("{\"model_type\": \"bert\", \"num_hidden_layers\": -1}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"num_hidden_layers\"", NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"attn_pdrop\": 1.5}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"attn_pdrop\"", "[0, 1]", NULL);
  expect_err(parse_err("{\"model_type\": \"bert\", \"pad_token_id\": 30522}", &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "\"pad_token_id\"", NULL);
  expect_err(
      parse_err("{\"model_type\": \"bert\", \"num_labels\": 2, \"id2label\": {\"0\": \"a\"}}", &e),
      DDP_ERR_INVALID_ARGUMENT, e.msg, "\"num_labels\" (2)", "id2label", NULL);
  expect_err(parse_err("[1, 2]", &e), DDP_ERR_INVALID_ARGUMENT, e.msg, "JSON object", NULL);
  expect_err(parse_err("{\"model_type\": ", &e), DDP_ERR_INVALID_DATA, e.msg,
             "line 1, column 16: JSON syntax error at the end of the file", NULL);
  /* Valid in Transformers, not implemented here: refused, saying so. */
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"activation_function\": \"quick_gelu\"}", &e),
             DDP_ERR_UNSUPPORTED, e.msg, "\"activation_function\"", "quick_gelu", "silu", NULL);
  expect_err(parse_err("{\"model_type\": \"bert\", \"position_embedding_type\": \"relative_key\"}",
                       &e),
             DDP_ERR_UNSUPPORTED, e.msg, "position_embedding_type", NULL);
  expect_err(parse_err("{\"model_type\": \"bert\", \"is_decoder\": true}", &e), DDP_ERR_UNSUPPORTED,
             e.msg, "is_decoder", NULL);
  expect_err(parse_err("{\"model_type\": \"gpt2\", \"add_cross_attention\": true}", &e),
             DDP_ERR_UNSUPPORTED, e.msg, "add_cross_attention", NULL);
  expect_err(parse_err("{\"model_type\": \"bert\", \"problem_type\": "
                       "\"multi_label_classification\"}",
                       &e),
             DDP_ERR_UNSUPPORTED, e.msg, "problem_type", NULL);
  /* ddp_model_from_json takes the same config and the same errors. */
  ddp_model_t *m = NULL;
  expect_err(ddp_model_from_json("{\"model_type\": \"gpt2\", \"n_embd\": 10, \"n_head\": 4}", &m,
                                 &e),
             DDP_ERR_INVALID_ARGUMENT, e.msg, "n_embd", "n_head", NULL);
  assert_null(m);
}

/* write -> parse gives the same config; the file has Transformers' keys. */
static void test_config_write_roundtrip(void **state) {
  (void)state;
  const char *srcs[2] = {cfg_text(GPT2_JSON, ", \"n_inner\": 96, \"tie_word_embeddings\": false"),
                         NULL};
  char b2[1024];
  snprintf(b2, sizeof b2, BERT_JSON, ", \"pad_token_id\": 3, \"classifier_dropout\": 0.25");
  srcs[1] = b2;
  for (int k = 0; k < 2; k++) {
    ddp_hf_config_t a, b;
    memset(&a, 0, sizeof a);
    assert_int_equal(ddp_hf_config_parse(srcs[k], NULL, &a, NULL), DDP_OK);
    char path[256];
    ddp_test_tmp_file(path, sizeof path, "transformers", "config");
    assert_int_equal(ddp_hf_config_write(&a, path, NULL), DDP_OK);
    FILE *f = fopen(path, "rb");
    char text[4096];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    assert_non_null(strstr(text, k ? "\"BertForSequenceClassification\"" : "\"GPT2LMHeadModel\""));
    assert_non_null(strstr(text, "\"torch_dtype\":"));
    assert_int_equal(ddp_hf_config_parse(text, path, &b, NULL), DDP_OK);
    assert_memory_equal(&a, &b, sizeof a);
    unlink(path);
  }
}

/* ---------------------------------------------------------------- names, init ----- */

/* Transformers' state_dict names, parameters() order and shapes (the first block in full),
 * LayerNorm membership, the tied head (no parameter of its own) and the untied one. */
static void test_names(void **state) {
  (void)state;
  static const char *const g[] = {"transformer.wte.weight",
                                  "transformer.wpe.weight",
                                  "transformer.h.0.ln_1.weight",
                                  "transformer.h.0.ln_1.bias",
                                  "transformer.h.0.attn.c_attn.weight",
                                  "transformer.h.0.attn.c_attn.bias",
                                  "transformer.h.0.attn.c_proj.weight",
                                  "transformer.h.0.attn.c_proj.bias",
                                  "transformer.h.0.ln_2.weight",
                                  "transformer.h.0.ln_2.bias",
                                  "transformer.h.0.mlp.c_fc.weight",
                                  "transformer.h.0.mlp.c_fc.bias",
                                  "transformer.h.0.mlp.c_proj.weight",
                                  "transformer.h.0.mlp.c_proj.bias"};
  static const int64_t gs[][2] = {{256, 64}, {64, 64}, {64, 0},   {64, 0}, {64, 192},
                                  {192, 0},  {64, 64}, {64, 0},   {64, 0}, {64, 0},
                                  {64, 256}, {256, 0}, {256, 64}, {64, 0}};
  ddp_model_t *m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_num_params(m), 2 + 12 * 2 + 2);
  for (size_t i = 0; i < NELEM(g); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (strcmp(p->name, g[i])) fail_msg("parameter %zu is %s, expected %s", i, p->name, g[i]);
    assert_int_equal(p->value.shape[0], gs[i][0]);
    if (gs[i][1]) assert_int_equal(p->value.shape[1], gs[i][1]);
  }
  assert_string_equal(ddp_model_param(m, 14)->name, "transformer.h.1.ln_1.weight");
  assert_string_equal(ddp_model_param(m, 26)->name, "transformer.ln_f.weight");
  assert_string_equal(ddp_model_param(m, 27)->name, "transformer.ln_f.bias");
  assert_null(ddp_model_find_param(m, "lm_head.weight"));
  assert_true(ddp_model_param_in_layer_norm(m, 2) && ddp_model_param_in_layer_norm(m, 27));
  assert_false(ddp_model_param_in_layer_norm(m, 4) || ddp_model_param_in_layer_norm(m, 0));
  assert_int_equal(ddp_model_task(m), DDP_TASK_CAUSAL_LM);
  assert_int_equal(ddp_model_hf_config(m)->gpt2.n_layer, 2);
  ddp_model_destroy(m);
  m = model_of(cfg_text(GPT2_JSON, ", \"tie_word_embeddings\": false"), DDP_F64);
  assert_int_equal(ddp_model_num_params(m), 29);
  assert_string_equal(ddp_model_param(m, 28)->name, "lm_head.weight");
  assert_int_equal(ddp_model_param(m, 28)->value.shape[0], 256);
  ddp_model_destroy(m);

  static const char *const b[] = {"bert.embeddings.word_embeddings.weight",
                                  "bert.embeddings.position_embeddings.weight",
                                  "bert.embeddings.token_type_embeddings.weight",
                                  "bert.embeddings.LayerNorm.weight",
                                  "bert.embeddings.LayerNorm.bias",
                                  "bert.encoder.layer.0.attention.self.query.weight",
                                  "bert.encoder.layer.0.attention.self.query.bias",
                                  "bert.encoder.layer.0.attention.self.key.weight",
                                  "bert.encoder.layer.0.attention.self.key.bias",
                                  "bert.encoder.layer.0.attention.self.value.weight",
                                  "bert.encoder.layer.0.attention.self.value.bias",
                                  "bert.encoder.layer.0.attention.output.dense.weight",
                                  "bert.encoder.layer.0.attention.output.dense.bias",
                                  "bert.encoder.layer.0.attention.output.LayerNorm.weight",
                                  "bert.encoder.layer.0.attention.output.LayerNorm.bias",
                                  "bert.encoder.layer.0.intermediate.dense.weight",
                                  "bert.encoder.layer.0.intermediate.dense.bias",
                                  "bert.encoder.layer.0.output.dense.weight",
                                  "bert.encoder.layer.0.output.dense.bias",
                                  "bert.encoder.layer.0.output.LayerNorm.weight",
                                  "bert.encoder.layer.0.output.LayerNorm.bias"};
  static const int64_t bs[][2] = {{256, 64}, {64, 64}, {2, 64}, {64, 0},   {64, 0},  {64, 64},
                                  {64, 0},   {64, 64}, {64, 0}, {64, 64},  {64, 0},  {64, 64},
                                  {64, 0},   {64, 0},  {64, 0}, {128, 64}, {128, 0}, {64, 128},
                                  {64, 0},   {64, 0},  {64, 0}};
  m = model_of(cfg_text(BERT_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_num_params(m), 5 + 16 * 2 + 4);
  for (size_t i = 0; i < NELEM(b); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (strcmp(p->name, b[i])) fail_msg("parameter %zu is %s, expected %s", i, p->name, b[i]);
    assert_int_equal(p->value.shape[0], bs[i][0]);
    if (bs[i][1]) assert_int_equal(p->value.shape[1], bs[i][1]);
  }
  static const char *const tail[] = {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                                     "classifier.weight", "classifier.bias"};
  for (size_t i = 0; i < 4; i++) assert_string_equal(ddp_model_param(m, 37 + i)->name, tail[i]);
  assert_int_equal(ddp_model_param(m, 39)->value.shape[0], 3);
  assert_int_equal(ddp_model_task(m), DDP_TASK_SEQ_CLASSIFICATION);
  ddp_model_destroy(m);
}

/* mean and standard deviation of a parameter's values. */
static void stats(const ddp_param_t *p, double *mean, double *sd) {
  double s = 0, s2 = 0;
  int64_t n = p->value.numel;
  for (int64_t k = 0; k < n; k++) {
    double v = p->value.dtype == DDP_F32 ? ((float *)p->value.data)[k]
                                         : ((double *)p->value.data)[k];
    s += v;
    s2 += v * v;
  }
  *mean = s / (double)n;
  *sd = sqrt(s2 / (double)n - *mean * *mean);
}

static void expect_stats(ddp_model_t *m, const char *name, double mean, double sd, double tol) {
  double mu, s;
  ddp_param_t *p = ddp_model_find_param(m, name);
  assert_non_null(p);
  stats(p, &mu, &s);
  if (fabs(mu - mean) > tol || fabs(s - sd) > tol * (sd > 0 ? 1 : 0) + (sd > 0 ? 0.05 * sd : 0))
    fail_msg("%s: mean %.5g sd %.5g, expected mean %.5g sd %.5g", name, mu, s, mean, sd);
}

/* _init_weights: N(0, 0.02) weights and embeddings, c_proj N(0, 0.02 / sqrt(2 n_layer)),
 * biases 0, LayerNorm 1 and 0, BERT's pad row 0; deterministic in the seed. */
static void test_init(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);
  expect_stats(m, "transformer.wte.weight", 0, 0.02, 1e-3);
  expect_stats(m, "transformer.h.0.attn.c_attn.weight", 0, 0.02, 1e-3);
  expect_stats(m, "transformer.h.1.mlp.c_fc.weight", 0, 0.02, 1e-3);
  expect_stats(m, "transformer.h.0.attn.c_proj.weight", 0, 0.01, 1e-3);
  expect_stats(m, "transformer.h.1.mlp.c_proj.weight", 0, 0.01, 1e-3);
  expect_stats(m, "transformer.h.1.mlp.c_proj.bias", 0, 0, 0);
  expect_stats(m, "transformer.ln_f.weight", 1, 0, 0);
  expect_stats(m, "transformer.ln_f.bias", 0, 0, 0);
  ddp_model_t *m2 = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_init(m2, 5), DDP_OK);
  ddp_tensor_t a = ddp_model_flat_params(m, DDP_F32), b = ddp_model_flat_params(m2, DDP_F32);
  assert_memory_equal(a.data, b.data, ddp_tensor_nbytes(&a));
  assert_int_equal(ddp_model_init(m2, 6), DDP_OK);
  assert_true(memcmp(a.data, b.data, ddp_tensor_nbytes(&a)) != 0);
  ddp_model_destroy(m);
  ddp_model_destroy(m2);
  m = model_of(cfg_text(BERT_JSON, ", \"pad_token_id\": 7, \"initializer_range\": 0.05"), DDP_F64);
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);
  expect_stats(m, "bert.embeddings.word_embeddings.weight", 0, 0.05, 2e-3);
  expect_stats(m, "bert.encoder.layer.1.attention.self.key.weight", 0, 0.05, 2e-3);
  expect_stats(m, "bert.encoder.layer.1.attention.self.key.bias", 0, 0, 0);
  expect_stats(m, "bert.encoder.layer.0.output.LayerNorm.weight", 1, 0, 0);
  expect_stats(m, "classifier.weight", 0, 0.05, 1e-2);
  const double *w = ddp_model_find_param(m, "bert.embeddings.word_embeddings.weight")->value.data;
  for (int k = 0; k < 64; k++) {
    DDP_ASSERT_EQ(w[7 * 64 + k], 0.0);
    assert_true(w[6 * 64 + k] != 0.0);
  }
  ddp_model_destroy(m);
}

/* ---------------------------------------------------------------- steps ----------- */

/* Central differences in f64 for chosen elements: (name, element). */
typedef struct probe {
  const char *name;
  int64_t k;
} probe_t;

static void gradcheck(ddp_model_t *m, const batch_t *b, const probe_t *pr, size_t n) {
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  ddp_model_zero_grad(m);
  step(m, c, b, true, NULL);
  for (size_t i = 0; i < n; i++) {
    ddp_param_t *p = ddp_model_find_param(m, pr[i].name);
    assert_non_null(p);
    double g = ((double *)p->grad.data)[pr[i].k], w0 = ((double *)p->value.data)[pr[i].k];
    const double h = 1e-5;
    ((double *)p->value.data)[pr[i].k] = w0 + h;
    double lp = ((double *)step(m, c, b, false, NULL)->value.data)[0];
    ((double *)p->value.data)[pr[i].k] = w0 - h;
    double lm = ((double *)step(m, c, b, false, NULL)->value.data)[0];
    ((double *)p->value.data)[pr[i].k] = w0;
    double fd = (lp - lm) / (2 * h);
    if (!(fabs(fd - g) <= 1e-7 + 1e-6 * fabs(fd)))
      fail_msg("%s[%lld]: gradient %.12g, finite difference %.12g", pr[i].name, (long long)pr[i].k,
               g, fd);
  }
  ddp_ctx_destroy(c);
}

/* Gradients of both families against finite differences (f64), the tied embedding's two
 * contributions included; BERT's padding row gets no gradient (padding_idx); every hook
 * fires exactly once, the tied wte last. */
static void test_gradcheck(void **state) {
  (void)state;
  ddp_model_t *m = model_of("{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 16, "
                            "\"n_head\": 2, \"vocab_size\": 256, \"n_positions\": 16, "
                            "\"resid_pdrop\": 0, \"embd_pdrop\": 0, \"attn_pdrop\": 0, "
                            "\"initializer_range\": 0.4}",
                            DDP_F64);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  batch_t b;
  gpt2_batch(&b, 2, 6, 1);
  const probe_t gp[] = {{"transformer.wte.weight", b.x[0] * 16 + 3},
                        {"transformer.wte.weight", 5 * 16 + 1},
                        {"transformer.wpe.weight", 16 + 2},
                        {"transformer.h.0.ln_1.weight", 4},
                        {"transformer.h.0.attn.c_attn.weight", 5 * 48 + 2},
                        {"transformer.h.0.attn.c_attn.weight", 5 * 48 + 20},
                        {"transformer.h.0.attn.c_attn.weight", 5 * 48 + 40},
                        {"transformer.h.0.attn.c_attn.bias", 35},
                        {"transformer.h.0.attn.c_proj.weight", 77},
                        {"transformer.h.0.ln_2.bias", 9},
                        {"transformer.h.0.mlp.c_fc.bias", 50},
                        {"transformer.h.0.mlp.c_proj.weight", 300},
                        {"transformer.ln_f.weight", 11}};
  gradcheck(m, &b, gp, NELEM(gp));
  order_t o = {{0}, 0};
  ddp_model_set_hook(m, on_ready, &o);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  step(m, c, &b, true, NULL);
  assert_int_equal(o.n, (int)ddp_model_num_params(m));
  assert_int_equal(o.idx[o.n - 1], 0); /* wte: once, after both uses */
  ddp_model_destroy(m);

  m = model_of("{\"model_type\": \"bert\", \"num_hidden_layers\": 1, \"hidden_size\": 16, "
               "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 256, "
               "\"max_position_embeddings\": 16, \"num_labels\": 3, \"hidden_dropout_prob\": 0, "
               "\"attention_probs_dropout_prob\": 0, \"initializer_range\": 0.4}",
               DDP_F64);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  bert_batch(&b, 3, 7, 3, true, false, 2);
  const probe_t bp[] = {{"bert.embeddings.word_embeddings.weight", b.x[1] * 16 + 5},
                        {"bert.embeddings.position_embeddings.weight", 2 * 16 + 1},
                        {"bert.embeddings.token_type_embeddings.weight", 16 + 7},
                        {"bert.embeddings.LayerNorm.weight", 3},
                        {"bert.encoder.layer.0.attention.self.query.weight", 37},
                        {"bert.encoder.layer.0.attention.self.key.weight", 101},
                        {"bert.encoder.layer.0.attention.self.value.bias", 6},
                        {"bert.encoder.layer.0.attention.output.LayerNorm.bias", 2},
                        {"bert.encoder.layer.0.intermediate.dense.weight", 200},
                        {"bert.encoder.layer.0.output.dense.bias", 15},
                        {"bert.pooler.dense.weight", 130},
                        {"classifier.bias", 1}};
  gradcheck(m, &b, bp, NELEM(bp));
  const double *gw = ddp_model_find_param(m, "bert.embeddings.word_embeddings.weight")->grad.data;
  double row0 = 0;
  for (int k = 0; k < 16; k++) row0 += fabs(gw[k]);
  DDP_ASSERT_EQ(row0, 0.0); /* masked: no gradient reaches the pad positions anyway */
  /* Attended pad ids: the loss depends on row 0 (a finite difference sees it), yet the
   * gradient stays 0, as nn.Embedding(padding_idx=0) has it. */
  bert_batch(&b, 3, 7, 1, false, false, 2);
  DDP_ASSERT_EQ(b.x[5], 0);
  ddp_ctx_t *c0;
  assert_int_equal(ddp_ctx_create(&c0), DDP_OK);
  ddp_model_zero_grad(m);
  step(m, c0, &b, true, NULL);
  row0 = 0;
  for (int k = 0; k < 16; k++) row0 += fabs(gw[k]);
  DDP_ASSERT_EQ(row0, 0.0);
  double *w0 = ddp_model_find_param(m, "bert.embeddings.word_embeddings.weight")->value.data;
  w0[2] += 1e-3;
  double lp = ((double *)step(m, c0, &b, false, NULL)->value.data)[0];
  w0[2] -= 2e-3;
  double lm = ((double *)step(m, c0, &b, false, NULL)->value.data)[0];
  w0[2] += 1e-3;
  assert_true(fabs(lp - lm) > 1e-9);
  ddp_ctx_destroy(c0);
  /* A regression head (num_labels 1): MSE on float labels. */
  ddp_model_destroy(m);
  m = model_of("{\"model_type\": \"bert\", \"num_hidden_layers\": 1, \"hidden_size\": 16, "
               "\"num_attention_heads\": 2, \"intermediate_size\": 24, \"vocab_size\": 256, "
               "\"num_labels\": 1, \"hidden_dropout_prob\": 0, \"hidden_act\": \"gelu_new\", "
               "\"attention_probs_dropout_prob\": 0, \"initializer_range\": 0.4}",
               DDP_F64);
  assert_int_equal(ddp_model_init(m, 4), DDP_OK);
  bert_batch(&b, 3, 7, 2, true, true, 2);
  const probe_t rp[] = {{"classifier.weight", 3},
                        {"bert.pooler.dense.bias", 2},
                        {"bert.encoder.layer.0.intermediate.dense.bias", 20}};
  gradcheck(m, &b, rp, NELEM(rp));
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* Forward-time errors name the key: T > n_positions / max_position_embeddings, ids outside
 * vocab_size and type_vocab_size, bad masks and shapes. */
static void test_forward_errors(void **state) {
  (void)state;
  ddp_model_t *g = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32);
  ddp_model_t *b = model_of(cfg_text(BERT_JSON, NULL), DDP_F32);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t ids[2 * 65];
  for (int k = 0; k < 2 * 65; k++) ids[k] = k % 7;
  ddp_var_t *x, *y;
  int64_t s[3] = {2, 65, 0};
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, s, ids, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(g, c, x, 0, &y), c, "sequence length 65", "n_positions = 64");
  expect_ctx_err(ddp_model_forward(b, c, x, 0, &y), c, "sequence length 65",
                 "max_position_embeddings = 64");
  s[1] = 8;
  ids[11] = 256;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, s, ids, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(g, c, x, 0, &y), c, "token id 256 at [1, 3]",
                 "vocab_size = 256");
  expect_ctx_err(ddp_model_forward(b, c, x, 0, &y), c, "token id 256", "vocab_size = 256");
  ids[11] = -1;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, s, ids, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(g, c, x, 0, &y), c, "token id -1", NULL);
  /* BERT rows: [B, 3, T] with a token type 2 (type_vocab_size 2), a mask value 5. */
  batch_t bt;
  bert_batch(&bt, 2, 8, 3, false, false, 1);
  bt.x[2 * 8 + 3] = 2;
  assert_int_equal(ddp_var_new(c, DDP_I64, 3, bt.shape, bt.x, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(b, c, x, 0, &y), c, "token_type_id 2", "type_vocab_size = 2");
  bt.x[2 * 8 + 3] = 0;
  bt.x[8 + 1] = 5;
  assert_int_equal(ddp_var_new(c, DDP_I64, 3, bt.shape, bt.x, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(b, c, x, 0, &y), c,
                 "attention_mask value 5 at [0, 1] must be 0 or 1", NULL);
  int64_t s4[3] = {2, 4, 8};
  assert_int_equal(ddp_var_new(c, DDP_I64, 3, s4, NULL, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(b, c, x, 0, &y), c, "[B, 2, T]", NULL);
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, s, NULL, false, &x), DDP_OK);
  expect_ctx_err(ddp_model_forward(g, c, x, 0, &y), c, "I64 [B, T]", NULL);
  ddp_ctx_destroy(c);
  ddp_model_destroy(g);
  ddp_model_destroy(b);
}

/* ---------------------------------------------------------------- checkpoints ----- */

static void expect_same_params(ddp_model_t *a, ddp_model_t *b) {
  assert_int_equal(ddp_model_num_params(a), ddp_model_num_params(b));
  for (size_t i = 0; i < ddp_model_num_params(a); i++) {
    ddp_param_t *p = ddp_model_param(a, i), *q = ddp_model_param(b, i);
    assert_string_equal(p->name, q->name);
    for (int64_t k = 0; k < p->value.numel; k++)
      if (getv(p->value.data, p->value.dtype, k) != getv(q->value.data, q->value.dtype, k))
        fail_msg("%s[%lld] differs", p->name, (long long)k);
  }
}

/* save_pretrained -> from_pretrained: config.json and model.safetensors (metadata format pt,
 * no tied lm_head.weight), the same values (also into another dtype), created parents. */
static void test_pretrained_roundtrip(void **state) {
  (void)state;
  const char *cfgs[3] = {cfg_text(GPT2_JSON, NULL), NULL, NULL};
  char b[1024], u[1024];
  snprintf(b, sizeof b, BERT_JSON, ", \"pad_token_id\": 1");
  snprintf(u, sizeof u, GPT2_JSON, ", \"tie_word_embeddings\": false, \"n_inner\": 80");
  cfgs[1] = b;
  cfgs[2] = u;
  for (int k = 0; k < 3; k++) {
    ddp_dtype_t dt = k == 1 ? DDP_F64 : DDP_F32;
    ddp_model_t *m = model_of(cfgs[k], dt), *m2, *m3;
    assert_int_equal(ddp_model_init(m, 9), DDP_OK);
    char dir[400], path[512];
    snprintf(dir, sizeof dir, "%s/rt%d/nested/dir", g_dir, k);
    ddp_error_t err = {0};
    if (ddp_model_save_pretrained(m, dir, &err) != DDP_OK) fail_msg("%s", err.msg);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ddp_st_file_t *f;
    assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, NULL), DDP_OK);
    assert_string_equal(ddp_st_meta_get(f, "format"), "pt");
    assert_int_equal(ddp_st_count(f), ddp_model_num_params(m));
    size_t idx;
    assert_int_equal(ddp_st_find(f, "lm_head.weight", &idx) == DDP_OK, k == 2);
    ddp_st_close(f);
    if (ddp_model_from_pretrained(dir, dt, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
    expect_same_params(m, m2);
    assert_memory_equal(ddp_model_hf_config(m), ddp_model_hf_config(m2), sizeof(ddp_hf_config_t));
    assert_int_equal(ddp_model_from_pretrained(dir, dt == DDP_F32 ? DDP_F64 : DDP_F32, &m3, &err),
                     DDP_OK);
    assert_int_equal(ddp_model_param(m3, 0)->value.dtype, dt == DDP_F32 ? DDP_F64 : DDP_F32);
    if (dt == DDP_F32) expect_same_params(m, m3);
    ddp_model_destroy(m);
    ddp_model_destroy(m2);
    ddp_model_destroy(m3);
  }
}

/* What loading tolerates, as Transformers does: the causal-mask and position_ids buffers, a
 * tied lm_head.weight of the right shape (wte's values win), base-model keys without the
 * prefix. */
static void test_pretrained_tolerated(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32), *m2;
  assert_int_equal(ddp_model_init(m, 2), DDP_OK);
  char dir[400];
  snprintf(dir, sizeof dir, "%s/tol_gpt2", g_dir);
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_save_pretrained(m, dir, &err), DDP_OK);
  static uint8_t mask[64 * 64];
  float masked = -1e4f;
  static float zeros[256 * 64];
  int64_t ms[4] = {1, 1, 64, 64}, zs[2] = {256, 64};
  ddp_tensor_t tm, tb, tz;
  ddp_tensor_view(&tm, DDP_BOOL, 4, ms, mask);
  ddp_tensor_view(&tb, DDP_F32, 0, NULL, &masked);
  ddp_tensor_view(&tz, DDP_F32, 2, zs, zeros);
  ddp_st_entry_t extra[3] = {{"transformer.h.0.attn.bias", &tm},
                             {"transformer.h.1.attn.masked_bias", &tb},
                             {"lm_head.weight", &tz}};
  write_weights(dir, m, NULL, NULL, extra, 3);
  if (ddp_model_from_pretrained(dir, DDP_F32, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
  expect_same_params(m, m2);
  ddp_model_destroy(m2);
  extra[0].name = "h.0.attn.bias";
  write_weights(dir, m, NULL, "transformer.", extra, 1);
  if (ddp_model_from_pretrained(dir, DDP_F32, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
  expect_same_params(m, m2);
  ddp_model_destroy(m2);
  ddp_model_destroy(m);

  m = model_of(cfg_text(BERT_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_init(m, 2), DDP_OK);
  snprintf(dir, sizeof dir, "%s/tol_bert", g_dir);
  assert_int_equal(ddp_model_save_pretrained(m, dir, &err), DDP_OK);
  static int64_t pos[64];
  for (int k = 0; k < 64; k++) pos[k] = k;
  int64_t ps[2] = {1, 64};
  ddp_tensor_t tp;
  ddp_tensor_view(&tp, DDP_I64, 2, ps, pos);
  ddp_st_entry_t pe = {"bert.embeddings.position_ids", &tp};
  write_weights(dir, m, NULL, NULL, &pe, 1);
  if (ddp_model_from_pretrained(dir, DDP_F32, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
  expect_same_params(m, m2);
  ddp_model_destroy(m2);
  ddp_model_destroy(m);
}

/* Strict loading otherwise, in PyTorch's words:
 * a missing key, an unexpected key, a size mismatch (the tied head's included), an unknown
 * model_type, no directory (test_transformers_torch checks PyTorch's text for the same). */
static void test_pretrained_errors(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32), *m2 = NULL;
  assert_int_equal(ddp_model_init(m, 2), DDP_OK);
  char dir[400], path[512];
  snprintf(dir, sizeof dir, "%s/bad_gpt2", g_dir);
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_save_pretrained(m, dir, &err), DDP_OK);
  const char *miss = "Missing key(s) in state_dict: \"transformer.ln_f.bias\". ";
  write_weights(dir, m, "transformer.ln_f.bias", NULL, NULL, 0);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "Error(s) in loading state_dict", miss, NULL);
  assert_null(m2);
  static float small[255 * 64];
  int64_t s1[2] = {32, 64}, s2[2] = {255, 64};
  ddp_tensor_t t1, t2;
  ddp_tensor_view(&t1, DDP_F32, 2, s1, small);
  ddp_tensor_view(&t2, DDP_F32, 2, s2, small);
  const char *size = "size mismatch for transformer.wpe.weight: copying a param with shape "
                     "torch.Size([32, 64]) from checkpoint, the shape in current model is "
                     "torch.Size([64, 64]).";
  ddp_st_entry_t e1 = {"transformer.wpe.weight", &t1};
  write_weights(dir, m, "transformer.wpe.weight", NULL, &e1, 1);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             size, NULL);
  const char *lm = "size mismatch for lm_head.weight: copying a param with shape "
                   "torch.Size([255, 64]) from checkpoint, the shape in current model is "
                   "torch.Size([256, 64]).";
  ddp_st_entry_t e2 = {"lm_head.weight", &t2};
  write_weights(dir, m, NULL, NULL, &e2, 1);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg, lm,
             NULL);
  const char *unexp = "Unexpected key(s) in state_dict: \"transformer.h.2.ln_1.weight\". ";
  ddp_st_entry_t e3 = {"transformer.h.2.ln_1.weight", &ddp_model_param(m, 2)->value};
  write_weights(dir, m, NULL, NULL, &e3, 1);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             unexp, NULL);
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *f = fopen(path, "wb");
  fputs("{\"model_type\": \"t5\", \"d_model\": 64}\n", f);
  fclose(f);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_ARGUMENT, err.msg,
             "config.json", "model_type", "t5", "gpt2, bert", NULL);
  snprintf(path, sizeof path, "%s/none", g_dir);
  expect_err(ddp_model_from_pretrained(path, DDP_F32, &m2, &err), DDP_ERR_NOT_FOUND, err.msg,
             "config.json", NULL);
  ddp_model_destroy(m);
}

/* ---------------------------------------------------------------- sharded --------- */

/* Transformers' convert_file_size_to_int; anything else names the parameter. */
static void test_file_size(void **state) {
  (void)state;
  static const struct {
    const char *text;
    int64_t bytes;
  } ok[] = {{"5GB", 5000000000LL}, {"10MB", 10000000},  {"100KB", 100000},
            {"100kb", 12500},      {"2GiB", 1LL << 31}, {"64MiB", 64 << 20},
            {"512KiB", 512 << 10}, {"40Mb", 5000000},   {"12345", 12345}};
  for (size_t i = 0; i < NELEM(ok); i++) {
    int64_t b = 0;
    ddp_error_t err = {0};
    if (ddp_parse_file_size(ok[i].text, "max_shard_size", &b, &err) != DDP_OK)
      fail_msg("%s: %s", ok[i].text, err.msg);
    assert_int_equal(b, ok[i].bytes);
  }
  static const char *bad[] = {"",  "GB",    "10XB", "5 GB",         "-5GB",
                              "0", "1.5GB", "7b",   "99999999999GB"};
  for (size_t i = 0; i < NELEM(bad); i++) {
    int64_t b = 0;
    ddp_error_t err = {0};
    expect_err(ddp_parse_file_size(bad[i], "--max_shard_size", &b, &err), DDP_ERR_INVALID_ARGUMENT,
               err.msg, "--max_shard_size", "not a valid size", "'5GB'", NULL);
    char quoted[64];
    snprintf(quoted, sizeof quoted, "'%s'", bad[i]);
    expect_err(DDP_ERR_INVALID_ARGUMENT, DDP_ERR_INVALID_ARGUMENT, err.msg, quoted, NULL);
  }
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("cannot open %s", path);
  static char text[1 << 17];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  return text;
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static bool exists(const char *dir, const char *file) {
  char path[600];
  struct stat sb;
  snprintf(path, sizeof path, "%s/%s", dir, file);
  return stat(path, &sb) == 0;
}

/* A Llama of about 500 KB in 100 KB shards: the files and index Transformers' shard_checkpoint
 * gives (greedy in state_dict order, sorted keys, indent 2), every tensor where the index says,
 * and from_pretrained reads it back; GPT-2 (tied head) through the same code; a later save of
 * the other layout removes the stale files. */
static void test_pretrained_sharded(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(LLAMA_JSON, NULL), DDP_F32), *m2;
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);
  char dir[400], path[600];
  snprintf(dir, sizeof dir, "%s/sharded", g_dir);
  ddp_error_t err = {0};
  const int64_t cap = 100000;
  if (ddp_model_save_pretrained_sharded(m, dir, cap, &err) != DDP_OK) fail_msg("%s", err.msg);
  /* The expected layout, computed here from the rule. */
  size_t np = ddp_model_num_params(m), shard[128], nshards = 1, in = 0;
  int64_t block = 0, total = 0;
  for (size_t i = 0; i < np; i++) {
    int64_t b = (int64_t)ddp_tensor_nbytes(&ddp_model_param(m, i)->value);
    if (block + b > cap && in > 0) nshards++, block = 0, in = 0;
    shard[i] = nshards - 1;
    block += b, total += b, in++;
  }
  assert_true(nshards >= 4);
  assert_false(exists(dir, "model.safetensors"));
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  char *text = read_text(path), head[256];
  snprintf(head, sizeof head,
           "{\n  \"metadata\": {\n    \"total_size\": %lld\n  },\n  \"weight_map\": {\n    "
           "\"lm_head.weight\": \"model-%05zu-of-%05zu.safetensors\",\n    "
           "\"model.embed_tokens.weight\": \"model-00001-of-%05zu.safetensors\",\n",
           (long long)total, nshards, nshards, nshards);
  if (strncmp(text, head, strlen(head))) fail_msg("index starts\n%.300s\nexpected\n%s", text, head);
  assert_string_equal(text + strlen(text) - 7, "\n  }\n}\n");
  cJSON *j = cJSON_Parse(text);
  cJSON *map = cJSON_GetObjectItem(j, "weight_map");
  assert_int_equal(cJSON_GetArraySize(map), np);
  for (size_t i = 0; i < np; i++) {
    const char *name = ddp_model_param(m, i)->name;
    char want[64];
    snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", shard[i] + 1, nshards);
    assert_string_equal(cJSON_GetObjectItem(map, name)->valuestring, want);
    ddp_st_file_t *f;
    snprintf(path, sizeof path, "%s/%s", dir, want);
    assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, NULL), DDP_OK);
    assert_string_equal(ddp_st_meta_get(f, "format"), "pt");
    size_t at;
    assert_int_equal(ddp_st_find(f, name, &at), DDP_OK);
    ddp_st_close(f);
  }
  cJSON_Delete(j);
  if (ddp_model_from_pretrained(dir, DDP_F32, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
  expect_same_params(m, m2);
  ddp_model_destroy(m2);
  /* One file: the index and the shards go; sharded again: model.safetensors goes. */
  assert_int_equal(ddp_model_save_pretrained(m, dir, &err), DDP_OK);
  assert_true(exists(dir, "model.safetensors"));
  assert_false(exists(dir, "model.safetensors.index.json"));
  assert_false(exists(dir, "model-00001-of-00004.safetensors") ||
               exists(dir, "model-00001-of-00005.safetensors") ||
               exists(dir, "model-00001-of-00006.safetensors"));
  assert_int_equal(ddp_model_save_pretrained_sharded(m, dir, 200000, &err), DDP_OK);
  assert_false(exists(dir, "model.safetensors"));
  assert_int_equal(ddp_model_save_pretrained_sharded(m, dir, cap, &err), DDP_OK);
  char last[64];
  snprintf(last, sizeof last, "model-%05zu-of-%05zu.safetensors", nshards, nshards);
  assert_true(exists(dir, last));
  DIR *d = opendir(dir);
  size_t files = 0;
  for (struct dirent *e; (e = readdir(d));) files += e->d_name[0] != '.';
  closedir(d);
  assert_int_equal(files, nshards + 2); /* + config.json and the index */
  expect_err(ddp_model_save_pretrained_sharded(m, dir, 0, &err), DDP_ERR_INVALID_ARGUMENT, err.msg,
             "max_shard_size", NULL);
  ddp_model_destroy(m);

  m = model_of(cfg_text(GPT2_JSON, NULL), DDP_F32);
  assert_int_equal(ddp_model_init(m, 6), DDP_OK);
  snprintf(dir, sizeof dir, "%s/sharded_gpt2", g_dir);
  assert_int_equal(ddp_model_save_pretrained_sharded(m, dir, 30000, &err), DDP_OK);
  assert_true(exists(dir, "model.safetensors.index.json"));
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  assert_null(strstr(read_text(path), "lm_head.weight")); /* tied: not saved */
  if (ddp_model_from_pretrained(dir, DDP_F32, &m2, &err) != DDP_OK) fail_msg("%s", err.msg);
  expect_same_params(m, m2);
  ddp_model_destroy(m2);
  ddp_model_destroy(m);
}

/* Rewrites DIR/FILE without tensor `drop` and with `add` (NULL: none). */
static void rewrite_shard(const char *dir, const char *file, const char *drop,
                          const ddp_st_entry_t *add) {
  char path[600];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  ddp_st_file_t *f;
  assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, NULL), DDP_OK);
  ddp_st_entry_t es[64];
  ddp_tensor_t ts[64];
  size_t n = 0;
  for (size_t i = 0; i < ddp_st_count(f); i++) {
    if (drop && !strcmp(ddp_st_name(f, i), drop)) continue;
    assert_int_equal(ddp_st_tensor(f, i, &ts[n]), DDP_OK);
    es[n] = (ddp_st_entry_t){ddp_st_name(f, i), &ts[n]};
    n++;
  }
  if (add) es[n++] = *add;
  const char *mk[1] = {"format"}, *mv[1] = {"pt"};
  ddp_error_t err = {0};
  if (ddp_st_write(path, es, n, mk, mv, 1, &err) != DDP_OK) fail_msg("%s", err.msg);
  ddp_st_close(f);
}

/* Sets weight_map[name] to file (NULL: removes the entry). */
static void edit_index(const char *dir, const char *name, const char *file) {
  char path[600];
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  cJSON *j = cJSON_Parse(read_text(path)), *map = cJSON_GetObjectItem(j, "weight_map");
  cJSON_DeleteItemFromObjectCaseSensitive(map, name);
  if (file) cJSON_AddStringToObject(map, name, file);
  char *t = cJSON_Print(j);
  write_text(path, t);
  cJSON_free(t);
  cJSON_Delete(j);
}

/* A sharded directory is checked whole, strictly, before anything is copied: each error
 * names the file and the tensor. */
static void test_pretrained_sharded_errors(void **state) {
  (void)state;
  ddp_model_t *m = model_of(cfg_text(LLAMA_JSON, NULL), DDP_F32), *m2 = NULL;
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);
  char dir[400], path[600];
  snprintf(dir, sizeof dir, "%s/sharded_bad", g_dir);
  ddp_error_t err = {0};
  const char *first = "model-00001-of-00006.safetensors",
             *last = "model-00006-of-00006.safetensors";
  const char *norm = "model-00005-of-00006.safetensors"; /* model.norm.weight's; lm_head: last */
#define RESAVE() assert_int_equal(ddp_model_save_pretrained_sharded(m, dir, 100000, &err), DDP_OK)
  RESAVE();
  assert_true(exists(dir, last));
  /* A file the index names is absent. */
  snprintf(path, sizeof path, "%s/%s", dir, last);
  assert_int_equal(unlink(path), 0);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_NOT_FOUND, err.msg,
             "model.safetensors.index.json names model-00006-of-00006.safetensors",
             "(for tensor 'lm_head.weight')", "which is not in", dir, NULL);
  assert_null(m2);
  /* A tensor in another file than the index says. */
  RESAVE();
  edit_index(dir, "model.norm.weight", first);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "tensor 'model.norm.weight' is in", norm, "but", "puts it in", first, NULL);
  /* A tensor the index does not list. */
  RESAVE();
  edit_index(dir, "model.norm.weight", NULL);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "tensor 'model.norm.weight' in", norm, "is not in the weight_map of",
             "model.safetensors.index.json", NULL);
  /* A tensor the index lists in a file that lacks it. */
  RESAVE();
  edit_index(dir, "model.layers.0.mlp.extra.weight", first);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "puts tensor 'model.layers.0.mlp.extra.weight' in", first, "does not hold it", NULL);
  /* A model tensor absent from both: PyTorch's strict wording, naming the index. */
  RESAVE();
  rewrite_shard(dir, norm, "model.norm.weight", NULL);
  edit_index(dir, "model.norm.weight", NULL);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "Error(s) in loading state_dict from", "model.safetensors.index.json",
             "Missing key(s) in state_dict: \"model.norm.weight\". ", NULL);
  /* An extra tensor in both. */
  RESAVE();
  ddp_st_entry_t extra = {"model.layers.2.input_layernorm.weight", &ddp_model_param(m, 1)->value};
  rewrite_shard(dir, first, NULL, &extra);
  edit_index(dir, extra.name, first);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "Unexpected key(s) in state_dict: \"model.layers.2.input_layernorm.weight\". ", NULL);
  /* A malformed index, and a file name that leaves the directory. */
  RESAVE();
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  write_text(path, "{\"metadata\": {}}");
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "model.safetensors.index.json has no \"weight_map\"", NULL);
  RESAVE();
  edit_index(dir, "model.norm.weight", "../model-00006-of-00006.safetensors");
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_INVALID_DATA, err.msg,
             "weight_map[\"model.norm.weight\"]", "not a file name in", NULL);
  /* Neither layout. */
  RESAVE();
  assert_int_equal(unlink(path), 0);
  expect_err(ddp_model_from_pretrained(dir, DDP_F32, &m2, &err), DDP_ERR_NOT_FOUND, err.msg,
             "no file named model.safetensors or model.safetensors.index.json", dir, NULL);
  assert_null(m2);
#undef RESAVE
  ddp_model_destroy(m);
}

/* ddp_model_from_json: a top-level "model_type" is a Transformers config; other models have
 * no HF config and the default task; ddp_model_save_pretrained refuses them. */
static void test_model_json_dispatch(void **state) {
  (void)state;
  ddp_model_t *m;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(cfg_text(BERT_JSON, ", \"torch_dtype\": \"float64\""), &m,
                                       &err),
                   DDP_OK);
  assert_int_equal(ddp_model_task(m), DDP_TASK_SEQ_CLASSIFICATION);
  assert_int_equal(ddp_model_param(m, 0)->value.dtype, DDP_F64);
  assert_int_equal(ddp_model_hf_config(m)->bert.num_labels, 3);
  ddp_model_destroy(m);
  assert_int_equal(ddp_model_from_json(
                       "{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 3}]}", &m, &err),
                   DDP_OK);
  assert_int_equal(ddp_model_task(m), DDP_TASK_DEFAULT);
  assert_null(ddp_model_hf_config(m));
  char dir[400];
  snprintf(dir, sizeof dir, "%s/mlp", g_dir);
  expect_err(ddp_model_save_pretrained(m, dir, &err), DDP_ERR_INVALID_ARGUMENT, err.msg,
             "not a Transformers model", NULL);
  ddp_model_destroy(m);
}

static int setup(void **state) {
  (void)state;
  snprintf(g_dir, sizeof g_dir, "/tmp/ddp_transformers_XXXXXX");
  return mkdtemp(g_dir) ? 0 : 1;
}

static int teardown(void **state) {
  (void)state;
  char line[512];
  snprintf(line, sizeof line, "rm -rf '%s'", g_dir);
  return system(line) == 0 ? 0 : 1;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_config_defaults),
      cmocka_unit_test(test_config_errors),
      cmocka_unit_test(test_config_write_roundtrip),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_init),
      cmocka_unit_test(test_gradcheck),
      cmocka_unit_test(test_forward_errors),
      cmocka_unit_test(test_pretrained_roundtrip),
      cmocka_unit_test(test_pretrained_tolerated),
      cmocka_unit_test(test_pretrained_errors),
      cmocka_unit_test(test_file_size),
      cmocka_unit_test(test_pretrained_sharded),
      cmocka_unit_test(test_pretrained_sharded_errors),
      cmocka_unit_test(test_model_json_dispatch),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
