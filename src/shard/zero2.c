/* ZeRO-2's gradient reduction (include/ddp/shard.h, docs/sharding.md "ZeRO-2"): each
 * bucket of gradients is reduced to the ranks that own its parameters as soon as backward
 * has finished it, and the memory of the gradients this rank does not own is handed back.
 *
 * The algorithm. Buckets are DDP's initial layout: the parameters in reverse model order
 * (the order backward finishes them), closed at 1 MiB for the first bucket and then at the
 * cap (25 MiB, or ddp_bucket_cap_mb); a parameter larger than the cap is cut into pieces of
 * the cap, each a bucket of its own. Inside a bucket the elements are grouped by owner:
 * segment r holds, one after the other, the pieces of the parameters rank r owns (the
 * partition is ZeroRedundancyOptimizer's, whole parameters). When the model's
 * gradient-ready hook has seen every parameter of a bucket (and of every bucket before it:
 * buckets go in index order on every rank), this rank writes its local gradients into the
 * bucket, divided as DDP divides (x * fl(1/W), or x / W with divide_in_place from the
 * second reduction on, as the reducer's bucket-view gradients;
 * --sharding_arithmetic's pre-divide otherwise), and launches the bucket's collective, in a
 * buffer from ddp_pg_alloc (shm reduces it in place):
 *   - a reduce-scatter when the owners' segments, each padded to the largest one (m
 *     elements), cost no more than an allreduce (W m <= 2 numel): rank r receives segment r;
 *   - an allreduce otherwise (a bucket one owner fills, such as a piece of GPT-2's
 *     embedding, where a reduce-scatter would send W times the bucket).
 * Either sums the W contributions of every element in rank order in the element's dtype
 * (D2), which is what DDP's allreduce computes for that element, so the owner's reduced
 * gradient is DDP's bit for bit whatever the buckets and the collective. The owner copies
 * its segment into its gradients; the gradients it does not own become None with their
 * pages returned (ddp_param_release_grad). A bucket's buffer lives from its launch to its
 * completion, which the hook checks at each later launch and ddp__zero2_reduce waits for at
 * the end of backward. The buffers in flight are bounded (two of the largest kind): a
 * launch that would pass the bound first waits for the oldest bucket (every rank launches
 * the same buckets in the same order, so the oldest is or will be issued everywhere and the
 * wait ends). The pieces and the bound keep the owner of a large parameter from holding
 * several copies of it at once.
 *
 * Why not point to point: sends of exactly the elements each owner needs would carry the
 * bytes of an unpadded reduce-scatter, but on shm they go through a small staging area in
 * lock step, which made the step 1.6x slower than DDP's in-place allreduce on a GPT-2 10M.
 *
 * Gradient accumulation: a micro-batch run with sync off (no_sync) reduces nothing; the
 * gradients accumulate locally at full size as in DDP, and the last micro-batch's backward
 * reduces the sum, so the bits stay DDP's. A parameter no backward reached (None on this
 * rank) contributes zeros, as in DDP. */
#include "shard/zero2.h"

#include <string.h>

/* A piece of a bucket: elements [lo, lo + len) of parameter `param` (a parameter larger than
 * the cap is cut into pieces of at most the cap, each in its own bucket). */
typedef struct piece {
  size_t param, lo, len;
  size_t bucket;
  size_t off; /* in its owner's segment of the bucket */
} piece_t;

typedef struct bucket {
  size_t first, count; /* pieces pc[first .. first + count) */
  size_t numel;
  size_t *seg; /* [W] offset of owner r's segment; cnt[r] its elements */
  size_t *cnt; /* [W] */
  size_t pending;
  bool launched, done;
  bool rs;            /* reduce-scatter (segments padded to m); else allreduce */
  size_t m, bufn;     /* the largest segment; the buffer's elements */
  unsigned char *buf; /* bufn elements (ddp_pg_alloc) while in flight */
  ddp_work_t **works; /* [1] */
  size_t nworks;
} bucket_t;

struct ddp__zero2 {
  ddp__zero2_cfg_t c;
  size_t esz;
  size_t *ord;    /* [n] parameters in bucket order */
  size_t *pfirst; /* [n] parameter i's first piece; its pieces follow it */
  size_t *pcount; /* [n] */
  piece_t *pc;    /* [npc] in bucket order */
  size_t npc;
  bool *ready; /* [n] marked in this backward */
  bucket_t *b; /* [nb] */
  size_t nb;
  size_t next_launch, next_done;
  size_t inflight, budget; /* bytes of the buffers launched and not done; their bound */
  size_t reductions;       /* completed: cfg.divide_in_place applies from the second on */
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
    if (x->buf) ddp_pg_free(z2->c.pg, x->buf);
    ddp__free(x->seg);
    ddp__free(x->cnt);
    ddp__free(x->works);
  }
  ddp__free(z2->b);
  z2->b = NULL;
  z2->nb = 0;
}

