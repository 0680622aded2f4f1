/* ddp-compare: compares two libddp dumps (docs/dumps.md) tensor by tensor, step by step.
 *
 *   ddp-compare [--rtol R] [--atol A] [--json] [--verbose] [--rank R] [--only P1,P2,...]
 *               [--no-layouts] DIR_A DIR_B
 *
 * Contract (docs/compare.md is the user-facing copy):
 * - The files compared are, in this order: rank{r}/init.safetensors (when both dumps have
 *   it), then rank{r}/step{NNNNNN}.safetensors for every step both dumps have, ranks in
 *   order inside each step. Inside a file, tensors go in A's file order.
 * - An element is within tolerance when |a - b| <= atol + rtol * max(|a|, |b|); equal values
 *   (infinities of one sign, +0 and -0) and two NaNs are within it. Integer and bool tensors
 *   must be equal. Defaults: rtol 1e-5, atol 1e-7.
 * - For every tensor name it reports, over all steps and ranks, the element count, the
 *   largest absolute and relative differences, a histogram of ULP distances (0, 1, 2-3,
 *   4-15, 16-255, >= 256 units in the last place of the tensor's dtype; for integers the
 *   plain difference) and the number of elements beyond tolerance; and the first element
 *   beyond tolerance in the order above, with its flat row-major index and coordinates,
 *   and for a grad.* or local_grad.* tensor its DDP bucket when the step file's metadata
 *   records "buckets" (libddp_capture.py writes it).
 * - Bucket layouts (rank{r}/ddp.json "bucket_layouts" initial and rebuilt) are compared when
 *   both dumps have them; a layout that differs counts as a difference.
 * - local_grad.<name> (each rank's gradient before communication, --dump_local_grads) is
 *   compared when both dumps hold it and skipped otherwise. For the first step with a
 *   difference the report says whether the local gradients already differed there or
 *   earlier ("local gradients already differ": the compute side), or only the averaged
 *   grad.* did ("only the averaged gradients differ": communication or a comm hook), or
 *   neither (the optimizer step or the buffers). The compute verdict also names the first
 *   differing input (input.*, input_checksum.*) at or before that step.
 * - grads_none (the names whose .grad was None) must be equal on both sides for every step
 *   and rank where both files record it; a mismatch counts as a difference.
 * - Exit status: 0 when everything is within tolerance, 1 when something is not, 2 for bad
 *   input (a missing directory or file, a corrupt file, different world sizes, tensor names,
 *   dtypes or shapes), with a message naming the file and the tensor.
 *
 * Only libddp's public API (safetensors reader) and cJSON are used. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "ddp/common.h"
#include "ddp/io.h"
#include "ddp/tensor.h"

#define NHIST 6
static const char *const hist_label[NHIST] = {"0", "1", "2-3", "4-15", "16-255", ">=256"};

/* What one tensor name accumulates over all steps and ranks. */
typedef struct tstat {
  char *name;
  char dtype[8];
  int64_t elements;
  int64_t beyond;
  double max_abs, max_rel;
  uint64_t hist[NHIST];
} tstat_t;

/* The first element beyond tolerance. */
typedef struct first_fail {
  bool set;
  int step; /* -1: init.safetensors */
  int rank;
  int bucket; /* the DDP bucket of a grad.* or local_grad.* tensor; -1: not known */
  char tensor[256];
  int64_t index;
  int ndim;
  int64_t coords[DDP_MAX_DIMS];
  double a, b, abs, rel;
  uint64_t ulps;
} first_fail_t;

typedef struct opts {
  double rtol, atol;
  bool json, verbose, layouts;
  int rank;    /* -1: every rank */
  char **only; /* name prefixes; NULL: every tensor */
  int nonly;
  const char *dir[2];
} opts_t;

typedef struct cmp {
  opts_t o;
  cJSON *meta[2];
  int world[2], steps[2];
  int steps_compared;
  tstat_t *stats;
  size_t nstats, capstats;
  first_fail_t first;
  cJSON *entries;      /* per (step, rank, tensor) results, for --json */
  double loss_max_abs; /* |loss_a - loss_b| over steps, from the files' metadata */
  bool loss_seen;
  cJSON *layouts; /* per rank: {"rank", "initial", "rebuilt"} */
  bool layout_differs;
  char layout_msg[512];
  /* Where differences start, per kind (INT32_MAX: none): local_grad.*, grad.*. */
  int first_local_step, first_grad_step;
  int first_local_rank, first_local_bucket;
  char first_local_tensor[256];
  /* The first input (input.*, input_checksum.*) beyond tolerance (step INT32_MAX: none). */
  int first_input_step, first_input_rank;
  char first_input_tensor[256];
  cJSON *cur_buckets;       /* the current A file's "buckets" metadata, parsed; NULL: none */
  bool have_local;          /* both dumps held local_grad.* somewhere */
  int none_step, none_rank; /* the first grads_none mismatch (none_step INT32_MAX: none) */
  char none_msg[512];
  char err[1024]; /* bad-input message */
} cmp_t;

