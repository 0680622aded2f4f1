/* --deepspeed ds_config.json (docs/sharding.md, "Flags"): DeepSpeed's zero_optimization keys
 * read, checked and mapped onto libddp's knobs, "auto" filled as Transformers'
 * HfTrainerDeepSpeedConfig fills it, and the top-level keys Transformers fills from its
 * TrainingArguments checked against ddp-train's flags, a conflict refused naming both values
 * in Transformers' words ("ds KEY=VAL vs hf ARG=VAL"). */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/trainer.h"

#define ZERO_KEYS                                                                           \
  "stage, reduce_bucket_size, allgather_bucket_size, reduce_scatter, overlap_comm, "        \
  "contiguous_gradients, stage3_prefetch_bucket_size, stage3_param_persistence_threshold, " \
  "offload_optimizer, offload_param, allgather_partitions, round_robin_gradients, "         \
  "use_multi_rank_bucket_allreduce, sub_group_size, stage3_max_live_parameters, "           \
  "stage3_max_reuse_distance, stage3_gather_16bit_weights_on_model_save, "                  \
  "gather_16bit_weights_on_model_save, load_from_fp32_weights, elastic_checkpoint, "        \
  "ignore_unused_parameters"

/* Keys that change neither the bits nor a libddp knob: switches (true/false) and counts
 * (integers >= 0). docs/sharding.md says why for each. */
static const char *const NOOP_BOOL[] = {"overlap_comm",
                                        "contiguous_gradients",
                                        "allgather_partitions",
                                        "round_robin_gradients",
                                        "use_multi_rank_bucket_allreduce",
                                        "stage3_gather_16bit_weights_on_model_save",
                                        "gather_16bit_weights_on_model_save",
                                        "load_from_fp32_weights",
                                        "elastic_checkpoint",
                                        "ignore_unused_parameters"};
static const char *const NOOP_COUNT[] = {"sub_group_size", "stage3_max_live_parameters",
                                         "stage3_max_reuse_distance"};

static bool in(const char *const *list, size_t n, const char *k) {
  for (size_t i = 0; i < n; i++)
    if (!strcmp(list[i], k)) return true;
  return false;
}

static bool is_auto(const cJSON *it) {
  return cJSON_IsString(it) && !strcmp(it->valuestring, "auto");
}

/* An element count as DeepSpeed's pydantic model takes it: an integral number >= 0 (5e8
 * included). */
static bool count_value(const cJSON *it, int64_t *out) {
  if (!cJSON_IsNumber(it)) return false;
  double v = it->valuedouble;
  if (!(v >= 0) || v != floor(v) || v > 9007199254740992.0) return false;
  *out = (int64_t)v;
  return true;
}

static ddp_status_t bad(const char *path, int rank, const char *key, const cJSON *it,
                        const char *expected, ddp_error_t *err) {
  char *shown = cJSON_PrintUnformatted(it);
  ddp_status_t st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "--deepspeed %s: %s = %s; %s",
                               path, key, shown ? shown : "?", expected);
  cJSON_free(shown);
  return st;
}

/* offload_optimizer / offload_param: {"device": "none" | "cpu" | "nvme", ...}. */
static ddp_status_t offload(const char *path, int rank, const char *key, const cJSON *it,
                            ddp_error_t *err) {
  char name[96];
  snprintf(name, sizeof name, "zero_optimization.%s", key);
  if (cJSON_IsNull(it)) return DDP_OK;
  if (!cJSON_IsObject(it))
    return bad(path, rank, name, it, "expected an object such as {\"device\": \"none\"}", err);
  const cJSON *dev = cJSON_GetObjectItemCaseSensitive(it, "device");
  snprintf(name, sizeof name, "zero_optimization.%s.device", key);
  if (!dev || cJSON_IsNull(dev)) return DDP_OK;
  const char *d = cJSON_IsString(dev) ? dev->valuestring : "";
  if (!strcmp(d, "none") || !strcmp(d, "cpu")) return DDP_OK; /* cpu: already in host memory */
  if (!strcmp(d, "nvme"))
    return bad(path, rank, name, dev,
               "libddp has no NVMe offload (ZeRO-Infinity); use \"none\" or \"cpu\" (a no-op: "
               "libddp's state already lives in host memory)",
               err);
  return bad(path, rank, name, dev, "expected \"none\", \"cpu\" or \"nvme\"", err);
}

