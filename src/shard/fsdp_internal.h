/* Private to src/shard: what the ZeRO-3 state code (fsdp_state.c: checkpoints) sees of a
 * ddp_fsdp handle (fsdp.c), so that the two files share no struct layout. */
#ifndef DDP_SRC_SHARD_FSDP_INTERNAL_H
#define DDP_SRC_SHARD_FSDP_INTERNAL_H

#include "ddp/shard.h"

typedef struct ddp__fsdp_unit_view {
  const size_t *idx, *off; /* [np] model parameter indices, element offsets */
  size_t np, numel, S;     /* padded = S * world */
  unsigned char *shard;    /* [S] this rank's parameters */
} ddp__fsdp_unit_view_t;

typedef struct ddp__fsdp_view {
  ddp_pg_t *pg;
  ddp_model_t *model;
  int rank, world;
  ddp_dtype_t dt;
  size_t esz, nunits, nparams, ngroups;
  const int *group;        /* [nparams] optimizer group, -1 frozen */
  const size_t *piece_of;  /* [nparams] this rank's piece of parameter i, SIZE_MAX none */
  const size_t *piece_at;  /* [npieces] element offset of the piece in its unit's shard */
  ddp_optim_t *const *opt; /* [ngroups], over this rank's pieces in parameter order */
} ddp__fsdp_view_t;

void ddp__fsdp_view(ddp_fsdp_t *f, ddp__fsdp_view_t *v);
void ddp__fsdp_unit(ddp_fsdp_t *f, size_t ui, ddp__fsdp_unit_view_t *u);

#endif /* DDP_SRC_SHARD_FSDP_INTERNAL_H */
