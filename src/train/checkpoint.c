/* Checkpoints on disk: the checkpoint directory protocol, rotation, finding the latest
 * checkpoint and loading one.
 *
 * Crash safety. Every file is written to a temporary name in its final directory, fsynced
 * and renamed (src/common/file.c's one atomic writer: safetensors files by ddp_st_write,
 * trainer_state.json here). A checkpoint is
 * first assembled in output_dir/tmp-checkpoint-<step>/, the directory is fsynced, renamed to
 * checkpoint-<step>/, and output_dir is fsynced. A checkpoint-<step> directory therefore
 * exists only once all three files are durable; a kill -9 at any moment leaves at worst a
 * tmp-checkpoint-* directory, which the latest-checkpoint search ignores and the next save
 * of that step replaces. Rotation deletes old checkpoints only after the new one is in
 * place. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/train_internal.h"

static ddp_status_t sys_error(ddp_error_t *err, const char *what, const char *path) {
  int e = errno;
  return ddp__error(err, -1, e == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM,
                    "%s %s: %s (errno %d)", what, path, strerror(e), e);
}

/* Removes a checkpoint directory: its plain files, then the directory (checkpoints hold no
 * subdirectories). */
static ddp_status_t remove_dir(const char *path, ddp_error_t *err) {
  DIR *d = opendir(path);
  if (!d) return errno == ENOENT ? DDP_OK : sys_error(err, "opendir", path);
  struct dirent *e;
  char child[4600];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(child, sizeof child, "%s/%s", path, e->d_name);
    if (unlink(child) != 0 && errno != ENOENT) {
      ddp_status_t st = sys_error(err, "unlink", child);
      closedir(d);
      return st;
    }
  }
  closedir(d);
  if (rmdir(path) != 0 && errno != ENOENT) return sys_error(err, "rmdir", path);
  return DDP_OK;
}

