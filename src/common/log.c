/* The one logging function of the library. Lines are formatted whole and handed to the sink
 * in one call, so lines from concurrent ranks never interleave mid-line. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"

/* The sink is process-wide by nature (stderr is); it is only read under the lock. */
static pthread_mutex_t sink_lock = PTHREAD_MUTEX_INITIALIZER;
static ddp_log_sink_fn sink_fn;
static void *sink_user;

static ddp_log_level_t parse_level(const char *v) {
  if (strcasecmp(v, "DETAIL") == 0) return DDP_LOG_DETAIL;
  if (strcasecmp(v, "INFO") == 0) return DDP_LOG_INFO;
  return DDP_LOG_WARN;
}

ddp_log_level_t ddp_log_level_from_env(void) {
  if (ddp_env_is_set(DDP_ENV_DEBUG)) return parse_level(ddp_env_get(DDP_ENV_DEBUG));
  return parse_level(ddp_env_get(DDP_ENV_TORCH_DEBUG));
}

bool ddp__log_enabled(ddp_log_level_t level) {
  return level <= DDP_LOG_WARN || level <= ddp_log_level_from_env();
}

void ddp_set_log_sink(ddp_log_sink_fn fn, void *user) {
  pthread_mutex_lock(&sink_lock);
  sink_fn = fn;
  sink_user = user;
  pthread_mutex_unlock(&sink_lock);
}

static const char *level_name(ddp_log_level_t l) {
  switch (l) {
    case DDP_LOG_ERROR: return "ERROR";
    case DDP_LOG_WARN: return "WARN";
    case DDP_LOG_INFO: return "INFO";
    default: return "DETAIL";
  }
}

void ddp__vlog(int rank, ddp_log_level_t level, const char *fmt, va_list ap) {
  if (!ddp__log_enabled(level)) return;
  char line[1024];
  int n = rank >= 0 ? snprintf(line, sizeof line, "[rank%d] libddp %s: ", rank, level_name(level))
                    : snprintf(line, sizeof line, "libddp %s: ", level_name(level));
  if (n < 0) return;
  vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  pthread_mutex_lock(&sink_lock);
  if (sink_fn) {
    sink_fn(sink_user, level, line);
  } else {
    fprintf(stderr, "%s\n", line);
  }
  pthread_mutex_unlock(&sink_lock);
}

void ddp__log(int rank, ddp_log_level_t level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ddp__vlog(rank, level, fmt, ap);
  va_end(ap);
}
