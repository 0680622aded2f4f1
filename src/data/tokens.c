/* Token streams from files, and llm.c's writer.
 *
 * Three formats, all read whole and checked before a single id is handed out:
 *  - llm.c's .bin (karpathy/llm.c dev/data/data_common.py): 256 little-endian int32 of
 *    header -- magic, version, token count, zeros -- then the tokens: uint16 in the GPT-2
 *    format (magic 20240520, version 1), uint32 in the Llama 3 one (20240801, version 7).
 *    The file size must be exactly header + count * element size. Both are written too.
 *  - safetensors: a 1-D integer tensor named "tokens", or the file's only tensor. The
 *    whole file goes through libddp's safetensors reader (ddp_st_parse), so a corrupt
 *    layout is refused there with its own message.
 *  - text: every byte is one token (the byte-level tokenizer, src/data/text.c).
 * The format is the extension's (.bin, .safetensors, .txt) or, for any other name, the
 * content's: an llm.c magic, then a safetensors header, then text (git's rule: no NUL
 * byte in the first 8000 bytes). Every message
 * starts "tokens PATH:" and names the fault with the expected and the found value. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "common/common.h"
#include "data/data_internal.h"
#include "ddp/io.h"

#define LLMC_HEADER_BYTES ((size_t)DDP_LLMC_HEADER_INTS * 4u)
/* llm.c's multiple-choice eval files (HellaSwag, MMLU) share the header layout. */
#define LLMC_EVAL_MAGIC 20240522
#define ST_TENSOR_NAME "tokens"
/* Text has no NUL byte in its first 8000 bytes (git's test for a binary file). */
#define SNIFF_BYTES 8000u

typedef enum token_format { FMT_LLMC, FMT_SAFETENSORS, FMT_TEXT, FMT_UNKNOWN } token_format_t;

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int32_t le32s(const unsigned char *p) {
  uint32_t u = le32(p);
  int32_t v;
  memcpy(&v, &u, sizeof v);
  return v;
}

static uint64_t le64(const unsigned char *p) {
  return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static void put_le32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int64_t *alloc_ids(int64_t n) { return ddp__malloc((size_t)n * sizeof(int64_t)); }

void ddp_tokens_free(int64_t *tokens) { ddp__free(tokens); }

/* ---------------------------------------------------------------- llm.c ----------- */

ddp_status_t ddp__tokens_parse_llmc(const char *path, const unsigned char *b, size_t len,
                                    int64_t **tokens, int64_t *n, ddp_error_t *err) {
  DDP_REQUIRE(path && (b || len == 0) && tokens && n);
  *tokens = NULL;
  *n = 0;
  if (len == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: the file is empty (0 bytes); an llm.c token file starts with "
                      "a %zu-byte header",
                      path, LLMC_HEADER_BYTES);
  if (len < 4)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: truncated: %zu bytes, shorter than llm.c's %zu-byte header", path,
                      len, LLMC_HEADER_BYTES);
  int32_t magic = le32s(b);
  if (magic != DDP_LLMC_MAGIC && magic != DDP_LLMC_MAGIC_U32)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: wrong magic: expected %d (llm.c GPT-2 tokens) or %d (llm.c "
                      "Llama 3 tokens), found %d (bytes %02x %02x %02x %02x)%s",
                      path, DDP_LLMC_MAGIC, DDP_LLMC_MAGIC_U32, (int)magic, b[0], b[1], b[2], b[3],
                      magic == LLMC_EVAL_MAGIC ? "; that is llm.c's eval file, not tokens" : "");
  if (len < LLMC_HEADER_BYTES)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: truncated header: the file has %zu bytes, llm.c's header "
                      "alone is %zu",
                      path, len, LLMC_HEADER_BYTES);
  int32_t want_version = magic == DDP_LLMC_MAGIC ? DDP_LLMC_VERSION : DDP_LLMC_VERSION_U32;
  size_t esize = magic == DDP_LLMC_MAGIC ? 2 : 4;
  int32_t version = le32s(b + 4);
  if (version != want_version)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: wrong version: expected %d for magic %d (uint%zu tokens), "
                      "found %d",
                      path, (int)want_version, (int)magic, esize * 8, (int)version);
  int32_t count = le32s(b + 8);
  if (count < 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: the header's token count (int32 at offset 8) is negative: %d",
                      path, (int)count);
  if (count == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: empty: the header's token count is 0 (file of %zu bytes)", path,
                      len);
  uint64_t want = LLMC_HEADER_BYTES + (uint64_t)count * esize;
  if ((uint64_t)len != want)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: %s: the header promises %d uint%zu tokens, %llu bytes with "
                      "the header, but the file has %zu bytes (%s %llu)",
                      path, (uint64_t)len < want ? "truncated" : "trailing bytes", (int)count,
                      esize * 8, (unsigned long long)want, len,
                      (uint64_t)len < want ? "missing" : "extra",
                      (unsigned long long)((uint64_t)len < want ? want - len : len - want));
  int64_t *ids = alloc_ids(count);
  if (!ids) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "tokens %s: %d tokens", path, (int)count);
  const unsigned char *p = b + LLMC_HEADER_BYTES;
  if (esize == 2) {
    for (int32_t i = 0; i < count; i++) ids[i] = (int64_t)p[2 * i] | (int64_t)p[2 * i + 1] << 8;
  } else {
    for (int32_t i = 0; i < count; i++) ids[i] = (int64_t)le32(p + 4 * (size_t)i);
  }
  *tokens = ids;
  *n = count;
  return DDP_OK;
}

