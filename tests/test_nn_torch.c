/* The nn layer against PyTorch 1.13 (tools/torch/nn_oracle.py under /usr/bin/python3): every
 * op's forward and backward on the same inputs in f64 and f32, and a whole model file's
 * forward, loss, gradients, buffers and gradient-hook order. Also prints (does not assert)
 * the time of one forward+backward step of a 784-1024-1024-10 MLP at batch 64, libddp vs
 * torch, one thread each. Skips when torch is absent. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/nn.h"
#include "harness.h"
#include "opcheck.h"

static char g_dir[256];
static char g_oracle[512];

static void write_text(const char *dir, const char *name, const char *text) {
  ddp_test_write_bin(dir, name, text, strlen(text));
}

static int run_oracle(const char *cmd, const char *dir) {
  char line[2048];
  snprintf(line, sizeof line, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s %s %s",
           ddp_test_python(), g_oracle, cmd, dir);
  return system(line);
}

static int setup(void **state) {
  (void)state;
  const char *py = ddp_test_python(), *root = ddp_test_source_root();
  if (!py || !root) return 0;
  char line[512];
  snprintf(line, sizeof line, "%s -c 'import torch, numpy' >/dev/null 2>&1", py);
  if (system(line) != 0) return 0;
  snprintf(g_oracle, sizeof g_oracle, "%s/tools/torch/nn_oracle.py", root);
  snprintf(g_dir, sizeof g_dir, "/tmp/ddp_nn_torch_XXXXXX");
  if (!mkdtemp(g_dir)) g_dir[0] = 0;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_dir[0]) {
    char line[512];
    snprintf(line, sizeof line, "rm -rf '%s'", g_dir);
    if (system(line) != 0) return 1;
  }
  return 0;
}

#define NEED_TORCH()                                                     \
  do {                                                                   \
    if (!g_dir[0]) {                                                     \
      print_message("torch (under /usr/bin/python3) absent: skipped\n"); \
      skip();                                                            \
    }                                                                    \
  } while (0)

/* ---------------------------------------------------------------- ops ------------- */

#define TF(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, true }
#define TFC(n, ...) \
  { n, {__VA_ARGS__}, DDP_TEST_IN_FLOAT, 0, false }

static const ddp_test_tcase_t tcases[] = {
    {"linear", "linear", "{}", 3, {TF(3, 2, 3, 5), TF(2, 4, 5), TF(1, 4)}},
    {"linear_nobias", "linear", "{}", 2, {TF(2, 3, 5), TF(2, 4, 5)}},
    {"matmul", "matmul", "{}", 2, {TF(2, 4, 5), TF(2, 5, 3)}},
    {"add", "add", "{}", 2, {TF(2, 3, 4), TF(2, 3, 4)}},
    {"mul", "mul", "{}", 2, {TF(2, 3, 4), TF(2, 3, 4)}},
    {"bias_add", "bias_add", "{}", 2, {TF(3, 2, 3, 4), TF(1, 4)}},
    {"relu", "relu", "{}", 1, {TF(2, 4, 5)}},
    {"gelu", "gelu", "{\"approximate\": \"none\"}", 1, {TF(2, 4, 5)}},
    {"gelu_tanh", "gelu", "{\"approximate\": \"tanh\"}", 1, {TF(2, 4, 5)}},
    {"tanh", "tanh", "{}", 1, {TF(2, 4, 5)}},
    {"sigmoid", "sigmoid", "{}", 1, {TF(2, 4, 5)}},
    {"softmax", "softmax", "{}", 1, {TF(2, 3, 6)}},
    {"log_softmax", "log_softmax", "{}", 1, {TF(2, 3, 6)}},
    {"dropout",
     "dropout",
     "{\"p\": 0.3}",
     2,
     {TF(2, 6, 7), {2, {6, 7}, DDP_TEST_IN_MASK, 0, false}}},
    {"layer_norm", "layer_norm", "{\"eps\": 1e-5}", 3, {TF(2, 4, 6), TF(1, 6), TF(1, 6)}},
    {"batch_norm_train",
     "batch_norm",
     "{\"training\": true, \"momentum\": 0.1, \"eps\": 1e-5}",
     3,
     {TF(2, 5, 4), TF(1, 4), TF(1, 4)}},
    {"batch_norm_eval",
     "batch_norm",
     "{\"training\": false, \"momentum\": 0.1, \"eps\": 1e-5}",
     3,
     {TF(2, 5, 4), TF(1, 4), TF(1, 4)}},
    {"embedding", "embedding", "{}", 2, {{2, {2, 3}, DDP_TEST_IN_IDS, 7, false}, TF(2, 7, 4)}},
    {"reshape", "reshape", "{\"shape\": [2, -1, 3]}", 1, {TF(2, 3, 4)}},
    {"concat", "concat", "{\"dim\": 1}", 3, {TF(3, 2, 1, 3), TF(3, 2, 2, 3), TF(3, 2, 3, 3)}},
    {"sum", "sum", "{}", 1, {TF(2, 3, 4)}},
    {"mean", "mean", "{}", 1, {TF(2, 3, 4)}},
    {"mse_loss", "mse_loss", "{}", 2, {TF(2, 3, 4), TF(2, 3, 4)}},
    {"cross_entropy",
     "cross_entropy",
     "{\"ignore_index\": -100}",
     2,
     {TF(2, 6, 5), {1, {6}, DDP_TEST_IN_TARGETS, 5, false}}},
};