/* "checkpoint-<digits>" -> step; -1 for any other name. */
static int64_t checkpoint_step(const char *name) {
  if (strncmp(name, "checkpoint-", 11) != 0 || !name[11]) return -1;
  int64_t v = 0;
  for (const char *p = name + 11; *p; p++) {
    if (*p < '0' || *p > '9' || v > INT64_MAX / 10 - 10) return -1;
    v = v * 10 + (*p - '0');
  }
  return v;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* The steps of the complete checkpoints under dir, ascending. *steps is ddp__malloc'd. */
static ddp_status_t list_checkpoints(const char *dir, int64_t **steps, size_t *n,
                                     ddp_error_t *err) {
  *steps = NULL;
  *n = 0;
  DIR *d = opendir(dir);
  if (!d) return sys_error(err, "opendir", dir);
  size_t cap = 16;
  int64_t *v = ddp__malloc(cap * sizeof *v);
  if (!v) {
    closedir(d);
    return DDP_ERR_NO_MEMORY;
  }
  struct dirent *e;
  char probe[4600];
  while ((e = readdir(d))) {
    int64_t s = checkpoint_step(e->d_name);
    if (s < 0) continue;
    snprintf(probe, sizeof probe, "%s/%s/trainer_state.json", dir, e->d_name);
    if (access(probe, R_OK) != 0) continue;
    if (*n == cap) {
      int64_t *t = ddp__realloc(v, 2 * cap * sizeof *v);
      if (!t) {
        ddp__free(v);
        closedir(d);
        return DDP_ERR_NO_MEMORY;
      }
      v = t;
      cap *= 2;
    }
    v[(*n)++] = s;
  }
  closedir(d);
  qsort(v, *n, sizeof *v, cmp_i64);
  *steps = v;
  return DDP_OK;
}

ddp_status_t ddp_train_latest_checkpoint(const char *dir, char *out, size_t cap, ddp_error_t *err) {
  DDP_REQUIRE(dir && out && cap);
  int64_t *steps;
  size_t n;
  DDP_CHECK(list_checkpoints(dir, &steps, &n, err));
  ddp_status_t st = DDP_OK;
  if (n == 0) {
    st = ddp__error_quiet(err, DDP_ERR_NOT_FOUND, "no complete checkpoint-<step> directory in %s",
                          dir);
  } else {
    snprintf(out, cap, "%s/checkpoint-%lld", dir, (long long)steps[n - 1]);
  }
  ddp__free(steps);
  return st;
}

ddp_status_t ddp__train_resume_dir(const ddp_train_args_t *a, int rank, char *dir, size_t cap,
                                   ddp_error_t *err) {
  const char *r = a->resume_from_checkpoint;
  dir[0] = '\0';
  int64_t restarts = 0;
  if (!r[0] && ddp_env_is_set(DDP_ENV_RESTART_COUNT))
    DDP_CHECK(ddp_env_int(DDP_ENV_RESTART_COUNT, 0, INT32_MAX, &restarts, err));
  bool latest = !strcasecmp(r, "true") || !strcasecmp(r, "latest");
  if (!latest && !(restarts > 0)) {
    if (r[0] && strcasecmp(r, "false") != 0) snprintf(dir, cap, "%s", r);
    return DDP_OK;
  }
  int64_t *steps = NULL;
  size_t n = 0;
  struct stat sb;
  if (restarts > 0 && stat(a->output_dir, &sb) != 0)
    n = 0; /* nothing written yet */
  else
    DDP_CHECK(list_checkpoints(a->output_dir, &steps, &n, err));
  if (n == 0) {
    ddp__free(steps);
    if (latest)
      return ddp__error_quiet(err, DDP_ERR_NOT_FOUND,
                              "no complete checkpoint-<step> directory in %s", a->output_dir);
    if (rank == 0)
      ddp__log(rank, DDP_LOG_WARN,
               "restart %lld (TORCHELASTIC_RESTART_COUNT): %s holds no "
               "checkpoint yet, so training starts again at step 0",
               (long long)restarts, a->output_dir);
    return DDP_OK;
  }
  ddp_status_t st = DDP_ERR_INVALID_DATA;
  char cand[4096];
  for (size_t i = n; i-- > 0 && st != DDP_OK;) {
    snprintf(cand, sizeof cand, "%s/checkpoint-%lld", a->output_dir, (long long)steps[i]);
    st = ddp__train_verify_checkpoint(cand, true, err); /* reported below, once */
    if (st == DDP_OK) {
      snprintf(dir, cap, "%s", cand);
    } else if (i > 0 && rank == 0) {
      ddp__log(rank, DDP_LOG_WARN,
               "skipping %s, which fails verification (%s); trying the "
               "next newest checkpoint",
               cand, err ? err->msg : ddp_status_name(st));
    }
  }
  ddp__free(steps);
  if (st == DDP_OK && restarts > 0 && rank == 0)
    ddp__log(rank, DDP_LOG_WARN, "restart %lld (TORCHELASTIC_RESTART_COUNT): resuming from %s",
             (long long)restarts, dir);
  if (st != DDP_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%.1000s", err ? err->msg : ddp_status_name(st));
    return ddp__error(err, rank, st, "no checkpoint in %s verifies; the oldest fails with: %s",
                      a->output_dir, why);
  }
  return DDP_OK;
}

static void pause_ms(int64_t ms) {
  if (ms <= 0) return;
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void ddp__train_optim_file(char *buf, size_t cap, const char *dir, size_t group) {
  if (group == 0) {
    snprintf(buf, cap, "%s/optimizer.safetensors", dir);
  } else {
    snprintf(buf, cap, "%s/optimizer_group%zu.safetensors", dir, group);
  }
}

void ddp__train_hook_file(char *buf, size_t cap, const char *dir, int rank) {
  snprintf(buf, cap, "%s/hook_state_rank%d.safetensors", dir, rank);
}

ddp_status_t ddp__train_save_stage(const char *output_dir, int64_t step, ddp_model_t *model,
                                   int64_t max_shard_size, ddp_optim_t *const *opts, size_t nopt,
                                   const char *state_json, int64_t pause, char *tmp, size_t cap,
                                   ddp_error_t *err) {
  char file[4200];
  snprintf(tmp, cap, "%s/tmp-checkpoint-%lld", output_dir, (long long)step);
  DDP_CHECK(ddp__mkdirs(output_dir, -1, "checkpoint", err));
  DDP_CHECK(remove_dir(tmp, err));
  if (mkdir(tmp, 0755) != 0) return sys_error(err, "mkdir", tmp);

  snprintf(file, sizeof file, "%s/model.safetensors", tmp);
  if (!model) {
    /* ZeRO-3 SHARDED_STATE_DICT: every rank writes its shards instead */
  } else if (ddp_model_hf_config(model)) {
    /* A Transformers model: save_pretrained's layout (config.json, model.safetensors
     * without the tied lm_head, or its shards and their index), so that from_pretrained
     * loads the checkpoint. */
    DDP_CHECK(ddp_model_save_pretrained_sharded(model, tmp, max_shard_size, err));
  } else {
    DDP_CHECK(ddp_model_save(model, file, err));
  }
  pause_ms(pause);
  for (size_t g = 0; g < nopt; g++) {
    ddp__train_optim_file(file, sizeof file, tmp, g);
    DDP_CHECK(ddp_optim_save(opts[g], file, err));
  }
  pause_ms(pause);
  snprintf(file, sizeof file, "%s/trainer_state.json", tmp);
  return ddp__file_write_atomic(file, state_json, strlen(state_json), 0644, -1, "checkpoint", err);
}

ddp_status_t ddp__train_save_commit(const char *output_dir, int64_t step, int64_t limit, char *dir,
                                    size_t cap, ddp_error_t *err) {
  char tmp[4096], fin[4096], old[4096];
  snprintf(tmp, sizeof tmp, "%s/tmp-checkpoint-%lld", output_dir, (long long)step);
  snprintf(fin, sizeof fin, "%s/checkpoint-%lld", output_dir, (long long)step);
  snprintf(old, sizeof old, "%s/old-checkpoint-%lld", output_dir, (long long)step);
  DDP_CHECK(ddp__train_write_checksums(tmp, err)); /* every rank's files are in by now */
  DDP_CHECK(ddp__sync_dir(tmp, -1, "checkpoint", err));

  /* A checkpoint of the same step from an earlier run is moved aside, not overwritten in
   * place, so some complete copy exists at every moment. */
  struct stat sb;
  bool had_old = stat(fin, &sb) == 0;
  if (had_old) {
    DDP_CHECK(remove_dir(old, err));
    if (rename(fin, old) != 0) return sys_error(err, "rename", fin);
  }
  if (rename(tmp, fin) != 0) return sys_error(err, "rename to", fin);
  DDP_CHECK(ddp__sync_dir(output_dir, -1, "checkpoint", err));
  if (had_old) DDP_CHECK(remove_dir(old, err));
  if (dir) snprintf(dir, cap, "%s", fin);

  if (limit >= 0) {
    int64_t *steps;
    size_t n;
    DDP_CHECK(list_checkpoints(output_dir, &steps, &n, err));
    ddp_status_t st = DDP_OK;
    /* Never delete the checkpoint just written, even with limit 0. */
    size_t keep = DDP_MAX((size_t)limit, 1);
    for (size_t i = 0; st == DDP_OK && n > keep && i < n - keep; i++) {
      if (steps[i] == step) continue;
      snprintf(old, sizeof old, "%s/checkpoint-%lld", output_dir, (long long)steps[i]);
      st = remove_dir(old, err);
    }
    ddp__free(steps);
    DDP_CHECK(st);
  }
  return DDP_OK;
}

ddp_status_t ddp__train_read_state(const char *dir, int64_t *step, int *world, ddp_error_t *err) {
  char path[4200];
  snprintf(path, sizeof path, "%s/trainer_state.json", dir);
  char *text;
  DDP_CHECK(ddp__file_read(path, 0, -1, "checkpoint", &text, NULL, err));
  cJSON *o = cJSON_Parse(text);
  ddp__free(text);
  const cJSON *gs = o ? cJSON_GetObjectItemCaseSensitive(o, "global_step") : NULL;
  const cJSON *ws = o ? cJSON_GetObjectItemCaseSensitive(o, "world_size") : NULL;
  if (!cJSON_IsNumber(gs) || gs->valuedouble < 0 || !cJSON_IsNumber(ws)) {
    cJSON_Delete(o);
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "%s: not a trainer state (needs numeric global_step and world_size)", path);
  }
  *step = (int64_t)gs->valuedouble;
  if (world) *world = (int)ws->valuedouble;
  cJSON_Delete(o);
  return DDP_OK;
}

ddp_status_t ddp_train_checkpoint_load(const char *dir, ddp_model_t *model, ddp_optim_t *opt,
                                       int64_t *step, ddp_error_t *err) {
  DDP_REQUIRE(dir && model);
  char path[4200];
  int64_t s;
  DDP_CHECK(ddp__train_verify_checkpoint(dir, false, err));
  DDP_CHECK(ddp__train_read_state(dir, &s, NULL, err));
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  if (ddp_model_hf_config(model))
    DDP_CHECK(ddp_model_load_pretrained(model, dir, err)); /* single file or sharded */
  else
    DDP_CHECK(ddp_model_load(model, path, true, NULL, NULL, err));
  if (opt) {
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    DDP_CHECK(ddp_optim_load(opt, path, err));
  }
  if (step) *step = s;
  return DDP_OK;
}
