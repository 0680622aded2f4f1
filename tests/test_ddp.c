/* DistributedDataParallel (src/reducer): bucket assignment against the spec's rule and
 * worked examples; equivalence of W-rank DDP training with one process on W times the
 * batch (SGD and AdamW, with and without LayerNorm, no_sync accumulation); bitwise identity
 * across backends, bucket caps, gradient_as_bucket_view and static_graph; bucket layouts
 * (initial and rebuilt) recomputed independently; find_unused_parameters (averaging with
 * absent ranks as zeros, globally unused grads untouched, the one-time warning);
 * broadcast_buffers; and PyTorch's error texts, with nothing hanging. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/pg.h"
#include "ddp/reducer.h"
#include "ddp/store.h"
#include "common/common.h"
#include "harness.h"

#define IN 12
#define HID 24
#define OUT 5
#define MAXP 16

/* ---------------------------------------------------------------- bucket rule ----- */

/* An independent, naive rendering of spec §2.1 for one key: visit in order, close at
 * >= limit, advance the limit, trailing partial last; sort by smallest index when no
 * order is given. Returns the number of buckets; bucket of each visited item in bk[]. */
static size_t naive_assign(size_t n, const size_t *bytes, const size_t *limits, size_t nl,
                           const size_t *order, size_t *out_idx, size_t *out_off) {
  size_t nb = 0, pos = 0, acc = 0, li = 0;
  out_off[0] = 0;
  for (size_t k = 0; k < n; k++) {
    size_t i = order ? order[k] : k;
    out_idx[pos++] = i;
    acc += bytes[i];
    if (acc >= limits[li]) {
      out_off[++nb] = pos;
      acc = 0;
      if (li + 1 < nl) li++;
    }
  }
  if (out_off[nb] != pos) out_off[++nb] = pos;
  return nb; /* with one key and no order, production order is already sorted */
}

static void expect_buckets(const ddp_bucket_assignment_t *a, size_t nb, const size_t *sizes,
                           const size_t *idx) {
  assert_int_equal(a->nbuckets, nb);
  size_t pos = 0;
  for (size_t b = 0; b < nb; b++) {
    assert_int_equal(a->offsets[b], pos);
    assert_int_equal(a->offsets[b + 1] - a->offsets[b], sizes[b]);
    for (size_t k = 0; k < sizes[b]; k++) assert_int_equal(a->indices[pos + k], idx[pos + k]);
    pos += sizes[b];
  }
}

/* spec §2.2 and §2.3 worked examples, plus multi-dtype keys and sparse singletons. */
static void test_assignment_examples(void **state) {
  (void)state;
  const size_t KiB = 1024, MiB = 1024 * 1024;
  size_t bytes[6] = {600 * KiB, 600 * KiB, 30 * MiB, 4 * MiB, 24 * MiB, 2 * MiB};
  int keys[6] = {0};
  size_t limits[2] = {MiB, 25 * MiB};
  ddp_bucket_assignment_t a;
  assert_int_equal(ddp_compute_bucket_assignment_by_size(6, bytes, keys, NULL, limits, 2, NULL, &a),
                   DDP_OK);
  size_t s1[] = {2, 1, 2, 1}, i1[] = {0, 1, 2, 3, 4, 5};
  expect_buckets(&a, 4, s1, i1);
  assert_int_equal(a.limits[0], MiB);
  assert_int_equal(a.limits[1], 25 * MiB);
  ddp_bucket_assignment_free(&a);

  size_t order[6] = {5, 4, 3, 2, 1, 0};
  assert_int_equal(ddp_compute_bucket_assignment_by_size(6, bytes, keys, NULL, limits, 2, order,
                                                         &a),
                   DDP_OK);
  size_t s2[] = {1, 2, 1, 2}, i2[] = {5, 4, 3, 2, 1, 0};
  expect_buckets(&a, 4, s2, i2);
  ddp_bucket_assignment_free(&a);

  /* No limit: one bucket. */
  size_t inf = SIZE_MAX;
  assert_int_equal(ddp_compute_bucket_assignment_by_size(6, bytes, keys, NULL, &inf, 1, NULL, &a),
                   DDP_OK);
  assert_int_equal(a.nbuckets, 1);
  ddp_bucket_assignment_free(&a);

  /* Two keys interleaved, a sparse one: per-key accumulators, sorted by smallest index. */
  size_t b3[5] = {8, 8, 8, 8, 8};
  int k3[5] = {0, 1, 0, 1, 0};
  bool sp[5] = {false, false, false, false, true};
  size_t l3 = 16;
  assert_int_equal(ddp_compute_bucket_assignment_by_size(5, b3, k3, sp, &l3, 1, NULL, &a), DDP_OK);
  size_t s3[] = {2, 2, 1}, i3[] = {0, 2, 1, 3, 4};
  expect_buckets(&a, 3, s3, i3);
  ddp_bucket_assignment_free(&a);

  /* Random sizes against the naive rule. */
  uint64_t x = 12345;
  for (int trial = 0; trial < 200; trial++) {
    size_t n = 1 + (size_t)(trial % 17), by[32], ord[32], idx[32], off[33];
    for (size_t i = 0; i < n; i++) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      by[i] = 1 + (size_t)((x >> 33) % 5000);
      ord[i] = i;
    }
    for (size_t i = n; i > 1; i--) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      size_t j = (size_t)((x >> 33) % i), t = ord[i - 1];
      ord[i - 1] = ord[j];
      ord[j] = t;
    }
    size_t lim[2] = {1 + (size_t)(trial * 37 % 3000), 1 + (size_t)(trial * 91 % 9000)};
    int kk[32] = {0};
    const size_t *o = (trial & 1) ? ord : NULL;
    size_t nb = naive_assign(n, by, lim, 2, o, idx, off);
    assert_int_equal(ddp_compute_bucket_assignment_by_size(n, by, kk, NULL, lim, 2, o, &a), DDP_OK);
    assert_int_equal(a.nbuckets, nb);
    for (size_t b = 0; b <= nb; b++) assert_int_equal(a.offsets[b], off[b]);
    for (size_t k = 0; k < n; k++) assert_int_equal(a.indices[k], idx[k]);
    ddp_bucket_assignment_free(&a);
  }
}

/* ---------------------------------------------------------------- models, data ---- */

enum { M_PLAIN = 0, M_LN = 1, M_BRANCH = 2, M_CKPT = 3, M_BN = 4 };

/* Sequential: 0 Linear(IN,HID), 1 ReLU, [2 LayerNorm | BatchNorm], Linear(HID,HID), Tanh
 * (checkpointed, or behind branch flag 0), Linear(HID,OUT). */
static ddp_status_t build_model(int kind, uint64_t seed, ddp_model_t **out) {
  ddp_model_t *m = NULL;
  ddp_module_t *seq, *l0, *a1, *n2, *l3, *a4, *l5, *body, *wrap;
  DDP_CHECK(ddp_model_create(&m));
  ddp_status_t st;
#define T(call)                  \
  do {                           \
    st = (call);                 \
    if (st != DDP_OK) goto fail; \
  } while (0)
  T(ddp_module_sequential(m, &seq));
  T(ddp_module_linear(m, "0", IN, HID, true, DDP_F32, &l0));
  T(ddp_module_activation(m, DDP_ACT_RELU, &a1));
  T(ddp_module_append(seq, l0));
  T(ddp_module_append(seq, a1));
  if (kind == M_LN) {
    T(ddp_module_layer_norm(m, "2", HID, 1e-5, DDP_F32, &n2));
    T(ddp_module_append(seq, n2));
  } else if (kind == M_BN) {
    T(ddp_module_batch_norm(m, "2", HID, 1e-5, 0.1, DDP_F32, &n2));
    T(ddp_module_append(seq, n2));
  }
  T(ddp_module_sequential(m, &body));
  T(ddp_module_linear(m, "3.0", HID, HID, true, DDP_F32, &l3));
  T(ddp_module_activation(m, DDP_ACT_TANH, &a4));
  T(ddp_module_append(body, l3));
  T(ddp_module_append(body, a4));
  if (kind == M_BRANCH)
    T(ddp_module_branch(m, body, 0, &wrap));
  else if (kind == M_CKPT)
    T(ddp_module_checkpointed(m, body, &wrap));
  else
    wrap = body;
  T(ddp_module_append(seq, wrap));
  T(ddp_module_linear(m, "5", HID, OUT, true, DDP_F32, &l5));
  T(ddp_module_append(seq, l5));
  ddp_model_set_root(m, seq);
  T(ddp_model_finalize(m));
  T(ddp_model_init(m, seed));
#undef T
  *out = m;
  return DDP_OK;
fail:
  ddp_model_destroy(m);
  return st;
}

