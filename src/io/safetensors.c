/* safetensors reader (include/ddp/io.h has the format and the contracts; the writer is
 * safetensors_write.c).
 *
 * Reading treats every byte of the file as hostile. The image (the whole file, read into
 * memory or mapped) is checked in this order, each check relying only on the ones before:
 *   1. the 8-byte header length N against the file size and DDP_ST_MAX_HEADER;
 *   2. the header bytes: they start with '{', are valid UTF-8 without raw control bytes,
 *      parse as one JSON object (cJSON, bounded by N, never by a terminator) followed only
 *      by whitespace (the writer's space padding);
 *   3. the keys: no duplicates (cJSON keeps them; we sort the names and compare
 *      neighbours), "__metadata__" is an object of strings;
 *   4. each tensor entry: an object with exactly one "dtype" (a known name), "shape" (at
 *      most DDP_MAX_DIMS exact non-negative integers whose element count and byte size fit
 *      in int64), "data_offsets" (two exact non-negative integers, begin <= end <= the data
 *      block's length, end - begin == numel * element size);
 *   5. coverage: sorted by (begin, end) the ranges tile the data block exactly, so there is
 *      no overlap, no hole and no trailing byte.
 * Only then are pointers formed (place_tensors: offsets need not be multiples of the element
 * size, since the format does not require it and the reference reader does not check it;
 * a tensor that would be misaligned in memory is copied instead).
 *
 * Numbers in JSON are doubles in cJSON, so an integer field must be at most 2^53 (exactly
 * representable); no real file comes near that. cJSON keeps no number text, so an integer
 * spelled 1e3 or 4.0 is accepted as the integer it equals (the reference reader, stricter,
 * would refuse it); a fraction, a negative or a non-number is an error.
 *
 * cJSON's parse tree uses cJSON's own allocator (libc unless the application installed
 * hooks); it lives only during open or write and is always freed before returning. cJSON's
 * parser also writes a process-wide error position on every call, so parses are serialized
 * by cjson_parse_lock (the one static here: it guards cJSON's global, not libddp state). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/common.h"
#include "ddp/io.h"
#include "io/io_internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader and writer copy it as host bytes"
#endif

#define ST_MAGIC 0x53544631u /* "STF1" */
#define ST_ALIGN 64
/* The largest integer a double holds exactly: the bound for JSON integers. */
#define ST_MAX_JSON_INT 9007199254740992.0

static pthread_mutex_t cjson_parse_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct st_tensor {
  char *name;
  ddp_dtype_t dtype;
  int ndim;
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  uint64_t begin, end; /* relative to the data block */
  size_t json_index;   /* position among the header's tensor keys, to keep ties stable */
  void *ptr;           /* into the image, or into fixup when that would be misaligned */
} st_tensor_t;

struct ddp_st_file {
  uint32_t magic;
  unsigned char *buf;  /* buffered image (ddp__aligned_alloc), or NULL */
  unsigned char *copy; /* ddp_st_parse's image (ddp__malloc), or NULL */
  void *map;           /* mmap'ed image, or NULL */
  size_t map_len;
  unsigned char *fixup; /* aligned copies of tensors that would be misaligned, or NULL */
  size_t n;
  st_tensor_t *t;  /* file order */
  size_t *by_name; /* indices into t sorted by name, for ddp_st_find */
  size_t nmeta;
  char **meta_key;
  char **meta_val;
};

/* ------------------------------------------------------------------ small helpers --- */

static uint64_t load_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

size_t ddp__st_utf8_check(const unsigned char *s, size_t len) {
  size_t i = 0;
  while (i < len) {
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t need;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (len - i <= need) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k <= need; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
    }
    i += need + 1;
  }
  return len;
}

/* An exact non-negative JSON integer no larger than 2^53. */
static bool json_uint(const cJSON *j, uint64_t *out) {
  if (!cJSON_IsNumber(j)) return false;
  double d = j->valuedouble;
  if (!(d >= 0.0 && d <= ST_MAX_JSON_INT)) return false; /* also rejects NaN */
  if (floor(d) != d) return false;
  *out = (uint64_t)d;
  return true;
}

