/* ZeRO-2's gradient reduction (include/ddp/shard.h, docs/sharding.md "ZeRO-2"): each
 * bucket of gradients is reduced to the ranks that own its parameters as soon as backward
 * has finished it, and the memory of the gradients this rank does not own is handed back.
 *
 * The algorithm. Buckets are DDP's initial layout: the parameters in reverse model order
 * (the order backward finishes them), closed at 1 MiB for the first bucket and then at the
 * cap (25 MiB, or ddp_bucket_cap_mb). Inside a bucket the elements are grouped by owner:
 * segment r holds, one after the other, the parameters rank r owns (the partition is
 * ZeroRedundancyOptimizer's, whole parameters). When the model's gradient-ready hook has
 * seen every parameter of a bucket (and of every bucket before it: buckets go in index
 * order on every rank), this rank writes its local gradients into the bucket, divided as
 * DDP divides (x * fl(1/W), or x / W with divide_in_place; --sharding_arithmetic's
 * pre-divide otherwise), and for each owner r in rank order either sends segment r to r
 * or, when r is this rank, receives the W - 1 other ranks' segment r in rank order. The
 * owner then sums the W contributions in rank order, ((x_0 + x_1) + x_2) + ..., in the
 * element's dtype, which is the sum DDP's allreduce computes for those elements (D2), so
 * the reduced gradient is DDP's bit for bit whatever the buckets; it is copied into the
 * owned parameters' gradients, and the other parameters' gradients become None with their
 * pages returned (ddp_param_release_grad). A bucket's buffer (its elements plus W - 1
 * segments to receive) lives from its launch to its completion, which the hook checks at
 * each later launch and ddp__zero2_reduce waits for at the end of backward.
 *
 * Why point to point: libddp's reduce_scatter gives every rank an equal count, and owners
 * hold whole parameters, so a bucket would be padded to W times its largest owner segment
 * (W times the bucket when one parameter fills it, as GPT-2's embedding does). The sends
 * carry exactly the elements another rank owns: each rank sends Ψ - Ψ_r per step, the mean
 * Ψ(W - 1)/W of a reduce-scatter. Matching is deadlock-free: every rank issues, bucket by
 * bucket and owner by owner in rank order, the owner's receives in rank order and each
 * other rank's one send, and a group runs its operations in issue order.
 *
 * Gradient accumulation: a micro-batch run with sync off (no_sync) reduces nothing; the
 * gradients accumulate locally at full size as in DDP, and the last micro-batch's backward
 * reduces the sum, so the bits stay DDP's. A parameter no backward reached (None on this
 * rank) contributes zeros, as in DDP. */
#include "shard/zero2.h"

#include <string.h>

typedef struct bucket {
  size_t first, count; /* parameters ord[first .. first + count) */
  size_t numel;
  size_t *seg; /* [W] offset of owner r's segment; cnt[r] its elements */
  size_t *cnt; /* [W] */
  size_t pending;
  bool launched, done;
  unsigned char *buf; /* numel + W * cnt[rank] elements while in flight */
  ddp_work_t **works; /* [2W]: W - 1 receives and up to W - 1 sends */
  size_t nworks;
} bucket_t;

struct ddp__zero2 {
  ddp__zero2_cfg_t c;
  size_t esz;
  size_t *ord;   /* [n] parameters in bucket order */
  size_t *where; /* [n] parameter i's bucket */
  size_t *poff;  /* [n] parameter i's offset in its owner's segment */
  bool *ready;   /* [n] marked in this backward */
  bucket_t *b;   /* [nb] */
  size_t nb;
  size_t next_launch, next_done;
  /* attached (ddp__zero2_attach): */
  ddp_model_t *model;
  ddp_param_t **mp; /* [n] the model parameter behind parameter i */
  size_t *index;    /* [model params] zero index, SIZE_MAX: none */
  size_t nmodel;
  bool armed;          /* the running backward reduces */
  ddp_status_t status; /* the first failure in a hook, message in err */
  ddp_error_t err;
};

static void free_buckets(ddp__zero2_t *z2) {
  for (size_t k = 0; k < z2->nb; k++) {
    bucket_t *x = &z2->b[k];
    for (size_t w = 0; w < x->nworks; w++) (void)ddp_work_wait_free(x->works[w]);
    ddp__free(x->buf);
    ddp__free(x->seg);
    ddp__free(x->cnt);
    ddp__free(x->works);
  }
  ddp__free(z2->b);
  z2->b = NULL;
  z2->nb = 0;
}

/* Buckets over z2->ord (already in visiting order): DDP's compute_bucket_assignment_by_size
 * for one dtype, then each bucket's owner segments. */
