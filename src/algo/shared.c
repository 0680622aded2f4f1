/* Collectives for the shared-memory family (threads, shm): every rank maps one control
 * block and can read the buffers its peers publish.
 *
 * Synchronisation. The control block holds one slot per rank (a barrier counter, the
 * fingerprint and the buffer handles of the running collective), one cell per ordered pair
 * of ranks for point-to-point, and a failure record. Every change is a store to a word owned
 * by one writer, followed by a bump of one group-wide event word; a waiter polls briefly
 * (a fraction of a microsecond with PAUSE, then up to 50 us yielding its CPU between polls,
 * since busy spinning loses badly when the awaited rank needs that CPU, spec §0.10; up to
 * 1-8 ms after it woke a sleeping peer: wait_policy.c) and then sleeps on the event word with a
 * futex in slices of 10 ms. Between slices it checks the failure record, the abort flag, its
 * deadline and the liveness of peers, so a dead peer is noticed within tens of milliseconds and
 * nothing waits past the deadline. The first rank to fail writes the failure record, which makes
 * every other rank's waits fail at once.
 *
 * What a rank publishes for collective number s (its barrier count, its fingerprint, and its
 * buffers' handles or, for the smallest allreduce, the input itself) lives in one cache line,
 * the one of parity s & 1 in the rank's slot, so a peer leaving the collective's first
 * barrier has pulled everything it needs in one transfer between cores. A rank can run at
 * most one collective ahead of the slowest (every collective starts with a barrier), so it
 * never overwrites a line a slower peer is still reading. The same bound lets a rank, once
 * past a collective's first barrier, take its line and box of the other parity back into its
 * own cache (enter()): no peer reads them any more, and the next collective then publishes
 * with local stores.
 *
 * Data. When every rank's buffers are readable by all (threads always; shm for buffers from
 * ddp_pg_alloc) the collectives read peers' buffers in place ("direct"). Otherwise they copy
 * through each rank's staging area in chunks. Both modes reduce every element with the same
 * rank-order fold, so they give the same bits. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "algo/algo.h"

/* A wait's phases and their budgets: wait_policy.c. Between the futex sleeps of the last
 * phase a waiter checks for failures every SLICE_NS. */
#define SLICE_NS (10 * 1000000LL)
#define P2P_DESYNC (1ull << 63)

typedef struct ctl_hdr {
  _Atomic uint32_t event;
  char pad0[60];
  _Atomic uint32_t waiters;
  char pad1[60];
  _Atomic int32_t failed_by; /* 0 = none, else rank + 1 of the first failing rank */
  _Atomic uint32_t failed;   /* its status, stored after msg */
  char msg[DDP_ERROR_MSG_MAX];
} __attribute__((aligned(64))) ctl_hdr_t;

/* One rank's line for one parity. `barrier` counts the barriers this rank has entered, and
 * is stored after the rest of the line (the store publishes it): the fingerprint, then either
 * up to INLINE_BYTES of its input (the one-barrier allreduce of the smallest messages) or the
 * handles of its input and output (every other path). Barriers after a collective's
 * first keep counting in the same line: a peer already in the next collective has moved to
 * the other line, and the count it left in this one is at least every count this
 * collective waits for. */
#define INLINE_BYTES 24
typedef struct pub_line {
  _Atomic uint64_t barrier;
  ddp__fp_t fp;
  union {
    uint64_t h[2]; /* in, out */
    unsigned char data[INLINE_BYTES];
  } u;
} __attribute__((aligned(64))) pub_line_t;
_Static_assert(sizeof(pub_line_t) == 64, "a rank's published line is one cache line");

typedef struct rank_slot {
  pub_line_t line[2]; /* [seq & 1] */
  int32_t pid;
  _Atomic int32_t left; /* 1 once this rank has destroyed its group (ddp__shared_leave) */
} __attribute__((aligned(64))) rank_slot_t;

typedef struct pair_cell {
  _Atomic uint64_t posted; /* chunks the sender has put in its staging area */
  _Atomic uint64_t acked;  /* chunks the receiver has taken; bit 63 = fingerprint mismatch */
  uint64_t bytes;          /* size of the posted chunk */
  uint64_t pad;
  ddp__fp_t fp;  /* sender's fingerprint (first chunk) */
  ddp__fp_t rfp; /* receiver's fingerprint, on mismatch */
} __attribute__((aligned(64))) pair_cell_t;

/* Each rank's two boxes (one per parity of the collective's sequence number) for the
 * one-barrier small allreduce. */
#define BOX_BYTES DDP__SHARED_BOX_BYTES
/* The most of a box enter() takes back into its writer's cache. */
#define BOX_TAKE_MAX (4u * 1024u)

/* Each rank's stamped lines (EXT_LINES per parity) for allreduces of INLINE_BYTES + 1 to
 * STAMPED_BYTES: the input's bytes after the first INLINE_BYTES (which ride in the rank's
 * line), EXT_BYTES per line, each line ending in `stamp`, the barrier count of the
 * collective's barrier, stored after the line's data. A waiter loads every peer's line and
 * all its stamped lines in each poll, so their transfers between cores overlap; a box read
 * after the barrier would be a second transfer, after the first. Polling the lines while
 * their writer fills them costs that writer a re-fetch of each, which is why the path stops
 * at EXT_LINES (measured: docs/benchmarks.md, "What made libddp fast"). */
