/* PowerSGD gradient compression (Vogels et al., NeurIPS 2019) as PyTorch's powerSGD_hook
 * and batched_powerSGD_hook compute it (spec §7.5-7.7).
 *
 * Per bucket and synchronised step, after a warm-up of start_powerSGD_iter plain
 * allreduce steps: the local gradients plus the stored error form, per parameter, an n x m
 * matrix M (n = first dimension). Matrices worth compressing get a rank-r approximation
 * P Q^T: Q (m x r) is last step's Q (warm start) or random normals, orthogonalised;
 * P = M Q is summed over ranks and orthogonalised; Q = M^T P is summed and divided by W;
 * the estimate P Q^T replaces M. The other tensors are averaged exactly. Three allreduces
 * per bucket, always in the order (uncompressed, P, Q), empty ones included, so every rank
 * issues the same sequence. The error, local input minus the result, is added next step.
 *
 * The factors are computed in f32 (f16/bf16 buckets, under a compress wrapper, are widened
 * first); Q's random start comes from the counter-based generator keyed by (random_seed,
 * DDP_RNG_POWERSGD, draw number), the same on every rank (D4). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "hooks_internal.h"

#define PSGD_MAGIC 0x50534744u /* "PSGD" */

typedef struct psgd_mem {
  float *error; /* error feedback, one per bucket element (padded length when batched) */
  size_t nerror;
  float *p, *q; /* warm-start memories */
  size_t np, nq;
  bool has_mem;
  /* The bucket layout error, p and q are laid out for (powerSGD_hook only): per parameter
   * in bucket order, 4 values: ddp_param_t.index, element offset, element count, first
   * dimension. nlay == 0: not recorded. */
  size_t *lay;
  size_t nlay;
} psgd_mem_t;

struct ddp_powersgd_state {
  uint32_t magic;
  ddp_powersgd_options_t o;
  int rank;
  int64_t iter;
  psgd_mem_t *mem; /* by bucket index; grows (calls hold the index, not a pointer) */
  size_t nmem;
  int64_t total_before, total_after, next_stats_report;
  uint64_t draws; /* random Q initialisations so far: the stream index of the next */
  int64_t nallreduce;
  int64_t bytes_step;
};

ddp_status_t ddp_powersgd_state_create(const ddp_powersgd_options_t *opts, int rank,
                                       ddp_powersgd_state_t **out, ddp_error_t *err) {
  DDP_REQUIRE(out);
  *out = NULL;
  ddp_powersgd_options_t o = DDP_POWERSGD_OPTIONS_INIT;
  if (opts) {
    DDP_REQUIRE(opts->struct_size >= sizeof(size_t) && opts->struct_size <= sizeof o);
    memcpy(&o, opts, opts->struct_size);
    o.struct_size = sizeof o;
  }
  if ((o.use_error_feedback || o.warm_start) && o.start_powerSGD_iter <= 1)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                      "`warm_start` is enabled, because PowerSGD can only be applied after "
                      "the first two iterations in DDP.");
  if (o.matrix_approximation_rank < 1)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "PowerSGD: matrix_approximation_rank must be >= 1, got %" PRId64,
                      o.matrix_approximation_rank);
  if (!(o.orthogonalization_epsilon >= 0) || !isfinite(o.min_compression_rate))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "PowerSGD: orthogonalization_epsilon must be >= 0 and "
                      "min_compression_rate finite");
  ddp_powersgd_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "PowerSGD: out of memory");
  s->magic = PSGD_MAGIC;
  s->o = o;
  if (s->o.compression_stats_logging_frequency < 1) s->o.compression_stats_logging_frequency = 1;
  s->rank = rank;
  ddp__log(rank, DDP_LOG_INFO,
           "PowerSGD config: matrix_approximation_rank = %" PRId64
           "; start_powerSGD_iter = %" PRId64 "; min_compression_rate = %g; "
           "orthogonalization_epsilon = %g; use_error_feedback = %d; warm_start = %d; "
           "random_seed = %" PRIu64 "; compression_stats_logging_frequency = %" PRId64
           "; batch_tensors_with_same_shape = %d",
           o.matrix_approximation_rank, o.start_powerSGD_iter, o.min_compression_rate,
           o.orthogonalization_epsilon, o.use_error_feedback, o.warm_start, o.random_seed,
           s->o.compression_stats_logging_frequency, o.batch_tensors_with_same_shape);
  *out = s;
  return DDP_OK;
}

static void mem_clear(psgd_mem_t *m) {
  ddp__free(m->p);
  ddp__free(m->q);
  m->p = m->q = NULL;
  m->np = m->nq = 0;
  m->has_mem = false;
}

/* The bucket's layout changed: its error feedback and warm-start factors no longer fit. */
static void mem_restart(psgd_mem_t *m, int rank, size_t bucket) {
  ddp__log(rank, DDP_LOG_WARN,
           "PowerSGD: bucket %zu now holds other tensors than its error feedback and "
           "warm-start memories were built for; they restart from zero", bucket);
  mem_clear(m);
  ddp__free(m->error);
  m->error = NULL;
  m->nerror = 0;
}

/* Frees everything a bucket's memory holds. */
static void mem_free(psgd_mem_t *m) {
  mem_clear(m);
  ddp__free(m->error);
  ddp__free(m->lay);
  m->error = NULL;
  m->lay = NULL;
  m->nerror = m->nlay = 0;
}

void ddp_powersgd_state_destroy(ddp_powersgd_state_t *s) {
  if (!s) return;
  DDP_REQUIRE(s->magic == PSGD_MAGIC);
  for (size_t i = 0; i < s->nmem; i++) mem_free(&s->mem[i]);
  ddp__free(s->mem);
  s->magic = 0;
  ddp__free(s);
}

int64_t ddp_powersgd_iter(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->iter;
}

int64_t ddp_powersgd_num_allreduces(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->nallreduce;
}

uint64_t ddp_powersgd_draws(const ddp_powersgd_state_t *s) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  return s->draws;
}

void ddp_powersgd_set_init_q(ddp_powersgd_state_t *s,
                             void (*init_q)(void *user, uint64_t draw, size_t bucket_index,
                                            float *q, size_t n),
                             void *init_q_user) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC);
  s->o.init_q = init_q;
  s->o.init_q_user = init_q_user;
}

