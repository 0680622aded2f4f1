/* Collectives for the link family (tcp): the backend moves bytes between pairs of ranks,
 * one batch of concurrent sends and receives at a time (ddp_backend_ops_t.xfer).
 *
 * Every collective starts with an all-to-all of 32-byte fingerprints, so every rank sees
 * every other rank's (seq, op, dtype, count, root, algorithm) before any payload moves and
 * all ranks reach the same DESYNC verdict. Payload sizes then follow from the agreed
 * fingerprint, so the byte streams never lose their framing. */
#include <stdio.h>
#include <string.h>

#include "algo/algo.h"

#define MAXW DDP_PG_MAX_WORLD

static ddp_status_t xfer_idle(ddp__comm_t *c, ddp_xfer_t *ops, size_t n, ddp_xfer_idle_t *idle,
                              ddp_error_t *err) {
  ddp_status_t st = n ? c->ops->xfer(c->state, ops, n, idle, c->deadline_ns, err) : DDP_OK;
  if (st == DDP_OK && idle && !idle->ran) {
    idle->ran = true;
    idle->fn(idle->arg);
  }
  return st;
}

static ddp_status_t xfer(ddp__comm_t *c, ddp_xfer_t *ops, size_t n, ddp_error_t *err) {
  return xfer_idle(c, ops, n, NULL, err);
}

/* Adds a transfer unless it is empty (both ends compute the same sizes). */
static void add(ddp_xfer_t *ops, size_t *n, int peer, bool is_send, const void *buf, size_t bytes) {
  if (bytes == 0) return;
  ops[*n] = (ddp_xfer_t){.peer = peer, .is_send = is_send, .buf = (void *)buf, .bytes = bytes};
  (*n)++;
}

/* DDP_ERR_DESYNC naming the first peer whose fingerprint (fps[j]) differs from op's. */
static ddp_status_t verify_fps(ddp__comm_t *c, const ddp__coll_t *op, const ddp__fp_t *fps,
                               ddp_error_t *err) {
  for (int j = 0; j < c->size; j++) {
    if (j == c->rank || ddp__fp_equal(&fps[j], &op->fp)) continue;
    char a[160], b[160];
    ddp__fp_str(&op->fp, a, sizeof a);
    ddp__fp_str(&fps[j], b, sizeof b);
    return ddp__error_quiet(err, DDP_ERR_DESYNC,
                            "mismatched collectives: rank %d runs %s, but rank %d runs %s", c->rank,
                            a, j, b);
  }
  return DDP_OK;
}

/* Sends `msg` (msg_bytes, starting with this rank's fingerprint), then `payload`
 * (payload_bytes, as the send's tail: stream backends only), to every peer, receives every
 * peer's fingerprint, and compares. A collective can append its first payload to the
 * fingerprint, in msg or as the payload, so that it travels in the same segment (one
 * network round trip fewer); receivers still read only the 32 fingerprint bytes here, so
 * ranks that disagree on the payload size all read each other's fingerprints and all
 * report DESYNC. A receiver may also take what already followed a peer's fingerprint (the
 * payload of the agreed size; ddp_xfer_t's tail): into tail + j * tail_bytes for peer j, up
 * to tail_bytes, with the count in got[j]. What a peer whose fingerprint differs sent past it is
 * never used: DESYNC fails the group. tail NULL = fingerprints only. */
static ddp_status_t exchange_fps(ddp__comm_t *c, const ddp__coll_t *op, const void *msg,
                                 size_t msg_bytes, const void *payload, size_t payload_bytes,
                                 unsigned char *tail, size_t tail_bytes, size_t *got,
                                 ddp_error_t *err) {
  ddp__fp_t fps[MAXW];
  ddp_xfer_t ops[2 * MAXW];
  size_t n = 0;
  for (int j = 0; j < c->size; j++) {
    if (j == c->rank) continue;
    add(ops, &n, j, true, msg, msg_bytes);
    if (payload_bytes) {
      ops[n - 1].tail = (void *)payload;
      ops[n - 1].tail_bytes = payload_bytes;
    }
    add(ops, &n, j, false, &fps[j], sizeof fps[j]);
    if (tail) {
      ops[n - 1].tail = tail + (size_t)j * tail_bytes;
      ops[n - 1].tail_bytes = tail_bytes;
    }
  }
  DDP_CHECK(xfer(c, ops, n, err));
  for (size_t i = 0; tail && i < n; i++)
    if (!ops[i].is_send) got[ops[i].peer] = ops[i].tail_done;
  return verify_fps(c, op, fps, err);
}