#define EXT_BYTES 56
#define EXT_LINES 2
#define STAMPED_BYTES (INLINE_BYTES + EXT_LINES * EXT_BYTES)
typedef struct ext_line {
  unsigned char data[EXT_BYTES];
  _Atomic uint64_t stamp;
} __attribute__((aligned(64))) ext_line_t;
_Static_assert(sizeof(ext_line_t) == 64, "a stamped line is one cache line");
_Static_assert(INLINE_BYTES % 8 == 0 && EXT_BYTES % 8 == 0, "no element straddles two lines");
_Static_assert(STAMPED_BYTES <= DDP_REDUCE_TMP_BYTES / DDP_PG_MAX_WORLD,
               "every rank's stamped input fits in the fold's tmp");

static size_t hdr_bytes(void) { return (sizeof(ctl_hdr_t) + 63) & ~(size_t)63; }

size_t ddp__shared_ctl_bytes(int size) {
  return hdr_bytes() + (size_t)size * sizeof(rank_slot_t) +
         (size_t)size * (size_t)size * sizeof(pair_cell_t) + (size_t)size * 2 * BOX_BYTES +
         (size_t)size * 2 * EXT_LINES * sizeof(ext_line_t);
}

static ctl_hdr_t *hdr(ddp__comm_t *c) { return (ctl_hdr_t *)c->sh->ctl; }
static rank_slot_t *slot(ddp__comm_t *c, int r) {
  return (rank_slot_t *)((char *)c->sh->ctl + hdr_bytes()) + r;
}
static pair_cell_t *cell(ddp__comm_t *c, int from, int to) {
  return (pair_cell_t *)((char *)c->sh->ctl + hdr_bytes() + (size_t)c->size * sizeof(rank_slot_t)) +
         (size_t)from * (size_t)c->size + (size_t)to;
}

/* Rank r's line for the running collective (c->par). */
static pub_line_t *line(ddp__comm_t *c, int r) { return &slot(c, r)->line[c->par]; }

static unsigned char *box(ddp__comm_t *c, int r, uint64_t seq) {
  return (unsigned char *)c->sh->ctl + hdr_bytes() + (size_t)c->size * sizeof(rank_slot_t) +
         (size_t)c->size * (size_t)c->size * sizeof(pair_cell_t) +
         ((size_t)r * 2 + (seq & 1)) * BOX_BYTES;
}

/* Rank r's stamped lines of parity `par`. */
static ext_line_t *ext(ddp__comm_t *c, int r, int par) {
  return (ext_line_t *)(box(c, c->size, 0)) + ((size_t)r * 2 + (size_t)par) * EXT_LINES;
}

void ddp__shared_attach(ddp__comm_t *c, int pid) { slot(c, c->rank)->pid = pid; }

/* Pollers read the slots themselves: only sleepers need the event word, and a bump of it
 * is a write every rank's cache then misses on. A sleeper registers in `waiters` before it
 * reads the event word and looks at the slots for the last time (wait_for), so with
 * sequentially consistent atomics either it sees the change the caller made before this
 * call, or this load sees it registered and the bump makes its futex wait return. */
