/* The trainer's setup from its arguments (HF's optimizer groups, the sampler and loader,
 * the step counts, the schedule, the gradient sync) and the JSON that records a run:
 * trainer_state.json in each checkpoint and the config of a dump (trainer.h). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/trainer.h"

/* HF's Trainer.create_optimizer: weight_decay applies to get_decay_parameter_names (every
 * parameter outside LayerNorm modules whose name does not contain "bias"), 0 to the
 * others; group 0 holds the decayed parameters, group 1 the rest, each in model order.
 * With weight_decay 0, or when one group would be empty, a single group in model order
 * (the same arithmetic, and the same optimizer state names, as before grouping). Fills
 * t->pairs, t->grads, t->ntrain and t->opt. */
static ddp_status_t setup_optimizers(ddp__trainer_t *t) {
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

/* world_size_invariant_shards K: the global batch of a step (W GA
 * per_device_train_batch_size samples, as in a normal run) is K shards of m samples, read
 * in the order of the whole dataset's shuffle (the sampler of one replica), whatever the
 * world size; micro-batch k of rank r runs global shards (k W + r) Sm ... + Sm - 1, Sm =
 * K / (W GA). An epoch is the full global batches of the dataset. The mode keeps no
 * state that depends on the rank, so models with buffers (BatchNorm's running statistics)
 * are refused: their per-rank updates are not invariant. */
static ddp_status_t check_invariant(ddp__trainer_t *t, int64_t *shard_size) {
  const ddp_train_args_t *a = t->a;
  int64_t K = a->world_size_invariant_shards, WA = t->world * a->gradient_accumulation_steps;
  if (K % WA != 0 || a->per_device_train_batch_size % (K / WA) != 0)
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: world_size_invariant_shards %lld needs world size x "
                      "gradient_accumulation_steps (%d x %lld) to divide it, and "
                      "per_device_train_batch_size %lld to be a multiple of the shards per "
                      "micro-batch (K / (W GA))",
                      (long long)K, t->world, (long long)a->gradient_accumulation_steps,
                      (long long)a->per_device_train_batch_size);
  if (ddp_model_num_buffers(t->model) > 0)
    return ddp__error(t->err, t->rank, DDP_ERR_UNSUPPORTED,
                      "trainer: world_size_invariant_shards is refused for a model with buffers "
                      "(%s): running statistics updated per rank are not invariant to the "
                      "world size; use LayerNorm or GroupNorm",
                      ddp_model_buffer(t->model, 0)->name);
  t->inv_k = K;
  t->inv_sm = K / WA;
  *shard_size = a->per_device_train_batch_size / t->inv_sm;
  t->inv_loss = ddp__calloc((size_t)K, sizeof *t->inv_loss);
  return t->inv_loss ? DDP_OK : DDP_ERR_NO_MEMORY;
}

/* DistributedSampler and the loader of this rank's shard, and the step counts: HF's
 * steps per epoch (full accumulation windows) and max_steps. In invariant mode, one
 * replica's sampler and the loader of shards (check_invariant). */
static ddp_status_t setup_data(ddp__trainer_t *t) {
  const ddp_train_args_t *a = t->a;
  int64_t shard = 0;
  if (a->world_size_invariant_shards > 0) DDP_CHECK(check_invariant(t, &shard));
  ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
  so.dataset_len = ddp_dataset_length(t->train);
  so.num_replicas = t->inv_k ? 1 : t->world;
  so.rank = t->inv_k ? 0 : t->rank;
  so.seed = a->data_seed >= 0 ? (uint64_t)a->data_seed : a->seed; /* HF's data_seed */
  so.shuffle = a->dataloader_shuffle;
  DDP_CHECK(ddp_sampler_create(&so, &t->sampler, t->err));
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = t->inv_k ? shard : a->per_device_train_batch_size;
  lo.drop_last = t->inv_k ? true : a->dataloader_drop_last;
  DDP_CHECK(ddp_loader_create(t->train, t->sampler, &lo, &t->loader, t->err));
  t->loader_epoch = -1;

  int64_t nb = ddp_loader_num_batches(t->loader);
  t->steps_per_epoch = t->inv_k ? nb / t->inv_k : nb / a->gradient_accumulation_steps;
  if (t->inv_k && t->steps_per_epoch < 1) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: world_size_invariant_shards %lld: the dataset's %lld samples "
                      "hold no full global batch of %lld shards of %lld",
                      (long long)t->inv_k, (long long)so.dataset_len, (long long)t->inv_k,
                      (long long)shard);
  }
  if (t->steps_per_epoch < 1) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: an epoch has %lld micro-batches per rank (%lld samples, %d "
                      "ranks, batch %lld), fewer than gradient_accumulation_steps %lld",
                      (long long)nb, (long long)so.dataset_len, t->world, (long long)lo.batch_size,
                      (long long)a->gradient_accumulation_steps);
  }
  t->max_steps = a->max_steps > 0 ? a->max_steps
                                  : (int64_t)ceil(a->num_train_epochs * (double)t->steps_per_epoch);
  if (t->max_steps < 1) t->max_steps = 1;
  return DDP_OK;
}

