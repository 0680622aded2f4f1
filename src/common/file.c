/* Files: the one atomic writer, the one mkdir -p and the one whole-file reader of libddp
 * (common.h, "Files", has the contracts and the durability policy). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/common.h"

/* Logs and records a failed step: "<what>: <step>(<file>): <strerror> (errno N)" (no
 * "<what>: " when what is ""). */
static ddp_status_t file_error(ddp_error_t *err, int rank, ddp_status_t st, const char *what,
                               const char *step, const char *file, int e) {
  const char *sep = what[0] ? ": " : "";
  if (rank == DDP__QUIET)
    return ddp__error_quiet(err, st, "%s%s%s(%s): %s (errno %d)", what, sep, step, file,
                            strerror(e), e);
  return ddp__error(err, rank, st, "%s%s%s(%s): %s (errno %d)", what, sep, step, file, strerror(e),
                    e);
}

/* ---------------------------------------------------------------- atomic write ---- */

ddp_status_t ddp__afile_open(ddp__afile_t *f, const char *path, int rank, const char *what,
                             ddp_error_t *err) {
  DDP_REQUIRE(f && path && what);
  *f = (ddp__afile_t){.fd = -1, .rank = rank, .path = path, .err = err};
  snprintf(f->what, sizeof f->what, "%s", what);
  /* "<dir>/.<name>.tmp.XXXXXX": the target's own directory, so that rename() stays on one
   * file system, and a dot name, so that directory scans (the file store's keys, a
   * checkpoint's checksums) never take it for a real file. */
  const char *slash = strrchr(path, '/');
  int dlen = slash ? (int)(slash - path) + 1 : 0;
  int k = snprintf(f->tmp, sizeof f->tmp, "%.*s.%s.tmp.XXXXXX", dlen, path,
                   slash ? slash + 1 : path);
  if (k < 0 || (size_t)k >= sizeof f->tmp) {
    f->st = file_error(err, rank, DDP_ERR_INVALID_ARGUMENT, f->what, "mkostemp", path,
                       ENAMETOOLONG);
    return f->st;
  }
  f->fd = mkostemp(f->tmp, O_CLOEXEC);
  if (f->fd < 0) f->st = file_error(err, rank, DDP_ERR_SYSTEM, f->what, "mkostemp", f->tmp, errno);
  return f->st;
}

ddp_status_t ddp__afile_write(ddp__afile_t *f, const void *buf, size_t len) {
  const unsigned char *p = buf;
  while (f->st == DDP_OK && len > 0) {
    ssize_t w = write(f->fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      f->st = file_error(f->err, f->rank, DDP_ERR_SYSTEM, f->what, "write", f->tmp,
                         w < 0 ? errno : ENOSPC);
      break;
    }
    p += w;
    len -= (size_t)w;
  }
  return f->st;
}

void ddp__afile_discard(ddp__afile_t *f) {
  if (f->fd >= 0) {
    close(f->fd);
    unlink(f->tmp);
  }
  f->fd = -1;
}

ddp_status_t ddp__sync_dir(const char *dir, int rank, const char *what, ddp_error_t *err) {
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return file_error(err, rank, DDP_ERR_SYSTEM, what, "open", dir, errno);
  int r = fsync(dfd), e = errno;
  close(dfd);
  if (r != 0 && e != EINVAL) return file_error(err, rank, DDP_ERR_SYSTEM, what, "fsync", dir, e);
  return DDP_OK;
}

/* The directory holding f->path, synced so that the rename in it is durable. */
static ddp_status_t sync_parent(ddp__afile_t *f) {
  char dir[sizeof f->tmp];
  const char *slash = strrchr(f->path, '/');
  if (!slash) {
    snprintf(dir, sizeof dir, ".");
  } else if (slash == f->path) {
    snprintf(dir, sizeof dir, "/");
  } else {
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - f->path), f->path);
  }
  return ddp__sync_dir(dir, f->rank, f->what, f->err);
}

