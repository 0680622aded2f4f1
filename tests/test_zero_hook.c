/* ZeRO-1 overlapped with DDP (ddp_zero_overlap_*, include/ddp/shard.h): PyTorch 1.13's
 * hook_with_zero_step and hook_with_zero_step_interleaved against plain DDP on the same
 * batches from the same start.
 *
 * The contract tested: a run of T synchronised iterations with the hook ends with the
 * parameters, bit for bit, of DDP followed by the same optimizer (AdamW with weight decay,
 * two groups: weights with decay, biases without) on the same batches, with the optimizer
 * step skipped in the first 2 iterations (3 with static_graph) and the lr of iteration t at
 * iteration t. The parameters are unchanged through the warm-up, the hook reports T - 2
 * updates, every rank ends with the same parameters, and the buckets (a tiny bucket cap:
 * several per rank) go to ranks i % W, or, with shard_buckets, by PyTorch's threshold.
 * Also ZeRO-1's parameters_as_bucket_view: the buckets' layout, the bits of the
 * per-parameter broadcasts, the parameters restored by destroy. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ddp/optim.h"
#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "common/common.h"
#include "harness.h"

#define IN 8
#define HID 16
#define OUT 4
#define ROWS 6 /* per rank per iteration */
#define MAXP 8

typedef struct cfg {
  int world;
  int iters;
  int mode; /* 0: DDP reference, 1: hook_with_zero_step, 2: _interleaved */
  bool shard_buckets;
  bool static_graph;
  bool divide_in_place; /* gradient_as_bucket_view */
  int skip;             /* reference: iterations without a step */
  ddp_store_t *store;
} cfg_t;

/* Sequential: Linear(IN,HID), Tanh, Linear(HID,HID), Tanh, Linear(HID,OUT). */
static ddp_status_t build(ddp_model_t **out) {
  ddp_model_t *m = NULL;
  ddp_module_t *seq, *l0, *a1, *l2, *a3, *l4;
  DDP_CHECK(ddp_model_create(&m));
  ddp_status_t st = ddp_module_sequential(m, &seq);
  if (st == DDP_OK) st = ddp_module_linear(m, "0", IN, HID, true, DDP_F32, &l0);
  if (st == DDP_OK) st = ddp_module_activation(m, DDP_ACT_TANH, &a1);
  if (st == DDP_OK) st = ddp_module_linear(m, "2", HID, HID, true, DDP_F32, &l2);
  if (st == DDP_OK) st = ddp_module_activation(m, DDP_ACT_TANH, &a3);
  if (st == DDP_OK) st = ddp_module_linear(m, "4", HID, OUT, true, DDP_F32, &l4);
  ddp_module_t *mods[] = {l0, a1, l2, a3, l4};
  for (size_t k = 0; st == DDP_OK && k < 5; k++) st = ddp_module_append(seq, mods[k]);
  if (st == DDP_OK) {
    ddp_model_set_root(m, seq);
    st = ddp_model_finalize(m);
  }
  if (st == DDP_OK) st = ddp_model_init(m, 7);
  if (st != DDP_OK) {
    ddp_model_destroy(m);
    return st;
  }
  *out = m;
  return DDP_OK;
}

/* Forward, MSE loss and backward of this rank's rows of iteration it. */
static ddp_status_t iteration(ddp_ddp_t *ddp, ddp_ctx_t *ctx, int rank, int it) {
  float x[ROWS * IN], y[ROWS * OUT];
  for (int i = 0; i < ROWS; i++) {
    int r = rank * ROWS + i;
    for (int j = 0; j < IN; j++) x[i * IN + j] = (float)sin(0.37 * r + 0.11 * j + 0.7 * it);
    for (int k = 0; k < OUT; k++) y[i * OUT + k] = (float)cos(0.23 * r - 0.5 * k + 0.3 * it);
  }
  int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
  ddp_var_t *vx, *vy, *out, *loss;
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, xs, x, false, &vx));
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, ys, y, false, &vy));
  DDP_CHECK(ddp_ddp_forward(ddp, ctx, vx, 0, &out));
  DDP_CHECK(ddp_mse_loss(ctx, out, vy, &loss));
  ddp_status_t st = ddp_ddp_backward(ddp, ctx, loss);
  ddp_ctx_reset(ctx);
  return st;
}

static double lr_at(int it) { return 1e-2 * (1.0 - 0.05 * it); }

static bool rebuilt(void *user) {
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(user, &ld);
  return ld.has_rebuilt_buckets;
}

typedef struct rank_state {
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_model_t *m;
  ddp_ddp_t *ddp;
  ddp_ctx_t *ctx;
  ddp_optim_t *opt[2];
  ddp_zero_overlap_t *z;
  ddp_optim_param_t pairs[MAXP];
  size_t ngrp[2];
} rank_state_t;