ddp_status_t ddp__trainer_setup(ddp__trainer_t *t) {
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
  /* get_scheduler's defaults: one cycle for the restarts; polynomial decays from the
   * optimizer's learning rate. */
  if (kind == DDP_LR_COSINE_WITH_RESTARTS) t->sched.num_cycles = 1.0;
  t->sched.lr_init = a->learning_rate;
  DDP_CHECK(ddp__train_lr_kwargs(a, &t->sched, t->err));
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
  /* --deepspeed's keys onto the arguments the sync and ZeRO read (ds_config.c) */
  DDP_CHECK(ddp__train_ds_config_apply(t));
  /* ZeRO-2 and ZeRO-3 reduce their gradients themselves, bucket by bucket and unit by unit
   * (zero.c): no DDP reducer (its buckets would be 4Ψ of memory for nothing) */
  int stage = 0;
  DDP_CHECK(ddp__train_zero_stage(a, t->rank, &stage, t->err));
  DDP_CHECK(ddp__sync_create(t->pg, t->model, a, a->ddp_reducer && stage < 2, &t->sync, t->err));
  DDP_CHECK(ddp__train_zero_setup(t));
  ddp_model_set_grads_none(t->model); /* a fresh PyTorch module's gradients are None */
  return DDP_OK;
}

/* The optimizer's parameter groups as JSON: [{"weight_decay": wd, "params": [names]}, ...]
 * (HF's optimizer_grouped_parameters, by state_dict name). */
static char *groups_json(ddp__trainer_t *t) {
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

ddp_status_t ddp__trainer_state_json(ddp__trainer_t *t, int64_t step, char **out) {
  const ddp_train_args_t *a = t->a;
  const int64_t GA = a->gradient_accumulation_steps;
  *out = NULL;
  char *args = NULL;
  DDP_CHECK(ddp_train_args_to_json(a, &args));
  char digest[17];
  ddp_status_t st = ddp__train_data_digest(t, digest);
  if (st != DDP_OK) {
    ddp_free(args);
    return st;
  }
  char *groups = groups_json(t);
  ddp__json_t j;
  ddp__json_begin(&j);
  /* 2: checksums.sha256 is written with every checkpoint (ckpt_integrity.c) */
  ddp__json_int(&j, "checkpoint_format", DDP__TRAIN_CHECKPOINT_FORMAT);
  ddp__json_int(&j, "global_step", step);
  ddp__json_int(&j, "max_steps", t->max_steps);
  ddp__json_num(&j, "epoch", "%.6f", (double)step / (double)t->steps_per_epoch);
  ddp__json_int(&j, "world_size", t->world);
  ddp__json_int(&j, "steps_per_epoch", t->steps_per_epoch);
  ddp__json_object(&j, "sampler");
  ddp__json_str(&j, "kind", "DistributedSampler");
  ddp__json_uint(&j, "seed", a->seed);
  ddp__json_int(&j, "epoch", step / t->steps_per_epoch);
  /* invariant mode: global shards consumed in the epoch, of the shard size */
  ddp__json_int(&j, "batches_consumed", (step % t->steps_per_epoch) * (t->inv_k ? t->inv_k : GA));
  ddp__json_int(&j, "batch_size",
                t->inv_k ? a->per_device_train_batch_size / t->inv_sm
                         : a->per_device_train_batch_size);
  ddp__json_end(&j);
  ddp__json_object(&j, "rng");
  ddp__json_str(&j, "generator", "philox4x32-10");
  ddp__json_uint(&j, "seed", a->seed);
  ddp__json_int(&j, "dropout_next_step", step * GA);
  ddp__json_end(&j);
  ddp__json_object(&j, "dataset"); /* what a resume compares (resume_check.c) */
  ddp__json_int(&j, "samples", ddp_dataset_length(t->train));
  ddp__json_int(&j, "feature_numel", ddp_dataset_feature_numel(t->train));
  ddp__json_int(&j, "label_numel", ddp_dataset_label_numel(t->train));
  ddp__json_str(&j, "digest", digest);
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

/* The dump's config: the options under torch_reference.py's names (docs/dumps.md), plus
 * every training argument under "training_args". */
ddp_status_t ddp__trainer_dump_config(ddp__trainer_t *t, char **out) {
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
  ddp__json_str(&j, "loss",
                t->task == DDP_TASK_CAUSAL_LM ? "causal_lm"
                : t->classify                 ? "ce"
                                              : "mse");
  ddp__json_bool(&j, "shuffle", a->dataloader_shuffle);
  ddp__json_uint(&j, "data_seed", a->data_seed >= 0 ? (uint64_t)a->data_seed : a->seed);
  ddp__json_bool(&j, "zero_grad_set_to_none", a->zero_grad_set_to_none);
  ddp__json_str(&j, "weight_decay_grouping", a->weight_decay_grouping);
  ddp__json_bool(&j, "sampler_drop_last", false);
  ddp__json_bool(&j, "dataloader_drop_last", a->dataloader_drop_last);
  ddp__json_str(&j, "flags", a->forward_flags);
  /* unset (<= 0): null */
  ddp__json_num(&j, "bucket_cap_mb", "%.17g",
                a->ddp_bucket_cap_mb > 0 ? a->ddp_bucket_cap_mb : NAN);
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