/* Global batch row `row` of step `step`: deterministic, identical wherever computed. */
static void fill_batch(int step, int row0, int rows, float *x, float *y) {
  for (int i = 0; i < rows; i++) {
    int r = row0 + i;
    for (int j = 0; j < IN; j++) x[i * IN + j] = (float)sin(0.37 * r + 0.11 * j + 0.7 * step);
    for (int k = 0; k < OUT; k++) y[i * OUT + k] = (float)cos(0.23 * r - 0.5 * k + 0.3 * step);
  }
}

typedef struct cfg {
  const char *backend;
  ddp_test_mode_t mode;
  int world;
  int b;
  int kind;
  int optim; /* 0 SGD, 1 AdamW */
  int steps;
  int accum;
  uint64_t flags_rank1; /* forward flags of rank >= 1 (rank 0: all set) */
  uint64_t flags_rank0;
  ddp_ddp_options_t dopts;
  ddp_store_t *store;
  int64_t timeout_ms;
  bool put_grads; /* put grads after the first step's backward instead of params */
  int join;       /* 0 off; 1 divide by initial W; 2 by active ranks; 3 throw */
} cfg_t;

/* This rank's group for cfg (see ddp_test_pg_create; a failure is said as "pg create: ..."). */
/* ddp_test_say with head and the reducer's last error (copied out; "" without a reducer). */
static void say_ddp_error(ddp_test_rank_t *tr, const char *head, const ddp_ddp_t *ddp) {
  ddp_error_t de = {0};
  if (ddp) ddp_ddp_last_error_copy(ddp, &de);
  ddp_test_say(tr, "%s%s", head, de.msg);
}

static ddp_status_t make_pg(ddp_test_rank_t *tr, const cfg_t *cfg, ddp_store_t **store,
                            ddp_pg_t **pg) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = cfg->backend;
  o.store = cfg->store;
  o.timeout_ms = cfg->timeout_ms;
  o.shm_heap_bytes = 16u << 20;
  return ddp_test_pg_create(tr, &o, "pg create", store, pg);
}

/* What every rank function holds: its group (and, forked, the file store under it), the
 * model under DDP and an autograd context. */
typedef struct rank_env {
  ddp_store_t *store;
  ddp_pg_t *pg;
  ddp_model_t *m; /* built by the caller before env_open; env_close destroys it */
  ddp_ddp_t *ddp;
  ddp_ctx_t *ctx;
  ddp_error_t err;
} rank_env_t;

/* Creates the group, DDP over e->m with cfg's options (saying the construction error) and
 * the context. */
static ddp_status_t env_open(ddp_test_rank_t *tr, const cfg_t *cfg, rank_env_t *e) {
  DDP_CHECK(make_pg(tr, cfg, &e->store, &e->pg));
  ddp_status_t st = ddp_ddp_create(e->m, e->pg, &cfg->dopts, &e->ddp, &e->err);
  if (st != DDP_OK) {
    ddp_test_say(tr, "%s", e->err.msg);
    return st;
  }
  return ddp_ctx_create(&e->ctx);
}

/* Destroys whatever env_open (and the caller's model build) created. */
static void env_close(rank_env_t *e) {
  ddp_ctx_destroy(e->ctx);
  ddp_ddp_destroy(e->ddp);
  ddp_model_destroy(e->m);
  ddp_pg_destroy(e->pg);
  ddp_store_destroy(e->store);
}

static ddp_status_t make_optim(int kind, ddp_model_t *m, ddp_optim_t **opt) {
  ddp_optim_param_t ps[MAXP];
  size_t n = 0;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (!p->requires_grad) continue;
    ps[n].param = &p->value;
    ps[n].grad = &p->grad;
    n++;
  }
  ddp_optim_options_t sgd = DDP_SGD_OPTIONS_INIT, adamw = DDP_ADAMW_OPTIONS_INIT;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  adamw.lr = 1e-3;
  return ddp_optim_create(kind == 0 ? &sgd : &adamw, ps, n, opt, NULL);
}

/* One micro-step's forward and loss on rows [row0, row0+rows) of the global batch. */
static ddp_status_t fwd_loss(ddp_ctx_t *ctx, ddp_model_t *m, ddp_ddp_t *ddp, int step, int row0,
                             int rows, uint64_t flags, ddp_var_t **loss) {
  float x[64 * IN], y[64 * OUT];
  fill_batch(step, row0, rows, x, y);
  int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
  ddp_var_t *vx, *vy, *out;
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, xs, x, false, &vx));
  DDP_CHECK(ddp_var_new(ctx, DDP_F32, 2, ys, y, false, &vy));
  if (ddp)
    DDP_CHECK(ddp_ddp_forward(ddp, ctx, vx, flags, &out));
  else
    DDP_CHECK(ddp_model_forward(m, ctx, vx, flags, &out));
  return ddp_mse_loss(ctx, out, vy, loss);
}

/* One DDP micro-step on rows [row0, row0+rows) of step's batch: forward and loss, backward
 * with gradient synchronisation set to sync (restored afterwards), context reset. */
static ddp_status_t micro_step(rank_env_t *e, int step, int row0, int rows, uint64_t flags,
                               bool sync) {
  bool old = ddp_ddp_set_sync(e->ddp, sync);
  ddp_var_t *loss;
  ddp_status_t st = fwd_loss(e->ctx, e->m, e->ddp, step, row0, rows, flags, &loss);
  if (st == DDP_OK) st = ddp_ddp_backward(e->ddp, e->ctx, loss);
  ddp_ddp_set_sync(e->ddp, old);
  ddp_ctx_reset(e->ctx);
  return st;
}

static bool put_params(ddp_test_rank_t *tr, ddp_model_t *m) {
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (!ddp_test_put(tr, p->value.data, (size_t)p->value.numel * 4)) return false;
  }
  return true;
}

static int train_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  int r = ddp_test_rank(tr), W = ddp_test_world_size(tr);
  rank_env_t e = {0};
  ddp_optim_t *opt = NULL;
  /* Every rank starts from different weights: the construction broadcast must fix that. */
  ddp_status_t st = build_model(cfg->kind, 42 + (uint64_t)r, &e.m);
  if (st == DDP_OK) st = env_open(tr, cfg, &e);
  if (st != DDP_OK) goto out;
  ddp_model_t *m = e.m;
  ddp_ddp_t *ddp = e.ddp;
  DDP_CHECK_GOTO(make_optim(cfg->optim, m, &opt), st, out);
  uint64_t flags = r == 0 ? cfg->flags_rank0 : cfg->flags_rank1;
  int steps = cfg->steps;
  if (cfg->join) {
    steps = cfg->steps + r - (W - 1); /* uneven: rank W-1 runs cfg->steps */
    DDP_CHECK_GOTO(ddp_ddp_join_begin(ddp, cfg->join == 1, cfg->join == 3), st, out);
  }
  for (int step = 0; step < steps; step++) {
    for (int a = 0; a < cfg->accum; a++) {
      int row0 = (step * cfg->accum + a) * W * cfg->b + r * cfg->b;
      st = micro_step(&e, step * cfg->accum + a, row0, cfg->b, flags, a == cfg->accum - 1);
      if (st != DDP_OK) {
        char head[32];
        snprintf(head, sizeof head, "step %d: ", step);
        say_ddp_error(tr, head, ddp);
        goto out;
      }
    }
    if (cfg->dopts.gradient_as_bucket_view && step == 0) {
      /* .grad is a view into bucket memory, not the model's flat gradient buffer. */
      ddp_tensor_t fg = ddp_model_flat_grads(m, DDP_F32);
      for (size_t i = 0; i < ddp_model_num_params(m); i++) {
        const char *g = ddp_model_param(m, i)->grad.data, *lo = fg.data;
        if (g >= lo && g < lo + fg.numel * 4) {
          ddp_test_say(tr, "grad %zu is not a bucket view", i);
          st = DDP_ERR_INTERNAL;
          goto out;
        }
      }
    }
    if (cfg->put_grads && step == 0) {
      for (size_t i = 0; i < ddp_model_num_params(m); i++) {
        ddp_param_t *p = ddp_model_param(m, i);
        ddp_test_put(tr, p->grad.data, (size_t)p->grad.numel * 4);
      }
    }
    st = ddp_optim_step(opt, &e.err);
    if (st != DDP_OK) {
      ddp_test_say(tr, "optim: %s", e.err.msg);
      goto out;
    }
    ddp_optim_zero_grad(opt, false);
  }
  if (cfg->join) {
    st = ddp_ddp_join_end(ddp);
    if (st != DDP_OK) {
      say_ddp_error(tr, "join: ", ddp);
      goto out;
    }
  }
  if (!cfg->put_grads && !put_params(tr, m)) st = DDP_ERR_NO_MEMORY;
out:
  ddp_optim_destroy(opt);
  env_close(&e);
  return st;
}