void ddp_powersgd_stats(void *state, ddp_comm_hook_stats_t *out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && out);
  out->numel_before = s->total_before;
  out->numel_after = s->total_after;
  out->bytes_last_step = s->bytes_step;
}

static psgd_mem_t *get_mem(ddp_powersgd_state_t *s, size_t idx) {
  if (idx >= s->nmem) {
    psgd_mem_t *m = ddp__calloc(idx + 1, sizeof *m);
    if (!m) return NULL;
    if (s->nmem) memcpy(m, s->mem, s->nmem * sizeof *m);
    ddp__free(s->mem);
    s->mem = m;
    s->nmem = idx + 1;
  }
  return &s->mem[idx];
}

/* maybe_increase_iter: iter counts synchronised backward passes. */
static void maybe_increase_iter(ddp_powersgd_state_t *s, bool is_last) {
  if (is_last) s->iter++;
  if (is_last && s->iter == s->o.start_powerSGD_iter)
    ddp__log(s->rank, DDP_LOG_INFO, "Start to apply PowerSGD after %" PRId64 " iterations.",
             s->iter);
}

static void maybe_log_stats(ddp_powersgd_state_t *s, bool is_last) {
  if (!is_last || s->iter < s->next_stats_report) return;
  double rate = s->total_after > 0 ? (double)s->total_before / (double)s->total_after : 0.0;
  ddp__log(s->rank, DDP_LOG_INFO,
           "Compression stats: iter %" PRId64 ", total before compression %" PRId64
           ", total after compression %" PRId64 ", rate %g",
           s->iter, s->total_before, s->total_after, rate);
  s->next_stats_report = s->iter + s->o.compression_stats_logging_frequency;
}

static ddp_status_t launch(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_comm_work_t *w,
                           float *buf, size_t n) {
  ddp_work_t *pw = NULL;
  s->nallreduce++;
  s->bytes_step += (int64_t)(n * sizeof(float));
  DDP_CHECK(ddp_allreduce(pg, buf, buf, n, DDP_F32, DDP_OP_SUM, &pw));
  return ddp_comm_work_add(w, pw);
}

/* Modified Gram-Schmidt on the columns of a row-major rows x cols matrix: normalise column
 * i (by its norm, plus eps when eps != 0), then remove its component from every later
 * column. Norms and dot products accumulate in double and round to f32. */
static void mgs(float *a, size_t rows, size_t cols, double eps) {
  for (size_t i = 0; i < cols; i++) {
    double ss = 0;
    for (size_t k = 0; k < rows; k++) ss += (double)a[k * cols + i] * a[k * cols + i];
    float norm = (float)sqrt(ss);
    float den = eps != 0 ? norm + (float)eps : norm;
    for (size_t k = 0; k < rows; k++) a[k * cols + i] /= den;
    for (size_t j = i + 1; j < cols; j++) {
      double dot = 0;
      for (size_t k = 0; k < rows; k++) dot += (double)a[k * cols + i] * a[k * cols + j];
      float fd = (float)dot;
      for (size_t k = 0; k < rows; k++) a[k * cols + j] -= fd * a[k * cols + i];
    }
  }
}

/* _orthogonalize: Gram-Schmidt for rank <= 2 or a low-precision bucket, else Householder
 * QR through LAPACK (the matrix becomes its Q factor). */
static ddp_status_t orthogonalize(float *a, size_t rows, size_t cols, double eps, bool low) {
  if (cols <= 2 || low || rows < cols) {
    mgs(a, rows, cols, eps);
    return DDP_OK;
  }
  return ddp_qr_q(DDP_F32, (int64_t)rows, (int64_t)cols, a, (int64_t)cols);
}

static void fill_normal(ddp_powersgd_state_t *s, size_t bucket, float *q, size_t n) {
  uint64_t draw = s->draws++;
  if (s->o.init_q) {
    s->o.init_q(s->o.init_q_user, draw, bucket, q, n);
    return;
  }
  ddp_rng_t r;
  ddp_rng_init(&r, s->o.random_seed, ddp_rng_stream(DDP_RNG_POWERSGD, 0, draw));
  for (size_t i = 0; i < n; i++) q[i] = ddp_rng_normal(&r);
}

/* ---------------------------------------------------------------- powerSGD_hook --- */

typedef struct mat {
  size_t off;      /* element offset of the tensor in the bucket */
  size_t n, m, r;  /* M is n x m; rank r */
  size_t poff, qoff;
} mat_t;

typedef struct psgd_call {
  ddp_powersgd_state_t *s;
  ddp_pg_t *pg;
  psgd_mem_t *mem;
  size_t index;
  bool is_last, low;
  size_t numel;
  float *in;      /* input: the bucket (f32) or an f32 copy of it */
  bool own_in;
  float *cp;      /* input_cp for error feedback */
  float *unc;     /* the uncompressed tensors, concatenated */
  size_t nunc;
  size_t *unc_off, *unc_len, nuncs;
  mat_t *mats;
  size_t nmats;
} psgd_call_t;

static void call_free(void *user) {
  psgd_call_t *c = user;
  if (c->own_in) ddp__free(c->in);
  ddp__free(c->cp);
  ddp__free(c->unc);
  ddp__free(c->unc_off);
  ddp__free(c->unc_len);
  ddp__free(c->mats);
  ddp__free(c);
}

/* Steps 11-14: average Q, decompress M = P Q^T into the input, store the error. */
static ddp_status_t psgd_finish(void *user, ddp_comm_work_t *w) {
  psgd_call_t *c = user;
  ddp_powersgd_state_t *s = c->s;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  float world = (float)ddp_pg_size(c->pg);
  for (size_t i = 0; i < mem->nq; i++) mem->q[i] /= world;
  for (size_t j = 0; j < c->nmats; j++) {
    mat_t *x = &c->mats[j];
    DDP_CHECK(ddp_gemm(DDP_F32, false, true, (int64_t)x->n, (int64_t)x->m, (int64_t)x->r, 1.0,
                       mem->p + x->poff, (int64_t)x->r, mem->q + x->qoff, (int64_t)x->r, 0.0,
                       c->in + x->off, (int64_t)x->m));
  }
  if (s->o.use_error_feedback)
    for (size_t i = 0; i < c->numel; i++) mem->error[i] = c->cp[i] - c->in[i];
  if (!s->o.warm_start) mem_clear(mem);
  maybe_increase_iter(s, c->is_last);
  ddp_comm_work_set_result(w, c->in, c->numel, DDP_F32);
  return DDP_OK;
}

