/* Communication hooks (src/hooks, the reducer's hook interface): every built-in hook run on
 * W thread ranks and compared with an independent serial computation of the whole
 * multi-rank maths done here in one process (bitwise for allreduce, fp16/bf16 compression
 * and the wrappers, with D2 rounding; PowerSGD against an f64 reference with its own
 * Gram-Schmidt and Householder QR, <= 1e-6 relative per step from libddp's own carried
 * state, plus a looser multi-step drift bound); PowerSGD's warm-up equal to the
 * allreduce hook bitwise and its 3 allreduces per bucket; registration and configuration
 * errors; and PowerSGD rank 4 training a classifier within 5% of the no-hook loss with the
 * reported compression rate recomputed from the layer shapes. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/data.h"
#include "ddp/hooks.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/pg.h"
#include "ddp/reducer.h"
#include "ddp/store.h"
#include "common/common.h"
#include "harness.h"

#define MAXW 4
#define MAXN 4096
/* PowerSGD, f32 against f64. One step from a common carried state: 1e-6 relative (the
 * issue's bound). The free-running multi-step drift check: the reference carries its own
 * f64 error feedback and Q memory while libddp carries f32 ones, so the rounding of earlier
 * steps accumulates (warm-started rank-1 power iteration reaches ~1.2e-6 by step 5): 1e-6
 * for the first three compressed steps, 4e-6 after. */
#define PSGD_STEP_TOL 1e-6
#define PSGD_DRIFT_TOL(t, start) ((t) <= (start) + 2 ? 1e-6 : 4e-6)

/* ---------------------------------------------------------------- fake buckets ---- */

/* A bucket of parameters with the given shapes (2-D {n, m}, or 1-D {n, 0}). */
typedef struct layout {
  size_t nparams;
  int64_t shape[8][2];
} layout_t;

static size_t layout_numel(const layout_t *l) {
  size_t n = 0;
  for (size_t k = 0; k < l->nparams; k++)
    n += (size_t)(l->shape[k][0] * (l->shape[k][1] ? l->shape[k][1] : 1));
  return n;
}

/* The local gradient of rank r at step t, element i: varied signs and magnitudes. */
static float grad_value(int r, int t, size_t i) {
  double v = sin(0.731 * (double)i + 1.37 * r + 0.59 * t) * (1.0 + 0.5 * cos(0.11 * (double)i));
  if (i % 7 == 3) v *= 37.0;
  return (float)(v / 3.0);
}

typedef enum {
  H_ALLREDUCE,
  H_FP16,
  H_BF16,
  H_WRAP16_AR,
  H_WRAPB16_AR,
  H_PSGD,
  H_BPSGD
} hook_kind_t;

typedef struct run {
  hook_kind_t kind;
  int world, steps;
  layout_t layout;
  ddp_powersgd_options_t popts;
  float out[MAXW][8][MAXN]; /* [rank][step][element] the resolved result, widened */
  int64_t nallreduce[MAXW];
  int64_t iter[MAXW];
  uint64_t draws[MAXW]; /* ddp_powersgd_draws at the end */
  ddp_comm_hook_stats_t stats[MAXW];
  ddp_status_t st[MAXW];
  /* PowerSGD with snap_dir set: each rank's carried state just before step t, read back
   * through ddp_powersgd_state_save (bucket 0's error feedback and warm-start Q). */
  const char *snap_dir;
  float snap_err[MAXW][8][MAXN], snap_q[MAXW][8][MAXN];
  size_t snap_nerr[MAXW][8], snap_nq[MAXW][8]; /* 0: absent */
} run_t;

/* Copies tensor `name` of a saved PowerSGD state into dst (at most cap floats); *n = 0
 * when the state holds no such tensor. */
static ddp_status_t snap_tensor(const ddp_st_file_t *f, const char *name, float *dst, size_t cap,
                                size_t *n) {
  size_t idx;
  ddp_tensor_t v;
  *n = 0;
  if (ddp_st_find(f, name, &idx) != DDP_OK) return DDP_OK;
  DDP_CHECK(ddp_st_tensor(f, idx, &v));
  if (v.dtype != DDP_F32 || v.numel < 1 || (size_t)v.numel > cap) return DDP_ERR_INVALID_DATA;
  memcpy(dst, v.data, (size_t)v.numel * sizeof(float));
  *n = (size_t)v.numel;
  return DDP_OK;
}

/* Rank r's PowerSGD state before step t, saved to a file and read back into R. */
static ddp_status_t snap_state(run_t *R, const ddp_powersgd_state_t *ps, int r, int t) {
  char path[512];
  snprintf(path, sizeof path, "%s/rank%d.safetensors", R->snap_dir, r);
  DDP_CHECK(ddp_powersgd_state_save(ps, path, NULL));
  ddp_st_file_t *f = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, NULL));
  ddp_status_t st = snap_tensor(f, "bucket.0.error", R->snap_err[r][t], MAXN, &R->snap_nerr[r][t]);
  if (st == DDP_OK) st = snap_tensor(f, "bucket.0.q", R->snap_q[r][t], MAXN, &R->snap_nq[r][t]);
  ddp_st_close(f);
  unlink(path);
  return st;
}

static ddp_status_t run_rank(ddp_pg_t *pg, void *arg) {
  run_t *R = arg;
  int r = ddp_pg_rank(pg);
  const layout_t *l = &R->layout;
  size_t numel = layout_numel(l);
  ddp_param_t params[8];
  ddp_param_t *pp[8];
  size_t offs[8], off = 0;
  memset(params, 0, sizeof params);
  for (size_t k = 0; k < l->nparams; k++) {
    params[k].value.ndim = l->shape[k][1] ? 2 : 1;
    params[k].value.shape[0] = l->shape[k][0];
    params[k].value.shape[1] = l->shape[k][1];
    params[k].value.numel = l->shape[k][0] * (l->shape[k][1] ? l->shape[k][1] : 1);
    params[k].value.dtype = DDP_F32;
    pp[k] = &params[k];
    offs[k] = off;
    off += (size_t)params[k].value.numel;
  }
  ddp_powersgd_state_t *ps = NULL;
  ddp_hook_counters_t cnt = {0, 0, 0};
  ddp_compress_wrapper_t wrap = {DDP_F16, ddp_allreduce_hook, &cnt};
  ddp_status_t st = DDP_OK;
  if (R->kind == H_PSGD || R->kind == H_BPSGD) {
    /* An init_q goes in through the options on even ranks and through
     * ddp_powersgd_set_init_q (what ddp-train's power_sgd_init_q uses) on odd ones; every
     * rank must still hold the same bits. */
    ddp_powersgd_options_t o = R->popts;
    if (r % 2) o.init_q = NULL, o.init_q_user = NULL;
    DDP_CHECK(ddp_powersgd_state_create(&o, r, &ps, NULL));
    if (r % 2 && R->popts.init_q) {
      ddp_powersgd_set_init_q(ps, R->popts.init_q, R->popts.init_q_user);
    }
  }
  if (R->kind == H_WRAPB16_AR) wrap.dtype = DDP_BF16;
  float *buf = ddp_pg_alloc(pg, numel * sizeof(float));
  if (!buf) st = DDP_ERR_NO_MEMORY;
  for (int t = 0; t < R->steps && st == DDP_OK; t++) {
    if (ps && R->snap_dir && (st = snap_state(R, ps, r, t)) != DDP_OK) break;
    for (size_t i = 0; i < numel; i++) buf[i] = grad_value(r, t, i);
    ddp_grad_bucket_t b = {0, true, buf, numel, DDP_F32, l->nparams, pp, offs};
    ddp_comm_work_t *w = NULL;
    switch (R->kind) {
      case H_ALLREDUCE: st = ddp_allreduce_hook(&cnt, pg, &b, &w); break;
      case H_FP16: st = ddp_fp16_compress_hook(&cnt, pg, &b, &w); break;
      case H_BF16: st = ddp_bf16_compress_hook(&cnt, pg, &b, &w); break;
      case H_WRAP16_AR:
      case H_WRAPB16_AR: st = ddp_compress_wrapper_hook(&wrap, pg, &b, &w); break;
      case H_PSGD: st = ddp_powersgd_hook(ps, pg, &b, &w); break;
      case H_BPSGD: st = ddp_batched_powersgd_hook(ps, pg, &b, &w); break;
    }
    if (st != DDP_OK) break;
    const void *data;
    size_t n;
    ddp_dtype_t dt;
    st = ddp_comm_work_wait(w, &data, &n, &dt);
    if (st == DDP_OK && n != numel) st = DDP_ERR_INTERNAL;
    for (size_t i = 0; i < numel && st == DDP_OK; i++) {
      float v = dt == DDP_F16    ? ddp_f16_to_f32(((const ddp_f16_t *)data)[i])
                : dt == DDP_BF16 ? ddp_bf16_to_f32(((const ddp_bf16_t *)data)[i])
                                 : ((const float *)data)[i];
      R->out[r][t][i] = v;
    }
    ddp_comm_work_free(w);
  }
  if (ps) {
    R->nallreduce[r] = ddp_powersgd_num_allreduces(ps);
    R->iter[r] = ddp_powersgd_iter(ps);
    R->draws[r] = ddp_powersgd_draws(ps);
    ddp_powersgd_stats(ps, &R->stats[r]);
  } else {
    ddp_hook_counters_stats(&cnt, &R->stats[r]);
  }
  ddp_powersgd_state_destroy(ps);
  ddp_pg_free(pg, buf);
  R->st[r] = st;
  return st;
}

