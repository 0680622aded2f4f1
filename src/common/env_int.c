/* Integer environment variables, checked: above status.c (a bad value is an error naming the
 * variable), while env.c stays below the logger, which reads its level through it. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>

#include "common/common.h"

ddp_status_t ddp_env_int(ddp_env_id_t id, int64_t lo, int64_t hi, int64_t *out, ddp_error_t *err) {
  const char *v = ddp_env_get(id);
  char *end = NULL;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end != '\0' || x < lo || x > hi) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "environment variable %s=\"%s\" is not an integer in [%" PRId64 ", %" PRId64
                      "]",
                      ddp_env_name(id), v, lo, hi);
  }
  *out = x;
  return DDP_OK;
}