static int bad(cmp_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(cmp_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
  return 2;
}

/* ------------------------------------------------------------ element decoding -------- */

static float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31u, man = h & 1023u;
  float v;
  if (exp == 0) {
    v = ldexpf((float)man, -24); /* zero or subnormal: man * 2^-24, exact */
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = ldexpf((float)(man | 1024u), (int)exp - 25);
  }
  return sign ? -v : v;
}

static double float_at(const ddp_tensor_t *t, int64_t i) {
  uint16_t h;
  uint32_t u;
  float f;
  switch (t->dtype) {
    case DDP_F32: return ((const float *)t->data)[i];
    case DDP_F64: return ((const double *)t->data)[i];
    case DDP_F16: memcpy(&h, (const uint16_t *)t->data + i, 2); return f16_to_f32(h);
    case DDP_BF16:
      memcpy(&h, (const uint16_t *)t->data + i, 2);
      u = (uint32_t)h << 16;
      memcpy(&f, &u, 4);
      return f;
    default: return 0;
  }
}

static int64_t int_at(const ddp_tensor_t *t, int64_t i) {
  switch (t->dtype) {
    case DDP_I32: return ((const int32_t *)t->data)[i];
    case DDP_I64: return ((const int64_t *)t->data)[i];
    case DDP_U8: return ((const uint8_t *)t->data)[i];
    case DDP_BOOL: return ((const uint8_t *)t->data)[i] != 0;
    default: return 0;
  }
}

static bool is_float(ddp_dtype_t dt) {
  return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16;
}

/* The element's bits mapped to an unsigned key that increases with the value, so that the
 * distance between two keys counts the representable values between them (ULPs). */
static uint64_t order_key(const ddp_tensor_t *t, int64_t i) {
  uint64_t u = 0, top;
  int bits = (int)ddp_dtype_size(t->dtype) * 8;
  memcpy(&u, (const unsigned char *)t->data + (size_t)i * (size_t)(bits / 8), (size_t)(bits / 8));
  top = (uint64_t)1 << (bits - 1);
  if (u & top) return (bits == 64 ? ~u : (~u & ((top << 1) - 1)));
  return u | top;
}

static int hist_bucket(uint64_t d) {
  if (d == 0) return 0;
  if (d == 1) return 1;
  if (d < 4) return 2;
  if (d < 16) return 3;
  if (d < 256) return 4;
  return 5;
}

/* ------------------------------------------------------------ bookkeeping ------------- */

static tstat_t *stat_for(cmp_t *c, const char *name, ddp_dtype_t dt) {
  for (size_t i = 0; i < c->nstats; i++)
    if (strcmp(c->stats[i].name, name) == 0) return &c->stats[i];
  if (c->nstats == c->capstats) {
    size_t cap = c->capstats ? 2 * c->capstats : 32;
    tstat_t *s = realloc(c->stats, cap * sizeof *s);
    if (!s) return NULL;
    c->stats = s;
    c->capstats = cap;
  }
  tstat_t *s = &c->stats[c->nstats];
  memset(s, 0, sizeof *s);
  s->name = strdup(name);
  if (!s->name) return NULL;
  snprintf(s->dtype, sizeof s->dtype, "%s", ddp_dtype_name(dt));
  c->nstats++;
  return s;
}

static bool selected(const cmp_t *c, const char *name) {
  if (!c->o.only) return true;
  for (int i = 0; i < c->o.nonly; i++)
    if (strncmp(name, c->o.only[i], strlen(c->o.only[i])) == 0) return true;
  return false;
}

static void step_label(char *buf, size_t n, int step) {
  if (step < 0)
    snprintf(buf, n, "init");
  else
    snprintf(buf, n, "%d", step);
}

/* ------------------------------------------------------------ tensors ----------------- */

/* The index of the bucket that holds grad.NAME or local_grad.NAME in the current file's
 * "buckets" metadata (a JSON list, per bucket in reducer order, of parameter names: written
 * by libddp_capture.py); -1 when the file has none or the tensor is no gradient. */
static int bucket_of(const cmp_t *c, const char *name) {
  const char *p = NULL;
  if (!strncmp(name, "grad.", 5)) p = name + 5;
  if (!strncmp(name, "local_grad.", 11)) p = name + 11;
  if (!p || !c->cur_buckets) return -1;
  int b = 0;
  const cJSON *bucket, *n;
  cJSON_ArrayForEach(bucket, c->cur_buckets) {
    cJSON_ArrayForEach(n, bucket) {
      if (cJSON_IsString(n) && strcmp(n->valuestring, p) == 0) return b;
    }
    b++;
  }
  return -1;
}

