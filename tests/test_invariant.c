/* world_size_invariant_shards (docs/ddp.md, "World-size-invariant training"), through
 * ddp-train's public flags: with K = 12 shards of a global batch of 48 samples, every world
 * size W and accumulation split A with W A dividing 12 ends 20 steps with the same
 * parameter hash, on threads and (W in {2, 3, 4}) on shm and tcp processes under ddprun
 * and on the mpi backend under mpirun (when built and installed), and with gradients as
 * bucket views and unused-parameter detection on threads, for the digits MLP, an
 * MLP with dropout and a GPT-2 with and without dropout; the hash differs from a normal run
 * of the same job (so the test cannot pass by accident). ddp-compare finds no difference at
 * any step between a W = 1 and a W = 4 invariant run, and finds the reassociation
 * differences between two normal runs. What the mode cannot make invariant is refused
 * with a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cleanup.h"
#include "harness.h"
#include "proc.h"

static char g_tmp[256];

/* The W x A splits of 12 shards: W A divides 12. */
static const int splits[][2] = {{1, 1}, {1, 2}, {1, 3}, {2, 1}, {2, 2}, {2, 3}, {3, 1},
                                {3, 2}, {4, 1}, {4, 3}, {6, 1}, {6, 2}, {12, 1}};
#define GLOBAL_BATCH 48
#define SHARDS "12"

/* Runs cmd (stdout and stderr into a log) under a deadline; returns its exit status and
 * leaves the output in *out (malloc'd) when out is not NULL. */
static int run(const char *cmd, char **out) {
  char full[16384], log[300];
  snprintf(log, sizeof log, "%s/stderr.txt", g_tmp);
  snprintf(full, sizeof full, "%s 2>&1", cmd);
  return ddp_test_proc_run(full, log, 240, out);
}

/* The parameter hash of a finished run's metrics.jsonl summary line. */
static void summary_hash(const char *dir, char *hash, size_t cap) {
  char path[512];
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  char *text = ddp_test_read_file(path, NULL);
  if (!text) fail_msg("no %s", path);
  hash[0] = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    cJSON *o = cJSON_Parse(line);
    const cJSON *h = o ? cJSON_GetObjectItemCaseSensitive(o, "param_hash") : NULL;
    if (o && cJSON_GetObjectItemCaseSensitive(o, "summary") && cJSON_IsString(h))
      snprintf(hash, cap, "%s", h->valuestring);
    cJSON_Delete(o);
  }
  free(text);
  if (!hash[0]) fail_msg("%s has no summary line with a param_hash", path);
}

/* Trains the job `job` (ddp-train flags) with W ranks (threads, or processes under ddprun
 * on backend `be`), A accumulation steps, K = 12 shards (0: normal mode) into a fresh
 * directory and returns its parameter hash; `extra` goes on the command line too. */
static void train(const char *job, const char *be, int W, int A, bool invariant, const char *extra,
                  char *hash, size_t cap) {
  static int seq;
  char dir[400], cmd[8192], *out = NULL;
  snprintf(dir, sizeof dir, "%s/run%d", g_tmp, seq++);
  char common[4096];
  snprintf(common, sizeof common,
           "%s --max_steps 20 --logging_steps 10 --learning_rate 3e-3 --save_strategy no "
           "--ddp_find_unused_parameters false --disable_tqdm --gradient_accumulation_steps %d "
           "--per_device_train_batch_size %d %s %s --output_dir '%s'",
           job, A, GLOBAL_BATCH / (W * A), invariant ? "--world_size_invariant_shards " SHARDS : "",
           extra ? extra : "", dir);
  if (be && !strcmp(be, "mpi")) /* mpirun's own rendezvous: no store, no port */
    snprintf(cmd, sizeof cmd,
             "env -u RANK -u WORLD_SIZE -u DDP_BACKEND -u MASTER_ADDR -u MASTER_PORT "
             "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" "
             "mpirun --allow-run-as-root --oversubscribe -np %d '%s' --ddp_backend mpi %s",
             W, ddp_test_tool("ddp-train"), common);
  else if (be)
    snprintf(cmd, sizeof cmd, "'%s' --nproc_per_node %d --backend %s --standalone '%s' %s",
             ddp_test_tool("ddprun"), W, be, ddp_test_tool("ddp-train"), common);
  else
    snprintf(cmd, sizeof cmd, "'%s' --threads %d %s", ddp_test_tool("ddp-train"), W, common);
  int rc = run(cmd, &out);
  if (rc != 0) fail_msg("exit %d: %s\n%s", rc, cmd, out ? out : "");
  free(out);
  summary_hash(dir, hash, cap);
  ddp_test_remove_now(dir);
}

