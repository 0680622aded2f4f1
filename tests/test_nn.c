/* Tests of the nn layer without PyTorch: every op's backward against central finite
 * differences in f64, gradient-ready hooks (order, exactly once, tied and reused weights,
 * frozen and unused parameters, reentrant checkpointing), the graph search, zero
 * allocations after the first step, initialisation, batch-norm running statistics, model
 * files and state_dict save/load. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "opcheck.h"

/* ---------------------------------------------------------------- gradcheck ------- */

/* Whether the context's last error (copied out) contains needle. */
static bool ctx_error_has(const ddp_ctx_t *c, const char *needle) {
  ddp_error_t e;
  ddp_ctx_last_error_copy(c, &e);
  return strstr(e.msg, needle) != NULL;
}

static double bn_rm[4] = {0.1, -0.2, 0.3, 0.05}, bn_rv[4] = {1.5, 0.7, 2.0, 0.9};

static ddp_status_t b_linear(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_linear(c, in[0], in[1], in[2], o);
}
static ddp_status_t b_linear_nb(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_linear(c, in[0], in[1], NULL, o);
}
static ddp_status_t b_matmul(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_matmul(c, in[0], in[1], o);
}
static ddp_status_t b_add(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_add(c, in[0], in[1], o);
}
static ddp_status_t b_mul(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_mul(c, in[0], in[1], o);
}
static ddp_status_t b_bias(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_bias_add(c, in[0], in[1], o);
}
static ddp_status_t b_relu(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_RELU, in[0], o);
}
static ddp_status_t b_gelu(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_GELU, in[0], o);
}
static ddp_status_t b_gelut(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_GELU_TANH, in[0], o);
}
static ddp_status_t b_tanh(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_TANH, in[0], o);
}
static ddp_status_t b_sigm(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_activation(c, DDP_ACT_SIGMOID, in[0], o);
}
static ddp_status_t b_softmax(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_softmax(c, in[0], o);
}
static ddp_status_t b_lsm(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_log_softmax(c, in[0], o);
}
static ddp_status_t b_dropout(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_dropout(c, in[0], 0.3, true, o);
}
static ddp_status_t b_ln(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_layer_norm(c, in[0], in[1], in[2], 1e-5, o);
}
static ddp_status_t b_bn_train(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_batch_norm(c, in[0], in[1], in[2], NULL, NULL, NULL, true, 0.1, 1e-5, o);
}
static ddp_status_t b_bn_eval(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  ddp_tensor_t rm, rv;
  int64_t n = 4;
  ddp_tensor_view(&rm, DDP_F64, 1, &n, bn_rm);
  ddp_tensor_view(&rv, DDP_F64, 1, &n, bn_rv);
  return ddp_batch_norm(c, in[0], in[1], in[2], &rm, &rv, NULL, false, 0.1, 1e-5, o);
}
static ddp_status_t b_emb(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_embedding(c, in[0], in[1], o);
}
static ddp_status_t b_reshape(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  int64_t sh[3] = {2, -1, 3};
  ddp_var_t *r;
  ddp_status_t st = ddp_reshape(c, in[0], 3, sh, &r);
  if (st) return st;
  return ddp_activation(c, DDP_ACT_TANH, r, o); /* a consumer, so the view's grad is used */
}
static ddp_status_t b_concat(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_concat(c, 3, in, 1, o);
}
static ddp_status_t b_sum(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_sum(c, in[0], o);
}
static ddp_status_t b_mean(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_mean(c, in[0], o);
}
static ddp_status_t b_mse(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_mse_loss(c, in[0], in[1], o);
}
static ddp_status_t b_ce(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  return ddp_cross_entropy(c, in[0], in[1], -100, o);
}

typedef struct seg_w {
  ddp_var_t *w;
} seg_w_t;
static ddp_status_t seg_lin_tanh(void *user, ddp_ctx_t *c, size_t nin, ddp_var_t *const *in,
                                 ddp_var_t **out) {
  (void)nin;
  ddp_var_t *h;
  ddp_status_t st = ddp_linear(c, in[0], in[1], NULL, &h);
  if (st) return st;
  st = ddp_dropout(c, h, 0.25, true, &h);
  if (st) return st;
  (void)user;
  return ddp_activation(c, DDP_ACT_TANH, h, out);
}
static ddp_status_t b_ckpt(ddp_ctx_t *c, ddp_var_t **in, ddp_var_t **o) {
  ddp_var_t *h;
  ddp_status_t st = ddp_checkpoint(c, seg_lin_tanh, NULL, 2, in, &h);
  if (st) return st;
  return ddp_mul(c, h, h, o);
}

#define F(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, true }
#define FC(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, false }
#define IDS(hi, n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_IDS, hi, false }

static const ddp_test_gcase_t gcases[] = {
    {"linear", 3, {F(3, 2, 3, 5), F(2, 4, 5), F(1, 4)}, b_linear},
    {"linear_nobias", 2, {F(2, 3, 5), F(2, 4, 5)}, b_linear_nb},
    {"matmul", 2, {F(2, 4, 5), F(2, 5, 3)}, b_matmul},
    {"add", 2, {F(2, 3, 4), F(2, 3, 4)}, b_add},
    {"mul", 2, {F(2, 3, 4), F(2, 3, 4)}, b_mul},
    {"bias_add", 2, {F(3, 2, 3, 4), F(1, 4)}, b_bias},
    {"relu", 1, {F(2, 4, 5)}, b_relu},
    {"gelu", 1, {F(2, 4, 5)}, b_gelu},
    {"gelu_tanh", 1, {F(2, 4, 5)}, b_gelut},
    {"tanh", 1, {F(2, 4, 5)}, b_tanh},
    {"sigmoid", 1, {F(2, 4, 5)}, b_sigm},
    {"softmax", 1, {F(2, 3, 6)}, b_softmax},
    {"log_softmax", 1, {F(2, 3, 6)}, b_lsm},
    {"dropout", 1, {F(2, 6, 7)}, b_dropout},
    {"layer_norm", 3, {F(2, 4, 6), F(1, 6), F(1, 6)}, b_ln},
    {"batch_norm_train", 3, {F(2, 5, 4), F(1, 4), F(1, 4)}, b_bn_train},
    {"batch_norm_eval", 3, {F(2, 5, 4), F(1, 4), F(1, 4)}, b_bn_eval},
    {"embedding", 2, {IDS(7, 2, 2, 3), F(2, 7, 4)}, b_emb},
    {"reshape", 1, {F(2, 3, 4)}, b_reshape},
    {"concat", 3, {F(3, 2, 1, 3), F(3, 2, 2, 3), F(3, 2, 3, 3)}, b_concat},
    {"sum", 1, {F(2, 3, 4)}, b_sum},
    {"mean", 1, {F(2, 3, 4)}, b_mean},
    {"mse_loss", 2, {F(2, 3, 4), F(2, 3, 4)}, b_mse},
    {"mse_loss_const_target", 2, {F(2, 3, 4), FC(2, 3, 4)}, b_mse},
    {"cross_entropy", 2, {F(2, 6, 5), {1, {6}, DDP_TEST_IN_TARGETS, 5, false}}, b_ce},
    {"checkpoint", 2, {F(2, 3, 4), F(2, 5, 4)}, b_ckpt},
};

/* Every op's analytic gradient matches central differences: max|a - n| / max|n| < 1e-6. */
static void test_gradcheck(void **state) {
  (void)state;
  ddp_test_gradcheck(gcases, sizeof gcases / sizeof gcases[0], 1e-6);
}

/* ---------------------------------------------------------------- hooks ----------- */