/* dtypes that safetensors defines but libddp does not implement: UNSUPPORTED, not corrupt. */
static bool st_known_foreign_dtype(const char *name) {
  static const char *const foreign[] = {"I8",      "I16", "U16", "U32",     "U64",     "F8_E4M3",
                                        "F8_E5M2", "C64", "F4",  "F6_E2M3", "F6_E3M2", "F8_E8M0"};
  for (size_t i = 0; i < DDP_ARRAY_LEN(foreign); i++) {
    if (strcmp(name, foreign[i]) == 0) return true;
  }
  return false;
}

int ddp__st_cmp_str_ptr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_offsets(const void *a, const void *b) {
  const st_tensor_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return x->json_index < y->json_index ? -1 : (x->json_index > y->json_index);
}

/* qsort has no context argument; by-name sorting goes through this pair. */
typedef struct name_ref {
  const char *name;
  size_t index;
} name_ref_t;

static int cmp_name_ref(const void *a, const void *b) {
  return strcmp(((const name_ref_t *)a)->name, ((const name_ref_t *)b)->name);
}

/* ------------------------------------------------------------------ file handle ----- */

static void st_free(ddp_st_file_t *f) {
  if (!f) return;
  for (size_t i = 0; i < f->n; i++) ddp__free(f->t[i].name);
  for (size_t i = 0; i < f->nmeta; i++) {
    ddp__free(f->meta_key[i]);
    ddp__free(f->meta_val[i]);
  }
  ddp__free(f->t);
  ddp__free(f->by_name);
  ddp__free(f->meta_key);
  ddp__free(f->meta_val);
  ddp__aligned_free(f->fixup);
  ddp__aligned_free(f->buf);
  ddp__free(f->copy);
  if (f->map) munmap(f->map, f->map_len);
  f->magic = 0;
  ddp__free(f);
}

void ddp_st_close(ddp_st_file_t *f) {
  if (!f) return;
  DDP_REQUIRE(f->magic == ST_MAGIC);
  st_free(f);
}

/* ------------------------------------------------------------------ header parsing -- */

/* Parse state for one image. `where` prefixes every message ("safetensors 'x.st'"). */
typedef struct st_parse {
  ddp_st_file_t *f;
  const char *where;
  ddp_error_t *err;
} st_parse_t;

#define BAD(p, ...) st_bad((p), DDP_ERR_INVALID_DATA, __VA_ARGS__)

