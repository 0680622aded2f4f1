/* ddprun's resources of a job outside its ranks: the store's port, reserved on node 0
 * before any rank starts, the store served on it, and the shared-memory segments a stopped
 * rank left behind. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <netinet/in.h>
#include <unistd.h>

#include "ddprun.h"

/* Binds and listens on host:port (0: any free port) with SO_REUSEADDR, as the store server
 * does, so a port held only by connections in TIME_WAIT is taken and one another store
 * listens on is refused (EADDRINUSE). Returns the socket or -1 with errno set. */
static int bind_listen(const char *host, int port, int *bound_port) {
  char pstr[16];
  snprintf(pstr, sizeof pstr, "%d", port);
  struct addrinfo hints = {0}, *ai = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gai = getaddrinfo(host, pstr, &hints, &ai);
  if (gai != 0) {
    errno = EADDRNOTAVAIL;
    return -1;
  }
  int fd = -1, e = EADDRNOTAVAIL;
  for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      e = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
      e = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(ai);
  if (fd < 0) {
    errno = e;
    return -1;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  *bound_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
  return fd;
}

int reserve_port(options_t *o, int *fd) {
  *fd = -1;
  if (o->node_rank != 0) return 0;
  int port = o->master_port, got = 0;
  int s = bind_listen(o->master_addr, port, &got);
  if (s < 0 && errno == EADDRINUSE && o->port_auto && port != 0)
    s = bind_listen(o->master_addr, 0, &got); /* a restart: any free port will do */
  if (s >= 0) {
    o->master_port = got;
    *fd = s;
    if (o->no_reserve) { /* only the port number was wanted (or the check) */
      close(s);
      *fd = -1;
    }
    return 0;
  }
  int e = errno;
  if (e == EADDRINUSE) {
    say("port %d on %s is in use: another job's store (or another program) listens there. "
        "Two jobs must not share a port: with the same DDP_JOB_TOKEN their ranks would join "
        "each other's group. Use --standalone (a free port) or another --master_port",
        port, o->master_addr);
    return EXIT_LAUNCH;
  }
  if (port == 0) {
    say("cannot reserve a free port on %s for the store: %s (errno %d)", o->master_addr,
        strerror(e), e);
    return EXIT_LAUNCH;
  }
  /* master_addr is not an address of this host (a name for it behind NAT, say): rank 0
   * binds the store itself, as before ports were reserved. */
  return 0;
}

void remove_shm_leftovers(const rank_proc_t *r) {
  char prefix[64];
  int plen = snprintf(prefix, sizeof prefix, "ddp-%u-%d-", (unsigned)getuid(), (int)r->pid);
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, (size_t)plen) != 0) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) == 0)
      say("removed /dev/shm/%s, left by rank %d (pid %d) when it was stopped", e->d_name, r->rank,
          (int)r->pid);
  }
  closedir(d);
}

int serve_store(launcher_t *L) {
  L->store = NULL;
  if (L->listen_fd < 0) return 0;
  int fd = L->listen_fd;
  L->listen_fd = -1; /* the server's now, closed when it stops */
  ddp_error_t err = {DDP_OK, ""};
  if (ddp_store_serve_fd(fd, L->token, true, &L->store, &err) != DDP_OK) {
    say("cannot serve the store on %s:%d: %s", L->opt.master_addr, L->opt.master_port, err.msg);
    return EXIT_LAUNCH;
  }
  return 0;
}

bool agent_store(const launcher_t *L) {
  if (L->opt.no_reserve) return false;
  return L->opt.node_rank != 0 || L->store != NULL;
}