typedef struct rec {
  int n;
  size_t idx[64];
  int fire[64];
  double sumsq[64]; /* the gradient's sum of squares when the hook fired */
} rec_t;

static double grad_sumsq(const ddp_param_t *p) {
  double s = 0;
  for (int64_t k = 0; k < p->value.numel; k++) {
    double g = p->value.dtype == DDP_F32 ? ((float *)p->grad.data)[k] : ((double *)p->grad.data)[k];
    s += g * g;
  }
  return s;
}

static void on_ready(void *user, ddp_param_t *p, int fire) {
  rec_t *r = user;
  assert_true(r->n < 64);
  r->idx[r->n] = p->index;
  r->fire[r->n] = fire;
  r->sumsq[r->n] = grad_sumsq(p);
  r->n++;
}

/* Each fired gradient equals the final one (it was final when the hook ran). */
static void expect_final(ddp_model_t *m, const rec_t *r) {
  for (int i = 0; i < r->n; i++) {
    bool last = true;
    for (int j = i + 1; j < r->n; j++) last = last && r->idx[j] != r->idx[i];
    if (last) DDP_ASSERT_EQ(r->sumsq[i], grad_sumsq(ddp_model_param(m, r->idx[i])));
  }
}

typedef struct cbrec {
  ddp_ctx_t *ctx;
  rec_t r;
  int queued, ran, hooks_seen_at_run;
  bool in_bwd_at_hook;
} cbrec_t;

static ddp_status_t end_cb(void *user) {
  cbrec_t *s = user;
  s->ran++;
  s->hooks_seen_at_run = s->r.n;
  return DDP_OK;
}

static void queue_on_first(void *user, ddp_param_t *p, int fire) {
  cbrec_t *s = user;
  on_ready(&s->r, p, fire);
  s->in_bwd_at_hook = ddp_ctx_in_backward(s->ctx);
  if (!s->queued++) assert_int_equal(ddp_ctx_queue_callback(s->ctx, end_cb, s), DDP_OK);
}

static ddp_model_t *mlp_model(ddp_dtype_t dt, const int64_t *dims, int nlayers, bool with_root) {
  ddp_model_t *m;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  ddp_module_t *seq, *mod;
  assert_int_equal(ddp_module_sequential(m, &seq), DDP_OK);
  for (int i = 0; i < nlayers; i++) {
    char name[16];
    snprintf(name, sizeof name, "%d", 2 * i);
    assert_int_equal(ddp_module_linear(m, name, dims[i], dims[i + 1], true, dt, &mod), DDP_OK);
    assert_int_equal(ddp_module_append(seq, mod), DDP_OK);
    if (i + 1 < nlayers) {
      assert_int_equal(ddp_module_activation(m, DDP_ACT_RELU, &mod), DDP_OK);
      assert_int_equal(ddp_module_append(seq, mod), DDP_OK);
    }
  }
  assert_int_equal(ddp_model_finalize(m), DDP_OK);
  if (with_root) ddp_model_set_root(m, seq);
  assert_int_equal(ddp_model_init(m, 42), DDP_OK);
  return m;
}

static ddp_var_t *rand_input(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                             uint64_t seed) {
  return ddp_test_rand_var(c, dt, ndim, shape, seed, false);
}

/* Finalizes m and sets its F64 parameters to U(-0.5, 0.5) draws from seed (stream seed). */
static void finalize_random(ddp_model_t *m, uint64_t seed) {
  assert_int_equal(ddp_model_finalize(m), DDP_OK);
  ddp_rng_t g;
  ddp_rng_init(&g, seed, seed);
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    double *v = p->value.data;
    for (int64_t k = 0; k < p->value.numel; k++) v[k] = ddp_rng_uniform_f64(&g) - 0.5;
  }
}

static ddp_var_t *targets(ddp_ctx_t *c, int64_t n, int64_t classes) {
  ddp_var_t *t;
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &n, NULL, false, &t), DDP_OK);
  for (int64_t i = 0; i < n; i++) ((int64_t *)t->value.data)[i] = (i * 7 + 3) % classes;
  return t;
}

/* MLP: every parameter fires exactly once, in reverse layer order, bias before weight, and
 * each fired gradient is final. */
