/* Gradient buckets: the construction-time layout (§2.2), initialize_buckets (one flat
 * communication buffer per bucket, each managed parameter's slot in it) and the one-time
 * rebuild from the recorded ready order with rank 0's layout (§2.3). The layouts come from
 * compute_bucket_assignment_by_size (assign.c). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

void ddp__ddp_free_buckets(ddp_ddp_t *d, ddp__bucket_t *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    ddp__ddp_drain(&b[i].work);
    ddp_comm_work_free(b[i].cwork);
    ddp__free(b[i].gb_params);
    ddp__inv_bucket_free(d, &b[i]);
    ddp_pg_free(d->pg, b[i].buf);
    ddp__free(b[i].vars);
    ddp__free(b[i].offsets);
  }
  ddp__free(b);
}

/* Bucket b of layout a into x: its parameters, their offsets and its zeroed buffer. */
static ddp_status_t fill_bucket(ddp_ddp_t *d, const ddp_bucket_assignment_t *a, size_t b,
                                ddp__bucket_t *x) {
  size_t n = a->offsets[b + 1] - a->offsets[b];
  if (n == 0) return ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT, "Empty bucket specified.");
  x->nvars = n;
  x->vars = ddp__calloc(n, sizeof(size_t));
  x->offsets = ddp__calloc(n, sizeof(size_t));
  x->limit = a->limits[b];
  if (!x->vars || !x->offsets) return ddp__ddp_oom(d);
  x->dtype = d->params[a->indices[a->offsets[b]]]->value.dtype;
  for (size_t k = 0; k < n; k++) {
    size_t i = a->indices[a->offsets[b] + k];
    if (d->params[i]->value.dtype != x->dtype)
      return ddp__ddp_fail(d, DDP_ERR_INVALID_ARGUMENT,
                           "All parameters in a bucket must have the same dtype.");
    x->vars[k] = i;
    x->offsets[k] = x->numel;
    x->numel += (size_t)d->params[i]->value.numel;
  }
  size_t bytes = x->numel * ddp_dtype_size(x->dtype);
  x->buf = ddp_pg_alloc(d->pg, bytes ? bytes : 1);
  if (!x->buf) /* the group records an allocation failure without logging it */
    return ddp__ddp_fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: bucket %zu of %zu bytes: %s",
                         d->rank, b, bytes, ddp__ddp_pg_error(d));
  memset(x->buf, 0, bytes);
  return DDP_OK;
}

/* initialize_buckets: new flat buffers and offsets for the layout. With
 * gradient_as_bucket_view every gradient is copied into its new slot and repointed there,
 * so accumulation (no_sync windows included) carries across a rebuild. */
static ddp_status_t init_buckets(ddp_ddp_t *d, const ddp_bucket_assignment_t *a) {
  ddp__bucket_t *nb = ddp__calloc(a->nbuckets + 1, sizeof *nb);
  if (!nb) return ddp__ddp_oom(d);
  for (size_t b = 0; b < a->nbuckets; b++) {
    ddp_status_t st = fill_bucket(d, a, b, &nb[b]);
    if (st != DDP_OK) {
      ddp__ddp_free_buckets(d, nb, a->nbuckets);
      return st;
    }
  }
  ddp__bucket_t *old = d->buckets;
  size_t nold = d->nbuckets;
  d->buckets = nb;
  d->nbuckets = a->nbuckets;
  for (size_t b = 0; b < a->nbuckets; b++)
    for (size_t k = 0; k < nb[b].nvars; k++) {
      d->param_bucket[nb[b].vars[k]] = b;
      d->param_offset[nb[b].vars[k]] = nb[b].offsets[k];
    }
  if (d->opts.gradient_as_bucket_view)
    for (size_t i = 0; i < d->P; i++) {
      /* A None gradient stays None (PyTorch's initialize_bucket_views). */
      ddp_param_t *p = d->params[i];
      void *slot = ddp__ddp_slot(d, i);
      if (!p->grad.data) continue;
      memcpy(slot, p->grad.data, ddp__ddp_pbytes(p));
      ddp_param_set_grad_data(p, slot);
    }
  ddp__ddp_free_buckets(d, old, nold);
  d->next_bucket = 0;
  return DDP_OK;
}

/* The bucket rule's inputs: each managed parameter's bytes, keyed by its dtype. */
static ddp_status_t param_sizes(ddp_ddp_t *d, size_t **bytes, int **keys) {
  *bytes = ddp__calloc(d->P, sizeof **bytes);
  *keys = ddp__calloc(d->P, sizeof **keys);
  if (!*bytes || !*keys) {
    ddp__free(*bytes);
    ddp__free(*keys);
    *bytes = NULL;
    *keys = NULL;
    return DDP_ERR_NO_MEMORY;
  }
  for (size_t i = 0; i < d->P; i++) {
    (*bytes)[i] = ddp__ddp_pbytes(d->params[i]);
    (*keys)[i] = (int)d->params[i]->value.dtype;
  }
  return DDP_OK;
}

