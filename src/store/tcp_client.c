/* The TCP store client (and, with is_server, the owner of the server thread).
 *
 * A handle keeps a pool of idle connections to the server. A call takes one (or opens a
 * new one), sends one request, reads one reply and puts the connection back; so calls from
 * many threads on one handle never queue behind each other's blocking GET or WAIT. A
 * connection that saw anything unexpected (an I/O error, a malformed reply, a local
 * timeout, a cancellation) is closed instead of returned: its request/reply pairing can no
 * longer be trusted.
 *
 * Opening a connection retries refused or unreachable connects with exponential backoff
 * (10 ms doubling to 1 s) until the call's deadline, so clients may start before the
 * server. The first message on every connection is HELLO with the protocol version and the
 * job token; a rejection is final (no retry).
 *
 * Blocking waits are timed by the server, which answers TIMEOUT naming the missing keys;
 * the client adds a grace period on top, so a server that never answers still ends the call.
 * Every socket wait is a poll() that also watches the cancel eventfds of the caller's view
 * chain, so ddp_store_cancel() ends it at once. */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "store/store_internal.h"

/* Extra time the client waits past a server-timed deadline before giving up on the reply. */
#define SERVER_GRACE_MS 2000
#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000
#define CONNECT_ATTEMPT_MS 5000

typedef struct tcp_store {
  char host[256];
  int port;
  char local[80]; /* numeric local address of the first connection; "" when not meaningful */
  char *token;
  ddp__store_server_t *server;
  pthread_mutex_t mu;
  int *idle;
  size_t nidle, cap;
} tcp_store_t;

static tcp_store_t *tst(ddp_store_t *s) { return s->impl; }

/* Waits until fd is ready for events, the deadline passes (DDP_ERR_TIMEOUT) or the call is
 * cancelled (DDP_ERR_ABORTED). Records no error: callers know what they were waiting for. */
static ddp_status_t wait_fd(const ddp__store_call_t *c, int fd, short events, int64_t deadline) {
  struct pollfd pfd[DDP_STORE_MAX_DEPTH + 2];
  for (;;) {
    pfd[0] = (struct pollfd){fd, events, 0};
    int n = 1 + ddp__store_cancel_pollfds(c, pfd + 1, DDP_STORE_MAX_DEPTH + 1);
    if (ddp__store_cancelled(c)) return DDP_ERR_ABORTED;
    int ms = ddp_ms_until(deadline);
    int r = poll(pfd, (nfds_t)n, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return DDP_ERR_SYSTEM;
    if (ddp__store_cancelled(c)) return DDP_ERR_ABORTED;
    if (pfd[0].revents) return DDP_OK;
    if (r == 0 || ddp_ms_until(deadline) == 0) return DDP_ERR_TIMEOUT;
  }
}

static ddp_status_t io_error(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                             const char *phase, ddp_status_t st, int e) {
  if (st == DDP_ERR_ABORTED) return ddp__store_aborted(c, what);
  if (st == DDP_ERR_TIMEOUT) {
    return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT, "%s on %s: no reply within %lld ms (%s)",
                      what, s->desc, (long long)c->timeout_ms, phase);
  }
  if (e == 0) {
    return ddp__error(c->err, c->rank, DDP_ERR_REMOTE,
                      "%s on %s: the server closed the connection (%s)", what, s->desc, phase);
  }
  return ddp__error(c->err, c->rank,
                    e == ECONNRESET || e == EPIPE ? DDP_ERR_REMOTE : DDP_ERR_SYSTEM,
                    "%s on %s: %s: %s (errno %d)", what, s->desc, phase, strerror(e), e);
}

static ddp_status_t send_all(ddp_store_t *s, const ddp__store_call_t *c, const char *what, int fd,
                             const unsigned char *p, size_t n, int64_t deadline) {
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ddp_status_t st = wait_fd(c, fd, POLLOUT, deadline);
      if (st != DDP_OK) return io_error(s, c, what, "sending the request", st, errno);
      continue;
    }
    return io_error(s, c, what, "send", DDP_ERR_SYSTEM, errno);
  }
  return DDP_OK;
}

