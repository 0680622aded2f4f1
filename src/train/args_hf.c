/* Hugging Face TrainingArguments that ddp-train has no field for, and booleans as
 * HfArgumentParser reads them.
 *
 * A user's command line or config file written for Transformers' Trainer carries arguments
 * that steer what ddp-train does not do (upload to the Hub, mixed precision, logging
 * integrations) or that have no bearing on a CPU run's numbers (do_train, the dataloader's
 * worker count, local_rank). Refusing them as unknown would make every such command line
 * fail on its first flag; ignoring them would let a run pretend to do what it does not. So
 * each name here has a rule: a name that changes nothing in a run of ddp-train takes any
 * value of its type (checked), and a name that would change the run takes only the values
 * under which ddp-train already behaves as HF does (its default, as a rule), and any other
 * value is refused naming the argument, the value and why. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "train/train_internal.h"

typedef enum hf_kind { HB, HI, HF, HS } hf_kind_t; /* bool, int, float, string */

typedef struct hf_arg {
  const char *name;
  hf_kind_t kind;
  /* NULL: any value of the kind. Else the values accepted, '|'-separated ("" is one),
   * compared as numbers for HI and HF, as booleans for HB. "none" (JSON null) is accepted
   * only where listed, or anywhere for an optional argument with accepted == NULL. */
  const char *accepted;
  const char *why; /* for accepted == NULL: why it changes nothing; else why not others */
} hf_arg_t;