static ddp_status_t assign(ddp__zero2_t *z2, size_t cap, size_t first_cap, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  free_buckets(z2);
  z2->b = ddp__calloc(c->n ? c->n : 1, sizeof *z2->b);
  if (!z2->b) goto oom;
  for (size_t k = 0, bytes = 0; k < c->n; k++) {
    bucket_t *x = &z2->b[z2->nb];
    if (x->count == 0) x->first = k;
    x->count++;
    bytes += (size_t)c->params[z2->ord[k]].param->numel * z2->esz;
    if (bytes >= (z2->nb == 0 ? first_cap : cap) || k + 1 == c->n) {
      z2->nb++;
      bytes = 0;
    }
  }
  size_t W = (size_t)c->world;
  for (size_t b = 0; b < z2->nb; b++) {
    bucket_t *x = &z2->b[b];
    x->seg = ddp__calloc(W, sizeof *x->seg);
    x->cnt = ddp__calloc(W, sizeof *x->cnt);
    x->works = ddp__calloc(2 * W, sizeof *x->works);
    if (!x->seg || !x->cnt || !x->works) goto oom;
    for (size_t k = x->first; k < x->first + x->count; k++) {
      size_t i = z2->ord[k];
      z2->where[i] = b;
      z2->poff[i] = x->cnt[c->owner[i]];
      x->cnt[c->owner[i]] += (size_t)c->params[i].param->numel;
    }
    for (size_t r = 0; r < W; r++) {
      x->seg[r] = x->numel;
      x->numel += x->cnt[r];
    }
  }
  return DDP_OK;
oom:
  free_buckets(z2);
  return ddp__error(err, c->rank, DDP_ERR_NO_MEMORY, "zero: out of memory for %zu buckets", c->n);
}

ddp_status_t ddp__zero2_create(const ddp__zero2_cfg_t *cfg, size_t cap_bytes, size_t first_bytes,
                               ddp__zero2_t **out, ddp_error_t *err) {
  *out = NULL;
  ddp__zero2_t *z2 = ddp__calloc(1, sizeof *z2);
  size_t n1 = cfg->n ? cfg->n : 1;
  if (z2) {
    z2->c = *cfg;
    z2->esz = ddp_dtype_size(cfg->dt);
    z2->ord = ddp__calloc(n1, sizeof *z2->ord);
    z2->where = ddp__calloc(n1, sizeof *z2->where);
    z2->poff = ddp__calloc(n1, sizeof *z2->poff);
    z2->ready = ddp__calloc(n1, sizeof *z2->ready);
  }
  if (!z2 || !z2->ord || !z2->where || !z2->poff || !z2->ready) {
    ddp__zero2_destroy(z2);
    return ddp__error(err, cfg->rank, DDP_ERR_NO_MEMORY, "zero: out of memory");
  }
  for (size_t k = 0; k < cfg->n; k++) z2->ord[k] = cfg->n - 1 - k;
  ddp_status_t st = assign(z2, cap_bytes, first_bytes, err);
  if (st != DDP_OK) {
    ddp__zero2_destroy(z2);
    return st;
  }
  *out = z2;
  return DDP_OK;
}

void ddp__zero2_destroy(ddp__zero2_t *z2) {
  if (!z2) return;
  if (z2->model)
    for (size_t i = 0; i < z2->c.n; i++) ddp_param_set_hook(z2->mp[i], NULL, NULL);
  free_buckets(z2);
  ddp__free(z2->ord);
  ddp__free(z2->where);
  ddp__free(z2->poff);
  ddp__free(z2->ready);
  ddp__free(z2->mp);
  ddp__free(z2->index);
  ddp__free(z2);
}

static ddp_status_t pg_fail(ddp__zero2_t *z2, ddp_status_t st, const char *what, size_t b,
                            ddp_error_t *err) {
  ddp_error_t pe;
  ddp_pg_last_error_copy(z2->c.pg, &pe);
  return ddp__error_quiet(err, st, "zero: gradient %s of bucket %zu (of %zu): %s", what, b, z2->nb,
                          pe.msg);
}