static bool wake(ddp__comm_t *c) {
  ctl_hdr_t *h = hdr(c);
  if (atomic_load(&h->waiters) == 0) return false;
  atomic_fetch_add(&h->event, 1);
  syscall(SYS_futex, (uint32_t *)&h->event, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
  return true;
}

/* wake() from the thread running the group's work, which owns the wait policy: a peer it
 * woke will be late, so its next wait polls longer (wait_policy.c). Any thread may call
 * wake() (an abort's poison), only the owner this. */
static void signal_peers(ddp__comm_t *c) {
  if (wake(c)) ddp__wait_woke(&c->wait);
}

void ddp__shared_poison(ddp__comm_t *c, ddp_status_t st, const char *msg) {
  ctl_hdr_t *h = hdr(c);
  int32_t none = 0;
  if (atomic_compare_exchange_strong(&h->failed_by, &none, c->rank + 1)) {
    snprintf(h->msg, sizeof h->msg, "%s", msg);
    atomic_store(&h->failed, (uint32_t)st);
  }
  wake(c);
}

void ddp__shared_leave(ddp__comm_t *c) {
  atomic_store(&slot(c, c->rank)->left, 1);
  wake(c);
}

/* DDP_OK unless `peer` (or, when peer < 0, any rank) has left the group. Called only after
 * the wait's predicate failed, so a peer that left after doing its part of this wait (the
 * last barrier of the group's last collective) is never blamed. */
static ddp_status_t check_left(ddp__comm_t *c, int peer, ddp_error_t *err) {
  for (int j = 0; j < c->size; j++) {
    if (j == c->rank || (peer >= 0 && j != peer) || !atomic_load(&slot(c, j)->left)) continue;
    return ddp__error_quiet(err, DDP_ERR_REMOTE,
                            "rank %d (pid %d) left the group (ddp_pg_destroy) while this rank "
                            "still needed it",
                            j, (int)slot(c, j)->pid);
  }
  return DDP_OK;
}

/* DDP_OK while nobody has failed the group. */
static ddp_status_t check_failed(ddp__comm_t *c, ddp_error_t *err) {
  if (atomic_load(&c->aborted))
    return ddp__error_quiet(err, DDP_ERR_ABORTED, "the group was aborted on rank %d", c->rank);
  ctl_hdr_t *h = hdr(c);
  uint32_t st = atomic_load(&h->failed);
  if (st == 0) return DDP_OK;
  int by = atomic_load(&h->failed_by) - 1;
  if (by == c->rank) return ddp__error_quiet(err, (ddp_status_t)st, "%s", h->msg);
  return ddp__error_quiet(err, DDP_ERR_REMOTE, "rank %d failed the group: %s", by, h->msg);
}

ddp_status_t ddp__shared_group_failed(ddp__comm_t *c, ddp_error_t *err) {
  return check_failed(c, err);
}

typedef bool (*pred_fn)(ddp__comm_t *c, const void *arg);
/* Appends "who we are waiting for" to buf. */
typedef void (*describe_fn)(ddp__comm_t *c, const void *arg, char *buf, size_t n);

/* What a sleeping waiter checks before each sleep: *done when pred holds; DDP_OK (sleep
 * on, unless done) or the failure (the group failed, a peer left or died, the deadline
 * passed). */
static ddp_status_t sleep_checks(ddp__comm_t *c, pred_fn pred, const void *arg, describe_fn desc,
                                 int peer, int64_t start, int64_t *last_check, bool *done,
                                 ddp_error_t *err) {
  *done = pred(c, arg);
  if (*done) return DDP_OK;
  DDP_CHECK(check_failed(c, err));
  ddp_status_t gone = check_left(c, peer, err);
  if (gone != DDP_OK) {
    ddp__shared_poison(c, gone, err->msg);
    return gone;
  }
  int64_t now = ddp_now_ns();
  if (c->sh->check_peers && now - *last_check >= SLICE_NS) {
    *last_check = now;
    ddp_status_t st = c->sh->check_peers(c->state, peer, err);
    if (st != DDP_OK) {
      ddp__shared_poison(c, st, err->msg);
      return st;
    }
  }
  if (now >= c->deadline_ns) {
    char who[256] = "";
    desc(c, arg, who, sizeof who);
    ddp__error_quiet(err, DDP_ERR_TIMEOUT, "timed out after %lld ms %s",
                     (long long)((now - start) / 1000000), who);
    ddp__shared_poison(c, DDP_ERR_TIMEOUT, err->msg);
    return DDP_ERR_TIMEOUT;
  }
  return DDP_OK;
}

/* Waits until pred holds, the group fails, a peer dies (`peer`, or any when < 0; in a
 * barrier a peer cannot leave before everyone has arrived, so any exit is a failure) or
 * the deadline passes. */
static ddp_status_t wait_for(ddp__comm_t *c, pred_fn pred, const void *arg, describe_fn desc,
                             int peer, ddp_error_t *err) {
  ctl_hdr_t *h = hdr(c);
  if (pred(c, arg)) return DDP_OK; /* often already true: no clock read */
  int64_t t0 = ddp_now_ns(), spin = ddp__wait_spin_ns(&c->wait),
          yield = ddp__wait_yield_ns(&c->wait);
  if (c->deadline_ns == DDP__DEADLINE_LAZY) c->deadline_ns = ddp_deadline_from(t0, c->timeout_ms);
  for (unsigned i = 0;; i++) {
    if (pred(c, arg)) {
      ddp__wait_ended(&c->wait, DDP__WAIT_SPUN, 0);
      return DDP_OK;
    }
    if ((i & 7) == 7 && ddp_now_ns() - t0 >= spin) break;
    __builtin_ia32_pause();
  }
  for (int64_t now = ddp_now_ns(); now - t0 < yield; now = ddp_now_ns()) {
    if (pred(c, arg)) {
      ddp__wait_ended(&c->wait, DDP__WAIT_YIELDED, now - t0);
      return DDP_OK;
    }
    sched_yield();
  }
  int64_t start = ddp_now_ns(), last_check = start;
  ddp__wait_ended(&c->wait, DDP__WAIT_SLEPT, start - t0);
  for (;;) {
    atomic_fetch_add(&h->waiters, 1); /* before the event word and the last look (wake) */
    uint32_t ev = atomic_load(&h->event);
    bool done = false;
    ddp_status_t st = sleep_checks(c, pred, arg, desc, peer, start, &last_check, &done, err);
    if (st == DDP_OK && !done) {
      int64_t left = DDP_MIN(c->deadline_ns - ddp_now_ns(), SLICE_NS);
      if (left < 1) left = 1;
      struct timespec ts = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
      syscall(SYS_futex, (uint32_t *)&h->event, FUTEX_WAIT, ev, &ts, NULL, 0);
    }
    atomic_fetch_sub(&h->waiters, 1);
    if (st != DDP_OK || done) return st;
  }
}

/* ---- barrier ---- */

static bool barrier_done(ddp__comm_t *c, const void *arg) {
  for (int j = 0; j < c->size; j++)
    if (atomic_load(&line(c, j)->barrier) < c->barriers) return false;
  return true;
}

static void barrier_desc(ddp__comm_t *c, const void *arg, char *buf, size_t n) {
  size_t o = (size_t)snprintf(buf, n, "in a barrier waiting for");
  const char *sep = " ";
  for (int j = 0; j < c->size && o < n; j++)
    if (atomic_load(&line(c, j)->barrier) < c->barriers) {
      o += (size_t)snprintf(buf + o, n - o, "%srank %d (pid %d)", sep, j, (int)slot(c, j)->pid);
      sep = ", ";
    }
}

/* What a barrier that ends a stamped allreduce's publication waits for besides the counts. */
typedef struct stamped_wait {
  size_t lines;        /* stamped lines per rank */
  const ddp__fp_t *fp; /* this rank's collective */
} stamped_wait_t;

/* barrier_done, and every peer's first `lines` stamped lines carry this barrier's count.
 * Every line is loaded in every pass (no early exit), so that the misses of one pass
 * overlap. A peer that reached the barrier with another collective (its fingerprint differs)
 * stamps nothing: it counts as done, and enter() reports the mismatch on every rank. */
static bool stamped_done(ddp__comm_t *c, const void *arg) {
  const stamped_wait_t *sw = arg;
  bool done = true;
  for (int j = 0; j < c->size; j++) {
    const ext_line_t *e = ext(c, j, c->par);
    bool in = atomic_load_explicit(&line(c, j)->barrier, memory_order_acquire) >= c->barriers;
    bool stamped = true;
    for (size_t i = 0; i < sw->lines; i++)
      stamped &= atomic_load_explicit(&e[i].stamp, memory_order_acquire) >= c->barriers;
    done &= in && (stamped || !ddp__fp_equal(&line(c, j)->fp, sw->fp));
  }
  return done;
}

/* A barrier that, with sw, also waits for the peers' stamped lines (stamped_done). */
static ddp_status_t barrier_with(ddp__comm_t *c, const stamped_wait_t *sw, ddp_error_t *err) {
  c->barriers++;
  atomic_store(&line(c, c->rank)->barrier, c->barriers);
  signal_peers(c);
  if (sw) return wait_for(c, stamped_done, sw, barrier_desc, -1, err);
  return wait_for(c, barrier_done, NULL, barrier_desc, -1, err);
}

static ddp_status_t barrier(ddp__comm_t *c, ddp_error_t *err) { return barrier_with(c, NULL, err); }

/* ---- collectives ---- */

/* Asks for the cache lines of [p, p + n) ahead of use, all at once (the misses overlap);
 * `write`: in exclusive state (PREFETCHW, a no-op on x86 processors without it). */
static void prefetch_lines(const void *p, size_t n, bool write) {
  const char *b = (const char *)((uintptr_t)p & ~(uintptr_t)63), *e = (const char *)p + n;
  for (; b < e; b += 64) {
#if defined(__x86_64__) || defined(__i386__)
    if (write)
      __asm__ volatile("prefetchw %0" ::"m"(*b));
    else
      __builtin_prefetch(b, 0, 3);
#else
    __builtin_prefetch(b, write, 3);
#endif
  }
}

/* Enters the collective's first barrier with this rank's line published (the caller has
 * filled its handles or data) and compares the fingerprints: every rank sees the same set,
 * so every rank reaches the same verdict. */
static ddp_status_t enter(ddp__comm_t *c, const ddp__coll_t *op, size_t stamped, ddp_error_t *err) {
  stamped_wait_t sw = {stamped, &op->fp};
  line(c, c->rank)->fp = op->fp;
  DDP_CHECK(barrier_with(c, stamped ? &sw : NULL, err));
  /* Every peer has entered this collective, so none reads this rank's line of the other
   * parity any more: take it back into this cache now (the peers' polls left it shared
   * there), and the next collective publishes with a local store instead of first waiting
   * for the peers' copies to be invalidated. */
  prefetch_lines(&slot(c, c->rank)->line[!c->par], sizeof(pub_line_t), true);
  /* The same for the box of the other parity, if the collective before this one filled it
   * (up to a cap: beyond it the transfers are a small part of the copy). */
  if (c->box_dirty[!c->par]) {
    prefetch_lines(box(c, c->rank, (uint64_t)!c->par), DDP_MIN(c->box_dirty[!c->par], BOX_TAKE_MAX),
                   true);
    c->box_dirty[!c->par] = 0;
  }
  if (c->ext_dirty[!c->par]) {
    prefetch_lines(ext(c, c->rank, !c->par), c->ext_dirty[!c->par] * sizeof(ext_line_t), true);
    c->ext_dirty[!c->par] = 0;
  }
  for (int j = 0; c->check_fp && j < c->size; j++) {
    const ddp__fp_t *fp = &line(c, j)->fp;
    if (!ddp__fp_equal(fp, &op->fp)) {
      char a[160], b[160];
      ddp__fp_str(&op->fp, a, sizeof a);
      ddp__fp_str(fp, b, sizeof b);
      return ddp__error_quiet(err, DDP_ERR_DESYNC,
                              "mismatched collectives: rank %d runs %s, but rank %d runs %s",
                              c->rank, a, j, b);
    }
  }
  return DDP_OK;
}

/* Whether rank j's published buffers (its line's handles) are in shared memory. */
static bool published_shared(ddp__comm_t *c, int j) {
  return line(c, j)->u.h[0] != UINT64_MAX && line(c, j)->u.h[1] != UINT64_MAX;
}

/* enter() with this rank's buffers published. *direct = every rank's buffers are readable
 * by all. */
static ddp_status_t begin(ddp__comm_t *c, const ddp__coll_t *op, const void *in, size_t in_bytes,
                          const void *out, size_t out_bytes, bool *direct, ddp_error_t *err) {
  pub_line_t *me = line(c, c->rank);
  me->u.h[0] = in_bytes ? c->sh->to_handle(c->state, in, in_bytes) : 0;
  me->u.h[1] = out_bytes ? c->sh->to_handle(c->state, out, out_bytes) : 0;
  DDP_CHECK(enter(c, op, 0, err));
  *direct = true;
  for (int j = 0; j < c->size; j++) *direct &= published_shared(c, j);
  return DDP_OK;
}

static const unsigned char *peer_in(ddp__comm_t *c, int j) {
  return c->sh->from_handle(c->state, line(c, j)->u.h[0]);
}
static const unsigned char *peer_out(ddp__comm_t *c, int j) {
  return c->sh->from_handle(c->state, line(c, j)->u.h[1]);
}

/* The direct canonical allreduce (below), after begin() or enter() found every rank's
 * buffers in shared memory. */
static ddp_status_t allreduce_direct(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), lo, len, blk = DDP_REDUCE_TMP_BYTES / es;
  int W = c->size, r = c->rank;
  unsigned char *out = op->recv, *dsts[DDP_PG_MAX_WORLD];
  const void *srcs[DDP_PG_MAX_WORLD];
  ddp_coll_part(op->count, W, r, &lo, &len);
  for (int j = 0; j < W; j++) dsts[j] = (unsigned char *)peer_out(c, j) + lo * es;
  for (size_t off = 0; off < len; off += blk) {
    size_t m = DDP_MIN(blk, len - off);
    for (int j = 0; j < W; j++) srcs[j] = peer_in(c, j) + (lo + off) * es;
    ddp_reduce_fold(op->dt, op->op, W, srcs, out + (lo + off) * es, m, c->tmp, W);
    for (int j = 0; j < W; j++)
      if (j != r) memcpy(dsts[j] + off * es, out + (lo + off) * es, m * es);
  }
  return barrier(c, err);
}