DDP_PRINTF(3, 4)
static ddp_status_t st_bad(st_parse_t *p, ddp_status_t st, const char *fmt, ...) {
  char msg[DDP_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return ddp__error(p->err, -1, st, "%s: %s", p->where, msg);
}

static ddp_status_t parse_metadata(st_parse_t *p, const cJSON *meta) {
  if (!cJSON_IsObject(meta)) return BAD(p, "\"" ST_META_KEY "\" is not a JSON object");
  size_t n = 0;
  for (const cJSON *c = meta->child; c; c = c->next) {
    if (!cJSON_IsString(c) || !c->valuestring) {
      return BAD(p, ST_META_KEY " value of key '" NM "' is not a string", c->string);
    }
    n++;
  }
  ddp_st_file_t *f = p->f;
  f->meta_key = ddp__calloc(n, sizeof *f->meta_key);
  f->meta_val = ddp__calloc(n, sizeof *f->meta_val);
  if (!f->meta_key || !f->meta_val)
    return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: metadata", p->where);
  for (const cJSON *c = meta->child; c; c = c->next) {
    char *k = ddp__strdup(c->string), *v = ddp__strdup(c->valuestring);
    if (!k || !v) {
      ddp__free(k);
      ddp__free(v);
      return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: metadata", p->where);
    }
    f->meta_key[f->nmeta] = k;
    f->meta_val[f->nmeta] = v;
    f->nmeta++;
  }
  /* Duplicate keys: sort a copy of the pointers and compare neighbours. */
  if (n > 1) {
    const char **keys = ddp__malloc(n * sizeof *keys);
    if (!keys) return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: metadata", p->where);
    memcpy(keys, f->meta_key, n * sizeof *keys);
    qsort(keys, n, sizeof *keys, ddp__st_cmp_str_ptr);
    for (size_t i = 1; i < n; i++) {
      if (strcmp(keys[i - 1], keys[i]) == 0) {
        ddp_status_t st = BAD(p, ST_META_KEY " has duplicate key '" NM "'", keys[i]);
        ddp__free(keys);
        return st;
      }
    }
    ddp__free(keys);
  }
  return DDP_OK;
}

/* The one member called `key` of entry `e`: NULL plus an error when missing or repeated. */
static const cJSON *one_field(st_parse_t *p, const cJSON *e, const char *key, ddp_status_t *st) {
  const cJSON *found = NULL;
  for (const cJSON *c = e->child; c; c = c->next) {
    if (strcmp(c->string, key) != 0) continue;
    if (found) {
      *st = BAD(p, "tensor '" NM "' has field \"%s\" twice", e->string, key);
      return NULL;
    }
    found = c;
  }
  if (!found) *st = BAD(p, "tensor '" NM "' has no \"%s\" field", e->string, key);
  return found;
}

static ddp_status_t parse_tensor(st_parse_t *p, const cJSON *e, uint64_t data_len, st_tensor_t *t) {
  const char *name = e->string;
  if (!cJSON_IsObject(e)) return BAD(p, "tensor '" NM "' is not a JSON object", name);
  ddp_status_t st = DDP_OK;
  const cJSON *jd = one_field(p, e, "dtype", &st);
  if (!jd) return st;
  const cJSON *js = one_field(p, e, "shape", &st);
  if (!js) return st;
  const cJSON *jo = one_field(p, e, "data_offsets", &st);
  if (!jo) return st;

  if (!cJSON_IsString(jd) || !jd->valuestring) {
    return BAD(p, "tensor '" NM "': \"dtype\" is not a string", name);
  }
  if (ddp_dtype_from_name(jd->valuestring, &t->dtype) != DDP_OK) {
    if (st_known_foreign_dtype(jd->valuestring)) {
      return st_bad(p, DDP_ERR_UNSUPPORTED, "tensor '" NM "': dtype %s is not supported by libddp",
                    name, jd->valuestring);
    }
    return BAD(p, "tensor '" NM "': unknown dtype \"%.32s\"", name, jd->valuestring);
  }
  size_t esize = ddp_dtype_size(t->dtype);

  if (!cJSON_IsArray(js)) return BAD(p, "tensor '" NM "': \"shape\" is not a list", name);
  int ndim = cJSON_GetArraySize(js);
  if (ndim > DDP_MAX_DIMS) {
    return st_bad(p, DDP_ERR_UNSUPPORTED, "tensor '" NM "': shape has %d dimensions, more than %d",
                  name, ndim, DDP_MAX_DIMS);
  }
  /* Element count and byte size in uint64 with overflow checks; both must fit int64. */
  uint64_t numel = 1;
  bool overflow = false;
  int d = 0;
  for (const cJSON *c = js->child; c; c = c->next, d++) {
    uint64_t dim;
    if (!json_uint(c, &dim)) {
      return BAD(p, "tensor '" NM "': shape[%d] is not a non-negative integer", name, d);
    }
    t->shape[d] = (int64_t)dim;
    if (__builtin_mul_overflow(numel, dim, &numel)) overflow = true;
  }
  t->ndim = ndim;
  uint64_t nbytes = 0;
  if (overflow || __builtin_mul_overflow(numel, (uint64_t)esize, &nbytes) ||
      nbytes > (uint64_t)INT64_MAX) {
    /* As in the reference implementation, an overflowing partial product is an error even
     * when a later zero dimension would bring the total back to 0. */
    return BAD(p, "tensor '" NM "': element count of the shape overflows 64 bits", name);
  }
  t->numel = (int64_t)numel;

  if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2) {
    return BAD(p, "tensor '" NM "': \"data_offsets\" is not a list of two integers", name);
  }
  if (!json_uint(jo->child, &t->begin) || !json_uint(jo->child->next, &t->end)) {
    return BAD(p, "tensor '" NM "': data_offsets are not non-negative integers", name);
  }
  if (t->begin > t->end) {
    return BAD(p, "tensor '" NM "': data_offsets [%" PRIu64 ", %" PRIu64 "] have begin > end", name,
               t->begin, t->end);
  }
  if (t->end > data_len) {
    return BAD(p,
               "tensor '" NM "': data_offsets [%" PRIu64 ", %" PRIu64
               "] run past the end of the data block (%" PRIu64 " bytes; file truncated?)",
               name, t->begin, t->end, data_len);
  }
  if (t->end - t->begin != nbytes) {
    return BAD(p,
               "tensor '" NM "': data_offsets [%" PRIu64 ", %" PRIu64 "] span %" PRIu64
               " bytes but %s with %" PRIu64 " elements needs %" PRIu64,
               name, t->begin, t->end, t->end - t->begin, ddp_dtype_name(t->dtype), numel, nbytes);
  }
  t->name = ddp__strdup(name);
  if (!t->name) return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: tensor name", p->where);
  return DDP_OK;
}

