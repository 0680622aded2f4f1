/* The finiteness check of data read from files: a NaN or an infinity among the features or
 * float labels would only show up as a NaN loss many steps later, so the first one is
 * reported at load, with the tensor, the element and the sample it belongs to. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

/* Whether element i is NaN (1), an infinity (2) or finite (0). */
static int classify(const ddp_tensor_t *t, int64_t i) {
  switch (t->dtype) {
    case DDP_F32: {
      float v = ((const float *)t->data)[i];
      return isnan(v) ? 1 : isinf(v) ? 2 : 0;
    }
    case DDP_F64: {
      double v = ((const double *)t->data)[i];
      return isnan(v) ? 1 : isinf(v) ? 2 : 0;
    }
    case DDP_F16: { /* exponent all ones: mantissa 0 is an infinity, else NaN */
      uint16_t h = ((const uint16_t *)t->data)[i];
      return (h & 0x7c00u) != 0x7c00u ? 0 : (h & 0x03ffu) ? 1 : 2;
    }
    case DDP_BF16: {
      uint16_t b = ((const uint16_t *)t->data)[i];
      return (b & 0x7f80u) != 0x7f80u ? 0 : (b & 0x007fu) ? 1 : 2;
    }
    default: return 0;
  }
}

ddp_status_t ddp__data_check_finite(const ddp_tensor_t *t, const char *path, const char *name,
                                    ddp_error_t *err) {
  if (t->dtype != DDP_F32 && t->dtype != DDP_F64 && t->dtype != DDP_F16 && t->dtype != DDP_BF16) {
    return DDP_OK;
  }
  for (int64_t i = 0; i < t->numel; i++) {
    int kind = classify(t, i);
    if (!kind) continue;
    char idx[24 * DDP_MAX_DIMS + 4] = "";
    size_t len = 0;
    int64_t rest = i, stride = t->numel;
    for (int d = 0; d < t->ndim && len < sizeof idx; d++) {
      stride /= t->shape[d] ? t->shape[d] : 1;
      len += (size_t)snprintf(idx + len, sizeof idx - len, "%s%lld", d ? ", " : "",
                              (long long)(rest / stride));
      rest %= stride;
    }
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "dataset %s: tensor '%s' element %lld (sample %lld, index [%s]) is %s; "
                      "the file is damaged or the data holds values that cannot train",
                      path, name, (long long)i,
                      (long long)(t->ndim > 0 && t->shape[0] ? i / (t->numel / t->shape[0]) : 0),
                      idx, kind == 1 ? "NaN" : "infinite");
  }
  return DDP_OK;
}
