/* Text classification CSV: a header row, then one record per sample with a text column and
 * a label column (other columns ignored), as Transformers' run_glue.py reads a CSV through
 * the datasets library. Each text becomes byte-level token ids truncated to max_length and
 * padded on the right with pad_token_id, with the attention mask beside them:
 *     features I64 [2, max_length] = (ids, mask),  label I64 or F32 scalar.
 *
 * Records follow RFC 4180: fields are separated by the delimiter, records by \n or \r\n. A
 * field that starts with a double quote is quoted: it runs to the next lone quote and may
 * hold delimiters, line breaks and doubled quotes ("" is one "); only a delimiter or the
 * end of the record may follow its closing quote. A quote inside an unquoted field is kept
 * as an ordinary character (as Python's csv module does). Text fields are taken byte for
 * byte, spaces included; header names and labels are trimmed of spaces and tabs.
 *
 * The file is read whole and walked twice by one scanner: the first walk checks every
 * record and counts them, the second fills buffers allocated once at their final size.
 * Every error names the file, the 1-based line (where the field starts) and column. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

#define FIELD_SHOW 40 /* characters of a bad field quoted in a message */
#define MAX_LENGTH_LIMIT (1 << 24)

/* One field of the current record: its unquoted bytes are scratch[off, off + len). */
typedef struct field {
  size_t off, len;
  int64_t line;
  bool quoted;
} field_t;

typedef struct scanner {
  const char *path;
  const char *p, *end;
  int64_t line; /* 1-based line of p */
  char delim;
  char *scratch; /* unquoted bytes of the current record's fields */
  size_t scratch_len, scratch_cap;
  field_t *fields;
  size_t nfields, fields_cap;
  int64_t rec_line; /* line where the current record starts */
} scanner_t;

static ddp_status_t scratch_put(scanner_t *s, char c) {
  if (s->scratch_len == s->scratch_cap) {
    size_t cap = s->scratch_cap ? 2 * s->scratch_cap : 256;
    char *nb = ddp__realloc(s->scratch, cap);
    if (!nb) return DDP_ERR_NO_MEMORY;
    s->scratch = nb;
    s->scratch_cap = cap;
  }
  s->scratch[s->scratch_len++] = c;
  return DDP_OK;
}

static ddp_status_t field_push(scanner_t *s, size_t off, int64_t line, bool quoted) {
  if (s->nfields == s->fields_cap) {
    size_t cap = s->fields_cap ? 2 * s->fields_cap : 16;
    field_t *nf = ddp__realloc(s->fields, cap * sizeof *nf);
    if (!nf) return DDP_ERR_NO_MEMORY;
    s->fields = nf;
    s->fields_cap = cap;
  }
  s->fields[s->nfields++] = (field_t){off, s->scratch_len - off, line, quoted};
  return DDP_OK;
}

/* Reads the next record into s->fields; *eof when the input is exhausted. */
static ddp_status_t next_record(scanner_t *s, bool *eof, ddp_error_t *err) {
  s->nfields = 0;
  s->scratch_len = 0;
  s->rec_line = s->line;
  *eof = s->p >= s->end;
  if (*eof) return DDP_OK;
  for (;;) {
    size_t off = s->scratch_len;
    int64_t line = s->line;
    size_t col = s->nfields + 1;
    if (s->p < s->end && *s->p == '"') {
      s->p++;
      for (;;) {
        if (s->p >= s->end)
          return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                            "text csv %s: line %lld column %zu: unterminated quote: the quoted "
                            "field that opens there runs to the end of the file",
                            s->path, (long long)line, col);
        char c = *s->p++;
        if (c == '"') {
          if (s->p < s->end && *s->p == '"') {
            s->p++;
          } else {
            break;
          }
        } else if (c == '\n') {
          s->line++;
        }
        DDP_CHECK(scratch_put(s, c));
      }
      DDP_CHECK(field_push(s, off, line, true));
      if (s->p >= s->end) return DDP_OK;
      if (*s->p == s->delim) {
        s->p++;
        continue;
      }
      if (*s->p == '\r' && s->p + 1 == s->end) {
        s->p++;
        return DDP_OK;
      }
      if (*s->p == '\n' || (*s->p == '\r' && s->p[1] == '\n')) {
        s->p += *s->p == '\r' ? 2 : 1;
        s->line++;
        return DDP_OK;
      }
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "text csv %s: line %lld column %zu: '%c' after the closing quote of a "
                        "quoted field (only the delimiter or the end of the line may follow; "
                        "write a quote inside a quoted field as \"\")",
                        s->path, (long long)s->line, col, *s->p);
    }
    while (s->p < s->end && *s->p != s->delim && *s->p != '\n') DDP_CHECK(scratch_put(s, *s->p++));
    /* A \r ending the line (or the file) belongs to the line break, not the field. */
    if ((s->p >= s->end || *s->p == '\n') && s->scratch_len > off &&
        s->scratch[s->scratch_len - 1] == '\r')
      s->scratch_len--;
    DDP_CHECK(field_push(s, off, line, false));
    if (s->p >= s->end) return DDP_OK;
    if (*s->p++ == '\n') {
      s->line++;
      return DDP_OK;
    }
  }
}

