/* The public store API: argument checks, prefix views, deadlines, cancellation and the
 * last error of each handle, in front of the three kinds (memory.c, file.c, tcp_client.c).
 *
 * A view is a handle with no state of its own besides its prefix and its cancel flag: every
 * call runs on the root's table with the full key. Cancellation is per handle, and a call
 * checks the chain from the handle it was made on down to the root, so cancelling a view
 * stops the calls made through it (and through views above it) without touching its base. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "store/store_internal.h"

static void require_valid(const ddp_store_t *s) {
  DDP_REQUIRE(s != NULL);
  DDP_REQUIRE(s->magic == DDP__STORE_MAGIC);
}

ddp_status_t ddp__store_new(const ddp_store_options_t *opts, const ddp__store_ops_t *ops,
                            ddp_store_options_t *read, ddp_error_t *err, ddp_store_t **out) {
  ddp_store_options_t o = DDP_STORE_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  if (read) *read = o;
  int64_t timeout_ms = o.timeout_ms;
  if (timeout_ms < 0) {
    int64_t sec = 0;
    DDP_CHECK(ddp_env_int(DDP_ENV_TIMEOUT, 0, INT64_MAX / 1000, &sec, err));
    timeout_ms = sec * 1000;
  }
  ddp_store_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, o.rank, DDP_ERR_NO_MEMORY, "store: out of memory");
  s->prefix = ddp__strdup("");
  s->cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (!s->prefix || s->cancel_fd < 0) {
    int e = errno;
    bool no_fd = s->cancel_fd < 0;
    if (!no_fd) close(s->cancel_fd);
    ddp__free(s->prefix);
    ddp__free(s);
    return no_fd ? ddp__error(err, o.rank, DDP_ERR_SYSTEM, "store: eventfd: %s (errno %d)",
                              strerror(e), e)
                 : ddp__error(err, o.rank, DDP_ERR_NO_MEMORY, "store: out of memory");
  }
  s->magic = DDP__STORE_MAGIC;
  s->ops = ops;
  s->root = s;
  s->rank = o.rank;
  s->timeout_ms = timeout_ms;
  atomic_init(&s->cancelled, false);
  pthread_mutex_init(&s->err_lock, NULL);
  snprintf(s->desc, sizeof s->desc, "%s store", ops->kind);
  *out = s;
  return DDP_OK;
}

void ddp__store_free(ddp_store_t *s) {
  if (!s) return;
  s->magic = 0;
  if (s->cancel_fd >= 0) close(s->cancel_fd);
  pthread_mutex_destroy(&s->err_lock);
  ddp__free(s->prefix);
  ddp__free(s);
}

static ddp_status_t create_prefix(ddp_store_t *base, const char *prefix, ddp_error_t *err,
                                  ddp_store_t **out) {
  if (base->depth + 1 > DDP_STORE_MAX_DEPTH) {
    return ddp__error(err, base->rank, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_prefix(\"%s\"): more than %d nested prefix views", prefix,
                      DDP_STORE_MAX_DEPTH);
  }
  size_t plen = strlen(prefix);
  size_t full = base->prefix_len + plen + 1;
  if (full > DDP_STORE_MAX_KEY) {
    return ddp__error(err, base->rank, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_prefix: prefix of %zu bytes exceeds the key limit %d", full,
                      DDP_STORE_MAX_KEY);
  }
  ddp_store_t *v = ddp__calloc(1, sizeof *v);
  char *p = ddp__malloc(full + 1);
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (!v || !p || fd < 0) {
    int e = errno;
    ddp__free(v);
    ddp__free(p);
    if (fd >= 0) close(fd);
    return fd < 0 ? ddp__error(err, base->rank, DDP_ERR_SYSTEM, "store: eventfd: %s (errno %d)",
                               strerror(e), e)
                  : ddp__error(err, base->rank, DDP_ERR_NO_MEMORY, "store: out of memory");
  }
  memcpy(p, base->prefix, base->prefix_len);
  memcpy(p + base->prefix_len, prefix, plen);
  p[full - 1] = '/';
  p[full] = '\0';
  v->magic = DDP__STORE_MAGIC;
  v->ops = base->ops;
  v->parent = base;
  v->root = base->root;
  v->prefix = p;
  v->prefix_len = full;
  v->depth = base->depth + 1;
  v->rank = base->rank;
  v->timeout_ms = base->timeout_ms;
  v->cancel_fd = fd;
  atomic_init(&v->cancelled, false);
  pthread_mutex_init(&v->err_lock, NULL);
  snprintf(v->desc, sizeof v->desc, "%s", base->root->desc);
  *out = v;
  return DDP_OK;
}

ddp_status_t ddp_store_create_prefix(ddp_store_t *base, const char *prefix, ddp_store_t **out,
                                     ddp_error_t *err) {
  require_valid(base);
  DDP_REQUIRE(prefix != NULL && out != NULL);
  *out = NULL;
  return create_prefix(base, prefix, err, out);
}

void ddp_store_destroy(ddp_store_t *s) {
  if (!s) return;
  require_valid(s);
  if (s->parent == NULL && s->ops->destroy) s->ops->destroy(s);
  ddp__store_free(s);
}

/* ---------------------------------------------------------------- errors ---------- */

