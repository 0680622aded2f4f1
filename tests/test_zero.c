/* src/shard (include/ddp/shard.h) on its own: ddp_zero_partition on sizes whose greedy
 * result is worked out by hand below (PyTorch 1.13 ZeroRedundancyOptimizer
 * _partition_parameters: per group, largest first with a stable sort, each to the first
 * rank with the smallest total, totals shared across groups), and the sharded clip
 * (ddp_zero_clip_grad_norm) against ddp_clip_grad_norm over the full averaged gradients,
 * bit for bit, at stage 1 (gradients already averaged) and stage 2 (after the
 * reduce-scatter of local gradients, against DDP's x fl(1/W) rank-order sum); with
 * --sharding_arithmetic deepspeed, DeepSpeed ZeRO-1/2's clipping (written out below) at
 * both stages; stage 2 attached to a model, its buckets launched from the backward's
 * gradient-ready hooks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/shard.h"
#include "common/common.h"
#include "harness.h"
#include "parity.h"

/* ---------------------------------------------------------------- partition ------- */

static void partition(const int64_t *numel, const size_t *gn, size_t ng, int world, const int *want,
                      size_t n) {
  int owner[16];
  memset(owner, 0xff, sizeof owner);
  ddp_zero_partition(numel, gn, ng, world, owner);
  for (size_t i = 0; i < n; i++) {
    if (owner[i] != want[i])
      fail_msg("W=%d: parameter %zu (numel %lld) owned by rank %d, expected %d", world, i,
               (long long)numel[i], owner[i], want[i]);
  }
}

/* Sizes whose greedy partition is known by hand. */
static void test_partition_by_hand(void **state) {
  (void)state;
  /* 40 -> r0; 30 -> r1; 20 -> r1 (30 < 40); 10 -> r0 (40 < 50). */
  const int64_t a[] = {10, 40, 30, 20};
  const size_t an[] = {4};
  partition(a, an, 1, 2, (const int[]){0, 0, 1, 1}, 4);
  /* Ties: equal sizes keep their order, and a tie between ranks goes to the first. */
  const int64_t b[] = {5, 5, 5};
  const size_t bn[] = {3};
  partition(b, bn, 1, 2, (const int[]){0, 1, 0}, 3);
  /* Totals shared across groups: group 0 puts 100 on r0; group 1's ones go to r1, r2, r1. */
  const int64_t c[] = {100, 1, 1, 1};
  const size_t cn[] = {1, 3};
  partition(c, cn, 2, 3, (const int[]){0, 1, 2, 1}, 4);
  /* More ranks than parameters: the largest to r0, the next to r1, r2 and r3 own nothing. */
  const int64_t d[] = {3, 7};
  const size_t dn[] = {2};
  partition(d, dn, 1, 4, (const int[]){1, 0}, 2);
  /* One rank owns everything. */
  partition(a, an, 1, 1, (const int[]){0, 0, 0, 0}, 4);
  /* test_zero_parity.c's MLP 64-32-32-10 in Transformers' groups (weights, then biases):
   * W = 3: 2048 -> r0, 1024 -> r1, 320 -> r2; the biases 32, 32, 10 all to r2 (352, 384,
   * 394 stay below 1024). W = 2: 2048 -> r0, then everything to r1 (at most 1408). */
  const int64_t e[] = {2048, 1024, 320, 32, 32, 10};
  const size_t en[] = {3, 3};
  partition(e, en, 2, 3, (const int[]){0, 1, 2, 2, 2, 2}, 6);
  partition(e, en, 2, 2, (const int[]){0, 1, 1, 1, 1, 1}, 6);
}

/* ---------------------------------------------------------------- sharded clip ---- */

#define NP 5
static const int64_t SHAPES[NP] = {37, 300, 5, 64, 1};

typedef struct clip_cfg {
  int stage;
  double max_norm;
  ddp_store_t *store;
} clip_cfg_t;

/* Deterministic, rank-dependent local gradients and rank-independent parameters. */
static float gval(int rank, size_t i, int64_t k) {
  return (float)sin(0.37 * (double)(k + 1) * (double)(i + 2) + 0.9 * rank) *
         (float)(1.0 + 0.25 * (double)i);
}

