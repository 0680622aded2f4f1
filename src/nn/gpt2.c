/* GPT-2 as Transformers' GPT2LMHeadModel: the parameters in its registration order with its
 * state_dict names, its forward (pre-LN blocks, learned positions, tied lm_head) and its
 * _init_weights (spec/transformers.md, docs/nn.md "Transformers").
 *
 * Parameters, in parameters() order (C = n_embd, I = n_inner or 4 C, V = vocab_size):
 *   transformer.wte.weight [V, C], transformer.wpe.weight [n_positions, C],
 *   per block i: transformer.h.i.ln_1.{weight,bias} [C], attn.c_attn.{weight [C, 3C], bias},
 *   attn.c_proj.{weight [C, C], bias}, ln_2.{weight,bias}, mlp.c_fc.{weight [C, I], bias},
 *   mlp.c_proj.{weight [I, C], bias}; transformer.ln_f.{weight,bias};
 *   lm_head.weight [V, C] only when tie_word_embeddings is false (tied, the head uses wte: one
 *   parameter used twice, whose gradient-ready hook fires once, after the embedding's use).
 * Conv1D weights are stored [in, out] (ddp_conv1d). */
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

/* Parameter indices of one block; each LayerNorm's bias follows its weight. */
typedef struct block {
  size_t ln_1, c_attn_w, c_attn_b, attn_proj_w, attn_proj_b, ln_2, c_fc_w, c_fc_b, mlp_proj_w,
      mlp_proj_b;
} block_t;

typedef struct gpt2 {
  ddp_hf_config_t hf; /* first member: ddp_model_hf_config reads it */
  ddp_model_t *m;
  ddp_act_t act;
  size_t wte, wpe, ln_f, lm_head; /* lm_head == wte when tied */
  block_t *h;
  unsigned char *role; /* ddp__init_role_t per parameter */
} gpt2_t;

static void gpt2_destroy(void *state) {
  gpt2_t *g = state;
  if (!g) return;
  ddp__free(g->h);
  ddp__free(g->role);
  ddp__free(g);
}

/* ---------------------------------------------------------------- forward --------- */

static ddp_status_t ln(ddp_ctx_t *c, gpt2_t *g, size_t w, ddp_var_t *x, ddp_var_t **y) {
  ddp_var_t *wv, *bv;
  DDP_CHECK(ddp__pvar(c, g->m, w, &wv));
  DDP_CHECK(ddp__pvar(c, g->m, w + 1, &bv));
  return ddp_layer_norm(c, x, wv, bv, g->hf.gpt2.layer_norm_epsilon, y);
}

static ddp_status_t conv1d(ddp_ctx_t *c, gpt2_t *g, size_t w, size_t b, ddp_var_t *x,
                           ddp_var_t **y) {
  ddp_var_t *wv, *bv;
  DDP_CHECK(ddp__pvar(c, g->m, w, &wv));
  DDP_CHECK(ddp__pvar(c, g->m, b, &bv));
  return ddp_conv1d(c, x, wv, bv, y);
}

/* One pre-LN block: h + attn(ln_1(h)), then that + mlp(ln_2(that)). */
static ddp_status_t block_forward(ddp_ctx_t *c, gpt2_t *g, int64_t layer, ddp_var_t *h,
                                  bool training, ddp_var_t **out) {
  const ddp_gpt2_config_t *cfg = &g->hf.gpt2;
  const block_t *b = &g->h[layer];
  ddp_var_t *a, *q, *k, *v, *r;
  DDP_CHECK(ln(c, g, b->ln_1, h, &a));
  DDP_CHECK(conv1d(c, g, b->c_attn_w, b->c_attn_b, a, &a));
  DDP_CHECK(ddp_split_heads(c, a, cfg->n_head, &q, &k, &v));
  double scale = cfg->scale_attn_weights ? 1.0 / sqrt((double)(cfg->n_embd / cfg->n_head)) : 1.0;
  if (cfg->scale_attn_by_inverse_layer_idx) scale /= (double)(layer + 1);
  DDP_CHECK(ddp_attention(c, q, k, v, NULL, true, scale, cfg->attn_pdrop, training, &a));
  DDP_CHECK(ddp_merge_heads(c, a, &a));
  DDP_CHECK(conv1d(c, g, b->attn_proj_w, b->attn_proj_b, a, &a));
  DDP_CHECK(ddp_dropout(c, a, cfg->resid_pdrop, training, &a));
  DDP_CHECK(ddp_add(c, a, h, &r));
  DDP_CHECK(ln(c, g, b->ln_2, r, &a));
  DDP_CHECK(conv1d(c, g, b->c_fc_w, b->c_fc_b, a, &a));
  DDP_CHECK(ddp_activation(c, g->act, a, &a));
  DDP_CHECK(conv1d(c, g, b->mlp_proj_w, b->mlp_proj_b, a, &a));
  DDP_CHECK(ddp_dropout(c, a, cfg->resid_pdrop, training, &a));
  return ddp_add(c, r, a, out);
}

