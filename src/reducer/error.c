/* The reducer's last error and its discipline (docs/errors.md): a failure is logged once,
 * where it starts.
 *
 * - What the reducer detects itself (PyTorch's shape, "marked ready twice" and
 *   unfinished-reduction errors, a bad layout from rank 0, out of memory) goes through
 *   ddp__ddp_fail: it fills the handle's last error and logs one ERROR line.
 * - What fails below it (a collective, a launch, the autograd context) has been logged
 *   there; ddp__ddp_carry adds the reducer's context (which collective, which bucket and
 *   its parameters, the hint about unused parameters) to the last error without logging.
 *   The inner message already names the rank ("rank 1: allreduce #12 ..."), so the
 *   reducer's context does not repeat it.
 * - Once a collective has failed, the reducer issues no further one in that backward:
 *   works already in flight are drained (ddp__ddp_drain) without touching the error.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

static void fill(ddp_ddp_t *d, ddp_status_t st, const char *fmt, va_list ap) {
  d->err.status = st;
  vsnprintf(d->err.msg, sizeof d->err.msg, fmt, ap);
}

ddp_status_t ddp__ddp_fail(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fill(d, st, fmt, ap);
  va_end(ap);
  ddp__log(d->rank, DDP_LOG_ERROR, "%s", d->err.msg);
  return st;
}

ddp_status_t ddp__ddp_carry(ddp_ddp_t *d, ddp_status_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fill(d, st, fmt, ap);
  va_end(ap);
  return st;
}

ddp_status_t ddp__ddp_oom(ddp_ddp_t *d) {
  return ddp__ddp_fail(d, DDP_ERR_NO_MEMORY, "[rank %d] DDP: out of memory", d->rank);
}

void ddp__ddp_error_clear(ddp_ddp_t *d) {
  d->err.status = DDP_OK;
  d->err.msg[0] = 0;
}

const char *ddp__ddp_pg_error(ddp_ddp_t *d) {
  ddp_pg_last_error_copy(d->pg, &d->pg_err);
  return d->pg_err.msg;
}

const char *ddp__ddp_ctx_error(ddp_ddp_t *d, const ddp_ctx_t *ctx) {
  ddp_ctx_last_error_copy(ctx, &d->ctx_err);
  return d->ctx_err.msg;
}

void ddp__ddp_error_copy(const ddp_ddp_t *d, ddp_status_t st, ddp_error_t *err) {
  if (!err) return;
  err->status = st;
  memcpy(err->msg, d->err.msg, sizeof err->msg);
}

ddp_status_t ddp__ddp_wait(ddp_ddp_t *d, ddp_work_t **w, const char *what) {
  if (!*w) return DDP_OK;
  ddp_status_t st = ddp_work_wait(*w, -1);
  if (st != DDP_OK)
    ddp__ddp_carry(d, st, "DDP %s failed: %s", what,
                   ddp_work_error(*w)[0] ? ddp_work_error(*w) : ddp__ddp_pg_error(d));
  ddp_work_free(*w);
  *w = NULL;
  return st;
}

void ddp__ddp_drain(ddp_work_t **w) {
  if (!*w) return;
  ddp_work_wait(*w, -1);
  ddp_work_free(*w);
  *w = NULL;
}

void ddp__ddp_append_names(char *buf, size_t cap, const ddp_ddp_t *d, const size_t *idx, size_t n,
                           const char *sep) {
  size_t len = strlen(buf);
  for (size_t k = 0; k < n && len + 1 < cap; k++) {
    int w = snprintf(buf + len, cap - len, "%s%s", k ? sep : "", d->params[idx[k]]->name);
    if (w < 0) break;
    len += (size_t)w;
    if (len >= cap) len = cap - 1;
  }
}

void ddp_ddp_last_error_copy(const ddp_ddp_t *d, ddp_error_t *out) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && out);
  *out = d->err;
}