/* zero_optimization, every key checked; "auto" left as DDP__DS_AUTO. */
static ddp_status_t zero_section(const char *path, int rank, const cJSON *zo, ddp__ds_config_t *c,
                                 ddp_error_t *err) {
  const cJSON *it = NULL;
  cJSON_ArrayForEach(it, zo) {
    const char *k = it->string;
    char name[96];
    snprintf(name, sizeof name, "zero_optimization.%s", k);
    int64_t v = 0;
    if (!strcmp(k, "stage")) {
      double s = cJSON_IsNumber(it) ? it->valuedouble : -1;
      if (s != 0 && s != 1 && s != 2 && s != 3) {
        char *shown = cJSON_PrintUnformatted(it);
        ddp_status_t st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                                     "--deepspeed %s: zero_optimization.stage %s is not a ZeRO "
                                     "stage (0, 1, 2 or 3)",
                                     path, shown ? shown : "?");
        cJSON_free(shown);
        return st;
      }
      c->stage = (int)s;
    } else if (!strcmp(k, "reduce_bucket_size") || !strcmp(k, "stage3_prefetch_bucket_size") ||
               !strcmp(k, "stage3_param_persistence_threshold")) {
      /* the keys Transformers fills from the model's hidden size */
      bool rbs = !strcmp(k, "reduce_bucket_size");
      if (is_auto(it)) {
        v = DDP__DS_AUTO;
      } else if (!count_value(it, &v) || (rbs && v == 0)) {
        return bad(path, rank, name, it,
                   rbs ? "expected a number of elements > 0 or \"auto\""
                       : "expected a number of elements >= 0 or \"auto\"",
                   err);
      }
      if (rbs)
        c->reduce_bucket_size = v;
      else if (!strcmp(k, "stage3_prefetch_bucket_size"))
        c->prefetch_bucket_size = v;
      else
        c->persistence_threshold = v;
    } else if (!strcmp(k, "allgather_bucket_size")) {
      if (!count_value(it, &v) || v == 0)
        return bad(path, rank, name, it, "expected a number of elements > 0", err);
      c->allgather_bucket_size = v;
    } else if (!strcmp(k, "reduce_scatter")) {
      if (!cJSON_IsBool(it)) return bad(path, rank, name, it, "expected true or false", err);
      c->reduce_scatter = cJSON_IsTrue(it);
    } else if (!strcmp(k, "offload_optimizer") || !strcmp(k, "offload_param")) {
      DDP_CHECK(offload(path, rank, k, it, err));
    } else if (in(NOOP_BOOL, DDP_ARRAY_LEN(NOOP_BOOL), k)) {
      if (!cJSON_IsBool(it)) return bad(path, rank, name, it, "expected true or false", err);
    } else if (in(NOOP_COUNT, DDP_ARRAY_LEN(NOOP_COUNT), k)) {
      if (!count_value(it, &v)) return bad(path, rank, name, it, "expected an integer >= 0", err);
    } else {
      return bad(path, rank, name, it, "not supported by libddp (supported: " ZERO_KEYS ")", err);
    }
  }
  return DDP_OK;
}

/* Precision sections: fp16 / bf16 / amp with "enabled" true cannot apply (libddp trains in
 * f32 or f64 on the CPU); their other keys (loss_scale, initial_scale_power, ...) apply
 * only when enabled, as in DeepSpeed, and are ignored. */
