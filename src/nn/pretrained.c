/* The Transformers families as models: building from a config, the task and its loss,
 * Transformers' _init_weights, and checkpoint directories as save_pretrained and
 * from_pretrained lay them out (config.json + model.safetensors). The families themselves are
 * gpt2.c, bert.c and llama.c, each registered in hf_families.c's table, which this file reads
 * (the families call only hf_init.c below them, never this file); config.json is
 * hf_config.c. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

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

ddp_status_t ddp_parse_file_size(const char *text, const char *what, int64_t *bytes,
                                 ddp_error_t *err) {
  DDP_REQUIRE(text && what && bytes);
  /* Transformers' convert_file_size_to_int: the unit decides the factor; a lower-case "b"
   * after a decimal unit means bits. Plain digits are bytes (its int argument). */
  static const struct {
    const char *unit;
    int64_t factor;
  } units[] = {{"GIB", 1LL << 30},   {"MIB", 1LL << 20}, {"KIB", 1LL << 10},
               {"GB", 1000000000LL}, {"MB", 1000000LL},  {"KB", 1000LL}};
  size_t n = strlen(text), digits = 0;
  while (digits < n && text[digits] >= '0' && text[digits] <= '9') digits++;
  int64_t factor = 0, divisor = 1;
  if (digits > 0 && digits == n) factor = 1;
  for (size_t u = 0; !factor && digits > 0 && u < DDP_ARRAY_LEN(units); u++) {
    const char *unit = units[u].unit;
    if (n - digits != strlen(unit)) continue;
    bool same = true;
    for (size_t i = 0; same && unit[i]; i++)
      same = (text[digits + i] & ~0x20) == unit[i]; /* ASCII letters, either case */
    if (!same) continue;
    factor = units[u].factor;
    if (strlen(unit) == 2 && text[n - 1] == 'b') divisor = 8;
  }
  int64_t v = 0;
  for (size_t i = 0; factor && i < digits; i++) {
    if (v > (INT64_MAX - 9) / 10) factor = 0; /* overflow */
    v = v * 10 + (text[i] - '0');
  }
  if (factor && v > INT64_MAX / factor) factor = 0;
  if (!factor || v * factor / divisor < 1)
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "%s: '%s' is not a valid size: use an integer followed by the unit, "
                            "e.g. "
                            "'5GB' (also KB, MB, KiB, MiB, GiB; a lower-case b means bits), or a "
                            "number of bytes > 0",
                            what, text);
  *bytes = v * factor / divisor;
  return DDP_OK;
}

/* Appends s to the file as a JSON string the way Python's json.dumps writes it
 * (ensure_ascii: every non-ASCII code point as \uXXXX, surrogate pairs above U+FFFF).
 * Names are valid UTF-8 (ddp_st_write refuses others). */
static void json_str(ddp__afile_t *f, const char *s) {
  char out[16];
  ddp__afile_write(f, "\"", 1);
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    uint32_t c = *p++;
    int more = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
    if (more) c &= 0x3Fu >> more;
    for (; more > 0 && *p; more--) c = (c << 6) | (*p++ & 0x3Fu);
    int k;
    if (c == '"' || c == '\\')
      k = snprintf(out, sizeof out, "\\%c", (char)c);
    else if (c >= 0x20 && c < 0x7F)
      k = snprintf(out, sizeof out, "%c", (char)c);
    else if (c == '\n' || c == '\r' || c == '\t' || c == '\b' || c == '\f')
      k = snprintf(out, sizeof out, "\\%c",
                   c == '\n'   ? 'n'
                   : c == '\r' ? 'r'
                   : c == '\t' ? 't'
                   : c == '\b' ? 'b'
                               : 'f');
    else if (c > 0xFFFF)
      k = snprintf(out, sizeof out, "\\u%04x\\u%04x", 0xD800 + ((c - 0x10000) >> 10),
                   0xDC00 + ((c - 0x10000) & 0x3FF));
    else
      k = snprintf(out, sizeof out, "\\u%04x", c);
    ddp__afile_write(f, out, (size_t)k);
  }
  ddp__afile_write(f, "\"", 1);
}