/* Bucket b's local gradients into its owner segments, then its sends and receives. */
static ddp_status_t launch(ddp__zero2_t *z2, size_t b, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  bucket_t *x = &z2->b[b];
  size_t mine = x->cnt[c->rank], total = x->numel + (size_t)c->world * mine;
  x->launched = true;
  x->buf = ddp__malloc((total ? total : 1) * z2->esz);
  if (!x->buf)
    return ddp__error(err, c->rank, DDP_ERR_NO_MEMORY,
                      "zero: out of memory for gradient bucket %zu (%zu bytes)", b,
                      total * z2->esz);
  for (size_t k = x->first; k < x->first + x->count; k++) {
    size_t i = z2->ord[k];
    const ddp_tensor_t *g = c->params[i].grad;
    unsigned char *dst = x->buf + (x->seg[c->owner[i]] + z2->poff[i]) * z2->esz;
    if (g->data)
      ddp_grad_arith_pre(c->arith, c->world, c->divide_in_place, dst, g->data, (size_t)g->numel,
                         c->dt);
    else
      memset(dst, 0, (size_t)g->numel * z2->esz);
  }
  unsigned char *recv = x->buf + x->numel * z2->esz;
  for (int r = 0; r < c->world; r++) {
    if (x->cnt[r] == 0) continue;
    for (int q = 0; q < c->world; q++) {
      ddp_status_t st = DDP_OK;
      if (r == c->rank && q != c->rank)
        st = ddp_recv(c->pg, recv + (size_t)q * mine * z2->esz, mine, c->dt, q,
                      &x->works[x->nworks]);
      else if (r != c->rank && q == c->rank)
        st = ddp_send(c->pg, x->buf + x->seg[r] * z2->esz, x->cnt[r], c->dt, r,
                      &x->works[x->nworks]);
      else
        continue;
      if (st != DDP_OK) return pg_fail(z2, st, r == c->rank ? "receive" : "send", b, err);
      x->nworks++;
    }
  }
  return DDP_OK;
}

/* acc = ((p_0 + p_1) + p_2) + ... in the dtype (p_q: rank q's contribution). */
static void sum_in_rank_order(ddp__zero2_t *z2, bucket_t *x, unsigned char *acc) {
  const ddp__zero2_cfg_t *c = &z2->c;
  size_t n = x->cnt[c->rank];
  unsigned char *recv = x->buf + x->numel * z2->esz;
  for (int q = 0; q < c->world; q++) {
    const unsigned char *p = q == c->rank ? x->buf + x->seg[c->rank] * z2->esz
                                          : recv + (size_t)q * n * z2->esz;
    if (q == 0) {
      memcpy(acc, p, n * z2->esz);
    } else if (c->dt == DDP_F32) {
      float *a = (float *)acc;
      const float *s = (const float *)p;
      for (size_t k = 0; k < n; k++) a[k] += s[k];
    } else {
      double *a = (double *)acc;
      const double *s = (const double *)p;
      for (size_t k = 0; k < n; k++) a[k] += s[k];
    }
  }
}

/* Bucket b's works are done (block: wait for them): the owner's sum into its gradients,
 * the others' gradients None. */
static ddp_status_t finish(ddp__zero2_t *z2, size_t b, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  bucket_t *x = &z2->b[b];
  ddp_status_t st = DDP_OK;
  for (size_t w = 0; w < x->nworks; w++) {
    ddp_status_t s = ddp_work_wait_free(x->works[w]);
    x->works[w] = NULL;
    if (s != DDP_OK && st == DDP_OK) st = pg_fail(z2, s, "send/receive", b, err);
  }
  x->nworks = 0;
  x->done = true;
  if (st != DDP_OK) {
    ddp__free(x->buf);
    x->buf = NULL;
    return st;
  }
  /* the accumulator: this rank's own receive slot, which nothing was received into */
  unsigned char *acc = x->buf + (x->numel + (size_t)c->rank * x->cnt[c->rank]) * z2->esz;
  sum_in_rank_order(z2, x, acc);
  ddp_grad_arith_post(c->arith, c->world, acc, x->cnt[c->rank], c->dt);
  for (size_t k = x->first; k < x->first + x->count && st == DDP_OK; k++) {
    size_t i = z2->ord[k];
    ddp_tensor_t *g = c->params[i].grad;
    if (c->owner[i] != c->rank) {
      if (z2->model) {
        ddp_param_release_grad(z2->mp[i]);
      } else if (g->data) { /* None, as ddp_optim_zero_grad(set_to_none) makes it */
        ddp_tensor_t hdr = *g;
        ddp_tensor_free(g);
        *g = hdr;
        g->data = NULL;
        g->owns = false;
      }
      continue;
    }
    if (!g->data && z2->model) ddp_param_set_grad_data(z2->mp[i], NULL);
    if (!g->data)
      st = ddp__error(err, c->rank, DDP_ERR_INVALID_USAGE,
                      "zero: parameter %zu, owned by rank %d, has no gradient storage", i, c->rank);
    else
      memcpy(g->data, acc + z2->poff[i] * z2->esz, (size_t)g->numel * z2->esz);
  }
  ddp__free(x->buf);
  x->buf = NULL;
  return st;
}