/* Steps 8-11: average the uncompressed tensors into place, orthogonalise the summed Ps,
 * Q = M^T P with the local M, and launch the Q allreduce. */
static ddp_status_t psgd_after_p(void *user, ddp_comm_work_t *w) {
  psgd_call_t *c = user;
  ddp_powersgd_state_t *s = c->s;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  float world = (float)ddp_pg_size(c->pg);
  size_t pos = 0;
  for (size_t k = 0; k < c->nuncs; k++)
    for (size_t i = 0; i < c->unc_len[k]; i++) c->in[c->unc_off[k] + i] = c->unc[pos++] / world;
  for (size_t j = 0; j < c->nmats; j++) {
    mat_t *x = &c->mats[j];
    DDP_CHECK(orthogonalize(mem->p + x->poff, x->n, x->r, s->o.orthogonalization_epsilon, c->low));
    DDP_CHECK(ddp_gemm(DDP_F32, true, false, (int64_t)x->m, (int64_t)x->r, (int64_t)x->n, 1.0,
                       c->in + x->off, (int64_t)x->m, mem->p + x->poff, (int64_t)x->r, 0.0,
                       mem->q + x->qoff, (int64_t)x->r));
  }
  DDP_CHECK(launch(s, c->pg, w, mem->q, mem->nq));
  ddp_comm_work_then(w, psgd_finish, c);
  return DDP_OK;
}

/* The warm-up phase and its single allreduce (÷W, then SUM). */
static ddp_status_t warmup(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                           ddp_comm_work_t **out) {
  maybe_increase_iter(s, b->is_last);
  ddp__hk_divide(b->buffer, b->numel, b->dtype, ddp_pg_size(pg));
  s->nallreduce++;
  s->bytes_step += (int64_t)(b->numel * ddp_dtype_size(b->dtype));
  s->total_before += (int64_t)b->numel;
  s->total_after += (int64_t)b->numel;
  return ddp__hk_allreduce_work(pg, b->buffer, b->numel, b->dtype, out);
}

/* The input (f32 view or copy of buffer()) with the stored error added, and input_cp. */
static ddp_status_t prepare_input(psgd_call_t *c, ddp_grad_bucket_t *b, size_t len) {
  ddp_powersgd_state_t *s = c->s;
  if (b->dtype == DDP_F32 && len == b->numel) {
    c->in = b->buffer;
  } else {
    c->in = ddp__calloc(len + 1, sizeof(float));
    if (!c->in) return DDP_ERR_NO_MEMORY;
    c->own_in = true;
    ddp__hk_convert(c->in, DDP_F32, b->buffer, b->dtype, b->numel);
  }
  if (!s->o.use_error_feedback) return DDP_OK;
  psgd_mem_t *mem = c->mem;
  if (mem->error && mem->nerror == len) {
    for (size_t i = 0; i < len; i++) c->in[i] += mem->error[i];
  } else {
    ddp__free(mem->error);
    mem->error = ddp__calloc(len + 1, sizeof(float));
    if (!mem->error) return DDP_ERR_NO_MEMORY;
    mem->nerror = len;
    ddp__log(s->rank, DDP_LOG_INFO,
             "A zero tensor of length %zu that represents local error is created.", len);
  }
  c->cp = ddp__malloc((len + 1) * sizeof(float));
  if (!c->cp) return DDP_ERR_NO_MEMORY;
  memcpy(c->cp, c->in, len * sizeof(float));
  return DDP_OK;
}

/* (Re)allocates the P and Q memories; returns whether Q needs a random start. */
static ddp_status_t prepare_memory(psgd_call_t *c, size_t np, size_t nq, bool *need_rand) {
  psgd_mem_t *mem = c->mem;
  *need_rand = !c->s->o.warm_start || !mem->has_mem || mem->np != np || mem->nq != nq;
  if (!*need_rand) return DDP_OK;
  mem_clear(mem);
  mem->p = ddp__calloc(np + 1, sizeof(float));
  mem->q = ddp__calloc(nq + 1, sizeof(float));
  if (!mem->p || !mem->q) {
    mem_clear(mem);
    return DDP_ERR_NO_MEMORY;
  }
  mem->np = np;
  mem->nq = nq;
  mem->has_mem = true;
  return DDP_OK;
}

static ddp_status_t start_call(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               psgd_call_t **out) {
  if (b->dtype != DDP_F32 && b->dtype != DDP_F16 && b->dtype != DDP_BF16)
    return DDP_ERR_UNSUPPORTED;
  psgd_call_t *c = ddp__calloc(1, sizeof *c);
  if (!c) return DDP_ERR_NO_MEMORY;
  c->s = s;
  c->pg = pg;
  c->index = b->index;
  c->is_last = b->is_last;
  c->low = b->dtype != DDP_F32;
  c->mem = get_mem(s, b->index);
  if (!c->mem) {
    ddp__free(c);
    return DDP_ERR_NO_MEMORY;
  }
  *out = c;
  return DDP_OK;
}

/* P and Q offsets of a bucket layout (lay: 4 values per parameter, see psgd_mem_t):
 * compressed tensors grouped by (n, m) in order of first appearance, as step 5 lays them
 * out. poff[k] = qoff[k] = SIZE_MAX for a tensor left uncompressed. */
