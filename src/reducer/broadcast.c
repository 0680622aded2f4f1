/* Coalesced broadcasts from one rank (§1.4): _sync_module_states at construction and at
 * the end of join(), and the buffer broadcast before each synchronised forward (§5).
 *
 * _broadcast_coalesced groups the tensors into chunks of at most bcast_bytes per dtype by
 * the bucket rule (sorted by lowest index), packs each chunk into one communication buffer
 * and broadcasts it from root as one operation. At most two chunks are in flight: the
 * oldest is waited for and unpacked before a third starts. After a failure nothing new
 * starts; what is in flight is drained. */
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

typedef struct tref {
  void *data;
  size_t bytes;
  ddp_dtype_t dtype;
} tref_t;

/* One chunk in flight: its work and its packed buffer. */
typedef struct chunk {
  ddp_work_t *w;
  void *buf;
} chunk_t;

/* Waits for chunk c (in slot s), unpacks it into its tensors and frees its buffer. */
static ddp_status_t retire_chunk(ddp_ddp_t *d, const ddp_bucket_assignment_t *a, const tref_t *t,
                                 chunk_t *s, size_t c, const char *what) {
  char name[96];
  snprintf(name, sizeof name, "broadcast of %s chunk %zu", what, c);
  ddp_status_t ws = ddp__ddp_wait(d, &s->w, name);
  if (ws == DDP_OK) {
    size_t off = 0;
    for (size_t k = a->offsets[c]; k < a->offsets[c + 1]; k++) {
      const tref_t *x = &t[a->indices[k]];
      if (x->bytes) memcpy(x->data, (char *)s->buf + off, x->bytes);
      off += x->bytes;
    }
  }
  ddp_pg_free(d->pg, s->buf);
  s->buf = NULL;
  return ws;
}

/* Packs chunk c (root's data) into a fresh buffer in slot s and starts its broadcast. */
static ddp_status_t start_chunk(ddp_ddp_t *d, const ddp_bucket_assignment_t *a, const tref_t *t,
                                chunk_t *s, size_t c, int root, const char *what) {
  size_t total = 0;
  for (size_t k = a->offsets[c]; k < a->offsets[c + 1]; k++) total += t[a->indices[k]].bytes;
  ddp_dtype_t dt = t[a->indices[a->offsets[c]]].dtype;
  void *buf = ddp_pg_alloc(d->pg, total ? total : 1);
  if (!buf)
    return ddp__ddp_fail(d, DDP_ERR_NO_MEMORY,
                         "[rank %d] DDP: no memory for a %zu-byte %s chunk: %s", d->rank, total,
                         what, ddp__ddp_pg_error(d));
  size_t off = 0;
  for (size_t k = a->offsets[c]; k < a->offsets[c + 1]; k++) {
    const tref_t *x = &t[a->indices[k]];
    if (d->rank == root && x->bytes) memcpy((char *)buf + off, x->data, x->bytes);
    off += x->bytes;
  }
  s->buf = buf;
  ddp_status_t st = ddp_broadcast(d->pg, buf, total / ddp_dtype_size(dt), dt, root, &s->w);
  if (st != DDP_OK)
    ddp__ddp_carry(d, st, "DDP broadcast of %s chunk %zu: %s", what, c, ddp__ddp_pg_error(d));
  return st;
}

static ddp_status_t broadcast_coalesced(ddp_ddp_t *d, const tref_t *t, size_t n, size_t cap,
                                        int root, const char *what) {
  if (n == 0) return DDP_OK;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  size_t *bytes = ddp__calloc(n, sizeof *bytes);
  int *keys = ddp__calloc(n, sizeof *keys);
  ddp_bucket_assignment_t a = {0};
  chunk_t fl[2] = {{0}};
  if (!bytes || !keys) goto out;
  for (size_t i = 0; i < n; i++) {
    bytes[i] = t[i].bytes;
    keys[i] = (int)t[i].dtype;
  }
  size_t lim = cap;
  DDP_CHECK_GOTO(ddp_compute_bucket_assignment_by_size(n, bytes, keys, NULL, &lim, 1, NULL, &a), st,
                 out);
  st = DDP_OK;
  size_t oldest = 0; /* chunks [oldest, c) are in flight, in fl[chunk % 2] */
  for (size_t c = 0; c <= a.nbuckets; c++) {
    /* Retire the oldest when two are in flight (or, at the end, every one left). */
    while (oldest < c && (c - oldest == 2 || c == a.nbuckets)) {
      chunk_t *s = &fl[oldest % 2];
      if (st == DDP_OK) {
        st = retire_chunk(d, &a, t, s, oldest, what);
      } else { /* the failure is recorded: only wait */
        ddp__ddp_drain(&s->w);
        ddp_pg_free(d->pg, s->buf);
        s->buf = NULL;
      }
      oldest++;
    }
    if (c == a.nbuckets) break;
    if (st != DDP_OK) {
      c = a.nbuckets - 1; /* drain what is in flight, start nothing new */
      continue;
    }
    st = start_chunk(d, &a, t, &fl[c % 2], c, root, what);
    if (st != DDP_OK) c = a.nbuckets - 1;
  }
  for (int s2 = 0; s2 < 2; s2++) {
    ddp__ddp_drain(&fl[s2].w);
    if (fl[s2].buf) ddp_pg_free(d->pg, fl[s2].buf);
  }
out:
  if (st == DDP_ERR_NO_MEMORY && d->err.status == DDP_OK) ddp__ddp_oom(d);
  ddp_bucket_assignment_free(&a);
  ddp__free(bytes);
  ddp__free(keys);
  return st;
}

ddp_status_t ddp__ddp_sync_buffers(ddp_ddp_t *d, int root) {
  size_t nb = ddp_model_num_buffers(d->model);
  if (nb == 0) return DDP_OK;
  tref_t *t = ddp__calloc(nb, sizeof *t);
  if (!t) return ddp__ddp_oom(d);
  for (size_t i = 0; i < nb; i++) {
    ddp_buffer_t *b = ddp_model_buffer(d->model, i);
    t[i] = (tref_t){b->value.data, ddp_tensor_nbytes(&b->value), b->value.dtype};
  }
  ddp_status_t st = broadcast_coalesced(d, t, nb, d->bcast_bytes, root, "buffers");
  ddp__free(t);
  return st;
}

ddp_status_t ddp__ddp_sync_module_states(ddp_ddp_t *d, int root) {
  size_t np = ddp_model_num_params(d->model), nb = ddp_model_num_buffers(d->model);
  tref_t *t = ddp__calloc(np + nb + 1, sizeof *t);
  if (!t) return ddp__ddp_oom(d);
  size_t n = 0;
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    t[n++] = (tref_t){p->value.data, ddp__ddp_pbytes(p), p->value.dtype};
  }
  if (d->opts.broadcast_buffers)
    for (size_t i = 0; i < nb; i++) {
      ddp_buffer_t *b = ddp_model_buffer(d->model, i);
      t[n++] = (tref_t){b->value.data, ddp_tensor_nbytes(&b->value), b->value.dtype};
    }
  ddp_status_t st = broadcast_coalesced(d, t, n, d->bcast_bytes, root, "parameters and buffers");
  ddp__free(t);
  return st;
}