/* This rank's member of a threads group over the shared store (20 s timeout). */
static ddp_status_t threads_group(ddp_test_rank_t *tr, ddp_store_t *shared, ddp_store_t **store,
                                  ddp_pg_t **pg) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = "threads";
  o.store = shared;
  o.timeout_ms = 20000;
  return ddp_test_pg_create(tr, &o, "create", store, pg);
}

/* This rank's parameters p, gradients g and the expected averaged gradients ref, one per
 * SHAPES entry, and the optimizer pairs over them. ref is DDP's average (each rank's
 * gradient x fl(1/W), summed in rank order) or, with divide, DeepSpeed's average_tensor
 * (each gradient / W, rank-order sum). At stage 1 the gradients are already averaged. */
static void fill(int rank, int W, int stage, bool divide, ddp_tensor_t *p, ddp_tensor_t *g,
                 ddp_tensor_t *ref, ddp_optim_param_t *pairs) {
  float inv = (float)(1.0 / W);
  for (size_t i = 0; i < NP; i++) {
    ddp_tensor_alloc(&p[i], DDP_F32, 1, &SHAPES[i]);
    ddp_tensor_alloc(&g[i], DDP_F32, 1, &SHAPES[i]);
    ddp_tensor_alloc(&ref[i], DDP_F32, 1, &SHAPES[i]);
    float *gd = g[i].data, *rd = ref[i].data;
    for (int64_t k = 0; k < SHAPES[i]; k++) {
      float avg = 0;
      for (int q = 0; q < W; q++) {
        float t = divide ? gval(q, i, k) / (float)W : gval(q, i, k) * inv;
        avg = q ? avg + t : t;
      }
      rd[k] = avg;
      gd[k] = stage == 1 ? avg : gval(rank, i, k);
    }
    pairs[i] = (ddp_optim_param_t){&p[i], &g[i]};
  }
}