/* Compares one tensor pair element by element into its stat and the per-entry record. */
static int compare_tensor(cmp_t *c, int step, int rank, const char *name, const ddp_tensor_t *a,
                          const ddp_tensor_t *b) {
  tstat_t *s = stat_for(c, name, a->dtype);
  if (!s) return bad(c, "out of memory");
  bool fl = is_float(a->dtype);
  double emax_abs = 0, emax_rel = 0;
  uint64_t ehist[NHIST] = {0};
  int64_t ebeyond = 0;
  for (int64_t i = 0; i < a->numel; i++) {
    double va, vb, d, rel, mag;
    uint64_t ulps;
    bool within;
    if (fl) {
      va = float_at(a, i);
      vb = float_at(b, i);
      if (isnan(va) || isnan(vb)) {
        within = isnan(va) && isnan(vb);
        d = within ? 0 : INFINITY;
        rel = d;
        ulps = within ? 0 : UINT64_MAX;
      } else if (va == vb) {
        within = true;
        d = rel = 0;
        ulps = 0;
      } else {
        uint64_t ka = order_key(a, i), kb = order_key(b, i);
        d = fabs(va - vb);
        mag = fmax(fabs(va), fabs(vb));
        ulps = ka > kb ? ka - kb : kb - ka;
        if (isinf(mag)) { /* an infinity against anything else is never close */
          d = rel = INFINITY;
          within = false;
        } else {
          rel = d / mag;
          within = d <= c->o.atol + c->o.rtol * mag;
        }
      }
    } else {
      int64_t ia = int_at(a, i), ib = int_at(b, i);
      va = (double)ia;
      vb = (double)ib;
      within = ia == ib;
      ulps = ia > ib ? (uint64_t)ia - (uint64_t)ib : (uint64_t)ib - (uint64_t)ia;
      d = (double)ulps;
      mag = fmax(fabs(va), fabs(vb));
      rel = ulps ? d / mag : 0;
    }
    ehist[hist_bucket(ulps)]++;
    if (!(d <= emax_abs)) emax_abs = d;
    if (!(rel <= emax_rel)) emax_rel = rel;
    if (!within) {
      ebeyond++;
      if (!strncmp(name, "local_grad.", 11) && step < c->first_local_step) {
        c->first_local_step = step;
        c->first_local_rank = rank;
        c->first_local_bucket = bucket_of(c, name);
        snprintf(c->first_local_tensor, sizeof c->first_local_tensor, "%s", name);
      }
      if (!strncmp(name, "input", 5) && step >= 0 && step < c->first_input_step) {
        c->first_input_step = step;
        c->first_input_rank = rank;
        snprintf(c->first_input_tensor, sizeof c->first_input_tensor, "%s", name);
      }
      if (!strncmp(name, "grad.", 5) && step < c->first_grad_step) c->first_grad_step = step;
      if (!c->first.set) {
        first_fail_t *f = &c->first;
        f->set = true;
        f->step = step;
        f->rank = rank;
        f->bucket = bucket_of(c, name);
        snprintf(f->tensor, sizeof f->tensor, "%s", name);
        f->index = i;
        f->ndim = a->ndim;
        int64_t rest = i;
        for (int k = a->ndim - 1; k >= 0; k--) {
          f->coords[k] = a->shape[k] ? rest % a->shape[k] : 0;
          rest = a->shape[k] ? rest / a->shape[k] : 0;
        }
        f->a = va;
        f->b = vb;
        f->abs = d;
        f->rel = rel;
        f->ulps = ulps;
      }
    }
  }
  s->elements += a->numel;
  s->beyond += ebeyond;
  if (!(emax_abs <= s->max_abs)) s->max_abs = emax_abs;
  if (!(emax_rel <= s->max_rel)) s->max_rel = emax_rel;
  for (int k = 0; k < NHIST; k++) s->hist[k] += ehist[k];

  if (c->o.json || c->o.verbose) {
    cJSON *e = cJSON_CreateObject();
    if (!e) return bad(c, "out of memory");
    cJSON_AddItemToArray(c->entries, e);
    if (step < 0)
      cJSON_AddStringToObject(e, "step", "init");
    else
      cJSON_AddNumberToObject(e, "step", step);
    cJSON_AddNumberToObject(e, "rank", rank);
    cJSON_AddStringToObject(e, "tensor", name);
    cJSON_AddNumberToObject(e, "elements", (double)a->numel);
    cJSON_AddNumberToObject(e, "max_abs", emax_abs);
    cJSON_AddNumberToObject(e, "max_rel", emax_rel);
    cJSON *h = cJSON_AddArrayToObject(e, "ulp_hist");
    for (int k = 0; k < NHIST; k++) cJSON_AddItemToArray(h, cJSON_CreateNumber((double)ehist[k]));
    cJSON_AddNumberToObject(e, "beyond", (double)ebeyond);
  }
  return 0;
}

static int open_st(cmp_t *c, const char *path, ddp_st_file_t **f) {
  ddp_error_t err = {0};
  ddp_status_t st = ddp_st_open(path, DDP_ST_MMAP, f, &err);
  if (st != DDP_OK)
    return bad(c, "cannot read %s: %s (%s)", path, err.msg[0] ? err.msg : ddp_status_str(st),
               ddp_status_name(st));
  return 0;
}

