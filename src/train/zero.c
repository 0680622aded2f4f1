/* Sharded data parallelism in the trainer (docs/sharding.md): Hugging Face's --fsdp and
 * --deepspeed switches read into a ZeRO stage, the ZeRO handle over the trainer's optimizer
 * groups, and the state bytes of metrics.jsonl. */
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/trainer.h"

#define FSDP_CHOICES                                                                           \
  "full_shard (ZeRO-3), shard_grad_op (ZeRO-2), hybrid_shard (ZeRO-3 in a node, replicated "   \
  "across nodes), hybrid_shard_zero2 (the same, parameters kept gathered from forward to the " \
  "end of backward), no_shard (DDP), auto_wrap; libddp has no offload (docs/sharding.md)"

/* --fsdp: space-separated options (HF's FSDPOption). *stage: the ZeRO stage (hybrid_shard
 * and hybrid_shard_zero2 are ZeRO-3's machinery, fsdp.c); *hybrid (may be NULL): 1
 * hybrid_shard, 2 hybrid_shard_zero2, 0 neither. */
static ddp_status_t fsdp_stage(const char *s, int rank, int *stage, int *hybrid, ddp_error_t *err) {
  char buf[DDP_TRAIN_STR_MAX];
  snprintf(buf, sizeof buf, "%s", s);
  int st = -1;
  for (char *save = NULL, *w = strtok_r(buf, " ,", &save); w; w = strtok_r(NULL, " ,", &save)) {
    if (!strcmp(w, "auto_wrap")) continue;
    int v = !strcmp(w, "full_shard")           ? 3
            : !strcmp(w, "shard_grad_op")      ? 2
            : !strcmp(w, "no_shard")           ? 0
            : !strcmp(w, "hybrid_shard")       ? 4
            : !strcmp(w, "hybrid_shard_zero2") ? 5
                                               : -1;
    bool later = !strcmp(w, "offload");
    if (v < 0)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "--fsdp: option '%s' is %s; %s", w,
                        later ? "not supported by libddp" : "unknown", "choices: " FSDP_CHOICES);
    if (st >= 0 && st != v)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "--fsdp '%s': full_shard, shard_grad_op, hybrid_shard, "
                        "hybrid_shard_zero2 and no_shard are exclusive",
                        s);
    st = v;
  }
  if (st < 0)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp '%s' names no sharding strategy; choices: " FSDP_CHOICES, s);
  *stage = st > 3 ? 3 : st;
  if (hybrid) *hybrid = st > 3 ? st - 3 : 0;
  return DDP_OK;
}

/* --deepspeed: zero_optimization.stage of the JSON file (DeepSpeed's default 0); the file's
 * other keys are checked there too (ds_config.c). */
static ddp_status_t deepspeed_stage(const char *path, int rank, int *stage, ddp_error_t *err) {
  ddp__ds_config_t c;
  *stage = 0;
  DDP_CHECK(ddp__ds_config_read(path, rank, &c, err));
  *stage = c.stage;
  return DDP_OK;
}

ddp_status_t ddp__train_zero_stage(const ddp_train_args_t *a, int rank, int *stage,
                                   ddp_error_t *err) {
  *stage = 0;
  if (a->fsdp[0] && a->deepspeed[0])
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp '%s' and --deepspeed %s: only one of FSDP and DeepSpeed can be "
                      "used (as in transformers' TrainingArguments)",
                      a->fsdp, a->deepspeed);
  if (a->fsdp[0]) return fsdp_stage(a->fsdp, rank, stage, NULL, err);
  if (a->deepspeed[0]) return deepspeed_stage(a->deepspeed, rank, stage, err);
  return DDP_OK;
}

/* ---------------------------------------------------------------- ZeRO-1 overlapped */

static bool has_rebuilt_buckets(void *user) {
  ddp__trainer_t *t = user;
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(ddp__sync_reducer(t->sync), &ld);
  return ld.has_rebuilt_buckets;
}

/* ddp__sync_hook_wrap_fn: the hook begin would register becomes PyTorch's `hook` argument. */
static ddp_status_t wrap_hook(void *user, const ddp_comm_hook_t *inner, ddp_comm_hook_t *out,
                              ddp_error_t *err) {
  ddp__trainer_t *t = user;
  ddp_zero_hook_kind_t kind = DDP_ZERO_HOOK_STEP;
  ddp_zero_hook_kind_parse(t->a->zero_comm_hook, &kind); /* checked by overlap_setup */
  ddp_zero_overlap_options_t o = DDP_ZERO_OVERLAP_OPTIONS_INIT;
  o.kind = kind;
  o.shard_buckets = t->a->zero_shard_buckets;
  o.has_rebuilt_buckets = has_rebuilt_buckets;
  o.user = t;
  o.divide_in_place = t->a->gradient_as_bucket_view;
  ddp_zero_group_t groups[DDP__TRAIN_MAX_GROUPS];
  for (size_t g = 0, off = 0; g < t->nopt; g++) {
    size_t n = ddp_optim_num_params(t->opt[g]);
    groups[g] = (ddp_zero_group_t){*ddp_optim_options(t->opt[g]), t->pairs + off, n};
    off += n;
  }
  DDP_CHECK(ddp_zero_overlap_create(t->pg, &o, groups, t->nopt, inner, &t->zovl, err));
  ddp_zero_overlap_hook(t->zovl, out);
  return DDP_OK;
}

