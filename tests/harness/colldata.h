/* Shared data for collective tests (test_collectives, test_mpi): the random inputs of the D2
 * check and its serial reference, so every backend's test checks against one definition. */
#ifndef DDP_TEST_COLLDATA_H
#define DDP_TEST_COLLDATA_H

#include <stddef.h>
#include <stdint.h>

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

#endif /* DDP_TEST_COLLDATA_H */
