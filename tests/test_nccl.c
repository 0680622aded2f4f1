/* The nccl backend (suite coll). Exits 77 (skipped) when the backend is not built, and
 * after its GPU-free checks when no GPU is usable.
 *
 * Without a GPU:
 *  - registration: ddp_backend_find("nccl") is the nccl table (link family, with `run`),
 *    and ddp_backend_names() lists it;
 *  - error mapping: each NCCL result and a set of CUDA errors map to the documented status,
 *    and the message carries ncclGetErrorString / cudaGetErrorString (compared with the
 *    strings the libraries themselves return);
 *  - on a machine where cudaGetDeviceCount fails or finds no device, ddp_pg_create with
 *    backend "nccl" fails cleanly with that status and names the CUDA error.
 * With GPUs (tools/maint/gpu_check.sh), for W = 1 and W = min(2, GPUs) (NCCL allows one rank per
 * GPU): every collective on host buffers (staged) and on device buffers, with exact data
 * computed by closed formulas, and D2: random fp32/fp16/bf16 allreduce results bitwise equal
 * to a serial rank-order fold. GPU detection runs in a forked child so that this parent never
 * initialises CUDA before the harness forks ranks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp_config.h"

#if DDP_HAVE_NCCL
#include "backend/nccl/nccl.h"
#include "ddp/backend.h"
#include "ddp/pg.h"
#include "ddp/store.h"
#include "harness.h"

/* The group's last error, copied out under its lock (ddp_pg_last_error_copy); the message
 * of the returned value lives to the end of the caller's full expression. */
static ddp_error_t pg_err(const ddp_pg_t *pg) {
  ddp_error_t e;
  ddp_pg_last_error_copy(pg, &e);
  return e;
}

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- GPU-free checks ---- */

static void test_registration(void **state) {
  (void)state;
  const ddp_backend_ops_t *b = ddp_backend_find("nccl");
  assert_non_null(b);
  assert_string_equal(b->name, "nccl");
  assert_int_equal(b->abi_version, DDP_BACKEND_ABI_VERSION);
  assert_non_null(b->run);
  assert_non_null(b->create);
  assert_non_null(strstr(ddp_backend_names(), "nccl"));
}

static void test_error_mapping(void **state) {
  (void)state;
  static const struct {
    ncclResult_t r;
    ddp_status_t st;
  } nm[] = {{ncclSuccess, DDP_OK},
            {ncclUnhandledCudaError, DDP_ERR_SYSTEM},
            {ncclSystemError, DDP_ERR_REMOTE},
            {ncclInternalError, DDP_ERR_INTERNAL},
            {ncclInvalidArgument, DDP_ERR_INVALID_ARGUMENT},
            {ncclInvalidUsage, DDP_ERR_INVALID_USAGE},
            {ncclRemoteError, DDP_ERR_REMOTE}};
  for (size_t i = 0; i < ARRAY_LEN(nm); i++) {
    assert_int_equal(ddp__nccl_status(nm[i].r), nm[i].st);
    if (nm[i].r == ncclSuccess) continue;
    ddp_error_t err = {0};
    assert_int_equal(ddp__nccl_error(&err, nm[i].r, NULL, "ncclAllReduce"), nm[i].st);
    assert_int_equal(err.status, nm[i].st);
    assert_non_null(strstr(err.msg, ncclGetErrorString(nm[i].r)));
    assert_non_null(strstr(err.msg, "ncclAllReduce: NCCL error"));
  }
  static const struct {
    cudaError_t e;
    ddp_status_t st;
  } cm[] = {{cudaSuccess, DDP_OK},
            {cudaErrorMemoryAllocation, DDP_ERR_NO_MEMORY},
            {cudaErrorNoDevice, DDP_ERR_UNSUPPORTED},
            {cudaErrorInsufficientDriver, DDP_ERR_UNSUPPORTED},
            {cudaErrorInvalidValue, DDP_ERR_SYSTEM},
            {cudaErrorLaunchFailure, DDP_ERR_SYSTEM}};
  for (size_t i = 0; i < ARRAY_LEN(cm); i++) {
    assert_int_equal(ddp__cuda_status(cm[i].e), cm[i].st);
    if (cm[i].e == cudaSuccess) continue;
    ddp_error_t err = {0};
    assert_int_equal(ddp__cuda_error(&err, cm[i].e, "cudaMalloc"), cm[i].st);
    assert_non_null(strstr(err.msg, cudaGetErrorString(cm[i].e)));
    assert_non_null(strstr(err.msg, cudaGetErrorName(cm[i].e)));
  }
}

