/* Each framework's gradient-reduction arithmetic (include/ddp/shard.h, ddp_grad_arith_t;
 * docs/sharding.md "Framework arithmetic"): where the division by W happens around the
 * rank-order sum. The f32 divisions are true divisions by the factor rounded to f32, as
 * PyTorch's CPU `tensor.div_(python_float)`; the multiplies are by the reciprocal computed
 * in double and rounded to f32, as `tensor.mul_(1 / W)` and DDP's reducer. */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "ddp/shard.h"

static const char *const names[] = {"ddp", "fsdp1", "fsdp2", "deepspeed", "deepspeed_allreduce"};

const char *ddp_grad_arith_name(ddp_grad_arith_t a) {
  return (size_t)a < DDP_ARRAY_LEN(names) ? names[a] : "?";
}

bool ddp_grad_arith_parse(const char *name, ddp_grad_arith_t *out) {
  DDP_REQUIRE(out);
  for (size_t i = 0; name && i < DDP_ARRAY_LEN(names); i++)
    if (!strcmp(name, names[i])) {
      *out = (ddp_grad_arith_t)i;
      return true;
    }
  return false;
}

/* FSDP1's _get_gradient_predivide_factor: 1 doubled while W % f == 0 and W / f > f. */
static double fsdp1_pre(int world) {
  int f = 1;
  while (world % f == 0 && (double)world / f > f) f *= 2;
  return (double)f;
}

void ddp_grad_arith_factors(ddp_grad_arith_t a, int world, double *pre, double *post) {
  double w = (double)world, p = 1, q = 1;
  switch (a) {
    case DDP_GRAD_ARITH_DDP:
    case DDP_GRAD_ARITH_DEEPSPEED: p = w; break;
    case DDP_GRAD_ARITH_FSDP1:
      p = fsdp1_pre(world);
      q = w / p;
      break;
    case DDP_GRAD_ARITH_FSDP2:
    case DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE: q = w; break;
  }
  if (pre) *pre = p;
  if (post) *post = q;
}

/* dst = src / d (true division) or src * fl(1/d) (mul), in dt. d == 1: a copy. */
static void scale(void *dst, const void *src, size_t n, ddp_dtype_t dt, double d, bool mul) {
  if (d == 1) {
    if (dst != src) memmove(dst, src, n * ddp_dtype_size(dt));
    return;
  }
  if (dt == DDP_F32) {
    float *o = dst, fd = (float)d, r = (float)(1.0 / d);
    const float *s = src;
    if (mul)
      for (size_t k = 0; k < n; k++) o[k] = s[k] * r;
    else
      for (size_t k = 0; k < n; k++) o[k] = s[k] / fd;
  } else {
    DDP_REQUIRE(dt == DDP_F64);
    double *o = dst, r = 1.0 / d;
    const double *s = src;
    if (mul)
      for (size_t k = 0; k < n; k++) o[k] = s[k] * r;
    else
      for (size_t k = 0; k < n; k++) o[k] = s[k] / d;
  }
}

void ddp_grad_arith_pre(ddp_grad_arith_t a, int world, bool divide_in_place, void *dst,
                        const void *src, size_t n, ddp_dtype_t dt) {
  double pre;
  ddp_grad_arith_factors(a, world, &pre, NULL);
  scale(dst, src, n, dt, pre, a == DDP_GRAD_ARITH_DDP && !divide_in_place);
}

void ddp_grad_arith_post(ddp_grad_arith_t a, int world, void *buf, size_t n, ddp_dtype_t dt) {
  double post;
  ddp_grad_arith_factors(a, world, NULL, &post);
  scale(buf, buf, n, dt, post, a == DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE);
}

/* ---------------------------------------------------------------- the comm hook --- */

typedef struct arith_state {
  ddp_grad_arith_t a;
} arith_state_t;

typedef struct arith_call {
  ddp_grad_arith_t a;
  int world;
  void *buf;
  size_t n;
  ddp_dtype_t dt;
} arith_call_t;

static ddp_status_t arith_post(void *user, ddp_comm_work_t *w) {
  arith_call_t *c = user;
  ddp_grad_arith_post(c->a, c->world, c->buf, c->n, c->dt);
  ddp_comm_work_set_result(w, c->buf, c->n, c->dt);
  return DDP_OK;
}

