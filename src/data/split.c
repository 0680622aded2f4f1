/* The held-out split (include/ddp/data.h, ddp_dataset_split): two index views over one
 * dataset, drawn as torch.randperm draws. */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

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

ddp_status_t ddp_dataset_split(const ddp_dataset_t *ds, double fraction, uint64_t seed,
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
