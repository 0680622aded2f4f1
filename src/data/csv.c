/* CSV source: a header row naming the columns, then one sample per line of numeric fields.
 * The label column (by name) becomes the label, every other column an F32 feature.
 *
 * The whole file is read into memory and parsed in two passes: the first counts the data
 * lines and checks every row's width, the second converts the fields, so the result
 * buffers are allocated once at their final size. Lines end in \n or \r\n; fields may be
 * surrounded by spaces; header names may be double-quoted. NaN, infinities and values
 * outside float32's range are refused. Every failure names the file, the 1-based line and
 * column, and the offending text. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

#define FIELD_SHOW 40 /* characters of a bad field quoted in a message */

/* Reads a file into a NUL-terminated heap buffer; a NUL byte inside is refused. */
static ddp_status_t read_all(const char *path, char **out, size_t *len, ddp_error_t *err) {
  char *buf = NULL;
  DDP_CHECK(ddp__file_read(path, 0, -1, "csv", &buf, len, err));
  const char *nul = memchr(buf, '\0', *len);
  if (nul) {
    ddp__free(buf);
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: the file contains a NUL byte (at offset %zu); not a text file", path,
                      (size_t)(nul - buf));
  }
  *out = buf;
  return DDP_OK;
}

/* A line [b, e) without its \r. */
typedef struct span {
  const char *b, *e;
} span_t;

static bool next_line(const char **cur, const char *end, span_t *line) {
  if (*cur >= end) return false;
  const char *nl = memchr(*cur, '\n', (size_t)(end - *cur));
  const char *e = nl ? nl : end;
  line->b = *cur;
  line->e = (e > *cur && e[-1] == '\r') ? e - 1 : e;
  *cur = nl ? nl + 1 : end;
  return true;
}

static bool blank(span_t s) {
  for (const char *p = s.b; p < s.e; p++)
    if (*p != ' ' && *p != '\t') return false;
  return true;
}

/* Field cursor over one line: field_next yields each field trimmed of spaces (and of one
 * pair of double quotes when unquote is set); false after the last. */
typedef struct field_cursor {
  span_t line;
  const char *p;
  bool done;
} field_cursor_t;

static void field_start(field_cursor_t *fc, span_t line) {
  fc->line = line;
  fc->p = line.b;
  fc->done = false;
}

static bool field_next(field_cursor_t *fc, char delim, bool unquote, span_t *field) {
  if (fc->done) return false;
  const char *q = fc->p;
  while (q < fc->line.e && *q != delim) q++;
  const char *b = fc->p, *e = q;
  while (b < e && (*b == ' ' || *b == '\t')) b++;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t')) e--;
  if (unquote && e - b >= 2 && *b == '"' && e[-1] == '"') {
    b++;
    e--;
  }
  field->b = b;
  field->e = e;
  if (q >= fc->line.e)
    fc->done = true;
  else
    fc->p = q + 1;
  return true;
}

static int64_t count_fields(span_t line, char delim) {
  int64_t n = 1;
  for (const char *p = line.b; p < line.e; p++) n += *p == delim;
  return n;
}

/* Parses one numeric field. */
static ddp_status_t parse_number(span_t f, const char *path, int64_t lineno, int64_t col,
                                 const char *colname, double *out, ddp_error_t *err) {
  char tmp[64];
  size_t len = (size_t)(f.e - f.b);
  if (len == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: line %lld column %lld ('%s'): empty field", path, (long long)lineno,
                      (long long)col + 1, colname);
  if (len < sizeof tmp) {
    memcpy(tmp, f.b, len);
    tmp[len] = '\0';
    char *end;
    errno = 0;
    double v = strtod(tmp, &end);
    if (*end == '\0' && end != tmp && !isnan(v)) {
      /* Infinities ("inf", or a magnitude past double's range such as 1e999) and values
       * past float32's range, which every column becomes, would train to NaN. */
      if (!isfinite(v) || fabs(v) > FLT_MAX) {
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "csv %s: line %lld column %lld ('%s'): '%s' is %s", path,
                          (long long)lineno, (long long)col + 1, colname, tmp,
                          isfinite(v) ? "outside float32's range (largest 3.4028235e+38)"
                                      : "not a finite number");
      }
      *out = v;
      return DDP_OK;
    }
  }
  return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "csv %s: line %lld column %lld ('%s'): not a number: '%.*s'", path,
                    (long long)lineno, (long long)col + 1, colname,
                    (int)(len < FIELD_SHOW ? len : FIELD_SHOW), f.b);
}

/* One CSV file being read: its text, the header's column names and the label's column. */
typedef struct csv {
  const char *path;
  ddp_csv_options_t o;
  const char *end, *data; /* the text's end; the first line after the header */
  char **names;           /* [ncols] */
  int64_t ncols, label_col, rows;
} csv_t;