static ddp_status_t gpt2_forward(void *state, ddp_ctx_t *c, ddp_var_t *x, bool training,
                                 ddp_var_t **y) {
  gpt2_t *g = state;
  const ddp_gpt2_config_t *cfg = &g->hf.gpt2;
  char sx[128];
  if (x->value.dtype != DDP_I64 || x->value.ndim != 2 || x->value.numel == 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "gpt2: input_ids must be non-empty I64 [B, T] (got %s)",
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  int64_t T = x->value.shape[1];
  if (T > cfg->n_positions)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "gpt2: sequence length %lld exceeds n_positions = %lld (the longest "
                          "sequence the position embeddings cover)",
                          (long long)T, (long long)cfg->n_positions);
  const int64_t *ids = x->value.data;
  for (int64_t i = 0; i < x->value.numel; i++)
    if (ids[i] < 0 || ids[i] >= cfg->vocab_size)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "gpt2: token id %lld at [%lld, %lld] is out of range for vocab_size = "
                            "%lld",
                            (long long)ids[i], (long long)(i / T), (long long)(i % T),
                            (long long)cfg->vocab_size);
  ddp_var_t *pos, *wte, *wpe, *tok, *pe, *h, *head;
  DDP_CHECK(ddp_var_new(c, DDP_I64, 1, &T, NULL, false, &pos));
  for (int64_t t = 0; t < T; t++) ((int64_t *)pos->value.data)[t] = t;
  DDP_CHECK(ddp__pvar(c, g->m, g->wte, &wte));
  DDP_CHECK(ddp__pvar(c, g->m, g->wpe, &wpe));
  /* Transformers' order: token embeddings, then positions, then their sum. */
  DDP_CHECK(ddp_embedding(c, x, wte, &tok));
  DDP_CHECK(ddp_embedding(c, pos, wpe, &pe));
  DDP_CHECK(ddp_add(c, tok, pe, &h));
  DDP_CHECK(ddp_dropout(c, h, cfg->embd_pdrop, training, &h));
  for (int64_t l = 0; l < cfg->n_layer; l++) {
    DDP_CHECK(ddp__block_enter(c, g->m, (size_t)l, &h));
    DDP_CHECK(block_forward(c, g, l, h, training, &h));
    DDP_CHECK(ddp__block_leave(c, g->m, (size_t)l, &h));
  }
  DDP_CHECK(ln(c, g, g->ln_f, h, &h));
  DDP_CHECK(ddp__pvar(c, g->m, g->lm_head, &head));
  return ddp_linear(c, h, head, NULL, y);
}

static ddp_status_t gpt2_init(void *state, uint64_t seed) {
  gpt2_t *g = state;
  const ddp_gpt2_config_t *cfg = &g->hf.gpt2;
  ddp__hf_init(g->m, g->role, cfg->initializer_range,
               cfg->initializer_range / sqrt(2.0 * (double)cfg->n_layer), (size_t)-1, 0, seed);
  return DDP_OK;
}

static const ddp__family_t gpt2_family = {"gpt2",    DDP_TASK_CAUSAL_LM, gpt2_forward,
                                          gpt2_init, gpt2_destroy,       NULL};

/* ---------------------------------------------------------------- build ----------- */

typedef struct builder {
  gpt2_t *g;
  ddp_dtype_t dt;
  ddp_error_t *err;
  char name[256];
} builder_t;

/* Records the init roles of the last k (1 or 2) registered parameters. */
static void roles(builder_t *b, size_t k, ddp__init_role_t r0, ddp__init_role_t r1) {
  size_t n = ddp_model_num_params(b->g->m);
  b->g->role[n - k] = (unsigned char)r0;
  if (k == 2) b->g->role[n - 1] = (unsigned char)r1;
}

static ddp_status_t fail(builder_t *b, const char *what, ddp_status_t st) {
  return ddp__error(b->err, -1, st, "gpt2: cannot register %s", what);
}

/* "transformer.h.<i>.<leaf>" in b->name. */
static const char *nm(builder_t *b, int64_t i, const char *leaf) {
  snprintf(b->name, sizeof b->name, "transformer.h.%lld.%s", (long long)i, leaf);
  return b->name;
}

static ddp_status_t add_ln(builder_t *b, const char *prefix, size_t *idx) {
  ddp_module_t *mod;
  *idx = ddp_model_num_params(b->g->m);
  ddp_status_t st = ddp_module_layer_norm(b->g->m, prefix, b->g->hf.gpt2.n_embd,
                                          b->g->hf.gpt2.layer_norm_epsilon, b->dt, &mod);
  if (st != DDP_OK) return fail(b, prefix, st);
  roles(b, 2, DDP__INIT_ONE, DDP__INIT_ZERO);
  return DDP_OK;
}

