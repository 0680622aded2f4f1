/* Tests of the pre-rounded reproducible sum (ddp_rsum_*, src/tensor/rsum.c).
 *
 * - Order and grouping: one sum computed term by term, in a random permutation through one
 *   multi-source call, and split over random "ranks" (each with its own exps, MAX-combined,
 *   its own deposits in several calls and element ranges, the int64 accumulators added in
 *   random order) gives the same exps, accumulators and results, bit for bit.
 * - Accuracy against the exact sum: an exact fixed-point accumulator (big_t below) holds
 *   the sum of the terms, so every result is checked against the documented bound
 *   (|sum - S| <= n M 2^(c - 50) before the division, plus 2^-53 |S / d| and half an ulp of
 *   the result), and whether it is the correctly rounded exact mean is decided exactly.
 * - Edge cases: zero blocks, NaN and infinities, subnormals, f64 near 2^-1000 and 2^1023,
 *   DDP_RSUM_MAX_TERMS terms of FLT_MAX, partial blocks, one term.
 * - Real gradients: the 12 shard gradients of a small MLP, rsum's mean against the exact
 *   mean, with the naive float sum / 12 for contrast.
 * The measured figures are printed (print_message); docs quote them. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ddp/nn.h"
#include "ddp/tensor.h"
#include "harness.h"

#define BLK DDP_RSUM_BLOCK

/* ---------------------------------------------------------------- random draws ---- */

/* splitmix64: a fixed seed gives the same data on every machine. */
typedef struct rng {
  uint64_t s;
} rng_t;

