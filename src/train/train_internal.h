/* Private interfaces between the files of src/train (not installed). */
#ifndef DDP_TRAIN_INTERNAL_H
#define DDP_TRAIN_INTERNAL_H

#include "ddp/train.h"

/* Every rank hashes its parameters, the hashes are all-gathered, and any difference is
 * DDP_ERR_INVALID_DATA naming the groups of ranks that agree ("ranks 0,2 hold ..., rank 1
 * holds ..."). Collective: every rank calls it at the same step. */
ddp_status_t ddp__train_replica_check(ddp_pg_t *pg, ddp_model_t *model, int64_t step,
                                      uint64_t *hash, ddp_error_t *err);

/* Writes output_dir/checkpoint-<step>/ (model.safetensors, optimizer.safetensors,
 * trainer_state.json holding state_json) through output_dir/tmp-checkpoint-<step>/ and a
 * rename, fsyncing files and directories; pause_ms > 0 sleeps between the files (the
 * kill-during-save test hook, DDP_TRAIN_SAVE_PAUSE_MS). Then deletes the oldest
 * checkpoint-* directories beyond limit (limit < 0: keep all). dir receives the path. */
ddp_status_t ddp__train_save(const char *output_dir, int64_t step, ddp_model_t *model,
                             const ddp_optim_t *opt, const char *state_json, int64_t limit,
                             int64_t pause_ms, char *dir, size_t cap, ddp_error_t *err);

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
