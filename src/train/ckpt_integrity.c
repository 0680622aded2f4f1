/* Checkpoint integrity: a SHA-256 per file, recorded when a checkpoint is committed and
 * verified before one is loaded.
 *
 * checkpoint-<step>/checksums.sha256 lists every other file of the checkpoint in
 * sha256sum's format ("<64 hex digits>  <name>\n", names sorted), so `sha256sum -c
 * checksums.sha256` inside the directory checks it as well. It is written by rank 0 at
 * commit time, after every rank has added its files, atomically like the others. A
 * checkpoint without it is accepted unverified only when it was written before checksums
 * were recorded (its trainer_state.json has no "checkpoint_format" >= 2); one of this
 * format without it is refused: the file was lost or removed, and nothing vouches for the
 * rest. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/train_internal.h"

/* ---------------------------------------------------------------- SHA-256 --------- */

typedef struct sha256 {
  uint32_t h[8];
  uint64_t bytes;
  uint8_t block[64];
  size_t used;
} sha256_t;

static const uint32_t K256[64] = {0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b,
                                  0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
                                  0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7,
                                  0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
                                  0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152,
                                  0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
                                  0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
                                  0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
                                  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
                                  0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
                                  0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f,
                                  0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
                                  0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_init(sha256_t *s) {
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, h0, sizeof h0);
  s->bytes = 0;
  s->used = 0;
}

static void sha256_block(sha256_t *s, const uint8_t *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
           p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5],
           g = s->h[6], h = s->h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = h + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
    uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  s->h[0] += a;
  s->h[1] += b;
  s->h[2] += c;
  s->h[3] += d;
  s->h[4] += e;
  s->h[5] += f;
  s->h[6] += g;
  s->h[7] += h;
}

static void sha256_update(sha256_t *s, const uint8_t *p, size_t n) {
  s->bytes += n;
  while (n > 0) {
    if (s->used == 0 && n >= 64) {
      sha256_block(s, p);
      p += 64;
      n -= 64;
      continue;
    }
    size_t k = DDP_MIN(64 - s->used, n);
    memcpy(s->block + s->used, p, k);
    s->used += k;
    p += k;
    n -= k;
    if (s->used == 64) {
      sha256_block(s, s->block);
      s->used = 0;
    }
  }
}

/* The digest as 64 lowercase hex digits and a NUL. */
static void sha256_hex(sha256_t *s, char out[65]) {
  uint64_t bits = s->bytes * 8;
  uint8_t pad = 0x80, zero = 0, len[8];
  sha256_update(s, &pad, 1);
  while (s->used != 56) sha256_update(s, &zero, 1);
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
  sha256_update(s, len, 8);
  for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", s->h[i]);
}

/* ---------------------------------------------------------------- files ----------- */

/* An error of this file: logged once (ddp__error) unless quiet, when the caller reports it
 * (a search of checkpoints that warns about each one it skips). */
DDP_PRINTF(4, 5)
static ddp_status_t fail(bool quiet, ddp_error_t *err, ddp_status_t st, const char *fmt, ...) {
  char msg[DDP_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return quiet ? ddp__error_quiet(err, st, "%s", msg) : ddp__error(err, -1, st, "%s", msg);
}

static ddp_status_t file_sha256(const char *path, char out[65], bool quiet, ddp_error_t *err) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return fail(quiet, err, e == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM,
                "open %s: %s (errno %d)", path, strerror(e), e);
  }
  enum { CHUNK = 1 << 20 };
  uint8_t *buf = ddp__malloc(CHUNK);
  if (!buf) {
    close(fd);
    return DDP_ERR_NO_MEMORY;
  }
  sha256_t s;
  sha256_init(&s);
  ddp_status_t st = DDP_OK;
  for (;;) {
    ssize_t k = read(fd, buf, CHUNK);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      int e = errno;
      st = fail(quiet, err, DDP_ERR_SYSTEM, "read %s: %s (errno %d)", path, strerror(e), e);
      break;
    }
    if (k == 0) break;
    sha256_update(&s, buf, (size_t)k);
  }
  ddp__free(buf);
  close(fd);
  if (st == DDP_OK) sha256_hex(&s, out);
  return st;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

