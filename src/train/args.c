/* TrainingArguments by name: the field table, string and JSON setters, validation, help
 * text and the JSON dump written into trainer_state.json.
 *
 * One table drives everything. Each row names a field of ddp_train_args_t (HF's name), its
 * kind, its offset and size, its range and its help line; the setter parses by kind, so the
 * command line, the config file and --help cannot disagree about a field. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "ddp/hooks.h"
#include "ddp/train.h"
#include "train/train_internal.h"

typedef enum arg_kind { K_INT, K_U64, K_FLOAT, K_BOOL, K_TRI, K_STR } arg_kind_t;

typedef struct arg_field {
  const char *name;
  arg_kind_t kind;
  size_t offset, size;
  double lo, hi;   /* numeric range (inclusive) */
  const char *def; /* default as shown by --help */
  const char *help;
} arg_field_t;

#define F_INT(n, lo, hi, def, help) \
  { #n, K_INT, offsetof(ddp_train_args_t, n), sizeof(int64_t), lo, hi, def, help }
#define F_FLT(n, lo, hi, def, help) \
  { #n, K_FLOAT, offsetof(ddp_train_args_t, n), sizeof(double), lo, hi, def, help }
#define F_BOOL(n, def, help) \
  { #n, K_BOOL, offsetof(ddp_train_args_t, n), sizeof(bool), 0, 1, def, help }
#define F_TRI(n, def, help) \
  { #n, K_TRI, offsetof(ddp_train_args_t, n), sizeof(ddp_tristate_t), 0, 1, def, help }
#define F_STR(n, def, help) \
  { #n, K_STR, offsetof(ddp_train_args_t, n), sizeof(((ddp_train_args_t *)0)->n), 0, 0, def, help }

static const arg_field_t fields[] = {
    F_INT(per_device_train_batch_size, 1, 1 << 20, "8", "samples per rank per micro-batch"),
    F_INT(per_device_eval_batch_size, 1, 1 << 20, "8", "samples per rank per eval batch"),
    F_INT(gradient_accumulation_steps, 1, 1 << 20, "1",
          "micro-batches per optimizer step; no gradient sync on all but the last; loss / N"),
    F_FLT(num_train_epochs, 0, 1e9, "3.0", "epochs to train when max_steps <= 0"),
    F_INT(max_steps, -1, 1e15, "-1", "optimizer steps to train; overrides num_train_epochs"),
    F_BOOL(dataloader_drop_last, "false", "drop each rank's last partial batch"),
    F_FLT(learning_rate, 0, 1e9, "5e-5", "initial (peak) learning rate"),
    F_FLT(weight_decay, 0, 1e9, "0.0",
          "decoupled (adamw) or L2 (adam, sgd) decay; biases and LayerNorms exempt (HF)"),
    F_STR(weight_decay_grouping, "transformers",
          "libddp: transformers (no decay on biases, LayerNorms) or all (torch.optim)"),
    F_BOOL(zero_grad_set_to_none, "true",
           "libddp: zero_grad(set_to_none): true gradients None, false zero-filled (1.13)"),
    F_FLT(adam_beta1, 0, 0.999999999, "0.9", "Adam beta1"),
    F_FLT(adam_beta2, 0, 0.999999999, "0.999", "Adam beta2"),
    F_FLT(adam_epsilon, 0, 1, "1e-8", "Adam epsilon"),
    F_STR(optim, "adamw_torch", "optimizer: adamw_torch (= adamw), adam, sgd"),
    F_STR(optim_args, "", "key=value,...: sgd takes momentum, dampening, nesterov"),
    F_FLT(max_grad_norm, -1e9, 1e9, "1.0", "clip the global gradient norm; <= 0 disables"),
    F_STR(lr_scheduler_type, "linear",
          "linear, cosine, cosine_with_restarts, polynomial, inverse_sqrt, "
          "cosine_with_min_lr, constant, constant_with_warmup"),
    F_STR(lr_scheduler_kwargs, "",
          "JSON object: num_cycles (cosine kinds), lr_end and power (polynomial), "
          "timescale (inverse_sqrt), min_lr or min_lr_rate (cosine_with_min_lr)"),
    F_INT(warmup_steps, 0, 1e15, "0", "linear warmup steps (wins over warmup_ratio)"),
    F_FLT(warmup_ratio, 0, 1, "0.0", "warmup as a fraction of the training steps"),
    {"seed", K_U64, offsetof(ddp_train_args_t, seed), sizeof(uint64_t), 0, 4294967295.0, "42",
     "seed of initial weights, shuffling and dropout"},
    F_INT(data_seed, -1, 4294967295.0, "-1", "seed of the data order (HF; -1: seed)"),
    F_BOOL(dataloader_shuffle, "true", "libddp: false: DistributedSampler(shuffle=False)"),
    F_FLT(logging_steps, 0, 1e15, "500", "log (and check replicas) every N steps; < 1: fraction"),
    F_STR(eval_strategy, "no", "no, steps, epoch"),
    F_FLT(eval_steps, 0, 1e15, "0", "evaluate every N steps (0: logging_steps); < 1: fraction"),
    F_FLT(eval_split, 0, 0.9, "0.1", "held-out fraction of the data for evaluation (libddp)"),
    F_STR(save_strategy, "steps", "steps, epoch, no"),
    F_FLT(save_steps, 0, 1e15, "500", "save a checkpoint every N steps; < 1: fraction"),
    F_INT(save_total_limit, -1, 1e9, "-1", "keep at most N checkpoints (-1: all)"),
    F_BOOL(save_safetensors, "true", "HF: model weights as safetensors (false is unsupported)"),
    F_STR(max_shard_size, "5GB",
          "save_pretrained's: shard the saved weights above this size (10MB, 2GiB, bytes)"),
    F_STR(output_dir, "trainer_output", "checkpoints, metrics.jsonl, loss.svg"),
    F_STR(resume_from_checkpoint, "", "a checkpoint directory, or true for the latest"),
    F_BOOL(gradient_checkpointing, "false", "enters ddp_find_unused_parameters' default only"),
    F_BOOL(disable_tqdm, "false", "plain log lines even on a terminal"),
    F_STR(dump_dir, "", "write per-step dumps for ddp-compare (docs/dumps.md)"),
    F_STR(forward_flags, "0",
          "libddp: branch-layer flags: per rank (commas), per step (colons), e.g. 0:1,1"),
    F_BOOL(dump_local_grads, "false", "libddp: dumps also hold each rank's local_grad.*"),
    F_STR(ddp_backend, "", "gloo (= tcp), threads, shm, tcp, mpi, nccl; empty: automatic"),
    F_TRI(ddp_find_unused_parameters, "none",
          "none: true unless gradient_checkpointing (HF's rule)"),
    F_FLT(ddp_bucket_cap_mb, -1, 1 << 20, "-1", "DDP bucket size in MiB (-1: 25)"),
    F_FLT(ddp_first_bucket_mb, -1, 1 << 20, "-1",
          "libddp: first bucket's cap in MiB (-1: 1 when the cap is unset, else the cap)"),
    F_TRI(ddp_broadcast_buffers, "none", "broadcast buffers before each forward (none: true)"),
    F_INT(ddp_timeout, 1, 1e9, "1800", "seconds any collective may wait"),
    F_TRI(ddp_static_graph, "none", "DDP static_graph (none: false)"),
    F_BOOL(gradient_as_bucket_view, "false", "gradients live in the DDP buckets"),
    F_BOOL(ddp_reducer, "true",
           "libddp: bucketed DDP reducer; false: one flat gradient allreduce after backward"),
    F_STR(ddp_trace, "", "libddp: write the Perfetto/Chrome timeline of every rank to FILE"),
    F_STR(comm_hook, "no", "no, fp16, bf16, power_sgd, batched_power_sgd, allreduce"),
    F_STR(comm_wrapper, "no", "no, fp16, bf16"),
    F_STR(comm_state_option, "", "JSON object of PowerSGD state options"),
    F_STR(power_sgd_init_q, "",
          "libddp: torch_reference.py's powersgd_q.safetensors: start PowerSGD from its Qs"),
    F_STR(deepspeed, "", "HF: a DeepSpeed config; zero_optimization.stage 1|2|3: ZeRO-1/2/3"),
    F_STR(fsdp, "", "HF: FSDP options; full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard"),
    F_STR(fsdp_config, "",
          "HF: FSDP config (JSON file or object): transformer_layer_cls_to_wrap, "
          "min_num_params, reshard_after_forward"),
    F_STR(sharding_arithmetic, "ddp",
          "libddp: whose gradient arithmetic (where the reduction divides, the clipping "
          "norm's order): ddp, fsdp1, fsdp2, deepspeed, deepspeed_allreduce"),
    F_BOOL(zero_parameters_as_bucket_view, "false",
           "PyTorch ZeRO-1 (--deepspeed stage 1): one flat parameter bucket per rank, one "
           "broadcast each"),
    F_STR(zero_comm_hook, "no",
          "PyTorch ZeRO-1's step inside DDP's comm hook: no, hook_with_zero_step, "
          "hook_with_zero_step_interleaved (wraps --comm_hook; the first 2 steps update nothing)"),
    F_BOOL(zero_shard_buckets, "false",
           "PyTorch hook_with_zero_step's shard_buckets (false: bucket i to rank i % W)"),
    F_INT(world_size_invariant_shards, 0, 65536, "0",
          "libddp: K shards per global batch: the same bits for any world size (0: off)"),
    F_BOOL(overwrite_output_dir, "false",
           "HF: recorded; output_dir is written either way, never while another run holds it"),
    F_BOOL(halt_on_nonfinite, "true",
           "libddp: a NaN/Inf loss or gradient norm stops the run (false: a warning)"),
};

size_t ddp_train_arg_count(void) { return DDP_ARRAY_LEN(fields); }

void ddp_train_arg_info(size_t i, const char **name, const char **type, const char **def,
                        const char **help) {
  DDP_REQUIRE(i < DDP_ARRAY_LEN(fields));
  static const char *const kinds[] = {"int", "int", "float", "bool", "Optional[bool]", "str"};
  if (name) *name = fields[i].name;
  if (type) *type = kinds[fields[i].kind];
  if (def) *def = fields[i].def;
  if (help) *help = fields[i].help;
}

/* Levenshtein distance, for "did you mean" on an unknown name. */
static size_t edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  if (la > 63 || lb > 63) return 99;
  size_t row[64];
  for (size_t j = 0; j <= lb; j++) row[j] = j;
  for (size_t i = 1; i <= la; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t up = row[j];
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      size_t best = DDP_MIN(row[j] + 1, row[j - 1] + 1);
      row[j] = DDP_MIN(best, diag + cost);
      diag = up;
    }
  }
  return row[lb];
}

static const arg_field_t *find_field(const char *name) {
  for (size_t i = 0; i < DDP_ARRAY_LEN(fields); i++) {
    if (!strcmp(fields[i].name, name)) return &fields[i];
  }
  return NULL;
}

/* The caller's args read by the one options policy (ddp__opts_read): a struct from an
 * older header gets the defaults past its end. */
static ddp_train_args_t args_in(const ddp_train_args_t *a) {
  ddp_train_args_t c = DDP_TRAIN_ARGS_INIT;
  ddp__opts_read(&c, sizeof c, a);
  return c;
}

ddp_status_t ddp_train_args_set(ddp_train_args_t *a, const char *name, const char *value,
                                ddp_error_t *err) {
  DDP_REQUIRE(a && name && value);
  /* HF's name for eval_strategy until Transformers 4.46 (TrainingArguments took both). */
  if (!strcmp(name, "evaluation_strategy")) name = "eval_strategy";
  const arg_field_t *f = find_field(name);
  if (!f) {
    ddp_status_t st = ddp__train_args_hf(name, value, err);
    if (st != DDP_ERR_NOT_FOUND) return st;
    const char *best = NULL;
    size_t bd = 4, nf = DDP_ARRAY_LEN(fields);
    for (size_t i = 0; i < nf + ddp__train_args_hf_count(); i++) {
      const char *n = i < nf ? fields[i].name : ddp__train_args_hf_name(i - nf);
      size_t d = edit_distance(name, n);
      if (d < bd) {
        bd = d;
        best = n;
      }
    }
    return ddp__error_quiet(err, DDP_ERR_NOT_FOUND, "unknown argument \"%s\"%s%s%s", name,
                            best ? " (did you mean \"" : "", best ? best : "", best ? "\"?)" : "");
  }
  /* A caller built against an older header has a smaller struct: the fields past it are
   * not its to set (ddp__opts_read's policy gives them their defaults when it is read). */
  DDP_REQUIRE(a->struct_size >= sizeof(size_t) && a->struct_size <= sizeof *a);
  if (f->offset + f->size > a->struct_size) {
    return ddp__error_quiet(err, DDP_ERR_NOT_FOUND,
                            "argument \"%s\" is newer than the caller's ddp_train_args_t "
                            "(struct_size %zu)",
                            name, a->struct_size);
  }
  char *p = (char *)a + f->offset;
  char *end = NULL;
  switch (f->kind) {
    case K_INT:
    case K_U64: {
      errno = 0;
      long long x = strtoll(value, &end, 10);
      if (errno || end == value || *end || (double)x < f->lo || (double)x > f->hi) {
        return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                                "%s expects an integer in [%.0f, %.0f], got \"%s\"", name, f->lo,
                                f->hi, value);
      }
      if (f->kind == K_INT) {
        *(int64_t *)p = x;
      } else {
        *(uint64_t *)p = (uint64_t)x;
      }
      break;
    }
    case K_FLOAT: {
      errno = 0;
      double x = strtod(value, &end);
      if (errno || end == value || *end || !isfinite(x) || x < f->lo || x > f->hi) {
        return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                                "%s expects a number in [%g, %g], got \"%s\"", name, f->lo, f->hi,
                                value);
      }
      *(double *)p = x;
      break;
    }
    case K_BOOL: {
      bool b;
      if (!ddp__train_parse_bool(value, &b)) {
        return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                                "%s expects true or false, got \"%s\"", name, value);
      }
      *(bool *)p = b;
      break;
    }
    case K_TRI: {
      bool b;
      if (!strcasecmp(value, "none") || !strcasecmp(value, "null")) {
        *(ddp_tristate_t *)p = DDP_UNSET;
      } else if (ddp__train_parse_bool(value, &b)) {
        *(ddp_tristate_t *)p = b ? DDP_TRUE : DDP_FALSE;
      } else {
        return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                                "%s expects true, false or none, got \"%s\"", name, value);
      }
      break;
    }
    case K_STR:
      if (strlen(value) >= f->size) {
        return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "%s: value longer than %zu bytes",
                                name, f->size - 1);
      }
      memcpy(p, value, strlen(value) + 1);
      break;
  }
  return DDP_OK;
}

