/* Model files: a JSON description of a Sequential model (schema in docs/nn.md), built into
 * a ddp_model_t with PyTorch's state_dict names. A layer's "name" replaces its position in
 * those names (nn.Sequential(OrderedDict(...))); an "add" layer sums sub-networks. */
#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

typedef struct build {
  ddp_model_t *m;
  ddp_dtype_t dt;
  ddp_error_t *err;
  int depth;
} build_t;

#define MAX_DEPTH 16
#define NAME_LEN 512

static ddp_status_t bad(build_t *b, const char *path, const char *what) {
  return ddp__error(b->err, -1, DDP_ERR_INVALID_DATA, "model json: %s: %s", path, what);
}

/* Reads a required positive integer field. */
static ddp_status_t get_int(build_t *b, const cJSON *o, const char *path, const char *key,
                            int64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > 1e12 ||
      v->valuedouble != (double)(int64_t)v->valuedouble) {
    char w[96];
    snprintf(w, sizeof w, "field \"%s\" must be a positive integer", key);
    return bad(b, path, w);
  }
  *out = (int64_t)v->valuedouble;
  return DDP_OK;
}

/* "field \"key\" must be <what>, got <the value as JSON>". */
static ddp_status_t bad_field(build_t *b, const char *path, const char *key, const char *what,
                              const cJSON *v) {
  char *js = cJSON_PrintUnformatted(v);
  char w[256];
  snprintf(w, sizeof w, "field \"%s\" must be %s, got %.60s", key, what, js ? js : "?");
  cJSON_free(js);
  return bad(b, path, w);
}

/* An optional boolean field: absent is def; any other JSON type is an error. */
static ddp_status_t get_bool(build_t *b, const cJSON *o, const char *path, const char *key,
                             bool def, bool *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = def;
  if (!v) return DDP_OK;
  if (!cJSON_IsBool(v)) return bad_field(b, path, key, "true or false", v);
  *out = cJSON_IsTrue(v);
  return DDP_OK;
}

/* An optional finite number field in [lo, hi] (lo excluded when lo_open): absent is def. */
static ddp_status_t get_real(build_t *b, const cJSON *o, const char *path, const char *key,
                             double def, double lo, bool lo_open, double hi, double *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = def;
  if (!v) return DDP_OK;
  double x = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi) {
    char what[96];
    if (isinf(hi)) {
      snprintf(what, sizeof what, "a number %s %g", lo_open ? ">" : ">=", lo);
    } else {
      snprintf(what, sizeof what, "a number in %s%g, %g]", lo_open ? "(" : "[", lo, hi);
    }
    return bad_field(b, path, key, what, v);
  }
  *out = x;
  return DDP_OK;
}

/* An optional forward-flag bit "flag": an integer 0..63; absent is def. */
static ddp_status_t get_flag(build_t *b, const cJSON *o, const char *path, int def, int *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "flag");
  *out = def;
  if (!v) return DDP_OK;
  double f = cJSON_IsNumber(v) ? v->valuedouble : -1;
  if (f < 0 || f > 63 || f != (double)(int)f) {
    return bad_field(b, path, "flag", "0..63 (an integer)", v);
  }
  *out = (int)f;
  return DDP_OK;
}

static ddp_status_t build_seq(build_t *b, const cJSON *layers, const char *prefix, const char *path,
                              ddp_module_t **out);

/* A child's key: its "name" (non-empty, at most 64 characters, no '.', as add_module
 * requires), else its position k. */
static ddp_status_t child_key(build_t *b, const cJSON *o, int k, const char *path, char *key,
                              size_t cap) {
  const cJSON *nm = cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, "name") : NULL;
  if (!nm) {
    snprintf(key, cap, "%d", k);
    return DDP_OK;
  }
  if (!cJSON_IsString(nm) || !nm->valuestring[0] || strlen(nm->valuestring) > 64 ||
      strchr(nm->valuestring, '.'))
    return bad(b, path,
               "\"name\" must be a non-empty string of at most 64 characters "
               "without '.'");
  for (const char *c = nm->valuestring; *c; c++)
    if ((unsigned char)*c < 0x21 || *c == '"' || *c == '\\')
      return bad(b, path, "\"name\" may not contain spaces, quotes or backslashes");
  snprintf(key, cap, "%s", nm->valuestring);
  return DDP_OK;
}

