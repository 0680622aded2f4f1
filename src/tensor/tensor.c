/* Dense contiguous tensors: dtype table, shape arithmetic with overflow checks, owning
 * tensors and views, and dtype conversion. */
#include <inttypes.h>
#include <math.h>
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

ddp_status_t ddp_shape_numel(int ndim, const int64_t *shape, size_t elem_size, int64_t *numel) {
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

static ddp_status_t fill_header(ddp_tensor_t *t, ddp_dtype_t dt, int ndim, const int64_t *shape) {
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

double ddp_dtype_load(const void *p, ddp_dtype_t dt, size_t i) {
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

/* Element i of t as double (exact for every dtype but i64 beyond 2^53). */
static double load_f(const ddp_tensor_t *t, int64_t i) {
  return ddp_dtype_load(t->data, t->dtype, (size_t)i);
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

/* Narrowing to f16/bf16 must round once, from the exact value. Rounding a double (or an
 * int64) to float first and then to f16 rounds twice and can be wrong: 1 + 2^-11 + 2^-40
 * becomes the float 1 + 2^-11, a tie that then rounds down to 1, while the nearest f16 is
 * 1 + 2^-10. The cure is round-to-odd for the first step (Boldo and Melquiond): truncate
 * to float and set the last bit when anything was cut off. Float keeps at least two more
 * bits than f16 or bf16 everywhere in their ranges (subnormals included), so the second,
 * ordinary rounding then gives the correctly rounded result. */
static float f64_to_f32_odd(double d) {
  float f = (float)d;
  if (isnan(d) || (double)f == d) return f;
  if (fabs((double)f) > fabs(d)) f = nextafterf(f, 0.0f); /* truncate toward zero */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u |= 1u; /* sticky: inexact */
  memcpy(&f, &u, sizeof f);
  return f;
}

/* The same for an integer: keep the top 24 significant bits, OR-ing the rest into the
 * last one; the scaling by a power of two is exact. */
static float i64_to_f32_odd(int64_t v) {
  uint64_t a = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
  if (a < (1u << 24)) return v < 0 ? -(float)a : (float)a;
  int shift = 64 - 24 - __builtin_clzll(a);
  uint64_t kept = (a >> shift) | ((a & ((UINT64_C(1) << shift) - 1)) != 0);
  float f = ldexpf((float)kept, shift);
  return v < 0 ? -f : f;
}

ddp_status_t ddp_tensor_copy(ddp_tensor_t *dst, const ddp_tensor_t *src) {
  DDP_REQUIRE(dst && src);
  if (dst->numel != src->numel) return DDP_ERR_INVALID_ARGUMENT;
  if (dst->dtype == src->dtype) {
    memmove(dst->data, src->data, ddp_tensor_nbytes(src));
    return DDP_OK;
  }
  void *q = dst->data;
  bool fsrc = is_float(src->dtype);
  for (int64_t i = 0; i < src->numel; i++) {
    /* Float sources are read as double (exact for f16/bf16/f32/f64), integer sources as
     * int64 (exact); each destination then converts from that exact value once. */
    double f = fsrc ? load_f(src, i) : 0.0;
    int64_t n = fsrc ? 0 : load_i(src, i);
    switch (dst->dtype) {
      case DDP_F32: ((float *)q)[i] = fsrc ? (float)f : (float)n; break;
      case DDP_F64: ((double *)q)[i] = fsrc ? f : (double)n; break;
      case DDP_F16:
        ((uint16_t *)q)[i] = ddp_f32_to_f16(fsrc ? f64_to_f32_odd(f) : i64_to_f32_odd(n));
        break;
      case DDP_BF16:
        ((uint16_t *)q)[i] = ddp_f32_to_bf16(fsrc ? f64_to_f32_odd(f) : i64_to_f32_odd(n));
        break;
      case DDP_I32: ((int32_t *)q)[i] = fsrc ? (int32_t)f : (int32_t)n; break;
      case DDP_I64: ((int64_t *)q)[i] = fsrc ? (int64_t)f : n; break;
      case DDP_U8: ((uint8_t *)q)[i] = fsrc ? (uint8_t)f : (uint8_t)n; break;
      case DDP_BOOL: ((uint8_t *)q)[i] = fsrc ? f != 0 : n != 0; break;
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
