/* Private to src/optim: the optimizer handle and its per-parameter state, shared by the
 * update kernels (optim.c) and the state file code (optim_state.c). */
#ifndef DDP_SRC_OPTIM_INTERNAL_H
#define DDP_SRC_OPTIM_INTERNAL_H

#include "ddp/optim.h"

/* State of one parameter, PyTorch's optimizer.state[p]. */
typedef struct ddp_optim_pstate {
  ddp_dtype_t dtype;  /* fixed at create */
  int64_t numel;      /* fixed at create */
  bool has_state;     /* false until the first step that saw a grad (or a load) */
  double step;        /* Adam/AdamW: completed steps (an f32 value, as torch keeps it) */
  ddp_tensor_t buf;   /* SGD momentum_buffer, or Adam exp_avg; flat [numel] */
  ddp_tensor_t sq;    /* exp_avg_sq */
  ddp_tensor_t maxsq; /* max_exp_avg_sq (amsgrad) */
} ddp_optim_pstate_t;

struct ddp_optim {
  uint32_t magic;
  ddp_optim_options_t opts; /* copied at create; lr changes through set_lr and load */
  size_t n;
  ddp_optim_param_t *params; /* [n], the caller's tensors */
  ddp_optim_pstate_t *state; /* [n] */
};

/* Allocates zeroed state tensors for parameter i (buf; sq and maxsq for the Adams). */
ddp_status_t ddp__optim_state_alloc(ddp_optim_t *opt, size_t i);
/* Frees parameter i's state tensors and marks it stateless. */
void ddp__optim_state_clear(ddp_optim_pstate_t *s);

#endif /* DDP_SRC_OPTIM_INTERNAL_H */
