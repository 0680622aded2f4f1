/* safetensors writer (include/ddp/io.h has the format and the contracts; the reader, which
 * treats every byte as hostile, is safetensors.c). The header is cJSON's compact print of
 * the entries in the caller's order, padded with spaces to a multiple of 8 bytes; the data
 * follow in the same order, packed; the file is replaced atomically. */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/io.h"
#include "io/io_internal.h"

static void store_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static bool utf8_valid(const char *s) {
  size_t n = strlen(s);
  return ddp__st_utf8_check((const unsigned char *)s, n) == n;
}

/* Checks names and keys, returning DDP_ERR_INVALID_ARGUMENT naming the first problem. */
static ddp_status_t check_write_args(const char *path, const ddp_st_entry_t *e, size_t n,
                                     const char *const *mk, const char *const *mv, size_t nmeta,
                                     ddp_error_t *err) {
  for (size_t i = 0; i < n; i++) {
    const char *name = e[i].name;
    const ddp_tensor_t *t = e[i].tensor;
    if (!name || !name[0] || !utf8_valid(name) || strcmp(name, ST_META_KEY) == 0) {
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "safetensors write '%s': entry %zu has an empty, non-UTF-8 or reserved "
                        "name",
                        path, i);
    }
    int64_t numel;
    if (!t || !ddp_dtype_valid((int)t->dtype) ||
        ddp_shape_numel(t->ndim, t->shape, ddp_dtype_size(t->dtype), &numel) != DDP_OK ||
        numel != t->numel || (numel > 0 && !t->data)) {
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "safetensors write '%s': tensor '" NM "' is invalid (dtype, shape, "
                        "numel or data)",
                        path, name);
    }
  }
  for (size_t i = 0; i < nmeta; i++) {
    if (!mk[i] || !mv[i] || !utf8_valid(mk[i]) || !utf8_valid(mv[i])) {
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "safetensors write '%s': metadata entry %zu is NULL or not UTF-8", path, i);
    }
  }
  /* Duplicates, by sorting pointer copies (n log n for large models). */
  size_t cap = n > nmeta ? n : nmeta;
  if (cap < 2) return DDP_OK;
  const char **s = ddp__malloc(cap * sizeof *s);
  if (!s) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "safetensors write '%s'", path);
  ddp_status_t st = DDP_OK;
  for (int pass = 0; pass < 2 && st == DDP_OK; pass++) {
    size_t m = pass == 0 ? n : nmeta;
    for (size_t i = 0; i < m; i++) s[i] = pass == 0 ? e[i].name : mk[i];
    qsort(s, m, sizeof *s, ddp__st_cmp_str_ptr);
    for (size_t i = 1; i < m; i++) {
      if (strcmp(s[i - 1], s[i]) == 0) {
        st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "safetensors write '%s': duplicate %s '" NM "'", path,
                        pass == 0 ? "tensor name" : "metadata key", s[i]);
        break;
      }
    }
  }
  ddp__free(s);
  return st;
}

/* The JSON header text (cJSON_malloc'd, unpadded), or NULL when out of memory. Integers are
 * emitted as raw text: cJSON prints doubles with 15 significant digits, which would corrupt
 * offsets beyond 10^15. */
static char *build_header(const ddp_st_entry_t *e, size_t n, const char *const *mk,
                          const char *const *mv, size_t nmeta) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return NULL;
  char *text = NULL;
  if (nmeta > 0) {
    cJSON *meta = cJSON_AddObjectToObject(root, ST_META_KEY);
    if (!meta) goto out;
    for (size_t i = 0; i < nmeta; i++) {
      if (!cJSON_AddStringToObject(meta, mk[i], mv[i])) goto out;
    }
  }
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    const ddp_tensor_t *t = e[i].tensor;
    uint64_t nb = (uint64_t)ddp_tensor_nbytes(t);
    char shape[DDP_MAX_DIMS * 22 + 4], offs[48];
    int k = snprintf(shape, sizeof shape, "[");
    for (int d = 0; d < t->ndim; d++) {
      k += snprintf(shape + k, sizeof shape - (size_t)k, "%s%" PRId64, d ? "," : "", t->shape[d]);
    }
    snprintf(shape + k, sizeof shape - (size_t)k, "]");
    snprintf(offs, sizeof offs, "[%" PRIu64 ",%" PRIu64 "]", off, off + nb);
    off += nb;
    cJSON *o = cJSON_AddObjectToObject(root, e[i].name);
    if (!o || !cJSON_AddStringToObject(o, "dtype", ddp_dtype_name(t->dtype)) ||
        !cJSON_AddRawToObject(o, "shape", shape) ||
        !cJSON_AddRawToObject(o, "data_offsets", offs)) {
      goto out;
    }
  }
  text = cJSON_PrintUnformatted(root);
out:
  cJSON_Delete(root);
  return text;
}

ddp_status_t ddp_st_write(const char *path, const ddp_st_entry_t *entries, size_t n,
                          const char *const *meta_keys, const char *const *meta_values,
                          size_t nmeta, ddp_error_t *err) {
  DDP_REQUIRE(path && (entries || n == 0) && ((meta_keys && meta_values) || nmeta == 0));
  DDP_CHECK(check_write_args(path, entries, n, meta_keys, meta_values, nmeta, err));

  char *json = build_header(entries, n, meta_keys, meta_values, nmeta);
  if (!json) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "safetensors write '%s': header", path);
  size_t jlen = strlen(json);
  size_t hlen = (jlen + 7) & ~(size_t)7;
  unsigned char *head = ddp__malloc(8 + hlen);
  if (!head) {
    cJSON_free(json);
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "safetensors write '%s'", path);
  }
  store_le64(head, hlen);
  memcpy(head + 8, json, jlen);
  memset(head + 8 + jlen, ' ', hlen - jlen);
  cJSON_free(json);

  /* The one atomic writer (src/common/file.c): a temporary beside path, fsync, rename,
   * fsync of the directory. */
  char what[DDP_ERROR_MSG_MAX / 2];
  snprintf(what, sizeof what, "safetensors write '%s'", path);
  ddp__afile_t f;
  if (ddp__afile_open(&f, path, -1, what, err) == DDP_OK) {
    ddp__afile_write(&f, head, 8 + hlen);
    for (size_t i = 0; i < n; i++) {
      ddp__afile_write(&f, entries[i].tensor->data, ddp_tensor_nbytes(entries[i].tensor));
    }
  }
  ddp__free(head);
  return ddp__afile_commit(&f, 0644);
}