static ddp_status_t precision(const char *path, int rank, const cJSON *o, ddp_error_t *err) {
  static const char *const secs[] = {"fp16", "bf16", "amp"};
  for (size_t i = 0; i < DDP_ARRAY_LEN(secs); i++) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, secs[i]);
    const cJSON *en = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "enabled") : NULL;
    if (!en || cJSON_IsFalse(en) || is_auto(en) || cJSON_IsNull(en)) continue;
    char name[32];
    snprintf(name, sizeof name, "%s.enabled", secs[i]);
    if (!cJSON_IsTrue(en))
      return bad(path, rank, name, en, "expected true, false or \"auto\"", err);
    return bad(path, rank, name, en,
               "libddp trains in the model's f32 (or f64) on the CPU: no fp16/bf16 mixed "
               "precision and no loss scaling; set it to false or \"auto\" (the loss-scaling "
               "keys are ignored while it is off, as in DeepSpeed)",
               err);
  }
  /* gradient pre-division and a reduced communication dtype change the reduction's bits */
  const cJSON *ps = cJSON_GetObjectItemCaseSensitive(o, "prescale_gradients");
  if (ps && !cJSON_IsFalse(ps))
    return bad(path, rank, "prescale_gradients", ps,
               "not reproduced by libddp (false only; --sharding_arithmetic deepspeed is "
               "DeepSpeed's divide-then-sum)",
               err);
  const cJSON *pf = cJSON_GetObjectItemCaseSensitive(o, "gradient_predivide_factor");
  if (pf && !(cJSON_IsNumber(pf) && pf->valuedouble == 1.0))
    return bad(path, rank, "gradient_predivide_factor", pf, "not reproduced by libddp (1.0 only)",
               err);
  const cJSON *cd = cJSON_GetObjectItemCaseSensitive(o, "communication_data_type");
  if (cd && !cJSON_IsNull(cd) &&
      !(cJSON_IsString(cd) &&
        (!strcmp(cd->valuestring, "fp32") || !strcmp(cd->valuestring, "float32"))))
    return bad(path, rank, "communication_data_type", cd,
               "libddp reduces in the gradients' dtype (f32): \"fp32\" or null only", err);
  return DDP_OK;
}

static ddp_status_t parse(const char *path, int rank, ddp__ds_config_t *c, cJSON **out,
                          ddp_error_t *err) {
  *c = (ddp__ds_config_t)DDP__DS_CONFIG_INIT;
  *out = NULL;
  char *text = NULL;
  DDP_CHECK(ddp__file_read(path, 1 << 24, rank, "--deepspeed config", &text, NULL, err));
  cJSON *o = NULL;
  ddp_status_t st = ddp__json_read(text, path, rank, &o, err);
  ddp__free(text);
  if (st != DDP_OK) return st;
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "--deepspeed %s: a DeepSpeed config is a JSON object", path);
  }
  const cJSON *zo = cJSON_GetObjectItemCaseSensitive(o, "zero_optimization");
  if (zo && !cJSON_IsObject(zo))
    st = bad(path, rank, "zero_optimization", zo, "expected an object", err);
  if (st == DDP_OK && zo) st = zero_section(path, rank, zo, c, err);
  if (st == DDP_OK) st = precision(path, rank, o, err);
  if (st != DDP_OK) {
    cJSON_Delete(o);
    return st;
  }
  *out = o;
  return DDP_OK;
}

ddp_status_t ddp__ds_config_read(const char *path, int rank, ddp__ds_config_t *out,
                                 ddp_error_t *err) {
  cJSON *o = NULL;
  DDP_CHECK(parse(path, rank, out, &o, err));
  cJSON_Delete(o);
  return DDP_OK;
}

/* ------------------------------------------------------------- the top-level keys --- */

/* A float as Python's repr writes it (Transformers' message): the shortest round trip,
 * ".0" on integral values. */
static void pyfloat(char *buf, size_t cap, double v) {
  for (int p = 1; p <= 17; p++) {
    snprintf(buf, cap, "%.*g", p, v);
    if (strtod(buf, NULL) == v) break;
  }
  if (isfinite(v) && !strpbrk(buf, ".e")) snprintf(buf + strlen(buf), cap - strlen(buf), ".0");
}

typedef struct mismatch {
  char text[2048];
  size_t len;
  int n;
} mismatch_t;

static const cJSON *node(const cJSON *root, const char *dotted) {
  char buf[128];
  snprintf(buf, sizeof buf, "%s", dotted);
  const cJSON *cur = root;
  for (char *save = NULL, *w = strtok_r(buf, ".", &save); w && cur; w = strtok_r(NULL, ".", &save))
    cur = cJSON_IsObject(cur) ? cJSON_GetObjectItemCaseSensitive(cur, w) : NULL;
  return cur;
}

/* Transformers' fill_match: absent or "auto" passes (auto: the flag's value is used); any
 * other value must equal the flag's (n numbers: a list of n). */
