/* Private interfaces between the files of src/train (not installed). */
#ifndef DDP_TRAIN_INTERNAL_H
#define DDP_TRAIN_INTERNAL_H

#include "ddp/train.h"

/* Every rank hashes its parameters, the hashes are all-gathered, and any difference is
 * DDP_ERR_INVALID_DATA naming the groups of ranks that agree ("ranks 0,2 hold ..., rank 1
 * holds ..."). Collective: every rank calls it at the same step. */
ddp_status_t ddp__train_replica_check(ddp_pg_t *pg, ddp_model_t *model, int64_t step,
                                      uint64_t *hash, ddp_error_t *err);

/* HF's optimizer parameter groups: at most two (weight decay, no weight decay). */
#define DDP__TRAIN_MAX_GROUPS 2

/* A checkpoint is written in two phases so that every rank can add its own files between
 * them. Stage (rank 0): creates output_dir/tmp-checkpoint-<step>/ afresh (tmp receives its
 * path) and writes model.safetensors, the optimizer file of each parameter group
 * (ddp__train_optim_file) and trainer_state.json holding state_json, each atomically;
 * pause_ms > 0 sleeps between the files (the kill-during-save test hook,
 * DDP_TRAIN_SAVE_PAUSE_MS). Then each rank may write into tmp (its comm hook state,
 * ddp__train_hook_file). Commit (rank 0): fsyncs tmp, renames it to checkpoint-<step>/,
 * fsyncs output_dir, then deletes the oldest checkpoint-* directories beyond limit
 * (limit < 0: keep all). dir receives the final path. */
ddp_status_t ddp__train_save_stage(const char *output_dir, int64_t step, ddp_model_t *model,
                                   ddp_optim_t *const *opts, size_t nopt,
                                   const char *state_json, int64_t pause_ms, char *tmp,
                                   size_t cap, ddp_error_t *err);
ddp_status_t ddp__train_save_commit(const char *output_dir, int64_t step, int64_t limit,
                                    char *dir, size_t cap, ddp_error_t *err);
/* dir/optimizer.safetensors for group 0, dir/optimizer_group<g>.safetensors after. */
void ddp__train_optim_file(char *buf, size_t cap, const char *dir, size_t group);
/* dir/hook_state_rank<rank>.safetensors: one rank's PowerSGD state. */
void ddp__train_hook_file(char *buf, size_t cap, const char *dir, int rank);

/* Reads trainer_state.json of a checkpoint directory: global_step. */
ddp_status_t ddp__train_read_state(const char *dir, int64_t *step, int *world,
                                   ddp_error_t *err);

/* Writes text to path atomically (temporary file in the same directory, fsync, rename,
 * fsync of the directory). */
ddp_status_t ddp__train_write_atomic(const char *path, const char *text, size_t len,
                                     ddp_error_t *err);

/* mkdir -p. */
ddp_status_t ddp__train_mkdirs(const char *path, ddp_error_t *err);

#endif /* DDP_TRAIN_INTERNAL_H */
