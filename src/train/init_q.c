/* power_sgd_init_q: PyTorch's random PowerSGD Q draws served to libddp's PowerSGD state
 * (contract in train_internal.h, user guide in docs/train.md and docs/hooks.md).
 *
 * libddp's draw k and PyTorch's are the same event (the k-th random initialisation of Q:
 * once per bucket with warm start, once per bucket and PowerSGD step without), and both lay
 * a bucket's Qs out in the same order, so for the same job draw k has the same bucket index
 * and length on both sides. Every rank opens the file: PyTorch draws the same Q on every
 * rank, and so does libddp. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "train/train_internal.h"

struct ddp__train_q {
  ddp_st_file_t *f;
  char path[DDP_TRAIN_STR_MAX];
  int rank;
  uint64_t draws;                  /* what PyTorch's run made: the file's "draws" */
  char bad[DDP_ERROR_MSG_MAX / 2]; /* the first draw that did not fit, "" when none */
};

ddp_status_t ddp__train_q_open(const char *path, int rank, ddp__train_q_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  ddp__train_q_t *q = ddp__calloc(1, sizeof *q);
  if (!q) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "power_sgd_init_q: no memory");
  snprintf(q->path, sizeof q->path, "%s", path);
  q->rank = rank;
  ddp_error_t e = {0};
  ddp_status_t st = ddp_st_open(path, DDP_ST_READ, &q->f, &e);
  if (st != DDP_OK) {
    ddp__free(q);
    return ddp__error_quiet(err, st, "power_sgd_init_q %s: %s", path, e.msg); /* logged */
  }
  const char *d = ddp_st_meta_get(q->f, "draws");
  char *end = NULL;
  unsigned long long n = d ? strtoull(d, &end, 10) : 0;
  if (!d || !*d || *end) {
    ddp__train_q_close(q);
    return ddp__error(err, rank, DDP_ERR_INVALID_DATA,
                      "power_sgd_init_q %s: no \"draws\" in the metadata; expected the "
                      "powersgd_q.safetensors that tools/torch/torch_reference.py writes",
                      path);
  }
  q->draws = n;
  *out = q;
  return DDP_OK;
}

void ddp__train_q_fill(void *user, uint64_t draw, size_t bucket, float *out, size_t n) {
  ddp__train_q_t *q = user;
  char name[40], key[40];
  snprintf(name, sizeof name, "draw%" PRIu64, draw);
  snprintf(key, sizeof key, "bucket%" PRIu64, draw);
  const char *b = ddp_st_meta_get(q->f, key);
  size_t i;
  ddp_tensor_t t;
  bool found = ddp_st_find(q->f, name, &i) == DDP_OK && ddp_st_tensor(q->f, i, &t) == DDP_OK;
  if (found && b && t.dtype == DDP_F32 && (size_t)t.numel == n && strtoull(b, NULL, 10) == bucket) {
    memcpy(out, t.data, n * sizeof *out);
    return;
  }
  if (!q->bad[0]) {
    snprintf(q->bad, sizeof q->bad,
             "random Q draw %" PRIu64 " (bucket %zu, %zu values) does not fit PyTorch's: %s", draw,
             bucket, n,
             !found                 ? "the file has no such draw"
             : !b                   ? "the file names no bucket for it"
             : t.dtype != DDP_F32   ? "its tensor is not f32"
             : (size_t)t.numel != n ? "its length differs"
                                    : "its bucket differs");
  }
  for (size_t k = 0; k < n; k++) out[k] = NAN; /* the comparison cannot miss it either */
}

ddp_status_t ddp__train_q_check(const ddp__train_q_t *q, ddp_error_t *err) {
  DDP_REQUIRE(q);
  if (!q->bad[0]) return DDP_OK;
  return ddp__error(err, q->rank, DDP_ERR_INVALID_DATA,
                    "power_sgd_init_q %s: %s; the PyTorch run had other PowerSGD options, "
                    "buckets or parameters",
                    q->path, q->bad);
}

ddp_status_t ddp__train_q_finish(const ddp__train_q_t *q, uint64_t draws_made, ddp_error_t *err) {
  DDP_REQUIRE(q);
  if (draws_made == q->draws) return DDP_OK;
  return ddp__error(err, q->rank, DDP_ERR_INVALID_DATA,
                    "power_sgd_init_q %s: PyTorch's run made %" PRIu64 " random Q draws and "
                    "this one %" PRIu64 ": the runs differ (steps, buckets or PowerSGD "
                    "options)",
                    q->path, q->draws, draws_made);
}

void ddp__train_q_close(ddp__train_q_t *q) {
  if (!q) return;
  ddp_st_close(q->f);
  ddp__free(q);
}