/* Allreduce AUTO, from the small bound up to BOX_BYTES (src/pg resolves it so): the box
 * when buffers are private, canonical when they are shared. A fold of the whole vector from
 * a peer's box moves all of it between the cores, and the take-back of the box moves it
 * again; canonical moves half of it each way, both ranks at once (ddp-bench, W = 2, shared
 * buffers, alternating runs, median ratio of p50 canonical / box: 512 B 1.09-1.18, 1 KiB
 * 0.71-0.84, 2 KiB 0.57-0.62, 4 KiB 0.47-0.49, 8-16 KiB 0.27-0.54; with private buffers
 * canonical copies through the staging area behind three barriers and loses: 1-4 KiB
 * 1.33-1.55, 16 KiB 0.87). Each rank publishes its buffers' handles in its line and fills its
 * box only when they are private, so after the first barrier every rank sees the same
 * handles and takes the same path: canonical when all are shared; otherwise the fold of
 * every rank's input in rank order, from its box or, where shared, from its buffer. A rank
 * whose buffer peers read must not write its output before they are done: its fold goes
 * to scratch, and after a barrier that every rank joins (all see the same handles) it
 * copies the result out. */
static ddp_status_t allreduce_auto(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t bytes = op->count * ddp_dtype_size(op->dt);
  int W = c->size, r = c->rank;
  const void *srcs[DDP_PG_MAX_WORLD];
  line(c, r)->u.h[0] = c->sh->to_handle(c->state, op->send, bytes);
  line(c, r)->u.h[1] = c->sh->to_handle(c->state, op->recv, bytes);
  bool read_by_peers = published_shared(c, r);
  if (!read_by_peers) {
    memcpy(box(c, r, op->fp.seq), op->send, bytes);
    c->box_dirty[c->par] = bytes; /* the next collective's enter() takes it back */
  }
  DDP_CHECK(enter(c, op, 0, err));
  bool all_shared = true, any_shared = false;
  for (int j = 0; j < W; j++) {
    all_shared &= published_shared(c, j);
    any_shared |= published_shared(c, j);
  }
  if (all_shared) return allreduce_direct(c, op, err);
  for (int j = 0; j < W; j++) {
    srcs[j] = j == r ? op->send : published_shared(c, j) ? peer_in(c, j) : box(c, j, op->fp.seq);
    if (j != r) prefetch_lines(srcs[j], bytes, false); /* all misses at once */
  }
  unsigned char *dst = read_by_peers ? c->scratch : op->recv;
  ddp_reduce_fold(op->dt, op->op, W, srcs, dst, op->count, c->tmp, W);
  if (!any_shared) return DDP_OK;
  DDP_CHECK(barrier(c, err)); /* every rank, when any reads a peer's buffer */
  if (read_by_peers) memcpy(op->recv, dst, bytes);
  return DDP_OK;
}