static void run_hook(run_t *R) {
  assert_int_equal(ddp_spawn_threads(R->world, NULL, run_rank, R), DDP_OK);
  for (int r = 0; r < R->world; r++) assert_int_equal(R->st[r], DDP_OK);
}

/* ---------------------------------------------------------------- serial maths ---- */

static float h16(float x) { return ddp_f16_to_f32(ddp_f32_to_f16(x)); }
static float hb16(float x) { return ddp_bf16_to_f32(ddp_f32_to_bf16(x)); }

/* allreduce_hook: fl(g/W) summed in rank order in f32. */
static float serial_allreduce(int W, int t, size_t i) {
  float s = 0;
  for (int r = 0; r < W; r++) {
    float c = grad_value(r, t, i) / (float)W;
    s = r == 0 ? c : s + c;
  }
  return s;
}

/* compress hook: cast, divide in low precision, rank-order sum adding in f32 and rounding
 * to the low dtype after every addition (D2), widen. */
static float serial_compress(int W, int t, size_t i, float (*rnd)(float)) {
  float s = 0;
  for (int r = 0; r < W; r++) {
    float c = rnd(rnd(grad_value(r, t, i)) / (float)W);
    s = r == 0 ? c : rnd(s + c);
  }
  return s;
}

static layout_t mixed_layout(void) {
  layout_t l = {5, {{6, 5}, {6, 0}, {20, 16}, {16, 0}, {8, 6}}};
  return l;
}

static void check_bitwise(run_t *R, float (*fn)(int, int, size_t, float (*)(float)),
                          float (*rnd)(float)) {
  size_t numel = layout_numel(&R->layout);
  for (int t = 0; t < R->steps; t++)
    for (size_t i = 0; i < numel; i++) {
      float want = fn ? fn(R->world, t, i, rnd) : serial_allreduce(R->world, t, i);
      for (int r = 0; r < R->world; r++)
        if (memcmp(&R->out[r][t][i], &want, 4) != 0)
          fail_msg("rank %d step %d element %zu: got %.9g want %.9g", r, t, i,
                   (double)R->out[r][t][i], (double)want);
    }
}

/* The default hooks and the wrappers around allreduce, bitwise, W = 1..4. */
static void test_default_hooks_bitwise(void **state) {
  (void)state;
  static run_t R;
  for (int W = 1; W <= MAXW; W++) {
    hook_kind_t kinds[] = {H_ALLREDUCE, H_FP16, H_BF16, H_WRAP16_AR, H_WRAPB16_AR};
    for (size_t k = 0; k < 5; k++) {
      memset(&R, 0, sizeof R);
      R.kind = kinds[k];
      R.world = W;
      R.steps = 2;
      R.layout = mixed_layout();
      run_hook(&R);
      if (kinds[k] == H_ALLREDUCE)
        check_bitwise(&R, NULL, NULL);
      else
        check_bitwise(&R, serial_compress,
                      kinds[k] == H_FP16 || kinds[k] == H_WRAP16_AR ? h16 : hb16);
      size_t numel = layout_numel(&R.layout);
      size_t esz = kinds[k] == H_ALLREDUCE ? 4 : 2;
      assert_int_equal(R.stats[0].bytes_last_step, (int64_t)(numel * esz));
      assert_int_equal(R.stats[0].numel_before, R.stats[0].numel_after);
    }
  }
}

/* ---------------------------------------------------------------- PowerSGD serial -- */

typedef struct pmem {
  double *err;
  double *p, *q;
  bool has;
} pmem_t;

static void ref_mgs(double *a, size_t rows, size_t cols, double eps) {
  for (size_t i = 0; i < cols; i++) {
    double ss = 0;
    for (size_t k = 0; k < rows; k++) ss += a[k * cols + i] * a[k * cols + i];
    double den = sqrt(ss) + eps;
    for (size_t k = 0; k < rows; k++) a[k * cols + i] /= den;
    for (size_t j = i + 1; j < cols; j++) {
      double dot = 0;
      for (size_t k = 0; k < rows; k++) dot += a[k * cols + i] * a[k * cols + j];
      for (size_t k = 0; k < rows; k++) a[k * cols + j] -= dot * a[k * cols + i];
    }
  }
}

/* Householder QR with LAPACK's convention (beta = -sign(alpha) * norm, v(0) = 1), the
 * matrix replaced by its first cols columns of Q. */
static void ref_qr(double *a, size_t rows, size_t cols) {
  double *v = calloc(rows * cols + 1, sizeof(double)), *tau = calloc(cols + 1, sizeof(double));
  double *R = malloc(rows * cols * sizeof(double) + 8);
  memcpy(R, a, rows * cols * sizeof(double));
  for (size_t k = 0; k < cols; k++) {
    double alpha = R[k * cols + k], xn = 0;
    for (size_t i = k + 1; i < rows; i++) xn += R[i * cols + k] * R[i * cols + k];
    if (xn == 0) {
      tau[k] = 0;
      v[k * cols + k] = 1;
      continue;
    }
    double beta = -copysign(sqrt(alpha * alpha + xn), alpha);
    tau[k] = (beta - alpha) / beta;
    v[k * cols + k] = 1;
    for (size_t i = k + 1; i < rows; i++) v[i * cols + k] = R[i * cols + k] / (alpha - beta);
    for (size_t j = k; j < cols; j++) {
      double d = 0;
      for (size_t i = k; i < rows; i++) d += v[i * cols + k] * R[i * cols + j];
      for (size_t i = k; i < rows; i++) R[i * cols + j] -= tau[k] * d * v[i * cols + k];
    }
  }
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) a[i * cols + j] = i == j ? 1.0 : 0.0;
  for (size_t kk = cols; kk-- > 0;) {
    for (size_t j = 0; j < cols; j++) {
      double d = 0;
      for (size_t i = kk; i < rows; i++) d += v[i * cols + kk] * a[i * cols + j];
      for (size_t i = kk; i < rows; i++) a[i * cols + j] -= tau[kk] * d * v[i * cols + kk];
    }
  }
  free(v);
  free(tau);
  free(R);
}

static void ref_orth(double *a, size_t rows, size_t cols, double eps) {
  if (cols <= 2 || rows < cols)
    ref_mgs(a, rows, cols, eps);
  else
    ref_qr(a, rows, cols);
}

/* The whole W-rank powerSGD_hook for one bucket, serially in f64, one step at a time:
 * pref_step(P, t, out) is the result every rank should hold after step t. P carries the
 * per-rank error feedback, the warm-start Q and the count of random Q draws between steps,
 * in f64, unless the caller overwrites them before a step (pref_seed). Q's random start:
 * normals of the counter-based generator keyed (random_seed, DDP_RNG_POWERSGD stream of
 * the draw number). */
typedef struct pref {
  const run_t *R;
  size_t numel;
  double in[MAXW][MAXN], cp[MAXW][MAXN];
  double err[MAXW][MAXN];
  double Qs[MAXN], Ps[MAXN];
  bool has_err, has_mem;
  uint64_t draws;
  /* layout: compressed matrices grouped by shape in order of first appearance */
  size_t off[8], n[8], m[8], rk[8], poff[8], qoff[8], order[8], nord, np, nq;
  bool comp[8];
} pref_t;

