/* The default communication hooks (spec §7.2-7.4): allreduce_hook, fp16/bf16_compress_hook
 * and the fp16/bf16 compress wrappers, in PyTorch's order of casts, divisions and
 * collectives. The group's allreduce of f16/bf16 adds in fp32 and rounds after every
 * addition in rank order (D2), which is what makes these hooks bitwise reproducible. */
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "hooks_internal.h"

void ddp__hk_divide(void *buf, size_t n, ddp_dtype_t dt, int world) {
  if (dt == DDP_F64) {
    double *x = buf;
    for (size_t i = 0; i < n; i++) x[i] /= (double)world;
  } else if (dt == DDP_F32) {
    float *x = buf;
    for (size_t i = 0; i < n; i++) x[i] /= (float)world;
  } else {
    for (size_t i = 0; i < n; i++)
      ddp__hk_store(buf, dt, i, ddp__hk_load(buf, dt, i) / (float)world);
  }
}

ddp_status_t ddp__hk_allreduce_work(ddp_pg_t *pg, void *buf, size_t n, ddp_dtype_t dt,
                                    ddp_comm_work_t **out) {
  ddp_comm_work_t *w = NULL;
  ddp_work_t *pw = NULL;
  DDP_CHECK(ddp_comm_work_create(&w));
  ddp_status_t st = ddp_allreduce(pg, buf, buf, n, dt, DDP_OP_SUM, &pw);
  if (st == DDP_OK) st = ddp_comm_work_add(w, pw);
  if (st != DDP_OK) {
    ddp_comm_work_free(w);
    return st;
  }
  ddp_comm_work_set_result(w, buf, n, dt);
  *out = w;
  return DDP_OK;
}

static void count(void *state, const ddp_grad_bucket_t *b, size_t elem_bytes) {
  ddp_hook_counters_t *c = state;
  if (!c) return;
  if (b->index == 0) c->bytes_step = 0;
  c->numel_before += (int64_t)b->numel;
  c->numel_after += (int64_t)b->numel;
  c->bytes_step += (int64_t)(b->numel * elem_bytes);
}

void ddp_hook_counters_stats(void *state, ddp_comm_hook_stats_t *out) {
  DDP_REQUIRE(state && out);
  const ddp_hook_counters_t *c = state;
  out->numel_before = c->numel_before;
  out->numel_after = c->numel_after;
  out->bytes_last_step = c->bytes_step;
}

ddp_status_t ddp_allreduce_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                ddp_comm_work_t **out) {
  DDP_REQUIRE(pg && b && out);
  *out = NULL;
  if (!ddp__hk_float_dtype(b->dtype)) return DDP_ERR_UNSUPPORTED;
  ddp__hk_divide(b->buffer, b->numel, b->dtype, ddp_pg_size(pg));
  count(state, b, ddp_dtype_size(b->dtype));
  return ddp__hk_allreduce_work(pg, b->buffer, b->numel, b->dtype, out);
}

/* ---------------------------------------------------------------- compress hook --- */

typedef struct compress_call {
  ddp_pg_t *pg;
  void *c;      /* the low-precision copy (ddp_pg_alloc) */
  void *buffer; /* buffer() at call time, receives the widened result */
  size_t n;
  ddp_dtype_t bdt, cdt;
} compress_call_t;

static void compress_free(void *user) {
  compress_call_t *k = user;
  ddp_pg_free(k->pg, k->c);
  ddp__free(k);
}

/* f32 <-> the compressed dtype (f16 or bf16) over arrays: the same bits as the element
 * functions, many times faster (common.h). */
static void narrow_n(ddp_dtype_t cdt, const float *src, void *dst, size_t n) {
  if (cdt == DDP_F16)
    ddp_f32_to_f16_n(src, dst, n);
  else
    ddp_f32_to_bf16_n(src, dst, n);
}

static void widen_n(ddp_dtype_t cdt, const void *src, float *dst, size_t n) {
  if (cdt == DDP_F16)
    ddp_f16_to_f32_n(src, dst, n);
  else
    ddp_bf16_to_f32_n(src, dst, n);
}

void ddp__hk_convert(void *dst, ddp_dtype_t ddt, const void *src, ddp_dtype_t sdt, size_t n) {
  bool half_s = sdt == DDP_F16 || sdt == DDP_BF16, half_d = ddt == DDP_F16 || ddt == DDP_BF16;
  if (sdt == DDP_F32 && half_d) {
    narrow_n(ddt, src, dst, n);
  } else if (half_s && ddt == DDP_F32) {
    widen_n(sdt, src, dst, n);
  } else if (sdt == DDP_F32 && ddt == DDP_F32) { /* others round or quiet NaNs, below */
    memcpy(dst, src, n * sizeof(float));
  } else {
    for (size_t i = 0; i < n; i++) ddp__hk_store(dst, ddt, i, ddp__hk_load(src, sdt, i));
  }
}

/* Decompress: widen the reduced low-precision copy into buffer(), in place. */
static ddp_status_t compress_done(void *user, ddp_comm_work_t *w) {
  compress_call_t *k = user;
  ddp__hk_convert(k->buffer, k->bdt, k->c, k->cdt, k->n);
  ddp_comm_work_set_result(w, k->buffer, k->n, k->bdt);
  return DDP_OK;
}

