/* BERT as Transformers' BertForSequenceClassification: the parameters in its registration
 * order with its state_dict names, its forward (embeddings with a padding row, post-LN encoder
 * layers, padding mask, tanh pooler on the first token, classifier) and its _init_weights
 * (spec/transformers.md, docs/nn.md "Transformers").
 *
 * Parameters, in parameters() order (C = hidden_size, I = intermediate_size):
 *   bert.embeddings.{word_embeddings [vocab_size, C], position_embeddings
 *   [max_position_embeddings, C], token_type_embeddings [type_vocab_size, C]}.weight,
 *   bert.embeddings.LayerNorm.{weight,bias};
 *   per layer i, under bert.encoder.layer.i: attention.self.{query,key,value}.{weight,bias},
 *   attention.output.dense.{weight,bias}, attention.output.LayerNorm.{weight,bias},
 *   intermediate.dense.{weight [I, C],bias}, output.dense.{weight [C, I],bias},
 *   output.LayerNorm.{weight,bias};
 *   bert.pooler.dense.{weight,bias}; classifier.{weight [num_labels, C],bias}.
 * Linear weights are nn.Linear's [out, in]. */
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

/* Parameter indices of one layer; a Linear's or LayerNorm's bias follows its weight. */
typedef struct layer {
  size_t query, key, value, attn_dense, attn_ln, inter, out_dense, out_ln;
} layer_t;

typedef struct bert {
  ddp_hf_config_t hf; /* first member: ddp_model_hf_config reads it */
  ddp_model_t *m;
  ddp_act_t act;
  size_t word, position, token_type, emb_ln, pooler, classifier;
  layer_t *layer;
  unsigned char *role; /* ddp__init_role_t per parameter */
} bert_t;

static void bert_destroy(void *state) {
  bert_t *b = state;
  if (!b) return;
  ddp__free(b->layer);
  ddp__free(b->role);
  ddp__free(b);
}

/* ---------------------------------------------------------------- padded embedding */

/* nn.Embedding with padding_idx: the forward looks the pad row up like any other, but the
 * backward leaves that row's gradient alone (PyTorch's embedding_backward skips it). */
static ddp_status_t bw_embed_padded(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *ids = n->ins[0], *w = n->ins[1];
  int64_t D = w->value.shape[1], pad = n->i0;
  void *g = ddp__grad(c, w);
  if (!g) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "embedding: arena exhausted");
  const int64_t *id = ids->value.data;
  for (int64_t i = 0; i < ids->value.numel; i++) {
    if (id[i] == pad) continue;
    if (w->value.dtype == DDP_F32) {
      float *gw = (float *)g + id[i] * D;
      const float *gy = (const float *)n->out->grad.data + i * D;
      for (int64_t j = 0; j < D; j++) gw[j] += gy[j];
    } else {
      double *gw = (double *)g + id[i] * D;
      const double *gy = (const double *)n->out->grad.data + i * D;
      for (int64_t j = 0; j < D; j++) gw[j] += gy[j];
    }
  }
  return DDP_OK;
}

/* ids I64 [B, T] (checked against the table by the caller), w [V, D] -> [B, T, D]. */
ddp_status_t ddp__embedding_padded(ddp_ctx_t *c, ddp_var_t *ids, ddp_var_t *w, int64_t pad,
                                   ddp_var_t **y) {
  int64_t D = w->value.shape[1];
  int64_t shape[3] = {ids->value.shape[0], ids->value.shape[1], D};
  ddp_var_t *out = ddp__var_alloc(c, w->value.dtype, 3, shape);
  if (!out) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "embedding: arena exhausted");
  ddp_var_t *ins[2] = {ids, w};
  if (ddp__needs_grad(c, 2, ins)) {
    ddp_node_t *n = ddp__node_new(c, "embedding", bw_embed_padded, out, 2, ins);
    if (!n) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "embedding: arena exhausted");
    n->i0 = pad;
  }
  size_t row = (size_t)D * ddp_dtype_size(w->value.dtype);
  const int64_t *id = ids->value.data;
  for (int64_t i = 0; i < ids->value.numel; i++)
    memcpy((char *)out->value.data + (size_t)i * row, (const char *)w->value.data + id[i] * row,
           row);
  *y = out;
  return DDP_OK;
}