/* Whether every item of a JSON list is a string. */
static bool all_strings(const cJSON *list) {
  const cJSON *x;
  cJSON_ArrayForEach(x, list) {
    if (!cJSON_IsString(x)) return false;
  }
  return true;
}

/* A JSON list of strings as one string, the items joined by spaces (freed with
 * cJSON_free); NULL when memory runs out. */
static char *join_names(const cJSON *list) {
  size_t n = 1;
  const cJSON *x;
  cJSON_ArrayForEach(x, list) n += strlen(x->valuestring) + 1;
  char *s = cJSON_malloc(n), *p = s;
  if (!s) return NULL;
  *p = 0;
  cJSON_ArrayForEach(x, list) { p += sprintf(p, "%s%s", p == s ? "" : " ", x->valuestring); }
  return s;
}

ddp_status_t ddp_train_args_load_json(ddp_train_args_t *a, const char *path, ddp_error_t *err) {
  DDP_REQUIRE(a && path);
  char *text = NULL;
  cJSON *root = NULL;
  /* Quiet: a bad config file is the caller's usage error to report. */
  ddp_status_t st = ddp__file_read(path, 0, DDP__QUIET, "config file", &text, NULL, err);
  if (st != DDP_OK) return st;
  char src[DDP_TRAIN_STR_MAX + 16];
  snprintf(src, sizeof src, "config file %s", path);
  if ((st = ddp__json_read(text, src, DDP__QUIET, &root, err)) != DDP_OK) goto out;
  if (!cJSON_IsObject(root)) {
    st = ddp__error_quiet(err, DDP_ERR_INVALID_DATA, "config file %s: not a JSON object", path);
    goto out;
  }
  const cJSON *it;
  cJSON_ArrayForEach(it, root) {
    char buf[64];
    const char *v = NULL;
    char *printed = NULL;
    if (cJSON_IsString(it)) {
      v = it->valuestring;
    } else if (cJSON_IsBool(it)) {
      v = cJSON_IsTrue(it) ? "true" : "false";
    } else if (cJSON_IsNull(it)) {
      /* Unset: an Optional[bool]'s none, else the field's default (HF writes null for an
       * unset deepspeed, resume_from_checkpoint, ddp_bucket_cap_mb, ...; passing "none" on
       * would name a file "none"). evaluation_strategy, unset beside eval_strategy in
       * Transformers 4.41-4.45's dumps, leaves eval_strategy alone. */
      if (!strcmp(it->string, "evaluation_strategy")) continue;
      const arg_field_t *f = find_field(it->string);
      v = f && f->kind != K_TRI ? f->def : "none";
    } else if (cJSON_IsNumber(it)) {
      double d = it->valuedouble;
      if (d == floor(d) && fabs(d) < 1e15) {
        snprintf(buf, sizeof buf, "%.0f", d);
      } else {
        snprintf(buf, sizeof buf, "%.17g", d);
      }
      v = buf;
    } else if (cJSON_IsObject(it)) {
      /* comm_state_option, fsdp_config, HF's *_kwargs: their JSON text. */
      printed = cJSON_PrintUnformatted(it);
      v = printed;
    } else if (cJSON_IsArray(it) && all_strings(it)) {
      /* HF's list-valued fsdp, report_to, debug: the names joined by spaces, as the
       * command line gives them ("full_shard auto_wrap"). */
      if (!(printed = join_names(it))) {
        st = ddp__error_quiet(err, DDP_ERR_NO_MEMORY, "config file %s: key \"%s\": no memory", path,
                              it->string);
        goto out;
      }
      v = printed;
    }
    if (!v) {
      st = ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "config file %s: key \"%s\" has a value of the wrong type", path,
                            it->string);
      goto out;
    }
    ddp_error_t e = {0};
    st = ddp_train_args_set(a, it->string, v, &e);
    if (printed) cJSON_free(printed);
    if (st != DDP_OK) {
      ddp__error_quiet(err, st, "config file %s: %s", path, e.msg);
      goto out;
    }
  }
