/* Trainer: TrainingArguments parsing (HF names and defaults, both flag spellings, config
 * files, exit status 2 for every usage error, through the built ddp-train), training that
 * lowers the loss on the digits, the DDP oracle (W ranks x batch b = 1 rank x batch W*b;
 * gradient accumulation 4 = batch 4x), bitwise resume (also with two optimizer groups and
 * with PowerSGD's per-rank state), HF's weight-decay groups, a kill -9 during a save, the
 * metrics file, the replica check naming diverged ranks, plain mpirun as a launcher, and
 * the progress bar on a pseudo-terminal versus plain lines.
 *
 * Ranks are threads (ddp_spawn_threads); they record what they saw in the test's arrays
 * and only the parent asserts. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "ddp.h"
#include "harness.h"
#include "proc.h"
#include "train/train_internal.h"

#define MAXW 8

/* An MLP for the 64-feature digits, with dropout so that resume must replay RNG counters. */
static const char *mlp_json = "{\"dtype\": \"f32\", \"layers\": ["
                              "{\"type\": \"linear\", \"in\": 64, \"out\": 32},"
                              "{\"type\": \"relu\"},"
                              "{\"type\": \"dropout\", \"p\": 0.1},"
                              "{\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

static char digits_path[4096];
static ddp_dataset_t *digits;

typedef struct run {
  ddp_train_args_t args;
  const char *model_json;
  /* filled by the ranks */
  ddp_status_t st[MAXW];
  char msg[MAXW][DDP_ERROR_MSG_MAX];
  uint64_t hash[MAXW];
  ddp_train_result_t res[MAXW];
  float *params; /* rank 0's final flat parameters (malloc'd) */
  int64_t nparams;
  double loss_before, loss_after;    /* rank 0: mean CE over the whole dataset */
  const ddp_dataset_t *train, *eval; /* NULL: all the digits, no evaluation */
  double eval_loss, eval_acc;        /* rank 0: recomputed here on the final model */
} run_t;

/* Mean cross-entropy of the model over every digit, computed here sample by sample in
 * double from the logits (independently of the trainer's loss code). */
static ddp_status_t data_loss(ddp_model_t *m, const ddp_dataset_t *ds, double *out,
                              double *accuracy) {
  ddp_ctx_t *ctx = NULL;
  ddp_status_t st = ddp_ctx_create(&ctx);
  if (st != DDP_OK) return st;
  ddp_ctx_set_grad_enabled(ctx, false);
  ddp_model_train(m, false);
  int64_t n = ddp_dataset_length(ds), fn = 64, one = 1, correct = 0;
  double total = 0;
  float f[64];
  int64_t lab;
  for (int64_t i = 0; st == DDP_OK && i < n; i++) {
    ddp_tensor_t ft, lt;
    ddp_tensor_view(&ft, DDP_F32, 1, &fn, f);
    ddp_tensor_view(&lt, DDP_I64, 1, &one, &lab);
    if ((st = ddp_dataset_get(ds, i, &ft, &lt, NULL)) != DDP_OK) break;
    int64_t shape[2] = {1, 64};
    ddp_var_t *x, *y;
    if ((st = ddp_var_new(ctx, DDP_F32, 2, shape, f, false, &x)) != DDP_OK ||
        (st = ddp_model_forward(m, ctx, x, 0, &y)) != DDP_OK) {
      break;
    }
    const float *z = y->value.data;
    double mx = z[0], s = 0;
    int best = 0;
    for (int c = 1; c < 10; c++) {
      mx = fmax(mx, z[c]);
      if (z[c] > z[best]) best = c;
    }
    for (int c = 0; c < 10; c++) s += exp(z[c] - mx);
    total += log(s) + mx - z[lab];
    correct += best == lab;
    ddp_ctx_reset(ctx);
  }
  ddp_model_train(m, true);
  ddp_ctx_destroy(ctx);
  *out = total / (double)n;
  if (accuracy) *accuracy = (double)correct / (double)n;
  return st;
}

static ddp_status_t full_loss(ddp_model_t *m, double *out) {
  return data_loss(m, digits, out, NULL);
}

static ddp_status_t rank_fn(ddp_pg_t *pg, void *arg) {
  run_t *r = arg;
  int rank = ddp_pg_rank(pg);
  ddp_error_t err = {0};
  ddp_model_t *m = NULL;
  ddp_status_t st = ddp_model_from_json(r->model_json ? r->model_json : mlp_json, &m, &err);
  /* Different initial weights per rank on purpose: the trainer must broadcast rank 0's. */
  if (st == DDP_OK) st = ddp_model_init(m, r->args.seed + (uint64_t)rank);
  if (st == DDP_OK && rank == 0) st = full_loss(m, &r->loss_before);
  if (st == DDP_OK) {
    st = ddp_train(pg, m, r->train ? r->train : digits, r->eval, &r->args, NULL, NULL,
                   &r->res[rank], &err);
  }
  if (st == DDP_OK && rank == 0 && r->eval) st = data_loss(m, r->eval, &r->eval_loss, &r->eval_acc);
  if (st == DDP_OK) {
    r->hash[rank] = ddp_train_param_hash(m);
    if (rank == 0) {
      st = full_loss(m, &r->loss_after);
      ddp_tensor_t p = ddp_model_flat_params(m, DDP_F32);
      r->params = malloc((size_t)p.numel * sizeof(float));
      if (r->params) memcpy(r->params, p.data, (size_t)p.numel * sizeof(float));
      r->nparams = p.numel;
    }
  }
  r->st[rank] = st;
  snprintf(r->msg[rank], sizeof r->msg[rank], "%s", err.msg);
  ddp_model_destroy(m);
  return st;
}

static void run_world(run_t *r, int world) {
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.timeout_ms = 30000;
  ddp_status_t st = ddp_spawn_threads(world, &po, rank_fn, r);
  for (int i = 0; i < world; i++) {
    if (r->st[i] != DDP_OK) fail_msg("rank %d: %s: %s", i, ddp_status_name(r->st[i]), r->msg[i]);
  }
  assert_int_equal(st, DDP_OK);
  for (int i = 1; i < world; i++) DDP_ASSERT_EQ(r->hash[i], r->hash[0]);
}

static void make_dir(char *buf, size_t cap, const char *stem) {
  snprintf(buf, cap, "/tmp/ddp_train_%s_XXXXXX", stem);
  ddp_test_mkdtemp(buf); /* removed at exit, also on failure */
}

static void rm_tree(const char *dir) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  assert_int_equal(system(cmd), 0);
}

static run_t *new_run(const char *outdir) {
  run_t *r = calloc(1, sizeof *r);
  assert_non_null(r);
  r->args = (ddp_train_args_t)DDP_TRAIN_ARGS_INIT;
  snprintf(r->args.output_dir, sizeof r->args.output_dir, "%s", outdir);
  r->args.save_strategy[0] = 0;
  strcpy(r->args.save_strategy, "no");
  r->args.logging_steps = 5;
  /* Every test model uses all its parameters: HF's default (true) would only add PyTorch's
   * "no unused parameters" warning per rank. test_loss_falls keeps the default. */
  r->args.ddp_find_unused_parameters = DDP_FALSE;
  return r;
}

static void free_run(run_t *r) {
  free(r->params);
  free(r);
}

/* A run with from's arguments and model, writing to dir. */
static run_t *like_run(const run_t *from, const char *dir) {
  run_t *r = new_run(dir);
  r->args = from->args;
  snprintf(r->args.output_dir, sizeof r->args.output_dir, "%s", dir);
  r->model_json = from->model_json;
  return r;
}

/* A run like `from` in dir, resumed on world ranks from from's checkpoint-<step>; asserts
 * that it started at step and ended with from's parameters bit for bit. */
static run_t *resumed_run(const run_t *from, const char *dir, int64_t step, int world) {
  run_t *r = like_run(from, dir);
  size_t cap = sizeof r->args.resume_from_checkpoint;
  int n = snprintf(r->args.resume_from_checkpoint, cap, "%s/checkpoint-%lld", from->args.output_dir,
                   (long long)step);
  assert_true(n > 0 && (size_t)n < cap);
  run_world(r, world);
  assert_int_equal(r->res[0].start_step, step);
  assert_int_equal(r->nparams, from->nparams);
  assert_memory_equal(r->params, from->params, (size_t)from->nparams * sizeof(float));
  return r;
}

/* ||a - b|| / ||b|| */
static double rel_diff(const float *a, const float *b, int64_t n) {
  double d = 0, s = 0;
  for (int64_t i = 0; i < n; i++) {
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    s += (double)b[i] * b[i];
  }
  return sqrt(d / s);
}

/* ---------------------------------------------------------------- the tool -------- */

/* Runs cmd under /bin/sh with its stdout into out (at most cap - 1 bytes, NUL-terminated);
 * returns the exit status (-1: killed). */
static int shell_output(const char *cmd, char *out, size_t cap) {
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, cap - 1, p);
  out[n] = 0;
  int rc = pclose(p);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* Runs build/tools/ddp-train with argv (NULL-terminated) and extra env "K=V" (may be NULL);
 * captures stdout+stderr into out. Returns the exit status (-1: killed). */
static int run_tool(char *out, size_t cap, const char *env, const char *const *argv) {
  const char *build = getenv("DDP_BUILD_ROOT");
  assert_non_null(build);
  char exe[4096], cmd[16384];
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  size_t len = (size_t)snprintf(cmd, sizeof cmd, "%s%s '%s'", env ? env : "", env ? " " : "", exe);
  for (const char *const *a = argv; *a; a++) {
    len += (size_t)snprintf(cmd + len, sizeof cmd - len, " '%s'", *a);
  }
  snprintf(cmd + len, sizeof cmd - len, " 2>&1");
  return shell_output(cmd, out, cap);
}