static void match(mismatch_t *m, const cJSON *root, const char *key, const double *hf, int n,
                  bool integral, const char *hf_key) {
  const cJSON *it = node(root, key);
  if (!it || cJSON_IsNull(it) || is_auto(it)) return;
  bool eq = n == 1 ? cJSON_IsNumber(it) && it->valuedouble == hf[0]
                   : cJSON_IsArray(it) && cJSON_GetArraySize(it) == n;
  for (int i = 0; n > 1 && eq && i < n; i++) {
    const cJSON *e = cJSON_GetArrayItem(it, i);
    eq = cJSON_IsNumber(e) && e->valuedouble == hf[i];
  }
  if (eq) return;
  char *shown = cJSON_PrintUnformatted(it);
  char hv[128] = "";
  size_t hl = 0;
  if (n > 1) hv[hl++] = '[';
  for (int i = 0; i < n; i++) {
    char one[40];
    if (integral)
      snprintf(one, sizeof one, "%lld", (long long)hf[i]);
    else
      pyfloat(one, sizeof one, hf[i]);
    hl += (size_t)snprintf(hv + hl, sizeof hv - hl, "%s%s", i ? ", " : "", one);
  }
  if (n > 1) snprintf(hv + hl, sizeof hv - hl, "]");
  m->len += (size_t)snprintf(m->text + m->len, sizeof m->text - m->len, "%s- ds %s=%s vs hf %s=%s",
                             m->n ? "; " : "", key, shown ? shown : "?", hf_key, hv);
  if (m->len >= sizeof m->text) m->len = sizeof m->text - 1;
  m->n++;
  cJSON_free(shown);
}

/* optimizer.type against --optim (DeepSpeed lower-cases the name; its "Adam" is AdamW
 * unless adam_w_mode is false), scheduler.type against --lr_scheduler_type. */
static void match_names(mismatch_t *m, const cJSON *root, const ddp_train_args_t *a) {
  const cJSON *ot = node(root, "optimizer.type");
  if (cJSON_IsString(ot)) {
    const cJSON *wm = node(root, "optimizer.params.adam_w_mode");
    const char *t = ot->valuestring, *want = NULL;
    bool adamw = !strncmp(a->optim, "adamw", 5);
    if (!strcasecmp(t, "adamw"))
      want = adamw ? NULL : "adamw_torch";
    else if (!strcasecmp(t, "adam") && !cJSON_IsFalse(wm))
      want = adamw ? NULL : "adamw_torch";
    else if (!strcasecmp(t, "adam"))
      want = !strcmp(a->optim, "adam") ? NULL : "adam";
    else if (!strcasecmp(t, "sgd"))
      want = !strcmp(a->optim, "sgd") ? NULL : "sgd";
    else
      want = "";
    if (want)
      m->len += (size_t)snprintf(m->text + m->len, sizeof m->text - m->len,
                                 "%s- ds optimizer.type=%s%s vs hf optim=%s (%s%s)",
                                 m->n++ ? "; " : "", t,
                                 cJSON_IsFalse(wm) ? " (adam_w_mode false)" : "", a->optim,
                                 want[0] ? "it is libddp's optim "
                                         : "libddp has no such optimizer: adamw_torch, adam, sgd",
                                 want);
  }
  const cJSON *st = node(root, "scheduler.type");
  if (cJSON_IsString(st)) {
    const char *t = st->valuestring;
    const char *want = !strcmp(t, "WarmupLR")        ? "constant_with_warmup"
                       : !strcmp(t, "WarmupDecayLR") ? "linear"
                                                     : "";
    if (strcmp(want, a->lr_scheduler_type) != 0)
      m->len += (size_t)snprintf(m->text + m->len, sizeof m->text - m->len,
                                 "%s- ds scheduler.type=%s vs hf lr_scheduler_type=%s (%s%s)",
                                 m->n++ ? "; " : "", t, a->lr_scheduler_type,
                                 want[0] ? "it is libddp's "
                                         : "libddp reads WarmupLR and WarmupDecayLR only",
                                 want);
  }
  if (m->len >= sizeof m->text) m->len = sizeof m->text - 1;
}

/* The model's hidden size as Transformers reads model.config.hidden_size; 0: none. */
static int64_t hidden_size(const ddp_model_t *model) {
  const ddp_hf_config_t *h = ddp_model_hf_config(model);
  if (!h) return 0;
  switch (h->model_type) {
    case DDP_HF_GPT2: return h->gpt2.n_embd; /* GPT2Config maps hidden_size to n_embd */
    case DDP_HF_BERT: return h->bert.hidden_size;
    case DDP_HF_LLAMA: return h->llama.hidden_size;
    default: return 0;
  }
}

/* The top-level keys Transformers fills from its arguments (trainer_config_process and
 * _finalize) against ddp-train's flags, and the DeepSpeed scheduler's warm-up shape. */