ddp_status_t ddp__train_write_checksums(const char *dir, ddp_error_t *err) {
  DIR *d = opendir(dir);
  if (!d) {
    int e = errno;
    return ddp__error(err, -1, DDP_ERR_SYSTEM, "opendir %s: %s (errno %d)", dir, strerror(e), e);
  }
  size_t n = 0, cap = 16;
  char **names = ddp__malloc(cap * sizeof *names);
  ddp_status_t st = names ? DDP_OK : DDP_ERR_NO_MEMORY;
  struct dirent *e;
  char path[4600];
  while (st == DDP_OK && (e = readdir(d))) {
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (e->d_name[0] == '.' || !strcmp(e->d_name, DDP__TRAIN_CHECKSUMS) ||
        strstr(e->d_name, ".tmp.") || stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
      continue;
    if (n == cap) {
      char **t = ddp__realloc(names, 2 * cap * sizeof *names);
      if (!t) {
        st = DDP_ERR_NO_MEMORY;
        break;
      }
      names = t;
      cap *= 2;
    }
    if (!(names[n] = ddp__strdup(e->d_name)))
      st = DDP_ERR_NO_MEMORY;
    else
      n++;
  }
  closedir(d);
  char *text = st == DDP_OK ? ddp__malloc(n * 400 + 1) : NULL;
  if (st == DDP_OK && !text) st = DDP_ERR_NO_MEMORY;
  size_t len = 0;
  if (st == DDP_OK) qsort(names, n, sizeof *names, cmp_str);
  for (size_t i = 0; st == DDP_OK && i < n; i++) {
    char hex[65];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    st = file_sha256(path, hex, false, err);
    if (st == DDP_OK) len += (size_t)snprintf(text + len, 400, "%s  %.300s\n", hex, names[i]);
  }
  if (st == DDP_OK) {
    snprintf(path, sizeof path, "%s/%s", dir, DDP__TRAIN_CHECKSUMS);
    st = ddp__file_write_atomic(path, text, len, 0644, -1, "checkpoint", err);
  }
  for (size_t i = 0; i < n; i++) ddp__free(names[i]);
  ddp__free(names);
  ddp__free(text);
  return st;
}

/* trainer_state.json's "checkpoint_format" (0 when absent: older checkpoints). */
static ddp_status_t checkpoint_format(const char *dir, bool quiet, int64_t *format,
                                      ddp_error_t *err) {
  char path[4600];
  snprintf(path, sizeof path, "%s/trainer_state.json", dir);
  char *text = NULL;
  if (access(path, F_OK) != 0) return DDP_OK; /* reported by whoever reads the state */
  (void)quiet;
  DDP_CHECK(ddp__file_read(path, 0, -1, "checkpoint", &text, NULL, err));
  cJSON *o = cJSON_Parse(text);
  ddp__free(text);
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "checkpoint_format");
  *format = cJSON_IsNumber(v) ? (int64_t)v->valuedouble : 0;
  cJSON_Delete(o);
  return DDP_OK;
}

ddp_status_t ddp__train_verify_checkpoint(const char *dir, bool quiet, ddp_error_t *err) {
  char path[4600], line[1024];
  snprintf(path, sizeof path, "%s/%s", dir, DDP__TRAIN_CHECKSUMS);
  FILE *f = fopen(path, "r");
  if (!f) {
    int e = errno;
    if (e == ENOENT) {
      int64_t format = 0;
      DDP_CHECK(checkpoint_format(dir, quiet, &format, err));
      if (format < DDP__TRAIN_CHECKPOINT_FORMAT) return DDP_OK; /* before checksums */
      return fail(quiet, err, DDP_ERR_INVALID_DATA,
                  "%s is missing: the checkpoint was written with checksums (its "
                  "trainer_state.json has checkpoint_format %lld), so it is incomplete or was "
                  "altered, and is not resumed unverified; resume an intact checkpoint, or "
                  "restore the file",
                  path, (long long)format);
    }
    return fail(quiet, err, DDP_ERR_SYSTEM, "open %s: %s (errno %d)", path, strerror(e), e);
  }
  ddp_status_t st = DDP_OK;
  int lineno = 0;
  while (st == DDP_OK && fgets(line, sizeof line, f)) {
    lineno++;
    size_t l = strlen(line);
    while (l > 0 && (line[l - 1] == '\n' || line[l - 1] == '\r')) line[--l] = '\0';
    if (l == 0) continue;
    const char *name = line + 66;
    if (l < 67 || line[64] != ' ' || line[65] != ' ' || strspn(line, "0123456789abcdef") != 64 ||
        strchr(name, '/')) {
      st = fail(quiet, err, DDP_ERR_INVALID_DATA,
                "%s line %d: expected \"<64 hex digits>  <file name>\"", path, lineno);
      break;
    }
    line[64] = '\0';
    char file[4600], hex[65];
    snprintf(file, sizeof file, "%s/%s", dir, name);
    /* Quietly: a missing file is reported below as what it means for the checkpoint. */
    st = file_sha256(file, hex, true, err);
    if (st == DDP_ERR_NOT_FOUND) {
      st = fail(quiet, err, DDP_ERR_INVALID_DATA,
                "%s is missing: %s lists it (the checkpoint is incomplete)", file, path);
    } else if (st != DDP_OK) {
      st = fail(quiet, err, st, "%s", err ? err->msg : ddp_status_name(st));
    } else if (strcmp(hex, line) != 0) {
      st = fail(quiet, err, DDP_ERR_INVALID_DATA,
                "%s is corrupt: its SHA-256 is %s, but %s recorded %s when the checkpoint "
                "was saved",
                file, hex, DDP__TRAIN_CHECKSUMS, line);
    }
  }
  fclose(f);
  return st;
}
