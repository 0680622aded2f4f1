/* PyTorch parity of the communication hooks (issue 6, "PyTorch parity in CI").
 *
 * Each configuration runs tools/torch_reference.py (real PyTorch 1.13 DDP over gloo, W = 2)
 * with a hook, then the same job in libddp with the same hook on thread ranks, and compares
 * the per-step dumps with ddp-compare (the driver is tests/harness/parity.c, shared with
 * test_ddp_parity): every averaged gradient, parameter and input of every step and rank,
 * and the bucket layouts. Hooks covered: fp16_compress_hook; fp16_compress_wrapper around
 * allreduce_hook; powerSGD_hook at matrix_approximation_rank 1 and 2 with
 * start_powerSGD_iter = 2, warm start on and off.
 *
 * PowerSGD starts Q from random values; PyTorch draws them with torch.randn, libddp with
 * its counter-based generator. torch_reference.py records PyTorch's draws in
 * powersgd_q.safetensors and the libddp side injects them through
 * ddp_powersgd_options_t.init_q (docs/hooks.md), checking that every draw it is asked for
 * exists, has the bucket index and length PyTorch used, and that it consumes exactly the
 * draws PyTorch made. Both sides use one bucket (PyTorch 1.13's PowerSGD deadlocks on gloo
 * with more, spec/numerics.md), so the per-bucket maths coincide.
 *
 * Tolerances (docs/compare.md, "Communication hooks", has the measured figures): the fp16
 * paths at rtol 1e-3 / atol 1e-7 plus 99.9 % of the gradient elements equal (check_fp16
 * says why); PowerSGD at rtol 1e-5 / atol 2e-7: its products and Gram-Schmidt norms sum in
 * other orders than PyTorch's (libddp accumulates the norms in double), error feedback
 * carries that into later steps, and the measured 7.5e-8 is within ddp-compare's default
 * atol of 1e-7; 2e-7 leaves a margin for another BLAS. A control run with libddp's own Q
 * must fail from the first PowerSGD step. Without torch or ddp-compare the tests skip. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/hooks.h"
#include "ddp/io.h"
#include "harness.h"
#include "parity.h"

#define W 2

static const char *const MLP =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

/* The common job: 2 ranks, batch 8, SGD with momentum, one bucket (the MLP's 9.4 KiB of
 * parameters fit in the first bucket; bucket_cap_mb is given explicitly on both sides). */
static ddp_test_pcfg_t base_cfg(const char *name, int steps) {
  ddp_test_pcfg_t c = {.name = name, .model = MLP, .world = W, .steps = steps, .batch = 8,
                       .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = 100,
                       .broadcast_buffers = true, .rebuilt = true};
  return c;
}

static void report(const char *name, const ddp_test_parity_result_t *r) {
  print_message("%-22s grads max abs %.3g rel %.3g, %lld of %lld equal; params max abs %.3g "
                "rel %.3g; buckets %d/%d\n",
                name, r->grad_abs, r->grad_rel, (long long)r->grad_bitwise,
                (long long)r->grad_elements, r->param_abs, r->param_rel, r->buckets_initial,
                r->buckets_rebuilt);
  assert_int_equal(r->buckets_initial, 1);
  assert_int_equal(r->buckets_rebuilt, 1);
}

/* ---------------------------------------------------------------- fp16 ------------ */

static ddp_status_t setup_fp16_hook(ddp_ddp_t *ddp, int rank, const char *torch_dir, void *user,
                                    char *msg, size_t cap) {
  (void)rank, (void)torch_dir, (void)user;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_hooks_configure(ddp, "fp16", "no", NULL, &err);
  if (st != DDP_OK) snprintf(msg, cap, "fp16 hook: %s", err.msg);
  return st;
}

/* The fp16 paths' tolerance: rtol 1e-3 (one fp16 ULP is at most 2^-10 = 9.8e-4 of a
 * normal value), atol 1e-7 (above the fp16 subnormal spacing 2^-24 = 6e-8). The local f32
 * gradients differ from PyTorch's in their last bits (GEMM order), and where one lies next
 * to an fp16 rounding boundary the rounded, divided value differs by one fp16 ULP; nothing
 * else differs. To keep the check sharp, 99.9 % of the gradient elements must be equal:
 * a hook that skipped a rounding would differ almost everywhere. */
static void check_fp16(const char *name, const ddp_test_parity_result_t *r) {
  report(name, r);
  assert_true(r->grad_elements > 0);
  assert_true((double)r->grad_bitwise >= 0.999 * (double)r->grad_elements);
}

static void fp16_tolerance(ddp_test_pcfg_t *c) {
  c->rtol = 1e-3;
  c->atol = 1e-7;
}

static void test_fp16_hook(void **state) {
  (void)state;
  ddp_test_pcfg_t c = base_cfg("fp16_hook", 4);
  c.torch_args = "--comm_hook fp16";
  c.setup = setup_fp16_hook;
  fp16_tolerance(&c);
  ddp_test_parity_result_t r;
  ddp_test_parity(&c, &r);
  check_fp16(c.name, &r);
}