/* ---------------------------------------------------------------- forward --------- */

static ddp_status_t linear(ddp_ctx_t *c, bert_t *b, size_t w, ddp_var_t *x, ddp_var_t **y) {
  ddp_var_t *wv, *bv;
  DDP_CHECK(ddp__pvar(c, b->m, w, &wv));
  DDP_CHECK(ddp__pvar(c, b->m, w + 1, &bv));
  return ddp_linear(c, x, wv, bv, y);
}

static ddp_status_t ln(ddp_ctx_t *c, bert_t *b, size_t w, ddp_var_t *x, ddp_var_t **y) {
  ddp_var_t *wv, *bv;
  DDP_CHECK(ddp__pvar(c, b->m, w, &wv));
  DDP_CHECK(ddp__pvar(c, b->m, w + 1, &bv));
  return ddp_layer_norm(c, x, wv, bv, b->hf.bert.layer_norm_eps, y);
}

/* One post-LN encoder layer. The projections run in Transformers' order (query, key and its
 * heads, value and its heads, then the query's heads), so that backward reaches the
 * parameters in PyTorch's order: value, key, query. */
static ddp_status_t layer_forward(ddp_ctx_t *c, bert_t *b, const layer_t *L, ddp_var_t *h,
                                  ddp_var_t *mask, bool training, ddp_var_t **out) {
  const ddp_bert_config_t *cfg = &b->hf.bert;
  int64_t H = cfg->num_attention_heads;
  ddp_var_t *q, *k, *v, *a, *i;
  DDP_CHECK(linear(c, b, L->query, h, &q));
  DDP_CHECK(linear(c, b, L->key, h, &k));
  DDP_CHECK(ddp_to_heads(c, k, H, &k));
  DDP_CHECK(linear(c, b, L->value, h, &v));
  DDP_CHECK(ddp_to_heads(c, v, H, &v));
  DDP_CHECK(ddp_to_heads(c, q, H, &q));
  double scale = 1.0 / sqrt((double)(cfg->hidden_size / H));
  DDP_CHECK(ddp_attention(c, q, k, v, mask, false, scale, cfg->attention_probs_dropout_prob,
                          training, &a));
  DDP_CHECK(ddp_merge_heads(c, a, &a));
  DDP_CHECK(linear(c, b, L->attn_dense, a, &a));
  DDP_CHECK(ddp_dropout(c, a, cfg->hidden_dropout_prob, training, &a));
  DDP_CHECK(ddp_add(c, a, h, &a));
  DDP_CHECK(ln(c, b, L->attn_ln, a, &a));
  DDP_CHECK(linear(c, b, L->inter, a, &i));
  DDP_CHECK(ddp_activation(c, b->act, i, &i));
  DDP_CHECK(linear(c, b, L->out_dense, i, &i));
  DDP_CHECK(ddp_dropout(c, i, cfg->hidden_dropout_prob, training, &i));
  DDP_CHECK(ddp_add(c, i, a, &i));
  return ln(c, b, L->out_ln, i, out);
}

/* Row r of x [B, R, T] as a new [B, T] var (inputs need no gradient). */
static ddp_status_t row_of(ddp_ctx_t *c, ddp_var_t *x, int64_t r, ddp_var_t **out) {
  int64_t B = x->value.shape[0], R = x->value.shape[1], T = x->value.shape[2];
  int64_t shape[2] = {B, T};
  DDP_CHECK(ddp_var_new(c, DDP_I64, 2, shape, NULL, false, out));
  for (int64_t i = 0; i < B; i++)
    memcpy((int64_t *)(*out)->value.data + i * T, (const int64_t *)x->value.data + (i * R + r) * T,
           (size_t)T * sizeof(int64_t));
  return DDP_OK;
}

