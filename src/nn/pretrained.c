/* The Transformers families as models: building from a config, the task and its loss,
 * Transformers' _init_weights, and checkpoint directories as save_pretrained and
 * from_pretrained lay them out (config.json + model.safetensors). The families themselves are
 * gpt2.c, bert.c and llama.c, each registered in hf_families.c's table, which this file reads
 * (the families call only hf_init.c below them, never this file); config.json is
 * hf_config.c. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "nn/nn_internal.h"

/* ---------------------------------------------------------------- families -------- */

ddp_status_t ddp_model_from_hf_config(const ddp_hf_config_t *cfg, ddp_dtype_t dt, ddp_model_t **out,
                                      ddp_error_t *err) {
  DDP_REQUIRE(cfg && out);
  *out = NULL;
  if (dt != DDP_F32 && dt != DDP_F64)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "from_hf_config: dtype must be F32 or F64 (got %s)", ddp_dtype_name(dt));
  DDP_CHECK(ddp_hf_config_check(cfg, NULL, err));
  ddp_model_t *m;
  if (ddp_model_create(&m) != DDP_OK)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "from_hf_config: out of memory");
  const ddp__hf_family_t *fam = ddp__hf_family_find(cfg->model_type);
  if (!fam) {
    ddp_model_destroy(m);
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "from_hf_config: no model family registered for model_type %d",
                      (int)cfg->model_type);
  }
  ddp_status_t st = fam->build(m, cfg, dt, err);
  if (st == DDP_OK) {
    st = ddp_model_finalize(m);
    if (st != DDP_OK) {
      double bytes = 0; /* values and gradients */
      for (size_t i = 0; i < ddp_model_num_params(m); i++) {
        const ddp_tensor_t *v = &ddp_model_param(m, i)->value;
        bytes += 2.0 * (double)v->numel * (double)ddp_dtype_size(v->dtype);
      }
      ddp__error(err, -1, st,
                 "from_hf_config: cannot allocate the parameters and their gradients: out of "
                 "memory asking for %.0f bytes (%.3g GB) in one block, for %zu tensors",
                 bytes, bytes * 1e-9, ddp_model_num_params(m));
    }
  }
  if (st != DDP_OK) {
    ddp_model_destroy(m);
    return st;
  }
  *out = m;
  return DDP_OK;
}

ddp_status_t ddp__model_from_hf_json(const char *json, ddp_model_t **out, ddp_error_t *err) {
  ddp_hf_config_t cfg;
  DDP_CHECK(ddp_hf_config_parse(json, "model json", &cfg, err));
  return ddp_model_from_hf_config(&cfg, cfg.torch_dtype, out, err);
}

ddp_model_task_t ddp_model_task(const ddp_model_t *m) {
  const ddp__family_t *fam = ddp__model_family(m, NULL);
  return fam ? fam->task : DDP_TASK_DEFAULT;
}

const ddp_hf_config_t *ddp_model_hf_config(const ddp_model_t *m) {
  void *state;
  return ddp__model_family(m, &state) ? (const ddp_hf_config_t *)state : NULL;
}

/* ---------------------------------------------------------------- loss ------------ */

/* labels as a [B] var of logits' dtype (a copy when the dtype differs). */
static ddp_status_t float_labels(ddp_ctx_t *c, ddp_var_t *logits, ddp_var_t *labels,
                                 ddp_var_t **out) {
  if (labels->value.dtype == logits->value.dtype) {
    *out = labels;
    return DDP_OK;
  }
  DDP_CHECK(ddp_var_new(c, logits->value.dtype, labels->value.ndim, labels->value.shape, NULL,
                        false, out));
  return ddp_tensor_copy(&(*out)->value, &labels->value);
}

