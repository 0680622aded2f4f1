/* Private interface of the store layer: the handle, the per-kind operation table, the call
 * context that carries a deadline and the cancellation chain, the key/value table shared by
 * the in-memory store and the TCP server, and the TCP wire format. Not installed. */
#ifndef DDP_SRC_STORE_INTERNAL_H
#define DDP_SRC_STORE_INTERNAL_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>

#include "common/common.h"
#include "ddp/store.h"

#define DDP__STORE_MAGIC 0x53544f52u /* "STOR" */

/* One operation in progress. Keys reaching a kind's table are full keys (the view's prefix
 * already applied). `caller` is the handle the user called: its chain of views down to the
 * root is what cancellation checks. */
typedef struct ddp__store_call {
  ddp_store_t *caller;
  int64_t deadline_ns; /* INT64_MAX = none */
  int64_t timeout_ms;  /* the budget the deadline came from, for messages */
  ddp_error_t *err;
  int rank;
} ddp__store_call_t;

/* A kind's operations, run on the root handle. Each returns a status and fills call->err
 * with ddp__error where an error starts. A NULL member is never called. */
typedef struct ddp__store_ops {
  const char *kind;
  ddp_status_t (*set)(ddp_store_t *s, const ddp__store_call_t *c, const char *key, const void *v,
                      size_t n);
  /* Waits until key exists (deadline, cancellation), then copies its value (ddp_malloc). */
  ddp_status_t (*get)(ddp_store_t *s, const ddp__store_call_t *c, const char *key, void **v,
                      size_t *n);
  ddp_status_t (*add)(ddp_store_t *s, const ddp__store_call_t *c, const char *key, int64_t delta,
                      int64_t *result);
  ddp_status_t (*wait)(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                       size_t nkeys);
  ddp_status_t (*check)(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                        size_t nkeys, bool *all);
  ddp_status_t (*compare_set)(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                              const void *exp, size_t exp_n, const void *des, size_t des_n,
                              void **actual, size_t *actual_n);
  ddp_status_t (*del)(ddp_store_t *s, const ddp__store_call_t *c, const char *key, bool *deleted);
  ddp_status_t (*num_keys)(ddp_store_t *s, const ddp__store_call_t *c, int64_t *n);
  /* Wakes every blocked call so that it re-checks cancellation (may be NULL when the kind
   * only blocks in poll() on the cancel fds). */
  void (*wake)(ddp_store_t *s);
  int (*port)(const ddp_store_t *s);
  void (*destroy)(ddp_store_t *s);
} ddp__store_ops_t;

#define DDP__STORE_ERR_SLOTS 16

/* The last error of one thread on one handle. */
typedef struct ddp__store_err_slot {
  pthread_t tid;
  uint64_t stamp; /* 0 = unused */
  ddp_error_t e;
} ddp__store_err_slot_t;

struct ddp_store {
  uint32_t magic;
  const ddp__store_ops_t *ops; /* the root's table (views share it) */
  ddp_store_t *parent;         /* NULL for a root, else the base of this view */
  ddp_store_t *root;           /* self for a root */
  char *prefix;                /* full prefix of a view ("a/b/"), "" for a root */
  size_t prefix_len;
  int depth; /* 0 for a root */
  int rank;
  int64_t timeout_ms;
  char desc[160]; /* "tcp store 10.0.0.1:29500", for messages */
  atomic_bool cancelled;
  int cancel_fd; /* eventfd, readable once cancelled */
  pthread_mutex_t err_lock;
  uint64_t err_clock;
  ddp__store_err_slot_t errs[DDP__STORE_ERR_SLOTS];
  void *impl; /* the kind's state (roots only) */
};

/* Shared construction: reads the caller's options (ddp__opts_read; *read, when not NULL,
 * gets them) and fills the generic fields of a root handle (magic, timeout from opts or
 * DDP_TIMEOUT, rank, cancel eventfd). */
ddp_status_t ddp__store_new(const ddp_store_options_t *opts, const ddp__store_ops_t *ops,
                            ddp_store_options_t *read, ddp_error_t *err, ddp_store_t **out);
void ddp__store_free(ddp_store_t *s);

/* True once the caller or any base below it was cancelled. */
bool ddp__store_cancelled(const ddp__store_call_t *c);
/* Records DDP_ERR_ABORTED for an operation named `what`. */
ddp_status_t ddp__store_aborted(const ddp__store_call_t *c, const char *what);
/* Appends the cancel eventfds of the caller's chain to pfd (POLLIN); returns how many. */
int ddp__store_cancel_pollfds(const ddp__store_call_t *c, struct pollfd *pfd, int max);
/* Sleeps up to ms (bounded by the deadline) unless cancelled first; returns false when
 * cancelled. */