static const double rm0[4] = {0.1, -0.2, 0.3, 0.05}, rv0[4] = {1.5, 0.7, 2.0, 0.9};

/* The batch-norm cases' running statistics, as the last run left them. */
typedef struct bn_state {
  double rm[4], rv[4];
} bn_state_t;

static void get_attr_num(const char *attrs, const char *key, double *v) {
  cJSON *j = cJSON_Parse(attrs);
  cJSON *x = cJSON_GetObjectItem(j, key);
  if (cJSON_IsNumber(x)) *v = x->valuedouble;
  if (cJSON_IsBool(x)) *v = cJSON_IsTrue(x);
  cJSON_Delete(j);
}

static ddp_status_t run_op(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_var_t **in,
                           ddp_var_t **y) {
  bn_state_t *bn = user;
  const char *op = tc->op;
  double p = 0, eps = 1e-5, mom = 0.1, train = 0, dim = 0;
  if (!strcmp(op, "linear")) return ddp_linear(c, in[0], in[1], tc->nin > 2 ? in[2] : NULL, y);
  if (!strcmp(op, "matmul")) return ddp_matmul(c, in[0], in[1], y);
  if (!strcmp(op, "add")) return ddp_add(c, in[0], in[1], y);
  if (!strcmp(op, "mul")) return ddp_mul(c, in[0], in[1], y);
  if (!strcmp(op, "bias_add")) return ddp_bias_add(c, in[0], in[1], y);
  if (!strcmp(op, "relu")) return ddp_activation(c, DDP_ACT_RELU, in[0], y);
  if (!strcmp(op, "gelu"))
    return ddp_activation(c, strstr(tc->attrs, "tanh") ? DDP_ACT_GELU_TANH : DDP_ACT_GELU, in[0],
                          y);
  if (!strcmp(op, "tanh")) return ddp_activation(c, DDP_ACT_TANH, in[0], y);
  if (!strcmp(op, "sigmoid")) return ddp_activation(c, DDP_ACT_SIGMOID, in[0], y);
  if (!strcmp(op, "softmax")) return ddp_softmax(c, in[0], y);
  if (!strcmp(op, "log_softmax")) return ddp_log_softmax(c, in[0], y);
  if (!strcmp(op, "dropout")) {
    get_attr_num(tc->attrs, "p", &p);
    return ddp_dropout(c, in[0], p, true, y);
  }
  if (!strcmp(op, "layer_norm")) return ddp_layer_norm(c, in[0], in[1], in[2], 1e-5, y);
  if (!strcmp(op, "batch_norm")) {
    get_attr_num(tc->attrs, "training", &train);
    get_attr_num(tc->attrs, "momentum", &mom);
    get_attr_num(tc->attrs, "eps", &eps);
    ddp_tensor_t rm, rv;
    int64_t n = 4;
    memcpy(bn->rm, rm0, sizeof rm0);
    memcpy(bn->rv, rv0, sizeof rv0);
    ddp_tensor_view(&rm, DDP_F64, 1, &n, bn->rm);
    ddp_tensor_view(&rv, DDP_F64, 1, &n, bn->rv);
    return ddp_batch_norm(c, in[0], in[1], in[2], &rm, &rv, NULL, train != 0, mom, eps, y);
  }
  if (!strcmp(op, "embedding")) return ddp_embedding(c, in[0], in[1], y);
  if (!strcmp(op, "reshape")) {
    int64_t sh[3] = {2, -1, 3};
    return ddp_reshape(c, in[0], 3, sh, y);
  }
  if (!strcmp(op, "concat")) {
    get_attr_num(tc->attrs, "dim", &dim);
    return ddp_concat(c, (size_t)tc->nin, in, (int)dim, y);
  }
  if (!strcmp(op, "sum")) return ddp_sum(c, in[0], y);
  if (!strcmp(op, "mean")) return ddp_mean(c, in[0], y);
  if (!strcmp(op, "mse_loss")) return ddp_mse_loss(c, in[0], in[1], y);
  if (!strcmp(op, "cross_entropy")) return ddp_cross_entropy(c, in[0], in[1], -100, y);
  fail_msg("unknown op %s", op);
  return DDP_ERR_INTERNAL;
}