/* The single-process reference: batch W*b per micro-step, same seed as rank 0. */
static void reference(const cfg_t *cfg, float *params, size_t *nfloats) {
  ddp_model_t *m;
  ddp_optim_t *opt;
  ddp_ctx_t *ctx;
  assert_int_equal(build_model(cfg->kind, 42, &m), DDP_OK);
  assert_int_equal(make_optim(cfg->optim, m, &opt), DDP_OK);
  assert_int_equal(ddp_ctx_create(&ctx), DDP_OK);
  int rows = cfg->world * cfg->b;
  for (int step = 0; step < cfg->steps; step++) {
    /* Under join the ranks still training at this step are the highest ones: rank r runs
     * steps + r - (W-1) steps, so their rows are contiguous at the end of the batch. */
    int active = cfg->world;
    if (cfg->join)
      for (int r = 0; r < cfg->world; r++)
        if (step >= cfg->steps + r - (cfg->world - 1)) active--;
    for (int a = 0; a < cfg->accum; a++) {
      ddp_var_t *loss;
      int row0 = (step * cfg->accum + a) * rows + (cfg->world - active) * cfg->b;
      assert_int_equal(fwd_loss(ctx, m, NULL, step * cfg->accum + a, row0, active * cfg->b,
                                cfg->flags_rank0, &loss),
                       DDP_OK);
      assert_int_equal(ddp_backward(ctx, loss), DDP_OK);
      ddp_ctx_reset(ctx);
    }
    if (cfg->join == 1) /* joined ranks count as zeros: scale the mean by active / W */
      for (size_t i = 0; i < ddp_model_num_params(m); i++) {
        ddp_param_t *p = ddp_model_param(m, i);
        for (int64_t k = 0; k < p->grad.numel; k++)
          ((float *)p->grad.data)[k] *= (float)active / (float)cfg->world;
      }
    assert_int_equal(ddp_optim_step(opt, NULL), DDP_OK);
    ddp_optim_zero_grad(opt, false);
  }
  size_t n = 0;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    memcpy(params + n, p->value.data, (size_t)p->value.numel * 4);
    n += (size_t)p->value.numel;
  }
  *nfloats = n;
  ddp_ctx_destroy(ctx);
  ddp_optim_destroy(opt);
  ddp_model_destroy(m);
}

static ddp_test_results_t *spawn(cfg_t *cfg, ddp_test_fn fn) {
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = cfg->world;
  o.mode = cfg->mode;
  o.timeout_ms = 30000;
  o.value_bytes = 256 * 1024;
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  cfg->store = NULL;
  if (cfg->mode == DDP_TEST_THREADS)
    assert_int_equal(ddp_store_create_memory(&so, &cfg->store, NULL), DDP_OK);
  ddp_test_results_t *res = ddp_test_spawn(&o, fn, cfg);
  ddp_store_destroy(cfg->store);
  cfg->store = NULL;
  return res;
}

static cfg_t base_cfg(int world, int kind, int optim) {
  cfg_t c;
  memset(&c, 0, sizeof c);
  c.backend = "threads";
  c.mode = DDP_TEST_THREADS;
  c.world = world;
  c.b = 4;
  c.kind = kind;
  c.optim = optim;
  c.steps = 20;
  c.accum = 1;
  c.flags_rank0 = c.flags_rank1 = 1;
  ddp_ddp_options_t d = DDP_DDP_OPTIONS_INIT;
  c.dopts = d;
  c.timeout_ms = 20000;
  return c;
}

/* Runs cfg; checks every rank returned OK and holds identical bits; returns rank 0's
 * values (malloc'd) and their size. */
static float *run_identical(cfg_t *cfg, size_t *nbytes) {
  ddp_test_results_t *res = spawn(cfg, train_rank);
  ddp_test_expect_ok(res);
  const ddp_test_result_t *r0 = ddp_test_result(res, 0);
  for (int r = 1; r < cfg->world; r++) {
    const ddp_test_result_t *rr = ddp_test_result(res, r);
    assert_int_equal(rr->nvalues, r0->nvalues);
    assert_memory_equal(rr->values, r0->values, r0->nvalues);
  }
  float *v = malloc(r0->nvalues);
  memcpy(v, r0->values, r0->nvalues);
  *nbytes = r0->nvalues;
  ddp_test_results_free(res);
  return v;
}

/* Runs cfg (run_identical) and checks that rank 0's values begin with base's n0 bytes;
 * returns their size. */
static size_t expect_bits(cfg_t *cfg, const float *base, size_t n0) {
  size_t n;
  float *v = run_identical(cfg, &n);
  assert_memory_equal(v, base, n0);
  free(v);
  return n;
}

/* Max-norm relative error over the whole parameter vector. */
static double rel_err(const float *a, const float *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    num = fmax(num, fabs((double)a[i] - (double)b[i]));
    den = fmax(den, fabs((double)b[i]));
  }
  return num / den;
}

/* After 20 SGD steps and 20 AdamW steps, W in {2,3,4} thread ranks, MLP with and without
 * LayerNorm, per-rank batch b: parameters equal one process with batch W*b to 1e-5. */
static void test_equivalence_threads(void **state) {
  (void)state;
  static float ref[4096];
  for (int kind = 0; kind < 2; kind++)
    for (int optim = 0; optim < 2; optim++)
      for (int W = 2; W <= 4; W++) {
        cfg_t c = base_cfg(W, kind == 0 ? M_PLAIN : M_LN, optim);
        size_t nb, nref;
        float *v = run_identical(&c, &nb);
        reference(&c, ref, &nref);
        assert_int_equal(nb, nref * 4);
        double e = rel_err(v, ref, nref);
        print_message("W=%d %s %s: max rel err %.3g\n", W, kind ? "LayerNorm" : "plain",
                      optim ? "AdamW" : "SGD", e);
        assert_true(e <= 1e-5);
        free(v);
      }
}

/* no_sync gradient accumulation over 4 micro-steps equals one process accumulating the
 * same 4 micro-batches of W*b. */
static void test_no_sync_accumulation(void **state) {
  (void)state;
  static float ref[4096];
  cfg_t c = base_cfg(3, M_LN, 0);
  c.accum = 4;
  c.steps = 5;
  size_t nb, nref;
  float *v = run_identical(&c, &nb);
  reference(&c, ref, &nref);
  double e = rel_err(v, ref, nref);
  print_message("no_sync accum 4, W=3: max rel err %.3g\n", e);
  assert_true(e <= 1e-5);
  free(v);
  /* W=2: gradient_as_bucket_view accumulating in bucket memory across the rebuild gives the
   * same bits. */
  c.world = 2;
  float *a = run_identical(&c, &nb);
  c.dopts.gradient_as_bucket_view = true;
  c.dopts.bucket_cap_mb = 0.001;
  size_t nb2;
  float *g = run_identical(&c, &nb2);
  assert_int_equal(nb, nb2);
  assert_memory_equal(a, g, nb);
  free(a);
  free(g);
}

/* Bitwise identity across bucket_cap_mb {0.001, 1, 25, unset}, backends threads/shm/tcp,
 * gradient_as_bucket_view (W a power of two, where dividing and multiplying by 1/W round
 * the same) and static_graph. */
static void test_bitwise_across_configs(void **state) {
  (void)state;
  for (int W = 2; W <= 4; W++) {
    cfg_t c = base_cfg(W, M_LN, 1);
    c.steps = 8;
    size_t n0;
    float *base = run_identical(&c, &n0);
    double caps[] = {0.001, 1, 25};
    for (size_t k = 0; k < 3; k++) {
      cfg_t d = c;
      d.dopts.bucket_cap_mb = caps[k];
      assert_int_equal(expect_bits(&d, base, n0), n0);
    }
    const char *be[] = {"shm", "tcp"};
    for (size_t k = 0; k < 2; k++) {
      cfg_t d = c;
      d.backend = be[k];
      d.mode = DDP_TEST_FORK;
      d.dopts.bucket_cap_mb = 0.001;
      assert_int_equal(expect_bits(&d, base, n0), n0);
      /* find_unused_parameters: the used-map allreduce from private memory into pg memory */
      d.dopts.find_unused_parameters = true;
      d.dopts.bucket_cap_mb = DDP_BUCKET_CAP_UNSET;
      d.dopts.first_bucket_bytes = 1500;
      expect_bits(&d, base, n0);
    }
    cfg_t d = c;
    d.kind = M_LN;
    d.dopts.broadcast_bucket_bytes = 600; /* many construction chunks, 2 in flight */
    expect_bits(&d, base, n0);
    if (W != 3) { /* in-place division by W rounds like the multiply only for powers of 2 */
      d = c;
      d.dopts.gradient_as_bucket_view = true;
      d.dopts.bucket_cap_mb = 0.001;
      expect_bits(&d, base, n0);
    }
    d = c;
    d.dopts.static_graph = true;
    d.dopts.bucket_cap_mb = 0.001;
    expect_bits(&d, base, n0);
    free(base);
  }
}

