/* The TCP store server: one background thread, one poll() loop, every client connection
 * non-blocking, the key/value table owned by that thread alone (no lock).
 *
 * Each connection moves through: HELLO (protocol version and job token; anything else
 * first, or a wrong token, ends it), then requests answered in order. GET on a missing key
 * and WAIT on missing keys never block the loop: the connection is parked with its keys and
 * deadline, and every pass of the loop answers the parked connections whose keys now exist
 * (or whose deadline passed, with TIMEOUT naming the missing keys). A parked client sends
 * nothing until answered; the poll timeout is the nearest parked deadline.
 *
 * Hostile input ends only the connection that sent it: a header is validated before its
 * body is buffered (ddp__wire_parse_request_hdr), a body must split into fields of the
 * sizes its op allows, and the first such failure is logged once with the peer address and
 * the connection is closed. Replies are queued per connection and written as the socket
 * accepts them, so a slow reader never stalls the others. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "store/store_internal.h"

#define MAX_CLIENTS 4096
#define PROTO_DDP 1
#define PROTO_TORCH 2
#define WAIT_TORCH_GET 100 /* wait_op of a parked PyTorch GET or WAIT */
#define WAIT_TORCH_WAIT 101
#define READ_CHUNK 65536

typedef struct client {
  struct client *next;
  int fd;
  char peer[80];
  unsigned char *in;
  size_t in_len, in_cap;
  unsigned char *out;
  size_t out_len, out_off;
  unsigned char proto; /* 0 until the first byte; PROTO_DDP or PROTO_TORCH */
  bool hello_ok;
  bool closing;     /* close once out is flushed */
  bool dead;        /* close now */
  unsigned wait_op; /* 0, DDP__OP_GET or DDP__OP_WAIT */
  char **wkeys;
  size_t nwkeys;
  int64_t wdeadline_ns;
  uint64_t wtimeout_ms;
} client_t;

struct ddp__store_server {
  int lfd;
  int stop_fd;
  int port;
  int rank;
  char addr[96];
  char *token;
  size_t token_len;
  pthread_t thread;
  ddp__kv_t kv;
  bool torch;    /* PyTorch's TCPStore clients are served too (ddprun) */
  ddp__kv_t tkv; /* their keys: a space of their own, which they cannot reach past */
  client_t *clients;
  size_t nclients;
  struct pollfd *pfd; /* poll set, at least 2 entries; grows with the clients */
  size_t pcap;
  uint64_t mutations;       /* counts set, add and compare_set, to know when to re-check waits */
  int64_t accept_resume_ns; /* out of fds: leave the listener alone until then */
  bool fd_limit_logged;
};

static void format_peer(const struct sockaddr *sa, socklen_t len, char *buf, size_t cap) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) !=
      0) {
    snprintf(buf, cap, "unknown peer");
  } else if (sa->sa_family == AF_INET6) {
    snprintf(buf, cap, "[%.60s]:%.8s", host, serv);
  } else {
    snprintf(buf, cap, "%.60s:%.8s", host, serv);
  }
}

static void clear_wait(client_t *cl) {
  for (size_t i = 0; i < cl->nwkeys; i++) ddp__free(cl->wkeys[i]);
  ddp__free(cl->wkeys);
  cl->wkeys = NULL;
  cl->nwkeys = 0;
  cl->wait_op = 0;
}

static void client_free(client_t *cl) {
  close(cl->fd);
  clear_wait(cl);
  ddp__free(cl->in);
  ddp__free(cl->out);
  ddp__free(cl);
}

/* Ends a connection for a protocol violation, logging once with the peer address. */
static void drop(ddp__store_server_t *srv, client_t *cl, const char *why) {
  if (cl->dead) return;
  ddp__log(srv->rank, DDP_LOG_WARN, "tcp store server %s: closing the connection from %s: %s",
           srv->addr, cl->peer, why);
  cl->dead = true;
}

/* Queues msg (a ddp__malloc block, taken over) for sending. */
static void queue(ddp__store_server_t *srv, client_t *cl, unsigned char *msg, size_t n) {
  if (cl->out_len == cl->out_off) {
    ddp__free(cl->out);
    cl->out = msg;
    cl->out_len = n;
    cl->out_off = 0;
    return;
  }
  unsigned char *joined = ddp__malloc(cl->out_len - cl->out_off + n);
  if (!joined) {
    ddp__free(msg);
    drop(srv, cl, "out of memory queueing a reply");
    return;
  }
  memcpy(joined, cl->out + cl->out_off, cl->out_len - cl->out_off);
  memcpy(joined + cl->out_len - cl->out_off, msg, n);
  cl->out_len = cl->out_len - cl->out_off + n;
  cl->out_off = 0;
  ddp__free(cl->out);
  ddp__free(msg);
  cl->out = joined;
}

