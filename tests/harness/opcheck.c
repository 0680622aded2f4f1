/* nn operation checks (opcheck.h): finite differences in f64 and parity with PyTorch 1.13
 * through tools/torch/nn_oracle.py. */
#include "opcheck.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "harness.h"

/* ---------------------------------------------------------------- inputs ---------- */

int64_t ddp_test_opin_numel(const ddp_test_opin_t *in) {
  int64_t n = 1;
  for (int i = 0; i < in->ndim; i++) n *= in->shape[i];
  return n;
}

bool ddp_test_opin_is_int(const ddp_test_opin_t *in) {
  return in->kind == DDP_TEST_IN_IDS || in->kind == DDP_TEST_IN_TARGETS ||
         in->kind == DDP_TEST_IN_PAD;
}

void ddp_test_opin_fill(const ddp_test_opin_t *in, ddp_rng_t *rng, double *data) {
  int64_t n = ddp_test_opin_numel(in);
  int64_t cols = in->ndim ? in->shape[in->ndim - 1] : 1;
  for (int64_t k = 0; k < n; k++) {
    switch (in->kind) {
      case DDP_TEST_IN_IDS: data[k] = (double)(ddp_rng_u32(rng) % (uint32_t)in->hi); break;
      case DDP_TEST_IN_TARGETS:
        data[k] = k % 3 == 1 ? -100 : (double)(ddp_rng_u32(rng) % (uint32_t)in->hi);
        break;
      case DDP_TEST_IN_MASK: data[k] = 1; break;
      case DDP_TEST_IN_PAD: {
        int64_t b = k / cols, j = k % cols;
        data[k] = (b % 3 == 1 && j >= cols - 2) || (b % 3 == 2 && j < 2) ? 0 : 1;
        break;
      }
      default: data[k] = ddp_rng_uniform_f64(rng) * 2 - 1; break;
    }
  }
}

/* Fails the test with the op's name and the context's last error (copied out). */
static void fail_ctx(const ddp_ctx_t *c, const char *name) {
  ddp_error_t e;
  ddp_ctx_last_error_copy(c, &e);
  fail_msg("%s: %s", name, e.msg);
}

/* A var of dtype dt (ids: I64) holding data. */
static ddp_var_t *make_var(ddp_ctx_t *c, const ddp_test_opin_t *g, ddp_dtype_t dt,
                           const double *data) {
  int64_t n = ddp_test_opin_numel(g);
  ddp_var_t *v;
  bool ids = ddp_test_opin_is_int(g);
  assert_int_equal(ddp_var_new(c, ids ? DDP_I64 : dt, g->ndim, g->shape, NULL, g->rg, &v), DDP_OK);
  for (int64_t k = 0; k < n; k++) {
    if (ids)
      ((int64_t *)v->value.data)[k] = (int64_t)data[k];
    else if (dt == DDP_F32)
      ((float *)v->value.data)[k] = (float)data[k];
    else
      ((double *)v->value.data)[k] = data[k];
  }
  return v;
}

/* ---------------------------------------------------------------- gradcheck ------- */

typedef struct gstate {
  const ddp_test_gcase_t *gc;
  double *data[DDP_TEST_OP_MAX_IN];
  int64_t numel[DDP_TEST_OP_MAX_IN];
  double *r; /* random weights of the scalar loss sum(out * r) */
} gstate_t;

/* Evaluates loss = sum(op(inputs) * r) on fresh vars; with grads, also runs backward and
 * copies the inputs' gradients. */
