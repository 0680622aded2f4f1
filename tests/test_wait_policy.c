/* The shared family's waiting policy (src/algo/wait_policy.c): the budgets of a wait's PAUSE
 * and sched_yield phases as earlier waits ended. The rules are pure bookkeeping, checked
 * without two CPUs or a clock; one test checks the wiring in shared.c (a barrier that wakes
 * a sleeping peer records it for the waker only). The collectives themselves are
 * test_collectives'. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <time.h>

#include "algo/algo.h"
#include "ddp/pg.h"
#include "pg/pg_internal.h"

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

/* Two thread ranks: rank 1 arrives at a barrier 200 ms after rank 0, which has long gone to
 * sleep on the futex by then (its yield budget is 50 us), so rank 1's arrival wakes it. Each
 * rank records, after the barrier, whether its policy holds a wake-up; the main thread
 * asserts. Rank 1's own wait found rank 0 arrived, so it polled nothing and kept the record
 * for its next wait; rank 0 woke nobody. */
typedef struct wake_probe {
  bool woke[2];
} wake_probe_t;

static ddp_status_t wake_rank(ddp_pg_t *pg, void *arg) {
  wake_probe_t *p = arg;
  int r = ddp_pg_rank(pg);
  DDP_CHECK(ddp_barrier(pg, NULL)); /* both up, no one asleep yet */
  if (r == 1) {
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  DDP_CHECK(ddp_barrier(pg, NULL));
  p->woke[r] = pg->comm.wait.woke_sleeper;
  return ddp_barrier(pg, NULL); /* after the records: its wait may consume them */
}

static void test_barrier_records_wake(void **state) {
  (void)state;
  wake_probe_t p = {{true, false}};
  assert_int_equal(ddp_spawn_threads(2, NULL, wake_rank, &p), DDP_OK);
  assert_false(p.woke[0]); /* rank 0 slept and was woken; it woke nobody */
  assert_true(p.woke[1]);  /* rank 1 woke the sleeper */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_start),
      cmocka_unit_test(test_spin_adapts),
      cmocka_unit_test(test_after_wake_once),
      cmocka_unit_test(test_after_wake_doubles),
      cmocka_unit_test(test_barrier_records_wake),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
