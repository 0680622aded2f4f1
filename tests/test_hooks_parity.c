/* PyTorch parity of the communication hooks (issue 6, "PyTorch parity in CI"; issue 8:
 * through ddp-train).
 *
 * Each configuration runs tools/torch/torch_reference.py (real PyTorch 1.13 DDP over gloo, W = 2)
 * with a hook, then the same job through tools/ddp-train with the same --comm_hook,
 * --comm_wrapper and --comm_state_option on thread ranks, and compares the per-step dumps
 * with ddp-compare (the driver is tests/harness/parity.c, shared with test_ddp_parity):
 * every averaged gradient, parameter and input of every step and rank, and the bucket
 * layouts. Hooks covered: fp16_compress_hook; fp16_compress_wrapper around allreduce_hook;
 * powerSGD_hook at matrix_approximation_rank 1 and 2 with start_powerSGD_iter = 2, warm
 * start on and off.
 *
 * PowerSGD starts Q from random values; PyTorch draws them with torch.randn, libddp with
 * its counter-based generator. torch_reference.py records PyTorch's draws in
 * powersgd_q.safetensors and ddp-train injects them (--power_sgd_init_q, docs/train.md),
 * failing the run when a draw it is asked for is missing or has another bucket index or
 * length than PyTorch's, or when it made another number of draws than PyTorch did; the
 * tests check that ddp-train does fail on both. Both sides use one bucket (PyTorch 1.13's
 * PowerSGD deadlocks on gloo with more, spec/numerics.md), so the per-bucket maths
 * coincide.
 *
 * Tolerances (docs/compare.md, "Communication hooks", has the measured figures): the fp16
 * paths at rtol 1e-3 / atol 1e-7 plus 99.9 % of the gradient elements equal (check_fp16
 * says why); PowerSGD at rtol 1e-5 / atol 2e-7: its products and Gram-Schmidt norms sum in
 * other orders than PyTorch's (libddp accumulates the norms in double), error feedback
 * carries that into later steps, and the measured 7.5e-8 is within ddp-compare's default
 * atol of 1e-7; 2e-7 leaves a margin for another BLAS. A control run with libddp's own Q
 * must fail from the first PowerSGD step. Without torch or the tools the tests skip. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/io.h"
#include "harness.h"
#include "parity.h"

#define W 2

static const char *const MLP =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

/* The common job: 2 ranks, batch 8, SGD with momentum, one bucket (the MLP's 9.4 KiB of
 * parameters fit in the first bucket; bucket_cap_mb is given explicitly on both sides). */
