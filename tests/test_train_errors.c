/* ddp-train on bad input and failing output (issue 15, "Found"): every case exits with the
 * documented status and a message that names the file and the row, column, tensor, element
 * or model-file field; nothing crashes; metrics.jsonl write failures stop the run at once,
 * and a resume after a crash leaves metrics.jsonl with each step once and the lines before
 * the checkpoint untouched.
 *
 * The cases run the built ddp-train (DDP_BUILD_ROOT/tools/ddp-train) with --threads 1 in a
 * fresh temporary directory, which the group teardown removes. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp.h"
#include "harness.h"
#include "proc.h"

static char dir[256];  /* the test's temporary directory */
static char exe[4096]; /* ddp-train */

static int setup_dir(void **state) {
  (void)state;
  const char *build = getenv("DDP_BUILD_ROOT");
  if (!build) {
    fprintf(stderr, "DDP_BUILD_ROOT is not set (run under meson test)\n");
    return -1;
  }
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  snprintf(dir, sizeof dir, "/tmp/ddp-test-train-errors-XXXXXX");
  return mkdtemp(dir) ? 0 : -1;
}

static int remove_dir(void **state) {
  (void)state;
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

static void put(const char *name, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
  assert_int_equal(fclose(f), 0);
}

static char *slurp(const char *name, size_t *len) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return ddp_test_read_file(path, len);
}

/* Runs `cd dir && [env] ddp-train --threads 1 ARGS 2>&1`; *out: everything it printed
 * (malloc'd). Returns the exit status (-1: killed by a signal, such as SIGSEGV). */
static int train(char **out, const char *env, const char *fmt, ...) {
  char args[4096], cmd[16384], err[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "cd '%s' && %s '%s' --threads 1 %s 2>&1", dir, env ? env : "", exe,
           args);
  snprintf(err, sizeof err, "%s/stderr.txt", dir);
  return ddp_test_proc_run(cmd, err, 120, out);
}

/* Asserts the exit status and that the output holds every needle (NULL-terminated). */
static void expect(const char *what, int rc, char *out, int want, ...) {
  if (rc != want) fail_msg("%s: exit status %d, expected %d; output:\n%s", what, rc, want, out);
  va_list ap;
  va_start(ap, want);
  for (const char *n = va_arg(ap, const char *); n; n = va_arg(ap, const char *)) {
    if (!strstr(out, n)) fail_msg("%s: the output lacks \"%s\":\n%s", what, n, out);
  }
  va_end(ap);
  free(out);
}

/* A safetensors data file: features [16, 4] of dt (values i / 8), labels I64 [16] (i % 3). */
static void write_data(const char *name, ddp_dtype_t dt) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ddp_tensor_t x, y;
  int64_t xs[2] = {16, 4}, ys[1] = {16};
  assert_int_equal(ddp_tensor_alloc(&x, dt, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_I64, 1, ys), DDP_OK);
  for (int i = 0; i < 64; i++) {
    if (dt == DDP_F32) ((float *)x.data)[i] = (float)i / 8;
    if (dt == DDP_F64) ((double *)x.data)[i] = i / 8.0;
    if (dt == DDP_I64) ((int64_t *)x.data)[i] = i % 5;
  }
  for (int i = 0; i < 16; i++) ((int64_t *)y.data)[i] = i % 3;
  ddp_st_entry_t e[2] = {{"features", &x}, {"labels", &y}};
  ddp_error_t err = {0};
  assert_int_equal(ddp_st_write(path, e, 2, NULL, NULL, 0, &err), DDP_OK);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
}

/* F64 features and no --model trained to the end (they crashed with SIGSEGV / malloc():
 * invalid size); I64 features are refused with the dtype and what to do. */
