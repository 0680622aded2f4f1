/* What a resumed run must share with the run that wrote its checkpoint (trainer.h).
 *
 * trainer_state.json records the training data ("dataset": samples, elements per feature
 * and label, a digest of every sample's bytes) beside the arguments. On resume, a changed
 * per_device_train_batch_size, seed, data_seed or training data (another --data, another
 * --block_size or --max_seq_length) gets Transformers' warning (Trainer's
 * compare_trainer_and_checkpoint_args: "Warning: The training argument '...' value (...)
 * does not match the trainer state ..."), since the run then differs from an uninterrupted
 * one. When the checkpoint is in the middle of an epoch (the sampler has consumed part of
 * it) and what changed decides the epoch's data order, the rest of the epoch cannot be
 * reproduced (samples already seen would be drawn again, others never): that is refused,
 * naming the argument, both values and the way out. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/trainer.h"

/* FNV-1a, 64 bits, over every sample's feature and label bytes in index order. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

ddp_status_t ddp__train_data_digest(ddp__trainer_t *t, char hex[17]) {
  if (t->data_digest[0]) {
    memcpy(hex, t->data_digest, 17);
    return DDP_OK;
  }
  const ddp_sample_spec_t *sp = ddp_dataset_spec(t->train);
  int64_t fn = ddp_dataset_feature_numel(t->train), ln = ddp_dataset_label_numel(t->train);
  size_t fb = (size_t)fn * ddp_dtype_size(sp->feature_dtype);
  size_t lb = (size_t)ln * ddp_dtype_size(sp->label_dtype);
  unsigned char *buf = ddp__malloc(fb + lb + 1);
  if (!buf)
    return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY,
                      "trainer: out of memory: %zu bytes for one sample (the data digest)",
                      fb + lb + 1);
  ddp_tensor_t f = {.dtype = sp->feature_dtype, .ndim = 1, .shape = {fn}, .numel = fn, .data = buf};
  ddp_tensor_t l = {.dtype = sp->label_dtype,
                    .ndim = 1,
                    .shape = {ln},
                    .numel = ln,
                    .data = buf + fb};
  uint64_t h = 0xcbf29ce484222325ULL;
  int64_t n = ddp_dataset_length(t->train);
  ddp_status_t st = DDP_OK;
  for (int64_t i = 0; st == DDP_OK && i < n; i++) {
    st = ddp_dataset_get(t->train, i, &f, &l, t->err);
    h = fnv(h, buf, fb + lb);
  }
  ddp__free(buf);
  DDP_CHECK(st);
  snprintf(t->data_digest, sizeof t->data_digest, "%016" PRIx64, h);
  memcpy(hex, t->data_digest, 17);
  return DDP_OK;
}

static int64_t num(const cJSON *o, const char *key, int64_t dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) ? (int64_t)v->valuedouble : cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

/* Transformers' warning for one argument; "" when it agrees. */
static void warn_arg(const ddp__trainer_t *t, const char *path, const char *name, int64_t now,
                     int64_t then, const char *why) {
  if (now == then || t->rank != 0) return;
  ddp__log(t->rank, DDP_LOG_WARN,
           "Warning: The training argument '%s' value (%" PRId64 ") does not match the trainer "
           "state's value (%" PRId64 ") in %s. libddp goes on with %" PRId64 ": %s",
           name, now, then, path, now, why);
}