/* fp16_compress_wrapper(allreduce_hook): Accelerate has no name for a wrapper around
 * plain allreduce, so both sides register it directly (torch_reference.py's
 * --comm_hook allreduce is PyTorch's allreduce_hook). */
static ddp_status_t setup_fp16_wrapper(ddp_ddp_t *ddp, int rank, const char *torch_dir,
                                       void *user, char *msg, size_t cap) {
  (void)torch_dir;
  ddp_compress_wrapper_t *wr = (ddp_compress_wrapper_t *)user + rank;
  *wr = (ddp_compress_wrapper_t){DDP_F16, ddp_allreduce_hook, NULL};
  ddp_comm_hook_t h = {ddp_compress_wrapper_hook, wr, "fp16_compress_wrapper(allreduce_hook)",
                       NULL, NULL};
  ddp_error_t err = {0};
  ddp_status_t st = ddp_ddp_register_comm_hook(ddp, &h, &err);
  if (st != DDP_OK) snprintf(msg, cap, "register: %s", err.msg);
  return st;
}

static void test_fp16_wrapper_allreduce(void **state) {
  (void)state;
  ddp_compress_wrapper_t wrappers[W];
  ddp_test_pcfg_t c = base_cfg("fp16_wrapper_allreduce", 4);
  c.torch_args = "--comm_hook allreduce --comm_wrapper fp16";
  c.setup = setup_fp16_wrapper;
  c.setup_user = wrappers;
  fp16_tolerance(&c);
  ddp_test_parity_result_t r;
  ddp_test_parity(&c, &r);
  check_fp16(c.name, &r);
}

/* ---------------------------------------------------------------- PowerSGD -------- */

/* Per rank: PyTorch's recorded Q draws and what init_q saw. */
typedef struct qsrc {
  ddp_st_file_t *f;
  int64_t calls;    /* init_q calls */
  char bad[300];    /* the first mismatch, "" when none */
} qsrc_t;

typedef struct psgd_case {
  int rank;        /* matrix_approximation_rank */
  bool warm_start;
  bool inject;     /* false: libddp's own generator (the control run) */
  qsrc_t q[W];
} psgd_case_t;

/* init_q: copy PyTorch's draw k into Q. A missing draw, another bucket or another length
 * is recorded and Q is filled with NaN, which the comparison cannot miss either. */
static void inject_q(void *user, uint64_t draw, size_t bucket, float *q, size_t n) {
  qsrc_t *s = user;
  s->calls++;
  char name[64], key[64];
  snprintf(name, sizeof name, "draw%llu", (unsigned long long)draw);
  snprintf(key, sizeof key, "bucket%llu", (unsigned long long)draw);
  size_t i;
  ddp_tensor_t t;
  const char *b = ddp_st_meta_get(s->f, key);
  if (ddp_st_find(s->f, name, &i) != DDP_OK || ddp_st_tensor(s->f, i, &t) != DDP_OK ||
      t.dtype != DDP_F32 || (size_t)t.numel != n || !b || strtoull(b, NULL, 10) != bucket) {
    if (!s->bad[0])
      snprintf(s->bad, sizeof s->bad,
               "init_q draw %llu bucket %zu n %zu: PyTorch's draw is missing or differs",
               (unsigned long long)draw, bucket, n);
    for (size_t k = 0; k < n; k++) q[k] = NAN;
    return;
  }
  memcpy(q, t.data, n * sizeof(float));
}

static void free_psgd(void *state) { ddp_powersgd_state_destroy(state); }

static ddp_status_t setup_psgd(ddp_ddp_t *ddp, int rank, const char *torch_dir, void *user,
                               char *msg, size_t cap) {
  psgd_case_t *pc = user;
  qsrc_t *s = &pc->q[rank];
  ddp_error_t err = {0};
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  o.matrix_approximation_rank = pc->rank;
  o.start_powerSGD_iter = 2;
  o.warm_start = pc->warm_start;
  if (pc->inject) {
    o.init_q = inject_q;
    o.init_q_user = s;
  }
  char path[700];
  snprintf(path, sizeof path, "%s/powersgd_q.safetensors", torch_dir);
  ddp_status_t st = ddp_st_open(path, DDP_ST_READ, &s->f, &err);
  if (st != DDP_OK) {
    snprintf(msg, cap, "%s: %s", path, err.msg);
    return st;
  }
  ddp_powersgd_state_t *ps = NULL;
  st = ddp_powersgd_state_create(&o, rank, &ps, &err);
  if (st != DDP_OK) {
    snprintf(msg, cap, "PowerSGDState: %s", err.msg);
    return st;
  }
  ddp_comm_hook_t h = {ddp_powersgd_hook, ps, "powerSGD_hook", ddp_powersgd_stats, free_psgd};
  st = ddp_ddp_register_comm_hook(ddp, &h, &err);
  if (st != DDP_OK) {
    ddp_powersgd_state_destroy(ps);
    snprintf(msg, cap, "register: %s", err.msg);
  }
  return st;
}