static cJSON *print_args(const char *const *argv) {
  char out[65536];
  int rc = run_tool(out, sizeof out, NULL, argv);
  if (rc != 0) fail_msg("ddp-train exited %d: %s", rc, out);
  cJSON *o = cJSON_Parse(out);
  assert_non_null(o);
  return o;
}

static double jnum(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  if (!cJSON_IsNumber(v)) fail_msg("key %s is not a number", k);
  return v->valuedouble;
}

static const char *jstr(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  if (!cJSON_IsString(v)) fail_msg("key %s is not a string", k);
  return v->valuestring;
}

/* HF's defaults (transformers.TrainingArguments, spec §8.1) and the effective DDP flags. */
static void test_defaults(void **state) {
  ddp_train_args_t a = DDP_TRAIN_ARGS_INIT;
  assert_int_equal(a.per_device_train_batch_size, 8);
  assert_int_equal(a.gradient_accumulation_steps, 1);
  DDP_ASSERT_EQ(a.num_train_epochs, 3.0);
  assert_int_equal(a.max_steps, -1);
  DDP_ASSERT_EQ(a.learning_rate, 5e-5);
  DDP_ASSERT_EQ(a.weight_decay, 0.0);
  DDP_ASSERT_EQ(a.adam_beta1, 0.9);
  DDP_ASSERT_EQ(a.adam_beta2, 0.999);
  DDP_ASSERT_EQ(a.adam_epsilon, 1e-8);
  assert_string_equal(a.optim, "adamw_torch");
  DDP_ASSERT_EQ(a.max_grad_norm, 1.0);
  assert_string_equal(a.lr_scheduler_type, "linear");
  assert_int_equal(a.seed, 42);
  assert_int_equal(a.ddp_timeout, 1800);
  assert_int_equal(a.ddp_find_unused_parameters, DDP_UNSET);
  assert_string_equal(a.comm_hook, "no");
  assert_string_equal(a.optim_args, "");
  assert_string_equal(a.forward_flags, "0");
  DDP_ASSERT_EQ(a.ddp_first_bucket_mb, -1);
  assert_string_equal(a.power_sgd_init_q, "");
  /* HF's rule: unset find_unused is True unless gradient checkpointing is on. */
  assert_true(ddp_train_find_unused(&a));
  a.gradient_checkpointing = true;
  assert_false(ddp_train_find_unused(&a));
  assert_true(ddp_train_broadcast_buffers(&a));
  assert_false(ddp_train_static_graph(&a));
  assert_null(ddp_train_backend_name(&a));
  assert_int_equal(ddp_train_args_validate(&a, NULL), DDP_OK);

  ddp_error_t err = {0};
  assert_int_equal(ddp_train_args_set(&a, "ddp_backend", "gloo", &err), DDP_OK);
  assert_string_equal(ddp_train_backend_name(&a), "tcp");
  assert_int_equal(ddp_train_args_set(&a, "ddp_backend", "hccl", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "threads, shm, tcp, mpi, nccl"));
  assert_int_equal(ddp_train_args_set(&a, "ddp_backend", "shm", &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "ddp_find_unused_parameters", "false", &err), DDP_OK);
  assert_false(ddp_train_find_unused(&a));
  assert_int_equal(ddp_train_args_set(&a, "ddp_find_unused_parameters", "none", &err), DDP_OK);
  assert_int_equal(a.ddp_find_unused_parameters, DDP_UNSET);
  assert_int_equal(ddp_train_args_set(&a, "learning_rat", "1", &err), DDP_ERR_NOT_FOUND);
  assert_non_null(strstr(err.msg, "did you mean \"learning_rate\""));
  assert_int_equal(ddp_train_args_set(&a, "max_steps", "1.5", &err), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_train_args_set(&a, "disable_tqdm", "maybe", &err), DDP_ERR_INVALID_ARGUMENT);
  /* Hooks are validated by name; they run inside the reducer, so the flat path refuses
   * them instead of ignoring them. */
  assert_int_equal(ddp_train_args_set(&a, "comm_hook", "power_sgd", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_OK);
  assert_int_equal(
      ddp_train_args_set(&a, "comm_state_option",
                         "{\"matrix_approximation_rank\": 2, \"start_powerSGD_iter\": 3}", &err),
      DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "comm_state_option", "{\"rank\": 2}", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  /* Text after the object is an error, not ignored. */
  assert_int_equal(ddp_train_args_set(&a, "comm_state_option",
                                      "{\"matrix_approximation_rank\": 2} 4", &err),
                   DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "must be a JSON object"));
  assert_int_equal(ddp_train_args_set(&a, "comm_state_option", "", &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "ddp_reducer", "false", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(err.msg, "ddp_reducer"));
  assert_int_equal(ddp_train_args_set(&a, "ddp_reducer", "true", &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "comm_hook", "fp8", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_train_args_set(&a, "comm_hook", "no", &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "comm_state_option", "{\"warm_start\": false}", &err),
                   DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
}

/* forward_flags (torch_reference.py's --flags: one integer, or one per rank cycled) and
 * optim_args (HF's "key=value,..."; SGD's momentum, dampening, nesterov). */
static void test_flags_and_optim_args(void **state) {
  static const struct {
    const char *text;
    int rank;
    uint64_t want;
  } ok[] = {{"0", 3, 0},       {"5", 0, 5},
            {"1,0", 0, 1},     {"1,0", 1, 0},
            {"1,0", 2, 1},     {"1,0,2", 5, 2},
            {" 3 , 4 ", 1, 4}, {"0x10,7", 0, 16},
            {"0X1f", 9, 31},   {"18446744073709551615", 0, UINT64_MAX}};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    uint64_t v = 99;
    if (!ddp__train_forward_flags(ok[i].text, ok[i].rank, &v) || v != ok[i].want) {
      fail_msg("forward_flags \"%s\" rank %d: %llu, want %llu", ok[i].text, ok[i].rank,
               (unsigned long long)v, (unsigned long long)ok[i].want);
    }
  }
  static const char *const bad[] = {"",    "1,",  ",1",
                                    "-1",  "1 2", "0x",
                                    "1.5", "a",   "18446744073709551616"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    if (ddp__train_forward_flags(bad[i], 0, NULL)) fail_msg("accepted \"%s\"", bad[i]);
  }

  ddp_train_args_t a = DDP_TRAIN_ARGS_INIT;
  ddp_error_t err = {0};
  strcpy(a.optim, "sgd");
  strcpy(a.optim_args, " momentum = 0.9, dampening=0.25 ");
  ddp_optim_options_t o = DDP_SGD_OPTIONS_INIT;
  assert_int_equal(ddp__train_optim_args(&a, &o, &err), DDP_OK);
  DDP_ASSERT_EQ(o.momentum, 0.9);
  DDP_ASSERT_EQ(o.dampening, 0.25);
  assert_false(o.nesterov);
  strcpy(a.optim_args, "momentum=0.5,nesterov=True");
  o = (ddp_optim_options_t)DDP_SGD_OPTIONS_INIT;
  assert_int_equal(ddp__train_optim_args(&a, &o, &err), DDP_OK);
  DDP_ASSERT_EQ(o.momentum, 0.5);
  assert_true(o.nesterov);
  strcpy(a.optim_args, "momentum");
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "not key=value"));
  strcpy(a.optim_args, "momentum=-1");
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  strcpy(a.optim_args, "lr=0.1");
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "unknown key \"lr\" for optim sgd"));
  strcpy(a.optim_args, "");
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_OK);
  strcpy(a.forward_flags, "2,1,0");
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_OK);
}

/* Hugging Face TrainingArguments with no field here: accepted where they change nothing or
 * ask for what ddp-train does, refused naming the value and the reason otherwise; booleans
 * as HfArgumentParser reads them; evaluation_strategy, eval_strategy's old name. */
