/* ddp-train as users meet it (issue 38): a broken model file is reported before the data
 * is read, with its line and column; a text corpus with a model that cannot train on it says
 * so; a second run on a live run's output_dir fails at once naming the holder's pid; ranks
 * given different training arguments fail before step 1 naming the argument and the values.
 *
 * The cases run the built ddp-train (DDP_BUILD_ROOT/tools/ddp-train) in a fresh temporary
 * directory, which the group teardown removes. */
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

#include <cmocka.h>

#include "ddp.h"
#include "harness.h"
#include "proc.h"

static char dir[256];    /* the test's temporary directory */
static char exe[4096];   /* ddp-train */
static char root[4096];  /* the source tree (tests/data) */
static char tools[4096]; /* the built tools (ddprun) */

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
  snprintf(tools, sizeof tools, "%s/tools", build);
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
  expect("no model_type", rc, out, 2, "--model typeless.json", "no \"model_type\"", "no \"layers\"",
         NULL);
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

/* Runs `cd dir && /bin/sh -c SCRIPT 2>&1` (SCRIPT from fmt); *out as run's. */
static int shell(char **out, const char *fmt, ...) {
  char script[8192], cmd[16384], err[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(script, sizeof script, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "cd '%s' && { %s ; } 2>&1", dir, script);
  snprintf(err, sizeof err, "%s/stderr.txt", dir);
  return ddp_test_proc_run(cmd, err, 120, out);
}

/* Issue 38, item 2: two runs on one output_dir both exited 0 and mixed their checkpoints
 * and metrics. The second now fails in under a second naming the directory and the
 * holder's pid; the lock goes with its holder, so a lock file a dead run left is no lock,
 * and overwrite_output_dir does not take a live run's directory. */
static void test_output_dir_lock(void **state) {
  (void)state;
  char *out = NULL;
  int rc = shell(&out,
                 "'%s' --threads 2 --max_steps 4 --output_dir shared --disable_tqdm true "
                 "--ddp_fault rank=0,step=2,kind=slow:4000 > first.log 2>&1 & first=$!; "
                 "i=0; while [ ! -s shared/.ddp-train.lock ] && [ $i -lt 200 ]; do sleep 0.05; "
                 "i=$((i+1)); done; t0=$(date +%%s%%N); "
                 "'%s' --threads 2 --max_steps 4 --output_dir shared --overwrite_output_dir true; "
                 "echo \"second rc=$? ms=$(( ($(date +%%s%%N) - t0) / 1000000 ))\"; "
                 "echo \"first pid=$first\"; wait $first; echo \"first rc=$?\"",
                 exe, exe);
  assert_int_equal(rc, 0);
  int pid = 0, ms = -1;
  const char *p = strstr(out, "first pid="), *q = strstr(out, "second rc=1 ms=");
  if (!p || !q || sscanf(p, "first pid=%d", &pid) != 1 || sscanf(q, "second rc=1 ms=%d", &ms) != 1)
    fail_msg("the second run did not fail with exit status 1:\n%s", out);
  char holder[96];
  snprintf(holder, sizeof holder, "(pid %d holds shared/.ddp-train.lock)", pid);
  if (ms >= 1000) fail_msg("the second run took %d ms to fail:\n%s", ms, out);
  expect("second run", 0, out, 0, "output_dir shared is in use by another run", holder,
         "first rc=0", NULL);
  /* The first run's lock file stays, unlocked: a third run takes it. */
  put("shared/.ddp-train.lock", "999999\n");
  rc = run(&out, "--threads 2 --max_steps 2 --output_dir shared");
  expect("stale lock file", rc, out, 0, "last checkpoint shared/checkpoint-2", NULL);
}

/* Issue 38, item 3: ranks given a different --seed sharded the data differently and ended
 * with exit 0. They now fail at start-up, before step 1, naming the argument and both
 * values (ddprun, a wrapper giving rank 1 its own --seed). */
static void test_ranks_disagree(void **state) {
  (void)state;
  char *out = NULL;
  char wrap[16384];
  snprintf(wrap, sizeof wrap,
           "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then exec '%s' \"$@\" --seed 2; fi\n"
           "exec '%s' \"$@\"\n",
           exe, exe);
  put("wrap.sh", wrap);
  int rc = shell(&out,
                 "chmod +x wrap.sh && '%s/ddprun' --nproc_per_node 2 --backend shm --standalone "
                 "./wrap.sh "
                 "--max_steps 3 --logging_steps 1 --disable_tqdm true --output_dir disagree",
                 tools);
  if (strstr(out, "step      1/")) fail_msg("a step ran:\n%s", out);
  expect("rank 1 --seed 2", rc, out, 1,
         "training arguments differ between ranks: seed is 42 on rank 0 and 2 on rank 1", NULL);
  snprintf(wrap, sizeof wrap,
           "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then exec '%s' \"$@\" --ddp_bucket_cap_mb 1; fi\n"
           "exec '%s' \"$@\"\n",
           exe, exe);
  put("wrap.sh", wrap);
  rc = shell(&out,
             "'%s/ddprun' --nproc_per_node 2 --backend shm --standalone ./wrap.sh --max_steps 3 "
             "--disable_tqdm true --output_dir disagree",
             tools);
  expect("rank 1 --ddp_bucket_cap_mb 1", rc, out, 1,
         "ddp_bucket_cap_mb is -1 on rank 0 and 1 on rank 1", NULL);
}

/* Issue 38, item 5: training that turned NaN ran to the end and saved NaN checkpoints. It
 * now stops at the first non-finite gradient norm naming the step and the first parameter
 * with a non-finite gradient; the last checkpoint (of the step before) is finite. With
 * --halt_on_nonfinite false it warns and goes on. */
static void test_nonfinite_stops(void **state) {
  (void)state;
  char *out = NULL;
  int rc = run(&out, "--threads 2 --learning_rate 1e8 --optim sgd --max_grad_norm 0 "
                     "--max_steps 10 --save_steps 1 --disable_tqdm true --output_dir nan");
  expect("lr 1e8", rc, out, 1,
         "trainer: step 3: the gradient norm is nan; the first parameter with a non-finite "
         "gradient is 0.weight (element ",
         "the run stops before the step's update and save", NULL);
  char path[512];
  snprintf(path, sizeof path, "%s/nan/checkpoint-3", dir);
  struct stat sb;
  assert_int_not_equal(stat(path, &sb), 0);
  snprintf(path, sizeof path, "%s/nan/checkpoint-2/model.safetensors", dir);
  ddp_st_file_t *f = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, &err), DDP_OK);
  for (size_t i = 0; i < ddp_st_count(f); i++) {
    ddp_tensor_t x;
    const char *name = ddp_st_name(f, i);
    assert_int_equal(ddp_st_tensor(f, i, &x), DDP_OK);
    assert_int_equal(x.dtype, DDP_F32);
    for (int64_t k = 0; k < x.numel; k++) {
      if (!isfinite(((const float *)x.data)[k]))
        fail_msg("%s[%lld] is not finite", name, (long long)k);
    }
  }
  ddp_st_close(f);
  rc = run(&out, "--learning_rate 1e8 --optim sgd --max_grad_norm 0 --max_steps 4 "
                 "--halt_on_nonfinite false --save_strategy no --output_dir nan2");
  expect("halt_on_nonfinite false", rc, out, 0,
         "the gradient norm is nan; the first parameter with a non-finite gradient is",
         "(halt_on_nonfinite false: training goes on)", NULL);
}