static void factor_offsets(const ddp_powersgd_state_t *s, const size_t *lay, size_t count,
                           size_t *poff, size_t *qoff, bool *taken) {
  size_t np = 0, nq = 0;
  for (size_t k = 0; k < count; k++) {
    size_t n = lay[4 * k + 3], numel = lay[4 * k + 2], m = n ? numel / n : 0;
    size_t r = DDP_MIN(DDP_MIN(n, m), (size_t)s->o.matrix_approximation_rank);
    taken[k] = !((double)(n + m) * (double)r * s->o.min_compression_rate < (double)n * (double)m);
    poff[k] = qoff[k] = SIZE_MAX;
  }
  for (size_t i = 0; i < count; i++) {
    if (taken[i]) continue;
    for (size_t j = i; j < count; j++) {
      if (taken[j] || lay[4 * j + 3] != lay[4 * i + 3] || lay[4 * j + 2] != lay[4 * i + 2])
        continue;
      taken[j] = true;
      size_t n = lay[4 * j + 3], m = lay[4 * j + 2] / n;
      size_t r = DDP_MIN(DDP_MIN(n, m), (size_t)s->o.matrix_approximation_rank);
      poff[j] = np;
      qoff[j] = nq;
      np += n * r;
      nq += m * r;
    }
  }
}

/* Keeps a bucket's memories valid when the reducer hands the bucket over in another
 * layout than the one they were written for, which happens after a resume: the reducer
 * restarts with its construction-time layout for one step and then rebuilds, while the
 * saved memories follow the rebuilt one. PowerSGD's arithmetic is per tensor (the
 * allreduces are elementwise), so when the bucket holds the same tensors in another order
 * the error feedback and the P/Q blocks are moved to their new places and the result is
 * bitwise the same as in the old layout. Any other change (different tensors) drops the
 * bucket's memories, which then restart as on a first use. */
static size_t *bucket_layout(const ddp_grad_bucket_t *b) {
  size_t *lay = ddp__malloc((4 * b->nparams + 1) * sizeof *lay);
  if (!lay) return NULL;
  for (size_t k = 0; k < b->nparams; k++) {
    const ddp_param_t *p = b->params[k];
    lay[4 * k] = p->index;
    lay[4 * k + 1] = b->offsets[k];
    lay[4 * k + 2] = (size_t)p->value.numel;
    lay[4 * k + 3] = p->value.ndim > 0 ? (size_t)p->value.shape[0] : 1;
  }
  return lay;
}

static ddp_status_t follow_layout(ddp_powersgd_state_t *s, psgd_mem_t *mem,
                                  const ddp_grad_bucket_t *b) {
  size_t cnt = b->nparams;
  size_t *lay = bucket_layout(b);
  if (!lay) return DDP_ERR_NO_MEMORY;
  bool same = mem->nlay == cnt && !memcmp(mem->lay, lay, 4 * cnt * sizeof *lay);
  if (same || (!mem->error && !mem->has_mem)) goto record;
  /* old position of each new tensor (SIZE_MAX: not in the old layout) */
  size_t *from = ddp__malloc((cnt + 1) * sizeof *from);
  size_t *buf = ddp__malloc((4 * (cnt + mem->nlay) + 2) * sizeof *buf);
  bool *taken = ddp__malloc((cnt + mem->nlay + 1) * sizeof *taken);
  if (!from || !buf || !taken) {
    ddp__free(from);
    ddp__free(buf);
    ddp__free(taken);
    ddp__free(lay);
    return DDP_ERR_NO_MEMORY;
  }
  bool permutation = mem->nlay == cnt;
  for (size_t k = 0; permutation && k < cnt; k++) {
    from[k] = SIZE_MAX;
    for (size_t j = 0; j < mem->nlay; j++)
      if (mem->lay[4 * j] == lay[4 * k] && mem->lay[4 * j + 2] == lay[4 * k + 2] &&
          mem->lay[4 * j + 3] == lay[4 * k + 3])
        from[k] = j;
    permutation = from[k] != SIZE_MAX;
  }
  permutation = permutation && (!mem->error || mem->nerror == b->numel);
  float *ne = NULL, *npp = NULL, *nqq = NULL;
  if (permutation) {
    size_t *op = buf, *oq = buf + cnt, *pp = buf + 2 * cnt, *pq = buf + 3 * cnt;
    factor_offsets(s, mem->lay, cnt, op, oq, taken);
    factor_offsets(s, lay, cnt, pp, pq, taken);
    if (mem->error) ne = ddp__calloc(mem->nerror + 1, sizeof(float));
    if (mem->has_mem) {
      npp = ddp__calloc(mem->np + 1, sizeof(float));
      nqq = ddp__calloc(mem->nq + 1, sizeof(float));
    }
    if ((mem->error && !ne) || (mem->has_mem && (!npp || !nqq))) {
      ddp__free(ne);
      ddp__free(npp);
      ddp__free(nqq);
      ddp__free(from);
      ddp__free(buf);
      ddp__free(taken);
      ddp__free(lay);
      return DDP_ERR_NO_MEMORY;
    }
    for (size_t k = 0; k < cnt; k++) {
      size_t j = from[k], numel = lay[4 * k + 2], n = lay[4 * k + 3];
      if (ne) memcpy(ne + lay[4 * k + 1], mem->error + mem->lay[4 * j + 1], numel * sizeof(float));
      if (npp && pp[k] != SIZE_MAX) {
        size_t r = DDP_MIN(DDP_MIN(n, numel / n), (size_t)s->o.matrix_approximation_rank);
        memcpy(npp + pp[k], mem->p + op[j], n * r * sizeof(float));
        memcpy(nqq + pq[k], mem->q + oq[j], numel / n * r * sizeof(float));
      }
    }
    if (ne) {
      ddp__free(mem->error);
      mem->error = ne;
    }
    if (npp) {
      ddp__free(mem->p);
      ddp__free(mem->q);
      mem->p = npp;
      mem->q = nqq;
    }
  } else {
    mem_restart(mem, s->rank, b->index);
  }
  ddp__free(from);
  ddp__free(buf);
  ddp__free(taken);
record:
  ddp__free(mem->lay);
  mem->lay = lay;
  mem->nlay = cnt;
  return DDP_OK;
}