static ddp_status_t check_fps(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  return exchange_fps(c, op, &op->fp, sizeof op->fp, NULL, 0, NULL, 0, NULL, err);
}

/* Owner-computes reduction over slices (the canonical order, D2). Rank r owns the element
 * range [lo_r, lo_r + len_r) of a vector of which every rank holds a contribution at
 * in_j + base_j (base_j = the offset of that range in rank j's input). The ranges are
 * walked in segments of `seg` elements (segment_elems). Segment s moves in one batch: every rank
 * sends segment s of each peer's range to that peer and receives segment s of its own range from
 * every peer into per-source scratch. The fold of segment s (the W contributions in rank
 * order into out) runs inside the batch of segment s + 1, the first time that batch waits
 * for the network (ddp_xfer_idle_t), so the reduction of one segment overlaps the transfer
 * of the next. Scratch is two sets of W segments, used alternately, whatever the message
 * size (a slice in one part of up to two segments uses one set). Sends and receives of a segment
 * stay in one batch, so no rank can block on a full socket while its peer does the same.
 *
 * Fingerprints. The caller has not exchanged them. When the first segment sent to each
 * peer is at most FP_PIGGYBACK bytes, it follows this rank's fingerprint on the same stream
 * in the first batch, which receives only the peers' 32-byte fingerprints; after the
 * verdict, the peers' first segments (already on their way) are received. So the check
 * costs no round trip of its own. The bound keeps fingerprint and segment within what any
 * socket buffers hold, so ranks that disagree (and stop reading after the fingerprint)
 * never block each other's sends. Larger segments, and message backends (MPI completes a
 * send only once the receiver has posted for it), exchange fingerprints first. */
#define FP_PIGGYBACK (64u * 1024u)

/* The segment, in elements, that walks slices of at most maxlen elements: a slice of up to
 * two of the group's segments (seg elements) goes whole, a longer one in the fewest equal
 * parts of at most seg, rounded up to 64 bytes. On loopback a segment is two copies by the
 * kernel and a fold on a CPU the ranks keep busy, so for two segments the pipeline costs
 * more than the overlap it buys (ddp-bench --segment, W = 2, tcp, 256 KiB segments,
 * alternating runs, median ratio of p50 to two segments: slice 384 KiB whole 0.87, 512 KiB
 * 0.78-0.89; a 640 or 768 KiB slice whole was 1.13-1.27x slower than in 256 KiB segments,
 * and parts of 512 KiB made later collectives slower). The fold order does not depend on
 * it; every rank computes the same parts from the agreed count and segment. */
static size_t segment_elems(const ddp__comm_t *c, size_t es, size_t maxlen) {
  size_t seg = c->segment_bytes / es, align = DDP_MAX(64 / es, (size_t)1);
  size_t parts = (maxlen + seg - 1) / seg;
  if (parts <= 2) return DDP_MAX(maxlen, (size_t)1);
  size_t part = (maxlen + parts - 1) / parts;
  return (part + align - 1) / align * align;
}

typedef struct fold_job {
  ddp__comm_t *c;
  const ddp__coll_t *op;
  const void *srcs[MAXW];
  unsigned char *dst;
  size_t n;
} fold_job_t;

static void fold_job_run(void *arg) {
  fold_job_t *f = arg;
  ddp_reduce_fold(f->op->dt, f->op->op, f->c->size, f->srcs, f->dst, f->n, f->c->tmp, f->c->size);
}