/* Allreduce. Direct, canonical: rank r owns slice r. It folds slice r of every rank's
 * input in rank order, one cache-sized block at a time, into its own output, and copies
 * each folded block, still in cache, into slice r of every other rank's output; a last
 * barrier keeps buffers alive until every rank has written its slice everywhere. Nobody
 * else reads or writes slice r of any buffer, so in-place buffers are safe: a block is read
 * from every input before it is written to any output. Each rank reads n elements and
 * writes n, where a reduce-scatter followed by an all-gather would read 2n - n/W and need
 * a third barrier (16-27% less memory traffic, the bound for large messages). Direct, small: every
 * rank folds the whole vector into private scratch; after one barrier nobody reads inputs any more
 * and each copies its result out (two barriers instead of three). Staging: the canonical scheme per
 * chunk of the staging area: each rank stages only the slices its peers fold (slice r of its
 * input is read by itself alone, from the caller's buffer), folds slice r block by block into its
 * own output and copies each folded block, still in cache, into its staging for the peers, then
 * copies the peers' slices out. With W = 2 a rank reads 2.5n bytes (n/2 of them in cache) and
 * writes 2n, where staging the whole input and copying the whole result back read 3n and wrote
 * 2.5n. */
static ddp_status_t allreduce(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count, lo, len;
  int W = c->size, r = c->rank;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  const void *srcs[DDP_PG_MAX_WORLD];
  bool direct;
  if (op->algo == DDP_ALGO_SMALL && n * es <= BOX_BYTES) {
    /* One barrier: the input is copied into this rank's line (up to INLINE_BYTES), its line
     * and stamped lines (up to STAMPED_BYTES) or its box of this parity before the barrier
     * of enter(), and every rank folds them in rank order after it. The caller may reuse
     * its buffers at once (nothing reads them), and the lines and the box are written again
     * only by the collective after next, which starts after every rank has passed the next
     * one's barrier, so after every rank has finished reading this one. */
    size_t bytes = n * es;
    if (bytes <= STAMPED_BYTES) {
      size_t head = DDP_MIN(bytes, (size_t)INLINE_BYTES), k = 0;
      for (size_t off = head; off < bytes; off += EXT_BYTES, k++) {
        ext_line_t *e = ext(c, r, c->par) + k;
        memcpy(e->data, in + off, DDP_MIN((size_t)EXT_BYTES, bytes - off));
        atomic_store_explicit(&e->stamp, c->barriers + 1, memory_order_release);
      }
      c->ext_dirty[c->par] = k; /* the next collective's enter() takes them back */
      memcpy(line(c, r)->u.data, in, head);
      DDP_CHECK(enter(c, op, k, err));
      /* Up to INLINE_BYTES the fold reads the lines; beyond, every rank's pieces are
       * gathered in tmp first, then folded once (a fold per line costs more than the
       * copies). out is the caller's buffer: no source overlaps it, so the fold needs no
       * accumulator of its own. */
      for (int j = 0; j < W; j++) {
        srcs[j] = line(c, j)->u.data;
        if (!k) continue;
        unsigned char *g = c->tmp + (size_t)j * bytes;
        memcpy(g, srcs[j], head);
        for (size_t off = head, i = 0; off < bytes; off += EXT_BYTES, i++)
          memcpy(g + off, ext(c, j, c->par)[i].data, DDP_MIN((size_t)EXT_BYTES, bytes - off));
        srcs[j] = g;
      }
      if (n) ddp_reduce_fold(op->dt, op->op, W, srcs, out, n, NULL, W);
      return DDP_OK;
    }
    memcpy(box(c, r, op->fp.seq), in, bytes);
    DDP_CHECK(enter(c, op, 0, err));
    for (int j = 0; j < W; j++) {
      srcs[j] = box(c, j, op->fp.seq);
      if (j != r) prefetch_lines(srcs[j], bytes, false); /* all misses at once */
    }
    c->box_dirty[c->par] = bytes; /* the next collective's enter() takes it back */
    ddp_reduce_fold(op->dt, op->op, W, srcs, out, n, c->tmp, W);
    return DDP_OK;
  }
  if (op->algo == DDP_ALGO_AUTO && n > 0 && n * es <= BOX_BYTES) return allreduce_auto(c, op, err);
  DDP_CHECK(begin(c, op, in, n * es, out, n * es, &direct, err));
  if (n == 0) return DDP_OK;
  if (direct && op->algo == DDP_ALGO_SMALL && n * es <= c->scratch_bytes) {
    for (int j = 0; j < W; j++) srcs[j] = peer_in(c, j);
    ddp_reduce_fold(op->dt, op->op, W, srcs, c->scratch, n, c->tmp, W);
    DDP_CHECK(barrier(c, err));
    memcpy(out, c->scratch, n * es);
    return DDP_OK;
  }
  if (direct) return allreduce_direct(c, op, err);
  size_t chunk = c->sh->staging_bytes / es, blk = DDP_REDUCE_TMP_BYTES / es;
  unsigned char *const *stg = c->sh->staging;
  for (size_t b = 0; b < n; b += chunk) {
    size_t m = DDP_MIN(chunk, n - b), end;
    ddp_coll_part(m, W, r, &lo, &len);
    end = lo + len;
    memcpy(stg[r], in + b * es, lo * es); /* slice r of the input is read by this rank only */
    memcpy(stg[r] + end * es, in + (b + end) * es, (m - end) * es);
    DDP_CHECK(barrier(c, err));
    for (size_t off = 0; off < len; off += blk) {
      size_t k = DDP_MIN(blk, len - off), at = lo + off;
      for (int j = 0; j < W; j++) srcs[j] = j == r ? in + (b + at) * es : stg[j] + at * es;
      ddp_reduce_fold(op->dt, op->op, W, srcs, out + (b + at) * es, k, c->tmp, W);
      memcpy(stg[r] + at * es, out + (b + at) * es, k * es); /* for the peers, still in cache */
    }
    DDP_CHECK(barrier(c, err));
    for (int j = 0; j < W; j++) {
      if (j == r) continue;
      ddp_coll_part(m, W, j, &lo, &len);
      memcpy(out + (b + lo) * es, stg[j] + lo * es, len * es);
    }
    DDP_CHECK(barrier(c, err));
  }
  return DDP_OK;
}

