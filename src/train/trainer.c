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
 * loss over ranks for logging. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "ddp/reducer.h"
#include "ddp_config.h"
#include "train/faults.h"
#include "train/sync.h"
#include "train/train_internal.h"

typedef struct trainer {
  ddp_pg_t *pg;
  int rank, world;
  ddp_model_t *model;
  const ddp_dataset_t *train, *eval;
  ddp_train_args_t args;  /* the caller's, read by ddp__opts_read */
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
  ddp_tensor_t **grads;   /* for clipping */
  size_t ntrain;          /* parameters that require grad */
  ddp__sync_t *sync;
  char resume_dir[DDP_TRAIN_STR_MAX]; /* the checkpoint being resumed, "" when none */
  ddp_dump_t *dump;       /* --dump_dir (the reducer layer's dump writer); NULL when off */
  ddp__metrics_t *metrics; /* rank 0 (metrics.c) */
  bool classify;          /* integer class labels: cross-entropy; else MSE */
  ddp_model_task_t task;  /* DDP_TASK_CAUSAL_LM: ddp_causal_lm_loss (lm.c) */
  ddp_tensor_t seed_grad; /* backward seed 1/GA, scalar of the loss dtype */
  int64_t steps_per_epoch, max_steps, loader_epoch, loader_pos;
  ddp_lr_schedule_t sched;
  uint64_t flags;         /* this rank's forward_flags entry */
  ddp__train_q_t *init_q; /* power_sgd_init_q; NULL when off */
  ddp__train_fault_t fault; /* DDP_FAULT (faults.h) */

  /* the run (begin, the steps, finish) */
  int64_t start;          /* the step resumed from; 0 for a fresh run */
  int64_t pause_ms;       /* DDP_TRAIN_SAVE_PAUSE_MS: sleeps between checkpoint files */
  int64_t log_every, save_every, eval_every; /* in steps; 0: never */
  bool eval_epoch, save_steps, save_epoch;   /* the strategies */
  double samples_per_step; /* global samples per optimizer step */
  int64_t t_start, comm_total; /* ns */
  double win_loss, win_time, win_comm; /* the logging window's sums ... */
  int64_t win_n;                       /* ... over win_n steps */
} trainer_t;

/* w is read only after st's call has run (hence the pointer: argument order is unspecified). */
static ddp_status_t coll_wait(trainer_t *t, ddp_status_t st, ddp_work_t **w, const char *what) {
  if (st == DDP_OK) st = ddp_work_wait_free(*w);
  if (st != DDP_OK) { /* logged by the group where it started; context added here */
    return ddp__error_quiet(t->err, st, "trainer: %s: %s", what, ddp_pg_last_error(t->pg));
  }
  return DDP_OK;
}

