/* Fault injection in the training loop (contract in faults.h). */
#include "train/faults.h"

#include <inttypes.h>
#include <stdio.h>

#include "common/common.h"

ddp_status_t ddp__train_fault_init(ddp__train_fault_t *f, int rank, ddp_error_t *err) {
  f->rank = rank;
  f->mine = false;
  ddp_status_t st = ddp_fault_from_env(&f->spec, err); /* quiet: reported here, once */
  if (st != DDP_OK) return ddp__error(err, rank, st, "trainer: %s", err ? err->msg : "");
  f->mine = f->spec.kind != DDP_FAULT_NONE && f->spec.rank == rank && f->spec.step >= 0;
  return DDP_OK;
}

ddp_status_t ddp__train_fault_check(const ddp__train_fault_t *f, int world, int64_t max_steps,
                                    ddp_error_t *err) {
  const ddp_fault_t *s = &f->spec;
  if (s->kind == DDP_FAULT_NONE) return DDP_OK;
  char why[160] = "";
  if (s->rank >= world)
    snprintf(why, sizeof why, "rank %d is beyond the world size %d (ranks 0 to %d)", s->rank, world,
             world - 1);
  else if (s->step >= max_steps)
    snprintf(why, sizeof why,
             "step %" PRId64 " is beyond the run's last step %" PRId64 " (steps are 0-based; "
             "max_steps %" PRId64 ")",
             s->step, max_steps - 1, max_steps);
  if (!why[0]) return DDP_OK;
  const char *v = ddp_env_get(DDP_ENV_FAULT);
  /* Every rank refuses; rank 0 says why (the same line from every rank is noise). */
  if (f->rank == 0)
    return ddp__error(err, f->rank, DDP_ERR_INVALID_ARGUMENT,
                      "trainer: --ddp_fault (DDP_FAULT) \"%.160s\" can never fire: %s", v ? v : "",
                      why);
  return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                          "trainer: --ddp_fault (DDP_FAULT) \"%.160s\" can never fire: %s",
                          v ? v : "", why);
}

ddp_status_t ddp__train_fault_step(ddp__train_fault_t *f, ddp_pg_t *pg, int64_t step,
                                   ddp_error_t *err) {
  if (!f->mine || step != f->spec.step) return DDP_OK;
  ddp_fault_kind_t k = f->spec.kind;
  if (k == DDP_FAULT_SKIP_BACKWARD || (k == DDP_FAULT_CORRUPT_BUCKET && f->spec.after))
    return DDP_OK; /* later in the step */
  char where[64];
  snprintf(where, sizeof where, "step %" PRId64, step);
  ddp_error_t e = {DDP_OK, ""};
  ddp_status_t st = ddp_pg_inject_fault(pg, &f->spec, where, &e);
  if (st != DDP_OK) return ddp__error_quiet(err, st, "trainer: %s", e.msg); /* pg logged it */
  return DDP_OK;
}

bool ddp__train_fault_skips(ddp__train_fault_t *f, int64_t step, int64_t micro) {
  if (!f->mine || step != f->spec.step || f->spec.kind != DDP_FAULT_SKIP_BACKWARD) return false;
  if (micro == 0) {
    char where[64];
    snprintf(where, sizeof where, "step %" PRId64 " (forward only)", step);
    ddp__fault_log(&f->spec, f->rank, where);
  }
  return true;
}

void ddp__train_fault_after_backward(ddp__train_fault_t *f, ddp_model_t *model, int64_t step) {
  if (!f->mine || step != f->spec.step || f->spec.kind != DDP_FAULT_CORRUPT_BUCKET ||
      !f->spec.after)
    return;
  char where[80];
  snprintf(where, sizeof where, "step %" PRId64 " (reduced gradients)", step);
  ddp__fault_log(&f->spec, f->rank, where);
  static const ddp_dtype_t dts[] = {DDP_F32, DDP_F64, DDP_BF16, DDP_F16};
  for (size_t i = 0; i < DDP_ARRAY_LEN(dts); i++) {
    ddp_tensor_t g = ddp_model_flat_grads(model, dts[i]);
    if (g.numel == 0 || !g.data) continue;
    ddp__fault_flip_bits(g.data, (size_t)g.numel, ddp_dtype_size(g.dtype));
    return;
  }
}

void ddp__train_fault_end(const ddp__train_fault_t *f, ddp_status_t st, const char *msg) {
  if (f->spec.kind == DDP_FAULT_NONE || st == DDP_OK) return;
  ddp__log(f->rank, DDP_LOG_WARN,
           "fault injection: rank %d failed at t=%.6f s (CLOCK_MONOTONIC): %s: %s", f->rank,
           (double)ddp_now_ns() * 1e-9, ddp_status_name(st), msg);
}
