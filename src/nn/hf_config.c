/* Transformers' config.json for GPT-2, BERT and Llama: defaults, parsing with errors that name
 * the key, validation, and writing as save_pretrained does. The keys and defaults are those of
 * Transformers' GPT2Config, BertConfig and LlamaConfig (docs/nn.md, "Transformers"). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nn/nn_internal.h"

/* Activations libddp has, by Transformers' ACT2FN names. */
static const struct {
  const char *name;
  ddp_act_t act;
} acts[] = {
    {"gelu", DDP_ACT_GELU},          {"gelu_python", DDP_ACT_GELU},
    {"gelu_new", DDP_ACT_GELU_TANH}, {"gelu_pytorch_tanh", DDP_ACT_GELU_TANH},
    {"relu", DDP_ACT_RELU},          {"tanh", DDP_ACT_TANH},
    {"sigmoid", DDP_ACT_SIGMOID},    {"silu", DDP_ACT_SILU},
    {"swish", DDP_ACT_SILU},
};
#define MODEL_TYPES "gpt2, bert, llama"
#define ACT_LIST "gelu, gelu_python, gelu_new, gelu_pytorch_tanh, relu, tanh, sigmoid, silu, swish"

bool ddp__hf_activation(const char *name, ddp_act_t *act) {
  for (size_t i = 0; i < DDP_ARRAY_LEN(acts); i++)
    if (!strcmp(acts[i].name, name)) {
      *act = acts[i].act;
      return true;
    }
  return false;
}

void ddp_hf_config_defaults(ddp_hf_config_t *cfg, ddp_hf_model_type_t model_type) {
  DDP_REQUIRE(cfg && model_type >= DDP_HF_GPT2 && model_type <= DDP_HF_LLAMA);
  memset(cfg, 0, sizeof *cfg);
  cfg->model_type = model_type;
  cfg->torch_dtype = DDP_F32;
  ddp_gpt2_config_t *g = &cfg->gpt2;
  g->vocab_size = 50257;
  g->n_positions = 1024;
  g->n_embd = 768;
  g->n_layer = 12;
  g->n_head = 12;
  g->n_inner = 0;
  snprintf(g->activation_function, sizeof g->activation_function, "gelu_new");
  g->resid_pdrop = g->embd_pdrop = g->attn_pdrop = 0.1;
  g->layer_norm_epsilon = 1e-5;
  g->initializer_range = 0.02;
  g->scale_attn_weights = true;
  g->tie_word_embeddings = true;
  ddp_bert_config_t *b = &cfg->bert;
  b->vocab_size = 30522;
  b->hidden_size = 768;
  b->num_hidden_layers = 12;
  b->num_attention_heads = 12;
  b->intermediate_size = 3072;
  snprintf(b->hidden_act, sizeof b->hidden_act, "gelu");
  b->hidden_dropout_prob = b->attention_probs_dropout_prob = 0.1;
  b->max_position_embeddings = 512;
  b->type_vocab_size = 2;
  b->layer_norm_eps = 1e-12;
  b->initializer_range = 0.02;
  b->pad_token_id = 0;
  b->num_labels = 2;
  b->classifier_dropout = -1;
  ddp_llama_config_t *l = &cfg->llama;
  l->vocab_size = 32000;
  l->hidden_size = 4096;
  l->intermediate_size = 11008;
  l->num_hidden_layers = 32;
  l->num_attention_heads = 32;
  l->num_key_value_heads = 0; /* null: num_attention_heads */
  l->head_dim = 0;            /* null: hidden_size / num_attention_heads */
  snprintf(l->hidden_act, sizeof l->hidden_act, "silu");
  l->max_position_embeddings = 2048;
  l->initializer_range = 0.02;
  l->rms_norm_eps = 1e-6;
  l->pad_token_id = -1;
  l->bos_token_id = 1;
  l->eos_token_id = 2;
  l->tie_word_embeddings = false;
  l->rope_theta = 10000.0;
  l->rope_scaling.type = DDP_ROPE_DEFAULT;
  l->attention_bias = false;
  l->attention_dropout = 0.0;
  l->mlp_bias = false;
}

/* ---------------------------------------------------------------- checks ---------- */

static const char *src_name(const char *path) { return path ? path : "config.json"; }

static ddp_status_t bad_key(ddp_error_t *err, ddp_status_t st, const char *path, const char *key,
                            const char *what) {
  return ddp__error(err, -1, st, "%s: \"%s\" %s", src_name(path), key, what);
}

/* Sizes and counts: positive, and at most INT32_MAX (a dimension that large is no model
 * libddp can allocate; above it, a count would fail later as "out of memory" or overflow). */
#define HF_DIM_MAX 2147483647LL
static ddp_status_t need_pos(const char *path, const char *key, int64_t v, ddp_error_t *err) {
  if (v >= 1 && v <= HF_DIM_MAX) return DDP_OK;
  char w[128];
  if (v < 1)
    snprintf(w, sizeof w, "must be a positive integer (got %lld)", (long long)v);
  else
    snprintf(w, sizeof w, "(%lld) is beyond the limit %lld (2^31 - 1) for a size or count",
             (long long)v, HF_DIM_MAX);
  return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, key, w);
}

static ddp_status_t need_prob(const char *path, const char *key, double v, ddp_error_t *err) {
  if (v >= 0 && v <= 1) return DDP_OK;
  char w[96];
  snprintf(w, sizeof w, "must be a probability in [0, 1] (got %g)", v);
  return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, key, w);
}

