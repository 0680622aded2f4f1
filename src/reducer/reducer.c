/* DistributedDataParallel: construction (shape check, broadcast from rank 0), gradient
 * buckets, the gradient-ready hook, in-order bucket launch overlapped with backward,
 * finalize and copy-back, the one-time rebuild, no_sync, buffer broadcast,
 * find_unused_parameters, static_graph and statistics. The behaviour, numbers and texts
 * follow spec/ddp-semantics.md; section numbers below refer to it. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <unistd.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/reducer.h"
#include "tensor/tensor_internal.h"

#define DDP_MAGIC 0x44445052u /* "DDPR" */
#define ERRBUF 8192

/* One gradient bucket: managed parameters vars[] at element offsets[] of one flat buffer
 * from ddp_pg_alloc (so the shm backend reduces it in place). */
typedef struct bucket {
  ddp_dtype_t dtype;
  size_t nvars;
  size_t *vars;
  size_t *offsets;
  size_t numel;
  size_t limit;
  void *buf;
  size_t pending; /* variables not yet ready in this backward */
  ddp_work_t *work;
  int64_t t_launch;
  /* with a comm hook: what the hook sees and what it returned */
  ddp_grad_bucket_t gb;
  ddp_param_t **gb_params;
  ddp_comm_work_t *cwork;
} bucket_t;

/* One complete ("X") event of the Chrome trace. */
typedef struct trace_ev {
  const char *name;
  int64_t ts, dur; /* ns */
  int tid;         /* 0 compute, 1 communication */
  int64_t bucket;  /* -1 when not a bucket */
  int64_t bytes;
} trace_ev_t;

typedef struct layout_stats {
  size_t nb;
  int64_t *sizes;
  int64_t *limits;
  size_t *offs;
  size_t *idx;
} layout_stats_t;

struct ddp_ddp {
  uint32_t magic;
  ddp_model_t *model;
  ddp_pg_t *pg;
  ddp_ddp_options_t opts;
  int rank, world;
  size_t bucket_bytes_cap, first_bucket_bytes_cap;
  size_t bcast_bytes; /* chunk limit of the coalesced broadcasts */

  size_t P;               /* managed parameters */
  ddp_param_t **params;   /* managed index -> model parameter */
  size_t nmodel;          /* parameters of the model, frozen ones included */
  size_t *mindex;         /* model index -> managed index, SIZE_MAX when frozen */
  size_t *param_bucket;   /* managed index -> bucket */
  size_t *param_offset;   /* managed index -> element offset in its bucket */
  bucket_t *buckets;
  size_t nbuckets;
  size_t next_bucket;

  bool hooks_set; /* the model's grad-ready hooks point here */
  bool has_comm_hook; /* a registered comm hook replaces the allreduce, no pre-divide */
  ddp_comm_hook_t comm_hook;
  char *comm_hook_name;
  int64_t comm_bytes_step; /* payload bytes of the last synced step without a hook */
  int64_t comm_numel_total; /* elements all-reduced so far without a hook */

  /* per backward */
  ddp_ctx_t *ctx;
  bool expect_hooks;
  bool require_finalize;
  bool marked_unused; /* the unused set was marked ready at this backward's first hook */
  bool first_hook_seen;
  bool finalize_queued;
  bool *ready;
  size_t *ready_order;
  size_t nready_order;
  size_t *prev_ready_order;
  size_t nprev_ready_order;
  ddp_status_t hook_status;
  ddp_local_grad_fn local_fn; /* ddp_ddp_set_local_grad_fn; NULL: none */
  void *local_user;

  /* unused parameters */
  bool *unused;          /* from the graph search (dynamic) or iteration 1 (static) */
  size_t *unused_list;
  size_t nunused;
  bool *visited;
  int32_t *local_used;
  int32_t *global_used;  /* ddp_pg_alloc; result of the used-map allreduce */
  ddp_work_t *used_work;
  bool used_waited;
  bool warned_no_unused;
  bool prev_unused_valid;
  bool *prev_unused;
  bool unused_changed;

  /* static graph */
  int *fire_expected;
  int *fire_left;
  bool static_first_done;
  bool in_delayed; /* delayed_all_reduce is marking: it finalizes itself */

  /* sync state (§5, §6) */
  bool require_backward_grad_sync;
  bool require_forward_param_sync;

  /* rebuild (§2.3) */
  bool has_rebuilt;
  size_t *rebuilt;
  size_t nrebuilt;

  /* join() (§9.2) */
  bool join_enabled;
  bool join_divide_initial;
  bool join_throw;
  int32_t *join_count; /* ddp_pg_alloc: the not-joined count of this iteration */
  ddp_work_t *join_work;
  int div_factor;      /* 0 = not fixed yet in this backward */

  /* statistics */
  int64_t num_iterations;
  char dtypes[64];
  layout_stats_t initial, rebuilt_stats;
  int64_t t_fwd_start, t_fwd_end, t_bwd_start, t_bwd_compute_end, t_comm_start, t_comm_end;
  int64_t sum_fwd, sum_bwd, sum_comm, sum_overlap, nsamples;
  int64_t unused_bytes;

  /* timeline */
  char *trace_path;
  trace_ev_t *ev;
  size_t nev, cap_ev;
  int64_t t_pre_forward;

  char err[ERRBUF];
};

static void trace(ddp_ddp_t *d, const char *name, int64_t t0, int64_t t1, int tid, int64_t bucket,
                  int64_t bytes) {
  if (!d->trace_path) return;
  if (d->nev == d->cap_ev) {
    size_t nc = d->cap_ev ? 2 * d->cap_ev : 256;
    trace_ev_t *n = ddp__realloc(d->ev, nc * sizeof *n);
    if (!n) return; /* the timeline is best effort: a full trace loses events */
    d->ev = n;
    d->cap_ev = nc;
  }
  d->ev[d->nev++] = (trace_ev_t){name, t0, t1 - t0, tid, bucket, bytes};
}

/* Appends this rank's events as JSON array elements in one write (O_APPEND), so ranks in
 * different processes never interleave inside an event. The array's closing bracket is
 * optional in the trace format. */
static void write_trace(ddp_ddp_t *d) {
  size_t cap = 256 + d->nev * 200, len = 0;
  char *buf = ddp__malloc(cap);
  if (!buf) return;
  for (size_t i = 0; i < d->nev; i++) {
    const trace_ev_t *e = &d->ev[i];
    char name[48];
    if (e->bucket >= 0) snprintf(name, sizeof name, "%s %" PRId64, e->name, e->bucket);
    else snprintf(name, sizeof name, "%s", e->name);
    len += (size_t)snprintf(buf + len, cap - len,
                            "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"bytes\":%" PRId64 "}},\n",
                            name, d->rank, e->tid, (double)e->ts / 1e3, (double)e->dur / 1e3,
                            e->bytes);
    if (len >= cap) {
      len = cap - 1;
      break;
    }
  }
  int fd = open(d->trace_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    ddp__log(d->rank, DDP_LOG_WARN, "DDP trace: open %s: %s", d->trace_path, strerror(errno));
  } else {
    if (write(fd, buf, len) != (ssize_t)len)
      ddp__log(d->rank, DDP_LOG_WARN, "DDP trace: short write to %s", d->trace_path);
    close(fd);
  }
  ddp__free(buf);
}

/* ---------------------------------------------------------------- helpers --------- */

static ddp_status_t fail(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...)
    DDP_PRINTF(3, 4);
static ddp_status_t fail(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->err, sizeof d->err, fmt, ap);
  va_end(ap);
  ddp__log(d->rank, DDP_LOG_ERROR, "%s", d->err);
  return st;
}

static size_t esz(const ddp_param_t *p) { return ddp_dtype_size(p->value.dtype); }
static size_t pbytes(const ddp_param_t *p) { return (size_t)p->value.numel * esz(p); }

static void copy_err(ddp_error_t *err, const ddp_ddp_t *d, ddp_status_t st) {
  if (!err) return;
  err->status = st;
  size_t n = DDP_MIN(strlen(d->err), sizeof err->msg - 1); /* truncated: the log has it all */
  memcpy(err->msg, d->err, n);
  err->msg[n] = 0;
}

/* Appends ", name" entries for the given managed indices. */
static void append_names(char *buf, size_t cap, ddp_ddp_t *d, const size_t *idx, size_t n,
                         const char *sep) {
  size_t len = strlen(buf);
  for (size_t k = 0; k < n && len + 1 < cap; k++) {
    int w = snprintf(buf + len, cap - len, "%s%s", k ? sep : "", d->params[idx[k]]->name);
    if (w < 0) break;
    len += (size_t)w;
    if (len >= cap) len = cap - 1;
  }
}

static void fmt_shape(char *buf, size_t cap, const int64_t *v, int n) {
  size_t len = 0;
  len += (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < n && len < cap; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%" PRId64, i ? ", " : "", v[i]);
  if (len < cap) snprintf(buf + len, cap - len, "]");
}

static ddp_status_t wait_work(ddp_ddp_t *d, ddp_work_t **w, const char *what) {
  if (!*w) return DDP_OK;
  ddp_status_t st = ddp_work_wait(*w, -1);
  if (st != DDP_OK)
    fail(d, st, "[rank %d] DDP %s failed: %s", d->rank, what,
         ddp_work_error(*w)[0] ? ddp_work_error(*w) : ddp_pg_last_error(d->pg));
  ddp_work_free(*w);
  *w = NULL;
  return st;
}

/* ---------------------------------------------------------------- coalesced bcast - */

typedef struct tref {
  void *data;
  size_t bytes;
  ddp_dtype_t dtype;
} tref_t;

/* _broadcast_coalesced (§1.4): the tensors are grouped into chunks of at most `cap` bytes
 * per dtype by the bucket rule (sorted by lowest index), each chunk is packed into one
 * communication buffer and broadcast from rank 0 as one operation; at most two chunks are
 * in flight, the oldest being waited for and unpacked before a third starts. */
static ddp_status_t broadcast_coalesced(ddp_ddp_t *d, const tref_t *t, size_t n, size_t cap,
                                        int root, const char *what) {
  if (n == 0) return DDP_OK;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  size_t *bytes = ddp__calloc(n, sizeof *bytes);
  int *keys = ddp__calloc(n, sizeof *keys);
  ddp_bucket_assignment_t a = {0};
  struct {
    ddp_work_t *w;
    void *buf;
    size_t chunk;
  } fl[2] = {{0}};
  if (!bytes || !keys) goto out;
  for (size_t i = 0; i < n; i++) {
    bytes[i] = t[i].bytes;
    keys[i] = (int)t[i].dtype;
  }
  size_t lim = cap;
  DDP_CHECK_GOTO(ddp_compute_bucket_assignment_by_size(n, bytes, keys, NULL, &lim, 1, NULL, &a),
                 st, out);
  st = DDP_OK;
  size_t oldest = 0; /* chunks [oldest, c) are in flight, in fl[chunk % 2] */
  for (size_t c = 0; c <= a.nbuckets; c++) {
    /* Retire the oldest when two are in flight (or, at the end, every one left). */
    while (oldest < c && (c - oldest == 2 || c == a.nbuckets)) {
      int slot = (int)(oldest % 2);
      char name[96];
      snprintf(name, sizeof name, "broadcast of %s chunk %zu", what, oldest);
      ddp_status_t ws = wait_work(d, &fl[slot].w, name);
      if (ws == DDP_OK && st == DDP_OK) {
        size_t off = 0;
        for (size_t k = a.offsets[oldest]; k < a.offsets[oldest + 1]; k++) {
          const tref_t *x = &t[a.indices[k]];
          if (x->bytes) memcpy(x->data, (char *)fl[slot].buf + off, x->bytes);
          off += x->bytes;
        }
      }
      if (st == DDP_OK) st = ws;
      ddp_pg_free(d->pg, fl[slot].buf);
      fl[slot].buf = NULL;
      oldest++;
    }
    if (c == a.nbuckets) break;
    if (st != DDP_OK) {
      c = a.nbuckets - 1; /* drain what is in flight, start nothing new */
      continue;
    }
    int slot = (int)(c % 2);
    size_t total = 0;
    for (size_t k = a.offsets[c]; k < a.offsets[c + 1]; k++) total += t[a.indices[k]].bytes;
    ddp_dtype_t dt = t[a.indices[a.offsets[c]]].dtype;
    void *buf = ddp_pg_alloc(d->pg, total ? total : 1);
    if (!buf) {
      st = fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: no memory for a %zu-byte %s chunk: %s",
                d->rank, total, what, ddp_pg_last_error(d->pg));
      c = a.nbuckets - 1;
      continue;
    }
    size_t off = 0;
    for (size_t k = a.offsets[c]; k < a.offsets[c + 1]; k++) {
      const tref_t *x = &t[a.indices[k]];
      if (d->rank == root && x->bytes) memcpy((char *)buf + off, x->data, x->bytes);
      off += x->bytes;
    }
    fl[slot].buf = buf;
    fl[slot].chunk = c;
    st = ddp_broadcast(d->pg, buf, total / ddp_dtype_size(dt), dt, root, &fl[slot].w);
    if (st != DDP_OK) {
      fail(d, st, "[rank %d] DDP broadcast of %s chunk %zu: %s", d->rank, what, c,
           ddp_pg_last_error(d->pg));
      c = a.nbuckets - 1;
    }
  }
  for (int s2 = 0; s2 < 2; s2++) {
    if (fl[s2].w) {
      ddp_work_wait(fl[s2].w, -1);
      ddp_work_free(fl[s2].w);
    }
    if (fl[s2].buf) ddp_pg_free(d->pg, fl[s2].buf);
  }
out:
  if (st == DDP_ERR_NO_MEMORY && !d->err[0]) fail(d, st, "[rank %d] DDP: out of memory", d->rank);
  ddp_bucket_assignment_free(&a);
  ddp__free(bytes);
  ddp__free(keys);
  return st;
}

