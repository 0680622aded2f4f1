/* Private interface between the files of the process-group layer: pg.c (groups, the queue,
 * work handles) and launch.c (groups from a launcher's environment, groups of threads).
 * Not installed. */
#ifndef DDP_SRC_PG_INTERNAL_H
#define DDP_SRC_PG_INTERNAL_H

#include "ddp/pg.h"

/* The group owns store from now on and destroys it with itself (ddp_pg_create_from_env). */
void ddp__pg_own_store(ddp_pg_t *pg, ddp_store_t *store);

#endif /* DDP_SRC_PG_INTERNAL_H */