static void pref_init(pref_t *P, const run_t *R) {
  const ddp_powersgd_options_t *o = &R->popts;
  const layout_t *l = &R->layout;
  memset(P, 0, sizeof *P);
  P->R = R;
  P->numel = layout_numel(l);
  size_t pos = 0;
  for (size_t k = 0; k < l->nparams; k++) {
    P->n[k] = (size_t)l->shape[k][0];
    P->m[k] = l->shape[k][1] ? (size_t)l->shape[k][1] : 1;
    P->off[k] = pos;
    pos += P->n[k] * P->m[k];
    size_t r = P->n[k] < P->m[k] ? P->n[k] : P->m[k];
    if ((size_t)o->matrix_approximation_rank < r) r = (size_t)o->matrix_approximation_rank;
    P->rk[k] = r;
    P->comp[k] = (double)(P->n[k] + P->m[k]) * (double)r * o->min_compression_rate <
                 (double)(P->n[k] * P->m[k]);
  }
  bool used[8] = {false};
  for (size_t i = 0; i < l->nparams; i++) {
    if (!P->comp[i] || used[i]) continue;
    for (size_t j = i; j < l->nparams; j++)
      if (P->comp[j] && !used[j] && P->n[j] == P->n[i] && P->m[j] == P->m[i]) {
        used[j] = true;
        P->order[P->nord++] = j;
        P->poff[j] = P->np;
        P->qoff[j] = P->nq;
        P->np += P->n[j] * P->rk[j];
        P->nq += P->m[j] * P->rk[j];
      }
  }
}

/* Replaces P's carried state with libddp's own just before step t (R's snapshots): every
 * rank's error feedback and the warm-start Q, widened. The Q memory is the allreduced
 * average, so every rank must hold the same bits. The draw count stays the reference's. */
static void pref_seed(pref_t *P, int t) {
  const run_t *R = P->R;
  int W = R->world;
  P->has_err = R->snap_nerr[0][t] != 0;
  P->has_mem = R->snap_nq[0][t] != 0;
  for (int r = 0; r < W; r++) {
    assert_int_equal(R->snap_nerr[r][t], P->has_err ? P->numel : 0);
    assert_int_equal(R->snap_nq[r][t], P->has_mem ? P->nq : 0);
    for (size_t i = 0; i < R->snap_nerr[r][t]; i++) P->err[r][i] = R->snap_err[r][t][i];
    if (r > 0) assert_memory_equal(R->snap_q[r][t], R->snap_q[0][t], R->snap_nq[0][t] * 4);
  }
  for (size_t i = 0; i < R->snap_nq[0][t]; i++) P->Qs[i] = R->snap_q[0][t][i];
}

/* Adds to Y, over every rank r and compressed matrix k, M X (tr false: Y n x rk, X m x rk)
 * or M^T X (tr true: Y m x rk, X n x rk), where M is rank r's n x m input at off[k]; X and Y
 * are row-major at xoff[k] and yoff[k]. Each entry's sum runs over the inner index in
 * increasing order, then adds to Y rank by rank: the order the f64 reference fixes. */
static void pref_project(pref_t *P, bool tr, const double *X, const size_t *xoff, double *Y,
                         const size_t *yoff) {
  for (int r = 0; r < P->R->world; r++)
    for (size_t j = 0; j < P->nord; j++) {
      size_t k = P->order[j], m = P->m[k], rk = P->rk[k];
      size_t rows = tr ? m : P->n[k], inner = tr ? P->n[k] : m;
      for (size_t a = 0; a < rows; a++)
        for (size_t c = 0; c < rk; c++) {
          double s = 0;
          for (size_t b = 0; b < inner; b++)
            s += P->in[r][P->off[k] + (tr ? b * m + a : a * m + b)] * X[xoff[k] + b * rk + c];
          Y[yoff[k] + a * rk + c] += s;
        }
    }
}

static void pref_step(pref_t *P, int t, double *out) {
  const run_t *R = P->R;
  const ddp_powersgd_options_t *o = &R->popts;
  int W = R->world;
  size_t numel = P->numel, nq = P->nq, nord = P->nord;
  const size_t *n = P->n, *m = P->m, *rk = P->rk, *off = P->off, *poff = P->poff, *qoff = P->qoff,
               *order = P->order;
  double *Qs = P->Qs, *Ps = P->Ps;
  if (t < o->start_powerSGD_iter) {
    for (size_t i = 0; i < numel; i++) out[i] = serial_allreduce(W, t, i);
    return;
  }
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < numel; i++) {
      P->in[r][i] = grad_value(r, t, i);
      if (o->use_error_feedback && P->has_err) P->in[r][i] += P->err[r][i];
      P->cp[r][i] = P->in[r][i];
    }
  P->has_err = o->use_error_feedback;
  bool need = !o->warm_start || !P->has_mem;
  if (need && o->init_q) {
    static float qf[MAXN];
    o->init_q(o->init_q_user, P->draws++, 0, qf, nq);
    for (size_t i = 0; i < nq; i++) Qs[i] = qf[i];
    P->has_mem = true;
  } else if (need) {
    ddp_rng_t g;
    ddp_rng_init(&g, o->random_seed, ddp_rng_stream(DDP_RNG_POWERSGD, 0, P->draws++));
    for (size_t i = 0; i < nq; i++) Qs[i] = ddp_rng_normal(&g);
    P->has_mem = true;
  }
  for (size_t j = 0; j < nord; j++) {
    size_t k = order[j];
    ref_orth(Qs + qoff[k], m[k], rk[k], o->orthogonalization_epsilon);
  }
  /* uncompressed: exact mean */
  for (size_t k = 0; k < R->layout.nparams; k++) {
    if (P->comp[k]) continue;
    for (size_t i = off[k]; i < off[k] + n[k] * m[k]; i++) {
      double s = 0;
      for (int r = 0; r < W; r++) s += P->in[r][i];
      out[i] = s / W;
    }
  }
  memset(Ps, 0, sizeof P->Ps);
  pref_project(P, false, Qs, qoff, Ps, poff);
  for (size_t j = 0; j < nord; j++) {
    size_t k = order[j];
    ref_orth(Ps + poff[k], n[k], rk[k], o->orthogonalization_epsilon);
  }
  memset(Qs, 0, sizeof P->Qs);
  pref_project(P, true, Ps, poff, Qs, qoff);
  for (size_t i = 0; i < nq; i++) Qs[i] /= W;
  for (size_t j = 0; j < nord; j++) {
    size_t k = order[j];
    for (size_t a = 0; a < n[k]; a++)
      for (size_t b2 = 0; b2 < m[k]; b2++) {
        double s = 0;
        for (size_t c = 0; c < rk[k]; c++)
          s += Ps[poff[k] + a * rk[k] + c] * Qs[qoff[k] + b2 * rk[k] + c];
        out[off[k] + a * m[k] + b2] = s;
      }
  }
  for (int r = 0; r < W; r++)
    for (size_t i = 0; i < numel; i++) P->err[r][i] = P->cp[r][i] - out[i];
  if (!o->warm_start) P->has_mem = false;
}

/* Relative l2 error of every rank's step-t result against ref, over all ranks. */
static double rel_error(const run_t *R, int t, const double *ref) {
  double num = 0, den = 0;
  size_t numel = layout_numel(&R->layout);
  for (int r = 0; r < R->world; r++)
    for (size_t i = 0; i < numel; i++) {
      double d = R->out[r][t][i] - ref[i];
      num += d * d;
      den += ref[i] * ref[i];
    }
  return sqrt(num / den);
}

/* An injected Q start (as a parity run would inject PyTorch's). */
static void inject_q(void *user, uint64_t draw, size_t bucket, float *q, size_t n) {
  (void)user;
  (void)bucket;
  for (size_t i = 0; i < n; i++) q[i] = (float)cos(0.3 * (double)i + 1.1 * (double)draw);
}

/* Worst per-step (seeded) and drift relative errors seen by test_powersgd_serial. */
typedef struct psgd_worst {
  double step[8], drift[8];
} psgd_worst_t;