ddp_status_t ddp_model_loss(ddp_model_t *m, ddp_ctx_t *c, ddp_var_t *logits, ddp_var_t *labels,
                            ddp_var_t **loss) {
  DDP_REQUIRE(m && c && logits && labels && loss);
  bool ints = labels->value.dtype == DDP_I64;
  const ddp_hf_config_t *hf = ddp_model_hf_config(m);
  switch (ddp_model_task(m)) {
    case DDP_TASK_CAUSAL_LM: return ddp_causal_lm_loss(c, logits, labels, -100, loss);
    case DDP_TASK_SEQ_CLASSIFICATION: {
      const char *pt = hf->bert.problem_type;
      bool regression = !strcmp(pt, "regression") || (!*pt && hf->bert.num_labels == 1);
      if (!regression && ints) return ddp_cross_entropy(c, logits, labels, -100, loss);
      if (!regression)
        return ddp__ctx_error(c, DDP_ERR_UNSUPPORTED,
                              "loss: float labels with num_labels = %lld would be Transformers' "
                              "multi_label_classification (BCE), which libddp does not have; "
                              "give I64 class labels",
                              (long long)hf->bert.num_labels);
      /* Regression: MSE of logits.squeeze() against labels.squeeze() (num_labels 1: [B]),
       * or of logits [B, num_labels] against labels of that shape. */
      if (labels->value.numel != logits->value.numel)
        return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                              "loss: regression labels must have %lld values (logits %lld x %lld)",
                              (long long)logits->value.numel, (long long)logits->value.shape[0],
                              (long long)hf->bert.num_labels);
      ddp_var_t *t;
      DDP_CHECK(float_labels(c, logits, labels, &t));
      DDP_CHECK(ddp_reshape(c, t, logits->value.ndim, logits->value.shape, &t));
      return ddp_mse_loss(c, logits, t, loss);
    }
    case DDP_TASK_DEFAULT: break;
  }
  if (ints) return ddp_cross_entropy(c, logits, labels, -100, loss);
  ddp_var_t *t;
  DDP_CHECK(float_labels(c, logits, labels, &t));
  return ddp_mse_loss(c, logits, t, loss);
}

/* ---------------------------------------------------------------- directories ----- */

static ddp_status_t join(char *buf, size_t len, const char *dir, const char *file,
                         ddp_error_t *err) {
  int k = snprintf(buf, len, "%s/%s", dir, file);
  if (k < 0 || (size_t)k >= len)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "pretrained: path too long: %s", dir);
  return DDP_OK;
}

ddp_status_t ddp_model_save_pretrained(ddp_model_t *m, const char *dir, ddp_error_t *err) {
  DDP_REQUIRE(m && dir && ddp_model_finalized(m));
  const ddp_hf_config_t *hf = ddp_model_hf_config(m);
  if (!hf)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "save_pretrained: the model is not a Transformers model (gpt2, bert, "
                      "llama); "
                      "use ddp_model_save");
  char path[4096];
  DDP_CHECK(ddp__mkdirs(dir, -1, "save_pretrained", err)); /* os.makedirs(exist_ok=True) */
  DDP_CHECK(join(path, sizeof path, dir, "config.json", err));
  DDP_CHECK(ddp_hf_config_write(hf, path, err)); /* torch_dtype: the model's dtype */
  /* The state_dict: parameters (the tied lm_head is no parameter of its own), then buffers. */
  size_t np = ddp_model_num_params(m), nb = ddp_model_num_buffers(m);
  ddp_st_entry_t *es = ddp__calloc(np + nb, sizeof *es);
  if (!es) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "save_pretrained: out of memory");
  for (size_t i = 0; i < np; i++) {
    es[i].name = ddp_model_param(m, i)->name;
    es[i].tensor = &ddp_model_param(m, i)->value;
  }
  for (size_t i = 0; i < nb; i++) {
    es[np + i].name = ddp_model_buffer(m, i)->name;
    es[np + i].tensor = &ddp_model_buffer(m, i)->value;
  }
  const char *mk[1] = {"format"}, *mv[1] = {"pt"};
  ddp_status_t st = join(path, sizeof path, dir, "model.safetensors", err);
  if (st == DDP_OK) st = ddp_st_write(path, es, np + nb, mk, mv, 1, err);
  ddp__free(es);
  return st;
}

