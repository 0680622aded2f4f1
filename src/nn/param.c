/* A parameter's gradient slot and gradient-ready hook. Below both the model (which owns the
 * parameters and their flat buffers) and autograd (which defines a None gradient that a
 * gradient reaches), so that neither calls the other for them. */
#include "nn/nn_internal.h"

void ddp_param_set_grad_data(ddp_param_t *p, void *data) {
  DDP_REQUIRE(p && p->value.data);
  p->grad.data = data ? data : p->grad_home_;
}

void ddp_param_set_grad_none(ddp_param_t *p) {
  DDP_REQUIRE(p && p->value.data);
  p->grad.data = NULL;
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
