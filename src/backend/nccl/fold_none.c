/* The nccl backend's fold without a CUDA compiler (nvcc was not found at configure time):
 * no device kernel is built, and the backend folds canonical slices on the host instead
 * (src/backend/nccl/nccl.c, reduce_owned). */
#include "backend/nccl/nccl.h"

bool ddp__nccl_have_fold_kernel(void) { return false; }

cudaError_t ddp__nccl_fold_launch(int dtype, int op, int world, const void *base,
                                  size_t stride_bytes, void *dst, size_t n, cudaStream_t stream) {
  (void)dtype, (void)op, (void)world, (void)base, (void)stride_bytes, (void)dst, (void)n,
      (void)stream;
  return cudaErrorNotSupported;
}
