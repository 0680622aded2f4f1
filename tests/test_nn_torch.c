/* The nn layer against PyTorch 1.13 (tools/nn_oracle.py under /usr/bin/python3): every
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

static char g_dir[256];
static char g_oracle[512];

static void write_file(const char *dir, const char *name, const void *data, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

/* Reads exactly n bytes (fails on a size mismatch). */
static void read_file(const char *dir, const char *name, void *data, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "rb");
  if (!f) fail_msg("oracle output %s missing", p);
  size_t got = fread(data, 1, n, f);
  char extra;
  size_t more = fread(&extra, 1, 1, f);
  fclose(f);
  if (got != n || more != 0) fail_msg("%s: expected %zu bytes", p, n);
}

static void write_text(const char *dir, const char *name, const char *text) {
  write_file(dir, name, text, strlen(text));
}

static int run_oracle(const char *cmd, const char *dir) {
  char line[2048];
  snprintf(line, sizeof line,
           "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s %s %s", ddp_test_python(), g_oracle, cmd,
           dir);
  return system(line);
}

static int setup(void **state) {
  (void)state;
  const char *py = ddp_test_python(), *root = ddp_test_source_root();
  if (!py || !root) return 0;
  char line[512];
  snprintf(line, sizeof line, "%s -c 'import torch, numpy' >/dev/null 2>&1", py);
  if (system(line) != 0) return 0;
  snprintf(g_oracle, sizeof g_oracle, "%s/tools/nn_oracle.py", root);
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

#define NEED_TORCH()                                            \
  do {                                                          \
    if (!g_dir[0]) {                                            \
      print_message("torch (under /usr/bin/python3) absent: skipped\n"); \
      skip();                                                   \
    }                                                           \
  } while (0)

/* ---------------------------------------------------------------- ops ------------- */

typedef struct tin {
  int ndim;
  int64_t shape[4];
  int kind; /* 0 float, 1 ids < hi, 2 targets with ignored entries, 3 dropout mask */
  int64_t hi;
  bool rg;
} tin_t;

typedef struct tcase {
  const char *name;
  const char *op;
  const char *attrs; /* JSON object text */
  int nin;
  tin_t in[3];
} tcase_t;

#define TF(n, ...) {n, {__VA_ARGS__}, 0, 0, true}
#define TFC(n, ...) {n, {__VA_ARGS__}, 0, 0, false}

static const tcase_t tcases[] = {
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
    {"dropout", "dropout", "{\"p\": 0.3}", 2, {TF(2, 6, 7), {2, {6, 7}, 3, 0, false}}},
    {"layer_norm", "layer_norm", "{\"eps\": 1e-5}", 3, {TF(2, 4, 6), TF(1, 6), TF(1, 6)}},
    {"batch_norm_train", "batch_norm", "{\"training\": true, \"momentum\": 0.1, \"eps\": 1e-5}", 3,
     {TF(2, 5, 4), TF(1, 4), TF(1, 4)}},
    {"batch_norm_eval", "batch_norm", "{\"training\": false, \"momentum\": 0.1, \"eps\": 1e-5}", 3,
     {TF(2, 5, 4), TF(1, 4), TF(1, 4)}},
    {"embedding", "embedding", "{}", 2, {{2, {2, 3}, 1, 7, false}, TF(2, 7, 4)}},
    {"reshape", "reshape", "{\"shape\": [2, -1, 3]}", 1, {TF(2, 3, 4)}},
    {"concat", "concat", "{\"dim\": 1}", 3, {TF(3, 2, 1, 3), TF(3, 2, 2, 3), TF(3, 2, 3, 3)}},
    {"sum", "sum", "{}", 1, {TF(2, 3, 4)}},
    {"mean", "mean", "{}", 1, {TF(2, 3, 4)}},
    {"mse_loss", "mse_loss", "{}", 2, {TF(2, 3, 4), TF(2, 3, 4)}},
    {"cross_entropy", "cross_entropy", "{\"ignore_index\": -100}", 2, {TF(2, 6, 5), {1, {6}, 2, 5, false}}},
};
#define NCASES (sizeof tcases / sizeof tcases[0])

static double rm0[4] = {0.1, -0.2, 0.3, 0.05}, rv0[4] = {1.5, 0.7, 2.0, 0.9};

typedef struct run_out {
  ddp_var_t *in[3];
  ddp_var_t *y;
  double rm[4], rv[4];
} run_out_t;

static void get_attr_num(const char *attrs, const char *key, double *v) {
  cJSON *j = cJSON_Parse(attrs);
  cJSON *x = cJSON_GetObjectItem(j, key);
  if (cJSON_IsNumber(x)) *v = x->valuedouble;
  if (cJSON_IsBool(x)) *v = cJSON_IsTrue(x);
  cJSON_Delete(j);
}

/* Runs case tc in libddp with dtype dt on the given host data (f64 values, ids as values). */
static void run_c(ddp_ctx_t *c, const tcase_t *tc, ddp_dtype_t dt, double **data, int64_t *numel,
                  const double *gout, run_out_t *o) {
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 3, 0, 0);
  for (int i = 0; i < tc->nin; i++) {
    const tin_t *g = &tc->in[i];
    if (g->kind == 1 || g->kind == 2) {
      int64_t ids[64];
      for (int64_t k = 0; k < numel[i]; k++) ids[k] = (int64_t)data[i][k];
      assert_int_equal(ddp_var_new(c, DDP_I64, g->ndim, g->shape, ids, false, &o->in[i]), DDP_OK);
    } else {
      assert_int_equal(ddp_var_new(c, dt, g->ndim, g->shape, NULL, g->rg, &o->in[i]), DDP_OK);
      for (int64_t k = 0; k < numel[i]; k++) {
        if (dt == DDP_F32) ((float *)o->in[i]->value.data)[k] = (float)data[i][k];
        else ((double *)o->in[i]->value.data)[k] = data[i][k];
      }
    }
  }
  ddp_var_t **in = o->in;
  const char *op = tc->op;
  ddp_status_t st = DDP_ERR_INTERNAL;
  double p = 0, eps = 1e-5, mom = 0.1, train = 0, dim = 0;
  if (!strcmp(op, "linear")) st = ddp_linear(c, in[0], in[1], tc->nin > 2 ? in[2] : NULL, &o->y);
  else if (!strcmp(op, "matmul")) st = ddp_matmul(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "add")) st = ddp_add(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "mul")) st = ddp_mul(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "bias_add")) st = ddp_bias_add(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "relu")) st = ddp_activation(c, DDP_ACT_RELU, in[0], &o->y);
  else if (!strcmp(op, "gelu")) st = ddp_activation(c, strstr(tc->attrs, "tanh") ? DDP_ACT_GELU_TANH : DDP_ACT_GELU, in[0], &o->y);
  else if (!strcmp(op, "tanh")) st = ddp_activation(c, DDP_ACT_TANH, in[0], &o->y);
  else if (!strcmp(op, "sigmoid")) st = ddp_activation(c, DDP_ACT_SIGMOID, in[0], &o->y);
  else if (!strcmp(op, "softmax")) st = ddp_softmax(c, in[0], &o->y);
  else if (!strcmp(op, "log_softmax")) st = ddp_log_softmax(c, in[0], &o->y);
  else if (!strcmp(op, "dropout")) {
    get_attr_num(tc->attrs, "p", &p);
    st = ddp_dropout(c, in[0], p, true, &o->y);
  } else if (!strcmp(op, "layer_norm")) st = ddp_layer_norm(c, in[0], in[1], in[2], 1e-5, &o->y);
  else if (!strcmp(op, "batch_norm")) {
    get_attr_num(tc->attrs, "training", &train);
    get_attr_num(tc->attrs, "momentum", &mom);
    get_attr_num(tc->attrs, "eps", &eps);
    ddp_tensor_t rm, rv;
    int64_t n = 4;
    memcpy(o->rm, rm0, sizeof rm0);
    memcpy(o->rv, rv0, sizeof rv0);
    ddp_tensor_view(&rm, DDP_F64, 1, &n, o->rm);
    ddp_tensor_view(&rv, DDP_F64, 1, &n, o->rv);
    st = ddp_batch_norm(c, in[0], in[1], in[2], &rm, &rv, NULL, train != 0, mom, eps, &o->y);
  } else if (!strcmp(op, "embedding")) st = ddp_embedding(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "reshape")) {
    int64_t sh[3] = {2, -1, 3};
    st = ddp_reshape(c, in[0], 3, sh, &o->y);
  } else if (!strcmp(op, "concat")) {
    get_attr_num(tc->attrs, "dim", &dim);
    st = ddp_concat(c, (size_t)tc->nin, in, (int)dim, &o->y);
  } else if (!strcmp(op, "sum")) st = ddp_sum(c, in[0], &o->y);
  else if (!strcmp(op, "mean")) st = ddp_mean(c, in[0], &o->y);
  else if (!strcmp(op, "mse_loss")) st = ddp_mse_loss(c, in[0], in[1], &o->y);
  else if (!strcmp(op, "cross_entropy")) st = ddp_cross_entropy(c, in[0], in[1], -100, &o->y);
  if (st != DDP_OK) fail_msg("%s: %s", tc->name, ddp_ctx_last_error(c)->msg);
  if (!gout) return;
  ddp_tensor_t g;
  ddp_var_t *y = o->y;
  void *gbuf = malloc((size_t)y->value.numel * 8);
  for (int64_t k = 0; k < y->value.numel; k++) {
    if (dt == DDP_F32) ((float *)gbuf)[k] = (float)gout[k];
    else ((double *)gbuf)[k] = gout[k];
  }
  ddp_tensor_view(&g, dt, y->value.ndim, y->value.shape, gbuf);
  assert_int_equal(ddp_backward_multi(c, 1, &y, &g), DDP_OK);
  free(gbuf);
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