static ddp_status_t sync_buffers(ddp_ddp_t *d, int root) {
  size_t nb = ddp_model_num_buffers(d->model);
  if (nb == 0) return DDP_OK;
  tref_t *t = ddp__calloc(nb, sizeof *t);
  if (!t) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  for (size_t i = 0; i < nb; i++) {
    ddp_buffer_t *b = ddp_model_buffer(d->model, i);
    t[i] = (tref_t){b->value.data, ddp_tensor_nbytes(&b->value), b->value.dtype};
  }
  ddp_status_t st = broadcast_coalesced(d, t, nb, d->bcast_bytes, root, "buffers");
  ddp__free(t);
  return st;
}

/* ---------------------------------------------------------------- buckets --------- */

static void free_buckets(ddp_ddp_t *d, bucket_t *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (b[i].work) {
      ddp_work_wait(b[i].work, -1);
      ddp_work_free(b[i].work);
    }
    ddp_comm_work_free(b[i].cwork);
    ddp__free(b[i].gb_params);
    ddp_pg_free(d->pg, b[i].buf);
    ddp__free(b[i].vars);
    ddp__free(b[i].offsets);
  }
  ddp__free(b);
}

static void *slot_of(ddp_ddp_t *d, size_t i) {
  bucket_t *b = &d->buckets[d->param_bucket[i]];
  return (char *)b->buf + d->param_offset[i] * ddp_dtype_size(b->dtype);
}

static void record_layout(ddp_ddp_t *d, layout_stats_t *ls, const ddp_bucket_assignment_t *a) {
  ddp__free(ls->sizes);
  ddp__free(ls->limits);
  ddp__free(ls->offs);
  ddp__free(ls->idx);
  ls->nb = a->nbuckets;
  ls->sizes = ddp__calloc(a->nbuckets + 1, sizeof(int64_t));
  ls->limits = ddp__calloc(a->nbuckets + 1, sizeof(int64_t));
  ls->offs = ddp__calloc(a->nbuckets + 1, sizeof(size_t));
  ls->idx = ddp__calloc(a->offsets[a->nbuckets] + 1, sizeof(size_t));
  if (!ls->sizes || !ls->limits || !ls->offs || !ls->idx) {
    ls->nb = 0;
    return;
  }
  for (size_t b = 0; b < a->nbuckets; b++) {
    int64_t s = 0;
    for (size_t k = a->offsets[b]; k < a->offsets[b + 1]; k++)
      s += (int64_t)pbytes(d->params[a->indices[k]]);
    ls->sizes[b] = s;
    ls->limits[b] = a->limits[b] == SIZE_MAX ? INT64_MAX : (int64_t)a->limits[b];
    ls->offs[b] = a->offsets[b];
  }
  ls->offs[a->nbuckets] = a->offsets[a->nbuckets];
  memcpy(ls->idx, a->indices, a->offsets[a->nbuckets] * sizeof(size_t));
}

/* initialize_buckets: new flat buffers and offsets for the layout. With
 * gradient_as_bucket_view every gradient is copied into its new slot and repointed there,
 * so accumulation (no_sync windows included) carries across a rebuild. */
static ddp_status_t init_buckets(ddp_ddp_t *d, const ddp_bucket_assignment_t *a) {
  bucket_t *nb = ddp__calloc(a->nbuckets + 1, sizeof *nb);
  if (!nb) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  for (size_t b = 0; b < a->nbuckets; b++) {
    bucket_t *x = &nb[b];
    size_t n = a->offsets[b + 1] - a->offsets[b];
    if (n == 0) {
      free_buckets(d, nb, a->nbuckets);
      return fail(d, DDP_ERR_INVALID_ARGUMENT, "Empty bucket specified.");
    }
    x->nvars = n;
    x->vars = ddp__calloc(n, sizeof(size_t));
    x->offsets = ddp__calloc(n, sizeof(size_t));
    x->limit = a->limits[b];
    if (!x->vars || !x->offsets) {
      free_buckets(d, nb, a->nbuckets);
      return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
    }
    x->dtype = d->params[a->indices[a->offsets[b]]]->value.dtype;
    for (size_t k = 0; k < n; k++) {
      size_t i = a->indices[a->offsets[b] + k];
      if (d->params[i]->value.dtype != x->dtype) {
        free_buckets(d, nb, a->nbuckets);
        return fail(d, DDP_ERR_INVALID_ARGUMENT,
                    "All parameters in a bucket must have the same dtype.");
      }
      x->vars[k] = i;
      x->offsets[k] = x->numel;
      x->numel += (size_t)d->params[i]->value.numel;
    }
    size_t bytes = x->numel * ddp_dtype_size(x->dtype);
    x->buf = ddp_pg_alloc(d->pg, bytes ? bytes : 1);
    if (!x->buf) {
      free_buckets(d, nb, a->nbuckets);
      return fail(d, DDP_ERR_NO_MEMORY,
                  "[rank %d] DDP: bucket %zu of %zu bytes: %s", d->rank, b, bytes,
                  ddp_pg_last_error(d->pg));
    }
    memset(x->buf, 0, bytes);
  }
  bucket_t *old = d->buckets;
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
      void *slot = slot_of(d, i);
      if (!p->grad.data) continue;
      memcpy(slot, p->grad.data, pbytes(p));
      ddp_param_set_grad_data(p, slot);
    }
  free_buckets(d, old, nold);
  d->next_bucket = 0;
  return DDP_OK;
}

/* ---------------------------------------------------------------- backward -------- */

static void stats_sample_end(ddp_ddp_t *d);
static ddp_status_t sync_module_states(ddp_ddp_t *d, int root);

static ddp_status_t run_comm_hook(ddp_ddp_t *d, size_t b);

/* Launching means one allreduce SUM of the whole flat buffer (no comm hook: the copy-in
 * already multiplied by 1/W), or a call of the registered comm hook. Buckets go strictly in index order (§3.5): a ready bucket
 * waits for every lower-indexed one. */
static ddp_status_t launch_ready(ddp_ddp_t *d) {
  while (d->next_bucket < d->nbuckets && d->buckets[d->next_bucket].pending == 0) {
    bucket_t *b = &d->buckets[d->next_bucket];
    if (d->t_comm_start == 0) d->t_comm_start = ddp_now_ns();
    b->t_launch = ddp_now_ns();
    if (ddp_pg_flight_recorder_enabled(d->pg)) { /* its entry names the bucket's parameters */
      char names[512] = "";
      append_names(names, sizeof names, d, b->vars, b->nvars, ",");
      ddp_pg_set_next_collective_tag(d->pg, (int64_t)d->next_bucket, names);
    }
    if (d->has_comm_hook) {
      DDP_CHECK(run_comm_hook(d, d->next_bucket));
      d->next_bucket++;
      continue;
    }
    if (d->next_bucket == 0) d->comm_bytes_step = 0;
    d->comm_bytes_step += (int64_t)(b->numel * ddp_dtype_size(b->dtype));
    d->comm_numel_total += (int64_t)b->numel;
    ddp_status_t st = ddp_allreduce(d->pg, b->buf, b->buf, b->numel, b->dtype, DDP_OP_SUM, &b->work);
    if (st != DDP_OK)
      return fail(d, st, "[rank %d] DDP: launching the allreduce of bucket %zu failed: %s",
                  d->rank, d->next_bucket, ddp_pg_last_error(d->pg));
    d->next_bucket++;
  }
  return DDP_OK;
}

static ddp_status_t resolve_comm_hook(ddp_ddp_t *d, size_t b, bool report);
static ddp_status_t finalize_backward(ddp_ddp_t *d);
static ddp_status_t finalize_cb(void *user) { return finalize_backward(user); }

static ddp_status_t marked_twice(ddp_ddp_t *d, size_t i) {
  char buf[ERRBUF];
  snprintf(buf, sizeof buf,
           "Expected to mark a variable ready only once. This error is caused by one of the "
           "following reasons: 1) Use of a module parameter outside the `forward` function. "
           "Please make sure model parameters are not shared across multiple concurrent "
           "forward-backward passes. or try to use _set_static_graph() as a workaround if "
           "this module graph does not change during training loop.2) Reused parameters in "
           "multiple reentrant backward passes. For example, if you use multiple `checkpoint` "
           "functions to wrap the same part of your model, it would result in the same set of "
           "parameters been used by different reentrant backward passes multiple times, and "
           "hence marking a variable ready multiple times. DDP does not support such use "
           "cases in default. You can try to use _set_static_graph() as a workaround if your "
           "module graph does not change over iterations.");
  size_t len = strlen(buf);
  if (d->marked_unused)
    len += (size_t)snprintf(
        buf + len, sizeof buf - len,
        "\n3) Incorrect unused parameter detection. The return value of the `forward` "
        "function is inspected by the distributed data parallel wrapper to figure out if any "
        "of the module's parameters went unused. For unused parameters, DDP would not expect "
        "gradients from then. However, if an unused parameter becomes part of the autograd "
        "graph at a later point in time (e.g., in a reentrant backward when using "
        "`checkpoint`), the gradient will show up unexpectedly. If all parameters in the "
        "model participate in the backward pass, you can disable unused parameter detection "
        "by passing the keyword argument `find_unused_parameters=False` to "
        "`torch.nn.parallel.DistributedDataParallel`. If unused parameters in the model do "
        "not change over iterations, You can try to use _set_static_graph() as a workaround "
        "if this module graph does not change over iterations.");
  snprintf(buf + DDP_MIN(len, sizeof buf - 1), sizeof buf - DDP_MIN(len, sizeof buf - 1),
           "\nParameter at index %zu with name %s has been marked as ready twice. This means "
           "that multiple autograd engine  hooks have fired for this particular parameter "
           "during this iteration. (rank %d)",
           i, d->params[i]->name, d->rank);
  return fail(d, DDP_ERR_INVALID_USAGE, "%s", buf);
}