static void test_hooks_mlp(void **state) {
  (void)state;
  int64_t dims[4] = {5, 8, 6, 3};
  ddp_model_t *m = mlp_model(DDP_F64, dims, 3, true);
  rec_t r = {0};
  ddp_model_set_hook(m, on_ready, &r);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {4, 5};
  ddp_var_t *y, *loss;
  assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, xs, 1), 0, &y), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, y, targets(c, 4, 3), -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  size_t expect[6] = {5, 4, 3, 2, 1, 0}; /* 4.bias 4.weight 2.bias 2.weight 0.bias 0.weight */
  assert_int_equal(r.n, 6);
  for (int i = 0; i < 6; i++) {
    assert_int_equal(r.idx[i], expect[i]);
    assert_int_equal(r.fire[i], 1);
  }
  expect_final(m, &r);
  /* A second backward in a new step fires again with fire count 1 and accumulates (+=). */
  double before = ((double *)ddp_model_param(m, 0)->grad.data)[0];
  ddp_ctx_reset(c);
  r.n = 0;
  assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, xs, 1), 0, &y), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, y, targets(c, 4, 3), -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(r.n, 6);
  assert_int_equal(r.fire[5], 1);
  assert_true(fabs(((double *)ddp_model_param(m, 0)->grad.data)[0] - 2 * before) <=
              1e-12 * fabs(before));
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* A callback queued from the first hook runs once, after the last hook of the backward
 * (PyTorch's queue_callback, where DDP finalizes), and the queue is empty afterwards. */
static void test_backward_callback(void **state) {
  (void)state;
  int64_t dims[3] = {5, 8, 3};
  ddp_model_t *m = mlp_model(DDP_F64, dims, 2, true);
  cbrec_t s;
  memset(&s, 0, sizeof s);
  assert_int_equal(ddp_ctx_create(&s.ctx), DDP_OK);
  ddp_model_set_hook(m, queue_on_first, &s);
  int64_t xs[2] = {4, 5};
  for (int step = 0; step < 2; step++) {
    ddp_var_t *y, *loss;
    ddp_ctx_reset(s.ctx);
    s.queued = 0;
    s.r.n = 0;
    assert_int_equal(ddp_model_forward(m, s.ctx, rand_input(s.ctx, DDP_F64, 2, xs, 1), 0, &y),
                     DDP_OK);
    assert_int_equal(ddp_sum(s.ctx, y, &loss), DDP_OK);
    assert_false(ddp_ctx_in_backward(s.ctx));
    assert_int_equal(ddp_backward(s.ctx, loss), DDP_OK);
    assert_int_equal(s.ran, step + 1);
    assert_int_equal(s.hooks_seen_at_run, 4);
    assert_true(s.in_bwd_at_hook);
  }
  ddp_ctx_destroy(s.ctx);
  ddp_model_destroy(m);
}

/* Tied weights: an embedding matrix E [V, D] used as the input embedding and as the output
 * projection fires once, after its last contribution (the embedding's), and its gradient
 * is the sum of both uses. The same parameter applied twice in sequence behaves alike. */
static void test_hooks_tied_and_reused(void **state) {
  (void)state;
  ddp_model_t *m;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  int64_t es[2] = {7, 4}, ls[2] = {4, 4}, bs = 4;
  size_t iE, iW, iB;
  assert_int_equal(ddp_model_add_param(m, "emb.weight", DDP_F64, 2, es, true, &iE), DDP_OK);
  assert_int_equal(ddp_model_add_param(m, "lin.weight", DDP_F64, 2, ls, true, &iW), DDP_OK);
  assert_int_equal(ddp_model_add_param(m, "lin.bias", DDP_F64, 1, &bs, true, &iB), DDP_OK);
  finalize_random(m, 5);
  rec_t r = {0};
  ddp_model_set_hook(m, on_ready, &r);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t ids_shape = 3;
  int64_t ids[3] = {1, 5, 1};
  ddp_var_t *idv, *h, *y, *loss;
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &ids_shape, ids, false, &idv), DDP_OK);
  ddp_var_t *E = ddp_param_var(c, ddp_model_param(m, iE));
  ddp_var_t *W = ddp_param_var(c, ddp_model_param(m, iW));
  ddp_var_t *B = ddp_param_var(c, ddp_model_param(m, iB));
  assert_int_equal(ddp_embedding(c, idv, E, &h), DDP_OK);
  /* lin used twice: h -> tanh(lin(h)) -> lin(.) */
  assert_int_equal(ddp_linear(c, h, W, B, &h), DDP_OK);
  assert_int_equal(ddp_activation(c, DDP_ACT_TANH, h, &h), DDP_OK);
  assert_int_equal(ddp_linear(c, h, W, B, &h), DDP_OK);
  assert_int_equal(ddp_linear(c, h, E, NULL, &y), DDP_OK); /* tied output projection [3, 7] */
  assert_int_equal(ddp_cross_entropy(c, y, targets(c, 3, 7), -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(r.n, 3);
  /* lin.bias and lin.weight finish at the first application (reached last in reverse, but
   * before the embedding); E finishes at the embedding, the last node. */
  assert_int_equal(r.idx[0], iB);
  assert_int_equal(r.idx[1], iW);
  assert_int_equal(r.idx[2], iE);
  for (int i = 0; i < 3; i++) assert_int_equal(r.fire[i], 1);
  expect_final(m, &r);
  /* E's gradient has both contributions: rows 1 and 5 (embedding) differ from the output
   * projection's alone, and rows 0, 2.. (output only) are non-zero. */
  const double *gE = ddp_model_param(m, iE)->grad.data;
  double row0 = 0;
  for (int j = 0; j < 4; j++) row0 += fabs(gE[j]);
  assert_true(row0 > 0);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

static void mark_reached(void *user, ddp_param_t *p) {
  bool *reach = user;
  assert_false(reach[p->index]); /* once per parameter */
  reach[p->index] = true;
}

/* Frozen parameters never fire and keep a zero gradient; an unused branch's parameters
 * never fire and are not reachable; with the flag set they are. */
static void test_hooks_frozen_unused(void **state) {
  (void)state;
  const char *json = "{\"dtype\": \"f64\", \"layers\": ["
                     "{\"type\": \"linear\", \"in\": 4, \"out\": 6, \"frozen\": true},"
                     "{\"type\": \"tanh\"},"
                     "{\"type\": \"branch\", \"flag\": 2, \"layers\": [{\"type\": \"linear\", "
                     "\"in\": 6, \"out\": 6}, {\"type\": \"relu\"}]},"
                     "{\"type\": \"linear\", \"in\": 6, \"out\": 3}]}";
  ddp_model_t *m;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(json, &m, &err), DDP_OK);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  assert_int_equal(ddp_model_num_params(m), 6);
  assert_string_equal(ddp_model_param(m, 2)->name, "2.body.0.weight");
  rec_t r = {0};
  ddp_model_set_hook(m, on_ready, &r);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {5, 4};
  for (int flag_on = 0; flag_on < 2; flag_on++) {
    ddp_ctx_reset(c);
    r.n = 0;
    ddp_var_t *y, *loss;
    assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, xs, 9), flag_on ? 4 : 0, &y),
                     DDP_OK);
    bool reach[6] = {0};
    ddp_graph_visit_params(c, 1, &y, mark_reached, reach);
    /* frozen params are not reported; the branch's only with the flag; the head always */
    assert_false(reach[0] || reach[1]);
    DDP_ASSERT_EQ(reach[2], (bool)flag_on);
    DDP_ASSERT_EQ(reach[3], (bool)flag_on);
    assert_true(reach[4] && reach[5]);
    assert_int_equal(ddp_mse_loss(c, y, rand_input(c, DDP_F64, 2, (int64_t[]){5, 3}, 4), &loss),
                     DDP_OK);
    assert_int_equal(ddp_backward(c, loss), DDP_OK);
    assert_int_equal(r.n, flag_on ? 4 : 2);
    for (int i = 0; i < r.n; i++) assert_true(r.idx[i] >= 2); /* frozen 0.* never fire */
    if (!flag_on) {
      assert_int_equal(r.idx[0], 5);
      assert_int_equal(r.idx[1], 4);
    }
    DDP_ASSERT_EQ(grad_sumsq(ddp_model_param(m, 0)), 0);
    DDP_ASSERT_EQ(grad_sumsq(ddp_model_param(m, 1)), 0);
    expect_final(m, &r);
  }
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

static const char *ckpt_json(bool checkpointed) {
  return checkpointed
             ? "{\"dtype\": \"f64\", \"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 6},"
               "{\"type\": \"tanh\"}, {\"type\": \"checkpoint\", \"layers\": [{\"type\": "
               "\"linear\", "
               "\"in\": 6, \"out\": 6}, {\"type\": \"dropout\", \"p\": 0.2}, {\"type\": "
               "\"tanh\"}]},"
               "{\"type\": \"linear\", \"in\": 6, \"out\": 3}]}"
             : "{\"dtype\": \"f64\", \"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 6},"
               "{\"type\": \"tanh\"}, {\"type\": \"linear\", \"in\": 6, \"out\": 6}, "
               "{\"type\": \"dropout\", \"p\": 0.2}, {\"type\": \"tanh\"},"
               "{\"type\": \"linear\", \"in\": 6, \"out\": 3}]}";
}

/* A checkpointed segment: its parameters are unreachable from the output (forward ran
 * without grad), fire during the recompute's inner backward in reverse order, and the
 * gradients equal those of the same model without checkpointing, bit for bit. */
static void test_hooks_checkpoint(void **state) {
  (void)state;
  ddp_model_t *m[2];
  rec_t r[2] = {{0}, {0}};
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {5, 4};
  for (int k = 0; k < 2; k++) {
    assert_int_equal(ddp_model_from_json(ckpt_json(k == 1), &m[k], NULL), DDP_OK);
    assert_int_equal(ddp_model_init(m[k], 11), DDP_OK);
    ddp_model_set_hook(m[k], on_ready, &r[k]);
    ddp_ctx_reset(c);
    ddp_ctx_set_rng(c, 1, 0, 0);
    ddp_var_t *y, *loss;
    assert_int_equal(ddp_model_forward(m[k], c, rand_input(c, DDP_F64, 2, xs, 9), 0, &y), DDP_OK);
    if (k == 1) {
      bool reach[6] = {0};
      ddp_graph_visit_params(c, 1, &y, mark_reached, reach);
      assert_true(reach[0] && reach[1] && !reach[2] && !reach[3] && reach[4] && reach[5]);
    }
    assert_int_equal(ddp_cross_entropy(c, y, targets(c, 5, 3), -100, &loss), DDP_OK);
    assert_int_equal(ddp_backward(c, loss), DDP_OK);
    assert_int_equal(r[k].n, 6);
    for (int i = 0; i < 6; i++) {
      assert_int_equal(r[k].idx[i], 5 - i);
      assert_int_equal(r[k].fire[i], 1);
    }
    expect_final(m[k], &r[k]);
  }
  ddp_tensor_t g0 = ddp_model_flat_grads(m[0], DDP_F64), g1 = ddp_model_flat_grads(m[1], DDP_F64);
  assert_int_equal(g0.numel, g1.numel);
  assert_memory_equal(g0.data, g1.data, ddp_tensor_nbytes(&g0));
  ddp_model_destroy(m[0]);
  ddp_model_destroy(m[1]);
  ddp_ctx_destroy(c);
}

