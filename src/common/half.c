/* fp16 (IEEE binary16) and bf16 conversions with round-to-nearest-even.
 *
 * Narrowing works on the float's bits. For bf16 the float is truncated to its top 16 bits
 * after adding 0x7fff plus the lowest kept bit, which is exactly round-to-nearest-even on the
 * mantissa, carrying into the exponent (and up to Inf) when it must. For fp16 the exponent is
 * rebiased (127 -> 15); numbers below fp16's normal range are shifted into a subnormal,
 * rounding on the bits shifted out, and numbers at or past 65520 round to Inf. NaN keeps its
 * sign and top payload bits and is forced quiet, so it never turns into Inf. */
#include <string.h>

#include "common/common.h"

/* The F16C path needs __builtin_cpu_supports("f16c"), which GCC has and clang 14 (the fuzz
 * build's compiler) rejects; without it the element functions give the same bits, slower. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define DDP_HAVE_F16C_PATH 1
#endif

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

ddp_bf16_t ddp_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ddp_bf16_t)((u >> 16) | 0x0040u); /* NaN */
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return (ddp_bf16_t)(u >> 16);
}

float ddp_bf16_to_f32(ddp_bf16_t h) { return bits_f32((uint32_t)h << 16); }

ddp_f16_t ddp_f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (ddp_f16_t)(sign | 0x7e00u | ((a >> 13) & 0x03ffu)); /* NaN */
  if (a >= 0x477ff000u) return (ddp_f16_t)(sign | 0x7c00u); /* >= 65520 rounds to Inf */
  if (a < 0x38800000u) {
    /* Below 2^-14: the result is subnormal (or zero). Value = mant * 2^(exp-150); the fp16
     * subnormal unit is 2^-24, so shift the full 24-bit mantissa right by 126 - exp. */
    if (a < 0x33000000u) return sign; /* below half of the smallest subnormal: +-0 */
    uint32_t exp = a >> 23;
    uint32_t mant = (a & 0x007fffffu) | 0x00800000u;
    uint32_t shift = 126u - exp; /* 14 .. 24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (ddp_f16_t)(sign | q);
  }
  /* Normal: rebias and round the 13 dropped mantissa bits to nearest even. A carry out of
   * the mantissa correctly bumps the exponent. */
  uint32_t r = a - 0x38000000u; /* (127 - 15) << 23 */
  uint32_t lsb = (r >> 13) & 1u;
  r += 0x0fffu + lsb;
  return (ddp_f16_t)(sign | (r >> 13));
}

float ddp_f16_to_f32(ddp_f16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x03ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* Inf, NaN */
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    /* Subnormal: mant * 2^-24, exact in float. */
    float v = (float)mant * 0x1p-24f;
    return bits_f32(sign | f32_bits(v));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* ---- arrays ----
 * The same conversions over arrays, which the compression hooks and the f16/bf16
 * reductions use. bf16 is integer work the compiler vectorizes. fp16 uses the CPU's F16C
 * instructions where it has them (8 lanes, round to nearest even, as the scalar code):
 * narrowing gives the scalar code's bits for every input, NaNs included; widening differs
 * only for signalling NaNs, which the hardware quiets, so a block of 8 that holds one is
 * widened by the scalar code instead. Without F16C everything is scalar. */

void ddp_bf16_to_f32_n(const ddp_bf16_t *src, float *dst, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)src[i] << 16);
}

void ddp_f32_to_bf16_n(const float *src, ddp_bf16_t *dst, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u = f32_bits(src[i]);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = (ddp_bf16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x0040u : r);
  }
}

#ifdef DDP_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) static size_t f16_to_f32_f16c(const ddp_f16_t *src, float *dst,
                                                                  size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
    /* A signalling NaN: exponent all ones, quiet bit clear, payload not zero. */
    __m128i expq = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7e00)),
                                   _mm_set1_epi16(0x7c00));
    __m128i zero = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x01ff)), _mm_setzero_si128());
    if (_mm_movemask_epi8(_mm_andnot_si128(zero, expq))) {
      for (size_t k = i; k < i + 8; k++) dst[k] = ddp_f16_to_f32(src[k]);
    } else {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
  }
  return i;
}

__attribute__((target("avx,f16c"))) static size_t f32_to_f16_f16c(const float *src, ddp_f16_t *dst,
                                                                  size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(dst + i), h);
  }
  return i;
}
#endif

void ddp_f16_to_f32_n(const ddp_f16_t *src, float *dst, size_t n) {
  size_t i = 0;
#ifdef DDP_HAVE_F16C_PATH
  if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"))
    i = f16_to_f32_f16c(src, dst, n);
#endif
  for (; i < n; i++) dst[i] = ddp_f16_to_f32(src[i]);
}

void ddp_f32_to_f16_n(const float *src, ddp_f16_t *dst, size_t n) {
  size_t i = 0;
#ifdef DDP_HAVE_F16C_PATH
  if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"))
    i = f32_to_f16_f16c(src, dst, n);
#endif
  for (; i < n; i++) dst[i] = ddp_f32_to_f16(src[i]);
}
