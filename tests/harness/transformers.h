/* Shared pieces of tests/test_transformers.c and tests/test_transformers_torch.c: the tiny
 * GPT-2 and BERT configs, models built from config text, token batches, the gradient-hook
 * recorder, one training step, checkpoint variants. Header-only (static inline), for
 * parent-side CMocka code: include it after cmocka.h and ddp/nn.h. */
#ifndef DDP_TEST_TRANSFORMERS_H
#define DDP_TEST_TRANSFORMERS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/nn.h"

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

/* GPT-2: n_layer 2, n_embd 64, n_head 4, vocab 256, n_positions 64; BERT: 2 layers, hidden 64,
 * 4 heads, intermediate 128, vocab 256, max_position 64, num_labels 3; dropout 0. "%s" takes
 * extra members (", \"key\": value"). */
#define GPT2_JSON                                                                     \
  "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_embd\": 64, \"n_head\": 4, "        \
  "\"vocab_size\": 256, \"n_positions\": 64, \"resid_pdrop\": 0, \"embd_pdrop\": 0, " \
  "\"attn_pdrop\": 0%s}"
#define BERT_JSON                                                                    \
  "{\"model_type\": \"bert\", \"num_hidden_layers\": 2, \"hidden_size\": 64, "       \
  "\"num_attention_heads\": 4, \"intermediate_size\": 128, \"vocab_size\": 256, "    \
  "\"max_position_embeddings\": 64, \"num_labels\": 3, \"hidden_dropout_prob\": 0, " \
  "\"attention_probs_dropout_prob\": 0%s}"

/* Llama: hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim 16), vocab 256, intermediate 172,
 * rope_theta 10000, max_position 32 (the tiny Llama). */
#define LLAMA_JSON                                                                \
  "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "   \
  "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256, " \
  "\"intermediate_size\": 172, \"rope_theta\": 10000, \"max_position_embeddings\": 32%s}"

/* The config text of GPT2_JSON / BERT_JSON with extra members (", \"k\": v") appended. */
static inline const char *cfg_text(const char *fmt, const char *extra) {
  static char buf[1024];
  snprintf(buf, sizeof buf, fmt, extra ? extra : "");
  return buf;
}

static inline ddp_model_t *model_of(const char *json, ddp_dtype_t dt) {
  ddp_hf_config_t cfg;
  ddp_error_t err = {0};
  if (ddp_hf_config_parse(json, NULL, &cfg, &err) != DDP_OK) fail_msg("parse: %s", err.msg);
  ddp_model_t *m;
  if (ddp_model_from_hf_config(&cfg, dt, &m, &err) != DDP_OK) fail_msg("build: %s", err.msg);
  return m;
}

/* Token batches. GPT-2: ids [B, T] in [0, 256), labels a copy with every 5th -100. BERT:
 * rows 1 ([B, T] ids), 2 (+ attention_mask) or 3 (+ token_type_ids); with pad, row b keeps
 * T - 2 b tokens and the rest are pad_token_id (0) with mask 0 (without pad, every 7th
 * token from the 6th is pad_token_id, attended); labels (b² + 1) % 3 (I64) or, for a
 * regression head, floats. */
typedef struct batch {
  int nd;
  int64_t shape[3];
  int64_t x[3 * 4 * 64];
  int lnd;
  int64_t lshape[2];
  ddp_dtype_t ldt;
  union {
    int64_t i[4 * 64];
    double f[4 * 64];
  } labels;
} batch_t;

static inline void gpt2_batch(batch_t *b, int64_t B, int64_t T, uint64_t seed) {
  ddp_rng_t r;
  ddp_rng_init(&r, seed, 9);
  memset(b, 0, sizeof *b);
  b->nd = 2;
  b->shape[0] = B;
  b->shape[1] = T;
  b->lnd = 2;
  b->lshape[0] = B;
  b->lshape[1] = T;
  b->ldt = DDP_I64;
  for (int64_t k = 0; k < B * T; k++) {
    b->x[k] = ddp_rng_u32(&r) % 256;
    b->labels.i[k] = k % 5 == 3 ? -100 : b->x[k];
  }
}