static ddp_status_t seg_uses_param(void *user, ddp_ctx_t *c, size_t nin, ddp_var_t *const *in,
                                   ddp_var_t **out) {
  (void)nin;
  ddp_var_t *h;
  ddp_status_t st = ddp_linear(c, in[0], ddp_param_var(c, user), NULL, &h);
  if (st) return st;
  return ddp_activation(c, DDP_ACT_TANH, h, out);
}

/* A parameter used inside a checkpointed segment and outside it fires twice in one
 * backward (fire counts 1 then 2): what DDP must detect as "marked ready twice". */
static void test_hooks_checkpoint_fires_again(void **state) {
  (void)state;
  ddp_model_t *m;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  int64_t ws[2] = {4, 4};
  assert_int_equal(ddp_model_add_param(m, "a", DDP_F64, 2, ws, true, NULL), DDP_OK);
  assert_int_equal(ddp_model_add_param(m, "w", DDP_F64, 2, ws, true, NULL), DDP_OK);
  finalize_random(m, 8);
  rec_t r = {0};
  ddp_model_set_hook(m, on_ready, &r);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {3, 4};
  ddp_var_t *h, *y, *loss;
  ddp_param_t *A = ddp_model_param(m, 0), *W = ddp_model_param(m, 1);
  assert_int_equal(ddp_linear(c, rand_input(c, DDP_F64, 2, xs, 2), ddp_param_var(c, A), NULL, &h),
                   DDP_OK);
  assert_int_equal(ddp_checkpoint(c, seg_uses_param, W, 1, &h, &h), DDP_OK);
  assert_int_equal(ddp_linear(c, h, ddp_param_var(c, W), NULL, &y), DDP_OK);
  assert_int_equal(ddp_sum(c, y, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(r.n, 3);
  assert_int_equal(r.idx[0], 1);
  assert_int_equal(r.fire[0], 1);
  assert_int_equal(r.idx[1], 1);
  assert_int_equal(r.fire[1], 2);
  assert_int_equal(r.idx[2], 0);
  assert_int_equal(r.fire[2], 1);
  /* A new backward starts the counts again. */
  ddp_ctx_reset(c);
  r.n = 0;
  assert_int_equal(ddp_linear(c, rand_input(c, DDP_F64, 2, xs, 2), ddp_param_var(c, W), NULL, &y),
                   DDP_OK);
  assert_int_equal(ddp_sum(c, y, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(r.n, 1);
  assert_int_equal(r.fire[0], 1);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* ---------------------------------------------------------------- memory ---------- */

/* After the first step, forward + backward of a 784-1024-1024-10 MLP at batch 64 allocates
 * nothing (the arena is reused). */
static void test_zero_alloc_after_first_step(void **state) {
  (void)state;
  int64_t dims[4] = {784, 1024, 1024, 10};
  ddp_model_t *m = mlp_model(DDP_F32, dims, 3, true);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t t[64];
  float *x = ddp_test_mlp_batch(t);
  ddp_test_mlp_step(m, c, x, t);
  ddp_alloc_stats_t a0, a1;
  ddp_alloc_stats(&a0);
  for (int s = 0; s < 3; s++) ddp_test_mlp_step(m, c, x, t);
  ddp_alloc_stats(&a1);
  assert_int_equal(a1.allocs - a0.allocs, 0);
  assert_int_equal(a1.frees - a0.frees, 0);
  assert_true(ddp_ctx_arena_bytes(c) > 0);
  free(x);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* ---------------------------------------------------------------- init ------------ */

/* Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias (moments
 * within sampling error), deterministic per seed; norms start at weight 1, bias 0. */
static void test_init(void **state) {
  (void)state;
  int64_t dims[2] = {100, 300};
  ddp_model_t *m = mlp_model(DDP_F64, dims, 1, false), *m2 = mlp_model(DDP_F64, dims, 1, false);
  ddp_param_t *w = ddp_model_param(m, 0);
  double bound = 0.1, s = 0, s2 = 0;
  for (int64_t k = 0; k < w->value.numel; k++) {
    double v = ((double *)w->value.data)[k];
    assert_true(fabs(v) <= bound);
    s += v;
    s2 += v * v;
  }
  double n = (double)w->value.numel, mean = s / n, var = s2 / n - mean * mean;
  assert_true(fabs(mean) < 0.003);
  assert_true(fabs(var / (bound * bound / 3) - 1) < 0.03);
  ddp_param_t *b = ddp_model_param(m, 1);
  for (int64_t k = 0; k < b->value.numel; k++)
    assert_true(fabs(((double *)b->value.data)[k]) <= bound);
  ddp_tensor_t f1 = ddp_model_flat_params(m, DDP_F64), f2 = ddp_model_flat_params(m2, DDP_F64);
  assert_memory_equal(f1.data, f2.data, ddp_tensor_nbytes(&f1));
  assert_int_equal(ddp_model_init(m2, 43), DDP_OK);
  assert_memory_not_equal(f1.data, f2.data, ddp_tensor_nbytes(&f1));
  /* views tile the flat buffer in registration order */
  assert_ptr_equal(w->value.data, f1.data);
  assert_ptr_equal(b->value.data, (double *)f1.data + w->value.numel);
  assert_ptr_equal(b->grad.data, (double *)ddp_model_flat_grads(m, DDP_F64).data + w->value.numel);
  ddp_model_destroy(m);
  ddp_model_destroy(m2);
}

/* ---------------------------------------------------------------- batch norm ------ */

/* Running statistics follow PyTorch's rule (momentum 0.1, unbiased running variance,
 * num_batches_tracked counts), and eval mode normalises with them. */
static void test_batch_norm_running_stats(void **state) {
  (void)state;
  ddp_model_t *m;
  ddp_module_t *bn;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  assert_int_equal(ddp_module_batch_norm(m, "bn", 4, 1e-5, 0.1, DDP_F64, &bn), DDP_OK);
  assert_int_equal(ddp_model_finalize(m), DDP_OK);
  ddp_model_set_root(m, bn);
  assert_int_equal(ddp_model_init(m, 1), DDP_OK);
  assert_int_equal(ddp_model_num_buffers(m), 3);
  assert_string_equal(ddp_model_buffer(m, 2)->name, "bn.num_batches_tracked");
  assert_int_equal(ddp_model_buffer(m, 2)->value.dtype, DDP_I64);
  double rm[4] = {0, 0, 0, 0}, rv[4] = {1, 1, 1, 1};
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {6, 4};
  ddp_var_t *x = NULL, *y;
  for (int step = 0; step < 2; step++) {
    ddp_ctx_reset(c);
    x = rand_input(c, DDP_F64, 2, xs, 20 + step);
    assert_int_equal(ddp_model_forward(m, c, x, 0, &y), DDP_OK);
    const double *xd = x->value.data;
    for (int j = 0; j < 4; j++) {
      double mu = 0, v = 0;
      for (int i = 0; i < 6; i++) mu += xd[i * 4 + j];
      mu /= 6;
      for (int i = 0; i < 6; i++) v += (xd[i * 4 + j] - mu) * (xd[i * 4 + j] - mu);
      rm[j] = 0.9 * rm[j] + 0.1 * mu;
      rv[j] = 0.9 * rv[j] + 0.1 * v / 5;
      double y0 = (xd[j] - mu) / sqrt(v / 6 + 1e-5);
      assert_true(fabs(((double *)y->value.data)[j] - y0) < 1e-12);
    }
  }
  const double *brm = ddp_model_buffer(m, 0)->value.data, *brv = ddp_model_buffer(m, 1)->value.data;
  for (int j = 0; j < 4; j++) {
    assert_true(fabs(brm[j] - rm[j]) < 1e-14);
    assert_true(fabs(brv[j] - rv[j]) < 1e-14);
  }
  assert_int_equal(((int64_t *)ddp_model_buffer(m, 2)->value.data)[0], 2);
  ddp_model_train(m, false);
  assert_int_equal(ddp_model_forward(m, c, x, 0, &y), DDP_OK);
  for (int j = 0; j < 4; j++) {
    double y0 = (((double *)x->value.data)[j] - rm[j]) / sqrt(rv[j] + 1e-5);
    assert_true(fabs(((double *)y->value.data)[j] - y0) < 1e-12);
  }
  assert_int_equal(((int64_t *)ddp_model_buffer(m, 2)->value.data)[0], 2);
  /* A batch of one in training is PyTorch's error. */
  ddp_model_train(m, true);
  int64_t one[2] = {1, 4};
  assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, one, 1), 0, &y),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_true(ctx_error_has(c, "Expected more than 1 value per channel"));
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* Cross-entropy's mean skips ignore_index targets; a naive log-sum-exp gives the value. */
static void test_cross_entropy_value(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {4, 3}, n = 4;
  ddp_var_t *x = rand_input(c, DDP_F64, 2, xs, 77), *t, *loss;
  int64_t tt[4] = {2, -100, 0, 1};
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &n, tt, false, &t), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, x, t, -100, &loss), DDP_OK);
  const double *xd = x->value.data;
  double s = 0;
  for (int i = 0; i < 4; i++) {
    if (tt[i] < 0) continue;
    double z = 0;
    for (int j = 0; j < 3; j++) z += exp(xd[i * 3 + j]);
    s += log(z) - xd[i * 3 + tt[i]];
  }
  assert_true(fabs(((double *)loss->value.data)[0] - s / 3) < 1e-14);
  tt[0] = 3;
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &n, tt, false, &t), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, x, t, -100, &loss), DDP_ERR_INVALID_ARGUMENT);
  assert_true(ctx_error_has(c, "Target 3 is out of bounds"));
  ddp_ctx_destroy(c);
}

