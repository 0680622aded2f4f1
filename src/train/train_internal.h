/* Private interfaces between the files of src/train (not installed). */
#ifndef DDP_TRAIN_INTERNAL_H
#define DDP_TRAIN_INTERNAL_H

#include "ddp/train.h"

/* ddp_train's body (trainer.c); ddp_train (fail.c) adds the group abort on a local failure. */
ddp_status_t ddp__train_run(ddp_pg_t *pg, ddp_model_t *model, const ddp_dataset_t *train,
                            const ddp_dataset_t *eval, const ddp_train_args_t *args,
                            ddp_train_event_fn ev, void *user, ddp_train_result_t *result,
                            ddp_error_t *err);

/* Every rank hashes its parameters, the hashes are all-gathered, and any difference is
 * DDP_ERR_INVALID_DATA naming the groups of ranks that agree ("ranks 0,2 hold ..., rank 1
 * holds ..."). Collective: every rank calls it at the same step. */
ddp_status_t ddp__train_replica_check(ddp_pg_t *pg, ddp_model_t *model, int64_t step,
                                      uint64_t *hash, ddp_error_t *err);

/* Entry rank % n of forward_flags (n comma-separated integers >= 0, decimal or 0x hex,
 * spaces allowed: torch_reference.py's --flags) into *out (may be NULL); false when the
 * text is malformed. */
bool ddp__train_forward_flags(const char *text, int rank, uint64_t *out);
/* The flags of optimizer step `step` on `rank`: entry rank % n of the comma-separated
 * entries, and within it value step % m of its m colon-separated values ("0:1" = 0 on
 * even steps, 1 on odd ones). ddp__train_forward_flags is step 0. False when malformed. */
bool ddp__train_forward_flags_at(const char *text, int rank, int64_t step, uint64_t *out);

/* A boolean as HfArgumentParser reads one: true, yes, t, y, 1 or false, no, f, n, 0, in any
 * case. False when v is none of them. (args_hf.c) */
bool ddp__train_parse_bool(const char *v, bool *out);

/* A Hugging Face TrainingArguments name that ddp_train_args_t has no field for (args_hf.c):
 * DDP_OK when value is accepted (the argument changes nothing in ddp-train, or asks for
 * what ddp-train does), DDP_ERR_INVALID_ARGUMENT (not logged) naming the argument, the
 * value, why and the values accepted, DDP_ERR_NOT_FOUND (nothing written) for a name that
 * is not one of them. */
ddp_status_t ddp__train_args_hf(const char *name, const char *value, ddp_error_t *err);
/* The names ddp__train_args_hf knows, i < ddp__train_args_hf_count() (for "did you mean"). */
size_t ddp__train_args_hf_count(void);
const char *ddp__train_args_hf_name(size_t i);

/* HF's lr_scheduler_kwargs applied to s (its kind and, for cosine_with_min_lr's min_lr,
 * lr_init already set): each key must be an argument of s's kind, with a number (timescale:
 * a positive integer); cosine_with_min_lr needs exactly one of min_lr and min_lr_rate.
 * DDP_ERR_INVALID_ARGUMENT (not logged) names the key, the schedule and what it takes. */
ddp_status_t ddp__train_lr_kwargs(const ddp_train_args_t *a, ddp_lr_schedule_t *s,
                                  ddp_error_t *err);

/* HF's optim_args ("key=value,key=value", spaces ignored) applied to o: optim sgd takes
 * momentum, dampening and nesterov (torch.optim.SGD's keywords); the other optimizers take
 * no key. DDP_ERR_INVALID_ARGUMENT (not logged) names a malformed item, an unknown key or
 * a bad value. */
ddp_status_t ddp__train_optim_args(const ddp_train_args_t *a, ddp_optim_options_t *o,
                                   ddp_error_t *err);

