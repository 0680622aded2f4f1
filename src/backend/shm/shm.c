/* The shm backend: ranks are processes on one host sharing one POSIX shared-memory segment
 * per group.
 *
 * Segment layout: [control block][staging area of each rank][heap of each rank]. Rank 0
 * creates the segment under an unguessable name (uid, pid and 64 random bits), publishes the
 * name through the store, and every rank maps it. Once all ranks have joined (each has
 * mapped it), every rank unlinks the name (the first unlink wins), so nothing is left in
 * /dev/shm even if a rank is killed later; a rank that fails during create unlinks too.
 *
 * Buffers from ddp_pg_alloc come from the caller's own heap inside the segment; peers can
 * read them through offsets, so collectives on them run in place with no copy. Other
 * buffers go through the staging areas in chunks.
 *
 * Memory. The segment is a sparse file: only what is reserved uses memory. Rank 0 reserves
 * the control block and the staging areas at create, and each rank reserves every heap
 * block it hands out (posix_fallocate), so a /dev/shm too small for the job is an error
 * naming /dev/shm, the bytes needed and the bytes free, never a SIGBUS on first touch
 * later (tmpfs delivers SIGBUS for a page of a sparse file it cannot back). Because heap
 * blocks cost nothing until handed out, each rank's heap is as large as the host's
 * physical memory by default, so any model that fits in memory (and in /dev/shm) gets its
 * buckets in the segment.
 *
 * Liveness: every rank opens a pidfd for each peer. The shared-family waits poll them every
 * 10 ms while sleeping, so a killed peer is reported by rank and pid within milliseconds,
 * instead of at the timeout. Where pidfd_open is unavailable, kill(pid, 0) is the fallback. */
#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend/backends.h"
#include "common/common.h"

#define PAGE 4096u
#define BLOCK_HDR 64u

typedef struct range {
  size_t off;
  size_t len;
} range_t;