static double geval(ddp_ctx_t *c, gstate_t *s, double **grads) {
  const ddp_test_gcase_t *gc = s->gc;
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 7, 0, 1);
  ddp_var_t *in[DDP_TEST_OP_MAX_IN];
  for (int i = 0; i < gc->nin; i++) in[i] = make_var(c, &gc->in[i], DDP_F64, s->data[i]);
  ddp_var_t *out, *rv, *prod, *loss;
  ddp_status_t st = gc->fn(c, in, &out);
  if (st != DDP_OK) fail_ctx(c, gc->name);
  if (!s->r) {
    s->r = malloc((size_t)out->value.numel * sizeof(double));
    ddp_rng_t rng;
    ddp_rng_init(&rng, 99, 1);
    for (int64_t k = 0; k < out->value.numel; k++) s->r[k] = ddp_rng_uniform_f64(&rng) * 2 - 1;
  }
  assert_int_equal(ddp_var_new(c, DDP_F64, out->value.ndim, out->value.shape, s->r, false, &rv),
                   DDP_OK);
  assert_int_equal(ddp_mul(c, out, rv, &prod), DDP_OK);
  assert_int_equal(ddp_sum(c, prod, &loss), DDP_OK);
  double L = ((double *)loss->value.data)[0];
  if (grads) {
    assert_int_equal(ddp_backward(c, loss), DDP_OK);
    for (int i = 0; i < gc->nin; i++) {
      if (!gc->in[i].rg) continue;
      if (!in[i]->grad.data) fail_msg("%s: input %d received no gradient", gc->name, i);
      memcpy(grads[i], in[i]->grad.data, (size_t)s->numel[i] * sizeof(double));
    }
  }
  return L;
}

double ddp_test_gradcheck(const ddp_test_gcase_t *cases, size_t ncases, double tol) {
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  ddp_rng_t rng;
  ddp_rng_init(&rng, 1234, 5);
  double worst = 0;
  for (size_t ci = 0; ci < ncases; ci++) {
    gstate_t s;
    memset(&s, 0, sizeof s);
    s.gc = &cases[ci];
    double *grads[DDP_TEST_OP_MAX_IN] = {0};
    for (int i = 0; i < s.gc->nin; i++) {
      s.numel[i] = ddp_test_opin_numel(&s.gc->in[i]);
      s.data[i] = malloc((size_t)s.numel[i] * sizeof(double));
      grads[i] = calloc((size_t)s.numel[i], sizeof(double));
      ddp_test_opin_fill(&s.gc->in[i], &rng, s.data[i]);
    }
    geval(c, &s, grads);
    const double h = 1e-6;
    for (int i = 0; i < s.gc->nin; i++) {
      if (!s.gc->in[i].rg) continue;
      double maxdiff = 0, maxref = 0, worst_a = 0, worst_n = 0;
      for (int64_t k = 0; k < s.numel[i]; k++) {
        double x0 = s.data[i][k];
        s.data[i][k] = x0 + h;
        double lp = geval(c, &s, NULL);
        s.data[i][k] = x0 - h;
        double lm = geval(c, &s, NULL);
        s.data[i][k] = x0;
        double num = (lp - lm) / (2 * h);
        if (fabs(num - grads[i][k]) > maxdiff) {
          maxdiff = fabs(num - grads[i][k]);
          worst_a = grads[i][k];
          worst_n = num;
        }
        maxref = fmax(maxref, fabs(num));
      }
      double rel = maxdiff / fmax(maxref, 1e-12);
      if (!(rel < tol))
        fail_msg("%s input %d: rel err %.3g >= %.3g (worst element: analytic %.17g, numeric "
                 "%.17g)",
                 s.gc->name, i, rel, tol, worst_a, worst_n);
      if (!(maxref > 0)) fail_msg("%s input %d: the gradient is zero", s.gc->name, i);
      worst = fmax(worst, rel);
    }
    for (int i = 0; i < s.gc->nin; i++) {
      free(s.data[i]);
      free(grads[i]);
    }
    free(s.r);
  }
  ddp_ctx_destroy(c);
  return worst;
}

/* ---------------------------------------------------------------- files ----------- */

