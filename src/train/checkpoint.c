/* Checkpoints on disk: atomic writes, the checkpoint directory protocol, rotation, finding
 * the latest checkpoint and loading one; also the held-out split and the loss-curve SVG.
 *
 * Crash safety. Every file is written to a temporary name in its final directory, fsynced
 * and renamed (safetensors files by ddp_st_write, trainer_state.json here). A checkpoint is
 * first assembled in output_dir/tmp-checkpoint-<step>/, the directory is fsynced, renamed to
 * checkpoint-<step>/, and output_dir is fsynced. A checkpoint-<step> directory therefore
 * exists only once all three files are durable; a kill -9 at any moment leaves at worst a
 * tmp-checkpoint-* directory, which the latest-checkpoint search ignores and the next save
 * of that step replaces. Rotation deletes old checkpoints only after the new one is in
 * place. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
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

static ddp_status_t fsync_dir(const char *path, ddp_error_t *err) {
  int fd = open(path, O_RDONLY | O_DIRECTORY);
  if (fd < 0) return sys_error(err, "open directory", path);
  int rc = fsync(fd);
  close(fd);
  if (rc != 0 && errno != EINVAL) return sys_error(err, "fsync directory", path);
  return DDP_OK;
}

ddp_status_t ddp__train_mkdirs(const char *path, ddp_error_t *err) {
  char buf[4096];
  if (strlen(path) >= sizeof buf) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "path too long: %s", path);
  }
  strcpy(buf, path);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == 0) {
      char c = *p;
      *p = 0;
      if (mkdir(buf, 0755) != 0 && errno != EEXIST) return sys_error(err, "mkdir", buf);
      *p = c;
      if (!c) break;
    }
  }
  return DDP_OK;
}

ddp_status_t ddp__train_write_atomic(const char *path, const char *text, size_t len,
                                     ddp_error_t *err) {
  char tmp[4200], dir[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) {
    *slash = 0;
  } else {
    strcpy(dir, ".");
  }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return sys_error(err, "open", tmp);
  size_t off = 0;
  while (off < len) {
    ssize_t n = write(fd, text + off, len - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ddp_status_t st = sys_error(err, "write", tmp);
      close(fd);
      unlink(tmp);
      return st;
    }
    off += (size_t)n;
  }
  if (fsync(fd) != 0) {
    ddp_status_t st = sys_error(err, "fsync", tmp);
    close(fd);
    unlink(tmp);
    return st;
  }
  close(fd);
  if (rename(tmp, path) != 0) {
    ddp_status_t st = sys_error(err, "rename to", path);
    unlink(tmp);
    return st;
  }
  return fsync_dir(dir, err);
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

ddp_status_t ddp_train_latest_checkpoint(const char *dir, char *out, size_t cap,
                                         ddp_error_t *err) {
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
  if (restarts > 0 && stat(a->output_dir, &sb) != 0) n = 0; /* nothing written yet */
  else DDP_CHECK(list_checkpoints(a->output_dir, &steps, &n, err));
  if (n == 0) {
    ddp__free(steps);
    if (latest)
      return ddp__error_quiet(err, DDP_ERR_NOT_FOUND,
                              "no complete checkpoint-<step> directory in %s", a->output_dir);
    if (rank == 0)
      ddp__log(rank, DDP_LOG_WARN, "restart %lld (TORCHELASTIC_RESTART_COUNT): %s holds no "
               "checkpoint yet, so training starts again at step 0", (long long)restarts,
               a->output_dir);
    return DDP_OK;
  }
  ddp_status_t st = DDP_ERR_INVALID_DATA;
  char cand[4096];
  for (size_t i = n; i-- > 0 && st != DDP_OK;) {
    snprintf(cand, sizeof cand, "%s/checkpoint-%lld", a->output_dir, (long long)steps[i]);
    st = ddp__train_verify_checkpoint(cand, err);
    if (st == DDP_OK) {
      snprintf(dir, cap, "%s", cand);
    } else if (i > 0 && rank == 0) {
      ddp__log(rank, DDP_LOG_WARN, "skipping %s, which fails verification (%s); trying the "
               "next newest checkpoint", cand, err ? err->msg : ddp_status_name(st));
    }
  }
  ddp__free(steps);
  if (st == DDP_OK && restarts > 0 && rank == 0)
    ddp__log(rank, DDP_LOG_WARN, "restart %lld (TORCHELASTIC_RESTART_COUNT): resuming from %s",
             (long long)restarts, dir);
  if (st != DDP_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", err ? err->msg : ddp_status_name(st));
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
                                   ddp_optim_t *const *opts, size_t nopt,
                                   const char *state_json, int64_t pause, char *tmp, size_t cap,
                                   ddp_error_t *err) {
  char file[4200];
  snprintf(tmp, cap, "%s/tmp-checkpoint-%lld", output_dir, (long long)step);
  DDP_CHECK(ddp__train_mkdirs(output_dir, err));
  DDP_CHECK(remove_dir(tmp, err));
  if (mkdir(tmp, 0755) != 0) return sys_error(err, "mkdir", tmp);

  snprintf(file, sizeof file, "%s/model.safetensors", tmp);
  if (ddp_model_hf_config(model)) {
    /* A Transformers model: save_pretrained's layout (config.json, model.safetensors
     * without the tied lm_head), so that from_pretrained loads the checkpoint. */
    DDP_CHECK(ddp_model_save_pretrained(model, tmp, err));
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
  return ddp__train_write_atomic(file, state_json, strlen(state_json), err);
}

ddp_status_t ddp__train_save_commit(const char *output_dir, int64_t step, int64_t limit,
                                    char *dir, size_t cap, ddp_error_t *err) {
  char tmp[4096], fin[4096], old[4096];
  snprintf(tmp, sizeof tmp, "%s/tmp-checkpoint-%lld", output_dir, (long long)step);
  snprintf(fin, sizeof fin, "%s/checkpoint-%lld", output_dir, (long long)step);
  snprintf(old, sizeof old, "%s/old-checkpoint-%lld", output_dir, (long long)step);
  DDP_CHECK(ddp__train_write_checksums(tmp, err)); /* every rank's files are in by now */
  DDP_CHECK(fsync_dir(tmp, err));

  /* A checkpoint of the same step from an earlier run is moved aside, not overwritten in
   * place, so some complete copy exists at every moment. */
  struct stat sb;
  bool had_old = stat(fin, &sb) == 0;
  if (had_old) {
    DDP_CHECK(remove_dir(old, err));
    if (rename(fin, old) != 0) return sys_error(err, "rename", fin);
  }
  if (rename(tmp, fin) != 0) return sys_error(err, "rename to", fin);
  DDP_CHECK(fsync_dir(output_dir, err));
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

static ddp_status_t read_text(const char *path, char **out, ddp_error_t *err) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) return sys_error(err, "open", path);
  size_t cap = 4096, len = 0;
  char *buf = ddp__malloc(cap);
  while (buf) {
    if (len + 1 == cap) {
      char *t = ddp__realloc(buf, cap * 2);
      if (!t) break;
      buf = t;
      cap *= 2;
    }
    size_t got = fread(buf + len, 1, cap - 1 - len, f);
    len += got;
    if (!got) {
      buf[len] = 0;
      fclose(f);
      *out = buf;
      return DDP_OK;
    }
  }
  ddp__free(buf);
  fclose(f);
  return DDP_ERR_NO_MEMORY;
}