bool ddp__store_sleep(const ddp__store_call_t *c, int ms);
/* Formats up to a few keys as "'a', 'b' and 3 more" into buf. */
void ddp__store_format_keys(char *buf, size_t cap, const char *const *keys, size_t n);
/* Parses a stored counter value (decimal int64, optional sign). */
bool ddp__store_parse_i64(const void *v, size_t n, int64_t *out);
/* Adds with overflow check; false on overflow. */
bool ddp__store_add_i64(int64_t a, int64_t b, int64_t *out);
/* Copies n bytes into a fresh ddp_malloc block (n may be 0). NULL when out of memory. */
void *ddp__store_dup_value(const void *v, size_t n);

/* ---- key/value table: a chained hash table of byte values under string keys. Not
 * thread-safe: the memory store guards it with its mutex, the TCP server owns its own. */
typedef struct ddp__kv_entry {
  struct ddp__kv_entry *next;
  uint64_t hash;
  char *key;
  size_t key_len;
  unsigned char *val;
  size_t val_len;
} ddp__kv_entry_t;

typedef struct ddp__kv {
  ddp__kv_entry_t **buckets;
  size_t nbuckets; /* power of two */
  size_t count;
} ddp__kv_t;

ddp_status_t ddp__kv_init(ddp__kv_t *kv);
void ddp__kv_fini(ddp__kv_t *kv);
ddp__kv_entry_t *ddp__kv_find(const ddp__kv_t *kv, const char *key, size_t key_len);
/* Inserts or replaces; copies key and value. DDP_ERR_NO_MEMORY leaves the table as it was. */
ddp_status_t ddp__kv_put(ddp__kv_t *kv, const char *key, size_t key_len, const void *v, size_t n);
bool ddp__kv_del(ddp__kv_t *kv, const char *key, size_t key_len);
/* The counter update of add(): a missing key counts as 0; a value that is not a decimal
 * int64, or an overflow, is an error described in why. */
ddp_status_t ddp__kv_add(ddp__kv_t *kv, const char *key, size_t key_len, int64_t delta,
                         int64_t *result, char *why, size_t cap);
/* compare_set on the table; *after is the entry after the call (NULL = still missing). */
ddp_status_t ddp__kv_cset(ddp__kv_t *kv, const char *key, size_t key_len, const void *exp,
                          size_t exp_n, const void *des, size_t des_n,
                          const ddp__kv_entry_t **after);

/* ---- TCP wire format (docs/rendezvous.md). Every message, in both directions, is a
 * 12-byte header followed by nfields length-prefixed fields, all integers little-endian:
 *   u32 magic "DDPS" | u8 op or status | u8 nfields | u16 zero | u32 body_len
 *   body = nfields x (u32 len | len bytes)
 * The receiver checks the header before reading the body: a bad magic, non-zero reserved
 * bits, an unknown op, a field count or body length outside the op's bounds closes the
 * connection. */
#define DDP__WIRE_MAGIC 0x53504444u /* bytes 'D' 'D' 'P' 'S' */
#define DDP__WIRE_VERSION 1u
#define DDP__WIRE_HDR 12
#define DDP__WIRE_MAX_TOKEN 1024
#define DDP__WIRE_MAX_FIELDS (DDP_STORE_MAX_WAIT_KEYS + 1)

typedef enum ddp__wire_op {
  DDP__OP_HELLO = 1,   /* [u32 version][token] -> OK | error, connection closed */
  DDP__OP_SET = 2,     /* [key][value] -> OK */
  DDP__OP_GET = 3,     /* [key][u64 timeout_ms] -> [value] | TIMEOUT */
  DDP__OP_ADD = 4,     /* [key][i64 delta] -> [i64 result] */
  DDP__OP_WAIT = 5,    /* [u64 timeout_ms][key]... -> OK | TIMEOUT naming missing keys */
  DDP__OP_CHECK = 6,   /* [key]... -> [u8 all_exist] */
  DDP__OP_CSET = 7,    /* [key][expected][desired] -> [actual] */
  DDP__OP_DELETE = 8,  /* [key] -> [u8 deleted] */
  DDP__OP_NUMKEYS = 9, /* -> [i64 n] */
  DDP__OP_MAX_ = 10
} ddp__wire_op_t;

