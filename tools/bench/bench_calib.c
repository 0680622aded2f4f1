/* ddp-bench's reference lines: what this machine can do without libddp, measured in the same
 * run as the collectives so that ratios are not fooled by a slow or fast day (spec
 * collectives.md §7.3: runs vary by about 1.5x).
 *
 * - memcpy bandwidth, 1 thread: copy `bytes` from one buffer to another, reps times; the
 *   median of bytes / time. Both buffers are written first so no page fault is timed.
 * - memcpy bandwidth, 2 threads: each thread copies its own half; a rep lasts until the
 *   slower thread finishes; bytes / that time, median over reps.
 * - TCP loopback bandwidth: one connection on 127.0.0.1, a sender thread writing 4 MiB
 *   blocks, the caller reading; bytes / (last byte read - first write started).
 * - TCP round trip: a fresh connection with TCP_NODELAY, 8 bytes each way, blocking reads;
 *   p50 and p99 over the timed round trips after a warm-up.
 * Every socket carries 10 s send and receive timeouts, so a stuck peer ends the line. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench.h"
#include "ddp/common.h"

#define CALIB_REPS 5
#define TCP_BLOCK (4u << 20)
#define RTT_WARMUP 200
#define RTT_ITERS 2000
#define SOCK_TIMEOUT_S 10

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_percentile(const double *sorted, int n, double p) {
  if (n <= 0) return 0.0;
  int k = (int)((p / 100.0) * n + 0.999999999);
  if (k < 1) k = 1;
  if (k > n) k = n;
  return sorted[k - 1];
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return bench_percentile(v, n, 50.0);
}

/* ---- memcpy ---- */

typedef struct copy_job {
  unsigned char *dst;
  const unsigned char *src;
  size_t len;
  pthread_barrier_t *start;
  int64_t ns;
} copy_job_t;

static void *copy_thread(void *arg) {
  copy_job_t *j = arg;
  pthread_barrier_wait(j->start);
  int64_t t0 = ddp_now_ns();
  memcpy(j->dst, j->src, j->len);
  j->ns = ddp_now_ns() - t0;
  return NULL;
}

static int measure_memcpy(unsigned char *dst, const unsigned char *src, size_t bytes, int nthreads,
                          double *gbs) {
  double rate[CALIB_REPS];
  for (int rep = 0; rep < CALIB_REPS; rep++) {
    if (nthreads == 1) {
      int64_t t0 = ddp_now_ns();
      memcpy(dst, src, bytes);
      rate[rep] = (double)bytes / (double)(ddp_now_ns() - t0);
      continue;
    }
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, 2);
    copy_job_t job[2];
    pthread_t th[2];
    size_t half = bytes / 2;
    for (int t = 0; t < 2; t++) {
      job[t] = (copy_job_t){dst + t * half, src + t * half, half, &start, 0};
      if (pthread_create(&th[t], NULL, copy_thread, &job[t]) != 0) {
        fprintf(stderr, "ddp-bench: memcpy calibration: pthread_create failed\n");
        if (t == 1) {
          /* The first thread waits at the barrier for its partner: be that partner. */
          pthread_barrier_wait(&start);
          pthread_join(th[0], NULL);
        }
        pthread_barrier_destroy(&start);
        return -1;
      }
    }
    pthread_join(th[0], NULL);
    pthread_join(th[1], NULL);
    pthread_barrier_destroy(&start);
    int64_t ns = job[0].ns > job[1].ns ? job[0].ns : job[1].ns;
    rate[rep] = (double)(2 * half) / (double)ns;
  }
  *gbs = median(rate, CALIB_REPS);
  return 0;
}

/* ---- TCP loopback ---- */

static int set_timeouts(int fd) {
  struct timeval tv = {SOCK_TIMEOUT_S, 0};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) return -1;
  if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) return -1;
  return 0;
}

/* A connected pair of sockets over 127.0.0.1 (*a = connecting side, *b = accepted side). */
static int tcp_pair(int *a, int *b, int nodelay) {
  int ls = -1, c = -1, s = -1;
  struct sockaddr_in addr = {0};
  socklen_t alen = sizeof addr;
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ls < 0 || bind(ls, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(ls, 1) != 0 ||
      getsockname(ls, (struct sockaddr *)&addr, &alen) != 0) {
    fprintf(stderr, "ddp-bench: loopback calibration: listen on 127.0.0.1: %s (errno %d)\n",
            strerror(errno), errno);
    goto fail;
  }
  c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0 || set_timeouts(c) != 0 || connect(c, (struct sockaddr *)&addr, sizeof addr) != 0) {
    fprintf(stderr, "ddp-bench: loopback calibration: connect: %s (errno %d)\n", strerror(errno),
            errno);
    goto fail;
  }
  s = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
  if (s < 0 || set_timeouts(s) != 0) {
    fprintf(stderr, "ddp-bench: loopback calibration: accept: %s (errno %d)\n", strerror(errno),
            errno);
    goto fail;
  }
  if (nodelay) {
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  close(ls);
  *a = c;
  *b = s;
  return 0;
fail:
  if (ls >= 0) close(ls);
  if (c >= 0) close(c);
  if (s >= 0) close(s);
  return -1;
}

