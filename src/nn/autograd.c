/* The autograd engine: the arena, the tape, backward with gradient-ready hooks, the graph
 * search for unused parameters, and reentrant activation checkpointing. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <stdatomic.h>

#include "nn/nn_internal.h"

#define ARENA_MIN_CHUNK ((size_t)1 << 20)
#define ARENA_ALIGN 64

/* ---------------------------------------------------------------- arena ----------- */

static ddp__chunk_t *chunk_new(size_t cap) {
  ddp__chunk_t *ch = ddp__malloc(sizeof *ch);
  if (!ch) return NULL;
  ch->base = ddp__aligned_alloc(cap);
  if (!ch->base) {
    ddp__free(ch);
    return NULL;
  }
  ch->cap = cap;
  ch->used = 0;
  ch->next = NULL;
  return ch;
}

static void chunks_free(ddp__chunk_t *ch) {
  while (ch) {
    ddp__chunk_t *next = ch->next;
    ddp__aligned_free(ch->base);
    ddp__free(ch);
    ch = next;
  }
}

void *ddp__arena_alloc(ddp_ctx_t *c, size_t bytes) {
  bytes = (bytes + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
  if (bytes == 0) bytes = ARENA_ALIGN;
  ddp__chunk_t *ch = c->chunks;
  if (!ch || ch->cap - ch->used < bytes) {
    size_t cap = DDP_MAX(bytes, DDP_MAX(ARENA_MIN_CHUNK, c->total_cap));
    ddp__chunk_t *nc = chunk_new(cap);
    if (!nc) {
      c->oom_request = bytes;
      c->oom_chunk = cap;
      return NULL;
    }
    nc->next = ch;
    c->chunks = nc;
    c->total_cap += cap;
    ch = nc;
  }
  void *p = ch->base + ch->used;
  ch->used += bytes;
  c->used_total += bytes;
  return p;
}

void *ddp__arena_zalloc(ddp_ctx_t *c, size_t bytes) {
  void *p = ddp__arena_alloc(c, bytes);
  if (p) memset(p, 0, bytes);
  return p;
}

/* ---------------------------------------------------------------- context --------- */

/* ddp_param_var caches a parameter's leaf under a generation, and that cache lives in the
 * parameter, so it outlives the context that filled it. Generations must therefore never
 * repeat, across contexts either (a new context counting 1, 2, ... would find a destroyed
 * context's leaf). They come from one process-wide counter: a number, not state. */
static uint64_t next_generation(void) {
  static _Atomic uint64_t counter = 1;
  return atomic_fetch_add(&counter, 1);
}

ddp_status_t ddp_ctx_create(ddp_ctx_t **out) {
  DDP_REQUIRE(out);
  *out = NULL;
  ddp_ctx_t *c = ddp__calloc(1, sizeof *c);
  if (!c) return DDP_ERR_NO_MEMORY;
  c->grad_enabled = true;
  c->gen = next_generation();
  *out = c;
  return DDP_OK;
}

void ddp_ctx_destroy(ddp_ctx_t *c) {
  if (!c) return;
  chunks_free(c->chunks);
  ddp__free(c);
}

void ddp_ctx_reset(ddp_ctx_t *c) {
  DDP_REQUIRE(c);
  if (c->chunks && c->chunks->next) {
    /* Several chunks: replace them by one that holds the whole step. If that allocation
     * fails the old chunks are gone and the next step grows again from nothing. */
    size_t cap = c->total_cap;
    chunks_free(c->chunks);
    c->chunks = chunk_new(cap);
    c->total_cap = c->chunks ? cap : 0;
  } else if (c->chunks) {
    c->chunks->used = 0;
  }
  c->used_total = 0;
  c->tail = NULL;
  c->gen = next_generation();
  c->dropout_ctr = 0;
}

bool ddp_ctx_set_grad_enabled(ddp_ctx_t *c, bool enabled) {
  DDP_REQUIRE(c);
  bool prev = c->grad_enabled;
  c->grad_enabled = enabled;
  return prev;
}

bool ddp_ctx_grad_enabled(const ddp_ctx_t *c) {
  DDP_REQUIRE(c);
  return c->grad_enabled;
}

void ddp_ctx_set_rng(ddp_ctx_t *c, uint64_t seed, uint32_t rank, uint64_t step) {
  DDP_REQUIRE(c);
  c->rng_seed = seed;
  c->rng_rank = rank;
  c->rng_step = step;
  c->dropout_ctr = 0;
}

size_t ddp_ctx_arena_bytes(const ddp_ctx_t *c) {
  DDP_REQUIRE(c);
  return c->total_cap;
}

void ddp_ctx_last_error_copy(const ddp_ctx_t *c, ddp_error_t *out) {
  DDP_REQUIRE(c && out);
  *out = c->err;
}

ddp_status_t ddp__ctx_error(ddp_ctx_t *c, ddp_status_t st, const char *fmt, ...) {
  char msg[DDP_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (st == DDP_ERR_NO_MEMORY && c->oom_request) {
    size_t n = strlen(msg);
    snprintf(msg + n, sizeof msg - n,
             " (out of memory: %zu bytes asked for, a new arena chunk of %zu bytes (%.3g GB), "
             "with %zu bytes (%.3g GB) already held by this context)",
             c->oom_request, c->oom_chunk, (double)c->oom_chunk * 1e-9, c->total_cap,
             (double)c->total_cap * 1e-9);
    c->oom_request = c->oom_chunk = 0;
  }
  return ddp__error(&c->err, -1, st, "%s", msg);
}

/* ---------------------------------------------------------------- vars and nodes -- */

static ddp_var_t *var_alloc(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                            bool zero) {
  int64_t numel;
  if (ddp_shape_numel(ndim, shape, ddp_dtype_size(dt), &numel) != DDP_OK) return NULL;
  ddp_var_t *v = ddp__arena_zalloc(c, sizeof *v);
  if (!v) return NULL;
  size_t bytes = (size_t)numel * ddp_dtype_size(dt);
  void *data = zero ? ddp__arena_zalloc(c, bytes) : ddp__arena_alloc(c, bytes);
  if (!data) return NULL;
  ddp_tensor_view(&v->value, dt, ndim, shape, data);
  return v;
}

ddp_var_t *ddp__var_alloc(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape) {
  return var_alloc(c, dt, ndim, shape, true);
}

ddp_var_t *ddp__var_alloc_raw(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape) {
  return var_alloc(c, dt, ndim, shape, false);
}

ddp_status_t ddp_var_new(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape,
                         const void *data, bool requires_grad, ddp_var_t **out) {
  DDP_REQUIRE(c && out);
  *out = NULL;
  if (!ddp_dtype_valid((int)dt) || ndim < 0 || ndim > DDP_MAX_DIMS)
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT, "ddp_var_new: bad dtype or ndim %d", ndim);
  ddp_var_t *v = ddp__var_alloc(c, dt, ndim, shape);
  if (!v) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "ddp_var_new: arena exhausted");
  if (data) memcpy(v->value.data, data, ddp_tensor_nbytes(&v->value));
  v->requires_grad = requires_grad;
  *out = v;
  return DDP_OK;
}

