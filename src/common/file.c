/* Writing a file through a temporary and rename(): readers see the old file or the whole
 * new one, never a prefix. The callers (llm.c token files, the reducer's dumps) make the
 * temporary with mkstemp in the target's folder and name the failed step in their errors. */
#include <errno.h>
#include <stdio.h>
#include <unistd.h>

#include "common/common.h"

bool ddp__write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, p + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    off += (size_t)w;
  }
  return true;
}

const char *ddp__tmp_commit(int fd, const char *tmp, const char *path, const char *what,
                            int *e) {
  if (!what && fsync(fd) != 0) what = "fsync";
  *e = errno;
  if (close(fd) != 0 && !what) {
    what = "close";
    *e = errno;
  }
  if (!what && rename(tmp, path) != 0) {
    what = "rename";
    *e = errno;
  }
  if (what) unlink(tmp);
  return what;
}