/* Every value of v (I64 [B, T]) in [0, hi): else an error naming what and the key. */
static ddp_status_t check_ids(ddp_ctx_t *c, ddp_var_t *v, int64_t hi, const char *what,
                              const char *key) {
  const int64_t *d = v->value.data;
  int64_t T = v->value.shape[1];
  for (int64_t i = 0; i < v->value.numel; i++)
    if (d[i] < 0 || d[i] >= hi)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "bert: %s %lld at [%lld, %lld] is out of range for %s = %lld", what,
                            (long long)d[i], (long long)(i / T), (long long)(i % T), key,
                            (long long)hi);
  return DDP_OK;
}

static ddp_status_t bert_forward(void *state, ddp_ctx_t *c, ddp_var_t *x, bool training,
                                 ddp_var_t **y) {
  bert_t *b = state;
  const ddp_bert_config_t *cfg = &b->hf.bert;
  char sx[128];
  bool plain = x->value.ndim == 2,
       rows = x->value.ndim == 3 && (x->value.shape[1] == 2 || x->value.shape[1] == 3);
  if (x->value.dtype != DDP_I64 || !(plain || rows) || x->value.numel == 0)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "bert: input must be non-empty I64 [B, T] (input_ids), [B, 2, T] "
                          "(input_ids, attention_mask) or [B, 3, T] (and token_type_ids); got %s",
                          ddp_tensor_describe(&x->value, sx, sizeof sx));
  ddp_var_t *ids = x, *mask = NULL, *tt;
  if (rows) {
    DDP_CHECK(row_of(c, x, 0, &ids));
    DDP_CHECK(row_of(c, x, 1, &mask));
  }
  int64_t T = ids->value.shape[1];
  if (T > cfg->max_position_embeddings)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "bert: sequence length %lld exceeds max_position_embeddings = %lld",
                          (long long)T, (long long)cfg->max_position_embeddings);
  DDP_CHECK(check_ids(c, ids, cfg->vocab_size, "token id", "vocab_size"));
  const int64_t *mk = mask ? mask->value.data : NULL;
  for (int64_t i = 0; mk && i < mask->value.numel; i++)
    if (mk[i] != 0 && mk[i] != 1)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "bert: attention_mask value %lld at [%lld, %lld] must be 0 or 1",
                            (long long)mk[i], (long long)(i / T), (long long)(i % T));
  if (rows && x->value.shape[1] == 3) {
    DDP_CHECK(row_of(c, x, 2, &tt));
    DDP_CHECK(check_ids(c, tt, cfg->type_vocab_size, "token_type_id", "type_vocab_size"));
  } else {
    DDP_CHECK(ddp_var_new(c, DDP_I64, 2, ids->value.shape, NULL, false, &tt));
  }
  ddp_var_t *pos, *w, *e, *t, *p;
  DDP_CHECK(ddp_var_new(c, DDP_I64, 1, &T, NULL, false, &pos));
  for (int64_t k = 0; k < T; k++) ((int64_t *)pos->value.data)[k] = k;
  /* Transformers' order: words, token types, their sum, then positions added. */
  DDP_CHECK(ddp__pvar(c, b->m, b->word, &w));
  DDP_CHECK(ddp__embedding_padded(c, ids, w, cfg->pad_token_id, &e));
  DDP_CHECK(ddp__pvar(c, b->m, b->token_type, &w));
  DDP_CHECK(ddp_embedding(c, tt, w, &t));
  DDP_CHECK(ddp_add(c, e, t, &e));
  DDP_CHECK(ddp__pvar(c, b->m, b->position, &w));
  DDP_CHECK(ddp_embedding(c, pos, w, &p));
  DDP_CHECK(ddp_add(c, e, p, &e));
  DDP_CHECK(ln(c, b, b->emb_ln, e, &e));
  DDP_CHECK(ddp_dropout(c, e, cfg->hidden_dropout_prob, training, &e));
  for (int64_t l = 0; l < cfg->num_hidden_layers; l++) {
    DDP_CHECK(ddp__block_enter(c, b->m, (size_t)l, &e));
    DDP_CHECK(layer_forward(c, b, &b->layer[l], e, mask, training, &e));
    DDP_CHECK(ddp__block_leave(c, b->m, (size_t)l, &e));
  }
  /* Pooler: dense + tanh on the first token; then dropout and the classifier. */
  int64_t bc[2] = {ids->value.shape[0], cfg->hidden_size};
  DDP_CHECK(ddp_narrow(c, e, 1, 0, 1, &e));
  DDP_CHECK(ddp_reshape(c, e, 2, bc, &e));
  DDP_CHECK(linear(c, b, b->pooler, e, &e));
  DDP_CHECK(ddp_activation(c, DDP_ACT_TANH, e, &e));
  double pc = cfg->classifier_dropout == -1 ? cfg->hidden_dropout_prob : cfg->classifier_dropout;
  DDP_CHECK(ddp_dropout(c, e, pc, training, &e));
  return linear(c, b, b->classifier, e, y);
}

