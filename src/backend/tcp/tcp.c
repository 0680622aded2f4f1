/* The tcp backend: ranks anywhere, one full-duplex TCP connection per pair of ranks.
 *
 * Setup. Every rank listens on an ephemeral port and publishes "host port" in the store;
 * host is the address peers can reach it at (publish_host: an interface named by
 * DDP_SOCKET_IFNAME, else the local end of the store connection, else the hostname).
 * Rank i connects to every rank j < i and accepts one connection from every rank j > i;
 * dependencies only point down, so the mesh cannot deadlock. The connecting side sends a
 * hello (magic, rank, world, job token); the accepting side checks every field, answers
 * with a verdict, and drops bad connections (a wrong token is logged and the slot keeps
 * waiting for the real peer). Sockets are non-blocking with TCP_NODELAY and keepalives, and
 * with large socket buffers where the host allows them (otherwise the kernel's autotuning
 * stays on).
 *
 * Data. xfer() runs a batch of sends and receives at once; transfers to (or from) the same
 * peer run in batch order, one after the other on that stream. It writes and reads whatever each
 * socket accepts, handles partial transfers and EINTR, and polls all pending sockets plus an abort
 * eventfd (after a short window of retries that yield the CPU, YIELD_NS) until everything is done,
 * so sends and receives to all peers proceed concurrently and the algorithms' segments pipeline
 * through the socket buffers. A read of 0 bytes (FIN) or a reset names the peer rank and address;
 * the deadline names every peer still pending with its byte counts. A receive of zero bytes is a
 * probe: it fails if the peer's stream has ended without the goodbye byte that an orderly destroy
 * sends before closing, i.e. if the peer failed or aborted.
 *
 * Failure. fail() half-closes every connection (SHUT_WR): data already written still
 * arrives, then peers read end-of-file and fail at once instead of at their timeout.
 * abort() also wakes a blocked xfer through the eventfd.
 *
 * Blame. A rank that fails the group this way is alive; the culprit may be another rank
 * (the one whose connection it saw close, or the one it timed out waiting for), and a rank
 * that was not waiting on the culprit reads this rank's end-of-file first. So before the
 * half-close, fail() sends one byte of TCP urgent data (MSG_OOB, outside the byte stream:
 * the reader's ordinary receives skip it) holding the rank it blames. A reader that meets
 * end-of-file looks for that byte: present, the peer failed because of the rank it names,
 * and the message blames that rank first; absent, the peer itself exited (killed, crashed)
 * or aborted, and is blamed. A dead rank's kernel sends no urgent byte, so the blame
 * follows the chain of closures back to the rank that actually died. */
#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "backend/backends.h"
#include "common/common.h"

#define HELLO_MAGIC 0x64647074u /* "ddpt" */
#define TOKEN_MAX 256
#define ADDR_MAX 320
/* For this long after an xfer starts, a pending batch is retried with sched_yield between
 * attempts before it sleeps in poll(). A small message's reply usually arrives within
 * that window, and the poll sleep and wake-up it saves cost about 2 us of a 12-14 us
 * round trip on the 2-vCPU development host (more when the ranks run on separate CPUs).
 * Yielding, unlike a bare busy poll, hands the CPU to a runnable peer on the same CPU. */
#define YIELD_NS (50 * 1000)
/* How long a rank that read an end-of-file without an urgent byte waits for the other
 * connections to show who failed first (blame_of). */
#define BLAME_GRACE_MS 200
/* The same wait after a reset or a broken pipe. Shorter: both neighbours of a killed rank
 * see its connection reset, and each would wait the whole grace for the other to close
 * first. A live rank that fails closes its connections only after it saw the death, so by
 * the time its reset shows here the dead rank's own (closed earlier) almost always shows
 * too, or its urgent byte names the culprit. */
#define RESET_GRACE_MS 20

typedef struct hello {
  uint32_t magic;
  int32_t rank;
  int32_t world;
  uint32_t token_len;
  char token[TOKEN_MAX];
} hello_t;

typedef struct verdict {
  uint32_t magic;
  uint32_t code; /* 0 accepted, 1 wrong token, 2 wrong world or rank */
} verdict_t;

typedef struct tcp_state {
  int rank;
  int size;
  int *fds;               /* per peer; -1 for self */
  char (*addr)[ADDR_MAX]; /* "host:port" of each peer, for messages */
  int efd;                /* abort eventfd */
  atomic_bool failed;
  atomic_int blame;       /* the rank this rank's first failure blames; -1 = none yet */
  atomic_bool closed_out; /* fail() has run (or is running): it runs once */
} tcp_state_t;