/* cudaGetDeviceCount in a child: >0 devices, 0 none, -1 the call failed (code in *e). */
static int probe_gpus(int *e) {
  int fd[2];
  if (pipe(fd) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    int rc = (int)cudaGetDeviceCount(&n);
    int msg[2] = {rc, n};
    ssize_t w = write(fd[1], msg, sizeof msg);
    _exit(w == sizeof msg ? 0 : 1);
  }
  close(fd[1]);
  int msg[2] = {-1, 0};
  ssize_t got = read(fd[0], msg, sizeof msg);
  close(fd[0]);
  waitpid(pid, NULL, 0);
  *e = got == sizeof msg ? msg[0] : -1;
  if (got != sizeof msg) return -1;
  return msg[0] != 0 ? -1 : msg[1];
}

static void test_create_without_gpu(void **state) {
  (void)state;
  int e = 0, n = probe_gpus(&e);
  if (n > 0) skip();
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = 5000;
  ddp_store_t *store = NULL;
  assert_int_equal(ddp_store_create_memory(&so, &store, NULL), DDP_OK);
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = "nccl";
  o.store = store;
  o.timeout_ms = 5000;
  ddp_pg_t *pg = NULL;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_pg_create(&o, &pg, &err);
  assert_null(pg);
  assert_int_not_equal(st, DDP_OK);
  print_message("without a GPU: %s\n", err.msg);
  if (e > 0) { /* the call failed: its own string must be in the message */
    assert_int_equal(st, ddp__cuda_status((cudaError_t)e));
    assert_non_null(strstr(err.msg, cudaGetErrorString((cudaError_t)e)));
    assert_non_null(strstr(err.msg, "cudaGetDeviceCount"));
  } else {
    assert_int_equal(st, DDP_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "no CUDA device"));
  }
  ddp_store_destroy(store);
}

/* ---- with GPUs ---- */

static double val_sum(int r, size_t i) { return (double)((r + 1) * (int)(i % 7 + 1)); }

typedef struct gctx {
  ddp_test_rank_t *tr;
  ddp_pg_t *pg;
  int r, W;
  bool device;
  long bad;
} gctx_t;

static ddp_status_t gwait(gctx_t *c, ddp_status_t st, ddp_work_t **w, const char *what) {
  if (st != DDP_OK) {
    ddp_test_say(c->tr, "%s: %s", what, pg_err(c->pg).msg);
    return st;
  }
  st = ddp_work_wait(*w, -1);
  if (st != DDP_OK) ddp_test_say(c->tr, "%s: %s", what, ddp_work_error(*w));
  ddp_work_free(*w);
  return st;
}

/* Host mirror h (float) of a buffer that lives at b (host or device). */
static void *gbuf(gctx_t *c, size_t bytes) {
  if (!c->device) return ddp_malloc(bytes + 4);
  void *p = NULL;
  return cudaMalloc(&p, bytes + 4) == cudaSuccess ? p : NULL;
}
static void gfree(gctx_t *c, void *p) {
  if (c->device) {
    cudaFree(p);
  } else {
    ddp_free(p);
  }
}
static void put(gctx_t *c, void *dst, const void *src, size_t n) {
  if (c->device) {
    cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
  } else {
    memcpy(dst, src, n);
  }
}
static void get(gctx_t *c, void *dst, const void *src, size_t n) {
  if (c->device) {
    cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
  } else {
    memcpy(dst, src, n);
  }
}

static void expect(gctx_t *c, const char *what, const float *got, size_t n,
                   double (*want)(gctx_t *, size_t)) {
  for (size_t i = 0; i < n; i++)
    if (got[i] != (float)want(c, i)) {
      if (c->bad++ == 0)
        ddp_test_say(c->tr, "%s (%s buffers): [%zu] = %g, expected %g", what,
                     c->device ? "device" : "host", i, got[i], want(c, i));
      return;
    }
}

static size_t g_n;
static double w_sum(gctx_t *c, size_t i) {
  double s = 0;
  for (int j = 0; j < c->W; j++) s += val_sum(j, i);
  return s;
}
static double w_gather(gctx_t *c, size_t i) { return val_sum((int)(i / g_n), i % g_n); }
static double w_root(gctx_t *c, size_t i) { return val_sum(0, i); }
static double w_rs(gctx_t *c, size_t i) {
  double s = 0;
  for (int j = 0; j < c->W; j++) s += val_sum(j, (size_t)c->r * g_n + i);
  return s;
}