/* a with its buckets in reverse order, into r. */
static ddp_status_t reversed(const ddp_bucket_assignment_t *a, size_t P,
                             ddp_bucket_assignment_t *r) {
  r->nbuckets = a->nbuckets;
  r->offsets = ddp__calloc(a->nbuckets + 1, sizeof(size_t));
  r->indices = ddp__calloc(P + 1, sizeof(size_t));
  r->limits = ddp__calloc(a->nbuckets + 1, sizeof(size_t));
  if (!r->offsets || !r->indices || !r->limits) return DDP_ERR_NO_MEMORY;
  size_t pos = 0;
  for (size_t b = 0; b < a->nbuckets; b++) {
    size_t s = a->nbuckets - 1 - b;
    r->offsets[b] = pos;
    r->limits[b] = a->limits[s];
    for (size_t k = a->offsets[s]; k < a->offsets[s + 1]; k++) r->indices[pos++] = a->indices[k];
  }
  r->offsets[a->nbuckets] = pos;
  return DDP_OK;
}

/* Initial layout (§2.2): registration order, one bucket per dtype unless find_unused is
 * on without static graph, then limits [first, cap] when bucket_cap_mb is unset or the
 * first-bucket size was given, else [cap] (newer PyTorch with an explicit cap); the list
 * is reversed so the last-defined parameters go first. */
ddp_status_t ddp__ddp_init_initial_buckets(ddp_ddp_t *d) {
  const ddp_ddp_options_t *o = &d->opts;
  size_t limits[2];
  size_t nlim;
  if (o->static_graph || !o->find_unused_parameters) {
    limits[0] = SIZE_MAX;
    nlim = 1;
  } else if (o->bucket_cap_mb == DDP_BUCKET_CAP_UNSET || o->first_bucket_bytes >= 0) {
    /* PyTorch's None (and 1.13 always): a small first bucket. */
    limits[0] = d->first_bucket_bytes_cap;
    limits[1] = d->bucket_bytes_cap;
    nlim = 2;
  } else {
    limits[0] = d->bucket_bytes_cap;
    nlim = 1;
  }
  size_t *bytes;
  int *keys;
  if (param_sizes(d, &bytes, &keys) != DDP_OK) return ddp__ddp_oom(d);
  ddp_bucket_assignment_t a = {0}, r = {0};
  ddp_status_t st = ddp_compute_bucket_assignment_by_size(d->P, bytes, keys, NULL, limits, nlim,
                                                          NULL, &a);
  ddp__free(bytes);
  ddp__free(keys);
  if (st == DDP_OK) st = reversed(&a, d->P, &r);
  ddp_bucket_assignment_free(&a);
  if (st != DDP_OK) {
    ddp_bucket_assignment_free(&r);
    return ddp__ddp_oom(d);
  }
  st = init_buckets(d, &r);
  if (st == DDP_OK) ddp__ddp_record_layout(d, &d->initial, &r);
  ddp_bucket_assignment_free(&r);
  return st;
}

bool ddp__ddp_should_rebuild(const ddp_ddp_t *d) {
  return (d->opts.static_graph || !d->opts.find_unused_parameters) && !d->has_rebuilt;
}

/* Rank 0's rebuilt layout, adopted by every rank (two broadcasts: the indices with the
 * bucket count, then the per-bucket sizes), into r. mine is this rank's own layout; rank
 * 0's is checked before use. */
