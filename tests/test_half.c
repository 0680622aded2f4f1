/* Tests of fp16 and bf16 conversion against an independent reference.
 *
 * The reference does not share the library's bit tricks. It lists every finite
 * non-negative fp16 (or bf16) value as a double, in bit-pattern order (which is value
 * order), plus one virtual entry past the largest finite value standing for the next
 * power of two and carrying the Inf pattern. Rounding |x| is then a binary search for the
 * two neighbours and a comparison with their exact midpoint, ties going to the even
 * pattern; everything at or past the virtual entry is Inf. That is IEEE round to nearest
 * even by definition, including overflow at 65520 (fp16) and subnormals. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "ddp/common.h"
#include "harness.h"

/* ---------------------------------------------------------------- reference ------- */

/* Value of a finite non-negative fp16 pattern from its fields, by the definition. */
static double f16_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return ldexp(m, -24);
  return ldexp(1024 + m, e - 25);
}

/* bf16: 8 exponent bits (bias 127), 7 mantissa bits. */
static double bf16_value(uint16_t h) {
  int e = (h >> 7) & 0xff, m = h & 0x7f;
  if (e == 0) return ldexp(m, -133);
  return ldexp(128 + m, e - 134);
}

typedef struct ref_table {
  double v[0x7f81];
  int n; /* entries, the last one virtual (Inf pattern) */
} ref_table_t;

static ref_table_t f16_tab, bf16_tab;

static int setup_tables(void **state) {
  (void)state;
  f16_tab.n = 0x7c00 + 1;
  for (int h = 0; h < 0x7c00; h++) f16_tab.v[h] = f16_value((uint16_t)h);
  f16_tab.v[0x7c00] = 65536.0;
  bf16_tab.n = 0x7f80 + 1;
  for (int h = 0; h < 0x7f80; h++) bf16_tab.v[h] = bf16_value((uint16_t)h);
  bf16_tab.v[0x7f80] = ldexp(1.0, 128);
  return 0;
}

/* Pattern (without sign) nearest to a >= 0, ties to even; n-1 is the Inf pattern. */
static uint16_t ref_round(const ref_table_t *t, double a) {
  int last = t->n - 1;
  if (a >= t->v[last]) return (uint16_t)last;
  int lo = 0, hi = last; /* v[lo] <= a < v[hi] */
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (t->v[mid] <= a)
      lo = mid;
    else
      hi = mid;
  }
  double mid = (t->v[lo] + t->v[hi]) / 2; /* exact: both have few significant bits */
  if (a < mid) return (uint16_t)lo;
  if (a > mid) return (uint16_t)hi;
  return (uint16_t)((lo & 1) ? hi : lo);
}

static uint16_t ref_f32_to_f16(float f) {
  uint16_t s = signbit(f) ? 0x8000 : 0;
  if (isnan(f)) return (uint16_t)(s | 0x7e00);
  return (uint16_t)(s | ref_round(&f16_tab, fabs((double)f)));
}

static uint16_t ref_f32_to_bf16(float f) {
  uint16_t s = signbit(f) ? 0x8000 : 0;
  if (isnan(f)) return (uint16_t)(s | 0x7fc0);
  return (uint16_t)(s | ref_round(&bf16_tab, fabs((double)f)));
}

static bool f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
static bool bf16_is_nan(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f); }

/* Compares one float's conversions with the reference; NaN must map to a NaN of the
 * same sign. Returns false and prints on a mismatch (so a sweep reports its first). */
static bool check_one(float f) {
  uint16_t got = ddp_f32_to_f16(f), want = ref_f32_to_f16(f);
  uint16_t gotb = ddp_f32_to_bf16(f), wantb = ref_f32_to_bf16(f);
  bool ok;
  if (isnan(f)) {
    ok = f16_is_nan(got) && bf16_is_nan(gotb) && (got & 0x8000) == (want & 0x8000) &&
         (gotb & 0x8000) == (wantb & 0x8000);
  } else {
    ok = got == want && gotb == wantb;
  }
  if (!ok)
    print_error("float %a (0x%08x): f16 got 0x%04x want 0x%04x, bf16 got 0x%04x want 0x%04x\n",
                (double)f, ddp_test_fbits(f), got, want, gotb, wantb);
  return ok;
}

