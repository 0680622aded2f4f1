/* libddp train layer: the training loop a user runs first, driven by Hugging Face's
 * TrainingArguments names and defaults (docs/train.md).
 *
 * Three parts:
 *  - ddp_train_args_t: every setting under its HF name, with HF's default, settable by name
 *    from strings (command line `--flag value`, `--flag=value`) or from a JSON config file
 *    with the same keys, and validated as a whole (ddp_train_args_validate).
 *  - ddp_train(): one rank's trainer. Every rank of a process group calls it with its own
 *    model (same architecture), the same datasets and the same arguments. It broadcasts rank
 *    0's weights, shards the training set with DistributedSampler, runs forward/backward with
 *    HF's gradient accumulation (no gradient synchronisation on all but the last micro-batch
 *    of a window, loss divided by gradient_accumulation_steps), averages gradients across
 *    ranks, clips, steps the optimizer and the LR schedule, evaluates, logs metrics, checks
 *    that the replicas are identical, and writes and rotates checkpoints.
 *  - Checkpoints: output_dir/checkpoint-<step>/{model.safetensors, optimizer.safetensors,
 *    trainer_state.json}, written into a temporary directory and renamed into place, so a
 *    crash during a save leaves the previous checkpoint intact. Resuming continues bitwise
 *    identically to a run that was never interrupted.
 *
 * Files (metrics.jsonl, loss.svg, checkpoints) are written by rank 0 only. Only tools print:
 * progress reaches the caller through a callback on rank 0. */
#ifndef DDP_TRAIN_H
#define DDP_TRAIN_H

#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/pg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP_TRAIN_STR_MAX 512

/* Tri-state for HF's Optional[bool] fields: unset means "HF's default logic decides". */
typedef enum ddp_tristate { DDP_UNSET = -1, DDP_FALSE = 0, DDP_TRUE = 1 } ddp_tristate_t;

/* TrainingArguments. Names are HF's (transformers.TrainingArguments; DDP fields from §8 of
 * spec/ddp-semantics.md; comm_* from Accelerate's DistributedDataParallelKwargs). Start from
 * DDP_TRAIN_ARGS_INIT; set fields directly or by name with ddp_train_args_set. */