/* static_graph: reentrant checkpointing (parameters that fire inside the recompute) gives
 * the same bits as plain training; a branch unused on every rank gives the same bits as
 * find_unused_parameters (its grads untouched, never applied). */
static void test_static_graph(void **state) {
  (void)state;
  size_t n0;
  cfg_t p = base_cfg(2, M_PLAIN, 0);
  p.steps = 6;
  float *plain = run_identical(&p, &n0);
  cfg_t d = base_cfg(2, M_CKPT, 0);
  d.steps = 6;
  d.dopts.static_graph = true;
  d.dopts.bucket_cap_mb = 0.001;
  assert_int_equal(expect_bits(&d, plain, n0), n0);
  free(plain);

  cfg_t f = base_cfg(2, M_BRANCH, 0);
  f.flags_rank0 = f.flags_rank1 = 0;
  f.steps = 6;
  f.dopts.find_unused_parameters = true;
  float *fu = run_identical(&f, &n0);
  cfg_t s = f;
  s.dopts.find_unused_parameters = false;
  s.dopts.static_graph = true;
  s.dopts.bucket_cap_mb = 0.001;
  assert_int_equal(expect_bits(&s, fu, n0), n0);
  free(fu);
}

/* ---------------------------------------------------------------- layouts --------- */

static int layout_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  int r = ddp_test_rank(tr);
  rank_env_t e = {0};
  ddp_status_t st = build_model(cfg->kind, 7, &e.m);
  if (st == DDP_OK) st = env_open(tr, cfg, &e);
  if (st != DDP_OK) goto out;
  ddp_ddp_t *ddp = e.ddp;
  /* initial layout */
  uint64_t nb = ddp_ddp_num_buckets(ddp);
  ddp_test_put(tr, &nb, 8);
  for (size_t b = 0; b < nb; b++) {
    size_t n;
    const size_t *idx = ddp_ddp_bucket_params(ddp, b, &n);
    uint64_t n64 = n;
    ddp_test_put(tr, &n64, 8);
    for (size_t k = 0; k < n; k++) {
      uint64_t v = idx[k];
      ddp_test_put(tr, &v, 8);
    }
  }
  for (int step = 0; step < 2; step++)
    DDP_CHECK_GOTO(micro_step(&e, step, r * 4, 4, 1, true), st, out);
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(ddp, &ld);
  uint64_t h = ld.has_rebuilt_buckets, nr = ld.num_rebuilt_buckets;
  ddp_test_put(tr, &h, 8);
  ddp_test_put(tr, &nr, 8);
  for (size_t b = 0; b < nr; b++) {
    uint64_t n = ld.rebuilt_per_bucket_param_offsets[b + 1] -
                 ld.rebuilt_per_bucket_param_offsets[b];
    ddp_test_put(tr, &n, 8);
    for (size_t k = 0; k < n; k++) {
      uint64_t v = ld.rebuilt_per_bucket_param_indices[ld.rebuilt_per_bucket_param_offsets[b] + k];
      ddp_test_put(tr, &v, 8);
    }
    int64_t lim = ld.rebuilt_bucket_size_limits[b], sz = ld.rebuilt_bucket_sizes[b];
    ddp_test_put(tr, &lim, 8);
    ddp_test_put(tr, &sz, 8);
  }
  if (ld.num_runtime_samples != 2 || ld.iteration != 2 || ld.avg_backward_comm_time <= 0 ||
      ld.avg_forward_compute_time <= 0 || ld.total_parameter_size_bytes <= 0) {
    ddp_test_say(tr, "stats: samples %lld iteration %lld comm %lld",
                 (long long)ld.num_runtime_samples, (long long)ld.iteration,
                 (long long)ld.avg_backward_comm_time);
    st = DDP_ERR_INTERNAL;
  }
out:
  env_close(&e);
  return st;
}

static atomic_int info_init, info_rebuilt;
static void info_sink(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  if (level != DDP_LOG_INFO) return;
  if (strstr(line,
             "Reducer initialized with bucket_bytes_cap: 26214400 first_bucket_bytes_cap: 2000"))
    atomic_fetch_add(&info_init, 1);
  if (strstr(line, "2 buckets rebuilt with size limits: 2000, 26214400 bytes."))
    atomic_fetch_add(&info_rebuilt, 1);
}

static void record_order(void *user, ddp_param_t *p, int fire) {
  size_t *o = user;
  (void)fire;
  o[1 + o[0]++] = p->index;
}

/* Initial (one bucket; or [first, cap] reversed under find_unused) and rebuilt layouts
 * (ready order with [first, cap], rank 0's everywhere) equal the rule computed here from
 * the hook order of a plain backward. */
static void test_bucket_layouts(void **state) {
  (void)state;
  /* The hook order and sizes, from a plain model. */
  ddp_model_t *m;
  ddp_ctx_t *ctx;
  assert_int_equal(build_model(M_LN, 7, &m), DDP_OK);
  assert_int_equal(ddp_ctx_create(&ctx), DDP_OK);
  size_t order[1 + MAXP] = {0};
  ddp_model_set_hook(m, record_order, order);
  ddp_var_t *loss;
  assert_int_equal(fwd_loss(ctx, m, NULL, 0, 0, 4, 1, &loss), DDP_OK);
  assert_int_equal(ddp_backward(ctx, loss), DDP_OK);
  size_t P = ddp_model_num_params(m), bytes[MAXP];
  assert_int_equal(order[0], P);
  char os_[128] = "";
  for (size_t i = 0; i < P; i++)
    snprintf(os_ + strlen(os_), sizeof os_ - strlen(os_), "%s%zu", i ? ", " : "", order[1 + i]);
  print_message("grad-ready order: %s\n",
                os_); /* torch 1.13 on this model: 7, 6, 5, 4, 2, 3, 1, 0 */
  for (size_t i = 0; i < P; i++) bytes[i] = (size_t)ddp_model_param(m, i)->value.numel * 4;
  ddp_ctx_destroy(ctx);
  ddp_model_destroy(m);

  struct {
    double cap;
    int64_t first;
    bool find_unused;
  } cases[] = {{DDP_BUCKET_CAP_UNSET, 2000, false},
               {0.001, -1, false},
               {0.004, 1500, true},
               {0.002, -1, true},
               {DDP_BUCKET_CAP_UNSET, 3000, true}};
  for (size_t t = 0; t < DDP_ARRAY_LEN(cases); t++) {
    cfg_t c = base_cfg(3, M_LN, 0);
    c.dopts.bucket_cap_mb = cases[t].cap;
    c.dopts.first_bucket_bytes = cases[t].first;
    c.dopts.find_unused_parameters = cases[t].find_unused;
    size_t cap = cases[t].cap < 0 ? 25u * 1024 * 1024 : (size_t)(cases[t].cap * 1024 * 1024);
    size_t first = cases[t].first >= 0 ? (size_t)cases[t].first
                                       : (cases[t].cap < 0 ? 1024 * 1024 : cap);
    /* expected initial */
    size_t ei[MAXP], eo[MAXP + 1], enb;
    if (!cases[t].find_unused) {
      enb = 1;
      eo[0] = 0;
      eo[1] = P;
      for (size_t i = 0; i < P; i++) ei[i] = i;
    } else {
      bool two = cases[t].cap < 0 || cases[t].first >= 0;
      size_t li[2] = {two ? first : cap, cap}, ti[MAXP], to[MAXP + 1];
      size_t tn = naive_assign(P, bytes, li, two ? 2 : 1, NULL, ti, to);
      enb = tn;
      size_t pos = 0;
      for (size_t b = 0; b < tn; b++) { /* reversed */
        size_t s = tn - 1 - b;
        eo[b] = pos;
        for (size_t k = to[s]; k < to[s + 1]; k++) ei[pos++] = ti[k];
      }
      eo[tn] = pos;
    }
    /* expected rebuilt */
    size_t ri[MAXP], ro[MAXP + 1], rnb = 0, lim2[2] = {first, cap};
    if (!cases[t].find_unused) rnb = naive_assign(P, bytes, lim2, 2, order + 1, ri, ro);

    if (t == 0) { /* DDP_DEBUG=INFO: the init and rebuild lines, once per rank */
      atomic_store(&info_init, 0);
      atomic_store(&info_rebuilt, 0);
      setenv("DDP_DEBUG", "INFO", 1);
      ddp_set_log_sink(info_sink, NULL);
    }
    ddp_test_results_t *res = spawn(&c, layout_rank);
    if (t == 0) {
      ddp_set_log_sink(NULL, NULL);
      unsetenv("DDP_DEBUG");
      assert_int_equal(atomic_load(&info_init), 3);
      assert_int_equal(atomic_load(&info_rebuilt), 3);
    }
    ddp_test_expect_ok(res);
    for (int r = 0; r < 3; r++) {
      const uint64_t *v = (const uint64_t *)ddp_test_result(res, r)->values;
      size_t pos = 0;
      assert_int_equal(v[pos++], enb);
      for (size_t b = 0; b < enb; b++) {
        assert_int_equal(v[pos++], eo[b + 1] - eo[b]);
        for (size_t k = eo[b]; k < eo[b + 1]; k++) assert_int_equal(v[pos++], ei[k]);
      }
      assert_int_equal(v[pos++], !cases[t].find_unused);
      assert_int_equal(v[pos++], rnb);
      for (size_t b = 0; b < rnb; b++) {
        assert_int_equal(v[pos++], ro[b + 1] - ro[b]);
        size_t sz = 0;
        for (size_t k = ro[b]; k < ro[b + 1]; k++) {
          assert_int_equal(v[pos++], ri[k]);
          sz += bytes[ri[k]];
        }
        assert_int_equal(v[pos++], b == 0 ? first : cap);
        assert_int_equal(v[pos++], sz);
      }
    }
    print_message("cap %g first %lld find_unused %d: %zu initial, %zu rebuilt buckets\n",
                  cases[t].cap, (long long)cases[t].first, cases[t].find_unused, enb, rnb);
    ddp_test_results_free(res);
  }
}

