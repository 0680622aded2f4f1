/* world_size_invariant_shards (docs/ddp.md, "World-size-invariant training"): the
 * averaged gradients of a step are the same bits for any world size W and any split of
 * the step's K shards into forward/backward passes.
 *
 * Each rank runs K / W passes per step, one per shard; every pass but the last runs under
 * no_sync. Whenever a parameter's gradient of a pass is ready, the hook moves it into the
 * slot of that shard in its bucket's shard store, noting the largest magnitude of each of
 * its blocks on the way (ddp_rsum_take_*: one pass over a gradient still in cache), which
 * leaves the gradient zero for the next shard; the last shard's gradients stay where
 * backward left them. When a bucket is ready in the synchronising pass, its block
 * exponents are combined over the ranks by an allreduce MAX (exact), launched without
 * waiting; once it is done (seen by a later grad-ready hook, at the next bucket's launch,
 * or at once for the last bucket) every shard is rounded onto the common grid and added
 * into the int64 accumulators (ddp_rsum_deposit_*), and the accumulators are summed over
 * the ranks by an allreduce SUM launched like any bucket's, overlapping the rest of
 * backward. Every rank issues MAX b, SUM b, MAX b + 1, ... in that order. Not waiting for
 * MAX at once keeps the ranks from meeting in the middle of backward, where the slower
 * one's lag would cost the other a wait on top of the one at the end of the step. Integer
 * sums are exact, so neither the grouping of shards into ranks nor the order of the
 * additions shows in the result; finalize turns each accumulator into the mean over the K
 * shards (ddp_rsum_result_*), written by the copy-back straight into each gradient (or
 * its bucket slot with gradient_as_bucket_view) instead of a copy of the flat buffer.
 *
 * Everything the reducer checks still runs: buckets, their order, unused parameters, the
 * unfinished-reduction check; and the shard count: a step must begin exactly K / W
 * passes on every rank before its synchronising backward. A parameter that got no
 * gradient in a shard contributes nothing for it. */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* A bucket's state: the shard store, the block exponents and the accumulators (the last
 * two are communicated, so they come from ddp_pg_alloc). */
typedef struct ddp__inv_bucket {
  void *store;   /* [inv_s - 1][numel] of the bucket's dtype (the last shard stays in the
                  * gradients until the launch) */
  int32_t *exps; /* [nblk] */
  int64_t *acc;  /* [numel] */
  size_t nblk;
  ddp_work_t *exps_work; /* the exponents' allreduce, launched and not yet waited for */
} ddp__inv_bucket_t;

ddp_status_t ddp__inv_init(ddp_ddp_t *d) {
  int64_t K = d->opts.world_size_invariant_shards;
  if (K == 0) return DDP_OK;
  if (K < 0 || K > DDP_RSUM_MAX_TERMS || K % d->world != 0)
    return ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                         "[rank %d] DDP: world_size_invariant_shards must be a multiple of the "
                         "world size %d between 1 and %d (got %lld)",
                         d->rank, d->world, (int)DDP_RSUM_MAX_TERMS, (long long)K);
  d->inv_k = K;
  d->inv_s = (int)(K / d->world);
  d->inv_written = ddp__calloc((size_t)d->inv_s * (d->P ? d->P : 1), sizeof *d->inv_written);
  d->inv_blk = ddp__calloc(d->P ? d->P : 1, sizeof *d->inv_blk);
  if (!d->inv_written || !d->inv_blk) return ddp__ddp_oom(d);
  ddp__log(d->rank, DDP_LOG_INFO,
           "DDP: world_size_invariant_shards %lld: %d shards per rank and step, summed with the "
           "pre-rounded reproducible sum",
           (long long)K, d->inv_s);
  return DDP_OK;
}

void ddp__inv_free(ddp_ddp_t *d) {
  ddp__free(d->inv_written);
  ddp__free(d->inv_blk);
}

void ddp__inv_bucket_free(ddp_ddp_t *d, ddp__bucket_t *x) {
  ddp__inv_bucket_t *v = x->inv;
  if (!v) return;
  ddp__ddp_drain(&v->exps_work);
  ddp__free(v->store);
  if (v->exps) ddp_pg_free(d->pg, v->exps);
  if (v->acc) ddp_pg_free(d->pg, v->acc);
  ddp__free(v);
  x->inv = NULL;
}

/* Bucket x's state, made at its first use (after any rebuild), with its parameters'
 * block offsets. */
