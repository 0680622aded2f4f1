/* Private to the PowerSGD hooks (powersgd_state.c: the state, its memories and save/load;
 * powersgd.c: powerSGD_hook and the maths both hooks share; powersgd_batched.c:
 * batched_powerSGD_hook). */
#ifndef DDP_HOOKS_POWERSGD_INTERNAL_H
#define DDP_HOOKS_POWERSGD_INTERNAL_H

#include "hooks_internal.h"

#define PSGD_MAGIC 0x50534744u /* "PSGD" */

typedef struct psgd_mem {
  float *error; /* error feedback, one per bucket element (padded length when batched) */
  size_t nerror;
  float *p, *q; /* warm-start memories */
  size_t np, nq;
  bool has_mem;
  /* The bucket layout error, p and q are laid out for (powerSGD_hook only): per parameter
   * in bucket order, 4 values: ddp_param_t.index, element offset, element count, first
   * dimension. nlay == 0: not recorded. */
  size_t *lay;
  size_t nlay;
} psgd_mem_t;

struct ddp_powersgd_state {
  uint32_t magic;
  ddp_powersgd_options_t o;
  int rank;
  int64_t iter;
  psgd_mem_t *mem; /* by bucket index; grows (calls hold the index, not a pointer) */
  size_t nmem;
  int64_t total_before, total_after, next_stats_report;
  uint64_t draws; /* random Q initialisations so far: the stream index of the next */
  int64_t nallreduce;
  int64_t bytes_step;
};

/* ---------------------------------------------------------------- powersgd_state.c */

/* Drops the warm-start memories (P, Q). */
void ddp__psgd_mem_clear(psgd_mem_t *m);
/* The bucket's layout changed: its error feedback and warm-start factors no longer fit
 * (logs a warning and drops them). */
void ddp__psgd_mem_restart(psgd_mem_t *m, int rank, size_t bucket);
/* Frees everything a bucket's memory holds. */
void ddp__psgd_mem_free(psgd_mem_t *m);
/* Bucket idx's memories, growing the array (NULL: out of memory). Calls hold the index,
 * not the pointer, across continuations. */
psgd_mem_t *ddp__psgd_get_mem(ddp_powersgd_state_t *s, size_t idx);

/* ---------------------------------------------------------------- powersgd.c ------- */

typedef struct mat {
  size_t off;     /* element offset of the tensor in the bucket */
  size_t n, m, r; /* M is n x m; rank r */
  size_t poff, qoff;
} mat_t;

typedef struct psgd_call {
  ddp_powersgd_state_t *s;
  ddp_pg_t *pg;
  psgd_mem_t *mem;
  size_t index;
  bool is_last, low;
  size_t numel;
  float *in; /* input: the bucket (f32) or an f32 copy of it */
  bool own_in;
  float *cp;  /* input_cp for error feedback */
  float *unc; /* the uncompressed tensors, concatenated */
  size_t nunc;
  size_t *unc_off, *unc_len, nuncs;
  mat_t *mats;
  size_t nmats;
} psgd_call_t;

/* maybe_increase_iter: iter counts synchronised backward passes. */
void ddp__psgd_maybe_increase_iter(ddp_powersgd_state_t *s, bool is_last);
/* The compression stats line, every compression_stats_logging_frequency iterations. */
void ddp__psgd_maybe_log_stats(ddp_powersgd_state_t *s, bool is_last);
/* One allreduce SUM of n f32 in place, added to w (and to the counters). */
ddp_status_t ddp__psgd_launch(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_comm_work_t *w, float *buf,
                              size_t n);
/* _orthogonalize on the columns of a row-major rows x cols matrix. */
ddp_status_t ddp__psgd_orthogonalize(float *a, size_t rows, size_t cols, double eps, bool low);
/* Q's random start: n values of bucket's draw number s->draws (which it advances). */
void ddp__psgd_fill_normal(ddp_powersgd_state_t *s, size_t bucket, float *q, size_t n);
/* The warm-up phase and its single allreduce (divide by W, then SUM). */
ddp_status_t ddp__psgd_warmup(ddp_powersgd_state_t *s, ddp_pg_t *pg, ddp_grad_bucket_t *b,
                              ddp_comm_work_t **out);
/* The input (an f32 view or copy of buffer(), padded to len) with the stored error added,
 * and input_cp. */
ddp_status_t ddp__psgd_prepare_input(psgd_call_t *c, ddp_grad_bucket_t *b, size_t len);
/* (Re)allocates the P and Q memories; *need_rand: Q needs a random start. */
ddp_status_t ddp__psgd_prepare_memory(psgd_call_t *c, size_t np, size_t nq, bool *need_rand);
/* The bucket's layout, 4 values per parameter (see psgd_mem_t); NULL: out of memory. */
size_t *ddp__psgd_bucket_layout(const ddp_grad_bucket_t *b);

#endif