/* ---------------------------------------------------------------- tests ----------- */

/* Widening every fp16 pattern gives the value its fields define (exact bits for
 * non-NaN), and narrowing back gives the same pattern; NaN stays NaN with its sign and
 * payload, made quiet. */
static void test_f16_all_patterns_round_trip(void **state) {
  (void)state;
  for (uint32_t h = 0; h < 0x10000; h++) {
    float f = ddp_f16_to_f32((uint16_t)h);
    uint16_t back = ddp_f32_to_f16(f);
    bool neg = h & 0x8000;
    if (f16_is_nan((uint16_t)h)) {
      assert_true(isnan(f));
      assert_int_equal(signbit(f) != 0, neg);
      assert_true(f16_is_nan(back));
      assert_int_equal(back & 0x8000, h & 0x8000);
      assert_int_equal(back & 0x1ff, h & 0x1ff); /* payload below the quiet bit */
      assert_true(back & 0x200);                 /* quiet */
      continue;
    }
    if ((h & 0x7fff) == 0x7c00) {
      assert_true(isinf(f));
    } else {
      double want = f16_value((uint16_t)(h & 0x7fff));
      if (neg) want = -want;
      DDP_ASSERT_EQ((double)f, want);
    }
    assert_int_equal(signbit(f) != 0, neg);
    if (back != h) fail_msg("f16 0x%04x -> %a -> 0x%04x", h, (double)f, back);
  }
}

/* The same for every bf16 pattern. */
static void test_bf16_all_patterns_round_trip(void **state) {
  (void)state;
  for (uint32_t h = 0; h < 0x10000; h++) {
    float f = ddp_bf16_to_f32((uint16_t)h);
    assert_int_equal(ddp_test_fbits(f), h << 16); /* bf16 is the top half of a float */
    uint16_t back = ddp_f32_to_bf16(f);
    if (bf16_is_nan((uint16_t)h)) {
      assert_true(isnan(f));
      assert_true(bf16_is_nan(back));
      assert_int_equal(back & 0x8000, h & 0x8000);
      assert_int_equal(back & 0x3f, h & 0x3f);
      continue;
    }
    if ((h & 0x7fff) != 0x7f80) {
      double want = bf16_value((uint16_t)(h & 0x7fff));
      if (h & 0x8000) want = -want;
      DDP_ASSERT_EQ((double)f, want);
    }
    if (back != h) fail_msg("bf16 0x%04x -> %a -> 0x%04x", h, (double)f, back);
  }
}

