/* Equality asserts that say what they saw (libuv's ASSERT_EQ). `assert_true(a == b)` reports
 * only "a == b" on failure; these print both expressions and both values:
 *
 *   tests/test_x.c:12: error: Failure!   (CMocka's line, after:)
 *   DDP_ASSERT_EQ(h, h0) failed
 *        h = 1311768467294899695 (0x1234567890abcdef)
 *       h0 = 1311768467294899696 (0x1234567890abcdf0)
 *
 * DDP_ASSERT_EQ(a, b) asserts exactly `a == b` with C's own conversions: each side is
 * evaluated once, kept in its own type (__typeof__), compared with ==, and printed by its
 * type: integers in decimal (unsigned ones in hex too), float with 9 significant digits and
 * double with 17 (each with its exact %a spelling), pointers with %p. Use CMocka's
 * assert_int_equal and assert_string_equal where both sides are integers of one signedness or
 * strings; use this one for floating point, for mixed types, and where the expression text
 * helps the reader of a failure.
 *
 * DDP_ASSERT_SAME_BITS(a, b) asserts that a and b (of one size, each evaluated once) have the
 * same bytes, memcmp(&a, &b, sizeof a) == 0: two floats that must agree bit for bit, -0.0
 * and NaN included. It prints both values.
 *
 * DDP_ASSERT_PREFIX(s, prefix) asserts strncmp(s, prefix, strlen(prefix)) == 0 and prints
 * the start of s and the prefix, quoted.
 *
 * DDP_ASSERT_EXITED(status, code) and DDP_ASSERT_KILLED(status, sig) take a wait status
 * (from waitpid or system) and assert `status != -1 && WIFEXITED(status) &&
 * WEXITSTATUS(status) == code`, respectively `WIFSIGNALED(status) && WTERMSIG(status) ==
 * sig`; a failure says how the process ended ("exited with 3", "killed by signal 9").
 *
 * Like every CMocka assertion, these longjmp: use them in the parent only (harness.h).
 * Include <cmocka.h> before using them. */
#ifndef DDP_TEST_ASSERTS_H
#define DDP_TEST_ASSERTS_H

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

/* The value as text for a failure message ("-3", "7 (0x7)", "0.1 (0x1.99999ap-4)", ...). */
void ddp_test_fmt_i(char *buf, size_t n, long long v);
void ddp_test_fmt_u(char *buf, size_t n, unsigned long long v);
void ddp_test_fmt_f(char *buf, size_t n, float v);
void ddp_test_fmt_d(char *buf, size_t n, double v);
void ddp_test_fmt_ld(char *buf, size_t n, long double v);
void ddp_test_fmt_p(char *buf, size_t n, const volatile void *v);
/* s quoted, with C escapes, cut after 60 characters ("..." marks the cut); NULL as "NULL". */
void ddp_test_fmt_str(char *buf, size_t n, const char *s);
/* A wait status in words: "exited with 0", "killed by signal 9", "-1 (no status)". */
void ddp_test_fmt_wait(char *buf, size_t n, int status);

/* Prints "<head> failed" and "<ta> = <va>", "<tb> = <vb>" below it (CMocka's print_error),
 * then fails the test at file:line. */
void ddp_test_fail_pair(const char *file, int line, const char *head, const char *ta,
                        const char *va, const char *tb, const char *vb) __attribute__((noreturn));

#define DDP_TEST_FMT_(buf, x)                   \
  _Generic((x), _Bool                           \
           : ddp_test_fmt_u, unsigned char      \
           : ddp_test_fmt_u, unsigned short     \
           : ddp_test_fmt_u, unsigned int       \
           : ddp_test_fmt_u, unsigned long      \
           : ddp_test_fmt_u, unsigned long long \
           : ddp_test_fmt_u, char               \
           : ddp_test_fmt_i, signed char        \
           : ddp_test_fmt_i, short              \
           : ddp_test_fmt_i, int                \
           : ddp_test_fmt_i, long               \
           : ddp_test_fmt_i, long long          \
           : ddp_test_fmt_i, float              \
           : ddp_test_fmt_f, double             \
           : ddp_test_fmt_d, long double        \
           : ddp_test_fmt_ld, default           \
           : ddp_test_fmt_p)(buf, sizeof buf, x)