static uint64_t rnd(rng_t *r) {
  uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

static double unif(rng_t *r) { return (double)(rnd(r) >> 11) * 0x1p-53; }

static int64_t below(rng_t *r, int64_t n) { return (int64_t)(rnd(r) % (uint64_t)n); }

static double gauss(rng_t *r) {
  return sqrt(-2 * log(1 - unif(r))) * cos(6.283185307179586 * unif(r));
}

static void shuffle(rng_t *r, int64_t *v, int64_t n) {
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = below(r, i + 1), t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

typedef enum kind {
  WIDE,      /* mixed signs over 60 binades, 6% zeros (both signs), 4% subnormals */
  GRADLIKE,  /* per element scale 2^-12 ... 2^-6, terms scale * (0.25 + N(0, 1)) */
  SUBNORMAL, /* random subnormals of the dtype, mixed signs */
} kind_t;

/* One term value; scale is the element's scale for GRADLIKE. */
static double draw(rng_t *r, kind_t kind, bool f64, double scale) {
  double sign = rnd(r) & 1 ? -1.0 : 1.0;
  double u = unif(r);
  if (kind == WIDE && u < 0.06) return sign * 0.0;
  if (kind == SUBNORMAL || (kind == WIDE && u < 0.10)) {
    uint64_t m = rnd(r) & (f64 ? (UINT64_C(1) << 52) - 1 : (UINT64_C(1) << 23) - 1);
    return sign * ldexp((double)m, f64 ? -1074 : -149);
  }
  if (kind == GRADLIKE) {
    double v = scale * (0.25 + gauss(r));
    return f64 ? v : (double)(float)v;
  }
  double v = sign * ldexp(1 + unif(r), -45 + (int)below(r, 61));
  return f64 ? v : (double)(float)v;
}

/* ---------------------------------------------------------------- the terms ------- */

/* k terms of n elements each, float or double. */
typedef struct terms {
  bool f64;
  int64_t k;
  size_t n;
  void **x; /* x[t]: n floats or n doubles */
} terms_t;

static terms_t terms_new(bool f64, int64_t k, size_t n) {
  terms_t T = {f64, k, n, calloc((size_t)k, sizeof(void *))};
  assert_non_null(T.x);
  for (int64_t t = 0; t < k; t++) {
    T.x[t] = calloc(n ? n : 1, f64 ? sizeof(double) : sizeof(float));
    assert_non_null(T.x[t]);
  }
  return T;
}

static void terms_free(terms_t *T) {
  for (int64_t t = 0; t < T->k; t++) free(T->x[t]);
  free(T->x);
  T->x = NULL;
}

static double get(const terms_t *T, int64_t t, size_t i) {
  return T->f64 ? ((const double *)T->x[t])[i] : (double)((const float *)T->x[t])[i];
}

static void set(terms_t *T, int64_t t, size_t i, double v) {
  if (T->f64)
    ((double *)T->x[t])[i] = v;
  else
    ((float *)T->x[t])[i] = (float)v;
}

static void fill(rng_t *r, terms_t *T, kind_t kind) {
  for (size_t i = 0; i < T->n; i++) {
    double scale = ldexp(1.0, -12 + (int)below(r, 7));
    for (int64_t t = 0; t < T->k; t++) set(T, t, i, draw(r, kind, T->f64, scale));
  }
}

static void exps_of(const terms_t *T, int32_t *exps, int64_t t) {
  if (T->f64)
    ddp_rsum_exps_f64(exps, T->x[t], T->n);
  else
    ddp_rsum_exps_f32(exps, T->x[t], T->n);
}

/* Deposits the cnt terms idx[] of elements [off, off + len) (off a multiple of the block)
 * in one multi-source call, into acc (all n elements) for a sum of `terms` terms; add
 * false overwrites those elements of acc instead of adding to them. */
static void deposit_to(const terms_t *T, int64_t *acc, const int32_t *exps, int64_t terms, bool add,
                       const int64_t *idx, int cnt, size_t off, size_t len) {
  assert_int_equal(off % BLK, 0);
  if (T->f64) {
    const double **p = calloc((size_t)cnt, sizeof *p);
    assert_non_null(p);
    for (int s = 0; s < cnt; s++) p[s] = (const double *)T->x[idx[s]] + off;
    ddp_rsum_deposit_f64(acc + off, exps + off / BLK, terms, add, cnt, p, len);
    free(p);
  } else {
    const float **p = calloc((size_t)cnt, sizeof *p);
    assert_non_null(p);
    for (int s = 0; s < cnt; s++) p[s] = (const float *)T->x[idx[s]] + off;
    ddp_rsum_deposit_f32(acc + off, exps + off / BLK, terms, add, cnt, p, len);
    free(p);
  }
}

static void deposit(const terms_t *T, int64_t *acc, const int32_t *exps, int64_t terms,
                    const int64_t *idx, int cnt, size_t off, size_t len) {
  deposit_to(T, acc, exps, terms, true, idx, cnt, off, len);
}

/* out[i] in T's dtype, as double. */
static void result_of(const terms_t *T, const int64_t *acc, const int32_t *exps, int64_t divisor,
                      double *out) {
  size_t n = T->n;
  if (T->f64) {
    ddp_rsum_result_f64(acc, exps, T->k, n, divisor, out);
    return;
  }
  float *o = calloc(n ? n : 1, sizeof *o);
  assert_non_null(o);
  ddp_rsum_result_f32(acc, exps, T->k, n, divisor, o);
  for (size_t i = 0; i < n; i++) out[i] = o[i];
  free(o);
}

/* The plain way: exps, then every term deposited one by one in order, then the result. */
static void rsum_in_order(const terms_t *T, int64_t divisor, int32_t *exps, int64_t *acc,
                          double *out) {
  memset(exps, 0, ddp_rsum_blocks(T->n) * sizeof *exps);
  memset(acc, 0, T->n * sizeof *acc);
  for (int64_t t = 0; t < T->k; t++) exps_of(T, exps, t);
  for (int64_t t = 0; t < T->k; t++) deposit(T, acc, exps, T->k, &t, 1, 0, T->n);
  result_of(T, acc, exps, divisor, out);
}

/* ---------------------------------------------------------------- exact sums ------ */

/* A fixed-point number, sum d[i] 2^(32 i + BIG_EMIN), digits signed and not normalized
 * (each addition adds below 2^32 in magnitude to a digit, so 2^30 additions cannot
 * overflow one). 2^-1140 ... 2^1227 holds 2 * 2^16 f64 terms, a divisor up to 2^17 times
 * a value up to 2^1024, and the bound n M 2^(c - 50) of a subnormal M, with room. */
#define BIG_EMIN (-1140)
#define BIG_LIMBS 74
typedef struct big {
  int64_t d[BIG_LIMBS];
} big_t;

/* b += v 2^e, |v| < 2^63, e >= BIG_EMIN. */
static void big_add(big_t *b, int64_t v, int e) {
  if (v == 0) return;
  assert_true(e >= BIG_EMIN);
  uint64_t u = v < 0 ? -(uint64_t)v : (uint64_t)v;
  int p = e - BIG_EMIN, l = p / 32, s = p % 32;
  assert_true(l + 2 < BIG_LIMBS);
  uint64_t c0 = (u & 0xffffffffu) << s, c1 = (u >> 32) << s; /* each below 2^63 */
  int64_t part[3] = {(int64_t)(c0 & 0xffffffffu), (int64_t)((c0 >> 32) + (c1 & 0xffffffffu)),
                     (int64_t)(c1 >> 32)};
  for (int k = 0; k < 3; k++) b->d[l + k] += v < 0 ? -part[k] : part[k];
}

/* Digits into [0, 2^32); returns the carry out of the top digit (the value is
 * sum d[i] 2^(32 i) + carry 2^(32 BIG_LIMBS), in units of 2^BIG_EMIN). */
static int64_t big_norm(big_t *b) {
  int64_t carry = 0;
  for (int i = 0; i < BIG_LIMBS; i++) {
    int64_t t = b->d[i] + carry;
    int64_t lo = (int64_t)((uint64_t)t & 0xffffffffu);
    carry = (t - lo) / 4294967296; /* exact: t - lo is a multiple of 2^32 */
    b->d[i] = lo;
  }
  return carry;
}

static int big_sign(const big_t *b) {
  big_t t = *b;
  int64_t carry = big_norm(&t);
  if (carry) return carry < 0 ? -1 : 1;
  for (int i = 0; i < BIG_LIMBS; i++)
    if (t.d[i]) return 1;
  return 0;
}

/* The value, rounded to double (a few ulps; for measuring errors). */
static double big_to_double(const big_t *b) {
  big_t t = *b;
  double sign = 1;
  int64_t carry = big_norm(&t);
  if (carry < 0) { /* negate: the digits' carry out is then the same carry */
    for (int i = 0; i < BIG_LIMBS; i++) t.d[i] = -t.d[i];
    assert_int_equal(big_norm(&t), carry);
    sign = -1;
  }
  double v = 0;
  for (int i = BIG_LIMBS - 1; i >= 0; i--) v += ldexp((double)t.d[i], 32 * i + BIG_EMIN);
  return sign * v;
}

/* A binary floating-point format: p significand bits, smallest exponent of the ulp. */
typedef struct fmt {
  int p, emin;
} fmt_t;
static const fmt_t FMT32 = {24, -149}, FMT64 = {53, -1074};

/* x = m 2^e exactly, |m| < 2^p, e >= emin, 2^e the spacing of f's values at |x| (above
 * |x| when x is a power of two). x finite and representable in f. */
static void decomp(fmt_t f, double x, int64_t *m, int *e) {
  int ex = 0;
  frexp(x, &ex);
  *e = x == 0 || ex - f.p < f.emin ? f.emin : ex - f.p;
  *m = (int64_t)ldexp(x, -*e);
}

/* b += mul m 2^e, |m| < 2^53, |mul| <= 2^17: in two halves, so the products fit. */
static void big_add_mul(big_t *b, int64_t m, int e, int64_t mul) {
  int64_t sgn = m < 0 ? -1 : 1;
  uint64_t u = m < 0 ? -(uint64_t)m : (uint64_t)m;
  big_add(b, sgn * mul * (int64_t)(u & ((UINT64_C(1) << 26) - 1)), e);
  big_add(b, sgn * mul * (int64_t)(u >> 26), e + 26);
}

static void big_add_double(big_t *b, double x, int64_t mul) {
  int64_t m;
  int e;
  decomp(FMT64, x, &m, &e);
  big_add_mul(b, m, e, mul);
}

static int ceil_log2(int64_t n) {
  int c = 0;
  while ((INT64_C(1) << c) < n) c++;
  return c;
}

/* What the checks of one method over a set of elements measured. */
typedef struct stats {
  size_t n;            /* elements */
  size_t correct;      /* of them, equal to the correctly rounded exact mean */
  size_t within_ulp;   /* of them, within one ulp of the exact mean */
  size_t sums;         /* of them, whose sum before the division was checked (finite) */
  double max_ulps;     /* max |r - S/d| in ulps of r */
  double max_frac;     /* max |r - S/d| / the documented bound (0 when not checked) */
  double max_sum_frac; /* max |s - S| / (n M 2^(c - 50)), s the sum before the division */
} stats_t;

/* Checks one result r (in format f) of the mean of the n terms x[] with divisor d, for an
 * element whose block has largest magnitude M over all terms. M < 0: only measured (the
 * naive sum). Else the sum before the division, s (the result with divisor 1 in f64, exact
 * while in double's range; NAN or an infinity skips this part), must be within
 * E = n M 2^(c - 50) of the exact sum S, compared exactly, and r within the documented
 * bound:
 *   |r - S/d| <= E/d + 2^-53 |s/d| + ulp(r)/2,
 * with |s/d| <= |r| + err + E/d (err = |r - S/d|). The 2^-40 slack covers this function's
 * own double arithmetic (err is S - d r rounded to double, divided by d).
 * must_round: r must also be the correctly rounded S/d. Returns whether it is. */
static bool check_elem(stats_t *st, fmt_t f, const double *x, int64_t n, int64_t d, double M,
                       double r, double s, size_t elem, bool must_round) {
  if (!isfinite(r)) fail_msg("element %zu: result %a is not finite", elem, r);
  if (M >= 0 && isfinite(s)) {
    int64_t ms, mM;
    int es, eM;
    decomp(FMT64, s, &ms, &es);
    decomp(FMT64, M, &mM, &eM);
    big_t X = {{0}}; /* s - S */
    for (int64_t t = 0; t < n; t++) big_add_double(&X, x[t], -1);
    big_add_mul(&X, ms, es, 1);
    big_t above = X, below_ = X; /* s - S - E <= 0 and s - S + E >= 0 */
    big_add_mul(&above, mM, eM + ceil_log2(n) - 50, -n);
    big_add_mul(&below_, mM, eM + ceil_log2(n) - 50, n);
    double sum_err = fabs(big_to_double(&X)), E = ldexp(M, ceil_log2(n) - 50) * (double)n;
    if (big_sign(&above) > 0 || big_sign(&below_) < 0)
      fail_msg("element %zu: the sum before the division is %a off, above n M 2^(c - 50) = %a "
               "(s = %a, M = %a, n = %lld)",
               elem, sum_err, E, s, M, (long long)n);
    if (E > 0 && sum_err / E > st->max_sum_frac) st->max_sum_frac = sum_err / E;
    st->sums++;
  }
  int64_t m;
  int e;
  decomp(f, r, &m, &e);
  /* |r - S/d| = |d r - S| / d */
  big_t D = {{0}};
  for (int64_t t = 0; t < n; t++) big_add_double(&D, x[t], -1);
  big_add_mul(&D, m, e, d);
  double err = fabs(big_to_double(&D)) / (double)d;
  double ulp = ldexp(1.0, e);

  /* Correctly rounded: S/d lies between the midpoints to r's neighbours (a tie goes to
   * the even significand). With a = |m|, sigma the sign of r and the neighbours' magnitudes
   * succ and pred: 2 sigma S - d (a + succ) < 0 and 2 sigma S - d (a + pred) > 0. */
  int64_t sigma = signbit(r) ? -1 : 1, a = m < 0 ? -m : m;
  big_t B = {{0}};
  for (int64_t t = 0; t < n; t++) big_add_double(&B, x[t], 2 * sigma);
  big_add_mul(&B, a, e, -d);
  big_t hi = B, lo = B;
  big_add_mul(&hi, a + 1, e, -d);
  if (a == (INT64_C(1) << (f.p - 1)) && e > f.emin)
    big_add_mul(&lo, 2 * a - 1, e - 1, -d);
  else
    big_add_mul(&lo, a - 1, e, -d);
  bool even = (a & 1) == 0;
  int sh = big_sign(&hi), sl = big_sign(&lo);
  bool correct = (sh < 0 || (sh == 0 && even)) && (sl > 0 || (sl == 0 && even));

  st->n++;
  st->correct += correct;
  st->within_ulp += err <= ulp;
  if (err / ulp > st->max_ulps) st->max_ulps = err / ulp;
  if (M >= 0) {
    double Ed = ldexp(M, ceil_log2(n) - 50) * (double)n / (double)d; /* no overflow near 2^1024 */
    double bound = Ed + 0x1p-53 * (fabs(r) + err + Ed) + ulp / 2;
    if (!(err <= bound * (1 + 0x1p-40)))
      fail_msg("element %zu: |r - S/d| = %a above the bound %a (r = %a, M = %a, n = %lld, d = "
               "%lld)",
               elem, err, bound, r, M, (long long)n, (long long)d);
    if (err / bound > st->max_frac) st->max_frac = err / bound;
  }
  if (must_round && !correct)
    fail_msg("element %zu: r = %a is not the correctly rounded mean (error %.3g ulp)", elem, r,
             err / ulp);
  return correct;
}

/* The oracle itself on hand-made cases: correctly rounded or not, ties to even, negative
 * sums below a power of two, f64 and the smallest subnormal. */
static void test_oracle(void **state) {
  (void)state;
  stats_t st = {0};
  double x[3] = {1, 0x1p-30, 0};
  assert_true(check_elem(&st, FMT32, x, 2, 1, -1, 1.0, NAN, 0, false));
  assert_false(check_elem(&st, FMT32, x, 2, 1, -1, 1 + 0x1p-23, NAN, 0, false));
  x[1] = 0x1p-24; /* a tie between 1 and 1 + 2^-23: to the even 1 */
  assert_true(check_elem(&st, FMT32, x, 2, 1, -1, 1.0, NAN, 0, false));
  assert_false(check_elem(&st, FMT32, x, 2, 1, -1, 1 + 0x1p-23, NAN, 0, false));
  x[1] = 3 * 0x1p-24; /* a tie between 1 + 2^-23 and 1 + 2^-22: to the even 1 + 2^-22 */
  assert_true(check_elem(&st, FMT32, x, 2, 1, -1, 1 + 0x1p-22, NAN, 0, false));
  assert_false(check_elem(&st, FMT32, x, 2, 1, -1, 1 + 0x1p-23, NAN, 0, false));
  x[0] = -1; /* -1 + 3 2^-24 is a float: below 1 the spacing is 2^-24 */
  assert_true(check_elem(&st, FMT32, x, 2, 1, -1, -1 + 3 * 0x1p-24, NAN, 0, false));
  assert_false(check_elem(&st, FMT32, x, 2, 1, -1, -1 + 0x1p-23, NAN, 0, false));
  x[0] = 1, x[1] = 1, x[2] = 1; /* 3 / 3 */
  assert_true(check_elem(&st, FMT64, x, 3, 3, 1, 1.0, 3.0, 0, true));
  assert_false(check_elem(&st, FMT64, x, 3, 3, -1, 1 + 0x1p-52, NAN, 0, false));
  x[0] = 0x1p-1074, x[1] = 0x1p-1074, x[2] = 0; /* 2^-1073 / 2: the smallest subnormal */
  assert_true(check_elem(&st, FMT64, x, 2, 2, 0x1p-1074, 0x1p-1074, 0x1p-1073, 0, true));
  DDP_ASSERT_EQ(st.n, (size_t)11);
}

/* The largest magnitude of each block over all terms (what the bound is stated in). */
static double *block_max(const terms_t *T) {
  size_t nb = ddp_rsum_blocks(T->n);
  double *M = calloc(nb ? nb : 1, sizeof *M);
  assert_non_null(M);
  for (int64_t t = 0; t < T->k; t++)
    for (size_t i = 0; i < T->n; i++) M[i / BLK] = fmax(M[i / BLK], fabs(get(T, t, i)));
  return M;
}

/* Checks every element of out, the mean with divisor d of T's terms summed into acc with
 * exps, against the bound, and the sums before the division. */
static void check_all(stats_t *st, const terms_t *T, const int64_t *acc, const int32_t *exps,
                      int64_t d, const double *out, bool must_round) {
  double *M = block_max(T);
  double *x = calloc((size_t)T->k, sizeof *x), *s = calloc(T->n ? T->n : 1, sizeof *s);
  assert_true(x && s);
  ddp_rsum_result_f64(acc, exps, T->k, T->n, 1, s);
  for (size_t i = 0; i < T->n; i++) {
    for (int64_t t = 0; t < T->k; t++) x[t] = get(T, t, i);
    check_elem(st, T->f64 ? FMT64 : FMT32, x, T->k, d, M[i / BLK], out[i], s[i], i, must_round);
  }
  free(s);
  free(x);
  free(M);
}

/* The naive mean of f32 terms: a float sum left to right, divided in float. */
static void naive_mean_f32(const terms_t *T, double *out) {
  for (size_t i = 0; i < T->n; i++) {
    float s = 0;
    for (int64_t t = 0; t < T->k; t++) s += ((const float *)T->x[t])[i];
    out[i] = s / (float)T->k;
  }
}

static void measure_naive(stats_t *st, const terms_t *T, const double *out) {
  double *x = calloc((size_t)T->k, sizeof *x);
  assert_non_null(x);
  for (size_t i = 0; i < T->n; i++) {
    for (int64_t t = 0; t < T->k; t++) x[t] = get(T, t, i);
    check_elem(st, FMT32, x, T->k, T->k, -1, out[i], NAN, i, false);
  }
  free(x);
}

/* One line: the result's worst error in ulps and as a fraction of the bound, the
 * correctly rounded and within-one-ulp fractions; for rsum also the sum's worst error as a
 * fraction of n M 2^(c - 50). */
static void report(const char *what, int64_t k, const stats_t *st) {
  double nn = (double)st->n;
  print_message("%-26s K=%-3lld %5zu elems: max err %.4g ulp; correctly rounded %.2f%%, within 1 "
                "ulp %.2f%%",
                what, (long long)k, st->n, st->max_ulps, 100.0 * (double)st->correct / nn,
                100.0 * (double)st->within_ulp / nn);
  if (st->max_frac > 0)
    print_message("; %.4f of the bound; sum before division %.3g of n M 2^(c-50) (%zu finite)",
                  st->max_frac, st->max_sum_frac, st->sums);
  print_message("\n");
}

/* ---------------------------------------------------------------- independence ---- */

#define SENT32 INT32_C(0x5a5a5a5a)
#define SENT64 INT64_C(0x5a5a5a5a5a5a5a5a)

/* The first index where a and b (count elements of size sz) differ; count when none. */
static size_t first_diff(const void *a, const void *b, size_t count, size_t sz) {
  for (size_t i = 0; i < count; i++)
    if (memcmp((const char *)a + i * sz, (const char *)b + i * sz, sz)) return i;
  return count;
}

/* One sum three ways (in order; permuted through one multi-source call; over random
 * ranks): exps, accumulators and results agree bit for bit, and nothing is written past
 * element n or block ddp_rsum_blocks(n). */
static void check_independence(rng_t *r, const terms_t *T) {
  size_t n = T->n, nb = ddp_rsum_blocks(n);
  int64_t K = T->k;
  int32_t *e[3];
  int64_t *a[3];
  double *out[3];
  for (int w = 0; w < 3; w++) {
    e[w] = calloc(nb + 1, sizeof *e[w]);
    a[w] = calloc(n + 1, sizeof *a[w]);
    out[w] = calloc(n + 1, sizeof *out[w]);
    assert_true(e[w] && a[w] && out[w]);
    e[w][nb] = SENT32;
    a[w][n] = SENT64;
    out[w][n] = 0.5;
  }
  /* (i) in order, one term per call. */
  rsum_in_order(T, K, e[0], a[0], out[0]);

  /* (ii) a random permutation: exps in that order, then one call with every source. */
  int64_t *perm = calloc((size_t)K, sizeof *perm);
  assert_non_null(perm);
  for (int64_t t = 0; t < K; t++) perm[t] = t;
  shuffle(r, perm, K);
  for (int64_t t = 0; t < K; t++) exps_of(T, e[1], perm[t]);
  deposit(T, a[1], e[1], K, perm, (int)K, 0, n);
  result_of(T, a[1], e[1], K, out[1]);

  /* (iii) G ranks with random terms each (some may have none): each its own exps, combined
   * by MAX; each deposits its terms in chunks of 1 to 3 sources, every chunk split at a
   * random block boundary into two calls, the first chunk overwriting accumulators that hold
   * garbage; the accumulators added in a random rank order. */
  int64_t G = 1 + below(r, K);
  int64_t *rank_of = calloc((size_t)K, sizeof *rank_of), *order = calloc((size_t)G, sizeof *order);
  int32_t *eg = calloc(nb + 1, sizeof *eg);
  int64_t **ag = calloc((size_t)G, sizeof *ag);
  assert_true(rank_of && order && eg && ag);
  for (int64_t t = 0; t < K; t++) rank_of[t] = below(r, G);
  for (int64_t g = 0; g < G; g++) order[g] = g;
  shuffle(r, order, G);
  for (int64_t gi = 0; gi < G; gi++) {
    memset(eg, 0, nb * sizeof *eg);
    for (int64_t t = 0; t < K; t++)
      if (rank_of[perm[t]] == order[gi]) exps_of(T, eg, perm[t]);
    for (size_t b = 0; b < nb; b++) e[2][b] = eg[b] > e[2][b] ? eg[b] : e[2][b];
  }
  for (int64_t g = 0; g < G; g++) {
    ag[g] = malloc((n ? n : 1) * sizeof *ag[g]);
    assert_non_null(ag[g]);
    int64_t mine[64 + 1], cnt = 0;
    for (int64_t t = 0; t < K; t++)
      if (rank_of[perm[t]] == g) mine[cnt++] = perm[t];
    memset(ag[g], cnt ? 0xa5 : 0, (n ? n : 1) * sizeof *ag[g]);
    for (int64_t s = 0; s < cnt;) {
      int64_t chunk = 1 + below(r, 3);
      if (chunk > cnt - s) chunk = cnt - s;
      size_t cut = (size_t)below(r, (int64_t)nb + 1) * BLK;
      if (cut > n) cut = n;
      if (cut > 0) deposit_to(T, ag[g], e[2], K, s > 0, mine + s, (int)chunk, 0, cut);
      if (cut < n) deposit_to(T, ag[g], e[2], K, s > 0, mine + s, (int)chunk, cut, n - cut);
      s += chunk;
    }
  }
  shuffle(r, order, G);
  for (int64_t gi = 0; gi < G; gi++)
    for (size_t i = 0; i < n; i++) a[2][i] += ag[order[gi]][i];
  result_of(T, a[2], e[2], K, out[2]);

  for (int w = 1; w < 3; w++) {
    size_t i = first_diff(e[0], e[w], nb + 1, sizeof *e[0]);
    if (i <= nb) DDP_ASSERT_EQ(e[0][i], e[w][i]);
    i = first_diff(a[0], a[w], n + 1, sizeof *a[0]);
    if (i <= n) DDP_ASSERT_EQ(a[0][i], a[w][i]);
    i = first_diff(out[0], out[w], n, sizeof *out[0]);
    if (i < n) DDP_ASSERT_SAME_BITS(out[0][i], out[w][i]);
  }
  DDP_ASSERT_EQ(e[0][nb], SENT32);
  DDP_ASSERT_EQ(a[0][n], SENT64);

  for (int64_t g = 0; g < G; g++) free(ag[g]);
  free(ag);
  free(eg);
  free(order);
  free(rank_of);
  free(perm);
  for (int w = 0; w < 3; w++) {
    free(e[w]);
    free(a[w]);
    free(out[w]);
  }
}

static void independence(bool f64) {
  static const int64_t ks[] = {2, 3, 12, 64};
  rng_t r = {f64 ? 64 : 32};
  for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
    for (int trial = 0; trial < 40; trial++) {
      size_t n = 1 + (size_t)below(&r, 300); /* mostly a partial last block */
      terms_t T = terms_new(f64, ks[ki], n);
      fill(&r, &T, trial % 4 == 3 ? GRADLIKE : WIDE);
      check_independence(&r, &T);
      terms_free(&T);
    }
  }
}

/* f32 terms: the result does not depend on the order or the grouping of the terms. */
static void test_order_grouping_f32(void **state) {
  (void)state;
  independence(false);
}

/* f64 terms: the same. */
static void test_order_grouping_f64(void **state) {
  (void)state;
  independence(true);
}

/* ---------------------------------------------------------------- accuracy -------- */

static void accuracy(bool f64, kind_t kind, const char *what) {
  static const int64_t ks[] = {1, 2, 3, 12, 64};
  rng_t r = {(uint64_t)(100 + kind + 10 * f64)};
  for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
    size_t n = 64 * BLK + 7;
    terms_t T = terms_new(f64, ks[ki], n);
    fill(&r, &T, kind);
    int32_t *e = calloc(ddp_rsum_blocks(n), sizeof *e);
    int64_t *a = calloc(n, sizeof *a);
    double *out = calloc(n, sizeof *out);
    assert_true(e && a && out);
    rsum_in_order(&T, T.k, e, a, out);
    stats_t st = {0};
    check_all(&st, &T, a, e, T.k, out, false);
    report(what, T.k, &st);
    if (!f64) {
      stats_t nv = {0};
      naive_mean_f32(&T, out);
      measure_naive(&nv, &T, out);
      report("  naive float sum / K", T.k, &nv);
    }
    free(e);
    free(a);
    free(out);
    terms_free(&T);
  }
}