typedef struct ddp_train_args {
  size_t struct_size;
  /* batching and steps */
  int64_t per_device_train_batch_size; /* 8 */
  int64_t per_device_eval_batch_size;  /* 8 */
  int64_t gradient_accumulation_steps; /* 1; the loss of each micro-batch is divided by it */
  double num_train_epochs;             /* 3.0 */
  int64_t max_steps;                   /* -1: derived from num_train_epochs */
  bool dataloader_drop_last;           /* false */
  /* optimizer */
  double learning_rate;               /* 5e-5 */
  double weight_decay;                /* 0.0; not applied to biases and LayerNorm parameters (HF) */
  char weight_decay_grouping[16];     /* libddp: "transformers" (HF's groups: no decay on
                                       * biases and LayerNorm weights) or "all" (every
                                       * parameter, as torch.optim on model.parameters()) */
  bool zero_grad_set_to_none;         /* libddp: true (PyTorch 2.x, Transformers): gradients become
                                       * None after each step; false: zero-filled (PyTorch 1.13) */
  double adam_beta1;                  /* 0.9 */
  double adam_beta2;                  /* 0.999 */
  double adam_epsilon;                /* 1e-8 */
  char optim[32];                     /* "adamw_torch" (also "adamw", "adam", "sgd") */
  char optim_args[DDP_TRAIN_STR_MAX]; /* "": HF's "key=value,..."; sgd takes momentum,
                                       * dampening and nesterov (docs/train.md) */
  double max_grad_norm;               /* 1.0; <= 0 disables clipping, as in HF */
  /* schedule */
  char lr_scheduler_type[32]; /* "linear" (docs/train.md: HF's schedules) */
  int64_t warmup_steps;       /* 0; when > 0 it wins over warmup_ratio */
  double warmup_ratio;        /* 0.0 */
  /* run control */
  uint64_t seed;                      /* 42: initial weights, sampler shuffles, dropout */
  int64_t data_seed;                  /* -1 (HF's None): seed; else the sampler's seed */
  bool dataloader_shuffle;            /* libddp: true; false: DistributedSampler(shuffle=False) */
  double logging_steps;               /* 500; below 1: a fraction of max_steps (HF) */
  char eval_strategy[16];             /* "no" | "steps" | "epoch" */
  double eval_steps;                  /* 0: logging_steps (HF); below 1: a fraction of max_steps */
  double eval_split;                  /* libddp: held-out fraction when evaluating; 0.1 */
  char save_strategy[16];             /* "steps" | "epoch" | "no" */
  double save_steps;                  /* 500; below 1: a fraction of max_steps */
  int64_t save_total_limit;           /* -1: keep every checkpoint */
  char output_dir[DDP_TRAIN_STR_MAX]; /* "trainer_output" */
  char resume_from_checkpoint[DDP_TRAIN_STR_MAX]; /* "": none; a path; "true": the latest */
  bool gradient_checkpointing;      /* false; only enters ddp_find_unused_parameters' default */
  bool disable_tqdm;                /* false: progress bar when stdout is a terminal */
  char dump_dir[DDP_TRAIN_STR_MAX]; /* libddp: per-step dumps (docs/dumps.md); "" = none */
  char forward_flags[DDP_TRAIN_STR_MAX]; /* libddp: "0"; the flags of branch layers
                                          * (docs/nn.md): one entry per rank separated by
                                          * commas, cycled over the ranks; an entry is one
                                          * integer or one per step separated by colons,
                                          * cycled over the optimizer steps ("0:1,1") */
  bool dump_local_grads;                 /* libddp: false; dumps also hold local_grad.* */
  /* DDP */
  char ddp_backend[16]; /* "": auto. gloo (= tcp), threads, shm, tcp, mpi, nccl */
  ddp_tristate_t ddp_find_unused_parameters; /* unset: !gradient_checkpointing (HF) */
  double ddp_bucket_cap_mb;                  /* -1: unset (25 MiB); fractions allowed */
  double ddp_first_bucket_mb;           /* libddp: -1 = the reducer's rule (docs/ddp.md); > 0: the
                                         * first bucket's cap, e.g. 1 for PyTorch 1.13's layouts */
  ddp_tristate_t ddp_broadcast_buffers; /* unset: true (torch's default) */
  int64_t ddp_timeout;                  /* 1800 seconds */
  ddp_tristate_t ddp_static_graph;      /* unset: false */
  bool gradient_as_bucket_view;         /* false */
  bool ddp_reducer; /* libddp: true = the bucketed DDP reducer; false = one flat allreduce */
  char ddp_trace[DDP_TRAIN_STR_MAX]; /* libddp: "" or the Chrome/Perfetto timeline file that
                                      * every rank's reducer writes (docs/ddp.md, Timeline) */
  /* communication hooks (Accelerate's names) */
  char comm_hook[32];                        /* "no"; needs ddp_reducer (docs/hooks.md) */
  char comm_wrapper[16];                     /* "no" */
  char comm_state_option[DDP_TRAIN_STR_MAX]; /* JSON object, "" or "{}" = none */
  char power_sgd_init_q[DDP_TRAIN_STR_MAX];  /* libddp: "" or torch_reference.py's
                                              * powersgd_q.safetensors: PyTorch's random Q
                                              * draws, used instead of libddp's generator */
  int64_t world_size_invariant_shards;       /* libddp: 0 = off; K > 0: the global batch of
                                              * each step is K fixed shards and the run's
                                              * bits do not depend on the world size or on
                                              * gradient_accumulation_steps (docs/ddp.md) */
  bool overwrite_output_dir; /* HF's: "overwrite the content of the output directory"; the
                              * Trainer only records it (its scripts read it), and libddp
                              * writes into an existing output_dir either way. It never takes
                              * a directory that a live run holds (docs/train.md, "Output") */
  bool halt_on_nonfinite;    /* libddp: true (default): a NaN or Inf loss or gradient norm
                              * stops the run naming the step and the first parameter with a
                              * non-finite gradient, before the step's update and save;
                              * false: a warning, and training goes on */
  /* "": off; HF's --deepspeed ds_config.json: zero_optimization.stage 1 or 2 runs ZeRO-1/2
   * (docs/sharding.md) */
  char deepspeed[DDP_TRAIN_STR_MAX];
  /* "": off; HF's --fsdp options: full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard
   * (DDP), auto_wrap; libddp has no hybrid_shard, hybrid_shard_zero2 or offload */
  char fsdp[DDP_TRAIN_STR_MAX];
  /* "": defaults; HF's --fsdp_config: a JSON file or inline JSON object with
   * transformer_layer_cls_to_wrap, min_num_params, reshard_after_forward (ZeRO-3's wrap
   * policy; docs/sharding.md) */
  char fsdp_config[DDP_TRAIN_STR_MAX];
  /* libddp: where the gradient reduction divides by W (ddp_grad_arith_t): "ddp" (default,
   * DDP's bits in every sharded mode), "fsdp1", "fsdp2", "deepspeed", "deepspeed_allreduce"
   * (docs/sharding.md, "Framework arithmetic") */
  char sharding_arithmetic[DDP_TRAIN_STR_MAX];
  /* HF's save_safetensors: true (default); false would be pytorch_model.bin, a pickle, which
   * libddp does not write, and is an error */
  bool save_safetensors;
  /* save_pretrained's max_shard_size for checkpoints and the final model: "5GB" (default),
   * "10MB", "2GiB" or bytes; a larger state_dict is written as model-0000K-of-0000N
   * .safetensors files with model.safetensors.index.json (libddp: the Trainer itself has no
   * such argument and always uses save_pretrained's default) */
  char max_shard_size[DDP_TRAIN_STR_MAX];
  /* ZeRO-1 (--deepspeed with zero_optimization.stage 1; docs/sharding.md): PyTorch
   * ZeroRedundancyOptimizer's parameters_as_bucket_view (false: one broadcast per
   * parameter after the step; true: one per rank's flat bucket) */
  bool zero_parameters_as_bucket_view;
  /* ZeRO-1's step inside DDP's comm hook: "no" (default), "hook_with_zero_step",
   * "hook_with_zero_step_interleaved" (PyTorch's ddp_zero_hook around --comm_hook, with
   * ZeroRedundancyOptimizer(overlap_with_ddp=True): the first 2 steps, 3 with static_graph,
   * update nothing) */
  char zero_comm_hook[40];
  bool zero_shard_buckets; /* the hook's shard_buckets (false: bucket i to rank i % W) */
  /* HF's lr_scheduler_kwargs: "" or a JSON object of the schedule's own arguments
   * (cosine, cosine_with_restarts: num_cycles; polynomial: lr_end, power; inverse_sqrt:
   * timescale; cosine_with_min_lr: num_cycles and min_lr or min_lr_rate) */
  char lr_scheduler_kwargs[DDP_TRAIN_STR_MAX];
} ddp_train_args_t;

