/* The training loop (contract in include/ddp/train.h, user guide in docs/train.md).
 *
 * Step arithmetic follows HF's Trainer. Each rank's loader yields B = len(DataLoader)
 * micro-batches per epoch (DistributedSampler shard, per_device_train_batch_size rows);
 * an optimizer step consumes gradient_accumulation_steps (GA) of them, so an epoch has
 * S = B / GA steps (the B mod GA leftover micro-batches of an epoch are skipped, so every
 * window is full), and max_steps defaults to ceil(num_train_epochs * S). Step s (0-based)
 * belongs to epoch s / S and reads micro-batches (s mod S) * GA ... + GA - 1 of that
 * epoch's shuffle (seed + epoch). That makes the sampler position a pure function of the
 * step, which is what lets a resumed run replay the uninterrupted one bit for bit: the
 * checkpoint holds the parameters, the optimizer state and the step; the LR multiplier is
 * a function of the step; dropout draws come from (seed, rank, micro-step).
 *
 * One step: for each micro-batch k the forward is synchronising only when k == GA - 1
 * (HF runs the others under no_sync); the backward computes the gradient of loss / GA
 * (Accelerate's scaling; sync.h); after the window the gradients are the average
 * over ranks of the summed micro-gradients. Then clip_grad_norm (max_grad_norm > 0), set
 * the lr from the schedule, step the optimizer, zero the gradients, and average the step's
 * loss over ranks for logging.
 *
 * The run is a sequence of named steps: begin (setup.c's setup, the resume, the dump and
 * metrics files), then per optimizer step train_step, end_of_step (with the log line when
 * due), eval_step and save when due, then finish. Every metrics.jsonl line goes through
 * the one JSON writer (json.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "ddp_config.h"
#include "train/trainer.h"

/* w is read only after st's call has run (hence the pointer: argument order is unspecified). */
static ddp_status_t coll_wait(ddp__trainer_t *t, ddp_status_t st, ddp_work_t **w,
                              const char *what) {
  if (st == DDP_OK) st = ddp_work_wait_free(*w);
  if (st != DDP_OK) { /* logged by the group where it started; context added here */
    ddp_error_t pe;
    ddp_pg_last_error_copy(t->pg, &pe);
    return ddp__error_quiet(t->err, st, "trainer: %s: %s", what, pe.msg);
  }
  return DDP_OK;
}

/* Positions the loader at micro-batch `pos` of `epoch`. */
static ddp_status_t seek_loader(ddp__trainer_t *t, int64_t epoch, int64_t pos) {
  if (epoch != t->loader_epoch || pos < t->loader_pos) {
    DDP_CHECK(ddp_loader_set_epoch(t->loader, epoch, t->err));
    t->loader_epoch = epoch;
    t->loader_pos = 0;
  }
  while (t->loader_pos < pos) {
    ddp_batch_t b;
    bool has = false;
    DDP_CHECK(ddp_loader_next(t->loader, &b, &has, t->err));
    if (!has) {
      return ddp__error(t->err, t->rank, DDP_ERR_INTERNAL, "trainer: epoch %lld ended early",
                        (long long)epoch);
    }
    t->loader_pos++;
  }
  return DDP_OK;
}

/* An op's failure with the message it left (and logged) on the context. */
static ddp_status_t op_error(ddp__trainer_t *t, ddp_status_t st, const char *what) {
  if (st == DDP_OK) return st;
  ddp_error_t ce;
  ddp_ctx_last_error_copy(t->ctx, &ce);
  return ddp__error_quiet(t->err, st, "trainer: %s: %s", what, ce.msg);
}

/* loss = CE(logits, labels) or MSE(out, labels reshaped to out's shape). */
static ddp_status_t compute_loss(ddp__trainer_t *t, ddp_var_t *out, const ddp_batch_t *b,
                                 ddp_var_t **loss) {
  ddp_var_t *y;
  if (t->task == DDP_TASK_CAUSAL_LM) {
    return op_error(t, ddp__train_lm_loss(t->ctx, out, &b->labels, loss), "loss");
  }
  if (t->classify) {
    DDP_CHECK(ddp_var_new(t->ctx, DDP_I64, 1, &b->size, b->labels.data, false, &y));
    return op_error(t, ddp_cross_entropy(t->ctx, out, y, -100, loss), "loss");
  }
  if (b->labels.numel != out->value.numel) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: the model's output has %lld values per batch but the labels "
                      "have %lld",
                      (long long)out->value.numel, (long long)b->labels.numel);
  }
  ddp_tensor_t lab;
  DDP_CHECK(ddp_tensor_alloc(&lab, out->value.dtype, out->value.ndim, out->value.shape));
  ddp_status_t st = ddp_tensor_copy(&lab, &b->labels);
  if (st == DDP_OK) {
    st = ddp_var_new(t->ctx, lab.dtype, lab.ndim, lab.shape, lab.data, false, &y);
  }
  ddp_tensor_free(&lab);
  DDP_CHECK(st);
  return op_error(t, ddp_mse_loss(t->ctx, out, y, loss), "loss");
}

static ddp_status_t forward(ddp__trainer_t *t, const ddp_batch_t *b, ddp_var_t **out) {
  ddp_var_t *x;
  const ddp_sample_spec_t *sp = ddp_dataset_spec(t->train);
  DDP_CHECK(ddp_var_new(t->ctx, sp->feature_dtype, b->features.ndim, b->features.shape,
                        b->features.data, false, &x));
  return op_error(t, ddp_model_forward(t->model, t->ctx, x, t->flags, out), "forward");
}

static double scalar_value(const ddp_var_t *v) {
  return v->value.dtype == DDP_F64 ? *(const double *)v->value.data
                                   : (double)*(const float *)v->value.data;
}

/* Evaluation over the held-out set: rank r takes samples r, r + W, ... (no padding, so
 * nothing is counted twice); sums of loss, correct predictions and counts are all-reduced
 * in f64. */