static ddp_status_t recv_all(ddp_store_t *s, const ddp__store_call_t *c, const char *what, int fd,
                             unsigned char *p, size_t n, int64_t deadline) {
  while (n) {
    ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= (size_t)r;
      continue;
    }
    if (r == 0) return io_error(s, c, what, "reading the reply", DDP_ERR_REMOTE, 0);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      ddp_status_t st = wait_fd(c, fd, POLLIN, deadline);
      if (st != DDP_OK) return io_error(s, c, what, "waiting for the reply", st, errno);
      continue;
    }
    return io_error(s, c, what, "recv", DDP_ERR_SYSTEM, errno);
  }
  return DDP_OK;
}

/* One reply: its status code and body (ddp__malloc, parsed into m). */
typedef struct reply {
  ddp__wire_hdr_t h;
  unsigned char *body;
  ddp__wire_msg_t m;
} reply_t;

static ddp_status_t read_reply(ddp_store_t *s, const ddp__store_call_t *c, const char *what, int fd,
                               int64_t deadline, reply_t *rp) {
  unsigned char hdr[DDP__WIRE_HDR];
  char why[200];
  rp->body = NULL;
  DDP_CHECK(recv_all(s, c, what, fd, hdr, sizeof hdr, deadline));
  if (!ddp__wire_parse_response_hdr(hdr, &rp->h, why, sizeof why)) {
    return ddp__error(c->err, c->rank, DDP_ERR_INVALID_DATA, "%s on %s: malformed reply: %s", what,
                      s->desc, why);
  }
  rp->body = ddp__malloc(rp->h.body_len);
  if (!rp->body) return ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
  ddp_status_t st = recv_all(s, c, what, fd, rp->body, rp->h.body_len, deadline);
  if (st == DDP_OK && !ddp__wire_parse_body(&rp->h, rp->body, false, &rp->m, why, sizeof why)) {
    st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_DATA, "%s on %s: malformed reply: %s", what,
                    s->desc, why);
  }
  if (st != DDP_OK) {
    ddp__free(rp->body);
    rp->body = NULL;
  }
  return st;
}

/* Sends a request and reads its reply on fd. */
static ddp_status_t roundtrip(ddp_store_t *s, const ddp__store_call_t *c, const char *what, int fd,
                              unsigned op, unsigned nf, const void *const *f, const uint32_t *l,
                              int64_t deadline, reply_t *rp) {
  unsigned char *msg;
  size_t n;
  rp->body = NULL; /* stays NULL unless a reply is returned */
  if (ddp__wire_build(op, nf, f, l, &msg, &n) != DDP_OK) {
    return ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
  }
  ddp_status_t st = send_all(s, c, what, fd, msg, n, deadline);
  ddp__free(msg);
  if (st == DDP_OK) st = read_reply(s, c, what, fd, deadline, rp);
  return st;
}