/* Both of llm.c's formats: uint16 tokens (GPT-2) or uint32 (Llama 3, wide). */
static ddp_status_t write_llmc(const char *path, const int64_t *tokens, int64_t n, bool wide,
                               ddp_error_t *err) {
  DDP_REQUIRE(path && (tokens || n <= 0));
  const char *fmt = wide ? "Llama 3" : "GPT-2";
  size_t esize = wide ? 4 : 2;
  int64_t maxid = wide ? (int64_t)UINT32_MAX : 65535;
  if (n < 1 || n > INT32_MAX)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "tokens write %s: %lld tokens; llm.c's format holds 1 to %d", path,
                      (long long)n, INT32_MAX);
  for (int64_t i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] > maxid)
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "tokens write %s: token %lld at position %lld is outside [0, %lld] "
                        "(llm.c's %s format stores uint%zu)",
                        path, (long long)tokens[i], (long long)i, (long long)maxid, fmt, esize * 8);
  char what[160];
  snprintf(what, sizeof what, "tokens write %s", path);
  ddp__afile_t f;
  ddp__afile_open(&f, path, -1, what, err);
  unsigned char chunk[8192];
  memset(chunk, 0, LLMC_HEADER_BYTES);
  put_le32(chunk, wide ? DDP_LLMC_MAGIC_U32 : DDP_LLMC_MAGIC);
  put_le32(chunk + 4, wide ? DDP_LLMC_VERSION_U32 : DDP_LLMC_VERSION);
  put_le32(chunk + 8, (uint32_t)n);
  ddp__afile_write(&f, chunk, LLMC_HEADER_BYTES);
  for (int64_t i = 0; i < n && f.st == DDP_OK;) {
    size_t k = 0;
    for (; k < sizeof chunk / esize && i < n; k++, i++)
      for (size_t j = 0; j < esize; j++)
        chunk[esize * k + j] = (unsigned char)((uint64_t)tokens[i] >> (8 * j));
    ddp__afile_write(&f, chunk, esize * k);
  }
  return ddp__afile_commit(&f, 0644);
}

ddp_status_t ddp_tokens_write_llmc(const char *path, const int64_t *tokens, int64_t n,
                                   ddp_error_t *err) {
  return write_llmc(path, tokens, n, false, err);
}

ddp_status_t ddp_tokens_write_llmc_llama3(const char *path, const int64_t *tokens, int64_t n,
                                          ddp_error_t *err) {
  return write_llmc(path, tokens, n, true, err);
}

/* ---------------------------------------------------------------- safetensors ----- */

/* ddp_st_parse's messages start with where it parsed; the path replaces that. */
static ddp_status_t st_failed(const char *path, ddp_status_t st, const ddp_error_t *inner,
                              bool relabelled, ddp_error_t *err) {
  static const char prefix[] = "safetensors (memory): ";
  const char *m = inner->msg;
  if (strncmp(m, prefix, sizeof prefix - 1) == 0) m += sizeof prefix - 1;
  return ddp__error_quiet(err, st, "tokens %s: safetensors: %s%s", path, m,
                          relabelled ? " (checked with its U16 tensors relabelled F16, the "
                                       "same element size)"
                                     : "");
}

