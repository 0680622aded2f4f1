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

/* Hybrid sharding (hybrid.c): W ranks as N = W / L nodes of L. Rank r = n L + l is local
 * rank l of node n; the node group (r / L equal) shards, the replica group (r % L equal)
 * replicates. Not hybrid (L = W or 0): node = the whole group, replica NULL. */
typedef struct ddp__hybrid {
  ddp_pg_t *world;   /* the caller's group */
  ddp_pg_t *node;    /* the shard group (owned; == world when not hybrid) */
  ddp_pg_t *replica; /* owned; NULL when not hybrid */
  int W, L, N, n, l;
} ddp__hybrid_t;

/* Collective over pg: the node and replica groups for node size L (0: W). L that does not
 * divide W is DDP_ERR_INVALID_ARGUMENT naming both. */
ddp_status_t ddp__hybrid_create(ddp_pg_t *pg, int L, ddp__hybrid_t *h, ddp_error_t *err);
void ddp__hybrid_destroy(ddp__hybrid_t *h);
/* Collective: a unit's full local gradient gfull (padded elements, a multiple of W; its
 * contents are consumed) reduced into this rank's node shard gshard (padded / L elements,
 * [l S, (l + 1) S)) with arithmetic a (docs/sharding.md, "Hybrid sharding"). Of its
 * collectives only the default order's reduce-scatter is on the world group (the one a
 * flight-recorder tag set before the call names). */
ddp_status_t ddp__hybrid_reduce(const ddp__hybrid_t *h, ddp_grad_arith_t a, bool divide_in_place,
                                unsigned char *gfull, unsigned char *gshard, size_t padded,
                                ddp_dtype_t dt, ddp_error_t *err);
void ddp__fsdp_unit(ddp_fsdp_t *f, size_t ui, ddp__fsdp_unit_view_t *u);

#endif /* DDP_SRC_SHARD_FSDP_INTERNAL_H */
