/* ddp_pg_split (include/ddp/pg.h): sub-groups of a group, made with ddp_pg_create over a
 * prefix view of the store the parent was created on, as the torch backend's new_group
 * gets them from c10d's PrefixStore. The ranks first exchange their colors over the
 * parent (one all-gather), so each knows its rank and the size of its new group without
 * the store. */
#include <stdio.h>

#include "common/common.h"
#include "ddp/pg.h"
#include "pg/pg_internal.h"

ddp_status_t ddp_pg_split(ddp_pg_t *pg, int color, ddp_pg_t **out, ddp_error_t *err) {
  DDP_REQUIRE(pg && pg->magic == PG_MAGIC && out);
  *out = NULL;
  int rank = pg->rank, W = pg->size;
  if (color < 0)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "ddp_pg_split: color %d is negative",
                      color);
  if (!pg->store)
    return ddp__error(err, rank, DDP_ERR_UNSUPPORTED,
                      "ddp_pg_split: the %s group has no store to meet through (sub-groups "
                      "need one: use the tcp or shm backend)",
                      pg->ops->name);
  int32_t *colors = ddp__calloc((size_t)W, sizeof *colors);
  if (!colors) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "ddp_pg_split: colors");
  int32_t mine = color;
  ddp_status_t st = ddp_allgather(pg, &mine, colors, 1, DDP_I32, NULL);
  if (st != DDP_OK) {
    ddp_error_t pe;
    ddp_pg_last_error_copy(pg, &pe);
    ddp__free(colors);
    return ddp__error_quiet(err, st, "ddp_pg_split: exchanging colors: %s", pe.msg);
  }
  int sub_rank = 0, sub_size = 0;
  for (int r = 0; r < W; r++)
    if (colors[r] == color) {
      if (r < rank) sub_rank++;
      sub_size++;
    }
  ddp__free(colors);
  char prefix[96];
  snprintf(prefix, sizeof prefix, "ddp_pg/%lld/split/%llu/%d", (long long)pg->store_k,
           (unsigned long long)pg->nsplits++, color);
  ddp_store_t *view = NULL;
  ddp_error_t se = {DDP_OK, ""};
  st = ddp_store_create_prefix(pg->store, prefix, &view, &se);
  if (st != DDP_OK) return ddp__error_quiet(err, st, "ddp_pg_split: store: %s", se.msg);
  ddp_pg_options_t o = pg->opts;
  o.backend = pg->ops->name;
  o.rank = sub_rank;
  o.world = sub_size;
  o.store = view;
  o.no_flight_recorder = true;
  st = ddp_pg_create(&o, out, err);
  ddp_store_destroy(view);
  return st;
}