static void tune(int fd) {
  int one = 1, idle = 10, intvl = 2, cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  /* A peer host that vanishes without a FIN (power loss, partition) is noticed after about
   * idle + intvl * cnt = 16 s of silence instead of at the operation timeout. */
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  FILE *f = fopen("/proc/sys/net/core/wmem_max", "r");
  long max = 0;
  if (f) {
    if (fscanf(f, "%ld", &max) != 1) max = 0;
    fclose(f);
  }
  if (max >= (1 << 20)) {
    int sz = (int)DDP_MIN(max, 8L << 20);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  }
}

static void nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/* Moves all n bytes before the deadline (setup only). */
static ddp_status_t io_all(int fd, void *buf, size_t n, bool is_send, int64_t deadline, int efd) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = is_send ? send(fd, (char *)buf + done, n - done, MSG_NOSIGNAL)
                        : recv(fd, (char *)buf + done, n - done, 0);
    if (r > 0) {
      done += (size_t)r;
      continue;
    }
    if (r == 0) return DDP_ERR_REMOTE;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return DDP_ERR_REMOTE;
    struct pollfd p = {fd, is_send ? POLLOUT : POLLIN, 0};
    int ms = ddp_ms_until(deadline);
    if (ms <= 0) return DDP_ERR_TIMEOUT;
    poll(&p, 1, DDP_MIN(ms, 100));
  }
  return DDP_OK;
}

static int connect_to(const char *host, const char *port, int64_t deadline, int *last_errno) {
  while (ddp_now_ns() < deadline) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0) {
      *last_errno = EHOSTUNREACH;
      usleep(50000);
      continue;
    }
    for (struct addrinfo *a = res; a; a = a->ai_next) {
      int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      nonblock(fd);
      tune(fd);
      int rc = connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        struct pollfd p = {fd, POLLOUT, 0};
        int ms = ddp_ms_until(deadline);
        if (poll(&p, 1, DDP_MIN(ms, 2000)) == 1) {
          int e = 0;
          socklen_t el = sizeof e;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
          rc = e ? -1 : 0;
          errno = e ? e : ETIMEDOUT;
        } else {
          rc = -1;
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        freeaddrinfo(res);
        return fd;
      }
      *last_errno = errno;
      close(fd);
    }
    freeaddrinfo(res);
    usleep(50000);
  }
  return -1;
}

/* The first address of one interface: IPv4, else IPv6 that is not link-local (peers
 * could not use that without a scope). False when the interface has neither. */
static bool iface_addr(const struct ifaddrs *all, const char *name, size_t len, char *out,
                       size_t cap) {
  static const int families[2] = {AF_INET, AF_INET6};
  for (int f = 0; f < 2; f++)
    for (const struct ifaddrs *i = all; i; i = i->ifa_next) {
      int want = families[f];
      if (!i->ifa_addr || i->ifa_addr->sa_family != want || strlen(i->ifa_name) != len ||
          memcmp(i->ifa_name, name, len) != 0)
        continue;
      socklen_t sl = want == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
      if (want == AF_INET6 &&
          IN6_IS_ADDR_LINKLOCAL(&((const struct sockaddr_in6 *)i->ifa_addr)->sin6_addr))
        continue;
      if (getnameinfo(i->ifa_addr, sl, out, (socklen_t)cap, NULL, 0, NI_NUMERICHOST) == 0)
        return true;
    }
  return false;
}

/* The address this rank publishes for its peers (host, numeric or a name), in order:
 * 1. DDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME: the address of the first listed interface
 *    that has one; none is an error, since the user asked for that network.
 * 2. The local address of the store connection: the one the kernel picked to reach node 0,
 *    so reachable from node 0's network. This is right where the hostname names another
 *    address (containers, network namespaces, a hostname bound to 127.0.1.1), and it is
 *    loopback exactly when the store is reached over loopback, i.e. all ranks share a host.
 * 3. The hostname, when it resolves (memory and file stores, whose ranks share a host, and
 *    a store server on a wildcard address, whose own connection is over loopback).
 * 4. 127.0.0.1. */