/* Whether the mpi backend is built and mpirun is installed. */
static bool have_mpi(void) {
  return ddp_backend_find("mpi") && system("command -v mpirun >/dev/null 2>&1") == 0;
}

/* Every split on threads; the splits with W in {2, 3, 4} as shm and tcp processes; W in
 * {2, 3, 4} on mpi: one hash, which differs from a normal run's. */
static void expect_invariant(const char *job, const char *what) {
  char ref[64], h[64], normal[64];
  /* DDP_TEST_CUT (tools/test.sh --sanitize): the splits up to W = 4, and on processes
   * W = 2 with accumulation and W = 3 without, which still take every path once */
  const char *cut_env = getenv("DDP_TEST_CUT");
  bool cut = cut_env && !strcmp(cut_env, "1");
  train(job, NULL, 1, 1, true, NULL, ref, sizeof ref);
  for (size_t i = 1; i < sizeof splits / sizeof splits[0]; i++) {
    if (cut && splits[i][0] > 4) continue;
    train(job, NULL, splits[i][0], splits[i][1], true, NULL, h, sizeof h);
    print_message("%s: threads W=%d A=%d: %s (W=1: %s)\n", what, splits[i][0], splits[i][1], h,
                  ref);
    assert_string_equal(h, ref);
  }
  /* the reducer's other gradient layouts: bucket views, with unused-parameter detection */
  const char *layouts[] = {"--gradient_as_bucket_view true",
                           "--gradient_as_bucket_view true --ddp_find_unused_parameters true",
                           "--ddp_find_unused_parameters true"};
  for (int l = 0; l < 3; l++) {
    train(job, NULL, 2 + l, 1, true, layouts[l], h, sizeof h);
    print_message("%s: threads W=%d %s: %s\n", what, 2 + l, layouts[l], h);
    assert_string_equal(h, ref);
  }
  const char *backends[] = {"shm", "tcp", "mpi"};
  bool mpi = have_mpi();
  for (int b = 0; b < 3; b++)
    for (size_t i = 0; i < sizeof splits / sizeof splits[0]; i++) {
      int W = splits[i][0], A = splits[i][1];
      if (W < 2 || W > 4 || (b == 2 && (!mpi || A != 1))) continue;
      if (cut && !((W == 2 && A == 2) || (W == 3 && A == 1) || (b == 2 && W == 2))) continue;
      train(job, backends[b], W, A, true, NULL, h, sizeof h);
      print_message("%s: %s W=%d A=%d: %s\n", what, backends[b], W, A, h);
      assert_string_equal(h, ref);
    }
  if (!mpi) print_message("%s: mpi: not built or no mpirun, not run\n", what);
  train(job, NULL, 4, 1, false, NULL, normal, sizeof normal);
  print_message("%s: normal mode W=4: %s\n", what, normal);
  assert_string_not_equal(normal, ref);
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  assert_int_equal(fputs(text, f) >= 0, 1);
  assert_int_equal(fclose(f), 0);
}

static void test_mlp(void **state) {
  (void)state;
  expect_invariant("", "digits MLP");
}

static void test_mlp_dropout(void **state) {
  (void)state;
  char model[400], job[512];
  snprintf(model, sizeof model, "%s/mlp_dropout.json", g_tmp);
  write_file(model,
             "{\"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 128}, {\"type\": \"relu\"},"
             " {\"type\": \"dropout\", \"p\": 0.2}, {\"type\": \"linear\", \"in\": 128, \"out\": "
             "128}, {\"type\": \"gelu\"}, {\"type\": \"dropout\", \"p\": 0.2},"
             " {\"type\": \"linear\", \"in\": 128, \"out\": 10}]}\n");
  snprintf(job, sizeof job, "--model '%s'", model);
  expect_invariant(job, "MLP with dropout");
}