/* A record that is one empty unquoted field: an empty line. */
static bool record_blank(const scanner_t *s) {
  return s->nfields == 1 && s->fields[0].len == 0 && !s->fields[0].quoted;
}

/* A field trimmed of spaces and tabs. */
static void trimmed(const scanner_t *s, const field_t *f, const char **b, size_t *len) {
  const char *p = s->scratch + f->off, *e = p + f->len;
  while (p < e && (*p == ' ' || *p == '\t')) p++;
  while (e > p && (e[-1] == ' ' || e[-1] == '\t')) e--;
  *b = p;
  *len = (size_t)(e - p);
}

typedef struct columns {
  int64_t ncols, text, label;         /* header width and the two columns' 0-based indices */
  const char *text_name, *label_name; /* the options' strings */
} columns_t;

static ddp_status_t read_header(scanner_t *s, const ddp_text_csv_options_t *o, columns_t *c,
                                ddp_error_t *err) {
  bool eof = false;
  DDP_CHECK(next_record(s, &eof, err));
  if (eof)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "text csv %s: the file is empty (no header row)", s->path);
  if (record_blank(s))
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "text csv %s: line 1: missing header row (the line is empty)", s->path);
  c->ncols = (int64_t)s->nfields;
  c->text = c->label = -1;
  char names[256];
  size_t nl = 0;
  names[0] = '\0';
  for (size_t i = 0; i < s->nfields; i++) {
    const char *b;
    size_t len;
    trimmed(s, &s->fields[i], &b, &len);
    if (nl < sizeof names)
      nl += (size_t)snprintf(names + nl, sizeof names - nl, "%s'%.*s'", i ? ", " : "",
                             (int)DDP_MIN(len, FIELD_SHOW), b);
    const char *want[2] = {o->text_column, o->label_column};
    int64_t *idx[2] = {&c->text, &c->label};
    for (int k = 0; k < 2; k++) {
      if (strlen(want[k]) != len || memcmp(want[k], b, len) != 0) continue;
      if (*idx[k] >= 0)
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "text csv %s: line 1: column '%s' appears twice (columns %lld and "
                          "%zu)",
                          s->path, want[k], (long long)*idx[k] + 1, i + 1);
      *idx[k] = (int64_t)i;
    }
  }
  const char *what[2] = {"text", "label"};
  const char *want[2] = {o->text_column, o->label_column};
  int64_t idx[2] = {c->text, c->label};
  for (int k = 0; k < 2; k++)
    if (idx[k] < 0)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "text csv %s: line 1: no %s column named '%s' in the header (columns: "
                        "%s)",
                        s->path, what[k], want[k], names);
  c->text_name = o->text_column;
  c->label_name = o->label_column;
  return DDP_OK;
}