static void test_hf_arguments(void **state) {
  ddp_train_args_t a = DDP_TRAIN_ARGS_INIT;
  ddp_error_t err = {0};
  struct {
    const char *name, *value;
  } ok[] = {{"do_train", "true"},
            {"do_eval", "False"},
            {"local_rank", "-1"},
            {"use_cpu", "y"},
            {"run_name", "exp 3"},
            {"dataloader_num_workers", "4"},
            {"dataloader_prefetch_factor", "none"},
            {"fp16", "false"},
            {"bf16", "no"},
            {"report_to", "none"},
            {"report_to", "all"},
            {"report_to", ""},
            {"logging_strategy", "steps"},
            {"push_to_hub", "0"},
            {"label_smoothing_factor", "0.0"},
            {"neftune_noise_alpha", "null"},
            {"past_index", "-1"}};
  ddp_train_args_t before = a;
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    ddp_status_t st = ddp_train_args_set(&a, ok[i].name, ok[i].value, &err);
    if (st != DDP_OK)
      fail_msg("%s=\"%s\": %s: %s", ok[i].name, ok[i].value, ddp_status_str(st), err.msg);
  }
  /* Accepted without a field: the arguments are as before. */
  assert_memory_equal(&a, &before, sizeof a);
  struct {
    const char *name, *value, *expect;
  } refused[] = {
      {"fp16", "true", "fp16 \"true\" is not available: ddp-train has no mixed precision"},
      {"bf16", "1", "accepted here: false"},
      {"report_to", "wandb", "metrics.jsonl"},
      {"report_to", "wandb", "accepted here: none, all, \"\""},
      {"logging_strategy", "epoch", "logging_strategy \"epoch\""},
      {"label_smoothing_factor", "0.1", "no label smoothing"},
      {"push_to_hub", "true", "uploads nothing"},
      {"save_only_model", "true", "optimizer, scheduler and RNG states"},
      {"neftune_noise_alpha", "5", "accepted here: none, 0"},
      {"dataloader_num_workers", "four", "dataloader_num_workers expects an integer"},
      {"do_train", "maybe", "do_train expects true or false"},
      {"label_smoothing_factor", "none", "accepted here: 0"},
  };
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
    ddp_status_t st = ddp_train_args_set(&a, refused[i].name, refused[i].value, &err);
    if (st != DDP_ERR_INVALID_ARGUMENT || !strstr(err.msg, refused[i].expect)) {
      fail_msg("%s=\"%s\": %s \"%s\", expected INVALID_ARGUMENT with \"%s\"", refused[i].name,
               refused[i].value, ddp_status_str(st), err.msg, refused[i].expect);
    }
  }
  assert_int_equal(ddp_train_args_set(&a, "fp17", "true", &err), DDP_ERR_NOT_FOUND);
  assert_non_null(strstr(err.msg, "unknown argument \"fp17\" (did you mean \"fp16\"?)"));
  assert_int_equal(ddp_train_args_set(&a, "evaluation_strategy", "steps", &err), DDP_OK);
  assert_string_equal(a.eval_strategy, "steps");
  /* A config as TrainingArguments.to_json_string() writes one: every field of ours null
   * (unset: the defaults), evaluation_strategy null beside eval_strategy, HF's own names at
   * their defaults, lists and objects. */
  char dir[256], cfg[512];
  make_dir(dir, sizeof dir, "hfcfg");
  snprintf(cfg, sizeof cfg, "%s/training_args.json", dir);
  FILE *f = fopen(cfg, "w");
  assert_non_null(f);
  fprintf(f, "{");
  for (size_t i = 0; i < ddp_train_arg_count(); i++) {
    const char *n;
    ddp_train_arg_info(i, &n, NULL, NULL, NULL);
    fprintf(f, "\"%s\": null, ", n);
  }
  fprintf(f, "\"evaluation_strategy\": null, \"report_to\": [], \"gradient_checkpointing_kwargs\": "
             "{}, "
             "\"label_names\": null, \"accelerator_config\": {\"split_batches\": false}, "
             "\"per_gpu_train_batch_size\": null, \"fp16\": false, \"tf32\": null, "
             "\"hub_token\": \"<HUB_TOKEN>\", \"dispatch_batches\": null}\n");
  fclose(f);
  ddp_train_args_t loaded = DDP_TRAIN_ARGS_INIT, defaults = DDP_TRAIN_ARGS_INIT;
  ddp_status_t st = ddp_train_args_load_json(&loaded, cfg, &err);
  if (st != DDP_OK) fail_msg("%s: %s", ddp_status_str(st), err.msg);
  char *got = NULL, *want = NULL;
  assert_int_equal(ddp_train_args_to_json(&loaded, &got), DDP_OK);
  assert_int_equal(ddp_train_args_to_json(&defaults, &want), DDP_OK);
  assert_string_equal(got, want);
  ddp_free(got);
  ddp_free(want);
  rm_tree(dir);

  /* lr_scheduler_kwargs: the schedule's own arguments, refused by name otherwise. */
  struct {
    const char *type, *kwargs, *expect;
  } kw[] = {
      {"polynomial", "{\"lr_end\": 1e-6, \"power\": 2}", NULL},
      {"cosine_with_restarts", "{\"num_cycles\": 3}", NULL},
      {"cosine_with_min_lr", "{\"min_lr\": 1e-6}", NULL},
      {"inverse_sqrt", "{\"timescale\": 100}", NULL},
      {"linear", "{}", NULL},
      {"polynomial", "{\"num_cycles\": 2}",
       "\"num_cycles\" is not an argument of the polynomial schedule (it takes lr_end, power)"},
      {"linear", "{\"power\": 2}", "(it takes none)"},
      {"cosine_with_min_lr", "", "one of min_lr or min_lr_rate should be set"},
      {"cosine_with_min_lr", "{\"min_lr\": 1e-6, \"min_lr_rate\": 0.1}", "only one of min_lr"},
      {"inverse_sqrt", "{\"timescale\": 2.5}", "timescale takes a positive integer, got 2.5"},
      {"polynomial", "{\"power\": \"2\"}", "power takes a number, got \"2\""},
      {"cosine", "{num_cycles: 1}", "lr_scheduler_kwargs: not JSON"},
      {"cosine", "{\"num_cycles\": 1} x", "lr_scheduler_kwargs: not JSON"},
      {"cosine", "[1]", "a JSON object of the cosine schedule's arguments"},
  };
  for (size_t i = 0; i < sizeof kw / sizeof kw[0]; i++) {
    ddp_train_args_t b = DDP_TRAIN_ARGS_INIT;
    b.learning_rate = 1e-3;
    assert_int_equal(ddp_train_args_set(&b, "lr_scheduler_type", kw[i].type, &err), DDP_OK);
    assert_int_equal(ddp_train_args_set(&b, "lr_scheduler_kwargs", kw[i].kwargs, &err), DDP_OK);
    ddp_status_t vs = ddp_train_args_validate(&b, &err);
    if (kw[i].expect ? vs != DDP_ERR_INVALID_ARGUMENT || !strstr(err.msg, kw[i].expect)
                     : vs != DDP_OK) {
      fail_msg("%s %s: %s \"%s\", expected %s", kw[i].type, kw[i].kwargs, ddp_status_str(vs),
               vs ? err.msg : "", kw[i].expect ? kw[i].expect : "OK");
    }
  }

  const char *yes[] = {"true", "TRUE", "yes", "t", "Y", "1"},
             *no[] = {"false", "No", "f", "n", "0"};
  for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
    a.disable_tqdm = false;
    assert_int_equal(ddp_train_args_set(&a, "disable_tqdm", yes[i], &err), DDP_OK);
    if (!a.disable_tqdm) fail_msg("disable_tqdm=\"%s\" read as false", yes[i]);
  }
  for (size_t i = 0; i < sizeof no / sizeof *no; i++) {
    a.disable_tqdm = true;
    assert_int_equal(ddp_train_args_set(&a, "disable_tqdm", no[i], &err), DDP_OK);
    if (a.disable_tqdm) fail_msg("disable_tqdm=\"%s\" read as true", no[i]);
  }
}

/* The tool: both spellings, a config file overridden by flags, bare booleans. */
static void test_tool_parsing(void **state) {
  char dir[256], cfg[512];
  make_dir(dir, sizeof dir, "cfg");
  snprintf(cfg, sizeof cfg, "%s/args.json", dir);
  FILE *f = fopen(cfg, "w");
  assert_non_null(f);
  /* As TrainingArguments.to_json_string() writes some keys: lists, objects, HF-only names. */
  fprintf(f, "{\"learning_rate\": 0.25, \"max_steps\": 9, \"ddp_broadcast_buffers\": false, "
             "\"optim\": \"sgd\", \"ddp_static_graph\": null, \"warmup_ratio\": 0.125, "
             "\"report_to\": [\"none\"], \"fsdp\": [\"full_shard\", \"auto_wrap\"], "
             "\"lr_scheduler_kwargs\": {}, \"fp16\": false, "
             "\"do_train\": true, \"evaluation_strategy\": \"epoch\"}\n");
  fclose(f);

  const char *a1[] = {"--print_args", NULL};
  cJSON *o = print_args(a1);
  DDP_ASSERT_EQ(jnum(o, "learning_rate"), 5e-5);
  DDP_ASSERT_EQ(jnum(o, "per_device_train_batch_size"), 8);
  assert_string_equal(jstr(o, "optim"), "adamw_torch");
  DDP_ASSERT_EQ(jnum(o, "ddp_timeout"), 1800);
  cJSON_Delete(o);

  const char *a2[] = {"--config",
                      cfg,
                      "--max_steps=17",
                      "--per_device_train_batch_size",
                      "3",
                      "--ddp_find_unused_parameters",
                      "false",
                      "--disable_tqdm",
                      "--ddp_backend=gloo",
                      "--do_train",
                      "--report_to",
                      "none",
                      "--print_args",
                      NULL};
  o = print_args(a2);
  DDP_ASSERT_EQ(jnum(o, "learning_rate"), 0.25); /* from the file */
  DDP_ASSERT_EQ(jnum(o, "warmup_ratio"), 0.125);
  DDP_ASSERT_EQ(jnum(o, "max_steps"), 17); /* the flag wins */
  DDP_ASSERT_EQ(jnum(o, "per_device_train_batch_size"), 3);
  assert_true(cJSON_IsFalse(cJSON_GetObjectItem(o, "ddp_broadcast_buffers")));
  assert_true(cJSON_IsFalse(cJSON_GetObjectItem(o, "ddp_find_unused_parameters")));
  assert_true(cJSON_IsNull(cJSON_GetObjectItem(o, "ddp_static_graph")));
  assert_true(cJSON_IsTrue(cJSON_GetObjectItem(o, "disable_tqdm")));
  assert_string_equal(jstr(o, "optim"), "sgd");
  assert_string_equal(jstr(o, "ddp_backend"), "gloo");
  assert_string_equal(jstr(o, "eval_strategy"), "epoch"); /* evaluation_strategy, in the file */
  assert_string_equal(jstr(o, "fsdp"), "full_shard auto_wrap"); /* a list, in the file */
  cJSON_Delete(o);
  rm_tree(dir);
}