/* --zero_comm_hook: what PyTorch's overlap cannot do is refused naming the flag; the hook
 * itself is made when the reducer exists (wrap_hook, from ddp__sync_begin). */
static ddp_status_t overlap_setup(ddp__trainer_t *t, int stage, const ddp_zero_group_t *groups) {
  (void)groups;
  const ddp_train_args_t *a = t->a;
  ddp_zero_hook_kind_t kind;
  const char *why = NULL;
  if (!ddp_zero_hook_kind_parse(a->zero_comm_hook, &kind))
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--zero_comm_hook '%s' is not one of no, hook_with_zero_step, "
                      "hook_with_zero_step_interleaved",
                      a->zero_comm_hook);
  if (!a->ddp_reducer)
    why = "--ddp_reducer false (the step runs inside the DDP reducer's comm hook)";
  else if (ddp_train_find_unused(a) && !ddp_train_static_graph(a))
    why = "find_unused_parameters (DDP then never rebuilds its buckets, so PyTorch's hook "
          "never updates the parameters; pass --ddp_find_unused_parameters false or "
          "--ddp_static_graph true)";
  else if (a->max_grad_norm > 0)
    why = "--max_grad_norm > 0 (the step runs before every gradient is reduced: there is "
          "no global norm to clip by; pass --max_grad_norm 0)";
  else if (strcmp(a->save_strategy, "no") != 0 || a->resume_from_checkpoint[0])
    why = "checkpoints (not built for the overlapped ZeRO-1: its optimizer state is "
          "partitioned by DDP bucket and created after the warm-up; pass --save_strategy no)";
  else if (a->power_sgd_init_q[0])
    why = "--power_sgd_init_q";
  if (why)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "--zero_comm_hook %s (ZeRO stage %d) does not combine with %s",
                      a->zero_comm_hook, stage, why);
  if (a->zero_parameters_as_bucket_view)
    ddp__log(t->rank, DDP_LOG_WARN,
             "`parameters_as_bucket_view=True` will be ignored since `overlap_with_ddp=True`; "
             "instead, a different bucketing strategy will be used");
  ddp__sync_set_hook_wrap(t->sync, wrap_hook, t);
  return DDP_OK;
}

ddp_status_t ddp__train_zero_setup(ddp__trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  int stage = 0;
  DDP_CHECK(ddp__train_zero_stage(a, t->rank, &stage, t->err));
  const char *z1 = a->zero_parameters_as_bucket_view      ? "--zero_parameters_as_bucket_view"
                   : strcmp(a->zero_comm_hook, "no") != 0 ? "--zero_comm_hook"
                   : a->zero_shard_buckets                ? "--zero_shard_buckets"
                                                          : NULL;
  if (z1 && stage != 1)
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "%s is PyTorch ZeroRedundancyOptimizer's (ZeRO-1): it needs --deepspeed "
                      "with zero_optimization.stage 1 (the ZeRO stage is %d)",
                      z1, stage);
  if (stage == 0) return DDP_OK;
  const char *why = NULL;
  if (t->inv_k) why = "world_size_invariant_shards";
  if (stage >= 2 && strcmp(a->comm_hook, "no") != 0)
    why = stage == 2 ? "a comm_hook (stage 2 has no allreduce)"
                     : "a comm_hook (stage 3 has no allreduce)";
  if (stage == 3 && a->dump_dir[0]) why = "--dump_dir (the dump reads the model's full buffers)";
  if (stage == 3 && a->power_sgd_init_q[0]) why = "--power_sgd_init_q";
  if (why)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "ZeRO stage %d (--%s) does not combine with %s yet", stage,
                      a->fsdp[0] ? "fsdp" : "deepspeed", why);
  if (stage == 3) {
    t->zero3 = true;
    return DDP_OK; /* ddp__train_fsdp_setup, after the initial broadcast */
  }
  ddp_zero_group_t groups[DDP__TRAIN_MAX_GROUPS];
  for (size_t g = 0, off = 0; g < t->nopt; g++) {
    size_t n = ddp_optim_num_params(t->opt[g]);
    groups[g] = (ddp_zero_group_t){*ddp_optim_options(t->opt[g]), t->pairs + off, n};
    off += n;
  }
  if (strcmp(a->zero_comm_hook, "no") != 0) return overlap_setup(t, stage, groups);
  ddp_zero_options_t zo = DDP_ZERO_OPTIONS_INIT;
  zo.stage = stage;
  zo.parameters_as_bucket_view = a->zero_parameters_as_bucket_view;
  /* the reducer divides in place only gradients that are still bucket views: with
   * zero_grad(set_to_none=True) each backward defines them anew and they are multiplied */
  zo.divide_in_place = a->gradient_as_bucket_view && !a->zero_grad_set_to_none;
  DDP_CHECK(ddp__sync_grad_arith(a, t->rank, &zo.arith, t->err));
  DDP_CHECK(ddp_zero_create(t->pg, &zo, groups, t->nopt, &t->zero, t->err));
  /* ZeRO-2: its buckets reduce during backward, from the model's gradient-ready hooks */
  if (stage == 2) return ddp_zero_attach_model(t->zero, t->model, a->ddp_bucket_cap_mb, t->err);
  return DDP_OK;
}