/* Keys must differ among one module's children (positions included). */
static ddp_status_t check_keys(build_t *b, const cJSON *arr, const char *path) {
  int n = cJSON_GetArraySize(arr);
  for (int i = 0; i < n; i++)
    for (int j = 0; j < i; j++) {
      char ki[80], kj[80], pi[NAME_LEN];
      snprintf(pi, sizeof pi, "%s[%d]", path, i);
      DDP_CHECK(child_key(b, cJSON_GetArrayItem(arr, i), i, pi, ki, sizeof ki));
      DDP_CHECK(child_key(b, cJSON_GetArrayItem(arr, j), j, path, kj, sizeof kj));
      if (!strcmp(ki, kj)) {
        char w[200];
        snprintf(w, sizeof w, "entries %d and %d have the same name \"%s\"", j, i, ki);
        return bad(b, path, w);
      }
    }
  return DDP_OK;
}

/* {"type": "add", "branches": [B0, B1, ...]}: each Bk is an array of layers, or an object
 * {"layers": [...], "name": KEY, "flag": F}; branch k's layers are named PREFIX.KEY.i. */
static ddp_status_t build_add(build_t *b, const cJSON *l, const char *prefix, const char *path,
                              ddp_module_t **mod) {
  const cJSON *br = cJSON_GetObjectItemCaseSensitive(l, "branches");
  if (!cJSON_IsArray(br) || cJSON_GetArraySize(br) < 1 ||
      cJSON_GetArraySize(br) > DDP_ADD_MAX_BRANCHES)
    return bad(b, path, "\"branches\" must be an array of 1 to 16 branches");
  if (b->depth >= MAX_DEPTH) return bad(b, path, "nesting too deep");
  DDP_CHECK(check_keys(b, br, path));
  DDP_CHECK(ddp_module_add(b->m, mod));
  int k = 0;
  const cJSON *one;
  cJSON_ArrayForEach(one, br) {
    char key[80], pre[NAME_LEN], pth[NAME_LEN];
    DDP_CHECK(child_key(b, one, k, path, key, sizeof key));
    const cJSON *layers = cJSON_IsObject(one) ? cJSON_GetObjectItemCaseSensitive(one, "layers")
                                              : one;
    int flag = -1;
    if (cJSON_IsObject(one)) DDP_CHECK(get_flag(b, one, path, -1, &flag));
    int k1 = snprintf(pre, sizeof pre, "%s%s%s", prefix, *prefix ? "." : "", key);
    int k2 = snprintf(pth, sizeof pth, "%s.branches[%d]", path, k);
    if (k1 < 0 || k2 < 0 || (size_t)k1 >= sizeof pre || (size_t)k2 >= sizeof pth)
      return bad(b, path, "names nest too deep");
    if (!cJSON_IsArray(layers))
      return bad(b, pth, "a branch is an array of layers or an object with \"layers\"");
    ddp_module_t *body;
    b->depth++;
    ddp_status_t st = build_seq(b, layers, pre, pth, &body);
    b->depth--;
    DDP_CHECK(st);
    DDP_CHECK(ddp_module_add_branch(*mod, body, flag));
    k++;
  }
  return DDP_OK;
}