/* The body both value asserts share: `cmp` is an expression over ddp_eq_a_ and ddp_eq_b_. */
#define DDP_ASSERT_PAIR_(name, a, b, cmp)                                                 \
  do {                                                                                    \
    __typeof__(a) ddp_eq_a_ = (a);                                                        \
    __typeof__(b) ddp_eq_b_ = (b);                                                        \
    if (!(cmp)) {                                                                         \
      char ddp_eq_sa_[96], ddp_eq_sb_[96];                                                \
      DDP_TEST_FMT_(ddp_eq_sa_, ddp_eq_a_);                                               \
      DDP_TEST_FMT_(ddp_eq_sb_, ddp_eq_b_);                                               \
      ddp_test_fail_pair(__FILE__, __LINE__, name "(" #a ", " #b ")", #a, ddp_eq_sa_, #b, \
                         ddp_eq_sb_);                                                     \
    }                                                                                     \
  } while (0)

#define DDP_ASSERT_EQ(a, b) DDP_ASSERT_PAIR_("DDP_ASSERT_EQ", a, b, ddp_eq_a_ == ddp_eq_b_)

#define DDP_ASSERT_SAME_BITS(a, b)                                                    \
  do {                                                                                \
    _Static_assert(sizeof(a) == sizeof(b), "DDP_ASSERT_SAME_BITS: the sizes differ"); \
    DDP_ASSERT_PAIR_("DDP_ASSERT_SAME_BITS", a, b,                                    \
                     memcmp(&ddp_eq_a_, &ddp_eq_b_, sizeof ddp_eq_a_) == 0);          \
  } while (0)

#define DDP_ASSERT_PREFIX(s, prefix)                                                       \
  do {                                                                                     \
    const char *ddp_eq_s_ = (s), *ddp_eq_p_ = (prefix);                                    \
    if (strncmp(ddp_eq_s_, ddp_eq_p_, strlen(ddp_eq_p_)) != 0) {                           \
      char ddp_eq_sa_[256], ddp_eq_sb_[256];                                               \
      ddp_test_fmt_str(ddp_eq_sa_, sizeof ddp_eq_sa_, ddp_eq_s_);                          \
      ddp_test_fmt_str(ddp_eq_sb_, sizeof ddp_eq_sb_, ddp_eq_p_);                          \
      ddp_test_fail_pair(__FILE__, __LINE__, "DDP_ASSERT_PREFIX(" #s ", " #prefix ")", #s, \
                         ddp_eq_sa_, #prefix, ddp_eq_sb_);                                 \
    }                                                                                      \
  } while (0)

/* The body of the wait-status asserts: `ok` is an expression over ddp_eq_st_. */
#define DDP_ASSERT_WAIT_(name, status, arg, ok, wantfmt)                                          \
  do {                                                                                            \
    int ddp_eq_st_ = (status), ddp_eq_arg_ = (arg);                                               \
    if (!(ok)) {                                                                                  \
      char ddp_eq_sa_[96], ddp_eq_sb_[96];                                                        \
      ddp_test_fmt_wait(ddp_eq_sa_, sizeof ddp_eq_sa_, ddp_eq_st_);                               \
      snprintf(ddp_eq_sb_, sizeof ddp_eq_sb_, wantfmt, ddp_eq_arg_);                              \
      ddp_test_fail_pair(__FILE__, __LINE__, name "(" #status ", " #arg ")", #status, ddp_eq_sa_, \
                         "expected", ddp_eq_sb_);                                                 \
    }                                                                                             \
  } while (0)

#define DDP_ASSERT_EXITED(status, code)                         \
  DDP_ASSERT_WAIT_("DDP_ASSERT_EXITED", status, code,           \
                   ddp_eq_st_ != -1 && WIFEXITED(ddp_eq_st_) && \
                       WEXITSTATUS(ddp_eq_st_) == ddp_eq_arg_,  \
                   "exited with %d")

#define DDP_ASSERT_KILLED(status, sig)                                             \
  DDP_ASSERT_WAIT_("DDP_ASSERT_KILLED", status, sig,                               \
                   WIFSIGNALED(ddp_eq_st_) && WTERMSIG(ddp_eq_st_) == ddp_eq_arg_, \
                   "killed by signal %d")

#endif /* DDP_TEST_ASSERTS_H */