static ddp_status_t reduce_owned(ddp__comm_t *c, const ddp__coll_t *op, const unsigned char *in,
                                 const size_t *src_off, const size_t *len, unsigned char *out,
                                 ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), maxlen = 0;
  int W = c->size, r = c->rank;
  for (int j = 0; j < W; j++) maxlen = DDP_MAX(maxlen, len[j]);
  size_t seg = segment_elems(c, es, maxlen);
  bool piggy = c->check_fp && c->ops->stream && DDP_MIN(seg, maxlen) * es <= FP_PIGGYBACK;
  if (!piggy && c->check_fp) DDP_CHECK(check_fps(c, op, err));
  ddp_xfer_t ops[3 * MAXW];
  ddp__fp_t fps[MAXW];
  fold_job_t job = {.c = c, .op = op};
  ddp_xfer_idle_t idle = {fold_job_run, &job, true};
  /* Iteration s moves segment s (when there is one) while folding segment s - 1. */
  for (size_t s = 0; s == 0 || (s - 1) * seg < maxlen; s++) {
    size_t n = 0, b = s * seg;
    bool with_fp = s == 0 && piggy;
    unsigned char *scr = c->scratch + (s & 1) * (size_t)W * seg * es;
    size_t mine = len[r] > b ? DDP_MIN(seg, len[r] - b) : 0;
    for (int j = 0; j < W; j++) {
      if (j == r) continue;
      size_t theirs = len[j] > b ? DDP_MIN(seg, len[j] - b) : 0;
      if (with_fp) add(ops, &n, j, true, &op->fp, sizeof op->fp);
      if (b < maxlen) add(ops, &n, j, true, in + (src_off[j] + b) * es, theirs * es);
      if (with_fp) { /* the segment that follows may come in the same receive */
        add(ops, &n, j, false, &fps[j], sizeof fps[j]);
        ops[n - 1].tail = scr + (size_t)j * seg * es;
        ops[n - 1].tail_bytes = b < maxlen ? mine * es : 0;
      } else if (b < maxlen) {
        add(ops, &n, j, false, scr + (size_t)j * seg * es, mine * es);
      }
    }
    idle.ran = s == 0; /* nothing to fold before the first segment */
    DDP_CHECK(xfer_idle(c, ops, n, &idle, err));
    if (with_fp) {
      DDP_CHECK(verify_fps(c, op, fps, err));
      size_t got[MAXW] = {0}, k = 0;
      for (size_t i = 0; i < n; i++)
        if (!ops[i].is_send) got[ops[i].peer] = ops[i].tail_done;
      for (int j = 0; j < W && b < maxlen; j++)
        if (j != r) add(ops, &k, j, false, scr + (size_t)j * seg * es + got[j], mine * es - got[j]);
      DDP_CHECK(xfer(c, ops, k, err));
    }
    if (b >= maxlen) break;
    job.dst = out + b * es;
    job.n = mine;
    for (int j = 0; j < W; j++)
      job.srcs[j] = j == r ? in + (src_off[r] + b) * es : scr + (size_t)j * seg * es;
  }
  return DDP_OK;
}

/* Canonical allreduce: reduce_owned over the balanced partition, then an all-gather in
 * which every owner sends its finished slice to every peer, received straight into the
 * output, in batches of one segment per peer and direction, like the fold phase (measured
 * on loopback, W = 2, 256 KiB segments: 4 MiB took 1.5-2.3 ms with each slice in one
 * batch, 0.8-1.0 ms in segments). */
