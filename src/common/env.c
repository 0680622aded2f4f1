/* The one place libddp reads its environment. The list of variables is DDP_ENV_MAP in
 * ddp/common.h; docs/environment.md mirrors it and tests/test_common.c checks that the two
 * agree. Values are read at each call (no cache), so a test may change them. The logger reads
 * its level here, so this file reports nothing; typed reads that report a bad value are in
 * env_int.c, above the status layer. */
#include <stdlib.h>

#include "common/common.h"

typedef struct env_param {
  const char *name;
  const char *def;
  const char *doc;
} env_param_t;

static const env_param_t params[DDP_ENV_COUNT_] = {
#define DDP_ENV_ROW_(id, name, def, doc) [DDP_ENV_##id] = {name, def, doc},
    DDP_ENV_MAP(DDP_ENV_ROW_)
#undef DDP_ENV_ROW_
};

static const env_param_t *param(ddp_env_id_t id) {
  DDP_REQUIRE((int)id >= 0 && id < DDP_ENV_COUNT_);
  return &params[id];
}

const char *ddp_env_name(ddp_env_id_t id) { return param(id)->name; }
const char *ddp_env_default(ddp_env_id_t id) { return param(id)->def; }
const char *ddp_env_doc(ddp_env_id_t id) { return param(id)->doc; }

bool ddp_env_is_set(ddp_env_id_t id) {
  const char *v = getenv(param(id)->name);
  return v && *v;
}

const char *ddp_env_get(ddp_env_id_t id) {
  const char *v = getenv(param(id)->name);
  return (v && *v) ? v : param(id)->def;
}