ddp_status_t ddp_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               ddp_comm_work_t **out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && pg && b && out);
  *out = NULL;
  if (b->index == 0) s->bytes_step = 0;
  if (s->iter < s->o.start_powerSGD_iter) return warmup(s, pg, b, out);
  psgd_call_t *c = NULL;
  DDP_CHECK(start_call(s, pg, b, &c));
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    call_free(c);
    return st;
  }
  ddp_comm_work_on_free(w, call_free, c);
  c->numel = b->numel;
  DDP_CHECK_GOTO(follow_layout(s, c->mem, b), st, fail);
  DDP_CHECK_GOTO(prepare_input(c, b, b->numel), st, fail);

  /* Split into matrices; decide compression per tensor (step 3). */
  c->mats = ddp__calloc(b->nparams + 1, sizeof *c->mats);
  c->unc_off = ddp__calloc(b->nparams + 1, sizeof(size_t));
  c->unc_len = ddp__calloc(b->nparams + 1, sizeof(size_t));
  if (!c->mats || !c->unc_off || !c->unc_len) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  mat_t *all = ddp__calloc(b->nparams + 1, sizeof *all);
  if (!all) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  size_t nall = 0;
  for (size_t k = 0; k < b->nparams; k++) {
    const ddp_param_t *p = b->params[k];
    size_t numel = (size_t)p->value.numel;
    size_t n = p->value.ndim > 0 ? (size_t)p->value.shape[0] : 1;
    size_t m = n ? numel / n : 0;
    size_t r = DDP_MIN(DDP_MIN(n, m), (size_t)s->o.matrix_approximation_rank);
    bool compress = (double)(n + m) * (double)r * s->o.min_compression_rate < (double)n * (double)m;
    s->total_before += (int64_t)(n * m);
    if (compress) {
      s->total_after += (int64_t)((n + m) * r);
      all[nall++] = (mat_t){.off = b->offsets[k], .n = n, .m = m, .r = r};
    } else {
      s->total_after += (int64_t)(n * m);
      c->unc_off[c->nuncs] = b->offsets[k];
      c->unc_len[c->nuncs++] = numel;
      c->nunc += numel;
    }
  }
  maybe_log_stats(s, b->is_last);

  /* Step 4: the uncompressed tensors, flattened, in bucket order. */
  c->unc = ddp__malloc((c->nunc + 1) * sizeof(float));
  if (!c->unc) {
    ddp__free(all);
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  for (size_t k = 0, pos = 0; k < c->nuncs; k++) {
    memcpy(c->unc + pos, c->in + c->unc_off[k], c->unc_len[k] * sizeof(float));
    pos += c->unc_len[k];
  }

  /* Step 5: group by shape in order of first appearance; this order lays out P and Q. */
  size_t np = 0, nq = 0;
  bool *taken = ddp__calloc(nall + 1, sizeof(bool));
  if (!taken) {
    ddp__free(all);
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  for (size_t i = 0; i < nall; i++) {
    if (taken[i]) continue;
    for (size_t j = i; j < nall; j++) {
      if (taken[j] || all[j].n != all[i].n || all[j].m != all[i].m) continue;
      taken[j] = true;
      mat_t x = all[j];
      x.poff = np;
      x.qoff = nq;
      np += x.n * x.r;
      nq += x.m * x.r;
      c->mats[c->nmats++] = x;
    }
  }
  ddp__free(taken);
  ddp__free(all);
  bool need_rand;
  DDP_CHECK_GOTO(prepare_memory(c, np, nq, &need_rand), st, fail);

  /* Step 6: Q's start, then step 7: P = M Q with the local M. */
  psgd_mem_t *mem = c->mem;
  if (need_rand) fill_normal(s, b->index, mem->q, nq);
  for (size_t j = 0; j < c->nmats; j++) {
    mat_t *x = &c->mats[j];
    DDP_CHECK_GOTO(orthogonalize(mem->q + x->qoff, x->m, x->r, s->o.orthogonalization_epsilon,
                                 c->low), st, fail);
    DDP_CHECK_GOTO(ddp_gemm(DDP_F32, false, false, (int64_t)x->n, (int64_t)x->r, (int64_t)x->m,
                            1.0, c->in + x->off, (int64_t)x->m, mem->q + x->qoff, (int64_t)x->r,
                            0.0, mem->p + x->poff, (int64_t)x->r), st, fail);
  }
  /* Collectives A (uncompressed) and B (P), launched now so they overlap the backward. */
  DDP_CHECK_GOTO(launch(s, pg, w, c->unc, c->nunc), st, fail);
  DDP_CHECK_GOTO(launch(s, pg, w, mem->p, mem->np), st, fail);
  ddp_comm_work_then(w, psgd_after_p, c);
  *out = w;
  return DDP_OK;
fail:
  ddp_comm_work_free(w);
  return st;
}

/* ---------------------------------------------------------------- batched --------- */

typedef struct bpsgd_call {
  psgd_call_t c;
  size_t side, rank;
  /* When the bucket arrives in another order than its memories' layout: per parameter,
   * its offset now (map[3k]), in the memories' layout (map[3k+1]) and its length. */
  size_t *map;
  size_t nmap;
  float *in_old; /* the bucket in the memories' layout */
  float *out;    /* the result back in the current layout */
} bpsgd_call_t;

static ddp_status_t bpsgd_finish(void *user, ddp_comm_work_t *w) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  float world = (float)ddp_pg_size(c->pg);
  size_t s2 = k->side * k->side;
  for (size_t i = 0; i < mem->nq; i++) mem->q[i] /= world;
  DDP_CHECK(ddp_gemm(DDP_F32, false, true, (int64_t)k->side, (int64_t)k->side, (int64_t)k->rank,
                     1.0, mem->p, (int64_t)k->rank, mem->q, (int64_t)k->rank, 0.0, c->in,
                     (int64_t)k->side));
  if (c->s->o.use_error_feedback)
    for (size_t i = 0; i < s2; i++) mem->error[i] = c->cp[i] - c->in[i];
  if (!c->s->o.warm_start) mem_clear(mem);
  maybe_increase_iter(c->s, c->is_last);
  if (k->nmap) {
    k->out = ddp__malloc((c->numel + 1) * sizeof(float));
    if (!k->out) return DDP_ERR_NO_MEMORY;
    for (size_t j = 0; j < k->nmap; j++)
      memcpy(k->out + k->map[3 * j], c->in + k->map[3 * j + 1], k->map[3 * j + 2] * sizeof(float));
    ddp_comm_work_set_result(w, k->out, c->numel, DDP_F32);
    return DDP_OK;
  }
  ddp_comm_work_set_result(w, c->in, c->numel, DDP_F32);
  return DDP_OK;
}