ddp_var_t *ddp_param_var(ddp_ctx_t *c, ddp_param_t *p) {
  DDP_REQUIRE(c && p);
  if (p->leaf_ && p->leaf_gen_ == c->gen) return p->leaf_;
  ddp_var_t *v = ddp__arena_zalloc(c, sizeof *v);
  if (!v) return NULL;
  v->value = p->value;
  v->value.owns = false;
  v->requires_grad = p->requires_grad;
  v->param = p;
  p->leaf_ = v;
  p->leaf_gen_ = c->gen;
  return v;
}

ddp_node_t *ddp__node_new(ddp_ctx_t *c, const char *name, ddp__backward_fn bw, ddp_var_t *out,
                          size_t nin, ddp_var_t *const *ins) {
  ddp_node_t *n = ddp__arena_zalloc(c, sizeof *n);
  if (!n) return NULL;
  if (nin <= DDP__NODE_INLINE_INS) {
    n->ins = n->ins_inline;
  } else {
    n->ins = ddp__arena_alloc(c, nin * sizeof *n->ins);
    if (!n->ins) return NULL;
  }
  memcpy(n->ins, ins, nin * sizeof *ins);
  n->nin = nin;
  n->name = name;
  n->backward = bw;
  n->out = out;
  n->prev = c->tail;
  c->tail = n;
  out->creator = n;
  out->requires_grad = true;
  return n;
}

bool ddp__needs_grad(const ddp_ctx_t *c, size_t nin, ddp_var_t *const *ins) {
  if (!c->grad_enabled) return false;
  for (size_t i = 0; i < nin; i++)
    if (ins[i] && ins[i]->requires_grad) return true;
  return false;
}