static ddp_status_t publish_host(ddp_store_t *store, int rank, char *host, size_t cap,
                                 const char **why, ddp_error_t *err) {
  ddp_env_id_t id = ddp_env_is_set(DDP_ENV_SOCKET_IFNAME) ? DDP_ENV_SOCKET_IFNAME
                                                          : DDP_ENV_GLOO_SOCKET_IFNAME;
  const char *names = ddp_env_get(id);
  if (*names) {
    struct ifaddrs *all = NULL;
    if (getifaddrs(&all) != 0) {
      int e = errno;
      return ddp__error(err, rank, DDP_ERR_SYSTEM, "rank %d: getifaddrs (for %s): %s (errno %d)",
                        rank, ddp_env_name(id), strerror(e), e);
    }
    bool found = false;
    for (const char *p = names; *p && !found;) {
      size_t len = strcspn(p, ",");
      found = len > 0 && iface_addr(all, p, len, host, cap);
      p += len + (p[len] == ',');
    }
    char have[256] = "";
    size_t o = 0;
    for (const struct ifaddrs *i = all; !found && i && o < sizeof have; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
        o += (size_t)snprintf(have + o, sizeof have - o, " %s", i->ifa_name);
    freeifaddrs(all);
    if (!found)
      return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                        "rank %d: %s=\"%s\": no such interface with an IPv4 or global IPv6 "
                        "address on this host (interfaces with IPv4:%s)",
                        rank, ddp_env_name(id), names, have[0] ? have : " none");
    *why = ddp_env_name(id);
    return DDP_OK;
  }
  *why = "the local end of the store connection";
  if (ddp_store_local_addr(store, host, cap)) return DDP_OK;
  *why = "no address found: loopback";
  snprintf(host, cap, "127.0.0.1");
  char name[256];
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_socktype = SOCK_STREAM;
  if (gethostname(name, sizeof name) == 0 && getaddrinfo(name, NULL, &hints, &res) == 0) {
    snprintf(host, cap, "%s", name);
    *why = "the hostname";
  }
  if (res) freeaddrinfo(res);
  return DDP_OK;
}

static void tcp_destroy(void *state) {
  tcp_state_t *s = state;
  if (!s) return;
  /* A goodbye byte before the FIN: peers that probe a connection (zero-byte receives in
   * xfer) tell this orderly end from a failure, whose fail() sends the FIN alone. Nobody
   * reads the byte; best effort (a failed connection refuses it). */
  if (s->fds)
    for (int j = 0; j < s->size; j++)
      if (s->fds[j] >= 0) {
        if (send(s->fds[j], "", 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) { /* failed or full */
        }
        close(s->fds[j]);
      }
  if (s->efd >= 0) close(s->efd);
  ddp__free(s->fds);
  ddp__free(s->addr);
  ddp__free(s);
}

/* tcp_create, step 1: a non-blocking listener on an ephemeral port of every interface
 * (dual-stack IPv6, else IPv4); *port is the port it got. */
static ddp_status_t listen_any(int rank, int W, int *lfd_out, int *port, ddp_error_t *err) {
  int lfd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in6 a6 = {0};
  a6.sin6_family = AF_INET6;
  a6.sin6_addr = in6addr_any;
  int zero = 0, one = 1;
  if (lfd >= 0) setsockopt(lfd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&a6, sizeof a6) != 0) {
    if (lfd >= 0) close(lfd);
    lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a4 = {0};
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a4, sizeof a4) != 0) {
      ddp_status_t st = ddp__error(err, rank, DDP_ERR_SYSTEM, "rank %d: socket/bind: %s (errno %d)",
                                   rank, strerror(errno), errno);
      if (lfd >= 0) close(lfd);
      return st;
    }
  }
  *lfd_out = lfd;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (listen(lfd, W + 8) != 0)
    return ddp__error(err, rank, DDP_ERR_SYSTEM, "rank %d: listen: %s (errno %d)", rank,
                      strerror(errno), errno);
  nonblock(lfd);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(lfd, (struct sockaddr *)&ss, &sl);
  *port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                   : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  return DDP_OK;
}

/* Step 2: "host port" under tcp/addr/<rank> in the store (publish_host picks host). */
static ddp_status_t publish_addr(const ddp_backend_init_t *in, int port, ddp_error_t *err) {
  int rank = in->rank;
  char host[256], me[ADDR_MAX], key[64];
  const char *why = "";
  DDP_CHECK(publish_host(in->store, rank, host, sizeof host, &why, err));
  ddp__log(rank, DDP_LOG_INFO, "tcp: peers will connect to %s:%d (from %s)", host, port, why);
  snprintf(me, sizeof me, "%s %d", host, port);
  snprintf(key, sizeof key, "tcp/addr/%d", rank);
  ddp_status_t st = ddp_store_set(in->store, key, me, strlen(me) + 1);
  if (st != DDP_OK)
    return ddp__backend_store_failed(in->store, st, err, "rank %d: publishing the tcp address",
                                     rank);
  return DDP_OK;
}

