/* The value printers and the failure report of the equality asserts (asserts.h). */
#include "asserts.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

void ddp_test_fmt_i(char *buf, size_t n, long long v) { snprintf(buf, n, "%lld", v); }

void ddp_test_fmt_u(char *buf, size_t n, unsigned long long v) {
  if (v < 10)
    snprintf(buf, n, "%llu", v);
  else
    snprintf(buf, n, "%llu (%#llx)", v, v);
}

void ddp_test_fmt_f(char *buf, size_t n, float v) { snprintf(buf, n, "%.9g (%a)", v, v); }

void ddp_test_fmt_d(char *buf, size_t n, double v) { snprintf(buf, n, "%.17g (%a)", v, v); }

void ddp_test_fmt_ld(char *buf, size_t n, long double v) { snprintf(buf, n, "%.21Lg (%La)", v, v); }

void ddp_test_fmt_p(char *buf, size_t n, const volatile void *v) {
  snprintf(buf, n, "%p", (const void *)v);
}

void ddp_test_fmt_str(char *buf, size_t n, const char *s) {
  if (!s) {
    snprintf(buf, n, "NULL");
    return;
  }
  size_t k = 0;
  int i = 0;
  if (k + 1 < n) buf[k++] = '"';
  for (; s[i] && i < 60 && k + 8 < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\')
      k += (size_t)snprintf(buf + k, n - k, "\\%c", c);
    else if (c == '\n')
      k += (size_t)snprintf(buf + k, n - k, "\\n");
    else if (c == '\t')
      k += (size_t)snprintf(buf + k, n - k, "\\t");
    else if (c < 0x20 || c >= 0x7f)
      k += (size_t)snprintf(buf + k, n - k, "\\x%02x", c);
    else
      buf[k++] = (char)c;
  }
  snprintf(buf + k, n - k, s[i] ? "\"..." : "\"");
}

void ddp_test_fmt_wait(char *buf, size_t n, int status) {
  if (status == -1)
    snprintf(buf, n, "-1 (no status: the wait or the fork failed)");
  else if (WIFEXITED(status))
    snprintf(buf, n, "exited with %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, n, "killed by signal %d", WTERMSIG(status));
  else
    snprintf(buf, n, "wait status %#x", (unsigned)status);
}

void ddp_test_fail_pair(const char *file, int line, const char *head, const char *ta,
                        const char *va, const char *tb, const char *vb) {
  int w = (int)(strlen(ta) > strlen(tb) ? strlen(ta) : strlen(tb));
  print_error("%s failed\n  %*s = %s\n  %*s = %s\n", head, w, ta, va, w, tb, vb);
  _fail(file, line);
  abort(); /* not reached: _fail longjmps out of the test (or exits) */
}