void ddp_test_write_bin(const char *dir, const char *name, const void *data, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "wb");
  if (!f) fail_msg("cannot write %s", p);
  size_t put = fwrite(data, 1, n, f);
  fclose(f);
  if (put != n) fail_msg("%s: wrote %zu of %zu bytes", p, put, n);
}

void ddp_test_read_bin(const char *dir, const char *name, void *data, size_t n) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "rb");
  if (!f) fail_msg("oracle output %s missing", p);
  size_t got = fread(data, 1, n, f);
  char extra;
  size_t more = fread(&extra, 1, 1, f);
  fclose(f);
  if (got != n || more != 0)
    fail_msg("%s: expected %zu bytes, got %zu%s", p, n, got, more ? " and more" : "");
}

ddp_var_t *ddp_test_rand_var(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                             uint64_t seed, bool requires_grad) {
  ddp_var_t *v;
  assert_int_equal(ddp_var_new(c, dt, ndim, shape, NULL, requires_grad, &v), DDP_OK);
  ddp_rng_t r;
  ddp_rng_init(&r, seed, 3);
  for (int64_t k = 0; k < v->value.numel; k++) {
    double x = ddp_rng_uniform_f64(&r) * 2 - 1;
    if (dt == DDP_F32)
      ((float *)v->value.data)[k] = (float)x;
    else
      ((double *)v->value.data)[k] = x;
  }
  return v;
}

/* ---------------------------------------------------------------- against PyTorch -- */