/* Every usage error exits 2 with a message that names the problem. */
static void test_tool_errors(void **state) {
  struct {
    const char *argv[5];
    const char *expect;
  } cases[] = {
      {{"--no_such_flag", "1", NULL}, "unknown argument \"no_such_flag\""},
      {{"--no_such_flag", NULL}, "unknown argument \"no_such_flag\""},
      {{"--learning_rate", NULL}, "--learning_rate needs a value"},
      {{"--data", NULL}, "--data needs a value"},
      {{"--fp16", NULL}, "fp16 \"true\" is not available: ddp-train has no mixed precision"},
      {{"--report_to", "wandb", NULL}, "report_to \"wandb\" is not available"},
      {{"--learning_rate", "fast", NULL}, "learning_rate expects a number"},
      {{"--max_steps=2.5", NULL}, "max_steps expects an integer"},
      {{"--disable_tqdm", "maybe", NULL}, "disable_tqdm expects true or false"},
      {{"--config", "/nonexistent/args.json", NULL}, "No such file"},
      {{"--data", "/nonexistent/data.safetensors", NULL}, "No such file"},
      {{"--model", "/nonexistent/model.json", NULL}, "--model /nonexistent/model.json"},
      {{"--ddp_backend", "xccl", NULL}, "the choices are gloo (= tcp), threads, shm, tcp"},
      {{"--comm_hook", "fp16", "--ddp_reducer", "false"}, "needs ddp_reducer true"},
      {{"--comm_hook", "fp32", NULL}, "fp32"},
      {{"--comm_hook", "fp16", "--comm_wrapper", "int8"}, "int8"},
      {{"--optim", "lion", NULL}, "optim \"lion\""},
      {{"--lr_scheduler_type", "reduce_lr_on_plateau", NULL}, "lr_scheduler_type"},
      {{"--ddp_backend", "shm", NULL}, "run under ddprun"},
      {{"--threads", "0", NULL}, "--threads expects"},
      {{"--logging_steps", "2.5", NULL}, "logging_steps must be a whole number"},
      {{"--resume_from_checkpoint", "/nonexistent/checkpoint-5", NULL}, "checkpoint-5"},
      {{"--resume_from_checkpoint", "true", "--output_dir", "/nonexistent/out"},
       "/nonexistent/out"},
      {{"--forward_flags", "1,x", NULL}, "forward_flags expects one integer"},
      {{"--optim", "sgd", "--optim_args", "momentum=fast"}, "optim_args: momentum=fast"},
      {{"--optim_args", "betas=0.9", NULL}, "unknown key \"betas\" for optim adamw_torch"},
      {{"--optim", "sgd", "--optim_args", "nesterov=true"}, "Nesterov momentum requires"},
      {{"--ddp_first_bucket_mb", "0", NULL}, "ddp_first_bucket_mb must be positive"},
      {{"--power_sgd_init_q", "q.safetensors", NULL}, "power_sgd_init_q needs comm_hook"},
      {{"--max_shard_size", "10XB", NULL}, "max_shard_size: '10XB' is not a valid size"},
      {{"--save_safetensors", "false", NULL}, "save_safetensors false would save pytorch_model"},
      {{"--comm_hook", "power_sgd", "--power_sgd_init_q", "/nonexistent/q.safetensors"},
       "--power_sgd_init_q /nonexistent/q.safetensors"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char out[8192];
    int rc = run_tool(out, sizeof out, NULL, cases[i].argv);
    if (rc != 2) fail_msg("%s: exit %d, expected 2: %s", cases[i].argv[0], rc, out);
    if (!strstr(out, cases[i].expect)) {
      fail_msg("%s: message lacks \"%s\": %s", cases[i].argv[0], cases[i].expect, out);
    }
  }
  char out[16384];
  const char *help[] = {"--help", NULL};
  assert_int_equal(run_tool(out, sizeof out, NULL, help), 0);
  assert_non_null(strstr(out, "--gradient_accumulation_steps"));
  assert_non_null(strstr(out, "--ddp_find_unused_parameters"));
}

/* 2 and 4 thread ranks: the full-dataset loss falls well below its start. */
static void test_loss_falls(void **state) {
  for (int world = 2; world <= 4; world += 2) {
    char dir[256];
    make_dir(dir, sizeof dir, "loss");
    run_t *r = new_run(dir);
    r->args.ddp_find_unused_parameters = DDP_UNSET;
    strcpy(r->args.optim, "sgd");
    r->args.learning_rate = 0.2;
    r->args.max_steps = 300;
    r->args.per_device_train_batch_size = 16;
    run_world(r, world);
    print_message("world %d: full-data loss %.4f -> %.4f\n", world, r->loss_before, r->loss_after);
    assert_true(r->loss_after < 0.5 * r->loss_before);
    assert_true(r->res[0].replica_checks >= 300 / 5);
    free_run(r);
    rm_tree(dir);
  }
}

/* The DDP oracle: W ranks with batch b equal one rank with batch W*b (the strided
 * DistributedSampler shards of one shuffle make the same global batch), and accumulation of
 * 4 micro-batches of b equals one batch of 4b. SGD, no dropout. */
static const char *mlp_nodrop = "{\"dtype\": \"f32\", \"layers\": ["
                                "{\"type\": \"linear\", \"in\": 64, \"out\": 32},"
                                "{\"type\": \"tanh\"},"
                                "{\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

static run_t *oracle_run_sync(int world, int64_t batch, int64_t ga, bool reducer,
                              ddp_tristate_t find_unused) {
  char dir[256];
  make_dir(dir, sizeof dir, "eq");
  run_t *r = new_run(dir);
  r->model_json = mlp_nodrop;
  strcpy(r->args.optim, "sgd");
  r->args.learning_rate = 0.05;
  r->args.max_steps = 25;
  r->args.per_device_train_batch_size = batch;
  r->args.gradient_accumulation_steps = ga;
  r->args.ddp_reducer = reducer;
  r->args.ddp_find_unused_parameters = find_unused;
  run_world(r, world);
  rm_tree(dir);
  return r;
}

static run_t *oracle_run(int world, int64_t batch, int64_t ga) {
  return oracle_run_sync(world, batch, ga, true, DDP_FALSE);
}

static void test_equivalence(void **state) {
  run_t *one = oracle_run(1, 16, 1);
  run_t *four = oracle_run(4, 4, 1);
  run_t *acc = oracle_run(1, 4, 4);
  run_t *two_acc = oracle_run(2, 2, 4);
  assert_int_equal(one->nparams, four->nparams);
  double d1 = rel_diff(four->params, one->params, one->nparams);
  double d2 = rel_diff(acc->params, one->params, one->nparams);
  double d3 = rel_diff(two_acc->params, one->params, one->nparams);
  /* The runs moved the parameters (the comparison is not trivially of the initial ones). */
  double moved = fabs(one->loss_after - one->loss_before);
  print_message("rel diff: 4x4 vs 1x16 %.2e; GA4x4 vs 16 %.2e; 2 ranks GA4x2 vs 16 %.2e; "
                "loss %.4f -> %.4f\n",
                d1, d2, d3, one->loss_before, one->loss_after);
  assert_true(moved > 0.05);
  assert_true(d1 <= 1e-5);
  assert_true(d2 <= 1e-5);
  assert_true(d3 <= 1e-5);
  free_run(one);
  free_run(four);
  free_run(acc);
  free_run(two_acc);
}

/* The trainer's two synchronisation paths, the bucketed DDP reducer (with HF's default
 * find_unused_parameters, true, and accumulation) and the flat one-bucket allreduce, train
 * the same parameters (up to the reducer's pre-division by W). */
static void test_reducer_vs_flat(void **state) {
  run_t *a = oracle_run_sync(3, 4, 2, true, DDP_UNSET);
  run_t *b = oracle_run_sync(3, 4, 2, false, DDP_UNSET);
  double d = rel_diff(a->params, b->params, a->nparams);
  print_message("reducer vs flat allreduce: rel diff %.2e\n", d);
  assert_true(d <= 1e-6);
  free_run(a);
  free_run(b);
}

/* The held-out split partitions the data as documented (the first round(f * N) entries of
 * torch.randperm(N, seed) are held out, each part in ascending order, samples unchanged),
 * and the trainer's distributed evaluation over 3 ranks equals a serial recomputation. */
static void test_split_and_eval(void **state) {
  ddp_dataset_t *tr = NULL, *ev = NULL;
  assert_int_equal(ddp_dataset_split(digits, 0.1, 42, &tr, &ev, NULL), DDP_OK);
  int64_t n = ddp_dataset_length(digits), ne = ddp_dataset_length(ev);
  assert_int_equal(ne, 180); /* round(179.7) */
  assert_int_equal(ddp_dataset_length(tr) + ne, n);
  int64_t *perm = malloc((size_t)n * sizeof *perm);
  char *in_eval = calloc((size_t)n, 1);
  assert_true(perm && in_eval);
  ddp_randperm(n, 42, perm);
  for (int64_t i = 0; i < ne; i++) in_eval[perm[i]] = 1;
  /* Walk both parts in order against the base dataset. */
  int64_t a = 0, b = 0, fn = 64, one = 1;
  float f0[64], f1[64];
  int64_t l0, l1;
  ddp_tensor_t t0, t1, u0, u1;
  ddp_tensor_view(&t0, DDP_F32, 1, &fn, f0);
  ddp_tensor_view(&t1, DDP_F32, 1, &fn, f1);
  ddp_tensor_view(&u0, DDP_I64, 1, &one, &l0);
  ddp_tensor_view(&u1, DDP_I64, 1, &one, &l1);
  for (int64_t i = 0; i < n; i++) {
    const ddp_dataset_t *part = in_eval[i] ? ev : tr;
    int64_t j = in_eval[i] ? b++ : a++;
    assert_int_equal(ddp_dataset_get(digits, i, &t0, &u0, NULL), DDP_OK);
    assert_int_equal(ddp_dataset_get(part, j, &t1, &u1, NULL), DDP_OK);
    assert_memory_equal(f0, f1, sizeof f0);
    assert_int_equal(l0, l1);
  }
  free(perm);
  free(in_eval);

  char dir[256];
  make_dir(dir, sizeof dir, "eval");
  run_t *r = new_run(dir);
  r->train = tr;
  r->eval = ev;
  strcpy(r->args.optim, "sgd");
  r->args.learning_rate = 0.1;
  r->args.max_steps = 40;
  strcpy(r->args.eval_strategy, "steps");
  r->args.eval_steps = 20;
  r->args.per_device_eval_batch_size = 7; /* 180 rows over 3 ranks: uneven batches */
  run_world(r, 3);
  print_message("eval: trainer %.6f / %.4f, serial %.6f / %.4f\n", r->res[0].eval_loss,
                r->res[0].eval_accuracy, r->eval_loss, r->eval_acc);
  assert_true(fabs(r->res[0].eval_loss - r->eval_loss) <= 1e-5 * r->eval_loss);
  DDP_ASSERT_EQ(r->res[0].eval_accuracy, r->eval_acc);
  free_run(r);
  rm_tree(dir);
  ddp_dataset_destroy(tr);
  ddp_dataset_destroy(ev);
}

/* Accelerate's comm hooks through the trainer: fp16 compression stays within fp16 rounding
 * of the exact run but is not identical to it (the hook ran); PowerSGD (rank 1, from step 2)
 * changes the result and still trains. Replicas stay identical in both (run_world). */
static void test_comm_hooks(void **state) {
  run_t *exact = oracle_run_sync(2, 8, 1, true, DDP_FALSE);
  char dir[256];
  make_dir(dir, sizeof dir, "hook");
  run_t *fp16 = like_run(exact, dir);
  strcpy(fp16->args.comm_hook, "fp16");
  run_world(fp16, 2);
  run_t *psgd = like_run(exact, dir);
  strcpy(psgd->args.comm_hook, "power_sgd");
  strcpy(psgd->args.comm_state_option,
         "{\"matrix_approximation_rank\": 1, \"start_powerSGD_iter\": 2}");
  run_world(psgd, 2);
  double d16 = rel_diff(fp16->params, exact->params, exact->nparams);
  double dps = rel_diff(psgd->params, exact->params, exact->nparams);
  print_message("fp16 hook vs exact %.2e; PowerSGD vs exact %.2e; PowerSGD loss %.4f -> %.4f\n",
                d16, dps, psgd->loss_before, psgd->loss_after);
  assert_true(d16 > 0 && d16 < 1e-3);
  assert_true(dps > d16);
  assert_true(psgd->loss_after < psgd->loss_before);
  free_run(exact);
  free_run(fp16);
  free_run(psgd);
  rm_tree(dir);
}

/* Resume from step 10 of 30 (AdamW state, accumulation, dropout, mid-epoch) equals the
 * uninterrupted run bit for bit; save_total_limit keeps the newest checkpoints. */
static void test_resume_bitwise(void **state) {
  char da[256], db[256], ck[512];
  make_dir(da, sizeof da, "resA");
  make_dir(db, sizeof db, "resB");
  run_t *a = new_run(da);
  a->args.learning_rate = 1e-3;
  a->args.max_steps = 30;
  a->args.gradient_accumulation_steps = 2;
  a->args.warmup_steps = 4;
  strcpy(a->args.save_strategy, "steps");
  a->args.save_steps = 10;
  a->args.save_total_limit = 2;
  a->args.weight_decay = 0.01; /* two parameter groups, each with its optimizer file */
  run_world(a, 3);

  /* Rotation: 10 was deleted, 20 and 30 remain. */
  struct stat sb;
  snprintf(ck, sizeof ck, "%s/checkpoint-10", da);
  assert_int_not_equal(stat(ck, &sb), 0);
  snprintf(ck, sizeof ck, "%s/checkpoint-20/optimizer.safetensors", da);
  assert_int_equal(stat(ck, &sb), 0);
  snprintf(ck, sizeof ck, "%s/checkpoint-20/optimizer_group1.safetensors", da);
  assert_int_equal(stat(ck, &sb), 0);

  /* Resume from 20 in a fresh output directory, and from "true" (the latest) = 30. */
  run_t *b = resumed_run(a, db, 20, 3);
  DDP_ASSERT_EQ(b->hash[0], a->hash[0]);

  /* And from step 10 of a run that kept every checkpoint. */
  rm_tree(db);
  make_dir(db, sizeof db, "resC");
  run_t *c = like_run(a, db);
  c->args.save_total_limit = -1;
  c->args.max_steps = 10;
  run_world(c, 3);
  run_t *d = like_run(a, db);
  strcpy(d->args.resume_from_checkpoint, "true");
  run_world(d, 3);
  assert_int_equal(d->res[0].start_step, 10);
  /* The 10-step run ended its LR schedule at 10 steps; a 30-step run's schedule differs,
   * so this compares a resumed 30-step run whose first 10 steps used a 10-step schedule:
   * it must NOT equal the uninterrupted one. The bitwise case is the one above. */
  assert_true(d->hash[0] != a->hash[0]);
  free_run(a);
  free_run(b);
  free_run(c);
  free_run(d);
  rm_tree(da);
  rm_tree(db);
}

/* PowerSGD (rank 2 from step 2: error feedback and warm-start factors in use) on 2 ranks:
 * resuming from checkpoint-5 gives bitwise the parameters of the uninterrupted 12-step
 * run, because every rank's hook state is in the checkpoint. Without those files the
 * resumed run starts the state afresh and differs (the state matters to the result).
 * The same holds for batched PowerSGD. */
static void test_powersgd_resume(void **state) {
  char da[256], db[256], ck[512], cmd[1200];
  make_dir(da, sizeof da, "psgdA");
  make_dir(db, sizeof db, "psgdB");
  run_t *a = new_run(da);
  a->model_json = mlp_nodrop;
  a->args.learning_rate = 1e-3;
  a->args.max_steps = 12;
  strcpy(a->args.save_strategy, "steps");
  a->args.save_steps = 5;
  strcpy(a->args.comm_hook, "power_sgd");
  strcpy(a->args.comm_state_option,
         "{\"matrix_approximation_rank\": 2, \"start_powerSGD_iter\": 2}");
  run_world(a, 2);
  struct stat sb;
  for (int r = 0; r < 2; r++) {
    snprintf(ck, sizeof ck, "%s/checkpoint-5/hook_state_rank%d.safetensors", da, r);
    assert_int_equal(stat(ck, &sb), 0);
  }
  /* The two ranks' error feedback differs (rank-local state). */
  ddp_st_file_t *f0 = NULL, *f1 = NULL;
  snprintf(ck, sizeof ck, "%s/checkpoint-5/hook_state_rank0.safetensors", da);
  assert_int_equal(ddp_st_open(ck, DDP_ST_READ, &f0, NULL), DDP_OK);
  snprintf(ck, sizeof ck, "%s/checkpoint-5/hook_state_rank1.safetensors", da);
  assert_int_equal(ddp_st_open(ck, DDP_ST_READ, &f1, NULL), DDP_OK);
  assert_string_equal(ddp_st_meta_get(f0, "iter"), "5");
  size_t i0, i1;
  assert_int_equal(ddp_st_find(f0, "bucket.0.error", &i0), DDP_OK);
  assert_int_equal(ddp_st_find(f1, "bucket.0.error", &i1), DDP_OK);
  ddp_tensor_t e0, e1;
  assert_int_equal(ddp_st_tensor(f0, i0, &e0), DDP_OK);
  assert_int_equal(ddp_st_tensor(f1, i1, &e1), DDP_OK);
  assert_int_equal(e0.numel, e1.numel);
  assert_true(memcmp(e0.data, e1.data, (size_t)e0.numel * sizeof(float)) != 0);
  ddp_st_close(f0);
  ddp_st_close(f1);
  /* The file loads into a state created with the same options (iteration 5 restored), is
   * refused by one with another rank, and a missing file is DDP_ERR_NOT_FOUND. */
  ddp_powersgd_options_t po = DDP_POWERSGD_OPTIONS_INIT;
  po.matrix_approximation_rank = 2;
  po.start_powerSGD_iter = 2;
  ddp_powersgd_state_t *ps = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_powersgd_state_create(&po, 0, &ps, NULL), DDP_OK);
  snprintf(ck, sizeof ck, "%s/checkpoint-5/hook_state_rank0.safetensors", da);
  assert_int_equal(ddp_powersgd_state_load(ps, ck, &err), DDP_OK);
  assert_int_equal(ddp_powersgd_iter(ps), 5);
  ddp_powersgd_state_destroy(ps);
  po.matrix_approximation_rank = 1;
  assert_int_equal(ddp_powersgd_state_create(&po, 0, &ps, NULL), DDP_OK);
  assert_int_equal(ddp_powersgd_state_load(ps, ck, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "matrix_approximation_rank 2"));
  assert_int_equal(ddp_powersgd_iter(ps), 0);
  snprintf(ck, sizeof ck, "%s/checkpoint-5/hook_state_rank9.safetensors", da);
  assert_int_equal(ddp_powersgd_state_load(ps, ck, &err), DDP_ERR_NOT_FOUND);
  ddp_powersgd_state_destroy(ps);

  run_t *b = resumed_run(a, db, 5, 2);

  /* A checkpoint from before hook states (and checksums) were saved: no hook states, no
   * checksums, and no "checkpoint_format" in trainer_state.json (which would require them). */
  snprintf(cmd, sizeof cmd,
           "rm -f '%s'/checkpoint-5/hook_state_rank*.safetensors "
           "'%s'/checkpoint-5/checksums.sha256 && "
           "sed -i 's/\"checkpoint_format\": *[0-9]*,\\?//' '%s'/checkpoint-5/trainer_state.json",
           da, da, da);
  assert_int_equal(system(cmd), 0);
  run_t *c = like_run(b, db);
  run_world(c, 2);
  double d = rel_diff(c->params, a->params, a->nparams);
  print_message("PowerSGD resume: with hook state bitwise equal; without it rel diff %.2e\n", d);
  assert_true(d > 0);

  /* batched_power_sgd compresses the whole bucket as one matrix: the resumed step, run in
   * the reducer's construction-time order, is rearranged into the saved order. */
  rm_tree(da);
  rm_tree(db);
  make_dir(da, sizeof da, "bpsgdA");
  make_dir(db, sizeof db, "bpsgdB");
  run_t *x = like_run(a, da);
  strcpy(x->args.comm_hook, "batched_power_sgd");
  run_world(x, 2);
  free_run(resumed_run(x, db, 5, 2));
  free_run(x);
  free_run(a);
  free_run(b);
  free_run(c);
  rm_tree(da);
  rm_tree(db);
}

