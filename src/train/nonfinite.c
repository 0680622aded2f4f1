/* halt_on_nonfinite (docs/train.md): finding the first non-finite gradient, and stopping
 * the run (or warning) with the step, the value and that parameter named. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "common/common.h"
#include "train/trainer.h"

/* The first parameter (model order) whose gradient holds a NaN or an Inf, and the
 * element's index; SIZE_MAX when none. One pass over the gradients (f32 or f64, the dtypes
 * clipping takes), before clipping scales them all by a NaN coefficient. */
size_t ddp__train_first_nonfinite_grad(const ddp__trainer_t *t, int64_t *elem) {
  for (size_t i = 0; i < ddp_model_num_params(t->model); i++) {
    const ddp_param_t *p = ddp_model_param(t->model, i);
    const ddp_tensor_t *g = &p->grad;
    if (!p->requires_grad || !g->data) continue;
    for (int64_t k = 0; k < g->numel; k++) {
      double x = g->dtype == DDP_F64   ? ((const double *)g->data)[k]
                 : g->dtype == DDP_F32 ? ((const float *)g->data)[k]
                                       : 0.0;
      if (!isfinite(x)) {
        *elem = k;
        return i;
      }
    }
  }
  return SIZE_MAX;
}

/* halt_on_nonfinite: a NaN or Inf `what` (the gradient norm, the loss) at step `done` stops
 * the run, naming the first parameter with a non-finite gradient when bad < SIZE_MAX;
 * false: rank 0 warns and the run goes on. Every rank sees the same all-reduced value, so
 * every rank stops at the same step. */
ddp_status_t ddp__train_nonfinite(ddp__trainer_t *t, int64_t done, const char *what, double v,
                                  size_t bad, int64_t elem) {
  char where[600] = "";
  if (bad != SIZE_MAX) {
    snprintf(where, sizeof where,
             "; the first parameter with a non-finite gradient is %s (element %lld)",
             ddp_model_param(t->model, bad)->name, (long long)elem);
  }
  if (!t->a->halt_on_nonfinite) {
    if (t->rank == 0)
      ddp__log(t->rank, DDP_LOG_WARN,
               "trainer: step %lld: the %s is %g%s (halt_on_nonfinite false: training goes on)",
               (long long)done, what, isnan(v) ? fabs(v) : v, where);
    return DDP_OK;
  }
  return ddp__error(t->err, t->rank, DDP_ERR_INVALID_DATA,
                    "trainer: step %lld: the %s is %g%s; the run stops before the step's "
                    "update and save, so the last checkpoint is of an earlier step "
                    "(halt_on_nonfinite false: warn and go on)",
                    (long long)done, what, isnan(v) ? fabs(v) : v, where);
}
