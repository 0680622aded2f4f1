/* The in-memory store: one key/value table for the threads of one process, guarded by one
 * mutex. Blocking calls sleep on one condition variable (CLOCK_MONOTONIC deadlines) that
 * every mutation broadcasts, and that cancellation broadcasts too. */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "store/store_internal.h"

typedef struct mem_store {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ddp__kv_t kv;
} mem_store_t;

static mem_store_t *mem(ddp_store_t *s) { return s->impl; }

/* Waits on the condition variable until the deadline. Returns false once it has passed. */
static bool cv_wait_until(mem_store_t *m, int64_t deadline_ns) {
  if (deadline_ns == INT64_MAX) {
    pthread_cond_wait(&m->cv, &m->mu);
    return true;
  }
  if (ddp_now_ns() >= deadline_ns) return false;
  struct timespec ts = {(time_t)(deadline_ns / 1000000000LL), (long)(deadline_ns % 1000000000LL)};
  int r = pthread_cond_timedwait(&m->cv, &m->mu, &ts);
  return r != ETIMEDOUT || ddp_now_ns() < deadline_ns;
}

static bool all_exist(mem_store_t *m, const char *const *keys, size_t n, size_t *first_missing) {
  for (size_t i = 0; i < n; i++) {
    if (!ddp__kv_find(&m->kv, keys[i], strlen(keys[i]))) {
      if (first_missing) *first_missing = i;
      return false;
    }
  }
  return true;
}

/* The wait loop shared by get and wait, run with the mutex held. On timeout the message
 * names every missing key. */
static ddp_status_t wait_locked(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                                size_t n, const char *what) {
  mem_store_t *m = mem(s);
  for (;;) {
    if (ddp__store_cancelled(c)) return ddp__store_aborted(c, what);
    if (all_exist(m, keys, n, NULL)) return DDP_OK;
    if (!cv_wait_until(m, c->deadline_ns)) break;
  }
  const char *missing[DDP_STORE_MAX_WAIT_KEYS];
  size_t nm = 0;
  for (size_t i = 0; i < n; i++) {
    if (!ddp__kv_find(&m->kv, keys[i], strlen(keys[i]))) missing[nm++] = keys[i];
  }
  char list[600];
  ddp__store_format_keys(list, sizeof list, missing, nm);
  return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                    "%s timed out after %lld ms on %s: missing key%s %s", what,
                    (long long)c->timeout_ms, s->desc, nm == 1 ? "" : "s", list);
}

static ddp_status_t mem_set(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            const void *v, size_t n) {
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status_t st = ddp__kv_put(&m->kv, key, strlen(key), v, n);
  if (st == DDP_OK) pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  if (st != DDP_OK) return ddp__error(c->err, c->rank, st, "set('%.200s'): out of memory", key);
  return DDP_OK;
}

static ddp_status_t mem_get(ddp_store_t *s, const ddp__store_call_t *c, const char *key, void **v,
                            size_t *n) {
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  const char *keys[1] = {key};
  ddp_status_t st = wait_locked(s, c, keys, 1, "get");
  if (st == DDP_OK) {
    ddp__kv_entry_t *e = ddp__kv_find(&m->kv, key, strlen(key));
    *v = ddp__store_dup_value(e->val, e->val_len);
    *n = e->val_len;
    if (!*v) st = ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "get: out of memory");
  }
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status_t mem_add(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            int64_t delta, int64_t *result) {
  mem_store_t *m = mem(s);
  char why[400];
  pthread_mutex_lock(&m->mu);
  ddp_status_t st = ddp__kv_add(&m->kv, key, strlen(key), delta, result, why, sizeof why);
  if (st == DDP_OK) pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  if (st != DDP_OK) return ddp__error(c->err, c->rank, st, "add on %s: %s", s->desc, why);
  return DDP_OK;
}

static ddp_status_t mem_wait(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                             size_t n) {
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  ddp_status_t st = wait_locked(s, c, keys, n, "wait");
  pthread_mutex_unlock(&m->mu);
  return st;
}

static ddp_status_t mem_check(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                              size_t n, bool *all) {
  (void)c;
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  *all = all_exist(m, keys, n, NULL);
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static ddp_status_t mem_cset(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                             const void *exp, size_t exp_n, const void *des, size_t des_n,
                             void **actual, size_t *actual_n) {
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  const ddp__kv_entry_t *after = NULL;
  ddp_status_t st = ddp__kv_cset(&m->kv, key, strlen(key), exp, exp_n, des, des_n, &after);
  if (st == DDP_OK) {
    pthread_cond_broadcast(&m->cv);
    *actual = after ? ddp__store_dup_value(after->val, after->val_len) : ddp_malloc(0);
    *actual_n = after ? after->val_len : 0;
    if (!*actual) st = DDP_ERR_NO_MEMORY;
  }
  pthread_mutex_unlock(&m->mu);
  if (st != DDP_OK) return ddp__error(c->err, c->rank, st, "compare_set: out of memory");
  return DDP_OK;
}

static ddp_status_t mem_del(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            bool *deleted) {
  (void)c;
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  *deleted = ddp__kv_del(&m->kv, key, strlen(key));
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static ddp_status_t mem_num_keys(ddp_store_t *s, const ddp__store_call_t *c, int64_t *n) {
  (void)c;
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  *n = (int64_t)m->kv.count;
  pthread_mutex_unlock(&m->mu);
  return DDP_OK;
}

static void mem_wake(ddp_store_t *s) {
  mem_store_t *m = mem(s);
  pthread_mutex_lock(&m->mu);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
}

static void mem_destroy(ddp_store_t *s) {
  mem_store_t *m = mem(s);
  if (!m) return;
  ddp__kv_fini(&m->kv);
  pthread_cond_destroy(&m->cv);
  pthread_mutex_destroy(&m->mu);
  ddp__free(m);
  s->impl = NULL;
}

const ddp__store_ops_t ddp__store_memory_ops = {
    .kind = "in-memory",
    .set = mem_set,
    .get = mem_get,
    .add = mem_add,
    .wait = mem_wait,
    .check = mem_check,
    .compare_set = mem_cset,
    .del = mem_del,
    .num_keys = mem_num_keys,
    .wake = mem_wake,
    .port = NULL,
    .destroy = mem_destroy,
};

static ddp_status_t create_memory(const ddp_store_options_t *opts, ddp_error_t *err,
                                  ddp_store_t **out) {
  ddp_store_t *s = NULL;
  DDP_CHECK(ddp__store_new(opts, &ddp__store_memory_ops, NULL, err, &s));
  mem_store_t *m = ddp__calloc(1, sizeof *m);
  if (!m || ddp__kv_init(&m->kv) != DDP_OK) {
    ddp__free(m);
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "ddp_store_create_memory: out of memory");
  }
  pthread_mutex_init(&m->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->cv, &ca);
  pthread_condattr_destroy(&ca);
  s->impl = m;
  *out = s;
  return DDP_OK;
}

ddp_status_t ddp_store_create_memory(const ddp_store_options_t *opts, ddp_store_t **out,
                                     ddp_error_t *err) {
  DDP_REQUIRE(out != NULL);
  *out = NULL;
  return create_memory(opts, err, out);
}
