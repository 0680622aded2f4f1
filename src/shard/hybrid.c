/* Hybrid sharding (FSDP's HYBRID_SHARD and _HYBRID_SHARD_ZERO2; include/ddp/shard.h,
 * docs/sharding.md "Hybrid sharding"): shard within a node, replicate across nodes.
 *
 * Groups. W ranks form N = W / L nodes of L ranks (L: the launcher's LOCAL_WORLD_SIZE or
 * the caller's choice): rank r = n L + l. The node group (ranks n L .. n L + L - 1) holds
 * one copy of the model, sharded as FULL_SHARD shards it over L ranks; the replica group
 * (ranks l, L + l, 2 L + l, ...) holds the same shard on every node. Both are ddp_pg_split
 * groups of the caller's, made once at create. Parameters are all-gathered in the node
 * group only (fsdp.c).
 *
 * The gradient reduction is where the bits are decided. FSDP reduce-scatters a unit's
 * gradient inside the node and then all-reduces the shard across nodes (PyTorch 2.x
 * torch/distributed/fsdp/_runtime_utils.py `_reduce_grad`: reduce_scatter_tensor over the
 * node's process_group, then all_reduce over `_inter_node_pg`, with FSDP1's divide factors
 * of the whole data-parallel size W, `_init_utils.py` `_init_process_group_state`; FSDP2's
 * `foreach_reduce` in `_fsdp_collectives.py` does the same with its reduce_scatter_group
 * and all_reduce_group). For 2 nodes of 2 that sums (g0 + g1) + (g2 + g3), which is not
 * DDP's ((g0 + g1) + g2) + g3. So by default (arithmetic ddp, deepspeed,
 * deepspeed_allreduce: each one sum over all ranks) the unit's padded gradient, cut into W
 * pieces of P = padded / W, is reduce-scattered over ALL W ranks, libddp's rank-order sum,
 * with the pieces permuted so that rank n L + l receives piece l N + n; then the N pieces
 * of the replica group are all-gathered, giving rank l of every node pieces l N .. l N +
 * N - 1, which is its node shard [l S, (l + 1) S), S = N P. Every element is then DDP's
 * sum, bit for bit. Each rank sends (W - 1) P + (N - 1) P = (W + N - 2) P, what FSDP's
 * (L - 1) P N + 2 (N - 1) P sends too, but (N - 1)(L + 1) P of it crosses nodes against
 * FSDP's 2 (N - 1) P: the price of DDP's bits on real nodes (docs/sharding.md). Under
 * --sharding_arithmetic fsdp1 and fsdp2 the two-stage order is FSDP's own: pre-divide (FSDP1: by f
 * of W), reduce-scatter in the node, all-reduce SUM across nodes, post-divide (FSDP1: W / f; FSDP2
 * with a SUM-only backend: W, after the all-reduce). */
#include <string.h>

#include "common/common.h"
#include "ddp/shard.h"
#include "shard/fsdp_internal.h"

ddp_status_t ddp__hybrid_create(ddp_pg_t *pg, int L, ddp__hybrid_t *h, ddp_error_t *err) {
  int W = ddp_pg_size(pg), r = ddp_pg_rank(pg);
  if (L <= 0) L = W;
  *h = (ddp__hybrid_t){pg, pg, NULL, W, L, W / L, r / L, r % L};
  if (W % L != 0)
    return ddp__error(err, r, DDP_ERR_INVALID_ARGUMENT,
                      "fsdp: hybrid sharding's node size %d does not divide the world size %d "
                      "(each node must hold the same number of ranks)",
                      L, W);
  if (L == W) return DDP_OK; /* one node: FULL_SHARD */
  h->node = NULL;
  ddp_status_t st = ddp_pg_split(pg, h->n, &h->node, err);
  if (st == DDP_OK) st = ddp_pg_split(pg, h->l, &h->replica, err);
  if (st != DDP_OK) {
    ddp__hybrid_destroy(h);
    ddp_error_t why = err ? *err : (ddp_error_t){st, ""};
    return ddp__error_quiet(err, st, "fsdp: hybrid sharding's node and replica groups: %s",
                            why.msg);
  }
  return DDP_OK;
}

void ddp__hybrid_destroy(ddp__hybrid_t *h) {
  if (h->node && h->node != h->world) ddp_pg_destroy(h->node);
  ddp_pg_destroy(h->replica);
  h->node = h->world;
  h->replica = NULL;
}

static ddp_status_t coll(ddp_pg_t *pg, ddp_status_t st, const char *what, ddp_error_t *err) {
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t pe;
  ddp_pg_last_error_copy(pg, &pe);
  return ddp__error_quiet(err, st, "%s: %s", what, pe.msg);
}

ddp_status_t ddp__hybrid_reduce(const ddp__hybrid_t *h, ddp_grad_arith_t a, bool divide_in_place,
                                unsigned char *gfull, unsigned char *gshard, size_t padded,
                                ddp_dtype_t dt, ddp_error_t *err) {
  size_t esz = ddp_dtype_size(dt), S = padded / (size_t)h->L;
  bool fsdp = a == DDP_GRAD_ARITH_FSDP1 || a == DDP_GRAD_ARITH_FSDP2;
  if (fsdp) { /* FSDP's order: inside the node, then across nodes */
    ddp_grad_arith_pre(a, h->W, divide_in_place, gfull, gfull, padded, dt);
    DDP_CHECK(coll(h->node, ddp_reduce_scatter(h->node, gfull, gshard, S, dt, DDP_OP_SUM, NULL),
                   "gradient reduce_scatter in the node", err));
    DDP_CHECK(coll(h->replica, ddp_allreduce(h->replica, gshard, gshard, S, dt, DDP_OP_SUM, NULL),
                   "gradient all_reduce across nodes", err));
    ddp_grad_arith_post(a, h->W, gshard, S, dt);
    return DDP_OK;
  }
  /* DDP's order: one rank-order sum over all W ranks, each rank receiving piece l N + n */
  size_t P = padded / (size_t)h->W;
  unsigned char *perm = ddp__aligned_alloc((padded + P) * esz);
  if (!perm)
    return ddp__error(err, ddp_pg_rank(h->world), DDP_ERR_NO_MEMORY,
                      "fsdp: out of memory for the hybrid gradient (%zu bytes)",
                      (padded + P) * esz);
  for (int j = 0; j < h->W; j++) {
    size_t piece = (size_t)(j % h->L) * (size_t)h->N + (size_t)(j / h->L);
    ddp_grad_arith_pre(a, h->W, divide_in_place, perm + (size_t)j * P * esz,
                       gfull + piece * P * esz, P, dt);
  }
  unsigned char *mine = perm + (size_t)h->W * P * esz; /* [P]: this rank's piece */
  ddp_status_t st = coll(h->world,
                         ddp_reduce_scatter(h->world, perm, mine, P, dt, DDP_OP_SUM, NULL),
                         "gradient reduce_scatter over all ranks", err);
  if (st == DDP_OK) {
    ddp_grad_arith_post(a, h->W, mine, P, dt);
    st = coll(h->replica, ddp_allgather(h->replica, mine, gshard, P, dt, NULL),
              "gradient all_gather across nodes", err);
  }
  ddp__aligned_free(perm);
  return st;
}
