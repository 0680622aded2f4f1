/* tools/ddp-compare and tools/torch/torch_reference.py (docs/compare.md, docs/dumps.md).
 *
 * Without torch: dumps written here with ddp_st_write, whose differences the test plants
 * and therefore knows (ULP distances, the first element beyond tolerance, layouts), and
 * every kind of bad input. With torch (Debian's /usr/bin/python3): the reference run is
 * deterministic (two runs, byte-identical tensors) and records bucket layouts that follow
 * spec §2.2-2.3, DDP leaves every rank with the same averaged gradients, a planted
 * one-element change is found at its step, rank, tensor and index, and W ranks at batch b
 * agree with one rank at batch W*b. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/io.h"
#include "harness.h"
#include "parity.h"

static char g_tool[1024]; /* the ddp-compare executable */
static char g_tmp[256];   /* scratch directory for this file's dumps */
static bool g_torch;      /* the three reference dumps below exist */
static char g_a[512], g_b[512], g_single[512];

/* ---------------------------------------------------------------- helpers --------- */

/* Commands run through ddp_test_run_cmd (tests/harness/parity.c), which leaves their stderr
 * in g_tmp/stderr.txt; this reads it back and fails the test when it cannot. */
static char *stderr_text(void) {
  char *t = ddp_test_cmd_stderr();
  assert_non_null(t);
  return t;
}

/* ddp-compare --json EXTRA A B; the parsed report in *json (the caller deletes it). */
static int compare(const char *extra, const char *a, const char *b, cJSON **json) {
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out, "%s --json %s '%s' '%s'", g_tool, extra ? extra : "", a, b);
  cJSON *j = cJSON_Parse(out);
  if (!j) fail_msg("ddp-compare printed no JSON (exit %d): %s", rc, out);
  free(out);
  if (json)
    *json = j;
  else
    cJSON_Delete(j);
  return rc;
}

static const cJSON *get(const cJSON *o, const char *key) { return ddp_test_json_get(o, key); }

/* Checks the report's first_failure: step, rank, tensor, flat index and 2-D coordinates;
 * returns it for further checks. */
static const cJSON *expect_first_failure(const cJSON *report, int step, int rank,
                                         const char *tensor, int index, int row, int col) {
  const cJSON *ff = get(report, "first_failure");
  assert_int_equal(get(ff, "step")->valueint, step);
  assert_int_equal(get(ff, "rank")->valueint, rank);
  assert_string_equal(get(ff, "tensor")->valuestring, tensor);
  assert_int_equal(get(ff, "index")->valueint, index);
  assert_int_equal(cJSON_GetArrayItem(get(ff, "coords"), 0)->valueint, row);
  assert_int_equal(cJSON_GetArrayItem(get(ff, "coords"), 1)->valueint, col);
  return ff;
}

static const cJSON *tensor_stats(const cJSON *report, const char *name) {
  const cJSON *t;
  cJSON_ArrayForEach(t, get(report, "tensors")) {
    if (strcmp(get(t, "name")->valuestring, name) == 0) return t;
  }
  fail_msg("no stats for tensor %s", name);
  return NULL;
}

static void mkdir_p(const char *path) {
  char line[1024];
  snprintf(line, sizeof line, "mkdir -p '%s'", path);
  assert_int_equal(system(line), 0);
}

static bool files_equal(const char *p1, const char *p2) {
  FILE *a = fopen(p1, "rb"), *b = fopen(p2, "rb");
  bool eq = a && b;
  while (eq) {
    int ca = fgetc(a), cb = fgetc(b);
    if (ca != cb) eq = false;
    if (ca == EOF || cb == EOF) break;
  }
  if (a) fclose(a);
  if (b) fclose(b);
  return eq;
}

/* Rewrites a safetensors file with element `index` of tensor `name` (F32) replaced by
 * f(old); every other byte of every tensor, and the metadata, unchanged. */