static ddp_status_t evaluate(ddp__trainer_t *t, double *loss, double *acc) {
  *loss = *acc = NAN;
  if (!t->eval) return DDP_OK;
  int64_t n = ddp_dataset_length(t->eval);
  int64_t bs = t->a->per_device_eval_batch_size;
  double sums[3] = {0, 0, 0}; /* loss sum (per row or element), correct, rows/elements */
  int64_t *idx = ddp__malloc((size_t)(bs > 0 ? bs : 1) * sizeof *idx);
  ddp_tensor_t f = {0}, l = {0};
  const ddp_sample_spec_t *sp = ddp_dataset_spec(t->eval);
  int64_t fs[DDP_MAX_DIMS + 1], ls[DDP_MAX_DIMS + 1];
  fs[0] = ls[0] = bs;
  memcpy(fs + 1, sp->feature_shape, sizeof(int64_t) * (size_t)sp->feature_ndim);
  memcpy(ls + 1, sp->label_shape, sizeof(int64_t) * (size_t)sp->label_ndim);
  ddp_status_t st = idx ? DDP_OK : DDP_ERR_NO_MEMORY;
  if (st == DDP_OK) st = ddp_tensor_alloc(&f, sp->feature_dtype, sp->feature_ndim + 1, fs);
  if (st == DDP_OK) st = ddp_tensor_alloc(&l, sp->label_dtype, sp->label_ndim + 1, ls);
  /* ZeRO-3: the ranks run different numbers of batches, so the whole model is gathered
   * once (summon_full_params) instead of per unit */
  if (st == DDP_OK && t->fsdp) st = ddp_fsdp_gather_all(t->fsdp, t->err);
  bool prev = ddp_ctx_set_grad_enabled(t->ctx, false);
  ddp_model_train(t->model, false);
  for (int64_t start = t->rank; st == DDP_OK && start < n;) {
    int64_t m = 0;
    for (; m < bs && start < n; m++, start += t->world) idx[m] = start;
    if ((st = ddp_dataset_get_batch(t->eval, idx, m, &f, &l, t->err)) != DDP_OK) break;
    ddp_batch_t b = {0};
    b.features = f;
    b.features.shape[0] = m;
    b.features.numel = f.numel / bs * m;
    b.labels = l;
    b.labels.shape[0] = m;
    b.labels.numel = l.numel / bs * m;
    b.size = m;
    ddp_var_t *out, *lv;
    if ((st = forward(t, &b, &out)) != DDP_OK || (st = compute_loss(t, out, &b, &lv)) != DDP_OK) {
      break;
    }
    if (t->task == DDP_TASK_CAUSAL_LM) { /* weighted by predicted tokens (lm.c) */
      double k = (double)ddp__train_lm_targets(&b.labels);
      sums[0] += scalar_value(lv) * k;
      sums[2] += k;
    } else if (t->classify) {
      int64_t C = out->value.shape[out->value.ndim - 1];
      const int64_t *lab = b.labels.data;
      for (int64_t i = 0; i < m; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < C; c++) {
          double vc = out->value.dtype == DDP_F64 ? ((double *)out->value.data)[i * C + c]
                                                  : ((float *)out->value.data)[i * C + c];
          double vb = out->value.dtype == DDP_F64 ? ((double *)out->value.data)[i * C + best]
                                                  : ((float *)out->value.data)[i * C + best];
          if (vc > vb) best = c;
        }
        sums[1] += best == lab[i];
      }
      sums[0] += scalar_value(lv) * (double)m;
      sums[2] += (double)m;
    } else {
      sums[0] += scalar_value(lv) * (double)out->value.numel;
      sums[2] += (double)out->value.numel;
      sums[1] += (double)m;
    }
    ddp_ctx_reset(t->ctx);
  }
  ddp_model_train(t->model, true);
  ddp_ctx_set_grad_enabled(t->ctx, prev);
  if (t->fsdp) ddp_fsdp_free_all(t->fsdp);
  ddp_tensor_free(&f);
  ddp_tensor_free(&l);
  ddp__free(idx);
  ddp_ctx_reset(t->ctx);
  DDP_CHECK(st);
  ddp_work_t *w = NULL;
  DDP_CHECK(coll_wait(t, ddp_allreduce(t->pg, sums, sums, 3, DDP_F64, DDP_OP_SUM, &w), &w,
                      "eval allreduce"));
  *loss = sums[2] > 0 ? sums[0] / sums[2] : NAN;
  *acc = t->classify && sums[2] > 0 ? sums[1] / sums[2] : NAN;
  return DDP_OK;
}

/* Every rank writes its own files into the staged checkpoint directory: its comm hook's
 * state, when the hook keeps one (rank-local: PowerSGD's error feedback differs per rank),
 * and under ZeRO its shard of the optimizer state (zero.c). The statuses are all-gathered
 * so that every rank fails alike, naming the first rank that failed. */
static ddp_status_t save_rank_files(ddp__trainer_t *t, int64_t step) {
  bool shards = ddp__train_fsdp_sharded_save(t);
  if (!ddp__sync_hook_has_state(t->sync) && !t->zero && !shards) return DDP_OK;
  char tmp[DDP_TRAIN_STR_MAX + 64], file[DDP_TRAIN_STR_MAX + 128];
  snprintf(tmp, sizeof tmp, "%s/tmp-checkpoint-%lld", t->a->output_dir, (long long)step);
  int32_t mine = DDP_OK;
  if (ddp__sync_hook_has_state(t->sync)) {
    ddp__train_hook_file(file, sizeof file, tmp, t->rank);
    mine = ddp__sync_hook_save(t->sync, file, t->err);
  }
  if (mine == DDP_OK && t->zero) mine = ddp__train_zero_save_shard(t, tmp);
  if (mine == DDP_OK && shards) mine = ddp__train_fsdp_save_shard(t, tmp);
  int32_t *all = ddp__calloc((size_t)t->world, sizeof *all);
  if (!all) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
  ddp_work_t *w = NULL;
  ddp_status_t st = coll_wait(t, ddp_allgather(t->pg, &mine, all, 1, DDP_I32, &w), &w,
                              "checkpoint rank files status allgather");
  for (int r = 0; st == DDP_OK && r < t->world; r++) {
    if (all[r] == DDP_OK) continue;
    st = r == t->rank
             ? (ddp_status_t)all[r]
             : ddp__error(t->err, t->rank, (ddp_status_t)all[r],
                          "trainer: rank %d failed to save its %s into "
                          "checkpoint-%lld",
                          r, t->zero || shards ? "shards or comm hook state" : "comm hook state",
                          (long long)step);
  }
  ddp__free(all);
  return st;
}