#define MIXED "ddp-train has no mixed precision: the model trains in its dtype (docs/nn.md)"
static const hf_arg_t hf_args[] = {
    /* Nothing in a ddp-train run depends on these. */
    {"do_train", HB, NULL, "ddp-train always trains (HF's Trainer reads it neither)"},
    {"do_eval", HB, NULL, "evaluation follows eval_strategy (HF's Trainer reads it neither)"},
    {"do_predict", HB, NULL, "a script's switch; HF's Trainer does not read it"},
    {"local_rank", HI, NULL, "ranks come from the launcher's RANK and LOCAL_RANK"},
    {"no_cuda", HB, NULL, "ddp-train runs on the CPU"},
    {"use_cpu", HB, NULL, "ddp-train runs on the CPU"},
    {"run_name", HS, NULL, "a name for logging integrations"},
    {"logging_dir", HS, NULL, "TensorBoard's directory; metrics go to output_dir/metrics.jsonl"},
    {"log_level", HS, NULL, "the transformers logger's level"},
    {"log_level_replica", HS, NULL, "the transformers logger's level on replicas"},
    {"log_on_each_node", HB, NULL, "rank 0 logs"},
    {"dataloader_num_workers", HI, NULL, "the data are in memory; batches do not depend on it"},
    {"dataloader_pin_memory", HB, NULL, "CUDA's pinned memory"},
    {"dataloader_persistent_workers", HB, NULL, "the data are in memory"},
    {"dataloader_prefetch_factor", HI, NULL, "the data are in memory"},
    {"remove_unused_columns", HB, NULL, "datasets' columns; the data here are tensors"},
    {"skip_memory_metrics", HB, NULL, "a report of memory use"},
    {"full_determinism", HB, NULL, "ddp-train is deterministic with or without it"},
    {"tf32", HB, NULL, "an Ampere GPU's matmul mode"},
    {"prediction_loss_only", HB, NULL, "evaluation reports the loss only"},
    {"eval_accumulation_steps", HI, NULL, "where evaluation's predictions wait"},
    {"hub_model_id", HS, NULL, "used only with push_to_hub"},
    {"hub_strategy", HS, NULL, "used only with push_to_hub"},
    {"hub_token", HS, NULL, "used only with push_to_hub"},
    {"metric_for_best_model", HS, NULL, "used only with load_best_model_at_end"},
    {"greater_is_better", HB, NULL, "used only with load_best_model_at_end"},
    {"torch_empty_cache_steps", HI, NULL, "a CUDA cache"},
    {"logging_nan_inf_filter", HB, NULL, "a non-finite loss stops the run (halt_on_nonfinite)"},
    {"length_column_name", HS, NULL, "used only with group_by_length"},
    {"label_names", HS, NULL, "the data's labels are the tensor or column named by --data"},
    {"include_inputs_for_metrics", HB, NULL, "evaluation reports the loss only"},
    {"eval_do_concat_batches", HB, NULL, "evaluation reports the loss only"},
    {"eval_use_gather_object", HB, NULL, "evaluation reports the loss only"},
    {"hub_private_repo", HB, NULL, "used only with push_to_hub"},
    {"hub_always_push", HB, NULL, "used only with push_to_hub"},
    {"push_to_hub_model_id", HS, NULL, "used only with push_to_hub"},
    {"push_to_hub_organization", HS, NULL, "used only with push_to_hub"},
    {"push_to_hub_token", HS, NULL, "used only with push_to_hub"},
    {"ray_scope", HS, NULL, "Ray Tune's"},
    {"accelerator_config", HS, NULL,
     "Accelerate's dataloader options; the data go through DistributedSampler (docs/train.md)"},
    /* These would change the run; ddp-train does what the listed values ask. */
    {"fp16", HB, "false", MIXED "; --comm_hook fp16 compresses the gradients"},
    {"bf16", HB, "false", MIXED "; --comm_hook bf16 compresses the gradients"},
    {"fp16_full_eval", HB, "false", MIXED},
    {"bf16_full_eval", HB, "false", MIXED},
    {"half_precision_backend", HS, "auto", MIXED},
    {"fp16_opt_level", HS, "O1", MIXED},
    {"report_to", HS, "none|all|", "the run's metrics go to output_dir/metrics.jsonl and loss.svg"},
    {"logging_strategy", HS, "steps", "the run logs every --logging_steps steps"},
    {"logging_first_step", HB, "false", "the run logs every --logging_steps steps"},
    {"push_to_hub", HB, "false",
     "ddp-train uploads nothing; output_dir holds save_pretrained's files"},
    {"load_best_model_at_end", HB, "false", "the run ends with its last parameters"},
    {"save_on_each_node", HB, "false", "rank 0 writes the checkpoints"},
    {"save_only_model", HB, "false",
     "checkpoints hold the optimizer, scheduler and RNG states (docs/train.md)"},
    {"torch_compile", HB, "false", "ddp-train's kernels are compiled ahead of time"},
    {"label_smoothing_factor", HF, "0", "the loss has no label smoothing"},
    {"group_by_length", HB, "false", "batches follow the DistributedSampler order"},
    {"auto_find_batch_size", HB, "false", "the batch size is per_device_train_batch_size"},
    {"adafactor", HB, "false", "the optimizers are adamw_torch, adam and sgd (--optim)"},
    {"neftune_noise_alpha", HF, "none|0", "embeddings get no noise"},
    {"gradient_checkpointing_kwargs", HS, NULL,
     "gradient_checkpointing sets only ddp_find_unused_parameters' default here"},
    {"eval_delay", HF, "0", "evaluation follows eval_strategy from step 0"},
    {"eval_on_start", HB, "false", "evaluation follows eval_strategy"},
    {"ignore_data_skip", HB, "false", "a resumed run skips the batches it has trained on"},
    {"past_index", HI, "-1", "the models keep no past state between batches"},
    {"use_ipex", HB, "false", "Intel's extension is not used"},
    {"jit_mode_eval", HB, "false", "TorchScript is not used"},
    {"use_mps_device", HB, "false", "ddp-train runs on the CPU"},
    {"debug", HS, "", "PyTorch/XLA's debug reports"},
    {"per_gpu_train_batch_size", HI, "none", "HF's old name: use per_device_train_batch_size"},
    {"per_gpu_eval_batch_size", HI, "none", "HF's old name: use per_device_eval_batch_size"},
    {"restore_callback_states_from_checkpoint", HB, "false", "the run has no callbacks"},
    {"tpu_num_cores", HI, "none", "ddp-train runs on the CPU"},
    {"tpu_metrics_debug", HB, "false", "ddp-train runs on the CPU"},
    {"fsdp_min_num_params", HI, "0", "HF's old name: use fsdp_config's min_num_params"},
    {"fsdp_transformer_layer_cls_to_wrap", HS, "none",
     "HF's old name: use fsdp_config's transformer_layer_cls_to_wrap"},
    {"use_legacy_prediction_loop", HB, "false", "evaluation has one loop"},
    {"fp16_backend", HS, "auto", MIXED},
    {"mp_parameters", HS, "", "SageMaker's model parallelism"},
    {"torchdynamo", HS, "none", "ddp-train's kernels are compiled ahead of time"},
    {"torch_compile_backend", HS, "none", "ddp-train's kernels are compiled ahead of time"},
    {"torch_compile_mode", HS, "none", "ddp-train's kernels are compiled ahead of time"},
    {"dispatch_batches", HB, "none|false", "each rank reads its own shard (DistributedSampler)"},
    {"split_batches", HB, "none|false", "each rank reads its own shard (DistributedSampler)"},
    {"include_tokens_per_second", HB, "false", "metrics.jsonl has no throughput figures"},
    {"include_num_input_tokens_seen", HB, "false", "metrics.jsonl has no token counts"},
    {"optim_target_modules", HS, "none", "the optimizers update every parameter"},
    {"batch_eval_metrics", HB, "false", "evaluation reports the loss only"},
    {"use_liger_kernel", HB, "false", "Liger's kernels are not used"},
};
#undef MIXED