/* Connects once to any address of host:port. Returns the fd, or -1 with *e set. */
static int connect_once(const ddp__store_call_t *c, const tcp_store_t *t, int64_t deadline, int *e,
                        const char **call, ddp_status_t *wait_st) {
  char pstr[16];
  snprintf(pstr, sizeof pstr, "%d", t->port);
  struct addrinfo hints = {0}, *ai = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  *wait_st = DDP_OK;
  int gai = getaddrinfo(t->host, pstr, &hints, &ai);
  if (gai != 0) {
    *e = gai == EAI_SYSTEM ? errno : EHOSTUNREACH;
    *call = "getaddrinfo";
    return -1;
  }
  int fd = -1;
  for (struct addrinfo *a = ai; a; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      *e = errno;
      *call = "socket";
      continue;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    if (errno == EINPROGRESS) {
      /* One attempt waits at most CONNECT_ATTEMPT_MS, so a silent address (SYNs dropped)
       * does not use up the whole deadline before the next address or retry. */
      int64_t cap = ddp_deadline_after_ms(CONNECT_ATTEMPT_MS);
      ddp_status_t st = wait_fd(c, fd, POLLOUT, cap < deadline ? cap : deadline);
      int soerr = 0;
      socklen_t sl = sizeof soerr;
      if (st == DDP_OK && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr == 0) {
        break;
      }
      *e = st == DDP_OK ? soerr : ETIMEDOUT;
      if (st == DDP_ERR_ABORTED) *wait_st = st;
    } else {
      *e = errno;
    }
    *call = "connect";
    close(fd);
    fd = -1;
    if (*wait_st != DDP_OK) break;
  }
  freeaddrinfo(ai);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

/* Opens a connection, retrying with backoff until the deadline, and presents the token. */
static ddp_status_t open_conn(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                              int *out) {
  tcp_store_t *t = tst(s);
  int backoff = BACKOFF_FIRST_MS;
  int attempts = 0;
  int e = 0;
  const char *call = "connect";
  int fd = -1;
  for (;;) {
    ddp_status_t wst;
    attempts++;
    fd = connect_once(c, t, c->deadline_ns, &e, &call, &wst);
    if (fd >= 0) break;
    if (wst == DDP_ERR_ABORTED || ddp__store_cancelled(c)) return ddp__store_aborted(c, what);
    if (ddp_ms_until(c->deadline_ns) == 0) {
      return ddp__error(c->err, c->rank, DDP_ERR_TIMEOUT,
                        "%s: could not connect to %s within %lld ms (%d attempts); last error: "
                        "%s: %s (errno %d)",
                        what, s->desc, (long long)c->timeout_ms, attempts, call, strerror(e), e);
    }
    ddp__log(c->rank, DDP_LOG_DETAIL, "%s: %s: %s; retrying in %d ms", s->desc, call, strerror(e),
             backoff);
    if (!ddp__store_sleep(c, backoff)) return ddp__store_aborted(c, what);
    backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
  }
  unsigned char ver[4];
  ddp__wire_put_u32(ver, DDP__WIRE_VERSION);
  const void *f[2] = {ver, t->token};
  uint32_t l[2] = {4, (uint32_t)strlen(t->token)};
  reply_t rp;
  ddp_status_t st = roundtrip(s, c, what, fd, DDP__OP_HELLO, 2, f, l, c->deadline_ns, &rp);
  if (st == DDP_OK && rp.h.code != DDP_OK) {
    char text[DDP_ERROR_MSG_MAX];
    int tl = rp.m.nfields ? (int)DDP_MIN(rp.m.len[0], sizeof text - 1) : 0;
    if (tl) memcpy(text, rp.m.field[0], (size_t)tl);
    text[tl] = '\0';
    if (strstr(text, "job token")) {
      st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_USAGE,
                      "%s: %s rejected this client's job token (opts.job_token / DDP_JOB_TOKEN "
                      "differ from the server's): server says \"%s\"",
                      what, s->desc, text);
    } else {
      st = ddp__error(c->err, c->rank, DDP_ERR_INVALID_USAGE,
                      "%s: %s refused the connection: server says \"%s\"", what, s->desc, text);
    }
  }
  ddp__free(rp.body);
  if (st != DDP_OK) {
    close(fd);
    return st;
  }
  *out = fd;
  return DDP_OK;
}

static ddp_status_t take_conn(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                              int *fd) {
  tcp_store_t *t = tst(s);
  pthread_mutex_lock(&t->mu);
  if (t->nidle) {
    *fd = t->idle[--t->nidle];
    pthread_mutex_unlock(&t->mu);
    return DDP_OK;
  }
  pthread_mutex_unlock(&t->mu);
  return open_conn(s, c, what, fd);
}

static void give_conn(ddp_store_t *s, int fd) {
  tcp_store_t *t = tst(s);
  pthread_mutex_lock(&t->mu);
  if (t->nidle == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 4;
    int *p = ddp__realloc(t->idle, cap * sizeof *p);
    if (!p) {
      pthread_mutex_unlock(&t->mu);
      close(fd);
      return;
    }
    t->idle = p;
    t->cap = cap;
  }
  t->idle[t->nidle++] = fd;
  pthread_mutex_unlock(&t->mu);
}

/* One request on a pooled connection. A reply with an error status becomes this call's
 * error (its text is the server's); the connection stays pooled after any complete reply. */