static ddp_status_t need_nonneg(const char *path, const char *key, double v, bool strict_pos,
                                ddp_error_t *err) {
  if (isfinite(v) && (strict_pos ? v > 0 : v >= 0)) return DDP_OK;
  char w[96];
  snprintf(w, sizeof w, "must be a %s number (got %g)", strict_pos ? "positive" : "non-negative",
           v);
  return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, key, w);
}

static ddp_status_t need_act(const char *path, const char *key, const char *name,
                             ddp_error_t *err) {
  ddp_act_t a;
  if (ddp__hf_activation(name, &a)) return DDP_OK;
  char w[256];
  snprintf(w, sizeof w, "is \"%.40s\": libddp has no such activation (supported: " ACT_LIST ")",
           name);
  return bad_key(err, DDP_ERR_UNSUPPORTED, path, key, w);
}

static ddp_status_t need_heads(const char *path, const char *wkey, int64_t width, const char *hkey,
                               int64_t heads, ddp_error_t *err) {
  if (width % heads == 0) return DDP_OK;
  return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                    "%s: \"%s\" (%lld) must be divisible by \"%s\" (%lld)", src_name(path), wkey,
                    (long long)width, hkey, (long long)heads);
}

static ddp_status_t check_gpt2(const ddp_gpt2_config_t *g, const char *path, ddp_error_t *err) {
  DDP_CHECK(need_pos(path, "vocab_size", g->vocab_size, err));
  DDP_CHECK(need_pos(path, "n_positions", g->n_positions, err));
  DDP_CHECK(need_pos(path, "n_embd", g->n_embd, err));
  DDP_CHECK(need_pos(path, "n_layer", g->n_layer, err));
  DDP_CHECK(need_pos(path, "n_head", g->n_head, err));
  if (g->n_inner) DDP_CHECK(need_pos(path, "n_inner", g->n_inner, err));
  DDP_CHECK(need_heads(path, "n_embd", g->n_embd, "n_head", g->n_head, err));
  DDP_CHECK(need_act(path, "activation_function", g->activation_function, err));
  DDP_CHECK(need_prob(path, "resid_pdrop", g->resid_pdrop, err));
  DDP_CHECK(need_prob(path, "embd_pdrop", g->embd_pdrop, err));
  DDP_CHECK(need_prob(path, "attn_pdrop", g->attn_pdrop, err));
  DDP_CHECK(need_nonneg(path, "layer_norm_epsilon", g->layer_norm_epsilon, true, err));
  DDP_CHECK(need_nonneg(path, "initializer_range", g->initializer_range, false, err));
  return DDP_OK;
}

static ddp_status_t check_bert(const ddp_bert_config_t *b, const char *path, ddp_error_t *err) {
  DDP_CHECK(need_pos(path, "vocab_size", b->vocab_size, err));
  DDP_CHECK(need_pos(path, "hidden_size", b->hidden_size, err));
  DDP_CHECK(need_pos(path, "num_hidden_layers", b->num_hidden_layers, err));
  DDP_CHECK(need_pos(path, "num_attention_heads", b->num_attention_heads, err));
  DDP_CHECK(need_pos(path, "intermediate_size", b->intermediate_size, err));
  DDP_CHECK(need_pos(path, "max_position_embeddings", b->max_position_embeddings, err));
  DDP_CHECK(need_pos(path, "type_vocab_size", b->type_vocab_size, err));
  DDP_CHECK(need_pos(path, "num_labels", b->num_labels, err));
  DDP_CHECK(need_heads(path, "hidden_size", b->hidden_size, "num_attention_heads",
                       b->num_attention_heads, err));
  DDP_CHECK(need_act(path, "hidden_act", b->hidden_act, err));
  DDP_CHECK(need_prob(path, "hidden_dropout_prob", b->hidden_dropout_prob, err));
  DDP_CHECK(need_prob(path, "attention_probs_dropout_prob", b->attention_probs_dropout_prob, err));
  if (b->classifier_dropout != -1)
    DDP_CHECK(need_prob(path, "classifier_dropout", b->classifier_dropout, err));
  DDP_CHECK(need_nonneg(path, "layer_norm_eps", b->layer_norm_eps, true, err));
  DDP_CHECK(need_nonneg(path, "initializer_range", b->initializer_range, false, err));
  if (b->pad_token_id < -1 || b->pad_token_id >= b->vocab_size) {
    char w[128];
    snprintf(w, sizeof w, "(%lld) must be null or an id below vocab_size (%lld)",
             (long long)b->pad_token_id, (long long)b->vocab_size);
    return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "pad_token_id", w);
  }
  const char *pt = b->problem_type;
  if (*pt && strcmp(pt, "regression") && strcmp(pt, "single_label_classification")) {
    char w[160];
    snprintf(w, sizeof w,
             "is \"%.40s\": libddp supports null, \"regression\" and "
             "\"single_label_classification\"",
             pt);
    return bad_key(err, DDP_ERR_UNSUPPORTED, path, "problem_type", w);
  }
  return DDP_OK;
}