/* Broadcast: peers copy from the root's buffer (direct) or from its staging, per chunk. */
static ddp_status_t broadcast(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count;
  int root = op->root;
  unsigned char *buf = op->recv;
  bool direct;
  DDP_CHECK(begin(c, op, buf, n * es, NULL, 0, &direct, err));
  if (n == 0) return DDP_OK;
  if (direct) {
    if (c->rank != root) memcpy(buf, peer_in(c, root), n * es);
    return barrier(c, err);
  }
  size_t chunk = c->sh->staging_bytes / es;
  for (size_t b = 0; b < n; b += chunk) {
    size_t m = DDP_MIN(chunk, n - b);
    if (c->rank == root) memcpy(c->sh->staging[root], buf + b * es, m * es);
    DDP_CHECK(barrier(c, err));
    if (c->rank != root) memcpy(buf + b * es, c->sh->staging[root], m * es);
    DDP_CHECK(barrier(c, err));
  }
  return DDP_OK;
}

/* Allgather: block j of the output comes from rank j's input. */
static ddp_status_t allgather(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count;
  int W = c->size, r = c->rank;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  bool direct;
  DDP_CHECK(begin(c, op, in, n * es, out, W * n * es, &direct, err));
  if (n == 0) return DDP_OK;
  if (direct) {
    for (int j = 0; j < W; j++) {
      const unsigned char *src = j == r ? in : peer_in(c, j);
      if (src != out + j * n * es) memmove(out + j * n * es, src, n * es);
    }
    return barrier(c, err);
  }
  size_t chunk = c->sh->staging_bytes / es;
  for (size_t b = 0; b < n; b += chunk) {
    size_t m = DDP_MIN(chunk, n - b);
    memcpy(c->sh->staging[r], in + b * es, m * es);
    DDP_CHECK(barrier(c, err));
    for (int j = 0; j < W; j++) memcpy(out + (j * n + b) * es, c->sh->staging[j], m * es);
    DDP_CHECK(barrier(c, err));
  }
  return DDP_OK;
}

