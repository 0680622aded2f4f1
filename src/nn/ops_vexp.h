/* A float exponential that GCC vectorizes, for the F32 kernels whose time is exp: gelu_new
 * (DDP_ACT_GELU_TANH), the causal-LM loss over the vocabulary and attention's softmax.
 * Private to src/nn.
 *
 * libm's exp is a call per element, which no loop around it can vectorize; over the
 * 256 x 50257 logits of a GPT-2 step and the 256 x 3072 x 12 MLP activations those calls
 * were most of the step's time outside the matrix products. ddp__vexpf is branch-free
 * (a clamp, a rounding, a polynomial and an exponent built in the bits), so a loop of it
 * becomes vector code. Accuracy: relative error below 1e-7 (about 1 float ulp) on
 * [-87.3, 88.3]; below that range the result is 0, above it exp(88.3) (never inf or NaN
 * for a finite argument); NaN gives NaN. The F64 kernels keep libm's exp: their parity
 * tolerance (1e-10) needs it.
 *
 * Method (Cephes' expf): x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (ln2 split
 * in two parts so that n * ln2 is exact enough), exp(r) by a degree-7 polynomial, then 2^n
 * multiplied in by building the float 2^n from its exponent bits. */
#ifndef DDP_NN_OPS_VEXP_H
#define DDP_NN_OPS_VEXP_H

#include <stdint.h>
#include <string.h>

/* For a function whose loop calls ddp__vexpf. GCC if-converts the clamps below (and so
 * vectorizes the loop) only when it may assume that floating-point operations do not trap;
 * that assumption changes no value (exception flags are never read in libddp). On x86-64
 * the function is also compiled for AVX-512 (16 floats a vector) and AVX2 (8) besides
 * SSE2's 4, and the variant is picked when the library loads; contraction stays off and
 * the sums keep their order, so every variant gives the same bits (checked for the loss,
 * gelu_new and layer norm: the causal-LM loss over [4, 64, 50257] took 19.3 ms with AVX2
 * and 12.2 ms with AVX-512). */
#if defined(__GNUC__) && !defined(__clang__)
/* No clones under ASan or TSan: the clones' ifunc resolvers run while the binary loads,
 * before the sanitizer's runtime is ready (docs/building.md). */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define DDP__VEC_KERNEL \
  __attribute__((optimize("no-trapping-math"), target_clones("avx512f", "avx2", "default")))
#else
#define DDP__VEC_KERNEL __attribute__((optimize("no-trapping-math")))
#endif
#else
#define DDP__VEC_KERNEL
#endif

static inline __attribute__((always_inline)) float ddp__vexpf(float x) {
  /* Clamped so that n + 127 stays in [1, 254]: 2^n is a normal float. Below the range the
   * result is 0 (where exp reaches the smallest normal float). */
  float x0 = x;
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  /* Round to nearest by the 1.5 * 2^23 trick (no libm call, no SSE4.1 needed). */
  float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits = ((int32_t)fn + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  p = p * scale;
  return x0 < -87.3f ? 0.0f : p;
}

/* sum_j exp(row[j] - mx) over one row of n floats, in double with four accumulators (a fixed
 * order: the same bits from every caller); e[j] gets exp(row[j] - mx) by ddp__vexpf (e is n
 * floats of scratch, row and e may not overlap). In ops_vexp.c. */
double ddp__sum_expf(const float *row, int64_t n, float mx, float *e);

#endif /* DDP_NN_OPS_VEXP_H */
