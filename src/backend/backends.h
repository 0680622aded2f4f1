/* The built-in backend tables (src/backend/<name>/<name>.c), for the registry. */
#ifndef DDP_SRC_BACKENDS_H
#define DDP_SRC_BACKENDS_H

#include "ddp/backend.h"

extern const ddp_backend_ops_t ddp__backend_threads;
extern const ddp_backend_ops_t ddp__backend_shm;
extern const ddp_backend_ops_t ddp__backend_tcp;
/* Optional backends, compiled where the library was found (ddp_config.h). */
extern const ddp_backend_ops_t ddp__backend_mpi;  /* DDP_HAVE_MPI */
extern const ddp_backend_ops_t ddp__backend_nccl; /* DDP_HAVE_NCCL */

/* shm: why the last ddp_pg_alloc on this group's heap failed (/dev/shm full: the bytes
 * needed and free; or no free range), for ddp_pg_last_error. */
void ddp__shm_alloc_error(void *state, ddp_error_t *out);

/* Rendezvous step every backend ends its create with: publishes "<prefix>/joined/<rank>"
 * (value = the process id) and waits until all `size` ranks have, up to timeout_ms. On a
 * timeout the message names the ranks that never joined. pids (optional, size entries)
 * receives every rank's process id. */
ddp_status_t ddp__backend_join(ddp_store_t *store, const char *prefix, int rank, int size,
                               int64_t timeout_ms, int *pids, ddp_error_t *err);

#endif /* DDP_SRC_BACKENDS_H */
