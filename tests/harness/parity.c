/* The PyTorch parity driver (parity.h): torch_reference.py, the same job in libddp on
 * thread ranks with the dump writer, ddp-compare, and the layout checks. Moved here from
 * tests/test_ddp_parity.c so that tests/test_hooks_parity.c runs the same libddp side; its
 * file, JSON, command and scratch-directory helpers also serve tests/test_compare.c. */
#include "parity.h"

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

#include "ddp/data.h"
#include "ddp/io.h"
#include "ddp/optim.h"
#include "ddp/pg.h"
#include "ddp/reducer.h"
#include "common/common.h"
#include "harness.h"
#include "proc.h"

static char g_scratch[256]; /* the caller's scratch directory */
static char g_tool[1024];   /* ddp-compare */
static char g_data[1024];   /* tests/data/digits.safetensors */
static const char *g_py;    /* /usr/bin/python3 when it imports torch */

bool ddp_test_parity_init(const char *scratch_dir) {
  const char *build = getenv("DDP_BUILD_ROOT");
  snprintf(g_tool, sizeof g_tool, "%s/tools/ddp-compare", build ? build : ".");
  snprintf(g_scratch, sizeof g_scratch, "%s", scratch_dir);
  const char *src = ddp_test_source_root();
  if (!src) return false;
  snprintf(g_data, sizeof g_data, "%s/tests/data/digits.safetensors", src);
  g_py = ddp_test_python();
  return true;
}

static const char *g_group; /* ddp_test_parity_main's name for the scratch directory */

/* CMocka group setup and teardown of a parity test file: the scratch directory. */
static int group_setup(void **state) {
  (void)state;
  char dir[sizeof g_scratch];
  if (!ddp_test_make_scratch(dir, sizeof dir, g_group)) return 1;
  return ddp_test_parity_init(dir) ? 0 : 1;
}

static int group_teardown(void **state) {
  (void)state;
  return ddp_test_remove_scratch(g_scratch, true);
}

int ddp_test_parity_main(const char *name, const struct CMUnitTest *tests, size_t n) {
  g_group = name;
  return _cmocka_run_group_tests("tests", tests, n, group_setup, group_teardown);
}

const char *ddp_test_parity_scratch(void) { return g_scratch; }

bool ddp_test_parity_available(void) { return g_py && access(g_tool, X_OK) == 0; }
const char *ddp_test_parity_compare_tool(void) { return g_tool; }
const char *ddp_test_parity_dataset(void) { return g_data; }

/* ---------------------------------------------------------------- helpers --------- */

void ddp_test_write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
  fclose(f);
}

char *ddp_test_read_text(const char *path) {
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

cJSON *ddp_test_read_json(const char *path) {
  char *t = ddp_test_read_text(path);
  if (!t) fail_msg("cannot read %s", path);
  cJSON *j = cJSON_Parse(t);
  free(t);
  if (!j) fail_msg("%s is not JSON", path);
  return j;
}

const cJSON *ddp_test_json_get(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v) fail_msg("JSON has no \"%s\"", key);
  return v;
}

