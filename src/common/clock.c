/* Monotonic time and deadlines. Every wait in libddp is bounded by a deadline in
 * CLOCK_MONOTONIC nanoseconds. */
#include <limits.h>
#include <time.h>

#include "common/common.h"

int64_t ddp_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t ddp_deadline_from(int64_t now_ns, int64_t ms) {
  if (ms < 0 || ms > (INT64_MAX - now_ns) / 1000000LL) return INT64_MAX;
  return now_ns + ms * 1000000LL;
}

int64_t ddp_deadline_after_ms(int64_t ms) {
  return ms < 0 ? INT64_MAX : ddp_deadline_from(ddp_now_ns(), ms);
}

int ddp_ms_until(int64_t deadline_ns) {
  if (deadline_ns == INT64_MAX) return INT_MAX;
  int64_t left = deadline_ns - ddp_now_ns();
  if (left <= 0) return 0;
  int64_t ms = (left + 999999) / 1000000;
  return ms > INT_MAX ? INT_MAX : (int)ms;
}
