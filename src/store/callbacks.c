/* The callback store: a ddp_store_t whose operations are a caller's non-blocking functions
 * (ddp_store_create_callbacks). The blocking calls (get, wait) poll the caller's check and
 * get here, with a backoff of 1 to 16 ms that ddp__store_sleep cuts short on cancellation, so
 * a foreign store gets libddp's deadlines, cancellation and timeout messages unchanged. */
#include <string.h>

#include "store/store_internal.h"

typedef struct cb_store {
  ddp_store_callbacks_t cb;
} cb_store_t;

static cb_store_t *cbs(ddp_store_t *s) { return s->impl; }

/* The callbacks report into their own error; it is re-raised with the store's rank and the
 * operation, so the message says which store and call failed. */
static ddp_status_t failed(ddp_store_t *s, const ddp__store_call_t *c, ddp_status_t st,
                           const ddp_error_t *e, const char *what) {
  return ddp__error(c->err, c->rank, st, "%s on %s: %s", what, s->desc,
                    e->msg[0] ? e->msg : ddp_status_str(st));
}

static ddp_status_t cb_set(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                           const void *v, size_t n) {
  ddp_error_t e = {0};
  ddp_status_t st = cbs(s)->cb.set(cbs(s)->cb.ctx, key, v, n, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "set");
}

/* Polls until every key exists; on timeout names the missing ones. */
static ddp_status_t poll_keys(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                              size_t nkeys, const char *what) {
  cb_store_t *f = cbs(s);
  int backoff = 1;
  for (;;) {
    ddp_error_t e = {0};
    bool all = false;
    ddp_status_t st = f->cb.check(f->cb.ctx, keys, nkeys, &all, &e);
    if (st != DDP_OK) return failed(s, c, st, &e, what);
    if (all) return DDP_OK;
    if (ddp_ms_until(c->deadline_ns) == 0) break;
    if (!ddp__store_sleep(c, backoff)) return ddp__store_aborted(c, what);
    backoff = backoff < 16 ? backoff * 2 : 16;
  }
  const char *missing[DDP_STORE_MAX_WAIT_KEYS];
  size_t nm = 0;
  for (size_t i = 0; i < nkeys; i++) {
    ddp_error_t e = {0};
    bool one = false;
    if (f->cb.check(f->cb.ctx, &keys[i], 1, &one, &e) == DDP_OK && !one) missing[nm++] = keys[i];
  }
  char list[600];
  ddp__store_format_keys(list, sizeof list, missing, nm);
  return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                    "%s timed out after %lld ms on %s: missing key%s %s", what,
                    (long long)c->timeout_ms, s->desc, nm == 1 ? "" : "s", list);
}

static ddp_status_t cb_get(ddp_store_t *s, const ddp__store_call_t *c, const char *key, void **v,
                           size_t *n) {
  cb_store_t *f = cbs(s);
  for (;;) {
    const char *keys[1] = {key};
    DDP_CHECK(poll_keys(s, c, keys, 1, "get"));
    ddp_error_t e = {0};
    bool found = false;
    ddp_status_t st = f->cb.get(f->cb.ctx, key, &found, v, n, &e);
    if (st != DDP_OK) return failed(s, c, st, &e, "get");
    if (found) return DDP_OK;
    /* deleted between the check and the read: wait again */
  }
}

static ddp_status_t cb_add(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                           int64_t delta, int64_t *result) {
  ddp_error_t e = {0};
  ddp_status_t st = cbs(s)->cb.add(cbs(s)->cb.ctx, key, delta, result, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "add");
}

static ddp_status_t cb_wait(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                            size_t n) {
  return poll_keys(s, c, keys, n, "wait");
}

static ddp_status_t cb_check(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                             size_t nkeys, bool *all) {
  ddp_error_t e = {0};
  ddp_status_t st = cbs(s)->cb.check(cbs(s)->cb.ctx, keys, nkeys, all, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "check");
}

static ddp_status_t unsupported(ddp_store_t *s, const ddp__store_call_t *c, const char *what) {
  return ddp__error(c->err, c->rank, DDP_ERR_UNSUPPORTED, "%s: %s does not offer it", what,
                    s->desc);
}

static ddp_status_t cb_cset(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            const void *exp, size_t exp_n, const void *des, size_t des_n,
                            void **actual, size_t *actual_n) {
  cb_store_t *f = cbs(s);
  if (!f->cb.compare_set) return unsupported(s, c, "compare_set");
  ddp_error_t e = {0};
  ddp_status_t st = f->cb.compare_set(f->cb.ctx, key, exp, exp_n, des, des_n, actual, actual_n, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "compare_set");
}

static ddp_status_t cb_del(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                           bool *deleted) {
  cb_store_t *f = cbs(s);
  if (!f->cb.del) return unsupported(s, c, "delete");
  ddp_error_t e = {0};
  ddp_status_t st = f->cb.del(f->cb.ctx, key, deleted, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "delete");
}

static ddp_status_t cb_num_keys(ddp_store_t *s, const ddp__store_call_t *c, int64_t *n) {
  cb_store_t *f = cbs(s);
  if (!f->cb.num_keys) return unsupported(s, c, "num_keys");
  ddp_error_t e = {0};
  ddp_status_t st = f->cb.num_keys(f->cb.ctx, n, &e);
  return st == DDP_OK ? DDP_OK : failed(s, c, st, &e, "num_keys");
}

static void cb_destroy(ddp_store_t *s) {
  cb_store_t *f = cbs(s);
  if (!f) return;
  if (f->cb.destroy) f->cb.destroy(f->cb.ctx);
  ddp__free(f);
  s->impl = NULL;
}

const ddp__store_ops_t ddp__store_callbacks_ops = {
    .kind = "callbacks",
    .set = cb_set,
    .get = cb_get,
    .add = cb_add,
    .wait = cb_wait,
    .check = cb_check,
    .compare_set = cb_cset,
    .del = cb_del,
    .num_keys = cb_num_keys,
    .wake = NULL,
    .port = NULL,
    .destroy = cb_destroy,
};

ddp_status_t ddp_store_create_callbacks(const ddp_store_callbacks_t *cb,
                                        const ddp_store_options_t *opts, ddp_store_t **out,
                                        ddp_error_t *err) {
  DDP_REQUIRE(cb != NULL && out != NULL);
  *out = NULL;
  ddp_store_callbacks_t c = {0};
  ddp__opts_read(&c, sizeof c, cb);
  if (!c.set || !c.get || !c.add || !c.check) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_callbacks: set, get, add and check are required");
  }
  ddp_store_t *s = NULL;
  DDP_CHECK(ddp__store_new(opts, &ddp__store_callbacks_ops, NULL, err, &s));
  cb_store_t *f = ddp__calloc(1, sizeof *f);
  if (!f) {
    ddp__store_free(s);
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "ddp_store_create_callbacks: out of memory");
  }
  f->cb = c;
  f->cb.desc = NULL; /* copied into s->desc below; the caller's string may go */
  s->impl = f;
  snprintf(s->desc, sizeof s->desc, "%.150s", c.desc ? c.desc : "callback store");
  *out = s;
  return DDP_OK;
}