static ddp_status_t allreduce_canonical(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count, lo[MAXW] = {0}, len[MAXW] = {0};
  int W = c->size, r = c->rank;
  unsigned char *out = op->recv;
  for (int j = 0; j < W; j++) ddp_coll_part(n, W, j, &lo[j], &len[j]);
  DDP_CHECK(reduce_owned(c, op, op->send, lo, len, out + lo[r] * es, err));
  size_t maxlen = 0;
  for (int j = 0; j < W; j++) maxlen = DDP_MAX(maxlen, len[j]);
  size_t seg = segment_elems(c, es, maxlen);
  for (size_t b = 0; b < maxlen; b += seg) {
    ddp_xfer_t ops[2 * MAXW];
    size_t k = 0;
    for (int j = 0; j < W; j++) {
      if (j == r) continue;
      add(ops, &k, j, true, out + (lo[r] + b) * es, len[r] > b ? DDP_MIN(seg, len[r] - b) * es : 0);
      add(ops, &k, j, false, out + (lo[j] + b) * es,
          len[j] > b ? DDP_MIN(seg, len[j] - b) * es : 0);
    }
    DDP_CHECK(xfer(c, ops, k, err));
  }
  return DDP_OK;
}

/* Small allreduce: every rank sends its whole vector to every peer and folds all W in rank
 * order itself. One round of messages instead of two; W times the bytes, so only below
 * the size table's threshold. On stream backends (with_fp, up to FP_PIGGYBACK bytes) the
 * vector follows the fingerprint in the same send call (run_link skips the separate
 * fingerprint round), so a small allreduce costs one network round trip, and the receive
 * that takes a peer's fingerprint also takes whatever of its vector has arrived behind it (the
 * tail: one receive call fewer; measured on loopback, W = 2, 4 B to 16 KiB: 8.1-8.4 to 6.9-7.1 us
 * p50 with the abort check below, docs/benchmarks.md). A peer that sent its message
 * and then failed or aborted before completing is caught by a zero-byte probe receive
 * (tcp: its stream ended without the goodbye of an orderly destroy), so this rank fails
 * with it instead of completing on data from an aborted collective. */
static ddp_status_t allreduce_small(ddp__comm_t *c, const ddp__coll_t *op, bool with_fp,
                                    ddp_error_t *err) {
  size_t bytes = op->count * ddp_dtype_size(op->dt);
  int W = c->size, r = c->rank;
  ddp_xfer_t ops[2 * MAXW];
  const void *srcs[MAXW];
  size_t k = 0, got[MAXW] = {0};
  if (with_fp && sizeof op->fp + bytes <= DDP_REDUCE_TMP_BYTES) {
    /* one buffer where it fits: a copy costs less than a send in two parts (loopback,
     * W = 2, 4 B-4 KiB: p50 1.08-1.17x slower with the send tail) */
    memcpy(c->tmp, &op->fp, sizeof op->fp);
    memcpy(c->tmp + sizeof op->fp, op->send, bytes);
    DDP_CHECK(
        exchange_fps(c, op, c->tmp, sizeof op->fp + bytes, NULL, 0, c->scratch, bytes, got, err));
  } else if (with_fp) {
    DDP_CHECK(
        exchange_fps(c, op, &op->fp, sizeof op->fp, op->send, bytes, c->scratch, bytes, got, err));
  }
  for (int j = 0; j < W; j++) {
    srcs[j] = j == r ? op->send : c->scratch + (size_t)j * bytes;
    if (j == r) continue;
    if (!with_fp) add(ops, &k, j, true, op->send, bytes);
    add(ops, &k, j, false, c->scratch + (size_t)j * bytes + got[j], bytes - got[j]);
    if (with_fp) ops[k++] = (ddp_xfer_t){.peer = j}; /* the probe */
  }
  DDP_CHECK(xfer(c, ops, k, err));
  ddp_reduce_fold(op->dt, op->op, W, srcs, op->recv, op->count, c->tmp, W);
  return DDP_OK;
}

/* gloo-style ring (D1, not D2). The vector is cut into W chunks; each step moves one chunk
 * per rank to the right neighbour while receiving another from the left, cut into segments
 * of `seg` elements so that scratch stays one segment. Reduce-scatter: in step i rank r
 * sends chunk (r - i) mod W and adds the received chunk (r - i - 1) mod W into its output;
 * after W-1 steps rank r holds the total of chunk (r + 1) mod W. All-gather: the totals
 * travel W-1 more steps and are copied, not added. Every element is summed along one chain
 * starting at a rank that depends on its chunk, so the bits depend on W and count. */