static void plant(const char *path, const char *name, int64_t index, float (*f)(float)) {
  ddp_st_file_t *st = NULL;
  assert_int_equal(ddp_st_open(path, DDP_ST_READ, &st, NULL), DDP_OK);
  size_t n = ddp_st_count(st), nm = ddp_st_meta_count(st), target;
  assert_int_equal(ddp_st_find(st, name, &target), DDP_OK);
  ddp_st_entry_t *e = calloc(n, sizeof *e);
  ddp_tensor_t *views = calloc(n, sizeof *views);
  const char **mk = calloc(nm + 1, sizeof *mk), **mv = calloc(nm + 1, sizeof *mv);
  assert_true(e && views && mk && mv);
  ddp_tensor_t copy;
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(ddp_st_tensor(st, i, &views[i]), DDP_OK);
    e[i].name = ddp_st_name(st, i);
    e[i].tensor = &views[i];
  }
  assert_int_equal(views[target].dtype, DDP_F32);
  assert_true(index < views[target].numel);
  assert_int_equal(ddp_tensor_alloc(&copy, DDP_F32, views[target].ndim, views[target].shape),
                   DDP_OK);
  memcpy(copy.data, views[target].data, ddp_tensor_nbytes(&copy));
  ((float *)copy.data)[index] = f(((float *)copy.data)[index]);
  e[target].tensor = &copy;
  for (size_t i = 0; i < nm; i++) {
    mk[i] = ddp_st_meta_key(st, i);
    mv[i] = ddp_st_meta_value(st, i);
  }
  assert_int_equal(ddp_st_write(path, e, n, mk, mv, nm, NULL), DDP_OK);
  ddp_tensor_free(&copy);
  free(e);
  free(views);
  free(mk);
  free(mv);
  ddp_st_close(st);
}

static float big_change(float x) { return x * 1.01f + 1e-3f; }
static float one_ulp(float x) { return nextafterf(x, INFINITY); }

/* ---------------------------------------------------------------- synthetic dumps - */

static void write_meta(const char *dir, int world, int steps, const char *format) {
  char p[600], text[512];
  mkdir_p(dir);
  snprintf(p, sizeof p, "%s/meta.json", dir);
  snprintf(text, sizeof text,
           "{\"format\": \"%s\", \"producer\": \"test_compare\", \"world_size\": %d, "
           "\"steps\": %d, \"config\": {}, \"model\": {}}\n",
           format, world, steps);
  ddp_test_write_text(p, text);
}

/* rank{r}/step{s}.safetensors holding param.w (F32 [2, 4], the given values) and
 * input.y (I64 [2] = {s, r}). */
static void write_step(const char *dir, int rank, int step, const float *w, int w_ndim,
                       const int64_t *w_shape) {
  char d[600], p[700];
  snprintf(d, sizeof d, "%s/rank%d", dir, rank);
  mkdir_p(d);
  snprintf(p, sizeof p, "%s/step%06d.safetensors", d, step);
  ddp_tensor_t tw, ty;
  int64_t y[2] = {step, rank}, ys = 2;
  assert_int_equal(ddp_tensor_view(&tw, DDP_F32, w_ndim, w_shape, (void *)w), DDP_OK);
  assert_int_equal(ddp_tensor_view(&ty, DDP_I64, 1, &ys, y), DDP_OK);
  ddp_st_entry_t e[2] = {{"param.w", &tw}, {"input.y", &ty}};
  const char *mk[1] = {"loss"}, *mv[1] = {"1.5"};
  assert_int_equal(ddp_st_write(p, e, 2, mk, mv, 1, NULL), DDP_OK);
}

static const float base_w[8] = {1.0f, 1.5f, -2.0f, 0.75f, 3.0f, 1.25f, 0.0f, -0.5f};
static const int64_t shape24[2] = {2, 4};

/* A dump with W ranks and S steps of base_w. */
static void synthetic_dump(const char *dir, int world, int steps) {
  write_meta(dir, world, steps, "libddp-dump-1");
  for (int r = 0; r < world; r++)
    for (int s = 0; s < steps; s++) write_step(dir, r, s, base_w, 2, shape24);
}

static float ulps_away(float x, int k) {
  for (int i = 0; i < k; i++) x = nextafterf(x, INFINITY);
  return x;
}

/* ---------------------------------------------------------------- tests: no torch -- */

/* Distances planted at known ULP counts land in the right histogram buckets; max_abs and
 * max_rel equal what the test computes; with the default tolerance exactly the 256-ULP
 * element is beyond it and is the reported first failure (step, rank, index, coords). */