/* Queues one reply. Out of memory ends the connection (the client sees it closed). */
static void reply(ddp__store_server_t *srv, client_t *cl, unsigned code, unsigned nfields,
                  const void *const *field, const uint32_t *len) {
  unsigned char *msg;
  size_t n;
  if (ddp__wire_build(code, nfields, field, len, &msg, &n) != DDP_OK) {
    drop(srv, cl, "out of memory building a reply");
    return;
  }
  queue(srv, cl, msg, n);
}

/* A PyTorch reply: bytes as they go on the wire, or with `counted` a u64 length first. */
static void reply_torch(ddp__store_server_t *srv, client_t *cl, const void *v, size_t n,
                        bool counted) {
  unsigned char *msg = ddp__malloc(n + 8);
  if (!msg) {
    drop(srv, cl, "out of memory building a reply");
    return;
  }
  if (counted) ddp__wire_put_u64(msg, (uint64_t)n);
  memcpy(msg + (counted ? 8 : 0), v, n);
  queue(srv, cl, msg, n + (counted ? 8 : 0));
}

static ddp__kv_t *kv_of(ddp__store_server_t *srv, const client_t *cl) {
  return cl->proto == PROTO_TORCH ? &srv->tkv : &srv->kv;
}

static void reply_ok(ddp__store_server_t *srv, client_t *cl, const void *v, uint32_t n) {
  const void *f[1] = {v};
  uint32_t l[1] = {n};
  reply(srv, cl, DDP_OK, 1, f, l);
}

static void reply_err(ddp__store_server_t *srv, client_t *cl, ddp_status_t st, const char *fmt, ...)
    DDP_PRINTF(4, 5);
static void reply_err(ddp__store_server_t *srv, client_t *cl, ddp_status_t st, const char *fmt,
                      ...) {
  char text[DDP_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof text) n = (int)sizeof text - 1;
  const void *f[1] = {text};
  uint32_t l[1] = {(uint32_t)n};
  reply(srv, cl, st, 1, f, l);
}

static void reply_i64(ddp__store_server_t *srv, client_t *cl, int64_t v) {
  unsigned char b[8];
  ddp__wire_put_u64(b, (uint64_t)v);
  reply_ok(srv, cl, b, 8);
}

static bool key_exists(ddp__store_server_t *srv, const unsigned char *k, uint32_t n) {
  return ddp__kv_find(&srv->kv, (const char *)k, n) != NULL;
}

/* Parks a GET or WAIT with copies of its keys. */
static void park(ddp__store_server_t *srv, client_t *cl, unsigned op, const ddp__wire_msg_t *m,
                 unsigned first, size_t n, uint64_t timeout_ms) {
  cl->wkeys = ddp__calloc(n, sizeof *cl->wkeys);
  if (!cl->wkeys) {
    drop(srv, cl, "out of memory parking a wait");
    return;
  }
  cl->nwkeys = n;
  for (size_t i = 0; i < n; i++) {
    uint32_t kl = m->len[first + i];
    cl->wkeys[i] = ddp__malloc(kl + 1);
    if (!cl->wkeys[i]) {
      drop(srv, cl, "out of memory parking a wait");
      return;
    }
    memcpy(cl->wkeys[i], m->field[first + i], kl);
    cl->wkeys[i][kl] = '\0';
  }
  cl->wait_op = op;
  cl->wtimeout_ms = timeout_ms;
  cl->wdeadline_ns = timeout_ms > (uint64_t)INT64_MAX ? INT64_MAX
                                                      : ddp_deadline_after_ms((int64_t)timeout_ms);
}