static ddp_status_t check_llama(const ddp_llama_config_t *l, const char *path, ddp_error_t *err) {
  DDP_CHECK(need_pos(path, "vocab_size", l->vocab_size, err));
  DDP_CHECK(need_pos(path, "hidden_size", l->hidden_size, err));
  DDP_CHECK(need_pos(path, "intermediate_size", l->intermediate_size, err));
  DDP_CHECK(need_pos(path, "num_hidden_layers", l->num_hidden_layers, err));
  DDP_CHECK(need_pos(path, "num_attention_heads", l->num_attention_heads, err));
  DDP_CHECK(need_pos(path, "num_key_value_heads", l->num_key_value_heads, err));
  DDP_CHECK(need_pos(path, "max_position_embeddings", l->max_position_embeddings, err));
  if (l->head_dim) {
    DDP_CHECK(need_pos(path, "head_dim", l->head_dim, err));
  } else {
    DDP_CHECK(need_heads(path, "hidden_size", l->hidden_size, "num_attention_heads",
                         l->num_attention_heads, err));
  }
  int64_t d = l->head_dim ? l->head_dim : l->hidden_size / l->num_attention_heads;
  if (d % 2)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "%s: the head dimension (%lld: \"head_dim\", or \"hidden_size\" / "
                      "\"num_attention_heads\") must be even for rotary embeddings",
                      src_name(path), (long long)d);
  DDP_CHECK(need_heads(path, "num_attention_heads", l->num_attention_heads, "num_key_value_heads",
                       l->num_key_value_heads, err));
  DDP_CHECK(need_act(path, "hidden_act", l->hidden_act, err));
  DDP_CHECK(need_prob(path, "attention_dropout", l->attention_dropout, err));
  DDP_CHECK(need_nonneg(path, "rms_norm_eps", l->rms_norm_eps, false, err));
  DDP_CHECK(need_nonneg(path, "initializer_range", l->initializer_range, false, err));
  DDP_CHECK(need_nonneg(path, "rope_theta", l->rope_theta, true, err));
  const ddp_rope_scaling_t *r = &l->rope_scaling;
  if (r->type != DDP_ROPE_DEFAULT && !(isfinite(r->factor) && r->factor >= 1))
    return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "rope_scaling",
                   "needs a \"factor\" >= 1 (Transformers' _validate_*_rope_parameters)");
  if (r->type == DDP_ROPE_LLAMA3 &&
      (r->original_max_position_embeddings < 1 || !(r->low_freq_factor > 0) ||
       !(r->high_freq_factor > r->low_freq_factor)))
    return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "rope_scaling",
                   "of type \"llama3\" needs \"original_max_position_embeddings\" >= 1 and "
                   "0 < \"low_freq_factor\" < \"high_freq_factor\"");
  if (l->pad_token_id < -1 || l->pad_token_id >= l->vocab_size) {
    char w[128];
    snprintf(w, sizeof w, "(%lld) must be null or an id below vocab_size (%lld)",
             (long long)l->pad_token_id, (long long)l->vocab_size);
    return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "pad_token_id", w);
  }
  return DDP_OK;
}

ddp_status_t ddp_hf_config_check(const ddp_hf_config_t *cfg, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(cfg);
  if (cfg->torch_dtype != DDP_F32 && cfg->torch_dtype != DDP_F64)
    return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "torch_dtype",
                   "must be float32 or float64");
  if (cfg->model_type == DDP_HF_GPT2) return check_gpt2(&cfg->gpt2, path, err);
  if (cfg->model_type == DDP_HF_BERT) return check_bert(&cfg->bert, path, err);
  if (cfg->model_type == DDP_HF_LLAMA) return check_llama(&cfg->llama, path, err);
  return bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "model_type",
                 "is not set (supported: " MODEL_TYPES ")");
}

/* ---------------------------------------------------------------- parse ----------- */

typedef struct parse {
  const cJSON *root;
  const char *path;
  ddp_error_t *err;
} parse_t;

static const char *json_type(const cJSON *v) {
  if (cJSON_IsNull(v)) return "null";
  if (cJSON_IsBool(v)) return "a boolean";
  if (cJSON_IsNumber(v)) return "a number";
  if (cJSON_IsString(v)) return "a string";
  if (cJSON_IsArray(v)) return "an array";
  return "an object";
}

static ddp_status_t wrong_type(parse_t *p, const char *key, const cJSON *v, const char *want) {
  char w[128];
  snprintf(w, sizeof w, "must be %s (got %s)", want, json_type(v));
  return bad_key(p->err, DDP_ERR_INVALID_ARGUMENT, p->path, key, w);
}

/* The value of key, or NULL when absent. */
static const cJSON *item(parse_t *p, const char *key) {
  return cJSON_GetObjectItemCaseSensitive(p->root, key);
}

/* An integer key; null is allowed (and leaves *out at null_value) when nullable. */
static ddp_status_t get_int(parse_t *p, const char *key, bool nullable, int64_t null_value,
                            int64_t *out) {
  const cJSON *v = item(p, key);
  if (!v) return DDP_OK;
  if (nullable && cJSON_IsNull(v)) {
    *out = null_value;
    return DDP_OK;
  }
  if (!cJSON_IsNumber(v))
    return wrong_type(p, key, v, nullable ? "an integer or null" : "an integer");
  char w[160];
  if (v->valuedouble != floor(v->valuedouble)) {
    snprintf(w, sizeof w, "must be an integer (got %.17g)", v->valuedouble);
    return bad_key(p->err, DDP_ERR_INVALID_ARGUMENT, p->path, key, w);
  }
  /* Integers above 2^53 do not survive JSON's doubles (Python's json keeps them, libddp
   * cannot): a limit, said as one, not "not an integer". */
  if (fabs(v->valuedouble) > 9007199254740992.0) {
    snprintf(w, sizeof w, "(%.17g) is beyond the integers libddp reads exactly (|n| <= 2^53)",
             v->valuedouble);
    return bad_key(p->err, DDP_ERR_INVALID_ARGUMENT, p->path, key, w);
  }
  *out = (int64_t)v->valuedouble;
  return DDP_OK;
}

