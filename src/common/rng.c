/* Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11), the generator curand and PyTorch's CUDA side use.
 *
 * The state is a 128-bit counter and a 64-bit key. Each of ten rounds multiplies the two
 * even counter words by fixed constants, keeps the high and low halves of the 64-bit
 * products, and mixes them with the odd words and the key; the key is bumped by the Weyl
 * constants between rounds. The counter here is (block index low, block index high, stream
 * low, stream high) and the key is the seed, so block i of stream s under seed k is a pure
 * function of (k, s, i): no shared state, no dependence on who draws first. */
#include <math.h>

#include "common/common.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void ddp_philox4x32_10(uint64_t seed, uint64_t stream, uint64_t ctr, uint32_t out[4]) {
  uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32);
  uint32_t c2 = (uint32_t)stream, c3 = (uint32_t)(stream >> 32);
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; round++) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
    uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = (uint32_t)p1;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = (uint32_t)p0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += PHILOX_W0;
    k1 += PHILOX_W1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

uint64_t ddp_rng_stream(ddp_rng_purpose_t purpose, uint32_t rank, uint64_t step) {
  return ((uint64_t)(purpose & 0xffu) << 56) | ((uint64_t)(rank & 0xffffffu) << 32) |
         (step & 0xffffffffu);
}

void ddp_rng_init(ddp_rng_t *r, uint64_t seed, uint64_t stream) {
  DDP_REQUIRE(r);
  r->seed = seed;
  r->stream = stream;
  r->counter = 0;
  r->used = 4;
  r->has_spare = 0;
  r->spare = 0.0f;
}

void ddp_rng_seek(ddp_rng_t *r, uint64_t counter) {
  r->counter = counter;
  r->used = 4;
  r->has_spare = 0;
}

uint32_t ddp_rng_u32(ddp_rng_t *r) {
  if (r->used == 4) {
    ddp_philox4x32_10(r->seed, r->stream, r->counter++, r->buf);
    r->used = 0;
  }
  return r->buf[r->used++];
}

float ddp_rng_uniform(ddp_rng_t *r) { return (float)(ddp_rng_u32(r) >> 8) * 0x1p-24f; }

double ddp_rng_uniform_f64(ddp_rng_t *r) {
  uint64_t hi = ddp_rng_u32(r) >> 5, lo = ddp_rng_u32(r) >> 6;
  return (double)((hi << 26) | lo) * 0x1p-53;
}

float ddp_rng_normal(ddp_rng_t *r) {
  if (r->has_spare) {
    r->has_spare = 0;
    return r->spare;
  }
  /* u1 in (0, 1] so that log(u1) is finite. */
  double u1 = 1.0 - ddp_rng_uniform_f64(r);
  double u2 = ddp_rng_uniform_f64(r);
  double rad = sqrt(-2.0 * log(u1));
  double th = 2.0 * 3.14159265358979323846 * u2;
  r->spare = (float)(rad * sin(th));
  r->has_spare = 1;
  return (float)(rad * cos(th));
}
