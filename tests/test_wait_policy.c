/* The shared family's waiting policy (src/algo/wait_policy.c): the budgets of a wait's PAUSE
 * and sched_yield phases as earlier waits ended. Pure bookkeeping, so every rule is checked
 * here without two CPUs or a clock; the collectives that run on it are test_collectives'. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "algo/algo.h"

static void test_start(void **state) {
  (void)state;
  ddp__wait_policy_t p = {0};
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MIN_NS);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_YIELD_NS);
}

/* A peer that answered while this rank spun, or within the long spin while it yielded, is on
 * its own CPU: spin fully next time; a later answer or a sleep: spin the least. */
static void test_spin_adapts(void **state) {
  (void)state;
  ddp__wait_policy_t p = {0};
  ddp__wait_ended(&p, DDP__WAIT_SPUN, 0);
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MAX_NS);
  ddp__wait_ended(&p, DDP__WAIT_YIELDED, DDP__WAIT_SPIN_MAX_NS + 1);
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MIN_NS);
  ddp__wait_ended(&p, DDP__WAIT_YIELDED, DDP__WAIT_SPIN_MAX_NS - 1);
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MAX_NS);
  ddp__wait_ended(&p, DDP__WAIT_SLEPT, DDP__WAIT_YIELD_NS);
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MIN_NS);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_YIELD_NS); /* no wake-up involved */
}

/* After waking a sleeper, the next wait that polls yields for the after-wake budget, once:
 * without it the two ranks fall into sleeping in turn, one wake-up per collective. */
static void test_after_wake_once(void **state) {
  (void)state;
  ddp__wait_policy_t p = {0};
  ddp__wait_woke(&p);
  ddp__wait_woke(&p); /* several wake-ups before the next wait: still one window */
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_AFTER_WAKE_MIN_NS);
  assert_true(DDP__WAIT_AFTER_WAKE_MIN_NS > DDP__WAIT_YIELD_NS);
  ddp__wait_ended(&p, DDP__WAIT_YIELDED, 200 * 1000); /* the late peer came in time */
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_YIELD_NS);
  assert_int_equal(ddp__wait_spin_ns(&p), DDP__WAIT_SPIN_MIN_NS);
  ddp__wait_woke(&p);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_AFTER_WAKE_MIN_NS);
}

/* A window that ran out (the wait slept all the same) doubles for the next wake-up, up to the
 * cap; one that sufficed goes back to the least. */
static void test_after_wake_doubles(void **state) {
  (void)state;
  ddp__wait_policy_t p = {0};
  int64_t want = DDP__WAIT_AFTER_WAKE_MIN_NS;
  for (int i = 0; i < 8; i++) {
    ddp__wait_woke(&p);
    assert_int_equal(ddp__wait_yield_ns(&p), want);
    ddp__wait_ended(&p, DDP__WAIT_SLEPT, want);
    want = 2 * want > DDP__WAIT_AFTER_WAKE_MAX_NS ? DDP__WAIT_AFTER_WAKE_MAX_NS : 2 * want;
  }
  ddp__wait_woke(&p);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_AFTER_WAKE_MAX_NS);
  ddp__wait_ended(&p, DDP__WAIT_SPUN, 0);
  ddp__wait_woke(&p);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_AFTER_WAKE_MIN_NS);
  /* a sleep without a wake-up before it leaves the after-wake budget alone */
  ddp__wait_ended(&p, DDP__WAIT_YIELDED, 10);
  ddp__wait_ended(&p, DDP__WAIT_SLEPT, DDP__WAIT_YIELD_NS);
  ddp__wait_woke(&p);
  assert_int_equal(ddp__wait_yield_ns(&p), DDP__WAIT_AFTER_WAKE_MIN_NS);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_start),
      cmocka_unit_test(test_spin_adapts),
      cmocka_unit_test(test_after_wake_once),
      cmocka_unit_test(test_after_wake_doubles),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