ddp_status_t ddp__train_read_state(const char *dir, int64_t *step, int *world,
                                   ddp_error_t *err) {
  char path[4200];
  snprintf(path, sizeof path, "%s/trainer_state.json", dir);
  char *text;
  DDP_CHECK(read_text(path, &text, err));
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
  DDP_CHECK(ddp__train_verify_checkpoint(dir, err));
  DDP_CHECK(ddp__train_read_state(dir, &s, NULL, err));
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  DDP_CHECK(ddp_model_load(model, path, true, NULL, NULL, err));
  if (opt) {
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    DDP_CHECK(ddp_optim_load(opt, path, err));
  }
  if (step) *step = s;
  return DDP_OK;
}

/* ---------------------------------------------------------------- split ----------- */

typedef struct subset {
  const ddp_dataset_t *base;
  int64_t *idx;
  int64_t n;
} subset_t;

static int64_t subset_len(void *self) { return ((subset_t *)self)->n; }

static ddp_status_t subset_get(void *self, int64_t i, void *feature, void *label,
                               ddp_error_t *err) {
  subset_t *s = self;
  const ddp_sample_spec_t *sp = ddp_dataset_spec(s->base);
  int64_t fn = ddp_dataset_feature_numel(s->base), ln = ddp_dataset_label_numel(s->base);
  ddp_tensor_t f, l;
  DDP_CHECK(ddp_tensor_view(&f, sp->feature_dtype, 1, &fn, feature));
  DDP_CHECK(ddp_tensor_view(&l, sp->label_dtype, 1, &ln, label));
  return ddp_dataset_get(s->base, s->idx[i], &f, &l, err);
}