/* Known values, each derived in its comment. */
static void test_known_values(void **state) {
  (void)state;
  /* Largest finite fp16: (2 - 2^-10) * 2^15 = 65504. */
  assert_int_equal(ddp_f32_to_f16(65504.0f), 0x7bff);
  /* Halfway to the next power of two (65536) is 65520: a tie, and 0x7bff is odd, so it
   * rounds up to Inf; just below stays 65504. */
  assert_int_equal(ddp_f32_to_f16(65520.0f), 0x7c00);
  assert_int_equal(ddp_f32_to_f16(nextafterf(65520.0f, 0.0f)), 0x7bff);
  assert_int_equal(ddp_f32_to_f16(-65520.0f), 0xfc00);
  assert_int_equal(ddp_f32_to_f16(1e10f), 0x7c00);
  /* Smallest subnormal 2^-24; half of it is a tie with 0 (even): 0; a hair above: 2^-24. */
  assert_int_equal(ddp_f32_to_f16(0x1p-24f), 0x0001);
  assert_int_equal(ddp_f32_to_f16(0x1p-25f), 0x0000);
  assert_int_equal(ddp_f32_to_f16(-0x1p-25f), 0x8000);
  assert_int_equal(ddp_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
  /* 3 * 2^-25 lies halfway between 1 and 2 units: even -> 2 units. */
  assert_int_equal(ddp_f32_to_f16(0x3p-25f), 0x0002);
  /* Largest subnormal 1023 * 2^-24 and smallest normal 2^-14. */
  assert_int_equal(ddp_f32_to_f16(0x3ffp-24f), 0x03ff);
  assert_int_equal(ddp_f32_to_f16(0x1p-14f), 0x0400);
  /* Halfway between the largest subnormal and 2^-14 (2047 * 2^-25): even is 0x0400. */
  assert_int_equal(ddp_f32_to_f16(0x7ffp-25f), 0x0400);
  /* At 1 the fp16 step is 2^-10: 1 + 2^-11 ties to 1 (even), 1 + 3 * 2^-11 ties to
   * 1 + 2^-9 (pattern 0x3c02, even), 1 + 2^-11 + 2^-23 rounds up to 0x3c01. */
  assert_int_equal(ddp_f32_to_f16(1.0f), 0x3c00);
  assert_int_equal(ddp_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  assert_int_equal(ddp_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);
  assert_int_equal(ddp_f32_to_f16(1.0f + 0x1p-11f + 0x1p-23f), 0x3c01);
  /* 4095 * 2^-11 ties between 0x3fff (2 - 2^-10) and 2.0 (0x4000, even): the rounding
   * carries into the exponent. */
  assert_int_equal(ddp_f32_to_f16(0xfffp-11f), 0x4000);
  assert_int_equal(ddp_f32_to_f16(-2.0f), 0xc000);
  assert_int_equal(ddp_f32_to_f16(0.0f), 0x0000);
  assert_int_equal(ddp_f32_to_f16(-0.0f), 0x8000);
  assert_int_equal(ddp_f32_to_f16(INFINITY), 0x7c00);
  assert_int_equal(ddp_f32_to_f16(-INFINITY), 0xfc00);
  /* Float subnormals are far below 2^-25: signed zero. */
  assert_int_equal(ddp_f32_to_f16(ddp_test_bitsf(0x00000001)), 0x0000);
  assert_int_equal(ddp_f32_to_f16(ddp_test_bitsf(0x80400000)), 0x8000);
  uint16_t n = ddp_f32_to_f16(NAN), nn = ddp_f32_to_f16(-NAN);
  assert_true(f16_is_nan(n) && !(n & 0x8000));
  assert_true(f16_is_nan(nn) && (nn & 0x8000));
  /* A signalling float NaN whose payload sits only in the low 13 bits must not become
   * Inf. */
  assert_true(f16_is_nan(ddp_f32_to_f16(ddp_test_bitsf(0x7f800001))));
  assert_true(bf16_is_nan(ddp_f32_to_bf16(ddp_test_bitsf(0x7f800001))));
  assert_true(bf16_is_nan(ddp_f32_to_bf16(ddp_test_bitsf(0xff800001))));
  assert_true(ddp_f32_to_bf16(ddp_test_bitsf(0xff800001)) & 0x8000);

  /* bf16: at 1 the step is 2^-7; 1 + 2^-8 ties to 1, 1 + 3 * 2^-8 ties to 0x3f82. */
  assert_int_equal(ddp_f32_to_bf16(1.0f), 0x3f80);
  assert_int_equal(ddp_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  assert_int_equal(ddp_f32_to_bf16(1.0f + 0x3p-8f), 0x3f82);
  assert_int_equal(ddp_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-23f), 0x3f81);
  /* Largest finite bf16 is 0x7f7f; FLT_MAX is past the midpoint 0x7f7f8000: Inf. */
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x7f7f7fff)), 0x7f7f);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x7f7f8000)), 0x7f80);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x7f7fffff)), 0x7f80);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0xff7fffff)), 0xff80);
  /* bf16 subnormals: the unit is the float 0x00010000; half a unit ties to 0, 1.5 units
   * tie to 2. */
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x00008000)), 0x0000);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x00008001)), 0x0001);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x00018000)), 0x0002);
  assert_int_equal(ddp_f32_to_bf16(ddp_test_bitsf(0x80000001)), 0x8000);
  assert_int_equal(ddp_f32_to_bf16(-0.0f), 0x8000);
  assert_int_equal(ddp_f32_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(ddp_f32_to_bf16(-INFINITY), 0xff80);
  assert_true(bf16_is_nan(ddp_f32_to_bf16(NAN)));
}

/* Every tie and its neighbours: for each pair of adjacent fp16 (and bf16) values, the
 * exact midpoint (representable in float) and the floats just below and above it, both
 * signs. This covers the tie-breaking of every rounding interval exhaustively. */
