/* Llama as Transformers' LlamaForCausalLM (modeling_llama.py, 4.48): the parameters in its
 * registration order with its state_dict names, its forward (pre-RMSNorm blocks, rotary
 * positions, grouped-query attention, gated SiLU MLP, untied lm_head by default) and its
 * _init_weights (spec/transformers.md "Llama", docs/nn.md "Transformers").
 *
 * Parameters, in parameters() order (H = hidden_size, I = intermediate_size, V = vocab_size,
 * d = head_dim, nH / nKV = attention / key-value heads):
 *   model.embed_tokens.weight [V, H],
 *   per layer N: model.layers.N.self_attn.{q_proj [nH d, H], k_proj [nKV d, H],
 *   v_proj [nKV d, H], o_proj [H, nH d]}.weight (each followed by its bias with
 *   attention_bias), mlp.{gate_proj [I, H], up_proj [I, H], down_proj [H, I]}.weight (biases
 *   with mlp_bias), input_layernorm.weight [H], post_attention_layernorm.weight [H];
 *   model.norm.weight [H]; lm_head.weight [V, H] unless tie_word_embeddings (then the head
 *   uses embed_tokens: one parameter used twice).
 * LlamaDecoderLayer registers self_attn, mlp, input_layernorm, post_attention_layernorm in
 * that order, which is parameters()'s order. Linear weights are stored [out, in]. */
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

/* Parameter indices of one decoder layer; a bias is NONE when the config has none. */
typedef struct layer {
  size_t q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b;
  size_t gate_w, gate_b, up_w, up_b, down_w, down_b;
  size_t in_norm, post_norm;
} layer_t;

typedef struct llama {
  ddp_hf_config_t hf; /* first member: ddp_model_hf_config reads it */
  ddp_model_t *m;
  ddp_act_t act;
  int64_t head_dim;
  size_t embed, norm, lm_head; /* lm_head == embed when tied */
  layer_t *layers;
  unsigned char *role; /* ddp__init_role_t per parameter */
  float *inv_freq;     /* head_dim / 2, recomputed per forward (dynamic scaling) */
} llama_t;

static void llama_destroy(void *state) {
  llama_t *l = state;
  if (!l) return;
  ddp__free(l->layers);
  ddp__free(l->role);
  ddp__free(l->inv_freq);
  ddp__free(l);
}

static bool llama_is_norm(void *state, size_t index) {
  const llama_t *l = state;
  return index < ddp_model_num_params(l->m) && l->role[index] == DDP__INIT_ONE;
}

/* ---------------------------------------------------------------- forward --------- */

static ddp_status_t lin(ddp_ctx_t *c, llama_t *l, size_t w, size_t b, ddp_var_t *x, ddp_var_t **y) {
  ddp_var_t *wv, *bv = NULL;
  DDP_CHECK(ddp__pvar(c, l->m, w, &wv));
  if (b != NONE) DDP_CHECK(ddp__pvar(c, l->m, b, &bv));
  return ddp_linear(c, x, wv, bv, y);
}

static ddp_status_t rms(ddp_ctx_t *c, llama_t *l, size_t w, ddp_var_t *x, ddp_var_t **y) {
  ddp_var_t *wv;
  DDP_CHECK(ddp__pvar(c, l->m, w, &wv));
  return ddp_rms_norm(c, x, wv, l->hf.llama.rms_norm_eps, y);
}

/* LlamaAttention: q, k, v projections, heads, rotary on q then k, KV heads repeated, causal
 * softmax(q k^T * d^-0.5) v, heads merged, o_proj. */