static double val(const void *p, ddp_dtype_t dt, int64_t k) {
  return dt == DDP_F32 ? ((const float *)p)[k] : ((const double *)p)[k];
}

/* max|a - b| / max(max|b|, floor) over n elements of a (libddp) vs b (torch, same dtype). */
static double rel_err_floor(const void *a, const void *b, ddp_dtype_t dt, int64_t n, double floor) {
  double md = 0, mr = 0;
  for (int64_t k = 0; k < n; k++) {
    md = fmax(md, fabs(val(a, dt, k) - val(b, dt, k)));
    mr = fmax(mr, fabs(val(b, dt, k)));
  }
  return md / fmax(mr, floor);
}

static double rel_err(const void *a, const void *b, ddp_dtype_t dt, int64_t n) {
  return rel_err_floor(a, b, dt, n, 1e-3);
}

/* Dropout: torch multiplies by libddp's mask, read off libddp's output. Batch norm: the
 * running statistics go in as files. */
static void prepare_op(void *user, ddp_ctx_t *c, const ddp_test_tcase_t *tc, ddp_dtype_t dt,
                       double **data, const int64_t *numel, const ddp_var_t *y, const char *dir) {
  (void)user;
  (void)c;
  size_t es = ddp_dtype_size(dt);
  if (!strcmp(tc->op, "dropout")) {
    double p = 0.3;
    for (int64_t k = 0; k < numel[0]; k++)
      data[1][k] = val(y->value.data, dt, k) == 0 && data[0][k] != 0 ? 0 : 1.0 / (1.0 - p);
  }
  if (!strcmp(tc->op, "batch_norm")) {
    float f[4];
    double d[4];
    for (int k = 0; k < 4; k++) {
      f[k] = (float)rm0[k];
      d[k] = rm0[k];
    }
    ddp_test_write_bin(dir, "rm.bin", dt == DDP_F32 ? (void *)f : (void *)d, 4 * es);
    for (int k = 0; k < 4; k++) {
      f[k] = (float)rv0[k];
      d[k] = rv0[k];
    }
    ddp_test_write_bin(dir, "rv.bin", dt == DDP_F32 ? (void *)f : (void *)d, 4 * es);
  }
}

/* Batch norm's running statistics after the step equal torch's. */
static void check_op(void *user, const ddp_test_tcase_t *tc, ddp_dtype_t dt, const char *dir) {
  bn_state_t *bn = user;
  if (strcmp(tc->op, "batch_norm") != 0) return;
  size_t es = ddp_dtype_size(dt);
  void *r1 = malloc(4 * es), *r2 = malloc(4 * es);
  ddp_test_read_bin(dir, "rm_out.bin", r1, 4 * es);
  ddp_test_read_bin(dir, "rv_out.bin", r2, 4 * es);
  for (int k = 0; k < 4; k++) {
    /* running stats are kept in f64 here; torch's in the case dtype */
    double tolr = dt == DDP_F32 ? 1e-6 : 1e-14;
    if (!(fabs(bn->rm[k] - val(r1, dt, k)) <= tolr * (1 + fabs(bn->rm[k]))))
      fail_msg("%s running_mean[%d]: libddp %.17g, torch %.17g", tc->name, k, bn->rm[k],
               val(r1, dt, k));
    if (!(fabs(bn->rv[k] - val(r2, dt, k)) <= tolr * (1 + fabs(bn->rv[k]))))
      fail_msg("%s running_var[%d]: libddp %.17g, torch %.17g", tc->name, k, bn->rv[k],
               val(r2, dt, k));
  }
  free(r1);
  free(r2);
}