/* batched_powerSGD_hook compresses the bucket as one matrix, so the order of its tensors
 * is part of the arithmetic. When the reducer hands a bucket over in another order than
 * the one its memories were built in (the step after a resume, before the reducer's
 * rebuild), the bucket is rearranged into the memories' order for the computation and the
 * result rearranged back, which gives bitwise what the old order gives. A bucket with
 * other tensors drops its memories (they restart as on first use). */
static ddp_status_t batched_layout(ddp_powersgd_state_t *s, psgd_mem_t *mem,
                                   const ddp_grad_bucket_t *b, bpsgd_call_t *k) {
  size_t cnt = b->nparams;
  size_t *lay = bucket_layout(b);
  if (!lay) return DDP_ERR_NO_MEMORY;
  bool fresh = mem->nlay == 0 || (!mem->error && !mem->has_mem);
  if (!fresh && mem->nlay == cnt && !memcmp(mem->lay, lay, 4 * cnt * sizeof *lay)) {
    ddp__free(lay);
    return DDP_OK;
  }
  bool perm = !fresh && mem->nlay == cnt;
  size_t *map = perm ? ddp__malloc((3 * cnt + 1) * sizeof *map) : NULL;
  if (perm && !map) {
    ddp__free(lay);
    return DDP_ERR_NO_MEMORY;
  }
  size_t total = 0;
  for (size_t j = 0; perm && j < cnt; j++) {
    perm = false;
    for (size_t i = 0; i < cnt && !perm; i++) {
      if (mem->lay[4 * i] != lay[4 * j] || mem->lay[4 * i + 2] != lay[4 * j + 2]) continue;
      map[3 * j] = lay[4 * j + 1];
      map[3 * j + 1] = mem->lay[4 * i + 1];
      map[3 * j + 2] = lay[4 * j + 2];
      perm = map[3 * j] + map[3 * j + 2] <= b->numel && map[3 * j + 1] + map[3 * j + 2] <= b->numel;
    }
    total += lay[4 * j + 2];
  }
  if (perm && total == b->numel) {
    ddp__free(lay);
    k->map = map;
    k->nmap = cnt;
    return DDP_OK;
  }
  ddp__free(map);
  if (!fresh) {
    mem_restart(mem, s->rank, b->index);
  }
  ddp__free(mem->lay);
  mem->lay = lay;
  mem->nlay = cnt;
  return DDP_OK;
}

static ddp_status_t bpsgd_after_p(void *user, ddp_comm_work_t *w) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  psgd_mem_t *mem = c->mem = &c->s->mem[c->index]; /* the array may have grown */
  DDP_CHECK(orthogonalize(mem->p, k->side, k->rank, c->s->o.orthogonalization_epsilon, c->low));
  DDP_CHECK(ddp_gemm(DDP_F32, true, false, (int64_t)k->side, (int64_t)k->rank, (int64_t)k->side,
                     1.0, c->in, (int64_t)k->side, mem->p, (int64_t)k->rank, 0.0, mem->q,
                     (int64_t)k->rank));
  DDP_CHECK(launch(c->s, c->pg, w, mem->q, mem->nq));
  ddp_comm_work_then(w, bpsgd_finish, k);
  return DDP_OK;
}

static void bcall_free(void *user) {
  bpsgd_call_t *k = user;
  psgd_call_t *c = &k->c;
  if (c->own_in) ddp__free(c->in);
  ddp__free(c->cp);
  ddp__free(k->map);
  ddp__free(k->in_old);
  ddp__free(k->out);
  ddp__free(k);
}

ddp_status_t ddp_batched_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                                       ddp_comm_work_t **out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && pg && b && out);
  *out = NULL;
  if (b->index == 0) s->bytes_step = 0;
  if (s->iter < s->o.start_powerSGD_iter) return warmup(s, pg, b, out);
  if (b->dtype != DDP_F32 && b->dtype != DDP_F16 && b->dtype != DDP_BF16)
    return DDP_ERR_UNSUPPORTED;
  size_t side = (size_t)ceil(sqrt((double)b->numel));
  while (side * side < b->numel) side++;
  size_t rank = (size_t)s->o.matrix_approximation_rank;
  if (rank > side && rank > 2) return DDP_ERR_INVALID_ARGUMENT;
  bpsgd_call_t *k = ddp__calloc(1, sizeof *k);
  if (!k) return DDP_ERR_NO_MEMORY;
  psgd_call_t *c = &k->c;
  c->s = s;
  c->pg = pg;
  c->index = b->index;
  c->is_last = b->is_last;
  c->low = b->dtype != DDP_F32;
  c->numel = b->numel;
  k->side = side;
  k->rank = rank;
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    ddp__free(k);
    return st;
  }
  ddp_comm_work_on_free(w, bcall_free, k);
  c->mem = get_mem(s, b->index);
  if (!c->mem) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  DDP_CHECK_GOTO(batched_layout(s, c->mem, b, k), st, fail);
  ddp_grad_bucket_t in = *b;
  if (k->nmap) {
    k->in_old = ddp__malloc((b->numel + 1) * sizeof(float));
    if (!k->in_old) {
      st = DDP_ERR_NO_MEMORY;
      goto fail;
    }
    for (size_t j = 0; j < k->nmap; j++)
      for (size_t i = 0; i < k->map[3 * j + 2]; i++)
        k->in_old[k->map[3 * j + 1] + i] = ddp__hk_load(b->buffer, b->dtype, k->map[3 * j] + i);
    in.buffer = k->in_old;
    in.dtype = DDP_F32;
  }
  /* The padded s x s input (zeros past numel); error feedback runs on the padded length. */
  DDP_CHECK_GOTO(prepare_input(c, &in, side * side), st, fail);
  s->total_before += (int64_t)b->numel;
  s->total_after += (int64_t)(2 * side * rank);
  maybe_log_stats(s, b->is_last);
  bool need_rand;
  DDP_CHECK_GOTO(prepare_memory(c, side * rank, side * rank, &need_rand), st, fail);
  psgd_mem_t *mem = c->mem;
  if (need_rand) fill_normal(s, b->index, mem->q, mem->nq);
  DDP_CHECK_GOTO(orthogonalize(mem->q, side, rank, s->o.orthogonalization_epsilon, c->low), st,
                 fail);
  DDP_CHECK_GOTO(ddp_gemm(DDP_F32, false, false, (int64_t)side, (int64_t)rank, (int64_t)side,
                          1.0, c->in, (int64_t)side, mem->q, (int64_t)rank, 0.0, mem->p,
                          (int64_t)rank), st, fail);
  DDP_CHECK_GOTO(launch(s, pg, w, mem->p, mem->np), st, fail);
  ddp_comm_work_then(w, bpsgd_after_p, k);
  *out = w;
  return DDP_OK;
