/* output_dir/metrics.jsonl, written by rank 0 (docs/train.md, "Metrics").
 *
 * Each line is formatted whole in memory and handed to the kernel in one write(2) on a
 * descriptor opened with O_APPEND, so a reader (or a crash) never sees a line cut by a
 * stdio buffer boundary. A failed or short write is an error at once, naming the file and
 * errno; the partial bytes, if any, are cut off again (ftruncate to the previous length) so
 * the file still ends with a whole line.
 *
 * Resuming from the checkpoint of step S keeps what the interrupted run wrote up to S and
 * drops the rest (the lines of steps after S, which the resumed run writes again, a torn last
 * line, and earlier runs' summary lines), as Trainer's log history restarts from the
 * checkpoint's state. The kept lines are rewritten atomically (src/common/file.c), so a
 * crash during the rewrite leaves the old file whole. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "train/train_internal.h"

struct ddp__metrics {
  int fd;
  off_t size; /* bytes of whole lines in the file */
  char path[DDP_TRAIN_STR_MAX + 32];
};

static ddp_status_t sys_err(ddp_error_t *err, const char *what, const char *path) {
  int e = errno;
  return ddp__error(err, 0, DDP_ERR_SYSTEM, "trainer: %s %s: %s (errno %d)", what, path,
                    strerror(e), e);
}

/* Whether a line (without its \n) is kept when resuming at step `start`. */
static bool keep_line(const char *b, size_t n, int64_t start) {
  cJSON *o = cJSON_ParseWithLength(b, n);
  const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
  bool keep = cJSON_IsObject(o) && !cJSON_GetObjectItemCaseSensitive(o, "summary") &&
              cJSON_IsNumber(s) && s->valuedouble <= (double)start;
  cJSON_Delete(o);
  return keep;
}

/* Rewrites path with only the lines keep_line accepts. A missing file is left missing. */
static ddp_status_t cut_to_step(const char *path, int64_t start, ddp_error_t *err) {
  struct stat sb;
  if (stat(path, &sb) != 0 ? errno == ENOENT : !S_ISREG(sb.st_mode))
    return DDP_OK; /* missing, or not a plain file (a device, a pipe): nothing to keep */
  char *text;
  size_t len, kept = 0, dropped = 0;
  DDP_CHECK(ddp__file_read(path, 0, 0, "trainer: metrics", &text, &len, err));
  char *out = ddp__malloc(len + 1);
  if (!out) {
    ddp__free(text);
    return ddp__error(err, 0, DDP_ERR_NO_MEMORY, "trainer: no memory to read %s (%zu bytes)", path,
                      len);
  }
  for (size_t p = 0; p < len;) {
    char *nl = memchr(text + p, '\n', len - p);
    if (!nl) { /* a torn last line */
      dropped++;
      break;
    }
    size_t n = (size_t)(nl - (text + p));
    if (keep_line(text + p, n, start)) {
      memcpy(out + kept, text + p, n + 1);
      kept += n + 1;
    } else {
      dropped++;
    }
    p += n + 1;
  }
  ddp_status_t st = DDP_OK;
  if (dropped) {
    ddp__log(0, DDP_LOG_INFO, "resuming at step %lld: %zu line(s) of %s after that step dropped",
             (long long)start, dropped, path);
    st = ddp__file_write_atomic(path, out, kept, 0644, 0, "trainer: metrics", err);
  }
  ddp__free(text);
  ddp__free(out);
  return st;
}

ddp_status_t ddp__metrics_open(const char *output_dir, int64_t start, ddp__metrics_t **out,
                               ddp_error_t *err) {
  *out = NULL;
  ddp__metrics_t *m = ddp__calloc(1, sizeof *m);
  if (!m) return ddp__error(err, 0, DDP_ERR_NO_MEMORY, "trainer: no memory for metrics");
  snprintf(m->path, sizeof m->path, "%s/metrics.jsonl", output_dir);
  ddp_status_t st = start > 0 ? cut_to_step(m->path, start, err) : DDP_OK;
  if (st != DDP_OK) {
    ddp__free(m);
    return st;
  }
  m->fd = open(m->path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (start > 0 ? 0 : O_TRUNC),
               0644);
  if (m->fd < 0) {
    st = sys_err(err, "open", m->path);
    ddp__free(m);
    return st;
  }
  m->size = lseek(m->fd, 0, SEEK_END);
  if (m->size < 0) m->size = 0; /* a device such as /dev/null */
  *out = m;
  return DDP_OK;
}

ddp_status_t ddp__metrics_line(ddp__metrics_t *m, ddp__json_t *j, ddp_error_t *err) {
  if (!m) {
    ddp__json_free(j);
    return DDP_OK;
  }
  ddp__json_append(j, "\n");
  char *buf = ddp__json_take(j);
  if (!buf)
    return ddp__error(err, 0, DDP_ERR_NO_MEMORY, "trainer: no memory for a line of %s", m->path);
  size_t n = strlen(buf);
  ssize_t w;
  do {
    w = write(m->fd, buf, n);
  } while (w < 0 && errno == EINTR);
  ddp_status_t st = DDP_OK;
  if (w != (ssize_t)n) {
    if (w >= 0) errno = ENOSPC; /* a short write: the device is full */
    st = sys_err(err, "write", m->path);
    if (w > 0 && ftruncate(m->fd, m->size) != 0) {
      ddp__log(0, DDP_LOG_WARN, "%s: cannot cut off a partial line: %s", m->path, strerror(errno));
    }
  } else {
    m->size += (off_t)n;
  }
  ddp__free(buf);
  return st;
}

ddp_status_t ddp__metrics_close(ddp__metrics_t *m, ddp_error_t *err) {
  if (!m) return DDP_OK;
  ddp_status_t st = DDP_OK;
  if (close(m->fd) != 0 && err) st = sys_err(err, "close", m->path);
  ddp__free(m);
  return st;
}
