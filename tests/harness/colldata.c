/* Shared data for collective tests: see colldata.h. */
#include "colldata.h"

#include <stdio.h>
#include <string.h>

#include "ddp/common.h"

void ddp_test_d2_fill(ddp_dtype_t dt, void *p, size_t n, int rank, int salt) {
  ddp_rng_t g;
  ddp_rng_init(&g, 1234 + (uint64_t)salt, ddp_rng_stream(DDP_RNG_TEST, (uint32_t)rank, 0));
  for (size_t i = 0; i < n; i++) {
    float v = (ddp_rng_uniform(&g) - 0.5f) * 8.0f * (1.0f + (float)(i % 5));
    switch (dt) {
      case DDP_F32: ((float *)p)[i] = v; break;
      case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16(v); break;
      default: ((uint16_t *)p)[i] = ddp_f32_to_bf16(v); break;
    }
  }
}

/* The reference: ((x0 + x1) + x2) + ..., rounding fp16/bf16 after each addition. */
void ddp_test_d2_reference(ddp_dtype_t dt, void *acc, size_t n, int W, int salt) {
  size_t es = ddp_dtype_size(dt);
  unsigned char *x = ddp_malloc(n * es + 1);
  ddp_test_d2_fill(dt, acc, n, 0, salt);
  for (int j = 1; j < W; j++) {
    ddp_test_d2_fill(dt, x, n, j, salt);
    for (size_t i = 0; i < n; i++) {
      if (dt == DDP_F32) {
        ((float *)acc)[i] = ((float *)acc)[i] + ((float *)x)[i];
      } else if (dt == DDP_F16) {
        uint16_t *a = acc, *b = (uint16_t *)x;
        a[i] = ddp_f32_to_f16(ddp_f16_to_f32(a[i]) + ddp_f16_to_f32(b[i]));
      } else {
        uint16_t *a = acc, *b = (uint16_t *)x;
        a[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(a[i]) + ddp_bf16_to_f32(b[i]));
      }
    }
  }
  ddp_free(x);
}

uint64_t ddp_test_fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* ---- element access as double (exact for the small integers used here) ---- */

void ddp_test_set_el(ddp_dtype_t dt, void *p, size_t i, double v) {
  switch (dt) {
    case DDP_F32: ((float *)p)[i] = (float)v; break;
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)p)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case DDP_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case DDP_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    default: break;
  }
}

double ddp_test_get_el(ddp_dtype_t dt, const void *p, size_t i) {
  switch (dt) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    case DDP_I32: return ((const int32_t *)p)[i];
    case DDP_I64: return (double)((const int64_t *)p)[i];
    case DDP_U8: return ((const uint8_t *)p)[i];
    default: return 0;
  }
}

/* The library's AVG: the exact sum divided by W in the dtype. */
double ddp_test_avg_of(ddp_dtype_t dt, double sum, int W) {
  switch (dt) {
    case DDP_F32: return (float)sum / (float)W;
    case DDP_F64: return sum / W;
    case DDP_F16: return ddp_f16_to_f32(ddp_f32_to_f16((float)sum / (float)W));
    case DDP_BF16: return ddp_bf16_to_f32(ddp_f32_to_bf16((float)sum / (float)W));
    default: return (double)((int64_t)sum / W);
  }
}

/* Contributions: exact in every dtype for W <= 8 (sums <= 252, products <= 8). */
double ddp_test_val_sum(int r, size_t i) { return (double)((r + 1) * (int)(i % 7 + 1)); }
double ddp_test_val_prod(int r, size_t i) { return (i + (size_t)r) % 3 == 0 ? 2 : 1; }
double ddp_test_val_mm(int r, size_t i) { return (double)((r * 3 + (int)(i % 11)) % 11); }

/* ---- the shared checks ---- */

static void *buf_alloc(ddp_test_coll_t *c, size_t bytes) {
  return c->pg_alloc ? ddp_pg_alloc(c->pg, bytes) : ddp_malloc(bytes + 1);
}

static void buf_free(ddp_test_coll_t *c, void *p) {
  if (c->pg_alloc) {
    ddp_pg_free(c->pg, p);
  } else {
    ddp_free(p);
  }
}

void ddp_test_mismatch(ddp_test_coll_t *c, const char *what, ddp_dtype_t dt, size_t n, size_t i,
                       double got, double want) {
  if (c->bad++ == 0)
    snprintf(c->first, sizeof c->first, "%s %s count %zu: [%zu] = %g, expected %g", what,
             ddp_dtype_name(dt), n, i, got, want);
}

ddp_status_t ddp_test_run(ddp_test_coll_t *c, ddp_status_t st, ddp_work_t **wp, const char *what) {
  char msg[1024];
  if (st != DDP_OK) {
    ddp_error_t pe;
    ddp_pg_last_error_copy(c->pg, &pe);
    snprintf(msg, sizeof msg, "%s: issue failed: %.900s", what, pe.msg);
    c->say(c, msg);
    return st;
  }
  ddp_work_t *w = *wp;
  st = ddp_work_wait(w, -1);
  if (st != DDP_OK) {
    snprintf(msg, sizeof msg, "%s: %s", what, ddp_work_error(w));
    c->say(c, msg);
  }
  ddp_work_free(w);
  return st;
}

