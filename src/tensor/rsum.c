/* The pre-rounded reproducible sum (ddp_rsum_* in ddp/tensor.h).
 *
 * The method is Demmel and Nguyen's pre-rounding ("Fast reproducible floating-point
 * summation", 2013), the one-fold ancestor of ReproBLAS's binned sums. Elements are
 * grouped in blocks of DDP_RSUM_BLOCK consecutive elements. First the largest magnitude
 * of each block over every term of the sum is bounded by a power of two, |x| < 2^L
 * (ddp_rsum_exps_*, combined across ranks by an allreduce MAX, which is exact). With L
 * and the number of terms n known, every term is rounded to the same grid, the multiples
 * of 2^g with g = L - 50 + c, c = ceil(log2 n), and kept as the integer x / 2^g
 * (ddp_rsum_deposit_*). Each such integer is below 2^(50 - c) in magnitude, so n of them
 * add up exactly below 2^50: integer additions are associative, and the sum is the same
 * bits whatever the order and grouping, within a rank (its shards) and across ranks (an
 * allreduce SUM of the int64 accumulators, in any algorithm order). The result is the
 * integer times 2^g, divided by the divisor in double, rounded once to the dtype
 * (ddp_rsum_result_*).
 *
 * Error against the exact sum S of the n terms, for an element whose block has largest
 * magnitude M (so M >= 2^(L - 1)): each term moves by at most half a grid unit,
 * 2^(g - 1) = 2^(L - 51 + c) <= M 2^(c - 50), so |sum - S| <= n M 2^(c - 50). The integer
 * is exact in double (below 2^51), the scaling by 2^g is exact, and the division and the
 * rounding to the dtype add at most 2^-53 |S / divisor| and half an ulp of the result.
 * For n = 12 terms that is M 2^-42.4 on the sum: far below float's own rounding, so the
 * mean is almost always the correctly rounded mean of the exact shard gradients.
 *
 * Rounding to the grid and converting to an integer use the 1.5 * 2^52 trick (y + MAGIC
 * rounds y to an integer, to nearest even, and the low bits of the double are that
 * integer), which vectorizes without AVX-512DQ. A NaN or infinite term poisons its block
 * (DDP_RSUM_POISON; the results of the block are NaN): an overflowing gradient shows as
 * NaN, never as a wrong finite number. */
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "common/common.h"
#include "ddp/tensor.h"

#define BLK DDP_RSUM_BLOCK
/* A block's stored exponent is L + EBIAS (L is in -1021 ... 1024 for f64, -125 ... 128 for
 * f32), so that 0, what zeroed memory holds, means "every term was zero". */
#define EBIAS 2048
#define MAGIC 6755399441055744.0 /* 1.5 * 2^52 */
#define GRID_BITS 50

size_t ddp_rsum_blocks(size_t n) { return (n + BLK - 1) / BLK; }

