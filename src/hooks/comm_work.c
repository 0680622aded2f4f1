/* The future a comm hook returns (ddp_comm_work_t) and the GradBucket accessors: the part
 * of the hook interface the reducer and every hook share (ddp/hooks.h). */
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/hooks.h"

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
      if (!w->err[0])
        snprintf(w->err, sizeof w->err, "the hook's continuation failed: %s", ddp_status_str(st));
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