/* Answers a parked client when its keys exist or its deadline passed. */
static void service_wait(ddp__store_server_t *srv, client_t *cl, int64_t now) {
  bool all = true;
  ddp__kv_t *kv = kv_of(srv, cl);
  for (size_t i = 0; i < cl->nwkeys && all; i++) {
    all = ddp__kv_find(kv, cl->wkeys[i], strlen(cl->wkeys[i])) != NULL;
  }
  if (all && cl->wait_op >= WAIT_TORCH_GET) {
    static const unsigned char stop_waiting = 0;
    ddp__kv_entry_t *e = ddp__kv_find(kv, cl->wkeys[0], strlen(cl->wkeys[0]));
    if (cl->wait_op == WAIT_TORCH_GET)
      reply_torch(srv, cl, e->val, e->val_len, true);
    else
      reply_torch(srv, cl, &stop_waiting, 1, false);
    clear_wait(cl);
    return;
  }
  if (all) {
    if (cl->wait_op == DDP__OP_GET) {
      ddp__kv_entry_t *e = ddp__kv_find(&srv->kv, cl->wkeys[0], strlen(cl->wkeys[0]));
      reply_ok(srv, cl, e->val, (uint32_t)e->val_len);
    } else {
      reply(srv, cl, DDP_OK, 0, NULL, NULL);
    }
    clear_wait(cl);
    return;
  }
  if (now < cl->wdeadline_ns) return;
  const char *missing[DDP_STORE_MAX_WAIT_KEYS];
  size_t nm = 0;
  for (size_t i = 0; i < cl->nwkeys; i++) {
    if (!ddp__kv_find(&srv->kv, cl->wkeys[i], strlen(cl->wkeys[i]))) missing[nm++] = cl->wkeys[i];
  }
  char list[400];
  ddp__store_format_keys(list, sizeof list, missing, nm);
  reply_err(srv, cl, DDP_ERR_TIMEOUT,
            "%s timed out after %llu ms on tcp store %s: missing key%s %s",
            cl->wait_op == DDP__OP_GET ? "get" : "wait", (unsigned long long)cl->wtimeout_ms,
            srv->addr, nm == 1 ? "" : "s", list);
  clear_wait(cl);
}

static void handle_hello(ddp__store_server_t *srv, client_t *cl, const ddp__wire_msg_t *m) {
  uint32_t version = ddp__wire_get_u32(m->field[0]);
  if (version != DDP__WIRE_VERSION) {
    ddp__log(srv->rank, DDP_LOG_WARN,
             "tcp store server %s: client %s speaks protocol version %u, this server %u", srv->addr,
             cl->peer, version, DDP__WIRE_VERSION);
    reply_err(srv, cl, DDP_ERR_INVALID_USAGE,
              "tcp store %s speaks protocol version %u, the client %u", srv->addr,
              DDP__WIRE_VERSION, version);
    cl->closing = true;
    return;
  }
  /* Compare every byte whatever the first difference, so timing says nothing. */
  unsigned diff = m->len[1] != srv->token_len;
  for (uint32_t i = 0; i < m->len[1]; i++) {
    diff |= (unsigned)(m->field[1][i] ^ (unsigned char)srv->token[i % (srv->token_len + 1)]);
  }
  if (diff) {
    ddp__log(srv->rank, DDP_LOG_WARN,
             "tcp store server %s: rejected the job token presented by %s; closing", srv->addr,
             cl->peer);
    reply_err(srv, cl, DDP_ERR_INVALID_USAGE, "tcp store %s rejected the job token", srv->addr);
    cl->closing = true;
    return;
  }
  cl->hello_ok = true;
  reply(srv, cl, DDP_OK, 0, NULL, NULL);
}

static void handle(ddp__store_server_t *srv, client_t *cl, const ddp__wire_msg_t *m) {
  char why[400];
  const char *key = m->nfields ? (const char *)m->field[0] : NULL;
  uint32_t klen = m->nfields ? m->len[0] : 0;
  if (!cl->hello_ok) {
    if (m->op != DDP__OP_HELLO) {
      snprintf(why, sizeof why, "first message is op %u, not HELLO", m->op);
      drop(srv, cl, why);
      return;
    }
    handle_hello(srv, cl, m);
    return;
  }
  if (m->op == DDP__OP_SET || m->op == DDP__OP_ADD || m->op == DDP__OP_CSET) srv->mutations++;
  switch (m->op) {
    case DDP__OP_HELLO: drop(srv, cl, "a second HELLO"); return;
    case DDP__OP_SET:
      if (ddp__kv_put(&srv->kv, key, klen, m->field[1], m->len[1]) != DDP_OK) {
        reply_err(srv, cl, DDP_ERR_NO_MEMORY, "tcp store %s: out of memory", srv->addr);
      } else {
        reply(srv, cl, DDP_OK, 0, NULL, NULL);
      }
      return;
    case DDP__OP_GET:
      park(srv, cl, DDP__OP_GET, m, 0, 1, ddp__wire_get_u64(m->field[1]));
      if (cl->wait_op) service_wait(srv, cl, ddp_now_ns());
      return;
    case DDP__OP_ADD: {
      int64_t r;
      char kcopy[DDP_STORE_MAX_KEY + 1];
      memcpy(kcopy, key, klen);
      kcopy[klen] = '\0';
      ddp_status_t st = ddp__kv_add(&srv->kv, kcopy, klen, (int64_t)ddp__wire_get_u64(m->field[1]),
                                    &r, why, sizeof why);
      if (st != DDP_OK) {
        reply_err(srv, cl, st, "add on tcp store %s: %s", srv->addr, why);
      } else {
        reply_i64(srv, cl, r);
      }
      return;
    }
    case DDP__OP_WAIT:
      park(srv, cl, DDP__OP_WAIT, m, 1, m->nfields - 1, ddp__wire_get_u64(m->field[0]));
      if (cl->wait_op) service_wait(srv, cl, ddp_now_ns());
      return;
    case DDP__OP_CHECK: {
      unsigned char all = 1;
      for (unsigned i = 0; i < m->nfields && all; i++) {
        all = key_exists(srv, m->field[i], m->len[i]);
      }
      reply_ok(srv, cl, &all, 1);
      return;
    }
    case DDP__OP_CSET: {
      const ddp__kv_entry_t *after = NULL;
      if (ddp__kv_cset(&srv->kv, key, klen, m->field[1], m->len[1], m->field[2], m->len[2],
                       &after) != DDP_OK) {
        reply_err(srv, cl, DDP_ERR_NO_MEMORY, "tcp store %s: out of memory", srv->addr);
      } else if (after) {
        reply_ok(srv, cl, after->val, (uint32_t)after->val_len);
      } else {
        reply_ok(srv, cl, "", 0);
      }
      return;
    }
    case DDP__OP_DELETE: {
      unsigned char d = ddp__kv_del(&srv->kv, key, klen);
      reply_ok(srv, cl, &d, 1);
      return;
    }
    case DDP__OP_NUMKEYS: reply_i64(srv, cl, (int64_t)srv->kv.count); return;
    default:
      snprintf(why, sizeof why, "unknown op %u", m->op);
      drop(srv, cl, why);
      return;
  }
}