/* GPT-2 tiny (2 layers, 32 wide) on the shipped text, dropout p everywhere. */
static void gpt2(const char *p, const char *what) {
  char model[400], job[1024], text[512];
  snprintf(model, sizeof model, "%s/gpt2_%s.json", g_tmp, p);
  snprintf(text, sizeof text,
           "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_embd\": 32, \"n_head\": 4, "
           "\"vocab_size\": 256, \"n_positions\": 32, \"resid_pdrop\": %s, \"embd_pdrop\": "
           "%s, \"attn_pdrop\": %s}\n",
           p, p, p);
  write_file(model, text);
  snprintf(job, sizeof job,
           "--model '%s' --data '%s/tests/data/kjv_genesis_exodus.txt' --block_size 32", model,
           ddp_test_source_root());
  expect_invariant(job, what);
}

static void test_gpt2(void **state) {
  (void)state;
  gpt2("0.0", "GPT-2");
}

static void test_gpt2_dropout(void **state) {
  (void)state;
  gpt2("0.1", "GPT-2 with dropout");
}

/* ddp-compare --json A B --rank 0 --only grad.,param.: the parsed report (exit in *rc). */
static cJSON *compare(const char *a, const char *b, int *rc) {
  char cmd[2048], *out = NULL;
  snprintf(cmd, sizeof cmd, "'%s' --json --rank 0 --only grad.,param. '%s' '%s'",
           ddp_test_tool("ddp-compare"), a, b);
  *rc = run(cmd, &out);
  cJSON *o = cJSON_Parse(out ? out : "");
  if (!o) fail_msg("ddp-compare printed no JSON (exit %d): %s", *rc, out ? out : "");
  free(out);
  return o;
}

/* The largest max_abs over the report's tensors and the number of steps compared. */
static double worst(const cJSON *o, int *steps) {
  const cJSON *t, *s = cJSON_GetObjectItemCaseSensitive(o, "steps_compared");
  *steps = cJSON_IsNumber(s) ? s->valueint : -1;
  double m = 0;
  cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(o, "tensors")) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(t, "max_abs");
    if (cJSON_IsNumber(v) && v->valuedouble > m) m = v->valuedouble;
  }
  return m;
}

/* Dumps of W = 1 and W = 4 (rank 0 holds the averaged gradients and parameters of every
 * step): zero difference in invariant mode, the reassociation differences in normal mode. */
static void test_compare(void **state) {
  (void)state;
  char d[4][400], h[64];
  for (int i = 0; i < 4; i++) {
    char extra[1200];
    snprintf(d[i], sizeof d[i], "%s/dump%d", g_tmp, i);
    snprintf(extra, sizeof extra, "--dump_dir '%.399s'", d[i]);
    train("", NULL, i % 2 ? 4 : 1, 1, i < 2, extra, h, sizeof h);
  }
  int rc, steps;
  cJSON *inv = compare(d[0], d[1], &rc);
  double m = worst(inv, &steps);
  print_message("invariant W=1 vs W=4: %d steps, largest difference %g\n", steps, m);
  assert_int_equal(rc, 0);
  assert_int_equal(steps, 20);
  assert_true(m == 0.0);
  cJSON_Delete(inv);
  cJSON *normal = compare(d[2], d[3], &rc);
  m = worst(normal, &steps);
  print_message("normal W=1 vs W=4: %d steps, largest difference %g\n", steps, m);
  assert_int_equal(steps, 20);
  assert_true(m > 0.0);
  cJSON_Delete(normal);
}

/* A checkpoint written by 2 ranks at step 10, resumed by 4 (and by 3 with A = 2): the run
 * ends with the bits of the uninterrupted one, since nothing in the mode depends on W. */
