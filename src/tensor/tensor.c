/* Dense contiguous tensors: dtype table, shape arithmetic with overflow checks, owning
 * tensors and views, and dtype conversion. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/tensor.h"

typedef struct dtype_info {
  const char *name;
  size_t size;
} dtype_info_t;

static const dtype_info_t dtypes[DDP_DTYPE_COUNT_] = {
#define DDP_DTYPE_ROW_(id, name, size) [DDP_##id] = {name, size},
    DDP_DTYPE_MAP(DDP_DTYPE_ROW_)
#undef DDP_DTYPE_ROW_
};

bool ddp_dtype_valid(int dt) { return dt >= 0 && dt < DDP_DTYPE_COUNT_; }

size_t ddp_dtype_size(ddp_dtype_t dt) { return ddp_dtype_valid((int)dt) ? dtypes[dt].size : 0; }

const char *ddp_dtype_name(ddp_dtype_t dt) {
  return ddp_dtype_valid((int)dt) ? dtypes[dt].name : "?";
}

ddp_status_t ddp_dtype_from_name(const char *name, ddp_dtype_t *out) {
  for (int i = 0; i < DDP_DTYPE_COUNT_; i++) {
    if (strcmp(name, dtypes[i].name) == 0) {
      *out = (ddp_dtype_t)i;
      return DDP_OK;
    }
  }
  return DDP_ERR_NOT_FOUND;
}

ddp_status_t ddp_shape_numel(int ndim, const int64_t *shape, size_t elem_size,
                             int64_t *numel) {
  if (ndim < 0 || ndim > DDP_MAX_DIMS || elem_size == 0) return DDP_ERR_INVALID_ARGUMENT;
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return DDP_ERR_INVALID_ARGUMENT;
    if (shape[i] != 0 && n > INT64_MAX / shape[i]) return DDP_ERR_INVALID_ARGUMENT;
    n *= shape[i];
  }
  if (n > INT64_MAX / (int64_t)elem_size) return DDP_ERR_INVALID_ARGUMENT;
  *numel = n;
  return DDP_OK;
}

static ddp_status_t fill_header(ddp_tensor_t *t, ddp_dtype_t dt, int ndim,
                                const int64_t *shape) {
  memset(t, 0, sizeof *t);
  if (!ddp_dtype_valid((int)dt)) return DDP_ERR_INVALID_ARGUMENT;
  int64_t n;
  DDP_CHECK(ddp_shape_numel(ndim, shape, dtypes[dt].size, &n));
  t->dtype = dt;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->numel = n;
  return DDP_OK;
}

ddp_status_t ddp_tensor_alloc(ddp_tensor_t *t, ddp_dtype_t dt, int ndim, const int64_t *shape) {
  DDP_REQUIRE(t);
  DDP_CHECK(fill_header(t, dt, ndim, shape));
  size_t bytes = (size_t)t->numel * dtypes[dt].size;
  t->data = ddp__aligned_alloc(bytes);
  if (!t->data) {
    memset(t, 0, sizeof *t);
    return DDP_ERR_NO_MEMORY;
  }
  memset(t->data, 0, bytes);
  t->owns = true;
  return DDP_OK;
}

void ddp_tensor_free(ddp_tensor_t *t) {
  if (!t) return;
  if (t->owns) ddp__aligned_free(t->data);
  memset(t, 0, sizeof *t);
}

ddp_status_t ddp_tensor_view(ddp_tensor_t *t, ddp_dtype_t dt, int ndim, const int64_t *shape,
                             void *data) {
  DDP_REQUIRE(t);
  DDP_CHECK(fill_header(t, dt, ndim, shape));
  t->data = data;
  return DDP_OK;
}

ddp_status_t ddp_tensor_slice(const ddp_tensor_t *base, int64_t offset, int ndim,
                              const int64_t *shape, ddp_tensor_t *out) {
  DDP_REQUIRE(base && out);
  ddp_tensor_t v;
  DDP_CHECK(fill_header(&v, base->dtype, ndim, shape));
  if (offset < 0 || offset > base->numel || v.numel > base->numel - offset) {
    return DDP_ERR_INVALID_ARGUMENT;
  }
  v.data = (unsigned char *)base->data + (size_t)offset * dtypes[base->dtype].size;
  *out = v;
  return DDP_OK;
}

size_t ddp_tensor_nbytes(const ddp_tensor_t *t) {
  return (size_t)t->numel * ddp_dtype_size(t->dtype);
}

bool ddp_tensor_same_shape(const ddp_tensor_t *a, const ddp_tensor_t *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++) {
    if (a->shape[i] != b->shape[i]) return false;
  }
  return true;
}

/* Element i of t as double (exact for every dtype but i64 beyond 2^53). */
static double load_f(const ddp_tensor_t *t, int64_t i) {
  const void *p = t->data;
  switch (t->dtype) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    case DDP_I32: return ((const int32_t *)p)[i];
    case DDP_I64: return (double)((const int64_t *)p)[i];
    case DDP_U8: return ((const uint8_t *)p)[i];
    case DDP_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: DDP_REQUIRE(0 && "dtype");
  }
  return 0;
}