typedef struct placed {
  const char *name;
  size_t shard;
} placed_t;

static int cmp_placed(const void *a, const void *b) {
  return strcmp(((const placed_t *)a)->name, ((const placed_t *)b)->name);
}

static void shard_name(char *buf, size_t len, size_t k, size_t n) {
  snprintf(buf, len, "model-%05zu-of-%05zu.safetensors", k + 1, n);
}

/* Whether name is model-DDDDD-of-DDDDD.safetensors (Transformers' (.*?)-\d{5}-of-\d{5}
 * pattern for the weights name "model"). */
static bool is_shard_name(const char *name) {
  const char *pat = "model-#####-of-#####.safetensors";
  if (strlen(name) != strlen(pat)) return false;
  for (size_t i = 0; pat[i]; i++)
    if (pat[i] == '#' ? !(name[i] >= '0' && name[i] <= '9') : name[i] != pat[i]) return false;
  return true;
}

/* Removes what an earlier save left that this one did not write: shard files other than the
 * nshards just written, and the single file (sharded) or the index (single). */
static ddp_status_t remove_stale(const char *dir, size_t nshards, ddp_error_t *err) {
  char path[4200], keep[64];
  DIR *d = opendir(dir);
  if (!d)
    return ddp__error(err, -1, DDP_ERR_SYSTEM, "save_pretrained: opendir %s: %s (errno %d)", dir,
                      strerror(errno), errno);
  ddp_status_t st = DDP_OK;
  for (struct dirent *e; st == DDP_OK && (e = readdir(d));) {
    bool stale = is_shard_name(e->d_name);
    for (size_t k = 0; stale && nshards > 1 && k < nshards; k++) {
      shard_name(keep, sizeof keep, k, nshards);
      stale = strcmp(keep, e->d_name) != 0;
    }
    stale = stale ||
            !strcmp(e->d_name, nshards > 1 ? "model.safetensors" : "model.safetensors.index.json");
    if (!stale) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) != 0 && errno != ENOENT)
      st = ddp__error(err, -1, DDP_ERR_SYSTEM,
                      "save_pretrained: cannot remove %s from an earlier save: %s (errno %d)", path,
                      strerror(errno), errno);
  }
  closedir(d);
  if (st == DDP_OK) st = ddp__sync_dir(dir, -1, "save_pretrained", err);
  return st;
}

static ddp_status_t write_index(const char *path, const ddp_st_entry_t *es, size_t n,
                                const size_t *shard_of, size_t nshards, int64_t total,
                                ddp_error_t *err) {
  placed_t *sorted = ddp__calloc(n ? n : 1, sizeof *sorted);
  if (!sorted) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "save_pretrained: out of memory");
  for (size_t i = 0; i < n; i++) sorted[i] = (placed_t){es[i].name, shard_of[i]};
  qsort(sorted, n, sizeof *sorted, cmp_placed); /* json.dumps(sort_keys=True) */
  ddp__afile_t f;
  ddp_status_t st = ddp__afile_open(&f, path, -1, "save_pretrained", err);
  if (st != DDP_OK) goto out;
  char line[128], file[64];
  snprintf(line, sizeof line, "{\n  \"metadata\": {\n    \"total_size\": %lld\n  },\n",
           (long long)total);
  ddp__afile_write(&f, line, strlen(line));
  ddp__afile_write(&f, "  \"weight_map\": {", 17);
  for (size_t i = 0; i < n; i++) {
    const char *sep = i ? ",\n    " : "\n    ";
    ddp__afile_write(&f, sep, strlen(sep));
    json_str(&f, sorted[i].name);
    shard_name(file, sizeof file, sorted[i].shard, nshards);
    ddp__afile_write(&f, ": ", 2);
    json_str(&f, file);
  }
  const char *end = n ? "\n  }\n}\n" : "}\n}\n";
  ddp__afile_write(&f, end, strlen(end));
  st = ddp__afile_commit(&f, 0644);