static int compare_files(cmp_t *c, int step, int rank, const char *pa, const char *pb) {
  ddp_st_file_t *fa = NULL, *fb = NULL;
  int rc = open_st(c, pa, &fa);
  if (rc == 0) rc = open_st(c, pb, &fb);
  const char *bk = rc == 0 ? ddp_st_meta_get(fa, "buckets") : NULL;
  if (bk) {
    c->cur_buckets = cJSON_Parse(bk);
    if (!cJSON_IsArray(c->cur_buckets))
      rc = bad(c, "%s: metadata \"buckets\" is not a JSON list of lists of parameter names", pa);
  }
  for (size_t i = 0; rc == 0 && fa && i < ddp_st_count(fa); i++) {
    const char *name = ddp_st_name(fa, i);
    size_t j;
    ddp_tensor_t ta, tb;
    char da[64], db[64];
    if (!selected(c, name)) continue;
    bool local = !strncmp(name, "local_grad.", 11);
    if (ddp_st_find(fb, name, &j) != DDP_OK) {
      if (local) continue; /* local gradients are optional on either side */
      rc = bad(c, "tensor %s is in %s but not in %s", name, pa, pb);
      break;
    }
    if (ddp_st_tensor(fa, i, &ta) != DDP_OK || ddp_st_tensor(fb, j, &tb) != DDP_OK) {
      rc = bad(c, "tensor %s: cannot view it", name);
      break;
    }
    if (ta.dtype != tb.dtype || !ddp_tensor_same_shape(&ta, &tb)) {
      rc = bad(c, "tensor %s: %s in %s but %s in %s", name, ddp_tensor_describe(&ta, da, sizeof da),
               pa, ddp_tensor_describe(&tb, db, sizeof db), pb);
      break;
    }
    if (local) c->have_local = true;
    rc = compare_tensor(c, step, rank, name, &ta, &tb);
  }
  for (size_t j = 0; rc == 0 && fb && j < ddp_st_count(fb); j++) {
    size_t i;
    const char *name = ddp_st_name(fb, j);
    if (selected(c, name) && strncmp(name, "local_grad.", 11) != 0 &&
        ddp_st_find(fa, name, &i) != DDP_OK)
      rc = bad(c, "tensor %s is in %s but not in %s", name, pb, pa);
  }
  if (rc == 0 && step >= 0 && step < c->none_step) {
    const char *na = ddp_st_meta_get(fa, "grads_none"), *nb = ddp_st_meta_get(fb, "grads_none");
    if (na && nb && strcmp(na, nb) != 0) {
      c->none_step = step;
      c->none_rank = rank;
      snprintf(c->none_msg, sizeof c->none_msg, "A \"%.200s\", B \"%.200s\"", na, nb);
    }
  }
  if (rc == 0 && step >= 0) {
    const char *la = ddp_st_meta_get(fa, "loss"), *lb = ddp_st_meta_get(fb, "loss");
    if (la && lb) {
      double d = fabs(strtod(la, NULL) - strtod(lb, NULL));
      if (!c->loss_seen || !(d <= c->loss_max_abs)) c->loss_max_abs = d;
      c->loss_seen = true;
    }
  }
  cJSON_Delete(c->cur_buckets);
  c->cur_buckets = NULL;
  ddp_st_close(fa);
  ddp_st_close(fb);
  return rc;
}

/* ------------------------------------------------------------ JSON files -------------- */

static bool exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

/* Reads a JSON file. Returns 0 and *out (NULL when the file is absent and !required). */
static int read_json(cmp_t *c, const char *path, bool required, cJSON **out) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT && !required) return 0;
    return bad(c, "cannot open %s: %s", path, strerror(errno));
  }
  char *buf = NULL;
  size_t len = 0, cap = 0, n;
  for (;;) {
    if (len + 4096 + 1 > cap) {
      cap = cap ? 2 * cap : 65536;
      char *nb = realloc(buf, cap);
      if (!nb) {
        free(buf);
        fclose(f);
        return bad(c, "out of memory reading %s", path);
      }
      buf = nb;
    }
    n = fread(buf + len, 1, cap - len - 1, f);
    len += n;
    if (n == 0) break;
  }
  bool ioerr = ferror(f);
  fclose(f);
  if (ioerr) {
    free(buf);
    return bad(c, "read error on %s", path);
  }
  buf[len] = 0;
  *out = cJSON_ParseWithLength(buf, len);
  if (!*out) {
    const char *at = cJSON_GetErrorPtr();
    long off = at && at >= buf && at <= buf + len ? (long)(at - buf) : -1;
    free(buf);
    return bad(c, "%s is not valid JSON (near byte %ld)", path, off);
  }
  free(buf);
  return 0;
}

static int load_meta(cmp_t *c, int side) {
  char path[4096];
  struct stat sb;
  const char *dir = c->o.dir[side];
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return bad(c, "%s is not a dump directory (%s)", dir,
               exists(dir) ? "not a directory" : strerror(errno));
  snprintf(path, sizeof path, "%s/meta.json", dir);
  int rc = read_json(c, path, true, &c->meta[side]);
  if (rc) return rc;
  const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(c->meta[side], "format");
  const cJSON *w = cJSON_GetObjectItemCaseSensitive(c->meta[side], "world_size");
  const cJSON *s = cJSON_GetObjectItemCaseSensitive(c->meta[side], "steps");
  if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "libddp-dump-1") != 0)
    return bad(c, "%s: \"format\" is not \"libddp-dump-1\"", path);
  if (!cJSON_IsNumber(w) || w->valuedouble < 1 || w->valuedouble > 1e6 || !cJSON_IsNumber(s) ||
      s->valuedouble < 0 || s->valuedouble > 1e9)
    return bad(c, "%s: \"world_size\" (>= 1) and \"steps\" (>= 0) must be numbers", path);
  c->world[side] = w->valueint;
  c->steps[side] = s->valueint;
  return 0;
}