/* Parks a PyTorch GET (one key) or WAIT: PyTorch's client keeps the time, so no deadline. */
static void park_torch(ddp__store_server_t *srv, client_t *cl, unsigned op,
                       const ddp__torch_req_t *r) {
  cl->wkeys = ddp__calloc(r->nstr, sizeof *cl->wkeys);
  for (size_t i = 0; cl->wkeys && i < r->nstr; i++) {
    cl->wkeys[i] = ddp__malloc(r->len[i] + 1);
    if (!cl->wkeys[i]) break;
    memcpy(cl->wkeys[i], r->str[i], r->len[i]);
    cl->wkeys[i][r->len[i]] = '\0';
    cl->nwkeys = i + 1;
  }
  if (!cl->wkeys || cl->nwkeys < r->nstr) {
    clear_wait(cl);
    drop(srv, cl, "out of memory parking a wait");
    return;
  }
  cl->wait_op = op;
  cl->wdeadline_ns = INT64_MAX;
  service_wait(srv, cl, ddp_now_ns());
}

/* PyTorch 1.13's compare_set: a missing key is set only when `expected` is empty, and the
 * reply is then `desired`; otherwise the reply is the value after the call, or `expected`
 * for a key that stays missing (what 1.13's server answers). */
static void torch_cset(ddp__store_server_t *srv, client_t *cl, const ddp__torch_req_t *r) {
  const char *key = (const char *)r->str[0];
  ddp__kv_entry_t *e = ddp__kv_find(&srv->tkv, key, r->len[0]);
  if (!e && r->len[1] != 0) {
    reply_torch(srv, cl, r->str[1], r->len[1], true);
    return;
  }
  if (!e || (e->val_len == r->len[1] && memcmp(e->val, r->str[1], r->len[1]) == 0)) {
    if (ddp__kv_put(&srv->tkv, key, r->len[0], r->str[2], r->len[2]) != DDP_OK) {
      drop(srv, cl, "out of memory in compare_set");
      return;
    }
    e = ddp__kv_find(&srv->tkv, key, r->len[0]);
  }
  reply_torch(srv, cl, e->val, e->val_len, true);
}

