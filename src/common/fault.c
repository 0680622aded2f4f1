/* Fault injection: the one parser of a fault spec (DDP_FAULT and ddp-train's --ddp_fault)
 * and the actions that need no process group (docs/errors.md, "Fault injection"). The
 * injection points are src/pg/fault.c (collective=K, wrong_shape, corrupt_bucket, and the
 * crash and hang of a rank inside its group) and src/train/faults.c (step=S, skip_backward,
 * corrupt_bucket:after). */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"

static const char *const kind_names[] = {"none",          "crash",       "hang",          "slow",
                                         "skip_backward", "wrong_shape", "corrupt_bucket"};

const char *ddp_fault_kind_name(ddp_fault_kind_t k) {
  return (unsigned)k < DDP_ARRAY_LEN(kind_names) ? kind_names[k] : "?";
}

static ddp_status_t field_error(ddp_error_t *err, const char *field, const char *fmt, ...)
    DDP_PRINTF(3, 4);
static ddp_status_t field_error(ddp_error_t *err, const char *field, const char *fmt, ...) {
  char detail[320];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT, "DDP_FAULT field '%s': %s", field, detail);
}

/* A decimal integer in [lo, hi], the whole of s. */
static bool parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (errno || end == s || *end || x < lo || x > hi) return false;
  *out = x;
  return true;
}

static char *trim(char *s) {
  while (*s == ' ' || *s == '\t') s++;
  size_t n = strlen(s);
  while (n && (s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = 0;
  return s;
}

static ddp_status_t parse_kind(char *v, ddp_fault_t *f, ddp_error_t *err) {
  char *arg = strchr(v, ':');
  if (arg) *arg++ = 0;
  for (int k = DDP_FAULT_CRASH; k <= DDP_FAULT_CORRUPT_BUCKET; k++) {
    if (strcmp(v, kind_names[k]) != 0) continue;
    f->kind = (ddp_fault_kind_t)k;
    if (k == DDP_FAULT_SLOW) {
      if (!arg || !parse_int(arg, 0, 86400000, &f->slow_ms))
        return field_error(err, "kind",
                           "slow needs milliseconds in [0, 86400000] (slow:500), "
                           "got \"slow%s%s\"",
                           arg ? ":" : "", arg ? arg : "");
    } else if (k == DDP_FAULT_CORRUPT_BUCKET && arg) {
      if (strcmp(arg, "before") && strcmp(arg, "after"))
        return field_error(err, "kind", "corrupt_bucket takes :before or :after, got \":%s\"", arg);
      f->after = !strcmp(arg, "after");
    } else if (arg) {
      return field_error(err, "kind", "%s takes no \":%s\"", v, arg);
    }
    return DDP_OK;
  }
  return field_error(err, "kind",
                     "\"%s\" is not one of crash, hang, slow:MS, skip_backward, "
                     "wrong_shape, corrupt_bucket[:before|:after]",
                     v);
}

ddp_status_t ddp_fault_parse(const char *spec, ddp_fault_t *out, ddp_error_t *err) {
  DDP_REQUIRE(out);
  *out = (ddp_fault_t){DDP_FAULT_NONE, -1, -1, -1, 0, false};
  if (!spec) return DDP_OK;
  char buf[256];
  if (strlen(spec) >= sizeof buf)
    return field_error(err, "spec", "longer than %zu characters", sizeof buf - 1);
  snprintf(buf, sizeof buf, "%s", spec);
  if (!*trim(buf)) return DDP_OK;
  ddp_fault_t f = *out;
  bool has_rank = false, has_kind = false;
  char *save = NULL;
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(item, '=');
    if (!eq)
      return field_error(err, trim(item),
                         "expected key=value (keys rank, step, collective, "
                         "kind)");
    *eq = 0;
    char *key = trim(item), *v = trim(eq + 1);
    if (!strcmp(key, "rank")) {
      int64_t r;
      if (!parse_int(v, 0, 65535, &r))
        return field_error(err, "rank", "\"%s\" is not an integer in [0, 65535]", v);
      f.rank = (int)r;
      has_rank = true;
    } else if (!strcmp(key, "step") || !strcmp(key, "collective")) {
      int64_t *dst = key[0] == 's' ? &f.step : &f.collective;
      if (!parse_int(v, 0, INT64_MAX, dst))
        return field_error(err, key, "\"%s\" is not an integer >= 0", v);
    } else if (!strcmp(key, "kind")) {
      DDP_CHECK(parse_kind(v, &f, err));
      has_kind = true;
    } else {
      return field_error(err, key, "unknown key (the keys are rank, step, collective, kind)");
    }
  }
  if (!has_rank) return field_error(err, "rank", "missing (rank=R names the culprit)");
  if (!has_kind) return field_error(err, "kind", "missing (kind=crash, hang, slow:MS, ...)");
  if ((f.step >= 0) == (f.collective >= 0))
    return field_error(err, f.step >= 0 ? "collective" : "step",
                       "give exactly one of step=S and collective=K");
  if (f.collective >= 0 &&
      (f.kind == DDP_FAULT_SKIP_BACKWARD || (f.kind == DDP_FAULT_CORRUPT_BUCKET && f.after)))
    return field_error(err, "collective", "kind %s%s happens at a training step: use step=S",
                       kind_names[f.kind], f.after ? ":after" : "");
  *out = f;
  return DDP_OK;
}

ddp_status_t ddp_fault_from_env(ddp_fault_t *out, ddp_error_t *err) {
  const char *v = ddp_env_get(DDP_ENV_FAULT);
  ddp_status_t st = ddp_fault_parse(v, out, err);
  if (st != DDP_OK && err) {
    char msg[DDP_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", err->msg);
    ddp__error_quiet(err, st, "DDP_FAULT=\"%.160s\": %.300s", v, msg);
  }
  return st;
}

int64_t ddp__fault_log(const ddp_fault_t *f, int rank, const char *where) {
  int64_t now = ddp_now_ns();
  char kind[48];
  if (f->kind == DDP_FAULT_SLOW) {
    snprintf(kind, sizeof kind, "slow:%" PRId64, f->slow_ms);
  } else {
    snprintf(kind, sizeof kind, "%s%s", ddp_fault_kind_name(f->kind),
             f->kind == DDP_FAULT_CORRUPT_BUCKET ? (f->after ? ":after" : ":before") : "");
  }
  ddp__log(rank, DDP_LOG_WARN, "fault injection: %s on rank %d at %s (t=%.6f s, CLOCK_MONOTONIC)",
           kind, rank, where, (double)now * 1e-9);
  return now;
}

_Noreturn void ddp__fault_crash_process(const ddp_fault_t *f, int rank, const char *where) {
  ddp__fault_log(f, rank, where);
  fflush(stderr);
  kill(getpid(), SIGKILL);
  _exit(137); /* not reached */
}

void ddp__fault_flip_bits(void *buf, size_t count, size_t es) {
  if (!buf || count == 0 || es == 0) return;
  unsigned char *b = buf;
  /* Little-endian: the last byte of an element holds the sign and the top exponent bits;
   * 0x40 is the exponent's most significant bit for F32, F64, F16 and BF16. */
  b[es - 1] ^= 0x40;
  b[(count - 1) * es] ^= 0x01;
}
