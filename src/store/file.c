/* The file store: a directory on a filesystem every rank sees (local, tmpfs or NFS), one
 * file per key.
 *
 * A key file holds a 16-byte header ("DDPK", u32 key length, u64 value length, little
 * endian), the full key and the value. Writers build the file under a temporary name
 * starting with '.' and rename() it over the key's name (libddp's one atomic writer,
 * src/common/file.c), so readers see either the old or the new file, never a torn one.
 * Read-modify-write operations (add, compare_set, delete, and set, so that a set never slips
 * between another writer's read and rename) hold an exclusive flock() on "<dir>/.lock"; flock is
 * per open file description, so it excludes threads of one process as well as processes, and the
 * kernel drops it when a holder dies. Reads take no lock. Blocking calls poll with a backoff (1 ms
 * doubling up to 32 ms) that cancellation interrupts.
 *
 * File names: a key made of [A-Za-z0-9_-] and other bytes escaped as %XX, behind "k.",
 * when that fits in 200 bytes; otherwise "h." and 32 hex digits of two 64-bit hashes of the
 * key. The key stored inside the file is compared on every read, so a hash collision is
 * detected (DDP_ERR_INVALID_DATA), never silently served. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/store_internal.h"

#define KEY_FILE_MAGIC 0x4b504444u /* "DDPK" */
#define KEY_FILE_HDR 16
#define NAME_MAX_SHORT 200

typedef struct file_store {
  char *dir;
} file_store_t;

static file_store_t *fst(ddp_store_t *s) { return s->impl; }

static uint64_t hash64(const char *p, size_t n, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (size_t i = 0; i < n; i++) {
    h ^= (unsigned char)p[i];
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

/* Writes "<dir>/<encoded key>" into path. */
static void key_path(const file_store_t *f, const char *key, char *path, size_t cap) {
  static const char hex[] = "0123456789abcdef";
  char name[NAME_MAX_SHORT + 8];
  size_t n = 0;
  bool fits = true;
  name[n++] = 'k';
  name[n++] = '.';
  for (const unsigned char *p = (const unsigned char *)key; *p; p++) {
    bool plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                 *p == '_' || *p == '-';
    if (n + (plain ? 1 : 3) > NAME_MAX_SHORT) {
      fits = false;
      break;
    }
    if (plain) {
      name[n++] = (char)*p;
    } else {
      name[n++] = '%';
      name[n++] = hex[*p >> 4];
      name[n++] = hex[*p & 15];
    }
  }
  name[n] = '\0';
  if (!fits) {
    size_t kl = strlen(key);
    snprintf(name, sizeof name, "h.%016llx%016llx", (unsigned long long)hash64(key, kl, 0),
             (unsigned long long)hash64(key, kl, 0x9e3779b97f4a7c15ull));
  }
  snprintf(path, cap, "%s/%s", f->dir, name);
}

/* Directory paths are limited to 3800 bytes, so a key path always fits. */
#define PATH_CAP 4096

/* Reads the key file at path. Returns DDP_OK with *found false when it does not exist.
 * *v (ddp_malloc) and *n receive the value when want_value. */
static ddp_status_t read_key(ddp_store_t *s, const ddp__store_call_t *c, const char *path,
                             const char *key, bool *found, void **v, size_t *n) {
  *found = false;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return DDP_OK;
    int e = errno;
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: open(%s): %s (errno %d)", s->desc, path,
                      strerror(e), e);
  }
  ddp_status_t st = DDP_OK;
  unsigned char hdr[KEY_FILE_HDR];
  unsigned char *buf = NULL;
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    st = ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: fstat(%s): %s (errno %d)", s->desc, path,
                    strerror(e), e);
    goto out;
  }
  size_t klen = strlen(key);
  ssize_t r = pread(fd, hdr, sizeof hdr, 0);
  uint64_t vlen = r == (ssize_t)sizeof hdr ? ddp__wire_get_u64(hdr + 8) : 0;
  if (r != (ssize_t)sizeof hdr || ddp__wire_get_u32(hdr) != KEY_FILE_MAGIC ||
      ddp__wire_get_u32(hdr + 4) > DDP_STORE_MAX_KEY || vlen > DDP_STORE_MAX_VALUE ||
      (uint64_t)sb.st_size != KEY_FILE_HDR + ddp__wire_get_u32(hdr + 4) + vlen) {
    st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_DATA,
                    "%s: key file %s is corrupt (bad header or size %lld)", s->desc, path,
                    (long long)sb.st_size);
    goto out;
  }
  size_t total = (size_t)sb.st_size - KEY_FILE_HDR;
  buf = ddp__malloc(total);
  if (!buf) {
    st = ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "%s: out of memory reading %s", s->desc,
                    path);
    goto out;
  }
  size_t got = 0;
  while (got < total) {
    r = pread(fd, buf + got, total - got, (off_t)(KEY_FILE_HDR + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : 0;
      st = ddp__error(c->err, c->rank, r < 0 ? DDP_ERR_SYSTEM : DDP_ERR_INVALID_DATA,
                      "%s: read(%s) at offset %zu: %s", s->desc, path, KEY_FILE_HDR + got,
                      r < 0 ? strerror(e) : "unexpected end of file");
      goto out;
    }
    got += (size_t)r;
  }
  if (ddp__wire_get_u32(hdr + 4) != klen || memcmp(buf, key, klen) != 0) {
    st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_DATA,
                    "%s: key file %s holds another key (hash collision or foreign file)", s->desc,
                    path);
    goto out;
  }
  *found = true;
  if (v) {
    *v = ddp__store_dup_value(buf + klen, (size_t)vlen);
    *n = (size_t)vlen;
    if (!*v) st = ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", s->desc);
  }
