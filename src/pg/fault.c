/* Fault injection inside a process group (contract in fault.h and ddp/pg.h; the spec parser
 * is src/common/fault.c). Every action logs "fault injection: ..." with its CLOCK_MONOTONIC
 * time first, so that a test or a user can time the survivors' errors from it. */
#include "pg/fault.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/common.h"

ddp_status_t ddp__pg_fault_init(ddp__pg_fault_t *f, int rank, bool threads,
                                const ddp__pg_fault_ops_t *ops, ddp_error_t *err) {
  memset(f, 0, sizeof *f);
  f->rank = rank;
  f->threads = threads;
  f->ops = *ops;
  ddp_fault_t spec;
  ddp_error_t e = {DDP_OK, ""};
  ddp_status_t st = ddp_fault_from_env(&spec, &e); /* quiet: logged here, once */
  if (st != DDP_OK) return ddp__error(err, rank, st, "rank %d: %s", rank, e.msg);
  if (spec.kind != DDP_FAULT_NONE && spec.rank == rank && spec.collective >= 0) f->spec = spec;
  return DDP_OK;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

ddp_status_t ddp__pg_fault_fire(ddp_pg_t *pg, ddp__pg_fault_t *f, const ddp_fault_t *what,
                                const char *where, int64_t timeout_ms, ddp_error_t *err) {
  int rank = f->rank;
  bool threads = f->threads;
  char why[192];
  switch (what->kind) {
    case DDP_FAULT_CRASH:
      if (!threads) ddp__fault_crash_process(what, rank, where);
      /* Thread ranks share the process: the rank fails instead, and aborts its group so
       * that the others fail at once (they see "rank R aborted the group"). */
      ddp__fault_log(what, rank, where);
      snprintf(why, sizeof why, "fault injection: crash at %s", where);
      f->ops.abort(pg, why);
      return ddp__error(err, rank, DDP_ERR_ABORTED,
                        "rank %d: fault injection: crash at %s (threads backend: the rank "
                        "aborted its group)",
                        rank, where);
    case DDP_FAULT_HANG: {
      /* No collective is entered. The hang ends when the group has failed (the others
       * timed out and told this rank: on the shared backends the control block says so),
       * or after the timeout plus 1 s, so that thread ranks and an unsupervised process end
       * by themselves. */
      int64_t t0 = ddp__fault_log(what, rank, where);
      int64_t end = t0 + (timeout_ms + 1000) * 1000000LL;
      bool told = false;
      while (ddp_now_ns() < end && f->ops.status(pg) == DDP_OK && !(told = f->ops.peers_failed(pg)))
        sleep_ms(10);
      ddp_status_t gst = told ? DDP_ERR_REMOTE : f->ops.status(pg);
      double ms = (double)(ddp_now_ns() - t0) * 1e-6;
      snprintf(why, sizeof why, "fault injection: hang at %s released after %.0f ms", where, ms);
      f->ops.abort(pg, why);
      return ddp__error(err, rank, DDP_ERR_ABORTED,
                        "rank %d: fault injection: hang at %s released after %.0f ms (%s)", rank,
                        where, ms, gst != DDP_OK ? "the group had failed" : "timeout + 1 s");
    }
    case DDP_FAULT_SLOW:
      ddp__fault_log(what, rank, where);
      sleep_ms(what->slow_ms);
      return DDP_OK;
    case DDP_FAULT_WRONG_SHAPE:
      ddp__fault_log(what, rank, where);
      f->shape_armed = true;
      return DDP_OK;
    case DDP_FAULT_CORRUPT_BUCKET:
      ddp__fault_log(what, rank, where);
      f->corrupt_armed = true;
      return DDP_OK;
    default:
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "rank %d: fault injection: kind %s cannot happen in a process group", rank,
                        ddp_fault_kind_name(what->kind));
  }
}

static bool float_dtype(ddp_dtype_t dt) {
  return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16;
}

ddp_status_t ddp__pg_fault_submit(ddp_pg_t *pg, ddp__pg_fault_t *f, int64_t seq, ddp__coll_t *c,
                                  int64_t timeout_ms, ddp_error_t *err) {
  int rank = f->rank;
  const char *what = ddp_coll_kind_name(c->kind);
  if (f->spec.kind != DDP_FAULT_NONE && seq >= 0 && seq == f->spec.collective) {
    char where[96];
    snprintf(where, sizeof where, "%s #%" PRId64, what, seq);
    ddp_fault_t spec = f->spec;
    f->spec.kind = DDP_FAULT_NONE; /* once */
    DDP_CHECK(ddp__pg_fault_fire(pg, f, &spec, where, timeout_ms, err));
  }
  if (f->shape_armed && c->count > 0) {
    f->shape_armed = false;
    ddp__log(rank, DDP_LOG_WARN,
             "fault injection: wrong_shape: %s #%" PRId64 " issued with count %zu instead of %zu",
             what, seq, c->count - 1, c->count);
    c->count--;
  }
  if (f->corrupt_armed && c->kind == DDP_COLL_ALLREDUCE && float_dtype(c->dt) && c->count > 0) {
    f->corrupt_armed = false;
    ddp__log(rank, DDP_LOG_WARN,
             "fault injection: corrupt_bucket: bits flipped in the input "
             "of allreduce #%" PRId64 " (%zu elements)",
             seq, c->count);
    ddp__fault_flip_bits((void *)c->send, c->count, ddp_dtype_size(c->dt));
  }
  return DDP_OK;
}