/* The sorted ranges must tile [0, data_len): each begins where the previous ended. */
static ddp_status_t check_coverage(st_parse_t *p, uint64_t data_len) {
  const ddp_st_file_t *f = p->f;
  uint64_t pos = 0;
  const st_tensor_t *prev = NULL;
  for (size_t i = 0; i < f->n; i++) {
    const st_tensor_t *t = &f->t[i];
    if (prev && t->begin < pos) { /* pos is 0 until there is a prev */
      return BAD(p,
                 "tensors '" NM "' [%" PRIu64 ", %" PRIu64 "] and '" NM "' [%" PRIu64 ", %" PRIu64
                 "] overlap",
                 prev->name, prev->begin, prev->end, t->name, t->begin, t->end);
    }
    if (t->begin > pos) {
      if (!prev) {
        return BAD(p,
                   "hole of %" PRIu64 " bytes at the start of the data block, before '" NM
                   "' [%" PRIu64 ", %" PRIu64 "]",
                   t->begin, t->name, t->begin, t->end);
      }
      return BAD(p,
                 "hole of %" PRIu64 " bytes in the data block between '" NM "' (ends at %" PRIu64
                 ") and '" NM "' (begins at %" PRIu64 ")",
                 t->begin - pos, prev->name, prev->end, t->name, t->begin);
    }
    pos = t->end;
    prev = t;
  }
  if (pos != data_len) {
    return BAD(p,
               "the data block has %" PRIu64 " bytes but the tensors cover only [0, %" PRIu64
               "): %" PRIu64 " trailing bytes",
               data_len, pos, data_len - pos);
  }
  return DDP_OK;
}

/* Points every tensor into the data block, copying those that would be misaligned for
 * their dtype into one aligned side buffer (see io.h, "Alignment"). */
static ddp_status_t place_tensors(st_parse_t *p, const unsigned char *data) {
  ddp_st_file_t *f = p->f;
  size_t fix = 0;
  for (size_t i = 0; i < f->n; i++) {
    st_tensor_t *t = &f->t[i];
    size_t nb = (size_t)(t->end - t->begin);
    if (nb && (uintptr_t)(data + t->begin) % ddp_dtype_size(t->dtype) != 0) {
      fix += (nb + ST_ALIGN - 1) & ~(size_t)(ST_ALIGN - 1);
    }
  }
  if (fix) {
    f->fixup = ddp__aligned_alloc(fix);
    if (!f->fixup) {
      return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY,
                        "%s: %zu bytes to realign misaligned tensors", p->where, fix);
    }
  }
  size_t at = 0;
  for (size_t i = 0; i < f->n; i++) {
    st_tensor_t *t = &f->t[i];
    size_t nb = (size_t)(t->end - t->begin);
    const unsigned char *src = data + t->begin;
    if (nb && (uintptr_t)src % ddp_dtype_size(t->dtype) != 0) {
      memcpy(f->fixup + at, src, nb);
      t->ptr = f->fixup + at;
      at += (nb + ST_ALIGN - 1) & ~(size_t)(ST_ALIGN - 1);
    } else {
      t->ptr = (void *)src;
    }
  }
  return DDP_OK;
}