out:
  ddp__free(buf);
  close(fd);
  return st;
}

/* Writes the key file atomically (src/common/file.c: a dot-named temporary beside it,
 * fsync, rename, fsync of the directory). */
static ddp_status_t write_key(ddp_store_t *s, const ddp__store_call_t *c, const char *path,
                              const char *key, const void *v, size_t n) {
  unsigned char hdr[KEY_FILE_HDR];
  size_t klen = strlen(key);
  ddp__wire_put_u32(hdr, KEY_FILE_MAGIC);
  ddp__wire_put_u32(hdr + 4, (uint32_t)klen);
  ddp__wire_put_u64(hdr + 8, n);
  ddp__afile_t f;
  if (ddp__afile_open(&f, path, c->rank, s->desc, c->err) == DDP_OK) {
    ddp__afile_write(&f, hdr, sizeof hdr);
    ddp__afile_write(&f, key, klen);
    ddp__afile_write(&f, v, n);
  }
  return ddp__afile_commit(&f, 0600);
}

/* Takes the directory lock, retrying a non-blocking flock until the deadline. */
static ddp_status_t lock_dir(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                             int *out) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  snprintf(path, sizeof path, "%s/.lock", f->dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    int e = errno;
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: %s: open(%s): %s (errno %d)", s->desc,
                      what, path, strerror(e), e);
  }
  int backoff = 1;
  for (;;) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
      *out = fd;
      return DDP_OK;
    }
    int e = errno;
    if (e != EWOULDBLOCK && e != EINTR) {
      close(fd);
      return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: %s: flock(%s): %s (errno %d)",
                        s->desc, what, path, strerror(e), e);
    }
    if (ddp_ms_until(c->deadline_ns) == 0) {
      close(fd);
      return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                        "%s: %s timed out after %lld ms waiting for the lock %s", s->desc, what,
                        (long long)c->timeout_ms, path);
    }
    if (!ddp__store_sleep(c, backoff)) {
      close(fd);
      return ddp__store_aborted(c, what);
    }
    backoff = backoff < 16 ? backoff * 2 : 16;
  }
}

static void unlock_dir(int fd) {
  flock(fd, LOCK_UN);
  close(fd);
}