static const char *layout_state(const cJSON *a, const cJSON *b) {
  if (!cJSON_IsArray(a) || !cJSON_IsArray(b)) return "unavailable";
  return cJSON_Compare(a, b, true) ? "equal" : "differ";
}

static int compare_layouts(cmp_t *c, int rank) {
  char pa[4096], pb[4096];
  cJSON *ja = NULL, *jb = NULL;
  snprintf(pa, sizeof pa, "%s/rank%d/ddp.json", c->o.dir[0], rank);
  snprintf(pb, sizeof pb, "%s/rank%d/ddp.json", c->o.dir[1], rank);
  int rc = read_json(c, pa, false, &ja);
  if (rc == 0) rc = read_json(c, pb, false, &jb);
  if (rc == 0) {
    const cJSON *la = cJSON_GetObjectItemCaseSensitive(ja, "bucket_layouts");
    const cJSON *lb = cJSON_GetObjectItemCaseSensitive(jb, "bucket_layouts");
    cJSON *e = cJSON_CreateObject();
    cJSON_AddItemToArray(c->layouts, e);
    cJSON_AddNumberToObject(e, "rank", rank);
    static const char *const kinds[2] = {"initial", "rebuilt"};
    for (int k = 0; k < 2; k++) {
      const cJSON *xa = cJSON_GetObjectItemCaseSensitive(la, kinds[k]);
      const cJSON *xb = cJSON_GetObjectItemCaseSensitive(lb, kinds[k]);
      const char *state = layout_state(xa, xb);
      cJSON_AddStringToObject(e, kinds[k], state);
      if (strcmp(state, "differ") == 0 && !c->layout_differs) {
        char *sa = cJSON_PrintUnformatted(xa), *sb = cJSON_PrintUnformatted(xb);
        snprintf(c->layout_msg, sizeof c->layout_msg, "rank %d %s bucket layout: A %s, B %s", rank,
                 kinds[k], sa ? sa : "?", sb ? sb : "?");
        free(sa);
        free(sb);
        c->layout_differs = true;
      }
    }
  }
  cJSON_Delete(ja);
  cJSON_Delete(jb);
  return rc;
}

/* ------------------------------------------------------------ the walk ---------------- */

static int run(cmp_t *c) {
  int rc = load_meta(c, 0);
  if (rc == 0) rc = load_meta(c, 1);
  if (rc) return rc;
  int r0 = 0, r1 = c->world[0];
  if (c->o.rank >= 0) {
    if (c->o.rank >= c->world[0] || c->o.rank >= c->world[1])
      return bad(c, "--rank %d: the dumps have world sizes %d and %d", c->o.rank, c->world[0],
                 c->world[1]);
    r0 = c->o.rank;
    r1 = c->o.rank + 1;
  } else if (c->world[0] != c->world[1]) {
    return bad(c, "world sizes differ: %d in %s, %d in %s (use --rank to compare one rank)",
               c->world[0], c->o.dir[0], c->world[1], c->o.dir[1]);
  }
  c->steps_compared = c->steps[0] < c->steps[1] ? c->steps[0] : c->steps[1];
  for (int step = -1; step < c->steps_compared; step++) {
    for (int r = r0; r < r1; r++) {
      char pa[4096], pb[4096];
      if (step < 0) {
        snprintf(pa, sizeof pa, "%s/rank%d/init.safetensors", c->o.dir[0], r);
        snprintf(pb, sizeof pb, "%s/rank%d/init.safetensors", c->o.dir[1], r);
        if (!exists(pa) || !exists(pb)) continue; /* optional in the layout */
      } else {
        snprintf(pa, sizeof pa, "%s/rank%d/step%06d.safetensors", c->o.dir[0], r, step);
        snprintf(pb, sizeof pb, "%s/rank%d/step%06d.safetensors", c->o.dir[1], r, step);
      }
      rc = compare_files(c, step, r, pa, pb);
      if (rc) return rc;
    }
  }
  if (c->o.layouts)
    for (int r = r0; r < r1; r++)
      if ((rc = compare_layouts(c, r)) != 0) return rc;
  return (c->first.set || c->layout_differs || c->none_step != INT32_MAX) ? 1 : 0;
}

/* Where the first differing step's difference comes from (see the header comment):
 * a stable verdict name and a sentence. NULL when nothing differs. */
