/* libddp tensor layer: dtypes, dense contiguous tensors, views into flat buffers, and the
 * BLAS wrapper (the only code in libddp that calls OpenBLAS).
 *
 * A ddp_tensor_t is a small value struct (llm.c style): it is either owning (its data came
 * from ddp_tensor_alloc and ddp_tensor_free releases it) or a view (data points into memory
 * someone else owns: a flat parameter buffer, a bucket, an mmap'ed file). Tensors are
 * always contiguous, row-major. */
#ifndef DDP_TENSOR_H
#define DDP_TENSOR_H

#include "ddp/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP_MAX_DIMS 8

/* X(id, safetensors name, element size) */
#define DDP_DTYPE_MAP(X) \
  X(F32, "F32", 4)       \
  X(F64, "F64", 8)       \
  X(F16, "F16", 2)       \
  X(BF16, "BF16", 2)     \
  X(I32, "I32", 4)       \
  X(I64, "I64", 8)       \
  X(U8, "U8", 1)         \
  X(BOOL, "BOOL", 1)

typedef enum ddp_dtype {
/* The list expands to enumerators, which clang-format cannot see. */
/* clang-format off */
#define DDP_DTYPE_ENUM_(id, name, size) DDP_##id,
  DDP_DTYPE_MAP(DDP_DTYPE_ENUM_)
#undef DDP_DTYPE_ENUM_
  DDP_DTYPE_COUNT_
  /* clang-format on */
} ddp_dtype_t;

/* Element size in bytes; 0 for a value outside the list. */
DDP_API size_t ddp_dtype_size(ddp_dtype_t dt);
/* Element i of an array of dtype dt as a double, exact for every dtype but i64 beyond 2^53
 * (f16 and bf16 widen through their exact f32 values): the one per-dtype element loader. */
DDP_API double ddp_dtype_load(const void *p, ddp_dtype_t dt, size_t i);
/* The safetensors spelling ("F32", "BF16", ...); "?" outside the list. */
DDP_API const char *ddp_dtype_name(ddp_dtype_t dt);
/* Parses a safetensors dtype name. DDP_ERR_NOT_FOUND for an unknown one. */
DDP_API ddp_status_t ddp_dtype_from_name(const char *name, ddp_dtype_t *out);
DDP_API bool ddp_dtype_valid(int dt);

/* Element-wise reduction ops: how the collectives (ddp/pg.h) combine the ranks'
 * contributions, element by element, in the element's dtype. */
typedef enum ddp_redop {
  DDP_OP_SUM = 0,
  DDP_OP_AVG = 1, /* sum, then divided by W (integers: truncating division) */
  DDP_OP_MIN = 2,
  DDP_OP_MAX = 3,
  DDP_OP_PRODUCT = 4
} ddp_redop_t;

/* "SUM", "AVG", "MIN", "MAX", "PRODUCT"; "?" outside the list. */
DDP_API const char *ddp_redop_name(ddp_redop_t op);

/* The reduction kernels: the element-wise arithmetic of every reduction in the collectives,
 * used by the algorithms and by backends that reduce with their own code (a backend that
 * folds with these gives results bitwise equal to every other backend's, D2). Lane i of a
 * result depends only on lane i of the inputs. fp16 and bf16 compute in fp32 and round
 * after every operation; integer sums and products wrap; float MIN and MAX propagate NaN;
 * AVG is the sum divided by the world size. dt is a reducible dtype (not BOOL). */
/* dst[i] = dst[i] op src[i] (AVG accumulates as SUM). */
DDP_API void ddp_reduce_acc(ddp_dtype_t dt, ddp_redop_t op, void *dst, const void *src, size_t n);
/* dst[i] /= world, for AVG after the last addition (integers: truncating division). */
DDP_API void ddp_reduce_avg(ddp_dtype_t dt, void *dst, size_t n, int world);
/* The scratch block ddp_reduce_fold folds in. */
#define DDP_REDUCE_TMP_BYTES (64u * 1024u)
/* dst[i] = (((srcs[0][i] op srcs[1][i]) op srcs[2][i]) ...), the rank-order left fold over
 * nsrc sources, then the AVG division by world. dst may alias any source. tmp (that is,
 * DDP_REDUCE_TMP_BYTES) is used block by block unless dst aliases no source or is exactly
 * srcs[0] or srcs[1] and aliases no other; then it may be NULL. */