static ddp_status_t get_num(parse_t *p, const char *key, bool nullable, double null_value,
                            double *out) {
  const cJSON *v = item(p, key);
  if (!v) return DDP_OK;
  if (nullable && cJSON_IsNull(v)) {
    *out = null_value;
    return DDP_OK;
  }
  if (!cJSON_IsNumber(v)) return wrong_type(p, key, v, nullable ? "a number or null" : "a number");
  *out = v->valuedouble;
  return DDP_OK;
}

static ddp_status_t get_bool(parse_t *p, const char *key, bool *out) {
  const cJSON *v = item(p, key);
  if (!v) return DDP_OK;
  if (!cJSON_IsBool(v)) return wrong_type(p, key, v, "true or false");
  *out = cJSON_IsTrue(v);
  return DDP_OK;
}

static ddp_status_t get_str(parse_t *p, const char *key, bool nullable, char *out, size_t len) {
  const cJSON *v = item(p, key);
  if (!v) return DDP_OK;
  if (nullable && cJSON_IsNull(v)) {
    out[0] = 0;
    return DDP_OK;
  }
  if (!cJSON_IsString(v)) return wrong_type(p, key, v, nullable ? "a string or null" : "a string");
  if (strlen(v->valuestring) >= len)
    return bad_key(p->err, DDP_ERR_INVALID_ARGUMENT, p->path, key, "is too long");
  snprintf(out, len, "%s", v->valuestring);
  return DDP_OK;
}

/* A key whose only supported value is `ok` (Transformers' default): anything else changes the
 * architecture in a way libddp does not implement. */
static ddp_status_t refuse_bool(parse_t *p, const char *key, const char *why) {
  bool v = false;
  DDP_CHECK(get_bool(p, key, &v));
  if (!v) return DDP_OK;
  return ddp__error(p->err, -1, DDP_ERR_UNSUPPORTED, "%s: \"%s\": true is not supported (%s)",
                    src_name(p->path), key, why);
}

/* GPT2Config.attribute_map: the generic names Transformers accepts for GPT-2's keys. */
static ddp_status_t gpt2_int(parse_t *p, const char *key, const char *alias, int64_t *out) {
  if (!item(p, key) && item(p, alias)) return get_int(p, alias, false, 0, out);
  return get_int(p, key, false, 0, out);
}

static ddp_status_t parse_gpt2(parse_t *p, ddp_gpt2_config_t *g) {
  DDP_CHECK(get_int(p, "vocab_size", false, 0, &g->vocab_size));
  DDP_CHECK(gpt2_int(p, "n_positions", "max_position_embeddings", &g->n_positions));
  DDP_CHECK(gpt2_int(p, "n_embd", "hidden_size", &g->n_embd));
  DDP_CHECK(gpt2_int(p, "n_layer", "num_hidden_layers", &g->n_layer));
  DDP_CHECK(gpt2_int(p, "n_head", "num_attention_heads", &g->n_head));
  DDP_CHECK(get_int(p, "n_inner", true, 0, &g->n_inner));
  if (item(p, "n_inner") && !cJSON_IsNull(item(p, "n_inner")) && g->n_inner < 1)
    return need_pos(p->path, "n_inner", g->n_inner, p->err);
  DDP_CHECK(get_str(p, "activation_function", false, g->activation_function,
                    sizeof g->activation_function));
  DDP_CHECK(get_num(p, "resid_pdrop", false, 0, &g->resid_pdrop));
  DDP_CHECK(get_num(p, "embd_pdrop", false, 0, &g->embd_pdrop));
  DDP_CHECK(get_num(p, "attn_pdrop", false, 0, &g->attn_pdrop));
  DDP_CHECK(get_num(p, "layer_norm_epsilon", false, 0, &g->layer_norm_epsilon));
  DDP_CHECK(get_num(p, "initializer_range", false, 0, &g->initializer_range));
  DDP_CHECK(get_bool(p, "scale_attn_weights", &g->scale_attn_weights));
  DDP_CHECK(get_bool(p, "scale_attn_by_inverse_layer_idx", &g->scale_attn_by_inverse_layer_idx));
  DDP_CHECK(get_bool(p, "reorder_and_upcast_attn", &g->reorder_and_upcast_attn));
  DDP_CHECK(get_bool(p, "tie_word_embeddings", &g->tie_word_embeddings));
  return refuse_bool(p, "add_cross_attention", "GPT-2 with cross-attention needs an encoder");
}