static ddp_status_t gpu_checks(gctx_t *c) {
  size_t n = g_n, W = (size_t)c->W, nb = n * sizeof(float);
  float *h = ddp_malloc(W * nb + 4), *hr = ddp_malloc(W * nb + 4);
  unsigned char *a = gbuf(c, W * nb), *b = gbuf(c, W * nb);
  ddp_work_t *w = NULL;
  ddp_status_t st = a && b ? DDP_OK : DDP_ERR_NO_MEMORY;
  for (int algo = 0; algo < 2 && st == DDP_OK; algo++) {
    for (size_t i = 0; i < n; i++) h[i] = (float)val_sum(c->r, i);
    put(c, a, h, nb);
    st = gwait(c, ddp_allreduce(c->pg, a, a, n, DDP_F32, DDP_OP_SUM, &w), &w, "allreduce");
    get(c, hr, a, nb);
    if (st == DDP_OK) expect(c, "allreduce", hr, n, w_sum);
  }
  if (st == DDP_OK) {
    for (size_t i = 0; i < n; i++) h[i] = (float)val_sum(c->r, i);
    put(c, a, h, nb);
    st = gwait(c, ddp_broadcast(c->pg, a, n, DDP_F32, 0, &w), &w, "broadcast");
    get(c, hr, a, nb);
    if (st == DDP_OK) expect(c, "broadcast", hr, n, w_root);
  }
  if (st == DDP_OK) {
    for (size_t i = 0; i < n; i++) h[i] = (float)val_sum(c->r, i);
    put(c, a, h, nb);
    st = gwait(c, ddp_allgather(c->pg, a, b, n, DDP_F32, &w), &w, "allgather");
    get(c, hr, b, W * nb);
    if (st == DDP_OK) expect(c, "allgather", hr, W * n, w_gather);
  }
  if (st == DDP_OK) {
    for (size_t i = 0; i < W * n; i++) h[i] = (float)val_sum(c->r, i);
    put(c, a, h, W * nb);
    st = gwait(c, ddp_reduce_scatter(c->pg, a, b, n, DDP_F32, DDP_OP_SUM, &w), &w,
               "reduce_scatter");
    get(c, hr, b, nb);
    if (st == DDP_OK) expect(c, "reduce_scatter", hr, n, w_rs);
  }
  if (st == DDP_OK) st = gwait(c, ddp_barrier(c->pg, &w), &w, "barrier");
  gfree(c, a);
  gfree(c, b);
  ddp_free(h);
  ddp_free(hr);
  return st;
}

/* D2 on host buffers (the generator of tests/test_collectives.c). */
static void d2_fill(ddp_dtype_t dt, void *p, size_t n, int rank) {
  ddp_rng_t g;
  ddp_rng_init(&g, 1234, ddp_rng_stream(DDP_RNG_TEST, (uint32_t)rank, 0));
  for (size_t i = 0; i < n; i++) {
    float v = (ddp_rng_uniform(&g) - 0.5f) * 8.0f * (1.0f + (float)(i % 5));
    switch (dt) {
      case DDP_F32: ((float *)p)[i] = v; break;
      case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16(v); break;
      default: ((uint16_t *)p)[i] = ddp_f32_to_bf16(v); break;
    }
  }
}