ddp_status_t ddp__train_resume_check(ddp__trainer_t *t, const char *dir) {
  const ddp_train_args_t *a = t->a;
  char path[DDP_TRAIN_STR_MAX + 32];
  snprintf(path, sizeof path, "%s/trainer_state.json", dir);
  char *text = NULL;
  DDP_CHECK(ddp__file_read(path, 0, -1, "checkpoint", &text, NULL, t->err));
  cJSON *o = cJSON_Parse(text);
  ddp__free(text);
  const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "args");
  const cJSON *smp = cJSON_GetObjectItemCaseSensitive(o, "sampler");
  const cJSON *ds = cJSON_GetObjectItemCaseSensitive(o, "dataset");
  int64_t consumed = num(smp, "batches_consumed", 0), epoch = num(smp, "epoch", 0);
  int64_t spe = num(o, "steps_per_epoch", t->steps_per_epoch);
  int64_t bs = num(args, "per_device_train_batch_size", a->per_device_train_batch_size);
  int64_t ga = num(args, "gradient_accumulation_steps", a->gradient_accumulation_steps);
  int64_t world_then = num(o, "world_size", t->world);
  int64_t inv_then = num(args, "world_size_invariant_shards", 0);
  int64_t seed = num(args, "seed", (int64_t)a->seed), dseed = num(args, "data_seed", a->data_seed);
  bool shuffle = num(args, "dataloader_shuffle", a->dataloader_shuffle) != 0;
  int64_t samples = num(ds, "samples", -1), fn = num(ds, "feature_numel", -1);
  int64_t ln = num(ds, "label_numel", -1);
  const cJSON *dg = cJSON_GetObjectItemCaseSensitive(ds, "digest");
  char digest_then[17] = "";
  if (cJSON_IsString(dg)) snprintf(digest_then, sizeof digest_then, "%s", dg->valuestring);
  cJSON_Delete(o);

  int64_t ord_then = dseed >= 0 ? dseed : seed;
  int64_t ord_now = a->data_seed >= 0 ? a->data_seed : (int64_t)a->seed;
  char data_why[256] = "";
  if (samples >= 0) {
    char now_hex[17];
    DDP_CHECK(ddp__train_data_digest(t, now_hex));
    int64_t n = ddp_dataset_length(t->train), f = ddp_dataset_feature_numel(t->train);
    if (samples != n || fn != f || ln != ddp_dataset_label_numel(t->train))
      snprintf(data_why, sizeof data_why,
               "%" PRId64 " samples of %" PRId64 " elements then, %" PRId64 " of %" PRId64
               " now: another --data, --block_size or --max_seq_length",
               samples, fn, n, f);
    else if (strcmp(digest_then, now_hex) != 0)
      snprintf(data_why, sizeof data_why,
               "the same number and size of samples, other contents (digest %s then, %s now): "
               "another --data",
               digest_then, now_hex);
  }

  /* Mid-epoch: what decides the rest of the epoch's order must not have changed. With
   * --world_size_invariant_shards the order is the global batch's (docs/ddp.md): any world
   * size, per-device batch and accumulation that keep the global batch continue it. */
  bool invariant = a->world_size_invariant_shards > 0 && inv_then == a->world_size_invariant_shards;
  int64_t global_then = bs * world_then * ga;
  int64_t global_now = a->per_device_train_batch_size * t->world * a->gradient_accumulation_steps;
  const char *arg = NULL;
  char values[320] = "";
  if (consumed > 0 && invariant && global_then != global_now) {
    arg = "global batch (per_device_train_batch_size x world size x "
          "gradient_accumulation_steps)";
    snprintf(values, sizeof values, "%" PRId64 " then, %" PRId64 " now", global_then, global_now);
  } else if (consumed > 0 && !invariant && bs != a->per_device_train_batch_size) {
    arg = "per_device_train_batch_size";
    snprintf(values, sizeof values, "%" PRId64 " then, %" PRId64 " now", bs,
             a->per_device_train_batch_size);
  } else if (consumed > 0 && shuffle && a->dataloader_shuffle && ord_then != ord_now) {
    arg = a->data_seed >= 0 || dseed >= 0 ? "data_seed (or seed)" : "seed";
    snprintf(values, sizeof values, "%" PRId64 " then, %" PRId64 " now", ord_then, ord_now);
  } else if (consumed > 0 && data_why[0]) {
    arg = "training data";
    snprintf(values, sizeof values, "%s", data_why);
  }
  if (arg) {
    char msg[DDP_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg,
             "trainer: cannot resume %s with a different %s (%s): the checkpoint is in the "
             "middle of epoch %" PRId64 " (%" PRId64 " of its %" PRId64
             " steps done), and the rest of the epoch's data order cannot be reproduced; "
             "resume with what the checkpoint was written with, or from a checkpoint at an epoch "
             "boundary",
             dir, arg, values, epoch, consumed, spe);
    if (t->rank == 0) return ddp__error(t->err, t->rank, DDP_ERR_INVALID_ARGUMENT, "%s", msg);
    return ddp__error_quiet(t->err, DDP_ERR_INVALID_ARGUMENT, "%s", msg);
  }
  if (!(invariant && global_then == global_now))
    warn_arg(t, path, "per_device_train_batch_size", a->per_device_train_batch_size, bs,
             "the run differs from an uninterrupted one");
  warn_arg(t, path, "seed", (int64_t)a->seed, seed,
           "dropout (and the data order, without data_seed) differ from an uninterrupted run");
  if (dseed != a->data_seed)
    warn_arg(t, path, "data_seed", a->data_seed, dseed,
             "the data order differs from an uninterrupted run");
  if (data_why[0] && t->rank == 0)
    ddp__log(t->rank, DDP_LOG_WARN,
             "Warning: the training data differ from those %s was trained on (%s); the run "
             "differs from an uninterrupted one",
             dir, data_why);
  return DDP_OK;
}
