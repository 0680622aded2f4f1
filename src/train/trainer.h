/* Private to src/train: one rank's trainer, shared by the loop (trainer.c) and its setup
 * and descriptions (setup.c). */
#ifndef DDP_TRAIN_TRAINER_H
#define DDP_TRAIN_TRAINER_H

#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "train/faults.h"
#include "train/sync.h"
#include "train/train_internal.h"

/* --deepspeed's ds_config.json as read (ds_config.c; docs/sharding.md "Flags"). */
#define DDP__DS_AUTO (-2) /* "auto", before ddp__train_ds_config_apply fills it */
typedef struct ddp__ds_config {
  int stage;                     /* zero_optimization.stage; 0 when absent */
  int64_t reduce_bucket_size;    /* elements; -1: absent */
  int64_t allgather_bucket_size; /* elements; -1: absent (read, no libddp knob) */
  int64_t prefetch_bucket_size;  /* stage3_prefetch_bucket_size; -1: absent */
  int64_t persistence_threshold; /* stage3_param_persistence_threshold; -1: absent */
  int reduce_scatter;            /* -1: absent, else false 0 / true 1 */
} ddp__ds_config_t;
#define DDP__DS_CONFIG_INIT \
  { 0, -1, -1, -1, -1, -1 }

typedef struct ddp__trainer {
  ddp_pg_t *pg;
  int rank, world;
  ddp_model_t *model;
  const ddp_dataset_t *train, *eval;
  ddp_train_args_t args;     /* the caller's, read by ddp__opts_read */
  const ddp_train_args_t *a; /* &args */
  ddp_train_event_fn ev;
  void *user;
  ddp_train_result_t *res;
  ddp_error_t *err;

  ddp_ctx_t *ctx;
  ddp_sampler_t *sampler;
  ddp_loader_t *loader;
  ddp_optim_t *opt[DDP__TRAIN_MAX_GROUPS]; /* HF's parameter groups: decay, no decay */
  size_t nopt;
  ddp_optim_param_t *pairs; /* group 0's parameters, then group 1's */
  ddp_tensor_t **grads;     /* for clipping */
  size_t ntrain;            /* parameters that require grad */
  ddp__sync_t *sync;
  char resume_dir[DDP_TRAIN_STR_MAX]; /* the checkpoint being resumed, "" when none */
  ddp_dump_t *dump;        /* --dump_dir (the reducer layer's dump writer); NULL when off */
  ddp__metrics_t *metrics; /* rank 0 (metrics.c) */
  bool classify;           /* integer class labels: cross-entropy; else MSE */
  ddp_model_task_t task;   /* DDP_TASK_CAUSAL_LM: ddp_causal_lm_loss (lm.c) */
  ddp_tensor_t seed_grad;  /* backward seed 1/GA, scalar of the loss dtype */
  int64_t steps_per_epoch, max_steps, loader_epoch, loader_pos;
  ddp_lr_schedule_t sched;
  uint64_t flags;           /* this rank's forward_flags entry */
  ddp__train_q_t *init_q;   /* power_sgd_init_q; NULL when off */
  ddp__train_fault_t fault; /* DDP_FAULT (faults.h) */
  ddp_zero_t *zero;         /* --deepspeed / --fsdp ZeRO-1/2 (zero.c); NULL: DDP */
  ddp_zero_overlap_t *zovl; /* ZeRO-1 with --zero_comm_hook: the step runs in DDP's hook */
  ddp_fsdp_t *fsdp;         /* ZeRO-3 (zero.c), created after the initial broadcast */
  bool zero3;               /* ZeRO-3 asked for */
  ddp__ds_config_t ds;      /* --deepspeed's config, "auto" filled (ds_config.c) */
  bool fsdp_sharded_sd;     /* ZeRO-3 checkpoints: SHARDED_STATE_DICT (else FULL) */
  int resume_shards;        /* resuming a SHARDED checkpoint of that many ranks; 0: not */
  int lock_fd;              /* rank 0: output_dir's lock (agree.c); -1 when not held */
  char data_digest[17];     /* the training data's digest, "" until computed (resume_check.c) */

  /* world_size_invariant_shards (invariant mode; setup.c, trainer.c) */
  int64_t inv_k;    /* K shards per global batch; 0: off */
  int64_t inv_sm;   /* shards per micro-batch: K / (W GA) */
  double *inv_loss; /* [K] the step's shard losses, each from the rank that ran it */

  /* the run (begin, the steps, finish) */
  int64_t start;    /* the step resumed from; 0 for a fresh run */
  int64_t pause_ms; /* DDP_TRAIN_SAVE_PAUSE_MS: sleeps between checkpoint files */
  int64_t log_every, save_every, eval_every; /* in steps; 0: never */
  bool eval_epoch, save_steps, save_epoch;   /* the strategies */
  double samples_per_step;                   /* global samples per optimizer step */
  int64_t t_start, comm_total;               /* ns */
  double win_loss, win_time, win_comm;       /* the logging window's sums ... */
  int64_t win_n;                             /* ... over win_n steps */
} ddp__trainer_t;

