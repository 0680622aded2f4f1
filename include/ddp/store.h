/* libddp store layer: rendezvous key-value stores (in-memory, file, TCP) and prefix views.
 *
 * A store is how ranks find each other before a process group exists: rank 0 publishes an
 * address or a segment name, the others wait for it. Semantics follow c10d's Store:
 * values are byte strings; add() keeps a decimal int64 counter; wait() blocks until every
 * key exists or the deadline passes. Every blocking call is bounded by the store's timeout
 * (or the one given) and returns DDP_ERR_TIMEOUT naming the missing keys. All calls are
 * thread-safe on one handle; a handle must not be used across fork() (a child creates its
 * own). ddp_store_cancel() from any thread makes blocked and later calls return
 * DDP_ERR_ABORTED. Every create takes an optional ddp_error_t *err for its failure (it has
 * no handle yet); later failures are read with ddp_store_last_error_copy. Failures are
 * logged once, by the store, where they happen. docs/rendezvous.md describes the kinds, the
 * timeouts, the token and the wire format. */
#ifndef DDP_STORE_H
#define DDP_STORE_H

#include "ddp/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_store ddp_store_t;

/* Maximum key and value sizes accepted by every store kind (the TCP store enforces them on
 * the wire: a larger length closes that connection). */
#define DDP_STORE_MAX_KEY 4096
#define DDP_STORE_MAX_VALUE (64u << 20)
/* Most keys one wait() or check() may name. */
#define DDP_STORE_MAX_WAIT_KEYS 1024
/* Most nested prefix views over one store. */
#define DDP_STORE_MAX_DEPTH 8

typedef struct ddp_store_options {
  size_t struct_size;    /* sizeof(ddp_store_options_t) */
  int64_t timeout_ms;    /* default for every blocking call; <0 = DDP_TIMEOUT env (1800 s) */
  const char *job_token; /* TCP: presented at connect; NULL = DDP_JOB_TOKEN env, "" = none */
  int rank;              /* for log prefixes and messages; -1 unknown */
} ddp_store_options_t;

#define DDP_STORE_OPTIONS_INIT \
  { sizeof(ddp_store_options_t), -1, NULL, -1 }

/* Every create: opts may be NULL (defaults; read by struct_size, older callers get defaults
 * for the fields they lack); err (optional) receives the message on failure. */

/* In-process store shared by threads: create one, pass the same handle to every thread. */
DDP_API ddp_status_t ddp_store_create_memory(const ddp_store_options_t *opts, ddp_store_t **out,
                                             ddp_error_t *err);
/* A directory on a (possibly shared) filesystem, created (one level) when missing; one file
 * per key, atomic renames. The store never removes the directory. */
DDP_API ddp_status_t ddp_store_create_file(const char *dir, const ddp_store_options_t *opts,
                                           ddp_store_t **out, ddp_error_t *err);
/* TCP: when is_server, listens on host:port (port 0 = ephemeral; see ddp_store_port) and
 * serves from a background thread, and this handle is also a client of it. Clients retry
 * connecting with backoff until the timeout. host NULL means MASTER_ADDR (clients) or every
 * IPv4 interface (server); port -1 means MASTER_PORT. The job token is checked on every
 * connection: a server and its clients must hold equal tokens ("" equals only ""); a
 * rejected client gets DDP_ERR_INVALID_USAGE saying so. Wire format: docs/rendezvous.md. */
DDP_API ddp_status_t ddp_store_create_tcp(const char *host, int port, bool is_server,
                                          const ddp_store_options_t *opts, ddp_store_t **out,
                                          ddp_error_t *err);
/* A store whose operations are the caller's functions: how a foreign rendezvous (c10d's
 * Store under the PyTorch backend, src/torch) becomes a ddp_store_t. Every callback is
 * non-blocking and thread-safe on ctx, returns DDP_OK or a status with its message in err:
 *   set: stores the value; get: *found = the key exists, and then *v (ddp_malloc'ed) and *n
 *   hold its value; add: the c10d counter update; check: *all_exist for the keys.
 * del, num_keys and compare_set may be NULL (those calls are then DDP_ERR_UNSUPPORTED).
 * get and wait block here, not in the callbacks: the store polls check/get with a backoff of
 * 1 to 16 ms, so deadlines, cancellation and the timeout message naming the missing keys
 * behave as in every other kind. destroy (may be NULL) runs once, from ddp_store_destroy. */
typedef struct ddp_store_callbacks {
  size_t struct_size; /* sizeof(ddp_store_callbacks_t) */
  void *ctx;
  const char *desc; /* for messages ("c10d PrefixStore"); copied; NULL = "callback store" */
  ddp_status_t (*set)(void *ctx, const char *key, const void *v, size_t n, ddp_error_t *err);
  ddp_status_t (*get)(void *ctx, const char *key, bool *found, void **v, size_t *n,
                      ddp_error_t *err);
  ddp_status_t (*add)(void *ctx, const char *key, int64_t delta, int64_t *result, ddp_error_t *err);
  ddp_status_t (*check)(void *ctx, const char *const *keys, size_t nkeys, bool *all_exist,
                        ddp_error_t *err);
  ddp_status_t (*del)(void *ctx, const char *key, bool *deleted, ddp_error_t *err);
  ddp_status_t (*num_keys)(void *ctx, int64_t *n, ddp_error_t *err);
  ddp_status_t (*compare_set)(void *ctx, const char *key, const void *expected, size_t exp_n,
                              const void *desired, size_t des_n, void **actual, size_t *act_n,
                              ddp_error_t *err);
  void (*destroy)(void *ctx);
} ddp_store_callbacks_t;