static ddp_status_t bucket_state(ddp_ddp_t *d, ddp__bucket_t *x, ddp__inv_bucket_t **out) {
  if (x->inv) {
    *out = x->inv;
    return DDP_OK;
  }
  ddp__inv_bucket_t *v = ddp__calloc(1, sizeof *v);
  if (!v) return ddp__ddp_oom(d);
  x->inv = v;
  for (size_t k = 0; k < x->nvars; k++) {
    size_t i = x->vars[k];
    d->inv_blk[i] = v->nblk;
    v->nblk += ddp_rsum_blocks((size_t)d->params[i]->value.numel);
  }
  size_t esz = ddp_dtype_size(x->dtype), n = x->numel ? x->numel : 1;
  v->store = ddp__calloc((size_t)(d->inv_s > 1 ? d->inv_s - 1 : 1) * n, esz);
  v->exps = ddp_pg_alloc(d->pg, (v->nblk ? v->nblk : 1) * sizeof *v->exps);
  v->acc = ddp_pg_alloc(d->pg, n * sizeof *v->acc);
  if (!v->store || !v->exps || !v->acc) {
    ddp__inv_bucket_free(d, x);
    return ddp__ddp_fail(d, DDP_ERR_NO_MEMORY,
                         "[rank %d] DDP: world_size_invariant_shards: no memory for bucket state "
                         "of %zu shards x %zu elements",
                         d->rank, (size_t)d->inv_s, x->numel);
  }
  memset(v->exps, 0, (v->nblk ? v->nblk : 1) * sizeof *v->exps);
  *out = v;
  return DDP_OK;
}

ddp_status_t ddp__inv_begin_shard(ddp_ddp_t *d) {
  if (d->inv_seen >= d->inv_s)
    return ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                         "[rank %d] DDP: world_size_invariant_shards %lld with %d ranks: a step "
                         "runs %d forward/backward passes (shards) per rank, the last one "
                         "synchronising, but this is pass %d without a synchronising backward",
                         d->rank, (long long)d->inv_k, d->world, d->inv_s, d->inv_seen + 1);
  d->inv_seen++;
  return DDP_OK;
}

ddp_status_t ddp__inv_check_sync(ddp_ddp_t *d) {
  if (d->inv_seen == d->inv_s) return DDP_OK;
  return ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                       "[rank %d] DDP: world_size_invariant_shards %lld with %d ranks: the "
                       "synchronising pass must be the %d-th of its step (one per shard), but "
                       "it is pass %d",
                       d->rank, (long long)d->inv_k, d->world, d->inv_s, d->inv_seen);
}

ddp_status_t ddp__inv_store(ddp_ddp_t *d, size_t i) {
  ddp_param_t *p = d->params[i];
  if (!p->grad.data) return DDP_OK;
  if (d->inv_seen == 0)
    return ddp__ddp_fail(d, DDP_ERR_INVALID_USAGE,
                         "[rank %d] DDP: world_size_invariant_shards: parameter %s received a "
                         "gradient outside a shard (every forward must go through DDP's "
                         "pre_forward)",
                         d->rank, p->name);
  ddp__bucket_t *x = &d->buckets[d->param_bucket[i]];
  ddp__inv_bucket_t *v;
  DDP_CHECK(bucket_state(d, x, &v));
  /* a bucket whose exponents are combined meanwhile is deposited and launched now */
  if (d->inv_pending) DDP_CHECK(ddp__inv_poll(d, false));
  size_t s = (size_t)d->inv_seen - 1, n = (size_t)p->value.numel;
  size_t esz = ddp_dtype_size(x->dtype);
  int32_t *exps = v->exps + d->inv_blk[i];
  if (s + 1 == (size_t)d->inv_s) { /* the last shard stays in the gradient until launch */
    if (x->dtype == DDP_F32)
      ddp_rsum_exps_f32(exps, p->grad.data, n);
    else
      ddp_rsum_exps_f64(exps, p->grad.data, n);
    d->inv_written[s * d->P + i] = true;
    if (d->opts.find_unused_parameters && !d->opts.static_graph) d->local_used[i] = 1;
    return DDP_OK;
  }
  char *slot = (char *)v->store + (s * x->numel + d->param_offset[i]) * esz;
  bool *written = &d->inv_written[s * d->P + i];
  if (!*written) { /* the usual case: one pass moves the gradient and notes its exponents */
    if (x->dtype == DDP_F32)
      ddp_rsum_take_f32(exps, (float *)slot, p->grad.data, n);
    else
      ddp_rsum_take_f64(exps, (double *)slot, p->grad.data, n);
  } else { /* a second gradient in one pass: accumulate, then note the sum's exponents */
    ddp_reduce_acc(x->dtype, DDP_OP_SUM, slot, p->grad.data, n);
    if (x->dtype == DDP_F32)
      ddp_rsum_exps_f32(exps, (const float *)slot, n);
    else
      ddp_rsum_exps_f64(exps, (const double *)slot, n);
    memset(p->grad.data, 0, n * esz);
  }
  *written = true;
  if (d->opts.find_unused_parameters && !d->opts.static_graph) d->local_used[i] = 1;
  return DDP_OK;
}

/* Bucket b's exponents are combined (waits for their allreduce): its shards are deposited
 * and the accumulators' allreduce SUM launched. */
