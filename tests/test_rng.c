/* Tests of the Philox4x32-10 generator: published known-answer vectors, reproducibility,
 * independence from thread timing, seeking, and the distributions' statistics. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>

#include <cmocka.h>

#include "ddp/common.h"
#include "harness.h"

/* Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter words 0..3,
 * key words 0..1, then the four output words. Our mapping: counter = (ctr lo, ctr hi,
 * stream lo, stream hi), key = (seed lo, seed hi). */
static const uint32_t kat[3][10] = {
    {0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x6627e8d5, 0xe169c58d,
     0xbc57ac4c, 0x9b00dbd8},
    {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e,
     0xa20bc7c6, 0x6d5451fd},
    {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb,
     0x5001e420, 0x24126ea1},
};

static uint64_t pack(uint32_t lo, uint32_t hi) { return ((uint64_t)hi << 32) | lo; }

/* The block function reproduces the published vectors, directly and through a stream. */
static void test_known_answers(void **state) {
  (void)state;
  for (int i = 0; i < 3; i++) {
    const uint32_t *v = kat[i];
    uint64_t ctr = pack(v[0], v[1]), stream = pack(v[2], v[3]), seed = pack(v[4], v[5]);
    uint32_t out[4];
    ddp_philox4x32_10(seed, stream, ctr, out);
    for (int w = 0; w < 4; w++) assert_int_equal(out[w], v[6 + w]);
    ddp_rng_t r;
    ddp_rng_init(&r, seed, stream);
    ddp_rng_seek(&r, ctr);
    for (int w = 0; w < 4; w++) assert_int_equal(ddp_rng_u32(&r), v[6 + w]);
  }
}

/* A stream is the blocks 0, 1, 2, ... in order, word by word; the same (seed, stream)
 * gives the same draws; seek repositions (and drops a buffered partial block and spare
 * normal). */
static void test_stream_order_and_seek(void **state) {
  (void)state;
  const uint64_t seed = 0x0123456789abcdefull, stream = 77;
  ddp_rng_t a, b;
  ddp_rng_init(&a, seed, stream);
  ddp_rng_init(&b, seed, stream);
  for (uint64_t blk = 0; blk < 1000; blk++) {
    uint32_t out[4];
    ddp_philox4x32_10(seed, stream, blk, out);
    for (int w = 0; w < 4; w++) {
      uint32_t x = ddp_rng_u32(&a);
      assert_int_equal(x, out[w]);
      assert_int_equal(ddp_rng_u32(&b), x);
    }
  }
  /* Seek in the middle of a block. */
  ddp_rng_t r;
  ddp_rng_init(&r, seed, stream);
  ddp_rng_u32(&r);
  ddp_rng_u32(&r);
  ddp_rng_seek(&r, 5);
  uint32_t blk5[4];
  ddp_philox4x32_10(seed, stream, 5, blk5);
  for (int w = 0; w < 4; w++) assert_int_equal(ddp_rng_u32(&r), blk5[w]);
  /* Seek back to 0 replays the stream from the start, normals included. */
  ddp_rng_t c;
  ddp_rng_init(&c, seed, stream);
  float n0 = ddp_rng_normal(&c), n1 = ddp_rng_normal(&c), n2 = ddp_rng_normal(&c);
  ddp_rng_seek(&c, 0);
  DDP_ASSERT_EQ(ddp_rng_normal(&c), n0);
  DDP_ASSERT_EQ(ddp_rng_normal(&c), n1);
  DDP_ASSERT_EQ(ddp_rng_normal(&c), n2);
  /* One normal drawn (spare pending), then seek: the spare is dropped. */
  ddp_rng_seek(&c, 0);
  (void)ddp_rng_normal(&c);
  ddp_rng_seek(&c, 0);
  DDP_ASSERT_EQ(ddp_rng_normal(&c), n0);
  /* Seek near the top of the counter space wraps like the counter. */
  ddp_rng_seek(&r, UINT64_MAX);
  uint32_t top[4], wrap[4];
  ddp_philox4x32_10(seed, stream, UINT64_MAX, top);
  ddp_philox4x32_10(seed, stream, 0, wrap);
  for (int w = 0; w < 4; w++) assert_int_equal(ddp_rng_u32(&r), top[w]);
  assert_int_equal(ddp_rng_u32(&r), wrap[0]);
}

/* Distinct streams, seeds and counters give unrelated blocks: no equal block among the
 * first 256 of neighbouring streams and seeds, and the stream id packs its fields. */