/* Step 3, for each rank j below this one: its address from the store, a connection, the
 * hello h, and j's verdict. */
static ddp_status_t connect_down(const ddp_backend_init_t *in, tcp_state_t *s, int j,
                                 const hello_t *h, int64_t deadline, ddp_error_t *err) {
  int rank = in->rank;
  char key[64];
  snprintf(key, sizeof key, "tcp/addr/%d", j);
  const char *k = key;
  int64_t left = (deadline - ddp_now_ns()) / 1000000;
  if (ddp_store_wait(in->store, &k, 1, left > 0 ? left : 0) != DDP_OK)
    return ddp__error_quiet(err, DDP_ERR_TIMEOUT, /* the store has logged its wait */
                            "rank %d: timed out after %lld ms waiting for rank %d to join the "
                            "tcp group (it never published its address)",
                            rank, (long long)in->timeout_ms, j);
  void *v = NULL;
  size_t n = 0;
  char peer[ADDR_MAX] = "", ph[256] = "", pp[16] = "";
  if (ddp_store_get(in->store, key, &v, &n) == DDP_OK && n > 0 && n <= sizeof peer)
    memcpy(peer, v, n);
  ddp_free(v);
  peer[sizeof peer - 1] = '\0';
  if (sscanf(peer, "%255s %15s", ph, pp) != 2)
    return ddp__error(err, rank, DDP_ERR_INVALID_DATA, "rank %d: bad address \"%s\" of rank %d",
                      rank, peer, j);
  snprintf(s->addr[j], ADDR_MAX, "%s:%s", ph, pp);
  int e = 0;
  int fd = connect_to(ph, pp, deadline, &e);
  if (fd < 0)
    return ddp__error(err, rank, DDP_ERR_TIMEOUT,
                      "rank %d: could not connect to rank %d at %s within %lld ms: %s (errno %d)",
                      rank, j, s->addr[j], (long long)in->timeout_ms, strerror(e), e);
  s->fds[j] = fd;
  verdict_t vd = {0, 0};
  if (io_all(fd, (void *)h, sizeof *h, true, deadline, -1) != DDP_OK ||
      io_all(fd, &vd, sizeof vd, false, deadline, -1) != DDP_OK || vd.magic != HELLO_MAGIC)
    return ddp__error(err, rank, DDP_ERR_REMOTE,
                      "rank %d: handshake with rank %d at %s failed (no answer before the "
                      "deadline, or the connection was closed)",
                      rank, j, s->addr[j]);
  if (vd.code != 0)
    return ddp__error(err, rank, vd.code == 1 ? DDP_ERR_INVALID_ARGUMENT : DDP_ERR_INVALID_USAGE,
                      "rank %d: rank %d at %s refused the connection: %s", rank, j, s->addr[j],
                      vd.code == 1 ? "wrong job token (DDP_JOB_TOKEN differs)"
                                   : "its world size differs");
  return DDP_OK;
}

/* Step 4: one connection from a rank above this one, checked against this rank's hello
 * (token, world); a bad one is answered, logged and dropped, and the slot keeps waiting.
 * Returns true when it filled a slot. */