DDP_API ddp_status_t ddp_store_create_callbacks(const ddp_store_callbacks_t *cb,
                                                const ddp_store_options_t *opts, ddp_store_t **out,
                                                ddp_error_t *err);

/* A TCP store server alone, serving on listen_fd (a listening TCP socket; it is the
 * server's from now on, and closed by ddp_store_server_stop) from one background thread,
 * without a client handle: how ddprun serves its job's store (docs/launcher.md). Clients
 * present job_token (NULL: DDP_JOB_TOKEN). With torch_clients, a connection whose first
 * byte is a PyTorch 1.13 TCPStore query type is served with that protocol, in a key space
 * of its own and without a token (docs/rendezvous.md, "PyTorch's TCPStore clients"). */
typedef struct ddp__store_server ddp_store_server_t;
DDP_API ddp_status_t ddp_store_serve_fd(int listen_fd, const char *job_token, bool torch_clients,
                                        ddp_store_server_t **out, ddp_error_t *err);
/* Stops serving and closes every connection. NULL is a no-op. */
DDP_API void ddp_store_server_stop(ddp_store_server_t *srv);
/* A view whose keys are prefixed with "<prefix>/" (sub-groups). It holds a reference to
 * base, which must outlive it. */
DDP_API ddp_status_t ddp_store_create_prefix(ddp_store_t *base, const char *prefix,
                                             ddp_store_t **out, ddp_error_t *err);
/* NULL is a no-op. No call may be in flight on the handle (cancel, then join the callers).
 * Destroying a TCP server stops serving every client. */
DDP_API void ddp_store_destroy(ddp_store_t *s);

DDP_API ddp_status_t ddp_store_set(ddp_store_t *s, const char *key, const void *value, size_t len);
/* Waits (up to the store timeout) for key, then returns a copy: *value is allocated with
 * ddp_malloc and freed by the caller with ddp_free. */
DDP_API ddp_status_t ddp_store_get(ddp_store_t *s, const char *key, void **value, size_t *len);
/* Atomically adds delta to the int64 counter at key (missing = 0) and returns the result. */
DDP_API ddp_status_t ddp_store_add(ddp_store_t *s, const char *key, int64_t delta, int64_t *result);
/* Waits until all keys exist. timeout_ms < 0 uses the store's timeout. */
DDP_API ddp_status_t ddp_store_wait(ddp_store_t *s, const char *const *keys, size_t nkeys,
                                    int64_t timeout_ms);
/* *all_exist = every key exists now (no wait). */
DDP_API ddp_status_t ddp_store_check(ddp_store_t *s, const char *const *keys, size_t nkeys,
                                     bool *all_exist);
/* If the current value equals expected (a missing key equals an empty expected with
 * expected_len 0), sets desired. *actual (ddp_malloc'ed, caller frees) is the value after
 * the call, as in c10d's compareSet; a key that stays missing gives an empty *actual. */
DDP_API ddp_status_t ddp_store_compare_set(ddp_store_t *s, const char *key, const void *expected,
                                           size_t expected_len, const void *desired,
                                           size_t desired_len, void **actual, size_t *actual_len);
/* *deleted = the key existed. */
DDP_API ddp_status_t ddp_store_delete(ddp_store_t *s, const char *key, bool *deleted);
/* Keys in the whole underlying store (a prefix view does not filter, as in c10d). */
DDP_API ddp_status_t ddp_store_num_keys(ddp_store_t *s, int64_t *n);
/* Unblocks every waiting call made through this handle or a prefix view over it
 * (DDP_ERR_ABORTED); later calls through them fail the same way. Cancelling a view leaves
 * its base usable. Safe from any thread while other calls block. */
DDP_API void ddp_store_cancel(ddp_store_t *s);
DDP_API int64_t ddp_store_timeout_ms(const ddp_store_t *s);
/* TCP server: the bound port (useful with port 0); -1 otherwise. */
DDP_API int ddp_store_port(const ddp_store_t *s);
/* Copies into *out, under the handle's lock, the error of the last failed call on this
 * handle made by the calling thread (or, when this thread has none, the handle's latest);
 * status DDP_OK and "" when none. */
DDP_API void ddp_store_last_error_copy(const ddp_store_t *s, ddp_error_t *out);
/* The numeric local address (no port) of s's connection to its TCP store server: the
 * address the kernel chose to reach node 0, hence one that hosts on node 0's network can
 * reach this host at (the tcp backend publishes it to its peers). s may be a prefix view.
 * False (buf = "") for memory and file stores, for a server created on a wildcard address
 * (its own client then goes over loopback), and when the address does not fit in cap
 * bytes. Thread-safe: the address is fixed at create. */
DDP_API bool ddp_store_local_addr(const ddp_store_t *s, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* DDP_STORE_H */
