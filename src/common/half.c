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
