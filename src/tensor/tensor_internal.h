/* Private to libddp: dtype helpers that the layers above src/tensor share (the tensor
 * copies, the reducer's bucket copies, the comm hooks). Not installed. */
#ifndef DDP_SRC_TENSOR_INTERNAL_H
#define DDP_SRC_TENSOR_INTERNAL_H

#include <stdint.h>

#include "common/common.h"
#include "ddp/tensor.h"

/* Element i of an array of dtype dt as a double, exact for every dtype but i64 beyond 2^53
 * (f16 and bf16 widen through their exact f32 values). The one per-dtype element loader. */
static inline double ddp__dtype_load(const void *p, ddp_dtype_t dt, size_t i) {
  switch (dt) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const ddp_f16_t *)p)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const ddp_bf16_t *)p)[i]);
    case DDP_I32: return ((const int32_t *)p)[i];
    case DDP_I64: return (double)((const int64_t *)p)[i];
    case DDP_U8: return ((const uint8_t *)p)[i];
    case DDP_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: DDP_REQUIRE(0 && "dtype");
  }
  return 0;
}

#endif /* DDP_SRC_TENSOR_INTERNAL_H */