/* Everything the steps need, from the arguments: the optimizers of HF's parameter groups,
 * the sampler and loader, the step counts, the LR schedule, the backward seed and the
 * gradient sync (which broadcasts rank 0's weights). */
ddp_status_t ddp__trainer_setup(ddp__trainer_t *t);
/* The trainer_state.json of a checkpoint at `step` (ddp__free). */
ddp_status_t ddp__trainer_state_json(ddp__trainer_t *t, int64_t step, char **out);
/* The "config" object of a dump's meta.json (ddp__free). */
ddp_status_t ddp__trainer_dump_config(ddp__trainer_t *t, char **out);

/* The run's start, before the setup's first collective (agree.c): rank 0 creates and locks
 * output_dir (a second run on it fails naming the directory and the holder's pid); then
 * every rank all-gathers its start-up status and digests of the training arguments that
 * must agree and of the model's structure, and fails, naming the first argument that
 * differs and rank 0's and the other rank's values, or the model. */
ddp_status_t ddp__train_agree(ddp__trainer_t *t);
/* Drops rank 0's output_dir lock (a no-op when not held). */
void ddp__train_unlock(ddp__trainer_t *t);

/* ds_config.c: --deepspeed's file read and every key checked (a bad value, a key libddp
 * does not read, fp16/bf16 enabled, offload to NVMe: an error naming the key and value);
 * "auto" is left as DDP__DS_AUTO. */
ddp_status_t ddp__ds_config_read(const char *path, int rank, ddp__ds_config_t *out,
                                 ddp_error_t *err);
/* Setup, before the gradient sync is created (needs the model and t->max_steps, t->sched):
 * fills "auto" from the model's hidden size, refuses top-level keys that conflict with the
 * flags (Transformers' "ds KEY=VAL vs hf ARG=VAL"), and applies the config to t->args
 * (reduce_bucket_size: the reducer's bucket cap; reduce_scatter false: deepspeed_allreduce
 * arithmetic) and t->ds. A no-op without --deepspeed. */
ddp_status_t ddp__train_ds_config_apply(ddp__trainer_t *t);
/* ZeRO-3 under --deepspeed: stage3_prefetch_bucket_size onto the prefetch options. */
void ddp__train_ds_fsdp_options(const ddp__trainer_t *t, ddp_fsdp_options_t *o);

/* zero.c: the ZeRO stage the arguments ask for (0: DDP), from --fsdp and --deepspeed; an
 * unknown option or stage, stage 3, and both flags at once are errors naming the value. */
ddp_status_t ddp__train_zero_stage(const ddp_train_args_t *a, int rank, int *stage,
                                   ddp_error_t *err);
/* After the optimizers: t->zero over their groups when a stage is asked for. */
ddp_status_t ddp__train_zero_setup(ddp__trainer_t *t);
/* ZeRO-3: t->fsdp over the model, once the initial broadcast has made it equal on every
 * rank (the model's storage is released). */