static ddp_status_t attention(ddp_ctx_t *c, llama_t *l, const layer_t *L, ddp_var_t *x,
                              bool training, ddp_var_t **out) {
  const ddp_llama_config_t *cfg = &l->hf.llama;
  int64_t nH = cfg->num_attention_heads, nKV = cfg->num_key_value_heads;
  ddp_var_t *q, *k, *v, *a;
  DDP_CHECK(lin(c, l, L->q_w, L->q_b, x, &q));
  DDP_CHECK(lin(c, l, L->k_w, L->k_b, x, &k));
  DDP_CHECK(lin(c, l, L->v_w, L->v_b, x, &v));
  DDP_CHECK(ddp_to_heads(c, q, nH, &q));
  DDP_CHECK(ddp_to_heads(c, k, nKV, &k));
  DDP_CHECK(ddp_to_heads(c, v, nKV, &v));
  DDP_CHECK(ddp_rotary(c, q, l->inv_freq, &q));
  DDP_CHECK(ddp_rotary(c, k, l->inv_freq, &k));
  DDP_CHECK(ddp_repeat_kv(c, k, nH / nKV, &k));
  DDP_CHECK(ddp_repeat_kv(c, v, nH / nKV, &v));
  DDP_CHECK(ddp_attention(c, q, k, v, NULL, true, 1.0 / sqrt((double)l->head_dim),
                          cfg->attention_dropout, training, &a));
  DDP_CHECK(ddp_merge_heads(c, a, &a));
  return lin(c, l, L->o_w, L->o_b, a, out);
}

/* LlamaMLP: down_proj(act(gate_proj(x)) * up_proj(x)), in Transformers' evaluation order. */
static ddp_status_t mlp(ddp_ctx_t *c, llama_t *l, const layer_t *L, ddp_var_t *x, ddp_var_t **out) {
  ddp_var_t *g, *u;
  DDP_CHECK(lin(c, l, L->gate_w, L->gate_b, x, &g));
  DDP_CHECK(ddp_activation(c, l->act, g, &g));
  DDP_CHECK(lin(c, l, L->up_w, L->up_b, x, &u));
  DDP_CHECK(ddp_mul(c, g, u, &g));
  return lin(c, l, L->down_w, L->down_b, g, out);
}

static ddp_status_t llama_forward(void *state, ddp_ctx_t *c, ddp_var_t *x, bool training,
                                  ddp_var_t **y) {
  llama_t *l = state;
  const ddp_llama_config_t *cfg = &l->hf.llama;
  char sx[128];
  if (x->value.dtype != DDP_I64 || x->value.ndim != 2 || x->value.numel == 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "llama: input_ids must be non-empty I64 [B, T] (got %s)",
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  int64_t T = x->value.shape[1];
  const int64_t *ids = x->value.data;
  for (int64_t i = 0; i < x->value.numel; i++)
    if (ids[i] < 0 || ids[i] >= cfg->vocab_size)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "llama: token id %lld at [%lld, %lld] is out of range for vocab_size "
                            "= %lld",
                            (long long)ids[i], (long long)(i / T), (long long)(i % T),
                            (long long)cfg->vocab_size);
  /* Positions 0..T-1: the dynamic scaling's base depends on T (Transformers recomputes it
   * when the sequence outgrows max_position_embeddings). */
  ddp_rope_inv_freq(cfg->rope_theta, l->head_dim, &cfg->rope_scaling, cfg->max_position_embeddings,
                    T, l->inv_freq);
  ddp_var_t *emb, *h, *a, *head;
  DDP_CHECK(ddp__pvar(c, l->m, l->embed, &emb));
  if (cfg->pad_token_id >= 0) /* nn.Embedding(V, H, padding_idx=pad_token_id) */
    DDP_CHECK(ddp__embedding_padded(c, x, emb, cfg->pad_token_id, &h));
  else
    DDP_CHECK(ddp_embedding(c, x, emb, &h));
  for (int64_t i = 0; i < cfg->num_hidden_layers; i++) {
    const layer_t *L = &l->layers[i];
    DDP_CHECK(ddp__block_enter(c, l->m, (size_t)i, &h));
    DDP_CHECK(rms(c, l, L->in_norm, h, &a));
    DDP_CHECK(attention(c, l, L, a, training, &a));
    DDP_CHECK(ddp_add(c, h, a, &h));
    DDP_CHECK(rms(c, l, L->post_norm, h, &a));
    DDP_CHECK(mlp(c, l, L, a, &a));
    DDP_CHECK(ddp_add(c, h, a, &h));
    DDP_CHECK(ddp__block_leave(c, l->m, (size_t)i, &h));
  }
  DDP_CHECK(rms(c, l, l->norm, h, &h));
  DDP_CHECK(ddp__pvar(c, l->m, l->lm_head, &head));
  return ddp_linear(c, h, head, NULL, y);
}