static const char *diagnosis(const cmp_t *c, char *text, size_t cap) {
  if (!c->first.set || c->first.step < 0) return NULL;
  int s = c->first.step;
  if (c->first_local_step <= s) {
    char where[64] = "", inputs[400] = "";
    if (c->first_local_bucket >= 0)
      snprintf(where, sizeof where, "bucket %d, ", c->first_local_bucket);
    if (c->first_input_step <= c->first_local_step)
      snprintf(inputs, sizeof inputs, "; the inputs already differ at step %d, rank %d, %s",
               c->first_input_step, c->first_input_rank, c->first_input_tensor);
    snprintf(text, cap,
             "step %d: local gradients already differ (compute): first at step %d, rank %d, "
             "%s%s%s",
             s, c->first_local_step, c->first_local_rank, where, c->first_local_tensor, inputs);
    return "local_gradients_differ";
  }
  if (!c->have_local) {
    snprintf(text, cap, "step %d: no local_grad.* in both dumps (--dump_local_grads) to place it",
             s);
    return "unknown";
  }
  if (c->first_grad_step == s) {
    char where[64] = "";
    if (c->first.bucket >= 0)
      snprintf(where, sizeof where, ", first in bucket %d", c->first.bucket);
    snprintf(text, cap,
             "step %d: only the averaged gradients differ (communication or hook)%s; the local "
             "gradients agree",
             s, where);
    return "averaged_gradients_differ";
  }
  snprintf(text, cap, "step %d: the gradients agree; the optimizer step or the buffers differ", s);
  return "gradients_agree";
}

/* ------------------------------------------------------------ output ------------------ */

static const char *str_or(const cJSON *j, const char *key, const char *dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
  return cJSON_IsString(v) ? v->valuestring : dflt;
}

static void print_table(const cmp_t *c, int rc) {
  for (int s = 0; s < 2; s++)
    printf("%s = %s (%s, W=%d, %d steps)\n", s ? "B" : "A", c->o.dir[s],
           str_or(c->meta[s], "producer", "?"), c->world[s], c->steps[s]);
  printf("tolerance: |a-b| <= atol + rtol*max(|a|,|b|), rtol=%g atol=%g; steps compared: %d\n\n",
         c->o.rtol, c->o.atol, c->steps_compared);
  if (c->o.verbose) {
    printf("%-6s %-4s %-36s %12s %12s  %s\n", "step", "rank", "tensor", "max_abs", "max_rel",
           "ulp 0/1/2-3/4-15/16-255/>=256  beyond");
    const cJSON *e;
    cJSON_ArrayForEach(e, c->entries) {
      const cJSON *st = cJSON_GetObjectItemCaseSensitive(e, "step");
      char sl[16];
      if (cJSON_IsString(st))
        snprintf(sl, sizeof sl, "%s", st->valuestring);
      else
        snprintf(sl, sizeof sl, "%d", st->valueint);
      printf("%-6s %-4d %-36s %12.4g %12.4g ", sl,
             cJSON_GetObjectItemCaseSensitive(e, "rank")->valueint,
             cJSON_GetObjectItemCaseSensitive(e, "tensor")->valuestring,
             cJSON_GetObjectItemCaseSensitive(e, "max_abs")->valuedouble,
             cJSON_GetObjectItemCaseSensitive(e, "max_rel")->valuedouble);
      const cJSON *h;
      cJSON_ArrayForEach(h, cJSON_GetObjectItemCaseSensitive(e, "ulp_hist"))
          printf(" %.0f", h->valuedouble);
      printf("  %.0f\n", cJSON_GetObjectItemCaseSensitive(e, "beyond")->valuedouble);
    }
    printf("\n");
  }
  printf("%-36s %-5s %10s %11s %11s", "tensor (all steps and ranks)", "dtype", "elements",
         "max_abs", "max_rel");
  for (int k = 0; k < NHIST; k++) printf(" %8s", hist_label[k]);
  printf(" %8s\n", "beyond");
  for (size_t i = 0; i < c->nstats; i++) {
    const tstat_t *s = &c->stats[i];
    printf("%-36s %-5s %10lld %11.4g %11.4g", s->name, s->dtype, (long long)s->elements, s->max_abs,
           s->max_rel);
    for (int k = 0; k < NHIST; k++) printf(" %8llu", (unsigned long long)s->hist[k]);
    printf(" %8lld\n", (long long)s->beyond);
  }
  if (c->loss_seen) printf("\nloss (file metadata): max |a-b| = %.4g\n", c->loss_max_abs);
  const cJSON *e;
  if (cJSON_GetArraySize(c->layouts) > 0) printf("\nbucket layouts:");
  cJSON_ArrayForEach(e, c->layouts) printf(" rank %d initial %s, rebuilt %s;",
                                           cJSON_GetObjectItemCaseSensitive(e, "rank")->valueint,
                                           str_or(e, "initial", "?"), str_or(e, "rebuilt", "?"));
  if (cJSON_GetArraySize(c->layouts) > 0) printf("\n");
  if (c->layout_differs) printf("layout difference: %s\n", c->layout_msg);
  if (c->none_step != INT32_MAX)
    printf("\ngrads_none differs at step %d, rank %d: %s\n", c->none_step, c->none_rank,
           c->none_msg);
  if (c->first.set) {
    const first_fail_t *f = &c->first;
    char sl[16];
    step_label(sl, sizeof sl, f->step);
    char bl[32] = "";
    if (f->bucket >= 0) snprintf(bl, sizeof bl, "bucket %d, ", f->bucket);
    printf("\nfirst difference beyond tolerance: step %s, rank %d, %stensor %s, index %lld [", sl,
           f->rank, bl, f->tensor, (long long)f->index);
    for (int k = 0; k < f->ndim; k++) printf(k ? ", %lld" : "%lld", (long long)f->coords[k]);
    printf("]: a=%.9g b=%.9g |a-b|=%.4g rel=%.4g ulps=%llu\n", f->a, f->b, f->abs, f->rel,
           (unsigned long long)f->ulps);
    char dt[600];
    if (diagnosis(c, dt, sizeof dt)) printf("diagnosis: %s\n", dt);
  }
  printf("\nresult: %s\n", rc == 0 ? "within tolerance" : "BEYOND TOLERANCE");
}