/* Positions the loader at micro-batch `pos` of `epoch`. */
static ddp_status_t seek_loader(trainer_t *t, int64_t epoch, int64_t pos) {
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
static ddp_status_t op_error(trainer_t *t, ddp_status_t st, const char *what) {
  if (st == DDP_OK) return st;
  return ddp__error_quiet(t->err, st, "trainer: %s: %s", what, ddp_ctx_last_error(t->ctx)->msg);
}

/* loss = CE(logits, labels) or MSE(out, labels reshaped to out's shape). */
static ddp_status_t compute_loss(trainer_t *t, ddp_var_t *out, const ddp_batch_t *b,
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
                      "have %lld", (long long)out->value.numel, (long long)b->labels.numel);
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

static ddp_status_t forward(trainer_t *t, const ddp_batch_t *b, ddp_var_t **out) {
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
static ddp_status_t evaluate(trainer_t *t, double *loss, double *acc) {
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

/* HF's Trainer.create_optimizer: weight_decay applies to get_decay_parameter_names (every
 * parameter outside LayerNorm modules whose name does not contain "bias"), 0 to the
 * others; group 0 holds the decayed parameters, group 1 the rest, each in model order.
 * With weight_decay 0, or when one group would be empty, a single group in model order
 * (the same arithmetic, and the same optimizer state names, as before grouping). Fills
 * t->pairs, t->grads, t->ntrain and t->opt. */
static ddp_status_t setup_optimizers(trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  size_t np = ddp_model_num_params(t->model);
  t->pairs = ddp__calloc(np ? np : 1, sizeof *t->pairs);
  t->grads = ddp__calloc(np ? np : 1, sizeof *t->grads);
  bool *decay = ddp__calloc(np ? np : 1, sizeof *decay);
  if (!t->pairs || !t->grads || !decay) {
    ddp__free(decay);
    return DDP_ERR_NO_MEMORY;
  }
  size_t ndecay = 0;
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(t->model, i);
    if (!p->requires_grad) continue;
    decay[i] = !strcmp(a->weight_decay_grouping, "all") ||
               (!strstr(p->name, "bias") && !ddp_model_param_in_layer_norm(t->model, i));
    ndecay += decay[i];
    t->grads[t->ntrain++] = &p->grad;
  }
  if (t->ntrain == 0) {
    ddp__free(decay);
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: the model has no trainable parameter");
  }
  bool grouped = a->weight_decay > 0 && ndecay > 0 && ndecay < t->ntrain;
  size_t group_size[DDP__TRAIN_MAX_GROUPS] = {t->ntrain, 0};
  if (grouped) {
    group_size[0] = ndecay;
    group_size[1] = t->ntrain - ndecay;
  }
  for (int g = 0, k = 0; g < (grouped ? 2 : 1); g++) {
    for (size_t i = 0; i < np; i++) {
      ddp_param_t *p = ddp_model_param(t->model, i);
      if (!p->requires_grad || (grouped && decay[i] != (g == 0))) continue;
      t->pairs[k].param = &p->value;
      t->pairs[k].grad = &p->grad;
      k++;
    }
  }
  ddp__free(decay);
  ddp_optim_options_t oo;
  if (!strcmp(a->optim, "sgd")) {
    oo = (ddp_optim_options_t)DDP_SGD_OPTIONS_INIT;
  } else if (!strcmp(a->optim, "adam")) {
    oo = (ddp_optim_options_t)DDP_ADAM_OPTIONS_INIT;
  } else {
    oo = (ddp_optim_options_t)DDP_ADAMW_OPTIONS_INIT;
  }
  oo.lr = a->learning_rate;
  oo.beta1 = a->adam_beta1;
  oo.beta2 = a->adam_beta2;
  oo.eps = a->adam_epsilon;
  DDP_CHECK(ddp__train_optim_args(a, &oo, t->err));
  ddp__train_forward_flags(a->forward_flags, t->rank, &t->flags); /* validated */
  t->nopt = grouped ? 2 : 1;
  for (size_t g = 0, off = 0; g < t->nopt; g++) {
    oo.weight_decay = g == 0 && ndecay > 0 ? a->weight_decay : 0.0;
    DDP_CHECK(ddp_optim_create(&oo, t->pairs + off, group_size[g], &t->opt[g], t->err));
    off += group_size[g];
  }
  return DDP_OK;
}

/* DistributedSampler and the loader of this rank's shard, and the step counts: HF's
 * steps per epoch (full accumulation windows) and max_steps. */
static ddp_status_t setup_data(trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
  so.dataset_len = ddp_dataset_length(t->train);
  so.num_replicas = t->world;
  so.rank = t->rank;
  so.seed = a->data_seed >= 0 ? (uint64_t)a->data_seed : a->seed; /* HF's data_seed */
  so.shuffle = a->dataloader_shuffle;
  DDP_CHECK(ddp_sampler_create(&so, &t->sampler, t->err));
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = a->per_device_train_batch_size;
  lo.drop_last = a->dataloader_drop_last;
  DDP_CHECK(ddp_loader_create(t->train, t->sampler, &lo, &t->loader, t->err));
  t->loader_epoch = -1;

  int64_t nb = ddp_loader_num_batches(t->loader);
  t->steps_per_epoch = nb / a->gradient_accumulation_steps;
  if (t->steps_per_epoch < 1) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: an epoch has %lld micro-batches per rank (%lld samples, %d "
                      "ranks, batch %lld), fewer than gradient_accumulation_steps %lld",
                      (long long)nb, (long long)so.dataset_len, t->world,
                      (long long)lo.batch_size, (long long)a->gradient_accumulation_steps);
  }
  t->max_steps = a->max_steps > 0
                     ? a->max_steps
                     : (int64_t)ceil(a->num_train_epochs * (double)t->steps_per_epoch);
  if (t->max_steps < 1) t->max_steps = 1;
  return DDP_OK;
}

static ddp_status_t setup(trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  const ddp_sample_spec_t *sp = ddp_dataset_spec(t->train);
  t->classify = (sp->label_dtype == DDP_I64 || sp->label_dtype == DDP_I32) && sp->label_ndim == 0;
  t->task = ddp_model_task(t->model);
  if (sp->label_dtype == DDP_I32) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: class labels must be i64 (torch's long), the dataset has i32");
  }
  DDP_CHECK(ddp_ctx_create(&t->ctx));
  DDP_CHECK(setup_optimizers(t));
  DDP_CHECK(setup_data(t));

  ddp_lr_kind_t kind;
  DDP_CHECK(ddp_lr_kind_from_name(a->lr_scheduler_type, &kind, t->err));
  t->sched = (ddp_lr_schedule_t)DDP_LR_SCHEDULE_INIT;
  t->sched.kind = kind;
  t->sched.num_training_steps = t->max_steps;
  t->sched.num_warmup_steps = a->warmup_steps > 0
                                  ? a->warmup_steps
                                  : (int64_t)ceil((double)t->max_steps * a->warmup_ratio);
  DDP_CHECK(ddp_lr_schedule_check(&t->sched, t->err));

  ddp_dtype_t ldt = ddp_model_flat_params(t->model, DDP_F32).numel ? DDP_F32 : DDP_F64;
  DDP_CHECK(ddp_tensor_alloc(&t->seed_grad, ldt, 0, NULL));
  double inv = 1.0 / (double)a->gradient_accumulation_steps;
  if (ldt == DDP_F32) {
    *(float *)t->seed_grad.data = (float)inv;
  } else {
    *(double *)t->seed_grad.data = inv;
  }
  DDP_CHECK(ddp__sync_create(t->pg, t->model, a, a->ddp_reducer, &t->sync, t->err));
  ddp_model_set_grads_none(t->model); /* a fresh PyTorch module's gradients are None */
  return DDP_OK;
}

/* The optimizer's parameter groups as JSON: [{"weight_decay": wd, "params": [names]}, ...]
 * (HF's optimizer_grouped_parameters, by state_dict name). */
static char *groups_json(trainer_t *t) {
  cJSON *arr = cJSON_CreateArray();
  size_t k = 0;
  for (size_t g = 0; arr && g < t->nopt; g++) {
    cJSON *o = cJSON_CreateObject(), *names = cJSON_CreateArray();
    cJSON_AddItemToArray(arr, o);
    cJSON_AddNumberToObject(o, "weight_decay", ddp_optim_options(t->opt[g])->weight_decay);
    cJSON_AddItemToObject(o, "params", names);
    for (size_t i = 0; i < ddp_optim_num_params(t->opt[g]); i++, k++) {
      for (size_t j = 0; j < ddp_model_num_params(t->model); j++) {
        ddp_param_t *p = ddp_model_param(t->model, j);
        if (&p->value == t->pairs[k].param)
          cJSON_AddItemToArray(names, cJSON_CreateString(p->name));
      }
    }
  }
  char *s = arr ? cJSON_PrintUnformatted(arr) : NULL;
  cJSON_Delete(arr);
  return s;
}

/* The trainer_state.json of a checkpoint at `step` (ddp__free). */
static ddp_status_t state_json(trainer_t *t, int64_t step, char **out) {
  const ddp_train_args_t *a = t->a;
  const int64_t GA = a->gradient_accumulation_steps;
  *out = NULL;
  char *args = NULL;
  DDP_CHECK(ddp_train_args_to_json(a, &args));
  char *groups = groups_json(t);
  ddp__json_t j;
  ddp__json_begin(&j);
  ddp__json_int(&j, "global_step", step);
  ddp__json_int(&j, "max_steps", t->max_steps);
  ddp__json_num(&j, "epoch", "%.6f", (double)step / (double)t->steps_per_epoch);
  ddp__json_int(&j, "world_size", t->world);
  ddp__json_int(&j, "steps_per_epoch", t->steps_per_epoch);
  ddp__json_object(&j, "sampler");
  ddp__json_str(&j, "kind", "DistributedSampler");
  ddp__json_uint(&j, "seed", a->seed);
  ddp__json_int(&j, "epoch", step / t->steps_per_epoch);
  ddp__json_int(&j, "batches_consumed", (step % t->steps_per_epoch) * GA);
  ddp__json_int(&j, "batch_size", a->per_device_train_batch_size);
  ddp__json_end(&j);
  ddp__json_object(&j, "rng");
  ddp__json_str(&j, "generator", "philox4x32-10");
  ddp__json_uint(&j, "seed", a->seed);
  ddp__json_int(&j, "dropout_next_step", step * GA);
  ddp__json_end(&j);
  ddp__json_str(&j, "sync", ddp__sync_name(t->sync));
  ddp__json_raw(&j, "optimizer_groups", groups ? groups : "null");
  ddp__json_raw(&j, "args", args);
  ddp__json_end(&j);
  ddp__json_append(&j, "\n");
  ddp_free(args);
  if (groups) {
    cJSON_free(groups);
    *out = ddp__json_take(&j);
  } else {
    ddp__json_free(&j);
  }
  return *out ? DDP_OK : DDP_ERR_NO_MEMORY;
}

/* Every rank writes its PowerSGD state (rank-local: the error feedback differs per rank)
 * into the staged checkpoint directory; the statuses are all-gathered so that every rank
 * fails alike, naming the first rank that failed. */
static ddp_status_t save_hook_state(trainer_t *t, int64_t step) {
  ddp_powersgd_state_t *ps = ddp__sync_powersgd(t->sync);
  if (!ps) return DDP_OK;
  char tmp[DDP_TRAIN_STR_MAX + 64], file[DDP_TRAIN_STR_MAX + 128];
  snprintf(tmp, sizeof tmp, "%s/tmp-checkpoint-%lld", t->a->output_dir, (long long)step);
  ddp__train_hook_file(file, sizeof file, tmp, t->rank);
  int32_t mine = ddp_powersgd_state_save(ps, file, t->err);
  int32_t *all = ddp__calloc((size_t)t->world, sizeof *all);
  if (!all) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
  ddp_work_t *w = NULL;
  ddp_status_t st = coll_wait(t, ddp_allgather(t->pg, &mine, all, 1, DDP_I32, &w), &w,
                              "hook state status allgather");
  for (int r = 0; st == DDP_OK && r < t->world; r++) {
    if (all[r] == DDP_OK) continue;
    st = r == t->rank ? (ddp_status_t)all[r]
                      : ddp__error(t->err, t->rank, (ddp_status_t)all[r],
                                   "trainer: rank %d failed to save its PowerSGD state into "
                                   "checkpoint-%lld", r, (long long)step);
  }
  ddp__free(all);
  return st;
}

/* Rank 0 stages the checkpoint, every rank adds its comm hook state, rank 0 commits; the
 * statuses are broadcast so that every rank fails alike. */
static ddp_status_t save(trainer_t *t, int64_t step) {
  int32_t code = DDP_OK;
  char dir[DDP_TRAIN_STR_MAX] = "", tmp[DDP_TRAIN_STR_MAX + 64];
  if (t->rank == 0) {
    char *js = NULL;
    code = state_json(t, step, &js);
    if (code == DDP_OK) {
      code = ddp__train_save_stage(t->a->output_dir, step, t->model, t->opt, t->nopt, js,
                                   t->pause_ms, tmp, sizeof tmp, t->err);
    }
    ddp__free(js);
  }
  ddp_work_t *w = NULL;
  DDP_CHECK(coll_wait(t, ddp_broadcast(t->pg, &code, 1, DDP_I32, 0, &w), &w,
                      "checkpoint status broadcast"));
  if (code == DDP_OK) {
    DDP_CHECK(save_hook_state(t, step));
    if (t->rank == 0) {
      code = ddp__train_save_commit(t->a->output_dir, step, t->a->save_total_limit, dir,
                                    sizeof dir, t->err);
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
      ddp_train_event_t e = {.kind = DDP_TRAIN_EV_SAVE, .step = step, .max_steps = t->max_steps,
                             .epoch = (double)step / (double)t->steps_per_epoch,
                             .checkpoint = dir};
      t->ev(t->user, &e);
    }
  }
  return DDP_OK;
}

static ddp_status_t resume(trainer_t *t, int64_t *start) {
  char dir[DDP_TRAIN_STR_MAX];
  *start = 0;
  /* resume_from_checkpoint, or the newest verified checkpoint after a restart. */
  DDP_CHECK(ddp__train_resume_dir(t->a, t->rank, dir, sizeof dir, t->err));
  if (!dir[0]) return DDP_OK;
  int world = 0;
  int64_t step = 0;
  DDP_CHECK(ddp__train_read_state(dir, &step, &world, t->err));
  DDP_CHECK(ddp_train_checkpoint_load(dir, t->model, t->opt[0], NULL, t->err));
  for (size_t g = 1; g < t->nopt; g++) {
    char path[DDP_TRAIN_STR_MAX + 64];
    ddp__train_optim_file(path, sizeof path, dir, g);
    DDP_CHECK(ddp_optim_load(t->opt[g], path, t->err));
  }
  if (world != t->world) {
    ddp__log(t->rank, DDP_LOG_WARN,
             "resuming %s, written by %d ranks, with %d: the data order differs from an "
             "uninterrupted run", dir, world, t->world);
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

/* After the comm hook is registered: this rank's PowerSGD state from the checkpoint being
 * resumed. A checkpoint without one (written before hook states were saved, or by fewer
 * ranks) starts the state afresh with a warning: the run then differs from an
 * uninterrupted one. */
static ddp_status_t resume_hook_state(trainer_t *t) {
  ddp_powersgd_state_t *ps = ddp__sync_powersgd(t->sync);
  if (!ps || !t->resume_dir[0]) return DDP_OK;
  char file[DDP_TRAIN_STR_MAX + 64];
  ddp__train_hook_file(file, sizeof file, t->resume_dir, t->rank);
  if (access(file, F_OK) != 0) {
    ddp__log(t->rank, DDP_LOG_WARN,
             "resuming %s with comm_hook %s: %s is missing, so the PowerSGD state (error "
             "feedback, warm-start factors, iteration) starts afresh and the run differs from "
             "an uninterrupted one", t->resume_dir, t->a->comm_hook, file);
    return DDP_OK;
  }
  return ddp_powersgd_state_load(ps, file, t->err);
}

/* power_sgd_init_q: PyTorch's Q draws replace the generator of the PowerSGD state the hook
 * configuration made (validation has checked that comm_hook is a PowerSGD one). */
static ddp_status_t open_init_q(trainer_t *t) {
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

/* The "config" object of a dump's meta.json: the options under torch_reference.py's names
 * (docs/dumps.md), plus every training argument under "training_args" (ddp__free). */
static ddp_status_t dump_config(trainer_t *t, char **out) {
  const ddp_train_args_t *a = t->a;
  *out = NULL;
  char *args = NULL;
  DDP_CHECK(ddp_train_args_to_json(a, &args));
  const char *be = ddp_train_backend_name(a);
  ddp__json_t j;
  ddp__json_begin(&j);
  ddp__json_int(&j, "world", t->world);
  ddp__json_int(&j, "steps", t->max_steps);
  ddp__json_int(&j, "batch", a->per_device_train_batch_size);
  ddp__json_num(&j, "lr", "%.17g", a->learning_rate);
  ddp__json_str(&j, "optim", a->optim);
  ddp__json_str(&j, "lr_scheduler_type", a->lr_scheduler_type);
  ddp__json_int(&j, "warmup_steps", t->sched.num_warmup_steps);
  ddp__json_num(&j, "momentum", "%.17g", ddp_optim_options(t->opt[0])->momentum);
  ddp__json_num(&j, "weight_decay", "%.17g", a->weight_decay);
  ddp__json_num(&j, "adam_beta1", "%.17g", a->adam_beta1);
  ddp__json_num(&j, "adam_beta2", "%.17g", a->adam_beta2);
  ddp__json_num(&j, "adam_epsilon", "%.17g", a->adam_epsilon);
  ddp__json_num(&j, "max_grad_norm", "%.17g", a->max_grad_norm > 0 ? a->max_grad_norm : 0.0);
  ddp__json_uint(&j, "seed", a->seed);
  ddp__json_str(&j, "loss", t->task == DDP_TASK_CAUSAL_LM ? "causal_lm" : t->classify ? "ce"
                                                                                      : "mse");
  ddp__json_bool(&j, "shuffle", a->dataloader_shuffle);
  ddp__json_uint(&j, "data_seed", a->data_seed >= 0 ? (uint64_t)a->data_seed : a->seed);
  ddp__json_bool(&j, "zero_grad_set_to_none", a->zero_grad_set_to_none);
  ddp__json_str(&j, "weight_decay_grouping", a->weight_decay_grouping);
  ddp__json_bool(&j, "sampler_drop_last", false);
  ddp__json_bool(&j, "dataloader_drop_last", a->dataloader_drop_last);
  ddp__json_str(&j, "flags", a->forward_flags);
  /* unset (<= 0): null */
  ddp__json_num(&j, "bucket_cap_mb", "%.17g", a->ddp_bucket_cap_mb > 0 ? a->ddp_bucket_cap_mb
                                                                        : NAN);
  ddp__json_num(&j, "first_bucket_mb", "%.17g",
                a->ddp_first_bucket_mb > 0 ? a->ddp_first_bucket_mb : NAN);
  ddp__json_bool(&j, "find_unused_parameters", ddp_train_find_unused(a));
  ddp__json_bool(&j, "broadcast_buffers", ddp_train_broadcast_buffers(a));
  ddp__json_bool(&j, "static_graph", ddp_train_static_graph(a));
  ddp__json_bool(&j, "gradient_as_bucket_view", a->gradient_as_bucket_view);
  ddp__json_int(&j, "gradient_accumulation_steps", a->gradient_accumulation_steps);
  ddp__json_str(&j, "comm_hook", a->comm_hook);
  ddp__json_str(&j, "comm_wrapper", a->comm_wrapper);
  ddp__json_str(&j, "backend", be ? be : ddp_pg_backend_name(t->pg));
  ddp__json_int(&j, "timeout", a->ddp_timeout);
  ddp__json_str(&j, "sync", ddp__sync_name(t->sync));
  ddp__json_raw(&j, "training_args", args);
  ddp__json_end(&j);
  ddp_free(args);
  *out = ddp__json_take(&j);
  return *out ? DDP_OK : DDP_ERR_NO_MEMORY;
}

/* A dump call's status, with the message the writer logged. */
static ddp_status_t dump_check(trainer_t *t, ddp_status_t st) {
  if (st == DDP_OK) return DDP_OK;
  return ddp__error_quiet(t->err, st, "trainer: dump_dir %s: %s", t->a->dump_dir,
                          t->dump ? ddp_dump_last_error(t->dump) : "");
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

static double epoch_of(const trainer_t *t, int64_t step) {
  return (double)step / (double)t->steps_per_epoch;
}

/* The members every metrics line of step `step` starts with. */
static void metrics_begin(const trainer_t *t, ddp__json_t *j, int64_t step) {
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
static ddp_status_t open_dump(trainer_t *t) {
  char *config = NULL;
  DDP_CHECK(dump_config(t, &config));
  ddp_dump_options_t o = DDP_DUMP_OPTIONS_INIT;
  o.steps = t->max_steps - t->start;
  o.producer_version = "libddp " DDP_VERSION;
  o.config_json = config;
  ddp_status_t st = ddp_dump_open(t->a->dump_dir, t->rank, t->world, &o, &t->dump, t->err);
  ddp__free(config);
  DDP_CHECK(st);
  DDP_CHECK(dump_check(t, ddp_dump_init(t->dump, t->model, ddp__sync_reducer(t->sync))));
  if (t->a->dump_local_grads) ddp__sync_set_local_grad_fn(t->sync, ddp__train_dump_local, t->dump);
  return DDP_OK;
}

/* Everything before the first step: the model, optimizers, data and gradient sync
 * (setup), the checkpoint resumed from, the dump writer, rank 0's metrics file, and the
 * intervals of logging, evaluation and saving. */
static ddp_status_t begin(trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  if (ddp_env_is_set(DDP_ENV_TRAIN_SAVE_PAUSE_MS))
    DDP_CHECK(ddp_env_int(DDP_ENV_TRAIN_SAVE_PAUSE_MS, 0, 3600000, &t->pause_ms, t->err));
  DDP_CHECK(ddp__train_fault_init(&t->fault, t->rank, t->err));
  DDP_CHECK(setup(t));
  DDP_CHECK(resume(t, &t->start));
  DDP_CHECK(ddp__sync_begin(t->sync, t->err));
  DDP_CHECK(resume_hook_state(t));
  DDP_CHECK(open_init_q(t));
  t->res->start_step = t->start;
  if (a->dump_dir[0]) DDP_CHECK(open_dump(t));
  if (t->rank == 0) {
    DDP_CHECK(ddp__mkdirs(a->output_dir, t->rank, "trainer: output_dir", t->err));
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
} step_out_t;

/* Micro-batch k of step `step`: forward (synchronising only the last of the window, as HF
 * runs the others under no_sync) and backward of loss / GA; adds loss / GA to *loss. */
static ddp_status_t micro_step(trainer_t *t, int64_t step, int64_t k, double *loss,
                               int64_t *comm) {
  const int64_t GA = t->a->gradient_accumulation_steps;
  ddp_batch_t b;
  bool has = false;
  DDP_CHECK(ddp_loader_next(t->loader, &b, &has, t->err));
  if (!has) return ddp__error(t->err, t->rank, DDP_ERR_INTERNAL, "trainer: loader ran dry");
  t->loader_pos++;
  if (t->dump)
    DDP_CHECK(dump_check(t, ddp_dump_input(t->dump, &b.features, &b.labels, b.indices)));
  ddp_ctx_set_rng(t->ctx, t->a->seed, (uint32_t)t->rank, (uint64_t)(step * GA + k));
  DDP_CHECK(ddp__sync_pre_forward(t->sync, t->ctx, k == GA - 1, t->err));
  ddp_var_t *y, *l;
  DDP_CHECK(forward(t, &b, &y));
  DDP_CHECK(ddp__sync_post_forward(t->sync, t->ctx, y, t->err));
  DDP_CHECK(compute_loss(t, y, &b, &l));
  *loss += scalar_value(l) / (double)GA;
  if (!ddp__train_fault_skips(&t->fault, step, k)) {
    DDP_CHECK(ddp__sync_backward(t->sync, t->ctx, l, GA > 1 ? &t->seed_grad : NULL, comm,
                                 t->err));
  }
  ddp_ctx_reset(t->ctx);
  return DDP_OK;
}

/* Optimizer step `step` (0-based): its window of micro-batches, then clipping, the lr of
 * the schedule, the optimizer step and zero_grad; the loss is averaged over ranks. */
static ddp_status_t train_step(trainer_t *t, int64_t step, step_out_t *o) {
  const ddp_train_args_t *a = t->a;
  const int64_t GA = a->gradient_accumulation_steps;
  *o = (step_out_t){.t0 = ddp_now_ns()};
  int64_t epoch = step / t->steps_per_epoch;
  DDP_CHECK(seek_loader(t, epoch, (step % t->steps_per_epoch) * GA));
  ddp__train_forward_flags_at(a->forward_flags, t->rank, step, &t->flags); /* validated */
  DDP_CHECK(ddp__train_fault_step(&t->fault, t->pg, step, t->err));
  double local_loss = 0;
  for (int64_t k = 0; k < GA; k++) DDP_CHECK(micro_step(t, step, k, &local_loss, &o->comm));
  ddp__train_fault_after_backward(&t->fault, t->model, step);
  if (t->init_q) DDP_CHECK(ddp__train_q_check(t->init_q, t->err));
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_grads(t->dump)));
  DDP_CHECK(ddp_clip_grad_norm(t->grads, t->ntrain,
                               a->max_grad_norm > 0 ? a->max_grad_norm : INFINITY, 2.0, false,
                               &o->grad_norm, t->err));
  o->lr = ddp_lr_at(&t->sched, a->learning_rate, step);
  for (size_t g = 0; g < t->nopt; g++) {
    ddp_optim_set_lr(t->opt[g], o->lr);
    DDP_CHECK(ddp_optim_step(t->opt[g], t->err));
    ddp_optim_zero_grad(t->opt[g], a->zero_grad_set_to_none);
  }
  if (t->dump) {
    DDP_CHECK(dump_check(t, ddp_dump_step(t->dump, step - t->start, local_loss, (int)GA,
                                          t->flags)));
  }
  ddp_work_t *w = NULL;
  DDP_CHECK(coll_wait(t, ddp_allreduce(t->pg, &local_loss, &local_loss, 1, DDP_F64, DDP_OP_AVG,
                                       &w), &w, "loss allreduce"));
  o->loss = local_loss;
  return DDP_OK;
}

/* A logging step: the replica check, the window's means as a metrics.jsonl line and rank
 * 0's LOG event; the window starts again. */
static ddp_status_t log_window(trainer_t *t, int64_t done, const step_out_t *o, double eta) {
  double n = (double)t->win_n;
  double mean_loss = t->win_loss / n;
  double sps = t->win_time > 0 ? t->samples_per_step * n / t->win_time : 0;
  uint64_t h = 0;
  int64_t comm_bytes = 0;
  double comm_rate = 1.0;
  ddp__sync_comm_stats(t->sync, &comm_bytes, &comm_rate);
  DDP_CHECK(ddp__train_replica_check(t->pg, t->model, done, &h, t->err));
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
    ddp__json_end(&j);
    DDP_CHECK(ddp__metrics_line(t->metrics, &j, t->err));
  }
  if (t->ev) {
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_LOG, .step = done, .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done), .loss = mean_loss,
                           .grad_norm = o->grad_norm, .lr = o->lr,
                           .step_time_s = t->win_time / n, .comm_time_s = t->win_comm / n,
                           .samples_per_s = sps, .eta_s = eta};
    t->ev(t->user, &e);
  }
  t->win_loss = t->win_time = t->win_comm = 0;
  t->win_n = 0;
  return DDP_OK;
}

/* After step `done` - 1: the results, the logging window, rank 0's STEP event, and the
 * log line when it is due (every logging_steps and at the last step). */
static ddp_status_t end_of_step(trainer_t *t, int64_t done, const step_out_t *o) {
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
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_STEP, .step = done, .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done), .loss = o->loss,
                           .grad_norm = o->grad_norm, .lr = o->lr, .step_time_s = dt,
                           .comm_time_s = (double)o->comm * 1e-9,
                           .samples_per_s = rate * t->samples_per_step, .eta_s = eta};
    t->ev(t->user, &e);
  }
  if (every(done, t->log_every) || done == t->max_steps) return log_window(t, done, o, eta);
  return DDP_OK;
}