static ddp_test_pcfg_t base_cfg(const char *name, int steps, const char *hook_args) {
  ddp_test_pcfg_t c = {.name = name,
                       .model = MLP,
                       .world = W,
                       .steps = steps,
                       .batch = 8,
                       .accum = 1,
                       .lr = 0.1,
                       .momentum = 0.9,
                       .bucket_cap_mb = 100,
                       .broadcast_buffers = true,
                       .rebuilt = true,
                       .hook_args = hook_args};
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

/* The fp16 paths' tolerance: rtol 1e-3 (one fp16 ULP is at most 2^-10 = 9.8e-4 of a
 * normal value), atol 1e-7 (above the fp16 subnormal spacing 2^-24 = 6e-8). The local f32
 * gradients differ from PyTorch's in their last bits (GEMM order), and where one lies next
 * to an fp16 rounding boundary the rounded, divided value differs by one fp16 ULP; nothing
 * else differs. To keep the check sharp, 99.9 % of the gradient elements must be equal:
 * a hook that skipped a rounding would differ almost everywhere. */
static void fp16_parity(const char *name, const char *hook_args) {
  ddp_test_pcfg_t c = base_cfg(name, 4, hook_args);
  c.rtol = 1e-3;
  c.atol = 1e-7;
  ddp_test_parity_result_t r;
  ddp_test_parity(&c, &r);
  report(name, &r);
  assert_true(r.grad_elements > 0);
  assert_true((double)r.grad_bitwise >= 0.999 * (double)r.grad_elements);
}

static void test_fp16_hook(void **state) {
  (void)state;
  fp16_parity("fp16_hook", "--comm_hook fp16");
}

/* fp16_compress_wrapper(allreduce_hook): Accelerate has no name for a wrapper around
 * plain allreduce; torch_reference.py and ddp-train both call PyTorch's allreduce_hook
 * "allreduce". */
static void test_fp16_wrapper_allreduce(void **state) {
  (void)state;
  fp16_parity("fp16_wrapper_allreduce", "--comm_hook allreduce --comm_wrapper fp16");
}

/* ---------------------------------------------------------------- PowerSGD -------- */

/* PowerSGD's hook arguments, the same for both tools. */
static void psgd_args(char *buf, size_t cap, int rank, bool warm_start) {
  snprintf(buf, cap,
           "--comm_hook power_sgd --comm_state_option '{\"matrix_approximation_rank\": %d, "
           "\"start_powerSGD_iter\": 2, \"warm_start\": %s}'",
           rank, warm_start ? "true" : "false");
}

/* ddp-train on c with extra arguments must fail (exit 1) with needle in its message. */
static void expect_train_failure(const ddp_test_pcfg_t *c, const char *dir, const char *extra,
                                 const char *needle) {
  char A[600];
  snprintf(A, sizeof A, "%s/%s/torch", ddp_test_parity_scratch(), c->name);
  int rc = ddp_test_parity_train(c, A, dir, extra);
  char *err = ddp_test_cmd_stderr();
  if (rc != 1 || !err || !strstr(err, needle)) {
    fail_msg("%s with %s: exit %d (want 1), message lacks \"%s\": %s", c->name, extra, rc, needle,
             err ? err : "(none)");
  }
  const char *hit = strstr(err, needle), *line = hit;
  while (line > err && line[-1] != '\n') line--;
  print_message("%-22s with %s: %.*s\n", c->name, extra, (int)strcspn(line, "\n"), line);
  free(err);
}

/* The control run: the same job with libddp's own random Q instead of PyTorch's. It must
 * agree with PyTorch through the warm-up steps and fail from step 2, the first PowerSGD
 * step, on: the comparison does see the injected Q. */
static void psgd_control(const ddp_test_pcfg_t *injected) {
  char A[600], C[600];
  snprintf(A, sizeof A, "%s/%s/torch", ddp_test_parity_scratch(), injected->name);
  snprintf(C, sizeof C, "%s/%s/libddp_own_q", ddp_test_parity_scratch(), injected->name);
  ddp_test_pcfg_t c = *injected;
  c.inject_q = false;
  int rc = ddp_test_parity_train(&c, A, C, NULL);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("%s: ddp-train with its own Q exited %d", c.name, rc);
  }
  char *out = NULL;
  rc = ddp_test_run_cmd(&out, "%s --json --rtol %.17g --atol %.17g '%s' '%s'",
                        ddp_test_parity_compare_tool(), c.rtol > 0 ? c.rtol : 1e-5, c.atol, A, C);
  cJSON *j = cJSON_Parse(out);
  if (!j) fail_msg("ddp-compare printed no JSON (exit %d): %s", rc, out);
  free(out);
  assert_int_equal(rc, 1);
  const cJSON *ff = ddp_test_json_get(j, "first_failure");
  const cJSON *step = ddp_test_json_get(ff, "step");
  print_message("%-22s control with libddp's own Q: first failure at step %d, %s\n", c.name,
                step->valueint, ddp_test_json_get(ff, "tensor")->valuestring);
  assert_true(cJSON_IsNumber(step));
  assert_int_equal(step->valueint, 2);
  cJSON_Delete(j);
}

static void psgd_parity(int rank, bool warm_start) {
  enum { STEPS = 5 }; /* 2 warm-up allreduce steps, then 3 PowerSGD steps */
  char name[64], args[256];
  snprintf(name, sizeof name, "powersgd_r%d_warm_%s", rank, warm_start ? "on" : "off");
  psgd_args(args, sizeof args, rank, warm_start);
  ddp_test_pcfg_t c = base_cfg(name, STEPS, args);
  c.inject_q = true;
  c.atol = 2e-7;
  ddp_test_parity_result_t r;
  ddp_test_parity(&c, &r);
  report(name, &r);
  /* PyTorch drew once with warm start (the P/Q memories keep Q afterwards), once per
   * PowerSGD step without; ddp-train has checked that it made as many draws, each with
   * PyTorch's bucket index and length. */
  char path[700];
  snprintf(path, sizeof path, "%s/%s/torch/powersgd_q.safetensors", ddp_test_parity_scratch(),
           name);
  ddp_st_file_t *f = NULL;
  assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, NULL), DDP_OK);
  assert_string_equal(ddp_st_meta_get(f, "draws"), warm_start ? "1" : "3");
  ddp_st_close(f);
  /* ... and ddp-train does refuse Q draws of another job. */
  char dir[600];
  snprintf(dir, sizeof dir, "%s/%s/libddp_refused", ddp_test_parity_scratch(), name);
  if (rank == 1 && warm_start) {
    psgd_control(&c);
    /* At rank 2 each Q has twice the values of PyTorch's rank-1 draws. */
    expect_train_failure(&c, dir,
                         "--comm_state_option '{\"matrix_approximation_rank\": 2, "
                         "\"start_powerSGD_iter\": 2}'",
                         "does not fit PyTorch's: its length differs");
  } else if (rank == 1) {
    expect_train_failure(&c, dir, "--max_steps 4", "made 3 random Q draws and this one 2");
  }
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
      cmocka_unit_test(test_fp16_hook),        cmocka_unit_test(test_fp16_wrapper_allreduce),
      cmocka_unit_test(test_powersgd_r1_warm), cmocka_unit_test(test_powersgd_r1_cold),
      cmocka_unit_test(test_powersgd_r2_warm), cmocka_unit_test(test_powersgd_r2_cold),
  };
  return ddp_test_parity_main("ddp_hooks_parity", tests, sizeof tests / sizeof *tests);
}