static ddp_status_t top_level(ddp__trainer_t *t, const cJSON *o, const char *path) {
  const ddp_train_args_t *a = t->a;
  /* the keys Transformers fills from its arguments (trainer_config_process/_finalize) */
  mismatch_t m = {.len = 0, .n = 0};
  double v[2];
  v[0] = (double)a->per_device_train_batch_size;
  match(&m, o, "train_micro_batch_size_per_gpu", v, 1, true, "per_device_train_batch_size");
  v[0] = (double)a->gradient_accumulation_steps;
  match(&m, o, "gradient_accumulation_steps", v, 1, true, "gradient_accumulation_steps");
  v[0] = (double)(t->world * a->per_device_train_batch_size * a->gradient_accumulation_steps);
  match(&m, o, "train_batch_size", v, 1, true, "train_batch_size (calculated)");
  v[0] = a->max_grad_norm;
  match(&m, o, "gradient_clipping", v, 1, false, "max_grad_norm");
  v[0] = a->learning_rate;
  match(&m, o, "optimizer.params.lr", v, 1, false, "learning_rate");
  v[0] = a->adam_beta1, v[1] = a->adam_beta2;
  match(&m, o, "optimizer.params.betas", v, 2, false, "adam_beta1+adam_beta2");
  v[0] = a->adam_epsilon;
  match(&m, o, "optimizer.params.eps", v, 1, false, "adam_epsilon");
  v[0] = a->weight_decay;
  match(&m, o, "optimizer.params.weight_decay", v, 1, false, "weight_decay");
  /* Transformers fill_only's warmup_min_lr with 0: libddp's schedules start from 0 */
  v[0] = 0;
  match(&m, o, "scheduler.params.warmup_min_lr", v, 1, false, "(libddp's warmup start) lr");
  v[0] = a->learning_rate;
  match(&m, o, "scheduler.params.warmup_max_lr", v, 1, false, "learning_rate");
  v[0] = (double)t->max_steps;
  match(&m, o, "scheduler.params.total_num_steps", v, 1, true, "num_training_steps (calculated)");
  v[0] = (double)t->sched.num_warmup_steps;
  match(&m, o, "scheduler.params.warmup_num_steps", v, 1, true, "warmup_steps");
  match_names(&m, o, a);
  if (m.n)
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--deepspeed %s: Please correct the following DeepSpeed config values that "
                      "mismatch TrainingArguments values: %s. The easiest method is to set these "
                      "DeepSpeed config values to 'auto'.",
                      path, m.text);
  /* DeepSpeed's WarmupLR/WarmupDecayLR warm up logarithmically unless warmup_type says
   * linear; libddp's (Transformers') warmup is linear */
  const cJSON *wt = node(o, "scheduler.params.warmup_type");
  if (node(o, "scheduler") && t->sched.num_warmup_steps > 0 &&
      !(cJSON_IsString(wt) && !strcmp(wt->valuestring, "linear"))) {
    char *shown = wt ? cJSON_PrintUnformatted(wt) : NULL;
    ddp_status_t st =
        ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                   "--deepspeed %s: scheduler.params.warmup_type = %s with %lld warmup steps: "
                   "libddp's warmup is linear (Transformers'); set \"warmup_type\": \"linear\"",
                   path, shown ? shown : "absent (DeepSpeed's default \"log\")",
                   (long long)t->sched.num_warmup_steps);
    cJSON_free(shown);
    return st;
  }
  return DDP_OK;
}