static void ops_vs_torch(ddp_dtype_t dt, double tol) {
  NEED_TORCH();
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  char root[300];
  snprintf(root, sizeof root, "%s/ops_%s", g_dir, dt == DDP_F32 ? "f32" : "f64");
  assert_int_equal(mkdir(root, 0700), 0);
  const char *dts = dt == DDP_F32 ? "f32" : "f64";
  size_t es = ddp_dtype_size(dt);
  ddp_rng_t rng;
  ddp_rng_init(&rng, 2024, 1);
  static double *data[NCASES][3];
  static int64_t numel[NCASES][3];
  static double *gout[NCASES];
  for (size_t ci = 0; ci < NCASES; ci++) {
    const tcase_t *tc = &tcases[ci];
    char dir[400];
    snprintf(dir, sizeof dir, "%s/%02zu_%s", root, ci, tc->name);
    assert_int_equal(mkdir(dir, 0700), 0);
    for (int i = 0; i < tc->nin; i++) {
      const tin_t *g = &tc->in[i];
      numel[ci][i] = 1;
      for (int d = 0; d < g->ndim; d++) numel[ci][i] *= g->shape[d];
      data[ci][i] = malloc((size_t)numel[ci][i] * sizeof(double));
      for (int64_t k = 0; k < numel[ci][i]; k++) {
        if (g->kind == 1) data[ci][i][k] = (double)(ddp_rng_u32(&rng) % (uint32_t)g->hi);
        else if (g->kind == 2) data[ci][i][k] = k % 3 == 1 ? -100 : (double)(ddp_rng_u32(&rng) % (uint32_t)g->hi);
        else data[ci][i][k] = ddp_rng_uniform_f64(&rng) * 2 - 1;
      }
    }
    /* Forward once to learn the output shape; the dropout mask comes from libddp's run. */
    run_out_t o;
    run_c(c, tc, dt, data[ci], numel[ci], NULL, &o);
    if (!strcmp(tc->op, "dropout")) {
      double p = 0.3;
      for (int64_t k = 0; k < numel[ci][0]; k++)
        data[ci][1][k] = val(o.y->value.data, dt, k) == 0 && data[ci][0][k] != 0 ? 0 : 1.0 / (1.0 - p);
    }
    int64_t yn = o.y->value.numel;
    gout[ci] = malloc((size_t)yn * sizeof(double));
    for (int64_t k = 0; k < yn; k++) gout[ci][k] = ddp_rng_uniform_f64(&rng) * 2 - 1;
    /* case.json and inputs */
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "op", tc->op);
    cJSON_AddStringToObject(j, "dtype", dts);
    cJSON_AddItemToObject(j, "attrs", cJSON_Parse(tc->attrs));
    cJSON *ins = cJSON_AddArrayToObject(j, "inputs");
    for (int i = 0; i < tc->nin; i++) {
      const tin_t *g = &tc->in[i];
      bool ids = g->kind == 1 || g->kind == 2;
      cJSON *e = cJSON_CreateObject();
      cJSON_AddStringToObject(e, "dtype", ids ? "i64" : dts);
      cJSON *sh = cJSON_AddArrayToObject(e, "shape");
      for (int d = 0; d < g->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)g->shape[d]));
      cJSON_AddBoolToObject(e, "requires_grad", g->rg);
      cJSON_AddItemToArray(ins, e);
      char fn[16];
      snprintf(fn, sizeof fn, "in%d.bin", i);
      void *buf = malloc((size_t)numel[ci][i] * 8);
      for (int64_t k = 0; k < numel[ci][i]; k++) {
        if (ids) ((int64_t *)buf)[k] = (int64_t)data[ci][i][k];
        else if (dt == DDP_F32) ((float *)buf)[k] = (float)data[ci][i][k];
        else ((double *)buf)[k] = data[ci][i][k];
      }
      write_file(dir, fn, buf, (size_t)numel[ci][i] * (ids ? 8 : es));
      free(buf);
    }
    char *text = cJSON_Print(j);
    write_text(dir, "case.json", text);
    free(text);
    cJSON_Delete(j);
    void *gb = malloc((size_t)yn * 8);
    for (int64_t k = 0; k < yn; k++) {
      if (dt == DDP_F32) ((float *)gb)[k] = (float)gout[ci][k];
      else ((double *)gb)[k] = gout[ci][k];
    }
    write_file(dir, "gout.bin", gb, (size_t)yn * es);
    free(gb);
    if (!strcmp(tc->op, "batch_norm")) {
      float f[4];
      double d[4];
      for (int k = 0; k < 4; k++) {
        f[k] = (float)rm0[k];
        d[k] = rm0[k];
      }
      write_file(dir, "rm.bin", dt == DDP_F32 ? (void *)f : (void *)d, 4 * es);
      for (int k = 0; k < 4; k++) {
        f[k] = (float)rv0[k];
        d[k] = rv0[k];
      }
      write_file(dir, "rv.bin", dt == DDP_F32 ? (void *)f : (void *)d, 4 * es);
    }
  }
  assert_int_equal(run_oracle("ops", root), 0);
  for (size_t ci = 0; ci < NCASES; ci++) {
    const tcase_t *tc = &tcases[ci];
    char dir[400];
    snprintf(dir, sizeof dir, "%s/%02zu_%s", root, ci, tc->name);
    run_out_t o;
    run_c(c, tc, dt, data[ci], numel[ci], gout[ci], &o);
    int64_t yn = o.y->value.numel;
    void *ref = malloc((size_t)yn * es);
    read_file(dir, "out.bin", ref, (size_t)yn * es);
    /* f32 batch norm reproduces torch's CPU float arithmetic: bitwise, not within tol */
    bool exact = dt == DDP_F32 && !strcmp(tc->op, "batch_norm");
    double e = rel_err(o.y->value.data, ref, dt, yn);
    if (exact ? e != 0 : !(e < tol))
      fail_msg("%s %s forward: rel err %.3g", tc->name, ddp_dtype_name(dt), e);
    free(ref);
    for (int i = 0; i < tc->nin; i++) {
      if (!tc->in[i].rg) continue;
      char fn[16];
      snprintf(fn, sizeof fn, "grad%d.bin", i);
      ref = malloc((size_t)numel[ci][i] * es);
      read_file(dir, fn, ref, (size_t)numel[ci][i] * es);
      assert_non_null(o.in[i]->grad.data);
      e = rel_err(o.in[i]->grad.data, ref, dt, numel[ci][i]);
      if (exact ? e != 0 : !(e < tol))
        fail_msg("%s %s grad of input %d: rel err %.3g", tc->name, ddp_dtype_name(dt), i, e);
      free(ref);
    }
    if (!strcmp(tc->op, "batch_norm")) {
      void *r1 = malloc(4 * es), *r2 = malloc(4 * es);
      read_file(dir, "rm_out.bin", r1, 4 * es);
      read_file(dir, "rv_out.bin", r2, 4 * es);
      for (int k = 0; k < 4; k++) {
        /* running stats are kept in f64 here; torch's in the case dtype */
        double tolr = dt == DDP_F32 ? 1e-6 : 1e-14;
        assert_true(fabs(o.rm[k] - val(r1, dt, k)) <= tolr * (1 + fabs(o.rm[k])));
        assert_true(fabs(o.rv[k] - val(r2, dt, k)) <= tolr * (1 + fabs(o.rv[k])));
      }
      free(r1);
      free(r2);
    }
    for (int i = 0; i < tc->nin; i++) free(data[ci][i]);
    free(gout[ci]);
  }
  ddp_ctx_destroy(c);
}

