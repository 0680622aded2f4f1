/* ddprun's per-rank log files, torchrun's --log_dir, --redirects and --tee.
 *
 * A stream (a rank's stdout or stderr) that is redirected or teed is written, byte for byte
 * as the rank wrote it, to <log_dir>/<run_id>_<ddprun's pid>/attempt_<n>/<local_rank>/
 * stdout.log or stderr.log (torchrun's layout, with ddprun's pid where torchrun draws a
 * random suffix); a redirected stream goes only there, a teed one also to ddprun's own
 * stream with the [rankN] prefix. With neither flag nothing is written, as with torchrun,
 * and without --log_dir the files go under a new directory in $TMPDIR (torchrun's
 * behaviour too); ddprun says where, once. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ddprun.h"

bool parse_std_spec(const char *v, int nproc, uint8_t *out) {
  if (out)
    for (int i = 0; i < nproc; i++) out[i] = 0;
  if (v[0] >= '0' && v[0] <= '3' && v[1] == '\0') {
    if (out)
      for (int i = 0; i < nproc; i++) out[i] = (uint8_t)(v[0] - '0');
    return true;
  }
  /* LOCAL:V[,LOCAL:V...] */
  const char *p = v;
  for (;;) {
    char *end = NULL;
    errno = 0;
    long r = strtol(p, &end, 10);
    if (end == p || errno != 0 || r < 0 || r >= nproc || *end != ':') return false;
    if (end[1] < '0' || end[1] > '3') return false;
    if (out) out[r] = (uint8_t)(end[1] - '0');
    p = end + 2;
    if (*p == '\0') return true;
    if (*p != ',') return false;
    p++;
  }
}

/* mkdir -p: every missing directory of path, mode 0755. */
static int make_dirs(const char *path) {
  char buf[PATH_MAX];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf) return ENAMETOOLONG;
  memcpy(buf, path, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] != '/' && buf[i] != '\0') continue;
    char c = buf[i];
    buf[i] = '\0';
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return errno;
    buf[i] = c;
  }
  return 0;
}

static bool wants_logs(const launcher_t *L) {
  for (int i = 0; i < L->opt.nproc_per_node; i++)
    if (L->ranks[i].redirects | L->ranks[i].tee) return true;
  return false;
}

int prepare_logs(launcher_t *L) {
  const options_t *o = &L->opt;
  uint8_t red[MAX_LOCAL_RANKS], tee[MAX_LOCAL_RANKS]; /* parse_args checked both specs */
  parse_std_spec(o->redirects ? o->redirects : "0", o->nproc_per_node, red);
  parse_std_spec(o->tee ? o->tee : "0", o->nproc_per_node, tee);
  for (int i = 0; i < o->nproc_per_node; i++) {
    L->ranks[i].redirects = red[i];
    L->ranks[i].tee = tee[i];
  }
  if (!wants_logs(L)) {
    if (o->log_dir)
      say("--log_dir %s without --redirects or --tee: no log files are written (torchrun's rule)",
          o->log_dir);
    return 0;
  }
  char base[PATH_MAX];
  if (o->log_dir) {
    int e = make_dirs(o->log_dir);
    if (e != 0) {
      say("--log_dir %s: cannot create it: %s (errno %d)", o->log_dir, strerror(e), e);
      return EXIT_USAGE;
    }
    snprintf(base, sizeof base, "%s", o->log_dir);
  } else {
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    snprintf(base, sizeof base, "%s/ddprun_XXXXXX", tmp);
    if (!mkdtemp(base)) {
      say("cannot create a directory for the rank logs under %s: %s (errno %d)", tmp,
          strerror(errno), errno);
      return EXIT_LAUNCH;
    }
  }
  int n = snprintf(L->log_run_dir, sizeof L->log_run_dir, "%s/%s_%d", base, o->run_id,
                   (int)getpid());
  if (n < 0 || (size_t)n >= sizeof L->log_run_dir) {
    say("the rank logs' directory under %s is too long a path", base);
    return EXIT_USAGE;
  }
  say("rank logs in %s (attempt_<n>/<local_rank>/stdout.log and stderr.log)", L->log_run_dir);
  return 0;
}

/* Opens one stream's file when the rank's redirects or tee name it (bit: 1 stdout, 2 stderr). */
static bool open_stream_log(const rank_proc_t *r, line_stream_t *s, const char *dir, int bit,
                            const char *name) {
  s->log_fd = -1;
  s->quiet = (r->redirects & bit) && !(r->tee & bit);
  if (!((r->redirects | r->tee) & bit)) return true;
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  s->log_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (s->log_fd < 0) {
    say("cannot start rank %d: cannot create %s: %s (errno %d)", r->rank, path, strerror(errno),
        errno);
    return false;
  }
  return true;
}

bool open_rank_logs(const launcher_t *L, rank_proc_t *r, int local_rank) {
  r->out.log_fd = r->err.log_fd = -1;
  r->out.quiet = r->err.quiet = false;
  if (!((r->redirects | r->tee) & 3)) return true;
  char dir[PATH_MAX];
  int n = snprintf(dir, sizeof dir, "%s/attempt_%d/%d", L->log_run_dir, L->restart_count,
                   local_rank);
  if (n < 0 || (size_t)n >= sizeof dir) {
    say("cannot start rank %d: its log directory is too long a path", r->rank);
    return false;
  }
  int e = make_dirs(dir);
  if (e != 0) {
    say("cannot start rank %d: cannot create %s: %s (errno %d)", r->rank, dir, strerror(e), e);
    return false;
  }
  if (!open_stream_log(r, &r->out, dir, 1, "stdout.log")) return false;
  if (!open_stream_log(r, &r->err, dir, 2, "stderr.log")) {
    close_stream_log(&r->out);
    return false;
  }
  return true;
}

void close_stream_log(line_stream_t *s) {
  if (s->log_fd >= 0) close(s->log_fd);
  s->log_fd = -1;
}