/* mark_variable_ready (§3.4): copy grad * fl(1/W) into the slot (or divide in place when the
 * grad already is the slot), count the bucket down, launch what is ready, and once the last
 * bucket is launched start the used-map allreduce and queue the finalize. */
static ddp_status_t mark_ready(ddp_ddp_t *d, size_t i) {
  if (d->ready[i]) return marked_twice(d, i);
  if (d->div_factor == 0) {
    /* Fixed once per backward: W, or under join() with divide_by_initial_world_size=false
     * the number of ranks not yet joined, from this iteration's forward allreduce. */
    d->div_factor = d->world;
    if (d->join_work) {
      ddp_status_t st = wait_work(d, &d->join_work, "join: allreduce of the not-joined count");
      if (st != DDP_OK) return st;
      if (!d->join_divide_initial && d->join_count[0] > 0) d->div_factor = d->join_count[0];
    }
  }
  d->ready[i] = true;
  d->require_finalize = true;
  ddp_param_t *p = d->params[i];
  if (d->local_fn) d->local_fn(d->local_user, p);
  void *slot = slot_of(d, i);
  size_t n = (size_t)p->value.numel;
  if (!p->grad.data) {
    memset(slot, 0, pbytes(p));
  } else if (d->has_comm_hook) {
    /* The hook divides (spec §7.1): the bucket holds the undivided local gradients. */
    if (p->grad.data != slot) memcpy(slot, p->grad.data, pbytes(p));
    if (d->opts.gradient_as_bucket_view) ddp_param_set_grad_data(p, slot);
  } else if (p->grad.data == slot) {
    /* Bucket-view path: upstream divides in place (true division). */
    if (p->value.dtype == DDP_F32) {
      float *s = slot;
      for (size_t k = 0; k < n; k++) s[k] /= (float)d->div_factor;
    } else {
      double *s = slot;
      for (size_t k = 0; k < n; k++) s[k] /= (double)d->div_factor;
    }
  } else {
    /* One multiply by the reciprocal, computed in double and rounded to the dtype. */
    if (p->value.dtype == DDP_F32) {
      float r = (float)(1.0 / d->div_factor);
      float *s = slot;
      const float *g = p->grad.data;
      for (size_t k = 0; k < n; k++) s[k] = g[k] * r;
    } else {
      double r = 1.0 / d->div_factor;
      double *s = slot;
      const double *g = p->grad.data;
      for (size_t k = 0; k < n; k++) s[k] = g[k] * r;
    }
    if (d->opts.gradient_as_bucket_view) ddp_param_set_grad_data(p, slot);
  }
  bucket_t *b = &d->buckets[d->param_bucket[i]];
  b->pending--;
  DDP_CHECK(launch_ready(d));
  if (d->next_bucket == d->nbuckets && !d->finalize_queued) {
    bool dynamic_unused = d->opts.find_unused_parameters && !d->opts.static_graph;
    if (dynamic_unused) {
      d->used_waited = false;
      ddp_status_t st = ddp_allreduce(d->pg, d->local_used, d->global_used, d->P, DDP_I32,
                                      DDP_OP_SUM, &d->used_work);
      if (st != DDP_OK)
        return fail(d, st, "[rank %d] DDP: launching the used-parameter allreduce failed: %s",
                    d->rank, ddp_pg_last_error(d->pg));
    }
    d->finalize_queued = true;
    if (!d->in_delayed) {
      ddp_status_t st = ddp_ctx_queue_callback(d->ctx, finalize_cb, d);
      if (st != DDP_OK) return fail(d, st, "[rank %d] DDP: %s", d->rank, ddp_ctx_last_error(d->ctx)->msg);
    }
  }
  return DDP_OK;
}

static void mark_unused_ready(ddp_ddp_t *d) {
  if (d->marked_unused) return;
  d->marked_unused = true;
  for (size_t k = 0; k < d->nunused && d->hook_status == DDP_OK; k++)
    d->hook_status = mark_ready(d, d->unused_list[k]);
}

static bool should_rebuild(const ddp_ddp_t *d) {
  return (d->opts.static_graph || !d->opts.find_unused_parameters) && !d->has_rebuilt;
}

/* Finalize (§3.6): wait for every bucket in order and copy the averages back. A
 * parameter unused on every rank keeps its gradient untouched. */
static ddp_status_t finalize_backward(ddp_ddp_t *d) {
  d->t_bwd_compute_end = ddp_now_ns();
  d->expect_hooks = false;
  d->require_finalize = false;
  d->div_factor = 0;
  ddp_status_t first = DDP_OK;
  bool need_used = d->opts.find_unused_parameters || d->opts.static_graph;
  for (size_t b = 0; b < d->nbuckets; b++) {
    bucket_t *x = &d->buckets[b];
    bool hooked = x->cwork != NULL;
    ddp_status_t st = hooked    ? resolve_comm_hook(d, b, first == DDP_OK)
                      : x->work ? ddp_work_wait(x->work, -1)
                                : DDP_ERR_INTERNAL;
    if (hooked && st != DDP_OK && first == DDP_OK) first = st; /* message already set */
    trace(d, "allreduce bucket", x->t_launch, ddp_now_ns(), 1, (int64_t)b,
          (int64_t)(x->numel * ddp_dtype_size(x->dtype)));
    if (st != DDP_OK && first == DDP_OK) {
      char names[2048] = "";
      append_names(names, sizeof names, d, x->vars, x->nvars, ", ");
      fail(d, st,
           "[rank %d] DDP: allreduce of bucket %zu (%zu parameters: %s) failed: %s. If a "
           "rank's loss did not use one of these parameters, that rank never launches this "
           "bucket: its next forward names the parameter; find_unused_parameters=True "
           "handles it.",
           d->rank, b, x->nvars, names,
           x->work ? (ddp_work_error(x->work)[0] ? ddp_work_error(x->work)
                                                 : ddp_pg_last_error(d->pg))
                   : "not launched");
      first = st;
    }
    if (x->work) ddp_work_free(x->work);
    x->work = NULL;
    if (first != DDP_OK) continue;
    for (size_t k = 0; k < x->nvars; k++) {
      size_t i = x->vars[k];
      ddp_param_t *p = d->params[i];
      if (need_used && !d->local_used[i]) {
        if (!d->used_waited && d->used_work) {
          st = wait_work(d, &d->used_work, "allreduce of the used-parameter map");
          if (st != DDP_OK) {
            first = st;
            break;
          }
          d->used_waited = true;
        }
        if (d->global_used[i] == 0) continue;
      }
      void *slot = (char *)x->buf + x->offsets[k] * ddp_dtype_size(x->dtype);
      if (!d->opts.gradient_as_bucket_view) {
        if (!p->grad.data) ddp_param_set_grad_data(p, NULL);
        memcpy(p->grad.data, slot, pbytes(p));
      } else if (p->grad.data != slot) {
        if (!p->grad.data) {
          ddp_param_set_grad_data(p, slot);
        } else if (first == DDP_OK) {
          first = fail(d, DDP_ERR_INVALID_USAGE,
                       "Detected at least one parameter gradient is not the expected DDP "
                       "bucket view with gradient_as_bucket_view=True. This may happen (for "
                       "example) if multiple allreduce hooks were registered onto the same "
                       "parameter. If you hit this error, please file an issue with a minimal "
                       "repro. (parameter %zu, %s, rank %d)",
                       i, p->name, d->rank);
        }
      }
    }
  }
  if (d->used_work) {
    ddp_status_t st = wait_work(d, &d->used_work, "allreduce of the used-parameter map");
    if (first == DDP_OK) first = st;
    d->used_waited = true;
  }
  if (d->opts.find_unused_parameters && !d->opts.static_graph)
    memset(d->local_used, 0, d->P * sizeof *d->local_used);
  d->t_comm_end = ddp_now_ns();
  memcpy(d->prev_ready_order, d->ready_order, d->nready_order * sizeof(size_t));
  d->nprev_ready_order = d->nready_order;
  trace(d, "finalize", d->t_bwd_compute_end, d->t_comm_end, 0, -1, 0);
  if (first == DDP_OK) stats_sample_end(d);
  return first;
}

/* static_graph, backward 1 (§4.6): runs at the end of backward. The used map is reduced,
 * parameters that never fired become the unused set, then every parameter is marked ready
 * in index order (launching buckets as they fill) and the backward is finalized. */
static ddp_status_t delayed_all_reduce(void *user) {
  ddp_ddp_t *d = user;
  if (d->hook_status != DDP_OK) return d->hook_status;
  d->used_waited = false;
  ddp_status_t st = ddp_allreduce(d->pg, d->local_used, d->global_used, d->P, DDP_I32, DDP_OP_SUM,
                                  &d->used_work);
  if (st == DDP_OK) st = wait_work(d, &d->used_work, "allreduce of the used-parameter map");
  else
    fail(d, st, "[rank %d] DDP: used-parameter allreduce: %s", d->rank, ddp_pg_last_error(d->pg));
  if (st != DDP_OK) return st;
  d->used_waited = true;
  d->nunused = 0;
  d->unused_bytes = 0;
  for (size_t i = 0; i < d->P; i++) {
    d->unused[i] = d->fire_expected[i] == 0;
    if (d->unused[i]) {
      d->unused_list[d->nunused++] = i;
      d->unused_bytes += (int64_t)pbytes(d->params[i]);
      ddp__log(d->rank, DDP_LOG_INFO, "DDP static_graph: parameter %s (index %zu) is unused",
               d->params[i]->name, i);
    }
  }
  d->static_first_done = true;
  d->marked_unused = true;
  d->in_delayed = true;
  for (size_t i = 0; i < d->P && st == DDP_OK; i++) st = mark_ready(d, i);
  d->in_delayed = false;
  if (st != DDP_OK) return st;
  return finalize_backward(d);
}

/* The gradient-ready hook (§3.3). It cannot return a status: the first error is kept and
 * reported by ddp_ddp_backward (and by the next forward). */