static ddp_status_t adopt_rank0_layout(ddp_ddp_t *d, const ddp_bucket_assignment_t *mine,
                                       ddp_bucket_assignment_t *r) {
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  size_t P = d->P;
  int32_t *v1 = ddp__calloc(P + 1, sizeof *v1);
  int32_t *v2 = ddp__calloc(P + 1, sizeof *v2);
  ddp_work_t *w = NULL;
  if (!v1 || !v2) goto out;
  for (size_t k = 0; k < P; k++) v1[k] = (int32_t)mine->indices[k];
  v1[P] = (int32_t)mine->nbuckets;
  st = ddp_broadcast(d->pg, v1, P + 1, DDP_I32, 0, &w);
  st = st == DDP_OK ? ddp__ddp_wait(d, &w, "broadcast of rebuilt bucket indices")
                    : ddp__ddp_carry(d, st, "DDP broadcast of rebuilt bucket indices: %s",
                                     ddp__ddp_pg_error(d));
  if (st != DDP_OK) goto out;
  size_t nb = (size_t)v1[P];
  if (nb == 0 || nb > P) {
    st = ddp__ddp_fail(d, DDP_ERR_INVALID_DATA, "[rank %d] DDP: rank 0 sent %zu rebuilt buckets",
                       d->rank, nb);
    goto out;
  }
  for (size_t b = 0; b < mine->nbuckets && b < nb; b++)
    v2[b] = (int32_t)(mine->offsets[b + 1] - mine->offsets[b]);
  st = ddp_broadcast(d->pg, v2, nb, DDP_I32, 0, &w);
  st = st == DDP_OK ? ddp__ddp_wait(d, &w, "broadcast of rebuilt bucket sizes")
                    : ddp__ddp_carry(d, st, "DDP broadcast of rebuilt bucket sizes: %s",
                                     ddp__ddp_pg_error(d));
  if (st != DDP_OK) goto out;
  st = DDP_ERR_NO_MEMORY;
  r->nbuckets = nb;
  r->offsets = ddp__calloc(nb + 1, sizeof(size_t));
  r->indices = ddp__calloc(P + 1, sizeof(size_t));
  r->limits = ddp__calloc(nb + 1, sizeof(size_t));
  if (!r->offsets || !r->indices || !r->limits) goto out;
  size_t pos = 0;
  for (size_t b = 0; b < nb; b++) {
    r->offsets[b] = pos;
    pos += (size_t)v2[b];
    r->limits[b] = b == 0 ? d->first_bucket_bytes_cap : d->bucket_bytes_cap;
  }
  r->offsets[nb] = pos;
  if (pos != P) {
    st = ddp__ddp_fail(d, DDP_ERR_INVALID_DATA,
                       "[rank %d] DDP: rank 0's rebuilt layout covers %zu of %zu parameters",
                       d->rank, pos, P);
    goto out;
  }
  for (size_t k = 0; k < P; k++) {
    if (v1[k] < 0 || (size_t)v1[k] >= P) {
      st = ddp__ddp_fail(d, DDP_ERR_INVALID_DATA, "[rank %d] DDP: bad rebuilt index %d", d->rank,
                         v1[k]);
      goto out;
    }
    r->indices[k] = (size_t)v1[k];
  }
  st = DDP_OK;
out:
  if (st == DDP_ERR_NO_MEMORY && d->err.status == DDP_OK) ddp__ddp_oom(d);
  ddp__ddp_drain(&w);
  ddp__free(v1);
  ddp__free(v2);
  return st;
}

static void log_rebuilt(const ddp_ddp_t *d) {
  if (!ddp__log_enabled(DDP_LOG_INFO)) return;
  char lim[512] = "";
  size_t len = 0, nb = d->rebuilt_stats.nb;
  for (size_t b = 0; b < nb && len < sizeof lim; b++)
    len += (size_t)snprintf(lim + len, sizeof lim - len, "%s%" PRId64, b ? ", " : "",
                            d->rebuilt_stats.limits[b]);
  ddp__log(d->rank, DDP_LOG_INFO, "%zu buckets rebuilt with size limits: %s bytes.", nb, lim);
  ddp__log(d->rank, DDP_LOG_INFO, "Reducer buckets have been rebuilt in this iteration.");
}

/* _rebuild_buckets (§2.3): bucket the recorded ready order with [first cap, cap], then
 * adopt rank 0's layout. */
ddp_status_t ddp__ddp_rebuild_buckets(ddp_ddp_t *d) {
  if (!ddp__ddp_should_rebuild(d) || d->nrebuilt == 0) return DDP_OK;
  if (d->opts.static_graph)
    for (size_t i = 0; i < d->P && d->nrebuilt < d->P; i++) {
      bool seen = false;
      for (size_t k = 0; k < d->nrebuilt && !seen; k++) seen = d->rebuilt[k] == i;
      if (!seen) d->rebuilt[d->nrebuilt++] = i;
    }
  if (d->nrebuilt != d->P)
    return ddp__ddp_fail(d, DDP_ERR_INTERNAL,
                         "[rank %d] DDP: bucket rebuild recorded %zu of %zu parameters", d->rank,
                         d->nrebuilt, d->P);
  size_t *bytes;
  int *keys;
  if (param_sizes(d, &bytes, &keys) != DDP_OK) return ddp__ddp_oom(d);
  ddp_bucket_assignment_t a = {0}, r = {0};
  size_t limits[2] = {d->first_bucket_bytes_cap, d->bucket_bytes_cap};
  ddp_status_t st = ddp_compute_bucket_assignment_by_size(d->P, bytes, keys, NULL, limits, 2,
                                                          d->rebuilt, &a);
  ddp__free(bytes);
  ddp__free(keys);
  if (st != DDP_OK) {
    if (st == DDP_ERR_NO_MEMORY) ddp__ddp_oom(d);
  } else {
    st = adopt_rank0_layout(d, &a, &r);
  }
  if (st == DDP_OK) st = init_buckets(d, &r);
  if (st == DDP_OK) {
    ddp__ddp_record_layout(d, &d->rebuilt_stats, &r);
    d->has_rebuilt = true;
    d->nrebuilt = 0;
    log_rebuilt(d);
  }
  ddp_bucket_assignment_free(&a);
  ddp_bucket_assignment_free(&r);
  return st;
}

size_t ddp_ddp_num_buckets(const ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC);
  return d->nbuckets;
}

const size_t *ddp_ddp_bucket_params(const ddp_ddp_t *d, size_t b, size_t *n) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && b < d->nbuckets && n);
  *n = d->buckets[b].nvars;
  return d->buckets[b].vars;
}
