/* The BLAS wrapper: the only file in libddp that calls OpenBLAS.
 *
 * OpenBLAS keeps one process-wide thread pool. Left alone it starts one thread per core in
 * every rank, and W ranks on a laptop then fight over the cores; so the first BLAS call
 * sets the pool to DDP_BLAS_THREADS (default 1 per rank), and ddp_blas_set_threads
 * changes it explicitly. */
#include <cblas.h>
#include <limits.h>
#include <pthread.h>

#include "common/common.h"
#include "ddp/tensor.h"

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;

static void threads_init(void) {
  int64_t n = 1;
  if (ddp_env_int(DDP_ENV_BLAS_THREADS, 1, 1024, &n, NULL) != DDP_OK) n = 1;
  openblas_set_num_threads((int)n);
}

void ddp_blas_set_threads(int n) {
  pthread_once(&threads_once, threads_init);
  openblas_set_num_threads(n < 1 ? 1 : n);
}

int ddp_blas_get_threads(void) {
  pthread_once(&threads_once, threads_init);
  return openblas_get_num_threads();
}

ddp_status_t ddp_gemm(ddp_dtype_t dt, bool trans_a, bool trans_b, int64_t m, int64_t n,
                      int64_t k, double alpha, const void *a, int64_t lda, const void *b,
                      int64_t ldb, double beta, void *c, int64_t ldc) {
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX ||
      lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX) {
    return DDP_ERR_INVALID_ARGUMENT;
  }
  if (lda < (trans_a ? m : k) || ldb < (trans_b ? k : n) || ldc < n) {
    return DDP_ERR_INVALID_ARGUMENT;
  }
  if (m == 0 || n == 0) return DDP_OK;
  pthread_once(&threads_once, threads_init);
  enum CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  enum CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  /* BLAS requires ld >= 1 even for empty inner dimensions. */
  int ilda = (int)DDP_MAX(lda, 1), ildb = (int)DDP_MAX(ldb, 1), ildc = (int)DDP_MAX(ldc, 1);
  switch (dt) {
    case DDP_F32:
      cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, (float)alpha, a, ilda, b,
                  ildb, (float)beta, c, ildc);
      return DDP_OK;
    case DDP_F64:
      cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, ilda, b, ildb,
                  beta, c, ildc);
      return DDP_OK;
    default:
      return DDP_ERR_UNSUPPORTED;
  }
}

/* LAPACK's Fortran entry points, exported by libopenblas. */
void sgeqrf_(const int *m, const int *n, float *a, const int *lda, float *tau, float *work,
             const int *lwork, int *info);
void sorgqr_(const int *m, const int *n, const int *k, float *a, const int *lda,
             const float *tau, float *work, const int *lwork, int *info);
void dgeqrf_(const int *m, const int *n, double *a, const int *lda, double *tau, double *work,
             const int *lwork, int *info);
void dorgqr_(const int *m, const int *n, const int *k, double *a, const int *lda,
             const double *tau, double *work, const int *lwork, int *info);

/* LAPACK is column-major: the row-major matrix is transposed into a rows x cols
 * column-major copy, factored in place (geqrf leaves R and the Householder vectors, orgqr
 * forms the first cols columns of Q from them), and transposed back. The workspace is
 * sized generously (64 blocks per column) instead of by a query, which keeps one call
 * sequence for both precisions. */
ddp_status_t ddp_qr_q(ddp_dtype_t dt, int64_t rows, int64_t cols, void *a, int64_t lda) {
  if (rows < 0 || cols < 0 || rows < cols || rows > INT_MAX / 2 || lda < cols ||
      (rows > 0 && !a))
    return DDP_ERR_INVALID_ARGUMENT;
  if (dt != DDP_F32 && dt != DDP_F64) return DDP_ERR_UNSUPPORTED;
  if (cols == 0) return DDP_OK;
  pthread_once(&threads_once, threads_init);
  size_t es = ddp_dtype_size(dt);
  int m = (int)rows, n = (int)cols, lwork = (int)DDP_MAX(1, 64 * cols), info = 0;
  char *cm = ddp__malloc((size_t)rows * (size_t)cols * es);
  char *tau = ddp__malloc((size_t)cols * es);
  char *work = ddp__malloc((size_t)lwork * es);
  ddp_status_t st = DDP_OK;
  if (!cm || !tau || !work) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  if (dt == DDP_F32) {
    float *x = (float *)a, *c = (float *)cm;
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < cols; j++) c[j * rows + i] = x[i * lda + j];
    sgeqrf_(&m, &n, c, &m, (float *)tau, (float *)work, &lwork, &info);
    if (info == 0) sorgqr_(&m, &n, &n, c, &m, (float *)tau, (float *)work, &lwork, &info);
    for (int64_t i = 0; i < rows && info == 0; i++)
      for (int64_t j = 0; j < cols; j++) x[i * lda + j] = c[j * rows + i];
  } else {
    double *x = (double *)a, *c = (double *)cm;
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < cols; j++) c[j * rows + i] = x[i * lda + j];
    dgeqrf_(&m, &n, c, &m, (double *)tau, (double *)work, &lwork, &info);
    if (info == 0) dorgqr_(&m, &n, &n, c, &m, (double *)tau, (double *)work, &lwork, &info);
    for (int64_t i = 0; i < rows && info == 0; i++)
      for (int64_t j = 0; j < cols; j++) x[i * lda + j] = c[j * rows + i];
  }
  if (info != 0) st = DDP_ERR_INTERNAL;
out:
  ddp__free(cm);
  ddp__free(tau);
  ddp__free(work);
  return st;
}