/* Weights (decay 0.1) first, then biases (no decay): the trainer's two groups. */
static void groups(rank_state_t *s, ddp_zero_group_t g[2]) {
  ddp_optim_options_t wd = DDP_ADAMW_OPTIONS_INIT, nd = DDP_ADAMW_OPTIONS_INIT;
  wd.weight_decay = 0.1;
  nd.weight_decay = 0.0;
  size_t n = 0;
  for (int pass = 0; pass < 2; pass++) {
    s->ngrp[pass] = 0;
    for (size_t i = 0; i < ddp_model_num_params(s->m); i++) {
      ddp_param_t *p = ddp_model_param(s->m, i);
      if ((p->value.ndim == 2) != (pass == 0)) continue;
      s->pairs[n++] = (ddp_optim_param_t){&p->value, &p->grad};
      s->ngrp[pass]++;
    }
  }
  g[0] = (ddp_zero_group_t){wd, s->pairs, s->ngrp[0]};
  g[1] = (ddp_zero_group_t){nd, s->pairs + s->ngrp[0], s->ngrp[1]};
}

static int run_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  int rank = ddp_test_rank(tr);
  rank_state_t s = {0};
  ddp_error_t err = {0};
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.backend = "threads";
  po.store = cfg->store;
  po.timeout_ms = 20000;
  ddp_status_t st = ddp_test_pg_create(tr, &po, "pg create", &s.store, &s.pg);
  if (st != DDP_OK) return st;
  ddp_ddp_options_t dopts = DDP_DDP_OPTIONS_INIT;
  dopts.bucket_cap_mb = 0.0003; /* ~315 bytes: several buckets */
  dopts.static_graph = cfg->static_graph;
  dopts.gradient_as_bucket_view = cfg->divide_in_place;
  st = build(&s.m);
  if (st == DDP_OK) st = ddp_ddp_create(s.m, s.pg, &dopts, &s.ddp, &err);
  if (st == DDP_OK) st = ddp_ctx_create(&s.ctx);
  ddp_zero_group_t g[2];
  if (st == DDP_OK) groups(&s, g);
  if (st == DDP_OK && cfg->mode == 0) {
    for (int k = 0; k < 2 && st == DDP_OK; k++)
      st = ddp_optim_create(&g[k].opts, g[k].params, g[k].n, &s.opt[k], &err);
  } else if (st == DDP_OK) {
    ddp_zero_overlap_options_t o = DDP_ZERO_OVERLAP_OPTIONS_INIT;
    o.kind = cfg->mode == 1 ? DDP_ZERO_HOOK_STEP : DDP_ZERO_HOOK_STEP_INTERLEAVED;
    o.shard_buckets = cfg->shard_buckets;
    o.has_rebuilt_buckets = rebuilt;
    o.user = s.ddp;
    o.divide_in_place = cfg->divide_in_place;
    st = ddp_zero_overlap_create(s.pg, &o, g, 2, NULL, &s.z, &err);
    ddp_comm_hook_t h;
    if (st == DDP_OK) {
      ddp_zero_overlap_hook(s.z, &h);
      st = ddp_ddp_register_comm_hook(s.ddp, &h, &err);
    }
  }
  size_t np = ddp_model_num_params(s.m);
  float *init = calloc(4096, sizeof *init);
  int bad = 0;
  for (size_t i = 0, o = 0; st == DDP_OK && i < np;
       o += (size_t)ddp_model_param(s.m, i)->value.numel, i++)
    memcpy(init + o, ddp_model_param(s.m, i)->value.data,
           (size_t)ddp_model_param(s.m, i)->value.numel * 4);
  for (int it = 0; st == DDP_OK && it < cfg->iters; it++) {
    if (s.z) ddp_zero_overlap_set_lr(s.z, lr_at(it));
    st = iteration(s.ddp, s.ctx, rank, it);
    if (st != DDP_OK) {
      ddp_ddp_last_error_copy(s.ddp, &err);
      break;
    }
    for (int k = 0; k < 2 && s.opt[0] && it >= cfg->skip; k++) {
      ddp_optim_set_lr(s.opt[k], lr_at(it));
      st = ddp_optim_step(s.opt[k], &err);
    }
    for (int k = 0; k < 2; k++)
      for (size_t j = 0; j < g[k].n; j++)
        memset(g[k].params[j].grad->data, 0, (size_t)g[k].params[j].grad->numel * 4);
    int warm = cfg->static_graph ? 3 : 2;
    if (s.z && it == warm - 1) { /* the warm-up updated nothing */
      for (size_t i = 0, o = 0; i < np; o += (size_t)ddp_model_param(s.m, i)->value.numel, i++)
        if (memcmp(init + o, ddp_model_param(s.m, i)->value.data,
                   (size_t)ddp_model_param(s.m, i)->value.numel * 4) != 0) {
          ddp_test_say(tr, "parameter %zu changed during the warm-up (iteration %d)", i, it);
          bad = 1;
        }
      if (ddp_zero_overlap_updates(s.z) != 0) bad = 1;
    }
  }
  if (st != DDP_OK) ddp_test_say(tr, "%s", err.msg);
  int64_t upd = s.z ? ddp_zero_overlap_updates(s.z) : -1;
  int owners[MAXP];
  for (size_t i = 0; i < MAXP; i++) owners[i] = s.z && i < np ? ddp_zero_overlap_owner(s.z, i) : -2;
  ddp_test_put(tr, &upd, sizeof upd);
  ddp_test_put(tr, owners, sizeof owners);
  for (size_t i = 0; st == DDP_OK && i < np; i++) {
    ddp_param_t *p = ddp_model_param(s.m, i);
    ddp_test_put(tr, p->value.data, (size_t)p->value.numel * 4);
  }
  free(init);
  ddp_ctx_destroy(s.ctx);
  ddp_ddp_destroy(s.ddp);
  ddp_zero_overlap_destroy(s.z);
  for (int k = 0; k < 2; k++) ddp_optim_destroy(s.opt[k]);
  ddp_model_destroy(s.m);
  ddp_pg_destroy(s.pg);
  ddp_store_destroy(s.store);
  return st != DDP_OK ? (int)st : bad;
}

