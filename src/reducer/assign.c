/* compute_bucket_assignment_by_size: PyTorch's greedy bucketing rule (spec §2.1), as a pure
 * function shared by the reducer (gradient buckets) and the coalesced broadcasts (250 MiB
 * chunks). */
#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "ddp/reducer.h"

/* One open accumulator per key: the tensors added so far, their bytes, and the key's
 * position in the limits list. A key's buckets close when their bytes reach the current
 * limit; the position then advances and stays on the last limit. Closed buckets are
 * appended to the result as they close; the partial ones follow at the end in first-seen
 * key order (upstream walks a hash map there, so any fixed order is faithful). Without a
 * visiting order the result is sorted by each bucket's smallest index (construction
 * time); with one (rebuild), production order is kept. */
typedef struct acc {
  int key;
  size_t *items;
  size_t nitems;
  size_t bytes;
  size_t limit_pos;
} acc_t;

typedef struct builder {
  size_t nb;
  size_t nidx;
  size_t *starts; /* per bucket: start in idx */
  size_t *lens;
  size_t *lims;
  size_t *idx;
} builder_t;

static void emit(builder_t *b, const size_t *items, size_t n, size_t limit) {
  b->starts[b->nb] = b->nidx;
  b->lens[b->nb] = n;
  b->lims[b->nb] = limit;
  memcpy(b->idx + b->nidx, items, n * sizeof *items);
  b->nidx += n;
  b->nb++;
}

void ddp_bucket_assignment_free(ddp_bucket_assignment_t *a) {
  if (!a) return;
  ddp__free(a->offsets);
  ddp__free(a->indices);
  ddp__free(a->limits);
  memset(a, 0, sizeof *a);
}

ddp_status_t ddp_compute_bucket_assignment_by_size(size_t n, const size_t *bytes, const int *keys,
                                                   const bool *expect_sparse, const size_t *limits,
                                                   size_t nlimits, const size_t *order,
                                                   ddp_bucket_assignment_t *out) {
  DDP_REQUIRE(out && (n == 0 || (bytes && keys)) && limits && nlimits > 0);
  memset(out, 0, sizeof *out);
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  acc_t *accs = ddp__calloc(n + 1, sizeof *accs);
  size_t *pool = ddp__calloc(n + 1, sizeof *pool);
  builder_t b = {0,
                 0,
                 ddp__calloc(n + 1, sizeof(size_t)),
                 ddp__calloc(n + 1, sizeof(size_t)),
                 ddp__calloc(n + 1, sizeof(size_t)),
                 ddp__calloc(n + 1, sizeof(size_t))};
  size_t *perm = ddp__calloc(n + 1, sizeof *perm);
  size_t naccs = 0, pool_used = 0;
  if (!accs || !pool || !b.starts || !b.lens || !b.lims || !b.idx || !perm) goto done;
  /* Each accumulator's items live in its own region of `pool`, sized by the number of
   * tensors with its key (counted first), so a key can never overflow into another's. */
  for (size_t i = 0; i < n; i++) {
    size_t a = 0;
    while (a < naccs && accs[a].key != keys[i]) a++;
    if (a == naccs) accs[naccs++].key = keys[i];
    accs[a].nitems++; /* count first; reset below */
  }
  for (size_t a = 0; a < naccs; a++) {
    accs[a].items = pool + pool_used;
    pool_used += accs[a].nitems;
    accs[a].nitems = 0;
  }
  for (size_t k = 0; k < n; k++) {
    size_t i = order ? order[k] : k;
    if (i >= n) {
      st = DDP_ERR_INVALID_ARGUMENT;
      goto done;
    }
    if (expect_sparse && expect_sparse[i]) {
      emit(&b, &i, 1, SIZE_MAX);
      continue;
    }
    size_t a = 0;
    while (accs[a].key != keys[i]) a++;
    acc_t *ac = &accs[a];
    ac->items[ac->nitems++] = i;
    ac->bytes += bytes[i];
    size_t limit = limits[ac->limit_pos];
    if (ac->bytes >= limit) {
      emit(&b, ac->items, ac->nitems, limit);
      ac->nitems = 0;
      ac->bytes = 0;
      if (ac->limit_pos + 1 < nlimits) ac->limit_pos++;
    }
  }
  for (size_t a = 0; a < naccs; a++)
    if (accs[a].nitems) emit(&b, accs[a].items, accs[a].nitems, limits[accs[a].limit_pos]);

  /* Bucket order: production order, or sorted by smallest index (stable insertion sort;
   * the minimum of each bucket is unique since every index is in exactly one bucket). */
  size_t *minidx = pool; /* reuse: pool is no longer needed */
  for (size_t j = 0; j < b.nb; j++) {
    perm[j] = j;
    size_t m = SIZE_MAX;
    for (size_t t = 0; t < b.lens[j]; t++) m = DDP_MIN(m, b.idx[b.starts[j] + t]);
    minidx[j] = m;
  }
  if (!order) {
    for (size_t j = 1; j < b.nb; j++) {
      size_t v = perm[j], x = j;
      while (x > 0 && minidx[perm[x - 1]] > minidx[v]) {
        perm[x] = perm[x - 1];
        x--;
      }
      perm[x] = v;
    }
  }
  out->nbuckets = b.nb;
  out->offsets = ddp__calloc(b.nb + 1, sizeof(size_t));
  out->indices = ddp__calloc(n + 1, sizeof(size_t));
  out->limits = ddp__calloc(b.nb + 1, sizeof(size_t));
  if (!out->offsets || !out->indices || !out->limits) {
    ddp_bucket_assignment_free(out);
    goto done;
  }
  size_t pos = 0;
  for (size_t j = 0; j < b.nb; j++) {
    size_t s = perm[j];
    out->offsets[j] = pos;
    memcpy(out->indices + pos, b.idx + b.starts[s], b.lens[s] * sizeof(size_t));
    out->limits[j] = b.lims[s];
    pos += b.lens[s];
  }
  out->offsets[b.nb] = pos;
  st = DDP_OK;
done:
  ddp__free(accs);
  ddp__free(pool);
  ddp__free(b.starts);
  ddp__free(b.lens);
  ddp__free(b.lims);
  ddp__free(b.idx);
  ddp__free(perm);
  return st;
}
