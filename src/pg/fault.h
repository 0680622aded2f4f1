/* Fault injection inside a process group (private to src/pg; docs/errors.md, "Fault
 * injection"). pg.c keeps one ddp__pg_fault_t per group, filled from DDP_FAULT at create,
 * and calls ddp__pg_fault_submit at the top of every collective's entry point. */
#ifndef DDP_SRC_PG_FAULT_H
#define DDP_SRC_PG_FAULT_H

#include "algo/algo.h"
#include "ddp/pg.h"

/* What the fault layer needs of its group, given by pg.c (which owns the group's state) at
 * init: this file includes nothing of pg.c's and calls nothing of it, so pg.c calls down
 * into it and never the other way round (tools/maint/check_layers.py checks both). */
typedef struct ddp__pg_fault_ops {
  /* True when a peer has failed the group while this rank runs no collective (shared
   * family: the control block says so; other backends cannot tell without a collective,
   * and answer false). */
  bool (*peers_failed)(ddp_pg_t *pg);
  ddp_status_t (*status)(const ddp_pg_t *pg);      /* ddp_pg_status's contract */
  void (*abort)(ddp_pg_t *pg, const char *reason); /* ddp_pg_abort_reason's contract */
} ddp__pg_fault_ops_t;

typedef struct ddp__pg_fault {
  ddp_fault_t spec;   /* this rank's collective=K fault; kind NONE when there is none */
  bool shape_armed;   /* the next collective with a count > 0 gets count - 1 */
  bool corrupt_armed; /* the next floating-point allreduce gets bits flipped in its input */
  int rank;
  bool threads; /* the ranks are threads of one process: a crash aborts instead */
  ddp__pg_fault_ops_t ops;
} ddp__pg_fault_t;

/* Reads DDP_FAULT; keeps it when it names this rank and a collective (a step= fault is
 * ddp_train's). A malformed spec is DDP_ERR_INVALID_ARGUMENT naming the field. */
ddp_status_t ddp__pg_fault_init(ddp__pg_fault_t *f, int rank, bool threads,
                                const ddp__pg_fault_ops_t *ops, ddp_error_t *err);

/* Whether ddp__pg_fault_submit has anything to do. */
static inline bool ddp__pg_fault_active(const ddp__pg_fault_t *f) {
  return f->spec.kind != DDP_FAULT_NONE || f->shape_armed || f->corrupt_armed;
}

/* At the top of a collective's entry point, on the issuing thread, before the argument
 * checks: seq is the sequence number the collective will get (-1 for point-to-point). Fires
 * the collective=K fault when seq == K, then applies an armed wrong_shape (c->count - 1) or
 * corrupt_bucket (bits of c->send flipped). DDP_OK: go on; else the collective fails with
 * that status (an injected crash on the threads backend, a released hang: both abort the
 * group first, with the reason ddp_pg_last_error_copy then quotes); err (may be NULL) gets the
 * message. */
ddp_status_t ddp__pg_fault_submit(ddp_pg_t *pg, ddp__pg_fault_t *f, int64_t seq, ddp__coll_t *c,
                                  int64_t timeout_ms, ddp_error_t *err);

/* Runs fault `what` now on this rank (ddp_pg_inject_fault's contract in ddp/pg.h). */
ddp_status_t ddp__pg_fault_fire(ddp_pg_t *pg, ddp__pg_fault_t *f, const ddp_fault_t *what,
                                const char *where, int64_t timeout_ms, ddp_error_t *err);

#endif /* DDP_SRC_PG_FAULT_H */