static ddp_status_t build_layer(build_t *b, const cJSON *l, const char *prefix, const char *path,
                                ddp_module_t **mod) {
  if (!cJSON_IsObject(l)) return bad(b, path, "a layer must be an object");
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(l, "type");
  if (!cJSON_IsString(t)) return bad(b, path, "missing string field \"type\"");
  const char *ty = t->valuestring;
  size_t p0 = ddp_model_num_params(b->m);
  ddp_status_t st;
  int64_t a, c;
  if (!strcmp(ty, "linear")) {
    DDP_CHECK(get_int(b, l, path, "in", &a));
    DDP_CHECK(get_int(b, l, path, "out", &c));
    bool bias;
    DDP_CHECK(get_bool(b, l, path, "bias", true, &bias));
    st = ddp_module_linear(b->m, prefix, a, c, bias, b->dt, mod);
  } else if (!strcmp(ty, "relu")) {
    st = ddp_module_activation(b->m, DDP_ACT_RELU, mod);
  } else if (!strcmp(ty, "gelu")) {
    const cJSON *ap = cJSON_GetObjectItemCaseSensitive(l, "approximate");
    bool th = cJSON_IsString(ap) && !strcmp(ap->valuestring, "tanh");
    if (ap && !th && !(cJSON_IsString(ap) && !strcmp(ap->valuestring, "none")))
      return bad(b, path, "\"approximate\" must be \"none\" or \"tanh\"");
    st = ddp_module_activation(b->m, th ? DDP_ACT_GELU_TANH : DDP_ACT_GELU, mod);
  } else if (!strcmp(ty, "tanh")) {
    st = ddp_module_activation(b->m, DDP_ACT_TANH, mod);
  } else if (!strcmp(ty, "sigmoid")) {
    st = ddp_module_activation(b->m, DDP_ACT_SIGMOID, mod);
  } else if (!strcmp(ty, "dropout")) {
    double p;
    DDP_CHECK(get_real(b, l, path, "p", 0.5, 0, false, 1, &p));
    st = ddp_module_dropout(b->m, p, mod);
  } else if (!strcmp(ty, "layernorm")) {
    double eps;
    DDP_CHECK(get_int(b, l, path, "dim", &a));
    DDP_CHECK(get_real(b, l, path, "eps", 1e-5, 0, true, INFINITY, &eps));
    st = ddp_module_layer_norm(b->m, prefix, a, eps, b->dt, mod);
  } else if (!strcmp(ty, "batchnorm")) {
    double eps, mom;
    DDP_CHECK(get_int(b, l, path, "dim", &a));
    DDP_CHECK(get_real(b, l, path, "eps", 1e-5, 0, true, INFINITY, &eps));
    DDP_CHECK(get_real(b, l, path, "momentum", 0.1, 0, false, 1, &mom));
    st = ddp_module_batch_norm(b->m, prefix, a, eps, mom, b->dt, mod);
  } else if (!strcmp(ty, "embedding")) {
    DDP_CHECK(get_int(b, l, path, "num", &a));
    DDP_CHECK(get_int(b, l, path, "dim", &c));
    st = ddp_module_embedding(b->m, prefix, a, c, b->dt, mod);
  } else if (!strcmp(ty, "flatten")) {
    st = ddp_module_flatten(b->m, mod);
  } else if (!strcmp(ty, "add")) {
    st = build_add(b, l, prefix, path, mod);
    if (st != DDP_OK) return st;
  } else if (!strcmp(ty, "residual") || !strcmp(ty, "branch") || !strcmp(ty, "checkpoint")) {
    const cJSON *sub = cJSON_GetObjectItemCaseSensitive(l, "layers");
    if (!cJSON_IsArray(sub)) return bad(b, path, "missing array field \"layers\"");
    if (b->depth >= MAX_DEPTH) return bad(b, path, "nesting too deep");
    char pre[NAME_LEN], pth[NAME_LEN];
    int k1 = snprintf(pre, sizeof pre, "%s%sbody", prefix, *prefix ? "." : "");
    int k2 = snprintf(pth, sizeof pth, "%s.layers", path);
    if (k1 < 0 || k2 < 0 || (size_t)k1 >= sizeof pre || (size_t)k2 >= sizeof pth)
      return bad(b, path, "names nest too deep");
    ddp_module_t *body;
    b->depth++;
    st = build_seq(b, sub, pre, pth, &body);
    b->depth--;
    if (st != DDP_OK) return st;
    if (!strcmp(ty, "residual")) {
      st = ddp_module_residual(b->m, body, mod);
    } else if (!strcmp(ty, "checkpoint")) {
      st = ddp_module_checkpointed(b->m, body, mod);
    } else {
      int f;
      DDP_CHECK(get_flag(b, l, path, 0, &f));
      st = ddp_module_branch(b->m, body, (unsigned)f, mod);
    }
  } else {
    char w[256];
    snprintf(w, sizeof w,
             "unknown layer type \"%.80s\" (linear, relu, gelu, tanh, sigmoid, "
             "dropout, layernorm, batchnorm, embedding, flatten, residual, branch, checkpoint, "
             "add)",
             ty);
    return bad(b, path, w);
  }
  if (st != DDP_OK) {
    return ddp__error(b->err, -1, st, "model json: %s: cannot build the layer: %s", path,
                      ddp_status_str(st));
  }
  /* "frozen": true turns requires_grad off for the parameters this layer registered. */
  bool frozen;
  DDP_CHECK(get_bool(b, l, path, "frozen", false, &frozen));
  if (frozen)
    for (size_t i = p0; i < ddp_model_num_params(b->m); i++)
      ddp_model_param(b->m, i)->requires_grad = false;
  return DDP_OK;
}