static void test_ulp_histogram(void **state) {
  (void)state;
  char a[512], b[512];
  snprintf(a, sizeof a, "%s/ulp_a", g_tmp);
  snprintf(b, sizeof b, "%s/ulp_b", g_tmp);
  synthetic_dump(a, 2, 2);
  synthetic_dump(b, 2, 2);
  static const int k[8] = {0, 1, 2, 4, 16, 256, 0, 3};
  float w[8];
  double max_abs = 0, max_rel = 0;
  for (int i = 0; i < 8; i++) {
    w[i] = ulps_away(base_w[i], k[i]);
    double d = fabs((double)w[i] - (double)base_w[i]);
    double m = fmax(fabs((double)w[i]), fabs((double)base_w[i]));
    max_abs = fmax(max_abs, d);
    if (d > 0) max_rel = fmax(max_rel, d / m);
  }
  w[6] = -0.0f; /* equal to +0.0: distance 0 */
  write_step(b, 1, 1, w, 2, shape24);

  /* Expected buckets from the planted distances: 0, 1, 2-3, 4-15, 16-255, >= 256. */
  uint64_t expect[6] = {0};
  for (int i = 0; i < 8; i++) {
    int kk = k[i];
    expect[kk == 0 ? 0 : kk == 1 ? 1 : kk < 4 ? 2 : kk < 16 ? 3 : kk < 256 ? 4 : 5]++;
  }
  expect[0] += 8 * 3; /* the three unchanged (step, rank) files */

  cJSON *j;
  assert_int_equal(compare("--rtol 1 --atol 1", a, b, &j), 0);
  const cJSON *t = tensor_stats(j, "param.w");
  const cJSON *h = get(t, "ulp_hist");
  for (int i = 0; i < 6; i++)
    assert_int_equal((uint64_t)cJSON_GetArrayItem(h, i)->valuedouble, expect[i]);
  DDP_ASSERT_EQ(get(t, "max_abs")->valuedouble, max_abs);
  assert_true(fabs(get(t, "max_rel")->valuedouble - max_rel) <= 1e-15);
  assert_int_equal((int)get(t, "elements")->valuedouble, 32);
  assert_true(cJSON_IsNull(get(j, "first_failure")));
  cJSON_Delete(j);

  assert_int_equal(compare(NULL, a, b, &j), 1);
  const cJSON *ff = expect_first_failure(j, 1, 1, "param.w", 5, 1, 1);
  assert_int_equal(get(ff, "ulps")->valueint, 256);
  assert_int_equal((int)get(tensor_stats(j, "param.w"), "beyond")->valuedouble, 1);
  cJSON_Delete(j);

  /* The readable table says the same. */
  char *out = NULL;
  assert_int_equal(ddp_test_run_cmd(&out, "%s '%s' '%s'", g_tool, a, b), 1);
  assert_non_null(strstr(out, "first difference beyond tolerance: step 1, rank 1, tensor "
                              "param.w, index 5 [1, 1]"));
  free(out);
}

/* Bucket layouts are compared per rank: equal, different (exit 1), or unavailable. */
static void test_layouts(void **state) {
  (void)state;
  char a[512], b[512], p[700];
  snprintf(a, sizeof a, "%s/lay_a", g_tmp);
  snprintf(b, sizeof b, "%s/lay_b", g_tmp);
  synthetic_dump(a, 1, 1);
  synthetic_dump(b, 1, 1);
  snprintf(p, sizeof p, "%s/rank0/ddp.json", a);
  ddp_test_write_text(p, "{\"bucket_layouts\": {\"initial\": [[0, 1]], \"rebuilt\": [[1], [0]]}}");
  cJSON *j;
  assert_int_equal(compare(NULL, a, b, &j), 0); /* B has no ddp.json: unavailable */
  assert_string_equal(get(cJSON_GetArrayItem(get(j, "layouts"), 0), "rebuilt")->valuestring,
                      "unavailable");
  cJSON_Delete(j);
  snprintf(p, sizeof p, "%s/rank0/ddp.json", b);
  ddp_test_write_text(p, "{\"bucket_layouts\": {\"initial\": [[0, 1]], \"rebuilt\": [[1], [0]]}}");
  assert_int_equal(compare(NULL, a, b, &j), 0);
  assert_string_equal(get(cJSON_GetArrayItem(get(j, "layouts"), 0), "initial")->valuestring,
                      "equal");
  cJSON_Delete(j);
  ddp_test_write_text(p, "{\"bucket_layouts\": {\"initial\": [[0, 1]], \"rebuilt\": [[1, 0]]}}");
  assert_int_equal(compare(NULL, a, b, &j), 1);
  assert_true(cJSON_IsTrue(get(j, "layouts_differ")));
  assert_string_equal(get(cJSON_GetArrayItem(get(j, "layouts"), 0), "rebuilt")->valuestring,
                      "differ");
  assert_true(cJSON_IsNull(get(j, "first_failure")));
  cJSON_Delete(j);
  assert_int_equal(compare("--no-layouts", a, b, NULL), 0);
}