out:
  ddp__free(sorted);
  return st;
}

ddp_status_t ddp_model_save_pretrained(ddp_model_t *m, const char *dir, ddp_error_t *err) {
  return ddp_model_save_pretrained_sharded(m, dir, DDP_MAX_SHARD_SIZE_DEFAULT, err);
}

ddp_status_t ddp_model_save_pretrained_sharded(ddp_model_t *m, const char *dir,
                                               int64_t max_shard_size, ddp_error_t *err) {
  DDP_REQUIRE(m && dir && ddp_model_finalized(m));
  const ddp_hf_config_t *hf = ddp_model_hf_config(m);
  if (!hf)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "save_pretrained: the model is not a Transformers model (gpt2, bert, "
                      "llama); "
                      "use ddp_model_save");
  if (max_shard_size < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "save_pretrained: max_shard_size must be > 0 bytes (got %lld)",
                      (long long)max_shard_size);
  char path[4096];
  DDP_CHECK(ddp__mkdirs(dir, -1, "save_pretrained", err)); /* os.makedirs(exist_ok=True) */
  DDP_CHECK(join(path, sizeof path, dir, "config.json", err));
  DDP_CHECK(ddp_hf_config_write(hf, path, err)); /* torch_dtype: the model's dtype */
  /* The state_dict: parameters (the tied lm_head is no parameter of its own), then buffers. */
  size_t np = ddp_model_num_params(m), nb = ddp_model_num_buffers(m), n = np + nb;
  ddp_st_entry_t *es = ddp__calloc(n + 1, sizeof *es);
  size_t *shard_of = ddp__calloc(n + 1, sizeof *shard_of);
  ddp_status_t st = DDP_OK;
  if (!es || !shard_of) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "save_pretrained: out of memory");
    goto out;
  }
  for (size_t i = 0; i < np; i++) {
    es[i].name = ddp_model_param(m, i)->name;
    es[i].tensor = &ddp_model_param(m, i)->value;
  }
  for (size_t i = 0; i < nb; i++) {
    es[np + i].name = ddp_model_buffer(m, i)->name;
    es[np + i].tensor = &ddp_model_buffer(m, i)->value;
  }
  /* Transformers' shard_checkpoint: a new shard when this tensor would tip the current one
   * over the limit, but only once the current one holds a tensor. */
  size_t nshards = 1, in_block = 0;
  int64_t block = 0, total = 0;
  for (size_t i = 0; i < n; i++) {
    int64_t bytes = es[i].tensor->numel * (int64_t)ddp_dtype_size(es[i].tensor->dtype);
    if (block + bytes > max_shard_size && in_block > 0) {
      nshards++;
      block = 0;
      in_block = 0;
    }
    shard_of[i] = nshards - 1;
    block += bytes;
    total += bytes;
    in_block++;
  }
  const char *mk[1] = {"format"}, *mv[1] = {"pt"};
  if (nshards == 1) {
    st = join(path, sizeof path, dir, "model.safetensors", err);
    if (st == DDP_OK) st = ddp_st_write(path, es, n, mk, mv, 1, err);
  } else {
    for (size_t k = 0, first = 0; st == DDP_OK && k < nshards; k++) {
      size_t last = first;
      while (last < n && shard_of[last] == k) last++;
      char file[64];
      shard_name(file, sizeof file, k, nshards);
      st = join(path, sizeof path, dir, file, err);
      if (st == DDP_OK) st = ddp_st_write(path, es + first, last - first, mk, mv, 1, err);
      first = last;
    }
    if (st == DDP_OK) st = join(path, sizeof path, dir, "model.safetensors.index.json", err);
    if (st == DDP_OK) st = write_index(path, es, n, shard_of, nshards, total, err);
  }
  if (st == DDP_OK) st = remove_stale(dir, nshards, err);