static int clip_rank(ddp_test_rank_t *tr, void *arg) {
  const clip_cfg_t *cfg = arg;
  int rank = ddp_test_rank(tr), W = ddp_test_world_size(tr);
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t st = threads_group(tr, cfg->store, &store, &pg);
  if (st != DDP_OK) return st;
  ddp_tensor_t p[NP], g[NP], ref[NP];
  ddp_tensor_t *refp[NP];
  ddp_optim_param_t pairs[NP];
  fill(rank, W, cfg->stage, false, p, g, ref, pairs);
  for (size_t i = 0; i < NP; i++) refp[i] = &ref[i];
  ddp_zero_group_t grp = {DDP_ADAMW_OPTIONS_INIT, pairs, NP};
  ddp_zero_options_t zo = DDP_ZERO_OPTIONS_INIT;
  zo.stage = cfg->stage;
  ddp_zero_t *z = NULL;
  ddp_error_t err = {0};
  double total = -1, want = -2;
  st = ddp_zero_create(pg, &zo, &grp, 1, &z, &err);
  if (st == DDP_OK) st = ddp_zero_reduce_grads(z, &err);
  if (st == DDP_OK) st = ddp_zero_clip_grad_norm(z, cfg->max_norm, &total, &err);
  if (st != DDP_OK) ddp_test_say(tr, "%s", err.msg);
  if (st == DDP_OK) st = ddp_clip_grad_norm(refp, NP, cfg->max_norm, 2.0, false, &want, &err);
  int bad = 0;
  for (size_t i = 0; st == DDP_OK && i < NP && !bad; i++) {
    bool mine = ddp_zero_owner(z, i) == rank;
    if (!mine && cfg->stage == 2 && g[i].data) {
      ddp_test_say(tr, "stage 2: parameter %zu is not rank %d's but kept its gradient", i, rank);
      bad = 1;
    }
    if (!mine) continue;
    if (memcmp(g[i].data, ref[i].data, ddp_tensor_nbytes(&ref[i])) != 0) {
      ddp_test_say(tr, "parameter %zu: clipped gradient differs from ddp_clip_grad_norm's", i);
      bad = 1;
    }
  }
  if (st == DDP_OK && !bad && memcmp(&total, &want, sizeof total) != 0) {
    ddp_test_say(tr, "total norm %.17g, ddp_clip_grad_norm %.17g", total, want);
    bad = 1;
  }
  double vals[2] = {total, want};
  ddp_test_put(tr, vals, sizeof vals);
  ddp_zero_destroy(z);
  for (size_t i = 0; i < NP; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
    ddp_tensor_free(&ref[i]);
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st != DDP_OK ? (int)st : bad ? 1 : 0;
}

static void clip(int stage, int world, double max_norm) {
  clip_cfg_t cfg = {stage, max_norm, ddp_test_memory_store()};
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = world;
  ddp_test_results_t *res = ddp_test_spawn(&o, clip_rank, &cfg);
  ddp_test_expect_all(res, 0);
  double first[2];
  memcpy(first, ddp_test_result(res, 0)->values, sizeof first);
  for (int r = 1; r < world; r++) {
    double v[2];
    memcpy(v, ddp_test_result(res, r)->values, sizeof v);
    assert_memory_equal(v, first, sizeof v); /* the same norm on every rank */
  }
  print_message("stage %d W=%d max_norm %g: total norm %.9g (ddp_clip_grad_norm %.9g)\n", stage,
                world, max_norm, first[0], first[1]);
  assert_true(first[0] > max_norm); /* the clip scaled something */
  ddp_test_results_free(res);
  ddp_store_destroy(cfg.store);
}

/* Stage 1: the owners' gradients after the sharded clip are ddp_clip_grad_norm's bits. */
static void test_clip_stage1(void **state) {
  (void)state;
  clip(1, 2, 0.5);
  clip(1, 3, 0.5);
}

/* Stage 2: reduce-scatter then the sharded clip give the owners DDP's averaged and clipped
 * gradients bit for bit, and the others None. */
static void test_clip_stage2(void **state) {
  (void)state;
  clip(2, 2, 0.5);
  clip(2, 3, 0.5);
  clip(2, 4, 1.0);
}

/* ---------------------------------------------------------------- DeepSpeed's clip  */

/* DeepSpeed ZeRO-1/2's clipping (stage_1_and_2.py), written out for one group of the
 * SHAPES above: the flat group padded to a multiple of 2 W and cut into W partitions;
 * rank r's share is the f32 rounding of the f64 sum of its pieces' squared f64 norms; the
 * group norm the f32 square root of the shares summed in rank order; the total that norm
 * (the norm of one group norm); the coefficient 1 / max(1, (total + 1e-6) / max_norm) in
 * f32. avg[i] are the averaged gradients. */
static float deepspeed_ref(float *const *avg, int W, double max_norm, float *coef) {
  size_t total = 0, align = 2 * (size_t)W;
  for (size_t i = 0; i < NP; i++) total += (size_t)SHAPES[i];
  size_t psz = (total + align - 1) / align * align / (size_t)W;
  float sum = 0;
  for (int r = 0; r < W; r++) {
    double share = 0;
    for (size_t i = 0, off = 0; i < NP; off += (size_t)SHAPES[i], i++) {
      size_t lo = off > (size_t)r * psz ? off : (size_t)r * psz;
      size_t hi = off + (size_t)SHAPES[i] < (size_t)(r + 1) * psz ? off + (size_t)SHAPES[i]
                                                                  : (size_t)(r + 1) * psz;
      if (lo >= hi) continue;
      double acc = 0;
      for (size_t k = lo; k < hi; k++) acc += (double)avg[i][k - off] * avg[i][k - off];
      share += sqrt(acc) * sqrt(acc);
    }
    sum = r ? sum + (float)share : (float)share;
  }
  float gn = sqrtf(sum), t = (float)sqrt((double)gn * gn);
  float c = (t + 1e-6f) / (float)max_norm;
  *coef = 1.0f / (c < 1.0f ? 1.0f : c);
  return t;
}

static int ds_clip_rank(ddp_test_rank_t *tr, void *arg) {
  const clip_cfg_t *cfg = arg;
  int rank = ddp_test_rank(tr), W = ddp_test_world_size(tr);
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t st = threads_group(tr, cfg->store, &store, &pg);
  if (st != DDP_OK) return st;
  ddp_tensor_t p[NP], g[NP], ref[NP];
  float *refd[NP];
  ddp_optim_param_t pairs[NP];
  fill(rank, W, cfg->stage, true, p, g, ref, pairs);
  for (size_t i = 0; i < NP; i++) refd[i] = ref[i].data;
  float coef, want = deepspeed_ref(refd, W, cfg->max_norm, &coef);
  for (size_t i = 0; i < NP; i++)
    for (int64_t k = 0; k < SHAPES[i]; k++) refd[i][k] = refd[i][k] * coef;
  ddp_zero_group_t grp = {DDP_ADAMW_OPTIONS_INIT, pairs, NP};
  ddp_zero_options_t zo = DDP_ZERO_OPTIONS_INIT;
  zo.stage = cfg->stage;
  zo.arith = DDP_GRAD_ARITH_DEEPSPEED;
  ddp_zero_t *z = NULL;
  ddp_error_t err = {0};
  double total = -1;
  st = ddp_zero_create(pg, &zo, &grp, 1, &z, &err);
  if (st == DDP_OK) st = ddp_zero_reduce_grads(z, &err);
  if (st == DDP_OK) st = ddp_zero_clip_grad_norm(z, cfg->max_norm, &total, &err);
  if (st != DDP_OK) ddp_test_say(tr, "%s", err.msg);
  int bad = 0;
  if (st == DDP_OK && total != (double)want) {
    ddp_test_say(tr, "total norm %.9g, DeepSpeed's %.9g", total, (double)want);
    bad = 1;
  }
  for (size_t i = 0; st == DDP_OK && i < NP && !bad; i++)
    if (ddp_zero_owner(z, i) == rank &&
        memcmp(g[i].data, ref[i].data, ddp_tensor_nbytes(&ref[i])) != 0) {
      ddp_test_say(tr, "parameter %zu: clipped gradient differs from DeepSpeed's", i);
      bad = 1;
    }
  ddp_test_put(tr, &total, sizeof total);
  ddp_zero_destroy(z);
  for (size_t i = 0; i < NP; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
    ddp_tensor_free(&ref[i]);
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st != DDP_OK ? (int)st : bad ? 1 : 0;
}

/* --sharding_arithmetic deepspeed at stages 1 (every rank takes every piece's norm) and 2
 * (each owner its own, all-reduced): DeepSpeed's per-partition norm and coefficient above,
 * bit for bit, the same total on every rank (at W = 3 both partition boundaries cut
 * parameter 1, 300 elements). */
static void test_clip_deepspeed(void **state) {
  (void)state;
  const int worlds[] = {2, 3, 4};
  for (int stage = 1; stage <= 2; stage++)
    for (size_t w = 0; w < sizeof worlds / sizeof *worlds; w++) {
      clip_cfg_t cfg = {stage, 0.5, ddp_test_memory_store()};
      ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
      o.world = worlds[w];
      ddp_test_results_t *res = ddp_test_spawn(&o, ds_clip_rank, &cfg);
      ddp_test_expect_all(res, 0);
      double first;
      memcpy(&first, ddp_test_result(res, 0)->values, sizeof first);
      for (int r = 1; r < worlds[w]; r++)
        assert_memory_equal(ddp_test_result(res, r)->values, &first, sizeof first);
      print_message("deepspeed stage %d W=%d: total norm %.9g\n", stage, worlds[w], first);
      assert_true(first > 0.5);
      ddp_test_results_free(res);
      ddp_store_destroy(cfg.store);
    }
}

/* ---------------------------------------------------------------- stage 2 on a model */

/* A 6-40-30-5 MLP (six parameters), the same weights on every rank. */
static ddp_status_t mlp(ddp_model_t **out) {
  ddp_model_t *m = NULL;
  ddp_module_t *seq, *mod;
  static const int64_t dims[4] = {6, 40, 30, 5};
  DDP_CHECK(ddp_model_create(&m));
  ddp_status_t st;
  DDP_CHECK_GOTO(ddp_module_sequential(m, &seq), st, fail);
  for (int l = 0; l < 3; l++) {
    char name[8];
    snprintf(name, sizeof name, "%d", 2 * l);
    DDP_CHECK_GOTO(ddp_module_linear(m, name, dims[l], dims[l + 1], true, DDP_F32, &mod), st, fail);
    DDP_CHECK_GOTO(ddp_module_append(seq, mod), st, fail);
    if (l == 2) break;
    DDP_CHECK_GOTO(ddp_module_activation(m, DDP_ACT_TANH, &mod), st, fail);
    DDP_CHECK_GOTO(ddp_module_append(seq, mod), st, fail);
  }
  ddp_model_set_root(m, seq);
  DDP_CHECK_GOTO(ddp_model_finalize(m), st, fail);
  DDP_CHECK_GOTO(ddp_model_init(m, 11), st, fail);
  *out = m;
  return DDP_OK;
fail:
  ddp_model_destroy(m);
  return st;
}

/* Forward and backward of the MSE loss on micro-batch `mb` of this rank (rank-dependent
 * inputs and targets). */
static ddp_status_t mlp_step(ddp_model_t *m, ddp_ctx_t *ctx, int rank, int mb) {
  float x[4 * 6], y[4 * 5];
  for (int k = 0; k < 4 * 6; k++) x[k] = (float)sin(0.3 * k + 1.7 * rank + 0.45 * mb);
  for (int k = 0; k < 4 * 5; k++) y[k] = (float)cos(0.2 * k - 0.6 * rank + 0.8 * mb);
  ddp_var_t *vx, *vy, *out, *loss;
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, (int64_t[]){4, 6}, x, false, &vx));
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, (int64_t[]){4, 5}, y, false, &vy));
  DDP_CHECK(ddp_model_forward(m, ctx, vx, 0, &out));
  DDP_CHECK(ddp_mse_loss(ctx, out, vy, &loss));
  DDP_CHECK(ddp_backward(ctx, loss));
  ddp_ctx_reset(ctx);
  return DDP_OK;
}

