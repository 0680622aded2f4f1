/* The BLAS wrapper: the only file in libddp that calls OpenBLAS.
 *
 * OpenBLAS keeps one process-wide thread pool. Left alone it starts one thread per core in
 * every rank, and W ranks on a laptop then fight over the cores; so the first BLAS call
 * sets the pool to DDP_BLAS_THREADS (default 1 per rank), and ddp_blas_set_threads
 * changes it explicitly. */
#include <cblas.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/tensor.h"

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;

/* Kernel choice. A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels from the CPU model
 * when it loads. A model newer than the library (0.3.21 does not know family 6 model 207,
 * Emerald Rapids, for one) falls back to the SSE3 "Prescott" kernels, about 3.5x slower
 * for sgemm than the AVX-512 ones the CPU can run; PyTorch has the same problem when it
 * goes through that OpenBLAS. So, once per process and before main() (one thread, no BLAS
 * call in flight), when the user has not set OPENBLAS_CORETYPE, the library picked a core
 * from before AVX2, and the CPU has AVX-512 (or AVX2 + FMA), OpenBLAS's own selection is
 * run again with OPENBLAS_CORETYPE set to SkylakeX (or Haswell) and the variable is then
 * removed. The entry points are looked up with dlsym, so a BLAS without them (a
 * single-architecture build) is left as it is. Every process linked with libddp makes the
 * same choice, which keeps threads, processes and launchers bitwise comparable. */
static char blas_switched_from[24], blas_switched_to[24];

#if defined(__x86_64__) && defined(__GNUC__)
static const char *blas_better_core(const char *current) {
  static const char *const old[] = {"Prescott",   "Core2",     "Penryn",    "Dunnington",
                                    "Nehalem",    "Atom",      "Barcelona", "Katmai",
                                    "Coppermine", "Northwood", "Banias",    "Sandybridge"};
  bool is_old = false;
  for (size_t i = 0; i < DDP_ARRAY_LEN(old); i++) is_old |= !strcasecmp(current, old[i]);
  if (!is_old) return NULL;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return NULL;
}

__attribute__((constructor)) static void blas_pick_kernels(void) {
  if (ddp_env_is_set(DDP_ENV_OPENBLAS_CORETYPE)) return;
  void (*quit)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit");
  void (*init)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init");
  const char *now = openblas_get_corename();
  const char *to = now ? blas_better_core(now) : NULL;
  if (!quit || !init || !to) return;
  snprintf(blas_switched_from, sizeof blas_switched_from, "%s", now);
  if (setenv("OPENBLAS_CORETYPE", to, 1) != 0) return;
  quit();
  init();
  unsetenv("OPENBLAS_CORETYPE");
  snprintf(blas_switched_to, sizeof blas_switched_to, "%s", openblas_get_corename());
}
#endif

const char *ddp_blas_core(void) { return openblas_get_corename(); }

static void threads_init(void) {
  int64_t n = 1;
  if (ddp_env_int(DDP_ENV_BLAS_THREADS, 1, 1024, &n, NULL) != DDP_OK) n = 1;
  openblas_set_num_threads((int)n);
  if (blas_switched_from[0]) {
    ddp__log(-1, DDP_LOG_INFO,
             "OpenBLAS chose its %s kernels for this CPU; libddp switched them to %s (set "
             "OPENBLAS_CORETYPE to choose yourself)",
             blas_switched_from, blas_switched_to);
  }
}

void ddp_blas_set_threads(int n) {
  pthread_once(&threads_once, threads_init);
  openblas_set_num_threads(n < 1 ? 1 : n);
}

int ddp_blas_get_threads(void) {
  pthread_once(&threads_once, threads_init);
  return openblas_get_num_threads();
}

ddp_status_t ddp_gemm(ddp_dtype_t dt, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                      double alpha, const void *a, int64_t lda, const void *b, int64_t ldb,
                      double beta, void *c, int64_t ldc) {
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX ||
      ldb > INT_MAX || ldc > INT_MAX) {
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
      cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, (float)alpha, a, ilda, b, ildb,
                  (float)beta, c, ildc);
      return DDP_OK;
    case DDP_F64:
      cblas_dgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, ilda, b, ildb, beta, c,
                  ildc);
      return DDP_OK;
    default: return DDP_ERR_UNSUPPORTED;
  }
}

/* LAPACK's Fortran entry points, exported by libopenblas. */
void sgeqrf_(const int *m, const int *n, float *a, const int *lda, float *tau, float *work,
             const int *lwork, int *info);
void sorgqr_(const int *m, const int *n, const int *k, float *a, const int *lda, const float *tau,
             float *work, const int *lwork, int *info);
void dgeqrf_(const int *m, const int *n, double *a, const int *lda, double *tau, double *work,
             const int *lwork, int *info);
void dorgqr_(const int *m, const int *n, const int *k, double *a, const int *lda, const double *tau,
             double *work, const int *lwork, int *info);

/* LAPACK is column-major: the row-major matrix is transposed into a rows x cols
 * column-major copy, factored in place (geqrf leaves R and the Householder vectors, orgqr
 * forms the first cols columns of Q from them), and transposed back. The workspace is
 * sized generously (64 blocks per column) instead of by a query, which keeps one call
 * sequence for both precisions. */
ddp_status_t ddp_qr_q(ddp_dtype_t dt, int64_t rows, int64_t cols, void *a, int64_t lda) {
  if (rows < 0 || cols < 0 || rows < cols || rows > INT_MAX / 2 || lda < cols || (rows > 0 && !a))
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