static void test_wide_features(void **state) {
  (void)state;
  char *out;
  write_data("f64.safetensors", DDP_F64);
  write_data("i64.safetensors", DDP_I64);
  int rc = train(&out, NULL, "--data f64.safetensors --max_steps 3 --output_dir f64");
  expect("F64 features", rc, out, 0, "ddp-train: 3 steps", "replica check passed", NULL);
  rc = train(&out, NULL, "--threads 2 --data f64.safetensors --max_steps 3 --output_dir f64b");
  expect("F64 features, 2 ranks", rc, out, 0, "replica check passed", NULL);
  rc = train(&out, NULL, "--data i64.safetensors --max_steps 3 --output_dir i64");
  expect("I64 features", rc, out, 2, "--data i64.safetensors: the features are I64",
         "default model", NULL);
}

/* Infinities and float32 overflow in a CSV: the file, the line and the column. */
static void test_csv_values(void **state) {
  (void)state;
  static const struct {
    const char *value, *needle;
  } cases[] = {
      {"inf", "'inf' is not a finite number"},
      {"1e999", "'1e999' is not a finite number"},
      {"1e39", "'1e39' is outside float32's range"},
      {"nan", "not a number: 'nan'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char csv[256];
    snprintf(csv, sizeof csv, "x1,x2,label\n0.5,1,0\n0.25,%s,1\n1,2,2\n", cases[i].value);
    put("bad.csv", csv);
    char *out;
    int rc = train(&out, NULL, "--data bad.csv --max_steps 2 --output_dir csv");
    expect(cases[i].value, rc, out, 2, "--data bad.csv: csv bad.csv: line 3 column 2 ('x2')",
           cases[i].needle, NULL);
  }
}

/* NaN and Inf in a safetensors data file, written so or made by flipping one bit of the
 * payload: the file, the tensor, the element and its sample. */
static void test_safetensors_values(void **state) {
  (void)state;
  write_data("flip.safetensors", DDP_F32);
  char path[512];
  snprintf(path, sizeof path, "%s/flip.safetensors", dir);
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  uint64_t hlen = 0;
  assert_int_equal(fread(&hlen, 8, 1, f), 1);
  /* features come first in the payload; element 9 is 9/8 = 1.125f = 0x3f900000: setting
   * bit 30 of it gives 0x7f900000, a NaN. */
  long at = (long)(8 + hlen + 9 * 4 + 3);
  assert_int_equal(fseek(f, at, SEEK_SET), 0);
  int b = fgetc(f);
  assert_int_equal(b, 0x3f);
  assert_int_equal(fseek(f, at, SEEK_SET), 0);
  fputc(b | 0x40, f);
  assert_int_equal(fclose(f), 0);
  char *out;
  int rc = train(&out, NULL, "--data flip.safetensors --max_steps 2 --output_dir st");
  expect("bit flip", rc, out, 2, "--data flip.safetensors: dataset flip.safetensors",
         "tensor 'features' element 9 (sample 2, index [2, 1]) is NaN", NULL);
  /* An infinity where element 4 (0.5f) was. */
  write_data("inf.safetensors", DDP_F32);
  snprintf(path, sizeof path, "%s/inf.safetensors", dir);
  f = fopen(path, "r+b");
  assert_non_null(f);
  assert_int_equal(fread(&hlen, 8, 1, f), 1);
  static const unsigned char inf_bits[4] = {0x00, 0x00, 0x80, 0x7f};
  assert_int_equal(fseek(f, (long)(8 + hlen + 4 * 4), SEEK_SET), 0);
  assert_int_equal(fwrite(inf_bits, 1, 4, f), 4);
  assert_int_equal(fclose(f), 0);
  rc = train(&out, NULL, "--data inf.safetensors --max_steps 2 --output_dir st");
  expect("inf", rc, out, 2, "inf.safetensors",
         "tensor 'features' element 4 (sample 1, index [1, 0]) is infinite", NULL);
}

/* Model-file fields out of range or of the wrong JSON type: the file, the JSON path and the
 * field. */
static void test_model_fields(void **state) {
  (void)state;
  write_data("d.safetensors", DDP_F32);
  static const struct {
    const char *layer, *needle;
  } cases[] = {
      {"{\"type\": \"layernorm\", \"dim\": 8, \"eps\": -1}",
       "layers[1]: field \"eps\" must be a number > 0, got -1"},
      {"{\"type\": \"batchnorm\", \"dim\": 8, \"momentum\": 5}",
       "layers[1]: field \"momentum\" must be a number in [0, 1], got 5"},
      {"{\"type\": \"linear\", \"in\": 8, \"out\": 8, \"bias\": \"yes\"}",
       "layers[1]: field \"bias\" must be true or false, got \"yes\""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char json[512];
    snprintf(json, sizeof json,
             "{\"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 8}, %s, "
             "{\"type\": \"linear\", \"in\": 8, \"out\": 3}]}",
             cases[i].layer);
    put("bad.json", json);
    char *out;
    int rc = train(&out, NULL,
                   "--model bad.json --data d.safetensors --max_steps 2 "
                   "--output_dir mf");
    expect(cases[i].layer, rc, out, 2, "ddp-train: --model bad.json: model json: ", cases[i].needle,
           NULL);
  }
}

/* Every failure carries a reason: a model too large to allocate says so (it printed
 * "--model huge.json: " and nothing more), and a huge class label with the default model
 * is a data error naming the row, not a model error. */
static void test_reasons(void **state) {
  (void)state;
  write_data("d.safetensors", DDP_F32);
  put("huge.json", "{\"layers\": [{\"type\": \"linear\", \"in\": 100000, \"out\": 100000000000}, "
                   "{\"type\": \"linear\", \"in\": 100000000000, \"out\": 3}]}");
  char *out;
  int rc = train(&out, NULL,
                 "--model huge.json --data d.safetensors --max_steps 2 "
                 "--output_dir h");
  expect("huge model", rc, out, 2,
         "--model huge.json: model json: cannot allocate the "
         "parameters",
         "out of memory", NULL);
  put("biglabel.csv", "x1,x2,label\n0.5,1,0\n0.25,2,1\n1,2,3000000000\n");
  rc = train(&out, NULL, "--data biglabel.csv --max_steps 2 --output_dir bl");
  if (strstr(out, "--model (default)")) fail_msg("a label reported as a model error: %s", out);
  expect("huge label", rc, out, 2, "--data biglabel.csv: line 4: class label 3000000000", NULL);
}

/* A class label outside the model's outputs is a data error naming the file and the row
 * (it was a loss error during training, with an empty summary line). */
static void test_labels(void **state) {
  (void)state;
  put("m3.json", "{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 3}]}");
  put("lab7.csv", "x1,x2,label\n0.5,1,0\n0.25,2,1\n1,2,7\n1,1,2\n");
  put("labneg.csv", "x1,x2,label\n0.5,1,0\n0.25,2,-1\n");
  char *out;
  int rc = train(&out, NULL, "--model m3.json --data lab7.csv --max_steps 2 --output_dir l");
  expect("label 7", rc, out, 2,
         "--data lab7.csv: line 4: class label 7 is out of range for the model's 3 outputs", NULL);
  rc = train(&out, NULL, "--data labneg.csv --max_steps 2 --output_dir l");
  expect("label -1", rc, out, 2, "--data labneg.csv: line 3: class label -1 is negative", NULL);
  /* A model whose input does not fit the data is refused before any rank starts. */
  put("m5.json", "{\"layers\": [{\"type\": \"linear\", \"in\": 5, \"out\": 3}]}");
  rc = train(&out, NULL, "--model m5.json --data lab7.csv --max_steps 2 --output_dir l");
  expect("model/data mismatch", rc, out, 2, "--model m5.json on sample 0 of --data lab7.csv",
         "linear:", NULL);
}

/* Through the library: a loss that fails during training carries the op's message
 * (the failing rank's summary line was "training failed: DDP_ERR_INVALID_ARGUMENT: "). */
typedef struct loss_run {
  ddp_dataset_t *ds;
  ddp_status_t st;
  char msg[DDP_ERROR_MSG_MAX];
} loss_run_t;

static ddp_status_t loss_rank(ddp_pg_t *pg, void *arg) {
  loss_run_t *r = arg;
  ddp_error_t err = {0};
  ddp_model_t *m = NULL;
  ddp_status_t st =
      ddp_model_from_json("{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 3}]}", &m,
                          &err);
  ddp_train_args_t a = DDP_TRAIN_ARGS_INIT;
  a.max_steps = 1;
  a.per_device_train_batch_size = 4;
  snprintf(a.save_strategy, sizeof a.save_strategy, "no");
  snprintf(a.output_dir, sizeof a.output_dir, "%s/lib", dir);
  ddp_train_result_t res;
  if (st == DDP_OK) st = ddp_train(pg, m, r->ds, NULL, &a, NULL, NULL, &res, &err);
  r->st = st;
  snprintf(r->msg, sizeof r->msg, "%s", err.msg);
  ddp_model_destroy(m);
  return st;
}

static void test_loss_message(void **state) {
  (void)state;
  ddp_tensor_t x, y;
  int64_t xs[2] = {4, 2}, ys[1] = {4};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F32, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_I64, 1, ys), DDP_OK);
  for (int i = 0; i < 8; i++) ((float *)x.data)[i] = (float)i;
  for (int i = 0; i < 4; i++) ((int64_t *)y.data)[i] = i == 2 ? 7 : i % 3;
  loss_run_t r = {0};
  assert_int_equal(ddp_dataset_from_tensors(&x, &y, &r.ds, NULL), DDP_OK);
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  ddp_status_t st = ddp_spawn_threads(1, &po, loss_rank, &r);
  assert_int_equal(st, DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(r.st, DDP_ERR_INVALID_ARGUMENT);
  if (!strstr(r.msg, "trainer: loss: cross_entropy: Target 7 is out of bounds"))
    fail_msg("loss failure message: '%s'", r.msg);
  ddp_dataset_destroy(r.ds);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
}

/* metrics.jsonl that cannot be written: a full device stops the run at once with the file
 * and errno; a directory in its place cannot be opened. */
static void test_metrics_write_error(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/full", dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof path, "%s/full/metrics.jsonl", dir);
  assert_int_equal(symlink("/dev/full", path), 0);
  char *out;
  int rc = train(&out, NULL,
                 "--max_steps 20 --logging_steps 1 --save_strategy no "
                 "--output_dir full");
  expect("/dev/full", rc, out, 1, "write full/metrics.jsonl: No space left on device", NULL);
  snprintf(path, sizeof path, "%s/isdir/metrics.jsonl", dir);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "mkdir -p '%s'", path);
  assert_int_equal(system(cmd), 0);
  rc = train(&out, NULL, "--max_steps 2 --output_dir isdir");
  expect("a directory", rc, out, 1, "open isdir/metrics.jsonl: Is a directory", NULL);
}