/* safetensors defines U16, but libddp's dtype list does not hold it and its reader refuses
 * such a file as UNSUPPORTED. So in a copy of the file every "dtype": "U16" of the header
 * is rewritten "F16" in place (the same element size, the same header length: offsets,
 * data and every other header byte are unchanged) and the copy goes through the reader,
 * which still validates the whole layout; the token tensor's bits are then read as uint16.
 * The scan walks the header's JSON strings (skipping escapes) and rewrites a "U16" string
 * that is the value of a "dtype" key. Returns how many it rewrote. */
static size_t relabel_u16(unsigned char *h, size_t n) {
  size_t count = 0, i = 0;
  while (i < n) {
    if (h[i++] != '"') continue;
    size_t b = i;
    while (i < n && h[i] != '"') i += h[i] == '\\' ? 2 : 1;
    if (i >= n) break;
    size_t e = i++;
    if (e - b != 5 || memcmp(h + b, "dtype", 5) != 0) continue;
    size_t j = i;
    while (j < n && (h[j] == ' ' || h[j] == '\t' || h[j] == '\n' || h[j] == '\r')) j++;
    if (j >= n || h[j] != ':') continue;
    j++;
    while (j < n && (h[j] == ' ' || h[j] == '\t' || h[j] == '\n' || h[j] == '\r')) j++;
    if (n - j >= 5 && memcmp(h + j, "\"U16\"", 5) == 0) {
      h[j + 1] = 'F';
      count++;
      i = j + 5;
    }
  }
  return count;
}

/* Whether tensor `name` is declared U16 in the original header (valid JSON: the relabelled
 * copy, which differs only in those letters, passed the reader). */
static bool declared_u16(const unsigned char *b, const char *name) {
  uint64_t hlen = le64(b);
  cJSON *hdr = cJSON_ParseWithLength((const char *)b + 8, (size_t)hlen);
  const cJSON *e = hdr ? cJSON_GetObjectItemCaseSensitive(hdr, name) : NULL;
  const cJSON *dt = e ? cJSON_GetObjectItemCaseSensitive(e, "dtype") : NULL;
  bool u16 = cJSON_IsString(dt) && strcmp(dt->valuestring, "U16") == 0;
  cJSON_Delete(hdr);
  return u16;
}

static void shape_str(const ddp_tensor_t *t, char *buf, size_t cap) {
  size_t k = (size_t)snprintf(buf, cap, "[");
  for (int d = 0; d < t->ndim && k < cap; d++)
    k += (size_t)snprintf(buf + k, cap - k, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Picks and converts the token tensor of a parsed file. */
static ddp_status_t st_take(const char *path, const ddp_st_file_t *f, const unsigned char *b,
                            bool relabelled, int64_t **tokens, int64_t *n, ddp_error_t *err) {
  size_t idx = 0, count = ddp_st_count(f);
  if (ddp_st_find(f, ST_TENSOR_NAME, &idx) != DDP_OK) {
    if (count != 1)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "tokens %s: safetensors: no tensor named '" ST_TENSOR_NAME "' and %zu "
                        "tensors%s%s%s, so none is the token stream",
                        path, count, count ? " (the first: '" : "", count ? ddp_st_name(f, 0) : "",
                        count ? "')" : "");
    idx = 0;
  }
  const char *name = ddp_st_name(f, idx);
  ddp_tensor_t v;
  DDP_CHECK(ddp_st_tensor(f, idx, &v));
  bool u16 = relabelled && v.dtype == DDP_F16 && declared_u16(b, name);
  if (!u16 && v.dtype != DDP_I32 && v.dtype != DDP_I64 && v.dtype != DDP_U8)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: safetensors: tensor '%s' has dtype %s; token ids must be "
                      "I32, I64, U16 or U8",
                      path, name, ddp_dtype_name(v.dtype));
  char shape[128];
  shape_str(&v, shape, sizeof shape);
  if (v.ndim != 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: safetensors: tensor '%s' has shape %s; a token stream is 1-D",
                      path, name, shape);
  if (v.numel == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: safetensors: tensor '%s' is empty (shape %s)", path, name, shape);
  int64_t *ids = alloc_ids(v.numel);
  if (!ids)
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "tokens %s: %lld tokens", path,
                      (long long)v.numel);
  for (int64_t i = 0; i < v.numel; i++) {
    int64_t id;
    if (u16) {
      id = ((const uint16_t *)v.data)[i];
    } else if (v.dtype == DDP_U8) {
      id = ((const uint8_t *)v.data)[i];
    } else if (v.dtype == DDP_I32) {
      id = ((const int32_t *)v.data)[i];
    } else {
      id = ((const int64_t *)v.data)[i];
    }
    if (id < 0) {
      ddp__free(ids);
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "tokens %s: safetensors: tensor '%s' holds token id %lld at position "
                        "%lld; ids are >= 0",
                        path, name, (long long)id, (long long)i);
    }
    ids[i] = id;
  }
  *tokens = ids;
  *n = v.numel;
  return DDP_OK;
}