/* Exit 2, with a message naming the problem, for every kind of bad input. */
static void test_bad_input(void **state) {
  (void)state;
  char a[512], b[512], p[700], *msg;
  cJSON *j;
  snprintf(a, sizeof a, "%s/bad_a", g_tmp);
  synthetic_dump(a, 2, 2);

#define EXPECT_BAD(needle)                                               \
  do {                                                                   \
    assert_int_equal(compare(NULL, a, b, &j), 2);                        \
    assert_int_equal(get(j, "exit")->valueint, 2);                       \
    cJSON_Delete(j);                                                     \
    msg = stderr_text();                                                 \
    if (!strstr(msg, needle)) fail_msg("no \"%s\" in: %s", needle, msg); \
    free(msg);                                                           \
  } while (0)

  snprintf(b, sizeof b, "%s/bad_missing", g_tmp);
  EXPECT_BAD("bad_missing is not a dump directory");

  snprintf(b, sizeof b, "%s/bad_format", g_tmp);
  synthetic_dump(b, 2, 2);
  write_meta(b, 2, 2, "libddp-dump-0");
  EXPECT_BAD("is not \"libddp-dump-1\"");

  snprintf(b, sizeof b, "%s/bad_json", g_tmp);
  synthetic_dump(b, 2, 2);
  snprintf(p, sizeof p, "%s/meta.json", b);
  ddp_test_write_text(p, "{\"format\": ");
  EXPECT_BAD("is not valid JSON");

  snprintf(b, sizeof b, "%s/bad_world", g_tmp);
  synthetic_dump(b, 3, 2);
  EXPECT_BAD("world sizes differ");

  snprintf(b, sizeof b, "%s/bad_step", g_tmp);
  synthetic_dump(b, 2, 2);
  snprintf(p, sizeof p, "%s/rank1/step000001.safetensors", b);
  assert_int_equal(unlink(p), 0);
  EXPECT_BAD("rank1/step000001.safetensors");

  snprintf(b, sizeof b, "%s/bad_corrupt", g_tmp);
  synthetic_dump(b, 2, 2);
  snprintf(p, sizeof p, "%s/rank0/step000001.safetensors", b);
  assert_int_equal(truncate(p, 20), 0);
  EXPECT_BAD("rank0/step000001.safetensors");

  snprintf(b, sizeof b, "%s/bad_shape", g_tmp);
  synthetic_dump(b, 2, 2);
  int64_t s42[2] = {4, 2};
  write_step(b, 0, 1, base_w, 2, s42);
  EXPECT_BAD("tensor param.w: F32[2, 4] in");

  snprintf(b, sizeof b, "%s/bad_name", g_tmp);
  synthetic_dump(b, 2, 2);
  {
    char d[700];
    snprintf(d, sizeof d, "%s/rank1/step000000.safetensors", b);
    ddp_tensor_t tw;
    assert_int_equal(ddp_tensor_view(&tw, DDP_F32, 2, shape24, (void *)base_w), DDP_OK);
    ddp_st_entry_t e[1] = {{"param.v", &tw}};
    assert_int_equal(ddp_st_write(d, e, 1, NULL, NULL, 0, NULL), DDP_OK);
  }
  EXPECT_BAD("is in");
#undef EXPECT_BAD

  /* Usage errors are bad input too. */
  assert_int_equal(ddp_test_run_cmd(NULL, "%s --rtol x '%s' '%s'", g_tool, a, a), 2);
  assert_int_equal(ddp_test_run_cmd(NULL, "%s '%s'", g_tool, a), 2);
  assert_int_equal(ddp_test_run_cmd(NULL, "%s --rank 5 '%s' '%s'", g_tool, a, a), 2);
  assert_int_equal(ddp_test_run_cmd(NULL, "%s '%s' '%s'", g_tool, a, a), 0);
}