static void ops_vs_torch(ddp_dtype_t dt, double tol) {
  NEED_TORCH();
  bn_state_t bn;
  static const char *const exact[] = {"batch_norm", NULL};
  ddp_test_torch_ops_t o = {.cases = tcases,
                            .n = sizeof tcases / sizeof tcases[0],
                            .run = run_op,
                            .prepare = prepare_op,
                            .check = check_op,
                            .user = &bn,
                            .f32_exact_ops = exact};
  ddp_test_ops_vs_torch(&o, g_dir, dt, tol, NULL);
}

/* Every op's forward and input gradients equal torch's in f64 (rel 1e-10). */
static void test_ops_f64(void **state) {
  (void)state;
  ops_vs_torch(DDP_F64, 1e-10);
}

/* The same in f32 (rel 2e-5: different summation orders and libm). */
static void test_ops_f32(void **state) {
  (void)state;
  ops_vs_torch(DDP_F32, 2e-5);
}

/* ---------------------------------------------------------------- models ---------- */

/* Builds model_json in libddp, saves its weights for torch, runs one step on both sides
 * and compares output, loss, every gradient, the buffers after the step and the order in
 * which gradient hooks fired. x is [B, xdim] floats or [B, T] ids (ids_hi > 0). */
static void model_vs_torch(const char *tag, const char *model_json, int64_t B, int64_t xdim,
                           int64_t ids_hi, bool ce, uint64_t flags, double tol) {
  NEED_TORCH();
  char dir[400];
  snprintf(dir, sizeof dir, "%s/model_%s", g_dir, tag);
  assert_int_equal(mkdir(dir, 0700), 0);
  ddp_model_t *m;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(model_json, &m, &err), DDP_OK);
  assert_int_equal(ddp_model_init(m, 17), DDP_OK);
  char path[512];
  snprintf(path, sizeof path, "%s/weights.safetensors", dir);
  assert_int_equal(ddp_model_save(m, path, &err), DDP_OK);
  write_text(dir, "model.json", model_json);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  ddp_rng_t g;
  ddp_rng_init(&g, 31, 2);
  int64_t xs[2] = {B, xdim};
  ddp_var_t *x;
  if (ids_hi) {
    assert_int_equal(ddp_var_new(c, DDP_I64, 2, xs, NULL, false, &x), DDP_OK);
    for (int64_t k = 0; k < B * xdim; k++)
      ((int64_t *)x->value.data)[k] = ddp_rng_u32(&g) % (uint32_t)ids_hi;
  } else {
    assert_int_equal(ddp_var_new(c, DDP_F32, 2, xs, NULL, false, &x), DDP_OK);
    for (int64_t k = 0; k < B * xdim; k++)
      ((float *)x->value.data)[k] = ddp_rng_uniform(&g) * 2 - 1;
  }
  ddp_test_write_bin(dir, "x.bin", x->value.data, ddp_tensor_nbytes(&x->value));
  ddp_var_t *y, *loss, *t;
  assert_int_equal(ddp_model_forward(m, c, x, flags, &y), DDP_OK);
  int64_t ncls = y->value.shape[1];
  if (ce) {
    assert_int_equal(ddp_var_new(c, DDP_I64, 1, &B, NULL, false, &t), DDP_OK);
    for (int64_t i = 0; i < B; i++)
      ((int64_t *)t->value.data)[i] = ddp_rng_u32(&g) % (uint32_t)ncls;
    assert_int_equal(ddp_cross_entropy(c, y, t, -100, &loss), DDP_OK);
  } else {
    assert_int_equal(ddp_var_new(c, DDP_F32, y->value.ndim, y->value.shape, NULL, false, &t),
                     DDP_OK);
    for (int64_t k = 0; k < t->value.numel; k++) ((float *)t->value.data)[k] = ddp_rng_uniform(&g);
    assert_int_equal(ddp_mse_loss(c, y, t, &loss), DDP_OK);
  }
  ddp_test_write_bin(dir, "t.bin", t->value.data, ddp_tensor_nbytes(&t->value));
  char run[512];
  snprintf(run, sizeof run,
           "{\"x_dtype\": \"%s\", \"x_shape\": [%lld, %lld], \"loss\": \"%s\", \"flags\": %llu, "
           "\"train\": true}",
           ids_hi ? "i64" : "f32", (long long)B, (long long)xdim, ce ? "ce" : "mse",
           (unsigned long long)flags);
  write_text(dir, "run.json", run);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(run_oracle("model", dir), 0);

  float *ref = malloc((size_t)y->value.numel * 4);
  ddp_test_read_bin(dir, "y.bin", ref, (size_t)y->value.numel * 4);
  double e = rel_err(y->value.data, ref, DDP_F32, y->value.numel);
  if (!(e < tol)) fail_msg("%s: output rel err %.3g", tag, e);
  float lref;
  ddp_test_read_bin(dir, "loss.bin", &lref, 4);
  assert_true(fabs(((float *)loss->value.data)[0] - lref) <= tol * fabs(lref));
  free(ref);
  ddp_tensor_t gf = ddp_model_flat_grads(m, DDP_F32);
  ref = malloc(ddp_tensor_nbytes(&gf));
  ddp_test_read_bin(dir, "grads.bin", ref, ddp_tensor_nbytes(&gf));
  /* Each parameter's error is relative to the largest gradient of the model: a gradient
   * that is zero in exact arithmetic (a bias followed by BatchNorm) is rounding noise on
   * both sides. */
  double worst = 0, gmax = 0;
  for (int64_t k = 0; k < gf.numel; k++) gmax = fmax(gmax, fabs(ref[k]));
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    e = rel_err_floor(p->grad.data, ref + p->offset, DDP_F32, p->value.numel, gmax);
    if (!(e < tol)) fail_msg("%s: grad of %s rel err %.3g", tag, p->name, e);
    worst = fmax(worst, e);
    if (getenv("NN_VERBOSE")) print_message("  %s %.3g\n", p->name, e);
  }
  print_message("%s: worst gradient rel err vs torch %.3g; gradients bitwise equal: %s\n", tag,
                worst, memcmp(gf.data, ref, ddp_tensor_nbytes(&gf)) ? "no" : "yes");
  free(ref);
  size_t nb = 0;
  for (size_t i = 0; i < ddp_model_num_buffers(m); i++)
    nb += (size_t)ddp_model_buffer(m, i)->value.numel;
  if (nb) {
    double *bref = malloc(nb * 8);
    ddp_test_read_bin(dir, "buffers.bin", bref, nb * 8);
    size_t off = 0;
    for (size_t i = 0; i < ddp_model_num_buffers(m); i++) {
      ddp_buffer_t *b = ddp_model_buffer(m, i);
      for (int64_t k = 0; k < b->value.numel; k++, off++) {
        double v = b->value.dtype == DDP_I64 ? (double)((int64_t *)b->value.data)[k]
                                             : val(b->value.data, b->value.dtype, k);
        if (!(fabs(v - bref[off]) <= tol * (1 + fabs(bref[off]))))
          fail_msg("%s: buffer %s[%lld] = %.9g, torch %.9g", tag, b->name, (long long)k, v,
                   bref[off]);
      }
    }
    free(bref);
  }
  /* PyTorch's state_dict after the step loads by name (strict) into a fresh libddp model:
   * the same parameters bit for bit, the same buffers to tolerance. */
  ddp_model_t *m2;
  assert_int_equal(ddp_model_from_json(model_json, &m2, &err), DDP_OK);
  snprintf(path, sizeof path, "%s/state_after.safetensors", dir);
  size_t nmiss = 1, nunexp = 1;
  if (ddp_model_load(m2, path, true, &nmiss, &nunexp, &err) != DDP_OK)
    fail_msg("%s: %s", tag, err.msg);
  assert_int_equal(nmiss + nunexp, 0);
  ddp_tensor_t f1 = ddp_model_flat_params(m, DDP_F32), f2 = ddp_model_flat_params(m2, DDP_F32);
  assert_memory_equal(f1.data, f2.data, ddp_tensor_nbytes(&f1));
  for (size_t i = 0; i < ddp_model_num_buffers(m); i++) {
    ddp_tensor_t *a = &ddp_model_buffer(m, i)->value, *b = &ddp_model_buffer(m2, i)->value;
    for (int64_t k = 0; k < a->numel; k++) {
      double va = a->dtype == DDP_I64 ? (double)((int64_t *)a->data)[k] : val(a->data, a->dtype, k);
      double vb = b->dtype == DDP_I64 ? (double)((int64_t *)b->data)[k] : val(b->data, b->dtype, k);
      assert_true(fabs(va - vb) <= tol * (1 + fabs(vb)));
    }
  }
  ddp_model_destroy(m2);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* Hook order: re-run the libddp step recording the order, compare with torch's. */
