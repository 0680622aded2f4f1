/* PyTorch parity of the DDP reducer (issue 5, "PyTorch parity, in CI"), and the dump writer
 * (src/reducer/dump.c, docs/dumps.md).
 *
 * For each configuration, tools/torch_reference.py runs real PyTorch 1.13 DDP over gloo
 * (Debian's /usr/bin/python3) and writes dump A. Then libddp runs the same job in this
 * process with thread ranks: the same model file and the weights A recorded after DDP's
 * initial broadcast, the same samples (DistributedSampler with the same seed), the same
 * micro-batching, loss scaling, optimizer and DDP options, writing dump B with
 * ddp_dump_*. tools/ddp-compare must find every input, gradient, parameter and buffer of
 * every step and rank within its default tolerance (rtol 1e-5, atol 1e-7), and the
 * initial and rebuilt bucket layouts in both ddp.json files must be identical.
 *
 * Without torch the parity tests skip; test_dump_writer still checks the writer on its
 * own: the files and their order, metadata, ddp.json against the reducer, identical
 * averaged gradients and init tensors on every rank, and param_after = param_before -
 * lr * grad for plain SGD (the gradient is the one before the step). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp/data.h"
#include "ddp/io.h"
#include "ddp/optim.h"
#include "ddp/pg.h"
#include "ddp/reducer.h"
#include "common/common.h"
#include "harness.h"

#define MAXW 4

static char g_tmp[256];  /* this file's scratch directory */
static char g_tool[1024]; /* ddp-compare */
static char g_data[1024]; /* tests/data/digits.safetensors */
static const char *g_py;  /* /usr/bin/python3 when it imports torch (checked once: ~2 s) */

/* ---------------------------------------------------------------- configurations -- */

static const char *const MLP =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";
/* About 2.3 MiB of parameters: several 1 MiB buckets once rebuilt. */
static const char *const WIDE =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 512}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 512, \"out\": 512}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 512, \"out\": 512}, "
    "{\"type\": \"tanh\"}, {\"type\": \"linear\", \"in\": 512, \"out\": 10}]}";
/* A branch (flag bit 0) that only some ranks run: its parameters are unused there; and
 * one (flag bit 1) that no rank runs: globally unused, its gradient stays untouched. */
static const char *const BRANCH =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"relu\"}, {\"type\": \"branch\", \"flag\": 0, \"layers\": [{\"type\": "
    "\"linear\", \"in\": 32, \"out\": 32}, {\"type\": \"tanh\"}]}, "
    "{\"type\": \"branch\", \"flag\": 1, \"layers\": [{\"type\": \"linear\", \"in\": 32, "
    "\"out\": 32}]}, {\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";
static const char *const BN =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"batchnorm\", \"dim\": 32}, {\"type\": \"relu\"}, "
    "{\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

typedef struct pcfg {
  const char *name;
  const char *model;
  int world, steps, batch, accum;
  double lr, momentum;
  const char *flags;    /* per rank, cycled, as torch_reference.py --flags */
  double bucket_cap_mb; /* < 0: not given */
  bool find_unused, broadcast_buffers, static_graph, grad_as_bucket_view;
  bool rebuilt;         /* a rebuilt layout is expected */
} pcfg_t;

/* ---------------------------------------------------------------- helpers --------- */

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
  fclose(f);
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  buf[n] = 0;
  fclose(f);
  return buf;
}

static cJSON *read_json(const char *path) {
  char *t = read_text(path);
  if (!t) fail_msg("cannot read %s", path);
  cJSON *j = cJSON_Parse(t);
  free(t);
  if (!j) fail_msg("%s is not JSON", path);
  return j;
}

static const cJSON *get(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v) fail_msg("JSON has no \"%s\"", key);
  return v;
}