static ddp_status_t arith_hook(void *state, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                               ddp_comm_work_t **out) {
  DDP_REQUIRE(state && pg && b && out);
  *out = NULL;
  if (b->dtype != DDP_F32 && b->dtype != DDP_F64) return DDP_ERR_UNSUPPORTED;
  arith_call_t *c = ddp__calloc(1, sizeof *c);
  if (!c) return DDP_ERR_NO_MEMORY;
  *c = (arith_call_t){((arith_state_t *)state)->a, ddp_pg_size(pg), b->buffer, b->numel, b->dtype};
  ddp_grad_arith_pre(c->a, c->world, true, c->buf, c->buf, c->n, c->dt);
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = ddp_comm_work_create(&w);
  if (st != DDP_OK) {
    ddp__free(c);
    return st;
  }
  ddp_comm_work_on_free(w, ddp__free, c);
  ddp_work_t *pw = NULL;
  st = ddp_allreduce(pg, c->buf, c->buf, c->n, c->dt, DDP_OP_SUM, &pw);
  if (st == DDP_OK) st = ddp_comm_work_add(w, pw);
  if (st != DDP_OK) {
    ddp_comm_work_free(w);
    return st;
  }
  ddp_comm_work_then(w, arith_post, c);
  *out = w;
  return DDP_OK;
}

ddp_status_t ddp_grad_arith_hook(ddp_grad_arith_t a, ddp_comm_hook_t *out) {
  DDP_REQUIRE(out && (size_t)a < DDP_ARRAY_LEN(names));
  memset(out, 0, sizeof *out);
  arith_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return DDP_ERR_NO_MEMORY;
  s->a = a;
  out->fn = arith_hook;
  out->state = s;
  out->name = names[a];
  out->free_state = ddp__free;
  return DDP_OK;
}

/* ---------------------------------------------------------------- clipping --------- */

double ddp_grad_arith_norm(const void *x, size_t n, ddp_dtype_t dt, bool f64) {
  DDP_REQUIRE((x || n == 0) && (dt == DDP_F32 || dt == DDP_F64));
  double acc = 0.0; /* squares of f32 values are exact in f64; the sum runs in element order */
  if (dt == DDP_F32)
    for (size_t k = 0; k < n; k++) acc += (double)((const float *)x)[k] * ((const float *)x)[k];
  else
    for (size_t k = 0; k < n; k++) acc += ((const double *)x)[k] * ((const double *)x)[k];
  double r = sqrt(acc);
  return f64 || dt == DDP_F64 ? r : (double)(float)r;
}

/* clip_grad_norm_'s coefficient from the total, in dt: max_norm / (total + 1e-6) is
 * Tensor.__rtruediv__ (reciprocal, then times max_norm, each rounded), clamped to 1 (NaN
 * kept), as DEFINE_CLIP in src/optim/optim.c. */
static double torch_coef(double total, double max_norm, ddp_dtype_t dt) {
  if (dt == DDP_F32) {
    float c = (1.0f / ((float)total + 1e-6f)) * (float)max_norm;
    return c > 1.0f ? 1.0 : (double)c;
  }
  double c = (1.0 / (total + 1e-6)) * max_norm;
  return c > 1.0 ? 1.0 : c;
}

static void scale_grads(ddp_tensor_t *const *grads, size_t n, double coef) {
  for (size_t i = 0; i < n; i++) {
    ddp_tensor_t *g = grads[i];
    if (!g->data) continue;
    if (g->dtype == DDP_F32) {
      float c = (float)coef, *x = g->data;
      for (int64_t k = 0; k < g->numel; k++) x[k] = x[k] * c;
    } else {
      double *x = g->data;
      for (int64_t k = 0; k < g->numel; k++) x[k] = x[k] * coef;
    }
  }
}

/* One value summed over the ranks, in rank order, in dt. */
static ddp_status_t allreduce1(ddp_pg_t *pg, void *v, ddp_dtype_t dt, const char *who,
                               ddp_error_t *err) {
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(pg, v, v, 1, dt, DDP_OP_SUM, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st == DDP_OK) return DDP_OK;
  ddp_error_t pe;
  ddp_pg_last_error_copy(pg, &pe);
  return ddp__error_quiet(err, st, "%s clipping: gradient norm allreduce: %s", who, pe.msg);
}

ddp_status_t ddp_grad_arith_clip_sharded(ddp_pg_t *pg, const double *local, size_t m,
                                         ddp_tensor_t *const *grads, size_t n, ddp_dtype_t dt,
                                         double max_norm, double *total_norm, ddp_error_t *err) {
  DDP_REQUIRE(pg && (local || m == 0) && (grads || n == 0) && total_norm);
  DDP_REQUIRE(dt == DDP_F32 || dt == DDP_F64);
  /* FSDP1 _get_grad_norm / FSDP2 _get_total_norm: vector_norm of the stacked local norms
   * (their squares in f64, in order, as ddp_clip_grad_norm_from_norms) */
  double acc = 0.0;
  for (size_t k = 0; k < m; k++) {
    double v = dt == DDP_F32 ? (double)(float)local[k] : local[k];
    acc += v * v;
  }
  double total;
  if (dt == DDP_F32) { /* local ** 2 (x * x), all_reduce SUM, ** (1 / 2) (sqrt), in f32 */
    float l = (float)sqrt(acc), sq = l * l;
    DDP_CHECK(allreduce1(pg, &sq, DDP_F32, "fsdp", err));
    total = (double)sqrtf(sq);
  } else {
    double l = sqrt(acc), sq = l * l;
    DDP_CHECK(allreduce1(pg, &sq, DDP_F64, "fsdp", err));
    total = sqrt(sq);
  }
  scale_grads(grads, n, torch_coef(total, max_norm, dt));
  *total_norm = total;
  return DDP_OK;
}