out:
  cJSON_Delete(root);
  ddp__free(text);
  return st;
}

static bool one_of(const char *v, const char *const *choices) {
  for (; *choices; choices++) {
    if (!strcmp(v, *choices)) return true;
  }
  return false;
}

/* One value of forward_flags: spaces, a decimal or 0x-hex integer, spaces. Returns the
 * character after it (',', ':' or the end), NULL when malformed. */
static const char *flag_entry(const char *p, uint64_t *v) {
  while (*p == ' ') p++;
  bool hex = p[0] == '0' && (p[1] == 'x' || p[1] == 'X');
  if (!isxdigit((unsigned char)p[hex ? 2 : 0]) || (!hex && !isdigit((unsigned char)*p))) {
    return NULL;
  }
  char *end;
  errno = 0;
  *v = strtoull(p, &end, hex ? 16 : 10);
  if (errno) return NULL;
  while (*end == ' ') end++;
  return *end == ',' || *end == ':' || *end == 0 ? end : NULL;
}

bool ddp__train_forward_flags_at(const char *text, int rank, int64_t step, uint64_t *out) {
  DDP_REQUIRE(text && rank >= 0 && step >= 0);
  int n = 0; /* rank entries */
  uint64_t v;
  for (const char *p = text;; p++) {
    if (!(p = flag_entry(p, &v))) return false;
    if (*p != ':') n++;
    if (*p == 0) break;
  }
  const char *p = text;
  for (int i = 0; i < rank % n; p++) { /* to the start of entry rank % n */
    p = flag_entry(p, &v);
    if (*p == ',') i++;
  }
  int64_t ns = 0; /* the entry's step values */
  for (const char *q = p;; q++) {
    q = flag_entry(q, &v);
    ns++;
    if (*q != ':') break;
  }
  for (int64_t i = 0; i < step % ns; i++) p = flag_entry(p, &v) + 1;
  flag_entry(p, &v);
  if (out) *out = v;
  return true;
}