/* One PyTorch request (tcp_torch.c has the format), on the PyTorch clients' own keys. */
static void handle_torch(ddp__store_server_t *srv, client_t *cl, const ddp__torch_req_t *r) {
  char why[400];
  const char *key = r->nstr ? (const char *)r->str[0] : NULL;
  size_t klen = r->nstr ? r->len[0] : 0;
  unsigned char b[8];
  if (r->op <= DDP__TORCH_ADD || r->op == DDP__TORCH_DELETE_KEY) srv->mutations++;
  switch (r->op) {
    case DDP__TORCH_SET:
      if (ddp__kv_put(&srv->tkv, key, klen, r->str[1], r->len[1]) != DDP_OK)
        drop(srv, cl, "out of memory in set");
      return;
    case DDP__TORCH_COMPARE_SET: torch_cset(srv, cl, r); return;
    case DDP__TORCH_GET: park_torch(srv, cl, WAIT_TORCH_GET, r); return;
    case DDP__TORCH_WAIT: park_torch(srv, cl, WAIT_TORCH_WAIT, r); return;
    case DDP__TORCH_ADD: {
      int64_t v;
      char kcopy[DDP_STORE_MAX_KEY + 1];
      memcpy(kcopy, key, klen);
      kcopy[klen] = '\0';
      if (ddp__kv_add(&srv->tkv, kcopy, klen, r->delta, &v, why, sizeof why) != DDP_OK) {
        drop(srv, cl, why); /* PyTorch's server fails the same way: no error reply exists */
        return;
      }
      ddp__wire_put_u64(b, (uint64_t)v);
      reply_torch(srv, cl, b, 8, false);
      return;
    }
    case DDP__TORCH_CHECK: {
      unsigned char not_ready = 0;
      for (size_t i = 0; i < r->nstr && !not_ready; i++)
        not_ready = ddp__kv_find(&srv->tkv, (const char *)r->str[i], r->len[i]) == NULL;
      reply_torch(srv, cl, &not_ready, 1, false);
      return;
    }
    case DDP__TORCH_GETNUMKEYS:
      ddp__wire_put_u64(b, (uint64_t)srv->tkv.count);
      reply_torch(srv, cl, b, 8, false);
      return;
    case DDP__TORCH_DELETE_KEY:
      ddp__wire_put_u64(b, ddp__kv_del(&srv->tkv, key, klen) ? 1 : 0);
      reply_torch(srv, cl, b, 8, false);
      return;
    default: /* WATCH_KEY: C++ only in 1.13 (no Python binding); not served */
      drop(srv, cl, "PyTorch TCPStore WATCH_KEY is not served by this store");
      return;
  }
}

/* Handles every complete PyTorch request buffered for cl, unless it is parked. */
static void process_torch(ddp__store_server_t *srv, client_t *cl) {
  size_t off = 0, used = 0;
  char why[200];
  /* A parked GET or WAIT whose client sends again was given up (1.13's client makes one
   * request at a time; a timed-out store.wait leaves it here): dropped unanswered. */
  if (cl->wait_op >= WAIT_TORCH_GET && cl->in_len > 0) clear_wait(cl);
  ddp__torch_req_t *r = ddp__malloc(sizeof *r);
  if (!r) {
    drop(srv, cl, "out of memory parsing a request");
    return;
  }
  while (!cl->dead && !cl->closing && !cl->wait_op && off < cl->in_len) {
    int k = ddp__torch_parse(cl->in + off, cl->in_len - off, r, &used, why, sizeof why);
    if (k < 0) drop(srv, cl, why);
    if (k <= 0) break;
    handle_torch(srv, cl, r);
    off += used;
  }
  ddp__free(r);
  if (off) {
    memmove(cl->in, cl->in + off, cl->in_len - off);
    cl->in_len -= off;
  }
}

/* Handles every complete message buffered for cl, unless it is parked or closing. The first
 * byte tells the protocols apart: libddp's magic starts with 'D', PyTorch's requests with a
 * query type of 0 to 8. */
static void process_input(ddp__store_server_t *srv, client_t *cl) {
  size_t off = 0;
  char why[200];
  if (!cl->proto && cl->in_len > 0)
    cl->proto = srv->torch && cl->in[0] <= DDP__TORCH_LAST ? PROTO_TORCH : PROTO_DDP;
  if (cl->proto == PROTO_TORCH) {
    process_torch(srv, cl);
    return;
  }
  while (!cl->dead && !cl->closing && !cl->wait_op && cl->in_len - off >= DDP__WIRE_HDR) {
    ddp__wire_hdr_t h;
    if (!ddp__wire_parse_request_hdr(cl->in + off, &h, why, sizeof why)) {
      drop(srv, cl, why);
      break;
    }
    if (cl->in_len - off - DDP__WIRE_HDR < h.body_len) break;
    ddp__wire_msg_t *m = ddp__malloc(sizeof *m);
    if (!m) {
      drop(srv, cl, "out of memory parsing a request");
      break;
    }
    if (!ddp__wire_parse_body(&h, cl->in + off + DDP__WIRE_HDR, true, m, why, sizeof why)) {
      ddp__free(m);
      drop(srv, cl, why);
      break;
    }
    handle(srv, cl, m);
    ddp__free(m);
    off += DDP__WIRE_HDR + h.body_len;
  }
  if (off) {
    memmove(cl->in, cl->in + off, cl->in_len - off);
    cl->in_len -= off;
  }
}

/* Reads what the socket has. EOF or an error ends the connection; EOF inside a message is
 * logged as a half-sent message. */