/* A decoded message: fields point into the body buffer. */
typedef struct ddp__wire_msg {
  unsigned op; /* op (requests) or ddp_status_t (responses) */
  unsigned nfields;
  const unsigned char *field[DDP__WIRE_MAX_FIELDS];
  uint32_t len[DDP__WIRE_MAX_FIELDS];
} ddp__wire_msg_t;

typedef struct ddp__wire_hdr {
  unsigned code;
  unsigned nfields;
  uint32_t body_len;
} ddp__wire_hdr_t;

/* Header checks. why gets a short reason on failure. */
bool ddp__wire_parse_request_hdr(const unsigned char *p, ddp__wire_hdr_t *h, char *why, size_t cap);
bool ddp__wire_parse_response_hdr(const unsigned char *p, ddp__wire_hdr_t *h, char *why,
                                  size_t cap);
/* Splits a body into fields and checks each field's size against the op. */
bool ddp__wire_parse_body(const ddp__wire_hdr_t *h, const unsigned char *body, bool request,
                          ddp__wire_msg_t *m, char *why, size_t cap);
/* Builds one message into a fresh ddp__malloc block (*out, *out_n). */
ddp_status_t ddp__wire_build(unsigned code, unsigned nfields, const void *const *field,
                             const uint32_t *len, unsigned char **out, size_t *out_n);
uint64_t ddp__wire_get_u64(const unsigned char *p);
void ddp__wire_put_u64(unsigned char *p, uint64_t v);
uint32_t ddp__wire_get_u32(const unsigned char *p);
void ddp__wire_put_u32(unsigned char *p, uint32_t v);

/* ---- PyTorch 1.13's TCPStore wire format (tcp_torch.c), served beside libddp's own when
 * the server is started with torch clients (ddprun). A request is one query-type byte and
 * its fields, native (little) endian: a string is a u64 length and its bytes, a count a u64,
 * an add's delta an i64. There is no header, no length of the whole, and no handshake. */
enum {
  DDP__TORCH_SET = 0,         /* key, value; no reply */
  DDP__TORCH_COMPARE_SET = 1, /* key, expected, desired; reply: value (u64 length, bytes) */
  DDP__TORCH_GET = 2,         /* key; reply: value */
  DDP__TORCH_ADD = 3,         /* key, i64 delta; reply: i64 */
  DDP__TORCH_CHECK = 4,       /* u64 n, n keys; reply: u8 0 ready, 1 not ready */
  DDP__TORCH_WAIT = 5,        /* u64 n, n keys; reply: u8 0 (STOP_WAITING) once all exist */
  DDP__TORCH_GETNUMKEYS = 6,  /* reply: i64 */
  DDP__TORCH_WATCH_KEY = 7,   /* key (the callback connection; not served) */
  DDP__TORCH_DELETE_KEY = 8,  /* key; reply: i64 keys deleted */
  DDP__TORCH_LAST = 8
};
typedef struct ddp__torch_req {
  unsigned op;
  size_t nstr;                                       /* strings (keys, values) in str/len */
  const unsigned char *str[DDP_STORE_MAX_WAIT_KEYS]; /* into the input buffer */
  size_t len[DDP_STORE_MAX_WAIT_KEYS];
  int64_t delta; /* ADD */
} ddp__torch_req_t;
/* Parses one request at the front of in[0..n): 1 with *used set when it is complete, 0 when
 * more bytes are needed, -1 with why when it can never be valid (an unknown query type, a
 * key, value or key count over libddp's limits). Never reads past n. */
int ddp__torch_parse(const unsigned char *in, size_t n, ddp__torch_req_t *r, size_t *used,
                     char *why, size_t cap);

/* ---- TCP server (runs its own thread). */
typedef struct ddp__store_server ddp__store_server_t;
ddp_status_t ddp__store_server_start(const char *host, int port, const char *token, int rank,
                                     ddp_error_t *err, ddp__store_server_t **out);
/* On a listening socket the caller hands over; torch: also serve PyTorch's clients. */
ddp_status_t ddp__store_server_start_fd(int lfd, const char *token, bool torch, int rank,
                                        ddp_error_t *err, ddp__store_server_t **out);
int ddp__store_server_port(const ddp__store_server_t *srv);
void ddp__store_server_stop(ddp__store_server_t *srv);

/* Kind constructors' tables. */
extern const ddp__store_ops_t ddp__store_memory_ops;
extern const ddp__store_ops_t ddp__store_file_ops;
extern const ddp__store_ops_t ddp__store_callbacks_ops;
extern const ddp__store_ops_t ddp__store_tcp_ops;

#endif /* DDP_SRC_STORE_INTERNAL_H */