static bool accept_one(tcp_state_t *s, int lfd, const hello_t *mine, int64_t deadline) {
  int rank = s->rank, W = s->size;
  struct sockaddr_storage pa;
  socklen_t pl = sizeof pa;
  int fd = accept4(lfd, (struct sockaddr *)&pa, &pl, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return false;
  tune(fd);
  char ph[128] = "?", pp[16] = "?";
  getnameinfo((struct sockaddr *)&pa, pl, ph, sizeof ph, pp, sizeof pp,
              NI_NUMERICHOST | NI_NUMERICSERV);
  /* The dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d; messages show a.b.c.d. */
  if (strncmp(ph, "::ffff:", 7) == 0 && strchr(ph + 7, '.'))
    memmove(ph, ph + 7, strlen(ph + 7) + 1);
  hello_t ph_ = {0};
  int64_t hd = DDP_MIN(deadline, ddp_deadline_after_ms(5000));
  verdict_t vd = {HELLO_MAGIC, 0};
  if (io_all(fd, &ph_, sizeof ph_, false, hd, -1) != DDP_OK || ph_.magic != HELLO_MAGIC) {
    ddp__log(rank, DDP_LOG_WARN, "dropped a connection from %s:%s: no valid hello", ph, pp);
    close(fd);
    return false;
  }
  if (ph_.token_len != mine->token_len || memcmp(ph_.token, mine->token, mine->token_len) != 0) {
    vd.code = 1;
  } else if (ph_.world != W || ph_.rank <= rank || ph_.rank >= W || s->fds[ph_.rank] >= 0) {
    vd.code = 2;
  }
  io_all(fd, &vd, sizeof vd, true, hd, -1);
  if (vd.code != 0) {
    ddp__log(rank, DDP_LOG_WARN, "refused a connection from %s:%s claiming rank %d: %s", ph, pp,
             (int)ph_.rank, vd.code == 1 ? "wrong job token" : "bad rank or world size");
    close(fd);
    return false;
  }
  s->fds[ph_.rank] = fd;
  snprintf(s->addr[ph_.rank], ADDR_MAX, "%s:%s", ph, pp);
  return true;
}

/* Step 4: every rank above this one connects; the deadline names those that did not. */
static ddp_status_t accept_up(tcp_state_t *s, int lfd, const hello_t *mine, int64_t deadline,
                              int64_t timeout_ms, ddp_error_t *err) {
  int rank = s->rank, W = s->size;
  int64_t start = ddp_now_ns(), next_report = start + (int64_t)DDP__WAIT_REPORT_MS * 1000000;
  for (int got = 0; got < W - 1 - rank;) {
    struct pollfd p = {lfd, POLLIN, 0};
    int ms = ddp_ms_until(deadline);
    char missing[256] = "";
    if (ms <= 0 || ddp_now_ns() >= next_report) {
      size_t o = 0;
      for (int j = rank + 1; j < W && o < sizeof missing; j++)
        if (s->fds[j] < 0) o += (size_t)snprintf(missing + o, sizeof missing - o, " %d", j);
    }
    if (ms > 0 && ddp_now_ns() >= next_report) {
      ddp__log(rank, DDP_LOG_WARN,
               "rank %d: waiting for rank(s)%s to connect (%lld s of the %lld s timeout)", rank,
               missing, (long long)((ddp_now_ns() - start) / 1000000000),
               (long long)(timeout_ms / 1000));
      next_report = ddp_now_ns() + (int64_t)DDP__WAIT_REPORT_MS * 1000000;
    }
    if (ms <= 0) {
      return ddp__error(err, rank, DDP_ERR_TIMEOUT,
                        "rank %d: timed out after %lld ms waiting for rank(s)%s to connect", rank,
                        (long long)timeout_ms, missing);
    }
    if (poll(&p, 1, DDP_MIN(ms, 100)) <= 0) continue;
    if (accept_one(s, lfd, mine, deadline)) got++;
  }
  return DDP_OK;
}

/* Setup (the file comment): listen, publish, connect down, accept from above, then the
 * common join. */
static ddp_status_t tcp_create(const ddp_backend_init_t *in, void **out, ddp_error_t *err) {
  int rank = in->rank, W = in->size, lfd = -1, port = 0;
  if (!in->store)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: the tcp backend needs a store for rendezvous", rank);
  size_t tlen = strlen(in->job_token ? in->job_token : "");
  if (tlen > TOKEN_MAX)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT, "job token longer than %d bytes",
                      TOKEN_MAX);
  int64_t deadline = ddp_deadline_after_ms(in->timeout_ms);
  tcp_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "tcp backend state");
  s->rank = rank;
  s->size = W;
  atomic_init(&s->blame, -1);
  atomic_init(&s->closed_out, false);
  s->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  s->fds = ddp__malloc((size_t)W * sizeof *s->fds);
  s->addr = ddp__calloc((size_t)W, sizeof *s->addr);
  ddp_status_t st = DDP_OK;
  if (!s->fds || !s->addr || s->efd < 0) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "tcp backend state");
    goto fail;
  }
  for (int j = 0; j < W; j++) s->fds[j] = -1;
  hello_t h = {HELLO_MAGIC, rank, W, (uint32_t)tlen, {0}};
  memcpy(h.token, in->job_token ? in->job_token : "", tlen);
  DDP_CHECK_GOTO(listen_any(rank, W, &lfd, &port, err), st, fail);
  DDP_CHECK_GOTO(publish_addr(in, port, err), st, fail);
  for (int j = 0; j < rank; j++)
    DDP_CHECK_GOTO(connect_down(in, s, j, &h, deadline, err), st, fail);
  DDP_CHECK_GOTO(accept_up(s, lfd, &h, deadline, in->timeout_ms, err), st, fail);
  close(lfd);
  lfd = -1;
  int64_t left = (deadline - ddp_now_ns()) / 1000000;
  DDP_CHECK_GOTO(ddp__backend_join(in->store, "tcp", rank, W, left > 0 ? left : 0, NULL, err), st,
                 fail);
  *out = s;
  return DDP_OK;