static ddp_status_t request(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                            unsigned op, unsigned nf, const void *const *f, const uint32_t *l,
                            bool server_timed, reply_t *rp) {
  int fd;
  DDP_CHECK(take_conn(s, c, what, &fd));
  int64_t deadline = c->deadline_ns;
  if (server_timed && deadline != INT64_MAX) {
    deadline = deadline > INT64_MAX - SERVER_GRACE_MS * 1000000LL
                   ? INT64_MAX
                   : deadline + SERVER_GRACE_MS * 1000000LL;
  }
  ddp_status_t st = roundtrip(s, c, what, fd, op, nf, f, l, deadline, rp);
  if (st != DDP_OK) {
    close(fd);
    return st;
  }
  give_conn(s, fd);
  if (rp->h.code != DDP_OK) {
    int tl = rp->m.nfields ? (int)rp->m.len[0] : 0;
    const char *text = rp->m.nfields ? (const char *)rp->m.field[0] : "";
    /* The server's text already names the operation, the store and the keys. */
    st = ddp__error(c->err, c->rank, (ddp_status_t)rp->h.code, "%.*s", tl, text);
    ddp__free(rp->body);
    rp->body = NULL;
    return st;
  }
  return DDP_OK;
}

static ddp_status_t bad_reply(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                              reply_t *rp) {
  ddp__free(rp->body);
  return ddp__error(c->err, c->rank, DDP_ERR_INVALID_DATA,
                    "%s on %s: reply of unexpected shape (%u fields)", what, s->desc,
                    rp->m.nfields);
}

static uint64_t wire_timeout(const ddp__store_call_t *c) {
  return c->timeout_ms < 0 ? UINT64_MAX : (uint64_t)c->timeout_ms;
}

static ddp_status_t tcp_set(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            const void *v, size_t n) {
  const void *f[2] = {key, v};
  uint32_t l[2] = {(uint32_t)strlen(key), (uint32_t)n};
  reply_t rp;
  DDP_CHECK(request(s, c, "set", DDP__OP_SET, 2, f, l, false, &rp));
  ddp__free(rp.body);
  return DDP_OK;
}

static ddp_status_t tcp_get(ddp_store_t *s, const ddp__store_call_t *c, const char *key, void **v,
                            size_t *n) {
  unsigned char to[8];
  ddp__wire_put_u64(to, wire_timeout(c));
  const void *f[2] = {key, to};
  uint32_t l[2] = {(uint32_t)strlen(key), 8};
  reply_t rp;
  DDP_CHECK(request(s, c, "get", DDP__OP_GET, 2, f, l, true, &rp));
  if (rp.m.nfields != 1) return bad_reply(s, c, "get", &rp);
  *v = ddp__store_dup_value(rp.m.field[0], rp.m.len[0]);
  *n = rp.m.len[0];
  ddp__free(rp.body);
  if (!*v) return ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "get: out of memory");
  return DDP_OK;
}

static ddp_status_t tcp_add(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            int64_t delta, int64_t *result) {
  unsigned char d[8];
  ddp__wire_put_u64(d, (uint64_t)delta);
  const void *f[2] = {key, d};
  uint32_t l[2] = {(uint32_t)strlen(key), 8};
  reply_t rp;
  DDP_CHECK(request(s, c, "add", DDP__OP_ADD, 2, f, l, false, &rp));
  if (rp.m.nfields != 1 || rp.m.len[0] != 8) return bad_reply(s, c, "add", &rp);
  *result = (int64_t)ddp__wire_get_u64(rp.m.field[0]);
  ddp__free(rp.body);
  return DDP_OK;
}

/* Fields for WAIT and CHECK: [timeout] key... */
static ddp_status_t keys_request(ddp_store_t *s, const ddp__store_call_t *c, const char *what,
                                 unsigned op, const char *const *keys, size_t nkeys, reply_t *rp) {
  unsigned char to[8];
  ddp__wire_put_u64(to, wire_timeout(c));
  unsigned first = op == DDP__OP_WAIT ? 1 : 0;
  size_t nf = nkeys + first;
  const void **f = ddp__malloc((nf ? nf : 1) * sizeof *f);
  uint32_t *l = ddp__malloc((nf ? nf : 1) * sizeof *l);
  if (!f || !l) {
    ddp__free(f);
    ddp__free(l);
    return ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "%s: out of memory", what);
  }
  if (first) {
    f[0] = to;
    l[0] = 8;
  }
  for (size_t i = 0; i < nkeys; i++) {
    f[first + i] = keys[i];
    l[first + i] = (uint32_t)strlen(keys[i]);
  }
  ddp_status_t st = request(s, c, what, op, (unsigned)nf, f, l, op == DDP__OP_WAIT, rp);
  ddp__free(f);
  ddp__free(l);
  return st;
}

