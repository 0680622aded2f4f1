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
    const char *fmt = "%s: line %d, column %d: JSON syntax error at %s";
    return rank == DDP__QUIET
               ? ddp__error_quiet(err, DDP_ERR_INVALID_DATA, fmt, src, line, col, what)
               : ddp__error(err, rank, DDP_ERR_INVALID_DATA, fmt, src, line, col, what);
  }
  return DDP_OK;
}
