/* Data layer: DistributedSampler and randperm equal torch's (tools/torch/data_oracle.py), the
 * sources load the values that were written (in-memory, safetensors, CSV, MNIST idx,
 * the shipped digits against scikit-learn), corrupt files give clear errors, synthetic
 * tasks are reproducible and equal their defining formulas, and the loader's batches
 * are the sampler's indices in order. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/data.h"
#include "ddp/io.h"
#include "harness.h"

/* Views fb as an F32 [n] feature and *lab as an I64 scalar label, for ddp_dataset_get. */
static void sample_views(ddp_tensor_t *f, float *fb, int64_t n, ddp_tensor_t *l, int64_t *lab) {
  int64_t shape[1] = {n};
  ddp_tensor_view(f, DDP_F32, 1, shape, fb);
  ddp_tensor_view(l, DDP_I64, 0, NULL, lab);
}

static void write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

/* ---------------------------------------------------------------- sampler --------- */

/* Every (N, W, shuffle, drop_last, epoch) of the acceptance matrix, every rank, and a few
 * large randperms, equal torch's indices exactly. */
static void test_sampler_vs_torch(void **state) {
  (void)state;
  static const int64_t ns[] = {1, 7, 100, 1000};
  static const uint64_t seeds[] = {0, 12345};
  static const int64_t perm_n[] = {0, 1, 2, 624, 625, 50000};
  char in[128], out[128];
  ddp_test_tmp_file(in, sizeof in, "data", "samp_in");
  ddp_test_tmp_file(out, sizeof out, "data", "samp_out");
  FILE *f = fopen(in, "w");
  for (size_t a = 0; a < 4; a++)
    for (int w = 1; w <= 4; w++)
      for (int sh = 0; sh < 2; sh++)
        for (int dl = 0; dl < 2; dl++)
          for (int ep = 0; ep < 3; ep++)
            for (size_t sd = 0; sd < 2; sd++)
              fprintf(f, "sampler %lld %d %d %d %llu %d\n", (long long)ns[a], w, sh, dl,
                      (unsigned long long)seeds[sd], ep);
  for (size_t k = 0; k < sizeof perm_n / sizeof perm_n[0]; k++)
    fprintf(f, "perm %lld %llu\n", (long long)perm_n[k], (unsigned long long)(k * 7919u));
  fclose(f);
  char args[512];
  snprintf(args, sizeof args, "sampler %s %s", in, out);
  if (!ddp_test_run_tool("data_oracle.py", args)) {
    unlink(in);
    unlink(out);
    skip();
  }
  int64_t live0 = ddp_test_live_allocs();
  f = fopen(out, "r");
  assert_non_null(f);
  char *line = NULL;
  size_t cap = 0;
  int configs = 0;
  ddp_error_t err = {0};
  for (size_t a = 0; a < 4; a++)
    for (int w = 1; w <= 4; w++)
      for (int sh = 0; sh < 2; sh++)
        for (int dl = 0; dl < 2; dl++)
          for (int ep = 0; ep < 3; ep++)
            for (size_t sd = 0; sd < 2; sd++) {
              for (int r = 0; r < w; r++) {
                ddp_sampler_options_t o = DDP_SAMPLER_OPTIONS_INIT;
                o.dataset_len = ns[a];
                o.num_replicas = w;
                o.rank = r;
                o.shuffle = sh;
                o.drop_last = dl;
                o.seed = seeds[sd];
                ddp_sampler_t *s;
                assert_int_equal(ddp_sampler_create(&o, &s, &err), DDP_OK);
                ddp_sampler_set_epoch(s, ep);
                const int64_t *idx;
                int64_t n;
                assert_int_equal(ddp_sampler_indices(s, &idx, &n), DDP_OK);
                assert_int_equal(n, ddp_sampler_len(s));
                assert_true(getline(&line, &cap, f) > 0);
                char *p = line, *end;
                long long want_n = strtoll(p, &end, 10);
                p = end;
                if (want_n != n)
                  fail_msg("N=%lld W=%d r=%d shuffle=%d drop_last=%d epoch=%d: len %lld, torch "
                           "%lld",
                           (long long)ns[a], w, r, sh, dl, ep, (long long)n, want_n);
                for (int64_t k = 0; k < n; k++) {
                  long long v = strtoll(p, &end, 10);
                  p = end;
                  if (v != idx[k])
                    fail_msg("N=%lld W=%d r=%d shuffle=%d drop_last=%d seed=%llu epoch=%d: "
                             "position %lld is %lld, torch %lld",
                             (long long)ns[a], w, r, sh, dl, (unsigned long long)seeds[sd], ep,
                             (long long)k, (long long)idx[k], v);
                }
                ddp_sampler_destroy(s);
              }
              configs++;
            }
  for (size_t k = 0; k < sizeof perm_n / sizeof perm_n[0]; k++) {
    int64_t n = perm_n[k];
    int64_t *perm = malloc((size_t)(n + 1) * sizeof *perm);
    ddp_randperm(n, k * 7919u, perm);
    assert_true(getline(&line, &cap, f) >= 0);
    char *p = line, *end;
    for (int64_t i = 0; i < n; i++) {
      long long v = strtoll(p, &end, 10);
      assert_true(end != p);
      p = end;
      if (v != perm[i])
        fail_msg("randperm(%lld, seed %zu) [%lld] = %lld, torch %lld", (long long)n, k * 7919u,
                 (long long)i, (long long)perm[i], v);
    }
    free(perm);
  }
  free(line);
  fclose(f);
  unlink(in);
  unlink(out);
  printf("  %d sampler configurations x all ranks and %zu randperms equal torch's\n", configs,
         sizeof perm_n / sizeof perm_n[0]);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* Properties that hold whatever torch does, checked without the oracle: every rank has
 * num_samples indices; without drop_last the ranks cover every index; with drop_last they
 * never repeat one; bad ranks give torch's message. */
static void test_sampler_properties(void **state) {
  (void)state;
  ddp_error_t err = {0};
  for (int64_t n = 0; n <= 23; n++)
    for (int w = 1; w <= 5; w++)
      for (int dl = 0; dl < 2; dl++) {
        int *seen = calloc((size_t)n + 1, sizeof *seen);
        int64_t total = 0;
        for (int r = 0; r < w; r++) {
          ddp_sampler_options_t o = DDP_SAMPLER_OPTIONS_INIT;
          o.dataset_len = n;
          o.num_replicas = w;
          o.rank = r;
          o.drop_last = dl;
          o.seed = 3;
          ddp_sampler_t *s;
          assert_int_equal(ddp_sampler_create(&o, &s, &err), DDP_OK);
          const int64_t *idx;
          int64_t cnt;
          assert_int_equal(ddp_sampler_indices(s, &idx, &cnt), DDP_OK);
          int64_t expect = dl ? n / w : (n + w - 1) / w;
          assert_int_equal(cnt, expect);
          assert_int_equal(ddp_sampler_total_size(s), expect * w);
          for (int64_t k = 0; k < cnt; k++) {
            assert_true(idx[k] >= 0 && idx[k] < n);
            seen[idx[k]]++;
          }
          total += cnt;
          ddp_sampler_destroy(s);
        }
        for (int64_t i = 0; i < n; i++) {
          if (!dl && total >= n) assert_true(seen[i] >= 1);
          if (dl) assert_true(seen[i] <= 1);
        }
        free(seen);
      }
  ddp_sampler_options_t o = DDP_SAMPLER_OPTIONS_INIT;
  o.dataset_len = 10;
  o.num_replicas = 4;
  o.rank = 4;
  ddp_sampler_t *s = NULL;
  assert_int_equal(ddp_sampler_create(&o, &s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_string_equal(err.msg, "Invalid rank 4, rank should be in the interval [0, 3]");
  o.rank = -1;
  assert_int_equal(ddp_sampler_create(&o, &s, &err), DDP_ERR_INVALID_ARGUMENT);
  o.rank = 0;
  o.num_replicas = 0;
  assert_int_equal(ddp_sampler_create(&o, &s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_null(s);
}

/* ---------------------------------------------------------------- sources --------- */

static void test_from_tensors(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  ddp_tensor_t x, y;
  int64_t xs[3] = {5, 2, 3}, ys[1] = {5};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F32, 3, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_I64, 1, ys), DDP_OK);
  for (int i = 0; i < 30; i++) ((float *)x.data)[i] = (float)i * 0.5f;
  for (int i = 0; i < 5; i++) ((int64_t *)y.data)[i] = 100 + i;
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_tensors(&x, &y, &ds, &err), DDP_OK);
  /* The dataset holds a copy: changing the source afterwards changes nothing. */
  ((float *)x.data)[6] = -1;
  assert_int_equal(ddp_dataset_length(ds), 5);
  assert_int_equal(ddp_dataset_feature_numel(ds), 6);
  assert_int_equal(ddp_dataset_spec(ds)->feature_ndim, 2);
  assert_int_equal(ddp_dataset_spec(ds)->label_ndim, 0);
  ddp_tensor_t f, l;
  int64_t fs[2] = {2, 3};
  assert_int_equal(ddp_tensor_alloc(&f, DDP_F32, 2, fs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&l, DDP_I64, 0, NULL), DDP_OK);
  for (int i = 0; i < 5; i++) {
    assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
    for (int k = 0; k < 6; k++) DDP_ASSERT_EQ(((float *)f.data)[k], (float)(i * 6 + k) * 0.5f);
    assert_int_equal(*(int64_t *)l.data, 100 + i);
  }
  assert_int_equal(ddp_dataset_get(ds, 5, &f, &l, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "index 5 out of range"));
  assert_int_equal(ddp_dataset_get(ds, 0, &l, &f, &err), DDP_ERR_INVALID_ARGUMENT);
  /* Row-count mismatch. */
  ddp_tensor_t y4;
  int64_t y4s[1] = {4};
  assert_int_equal(ddp_tensor_alloc(&y4, DDP_I64, 1, y4s), DDP_OK);
  ddp_dataset_t *bad = NULL;
  assert_int_equal(ddp_dataset_from_tensors(&x, &y4, &bad, &err), DDP_ERR_INVALID_DATA);
  assert_null(bad);
  ddp_tensor_free(&y4);
  ddp_dataset_destroy(ds);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
  ddp_tensor_free(&f);
  ddp_tensor_free(&l);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

static void test_from_safetensors(void **state) {
  (void)state;
  char path[128];
  ddp_test_tmp_file(path, sizeof path, "data", "st");
  ddp_tensor_t x, y;
  int64_t xs[2] = {4, 3}, ys[2] = {4, 2};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F64, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_F32, 2, ys), DDP_OK);
  for (int i = 0; i < 12; i++) ((double *)x.data)[i] = i / 7.0;
  for (int i = 0; i < 8; i++) ((float *)y.data)[i] = (float)-i;
  ddp_st_entry_t e[2] = {{"inputs", &x}, {"targets", &y}};
  ddp_error_t err = {0};
  assert_int_equal(ddp_st_write(path, e, 2, NULL, NULL, 0, &err), DDP_OK);
  ddp_dataset_t *ds;
  assert_int_equal(ddp_dataset_from_safetensors(path, "inputs", "targets", &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_length(ds), 4);
  assert_int_equal(ddp_dataset_spec(ds)->feature_dtype, DDP_F64);
  double fb[3];
  float lb[2];
  ddp_tensor_t f, l;
  int64_t s3[1] = {3}, s2[1] = {2};
  ddp_tensor_view(&f, DDP_F64, 1, s3, fb);
  ddp_tensor_view(&l, DDP_F32, 1, s2, lb);
  assert_int_equal(ddp_dataset_get(ds, 2, &f, &l, &err), DDP_OK);
  for (int k = 0; k < 3; k++) DDP_ASSERT_EQ(fb[k], (6 + k) / 7.0);
  DDP_ASSERT_EQ(lb[0], -4.0f);
  DDP_ASSERT_EQ(lb[1], -5.0f);
  ddp_dataset_destroy(ds);
  /* Default names are absent: a clear error naming them. */
  assert_int_equal(ddp_dataset_from_safetensors(path, NULL, NULL, &ds, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "'features'"));
  unlink(path);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
}

/* NaN and infinities in a safetensors data file, written so or made by a bit flip in the
 * payload (an exponent bit of a float32 close to 2 turns it into infinity), are refused
 * at load, naming the file, the tensor, the element and its sample. */
static void test_safetensors_nonfinite(void **state) {
  (void)state;
  char path[128];
  ddp_test_tmp_file(path, sizeof path, "data", "stnf");
  ddp_tensor_t x, y;
  int64_t xs[2] = {5, 4}, ys[1] = {5};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F32, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_F32, 1, ys), DDP_OK);
  static const struct {
    ddp_dtype_t dt;
    int tensor; /* 0 features, 1 labels */
    int64_t elem;
    double v;
    const char *needle;
  } cases[] = {
      {DDP_F32, 0, 9, NAN, "tensor 'features' element 9 (sample 2, index [2, 1]) is NaN"},
      {DDP_F32, 0, 19, INFINITY, "element 19 (sample 4, index [4, 3]) is infinite"},
      {DDP_F32, 1, 3, -INFINITY, "tensor 'labels' element 3 (sample 3, index [3]) is infinite"},
      {DDP_F64, 0, 0, NAN, "tensor 'features' element 0 (sample 0, index [0, 0]) is NaN"},
  };
  ddp_error_t err = {0};
  ddp_dataset_t *ds = NULL;
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    ddp_tensor_t xc;
    assert_int_equal(ddp_tensor_alloc(&xc, cases[c].dt, 2, xs), DDP_OK);
    for (int i = 0; i < 20; i++) {
      if (cases[c].dt == DDP_F32) ((float *)xc.data)[i] = 1.5f + (float)i;
      if (cases[c].dt == DDP_F64) ((double *)xc.data)[i] = 1.5 + i;
    }
    for (int i = 0; i < 5; i++) ((float *)y.data)[i] = (float)i;
    if (cases[c].tensor == 1) {
      ((float *)y.data)[cases[c].elem] = (float)cases[c].v;
    } else if (cases[c].dt == DDP_F32) {
      ((float *)xc.data)[cases[c].elem] = (float)cases[c].v;
    } else {
      ((double *)xc.data)[cases[c].elem] = cases[c].v;
    }
    ddp_st_entry_t e[2] = {{"features", &xc}, {"labels", &y}};
    assert_int_equal(ddp_st_write(path, e, 2, NULL, NULL, 0, &err), DDP_OK);
    ddp_tensor_free(&xc);
    memset(&err, 0, sizeof err);
    assert_int_equal(ddp_dataset_from_safetensors(path, NULL, NULL, &ds, &err),
                     DDP_ERR_INVALID_DATA);
    assert_null(ds);
    if (!strstr(err.msg, cases[c].needle) || !strstr(err.msg, path))
      fail_msg("case %zu: message '%s' lacks '%s' or the path", c, err.msg, cases[c].needle);
  }
  /* A clean file loads; the same file with one bit flipped in the payload does not. */
  for (int i = 0; i < 20; i++) ((float *)x.data)[i] = 1.75f;
  for (int i = 0; i < 5; i++) ((float *)y.data)[i] = (float)i;
  ddp_st_entry_t e[2] = {{"features", &x}, {"labels", &y}};
  assert_int_equal(ddp_st_write(path, e, 2, NULL, NULL, 0, &err), DDP_OK);
  assert_int_equal(ddp_dataset_from_safetensors(path, NULL, NULL, &ds, &err), DDP_OK);
  ddp_dataset_destroy(ds);
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  uint64_t hlen = 0;
  assert_int_equal(fread(&hlen, 8, 1, f), 1);
  /* The first tensor in the payload is "features" (names are sorted); element 6's bit 30,
   * the top exponent bit of 1.75f (0x3fe00000), gives 0x7fe00000: NaN. */
  long at = (long)(8 + hlen + 6 * 4 + 3);
  assert_int_equal(fseek(f, at, SEEK_SET), 0);
  int byte = fgetc(f);
  assert_int_equal(byte, 0x3f);
  assert_int_equal(fseek(f, at, SEEK_SET), 0);
  fputc(byte ^ 0x40, f);
  fclose(f);
  memset(&err, 0, sizeof err);
  assert_int_equal(ddp_dataset_from_safetensors(path, NULL, NULL, &ds, &err), DDP_ERR_INVALID_DATA);
  if (!strstr(err.msg, "tensor 'features' element 6 (sample 1, index [1, 2]) is NaN"))
    fail_msg("bit flip: message '%s'", err.msg);
  unlink(path);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
}