static ddp_status_t llama_init(void *state, uint64_t seed) {
  llama_t *l = state;
  const ddp_llama_config_t *cfg = &l->hf.llama;
  ddp__hf_init(l->m, l->role, cfg->initializer_range, cfg->initializer_range,
               cfg->pad_token_id >= 0 ? l->embed : NONE, cfg->pad_token_id, seed);
  return DDP_OK;
}

static const ddp__family_t llama_family = {"llama",    DDP_TASK_CAUSAL_LM, llama_forward,
                                           llama_init, llama_destroy,      llama_is_norm};

/* ---------------------------------------------------------------- build ----------- */

typedef struct builder {
  llama_t *l;
  ddp_dtype_t dt;
  ddp_error_t *err;
  char name[256];
} builder_t;

static ddp_status_t fail(builder_t *b, const char *what, ddp_status_t st) {
  return ddp__error(b->err, -1, st, "llama: cannot register %s", what);
}

static const char *nm(builder_t *b, int64_t i, const char *leaf) {
  snprintf(b->name, sizeof b->name, "model.layers.%lld.%s", (long long)i, leaf);
  return b->name;
}

static ddp_status_t add(builder_t *b, const char *name, int ndim, const int64_t *shape,
                        ddp__init_role_t role, size_t *idx) {
  ddp_status_t st = ddp_model_add_param(b->l->m, name, b->dt, ndim, shape, true, idx);
  if (st != DDP_OK) return fail(b, name, st);
  b->l->role[*idx] = (unsigned char)role;
  return DDP_OK;
}

/* nn.Linear(in, out, bias): weight [out, in], then bias [out] (NONE without). */
static ddp_status_t add_linear(builder_t *b, const char *prefix, int64_t in, int64_t out, bool bias,
                               size_t *w, size_t *bi) {
  char n[300];
  int64_t ws[2] = {out, in};
  snprintf(n, sizeof n, "%s.weight", prefix);
  DDP_CHECK(add(b, n, 2, ws, DDP__INIT_NORMAL, w));
  *bi = NONE;
  if (!bias) return DDP_OK;
  snprintf(n, sizeof n, "%s.bias", prefix);
  return add(b, n, 1, &out, DDP__INIT_ZERO, bi);
}

static ddp_status_t add_norm(builder_t *b, const char *prefix, size_t *idx) {
  char n[300];
  snprintf(n, sizeof n, "%s.weight", prefix);
  return add(b, n, 1, &b->l->hf.llama.hidden_size, DDP__INIT_ONE, idx);
}