static ddp_test_results_t *spawn(cfg_t *cfg) {
  cfg->store = ddp_test_memory_store();
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = cfg->world;
  ddp_test_results_t *res = ddp_test_spawn(&o, run_rank, cfg);
  ddp_test_expect_all(res, 0);
  ddp_store_destroy(cfg->store);
  return res;
}

/* The hook's run (mode, shard_buckets) against DDP with the warm-up's steps skipped. */
static void parity(int world, int mode, bool shard_buckets, bool static_graph, bool in_place) {
  const int iters = 7, warm = static_graph ? 3 : 2;
  cfg_t ref = {world, iters, 0, false, static_graph, in_place, warm, NULL};
  cfg_t hk = {world, iters, mode, shard_buckets, static_graph, in_place, 0, NULL};
  ddp_test_results_t *a = spawn(&ref), *b = spawn(&hk);
  const ddp_test_result_t *r0 = ddp_test_result(b, 0);
  int64_t upd;
  memcpy(&upd, r0->values, sizeof upd);
  assert_int_equal(upd, iters - warm);
  int owners[MAXP];
  memcpy(owners, (const char *)r0->values + sizeof upd, sizeof owners);
  int seen[8] = {0};
  for (int i = 0; i < 6; i++) {
    assert_true(owners[i] >= 0 && owners[i] < world);
    seen[owners[i]] = 1;
  }
  for (int r = 0; r < world; r++) assert_true(seen[r]); /* every rank steps something */
  size_t head = sizeof upd + sizeof owners;
  const ddp_test_result_t *d0 = ddp_test_result(a, 0);
  assert_int_equal(r0->nvalues - head, d0->nvalues - head);
  for (int r = 0; r < world; r++) { /* every rank: DDP's bits */
    const ddp_test_result_t *x = ddp_test_result(b, r);
    assert_int_equal(x->nvalues, r0->nvalues);
    assert_memory_equal((const char *)x->values + head, (const char *)d0->values + head,
                        r0->nvalues - head);
  }
  print_message("W=%d %s%s%s%s: %lld updates after the warm-up, DDP's bits\n", world,
                mode == 1 ? "hook_with_zero_step" : "hook_with_zero_step_interleaved",
                shard_buckets ? " shard_buckets" : "", static_graph ? " static_graph" : "",
                in_place ? " gradient_as_bucket_view" : "", (long long)upd);
  ddp_test_results_free(a);
  ddp_test_results_free(b);
}

static void test_step(void **state) {
  (void)state;
  parity(2, 1, false, false, false);
  parity(3, 1, false, false, false);
}

static void test_interleaved(void **state) {
  (void)state;
  parity(2, 2, false, false, false);
  parity(3, 2, false, false, true);
}

static void test_shard_buckets(void **state) {
  (void)state;
  parity(2, 1, true, false, false);
  parity(3, 2, true, false, false);
}

/* static_graph: DDP rebuilds after the second iteration, so 3 iterations update nothing. */
static void test_static_graph(void **state) {
  (void)state;
  parity(2, 1, false, true, false);
}

/* ---------------------------------------------------------------- bucket view ----- */

/* parameters_as_bucket_view at stage 1: five parameters of sizes 37, 300, 5, 64, 1 in one
 * group; W = 3 gives rank 0 {300}, rank 1 {64}, rank 2 {37, 5, 1} (numel descending). Each
 * rank's parameters must be consecutive in that order in one buffer, a step must leave
 * every rank with the bits of the same step without the view, and destroy must point the
 * parameters back at their own storage with the values kept. */