static ddp_status_t build_name_index(st_parse_t *p) {
  ddp_st_file_t *f = p->f;
  name_ref_t *refs = ddp__malloc(f->n * sizeof *refs);
  f->by_name = ddp__malloc(f->n * sizeof *f->by_name);
  if (!refs || !f->by_name) {
    ddp__free(refs);
    return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: name index", p->where);
  }
  for (size_t i = 0; i < f->n; i++) refs[i] = (name_ref_t){f->t[i].name, i};
  qsort(refs, f->n, sizeof *refs, cmp_name_ref);
  for (size_t i = 0; i < f->n; i++) f->by_name[i] = refs[i].index;
  ddp__free(refs);
  return DDP_OK;
}

/* Rejects repeated keys in the header object (tensor names and "__metadata__" alike). */
static ddp_status_t check_duplicate_keys(st_parse_t *p, const cJSON *root, size_t nkeys) {
  if (nkeys < 2) return DDP_OK;
  const char **keys = ddp__malloc(nkeys * sizeof *keys);
  if (!keys) return ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: header keys", p->where);
  size_t k = 0;
  for (const cJSON *c = root->child; c; c = c->next) keys[k++] = c->string;
  qsort(keys, nkeys, sizeof *keys, ddp__st_cmp_str_ptr);
  ddp_status_t st = DDP_OK;
  for (size_t i = 1; i < nkeys; i++) {
    if (strcmp(keys[i - 1], keys[i]) == 0) {
      st = BAD(p, "duplicate name '" NM "' in the header", keys[i]);
      break;
    }
  }
  ddp__free(keys);
  return st;
}

/* Validates image[0, len) and fills p->f. The image stays owned by the caller (f->buf or
 * f->map); on failure the caller frees f. */
static ddp_status_t parse_image(st_parse_t *p, const unsigned char *img, size_t len) {
  if (len < 8) {
    return BAD(p, "file is %zu bytes, shorter than the 8-byte header length (truncated)", len);
  }
  uint64_t hlen = load_le64(img);
  if (hlen > DDP_ST_MAX_HEADER) {
    return BAD(p, "header length %" PRIu64 " exceeds the limit of %u bytes", hlen,
               DDP_ST_MAX_HEADER);
  }
  if (hlen > len - 8) {
    return BAD(p, "header length %" PRIu64 " runs past the end of the file (%zu bytes)", hlen, len);
  }
  const unsigned char *hdr = img + 8;
  if (hlen == 0 || hdr[0] != '{') {
    return BAD(p, "header (%" PRIu64 " bytes) does not start with '{' (file offset 8)", hlen);
  }
  size_t bad = ddp__st_utf8_check(hdr, (size_t)hlen);
  if (bad != hlen) return BAD(p, "header is not valid UTF-8 (file offset %zu)", 8 + bad);
  /* JSON allows no raw control character: outside strings only whitespace, inside strings
   * only escapes. cJSON does not check this, and a raw NUL would truncate a name. */
  for (size_t i = 0; i < hlen; i++) {
    if (hdr[i] < 0x20 && hdr[i] != '\t' && hdr[i] != '\n' && hdr[i] != '\r') {
      return BAD(p, "header has control byte 0x%02x at file offset %zu", hdr[i], 8 + i);
    }
  }

  const char *end = NULL;
  pthread_mutex_lock(&cjson_parse_lock);
  cJSON *root = cJSON_ParseWithLengthOpts((const char *)hdr, (size_t)hlen, &end, 0);
  pthread_mutex_unlock(&cjson_parse_lock);
  if (!root) {
    size_t at = end ? (size_t)(end - (const char *)hdr) : 0;
    return BAD(p, "header is not valid JSON (error near file offset %zu)", 8 + at);
  }
  ddp_status_t st = DDP_OK;
  for (const char *q = end; q < (const char *)hdr + hlen; q++) {
    if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
      st = BAD(p, "unexpected bytes after the JSON header (file offset %zu)",
               8 + (size_t)(q - (const char *)hdr));
      goto out;
    }
  }
  if (!cJSON_IsObject(root)) {
    st = BAD(p, "header is not a JSON object");
    goto out;
  }

  size_t nkeys = 0, ntensors = 0;
  const cJSON *meta = NULL;
  for (const cJSON *c = root->child; c; c = c->next) {
    nkeys++;
    if (strcmp(c->string, ST_META_KEY) == 0) {
      meta = c;
    } else {
      ntensors++;
    }
  }
  DDP_CHECK_GOTO(check_duplicate_keys(p, root, nkeys), st, out);
  if (meta) DDP_CHECK_GOTO(parse_metadata(p, meta), st, out);

  ddp_st_file_t *f = p->f;
  uint64_t data_len = (uint64_t)len - 8 - hlen;
  f->t = ddp__calloc(ntensors, sizeof *f->t);
  if (!f->t) {
    st = ddp__error(p->err, -1, DDP_ERR_NO_MEMORY, "%s: %zu tensors", p->where, ntensors);
    goto out;
  }
  for (const cJSON *c = root->child; c; c = c->next) {
    if (c == meta) continue;
    st_tensor_t *t = &f->t[f->n];
    t->json_index = f->n;
    st = parse_tensor(p, c, data_len, t);
    if (t->name) f->n++; /* owned from here on, freed with f */
    if (st != DDP_OK) goto out;
  }
  qsort(f->t, f->n, sizeof *f->t, cmp_offsets);
  DDP_CHECK_GOTO(check_coverage(p, data_len), st, out);
  DDP_CHECK_GOTO(place_tensors(p, hdr + hlen), st, out);
  DDP_CHECK_GOTO(build_name_index(p), st, out);