#define DDP_TRAIN_ARGS_INIT                                                                        \
  {                                                                                                \
    .struct_size = sizeof(ddp_train_args_t), .per_device_train_batch_size = 8,                     \
    .per_device_eval_batch_size = 8, .gradient_accumulation_steps = 1, .num_train_epochs = 3.0,    \
    .max_steps = -1, .dataloader_drop_last = false, .learning_rate = 5e-5, .weight_decay = 0.0,    \
    .weight_decay_grouping = "transformers", .zero_grad_set_to_none = true, .adam_beta1 = 0.9,     \
    .adam_beta2 = 0.999, .adam_epsilon = 1e-8, .optim = "adamw_torch", .optim_args = "",           \
    .max_grad_norm = 1.0, .lr_scheduler_type = "linear", .warmup_steps = 0, .warmup_ratio = 0.0,   \
    .seed = 42, .data_seed = -1, .dataloader_shuffle = true, .dump_local_grads = false,            \
    .logging_steps = 500, .eval_strategy = "no", .eval_steps = 0, .eval_split = 0.1,               \
    .save_strategy = "steps", .save_steps = 500, .save_total_limit = -1,                           \
    .output_dir = "trainer_output", .resume_from_checkpoint = "", .gradient_checkpointing = false, \
    .disable_tqdm = false, .dump_dir = "", .forward_flags = "0", .ddp_backend = "",                \
    .ddp_find_unused_parameters = DDP_UNSET, .ddp_bucket_cap_mb = -1, .ddp_first_bucket_mb = -1,   \
    .ddp_broadcast_buffers = DDP_UNSET, .ddp_timeout = 1800, .ddp_static_graph = DDP_UNSET,        \
    .gradient_as_bucket_view = false, .ddp_reducer = true, .comm_hook = "no",                      \
    .comm_wrapper = "no", .comm_state_option = "", .power_sgd_init_q = "",                         \
    .world_size_invariant_shards = 0, .overwrite_output_dir = false, .halt_on_nonfinite = true,    \
    .sharding_arithmetic = "ddp", .save_safetensors = true, .max_shard_size = "5GB",               \
    .zero_parameters_as_bucket_view = false, .zero_comm_hook = "no", .zero_shard_buckets = false,  \
    .lr_scheduler_kwargs = ""                                                                      \
  }