out:
  ddp__free(shard_of);
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

/* DIR's weights, open: model.safetensors, or else every file the index names, checked
 * against the index so that no tensor is in two files. */
typedef struct weights {
  ddp_st_file_t **files;
  size_t nfiles;
  char source[4200]; /* the file or the index, for messages */
} weights_t;

static void close_weights(weights_t *w) {
  for (size_t f = 0; f < w->nfiles; f++) ddp_st_close(w->files[f]);
  ddp__free(w->files);
  w->files = NULL;
  w->nfiles = 0;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks the open shards against the weight_map, both ways. */
static ddp_status_t check_index(const char *dir, const char *index, const cJSON *map,
                                ddp_st_file_t *const *files, const char *const *names,
                                size_t nfiles, ddp_error_t *err) {
  for (size_t f = 0; f < nfiles; f++)
    for (size_t i = 0; i < ddp_st_count(files[f]); i++) {
      const char *t = ddp_st_name(files[f], i);
      const cJSON *e = cJSON_GetObjectItemCaseSensitive(map, t);
      if (!e)
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "from_pretrained: tensor '%s' in %s/%s is not in the weight_map of %s", t,
                          dir, names[f], index);
      if (strcmp(e->valuestring, names[f]))
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "from_pretrained: tensor '%s' is in %s/%s, but %s puts it in %s", t, dir,
                          names[f], index, e->valuestring);
    }
  const cJSON *e;
  cJSON_ArrayForEach(e, map) {
    const char **hit = bsearch(&e->valuestring, names, nfiles, sizeof *names, cmp_str);
    size_t at;
    if (ddp_st_find(files[hit - names], e->string, &at) != DDP_OK)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "from_pretrained: %s puts tensor '%s' in %s, but %s/%s does not hold it",
                        index, e->string, e->valuestring, dir, e->valuestring);
  }
  return DDP_OK;
}

static ddp_status_t open_index(const char *dir, weights_t *w, ddp_error_t *err) {
  char *text = NULL, path[4200];
  cJSON *root = NULL;
  const char **names = NULL;
  ddp_status_t st = ddp__file_read(w->source, 1u << 28, -1, "from_pretrained", &text, NULL, err);
  if (st == DDP_OK) st = ddp__json_read(text, w->source, -1, &root, err);
  ddp__free(text);
  if (st != DDP_OK) return st;
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map"), *e;
  size_t n = 0;
  if (!cJSON_IsObject(map)) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "from_pretrained: %s has no \"weight_map\" object", w->source);
    goto out;
  }
  cJSON_ArrayForEach(e, map) {
    if (!cJSON_IsString(e)) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "from_pretrained: %s: weight_map[\"%s\"] is not a file name (a string)",
                      w->source, e->string);
      goto out;
    }
    const char *v = e->valuestring;
    if (!*v || strchr(v, '/') || !strcmp(v, ".") || !strcmp(v, "..")) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "from_pretrained: %s: weight_map[\"%s\"] is \"%s\", not a file name in %s",
                      w->source, e->string, v, dir);
      goto out;
    }
    n++;
  }
  /* The files, sorted and unique, as Transformers lists them (sorted(set(...))). */
  names = ddp__calloc(n + 1, sizeof *names);
  w->files = ddp__calloc(n + 1, sizeof *w->files);
  if (!names || !w->files) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "from_pretrained: out of memory");
    goto out;
  }
  size_t nf = 0;
  cJSON_ArrayForEach(e, map) names[nf++] = e->valuestring;
  qsort(names, nf, sizeof *names, cmp_str);
  size_t u = 0;
  for (size_t i = 0; i < nf; i++)
    if (u == 0 || strcmp(names[u - 1], names[i])) names[u++] = names[i];
  for (size_t f = 0; f < u; f++) {
    st = join(path, sizeof path, dir, names[f], err);
    if (st != DDP_OK) goto out;
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT) {
      const char *example = "";
      cJSON_ArrayForEach(e, map) if (!strcmp(e->valuestring, names[f])) {
        example = e->string;
        break;
      }
      st = ddp__error(err, -1, DDP_ERR_NOT_FOUND,
                      "from_pretrained: %s names %s (for tensor '%s'), which is not in %s",
                      w->source, names[f], example, dir);
      goto out;
    }
    st = ddp_st_open(path, DDP_ST_MMAP, &w->files[f], err); /* names the path */
    if (st != DDP_OK) goto out;
    w->nfiles++;
  }
  st = check_index(dir, w->source, map, w->files, names, w->nfiles, err);