bool ddp_test_have_torch(void) {
  if (!ddp_test_python() || !ddp_test_source_root()) return false;
  int rc = system("OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 -c "
                  "'import torch, numpy' >/dev/null 2>&1");
  return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

static double val(const void *p, ddp_dtype_t dt, int64_t k) {
  return dt == DDP_F32 ? ((const float *)p)[k] : ((const double *)p)[k];
}

static bool is_exact(const ddp_test_torch_ops_t *o, const char *op) {
  for (const char *const *e = o->f32_exact_ops; e && *e; e++)
    if (!strcmp(*e, op)) return true;
  return false;
}

/* libddp's a against torch's b (n elements of dt): fails unless
 * max|a - b| / max(max|b|, 1e-3) < tol (tol 0: unless a equals b exactly); returns that
 * error. */
static double compare(const char *what, const char *name, int input, const void *a, const void *b,
                      ddp_dtype_t dt, int64_t n, double tol) {
  double md = 0, mr = 0, wa = 0, wb = 0;
  int64_t wk = 0;
  for (int64_t k = 0; k < n; k++) {
    double d = fabs(val(a, dt, k) - val(b, dt, k));
    if (d > md || isnan(d)) {
      md = isnan(d) ? INFINITY : d;
      wa = val(a, dt, k);
      wb = val(b, dt, k);
      wk = k;
    }
    mr = fmax(mr, fabs(val(b, dt, k)));
  }
  double e = md / fmax(mr, 1e-3);
  if (tol == 0 ? md != 0 : !(e < tol)) {
    if (input >= 0)
      fail_msg("%s %s %s of input %d: rel err %.3g >= %.3g (element %lld: libddp %.17g, torch "
               "%.17g)",
               name, ddp_dtype_name(dt), what, input, e, tol, (long long)wk, wa, wb);
    else
      fail_msg("%s %s %s: rel err %.3g >= %.3g (element %lld: libddp %.17g, torch %.17g)", name,
               ddp_dtype_name(dt), what, e, tol, (long long)wk, wa, wb);
  }
  return e;
}

static ddp_var_t *run_case(const ddp_test_torch_ops_t *o, ddp_ctx_t *c, const ddp_test_tcase_t *tc,
                           ddp_dtype_t dt, double **data, const double *gout, ddp_var_t **in) {
  ddp_ctx_reset(c);
  ddp_ctx_set_rng(c, 3, 0, 0);
  for (int i = 0; i < tc->nin; i++) in[i] = make_var(c, &tc->in[i], dt, data[i]);
  ddp_var_t *y = NULL;
  ddp_status_t st = o->run(o->user, c, tc, in, &y);
  if (st != DDP_OK) fail_ctx(c, tc->name);
  if (!gout) return y;
  ddp_tensor_t g;
  void *gbuf = malloc((size_t)y->value.numel * 8 + 8);
  for (int64_t k = 0; k < y->value.numel; k++) {
    if (dt == DDP_F32)
      ((float *)gbuf)[k] = (float)gout[k];
    else
      ((double *)gbuf)[k] = gout[k];
  }
  ddp_tensor_view(&g, dt, y->value.ndim, y->value.shape, gbuf);
  assert_int_equal(ddp_backward_multi(c, 1, &y, &g), DDP_OK);
  free(gbuf);
  return y;
}

/* case.json, the inputs and gout.bin of one case. */
static void write_case(const ddp_test_tcase_t *tc, ddp_dtype_t dt, double **data,
                       const int64_t *numel, const double *gout, int64_t yn, const char *dir) {
  const char *dts = dt == DDP_F32 ? "f32" : "f64";
  size_t es = ddp_dtype_size(dt);
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "op", tc->op);
  cJSON_AddStringToObject(j, "dtype", dts);
  cJSON *attrs = cJSON_Parse(tc->attrs);
  if (!attrs) fail_msg("%s: attrs are not JSON: %s", tc->name, tc->attrs);
  cJSON_AddItemToObject(j, "attrs", attrs);
  cJSON *ins = cJSON_AddArrayToObject(j, "inputs");
  for (int i = 0; i < tc->nin; i++) {
    const ddp_test_opin_t *g = &tc->in[i];
    bool ids = ddp_test_opin_is_int(g);
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "dtype", ids ? "i64" : dts);
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < g->ndim; d++)
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)g->shape[d]));
    cJSON_AddBoolToObject(e, "requires_grad", g->rg);
    cJSON_AddItemToArray(ins, e);
    char fn[32];
    snprintf(fn, sizeof fn, "in%d.bin", i);
    void *buf = malloc((size_t)numel[i] * 8 + 8);
    for (int64_t k = 0; k < numel[i]; k++) {
      if (ids)
        ((int64_t *)buf)[k] = (int64_t)data[i][k];
      else if (dt == DDP_F32)
        ((float *)buf)[k] = (float)data[i][k];
      else
        ((double *)buf)[k] = data[i][k];
    }
    ddp_test_write_bin(dir, fn, buf, (size_t)numel[i] * (ids ? 8 : es));
    free(buf);
  }
  char *text = cJSON_Print(j);
  ddp_test_write_bin(dir, "case.json", text, strlen(text));
  free(text);
  cJSON_Delete(j);
  void *gb = malloc((size_t)yn * 8 + 8);
  for (int64_t k = 0; k < yn; k++) {
    if (dt == DDP_F32)
      ((float *)gb)[k] = (float)gout[k];
    else
      ((double *)gb)[k] = gout[k];
  }
  ddp_test_write_bin(dir, "gout.bin", gb, (size_t)yn * es);
  free(gb);
}