bool ddp__train_forward_flags(const char *text, int rank, uint64_t *out) {
  return ddp__train_forward_flags_at(text, rank, 0, out);
}

/* One schedule argument of lr_scheduler_kwargs into s, by name. */
static ddp_status_t lr_kwarg(const char *kind, const cJSON *it, ddp_lr_schedule_t *s,
                             double *min_lr, ddp_error_t *err) {
  static const struct {
    ddp_lr_kind_t kind;
    const char *takes;
  } takes[] = {{DDP_LR_CONSTANT, "none"},
               {DDP_LR_CONSTANT_WITH_WARMUP, "none"},
               {DDP_LR_LINEAR, "none"},
               {DDP_LR_COSINE, "num_cycles"},
               {DDP_LR_COSINE_WITH_RESTARTS, "num_cycles"},
               {DDP_LR_POLYNOMIAL, "lr_end, power"},
               {DDP_LR_INVERSE_SQRT, "timescale"},
               {DDP_LR_COSINE_WITH_MIN_LR, "num_cycles, min_lr, min_lr_rate"}};
  const char *list = "none";
  for (size_t i = 0; i < DDP_ARRAY_LEN(takes); i++) {
    if (takes[i].kind == s->kind) list = takes[i].takes;
  }
  /* A name is taken when it is one of the list's comma-separated words. */
  const char *n = it->string, *hit = strstr(list, n);
  size_t len = strlen(n);
  bool taken = hit && (hit == list || hit[-1] == ' ') && (hit[len] == 0 || hit[len] == ',');
  if (!taken) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "lr_scheduler_kwargs: \"%s\" is not an argument of the %s "
                            "schedule (it takes %s)",
                            n, kind, list);
  }
  double x = it->valuedouble;
  if (!cJSON_IsNumber(it) || !isfinite(x) ||
      (!strcmp(n, "timescale") && (x != floor(x) || x < 1 || x > 1e15))) {
    char *shown = cJSON_PrintUnformatted(it);
    ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "lr_scheduler_kwargs: %s takes %s, got %s", n,
                     strcmp(n, "timescale") ? "a number" : "a positive integer",
                     shown ? shown : "?");
    cJSON_free(shown);
    return DDP_ERR_INVALID_ARGUMENT;
  }
  if (!strcmp(n, "num_cycles")) s->num_cycles = x;
  if (!strcmp(n, "lr_end")) s->lr_end = x;
  if (!strcmp(n, "power")) s->power = x;
  if (!strcmp(n, "timescale")) s->timescale = (int64_t)x;
  if (!strcmp(n, "min_lr_rate")) s->min_lr_rate = x;
  if (!strcmp(n, "min_lr")) *min_lr = x;
  return DDP_OK;
}