/* Reduce-scatter and alltoall share a shape: rank r needs block r of every rank's input.
 * Reduce-scatter folds those blocks in rank order; alltoall places them side by side.
 * Staging carries, per chunk, the chunk of every block of the owner's input. */
static ddp_status_t blocks(ddp__comm_t *c, const ddp__coll_t *op, bool reduce, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count;
  int W = c->size, r = c->rank;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  const void *srcs[DDP_PG_MAX_WORLD];
  bool direct;
  DDP_CHECK(begin(c, op, in, W * n * es, out, reduce ? n * es : W * n * es, &direct, err));
  if (n == 0) return DDP_OK;
  if (direct) {
    for (int j = 0; j < W; j++) srcs[j] = (j == r ? in : peer_in(c, j)) + (size_t)r * n * es;
    if (reduce) {
      ddp_reduce_fold(op->dt, op->op, W, srcs, out, n, c->tmp, W);
    } else {
      for (int j = 0; j < W; j++) memcpy(out + j * n * es, srcs[j], n * es);
    }
    return barrier(c, err);
  }
  size_t chunk = c->sh->staging_bytes / ((size_t)W * es);
  unsigned char *const *stg = c->sh->staging;
  for (size_t b = 0; b < n; b += chunk) {
    size_t m = DDP_MIN(chunk, n - b);
    for (int k = 0; k < W; k++) memcpy(stg[r] + k * m * es, in + (k * n + b) * es, m * es);
    DDP_CHECK(barrier(c, err));
    for (int j = 0; j < W; j++) srcs[j] = stg[j] + (size_t)r * m * es;
    if (reduce) {
      ddp_reduce_fold(op->dt, op->op, W, srcs, out + b * es, m, c->tmp, W);
    } else {
      for (int j = 0; j < W; j++) memcpy(out + (j * n + b) * es, srcs[j], m * es);
    }
    DDP_CHECK(barrier(c, err));
  }
  return DDP_OK;
}