out:
  cJSON_Delete(root);
  return st;
}

static ddp_st_file_t *st_new(void) {
  ddp_st_file_t *f = ddp__calloc(1, sizeof *f);
  if (f) f->magic = ST_MAGIC;
  return f;
}

/* Bytes of padding before the image so that its data block starts 64-byte aligned. A bogus
 * header length only costs alignment; parse_image rejects it anyway. */
static size_t image_pad(const unsigned char first8[8], size_t len) {
  if (len < 8) return 0;
  uint64_t h = load_le64(first8);
  return (size_t)((ST_ALIGN - (8 + h % ST_ALIGN) % ST_ALIGN) % ST_ALIGN);
}

ddp_status_t ddp_st_parse(const void *bytes, size_t len, ddp_st_file_t **out, ddp_error_t *err) {
  DDP_REQUIRE(out);
  DDP_REQUIRE(bytes || len == 0);
  *out = NULL;
  ddp_st_file_t *f = st_new();
  if (!f) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "safetensors: file handle");
  /* An exact-size copy rather than an aligned one with slack: under ASan (the fuzz target)
   * any read past the image's end then faults. place_tensors realigns what needs it. */
  ddp_status_t st;
  f->copy = ddp__malloc(len);
  if (!f->copy) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "safetensors (memory): %zu-byte image", len);
    goto fail;
  }
  if (len) memcpy(f->copy, bytes, len);
  st_parse_t p = {f, "safetensors (memory)", err};
  DDP_CHECK_GOTO(parse_image(&p, f->copy, len), st, fail);
  *out = f;
  return DDP_OK;
fail:
  st_free(f);
  return st;
}

/* pread until n bytes or EOF; returns bytes read, or -1 with errno. */
static ssize_t read_full(int fd, unsigned char *dst, size_t n, off_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, dst + got, n - got, off + (off_t)got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    got += (size_t)r;
  }
  return (ssize_t)got;
}

