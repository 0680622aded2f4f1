/* Reduction kernels (ddp_reduce_* in ddp/tensor.h): the element-wise arithmetic of every
 * reduction in the collectives, shared by the algorithms (src/algo) and the backends that
 * reduce with their own code (mpi's AVG division, nccl's host fold). They live in the
 * tensor layer because they are dtype arithmetic and nothing else: below the store, the
 * backends and the algorithms, which all reach them through public headers (an
 * out-of-tree backend that folds with them stays bitwise equal to the others).
 *
 * The kernels are element-wise: lane i of the result depends only on lane i of the inputs,
 * so any blocking, chunking or vectorisation gives the same bits. fp16 and bf16 widen to
 * fp32, operate, and round back to the storage type after every single operation, which is
 * what gloo and NCCL do per step; the left fold in ddp_reduce_fold therefore rounds W-1
 * times per element, in rank order, on every backend. Integer sums and products wrap
 * (computed on unsigned types, so they are defined behaviour). Float MIN/MAX propagate
 * NaN. AVG is the sum divided by the world size (never multiplied by 1/W). */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "ddp/tensor.h"

#define FMIN_(a, b) (isnan(b) ? (b) : ((b) < (a) ? (b) : (a)))
#define FMAX_(a, b) (isnan(b) ? (b) : ((b) > (a) ? (b) : (a)))
#define IMIN_(a, b) ((b) < (a) ? (b) : (a))
#define IMAX_(a, b) ((b) > (a) ? (b) : (a))

/* acc_<T>(op, d, s, n, rev): d[i] = d[i] op s[i], or with rev d[i] = s[i] op d[i] (s the
 * left operand, for a fold whose earlier sources are already combined in s). The loops
 * vectorise (DDP_VEC_CLONES: AVX-512 folds 16 floats an instruction against SSE2's 4; the
 * shm and threads allreduce at 16 KiB-4 MiB, W = 2, 0.59-0.83x the time). Lane i stays
 * lane i, so every variant gives the same bits. */
#define ACC_LOOPS_(T, U, MN, MX, L, R)                              \
  switch (op) {                                                     \
    case DDP_OP_SUM:                                                \
    case DDP_OP_AVG:                                                \
      for (size_t i = 0; i < n; i++) d[i] = (T)((U)L[i] + (U)R[i]); \
      break;                                                        \
    case DDP_OP_PRODUCT:                                            \
      for (size_t i = 0; i < n; i++) d[i] = (T)((U)L[i] * (U)R[i]); \
      break;                                                        \
    case DDP_OP_MIN:                                                \
      for (size_t i = 0; i < n; i++) d[i] = MN(L[i], R[i]);         \
      break;                                                        \
    case DDP_OP_MAX:                                                \
      for (size_t i = 0; i < n; i++) d[i] = MX(L[i], R[i]);         \
      break;                                                        \
  }
#define ACC_NATIVE_(T, U, MN, MX)                                                            \
  DDP_VEC_CLONES static void acc_##T(ddp_redop_t op, T *d, const T *s, size_t n, bool rev) { \
    if (rev) {                                                                               \
      ACC_LOOPS_(T, U, MN, MX, s, d)                                                         \
    } else {                                                                                 \
      ACC_LOOPS_(T, U, MN, MX, d, s)                                                         \
    }                                                                                        \
  }

ACC_NATIVE_(float, float, FMIN_, FMAX_)
ACC_NATIVE_(double, double, FMIN_, FMAX_)
ACC_NATIVE_(int32_t, uint32_t, IMIN_, IMAX_)
ACC_NATIVE_(int64_t, uint64_t, IMIN_, IMAX_)
ACC_NATIVE_(uint8_t, uint32_t, IMIN_, IMAX_)

typedef void (*widen_n_fn)(const uint16_t *, float *, size_t);
typedef void (*narrow_n_fn)(const float *, uint16_t *, size_t);

/* f16/bf16: blocks of 256 widened to float (exact), combined, rounded back once per
 * operation; the array conversions give the element functions' bits, faster. */
DDP_VEC_CLONES static void acc_half(ddp_redop_t op, uint16_t *d, const uint16_t *s, size_t n,
                                    bool rev, widen_n_fn w, narrow_n_fn nr) {
  float a[256], b[256];
  for (size_t off = 0; off < n; off += 256) {
    size_t m = DDP_MIN((size_t)256, n - off);
    w((rev ? s : d) + off, a, m);
    w((rev ? d : s) + off, b, m);
    switch (op) {
      case DDP_OP_PRODUCT:
        for (size_t i = 0; i < m; i++) a[i] = a[i] * b[i];
        break;
      case DDP_OP_MIN:
        for (size_t i = 0; i < m; i++) a[i] = FMIN_(a[i], b[i]);
        break;
      case DDP_OP_MAX:
        for (size_t i = 0; i < m; i++) a[i] = FMAX_(a[i], b[i]);
        break;
      default:
        for (size_t i = 0; i < m; i++) a[i] = a[i] + b[i];
        break;
    }
    nr(a, d + off, m);
  }
}