static int64_t load_i(const ddp_tensor_t *t, int64_t i) {
  const void *p = t->data;
  switch (t->dtype) {
    case DDP_I32: return ((const int32_t *)p)[i];
    case DDP_I64: return ((const int64_t *)p)[i];
    case DDP_U8: return ((const uint8_t *)p)[i];
    case DDP_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: return (int64_t)load_f(t, i);
  }
}

static bool is_float(ddp_dtype_t dt) {
  return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16;
}

ddp_status_t ddp_tensor_copy(ddp_tensor_t *dst, const ddp_tensor_t *src) {
  DDP_REQUIRE(dst && src);
  if (dst->numel != src->numel) return DDP_ERR_INVALID_ARGUMENT;
  if (dst->dtype == src->dtype) {
    memmove(dst->data, src->data, ddp_tensor_nbytes(src));
    return DDP_OK;
  }
  void *q = dst->data;
  for (int64_t i = 0; i < src->numel; i++) {
    /* Float sources go through double (exact for f16/bf16/f32); a direct f32 -> f16 path
     * therefore rounds once, from the exact value. */
    double f = is_float(src->dtype) ? load_f(src, i) : (double)load_i(src, i);
    switch (dst->dtype) {
      case DDP_F32: ((float *)q)[i] = (float)f; break;
      case DDP_F64: ((double *)q)[i] = is_float(src->dtype) ? f : (double)load_i(src, i); break;
      case DDP_F16: ((uint16_t *)q)[i] = ddp_f32_to_f16((float)f); break;
      case DDP_BF16: ((uint16_t *)q)[i] = ddp_f32_to_bf16((float)f); break;
      case DDP_I32: ((int32_t *)q)[i] = (int32_t)(is_float(src->dtype) ? f : load_i(src, i)); break;
      case DDP_I64: ((int64_t *)q)[i] = is_float(src->dtype) ? (int64_t)f : load_i(src, i); break;
      case DDP_U8: ((uint8_t *)q)[i] = (uint8_t)(is_float(src->dtype) ? f : load_i(src, i)); break;
      case DDP_BOOL: ((uint8_t *)q)[i] = f != 0; break;
      default: return DDP_ERR_INVALID_ARGUMENT;
    }
  }
  return DDP_OK;
}

const char *ddp_tensor_describe(const ddp_tensor_t *t, char *buf, size_t len) {
  size_t n = (size_t)snprintf(buf, len, "%s[", ddp_dtype_name(t->dtype));
  for (int i = 0; i < t->ndim && n < len; i++) {
    n += (size_t)snprintf(buf + n, len - n, i ? ", %" PRId64 : "%" PRId64, t->shape[i]);
  }
  if (n < len) snprintf(buf + n, len - n, "]");
  return buf;
}