/* Wide-range f32 terms: every mean within the documented bound (figures printed). */
static void test_accuracy_wide_f32(void **state) {
  (void)state;
  accuracy(false, WIDE, "rsum f32 wide range");
}

/* Gradient-like f32 terms (a few binades): within the bound. */
static void test_accuracy_gradlike_f32(void **state) {
  (void)state;
  accuracy(false, GRADLIKE, "rsum f32 gradient-like");
}

/* f64 terms, f64 results: within the bound. */
static void test_accuracy_f64(void **state) {
  (void)state;
  accuracy(true, WIDE, "rsum f64 wide range");
  accuracy(true, GRADLIKE, "rsum f64 gradient-like");
}

/* ---------------------------------------------------------------- edge cases ------ */

/* A block whose terms are all zeros (of either sign) has exps 0 and gives +0; zeros in
 * some terms only change nothing else. */
static void test_zero_blocks(void **state) {
  (void)state;
  rng_t r = {7};
  for (int f64 = 0; f64 < 2; f64++) {
    size_t n = 3 * BLK + 5, nb = ddp_rsum_blocks(n);
    terms_t T = terms_new(f64, 5, n);
    fill(&r, &T, GRADLIKE);
    for (int64_t t = 0; t < T.k; t++)
      for (size_t i = BLK; i < 2 * BLK; i++) set(&T, t, i, t % 2 ? -0.0 : 0.0);
    for (size_t i = 2 * BLK; i < n; i++) set(&T, 1, i, -0.0);
    int32_t e[8] = {0};
    int64_t a[3 * BLK + 5];
    double out[3 * BLK + 5];
    rsum_in_order(&T, T.k, e, a, out);
    DDP_ASSERT_EQ(e[1], 0);
    for (size_t b = 0; b < nb; b++)
      if (b != 1) assert_true(e[b] > 0 && e[b] != DDP_RSUM_POISON);
    for (size_t i = BLK; i < 2 * BLK; i++) {
      DDP_ASSERT_EQ(a[i], 0);
      if (f64)
        DDP_ASSERT_SAME_BITS(out[i], 0.0);
      else
        DDP_ASSERT_SAME_BITS((float)out[i], 0.0f);
    }
    stats_t st = {0};
    check_all(&st, &T, a, e, T.k, out, false);
    /* the all-zero block through result alone, also for an accumulator left nonzero */
    a[BLK] = 12345;
    float o32[3 * BLK + 5];
    ddp_rsum_result_f32(a, e, T.k, n, T.k, o32);
    DDP_ASSERT_SAME_BITS(o32[BLK], 0.0f);
    terms_free(&T);
  }
}