#define MLP_NP 6
#define MLP_PSI (6 * 40 + 40 + 40 * 30 + 30 + 30 * 5 + 5)

typedef struct attach_cfg {
  ddp_store_t *store;
  int ga; /* micro-batches: the first ga - 1 with sync off */
} attach_cfg_t;

/* The reference: every rank's local gradient (the sum of its ga micro-batches, flat, in
 * model order), all-gathered, each x fl(1/W) and summed in rank order: DDP's average. */
static ddp_status_t attach_reference(ddp_pg_t *pg, ddp_model_t *m, ddp_ctx_t *ctx, int ga,
                                     float *ref) {
  int rank = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  for (int mb = 0; mb < ga; mb++) DDP_CHECK(mlp_step(m, ctx, rank, mb));
  float *all = calloc((size_t)W * MLP_PSI, sizeof *all);
  if (!all) return DDP_ERR_NO_MEMORY;
  ddp_tensor_t g = ddp_model_flat_grads(m, DDP_F32);
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allgather(pg, g.data, all, MLP_PSI, DDP_F32, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  float inv = (float)(1.0 / W);
  for (size_t k = 0; k < MLP_PSI; k++) {
    ref[k] = all[k] * inv;
    for (int q = 1; q < W; q++) ref[k] += all[(size_t)q * MLP_PSI + k] * inv;
  }
  free(all);
  ddp_model_set_grads_none(m);
  return st;
}

static int attach_rank(ddp_test_rank_t *tr, void *arg) {
  const attach_cfg_t *cfg = arg;
  int rank = ddp_test_rank(tr);
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_model_t *m = NULL;
  ddp_ctx_t *ctx = NULL;
  ddp_zero_t *z = NULL;
  ddp_error_t err = {0};
  float ref[MLP_PSI];
  int bad = 0;
  ddp_status_t st = threads_group(tr, cfg->store, &store, &pg);
  if (st != DDP_OK) return st;
  DDP_CHECK_GOTO(mlp(&m), st, out);
  DDP_CHECK_GOTO(ddp_ctx_create(&ctx), st, out);
  DDP_CHECK_GOTO(attach_reference(pg, m, ctx, cfg->ga, ref), st, out);
  ddp_optim_param_t pairs[MLP_NP];
  for (size_t i = 0; i < MLP_NP; i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    pairs[i] = (ddp_optim_param_t){&p->value, &p->grad};
  }
  ddp_zero_group_t grp = {DDP_ADAMW_OPTIONS_INIT, pairs, MLP_NP};
  ddp_zero_options_t zo = DDP_ZERO_OPTIONS_INIT;
  zo.stage = 2;
  DDP_CHECK_GOTO(ddp_zero_create(pg, &zo, &grp, 1, &z, &err), st, out);
  /* 0.002 MiB: 524 floats a bucket, so the six parameters make several buckets */
  DDP_CHECK_GOTO(ddp_zero_attach_model(z, m, 0.002, &err), st, out);
  double sent0 = ddp_pg_bytes_sent(pg);
  for (int mb = 0; mb < cfg->ga; mb++) {
    ddp_zero_set_sync(z, mb == cfg->ga - 1);
    DDP_CHECK_GOTO(mlp_step(m, ctx, rank, mb), st, out);
  }
  /* every bucket was launched from the hooks, inside backward: the reduction after it
   * sends nothing more */
  double in_backward = ddp_pg_bytes_sent(pg) - sent0;
  DDP_CHECK_GOTO(ddp_zero_reduce_grads(z, &err), st, out);
  double after = ddp_pg_bytes_sent(pg) - sent0 - in_backward;
  if (!(in_backward > 0) || after != 0) {
    ddp_test_say(tr, "sent %.0f bytes during backward, %.0f after it", in_backward, after);
    bad = 1;
  }
  for (size_t i = 0, off = 0; i < MLP_NP && !bad; off += (size_t)pairs[i].param->numel, i++) {
    const ddp_tensor_t *g = pairs[i].grad;
    if (ddp_zero_owner(z, i) != rank) {
      if (g->data)
        ddp_test_say(tr, "parameter %zu is not rank %d's but kept its gradient", i, rank);
      bad = g->data != NULL;
    } else if (!g->data || memcmp(g->data, ref + off, ddp_tensor_nbytes(g)) != 0) {
      ddp_test_say(tr, "parameter %zu: reduced gradient differs from DDP's average", i);
      bad = 1;
    }
  }
out:
  if (st != DDP_OK) ddp_test_say(tr, "%s", err.msg[0] ? err.msg : ddp_status_name(st));
  ddp_zero_destroy(z);
  ddp_ctx_destroy(ctx);
  ddp_model_destroy(m);
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st != DDP_OK ? (int)st : bad;
}

/* Stage 2 attached to a model: the buckets are launched from the gradient-ready hooks during
 * backward (their bytes are all sent before ddp_zero_reduce_grads), and ddp_zero_reduce_grads
 * leaves the owners DDP's averaged gradients bit for bit and the others None, with gradient
 * accumulation (sync off, then on) too. */
static void test_stage2_attached(void **state) {
  (void)state;
  for (int world = 2; world <= 4; world++)
    for (int ga = 1; ga <= 3; ga += 2) {
      attach_cfg_t cfg = {ddp_test_memory_store(), ga};
      ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
      o.world = world;
      ddp_test_results_t *res = ddp_test_spawn(&o, attach_rank, &cfg);
      ddp_test_expect_all(res, 0);
      ddp_test_results_free(res);
      ddp_store_destroy(cfg.store);
    }
}

/* ---------------------------------------------------------------- consolidation --- */

/* Shards of one AdamW group (parameters 0 and 2 in one, 1 in the other, saved under their
 * group indices) consolidate into the bytes ddp_optim_save writes for the whole group with
 * the same state; a shard given twice and a tensor that is not state are refused naming
 * the files; ddp_optim_load_indexed takes a subset back. */
static void test_consolidate(void **state) {
  (void)state;
  char dir[256], a[300], b[300], full[300], out[300], bad[300];
  assert_true(ddp_test_make_scratch(dir, sizeof dir, "zero_consolidate"));
  snprintf(a, sizeof a, "%s/optimizer-00001-of-00002.safetensors", dir);
  snprintf(b, sizeof b, "%s/optimizer-00002-of-00002.safetensors", dir);
  snprintf(full, sizeof full, "%s/full.safetensors", dir);
  snprintf(out, sizeof out, "%s/optimizer.safetensors", dir);
  snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
  const int64_t shapes[3] = {7, 3, 5};
  ddp_tensor_t p[3], g[3];
  ddp_optim_param_t all[3];
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ddp_tensor_alloc(&p[i], DDP_F32, 1, &shapes[i]), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&g[i], DDP_F32, 1, &shapes[i]), DDP_OK);
    for (int64_t k = 0; k < shapes[i]; k++) {
      ((float *)p[i].data)[k] = 0.1f * (float)(k + i);
      ((float *)g[i].data)[k] = gval(0, (size_t)i, k);
    }
    all[i] = (ddp_optim_param_t){&p[i], &g[i]};
  }
  ddp_optim_options_t o = DDP_ADAMW_OPTIONS_INIT;
  ddp_optim_t *whole = NULL, *s0 = NULL, *s1 = NULL;
  ddp_optim_param_t p02[2] = {all[0], all[2]};
  assert_int_equal(ddp_optim_create(&o, all, 3, &whole, NULL), DDP_OK);
  assert_int_equal(ddp_optim_create(&o, p02, 2, &s0, NULL), DDP_OK);
  assert_int_equal(ddp_optim_create(&o, &all[1], 1, &s1, NULL), DDP_OK);
  /* The shards step first (on the same parameters), the whole optimizer last; the state
   * depends only on the gradients, which do not change. */
  assert_int_equal(ddp_optim_step(s0, NULL), DDP_OK);
  assert_int_equal(ddp_optim_step(s1, NULL), DDP_OK);
  assert_int_equal(ddp_optim_step(whole, NULL), DDP_OK);
  const size_t i02[2] = {0, 2}, i1[1] = {1};
  assert_int_equal(ddp_optim_save_indexed(s0, a, i02, NULL), DDP_OK);
  assert_int_equal(ddp_optim_save_indexed(s1, b, i1, NULL), DDP_OK);
  assert_int_equal(ddp_optim_save(whole, full, NULL), DDP_OK);
  const char *shards[2] = {b, a}; /* any order */
  assert_int_equal(ddp_zero_consolidate(shards, 2, out, NULL), DDP_OK);
  size_t na = 0, nb = 0;
  char *x = ddp_test_read_file(out, &na), *y = ddp_test_read_file(full, &nb);
  assert_non_null(x);
  assert_non_null(y);
  assert_int_equal(na, nb);
  assert_memory_equal(x, y, na);
  free(x);
  free(y);
  /* A subset back from the consolidated file: the same bytes as the shard it came from. */
  ddp_optim_t *back = NULL;
  assert_int_equal(ddp_optim_create(&o, p02, 2, &back, NULL), DDP_OK);
  assert_int_equal(ddp_optim_load_indexed(back, out, i02, NULL), DDP_OK);
  assert_int_equal(ddp_optim_save_indexed(back, bad, i02, NULL), DDP_OK);
  x = ddp_test_read_file(bad, &na);
  y = ddp_test_read_file(a, &nb);
  assert_int_equal(na, nb);
  assert_memory_equal(x, y, na);
  free(x);
  free(y);
  /* A shard given twice. */
  ddp_error_t err = {0};
  const char *twice[2] = {a, a};
  assert_int_equal(ddp_zero_consolidate(twice, 2, out, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "'state.0.step' is in both"));
  assert_non_null(strstr(err.msg, "optimizer-00001-of-00002.safetensors"));
  /* A file that is not a shard of this optimizer. */
  ddp_st_entry_t e = {"model.weight", &p[0]};
  assert_int_equal(ddp_st_write(bad, &e, 1, NULL, NULL, 0, NULL), DDP_OK);
  const char *mixed[2] = {bad, a};
  assert_int_equal(ddp_zero_consolidate(mixed, 2, out, &err), DDP_ERR_INVALID_DATA);
  print_message("%s\n", err.msg);
  assert_non_null(strstr(err.msg, "bad.safetensors and "));
  assert_non_null(strstr(err.msg, "hold different optimizers"));
  ddp_optim_destroy(whole);
  ddp_optim_destroy(s0);
  ddp_optim_destroy(s1);
  ddp_optim_destroy(back);
  for (int i = 0; i < 3; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
  }
  assert_int_equal(ddp_test_remove_scratch(dir, false), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_partition_by_hand), cmocka_unit_test(test_clip_stage1),
      cmocka_unit_test(test_clip_stage2),       cmocka_unit_test(test_clip_deepspeed),
      cmocka_unit_test(test_stage2_attached),   cmocka_unit_test(test_consolidate),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