/* Runs powerSGD_hook for 6 steps and checks it two ways. Per step: before every step the
 * f64 reference takes libddp's own carried state (each rank's error feedback and the
 * warm-start Q, read back through ddp_powersgd_state_save), so each comparison covers the
 * maths of one step alone and must hold to PSGD_STEP_TOL. Drift: the reference runs free
 * from the same start with its own f64 carried state, bounding how far the f32 trajectory
 * wanders over several steps (PSGD_DRIFT_TOL). */
static void check_powersgd(int W, int64_t rank, bool warm, double rate, int64_t start, bool inject,
                           psgd_worst_t *worst) {
  static run_t R;
  static pref_t P;
  static double ref[MAXN];
  memset(&R, 0, sizeof R);
  R.kind = H_PSGD;
  R.world = W;
  R.steps = 6;
  R.layout = mixed_layout();
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  o.matrix_approximation_rank = rank;
  o.start_powerSGD_iter = start;
  o.warm_start = warm;
  o.min_compression_rate = rate;
  o.random_seed = 7;
  if (inject) o.init_q = inject_q;
  R.popts = o;
  char dir[] = "/tmp/ddp-test-hooks-XXXXXX";
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  R.snap_dir = dir;
  run_hook(&R);
  assert_int_equal(rmdir(dir), 0);
  size_t numel = layout_numel(&R.layout);
  bool verbose = getenv("HOOKS_VERBOSE") != NULL;

  /* per step, from libddp's carried state */
  pref_init(&P, &R);
  for (int t = 0; t < R.steps; t++) {
    if (t >= start) pref_seed(&P, t);
    pref_step(&P, t, ref);
    double rel = rel_error(&R, t, ref);
    if (rel > worst->step[t]) worst->step[t] = rel;
    if (verbose) {
      /* |input| / |result|: error feedback grows the input the rank-r result leaves out,
       * and the f32 rounding of the step scales with the input */
      double ni = 0, no = 0;
      for (size_t i = 0; i < numel; i++) {
        for (int r = 0; r < W; r++) ni += P.cp[r][i] * P.cp[r][i] / W;
        no += ref[i] * ref[i];
      }
      print_message("W=%d r=%lld warm=%d t=%d per-step rel=%.3g |input|/|result|=%.3g\n", W,
                    (long long)rank, warm, t, rel, t >= start ? sqrt(ni / no) : 1.0);
    }
    if (!(rel <= PSGD_STEP_TOL))
      fail_msg("W=%d rank=%lld warm=%d step %d from libddp's state: relative error %.3g", W,
               (long long)rank, warm, t, rel);
    for (int r = 0; r < W; r++) {
      if (t < start) /* warm-up: the allreduce hook, bitwise */
        for (size_t i = 0; i < numel; i++)
          DDP_ASSERT_SAME_BITS(R.out[r][t][i], (float)serial_allreduce(W, t, i));
      /* every rank holds the same bits */
      if (r > 0) assert_memory_equal(R.out[r][t], R.out[0][t], numel * 4);
    }
  }

  /* multi-step drift, the reference carrying its own state */
  pref_init(&P, &R);
  for (int t = 0; t < R.steps; t++) {
    pref_step(&P, t, ref);
    double rel = rel_error(&R, t, ref);
    if (rel > worst->drift[t]) worst->drift[t] = rel;
    if (verbose)
      print_message("W=%d r=%lld warm=%d t=%d drift rel=%.3g\n", W, (long long)rank, warm, t, rel);
    if (!(rel <= PSGD_DRIFT_TOL(t, start)))
      fail_msg("W=%d rank=%lld warm=%d step %d, multi-step drift: relative error %.3g", W,
               (long long)rank, warm, t, rel);
  }
  for (int r = 0; r < W; r++) {
    assert_int_equal(R.nallreduce[r], start + 3 * (R.steps - start));
    assert_int_equal(R.iter[r], R.steps);
    assert_int_equal(R.draws[r], P.draws); /* the reference's free run drew as often */
  }
}

/* powerSGD_hook against the serial f64 computation: rank 1 and 2 (Gram-Schmidt) and 4
 * (Householder QR), warm start on and off, W = 1..3. */
static void test_powersgd_serial(void **state) {
  (void)state;
  psgd_worst_t worst;
  memset(&worst, 0, sizeof worst);
  for (int W = 1; W <= 3; W++) {
    check_powersgd(W, 1, true, 2.0, 2, false, &worst);
    check_powersgd(W, 2, false, 2.0, 2, false, &worst);
    check_powersgd(W, 4, true, 1.0, 3, false, &worst);
    check_powersgd(W, 4, false, 2.0, 2, false, &worst);
    check_powersgd(W, 2, false, 2.0, 2, true, &worst);
  }
  for (int t = 0; t < 6; t++)
    print_message("PowerSGD step %d: worst relative error per step %.3g, multi-step drift %.3g\n",
                  t, worst.step[t], worst.drift[t]);
}

/* A bucket of vectors only: nothing is compressed, P and Q are empty, still 3 allreduces;
 * the result is the exact mean. */
static void test_powersgd_empty_collectives(void **state) {
  (void)state;
  static run_t R;
  memset(&R, 0, sizeof R);
  R.kind = H_PSGD;
  R.world = 3;
  R.steps = 4;
  R.layout = (layout_t){2, {{7, 0}, {3, 0}}};
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  o.start_powerSGD_iter = 2;
  R.popts = o;
  run_hook(&R);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(R.nallreduce[r], 2 + 3 * 2);
    assert_int_equal(R.stats[r].numel_before, R.stats[r].numel_after);
  }
  for (size_t i = 0; i < 10; i++) {
    double s = 0;
    for (int r = 0; r < 3; r++) s += (float)grad_value(r, 3, i);
    assert_true(fabs(R.out[0][3][i] - s / 3) <= 1e-6 * (fabs(s) + 1));
  }
}

/* batched_powerSGD_hook: 2 allreduces per bucket after warm-up, identical on every rank,
 * reported numel L before and 2 s r after. */
static void test_batched_powersgd(void **state) {
  (void)state;
  static run_t R;
  memset(&R, 0, sizeof R);
  R.kind = H_BPSGD;
  R.world = 2;
  R.steps = 4;
  R.layout = mixed_layout();
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  o.start_powerSGD_iter = 2;
  o.matrix_approximation_rank = 2;
  R.popts = o;
  run_hook(&R);
  size_t L = layout_numel(&R.layout), s = (size_t)ceil(sqrt((double)L));
  assert_int_equal(R.nallreduce[0], 2 + 2 * 2);
  assert_int_equal(R.stats[0].numel_before, (int64_t)(4 * L));
  assert_int_equal(R.stats[0].numel_after, (int64_t)(2 * L + 2 * 2 * s * 2));
  assert_memory_equal(R.out[0][3], R.out[1][3], L * 4);
  /* the estimate has rank <= 2 and is close to the mean in norm (a real approximation) */
  double num = 0, den = 0;
  for (size_t i = 0; i < L; i++) {
    double mean = ((double)grad_value(0, 2, i) + grad_value(1, 2, i)) / 2;
    num += (R.out[0][2][i] - mean) * (R.out[0][2][i] - mean);
    den += mean * mean;
  }
  assert_true(num < den);
}

/* PowerSGDState's own check, with PyTorch's text. */
static void test_powersgd_state_errors(void **state) {
  (void)state;
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  ddp_powersgd_state_t *s = NULL;
  ddp_error_t err = {0};
  assert_int_equal(o.start_powerSGD_iter, 1000);
  assert_int_equal(o.matrix_approximation_rank, 1);
  o.start_powerSGD_iter = 1;
  assert_int_equal(ddp_powersgd_state_create(&o, 0, &s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "Expect `start_powerSGD_iter` > 1 if `use_error_feedback`"));
  o.use_error_feedback = o.warm_start = false;
  assert_int_equal(ddp_powersgd_state_create(&o, 0, &s, &err), DDP_OK);
  ddp_powersgd_state_destroy(s);
}

/* ---------------------------------------------------------------- configuration --- */

static void expect_cfg_error(const char *h, const char *w, const char *js, const char *needle) {
  ddp_error_t err = {0};
  assert_int_equal(ddp_hooks_validate(h, w, js, &err), DDP_ERR_INVALID_ARGUMENT);
  if (!strstr(err.msg, needle)) fail_msg("'%s' not in '%s'", needle, err.msg);
}