/* A NaN or an infinity in one term poisons its block only: exps POISON, results NaN; the
 * other blocks are bit for bit those of the same sum with a finite value there. */
static void test_nan_inf(void **state) {
  (void)state;
  static const double bad[] = {NAN, INFINITY, -INFINITY};
  rng_t r = {11};
  for (int f64 = 0; f64 < 2; f64++) {
    for (size_t bi = 0; bi < 3; bi++) {
      size_t n = 4 * BLK - 3, nb = ddp_rsum_blocks(n);
      size_t where = bi == 2 ? 3 * BLK + 4 : BLK + 7 * bi; /* block 1, 1, 3 (the partial) */
      terms_t T = terms_new(f64, 6, n);
      fill(&r, &T, WIDE);
      int32_t e0[4] = {0}, e1[4] = {0};
      int64_t a0[4 * BLK], a1[4 * BLK];
      double o0[4 * BLK], o1[4 * BLK];
      rsum_in_order(&T, T.k, e0, a0, o0);
      set(&T, (int64_t)bi + 1, where, bad[bi]);
      rsum_in_order(&T, T.k, e1, a1, o1);
      for (size_t b = 0; b < nb; b++) {
        if (b == where / BLK)
          DDP_ASSERT_EQ(e1[b], DDP_RSUM_POISON);
        else
          DDP_ASSERT_EQ(e1[b], e0[b]);
      }
      for (size_t i = 0; i < n; i++) {
        if (i / BLK == where / BLK) {
          if (!isnan(o1[i])) fail_msg("element %zu of the poisoned block: %a, not NaN", i, o1[i]);
        } else {
          DDP_ASSERT_SAME_BITS(o1[i], o0[i]);
        }
      }
      terms_free(&T);
    }
  }
}