static ddp_status_t parse_bert(parse_t *p, ddp_bert_config_t *b) {
  DDP_CHECK(get_int(p, "vocab_size", false, 0, &b->vocab_size));
  DDP_CHECK(get_int(p, "hidden_size", false, 0, &b->hidden_size));
  DDP_CHECK(get_int(p, "num_hidden_layers", false, 0, &b->num_hidden_layers));
  DDP_CHECK(get_int(p, "num_attention_heads", false, 0, &b->num_attention_heads));
  DDP_CHECK(get_int(p, "intermediate_size", false, 0, &b->intermediate_size));
  DDP_CHECK(get_str(p, "hidden_act", false, b->hidden_act, sizeof b->hidden_act));
  DDP_CHECK(get_num(p, "hidden_dropout_prob", false, 0, &b->hidden_dropout_prob));
  DDP_CHECK(get_num(p, "attention_probs_dropout_prob", false, 0, &b->attention_probs_dropout_prob));
  DDP_CHECK(get_int(p, "max_position_embeddings", false, 0, &b->max_position_embeddings));
  DDP_CHECK(get_int(p, "type_vocab_size", false, 0, &b->type_vocab_size));
  DDP_CHECK(get_num(p, "layer_norm_eps", false, 0, &b->layer_norm_eps));
  DDP_CHECK(get_num(p, "initializer_range", false, 0, &b->initializer_range));
  DDP_CHECK(get_int(p, "pad_token_id", true, -1, &b->pad_token_id));
  DDP_CHECK(get_num(p, "classifier_dropout", true, -1, &b->classifier_dropout));
  DDP_CHECK(get_str(p, "problem_type", true, b->problem_type, sizeof b->problem_type));
  /* num_labels: the size of id2label when present (what Transformers keeps), else the
   * "num_labels" key; both present must agree. */
  const cJSON *ids = item(p, "id2label");
  int64_t nl = -1;
  DDP_CHECK(get_int(p, "num_labels", false, 0, &nl));
  if (ids && !cJSON_IsNull(ids)) {
    if (!cJSON_IsObject(ids)) return wrong_type(p, "id2label", ids, "an object");
    int64_t n = cJSON_GetArraySize(ids);
    if (nl >= 0 && item(p, "num_labels") && nl != n)
      return ddp__error(p->err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "%s: \"num_labels\" (%lld) disagrees with the %lld entries of \"id2label\"",
                        src_name(p->path), (long long)nl, (long long)n);
    nl = n;
  }
  if (item(p, "num_labels") || (ids && !cJSON_IsNull(ids))) b->num_labels = nl;
  const cJSON *pe = item(p, "position_embedding_type");
  if (pe && !cJSON_IsNull(pe) && !(cJSON_IsString(pe) && !strcmp(pe->valuestring, "absolute"))) {
    if (!cJSON_IsString(pe)) return wrong_type(p, "position_embedding_type", pe, "a string");
    return ddp__error(p->err, -1, DDP_ERR_UNSUPPORTED,
                      "%s: \"position_embedding_type\": \"%.40s\" is not supported (only "
                      "\"absolute\")",
                      src_name(p->path), pe->valuestring);
  }
  DDP_CHECK(refuse_bool(p, "is_decoder", "BERT as a decoder (causal self-attention)"));
  return refuse_bool(p, "add_cross_attention", "BERT with cross-attention needs an encoder");
}

static cJSON *to_json(const ddp_hf_config_t *cfg);

/* cfg->extra: every key of root that to_json does not write, and BERT's id2label/label2id
 * as given when they are not the generated ones (custom label names), as one JSON object. */
static ddp_status_t keep_extra(const cJSON *root, ddp_hf_config_t *cfg, const char *path,
                               ddp_error_t *err) {
  cfg->extra[0] = '\0';
  cJSON *ours = to_json(cfg), *extra = cJSON_CreateObject();
  ddp_status_t st = ours && extra ? DDP_OK : DDP_ERR_NO_MEMORY;
  for (const cJSON *k = root->child; st == DDP_OK && k; k = k->next) {
    /* id2label/label2id: kept only when they differ from the generated LABEL_i names */
    const cJSON *mine = cJSON_GetObjectItemCaseSensitive(ours, k->string);
    bool labels = !strcmp(k->string, "id2label") || !strcmp(k->string, "label2id");
    if (mine && (!labels || cJSON_Compare(k, mine, true))) continue;
    cJSON *copy = cJSON_Duplicate(k, true);
    if (!copy || !cJSON_AddItemToObject(extra, k->string, copy)) st = DDP_ERR_NO_MEMORY;
  }
  char *text = st == DDP_OK && extra->child ? cJSON_PrintUnformatted(extra) : NULL;
  if (st == DDP_OK && extra->child && !text) st = DDP_ERR_NO_MEMORY;
  cJSON_Delete(ours);
  cJSON_Delete(extra);
  if (st != DDP_OK) return ddp__error(err, -1, st, "%s: out of memory", src_name(path));
  if (text && strlen(text) >= sizeof cfg->extra) {
    size_t n = strlen(text);
    cJSON_free(text);
    return ddp__error(err, -1, DDP_ERR_UNSUPPORTED,
                      "%s: the keys libddp does not model take %zu bytes as JSON; it keeps at "
                      "most %d (DDP_HF_EXTRA_MAX) to write them back",
                      src_name(path), n, DDP_HF_EXTRA_MAX - 1);
  }
  if (text) snprintf(cfg->extra, sizeof cfg->extra, "%s", text);
  cJSON_free(text);
  return DDP_OK;
}

/* "rope_scaling": null, or an object whose "rope_type" (or legacy "type", which Transformers
 * copies to "rope_type") is default, linear, dynamic or llama3. */
static ddp_status_t parse_rope_scaling(parse_t *p, ddp_rope_scaling_t *r) {
  const cJSON *o = item(p, "rope_scaling");
  if (!o || cJSON_IsNull(o)) return DDP_OK;
  if (!cJSON_IsObject(o)) return wrong_type(p, "rope_scaling", o, "an object or null");
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "rope_type");
  if (!t) t = cJSON_GetObjectItemCaseSensitive(o, "type");
  if (!cJSON_IsString(t))
    return bad_key(p->err, DDP_ERR_INVALID_ARGUMENT, p->path, "rope_scaling",
                   "needs a string \"rope_type\" (or \"type\")");
  static const char *names[] = {"default", "linear", "dynamic", "llama3"};
  size_t k = 0;
  while (k < DDP_ARRAY_LEN(names) && strcmp(names[k], t->valuestring)) k++;
  if (k == DDP_ARRAY_LEN(names)) {
    char w[200];
    snprintf(w, sizeof w,
             "has rope_type \"%.40s\": libddp supports default, linear, dynamic and llama3",
             t->valuestring);
    return bad_key(p->err, DDP_ERR_UNSUPPORTED, p->path, "rope_scaling", w);
  }
  r->type = (ddp_rope_type_t)k;
  parse_t sub = {o, p->path, p->err};
  r->factor = 1.0;
  DDP_CHECK(get_num(&sub, "factor", false, 0, &r->factor));
  DDP_CHECK(get_int(&sub, "original_max_position_embeddings", false, 0,
                    &r->original_max_position_embeddings));
  DDP_CHECK(get_num(&sub, "low_freq_factor", false, 0, &r->low_freq_factor));
  return get_num(&sub, "high_freq_factor", false, 0, &r->high_freq_factor);
}

