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
#include <string.h>

#include "common/common.h"
#include "hooks_internal.h"

#define PSGD_MAGIC 0x50534744u /* "PSGD" */

typedef struct psgd_mem {
  float *error; /* error feedback, one per bucket element (padded length when batched) */
  size_t nerror;
  float *p, *q; /* warm-start memories */
  size_t np, nq;
  bool has_mem;
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

void ddp_powersgd_state_destroy(ddp_powersgd_state_t *s) {
  if (!s) return;
  DDP_REQUIRE(s->magic == PSGD_MAGIC);
  for (size_t i = 0; i < s->nmem; i++) {
    mem_clear(&s->mem[i]);
    ddp__free(s->mem[i].error);
  }
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
  DDP_CHECK(ddp_allreduce(pg, buf, buf, n, DDP_F32, DDP_SUM, &pw));
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
    for (size_t i = 0; i < b->numel; i++) c->in[i] = ddp__hk_load(b->buffer, b->dtype, i);
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
  ddp_comm_work_set_result(w, c->in, c->numel, DDP_F32);
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
  /* The padded s x s input (zeros past numel); error feedback runs on the padded length. */
  DDP_CHECK_GOTO(prepare_input(c, b, side * side), st, fail);
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