void *ddp__grad(ddp_ctx_t *c, ddp_var_t *v) {
  if (!v->grad.data) {
    void *g = ddp__arena_zalloc(c, ddp_tensor_nbytes(&v->value));
    if (!g) return NULL;
    ddp_tensor_view(&v->grad, v->value.dtype, v->value.ndim, v->value.shape, g);
  }
  return v->grad.data;
}

void ddp__accumulate(ddp_dtype_t dt, void *dst, const void *src, int64_t n) {
  if (dt == DDP_F32) {
    float *d = dst;
    const float *s = src;
    for (int64_t i = 0; i < n; i++) d[i] += s[i];
  } else {
    double *d = dst;
    const double *s = src;
    for (int64_t i = 0; i < n; i++) d[i] += s[i];
  }
}

/* ---------------------------------------------------------------- backward -------- */

/* A parameter's gradient is final when every node that uses its leaf, among the nodes this
 * backward will run, has run. The marking pass walks the tape from the end and marks the
 * nodes reachable from the roots (the tape is in creation order, so a consumer always comes
 * after its producers and one reverse sweep finds all of them), counting for every parameter
 * leaf its uses by marked nodes. The run pass walks the same nodes in the same order, and
 * after each node decrements the count of its parameter inputs; at zero the leaf's summed
 * gradient is added into param->grad (a leaf used once accumulates into param->grad
 * directly) and the hook fires. This is the order in which PyTorch's engine reaches each
 * AccumulateGrad node on one thread, and it makes a tied or reused parameter fire once,
 * after its last contribution. Nodes at or before `stop` are outside this backward (used by
 * the inner backward of a checkpoint). */
static ddp_status_t finalize_param(ddp_ctx_t *c, ddp_var_t *leaf) {
  ddp_param_t *p = leaf->param;
  if (leaf->grad.data && leaf->grad.data != p->grad.data)
    ddp__accumulate(p->value.dtype, p->grad.data, leaf->grad.data, p->value.numel);
  if (p->fire_bwd_ != c->bwd_id) {
    p->fire_bwd_ = c->bwd_id;
    p->fires_ = 0;
  }
  p->fires_++;
  if (p->hook) p->hook(p->hook_user, p, p->fires_);
  return DDP_OK;
}

static ddp_status_t run_backward(ddp_ctx_t *c, size_t nroots, ddp_var_t *const *roots,
                                 const ddp_tensor_t *grads, ddp_node_t *stop) {
  uint64_t id = ++c->mark_seq;
  if (c->bwd_depth == 0) c->bwd_id = id;

  for (size_t r = 0; r < nroots; r++) {
    if (!roots[r]->requires_grad)
      return ddp__ctx_error(c, DDP_ERR_INVALID_USAGE,
                            "backward: root %zu does not require grad and has no creator "
                            "(element 0 of tensors does not require grad)",
                            r);
    if (grads && grads[r].data && !ddp_tensor_same_shape(&grads[r], &roots[r]->value))
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "backward: gradient %zu has the wrong shape", r);
    if (grads && grads[r].data && grads[r].dtype != roots[r]->value.dtype)
      return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                            "backward: gradient %zu has dtype %s, root has %s", r,
                            ddp_dtype_name(grads[r].dtype), ddp_dtype_name(roots[r]->value.dtype));
    if (roots[r]->creator) roots[r]->creator->mark = id;
  }
  /* Marking pass. */
  for (ddp_node_t *n = c->tail; n && n != stop; n = n->prev) {
    if (n->mark != id) continue;
    n->out->grad.data = NULL;
    for (size_t i = 0; i < n->nin; i++) {
      ddp_var_t *v = n->ins[i];
      if (!v || !v->requires_grad) continue;
      if (v->creator) {
        v->creator->mark = id;
      } else if (v->param) {
        if (v->stamp_ != id) {
          v->stamp_ = id;
          v->pending_ = 0;
          v->grad.data = NULL;
        }
        v->pending_++;
      }
    }
  }
  /* Seed the roots. */
  for (size_t r = 0; r < nroots; r++) {
    ddp_var_t *v = roots[r];
    if (!ddp__grad(c, v)) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "backward: arena exhausted");
    if (grads && grads[r].data) {
      ddp__accumulate(v->value.dtype, v->grad.data, grads[r].data, v->value.numel);
    } else if (v->value.dtype == DDP_F32) {
      for (int64_t i = 0; i < v->value.numel; i++) ((float *)v->grad.data)[i] += 1.0f;
    } else {
      for (int64_t i = 0; i < v->value.numel; i++) ((double *)v->grad.data)[i] += 1.0;
    }
  }
  c->bwd_depth++;
  ddp_status_t st = DDP_OK;
  for (ddp_node_t *n = c->tail; n && n != stop; n = n->prev) {
    if (n->mark != id) continue;
    if (n->out->grad.data) {
      /* A parameter leaf used exactly once accumulates straight into param->grad. A None
       * gradient that a gradient now reaches is defined first: zeros in the model's flat
       * gradient buffer (so the values equal those of a zero-filled gradient). */
      for (size_t i = 0; i < n->nin; i++) {
        ddp_var_t *v = n->ins[i];
        if (v && v->param && v->stamp_ == id && v->requires_grad && !v->param->grad.data) {
          ddp_param_set_grad_data(v->param, NULL);
          memset(v->param->grad.data, 0, ddp_tensor_nbytes(&v->param->value));
        }
        if (v && v->param && v->stamp_ == id && v->requires_grad && !v->grad.data &&
            v->pending_ == 1 && v->param->grad.data)
          v->grad = v->param->grad;
      }
      st = n->backward(c, n);
      if (st != DDP_OK) break;
    }
    /* Parameter inputs are finalized in the order PyTorch's engine reaches their
     * AccumulateGrad nodes: edge order (norm layers: weight, then bias), except linear,
     * whose weight sits behind a transpose node, so its bias fires first. */
    for (size_t j = 0; j < n->nin; j++) {
      ddp_var_t *v = n->ins[n->fire_reverse ? n->nin - 1 - j : j];
      if (v && v->param && v->stamp_ == id && v->requires_grad && v->pending_ > 0) {
        if (--v->pending_ == 0) finalize_param(c, v);
      }
    }
  }
  c->bwd_depth--;
  return st;
}