/* ---------------------------------------------------------------- model files ----- */

static const char *big_json =
    "{\"layers\": [{\"type\": \"embedding\", \"num\": 10, \"dim\": 4}, {\"type\": \"flatten\"},"
    "{\"type\": \"linear\", \"in\": 12, \"out\": 8}, {\"type\": \"layernorm\", \"dim\": 8},"
    "{\"type\": \"gelu\", \"approximate\": \"tanh\"},"
    "{\"type\": \"residual\", \"layers\": [{\"type\": \"linear\", \"in\": 8, \"out\": 8},"
    "  {\"type\": \"batchnorm\", \"dim\": 8}, {\"type\": \"relu\"}, {\"type\": \"dropout\", \"p\": "
    "0.1}]},"
    "{\"type\": \"linear\", \"in\": 8, \"out\": 3}]}";

/* The JSON builder names parameters and buffers as PyTorch's state_dict does, a forward and
 * backward through every layer type fires every parameter once, and state_dict round-trips
 * through safetensors; load errors list missing and unexpected keys and size mismatches. */
static void test_model_json_state_dict(void **state) {
  (void)state;
  ddp_model_t *m, *m2;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(big_json, &m, &err), DDP_OK);
  static const char *pn[] = {"0.weight",      "2.weight",        "2.bias",        "3.weight",
                             "3.bias",        "5.body.0.weight", "5.body.0.bias", "5.body.1.weight",
                             "5.body.1.bias", "6.weight",        "6.bias"};
  static const char *bn[] = {"5.body.1.running_mean", "5.body.1.running_var",
                             "5.body.1.num_batches_tracked"};
  assert_int_equal(ddp_model_num_params(m), 11);
  for (size_t i = 0; i < 11; i++) assert_string_equal(ddp_model_param(m, i)->name, pn[i]);
  for (size_t i = 0; i < 3; i++) assert_string_equal(ddp_model_buffer(m, i)->name, bn[i]);
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);

  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  rec_t r = {0};
  ddp_model_set_hook(m, on_ready, &r);
  int64_t is[2] = {5, 3}, ids[15];
  for (int i = 0; i < 15; i++) ids[i] = (i * 3) % 10;
  ddp_var_t *x, *y, *loss;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, is, ids, false, &x), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, x, 0, &y), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, y, targets(c, 5, 3), -100, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(r.n, 11);
  for (int i = 0; i < 11; i++) assert_int_equal(r.fire[i], 1);
  assert_int_equal(r.idx[10], 0); /* the embedding is reached last */
  expect_final(m, &r);

  char dir[] = "/tmp/ddp_nn_XXXXXX";
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  char path[256], path2[256];
  snprintf(path, sizeof path, "%s/m.safetensors", dir);
  snprintf(path2, sizeof path2, "%s/other.safetensors", dir);
  assert_int_equal(ddp_model_save(m, path, &err), DDP_OK);
  assert_int_equal(ddp_model_from_json(big_json, &m2, &err), DDP_OK);
  assert_int_equal(ddp_model_init(m2, 6), DDP_OK);
  size_t nm = 9, nu = 9;
  assert_int_equal(ddp_model_load(m2, path, true, &nm, &nu, &err), DDP_OK);
  assert_int_equal(nm, 0);
  assert_int_equal(nu, 0);
  ddp_tensor_t a = ddp_model_flat_params(m, DDP_F32), b = ddp_model_flat_params(m2, DDP_F32);
  assert_memory_equal(a.data, b.data, ddp_tensor_nbytes(&a));
  for (size_t i = 0; i < 3; i++)
    assert_memory_equal(ddp_model_buffer(m, i)->value.data, ddp_model_buffer(m2, i)->value.data,
                        ddp_tensor_nbytes(&ddp_model_buffer(m, i)->value));

  /* A different architecture: strict lists both kinds of key; non-strict loads the rest. */
  ddp_model_t *m3;
  assert_int_equal(
      ddp_model_from_json("{\"layers\": [{\"type\": \"embedding\", \"num\": 10, \"dim\": 4},"
                          "{\"type\": \"flatten\"}, {\"type\": \"linear\", \"in\": 12, \"out\": 8},"
                          "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 8, \"out\": 8}]}",
                          &m3, &err),
      DDP_OK);
  assert_int_equal(ddp_model_load(m3, path, true, &nm, &nu, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "Missing key(s) in state_dict: \"4.weight\", \"4.bias\". "));
  assert_non_null(
      strstr(err.msg,
             "Unexpected key(s) in state_dict: \"3.weight\", \"3.bias\", \"5.body.0.weight\""));
  assert_int_equal(nm, 2);
  assert_int_equal(nu, 11);
  assert_int_equal(ddp_model_load(m3, path, false, &nm, &nu, &err), DDP_OK);
  assert_memory_equal(ddp_model_param(m3, 1)->value.data, ddp_model_param(m, 1)->value.data,
                      12 * 8 * 4);
  /* Size mismatch is an error even without strict, and nothing is modified. */
  ddp_model_t *m4;
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"embedding\", \"num\": 11, "
                                       "\"dim\": 4}]}",
                                       &m4, &err),
                   DDP_OK);
  assert_int_equal(ddp_model_load(m4, path, false, &nm, &nu, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "size mismatch for 0.weight: copying a param with shape "
                                  "torch.Size([10, 4]) from checkpoint, the shape in current model "
                                  "is torch.Size([11, 4])."));
  DDP_ASSERT_EQ(grad_sumsq(ddp_model_param(m4, 0)), 0);
  /* A prefix nests every name. */
  ddp_model_t *m5;
  assert_int_equal(
      ddp_model_from_json("{\"prefix\": \"model.layers\", \"layers\": [{\"type\": \"residual\", "
                          "\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 2}]}]}",
                          &m5, &err),
      DDP_OK);
  assert_string_equal(ddp_model_param(m5, 1)->name, "model.layers.0.body.0.bias");
  ddp_model_destroy(m5);
  assert_int_equal(ddp_model_from_json("{\"prefix\": \"a..b\", \"layers\": []}", &m5, &err),
                   DDP_ERR_INVALID_DATA);
  /* Malformed model files give a message naming the layer. */
  ddp_model_t *bad = NULL;
  assert_int_equal(ddp_model_from_json(
                       "{\"layers\": [{\"type\": \"linear\", \"in\": 0, \"out\": 2}]}", &bad, &err),
                   DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "layers[0]"));
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"conv\"}]}", &bad, &err),
                   DDP_ERR_INVALID_DATA);
  assert_null(bad);
  unlink(path);
  rmdir(dir);
  ddp_model_destroy(m);
  ddp_model_destroy(m2);
  ddp_model_destroy(m3);
  ddp_model_destroy(m4);
  ddp_ctx_destroy(c);
}