static void print_json(const cmp_t *c, int rc) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return;
  cJSON_AddStringToObject(root, "a", c->o.dir[0]);
  cJSON_AddStringToObject(root, "b", c->o.dir[1]);
  if (rc == 2) {
    cJSON_AddNumberToObject(root, "exit", 2);
    cJSON_AddStringToObject(root, "error", c->err);
  } else {
    cJSON_AddNumberToObject(root, "exit", rc);
    cJSON_AddBoolToObject(root, "ok", rc == 0);
    cJSON_AddNumberToObject(root, "rtol", c->o.rtol);
    cJSON_AddNumberToObject(root, "atol", c->o.atol);
    cJSON_AddNumberToObject(root, "world_size", c->world[0]);
    cJSON_AddNumberToObject(root, "steps_compared", c->steps_compared);
    if (c->first.set) {
      const first_fail_t *f = &c->first;
      cJSON *ff = cJSON_AddObjectToObject(root, "first_failure");
      if (f->step < 0)
        cJSON_AddStringToObject(ff, "step", "init");
      else
        cJSON_AddNumberToObject(ff, "step", f->step);
      cJSON_AddNumberToObject(ff, "rank", f->rank);
      if (f->bucket >= 0)
        cJSON_AddNumberToObject(ff, "bucket", f->bucket);
      else
        cJSON_AddNullToObject(ff, "bucket");
      cJSON_AddStringToObject(ff, "tensor", f->tensor);
      cJSON_AddNumberToObject(ff, "index", (double)f->index);
      cJSON *co = cJSON_AddArrayToObject(ff, "coords");
      for (int k = 0; k < f->ndim; k++)
        cJSON_AddItemToArray(co, cJSON_CreateNumber((double)f->coords[k]));
      cJSON_AddNumberToObject(ff, "a", f->a);
      cJSON_AddNumberToObject(ff, "b", f->b);
      cJSON_AddNumberToObject(ff, "abs", f->abs);
      cJSON_AddNumberToObject(ff, "rel", f->rel);
      cJSON_AddNumberToObject(ff, "ulps", (double)f->ulps);
      char dt[600];
      const char *v = diagnosis(c, dt, sizeof dt);
      if (v) {
        cJSON *dg = cJSON_AddObjectToObject(root, "diagnosis");
        cJSON_AddNumberToObject(dg, "step", f->step);
        cJSON_AddStringToObject(dg, "verdict", v);
        cJSON_AddStringToObject(dg, "text", dt);
      }
    } else {
      cJSON_AddNullToObject(root, "first_failure");
    }
    if (c->none_step != INT32_MAX) {
      cJSON *gn = cJSON_AddObjectToObject(root, "grads_none_mismatch");
      cJSON_AddNumberToObject(gn, "step", c->none_step);
      cJSON_AddNumberToObject(gn, "rank", c->none_rank);
      cJSON_AddStringToObject(gn, "detail", c->none_msg);
    } else {
      cJSON_AddNullToObject(root, "grads_none_mismatch");
    }
    cJSON *hl = cJSON_AddArrayToObject(root, "ulp_buckets");
    for (int k = 0; k < NHIST; k++) cJSON_AddItemToArray(hl, cJSON_CreateString(hist_label[k]));
    cJSON *ts = cJSON_AddArrayToObject(root, "tensors");
    for (size_t i = 0; i < c->nstats; i++) {
      const tstat_t *s = &c->stats[i];
      cJSON *t = cJSON_CreateObject();
      cJSON_AddItemToArray(ts, t);
      cJSON_AddStringToObject(t, "name", s->name);
      cJSON_AddStringToObject(t, "dtype", s->dtype);
      cJSON_AddNumberToObject(t, "elements", (double)s->elements);
      cJSON_AddNumberToObject(t, "max_abs", s->max_abs);
      cJSON_AddNumberToObject(t, "max_rel", s->max_rel);
      cJSON *h = cJSON_AddArrayToObject(t, "ulp_hist");
      for (int k = 0; k < NHIST; k++)
        cJSON_AddItemToArray(h, cJSON_CreateNumber((double)s->hist[k]));
      cJSON_AddNumberToObject(t, "beyond", (double)s->beyond);
    }
    if (c->loss_seen)
      cJSON_AddNumberToObject(root, "loss_max_abs", c->loss_max_abs);
    else
      cJSON_AddNullToObject(root, "loss_max_abs");
    cJSON_AddItemReferenceToObject(root, "layouts", c->layouts);
    cJSON_AddBoolToObject(root, "layouts_differ", c->layout_differs);
    cJSON_AddItemReferenceToObject(root, "entries", c->entries);
  }
  char *text = cJSON_Print(root);
  if (text) {
    fputs(text, stdout);
    fputc('\n', stdout);
    free(text);
  }
  cJSON_Delete(root);
}