static void test_config_validation(void **state) {
  (void)state;
  ddp_error_t err = {0};
  const char *ok[][3] = {{"no", "no", NULL},
                         {"fp16", NULL, ""},
                         {"bf16", "fp16", "{}"},
                         {"power_sgd", "bf16", "{\"matrix_approximation_rank\": 4}"},
                         {"batched_power_sgd", "fp16",
                          "{\"start_powerSGD_iter\": 5, \"warm_start\": false, "
                          "\"min_compression_rate\": 1.5, \"random_seed\": 3, "
                          "\"use_error_feedback\": true, \"orthogonalization_epsilon\": 1e-8, "
                          "\"compression_stats_logging_frequency\": 0, "
                          "\"batch_tensors_with_same_shape\": true}"}};
  for (size_t i = 0; i < 5; i++)
    assert_int_equal(ddp_hooks_validate(ok[i][0], ok[i][1], ok[i][2], &err), DDP_OK);
  /* allreduce: PyTorch's allreduce_hook, so that a wrapper can go around plain allreduce. */
  assert_int_equal(ddp_hooks_validate("allreduce", "fp16", NULL, &err), DDP_OK);
  expect_cfg_error("allreduce", "no", "{\"matrix_approximation_rank\": 2}",
                   "power_sgd or batched_power_sgd");
  expect_cfg_error("fp32", "no", NULL, "no, fp16, bf16, power_sgd, batched_power_sgd");
  expect_cfg_error("fp16", "int8", NULL, "valid choices: no, fp16, bf16");
  expect_cfg_error("no", "fp16", NULL, "needs a comm_hook");
  expect_cfg_error("power_sgd", "no", "{\"rank\": 2}",
                   "matrix_approximation_rank, start_powerSGD_iter");
  expect_cfg_error("power_sgd", "no", "{\"matrix_approximation_rank\": 0}",
                   "matrix_approximation_rank must be");
  expect_cfg_error("power_sgd", "no", "{\"warm_start\": 1}", "true or false");
  expect_cfg_error("power_sgd", "no", "[1]", "JSON object");
  expect_cfg_error("power_sgd", "no", "{\"start_powerSGD_iter\": 1}",
                   "Expect `start_powerSGD_iter` > 1");
  expect_cfg_error("fp16", "no", "{\"matrix_approximation_rank\": 2}",
                   "power_sgd or batched_power_sgd");
}

/* The factory: "no" builds nothing; a simple hook has stats but no state to save; the
 * PowerSGD hooks expose their state through ddp_hooks_powersgd and save / load it through
 * the generic callbacks, in ddp_powersgd_state_save's format; a failure leaves *out zero. */
static void test_factory(void **state) {
  (void)state;
  ddp_error_t err = {0};
  ddp_comm_hook_t h;
  memset(&h, 0xff, sizeof h);
  assert_int_equal(ddp_hooks_create("no", NULL, NULL, 0, &h, &err), DDP_OK);
  assert_null(h.fn);
  assert_null(h.state);
  assert_int_equal(ddp_hooks_create("fp16", "no", NULL, 0, &h, &err), DDP_OK);
  assert_non_null(h.fn);
  assert_string_equal(h.name, "fp16_compress_hook");
  assert_non_null(h.stats);
  assert_non_null(h.free_state);
  assert_null(h.save_state);
  assert_null(h.load_state);
  assert_null(ddp_hooks_powersgd(&h));
  h.free_state(h.state);
  memset(&h, 0xff, sizeof h);
  assert_int_equal(ddp_hooks_create("power_sgd", "no", "{\"start_powerSGD_iter\": 1}", 0, &h, &err),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_null(h.fn);
  assert_null(h.state);
  const char *js = "{\"matrix_approximation_rank\": 2, \"start_powerSGD_iter\": 3}";
  assert_int_equal(ddp_hooks_create("batched_power_sgd", "bf16", js, 0, &h, &err), DDP_OK);
  assert_string_equal(h.name, "bf16_compress_wrapper(batched_powerSGD_hook)");
  ddp_powersgd_state_t *ps = ddp_hooks_powersgd(&h);
  assert_non_null(ps);
  assert_non_null(h.save_state);
  assert_non_null(h.load_state);
  /* A user hook around the same function is not the factory's: no PowerSGD state. */
  ddp_comm_hook_t user = {.fn = ddp_powersgd_hook, .state = ps, .name = "powerSGD_hook"};
  assert_null(ddp_hooks_powersgd(&user));
  char dir[] = "/tmp/ddp-test-hooks-XXXXXX", path[64];
  ddp_test_mkdtemp(dir); /* removed at exit, also on failure */
  snprintf(path, sizeof path, "%s/state.safetensors", dir);
  assert_int_equal(h.save_state(h.state, path, &err), DDP_OK);
  assert_int_equal(h.load_state(h.state, path, &err), DDP_OK);
  assert_int_equal(ddp_powersgd_iter(ps), 0);
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  o.matrix_approximation_rank = 2;
  o.start_powerSGD_iter = 3;
  ddp_powersgd_state_t *direct = NULL;
  assert_int_equal(ddp_powersgd_state_create(&o, 0, &direct, &err), DDP_OK);
  assert_int_equal(ddp_powersgd_state_load(direct, path, &err), DDP_OK);
  ddp_powersgd_state_destroy(direct);
  unlink(path);
  assert_int_equal(h.load_state(h.state, path, &err), DDP_ERR_NOT_FOUND);
  h.free_state(h.state);
}

/* ---------------------------------------------------------------- DDP -------------- */

#define DIM 16
#define HID 64
#define NCLS 4
#define BATCH 16

typedef struct train {
  const char *hook, *wrapper, *state;
  int world, steps;
  float loss[MAXW]; /* mean loss of the last 10 steps on rank 0's view */
  ddp_ddp_comm_stats_t stats[MAXW];
  char msg[MAXW][512];
  ddp_status_t st[MAXW];
  int mode; /* 0 train; 1 register twice; 2 wrong-length hook; 3 register after a step */
} train_t;

static ddp_status_t build(ddp_model_t **out) {
  ddp_model_t *m = NULL;
  ddp_module_t *seq, *l0, *a, *l1;
  DDP_CHECK(ddp_model_create(&m));
  ddp_status_t st;
  DDP_CHECK_GOTO(ddp_module_sequential(m, &seq), st, fail);
  DDP_CHECK_GOTO(ddp_module_linear(m, "0", DIM, HID, true, DDP_F32, &l0), st, fail);
  DDP_CHECK_GOTO(ddp_module_activation(m, DDP_ACT_RELU, &a), st, fail);
  DDP_CHECK_GOTO(ddp_module_linear(m, "2", HID, NCLS, true, DDP_F32, &l1), st, fail);
  DDP_CHECK_GOTO(ddp_module_append(seq, l0), st, fail);
  DDP_CHECK_GOTO(ddp_module_append(seq, a), st, fail);
  DDP_CHECK_GOTO(ddp_module_append(seq, l1), st, fail);
  ddp_model_set_root(m, seq);
  DDP_CHECK_GOTO(ddp_model_finalize(m), st, fail);
  DDP_CHECK_GOTO(ddp_model_init(m, 5), st, fail);
  *out = m;
  return DDP_OK;
fail:
  ddp_model_destroy(m);
  return st;
}

/* A hook that resolves to one element too few. */
static ddp_status_t short_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               ddp_comm_work_t **out) {
  (void)state;
  DDP_CHECK(ddp_allreduce_hook(NULL, pg, b, out));
  ddp_comm_work_set_result(*out, b->buffer, b->numel - 1, b->dtype);
  return DDP_OK;
}

/* What the DDP rank functions below share: the model under DDP, an autograd context, a
 * synthetic mixture data set and one batch's tensors. */
typedef struct hrank {
  ddp_model_t *m;
  ddp_ddp_t *ddp;
  ddp_ctx_t *ctx;
  ddp_dataset_t *ds;
  int64_t nsamples;
  ddp_tensor_t xb, yb;
  ddp_error_t err;
} hrank_t;

/* Builds the model with DDP over it (bucket_cap_mb cap_mb; <= 0: the default), the context,
 * a mixture of n samples from seed and the batch tensors. h starts zeroed; hrank_close
 * frees what was made, also after a failure. */