/* 2^k: from its bits inside double's normal range, ldexp outside it. */
static inline double pow2(int k) {
  if (k < -1022 || k > 1023) return ldexp(1.0, k);
  uint64_t u = (uint64_t)(k + 1023) << 52;
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

static inline int64_t bits_of(double d) {
  int64_t k;
  memcpy(&k, &d, sizeof k);
  return k;
}

static inline double from_bits(int64_t k) {
  double d;
  memcpy(&d, &k, sizeof d);
  return d;
}

/* c = ceil(log2 terms), terms >= 1. */
static int ceil_log2(int64_t terms) {
  int c = 0;
  while ((INT64_C(1) << c) < terms) c++;
  return c;
}

/* A block's exponent code from the bits of its largest magnitude mx: the exponent field e
 * (subnormals as 1), |x| < 2^(e - eb), stored as e - eb + EBIAS; 0 for all zeros,
 * DDP_RSUM_POISON for a NaN or an infinity. */
static inline int32_t block_code(uint64_t mx, uint64_t inf_bits, int shift, int eb) {
  if (mx == 0) return 0;
  if (mx >= inf_bits) return DDP_RSUM_POISON;
  uint64_t e = mx >> shift;
  return (int32_t)(e ? e : 1) - eb + EBIAS;
}

/* exps[b] = max(exps[b], block b's code) for the n values of SRC, running MOVE on each
 * element k (at offset base) as it is read: nothing for ddp_rsum_exps_*; dst = src and
 * src = 0 for ddp_rsum_take_*, which moves a gradient still in cache into its slot in the
 * same pass instead of three. */
#define EXPS_(SIGNATURE, SRC, MOVE, U, ABS_MASK, INF_BITS, SHIFT, EB) \
  DDP_VEC_CLONES void SIGNATURE {                                     \
    for (size_t b = 0, base = 0; base < n; b++, base += BLK) {        \
      size_t m = DDP_MIN((size_t)BLK, n - base);                      \
      U mx = 0;                                                       \
      for (size_t k = 0; k < m; k++) {                                \
        U u;                                                          \
        memcpy(&u, &SRC[base + k], sizeof u);                         \
        MOVE;                                                         \
        u &= ABS_MASK;                                                \
        mx = u > mx ? u : mx;                                         \
      }                                                               \
      int32_t code = block_code(mx, INF_BITS, SHIFT, EB);             \
      if (code > exps[b]) exps[b] = code;                             \
    }                                                                 \
  }
#define F32_ uint32_t, 0x7fffffffu, 0x7f800000u, 23, 126
#define F64_ uint64_t, 0x7fffffffffffffffu, 0x7ff0000000000000u, 52, 1022
#define MOVE_ (dst[base + k] = src[base + k], src[base + k] = 0)
#define EXPS(...) EXPS_(__VA_ARGS__) /* F32_ and F64_ expand into their five arguments */

EXPS(ddp_rsum_exps_f32(int32_t *exps, const float *x, size_t n), x, (void)0, F32_)
EXPS(ddp_rsum_exps_f64(int32_t *exps, const double *x, size_t n), x, (void)0, F64_)
EXPS(ddp_rsum_take_f32(int32_t *exps, float *restrict dst, float *restrict src, size_t n), src,
     MOVE_, F32_)
EXPS(ddp_rsum_take_f64(int32_t *exps, double *restrict dst, double *restrict src, size_t n), src,
     MOVE_, F64_)

/* acc[k] = (add ? acc[k] : 0) + the sum over the sources of x[k] / 2^g rounded to an
 * integer, per block with its grid. The block is the outer loop, so that its accumulators
 * stay in L1 while every source is added (one pass over acc however many sources; a block
 * not added to is zeroed there, never in a pass of its own). The sources are as many
 * streams as there are shards, each read once from memory far from the last use, so each
 * is prefetched PREFETCH bytes ahead; a full block has a constant trip count. x / 2^g is
 * exact: 2^-g alone overflows double for f64 blocks below 2^-973, and then x is first
 * scaled by 2^(-g - 1023), which only moves its bits up, and then by 2^1023
 * (x 2^-g < 2^50), in a loop of its own so that the usual one keeps a single multiply. */
#define PREFETCH 2048
#define DEPOSIT_(NAME, T)                                                                        \
  DDP_VEC_CLONES void NAME(int64_t *acc, const int32_t *exps, int64_t terms, bool add, int nsrc, \
                           const T *const *srcs, size_t n) {                                     \
    int c = ceil_log2(terms);                                                                    \
    const int64_t km = bits_of(MAGIC);                                                           \
    for (size_t b = 0, base = 0; base < n; b++, base += BLK) {                                   \
      size_t m = DDP_MIN((size_t)BLK, n - base);                                                 \
      int64_t *a = acc + base;                                                                   \
      if (!add)                                                                                  \
        for (size_t k = 0; k < m; k++) a[k] = 0;                                                 \
      if (exps[b] == 0 || exps[b] == DDP_RSUM_POISON) continue;                                  \
      int ks = GRID_BITS - c - (exps[b] - EBIAS);                                                \
      double pre = ks > 1023 ? pow2(ks - 1023) : 1.0, scale = pow2(ks > 1023 ? 1023 : ks);       \
      if (ks > 1023) {                                                                           \
        for (int s = 0; s < nsrc; s++)                                                           \
          for (size_t k = 0; k < m; k++)                                                         \
            a[k] += bits_of((double)srcs[s][base + k] * pre * scale + MAGIC) - km;               \
      } else if (m == BLK) {                                                                     \
        for (int s = 0; s < nsrc; s++) {                                                         \
          const T *xb = srcs[s] + base;                                                          \
          if ((base + BLK) * sizeof(T) + PREFETCH <= n * sizeof(T)) /* inside the source */      \
            for (size_t o = 0; o < BLK * sizeof(T); o += 64)                                     \
              __builtin_prefetch((const char *)xb + PREFETCH + o, 0, 0);                         \
          for (size_t k = 0; k < BLK; k++) a[k] += bits_of((double)xb[k] * scale + MAGIC) - km;  \
        }                                                                                        \
      } else {                                                                                   \
        for (int s = 0; s < nsrc; s++)                                                           \
          for (size_t k = 0; k < m; k++)                                                         \
            a[k] += bits_of((double)srcs[s][base + k] * scale + MAGIC) - km;                     \
      }                                                                                          \
    }                                                                                            \
  }

DEPOSIT_(ddp_rsum_deposit_f32, float)
DEPOSIT_(ddp_rsum_deposit_f64, double)

/* out[k] = acc[k] 2^g / divisor, rounded once to T (the integer and the scaling are
 * exact, barring f64 results outside double's normal range). */
#define RESULT_(NAME, T)                                                                        \
  DDP_VEC_CLONES void NAME(const int64_t *acc, const int32_t *exps, int64_t terms, size_t n,    \
                           int64_t divisor, T *out) {                                           \
    int c = ceil_log2(terms);                                                                   \
    const int64_t km = bits_of(MAGIC);                                                          \
    double div = (double)divisor;                                                               \
    for (size_t b = 0, base = 0; base < n; b++, base += BLK) {                                  \
      size_t m = DDP_MIN((size_t)BLK, n - base);                                                \
      T *o = out + base;                                                                        \
      if (exps[b] == 0 || exps[b] == DDP_RSUM_POISON) {                                         \
        for (size_t k = 0; k < m; k++) o[k] = exps[b] ? (T)NAN : (T)0;                          \
        continue;                                                                               \
      }                                                                                         \
      int g = exps[b] - EBIAS - GRID_BITS + c;                                                  \
      const int64_t *a = acc + base;                                                            \
      if (g >= -1022 && g <= 1023 - 51) {                                                       \
        double unit = pow2(g);                                                                  \
        for (size_t k = 0; k < m; k++) o[k] = (T)((from_bits(a[k] + km) - MAGIC) * unit / div); \
      } else { /* high g: divided first, as the sum may overflow where the mean does not;       \
                * low g: scaled first, exact (a multiple of 2^-1071), then rounded once */      \
        for (size_t k = 0; k < m; k++)                                                          \
          o[k] = (T)(g > 0 ? ldexp((double)a[k] / div, g) : ldexp((double)a[k], g) / div);      \
      }                                                                                         \
    }                                                                                           \
  }

RESULT_(ddp_rsum_result_f32, float)
RESULT_(ddp_rsum_result_f64, double)
