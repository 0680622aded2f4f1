/* Private interface of the tensor layer's reduction kernels (reduce.c): the element-wise
 * arithmetic of every reduction in the collectives. The algorithms (src/algo) and the
 * backends that reduce with their own code (mpi, nccl) both use it; it sits below them, so
 * neither includes a header of the other. Not installed. */
#ifndef DDP_SRC_TENSOR_REDUCE_H
#define DDP_SRC_TENSOR_REDUCE_H

#include "common/common.h"
#include "ddp/tensor.h"

/* The scratch block ddp__reduce_fold folds in. */
#define DDP__FOLD_TMP_BYTES (64u * 1024u)

/* acc: dst[i] = dst[i] op src[i] (AVG accumulates as SUM). fp16 and bf16 compute in fp32
 * and round after every operation. */
void ddp__reduce_acc(ddp_dtype_t dt, ddp_redop_t op, void *dst, const void *src, size_t n);
/* dst[i] /= world, for AVG after the last addition. */
void ddp__reduce_avg(ddp_dtype_t dt, void *dst, size_t n, int world);
/* dst[i] = (((srcs[0][i] op srcs[1][i]) op srcs[2][i]) ...), the rank-order left fold over
 * nsrc sources, then the AVG division. dst may alias any source: each block of
 * DDP__FOLD_TMP_BYTES is folded in tmp before it is written. */
void ddp__reduce_fold(ddp_dtype_t dt, ddp_redop_t op, int nsrc, const void *const *srcs,
                      void *dst, size_t n, unsigned char *tmp, int world);

/* Balanced partition of n elements into parts: part j is [lo, lo+len). The canonical
 * algorithm's slices (rank j owns part j), wherever it runs (src/algo, nccl). */
static inline void ddp__part(size_t n, int parts, int j, size_t *lo, size_t *len) {
  size_t q = n / (size_t)parts, r = n % (size_t)parts, jj = (size_t)j;
  *lo = jj * q + (jj < r ? jj : r);
  *len = q + (jj < r ? 1 : 0);
}

#endif /* DDP_SRC_TENSOR_REDUCE_H */