static ddp_status_t tcp_wait(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                             size_t nkeys) {
  reply_t rp;
  DDP_CHECK(keys_request(s, c, "wait", DDP__OP_WAIT, keys, nkeys, &rp));
  ddp__free(rp.body);
  return DDP_OK;
}

static ddp_status_t tcp_check(ddp_store_t *s, const ddp__store_call_t *c, const char *const *keys,
                              size_t nkeys, bool *all) {
  reply_t rp;
  DDP_CHECK(keys_request(s, c, "check", DDP__OP_CHECK, keys, nkeys, &rp));
  if (rp.m.nfields != 1 || rp.m.len[0] != 1) return bad_reply(s, c, "check", &rp);
  *all = rp.m.field[0][0] != 0;
  ddp__free(rp.body);
  return DDP_OK;
}

static ddp_status_t tcp_cset(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                             const void *exp, size_t exp_n, const void *des, size_t des_n,
                             void **actual, size_t *actual_n) {
  const void *f[3] = {key, exp, des};
  uint32_t l[3] = {(uint32_t)strlen(key), (uint32_t)exp_n, (uint32_t)des_n};
  reply_t rp;
  DDP_CHECK(request(s, c, "compare_set", DDP__OP_CSET, 3, f, l, false, &rp));
  if (rp.m.nfields != 1) return bad_reply(s, c, "compare_set", &rp);
  *actual = ddp__store_dup_value(rp.m.field[0], rp.m.len[0]);
  *actual_n = rp.m.len[0];
  ddp__free(rp.body);
  if (!*actual) return ddp__error(c->err, c->rank, DDP_ERR_NO_MEMORY, "compare_set: out of memory");
  return DDP_OK;
}

static ddp_status_t tcp_del(ddp_store_t *s, const ddp__store_call_t *c, const char *key,
                            bool *deleted) {
  const void *f[1] = {key};
  uint32_t l[1] = {(uint32_t)strlen(key)};
  reply_t rp;
  DDP_CHECK(request(s, c, "delete", DDP__OP_DELETE, 1, f, l, false, &rp));
  if (rp.m.nfields != 1 || rp.m.len[0] != 1) return bad_reply(s, c, "delete", &rp);
  *deleted = rp.m.field[0][0] != 0;
  ddp__free(rp.body);
  return DDP_OK;
}

static ddp_status_t tcp_num_keys(ddp_store_t *s, const ddp__store_call_t *c, int64_t *n) {
  reply_t rp;
  DDP_CHECK(request(s, c, "num_keys", DDP__OP_NUMKEYS, 0, NULL, NULL, false, &rp));
  if (rp.m.nfields != 1 || rp.m.len[0] != 8) return bad_reply(s, c, "num_keys", &rp);
  *n = (int64_t)ddp__wire_get_u64(rp.m.field[0]);
  ddp__free(rp.body);
  return DDP_OK;
}

static int tcp_port(const ddp_store_t *s) {
  const tcp_store_t *t = s->impl;
  return t->server ? ddp__store_server_port(t->server) : -1;
}

static void tcp_destroy(ddp_store_t *s) {
  tcp_store_t *t = tst(s);
  if (!t) return;
  for (size_t i = 0; i < t->nidle; i++) close(t->idle[i]);
  ddp__free(t->idle);
  ddp__store_server_stop(t->server);
  pthread_mutex_destroy(&t->mu);
  ddp__free(t->token);
  ddp__free(t);
  s->impl = NULL;
}

const ddp__store_ops_t ddp__store_tcp_ops = {
    .kind = "tcp",
    .set = tcp_set,
    .get = tcp_get,
    .add = tcp_add,
    .wait = tcp_wait,
    .check = tcp_check,
    .compare_set = tcp_cset,
    .del = tcp_del,
    .num_keys = tcp_num_keys,
    .wake = NULL,
    .port = tcp_port,
    .destroy = tcp_destroy,
};