typedef struct order_rec {
  size_t idx[64];
  int n;
} order_rec_t;

static void on_ready(void *user, ddp_param_t *p, int fire) {
  order_rec_t *r = user;
  (void)fire;
  if (r->n < 64) r->idx[r->n++] = p->index;
}

static void order_vs_torch(const char *tag, const char *model_json, int64_t B, int64_t xdim,
                           int64_t ids_hi, bool ce, uint64_t flags) {
  char dir[400], path[512];
  snprintf(dir, sizeof dir, "%s/model_%s", g_dir, tag);
  snprintf(path, sizeof path, "%s/order.json", dir);
  ddp_model_t *m;
  assert_int_equal(ddp_model_from_json(model_json, &m, NULL), DDP_OK);
  order_rec_t r = {{0}, 0};
  ddp_model_set_hook(m, on_ready, &r);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t xs[2] = {B, xdim};
  ddp_var_t *x, *y, *loss, *t;
  assert_int_equal(ddp_var_new(c, ids_hi ? DDP_I64 : DDP_F32, 2, xs, NULL, false, &x), DDP_OK);
  assert_int_equal(ddp_model_init(m, 17), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, x, flags, &y), DDP_OK);
  if (ce) {
    assert_int_equal(ddp_var_new(c, DDP_I64, 1, &B, NULL, false, &t), DDP_OK);
    assert_int_equal(ddp_cross_entropy(c, y, t, -100, &loss), DDP_OK);
  } else {
    assert_int_equal(ddp_var_new(c, DDP_F32, y->value.ndim, y->value.shape, NULL, false, &t),
                     DDP_OK);
    assert_int_equal(ddp_mse_loss(c, y, t, &loss), DDP_OK);
  }
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  char buf[8192];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  cJSON *j = cJSON_Parse(buf);
  cJSON *o = cJSON_GetObjectItem(j, "order");
  assert_int_equal(cJSON_GetArraySize(o), r.n);
  char mine[512] = "", theirs[512] = "";
  for (int i = 0; i < r.n; i++) {
    snprintf(mine + strlen(mine), sizeof mine - strlen(mine), " %zu", r.idx[i]);
    snprintf(theirs + strlen(theirs), sizeof theirs - strlen(theirs), " %d",
             cJSON_GetArrayItem(o, i)->valueint);
  }
  cJSON_Delete(j);
  if (strcmp(mine, theirs))
    fail_msg("%s: hook order libddp [%s ] vs torch [%s ]", tag, mine, theirs);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