static void grad_hook(void *user, ddp_param_t *p, int fire) {
  ddp_ddp_t *d = user;
  (void)fire;
  if (d->hook_status != DDP_OK) return;
  size_t i = p->index < d->nmodel ? d->mindex[p->index] : SIZE_MAX;
  if (i == SIZE_MAX) return;
  bool static_first = d->opts.static_graph && !d->static_first_done;
  if ((d->opts.find_unused_parameters && !d->opts.static_graph) || static_first)
    if (p->grad.data) d->local_used[i] = 1;
  if (static_first) {
    if (!d->expect_hooks) return;
    if (!d->first_hook_seen) {
      d->first_hook_seen = true;
      ddp_status_t st = ddp_ctx_queue_callback(d->ctx, delayed_all_reduce, d);
      if (st != DDP_OK) d->hook_status = fail(d, st, "[rank %d] DDP: %s", d->rank,
                                              ddp_ctx_last_error(d->ctx)->msg);
    }
    d->fire_expected[i]++;
    return;
  }
  if (!d->expect_hooks) return;
  if (!d->first_hook_seen) d->first_hook_seen = true;
  d->ready_order[d->nready_order < d->P ? d->nready_order++ : d->P - 1] = i;
  mark_unused_ready(d);
  if (d->hook_status != DDP_OK) return;
  if (d->opts.static_graph) {
    if (d->fire_left[i] == 0) {
      d->hook_status = fail(d, DDP_ERR_INVALID_USAGE,
                            "Your training graph has changed in this iteration, e.g., one "
                            "parameter is unused in first iteration, but then got used in the "
                            "second iteration. this is not compatible with static_graph set to "
                            "True. (parameter %zu, %s, rank %d)",
                            i, d->params[i]->name, d->rank);
      return;
    }
    if (--d->fire_left[i] > 0) return;
  }
  if (should_rebuild(d) && d->nrebuilt < d->P) d->rebuilt[d->nrebuilt++] = i;
  d->hook_status = mark_ready(d, i);
}

/* ---------------------------------------------------------------- forward --------- */

static ddp_status_t ensure_prior_reduction_finished(ddp_ddp_t *d) {
  if (!d->require_finalize) return DDP_OK;
  size_t *idx = ddp__calloc(d->P + 1, sizeof *idx);
  size_t n = 0;
  if (!idx) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  for (size_t i = 0; i < d->P; i++)
    if (!d->ready[i]) idx[n++] = i;
  char *buf = ddp__malloc(ERRBUF);
  if (!buf) {
    ddp__free(idx);
    return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  }
  size_t len;
  if (d->opts.static_graph) {
    len = (size_t)snprintf(buf, ERRBUF,
                           "Expected to have finished reduction in the prior iteration before "
                           "starting a new one. This error indicates that your training graph "
                           "has changed in this iteration, e.g., one parameter is used in first "
                           "iteration, but then got unused in the second iteration. this is not "
                           "compatible with static_graph set to True.");
  } else {
    len = (size_t)snprintf(
        buf, ERRBUF,
        "Expected to have finished reduction in the prior iteration before starting a new "
        "one. This error indicates that your module has parameters that were not used in "
        "producing loss. %s\nIf you already have done the above, then the distributed data "
        "parallel module wasn't able to locate the output tensors in the return value of your "
        "module's `forward` function. Please include the loss function and the structure of "
        "the return value of `forward` of your module when reporting this issue (e.g. list, "
        "dict, iterable).",
        d->opts.find_unused_parameters
            ? "Since `find_unused_parameters=True` is enabled, this likely  means that not all "
              "`forward` outputs participate in computing loss. You can fix this by making "
              "sure all `forward` function outputs participate in calculating loss. "
            : "You can enable unused parameter detection by passing the keyword argument "
              "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, "
              "and by \nmaking sure all `forward` function outputs participate in calculating "
              "loss. ");
  }
  len += (size_t)snprintf(buf + len, ERRBUF - DDP_MIN(len, ERRBUF),
                          "\nParameter indices which did not receive grad for rank %d:", d->rank);
  for (size_t k = 0; k < n && len < ERRBUF; k++)
    len += (size_t)snprintf(buf + len, ERRBUF - len, " %zu", idx[k]);
  if (len < ERRBUF)
    len += (size_t)snprintf(buf + len, ERRBUF - len,
                            "\nParameters which did not receive grad for rank %d: ", d->rank);
  if (len < ERRBUF) append_names(buf, ERRBUF, d, idx, n, ", ");
  for (size_t k = 0; k < n; k++)
    ddp__log(d->rank, DDP_LOG_INFO, "Parameter %s (index %zu) did not get gradient in backwards pass.",
             d->params[idx[k]]->name, idx[k]);
  ddp_status_t st = fail(d, DDP_ERR_INVALID_USAGE, "%s", buf);
  ddp__free(buf);
  ddp__free(idx);
  return st;
}

/* _rebuild_buckets (§2.3): bucket the recorded ready order with [first cap, cap], then
 * adopt rank 0's layout (two broadcasts: indices + count, then per-bucket sizes). */
static ddp_status_t rebuild_buckets(ddp_ddp_t *d) {
  if (!should_rebuild(d) || d->nrebuilt == 0) return DDP_OK;
  if (d->opts.static_graph)
    for (size_t i = 0; i < d->P && d->nrebuilt < d->P; i++) {
      bool seen = false;
      for (size_t k = 0; k < d->nrebuilt && !seen; k++) seen = d->rebuilt[k] == i;
      if (!seen) d->rebuilt[d->nrebuilt++] = i;
    }
  if (d->nrebuilt != d->P)
    return fail(d, DDP_ERR_INTERNAL,
                "[rank %d] DDP: bucket rebuild recorded %zu of %zu parameters", d->rank,
                d->nrebuilt, d->P);
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  size_t *bytes = ddp__calloc(d->P, sizeof *bytes);
  int *keys = ddp__calloc(d->P, sizeof *keys);
  int32_t *v1 = ddp__calloc(d->P + 1, sizeof *v1);
  int32_t *v2 = ddp__calloc(d->P + 1, sizeof *v2);
  ddp_bucket_assignment_t a = {0}, r = {0};
  ddp_work_t *w = NULL;
  if (!bytes || !keys || !v1 || !v2) goto out;
  for (size_t i = 0; i < d->P; i++) {
    bytes[i] = pbytes(d->params[i]);
    keys[i] = (int)d->params[i]->value.dtype;
  }
  size_t limits[2] = {d->first_bucket_bytes_cap, d->bucket_bytes_cap};
  DDP_CHECK_GOTO(ddp_compute_bucket_assignment_by_size(d->P, bytes, keys, NULL, limits, 2,
                                                       d->rebuilt, &a),
                 st, out);
  for (size_t k = 0; k < d->P; k++) v1[k] = (int32_t)a.indices[k];
  v1[d->P] = (int32_t)a.nbuckets;
  st = ddp_broadcast(d->pg, v1, d->P + 1, DDP_I32, 0, &w);
  if (st == DDP_OK) st = wait_work(d, &w, "broadcast of rebuilt bucket indices");
  if (st != DDP_OK) goto out;
  size_t nb = (size_t)v1[d->P];
  if (nb == 0 || nb > d->P) {
    st = fail(d, DDP_ERR_INVALID_DATA, "[rank %d] DDP: rank 0 sent %zu rebuilt buckets",
              d->rank, nb);
    goto out;
  }
  for (size_t b = 0; b < a.nbuckets && b < nb; b++)
    v2[b] = (int32_t)(a.offsets[b + 1] - a.offsets[b]);
  st = ddp_broadcast(d->pg, v2, nb, DDP_I32, 0, &w);
  if (st == DDP_OK) st = wait_work(d, &w, "broadcast of rebuilt bucket sizes");
  if (st != DDP_OK) goto out;
  st = DDP_ERR_NO_MEMORY;
  r.nbuckets = nb;
  r.offsets = ddp__calloc(nb + 1, sizeof(size_t));
  r.indices = ddp__calloc(d->P + 1, sizeof(size_t));
  r.limits = ddp__calloc(nb + 1, sizeof(size_t));
  if (!r.offsets || !r.indices || !r.limits) goto out;
  size_t pos = 0;
  for (size_t b = 0; b < nb; b++) {
    r.offsets[b] = pos;
    pos += (size_t)v2[b];
    r.limits[b] = b == 0 ? d->first_bucket_bytes_cap : d->bucket_bytes_cap;
  }
  r.offsets[nb] = pos;
  if (pos != d->P) {
    st = fail(d, DDP_ERR_INVALID_DATA, "[rank %d] DDP: rank 0's rebuilt layout covers %zu of %zu parameters",
              d->rank, pos, d->P);
    goto out;
  }
  for (size_t k = 0; k < d->P; k++) {
    if (v1[k] < 0 || (size_t)v1[k] >= d->P) {
      st = fail(d, DDP_ERR_INVALID_DATA, "[rank %d] DDP: bad rebuilt index %d", d->rank, v1[k]);
      goto out;
    }
    r.indices[k] = (size_t)v1[k];
  }
  st = init_buckets(d, &r);
  if (st != DDP_OK) goto out;
  record_layout(d, &d->rebuilt_stats, &r);
  d->has_rebuilt = true;
  d->nrebuilt = 0;
  if (ddp__log_enabled(DDP_LOG_INFO)) {
    char lim[512] = "";
    size_t len = 0;
    for (size_t b = 0; b < nb && len < sizeof lim; b++)
      len += (size_t)snprintf(lim + len, sizeof lim - len, "%s%" PRId64, b ? ", " : "",
                              d->rebuilt_stats.limits[b]);
    ddp__log(d->rank, DDP_LOG_INFO, "%zu buckets rebuilt with size limits: %s bytes.", nb, lim);
    ddp__log(d->rank, DDP_LOG_INFO, "Reducer buckets have been rebuilt in this iteration.");
  }
out:
  if (st == DDP_ERR_NO_MEMORY && !d->err[0]) fail(d, st, "[rank %d] DDP: out of memory", d->rank);
  if (w) {
    ddp_work_wait(w, -1);
    ddp_work_free(w);
  }
  ddp_bucket_assignment_free(&a);
  ddp_bucket_assignment_free(&r);
  ddp__free(bytes);
  ddp__free(keys);
  ddp__free(v1);
  ddp__free(v2);
  return st;
}

/* ---------------------------------------------------------------- join ------------ */

/* A one-element int32 allreduce, waited for: the join protocol's counters and votes. */
static ddp_status_t small_allreduce(ddp_ddp_t *d, int32_t v, ddp_redop_t op, const char *what,
                                    int32_t *out) {
  int32_t *buf = d->join_count + 1;
  buf[0] = v;
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(d->pg, buf, buf, 1, DDP_I32, op, &w);
  if (st != DDP_OK)
    return fail(d, st, "[rank %d] DDP %s: %s", d->rank, what, ddp_pg_last_error(d->pg));
  DDP_CHECK(wait_work(d, &w, what));
  *out = buf[0];
  return DDP_OK;
}

/* _find_common_rank: the largest rank whose condition holds (allreduce MAX). */
static ddp_status_t find_common_rank(ddp_ddp_t *d, int rank, bool cond, int *out) {
  int32_t r;
  DDP_CHECK(small_allreduce(d, cond ? rank : -1, DDP_OP_MAX, "join: allreduce of the common rank", &r));
  if (r < 0)
    return fail(d, DDP_ERR_INTERNAL,
                "BUG! Expected rank_cond to be true for at least one process. (rank %d)",
                d->rank);
  *out = r;
  return DDP_OK;
}