/* Subnormal f32 terms: the grid is finer than 2^-149, so the sum is exact and every mean
 * is the correctly rounded one; mixed with the smallest normals, within the bound.
 * Subnormal f64 terms (subnormal means): within the bound. */
static void test_subnormal(void **state) {
  (void)state;
  rng_t r = {13};
  static const int64_t ks[] = {3, 12, 64};
  for (size_t ki = 0; ki < 3; ki++) {
    size_t n = 10 * BLK + 9;
    terms_t T = terms_new(false, ks[ki], n);
    fill(&r, &T, SUBNORMAL);
    int32_t e[11];
    int64_t a[10 * BLK + 9];
    double out[10 * BLK + 9];
    rsum_in_order(&T, T.k, e, a, out);
    stats_t st = {0};
    check_all(&st, &T, a, e, T.k, out, true);
    for (int64_t t = 0; t < T.k; t += 2)
      for (size_t i = 0; i < n; i += 3)
        set(&T, t, i, ldexp(1 + unif(&r), -126 + (int)below(&r, 3)));
    rsum_in_order(&T, T.k, e, a, out);
    check_all(&st, &T, a, e, T.k, out, false);
    terms_free(&T);
    T = terms_new(true, ks[ki], n);
    fill(&r, &T, SUBNORMAL);
    rsum_in_order(&T, T.k, e, a, out);
    stats_t s64 = {0};
    check_all(&s64, &T, a, e, T.k, out, false);
    report("rsum f64 subnormal", T.k, &s64);
    terms_free(&T);
  }
}