ddp_status_t ddp_st_open(const char *path, int flags, ddp_st_file_t **out, ddp_error_t *err) {
  DDP_REQUIRE(path && out);
  DDP_REQUIRE(flags == DDP_ST_READ || flags == DDP_ST_MMAP);
  *out = NULL;
  char where[DDP_ERROR_MSG_MAX / 2];
  snprintf(where, sizeof where, "safetensors '%s'", path);
  ddp_status_t st = DDP_OK;
  ddp_st_file_t *f = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return ddp__error(err, -1, e == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM,
                      "%s: open: %s (errno %d)", where, strerror(e), e);
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s: fstat: %s (errno %d)", where, strerror(errno),
                    errno);
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "%s: not a regular file", where);
    goto fail;
  }
  size_t size = (size_t)sb.st_size;
  f = st_new();
  if (!f) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "%s: file handle", where);
    goto fail;
  }
  st_parse_t p = {f, where, err};
  const unsigned char *img;
  size_t len;
  if (flags == DDP_ST_MMAP && size >= 8) {
    void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s: mmap of %zu bytes: %s (errno %d)", where, size,
                      strerror(errno), errno);
      goto fail;
    }
    f->map = m;
    f->map_len = size;
    img = m;
    len = size;
  } else {
    /* A file shorter than 8 bytes cannot be mapped usefully; read it and let the parser
     * report it. Otherwise read it whole, placed so that the data block is aligned. */
    unsigned char first8[8] = {0};
    ssize_t r = read_full(fd, first8, sizeof first8, 0);
    if (r < 0) {
      st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s: read: %s (errno %d)", where, strerror(errno),
                      errno);
      goto fail;
    }
    size_t pad = image_pad(first8, (size_t)r);
    f->buf = ddp__aligned_alloc(pad + size);
    if (!f->buf) {
      st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "%s: %zu-byte file", where, size);
      goto fail;
    }
    r = read_full(fd, f->buf + pad, size, 0);
    if (r < 0) {
      st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s: read: %s (errno %d)", where, strerror(errno),
                      errno);
      goto fail;
    }
    img = f->buf + pad;
    len = (size_t)r; /* a file that shrank since fstat is parsed as the truncated file it is */
  }
  DDP_CHECK_GOTO(parse_image(&p, img, len), st, fail);
  close(fd);
  *out = f;
  return DDP_OK;
fail:
  close(fd);
  st_free(f);
  return st;
}

/* ------------------------------------------------------------------ accessors ------- */

size_t ddp_st_count(const ddp_st_file_t *f) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC);
  return f->n;
}

const char *ddp_st_name(const ddp_st_file_t *f, size_t i) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && i < f->n);
  return f->t[i].name;
}

ddp_status_t ddp_st_tensor(const ddp_st_file_t *f, size_t i, ddp_tensor_t *view) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && i < f->n && view);
  const st_tensor_t *t = &f->t[i];
  memset(view, 0, sizeof *view);
  view->dtype = t->dtype;
  view->ndim = t->ndim;
  memcpy(view->shape, t->shape, sizeof t->shape);
  view->numel = t->numel;
  view->data = t->ptr;
  view->owns = false;
  return DDP_OK;
}

ddp_status_t ddp_st_find(const ddp_st_file_t *f, const char *name, size_t *index) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && name && index);
  size_t lo = 0, hi = f->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(f->t[f->by_name[mid]].name, name);
    if (c == 0) {
      *index = f->by_name[mid];
      return DDP_OK;
    }
    if (c < 0) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return DDP_ERR_NOT_FOUND;
}

void ddp_st_offsets(const ddp_st_file_t *f, size_t i, uint64_t *begin, uint64_t *end) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && i < f->n && begin && end);
  *begin = f->t[i].begin;
  *end = f->t[i].end;
}

size_t ddp_st_meta_count(const ddp_st_file_t *f) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC);
  return f->nmeta;
}

const char *ddp_st_meta_key(const ddp_st_file_t *f, size_t i) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && i < f->nmeta);
  return f->meta_key[i];
}

const char *ddp_st_meta_value(const ddp_st_file_t *f, size_t i) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && i < f->nmeta);
  return f->meta_val[i];
}

const char *ddp_st_meta_get(const ddp_st_file_t *f, const char *key) {
  DDP_REQUIRE(f && f->magic == ST_MAGIC && key);
  for (size_t i = 0; i < f->nmeta; i++) {
    if (strcmp(f->meta_key[i], key) == 0) return f->meta_val[i];
  }
  return NULL;
}