/* Parses the label field of the current record into lab (I64 or F32). */
static ddp_status_t parse_label(const scanner_t *s, const columns_t *c, ddp_dtype_t dt,
                                int64_t num_labels, void *lab, ddp_error_t *err) {
  const field_t *f = &s->fields[c->label];
  const char *b;
  size_t len;
  trimmed(s, f, &b, &len);
  char tmp[64];
  const char *fault = len == 0 ? "empty label" : NULL;
  if (!fault && len < sizeof tmp) {
    memcpy(tmp, b, len);
    tmp[len] = '\0';
    char *end;
    errno = 0;
    if (dt == DDP_I64) {
      long long v = strtoll(tmp, &end, 10);
      if (*end == '\0' && errno == 0 && num_labels > 0 && (v < 0 || v >= num_labels)) {
        return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                          "text csv %s: line %lld column %lld ('%s'): label %lld is not a "
                          "class id in [0, %lld) (num_labels %lld)",
                          s->path, (long long)f->line, (long long)c->label + 1, c->label_name, v,
                          (long long)num_labels, (long long)num_labels);
      }
      if (*end == '\0' && errno == 0) {
        *(int64_t *)lab = v;
        return DDP_OK;
      }
      fault = errno == ERANGE ? "label out of the int64 range" : "label is not an integer";
    } else {
      double v = strtod(tmp, &end);
      if (*end == '\0' && isfinite(v)) {
        *(float *)lab = (float)v;
        return DDP_OK;
      }
      fault = "label is not a finite number";
    }
  }
  if (!fault) fault = dt == DDP_I64 ? "label is not an integer" : "label is not a finite number";
  return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "text csv %s: line %lld column %lld ('%s'): %s%s%.*s%s", s->path,
                    (long long)f->line, (long long)c->label + 1, c->label_name, fault,
                    len ? ": '" : "", (int)DDP_MIN(len, FIELD_SHOW), b, len ? "'" : "");
}

/* Output buffers of the second walk (NULL in the first). */
typedef struct fill {
  int64_t *features; /* [rows, 2, max_length] */
  void *labels;      /* [rows] */
} fill_t;

/* Walks every data record: checks it and, with fill, writes sample `rows`. */
static ddp_status_t scan_records(scanner_t *s, const ddp_text_csv_options_t *o, const columns_t *c,
                                 fill_t *fill, int64_t *rows, ddp_error_t *err) {
  int64_t n = 0, first_blank = 0;
  size_t lsize = ddp_dtype_size(o->label_dtype);
  for (;;) {
    bool eof = false;
    DDP_CHECK(next_record(s, &eof, err));
    if (eof) break;
    if (record_blank(s)) {
      if (!first_blank) first_blank = s->rec_line;
      continue;
    }
    if (first_blank)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "text csv %s: line %lld is empty but a record follows on line %lld",
                        s->path, (long long)first_blank, (long long)s->rec_line);
    if ((int64_t)s->nfields != c->ncols)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "text csv %s: line %lld has %zu fields, the header has %lld", s->path,
                        (long long)s->rec_line, s->nfields, (long long)c->ncols);
    const field_t *t = &s->fields[c->text];
    if (t->len == 0)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "text csv %s: line %lld column %lld ('%s'): empty text", s->path,
                        (long long)t->line, (long long)c->text + 1, c->text_name);
    unsigned char lab[8];
    DDP_CHECK(parse_label(s, c, o->label_dtype, o->num_labels, lab, err));
    if (fill) {
      int64_t L = o->max_length;
      int64_t *ids = fill->features + n * 2 * L, *mask = ids + L;
      int64_t k = (int64_t)DDP_MIN((size_t)L, t->len);
      ddp_byte_encode(s->scratch + t->off, (size_t)k, ids);
      for (int64_t j = 0; j < L; j++) mask[j] = j < k;
      for (int64_t j = k; j < L; j++) ids[j] = o->pad_token_id;
      memcpy((unsigned char *)fill->labels + (size_t)n * lsize, lab, lsize);
    }
    n++;
  }
  if (n == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA, "text csv %s: no records after the header",
                      s->path);
  *rows = n;
  return DDP_OK;
}

