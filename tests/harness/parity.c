/* The PyTorch parity driver (parity.h): torch_reference.py, the same job through
 * ddp-train, ddp-compare, and the layout checks. Shared by tests/test_ddp_parity.c and
 * tests/test_hooks_parity.c; its file, JSON, command and scratch-directory helpers also
 * serve tests/test_compare.c. */
#include "parity.h"

#include "cleanup.h"

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

#include "harness.h"
#include "proc.h"

static char g_scratch[256]; /* the caller's scratch directory */
static char g_tool[1024];   /* ddp-compare */
static char g_train[1024];  /* ddp-train */
static char g_data[1024];   /* tests/data/digits.safetensors */
static const char *g_py;    /* /usr/bin/python3 when it imports torch */

bool ddp_test_parity_init(const char *scratch_dir) {
  const char *build = getenv("DDP_BUILD_ROOT");
  snprintf(g_tool, sizeof g_tool, "%s/tools/ddp-compare", build ? build : ".");
  snprintf(g_train, sizeof g_train, "%s/tools/ddp-train", build ? build : ".");
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
  const char *filter = getenv("DDP_TEST_FILTER");
  if (filter && *filter) cmocka_set_test_filter(filter);
  return _cmocka_run_group_tests("tests", tests, n, group_setup, group_teardown);
}

const char *ddp_test_parity_scratch(void) { return g_scratch; }

bool ddp_test_parity_available(void) {
  return g_py && access(g_tool, X_OK) == 0 && access(g_train, X_OK) == 0;
}
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
  if (!mkdtemp(dir)) return false;
  /* Removed at exit even when a test fails, unless DDP_PARITY_KEEP asks to keep it. */
  if (!getenv("DDP_PARITY_KEEP")) ddp_test_remove_at_exit(dir);
  return true;
}

int ddp_test_remove_scratch(const char *dir, bool keep_env) {
  if (!dir[0] || (keep_env && getenv("DDP_PARITY_KEEP"))) return 0;
  return ddp_test_remove_now(dir) ? 0 : 1;
}

static const cJSON *get(const cJSON *o, const char *key) { return ddp_test_json_get(o, key); }

/* ---------------------------------------------------------------- the libddp run -- */

static const char *tf(bool b) { return b ? "true" : "false"; }

int ddp_test_parity_train(const ddp_test_pcfg_t *c, const char *torch_dir, const char *dump_dir,
                          const char *extra) {
  char init[700] = "", cap[160] = "", q[700] = "";
  if (torch_dir) snprintf(init, sizeof init, "--init '%s/weights.safetensors'", torch_dir);
  if (c->bucket_cap_mb >= 0) {
    /* PyTorch 1.13 keeps the 1 MiB first bucket with an explicit cap (docs/ddp.md). */
    snprintf(cap, sizeof cap, "--ddp_bucket_cap_mb %.17g --ddp_first_bucket_mb %.17g",
             c->bucket_cap_mb, c->first_bucket_mb > 0 ? c->first_bucket_mb : 1.0);
  } else if (c->first_bucket_mb > 0) {
    snprintf(cap, sizeof cap, "--ddp_first_bucket_mb %.17g", c->first_bucket_mb);
  }
  if (c->inject_q) {
    assert_non_null(torch_dir);
    snprintf(q, sizeof q, "--power_sgd_init_q '%s/powersgd_q.safetensors'", torch_dir);
  }
  /* torch_reference.py's defaults, which differ from Hugging Face's, are given explicitly:
   * no clipping, a constant learning rate. */
  return ddp_test_run_cmd(
      NULL,
      "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 '%s' --threads %d --model '%s/%s/model.json' "
      "%s --data '%s' --max_steps %d --per_device_train_batch_size %d "
      "--gradient_accumulation_steps %d --learning_rate %.17g --optim sgd "
      "--optim_args momentum=%.17g --max_grad_norm 0 --lr_scheduler_type constant --seed %d "
      "--forward_flags '%s' %s --ddp_find_unused_parameters %s --ddp_broadcast_buffers %s "
      "--ddp_static_graph %s --gradient_as_bucket_view %s --ddp_timeout 60 "
      "--save_strategy no --disable_tqdm --output_dir '%s.out' --dump_dir '%s' %s %s %s %s %s",
      g_train, c->world, g_scratch, c->name, init, c->data ? c->data : g_data, c->steps, c->batch,
      c->accum, c->lr, c->momentum, DDP_TEST_PARITY_SEED, c->flags ? c->flags : "0", cap,
      tf(c->find_unused), tf(c->broadcast_buffers), tf(c->static_graph), tf(c->grad_as_bucket_view),
      dump_dir, dump_dir, c->hook_args ? c->hook_args : "", c->data_args ? c->data_args : "", q,
      c->train_args ? c->train_args : "", extra ? extra : "");
}

/* ---------------------------------------------------------------- parity ---------- */

void ddp_test_parity(const ddp_test_pcfg_t *c, ddp_test_parity_result_t *res) {
  if (!ddp_test_parity_available()) {
    print_message("torch (under /usr/bin/python3), ddp-compare or ddp-train absent: skipped\n");
    skip();
  }
  char base[512], model[600], A[600], B[600];
  snprintf(base, sizeof base, "%s/%s", g_scratch, c->name);
  assert_int_equal(mkdir(base, 0755), 0);
  snprintf(model, sizeof model, "%s/model.json", base);
  snprintf(A, sizeof A, "%s/torch", base);
  snprintf(B, sizeof B, "%s/libddp", base);
  ddp_test_write_text(model, c->model);
  char cap[128] = "";
  if (c->bucket_cap_mb >= 0) snprintf(cap, sizeof cap, "--bucket_cap_mb %.17g", c->bucket_cap_mb);
  if (c->first_bucket_mb > 0) {
    snprintf(cap + strlen(cap), sizeof cap - strlen(cap), " --first_bucket_mb %.17g",
             c->first_bucket_mb);
  }
  char *out = NULL;
  int rc = ddp_test_run_cmd(
      &out,
      "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s/tools/torch/torch_reference.py "
      "--model '%s' --dump_dir '%s' --data '%s' --world %d --steps %d --batch %d "
      "--gradient_accumulation_steps %d --lr %.17g --momentum %.17g --optim sgd "
      "--seed %d --shuffle true --flags %s %s --find_unused_parameters %s "
      "--broadcast_buffers %s --static_graph %s --gradient_as_bucket_view %s "
      "--timeout 60 %s %s %s",
      g_py, ddp_test_source_root(), model, A, c->data ? c->data : g_data, c->world, c->steps,
      c->batch, c->accum, c->lr, c->momentum, DDP_TEST_PARITY_SEED, c->flags ? c->flags : "0", cap,
      tf(c->find_unused), tf(c->broadcast_buffers), tf(c->static_graph), tf(c->grad_as_bucket_view),
      c->hook_args ? c->hook_args : "", c->data_args ? c->data_args : "",
      c->torch_args ? c->torch_args : "");
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("%s: torch_reference.py exited %d: %s", c->name, rc, out);
  }
  free(out);

  /* The libddp side: ddp-train from A's weights after the broadcast, the same options. */
  rc = ddp_test_parity_train(c, A, B, NULL);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("%s: ddp-train exited %d", c->name, rc);
  }

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
    double *pa = strncmp(nm, "grad.", 5) == 0     ? &gabs
                 : strncmp(nm, "param.", 6) == 0  ? &pabs
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
  if (rc != 0) cJSON_Delete(j); /* the failing assertion below leaves the function */
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