static ddp_status_t parse_llama(parse_t *p, ddp_llama_config_t *l) {
  DDP_CHECK(get_int(p, "vocab_size", false, 0, &l->vocab_size));
  DDP_CHECK(get_int(p, "hidden_size", false, 0, &l->hidden_size));
  DDP_CHECK(get_int(p, "intermediate_size", false, 0, &l->intermediate_size));
  DDP_CHECK(get_int(p, "num_hidden_layers", false, 0, &l->num_hidden_layers));
  DDP_CHECK(get_int(p, "num_attention_heads", false, 0, &l->num_attention_heads));
  DDP_CHECK(get_int(p, "num_key_value_heads", true, 0, &l->num_key_value_heads));
  if (!l->num_key_value_heads) l->num_key_value_heads = l->num_attention_heads;
  DDP_CHECK(get_int(p, "head_dim", true, 0, &l->head_dim));
  if (item(p, "head_dim") && !cJSON_IsNull(item(p, "head_dim")) && l->head_dim < 1)
    return need_pos(p->path, "head_dim", l->head_dim, p->err);
  DDP_CHECK(get_str(p, "hidden_act", false, l->hidden_act, sizeof l->hidden_act));
  DDP_CHECK(get_int(p, "max_position_embeddings", false, 0, &l->max_position_embeddings));
  DDP_CHECK(get_num(p, "initializer_range", false, 0, &l->initializer_range));
  DDP_CHECK(get_num(p, "rms_norm_eps", false, 0, &l->rms_norm_eps));
  DDP_CHECK(get_int(p, "pad_token_id", true, -1, &l->pad_token_id));
  DDP_CHECK(get_int(p, "bos_token_id", true, -1, &l->bos_token_id));
  DDP_CHECK(get_int(p, "eos_token_id", true, -1, &l->eos_token_id));
  DDP_CHECK(get_bool(p, "tie_word_embeddings", &l->tie_word_embeddings));
  DDP_CHECK(get_num(p, "rope_theta", false, 0, &l->rope_theta));
  DDP_CHECK(parse_rope_scaling(p, &l->rope_scaling));
  DDP_CHECK(get_bool(p, "attention_bias", &l->attention_bias));
  DDP_CHECK(get_num(p, "attention_dropout", false, 0, &l->attention_dropout));
  DDP_CHECK(get_bool(p, "mlp_bias", &l->mlp_bias));
  /* pretraining_tp > 1 only slices the projections in Transformers: the same function. */
  return DDP_OK;
}

ddp_status_t ddp_hf_config_parse(const char *json, const char *path, ddp_hf_config_t *cfg,
                                 ddp_error_t *err) {
  DDP_REQUIRE(json && cfg);
  memset(cfg, 0, sizeof *cfg);
  cJSON *root = NULL;
  DDP_CHECK(ddp__json_read(json, src_name(path), -1, &root, err));
  parse_t p = {root, path, err};
  ddp_status_t st = DDP_OK;
  const cJSON *mt = item(&p, "model_type");
  if (!cJSON_IsObject(root)) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "%s: a config must be a JSON object",
                    src_name(path));
  } else if (!mt) {
    st = bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "model_type",
                 "is missing (supported: " MODEL_TYPES ")");
  } else if (!cJSON_IsString(mt)) {
    st = wrong_type(&p, "model_type", mt, "a string");
  } else if (!strcmp(mt->valuestring, "gpt2") || !strcmp(mt->valuestring, "bert") ||
             !strcmp(mt->valuestring, "llama")) {
    ddp_hf_model_type_t t = !strcmp(mt->valuestring, "gpt2")   ? DDP_HF_GPT2
                            : !strcmp(mt->valuestring, "bert") ? DDP_HF_BERT
                                                               : DDP_HF_LLAMA;
    ddp_hf_config_defaults(cfg, t);
    st = t == DDP_HF_GPT2   ? parse_gpt2(&p, &cfg->gpt2)
         : t == DDP_HF_BERT ? parse_bert(&p, &cfg->bert)
                            : parse_llama(&p, &cfg->llama);
    char dt[DDP_HF_NAME_MAX] = "";
    if (st == DDP_OK) st = get_str(&p, "torch_dtype", true, dt, sizeof dt);
    cfg->torch_dtype = !strcmp(dt, "float64") ? DDP_F64 : DDP_F32;
    if (st == DDP_OK) st = ddp_hf_config_check(cfg, path, err);
    if (st == DDP_OK) st = keep_extra(root, cfg, path, err);
  } else {
    char w[128];
    snprintf(w, sizeof w, "is \"%.40s\": unknown model_type (supported: " MODEL_TYPES ")",
             mt->valuestring);
    st = bad_key(err, DDP_ERR_INVALID_ARGUMENT, path, "model_type", w);
  }
  cJSON_Delete(root);
  return st;
}