/* Rank 0 stages the checkpoint, every rank adds its comm hook state and, under ZeRO, its
 * optimizer shard; rank 0 consolidates the shards (ZeRO) and commits; the statuses are
 * broadcast so that every rank fails alike. */
static ddp_status_t save(ddp__trainer_t *t, int64_t step) {
  int32_t code = DDP_OK;
  char dir[DDP_TRAIN_STR_MAX] = "", tmp[DDP_TRAIN_STR_MAX + 64];
  /* ZeRO-3 FULL_STATE_DICT: the full parameters and optimizer state, gathered (zero.c) */
  ddp_status_t gst = ddp__train_fsdp_save_begin(t);
  if (gst != DDP_OK) return gst;
  bool shards = ddp__train_fsdp_sharded_save(t);
  if (t->rank == 0) {
    char *js = NULL;
    code = ddp__trainer_state_json(t, step, &js);
    if (code == DDP_OK) {
      /* ZeRO: the optimizer files come from the ranks' shards (save_rank_files) */
      int64_t shard = DDP_MAX_SHARD_SIZE_DEFAULT; /* validated with the arguments */
      code = ddp_parse_file_size(t->a->max_shard_size, "max_shard_size", &shard, t->err);
      if (code == DDP_OK)
        code = ddp__train_save_stage(t->a->output_dir, step, shards ? NULL : t->model, shard,
                                     t->opt, t->zero || shards ? 0 : t->nopt, js, t->pause_ms, tmp,
                                     sizeof tmp, t->err);
    }
    ddp__free(js);
  }
  ddp__train_fsdp_save_end(t);
  ddp_work_t *w = NULL;
  DDP_CHECK(coll_wait(t, ddp_broadcast(t->pg, &code, 1, DDP_I32, 0, &w), &w,
                      "checkpoint status broadcast"));
  if (code == DDP_OK) {
    DDP_CHECK(save_rank_files(t, step));
    if (t->rank == 0 && t->zero) code = ddp__train_zero_consolidate(t, tmp);
    if (t->rank == 0 && code == DDP_OK) {
      code = ddp__train_save_commit(t->a->output_dir, step, t->a->save_total_limit, dir, sizeof dir,
                                    t->err);
    }
    DDP_CHECK(coll_wait(t, ddp_broadcast(t->pg, &code, 1, DDP_I32, 0, &w), &w,
                        "checkpoint status broadcast"));
  }
  if (code != DDP_OK) {
    if (t->rank != 0) {
      return ddp__error(t->err, t->rank, (ddp_status_t)code,
                        "trainer: rank 0 failed to save checkpoint-%lld", (long long)step);
    }
    return (ddp_status_t)code;
  }
  if (t->rank == 0) {
    snprintf(t->res->last_checkpoint, sizeof t->res->last_checkpoint, "%s", dir);
    ddp__json_t j;
    ddp__json_begin(&j);
    ddp__json_int(&j, "step", step);
    ddp__json_str(&j, "checkpoint", dir);
    ddp__json_end(&j);
    DDP_CHECK(ddp__metrics_line(t->metrics, &j, t->err));
    if (t->ev) {
      ddp_train_event_t e = {.kind = DDP_TRAIN_EV_SAVE,
                             .step = step,
                             .max_steps = t->max_steps,
                             .epoch = (double)step / (double)t->steps_per_epoch,
                             .checkpoint = dir};
      t->ev(t->user, &e);
    }
  }
  return DDP_OK;
}

static ddp_status_t resume(ddp__trainer_t *t, int64_t *start) {
  char dir[DDP_TRAIN_STR_MAX];
  *start = 0;
  /* resume_from_checkpoint, or the newest verified checkpoint after a restart. */
  DDP_CHECK(ddp__train_resume_dir(t->a, t->rank, dir, sizeof dir, t->err));
  if (!dir[0]) return DDP_OK;
  int world = 0;
  int64_t step = 0;
  DDP_CHECK(ddp__train_read_state(dir, &step, &world, t->err));
  DDP_CHECK(ddp__train_resume_check(t, dir));
  bool sharded = false; /* ZeRO-3 SHARDED_STATE_DICT: loaded once sharded (zero.c) */
  DDP_CHECK(ddp__train_fsdp_probe(t, dir, world, &sharded));
  if (!sharded)
    DDP_CHECK(ddp_train_checkpoint_load(dir, t->model, t->zero ? NULL : t->opt[0], NULL, t->err));
  for (size_t g = t->zero ? 0 : 1; !sharded && g < t->nopt; g++) {
    char path[DDP_TRAIN_STR_MAX + 64];
    ddp__train_optim_file(path, sizeof path, dir, g);
    /* ZeRO: this rank's parameters from the consolidated file, at any world size */
    DDP_CHECK(t->zero ? ddp_zero_optim_load(t->zero, g, path, t->err)
                      : ddp_optim_load(t->opt[g], path, t->err));
  }
  if (world != t->world && !t->inv_k) { /* invariant mode: the same run for any W */
    ddp__log(t->rank, DDP_LOG_WARN,
             "resuming %s, written by %d ranks, with %d: the data order differs from an "
             "uninterrupted run",
             dir, world, t->world);
  }
  if (step > t->max_steps) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: %s is at step %lld, past max_steps %lld", dir, (long long)step,
                      (long long)t->max_steps);
  }
  snprintf(t->resume_dir, sizeof t->resume_dir, "%s", dir);
  *start = step;
  ddp__log(t->rank, DDP_LOG_INFO, "resumed from %s at step %lld", dir, (long long)step);
  return DDP_OK;
}