ddp_status_t ddp__train_lr_kwargs(const ddp_train_args_t *a, ddp_lr_schedule_t *s,
                                  ddp_error_t *err) {
  const char *kind = ddp_lr_kind_name(s->kind);
  const char *text = a->lr_scheduler_kwargs;
  cJSON *root = NULL;
  if (text[strspn(text, " ")] && !(root = cJSON_ParseWithOpts(text, NULL, 1))) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "lr_scheduler_kwargs: not JSON: %s",
                            text);
  }
  ddp_status_t st = DDP_OK;
  if (root && !cJSON_IsObject(root)) {
    st = ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                          "lr_scheduler_kwargs: a JSON object of the %s schedule's arguments, "
                          "got %s",
                          kind, text);
  }
  double min_lr = NAN;
  bool rate = false;
  const cJSON *it;
  cJSON_ArrayForEach(it, root) {
    if (st != DDP_OK) break;
    st = lr_kwarg(kind, it, s, &min_lr, err);
    rate = rate || !strcmp(it->string, "min_lr_rate");
  }
  cJSON_Delete(root);
  if (st != DDP_OK || s->kind != DDP_LR_COSINE_WITH_MIN_LR) return st;
  /* HF's get_cosine_with_min_lr_schedule_with_warmup: exactly one of the two, min_lr as a
   * fraction of the optimizer's lr. */
  if (rate && !isnan(min_lr)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "lr_scheduler_kwargs: only one of min_lr or min_lr_rate should be "
                            "set (cosine_with_min_lr)");
  }
  if (!rate && isnan(min_lr)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "lr_scheduler_type cosine_with_min_lr: one of min_lr or min_lr_rate "
                            "should be set through lr_scheduler_kwargs");
  }
  if (!rate) s->min_lr_rate = min_lr / s->lr_init;
  return DDP_OK;
}

