/* The backend registry: static const tables, looked up by name, and the one list of the
 * backends libddp knows (DDP_BACKEND_LIST in ddp/backend.h): names, aliases ("gloo" names
 * the tcp backend, DESIGN.md, Configuration) and where each one's ranks run. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/backends.h"
#include "common/common.h"

static const ddp_backend_ops_t *const registry[] = {
    &ddp__backend_threads, &ddp__backend_shm, &ddp__backend_tcp,
#if DDP_HAVE_MPI
    &ddp__backend_mpi,
#endif
#if DDP_HAVE_NCCL
    &ddp__backend_nccl,
#endif
};

static const ddp_backend_info_t known[] = {
#define DDP_BACKEND_INFO_(name, alias, ranks, optional) {name, alias, ranks, optional},
    DDP_BACKEND_LIST(DDP_BACKEND_INFO_)
#undef DDP_BACKEND_INFO_
};

const ddp_backend_info_t *ddp_backend_info(const char *name) {
  if (!name) return NULL;
  for (size_t i = 0; i < DDP_ARRAY_LEN(known); i++)
    if (strcmp(known[i].name, name) == 0 ||
        (known[i].alias[0] && strcmp(known[i].alias, name) == 0))
      return &known[i];
  return NULL;
}

const ddp_backend_ops_t *ddp_backend_find(const char *name) {
  const ddp_backend_info_t *b = ddp_backend_info(name);
  if (!b) return NULL;
  for (size_t i = 0; i < DDP_ARRAY_LEN(registry); i++)
    if (strcmp(registry[i]->name, b->name) == 0) return registry[i];
  return NULL;
}

static char names[160];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void names_init(void) {
  size_t o = 0;
  for (size_t i = 0; i < DDP_ARRAY_LEN(known) && o < sizeof names; i++) {
    if (!ddp_backend_find(known[i].name)) continue;
    o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", o ? ", " : "", known[i].name);
    if (known[i].alias[0] && o < sizeof names)
      o += (size_t)snprintf(names + o, sizeof names - o, " (alias %s)", known[i].alias);
  }
}

const char *ddp_backend_names(void) {
  pthread_once(&names_once, names_init);
  return names;
}

ddp_status_t ddp__backend_store_failed(ddp_store_t *store, ddp_status_t st, ddp_error_t *err,
                                       const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  ddp_error_t se;
  ddp_store_last_error_copy(store, &se);
  return ddp__error_quiet(err, st, "%s: %s", what, se.msg);
}

/* " 1 3": the ranks from `from` on whose joined key is not in the store yet. */
static void missing_ranks(ddp_store_t *store, const char *prefix, int from, int size, char *buf,
                          size_t cap) {
  size_t o = 0;
  buf[0] = '\0';
  for (int k = from; k < size && o < cap; k++) {
    char key[128];
    bool ok = false;
    snprintf(key, sizeof key, "%s/joined/%d", prefix, k);
    const char *kk[1] = {key};
    if (ddp_store_check(store, kk, 1, &ok) == DDP_OK && !ok)
      o += (size_t)snprintf(buf + o, cap - o, " %d", k);
  }
}

/* On a timeout the message names the ranks that never joined. */
ddp_status_t ddp__backend_join(ddp_store_t *store, const char *prefix, int rank, int size,
                               int64_t timeout_ms, int *pids, ddp_error_t *err) {
  char key[128];
  int pid = (int)getpid();
  snprintf(key, sizeof key, "%s/joined/%d", prefix, rank);
  ddp_status_t st = ddp_store_set(store, key, &pid, sizeof pid);
  if (st != DDP_OK)
    return ddp__backend_store_failed(store, DDP_ERR_REMOTE, err, "rank %d: store set %s", rank,
                                     key);
  int64_t start = ddp_now_ns(), deadline = ddp_deadline_after_ms(timeout_ms);
  int64_t next_report = start + (int64_t)DDP__WAIT_REPORT_MS * 1000000;
  int64_t nap_us = 100;
  for (int j = 0; j < size; j++) {
    snprintf(key, sizeof key, "%s/joined/%d", prefix, j);
    const char *keys[1] = {key};
    /* Polled (the store's own wait would log each slice's timeout), so that a rank waiting
     * for peers that never come says so every DDP__WAIT_REPORT_MS, naming them. */
    bool here = false;
    st = DDP_OK;
    for (;;) {
      st = ddp_store_check(store, keys, 1, &here);
      if (st != DDP_OK || here) break;
      int64_t now = ddp_now_ns();
      if (now >= deadline) {
        st = DDP_ERR_TIMEOUT;
        break;
      }
      if (now >= next_report) {
        char missing[256];
        missing_ranks(store, prefix, j, size, missing, sizeof missing);
        ddp__log(rank, DDP_LOG_WARN,
                 "rank %d: waiting for rank(s)%s to join the %s group (%lld s of the %lld s "
                 "timeout)",
                 rank, missing, prefix, (long long)((now - start) / 1000000000),
                 (long long)(timeout_ms / 1000));
        next_report = now + (int64_t)DDP__WAIT_REPORT_MS * 1000000;
      }
      struct timespec ts = {0, (long)nap_us * 1000};
      nanosleep(&ts, NULL);
      nap_us = DDP_MIN(nap_us * 2, 20000);
    }
    if (st == DDP_ERR_TIMEOUT) {
      char missing[256];
      missing_ranks(store, prefix, j, size, missing, sizeof missing);
      return ddp__error(err, rank, DDP_ERR_TIMEOUT,
                        "rank %d: timed out after %lld ms waiting for rank(s)%s to join the %s "
                        "group",
                        rank, (long long)timeout_ms, missing, prefix);
    }
    if (st != DDP_OK)
      return ddp__backend_store_failed(store, st, err, "rank %d: waiting for rank %d to join", rank,
                                       j);
    if (pids) {
      void *v = NULL;
      size_t n = 0;
      st = ddp_store_get(store, key, &v, &n);
      if (st == DDP_OK && n == sizeof(int)) memcpy(&pids[j], v, sizeof(int));
      ddp_free(v);
      if (st != DDP_OK)
        return ddp__backend_store_failed(store, st, err, "rank %d: reading %s from the store", rank,
                                         key);
      if (n != sizeof(int))
        return ddp__error(err, rank, DDP_ERR_INVALID_DATA,
                          "rank %d: reading %s from the store failed", rank, key);
    }
  }
  return DDP_OK;
}