/* End of an outermost backward: on success the queued callbacks run in order (one queued by
 * a callback runs in this loop too); either way the queue is emptied. */
static ddp_status_t finish_backward(ddp_ctx_t *c, ddp_status_t st) {
  for (int i = 0; st == DDP_OK && i < c->ncb; i++) st = c->cb_fn[i](c->cb_user[i]);
  c->ncb = 0;
  return st;
}

ddp_status_t ddp_ctx_queue_callback(ddp_ctx_t *c, ddp_backward_callback_fn fn, void *user) {
  DDP_REQUIRE(c && fn);
  if (c->ncb >= DDP_CTX_MAX_CALLBACKS)
    return ddp__ctx_error(c, DDP_ERR_INVALID_USAGE,
                          "queue_callback: more than %d callbacks in one backward",
                          DDP_CTX_MAX_CALLBACKS);
  c->cb_fn[c->ncb] = fn;
  c->cb_user[c->ncb] = user;
  c->ncb++;
  return DDP_OK;
}

bool ddp_ctx_in_backward(const ddp_ctx_t *c) {
  DDP_REQUIRE(c);
  return c->bwd_depth > 0;
}

ddp_status_t ddp_backward(ddp_ctx_t *c, ddp_var_t *loss) {
  DDP_REQUIRE(c && loss);
  DDP_REQUIRE(c->bwd_depth == 0);
  if (loss->value.numel != 1)
    return finish_backward(c, ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                                             "backward: grad can be implicitly created only for "
                                             "scalar outputs (loss has %lld elements)",
                                             (long long)loss->value.numel));
  return finish_backward(c, run_backward(c, 1, &loss, NULL, NULL));
}

ddp_status_t ddp_backward_multi(ddp_ctx_t *c, size_t n, ddp_var_t *const *roots,
                                const ddp_tensor_t *grads) {
  DDP_REQUIRE(c && (n == 0 || roots));
  DDP_REQUIRE(c->bwd_depth == 0);
  return finish_backward(c, run_backward(c, n, roots, grads, NULL));
}