static ddp_status_t bert_init(void *state, uint64_t seed) {
  bert_t *b = state;
  const ddp_bert_config_t *cfg = &b->hf.bert;
  ddp__hf_init(b->m, b->role, cfg->initializer_range, cfg->initializer_range,
               cfg->pad_token_id >= 0 ? b->word : (size_t)-1, cfg->pad_token_id, seed);
  return DDP_OK;
}

static const ddp__family_t bert_family = {"bert",       DDP_TASK_SEQ_CLASSIFICATION,
                                          bert_forward, bert_init,
                                          bert_destroy, NULL};

/* ---------------------------------------------------------------- build ----------- */

typedef struct builder {
  bert_t *b;
  ddp_dtype_t dt;
  ddp_error_t *err;
  char name[256];
} builder_t;

static ddp_status_t done(builder_t *bd, ddp_status_t st, size_t first, ddp__init_role_t r0,
                         ddp__init_role_t r1) {
  if (st != DDP_OK) return ddp__error(bd->err, -1, st, "bert: cannot register %s", bd->name);
  bd->b->role[first] = (unsigned char)r0;
  if (ddp_model_num_params(bd->b->m) > first + 1) bd->b->role[first + 1] = (unsigned char)r1;
  return DDP_OK;
}

/* "bert.encoder.layer.<i>.<leaf>" (i >= 0) or leaf, in bd->name. */
static const char *nm(builder_t *bd, int64_t i, const char *leaf) {
  if (i >= 0)
    snprintf(bd->name, sizeof bd->name, "bert.encoder.layer.%lld.%s", (long long)i, leaf);
  else
    snprintf(bd->name, sizeof bd->name, "%s", leaf);
  return bd->name;
}

static ddp_status_t add_linear(builder_t *bd, const char *prefix, int64_t in, int64_t out,
                               size_t *idx) {
  ddp_module_t *mod;
  *idx = ddp_model_num_params(bd->b->m);
  return done(bd, ddp_module_linear(bd->b->m, prefix, in, out, true, bd->dt, &mod), *idx,
              DDP__INIT_NORMAL, DDP__INIT_ZERO);
}

static ddp_status_t add_ln(builder_t *bd, const char *prefix, size_t *idx) {
  ddp_module_t *mod;
  *idx = ddp_model_num_params(bd->b->m);
  const ddp_bert_config_t *cfg = &bd->b->hf.bert;
  return done(bd,
              ddp_module_layer_norm(bd->b->m, prefix, cfg->hidden_size, cfg->layer_norm_eps, bd->dt,
                                    &mod),
              *idx, DDP__INIT_ONE, DDP__INIT_ZERO);
}

