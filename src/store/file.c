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
 * kernel drops it when a holder dies. A contended lock is waited for in the kernel (lock_wait).
 * Reads take no lock. Blocking calls poll with a backoff (1 ms doubling up to 32 ms) that
 * cancellation interrupts.
 *
 * File names: a key made of [A-Za-z0-9_-] and other bytes escaped as %XX, behind "k.",
 * when that fits in 200 bytes; otherwise "h." and 32 hex digits of two 64-bit hashes of the
 * key. The key stored inside the file is compared on every read, so a hash collision is
 * detected (DDP_ERR_INVALID_DATA), never silently served. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
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

/* A contended lock is waited for in the kernel, where each release wakes the waiters: a
 * helper thread blocks in flock(LOCK_EX) while the caller waits for it, with the call's
 * deadline and cancellation. Polling with a backoff (as before) starved a waiter whenever
 * another thread re-took the lock in a loop: the lock was free only between one holder's
 * release and its next take, and a poller sleeping up to 16 ms almost never saw that
 * window (in the soak, one of 8 threads adding in a loop waited past its 10 s timeout).
 * When the caller gives up first, the helper releases the lock as soon as it gets it and
 * frees the shared state; `mu` decides which of the two saw the end first. */
typedef struct lock_wait {
  pthread_mutex_t mu;
  int fd;         /* the lock file, open; the helper's once abandoned */
  int efd;        /* eventfd, readable when the helper is done */
  int result;     /* the helper's flock: 0 or an errno */
  bool done;      /* under mu */
  bool abandoned; /* under mu */
} lock_wait_t;

static void lock_wait_free(lock_wait_t *w) {
  close(w->efd);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

static void *lock_helper(void *arg) {
  lock_wait_t *w = arg;
  int r;
  while ((r = flock(w->fd, LOCK_EX)) != 0 && errno == EINTR) {
  }
  int e = r == 0 ? 0 : errno;
  pthread_mutex_lock(&w->mu);
  bool abandoned = w->abandoned;
  w->result = e;
  w->done = true;
  if (!abandoned) { /* under mu: the caller frees w only after it saw done under mu */
    uint64_t one = 1;
    ssize_t n = write(w->efd, &one, sizeof one);
    (void)n; /* an eventfd counter far from overflow */
  }
  pthread_mutex_unlock(&w->mu);
  if (abandoned) {
    close(w->fd); /* drops the lock if the helper got it */
    lock_wait_free(w);
  }
  return NULL;
}

/* Waits for the lock on `fd` (open on the lock file) in a helper thread; on success the
 * lock is held through fd. On failure fd is closed (or handed to the helper). */
static ddp_status_t lock_wait(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                              const char *path, int fd) {
  lock_wait_t *w = calloc(1, sizeof *w);
  int efd = w ? eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK) : -1;
  if (efd < 0) {
    int e = w ? errno : ENOMEM;
    free(w);
    close(fd);
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM,
                      "%s: %s: waiting for the lock %s: %s (errno %d)", s->desc, what, path,
                      strerror(e), e);
  }
  pthread_mutex_init(&w->mu, NULL);
  w->fd = fd;
  w->efd = efd;
  pthread_attr_t attr;
  pthread_t tid;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int e = pthread_create(&tid, &attr, lock_helper, w);
  pthread_attr_destroy(&attr);
  if (e != 0) {
    lock_wait_free(w);
    close(fd);
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM,
                      "%s: %s: a thread to wait for the lock %s: %s (errno %d)", s->desc, what,
                      path, strerror(e), e);
  }
  struct pollfd pfd[DDP_STORE_MAX_DEPTH + 2];
  pfd[0] = (struct pollfd){efd, POLLIN, 0};
  int n = 1 + ddp__store_cancel_pollfds(c, pfd + 1, DDP_STORE_MAX_DEPTH + 1);
  bool cancelled = false;
  for (;;) {
    int ms = ddp_ms_until(c->deadline_ns);
    if (poll(pfd, (nfds_t)n, ms) > 0 && !(pfd[0].revents & POLLIN) && ddp__store_cancelled(c)) {
      cancelled = true;
      break;
    }
    if ((pfd[0].revents & POLLIN) || ddp_ms_until(c->deadline_ns) == 0) break;
  }
  pthread_mutex_lock(&w->mu);
  bool done = w->done;
  w->abandoned = !done;
  pthread_mutex_unlock(&w->mu);
  if (!done) { /* the helper closes fd and frees w */
    if (cancelled) return ddp__store_aborted(c, what);
    return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                      "%s: %s timed out after %lld ms waiting for the lock %s", s->desc, what,
                      (long long)c->timeout_ms, path);
  }
  int r = w->result;
  lock_wait_free(w);
  if (r != 0) {
    close(fd);
    return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: %s: flock(%s): %s (errno %d)", s->desc,
                      what, path, strerror(r), r);
  }
  return DDP_OK; /* done, even if the deadline passed meanwhile: the lock is ours */
}

/* Opens "<dir>/<name>" for a lock. */
static ddp_status_t open_lock_file(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                                   const char *name, char *path, int *out) {
  snprintf(path, PATH_CAP, "%s/%s", fst(s)->dir, name);
  *out = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (*out >= 0) return DDP_OK;
  int e = errno;
  return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: %s: open(%s): %s (errno %d)", s->desc,
                    what, path, strerror(e), e);
}

/* Takes the directory lock: at once when it is free and nobody waits for it, else through
 * lock_wait. A waiter holds a shared flock on "<dir>/.wait" while it waits, and a caller
 * that finds one queues behind it in the kernel instead of taking the lock the moment it is
 * released: otherwise the thread that just released the lock, still running, would
 * usually take it again before the waiter the release woke got a CPU. */
static ddp_status_t lock_dir(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                             int *out) {
  char path[PATH_CAP], wpath[PATH_CAP];
  int fd, wfd, r;
  DDP_CHECK(open_lock_file(s, c, what, ".lock", path, &fd));
  ddp_status_t st = open_lock_file(s, c, what, ".wait", wpath, &wfd);
  if (st != DDP_OK) {
    close(fd);
    return st;
  }
  bool waiters = flock(wfd, LOCK_EX | LOCK_NB) != 0;
  if (!waiters) {
    flock(wfd, LOCK_UN);
    while ((r = flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    if (r == 0) {
      close(wfd);
      *out = fd;
      return DDP_OK;
    }
    int e = errno;
    if (e != EWOULDBLOCK) {
      close(fd);
      close(wfd);
      return ddp__error(c->err, c->rank, DDP_ERR_SYSTEM, "%s: %s: flock(%s): %s (errno %d)",
                        s->desc, what, path, strerror(e), e);
    }
  }
  /* Shared, so any number wait at once; blocks only for the instant another caller holds it
   * exclusively to look. */
  while ((r = flock(wfd, LOCK_SH)) != 0 && errno == EINTR) {
  }
  st = lock_wait(s, c, what, path, fd);
  close(wfd); /* drops the shared lock */
  if (st == DDP_OK) *out = fd;
  return st;
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