/* ---------------------------------------------------------------- tests: torch ----- */

#define NEED_TORCH()                                                     \
  do {                                                                   \
    if (!g_torch) {                                                      \
      print_message("torch (under /usr/bin/python3) absent: skipped\n"); \
      skip();                                                            \
    }                                                                    \
  } while (0)

/* Two reference runs of one configuration: ddp-compare finds them equal, every tensor
 * file is byte-identical, the bucket layouts were recorded (initial and rebuilt) and
 * agree; and DDP left both ranks with bitwise the same averaged gradients and parameters. */
static void test_reference_deterministic(void **state) {
  (void)state;
  NEED_TORCH();
  cJSON *j;
  assert_int_equal(compare(NULL, g_a, g_b, &j), 0);
  const cJSON *l;
  cJSON_ArrayForEach(l, get(j, "layouts")) {
    assert_string_equal(get(l, "initial")->valuestring, "equal");
    assert_string_equal(get(l, "rebuilt")->valuestring, "equal");
  }
  assert_int_equal(cJSON_GetArraySize(get(j, "layouts")), 2);
  cJSON_Delete(j);
  /* The recorded layouts follow spec §2.2-2.3 for a 4840-byte model: one bucket of every
   * parameter in index order at construction (find_unused off), and after the rebuild one
   * bucket (under the 1 MiB first limit) in the order the gradients became ready. */
  {
    char p[700];
    snprintf(p, sizeof p, "%s/rank1/ddp.json", g_a);
    char *text = ddp_test_read_text(p);
    assert_non_null(text);
    cJSON *d = cJSON_Parse(text);
    free(text);
    assert_non_null(d);
    assert_true(cJSON_IsTrue(get(d, "initial_layout_verified")));
    const cJSON *lay = get(d, "bucket_layouts");
    const cJSON *ini = get(lay, "initial"), *reb = get(lay, "rebuilt");
    const cJSON *ready = get(d, "grad_ready_order");
    assert_int_equal(cJSON_GetArraySize(ini), 1);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(ini, 0)), 4);
    for (int i = 0; i < 4; i++)
      assert_int_equal(cJSON_GetArrayItem(cJSON_GetArrayItem(ini, 0), i)->valueint, i);
    assert_int_equal(cJSON_GetArraySize(reb), 1);
    assert_true(cJSON_Compare(cJSON_GetArrayItem(reb, 0), ready, true));
    /* A linear layer's bias is ready before its weight, the last layer first. */
    static const int order[4] = {3, 2, 1, 0};
    for (int i = 0; i < 4; i++) assert_int_equal(cJSON_GetArrayItem(ready, i)->valueint, order[i]);
    cJSON_Delete(d);
  }
  for (int r = 0; r < 2; r++)
    for (int s = -1; s < 3; s++) {
      char pa[700], pb[700];
      if (s < 0) {
        snprintf(pa, sizeof pa, "%s/rank%d/init.safetensors", g_a, r);
        snprintf(pb, sizeof pb, "%s/rank%d/init.safetensors", g_b, r);
      } else {
        snprintf(pa, sizeof pa, "%s/rank%d/step%06d.safetensors", g_a, r, s);
        snprintf(pb, sizeof pb, "%s/rank%d/step%06d.safetensors", g_b, r, s);
      }
      if (!files_equal(pa, pb)) fail_msg("%s and %s differ", pa, pb);
    }
  /* Every rank holds the same averaged gradients and parameters after each step. */
  for (int s = 0; s < 3; s++) {
    char p0[700], p1[700];
    snprintf(p0, sizeof p0, "%s/rank0/step%06d.safetensors", g_a, s);
    snprintf(p1, sizeof p1, "%s/rank1/step%06d.safetensors", g_a, s);
    ddp_st_file_t *f0, *f1;
    assert_int_equal(ddp_st_open(p0, DDP_ST_READ, &f0, NULL), DDP_OK);
    assert_int_equal(ddp_st_open(p1, DDP_ST_READ, &f1, NULL), DDP_OK);
    int nshared = 0;
    for (size_t i = 0; i < ddp_st_count(f0); i++) {
      const char *name = ddp_st_name(f0, i);
      size_t k;
      if (strncmp(name, "grad.", 5) != 0 && strncmp(name, "param.", 6) != 0) continue;
      ddp_tensor_t t0, t1;
      assert_int_equal(ddp_st_find(f1, name, &k), DDP_OK);
      assert_int_equal(ddp_st_tensor(f0, i, &t0), DDP_OK);
      assert_int_equal(ddp_st_tensor(f1, k, &t1), DDP_OK);
      assert_int_equal(ddp_tensor_nbytes(&t0), ddp_tensor_nbytes(&t1));
      if (memcmp(t0.data, t1.data, ddp_tensor_nbytes(&t0)) != 0)
        fail_msg("step %d: %s differs between rank 0 and rank 1", s, name);
      nshared++;
    }
    assert_int_equal(nshared, 8); /* 4 gradients, 4 parameters */
    /* ...while the ranks' inputs are different samples. */
    size_t i0, i1;
    ddp_tensor_t x0, x1;
    assert_int_equal(ddp_st_find(f0, "input.index", &i0), DDP_OK);
    assert_int_equal(ddp_st_find(f1, "input.index", &i1), DDP_OK);
    assert_int_equal(ddp_st_tensor(f0, i0, &x0), DDP_OK);
    assert_int_equal(ddp_st_tensor(f1, i1, &x1), DDP_OK);
    assert_true(memcmp(x0.data, x1.data, ddp_tensor_nbytes(&x0)) != 0);
    ddp_st_close(f0);
    ddp_st_close(f1);
  }
}