static ddp_status_t compress_hook(ddp_dtype_t cdt, void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                  ddp_comm_work_t **out) {
  DDP_REQUIRE(pg && b && out);
  *out = NULL;
  if (!ddp__hk_float_dtype(b->dtype)) return DDP_ERR_UNSUPPORTED;
  compress_call_t *k = ddp__calloc(1, sizeof *k);
  if (!k) return DDP_ERR_NO_MEMORY;
  k->pg = pg;
  k->n = b->numel;
  k->buffer = b->buffer;
  k->bdt = b->dtype;
  k->cdt = cdt;
  k->c = ddp_pg_alloc(pg, b->numel * 2 + 2);
  if (!k->c) {
    ddp__free(k);
    return DDP_ERR_NO_MEMORY;
  }
  /* Cast first, then divide in the low precision: two roundings, as PyTorch's
   * buffer.to(dtype).div_(world_size). */
  float world = (float)ddp_pg_size(pg);
  if (b->dtype == DDP_F32) {
    float tmp[1024];
    unsigned char *c = k->c;
    for (size_t i = 0; i < k->n; i += DDP_ARRAY_LEN(tmp)) {
      size_t m = DDP_MIN(DDP_ARRAY_LEN(tmp), k->n - i);
      narrow_n(cdt, (const float *)b->buffer + i, c + 2 * i, m);
      widen_n(cdt, c + 2 * i, tmp, m);
      for (size_t j = 0; j < m; j++) tmp[j] /= world;
      narrow_n(cdt, tmp, c + 2 * i, m);
    }
  } else {
    for (size_t i = 0; i < k->n; i++) {
      ddp__hk_store(k->c, cdt, i, ddp__hk_load(b->buffer, b->dtype, i));
      ddp__hk_store(k->c, cdt, i, ddp__hk_load(k->c, cdt, i) / world);
    }
  }
  count(state, b, 2);
  ddp_comm_work_t *w = NULL;
  ddp_work_t *pw = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    compress_free(k);
    return st;
  }
  ddp_comm_work_on_free(w, compress_free, k);
  st = ddp_allreduce(pg, k->c, k->c, k->n, cdt, DDP_OP_SUM, &pw);
  if (st == DDP_OK) st = ddp_comm_work_add(w, pw);
  if (st != DDP_OK) {
    ddp_comm_work_free(w);
    return st;
  }
  ddp_comm_work_then(w, compress_done, k);
  *out = w;
  return DDP_OK;
}

ddp_status_t ddp_fp16_compress_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                    ddp_comm_work_t **out) {
  return compress_hook(DDP_F16, state, pg, b, out);
}

ddp_status_t ddp_bf16_compress_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                    ddp_comm_work_t **out) {
  return compress_hook(DDP_BF16, state, pg, b, out);
}

/* ---------------------------------------------------------------- wrapper --------- */

typedef struct wrap_call {
  ddp_pg_t *pg;
  void *low; /* the low-precision buffer() the inner hook sees */
  size_t n;
  ddp_dtype_t ldt;
  ddp_comm_work_t *inner;
} wrap_call_t;

static void wrap_free(void *user) {
  wrap_call_t *k = user;
  ddp_comm_work_free(k->inner);
  ddp_pg_free(k->pg, k->low);
  ddp__free(k);
}

/* The wrapper's decompress: resolve the inner hook, copy its result into the
 * low-precision buffer() (casting if the inner result has another dtype) and resolve to it;
 * the reducer widens it into the gradients. */
static ddp_status_t wrap_done(void *user, ddp_comm_work_t *w) {
  wrap_call_t *k = user;
  const void *data = NULL;
  size_t cnt = 0;
  ddp_dtype_t dt = k->ldt;
  ddp_status_t st = ddp_comm_work_wait(k->inner, &data, &cnt, &dt);
  if (st != DDP_OK) {
    ddp_comm_work_set_error(w, ddp_comm_work_error(k->inner));
    return st;
  }
  if (cnt != k->n || !ddp__hk_float_dtype(dt)) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "compress wrapper: the inner hook resolved to %zu elements of %s, expected %zu", cnt,
             ddp_dtype_name(dt), k->n);
    ddp_comm_work_set_error(w, msg);
    return DDP_ERR_INVALID_USAGE;
  }
  if (data != k->low) {
    if (dt == k->ldt)
      memmove(k->low, data, k->n * ddp_dtype_size(dt));
    else
      ddp__hk_convert(k->low, k->ldt, data, dt, k->n);
  }
  ddp_comm_work_set_result(w, k->low, k->n, k->ldt);
  return DDP_OK;
}

ddp_status_t ddp_compress_wrapper_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                       ddp_comm_work_t **out) {
  DDP_REQUIRE(state && pg && b && out);
  const ddp_compress_wrapper_t *cw = state;
  DDP_REQUIRE(cw->inner && (cw->dtype == DDP_F16 || cw->dtype == DDP_BF16));
  *out = NULL;
  if (!ddp__hk_float_dtype(b->dtype)) return DDP_ERR_UNSUPPORTED;
  wrap_call_t *k = ddp__calloc(1, sizeof *k);
  if (!k) return DDP_ERR_NO_MEMORY;
  k->pg = pg;
  k->n = b->numel;
  k->ldt = cw->dtype;
  k->low = ddp_pg_alloc(pg, b->numel * 2 + 2);
  if (!k->low) {
    ddp__free(k);
    return DDP_ERR_NO_MEMORY;
  }
  ddp__hk_convert(k->low, k->ldt, b->buffer, b->dtype, k->n);
  ddp_grad_bucket_set_buffer(b, k->low, k->ldt);
  ddp_status_t st = cw->inner(cw->inner_state, pg, b, &k->inner);
  ddp_comm_work_t *w = NULL;
  if (st == DDP_OK && !k->inner) st = DDP_ERR_INVALID_USAGE;
  if (st == DDP_OK) st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    wrap_free(k);
    return st;
  }
  ddp_comm_work_on_free(w, wrap_free, k);
  ddp_comm_work_then(w, wrap_done, k);
  *out = w;
  return DDP_OK;
}