/* HF's parameter groups: with weight_decay, biases and LayerNorm parameters are not
 * decayed, every other parameter is. One SGD step (no clipping, constant lr) with and
 * without weight decay: the no-decay parameters end bitwise equal, the others differ by
 * -lr * wd * p0 (p0 recomputed here from the same initialisation). The checkpoint lists
 * the groups by name. */
static void test_weight_decay_groups(void **state) {
  static const char *ln_json = "{\"dtype\": \"f32\", \"layers\": ["
                               "{\"type\": \"linear\", \"in\": 64, \"out\": 16},"
                               "{\"type\": \"layernorm\", \"dim\": 16},"
                               "{\"type\": \"tanh\"},"
                               "{\"type\": \"linear\", \"in\": 16, \"out\": 10}]}";
  const double lr = 0.1, wd = 0.5;
  char dir[256], path[512];
  make_dir(dir, sizeof dir, "wd");
  run_t *r[2];
  for (int k = 0; k < 2; k++) {
    r[k] = new_run(dir);
    r[k]->model_json = ln_json;
    strcpy(r[k]->args.optim, "sgd");
    strcpy(r[k]->args.lr_scheduler_type, "constant");
    r[k]->args.learning_rate = lr;
    r[k]->args.max_grad_norm = 0;
    r[k]->args.max_steps = 1;
    r[k]->args.weight_decay = k == 0 ? wd : 0.0;
    strcpy(r[k]->args.save_strategy, k == 0 ? "steps" : "no");
    run_world(r[k], 1);
  }
  ddp_model_t *m = NULL;
  assert_int_equal(ddp_model_from_json(ln_json, &m, NULL), DDP_OK);
  assert_int_equal(ddp_model_init(m, r[0]->args.seed), DDP_OK);
  const float *p0 = ddp_model_flat_params(m, DDP_F32).data;
  cJSON *expect[2] = {cJSON_CreateArray(), cJSON_CreateArray()};
  int decayed = 0, exempt = 0;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    const ddp_param_t *p = ddp_model_param(m, i);
    /* Layer "1." is the LayerNorm; names with "bias" are biases. */
    bool no_decay = strstr(p->name, "bias") || strncmp(p->name, "1.", 2) == 0;
    cJSON_AddItemToArray(expect[no_decay], cJSON_CreateString(p->name));
    for (int64_t j = p->offset; j < p->offset + p->value.numel; j++) {
      double got = (double)r[0]->params[j] - r[1]->params[j];
      if (no_decay) {
        if (r[0]->params[j] != r[1]->params[j])
          fail_msg("%s[%lld] was decayed", p->name, (long long)(j - p->offset));
      } else {
        double want = -lr * wd * p0[j];
        if (fabs(got - want) > 1e-6 + 1e-3 * fabs(want))
          fail_msg("%s[%lld]: decay %.9g, expected %.9g", p->name, (long long)(j - p->offset), got,
                   want);
      }
    }
    decayed += !no_decay;
    exempt += no_decay;
  }
  assert_int_equal(decayed, 2);
  assert_int_equal(exempt, 4);
  /* trainer_state.json: [{"weight_decay": wd, "params": [...]}, {"weight_decay": 0, ...}]. */
  snprintf(path, sizeof path, "%s/checkpoint-1/trainer_state.json", dir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  static char text[65536];
  text[fread(text, 1, sizeof text - 1, f)] = 0;
  fclose(f);
  cJSON *js = cJSON_Parse(text);
  const cJSON *groups = cJSON_GetObjectItemCaseSensitive(js, "optimizer_groups");
  assert_int_equal(cJSON_GetArraySize(groups), 2);
  for (int g = 0; g < 2; g++) {
    const cJSON *gr = cJSON_GetArrayItem(groups, g);
    DDP_ASSERT_EQ(jnum(gr, "weight_decay"), (g == 0 ? wd : 0.0));
    assert_true(cJSON_Compare(cJSON_GetObjectItemCaseSensitive(gr, "params"), expect[g], true));
  }
  cJSON_Delete(js);
  cJSON_Delete(expect[0]);
  cJSON_Delete(expect[1]);
  ddp_model_destroy(m);
  free_run(r[0]);
  free_run(r[1]);
  rm_tree(dir);
}

