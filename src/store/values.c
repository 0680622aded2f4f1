/* What every store does with values and key lists, below the stores and the TCP server that
 * share it: counters stored as decimal text (add's contract in ddp/store.h), overflow-checked
 * sums, copies of values, and the short key lists of timeout messages. */
#include <stdio.h>
#include <string.h>

#include "store/store_internal.h"

void ddp__store_format_keys(char *buf, size_t cap, const char *const *keys, size_t n) {
  size_t used = 0;
  buf[0] = '\0';
  size_t shown = n < 4 ? n : 4;
  for (size_t i = 0; i < shown && used < cap; i++) {
    int w = snprintf(buf + used, cap - used, "%s'%.200s'", i ? ", " : "", keys[i]);
    if (w < 0) break;
    used += (size_t)w;
  }
  if (n > shown && used < cap) snprintf(buf + used, cap - used, " and %zu more", n - shown);
}

bool ddp__store_parse_i64(const void *v, size_t n, int64_t *out) {
  const unsigned char *p = v;
  if (n == 0 || n > 20) return false;
  size_t i = 0;
  bool neg = false;
  if (p[0] == '-' || p[0] == '+') {
    neg = p[0] == '-';
    i = 1;
    if (n == 1) return false;
  }
  uint64_t acc = 0;
  for (; i < n; i++) {
    if (p[i] < '0' || p[i] > '9') return false;
    acc = acc * 10 + (uint64_t)(p[i] - '0');
    if (acc > (uint64_t)INT64_MAX + 1) return false;
  }
  if (!neg && acc > (uint64_t)INT64_MAX) return false;
  *out = neg ? (int64_t)(0 - acc) : (int64_t)acc;
  return true;
}

bool ddp__store_add_i64(int64_t a, int64_t b, int64_t *out) {
  return !__builtin_add_overflow(a, b, out);
}

void *ddp__store_dup_value(const void *v, size_t n) {
  void *p = ddp_malloc(n);
  if (p && n) memcpy(p, v, n);
  return p;
}
