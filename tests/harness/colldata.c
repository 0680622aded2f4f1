/* Shared data for collective tests: see colldata.h. */
#include "colldata.h"

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