/* Issue 38, item 4: a duplicate key took the first value in model files and config.json
 * and the last in --config files. Both readers now refuse it naming the key and its lines. */
static void test_duplicate_keys(void **state) {
  (void)state;
  char *out = NULL;
  put("dup.json", "{\"model_type\": \"gpt2\", \"n_layer\": 2,\n \"n_layer\": 3}");
  int rc = run(&out, "--model dup.json --max_steps 1");
  expect("config.json", rc, out, 2, "--model dup.json",
         "line 2: duplicate key \"n_layer\" (first at line 1)", NULL);
  put("dupargs.json", "{\"seed\": 1,\n\"max_steps\": 2,\n\"seed\": 3}");
  rc = run(&out, "--config dupargs.json");
  expect("--config", rc, out, 2,
         "config file dupargs.json: line 3: duplicate key \"seed\" (first at line 1)", NULL);
}

/* Issue 38, item 7: ddp-fr-trace skipped a corrupt dump and a missing path without a word
 * ("no flight-recorder dump found"); each is now named with its problem. */
static void test_fr_trace_names_bad_dumps(void **state) {
  (void)state;
  char *out = NULL;
  put("fr0.json", "{\"rank\": 0, \"entries\": [");
  put("fr1.json", "");
  put("fr2.json", "[1, 2]");
  int rc =
      shell(&out,
            "/usr/bin/python3 '%s/tools/programs/ddp-fr-trace' fr0.json fr1.json fr2.json nosuch",
            root);
  expect("corrupt dumps", rc, out, 2,
         "ddp-fr-trace: fr0.json: corrupt dump: Expecting value: line 1 column 25",
         "ddp-fr-trace: fr1.json: corrupt dump: the file is empty",
         "ddp-fr-trace: fr2.json: not a flight-recorder dump (no \"entries\" list)",
         "ddp-fr-trace: nosuch: no such file or directory", NULL);
}