static ddp_status_t file_set(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                             const void *v, size_t n) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  key_path(f, key, path, sizeof path);
  int lk;
  DDP_CHECK(lock_dir(s, c, "set", &lk));
  ddp_status_t st = write_key(s, c, path, key, v, n);
  unlock_dir(lk);
  return st;
}

/* Polls until every key exists; on timeout names the missing ones. */
static ddp_status_t poll_keys(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                              size_t nkeys, const char *what) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  int backoff = 1;
  size_t next = 0; /* keys before next are known to exist */
  for (;;) {
    while (next < nkeys) {
      bool found;
      key_path(f, keys[next], path, sizeof path);
      DDP_CHECK(read_key(s, c, path, keys[next], &found, NULL, NULL));
      if (!found) break;
      next++;
    }
    if (next == nkeys) return DDP_OK;
    if (ddp_ms_until(c->deadline_ns) == 0) break;
    if (!ddp__store_sleep(c, backoff)) return ddp__store_aborted(c, what);
    backoff = backoff < 32 ? backoff * 2 : 32;
  }
  const char *missing[DDP_STORE_MAX_WAIT_KEYS];
  size_t nm = 0;
  for (size_t i = next; i < nkeys; i++) {
    bool found = false;
    key_path(f, keys[i], path, sizeof path);
    DDP_CHECK(read_key(s, c, path, keys[i], &found, NULL, NULL));
    if (!found) missing[nm++] = keys[i];
  }
  char list[600];
  ddp__store_format_keys(list, sizeof list, missing, nm);
  return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                    "%s timed out after %lld ms on %s: missing key%s %s", what,
                    (long long)c->timeout_ms, s->desc, nm == 1 ? "" : "s", list);
}

static ddp_status_t file_get(ddp_store_t *s, const ddp__store_call_t *c, const char *key, void **v,
                             size_t *n) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  key_path(f, key, path, sizeof path);
  for (;;) {
    const char *keys[1] = {key};
    DDP_CHECK(poll_keys(s, c, keys, 1, "get"));
    bool found;
    DDP_CHECK(read_key(s, c, path, key, &found, v, n));
    if (found) return DDP_OK;
    /* deleted between the wait and the read: wait again */
  }
}

static ddp_status_t file_add(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                             int64_t delta, int64_t *result) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  key_path(f, key, path, sizeof path);
  int lk;
  DDP_CHECK(lock_dir(s, c, "add", &lk));
  void *v = NULL;
  size_t n = 0;
  bool found;
  int64_t cur = 0, r = 0;
  ddp_status_t st = read_key(s, c, path, key, &found, &v, &n);
  if (st == DDP_OK && found && !ddp__store_parse_i64(v, n, &cur)) {
    st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_USAGE,
                    "add on %s: the value at key '%.200s' (%zu bytes) is not a decimal integer",
                    s->desc, key, n);
  }
  if (st == DDP_OK && !ddp__store_add_i64(cur, delta, &r)) {
    st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_ARGUMENT,
                    "add(%lld) on %s: key '%.200s' holding %lld overflows int64", (long long)delta,
                    s->desc, key, (long long)cur);
  }
  if (st == DDP_OK) {
    char buf[24];
    int len = snprintf(buf, sizeof buf, "%lld", (long long)r);
    st = write_key(s, c, path, key, buf, (size_t)len);
  }
  unlock_dir(lk);
  ddp_free(v);
  if (st == DDP_OK) *result = r;
  return st;
}

static ddp_status_t file_wait(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                              size_t n) {
  return poll_keys(s, c, keys, n, "wait");
}

static ddp_status_t file_check(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                               size_t nkeys, bool *all) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  *all = true;
  for (size_t i = 0; i < nkeys && *all; i++) {
    key_path(f, keys[i], path, sizeof path);
    DDP_CHECK(read_key(s, c, path, keys[i], all, NULL, NULL));
  }
  return DDP_OK;
}