ddp_status_t ddp__afile_commit(ddp__afile_t *f, unsigned mode) {
  if (f->st != DDP_OK) {
    ddp__afile_discard(f);
    return f->st;
  }
  const char *step = NULL;
  if (fchmod(f->fd, (mode_t)mode) != 0)
    step = "fchmod";
  else if (fsync(f->fd) != 0)
    step = "fsync";
  int e = errno;
  if (close(f->fd) != 0 && !step) {
    step = "close";
    e = errno;
  }
  f->fd = -1;
  if (!step && rename(f->tmp, f->path) != 0) {
    step = "rename";
    e = errno;
  }
  if (step) {
    unlink(f->tmp);
    f->st = file_error(f->err, f->rank, DDP_ERR_SYSTEM, f->what, step,
                       strcmp(step, "rename") ? f->tmp : f->path, e);
    return f->st;
  }
  f->st = sync_parent(f);
  return f->st;
}

ddp_status_t ddp__file_write_atomic(const char *path, const void *buf, size_t len, unsigned mode,
                                    int rank, const char *what, ddp_error_t *err) {
  ddp__afile_t f;
  if (ddp__afile_open(&f, path, rank, what, err) == DDP_OK) ddp__afile_write(&f, buf, len);
  return ddp__afile_commit(&f, mode);
}

/* ---------------------------------------------------------------- mkdir -p -------- */

ddp_status_t ddp__mkdirs(const char *path, int rank, const char *what, ddp_error_t *err) {
  DDP_REQUIRE(path && what);
  char buf[4096];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf)
    return file_error(err, rank, DDP_ERR_INVALID_ARGUMENT, what, "mkdir", path,
                      n ? ENAMETOOLONG : ENOENT);
  memcpy(buf, path, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] != '/' && buf[i] != 0) continue;
    char c = buf[i];
    buf[i] = 0;
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
      return file_error(err, rank, DDP_ERR_SYSTEM, what, "mkdir", buf, errno);
    buf[i] = c;
  }
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return file_error(err, rank, DDP_ERR_INVALID_ARGUMENT, what, "mkdir", path, ENOTDIR);
  return DDP_OK;
}

/* ---------------------------------------------------------------- whole-file read - */

ddp_status_t ddp__file_read(const char *path, size_t max, int rank, const char *what, char **out,
                            size_t *len, ddp_error_t *err) {
  DDP_REQUIRE(path && what && out);
  *out = NULL;
  if (len) *len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return file_error(err, rank, e == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM, what, "open",
                      path, e);
  }
  ddp_status_t st = DDP_OK;
  char *buf = NULL;
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    st = file_error(err, rank, DDP_ERR_SYSTEM, what, "fstat", path, errno);
    goto out;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = rank == DDP__QUIET ? ddp__error_quiet(err, DDP_ERR_INVALID_ARGUMENT,
                                               "%s: %s: not a regular file", what, path)
                            : ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                                         "%s: %s: not a regular file", what, path);
    goto out;
  }
  size_t size = (size_t)sb.st_size;
  if (max && size > max) {
    st = file_error(err, rank, DDP_ERR_INVALID_DATA, what, "read", path, EFBIG);
    goto out;
  }
  buf = ddp__malloc(size + 1);
  if (!buf) {
    st = file_error(err, rank, DDP_ERR_NO_MEMORY, what, "malloc", path, ENOMEM);
    goto out;
  }
  size_t got = 0;
  while (got < size) {
    ssize_t r = read(fd, buf + got, size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      st = file_error(err, rank, DDP_ERR_SYSTEM, what, "read", path, errno);
      goto out;
    }
    if (r == 0) break; /* the file shrank while it was read: what is there is the file */
    got += (size_t)r;
  }
  buf[got] = '\0';
  *out = buf;
  if (len) *len = got;
  buf = NULL;
out:
  ddp__free(buf);
  close(fd);
  return st;
}