static void test_resume_other_world(void **state) {
  (void)state;
  char ref[64], h[64], dir[400], cmd[4096], *out = NULL;
  train("", NULL, 2, 1, true, NULL, ref, sizeof ref);
  const struct { int W, A; } resumed[] = {{4, 1}, {3, 2}};
  for (size_t i = 0; i < sizeof resumed / sizeof resumed[0]; i++) {
    snprintf(dir, sizeof dir, "%s/resume%zu", g_tmp, i);
    const char *common =
        "--max_steps 20 --logging_steps 10 --learning_rate 3e-3 --save_steps 10 "
        "--ddp_find_unused_parameters false --disable_tqdm --world_size_invariant_shards " SHARDS;
    snprintf(cmd, sizeof cmd,
             "'%s' --threads 2 --per_device_train_batch_size %d %s --output_dir '%s' && "
             "rm -r '%s/checkpoint-20' && '%s' --threads %d --gradient_accumulation_steps %d "
             "--per_device_train_batch_size %d %s --output_dir '%s' --resume_from_checkpoint true",
             ddp_test_tool("ddp-train"), GLOBAL_BATCH / 2, common, dir, dir,
             ddp_test_tool("ddp-train"), resumed[i].W, resumed[i].A,
             GLOBAL_BATCH / (resumed[i].W * resumed[i].A), common, dir);
    int rc = run(cmd, &out);
    if (rc != 0) fail_msg("exit %d: %s\n%s", rc, cmd, out ? out : "");
    free(out);
    out = NULL;
    char path[512];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    char *metrics = ddp_test_read_file(path, NULL);
    assert_non_null(metrics);
    bool resumed_at_10 = strstr(metrics, "\"start_step\": 10") != NULL;
    free(metrics);
    if (!resumed_at_10) fail_msg("%s: the run did not resume at step 10", path);
    summary_hash(dir, h, sizeof h);
    print_message("2 ranks to step 10, then W=%d A=%d to 20: %s (uninterrupted: %s)\n",
                  resumed[i].W, resumed[i].A, h, ref);
    assert_string_equal(h, ref);
  }
}

/* What the mode refuses, each with its reason. */
static void test_refusals(void **state) {
  (void)state;
  char bn[400];
  snprintf(bn, sizeof bn, "%s/bn.json", g_tmp);
  write_file(bn,
             "{\"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, {\"type\": "
             "\"batchnorm\", \"dim\": 32}, {\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": "
             "32, \"out\": 10}]}\n");
  char bnflag[512];
  snprintf(bnflag, sizeof bnflag, "--model '%s'", bn);
  struct {
    int W;
    const char *flags, *expect;
  } cases[] = {
      {2, "--comm_hook fp16", "comm_hook must be no or allreduce"},
      {2, "--comm_hook allreduce --comm_wrapper fp16", "comm_hook must be no or allreduce"},
      {2, "--ddp_reducer false", "ddp_reducer false"},
      {2, "--dump_local_grads true --dump_dir x", "dump_local_grads"},
      {2, "--forward_flags 0,1", "forward_flags per rank"},
      {5, "", "needs world size x gradient_accumulation_steps (5 x 1) to divide it"},
      {2, bnflag, "refused for a model with buffers (1.running_mean)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' --threads %d --max_steps 2 --per_device_train_batch_size 12 "
             "--world_size_invariant_shards " SHARDS " --save_strategy no --output_dir r %s",
             g_tmp, ddp_test_tool("ddp-train"), cases[i].W, cases[i].flags);
    int rc = run(cmd, &out);
    print_message("%s: exit %d\n", cases[i].flags, rc);
    if (rc == 0 || !out || !strstr(out, cases[i].expect))
      fail_msg("expected a failure saying \"%s\" for %s; exit %d, output:\n%s", cases[i].expect,
               cases[i].flags, rc, out ? out : "");
    free(out);
  }
}

int main(void) {
  snprintf(g_tmp, sizeof g_tmp, "/tmp/ddp-test-invariant-XXXXXX");
  ddp_test_mkdtemp(g_tmp);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mlp),      cmocka_unit_test(test_mlp_dropout),
      cmocka_unit_test(test_gpt2),     cmocka_unit_test(test_gpt2_dropout),
      cmocka_unit_test(test_compare),  cmocka_unit_test(test_resume_other_world),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