ddp_status_t ddp__train_zero_dump(ddp__trainer_t *t) {
  size_t n = t->zero ? ddp_zero_num_params(t->zero) : t->ntrain,
         np = ddp_model_num_params(t->model);
  const char **names = ddp__calloc(n ? n : 1, sizeof *names);
  int *owner = ddp__calloc(n ? n : 1, sizeof *owner);
  ddp_status_t st = DDP_OK;
  if (!names || !owner) {
    st = ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: out of memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    owner[i] = t->zero ? ddp_zero_owner(t->zero, i) : ddp_zero_overlap_owner(t->zovl, i);
    for (size_t k = 0; k < np && !names[i]; k++) {
      ddp_param_t *p = ddp_model_param(t->model, k);
      if (&p->value == t->pairs[i].param) names[i] = p->name;
    }
    DDP_REQUIRE(names[i]);
  }
  st = ddp_dump_set_partition(t->dump, names, owner, n);
  if (st != DDP_OK) {
    ddp_error_t de;
    ddp_dump_last_error_copy(t->dump, &de);
    st = ddp__error_quiet(t->err, st, "trainer: dump_dir %s: %s", t->a->dump_dir, de.msg);
  }
out:
  ddp__free(names);
  ddp__free(owner);
  return st;
}

/* tmp/optimizer[_group<g>]-0000<r+1>-of-0000<W>.safetensors */
static void shard_file(char *buf, size_t cap, const char *tmp, size_t g, int r, int W) {
  char grp[32] = "";
  if (g > 0) snprintf(grp, sizeof grp, "_group%zu", g);
  snprintf(buf, cap, "%s/optimizer%s-%05d-of-%05d.safetensors", tmp, grp, r + 1, W);
}

ddp_status_t ddp__train_zero_save_shard(ddp__trainer_t *t, const char *tmp) {
  char file[DDP_TRAIN_STR_MAX + 160];
  for (size_t g = 0; g < t->nopt; g++) {
    shard_file(file, sizeof file, tmp, g, t->rank, t->world);
    DDP_CHECK(ddp_zero_optim_save(t->zero, g, file, t->err));
  }
  return DDP_OK;
}

ddp_status_t ddp__train_zero_consolidate(ddp__trainer_t *t, const char *tmp) {
  size_t cap = DDP_TRAIN_STR_MAX + 160;
  char *buf = ddp__calloc((size_t)t->world + 1, cap);
  const char **shards = ddp__calloc((size_t)t->world, sizeof *shards);
  ddp_status_t st = DDP_OK;
  if (!buf || !shards) st = ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
  for (size_t g = 0; st == DDP_OK && g < t->nopt; g++) {
    for (int r = 0; r < t->world; r++) {
      shard_file(buf + (size_t)r * cap, cap, tmp, g, r, t->world);
      shards[r] = buf + (size_t)r * cap;
    }
    char *out = buf + (size_t)t->world * cap;
    ddp__train_optim_file(out, cap, tmp, g);
    st = ddp_zero_consolidate(shards, (size_t)t->world, out, t->err);
  }
  ddp__free(buf);
  ddp__free(shards);
  return st;
}