/* Runs a shell command, stdout into *out (malloc'd), stderr into g_tmp/stderr.txt. */
static int run(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run(char **out, const char *fmt, ...) {
  char cmd[4096], full[4400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  snprintf(full, sizeof full, "%s 2>%s/stderr.txt", cmd, g_tmp);
  FILE *p = popen(full, "r");
  assert_non_null(p);
  size_t len = 0, cap = 1 << 16;
  char *buf = malloc(cap);
  assert_non_null(buf);
  size_t n;
  while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
    len += n;
    if (cap - len < 2) {
      cap *= 2;
      buf = realloc(buf, cap);
      assert_non_null(buf);
    }
  }
  buf[len] = 0;
  int st = pclose(p);
  if (out)
    *out = buf;
  else
    free(buf);
  return (st != -1 && WIFEXITED(st)) ? WEXITSTATUS(st) : -1;
}

static void print_stderr(void) {
  char p[512];
  snprintf(p, sizeof p, "%s/stderr.txt", g_tmp);
  char *t = read_text(p);
  if (t) print_error("%s\n", t);
  free(t);
}

/* ---------------------------------------------------------------- the libddp run -- */

typedef struct job {
  const pcfg_t *cfg;
  const char *model_path; /* model JSON file */
  const char *init_path;  /* weights to start from; NULL = ddp_model_init(seed 7 + rank) */
  const char *dump_dir;
  const char *config_json;
  uint64_t seed;
  const ddp_dataset_t *ds;
  uint64_t flags[MAXW];
  char msg[MAXW][600];
} job_t;

/* One rank of the libddp side: what torch_reference.py's worker does, step for step. */
static ddp_status_t rank_main(ddp_pg_t *pg, void *arg) {
  job_t *job = arg;
  const pcfg_t *c = job->cfg;
  int r = ddp_pg_rank(pg), W = ddp_pg_size(pg);
  char *msg = job->msg[r];
  ddp_error_t err = {0};
  ddp_model_t *m = NULL;
  ddp_ddp_t *ddp = NULL;
  ddp_optim_t *opt = NULL;
  ddp_ctx_t *ctx = NULL;
  ddp_sampler_t *smp = NULL;
  ddp_loader_t *ld = NULL;
  ddp_dump_t *d = NULL;
  ddp_status_t st = ddp_model_from_json_file(job->model_path, &m, &err);
  if (st != DDP_OK) {
    snprintf(msg, 600, "model: %s", err.msg);
    goto out;
  }
  st = job->init_path ? ddp_model_load(m, job->init_path, true, NULL, NULL, &err)
                      : ddp_model_init(m, 7 + (uint64_t)r);
  if (st != DDP_OK) {
    snprintf(msg, 600, "weights: %s", err.msg);
    goto out;
  }
  ddp_ddp_options_t o = DDP_DDP_OPTIONS_INIT;
  o.find_unused_parameters = c->find_unused;
  o.broadcast_buffers = c->broadcast_buffers;
  o.static_graph = c->static_graph;
  o.gradient_as_bucket_view = c->grad_as_bucket_view;
  if (c->bucket_cap_mb >= 0) {
    /* PyTorch 1.13 keeps the 1 MiB first bucket with an explicit cap (docs/ddp.md). */
    o.bucket_cap_mb = c->bucket_cap_mb;
    o.first_bucket_bytes = DDP_DEFAULT_FIRST_BUCKET_BYTES;
  }
  st = ddp_ddp_create(m, pg, &o, &ddp, &err);
  if (st != DDP_OK) {
    snprintf(msg, 600, "ddp create: %s", err.msg);
    goto out;
  }
  ddp_dump_options_t dopt = DDP_DUMP_OPTIONS_INIT;
  dopt.steps = c->steps;
  dopt.producer_version = "libddp (test_ddp_parity)";
  dopt.config_json = job->config_json;
  dopt.model_json = c->model;
  st = ddp_dump_open(job->dump_dir, r, W, &dopt, &d, &err);
  if (st != DDP_OK) {
    snprintf(msg, 600, "dump open: %s", err.msg);
    goto out;
  }
  st = ddp_dump_init(d, m, ddp);
  if (st != DDP_OK) {
    snprintf(msg, 600, "dump init: %s", ddp_dump_last_error(d));
    goto out;
  }
  ddp_optim_param_t ps[64];
  size_t np = 0;
  for (size_t i = 0; i < ddp_model_num_params(m) && np < 64; i++) {
    ddp_param_t *p = ddp_model_param(m, i);
    if (!p->requires_grad) continue;
    ps[np].param = &p->value;
    ps[np].grad = &p->grad;
    np++;
  }
  ddp_optim_options_t sgd = DDP_SGD_OPTIONS_INIT;
  sgd.lr = c->lr;
  sgd.momentum = c->momentum;
  DDP_CHECK_GOTO(ddp_optim_create(&sgd, ps, np, &opt, &err), st, out);
  ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
  so.dataset_len = ddp_dataset_length(job->ds);
  so.num_replicas = W;
  so.rank = r;
  so.shuffle = true;
  so.seed = job->seed; /* data_seed defaults to seed, as in Hugging Face */
  DDP_CHECK_GOTO(ddp_sampler_create(&so, &smp, &err), st, out);
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = c->batch;
  DDP_CHECK_GOTO(ddp_loader_create(job->ds, smp, &lo, &ld, &err), st, out);
  DDP_CHECK_GOTO(ddp_ctx_create(&ctx), st, out);
  uint64_t flags = job->flags[r];
  for (int step = 0; step < c->steps; step++) {
    double total = 0;
    for (int a = 0; a < c->accum; a++) {
      ddp_batch_t b;
      bool has = false;
      st = ddp_loader_next(ld, &b, &has, &err);
      if (st == DDP_OK && !has) st = DDP_ERR_INVALID_ARGUMENT; /* the test stays in epoch 0 */
      if (st != DDP_OK) {
        snprintf(msg, 600, "loader at step %d: %s", step, err.msg);
        goto out;
      }
      DDP_CHECK_GOTO(ddp_dump_input(d, &b.features, &b.labels, b.indices), st, out);
      bool old = ddp_ddp_set_sync(ddp, a == c->accum - 1); /* no_sync but for the last */
      ddp_var_t *vx, *vy, *out, *loss;
      st = ddp_var_new(ctx, b.features.dtype, b.features.ndim, b.features.shape,
                       b.features.data, false, &vx);
      if (st == DDP_OK)
        st = ddp_var_new(ctx, b.labels.dtype, b.labels.ndim, b.labels.shape, b.labels.data,
                         false, &vy);
      if (st == DDP_OK) st = ddp_ddp_forward(ddp, ctx, vx, flags, &out);
      if (st == DDP_OK) st = ddp_cross_entropy(ctx, out, vy, -100, &loss);
      if (st == DDP_OK && c->accum > 1) {
        /* Hugging Face's loss / gradient_accumulation_steps; for a power of two the
         * product by the reciprocal is the quotient, bit for bit. */
        float inv = 1.0f / (float)c->accum;
        ddp_var_t *s;
        st = ddp_var_new(ctx, DDP_F32, loss->value.ndim, loss->value.shape, &inv, false, &s);
        if (st == DDP_OK) st = ddp_mul(ctx, loss, s, &loss);
      }
      if (st == DDP_OK) {
        total += (double)*(const float *)loss->value.data;
        st = ddp_ddp_backward(ddp, ctx, loss);
      }
      ddp_ddp_set_sync(ddp, old);
      if (st != DDP_OK) {
        snprintf(msg, 600, "step %d micro-batch %d: %s | %s", step, a, ddp_ddp_last_error(ddp),
                 ddp_ctx_last_error(ctx)->msg);
        goto out;
      }
      ddp_ctx_reset(ctx);
    }
    DDP_CHECK_GOTO(ddp_dump_grads(d), st, out);
    DDP_CHECK_GOTO(ddp_optim_step(opt, &err), st, out);
    ddp_optim_zero_grad(opt, false);
    st = ddp_dump_step(d, step, total, c->accum, flags);
    if (st != DDP_OK) {
      snprintf(msg, 600, "dump step %d: %s", step, ddp_dump_last_error(d));
      goto out;
    }
  }
  st = ddp_dump_finish(d);
  if (st != DDP_OK) snprintf(msg, 600, "dump finish: %s", ddp_dump_last_error(d));
out:
  if (st != DDP_OK && !msg[0]) snprintf(msg, 600, "%s: %s", ddp_status_name(st), err.msg);
  ddp_dump_close(d);
  ddp_ctx_destroy(ctx);
  ddp_loader_destroy(ld);
  ddp_sampler_destroy(smp);
  ddp_optim_destroy(opt);
  ddp_ddp_destroy(ddp);
  ddp_model_destroy(m);
  return st;
}

static void parse_flags(const char *text, int world, uint64_t *out) {
  uint64_t v[MAXW];
  int n = 0;
  const char *p = text;
  while (*p && n < MAXW) {
    char *end;
    v[n++] = strtoull(p, &end, 0);
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  assert_true(n > 0);
  for (int r = 0; r < world; r++) out[r] = v[r % n];
}

static void run_libddp(job_t *job) {
  ddp_dataset_t *ds = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_safetensors(g_data, NULL, NULL, &ds, &err), DDP_OK);
  job->ds = ds;
  parse_flags(job->cfg->flags ? job->cfg->flags : "0", job->cfg->world, job->flags);
  memset(job->msg, 0, sizeof job->msg);
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.timeout_ms = 30000;
  ddp_status_t st = ddp_spawn_threads(job->cfg->world, &po, rank_main, job);
  ddp_dataset_destroy(ds);
  if (st != DDP_OK) {
    for (int r = 0; r < job->cfg->world; r++)
      print_error("rank %d: %s\n", r, job->msg[r]);
    fail_msg("%s: the libddp run failed: %s", job->cfg->name, ddp_status_name(st));
  }
}

/* ---------------------------------------------------------------- parity ---------- */

static bool torch_ok(void) {
  return g_py && access(g_tool, X_OK) == 0;
}

/* torch_reference.py for cfg into dir A; libddp into B; ddp-compare; layouts. */
static void parity(const pcfg_t *c) {
  if (!torch_ok()) {
    print_message("torch (under /usr/bin/python3) or ddp-compare absent: skipped\n");
    skip();
  }
  char base[512], model[600], A[600], B[600], weights[700];
  snprintf(base, sizeof base, "%s/%s", g_tmp, c->name);
  assert_int_equal(mkdir(base, 0755), 0);
  snprintf(model, sizeof model, "%s/model.json", base);
  snprintf(A, sizeof A, "%s/torch", base);
  snprintf(B, sizeof B, "%s/libddp", base);
  snprintf(weights, sizeof weights, "%s/weights.safetensors", A);
  write_text(model, c->model);
  const uint64_t seed = 1234;
  char cap[64] = "";
  if (c->bucket_cap_mb >= 0) snprintf(cap, sizeof cap, "--bucket_cap_mb %g", c->bucket_cap_mb);
  char *out = NULL;
  int rc = run(&out,
               "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s/tools/torch_reference.py "
               "--model '%s' --dump_dir '%s' --data '%s' --world %d --steps %d --batch %d "
               "--gradient_accumulation_steps %d --lr %.17g --momentum %.17g --optim sgd "
               "--seed %llu --shuffle true --flags %s %s --find_unused_parameters %s "
               "--broadcast_buffers %s --static_graph %s --gradient_as_bucket_view %s "
               "--timeout 60",
               g_py, ddp_test_source_root(), model, A, g_data, c->world, c->steps,
               c->batch, c->accum, c->lr, c->momentum, (unsigned long long)seed,
               c->flags ? c->flags : "0", cap, c->find_unused ? "true" : "false",
               c->broadcast_buffers ? "true" : "false", c->static_graph ? "true" : "false",
               c->grad_as_bucket_view ? "true" : "false");
  if (rc != 0) {
    print_stderr();
    fail_msg("%s: torch_reference.py exited %d: %s", c->name, rc, out);
  }
  free(out);

  /* The libddp side: A's weights after the broadcast, the same options. */
  char cfgjson[512];
  snprintf(cfgjson, sizeof cfgjson,
           "{\"world\": %d, \"steps\": %d, \"batch\": %d, \"lr\": %.17g, \"momentum\": %.17g, "
           "\"optim\": \"sgd\", \"seed\": %llu, \"gradient_accumulation_steps\": %d, "
           "\"find_unused_parameters\": %s, \"broadcast_buffers\": %s, \"static_graph\": %s}",
           c->world, c->steps, c->batch, c->lr, c->momentum, (unsigned long long)seed, c->accum,
           c->find_unused ? "true" : "false", c->broadcast_buffers ? "true" : "false",
           c->static_graph ? "true" : "false");
  job_t job = {.cfg = c, .model_path = model, .init_path = weights, .dump_dir = B,
               .config_json = cfgjson, .seed = seed};
  run_libddp(&job);

  rc = run(&out, "%s --json '%s' '%s'", g_tool, A, B);
  cJSON *j = cJSON_Parse(out);
  if (!j) fail_msg("%s: ddp-compare printed no JSON (exit %d): %s", c->name, rc, out);
  free(out);
  double gabs = 0, grel = 0, pabs = 0, prel = 0, babs = 0, brel = 0;
  const cJSON *t;
  cJSON_ArrayForEach(t, get(j, "tensors")) {
    const char *nm = get(t, "name")->valuestring;
    double a = get(t, "max_abs")->valuedouble, r = get(t, "max_rel")->valuedouble;
    double *pa = strncmp(nm, "grad.", 5) == 0    ? &gabs
                 : strncmp(nm, "param.", 6) == 0 ? &pabs
                 : strncmp(nm, "buffer.", 7) == 0 ? &babs
                                                 : NULL;
    if (!pa) continue;
    double *pr = pa == &gabs ? &grel : pa == &pabs ? &prel : &brel;
    if (a > *pa) *pa = a;
    if (r > *pr) *pr = r;
  }
  print_message("%-18s W=%d steps=%d: grads max abs %.3g rel %.3g; params max abs %.3g rel "
                "%.3g; buffers max abs %.3g rel %.3g\n",
                c->name, c->world, c->steps, gabs, grel, pabs, prel, babs, brel);
  if (rc != 0) {
    char *s = cJSON_PrintUnformatted(get(j, "first_failure"));
    print_error("%s: first failure %s; layouts differ: %s\n", c->name, s,
                cJSON_IsTrue(get(j, "layouts_differ")) ? "yes" : "no");
    free(s);
  }
  assert_int_equal(rc, 0);
  assert_int_equal(get(j, "steps_compared")->valueint, c->steps);
  cJSON_Delete(j);

  /* Bucket layouts, read directly (ddp-compare calls null on both sides "unavailable"):
   * initial and rebuilt identical on every rank, and a rebuild exactly when expected. */
  for (int r = 0; r < c->world; r++) {
    char pa[700], pb[700];
    snprintf(pa, sizeof pa, "%s/rank%d/ddp.json", A, r);
    snprintf(pb, sizeof pb, "%s/rank%d/ddp.json", B, r);
    cJSON *ja = read_json(pa), *jb = read_json(pb);
    const cJSON *la = get(ja, "bucket_layouts"), *lb = get(jb, "bucket_layouts");
    char *sa = cJSON_PrintUnformatted(la), *sb = cJSON_PrintUnformatted(lb);
    if (r == 0) print_message("%-18s layouts: torch %s, libddp %s\n", c->name, sa, sb);
    if (!cJSON_Compare(la, lb, true)) fail_msg("%s rank %d: layouts differ", c->name, r);
    free(sa);
    free(sb);
    assert_true(cJSON_IsArray(get(la, "initial")));
    assert_int_equal(cJSON_IsArray(get(la, "rebuilt")), c->rebuilt);
    assert_true(cJSON_IsTrue(get(ja, "initial_layout_verified")));
    assert_true(cJSON_IsTrue(get(jb, "initial_layout_verified")));
    assert_true(cJSON_Compare(get(ja, "param_names"), get(jb, "param_names"), true));
    assert_true(cJSON_Compare(get(ja, "bucket_sizes"), get(jb, "bucket_sizes"), true));
    cJSON_Delete(ja);
    cJSON_Delete(jb);
  }
}

static void test_parity_defaults(void **state) {
  (void)state;
  pcfg_t c = {.name = "defaults", .model = MLP, .world = 2, .steps = 6, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .rebuilt = true};
  parity(&c);
}

/* Beyond the list: .grad as a view into the bucket (divided in place by W). */
static void test_parity_grad_as_bucket_view(void **state) {
  (void)state;
  pcfg_t c = {.name = "grad_bucket_view", .model = MLP, .world = 2, .steps = 4, .batch = 8,
              .accum = 2, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .grad_as_bucket_view = true, .rebuilt = true};
  parity(&c);
}

static void test_parity_defaults_w3(void **state) {
  (void)state;
  pcfg_t c = {.name = "defaults_w3", .model = MLP, .world = 3, .steps = 4, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .rebuilt = true};
  parity(&c);
}

static void test_parity_bucket_cap_1(void **state) {
  (void)state;
  pcfg_t c = {.name = "bucket_cap_mb_1", .model = WIDE, .world = 2, .steps = 4, .batch = 8,
              .accum = 1, .lr = 0.05, .momentum = 0.9, .bucket_cap_mb = 1,
              .broadcast_buffers = true, .rebuilt = true};
  parity(&c);
}

static void test_parity_find_unused(void **state) {
  (void)state;
  pcfg_t c = {.name = "find_unused", .model = BRANCH, .world = 2, .steps = 6, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .flags = "1,0", .bucket_cap_mb = -1,
              .find_unused = true, .broadcast_buffers = true, .rebuilt = false};
  parity(&c);
}

/* Under find_unused the initial layout has several buckets too: limits [1 MiB, cap]. */
static void test_parity_bucket_cap_1_find_unused(void **state) {
  (void)state;
  pcfg_t c = {.name = "bucket_cap_1_unused", .model = WIDE, .world = 2, .steps = 3, .batch = 8,
              .accum = 1, .lr = 0.05, .momentum = 0.9, .bucket_cap_mb = 1,
              .find_unused = true, .broadcast_buffers = true, .rebuilt = false};
  parity(&c);
}

static void test_parity_grad_accum(void **state) {
  (void)state;
  pcfg_t c = {.name = "grad_accum_4", .model = MLP, .world = 2, .steps = 4, .batch = 8,
              .accum = 4, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .rebuilt = true};
  parity(&c);
}

static void test_parity_batchnorm_broadcast(void **state) {
  (void)state;
  pcfg_t c = {.name = "batchnorm_bb_on", .model = BN, .world = 2, .steps = 6, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .rebuilt = true};
  parity(&c);
}

static void test_parity_batchnorm_no_broadcast(void **state) {
  (void)state;
  pcfg_t c = {.name = "batchnorm_bb_off", .model = BN, .world = 2, .steps = 6, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = false, .rebuilt = true};
  parity(&c);
}

static void test_parity_static_graph(void **state) {
  (void)state;
  pcfg_t c = {.name = "static_graph", .model = MLP, .world = 2, .steps = 6, .batch = 8,
              .accum = 1, .lr = 0.1, .momentum = 0.9, .bucket_cap_mb = -1,
              .broadcast_buffers = true, .static_graph = true, .rebuilt = true};
  parity(&c);
}

/* ---------------------------------------------------------------- the writer ------ */

static void load_st(const char *path, ddp_st_file_t **f) {
  ddp_error_t err = {0};
  if (ddp_st_open(path, DDP_ST_READ, f, &err) != DDP_OK) fail_msg("%s: %s", path, err.msg);
}

static const float *tensor_f32(ddp_st_file_t *f, const char *name, int64_t *numel) {
  size_t i;
  ddp_tensor_t t;
  if (ddp_st_find(f, name, &i) != DDP_OK) fail_msg("no tensor %s", name);
  assert_int_equal(ddp_st_tensor(f, i, &t), DDP_OK);
  assert_int_equal(t.dtype, DDP_F32);
  *numel = t.numel;
  return t.data;
}

/* The writer without torch: W = 2 over plain SGD, each rank starting from its own weights
 * (the construction broadcast makes them equal). */
static void test_dump_writer(void **state) {
  (void)state;
  char base[512], model[600], B[600];
  snprintf(base, sizeof base, "%s/writer", g_tmp);
  assert_int_equal(mkdir(base, 0755), 0);
  snprintf(model, sizeof model, "%s/model.json", base);
  snprintf(B, sizeof B, "%s/dump", base);
  write_text(model, BN);
  const double lr = 0.25;
  pcfg_t c = {.name = "writer", .model = BN, .world = 2, .steps = 3, .batch = 6, .accum = 2,
              .lr = lr, .momentum = 0, .flags = "5", .bucket_cap_mb = -1,
              .broadcast_buffers = true};
  job_t job = {.cfg = &c, .model_path = model, .dump_dir = B, .config_json = "{\"lr\": 0.25}",
               .seed = 3};
  run_libddp(&job);

  char p[800];
  snprintf(p, sizeof p, "%s/meta.json", B);
  cJSON *meta = read_json(p);
  assert_string_equal(get(meta, "format")->valuestring, "libddp-dump-1");
  assert_string_equal(get(meta, "producer")->valuestring, "libddp");
  assert_int_equal(get(meta, "world_size")->valueint, 2);
  assert_int_equal(get(meta, "steps")->valueint, 3);
  assert_true(get(get(meta, "config"), "lr")->valuedouble == lr);
  assert_int_equal(cJSON_GetArraySize(get(get(meta, "model"), "layers")), 4);
  cJSON_Delete(meta);

  /* The names in docs/dumps.md's order, as the model lists them. */
  ddp_model_t *m = NULL;
  assert_int_equal(ddp_model_from_json(BN, &m, NULL), DDP_OK);
  size_t np = ddp_model_num_params(m), nb = ddp_model_num_buffers(m);
  ddp_st_file_t *f0[3], *f1[3], *i0, *i1;
  snprintf(p, sizeof p, "%s/rank0/init.safetensors", B);
  load_st(p, &i0);
  snprintf(p, sizeof p, "%s/rank1/init.safetensors", B);
  load_st(p, &i1);
  assert_int_equal(ddp_st_count(i0), np + nb);
  assert_string_equal(ddp_st_meta_get(i0, "producer"), "libddp");
  assert_string_equal(ddp_st_meta_get(i1, "rank"), "1");
  for (size_t i = 0; i < np + nb; i++) {
    char want[256];
    snprintf(want, sizeof want, "%s%s", i < np ? "param." : "buffer.",
             i < np ? ddp_model_param(m, i)->name : ddp_model_buffer(m, i - np)->name);
    assert_string_equal(ddp_st_name(i0, i), want);
    ddp_tensor_t a, b;
    assert_int_equal(ddp_st_tensor(i0, i, &a), DDP_OK);
    assert_int_equal(ddp_st_tensor(i1, i, &b), DDP_OK);
    assert_memory_equal(a.data, b.data, ddp_tensor_nbytes(&a)); /* after the broadcast */
  }
  for (int s = 0; s < 3; s++) {
    snprintf(p, sizeof p, "%s/rank0/step%06d.safetensors", B, s);
    load_st(p, &f0[s]);
    snprintf(p, sizeof p, "%s/rank1/step%06d.safetensors", B, s);
    load_st(p, &f1[s]);
    assert_int_equal(ddp_st_count(f0[s]), 3 + 2 * np + nb);
    assert_string_equal(ddp_st_name(f0[s], 0), "input.x");
    assert_string_equal(ddp_st_name(f0[s], 1), "input.y");
    assert_string_equal(ddp_st_name(f0[s], 2), "input.index");
    for (size_t i = 0; i < np; i++) {
      char want[256];
      snprintf(want, sizeof want, "grad.%s", ddp_model_param(m, i)->name);
      assert_string_equal(ddp_st_name(f0[s], 3 + i), want);
      snprintf(want, sizeof want, "param.%s", ddp_model_param(m, i)->name);
      assert_string_equal(ddp_st_name(f0[s], 3 + np + i), want);
    }
    for (size_t i = 0; i < nb; i++) {
      char want[256];
      snprintf(want, sizeof want, "buffer.%s", ddp_model_buffer(m, i)->name);
      assert_string_equal(ddp_st_name(f0[s], 3 + 2 * np + i), want);
    }
    char sv[8];
    snprintf(sv, sizeof sv, "%d", s);
    assert_string_equal(ddp_st_meta_get(f0[s], "step"), sv);
    assert_string_equal(ddp_st_meta_get(f1[s], "rank"), "1");
    assert_string_equal(ddp_st_meta_get(f0[s], "micro_batches"), "2");
    assert_string_equal(ddp_st_meta_get(f0[s], "flags"), "5");
    assert_string_equal(ddp_st_meta_get(f0[s], "grads_none"), "");
    assert_true(isfinite(strtod(ddp_st_meta_get(f0[s], "loss"), NULL)));
    /* Two micro-batches of 6 rows each, concatenated; the indices are the sampler's. */
    ddp_tensor_t x, y, ix;
    assert_int_equal(ddp_st_tensor(f0[s], 0, &x), DDP_OK);
    assert_int_equal(ddp_st_tensor(f0[s], 1, &y), DDP_OK);
    assert_int_equal(ddp_st_tensor(f0[s], 2, &ix), DDP_OK);
    assert_int_equal(x.shape[0], 12);
    assert_int_equal(x.shape[1], 64);
    assert_int_equal(y.dtype, DDP_I64);
    assert_int_equal(ix.dtype, DDP_I64);
    assert_int_equal(ix.numel, 12);
    ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
    so.dataset_len = 1797;
    so.num_replicas = 2;
    so.seed = 3;
    ddp_sampler_t *smp;
    assert_int_equal(ddp_sampler_create(&so, &smp, NULL), DDP_OK);
    const int64_t *want;
    int64_t nw;
    assert_int_equal(ddp_sampler_indices(smp, &want, &nw), DDP_OK);
    assert_memory_equal(ix.data, want + 12 * s, 12 * sizeof(int64_t));
    ddp_sampler_destroy(smp);
    /* Averaged gradients equal on both ranks; params after = before - lr * grad. */
    for (size_t i = 0; i < np; i++) {
      const char *nm = ddp_model_param(m, i)->name;
      char gn[256], pn[256];
      snprintf(gn, sizeof gn, "grad.%s", nm);
      snprintf(pn, sizeof pn, "param.%s", nm);
      int64_t n0, n1, nbf, naf;
      const float *g0 = tensor_f32(f0[s], gn, &n0), *g1 = tensor_f32(f1[s], gn, &n1);
      assert_int_equal(n0, n1);
      assert_memory_equal(g0, g1, (size_t)n0 * 4);
      const float *before = tensor_f32(s ? f0[s - 1] : i0, pn, &nbf);
      const float *after = tensor_f32(f0[s], pn, &naf);
      assert_int_equal(nbf, naf);
      double nz = 0;
      for (int64_t k = 0; k < n0; k++) {
        float want_p = before[k] - (float)lr * g0[k];
        if (fabsf(after[k] - want_p) > 1e-6f * fmaxf(1.0f, fabsf(want_p)))
          fail_msg("step %d %s[%lld]: %g, want %g - %g * %g", s, nm, (long long)k,
                   (double)after[k], (double)before[k], lr, (double)g0[k]);
        nz += fabs((double)g0[k]);
      }
      assert_true(nz > 0); /* the gradient is a real one */
    }
  }
  for (int s = 0; s < 3; s++) {
    ddp_st_close(f0[s]);
    ddp_st_close(f1[s]);
  }
  ddp_st_close(i0);
  ddp_st_close(i1);

  /* ddp.json: the lists and the layouts as the reducer reports them. */
  snprintf(p, sizeof p, "%s/rank1/ddp.json", B);
  cJSON *dj = read_json(p);
  const cJSON *pn = get(dj, "param_names");
  assert_int_equal(cJSON_GetArraySize(pn), np);
  for (size_t i = 0; i < np; i++)
    assert_string_equal(cJSON_GetArrayItem(pn, (int)i)->valuestring,
                        ddp_model_param(m, i)->name);
  assert_int_equal(cJSON_GetArraySize(get(dj, "buffer_names")), nb);
  const cJSON *init = get(get(dj, "bucket_layouts"), "initial");
  assert_int_equal(cJSON_GetArraySize(init), 1); /* one bucket at construction */
  assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(init, 0)), np);
  const cJSON *reb = get(get(dj, "bucket_layouts"), "rebuilt");
  assert_true(cJSON_IsArray(reb));
  assert_true(cJSON_IsTrue(get(dj, "initial_layout_verified")));
  assert_true(cJSON_IsNull(get(get(dj, "bucket_size_limits"), "initial")));
  const cJSON *ld = get(dj, "logging_data");
  assert_int_equal(get(ld, "world_size")->valueint, 2);
  assert_int_equal(get(ld, "rank")->valueint, 1);
  assert_int_equal(get(ld, "has_rebuilt_buckets")->valueint, 1);
  /* The rebuilt layout read back from its string form equals the array. */
  const char *s = get(ld, "rebuilt_per_bucket_param_indices")->valuestring;
  const cJSON *bk;
  cJSON_ArrayForEach(bk, reb) {
    const cJSON *ixj;
    cJSON_ArrayForEach(ixj, bk) {
      char *end;
      long v = strtol(s, &end, 10);
      assert_true(end != s);
      assert_int_equal(v, ixj->valueint);
      s = end;
      while (*s == ',' || *s == ' ') s++;
    }
  }
  assert_int_equal(*s, 0);
  cJSON_Delete(dj);
  ddp_model_destroy(m);

  /* A dump compares equal with itself through ddp-compare (when it is built). */
  if (access(g_tool, X_OK) == 0) {
    char *out = NULL;
    assert_int_equal(run(&out, "%s '%s' '%s'", g_tool, B, B), 0);
    free(out);
  }
}