/* The header row: column names, the label column (exactly once) and at least one feature. */
static ddp_status_t read_header(csv_t *c, const char *text, ddp_error_t *err) {
  const char *cur = text;
  span_t header;
  if (!next_line(&cur, c->end, &header) || blank(header))
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA, "csv %s: line 1: missing header row", c->path);
  c->data = cur;
  c->ncols = count_fields(header, c->o.delimiter);
  c->label_col = -1;
  field_cursor_t fc;
  field_start(&fc, header);
  c->names = ddp__calloc((size_t)c->ncols, sizeof *c->names);
  if (!c->names) return DDP_ERR_NO_MEMORY;
  for (int64_t k = 0; k < c->ncols; k++) {
    span_t f;
    field_next(&fc, c->o.delimiter, true, &f);
    size_t n = (size_t)(f.e - f.b);
    c->names[k] = ddp__malloc(n + 1);
    if (!c->names[k]) return DDP_ERR_NO_MEMORY;
    memcpy(c->names[k], f.b, n);
    c->names[k][n] = '\0';
    if (strcmp(c->names[k], c->o.label_column) == 0) {
      if (c->label_col >= 0)
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "csv %s: line 1: label column '%s' appears twice (columns %lld and "
                          "%lld)",
                          c->path, c->o.label_column, (long long)c->label_col + 1,
                          (long long)k + 1);
      c->label_col = k;
    }
  }
  if (c->label_col < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: line 1: no column named '%s' in the header (%lld columns)", c->path,
                      c->o.label_column, (long long)c->ncols);
  if (c->ncols < 2)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: line 1: the header has only the label column; no features", c->path);
  return DDP_OK;
}

/* Pass 1: counts the data rows and checks their widths. Blank lines are allowed only at
 * the end. */
static ddp_status_t count_rows(csv_t *c, ddp_error_t *err) {
  int64_t lineno = 1, first_blank = 0;
  const char *cur = c->data;
  span_t line;
  c->rows = 0;
  while (next_line(&cur, c->end, &line)) {
    lineno++;
    if (blank(line)) {
      if (!first_blank) first_blank = lineno;
      continue;
    }
    if (first_blank)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "csv %s: line %lld is empty but data follows on line %lld", c->path,
                        (long long)first_blank, (long long)lineno);
    int64_t w = count_fields(line, c->o.delimiter);
    if (w != c->ncols)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "csv %s: line %lld has %lld fields, the header has %lld", c->path,
                        (long long)lineno, (long long)w, (long long)c->ncols);
    c->rows++;
  }
  if (c->rows == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA, "csv %s: no data rows after the header",
                      c->path);
  return DDP_OK;
}

/* Pass 2: the rows into feat [rows, ncols - 1] (f32) and lab [rows] (the label dtype). */
static ddp_status_t convert_rows(const csv_t *c, float *feat, void *lab, ddp_error_t *err) {
  const int64_t nfeat = c->ncols - 1;
  const char *cur = c->data;
  int64_t lineno = 1;
  span_t line;
  for (int64_t r = 0; r < c->rows;) {
    next_line(&cur, c->end, &line);
    lineno++;
    if (blank(line)) continue;
    int64_t fcol = 0;
    field_cursor_t fc;
    field_start(&fc, line);
    for (int64_t k = 0; k < c->ncols; k++) {
      span_t f;
      double v = 0.0;
      field_next(&fc, c->o.delimiter, false, &f);
      DDP_CHECK(parse_number(f, c->path, lineno, k, c->names[k], &v, err));
      if (k != c->label_col) {
        feat[r * nfeat + fcol++] = (float)v;
      } else if (c->o.label_dtype != DDP_I64) {
        ((float *)lab)[r] = (float)v;
      } else if (v != floor(v) || !(fabs(v) < 9.0e15)) {
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "csv %s: line %lld column %lld ('%s'): class label %.*s is not "
                          "an integer",
                          c->path, (long long)lineno, (long long)k + 1, c->names[k],
                          (int)DDP_MIN(f.e - f.b, FIELD_SHOW), f.b);
      } else {
        ((int64_t *)lab)[r] = (int64_t)v;
      }
    }
    r++;
  }
  return DDP_OK;
}

ddp_status_t ddp_dataset_from_csv(const char *path, const ddp_csv_options_t *opts,
                                  ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  csv_t c = {.path = path, .o = DDP_CSV_OPTIONS_INIT};
  ddp__opts_read(&c.o, sizeof c.o, opts);
  if (!c.o.delimiter) c.o.delimiter = ',';
  if (!c.o.label_column || !*c.o.label_column)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "csv: label_column is empty");
  if (c.o.label_dtype != DDP_I64 && c.o.label_dtype != DDP_F32)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "csv: label_dtype must be I64 (classes) or F32 (regression), got %s",
                      ddp_dtype_name(c.o.label_dtype));

  char *text = NULL;
  size_t len = 0;
  DDP_CHECK(read_all(path, &text, &len, err));
  c.end = text + len;
  float *feat = NULL;
  void *lab = NULL;
  ddp_status_t st;
  DDP_CHECK_GOTO(read_header(&c, text, err), st, out);
  DDP_CHECK_GOTO(count_rows(&c, err), st, out);
  feat = ddp__aligned_alloc((size_t)(c.rows * (c.ncols - 1)) * sizeof(float));
  lab = ddp__aligned_alloc((size_t)c.rows * ddp_dtype_size(c.o.label_dtype));
  if (!feat || !lab) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  DDP_CHECK_GOTO(convert_rows(&c, feat, lab, err), st, out);
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_F32;
  spec.feature_ndim = 1;
  spec.feature_shape[0] = c.ncols - 1;
  spec.label_dtype = c.o.label_dtype;
  spec.label_ndim = 0;
  st = ddp__dataset_memory("csv", &spec, c.rows, feat, lab, out, err);
  feat = NULL;
  lab = NULL;
out:
  ddp__aligned_free(feat);
  ddp__aligned_free(lab);
  if (c.names)
    for (int64_t k = 0; k < c.ncols; k++) ddp__free(c.names[k]);
  ddp__free(c.names);
  ddp__free(text);
  return st;
}