/* A fault spec that can never fire (rank >= world size, step >= max_steps) ran the job to
 * the end as if the fault had been survived; it is refused before step 1. */
static void test_fault_never_fires(void **state) {
  (void)state;
  char *out = NULL;
  int rc = run(&out, "--threads 2 --max_steps 3 --ddp_fault rank=2,step=1,kind=crash");
  expect("rank 2 of 2", rc, out, 1,
         "--ddp_fault (DDP_FAULT) \"rank=2,step=1,kind=crash\" can never fire: rank 2 is "
         "beyond the world size 2 (ranks 0 to 1)",
         NULL);
  rc = run(&out, "--threads 2 --max_steps 3 --ddp_fault rank=1,step=3,kind=hang");
  expect("step 3 of 3", rc, out, 1,
         "can never fire: step 3 is beyond the run's last step 2 (steps are 0-based; "
         "max_steps 3)",
         NULL);
}

/* A checkpoint of this version without its checksums.sha256 was resumed unverified, as a
 * checkpoint from before checksums is; it is refused. */
static void test_checksums_required(void **state) {
  (void)state;
  char *out = NULL;
  int rc = run(&out, "--threads 2 --max_steps 2 --save_steps 2 --output_dir sums "
                     "--disable_tqdm true");
  expect("first run", rc, out, 0, NULL);
  char path[512];
  snprintf(path, sizeof path, "%s/sums/checkpoint-2/checksums.sha256", dir);
  assert_int_equal(unlink(path), 0);
  rc = run(&out, "--threads 2 --max_steps 4 --output_dir sums --resume_from_checkpoint "
                 "sums/checkpoint-2");
  expect("no checksums.sha256", rc, out, 1,
         "sums/checkpoint-2/checksums.sha256 is missing: the checkpoint was written with "
         "checksums (its trainer_state.json has checkpoint_format 2)",
         NULL);
}

/* Resuming with another batch size, seed or data went on silently. At an epoch boundary it
 * now warns as Transformers does; mid-epoch, where the rest of the epoch's order cannot be
 * reproduced, it is refused naming the argument and both values. */
static void test_resume_changed_args(void **state) {
  (void)state;
  char *out = NULL;
  int rc = run(&out, "--threads 2 --max_steps 2 --save_steps 2 --output_dir mid "
                     "--disable_tqdm true");
  expect("mid-epoch checkpoint", rc, out, 0, NULL);
  rc = run(&out, "--threads 2 --max_steps 4 --output_dir mid --resume_from_checkpoint "
                 "mid/checkpoint-2 --per_device_train_batch_size 4");
  expect("batch size mid-epoch", rc, out, 1,
         "cannot resume mid/checkpoint-2 with a different per_device_train_batch_size (8 "
         "then, 4 now): the checkpoint is in the middle of epoch 0 (2 of its 113 steps done)",
         NULL);
  rc = run(&out, "--threads 2 --max_steps 4 --output_dir mid --resume_from_checkpoint "
                 "mid/checkpoint-2 --seed 3");
  expect("seed mid-epoch", rc, out, 1, "with a different seed (42 then, 3 now)", NULL);
  /* 1797 samples, 2 ranks of 512: 2 steps an epoch, so checkpoint-2 is at a boundary. */
  rc = run(&out, "--threads 2 --max_steps 2 --save_steps 2 --per_device_train_batch_size 512 "
                 "--output_dir edge --disable_tqdm true");
  expect("epoch-boundary checkpoint", rc, out, 0, NULL);
  rc = run(&out, "--threads 2 --max_steps 3 --output_dir edge --resume_from_checkpoint "
                 "edge/checkpoint-2 --per_device_train_batch_size 256 --seed 3 "
                 "--disable_tqdm true");
  expect("epoch boundary", rc, out, 0,
         "Warning: The training argument 'per_device_train_batch_size' value (256) does not "
         "match the trainer state's value (512) in edge/checkpoint-2/trainer_state.json",
         "Warning: The training argument 'seed' value (3) does not match the trainer state's "
         "value (42)",
         NULL);
  put("g.json", "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 16, \"n_head\": 2, "
                "\"n_positions\": 64, \"vocab_size\": 256}");
  rc = run(&out,
           "--threads 2 --model g.json --data '%s/tests/data/kjv_genesis_exodus.txt' "
           "--block_size 32 --max_steps 2 --save_steps 2 --output_dir lm --disable_tqdm true",
           root);
  expect("GPT-2 checkpoint", rc, out, 0, NULL);
  rc = run(&out,
           "--threads 2 --model g.json --data '%s/tests/data/kjv_genesis_exodus.txt' "
           "--block_size 16 --max_steps 4 --output_dir lm --resume_from_checkpoint "
           "lm/checkpoint-2",
           root);
  expect("block size mid-epoch", rc, out, 1,
         "with a different training data (11477 samples of 32 elements then, 22954 of 16 now: "
         "another --data, --block_size or --max_seq_length)",
         NULL);
}