void ddp_test_ops_vs_torch(const ddp_test_torch_ops_t *o, const char *scratch, ddp_dtype_t dt,
                           double tol, ddp_test_torch_err_t *err) {
  if (!ddp_test_have_torch()) {
    print_message("torch (under /usr/bin/python3) absent: skipped\n");
    skip();
  }
  char root[400];
  snprintf(root, sizeof root, "%s/ops_%s", scratch, dt == DDP_F32 ? "f32" : "f64");
  assert_int_equal(mkdir(root, 0700), 0);
  ddp_test_torch_err_t worst = {0, 0, "", ""};
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  size_t es = ddp_dtype_size(dt);
  ddp_rng_t rng;
  ddp_rng_init(&rng, 2024, 1);
  size_t n = o->n;
  double *(*data)[DDP_TEST_OP_MAX_IN] = calloc(n, sizeof *data);
  int64_t(*numel)[DDP_TEST_OP_MAX_IN] = calloc(n, sizeof *numel);
  double **gout = calloc(n, sizeof *gout);
  for (size_t ci = 0; ci < n; ci++) {
    const ddp_test_tcase_t *tc = &o->cases[ci];
    char dir[600];
    snprintf(dir, sizeof dir, "%s/%02zu_%s", root, ci, tc->name);
    if (mkdir(dir, 0700) != 0) fail_msg("mkdir %s failed", dir);
    for (int i = 0; i < tc->nin; i++) {
      numel[ci][i] = ddp_test_opin_numel(&tc->in[i]);
      data[ci][i] = malloc((size_t)numel[ci][i] * sizeof(double) + 8);
      ddp_test_opin_fill(&tc->in[i], &rng, data[ci][i]);
    }
    /* A first forward gives the output's shape (and lets prepare see libddp's output). */
    ddp_var_t *in[DDP_TEST_OP_MAX_IN];
    ddp_var_t *y = run_case(o, c, tc, dt, data[ci], NULL, in);
    int64_t yn = y->value.numel;
    if (o->prepare) o->prepare(o->user, c, tc, dt, data[ci], numel[ci], y, dir);
    gout[ci] = malloc((size_t)yn * sizeof(double) + 8);
    for (int64_t k = 0; k < yn; k++) gout[ci][k] = ddp_rng_uniform_f64(&rng) * 2 - 1;
    write_case(tc, dt, data[ci], numel[ci], gout[ci], yn, dir);
  }
  char args[700];
  snprintf(args, sizeof args, "ops '%s'", root);
  assert_true(ddp_test_run_tool("nn_oracle.py", args));
  for (size_t ci = 0; ci < n; ci++) {
    const ddp_test_tcase_t *tc = &o->cases[ci];
    char dir[600];
    snprintf(dir, sizeof dir, "%s/%02zu_%s", root, ci, tc->name);
    ddp_var_t *in[DDP_TEST_OP_MAX_IN];
    ddp_var_t *y = run_case(o, c, tc, dt, data[ci], gout[ci], in);
    int64_t yn = y->value.numel;
    void *ref = malloc((size_t)yn * es + 8);
    ddp_test_read_bin(dir, "out.bin", ref, (size_t)yn * es);
    double ctol = dt == DDP_F32 && is_exact(o, tc->op) ? 0 : tol;
    double e = compare("forward", tc->name, -1, y->value.data, ref, dt, yn, ctol);
    if (e >= worst.forward) {
      worst.forward = e;
      worst.forward_case = tc->name;
    }
    free(ref);
    for (int i = 0; i < tc->nin; i++) {
      if (!tc->in[i].rg) continue;
      char fn[32];
      snprintf(fn, sizeof fn, "grad%d.bin", i);
      ref = malloc((size_t)numel[ci][i] * es + 8);
      ddp_test_read_bin(dir, fn, ref, (size_t)numel[ci][i] * es);
      if (!in[i]->grad.data) fail_msg("%s: input %d received no gradient", tc->name, i);
      e = compare("grad", tc->name, i, in[i]->grad.data, ref, dt, numel[ci][i], ctol);
      if (e >= worst.grad) {
        worst.grad = e;
        worst.grad_case = tc->name;
      }
      free(ref);
    }
    if (o->check) o->check(o->user, tc, dt, dir);
    for (int i = 0; i < tc->nin; i++) free(data[ci][i]);
    free(gout[ci]);
  }
  print_message("%s vs torch over %zu cases: max rel err forward %.3g (%s), gradients %.3g (%s)\n",
                ddp_dtype_name(dt), n, worst.forward, worst.forward_case, worst.grad,
                worst.grad_case);
  free(data);
  free(numel);
  free(gout);
  ddp_ctx_destroy(c);
  if (err) *err = worst;
}
