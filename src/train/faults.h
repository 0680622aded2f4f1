/* Fault injection in the training loop (private to src/train; docs/errors.md, "Fault
 * injection"). ddp_train keeps one ddp__train_fault_t, filled from DDP_FAULT, and calls:
 *   ddp__train_fault_step at the top of every optimizer step (before its first collective);
 *   ddp__train_fault_skips around each micro-batch's backward;
 *   ddp__train_fault_after_backward after the step's last backward;
 *   ddp__train_fault_end when ddp_train returns.
 * step=S faults fire here; collective=K faults fire in the process group (src/pg/fault.c). */
#ifndef DDP_TRAIN_FAULTS_H
#define DDP_TRAIN_FAULTS_H

#include "ddp/nn.h"
#include "ddp/pg.h"

typedef struct ddp__train_fault {
  ddp_fault_t spec; /* DDP_FAULT as parsed (kind NONE when unset) */
  int rank;
  bool mine; /* a step=S fault of this rank */
} ddp__train_fault_t;

/* Reads DDP_FAULT (a malformed spec is DDP_ERR_INVALID_ARGUMENT naming the field). */
ddp_status_t ddp__train_fault_init(ddp__train_fault_t *f, int rank, ddp_error_t *err);
/* A fault that can never fire (its rank >= world, its step >= max_steps) is
 * DDP_ERR_INVALID_ARGUMENT naming the spec and why; a rehearsal that silently does nothing
 * would pass for a survived fault. A step before a resumed run's first step is allowed (a
 * restarted job keeps its DDP_FAULT, and the fault fired before the restart). */
ddp_status_t ddp__train_fault_check(const ddp__train_fault_t *f, int world, int64_t max_steps,
                                    ddp_error_t *err);
/* At the top of optimizer step `step`: crash, hang, slow, wrong_shape and corrupt_bucket
 * (before) of this rank at this step, through ddp_pg_inject_fault. */
ddp_status_t ddp__train_fault_step(ddp__train_fault_t *f, ddp_pg_t *pg, int64_t step,
                                   ddp_error_t *err);
/* True when the backward of step `step` is to be skipped on this rank (skip_backward; logs
 * the injection at the step's first micro-batch). */
bool ddp__train_fault_skips(ddp__train_fault_t *f, int64_t step, int64_t micro);
/* corrupt_bucket:after: bits flipped in this rank's reduced gradients at step `step`. */
void ddp__train_fault_after_backward(ddp__train_fault_t *f, ddp_model_t *model, int64_t step);
/* When DDP_FAULT is set and ddp_train fails: logs "fault injection: rank R failed at t=...
 * s (CLOCK_MONOTONIC): MESSAGE", the time a test compares with the injection's. */
void ddp__train_fault_end(const ddp__train_fault_t *f, ddp_status_t st, const char *msg);

#endif /* DDP_TRAIN_FAULTS_H */
