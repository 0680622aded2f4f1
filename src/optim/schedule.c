/* Hugging Face's learning-rate schedules (transformers/optimization.py, get_scheduler):
 * each is a LambdaLR multiplier of the base learning rate, a pure function of the
 * scheduler's step count. The formulas are restated here from their definitions:
 *   warmup (step < W, all but constant):  step / max(1, W)
 *   constant_with_warmup:     1 after warmup
 *   linear:                   max(0, (T - step) / max(1, T - W))
 *   cosine (num_cycles c):    progress = (step - W) / max(1, T - W);
 *                             max(0, 0.5 * (1 + cos(pi * c * 2 * progress)))
 *   cosine_with_restarts (c): 0 once progress >= 1, else
 *                             max(0, 0.5 * (1 + cos(pi * ((c * progress) mod 1))))
 *   polynomial (lr_init L, lr_end E, power p): E / L after step T, else
 *                             ((L - E) * (1 - (step - W) / (T - W))^p + E) / L
 *   inverse_sqrt (timescale S): 1 / sqrt((step + S - W) / S)
 *   cosine_with_min_lr (c, rate r): f = cosine's wave before the max;
 *                             max(0, f * (1 - r) + r)
 * all in double, in the order Python evaluates them (Python's float % is C's fmod for the
 * non-negative operands here, ** is pow), so the values are bitwise those of the Python
 * lambdas on the same libm (tools/torch/hf_schedules.py; tests/test_optim.c). */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "ddp/optim.h"

static const char *const lr_names[] = {"constant",     "constant_with_warmup", "linear",
                                       "cosine",       "cosine_with_restarts", "polynomial",
                                       "inverse_sqrt", "cosine_with_min_lr"};

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
                    "constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, "
                    "inverse_sqrt, cosine_with_min_lr",
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
  bool cos_kind = s->kind == DDP_LR_COSINE || s->kind == DDP_LR_COSINE_WITH_RESTARTS ||
                  s->kind == DDP_LR_COSINE_WITH_MIN_LR;
  if ((s->kind == DDP_LR_LINEAR || cos_kind || s->kind == DDP_LR_POLYNOMIAL) &&
      s->num_training_steps < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lr schedule %s requires `num_training_steps` >= 1, got %lld",
                      lr_names[s->kind], (long long)s->num_training_steps);
  if (cos_kind && !(isfinite(s->num_cycles) && s->num_cycles >= 0))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "lr schedule %s: num_cycles %g",
                      lr_names[s->kind], s->num_cycles);
  if (s->kind == DDP_LR_POLYNOMIAL) {
    if (s->num_training_steps <= s->num_warmup_steps)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "lr schedule polynomial: num_training_steps %lld must exceed "
                        "num_warmup_steps %lld (the decay divides by their difference)",
                        (long long)s->num_training_steps, (long long)s->num_warmup_steps);
    if (!(isfinite(s->lr_init) && isfinite(s->lr_end) && isfinite(s->power) &&
          s->lr_init > s->lr_end))
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "lr schedule polynomial: lr_end (%g) must be smaller than initial lr "
                        "(%g), power %g",
                        s->lr_end, s->lr_init, s->power);
  }
  if (s->kind == DDP_LR_COSINE_WITH_MIN_LR && !isfinite(s->min_lr_rate))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lr schedule cosine_with_min_lr: min_lr_rate %g", s->min_lr_rate);
  if (s->kind == DDP_LR_INVERSE_SQRT && s->timescale < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lr schedule inverse_sqrt: timescale %lld is negative",
                      (long long)s->timescale);
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
    case DDP_LR_COSINE_WITH_RESTARTS: {
      if (step < w) return (double)step / at_least_one(w);
      double progress = (double)(step - w) / at_least_one(t - w);
      if (progress >= 1.0) return 0.0;
      double v = 0.5 * (1.0 + cos(M_PI * fmod(s->num_cycles * progress, 1.0)));
      return v > 0.0 ? v : 0.0;
    }
    case DDP_LR_POLYNOMIAL: {
      if (step < w) return (double)step / at_least_one(w);
      if (step > t) return s->lr_end / s->lr_init;
      double range = s->lr_init - s->lr_end;
      double remaining = 1.0 - (double)(step - w) / (double)(t - w);
      return (range * pow(remaining, s->power) + s->lr_end) / s->lr_init;
    }
    case DDP_LR_COSINE_WITH_MIN_LR: {
      if (step < w) return (double)step / at_least_one(w);
      double progress = (double)(step - w) / at_least_one(t - w);
      double f = 0.5 * (1.0 + cos(M_PI * s->num_cycles * 2.0 * progress));
      f = f * (1.0 - s->min_lr_rate) + s->min_lr_rate;
      return f > 0.0 ? f : 0.0;
    }
    case DDP_LR_INVERSE_SQRT: {
      if (step < w) return (double)step / at_least_one(w);
      int64_t ts = s->timescale > 0 ? s->timescale : (w ? w : 10000);
      return 1.0 / sqrt((double)(step + ts - w) / (double)ts);
    }
  }
  DDP_REQUIRE(!"unknown lr schedule kind");
  return 0.0;
}

double ddp_lr_at(const ddp_lr_schedule_t *s, double base_lr, int64_t step) {
  return base_lr * ddp_lr_lambda(s, step);
}