/* Pieces and buckets over z2->ord (already in visiting order): DDP's
 * compute_bucket_assignment_by_size for one dtype, with a parameter above the cap cut into
 * pieces of the cap, then each bucket's owner segments. */
static ddp_status_t assign(ddp__zero2_t *z2, size_t cap, size_t first_cap, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  size_t W = (size_t)c->world, maxel = cap / z2->esz ? cap / z2->esz : 1;
  free_buckets(z2);
  ddp__free(z2->pc);
  z2->npc = 0;
  for (size_t k = 0; k < c->n; k++) {
    size_t numel = (size_t)c->params[k].param->numel;
    z2->npc += numel > maxel ? (numel + maxel - 1) / maxel : 1;
  }
  z2->pc = ddp__calloc(z2->npc ? z2->npc : 1, sizeof *z2->pc);
  z2->b = ddp__calloc(z2->npc ? z2->npc : 1, sizeof *z2->b);
  if (!z2->pc || !z2->b) goto oom;
  size_t m = 0;
  for (size_t k = 0; k < c->n; k++) {
    size_t i = z2->ord[k], numel = (size_t)c->params[i].param->numel, lo = 0;
    z2->pfirst[i] = m;
    do {
      size_t len = numel - lo < maxel ? numel - lo : maxel;
      z2->pc[m++] = (piece_t){.param = i, .lo = lo, .len = len};
      lo += len;
    } while (lo < numel);
    z2->pcount[i] = m - z2->pfirst[i];
  }
  for (size_t k = 0, bytes = 0; k < z2->npc; k++) {
    bucket_t *x = &z2->b[z2->nb];
    if (x->count == 0) x->first = k;
    x->count++;
    bytes += z2->pc[k].len * z2->esz;
    if (bytes >= (z2->nb == 0 ? first_cap : cap) || k + 1 == z2->npc) {
      z2->nb++;
      bytes = 0;
    }
  }
  for (size_t b = 0; b < z2->nb; b++) {
    bucket_t *x = &z2->b[b];
    x->seg = ddp__calloc(W, sizeof *x->seg);
    x->cnt = ddp__calloc(W, sizeof *x->cnt);
    x->works = ddp__calloc(1, sizeof *x->works);
    if (!x->seg || !x->cnt || !x->works) goto oom;
    for (size_t k = x->first; k < x->first + x->count; k++) {
      piece_t *q = &z2->pc[k];
      int r = c->owner[q->param];
      q->bucket = b;
      q->off = x->cnt[r];
      x->cnt[r] += q->len;
    }
    for (size_t r = 0; r < W; r++) {
      x->numel += x->cnt[r];
      if (x->cnt[r] > x->m) x->m = x->cnt[r];
    }
    /* the collective that sends fewer bytes: a reduce-scatter sends (W - 1) m, an
     * allreduce 2 (W - 1) / W numel */
    x->rs = W * x->m <= 2 * x->numel;
    x->bufn = x->rs ? W * x->m : x->numel;
    for (size_t r = 0, off = 0; r < W; off += x->cnt[r], r++) x->seg[r] = x->rs ? r * x->m : off;
  }
  /* two buffers of the largest kind in flight (an allreduce's bucket, a reduce-scatter's
   * padding to at most twice it) */
  z2->budget = 4 * (cap > first_cap ? cap : first_cap);
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
    z2->pfirst = ddp__calloc(n1, sizeof *z2->pfirst);
    z2->pcount = ddp__calloc(n1, sizeof *z2->pcount);
    z2->ready = ddp__calloc(n1, sizeof *z2->ready);
  }
  if (!z2 || !z2->ord || !z2->pfirst || !z2->pcount || !z2->ready) {
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
  ddp__free(z2->pfirst);
  ddp__free(z2->pcount);
  ddp__free(z2->pc);
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

/* Bucket b's local gradients into its owner segments, then its collective. */
static ddp_status_t launch(ddp__zero2_t *z2, size_t b, ddp_error_t *err) {
  const ddp__zero2_cfg_t *c = &z2->c;
  bucket_t *x = &z2->b[b];
  size_t bytes = (x->bufn ? x->bufn : 1) * z2->esz;
  x->launched = true;
  x->buf = ddp_pg_alloc(c->pg, bytes);
  if (!x->buf) {
    ddp_error_t pe;
    ddp_pg_last_error_copy(c->pg, &pe);
    return ddp__error(err, c->rank, DDP_ERR_NO_MEMORY,
                      "zero: no memory for gradient bucket %zu (%zu bytes): %s", b, bytes, pe.msg);
  }
  z2->inflight += bytes;
  if (x->rs) memset(x->buf, 0, bytes); /* the segments' padding */
  for (size_t k = x->first; k < x->first + x->count; k++) {
    const piece_t *q = &z2->pc[k];
    const ddp_tensor_t *g = c->params[q->param].grad;
    unsigned char *dst = x->buf + (x->seg[c->owner[q->param]] + q->off) * z2->esz;
    if (g->data)
      ddp_grad_arith_pre(c->arith, c->world, c->divide_in_place && z2->reductions > 0, dst,
                         (const unsigned char *)g->data + q->lo * z2->esz, q->len, c->dt);
    else
      memset(dst, 0, q->len * z2->esz);
  }
  ddp_status_t st = x->rs ? ddp_reduce_scatter(c->pg, x->buf, x->buf + x->seg[c->rank] * z2->esz,
                                               x->m, c->dt, DDP_OP_SUM, &x->works[0])
                          : ddp_allreduce(c->pg, x->buf, x->buf, x->numel, c->dt, DDP_OP_SUM,
                                          &x->works[0]);
  if (st != DDP_OK) return pg_fail(z2, st, x->rs ? "reduce_scatter" : "allreduce", b, err);
  x->nworks = 1;
  return DDP_OK;
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
    if (s != DDP_OK && st == DDP_OK)
      st = pg_fail(z2, s, x->rs ? "reduce_scatter" : "allreduce", b, err);
  }
  x->nworks = 0;
  x->done = true;
  z2->inflight -= (x->bufn ? x->bufn : 1) * z2->esz;
  if (st != DDP_OK) {
    ddp_pg_free(c->pg, x->buf);
    x->buf = NULL;
    return st;
  }
  unsigned char *acc = x->buf + x->seg[c->rank] * z2->esz; /* this rank's sums */
  ddp_grad_arith_post(c->arith, c->world, acc, x->cnt[c->rank], c->dt);
  for (size_t k = x->first; k < x->first + x->count && st == DDP_OK; k++) {
    const piece_t *q = &z2->pc[k];
    size_t i = q->param;
    ddp_tensor_t *g = c->params[i].grad;
    if (c->owner[i] != c->rank) {
      if (q->lo + q->len < (size_t)g->numel) continue; /* not its last piece */
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
      memcpy((unsigned char *)g->data + q->lo * z2->esz, acc + q->off * z2->esz, q->len * z2->esz);
  }
  ddp_pg_free(c->pg, x->buf);
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

/* Before launching bucket b: the oldest buckets waited for and completed while the buffers
 * in flight would pass the budget. Every rank launches the same buckets in the same order,
 * so the oldest is issued (or will be) by every rank and the wait ends. */
static ddp_status_t throttle(ddp__zero2_t *z2, size_t b, ddp_error_t *err) {
  const bucket_t *x = &z2->b[b];
  size_t need = (x->bufn ? x->bufn : 1) * z2->esz;
  while (z2->next_done < z2->next_launch && z2->inflight + need > z2->budget)
    DDP_CHECK(finish(z2, z2->next_done++, err));
  return DDP_OK;
}

static void restart(ddp__zero2_t *z2) {
  for (size_t b = 0; b < z2->nb; b++) {
    z2->b[b].pending = z2->b[b].count;
    z2->b[b].launched = z2->b[b].done = false;
  }
  memset(z2->ready, 0, (z2->c.n ? z2->c.n : 1) * sizeof *z2->ready);
  z2->next_launch = z2->next_done = 0;
  z2->inflight = 0;
}

/* The model's gradient-ready hook: parameter p is final for this backward. */
static void grad_ready(void *user, ddp_param_t *p, int fire) {
  ddp__zero2_t *z2 = user;
  (void)fire;
  if (!z2->armed || z2->status != DDP_OK || p->index >= z2->nmodel) return;
  size_t i = z2->index[p->index];
  if (i == SIZE_MAX || z2->ready[i]) return;
  z2->ready[i] = true;
  for (size_t k = z2->pfirst[i]; k < z2->pfirst[i] + z2->pcount[i]; k++)
    z2->b[z2->pc[k].bucket].pending--;
  ddp_status_t st = DDP_OK;
  while (st == DDP_OK && z2->next_launch < z2->nb && z2->b[z2->next_launch].pending == 0) {
    st = poll_done(z2, &z2->err);
    if (st == DDP_OK) st = throttle(z2, z2->next_launch, &z2->err);
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
  while (st == DDP_OK && z2->next_launch < z2->nb) {
    st = throttle(z2, z2->next_launch, err);
    if (st == DDP_OK) st = launch(z2, z2->next_launch++, err);
  }
  /* after a failure the buckets in flight are still waited for, their status dropped */
  for (; z2->next_done < z2->next_launch; z2->next_done++) {
    if (st == DDP_OK) {
      st = finish(z2, z2->next_done, err);
      continue;
    }
    bucket_t *x = &z2->b[z2->next_done];
    for (size_t w = 0; w < x->nworks; w++) (void)ddp_work_wait_free(x->works[w]);
    x->nworks = 0;
    if (x->buf) ddp_pg_free(z2->c.pg, x->buf);
    x->buf = NULL;
  }
  z2->inflight = 0;
  z2->armed = false;
  if (st == DDP_OK) z2->reductions++;
  restart(z2);
  return st;
}