/* The step lines of metrics.jsonl (those with a "loss"), by step. */
static int step_lines(const char *text, cJSON **by_step, int max) {
  int n = 0;
  for (const char *p = text; *p;) {
    const char *nl = strchr(p, '\n');
    if (!nl) fail_msg("metrics.jsonl ends with a torn line: '%s'", p);
    cJSON *o = cJSON_ParseWithLength(p, (size_t)(nl - p));
    if (!o) fail_msg("metrics.jsonl has a line that is not JSON: '%.*s'", (int)(nl - p), p);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
    if (cJSON_GetObjectItemCaseSensitive(o, "loss") && cJSON_IsNumber(s)) {
      int k = (int)s->valuedouble;
      assert_true(k >= 1 && k <= max);
      if (by_step[k]) fail_msg("step %d appears twice in metrics.jsonl:\n%s", k, text);
      by_step[k] = o;
      n++;
    } else {
      cJSON_Delete(o);
    }
    p = nl + 1;
  }
  return n;
}

static const char *jstr(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsString(v) ? v->valuestring : "";
}

/* A crash after checkpoint-4, during the save of step 6 (kill -9), then a resume: each step
 * is in metrics.jsonl once, the lines up to checkpoint-4 are byte for byte what the first
 * run wrote, a torn line left by the crash is gone, and steps 5 and 6 have the first run's
 * loss and parameter hash (the resume is bitwise). */