static ddp_status_t add_layer(builder_t *b, int64_t i, layer_t *L) {
  const ddp_llama_config_t *cfg = &b->l->hf.llama;
  int64_t H = cfg->hidden_size, d = b->l->head_dim, I = cfg->intermediate_size;
  int64_t qd = cfg->num_attention_heads * d, kvd = cfg->num_key_value_heads * d;
  bool ab = cfg->attention_bias, mb = cfg->mlp_bias;
  DDP_CHECK(add_linear(b, nm(b, i, "self_attn.q_proj"), H, qd, ab, &L->q_w, &L->q_b));
  DDP_CHECK(add_linear(b, nm(b, i, "self_attn.k_proj"), H, kvd, ab, &L->k_w, &L->k_b));
  DDP_CHECK(add_linear(b, nm(b, i, "self_attn.v_proj"), H, kvd, ab, &L->v_w, &L->v_b));
  DDP_CHECK(add_linear(b, nm(b, i, "self_attn.o_proj"), qd, H, ab, &L->o_w, &L->o_b));
  DDP_CHECK(add_linear(b, nm(b, i, "mlp.gate_proj"), H, I, mb, &L->gate_w, &L->gate_b));
  DDP_CHECK(add_linear(b, nm(b, i, "mlp.up_proj"), H, I, mb, &L->up_w, &L->up_b));
  DDP_CHECK(add_linear(b, nm(b, i, "mlp.down_proj"), I, H, mb, &L->down_w, &L->down_b));
  DDP_CHECK(add_norm(b, nm(b, i, "input_layernorm"), &L->in_norm));
  return add_norm(b, nm(b, i, "post_attention_layernorm"), &L->post_norm);
}

ddp_status_t ddp__llama_build(ddp_model_t *m, const ddp_hf_config_t *hf, ddp_dtype_t dt,
                              ddp_error_t *err) {
  const ddp_llama_config_t *cfg = &hf->llama;
  llama_t *l = ddp__calloc(1, sizeof *l);
  if (!l) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "llama: out of memory");
  l->hf = *hf;
  l->hf.torch_dtype = dt;
  l->m = m;
  l->head_dim = cfg->head_dim ? cfg->head_dim : cfg->hidden_size / cfg->num_attention_heads;
  size_t per_layer = 9 + (cfg->attention_bias ? 4 : 0) + (cfg->mlp_bias ? 3 : 0);
  size_t nparams = 1 + per_layer * (size_t)cfg->num_hidden_layers + 1 +
                   (cfg->tie_word_embeddings ? 0 : 1);
  l->layers = ddp__calloc((size_t)cfg->num_hidden_layers, sizeof *l->layers);
  l->role = ddp__calloc(nparams, 1);
  l->inv_freq = ddp__calloc((size_t)l->head_dim / 2 + 1, sizeof(float));
  ddp_module_t *root;
  /* The model owns l from here on: a failure below frees it with the model. */
  DDP_CHECK(ddp__module_family(m, &llama_family, l, &root));
  ddp_model_set_root(m, root);
  if (!l->layers || !l->role || !l->inv_freq)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "llama: out of memory");
  if (!ddp__hf_activation(cfg->hidden_act, &l->act))
    return ddp__error(err, -1, DDP_ERR_UNSUPPORTED, "llama: hidden_act \"%s\" unknown",
                      cfg->hidden_act);
  builder_t b = {l, dt, err, ""};
  int64_t es[2] = {cfg->vocab_size, cfg->hidden_size};
  DDP_CHECK(add(&b, "model.embed_tokens.weight", 2, es, DDP__INIT_NORMAL, &l->embed));
  for (int64_t i = 0; i < cfg->num_hidden_layers; i++) {
    size_t first = ddp_model_num_params(m);
    DDP_CHECK(add_layer(&b, i, &l->layers[i]));
    if (ddp__model_add_block(m, "LlamaDecoderLayer", first, ddp_model_num_params(m) - first) !=
        DDP_OK)
      return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "llama: out of memory");
  }
  DDP_CHECK(add_norm(&b, "model.norm", &l->norm));
  l->lm_head = l->embed;
  if (!cfg->tie_word_embeddings)
    DDP_CHECK(add(&b, "lm_head.weight", 2, es, DDP__INIT_NORMAL, &l->lm_head));
  DDP_REQUIRE(ddp_model_num_params(m) == nparams);
  return DDP_OK;
}

const ddp__hf_family_t ddp__llama_family = {DDP_HF_LLAMA, ddp__llama_build};