/* After the comm hook is registered: this rank's hook state (when the hook keeps one) from
 * the checkpoint being resumed. A checkpoint without one (written before hook states were
 * saved, or by fewer ranks) starts the state afresh with a warning: the run then differs
 * from an uninterrupted one. */
static ddp_status_t resume_hook_state(ddp__trainer_t *t) {
  if (!ddp__sync_hook_has_state(t->sync) || !t->resume_dir[0]) return DDP_OK;
  char file[DDP_TRAIN_STR_MAX + 64];
  ddp__train_hook_file(file, sizeof file, t->resume_dir, t->rank);
  if (access(file, F_OK) != 0) {
    ddp__log(t->rank, DDP_LOG_WARN,
             "resuming %s with comm_hook %s: %s is missing, so the hook's state starts "
             "afresh and the run differs from an uninterrupted one",
             t->resume_dir, t->a->comm_hook, file);
    return DDP_OK;
  }
  return ddp__sync_hook_load(t->sync, file, t->err);
}

/* power_sgd_init_q: PyTorch's Q draws replace the generator of the PowerSGD state the hook
 * configuration made (validation has checked that comm_hook is a PowerSGD one). */
static ddp_status_t open_init_q(ddp__trainer_t *t) {
  if (!t->a->power_sgd_init_q[0]) return DDP_OK;
  ddp_powersgd_state_t *ps = ddp__sync_powersgd(t->sync);
  if (!ps) {
    return ddp__error(t->err, t->rank, DDP_ERR_INTERNAL,
                      "trainer: power_sgd_init_q without a PowerSGD state");
  }
  DDP_CHECK(ddp__train_q_open(t->a->power_sgd_init_q, t->rank, &t->init_q, t->err));
  ddp_powersgd_set_init_q(ps, ddp__train_q_fill, t->init_q);
  return DDP_OK;
}

/* A dump call's status, with the message the writer logged. */
static ddp_status_t dump_check(ddp__trainer_t *t, ddp_status_t st) {
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t de = {0};
  if (t->dump) ddp_dump_last_error_copy(t->dump, &de);
  return ddp__error_quiet(t->err, st, "trainer: dump_dir %s: %s", t->a->dump_dir, de.msg);
}

/* metrics.jsonl's number formats: most values as %.9g (null when not finite). */
#define G9 "%.9g"

static bool every(int64_t step, int64_t n) { return n > 0 && step % n == 0; }

/* HF's *_steps: a value below 1 is that fraction of the training steps, rounded up. */
static int64_t interval(double v, int64_t max_steps) {
  if (v <= 0) return 0;
  if (v < 1) return DDP_MAX((int64_t)ceil(v * (double)max_steps), 1);
  return (int64_t)v;
}

static double epoch_of(const ddp__trainer_t *t, int64_t step) {
  return (double)step / (double)t->steps_per_epoch;
}

/* The members every metrics line of step `step` starts with. */
static void metrics_begin(const ddp__trainer_t *t, ddp__json_t *j, int64_t step) {
  ddp__json_begin(j);
  ddp__json_int(j, "step", step);
  ddp__json_num(j, "epoch", "%.4f", epoch_of(t, step));
}

static void param_hash_member(ddp__json_t *j, uint64_t h) {
  char hex[24];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h);
  ddp__json_str(j, "param_hash", hex);
}

/* ---------------------------------------------------------------- the run --------- */

/* --dump_dir: the dump writer, with the run's configuration and the reducer's layout. */
static ddp_status_t open_dump(ddp__trainer_t *t) {
  char *config = NULL, *model = NULL;
  DDP_CHECK(ddp__trainer_dump_config(t, &config));
  /* "model": a Transformers model's config.json, as torch_reference.py inlines the model
   * file it was given (a libddp model file's text is not known here: {}) */
  const ddp_hf_config_t *hf = ddp_model_hf_config(t->model);
  ddp_status_t st = hf ? ddp_hf_config_to_json(hf, &model, t->err) : DDP_OK;
  if (st != DDP_OK) {
    ddp__free(config);
    return st;
  }
  ddp_dump_options_t o = DDP_DUMP_OPTIONS_INIT;
  o.steps = t->max_steps - t->start;
  o.producer_version = "libddp " DDP_VERSION;
  o.config_json = config;
  o.model_json = model;
  st = ddp_dump_open(t->a->dump_dir, t->rank, t->world, &o, &t->dump, t->err);
  ddp__free(config);
  ddp__free(model);
  DDP_CHECK(st);
  DDP_CHECK(dump_check(t, ddp_dump_init(t->dump, t->model, ddp__sync_reducer(t->sync))));
  if (t->a->dump_local_grads) ddp__sync_set_local_grad_fn(t->sync, ddp__train_dump_local, t->dump);
  if (t->zero) DDP_CHECK(ddp__train_zero_dump(t));
  return DDP_OK;
}

/* Everything before the first step: the model, optimizers, data and gradient sync
 * (setup), the checkpoint resumed from, the dump writer, rank 0's metrics file, and the
 * intervals of logging, evaluation and saving. */
