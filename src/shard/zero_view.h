/* ZeroRedundancyOptimizer's parameters_as_bucket_view for ZeRO stage 1 (zero.c): one flat
 * bucket per rank holding that rank's parameters, the parameters made views into it, and
 * _sync_params as one broadcast per rank. Private to src/shard. */
#ifndef DDP_SHARD_ZERO_VIEW_H
#define DDP_SHARD_ZERO_VIEW_H

#include "ddp/optim.h"
#include "ddp/pg.h"

typedef struct ddp__zero_view {
  int world;
  size_t n;             /* parameters */
  size_t esz;           /* element size */
  unsigned char **bkt;  /* [world] rank r's bucket (at least 1 element, zero when empty) */
  size_t *count;        /* [world] elements broadcast for rank r (1 for an empty bucket) */
  void **home;          /* [n] parameter i's storage before it became a view */
  ddp_tensor_t **param; /* [n] the parameters (the caller's pairs) */
} ddp__zero_view_t;

/* Builds the buckets: rank r's bucket holds, per group in order, r's parameters of that
 * group in the partition's order (numel descending, stable), each copied in and its data
 * pointed into the bucket (_build_param_buckets). owner[i] is parameter i's rank. */
ddp_status_t ddp__zero_view_build(ddp__zero_view_t *v, const ddp_optim_param_t *params, size_t n,
                                  const int *owner, const size_t *group_n, size_t ngroups,
                                  int world, int rank, ddp_error_t *err);
/* _sync_params: broadcast of bucket r from rank r, for r = 0..W-1, in that order; the works
 * go to works[0..W) (the caller waits for them). *m: how many were issued; on a failure to
 * issue, the status is returned with *m the ones issued before it. */
ddp_status_t ddp__zero_view_sync(ddp__zero_view_t *v, ddp_pg_t *pg, ddp_dtype_t dt,
                                 ddp_work_t **works, size_t *m);
/* Copies every parameter back to its former storage and points it there again (the model's
 * flat buffer), then frees the buckets. A view never built is a no-op. */
void ddp__zero_view_free(ddp__zero_view_t *v);

#endif