typedef struct shm_state {
  int rank;
  int size;
  unsigned char *base;
  size_t total;
  unsigned char **staging;
  int *pids;
  int *pidfds; /* -1 for self, or when pidfd_open is unavailable */
  int fd;      /* the segment, kept open to reserve heap blocks */
  ddp_backend_shared_t sh;
  pthread_mutex_t heap_mu; /* guards the free list */
  size_t heap_lo, heap_hi; /* this rank's heap, as segment offsets */
  range_t *free_list;      /* sorted by offset, coalesced */
  size_t nfree, capfree;
  ddp_error_t alloc_err; /* why the last shm_alloc failed (heap_mu) */
} shm_state_t;

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Default per-rank heap: the host's physical memory (it is only address space until blocks
 * are handed out), at least 256 MiB, and at most 32 TiB over all W ranks (a quarter of
 * x86-64's user address space, so the mapping always fits). */
static size_t default_heap(int W) {
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  size_t phys = pages > 0 && psz > 0 ? (size_t)pages * (size_t)psz : 0;
  return DDP_MIN(DDP_MAX(phys, (size_t)256 << 20), ((size_t)1 << 45) / (size_t)W);
}

/* Bytes free in /dev/shm for this user, or -1 when statvfs fails. */
static long long shm_free_bytes(void) {
  struct statvfs v;
  if (statvfs("/dev/shm", &v) != 0) return -1;
  return (long long)v.f_bavail * (long long)v.f_frsize;
}

/* Backs [off, off + len) of the segment with memory now. On failure err (not logged) names
 * /dev/shm, the bytes needed and the bytes free. */
static ddp_status_t reserve(int fd, size_t off, size_t len, int rank, const char *what,
                            ddp_error_t *err) {
  int e;
  do {
    e = posix_fallocate(fd, (off_t)off, (off_t)len);
  } while (e == EINTR);
  if (e == 0) return DDP_OK;
  return ddp__error_quiet(
      err, e == ENOSPC ? DDP_ERR_NO_MEMORY : DDP_ERR_SYSTEM,
      "rank %d: /dev/shm cannot hold %s: %zu bytes needed, %lld bytes free (posix_fallocate: "
      "%s); enlarge /dev/shm (docker run --shm-size, or mount -o remount,size=... /dev/shm) "
      "or use the tcp backend",
      rank, what, len, shm_free_bytes(), strerror(e));
}

static uint64_t to_handle(void *state, const void *p, size_t n) {
  shm_state_t *s = state;
  const unsigned char *q = p;
  if (q < s->base || q + n > s->base + s->total || q + n < q) return UINT64_MAX;
  return (uint64_t)(q - s->base);
}

static void *from_handle(void *state, uint64_t h) { return ((shm_state_t *)state)->base + h; }

static ddp_status_t check_peers(void *state, int peer, ddp_error_t *err) {
  shm_state_t *s = state;
  struct pollfd pfd[DDP_PG_MAX_WORLD];
  int idx[DDP_PG_MAX_WORLD], n = 0;
  for (int j = 0; j < s->size; j++) {
    if (j == s->rank || (peer >= 0 && j != peer)) continue;
    if (s->pidfds[j] >= 0) {
      pfd[n] = (struct pollfd){s->pidfds[j], POLLIN, 0};
      idx[n++] = j;
    } else if (kill(s->pids[j], 0) != 0 && errno == ESRCH) {
      return ddp__error_quiet(err, DDP_ERR_REMOTE, "rank %d (pid %d) has exited", j, s->pids[j]);
    }
  }
  if (n && poll(pfd, (nfds_t)n, 0) > 0) {
    for (int i = 0; i < n; i++)
      if (pfd[i].revents)
        return ddp__error_quiet(err, DDP_ERR_REMOTE, "rank %d (pid %d) has exited", idx[i],
                                s->pids[idx[i]]);
  }
  return DDP_OK;
}

static void shm_destroy(void *state) {
  shm_state_t *s = state;
  if (!s) return;
  if (s->pidfds)
    for (int j = 0; j < s->size; j++)
      if (s->pidfds[j] >= 0) close(s->pidfds[j]);
  if (s->base) munmap(s->base, s->total);
  if (s->fd >= 0) close(s->fd);
  ddp__free(s->pidfds);
  ddp__free(s->pids);
  ddp__free(s->staging);
  ddp__free(s->free_list);
  pthread_mutex_destroy(&s->heap_mu);
  ddp__free(s);
}

static ddp_status_t shm_create(const ddp_backend_init_t *in, void **out, ddp_error_t *err) {
  int rank = in->rank, W = in->size;
  if (!in->store)
    return ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: the shm backend needs a store (file or TCP) for rendezvous", rank);
  shm_state_t *s = ddp__calloc(1, sizeof *s);
  if (!s) return ddp__error(err, rank, DDP_ERR_NO_MEMORY, "shm backend state");
  pthread_mutex_init(&s->heap_mu, NULL);
  s->fd = -1;
  s->rank = rank;
  s->size = W;
  s->staging = ddp__calloc((size_t)W, sizeof *s->staging);
  s->pids = ddp__calloc((size_t)W, sizeof *s->pids);
  s->pidfds = ddp__malloc((size_t)W * sizeof *s->pidfds);
  s->capfree = 16;
  s->free_list = ddp__malloc(s->capfree * sizeof *s->free_list);
  ddp_status_t st = DDP_OK;
  char name[96] = "";
  int fd = -1;
  if (!s->staging || !s->pids || !s->pidfds || !s->free_list) {
    st = ddp__error(err, rank, DDP_ERR_NO_MEMORY, "shm backend state");
    goto fail;
  }
  for (int j = 0; j < W; j++) s->pidfds[j] = -1;
  size_t ctl = round_up(in->ctl_bytes, PAGE), stg = round_up(in->staging_bytes, PAGE);
  size_t heap = round_up(in->heap_bytes ? in->heap_bytes : default_heap(W), PAGE);
  s->total = ctl + (size_t)W * stg + (size_t)W * heap;

  if (rank == 0) {
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) rnd = (uint64_t)ddp_now_ns();
    snprintf(name, sizeof name, "/ddp-%u-%d-%016" PRIx64, (unsigned)getuid(), (int)getpid(), rnd);
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      st = ddp__error(err, rank, DDP_ERR_SYSTEM, "rank 0: shm_open(%s): %s (errno %d)", name,
                      strerror(errno), errno);
      name[0] = '\0';
      goto fail;
    }
    if (ftruncate(fd, (off_t)s->total) != 0) {
      st = ddp__error(err, rank, DDP_ERR_SYSTEM, "rank 0: ftruncate(%s, %zu): %s (errno %d)", name,
                      s->total, strerror(errno), errno);
      goto fail;
    }
    char what[96];
    snprintf(what, sizeof what, "the control block and %d staging areas of group %s", W, name);
    if ((st = reserve(fd, 0, ctl + (size_t)W * stg, rank, what, err)) != DDP_OK) {
      ddp__log(rank, DDP_LOG_ERROR, "%s: %s", ddp_status_name(st), err ? err->msg : what);
      goto fail;
    }
    st = ddp_store_set(in->store, "shm/name", name, strlen(name) + 1);
    if (st != DDP_OK) {
      st = ddp__backend_store_failed(in->store, st, err, "rank 0: publishing the shm segment name");
      goto fail;
    }
  } else {
    const char *key = "shm/name";
    st = ddp_store_wait(in->store, &key, 1, in->timeout_ms);
    if (st != DDP_OK) {
      st = ddp__error_quiet(err, st, /* the store has logged its wait */
                            "rank %d: timed out after %lld ms waiting for rank 0 to join the shm "
                            "group",
                            rank, (long long)in->timeout_ms);
      goto fail;
    }
    void *v = NULL;
    size_t n = 0;
    st = ddp_store_get(in->store, key, &v, &n);
    if (st == DDP_OK && n > 0 && n <= sizeof name) memcpy(name, v, n);
    ddp_free(v);
    name[sizeof name - 1] = '\0';
    fd = name[0] ? shm_open(name, O_RDWR, 0600) : -1;
    if (fd < 0) {
      st = ddp__error(err, rank, DDP_ERR_SYSTEM, "rank %d: shm_open(%s): %s (errno %d)", rank, name,
                      strerror(errno), errno);
      name[0] = '\0';
      goto fail;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != s->total) {
      st = ddp__error(err, rank, DDP_ERR_INVALID_ARGUMENT,
                      "rank %d: shm segment %s has %lld bytes, this rank expects %zu (the ranks "
                      "disagree on world size or options)",
                      rank, name, (long long)sb.st_size, s->total);
      goto fail;
    }
  }
  void *base = mmap(NULL, s->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    st = ddp__error(err, rank, DDP_ERR_SYSTEM, "rank %d: mmap of %zu bytes: %s (errno %d)", rank,
                    s->total, strerror(errno), errno);
    goto fail;
  }
  s->fd = fd;
  fd = -1;
  s->base = base;
  for (int j = 0; j < W; j++) s->staging[j] = s->base + ctl + (size_t)j * stg;
  s->heap_lo = ctl + (size_t)W * stg + (size_t)rank * heap;
  s->heap_hi = s->heap_lo + heap;
  s->free_list[0] = (range_t){s->heap_lo, heap};
  s->nfree = heap ? 1 : 0;

  st = ddp__backend_join(in->store, "shm", rank, W, in->timeout_ms, s->pids, err);
  if (st != DDP_OK) goto fail;
  if (shm_unlink(name) != 0 && errno != ENOENT)
    ddp__log(rank, DDP_LOG_WARN, "shm_unlink(%s): %s", name, strerror(errno));
  name[0] = '\0';
  for (int j = 0; j < W; j++) {
    if (j == rank) continue;
    s->pidfds[j] = (int)syscall(SYS_pidfd_open, s->pids[j], 0);
  }
  s->sh = (ddp_backend_shared_t){s->base,   s->staging,  in->staging_bytes,
                                 to_handle, from_handle, check_peers};
  *out = s;
  return DDP_OK;