static const char *mlp_json =
    "{\"dtype\": \"f32\", \"layers\": ["
    "{\"type\": \"linear\", \"in\": 10, \"out\": 16}, {\"type\": \"batchnorm\", \"dim\": 16},"
    "{\"type\": \"relu\"}, {\"type\": \"dropout\", \"p\": 0.0},"
    "{\"type\": \"residual\", \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": 16},"
    "  {\"type\": \"layernorm\", \"dim\": 16}, {\"type\": \"gelu\"}]},"
    "{\"type\": \"branch\", \"flag\": 1, \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": "
    "16},"
    "  {\"type\": \"tanh\"}]},"
    "{\"type\": \"branch\", \"flag\": 3, \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": "
    "16}]},"
    "{\"type\": \"linear\", \"in\": 16, \"out\": 5}]}";

static const char *emb_json =
    "{\"dtype\": \"f32\", \"prefix\": \"model.layers\", \"layers\": ["
    "{\"type\": \"embedding\", \"num\": 20, \"dim\": 6}, {\"type\": \"flatten\"},"
    "{\"type\": \"linear\", \"in\": 24, \"out\": 12}, {\"type\": \"sigmoid\"},"
    "{\"type\": \"checkpoint\", \"layers\": [{\"type\": \"linear\", \"in\": 12, \"out\": 12},"
    "  {\"type\": \"gelu\", \"approximate\": \"tanh\"}]},"
    "{\"type\": \"linear\", \"in\": 12, \"out\": 3, \"frozen\": true},"
    "{\"type\": \"linear\", \"in\": 3, \"out\": 4}]}";