static ddp_status_t hrank_open(hrank_t *h, ddp_pg_t *pg, double cap_mb, uint64_t seed, int64_t n) {
  DDP_CHECK(build(&h->m));
  ddp_ddp_options_t dopts = DDP_DDP_OPTIONS_INIT;
  if (cap_mb > 0) dopts.bucket_cap_mb = cap_mb;
  DDP_CHECK(ddp_ddp_create(h->m, pg, &dopts, &h->ddp, &h->err));
  DDP_CHECK(ddp_ctx_create(&h->ctx));
  ddp_synth_mixture_t sm = {seed, n, DIM, NCLS, 0.4f};
  DDP_CHECK(ddp_dataset_synthetic_mixture(&sm, &h->ds, &h->err));
  h->nsamples = n;
  int64_t xs[2] = {BATCH, DIM}, ys[1] = {BATCH};
  DDP_CHECK(ddp_tensor_alloc(&h->xb, DDP_F32, 2, xs));
  return ddp_tensor_alloc(&h->yb, DDP_I64, 1, ys);
}

static void hrank_close(hrank_t *h) {
  ddp_tensor_free(&h->xb);
  ddp_tensor_free(&h->yb);
  ddp_dataset_destroy(h->ds);
  ddp_ctx_destroy(h->ctx);
  ddp_ddp_destroy(h->ddp);
  ddp_model_destroy(h->m);
}

/* Loads rank r's share of step t's global batch (W ranks, BATCH rows each, wrapping). */
static ddp_status_t hrank_batch(hrank_t *h, int t, int r, int W) {
  int64_t idx[BATCH];
  for (int i = 0; i < BATCH; i++)
    idx[i] = ((int64_t)t * W * BATCH + (int64_t)r * BATCH + i) % h->nsamples;
  return ddp_dataset_get_batch(h->ds, idx, BATCH, &h->xb, &h->yb, &h->err);
}

/* The cross-entropy loss of the loaded batch, forward through DDP, or through plain (a
 * model outside DDP) when it is not NULL. */
static ddp_status_t hrank_loss(hrank_t *h, ddp_model_t *plain, ddp_var_t **loss) {
  int64_t xs[2] = {BATCH, DIM}, ys[1] = {BATCH};
  ddp_var_t *vx, *vy, *y;
  DDP_CHECK(ddp_var_new(h->ctx, DDP_F32, 2, xs, h->xb.data, false, &vx));
  DDP_CHECK(ddp_var_new(h->ctx, DDP_I64, 1, ys, h->yb.data, false, &vy));
  if (plain)
    DDP_CHECK(ddp_model_forward(plain, h->ctx, vx, 0, &y));
  else
    DDP_CHECK(ddp_ddp_forward(h->ddp, h->ctx, vx, 0, &y));
  return ddp_cross_entropy(h->ctx, y, vy, -100, loss);
}

/* Copies every parameter's gradient of m, in order, into dst. */
static void copy_grads(ddp_model_t *m, float *dst) {
  for (size_t i = 0, pos = 0; i < ddp_model_num_params(m); i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    memcpy(dst + pos, p->grad.data, (size_t)p->grad.numel * 4);
    pos += (size_t)p->grad.numel;
  }
}

/* Accelerate's names: the factory builds the hook, the caller registers it (and frees the
 * state when it was not registered). */
static ddp_status_t configure(ddp_ddp_t *ddp, int rank, const char *hook, const char *wrapper,
                              const char *state, ddp_error_t *err) {
  ddp_comm_hook_t h;
  DDP_CHECK(ddp_hooks_create(hook, wrapper, state, rank, &h, err));
  if (!h.fn) return DDP_OK;
  ddp_status_t st = ddp_ddp_register_comm_hook(ddp, &h, err);
  if (st != DDP_OK) h.free_state(h.state);
  return st;
}

static ddp_status_t train_rank(ddp_pg_t *pg, void *arg) {
  train_t *T = arg;
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  hrank_t h = {0};
  ddp_optim_t *opt = NULL;
  ddp_status_t st = hrank_open(&h, pg, 0, 11, 4096);
  if (st != DDP_OK) goto out;
  ddp_model_t *m = h.m;
  ddp_ddp_t *ddp = h.ddp;
  ddp_error_t *err = &h.err;
  ddp_optim_param_t ps[8];
  size_t np = 0;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ps[np].param = &ddp_model_param(m, i)->value;
    ps[np].grad = &ddp_model_param(m, i)->grad;
    np++;
  }
  ddp_optim_options_t so = DDP_SGD_OPTIONS_INIT;
  so.lr = 0.05;
  so.momentum = 0.9;
  DDP_CHECK_GOTO(ddp_optim_create(&so, ps, np, &opt, NULL), st, out);
  if (T->mode == 2) {
    ddp_comm_hook_t sh = {.fn = short_hook, .name = "short_hook"};
    DDP_CHECK_GOTO(ddp_ddp_register_comm_hook(ddp, &sh, err), st, out);
  } else {
    st = configure(ddp, r, T->hook, T->wrapper, T->state, err);
    if (st != DDP_OK) goto out;
  }
  if (T->mode == 1) {
    /* a second registration */
    st = configure(ddp, r, "fp16", "no", NULL, err);
    snprintf(T->msg[r], sizeof T->msg[r], "%.500s", err->msg);
    if (st != DDP_ERR_INVALID_USAGE) {
      st = DDP_ERR_INTERNAL;
      goto out;
    }
    st = DDP_OK;
  }
  double tail = 0;
  for (int t = 0; t < T->steps; t++) {
    ddp_var_t *loss;
    DDP_CHECK_GOTO(hrank_batch(&h, t, r, W), st, out);
    DDP_CHECK_GOTO(hrank_loss(&h, NULL, &loss), st, out);
    if (t >= T->steps - 10) tail += *(float *)loss->value.data;
    st = ddp_ddp_backward(ddp, h.ctx, loss);
    if (st != DDP_OK) {
      ddp_error_t de;
      ddp_ddp_last_error_copy(ddp, &de);
      snprintf(T->msg[r], sizeof T->msg[r], "%.511s", de.msg);
      goto out;
    }
    DDP_CHECK_GOTO(ddp_optim_step(opt, NULL), st, out);
    ddp_optim_zero_grad(opt, false);
    ddp_ctx_reset(h.ctx);
    if (T->mode == 3 && t == 0) {
      /* training has started: too late to register */
      ddp_status_t s2 = configure(ddp, r, "fp16", "no", NULL, err);
      snprintf(T->msg[r], sizeof T->msg[r], "%.500s", err->msg);
      if (s2 != DDP_ERR_INVALID_USAGE) {
        st = DDP_ERR_INTERNAL;
        goto out;
      }
    }
  }
  T->loss[r] = (float)(tail / 10);
  ddp_ddp_get_comm_stats(ddp, &T->stats[r]);
out:
  T->st[r] = st;
  ddp_optim_destroy(opt);
  hrank_close(&h);
  return st;
}

/* PowerSGD rank 4 with error feedback ends within 5% of the no-hook loss; the reported
 * compression rate is recomputed from the layer shapes. */
static void test_convergence_and_rate(void **state) {
  (void)state;
  static train_t base, ps;
  memset(&base, 0, sizeof base);
  memset(&ps, 0, sizeof ps);
  base.hook = "no";
  base.world = ps.world = 2;
  base.steps = ps.steps = 150;
  assert_int_equal(ddp_spawn_threads(2, NULL, train_rank, &base), DDP_OK);
  ps.hook = "power_sgd";
  ps.state = "{\"matrix_approximation_rank\": 4, \"start_powerSGD_iter\": 10}";
  assert_int_equal(ddp_spawn_threads(2, NULL, train_rank, &ps), DDP_OK);
  print_message("no hook loss %.5f, PowerSGD rank 4 loss %.5f, rate %.3f, bytes/step %lld vs "
                "%lld\n",
                (double)base.loss[0], (double)ps.loss[0], ps.stats[0].rate,
                (long long)ps.stats[0].bytes_last_step, (long long)base.stats[0].bytes_last_step);
  assert_true(base.loss[0] < 1.0f); /* it learned something */
  assert_true(fabs(ps.loss[0] - base.loss[0]) <= 0.05 * base.loss[0]);
  /* Shapes: 0.weight [HID, DIM], 0.bias [HID], 2.weight [NCLS, HID], 2.bias [NCLS]; r = 4. */
  int64_t shp[4][2] = {{HID, DIM}, {HID, 1}, {NCLS, HID}, {NCLS, 1}};
  int64_t before = 0, after = 0, total = 0;
  for (int k = 0; k < 4; k++) {
    int64_t n = shp[k][0], mm = shp[k][1], rr = n < mm ? n : mm;
    if (rr > 4) rr = 4;
    total += n * mm;
    before += n * mm;
    after += (n + mm) * rr * 2 < n * mm ? (n + mm) * rr : n * mm;
  }
  int64_t comp_steps = ps.steps - 10;
  assert_int_equal(ps.stats[0].numel_before, 10 * total + comp_steps * before);
  assert_int_equal(ps.stats[0].numel_after, 10 * total + comp_steps * after);
  double want = (double)(10 * total + comp_steps * before) /
                (double)(10 * total + comp_steps * after);
  assert_true(fabs(ps.stats[0].rate - want) < 1e-12);
  assert_true(ps.stats[0].bytes_last_step < base.stats[0].bytes_last_step);
  assert_int_equal(base.stats[0].bytes_last_step, total * 4);
}

