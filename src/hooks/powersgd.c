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
 * DDP_RNG_POWERSGD, draw number), the same on every rank (D4).
 *
 * This file: powerSGD_hook and the steps both hooks share. batched_powerSGD_hook is in
 * powersgd_batched.c; the state, its memories and their save/load in powersgd_state.c. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "powersgd_internal.h"

/* maybe_increase_iter: iter counts synchronised backward passes. */
void ddp__psgd_maybe_increase_iter(ddp_powersgd_state_t *s, bool is_last) {
  if (is_last) s->iter++;
  if (is_last && s->iter == s->o.start_powerSGD_iter)
    ddp__log(s->rank, DDP_LOG_INFO, "Start to apply PowerSGD after %" PRId64 " iterations.",
             s->iter);
}

void ddp__psgd_maybe_log_stats(ddp_powersgd_state_t *s, bool is_last) {
  if (!is_last || s->iter < s->next_stats_report) return;
  double rate = s->total_after > 0 ? (double)s->total_before / (double)s->total_after : 0.0;
  ddp__log(s->rank, DDP_LOG_INFO,
           "Compression stats: iter %" PRId64 ", total before compression %" PRId64
           ", total after compression %" PRId64 ", rate %g",
           s->iter, s->total_before, s->total_after, rate);
  s->next_stats_report = s->iter + s->o.compression_stats_logging_frequency;
}

ddp_status_t ddp__psgd_launch(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_comm_work_t *w, float *buf,
                              size_t n) {
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
ddp_status_t ddp__psgd_orthogonalize(float *a, size_t rows, size_t cols, double eps, bool low) {
  if (cols <= 2 || low || rows < cols) {
    mgs(a, rows, cols, eps);
    return DDP_OK;
  }
  return ddp_qr_q(DDP_F32, (int64_t)rows, (int64_t)cols, a, (int64_t)cols);
}

void ddp__psgd_fill_normal(ddp_powersgd_state_t *s, size_t bucket, float *q, size_t n) {
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
  if (!s->o.warm_start) ddp__psgd_mem_clear(mem);
  ddp__psgd_maybe_increase_iter(s, c->is_last);
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
    DDP_CHECK(ddp__psgd_orthogonalize(mem->p + x->poff, x->n, x->r, s->o.orthogonalization_epsilon,
                                      c->low));
    DDP_CHECK(ddp_gemm(DDP_F32, true, false, (int64_t)x->m, (int64_t)x->r, (int64_t)x->n, 1.0,
                       c->in + x->off, (int64_t)x->m, mem->p + x->poff, (int64_t)x->r, 0.0,
                       mem->q + x->qoff, (int64_t)x->r));
  }
  DDP_CHECK(ddp__psgd_launch(s, c->pg, w, mem->q, mem->nq));
  ddp_comm_work_then(w, psgd_finish, c);
  return DDP_OK;
}

/* The warm-up phase and its single allreduce (÷W, then SUM). */
ddp_status_t ddp__psgd_warmup(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                              ddp_comm_work_t **out) {
  ddp__psgd_maybe_increase_iter(s, b->is_last);
  ddp__hk_divide(b->buffer, b->numel, b->dtype, ddp_pg_size(pg));
  s->nallreduce++;
  s->bytes_step += (int64_t)(b->numel * ddp_dtype_size(b->dtype));
  s->total_before += (int64_t)b->numel;
  s->total_after += (int64_t)b->numel;
  return ddp__hk_allreduce_work(pg, b->buffer, b->numel, b->dtype, out);
}