/* Sets one field by its HF name from a string: integers, floats, booleans as
 * HfArgumentParser reads them ("true"/"false", "yes"/"no", "t"/"f", "y"/"n", "1"/"0", any
 * case), Optional[bool] fields also "none". HF's TrainingArguments names with no field here
 * are accepted where they change nothing or ask for what ddp-train does, and refused
 * (DDP_ERR_INVALID_ARGUMENT, naming why) otherwise (docs/train.md); "evaluation_strategy"
 * sets eval_strategy. An unknown name is DDP_ERR_NOT_FOUND, a malformed or out-of-range
 * value DDP_ERR_INVALID_ARGUMENT; both messages name the field (an unknown name also
 * suggests the closest known one). */
DDP_API ddp_status_t ddp_train_args_set(ddp_train_args_t *a, const char *name, const char *value,
                                        ddp_error_t *err);

/* Reads a JSON object whose keys are field names, as TrainingArguments.to_json_string()
 * writes them (values: numbers, booleans, strings; null for "unset": an Optional[bool]
 * field's none, any other field's default; an object as its JSON text; a list of
 * strings as the strings joined by spaces). DDP_ERR_NOT_FOUND for a missing file,
 * DDP_ERR_INVALID_DATA for malformed JSON, else as ddp_train_args_set. */
DDP_API ddp_status_t ddp_train_args_load_json(ddp_train_args_t *a, const char *path,
                                              ddp_error_t *err);

/* Cross-field checks: positive sizes, known optim / scheduler / strategy / backend names
 * (an unknown ddp_backend lists the choices), optim_args keys and values for the optim,
 * the syntax of forward_flags, comm hook names, wrapper and PowerSGD state options
 * (ddp_hooks_validate), power_sgd_init_q only with a PowerSGD hook; a hook with
 * ddp_reducer false is DDP_ERR_UNSUPPORTED. Files are not opened here. */
DDP_API ddp_status_t ddp_train_args_validate(const ddp_train_args_t *a, ddp_error_t *err);

/* libddp's backend for ddp_backend ("gloo" -> "tcp"); NULL when unset. */
DDP_API const char *ddp_train_backend_name(const ddp_train_args_t *a);
/* The effective find_unused_parameters / broadcast_buffers / static_graph (HF's logic). */
DDP_API bool ddp_train_find_unused(const ddp_train_args_t *a);
DDP_API bool ddp_train_broadcast_buffers(const ddp_train_args_t *a);
DDP_API bool ddp_train_static_graph(const ddp_train_args_t *a);

/* The table of fields, for --help and docs: name, type ("int", "float", "bool",
 * "Optional[bool]", "str"), default as text, and one line of help. i < ddp_train_arg_count(). */
DDP_API size_t ddp_train_arg_count(void);
DDP_API void ddp_train_arg_info(size_t i, const char **name, const char **type, const char **def,
                                const char **help);

/* The whole argument set as a JSON object (written into trainer_state.json). Caller frees
 * with ddp_free. */
DDP_API ddp_status_t ddp_train_args_to_json(const ddp_train_args_t *a, char **out);

/* ---------------------------------------------------------------- training -------- */

typedef enum ddp_train_event_kind {
  DDP_TRAIN_EV_STEP = 0, /* after every optimizer step (progress bars) */
  DDP_TRAIN_EV_LOG = 1,  /* every logging_steps and at the last step: window means */
  DDP_TRAIN_EV_EVAL = 2, /* after an evaluation */
  DDP_TRAIN_EV_SAVE = 3  /* after a checkpoint is in place */
} ddp_train_event_kind_t;

/* What rank 0's callback receives. Losses are means over all ranks. */
typedef struct ddp_train_event {
  ddp_train_event_kind_t kind;
  int64_t step, max_steps;
  double epoch;                    /* fractional, as HF logs it */
  double loss;                     /* STEP: this step's loss; LOG: mean over the logging window */
  double grad_norm;                /* before clipping (last step of the window) */
  double lr;                       /* the lr the step used */
  double step_time_s;              /* LOG: mean wall time per optimizer step over the window */
  double comm_time_s;              /* LOG: mean time per step in gradient communication */
  double samples_per_s;            /* global samples per second over the window */
  double eta_s;                    /* remaining time at the current rate */
  double eval_loss, eval_accuracy; /* EVAL; accuracy NaN for regression */
  const char *checkpoint;          /* SAVE: its directory */
} ddp_train_event_t;

typedef void (*ddp_train_event_fn)(void *user, const ddp_train_event_t *ev);

/* The outcome, filled on every rank. */
typedef struct ddp_train_result {
  int64_t steps;                   /* global step reached */
  int64_t start_step;              /* step resumed from (0 for a fresh run) */
  double first_loss, last_loss;    /* first and last logged step losses (means over ranks) */
  double eval_loss, eval_accuracy; /* last evaluation; NaN when none */
  double seconds;                  /* training wall time of this call */
  double samples_per_s;            /* global samples per second */
  double comm_seconds;             /* total time in gradient communication */
  uint64_t param_hash;             /* hash of the final parameters (equal on every rank) */
  int replica_checks;              /* replica checks passed */
  char last_checkpoint[DDP_TRAIN_STR_MAX]; /* "" when none was written */
} ddp_train_result_t;