/* ---- point to point ----
 * The sender copies a chunk into its staging area, records its size (and, with the first
 * chunk, its fingerprint) in the pair's cell and bumps `posted`; the receiver copies it out
 * and bumps `acked`, which frees the staging area for the next chunk. A receiver whose
 * fingerprint differs marks `acked` with the mismatch bit and leaves its own fingerprint,
 * so both ends report DESYNC. */

typedef struct p2p_wait {
  pair_cell_t *cell;
  uint64_t want;
  int peer;
  bool sender;
} p2p_wait_t;

static bool p2p_ready(ddp__comm_t *c, const void *arg) {
  const p2p_wait_t *w = arg;
  return (w->sender ? atomic_load(&w->cell->acked) & ~P2P_DESYNC : atomic_load(&w->cell->posted)) >=
         w->want;
}

static void p2p_desc(ddp__comm_t *c, const void *arg, char *buf, size_t n) {
  const p2p_wait_t *w = arg;
  snprintf(buf, n, "waiting for rank %d (pid %d) to %s chunk %llu", w->peer,
           (int)slot(c, w->peer)->pid, w->sender ? "take" : "post", (unsigned long long)w->want);
}

static ddp_status_t p2p(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), bytes = op->count * es, C = c->sh->staging_bytes;
  int peer = op->root;
  bool sender = op->kind == DDP_COLL_SEND;
  p2p_wait_t w = {sender ? cell(c, c->rank, peer) : cell(c, peer, c->rank), 0, peer, sender};
  size_t off = 0;
  do {
    size_t m = DDP_MIN(C, bytes - off);
    if (sender) {
      memcpy(c->sh->staging[c->rank], (const unsigned char *)op->send + off, m);
      w.cell->bytes = m;
      if (off == 0) w.cell->fp = op->fp;
      w.want = ++c->p2p_tx[peer];
      atomic_store(&w.cell->posted, w.want);
      signal_peers(c);
      DDP_CHECK(wait_for(c, p2p_ready, &w, p2p_desc, peer, err));
      if (atomic_load(&w.cell->acked) & P2P_DESYNC) {
        char a[160], b[160];
        ddp__fp_str(&op->fp, a, sizeof a);
        ddp__fp_str(&w.cell->rfp, b, sizeof b);
        return ddp__error_quiet(err, DDP_ERR_DESYNC,
                                "mismatched point-to-point: rank %d sends %s, but rank %d "
                                "expects %s",
                                c->rank, a, peer, b);
      }
    } else {
      w.want = ++c->p2p_rx[peer];
      DDP_CHECK(wait_for(c, p2p_ready, &w, p2p_desc, peer, err));
      if ((off == 0 && !ddp__fp_equal(&w.cell->fp, &op->fp)) || w.cell->bytes != m) {
        char a[160], b[160];
        ddp__fp_str(&op->fp, a, sizeof a);
        ddp__fp_str(&w.cell->fp, b, sizeof b);
        w.cell->rfp = op->fp;
        atomic_store(&w.cell->acked, w.want | P2P_DESYNC);
        wake(c);
        return ddp__error_quiet(err, DDP_ERR_DESYNC,
                                "mismatched point-to-point: rank %d expects %s, but rank %d "
                                "sends %s",
                                c->rank, a, peer, b);
      }
      memcpy((unsigned char *)op->recv + off, c->sh->staging[peer], m);
      atomic_store(&w.cell->acked, w.want);
      signal_peers(c);
    }
    off += m;
  } while (off < bytes);
  return DDP_OK;
}

ddp_status_t ddp__run_shared(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  DDP_CHECK(check_failed(c, err));
  c->par = (int)(op->fp.seq & 1); /* point-to-point has no line and ignores it */
  switch (op->kind) {
    case DDP_COLL_ALLREDUCE: return allreduce(c, op, err);
    case DDP_COLL_BROADCAST: return broadcast(c, op, err);
    case DDP_COLL_ALLGATHER: return allgather(c, op, err);
    case DDP_COLL_REDUCE_SCATTER: return blocks(c, op, true, err);
    case DDP_COLL_ALLTOALL: return blocks(c, op, false, err);
    case DDP_COLL_BARRIER: return enter(c, op, 0, err);
    case DDP_COLL_SEND:
    case DDP_COLL_RECV: return p2p(c, op, err);
  }
  return ddp__error_quiet(err, DDP_ERR_INTERNAL, "unknown operation kind %d", (int)op->kind);
}