void ddp__train_own_bytes(ddp__trainer_t *t, double own[5]) {
  own[3] = 0;
  if (t->zovl) { /* DDP's parameters and gradients; the state of this rank's buckets */
    own[0] = own[1] = 0;
    for (size_t i = 0; i < t->ntrain; i++) {
      const ddp_tensor_t *p = t->pairs[i].param, *g = t->pairs[i].grad;
      own[0] += (double)((size_t)p->numel * ddp_dtype_size(p->dtype));
      if (g->data) own[1] += (double)((size_t)g->numel * ddp_dtype_size(g->dtype));
    }
    own[2] = (double)ddp_zero_overlap_optim_bytes(t->zovl);
    return;
  }
  if (t->zero) {
    size_t p, g, o;
    ddp_zero_state_bytes(t->zero, &p, &g, &o);
    own[0] = (double)p, own[1] = (double)g, own[2] = (double)o;
    return;
  }
  if (t->fsdp) {
    size_t p, g, o, peak;
    ddp_fsdp_state_bytes(t->fsdp, &p, &g, &o, &peak);
    own[0] = (double)p, own[1] = (double)g, own[2] = (double)o, own[3] = (double)peak;
    return;
  }
  own[0] = own[1] = own[2] = 0;
  for (size_t i = 0; i < t->ntrain; i++) {
    const ddp_tensor_t *p = t->pairs[i].param, *g = t->pairs[i].grad;
    own[0] += (double)((size_t)p->numel * ddp_dtype_size(p->dtype));
    if (g->data) own[1] += (double)((size_t)g->numel * ddp_dtype_size(g->dtype));
  }
  for (size_t g = 0; g < t->nopt; g++) own[2] += (double)ddp_optim_state_bytes(t->opt[g]);
}

/* One metrics member: a JSON array of W numbers (all: NV values per rank). */
#define NV 7
static void member(ddp__json_t *j, const char *key, const double *all, int world, int k,
                   const char *fmt) {
  char buf[4096];
  size_t len = 0;
  buf[len++] = '[';
  for (int r = 0; r < world && len + 32 < sizeof buf; r++) {
    if (r) buf[len++] = ',';
    len += (size_t)snprintf(buf + len, sizeof buf - len, fmt, all[r * NV + k]);
  }
  snprintf(buf + len, sizeof buf - len, "]");
  ddp__json_raw(j, key, buf);
}

/* This process's peak resident set (getrusage ru_maxrss), in MiB. */
static double peak_rss_mb(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0.0;
}

ddp_status_t ddp__train_state_bytes(ddp__trainer_t *t, const double own[5], ddp__json_t *j) {
  int W = t->world;
  double *all = ddp__calloc((size_t)W * NV, sizeof *all);
  if (!all) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: out of memory");
  ddp_status_t st = DDP_OK;
  double mine[NV] = {own[0], own[1],        own[2], own[0] + own[1] + own[2],
                     own[3], peak_rss_mb(), own[4]};
  if (W > 1) { /* the ranks differ (their shards, their processes): gather them */
    ddp_work_t *w = NULL;
    st = ddp_allgather(t->pg, mine, all, NV, DDP_F64, &w);
    if (st == DDP_OK) st = ddp_work_wait_free(w);
    if (st != DDP_OK) {
      ddp_error_t pe;
      ddp_pg_last_error_copy(t->pg, &pe);
      st = ddp__error_quiet(t->err, st, "trainer: state bytes allgather: %s", pe.msg);
    }
  } else {
    memcpy(all, mine, sizeof mine);
  }
  int stage = 0, hybrid = 0;
  if (t->fsdp && t->a->fsdp[0]) (void)fsdp_stage(t->a->fsdp, t->rank, &stage, &hybrid, NULL);
  if (st == DDP_OK && j) {
    ddp__json_str(j, "sharding",
                  hybrid == 1                    ? "hybrid_shard"
                  : hybrid == 2                  ? "hybrid_shard_zero2"
                  : t->fsdp                      ? "zero3"
                  : t->zovl                      ? "zero1_overlap"
                  : !t->zero                     ? "ddp"
                  : ddp_zero_stage(t->zero) == 1 ? "zero1"
                                                 : "zero2");
    member(j, "param_bytes", all, W, 0, "%.0f");
    member(j, "grad_bytes", all, W, 1, "%.0f");
    member(j, "optim_bytes", all, W, 2, "%.0f");
    member(j, "state_bytes", all, W, 3, "%.0f");
    /* ZeRO-3: the full copies of the units in flight, apart from the sharded state */
    if (t->fsdp) member(j, "gathered_bytes", all, W, 4, "%.0f");
    /* the flight recorder's count of the last step's sends (absent when it is off) */
    if (own[4] >= 0) member(j, "sent_bytes", all, W, 6, "%.2f");
    member(j, "peak_rss_mb", all, W, 5, "%.1f");
  }
  ddp__free(all);
  return st;
}

/* ---------------------------------------------------------------- ZeRO-3 ---------- */