/* PyTorch's PowerSGD Q draws for power_sgd_init_q (init_q.c): the safetensors file
 * tools/torch/torch_reference.py writes, tensor "draw{k}" holding the k-th random initialisation
 * (every Q of the bucket, concatenated), metadata "bucket{k}" its bucket index and "draws"
 * their count. ddp__train_q_fill is a ddp_powersgd_options_t.init_q callback (user: the
 * ddp__train_q_t); it cannot fail, so a draw that is missing or has another bucket or
 * length is recorded, its Q filled with NaN, and reported by ddp__train_q_check.
 * ddp__train_q_finish then requires the state to have made exactly the file's number of
 * draws: the same job as PyTorch's makes the same draws. */
typedef struct ddp__train_q ddp__train_q_t;
ddp_status_t ddp__train_q_open(const char *path, int rank, ddp__train_q_t **out, ddp_error_t *err);
void ddp__train_q_fill(void *user, uint64_t draw, size_t bucket, float *q, size_t n);
ddp_status_t ddp__train_q_check(const ddp__train_q_t *q, ddp_error_t *err);
ddp_status_t ddp__train_q_finish(const ddp__train_q_t *q, uint64_t draws_made, ddp_error_t *err);
void ddp__train_q_close(ddp__train_q_t *q);

/* HF's optimizer parameter groups: at most two (weight decay, no weight decay). */
#define DDP__TRAIN_MAX_GROUPS 2

/* A checkpoint is written in two phases so that every rank can add its own files between
 * them. Stage (rank 0): creates output_dir/tmp-checkpoint-<step>/ afresh (tmp receives its
 * path) and writes model.safetensors, the optimizer file of each parameter group
 * (ddp__train_optim_file) and trainer_state.json holding state_json, each atomically;
 * pause_ms > 0 sleeps between the files (the kill-during-save test hook,
 * DDP_TRAIN_SAVE_PAUSE_MS); model NULL writes no model (ZeRO-3 SHARDED_STATE_DICT: the
 * ranks write their shards). Then each rank may write into tmp (its comm hook state,
 * ddp__train_hook_file). Commit (rank 0): fsyncs tmp, renames it to checkpoint-<step>/,
 * fsyncs output_dir, then deletes the oldest checkpoint-* directories beyond limit
 * (limit < 0: keep all). dir receives the final path. */
ddp_status_t ddp__train_save_stage(const char *output_dir, int64_t step, ddp_model_t *model,
                                   int64_t max_shard_size, ddp_optim_t *const *opts, size_t nopt,
                                   const char *state_json, int64_t pause_ms, char *tmp, size_t cap,
                                   ddp_error_t *err);
ddp_status_t ddp__train_save_commit(const char *output_dir, int64_t step, int64_t limit, char *dir,
                                    size_t cap, ddp_error_t *err);
/* dir/optimizer.safetensors for group 0, dir/optimizer_group<g>.safetensors after. */
void ddp__train_optim_file(char *buf, size_t cap, const char *dir, size_t group);
/* dir/hook_state_rank<rank>.safetensors: one rank's PowerSGD state. */
void ddp__train_hook_file(char *buf, size_t cap, const char *dir, int rank);

/* Checkpoint integrity (ckpt_integrity.c). Write: records the SHA-256 of every file in dir
 * in dir/checksums.sha256 (sha256sum's format), atomically; called on the staged directory
 * just before it is committed. Verify: recomputes them; a file that differs or is missing
 * is DDP_ERR_INVALID_DATA naming the file. A directory without checksums.sha256 verifies
 * only when its trainer_state.json's checkpoint_format is below
 * DDP__TRAIN_CHECKPOINT_FORMAT (written before checksums). quiet: the failure is not
 * logged (the caller reports it). */
#define DDP__TRAIN_CHECKSUMS "checksums.sha256"
/* trainer_state.json's "checkpoint_format": 2 since checksums.sha256 is always written. */
#define DDP__TRAIN_CHECKPOINT_FORMAT 2
ddp_status_t ddp__train_write_checksums(const char *dir, ddp_error_t *err);
ddp_status_t ddp__train_verify_checkpoint(const char *dir, bool quiet, ddp_error_t *err);