/* What a rank that has not joined adds to each forward (Join.notify_join_context): with
 * throw_on_early_termination a vote that fails every rank once one is out of data, then
 * the asynchronous "not joined" count whose sum is the divide factor when
 * divide_by_initial_world_size is false. */
static ddp_status_t join_notify(ddp_ddp_t *d) {
  if (d->join_throw) {
    int32_t out;
    DDP_CHECK(small_allreduce(d, 0, DDP_OP_SUM, "join: early-termination vote", &out));
    if (out > 0)
      return fail(d, DDP_ERR_ABORTED,
                  "Detected at least one rank that exhausted inputs. Throwing across all "
                  "ranks. (rank %d)",
                  d->rank);
  }
  if (d->join_work) DDP_CHECK(wait_work(d, &d->join_work, "join: allreduce of the not-joined count"));
  d->join_count[0] = 1;
  ddp_status_t st = ddp_allreduce(d->pg, d->join_count, d->join_count, 1, DDP_I32, DDP_OP_SUM,
                                  &d->join_work);
  if (st != DDP_OK)
    return fail(d, st, "[rank %d] DDP join: %s", d->rank, ddp_pg_last_error(d->pg));
  return DDP_OK;
}

ddp_status_t ddp_ddp_join_begin(ddp_ddp_t *d, bool divide_by_initial_world_size,
                                bool throw_on_early_termination) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  if (d->opts.static_graph)
    return fail(d, DDP_ERR_UNSUPPORTED,
                "[rank %d] DDP: join() with static_graph is not supported by libddp", d->rank);
  d->join_enabled = true;
  d->join_divide_initial = divide_by_initial_world_size;
  d->join_throw = throw_on_early_termination;
  return DDP_OK;
}

/* The joined rank's loop (Join.__exit__ with DDP's join hook): while any rank is still
 * training, shadow one iteration of theirs: the not-joined count (zero from us), the
 * pending rebuild, the buffer broadcast from the agreed rank, the backward-sync vote and,
 * when they synchronise, one allreduce of zeros per bucket in order and the used map.
 * When every rank has joined, the last joiner's parameters and buffers go to all. */
ddp_status_t ddp_ddp_join_end(ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  if (!d->join_enabled) return DDP_OK;
  d->err[0] = 0;
  if (d->join_work) DDP_CHECK(wait_work(d, &d->join_work, "join: allreduce of the not-joined count"));
  if (d->join_throw) {
    int32_t out;
    d->join_enabled = false;
    DDP_CHECK(small_allreduce(d, 1, DDP_OP_SUM, "join: early-termination vote", &out));
    return fail(d, DDP_ERR_ABORTED, "Rank %d exhausted all inputs.", d->rank);
  }
  bool last = true;
  ddp_status_t st = DDP_OK;
  for (;;) {
    int32_t active;
    DDP_CHECK_GOTO(small_allreduce(d, 0, DDP_OP_SUM, "join: allreduce of the not-joined count",
                                   &active), st, out);
    if (active == 0) break;
    last = false;
    DDP_CHECK_GOTO(rebuild_buckets(d), st, out);
    if (d->require_forward_param_sync && d->opts.broadcast_buffers &&
        ddp_model_num_buffers(d->model) > 0) {
      int root = 0;
      DDP_CHECK_GOTO(find_common_rank(d, d->rank, false, &root), st, out);
      DDP_CHECK_GOTO(sync_buffers(d, root), st, out);
    }
    int32_t sync;
    DDP_CHECK_GOTO(small_allreduce(d, 0, DDP_OP_SUM, "join: backward-sync flag", &sync), st, out);
    d->require_forward_param_sync = sync != 0;
    if (!sync) continue;
    for (size_t b = 0; b < d->nbuckets && st == DDP_OK; b++) {
      bucket_t *x = &d->buckets[b];
      if (d->opts.gradient_as_bucket_view)
        for (size_t k = 0; k < x->nvars; k++) /* keep the grads, which live here */
          if (d->params[x->vars[k]]->grad.data)
            ddp_param_set_grad_data(d->params[x->vars[k]], NULL);
      memset(x->buf, 0, x->numel * ddp_dtype_size(x->dtype));
      if (d->has_comm_hook) {
        st = run_comm_hook(d, b);
        continue;
      }
      st = ddp_allreduce(d->pg, x->buf, x->buf, x->numel, x->dtype, DDP_OP_SUM, &x->work);
      if (st != DDP_OK) {
        fail(d, st, "[rank %d] DDP join: bucket %zu: %s", d->rank, b, ddp_pg_last_error(d->pg));
        break;
      }
    }
    for (size_t b = 0; b < d->nbuckets; b++) {
      char what[64];
      snprintf(what, sizeof what, "join: shadow allreduce of bucket %zu", b);
      ddp_status_t ws = d->buckets[b].cwork ? resolve_comm_hook(d, b, st == DDP_OK)
                                            : wait_work(d, &d->buckets[b].work, what);
      if (st == DDP_OK) st = ws;
    }
    if (st != DDP_OK) goto out;
    if (d->opts.find_unused_parameters) {
      memset(d->global_used, 0, d->P * sizeof *d->global_used);
      st = ddp_allreduce(d->pg, d->global_used, d->global_used, d->P, DDP_I32, DDP_OP_SUM,
                         &d->used_work);
      if (st == DDP_OK) st = wait_work(d, &d->used_work, "join: shadow used-map allreduce");
      if (st != DDP_OK) goto out;
    }
    if (should_rebuild(d)) {
      for (size_t i = 0; i < d->P; i++) d->rebuilt[i] = i;
      d->nrebuilt = d->P;
    }
  }
  {
    int root = 0;
    DDP_CHECK_GOTO(find_common_rank(d, d->rank, last, &root), st, out);
    DDP_CHECK_GOTO(sync_module_states(d, root), st, out);
  }
out:
  d->join_enabled = false;
  return st;
}

ddp_status_t ddp_ddp_pre_forward(ddp_ddp_t *d, ddp_ctx_t *ctx) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && ctx);
  /* A hook error was returned by that backward; like PyTorch, the unfinished reduction is
   * what the next forward reports. */
  d->hook_status = DDP_OK;
  d->err[0] = 0;
  bool grad = ddp_ctx_grad_enabled(ctx);
  d->ctx = ctx;
  d->t_pre_forward = ddp_now_ns();
  if (grad && d->require_backward_grad_sync) {
    d->num_iterations++;
    d->t_fwd_start = ddp_now_ns();
  }
  if (d->join_enabled) DDP_CHECK(join_notify(d));
  if (grad) {
    DDP_CHECK(ensure_prior_reduction_finished(d));
    DDP_CHECK(rebuild_buckets(d));
  }
  if (d->require_forward_param_sync && d->opts.broadcast_buffers &&
      ddp_model_num_buffers(d->model) > 0) {
    int root = 0;
    if (d->join_enabled) DDP_CHECK(find_common_rank(d, d->rank, true, &root));
    DDP_CHECK(sync_buffers(d, root));
  }
  if (d->join_enabled) {
    int32_t flag;
    DDP_CHECK(small_allreduce(d, d->require_backward_grad_sync ? 1 : 0, DDP_OP_SUM,
                              "join: backward-sync flag", &flag));
  }
  return DDP_OK;
}

static void visit_used(void *user, ddp_param_t *p) {
  ddp_ddp_t *d = user;
  size_t i = p->index < d->nmodel ? d->mindex[p->index] : SIZE_MAX;
  if (i != SIZE_MAX) d->visited[i] = true;
}

/* prepare_for_backward (§3.2), plus the graph search of §4.1 under dynamic find_unused. */
static void prepare_for_backward(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n,
                                 ddp_var_t *const *outputs) {
  d->expect_hooks = true;
  d->first_hook_seen = false;
  d->marked_unused = false;
  d->finalize_queued = false;
  d->nready_order = 0;
  d->next_bucket = 0;
  d->t_comm_start = 0;
  memset(d->ready, 0, d->P * sizeof *d->ready);
  for (size_t b = 0; b < d->nbuckets; b++) d->buckets[b].pending = d->buckets[b].nvars;
  if (!d->has_rebuilt) d->nrebuilt = 0;
  if (d->opts.static_graph && d->static_first_done)
    memcpy(d->fire_left, d->fire_expected, d->P * sizeof *d->fire_left);
  if (d->opts.find_unused_parameters && !d->opts.static_graph) {
    memset(d->visited, 0, d->P * sizeof *d->visited);
    ddp_graph_visit_params(ctx, n, outputs, visit_used, d);
    d->nunused = 0;
    d->unused_bytes = 0;
    for (size_t i = 0; i < d->P; i++) {
      d->unused[i] = !d->visited[i];
      if (d->unused[i]) {
        d->unused_list[d->nunused++] = i;
        d->unused_bytes += (int64_t)pbytes(d->params[i]);
        ddp__log(d->rank, DDP_LOG_DETAIL, "Parameter %s at index %zu is marked as unused.",
                 d->params[i]->name, i);
      }
    }
    if (d->prev_unused_valid && memcmp(d->prev_unused, d->unused, d->P * sizeof(bool)) != 0)
      d->unused_changed = true;
    memcpy(d->prev_unused, d->unused, d->P * sizeof(bool));
    d->prev_unused_valid = true;
    if (d->nunused == 0 && !d->warned_no_unused) {
      d->warned_no_unused = true;
      ddp__log(d->rank, DDP_LOG_WARN,
               "find_unused_parameters=True was specified in DDP constructor, but did not find "
               "any unused parameters in the forward pass. This flag results in an extra "
               "traversal of the autograd graph every iteration,  which can adversely affect "
               "performance. If your model indeed never has any unused parameters in the "
               "forward pass, consider turning this flag off. Note that this warning may be a "
               "false positive if your model has flow control causing later iterations to have "
               "unused parameters.");
    }
  }
}

ddp_status_t ddp_ddp_post_forward(ddp_ddp_t *d, ddp_ctx_t *ctx, size_t n,
                                  ddp_var_t *const *outputs) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && ctx);
  d->ctx = ctx;
  trace(d, "forward", d->t_pre_forward, ddp_now_ns(), 0, -1, 0);
  if (ddp_ctx_grad_enabled(ctx) && d->require_backward_grad_sync) {
    d->require_forward_param_sync = true;
    d->t_fwd_end = ddp_now_ns();
    prepare_for_backward(d, ctx, n, outputs);
  } else {
    d->require_forward_param_sync = false;
  }
  return DDP_OK;
}

ddp_status_t ddp_ddp_forward(ddp_ddp_t *d, ddp_ctx_t *ctx, ddp_var_t *x, uint64_t flags,
                             ddp_var_t **y) {
  DDP_CHECK(ddp_ddp_pre_forward(d, ctx));
  ddp_status_t st = ddp_model_forward(d->model, ctx, x, flags, y);
  if (st != DDP_OK)
    return fail(d, st, "[rank %d] DDP forward: %s", d->rank, ddp_ctx_last_error(ctx)->msg);
  return ddp_ddp_post_forward(d, ctx, 1, y);
}

ddp_status_t ddp_ddp_backward(ddp_ddp_t *d, ddp_ctx_t *ctx, ddp_var_t *loss) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && ctx && loss);
  d->ctx = ctx;
  d->t_bwd_start = ddp_now_ns();
  ddp_status_t st = ddp_backward(ctx, loss);
  trace(d, "backward", d->t_bwd_start, ddp_now_ns(), 0, -1, 0);
  if (d->hook_status != DDP_OK) return d->hook_status;
  if (st != DDP_OK && !d->err[0])
    fail(d, st, "[rank %d] DDP backward: %s", d->rank, ddp_ctx_last_error(ctx)->msg);
  return st;
}