ddp_status_t ddp__train_fsdp_setup(ddp__trainer_t *t);
/* --dump_dir with ZeRO: the partition, by parameter name, into the dump's ddp.json. */
ddp_status_t ddp__train_zero_dump(ddp__trainer_t *t);
/* Checkpoints: this rank's optimizer shards into the staged directory tmp
 * (optimizer[_group<g>]-<r+1>-of-<W>.safetensors, HF's 5-digit numbering), and rank 0's
 * consolidation of them into the files a DDP checkpoint has (optimizer.safetensors,
 * optimizer_group<g>.safetensors). */
ddp_status_t ddp__train_zero_save_shard(ddp__trainer_t *t, const char *tmp);
ddp_status_t ddp__train_zero_consolidate(ddp__trainer_t *t, const char *tmp);
/* ZeRO-3 checkpoints (zero.c). save_begin, collective, before rank 0 stages the checkpoint:
 * FULL_STATE_DICT gathers the parameters into the model and the optimizer state into the
 * trainer's own optimizers, so that the checkpoint is DDP's; save_end frees them again.
 * save_shard: SHARDED_STATE_DICT, this rank's shard files. probe: whether dir (written by
 * world ranks) is a SHARDED checkpoint (refused unless ZeRO-3 resumes it); resume, after
 * ddp__train_fsdp_setup: the shards, or the loaded full optimizer state, into the handle. */
bool ddp__train_fsdp_sharded_save(const ddp__trainer_t *t);
ddp_status_t ddp__train_fsdp_save_begin(ddp__trainer_t *t);
void ddp__train_fsdp_save_end(ddp__trainer_t *t);
ddp_status_t ddp__train_fsdp_save_shard(ddp__trainer_t *t, const char *tmp);
ddp_status_t ddp__train_fsdp_probe(ddp__trainer_t *t, const char *dir, int world, bool *sharded);
ddp_status_t ddp__train_fsdp_resume(ddp__trainer_t *t);
/* Collective when W > 1: every rank's parameter, gradient and optimizer-state bytes
 * (measured after the step, before zero_grad), own[3] the ZeRO-3 gathered peak, own[4] the
 * bytes the rank sent in the step (flight recorder; -1 when off), and the process's peak RSS,
 * as metrics members on rank 0's line j. */
ddp_status_t ddp__train_state_bytes(ddp__trainer_t *t, const double own[5], ddp__json_t *j);
/* This rank's bytes now: parameters, present gradients, optimizer state. */
void ddp__train_own_bytes(ddp__trainer_t *t, double own[5]);
/* The training data's digest (16 hex digits; FNV-1a of every sample's bytes), computed
 * once (resume_check.c). */
ddp_status_t ddp__train_data_digest(ddp__trainer_t *t, char hex[17]);
/* Resuming `dir`: Transformers' warning for a changed per_device_train_batch_size, seed,
 * data_seed or training data; DDP_ERR_INVALID_ARGUMENT when the checkpoint is mid-epoch and
 * the change makes the rest of the epoch's data order unreproducible (resume_check.c). */
ddp_status_t ddp__train_resume_check(ddp__trainer_t *t, const char *dir);

/* halt_on_nonfinite (nonfinite.c). The first parameter (model order) whose gradient holds a
 * NaN or an Inf, and the element's index (*elem); SIZE_MAX when none: one pass over the f32
 * and f64 gradients, before clipping scales them all by a NaN coefficient. */
size_t ddp__train_first_nonfinite_grad(const ddp__trainer_t *t, int64_t *elem);
/* A NaN or Inf `what` (the gradient norm, the loss) of value v at step `done`: with
 * halt_on_nonfinite an error naming the step and parameter `bad` (SIZE_MAX: none), else a
 * warning on rank 0 and DDP_OK. Every rank sees the same all-reduced value, so every rank
 * stops at the same step. */
ddp_status_t ddp__train_nonfinite(ddp__trainer_t *t, int64_t done, const char *what, double v,
                                  size_t bad, int64_t elem);

#endif /* DDP_TRAIN_TRAINER_H */