/* A BERT CSV's label outside [0, num_labels) was found only in the loss, mid-training
 * ("cross_entropy: Target 5 is out of bounds (row 0, 2 classes)"); the CSV is checked as it
 * is read, before training, naming its line. */
static void test_csv_labels_checked(void **state) {
  (void)state;
  char *out = NULL;
  put("c.csv", "text,label\nhello there,0\ngood day,1\nbad one,5\nfine,1\n");
  put("b.json", "{\"model_type\": \"bert\", \"num_hidden_layers\": 1, \"hidden_size\": 16, "
                "\"num_attention_heads\": 2, \"intermediate_size\": 32, "
                "\"max_position_embeddings\": 64, \"vocab_size\": 256}");
  int rc = run(&out, "--threads 2 --model b.json --data c.csv --max_seq_length 16 "
                     "--per_device_train_batch_size 2 --max_steps 2");
  if (strstr(out, "cross_entropy")) fail_msg("the label reached the loss:\n%s", out);
  expect("label 5 of 2", rc, out, 1,
         "--data c.csv: text csv c.csv: line 4 column 2 ('label'): label 5 is not a class id in "
         "[0, 2) (num_labels 2)",
         NULL);
}

/* --config with text after its JSON object is refused (the shared reader), saying so. */
static void test_config_trailing_text(void **state) {
  (void)state;
  char *out = NULL;
  put("two.json", "{\"max_steps\": 2}\n{\"seed\": 3}\n");
  int rc = run(&out, "--config two.json");
  expect("two objects", rc, out, 2,
         "config file two.json: line 2, column 1: text after the end of the JSON value", NULL);
}

/* Out of memory named neither the bytes nor what asked ("from_hf_config: cannot allocate
 * the parameters", "matmul: arena exhausted"); both now say how many bytes were asked for. */
static void test_oom_names_bytes(void **state) {
  (void)state;
  char *out = NULL;
  /* 28 tensors of about 1.35 TB with their gradients: no machine here has it. */
  put("huge.json", "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_embd\": 65536, \"n_head\": 4, "
                   "\"n_positions\": 64, \"vocab_size\": 1000000}");
  int rc = run(&out, "--model huge.json --max_steps 1");
  expect("huge GPT-2", rc, out, 2,
         "--model huge.json: from_hf_config: cannot allocate the parameters and their "
         "gradients: out of memory asking for 1348969955328 bytes (1.35e+03 GB) in one block, "
         "for 28 tensors",
         NULL);
  /* An outer product of 2^22 x 2^22 floats: 64 TiB for matmul's output. */
  ddp_ctx_t *c = NULL;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t sa[2] = {1 << 22, 1}, sb[2] = {1, 1 << 22};
  ddp_var_t *a = NULL, *b = NULL, *y = NULL;
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, sa, NULL, false, &a), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, sb, NULL, false, &b), DDP_OK);
  assert_int_equal(ddp_matmul(c, a, b, &y), DDP_ERR_NO_MEMORY);
  ddp_error_t e = {0};
  ddp_ctx_last_error_copy(c, &e);
  ddp_ctx_destroy(c);
  if (!strstr(e.msg, "matmul: arena exhausted (out of memory: 70368744177664 bytes asked for"))
    fail_msg("matmul's message: %s", e.msg);
}

/* Integer limits in config.json: 1e20 and 2.5 were both "must be an integer (got a
 * number)", and n_layer 2^31 was "gpt2: out of memory". Each now says what is wrong. */