#define FSDP_KEYS                                                                             \
  "transformer_layer_cls_to_wrap, min_num_params, reshard_after_forward, backward_prefetch, " \
  "forward_prefetch, limit_all_gathers, version, state_dict_type, dp_shard_size"

/* A switch of --fsdp_config: JSON true/false or Transformers' strings "true"/"false" (any
 * case); -1: neither. */
static int switch_value(const cJSON *it) {
  if (cJSON_IsBool(it)) return cJSON_IsTrue(it);
  if (!cJSON_IsString(it)) return -1;
  if (!strcasecmp(it->valuestring, "true")) return 1;
  if (!strcasecmp(it->valuestring, "false")) return 0;
  return -1;
}

/* backward_prefetch: Transformers' and Accelerate's spellings (upper-cased there), PyTorch's
 * BackwardPrefetch names; false / null / NO_PREFETCH / NONE for none. -1: none of them. */
static int prefetch_value(const cJSON *it) {
  if (cJSON_IsNull(it) || cJSON_IsFalse(it)) return DDP_FSDP_NO_PREFETCH;
  if (!cJSON_IsString(it)) return -1;
  const char *v = it->valuestring;
  if (!strncasecmp(v, "BackwardPrefetch.", 17)) v += 17;
  if (!strcasecmp(v, "backward_pre")) return DDP_FSDP_BACKWARD_PRE;
  if (!strcasecmp(v, "backward_post")) return DDP_FSDP_BACKWARD_POST;
  if (!strcasecmp(v, "no_prefetch") || !strcasecmp(v, "none")) return DDP_FSDP_NO_PREFETCH;
  return -1;
}

/* --fsdp_config: a JSON object inline or a file's; Transformers' keys, with or without
 * their "fsdp_" prefix. */