/* A trainer killed with SIGKILL in the middle of writing checkpoint-20 leaves
 * checkpoint-10 complete and loadable, and a restart resumes from it. */
static void test_kill_during_save(void **state) {
  const char *build = getenv("DDP_BUILD_ROOT");
  assert_non_null(build);
  char dir[256], model[512], exe[4096], probe[512], ck[512];
  make_dir(dir, sizeof dir, "kill");
  snprintf(model, sizeof model, "%s/model.json", dir);
  FILE *f = fopen(model, "w");
  assert_non_null(f);
  fputs(mlp_json, f);
  fclose(f);
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    setenv("DDP_TRAIN_SAVE_PAUSE_MS", "400", 1);
    if (!freopen("/dev/null", "w", stdout)) _exit(125);
    execl(exe, exe, "--threads", "2", "--model", model, "--max_steps", "40", "--save_steps", "10",
          "--logging_steps", "5", "--learning_rate", "1e-3", "--output_dir", dir, (char *)NULL);
    _exit(127);
  }
  /* Wait until the second save has written its model file, then kill. */
  snprintf(probe, sizeof probe, "%s/tmp-checkpoint-20/model.safetensors", dir);
  struct stat sb;
  bool seen = false;
  for (int i = 0; i < 2000 && !seen; i++) {
    seen = stat(probe, &sb) == 0;
    if (!seen) usleep(10000);
  }
  kill(pid, SIGKILL);
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(seen);
  DDP_ASSERT_KILLED(status, SIGKILL);

  /* checkpoint-20 does not exist; checkpoint-10 is complete and is the latest. */
  snprintf(ck, sizeof ck, "%s/checkpoint-20", dir);
  assert_int_not_equal(stat(ck, &sb), 0);
  char latest[1024];
  assert_int_equal(ddp_train_latest_checkpoint(dir, latest, sizeof latest, NULL), DDP_OK);
  snprintf(ck, sizeof ck, "%s/checkpoint-10", dir);
  assert_string_equal(latest, ck);

  /* It loads into a fresh model and an AdamW over it. */
  ddp_model_t *m = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(mlp_json, &m, &err), DDP_OK);
  size_t np = ddp_model_num_params(m);
  ddp_optim_param_t pairs[16];
  assert_true(np <= 16);
  for (size_t i = 0; i < np; i++) {
    pairs[i].param = &ddp_model_param(m, i)->value;
    pairs[i].grad = &ddp_model_param(m, i)->grad;
  }
  ddp_optim_options_t oo = DDP_ADAMW_OPTIONS_INIT;
  ddp_optim_t *opt = NULL;
  assert_int_equal(ddp_optim_create(&oo, pairs, np, &opt, &err), DDP_OK);
  int64_t step = -1;
  ddp_status_t st = ddp_train_checkpoint_load(ck, m, opt, &step, &err);
  if (st != DDP_OK) fail_msg("checkpoint-10: %s", err.msg);
  assert_int_equal(step, 10);
  ddp_optim_destroy(opt);
  ddp_model_destroy(m);

  /* A restart with resume_from_checkpoint true resumes from it and completes. */
  char out[16384];
  const char *argv[] = {"--threads",
                        "2",
                        "--model",
                        model,
                        "--max_steps",
                        "20",
                        "--save_steps",
                        "10",
                        "--logging_steps",
                        "5",
                        "--learning_rate",
                        "1e-3",
                        "--output_dir",
                        dir,
                        "--resume_from_checkpoint",
                        "true",
                        NULL};
  int rc = run_tool(out, sizeof out, NULL, argv);
  if (rc != 0) fail_msg("resume exited %d: %s", rc, out);
  assert_non_null(strstr(out, "(from step 10)"));
  snprintf(ck, sizeof ck, "%s/checkpoint-20/trainer_state.json", dir);
  assert_int_equal(stat(ck, &sb), 0);
  rm_tree(dir);
}

/* metrics.jsonl: a line per logging step with the documented keys, lr following the linear
 * schedule (recomputed here), a summary, and the SVG plot. */