fail:
  ddp_comm_work_free(w);
  return st;
}

/* ---------------------------------------------------------------- save / load ----- */

/* The state file: per bucket b, "bucket.<b>.error" (the error feedback, f32 [nerror]) when
 * it exists, and "bucket.<b>.p" / "bucket.<b>.q" (the warm-start memories, f32) when they
 * hold values; the counters and the options that shape the state in the metadata. Every
 * field that a later hook call reads is here, so a loaded state continues bit for bit. */
#define PSGD_FORMAT "libddp-powersgd-1"
_Static_assert(sizeof(size_t) == sizeof(int64_t), "layouts are stored as i64");
#define PSGD_NMETA 13

static void meta_i64(char *buf, size_t cap, int64_t v) { snprintf(buf, cap, "%" PRId64, v); }

ddp_status_t ddp_powersgd_state_save(const ddp_powersgd_state_t *s, const char *path,
                                     ddp_error_t *err) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && path);
  size_t cap = 4 * s->nmem + 1, n = 0;
  ddp_st_entry_t *e = ddp__calloc(cap, sizeof *e);
  ddp_tensor_t *t = ddp__calloc(cap, sizeof *t);
  char (*names)[48] = ddp__calloc(cap, sizeof *names);
  ddp_status_t st = DDP_OK;
  if (!e || !t || !names) {
    st = ddp__error(err, s->rank, DDP_ERR_NO_MEMORY, "PowerSGD state save: out of memory");
    goto out;
  }
  for (size_t b = 0; b < s->nmem && st == DDP_OK; b++) {
    const psgd_mem_t *m = &s->mem[b];
    struct {
      const char *what;
      float *data;
      size_t len;
      bool present;
    } parts[3] = {{"error", m->error, m->nerror, m->error != NULL},
                  {"p", m->p, m->np, m->has_mem},
                  {"q", m->q, m->nq, m->has_mem}};
    for (int k = 0; k < 3 && st == DDP_OK; k++) {
      if (!parts[k].present) continue;
      int64_t len = (int64_t)parts[k].len;
      snprintf(names[n], sizeof names[n], "bucket.%zu.%s", b, parts[k].what);
      st = ddp_tensor_view(&t[n], DDP_F32, 1, &len, parts[k].data);
      e[n].name = names[n];
      e[n].tensor = &t[n];
      n++;
    }
    if (st == DDP_OK && m->nlay) {
      /* Stored as i64: size_t and int64_t have one size on the (LP64) platforms libddp
       * builds for (checked below), and the values are small. */
      int64_t shape[2] = {(int64_t)m->nlay, 4};
      snprintf(names[n], sizeof names[n], "bucket.%zu.layout", b);
      st = ddp_tensor_view(&t[n], DDP_I64, 2, shape, m->lay);
      e[n].name = names[n];
      e[n].tensor = &t[n];
      n++;
    }
  }
  if (st != DDP_OK) {
    st = ddp__error(err, s->rank, st, "PowerSGD state save %s: bad tensor view", path);
    goto out;
  }
  {
    static const char *const keys[PSGD_NMETA] = {
        "format", "iter", "draws", "total_numel_before_compression",
        "total_numel_after_compression", "next_stats_report", "num_allreduces", "buckets",
        "matrix_approximation_rank", "start_powerSGD_iter", "use_error_feedback", "warm_start",
        "random_seed"};
    char v[PSGD_NMETA][32];
    snprintf(v[0], sizeof v[0], "%s", PSGD_FORMAT);
    meta_i64(v[1], sizeof v[1], s->iter);
    snprintf(v[2], sizeof v[2], "%" PRIu64, s->draws);
    meta_i64(v[3], sizeof v[3], s->total_before);
    meta_i64(v[4], sizeof v[4], s->total_after);
    meta_i64(v[5], sizeof v[5], s->next_stats_report);
    meta_i64(v[6], sizeof v[6], s->nallreduce);
    meta_i64(v[7], sizeof v[7], (int64_t)s->nmem);
    meta_i64(v[8], sizeof v[8], s->o.matrix_approximation_rank);
    meta_i64(v[9], sizeof v[9], s->o.start_powerSGD_iter);
    snprintf(v[10], sizeof v[10], "%s", s->o.use_error_feedback ? "true" : "false");
    snprintf(v[11], sizeof v[11], "%s", s->o.warm_start ? "true" : "false");
    snprintf(v[12], sizeof v[12], "%" PRIu64, s->o.random_seed);
    const char *vals[PSGD_NMETA];
    for (int i = 0; i < PSGD_NMETA; i++) vals[i] = v[i];
    st = ddp_st_write(path, e, n, keys, vals, PSGD_NMETA, err);
  }
out:
  ddp__free(e);
  ddp__free(t);
  ddp__free(names);
  return st;
}

/* A metadata integer; false when absent or malformed. */
static bool meta_get_i64(const ddp_st_file_t *f, const char *key, int64_t *out) {
  const char *v = ddp_st_meta_get(f, key);
  if (!v || !v[0]) return false;
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*end) return false;
  *out = (int64_t)x;
  return true;
}