static void test_metrics_resume(void **state) {
  (void)state;
  const char *flags = "--max_steps 6 --save_steps 4 --logging_steps 1 --output_dir run";
  char cmd[8192], err[512];
  snprintf(cmd, sizeof cmd,
           "cd '%s' && { DDP_TRAIN_SAVE_PAUSE_MS=1500 '%s' --threads 1 %s > run1.log 2>&1 & "
           "pid=$!; until grep -q '\"step\": 6, \"epoch\"' run/metrics.jsonl 2>/dev/null; do "
           "kill -0 $pid 2>/dev/null || exit 3; sleep 0.01; done; kill -9 $pid; wait $pid; "
           "exit 0; }",
           dir, exe, flags);
  snprintf(err, sizeof err, "%s/stderr.txt", dir);
  int rc = ddp_test_proc_run(cmd, err, 120, NULL);
  if (rc != 0) {
    fail_msg("the first run was not killed at step 6 (%d): %s", rc, slurp("run1.log", NULL));
  }
  struct stat sb;
  snprintf(cmd, sizeof cmd, "%s/run/checkpoint-6", dir);
  if (stat(cmd, &sb) == 0) fail_msg("checkpoint-6 was committed before the kill");
  snprintf(cmd, sizeof cmd, "%s/run/checkpoint-4", dir);
  assert_int_equal(stat(cmd, &sb), 0);
  char *first = slurp("run/metrics.jsonl", NULL);
  assert_non_null(first);
  const char *ck = strstr(first, "{\"step\": 4, \"checkpoint\"");
  assert_non_null(ck);
  size_t keep = (size_t)(strchr(ck, '\n') + 1 - first);
  cJSON *before[8] = {0};
  assert_int_equal(step_lines(first, before, 7), 6);
  /* What a crash in the middle of a line would leave. */
  snprintf(cmd, sizeof cmd, "printf '{\"step\": 7, \"loss\": 0.' >> '%s/run/metrics.jsonl'", dir);
  assert_int_equal(system(cmd), 0);

  char *out;
  rc = train(&out, NULL, "%s --resume_from_checkpoint true", flags);
  expect("resume", rc, out, 0, "(from step 4)", NULL);
  size_t len = 0;
  char *after = slurp("run/metrics.jsonl", &len);
  assert_non_null(after);
  if (len < keep || memcmp(after, first, keep) != 0)
    fail_msg("the lines up to checkpoint-4 changed:\n--- before\n%.*s\n--- after\n%s", (int)keep,
             first, after);
  cJSON *steps[8] = {0};
  int n = step_lines(after, steps, 7);
  if (n != 6) fail_msg("%d step lines, expected 6:\n%s", n, after);
  for (int k = 1; k <= 6; k++) {
    assert_non_null(steps[k]);
    const cJSON *l0 = cJSON_GetObjectItemCaseSensitive(before[k], "loss");
    const cJSON *l1 = cJSON_GetObjectItemCaseSensitive(steps[k], "loss");
    if (l0->valuedouble != l1->valuedouble ||
        strcmp(jstr(before[k], "param_hash"), jstr(steps[k], "param_hash")) != 0)
      fail_msg("step %d: loss %.9g vs %.9g, param_hash %s vs %s", k, l0->valuedouble,
               l1->valuedouble, jstr(before[k], "param_hash"), jstr(steps[k], "param_hash"));
  }
  if (!strstr(after, "{\"step\": 6, \"checkpoint\"") || !strstr(after, "\"summary\": true"))
    fail_msg("the resumed run's checkpoint or summary line is missing:\n%s", after);
  for (int k = 0; k < 8; k++) {
    cJSON_Delete(before[k]);
    cJSON_Delete(steps[k]);
  }
  free(first);
  free(after);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_wide_features),
      cmocka_unit_test(test_csv_values),
      cmocka_unit_test(test_safetensors_values),
      cmocka_unit_test(test_model_fields),
      cmocka_unit_test(test_reasons),
      cmocka_unit_test(test_labels),
      cmocka_unit_test(test_loss_message),
      cmocka_unit_test(test_metrics_write_error),
      cmocka_unit_test(test_metrics_resume),
  };
  return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