/* PyTorch 1.13's DDP on the same model (gloo, one rank; 1.13's first-bucket size patched
 * in through dist._DEFAULT_FIRST_BUCKET_BYTES, libddp's through first_bucket_bytes): the
 * initial bucket sizes and the rebuilt per-bucket parameter indices agree. Skips without
 * torch. */
static const char torch_layout_py[] =
    "import os, sys\n"
    "os.environ[\"OMP_NUM_THREADS\"] = \"1\"\n"
    "os.environ[\"OPENBLAS_NUM_THREADS\"] = \"1\"\n"
    "import torch, torch.distributed as dist, torch.nn as nn\n"
    "from datetime import timedelta\n"
    "torch.set_num_threads(1)\n"
    "store = dist.TCPStore(\"127.0.0.1\", 0, 1, True, timedelta(seconds=60))  # the kernel's port\n"
    "dist.init_process_group(\"gloo\", store=store, rank=0, world_size=1)\n"
    "for case in sys.argv[1:]:\n"
    "    fu, first, cap = case.split(\":\")\n"
    "    dist._DEFAULT_FIRST_BUCKET_BYTES = int(first)\n"
    "    torch.manual_seed(0)\n"
    "    m = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.LayerNorm(24),\n"
    "                      nn.Sequential(nn.Linear(24, 24), nn.Tanh()), nn.Linear(24, 5))\n"
    "    d = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=float(cap),\n"
    "                                            find_unused_parameters=fu == \"1\")\n"
    "    for step in range(3):\n"
    "        loss = ((d(torch.randn(4, 12)) - torch.randn(4, 5)) ** 2).mean()\n"
    "        loss.backward()\n"
    "    ld = d._get_ddp_logging_data()\n"
    "    print(\"initial\", str(ld.get(\"bucket_sizes\")).replace(\",\", \" \"))\n"
    "    print(\"rebuilt\", str(ld.get(\"rebuilt_per_bucket_param_indices\")).replace(\" \", "
    "\".\").replace(\",.\", \"|\"))\n"
    "    sys.stdout.flush()\n"
    "dist.destroy_process_group()\n"
    "os._exit(0)\n"
    "\n";

static void test_bucket_layouts_vs_torch(void **state) {
  (void)state;
  const char *py = ddp_test_python();
  if (!py) {
    skip();
    return;
  }
  struct {
    bool find_unused;
    int64_t first;
    double cap;
  } cases[] = {{false, 2000, 25}, {true, 1500, 0.004}, {false, 1048, 0.001}, {true, 3000, 25}};
  char script[] = "/tmp/ddp-layout-"
                  "XX"
                  "XX"
                  "XX" /* mkstemp template */;
  int fd = mkstemp(script);
  assert_true(fd >= 0);
  ddp_test_remove_at_exit(script);
  assert_int_equal(write(fd, torch_layout_py, strlen(torch_layout_py)),
                   (ssize_t)strlen(torch_layout_py));
  close(fd);
  char cmd[1024];
  int len = snprintf(cmd, sizeof cmd, "%s %s", py, script);
  for (size_t t = 0; t < DDP_ARRAY_LEN(cases); t++)
    len += snprintf(cmd + len, sizeof cmd - (size_t)len, " %d:%lld:%g", cases[t].find_unused,
                    (long long)cases[t].first, cases[t].cap);
  char errlog[] = "/tmp/ddp-layout-err-"
                  "XX"
                  "XX"
                  "XX" /* mkstemp template */;
  int efd = mkstemp(errlog);
  assert_true(efd >= 0);
  close(efd);
  ddp_test_remove_at_exit(errlog);
  snprintf(cmd + len, sizeof cmd - (size_t)len, " 2>%s", errlog);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  char lines[8][512];
  int nl = 0;
  while (nl < 8 && fgets(lines[nl], sizeof lines[nl], p)) nl++;
  pclose(p);
  unlink(script);
  if (nl != 8) {
    char c2[256];
    snprintf(c2, sizeof c2, "cat %s >&2", errlog);
    if (system(c2) != 0) print_error("(no stderr log)\n");
  }
  unlink(errlog);
  assert_int_equal(nl, 8);
  for (size_t t = 0; t < DDP_ARRAY_LEN(cases); t++) {
    cfg_t c = base_cfg(1, M_LN, 0);
    c.dopts.find_unused_parameters = cases[t].find_unused;
    c.dopts.first_bucket_bytes = cases[t].first;
    c.dopts.bucket_cap_mb = cases[t].cap;
    ddp_test_results_t *res = spawn(&c, layout_rank);
    ddp_test_expect_ok(res);
    const uint64_t *v = (const uint64_t *)ddp_test_result(res, 0)->values;
    /* libddp's initial sizes and rebuilt indices in the script's format */
    char mine_init[512] = "initial", mine_reb[512] = "rebuilt ";
    size_t pos = 0, nb = v[pos++];
    static const int64_t numel[] = {288, 24, 24, 24, 576, 24, 120, 5};
    for (size_t b = 0; b < nb; b++) {
      size_t n = v[pos++];
      int64_t sz = 0;
      for (size_t k = 0; k < n; k++) sz += numel[v[pos++]] * 4;
      snprintf(mine_init + strlen(mine_init), sizeof mine_init - strlen(mine_init), " %lld",
               (long long)sz);
    }
    bool rebuilt = v[pos++];
    size_t nr = v[pos++];
    if (!rebuilt) snprintf(mine_reb + strlen(mine_reb), sizeof mine_reb - strlen(mine_reb), "None");
    for (size_t b = 0; b < nr; b++) {
      size_t n = v[pos++];
      for (size_t k = 0; k < n; k++)
        snprintf(mine_reb + strlen(mine_reb), sizeof mine_reb - strlen(mine_reb), "%s%llu",
                 k ? "." : (b ? "|" : ""), (unsigned long long)v[pos++]);
      pos += 2; /* limit, size */
    }
    /* torch joins sizes with ", " (made "  ") and prints "[...]"-free strings */
    char want_init[512] = "initial";
    for (char *tok = strtok(lines[2 * t] + 8, " \n"); tok; tok = strtok(NULL, " \n"))
      snprintf(want_init + strlen(want_init), sizeof want_init - strlen(want_init), " %s", tok);
    lines[2 * t + 1][strcspn(lines[2 * t + 1], "\n")] = 0;
    print_message("torch: %s | %s\nddp:   %s | %s\n", want_init, lines[2 * t + 1], mine_init,
                  mine_reb);
    assert_string_equal(mine_init, want_init);
    assert_string_equal(mine_reb, lines[2 * t + 1]);
    ddp_test_results_free(res);
  }
}

/* ---------------------------------------------------------------- find_unused ----- */

static atomic_int warn_count;
static void count_sink(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  if (level == DDP_LOG_WARN && strstr(line, "did not find any unused parameters"))
    atomic_fetch_add(&warn_count, 1);
}

typedef struct unused_res {
  float sentinel_after; /* a globally unused grad's value after backward */
  float max_diff;       /* |ddp grad - expected average| over the branch */
  float max_other;      /* same over the other parameters */
} unused_res_t;

/* Rank 1 skips the branch, rank 0 uses it (step 0); then both skip it (step 1). Expected
 * grads are computed on a plain copy of the model on each rank and exchanged through the
 * harness values. */