ddp_status_t ddp_test_check_allreduce(ddp_test_coll_t *c, ddp_dtype_t dt, size_t n) {
  static const ddp_redop_t ops[] = {DDP_OP_SUM, DDP_OP_AVG, DDP_OP_MIN, DDP_OP_MAX, DDP_OP_PRODUCT};
  size_t es = ddp_dtype_size(dt);
  unsigned char *in = buf_alloc(c, n * es), *out = buf_alloc(c, n * es);
  ddp_status_t st = DDP_OK;
  for (size_t k = 0; k < sizeof ops / sizeof ops[0] && st == DDP_OK; k++) {
    ddp_redop_t op = ops[k];
    bool inplace = (k % 2) == 0;
    for (size_t i = 0; i < n; i++) {
      double v = op == DDP_OP_PRODUCT                     ? ddp_test_val_prod(c->r, i)
                 : (op == DDP_OP_MIN || op == DDP_OP_MAX) ? ddp_test_val_mm(c->r, i)
                                                          : ddp_test_val_sum(c->r, i);
      ddp_test_set_el(dt, in, i, v);
    }
    ddp_work_t *w = NULL;
    st = ddp_test_run(c, ddp_allreduce(c->pg, in, inplace ? in : out, n, dt, op, &w), &w,
                      "allreduce");
    if (st != DDP_OK) break;
    const unsigned char *res = inplace ? in : out;
    for (size_t i = 0; i < n; i++) {
      double want = 0, s = 0, p = 1, mn = 1e9, mx = -1e9;
      for (int j = 0; j < c->W; j++) {
        s += ddp_test_val_sum(j, i);
        p *= ddp_test_val_prod(j, i);
        mn = ddp_test_val_mm(j, i) < mn ? ddp_test_val_mm(j, i) : mn;
        mx = ddp_test_val_mm(j, i) > mx ? ddp_test_val_mm(j, i) : mx;
      }
      switch (op) {
        case DDP_OP_SUM: want = s; break;
        case DDP_OP_AVG: want = ddp_test_avg_of(dt, s, c->W); break;
        case DDP_OP_MIN: want = mn; break;
        case DDP_OP_MAX: want = mx; break;
        case DDP_OP_PRODUCT: want = p; break;
      }
      double got = ddp_test_get_el(dt, res, i);
      if (got != want) {
        char what[48];
        snprintf(what, sizeof what, "allreduce %s%s", ddp_redop_name(op),
                 inplace ? " in place" : "");
        ddp_test_mismatch(c, what, dt, n, i, got, want);
        break;
      }
    }
  }
  buf_free(c, in);
  buf_free(c, out);
  return st;
}

