/* Private structures of the nn layer: the arena, the tape node and the context. */
#ifndef DDP_NN_INTERNAL_H
#define DDP_NN_INTERNAL_H

#include "common/common.h"
#include "ddp/nn.h"

/* The arena is a list of chunks used as a bump allocator. Reset rewinds it; when a step
 * needed more than one chunk, reset replaces them by one chunk of the total size, so from
 * the second step on a step of the same shape allocates nothing. */
typedef struct ddp__chunk {
  struct ddp__chunk *next;
  size_t cap, used;
  unsigned char *base;
} ddp__chunk_t;

typedef ddp_status_t (*ddp__backward_fn)(ddp_ctx_t *c, ddp_node_t *n);

#define DDP__NODE_INLINE_INS 3

struct ddp_node {
  ddp__backward_fn backward;
  const char *name;        /* op name, for messages */
  ddp_node_t *prev;        /* previous node on the tape */
  ddp_var_t *out;
  ddp_var_t **ins;
  size_t nin;
  ddp_var_t *ins_inline[DDP__NODE_INLINE_INS];
  void *saved;             /* op-specific arena data */
  void *saved2;
  double a0, a1;           /* op-specific scalars */
  int64_t i0, i1;
  uint64_t mark;           /* backward id that needs this node */
  bool fire_reverse;       /* finalize parameter inputs last-to-first (see run_backward) */
  /* checkpoint */
  ddp_segment_fn seg_fn;
  void *seg_user;
  uint64_t seg_dropout_ctr;
};

struct ddp_ctx {
  ddp__chunk_t *chunks;    /* head is the current chunk */
  size_t total_cap;
  size_t used_total;       /* bytes handed out since reset, across chunks */
  ddp_node_t *tail;        /* last recorded node */
  bool grad_enabled;
  uint64_t gen;            /* parameter-leaf generation (bumped at reset and recompute) */
  uint64_t mark_seq;       /* ids for backward passes and graph searches */
  uint64_t bwd_id;         /* id of the running outermost backward */
  int bwd_depth;
  uint64_t rng_seed;
  uint32_t rng_rank;
  uint64_t rng_step;
  uint64_t dropout_ctr;    /* dropout calls so far this step */
  ddp_backward_callback_fn cb_fn[DDP_CTX_MAX_CALLBACKS];
  void *cb_user[DDP_CTX_MAX_CALLBACKS];
  int ncb;
  ddp_error_t err;
};

void *ddp__arena_alloc(ddp_ctx_t *c, size_t bytes);      /* 64-byte aligned, not zeroed */
void *ddp__arena_zalloc(ddp_ctx_t *c, size_t bytes);
/* A var with value storage in the arena (zeroed), no grad. NULL when out of memory. */
ddp_var_t *ddp__var_alloc(ddp_ctx_t *c, ddp_dtype_t dt, int ndim, const int64_t *shape);
/* A node recording op `name` with output out and inputs ins (copied), appended to the tape,
 * and out->creator set. NULL when out of memory. */
ddp_node_t *ddp__node_new(ddp_ctx_t *c, const char *name, ddp__backward_fn bw, ddp_var_t *out,
                          size_t nin, ddp_var_t *const *ins);
/* Whether an op with these inputs must be recorded (grad mode on and an input requires
 * grad). */
bool ddp__needs_grad(const ddp_ctx_t *c, size_t nin, ddp_var_t *const *ins);
/* v's gradient storage, allocated zeroed on first use. NULL when out of memory. */
void *ddp__grad(ddp_ctx_t *c, ddp_var_t *v);
ddp_status_t ddp__ctx_error(ddp_ctx_t *c, ddp_status_t st, const char *fmt, ...)
    DDP_PRINTF(3, 4);

#endif /* DDP_NN_INTERNAL_H */