/* ---------------------------------------------------------------- write ----------- */

static void add_num(cJSON *o, const char *key, double v) { cJSON_AddNumberToObject(o, key, v); }

static void add_id(cJSON *o, const char *key, int64_t v) {
  if (v >= 0)
    add_num(o, key, (double)v);
  else
    cJSON_AddNullToObject(o, key);
}

static cJSON *llama_json(cJSON *o, const ddp_llama_config_t *l, bool f64) {
  cJSON *a = cJSON_AddArrayToObject(o, "architectures");
  cJSON_AddItemToArray(a, cJSON_CreateString("LlamaForCausalLM"));
  cJSON_AddBoolToObject(o, "attention_bias", l->attention_bias);
  add_num(o, "attention_dropout", l->attention_dropout);
  add_id(o, "bos_token_id", l->bos_token_id);
  add_id(o, "eos_token_id", l->eos_token_id);
  add_num(o, "head_dim",
          (double)(l->head_dim ? l->head_dim : l->hidden_size / l->num_attention_heads));
  cJSON_AddStringToObject(o, "hidden_act", l->hidden_act);
  add_num(o, "hidden_size", (double)l->hidden_size);
  add_num(o, "initializer_range", l->initializer_range);
  add_num(o, "intermediate_size", (double)l->intermediate_size);
  add_num(o, "max_position_embeddings", (double)l->max_position_embeddings);
  cJSON_AddBoolToObject(o, "mlp_bias", l->mlp_bias);
  cJSON_AddStringToObject(o, "model_type", "llama");
  add_num(o, "num_attention_heads", (double)l->num_attention_heads);
  add_num(o, "num_hidden_layers", (double)l->num_hidden_layers);
  add_num(o, "num_key_value_heads", (double)l->num_key_value_heads);
  add_id(o, "pad_token_id", l->pad_token_id);
  add_num(o, "pretraining_tp", 1);
  add_num(o, "rms_norm_eps", l->rms_norm_eps);
  const ddp_rope_scaling_t *r = &l->rope_scaling;
  if (r->type == DDP_ROPE_DEFAULT) {
    cJSON_AddNullToObject(o, "rope_scaling");
  } else {
    static const char *names[] = {"default", "linear", "dynamic", "llama3"};
    cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
    add_num(rs, "factor", r->factor);
    if (r->type == DDP_ROPE_LLAMA3) {
      add_num(rs, "high_freq_factor", r->high_freq_factor);
      add_num(rs, "low_freq_factor", r->low_freq_factor);
      add_num(rs, "original_max_position_embeddings", (double)r->original_max_position_embeddings);
    }
    cJSON_AddStringToObject(rs, "rope_type", names[r->type]);
  }
  add_num(o, "rope_theta", l->rope_theta);
  cJSON_AddBoolToObject(o, "tie_word_embeddings", l->tie_word_embeddings);
  cJSON_AddStringToObject(o, "torch_dtype", f64 ? "float64" : "float32");
  add_num(o, "vocab_size", (double)l->vocab_size);
  return o;
}

/* The config as save_pretrained writes it: Transformers' keys in sorted order. */
static cJSON *to_json(const ddp_hf_config_t *cfg) {
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  bool f64 = cfg->torch_dtype == DDP_F64;
  if (cfg->model_type == DDP_HF_GPT2) {
    const ddp_gpt2_config_t *g = &cfg->gpt2;
    cJSON_AddStringToObject(o, "activation_function", g->activation_function);
    cJSON *a = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(a, cJSON_CreateString("GPT2LMHeadModel"));
    add_num(o, "attn_pdrop", g->attn_pdrop);
    add_num(o, "embd_pdrop", g->embd_pdrop);
    add_num(o, "initializer_range", g->initializer_range);
    add_num(o, "layer_norm_epsilon", g->layer_norm_epsilon);
    cJSON_AddStringToObject(o, "model_type", "gpt2");
    add_num(o, "n_embd", (double)g->n_embd);
    add_num(o, "n_head", (double)g->n_head);
    if (g->n_inner)
      add_num(o, "n_inner", (double)g->n_inner);
    else
      cJSON_AddNullToObject(o, "n_inner");
    add_num(o, "n_layer", (double)g->n_layer);
    add_num(o, "n_positions", (double)g->n_positions);
    cJSON_AddBoolToObject(o, "reorder_and_upcast_attn", g->reorder_and_upcast_attn);
    add_num(o, "resid_pdrop", g->resid_pdrop);
    cJSON_AddBoolToObject(o, "scale_attn_by_inverse_layer_idx", g->scale_attn_by_inverse_layer_idx);
    cJSON_AddBoolToObject(o, "scale_attn_weights", g->scale_attn_weights);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", g->tie_word_embeddings);
    cJSON_AddStringToObject(o, "torch_dtype", f64 ? "float64" : "float32");
    add_num(o, "vocab_size", (double)g->vocab_size);
    return o;
  }
  if (cfg->model_type == DDP_HF_LLAMA) return llama_json(o, &cfg->llama, f64);
  const ddp_bert_config_t *b = &cfg->bert;
  cJSON *a = cJSON_AddArrayToObject(o, "architectures");
  cJSON_AddItemToArray(a, cJSON_CreateString("BertForSequenceClassification"));
  add_num(o, "attention_probs_dropout_prob", b->attention_probs_dropout_prob);
  if (b->classifier_dropout == -1)
    cJSON_AddNullToObject(o, "classifier_dropout");
  else
    add_num(o, "classifier_dropout", b->classifier_dropout);
  cJSON_AddStringToObject(o, "hidden_act", b->hidden_act);
  add_num(o, "hidden_dropout_prob", b->hidden_dropout_prob);
  add_num(o, "hidden_size", (double)b->hidden_size);
  cJSON *id2 = cJSON_AddObjectToObject(o, "id2label");
  for (int64_t i = 0; id2 && i < b->num_labels; i++) {
    char k[32], v[40];
    snprintf(k, sizeof k, "%lld", (long long)i);
    snprintf(v, sizeof v, "LABEL_%lld", (long long)i);
    cJSON_AddStringToObject(id2, k, v);
  }
  add_num(o, "initializer_range", b->initializer_range);
  add_num(o, "intermediate_size", (double)b->intermediate_size);
  cJSON *l2 = cJSON_AddObjectToObject(o, "label2id");
  for (int64_t i = 0; l2 && i < b->num_labels; i++) {
    char k[40];
    snprintf(k, sizeof k, "LABEL_%lld", (long long)i);
    add_num(l2, k, (double)i);
  }
  add_num(o, "layer_norm_eps", b->layer_norm_eps);
  add_num(o, "max_position_embeddings", (double)b->max_position_embeddings);
  cJSON_AddStringToObject(o, "model_type", "bert");
  add_num(o, "num_attention_heads", (double)b->num_attention_heads);
  add_num(o, "num_hidden_layers", (double)b->num_hidden_layers);
  if (b->pad_token_id >= 0)
    add_num(o, "pad_token_id", (double)b->pad_token_id);
  else
    cJSON_AddNullToObject(o, "pad_token_id");
  cJSON_AddStringToObject(o, "position_embedding_type", "absolute");
  if (b->problem_type[0]) cJSON_AddStringToObject(o, "problem_type", b->problem_type);
  cJSON_AddStringToObject(o, "torch_dtype", f64 ? "float64" : "float32");
  add_num(o, "type_vocab_size", (double)b->type_vocab_size);
  add_num(o, "vocab_size", (double)b->vocab_size);
  return o;
}