fail:
  if (fd >= 0) close(fd);
  if (name[0]) shm_unlink(name);
  shm_destroy(s);
  return st;
}

static const ddp_backend_shared_t *shm_shared(void *state) { return &((shm_state_t *)state)->sh; }

/* First-fit allocation in this rank's heap. Each block starts with a 64-byte header that
 * holds its length, so the payload stays 64-byte aligned. The block is reserved in
 * /dev/shm before it is handed out; when that fails (or no range fits) the reason is kept
 * for shm_alloc_error and NULL returned. */
static void *shm_alloc(void *state, size_t bytes) {
  shm_state_t *s = state;
  size_t need = round_up(bytes ? bytes : 1, 64) + BLOCK_HDR;
  void *p = NULL;
  pthread_mutex_lock(&s->heap_mu);
  size_t i = 0;
  while (i < s->nfree && s->free_list[i].len < need) i++;
  if (i == s->nfree) {
    ddp__error(&s->alloc_err, s->rank, DDP_ERR_NO_MEMORY,
               "rank %d: no free range of %zu bytes in this rank's shm heap of %zu bytes "
               "(shm_heap_bytes)",
               s->rank, need, s->heap_hi - s->heap_lo);
    pthread_mutex_unlock(&s->heap_mu);
    return NULL;
  }
  range_t *r = &s->free_list[i];
  size_t off = r->off;
  char what[64];
  snprintf(what, sizeof what, "a %zu-byte ddp_pg_alloc block", bytes);
  if (reserve(s->fd, off, need, s->rank, what, &s->alloc_err) != DDP_OK) {
    ddp__log(s->rank, DDP_LOG_ERROR, "%s", s->alloc_err.msg);
    pthread_mutex_unlock(&s->heap_mu);
    return NULL;
  }
  r->off += need;
  r->len -= need;
  if (r->len == 0) {
    memmove(r, r + 1, (s->nfree - i - 1) * sizeof *r);
    s->nfree--;
  }
  memcpy(s->base + off, &need, sizeof need);
  p = s->base + off + BLOCK_HDR;
  pthread_mutex_unlock(&s->heap_mu);
  return p;
}