/* An evaluation after step `done` - 1: its metrics.jsonl line (perplexity for a causal
 * LM, run_clm's exp(eval_loss)) and rank 0's EVAL event. */
static ddp_status_t eval_step(trainer_t *t, int64_t done) {
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
    ddp_train_event_t e = {.kind = DDP_TRAIN_EV_EVAL, .step = done, .max_steps = t->max_steps,
                           .epoch = epoch_of(t, done), .eval_loss = el, .eval_accuracy = ea};
    t->ev(t->user, &e);
  }
  return DDP_OK;
}

/* After the last step: the PowerSGD draws and the dump closed, the results, the final
 * replica check, rank 0's summary line and loss curve. */
static ddp_status_t finish(trainer_t *t) {
  ddp_train_result_t *r = t->res;
  if (t->init_q) {
    DDP_CHECK(ddp__train_q_finish(t->init_q, ddp_powersgd_draws(ddp__sync_powersgd(t->sync)),
                                  t->err));
  }
  if (t->dump) DDP_CHECK(dump_check(t, ddp_dump_finish(t->dump)));
  r->steps = t->max_steps;
  r->seconds = (double)(ddp_now_ns() - t->t_start) * 1e-9;
  r->samples_per_s =
      r->seconds > 0 ? t->samples_per_step * (double)(t->max_steps - t->start) / r->seconds : 0;
  r->comm_seconds = (double)t->comm_total * 1e-9;
  DDP_CHECK(ddp__train_replica_check(t->pg, t->model, t->max_steps, &r->param_hash, t->err));
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

static void teardown(trainer_t *t, ddp_status_t st) {
  ddp__train_fault_end(&t->fault, st, t->err->msg);
  ddp__metrics_close(t->metrics, NULL);
  ddp_dump_close(t->dump);
  ddp__sync_destroy(t->sync);
  ddp__train_q_close(t->init_q);
  ddp_tensor_free(&t->seed_grad);
  for (size_t g = 0; g < t->nopt; g++) ddp_optim_destroy(t->opt[g]);
  ddp_loader_destroy(t->loader);
  ddp_sampler_destroy(t->sampler);
  ddp_ctx_destroy(t->ctx);
  ddp__free(t->pairs);
  ddp__free(t->grads);
}

/* The loop in named steps: begin; per optimizer step the step, the end of the step (the
 * log line when due), an evaluation and a save when due; finish. */
ddp_status_t ddp__train_run(ddp_pg_t *pg, ddp_model_t *model, const ddp_dataset_t *train,
                            const ddp_dataset_t *eval, const ddp_train_args_t *args,
                            ddp_train_event_fn ev, void *user, ddp_train_result_t *result,
                            ddp_error_t *err) {
  DDP_REQUIRE(pg && model && train && args && result);
  ddp_error_t local = {0};
  trainer_t *t = ddp__calloc(1, sizeof *t);
  if (!t) return ddp__error(err, ddp_pg_rank(pg), DDP_ERR_NO_MEMORY, "trainer: no memory");
  t->pg = pg;
  t->rank = ddp_pg_rank(pg);
  t->world = ddp_pg_size(pg);
  t->model = model;
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
