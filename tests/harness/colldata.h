/* Shared data and checks for collective tests (test_collectives, test_mpi): the exact-data
 * checks of every collective, the random inputs of the D2 check and its serial reference,
 * so every backend's test checks against one definition. */
#ifndef DDP_TEST_COLLDATA_H
#define DDP_TEST_COLLDATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/pg.h"
#include "ddp/tensor.h"

/* Rank `rank`'s n random values of dt (F32, F16 or BF16) for test case `salt`. */
void ddp_test_d2_fill(ddp_dtype_t dt, void *p, size_t n, int rank, int salt);
/* The D2 reference into acc: ((x0 + x1) + x2) + ... over W ranks, fp16/bf16 rounded after
 * each addition. */
void ddp_test_d2_reference(ddp_dtype_t dt, void *acc, size_t n, int W, int salt);
/* FNV-1a over n bytes, continuing from h. */
uint64_t ddp_test_fnv(const void *p, size_t n, uint64_t h);

/* Element i of p as double and back (exact for the small integers the tests use). */
void ddp_test_set_el(ddp_dtype_t dt, void *p, size_t i, double v);
double ddp_test_get_el(ddp_dtype_t dt, const void *p, size_t i);
/* The library's AVG: the exact sum divided by W in the dtype. */
double ddp_test_avg_of(ddp_dtype_t dt, double sum, int W);
/* Rank r's element i for SUM/AVG, PRODUCT and MIN/MAX checks: exact in every dtype. */
double ddp_test_val_sum(int r, size_t i);
double ddp_test_val_prod(int r, size_t i);
double ddp_test_val_mm(int r, size_t i);

/* One rank's side of the checks below. The rank functions only record; the parent asserts
 * on what the rank reports (bad, first and its own messages). */
typedef struct ddp_test_coll {
  ddp_pg_t *pg;
  int r, W;
  bool pg_alloc; /* buffers from ddp_pg_alloc (shm: peers read them in place) */
  /* Reports a failed call's message through the test's own channel. */
  void (*say)(struct ddp_test_coll *c, const char *msg);
  long bad;        /* elements that differed from the expected value */
  char first[256]; /* the first of them */
} ddp_test_coll_t;

/* Counts a wrong element and keeps the first one's description. */
void ddp_test_mismatch(ddp_test_coll_t *c, const char *what, ddp_dtype_t dt, size_t n, size_t i,
                       double got, double want);
/* st is what issuing the call returned; waits for and frees *w, reporting a failure. */
ddp_status_t ddp_test_run(ddp_test_coll_t *c, ddp_status_t st, ddp_work_t **w, const char *what);
/* Allreduce SUM, AVG, MIN, MAX and PRODUCT, alternately in place and out of place, on n
 * elements of dt whose results are exact, against the closed-form values. */
ddp_status_t ddp_test_check_allreduce(ddp_test_coll_t *c, ddp_dtype_t dt, size_t n);
/* Broadcast (root moving with n), allgather and reduce_scatter (both in and out of place),
 * alltoall, barrier and send/recv around the ring, on exact data. */
ddp_status_t ddp_test_check_others(ddp_test_coll_t *c, ddp_dtype_t dt, size_t n);
/* D2: random f32/f16/bf16 data of counts 1000, 65539 and 3 allreduced (SUM, in place) and
 * compared bit for bit with ddp_test_d2_reference; *hash is FNV-1a over every result. */
ddp_status_t ddp_test_d2_run(ddp_test_coll_t *c, uint64_t *hash);

#endif /* DDP_TEST_COLLDATA_H */
