/* The Chrome-trace timeline (options.trace_path; chrome://tracing, Perfetto): each rank
 * records forward, backward, each bucket's allreduce and the finalize as complete ("X")
 * events in memory and appends them to the file at destroy, one process per rank
 * (pid = rank; tid 0 compute, 1 communication). Rank 0 starts the file at create. The
 * timeline is best effort: a full event array loses events, a failed write is a warning. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "reducer/reducer_internal.h"

ddp_status_t ddp__ddp_trace_open(ddp_ddp_t *d, const char *path) {
  d->trace_path = ddp__strdup(path);
  if (!d->trace_path) return ddp__ddp_oom(d);
  if (d->rank != 0) return DDP_OK;
  int fd = open(path, O_WRONLY | O_TRUNC | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, "[\n", 2) != 2) {
    if (fd >= 0) close(fd);
    return ddp__ddp_fail(d, DDP_ERR_SYSTEM, "[rank %d] DDP trace: open %s: %s", d->rank, path,
                         strerror(errno));
  }
  close(fd);
  return DDP_OK;
}

void ddp__ddp_trace(ddp_ddp_t *d, const char *name, int64_t t0, int64_t t1, int tid, int64_t bucket,
                    int64_t bytes) {
  if (!d->trace_path) return;
  if (d->nev == d->cap_ev) {
    size_t nc = d->cap_ev ? 2 * d->cap_ev : 256;
    ddp__trace_ev_t *n = ddp__realloc(d->ev, nc * sizeof *n);
    if (!n) return; /* the timeline is best effort: a full trace loses events */
    d->ev = n;
    d->cap_ev = nc;
  }
  d->ev[d->nev++] = (ddp__trace_ev_t){name, t0, t1 - t0, tid, bucket, bytes};
}

/* Appends this rank's events as JSON array elements in one write (O_APPEND), so ranks in
 * different processes never interleave inside an event. The array's closing bracket is
 * optional in the trace format. */
static void write_trace(ddp_ddp_t *d) {
  size_t cap = 256 + d->nev * 200, len = 0;
  char *buf = ddp__malloc(cap);
  if (!buf) return;
  for (size_t i = 0; i < d->nev; i++) {
    const ddp__trace_ev_t *e = &d->ev[i];
    char name[48];
    if (e->bucket >= 0)
      snprintf(name, sizeof name, "%s %" PRId64, e->name, e->bucket);
    else
      snprintf(name, sizeof name, "%s", e->name);
    len += (size_t)snprintf(buf + len, cap - len,
                            "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"bytes\":%" PRId64 "}},\n",
                            name, d->rank, e->tid, (double)e->ts / 1e3, (double)e->dur / 1e3,
                            e->bytes);
    if (len >= cap) {
      len = cap - 1;
      break;
    }
  }
  int fd = open(d->trace_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    ddp__log(d->rank, DDP_LOG_WARN, "DDP trace: open %s: %s", d->trace_path, strerror(errno));
  } else {
    if (write(fd, buf, len) != (ssize_t)len)
      ddp__log(d->rank, DDP_LOG_WARN, "DDP trace: short write to %s", d->trace_path);
    close(fd);
  }
  ddp__free(buf);
}

void ddp__ddp_trace_close(ddp_ddp_t *d) {
  if (d->trace_path && d->nev) write_trace(d);
  ddp__free(d->trace_path);
  ddp__free(d->ev);
  d->trace_path = NULL;
  d->ev = NULL;
  d->nev = d->cap_ev = 0;
}

/* The flight recorder's tag for bucket b's collective: its index and parameter names. */
void ddp__ddp_tag_bucket(ddp_ddp_t *d, size_t b) {
  if (!ddp_pg_flight_recorder_enabled(d->pg)) return;
  const ddp__bucket_t *x = &d->buckets[b];
  char names[512] = "";
  ddp__ddp_append_names(names, sizeof names, d, x->vars, x->nvars, ",");
  ddp_pg_set_next_collective_tag(d->pg, (int64_t)b, names);
}