/* A one-element change planted in a copy of a reference dump is reported at exactly its
 * step, rank, tensor and index; a second, later one does not displace it; a 1-ULP change
 * alone stays within tolerance but shows in the histogram. */
static void test_planted_difference(void **state) {
  (void)state;
  NEED_TORCH();
  char p[600], f[700];
  cJSON *j;
  snprintf(p, sizeof p, "%s/planted", g_tmp);
  assert_int_equal(ddp_test_run_cmd(NULL, "rm -rf '%s' && cp -r '%s' '%s'", p, g_a, p), 0);
  snprintf(f, sizeof f, "%s/rank0/step000002.safetensors", p);
  plant(f, "param.0.bias", 3, big_change);
  snprintf(f, sizeof f, "%s/rank1/step000001.safetensors", p);
  plant(f, "grad.2.weight", 7, big_change);
  assert_int_equal(compare(NULL, g_a, p, &j), 1);
  const cJSON *ff = expect_first_failure(j, 1, 1, "grad.2.weight", 7, 0, 7);
  DDP_ASSERT_EQ(get(ff, "b")->valuedouble, (double)big_change((float)get(ff, "a")->valuedouble));
  assert_int_equal((int)get(tensor_stats(j, "grad.2.weight"), "beyond")->valuedouble, 1);
  assert_int_equal((int)get(tensor_stats(j, "param.0.bias"), "beyond")->valuedouble, 1);
  assert_int_equal((int)get(tensor_stats(j, "grad.0.weight"), "beyond")->valuedouble, 0);
  cJSON_Delete(j);

  assert_int_equal(ddp_test_run_cmd(NULL, "rm -rf '%s' && cp -r '%s' '%s'", p, g_a, p), 0);
  snprintf(f, sizeof f, "%s/rank0/step000000.safetensors", p);
  plant(f, "param.2.weight", 11, one_ulp);
  assert_int_equal(compare(NULL, g_a, p, &j), 0);
  const cJSON *t = tensor_stats(j, "param.2.weight");
  assert_int_equal((int)cJSON_GetArrayItem(get(t, "ulp_hist"), 1)->valuedouble, 1);
  assert_int_equal((int)cJSON_GetArrayItem(get(t, "ulp_hist"), 0)->valuedouble,
                   (int)get(t, "elements")->valuedouble - 1);
  cJSON_Delete(j);
}