void ddp_ddp_set_local_grad_fn(ddp_ddp_t *d, ddp_local_grad_fn fn, void *user) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  d->local_fn = fn;
  d->local_user = user;
}

bool ddp_ddp_set_sync(ddp_ddp_t *d, bool sync) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  bool old = d->require_backward_grad_sync;
  d->require_backward_grad_sync = sync;
  return old;
}

/* ---------------------------------------------------------------- statistics ------ */

static void stats_sample_end(ddp_ddp_t *d) {
  int64_t it = d->num_iterations;
  if (!(it <= 10 || it % 100 == 0)) return;
  int64_t fwd = d->t_fwd_end - d->t_fwd_start;
  int64_t bwd = d->t_bwd_compute_end - d->t_bwd_start;
  int64_t comm = d->t_comm_start ? d->t_comm_end - d->t_comm_start : 0;
  int64_t ov = d->t_comm_start ? DDP_MAX(0, d->t_bwd_compute_end - d->t_comm_start) : 0;
  d->sum_fwd += fwd;
  d->sum_bwd += bwd;
  d->sum_comm += comm;
  d->sum_overlap += ov;
  d->nsamples++;
  ddp__log(d->rank, DDP_LOG_DETAIL,
           "DDP iteration %" PRId64 ": forward_compute_time=%" PRId64
           " ns backward_compute_time=%" PRId64 " ns backward_comm_time=%" PRId64
           " ns backward_compute_comm_overlap_time=%" PRId64 " ns",
           it, fwd, bwd, comm, ov);
  if (d->has_comm_hook) {
    ddp_ddp_comm_stats_t cs;
    ddp_ddp_get_comm_stats(d, &cs);
    ddp__log(d->rank, DDP_LOG_INFO,
             "DDP iteration %" PRId64 ": comm hook %s: numel before compression %" PRId64
             ", after %" PRId64 ", rate %g, %" PRId64 " bytes all-reduced this step",
             it, d->comm_hook_name, cs.numel_before, cs.numel_after, cs.rate,
             cs.bytes_last_step);
  }
}

void ddp_ddp_get_logging_data(ddp_ddp_t *d, ddp_ddp_logging_data_t *o) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && o);
  memset(o, 0, sizeof *o);
  o->world_size = d->world;
  o->rank = d->rank;
  o->iteration = d->num_iterations;
  o->backend_name = ddp_pg_backend_name(d->pg);
  o->module_name = "ddp_model";
  o->num_parameter_tensors = d->P;
  for (size_t i = 0; i < d->P; i++) o->total_parameter_size_bytes += (int64_t)pbytes(d->params[i]);
  o->dtypes = d->dtypes;
  o->broadcast_buffers = d->opts.broadcast_buffers;
  o->find_unused_parameters = d->opts.find_unused_parameters;
  o->gradient_as_bucket_view = d->opts.gradient_as_bucket_view;
  o->static_graph = d->opts.static_graph;
  o->bucket_cap_bytes = (int64_t)d->bucket_bytes_cap;
  o->first_bucket_bytes = (int64_t)d->first_bucket_bytes_cap;
  o->num_initial_buckets = d->initial.nb;
  o->bucket_sizes = d->initial.sizes;
  o->initial_bucket_size_limits = d->initial.limits;
  o->has_rebuilt_buckets = d->has_rebuilt;
  o->num_rebuilt_buckets = d->rebuilt_stats.nb;
  o->rebuilt_bucket_sizes = d->rebuilt_stats.sizes;
  o->rebuilt_bucket_size_limits = d->rebuilt_stats.limits;
  o->rebuilt_per_bucket_param_offsets = d->rebuilt_stats.offs;
  o->rebuilt_per_bucket_param_indices = d->rebuilt_stats.idx;
  o->num_prev_ready_order = d->nprev_ready_order;
  o->prev_iteration_grad_ready_order_indices = d->prev_ready_order;
  o->unused_parameter_size = d->unused_bytes;
  if (d->nsamples) {
    o->avg_forward_compute_time = d->sum_fwd / d->nsamples;
    o->avg_backward_compute_time = d->sum_bwd / d->nsamples;
    o->avg_backward_comm_time = d->sum_comm / d->nsamples;
    o->avg_backward_compute_comm_overlap_time = d->sum_overlap / d->nsamples;
  }
  o->num_runtime_samples = d->nsamples;
  o->comm_hook = d->comm_hook_name ? d->comm_hook_name : "";
  o->join_uneven_inputs = false;
  o->can_set_static_graph = d->opts.find_unused_parameters && !d->opts.static_graph &&
                            d->prev_unused_valid && !d->unused_changed;
}

size_t ddp_ddp_num_buckets(const ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  return d->nbuckets;
}

const size_t *ddp_ddp_bucket_params(const ddp_ddp_t *d, size_t b, size_t *n) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && b < d->nbuckets && n);
  *n = d->buckets[b].nvars;
  return d->buckets[b].vars;
}

ddp_param_t *ddp_ddp_param(ddp_ddp_t *d, size_t i) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && i < d->P);
  return d->params[i];
}

size_t ddp_ddp_num_params(const ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  return d->P;
}

const char *ddp_ddp_last_error(const ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  return d->err;
}

ddp_model_t *ddp_ddp_model(ddp_ddp_t *d) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC);
  return d->model;
}

/* ---------------------------------------------------------------- construction ---- */

/* _verify_param_shape_across_processes (§1.3). */
static ddp_status_t verify_shapes(ddp_ddp_t *d) {
  int64_t mine = (int64_t)d->P;
  int64_t *all = ddp__calloc((size_t)d->world, sizeof *all);
  ddp_work_t *w = NULL;
  if (!all) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  ddp_status_t st = ddp_allgather(d->pg, &mine, all, 1, DDP_I64, &w);
  if (st == DDP_OK) st = wait_work(d, &w, "allgather of the parameter count");
  else fail(d, st, "[rank %d] DDP: allgather of the parameter count: %s", d->rank, ddp_pg_last_error(d->pg));
  for (int i = 0; st == DDP_OK && i < d->world; i++)
    if (all[i] != mine)
      st = fail(d, DDP_ERR_INVALID_ARGUMENT,
                "DDP expects same model across all ranks, but Rank %d has %" PRId64
                " params, while rank %d has inconsistent %" PRId64 " params.",
                d->rank, mine, i, all[i]);
  ddp__free(all);
  if (st != DDP_OK) return st;
  size_t len = 0;
  for (size_t i = 0; i < d->P; i++) len += 2 * (size_t)d->params[i]->value.ndim;
  int64_t *meta = ddp__calloc(len + 1, sizeof *meta);
  int64_t *mine_meta = ddp__calloc(len + 1, sizeof *meta);
  if (!meta || !mine_meta) {
    ddp__free(meta);
    ddp__free(mine_meta);
    return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  }
  size_t pos = 0;
  for (size_t i = 0; i < d->P; i++) {
    const ddp_tensor_t *t = &d->params[i]->value;
    int64_t stride = 1;
    for (int k = 0; k < t->ndim; k++) mine_meta[pos + (size_t)k] = t->shape[k];
    for (int k = t->ndim - 1; k >= 0; k--) {
      mine_meta[pos + (size_t)t->ndim + (size_t)k] = stride;
      stride *= t->shape[k];
    }
    pos += 2 * (size_t)t->ndim;
  }
  memcpy(meta, mine_meta, len * sizeof *meta);
  st = ddp_broadcast(d->pg, meta, len, DDP_I64, 0, &w);
  if (st == DDP_OK) st = wait_work(d, &w, "broadcast of parameter shapes");
  else fail(d, st, "[rank %d] DDP: broadcast of parameter shapes: %s", d->rank, ddp_pg_last_error(d->pg));
  pos = 0;
  for (size_t i = 0; st == DDP_OK && i < d->P; i++) {
    int nd = d->params[i]->value.ndim;
    char sizes[256];
    fmt_shape(sizes, sizeof sizes, d->params[i]->value.shape, nd);
    if (memcmp(meta + pos, mine_meta + pos, (size_t)nd * sizeof *meta) != 0)
      st = fail(d, DDP_ERR_INVALID_ARGUMENT,
                "[%d]: params[%zu] in this process with sizes %s appears not to match sizes of "
                "the same param in process 0. (parameter %s)",
                d->rank, i, sizes, d->params[i]->name);
    else if (memcmp(meta + pos + nd, mine_meta + pos + nd, (size_t)nd * sizeof *meta) != 0)
      st = fail(d, DDP_ERR_INVALID_ARGUMENT,
                "params[%zu] in this process with sizes %s appears not to match strides of "
                "the same param in process 0. (parameter %s, rank %d)",
                i, sizes, d->params[i]->name, d->rank);
    pos += 2 * (size_t)nd;
  }
  ddp__free(meta);
  ddp__free(mine_meta);
  return st;
}

static ddp_status_t sync_module_states(ddp_ddp_t *d, int root) {
  size_t np = ddp_model_num_params(d->model), nb = ddp_model_num_buffers(d->model);
  tref_t *t = ddp__calloc(np + nb + 1, sizeof *t);
  if (!t) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
  size_t n = 0;
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(d->model, i);
    t[n++] = (tref_t){p->value.data, pbytes(p), p->value.dtype};
  }
  if (d->opts.broadcast_buffers)
    for (size_t i = 0; i < nb; i++) {
      ddp_buffer_t *b = ddp_model_buffer(d->model, i);
      t[n++] = (tref_t){b->value.data, ddp_tensor_nbytes(&b->value), b->value.dtype};
    }
  ddp_status_t st =
      broadcast_coalesced(d, t, n, d->bcast_bytes, root, "parameters and buffers");
  ddp__free(t);
  return st;
}

void ddp_ddp_destroy(ddp_ddp_t *d) {
  if (!d) return;
  DDP_REQUIRE(d->magic == DDP_MAGIC);
  if (d->trace_path && d->nev) write_trace(d);
  ddp__free(d->trace_path);
  ddp__free(d->ev);
  if (d->used_work) {
    ddp_work_wait(d->used_work, -1);
    ddp_work_free(d->used_work);
  }
  if (d->hooks_set) ddp_model_set_hook(d->model, NULL, NULL);
  for (size_t i = 0; i < d->P; i++) {
    ddp_param_t *p = d->params[i];
    if (d->buckets && p->grad.data && p->grad.data == slot_of(d, i)) {
      void *slot = p->grad.data;
      ddp_param_set_grad_data(p, NULL);
      memcpy(p->grad.data, slot, pbytes(p));
    }
  }
  free_buckets(d, d->buckets, d->nbuckets);
  if (d->has_comm_hook && d->comm_hook.free_state) d->comm_hook.free_state(d->comm_hook.state);
  ddp__free(d->comm_hook_name);
  if (d->join_work) {
    ddp_work_wait(d->join_work, -1);
    ddp_work_free(d->join_work);
  }
  if (d->global_used) ddp_pg_free(d->pg, d->global_used);
  if (d->join_count) ddp_pg_free(d->pg, d->join_count);
  layout_stats_t *ls[2] = {&d->initial, &d->rebuilt_stats};
  for (int k = 0; k < 2; k++) {
    ddp__free(ls[k]->sizes);
    ddp__free(ls[k]->limits);
    ddp__free(ls[k]->offs);
    ddp__free(ls[k]->idx);
  }
  ddp__free(d->params);
  ddp__free(d->mindex);
  ddp__free(d->param_bucket);
  ddp__free(d->param_offset);
  ddp__free(d->ready);
  ddp__free(d->ready_order);
  ddp__free(d->prev_ready_order);
  ddp__free(d->unused);
  ddp__free(d->unused_list);
  ddp__free(d->visited);
  ddp__free(d->local_used);
  ddp__free(d->prev_unused);
  ddp__free(d->fire_expected);
  ddp__free(d->fire_left);
  ddp__free(d->rebuilt);
  d->magic = 0;
  ddp__free(d);
}