/* Completes, in order, the launched buckets whose works have all finished. */
static ddp_status_t poll_done(ddp__zero2_t *z2, ddp_error_t *err) {
  while (z2->next_done < z2->next_launch) {
    bucket_t *x = &z2->b[z2->next_done];
    for (size_t w = 0; w < x->nworks; w++) {
      bool done = false;
      if (ddp_work_test(x->works[w], &done) != DDP_OK) break; /* finish reports it */
      if (!done) return DDP_OK;
    }
    DDP_CHECK(finish(z2, z2->next_done, err));
    z2->next_done++;
  }
  return DDP_OK;
}

static void restart(ddp__zero2_t *z2) {
  for (size_t b = 0; b < z2->nb; b++) {
    z2->b[b].pending = z2->b[b].count;
    z2->b[b].launched = z2->b[b].done = false;
  }
  memset(z2->ready, 0, (z2->c.n ? z2->c.n : 1) * sizeof *z2->ready);
  z2->next_launch = z2->next_done = 0;
}

/* The model's gradient-ready hook: parameter p is final for this backward. */
static void grad_ready(void *user, ddp_param_t *p, int fire) {
  ddp__zero2_t *z2 = user;
  (void)fire;
  if (!z2->armed || z2->status != DDP_OK || p->index >= z2->nmodel) return;
  size_t i = z2->index[p->index];
  if (i == SIZE_MAX || z2->ready[i]) return;
  z2->ready[i] = true;
  z2->b[z2->where[i]].pending--;
  ddp_status_t st = DDP_OK;
  while (st == DDP_OK && z2->next_launch < z2->nb && z2->b[z2->next_launch].pending == 0) {
    st = poll_done(z2, &z2->err);
    if (st == DDP_OK) st = launch(z2, z2->next_launch++, &z2->err);
  }
  z2->status = st;
}

ddp_status_t ddp__zero2_attach(ddp__zero2_t *z2, ddp_model_t *model, size_t cap_bytes,
                               size_t first_bytes, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  size_t nm = ddp_model_num_params(model);
  z2->mp = ddp__calloc(c->n ? c->n : 1, sizeof *z2->mp);
  z2->index = ddp__calloc(nm ? nm : 1, sizeof *z2->index);
  if (!z2->mp || !z2->index) return ddp__error(err, c->rank, DDP_ERR_NO_MEMORY, "zero: no memory");
  for (size_t k = 0; k < nm; k++) z2->index[k] = SIZE_MAX;
  size_t found = 0;
  for (size_t k = nm; k-- > 0;) { /* reverse model order: the buckets' order */
    ddp_param_t *p = ddp_model_param(model, k);
    for (size_t i = 0; i < c->n; i++)
      if (c->params[i].param == &p->value) {
        if (c->params[i].grad != &p->grad)
          return ddp__error(err, c->rank, DDP_ERR_INVALID_ARGUMENT,
                            "zero: parameter %zu (%s) is the model's but its gradient is not", i,
                            p->name);
        z2->index[k] = i;
        z2->mp[i] = p;
        z2->ord[found++] = i;
      }
  }
  if (found != c->n)
    return ddp__error(err, c->rank, DDP_ERR_INVALID_ARGUMENT,
                      "zero: %zu of the %zu parameters are not the model's", c->n - found, c->n);
  DDP_CHECK(assign(z2, cap_bytes, first_bytes, err));
  z2->model = model;
  z2->nmodel = nm;
  for (size_t i = 0; i < c->n; i++) {
    ddp_param_set_hook(z2->mp[i], grad_ready, z2);
    if (c->owner[i] != c->rank) ddp_param_release_grad(z2->mp[i]);
  }
  restart(z2);
  return DDP_OK;
}

void ddp__zero2_set_sync(ddp__zero2_t *z2, bool sync) {
  z2->armed = sync;
  restart(z2);
}

ddp_status_t ddp__zero2_reduce(ddp__zero2_t *z2, ddp_error_t *err) {
  ddp_status_t st = z2->status;
  if (st != DDP_OK && err) *err = z2->err;
  z2->status = DDP_OK;
  if (!z2->armed) restart(z2); /* not attached, or no set_sync: the whole reduction here */
  while (st == DDP_OK && z2->next_launch < z2->nb) st = launch(z2, z2->next_launch++, err);
  /* after a failure the buckets in flight are still waited for, their status dropped */
  for (; z2->next_done < z2->next_launch; z2->next_done++) {
    if (st == DDP_OK) {
      st = finish(z2, z2->next_done, err);
      continue;
    }
    bucket_t *x = &z2->b[z2->next_done];
    for (size_t w = 0; w < x->nworks; w++) (void)ddp_work_wait_free(x->works[w]);
    x->nworks = 0;
    ddp__free(x->buf);
    x->buf = NULL;
  }
  z2->armed = false;
  restart(z2);
  return st;
}