/* The checkpoint a run resumes from, into dir ("" = start at step 0), by
 * resume_from_checkpoint: a directory (used as given; loading verifies it); "true" or
 * "latest": the newest checkpoint in output_dir that verifies, older ones tried in turn with
 * a warning (on rank 0) naming each one skipped and why; "false": none; "" (unset): none,
 * unless the worker group was restarted (TORCHELASTIC_RESTART_COUNT > 0, torchrun or
 * ddprun --max_restarts), which resumes as "true" does, or starts at step 0 when output_dir
 * holds no checkpoint yet. */
ddp_status_t ddp__train_resume_dir(const ddp_train_args_t *a, int rank, char *dir, size_t cap,
                                   ddp_error_t *err);

/* Reads trainer_state.json of a checkpoint directory: global_step. */
ddp_status_t ddp__train_read_state(const char *dir, int64_t *step, int *world, ddp_error_t *err);

/* Causal language models (lm.c): the loss of logits [B, T, V] against labels I64 [B, T]
 * (position t predicts labels[t + 1], -100 ignored: ddp_causal_lm_loss), and the number of
 * labels it averages over (those of positions 1..T-1 that are not -100). */
ddp_status_t ddp__train_lm_loss(ddp_ctx_t *ctx, ddp_var_t *logits, const ddp_tensor_t *labels,
                                ddp_var_t **loss);
int64_t ddp__train_lm_targets(const ddp_tensor_t *labels);
/* The trainer's one JSON writer (json.c), for its three formats: metrics.jsonl lines,
 * trainer_state.json and a dump's config. One object at a time, members in call order,
 * ", " between members and ": " after keys (json.dumps' layout); strings escaped; a number
 * printed with the printf format given (one conversion of a double), null when it is NaN
 * or infinite (JSON has neither). Begin starts the object, object starts a nested one,
 * end closes the innermost; append adds raw text after the object (a newline). Take
 * returns the text (ddp__free; NULL when memory ran out) and resets j; free drops it. */
typedef struct ddp__json {
  char *buf;
  size_t len, cap;
  bool first; /* the innermost object has no member yet */
  bool oom;
} ddp__json_t;
void ddp__json_begin(ddp__json_t *j);
void ddp__json_object(ddp__json_t *j, const char *key);
void ddp__json_end(ddp__json_t *j);
void ddp__json_int(ddp__json_t *j, const char *key, long long v);
void ddp__json_uint(ddp__json_t *j, const char *key, unsigned long long v);
void ddp__json_num(ddp__json_t *j, const char *key, const char *fmt, double v);
void ddp__json_str(ddp__json_t *j, const char *key, const char *s);
void ddp__json_bool(ddp__json_t *j, const char *key, bool v);
void ddp__json_raw(ddp__json_t *j, const char *key, const char *json);
void ddp__json_append(ddp__json_t *j, const char *text);
char *ddp__json_take(ddp__json_t *j);
void ddp__json_free(ddp__json_t *j);

/* metrics.jsonl (metrics.c), rank 0's. Open: start 0 truncates the file; start S > 0 (a
 * resume from checkpoint-S) first cuts it to the lines of steps <= S (atomically), then
 * appends. Line: j's object and a '\n' in one write(2), j freed; m NULL is a no-op (the
 * other ranks); a failed write is DDP_ERR_SYSTEM naming the file and errno, and the file
 * keeps only whole lines. Close: NULL err ignores close's error. */
typedef struct ddp__metrics ddp__metrics_t;
ddp_status_t ddp__metrics_open(const char *output_dir, int64_t start, ddp__metrics_t **out,
                               ddp_error_t *err);
ddp_status_t ddp__metrics_line(ddp__metrics_t *m, ddp__json_t *j, ddp_error_t *err);
ddp_status_t ddp__metrics_close(ddp__metrics_t *m, ddp_error_t *err);

/* Training argument i (0 .. ddp_train_arg_count() - 1) of a as text into buf ("42", "1e-05"
 * as %.17g, "true", "none", strings quoted); returns whether every rank must be given the
 * same value (all but disable_tqdm, ddp_timeout and the paths: output_dir,
 * resume_from_checkpoint, dump_dir, ddp_trace, power_sgd_init_q). (args.c) */
bool ddp__train_arg_text(const ddp_train_args_t *a, size_t i, char *buf, size_t cap);

#endif /* DDP_TRAIN_INTERNAL_H */