static void read_client(ddp__store_server_t *srv, client_t *cl) {
  for (;;) {
    if (cl->in_cap - cl->in_len < READ_CHUNK) {
      size_t cap = cl->in_cap ? cl->in_cap * 2 : READ_CHUNK;
      while (cap - cl->in_len < READ_CHUNK) cap *= 2;
      unsigned char *b = ddp__realloc(cl->in, cap);
      if (!b) {
        drop(srv, cl, "out of memory buffering input");
        return;
      }
      cl->in = b;
      cl->in_cap = cap;
    }
    ssize_t r = recv(cl->fd, cl->in + cl->in_len, cl->in_cap - cl->in_len, 0);
    if (r > 0) {
      cl->in_len += (size_t)r;
      /* Validate as soon as a header is complete, before buffering a claimed body. */
      process_input(srv, cl);
      if (cl->dead) return;
      if (cl->wait_op && cl->in_len > READ_CHUNK) {
        drop(srv, cl, "sent more than 64 KiB while its wait was pending");
        return;
      }
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (r == 0) {
      if (cl->in_len && !cl->dead) {
        char why[120];
        snprintf(why, sizeof why, "closed mid-message with %zu bytes of an incomplete request",
                 cl->in_len);
        drop(srv, cl, why);
      }
    } else if (!cl->dead) {
      char why[120];
      snprintf(why, sizeof why, "recv: %s (errno %d)", strerror(errno), errno);
      drop(srv, cl, why);
    }
    cl->dead = true;
    return;
  }
}

static void flush_client(ddp__store_server_t *srv, client_t *cl) {
  while (cl->out_off < cl->out_len) {
    ssize_t w = send(cl->fd, cl->out + cl->out_off, cl->out_len - cl->out_off, MSG_NOSIGNAL);
    if (w > 0) {
      cl->out_off += (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (!cl->dead && !cl->closing) {
      char why[120];
      snprintf(why, sizeof why, "send: %s (errno %d)", strerror(errno), errno);
      drop(srv, cl, why);
    }
    cl->dead = true;
    return;
  }
  ddp__free(cl->out);
  cl->out = NULL;
  cl->out_len = cl->out_off = 0;
  if (cl->closing) cl->dead = true;
}

static void accept_clients(ddp__store_server_t *srv) {
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(srv->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        /* The pending connection stays queued; polling the listener now would spin. */
        srv->accept_resume_ns = ddp_deadline_after_ms(100);
        if (!srv->fd_limit_logged) {
          ddp__log(srv->rank, DDP_LOG_WARN,
                   "tcp store server %s: accept: %s (errno %d); %zu connections open", srv->addr,
                   strerror(errno), errno, srv->nclients);
          srv->fd_limit_logged = true;
        }
        return;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        ddp__log(srv->rank, DDP_LOG_WARN, "tcp store server %s: accept: %s (errno %d)", srv->addr,
                 strerror(errno), errno);
      }
      return;
    }
    srv->fd_limit_logged = false;
    char peer[80];
    format_peer((struct sockaddr *)&ss, sl, peer, sizeof peer);
    client_t *cl = srv->nclients < MAX_CLIENTS ? ddp__calloc(1, sizeof *cl) : NULL;
    if (!cl) {
      ddp__log(srv->rank, DDP_LOG_WARN,
               "tcp store server %s: refusing %s: %zu connections open or out of memory", srv->addr,
               peer, srv->nclients);
      close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    cl->fd = fd;
    memcpy(cl->peer, peer, sizeof peer);
    cl->next = srv->clients;
    srv->clients = cl;
    srv->nclients++;
    ddp__log(srv->rank, DDP_LOG_DETAIL, "tcp store server %s: connection from %s", srv->addr, peer);
  }
}

static void *server_main(void *arg) {
  ddp__store_server_t *srv = arg;
  for (;;) {
    /* When the poll set cannot grow, the clients past its end wait until it can. */
    size_t need = srv->nclients + 2;
    if (need > srv->pcap) {
      struct pollfd *p = ddp__realloc(srv->pfd, need * sizeof *p);
      if (p) {
        srv->pfd = p;
        srv->pcap = need;
      }
    }
    struct pollfd *pfd = srv->pfd;
    size_t pcap = srv->pcap;
    pfd[0] = (struct pollfd){srv->stop_fd, POLLIN, 0};
    bool accepting = ddp_now_ns() >= srv->accept_resume_ns;
    pfd[1] = (struct pollfd){accepting ? srv->lfd : -1, POLLIN, 0};
    size_t n = 2;
    int64_t next_deadline = accepting ? INT64_MAX : srv->accept_resume_ns;
    for (client_t *cl = srv->clients; cl && n < pcap; cl = cl->next) {
      short ev = POLLIN;
      if (cl->out_off < cl->out_len) ev |= POLLOUT;
      pfd[n++] = (struct pollfd){cl->fd, ev, 0};
      if (cl->wait_op && cl->wdeadline_ns < next_deadline) next_deadline = cl->wdeadline_ns;
    }
    int timeout = next_deadline == INT64_MAX ? -1 : ddp_ms_until(next_deadline);
    int r = poll(pfd, (nfds_t)n, timeout);
    if (r < 0 && errno != EINTR) {
      ddp__log(srv->rank, DDP_LOG_ERROR, "tcp store server %s: poll: %s (errno %d)", srv->addr,
               strerror(errno), errno);
    }
    if (r > 0 && (pfd[0].revents & POLLIN)) break;
    size_t i = 2;
    for (client_t *cl = srv->clients; cl && i < n; cl = cl->next, i++) {
      short rev = pfd[i].revents;
      if (rev & (POLLIN | POLLHUP | POLLERR)) read_client(srv, cl);
      if ((rev & POLLOUT) && !cl->dead) flush_client(srv, cl);
    }
    if (r > 0 && (pfd[1].revents & POLLIN)) accept_clients(srv);
    /* Parked clients may be answerable now (a set above) or past their deadline. An
     * answered client may have requests buffered behind its wait, and those may set keys
     * that clients earlier in the list wait for: repeat until a pass changes no key. */
    int64_t now = ddp_now_ns();
    uint64_t seen;
    do {
      seen = srv->mutations;
      for (client_t *cl = srv->clients; cl; cl = cl->next) {
        if (cl->dead) continue;
        if (cl->wait_op) service_wait(srv, cl, now);
        if (!cl->wait_op) process_input(srv, cl);
        if (cl->out_off < cl->out_len) flush_client(srv, cl);
      }
    } while (seen != srv->mutations);
    for (client_t **pp = &srv->clients; *pp;) {
      client_t *cl = *pp;
      if (cl->dead) {
        *pp = cl->next;
        srv->nclients--;
        client_free(cl);
      } else {
        pp = &cl->next;
      }
    }
  }
  return NULL;
}

/* The listening socket ddprun reserved for this job's store (DDP_STORE_LISTEN_FD, handed to
 * global rank 0 only): used when it is a listening TCP socket bound to `port`, so the port
 * never passes through a free state another job could take. -1 when there is none. */
static int inherited_listener(int port) {
  if (!ddp_env_is_set(DDP_ENV_STORE_LISTEN_FD)) return -1;
  int64_t v;
  if (ddp_env_int(DDP_ENV_STORE_LISTEN_FD, 0, INT32_MAX, &v, NULL) != DDP_OK) return -1;
  int fd = (int)v, listening = 0, type = 0;
  socklen_t n = sizeof listening, tn = sizeof type;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0 || !listening ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tn) != 0 || type != SOCK_STREAM ||
      getsockname(fd, (struct sockaddr *)&ss, &sl) != 0 ||
      (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
    return -1;
  int p = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                         : ((struct sockaddr_in *)&ss)->sin_port);
  if (p != port) return -1;
  fcntl(fd, F_SETFD, FD_CLOEXEC);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

/* Binds and listens on bind_host:port (the first address that works). */
static ddp_status_t bind_listener(ddp__store_server_t *srv, const char *bind_host, int port,
                                  ddp_error_t *err) {
  int rank = srv->rank;
  ddp_status_t st = DDP_OK;
  char pstr[16];
  snprintf(pstr, sizeof pstr, "%d", port);
  struct addrinfo hints = {0}, *ai = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gai = getaddrinfo(bind_host, pstr, &hints, &ai);
  if (gai != 0) {
    st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "tcp store server: cannot resolve %s: %s",
                    bind_host, gai_strerror(gai));
    return st;
  }
  int last_errno = 0;
  const char *last_call = "socket";
  for (struct addrinfo *a = ai; a && srv->lfd < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      last_call = "socket";
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      last_errno = errno;
      last_call = "bind";
      close(fd);
      continue;
    }
    if (listen(fd, 1024) != 0) {
      last_errno = errno;
      last_call = "listen";
      close(fd);
      continue;
    }
    srv->lfd = fd;
  }
  freeaddrinfo(ai);
  if (srv->lfd < 0) {
    st = ddp__error(err, rank, DDP_ERR_SYSTEM, "tcp store server: %s(%s:%d): %s (errno %d)",
                    last_call, bind_host, port, strerror(last_errno), last_errno);
    return st;
  }
  return st;
}