static void test_every_midpoint(void **state) {
  (void)state;
  const ref_table_t *tabs[2] = {&f16_tab, &bf16_tab};
  long checked = 0;
  for (int t = 0; t < 2; t++) {
    for (int h = 0; h + 1 < tabs[t]->n; h++) {
      double mid = (tabs[t]->v[h] + tabs[t]->v[h + 1]) / 2;
      float m = (float)mid;
      DDP_ASSERT_EQ((double)m, mid); /* a midpoint needs one bit more than the format */
      float cand[6] = {m,
                       nextafterf(m, 0.0f),
                       nextafterf(m, INFINITY),
                       (float)tabs[t]->v[h],
                       nextafterf((float)tabs[t]->v[h], INFINITY),
                       nextafterf((float)tabs[t]->v[h], 0.0f)};
      for (int c = 0; c < 6; c++) {
        if (!check_one(cand[c])) fail();
        if (!check_one(-cand[c])) fail();
        checked += 2;
      }
    }
  }
  assert_true(checked > 500000);
}

/* xorshift64*: the test's own bit source, independent of the library's RNG. */
static uint64_t xs_next(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}

/* 2^23 float bit patterns uniformly over all 2^32, and 2^23 concentrated on exponents
 * where fp16 is finite or subnormal (2^-26 .. 2^17), against the reference. */
static void test_random_sweep(void **state) {
  (void)state;
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < (1 << 23); i++) {
    uint32_t u = (uint32_t)(xs_next(&s) >> 32);
    if (!check_one(ddp_test_bitsf(u))) fail();
  }
  for (int i = 0; i < (1 << 23); i++) {
    uint64_t r = xs_next(&s);
    uint32_t exp = 101 + (uint32_t)((r >> 40) % 44); /* 101..144 */
    uint32_t u = ((uint32_t)(r >> 63) << 31) | (exp << 23) | ((uint32_t)r & 0x7fffff);
    if (!check_one(ddp_test_bitsf(u))) fail();
  }
}

/* The array conversions (F16C on this CPU) against the element functions, bit for bit:
 * every f16 and bf16 pattern widened (signalling NaNs included, which F16C alone would
 * quiet), and 2^24 float patterns narrowed (a stride through all 2^32, plus every value
 * of test_random_sweep's second kind); lengths that are not multiples of 8 reach the
 * scalar tails. */
static void test_arrays_match_elements(void **state) {
  (void)state;
  enum { N = 1 << 16 };
  static uint16_t h[N], back[N];
  static float f[N], g[N];
  for (uint32_t i = 0; i < N; i++) h[i] = (uint16_t)i;
  for (size_t len = N - 3; len <= N; len += 3) {
    ddp_f16_to_f32_n(h, f, len);
    ddp_bf16_to_f32_n(h, g, len);
    for (size_t i = 0; i < len; i++) {
      float a = ddp_f16_to_f32(h[i]), b = ddp_bf16_to_f32(h[i]);
      if (memcmp(&a, &f[i], 4) || memcmp(&b, &g[i], 4))
        fail_msg("widening 0x%04x (length %zu)", h[i], len);
    }
  }
  uint64_t s = 0x2545F4914F6CDD1Dull;
  for (int rep = 0; rep < 256; rep++) {
    for (uint32_t i = 0; i < N; i++) {
      uint32_t u = rep < 128 ? (uint32_t)(rep * N + i) * 257u : (uint32_t)(xs_next(&s) >> 32);
      f[i] = ddp_test_bitsf(u);
    }
    size_t len = N - (size_t)(rep % 8);
    ddp_f32_to_f16_n(f, h, len);
    ddp_f32_to_bf16_n(f, back, len);
    for (size_t i = 0; i < len; i++) {
      if (h[i] != ddp_f32_to_f16(f[i]) || back[i] != ddp_f32_to_bf16(f[i]))
        fail_msg("narrowing float bits 0x%08x", ddp_test_fbits(f[i]));
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_arrays_match_elements),
      cmocka_unit_test(test_f16_all_patterns_round_trip),
      cmocka_unit_test(test_bf16_all_patterns_round_trip),
      cmocka_unit_test(test_known_values),
      cmocka_unit_test(test_every_midpoint),
      cmocka_unit_test(test_random_sweep),
  };
  return cmocka_run_group_tests(tests, setup_tables, NULL);
}