/* Conv1D(nf, nx): weight [nx, nf], bias [nf]. */
static ddp_status_t add_conv1d(builder_t *b, const char *prefix, int64_t nx, int64_t nf,
                               ddp__init_role_t wrole, size_t *w, size_t *bias) {
  char n[300];
  int64_t ws[2] = {nx, nf};
  snprintf(n, sizeof n, "%s.weight", prefix);
  ddp_status_t st = ddp_model_add_param(b->g->m, n, b->dt, 2, ws, true, w);
  snprintf(n, sizeof n, "%s.bias", prefix);
  if (st == DDP_OK) st = ddp_model_add_param(b->g->m, n, b->dt, 1, &nf, true, bias);
  if (st != DDP_OK) return fail(b, prefix, st);
  roles(b, 2, wrole, DDP__INIT_ZERO);
  return DDP_OK;
}

static ddp_status_t add_embedding(builder_t *b, const char *prefix, int64_t num, size_t *idx) {
  ddp_module_t *mod;
  *idx = ddp_model_num_params(b->g->m);
  ddp_status_t st = ddp_module_embedding(b->g->m, prefix, num, b->g->hf.gpt2.n_embd, b->dt, &mod);
  if (st != DDP_OK) return fail(b, prefix, st);
  roles(b, 1, DDP__INIT_NORMAL, DDP__INIT_NORMAL);
  return DDP_OK;
}

ddp_status_t ddp__gpt2_build(ddp_model_t *m, const ddp_hf_config_t *hf, ddp_dtype_t dt,
                             ddp_error_t *err) {
  const ddp_gpt2_config_t *cfg = &hf->gpt2;
  gpt2_t *g = ddp__calloc(1, sizeof *g);
  if (!g) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "gpt2: out of memory");
  g->hf = *hf;
  g->hf.torch_dtype = dt;
  g->m = m;
  size_t nparams = 2 + 12 * (size_t)cfg->n_layer + 2 + (cfg->tie_word_embeddings ? 0 : 1);
  g->h = ddp__calloc((size_t)cfg->n_layer, sizeof *g->h);
  g->role = ddp__calloc(nparams, 1);
  ddp_module_t *root;
  /* The model owns g from here on: a failure below frees it with the model. */
  DDP_CHECK(ddp__module_family(m, &gpt2_family, g, &root));
  ddp_model_set_root(m, root);
  if (!g->h || !g->role)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY,
                      "gpt2: out of memory asking for %zu bytes for the %lld layers of n_layer",
                      (size_t)cfg->n_layer * sizeof *g->h + nparams, (long long)cfg->n_layer);
  if (!ddp__hf_activation(cfg->activation_function, &g->act))
    return ddp__error(err, -1, DDP_ERR_UNSUPPORTED, "gpt2: activation_function \"%s\" unknown",
                      cfg->activation_function);
  builder_t b = {g, dt, err, ""};
  int64_t C = cfg->n_embd, inner = cfg->n_inner ? cfg->n_inner : 4 * C;
  DDP_CHECK(add_embedding(&b, "transformer.wte", cfg->vocab_size, &g->wte));
  DDP_CHECK(add_embedding(&b, "transformer.wpe", cfg->n_positions, &g->wpe));
  for (int64_t i = 0; i < cfg->n_layer; i++) {
    block_t *k = &g->h[i];
    size_t first = ddp_model_num_params(m);
    DDP_CHECK(add_ln(&b, nm(&b, i, "ln_1"), &k->ln_1));
    DDP_CHECK(add_conv1d(&b, nm(&b, i, "attn.c_attn"), C, 3 * C, DDP__INIT_NORMAL, &k->c_attn_w,
                         &k->c_attn_b));
    DDP_CHECK(add_conv1d(&b, nm(&b, i, "attn.c_proj"), C, C, DDP__INIT_PROJ, &k->attn_proj_w,
                         &k->attn_proj_b));
    DDP_CHECK(add_ln(&b, nm(&b, i, "ln_2"), &k->ln_2));
    DDP_CHECK(
        add_conv1d(&b, nm(&b, i, "mlp.c_fc"), C, inner, DDP__INIT_NORMAL, &k->c_fc_w, &k->c_fc_b));
    DDP_CHECK(add_conv1d(&b, nm(&b, i, "mlp.c_proj"), inner, C, DDP__INIT_PROJ, &k->mlp_proj_w,
                         &k->mlp_proj_b));
    if (ddp__model_add_block(m, "GPT2Block", first, ddp_model_num_params(m) - first) != DDP_OK)
      return fail(&b, "transformer.h", DDP_ERR_NO_MEMORY);
  }
  DDP_CHECK(add_ln(&b, "transformer.ln_f", &g->ln_f));
  g->lm_head = g->wte;
  if (!cfg->tie_word_embeddings) {
    ddp_module_t *mod;
    g->lm_head = ddp_model_num_params(m);
    ddp_status_t st = ddp_module_linear(m, "lm_head", C, cfg->vocab_size, false, dt, &mod);
    if (st != DDP_OK) return fail(&b, "lm_head", st);
    roles(&b, 1, DDP__INIT_NORMAL, DDP__INIT_NORMAL);
  }
  DDP_REQUIRE(ddp_model_num_params(m) == nparams);
  return DDP_OK;
}

const ddp__hf_family_t ddp__gpt2_family = {DDP_HF_GPT2, ddp__gpt2_build};
