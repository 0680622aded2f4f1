/* Private to src/shard: ZeRO-2's gradient reduction (zero2.c), which zero.c's handle holds
 * for stage 2. Not installed. */
#ifndef DDP_SRC_SHARD_ZERO2_H
#define DDP_SRC_SHARD_ZERO2_H

#include "common/common.h"
#include "ddp/shard.h"

typedef struct ddp__zero2 ddp__zero2_t;

/* What the reduction reads from the ZeRO handle (borrowed; the arrays outlive z2). */
typedef struct ddp__zero2_cfg {
  ddp_pg_t *pg;
  int rank, world;
  size_t n;                        /* parameters, global order */
  const ddp_optim_param_t *params; /* [n] */
  const int *owner;                /* [n] */
  ddp_dtype_t dt;
  ddp_grad_arith_t arith;
  bool divide_in_place;
} ddp__zero2_cfg_t;

/* Buckets of DDP's initial layout (reverse parameter order, first_bytes then cap_bytes). */
ddp_status_t ddp__zero2_create(const ddp__zero2_cfg_t *cfg, size_t cap_bytes, size_t first_bytes,
                               ddp__zero2_t **out, ddp_error_t *err);
void ddp__zero2_destroy(ddp__zero2_t *z2);
/* ddp_zero_attach_model's work (shard.h). */
ddp_status_t ddp__zero2_attach(ddp__zero2_t *z2, ddp_model_t *model, size_t cap_bytes,
                               size_t first_bytes, ddp_error_t *err);
void ddp__zero2_set_sync(ddp__zero2_t *z2, bool sync);
/* ddp_zero_reduce_grads at stage 2: the buckets not launched yet, then every bucket's
 * completion. */
ddp_status_t ddp__zero2_reduce(ddp__zero2_t *z2, ddp_error_t *err);

#endif /* DDP_SRC_SHARD_ZERO2_H */