DDP_API void ddp_reduce_fold(ddp_dtype_t dt, ddp_redop_t op, int nsrc, const void *const *srcs,
                             void *dst, size_t n, unsigned char *tmp, int world);

/* The pre-rounded reproducible sum (src/tensor/rsum.c): a sum of f32 or f64 terms whose
 * result does not depend on the order or grouping of the additions, for
 * world_size_invariant_shards (docs/ddp.md). Elements go in blocks of DDP_RSUM_BLOCK.
 * Two passes over the terms: first every term's block exponents are combined with
 * ddp_rsum_exps_* into exps[ddp_rsum_blocks(n)] (zeroed first; across ranks an allreduce
 * MAX of them, I32); then every term is deposited into acc[n] (int64) with
 * ddp_rsum_deposit_*, given the combined exps and the total number of terms; across ranks
 * the accumulators are summed exactly by an allreduce SUM (I64) in any order. The result
 * is within n M 2^(c - 50) (c = ceil(log2 n), M the largest magnitude in the element's
 * block) of the exact sum before the division and the final rounding. terms <= 2^16. */
#define DDP_RSUM_BLOCK 32
#define DDP_RSUM_POISON INT32_MAX /* a block's exps entry after a NaN or an infinity */
#define DDP_RSUM_MAX_TERMS 65536
/* The number of exps entries of n elements. */
DDP_API size_t ddp_rsum_blocks(size_t n);
/* exps[b] = max(exps[b], the code of block b's largest |x|). */
DDP_API void ddp_rsum_exps_f32(int32_t *exps, const float *x, size_t n);
DDP_API void ddp_rsum_exps_f64(int32_t *exps, const double *x, size_t n);
/* ddp_rsum_exps_* of src, fused with dst = src and src = 0 (one pass; no overlap). */
DDP_API void ddp_rsum_take_f32(int32_t *exps, float *dst, float *src, size_t n);
DDP_API void ddp_rsum_take_f64(int32_t *exps, double *dst, double *src, size_t n);
/* acc[i] = (add ? acc[i] : 0) + the sum of srcs[s][i] rounded to its block's grid (an
 * integer) for s < nsrc, given the final exps and the total number of terms of the sum
 * (over all calls and ranks). With add false, acc need not be initialised. */
DDP_API void ddp_rsum_deposit_f32(int64_t *acc, const int32_t *exps, int64_t terms, bool add,
                                  int nsrc, const float *const *srcs, size_t n);
DDP_API void ddp_rsum_deposit_f64(int64_t *acc, const int32_t *exps, int64_t terms, bool add,
                                  int nsrc, const double *const *srcs, size_t n);
/* out[i] = the sum acc[i] stands for, divided by divisor (> 0), rounded once to the dtype;
 * NaN in a poisoned block. */
DDP_API void ddp_rsum_result_f32(const int64_t *acc, const int32_t *exps, int64_t terms, size_t n,
                                 int64_t divisor, float *out);
DDP_API void ddp_rsum_result_f64(const int64_t *acc, const int32_t *exps, int64_t terms, size_t n,
                                 int64_t divisor, double *out);

typedef struct ddp_tensor {
  ddp_dtype_t dtype;
  int ndim; /* 0..DDP_MAX_DIMS; 0 is a scalar with numel 1 */
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  void *data; /* 64-byte aligned when owning */
  bool owns;  /* true: ddp_tensor_free releases data */
} ddp_tensor_t;

/* Element count of a shape, with overflow and negative-dimension checks: DDP_ERR_INVALID_ARGUMENT
 * when a dim is negative, ndim is out of range, or numel * elem_size would exceed INT64_MAX. */