/* text and a newline to path, atomically (src/common/file.c). */
static ddp_status_t write_atomic(const char *path, const char *text, ddp_error_t *err) {
  ddp__afile_t f;
  if (ddp__afile_open(&f, path, -1, "config.json", err) == DDP_OK) {
    ddp__afile_write(&f, text, strlen(text));
    ddp__afile_write(&f, "\n", 1);
  }
  return ddp__afile_commit(&f, 0644);
}

static int cmp_key(const void *a, const void *b) {
  return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* The kept keys into o (replacing o's own of the same name), then every key in sorted order
 * (save_pretrained's sort_keys). On failure o is freed. */
static ddp_status_t merge_extra(cJSON *o, const char *extra, const char *path, ddp_error_t *err) {
  cJSON *x = cJSON_Parse(extra);
  ddp_status_t st = x && cJSON_IsObject(x) ? DDP_OK : DDP_ERR_INVALID_ARGUMENT;
  while (st == DDP_OK && x->child) {
    cJSON *k = cJSON_DetachItemViaPointer(x, x->child);
    cJSON_DeleteItemFromObjectCaseSensitive(o, k->string);
    cJSON_AddItemToObject(o, k->string, k);
  }
  cJSON_Delete(x);
  size_t n = (size_t)cJSON_GetArraySize(o);
  cJSON **items = st == DDP_OK ? ddp__calloc(n ? n : 1, sizeof *items) : NULL;
  if (st == DDP_OK && !items) st = DDP_ERR_NO_MEMORY;
  for (size_t i = 0; st == DDP_OK && i < n; i++) items[i] = cJSON_DetachItemViaPointer(o, o->child);
  if (st == DDP_OK) {
    qsort(items, n, sizeof *items, cmp_key);
    for (size_t i = 0; i < n; i++) cJSON_AddItemToObject(o, items[i]->string, items[i]);
  }
  ddp__free(items);
  if (st == DDP_OK) return DDP_OK;
  cJSON_Delete(o);
  return ddp__error(err, -1, st, "%s: %s", path,
                    st == DDP_ERR_NO_MEMORY ? "out of memory"
                                            : "the config's extra keys are not a JSON object");
}

ddp_status_t ddp_hf_config_to_json(const ddp_hf_config_t *cfg, char **out, ddp_error_t *err) {
  DDP_REQUIRE(cfg && out);
  *out = NULL;
  DDP_CHECK(ddp_hf_config_check(cfg, NULL, err));
  cJSON *o = to_json(cfg);
  if (o && cfg->extra[0]) DDP_CHECK(merge_extra(o, cfg->extra, "config.json", err));
  char *text = o ? cJSON_Print(o) : NULL;
  cJSON_Delete(o);
  size_t n = text ? strlen(text) : 0;
  *out = text ? ddp__malloc(n + 1) : NULL;
  if (*out) memcpy(*out, text, n + 1);
  cJSON_free(text);
  if (!*out) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "config.json: out of memory");
  return DDP_OK;
}

ddp_status_t ddp_hf_config_write(const ddp_hf_config_t *cfg, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(cfg && path);
  DDP_CHECK(ddp_hf_config_check(cfg, path, err));
  char *text = NULL;
  DDP_CHECK(ddp_hf_config_to_json(cfg, &text, err));
  ddp_status_t st = write_atomic(path, text, err);
  ddp__free(text);
  return st;
}
