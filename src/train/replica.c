/* The replica check: every rank hashes its parameters (FNV-1a over the flat buffers) and
 * the hashes are all-gathered; ranks whose parameters diverged are named, grouped by hash
 * (docs/train.md). */
#include <stdio.h>

#include "common/common.h"
#include "train/train_internal.h"

uint64_t ddp_train_param_hash(ddp_model_t *model) {
  DDP_REQUIRE(model);
  uint64_t h = 1469598103934665603ull;
  static const ddp_dtype_t dts[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16};
  /* Per dtype, the parameters in registration order: the bytes of the dtype's flat buffer
   * (offsets follow registration), read through each parameter so that parameters whose
   * storage a sharding layer gathered elsewhere (ZeRO-3) hash the same. */
  for (size_t d = 0; d < DDP_ARRAY_LEN(dts); d++)
    for (size_t k = 0; k < ddp_model_num_params(model); k++) {
      const ddp_param_t *p = ddp_model_param(model, k);
      if (p->value.dtype != dts[d] || !p->value.data) continue;
      const unsigned char *b = p->value.data;
      size_t n = ddp_tensor_nbytes(&p->value);
      for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    }
  return h;
}

ddp_status_t ddp__train_replica_check(ddp_pg_t *pg, ddp_model_t *model, int64_t step,
                                      uint64_t *hash, ddp_error_t *err) {
  int rank = ddp_pg_rank(pg), world = ddp_pg_size(pg);
  uint64_t mine = ddp_train_param_hash(model);
  uint64_t *all = ddp__calloc((size_t)world, sizeof *all);
  if (!all) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "replica check: no memory");
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allgather(pg, &mine, all, 1, DDP_I64, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st != DDP_OK) {
    /* The group logged its failure where it started; the check adds its context. */
    ddp_error_t pe;
    ddp_pg_last_error_copy(pg, &pe);
    st = ddp__error_quiet(err, st, "replica check at step %lld: allgather: %s", (long long)step,
                          pe.msg);
    goto out;
  }
  bool same = true;
  for (int r = 1; r < world; r++) same &= all[r] == all[0];
  if (!same) {
    /* Group ranks by hash, first appearance first: "ranks 0,2 hold 0x..; rank 1 holds 0x..". */
    char msg[DDP_ERROR_MSG_MAX - 96];
    size_t len = 0;
    bool *done = ddp__calloc((size_t)world, sizeof *done);
    for (int r = 0; done && r < world && len < sizeof msg; r++) {
      if (done[r]) continue;
      int count = 0;
      for (int q = r; q < world; q++) count += all[q] == all[r];
      len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%s ", len ? "; " : "",
                              count > 1 ? "ranks" : "rank");
      bool first = true;
      for (int q = r; q < world && len < sizeof msg; q++) {
        if (all[q] != all[r]) continue;
        done[q] = true;
        len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%d", first ? "" : ",", q);
        first = false;
      }
      if (len < sizeof msg) {
        len += (size_t)snprintf(msg + len, sizeof msg - len, " %s 0x%016llx",
                                count > 1 ? "hold" : "holds", (unsigned long long)all[r]);
      }
    }
    ddp__free(done);
    st = ddp__error(err, rank, DDP_ERR_INVALID_DATA,
                    "replica check at step %lld: the replicas' parameters diverged: %s",
                    (long long)step, msg);
  }
  if (hash) *hash = mine;
out:
  ddp__free(all);
  return st;
}