static int unused_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  int r = ddp_test_rank(tr);
  rank_env_t e = {0};
  ddp_model_t *plain = NULL;
  ddp_status_t st = build_model(M_BRANCH, 5, &e.m);
  if (st == DDP_OK) st = build_model(M_BRANCH, 5, &plain);
  if (st == DDP_OK) st = env_open(tr, cfg, &e);
  if (st != DDP_OK) goto out;
  ddp_model_t *m = e.m;
  ddp_ddp_t *ddp = e.ddp;
  ddp_ctx_t *ctx = e.ctx;
  for (int step = 0; step < 3; step++) {
    uint64_t flags = step == 0 ? (r == 0 ? 1 : 0) : (step == 1 ? 0 : 1);
    ddp_var_t *loss;
    /* local grads on the plain copy */
    ddp_model_zero_grad(plain);
    DDP_CHECK_GOTO(fwd_loss(ctx, plain, NULL, step, r * 4, 4, flags, &loss), st, out);
    DDP_CHECK_GOTO(ddp_backward(ctx, loss), st, out);
    ddp_ctx_reset(ctx);
    ddp_model_zero_grad(m);
    ddp_param_t *bw = ddp_model_find_param(m, "3.0.weight");
    if (step == 1) /* unused on every rank: this value must survive */
      for (int64_t k = 0; k < bw->grad.numel; k++) ((float *)bw->grad.data)[k] = 7.0f;
    st = micro_step(&e, step, r * 4, 4, flags, true);
    if (st != DDP_OK) {
      say_ddp_error(tr, "", ddp);
      goto out;
    }
    for (size_t i = 0; i < ddp_model_num_params(m); i++) {
      ddp_test_put(tr, ddp_model_param(plain, i)->grad.data,
                   (size_t)ddp_model_param(plain, i)->grad.numel * 4);
      ddp_test_put(tr, ddp_model_param(m, i)->grad.data,
                   (size_t)ddp_model_param(m, i)->grad.numel * 4);
    }
    ddp_ddp_logging_data_t ld;
    ddp_ddp_get_logging_data(ddp, &ld);
    int64_t ub = ld.unused_parameter_size;
    ddp_test_put(tr, &ub, 8);
  }
out:
  ddp_model_destroy(plain);
  env_close(&e);
  return st;
}

/* find_unused_parameters: a parameter used on rank 0 only gets (g0 + 0)/2; one unused on
 * every rank keeps its grad untouched (the sentinel 7 survives); the unused size is
 * reported; and the "did not find any unused parameters" warning comes once per rank. */
static void test_find_unused(void **state) {
  (void)state;
  ddp_model_t *m;
  assert_int_equal(build_model(M_BRANCH, 5, &m), DDP_OK);
  size_t P = ddp_model_num_params(m), numel[MAXP], total = 0;
  int64_t branch_bytes = 0;
  for (size_t i = 0; i < P; i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    numel[i] = (size_t)p->value.numel;
    total += numel[i];
    if (strncmp(p->name, "3.0.", 4) == 0) branch_bytes += p->value.numel * 4;
  }
  ddp_model_destroy(m);
  cfg_t c = base_cfg(2, M_BRANCH, 0);
  c.dopts.find_unused_parameters = true;
  c.dopts.bucket_cap_mb = 0.002;
  atomic_store(&warn_count, 0);
  ddp_set_log_sink(count_sink, NULL);
  ddp_test_results_t *res = spawn(&c, unused_rank);
  ddp_set_log_sink(NULL, NULL);
  ddp_test_expect_ok(res);
  const float *v[2] = {(const float *)ddp_test_result(res, 0)->values,
                       (const float *)ddp_test_result(res, 1)->values};
  size_t stride = 2 * total * 4 + 8; /* bytes per step */
  for (int step = 0; step < 3; step++) {
    for (int r = 0; r < 2; r++) {
      const char *base = (const char *)v[r] + (size_t)step * stride;
      const char *o0 = (const char *)v[0] + (size_t)step * stride;
      const char *o1 = (const char *)v[1] + (size_t)step * stride;
      size_t off = 0;
      for (size_t i = 0; i < P; i++) {
        const float *got = (const float *)(base + off + numel[i] * 4);
        const float *l0 = (const float *)(o0 + off), *l1 = (const float *)(o1 + off);
        for (size_t k = 0; k < numel[i]; k++) {
          if (step == 1 && (i == 2 || i == 3)) {
            /* unused everywhere: untouched (weight had the sentinel, bias zero) */
            DDP_ASSERT_EQ(got[k], (i == 2 ? 7.0f : 0.0f));
          } else {
            float want = l0[k] * 0.5f + l1[k] * 0.5f;
            DDP_ASSERT_EQ(got[k], want);
          }
        }
        off += 2 * numel[i] * 4;
      }
      int64_t ub;
      memcpy(&ub, base + 2 * total * 4, 8);
      int64_t want_ub = (step == 0 && r == 1) || step == 1 ? branch_bytes : 0;
      assert_int_equal(ub, want_ub);
    }
  }
  /* Step 2 uses everything: one warning per rank, never repeated. */
  assert_int_equal(atomic_load(&warn_count), 2);
  ddp_test_results_free(res);
}

/* ---------------------------------------------------------------- buffers --------- */

static int buffers_rank(ddp_test_rank_t *tr, void *arg) {
  const cfg_t *cfg = arg;
  int r = ddp_test_rank(tr);
  rank_env_t e = {0};
  ddp_status_t st = build_model(M_BN, 3, &e.m);
  if (st == DDP_OK) st = env_open(tr, cfg, &e);
  if (st != DDP_OK) goto out;
  ddp_model_t *m = e.m;
  ddp_ddp_t *ddp = e.ddp;
  ddp_ctx_t *ctx = e.ctx;
  ddp_buffer_t *rm = ddp_model_find_buffer(m, "2.running_mean");
  ddp_buffer_t *nbt = ddp_model_find_buffer(m, "2.num_batches_tracked");
  /* After create: rank 0's buffers everywhere (construction broadcast). */
  ddp_test_put(tr, rm->value.data, ddp_tensor_nbytes(&rm->value));
  /* Three synced steps, then a no_sync step, then one more pre-forward. */
  for (int step = 0; step < 4; step++) {
    st = micro_step(&e, step, r * 4, 4, 1, step != 3);
    if (st != DDP_OK) goto out;
    /* state as the forward of the next step will see it */
    if (step == 2) {
      DDP_CHECK_GOTO(ddp_ddp_pre_forward(ddp, ctx), st, out);
      ddp_test_put(tr, rm->value.data, ddp_tensor_nbytes(&rm->value));
      ddp_test_put(tr, nbt->value.data, ddp_tensor_nbytes(&nbt->value));
    }
  }
  /* After the no_sync forward the next forward does not broadcast. */
  DDP_CHECK_GOTO(ddp_ddp_pre_forward(ddp, ctx), st, out);
  ddp_test_put(tr, rm->value.data, ddp_tensor_nbytes(&rm->value));
out:
  if (st != DDP_OK) {
    if (e.err.msg[0])
      ddp_test_say(tr, "%s", e.err.msg);
    else
      say_ddp_error(tr, "", e.ddp);
  }
  env_close(&e);
  return st;
}

/* broadcast_buffers: rank 0's BatchNorm running stats and num_batches_tracked reach every
 * rank at construction and before each forward that follows a synchronised one, not after
 * a no_sync forward; with broadcast_buffers=false they stay each rank's own. */
static void test_broadcast_buffers(void **state) {
  (void)state;
  for (int on = 0; on < 2; on++) {
    cfg_t c = base_cfg(2, M_BN, 0);
    c.dopts.broadcast_buffers = on;
    ddp_test_results_t *res = spawn(&c, buffers_rank);
    ddp_test_expect_ok(res);
    const char *a = (const char *)ddp_test_result(res, 0)->values;
    const char *b = (const char *)ddp_test_result(res, 1)->values;
    size_t rmb = HID * 4;
    /* at create: identical either way (init is seeded identically on both ranks) */
    assert_memory_equal(a, b, rmb);
    if (on) {
      assert_memory_equal(a + rmb, b + rmb, rmb + 8);
      assert_int_equal(*(const int64_t *)(a + 2 * rmb), 3);
      assert_memory_not_equal(a + 2 * rmb + 8, b + 2 * rmb + 8, rmb);
    } else {
      assert_memory_not_equal(a + rmb, b + rmb, rmb);
    }
    ddp_test_results_free(res);
  }
}

/* ---------------------------------------------------------------- errors ---------- */

typedef struct err_cfg {
  cfg_t c;
  int scenario;
} err_cfg_t;

enum { E_COUNT = 0, E_SHAPE = 1, E_SKIP = 2, E_TWICE = 3 };