/* W = 2 ranks at batch 8 against one rank at batch 16 (shuffle off, so each step's samples
 * are the same set): rank 0's gradients and parameters agree within rtol 1e-5 (atol 1e-7),
 * and the two ranks' sample indices together are exactly the single rank's. */
static void test_ranks_vs_single_process(void **state) {
  (void)state;
  NEED_TORCH();
  cJSON *j;
  assert_int_equal(compare("--rank 0 --only grad.,param. --rtol 1e-5 --atol 1e-7", g_a, g_single,
                           &j),
                   0);
  const cJSON *t;
  int n = 0;
  cJSON_ArrayForEach(t, get(j, "tensors")) {
    n++;
    assert_true(get(t, "max_abs")->valuedouble < 1e-6);
  }
  assert_int_equal(n, 8);
  cJSON_Delete(j);
  for (int s = 0; s < 3; s++) {
    int seen[1797] = {0};
    for (int side = 0; side < 3; side++) {
      char path[700];
      if (side < 2)
        snprintf(path, sizeof path, "%s/rank%d/step%06d.safetensors", g_a, side, s);
      else
        snprintf(path, sizeof path, "%s/rank0/step%06d.safetensors", g_single, s);
      ddp_st_file_t *f;
      size_t k;
      ddp_tensor_t idx;
      assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, NULL), DDP_OK);
      assert_int_equal(ddp_st_find(f, "input.index", &k), DDP_OK);
      assert_int_equal(ddp_st_tensor(f, k, &idx), DDP_OK);
      assert_int_equal(idx.numel, side < 2 ? 8 : 16);
      for (int64_t i = 0; i < idx.numel; i++) {
        int64_t v = ((const int64_t *)idx.data)[i];
        assert_true(v >= 0 && v < 1797);
        seen[v] += side < 2 ? 1 : -1;
      }
      ddp_st_close(f);
    }
    for (int i = 0; i < 1797; i++) assert_int_equal(seen[i], 0);
  }
}

/* ---------------------------------------------------------------- setup ------------ */

static int reference_run(const char *dir, int world, int batch) {
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out,
                            "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s "
                            "%s/tools/torch/torch_reference.py "
                            "--model %s/mlp.json --dump_dir '%s' --world %d --steps 3 --batch %d "
                            "--shuffle false --lr 0.5",
                            ddp_test_python(), ddp_test_source_root(), g_tmp, dir, world, batch);
  if (rc != 0) {
    char *err = stderr_text();
    print_error("torch_reference.py failed (%d): %s\n%s\n", rc, out, err);
    free(err);
  }
  free(out);
  return rc;
}

static int setup(void **state) {
  (void)state;
  const char *build = getenv("DDP_BUILD_ROOT");
  snprintf(g_tool, sizeof g_tool, "%s/tools/ddp-compare", build ? build : ".");
  if (access(g_tool, X_OK) != 0) {
    print_error("%s not found (DDP_BUILD_ROOT unset or not built)\n", g_tool);
    return 1;
  }
  if (!ddp_test_make_scratch(g_tmp, sizeof g_tmp, "ddp_compare")) return 1;
  if (!ddp_test_parity_init(g_tmp) || !ddp_test_python()) return 0;
  char p[600];
  snprintf(p, sizeof p, "%s/mlp.json", g_tmp);
  ddp_test_write_text(p, "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": "
                         "64, \"out\": 16}, {\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": "
                         "16, \"out\": 10}]}\n");
  snprintf(g_a, sizeof g_a, "%s/ref_a", g_tmp);
  snprintf(g_b, sizeof g_b, "%s/ref_b", g_tmp);
  snprintf(g_single, sizeof g_single, "%s/ref_single", g_tmp);
  if (reference_run(g_a, 2, 8) || reference_run(g_b, 2, 8) || reference_run(g_single, 1, 16))
    return 1;
  g_torch = true;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  return ddp_test_remove_scratch(g_tmp, false);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ulp_histogram),      cmocka_unit_test(test_layouts),
      cmocka_unit_test(test_bad_input),          cmocka_unit_test(test_reference_deterministic),
      cmocka_unit_test(test_planted_difference), cmocka_unit_test(test_ranks_vs_single_process),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