/* Usage errors come back as statuses with a message. */
static void test_dump_errors(void **state) {
  (void)state;
  char dir[600];
  snprintf(dir, sizeof dir, "%s/errors", g_tmp);
  ddp_dump_t *d = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dump_open(dir, 2, 2, NULL, &d, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_null(d);
  ddp_dump_options_t o = DDP_DUMP_OPTIONS_INIT;
  o.config_json = "[1, 2]";
  assert_int_equal(ddp_dump_open(dir, 0, 1, &o, &d, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "config_json"));
  char file[700];
  snprintf(file, sizeof file, "%s/plain", g_tmp);
  write_text(file, "x");
  assert_int_equal(ddp_dump_open(file, 0, 1, NULL, &d, &err), DDP_ERR_SYSTEM);
  assert_non_null(strstr(err.msg, "mkdir"));
  assert_int_equal(ddp_dump_open(dir, 0, 1, NULL, &d, &err), DDP_OK);
  ddp_model_t *m = NULL;
  assert_int_equal(ddp_model_from_json(MLP, &m, NULL), DDP_OK);
  assert_int_equal(ddp_dump_init(d, m, NULL), DDP_OK);
  assert_int_equal(ddp_dump_step(d, 0, 0.0, 1, 0), DDP_ERR_INVALID_USAGE);
  assert_non_null(strstr(ddp_dump_last_error(d), "ddp_dump_grads"));
  ddp_tensor_t x, y;
  int64_t xs[2] = {2, 3}, ys[1] = {3};
  assert_int_equal(ddp_tensor_alloc(&x, DDP_F32, 2, xs), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&y, DDP_I64, 1, ys), DDP_OK);
  assert_int_equal(ddp_dump_input(d, &x, &y, NULL), DDP_ERR_INVALID_ARGUMENT);
  ddp_tensor_free(&x);
  ddp_tensor_free(&y);
  /* No reducer: no ddp.json, and the step count in meta.json follows what was written. */
  assert_int_equal(ddp_dump_grads(d), DDP_OK);
  assert_int_equal(ddp_dump_step(d, 0, 1.5, 1, 0), DDP_OK);
  assert_int_equal(ddp_dump_finish(d), DDP_OK);
  ddp_dump_close(d);
  ddp_model_destroy(m);
  char p[800];
  snprintf(p, sizeof p, "%s/rank0/ddp.json", dir);
  assert_int_not_equal(access(p, F_OK), 0);
  snprintf(p, sizeof p, "%s/meta.json", dir);
  cJSON *meta = read_json(p);
  assert_int_equal(get(meta, "steps")->valueint, 1);
  cJSON_Delete(meta);
}