/* An MLP with BatchNorm, LayerNorm, a residual block, a used and an unused branch: output,
 * loss, gradients (zeros for the unused branch), running stats and hook order match torch. */
static void test_model_mlp(void **state) {
  (void)state;
  model_vs_torch("mlp", mlp_json, 8, 10, 0, true, 2, 2e-5);
  order_vs_torch("mlp", mlp_json, 8, 10, 0, true, 2);
}

/* Embedding front, reentrant checkpoint, a frozen layer, MSE loss. */
static void test_model_embedding_checkpoint(void **state) {
  (void)state;
  model_vs_torch("emb", emb_json, 6, 4, 20, false, 0, 2e-5);
  order_vs_torch("emb", emb_json, 6, 4, 20, false, 0);
}

/* ---------------------------------------------------------------- timing ---------- */

/* Prints one forward+backward step of a 784-1024-1024-10 MLP at batch 64 (best of 20)
 * for libddp and for torch, one thread each. Informational: nothing is asserted beyond
 * both sides running. */
static void test_step_time(void **state) {
  (void)state;
  NEED_TORCH();
  ddp_model_t *m;
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"linear\", \"in\": 784, \"out\": "
                                       "1024}, {\"type\": \"relu\"},"
                                       "{\"type\": \"linear\", \"in\": 1024, \"out\": 1024}, "
                                       "{\"type\": \"relu\"},"
                                       "{\"type\": \"linear\", \"in\": 1024, \"out\": 10}]}",
                                       &m, NULL),
                   DDP_OK);
  assert_int_equal(ddp_model_init(m, 1), DDP_OK);
  ddp_blas_set_threads(1);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t t[64];
  float *x = ddp_test_mlp_batch(t);
  double best = 1e30, total = 0;
  const int iters = 20;
  for (int it = 0; it < iters + 3; it++) {
    int64_t t0 = ddp_now_ns();
    ddp_model_zero_grad(m);
    ddp_test_mlp_step(m, c, x, t);
    double ms = (double)(ddp_now_ns() - t0) / 1e6;
    if (it >= 3) {
      best = ms < best ? ms : best;
      total += ms;
    }
  }
  char dir[400];
  snprintf(dir, sizeof dir, "%s/bench", g_dir);
  assert_int_equal(mkdir(dir, 0700), 0);
  write_text(dir, "bench.json", "{\"dims\": [784, 1024, 1024, 10], \"batch\": 64, \"iters\": 20}");
  assert_int_equal(run_oracle("bench", dir), 0);
  char buf[1024];
  char p[512];
  snprintf(p, sizeof p, "%s/bench_out.json", dir);
  FILE *f = fopen(p, "rb");
  assert_non_null(f);
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  buf[k] = 0;
  fclose(f);
  cJSON *j = cJSON_Parse(buf);
  double tb = cJSON_GetObjectItem(j, "torch_best_ms")->valuedouble;
  double tm = cJSON_GetObjectItem(j, "torch_mean_ms")->valuedouble;
  cJSON_Delete(j);
  print_message("MLP 784-1024-1024-10 batch 64 fwd+bwd, 1 thread: libddp best %.2f ms mean %.2f "
                "ms; "
                "torch best %.2f ms mean %.2f ms; ratio (best) %.2f\n",
                best, total / iters, tb, tm, best / tb);
  free(x);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_f64),   cmocka_unit_test(test_ops_f32),
      cmocka_unit_test(test_model_mlp), cmocka_unit_test(test_model_embedding_checkpoint),
      cmocka_unit_test(test_step_time),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