/* Each handle keeps the last error of up to DDP__STORE_ERR_SLOTS threads (the least
 * recently failed slot is reused), guarded by err_lock; readers copy a slot out under that
 * lock. A failed create has no handle: its message goes to the create's ddp_error_t *. */
static void record_error(ddp_store_t *s, const ddp_error_t *e) {
  pthread_t self = pthread_self();
  pthread_mutex_lock(&s->err_lock);
  ddp__store_err_slot_t *slot = NULL;
  for (int i = 0; i < DDP__STORE_ERR_SLOTS; i++) {
    if (s->errs[i].stamp && pthread_equal(s->errs[i].tid, self)) slot = &s->errs[i];
  }
  if (!slot) {
    slot = &s->errs[0];
    for (int i = 1; i < DDP__STORE_ERR_SLOTS; i++) {
      if (s->errs[i].stamp < slot->stamp) slot = &s->errs[i];
    }
  }
  slot->tid = self;
  slot->stamp = ++s->err_clock;
  slot->e = *e;
  pthread_mutex_unlock(&s->err_lock);
}

void ddp_store_last_error_copy(const ddp_store_t *cs, ddp_error_t *out) {
  require_valid(cs);
  DDP_REQUIRE(out != NULL);
  ddp_store_t *s = (ddp_store_t *)cs; /* the lock is not part of the logical state */
  pthread_t self = pthread_self();
  const ddp__store_err_slot_t *pick = NULL;
  pthread_mutex_lock(&s->err_lock);
  for (int i = 0; i < DDP__STORE_ERR_SLOTS; i++) {
    const ddp__store_err_slot_t *e = &s->errs[i];
    if (!e->stamp) continue;
    if (pthread_equal(e->tid, self)) {
      pick = e;
      break;
    }
    if (!pick || e->stamp > pick->stamp) pick = e;
  }
  if (pick) {
    *out = pick->e;
  } else {
    ddp__error_clear(out);
  }
  pthread_mutex_unlock(&s->err_lock);
}

/* ---------------------------------------------------------------- cancellation ---- */

bool ddp__store_cancelled(const ddp__store_call_t *c) {
  for (const ddp_store_t *h = c->caller; h; h = h->parent) {
    if (atomic_load(&h->cancelled)) return true;
  }
  return false;
}

ddp_status_t ddp__store_aborted(const ddp__store_call_t *c, const char *what) {
  return ddp__error(c->err, c->rank, DDP_ERR_ABORTED,
                    "%s on %s aborted: ddp_store_cancel() was called on this store", what,
                    c->caller->root->desc);
}

int ddp__store_cancel_pollfds(const ddp__store_call_t *c, struct pollfd *pfd, int max) {
  int n = 0;
  for (const ddp_store_t *h = c->caller; h && n < max; h = h->parent) {
    pfd[n].fd = h->cancel_fd;
    pfd[n].events = POLLIN;
    pfd[n].revents = 0;
    n++;
  }
  return n;
}

bool ddp__store_sleep(const ddp__store_call_t *c, int ms) {
  struct pollfd pfd[DDP_STORE_MAX_DEPTH + 1];
  int n = ddp__store_cancel_pollfds(c, pfd, DDP_STORE_MAX_DEPTH + 1);
  int left = ddp_ms_until(c->deadline_ns);
  if (ms > left) ms = left;
  if (ms > 0) {
    int r = poll(pfd, (nfds_t)n, ms);
    (void)r; /* EINTR or an error only shortens the sleep; the caller loops */
  }
  return !ddp__store_cancelled(c);
}

void ddp_store_cancel(ddp_store_t *s) {
  require_valid(s);
  atomic_store(&s->cancelled, true);
  uint64_t one = 1;
  ssize_t w = write(s->cancel_fd, &one, sizeof one);
  (void)w; /* EAGAIN means the counter is already non-zero: readable either way */
  if (s->root->ops->wake) s->root->ops->wake(s->root);
}

/* ---------------------------------------------------------------- the API --------- */

/* The state of one public call: the full key (prefix + key) and the call context. */
typedef struct api_call {
  ddp_store_t *s;
  ddp_error_t err;
  ddp__store_call_t c;
  char *key; /* full key; points at kbuf when short */
  char kbuf[256];
} api_call_t;