#define NV 5
static const int64_t VSHAPES[NV] = {37, 300, 5, 64, 1};

typedef struct view_cfg {
  bool view;
  ddp_store_t *store;
} view_cfg_t;

static int view_rank(ddp_test_rank_t *tr, void *arg) {
  const view_cfg_t *cfg = arg;
  int rank = ddp_test_rank(tr);
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.backend = "threads";
  po.store = cfg->store;
  po.timeout_ms = 20000;
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_status_t st = ddp_test_pg_create(tr, &po, "pg create", &store, &pg);
  if (st != DDP_OK) return st;
  ddp_tensor_t p[NV], g[NV];
  void *own[NV];
  ddp_optim_param_t pairs[NV];
  for (size_t i = 0; i < NV; i++) {
    ddp_tensor_alloc(&p[i], DDP_F32, 1, &VSHAPES[i]);
    ddp_tensor_alloc(&g[i], DDP_F32, 1, &VSHAPES[i]);
    for (int64_t k = 0; k < VSHAPES[i]; k++) {
      ((float *)p[i].data)[k] = (float)cos(0.1 * (double)k + (double)i);
      ((float *)g[i].data)[k] = (float)sin(0.3 * (double)k - (double)i); /* averaged already */
    }
    own[i] = p[i].data;
    pairs[i] = (ddp_optim_param_t){&p[i], &g[i]};
  }
  ddp_zero_group_t grp = {DDP_ADAMW_OPTIONS_INIT, pairs, NV};
  ddp_zero_options_t zo = DDP_ZERO_OPTIONS_INIT;
  zo.parameters_as_bucket_view = cfg->view;
  ddp_zero_t *z = NULL;
  ddp_error_t err = {0};
  int bad = 0;
  st = ddp_zero_create(pg, &zo, &grp, 1, &z, &err);
  if (st == DDP_OK && cfg->view) { /* rank r's parameters back to back, largest first */
    static const int order[3][3] = {{1, -1, -1}, {3, -1, -1}, {0, 2, 4}};
    for (int r = 0; r < 3; r++)
      for (int k = 1; k < 3 && order[r][k] >= 0; k++) {
        const ddp_tensor_t *a = &p[order[r][k - 1]], *b = &p[order[r][k]];
        if ((char *)a->data + a->numel * 4 != (char *)b->data) bad = 1;
      }
    for (size_t i = 0; i < NV; i++)
      if (p[i].data == own[i] || ddp_zero_owner(z, i) != (i == 1 ? 0 : i == 3 ? 1 : 2)) bad = 1;
    if (bad) ddp_test_say(tr, "rank %d: the buckets' layout is not the partition's", rank);
  }
  for (int it = 0; st == DDP_OK && it < 3; it++) st = ddp_zero_step(z, 1e-2, &err);
  if (st != DDP_OK) ddp_test_say(tr, "%s", err.msg);
  float vals[407];
  size_t o = 0;
  for (size_t i = 0; i < NV; i++, o += (size_t)VSHAPES[i - 1])
    memcpy(vals + o, p[i].data, (size_t)VSHAPES[i] * 4);
  ddp_zero_destroy(z);
  for (size_t i = 0, off = 0; i < NV; off += (size_t)VSHAPES[i], i++)
    if (p[i].data != own[i] || memcmp(p[i].data, vals + off, (size_t)VSHAPES[i] * 4) != 0) {
      ddp_test_say(tr, "rank %d: parameter %zu not restored by destroy", rank, i);
      bad = 1;
    }
  ddp_test_put(tr, vals, sizeof vals);
  for (size_t i = 0; i < NV; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st != DDP_OK ? (int)st : bad;
}

static void test_bucket_view(void **state) {
  (void)state;
  view_cfg_t a = {false, ddp_test_memory_store()}, b = {true, ddp_test_memory_store()};
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 3;
  ddp_test_results_t *ra = ddp_test_spawn(&o, view_rank, &a),
                     *rb = ddp_test_spawn(&o, view_rank, &b);
  ddp_test_expect_all(ra, 0);
  ddp_test_expect_all(rb, 0);
  for (int r = 0; r < 3; r++) /* every rank: the per-parameter broadcasts' bits */
    assert_memory_equal(ddp_test_result(rb, r)->values, ddp_test_result(ra, 0)->values,
                        ddp_test_result(ra, 0)->nvalues);
  ddp_test_results_free(ra);
  ddp_test_results_free(rb);
  ddp_store_destroy(a.store);
  ddp_store_destroy(b.store);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_step),          cmocka_unit_test(test_interleaved),
      cmocka_unit_test(test_shard_buckets), cmocka_unit_test(test_static_graph),
      cmocka_unit_test(test_bucket_view),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