static ddp_status_t tokens_from_safetensors(const char *path, const unsigned char *b, size_t len,
                                            int64_t **tokens, int64_t *n, ddp_error_t *err) {
  unsigned char *img = NULL;
  if (len >= 8 && le64(b) <= len - 8 && memmem(b + 8, (size_t)le64(b), "U16", 3)) {
    img = ddp__malloc(len);
    if (!img) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "tokens %s: %zu bytes", path, len);
    memcpy(img, b, len);
    if (relabel_u16(img + 8, (size_t)le64(b)) == 0) {
      ddp__free(img);
      img = NULL;
    }
  }
  ddp_st_file_t *f = NULL;
  ddp_error_t inner = {0};
  ddp_status_t st = ddp_st_parse(img ? img : b, len, &f, &inner);
  if (st == DDP_OK)
    st = st_take(path, f, b, img != NULL, tokens, n, err);
  else
    st = st_failed(path, st, &inner, img != NULL, err);
  ddp_st_close(f);
  ddp__free(img);
  return st;
}

/* ---------------------------------------------------------------- text ------------ */

static ddp_status_t tokens_from_text(const char *path, const unsigned char *b, size_t len,
                                     int64_t **tokens, int64_t *n, ddp_error_t *err) {
  if (len == 0)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "tokens %s: the text file is empty (0 bytes): no tokens", path);
  if (len > (size_t)INT64_MAX / sizeof(int64_t))
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "tokens %s: %zu bytes", path, len);
  int64_t *ids = alloc_ids((int64_t)len);
  if (!ids) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "tokens %s: %zu tokens", path, len);
  ddp_byte_encode((const char *)b, len, ids);
  *tokens = ids;
  *n = (int64_t)len;
  return DDP_OK;
}

/* ---------------------------------------------------------------- dispatch -------- */

static bool has_ext(const char *path, const char *ext) {
  size_t a = strlen(path), b = strlen(ext);
  return a > b && strcasecmp(path + a - b, ext) == 0;
}

static token_format_t sniff(const unsigned char *b, size_t len) {
  if (len >= 4) {
    int32_t m = le32s(b);
    if (m == DDP_LLMC_MAGIC || m == DDP_LLMC_MAGIC_U32 || m == LLMC_EVAL_MAGIC) return FMT_LLMC;
  }
  if (len >= 9 && le64(b) <= len - 8 && b[8] == '{') return FMT_SAFETENSORS;
  if (len > 0 && !memchr(b, '\0', DDP_MIN(len, SNIFF_BYTES))) return FMT_TEXT;
  return FMT_UNKNOWN;
}

ddp_status_t ddp_tokens_read(const char *path, int64_t **tokens, int64_t *n, ddp_error_t *err) {
  DDP_REQUIRE(path && tokens && n);
  *tokens = NULL;
  *n = 0;
  char *text = NULL;
  size_t len = 0;
  DDP_CHECK(ddp__file_read(path, 0, -1, "tokens", &text, &len, err));
  const unsigned char *b = (const unsigned char *)text;
  token_format_t fmt = has_ext(path, ".bin")           ? FMT_LLMC
                       : has_ext(path, ".safetensors") ? FMT_SAFETENSORS
                       : has_ext(path, ".txt")         ? FMT_TEXT
                                                       : sniff(b, len);
  ddp_status_t st;
  switch (fmt) {
    case FMT_LLMC: st = ddp__tokens_parse_llmc(path, b, len, tokens, n, err); break;
    case FMT_SAFETENSORS: st = tokens_from_safetensors(path, b, len, tokens, n, err); break;
    case FMT_TEXT: st = tokens_from_text(path, b, len, tokens, n, err); break;
    default:
      st = len == 0 ? ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                                 "tokens %s: the file is empty (0 bytes): no tokens", path)
                    : ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                                 "tokens %s: unknown format: no llm.c magic (%d), no safetensors "
                                 "header, and not text (a NUL byte at offset %zu); name the file "
                                 ".bin, .safetensors or .txt to choose",
                                 path, DDP_LLMC_MAGIC,
                                 (size_t)((const unsigned char *)memchr(b, '\0', len) - b));
      break;
  }
  ddp__free(text);
  return st;
}