static ddp_status_t build_extra(int r, int scenario, ddp_model_t **out) {
  if (scenario == E_COUNT && r == 1) {
    ddp_model_t *m;
    ddp_module_t *l;
    DDP_CHECK(ddp_model_create(&m));
    ddp_module_linear(m, "0", IN, HID, true, DDP_F32, &l);
    ddp_module_linear(m, "1", HID, OUT, true, DDP_F32, &l);
    ddp_module_linear(m, "2", OUT, OUT, true, DDP_F32, &l);
    ddp_model_finalize(m);
    *out = m;
    return DDP_OK;
  }
  if (scenario == E_COUNT || scenario == E_SHAPE) {
    ddp_model_t *m;
    ddp_module_t *l;
    DDP_CHECK(ddp_model_create(&m));
    ddp_module_linear(m, "0", IN, HID + (scenario == E_SHAPE && r == 1), true, DDP_F32, &l);
    ddp_module_linear(m, "1", HID, OUT, true, DDP_F32, &l);
    ddp_model_finalize(m);
    *out = m;
    return DDP_OK;
  }
  return build_model(scenario == E_SKIP ? M_BRANCH : M_CKPT, 9, out);
}

static int error_rank(ddp_test_rank_t *tr, void *arg) {
  const err_cfg_t *ec = arg;
  int r = ddp_test_rank(tr);
  rank_env_t e = {0};
  ddp_status_t st = build_extra(r, ec->scenario, &e.m);
  if (st == DDP_OK) st = env_open(tr, &ec->c, &e);
  if (st != DDP_OK) {
    /* rank 0 is in the broadcast */
    if (ec->scenario == E_SHAPE && e.pg && !e.ddp) ddp_pg_abort(e.pg);
    goto out;
  }
  ddp_ddp_t *ddp = e.ddp;
  for (int step = 0; step < 2; step++) {
    uint64_t flags = ec->scenario == E_SKIP && r == 1 ? 0 : 1;
    st = micro_step(&e, step, r * 4, 4, flags, true);
    if (st != DDP_OK) {
      /* The message can pass the harness's 1 KiB: the whole text goes in the values. */
      char head[32];
      snprintf(head, sizeof head, "step %d: ", step);
      ddp_error_t de;
      ddp_ddp_last_error_copy(ddp, &de);
      ddp_test_say(tr, "%s%s", head, de.msg);
      ddp_test_put(tr, head, strlen(head));
      ddp_test_put(tr, de.msg, strlen(de.msg) + 1);
      goto out;
    }
  }
out:
  env_close(&e);
  return st;
}

static ddp_test_results_t *run_error(int scenario, bool find_unused, int64_t timeout_ms) {
  static err_cfg_t ec;
  ec.c = base_cfg(2, M_PLAIN, 0);
  ec.c.timeout_ms = timeout_ms;
  ec.c.dopts.find_unused_parameters = find_unused;
  ec.scenario = scenario;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 2;
  o.timeout_ms = 20000;
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  assert_int_equal(ddp_store_create_memory(&so, &ec.c.store, NULL), DDP_OK);
  ddp_test_results_t *res = ddp_test_spawn(&o, error_rank, &ec);
  ddp_store_destroy(ec.c.store);
  return res;
}

static void expect_msg(const ddp_test_result_t *r, const char *needle) {
  const char *text = r->nvalues ? (const char *)r->values : r->msg;
  if (!strstr(text, needle)) fail_msg("expected \"%s\" in: %s", needle, text);
}

/* Construction: PyTorch's count and shape messages. */
static void test_error_construction(void **state) {
  (void)state;
  ddp_test_results_t *res = run_error(E_COUNT, false, 3000);
  for (int r = 0; r < 2; r++)
    assert_int_equal(ddp_test_result(res, r)->status, DDP_ERR_INVALID_ARGUMENT);
  expect_msg(ddp_test_result(res, 0),
             "DDP expects same model across all ranks, but Rank 0 has 4 params, while rank 1 "
             "has inconsistent 6 params.");
  expect_msg(ddp_test_result(res, 1),
             "DDP expects same model across all ranks, but Rank 1 has 6 params, while rank 0 "
             "has inconsistent 4 params.");
  ddp_test_results_free(res);

  res = run_error(E_SHAPE, false, 3000);
  assert_int_equal(ddp_test_result(res, 1)->status, DDP_ERR_INVALID_ARGUMENT);
  expect_msg(ddp_test_result(res, 1),
             "[1]: params[0] in this process with sizes [25, 12] appears not to match sizes of "
             "the same param in process 0.");
  assert_int_not_equal(ddp_test_result(res, 0)->status, DDP_OK);
  assert_true(ddp_test_result(res, 0)->elapsed_ms < DDP_TEST_BOUND_MS(10000));
  ddp_test_results_free(res);
}

/* ERROR lines per rank (ranks 0 and 1), and those of rank 0 that the reducer wrote. */
static atomic_int error_lines[2], reducer_error_lines0;
static void error_sink(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  if (level != DDP_LOG_ERROR) return;
  for (int r = 0; r < 2; r++) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "[rank%d] libddp ERROR", r);
    if (strncmp(line, prefix, strlen(prefix)) != 0) continue;
    atomic_fetch_add(&error_lines[r], 1);
    if (r == 0 && (strstr(line, "DDP:") || strstr(line, "DDP ")))
      atomic_fetch_add(&reducer_error_lines0, 1);
  }
}

/* A rank whose loss skips a parameter without find_unused: it fails at its next forward
 * with PyTorch's text naming the indices and names; the other rank fails within the group
 * timeout naming the bucket and the parameter. Each failure is logged once, where it
 * starts: the group's on rank 0 (the reducer only adds the bucket to its message), the
 * reducer's on rank 1. */
static void test_error_unused_without_flag(void **state) {
  (void)state;
  for (int r = 0; r < 2; r++) atomic_store(&error_lines[r], 0);
  atomic_store(&reducer_error_lines0, 0);
  ddp_set_log_sink(error_sink, NULL);
  ddp_test_results_t *res = run_error(E_SKIP, false, 1500);
  ddp_set_log_sink(NULL, NULL);
  print_message("ERROR lines: rank 0 %d (reducer %d), rank 1 %d\n", atomic_load(&error_lines[0]),
                atomic_load(&reducer_error_lines0), atomic_load(&error_lines[1]));
  assert_int_equal(atomic_load(&error_lines[0]), 1);
  assert_int_equal(atomic_load(&reducer_error_lines0), 0);
  assert_int_equal(atomic_load(&error_lines[1]), 1);
  const ddp_test_result_t *r0 = ddp_test_result(res, 0), *r1 = ddp_test_result(res, 1);
  assert_int_equal(r1->status, DDP_ERR_INVALID_USAGE);
  expect_msg(r1, "Expected to have finished reduction in the prior iteration before starting a "
                 "new one. This error indicates that your module has parameters that were not "
                 "used in producing loss. You can enable unused parameter detection by passing "
                 "the keyword argument `find_unused_parameters=True`");
  expect_msg(r1, "Parameter indices which did not receive grad for rank 1: 2 3");
  expect_msg(r1, "3.0.weight, 3.0.bias");
  assert_int_not_equal(r0->status, DDP_OK);
  expect_msg(r0, "bucket 0");
  expect_msg(r0, "3.0.weight");
  assert_true(r0->elapsed_ms < DDP_TEST_BOUND_MS(10000));
  ddp_test_results_free(res);
}

/* find_unused_parameters with a reentrant checkpoint: "marked ready twice", reason 3, the
 * parameter's index and name, from the backward. */
static void test_error_marked_twice(void **state) {
  (void)state;
  ddp_test_results_t *res = run_error(E_TWICE, true, 3000);
  for (int r = 0; r < 2; r++) {
    const ddp_test_result_t *x = ddp_test_result(res, r);
    assert_int_equal(x->status, DDP_ERR_INVALID_USAGE);
    expect_msg(x, "step 0: Expected to mark a variable ready only once.");
    expect_msg(x, "3) Incorrect unused parameter detection.");
    expect_msg(x, "with name 3.0.");
    expect_msg(x, "has been marked as ready twice.");
  }
  ddp_test_results_free(res);
}

/* Appends the reducer's last error to this rank's values (NUL-separated). */
static void put_ddp_error(ddp_test_rank_t *tr, const ddp_ddp_t *ddp) {
  ddp_error_t de = {0};
  ddp_ddp_last_error_copy(ddp, &de);
  ddp_test_put(tr, de.msg, strlen(de.msg) + 1);
}

/* world_size_invariant_shards through the library: K must be a multiple of W; a step must
 * run K / W passes, the last synchronising (a first pass that synchronises is an error
 * naming the pass); comm hooks and join() are refused; the right pass count then trains. */