static ddp_status_t allreduce_ring(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t es = ddp_dtype_size(op->dt), n = op->count, seg = c->segment_bytes / es;
  int W = c->size, r = c->rank, right = (r + 1) % W, left = (r + W - 1) % W;
  unsigned char *out = op->recv;
  if (op->send != out) memcpy(out, op->send, n * es);
  for (int phase = 0; phase < 2; phase++) {
    for (int i = 0; i < W - 1; i++) {
      int sc = phase == 0 ? ((r - i) % W + W) % W : ((r + 1 - i) % W + W) % W;
      int rc = phase == 0 ? ((r - i - 1) % W + W) % W : ((r - i) % W + W) % W;
      size_t slo, slen, rlo, rlen;
      ddp_coll_part(n, W, sc, &slo, &slen);
      ddp_coll_part(n, W, rc, &rlo, &rlen);
      for (size_t b = 0; b < DDP_MAX(slen, rlen); b += seg) {
        size_t sm = slen > b ? DDP_MIN(seg, slen - b) : 0;
        size_t rm = rlen > b ? DDP_MIN(seg, rlen - b) : 0;
        unsigned char *dst = phase == 0 ? c->scratch : out + (rlo + b) * es;
        ddp_xfer_t ops[2];
        size_t k = 0;
        add(ops, &k, right, true, out + (slo + b) * es, sm * es);
        add(ops, &k, left, false, dst, rm * es);
        DDP_CHECK(xfer(c, ops, k, err));
        if (phase == 0) ddp_reduce_acc(op->dt, op->op, out + (rlo + b) * es, c->scratch, rm);
      }
    }
  }
  if (op->op == DDP_OP_AVG) ddp_reduce_avg(op->dt, out, n, W);
  return DDP_OK;
}

/* Broadcast: the root sends the whole buffer to every peer at once (its uplink carries
 * (W-1)·S, which is fine for the W <= 16 this backend targets); peers receive in place. */
static ddp_status_t broadcast(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t bytes = op->count * ddp_dtype_size(op->dt);
  ddp_xfer_t ops[MAXW];
  size_t k = 0;
  if (c->rank == op->root) {
    for (int j = 0; j < c->size; j++)
      if (j != op->root) add(ops, &k, j, true, op->recv, bytes);
  } else {
    add(ops, &k, op->root, false, op->recv, bytes);
  }
  return xfer(c, ops, k, err);
}

/* Allgather: every rank places its block, then sends it to every peer while receiving
 * theirs straight into their blocks of the output (one concurrent batch). */
static ddp_status_t allgather(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t bytes = op->count * ddp_dtype_size(op->dt);
  unsigned char *out = op->recv;
  int r = c->rank;
  if (op->send != out + r * bytes) memmove(out + r * bytes, op->send, bytes);
  ddp_xfer_t ops[2 * MAXW];
  size_t k = 0;
  for (int j = 0; j < c->size; j++) {
    if (j == r) continue;
    add(ops, &k, j, true, out + r * bytes, bytes);
    add(ops, &k, j, false, out + j * bytes, bytes);
  }
  return xfer(c, ops, k, err);
}

/* Reduce-scatter: reduce_owned where rank j's range is block j of every input. */
static ddp_status_t reduce_scatter(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t off[MAXW], len[MAXW];
  for (int j = 0; j < c->size; j++) {
    off[j] = (size_t)j * op->count;
    len[j] = op->count;
  }
  return reduce_owned(c, op, op->send, off, len, op->recv, err);
}

/* Alltoall: block j of the input goes to rank j, block j of the output comes from rank j;
 * the own block is copied locally. One concurrent batch. */