out:
  if (st != DDP_OK) close_weights(w);
  ddp__free(names);
  cJSON_Delete(root);
  return st;
}

static ddp_status_t open_weights(const char *dir, weights_t *w, ddp_error_t *err) {
  memset(w, 0, sizeof *w);
  struct stat sb;
  DDP_CHECK(join(w->source, sizeof w->source, dir, "model.safetensors", err));
  if (stat(w->source, &sb) == 0 || errno != ENOENT) { /* from_pretrained's first choice */
    w->files = ddp__calloc(1, sizeof *w->files);
    if (!w->files) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "from_pretrained: out of memory");
    ddp_status_t st = ddp_st_open(w->source, DDP_ST_MMAP, &w->files[0], err);
    if (st != DDP_OK) {
      close_weights(w);
      return st;
    }
    w->nfiles = 1;
    return DDP_OK;
  }
  DDP_CHECK(join(w->source, sizeof w->source, dir, "model.safetensors.index.json", err));
  if (stat(w->source, &sb) != 0 && errno == ENOENT)
    return ddp__error(err, -1, DDP_ERR_NOT_FOUND,
                      "from_pretrained: no file named model.safetensors or "
                      "model.safetensors.index.json found in directory %s",
                      dir);
  return open_index(dir, w, err);
}

ddp_status_t ddp_model_load_pretrained(ddp_model_t *m, const char *dir, ddp_error_t *err) {
  DDP_REQUIRE(m && dir && ddp_model_finalized(m));
  const ddp_hf_config_t *cfg = ddp_model_hf_config(m);
  if (!cfg)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "from_pretrained: the model is not a Transformers model (gpt2, bert, "
                      "llama); use ddp_model_load");
  keymap_t km = {"bert.", false, NULL};
  if (cfg->model_type == DDP_HF_GPT2) {
    km.prefix = "transformer.";
    km.tied = cfg->gpt2.tie_word_embeddings ? "transformer.wte.weight" : NULL;
  } else if (cfg->model_type == DDP_HF_LLAMA) {
    km.prefix = "model.";
    km.tied = cfg->llama.tie_word_embeddings ? "model.embed_tokens.weight" : NULL;
  }
  weights_t w;
  DDP_CHECK(open_weights(dir, &w, err));
  /* A base-model checkpoint (GPT2Model, BertModel, LlamaModel) names "wte.weight", not
   * "transformer.wte.weight": Transformers adds the prefix when no key carries it. */
  size_t nkeys = 0;
  for (size_t f = 0; f < w.nfiles; f++) nkeys += ddp_st_count(w.files[f]);
  km.add_prefix = nkeys > 0;
  for (size_t f = 0; f < w.nfiles; f++)
    for (size_t i = 0; i < ddp_st_count(w.files[f]); i++)
      if (!strncmp(ddp_st_name(w.files[f], i), km.prefix, strlen(km.prefix))) km.add_prefix = false;
  ddp_status_t st = ddp__model_load_files(m, w.files, w.nfiles, w.source, true, map_key, &km, NULL,
                                          NULL, err);
  close_weights(&w);
  return st;
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
  st = ddp_model_load_pretrained(m, dir, err);
  if (st != DDP_OK) {
    ddp_model_destroy(m);
    return st;
  }
  *out = m;
  return DDP_OK;
}