static ddp_status_t begin(ddp__trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  if (ddp_env_is_set(DDP_ENV_TRAIN_SAVE_PAUSE_MS))
    DDP_CHECK(ddp_env_int(DDP_ENV_TRAIN_SAVE_PAUSE_MS, 0, 3600000, &t->pause_ms, t->err));
  DDP_CHECK(ddp__train_fault_init(&t->fault, t->rank, t->err));
  DDP_CHECK(ddp__train_agree(t));
  DDP_CHECK(ddp__trainer_setup(t));
  DDP_CHECK(ddp__train_fault_check(&t->fault, t->world, t->max_steps, t->err));
  DDP_CHECK(resume(t, &t->start));
  DDP_CHECK(ddp__sync_begin(t->sync, t->err));
  DDP_CHECK(ddp__train_fsdp_setup(t));  /* ZeRO-3 shards the broadcast parameters */
  DDP_CHECK(ddp__train_fsdp_resume(t)); /* ... and takes the checkpoint's state */
  DDP_CHECK(resume_hook_state(t));
  DDP_CHECK(open_init_q(t));
  t->res->start_step = t->start;
  if (a->dump_dir[0]) DDP_CHECK(open_dump(t));
  if (t->rank == 0) {
    DDP_CHECK(ddp__mkdirs(a->output_dir, t->rank, "", t->err)); /* "mkdir(DIR): ..." */
    DDP_CHECK(ddp__metrics_open(a->output_dir, t->start, &t->metrics, t->err));
  }
  t->log_every = interval(a->logging_steps, t->max_steps);
  t->save_every = interval(a->save_steps, t->max_steps);
  t->eval_every = !strcmp(a->eval_strategy, "steps")
                      ? (a->eval_steps > 0 ? interval(a->eval_steps, t->max_steps) : t->log_every)
                      : 0;
  t->eval_epoch = !strcmp(a->eval_strategy, "epoch");
  t->save_steps = !strcmp(a->save_strategy, "steps");
  t->save_epoch = !strcmp(a->save_strategy, "epoch");
  t->samples_per_step = (double)t->world * (double)a->per_device_train_batch_size *
                        (double)a->gradient_accumulation_steps;
  t->t_start = ddp_now_ns();
  return DDP_OK;
}

/* What one optimizer step leaves for the end of the step. */
typedef struct step_out {
  int64_t t0;       /* when the step began (ns) */
  int64_t comm;     /* ns in gradient communication */
  double loss;      /* the step's loss, averaged over ranks */
  double grad_norm; /* before clipping */
  double lr;
  double bytes[5]; /* parameter, gradient, optimizer-state bytes after the step; ZeRO-3's
                    * gathered peak; bytes sent up to the optimizer step (-1: no recorder) */
} step_out_t;

/* Micro-batch k of step `step`: forward (synchronising only the last of the window, as HF
 * runs the others under no_sync) and backward of loss / GA; adds loss / GA to *loss. */
static ddp_status_t micro_step(ddp__trainer_t *t, int64_t step, int64_t k, double *loss,
                               int64_t *comm) {
  const int64_t GA = t->a->gradient_accumulation_steps;
  ddp_batch_t b;
  bool has = false;
  DDP_CHECK(ddp_loader_next(t->loader, &b, &has, t->err));
  if (!has) return ddp__error(t->err, t->rank, DDP_ERR_INTERNAL, "trainer: loader ran dry");
  t->loader_pos++;
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_input(t->dump, &b.features, &b.labels, b.indices)));
  ddp_ctx_set_rng(t->ctx, t->a->seed, (uint32_t)t->rank, (uint64_t)(step * GA + k));
  /* ZeRO-2 reduces the accumulated local gradients itself, from the last micro-batch's
   * backward on (zero.c) */
  bool zero2 = t->zero && ddp_zero_stage(t->zero) == 2;
  if (zero2) ddp_zero_set_sync(t->zero, k == GA - 1);
  DDP_CHECK(ddp__sync_pre_forward(t->sync, t->ctx, k == GA - 1 && !zero2 && !t->fsdp, t->err));
  /* ZeRO-3: the root unit gathered; its backward reduces on the window's last micro-batch */
  if (t->fsdp) DDP_CHECK(ddp_fsdp_begin(t->fsdp, true, k == GA - 1, t->err));
  ddp_var_t *y, *l;
  DDP_CHECK(forward(t, &b, &y));
  DDP_CHECK(ddp__sync_post_forward(t->sync, t->ctx, y, t->err));
  DDP_CHECK(compute_loss(t, y, &b, &l));
  *loss += scalar_value(l) / (double)GA;
  if (!ddp__train_fault_skips(&t->fault, step, k)) {
    DDP_CHECK(ddp__sync_backward(t->sync, t->ctx, l, GA > 1 ? &t->seed_grad : NULL, comm, t->err));
  }
  if (t->fsdp) DDP_CHECK(ddp_fsdp_end(t->fsdp, t->err));
  ddp_ctx_reset(t->ctx);
  return DDP_OK;
}

/* world_size_invariant_shards: the dropout stream of a shard is keyed by its global index
 * in the run, never by the rank that computes it. */
#define INV_RNG_STREAM UINT32_MAX

/* Invariant mode: shard q of micro-batch k of step `step`, global shard j = (k W + rank)
 * Sm + q of the step (setup.c): its samples from the global order, its dropout from j,
 * forward (synchronising only the step's last shard on this rank), the loss (the shard's
 * mean, unscaled: the reducer divides the sum of the K shard gradients by K), backward. */
static ddp_status_t shard_step(ddp__trainer_t *t, int64_t step, int64_t k, int64_t q,
                               int64_t *comm) {
  const int64_t GA = t->a->gradient_accumulation_steps;
  const int64_t j = (k * t->world + t->rank) * t->inv_sm + q;
  DDP_CHECK(ddp_loader_seek(t->loader, step / t->steps_per_epoch,
                            (step % t->steps_per_epoch) * t->inv_k + j, t->err));
  ddp_batch_t b;
  bool has = false;
  DDP_CHECK(ddp_loader_next(t->loader, &b, &has, t->err));
  if (!has) return ddp__error(t->err, t->rank, DDP_ERR_INTERNAL, "trainer: loader ran dry");
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_input(t->dump, &b.features, &b.labels, b.indices)));
  ddp_ctx_set_rng(t->ctx, t->a->seed, INV_RNG_STREAM, (uint64_t)(step * t->inv_k + j));
  DDP_CHECK(ddp__sync_pre_forward(t->sync, t->ctx, k == GA - 1 && q == t->inv_sm - 1, t->err));
  ddp_var_t *y, *l;
  DDP_CHECK(forward(t, &b, &y));
  DDP_CHECK(ddp__sync_post_forward(t->sync, t->ctx, y, t->err));
  DDP_CHECK(compute_loss(t, y, &b, &l));
  t->inv_loss[j] = scalar_value(l);
  if (!ddp__train_fault_skips(&t->fault, step, k))
    DDP_CHECK(ddp__sync_backward(t->sync, t->ctx, l, NULL, comm, t->err));
  ddp_ctx_reset(t->ctx);
  return DDP_OK;
}