static void acc_any(ddp_dtype_t dt, ddp_redop_t op, void *dst, const void *src, size_t n,
                    bool rev) {
  switch (dt) {
    case DDP_F32: acc_float(op, dst, src, n, rev); break;
    case DDP_F64: acc_double(op, dst, src, n, rev); break;
    case DDP_I32: acc_int32_t(op, dst, src, n, rev); break;
    case DDP_I64: acc_int64_t(op, dst, src, n, rev); break;
    case DDP_U8: acc_uint8_t(op, dst, src, n, rev); break;
    case DDP_F16: acc_half(op, dst, src, n, rev, ddp_f16_to_f32_n, ddp_f32_to_f16_n); break;
    case DDP_BF16: acc_half(op, dst, src, n, rev, ddp_bf16_to_f32_n, ddp_f32_to_bf16_n); break;
    default: DDP_REQUIRE(!"a reducible dtype (ddp/tensor.h)");
  }
}

DDP_VEC_CLONES static void avg_any(ddp_dtype_t dt, void *dst, size_t n, int world) {
  switch (dt) {
    case DDP_F32: {
      float *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = d[i] / (float)world;
      break;
    }
    case DDP_F64: {
      double *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = d[i] / (double)world;
      break;
    }
    case DDP_I32: {
      int32_t *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = d[i] / world;
      break;
    }
    case DDP_I64: {
      int64_t *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = d[i] / world;
      break;
    }
    case DDP_U8: {
      uint8_t *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = (uint8_t)(d[i] / world);
      break;
    }
    case DDP_F16: {
      uint16_t *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = ddp_f32_to_f16(ddp_f16_to_f32(d[i]) / (float)world);
      break;
    }
    case DDP_BF16: {
      uint16_t *d = dst;
      for (size_t i = 0; i < n; i++) d[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(d[i]) / (float)world);
      break;
    }
    default: DDP_REQUIRE(!"a reducible dtype (ddp/tensor.h)");
  }
}

void ddp_reduce_acc(ddp_dtype_t dt, ddp_redop_t op, void *dst, const void *src, size_t n) {
  acc_any(dt, op, dst, src, n, false);
}

void ddp_reduce_avg(ddp_dtype_t dt, void *dst, size_t n, int world) { avg_any(dt, dst, n, world); }

/* ddp_reduce_fold: the left fold over the sources in rank order. Where dst aliases only the
 * first source, or none, it accumulates in dst directly (one pass over memory per source).
 * Where dst is exactly a later source k (an in-place collective on a rank other than 0) and
 * aliases nothing else, the sources before k are combined first (in tmp, block by block,
 * when there are two or more of them) and then into dst as the left operand (acc's rev),
 * and the rest accumulate in dst: the same operations in the same order, without copying
 * every block through tmp and back (W = 2: rank 1 folds in one pass, like rank 0).
 * Anything else is folded block by block in tmp and then written. */
void ddp_reduce_fold(ddp_dtype_t dt, ddp_redop_t op, int nsrc, const void *const *srcs, void *dst,
                     size_t n, unsigned char *tmp, int world) {
  size_t es = ddp_dtype_size(dt), blk = DDP_REDUCE_TMP_BYTES / es;
  const unsigned char *d0 = dst;
  int at = -1; /* the source dst is, exactly; -2 when dst overlaps a source otherwise */
  for (int j = 0; j < nsrc && at != -2; j++) {
    const unsigned char *s = srcs[j];
    if (s == d0 && n > 0)
      at = at == -1 ? j : -2;
    else if (s < d0 + n * es && d0 < s + n * es)
      at = -2;
  }
  if (at == -1 || at == 0) {
    if (at == -1 && nsrc > 0) memcpy(dst, srcs[0], n * es);
    for (int j = 1; j < nsrc; j++) acc_any(dt, op, dst, srcs[j], n, false);
    if (op == DDP_OP_AVG) avg_any(dt, dst, n, world);
    return;
  }
  if (at == 1) {
    acc_any(dt, op, dst, srcs[0], n, true);
    for (int j = 2; j < nsrc; j++) acc_any(dt, op, dst, srcs[j], n, false);
    if (op == DDP_OP_AVG) avg_any(dt, dst, n, world);
    return;
  }
  for (size_t off = 0; off < n; off += blk) {
    size_t m = DDP_MIN(blk, n - off);
    unsigned char *d = (unsigned char *)dst + off * es;
    memcpy(tmp, (const unsigned char *)srcs[0] + off * es, m * es);
    for (int j = 1; j < nsrc; j++) {
      if (j == at)
        acc_any(dt, op, d, tmp, m, true);
      else
        acc_any(dt, op, j < at || at < 0 ? tmp : d, (const unsigned char *)srcs[j] + off * es, m,
                false);
    }
    if (at > 0) {
      if (op == DDP_OP_AVG) avg_any(dt, d, m, world);
      continue;
    }
    if (op == DDP_OP_AVG) avg_any(dt, tmp, m, world);
    memcpy(d, tmp, m * es);
  }
}

const char *ddp_redop_name(ddp_redop_t op) {
  switch (op) {
    case DDP_OP_SUM: return "SUM";
    case DDP_OP_AVG: return "AVG";
    case DDP_OP_MIN: return "MIN";
    case DDP_OP_MAX: return "MAX";
    case DDP_OP_PRODUCT: return "PRODUCT";
  }
  return "?";
}