static ddp_status_t build_seq(build_t *b, const cJSON *layers, const char *prefix, const char *path,
                              ddp_module_t **out) {
  DDP_CHECK(ddp_module_sequential(b->m, out));
  DDP_CHECK(check_keys(b, layers, path));
  int i = 0;
  const cJSON *l;
  cJSON_ArrayForEach(l, layers) {
    char pre[NAME_LEN], pth[NAME_LEN], key[80];
    int k2 = snprintf(pth, sizeof pth, "%s[%d]", path, i);
    if (k2 < 0 || (size_t)k2 >= sizeof pth) return bad(b, path, "names nest too deep");
    DDP_CHECK(child_key(b, l, i, pth, key, sizeof key));
    int k1 = snprintf(pre, sizeof pre, "%s%s%s", prefix, *prefix ? "." : "", key);
    if (k1 < 0 || k2 < 0 || (size_t)k1 >= sizeof pre || (size_t)k2 >= sizeof pth)
      return bad(b, path, "names nest too deep");
    ddp_module_t *mod;
    DDP_CHECK(build_layer(b, l, pre, pth, &mod));
    DDP_CHECK(ddp_module_append(*out, mod));
    i++;
  }
  return DDP_OK;
}

ddp_status_t ddp_model_from_json(const char *json, ddp_model_t **out, ddp_error_t *err) {
  DDP_REQUIRE(json && out);
  *out = NULL;
  cJSON *root = NULL;
  DDP_CHECK(ddp__json_read(json, "model json", -1, &root, err));
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA, "model json: not a JSON object");
  }
  if (!cJSON_GetObjectItemCaseSensitive(root, "layers") &&
      !cJSON_GetObjectItemCaseSensitive(root, "model_type")) {
    cJSON_Delete(root);
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "model json: neither a libddp model (no \"layers\" array) nor a "
                      "Transformers config.json (no \"model_type\"; supported: gpt2, bert, llama)");
  }
  if (cJSON_GetObjectItemCaseSensitive(root, "model_type")) {
    /* A Transformers config.json: GPT-2 or BERT (docs/nn.md, "Transformers"). */
    cJSON_Delete(root);
    return ddp__model_from_hf_json(json, out, err);
  }
  build_t b = {NULL, DDP_F32, err, 0};
  ddp_status_t st = DDP_OK;
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(root, "dtype");
  const cJSON *layers = cJSON_GetObjectItemCaseSensitive(root, "layers");
  if (dt && cJSON_IsString(dt) && !strcmp(dt->valuestring, "f64")) {
    b.dt = DDP_F64;
  } else if (dt && !(cJSON_IsString(dt) && !strcmp(dt->valuestring, "f32"))) {
    st = bad(&b, "dtype", "must be \"f32\" or \"f64\"");
    goto done;
  }
  if (!cJSON_IsArray(layers)) {
    st = bad(&b, "layers", "missing array field \"layers\"");
    goto done;
  }
  /* "prefix": "layers" names everything "layers.0.weight", ... (a wrapper module whose
   * attribute holds the Sequential; dots nest further). */
  const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "prefix");
  if (pre && (!cJSON_IsString(pre) || strlen(pre->valuestring) > 200 ||
              pre->valuestring[0] == '.' || strstr(pre->valuestring, "..") ||
              (*pre->valuestring && pre->valuestring[strlen(pre->valuestring) - 1] == '.'))) {
    st = bad(&b, "prefix", "must be a dotted module path such as \"layers\" or \"model.body\"");
    goto done;
  }
  DDP_CHECK_GOTO(ddp_model_create(&b.m), st, done);
  ddp_module_t *seq;
  DDP_CHECK_GOTO(build_seq(&b, layers, pre ? pre->valuestring : "", "layers", &seq), st, done);
  if ((st = ddp_model_finalize(b.m)) != DDP_OK) {
    double bytes = 0; /* values and gradients */
    for (size_t i = 0; i < ddp_model_num_params(b.m); i++) {
      const ddp_tensor_t *v = &ddp_model_param(b.m, i)->value;
      bytes += 2.0 * (double)v->numel * (double)ddp_dtype_size(v->dtype);
    }
    st = ddp__error(err, -1, st,
                    "model json: cannot allocate the parameters and their gradients: out of "
                    "memory asking for %.0f bytes (%.3g GB) in one block, for %zu tensors",
                    bytes, bytes * 1e-9, ddp_model_num_params(b.m));
    goto done;
  }
  ddp_model_set_root(b.m, seq);
done:
  cJSON_Delete(root);
  if (st != DDP_OK) {
    ddp_model_destroy(b.m);
    return st;
  }
  *out = b.m;
  return DDP_OK;
}

ddp_status_t ddp_model_from_json_file(const char *path, ddp_model_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  char *buf;
  DDP_CHECK(ddp__file_read(path, 1u << 24, -1, "model json", &buf, NULL, err));
  ddp_status_t st = ddp_model_from_json(buf, out, err);
  ddp__free(buf);
  return st;
}