static ddp_status_t d2_check(gctx_t *c) {
  static const ddp_dtype_t dts[] = {DDP_F32, DDP_F16, DDP_BF16};
  size_t n = 65539;
  ddp_status_t st = DDP_OK;
  for (size_t d = 0; d < ARRAY_LEN(dts) && st == DDP_OK; d++) {
    ddp_dtype_t dt = dts[d];
    size_t es = ddp_dtype_size(dt);
    unsigned char *buf = ddp_malloc(n * es), *ref = ddp_malloc(n * es), *x = ddp_malloc(n * es);
    d2_fill(dt, buf, n, c->r);
    ddp_work_t *w = NULL;
    st = gwait(c, ddp_allreduce(c->pg, buf, buf, n, dt, DDP_OP_SUM, &w), &w, "D2 allreduce");
    d2_fill(dt, ref, n, 0);
    for (int j = 1; j < c->W; j++) {
      d2_fill(dt, x, n, j);
      for (size_t i = 0; i < n; i++) {
        if (dt == DDP_F32) {
          ((float *)ref)[i] += ((float *)x)[i];
        } else if (dt == DDP_F16) {
          uint16_t *p = (uint16_t *)ref, *q = (uint16_t *)x;
          p[i] = ddp_f32_to_f16(ddp_f16_to_f32(p[i]) + ddp_f16_to_f32(q[i]));
        } else {
          uint16_t *p = (uint16_t *)ref, *q = (uint16_t *)x;
          p[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(p[i]) + ddp_bf16_to_f32(q[i]));
        }
      }
    }
    if (st == DDP_OK && memcmp(buf, ref, n * es) != 0) {
      c->bad++;
      ddp_test_say(c->tr, "D2 %s: not bitwise equal to the rank-order fold", ddp_dtype_name(dt));
    }
    ddp_free(buf);
    ddp_free(ref);
    ddp_free(x);
  }
  return st;
}

static int gpu_rank(ddp_test_rank_t *tr, void *arg) {
  (void)arg;
  int r = ddp_test_rank(tr);
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = 60000;
  so.rank = r;
  ddp_store_t *store = NULL;
  ddp_status_t st = ddp_store_create_file(ddp_test_dir(tr), &so, &store, NULL);
  if (st != DDP_OK) return st;
  char lr[16];
  snprintf(lr, sizeof lr, "%d", r);
  setenv("LOCAL_RANK", lr, 1);
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = "nccl";
  o.rank = r;
  o.world = ddp_test_world_size(tr);
  o.store = store;
  o.timeout_ms = 60000;
  ddp_error_t err = {0};
  gctx_t c = {tr, NULL, r, o.world, false, 0};
  st = ddp_pg_create(&o, &c.pg, &err);
  if (st != DDP_OK) {
    ddp_test_say(tr, "create: %s", err.msg);
    ddp_store_destroy(store);
    return st;
  }
  static const size_t counts[] = {1, 1000, 65539};
  for (int dev = 0; dev < 2 && st == DDP_OK; dev++)
    for (size_t k = 0; k < ARRAY_LEN(counts) && st == DDP_OK; k++) {
      c.device = dev == 1;
      g_n = counts[k];
      st = gpu_checks(&c);
    }
  if (st == DDP_OK) st = d2_check(&c);
  ddp_pg_destroy(c.pg);
  ddp_store_destroy(store);
  if (st == DDP_OK && c.bad) return DDP_ERR_INTERNAL;
  return st;
}

static int g_gpus;

static void test_gpu_collectives(void **state) {
  (void)state;
  int worlds[2] = {1, g_gpus >= 2 ? 2 : 1};
  for (int k = 0; k < (g_gpus >= 2 ? 2 : 1); k++) {
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = worlds[k];
    o.mode = DDP_TEST_FORK;
    o.timeout_ms = 120000;
    ddp_test_results_t *res = ddp_test_spawn(&o, gpu_rank, NULL);
    ddp_test_expect_ok(res);
    ddp_test_results_free(res);
  }
}

int main(void) {
  if (!ddp_backend_find("nccl")) {
    printf(
        "skip: the nccl backend is not built (CUDA and NCCL were not found at configure time)\n");
    return 77;
  }
  const struct CMUnitTest cpu[] = {
      cmocka_unit_test(test_registration),
      cmocka_unit_test(test_error_mapping),
      cmocka_unit_test(test_create_without_gpu),
  };
  int rc = cmocka_run_group_tests_name("nccl without a GPU", cpu, NULL, NULL);
  if (rc != 0) return rc;
  int e = 0;
  g_gpus = probe_gpus(&e);
  if (g_gpus <= 0) {
    printf("skip: no usable GPU (cudaGetDeviceCount: %s); the GPU tests run under "
           "tools/maint/gpu_check.sh\n",
           g_gpus < 0 ? cudaGetErrorString((cudaError_t)e) : "0 devices");
    return 77;
  }
  const struct CMUnitTest gpu[] = {
      cmocka_unit_test(test_gpu_collectives),
  };
  return cmocka_run_group_tests_name("nccl on GPUs", gpu, NULL, NULL);
}
#else
int main(void) {
  printf("skip: the nccl backend is not built (CUDA and NCCL were not found at configure time)\n");
  return 77;
}
#endif