static ddp_status_t fsdp_config(ddp__trainer_t *t, ddp_fsdp_options_t *o, char *cls, size_t cap) {
  const char *src = t->a->fsdp_config;
  char *text = NULL;
  if (src[0] != '{')
    DDP_CHECK(ddp__file_read(src, 1 << 20, t->rank, "--fsdp_config", &text, NULL, t->err));
  cJSON *j = NULL;
  ddp_status_t st = ddp__json_read(text ? text : src, text ? src : "--fsdp_config", t->rank, &j,
                                   t->err);
  ddp__free(text);
  if (st != DDP_OK) return st;
  const cJSON *it = NULL;
  const char *v1_only = NULL; /* an FSDP1 prefetch key given, for version 2's check */
  int version = 1;
  cJSON_ArrayForEach(it, j) {
    const char *k = it->string;
    if (!strncmp(k, "fsdp_", 5)) k += 5;
    int sw = switch_value(it), pf = prefetch_value(it);
    const char *bad = NULL; /* the choices of a known key given a value outside them */
    if (!strcmp(k, "transformer_layer_cls_to_wrap") && cJSON_IsString(it)) {
      snprintf(cls, cap, "%s", it->valuestring);
    } else if (!strcmp(k, "transformer_layer_cls_to_wrap") && cJSON_IsArray(it)) {
      size_t len = 0;
      const cJSON *e = NULL;
      cls[0] = 0;
      cJSON_ArrayForEach(e, it) if (cJSON_IsString(e) && len + strlen(e->valuestring) + 2 < cap)
          len += (size_t)snprintf(cls + len, cap - len, "%s%s", len ? "," : "", e->valuestring);
    } else if (!strcmp(k, "min_num_params") && cJSON_IsNumber(it) && it->valuedouble >= 0) {
      o->min_num_params = (int64_t)it->valuedouble;
    } else if (!strcmp(k, "reshard_after_forward")) {
      /* FSDP2's bool; Accelerate's FSDP1 spelling is the sharding strategy it implies */
      if (cJSON_IsString(it) && !strcasecmp(it->valuestring, "FULL_SHARD")) sw = 1;
      if (cJSON_IsString(it) && !strcasecmp(it->valuestring, "SHARD_GRAD_OP")) sw = 0;
      o->reshard_after_forward = sw == 1;
      bad = sw < 0 ? "true or false (or FULL_SHARD, SHARD_GRAD_OP)" : NULL;
    } else if (!strcmp(k, "backward_prefetch") || !strcmp(k, "backward_prefetch_policy")) {
      if (pf >= 0) o->backward_prefetch = (ddp_fsdp_prefetch_t)pf;
      bad = pf < 0 ? "backward_pre, backward_post or no_prefetch (any case), or false" : NULL;
      if (pf > 0) v1_only = it->string;
    } else if (!strcmp(k, "forward_prefetch")) {
      o->forward_prefetch = sw == 1;
      bad = sw < 0 ? "true or false" : NULL;
      if (sw == 1) v1_only = it->string;
    } else if (!strcmp(k, "limit_all_gathers")) {
      o->limit_all_gathers = sw == 1;
      bad = sw < 0 ? "true or false" : NULL;
    } else if (!strcmp(k, "version")) {
      double v = cJSON_IsNumber(it)   ? it->valuedouble
                 : cJSON_IsString(it) ? (!strcmp(it->valuestring, "1")   ? 1
                                         : !strcmp(it->valuestring, "2") ? 2
                                                                         : 0)
                                      : 0;
      version = (int)v;
      bad = v != 1 && v != 2 ? "1 or 2" : NULL;
    } else if (!strcmp(k, "dp_shard_size")) {
      /* hybrid sharding's node size (Accelerate's ParallelismConfig name; libddp) */
      double v = cJSON_IsNumber(it) ? it->valuedouble : 0;
      if (v >= 1 && v <= DDP_PG_MAX_WORLD && v == (int)v) o->shard_size = (int)v;
      bad = o->shard_size ? NULL : "a whole number of ranks per node, at least 1";
    } else if (!strcmp(k, "state_dict_type")) {
      /* LOCAL_STATE_DICT (FSDP1's flat local shards) has no layout here */
      bool full = cJSON_IsString(it) && !strcmp(it->valuestring, "FULL_STATE_DICT");
      bool sharded = cJSON_IsString(it) && !strcmp(it->valuestring, "SHARDED_STATE_DICT");
      if (full || sharded) t->fsdp_sharded_sd = sharded;
      bad = full || sharded ? NULL : "FULL_STATE_DICT or SHARDED_STATE_DICT";
    } else {
      char *shown = cJSON_PrintUnformatted(it);
      st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp_config: key '%s' = %s is not supported (supported: " FSDP_KEYS ")",
                      it->string, shown ? shown : "?");
      cJSON_free(shown);
      break;
    }
    if (bad) {
      char *shown = cJSON_PrintUnformatted(it);
      st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp_config: '%s' = %s; expected %s", it->string, shown ? shown : "?",
                      bad);
      cJSON_free(shown);
      break;
    }
  }
  /* FSDP2 (fully_shard) has no backward_prefetch or forward_prefetch switch: it prefetches
   * in backward in reverse forward order (BACKWARD_PRE's unit) and relies on implicit
   * forward prefetch; Accelerate refuses the FSDP1 keys with version 2. */
  if (st == DDP_OK && version == 2 && v1_only)
    st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                    "--fsdp_config: '%s' is an FSDP1 option; with \"version\": 2 (FSDP2) "
                    "prefetch is fixed (backward: the next unit when a unit's backward "
                    "starts); remove it or use version 1",
                    v1_only);
  if (st == DDP_OK && version == 2) {
    o->backward_prefetch = DDP_FSDP_BACKWARD_PRE;
    o->forward_prefetch = false;
  }
  cJSON_Delete(j);
  return st;
}

/* --fsdp hybrid_shard / hybrid_shard_zero2 (docs/sharding.md, "Hybrid sharding"): the
 * node size is fsdp_config's dp_shard_size, else the launcher's LOCAL_WORLD_SIZE, else W
 * (ranks as threads are one process on one host: one node, FULL_SHARD's layout). */
static ddp_status_t hybrid_setup(ddp__trainer_t *t, int hybrid, ddp_fsdp_options_t *o) {
  const char *mode = hybrid == 2 ? "hybrid_shard_zero2" : "hybrid_shard";
  if (!hybrid && o->shard_size)
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp_config: dp_shard_size %d applies to --fsdp hybrid_shard and "
                      "hybrid_shard_zero2 only (--fsdp '%s')",
                      o->shard_size, t->a->fsdp);
  if (!hybrid) return DDP_OK;
  const char *from = "--fsdp_config dp_shard_size";
  if (!o->shard_size && strcmp(ddp_pg_backend_name(t->pg), "threads") != 0 &&
      ddp_env_is_set(DDP_ENV_LOCAL_WORLD_SIZE)) {
    int64_t v = 0;
    DDP_CHECK(ddp_env_int(DDP_ENV_LOCAL_WORLD_SIZE, 1, DDP_PG_MAX_WORLD, &v, t->err));
    o->shard_size = (int)v;
    from = "the launcher's LOCAL_WORLD_SIZE";
  }
  if (!o->shard_size) {
    o->shard_size = t->world;
    from = "all ranks in one process: one node";
  }
  if (t->world % o->shard_size != 0)
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "--fsdp %s: the node size %d (%s) does not divide the world size %d; "
                      "every node must hold the same number of ranks",
                      mode, o->shard_size, from, t->world);
  if (t->fsdp_sharded_sd)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "--fsdp %s: SHARDED_STATE_DICT checkpoints are not built for hybrid "
                      "sharding (every node holds the same shards); use \"state_dict_type\": "
                      "\"FULL_STATE_DICT\"",
                      mode);
  if (hybrid == 2) o->reshard_after_forward = false; /* SHARD_GRAD_OP inside the node */
  if (t->rank == 0)
    ddp__log(t->rank, DDP_LOG_INFO, "fsdp: %s: %d node(s) of %d ranks (node size from %s)", mode,
             t->world / o->shard_size, o->shard_size, from);
  return DDP_OK;
}