static void test_metrics(void **state) {
  char dir[256], path[512];
  make_dir(dir, sizeof dir, "metrics");
  run_t *r = new_run(dir);
  r->args.learning_rate = 2e-3;
  r->args.max_steps = 23;
  r->args.logging_steps = 0.2; /* HF: a fraction of the steps, ceil(0.2 * 23) = every 5 */
  run_world(r, 2);
  const int64_t expect_grad_bytes = r->nparams * (int64_t)sizeof(float);
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  char line[4096];
  int64_t expect_step = 5;
  int logs = 0, summaries = 0;
  while (fgets(line, sizeof line, f)) {
    cJSON *o = cJSON_Parse(line);
    assert_non_null(o);
    if (cJSON_GetObjectItem(o, "summary")) {
      summaries++;
      DDP_ASSERT_EQ(jnum(o, "steps"), 23);
      DDP_ASSERT_EQ(jnum(o, "world_size"), 2);
      DDP_ASSERT_EQ(jnum(o, "replica_checks"), 6);
    } else if (cJSON_GetObjectItem(o, "loss")) {
      int64_t step = (int64_t)jnum(o, "step");
      assert_int_equal(step, expect_step);
      expect_step = expect_step + 5 > 23 ? 23 : expect_step + 5;
      /* HF linear schedule, warmup 0: the step `s` (1-based) used lr * (N - (s-1)) / N. */
      double lr = 2e-3 * (double)(23 - (step - 1)) / 23.0;
      assert_true(fabs(jnum(o, "lr") - lr) <= 1e-7 * lr); /* printed with 9 digits */
      assert_true(jnum(o, "loss") > 0 && jnum(o, "loss") < 10);
      assert_true(jnum(o, "grad_norm") > 0);
      assert_true(jnum(o, "step_time_ms") > 0);
      /* Wall-clock; the reducer's is an average over sampled iterations, so it is not
       * bounded by this window's step time. */
      assert_true(jnum(o, "comm_time_ms") >= 0);
      assert_true(jnum(o, "samples_per_s") > 0);
      assert_true(jnum(o, "overlap_ms") >= 0);
      /* No hook: every gradient byte goes over the wire once per step, uncompressed. */
      DDP_ASSERT_EQ(jnum(o, "comm_bytes"), (double)expect_grad_bytes);
      DDP_ASSERT_EQ(jnum(o, "compression_rate"), 1.0);
      logs++;
    }
    cJSON_Delete(o);
  }
  fclose(f);
  assert_int_equal(logs, 5); /* 5, 10, 15, 20, 23 */
  assert_int_equal(summaries, 1);
  snprintf(path, sizeof path, "%s/loss.svg", dir);
  f = fopen(path, "r");
  assert_non_null(f);
  assert_non_null(fgets(line, sizeof line, f));
  DDP_ASSERT_PREFIX(line, "<svg");
  fclose(f);
  free_run(r);
  rm_tree(dir);
}

/* The final parameter hash in a run's metrics.jsonl summary line. */
static void summary_hash(const char *dir, char *out, size_t cap) {
  char path[512], line[8192];
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  out[0] = 0;
  while (fgets(line, sizeof line, f)) {
    cJSON *o = cJSON_Parse(line);
    if (o && cJSON_GetObjectItem(o, "summary")) snprintf(out, cap, "%s", jstr(o, "param_hash"));
    cJSON_Delete(o);
  }
  fclose(f);
  assert_true(out[0] != 0);
}

/* Runs `cmd >log 2>&1`; when it does not exit 0, prints the log's last 8 KiB (the reason)
 * as a CMocka error and returns the status (-1 for a signal). */
static int run_logged(const char *cmd, const char *log) {
  char full[20000];
  snprintf(full, sizeof full, "%s >'%s' 2>&1", cmd, log);
  int rc = system(full);
  int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code != 0) {
    char tail[8192] = "";
    FILE *f = fopen(log, "r");
    if (f) {
      if (fseek(f, 0, SEEK_END) == 0 && ftell(f) > (long)sizeof tail - 1)
        fseek(f, -(long)(sizeof tail - 1), SEEK_END);
      else
        rewind(f);
      tail[fread(tail, 1, sizeof tail - 1, f)] = 0;
      fclose(f);
    }
    print_error("exit %d: %s\n--- its output (%s) ---\n%s\n---\n", code, cmd, log, tail);
  }
  return code;
}

/* True when the log says a port was taken (another job bound it between our probe and the
 * run's bind): the caller retries with a fresh port. */
static bool port_was_taken(const char *log) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "grep -q 'Address already in use' '%s'", log);
  int rc = system(cmd);
  return WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

/* Runs exe on `world` thread ranks with the flags `common` into a fresh directory, asserts
 * that it ends with the parameter hash of the run in dir (what names that run), and
 * removes both directories. */
static void expect_thread_hash(const char *exe, const char *world, const char *common,
                               const char *dir, const char *what) {
  char dt[256], cmd[16384], h[64], ht[64];
  make_dir(dt, sizeof dt, "thr");
  char log[300];
  snprintf(log, sizeof log, "%s.log", dt);
  ddp_test_remove_at_exit(log);
  snprintf(cmd, sizeof cmd, "'%s' --threads %s %s --output_dir '%s'", exe, world, common, dt);
  assert_int_equal(run_logged(cmd, log), 0);
  unlink(log);
  summary_hash(dir, h, sizeof h);
  summary_hash(dt, ht, sizeof ht);
  print_message("%s: %s, threads x%s: %s\n", what, h, world, ht);
  assert_string_equal(h, ht);
  rm_tree(dir);
  rm_tree(dt);
}

/* Acceptance: ranks as processes under ddprun (shm with 4, tcp with 2) end with parameters
 * bitwise equal to the same number of thread ranks. */
static void test_threads_vs_processes(void **state) {
  const char *build = getenv("DDP_BUILD_ROOT");
  assert_non_null(build);
  char ddprun[4096], exe[4096];
  snprintf(ddprun, sizeof ddprun, "%s/tools/ddprun", build);
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  struct {
    const char *backend, *world;
  } cases[] = {{"shm", "4"}, {"tcp", "2"}};
  for (size_t i = 0; i < 2; i++) {
    char dp[256], cmd[16384], what[64], log[300];
    make_dir(dp, sizeof dp, "proc");
    snprintf(log, sizeof log, "%s.log", dp);
    ddp_test_remove_at_exit(log);
    const char *common =
        "--max_steps 40 --logging_steps 10 --gradient_accumulation_steps 2 "
        "--learning_rate 1e-3 --save_strategy no --ddp_find_unused_parameters false";
    /* --standalone: ddprun reserves a port from the kernel before any rank starts. */
    snprintf(cmd, sizeof cmd,
             "'%s' --nproc_per_node %s --backend %s --standalone '%s' %s --output_dir '%s'", ddprun,
             cases[i].world, cases[i].backend, exe, common, dp);
    int rc = run_logged(cmd, log);
    if (rc != 0) fail_msg("ddprun run failed (exit %d; its output is above): %s", rc, cmd);
    unlink(log);
    snprintf(what, sizeof what, "%s processes x%s", cases[i].backend, cases[i].world);
    expect_thread_hash(exe, cases[i].world, common, dp, what);
  }
}

/* Plain Open MPI mpirun (OMPI_COMM_WORLD_* in the environment, no RANK) counts as a
 * launcher: 2 processes end with the parameter hash of 2 thread ranks. Skipped without
 * mpirun. MASTER_ADDR/PORT are set so that the run also works where the mpi backend was
 * not built (tcp then); the MPI library's own allocations are not leak-checked (as in
 * test_mpi). */
static void test_mpirun(void **state) {
  const char *build = getenv("DDP_BUILD_ROOT");
  assert_non_null(build);
  if (system("command -v mpirun >/dev/null 2>&1") != 0) {
    skip();
    return;
  }
  char exe[4096], dm[256], cmd[16384];
  snprintf(exe, sizeof exe, "%s/tools/ddp-train", build);
  make_dir(dm, sizeof dm, "mpi");
  const char *common = "--max_steps 20 --logging_steps 10 --learning_rate 1e-3 "
                       "--save_strategy no --ddp_find_unused_parameters false";
  char log[300];
  snprintf(log, sizeof log, "%s.log", dm);
  ddp_test_remove_at_exit(log);
  /* The store's port from the kernel; one taken before rank 0 binds it is retried. */
  int rc = -1;
  for (int attempt = 0; attempt < 3 && rc != 0; attempt++) {
    if (attempt > 0 && !port_was_taken(log)) break;
    snprintf(cmd, sizeof cmd,
             "env -u RANK -u WORLD_SIZE -u DDP_BACKEND MASTER_ADDR=127.0.0.1 MASTER_PORT=%d "
             "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" "
             "timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 '%s' %s "
             "--output_dir '%s'",
             ddp_test_free_port(), exe, common, dm);
    rc = run_logged(cmd, log);
  }
  if (rc != 0) fail_msg("mpirun ddp-train failed (exit %d; its output is above)", rc);
  unlink(log);
  expect_thread_hash(exe, "2", common, dm, "mpirun x2");
}

/* Runs ddp-train with args under a pseudo-terminal (util-linux script) or, pty false,
 * with stdout a pipe; returns the exit status and the output. */
static int run_tty(bool pty, const char *args, char *out, size_t cap) {
  const char *build = getenv("DDP_BUILD_ROOT");
  assert_non_null(build);
  char cmd[8192];
  if (pty) {
    snprintf(cmd, sizeof cmd, "script -qec \"'%s/tools/ddp-train' %s\" /dev/null </dev/null", build,
             args);
  } else {
    snprintf(cmd, sizeof cmd, "'%s/tools/ddp-train' %s </dev/null", build, args);
  }
  return shell_output(cmd, out, cap);
}

/* Rank 0's output: on a terminal a bar redrawn in place ("\r\033[K[###---] step/max loss L
 * lr LR N samples/s ETA m:ss") whose fields are checked here (the last bar: step 20 of 20,
 * the linear schedule's last lr recomputed), with the log lines above it; with stdout a
 * pipe, or --disable_tqdm on a terminal, plain log lines and no control sequence. */