ddp_status_t ddp__train_optim_args(const ddp_train_args_t *a, ddp_optim_options_t *o,
                                   ddp_error_t *err) {
  char buf[DDP_TRAIN_STR_MAX];
  size_t len = 0;
  for (const char *p = a->optim_args; *p && len + 1 < sizeof buf; p++) {
    if (*p != ' ') buf[len++] = *p; /* HF removes every space */
  }
  buf[len] = 0;
  bool sgd = !strcmp(a->optim, "sgd");
  for (char *item = buf, *next; len && item; item = next) {
    next = strchr(item, ',');
    if (next) *next++ = 0;
    char *eq = strchr(item, '=');
    if (!eq || eq == item) {
      return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "optim_args: \"%s\" is not key=value (optim_args is "
                              "\"key=value,key=value\")",
                              item);
    }
    *eq = 0;
    const char *key = item, *val = eq + 1;
    char *end = NULL;
    double x = strtod(val, &end);
    bool num = end != val && *end == 0 && isfinite(x);
    bool b = false;
    if (sgd && !strcmp(key, "momentum") && num && x >= 0) {
      o->momentum = x;
    } else if (sgd && !strcmp(key, "dampening") && num) {
      o->dampening = x;
    } else if (sgd && !strcmp(key, "nesterov") && ddp__train_parse_bool(val, &b)) {
      o->nesterov = b;
    } else if (sgd && (!strcmp(key, "momentum") || !strcmp(key, "dampening") ||
                       !strcmp(key, "nesterov"))) {
      return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "optim_args: %s=%s: momentum takes a number >= 0, dampening a "
                              "number, nesterov true or false",
                              key, val);
    } else {
      return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "optim_args: unknown key \"%s\" for optim %s (sgd takes "
                              "momentum, dampening, nesterov; the others take none)",
                              key, a->optim);
    }
  }
  if (o->nesterov && (o->momentum <= 0 || o->dampening != 0)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "optim_args: Nesterov momentum requires a momentum and zero "
                            "dampening");
  }
  return DDP_OK;
}

/* "gloo (= tcp), threads, shm, tcp, mpi, nccl": every name of libddp's one list of backends
 * (DDP_BACKEND_LIST), aliases first, built in this library or not. */
static const char *backend_choices(char *buf, size_t cap) {
  static const ddp_backend_info_t all[] = {
#define BACKEND_(name, alias, ranks, optional) {name, alias, ranks, optional},
      DDP_BACKEND_LIST(BACKEND_)
#undef BACKEND_
  };
  size_t o = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < DDP_ARRAY_LEN(all) && o < cap; i++)
    if (all[i].alias[0])
      o += (size_t)snprintf(buf + o, cap - o, "%s (= %s), ", all[i].alias, all[i].name);
  for (size_t i = 0; i < DDP_ARRAY_LEN(all) && o < cap; i++)
    o += (size_t)snprintf(buf + o, cap - o, "%s%s", i ? ", " : "", all[i].name);
  return buf;
}

/* world_size_invariant_shards: what the mode cannot make independent of the world size
 * is refused here; what depends on the world size (K / (W GA) shards per micro-batch) is
 * checked by the trainer. */
static ddp_status_t validate_invariant(const ddp_train_args_t *a, ddp_error_t *err) {
  if (a->world_size_invariant_shards == 0) return DDP_OK;
  const char *why = NULL;
  if (!a->ddp_reducer)
    why = "it runs in the DDP reducer (ddp_reducer false)";
  else if ((strcmp(a->comm_hook, "no") != 0 && strcmp(a->comm_hook, "allreduce") != 0) ||
           strcmp(a->comm_wrapper, "no") != 0)
    why = "a comm hook's compression or its own sum is not invariant to the world size; "
          "comm_hook must be no or allreduce, comm_wrapper no";
  else if (a->dump_local_grads)
    why = "dump_local_grads: a rank's local gradient is a set of shard gradients there";
  else if (strchr(a->forward_flags, ','))
    why = "forward_flags per rank: a shard's result would depend on the rank computing it";
  if (!why) return DDP_OK;
  return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                          "world_size_invariant_shards %lld is refused: %s",
                          (long long)a->world_size_invariant_shards, why);
}

