/* Allocation wrappers over a replaceable allocator, with counters. The allocator and the
 * counters are process-wide, like libuv's uv_replace_allocator: memory is a process
 * resource. Tests route the allocator through CMocka's leak checker (single-threaded tests)
 * or count allocations to prove a hot path allocates nothing.
 *
 * The counters are striped by CPU: one pair of counters shared by every thread would bounce
 * its cache line between the cores of thread ranks on every small collective (a work handle
 * is allocated and freed per collective), which measured about a tenth of a 4-byte
 * allreduce's time on the threads backend. A thread adds to the stripe of the CPU it runs
 * on (sched_getcpu reads the kernel's rseq area, no system call); a migration in between
 * only means another stripe, the adds stay atomic. The totals are the sums. */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "common/common.h"

static void *libc_malloc(void *u, size_t n) {
  (void)u;
  return malloc(n);
}
static void *libc_calloc(void *u, size_t n, size_t s) {
  (void)u;
  return calloc(n, s);
}
static void *libc_realloc(void *u, void *p, size_t n) {
  (void)u;
  return realloc(p, n);
}
static void libc_free(void *u, void *p) {
  (void)u;
  free(p);
}

static const ddp_allocator_t libc_allocator = {libc_malloc, libc_calloc, libc_realloc, libc_free,
                                               NULL};
static ddp_allocator_t current = {libc_malloc, libc_calloc, libc_realloc, libc_free, NULL};
#define STRIPES 16
static struct {
  _Alignas(64) _Atomic uint64_t allocs;
  _Atomic uint64_t frees;
} counts[STRIPES];

static unsigned stripe(void) {
  int cpu = sched_getcpu();
  return cpu < 0 ? 0u : (unsigned)cpu % STRIPES;
}

void ddp_set_allocator(const ddp_allocator_t *a) {
  if (a) {
    DDP_REQUIRE(a->malloc_fn && a->calloc_fn && a->realloc_fn && a->free_fn);
    current = *a;
  } else {
    current = libc_allocator;
  }
}

void ddp_alloc_stats(ddp_alloc_stats_t *out) {
  DDP_REQUIRE(out);
  out->allocs = out->frees = 0;
  for (int i = 0; i < STRIPES; i++) {
    out->allocs += atomic_load(&counts[i].allocs);
    out->frees += atomic_load(&counts[i].frees);
  }
}

void *ddp__malloc(size_t size) {
  void *p = current.malloc_fn(current.user, size ? size : 1);
  if (p) atomic_fetch_add(&counts[stripe()].allocs, 1);
  return p;
}

void *ddp__calloc(size_t n, size_t size) {
  if (n == 0 || size == 0) n = size = 1;
  void *p = current.calloc_fn(current.user, n, size);
  if (p) atomic_fetch_add(&counts[stripe()].allocs, 1);
  return p;
}

void *ddp__realloc(void *ptr, size_t size) {
  if (!ptr) return ddp__malloc(size);
  return current.realloc_fn(current.user, ptr, size ? size : 1);
}

void ddp__free(void *ptr) {
  if (!ptr) return;
  atomic_fetch_add(&counts[stripe()].frees, 1);
  current.free_fn(current.user, ptr);
}

char *ddp__strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = ddp__malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* An aligned block stores the pointer the allocator returned just below the aligned
 * address, so that any allocator (CMocka's included) can serve aligned requests. */
#define DDP_ALIGN 64

void *ddp__aligned_alloc(size_t size) {
  if (size > SIZE_MAX - DDP_ALIGN - sizeof(void *)) return NULL;
  unsigned char *raw = ddp__malloc(size + DDP_ALIGN + sizeof(void *));
  if (!raw) return NULL;
  uintptr_t a = ((uintptr_t)(raw + sizeof(void *)) + DDP_ALIGN - 1) & ~(uintptr_t)(DDP_ALIGN - 1);
  memcpy((void *)(a - sizeof(void *)), &raw, sizeof raw);
  return (void *)a;
}

void ddp__aligned_free(void *ptr) {
  if (!ptr) return;
  void *raw;
  memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
  ddp__free(raw);
}

void *ddp_malloc(size_t size) { return ddp__aligned_alloc(size); }
void ddp_free(void *ptr) { ddp__aligned_free(ptr); }