fail:
  if (lfd >= 0) close(lfd);
  tcp_destroy(s);
  return st;
}

/* Lists the other peers whose connections are closed too ("" if none). When a rank dies,
 * the neighbour that notices first fails and closes its own connections, so a third rank
 * may read that neighbour's end-of-file first; the dead rank's closed connection is then
 * already visible here and the message can name it. */
static void also_closed(tcp_state_t *s, int except, char *buf, size_t n) {
  size_t o = 0;
  buf[0] = '\0';
  for (int j = 0; j < s->size && o < n; j++) {
    if (j == s->rank || j == except || s->fds[j] < 0) continue;
    struct pollfd p = {s->fds[j], POLLRDHUP, 0};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)))
      o += (size_t)snprintf(buf + o, n - o, "%srank %d", o ? ", " : " (connections also closed by ",
                            j);
  }
  if (o && o < n) snprintf(buf + o, n - o, ")");
}

/* Records the rank this rank's failure blames (the first one wins). */
static void set_blame(tcp_state_t *s, int rank) {
  int none = -1;
  atomic_compare_exchange_strong(&s->blame, &none, rank);
}

/* The rank `peer` blamed in its urgent byte, or -1 when there is none (it sent none, or
 * this rank's reads went past it: Linux drops an urgent byte that an ordinary receive
 * reaches, which the receive that meets end-of-file always does). */
static int urgent_blame(tcp_state_t *s, int peer) {
  unsigned char b;
  if (recv(s->fds[peer], &b, 1, MSG_OOB | MSG_DONTWAIT) == 1 && b < s->size && b != s->rank)
    return b;
  return -1;
}

/* After end-of-file from `peer`: the rank that failed first. Its own urgent byte names it
 * when still readable. Otherwise the other connections that close decide, since this rank
 * has not read them to their end: one carrying an urgent byte belongs to a rank that failed
 * because of the rank it names; one that is reset (RST: a process that ended with data it
 * had not read, as a killed rank in a stream of collectives) belongs to a rank that exited.
 * A connection that ends in order without an urgent byte is weaker evidence: a failing
 * neighbour ends that way too when its urgent byte could not be sent (its send buffer stayed
 * full) or this rank's reads went past it, so it is blamed only if nothing better shows
 * within the grace period. A killed process closes its sockets one by one after its memory
 * is torn down, so a neighbour that saw one of them close may fail (and close its own)
 * before the dead rank's connection here shows its end: the other connections get up to
 * grace_ms to close, but never past the collective's own deadline: a rank whose neighbour
 * timed out a moment before it would otherwise fail up to the grace after its timeout. With
 * none closing, `peer` itself is blamed. */