ddp_status_t ddp__train_ds_config_apply(ddp__trainer_t *t) {
  ddp_train_args_t *a = &t->args;
  if (!a->deepspeed[0]) return DDP_OK;
  const char *path = a->deepspeed;
  ddp__ds_config_t *c = &t->ds;
  cJSON *o = NULL;
  DDP_CHECK(parse(path, t->rank, c, &o, t->err));
  ddp_status_t st = DDP_OK;

  /* "auto" from the hidden size (trainer_config_finalize) */
  char autos[256] = "";
  if (c->reduce_bucket_size == DDP__DS_AUTO)
    strcat(autos, "'zero_optimization.reduce_bucket_size'");
  if (c->prefetch_bucket_size == DDP__DS_AUTO)
    strcat(strcat(autos, autos[0] ? ", " : ""), "'zero_optimization.stage3_prefetch_bucket_size'");
  if (c->persistence_threshold == DDP__DS_AUTO)
    strcat(strcat(autos, autos[0] ? ", " : ""),
           "'zero_optimization.stage3_param_persistence_threshold'");
  int64_t h = hidden_size(t->model);
  if (autos[0] && !h) {
    st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                    "--deepspeed %s: the model's config has neither `hidden_size` nor "
                    "`hidden_sizes`, therefore it's not possible to automatically fill out the "
                    "following `auto` entries: [%s]; replace `auto` for these keys with an "
                    "integer of your choice (as Transformers asks)",
                    path, autos);
    goto out;
  }
  if (c->reduce_bucket_size == DDP__DS_AUTO) c->reduce_bucket_size = h * h;
  /* Transformers fills the stage-3 keys only at stage 3; DeepSpeed reads them only there */
  if (c->prefetch_bucket_size == DDP__DS_AUTO)
    c->prefetch_bucket_size = c->stage == 3 ? (int64_t)(0.9 * (double)h * (double)h) : -1;
  if (c->persistence_threshold == DDP__DS_AUTO)
    c->persistence_threshold = c->stage == 3 ? 10 * h : -1;

  st = top_level(t, o, path);
  if (st != DDP_OK) goto out;

  /* reduce_bucket_size (elements) -> the reducer's bucket cap at stages 1 and 2 (bytes =
   * elements x the gradients' element size), no smaller first bucket (DeepSpeed has none);
   * ZeRO-1 reduces through the reducer, today's ZeRO-2 does not (zero.c) */
  if (c->reduce_bucket_size > 0 && (c->stage == 1 || c->stage == 2)) {
    double esz = ddp_model_flat_params(t->model, DDP_F32).numel ? 4.0 : 8.0;
    double mb = (double)c->reduce_bucket_size * esz / (1024.0 * 1024.0);
    if (a->ddp_bucket_cap_mb > 0 && a->ddp_bucket_cap_mb != mb) {
      char shown[40];
      pyfloat(shown, sizeof shown, a->ddp_bucket_cap_mb);
      st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--deepspeed %s: zero_optimization.reduce_bucket_size=%lld (%.0f bytes) vs "
                      "--ddp_bucket_cap_mb %s (%.0f bytes): both set the bucket cap; give one",
                      path, (long long)c->reduce_bucket_size, (double)c->reduce_bucket_size * esz,
                      shown, a->ddp_bucket_cap_mb * 1024.0 * 1024.0);
      goto out;
    }
    a->ddp_bucket_cap_mb = mb;
    if (a->ddp_first_bucket_mb <= 0) a->ddp_first_bucket_mb = mb;
  }
  /* reduce_scatter false: DeepSpeed's allreduce path, under DeepSpeed's arithmetic */
  if (c->stage == 1 || c->stage == 2) {
    if (c->reduce_scatter == 0 && !strcmp(a->sharding_arithmetic, "deepspeed"))
      snprintf(a->sharding_arithmetic, sizeof a->sharding_arithmetic, "deepspeed_allreduce");
    else if (c->reduce_scatter == 1 && !strcmp(a->sharding_arithmetic, "deepspeed_allreduce"))
      st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--deepspeed %s: zero_optimization.reduce_scatter=true vs "
                      "--sharding_arithmetic deepspeed_allreduce (DeepSpeed's "
                      "\"reduce_scatter\": false path); use --sharding_arithmetic deepspeed or "
                      "\"reduce_scatter\": false",
                      path);
  }
out:
  cJSON_Delete(o);
  return st;
}

void ddp__train_ds_fsdp_options(const ddp__trainer_t *t, ddp_fsdp_options_t *o) {
  const ddp__ds_config_t *c = &t->ds;
  if (!t->a->deepspeed[0]) return;
  /* DeepSpeed prefetches, in forward and backward, the next parameters of the order it
   * traced while fewer than stage3_prefetch_bucket_size elements are in flight: any budget
   * > 0 starts the next unit's gather (libddp looks one unit ahead), 0 none */
  if (c->persistence_threshold > 0) o->persistence_threshold = c->persistence_threshold;
  if (c->prefetch_bucket_size < 0) return;
  bool on = c->prefetch_bucket_size > 0;
  o->backward_prefetch = on ? DDP_FSDP_BACKWARD_PRE : DDP_FSDP_NO_PREFETCH;
  o->forward_prefetch = on;
}