/* Copies the f32 vector `name` (absent: *data NULL) into a fresh allocation. */
static ddp_status_t load_vec(const ddp_st_file_t *f, const char *name, float **data,
                             size_t *len, bool *present) {
  size_t i;
  *data = NULL;
  *len = 0;
  *present = false;
  if (ddp_st_find(f, name, &i) != DDP_OK) return DDP_OK;
  ddp_tensor_t v;
  DDP_CHECK(ddp_st_tensor(f, i, &v));
  if (v.dtype != DDP_F32 || v.ndim != 1) return DDP_ERR_INVALID_DATA;
  *data = ddp__malloc(((size_t)v.numel + 1) * sizeof(float));
  if (!*data) return DDP_ERR_NO_MEMORY;
  if (v.numel) memcpy(*data, v.data, (size_t)v.numel * sizeof(float));
  *len = (size_t)v.numel;
  *present = true;
  return DDP_OK;
}

ddp_status_t ddp_powersgd_state_load(ddp_powersgd_state_t *s, const char *path,
                                     ddp_error_t *err) {
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && path);
  ddp_st_file_t *f = NULL;
  DDP_CHECK(ddp_st_open(path, DDP_ST_READ, &f, err));
  ddp_status_t st = DDP_OK;
  psgd_mem_t *mem = NULL;
  size_t nmem = 0;
  const char *fmt = ddp_st_meta_get(f, "format");
  int64_t iter, draws, before, after, next, nall, nb, rank, start, seed;
  if (!fmt || strcmp(fmt, PSGD_FORMAT) != 0 || !meta_get_i64(f, "iter", &iter) ||
      !meta_get_i64(f, "draws", &draws) ||
      !meta_get_i64(f, "total_numel_before_compression", &before) ||
      !meta_get_i64(f, "total_numel_after_compression", &after) ||
      !meta_get_i64(f, "next_stats_report", &next) || !meta_get_i64(f, "num_allreduces", &nall) ||
      !meta_get_i64(f, "buckets", &nb) || nb < 0 || nb > (1 << 24) ||
      !meta_get_i64(f, "matrix_approximation_rank", &rank) ||
      !meta_get_i64(f, "start_powerSGD_iter", &start) || !meta_get_i64(f, "random_seed", &seed)) {
    st = ddp__error(err, s->rank, DDP_ERR_INVALID_DATA,
                    "PowerSGD state %s: not a %s file (missing or malformed metadata)", path,
                    PSGD_FORMAT);
    goto out;
  }
  const char *ef = ddp_st_meta_get(f, "use_error_feedback");
  const char *ws = ddp_st_meta_get(f, "warm_start");
  bool saved_ef = ef && !strcmp(ef, "true"), saved_ws = ws && !strcmp(ws, "true");
  /* Options that shape the stored tensors must match; the others only steer later calls. */
  if (rank != s->o.matrix_approximation_rank || start != s->o.start_powerSGD_iter ||
      (uint64_t)seed != s->o.random_seed || saved_ef != s->o.use_error_feedback ||
      saved_ws != s->o.warm_start) {
    st = ddp__error(err, s->rank, DDP_ERR_INVALID_ARGUMENT,
                    "PowerSGD state %s was saved with matrix_approximation_rank %" PRId64
                    ", start_powerSGD_iter %" PRId64 ", random_seed %" PRId64
                    ", use_error_feedback %d, warm_start %d; this state has %" PRId64 ", %" PRId64
                    ", %" PRIu64 ", %d, %d",
                    path, rank, start, seed, saved_ef, saved_ws, s->o.matrix_approximation_rank,
                    s->o.start_powerSGD_iter, s->o.random_seed, s->o.use_error_feedback,
                    s->o.warm_start);
    goto out;
  }
  nmem = (size_t)nb;
  mem = ddp__calloc(nmem + 1, sizeof *mem);
  if (!mem) {
    st = ddp__error(err, s->rank, DDP_ERR_NO_MEMORY, "PowerSGD state load: out of memory");
    goto out;
  }
  for (size_t b = 0; b < nmem && st == DDP_OK; b++) {
    char name[48];
    bool has_e = false, has_p = false, has_q = false;
    snprintf(name, sizeof name, "bucket.%zu.error", b);
    st = load_vec(f, name, &mem[b].error, &mem[b].nerror, &has_e);
    snprintf(name, sizeof name, "bucket.%zu.p", b);
    if (st == DDP_OK) st = load_vec(f, name, &mem[b].p, &mem[b].np, &has_p);
    snprintf(name, sizeof name, "bucket.%zu.q", b);
    if (st == DDP_OK) st = load_vec(f, name, &mem[b].q, &mem[b].nq, &has_q);
    if (st == DDP_OK && has_p != has_q) st = DDP_ERR_INVALID_DATA;
    snprintf(name, sizeof name, "bucket.%zu.layout", b);
    size_t li;
    if (st == DDP_OK && ddp_st_find(f, name, &li) == DDP_OK) {
      ddp_tensor_t v;
      st = ddp_st_tensor(f, li, &v);
      if (st == DDP_OK && (v.dtype != DDP_I64 || v.ndim != 2 || v.shape[1] != 4))
        st = DDP_ERR_INVALID_DATA;
      if (st == DDP_OK) {
        mem[b].lay = ddp__malloc(((size_t)v.numel + 1) * sizeof(size_t));
        if (!mem[b].lay) st = DDP_ERR_NO_MEMORY;
      }
      if (st == DDP_OK) {
        memcpy(mem[b].lay, v.data, (size_t)v.numel * sizeof(size_t));
        mem[b].nlay = (size_t)v.shape[0];
      }
    }
    mem[b].has_mem = has_p && has_q;
    if (st != DDP_OK) {
      st = ddp__error(err, s->rank, st,
                      "PowerSGD state %s: bucket %zu: tensors must be f32 vectors, with p and "
                      "q present together, and the layout i64 [n, 4]", path, b);
    }
  }
  if (st != DDP_OK) goto out;
  /* Replace the state only once the whole file has been read. */
  for (size_t i = 0; i < s->nmem; i++) mem_free(&s->mem[i]);
  ddp__free(s->mem);
  s->mem = mem;
  s->nmem = nmem;
  mem = NULL;
  s->iter = iter;
  s->draws = (uint64_t)draws;
  s->total_before = before;
  s->total_after = after;
  s->next_stats_report = next;
  s->nallreduce = nall;
  s->bytes_step = 0;
out:
  for (size_t i = 0; mem && i < nmem; i++) mem_free(&mem[i]);
  ddp__free(mem);
  ddp_st_close(f);
  return st;
}