static void subset_destroy(void *self) {
  subset_t *s = self;
  if (!s) return;
  ddp__free(s->idx);
  ddp__free(s);
}

static const ddp_dataset_ops_t subset_ops = {DDP_DATASET_OPS_VERSION, "subset", subset_len,
                                             subset_get, subset_destroy};

static ddp_status_t make_subset(const ddp_dataset_t *ds, const int64_t *idx, int64_t n,
                                ddp_dataset_t **out, ddp_error_t *err) {
  subset_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return DDP_ERR_NO_MEMORY;
  s->base = ds;
  s->n = n;
  s->idx = ddp__malloc((size_t)DDP_MAX(n, 1) * sizeof(int64_t));
  if (!s->idx) {
    ddp__free(s);
    return DDP_ERR_NO_MEMORY;
  }
  memcpy(s->idx, idx, (size_t)n * sizeof(int64_t));
  return ddp_dataset_create(&subset_ops, s, ddp_dataset_spec(ds), out, err);
}

ddp_status_t ddp_train_split(const ddp_dataset_t *ds, double fraction, uint64_t seed,
                             ddp_dataset_t **train, ddp_dataset_t **eval, ddp_error_t *err) {
  DDP_REQUIRE(ds && train && eval);
  *train = *eval = NULL;
  int64_t n = ddp_dataset_length(ds);
  if (!(fraction >= 0 && fraction < 1)) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "eval_split %g is outside [0, 1)",
                      fraction);
  }
  int64_t ne = (int64_t)llround(fraction * (double)n);
  int64_t *perm = ddp__malloc((size_t)DDP_MAX(n, 1) * sizeof *perm);
  char *mark = ddp__calloc((size_t)DDP_MAX(n, 1), 1);
  int64_t *tr = ddp__malloc((size_t)DDP_MAX(n, 1) * sizeof *tr);
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  if (perm && mark && tr) {
    ddp_randperm(n, seed, perm);
    for (int64_t i = 0; i < ne; i++) mark[perm[i]] = 1;
    int64_t a = 0, b = 0;
    /* Ascending order within each part: tr holds the training indices first, then the
     * eval ones from the back. */
    for (int64_t i = 0; i < n; i++) {
      if (mark[i]) {
        perm[b++] = i;
      } else {
        tr[a++] = i;
      }
    }
    st = make_subset(ds, tr, a, train, err);
    if (st == DDP_OK) st = make_subset(ds, perm, b, eval, err);
    if (st != DDP_OK) {
      ddp_dataset_destroy(*train);
      *train = NULL;
    }
  }
  ddp__free(perm);
  ddp__free(mark);
  ddp__free(tr);
  return st;
}

/* ---------------------------------------------------------------- plot ------------ */

/* The SVG: a 720x420 canvas, a plot area with a 10% margin, x = step, y = loss, a polyline
 * for the training loss and one for the eval loss, min/max labels on both axes. */