/* The shipped digits file: 1797 samples, F32 [64] in [0, 1] with multiples of 1/16, I64
 * labels 0..9; and equal to scikit-learn's load_digits (labels and pixel sums). */
static void test_digits_fixture(void **state) {
  (void)state;
  const char *root = ddp_test_source_root();
  if (!root) skip();
  char path[1024];
  snprintf(path, sizeof path, "%s/tests/data/digits.safetensors", root);
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_safetensors(path, NULL, NULL, &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_length(ds), 1797);
  assert_int_equal(ddp_dataset_feature_numel(ds), 64);
  assert_int_equal(ddp_dataset_spec(ds)->label_dtype, DDP_I64);
  int64_t *labels = malloc(1797 * sizeof *labels);
  int64_t *sums = malloc(1797 * sizeof *sums);
  int counts[10] = {0};
  float fb[64];
  int64_t lab;
  ddp_tensor_t f, l;
  sample_views(&f, fb, 64, &l, &lab);
  for (int i = 0; i < 1797; i++) {
    assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
    assert_true(lab >= 0 && lab <= 9);
    counts[lab]++;
    labels[i] = lab;
    int64_t s = 0;
    for (int k = 0; k < 64; k++) {
      float px = fb[k] * 16.0f;
      DDP_ASSERT_EQ(px, floorf(px));
      assert_true(px >= 0 && px <= 16);
      s += (int64_t)px;
    }
    sums[i] = s;
  }
  for (int c = 0; c < 10; c++) assert_true(counts[c] >= 170 && counts[c] <= 190);
  ddp_dataset_destroy(ds);
  char out[128], args[256];
  ddp_test_tmp_file(out, sizeof out, "data", "digits");
  snprintf(args, sizeof args, "digits %s", out);
  if (!ddp_test_run_tool("data_oracle.py", args)) {
    unlink(out);
    free(labels);
    free(sums);
    skip();
  }
  FILE *fp = fopen(out, "r");
  assert_non_null(fp);
  for (int i = 0; i < 1797; i++) {
    long long y, s;
    assert_int_equal(fscanf(fp, "%lld %lld", &y, &s), 2);
    if (y != labels[i] || s != sums[i])
      fail_msg("digits sample %d: label %lld sum %lld, sklearn %lld %lld", i, (long long)labels[i],
               (long long)sums[i], y, s);
  }
  fclose(fp);
  unlink(out);
  free(labels);
  free(sums);
}