ddp_status_t ddp__train_fsdp_setup(ddp__trainer_t *t) {
  if (!t->zero3) return DDP_OK;
  int stage = 0, hybrid = 0;
  if (t->a->fsdp[0]) DDP_CHECK(fsdp_stage(t->a->fsdp, t->rank, &stage, &hybrid, t->err));
  ddp_fsdp_options_t o = DDP_FSDP_OPTIONS_INIT;
  char cls[DDP_TRAIN_STR_MAX] = "";
  /* auto_wrap's default, as Transformers': the model's layer class (_no_split_modules) */
  size_t nb = ddp_model_num_blocks(t->model);
  if (nb && ddp_model_hf_config(t->model)) ddp_model_block(t->model, 0, &o.wrap_cls, NULL, NULL);
  if (o.wrap_cls) snprintf(cls, sizeof cls, "%s", o.wrap_cls);
  /* Transformers' default backward_prefetch is NO_PREFETCH (PyTorch FSDP's own is
   * BACKWARD_PRE, ddp_fsdp_options_t's) */
  o.backward_prefetch = DDP_FSDP_NO_PREFETCH;
  ddp__train_ds_fsdp_options(t, &o); /* --deepspeed's stage3_prefetch_bucket_size */
  if (t->a->fsdp_config[0]) DDP_CHECK(fsdp_config(t, &o, cls, sizeof cls));
  DDP_CHECK(hybrid_setup(t, hybrid, &o));
  o.wrap_cls = cls;
  o.divide_in_place = t->a->gradient_as_bucket_view;
  DDP_CHECK(ddp__sync_grad_arith(t->a, t->rank, &o.arith, t->err));
  size_t np = ddp_model_num_params(t->model);
  int *group = ddp__calloc(np ? np : 1, sizeof *group);
  ddp_optim_options_t gopts[DDP__TRAIN_MAX_GROUPS];
  if (!group) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: out of memory");
  for (size_t i = 0; i < np; i++) group[i] = -1;
  for (size_t g = 0, off = 0; g < t->nopt; g++) {
    size_t n = ddp_optim_num_params(t->opt[g]);
    gopts[g] = *ddp_optim_options(t->opt[g]);
    for (size_t k = off; k < off + n; k++)
      for (size_t i = 0; i < np; i++)
        if (&ddp_model_param(t->model, i)->value == t->pairs[k].param) group[i] = (int)g;
    off += n;
  }
  ddp_status_t st = ddp_fsdp_create(t->pg, t->model, &o, gopts, group, t->nopt, &t->fsdp, t->err);
  ddp__free(group);
  return st;
}

/* ---------------------------------------------------------------- ZeRO-3 checkpoints */

/* tmp/pytorch_model_fsdp_0-0000<r+1>-of-0000<W>.safetensors (optim: optimizer_0-...), the
 * names of Accelerate's sharded FSDP checkpoint directories, flattened into files */
static void fsdp_file(char *buf, size_t cap, const char *dir, bool optim, int r, int W) {
  snprintf(buf, cap, "%s/%s-%05d-of-%05d.safetensors", dir,
           optim ? "optimizer_0" : "pytorch_model_fsdp_0", r + 1, W);
}

bool ddp__train_fsdp_sharded_save(const ddp__trainer_t *t) { return t->fsdp && t->fsdp_sharded_sd; }

/* pos[i]: model parameter i's position in its group's optimizer (the trainer's order). */
static ddp_status_t fsdp_pos(ddp__trainer_t *t, size_t **out) {
  size_t np = ddp_model_num_params(t->model);
  size_t *pos = ddp__calloc(np ? np : 1, sizeof *pos);
  if (!pos) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: out of memory");
  for (size_t g = 0, off = 0; g < t->nopt; g++) {
    size_t n = ddp_optim_num_params(t->opt[g]);
    for (size_t k = off; k < off + n; k++)
      for (size_t i = 0; i < np; i++)
        if (&ddp_model_param(t->model, i)->value == t->pairs[k].param) pos[i] = k - off;
    off += n;
  }
  *out = pos;
  return DDP_OK;
}

