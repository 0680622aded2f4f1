/* Whole-file reads for the data layer's file sources (CSV, MNIST idx, token files, text
 * CSV): one policy for opening, sizing and reading, and one way of naming failures. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/common.h"
#include "data/data_internal.h"

ddp_status_t ddp__data_read_file(const char *what, const char *path, unsigned char **out,
                                 size_t *len, ddp_error_t *err) {
  DDP_REQUIRE(what && path && out && len);
  *out = NULL;
  *len = 0;
  FILE *fp = fopen(path, "rb");
  if (!fp)
    return ddp__error(err, -1, errno == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM,
                      "%s %s: fopen: %s (errno %d)", what, path, strerror(errno), errno);
  ddp_status_t st = DDP_OK;
  unsigned char *buf = NULL;
  struct stat sb;
  if (fstat(fileno(fp), &sb) != 0) {
    st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s %s: fstat: %s (errno %d)", what, path,
                    strerror(errno), errno);
    goto out;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT, "%s %s: not a regular file", what,
                    path);
    goto out;
  }
  size_t size = (size_t)sb.st_size;
  buf = ddp__malloc(size + 1);
  if (!buf) {
    st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "%s %s: %zu bytes for the file", what, path,
                    size + 1);
    goto out;
  }
  size_t got = fread(buf, 1, size, fp);
  if (got != size) {
    st = ddp__error(err, -1, DDP_ERR_SYSTEM, "%s %s: read %zu of %zu bytes%s%s", what, path, got,
                    size, ferror(fp) ? ": " : " (the file shrank while it was read)",
                    ferror(fp) ? strerror(errno) : "");
    goto out;
  }
  buf[size] = '\0';
  *out = buf;
  *len = size;
  buf = NULL;
out:
  ddp__free(buf);
  fclose(fp);
  return st;
}