static int write_all(int fd, const void *buf, size_t len) {
  const unsigned char *p = buf;
  while (len > 0) {
    ssize_t k = send(fd, p, len, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    len -= (size_t)k;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t len) {
  unsigned char *p = buf;
  while (len > 0) {
    ssize_t k = recv(fd, p, len, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    len -= (size_t)k;
  }
  return 0;
}

typedef struct sender {
  int fd;
  const unsigned char *block;
  uint64_t total;
  int64_t t0;
  int rc;
} sender_t;

static void *sender_thread(void *arg) {
  sender_t *s = arg;
  s->t0 = ddp_now_ns();
  s->rc = 0;
  for (uint64_t sent = 0; sent < s->total;) {
    size_t n = s->total - sent < TCP_BLOCK ? (size_t)(s->total - sent) : TCP_BLOCK;
    if (write_all(s->fd, s->block, n) != 0) {
      s->rc = -1;
      break;
    }
    sent += n;
  }
  return NULL;
}

static int measure_tcp_bw(uint64_t total, unsigned char *tx, unsigned char *rx, double *gbs) {
  double rate[3];
  for (int rep = 0; rep < 3; rep++) {
    int a, b;
    if (tcp_pair(&a, &b, 0) != 0) return -1;
    sender_t s = {a, tx, total, 0, 0};
    pthread_t th;
    if (pthread_create(&th, NULL, sender_thread, &s) != 0) {
      close(a);
      close(b);
      return -1;
    }
    uint64_t got = 0;
    int rc = 0;
    while (got < total) {
      size_t want = total - got < TCP_BLOCK ? (size_t)(total - got) : TCP_BLOCK;
      ssize_t k = recv(b, rx, want, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        rc = -1;
        break;
      }
      got += (uint64_t)k;
    }
    int64_t t1 = ddp_now_ns();
    /* Closing our end first makes a sender stuck in send() fail at once. */
    close(b);
    pthread_join(th, NULL);
    close(a);
    if (rc != 0 || s.rc != 0) {
      fprintf(stderr, "ddp-bench: loopback bandwidth: transfer failed after %llu bytes\n",
              (unsigned long long)got);
      return -1;
    }
    rate[rep] = (double)total / (double)(t1 - s.t0);
  }
  *gbs = median(rate, 3);
  return 0;
}

typedef struct echo {
  int fd;
  int n;
  int rc;
} echo_t;

static void *echo_thread(void *arg) {
  echo_t *e = arg;
  char m[8];
  e->rc = 0;
  for (int i = 0; i < e->n; i++) {
    if (read_all(e->fd, m, sizeof m) != 0 || write_all(e->fd, m, sizeof m) != 0) {
      e->rc = -1;
      break;
    }
  }
  return NULL;
}

static int measure_tcp_rtt(double *p50, double *p99) {
  int a, b;
  if (tcp_pair(&a, &b, 1) != 0) return -1;
  echo_t e = {b, RTT_WARMUP + RTT_ITERS, 0};
  pthread_t th;
  if (pthread_create(&th, NULL, echo_thread, &e) != 0) {
    close(a);
    close(b);
    return -1;
  }
  double *rtt = ddp_malloc(sizeof(double) * RTT_ITERS);
  int rc = rtt ? 0 : -1;
  char m[8] = "ddpbench";
  for (int i = 0; rc == 0 && i < RTT_WARMUP + RTT_ITERS; i++) {
    int64_t t0 = ddp_now_ns();
    if (write_all(a, m, sizeof m) != 0 || read_all(a, m, sizeof m) != 0) {
      rc = -1;
      break;
    }
    if (i >= RTT_WARMUP) rtt[i - RTT_WARMUP] = (double)(ddp_now_ns() - t0) / 1e3;
  }
  if (rc != 0) shutdown(a, SHUT_RDWR);
  pthread_join(th, NULL);
  close(a);
  close(b);
  if (rc == 0 && e.rc == 0) {
    qsort(rtt, RTT_ITERS, sizeof *rtt, cmp_double);
    *p50 = bench_percentile(rtt, RTT_ITERS, 50.0);
    *p99 = bench_percentile(rtt, RTT_ITERS, 99.0);
  } else {
    fprintf(stderr, "ddp-bench: loopback round trip: ping-pong failed\n");
    rc = -1;
  }
  ddp_free(rtt);
  return rc;
}

int bench_calibrate(uint64_t bytes, bench_calib_t *out) {
  memset(out, 0, sizeof *out);
  out->bytes = bytes;
  int rc = 0;
  unsigned char *src = ddp_malloc(bytes), *dst = ddp_malloc(bytes);
  if (!src || !dst) {
    fprintf(stderr, "ddp-bench: calibration: cannot allocate 2 x %llu bytes\n",
            (unsigned long long)bytes);
    ddp_free(src);
    ddp_free(dst);
    return -1;
  }
  /* Touch every page of both buffers, and make the data non-trivial. */
  for (uint64_t i = 0; i < bytes; i++) src[i] = (unsigned char)(i * 131u + 7u);
  memset(dst, 0, bytes);
  if (measure_memcpy(dst, src, bytes, 1, &out->memcpy1_gbs) != 0) rc = -1;
  if (measure_memcpy(dst, src, bytes, 2, &out->memcpy2_gbs) != 0) rc = -1;
  if (measure_tcp_bw(bytes, src, dst, &out->tcp_bw_gbs) != 0) rc = -1;
  if (measure_tcp_rtt(&out->tcp_rtt_p50_us, &out->tcp_rtt_p99_us) != 0) rc = -1;
  ddp_free(src);
  ddp_free(dst);
  return rc;
}