static void test_streams_differ(void **state) {
  (void)state;
  uint32_t a[4], b[4], c[4];
  int equal_words = 0;
  for (uint64_t blk = 0; blk < 256; blk++) {
    ddp_philox4x32_10(1, 10, blk, a);
    ddp_philox4x32_10(1, 11, blk, b);
    ddp_philox4x32_10(2, 10, blk, c);
    assert_memory_not_equal(a, b, sizeof a);
    assert_memory_not_equal(a, c, sizeof a);
    for (int w = 0; w < 4; w++) equal_words += (a[w] == b[w]) + (a[w] == c[w]);
  }
  /* Chance of any equal 32-bit word is about 2048 / 2^32. */
  assert_int_equal(equal_words, 0);

  assert_int_equal(ddp_rng_stream(DDP_RNG_DROPOUT, 5, 9),
                   ((uint64_t)3 << 56) | ((uint64_t)5 << 32) | 9);
  assert_int_equal(ddp_rng_stream(DDP_RNG_TEST, 0xffffff, 0xffffffffu),
                   ((uint64_t)6 << 56) | ((uint64_t)0xffffff << 32) | 0xffffffffu);
  /* The stream ids of different purposes, ranks and steps are distinct. */
  uint64_t ids[6] = {ddp_rng_stream(DDP_RNG_INIT, 0, 0),    ddp_rng_stream(DDP_RNG_SHUFFLE, 0, 0),
                     ddp_rng_stream(DDP_RNG_INIT, 1, 0),    ddp_rng_stream(DDP_RNG_INIT, 0, 1),
                     ddp_rng_stream(DDP_RNG_DROPOUT, 7, 3), ddp_rng_stream(DDP_RNG_DROPOUT, 3, 7)};
  for (int i = 0; i < 6; i++)
    for (int j = i + 1; j < 6; j++) assert_true(ids[i] != ids[j]);
}

/* ---------------------------------------------------------------- threads --------- */

#define T_STREAMS 32
#define T_BLOCKS 256
#define T_THREADS 8

typedef struct thread_job {
  uint64_t seed;
  uint32_t (*out)[T_BLOCKS][4];        /* [stream][block][word], written by the ranks */
  uint32_t (*seq)[T_BLOCKS * 4];       /* [stream][draw], sequential draws per stream */
  uint32_t perm[T_STREAMS * T_BLOCKS]; /* a random order of (stream, block) pairs */
} thread_job_t;

/* Each rank computes every 8th pair of a random permutation of (stream, block), seeking
 * its own generator there, yielding now and then so ranks interleave differently each run;
 * then draws its own streams (stream % 8 == rank) sequentially, interleaving them. */
static int thread_draws(ddp_test_rank_t *r, void *arg) {
  thread_job_t *job = arg;
  int me = ddp_test_rank(r);
  ddp_rng_t g;
  ddp_rng_init(&g, job->seed, 0);
  for (int i = me; i < T_STREAMS * T_BLOCKS; i += T_THREADS) {
    uint32_t p = job->perm[i];
    uint32_t s = p / T_BLOCKS, blk = p % T_BLOCKS;
    ddp_rng_init(&g, job->seed, s);
    ddp_rng_seek(&g, blk);
    for (int w = 0; w < 4; w++) job->out[s][blk][w] = ddp_rng_u32(&g);
    if ((i / T_THREADS) % 61 == 0) sched_yield();
  }
  ddp_rng_t mine[T_STREAMS / T_THREADS];
  for (int k = 0; k < T_STREAMS / T_THREADS; k++)
    ddp_rng_init(&mine[k], job->seed, (uint64_t)(k * T_THREADS + me));
  uint32_t lcg = (uint32_t)me * 2654435761u + 1;
  int pos[T_STREAMS / T_THREADS] = {0};
  int left = T_STREAMS / T_THREADS * T_BLOCKS * 4;
  while (left > 0) {
    lcg = lcg * 1664525u + 1013904223u;
    int k = (int)((lcg >> 16) % (T_STREAMS / T_THREADS));
    int n = 1 + (int)((lcg >> 8) % 7);
    for (int j = 0; j < n && pos[k] < T_BLOCKS * 4; j++, left--)
      job->seq[k * T_THREADS + me][pos[k]++] = ddp_rng_u32(&mine[k]);
  }
  return DDP_OK;
}

/* Draws made by 8 threads in random interleavings equal the serial draws. */
static void test_threads_match_serial(void **state) {
  (void)state;
  thread_job_t *job = calloc(1, sizeof *job);
  job->out = calloc(T_STREAMS, sizeof *job->out);
  job->seq = calloc(T_STREAMS, sizeof *job->seq);
  job->seed = 0xfeedfacecafebeefull;
  for (uint32_t i = 0; i < T_STREAMS * T_BLOCKS; i++) job->perm[i] = i;
  srand(12345);
  for (uint32_t i = T_STREAMS * T_BLOCKS - 1; i > 0; i--) {
    uint32_t j = (uint32_t)rand() % (i + 1);
    uint32_t t = job->perm[i];
    job->perm[i] = job->perm[j];
    job->perm[j] = t;
  }
  for (int rep = 0; rep < 3; rep++) {
    memset(job->out, 0, T_STREAMS * sizeof *job->out);
    memset(job->seq, 0, T_STREAMS * sizeof *job->seq);
    ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
    o.world = T_THREADS;
    ddp_test_results_t *res = ddp_test_spawn(&o, thread_draws, job);
    ddp_test_expect_ok(res);
    ddp_test_results_free(res);
    for (uint32_t s = 0; s < T_STREAMS; s++) {
      ddp_rng_t g;
      ddp_rng_init(&g, job->seed, s);
      for (int i = 0; i < T_BLOCKS * 4; i++) {
        uint32_t want = ddp_rng_u32(&g);
        assert_int_equal(job->out[s][i / 4][i % 4], want);
        assert_int_equal(job->seq[s][i], want);
      }
    }
  }
  free(job->out);
  free(job->seq);
  free(job);
}