static void test_config_int_limits(void **state) {
  (void)state;
  static const struct {
    const char *value, *want;
  } cases[] = {
      {"2.5", "lim.json: \"n_layer\" must be an integer (got 2.5)"},
      {"1e20", "lim.json: \"n_layer\" (1e+20) is beyond the integers libddp reads exactly"},
      {"2147483648", "lim.json: \"n_layer\" (2147483648) is beyond the limit 2147483647 (2^31 - "
                     "1) for a size or count"},
      {"0", "lim.json: \"n_layer\" must be a positive integer (got 0)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[256], *out = NULL;
    snprintf(text, sizeof text,
             "{\"model_type\": \"gpt2\", \"n_layer\": %s, \"n_embd\": 16, \"n_head\": 2, "
             "\"n_positions\": 64, \"vocab_size\": 256}",
             cases[i].value);
    put("lim.json", text);
    int rc = run(&out, "--model lim.json --max_steps 1");
    expect(cases[i].value, rc, out, 2, cases[i].want, NULL);
  }
}

/* A rank waiting for peers that never come was silent until its timeout; it now says
 * "waiting for rank(s) ..." every 5 s (shm: the store join; tcp: the peers' connections). */
static void test_waiting_for_ranks(void **state) {
  (void)state;
  char *out = NULL;
  static const char *backends[2] = {"shm", "gloo"};
  static const char *verbs[2] = {"join the shm group", "connect"};
  for (int i = 0; i < 2; i++) {
    char want[128], env[160];
    snprintf(env, sizeof env,
             "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
             "MASTER_PORT=%d",
             ddp_test_free_port());
    int rc = shell(&out, "%s '%s' --ddp_backend %s --ddp_timeout 7 --max_steps 1", env, exe,
                   backends[i]);
    snprintf(want, sizeof want, "rank 0: waiting for rank(s) 1 to %s (5 s of the 7 s timeout)",
             verbs[i]);
    expect(backends[i], rc, out, 1, want, "timed out after 7000 ms waiting for rank(s) 1", NULL);
  }
}

/* Flags of one kind of model given for another were ignored silently; they are refused
 * naming the flag and the model, as Transformers' scripts refuse unused arguments. */
static void test_flags_for_model(void **state) {
  (void)state;
  char *out = NULL;
  put("b.json", "{\"model_type\": \"bert\", \"num_hidden_layers\": 1, \"hidden_size\": 16, "
                "\"num_attention_heads\": 2, \"intermediate_size\": 32, "
                "\"max_position_embeddings\": 64, \"vocab_size\": 256}");
  put("g.json", "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 16, \"n_head\": 2, "
                "\"n_positions\": 64, \"vocab_size\": 256}");
  int rc = run(&out, "--model b.json --data c.csv --sample_prompt hi");
  expect("--sample_prompt with BERT", rc, out, 2,
         "--sample_prompt applies to GPT-2 (run_clm's text blocks and the sample after "
         "training), but the model (b.json) is BERT, a classifier",
         NULL);
  rc = run(&out, "--model g.json --max_seq_length 32");
  expect("--max_seq_length with GPT-2", rc, out, 2,
         "--max_seq_length applies to BERT (run_glue's CSV texts), but the model (g.json) is "
         "GPT-2, a causal language model",
         "(GPT-2's sequence length is --block_size)", NULL);
  rc = run(&out, "--block_size 8");
  expect("--block_size with the MLP", rc, out, 2,
         "--block_size applies to GPT-2 (run_clm's text blocks and the sample after training), "
         "but the model (no --model) is the default MLP",
         NULL);
}

/* Issue 38, item 8: a config.json read and written back lost every key libddp does not
 * model (bos_token_id, custom keys, BERT's label names), and a dump's meta.json had
 * "model": {} for a Transformers model. Both now keep them, keys sorted as save_pretrained. */
static void test_config_round_trip(void **state) {
  (void)state;
  char *out = NULL;
  put("gx.json", "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 16, \"n_head\": 2, "
                 "\"n_positions\": 64, \"vocab_size\": 256, \"bos_token_id\": 50256, "
                 "\"eos_token_id\": 50256, \"my_custom\": {\"a\": [1, 2]}}");
  int rc = shell(&out,
                 "'%s' --threads 2 --model gx.json --data '%s/tests/data/kjv_genesis_exodus.txt' "
                 "--block_size 16 --max_steps 1 --save_strategy no --output_dir gx --dump_dir dd "
                 "> gx.log 2>&1 && tr -d '\\n\\t' < gx/config.json && echo && "
                 "tr -d '\\n\\t' < dd/meta.json",
                 exe, root);
  expect("GPT-2 config.json and meta.json", rc, out, 0,
         "\"attn_pdrop\":0.1,\"bos_token_id\":50256,\"embd_pdrop\":0.1,\"eos_token_id\":50256,",
         "\"model_type\":\"gpt2\",\"my_custom\":{\"a\":[1, 2]},\"n_embd\":16",
         "\"model\":{\"activation_function\":\"gelu_new\"", NULL);
  put("bx.json", "{\"model_type\": \"bert\", \"num_hidden_layers\": 1, \"hidden_size\": 16, "
                 "\"num_attention_heads\": 2, \"intermediate_size\": 32, "
                 "\"max_position_embeddings\": 64, \"vocab_size\": 256, \"id2label\": {\"0\": "
                 "\"neg\", \"1\": \"pos\"}, \"label2id\": {\"neg\": 0, \"pos\": 1}, "
                 "\"finetuning_task\": \"sst2\"}");
  put("c2.csv", "text,label\nhello there,0\ngood day,1\nbad one,1\nfine,1\n");
  rc = shell(&out,
             "'%s' --threads 1 --model bx.json --data c2.csv --max_seq_length 16 "
             "--per_device_train_batch_size 2 --max_steps 1 --save_strategy no --output_dir bx "
             "> bx.log 2>&1 && tr -d '\\n\\t' < bx/config.json",
             exe);
  expect("BERT config.json", rc, out, 0, "\"finetuning_task\":\"sst2\"",
         "\"id2label\":{\"0\":\"neg\",\"1\":\"pos\"}", "\"label2id\":{\"neg\":0,\"pos\":1}", NULL);
}

/* With zero_grad_set_to_none false, a parameter rank 0 never reaches kept the zeros of
 * zero_grad, and ddp-train listed no local_grads_none from step 1 on, while
 * tools/torch/torch_reference.py (tensor hooks) lists it every step; both list it now. */
static void test_local_grads_none(void **state) {
  (void)state;
  char *out = NULL;
  put("br.json", "{\"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 16}, {\"type\": "
                 "\"branch\", \"flag\": 0, \"layers\": [{\"type\": \"linear\", \"in\": 16, "
                 "\"out\": 16}]}, {\"type\": \"linear\", \"in\": 16, \"out\": 10}]}");
  int rc = run(&out, "--threads 2 --model br.json --forward_flags 0,1 --zero_grad_set_to_none "
                     "false --ddp_find_unused_parameters true --dump_dir dl --dump_local_grads "
                     "true --max_steps 3 --save_strategy no --output_dir dlo");
  expect("dump", rc, out, 0, NULL);
  for (int r = 0; r < 2; r++) {
    for (int step = 0; step < 3; step++) {
      char path[512];
      snprintf(path, sizeof path, "%s/dl/rank%d/step%06d.safetensors", dir, r, step);
      ddp_st_file_t *f = NULL;
      ddp_error_t err = {0};
      assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, &err), DDP_OK);
      const char *v = ddp_st_meta_get(f, "local_grads_none");
      const char *want = r == 0 ? "1.body.0.weight,1.body.0.bias" : "";
      if (!v || strcmp(v, want) != 0)
        fail_msg("rank %d step %d: local_grads_none \"%s\", expected \"%s\"", r, step,
                 v ? v : "(absent)", want);
      ddp_st_close(f);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_model_file_first),         cmocka_unit_test(test_corpus_needs_lm),
      cmocka_unit_test(test_output_dir_lock),          cmocka_unit_test(test_ranks_disagree),
      cmocka_unit_test(test_nonfinite_stops),          cmocka_unit_test(test_duplicate_keys),
      cmocka_unit_test(test_fr_trace_names_bad_dumps), cmocka_unit_test(test_fault_never_fires),
      cmocka_unit_test(test_checksums_required),       cmocka_unit_test(test_resume_changed_args),
      cmocka_unit_test(test_local_grads_none),         cmocka_unit_test(test_config_round_trip),
      cmocka_unit_test(test_flags_for_model),          cmocka_unit_test(test_waiting_for_ranks),
      cmocka_unit_test(test_oom_names_bytes),          cmocka_unit_test(test_config_int_limits),
      cmocka_unit_test(test_csv_labels_checked),       cmocka_unit_test(test_config_trailing_text),
  };
  return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