/* A parameter's gradient can be pointed elsewhere (a DDP bucket): backward accumulates
 * there, and NULL restores the flat buffer's view. */
static void test_grad_redirect(void **state) {
  (void)state;
  int64_t dims[2] = {3, 2};
  ddp_model_t *m = mlp_model(DDP_F64, dims, 1, true);
  ddp_param_t *w = ddp_model_param(m, 0);
  double bucket[6] = {0};
  void *home = w->grad.data;
  ddp_param_set_grad_data(w, bucket);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {4, 3};
  ddp_var_t *y, *loss;
  assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, xs, 1), 0, &y), DDP_OK);
  assert_int_equal(ddp_sum(c, y, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  double s = 0;
  for (int k = 0; k < 6; k++) s += fabs(bucket[k]);
  assert_true(s > 0);
  for (int k = 0; k < 6; k++) DDP_ASSERT_EQ(((double *)home)[k], 0);
  ddp_param_set_grad_data(w, NULL);
  assert_ptr_equal(w->grad.data, home);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* No-grad mode records nothing: outputs do not require grad and backward refuses them. */
static void test_no_grad(void **state) {
  (void)state;
  int64_t dims[2] = {3, 2};
  ddp_model_t *m = mlp_model(DDP_F64, dims, 1, true);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  assert_true(ddp_ctx_set_grad_enabled(c, false));
  int64_t xs[2] = {4, 3};
  ddp_var_t *y, *loss;
  assert_int_equal(ddp_model_forward(m, c, rand_input(c, DDP_F64, 2, xs, 1), 0, &y), DDP_OK);
  assert_false(y->requires_grad);
  assert_null(y->creator);
  assert_int_equal(ddp_sum(c, y, &loss), DDP_OK);
  assert_int_equal(ddp_backward(c, loss), DDP_ERR_INVALID_USAGE);
  assert_false(ddp_ctx_set_grad_enabled(c, true));
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

static float *dropout_mask(ddp_ctx_t *c, uint32_t rank, uint64_t step, int call, int64_t n) {
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 5, rank, step);
  ddp_var_t *x, *y = NULL;
  assert_int_equal(ddp_var_new(c, DDP_F32, 1, &n, NULL, false, &x), DDP_OK);
  for (int64_t k = 0; k < n; k++) ((float *)x->value.data)[k] = 1.0f;
  for (int i = 0; i <= call; i++) assert_int_equal(ddp_dropout(c, x, 0.3, true, &y), DDP_OK);
  float *m = malloc((size_t)n * sizeof(float));
  memcpy(m, y->value.data, (size_t)n * sizeof(float));
  return m;
}

/* Dropout keeps a fraction 1 - p (within 4 sigma) scaled by 1/(1 - p); the mask is a pure
 * function of (seed, rank, step, call index) (determinism contract D4); eval is identity. */
static void test_dropout_mask(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  const int64_t n = 100000;
  float *a = dropout_mask(c, 0, 1, 0, n), *b = dropout_mask(c, 0, 1, 0, n);
  float *r1 = dropout_mask(c, 1, 1, 0, n), *s2 = dropout_mask(c, 0, 2, 0, n);
  float *k2 = dropout_mask(c, 0, 1, 1, n);
  int64_t kept = 0;
  const float scale = (float)(1.0 / 0.7);
  for (int64_t k = 0; k < n; k++) {
    if (!(a[k] == 0 || a[k] == scale))
      fail_msg("mask[%lld] = %.9g: neither 0 nor the scale %.9g", (long long)k, (double)a[k],
               (double)scale);
    kept += a[k] != 0;
  }
  double frac = (double)kept / (double)n, sd = sqrt(0.7 * 0.3 / (double)n);
  assert_true(fabs(frac - 0.7) < 4 * sd);
  assert_memory_equal(a, b, (size_t)n * sizeof(float));
  assert_memory_not_equal(a, r1, (size_t)n * sizeof(float));
  assert_memory_not_equal(a, s2, (size_t)n * sizeof(float));
  assert_memory_not_equal(a, k2, (size_t)n * sizeof(float));
  ddp_var_t *x, *y;
  int64_t four = 4;
  assert_int_equal(ddp_var_new(c, DDP_F32, 1, &four, NULL, false, &x), DDP_OK);
  assert_int_equal(ddp_dropout(c, x, 0.3, false, &y), DDP_OK);
  assert_ptr_equal(x, y);
  assert_int_equal(ddp_dropout(c, x, 1.5, true, &y), DDP_ERR_INVALID_ARGUMENT);
  free(a);
  free(b);
  free(r1);
  free(s2);
  free(k2);
  ddp_ctx_destroy(c);
}

/* Model-file fields of the wrong JSON type or out of range are refused with the JSON path
 * and the field, instead of being silently replaced by a default. */
static void test_model_json_fields(void **state) {
  (void)state;
  static const struct {
    const char *layer;
    const char *needle;
  } cases[] = {
      {"{\"type\": \"linear\", \"in\": 2, \"out\": 2, \"bias\": \"yes\"}",
       "layers[1]: field \"bias\" must be true or false, got \"yes\""},
      {"{\"type\": \"linear\", \"in\": 2, \"out\": 2, \"bias\": 0}",
       "layers[1]: field \"bias\" must be true or false, got 0"},
      {"{\"type\": \"linear\", \"in\": 2, \"out\": 2, \"frozen\": \"true\"}",
       "layers[1]: field \"frozen\" must be true or false"},
      {"{\"type\": \"layernorm\", \"dim\": 2, \"eps\": -1}",
       "layers[1]: field \"eps\" must be a number > 0, got -1"},
      {"{\"type\": \"layernorm\", \"dim\": 2, \"eps\": 0}", "field \"eps\" must be a number > 0"},
      {"{\"type\": \"batchnorm\", \"dim\": 2, \"eps\": \"1e-5\"}",
       "layers[1]: field \"eps\" must be a number > 0, got \"1e-5\""},
      {"{\"type\": \"batchnorm\", \"dim\": 2, \"momentum\": 5}",
       "layers[1]: field \"momentum\" must be a number in [0, 1], got 5"},
      {"{\"type\": \"batchnorm\", \"dim\": 2, \"momentum\": -0.1}",
       "field \"momentum\" must be a number in [0, 1]"},
      {"{\"type\": \"dropout\", \"p\": 1.5}", "layers[1]: field \"p\" must be a number in [0, 1]"},
      {"{\"type\": \"dropout\", \"p\": null}", "field \"p\" must be a number in [0, 1], got null"},
      {"{\"type\": \"branch\", \"flag\": \"1\", \"layers\": []}",
       "layers[1]: field \"flag\" must be 0..63 (an integer), got \"1\""},
      {"{\"type\": \"branch\", \"flag\": 1.5, \"layers\": []}",
       "field \"flag\" must be 0..63 (an integer), got 1.5"},
      {"{\"type\": \"residual\", \"layers\": [{\"type\": \"batchnorm\", \"dim\": 2, \"eps\": -2}]}",
       "layers[1].layers[0]: field \"eps\" must be a number > 0"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char json[512];
    snprintf(json, sizeof json, "{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 2}, %s]}",
             cases[i].layer);
    ddp_model_t *m = NULL;
    ddp_error_t err = {0};
    ddp_status_t st = ddp_model_from_json(json, &m, &err);
    if (st != DDP_ERR_INVALID_DATA || m || !strstr(err.msg, cases[i].needle))
      fail_msg("case %zu: status %s, message '%s', expected '%s'", i, ddp_status_name(st), err.msg,
               cases[i].needle);
  }
  /* The same fields with valid values still build, and bias false drops the bias. */
  ddp_model_t *m = NULL;
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": "
                                       "2, \"bias\": false}, {\"type\": \"batchnorm\", \"dim\": 2, "
                                       "\"eps\": 1e-3, \"momentum\": 1}, {\"type\": \"dropout\", "
                                       "\"p\": 0}]}",
                                       &m, NULL),
                   DDP_OK);
  assert_int_equal(ddp_model_num_params(m), 3); /* weight, bn weight, bn bias */
  ddp_model_destroy(m);
  /* A model too large to allocate says so, with its size. */
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"linear\", \"in\": 100000, "
                                       "\"out\": 100000000000}]}",
                                       &m, &err),
                   DDP_ERR_NO_MEMORY);
  assert_null(m);
  if (!strstr(err.msg, "cannot allocate the parameters and their gradients: out of memory asking "
                       "for 80000800000000000 bytes (8e+07 GB) in one block, for 2 tensors"))
    fail_msg("huge model: message '%s'", err.msg);
}

