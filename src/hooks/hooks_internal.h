/* Private helpers shared by the hook implementations: element access across the floating
 * dtypes and the one-allreduce future. */
#ifndef DDP_HOOKS_INTERNAL_H
#define DDP_HOOKS_INTERNAL_H

#include "ddp/hooks.h"

/* Element i of a f32/f64/f16/bf16 array, widened to float (f64 is rounded to float). */
static inline float ddp__hk_load(const void *p, ddp_dtype_t dt, size_t i) {
  return (float)ddp_dtype_load(p, dt, i);
}

/* Stores v (rounded to nearest even) as element i of a f32/f64/f16/bf16 array. */
static inline void ddp__hk_store(void *p, ddp_dtype_t dt, size_t i, float v) {
  switch (dt) {
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((ddp_f16_t *)p)[i] = ddp_f32_to_f16(v); break;
    case DDP_BF16: ((ddp_bf16_t *)p)[i] = ddp_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v; break;
  }
}

/* dst[i] = src[i] for n elements, exactly as ddp__hk_store(dst, ddt, i, ddp__hk_load(src,
 * sdt, i)) (through float), with the f32 <-> f16/bf16 cases on the array conversions. dst
 * and src do not overlap. */
void ddp__hk_convert(void *dst, ddp_dtype_t ddt, const void *src, ddp_dtype_t sdt, size_t n);

static inline bool ddp__hk_float_dtype(ddp_dtype_t dt) {
  return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16;
}

/* buf[i] /= W in buf's dtype: one true division, rounded once to the dtype (f16/bf16:
 * computed in f32 and rounded, as PyTorch's CPU kernels do). */
void ddp__hk_divide(void *buf, size_t n, ddp_dtype_t dt, int world);

/* Launches one in-place allreduce SUM of buf and returns a future that resolves to buf. */
ddp_status_t ddp__hk_allreduce_work(ddp_pg_t *pg, void *buf, size_t n, ddp_dtype_t dt,
                                    ddp_comm_work_t **out);

#endif