/* The trainer's own optimizers hold no state while ZeRO-3 steps the shards. */
static void clear_full(ddp__trainer_t *t) {
  for (size_t g = 0; g < t->nopt; g++)
    for (size_t k = 0; k < ddp_optim_num_params(t->opt[g]); k++) {
      ddp_tensor_t *v[3];
      ddp_optim_param_state_set(t->opt[g], k, false, 0, v, NULL);
    }
}

ddp_status_t ddp__train_fsdp_save_begin(ddp__trainer_t *t) {
  if (!t->fsdp || t->fsdp_sharded_sd) return DDP_OK;
  size_t *pos = NULL;
  DDP_CHECK(ddp_fsdp_gather_all(t->fsdp, t->err));
  DDP_CHECK(fsdp_pos(t, &pos));
  ddp_status_t st = ddp_fsdp_optim_gather(t->fsdp, t->opt, pos, t->err);
  ddp__free(pos);
  return st;
}

void ddp__train_fsdp_save_end(ddp__trainer_t *t) {
  if (!t->fsdp || t->fsdp_sharded_sd) return;
  ddp_fsdp_free_all(t->fsdp);
  clear_full(t);
}

ddp_status_t ddp__train_fsdp_save_shard(ddp__trainer_t *t, const char *tmp) {
  char m[DDP_TRAIN_STR_MAX + 160], o[DDP_TRAIN_STR_MAX + 160];
  fsdp_file(m, sizeof m, tmp, false, t->rank, t->world);
  fsdp_file(o, sizeof o, tmp, true, t->rank, t->world);
  return ddp_fsdp_save_sharded(t->fsdp, m, o, t->err);
}

ddp_status_t ddp__train_fsdp_probe(ddp__trainer_t *t, const char *dir, int world, bool *sharded) {
  char m[DDP_TRAIN_STR_MAX + 160];
  fsdp_file(m, sizeof m, dir, false, 0, world > 0 ? world : 1);
  *sharded = world > 0 && access(m, F_OK) == 0;
  if (!*sharded) return DDP_OK;
  if (!t->zero3)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "%s is a ZeRO-3 SHARDED_STATE_DICT checkpoint "
                      "(pytorch_model_fsdp_0-*-of-%05d "
                      "shards, no model.safetensors), which only ZeRO-3 (--fsdp full_shard or "
                      "--deepspeed stage 3) resumes; to go on with DDP or ZeRO-1/2, resume it "
                      "with ZeRO-3 and save with --fsdp_config "
                      "'{\"state_dict_type\": \"FULL_STATE_DICT\"}'",
                      dir, world);
  t->resume_shards = world;
  /* every shard against checksums.sha256, as ddp_train_checkpoint_load does for DDP's */
  return ddp__train_verify_checkpoint(dir, false, t->err);
}

ddp_status_t ddp__train_fsdp_resume(ddp__trainer_t *t) {
  if (!t->fsdp || !t->resume_dir[0]) return DDP_OK;
  if (!t->resume_shards) { /* FULL (or DDP's, ZeRO-1/2's): the loaded optimizer state */
    size_t *pos = NULL;
    DDP_CHECK(fsdp_pos(t, &pos));
    ddp_status_t st = ddp_fsdp_optim_scatter(t->fsdp, t->opt, pos, t->err);
    ddp__free(pos);
    clear_full(t);
    return st;
  }
  int stage = 0, hybrid = 0;
  if (t->a->fsdp[0]) DDP_CHECK(fsdp_stage(t->a->fsdp, t->rank, &stage, &hybrid, t->err));
  if (hybrid)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "--fsdp %s: resuming %s, a SHARDED_STATE_DICT checkpoint, is not built for "
                      "hybrid sharding; resume it with --fsdp full_shard and save with "
                      "\"state_dict_type\": \"FULL_STATE_DICT\"",
                      t->a->fsdp, t->resume_dir);
  int W = t->resume_shards;
  size_t cap = DDP_TRAIN_STR_MAX + 160;
  char *buf = ddp__calloc((size_t)W * 2, cap);
  const char **paths = ddp__calloc((size_t)W * 2, sizeof *paths);
  ddp_status_t st = DDP_OK;
  if (!buf || !paths) st = ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
  for (int r = 0; st == DDP_OK && r < 2 * W; r++) {
    fsdp_file(buf + (size_t)r * cap, cap, t->resume_dir, r >= W, r % W, W);
    paths[r] = buf + (size_t)r * cap;
  }
  if (st == DDP_OK) st = ddp_fsdp_load_sharded(t->fsdp, paths, paths + W, W, t->err);
  ddp__free(buf);
  ddp__free(paths);
  return st;
}