ddp_status_t ddp_train_plot_svg(const char *metrics_path, const char *svg_path,
                                ddp_error_t *err) {
  DDP_REQUIRE(metrics_path && svg_path);
  char *text;
  DDP_CHECK(read_text(metrics_path, &text, err));
  size_t cap = 1024, n[2] = {0, 0};
  double *xs[2], *ys[2];
  xs[0] = ddp__malloc(cap * sizeof(double));
  ys[0] = ddp__malloc(cap * sizeof(double));
  xs[1] = ddp__malloc(cap * sizeof(double));
  ys[1] = ddp__malloc(cap * sizeof(double));
  char *svg = NULL;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  if (!xs[0] || !ys[0] || !xs[1] || !ys[1]) goto out;
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    cJSON *o = cJSON_Parse(line);
    if (!o) continue;
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    const cJSON *l0 = cJSON_GetObjectItemCaseSensitive(o, "loss");
    const cJSON *l1 = cJSON_GetObjectItemCaseSensitive(o, "eval_loss");
    for (int k = 0; k < 2; k++) {
      const cJSON *l = k ? l1 : l0;
      if (!cJSON_IsNumber(step) || !cJSON_IsNumber(l) || !isfinite(l->valuedouble)) continue;
      if (n[k] == cap) continue; /* the first `cap` points are plenty for a sketch */
      xs[k][n[k]] = step->valuedouble;
      ys[k][n[k]] = l->valuedouble;
      n[k]++;
      xmin = fmin(xmin, step->valuedouble);
      xmax = fmax(xmax, step->valuedouble);
      ymin = fmin(ymin, l->valuedouble);
      ymax = fmax(ymax, l->valuedouble);
    }
    cJSON_Delete(o);
  }
  if (n[0] + n[1] == 0) {
    xmin = 0;
    xmax = 1;
    ymin = 0;
    ymax = 1;
  }
  if (xmax <= xmin) xmax = xmin + 1;
  if (ymax <= ymin) ymax = ymin + 1;
  ymin = fmin(ymin, 0.0);
  const double W = 720, H = 420, L = 70, R = 20, T = 30, B = 50;
  size_t scap = 200000, len = 0;
  svg = ddp__malloc(scap);
  if (!svg) goto out;
#define EMIT(...)                                                              \
  do {                                                                         \
    if (len < scap) len += (size_t)snprintf(svg + len, scap - len, __VA_ARGS__); \
  } while (0)
  EMIT("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
       "font-family=\"sans-serif\" font-size=\"12\">\n", W, H);
  EMIT("<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  EMIT("<text x=\"%.0f\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">ddp-train loss"
       "</text>\n", W / 2);
  EMIT("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, H - B,
       W - R, H - B);
  EMIT("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, T, L,
       H - B);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", L, H - B + 16, xmin);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", W - R, H - B + 16,
       xmax);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2,
       H - 12);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.3g</text>\n", L - 6, H - B, ymin);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.3g</text>\n", L - 6, T + 4, ymax);
  static const char *const colour[2] = {"#1f77b4", "#d62728"};
  static const char *const label[2] = {"train loss", "eval loss"};
  for (int k = 0; k < 2; k++) {
    if (!n[k]) continue;
    EMIT("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", colour[k]);
    for (size_t i = 0; i < n[k]; i++) {
      double px = L + (xs[k][i] - xmin) / (xmax - xmin) * (W - L - R);
      double py = (H - B) - (ys[k][i] - ymin) / (ymax - ymin) * (H - B - T);
      EMIT("%.1f,%.1f ", px, py);
    }
    EMIT("\"/>\n");
    EMIT("<text x=\"%.0f\" y=\"%.0f\" fill=\"%s\" text-anchor=\"end\">%s</text>\n", W - R - 4,
         T + 14 + 16 * k, colour[k], label[k]);
  }
  EMIT("</svg>\n");
#undef EMIT
  if (len >= scap) len = scap - 1;
  st = ddp__train_write_atomic(svg_path, svg, len, err);
out:
  ddp__free(svg);
  for (int k = 0; k < 2; k++) {
    ddp__free(xs[k]);
    ddp__free(ys[k]);
  }
  ddp__free(text);
  return st;
}