/* The input (f32 view or copy of buffer()) with the stored error added, and input_cp. */
ddp_status_t ddp__psgd_prepare_input(psgd_call_t *c, ddp_grad_bucket_t *b, size_t len) {
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
ddp_status_t ddp__psgd_prepare_memory(psgd_call_t *c, size_t np, size_t nq, bool *need_rand) {
  psgd_mem_t *mem = c->mem;
  *need_rand = !c->s->o.warm_start || !mem->has_mem || mem->np != np || mem->nq != nq;
  if (!*need_rand) return DDP_OK;
  ddp__psgd_mem_clear(mem);
  mem->p = ddp__calloc(np + 1, sizeof(float));
  mem->q = ddp__calloc(nq + 1, sizeof(float));
  if (!mem->p || !mem->q) {
    ddp__psgd_mem_clear(mem);
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
  c->mem = ddp__psgd_get_mem(s, b->index);
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
size_t *ddp__psgd_bucket_layout(const ddp_grad_bucket_t *b) {
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
  size_t *lay = ddp__psgd_bucket_layout(b);
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
    ddp__psgd_mem_restart(mem, s->rank, b->index);
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

/* Steps 3-5 of a call: split the bucket into matrices and decide compression per tensor
 * (counting both totals), gather the uncompressed tensors, and lay out P and Q (*np, *nq
 * elements). */
static ddp_status_t split_bucket(psgd_call_t *c, const ddp_grad_bucket_t *b, size_t *np,
                                 size_t *nq) {
  ddp_powersgd_state_t *s = c->s;
  /* Split into matrices; decide compression per tensor (step 3). */
  c->mats = ddp__calloc(b->nparams + 1, sizeof *c->mats);
  c->unc_off = ddp__calloc(b->nparams + 1, sizeof(size_t));
  c->unc_len = ddp__calloc(b->nparams + 1, sizeof(size_t));
  if (!c->mats || !c->unc_off || !c->unc_len) return DDP_ERR_NO_MEMORY;
  mat_t *all = ddp__calloc(b->nparams + 1, sizeof *all);
  if (!all) return DDP_ERR_NO_MEMORY;
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
  ddp__psgd_maybe_log_stats(s, b->is_last);

  /* Step 4: the uncompressed tensors, flattened, in bucket order. */
  c->unc = ddp__malloc((c->nunc + 1) * sizeof(float));
  if (!c->unc) {
    ddp__free(all);
    return DDP_ERR_NO_MEMORY;
  }
  for (size_t k = 0, pos = 0; k < c->nuncs; k++) {
    memcpy(c->unc + pos, c->in + c->unc_off[k], c->unc_len[k] * sizeof(float));
    pos += c->unc_len[k];
  }

  /* Step 5: group by shape in order of first appearance; this order lays out P and Q. */
  bool *taken = ddp__calloc(nall + 1, sizeof(bool));
  if (!taken) {
    ddp__free(all);
    return DDP_ERR_NO_MEMORY;
  }
  for (size_t i = 0; i < nall; i++) {
    if (taken[i]) continue;
    for (size_t j = i; j < nall; j++) {
      if (taken[j] || all[j].n != all[i].n || all[j].m != all[i].m) continue;
      taken[j] = true;
      mat_t x = all[j];
      x.poff = *np;
      x.qoff = *nq;
      *np += x.n * x.r;
      *nq += x.m * x.r;
      c->mats[c->nmats++] = x;
    }
  }
  ddp__free(taken);
  ddp__free(all);
  return DDP_OK;
}

ddp_status_t ddp_powersgd_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               ddp_comm_work_t **out) {
  ddp_powersgd_state_t *s = state;
  DDP_REQUIRE(s && s->magic == PSGD_MAGIC && pg && b && out);
  *out = NULL;
  if (b->index == 0) s->bytes_step = 0;
  if (s->iter < s->o.start_powerSGD_iter) return ddp__psgd_warmup(s, pg, b, out);
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
  DDP_CHECK_GOTO(ddp__psgd_prepare_input(c, b, b->numel), st, fail);
  size_t np = 0, nq = 0;
  DDP_CHECK_GOTO(split_bucket(c, b, &np, &nq), st, fail);
  bool need_rand;
  DDP_CHECK_GOTO(ddp__psgd_prepare_memory(c, np, nq, &need_rand), st, fail);

  /* Step 6: Q's start, then step 7: P = M Q with the local M. */
  psgd_mem_t *mem = c->mem;
  if (need_rand) ddp__psgd_fill_normal(s, b->index, mem->q, nq);
  for (size_t j = 0; j < c->nmats; j++) {
    mat_t *x = &c->mats[j];
    DDP_CHECK_GOTO(ddp__psgd_orthogonalize(mem->q + x->qoff, x->m, x->r,
                                           s->o.orthogonalization_epsilon, c->low),
                   st, fail);
    DDP_CHECK_GOTO(ddp_gemm(DDP_F32, false, false, (int64_t)x->n, (int64_t)x->r, (int64_t)x->m, 1.0,
                            c->in + x->off, (int64_t)x->m, mem->q + x->qoff, (int64_t)x->r, 0.0,
                            mem->p + x->poff, (int64_t)x->r),
                   st, fail);
  }
  /* Collectives A (uncompressed) and B (P), launched now so they overlap the backward. */
  DDP_CHECK_GOTO(ddp__psgd_launch(s, pg, w, c->unc, c->nunc), st, fail);
  DDP_CHECK_GOTO(ddp__psgd_launch(s, pg, w, mem->p, mem->np), st, fail);
  ddp_comm_work_then(w, psgd_after_p, c);
  *out = w;
  return DDP_OK;
fail:
  ddp_comm_work_free(w);
  return st;
}