static void test_progress_output(void **state) {
  if (system("command -v script >/dev/null 2>&1") != 0) {
    skip();
    return;
  }
  char dir[256], args[1024];
  static char out[262144];
  make_dir(dir, sizeof dir, "tty");
  snprintf(args, sizeof args,
           "--threads 2 --max_steps 20 --logging_steps 10 --learning_rate 1e-3 "
           "--save_strategy no --ddp_find_unused_parameters false --output_dir %s",
           dir);
  int rc = run_tty(true, args, out, sizeof out);
  if (rc != 0) fail_msg("ddp-train under a pty exited %d: %s", rc, out);
  int bars = 0;
  const char *last = NULL;
  for (const char *p = strstr(out, "\r\033[K["); p; p = strstr(p + 1, "\r\033[K[")) {
    bars++;
    last = p;
  }
  assert_true(bars >= 2);
  const char *fields = strstr(last, "] ");
  assert_non_null(fields);
  long step = 0, max = 0;
  double loss = 0, lr = 0, sps = 0;
  int mins = -1, secs = -1;
  int got = sscanf(fields, "] %ld/%ld loss %lf lr %lf %lf samples/s ETA %d:%d", &step, &max, &loss,
                   &lr, &sps, &mins, &secs);
  if (got != 7) fail_msg("bar fields not parsed (%d): %.200s", got, fields);
  assert_int_equal(step, 20);
  assert_int_equal(max, 20);
  assert_true(loss > 0 && loss < 10);
  double want_lr = 1e-3 * (20.0 - 19.0) / 20.0;      /* linear decay, the step's lr (0-based 19) */
  assert_true(fabs(lr - want_lr) <= 0.01 * want_lr); /* printed with 3 digits */
  assert_true(sps > 0);
  assert_int_equal(mins, 0);
  assert_in_range(secs, 0, 59);
  /* The log lines are printed above the bar (cleared first). */
  assert_non_null(strstr(out, "\r\033[Kstep     10/20"));

  const char *plain_args[2] = {args, NULL};
  char args2[1200];
  snprintf(args2, sizeof args2, "%s --disable_tqdm", args);
  plain_args[1] = args2;
  for (int k = 0; k < 2; k++) {
    rc = run_tty(k == 1, plain_args[k], out, sizeof out);
    if (rc != 0) fail_msg("ddp-train exited %d: %s", rc, out);
    assert_null(strstr(out, "\033["));
    assert_null(strstr(out, "[#"));
    assert_non_null(strstr(out, "step     10/20"));
    assert_non_null(strstr(out, "step     20/20"));
  }
  rm_tree(dir);
}

/* PyTorch oracle: tools/torch/torch_reference.py runs real DDP (gloo, 3 ranks) with AdamW, weight
 * decay, accumulation 2, clipping and each warmup schedule; ddp-train started from the
 * same weights with the same HF arguments dumps every step, and ddp-compare finds inputs,
 * averaged gradients and parameters within its default tolerance (rtol 1e-5, atol 1e-7). */
static void test_dump_vs_torch(void **state) {
  const char *py = ddp_test_python();
  const char *build = getenv("DDP_BUILD_ROOT"), *root = ddp_test_source_root();
  if (!py || !build || !root) {
    skip();
    return;
  }
  char dir[256], model[512], cmd[16384];
  make_dir(dir, sizeof dir, "dump");
  snprintf(model, sizeof model, "%s/model.json", dir);
  FILE *f = fopen(model, "w");
  assert_non_null(f);
  /* Without biases (or LayerNorms) every parameter is in HF's weight-decay group, which is
   * what torch_reference.py's single AdamW group decays. */
  fputs("{\"dtype\": \"f32\", \"layers\": ["
        "{\"type\": \"linear\", \"in\": 64, \"out\": 32, \"bias\": false},"
        "{\"type\": \"tanh\"},"
        "{\"type\": \"linear\", \"in\": 32, \"out\": 10, \"bias\": false}]}",
        f);
  fclose(f);
  /* Each of HF's schedules that ddp-train takes beyond linear's warmup and decay, with
   * get_scheduler's defaults (cosine_with_restarts' one cycle, polynomial's lr_end, the
   * inverse square root's timescale): the learning rate of every step feeds the
   * parameters ddp-compare holds against PyTorch's. */
  static const char *const schedules[][2] = {{"linear", ""},
                                             {"cosine_with_restarts", ""},
                                             {"cosine_with_restarts", "{\"num_cycles\": 2}"},
                                             {"polynomial", ""},
                                             {"polynomial", "{\"lr_end\": 1e-4, \"power\": 2.0}"},
                                             {"inverse_sqrt", ""},
                                             {"cosine_with_min_lr", "{\"min_lr\": 2e-4}"}};
  for (size_t k = 0; k < sizeof schedules / sizeof *schedules; k++) {
    char hf[512];
    snprintf(hf, sizeof hf,
             "--max_grad_norm 1.0 --lr_scheduler_type %s --lr_scheduler_kwargs '%s' "
             "--warmup_steps 2 --seed 3 --optim adamw --weight_decay 0.01 "
             "--gradient_accumulation_steps 2 --ddp_find_unused_parameters false",
             schedules[k][0], schedules[k][1]);
    print_message("lr_scheduler_type %s %s\n", schedules[k][0], schedules[k][1]);
    snprintf(cmd, sizeof cmd,
             "rm -rf '%s/torch' '%s/libddp' && OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 '%s' "
             "'%s/tools/torch/torch_reference.py' --model '%s' --dump_dir '%s/torch' --world 3 "
             "--steps 6 --batch 4 --lr 1e-3 %s >'%s/torch.log' 2>&1",
             dir, dir, py, root, model, dir, hf, dir);
    int rc = system(cmd);
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) {
      rm_tree(dir);
      skip();
      return;
    }
    if (!(WIFEXITED(rc) && WEXITSTATUS(rc) == 0)) {
      snprintf(cmd, sizeof cmd, "cat '%s/torch.log' >&2", dir);
      if (system(cmd) != 0) print_error("(no torch.log)\n");
      fail_msg("torch_reference.py failed (its output is above)");
    }
    snprintf(cmd, sizeof cmd,
             "'%s/tools/ddp-train' --threads 3 --model '%s' --init '%s/torch/weights.safetensors' "
             "--max_steps 6 --per_device_train_batch_size 4 --learning_rate 1e-3 %s --dump_dir "
             "'%s/libddp' --save_strategy no --output_dir '%s/out'",
             build, model, dir, hf, dir, dir);
    char log[700];
    snprintf(log, sizeof log, "%s/ddp-train.log", dir);
    assert_int_equal(run_logged(cmd, log), 0);
    snprintf(cmd, sizeof cmd, "'%s/tools/ddp-compare' '%s/torch' '%s/libddp'", build, dir, dir);
    rc = system(cmd);
    DDP_ASSERT_EXITED(rc, 0);
  }
  rm_tree(dir);
}

/* The replica check: one rank's perturbed weight is an error naming the diverged rank. */
typedef struct div_arg {
  ddp_status_t st[3];
  char msg[3][DDP_ERROR_MSG_MAX];
} div_arg_t;

static ddp_status_t diverge_fn(ddp_pg_t *pg, void *arg) {
  div_arg_t *d = arg;
  int rank = ddp_pg_rank(pg);
  ddp_model_t *m = NULL;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_model_from_json(mlp_json, &m, &err);
  if (st == DDP_OK) st = ddp_model_init(m, 7);
  if (st == DDP_OK) st = ddp__train_replica_check(pg, m, 3, NULL, &err);
  if (st == DDP_OK && rank == 1) ((float *)ddp_model_param(m, 0)->value.data)[5] += 1e-6f;
  if (st == DDP_OK) st = ddp__train_replica_check(pg, m, 4, NULL, &err);
  d->st[rank] = st;
  snprintf(d->msg[rank], sizeof d->msg[rank], "%s", err.msg);
  ddp_model_destroy(m);
  return DDP_OK;
}

static void test_replica_check(void **state) {
  div_arg_t d;
  memset(&d, 0, sizeof d);
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.timeout_ms = 30000;
  assert_int_equal(ddp_spawn_threads(3, &po, diverge_fn, &d), DDP_OK);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(d.st[r], DDP_ERR_INVALID_DATA);
    assert_non_null(strstr(d.msg[r], "step 4"));
    assert_non_null(strstr(d.msg[r], "ranks 0,2 hold"));
    assert_non_null(strstr(d.msg[r], "rank 1 holds"));
  }
}

static int setup(void **state) {
  const char *root = ddp_test_source_root();
  if (!root) return -1;
  snprintf(digits_path, sizeof digits_path, "%s/tests/data/digits.safetensors", root);
  return ddp_dataset_from_safetensors(digits_path, NULL, NULL, &digits, NULL) == DDP_OK ? 0 : -1;
}

static int teardown(void **state) {
  ddp_dataset_destroy(digits);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_flags_and_optim_args),
      cmocka_unit_test(test_hf_arguments),
      cmocka_unit_test(test_tool_parsing),
      cmocka_unit_test(test_tool_errors),
      cmocka_unit_test(test_loss_falls),
      cmocka_unit_test(test_equivalence),
      cmocka_unit_test(test_reducer_vs_flat),
      cmocka_unit_test(test_comm_hooks),
      cmocka_unit_test(test_split_and_eval),
      cmocka_unit_test(test_resume_bitwise),
      cmocka_unit_test(test_powersgd_resume),
      cmocka_unit_test(test_weight_decay_groups),
      cmocka_unit_test(test_kill_during_save),
      cmocka_unit_test(test_metrics),
      cmocka_unit_test(test_replica_check),
      cmocka_unit_test(test_threads_vs_processes),
      cmocka_unit_test(test_mpirun),
      cmocka_unit_test(test_progress_output),
      cmocka_unit_test(test_dump_vs_torch),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