static inline void bert_batch(batch_t *b, int64_t B, int64_t T, int rows, bool pad, bool regression,
                              uint64_t seed) {
  ddp_rng_t r;
  ddp_rng_init(&r, seed, 9);
  memset(b, 0, sizeof *b);
  b->nd = rows == 1 ? 2 : 3;
  b->shape[0] = B;
  b->shape[1] = rows == 1 ? T : rows;
  b->shape[2] = T;
  b->lnd = 1;
  b->lshape[0] = B;
  b->ldt = regression ? DDP_F64 : DDP_I64;
  for (int64_t i = 0; i < B; i++) {
    int64_t len = pad ? T - 2 * i : T;
    for (int64_t t = 0; t < T; t++) {
      int64_t *row = b->x + i * (rows == 1 ? 1 : rows) * T;
      row[t] = t < len ? 1 + ddp_rng_u32(&r) % 255 : 0;
      if (!pad && t % 7 == 5) row[t] = 0; /* attended pad ids: padding_idx shows */
      if (rows > 1) row[T + t] = t < len;
      if (rows > 2) row[2 * T + t] = t >= len / 2 && t < len;
    }
    if (regression)
      b->labels.f[i] = ddp_rng_uniform_f64(&r) * 2 - 1;
    else
      b->labels.i[i] = (i * i + 1) % 3; /* unequal class counts: no cancelling bias gradient */
  }
}

typedef struct order {
  size_t idx[256];
  int n;
} order_t;

static inline void on_ready(void *user, ddp_param_t *p, int fire) {
  order_t *o = user;
  (void)fire;
  if (o->n < 256) o->idx[o->n++] = p->index;
}

/* One forward (training mode) + loss + backward; returns the loss var, logits in *logits. */
static inline ddp_var_t *step(ddp_model_t *m, ddp_ctx_t *c, const batch_t *b, bool grad,
                              ddp_var_t **logits) {
  ddp_var_t *x, *l, *y, *loss;
  ddp_ctx_reset(c);
  ddp_ctx_set_grad_enabled(c, grad);
  assert_int_equal(ddp_var_new(c, DDP_I64, b->nd, b->shape, b->x, false, &x), DDP_OK);
  assert_int_equal(ddp_var_new(c, b->ldt, b->lnd, b->lshape, &b->labels, false, &l), DDP_OK);
  const char *what = NULL;
  if (ddp_model_forward(m, c, x, 0, &y) != DDP_OK)
    what = "forward";
  else if (ddp_model_loss(m, c, y, l, &loss) != DDP_OK)
    what = "loss";
  else if (grad && ddp_backward(c, loss) != DDP_OK)
    what = "backward";
  if (what) {
    ddp_error_t e;
    ddp_ctx_last_error_copy(c, &e);
    fail_msg("%s: %s", what, e.msg);
  }
  if (logits) *logits = y;
  return loss;
}

static inline double getv(const void *p, ddp_dtype_t dt, int64_t k) {
  return dt == DDP_F32 ? ((const float *)p)[k] : ((const double *)p)[k];
}

static inline void mkdirs(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

/* Rewrites DIR/model.safetensors from m's parameters: without `drop`, names stripped of
 * `strip`, plus extra entries. */
static inline void write_weights(const char *dir, ddp_model_t *m, const char *drop,
                                 const char *strip, const ddp_st_entry_t *extra, size_t nextra) {
  ddp_st_entry_t es[128];
  char names[128][128];
  size_t n = 0;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (drop && !strcmp(p->name, drop)) continue;
    size_t sl = strip && !strncmp(p->name, strip, strlen(strip)) ? strlen(strip) : 0;
    snprintf(names[n], sizeof names[n], "%s", p->name + sl);
    es[n].name = names[n];
    es[n].tensor = &p->value;
    n++;
  }
  for (size_t i = 0; i < nextra; i++) es[n++] = extra[i];
  char path[512];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  ddp_error_t err = {0};
  if (ddp_st_write(path, es, n, NULL, NULL, 0, &err) != DDP_OK) fail_msg("%s", err.msg);
}

#endif /* DDP_TEST_TRANSFORMERS_H */
