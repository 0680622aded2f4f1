/* The trainer's one JSON writer (train_internal.h): metrics.jsonl lines, trainer_state.json
 * and a dump's config object. Members are separated by ", " and keys followed by ": ",
 * Python's json.dumps layout, which is what readers of these files have always seen. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "train/train_internal.h"

DDP_PRINTF(2, 3)
static void put(ddp__json_t *j, const char *fmt, ...) {
  if (j->oom) return;
  for (int pass = 0; pass < 2; pass++) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(j->buf ? j->buf + j->len : NULL, j->buf ? j->cap - j->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      j->oom = true;
      return;
    }
    if (j->buf && j->len + (size_t)n < j->cap) {
      j->len += (size_t)n;
      return;
    }
    size_t cap = DDP_MAX(2 * j->cap, j->len + (size_t)n + 256);
    char *b = ddp__realloc(j->buf, cap);
    if (!b) {
      j->oom = true;
      return;
    }
    j->buf = b;
    j->cap = cap;
  }
}

/* s as a JSON string: quotes, backslashes and control bytes escaped, other bytes as they
 * are (UTF-8 passes through). */
static void put_string(ddp__json_t *j, const char *s) {
  put(j, "\"");
  for (const char *p = s; *p; p++) {
    unsigned char c = (unsigned char)*p;
    if (c == '"' || c == '\\') {
      put(j, "\\%c", c);
    } else if (c == '\n') {
      put(j, "\\n");
    } else if (c == '\t') {
      put(j, "\\t");
    } else if (c == '\r') {
      put(j, "\\r");
    } else if (c < 0x20) {
      put(j, "\\u%04x", c);
    } else {
      size_t n = strcspn(p, "\"\\\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f\x10"
                            "\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f");
      put(j, "%.*s", (int)n, p);
      p += n - 1;
    }
  }
  put(j, "\"");
}

static void key(ddp__json_t *j, const char *k) {
  if (!j->first) put(j, ", ");
  j->first = false;
  put_string(j, k);
  put(j, ": ");
}

void ddp__json_begin(ddp__json_t *j) {
  *j = (ddp__json_t){.first = true};
  put(j, "{");
}

void ddp__json_object(ddp__json_t *j, const char *k) {
  key(j, k);
  put(j, "{");
  j->first = true;
}

void ddp__json_end(ddp__json_t *j) {
  put(j, "}");
  j->first = false;
}

void ddp__json_int(ddp__json_t *j, const char *k, long long v) {
  key(j, k);
  put(j, "%lld", v);
}

void ddp__json_uint(ddp__json_t *j, const char *k, unsigned long long v) {
  key(j, k);
  put(j, "%llu", v);
}

void ddp__json_num(ddp__json_t *j, const char *k, const char *fmt, double v) {
  key(j, k);
  if (!isfinite(v)) {
    put(j, "null");
    return;
  }
  char b[64];
  snprintf(b, sizeof b, fmt, v);
  put(j, "%s", b);
}

void ddp__json_str(ddp__json_t *j, const char *k, const char *s) {
  key(j, k);
  put_string(j, s);
}

void ddp__json_bool(ddp__json_t *j, const char *k, bool v) {
  key(j, k);
  put(j, v ? "true" : "false");
}

void ddp__json_raw(ddp__json_t *j, const char *k, const char *json) {
  key(j, k);
  put(j, "%s", json);
}

void ddp__json_append(ddp__json_t *j, const char *text) { put(j, "%s", text); }

char *ddp__json_take(ddp__json_t *j) {
  char *s = j->oom ? NULL : j->buf;
  if (!s) ddp__free(j->buf);
  *j = (ddp__json_t){0};
  return s;
}

void ddp__json_free(ddp__json_t *j) { ddp__free(ddp__json_take(j)); }
