/* A parameter's gradient slot and gradient-ready hook. Below both the model (which owns the
 * parameters and their flat buffers) and autograd (which defines a None gradient that a
 * gradient reaches), so that neither calls the other for them. */
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nn/nn_internal.h"

void ddp_param_set_grad_data(ddp_param_t *p, void *data) {
  DDP_REQUIRE(p && p->value.data);
  p->grad.data = data ? data : p->grad_home_;
}

void ddp_param_set_grad_none(ddp_param_t *p) {
  DDP_REQUIRE(p && p->value.data);
  p->grad.data = NULL;
}

void ddp_param_release_grad(ddp_param_t *p) {
  DDP_REQUIRE(p && p->value.data);
  p->grad.data = NULL;
  if (!p->grad_home_) return;
  /* Only the whole pages inside the parameter's slice: its neighbours' bytes stay. A None
   * gradient's storage holds nothing (autograd zero-fills it when it defines the gradient
   * again), so the hint may drop the pages or not: either is correct. */
  long pg = sysconf(_SC_PAGESIZE);
  uintptr_t ps = pg > 0 ? (uintptr_t)pg : 4096u;
  uintptr_t lo = ((uintptr_t)p->grad_home_ + ps - 1) & ~(ps - 1);
  uintptr_t hi = ((uintptr_t)p->grad_home_ + ddp_tensor_nbytes(&p->value)) & ~(ps - 1);
#ifdef MADV_DONTNEED
  if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#endif
}

bool ddp_param_grad_defined(const ddp_param_t *p) {
  DDP_REQUIRE(p);
  return p->grad.data != NULL;
}

void ddp_param_set_hook(ddp_param_t *p, ddp_grad_ready_fn fn, void *user) {
  DDP_REQUIRE(p);
  p->hook = fn;
  p->hook_user = user;
}