/* The table's alloc_error: why the last shm_alloc failed. */
static void shm_alloc_error(void *state, ddp_error_t *out) {
  shm_state_t *s = state;
  pthread_mutex_lock(&s->heap_mu);
  *out = s->alloc_err;
  pthread_mutex_unlock(&s->heap_mu);
}

static void shm_free(void *state, void *p) {
  shm_state_t *s = state;
  unsigned char *q = (unsigned char *)p - BLOCK_HDR;
  DDP_REQUIRE(q >= s->base + s->heap_lo && q < s->base + s->heap_hi);
  size_t off = (size_t)(q - s->base), len;
  memcpy(&len, q, sizeof len);
  pthread_mutex_lock(&s->heap_mu);
  size_t i = 0;
  while (i < s->nfree && s->free_list[i].off < off) i++;
  bool merge_prev = i > 0 && s->free_list[i - 1].off + s->free_list[i - 1].len == off;
  bool merge_next = i < s->nfree && off + len == s->free_list[i].off;
  if (merge_prev && merge_next) {
    s->free_list[i - 1].len += len + s->free_list[i].len;
    memmove(&s->free_list[i], &s->free_list[i + 1], (s->nfree - i - 1) * sizeof(range_t));
    s->nfree--;
  } else if (merge_prev) {
    s->free_list[i - 1].len += len;
  } else if (merge_next) {
    s->free_list[i].off = off;
    s->free_list[i].len += len;
  } else {
    if (s->nfree == s->capfree) {
      range_t *nl = ddp__realloc(s->free_list, 2 * s->capfree * sizeof *nl);
      if (!nl) {
        /* The block is lost to this group's heap; the segment is freed with the group. */
        pthread_mutex_unlock(&s->heap_mu);
        return;
      }
      s->free_list = nl;
      s->capfree *= 2;
    }
    memmove(&s->free_list[i + 1], &s->free_list[i], (s->nfree - i) * sizeof(range_t));
    s->free_list[i] = (range_t){off, len};
    s->nfree++;
  }
  pthread_mutex_unlock(&s->heap_mu);
}

const ddp_backend_ops_t ddp__backend_shm = {
    .abi_version = DDP_BACKEND_ABI_VERSION,
    .name = "shm",
    .family = DDP_BACKEND_SHARED,
    .create = shm_create,
    .destroy = shm_destroy,
    .abort = NULL,
    .mem_alloc = shm_alloc,
    .mem_free = shm_free,
    .shared = shm_shared,
    .xfer = NULL,
    .fail = NULL,
    .alloc_error = shm_alloc_error,
};