/* Invariant mode: the step's loss, the mean of the K shard losses summed in shard order
 * (each slot is filled by the one rank that ran the shard: adding zeros is exact). */
static ddp_status_t invariant_loss(ddp__trainer_t *t, double *loss) {
  ddp_work_t *w = NULL;
  DDP_CHECK(coll_wait(t,
                      ddp_allreduce(t->pg, t->inv_loss, t->inv_loss, (size_t)t->inv_k, DDP_F64,
                                    DDP_OP_SUM, &w),
                      &w, "loss allreduce"));
  double s = 0;
  for (int64_t j = 0; j < t->inv_k; j++) s += t->inv_loss[j];
  *loss = s / (double)t->inv_k;
  memset(t->inv_loss, 0, (size_t)t->inv_k * sizeof *t->inv_loss);
  return DDP_OK;
}

/* Optimizer step `step` (0-based): its window of micro-batches, then clipping, the lr of
 * the schedule, the optimizer step and zero_grad; the loss is averaged over ranks. */
static ddp_status_t train_step(ddp__trainer_t *t, int64_t step, step_out_t *o) {
  const ddp_train_args_t *a = t->a;
  const int64_t GA = a->gradient_accumulation_steps;
  *o = (step_out_t){.t0 = ddp_now_ns()};
  double sent0 = ddp_pg_bytes_sent(t->pg);
  int64_t epoch = step / t->steps_per_epoch;
  if (!t->inv_k) DDP_CHECK(seek_loader(t, epoch, (step % t->steps_per_epoch) * GA));
  ddp__train_forward_flags_at(a->forward_flags, t->rank, step, &t->flags); /* validated */
  DDP_CHECK(ddp__train_fault_step(&t->fault, t->pg, step, t->err));
  /* --zero_comm_hook: the update runs in the last micro-batch's backward, at this lr */
  if (t->zovl) ddp_zero_overlap_set_lr(t->zovl, ddp_lr_at(&t->sched, a->learning_rate, step));
  double local_loss = 0;
  for (int64_t k = 0; k < GA; k++) {
    if (!t->inv_k) {
      DDP_CHECK(micro_step(t, step, k, &local_loss, &o->comm));
      continue;
    }
    for (int64_t q = 0; q < t->inv_sm; q++) DDP_CHECK(shard_step(t, step, k, q, &o->comm));
  }
  ddp__train_fault_after_backward(&t->fault, t->model, step);
  if (t->init_q) DDP_CHECK(ddp__train_q_check(t->init_q, t->err));
  if (t->zero) DDP_CHECK(ddp_zero_reduce_grads(t->zero, t->err));
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_grads(t->dump)));
  int64_t elem = -1;
  size_t bad = ddp__train_first_nonfinite_grad(t, &elem);
  double max_norm = a->max_grad_norm > 0 ? a->max_grad_norm : INFINITY;
  if (t->zero)
    DDP_CHECK(ddp_zero_clip_grad_norm(t->zero, max_norm, &o->grad_norm, t->err));
  else if (t->fsdp)
    DDP_CHECK(ddp_fsdp_clip_grad_norm(t->fsdp, max_norm, &o->grad_norm, t->err));
  else
    DDP_CHECK(ddp_clip_grad_norm(t->grads, t->ntrain, max_norm, 2.0, false, &o->grad_norm, t->err));
  if (!isfinite(o->grad_norm) || bad != SIZE_MAX)
    DDP_CHECK(ddp__train_nonfinite(t, step + 1, "gradient norm", o->grad_norm, bad, elem));
  o->lr = ddp_lr_at(&t->sched, a->learning_rate, step);
  if (t->zero) {
    DDP_CHECK(ddp_zero_step(t->zero, o->lr, t->err));
    ddp__train_own_bytes(t, o->bytes);
    ddp_zero_zero_grad(t->zero, a->zero_grad_set_to_none);
  }
  if (t->fsdp) {
    DDP_CHECK(ddp_fsdp_step(t->fsdp, o->lr, t->err));
    ddp__train_own_bytes(t, o->bytes);
    ddp_fsdp_zero_grad(t->fsdp);
  }
  if (t->zovl) ddp__train_own_bytes(t, o->bytes); /* stepped inside the backward */
  for (size_t g = 0; !t->zero && !t->fsdp && !t->zovl && g < t->nopt; g++) {
    ddp_optim_set_lr(t->opt[g], o->lr);
    DDP_CHECK(ddp_optim_step(t->opt[g], t->err));
    if (g == t->nopt - 1) ddp__train_own_bytes(t, o->bytes);
  }
  for (size_t g = 0; !t->zero && !t->fsdp && g < t->nopt; g++)
    ddp_optim_zero_grad(t->opt[g], a->zero_grad_set_to_none);
  o->bytes[4] = sent0 >= 0 ? ddp_pg_bytes_sent(t->pg) - sent0 : -1;
  if (t->inv_k) DDP_CHECK(invariant_loss(t, &local_loss)); /* the step's loss, every rank */
  if (t->dump) {
    int micro = (int)(t->inv_k ? GA * t->inv_sm : GA);
    DDP_CHECK(dump_check(t, ddp_dump_step(t->dump, step - t->start, local_loss, micro, t->flags)));
  }
  if (!t->inv_k) {
    ddp_work_t *w = NULL;
    DDP_CHECK(coll_wait(t,
                        ddp_allreduce(t->pg, &local_loss, &local_loss, 1, DDP_F64, DDP_OP_AVG, &w),
                        &w, "loss allreduce"));
  }
  o->loss = local_loss;
  if (!isfinite(o->loss))
    DDP_CHECK(ddp__train_nonfinite(t, step + 1, "loss", o->loss, SIZE_MAX, -1));
  return DDP_OK;
}