static ddp_status_t file_cset(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                              const void *exp, size_t exp_n, const void *des, size_t des_n,
                              void **actual, size_t *actual_n) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  key_path(f, key, path, sizeof path);
  int lk;
  DDP_CHECK(lock_dir(s, c, "compare_set", &lk));
  void *v = NULL;
  size_t n = 0;
  bool found;
  ddp_status_t st = read_key(s, c, path, key, &found, &v, &n);
  if (st == DDP_OK) {
    bool match = found ? (n == exp_n && (n == 0 || memcmp(v, exp, n) == 0)) : exp_n == 0;
    if (match) {
      st = write_key(s, c, path, key, des, des_n);
      if (st == DDP_OK) {
        ddp_free(v);
        v = ddp__store_dup_value(des, des_n);
        n = des_n;
        if (!v) st = ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "compare_set: out of memory");
      }
    } else if (!found) {
      v = ddp_malloc(0);
      n = 0;
      if (!v) st = ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "compare_set: out of memory");
    }
  }
  unlock_dir(lk);
  if (st == DDP_OK) {
    *actual = v;
    *actual_n = n;
  } else {
    ddp_free(v);
  }
  return st;
}

static ddp_status_t file_del(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                             bool *deleted) {
  file_store_t *f = fst(s);
  char path[PATH_CAP];
  key_path(f, key, path, sizeof path);
  int lk;
  DDP_CHECK(lock_dir(s, c, "delete", &lk));
  ddp_status_t st = DDP_OK;
  *deleted = unlink(path) == 0;
  if (!*deleted && errno != ENOENT) {
    int e = errno;
    st = ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: unlink(%s): %s (errno %d)", s->desc, path,
                    strerror(e), e);
  }
  unlock_dir(lk);
  return st;
}

static ddp_status_t file_num_keys(ddp_store_t *s, const ddp__store_call_t *c, int64_t *n) {
  file_store_t *f = fst(s);
  DIR *d = opendir(f->dir);
  if (!d) {
    int e = errno;
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: opendir: %s (errno %d)", s->desc,
                      strerror(e), e);
  }
  int64_t count = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if ((de->d_name[0] == 'k' || de->d_name[0] == 'h') && de->d_name[1] == '.') count++;
  }
  closedir(d);
  *n = count;
  return DDP_OK;
}

static void file_destroy(ddp_store_t *s) {
  file_store_t *f = fst(s);
  if (!f) return;
  ddp__free(f->dir);
  ddp__free(f);
  s->impl = NULL;
}

const ddp__store_ops_t ddp__store_file_ops = {
    .kind = "file",
    .set = file_set,
    .get = file_get,
    .add = file_add,
    .wait = file_wait,
    .check = file_check,
    .compare_set = file_cset,
    .del = file_del,
    .num_keys = file_num_keys,
    .wake = NULL,
    .port = NULL,
    .destroy = file_destroy,
};

static ddp_status_t create_file(const char *dir, const ddp_store_options_t *opts, ddp_error_t *err,
                                ddp_store_t **out) {
  ddp_store_t *s = NULL;
  DDP_CHECK(ddp__store_new(opts, &ddp__store_file_ops, NULL, err, &s));
  if (dir[0] == '\0' || strlen(dir) > 3800) {
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_file: directory path is empty or too long");
  }
  if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
    int e = errno;
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_SYSTEM, "ddp_store_create_file: mkdir(%s): %s (errno %d)",
                      dir, strerror(e), e);
  }
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_file: %s is not a directory", dir);
  }
  file_store_t *f = ddp__calloc(1, sizeof *f);
  char *d = ddp__strdup(dir);
  if (!f || !d) {
    ddp__free(f);
    ddp__free(d);
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "ddp_store_create_file: out of memory");
  }
  f->dir = d;
  s->impl = f;
  snprintf(s->desc, sizeof s->desc, "file store %.140s", dir);
  *out = s;
  return DDP_OK;
}

ddp_status_t ddp_store_create_file(const char *dir, const ddp_store_options_t *opts,
                                   ddp_store_t **out, ddp_error_t *err) {
  DDP_REQUIRE(dir != NULL && out != NULL);
  *out = NULL;
  return create_file(dir, opts, err, out);
}