/* f64 terms near 2^-1000 and near 2^1000 (up to 1.9 2^1023, whose mean is finite): within
 * the bound, finite. */
static void test_f64_extremes(void **state) {
  (void)state;
  rng_t r = {17};
  static const int base[] = {-1000, -990, 1000, 1023};
  for (size_t bi = 0; bi < sizeof base / sizeof base[0]; bi++) {
    static const int64_t ks[] = {1, 3, 12, 64};
    for (size_t ki = 0; ki < 4; ki++) {
      size_t n = 5 * BLK + 3;
      terms_t T = terms_new(true, ks[ki], n);
      for (int64_t t = 0; t < T.k; t++)
        for (size_t i = 0; i < n; i++) {
          double s = base[bi] == 1023 ? 1 : (rnd(&r) & 1 ? -1 : 1); /* same sign near the top */
          set(&T, t, i, s * ldexp(1 + 0.9 * unif(&r), base[bi] - (int)below(&r, 6)));
        }
      int32_t e[6];
      int64_t a[5 * BLK + 3];
      double out[5 * BLK + 3];
      rsum_in_order(&T, T.k, e, a, out);
      stats_t st = {0};
      check_all(&st, &T, a, e, T.k, out, false);
      char what[64];
      snprintf(what, sizeof what, "rsum f64 near 2^%d", base[bi]);
      report(what, T.k, &st);
      terms_free(&T);
    }
  }
}