static int blame_of(tcp_state_t *s, int peer, int grace_ms, int64_t deadline) {
  int b = urgent_blame(s, peer);
  if (b >= 0) return b;
  struct pollfd p[DDP_PG_MAX_WORLD];
  int idx[DDP_PG_MAX_WORLD], n = 0;
  for (int j = 0; j < s->size; j++)
    if (j != s->rank && j != peer && s->fds[j] >= 0) {
      p[n] = (struct pollfd){s->fds[j], POLLRDHUP, 0};
      idx[n++] = j;
    }
  int64_t end = DDP_MIN(ddp_deadline_after_ms(grace_ms), deadline);
  int orderly = -1; /* the first connection seen to end in order without an urgent byte */
  for (int open = n; open > 0;) {
    int ms = ddp_ms_until(end);
    if (poll(p, (nfds_t)n, DDP_MAX(ms, 0)) > 0)
      for (int i = 0; i < n; i++) {
        if (p[i].fd < 0 || !(p[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) continue;
        b = urgent_blame(s, idx[i]);
        if (b >= 0) return b;
        if (p[i].revents & POLLERR) return idx[i]; /* reset */
        if (orderly < 0) orderly = idx[i];
        p[i].fd = -1; /* seen: its later reset (when that rank exits) says nothing new */
        open--;
      }
    if (ms <= 0) break;
  }
  return orderly >= 0 ? orderly : peer;
}

/* The REMOTE error for a connection to `peer` that ended: end-of-file after done of bytes
 * (probe: a zero-byte receive), or, with e != 0, a send or receive that failed with errno e
 * (EPIPE, ECONNRESET: the peer's socket is gone). Either way the peer may only have failed
 * because of another rank, so the message blames the rank that actually failed first. */
static ddp_status_t lost_peer_error(tcp_state_t *s, int peer, bool is_send, int e, size_t done,
                                    size_t bytes, bool probe, int64_t deadline, ddp_error_t *err) {
  char others[160], how[128] = "";
  int culprit = blame_of(s, peer, e != 0 ? RESET_GRACE_MS : BLAME_GRACE_MS, deadline);
  set_blame(s, culprit);
  also_closed(s, culprit, others, sizeof others);
  if (e != 0)
    snprintf(how, sizeof how, "%s: %s (errno %d)", is_send ? "send to it" : "recv from it",
             strerror(e), e);
  else if (!probe)
    snprintf(how, sizeof how, " after %zu of %zu bytes", done, bytes);
  if (culprit == peer && e != 0)
    return ddp__error_quiet(err, DDP_ERR_REMOTE, "%s rank %d (%s): %s (errno %d)%s",
                            is_send ? "send to" : "recv from", peer, s->addr[peer], strerror(e), e,
                            others);
  if (culprit == peer)
    return ddp__error_quiet(err, DDP_ERR_REMOTE,
                            "rank %d (%s) closed the connection%s: it exited, failed or "
                            "aborted%s",
                            peer, s->addr[peer], how, others);
  return ddp__error_quiet(err, DDP_ERR_REMOTE,
                          "rank %d (%s) exited, failed or aborted, and rank %d (%s) failed "
                          "the group because of it (%s%s)%s",
                          culprit, s->addr[culprit], peer, s->addr[peer],
                          e != 0 ? "" : "closed its connection", how, others);
}

/* Whether transfer o is complete: its bytes, and a send's tail (a receive's tail is only
 * taken when it has arrived). */
static bool xfer_done(const ddp_xfer_t *o) {
  return o->done == o->bytes && (!o->is_send || !o->tail || o->tail_done == o->tail_bytes);
}

static ddp_status_t tcp_xfer(void *state, ddp_xfer_t *ops, size_t n, ddp_xfer_idle_t *idle,
                             int64_t deadline, ddp_error_t *err) {
  tcp_state_t *s = state;
  struct pollfd pfd[2 * DDP_PG_MAX_WORLD + 1];
  size_t map[2 * DDP_PG_MAX_WORLD];
  int64_t start = ddp_now_ns();
  for (size_t i = 0; i < n; i++) ops[i].done = ops[i].tail_done = 0;
  for (;;) {
    size_t pending = 0;
    /* [is_send] bit per peer: an earlier transfer on that stream is unfinished this pass. */
    uint64_t busy[2][DDP_PG_MAX_WORLD / 64] = {{0}};
    for (size_t i = 0; i < n; i++) {
      ddp_xfer_t *o = &ops[i];
      int fd = s->fds[o->peer];
      uint64_t *word = &busy[o->is_send][o->peer / 64], bit = 1ull << (o->peer % 64);
      /* A send's tail is part of the transfer: it is done when both are sent. */
      bool send_tail = o->is_send && o->tail;
      if (!xfer_done(o) && (*word & bit)) continue; /* polled through the earlier one */
      char probe;
      if (!o->is_send && o->bytes == 0 && recv(fd, &probe, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
        return lost_peer_error(s, o->peer, false, 0, 0, 0, true, deadline, err);
      while (!xfer_done(o)) {
        ssize_t r;
        size_t want = o->bytes - o->done;
        if (send_tail) { /* one call for what is left of both */
          struct iovec v[2] = {{(char *)o->buf + o->done, want},
                               {(char *)o->tail + o->tail_done, o->tail_bytes - o->tail_done}};
          struct msghdr m = {.msg_iov = want ? v : v + 1, .msg_iovlen = want ? 2 : 1};
          r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (r > (ssize_t)want) {
            o->tail_done += (size_t)r - want;
            r = (ssize_t)want;
            if (r == 0) continue;
          }
        } else if (o->is_send) {
          r = send(fd, (char *)o->buf + o->done, want, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else if (o->tail && o->tail_done < o->tail_bytes) {
          /* The tail shares the call: what arrived beyond the transfer's bytes lands there. */
          struct iovec v[2] = {{(char *)o->buf + o->done, want},
                               {(char *)o->tail + o->tail_done, o->tail_bytes - o->tail_done}};
          struct msghdr m = {.msg_iov = v, .msg_iovlen = 2};
          r = recvmsg(fd, &m, MSG_DONTWAIT);
          if (r > (ssize_t)want) {
            o->tail_done += (size_t)r - want;
            r = (ssize_t)want;
          }
        } else {
          r = recv(fd, (char *)o->buf + o->done, want, MSG_DONTWAIT);
        }
        if (r > 0) {
          o->done += (size_t)r;
          continue;
        }
        if (r == 0 && !o->is_send)
          return lost_peer_error(s, o->peer, false, 0, o->done, o->bytes, false, deadline, err);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (atomic_load(&s->failed))
          return ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d",
                                  s->rank);
        /* A reset or a broken pipe: the peer's socket is gone, but the peer may have
         * closed it because another rank died first (seen in the soak: a send to a live
         * neighbour that had just failed because of the killed rank). */
        return lost_peer_error(s, o->peer, o->is_send, errno, o->done, o->bytes, false, deadline,
                               err);
      }
      if (!xfer_done(o)) {
        *word |= bit;
        pfd[pending] = (struct pollfd){fd, (short)(o->is_send ? POLLOUT : POLLIN), 0};
        map[pending++] = i;
      }
    }
    if (pending == 0) return DDP_OK;
    /* tcp_abort sets `failed` before it signals efd, so a load here sees every abort that
     * could wake the poll below; reading efd instead cost a syscall on every pass. */
    if (atomic_load(&s->failed))
      return ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d", s->rank);
    int64_t now = ddp_now_ns();
    if (now >= deadline) {
      set_blame(s, ops[map[0]].peer);
      char who[512];
      size_t o = 0;
      who[0] = '\0';
      for (size_t k = 0; k < pending && o < sizeof who; k++) {
        ddp_xfer_t *x = &ops[map[k]];
        o += (size_t)snprintf(who + o, sizeof who - o, "%srank %d (%s, %s %zu of %zu bytes)",
                              k ? ", " : "", x->peer, s->addr[x->peer],
                              x->is_send ? "sent" : "received", x->done, x->bytes);
      }
      return ddp__error_quiet(err, DDP_ERR_TIMEOUT, "timed out after %lld ms waiting for %s",
                              (long long)((now - start) / 1000000), who);
    }
    if (idle && !idle->ran) { /* the caller's fold, while the kernel moves this batch */
      idle->ran = true;
      idle->fn(idle->arg);
      continue;
    }
    if (now - start < YIELD_NS) {
      sched_yield();
      continue;
    }
    pfd[pending] = (struct pollfd){s->efd, POLLIN, 0};
    poll(pfd, (nfds_t)pending + 1, DDP_MIN(ddp_ms_until(deadline), 1000));
  }
}

/* Runs once per group, whoever calls it first: an abort from another thread and the rank's
 * own failing collective (which the abort ends) both call it, and two urgent bytes on one
 * stream would break the blame. TCP keeps a single urgent mark, so the second byte moves
 * the first into the ordinary byte stream; a peer that then probes the connection reads
 * that byte as data, not the end-of-file, and completes a collective this rank aborted
 * (seen in the soak: test_abort_unblocks on tcp, about 1 run in 40). */
static void tcp_fail(void *state) {
  tcp_state_t *s = state;
  if (atomic_exchange(&s->closed_out, true)) return;
  set_blame(s, s->rank); /* no peer to blame: this rank failed (desync, abort) */
  unsigned char b = (unsigned char)atomic_load(&s->blame);
  for (int j = 0; j < s->size; j++) {
    if (s->fds[j] < 0) continue;
    /* The urgent byte, then the end-of-file. A full send buffer (the peer is not reading)
     * gets 50 ms to drain; without the byte the peer blames this rank. */
    const int flags = MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT;
    if (send(s->fds[j], &b, 1, flags) < 0 && errno == EAGAIN) {
      struct pollfd p = {s->fds[j], POLLOUT, 0};
      if (poll(&p, 1, 50) == 1 && send(s->fds[j], &b, 1, flags) < 0) { /* blames this rank */
      }
    }
    shutdown(s->fds[j], SHUT_WR);
  }
}

static void tcp_abort(void *state) {
  tcp_state_t *s = state;
  atomic_store(&s->failed, true);
  uint64_t one = 1;
  if (write(s->efd, &one, sizeof one) < 0) { /* already signalled */
  }
  tcp_fail(s);
}

const ddp_backend_ops_t ddp__backend_tcp = {
    .abi_version = DDP_BACKEND_ABI_VERSION,
    .name = "tcp",
    .family = DDP_BACKEND_LINK,
    .create = tcp_create,
    .destroy = tcp_destroy,
    .abort = tcp_abort,
    .mem_alloc = NULL,
    .mem_free = NULL,
    .shared = NULL,
    .xfer = tcp_xfer,
    .fail = tcp_fail,
    .stream = true,
};