static int invariant_rank(ddp_test_rank_t *tr, void *arg) {
  cfg_t *cfg = arg;
  rank_env_t e = {0};
  ddp_status_t st = build_model(M_PLAIN, 9, &e.m);
  if (st == DDP_OK) st = env_open(tr, cfg, &e);
  if (st != DDP_OK) goto out; /* env_open said the construction error */
  ddp_comm_hook_t hook = {0};
  ddp_error_t he = {0};
  st = ddp_hooks_create("fp16", "no", "", ddp_test_rank(tr), &hook, &he);
  if (st == DDP_OK) st = ddp_ddp_register_comm_hook(e.ddp, &hook, &he);
  if (hook.fn) hook.free_state(hook.state); /* refused: still ours */
  if (st != DDP_ERR_INVALID_USAGE) {
    ddp_test_say(tr, "comm hook registered: %s", ddp_status_name(st));
    st = DDP_ERR_INTERNAL;
    goto out;
  }
  ddp_test_put(tr, he.msg, strlen(he.msg) + 1);
  if ((st = ddp_ddp_join_begin(e.ddp, true, false)) != DDP_ERR_UNSUPPORTED) {
    st = DDP_ERR_INTERNAL;
    goto out;
  }
  put_ddp_error(tr, e.ddp);
  /* the right count: 2 passes of 2 rows, the second synchronising, for 2 steps */
  st = DDP_OK;
  for (int step = 0; step < 2 && st == DDP_OK; step++) {
    st = micro_step(&e, step, ddp_test_rank(tr) * 4, 2, 1, false);
    if (st == DDP_OK) st = micro_step(&e, step, ddp_test_rank(tr) * 4 + 2, 2, 1, true);
  }
  if (st != DDP_OK) {
    say_ddp_error(tr, "two passes: ", e.ddp);
    goto out;
  }
  /* a synchronising first pass */
  st = micro_step(&e, 2, ddp_test_rank(tr) * 4, 2, 1, true);
  put_ddp_error(tr, e.ddp);
out:
  env_close(&e);
  return st;
}

static void test_world_size_invariant(void **state) {
  (void)state;
  static cfg_t c;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 2;
  o.timeout_ms = 20000;
  const int64_t ks[] = {3, 4};
  for (size_t i = 0; i < 2; i++) {
    c = base_cfg(2, M_PLAIN, 0);
    c.dopts.world_size_invariant_shards = ks[i];
    ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
    assert_int_equal(ddp_store_create_memory(&so, &c.store, NULL), DDP_OK);
    ddp_test_results_t *res = ddp_test_spawn(&o, invariant_rank, &c);
    ddp_store_destroy(c.store);
    for (int r = 0; r < 2; r++) {
      const ddp_test_result_t *x = ddp_test_result(res, r);
      if (ks[i] == 3) {
        assert_int_equal(x->status, DDP_ERR_INVALID_ARGUMENT);
        expect_msg(x, "world_size_invariant_shards must be a multiple of the world size 2");
        continue;
      }
      assert_int_equal(x->status, DDP_ERR_INVALID_USAGE);
      /* the values: the hook's, join's and the pass count's messages, NUL-separated */
      const char *v = (const char *)x->values, *end = v + x->nvalues;
      const char *want[] =
          {"world_size_invariant_shards is on: comm hook fp16_compress_hook is refused",
           "join() is refused with world_size_invariant_shards",
           "the synchronising pass must be the 2-th of its step (one per shard), but it is pass 1"};
      for (size_t k = 0; k < 3; k++, v += strlen(v) + 1) {
        if (v >= end) fail_msg("rank %d: message %zu missing", r, k);
        if (!strstr(v, want[k])) fail_msg("rank %d: expected \"%s\" in: %s", r, want[k], v);
      }
    }
    ddp_test_results_free(res);
  }
}

/* join(): uneven inputs (rank r runs 3 + r steps, W = 3). With
 * divide_by_initial_world_size the joined ranks count as zeros, without it the average is
 * over the ranks still training; either way the final parameters are the last joiner's on
 * every rank and equal the single-process run. BatchNorm buffers go through the join's
 * authoritative-rank broadcast without hanging. throw_on_early_termination fails every
 * rank with PyTorch's texts. */
static void test_join(void **state) {
  (void)state;
  static float ref[4096];
  for (int mode = 1; mode <= 2; mode++) {
    cfg_t c = base_cfg(3, M_LN, 0);
    c.steps = 5;
    c.join = mode;
    size_t nb, nref;
    float *v = run_identical(&c, &nb);
    reference(&c, ref, &nref);
    double e = rel_err(v, ref, nref);
    print_message("join divide_by_initial_world_size=%d: max rel err %.3g\n", mode == 1, e);
    assert_true(e <= 1e-5);
    free(v);
  }
  cfg_t b = base_cfg(3, M_BN, 0);
  b.steps = 4;
  b.join = 1;
  size_t nb;
  free(run_identical(&b, &nb));

  cfg_t t = base_cfg(3, M_PLAIN, 0);
  t.steps = 4;
  t.join = 3;
  ddp_test_results_t *res = spawn(&t, train_rank);
  for (int r = 0; r < 3; r++) assert_int_equal(ddp_test_result(res, r)->status, DDP_ERR_ABORTED);
  assert_non_null(strstr(ddp_test_result(res, 0)->msg, "Rank 0 exhausted all inputs."));
  for (int r = 1; r < 3; r++)
    assert_non_null(strstr(ddp_test_result(res, r)->msg,
                           "Detected at least one rank that exhausted inputs. Throwing across "
                           "all ranks."));
  ddp_test_results_free(res);
}

/* The Chrome trace: one JSON array of complete events from every rank, with forward,
 * backward, finalize and each bucket's allreduce, the buckets launched inside backward
 * (before the finalize starts). */
static void test_timeline(void **state) {
  (void)state;
  char path[] = "/tmp/ddp-trace-"
                "XX"
                "XX"
                "XX" /* mkstemp template */;
  int fd = mkstemp(path);
  if (fd >= 0) ddp_test_remove_at_exit(path); /* also when an assertion below fails */
  assert_true(fd >= 0);
  close(fd);
  cfg_t c = base_cfg(2, M_LN, 0);
  c.steps = 3;
  c.dopts.bucket_cap_mb = 0.001;
  c.dopts.trace_path = path;
  size_t nb;
  free(run_identical(&c, &nb));
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  char line[512];
  assert_non_null(fgets(line, sizeof line, f));
  assert_string_equal(line, "[\n");
  /* Per rank, events come in recording order: forward, then the bucket allreduces and
   * the finalize (recorded in the finalize), then the backward that contains them. */
  int nfwd[2] = {0}, nbwd[2] = {0}, nfin[2] = {0}, nbk[2] = {0}, inside[2] = {0};
  double fin_ts[2] = {0}, b0_ts[2] = {0};
  while (fgets(line, sizeof line, f)) {
    char name[64];
    int pid, tid;
    double ts, dur;
    assert_int_equal(sscanf(line,
                            "{\"name\":\"%63[^\"]\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                            "\"ts\":%lf,\"dur\":%lf",
                            name, &pid, &tid, &ts, &dur),
                     5);
    assert_in_range(pid, 0, 1);
    if (strcmp(name, "forward") == 0) nfwd[pid]++;
    if (strcmp(name, "finalize") == 0) {
      nfin[pid]++;
      fin_ts[pid] = ts;
    }
    if (strncmp(name, "allreduce bucket", 16) == 0) {
      assert_int_equal(tid, 1);
      nbk[pid]++;
      if (strcmp(name, "allreduce bucket 0") == 0) b0_ts[pid] = ts;
    }
    if (strcmp(name, "backward") == 0) {
      nbwd[pid]++;
      /* bucket 0 was launched inside this backward, before its finalize started */
      if (ts <= b0_ts[pid] && b0_ts[pid] <= fin_ts[pid] && fin_ts[pid] <= ts + dur) inside[pid]++;
    }
  }
  fclose(f);
  unlink(path);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(nfwd[r], 3);
    assert_int_equal(nbwd[r], 3);
    assert_int_equal(nfin[r], 3);
    assert_true(nbk[r] > 3); /* 1 bucket in iteration 1, several after the rebuild */
    assert_int_equal(inside[r], 3);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_assignment_examples),
      cmocka_unit_test(test_bucket_layouts),
      cmocka_unit_test(test_bucket_layouts_vs_torch),
      cmocka_unit_test(test_equivalence_threads),
      cmocka_unit_test(test_no_sync_accumulation),
      cmocka_unit_test(test_bitwise_across_configs),
      cmocka_unit_test(test_static_graph),
      cmocka_unit_test(test_find_unused),
      cmocka_unit_test(test_broadcast_buffers),
      cmocka_unit_test(test_join),
      cmocka_unit_test(test_world_size_invariant),
      cmocka_unit_test(test_timeline),
      cmocka_unit_test(test_error_construction),
      cmocka_unit_test(test_error_unused_without_flag),
      cmocka_unit_test(test_error_marked_twice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
