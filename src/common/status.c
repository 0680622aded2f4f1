/* Status names and texts, generated from DDP_STATUS_MAP, and the error recorder. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"

const char *ddp_status_name(ddp_status_t s) {
  if (s == DDP_OK) return "DDP_OK";
  switch (s) {
#define DDP_STATUS_NAME_(name, text) \
  case DDP_ERR_##name: return "DDP_ERR_" #name;
    DDP_STATUS_MAP(DDP_STATUS_NAME_)
#undef DDP_STATUS_NAME_
    default: return "DDP_ERR_UNKNOWN";
  }
}

const char *ddp_status_str(ddp_status_t s) {
  switch (s) {
    case DDP_OK: return "success";
#define DDP_STATUS_TEXT_(name, text) \
  case DDP_ERR_##name: return text;
      DDP_STATUS_MAP(DDP_STATUS_TEXT_)
#undef DDP_STATUS_TEXT_
    default: return "unknown status";
  }
}

_Noreturn void ddp__contract_failed(const char *file, int line, const char *expr) {
  fprintf(stderr, "libddp: contract violated at %s:%d: %s\n", file, line, expr);
  fflush(stderr);
  abort();
}

static void error_fill(ddp_error_t *err, ddp_status_t st, const char *fmt, va_list ap) {
  err->status = st;
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
}

ddp_status_t ddp__verror(ddp_error_t *err, int rank, ddp_status_t st, const char *fmt, va_list ap) {
  ddp_error_t local;
  ddp_error_t *e = err ? err : &local;
  error_fill(e, st, fmt, ap);
  ddp__log(rank, DDP_LOG_ERROR, "%s: %s", ddp_status_name(st), e->msg);
  return st;
}

ddp_status_t ddp__error(ddp_error_t *err, int rank, ddp_status_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ddp__verror(err, rank, st, fmt, ap);
  va_end(ap);
  return st;
}

ddp_status_t ddp__error_quiet(ddp_error_t *err, ddp_status_t st, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    error_fill(err, st, fmt, ap);
    va_end(ap);
  }
  return st;
}

void ddp__error_clear(ddp_error_t *err) {
  if (!err) return;
  err->status = DDP_OK;
  err->msg[0] = '\0';
}
