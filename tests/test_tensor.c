/* Tests of the tensor layer: the dtype table, shape arithmetic, owning tensors and views,
 * dtype conversion (checked against the scalar conversions and exact double arithmetic),
 * the BLAS wrapper against a naive triple loop, and the collectives' fold in place against
 * an element-by-element left fold. */
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cmocka.h>

#include "ddp/tensor.h"
#include "common/common.h"
#include "harness.h"

/* ---------------------------------------------------------------- dtypes ---------- */

/* Every row of DDP_DTYPE_MAP: size, safetensors name, and the name parses back; values
 * outside the list have size 0 and name "?"; unknown names are NOT_FOUND. */
static void test_dtype_table(void **state) {
  (void)state;
  int n = 0;
#define CHECK_(id, name, size)                                  \
  do {                                                          \
    assert_int_equal(DDP_##id, n);                              \
    assert_int_equal(ddp_dtype_size(DDP_##id), size);           \
    assert_string_equal(ddp_dtype_name(DDP_##id), name);        \
    ddp_dtype_t back = DDP_DTYPE_COUNT_;                        \
    assert_int_equal(ddp_dtype_from_name(name, &back), DDP_OK); \
    assert_int_equal(back, DDP_##id);                           \
    assert_true(ddp_dtype_valid(DDP_##id));                     \
    n++;                                                        \
  } while (0);
  DDP_DTYPE_MAP(CHECK_)
#undef CHECK_
  assert_int_equal(n, DDP_DTYPE_COUNT_);
  assert_int_equal(ddp_dtype_size(DDP_F32), 4);
  assert_int_equal(ddp_dtype_size(DDP_BF16), 2);
  assert_string_equal(ddp_dtype_name(DDP_BF16), "BF16");
  assert_false(ddp_dtype_valid(DDP_DTYPE_COUNT_));
  assert_false(ddp_dtype_valid(-1));
  assert_int_equal(ddp_dtype_size(DDP_DTYPE_COUNT_), 0);
  assert_int_equal(ddp_dtype_size((ddp_dtype_t)-1), 0);
  assert_string_equal(ddp_dtype_name(DDP_DTYPE_COUNT_), "?");
  ddp_dtype_t dt = DDP_I32;
  static const char *const bad[] = {"f32", "F8", "", "FLOAT", "F32 ", "?"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    assert_int_equal(ddp_dtype_from_name(bad[i], &dt), DDP_ERR_NOT_FOUND);
    assert_int_equal(dt, DDP_I32); /* untouched */
  }
}

/* ---------------------------------------------------------------- shapes ---------- */

/* numel is the product of the dims (1 for a scalar); negative dims, ndim out of range,
 * a zero element size and products past INT64_MAX (in elements or in bytes) are
 * INVALID_ARGUMENT. */
static void test_shape_numel(void **state) {
  (void)state;
  int64_t n = -1;
  int64_t s3[3] = {2, 3, 4};
  assert_int_equal(ddp_shape_numel(3, s3, 4, &n), DDP_OK);
  assert_int_equal(n, 24);
  assert_int_equal(ddp_shape_numel(0, NULL, 8, &n), DDP_OK);
  assert_int_equal(n, 1);
  int64_t z[3] = {5, 0, 7};
  assert_int_equal(ddp_shape_numel(3, z, 4, &n), DDP_OK);
  assert_int_equal(n, 0);
  int64_t s8[8] = {1, 2, 1, 2, 1, 2, 1, 2};
  assert_int_equal(ddp_shape_numel(8, s8, 1, &n), DDP_OK);
  assert_int_equal(n, 16);

  n = 99;
  int64_t neg[2] = {3, -1};
  assert_int_equal(ddp_shape_numel(2, neg, 4, &n), DDP_ERR_INVALID_ARGUMENT);
  int64_t neg0[2] = {0, -1}; /* negative even when the product would be 0 */
  assert_int_equal(ddp_shape_numel(2, neg0, 4, &n), DDP_ERR_INVALID_ARGUMENT);
  int64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  assert_int_equal(ddp_shape_numel(9, s9, 4, &n), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_shape_numel(-1, s3, 4, &n), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_shape_numel(3, s3, 0, &n), DDP_ERR_INVALID_ARGUMENT);
  int64_t big[2] = {INT64_MAX / 2 + 1, 2};
  assert_int_equal(ddp_shape_numel(2, big, 1, &n), DDP_ERR_INVALID_ARGUMENT);
  int64_t big3[3] = {1 << 21, 1 << 21, 1 << 21}; /* 2^63 */
  assert_int_equal(ddp_shape_numel(3, big3, 1, &n), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(n, 99); /* untouched on failure */
  /* Elements fit, bytes do not. */
  int64_t e1[1] = {INT64_MAX / 4 + 1};
  assert_int_equal(ddp_shape_numel(1, e1, 4, &n), DDP_ERR_INVALID_ARGUMENT);
  int64_t e2[1] = {INT64_MAX / 4};
  assert_int_equal(ddp_shape_numel(1, e2, 4, &n), DDP_OK);
  assert_int_equal(n, INT64_MAX / 4);
  int64_t e3[2] = {INT64_MAX, 1};
  assert_int_equal(ddp_shape_numel(2, e3, 1, &n), DDP_OK);
  assert_int_equal(n, INT64_MAX);
}

/* ---------------------------------------------------------------- tensors --------- */

/* An allocator that refuses large requests, to reach the NO_MEMORY path reliably (a real
 * huge malloc would trip the sanitizers instead of returning NULL). */
static void *small_malloc(void *u, size_t n) {
  (void)u;
  return n > (1u << 30) ? NULL : malloc(n);
}
static void *small_calloc(void *u, size_t n, size_t s) {
  (void)u;
  return calloc(n, s);
}
static void *small_realloc(void *u, void *p, size_t n) {
  (void)u;
  return realloc(p, n);
}
static void small_free(void *u, void *p) {
  (void)u;
  free(p);
}

/* Owning tensors are zero-filled, 64-byte aligned, carry their shape and numel, and are
 * released (and zeroed) by free; failures leave the struct zeroed. Runs under CMocka's
 * allocator, so a leak fails the test. */
static void test_alloc(void **state) {
  (void)state;
  ddp_test_use_cmocka_allocator();
  for (ddp_dtype_t dt = 0; dt < DDP_DTYPE_COUNT_; dt++) {
    for (int64_t rows = 0; rows < 9; rows++) {
      int64_t shape[3] = {rows, 3, 5};
      ddp_tensor_t t;
      assert_int_equal(ddp_tensor_alloc(&t, dt, 3, shape), DDP_OK);
      assert_true(t.owns);
      assert_int_equal(t.dtype, dt);
      assert_int_equal(t.ndim, 3);
      assert_int_equal(t.numel, rows * 15);
      assert_int_equal(t.shape[0], rows);
      assert_int_equal(t.shape[2], 5);
      assert_non_null(t.data);
      assert_int_equal((uintptr_t)t.data % 64, 0);
      assert_int_equal(ddp_tensor_nbytes(&t), (size_t)rows * 15 * ddp_dtype_size(dt));
      const unsigned char *b = t.data;
      for (size_t i = 0; i < ddp_tensor_nbytes(&t); i++) assert_int_equal(b[i], 0);
      memset(t.data, 0xff, ddp_tensor_nbytes(&t));
      ddp_tensor_free(&t);
      assert_null(t.data);
      assert_false(t.owns);
      assert_int_equal(t.numel, 0);
    }
  }
  ddp_tensor_t s;
  assert_int_equal(ddp_tensor_alloc(&s, DDP_F64, 0, NULL), DDP_OK); /* scalar */
  assert_int_equal(s.numel, 1);
  DDP_ASSERT_EQ(((double *)s.data)[0], 0.0);
  ddp_tensor_free(&s);
  ddp_tensor_free(&s); /* zeroed struct: no-op */
  ddp_tensor_free(NULL);

  ddp_tensor_t bad;
  int64_t neg[1] = {-2};
  memset(&bad, 0x7f, sizeof bad);
  assert_int_equal(ddp_tensor_alloc(&bad, DDP_F32, 1, neg), DDP_ERR_INVALID_ARGUMENT);
  assert_null(bad.data);
  assert_int_equal(bad.numel, 0);
  memset(&bad, 0x7f, sizeof bad);
  int64_t one[1] = {1};
  assert_int_equal(ddp_tensor_alloc(&bad, DDP_DTYPE_COUNT_, 1, one), DDP_ERR_INVALID_ARGUMENT);
  assert_null(bad.data);
  ddp_test_use_default_allocator();

  ddp_allocator_t a = {small_malloc, small_calloc, small_realloc, small_free, NULL};
  ddp_set_allocator(&a);
  int64_t huge[1] = {INT64_MAX / 8};
  memset(&bad, 0x7f, sizeof bad);
  assert_int_equal(ddp_tensor_alloc(&bad, DDP_F64, 1, huge), DDP_ERR_NO_MEMORY);
  assert_null(bad.data);
  assert_int_equal(bad.numel, 0);
  assert_false(bad.owns);
  ddp_set_allocator(NULL);
}

/* Views point at caller memory, own nothing and free nothing; slices are views at an
 * element offset, bounds-checked against the base. */
static void test_view_and_slice(void **state) {
  (void)state;
  ddp_test_use_cmocka_allocator();
  float buf[24];
  for (int i = 0; i < 24; i++) buf[i] = (float)i;
  int64_t shape[2] = {4, 6};
  ddp_tensor_t v;
  assert_int_equal(ddp_tensor_view(&v, DDP_F32, 2, shape, buf), DDP_OK);
  assert_ptr_equal(v.data, buf);
  assert_false(v.owns);
  assert_int_equal(v.numel, 24);
  int64_t neg[2] = {4, -6};
  assert_int_equal(ddp_tensor_view(&v, DDP_F32, 2, neg, buf), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_tensor_view(&v, DDP_F32, 2, shape, buf), DDP_OK);

  ddp_tensor_t s;
  int64_t row[1] = {6};
  assert_int_equal(ddp_tensor_slice(&v, 6, 1, row, &s), DDP_OK);
  assert_ptr_equal(s.data, &buf[6]);
  assert_false(s.owns);
  DDP_ASSERT_EQ(((float *)s.data)[5], 11.0f);
  int64_t tail[2] = {3, 6};
  assert_int_equal(ddp_tensor_slice(&v, 6, 2, tail, &s), DDP_OK); /* ends exactly at the end */
  DDP_ASSERT_EQ(((float *)s.data)[17], 23.0f);
  int64_t empty[1] = {0};
  assert_int_equal(ddp_tensor_slice(&v, 24, 1, empty, &s), DDP_OK);
  assert_ptr_equal(s.data, buf + 24);

  ddp_tensor_t keep = s;
  assert_int_equal(ddp_tensor_slice(&v, 7, 2, tail, &s), DDP_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&s, &keep, sizeof s); /* untouched on failure */
  assert_int_equal(ddp_tensor_slice(&v, -1, 1, row, &s), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_tensor_slice(&v, 25, 1, empty, &s), DDP_ERR_INVALID_ARGUMENT);
  int64_t over[1] = {25};
  assert_int_equal(ddp_tensor_slice(&v, 0, 1, over, &s), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_tensor_slice(&v, INT64_MAX, 1, row, &s), DDP_ERR_INVALID_ARGUMENT);
  int64_t huge[1] = {INT64_MAX / 4};
  assert_int_equal(ddp_tensor_slice(&v, 1, 1, huge, &s), DDP_ERR_INVALID_ARGUMENT);

  /* A slice of an owning tensor, then freeing the view: the owner is intact. */
  ddp_tensor_t o;
  assert_int_equal(ddp_tensor_alloc(&o, DDP_I64, 2, shape), DDP_OK);
  assert_int_equal(ddp_tensor_slice(&o, 12, 1, row, &s), DDP_OK);
  ((int64_t *)s.data)[0] = 42;
  ddp_tensor_free(&s);
  assert_int_equal(((int64_t *)o.data)[12], 42);
  ddp_tensor_free(&o);
  ddp_tensor_free(&v);
  DDP_ASSERT_EQ(buf[23], 23.0f);

  ddp_tensor_t a, b;
  int64_t sa[2] = {2, 3}, sb[2] = {3, 2}, sc[1] = {6};
  ddp_tensor_view(&a, DDP_F32, 2, sa, buf);
  ddp_tensor_view(&b, DDP_I32, 2, sa, buf);
  assert_true(ddp_tensor_same_shape(&a, &b));
  ddp_tensor_view(&b, DDP_F32, 2, sb, buf);
  assert_false(ddp_tensor_same_shape(&a, &b));
  ddp_tensor_view(&b, DDP_F32, 1, sc, buf);
  assert_false(ddp_tensor_same_shape(&a, &b));
  char d[64];
  assert_string_equal(ddp_tensor_describe(&a, d, sizeof d), "F32[2, 3]");
  ddp_tensor_view(&b, DDP_BF16, 0, NULL, buf);
  assert_string_equal(ddp_tensor_describe(&b, d, sizeof d), "BF16[]");
  assert_string_equal(ddp_tensor_describe(&a, d, 5), "F32[");
  ddp_test_use_default_allocator();
}

/* ---------------------------------------------------------------- conversion ------ */

/* Narrowing f32 to f16/bf16 in a tensor copy is the scalar conversion, element by element
 * (the scalar conversions are checked exhaustively in test_half.c); widening is exact. */
static void test_copy_f32_to_half(void **state) {
  (void)state;
  enum { N = 4096 };
  float *src = malloc(N * sizeof *src);
  uint16_t *h = malloc(N * sizeof *h), *bh = malloc(N * sizeof *bh);
  float *back = malloc(N * sizeof *back);
  uint64_t x = 88172645463325252ull;
  for (int i = 0; i < N; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    uint32_t u = (uint32_t)x;
    /* Mostly fp16-range values, with ties forced in every 4th. */
    u = (u & 0x80000000u) | ((101u + (u >> 8) % 45u) << 23) | (u & 0x7fffffu);
    if (i % 4 == 0) u = (u & ~0x1fffu) | 0x1000u; /* fp16 tie in the normal range */
    src[i] = ddp_test_bitsf(u);
  }
  src[0] = 65520.0f;
  src[1] = -0.0f;
  src[2] = INFINITY;
  src[3] = NAN;
  int64_t shape[2] = {64, 64};
  ddp_tensor_t ts, th, tb, tback;
  ddp_tensor_view(&ts, DDP_F32, 2, shape, src);
  ddp_tensor_view(&th, DDP_F16, 2, shape, h);
  ddp_tensor_view(&tb, DDP_BF16, 2, shape, bh);
  ddp_tensor_view(&tback, DDP_F32, 2, shape, back);
  assert_int_equal(ddp_tensor_copy(&th, &ts), DDP_OK);
  assert_int_equal(ddp_tensor_copy(&tb, &ts), DDP_OK);
  for (int i = 0; i < N; i++) {
    if (isnan(src[i])) {
      assert_int_equal(h[i] & 0x7c00, 0x7c00);
      assert_true(h[i] & 0x3ff);
      assert_int_equal(bh[i] & 0x7f80, 0x7f80);
      assert_true(bh[i] & 0x7f);
      continue;
    }
    assert_int_equal(h[i], ddp_f32_to_f16(src[i]));
    assert_int_equal(bh[i], ddp_f32_to_bf16(src[i]));
  }
  assert_int_equal(h[0], 0x7c00);
  assert_int_equal(h[1], 0x8000);
  assert_int_equal(ddp_tensor_copy(&tback, &th), DDP_OK);
  for (int i = 4; i < N; i++)
    assert_int_equal(ddp_test_fbits(back[i]), ddp_test_fbits(ddp_f16_to_f32(h[i])));
  assert_int_equal(ddp_tensor_copy(&tback, &tb), DDP_OK);
  for (int i = 4; i < N; i++) assert_int_equal(ddp_test_fbits(back[i]), (uint32_t)bh[i] << 16);
  /* f16 -> bf16 goes through the exact value. */
  assert_int_equal(ddp_tensor_copy(&tb, &th), DDP_OK);
  for (int i = 4; i < N; i++) assert_int_equal(bh[i], ddp_f32_to_bf16(ddp_f16_to_f32(h[i])));
  free(src);
  free(h);
  free(bh);
  free(back);
}

/* Copies n elements of src (dtype sd) into dst (dtype dd) through 1-d views; the copy must
 * succeed. */
static void copy_1d(ddp_dtype_t dd, void *dst, ddp_dtype_t sd, void *src, int64_t n) {
  int64_t shape[1] = {n};
  ddp_tensor_t td, ts;
  ddp_tensor_view(&ts, sd, 1, shape, src);
  ddp_tensor_view(&td, dd, 1, shape, dst);
  assert_int_equal(ddp_tensor_copy(&td, &ts), DDP_OK);
}

/* f64 and i64 sources narrow to f16/bf16/f32 with one rounding from the exact value.
 * Each case sits just above a tie of the target format, by less than the intermediate
 * float can hold: rounding first to float would land exactly on the tie and then round
 * to even, downward. */
static void test_copy_single_rounding(void **state) {
  (void)state;
  /* f64 -> f16: 1 + 2^-11 is the tie between 0x3c00 and 0x3c01. */
  double d[6] = {1 + 0x1p-11 + 0x1p-40, -(1 + 0x1p-11 + 0x1p-40), 1 + 0x1p-11,
                 65520 - 0x1p-30,       0x1p-25 + 0x1p-60,        1e300};
  uint16_t want16[6] = {0x3c01, 0xbc01, 0x3c00, 0x7bff, 0x0001, 0x7c00};
  uint16_t h[6];
  copy_1d(DDP_F16, h, DDP_F64, d, 6);
  for (int i = 0; i < 6; i++) assert_int_equal(h[i], want16[i]);

  /* f64 -> bf16: 1 + 2^-8 is the tie between 0x3f80 and 0x3f81. */
  double db[5] = {1 + 0x1p-8 + 0x1p-40, 1 + 0x1p-8, 0x1p-134 + 0x1p-170, -1e300, 1e-300};
  uint16_t wantb[5] = {0x3f81, 0x3f80, 0x0001, 0xff80, 0x0000};
  uint16_t b[5];
  copy_1d(DDP_BF16, b, DDP_F64, db, 5);
  for (int i = 0; i < 5; i++) assert_int_equal(b[i], wantb[i]);

  /* i64 -> f32: 2^60 + 2^36 + 1 is just above the float tie 2^60 + 2^36 (float's step at
   * 2^60 is 2^37); the nearest float is 2^60 + 2^37. Through double (step 2^8) the +1 is
   * lost first, leaving the tie, which rounds to 2^60. */
  int64_t iv[3] = {((int64_t)1 << 60) + ((int64_t)1 << 36) + 1, ((int64_t)1 << 24) + 1,
                   -(((int64_t)1 << 60) + ((int64_t)1 << 36) + 1)};
  float fw[3] = {0x1p60f + 0x1p37f, 0x1p24f, -(0x1p60f + 0x1p37f)};
  float fo[3];
  copy_1d(DDP_F32, fo, DDP_I64, iv, 3);
  for (int i = 0; i < 3; i++) DDP_ASSERT_EQ(fo[i], fw[i]);
  /* i64 -> bf16: 2^30 + 2^22 + 1 is just above the bf16 tie (step 2^23 at 2^30). */
  int64_t ib[2] = {((int64_t)1 << 30) + ((int64_t)1 << 22) + 1,
                   ((int64_t)1 << 30) + ((int64_t)1 << 22)};
  uint16_t bo[2];
  copy_1d(DDP_BF16, bo, DDP_I64, ib, 2);
  assert_int_equal(bo[0], ddp_f32_to_bf16(0x1p30f + 0x1p23f));
  assert_int_equal(bo[1], ddp_f32_to_bf16(0x1p30f)); /* an exact tie: to even */
  /* f64 -> f32 is C's (correctly rounded) conversion. */
  double dd[2] = {1 + 0x1p-24 + 0x1p-50, 0.1}; /* just above the float tie */
  float ff[2];
  copy_1d(DDP_F32, ff, DDP_F64, dd, 2);
  DDP_ASSERT_EQ(ff[0], 1 + 0x1p-23f);
  DDP_ASSERT_EQ(ff[1], 0.1f);
}

/* Integer and boolean conversions follow C's rules: truncation toward zero, any nonzero
 * (NaN included) is true; same-dtype copies are byte copies; numel must match. */
static void test_copy_integer_and_bool(void **state) {
  (void)state;
  float f[6] = {2.7f, -2.7f, 0.0f, -0.0f, 0.5f, NAN};
  int32_t i32[6];
  uint8_t bo[6];
  int64_t s6[1] = {6};
  ddp_tensor_t tf, ti, tb;
  ddp_tensor_view(&tf, DDP_F32, 1, s6, f);
  ddp_tensor_view(&ti, DDP_I32, 1, s6, i32);
  ddp_tensor_view(&tb, DDP_BOOL, 1, s6, bo);
  f[5] = 100.0f;
  assert_int_equal(ddp_tensor_copy(&ti, &tf), DDP_OK);
  int32_t wi[6] = {2, -2, 0, 0, 0, 100};
  assert_memory_equal(i32, wi, sizeof wi);
  f[5] = NAN;
  assert_int_equal(ddp_tensor_copy(&tb, &tf), DDP_OK);
  uint8_t wb[6] = {1, 1, 0, 0, 1, 1};
  assert_memory_equal(bo, wb, sizeof wb);

  int64_t i64[6] = {-3, 0, 7, INT64_MAX, INT64_MIN, 255};
  double dv[6];
  ddp_tensor_t t64, td;
  ddp_tensor_view(&t64, DDP_I64, 1, s6, i64);
  ddp_tensor_view(&td, DDP_F64, 1, s6, dv);
  assert_int_equal(ddp_tensor_copy(&td, &t64), DDP_OK);
  for (int i = 0; i < 6; i++) DDP_ASSERT_EQ(dv[i], (double)i64[i]);
  assert_int_equal(ddp_tensor_copy(&tb, &t64), DDP_OK);
  uint8_t wb2[6] = {1, 0, 1, 1, 1, 1};
  assert_memory_equal(bo, wb2, sizeof wb2);
  /* i32 -> i64 -> i32 round trip and u8 widening. */
  int32_t src32[6] = {INT32_MIN, -1, 0, 1, INT32_MAX, 12345};
  ddp_tensor_t t32;
  ddp_tensor_view(&t32, DDP_I32, 1, s6, src32);
  assert_int_equal(ddp_tensor_copy(&t64, &t32), DDP_OK);
  for (int i = 0; i < 6; i++) assert_int_equal(i64[i], src32[i]);
  int64_t s2[1] = {2};
  ddp_tensor_t t64b;
  int64_t big[2] = {((int64_t)1 << 53) + 1, -(((int64_t)1 << 53) + 1)};
  ddp_tensor_view(&t64b, DDP_I64, 1, s2, big);
  int64_t out[2];
  ddp_tensor_t tout;
  ddp_tensor_view(&tout, DDP_I64, 1, s2, out);
  assert_int_equal(ddp_tensor_copy(&tout, &t64b), DDP_OK); /* same dtype: exact */
  assert_int_equal(out[0], big[0]);
  assert_int_equal(out[1], big[1]);
  uint8_t u8[6] = {0, 1, 127, 128, 200, 255};
  ddp_tensor_t tu;
  ddp_tensor_view(&tu, DDP_U8, 1, s6, u8);
  assert_int_equal(ddp_tensor_copy(&t32, &tu), DDP_OK);
  for (int i = 0; i < 6; i++) assert_int_equal(src32[i], u8[i]);
  assert_int_equal(ddp_tensor_copy(&tf, &tu), DDP_OK);
  for (int i = 0; i < 6; i++) DDP_ASSERT_EQ(f[i], (float)u8[i]);

  /* Different numel. */
  int64_t s5[1] = {5};
  ddp_tensor_t t5;
  ddp_tensor_view(&t5, DDP_F32, 1, s5, f);
  assert_int_equal(ddp_tensor_copy(&t5, &ti), DDP_ERR_INVALID_ARGUMENT);
  /* Different shapes with equal numel are fine. */
  int64_t s23[2] = {2, 3};
  ddp_tensor_t t23;
  float g[6];
  ddp_tensor_view(&t23, DDP_F32, 2, s23, g);
  assert_int_equal(ddp_tensor_copy(&t23, &tf), DDP_OK);
  assert_memory_equal(g, f, sizeof g);
}

/* ---------------------------------------------------------------- BLAS ------------ */

/* Must run first: the first BLAS use reads DDP_BLAS_THREADS. A forked child (whose
 * wrapper has not been used yet) sees the variable; then set/get. */
static int blas_first_use(ddp_test_rank_t *r, void *arg) {
  (void)arg;
  int n = ddp_blas_get_threads();
  ddp_test_put(r, &n, sizeof n);
  return DDP_OK;
}

/* The kernel set libddp leaves OpenBLAS running: never one from before AVX2 on a CPU with
 * AVX2 and FMA, unless the user chose it through OPENBLAS_CORETYPE (src/tensor/blas.c). */
static void test_blas_kernels(void **state) {
  (void)state;
  const char *core = ddp_blas_core();
  assert_non_null(core);
#if defined(__x86_64__) && defined(__GNUC__)
  static const char *const old[] = {"Prescott",   "Core2",     "Penryn",    "Dunnington",
                                    "Nehalem",    "Atom",      "Barcelona", "Katmai",
                                    "Coppermine", "Northwood", "Banias",    "Sandybridge"};
  const char *user = getenv("OPENBLAS_CORETYPE");
  __builtin_cpu_init();
  if ((!user || !*user) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    for (size_t i = 0; i < sizeof old / sizeof old[0]; i++)
      if (!strcasecmp(core, old[i])) fail_msg("OpenBLAS runs its %s kernels on an AVX2 CPU", core);
#endif
}

static void test_blas_threads(void **state) {
  (void)state;
  char *saved = getenv("DDP_BLAS_THREADS") ? strdup(getenv("DDP_BLAS_THREADS")) : NULL;
  setenv("DDP_BLAS_THREADS", "2", 1);
  ddp_test_opts_t o = DDP_TEST_OPTS_INIT;
  o.mode = DDP_TEST_FORK;
  ddp_test_results_t *res = ddp_test_spawn(&o, blas_first_use, NULL);
  ddp_test_expect_ok(res);
  int n;
  memcpy(&n, ddp_test_result(res, 0)->values, sizeof n);
  assert_int_equal(n, 2);
  ddp_test_results_free(res);
  if (saved) {
    setenv("DDP_BLAS_THREADS", saved, 1);
    free(saved);
  } else {
    unsetenv("DDP_BLAS_THREADS");
  }
  ddp_blas_set_threads(2);
  assert_int_equal(ddp_blas_get_threads(), 2);
  ddp_blas_set_threads(1);
  assert_int_equal(ddp_blas_get_threads(), 1);
  ddp_blas_set_threads(0);
  assert_int_equal(ddp_blas_get_threads(), 1);
  ddp_blas_set_threads(-4);
  assert_int_equal(ddp_blas_get_threads(), 1);
}

/* Element (i, j) of op(X) for a row-major X with row stride ld. */
static double at(const double *x, int64_t ld, bool trans, int64_t i, int64_t j) {
  return trans ? x[j * ld + i] : x[i * ld + j];
}

/* gemm for f32 and f64, all four transpose combinations, non-square shapes with padded
 * leading dimensions, against a naive triple loop in double. The padding holds NaN in A
 * and B (a read there poisons the result) and a sentinel in C (a write there is caught). */
static void test_gemm(void **state) {
  (void)state;
  static const int64_t shapes[][3] = {{3, 5, 7}, {1, 1, 1}, {8, 1, 13}, {17, 9, 1},  {2, 33, 4},
                                      {0, 3, 2}, {4, 0, 2}, {5, 6, 0},  {31, 29, 37}};
  const double alpha = 1.5, beta = -0.5;
  uint64_t seed = 1;
  for (int dt = 0; dt < 2; dt++) {
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      for (int tr = 0; tr < 4; tr++) {
        bool ta = tr & 1, tb = tr & 2;
        int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        int64_t arows = ta ? k : m, acols = ta ? m : k;
        int64_t brows = tb ? n : k, bcols = tb ? k : n;
        int64_t lda = acols + 3, ldb = bcols + 2, ldc = n + 5;
        size_t na = (size_t)(arows * lda) + 1, nb = (size_t)(brows * ldb) + 1,
               nc = (size_t)(m * ldc) + 1;
        double *a = malloc(na * sizeof *a), *b = malloc(nb * sizeof *b);
        double *c = malloc(nc * sizeof *c), *ref = malloc(nc * sizeof *ref);
        for (size_t i = 0; i < na; i++) a[i] = NAN;
        for (size_t i = 0; i < nb; i++) b[i] = NAN;
        for (size_t i = 0; i < nc; i++) c[i] = -777.0;
          /* Values with few significant bits, so f32 products and sums are close to exact. */
#define RND()                                                     \
  (seed = seed * 6364136223846793005ull + 1442695040888963407ull, \
   (double)((int64_t)(seed >> 40) % 2001 - 1000) / 64.0)
        for (int64_t i = 0; i < arows; i++)
          for (int64_t j = 0; j < acols; j++) a[i * lda + j] = RND();
        for (int64_t i = 0; i < brows; i++)
          for (int64_t j = 0; j < bcols; j++) b[i * ldb + j] = RND();
        for (int64_t i = 0; i < m; i++)
          for (int64_t j = 0; j < n; j++) c[i * ldc + j] = RND();
#undef RND
        memcpy(ref, c, nc * sizeof *c);
        double scale = 0;
        for (int64_t i = 0; i < m; i++) {
          for (int64_t j = 0; j < n; j++) {
            double s = 0, mag = 0;
            for (int64_t p = 0; p < k; p++) {
              s += at(a, lda, ta, i, p) * at(b, ldb, tb, p, j);
              mag += fabs(at(a, lda, ta, i, p) * at(b, ldb, tb, p, j));
            }
            ref[i * ldc + j] = alpha * s + beta * c[i * ldc + j];
            scale = fmax(scale, fabs(alpha) * mag + fabs(beta * c[i * ldc + j]));
          }
        }
        ddp_status_t st;
        if (dt == 0) {
          float *fa = malloc(na * sizeof *fa), *fb = malloc(nb * sizeof *fb),
                *fc = malloc(nc * sizeof *fc);
          for (size_t i = 0; i < na; i++) fa[i] = (float)a[i];
          for (size_t i = 0; i < nb; i++) fb[i] = (float)b[i];
          for (size_t i = 0; i < nc; i++) fc[i] = (float)c[i];
          st = ddp_gemm(DDP_F32, ta, tb, m, n, k, alpha, fa, lda, fb, ldb, beta, fc, ldc);
          for (size_t i = 0; i < nc; i++) c[i] = fc[i];
          free(fa);
          free(fb);
          free(fc);
        } else {
          st = ddp_gemm(DDP_F64, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        }
        assert_int_equal(st, DDP_OK);
        /* The classical bound for a k-term dot product: (k + 2) units of roundoff. */
        double tol = (double)(k + 2) * (dt == 0 ? 0x1p-24 : 0x1p-53) * (scale + 1);
        for (int64_t i = 0; i < m; i++) {
          for (int64_t j = 0; j < ldc && (size_t)(i * ldc + j) < nc; j++) {
            double got = c[i * ldc + j], want = ref[i * ldc + j];
            if (j >= n) {
              if (got != -777.0)
                fail_msg("padding of C written at (%lld, %lld)", (long long)i, (long long)j);
              continue;
            }
            if (!(fabs(got - want) <= tol))
              fail_msg("%s ta=%d tb=%d m=%lld n=%lld k=%lld: C[%lld,%lld] = %.17g, want %.17g",
                       dt ? "dgemm" : "sgemm", ta, tb, (long long)m, (long long)n, (long long)k,
                       (long long)i, (long long)j, got, want);
          }
        }
        DDP_ASSERT_EQ(c[nc - 1], -777.0);
        free(a);
        free(b);
        free(c);
        free(ref);
      }
    }
  }
}

/* beta = 0 overwrites C (NaN or Inf already there must not leak into the result), as
 * BLAS and PyTorch define it. */
static void test_gemm_beta_zero(void **state) {
  (void)state;
  double a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}; /* 2x3 @ 3x2 */
  double c[4] = {NAN, INFINITY, NAN, -INFINITY};
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 2, 2, 3, 1.0, a, 3, b, 2, 0.0, c, 2), DDP_OK);
  double want[4] = {1 + 3, 2 + 3, 4 + 6, 5 + 6};
  for (int i = 0; i < 4; i++) DDP_ASSERT_EQ(c[i], want[i]);
  float fa[6] = {1, 2, 3, 4, 5, 6}, fb[6] = {1, 0, 0, 1, 1, 1};
  float fc[4] = {NAN, INFINITY, NAN, -INFINITY};
  assert_int_equal(ddp_gemm(DDP_F32, false, false, 2, 2, 3, 1.0, fa, 3, fb, 2, 0.0, fc, 2), DDP_OK);
  for (int i = 0; i < 4; i++) DDP_ASSERT_EQ(fc[i], (float)want[i]);
}

/* ---------------------------------------------------------------- reductions ------ */

/* Element j of a source: random bits, with the values that tell operand order apart mixed
 * in for the float types (NaNs with different payloads, +0 and -0, infinities). */
static void fold_fill(ddp_dtype_t dt, unsigned char *p, size_t n, uint64_t *seed) {
  size_t es = ddp_dtype_size(dt);
  for (size_t i = 0; i < n; i++) {
    *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t r = *seed >> 11;
    unsigned char *e = p + i * es;
    if (dt == DDP_F32) {
      static const uint32_t special[] = {0x7fc00001u, 0x7fc00002u, 0x80000000u,
                                         0x00000000u, 0x7f800000u, 0xff800000u};
      float f = (float)((double)(r % 2001) / 64.0 - 15.6);
      uint32_t bits;
      memcpy(&bits, &f, 4);
      if (r % 7 == 0) bits = special[(r >> 20) % 6];
      memcpy(e, &bits, 4);
    } else if (dt == DDP_F64) {
      static const uint64_t special[] = {0x7ff8000000000001ull, 0x7ff8000000000002ull,
                                         0x8000000000000000ull, 0};
      double f = (double)(r % 2001) / 64.0 - 15.6;
      uint64_t bits;
      memcpy(&bits, &f, 8);
      if (r % 7 == 0) bits = special[(r >> 20) % 4];
      memcpy(e, &bits, 8);
    } else {
      memcpy(e, &r, es); /* integers and f16/bf16 patterns, NaNs included */
    }
  }
}

/* Whether the element's bits are a NaN of dt (false for the integer types). */
static bool fold_is_nan(ddp_dtype_t dt, uint64_t b) {
  switch (dt) {
    case DDP_F32: return (b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu);
    case DDP_F64: return (b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull && (b << 12);
    case DDP_F16: return (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu);
    case DDP_BF16: return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu);
    default: return false;
  }
}

/* ddp_reduce_fold gives the rank-order left fold, computed here one element at a time
 * with ddp_reduce_acc, whatever source dst is (none, the first, the second, a later one:
 * the in-place collective on every rank), for every dtype and operation and W = 2-4, over
 * more than two of its tmp blocks. Bits are compared: MIN and MAX choose an operand
 * explicitly, so a swapped order changes the sign of a zero or the payload of a NaN they
 * return. Sums and products of NaNs only need to be NaN: C leaves the payload open, and the
 * compiler orders a commutative operation's operands as it likes (x86 returns the first
 * operand's payload). */
static void test_reduce_fold_in_place(void **state) {
  (void)state;
  static const ddp_dtype_t dts[] = {DDP_F32, DDP_F64, DDP_I32, DDP_I64, DDP_U8, DDP_F16, DDP_BF16};
  static const ddp_redop_t ops[] = {DDP_OP_SUM, DDP_OP_AVG, DDP_OP_PRODUCT, DDP_OP_MIN, DDP_OP_MAX};
  unsigned char *tmp = malloc(DDP_REDUCE_TMP_BYTES);
  assert_non_null(tmp);
  uint64_t seed = 12345;
  for (size_t t = 0; t < DDP_ARRAY_LEN(dts); t++) {
    ddp_dtype_t dt = dts[t];
    size_t es = ddp_dtype_size(dt), n = 2 * (DDP_REDUCE_TMP_BYTES / es) + 37, bytes = n * es;
    for (size_t o = 0; o < DDP_ARRAY_LEN(ops); o++) {
      for (int W = 2; W <= 4; W++) {
        unsigned char *src[4], *want = malloc(bytes), *copy[4], *out = malloc(bytes);
        assert_non_null(want);
        assert_non_null(out);
        for (int j = 0; j < W; j++) {
          src[j] = malloc(bytes);
          copy[j] = malloc(bytes);
          assert_non_null(src[j]);
          assert_non_null(copy[j]);
          fold_fill(dt, src[j], n, &seed);
        }
        memcpy(want, src[0], bytes);
        for (int j = 1; j < W; j++)
          for (size_t i = 0; i < n; i++)
            ddp_reduce_acc(dt, ops[o], want + i * es, src[j] + i * es, 1);
        if (ops[o] == DDP_OP_AVG) ddp_reduce_avg(dt, want, n, W);
        for (int at = -1; at < W; at++) { /* dst is source `at`; -1: its own buffer */
          const void *srcs[4];
          for (int j = 0; j < W; j++) {
            memcpy(copy[j], src[j], bytes);
            srcs[j] = copy[j];
          }
          unsigned char *dst = at < 0 ? out : copy[at];
          /* the header's contract: tmp only for a later source than the second */
          ddp_reduce_fold(dt, ops[o], W, srcs, dst, n, at >= 2 ? tmp : NULL, W);
          for (size_t i = 0; i < n; i++)
            if (memcmp(dst + i * es, want + i * es, es) != 0) {
              uint64_t got = 0, exp = 0;
              memcpy(&got, dst + i * es, es);
              memcpy(&exp, want + i * es, es);
              bool arith = ops[o] != DDP_OP_MIN && ops[o] != DDP_OP_MAX;
              if (arith && fold_is_nan(dt, got) && fold_is_nan(dt, exp)) continue;
              fail_msg("%s %s W=%d dst=source %d: element %zu is 0x%llx, want 0x%llx",
                       ddp_dtype_name(dt), ddp_redop_name(ops[o]), W, at, i,
                       (unsigned long long)got, (unsigned long long)exp);
            }
        }
        for (int j = 0; j < W; j++) {
          free(src[j]);
          free(copy[j]);
        }
        free(want);
        free(out);
      }
    }
  }
  free(tmp);
}

/* Invalid arguments are refused before BLAS sees them (BLAS would print and exit). */
static void test_gemm_invalid(void **state) {
  (void)state;
  double a[64] = {0}, b[64] = {0}, c[64] = {0};
  /* m=4, n=3, k=2. Row strides: A is 4x2 (2x4 transposed), B is 2x3 (3x2 transposed). */
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, 2, 1, a, 2, b, 3, 0, c, 3), DDP_OK);
  assert_int_equal(ddp_gemm(DDP_F64, true, true, 4, 3, 2, 1, a, 4, b, 2, 0, c, 3), DDP_OK);
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, 2, 1, a, 1, b, 3, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT); /* lda < k */
  assert_int_equal(ddp_gemm(DDP_F64, true, false, 4, 3, 2, 1, a, 3, b, 3, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT); /* transposed: lda < m */
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, 2, 1, a, 2, b, 2, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT); /* ldb < n */
  assert_int_equal(ddp_gemm(DDP_F64, false, true, 4, 3, 2, 1, a, 2, b, 1, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT); /* transposed: ldb < k */
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, 2, 1, a, 2, b, 3, 0, c, 2),
                   DDP_ERR_INVALID_ARGUMENT); /* ldc < n */
  assert_int_equal(ddp_gemm(DDP_F64, false, false, -1, 3, 2, 1, a, 2, b, 3, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, -3, 2, 1, a, 2, b, 3, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, -2, 1, a, 2, b, 3, 0, c, 3),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_gemm(DDP_F64, false, false, (int64_t)INT_MAX + 1, 3, 2, 1, a, 2, b, 3, 0, c,
                            3),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 4, 3, 2, 1, a, (int64_t)INT_MAX + 1, b, 3, 0, c,
                            3),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_gemm(DDP_F16, false, false, 4, 3, 2, 1, a, 2, b, 3, 0, c, 3),
                   DDP_ERR_UNSUPPORTED);
  assert_int_equal(ddp_gemm(DDP_I32, false, false, 4, 3, 2, 1, a, 2, b, 3, 0, c, 3),
                   DDP_ERR_UNSUPPORTED);
  /* Empty outputs touch nothing, whatever the pointers. */
  assert_int_equal(ddp_gemm(DDP_F64, false, false, 0, 3, 2, 1, NULL, 2, NULL, 3, 0, NULL, 3),
                   DDP_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_blas_threads), /* first: the first BLAS use reads the env */
      cmocka_unit_test(test_blas_kernels),
      cmocka_unit_test(test_dtype_table),
      cmocka_unit_test(test_shape_numel),
      cmocka_unit_test(test_alloc),
      cmocka_unit_test(test_view_and_slice),
      cmocka_unit_test(test_copy_f32_to_half),
      cmocka_unit_test(test_copy_single_rounding),
      cmocka_unit_test(test_copy_integer_and_bool),
      cmocka_unit_test(test_gemm),
      cmocka_unit_test(test_gemm_beta_zero),
      cmocka_unit_test(test_gemm_invalid),
      cmocka_unit_test(test_reduce_fold_in_place),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