/* DDP_RSUM_MAX_TERMS terms of +-FLT_MAX (through sixteen multi-source calls) do not
 * overflow: the means are FLT_MAX, -FLT_MAX and, for as many + as -, +0; likewise in f64. */
static void test_max_terms(void **state) {
  (void)state;
  enum { N = 40, K = DDP_RSUM_MAX_TERMS };
  float A[N], B[N];
  for (int i = 0; i < N; i++) {
    A[i] = i < 20 ? FLT_MAX : i < 30 ? -FLT_MAX : FLT_MAX;
    B[i] = i < 20 ? FLT_MAX : i < 30 ? -FLT_MAX : -FLT_MAX;
  }
  const float **src = calloc(K, sizeof *src);
  assert_non_null(src);
  for (int s = 0; s < K; s++) src[s] = s % 2 ? B : A;
  int32_t e[2] = {0};
  int64_t a[N] = {0};
  ddp_rsum_exps_f32(e, A, N);
  ddp_rsum_exps_f32(e, B, N);
  for (int call = 0; call < 16; call++)
    ddp_rsum_deposit_f32(a, e, K, true, K / 16, src + call * (K / 16), N);
  float o[N];
  double o64[N];
  ddp_rsum_result_f32(a, e, K, N, K, o);
  ddp_rsum_result_f64(a, e, K, N, K, o64);
  for (int i = 0; i < N; i++) {
    float want = i < 20 ? FLT_MAX : i < 30 ? -FLT_MAX : 0.0f;
    DDP_ASSERT_SAME_BITS(o[i], want);
    DDP_ASSERT_SAME_BITS(o64[i], (double)want);
  }
  free(src);
}

/* The last, partial block has its own grid: one element of 2^-100 scale after a block of
 * 2^10 values is exact; n = 31 and n = 33 leave what follows untouched. */
static void test_partial_block(void **state) {
  (void)state;
  for (size_t n = 31; n <= 33; n++) {
    terms_t T = terms_new(false, 3, n);
    for (int64_t t = 0; t < 3; t++)
      for (size_t i = 0; i < n; i++)
        set(&T, t, i, i < BLK ? ldexp(1 + (double)(i + t) / 64, 10) : ldexp(1 + t / 8.0, -100));
    int32_t e[3] = {0, 0, SENT32};
    int64_t a[34];
    double out[34];
    a[n] = SENT64;
    out[n] = 0.25;
    rsum_in_order(&T, 3, e, a, out);
    DDP_ASSERT_EQ(e[ddp_rsum_blocks(n)], ddp_rsum_blocks(n) == 2 ? SENT32 : 0);
    DDP_ASSERT_EQ(a[n], SENT64);
    DDP_ASSERT_EQ(out[n], 0.25);
    if (n == 33) DDP_ASSERT_SAME_BITS((float)out[32], (float)ldexp(1.125, -100));
    stats_t st = {0};
    check_all(&st, &T, a, e, 3, out, true); /* these sums are exact on the grid */
    terms_free(&T);
  }
}