/* How the checkpoint's keys map onto the model's names. */
typedef struct keymap {
  const char *prefix; /* "transformer.", "bert." or "model." */
  bool add_prefix;    /* a base-model checkpoint: no key carries the prefix */
  const char *tied;   /* the embedding a tied lm_head.weight is (NULL: untied) */
} keymap_t;

static bool ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && !strcmp(s + a - b, suffix);
}

/* Transformers' tolerances (modeling_gpt2.py, modeling_bert.py, modeling_llama.py):
 * non-persistent buffers that older checkpoints hold (GPT-2's causal mask, BERT's
 * position_ids, Llama's rotary inv_freq) are dropped; a tied lm_head.weight names the
 * embedding. */
static const char *map_key(void *user, const char *key, char *buf, size_t len) {
  const keymap_t *km = user;
  if (ends_with(key, ".attn.bias") || ends_with(key, ".attn.masked_bias") ||
      ends_with(key, "embeddings.position_ids") || ends_with(key, ".rotary_emb.inv_freq"))
    return NULL;
  if (km->tied && !strcmp(key, "lm_head.weight")) return km->tied;
  if (!km->add_prefix || !strncmp(key, "lm_head.", 8) || !strncmp(key, "classifier.", 11))
    return key;
  int k = snprintf(buf, len, "%s%s", km->prefix, key);
  return k < 0 || (size_t)k >= len ? key : buf;
}

ddp_status_t ddp_model_from_pretrained(const char *dir, ddp_dtype_t dt, ddp_model_t **out,
                                       ddp_error_t *err) {
  DDP_REQUIRE(dir && out);
  *out = NULL;
  char path[4096];
  char *text;
  ddp_hf_config_t cfg;
  DDP_CHECK(join(path, sizeof path, dir, "config.json", err));
  DDP_CHECK(ddp__file_read(path, 1u << 24, -1, "from_pretrained", &text, NULL, err));
  ddp_status_t st = ddp_hf_config_parse(text, path, &cfg, err);
  ddp__free(text);
  DDP_CHECK(st);
  ddp_model_t *m;
  DDP_CHECK(ddp_model_from_hf_config(&cfg, dt, &m, err));
  keymap_t km = {"bert.", false, NULL};
  if (cfg.model_type == DDP_HF_GPT2) {
    km.prefix = "transformer.";
    km.tied = cfg.gpt2.tie_word_embeddings ? "transformer.wte.weight" : NULL;
  } else if (cfg.model_type == DDP_HF_LLAMA) {
    km.prefix = "model.";
    km.tied = cfg.llama.tie_word_embeddings ? "model.embed_tokens.weight" : NULL;
  }
  ddp_st_file_t *f = NULL;
  DDP_CHECK_GOTO(join(path, sizeof path, dir, "model.safetensors", err), st, fail);
  DDP_CHECK_GOTO(ddp_st_open(path, DDP_ST_MMAP, &f, err), st, fail);
  /* A base-model checkpoint (GPT2Model, BertModel, LlamaModel) names "wte.weight", not
   * "transformer.wte.weight": Transformers adds the prefix when no key carries it. */
  km.add_prefix = ddp_st_count(f) > 0;
  for (size_t i = 0; i < ddp_st_count(f); i++)
    if (!strncmp(ddp_st_name(f, i), km.prefix, strlen(km.prefix))) km.add_prefix = false;
  ddp_st_close(f);
  DDP_CHECK_GOTO(ddp__model_load_mapped(m, path, true, map_key, &km, NULL, NULL, err), st, fail);
  *out = m;
  return DDP_OK;
fail:
  ddp_model_destroy(m);
  return st;
}