/* The replica check and parameter hash; ZeRO-3 gathers every unit for it first. */
static ddp_status_t replica_check(ddp__trainer_t *t, int64_t step, uint64_t *h) {
  if (t->fsdp) DDP_CHECK(ddp_fsdp_gather_all(t->fsdp, t->err));
  ddp_status_t st = ddp__train_replica_check(t->pg, t->model, step, h, t->err);
  if (t->fsdp) ddp_fsdp_free_all(t->fsdp);
  return st;
}

/* A logging step: the replica check, the window's means as a metrics.jsonl line and rank
 * 0's LOG event; the window starts again. */
static ddp_status_t log_window(ddp__trainer_t *t, int64_t done, const step_out_t *o, double eta) {
  double n = (double)t->win_n;
  double mean_loss = t->win_loss / n;
  double sps = t->win_time > 0 ? t->samples_per_step * n / t->win_time : 0;
  uint64_t h = 0;
  int64_t comm_bytes = 0;
  double comm_rate = 1.0;
  ddp__sync_comm_stats(t->sync, &comm_bytes, &comm_rate);
  DDP_CHECK(replica_check(t, done, &h));
  t->res->replica_checks++;
  if (t->metrics) {
    ddp__json_t j;
    metrics_begin(t, &j, done);
    ddp__json_num(&j, "loss", G9, mean_loss);
    ddp__json_num(&j, "grad_norm", G9, o->grad_norm);
    ddp__json_num(&j, "lr", G9, o->lr);
    ddp__json_num(&j, "step_time_ms", G9, t->win_time / n * 1e3);
    ddp__json_num(&j, "comm_time_ms", G9, t->win_comm / n * 1e3);
    ddp__json_num(&j, "overlap_ms", "%.4f", ddp__sync_overlap_ns(t->sync) * 1e-6);
    ddp__json_int(&j, "comm_bytes", comm_bytes);
    ddp__json_num(&j, "compression_rate", "%.4f", comm_rate);
    ddp__json_num(&j, "samples_per_s", G9, sps);
    param_hash_member(&j, h);
    DDP_CHECK(ddp__train_state_bytes(t, o->bytes, &j));
    ddp__json_end(&j);
    DDP_CHECK(ddp__metrics_line(t->metrics, &j, t->err));
  } else if (t->world > 1) {
    DDP_CHECK(ddp__train_state_bytes(t, o->bytes, NULL)); /* collective */
  }
  if (t->ev) {
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_LOG,
                           .step = done,
                           .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done),
                           .loss = mean_loss,
                           .grad_norm = o->grad_norm,
                           .lr = o->lr,
                           .step_time_s = t->win_time / n,
                           .comm_time_s = t->win_comm / n,
                           .samples_per_s = sps,
                           .eta_s = eta};
    t->ev(t->user, &e);
  }
  t->win_loss = t->win_time = t->win_comm = 0;
  t->win_n = 0;
  return DDP_OK;
}

/* After step `done` - 1: the results, the logging window, rank 0's STEP event, and the
 * log line when it is due (every logging_steps and at the last step). */
static ddp_status_t end_of_step(ddp__trainer_t *t, int64_t done, const step_out_t *o) {
  double dt = (double)(ddp_now_ns() - o->t0) * 1e-9;
  t->comm_total += o->comm;
  if (isnan(t->res->first_loss)) t->res->first_loss = o->loss;
  t->res->last_loss = o->loss;
  t->win_loss += o->loss;
  t->win_time += dt;
  t->win_comm += (double)o->comm * 1e-9;
  t->win_n++;
  double elapsed = (double)(ddp_now_ns() - t->t_start) * 1e-9;
  double rate = elapsed > 0 ? (double)(done - t->start) / elapsed : 0;
  double eta = rate > 0 ? (double)(t->max_steps - done) / rate : 0;
  if (t->ev) {
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_STEP,
                           .step = done,
                           .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done),
                           .loss = o->loss,
                           .grad_norm = o->grad_norm,
                           .lr = o->lr,
                           .step_time_s = dt,
                           .comm_time_s = (double)o->comm * 1e-9,
                           .samples_per_s = rate * t->samples_per_step,
                           .eta_s = eta};
    t->ev(t->user, &e);
  }
  if (every(done, t->log_every) || done == t->max_steps) return log_window(t, done, o, eta);
  return DDP_OK;
}

/* An evaluation after step `done` - 1: its metrics.jsonl line (perplexity for a causal
 * LM, run_clm's exp(eval_loss)) and rank 0's EVAL event. */
static ddp_status_t eval_step(ddp__trainer_t *t, int64_t done) {
  double el, ea;
  DDP_CHECK(evaluate(t, &el, &ea));
  t->res->eval_loss = el;
  t->res->eval_accuracy = ea;
  if (t->metrics) {
    ddp__json_t j;
    metrics_begin(t, &j, done);
    ddp__json_num(&j, "eval_loss", G9, el);
    ddp__json_num(&j, "eval_accuracy", G9, ea);
    if (t->task == DDP_TASK_CAUSAL_LM) ddp__json_num(&j, "perplexity", G9, exp(el));
    ddp__json_end(&j);
    DDP_CHECK(ddp__metrics_line(t->metrics, &j, t->err));
  }
  if (t->ev) {
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_EVAL,
                           .step = done,
                           .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done),
                           .eval_loss = el,
                           .eval_accuracy = ea};
    t->ev(t->user, &e);
  }
  return DDP_OK;
}

/* After the last step: the PowerSGD draws and the dump closed, the results, the final
 * replica check, rank 0's summary line and loss curve. */