static ddp_status_t complete(ddp_ddp_t *d, size_t b) {
  ddp__bucket_t *x = &d->buckets[b];
  ddp__inv_bucket_t *v = x->inv;
  char what[96];
  snprintf(what, sizeof what, "allreduce of bucket %zu's block exponents", b);
  DDP_CHECK(ddp__ddp_wait(d, &v->exps_work, what));
  size_t esz = ddp_dtype_size(x->dtype);
  const void *srcs[64];
  for (size_t k = 0; k < x->nvars; k++) {
    size_t i = x->vars[k], n = (size_t)d->params[i]->value.numel;
    /* the sources in groups of 64 (one pass over the accumulators per group; the first
     * group's pass writes them, so they are never zeroed first) */
    bool add = false;
    for (int s0 = 0; s0 < d->inv_s; s0 += 64) {
      int ns = 0;
      for (int s = s0; s < d->inv_s && s < s0 + 64; s++)
        if (d->inv_written[(size_t)s * d->P + i])
          srcs[ns++] = s + 1 == d->inv_s
                           ? d->params[i]->grad.data /* the last shard's */
                           : (char *)v->store + ((size_t)s * x->numel + x->offsets[k]) * esz;
      if (ns == 0) continue;
      if (x->dtype == DDP_F32)
        ddp_rsum_deposit_f32(v->acc + x->offsets[k], v->exps + d->inv_blk[i], d->inv_k, add, ns,
                             (const float *const *)srcs, n);
      else
        ddp_rsum_deposit_f64(v->acc + x->offsets[k], v->exps + d->inv_blk[i], d->inv_k, add, ns,
                             (const double *const *)srcs, n);
      add = true;
    }
    if (!add) memset(v->acc + x->offsets[k], 0, n * sizeof *v->acc); /* no gradient at all */
  }
  if (b == 0) d->comm_bytes_step = 0;
  d->comm_bytes_step += (int64_t)(x->numel * sizeof *v->acc + v->nblk * sizeof *v->exps);
  d->comm_numel_total += (int64_t)x->numel;
  ddp__ddp_tag_bucket(d, b); /* the SUM's entry names the bucket too */
  ddp_status_t st = ddp_allreduce(d->pg, v->acc, v->acc, x->numel, DDP_I64, DDP_OP_SUM, &x->work);
  if (st != DDP_OK)
    return ddp__ddp_carry(d, st, "DDP: launching the allreduce of bucket %zu failed: %s", b,
                          ddp__ddp_pg_error(d));
  return DDP_OK;
}

ddp_status_t ddp__inv_poll(ddp_ddp_t *d, bool block) {
  if (d->inv_pending == 0) return DDP_OK;
  ddp__inv_bucket_t *v = d->buckets[d->inv_pending - 1].inv;
  bool done = block;
  if (!block && ddp_work_test(v->exps_work, &done) != DDP_OK) done = true; /* wait reports */
  if (!done) return DDP_OK;
  size_t b = d->inv_pending - 1;
  d->inv_pending = 0;
  return complete(d, b);
}

ddp_status_t ddp__inv_launch(ddp_ddp_t *d, size_t b) {
  DDP_CHECK(ddp__inv_poll(d, true)); /* the previous bucket's SUM goes before this MAX (the
                                      * caller normally did this already) */
  ddp__bucket_t *x = &d->buckets[b];
  ddp__inv_bucket_t *v;
  DDP_CHECK(bucket_state(d, x, &v));
  ddp_status_t st = ddp_allreduce(d->pg, v->exps, v->exps, v->nblk, DDP_I32, DDP_OP_MAX,
                                  &v->exps_work);
  if (st != DDP_OK) {
    return ddp__ddp_carry(d, st,
                          "DDP: world_size_invariant_shards: launching the exponent "
                          "allreduce of bucket %zu failed: %s",
                          b, ddp__ddp_pg_error(d));
  }
  d->inv_pending = b + 1;
  return b + 1 == d->nbuckets ? ddp__inv_poll(d, true) : DDP_OK;
}

void ddp__inv_result(ddp_ddp_t *d, const ddp__bucket_t *x, size_t k, void *out) {
  const ddp__inv_bucket_t *v = x->inv;
  size_t i = x->vars[k], n = (size_t)d->params[i]->value.numel;
  const int32_t *e = v->exps + d->inv_blk[i];
  if (x->dtype == DDP_F32)
    ddp_rsum_result_f32(v->acc + x->offsets[k], e, d->inv_k, n, d->inv_k, out);
  else
    ddp_rsum_result_f64(v->acc + x->offsets[k], e, d->inv_k, n, d->inv_k, out);
}

void ddp__inv_end_step(ddp_ddp_t *d) {
  if (!d->inv_k) return;
  if (d->inv_pending) /* a failed step: its exponents are not used */
    ddp__ddp_drain(&d->buckets[d->inv_pending - 1].inv->exps_work);
  d->inv_pending = 0;
  d->inv_seen = 0;
  memset(d->inv_written, 0, (size_t)d->inv_s * d->P * sizeof *d->inv_written);
  for (size_t b = 0; b < d->nbuckets; b++) {
    ddp__inv_bucket_t *v = d->buckets[b].inv;
    if (v) memset(v->exps, 0, v->nblk * sizeof *v->exps);
  }
}