ddp_status_t ddp_test_check_others(ddp_test_coll_t *c, ddp_dtype_t dt, size_t n) {
  size_t es = ddp_dtype_size(dt), W = (size_t)c->W;
  int r = c->r;
  unsigned char *a = buf_alloc(c, W * n * es), *b = buf_alloc(c, W * n * es);
  ddp_work_t *w = NULL;
  ddp_status_t st;
  /* broadcast from a root that moves with n */
  int root = (int)(n % W);
  for (size_t i = 0; i < n; i++) ddp_test_set_el(dt, a, i, ddp_test_val_sum(r, i));
  st = ddp_test_run(c, ddp_broadcast(c->pg, a, n, dt, root, &w), &w, "broadcast");
  for (size_t i = 0; st == DDP_OK && i < n; i++)
    if (ddp_test_get_el(dt, a, i) != ddp_test_val_sum(root, i)) {
      ddp_test_mismatch(c, "broadcast", dt, n, i, ddp_test_get_el(dt, a, i),
                        ddp_test_val_sum(root, i));
      break;
    }
  /* allgather, out of place and in place (send = recv + r*n) */
  for (int inplace = 0; inplace < 2 && st == DDP_OK; inplace++) {
    unsigned char *send = inplace ? b + (size_t)r * n * es : a;
    for (size_t i = 0; i < n; i++) ddp_test_set_el(dt, send, i, ddp_test_val_sum(r, i));
    st = ddp_test_run(c, ddp_allgather(c->pg, send, b, n, dt, &w), &w, "allgather");
    for (size_t j = 0; st == DDP_OK && j < W; j++)
      for (size_t i = 0; i < n; i++)
        if (ddp_test_get_el(dt, b, j * n + i) != ddp_test_val_sum((int)j, i)) {
          ddp_test_mismatch(c, inplace ? "allgather in place" : "allgather", dt, n, j * n + i,
                            ddp_test_get_el(dt, b, j * n + i), ddp_test_val_sum((int)j, i));
          j = W;
          break;
        }
  }
  /* reduce_scatter SUM: block k of rank j's input holds ddp_test_val_sum(j, k*n + i) */
  for (int inplace = 0; inplace < 2 && st == DDP_OK; inplace++) {
    for (size_t i = 0; i < W * n; i++) ddp_test_set_el(dt, a, i, ddp_test_val_sum(r, i));
    unsigned char *recv = inplace ? a + (size_t)r * n * es : b;
    st = ddp_test_run(c, ddp_reduce_scatter(c->pg, a, recv, n, dt, DDP_OP_SUM, &w), &w,
                      "reduce_scatter");
    for (size_t i = 0; st == DDP_OK && i < n; i++) {
      double s = 0;
      for (int j = 0; j < c->W; j++) s += ddp_test_val_sum(j, (size_t)r * n + i);
      if (ddp_test_get_el(dt, recv, i) != s) {
        ddp_test_mismatch(c, inplace ? "reduce_scatter in place" : "reduce_scatter", dt, n, i,
                          ddp_test_get_el(dt, recv, i), s);
        break;
      }
    }
  }
  /* alltoall: rank j's block k = val(j, k) pattern; we get block j = rank j's block r */
  if (st == DDP_OK) {
    for (size_t k = 0; k < W; k++)
      for (size_t i = 0; i < n; i++)
        ddp_test_set_el(dt, a, k * n + i, (double)((r * 7 + (int)k + (int)i) % 100));
    st = ddp_test_run(c, ddp_alltoall(c->pg, a, b, n, dt, &w), &w, "alltoall");
    for (size_t j = 0; st == DDP_OK && j < W; j++)
      for (size_t i = 0; i < n; i++) {
        double want = (double)(((int)j * 7 + r + (int)i) % 100);
        if (ddp_test_get_el(dt, b, j * n + i) != want) {
          ddp_test_mismatch(c, "alltoall", dt, n, j * n + i, ddp_test_get_el(dt, b, j * n + i),
                            want);
          j = W;
          break;
        }
      }
  }
  if (st == DDP_OK) st = ddp_test_run(c, ddp_barrier(c->pg, &w), &w, "barrier");
  /* send/recv around the ring; odd ranks receive first so the ring cannot deadlock */
  if (st == DDP_OK && W > 1) {
    int to = (r + 1) % c->W, from = (r + c->W - 1) % c->W;
    for (size_t i = 0; i < n; i++) ddp_test_set_el(dt, a, i, ddp_test_val_sum(r, i));
    for (int step = 0; step < 2 && st == DDP_OK; step++) {
      bool do_send = (r % 2 == 0) == (step == 0);
      st = do_send ? ddp_test_run(c, ddp_send(c->pg, a, n, dt, to, &w), &w, "send")
                   : ddp_test_run(c, ddp_recv(c->pg, b, n, dt, from, &w), &w, "recv");
    }
    for (size_t i = 0; st == DDP_OK && i < n; i++)
      if (ddp_test_get_el(dt, b, i) != ddp_test_val_sum(from, i)) {
        ddp_test_mismatch(c, "send/recv", dt, n, i, ddp_test_get_el(dt, b, i),
                          ddp_test_val_sum(from, i));
        break;
      }
  }
  buf_free(c, a);
  buf_free(c, b);
  return st;
}

static const size_t d2_counts[] = {1000, 65539, 16384, 3};
static const ddp_dtype_t d2_dtypes[] = {DDP_F32, DDP_F16, DDP_BF16};

ddp_status_t ddp_test_d2_run(ddp_test_coll_t *c, uint64_t *hash) {
  uint64_t h = 1469598103934665603ull;
  ddp_status_t st = DDP_OK;
  for (size_t d = 0; d < sizeof d2_dtypes / sizeof d2_dtypes[0] && st == DDP_OK; d++)
    for (size_t k = 0; k < sizeof d2_counts / sizeof d2_counts[0] && st == DDP_OK; k++) {
      ddp_dtype_t dt = d2_dtypes[d];
      size_t n = d2_counts[k], es = ddp_dtype_size(dt);
      unsigned char *buf = buf_alloc(c, n * es), *ref = ddp_malloc(n * es);
      ddp_test_d2_fill(dt, buf, n, c->r, (int)k);
      ddp_work_t *w = NULL;
      st = ddp_test_run(c, ddp_allreduce(c->pg, buf, buf, n, dt, DDP_OP_SUM, &w), &w,
                        "D2 allreduce");
      ddp_test_d2_reference(dt, ref, n, c->W, (int)k);
      if (st == DDP_OK && memcmp(buf, ref, n * es) != 0) {
        size_t i = 0;
        while (memcmp(buf + i * es, ref + i * es, es) == 0) i++;
        ddp_test_mismatch(c, "D2 allreduce", dt, n, i, ddp_test_get_el(dt, buf, i),
                          ddp_test_get_el(dt, ref, i));
      }
      h = ddp_test_fnv(buf, n * es, h);
      buf_free(c, buf);
      ddp_free(ref);
    }
  *hash = h;
  return st;
}