/* ---------------------------------------------------------------- setup ----------- */

static int setup(void **state) {
  (void)state;
  const char *build = getenv("DDP_BUILD_ROOT");
  snprintf(g_tool, sizeof g_tool, "%s/tools/ddp-compare", build ? build : ".");
  const char *src = ddp_test_source_root();
  if (!src) return 1;
  snprintf(g_data, sizeof g_data, "%s/tests/data/digits.safetensors", src);
  snprintf(g_tmp, sizeof g_tmp, "/tmp/ddp_parity_XXXXXX");
  if (!mkdtemp(g_tmp)) return 1;
  g_py = ddp_test_python();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_tmp[0] && !getenv("DDP_PARITY_KEEP")) {
    char line[512];
    snprintf(line, sizeof line, "rm -rf '%s'", g_tmp);
    if (system(line) != 0) return 1;
  }
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dump_errors),
      cmocka_unit_test(test_dump_writer),
      cmocka_unit_test(test_parity_defaults),
      cmocka_unit_test(test_parity_bucket_cap_1),
      cmocka_unit_test(test_parity_find_unused),
      cmocka_unit_test(test_parity_bucket_cap_1_find_unused),
      cmocka_unit_test(test_parity_grad_accum),
      cmocka_unit_test(test_parity_batchnorm_broadcast),
      cmocka_unit_test(test_parity_batchnorm_no_broadcast),
      cmocka_unit_test(test_parity_static_graph),
      cmocka_unit_test(test_parity_grad_as_bucket_view),
      cmocka_unit_test(test_parity_defaults_w3),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
