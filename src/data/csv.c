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
                      "csv %s: the file contains a NUL byte (at offset %zu); not a text file",
                      path, (size_t)(nul - buf));
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
                      "csv %s: line %lld column %lld ('%s'): empty field", path,
                      (long long)lineno, (long long)col + 1, colname);
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

ddp_status_t ddp_dataset_from_csv(const char *path, const ddp_csv_options_t *opts,
                                  ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  ddp_csv_options_t o = DDP_CSV_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  if (!o.delimiter) o.delimiter = ',';
  if (!o.label_column || !*o.label_column)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "csv: label_column is empty");
  if (o.label_dtype != DDP_I64 && o.label_dtype != DDP_F32)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "csv: label_dtype must be I64 (classes) or F32 (regression), got %s",
                      ddp_dtype_name(o.label_dtype));

  char *text = NULL;
  size_t len = 0;
  DDP_CHECK(read_all(path, &text, &len, err));
  const char *end = text + len, *cur = text;
  ddp_status_t st = DDP_OK;
  float *feat = NULL;
  void *lab = NULL;
  char **names = NULL;
  int64_t ncols = 0;

  span_t header;
  if (!next_line(&cur, end, &header) || blank(header)) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA, "csv %s: line 1: missing header row", path);
    goto out;
  }
  ncols = count_fields(header, o.delimiter);
  int64_t label_col = -1;
  field_cursor_t fc;
  field_start(&fc, header);
  names = ddp__calloc((size_t)ncols, sizeof *names);
  if (!names) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  for (int64_t c = 0; c < ncols; c++) {
    span_t f;
    field_next(&fc, o.delimiter, true, &f);
    size_t n = (size_t)(f.e - f.b);
    names[c] = ddp__malloc(n + 1);
    if (!names[c]) {
      st = DDP_ERR_NO_MEMORY;
      goto out;
    }
    memcpy(names[c], f.b, n);
    names[c][n] = '\0';
    if (strcmp(names[c], o.label_column) == 0) {
      if (label_col >= 0) {
        st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "csv %s: line 1: label column '%s' appears twice (columns %lld and "
                        "%lld)",
                        path, o.label_column, (long long)label_col + 1, (long long)c + 1);
        goto out;
      }
      label_col = c;
    }
  }
  if (label_col < 0) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "csv %s: line 1: no column named '%s' in the header (%lld columns)", path,
                    o.label_column, (long long)ncols);
    goto out;
  }
  if (ncols < 2) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "csv %s: line 1: the header has only the label column; no features", path);
    goto out;
  }

  /* Pass 1: count rows and check widths. Blank lines are allowed only at the end. */
  int64_t rows = 0, lineno = 1, first_blank = 0;
  const char *data_start = cur;
  span_t line;
  while (next_line(&cur, end, &line)) {
    lineno++;
    if (blank(line)) {
      if (!first_blank) first_blank = lineno;
      continue;
    }
    if (first_blank) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: line %lld is empty but data follows on line %lld", path,
                      (long long)first_blank, (long long)lineno);
      goto out;
    }
    int64_t w = count_fields(line, o.delimiter);
    if (w != ncols) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "csv %s: line %lld has %lld fields, the header has %lld", path,
                      (long long)lineno, (long long)w, (long long)ncols);
      goto out;
    }
    rows++;
  }
  if (rows == 0) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA, "csv %s: no data rows after the header",
                    path);
    goto out;
  }

  /* Pass 2: convert. */
  int64_t nfeat = ncols - 1;
  size_t lsize = ddp_dtype_size(o.label_dtype);
  feat = ddp__aligned_alloc((size_t)(rows * nfeat) * sizeof(float));
  lab = ddp__aligned_alloc((size_t)rows * lsize);
  if (!feat || !lab) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  cur = data_start;
  lineno = 1;
  for (int64_t r = 0; r < rows;) {
    next_line(&cur, end, &line);
    lineno++;
    if (blank(line)) continue;
    int64_t fcol = 0;
    field_start(&fc, line);
    for (int64_t c = 0; c < ncols; c++) {
      span_t f;
      double v = 0.0;
      field_next(&fc, o.delimiter, false, &f);
      DDP_CHECK_GOTO(parse_number(f, path, lineno, c, names[c], &v, err), st, out);
      if (c == label_col) {
        if (o.label_dtype == DDP_I64) {
          if (v != floor(v) || !(fabs(v) < 9.0e15)) {
            st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                            "csv %s: line %lld column %lld ('%s'): class label %.*s is not "
                            "an integer",
                            path, (long long)lineno, (long long)c + 1, names[c],
                            (int)DDP_MIN(f.e - f.b, FIELD_SHOW), f.b);
            goto out;
          }
          ((int64_t *)lab)[r] = (int64_t)v;
        } else {
          ((float *)lab)[r] = (float)v;
        }
      } else {
        feat[r * nfeat + fcol++] = (float)v;
      }
    }
    r++;
  }

  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_F32;
  spec.feature_ndim = 1;
  spec.feature_shape[0] = nfeat;
  spec.label_dtype = o.label_dtype;
  spec.label_ndim = 0;
  st = ddp__dataset_memory("csv", &spec, rows, feat, lab, out, err);
  feat = NULL;
  lab = NULL;
out:
  ddp__aligned_free(feat);
  ddp__aligned_free(lab);
  if (names)
    for (int64_t c = 0; c < ncols; c++) ddp__free(names[c]);
  ddp__free(names);
  ddp__free(text);
  return st;
}