/* Shape errors are statuses with a message naming both shapes, never aborts. */
static void test_shape_errors(void **state) {
  (void)state;
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {3, 5}, ws[2] = {4, 6};
  ddp_var_t *x, *w, *y;
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, xs, NULL, true, &x), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, ws, NULL, true, &w), DDP_OK);
  assert_int_equal(ddp_linear(c, x, w, NULL, &y), DDP_ERR_INVALID_ARGUMENT);
  assert_true(ctx_error_has(c, "F32[3, 5]"));
  assert_true(ctx_error_has(c, "F32[4, 6]"));
  assert_int_equal(ddp_add(c, x, w, &y), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_matmul(c, x, w, &y), DDP_ERR_INVALID_ARGUMENT);
  int64_t bad[2] = {4, 4};
  assert_int_equal(ddp_reshape(c, x, 2, bad, &y), DDP_ERR_INVALID_ARGUMENT);
  ddp_var_t *xs2[2] = {x, w};
  assert_int_equal(ddp_concat(c, 2, xs2, 0, &y), DDP_ERR_INVALID_ARGUMENT);
  ddp_var_t *ids;
  int64_t one = 1, id = 9;
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &one, &id, false, &ids), DDP_OK);
  assert_int_equal(ddp_embedding(c, ids, w, &y), DDP_ERR_INVALID_ARGUMENT);
  assert_true(ctx_error_has(c, "index out of range"));
  ddp_ctx_destroy(c);
}

static const char *gc_model_json =
    "{\"dtype\": \"f64\", \"layers\": [{\"type\": \"embedding\", \"num\": 6, \"dim\": 3}, "
    "{\"type\": \"flatten\"},"
    "{\"type\": \"linear\", \"in\": 6, \"out\": 5}, {\"type\": \"layernorm\", \"dim\": 5},"
    "{\"type\": \"gelu\"},"
    "{\"type\": \"residual\", \"layers\": [{\"type\": \"linear\", \"in\": 5, \"out\": 5},"
    "  {\"type\": \"batchnorm\", \"dim\": 5}, {\"type\": \"sigmoid\"}, {\"type\": \"dropout\", "
    "\"p\": 0.2}]},"
    "{\"type\": \"branch\", \"flag\": 0, \"layers\": [{\"type\": \"linear\", \"in\": 5, \"out\": "
    "5}, {\"type\": \"tanh\"}]},"
    "{\"type\": \"checkpoint\", \"layers\": [{\"type\": \"linear\", \"in\": 5, \"out\": 5}, "
    "{\"type\": \"gelu\", \"approximate\": \"tanh\"}]},"
    "{\"type\": \"linear\", \"in\": 5, \"out\": 3}]}";

static double model_loss(ddp_model_t *m, ddp_ctx_t *c, bool backward) {
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 9, 0, 0);
  int64_t is[2] = {4, 2}, ids[8] = {0, 5, 2, 2, 3, 1, 4, 0}, n = 4, tt[4] = {0, 2, 1, 2};
  ddp_var_t *x, *t, *y, *loss;
  assert_int_equal(ddp_var_new(c, DDP_I64, 2, is, ids, false, &x), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_I64, 1, &n, tt, false, &t), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, x, 1, &y), DDP_OK);
  assert_int_equal(ddp_cross_entropy(c, y, t, -100, &loss), DDP_OK);
  if (backward) assert_int_equal(ddp_backward(c, loss), DDP_OK);
  return ((double *)loss->value.data)[0];
}

/* Every parameter gradient of a model using every module kind (embedding, layer and batch
 * norm, residual, dropout, a taken branch, a checkpointed segment) matches central
 * differences: the module glue and parameter accumulation, not just the ops. */
static void test_model_gradcheck(void **state) {
  (void)state;
  ddp_model_t *m;
  assert_int_equal(ddp_model_from_json(gc_model_json, &m, NULL), DDP_OK);
  assert_int_equal(ddp_model_init(m, 4), DDP_OK);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  ddp_model_zero_grad(m);
  model_loss(m, c, true);
  ddp_tensor_t g = ddp_model_flat_grads(m, DDP_F64), w = ddp_model_flat_params(m, DDP_F64);
  double *ga = malloc(ddp_tensor_nbytes(&g));
  memcpy(ga, g.data, ddp_tensor_nbytes(&g));
  double gmax = 0;
  for (int64_t k = 0; k < g.numel; k++) gmax = fmax(gmax, fabs(ga[k]));
  assert_true(gmax > 0);
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    double md = 0;
    for (int64_t k = 0; k < p->value.numel; k++) {
      double *wk = (double *)w.data + p->offset + k, w0 = *wk, h = 1e-6;
      *wk = w0 + h;
      double lp = model_loss(m, c, false);
      *wk = w0 - h;
      double lm = model_loss(m, c, false);
      *wk = w0;
      md = fmax(md, fabs((lp - lm) / (2 * h) - ga[p->offset + k]));
    }
    if (!(md / gmax < 1e-6)) fail_msg("%s: max diff %.3g (max grad %.3g)", p->name, md, gmax);
  }
  free(ga);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* One training step of the checkpoint model, from any thread: returns the flat gradients. */