/* CSV: values and labels as written; F32 labels; every malformed input is
 * DDP_ERR_INVALID_DATA naming the line. */
static void test_csv(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  char path[128];
  ddp_test_tmp_file(path, sizeof path, "data", "csv");
  const char *good = "a, b ,label,c\r\n1.5,2,3,-4e-1\n0,1e3,0,7\n  -2 ,3.25,9, 0.125\n\n \n";
  write_file(path, good, strlen(good));
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_csv(path, NULL, &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_length(ds), 3);
  assert_int_equal(ddp_dataset_feature_numel(ds), 3);
  static const float want_f[3][3] = {{1.5f, 2, -0.4f}, {0, 1000, 7}, {-2, 3.25f, 0.125f}};
  static const int64_t want_l[3] = {3, 0, 9};
  float fb[3];
  int64_t lb;
  ddp_tensor_t f, l;
  sample_views(&f, fb, 3, &l, &lb);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
    for (int k = 0; k < 3; k++) DDP_ASSERT_EQ(fb[k], want_f[i][k]);
    assert_int_equal(lb, want_l[i]);
  }
  ddp_dataset_destroy(ds);
  /* Regression labels from a named column, other delimiter. */
  const char *semi = "y;x1;x2\n0.5;1;2\n-1.25;3;4\n";
  write_file(path, semi, strlen(semi));
  ddp_csv_options_t o = DDP_CSV_OPTIONS_INIT;
  o.label_column = "y";
  o.label_dtype = DDP_F32;
  o.delimiter = ';';
  assert_int_equal(ddp_dataset_from_csv(path, &o, &ds, &err), DDP_OK);
  float yb;
  float xb[2];
  int64_t s2[1] = {2};
  ddp_tensor_view(&f, DDP_F32, 1, s2, xb);
  ddp_tensor_view(&l, DDP_F32, 0, NULL, &yb);
  assert_int_equal(ddp_dataset_get(ds, 1, &f, &l, &err), DDP_OK);
  DDP_ASSERT_EQ(yb, -1.25f);
  DDP_ASSERT_EQ(xb[0], 3);
  DDP_ASSERT_EQ(xb[1], 4);
  ddp_dataset_destroy(ds);

  static const struct {
    const char *text;
    const char *needle;
  } bad[] = {
      {"a,label\n1,2\n3\n", "line 3 has 1 fields, the header has 2"},
      {"a,label\n1,2\nx,3\n", "line 3 column 1 ('a'): not a number: 'x'"},
      {"a,label\n1,2\n,3\n", "line 3 column 1 ('a'): empty field"},
      {"a,b\n1,2\n", "no column named 'label'"},
      {"a,label\n1,2.5\n", "class label 2.5 is not an integer"},
      {"a,label\n1,2\n\n3,4\n", "line 3 is empty but data follows on line 4"},
      {"a,label\n", "no data rows"},
      {"", "missing header row"},
      {"a,label\n1,2,3\n", "line 2 has 3 fields"},
      {"a,label\n1e999x,2\n", "not a number"},
      {"label,label\n1,2\n", "appears twice"},
      {"a,label\nnan,1\n", "not a number"},
      /* Values that parse but cannot train: infinities and float32 overflow. */
      {"a,label\n1,0\ninf,1\n", "line 3 column 1 ('a'): 'inf' is not a finite number"},
      {"a,label\n1,0\n-Infinity,1\n", "line 3 column 1 ('a'): '-Infinity' is not a finite"},
      {"a,b,label\n1,1e999,0\n", "line 2 column 2 ('b'): '1e999' is not a finite number"},
      {"a,b,label\n1,2,0\n3,-1e39,1\n", "line 3 column 2 ('b'): '-1e39' is outside float32"},
      {"a,label\n1,1e39\n", "line 2 column 2 ('label'): '1e39' is outside float32"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_file(path, bad[i].text, strlen(bad[i].text));
    ds = NULL;
    memset(&err, 0, sizeof err);
    assert_int_equal(ddp_dataset_from_csv(path, NULL, &ds, &err), DDP_ERR_INVALID_DATA);
    assert_null(ds);
    if (!strstr(err.msg, bad[i].needle) || !strstr(err.msg, path))
      fail_msg("case %zu: message '%s' lacks '%s' or the path", i, err.msg, bad[i].needle);
  }
  unlink(path);
  assert_int_equal(ddp_dataset_from_csv(path, NULL, &ds, &err), DDP_ERR_NOT_FOUND);
  assert_non_null(strstr(err.msg, "No such file"));
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- MNIST ----------- */

static size_t idx_header(unsigned char *b, uint32_t magic, const uint32_t *dims, int nd) {
  uint32_t v[4] = {magic, 0, 0, 0};
  for (int d = 0; d < nd; d++) v[d + 1] = dims[d];
  for (int k = 0; k <= nd; k++) {
    b[4 * k] = (unsigned char)(v[k] >> 24);
    b[4 * k + 1] = (unsigned char)(v[k] >> 16);
    b[4 * k + 2] = (unsigned char)(v[k] >> 8);
    b[4 * k + 3] = (unsigned char)v[k];
  }
  return 4 + 4 * (size_t)nd;
}

static void test_mnist(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  char ip[128], lp[128];
  ddp_test_tmp_file(ip, sizeof ip, "data", "img");
  ddp_test_tmp_file(lp, sizeof lp, "data", "lab");
  enum { N = 5, R = 4, C = 3 };
  unsigned char img[16 + N * R * C], lab[8 + N];
  uint32_t idims[3] = {N, R, C}, ldims[1] = {N};
  size_t ih = idx_header(img, 0x803, idims, 3), lh = idx_header(lab, 0x801, ldims, 1);
  for (int i = 0; i < N * R * C; i++) img[ih + i] = (unsigned char)(i * 37 % 256);
  for (int i = 0; i < N; i++) lab[lh + i] = (unsigned char)(9 - i);
  write_file(ip, img, sizeof img);
  write_file(lp, lab, sizeof lab);
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  for (int scale = 0; scale < 2; scale++) {
    assert_int_equal(ddp_dataset_from_mnist(ip, lp, scale, &ds, &err), DDP_OK);
    assert_int_equal(ddp_dataset_length(ds), N);
    assert_int_equal(ddp_dataset_spec(ds)->feature_ndim, 2);
    assert_int_equal(ddp_dataset_spec(ds)->feature_shape[0], R);
    float fb[R * C];
    int64_t y;
    ddp_tensor_t f, l;
    int64_t fs[2] = {R, C};
    ddp_tensor_view(&f, DDP_F32, 2, fs, fb);
    ddp_tensor_view(&l, DDP_I64, 0, NULL, &y);
    for (int i = 0; i < N; i++) {
      assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
      assert_int_equal(y, 9 - i);
      for (int k = 0; k < R * C; k++) {
        float raw = (float)((i * R * C + k) * 37 % 256);
        DDP_ASSERT_EQ(fb[k], (scale ? raw / 255.0f : raw));
      }
    }
    ddp_dataset_destroy(ds);
  }
  /* Corruptions: each one an INVALID_DATA naming the file and the problem. */
  struct {
    const char *what, *needle;
    int file; /* 0 images, 1 labels */
    size_t len;
    int patch_at;
    unsigned char patch;
  } bad[] = {
      {"bad image magic", "magic at offset 0 is 0x00000804", 0, sizeof img, 3, 0x04},
      {"labels file given as images", "expected 0x00000803", 0, sizeof img, 3, 0x01},
      {"truncated images", "truncated", 0, sizeof img - 1, -1, 0},
      {"truncated header", "shorter than its 16-byte idx header", 0, 10, -1, 0},
      {"truncated labels", "truncated", 1, sizeof lab - 2, -1, 0},
      {"count mismatch", "holds 5 images but", 1, sizeof lab, 7, 6},
      {"zero rows", "dimension 1 (offset 8) is zero", 0, sizeof img, 11, 0},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    unsigned char b[sizeof img + 8];
    const unsigned char *src = bad[i].file ? lab : img;
    size_t full = bad[i].file ? sizeof lab : sizeof img;
    memcpy(b, src, full);
    if (bad[i].patch_at >= 0) b[bad[i].patch_at] = bad[i].patch;
    if (bad[i].file == 1 && bad[i].patch_at == 7) { /* count mismatch: one more label */
      b[full] = 0;
      bad[i].len = full + 1;
    }
    write_file(bad[i].file ? lp : ip, b, bad[i].len);
    ds = NULL;
    memset(&err, 0, sizeof err);
    assert_int_equal(ddp_dataset_from_mnist(ip, lp, true, &ds, &err), DDP_ERR_INVALID_DATA);
    assert_null(ds);
    if (!strstr(err.msg, bad[i].needle))
      fail_msg("%s: message '%s' lacks '%s'", bad[i].what, err.msg, bad[i].needle);
    write_file(ip, img, sizeof img);
    write_file(lp, lab, sizeof lab);
  }
  /* Trailing bytes after the images. */
  unsigned char longer[sizeof img + 3];
  memcpy(longer, img, sizeof img);
  memset(longer + sizeof img, 0, 3);
  write_file(ip, longer, sizeof longer);
  assert_int_equal(ddp_dataset_from_mnist(ip, lp, true, &ds, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "trailing bytes"));
  unlink(ip);
  unlink(lp);
  assert_int_equal(ddp_dataset_from_mnist(ip, lp, true, &ds, &err), DDP_ERR_NOT_FOUND);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- synthetic ------- */

static void test_synthetic_regression(void **state) {
  (void)state;
  ddp_synth_regression_t cfg =
      {.seed = 42, .n = 3000, .in_dim = 6, .hidden = 5, .out_dim = 2, .noise_std = 0.0f};
  ddp_dataset_t *clean, *again, *noisy, *other;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_synthetic_regression(&cfg, &clean, &err), DDP_OK);
  assert_int_equal(ddp_dataset_synthetic_regression(&cfg, &again, &err), DDP_OK);
  cfg.noise_std = 0.1f;
  assert_int_equal(ddp_dataset_synthetic_regression(&cfg, &noisy, &err), DDP_OK);
  cfg.seed = 43;
  assert_int_equal(ddp_dataset_synthetic_regression(&cfg, &other, &err), DDP_OK);
  ddp_tensor_t w1, b1, w2, b2;
  assert_int_equal(ddp_dataset_teacher(clean, &w1, &b1, &w2, &b2), DDP_OK);
  assert_int_equal(w1.shape[0], 5);
  assert_int_equal(w1.shape[1], 6);
  const float *W1 = w1.data, *B1 = b1.data, *W2 = w2.data, *B2 = b2.data;
  float x[6], y[2], x2[6], y2[2], xn[6], yn[2], xo[6], yo[2];
  ddp_tensor_t f, l, f2, l2, fn, ln, fo, lo;
  int64_t s6[1] = {6}, s2[1] = {2};
  ddp_tensor_view(&f, DDP_F32, 1, s6, x);
  ddp_tensor_view(&l, DDP_F32, 1, s2, y);
  ddp_tensor_view(&f2, DDP_F32, 1, s6, x2);
  ddp_tensor_view(&l2, DDP_F32, 1, s2, y2);
  ddp_tensor_view(&fn, DDP_F32, 1, s6, xn);
  ddp_tensor_view(&ln, DDP_F32, 1, s2, yn);
  ddp_tensor_view(&fo, DDP_F32, 1, s6, xo);
  ddp_tensor_view(&lo, DDP_F32, 1, s2, yo);
  double noise_sum = 0, noise_sq = 0, xs = 0, xsq = 0;
  int differ = 0;
  for (int64_t i = 2999; i >= 0; i--) { /* any order gives the same samples */
    assert_int_equal(ddp_dataset_get(clean, i, &f, &l, &err), DDP_OK);
    assert_int_equal(ddp_dataset_get(again, i, &f2, &l2, &err), DDP_OK);
    assert_int_equal(ddp_dataset_get(noisy, i, &fn, &ln, &err), DDP_OK);
    assert_int_equal(ddp_dataset_get(other, i, &fo, &lo, &err), DDP_OK);
    assert_memory_equal(x, x2, sizeof x);
    assert_memory_equal(y, y2, sizeof y);
    assert_memory_equal(x, xn, sizeof x); /* features come first, noise after */
    differ += memcmp(x, xo, sizeof x) != 0;
    /* The teacher's formula, evaluated independently. */
    for (int o = 0; o < 2; o++) {
      double acc = B2[o];
      for (int h = 0; h < 5; h++) {
        double z = B1[h];
        for (int k = 0; k < 6; k++) z += (double)W1[h * 6 + k] * x[k];
        acc += W2[o * 5 + h] * tanh(z);
      }
      assert_true(fabs(acc - y[o]) <= 1e-6 * (1 + fabs(acc)));
      double e = (double)yn[o] - y[o];
      noise_sum += e;
      noise_sq += e * e;
    }
    for (int k = 0; k < 6; k++) {
      xs += x[k];
      xsq += (double)x[k] * x[k];
    }
  }
  assert_true(differ > 2990);
  double nm = noise_sum / 6000, nsd = sqrt(noise_sq / 6000 - nm * nm);
  assert_true(fabs(nm) < 0.01 && fabs(nsd - 0.1) < 0.01);
  double xm = xs / 18000, xsd = sqrt(xsq / 18000 - xm * xm);
  assert_true(fabs(xm) < 0.05 && fabs(xsd - 1) < 0.05);
  ddp_dataset_destroy(clean);
  ddp_dataset_destroy(again);
  ddp_dataset_destroy(noisy);
  ddp_dataset_destroy(other);
  cfg.in_dim = 0;
  assert_int_equal(ddp_dataset_synthetic_regression(&cfg, &clean, &err), DDP_ERR_INVALID_ARGUMENT);
}

static void test_synthetic_mixture(void **state) {
  (void)state;
  enum { K = 4, D = 3, N = 8000 };
  ddp_synth_mixture_t cfg = {.seed = 7, .n = N, .dim = D, .num_classes = K, .separation = 5.0f};
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_synthetic_mixture(&cfg, &ds, &err), DDP_OK);
  ddp_tensor_t c;
  assert_int_equal(ddp_dataset_centers(ds, &c), DDP_OK);
  const float *ctr = c.data;
  float x[D];
  int64_t y;
  ddp_tensor_t f, l;
  sample_views(&f, x, D, &l, &y);
  int count[K] = {0};
  double sum[K][D] = {{0}}, sq[K][D] = {{0}};
  int nearest_ok = 0;
  for (int i = 0; i < N; i++) {
    assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
    assert_true(y >= 0 && y < K);
    count[y]++;
    double best = INFINITY;
    int arg = -1;
    for (int k = 0; k < K; k++) {
      double d2 = 0;
      for (int j = 0; j < D; j++) d2 += (x[j] - ctr[k * D + j]) * (x[j] - ctr[k * D + j]);
      if (d2 < best) best = d2, arg = k;
    }
    nearest_ok += arg == y;
    for (int j = 0; j < D; j++) {
      double e = x[j] - ctr[y * D + j];
      sum[y][j] += e;
      sq[y][j] += e * e;
    }
  }
  /* Classes balanced within sampling error; residuals N(0, 1); separable enough. */
  for (int k = 0; k < K; k++) {
    assert_true(abs(count[k] - N / K) < 150);
    for (int j = 0; j < D; j++) {
      double m = sum[k][j] / count[k], v = sq[k][j] / count[k] - m * m;
      assert_true(fabs(m) < 0.1 && fabs(v - 1) < 0.1);
    }
  }
  assert_true(nearest_ok > N * 8 / 10);
  /* Reproducible by (seed, index). */
  float x2[D];
  int64_t y2;
  ddp_tensor_t f2, l2;
  sample_views(&f2, x2, D, &l2, &y2);
  ddp_dataset_t *ds2;
  assert_int_equal(ddp_dataset_synthetic_mixture(&cfg, &ds2, &err), DDP_OK);
  assert_int_equal(ddp_dataset_get(ds, 1234, &f, &l, &err), DDP_OK);
  assert_int_equal(ddp_dataset_get(ds2, 1234, &f2, &l2, &err), DDP_OK);
  assert_memory_equal(x, x2, sizeof x);
  assert_int_equal(y, y2);
  ddp_tensor_t w1, b1, w2, b2;
  assert_int_equal(ddp_dataset_teacher(ds, &w1, &b1, &w2, &b2), DDP_ERR_INVALID_ARGUMENT);
  ddp_dataset_destroy(ds);
  ddp_dataset_destroy(ds2);
}