/* ------------------------------------------------------------ main -------------------- */

static void usage(FILE *f) {
  fputs("usage: ddp-compare [--rtol R] [--atol A] [--json] [--verbose] [--rank R]\n"
        "                   [--only PREFIX[,PREFIX...]] [--no-layouts] DIR_A DIR_B\n"
        "Compares two libddp dumps (docs/dumps.md, docs/compare.md).\n"
        "  --rtol R      relative tolerance (default 1e-5)\n"
        "  --atol A      absolute tolerance (default 1e-7)\n"
        "  --json        machine-readable report on stdout\n"
        "  --verbose     one table row per step, rank and tensor\n"
        "  --rank R      compare only rank R (the world sizes may then differ)\n"
        "  --only P,...  compare only tensors whose names start with one of the prefixes\n"
        "  --no-layouts  skip the bucket layouts\n"
        "Exit status: 0 within tolerance, 1 beyond it, 2 bad input.\n",
        f);
}

/* The library's error lines repeat what the tool reports itself, with its context; other
 * levels pass through to stderr. */
static void log_sink(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  if (level != DDP_LOG_ERROR) fprintf(stderr, "%s\n", line);
}

static bool parse_double(const char *s, double *out) {
  char *end;
  errno = 0;
  *out = strtod(s, &end);
  return s[0] && !*end && errno == 0 && *out >= 0 && isfinite(*out);
}

static int split_only(cmp_t *c, const char *arg) {
  char *copy = strdup(arg), *save = NULL;
  if (!copy) return -1;
  int n = 1;
  for (const char *p = arg; *p; p++) n += *p == ',';
  c->o.only = calloc((size_t)n, sizeof *c->o.only);
  if (!c->o.only) {
    free(copy);
    return -1;
  }
  for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    c->o.only[c->o.nonly] = strdup(tok);
    if (!c->o.only[c->o.nonly]) {
      free(copy);
      return -1;
    }
    c->o.nonly++;
  }
  free(copy);
  return 0;
}

int main(int argc, char **argv) {
  cmp_t c;
  memset(&c, 0, sizeof c);
  c.first_local_step = c.first_grad_step = c.none_step = c.first_input_step = INT32_MAX;
  c.o.rtol = 1e-5;
  c.o.atol = 1e-7;
  c.o.layouts = true;
  c.o.rank = -1;
  int ndirs = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    bool has_val = i + 1 < argc;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(a, "--json")) {
      c.o.json = true;
    } else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) {
      c.o.verbose = true;
    } else if (!strcmp(a, "--no-layouts")) {
      c.o.layouts = false;
    } else if ((!strcmp(a, "--rtol") || !strcmp(a, "--atol")) && has_val) {
      double v;
      if (!parse_double(argv[++i], &v)) {
        fprintf(stderr, "ddp-compare: %s wants a finite number >= 0, got '%s'\n", a, argv[i]);
        return 2;
      }
      *(a[2] == 'r' ? &c.o.rtol : &c.o.atol) = v;
    } else if (!strcmp(a, "--rank") && has_val) {
      char *end;
      long r = strtol(argv[++i], &end, 10);
      if (!argv[i][0] || *end || r < 0 || r > 1000000) {
        fprintf(stderr, "ddp-compare: --rank wants a rank >= 0, got '%s'\n", argv[i]);
        return 2;
      }
      c.o.rank = (int)r;
    } else if (!strcmp(a, "--only") && has_val) {
      if (split_only(&c, argv[++i]) != 0) {
        fprintf(stderr, "ddp-compare: out of memory\n");
        return 2;
      }
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "ddp-compare: unknown option or missing value: %s\n", a);
      usage(stderr);
      return 2;
    } else if (ndirs < 2) {
      c.o.dir[ndirs++] = a;
    } else {
      fprintf(stderr, "ddp-compare: more than two directories given\n");
      return 2;
    }
  }
  if (ndirs != 2) {
    usage(stderr);
    return 2;
  }
  ddp_set_log_sink(log_sink, NULL);
  c.entries = cJSON_CreateArray();
  c.layouts = cJSON_CreateArray();
  int rc = (c.entries && c.layouts) ? run(&c) : bad(&c, "out of memory");
  if (rc == 2) fprintf(stderr, "ddp-compare: %s\n", c.err);
  if (c.o.json)
    print_json(&c, rc);
  else if (rc != 2)
    print_table(&c, rc);
  for (size_t i = 0; i < c.nstats; i++) free(c.stats[i].name);
  free(c.stats);
  for (int i = 0; i < c.o.nonly; i++) free(c.o.only[i]);
  free(c.o.only);
  cJSON_Delete(c.entries);
  cJSON_Delete(c.layouts);
  cJSON_Delete(c.meta[0]);
  cJSON_Delete(c.meta[1]);
  return rc;
}