static void free_server(ddp__store_server_t *srv) {
  if (srv->lfd >= 0) close(srv->lfd);
  if (srv->stop_fd >= 0) close(srv->stop_fd);
  if (srv->kv.buckets) ddp__kv_fini(&srv->kv);
  if (srv->tkv.buckets) ddp__kv_fini(&srv->tkv);
  ddp__free(srv->pfd);
  ddp__free(srv->token);
  ddp__free(srv);
}

static ddp_status_t new_server(const char *token, int rank, ddp_error_t *err,
                               ddp__store_server_t **out) {
  ddp__store_server_t *srv = ddp__calloc(1, sizeof *srv);
  if (!srv) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "tcp store server: out of memory");
  srv->lfd = -1;
  srv->stop_fd = -1;
  srv->rank = rank;
  srv->token = ddp__strdup(token);
  srv->token_len = srv->token ? strlen(token) : 0;
  srv->pfd = ddp__calloc(2, sizeof *srv->pfd);
  srv->pcap = 2;
  if (!srv->token || !srv->pfd || ddp__kv_init(&srv->kv) != DDP_OK ||
      ddp__kv_init(&srv->tkv) != DDP_OK) {
    free_server(srv);
    return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "tcp store server: out of memory");
  }
  *out = srv;
  return DDP_OK;
}