/* Trains `model` on `train` (and evaluates on `eval`, which may be NULL) as rank
 * ddp_pg_rank(pg) of the group. Every rank passes a model of the same architecture (its
 * weights are replaced by rank 0's), the same datasets and the same args. The loss is
 * cross-entropy when labels are integer class ids, else MSE. Blocking; every collective is
 * bounded by the group's timeout. ev (may be NULL) is called on rank 0 only.
 * Errors: DDP_ERR_INVALID_ARGUMENT (args, dataset/model mismatch), DDP_ERR_NOT_FOUND (a
 * checkpoint to resume from), DDP_ERR_INVALID_DATA (a corrupt checkpoint, or replicas
 * that diverged: the message names the ranks), DDP_ERR_SYSTEM (files), and the group's
 * statuses. A failure of this rank alone (bad data, an output directory it cannot create)
 * aborts the group (ddp_pg_abort_reason with the message), so the other ranks fail at once
 * naming this rank instead of waiting for the timeout; the group is then unusable. */
DDP_API ddp_status_t ddp_train(ddp_pg_t *pg, ddp_model_t *model, const ddp_dataset_t *train,
                               const ddp_dataset_t *eval, const ddp_train_args_t *args,
                               ddp_train_event_fn ev, void *user, ddp_train_result_t *result,
                               ddp_error_t *err);

/* The newest complete checkpoint-<step> directory under dir (temporary directories of an
 * interrupted save are ignored). DDP_ERR_NOT_FOUND when there is none. */
DDP_API ddp_status_t ddp_train_latest_checkpoint(const char *dir, char *out, size_t cap,
                                                 ddp_error_t *err);

/* Checks that a checkpoint directory is complete and loadable into model (and into an
 * optimizer when opt is not NULL: optimizer.safetensors holds parameter group 0, which is
 * every trainable parameter unless weight_decay > 0 split them, docs/train.md); returns
 * its step. */
DDP_API ddp_status_t ddp_train_checkpoint_load(const char *dir, ddp_model_t *model,
                                               ddp_optim_t *opt, int64_t *step, ddp_error_t *err);

/* Draws metrics.jsonl's training losses (and eval losses) as an SVG line plot. */
DDP_API ddp_status_t ddp_train_plot_svg(const char *metrics_path, const char *svg_path,
                                        ddp_error_t *err);

/* Hash of the model's parameters (every dtype's flat buffer, FNV-1a over the bytes). */
DDP_API uint64_t ddp_train_param_hash(ddp_model_t *model);

/* ---------------------------------------------------------------- generation ------ */

/* Options of ddp_generate. Start from DDP_GENERATE_OPTIONS_INIT. */
typedef struct ddp_generate_options {
  size_t struct_size;
  int64_t max_new_tokens; /* 64: tokens appended to the prompt */
  int64_t top_k;          /* 0: greedy (argmax); k > 0: a draw among the k likeliest */
  uint64_t seed;          /* top-k's draws: Philox stream (DDP_RNG_SAMPLE, 0, 0) */
  int64_t context;        /* tokens the model sees, the latest ones; 0: its n_positions */
} ddp_generate_options_t;

#define DDP_GENERATE_OPTIONS_INIT                                                                \
  {                                                                                              \
    .struct_size = sizeof(ddp_generate_options_t), .max_new_tokens = 64, .top_k = 0, .seed = 42, \
    .context = 0                                                                                 \
  }

/* Continues prompt (n >= 1 token ids) with o->max_new_tokens tokens from a causal language
 * model (GPT-2: ids [1, T] in, logits [1, T, V] out), one forward per token over the last
 * `context` tokens, with gradients off and the model in evaluation mode (it is left in
 * training mode). *out (ddp_free) receives only the new tokens, *nout their count. Greedy
 * or seeded top-k: the same seed gives the same tokens everywhere. Errors: an empty
 * prompt or negative option (DDP_ERR_INVALID_ARGUMENT), a model that is not a causal LM,
 * and the forward's errors (an id beyond the vocabulary), with the forward's message. */
DDP_API ddp_status_t ddp_generate(ddp_model_t *m, const int64_t *prompt, int64_t n,
                                  const ddp_generate_options_t *o, int64_t **out, int64_t *nout,
                                  ddp_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* DDP_TRAIN_H */
