/* The one JSON reader of libddp's input files (common.h, ddp__json_read): cJSON's parser,
 * with the position of a syntax error as a line and a column, and nothing allowed after
 * the value but white space. */
#include <cjson/cJSON.h>
#include <string.h>

#include "common/common.h"

/* The 1-based line and byte column of at in text. */
static void position(const char *text, const char *at, int *line, int *col) {
  *line = 1;
  const char *bol = text;
  for (const char *p = text; p < at && *p; p++) {
    if (*p == '\n') {
      (*line)++;
      bol = p + 1;
    }
  }
  *col = (int)(at - bol) + 1;
}

/* What stands at the error: the next few bytes of its line, or "the end of the file". */
static void near(const char *at, char *buf, size_t cap) {
  if (!*at) {
    snprintf(buf, cap, "the end of the file");
    return;
  }
  size_t n = strcspn(at, "\r\n");
  snprintf(buf, cap, "\"%.*s%s\"", (int)(n > 24 ? 24 : n), at, n > 24 ? "..." : "");
}

typedef struct key {
  const char *s; /* the key as written, without its quotes */
  size_t len;
  int line;
} key_t_;

/* The first key given twice in one object of valid JSON text: *dup and *first receive the
 * second and the first occurrence; false when none. Keys compare as written (escapes not
 * decoded). One pass; each key is compared with the earlier keys of its object. */
static bool find_duplicate(const char *text, key_t_ *dup, key_t_ *first, ddp_status_t *st) {
  size_t cap = 64, n = 0, depth = 0, dcap = 16;
  key_t_ *keys = ddp__malloc(cap * sizeof *keys);
  size_t *scope = ddp__malloc(dcap * sizeof *scope); /* keys[scope[d]..] are object d's */
  bool found = false;
  *st = DDP_OK;
  if (!keys || !scope) {
    *st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  int line = 1;
  for (const char *p = text; *p && !found; p++) {
    if (*p == '\n') {
      line++;
    } else if (*p == '{') {
      if (depth == dcap) {
        size_t *g = ddp__realloc(scope, 2 * dcap * sizeof *scope);
        if (!g) {
          *st = DDP_ERR_NO_MEMORY;
          goto out;
        }
        scope = g;
        dcap *= 2;
      }
      scope[depth++] = n;
    } else if (*p == '}') {
      n = scope[--depth];
    } else if (*p == '"') {
      const char *s = ++p;
      while (*p != '"') p += *p == '\\' ? 2 : 1;
      key_t_ k = {s, (size_t)(p - s), line};
      const char *q = p + 1;
      while (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n') q++;
      if (*q != ':' || depth == 0) continue;
      for (size_t i = scope[depth - 1]; i < n; i++) {
        if (keys[i].len == k.len && !memcmp(keys[i].s, k.s, k.len)) {
          *dup = k;
          *first = keys[i];
          found = true;
        }
      }
      if (n == cap) {
        key_t_ *g = ddp__realloc(keys, 2 * cap * sizeof *keys);
        if (!g) {
          *st = DDP_ERR_NO_MEMORY;
          goto out;
        }
        keys = g;
        cap *= 2;
      }
      keys[n++] = k;
    }
  }
out:
  ddp__free(keys);
  ddp__free(scope);
  return found;
}

ddp_status_t ddp__json_read(const char *text, const char *src, int rank, struct cJSON **out,
                            ddp_error_t *err) {
  DDP_REQUIRE(text && src && out);
  const char *end = NULL;
  *out = cJSON_ParseWithOpts(text, &end, true);
  if (!*out) {
    const char *at = end && end >= text ? end : text;
    int line, col;
    char what[64];
    position(text, at, &line, &col);
    near(at, what, sizeof what);
    /* A whole value followed by more text: say so (Python's json: "Extra data"). */
    cJSON *head = cJSON_ParseWithOpts(text, NULL, false);
    bool extra = head != NULL;
    cJSON_Delete(head);
    const char *fmt = extra ? "%s: line %d, column %d: text after the end of the JSON value, "
                              "at %s (a file holds one JSON value)"
                            : "%s: line %d, column %d: JSON syntax error at %s";
    return rank == DDP__QUIET
               ? ddp__error_quiet(err, DDP_ERR_INVALID_DATA, fmt, src, line, col, what)
               : ddp__error(err, rank, DDP_ERR_INVALID_DATA, fmt, src, line, col, what);
  }
  key_t_ dup, first;
  ddp_status_t st;
  if (find_duplicate(text, &dup, &first, &st)) {
    cJSON_Delete(*out);
    *out = NULL;
    const char *fmt = "%s: line %d: duplicate key \"%.*s\" (first at line %d); Python's json "
                      "would take the last silently, libddp refuses";
    int len = (int)(dup.len > 80 ? 80 : dup.len);
    return rank == DDP__QUIET ? ddp__error_quiet(err, DDP_ERR_INVALID_DATA, fmt, src, dup.line, len,
                                                 dup.s, first.line)
                              : ddp__error(err, rank, DDP_ERR_INVALID_DATA, fmt, src, dup.line, len,
                                           dup.s, first.line);
  }
  if (st != DDP_OK) {
    cJSON_Delete(*out);
    *out = NULL;
    return ddp__error(err, rank == DDP__QUIET ? -1 : rank, st, "%s: no memory", src);
  }
  return DDP_OK;
}
