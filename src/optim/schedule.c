/* Hugging Face's learning-rate schedules (transformers/optimization.py, get_scheduler):
 * each is a LambdaLR multiplier of the base learning rate, a pure function of the
 * scheduler's step count. The formulas are restated here from their definitions:
 *   warmup (step < W):        step / max(1, W)
 *   constant_with_warmup:     1 after warmup
 *   linear:                   max(0, (T - step) / max(1, T - W))
 *   cosine (num_cycles c):    progress = (step - W) / max(1, T - W);
 *                             max(0, 0.5 * (1 + cos(pi * c * 2 * progress)))
 * all in double, in the order Python evaluates them, so the values are bitwise those of
 * the Python lambdas on the same libm. */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "ddp/optim.h"

static const char *const lr_names[] = {"constant", "constant_with_warmup", "linear", "cosine"};

const char *ddp_lr_kind_name(ddp_lr_kind_t kind) {
  if ((int)kind < 0 || (size_t)kind >= DDP_ARRAY_LEN(lr_names)) return "?";
  return lr_names[kind];
}

ddp_status_t ddp_lr_kind_from_name(const char *name, ddp_lr_kind_t *out, ddp_error_t *err) {
  DDP_REQUIRE(name && out);
  for (size_t i = 0; i < DDP_ARRAY_LEN(lr_names); i++) {
    if (strcmp(name, lr_names[i]) == 0) {
      *out = (ddp_lr_kind_t)i;
      return DDP_OK;
    }
  }
  return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                    "lr_scheduler_type '%s' is not supported; choose one of constant, "
                    "constant_with_warmup, linear, cosine",
                    name);
}

ddp_status_t ddp_lr_schedule_check(const ddp_lr_schedule_t *s, ddp_error_t *err) {
  DDP_REQUIRE(s);
  if ((int)s->kind < 0 || (size_t)s->kind >= DDP_ARRAY_LEN(lr_names))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "lr schedule: unknown kind %d",
                      (int)s->kind);
  if (s->num_warmup_steps < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lr schedule %s: num_warmup_steps %lld is negative", lr_names[s->kind],
                      (long long)s->num_warmup_steps);
  if ((s->kind == DDP_LR_LINEAR || s->kind == DDP_LR_COSINE) && s->num_training_steps < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lr schedule %s requires `num_training_steps` >= 1, got %lld",
                      lr_names[s->kind], (long long)s->num_training_steps);
  if (s->kind == DDP_LR_COSINE && !isfinite(s->num_cycles))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "lr schedule cosine: num_cycles %g",
                      s->num_cycles);
  return DDP_OK;
}

/* max(1, n) as a double, the denominators' guard against division by zero. */
static double at_least_one(int64_t n) { return n < 1 ? 1.0 : (double)n; }

double ddp_lr_lambda(const ddp_lr_schedule_t *s, int64_t step) {
  DDP_REQUIRE(s);
  int64_t w = s->num_warmup_steps, t = s->num_training_steps;
  switch (s->kind) {
    case DDP_LR_CONSTANT: return 1.0;
    case DDP_LR_CONSTANT_WITH_WARMUP:
      if (step < w) return (double)step / at_least_one(w);
      return 1.0;
    case DDP_LR_LINEAR: {
      if (step < w) return (double)step / at_least_one(w);
      double v = (double)(t - step) / at_least_one(t - w);
      return v > 0.0 ? v : 0.0;
    }
    case DDP_LR_COSINE: {
      if (step < w) return (double)step / at_least_one(w);
      double progress = (double)(step - w) / at_least_one(t - w);
      double v = 0.5 * (1.0 + cos(M_PI * s->num_cycles * 2.0 * progress));
      return v > 0.0 ? v : 0.0;
    }
  }
  DDP_REQUIRE(!"unknown lr schedule kind");
  return 0.0;
}

double ddp_lr_at(const ddp_lr_schedule_t *s, double base_lr, int64_t step) {
  return base_lr * ddp_lr_lambda(s, step);
}