/* DeepSpeed's unscale_and_clip_grads with loss_scale 1 (f32 training): clip =
 * ((total / 1) + 1e-6) / clip_grad, clamped to at least 1 (NaN kept), and the gradients
 * multiplied by 1 / clip; in f32 for ZeRO-1/2 (their norm is an f32 tensor), in f64 for
 * ZeRO-3 (an f64 tensor; the f32 gradients take the coefficient rounded to f32). */
static double deepspeed_coef(double total, double max_norm, bool f64) {
  if (f64) {
    double c = (total + 1e-6) / max_norm;
    return 1.0 / (c < 1.0 ? 1.0 : c);
  }
  float c = ((float)total + 1e-6f) / (float)max_norm;
  return (double)(1.0f / (c < 1.0f ? 1.0f : c));
}

ddp_status_t ddp_grad_arith_clip_deepspeed(ddp_pg_t *pg, ddp_tensor_t *const *grads,
                                           const int *holder, const size_t *group_n, size_t ngroups,
                                           ddp_tensor_t *const *scale, ddp_dtype_t dt,
                                           double max_norm, double *total_norm, ddp_error_t *err) {
  DDP_REQUIRE(pg && (grads || ngroups == 0) && group_n && scale && total_norm);
  DDP_REQUIRE(dt == DDP_F32 || dt == DDP_F64);
  int W = ddp_pg_size(pg), rank = ddp_pg_rank(pg);
  size_t n = 0, npieces = 0;
  for (size_t g = 0; g < ngroups; g++) n += group_n[g];
  /* the pieces: each group's flat buffer padded to a multiple of 2 W
   * (nccl_start_alignment_factor * W, flatten_dense_tensors_aligned), cut into W equal
   * partitions (get_data_parallel_partitions); a parameter meets each partition it
   * straddles in one piece (get_partition_info, get_flat_partition) */
  size_t *psz = ddp__calloc(ngroups ? ngroups : 1, sizeof *psz);
  if (!psz) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "deepspeed clipping: out of memory");
  for (size_t g = 0, i = 0; g < ngroups; g++) {
    size_t total = 0, align = 2 * (size_t)W;
    for (size_t k = 0; k < group_n[g]; k++, i++) total += (size_t)grads[i]->numel;
    psz[g] = (total + align - 1) / align * align / (size_t)W;
    for (size_t k = i - group_n[g], off = 0; k < i; k++) {
      size_t numel = (size_t)grads[k]->numel;
      if (numel) npieces += (off + numel - 1) / psz[g] - off / psz[g] + 1;
      off += numel;
    }
  }
  /* piece norms, each as `g.data.double()`'s 2-norm (f64, not rounded), computed by the rank
   * that holds the gradient and summed over the ranks (one nonzero term each: exact) */
  double *pn = ddp__calloc(npieces ? npieces : 1, sizeof *pn);
  double *sq = ddp__calloc(ngroups * (size_t)W + 1, sizeof *sq);
  if (!pn || !sq) {
    ddp__free(psz);
    ddp__free(pn);
    ddp__free(sq);
    return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "deepspeed clipping: out of memory");
  }
  ddp_status_t st = DDP_OK;
  for (size_t g = 0, i = 0, q = 0; g < ngroups; g++)
    for (size_t k = 0, off = 0; k < group_n[g]; k++, i++) {
      const ddp_tensor_t *t = grads[i];
      size_t numel = (size_t)t->numel;
      for (size_t a = off; a < off + numel; q++) {
        size_t b = (a / psz[g] + 1) * psz[g];
        if (b > off + numel) b = off + numel;
        if (t->data && (!holder || holder[i] == rank))
          pn[q] = ddp_grad_arith_norm((const unsigned char *)t->data +
                                          (a - off) * ddp_dtype_size(dt),
                                      b - a, dt, true);
        a = b;
      }
      off += numel;
    }
  if (holder && npieces) {
    ddp_work_t *w = NULL;
    st = ddp_allreduce(pg, pn, pn, npieces, DDP_F64, DDP_OP_SUM, &w);
    if (st == DDP_OK) st = ddp_work_wait_free(w);
    if (st != DDP_OK) {
      ddp_error_t pe;
      ddp_pg_last_error_copy(pg, &pe);
      st = ddp__error_quiet(err, st, "deepspeed clipping: piece norm allreduce: %s", pe.msg);
      goto out;
    }
  }
  /* get_grad_norm_direct per group, as each rank r computes it: the squares of its pieces'
   * norms summed in f64 (torch.stack(all_norms).square().sum()), .float(), all_reduce SUM
   * (rank order, f32), ** (1 / 2); non-finite becomes -1. scaled_global_norm: the 2-norm of
   * the groups' norms (ddp_grad_norms's rounding). */
  double gacc = 0.0;
  for (size_t g = 0, i = 0, q = 0; g < ngroups; g++) {
    double *s = sq + g * (size_t)W;
    for (size_t k = 0, off = 0; k < group_n[g]; k++, i++) {
      size_t numel = (size_t)grads[i]->numel;
      for (size_t a = off; a < off + numel; q++) {
        size_t b = (a / psz[g] + 1) * psz[g];
        s[a / psz[g]] += pn[q] * pn[q];
        a = b < off + numel ? b : off + numel;
      }
      off += numel;
    }
    double gn;
    if (dt == DDP_F32) {
      float sum = (float)s[0];
      for (int r = 1; r < W; r++) sum += (float)s[r];
      float root = sqrtf(sum);
      gn = isfinite(root) ? (double)root : -1.0;
    } else {
      double sum = s[0];
      for (int r = 1; r < W; r++) sum += s[r];
      gn = isfinite(sqrt(sum)) ? sqrt(sum) : -1.0;
    }
    gacc += gn * gn;
  }
  double total = dt == DDP_F32 ? (double)(float)sqrt(gacc) : sqrt(gacc);
  scale_grads(scale, n, deepspeed_coef(total, max_norm, dt == DDP_F64));
  *total_norm = total;
