/* Internal interface of the nccl backend: CUDA and NCCL error mapping, exposed so tests can
 * check it on machines without a GPU. */
#ifndef DDP_SRC_NCCL_H
#define DDP_SRC_NCCL_H

#include <cuda_runtime.h>
#include <nccl.h>

#include "common/common.h"

/* The status a CUDA error maps to: DDP_OK for cudaSuccess; NO_MEMORY for allocation
 * failures; UNSUPPORTED when there is no usable device or driver; SYSTEM otherwise. */
ddp_status_t ddp__cuda_status(cudaError_t e);
/* The status an NCCL result maps to: DDP_OK; REMOTE for system and remote errors (a peer
 * or the network); INVALID_ARGUMENT / INVALID_USAGE for misuse; SYSTEM for unhandled CUDA
 * errors; INTERNAL otherwise. */
ddp_status_t ddp__nccl_status(ncclResult_t r);
/* Fill err (quietly: the caller logs, once) with "<what>: CUDA error N (name):
 * <cudaGetErrorString>" or "<what>: NCCL error N: <ncclGetErrorString> (<ncclGetLastError>)"
 * and return the mapped status; comm may be NULL. No rank prefix: a collective's failure
 * gets it from the group, a create's from create_failed. */
ddp_status_t ddp__cuda_error(ddp_error_t *err, cudaError_t e, const char *what);
ddp_status_t ddp__nccl_error(ddp_error_t *err, ncclResult_t r, ncclComm_t comm, const char *what);

/* The ordered reduction kernel (fold.cu, built with nvcc; fold_none.c without it): enqueues
 * dst[i] = fold in rank order over j < world of (base + j * stride_bytes)[i], then the AVG
 * division, with the host fold's exact arithmetic (ddp_reduce_fold). dtype and op are
 * ddp_dtype_t and ddp_redop_t values. Returns the launch's error. */
bool ddp__nccl_have_fold_kernel(void);
cudaError_t ddp__nccl_fold_launch(int dtype, int op, int world, const void *base,
                                  size_t stride_bytes, void *dst, size_t n, cudaStream_t stream);

#endif /* DDP_SRC_NCCL_H */