static ddp_status_t alltoall(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  size_t bytes = op->count * ddp_dtype_size(op->dt);
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  int r = c->rank;
  memcpy(out + r * bytes, in + r * bytes, bytes);
  ddp_xfer_t ops[2 * MAXW];
  size_t k = 0;
  for (int j = 0; j < c->size; j++) {
    if (j == r) continue;
    add(ops, &k, j, true, in + j * bytes, bytes);
    add(ops, &k, j, false, out + j * bytes, bytes);
  }
  return xfer(c, ops, k, err);
}

/* Point to point: the pair swaps fingerprints first (both ends then agree on DESYNC), and
 * only then the payload moves. */
static ddp_status_t p2p(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  ddp__fp_t theirs;
  int peer = op->root;
  bool sender = op->kind == DDP_COLL_SEND;
  ddp_xfer_t ops[2] =
      {{.peer = peer, .is_send = true, .buf = (void *)&op->fp, .bytes = sizeof op->fp},
       {.peer = peer, .buf = &theirs, .bytes = sizeof theirs}};
  DDP_CHECK(c->ops->xfer(c->state, ops, 2, NULL, c->deadline_ns, err));
  if (!ddp__fp_equal(&theirs, &op->fp)) {
    char a[160], b[160];
    ddp__fp_str(&op->fp, a, sizeof a);
    ddp__fp_str(&theirs, b, sizeof b);
    return ddp__error_quiet(err, DDP_ERR_DESYNC,
                            "mismatched point-to-point: rank %d %s %s, but rank %d %s %s", c->rank,
                            sender ? "sends" : "expects", a, peer, sender ? "expects" : "sends", b);
  }
  size_t bytes = op->count * ddp_dtype_size(op->dt), k = 0;
  add(ops, &k, peer, sender, sender ? op->send : op->recv, bytes);
  return xfer(c, ops, k, err);
}

ddp_status_t ddp__run_link(ddp__comm_t *c, const ddp__coll_t *op, ddp_error_t *err) {
  ddp__coll_t o = *op;
  if (o.kind == DDP_COLL_SEND || o.kind == DDP_COLL_RECV) return p2p(c, &o, err);
  size_t es = ddp_dtype_size(o.dt);
  /* Which allreduce runs: small (when it fits the scratch), ring, or canonical. */
  bool small = o.kind == DDP_COLL_ALLREDUCE && o.algo == DDP_ALGO_SMALL &&
               o.count * es * (size_t)c->size <= c->scratch_bytes;
  bool canonical = o.kind == DDP_COLL_ALLREDUCE && !small && o.algo != DDP_ALGO_RING;
  if (small && c->check_fp && c->ops->stream && c->size > 1 && o.count > 0 &&
      o.count * es <= FP_PIGGYBACK)
    return allreduce_small(c, &o, true, err);
  /* reduce_owned checks fingerprints itself, with the first segment when it is small. */
  bool owned = o.count > 0 && c->size > 1 && (canonical || o.kind == DDP_COLL_REDUCE_SCATTER);
  if (c->size > 1 && !owned && c->check_fp) DDP_CHECK(check_fps(c, &o, err));
  if (o.count == 0 || o.kind == DDP_COLL_BARRIER) return DDP_OK;
  if (c->size == 1) {
    if (o.kind != DDP_COLL_BROADCAST && o.send != o.recv) memmove(o.recv, o.send, o.count * es);
    return DDP_OK;
  }
  switch (o.kind) {
    case DDP_COLL_ALLREDUCE:
      if (small) return allreduce_small(c, &o, false, err);
      return canonical ? allreduce_canonical(c, &o, err) : allreduce_ring(c, &o, err);
    case DDP_COLL_BROADCAST: return broadcast(c, &o, err);
    case DDP_COLL_ALLGATHER: return allgather(c, &o, err);
    case DDP_COLL_REDUCE_SCATTER: return reduce_scatter(c, &o, err);
    case DDP_COLL_ALLTOALL: return alltoall(c, &o, err);
    default: break;
  }
  return ddp__error_quiet(err, DDP_ERR_INTERNAL, "unknown operation kind %d", (int)o.kind);
}
