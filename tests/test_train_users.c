/* ddp-train as users meet it (issue 38): a broken model file is reported before the data
 * is read, with its line and column; a text corpus with a model that cannot train on it says
 * so.
 *
 * The cases run the built ddp-train (DDP_BUILD_ROOT/tools/ddp-train) in a fresh temporary
 * directory, which the group teardown removes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp.h"
#include "harness.h"
#include "proc.h"

static char dir[256];   /* the test's temporary directory */
static char exe[4096];  /* ddp-train */
static char root[4096]; /* the source tree (tests/data) */

static int setup_dir(void **state) {
  (void)state;
  const char *build = getenv("DDP_BUILD_ROOT");
  const char *src = getenv("DDP_SOURCE_ROOT");
  if (!build || !src) {
    fprintf(stderr, "DDP_BUILD_ROOT or DDP_SOURCE_ROOT is not set (run under meson test)\n");
    return -1;
  }
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  snprintf(root, sizeof root, "%s", src);
  snprintf(dir, sizeof dir, "/tmp/ddp-test-train-users-XXXXXX");
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

/* Runs `cd dir && ddp-train ARGS 2>&1` (ARGS may hold "%R" for the source tree, once);
 * *out: everything it printed (malloc'd). Returns the exit status. */
static int run(char **out, const char *fmt, ...) {
  char args[4096], cmd[16384], err[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s 2>&1", dir, exe, args);
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

/* Issue 38, item 1: a config.json with a syntax error, or without "model_type", given with
 * the text corpus, was blamed on the data ("safetensors 'corpus.txt': header length ...");
 * the model file is now parsed first and its error names the file, line and column. */
static void test_model_file_first(void **state) {
  (void)state;
  char *out = NULL;
  put("bad.json", "{\"model_type\": \"gpt2\", \"n_layer\": 2");
  int rc = run(&out, "--threads 2 --model bad.json --data '%s/tests/data/kjv_genesis_exodus.txt'",
               root);
  expect("truncated config.json", rc, out, 2, "--model bad.json",
         "line 1, column 36: JSON syntax error at the end of the file", NULL);
  put("bad2.json", "{\n  \"model_type\": \"gpt2\",\n  \"n_layer\" 2\n}\n");
  rc = run(&out, "--model bad2.json --data '%s/tests/data/kjv_genesis_exodus.txt'", root);
  expect("missing colon", rc, out, 2, "--model bad2.json", "line 3, column 13", NULL);
  put("typeless.json", "{\"n_layer\": 2, \"n_embd\": 64}");
  rc = run(&out, "--model typeless.json --data '%s/tests/data/kjv_genesis_exodus.txt'", root);
  expect("no model_type", rc, out, 2, "--model typeless.json", "no \"model_type\"",
         "no \"layers\"", NULL);
  rc = run(&out, "--model bad.json --data nosuch.safetensors");
  expect("model before data", rc, out, 2, "--model bad.json", "line 1, column 36", NULL);
}

/* A text corpus (or an llm.c token file) with the default MLP or a libddp model was read
 * as safetensors; it is refused, saying what trains on it. */
static void test_corpus_needs_lm(void **state) {
  (void)state;
  char *out = NULL;
  int rc = run(&out, "--data '%s/tests/data/kjv_genesis_exodus.txt'", root);
  expect("text with the default MLP", rc, out, 2, "kjv_genesis_exodus.txt",
         "a text or token corpus trains a causal language model", "(default: an MLP)", NULL);
  put("mlp.json", "{\"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 3}]}");
  /* llm.c's GPT-2 header: magic 20240520, version 1, 0 tokens. */
  unsigned char h[1024] = {0x88, 0xd8, 0x34, 0x01, 1};
  char path[512];
  snprintf(path, sizeof path, "%s/tokens.data", dir);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(h, 1, sizeof h, f), sizeof h);
  assert_int_equal(fclose(f), 0);
  rc = run(&out, "--model mlp.json --data tokens.data");
  expect("llm.c tokens with a libddp model", rc, out, 2, "--data tokens.data",
         "a text or token corpus", "the model mlp.json", NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_model_file_first),
      cmocka_unit_test(test_corpus_needs_lm),
  };
  return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