ddp_status_t ddp_train_args_validate(const ddp_train_args_t *in, ddp_error_t *err) {
  DDP_REQUIRE(in);
  ddp_train_args_t copy = args_in(in);
  const ddp_train_args_t *a = &copy;
  static const char *const optims[] = {"adamw_torch", "adamw", "adam", "sgd", NULL};
  static const char *const strategies[] = {"no", "steps", "epoch", NULL};
  if (!one_of(a->optim, optims)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "optim \"%s\" is not available; the choices are adamw_torch, adamw, "
                            "adam, sgd",
                            a->optim);
  }
  ddp_lr_schedule_t sched = DDP_LR_SCHEDULE_INIT;
  ddp_error_t e = {0};
  if (ddp_lr_kind_from_name(a->lr_scheduler_type, &sched.kind, &e) != DDP_OK) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "lr_scheduler_type: %s", e.msg);
  }
  sched.lr_init = a->learning_rate;
  DDP_CHECK(ddp__train_lr_kwargs(a, &sched, err));
  if (!one_of(a->eval_strategy, strategies) || !one_of(a->save_strategy, strategies)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "eval_strategy \"%s\" / save_strategy \"%s\": the choices are no, "
                            "steps, epoch",
                            a->eval_strategy, a->save_strategy);
  }
  if (a->max_steps <= 0 && !(a->num_train_epochs > 0)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "nothing to train: max_steps is %lld and num_train_epochs %g",
                            (long long)a->max_steps, a->num_train_epochs);
  }
  if (a->max_steps == 0) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "max_steps must be positive, or -1 to use num_train_epochs");
  }
  /* HF: a value below 1 is a fraction of the training steps; above 1 it must be whole. */
  const struct {
    const char *name;
    double v;
    bool zero_ok;
  } steps[] = {{"logging_steps", a->logging_steps, false},
               {"eval_steps", a->eval_steps, true},
               {"save_steps", a->save_steps, false}};
  for (size_t i = 0; i < DDP_ARRAY_LEN(steps); i++) {
    double v = steps[i].v;
    if ((v == 0 && !steps[i].zero_ok) || v < 0 || (v > 1 && v != floor(v))) {
      return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                              "%s must be a whole number of steps, or a fraction in (0, 1) of "
                              "the training steps; got %g",
                              steps[i].name, v);
    }
  }
  if (!a->output_dir[0]) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "output_dir is empty");
  }
  if (a->ddp_backend[0] && !ddp_backend_info(a->ddp_backend)) {
    char choices[160];
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "ddp_backend \"%s\" is not available in libddp; the choices are %s",
                            a->ddp_backend, backend_choices(choices, sizeof choices));
  }
  if (a->ddp_bucket_cap_mb == 0) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "ddp_bucket_cap_mb must be positive (or -1 for the default 25)");
  }
  if (a->ddp_first_bucket_mb != -1 && !(a->ddp_first_bucket_mb > 0)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "ddp_first_bucket_mb must be positive (or -1 for the reducer's "
                            "rule), got %g",
                            a->ddp_first_bucket_mb);
  }
  if (a->ddp_trace[0] && !a->ddp_reducer) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "ddp_trace needs ddp_reducer true: the timeline is the reducer's");
  }
  ddp_optim_options_t oo = DDP_SGD_OPTIONS_INIT;
  DDP_CHECK(ddp__train_optim_args(a, &oo, err));
  if (!ddp__train_forward_flags(a->forward_flags, 0, NULL)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "forward_flags expects one integer >= 0 (decimal or 0x hex), or "
                            "one per rank separated by commas, each one integer or one per "
                            "step separated by colons, got \"%s\"",
                            a->forward_flags);
  }
  if (strcmp(a->weight_decay_grouping, "transformers") != 0 &&
      strcmp(a->weight_decay_grouping, "all") != 0) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "weight_decay_grouping \"%s\": the choices are transformers, all",
                            a->weight_decay_grouping);
  }
  /* The hooks layer knows the names, the PowerSGD keys and their ranges. */
  ddp_error_t he = {0};
  if (ddp_hooks_validate(a->comm_hook, a->comm_wrapper, a->comm_state_option, &he) != DDP_OK) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "%s", he.msg);
  }
  if (a->power_sgd_init_q[0] && strcmp(a->comm_hook, "power_sgd") != 0 &&
      strcmp(a->comm_hook, "batched_power_sgd") != 0) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                            "power_sgd_init_q needs comm_hook power_sgd or batched_power_sgd "
                            "(comm_hook is \"%s\")",
                            a->comm_hook);
  }
  DDP_CHECK(validate_invariant(a, err));
  if (!a->save_safetensors) {
    return ddp__error_quiet(err, DDP_ERR_UNSUPPORTED,
                            "save_safetensors false would save pytorch_model.bin (a pickle), "
                            "which libddp does not write; keep save_safetensors true");
  }
  int64_t shard_bytes;
  DDP_CHECK(ddp_parse_file_size(a->max_shard_size, "max_shard_size", &shard_bytes, err));
  if (!a->ddp_reducer && strcmp(a->comm_hook, "no") != 0) {
    return ddp__error_quiet(err, DDP_ERR_UNSUPPORTED,
                            "comm_hook \"%s\" runs inside the DDP reducer; it needs ddp_reducer "
                            "true (the flat allreduce path has no hooks)",
                            a->comm_hook);
  }
  return DDP_OK;
}