ddp_status_t ddp_ddp_create(ddp_model_t *model, ddp_pg_t *pg, const ddp_ddp_options_t *opts,
                            ddp_ddp_t **out, ddp_error_t *err) {
  DDP_REQUIRE(model && pg && out);
  *out = NULL;
  int rank = ddp_pg_rank(pg);
  ddp_ddp_options_t o = DDP_DDP_OPTIONS_INIT;
  if (opts) {
    DDP_REQUIRE(opts->struct_size >= sizeof(size_t) && opts->struct_size <= sizeof o);
    memcpy(&o, opts, opts->struct_size);
    o.struct_size = sizeof o;
  }
  if (!ddp_model_finalized(model))
    return ddp__error(err, rank, DDP_ERR_INVALID_USAGE,
                      "DDP: the model must be finalized (ddp_model_finalize) before wrapping");
  if (o.bucket_cap_mb != DDP_BUCKET_CAP_UNSET && !(o.bucket_cap_mb >= 0))
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "DDP: bucket_cap_mb must be >= 0 (got %g)", o.bucket_cap_mb);
  ddp_ddp_t *d = ddp__calloc(1, sizeof *d);
  if (!d) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "DDP: out of memory");
  d->magic = DDP_MAGIC;
  d->model = model;
  d->pg = pg;
  d->opts = o;
  d->rank = rank;
  d->world = ddp_pg_size(pg);
  d->require_backward_grad_sync = true;
  d->require_forward_param_sync = true;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  d->bcast_bytes = o.broadcast_bucket_bytes ? o.broadcast_bucket_bytes : DDP_BROADCAST_BUCKET_BYTES;
  d->opts.trace_path = NULL; /* the copy below is the handle's */
  if (o.trace_path) {
    d->trace_path = ddp__strdup(o.trace_path);
    if (!d->trace_path) goto fail_mem;
    if (rank == 0) {
      int fd = open(o.trace_path, O_WRONLY | O_TRUNC | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0 || write(fd, "[\n", 2) != 2) {
        if (fd >= 0) close(fd);
        st = fail(d, DDP_ERR_SYSTEM, "[rank %d] DDP trace: open %s: %s", rank, o.trace_path,
                  strerror(errno));
        goto fail;
      }
      close(fd);
    }
  }
  bool unset = o.bucket_cap_mb == DDP_BUCKET_CAP_UNSET;
  double cap_mb = unset ? DDP_DEFAULT_BUCKET_CAP_MB : o.bucket_cap_mb;
  d->bucket_bytes_cap = (size_t)(int64_t)(cap_mb * 1024.0 * 1024.0);
  d->first_bucket_bytes_cap =
      o.first_bucket_bytes >= 0 ? (size_t)o.first_bucket_bytes
                                : (unset ? (size_t)DDP_DEFAULT_FIRST_BUCKET_BYTES : d->bucket_bytes_cap);
  size_t np = ddp_model_num_params(model);
  d->params = ddp__calloc(np + 1, sizeof *d->params);
  d->mindex = ddp__calloc(np + 1, sizeof *d->mindex);
  d->nmodel = np;
  if (!d->params || !d->mindex) goto fail_mem;
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(model, i);
    d->mindex[i] = SIZE_MAX;
    if (p->index != i) {
      st = fail(d, DDP_ERR_INTERNAL, "[rank %d] DDP: parameter %zu has index %zu", rank, i,
                p->index);
      goto fail;
    }
    if (!p->requires_grad) continue;
    if (p->value.dtype != DDP_F32 && p->value.dtype != DDP_F64) {
      st = fail(d, DDP_ERR_UNSUPPORTED, "[rank %d] DDP: parameter %s has dtype %s; DDP reduces F32 and F64 gradients",
                rank, p->name, ddp_dtype_name(p->value.dtype));
      goto fail;
    }
    d->mindex[i] = d->P;
    d->params[d->P++] = p;
  }
  if (d->P == 0) {
    st = fail(d, DDP_ERR_INVALID_ARGUMENT,
              "DistributedDataParallel is not needed when a module doesn't have any parameter "
              "that requires a gradient.");
    goto fail;
  }
  size_t P = d->P;
  d->param_bucket = ddp__calloc(P, sizeof(size_t));
  d->param_offset = ddp__calloc(P, sizeof(size_t));
  d->ready = ddp__calloc(P, sizeof(bool));
  d->ready_order = ddp__calloc(P, sizeof(size_t));
  d->prev_ready_order = ddp__calloc(P, sizeof(size_t));
  d->unused = ddp__calloc(P, sizeof(bool));
  d->unused_list = ddp__calloc(P, sizeof(size_t));
  d->visited = ddp__calloc(P, sizeof(bool));
  d->local_used = ddp__calloc(P, sizeof(int32_t));
  d->prev_unused = ddp__calloc(P, sizeof(bool));
  d->fire_expected = ddp__calloc(P, sizeof(int));
  d->fire_left = ddp__calloc(P, sizeof(int));
  d->rebuilt = ddp__calloc(P, sizeof(size_t));
  d->global_used = ddp_pg_alloc(pg, P * sizeof(int32_t));
  d->join_count = ddp_pg_alloc(pg, 2 * sizeof(int32_t));
  if (!d->param_bucket || !d->param_offset || !d->ready || !d->ready_order ||
      !d->prev_ready_order || !d->unused || !d->unused_list || !d->visited || !d->local_used ||
      !d->prev_unused || !d->fire_expected || !d->fire_left || !d->rebuilt || !d->global_used ||
      !d->join_count)
    goto fail_mem;
  {
    size_t len = 0;
    for (size_t i = 0; i < P; i++) {
      const char *nm = ddp_dtype_name(d->params[i]->value.dtype);
      if (!strstr(d->dtypes, nm) && len + strlen(nm) + 2 < sizeof d->dtypes)
        len += (size_t)snprintf(d->dtypes + len, sizeof d->dtypes - len, "%s%s", len ? "," : "", nm);
    }
  }
  if (o.init_sync) {
    DDP_CHECK_GOTO(verify_shapes(d), st, fail);
    DDP_CHECK_GOTO(sync_module_states(d, 0), st, fail);
  }
  if (o.static_graph && o.find_unused_parameters)
    ddp__log(rank, DDP_LOG_WARN,
             "You passed find_unused_parameters=true to DistributedDataParallel, "
             "`_set_static_graph` will detect unused parameters automatically, so you do not "
             "need to set find_unused_parameters=true, just be sure these unused parameters "
             "will not change during training loop while calling `_set_static_graph`.");
  /* Initial layout (§2.2): registration order, one bucket per dtype unless find_unused is
   * on without static graph, then limits [first, cap] when bucket_cap_mb is unset or the
   * first-bucket size was given, else [cap] (newer PyTorch with an explicit cap); the list
   * is reversed so the last-defined parameters go first. */
  {
    size_t *bytes = ddp__calloc(P, sizeof *bytes);
    int *keys = ddp__calloc(P, sizeof *keys);
    ddp_bucket_assignment_t a = {0}, r = {0};
    if (!bytes || !keys) {
      ddp__free(bytes);
      ddp__free(keys);
      goto fail_mem;
    }
    for (size_t i = 0; i < P; i++) {
      bytes[i] = pbytes(d->params[i]);
      keys[i] = (int)d->params[i]->value.dtype;
    }
    size_t limits[2];
    size_t nlim;
    if (o.static_graph || !o.find_unused_parameters) {
      limits[0] = SIZE_MAX;
      nlim = 1;
    } else if (unset || o.first_bucket_bytes >= 0) {
      /* PyTorch's None (and 1.13 always): a small first bucket. */
      limits[0] = d->first_bucket_bytes_cap;
      limits[1] = d->bucket_bytes_cap;
      nlim = 2;
    } else {
      limits[0] = d->bucket_bytes_cap;
      nlim = 1;
    }
    st = ddp_compute_bucket_assignment_by_size(P, bytes, keys, NULL, limits, nlim, NULL, &a);
    ddp__free(bytes);
    ddp__free(keys);
    if (st != DDP_OK) goto fail_mem;
    r.nbuckets = a.nbuckets;
    r.offsets = ddp__calloc(a.nbuckets + 1, sizeof(size_t));
    r.indices = ddp__calloc(P + 1, sizeof(size_t));
    r.limits = ddp__calloc(a.nbuckets + 1, sizeof(size_t));
    if (!r.offsets || !r.indices || !r.limits) {
      ddp_bucket_assignment_free(&a);
      ddp_bucket_assignment_free(&r);
      goto fail_mem;
    }
    size_t pos = 0;
    for (size_t b = 0; b < a.nbuckets; b++) {
      size_t s = a.nbuckets - 1 - b;
      r.offsets[b] = pos;
      r.limits[b] = a.limits[s];
      for (size_t k = a.offsets[s]; k < a.offsets[s + 1]; k++) r.indices[pos++] = a.indices[k];
    }
    r.offsets[a.nbuckets] = pos;
    ddp_bucket_assignment_free(&a);
    st = init_buckets(d, &r);
    if (st == DDP_OK) record_layout(d, &d->initial, &r);
    ddp_bucket_assignment_free(&r);
    if (st != DDP_OK) goto fail;
  }
  ddp_model_set_hook(model, grad_hook, d);
  d->hooks_set = true;
  if (ddp__log_enabled(DDP_LOG_INFO)) {
    ddp__log(rank, DDP_LOG_INFO,
             "Reducer initialized with bucket_bytes_cap: %zu first_bucket_bytes_cap: %zu",
             d->bucket_bytes_cap, d->first_bucket_bytes_cap);
    ddp__log(rank, DDP_LOG_INFO,
             "DDP Initialized with: world_size: %d rank: %d backend_name: %s "
             "num_parameter_tensors: %zu dtypes: %s bucket_cap_bytes: %zu "
             "first_bucket_bytes: %zu num_buckets: %zu broadcast_buffers: %d "
             "find_unused_parameters: %d gradient_as_bucket_view: %d static_graph: %d "
             "init_sync: %d",
             d->world, rank, ddp_pg_backend_name(pg), P, d->dtypes, d->bucket_bytes_cap,
             d->first_bucket_bytes_cap, d->nbuckets, o.broadcast_buffers,
             o.find_unused_parameters, o.gradient_as_bucket_view, o.static_graph, o.init_sync);
  }
  *out = d;
  return DDP_OK;
fail_mem:
  st = fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", rank);
fail:
  copy_err(err, d, st);
  ddp_ddp_destroy(d);
  return st;
}

