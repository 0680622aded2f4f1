/* How long a waiter of the shared family polls before it sleeps (algo.h,
 * ddp__wait_policy_t); shared.c's wait_for runs the phases, this file only keeps the
 * budgets, so the rules can be tested without two CPUs and a clock.
 *
 * A wait has three phases timed from its start: poll with PAUSE for the spin budget, then
 * poll with sched_yield until the yield budget, then sleep on the futex. Measured on the
 * 2-vCPU development host shared with other jobs (W=2, 4-byte allreduce, ddp-bench p50):
 * when the two ranks run on different CPUs a flag round trip takes about 1 us and any
 * polling catches it; but often the other CPU is busy with another process and the awaited
 * rank is queued on the waiter's own CPU, where every PAUSE spin only delays it (the old
 * 2000-poll spin, about 90 us on this CPU, set a 90 us floor per barrier; a 5 us spin gives
 * 14 us, a 0.2 us spin 4.4 us). sched_yield hands the CPU to it at once. Sleeping on the
 * futex right away costs a wake-up per barrier (15-20 us under load). With W=4 on the same
 * two CPUs this policy gives 16-20 us where the old short spin gave 60 us.
 *
 * The spin adapts: after a wait that ended within the longer spin bound the peers are
 * answering from their own CPUs, and the next wait spins that long, since each sched_yield costs a
 * system call (0.3-0.5 us here) that a peer arriving 0.3 us later then waits out (4-byte
 * allreduce p50 0.5 to 0.36 us); after a longer wait it spins only the shorter bound again,
 * the policy above for CPUs the ranks share.
 *
 * The yield budget adapts too. A rank that had to wake a sleeping peer knows that peer will
 * reach the next collective late by its wake-up latency, which on a virtual machine whose
 * vCPU went idle is often longer than the 50 us yield budget on the development host. Were this
 * rank to sleep in that wait as well, the peer would have to wake it in turn, arrive early at the
 * one after, and sleep there: each rank then sleeps once per collective for good, and a 0.3 us
 * allreduce takes 150-170 us from one hiccup on (in 16 of 20 ddp-bench runs in such an hour, 89 of
 * their 200 points). So the next wait that polls after waking a sleeper yields for up to the
 * after-wake budget (1 ms at first) before it sleeps: it sees the late peer arrive, neither rank
 * sleeps, and the two run in step again (3 of 400 points stuck against 126 of 400, in runs
 * alternating with the old policy's; docs/benchmarks.md, "What made libddp fast"). A wake-up slower
 * than that budget would keep the pattern going at a slower pace, so a budget that ran out doubles,
 * up to 8 ms, and one that sufficed goes back to 1 ms. The cost is bounded by one such window of
 * polling per wake-up, and the polling yields its CPU to anything runnable. */
#include "algo/algo.h"

int64_t ddp__wait_spin_ns(const ddp__wait_policy_t *p) {
  return p->spin_ns ? p->spin_ns : DDP__WAIT_SPIN_MIN_NS;
}

static int64_t after_wake_ns(const ddp__wait_policy_t *p) {
  return p->after_wake_ns ? p->after_wake_ns : DDP__WAIT_AFTER_WAKE_MIN_NS;
}

int64_t ddp__wait_yield_ns(const ddp__wait_policy_t *p) {
  return p->woke_sleeper ? after_wake_ns(p) : DDP__WAIT_YIELD_NS;
}

void ddp__wait_woke(ddp__wait_policy_t *p) { p->woke_sleeper = true; }

void ddp__wait_ended(ddp__wait_policy_t *p, ddp__wait_phase_t phase, int64_t waited_ns) {
  if (p->woke_sleeper) {
    int64_t w = after_wake_ns(p);
    p->after_wake_ns = phase == DDP__WAIT_SLEPT ? DDP_MIN(2 * w, DDP__WAIT_AFTER_WAKE_MAX_NS)
                                                : DDP__WAIT_AFTER_WAKE_MIN_NS;
    p->woke_sleeper = false;
  }
  bool quick = phase == DDP__WAIT_SPUN ||
               (phase == DDP__WAIT_YIELDED && waited_ns < DDP__WAIT_SPIN_MAX_NS);
  p->spin_ns = quick ? DDP__WAIT_SPIN_MAX_NS : DDP__WAIT_SPIN_MIN_NS;
}
