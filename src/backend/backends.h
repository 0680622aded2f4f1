/* The built-in backend tables (src/backend/<name>/<name>.c), for the registry. */
#ifndef DDP_SRC_BACKENDS_H
#define DDP_SRC_BACKENDS_H

#include "common/common.h"
#include "ddp/backend.h"

extern const ddp_backend_ops_t ddp__backend_threads;
extern const ddp_backend_ops_t ddp__backend_shm;
extern const ddp_backend_ops_t ddp__backend_tcp;
/* Optional backends, compiled where the library was found (ddp_config.h). */
extern const ddp_backend_ops_t ddp__backend_mpi;  /* DDP_HAVE_MPI */
extern const ddp_backend_ops_t ddp__backend_nccl; /* DDP_HAVE_NCCL */

/* A store call of a backend's create failed with st: the store has logged it where it
 * happened, so this only fills err (quietly) with the context fmt, ": ", and the store's
 * message, and returns st. */
ddp_status_t ddp__backend_store_failed(ddp_store_t *store, ddp_status_t st, ddp_error_t *err,
                                       const char *fmt, ...) DDP_PRINTF(4, 5);

/* A rank waiting at create for peers that have not come logs "rank R: waiting for rank(s)
 * ... (S s of the T s timeout)" at WARN every DDP__WAIT_REPORT_MS, so that a job waiting
 * for a rank that was never started says so long before its timeout. */
#define DDP__WAIT_REPORT_MS 5000

/* Rendezvous step every backend ends its create with: publishes "<prefix>/joined/<rank>"
 * (value = the process id) and waits until all `size` ranks have, up to timeout_ms. On a
 * timeout the message names the ranks that never joined; while it waits it reports every
 * DDP__WAIT_REPORT_MS. pids (optional, size entries)
 * receives every rank's process id. */
ddp_status_t ddp__backend_join(ddp_store_t *store, const char *prefix, int rank, int size,
                               int64_t timeout_ms, int *pids, ddp_error_t *err);

#endif /* DDP_SRC_BACKENDS_H */