static ddp_status_t add_embedding(builder_t *bd, const char *prefix, int64_t num, size_t *idx) {
  ddp_module_t *mod;
  *idx = ddp_model_num_params(bd->b->m);
  nm(bd, -1, prefix);
  return done(bd,
              ddp_module_embedding(bd->b->m, prefix, num, bd->b->hf.bert.hidden_size, bd->dt, &mod),
              *idx, DDP__INIT_NORMAL, DDP__INIT_NORMAL);
}

ddp_status_t ddp__bert_build(ddp_model_t *m, const ddp_hf_config_t *hf, ddp_dtype_t dt,
                             ddp_error_t *err) {
  const ddp_bert_config_t *cfg = &hf->bert;
  bert_t *b = ddp__calloc(1, sizeof *b);
  if (!b) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "bert: out of memory");
  b->hf = *hf;
  b->hf.torch_dtype = dt;
  b->m = m;
  size_t nparams = 5 + 16 * (size_t)cfg->num_hidden_layers + 4;
  b->layer = ddp__calloc((size_t)cfg->num_hidden_layers, sizeof *b->layer);
  b->role = ddp__calloc(nparams, 1);
  ddp_module_t *root;
  /* The model owns b from here on: a failure below frees it with the model. */
  DDP_CHECK(ddp__module_family(m, &bert_family, b, &root));
  ddp_model_set_root(m, root);
  if (!b->layer || !b->role)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY,
                      "bert: out of memory asking for %zu bytes for the %lld layers of "
                      "num_hidden_layers",
                      (size_t)cfg->num_hidden_layers * sizeof *b->layer + nparams,
                      (long long)cfg->num_hidden_layers);
  if (!ddp__hf_activation(cfg->hidden_act, &b->act))
    return ddp__error(err, -1, DDP_ERR_UNSUPPORTED, "bert: hidden_act \"%s\" unknown",
                      cfg->hidden_act);
  builder_t bd = {b, dt, err, ""};
  int64_t C = cfg->hidden_size, I = cfg->intermediate_size;
  DDP_CHECK(add_embedding(&bd, "bert.embeddings.word_embeddings", cfg->vocab_size, &b->word));
  DDP_CHECK(add_embedding(&bd, "bert.embeddings.position_embeddings", cfg->max_position_embeddings,
                          &b->position));
  DDP_CHECK(add_embedding(&bd, "bert.embeddings.token_type_embeddings", cfg->type_vocab_size,
                          &b->token_type));
  DDP_CHECK(add_ln(&bd, nm(&bd, -1, "bert.embeddings.LayerNorm"), &b->emb_ln));
  for (int64_t i = 0; i < cfg->num_hidden_layers; i++) {
    layer_t *L = &b->layer[i];
    size_t first = ddp_model_num_params(m);
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "attention.self.query"), C, C, &L->query));
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "attention.self.key"), C, C, &L->key));
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "attention.self.value"), C, C, &L->value));
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "attention.output.dense"), C, C, &L->attn_dense));
    DDP_CHECK(add_ln(&bd, nm(&bd, i, "attention.output.LayerNorm"), &L->attn_ln));
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "intermediate.dense"), C, I, &L->inter));
    DDP_CHECK(add_linear(&bd, nm(&bd, i, "output.dense"), I, C, &L->out_dense));
    DDP_CHECK(add_ln(&bd, nm(&bd, i, "output.LayerNorm"), &L->out_ln));
    if (ddp__model_add_block(m, "BertLayer", first, ddp_model_num_params(m) - first) != DDP_OK)
      return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "bert: out of memory");
  }
  DDP_CHECK(add_linear(&bd, nm(&bd, -1, "bert.pooler.dense"), C, C, &b->pooler));
  DDP_CHECK(add_linear(&bd, nm(&bd, -1, "classifier"), C, cfg->num_labels, &b->classifier));
  DDP_REQUIRE(ddp_model_num_params(m) == nparams);
  return DDP_OK;
}

const ddp__hf_family_t ddp__bert_family = {DDP_HF_BERT, ddp__bert_build};