void ddp_graph_visit_params(ddp_ctx_t *c, size_t nout, ddp_var_t *const *outputs,
                            void (*visit)(void *user, ddp_param_t *p), void *user) {
  DDP_REQUIRE(c && visit);
  uint64_t id = ++c->mark_seq;
  for (size_t r = 0; r < nout; r++) {
    ddp_var_t *v = outputs[r];
    if (!v || !v->requires_grad) continue;
    if (v->creator) {
      v->creator->mark = id;
    } else if (v->param && v->stamp_ != id) {
      v->stamp_ = id;
      visit(user, v->param);
    }
  }
  for (ddp_node_t *n = c->tail; n; n = n->prev) {
    if (n->mark != id) continue;
    for (size_t i = 0; i < n->nin; i++) {
      ddp_var_t *v = n->ins[i];
      if (!v || !v->requires_grad) continue;
      if (v->creator) {
        v->creator->mark = id;
      } else if (v->param && v->stamp_ != id) {
        v->stamp_ = id;
        visit(user, v->param);
      }
    }
  }
}

/* ---------------------------------------------------------------- checkpoint ------ */

/* Backward of a checkpointed segment: recompute with grad on detached copies of the inputs
 * (same dropout draws as the forward), run an inner backward over just the recomputed nodes,
 * pass the inputs' gradients on, and drop the recomputed nodes from the tape. */
static ddp_status_t bw_checkpoint(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_node_t *saved_tail = c->tail;
  ddp_var_t **det = ddp__arena_alloc(c, n->nin * sizeof *det);
  if (!det) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
  for (size_t i = 0; i < n->nin; i++) {
    det[i] = ddp__arena_zalloc(c, sizeof **det);
    if (!det[i]) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
    det[i]->value = n->ins[i]->value;
    det[i]->value.owns = false;
    det[i]->requires_grad = n->ins[i]->requires_grad;
  }
  bool prev_mode = ddp_ctx_set_grad_enabled(c, true);
  uint64_t saved_ctr = c->dropout_ctr;
  c->dropout_ctr = n->seg_dropout_ctr;
  c->gen = next_generation(); /* fresh parameter leaves: the inner graph is its own */
  ddp_var_t *y = NULL;
  ddp_status_t st = n->seg_fn(n->seg_user, c, n->nin, det, &y);
  c->dropout_ctr = saved_ctr;
  ddp_ctx_set_grad_enabled(c, prev_mode);
  if (st == DDP_OK && y && y->requires_grad) {
    if (!ddp_tensor_same_shape(&y->value, &n->out->value))
      st = ddp__ctx_error(c, DDP_ERR_INVALID_USAGE,
                          "checkpoint: recomputed output has a different shape");
    else
      st = run_backward(c, 1, &y, &n->out->grad, saved_tail);
  }
  for (size_t i = 0; st == DDP_OK && i < n->nin; i++) {
    if (!det[i]->grad.data || !n->ins[i]->requires_grad) continue;
    void *g = ddp__grad(c, n->ins[i]);
    if (!g) {
      st = ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
      break;
    }
    ddp__accumulate(det[i]->value.dtype, g, det[i]->grad.data, det[i]->value.numel);
  }
  c->tail = saved_tail;
  return st;
}

ddp_status_t ddp_checkpoint(ddp_ctx_t *c, ddp_segment_fn fn, void *user, size_t nin,
                            ddp_var_t *const *in, ddp_var_t **out) {
  DDP_REQUIRE(c && fn && out && (nin == 0 || in));
  /* *out is written only on success: callers may pass the address of an input. */
  uint64_t ctr0 = c->dropout_ctr;
  bool prev_mode = ddp_ctx_set_grad_enabled(c, false);
  ddp_var_t *y = NULL;
  ddp_status_t st = fn(user, c, nin, in, &y);
  ddp_ctx_set_grad_enabled(c, prev_mode);
  if (st != DDP_OK) return st;
  if (!y) return ddp__ctx_error(c, DDP_ERR_INVALID_USAGE, "checkpoint: segment gave no output");
  /* A fresh var header over the output's storage, so that the node never rewires a var the
   * segment returned as is (an identity segment returns its input). */
  ddp_var_t *v = ddp__arena_zalloc(c, sizeof *v);
  if (!v) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
  v->value = y->value;
  v->value.owns = false;
  if (ddp__needs_grad(c, nin, in)) {
    ddp_node_t *n = ddp__node_new(c, "checkpoint", bw_checkpoint, v, nin, in);
    if (!n) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "checkpoint: arena exhausted");
    n->seg_fn = fn;
    n->seg_user = user;
    n->seg_dropout_ctr = ctr0;
  }
  *out = v;
  return DDP_OK;
}
