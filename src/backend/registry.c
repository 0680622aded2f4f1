/* The backend registry: static const tables, looked up by name. Hugging Face's "gloo"
 * names the tcp backend (DESIGN.md, Configuration). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "backend/backends.h"
#include "common/common.h"

static const ddp_backend_ops_t *const registry[] = {
    &ddp__backend_threads,
    &ddp__backend_shm,
    &ddp__backend_tcp,
#if DDP_HAVE_MPI
    &ddp__backend_mpi,
#endif
#if DDP_HAVE_NCCL
    &ddp__backend_nccl,
#endif
};

const ddp_backend_ops_t *ddp_backend_find(const char *name) {
  if (!name) return NULL;
  if (strcmp(name, "gloo") == 0) name = "tcp";
  for (size_t i = 0; i < DDP_ARRAY_LEN(registry); i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

const char *ddp_backend_names(void) {
  return "threads, shm, tcp (alias gloo)"
#if DDP_HAVE_MPI
         ", mpi"
#endif
#if DDP_HAVE_NCCL
         ", nccl"
#endif
      ;
}

ddp_status_t ddp__backend_join(ddp_store_t *store, const char *prefix, int rank, int size,
                               int64_t timeout_ms, int *pids, ddp_error_t *err) {
  char key[128];
  int pid = (int)getpid();
  snprintf(key, sizeof key, "%s/joined/%d", prefix, rank);
  if (ddp_store_set(store, key, &pid, sizeof pid) != DDP_OK)
    return ddp__error(err, rank, DDP_ERR_REMOTE, "rank %d: store set %s: %s", rank, key,
                      ddp_store_last_error(store));
  int64_t deadline = ddp_deadline_after_ms(timeout_ms);
  for (int j = 0; j < size; j++) {
    snprintf(key, sizeof key, "%s/joined/%d", prefix, j);
    const char *keys[1] = {key};
    int64_t left = (deadline - ddp_now_ns()) / 1000000;
    ddp_status_t st = ddp_store_wait(store, keys, 1, left > 0 ? left : 0);
    if (st == DDP_ERR_TIMEOUT) {
      char missing[256];
      size_t o = 0;
      missing[0] = '\0';
      for (int k = j; k < size && o < sizeof missing; k++) {
        bool ok = false;
        snprintf(key, sizeof key, "%s/joined/%d", prefix, k);
        const char *kk[1] = {key};
        if (ddp_store_check(store, kk, 1, &ok) == DDP_OK && !ok)
          o += (size_t)snprintf(missing + o, sizeof missing - o, " %d", k);
      }
      return ddp__error(err, rank, DDP_ERR_TIMEOUT,
                        "rank %d: timed out after %lld ms waiting for rank(s)%s to join the %s "
                        "group", rank, (long long)timeout_ms, missing, prefix);
    }
    if (st != DDP_OK)
      return ddp__error(err, rank, st, "rank %d: waiting for rank %d to join: %s", rank, j,
                        ddp_store_last_error(store));
    if (pids) {
      void *v = NULL;
      size_t n = 0;
      st = ddp_store_get(store, key, &v, &n);
      if (st != DDP_OK || n != sizeof(int)) {
        ddp_free(v);
        return ddp__error(err, rank, st ? st : DDP_ERR_INVALID_DATA,
                          "rank %d: reading %s from the store failed", rank, key);
      }
      memcpy(&pids[j], v, sizeof(int));
      ddp_free(v);
    }
  }
  return DDP_OK;
}
