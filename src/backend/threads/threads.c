/* The threads backend: ranks are threads of one process. The control block and staging
 * areas are ordinary heap memory shared by reference, and every pointer is readable by
 * every rank, so the shared-family collectives always read peers' buffers in place (zero
 * copy). Rank 0 allocates the context and publishes its address through the store (which
 * must be an in-process store, e.g. ddp_store_create_memory); the others take a reference.
 * The context is freed by the last rank to leave. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "backend/backends.h"
#include "common/common.h"

typedef struct threads_ctx {
  atomic_int refs; /* ranks still holding the context */
  void *ctl;
  unsigned char **staging;
  size_t staging_bytes;
} threads_ctx_t;

typedef struct threads_state {
  threads_ctx_t *ctx;
  ddp_backend_shared_t sh;
} threads_state_t;

typedef struct ctx_msg {
  threads_ctx_t *ctx;
  int pid;
} ctx_msg_t;

static void ctx_release(threads_ctx_t *x) {
  if (atomic_fetch_sub(&x->refs, 1) != 1) return;
  ddp__aligned_free(x->ctl);
  ddp__aligned_free(x->staging ? x->staging[0] : NULL);
  ddp__free(x->staging);
  ddp__free(x);
}

static uint64_t to_handle(void *state, const void *p, size_t n) { return (uint64_t)(uintptr_t)p; }
static void *from_handle(void *state, uint64_t h) { return (void *)(uintptr_t)h; }

static ddp_status_t threads_create(const ddp_backend_init_t *in, void **out, ddp_error_t *err) {
  int rank = in->rank, W = in->size;
  if (!in->store)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: the threads backend needs an in-process store "
                      "(ddp_store_create_memory) shared by all ranks, or ddp_spawn_threads",
                      rank);
  threads_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "threads backend state");
  ddp_status_t st = DDP_OK;
  if (rank == 0) {
    threads_ctx_t *x = ddp__calloc(1, sizeof *x);
    if (x) {
      atomic_init(&x->refs, W);
      x->staging_bytes = in->staging_bytes;
      x->ctl = ddp__aligned_alloc(in->ctl_bytes);
      x->staging = ddp__calloc((size_t)W, sizeof *x->staging);
      unsigned char *area = ddp__aligned_alloc((size_t)W * in->staging_bytes);
      if (x->staging) x->staging[0] = area;
      if (!x->ctl || !x->staging || !area) {
        atomic_store(&x->refs, 1);
        ctx_release(x);
        x = NULL;
      } else {
        for (int j = 1; j < W; j++) x->staging[j] = area + (size_t)j * in->staging_bytes;
        memset(x->ctl, 0, in->ctl_bytes); /* the contract: ctl is zero at create */
      }
    }
    if (!x) {
      ddp__free(s);
      return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "threads backend context for %d ranks", W);
    }
    s->ctx = x;
    ctx_msg_t m = {x, (int)getpid()};
    st = ddp_store_set(in->store, "threads/ctx", &m, sizeof m);
    if (st != DDP_OK) {
      st = ddp__backend_store_failed(in->store, st, err, "rank 0: publishing the threads context");
      goto fail;
    }
  } else {
    const char *key = "threads/ctx";
    st = ddp_store_wait(in->store, &key, 1, in->timeout_ms);
    if (st != DDP_OK) {
      st = ddp__error_quiet(err, st, /* the store has logged its wait */
                            "rank %d: timed out after %lld ms waiting for rank 0 to join the "
                            "threads group",
                            rank, (long long)in->timeout_ms);
      ddp__free(s);
      return st;
    }
    void *v = NULL;
    size_t n = 0;
    st = ddp_store_get(in->store, key, &v, &n);
    ctx_msg_t m = {0};
    if (st == DDP_OK && n == sizeof m) memcpy(&m, v, sizeof m);
    ddp_free(v);
    if (!m.ctx || m.pid != (int)getpid()) {
      ddp__free(s);
      return ddp__error(err, rank, DDP_ERR_INVALID_USAGE,
                        "rank %d: the threads backend needs every rank in one process sharing "
                        "one in-process store (found %s)",
                        rank, m.ctx ? "a context from another process" : "no context");
    }
    s->ctx = m.ctx;
  }
  st = ddp__backend_join(in->store, "threads", rank, W, in->timeout_ms, NULL, err);
  if (st != DDP_OK) goto fail;
  s->sh = (ddp_backend_shared_t){s->ctx->ctl, s->ctx->staging, s->ctx->staging_bytes,
                                 to_handle,   from_handle,     NULL};
  *out = s;
  return DDP_OK;
fail:
  ctx_release(s->ctx);
  ddp__free(s);
  return st;
}

static void threads_destroy(void *state) {
  threads_state_t *s = state;
  ctx_release(s->ctx);
  ddp__free(s);
}

static const ddp_backend_shared_t *threads_shared(void *state) {
  return &((threads_state_t *)state)->sh;
}

const ddp_backend_ops_t ddp__backend_threads = {
    .abi_version = DDP_BACKEND_ABI_VERSION,
    .name = "threads",
    .family = DDP_BACKEND_SHARED,
    .create = threads_create,
    .destroy = threads_destroy,
    .abort = NULL,
    .mem_alloc = NULL,
    .mem_free = NULL,
    .shared = threads_shared,
    .xfer = NULL,
    .fail = NULL,
};