/* ---------------------------------------------------------------- distributions --- */

/* uniform() is in [0, 1) and a multiple of 2^-24 (the top 24 bits of one word);
 * uniform_f64 is in [0, 1) with 53 bits from two words; means and a 256-bucket chi-square
 * are within statistical bounds. */
static void test_uniform(void **state) {
  (void)state;
  ddp_rng_t r, raw;
  ddp_rng_init(&r, 42, 1);
  ddp_rng_init(&raw, 42, 1);
  const int n = 1000000;
  double sum = 0, mn = 1, mx = 0;
  long buckets[256] = {0};
  for (int i = 0; i < n; i++) {
    float u = ddp_rng_uniform(&r);
    uint32_t w = ddp_rng_u32(&raw);
    assert_true(u >= 0.0f && u < 1.0f);
    DDP_ASSERT_EQ((double)u, (double)(w >> 8) * 0x1p-24);
    sum += u;
    mn = fmin(mn, u);
    mx = fmax(mx, u);
    buckets[w >> 24]++;
  }
  /* Mean 1/2, sd of the mean sqrt(1/12/n) ~ 2.9e-4: allow 6 sd. */
  assert_true(fabs(sum / n - 0.5) < 6 * sqrt(1.0 / 12 / n));
  assert_true(mn < 1e-5 && mx > 1 - 1e-5);
  /* Chi-square with 255 degrees of freedom: mean 255, sd sqrt(510) ~ 22.6. */
  double chi = 0, e = n / 256.0;
  for (int b = 0; b < 256; b++) chi += (buckets[b] - e) * (buckets[b] - e) / e;
  assert_true(chi < 255 + 6 * sqrt(510.0));
  assert_true(chi > 255 - 6 * sqrt(510.0));

  ddp_rng_init(&r, 43, 2);
  ddp_rng_init(&raw, 43, 2);
  sum = 0;
  for (int i = 0; i < n; i++) {
    double u = ddp_rng_uniform_f64(&r);
    uint64_t hi = ddp_rng_u32(&raw) >> 5, lo = ddp_rng_u32(&raw) >> 6;
    assert_true(u >= 0.0 && u < 1.0);
    DDP_ASSERT_EQ(u, (double)((hi << 26) | lo) * 0x1p-53);
    sum += u;
  }
  assert_true(fabs(sum / n - 0.5) < 6 * sqrt(1.0 / 12 / n));
}

/* 1e5 normals: mean, variance, the mass within one sd, skewness and kurtosis all within
 * six standard errors of N(0, 1); two generators agree draw for draw. */
static void test_normal(void **state) {
  (void)state;
  ddp_rng_t r, r2;
  ddp_rng_init(&r, 7, ddp_rng_stream(DDP_RNG_TEST, 0, 0));
  ddp_rng_init(&r2, 7, ddp_rng_stream(DDP_RNG_TEST, 0, 0));
  const int n = 100000;
  double s1 = 0, s2 = 0, s3 = 0, s4 = 0;
  int within = 0;
  for (int i = 0; i < n; i++) {
    float x = ddp_rng_normal(&r);
    DDP_ASSERT_EQ(x, ddp_rng_normal(&r2));
    assert_true(isfinite(x));
    double d = x;
    s1 += d;
    s2 += d * d;
    s3 += d * d * d;
    s4 += d * d * d * d;
    within += fabs(d) < 1.0;
  }
  double mean = s1 / n, var = s2 / n - mean * mean;
  double se = 1 / sqrt((double)n);
  assert_true(fabs(mean) < 6 * se);
  assert_true(fabs(var - 1) < 6 * sqrt(2.0) * se);
  assert_true(fabs(s3 / n) < 6 * sqrt(15.0) * se);     /* Var(x^3) = E[x^6] = 15 */
  assert_true(fabs(s4 / n - 3) < 6 * sqrt(96.0) * se); /* Var(x^4) = 105 - 9 */
  double p = erf(1 / sqrt(2.0));                       /* 0.6827 */
  assert_true(fabs((double)within / n - p) < 6 * sqrt(p * (1 - p) / n));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_known_answers),  cmocka_unit_test(test_stream_order_and_seek),
      cmocka_unit_test(test_streams_differ), cmocka_unit_test(test_threads_match_serial),
      cmocka_unit_test(test_uniform),        cmocka_unit_test(test_normal),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