/* The control run: the same job with libddp's own random Q instead of PyTorch's. It must
 * agree with PyTorch through the warm-up steps and fail from step 2, the first PowerSGD
 * step, on: the comparison does see the injected Q. */
static void psgd_control(ddp_test_pcfg_t *c, int rank, bool warm_start) {
  char base[512], model[600], A[600], C[600], weights[700];
  snprintf(base, sizeof base, "%s/%s", ddp_test_parity_scratch(), c->name);
  snprintf(model, sizeof model, "%s/model.json", base);
  snprintf(A, sizeof A, "%s/torch", base);
  snprintf(C, sizeof C, "%s/libddp_own_q", base);
  snprintf(weights, sizeof weights, "%s/weights.safetensors", A);
  psgd_case_t own = {.rank = rank, .warm_start = warm_start, .inject = false};
  c->setup_user = &own;
  ddp_test_parity_run_libddp(c, model, weights, C, "{}", DDP_TEST_PARITY_SEED, A);
  for (int k = 0; k < W; k++) {
    assert_int_equal(own.q[k].calls, 0);
    ddp_st_close(own.q[k].f);
  }
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out, "%s --json --rtol %.17g --atol %.17g '%s' '%s'",
                            ddp_test_parity_compare_tool(), c->rtol > 0 ? c->rtol : 1e-5,
                            c->atol, A, C);
  cJSON *j = cJSON_Parse(out);
  if (!j) fail_msg("ddp-compare printed no JSON (exit %d): %s", rc, out);
  free(out);
  assert_int_equal(rc, 1);
  const cJSON *ff = ddp_test_json_get(j, "first_failure");
  const cJSON *step = ddp_test_json_get(ff, "step");
  print_message("%-22s control with libddp's own Q: first failure at step %d, %s\n", c->name,
                step->valueint, ddp_test_json_get(ff, "tensor")->valuestring);
  assert_true(cJSON_IsNumber(step));
  assert_int_equal(step->valueint, 2);
  cJSON_Delete(j);
}

static void psgd_parity(int rank, bool warm_start) {
  enum { STEPS = 5 }; /* 2 warm-up allreduce steps, then 3 PowerSGD steps */
  char name[64], args[256];
  snprintf(name, sizeof name, "powersgd_r%d_warm_%s", rank, warm_start ? "on" : "off");
  snprintf(args, sizeof args,
           "--comm_hook power_sgd --comm_state_option '{\"matrix_approximation_rank\": %d, "
           "\"start_powerSGD_iter\": 2, \"warm_start\": %s}'",
           rank, warm_start ? "true" : "false");
  psgd_case_t pc = {.rank = rank, .warm_start = warm_start, .inject = true};
  ddp_test_pcfg_t c = base_cfg(name, STEPS);
  c.torch_args = args;
  c.setup = setup_psgd;
  c.setup_user = &pc;
  c.atol = 2e-7;
  ddp_test_parity_result_t r;
  ddp_test_parity(&c, &r);
  report(name, &r);
  /* One random start with warm start (kept in the P/Q memories afterwards), one per
   * PowerSGD step without; PyTorch made the same number of draws. */
  int64_t want = warm_start ? 1 : STEPS - 2;
  for (int k = 0; k < W; k++) {
    if (pc.q[k].bad[0]) fail_msg("%s rank %d: %s", name, k, pc.q[k].bad);
    assert_int_equal(pc.q[k].calls, want);
    assert_string_equal(ddp_st_meta_get(pc.q[k].f, "draws"), warm_start ? "1" : "3");
    ddp_st_close(pc.q[k].f);
  }
  if (rank == 1 && warm_start) psgd_control(&c, rank, warm_start);
}

static void test_powersgd_r1_warm(void **state) {
  (void)state;
  psgd_parity(1, true);
}

static void test_powersgd_r1_cold(void **state) {
  (void)state;
  psgd_parity(1, false);
}

static void test_powersgd_r2_warm(void **state) {
  (void)state;
  psgd_parity(2, true);
}

static void test_powersgd_r2_cold(void **state) {
  (void)state;
  psgd_parity(2, false);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fp16_hook),
      cmocka_unit_test(test_fp16_wrapper_allreduce),
      cmocka_unit_test(test_powersgd_r1_warm),
      cmocka_unit_test(test_powersgd_r1_cold),
      cmocka_unit_test(test_powersgd_r2_warm),
      cmocka_unit_test(test_powersgd_r2_cold),
  };
  return ddp_test_parity_main("ddp_hooks_parity", tests, sizeof tests / sizeof *tests);
}