DDP_API ddp_status_t ddp_shape_numel(int ndim, const int64_t *shape, size_t elem_size,
                                     int64_t *numel);

/* Owning tensor, zero-filled. On failure *t is zeroed. */
DDP_API ddp_status_t ddp_tensor_alloc(ddp_tensor_t *t, ddp_dtype_t dt, int ndim,
                                      const int64_t *shape);
/* Releases owned data (no-op for views and zeroed structs) and zeroes *t. */
DDP_API void ddp_tensor_free(ddp_tensor_t *t);
/* A view of caller memory; nothing is copied or freed. */
DDP_API ddp_status_t ddp_tensor_view(ddp_tensor_t *t, ddp_dtype_t dt, int ndim,
                                     const int64_t *shape, void *data);
/* A view of `base` starting at element `offset` with the given shape. DDP_ERR_INVALID_ARGUMENT
 * when the slice runs past base's end or the dtypes differ in size. */
DDP_API ddp_status_t ddp_tensor_slice(const ddp_tensor_t *base, int64_t offset, int ndim,
                                      const int64_t *shape, ddp_tensor_t *out);
DDP_API size_t ddp_tensor_nbytes(const ddp_tensor_t *t);
DDP_API bool ddp_tensor_same_shape(const ddp_tensor_t *a, const ddp_tensor_t *b);
/* Copies src into dst, converting dtype (floating <-> floating, integer <-> integer, and
 * across with C's conversion rules; narrowing to f16/bf16 rounds to nearest even).
 * Shapes must have equal numel. */
DDP_API ddp_status_t ddp_tensor_copy(ddp_tensor_t *dst, const ddp_tensor_t *src);
/* "f32[64, 784]" into buf. */
DDP_API const char *ddp_tensor_describe(const ddp_tensor_t *t, char *buf, size_t len);

/* ---------------------------------------------------------------- BLAS ------------ */

/* Row-major C = alpha * op(A) @ op(B) + beta * C with op(X) = X or X^T.
 * op(A) is M x K, op(B) is K x N, C is M x N; lda/ldb/ldc are row strides in elements.
 * dt is DDP_F32 (sgemm) or DDP_F64 (dgemm). */
DDP_API ddp_status_t ddp_gemm(ddp_dtype_t dt, bool trans_a, bool trans_b, int64_t m, int64_t n,
                              int64_t k, double alpha, const void *a, int64_t lda, const void *b,
                              int64_t ldb, double beta, void *c, int64_t ldc);
/* Replaces the row-major rows x cols matrix a (row stride lda >= cols, rows >= cols) by
 * the Q factor of its reduced QR decomposition: LAPACK's Householder geqrf then orgqr, as
 * torch.linalg.qr(mode="reduced") computes it (LAPACK's sign convention). dt is DDP_F32
 * (sgeqrf/sorgqr) or DDP_F64 (dgeqrf/dorgqr). Allocates a column-major copy. */
DDP_API ddp_status_t ddp_qr_q(ddp_dtype_t dt, int64_t rows, int64_t cols, void *a, int64_t lda);
/* OpenBLAS threads for this process. The first BLAS call sets DDP_BLAS_THREADS (default 1:
 * one thread per rank, so ranks do not oversubscribe the cores). */
DDP_API void ddp_blas_set_threads(int n);
DDP_API int ddp_blas_get_threads(void);
/* The name of the kernel set OpenBLAS runs ("SkylakeX", "Haswell", ...). When OpenBLAS
 * does not know the CPU and falls back to kernels from before AVX2, libddp switches it at
 * load time to the AVX-512 or AVX2 set the CPU supports, unless OPENBLAS_CORETYPE is set
 * (docs/environment.md); every libddp process makes the same choice. */
DDP_API const char *ddp_blas_core(void);

#ifdef __cplusplus
}
#endif
#endif /* DDP_TENSOR_H */