static ddp_status_t create_tcp(const char *host, int port, bool is_server,
                               const ddp_store_options_t *opts, ddp_error_t *err,
                               ddp_store_t **out) {
  ddp_store_t *s = NULL;
  ddp_store_options_t o;
  DDP_CHECK(ddp__store_new(opts, &ddp__store_tcp_ops, &o, err, &s));
  int rank = s->rank;
  ddp_status_t st = DDP_OK;
  if (port == -1) {
    int64_t p = 0;
    st = ddp_env_int(DDP_ENV_MASTER_PORT, 1, 65535, &p, err);
    if (st != DDP_OK) {
      ddp__store_free(s);
      return st;
    }
    port = (int)p;
  }
  if (port < 0 || port > 65535 || (port == 0 && !is_server)) {
    ddp__store_free(s);
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_tcp: port %d is not in 1..65535 (0 only for a server)",
                      port);
  }
  const char *tok = o.job_token ? o.job_token : ddp_env_get(DDP_ENV_JOB_TOKEN);
  if (strlen(tok) > DDP__WIRE_MAX_TOKEN) {
    ddp__store_free(s);
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "ddp_store_create_tcp: the job token is longer than %d bytes",
                      DDP__WIRE_MAX_TOKEN);
  }
  tcp_store_t *t = ddp__calloc(1, sizeof *t);
  if (!t || !(t->token = ddp__strdup(tok))) {
    ddp__free(t);
    ddp__store_free(s);
    return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "ddp_store_create_tcp: out of memory");
  }
  pthread_mutex_init(&t->mu, NULL);
  s->impl = t;
  if (is_server) {
    st = ddp__store_server_start(host, port, tok, rank, err, &t->server);
    if (st != DDP_OK) {
      ddp_store_destroy(s);
      return st;
    }
    port = ddp__store_server_port(t->server);
  }
  /* The server's own client reaches it over loopback when it listens on every interface. */
  const char *chost = host && *host ? host
                                    : (is_server ? "127.0.0.1" : ddp_env_get(DDP_ENV_MASTER_ADDR));
  bool wildcard = (!(host && *host) && is_server) || strcmp(chost, "0.0.0.0") == 0 ||
                  strcmp(chost, "::") == 0;
  if (strcmp(chost, "0.0.0.0") == 0) chost = "127.0.0.1";
  if (strcmp(chost, "::") == 0) chost = "::1";
  snprintf(t->host, sizeof t->host, "%s", chost);
  t->port = port;
  snprintf(s->desc, sizeof s->desc, "tcp store %.100s:%d", chost, port);
  /* Connect once now: a wrong address or token fails here, not at the first set. */
  ddp__store_call_t c = {s, ddp_deadline_after_ms(s->timeout_ms), s->timeout_ms, err, rank};
  int fd;
  st = open_conn(s, &c, "ddp_store_create_tcp", &fd);
  if (st != DDP_OK) {
    ddp_store_destroy(s);
    return st;
  }
  /* The address the kernel picked to reach the server, for ddp_store_local_addr. A
   * server's own client that reaches its wildcard listener over loopback learns nothing
   * about how other hosts reach this one. */
  struct sockaddr_storage la;
  socklen_t ll = sizeof la;
  if (!wildcard && getsockname(fd, (struct sockaddr *)&la, &ll) == 0 &&
      getnameinfo((struct sockaddr *)&la, ll, t->local, sizeof t->local, NULL, 0, NI_NUMERICHOST) !=
          0)
    t->local[0] = '\0';
  give_conn(s, fd);
  *out = s;
  return DDP_OK;
}

bool ddp_store_local_addr(const ddp_store_t *s, char *buf, size_t cap) {
  DDP_REQUIRE(s && s->magic == DDP__STORE_MAGIC && buf && cap > 0);
  const ddp_store_t *r = s->root;
  buf[0] = '\0';
  if (r->ops != &ddp__store_tcp_ops || !r->impl) return false;
  const tcp_store_t *t = r->impl;
  if (!t->local[0] || strlen(t->local) >= cap) return false;
  memcpy(buf, t->local, strlen(t->local) + 1);
  return true;
}

ddp_status_t ddp_store_create_tcp(const char *host, int port, bool is_server,
                                  const ddp_store_options_t *opts, ddp_store_t **out,
                                  ddp_error_t *err) {
  DDP_REQUIRE(out != NULL);
  *out = NULL;
  return create_tcp(host, port, is_server, opts, err, out);
}