static int rank_step(ddp_test_rank_t *tr, void *arg) {
  (void)arg;
  ddp_model_t *m;
  ddp_ctx_t *c;
  ddp_status_t st = ddp_model_from_json(ckpt_json(true), &m, NULL);
  if (st != DDP_OK) return st;
  if ((st = ddp_ctx_create(&c)) != DDP_OK) return st;
  ddp_model_init(m, 11);
  for (int step = 0; step < 50 && st == DDP_OK; step++) {
    ddp_ctx_reset(c);
    ddp_ctx_set_rng(c, 1, 0, (uint64_t)step);
    int64_t xs[2] = {5, 4}, n = 5;
    ddp_var_t *x, *t, *y, *loss;
    st = ddp_var_new(c, DDP_F64, 2, xs, NULL, false, &x);
    if (st == DDP_OK) st = ddp_var_new(c, DDP_I64, 1, &n, NULL, false, &t);
    if (st != DDP_OK) break;
    for (int k = 0; k < 20; k++) ((double *)x->value.data)[k] = sin(k + step);
    for (int k = 0; k < 5; k++) ((int64_t *)t->value.data)[k] = (k + step) % 3;
    if (st == DDP_OK) st = ddp_model_forward(m, c, x, 0, &y);
    if (st == DDP_OK) st = ddp_cross_entropy(c, y, t, -100, &loss);
    if (st == DDP_OK) st = ddp_backward(c, loss);
  }
  ddp_tensor_t g = ddp_model_flat_grads(m, DDP_F64);
  if (st == DDP_OK && !ddp_test_put(tr, g.data, ddp_tensor_nbytes(&g))) st = DDP_ERR_INTERNAL;
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
  return st;
}

/* Contexts and models hold all state (no globals): four threads stepping their own copies
 * concurrently produce bitwise the gradients of a run on the test's own thread (D1). */
static void test_threads_independent(void **state) {
  (void)state;
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.world = 1;
  ddp_test_results_t *ref = ddp_test_spawn(&o, rank_step, NULL);
  ddp_test_expect_ok(ref);
  o.world = 4;
  ddp_test_results_t *res = ddp_test_spawn(&o, rank_step, NULL);
  ddp_test_expect_ok(res);
  const ddp_test_result_t *r0 = ddp_test_result(ref, 0);
  assert_true(r0->nvalues > 0);
  for (int r = 0; r < 4; r++) {
    const ddp_test_result_t *rr = ddp_test_result(res, r);
    assert_int_equal(rr->nvalues, r0->nvalues);
    assert_memory_equal(rr->values, r0->values, r0->nvalues);
  }
  ddp_test_results_free(ref);
  ddp_test_results_free(res);
}

/* ddp_param_release_grad: the gradient becomes None and the whole pages inside the
 * parameter's slice of the flat gradient buffer are no longer resident (mincore), while
 * the neighbouring parameter's gradient keeps its values; the next backward defines the
 * gradient again with the same values as before the release. */
static void test_param_release_grad(void **state) {
  (void)state;
  ddp_model_t *m = NULL;
  ddp_module_t *lin = NULL;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  assert_int_equal(ddp_module_linear(m, "", 512, 256, true, DDP_F32, &lin), DDP_OK);
  ddp_model_set_root(m, lin);
  assert_int_equal(ddp_model_finalize(m), DDP_OK);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  ddp_ctx_t *ctx = NULL;
  assert_int_equal(ddp_ctx_create(&ctx), DDP_OK);
  float x[2 * 512];
  for (int k = 0; k < 2 * 512; k++) x[k] = (float)sin(0.01 * k);
  float *before = NULL;
  for (int pass = 0; pass < 2; pass++) {
    ddp_var_t *vx, *y, *loss;
    assert_int_equal(ddp_var_new(ctx, DDP_F32, 2, (int64_t[]){2, 512}, x, false, &vx), DDP_OK);
    assert_int_equal(ddp_module_forward(lin, ctx, vx, 0, &y), DDP_OK);
    ddp_var_t *sq;
    assert_int_equal(ddp_mul(ctx, y, y, &sq), DDP_OK);
    assert_int_equal(ddp_sum(ctx, sq, &loss), DDP_OK);
    assert_int_equal(ddp_backward(ctx, loss), DDP_OK);
    ddp_ctx_reset(ctx);
    ddp_param_t *w = ddp_model_param(m, 0), *b = ddp_model_param(m, 1);
    size_t nb = ddp_tensor_nbytes(&w->value);
    if (pass == 1) { /* defined again, the same values as before the release */
      assert_non_null(w->grad.data);
      assert_memory_equal(w->grad.data, before, nb);
      break;
    }
    before = malloc(nb);
    assert_non_null(before);
    memcpy(before, w->grad.data, nb);
    float bias0 = *(float *)b->grad.data;
    long ps = sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)w->grad.data + (uintptr_t)ps - 1) & ~(uintptr_t)(ps - 1);
    uintptr_t hi = ((uintptr_t)w->grad.data + nb) & ~(uintptr_t)(ps - 1);
    size_t npages = (hi - lo) / (size_t)ps;
    assert_true(npages > 100);
    unsigned char *vec = calloc(npages, 1);
    assert_non_null(vec);
    assert_int_equal(mincore((void *)lo, hi - lo, vec), 0);
    assert_int_equal(vec[0] & 1, 1); /* resident while the gradient is defined */
    ddp_param_release_grad(w);
    assert_null(w->grad.data);
    assert_int_equal(mincore((void *)lo, hi - lo, vec), 0);
    size_t resident = 0;
    for (size_t k = 0; k < npages; k++) resident += vec[k] & 1;
    print_message("released %zu pages, %zu still resident\n", npages, resident);
    assert_int_equal(resident, 0);
    assert_true(*(float *)b->grad.data == bias0); /* the neighbour keeps its gradient */
    free(vec);
    ddp_model_set_grads_none(m); /* the next backward starts from None everywhere */
  }
  free(before);
  ddp_ctx_destroy(ctx);
  ddp_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gradcheck),
      cmocka_unit_test(test_hooks_mlp),
      cmocka_unit_test(test_backward_callback),
      cmocka_unit_test(test_hooks_tied_and_reused),
      cmocka_unit_test(test_hooks_frozen_unused),
      cmocka_unit_test(test_hooks_checkpoint),
      cmocka_unit_test(test_hooks_checkpoint_fires_again),
      cmocka_unit_test(test_zero_alloc_after_first_step),
      cmocka_unit_test(test_init),
      cmocka_unit_test(test_batch_norm_running_stats),
      cmocka_unit_test(test_cross_entropy_value),
      cmocka_unit_test(test_model_json_state_dict),
      cmocka_unit_test(test_grad_redirect),
      cmocka_unit_test(test_no_grad),
      cmocka_unit_test(test_dropout_mask),
      cmocka_unit_test(test_shape_errors),
      cmocka_unit_test(test_model_json_fields),
      cmocka_unit_test(test_threads_independent),
      cmocka_unit_test(test_model_gradcheck),
      cmocka_unit_test(test_param_release_grad),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