static void api_begin(api_call_t *a, ddp_store_t *s, int64_t timeout_ms) {
  require_valid(s);
  a->s = s;
  ddp__error_clear(&a->err);
  if (timeout_ms < 0) timeout_ms = s->timeout_ms;
  a->c.caller = s;
  a->c.timeout_ms = timeout_ms;
  a->c.deadline_ns = ddp_deadline_after_ms(timeout_ms);
  a->c.err = &a->err;
  a->c.rank = s->rank;
  a->key = NULL;
}

static ddp_status_t api_end(api_call_t *a, ddp_status_t st) {
  if (a->key && a->key != a->kbuf) ddp__free(a->key);
  if (st != DDP_OK) record_error(a->s, &a->err);
  return st;
}

/* Builds the full key for `key`, or an error naming the operation. */
static ddp_status_t full_key(api_call_t *a, const char *what, const char *key, char **out) {
  DDP_REQUIRE(key != NULL);
  size_t klen = strlen(key);
  size_t n = a->s->prefix_len + klen;
  if (n > DDP_STORE_MAX_KEY) {
    return ddp__error(&a->err, a->s->rank, DDP_ERR_INVALID_ARGUMENT,
                      "%s: key '%.64s...' is %zu bytes with its prefix; the limit is %d", what, key,
                      n, DDP_STORE_MAX_KEY);
  }
  char *buf = n < sizeof a->kbuf ? a->kbuf : ddp__malloc(n + 1);
  if (!buf) return ddp__error(&a->err, a->s->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
  memcpy(buf, a->s->prefix, a->s->prefix_len);
  memcpy(buf + a->s->prefix_len, key, klen + 1);
  *out = buf;
  return DDP_OK;
}

static ddp_status_t check_value(api_call_t *a, const char *what, const void *v, size_t n) {
  DDP_REQUIRE(v != NULL || n == 0);
  if (n > DDP_STORE_MAX_VALUE) {
    return ddp__error(&a->err, a->s->rank, DDP_ERR_INVALID_ARGUMENT,
                      "%s: value of %zu bytes exceeds the limit of %u bytes", what, n,
                      (unsigned)DDP_STORE_MAX_VALUE);
  }
  return DDP_OK;
}

/* Runs `call` unless the handle chain is already cancelled. */
#define API_RUN(a, what, call) \
  (ddp__store_cancelled(&(a)->c) ? ddp__store_aborted(&(a)->c, (what)) : (call))

ddp_status_t ddp_store_set(ddp_store_t *s, const char *key, const void *value, size_t len) {
  api_call_t a;
  api_begin(&a, s, -1);
  ddp_status_t st = full_key(&a, "set", key, &a.key);
  if (st == DDP_OK) st = check_value(&a, "set", value, len);
  if (st == DDP_OK) st = API_RUN(&a, "set", s->ops->set(s->root, &a.c, a.key, value, len));
  return api_end(&a, st);
}

ddp_status_t ddp_store_get(ddp_store_t *s, const char *key, void **value, size_t *len) {
  DDP_REQUIRE(value != NULL && len != NULL);
  *value = NULL;
  *len = 0;
  api_call_t a;
  api_begin(&a, s, -1);
  ddp_status_t st = full_key(&a, "get", key, &a.key);
  if (st == DDP_OK) st = API_RUN(&a, "get", s->ops->get(s->root, &a.c, a.key, value, len));
  return api_end(&a, st);
}

ddp_status_t ddp_store_add(ddp_store_t *s, const char *key, int64_t delta, int64_t *result) {
  api_call_t a;
  api_begin(&a, s, -1);
  int64_t r = 0;
  ddp_status_t st = full_key(&a, "add", key, &a.key);
  if (st == DDP_OK) st = API_RUN(&a, "add", s->ops->add(s->root, &a.c, a.key, delta, &r));
  if (st == DDP_OK && result) *result = r;
  return api_end(&a, st);
}

/* Builds the array of full keys for wait and check. */
static ddp_status_t full_keys(api_call_t *a, const char *what, const char *const *keys,
                              size_t nkeys, char ***out) {
  DDP_REQUIRE(keys != NULL || nkeys == 0);
  if (nkeys > DDP_STORE_MAX_WAIT_KEYS) {
    return ddp__error(&a->err, a->s->rank, DDP_ERR_INVALID_ARGUMENT,
                      "%s: %zu keys; the limit is %d", what, nkeys, DDP_STORE_MAX_WAIT_KEYS);
  }
  char **fk = ddp__calloc(nkeys ? nkeys : 1, sizeof *fk);
  if (!fk) return ddp__error(&a->err, a->s->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
  for (size_t i = 0; i < nkeys; i++) {
    DDP_REQUIRE(keys[i] != NULL);
    size_t kl = strlen(keys[i]);
    size_t n = a->s->prefix_len + kl;
    if (n > DDP_STORE_MAX_KEY) {
      for (size_t j = 0; j < i; j++) ddp__free(fk[j]);
      ddp__free(fk);
      return ddp__error(&a->err, a->s->rank, DDP_ERR_INVALID_ARGUMENT,
                        "%s: key %zu is %zu bytes with its prefix; the limit is %d", what, i, n,
                        DDP_STORE_MAX_KEY);
    }
    fk[i] = ddp__malloc(n + 1);
    if (!fk[i]) {
      for (size_t j = 0; j < i; j++) ddp__free(fk[j]);
      ddp__free(fk);
      return ddp__error(&a->err, a->s->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
    }
    memcpy(fk[i], a->s->prefix, a->s->prefix_len);
    memcpy(fk[i] + a->s->prefix_len, keys[i], kl + 1);
  }
  *out = fk;
  return DDP_OK;
}

static void free_keys(char **fk, size_t n) {
  if (!fk) return;
  for (size_t i = 0; i < n; i++) ddp__free(fk[i]);
  ddp__free(fk);
}

ddp_status_t ddp_store_wait(ddp_store_t *s, const char *const *keys, size_t nkeys,
                            int64_t timeout_ms) {
  api_call_t a;
  api_begin(&a, s, timeout_ms);
  char **fk = NULL;
  ddp_status_t st = full_keys(&a, "wait", keys, nkeys, &fk);
  if (st == DDP_OK) {
    st = API_RUN(&a, "wait", s->ops->wait(s->root, &a.c, (const char *const *)fk, nkeys));
  }
  free_keys(fk, nkeys);
  return api_end(&a, st);
}

ddp_status_t ddp_store_check(ddp_store_t *s, const char *const *keys, size_t nkeys,
                             bool *all_exist) {
  DDP_REQUIRE(all_exist != NULL);
  *all_exist = false;
  api_call_t a;
  api_begin(&a, s, -1);
  char **fk = NULL;
  ddp_status_t st = full_keys(&a, "check", keys, nkeys, &fk);
  if (st == DDP_OK) {
    st = API_RUN(&a, "check",
                 s->ops->check(s->root, &a.c, (const char *const *)fk, nkeys, all_exist));
  }
  free_keys(fk, nkeys);
  return api_end(&a, st);
}

ddp_status_t ddp_store_compare_set(ddp_store_t *s, const char *key, const void *expected,
                                   size_t expected_len, const void *desired, size_t desired_len,
                                   void **actual, size_t *actual_len) {
  DDP_REQUIRE(actual != NULL && actual_len != NULL);
  *actual = NULL;
  *actual_len = 0;
  api_call_t a;
  api_begin(&a, s, -1);
  ddp_status_t st = full_key(&a, "compare_set", key, &a.key);
  if (st == DDP_OK) st = check_value(&a, "compare_set", expected, expected_len);
  if (st == DDP_OK) st = check_value(&a, "compare_set", desired, desired_len);
  if (st == DDP_OK) {
    st = API_RUN(&a, "compare_set",
                 s->ops->compare_set(s->root, &a.c, a.key, expected, expected_len, desired,
                                     desired_len, actual, actual_len));
  }
  return api_end(&a, st);
}

ddp_status_t ddp_store_delete(ddp_store_t *s, const char *key, bool *deleted) {
  api_call_t a;
  api_begin(&a, s, -1);
  bool d = false;
  ddp_status_t st = full_key(&a, "delete", key, &a.key);
  if (st == DDP_OK) st = API_RUN(&a, "delete", s->ops->del(s->root, &a.c, a.key, &d));
  if (deleted) *deleted = st == DDP_OK && d;
  return api_end(&a, st);
}

ddp_status_t ddp_store_num_keys(ddp_store_t *s, int64_t *n) {
  DDP_REQUIRE(n != NULL);
  *n = 0;
  api_call_t a;
  api_begin(&a, s, -1);
  ddp_status_t st = API_RUN(&a, "num_keys", s->ops->num_keys(s->root, &a.c, n));
  return api_end(&a, st);
}

int64_t ddp_store_timeout_ms(const ddp_store_t *s) {
  require_valid(s);
  return s->timeout_ms;
}

int ddp_store_port(const ddp_store_t *s) {
  require_valid(s);
  return s->root->ops->port ? s->root->ops->port(s->root) : -1;
}

ddp_status_t ddp_store_serve_fd(int listen_fd, const char *job_token, bool torch_clients,
                                ddp_store_server_t **out, ddp_error_t *err) {
  DDP_REQUIRE(out);
  *out = NULL;
  const char *token = job_token ? job_token : ddp_env_get(DDP_ENV_JOB_TOKEN);
  return ddp__store_server_start_fd(listen_fd, token, torch_clients, -1, err, out);
}

void ddp_store_server_stop(ddp_store_server_t *srv) { ddp__store_server_stop(srv); }
