/* parameters_as_bucket_view (zero_view.h), after ZeroRedundancyOptimizer 1.13's
 * _build_param_buckets and _broadcast_params_from_rank: a bucket per rank (one device
 * here), the rank's trainable parameters in its partition order flattened into it and
 * turned into views, an empty rank's bucket a single zero (torch.zeros(1)), and the
 * parameter sync one broadcast per bucket from its rank instead of one per parameter. */
#include <string.h>

#include "common/common.h"
#include "shard/zero_view.h"

/* Parameters of group [base, base + m) in the partition's visiting order: numel
 * descending, ties in index order (Python's stable sorted(reverse=True)). */
static void sorted_order(const ddp_optim_param_t *params, size_t base, size_t m, size_t *ord) {
  for (size_t i = 0; i < m; i++) {
    size_t j = i;
    while (j > 0 && params[base + ord[j - 1]].param->numel < params[base + i].param->numel) {
      ord[j] = ord[j - 1];
      j--;
    }
    ord[j] = i;
  }
}

ddp_status_t ddp__zero_view_build(ddp__zero_view_t *v, const ddp_optim_param_t *params, size_t n,
                                  const int *owner, const size_t *group_n, size_t ngroups,
                                  int world, int rank, ddp_error_t *err) {
  memset(v, 0, sizeof *v);
  v->world = world;
  v->n = n;
  v->esz = n ? ddp_dtype_size(params[0].param->dtype) : 4;
  v->bkt = ddp__calloc((size_t)world, sizeof *v->bkt);
  v->count = ddp__calloc((size_t)world, sizeof *v->count);
  v->home = ddp__calloc(n ? n : 1, sizeof *v->home);
  v->param = ddp__calloc(n ? n : 1, sizeof *v->param);
  size_t *ord = ddp__calloc(n ? n : 1, sizeof *ord),
         *fill = ddp__calloc((size_t)world, sizeof *fill);
  ddp_status_t st = DDP_OK;
  if (!v->bkt || !v->count || !v->home || !v->param || !ord || !fill) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "zero: out of memory for the parameter buckets");
    goto out;
  }
  for (size_t i = 0; i < n; i++) v->count[owner[i]] += (size_t)params[i].param->numel;
  for (int r = 0; r < world; r++) {
    size_t bytes = (v->count[r] ? v->count[r] : 1) * v->esz;
    v->bkt[r] = ddp__calloc(1, bytes);
    if (!v->bkt[r]) {
      st = ddp__error(err, rank, DDP_ERR_NO_MEMORY,
                      "zero: out of memory for rank %d's %zu-byte parameter bucket "
                      "(parameters_as_bucket_view)",
                      r, bytes);
      goto out;
    }
    if (!v->count[r]) v->count[r] = 1; /* the dummy bucket, broadcast like the others */
  }
  for (size_t g = 0, base = 0; g < ngroups; base += group_n[g], g++) {
    sorted_order(params, base, group_n[g], ord);
    for (size_t k = 0; k < group_n[g]; k++) {
      size_t i = base + ord[k];
      ddp_tensor_t *p = params[i].param;
      int r = owner[i];
      unsigned char *dst = v->bkt[r] + fill[r] * v->esz;
      memcpy(dst, p->data, (size_t)p->numel * v->esz);
      v->home[i] = p->data;
      v->param[i] = p;
      p->data = dst;
      fill[r] += (size_t)p->numel;
    }
  }
out:
  ddp__free(ord);
  ddp__free(fill);
  if (st != DDP_OK) ddp__zero_view_free(v);
  return st;
}

ddp_status_t ddp__zero_view_sync(ddp__zero_view_t *v, ddp_pg_t *pg, ddp_dtype_t dt,
                                 ddp_work_t **works, size_t *m) {
  *m = 0;
  for (int r = 0; r < v->world; r++) {
    ddp_status_t st = ddp_broadcast(pg, v->bkt[r], v->count[r], dt, r, &works[*m]);
    if (st != DDP_OK) return st;
    (*m)++;
  }
  return DDP_OK;
}

void ddp__zero_view_free(ddp__zero_view_t *v) {
  for (size_t i = 0; v->home && i < v->n; i++) {
    ddp_tensor_t *p = v->param[i];
    if (!p || !v->home[i]) continue;
    memcpy(v->home[i], p->data, (size_t)p->numel * v->esz);
    p->data = v->home[i];
  }
  for (int r = 0; v->bkt && r < v->world; r++) ddp__free(v->bkt[r]);
  ddp__free(v->bkt);
  ddp__free(v->count);
  ddp__free(v->home);
  ddp__free(v->param);
  memset(v, 0, sizeof *v);
}