/* ---------------------------------------------------------------- comm hooks ------ */

/* The future behind a hook's result. Collectives added to it are waited for in the order
 * they were added; then the continuation runs (it may add collectives and set another
 * continuation, which runs after those); the work resolves when no continuation is left. */
struct ddp_comm_work {
  ddp_work_t **works;
  size_t n, cap;
  ddp_comm_then_fn then;
  void *then_user;
  void *data;
  size_t count;
  ddp_dtype_t dt;
  bool has_result;
  void (*on_free)(void *);
  void *free_user;
  ddp_status_t status;
  char err[1024];
};

ddp_status_t ddp_comm_work_create(ddp_comm_work_t **out) {
  DDP_REQUIRE(out);
  *out = ddp__calloc(1, sizeof **out);
  return *out ? DDP_OK : DDP_ERR_NO_MEMORY;
}

ddp_status_t ddp_comm_work_add(ddp_comm_work_t *w, ddp_work_t *work) {
  DDP_REQUIRE(w && work);
  if (w->n == w->cap) {
    size_t cap = w->cap ? 2 * w->cap : 4;
    ddp_work_t **nw = ddp__malloc(cap * sizeof *nw);
    if (!nw) {
      ddp_work_wait(work, -1);
      ddp_work_free(work);
      return DDP_ERR_NO_MEMORY;
    }
    if (w->n) memcpy(nw, w->works, w->n * sizeof *nw);
    ddp__free(w->works);
    w->works = nw;
    w->cap = cap;
  }
  w->works[w->n++] = work;
  return DDP_OK;
}

void ddp_comm_work_then(ddp_comm_work_t *w, ddp_comm_then_fn fn, void *user) {
  DDP_REQUIRE(w);
  w->then = fn;
  w->then_user = user;
}

void ddp_comm_work_set_result(ddp_comm_work_t *w, void *data, size_t count, ddp_dtype_t dt) {
  DDP_REQUIRE(w);
  w->data = data;
  w->count = count;
  w->dt = dt;
  w->has_result = true;
}

void ddp_comm_work_on_free(ddp_comm_work_t *w, void (*fn)(void *), void *user) {
  DDP_REQUIRE(w);
  w->on_free = fn;
  w->free_user = user;
}

void ddp_comm_work_set_error(ddp_comm_work_t *w, const char *msg) {
  DDP_REQUIRE(w && msg);
  snprintf(w->err, sizeof w->err, "%s", msg);
}

const char *ddp_comm_work_error(const ddp_comm_work_t *w) {
  DDP_REQUIRE(w);
  return w->err;
}

static void drain_works(ddp_comm_work_t *w) {
  for (size_t i = 0; i < w->n; i++) {
    ddp_status_t st = ddp_work_wait(w->works[i], -1);
    if (st != DDP_OK && w->status == DDP_OK) {
      w->status = st;
      const char *e = ddp_work_error(w->works[i]);
      snprintf(w->err, sizeof w->err, "collective %zu of the hook failed: %s", i,
               e[0] ? e : ddp_status_str(st));
    }
    ddp_work_free(w->works[i]);
  }
  w->n = 0;
}

ddp_status_t ddp_comm_work_wait(ddp_comm_work_t *w, const void **data, size_t *count,
                                ddp_dtype_t *dt) {
  DDP_REQUIRE(w);
  for (;;) {
    drain_works(w);
    if (w->status != DDP_OK || !w->then) break;
    ddp_comm_then_fn fn = w->then;
    w->then = NULL;
    ddp_status_t st = fn(w->then_user, w);
    if (st != DDP_OK) {
      drain_works(w);
      w->status = st;
      if (!w->err[0]) snprintf(w->err, sizeof w->err, "the hook's continuation failed: %s",
                               ddp_status_str(st));
      break;
    }
  }
  if (w->status == DDP_OK && !w->has_result) {
    w->status = DDP_ERR_INVALID_USAGE;
    snprintf(w->err, sizeof w->err, "the comm hook's work resolved to no tensor");
  }
  if (data) *data = w->data;
  if (count) *count = w->count;
  if (dt) *dt = w->dt;
  return w->status;
}

void ddp_comm_work_free(ddp_comm_work_t *w) {
  if (!w) return;
  drain_works(w);
  if (w->on_free) w->on_free(w->free_user);
  ddp__free(w->works);
  ddp__free(w);
}

void ddp_grad_bucket_set_buffer(ddp_grad_bucket_t *b, void *data, ddp_dtype_t dt) {
  DDP_REQUIRE(b && (data || b->numel == 0));
  b->buffer = data;
  b->dtype = dt;
}

void *ddp_grad_bucket_gradient(const ddp_grad_bucket_t *b, size_t k) {
  DDP_REQUIRE(b && k < b->nparams);
  return (char *)b->buffer + b->offsets[k] * ddp_dtype_size(b->dtype);
}

/* Calls the hook on bucket b with a fresh GradBucket over its flat buffer. */
static ddp_status_t run_comm_hook(ddp_ddp_t *d, size_t b) {
  bucket_t *x = &d->buckets[b];
  if (!x->gb_params) {
    x->gb_params = ddp__calloc(x->nvars, sizeof *x->gb_params);
    if (!x->gb_params) return fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
    for (size_t k = 0; k < x->nvars; k++) x->gb_params[k] = d->params[x->vars[k]];
  }
  x->gb = (ddp_grad_bucket_t){.index = b,
                              .is_last = b + 1 == d->nbuckets,
                              .buffer = x->buf,
                              .numel = x->numel,
                              .dtype = x->dtype,
                              .nparams = x->nvars,
                              .params = x->gb_params,
                              .offsets = x->offsets};
  ddp_comm_work_t *w = NULL;
  ddp_status_t st = d->comm_hook.fn(d->comm_hook.state, d->pg, &x->gb, &w);
  if (st != DDP_OK) {
    char msg[1024];
    const char *pe = ddp_pg_status(d->pg) != DDP_OK ? ddp_pg_last_error(d->pg) : "";
    snprintf(msg, sizeof msg, "%s", w && ddp_comm_work_error(w)[0] ? ddp_comm_work_error(w)
                                    : pe[0]                      ? pe
                                                                 : ddp_status_str(st));
    ddp_comm_work_free(w);
    return fail(d, st, "[rank %d] DDP: comm hook %s failed on bucket %zu: %s", d->rank,
                d->comm_hook_name, b, msg);
  }
  if (!w)
    return fail(d, DDP_ERR_INVALID_USAGE, "[rank %d] DDP: comm hook %s returned no work for bucket %zu",
                d->rank, d->comm_hook_name, b);
  x->cwork = w;
  return DDP_OK;
}

/* Resolves bucket b's hook work and converts its result into the bucket's flat buffer in
 * the gradient dtype (the copy-back then proceeds as without a hook). */
static ddp_status_t resolve_comm_hook(ddp_ddp_t *d, size_t b, bool report) {
  bucket_t *x = &d->buckets[b];
  const void *data = NULL;
  size_t cnt = 0;
  ddp_dtype_t dt = x->dtype;
  ddp_status_t st = ddp_comm_work_wait(x->cwork, &data, &cnt, &dt);
  if (st != DDP_OK) {
    if (report)
      fail(d, st, "[rank %d] DDP: comm hook %s on bucket %zu failed: %s", d->rank,
           d->comm_hook_name, b, ddp_comm_work_error(x->cwork));
  } else if (cnt != x->numel) {
    st = DDP_ERR_INVALID_USAGE;
    if (report)
      fail(d, st,
           "[rank %d] DDP: comm hook %s resolved bucket %zu to a tensor of %zu elements, "
           "expected %zu (the bucket's element count)",
           d->rank, d->comm_hook_name, b, cnt, x->numel);
  } else if (dt != DDP_F32 && dt != DDP_F64 && dt != DDP_F16 && dt != DDP_BF16) {
    st = DDP_ERR_INVALID_USAGE;
    if (report)
      fail(d, st, "[rank %d] DDP: comm hook %s resolved bucket %zu to dtype %s; expected a "
           "floating dtype", d->rank, d->comm_hook_name, b, ddp_dtype_name(dt));
  } else if (data != x->buf || dt != x->dtype) {
    size_t es = ddp_dtype_size(dt), n = x->numel;
    const char *src = data, *dst = x->buf;
    void *tmp = NULL;
    if (dt != x->dtype && src < dst + n * ddp_dtype_size(x->dtype) && dst < src + n * es) {
      tmp = ddp__malloc(n * es + 1);
      if (!tmp) st = fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
      else data = memcpy(tmp, data, n * es);
    }
    if (st == DDP_OK) {
      if (dt == x->dtype) memmove(x->buf, data, n * es);
      else if (x->dtype == DDP_F64)
        for (size_t i = 0; i < n; i++) ((double *)x->buf)[i] = ddp__dtype_load(data, dt, i);
      else
        for (size_t i = 0; i < n; i++) ((float *)x->buf)[i] = (float)ddp__dtype_load(data, dt, i);
    }
    ddp__free(tmp);
  }
  ddp_comm_work_free(x->cwork);
  x->cwork = NULL;
  return st;
}

ddp_status_t ddp_ddp_register_comm_hook(ddp_ddp_t *d, const ddp_comm_hook_t *hook,
                                        ddp_error_t *err) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && hook && hook->fn);
  d->err[0] = 0;
  ddp_status_t st;
  if (d->has_comm_hook) {
    st = fail(d, DDP_ERR_INVALID_USAGE,
              "register_comm_hook or register_builtin_comm_hook can only be called once. "
              "(rank %d: %s is already registered)", d->rank, d->comm_hook_name);
  } else if (d->num_iterations > 0 || d->require_finalize) {
    st = fail(d, DDP_ERR_INVALID_USAGE,
              "register_comm_hook must be called before the first backward: this DDP model "
              "has already run %" PRId64 " synchronised iteration(s) (rank %d)",
              d->num_iterations, d->rank);
  } else {
    const char *name = hook->name ? hook->name : "comm_hook";
    size_t len = strlen(name);
    d->comm_hook_name = ddp__malloc(len + 1);
    if (!d->comm_hook_name) {
      st = fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
    } else {
      memcpy(d->comm_hook_name, name, len + 1);
      d->comm_hook = *hook;
      d->has_comm_hook = true;
      ddp__log(d->rank, DDP_LOG_INFO, "DDP: registered comm hook %s", name);
      return DDP_OK;
    }
  }
  copy_err(err, d, st);
  return st;
}

void ddp_ddp_get_comm_stats(ddp_ddp_t *d, ddp_ddp_comm_stats_t *out) {
  DDP_REQUIRE(d && d->magic == DDP_MAGIC && out);
  memset(out, 0, sizeof *out);
  if (d->has_comm_hook) {
    if (d->comm_hook.stats) {
      ddp_comm_hook_stats_t s = {0, 0, 0};
      d->comm_hook.stats(d->comm_hook.state, &s);
      out->numel_before = s.numel_before;
      out->numel_after = s.numel_after;
      out->bytes_last_step = s.bytes_last_step;
    }
  } else {
    out->numel_before = out->numel_after = d->comm_numel_total;
    out->bytes_last_step = d->comm_bytes_step;
  }
  out->rate = out->numel_after > 0 ? (double)out->numel_before / (double)out->numel_after : 1.0;
}