out:
  ddp__free(psz);
  ddp__free(pn);
  ddp__free(sq);
  return st;
}

ddp_status_t ddp_grad_arith_clip_deepspeed3(ddp_pg_t *pg, double *sq, size_t ngroups,
                                            ddp_tensor_t *const *grads, size_t n, double max_norm,
                                            double *total_norm, ddp_error_t *err) {
  DDP_REQUIRE(pg && (sq || ngroups == 0) && (grads || n == 0) && total_norm);
  if (ngroups) {
    ddp_work_t *w = NULL;
    ddp_status_t st = ddp_allreduce(pg, sq, sq, ngroups, DDP_F64, DDP_OP_SUM, &w);
    if (st == DDP_OK) st = ddp_work_wait_free(w);
    if (st != DDP_OK) {
      ddp_error_t pe;
      ddp_pg_last_error_copy(pg, &pe);
      return ddp__error_quiet(err, st, "deepspeed clipping: gradient norm allreduce: %s", pe.msg);
    }
  }
  /* stage3.py get_grad_norm_direct per group: all_reduce SUM of the f64 sums, ** (1 / 2),
   * non-finite -1; the global norm the f64 2-norm of the groups' norms */
  double acc = 0.0;
  for (size_t g = 0; g < ngroups; g++) {
    double gn = sqrt(sq[g]);
    if (!isfinite(gn)) gn = -1.0;
    acc += gn * gn;
  }
  double total = sqrt(acc);
  scale_grads(grads, n, deepspeed_coef(total, max_norm, true));
  *total_norm = total;
  return DDP_OK;
}

double ddp_grad_arith_param_norm(ddp_grad_arith_t a, int rank, int world, const ddp_tensor_t *g) {
  DDP_REQUIRE(g && g->data && world >= 1 && rank >= 0 && rank < world);
  size_t numel = (size_t)g->numel, lo = 0, hi = numel, esz = ddp_dtype_size(g->dtype);
  bool f64 = false;
  if (a == DDP_GRAD_ARITH_FSDP2) { /* torch.chunk on dim 0: ceil(rows / W) rows a rank */
    size_t rows = g->ndim ? (size_t)g->shape[0] : 1, row = rows ? numel / rows : 0;
    size_t c = (rows + (size_t)world - 1) / (size_t)world, r0 = (size_t)rank * c;
    r0 = r0 < rows ? r0 : rows;
    lo = r0 * row;
    hi = (r0 + c < rows ? r0 + c : rows) * row;
  } else if (a == DDP_GRAD_ARITH_DEEPSPEED || a == DDP_GRAD_ARITH_DEEPSPEED_ALLREDUCE) {
    size_t ps = (numel + (size_t)world - 1) / (size_t)world; /* ds_tensor: ceil(numel / W) */
    lo = (size_t)rank * ps < numel ? (size_t)rank * ps : numel;
    hi = lo + ps < numel ? lo + ps : numel;
    f64 = true;
  }
  return ddp_grad_arith_norm((const unsigned char *)g->data + lo * esz, hi - lo, g->dtype, f64);
}