const char *ddp_train_backend_name(const ddp_train_args_t *a) {
  DDP_REQUIRE(a);
  /* A pointer into the caller's struct, so read in place; past an older struct's end the
   * field has its default, "" (auto). */
  if (offsetof(ddp_train_args_t, ddp_backend) + sizeof a->ddp_backend > a->struct_size ||
      !a->ddp_backend[0])
    return NULL;
  const ddp_backend_info_t *b = ddp_backend_info(a->ddp_backend); /* "gloo" is tcp */
  return b ? b->name : a->ddp_backend;
}

bool ddp_train_find_unused(const ddp_train_args_t *in) {
  ddp_train_args_t a = args_in(in);
  /* HF: unset means False with gradient checkpointing, True otherwise (a plain module is
   * not a PreTrainedModel, and a PreTrainedModel without checkpointing also gets True). */
  if (a.ddp_find_unused_parameters == DDP_UNSET) return !a.gradient_checkpointing;
  return a.ddp_find_unused_parameters == DDP_TRUE;
}

bool ddp_train_broadcast_buffers(const ddp_train_args_t *in) {
  return args_in(in).ddp_broadcast_buffers != DDP_FALSE;
}

bool ddp_train_static_graph(const ddp_train_args_t *in) {
  return args_in(in).ddp_static_graph == DDP_TRUE;
}

ddp_status_t ddp_train_args_to_json(const ddp_train_args_t *in, char **out) {
  DDP_REQUIRE(in && out);
  *out = NULL;
  ddp_train_args_t copy = args_in(in), *a = &copy;
  cJSON *o = cJSON_CreateObject();
  if (!o) return DDP_ERR_NO_MEMORY;
  for (size_t i = 0; i < DDP_ARRAY_LEN(fields); i++) {
    const arg_field_t *f = &fields[i];
    const char *p = (const char *)a + f->offset;
    cJSON *v = NULL;
    switch (f->kind) {
      case K_INT: v = cJSON_CreateNumber((double)*(const int64_t *)p); break;
      case K_U64: v = cJSON_CreateNumber((double)*(const uint64_t *)p); break;
      case K_FLOAT: v = cJSON_CreateNumber(*(const double *)p); break;
      case K_BOOL: v = cJSON_CreateBool(*(const bool *)p); break;
      case K_TRI: {
        ddp_tristate_t t = *(const ddp_tristate_t *)p;
        v = t == DDP_UNSET ? cJSON_CreateNull() : cJSON_CreateBool(t == DDP_TRUE);
        break;
      }
      case K_STR: v = cJSON_CreateString(p); break;
    }
    if (!v || !cJSON_AddItemToObject(o, f->name, v)) {
      cJSON_Delete(v);
      cJSON_Delete(o);
      return DDP_ERR_NO_MEMORY;
    }
  }
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!s) return DDP_ERR_NO_MEMORY;
  size_t n = strlen(s) + 1;
  *out = ddp_malloc(n);
  if (*out) memcpy(*out, s, n);
  cJSON_free(s);
  return *out ? DDP_OK : DDP_ERR_NO_MEMORY;
}

bool ddp__train_arg_text(const ddp_train_args_t *a, size_t i, char *buf, size_t cap) {
  DDP_REQUIRE(a && i < DDP_ARRAY_LEN(fields) && buf && cap > 0);
  const arg_field_t *f = &fields[i];
  const char *p = (const char *)a + f->offset;
  switch (f->kind) {
    case K_INT: snprintf(buf, cap, "%lld", (long long)*(const int64_t *)p); break;
    case K_U64: snprintf(buf, cap, "%llu", (unsigned long long)*(const uint64_t *)p); break;
    case K_FLOAT: snprintf(buf, cap, "%.17g", *(const double *)p); break;
    case K_BOOL: snprintf(buf, cap, "%s", *(const bool *)p ? "true" : "false"); break;
    case K_TRI: {
      ddp_tristate_t t = *(const ddp_tristate_t *)p;
      snprintf(buf, cap, "%s", t == DDP_UNSET ? "none" : t == DDP_TRUE ? "true" : "false");
      break;
    }
    case K_STR: snprintf(buf, cap, "\"%s\"", p); break;
  }
  /* Each rank's own: the progress bar (rank 0 draws it), ddp_timeout (from each process's
   * DDP_TIMEOUT) and the paths, which may name each host's own disk. Every other argument
   * shapes the data, the steps or the collectives, so every rank must be given the same. */
  static const char *const own[] = {"disable_tqdm",           "ddp_timeout", "output_dir",
                                    "resume_from_checkpoint", "dump_dir",    "ddp_trace",
                                    "power_sgd_init_q"};
  for (size_t k = 0; k < DDP_ARRAY_LEN(own); k++)
    if (!strcmp(f->name, own[k])) return false;
  return true;
}