/* ---------------------------------------------------------------- loader ---------- */

/* W ranks, each with its sampler and loader: batch b of rank r holds the sampler's indices
 * [b*B, (b+1)*B) and the dataset's rows for them; drop_last drops the short batch. */
static void test_loader(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  enum { N = 23, D = 2 };
  ddp_tensor_t x, y;
  int64_t xs[2] = {N, D}, ys[1] = {N};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F32, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_I64, 1, ys), DDP_OK);
  for (int i = 0; i < N; i++) {
    ((float *)x.data)[i * D] = (float)i;
    ((float *)x.data)[i * D + 1] = (float)-i;
    ((int64_t *)y.data)[i] = i % 3;
  }
  ddp_dataset_t *ds;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_tensors(&x, &y, &ds, &err), DDP_OK);
  for (int w = 1; w <= 3; w++)
    for (int dl = 0; dl < 2; dl++)
      for (int r = 0; r < w; r++) {
        ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
        so.dataset_len = N;
        so.num_replicas = w;
        so.rank = r;
        so.seed = 11;
        ddp_sampler_t *s;
        assert_int_equal(ddp_sampler_create(&so, &s, &err), DDP_OK);
        ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
        lo.batch_size = 3;
        lo.drop_last = dl;
        ddp_loader_t *ld;
        assert_int_equal(ddp_loader_create(ds, s, &lo, &ld, &err), DDP_OK);
        for (int ep = 0; ep < 2; ep++) {
          assert_int_equal(ddp_loader_set_epoch(ld, ep, &err), DDP_OK);
          /* The expected order, from a second sampler at the same epoch. */
          ddp_sampler_t *ref;
          assert_int_equal(ddp_sampler_create(&so, &ref, &err), DDP_OK);
          ddp_sampler_set_epoch(ref, ep);
          const int64_t *idx;
          int64_t n;
          assert_int_equal(ddp_sampler_indices(ref, &idx, &n), DDP_OK);
          int64_t pos = 0, nb = 0;
          ddp_batch_t b;
          bool has;
          for (;;) {
            assert_int_equal(ddp_loader_next(ld, &b, &has, &err), DDP_OK);
            if (!has) break;
            assert_int_equal(b.index, nb);
            assert_int_equal(b.features.shape[0], b.size);
            assert_int_equal(b.features.shape[1], D);
            assert_int_equal(b.labels.ndim, 1);
            if (dl) assert_int_equal(b.size, 3);
            for (int64_t k = 0; k < b.size; k++) {
              int64_t want = idx[pos + k];
              assert_int_equal(b.indices[k], want);
              DDP_ASSERT_EQ(((float *)b.features.data)[k * D], (float)want);
              DDP_ASSERT_EQ(((float *)b.features.data)[k * D + 1], (float)-want);
              assert_int_equal(((int64_t *)b.labels.data)[k], want % 3);
            }
            pos += b.size;
            nb++;
          }
          assert_int_equal(nb, ddp_loader_num_batches(ld));
          assert_int_equal(pos, dl ? n / 3 * 3 : n);
          /* Stays at the end until the next set_epoch. */
          assert_int_equal(ddp_loader_next(ld, &b, &has, &err), DDP_OK);
          assert_false(has);
          /* ddp_loader_seek: batch k of the epoch, backwards and forwards, then on. */
          for (int64_t k = nb - 1; k >= 0; k -= 2) {
            assert_int_equal(ddp_loader_seek(ld, ep, k, &err), DDP_OK);
            assert_int_equal(ddp_loader_next(ld, &b, &has, &err), DDP_OK);
            assert_true(has);
            assert_int_equal(b.index, k);
            assert_int_equal(b.indices[0], idx[k * 3]);
          }
          assert_int_equal(ddp_loader_seek(ld, ep, nb, &err), DDP_ERR_INVALID_ARGUMENT);
          assert_non_null(strstr(err.msg, "outside epoch"));
          assert_int_equal(ddp_loader_set_epoch(ld, ep, &err), DDP_OK);
          ddp_sampler_destroy(ref);
        }
        ddp_loader_destroy(ld);
        ddp_sampler_destroy(s);
      }
  /* No sampler: sequential order, epoch started implicitly. */
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = 10;
  ddp_loader_t *ld;
  assert_int_equal(ddp_loader_create(ds, NULL, &lo, &ld, &err), DDP_OK);
  assert_int_equal(ddp_loader_num_batches(ld), 3);
  ddp_batch_t b;
  bool has;
  int64_t seen = 0;
  while (ddp_loader_next(ld, &b, &has, &err) == DDP_OK && has)
    for (int64_t k = 0; k < b.size; k++) assert_int_equal(b.indices[k], seen++);
  assert_int_equal(seen, N);
  ddp_loader_destroy(ld);
  /* A sampler for another length is refused. */
  ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
  so.dataset_len = N + 1;
  ddp_sampler_t *s;
  assert_int_equal(ddp_sampler_create(&so, &s, &err), DDP_OK);
  assert_int_equal(ddp_loader_create(ds, s, &lo, &ld, &err), DDP_ERR_INVALID_ARGUMENT);
  lo.batch_size = 0;
  assert_int_equal(ddp_loader_create(ds, NULL, &lo, &ld, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "batch_size=0"));
  ddp_sampler_destroy(s);
  ddp_dataset_destroy(ds);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sampler_vs_torch),
      cmocka_unit_test(test_sampler_properties),
      cmocka_unit_test(test_from_tensors),
      cmocka_unit_test(test_from_safetensors),
      cmocka_unit_test(test_safetensors_nonfinite),
      cmocka_unit_test(test_digits_fixture),
      cmocka_unit_test(test_csv),
      cmocka_unit_test(test_mnist),
      cmocka_unit_test(test_synthetic_regression),
      cmocka_unit_test(test_synthetic_mixture),
      cmocka_unit_test(test_loader),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