/* Runs a shell command, stdout into *out (malloc'd), stderr into g_scratch/stderr.txt. */
int ddp_test_run_cmd(char **out, const char *fmt, ...) {
  char cmd[4096], err_path[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  snprintf(err_path, sizeof err_path, "%s/stderr.txt", g_scratch);
  return ddp_test_proc_run(cmd, err_path, DDP_TEST_CMD_TIMEOUT_S, out);
}

char *ddp_test_cmd_stderr(void) {
  char p[512];
  snprintf(p, sizeof p, "%s/stderr.txt", g_scratch);
  return ddp_test_read_text(p);
}

void ddp_test_print_cmd_stderr(void) {
  char *t = ddp_test_cmd_stderr();
  if (t) print_error("%s\n", t);
  free(t);
}

bool ddp_test_make_scratch(char *dir, size_t cap, const char *name) {
  snprintf(dir, cap, "/tmp/%s_XXXXXX", name);
  return mkdtemp(dir) != NULL;
}

int ddp_test_remove_scratch(const char *dir, bool keep_env) {
  if (!dir[0] || (keep_env && getenv("DDP_PARITY_KEEP"))) return 0;
  char line[512];
  snprintf(line, sizeof line, "rm -rf '%s'", dir);
  return system(line) != 0 ? 1 : 0;
}

static const cJSON *get(const cJSON *o, const char *key) { return ddp_test_json_get(o, key); }

/* ---------------------------------------------------------------- the libddp run -- */

typedef struct job {
  const ddp_test_pcfg_t *cfg;
  const char *model_path; /* model JSON file */
  const char *init_path;  /* weights to start from; NULL = ddp_model_init(seed 7 + rank) */
  const char *dump_dir;
  const char *config_json;
  uint64_t seed;
  const char *torch_dir; /* dump A, for the setup callback; may be NULL */
  const ddp_dataset_t *ds;
  uint64_t flags[DDP_TEST_PARITY_MAXW];
  char msg[DDP_TEST_PARITY_MAXW][600];
} job_t;

/* One rank of the libddp side: what torch_reference.py's worker does, step for step. */
static ddp_status_t rank_main(ddp_pg_t *pg, void *arg) {
  job_t *job = arg;
  const ddp_test_pcfg_t *c = job->cfg;
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
  if (c->setup) {
    st = c->setup(ddp, r, job->torch_dir, c->setup_user, msg, 600);
    if (st != DDP_OK) goto out;
  }
  ddp_dump_options_t dopt = DDP_DUMP_OPTIONS_INIT;
  dopt.steps = c->steps;
  dopt.producer_version = "libddp (tests/harness/parity.c)";
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
  uint64_t v[DDP_TEST_PARITY_MAXW];
  int n = 0;
  const char *p = text;
  while (*p && n < DDP_TEST_PARITY_MAXW) {
    char *end;
    v[n++] = strtoull(p, &end, 0);
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  assert_true(n > 0);
  for (int r = 0; r < world; r++) out[r] = v[r % n];
}

static void run_job(job_t *job) {
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

void ddp_test_parity_run_libddp(const ddp_test_pcfg_t *c, const char *model_path,
                                const char *init_path, const char *dump_dir,
                                const char *config_json, uint64_t seed, const char *torch_dir) {
  job_t job = {.cfg = c, .model_path = model_path, .init_path = init_path,
               .dump_dir = dump_dir, .config_json = config_json, .seed = seed,
               .torch_dir = torch_dir};
  run_job(&job);
}

/* ---------------------------------------------------------------- parity ---------- */

void ddp_test_parity(const ddp_test_pcfg_t *c, ddp_test_parity_result_t *res) {
  if (!ddp_test_parity_available()) {
    print_message("torch (under /usr/bin/python3) or ddp-compare absent: skipped\n");
    skip();
  }
  char base[512], model[600], A[600], B[600], weights[700];
  snprintf(base, sizeof base, "%s/%s", g_scratch, c->name);
  assert_int_equal(mkdir(base, 0755), 0);
  snprintf(model, sizeof model, "%s/model.json", base);
  snprintf(A, sizeof A, "%s/torch", base);
  snprintf(B, sizeof B, "%s/libddp", base);
  snprintf(weights, sizeof weights, "%s/weights.safetensors", A);
  ddp_test_write_text(model, c->model);
  const uint64_t seed = DDP_TEST_PARITY_SEED;
  char cap[64] = "";
  if (c->bucket_cap_mb >= 0) snprintf(cap, sizeof cap, "--bucket_cap_mb %g", c->bucket_cap_mb);
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out,
               "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s/tools/torch_reference.py "
               "--model '%s' --dump_dir '%s' --data '%s' --world %d --steps %d --batch %d "
               "--gradient_accumulation_steps %d --lr %.17g --momentum %.17g --optim sgd "
               "--seed %llu --shuffle true --flags %s %s --find_unused_parameters %s "
               "--broadcast_buffers %s --static_graph %s --gradient_as_bucket_view %s "
               "--timeout 60 %s",
               g_py, ddp_test_source_root(), model, A, g_data, c->world, c->steps,
               c->batch, c->accum, c->lr, c->momentum, (unsigned long long)seed,
               c->flags ? c->flags : "0", cap, c->find_unused ? "true" : "false",
               c->broadcast_buffers ? "true" : "false", c->static_graph ? "true" : "false",
               c->grad_as_bucket_view ? "true" : "false", c->torch_args ? c->torch_args : "");
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
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
  ddp_test_parity_run_libddp(c, model, weights, B, cfgjson, seed, A);

  char tol[128] = "";
  if (c->rtol > 0 || c->atol > 0)
    snprintf(tol, sizeof tol, "--rtol %.17g --atol %.17g", c->rtol > 0 ? c->rtol : 1e-5,
             c->atol > 0 ? c->atol : 1e-7);
  rc = ddp_test_run_cmd(&out, "%s --json %s '%s' '%s'", g_tool, tol, A, B);
  cJSON *j = cJSON_Parse(out);
  if (!j) fail_msg("%s: ddp-compare printed no JSON (exit %d): %s", c->name, rc, out);
  free(out);
  double gabs = 0, grel = 0, pabs = 0, prel = 0, babs = 0, brel = 0;
  int64_t gelems = 0, gexact = 0;
  const cJSON *t;
  cJSON_ArrayForEach(t, get(j, "tensors")) {
    const char *nm = get(t, "name")->valuestring;
    double a = get(t, "max_abs")->valuedouble, r = get(t, "max_rel")->valuedouble;
    if (strncmp(nm, "grad.", 5) == 0) {
      gelems += (int64_t)get(t, "elements")->valuedouble;
      gexact += (int64_t)cJSON_GetArrayItem(get(t, "ulp_hist"), 0)->valuedouble;
    }
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
  if (res) {
    *res = (ddp_test_parity_result_t){gabs, grel, pabs, prel, babs, brel, gelems, gexact, 0, -1};
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
    cJSON *ja = ddp_test_read_json(pa), *jb = ddp_test_read_json(pb);
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
    if (r == 0 && res) {
      res->buckets_initial = cJSON_GetArraySize(get(la, "initial"));
      const cJSON *rb = get(la, "rebuilt");
      res->buckets_rebuilt = cJSON_IsArray(rb) ? cJSON_GetArraySize(rb) : -1;
    }
    cJSON_Delete(ja);
    cJSON_Delete(jb);
  }
}