/* One term: terms within 2^26 of their block's largest come back bit for bit (the grid
 * holds 50 bits); divisor 1 and 2 on the same accumulators. */
static void test_one_term(void **state) {
  (void)state;
  rng_t r = {19};
  for (int f64 = 0; f64 < 2; f64++) {
    size_t n = 4 * BLK + 1;
    terms_t T = terms_new(f64, 1, n);
    for (size_t i = 0; i < n; i++) {
      double v = (rnd(&r) & 1 ? -1 : 1) * ldexp(1 + unif(&r), -20 + (int)below(&r, 20));
      set(&T, 0, i, f64 ? ldexp(round(ldexp(v, 26)), -26) : v); /* f64: 2^-26 grid too */
    }
    int32_t e[5];
    int64_t a[4 * BLK + 1];
    double out[4 * BLK + 1];
    rsum_in_order(&T, 1, e, a, out);
    for (size_t i = 0; i < n; i++) DDP_ASSERT_SAME_BITS(out[i], get(&T, 0, i));
    result_of(&T, a, e, 2, out);
    for (size_t i = 0; i < n; i++) DDP_ASSERT_SAME_BITS(out[i], get(&T, 0, i) / 2);
    terms_free(&T);
  }
}

/* ---------------------------------------------------------------- MLP gradients --- */

/* A 20-64-64-10 f32 MLP; a batch of 48 split into 12 shards of 4, each shard's gradient
 * of its mean cross-entropy; rsum's mean of the 12 against the exact mean of those same
 * f32 gradients: within the bound, and at least as often correctly rounded, and with no
 * larger worst error, as the naive float sum / 12. */
static void test_mlp_shard_gradients(void **state) {
  (void)state;
  enum { IN = 20, CLS = 10, SHARDS = 12, PER = 4 };
  const char *json = "{\"dtype\": \"f32\", \"layers\": ["
                     "{\"type\": \"linear\", \"in\": 20, \"out\": 64}, {\"type\": \"tanh\"},"
                     "{\"type\": \"linear\", \"in\": 64, \"out\": 64}, {\"type\": \"relu\"},"
                     "{\"type\": \"linear\", \"in\": 64, \"out\": 10}]}";
  ddp_model_t *m;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(json, &m, &err), DDP_OK);
  assert_int_equal(ddp_model_init(m, 5), DDP_OK);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  size_t n = (size_t)ddp_model_flat_grads(m, DDP_F32).numel;
  assert_int_equal(n, 20 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10);
  terms_t T = terms_new(false, SHARDS, n);
  rng_t r = {23};
  float xs[SHARDS * PER * IN];
  int64_t ys[SHARDS * PER];
  for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++) xs[i] = (float)gauss(&r);
  for (size_t i = 0; i < SHARDS * PER; i++) ys[i] = below(&r, CLS);
  for (int k = 0; k < SHARDS; k++) {
    ddp_ctx_reset(c);
    ddp_model_zero_grad(m);
    ddp_var_t *x, *t, *logits, *loss;
    assert_int_equal(ddp_var_new(c, DDP_F32, 2, (int64_t[]){PER, IN}, xs + k * PER * IN, false, &x),
                     DDP_OK);
    assert_int_equal(ddp_var_new(c, DDP_I64, 1, (int64_t[]){PER}, ys + k * PER, false, &t), DDP_OK);
    assert_int_equal(ddp_model_forward(m, c, x, 0, &logits), DDP_OK);
    assert_int_equal(ddp_cross_entropy(c, logits, t, -100, &loss), DDP_OK);
    assert_int_equal(ddp_backward(c, loss), DDP_OK);
    memcpy(T.x[k], ddp_model_flat_grads(m, DDP_F32).data, n * sizeof(float));
  }
  int32_t *e = calloc(ddp_rsum_blocks(n), sizeof *e);
  int64_t *a = calloc(n, sizeof *a);
  double *out = calloc(n, sizeof *out);
  assert_true(e && a && out);
  rsum_in_order(&T, SHARDS, e, a, out);
  stats_t st = {0}, nv = {0};
  check_all(&st, &T, a, e, SHARDS, out, false);
  report("rsum MLP shard gradients", SHARDS, &st);
  naive_mean_f32(&T, out);
  measure_naive(&nv, &T, out);
  report("  naive float sum / 12", SHARDS, &nv);
  assert_true(st.correct >= nv.correct);
  if (!(st.max_ulps <= nv.max_ulps)) fail_msg("rsum %g ulp, naive %g", st.max_ulps, nv.max_ulps);
  free(e);
  free(a);
  free(out);
  terms_free(&T);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_oracle),
      cmocka_unit_test(test_order_grouping_f32),
      cmocka_unit_test(test_order_grouping_f64),
      cmocka_unit_test(test_accuracy_wide_f32),
      cmocka_unit_test(test_accuracy_gradlike_f32),
      cmocka_unit_test(test_accuracy_f64),
      cmocka_unit_test(test_zero_blocks),
      cmocka_unit_test(test_nan_inf),
      cmocka_unit_test(test_subnormal),
      cmocka_unit_test(test_f64_extremes),
      cmocka_unit_test(test_max_terms),
      cmocka_unit_test(test_partial_block),
      cmocka_unit_test(test_one_term),
      cmocka_unit_test(test_mlp_shard_gradients),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