/* ---------------------------------------------------------------- DDP gradients --- */

#define NPARAM_ELEMS (DIM * HID + HID + HID * NCLS + NCLS)

typedef struct grads {
  const char *hook, *wrapper, *state; /* configure names; NULL hook: the allreduce hook */
  const char *backend;                /* fork mode: shm or tcp */
  double cap_mb;
  int steps;
  float local[MAXW][4][NPARAM_ELEMS];
  float synced[MAXW][4][NPARAM_ELEMS];
  size_t nbuckets[MAXW];
  bool join; /* ranks > 0 run one step, then join() shadows the rest */
  ddp_status_t st[MAXW];
} grads_t;

/* Each step: the local gradient on a plain copy of the model, then the DDP gradient on the
 * same batch (no optimizer step, so both models keep the same weights). */
static ddp_status_t grads_core(ddp_pg_t *pg, grads_t *G, float (*local)[NPARAM_ELEMS],
                               float (*synced)[NPARAM_ELEMS]) {
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  hrank_t h = {0};
  ddp_model_t *plain = NULL;
  ddp_status_t st;
  DDP_CHECK_GOTO(hrank_open(&h, pg, G->cap_mb, 3, 1024), st, out);
  DDP_CHECK_GOTO(build(&plain), st, out);
  ddp_ddp_t *ddp = h.ddp;
  if (G->hook) {
    DDP_CHECK_GOTO(configure(ddp, r, G->hook, G->wrapper, G->state, &h.err), st, out);
  } else {
    ddp_comm_hook_t ar = {.fn = ddp_allreduce_hook, .name = "allreduce_hook"};
    DDP_CHECK_GOTO(ddp_ddp_register_comm_hook(ddp, &ar, &h.err), st, out);
  }
  if (G->join) DDP_CHECK_GOTO(ddp_ddp_join_begin(ddp, true, false), st, out);
  for (int t = 0; t < (G->join && r > 0 ? 1 : G->steps); t++) {
    DDP_CHECK_GOTO(hrank_batch(&h, t, r, W), st, out);
    for (int pass = 0; pass < 2; pass++) {
      ddp_model_t *mm = pass == 0 ? plain : h.m;
      ddp_var_t *loss;
      ddp_model_zero_grad(mm);
      DDP_CHECK_GOTO(hrank_loss(&h, pass == 0 ? plain : NULL, &loss), st, out);
      if (pass == 0)
        DDP_CHECK_GOTO(ddp_backward(h.ctx, loss), st, out);
      else
        DDP_CHECK_GOTO(ddp_ddp_backward(ddp, h.ctx, loss), st, out);
      ddp_ctx_reset(h.ctx);
      copy_grads(mm, pass == 0 ? local[t] : synced[t]);
    }
  }
  if (G->join) DDP_CHECK_GOTO(ddp_ddp_join_end(ddp), st, out);
  G->nbuckets[r] = ddp_ddp_num_buckets(ddp);
out:
  if (st != DDP_OK) {
    ddp_error_t de = {0};
    if (h.ddp) ddp_ddp_last_error_copy(h.ddp, &de);
    fprintf(stderr, "rank %d: %s %s\n", r, h.err.msg, de.msg);
  }
  hrank_close(&h);
  ddp_model_destroy(plain);
  return st;
}

static ddp_status_t grads_rank(ddp_pg_t *pg, void *arg) {
  grads_t *G = arg;
  int r = ddp_pg_rank(pg);
  G->st[r] = grads_core(pg, G, G->local[r], G->synced[r]);
  return G->st[r];
}

/* A forked rank on the shm or tcp backend: puts its synchronised gradients. */
static int grads_fork_rank(ddp_test_rank_t *tr, void *arg) {
  grads_t *G = arg;
  int r = ddp_test_rank(tr);
  ddp_store_t *store = NULL;
  ddp_pg_t *pg = NULL;
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = 20000;
  so.rank = r;
  ddp_status_t st = ddp_store_create_file(ddp_test_dir(tr), &so, &store, NULL);
  if (st != DDP_OK) return st;
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = G->backend;
  o.rank = r;
  o.world = ddp_test_world_size(tr);
  o.store = store;
  o.timeout_ms = 20000;
  o.shm_heap_bytes = 16u << 20;
  ddp_error_t err = {0};
  st = ddp_pg_create(&o, &pg, &err);
  if (st == DDP_OK) {
    st = grads_core(pg, G, G->local[0], G->synced[0]);
    if (st == DDP_OK && !ddp_test_put(tr, G->synced[0], sizeof G->synced[0])) st = DDP_ERR_INTERNAL;
  } else {
    ddp_test_say(tr, "pg create: %s", err.msg);
  }
  ddp_pg_destroy(pg);
  ddp_store_destroy(store);
  return st;
}

/* Through the reducer, several buckets: the allreduce, fp16 and bf16 hooks give exactly the
 * serial fold of the ranks' local gradients; PowerSGD runs with every layout and leaves
 * identical gradients on every rank. */
static void test_ddp_hooks_bitwise(void **state) {
  (void)state;
  static grads_t G;
  const char *hooks[] = {NULL, "fp16", "bf16", "power_sgd"};
  for (int W = 2; W <= 3; W++)
    for (int h = 0; h < 4; h++) {
      memset(&G, 0, sizeof G);
      G.hook = hooks[h];
      G.state = h == 3 ? "{\"start_powerSGD_iter\": 2, \"matrix_approximation_rank\": 2}" : NULL;
      G.cap_mb = 0.0002; /* 210 bytes: three buckets */
      G.steps = 4;
      assert_int_equal(ddp_spawn_threads(W, NULL, grads_rank, &G), DDP_OK);
      assert_true(G.nbuckets[0] >= 3);
      for (int t = 0; t < G.steps; t++)
        for (size_t i = 0; i < NPARAM_ELEMS; i++) {
          float want = 0;
          for (int r = 0; r < W; r++) {
            float g = G.local[r][t][i], c;
            if (h == 0 || (h == 3 && t < 2)) {
              c = g / (float)W;
              want = r == 0 ? c : want + c;
            } else if (h == 1) {
              c = h16(h16(g) / (float)W);
              want = r == 0 ? c : h16(want + c);
            } else if (h == 2) {
              c = hb16(hb16(g) / (float)W);
              want = r == 0 ? c : hb16(want + c);
            }
          }
          for (int r = 0; r < W; r++) {
            if (h == 3 && t >= 2) {
              DDP_ASSERT_SAME_BITS(G.synced[r][t][i], G.synced[0][t][i]);
              continue;
            }
            if (memcmp(&G.synced[r][t][i], &want, 4) != 0)
              fail_msg("hook %d W %d rank %d step %d elem %zu: %.9g vs %.9g", h, W, r, t, i,
                       (double)G.synced[r][t][i], (double)want);
          }
        }
    }
}

/* join() with the fp16 hook: the joined rank shadows with zero buckets through the hook,
 * so the active rank gets f16(f16(g)/2) + 0. */