static ddp_status_t finish(ddp__trainer_t *t) {
  ddp_train_result_t *r = t->res;
  if (t->init_q) {
    DDP_CHECK(
        ddp__train_q_finish(t->init_q, ddp_powersgd_draws(ddp__sync_powersgd(t->sync)), t->err));
  }
  /* the overlapped ZeRO-1's partition exists once its warm-up is over */
  if (t->dump && t->zovl) DDP_CHECK(ddp__train_zero_dump(t));
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_finish(t->dump)));
  r->steps = t->max_steps;
  r->seconds = (double)(ddp_now_ns() - t->t_start) * 1e-9;
  r->samples_per_s = r->seconds > 0
                         ? t->samples_per_step * (double)(t->max_steps - t->start) / r->seconds
                         : 0;
  r->comm_seconds = (double)t->comm_total * 1e-9;
  if (t->fsdp) { /* the full model back in its own storage, for the caller's save */
    DDP_CHECK(ddp_fsdp_unshard(t->fsdp, t->err));
    ddp_fsdp_destroy(t->fsdp);
    t->fsdp = NULL;
  }
  DDP_CHECK(replica_check(t, t->max_steps, &r->param_hash));
  r->replica_checks++;
  if (!t->metrics) return DDP_OK;
  ddp__json_t j;
  ddp__json_begin(&j);
  ddp__json_bool(&j, "summary", true);
  ddp__json_int(&j, "steps", r->steps);
  ddp__json_int(&j, "start_step", t->start);
  ddp__json_int(&j, "world_size", t->world);
  ddp__json_num(&j, "first_loss", G9, r->first_loss);
  ddp__json_num(&j, "last_loss", G9, r->last_loss);
  ddp__json_num(&j, "eval_loss", G9, r->eval_loss);
  ddp__json_num(&j, "eval_accuracy", G9, r->eval_accuracy);
  ddp__json_num(&j, "seconds", "%.3f", r->seconds);
  ddp__json_num(&j, "samples_per_s", "%.1f", r->samples_per_s);
  ddp__json_num(&j, "comm_seconds", "%.3f", r->comm_seconds);
  ddp__json_int(&j, "replica_checks", r->replica_checks);
  param_hash_member(&j, r->param_hash);
  ddp__json_str(&j, "sync", ddp__sync_name(t->sync));
  if (t->task == DDP_TASK_CAUSAL_LM) ddp__json_num(&j, "perplexity", G9, exp(r->eval_loss));
  ddp__json_end(&j);
  ddp_status_t st = ddp__metrics_line(t->metrics, &j, t->err);
  if (st == DDP_OK) st = ddp__metrics_close(t->metrics, t->err);
  t->metrics = NULL;
  DDP_CHECK(st);
  char mp[DDP_TRAIN_STR_MAX + 32], sp[DDP_TRAIN_STR_MAX + 32];
  snprintf(mp, sizeof mp, "%s/metrics.jsonl", t->a->output_dir);
  snprintf(sp, sizeof sp, "%s/loss.svg", t->a->output_dir);
  return ddp_train_plot_svg(mp, sp, t->err);
}

static void teardown(ddp__trainer_t *t, ddp_status_t st) {
  ddp__train_fault_end(&t->fault, st, t->err->msg);
  ddp__metrics_close(t->metrics, NULL);
  ddp_dump_close(t->dump);
  ddp__sync_destroy(t->sync);
  ddp__train_q_close(t->init_q);
  ddp_tensor_free(&t->seed_grad);
  for (size_t g = 0; g < t->nopt; g++) ddp_optim_destroy(t->opt[g]);
  ddp_zero_destroy(t->zero);
  ddp_zero_overlap_destroy(t->zovl); /* after the reducer that called it */
  ddp_fsdp_destroy(t->fsdp);
  ddp_loader_destroy(t->loader);
  ddp_sampler_destroy(t->sampler);
  ddp_ctx_destroy(t->ctx);
  ddp__free(t->pairs);
  ddp__free(t->grads);
  ddp__free(t->inv_loss);
  ddp__train_unlock(t);
}

/* The loop in named steps: begin; per optimizer step the step, the end of the step (the
 * log line when due), an evaluation and a save when due; finish. */
ddp_status_t ddp__train_run(ddp_pg_t *pg, ddp_model_t *model, const ddp_dataset_t *train,
                            const ddp_dataset_t *eval, const ddp_train_args_t *args,
                            ddp_train_event_fn ev, void *user, ddp_train_result_t *result,
                            ddp_error_t *err) {
  DDP_REQUIRE(pg && model && train && args && result);
  ddp_error_t local = {0};
  ddp__trainer_t *t = ddp__calloc(1, sizeof *t);
  if (!t) return ddp__error(err, ddp_pg_rank(pg), DDP_ERR_NO_MEMORY, "trainer: no memory");
  t->pg = pg;
  t->rank = ddp_pg_rank(pg);
  t->world = ddp_pg_size(pg);
  t->model = model;
  t->lock_fd = -1;
  t->train = train;
  t->eval = eval;
  t->args = (ddp_train_args_t)DDP_TRAIN_ARGS_INIT;
  ddp__opts_read(&t->args, sizeof t->args, args);
  t->a = &t->args;
  t->ev = t->rank == 0 ? ev : NULL;
  t->user = user;
  t->res = result;
  t->err = err ? err : &local;
  memset(result, 0, sizeof *result);
  result->eval_loss = result->eval_accuracy = NAN;
  result->first_loss = result->last_loss = NAN;

  ddp_status_t st = ddp_train_args_validate(t->a, t->err);
  if (st != DDP_OK) {
    ddp__free(t);
    return st;
  }
  st = begin(t);
  for (int64_t step = t->start; st == DDP_OK && step < t->max_steps; step++) {
    const int64_t done = step + 1;
    const bool epoch_end = done % t->steps_per_epoch == 0;
    step_out_t o;
    st = train_step(t, step, &o);
    if (st == DDP_OK) st = end_of_step(t, done, &o);
    if (st == DDP_OK && t->eval && (every(done, t->eval_every) || (t->eval_epoch && epoch_end)))
      st = eval_step(t, done);
    /* HF saves every save_steps and, with the steps strategy, at the last step. */
    if (st == DDP_OK && ((t->save_steps && (every(done, t->save_every) || done == t->max_steps)) ||
                         (t->save_epoch && epoch_end)))
      st = save(t, done);
  }
  if (st == DDP_OK) st = finish(t);
  teardown(t, st);
  ddp__free(t);
  return st;
}