bool ddp__train_parse_bool(const char *v, bool *out) {
  static const char *const yes[] = {"true", "yes", "t", "y", "1"};
  static const char *const no[] = {"false", "no", "f", "n", "0"};
  for (size_t i = 0; i < DDP_ARRAY_LEN(yes); i++) {
    if (!strcasecmp(v, yes[i]) || !strcasecmp(v, no[i])) {
      *out = !strcasecmp(v, yes[i]);
      return true;
    }
  }
  return false;
}

static bool is_none(const char *v) { return !strcasecmp(v, "none") || !strcasecmp(v, "null"); }

/* One value against its kind: false when it is not a value of the kind. *num is set for
 * numbers and booleans (1 or 0). */
static bool read_value(hf_kind_t kind, const char *v, double *num) {
  char *end = NULL;
  switch (kind) {
    case HB: {
      bool b;
      if (!ddp__train_parse_bool(v, &b)) return false;
      *num = b;
      return true;
    }
    case HI: *num = (double)strtoll(v, &end, 10); return end != v && !*end;
    case HF: *num = strtod(v, &end); return end != v && !*end && isfinite(*num);
    case HS: return true;
  }
  return false;
}

/* Whether v is one of the '|'-separated values of list, for kind. */
static bool listed(hf_kind_t kind, const char *list, const char *v, double num, bool none) {
  const char *p = list;
  for (;;) {
    const char *bar = strchr(p, '|');
    size_t n = bar ? (size_t)(bar - p) : strlen(p);
    char item[32];
    DDP_REQUIRE(n < sizeof item);
    memcpy(item, p, n);
    item[n] = 0;
    double x;
    if (is_none(item)) {
      if (none) return true;
    } else if (kind == HS) {
      if (!strcmp(item, v)) return true;
    } else if (!none && read_value(kind, item, &x) && x == num) {
      return true;
    }
    if (!bar) return false;
    p = bar + 1;
  }
}

size_t ddp__train_args_hf_count(void) { return DDP_ARRAY_LEN(hf_args); }

const char *ddp__train_args_hf_name(size_t i) {
  DDP_REQUIRE(i < DDP_ARRAY_LEN(hf_args));
  return hf_args[i].name;
}

ddp_status_t ddp__train_args_hf(const char *name, const char *value, ddp_error_t *err) {
  static const char *const kinds[] = {"true or false", "an integer", "a number", "a string"};
  const hf_arg_t *h = NULL;
  for (size_t i = 0; i < DDP_ARRAY_LEN(hf_args); i++) {
    if (!strcmp(hf_args[i].name, name)) h = &hf_args[i];
  }
  if (!h) return DDP_ERR_NOT_FOUND;
  bool none = is_none(value);
  double num = 0;
  if (!none && !read_value(h->kind, value, &num)) {
    return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "%s expects %s, got \"%s\"", name,
                            kinds[h->kind], value);
  }
  if (!h->accepted || listed(h->kind, h->accepted, value, num, none)) return DDP_OK;
  /* The accepted values as a list: "none, all, \"\"". */
  char shown[96] = "";
  size_t len = 0;
  for (const char *p = h->accepted;;) {
    const char *bar = strchr(p, '|');
    int n = bar ? (int)(bar - p) : (int)strlen(p);
    len += (size_t)snprintf(shown + len, sizeof shown - len, "%s%s%.*s%s", len ? ", " : "",
                            n ? "" : "\"", n, p, n ? "" : "\"");
    DDP_REQUIRE(len < sizeof shown);
    if (!bar) break;
    p = bar + 1;
  }
  return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                          "%s \"%s\" is not available: %s (HF's TrainingArguments "
                          "name; accepted here: %s)",
                          name, value, h->why, shown);
}