static void test_join_with_hook(void **state) {
  (void)state;
  static grads_t G;
  memset(&G, 0, sizeof G);
  G.hook = "fp16";
  G.cap_mb = 0.0002;
  G.steps = 3;
  G.join = true;
  assert_int_equal(ddp_spawn_threads(2, NULL, grads_rank, &G), DDP_OK);
  for (int t = 0; t < 3; t++)
    for (size_t i = 0; i < NPARAM_ELEMS; i++) {
      float c0 = h16(h16(G.local[0][t][i]) / 2.0f);
      float want = t == 0 ? h16(c0 + h16(h16(G.local[1][t][i]) / 2.0f)) : c0;
      if (memcmp(&G.synced[0][t][i], &want, 4) != 0)
        fail_msg("step %d elem %zu: %.9g vs %.9g", t, i, (double)G.synced[0][t][i], (double)want);
    }
}

/* A user hook that counts its calls and delegates to allreduce_hook. */
typedef struct counting {
  int calls;
  int last_index;
} counting_t;

static ddp_status_t counting_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                  ddp_comm_work_t **out) {
  counting_t *c = state;
  c->calls++;
  c->last_index = (int)b->index;
  if (ddp_grad_bucket_gradient(b, 0) != b->buffer) return DDP_ERR_INTERNAL; /* view 0 at offset 0 */
  return ddp_allreduce_hook(NULL, pg, b, out);
}

typedef struct nosync {
  float local[MAXW][NPARAM_ELEMS], synced[MAXW][NPARAM_ELEMS];
  int calls[MAXW][3];
  size_t nbuckets[MAXW];
} nosync_t;

/* Step 0 under no_sync, step 1 synchronised: the hook runs only in step 1, once per
 * bucket, on the accumulated gradients. */
static ddp_status_t nosync_rank(ddp_pg_t *pg, void *arg) {
  nosync_t *N = arg;
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  hrank_t h = {0};
  ddp_model_t *plain = NULL;
  counting_t cnt = {0, -1};
  ddp_status_t st;
  DDP_CHECK_GOTO(hrank_open(&h, pg, 0.0002, 9, 512), st, out);
  DDP_CHECK_GOTO(build(&plain), st, out);
  ddp_ddp_t *ddp = h.ddp;
  ddp_comm_hook_t ch = {.fn = counting_hook, .state = &cnt, .name = "counting_hook"};
  DDP_CHECK_GOTO(ddp_ddp_register_comm_hook(ddp, &ch, &h.err), st, out);
  ddp_model_zero_grad(plain);
  ddp_model_zero_grad(h.m);
  for (int t = 0; t < 2; t++) {
    DDP_CHECK_GOTO(hrank_batch(&h, t, r, W), st, out);
    for (int pass = 0; pass < 2; pass++) {
      ddp_var_t *loss;
      if (pass == 1) ddp_ddp_set_sync(ddp, t == 1);
      DDP_CHECK_GOTO(hrank_loss(&h, pass == 0 ? plain : NULL, &loss), st, out);
      if (pass == 0)
        DDP_CHECK_GOTO(ddp_backward(h.ctx, loss), st, out);
      else
        DDP_CHECK_GOTO(ddp_ddp_backward(ddp, h.ctx, loss), st, out);
      ddp_ctx_reset(h.ctx);
    }
    N->calls[r][t] = cnt.calls;
  }
  copy_grads(plain, N->local[r]);
  copy_grads(h.m, N->synced[r]);
  N->nbuckets[r] = ddp_ddp_num_buckets(ddp);
  N->calls[r][2] = cnt.last_index;
out:
  hrank_close(&h);
  ddp_model_destroy(plain);
  return st;
}

static void test_user_hook_no_sync(void **state) {
  (void)state;
  static nosync_t N;
  memset(&N, 0, sizeof N);
  assert_int_equal(ddp_spawn_threads(3, NULL, nosync_rank, &N), DDP_OK);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(N.calls[r][0], 0);
    assert_int_equal(N.calls[r][1], (int)N.nbuckets[r]);
    assert_int_equal(N.calls[r][2], (int)N.nbuckets[r] - 1);
  }
  for (size_t i = 0; i < NPARAM_ELEMS; i++) {
    float want = 0;
    for (int r = 0; r < 3; r++) {
      float c = N.local[r][i] / 3.0f;
      want = r == 0 ? c : want + c;
    }
    for (int r = 0; r < 3; r++)
      if (memcmp(&N.synced[r][i], &want, 4) != 0)
        fail_msg("rank %d elem %zu: %.9g vs %.9g", r, i, (double)N.synced[r][i], (double)want);
  }
}

/* Every hook and wrapper gives the same bits on the threads, shm and tcp backends. */
static void test_backends_bitwise(void **state) {
  (void)state;
  static grads_t G, F;
  const char *cfgs[][3] = {{NULL, "no", NULL},
                           {"fp16", "no", NULL},
                           {"bf16", "no", NULL},
                           {"power_sgd", "no",
                            "{\"start_powerSGD_iter\": 2, \"matrix_approximation_rank\": 3}"},
                           {"batched_power_sgd", "no", "{\"start_powerSGD_iter\": 2}"},
                           {"power_sgd", "fp16",
                            "{\"start_powerSGD_iter\": 2, \"matrix_approximation_rank\": 2}"},
                           {"fp16", "bf16", NULL}};
  const char *backends[] = {"shm", "tcp"};
  for (size_t c = 0; c < sizeof cfgs / sizeof *cfgs; c++) {
    memset(&G, 0, sizeof G);
    G.hook = cfgs[c][0];
    G.wrapper = cfgs[c][1];
    G.state = cfgs[c][2];
    G.cap_mb = 0.0002;
    G.steps = 4;
    assert_int_equal(ddp_spawn_threads(3, NULL, grads_rank, &G), DDP_OK);
    for (int b = 0; b < 2; b++) {
      memcpy(&F, &G, sizeof F);
      F.backend = backends[b];
      ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
      o.world = 3;
      o.mode = DDP_TEST_FORK;
      o.timeout_ms = 30000;
      o.value_bytes = sizeof F.synced[0] + 64;
      ddp_test_results_t *res = ddp_test_spawn(&o, grads_fork_rank, &F);
      for (int r = 0; r < 3; r++) {
        const ddp_test_result_t *x = ddp_test_result(res, r);
        if (x->status != 0)
          fail_msg("%s %s rank %d: %s", cfgs[c][0] ? cfgs[c][0] : "allreduce", backends[b], r,
                   x->msg);
        assert_int_equal(x->nvalues, sizeof G.synced[0]);
        if (memcmp(x->values, G.synced[r], sizeof G.synced[0]) != 0)
          fail_msg("config %zu: %s differs from threads on rank %d", c, backends[b], r);
      }
      ddp_test_results_free(res);
    }
  }
}

/* Registering twice, and a hook whose result has the wrong length. */
static void test_registration_errors(void **state) {
  (void)state;
  static train_t T;
  memset(&T, 0, sizeof T);
  T.hook = "fp16";
  T.world = 2;
  T.steps = 2;
  T.mode = 1;
  assert_int_equal(ddp_spawn_threads(2, NULL, train_rank, &T), DDP_OK);
  assert_non_null(
      strstr(T.msg[0],
             "register_comm_hook or register_builtin_comm_hook can only be called once."));
  memset(&T, 0, sizeof T);
  T.hook = "no";
  T.world = 2;
  T.steps = 2;
  T.mode = 3;
  assert_int_equal(ddp_spawn_threads(2, NULL, train_rank, &T), DDP_OK);
  assert_non_null(strstr(T.msg[1], "must be called before the first backward"));
  memset(&T, 0, sizeof T);
  T.world = 2;
  T.steps = 1;
  T.mode = 2;
  assert_int_not_equal(ddp_spawn_threads(2, NULL, train_rank, &T), DDP_OK);
  if (!strstr(T.msg[0], "expected") || !strstr(T.msg[0], "element count"))
    fail_msg("message: %s", T.msg[0]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_default_hooks_bitwise),
      cmocka_unit_test(test_powersgd_serial),
      cmocka_unit_test(test_powersgd_empty_collectives),
      cmocka_unit_test(test_batched_powersgd),
      cmocka_unit_test(test_powersgd_state_errors),
      cmocka_unit_test(test_config_validation),
      cmocka_unit_test(test_factory),
      cmocka_unit_test(test_registration_errors),
      cmocka_unit_test(test_ddp_hooks_bitwise),
      cmocka_unit_test(test_backends_bitwise),
      cmocka_unit_test(test_user_hook_no_sync),
      cmocka_unit_test(test_join_with_hook),
      cmocka_unit_test(test_convergence_and_rate),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