static ddp_status_t check_options(const ddp_text_csv_options_t *opts, ddp_text_csv_options_t *o,
                                  ddp_error_t *err) {
  ddp_text_csv_options_t d = DDP_TEXT_CSV_OPTIONS_INIT;
  *o = d;
  ddp__opts_read(o, sizeof *o, opts);
  if (!o->delimiter) o->delimiter = ',';
  if (!o->text_column || !*o->text_column || !o->label_column || !*o->label_column ||
      strcmp(o->text_column, o->label_column) == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "text csv: text_column and label_column must be two different non-empty "
                      "names");
  if (o->max_length < 1 || o->max_length > MAX_LENGTH_LIMIT)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "text csv: max_length %lld is outside [1, %d]", (long long)o->max_length,
                      MAX_LENGTH_LIMIT);
  if (o->pad_token_id < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "text csv: pad_token_id %lld is negative",
                      (long long)o->pad_token_id);
  if (o->label_dtype != DDP_I64 && o->label_dtype != DDP_F32)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "text csv: label_dtype must be I64 (classes) or F32 (regression), got %s",
                      ddp_dtype_name(o->label_dtype));
  if (o->num_labels < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "text csv: num_labels %lld is negative",
                      (long long)o->num_labels);
  if (o->delimiter == '"' || o->delimiter == '\n' || o->delimiter == '\r')
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "text csv: the delimiter cannot be a quote or a line break");
  return DDP_OK;
}

ddp_status_t ddp__text_csv_parse(const char *path, const char *text, size_t len,
                                 const ddp_text_csv_options_t *opts, ddp_dataset_t **out,
                                 ddp_error_t *err) {
  DDP_REQUIRE(path && (text || len == 0) && out);
  *out = NULL;
  ddp_text_csv_options_t o;
  DDP_CHECK(check_options(opts, &o, err));
  const char *nul = len ? memchr(text, '\0', len) : NULL;
  if (nul) {
    int64_t line = 1;
    for (const char *q = text; q < nul; q++) line += *q == '\n';
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "text csv %s: line %lld: a NUL byte (file offset %zu); not a text file", path,
                      (long long)line, (size_t)(nul - text));
  }
  /* A UTF-8 byte order mark (spreadsheet exports) is not part of the first name. */
  if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
    text += 3;
    len -= 3;
  }
  scanner_t s = {path, text, text + len, 1, o.delimiter, NULL, 0, 0, NULL, 0, 0, 0};
  columns_t c;
  fill_t fill = {NULL, NULL};
  int64_t rows = 0, rows2 = 0;
  ddp_status_t st;
  DDP_CHECK_GOTO(read_header(&s, &o, &c, err), st, out);
  const char *data = s.p;
  int64_t data_line = s.line;
  DDP_CHECK_GOTO(scan_records(&s, &o, &c, NULL, &rows, err), st, out);
  size_t fbytes = (size_t)rows * 2 * (size_t)o.max_length * sizeof(int64_t);
  fill.features = ddp__aligned_alloc(fbytes);
  fill.labels = ddp__aligned_alloc((size_t)rows * ddp_dtype_size(o.label_dtype));
  if (!fill.features || !fill.labels) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "text csv %s: %lld samples of %zu bytes", path,
                    (long long)rows, fbytes / (size_t)rows);
    goto out;
  }
  s.p = data;
  s.line = data_line;
  DDP_CHECK_GOTO(scan_records(&s, &o, &c, &fill, &rows2, err), st, out);
  DDP_REQUIRE(rows2 == rows);
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_I64;
  spec.feature_ndim = 2;
  spec.feature_shape[0] = 2;
  spec.feature_shape[1] = o.max_length;
  spec.label_dtype = o.label_dtype;
  spec.label_ndim = 0;
  st = ddp__dataset_memory("text_csv", &spec, rows, fill.features, fill.labels, out, err);
  fill.features = fill.labels = NULL;
out:
  ddp__aligned_free(fill.features);
  ddp__aligned_free(fill.labels);
  ddp__free(s.scratch);
  ddp__free(s.fields);
  return st;
}

ddp_status_t ddp_dataset_from_text_csv(const char *path, const ddp_text_csv_options_t *opts,
                                       ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  *out = NULL;
  ddp_text_csv_options_t o;
  DDP_CHECK(check_options(opts, &o, err));
  char *b = NULL;
  size_t len = 0;
  DDP_CHECK(ddp__file_read(path, 0, -1, "text csv", &b, &len, err));
  ddp_status_t st = ddp__text_csv_parse(path, b, len, &o, out, err);
  ddp__free(b);
  return st;
}