static ddp_status_t run_server(ddp__store_server_t *srv, const char *bind_host, ddp_error_t *err,
                               ddp__store_server_t **out);
ddp_status_t ddp__store_server_start(const char *host, int port, const char *token, int rank,
                                     ddp_error_t *err, ddp__store_server_t **out) {
  ddp__store_server_t *srv = NULL;
  ddp_status_t st = new_server(token, rank, err, &srv);
  if (st != DDP_OK) return st;
  srv->lfd = inherited_listener(port);
  const char *bind_host = (host && *host) ? host : "0.0.0.0";
  if (srv->lfd < 0) DDP_CHECK_GOTO(bind_listener(srv, bind_host, port, err), st, fail);
  return run_server(srv, bind_host, err, out);
fail:
  free_server(srv);
  return st;
}

ddp_status_t ddp__store_server_start_fd(int lfd, const char *token, bool torch, int rank,
                                        ddp_error_t *err, ddp__store_server_t **out) {
  ddp__store_server_t *srv = NULL;
  ddp_status_t st = new_server(token, rank, err, &srv);
  if (st != DDP_OK) return close(lfd), st;
  srv->lfd = lfd;
  srv->torch = torch;
  fcntl(lfd, F_SETFD, FD_CLOEXEC);
  fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);
  return run_server(srv, "", err, out);
}

/* Names the server by its address and starts its thread; on failure frees it. */
static ddp_status_t run_server(ddp__store_server_t *srv, const char *bind_host, ddp_error_t *err,
                               ddp__store_server_t **out) {
  int rank = srv->rank;
  ddp_status_t st = DDP_OK;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(srv->lfd, (struct sockaddr *)&ss, &sl);
  srv->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
  if (!*bind_host) { /* a socket handed over: its own address */
    char host[NI_MAXHOST];
    if (getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, NULL, 0, NI_NUMERICHOST) != 0)
      snprintf(host, sizeof host, "?");
    snprintf(srv->addr, sizeof srv->addr, "%.64s:%d", host, srv->port);
  } else {
    snprintf(srv->addr, sizeof srv->addr, "%.64s:%d", bind_host, srv->port);
  }
  srv->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (srv->stop_fd < 0) {
    int e = errno;
    st = ddp__error(err, rank, DDP_ERR_SYSTEM, "tcp store server: eventfd: %s (errno %d)",
                    strerror(e), e);
    goto fail;
  }
  int pe = pthread_create(&srv->thread, NULL, server_main, srv);
  if (pe != 0) {
    st = ddp__error(err, rank, DDP_ERR_SYSTEM, "tcp store server: pthread_create: %s (errno %d)",
                    strerror(pe), pe);
    goto fail;
  }
  ddp__log(rank, DDP_LOG_INFO, "tcp store server listening on %s", srv->addr);
  *out = srv;
  return DDP_OK;
fail:
  free_server(srv);
  return st;
}

int ddp__store_server_port(const ddp__store_server_t *srv) { return srv->port; }

void ddp__store_server_stop(ddp__store_server_t *srv) {
  if (!srv) return;
  uint64_t one = 1;
  ssize_t w = write(srv->stop_fd, &one, sizeof one);
  (void)w;
  pthread_join(srv->thread, NULL);
  while (srv->clients) {
    client_t *cl = srv->clients;
    srv->clients = cl->next;
    client_free(cl);
  }
  close(srv->lfd);
  close(srv->stop_fd);
  ddp__kv_fini(&srv->kv);
  ddp__kv_fini(&srv->tkv);
  ddp__free(srv->pfd);
  ddp__free(srv->token);
  ddp__free(srv);
}