/* Every op's forward and input gradients equal torch's in f64 (rel 1e-10). */
static void test_ops_f64(void **state) {
  (void)state;
  ops_vs_torch(DDP_F64, 1e-10);
}

/* The same in f32 (rel 2e-5: different summation orders and libm); batch norm bitwise. */
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
    for (int64_t k = 0; k < B * xdim; k++) ((int64_t *)x->value.data)[k] = ddp_rng_u32(&g) % (uint32_t)ids_hi;
  } else {
    assert_int_equal(ddp_var_new(c, DDP_F32, 2, xs, NULL, false, &x), DDP_OK);
    for (int64_t k = 0; k < B * xdim; k++) ((float *)x->value.data)[k] = ddp_rng_uniform(&g) * 2 - 1;
  }
  write_file(dir, "x.bin", x->value.data, ddp_tensor_nbytes(&x->value));
  ddp_var_t *y, *loss, *t;
  assert_int_equal(ddp_model_forward(m, c, x, flags, &y), DDP_OK);
  int64_t ncls = y->value.shape[1];
  if (ce) {
    assert_int_equal(ddp_var_new(c, DDP_I64, 1, &B, NULL, false, &t), DDP_OK);
    for (int64_t i = 0; i < B; i++) ((int64_t *)t->value.data)[i] = ddp_rng_u32(&g) % (uint32_t)ncls;
    assert_int_equal(ddp_cross_entropy(c, y, t, -100, &loss), DDP_OK);
  } else {
    assert_int_equal(ddp_var_new(c, DDP_F32, y->value.ndim, y->value.shape, NULL, false, &t), DDP_OK);
    for (int64_t k = 0; k < t->value.numel; k++) ((float *)t->value.data)[k] = ddp_rng_uniform(&g);
    assert_int_equal(ddp_mse_loss(c, y, t, &loss), DDP_OK);
  }
  write_file(dir, "t.bin", t->value.data, ddp_tensor_nbytes(&t->value));
  char run[512];
  snprintf(run, sizeof run,
           "{\"x_dtype\": \"%s\", \"x_shape\": [%lld, %lld], \"loss\": \"%s\", \"flags\": %llu, "
           "\"train\": true}", ids_hi ? "i64" : "f32", (long long)B, (long long)xdim,
           ce ? "ce" : "mse", (unsigned long long)flags);
  write_text(dir, "run.json", run);
  assert_int_equal(ddp_backward(c, loss), DDP_OK);
  assert_int_equal(run_oracle("model", dir), 0);

  float *ref = malloc((size_t)y->value.numel * 4);
  read_file(dir, "y.bin", ref, (size_t)y->value.numel * 4);
  double e = rel_err(y->value.data, ref, DDP_F32, y->value.numel);
  if (!(e < tol)) fail_msg("%s: output rel err %.3g", tag, e);
  float lref;
  read_file(dir, "loss.bin", &lref, 4);
  assert_true(fabs(((float *)loss->value.data)[0] - lref) <= tol * fabs(lref));
  free(ref);
  ddp_tensor_t gf = ddp_model_flat_grads(m, DDP_F32);
  ref = malloc(ddp_tensor_nbytes(&gf));
  read_file(dir, "grads.bin", ref, ddp_tensor_nbytes(&gf));
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
  for (size_t i = 0; i < ddp_model_num_buffers(m); i++) nb += (size_t)ddp_model_buffer(m, i)->value.numel;
  if (nb) {
    double *bref = malloc(nb * 8);
    read_file(dir, "buffers.bin", bref, nb * 8);
    size_t off = 0;
    for (size_t i = 0; i < ddp_model_num_buffers(m); i++) {
      ddp_buffer_t *b = ddp_model_buffer(m, i);
      for (int64_t k = 0; k < b->value.numel; k++, off++) {
        double v = b->value.dtype == DDP_I64 ? (double)((int64_t *)b->value.data)[k] : val(b->value.data, b->value.dtype, k);
        if (!(fabs(v - bref[off]) <= tol * (1 + fabs(bref[off]))))
          fail_msg("%s: buffer %s[%lld] = %.9g, torch %.9g", tag, b->name, (long long)k, v, bref[off]);
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
  if (ddp_model_load(m2, path, true, &nmiss, &nunexp, &err) != DDP_OK) fail_msg("%s: %s", tag, err.msg);
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
    assert_int_equal(ddp_var_new(c, DDP_F32, y->value.ndim, y->value.shape, NULL, false, &t), DDP_OK);
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
  if (strcmp(mine, theirs)) fail_msg("%s: hook order libddp [%s ] vs torch [%s ]", tag, mine, theirs);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

static const char *mlp_json =
    "{\"dtype\": \"f32\", \"layers\": ["
    "{\"type\": \"linear\", \"in\": 10, \"out\": 16}, {\"type\": \"batchnorm\", \"dim\": 16},"
    "{\"type\": \"relu\"}, {\"type\": \"dropout\", \"p\": 0.0},"
    "{\"type\": \"residual\", \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": 16},"
    "  {\"type\": \"layernorm\", \"dim\": 16}, {\"type\": \"gelu\"}]},"
    "{\"type\": \"branch\", \"flag\": 1, \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": 16},"
    "  {\"type\": \"tanh\"}]},"
    "{\"type\": \"branch\", \"flag\": 3, \"layers\": [{\"type\": \"linear\", \"in\": 16, \"out\": 16}]},"
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
  assert_int_equal(ddp_model_from_json(
                       "{\"layers\": [{\"type\": \"linear\", \"in\": 784, \"out\": 1024}, {\"type\": \"relu\"},"
                       "{\"type\": \"linear\", \"in\": 1024, \"out\": 1024}, {\"type\": \"relu\"},"
                       "{\"type\": \"linear\", \"in\": 1024, \"out\": 10}]}", &m, NULL), DDP_OK);
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
  print_message("MLP 784-1024-1024-10 batch 64 fwd+bwd, 1 thread: libddp best %.2f ms mean %.2f ms; "
                "torch best %.2f ms mean %.2f ms; ratio (best) %.2f\n",
                best, total / iters, tb, tm, best / tb);
  free(x);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_f64),
      cmocka_unit_test(test_ops_f32),
      cmocka_unit_test(test_model_mlp),
      cmocka_unit_test(test_model_embedding_checkpoint),
      cmocka_unit_test(test_step_time),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
