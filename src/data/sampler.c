/* torch.randperm on a seeded CPU generator, and torch.utils.data.DistributedSampler.
 *
 * torch's CPU generator is MT19937 (Matsumoto and Nishimura, 1998) seeded through the
 * reference init_genrand with the low 32 bits of the seed; random() is one tempered 32-bit
 * output and random64() two outputs, the first as the high half. randperm_cpu shuffles
 * 0..n-1 in place: for n < 2^32/20, for i = 0..n-2 it swaps slot i with slot i + z where
 * z = random() mod (n - i); for larger n (where the modulo would be visibly biased) it
 * builds the permutation "inside out", for i = 0..n-1 taking z = random64() mod (i + 1),
 * moving slot z to slot i and writing i at slot z.
 *
 * DistributedSampler (1.13): N samples, W replicas. num_samples is ceil(N / W), or with
 * drop_last and N not divisible by W, ceil((N - W) / W) (= floor(N / W)); total_size is
 * num_samples * W. The epoch's order is randperm(N) under seed + epoch (or 0..N-1); without
 * drop_last it is padded to total_size by repeating itself from the start as often as
 * needed, with drop_last it is cut to total_size; rank r takes positions r, r + W, ... */
#include <string.h>

#include "common/common.h"
#include "ddp/data.h"

/* ---------------------------------------------------------------- MT19937 --------- */

#define MT_N 624
#define MT_M 397

typedef struct mt19937 {
  uint32_t s[MT_N];
  int i;
} mt19937_t;

static void mt_seed(mt19937_t *mt, uint32_t seed) {
  mt->s[0] = seed;
  for (int k = 1; k < MT_N; k++)
    mt->s[k] = 1812433253u * (mt->s[k - 1] ^ (mt->s[k - 1] >> 30)) + (uint32_t)k;
  mt->i = MT_N;
}

/* Regenerates all 624 words (the "twist"), then tempers one per call. */
static uint32_t mt_next(mt19937_t *mt) {
  if (mt->i >= MT_N) {
    for (int k = 0; k < MT_N; k++) {
      uint32_t y = (mt->s[k] & 0x80000000u) | (mt->s[(k + 1) % MT_N] & 0x7fffffffu);
      mt->s[k] = mt->s[(k + MT_M) % MT_N] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
    }
    mt->i = 0;
  }
  uint32_t y = mt->s[mt->i++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

void ddp_randperm(int64_t n, uint64_t seed, int64_t *out) {
  DDP_REQUIRE(n >= 0 && (out || n == 0));
  mt19937_t mt;
  mt_seed(&mt, (uint32_t)(seed & 0xffffffffu));
  if (n < (int64_t)(UINT32_MAX / 20)) {
    for (int64_t i = 0; i < n; i++) out[i] = i;
    for (int64_t i = 0; i + 1 < n; i++) {
      int64_t z = (int64_t)(mt_next(&mt) % (uint64_t)(n - i));
      int64_t t = out[i];
      out[i] = out[i + z];
      out[i + z] = t;
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    uint64_t hi = mt_next(&mt), lo = mt_next(&mt);
    int64_t z = (int64_t)(((hi << 32) | lo) % (uint64_t)(i + 1));
    out[i] = out[z];
    out[z] = i;
  }
}

/* ---------------------------------------------------------------- sampler --------- */

#define SAMPLER_MAGIC 0x53414d50u /* "SAMP" */

struct ddp_sampler {
  uint32_t magic;
  ddp_sampler_options_t opts;
  int64_t epoch;
  int64_t num_samples, total_size;
  int64_t *order; /* [N] the epoch's permutation (scratch) */
  int64_t *mine;  /* [num_samples] this rank's indices */
};

ddp_status_t ddp_sampler_create(const ddp_sampler_options_t *in, ddp_sampler_t **out,
                                ddp_error_t *err) {
  DDP_REQUIRE(in && out);
  *out = NULL;
  ddp_sampler_options_t o = DDP_SAMPLER_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, in);
  const ddp_sampler_options_t *opts = &o;
  int w = opts->num_replicas;
  if (w < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "sampler: num_replicas must be at least 1, got %d", w);
  if (opts->rank >= w || opts->rank < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "Invalid rank %d, rank should be in the interval [0, %d]", opts->rank, w - 1);
  int64_t n = opts->dataset_len;
  if (n < 0 || n > ((int64_t)1 << 40))
    return ddp__error(err, opts->rank, DDP_ERR_INVALID_ARGUMENT,
                      "sampler: dataset length %lld out of range", (long long)n);
  ddp_sampler_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return DDP_ERR_NO_MEMORY;
  s->magic = SAMPLER_MAGIC;
  s->opts = *opts;
  if (opts->drop_last && n % w != 0)
    s->num_samples = n / w; /* ceil((N - W) / W) for N % W != 0 */
  else
    s->num_samples = (n + w - 1) / w;
  s->total_size = s->num_samples * w;
  s->order = ddp__malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
  s->mine = ddp__malloc((size_t)(s->num_samples > 0 ? s->num_samples : 1) * sizeof(int64_t));
  if (!s->order || !s->mine) {
    ddp_sampler_destroy(s);
    return DDP_ERR_NO_MEMORY;
  }
  *out = s;
  return DDP_OK;
}

void ddp_sampler_destroy(ddp_sampler_t *s) {
  if (!s) return;
  DDP_REQUIRE(s->magic == SAMPLER_MAGIC);
  ddp__free(s->order);
  ddp__free(s->mine);
  s->magic = 0;
  ddp__free(s);
}

#define CHECK_S(s) DDP_REQUIRE((s) && (s)->magic == SAMPLER_MAGIC)

void ddp_sampler_set_epoch(ddp_sampler_t *s, int64_t epoch) {
  CHECK_S(s);
  s->epoch = epoch;
}

int64_t ddp_sampler_epoch(const ddp_sampler_t *s) {
  CHECK_S(s);
  return s->epoch;
}

int64_t ddp_sampler_len(const ddp_sampler_t *s) {
  CHECK_S(s);
  return s->num_samples;
}

int64_t ddp_sampler_total_size(const ddp_sampler_t *s) {
  CHECK_S(s);
  return s->total_size;
}

int64_t ddp_sampler_dataset_len(const ddp_sampler_t *s) {
  CHECK_S(s);
  return s->opts.dataset_len;
}

ddp_status_t ddp_sampler_indices(ddp_sampler_t *s, const int64_t **indices, int64_t *n) {
  CHECK_S(s);
  DDP_REQUIRE(indices && n);
  int64_t len = s->opts.dataset_len, w = s->opts.num_replicas, r = s->opts.rank;
  if (s->opts.shuffle)
    ddp_randperm(len, s->opts.seed + (uint64_t)s->epoch, s->order);
  else
    for (int64_t i = 0; i < len; i++) s->order[i] = i;
  /* Position p of the padded (or cut) list is order[p mod N]: padding repeats the list
   * from its start, and cutting keeps a prefix. */
  for (int64_t k = 0; k < s->num_samples; k++) {
    int64_t p = r + k * w;
    s->mine[k] = s->order[p % len];
  }
  *indices = s->mine;
  *n = s->num_samples;
  return DDP_OK;
}
