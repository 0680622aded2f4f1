/* Fidelity to PyTorch where a gradient is None (issue 14): the optimizers skip None
 * gradients, DDP leaves a globally unused parameter's gradient None on every backend and
 * mode, Adam's per-parameter step count, zero_grad(set_to_none=false) against true, the
 * per-step forward_flags schedule, named layers and the "add" node of model files, and
 * ddp-compare's diagnosis of the first differing step (local vs averaged gradients).
 *
 * The ddp-train runs are real tool runs (threads, and ddprun on shm and tcp) writing dumps
 * and checkpoints that the parent reads back and asserts on. */
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

#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "harness.h"
#include "parity.h"
#include "train/train_internal.h"

/* The MLP with a logits head and an auxiliary head (flag bit 0): DDP_TEST_AUX_MODEL. */
static const char *const AUX = DDP_TEST_AUX_MODEL;
static const char *const MLP =
    "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32}, "
    "{\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 32, \"out\": 10}]}";

static char g_model[600], g_mlp[600];

static void write_models(void) {
  if (g_model[0]) return;
  snprintf(g_model, sizeof g_model, "%s/aux.json", ddp_test_parity_scratch());
  snprintf(g_mlp, sizeof g_mlp, "%s/mlp.json", ddp_test_parity_scratch());
  ddp_test_write_text(g_model, AUX);
  ddp_test_write_text(g_mlp, MLP);
}

/* ddp-train on `launch` ("--threads 2", or a ddprun prefix) with the common arguments,
 * writing dump_dir and output_dir dump_dir.out; extra last (it overrides). Fails the test
 * unless it exits 0; returns the tool's stdout (malloc'd). */
static char *train(const char *launch, const char *model, const char *dump_dir, const char *extra) {
  char *out = NULL;
  int rc = ddp_test_run_cmd(
      &out,
      "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s --model '%s' --data '%s' "
      "--per_device_train_batch_size 8 --learning_rate 0.01 --lr_scheduler_type constant "
      "--max_grad_norm 0 --seed 7 --save_strategy no --disable_tqdm --ddp_timeout 60 "
      "--output_dir '%s.out' --dump_dir '%s' %s",
      launch, model, ddp_test_parity_dataset(), dump_dir, dump_dir, extra);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("ddp-train (%s %s) exited %d: %s", launch, extra, rc, out ? out : "");
  }
  return out;
}

static ddp_st_file_t *st_open(const char *path) {
  ddp_st_file_t *f = NULL;
  ddp_error_t err = {0};
  if (ddp_st_open(path, DDP_ST_MMAP, &f, &err) != DDP_OK) fail_msg("%s: %s", path, err.msg);
  return f;
}

static ddp_tensor_t st_get(ddp_st_file_t *f, const char *name) {
  size_t i;
  ddp_tensor_t t;
  if (ddp_st_find(f, name, &i) != DDP_OK) fail_msg("tensor %s missing", name);
  assert_int_equal(ddp_st_tensor(f, i, &t), DDP_OK);
  return t;
}

/* Whether tensor `name` holds the same bytes in two files. */
static bool same_bytes(ddp_st_file_t *a, ddp_st_file_t *b, const char *name) {
  ddp_tensor_t x = st_get(a, name), y = st_get(b, name);
  return x.numel == y.numel && memcmp(x.data, y.data, ddp_tensor_nbytes(&x)) == 0;
}

/* ---------------------------------------------------------------- unit ------------ */

/* forward_flags: per rank (commas, cycled), per step (colons, cycled); today's syntax. */
static void test_flags_schedule(void **state) {
  (void)state;
  static const struct {
    const char *text;
    int rank;
    int64_t step;
    uint64_t want;
  } ok[] = {{"0:1", 0, 0, 0},         {"0:1", 0, 1, 1},       {"0:1", 3, 7, 1},
            {"0,1", 1, 4, 1},         {"0,1", 2, 4, 0},       {"0:1,1", 0, 3, 1},
            {"0:1,1", 1, 2, 1},       {"1:2:4,0x8", 0, 5, 4}, {"1:2:4,0x8", 1, 5, 8},
            {" 2 : 3 , 5 ", 0, 1, 3}, {"7", 5, 9, 7}};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    uint64_t v = 99;
    if (!ddp__train_forward_flags_at(ok[i].text, ok[i].rank, ok[i].step, &v) || v != ok[i].want)
      fail_msg("forward_flags \"%s\" rank %d step %lld: %llu, want %llu", ok[i].text, ok[i].rank,
               (long long)ok[i].step, (unsigned long long)v, (unsigned long long)ok[i].want);
  }
  static const char *const bad[] = {"0:", ":1", "0::1", "0:,1", "0:x", "1,:2", "0:-1"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    if (ddp__train_forward_flags_at(bad[i], 0, 0, NULL)) fail_msg("accepted \"%s\"", bad[i]);
}

/* Named layers change the state_dict names only; "add" sums its active branches; bad
 * names and an add with no active branch are errors naming the place. */
static void test_named_add_model(void **state) {
  (void)state;
  ddp_model_t *m = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_model_from_json(AUX, &m, &err), DDP_OK);
  static const char *const names[] = {"fc1.weight",
                                      "fc1.bias",
                                      "heads.logits.0.weight",
                                      "heads.logits.0.bias",
                                      "heads.aux.0.weight",
                                      "heads.aux.0.bias"};
  assert_int_equal(ddp_model_num_params(m), 6);
  for (size_t i = 0; i < 6; i++) assert_string_equal(ddp_model_param(m, i)->name, names[i]);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  ddp_ctx_t *c;
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  int64_t sh[2] = {2, 64};
  float x[128];
  for (int i = 0; i < 128; i++) x[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
  /* y(flag 1) = logits(h) + aux(h), y(flag 0) = logits(h); backward with flag 0 leaves the
   * aux head's gradients None and defines the others. */
  ddp_var_t *in, *y0, *y1, *l;
  ddp_model_set_grads_none(m);
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, sh, x, false, &in), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, in, 0, &y0), DDP_OK);
  assert_int_equal(ddp_sum(c, y0, &l), DDP_OK);
  assert_int_equal(ddp_backward(c, l), DDP_OK);
  for (size_t i = 0; i < 6; i++)
    if (ddp_param_grad_defined(ddp_model_param(m, i)) != (i < 4))
      fail_msg("%s: defined %d after a flag-0 backward, want %d", names[i],
               ddp_param_grad_defined(ddp_model_param(m, i)), i < 4);
  assert_int_equal(ddp_model_forward(m, c, in, 1, &y1), DDP_OK);
  /* aux alone: the difference, compared with a direct linear of the aux head. */
  ddp_var_t *h, *a;
  {
    ddp_var_t *w1 = ddp_param_var(c, ddp_model_param(m, 0)),
              *b1 = ddp_param_var(c, ddp_model_param(m, 1));
    ddp_var_t *wa = ddp_param_var(c, ddp_model_param(m, 4)),
              *ba = ddp_param_var(c, ddp_model_param(m, 5));
    assert_int_equal(ddp_linear(c, in, w1, b1, &h), DDP_OK);
    assert_int_equal(ddp_relu(c, h, &h), DDP_OK);
    assert_int_equal(ddp_linear(c, h, wa, ba, &a), DDP_OK);
  }
  const float *p0 = y0->value.data, *p1 = y1->value.data, *pa = a->value.data;
  for (int i = 0; i < 20; i++)
    if (p1[i] != p0[i] + pa[i]) fail_msg("y[%d]: %.9g, want %.9g + %.9g", i, p1[i], p0[i], pa[i]);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);

  static const struct {
    const char *json, *msg;
  } bad[] = {
      {"{\"layers\": [{\"type\": \"relu\", \"name\": \"a\"}, {\"type\": \"tanh\", \"name\": "
       "\"a\"}]}",
       "same name \"a\""},
      {"{\"layers\": [{\"type\": \"relu\", \"name\": \"1\"}, {\"type\": \"tanh\"}]}",
       "same name \"1\""},
      {"{\"layers\": [{\"type\": \"relu\", \"name\": \"a.b\"}]}", "without '.'"},
      {"{\"layers\": [{\"type\": \"add\", \"branches\": []}]}", "1 to 16 branches"},
      {"{\"layers\": [{\"type\": \"add\", \"branches\": [{\"flag\": 70, \"layers\": []}]}]}",
       "\"flag\" must be 0..63"},
      {"{\"layers\": [{\"type\": \"add\", \"branches\": [3]}]}", "a branch is an array"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ddp_error_t e = {0};
    ddp_model_t *mm = NULL;
    if (ddp_model_from_json(bad[i].json, &mm, &e) == DDP_OK) fail_msg("accepted %s", bad[i].json);
    if (!strstr(e.msg, bad[i].msg))
      fail_msg("%s: message \"%s\" lacks \"%s\"", bad[i].json, e.msg, bad[i].msg);
  }
  /* Every branch flagged and none active: an error at forward. */
  assert_int_equal(ddp_model_from_json("{\"layers\": [{\"type\": \"add\", \"branches\": "
                                       "[{\"flag\": 2, \"layers\": [{\"type\": \"relu\"}]}]}]}",
                                       &m, &err),
                   DDP_OK);
  assert_int_equal(ddp_ctx_create(&c), DDP_OK);
  assert_int_equal(ddp_var_new(c, DDP_F32, 2, sh, x, false, &in), DDP_OK);
  assert_int_equal(ddp_model_forward(m, c, in, 3, &y0), DDP_ERR_INVALID_ARGUMENT);
  ddp_error_t ce;
  ddp_ctx_last_error_copy(c, &ce);
  assert_non_null(strstr(ce.msg, "no branch is active"));
  assert_int_equal(ddp_model_forward(m, c, in, 4, &y0), DDP_OK);
  ddp_ctx_destroy(c);
  ddp_model_destroy(m);
}

/* SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW leave a parameter
 * whose gradient is None bitwise unchanged and create no state for it; Adam's step count
 * advances only on steps with a gradient; the checkpoint keeps which states exist;
 * clip_grad_norm ignores None. */
static void test_optim_skips_none(void **state) {
  (void)state;
  static const char *const kinds[] = {"sgd", "adam", "adamw"};
  for (int k = 0; k < 3; k++) {
    ddp_optim_options_t o = k == 0   ? (ddp_optim_options_t)DDP_SGD_OPTIONS_INIT
                            : k == 1 ? (ddp_optim_options_t)DDP_ADAM_OPTIONS_INIT
                                     : (ddp_optim_options_t)DDP_ADAMW_OPTIONS_INIT;
    o.lr = 0.1;
    o.weight_decay = 0.01;
    if (k == 0) {
      o.momentum = 0.9;
      o.nesterov = true;
    }
    ddp_tensor_t p[2], g[2];
    int64_t n = 5;
    ddp_optim_param_t pr[2];
    for (int i = 0; i < 2; i++) {
      assert_int_equal(ddp_tensor_alloc(&p[i], DDP_F32, 1, &n), DDP_OK);
      assert_int_equal(ddp_tensor_alloc(&g[i], DDP_F32, 1, &n), DDP_OK);
      for (int e = 0; e < 5; e++) ((float *)p[i].data)[e] = 0.25f * (float)(e + 1);
      pr[i] = (ddp_optim_param_t){&p[i], &g[i]};
    }
    float before[5];
    memcpy(before, p[1].data, sizeof before);
    ddp_optim_t *opt;
    ddp_error_t err = {0};
    assert_int_equal(ddp_optim_create(&o, pr, 2, &opt, &err), DDP_OK);
    /* Parameter 1's gradient: None on even steps, 0.5 on odd ones (10 steps). */
    for (int s = 0; s < 10; s++) {
      ddp_optim_zero_grad(opt, true);
      assert_null(g[0].data);
      assert_int_equal(g[0].numel, 5); /* None keeps the shape */
      assert_int_equal(ddp_tensor_alloc(&g[0], DDP_F32, 1, &n), DDP_OK);
      for (int e = 0; e < 5; e++) ((float *)g[0].data)[e] = 0.1f;
      if (s % 2) {
        assert_int_equal(ddp_tensor_alloc(&g[1], DDP_F32, 1, &n), DDP_OK);
        for (int e = 0; e < 5; e++) ((float *)g[1].data)[e] = 0.5f;
      } else {
        assert_null(g[1].data);
      }
      if (s == 0) {
        assert_int_equal(ddp_optim_step(opt, &err), DDP_OK);
        if (memcmp(before, p[1].data, sizeof before) != 0)
          fail_msg("%s: a None gradient moved the parameter (%.9g -> %.9g)", kinds[k], before[0],
                   ((float *)p[1].data)[0]);
        /* clip_grad_norm: the None gradient neither counts nor is touched. */
        ddp_tensor_t *gs[2] = {&g[0], &g[1]};
        double total = 0;
        assert_int_equal(ddp_clip_grad_norm(gs, 2, 1e9, 2.0, false, &total, &err), DDP_OK);
        double want = sqrt(5.0 * 0.1f * 0.1f);
        if (fabs(total - want) > 1e-6) fail_msg("clip total %.9g, want %.9g", total, want);
        /* Checkpoint: state for parameter 0 only. */
        char path[600];
        snprintf(path, sizeof path, "%s/opt_%s.safetensors", ddp_test_parity_scratch(), kinds[k]);
        assert_int_equal(ddp_optim_save(opt, path, &err), DDP_OK);
        ddp_st_file_t *f = st_open(path);
        size_t idx;
        const char *probe = k == 0 ? "state.%d.momentum_buffer" : "state.%d.exp_avg";
        char n0[64], n1[64];
        snprintf(n0, sizeof n0, probe, 0);
        snprintf(n1, sizeof n1, probe, 1);
        assert_int_equal(ddp_st_find(f, n0, &idx), DDP_OK);
        if (ddp_st_find(f, n1, &idx) == DDP_OK) fail_msg("%s: state for a None gradient", kinds[k]);
        ddp_st_close(f);
        ddp_optim_t *o2;
        assert_int_equal(ddp_optim_create(&o, pr, 2, &o2, &err), DDP_OK);
        assert_int_equal(ddp_optim_load(o2, path, &err), DDP_OK);
        assert_int_equal(ddp_optim_save(o2, path, &err), DDP_OK);
        f = st_open(path);
        if (ddp_st_find(f, n1, &idx) == DDP_OK) fail_msg("%s: load created state", kinds[k]);
        assert_int_equal(ddp_st_find(f, n0, &idx), DDP_OK);
        ddp_st_close(f);
        ddp_optim_destroy(o2);
      } else {
        assert_int_equal(ddp_optim_step(opt, &err), DDP_OK);
      }
    }
    if (k > 0) {
      char path[600];
      snprintf(path, sizeof path, "%s/opt_%s_end.safetensors", ddp_test_parity_scratch(), kinds[k]);
      assert_int_equal(ddp_optim_save(opt, path, &err), DDP_OK);
      ddp_st_file_t *f = st_open(path);
      float s0 = *(const float *)st_get(f, "state.0.step").data;
      float s1 = *(const float *)st_get(f, "state.1.step").data;
      if (s0 != 10.0f || s1 != 5.0f)
        fail_msg("%s: step counts %g and %g, want 10 and 5", kinds[k], s0, s1);
      ddp_st_close(f);
    }
    ddp_optim_destroy(opt);
    for (int i = 0; i < 2; i++) {
      ddp_tensor_free(&p[i]);
      ddp_tensor_free(&g[i]);
    }
  }
}

/* ---------------------------------------------------------------- ddp-train ------- */

/* The aux head, never used on any rank, with AdamW and weight decay 1e-2 for 10 steps:
 * its parameters are bitwise what the broadcast gave them and its gradients are listed in
 * grads_none at every step on every rank, on threads, shm and tcp, with the reducer's
 * modes (gradient_as_bucket_view, static_graph), the flat allreduce and zero-filling
 * zero_grad; the other parameters moved. */
static void test_never_used_backends(void **state) {
  (void)state;
  if (access(ddp_test_tool("ddp-train"), X_OK) != 0) skip();
  write_models();
  char shm[2048], tcp[2048], thr[64];
  snprintf(thr, sizeof thr, "'%s' --threads 2", ddp_test_tool("ddp-train"));
  /* --standalone: ddprun reserves the store's port from the kernel before any rank starts. */
  snprintf(shm, sizeof shm, "'%s' --nproc_per_node 2 --backend shm --standalone '%s'",
           ddp_test_tool("ddprun"), ddp_test_tool("ddp-train"));
  snprintf(tcp, sizeof tcp, "'%s' --nproc_per_node 2 --backend tcp --standalone '%s'",
           ddp_test_tool("ddprun"), ddp_test_tool("ddp-train"));
  const struct {
    const char *name, *launch, *extra;
  } cases[] = {
      {"threads", thr, ""},
      {"shm", shm, ""},
      {"tcp", tcp, ""},
      {"bucket_view", thr, "--gradient_as_bucket_view true"},
      {"static_graph", thr, "--ddp_static_graph true --ddp_find_unused_parameters false"},
      {"flat", thr, "--ddp_reducer false"},
      {"zero_fill", thr, "--zero_grad_set_to_none false"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char dir[600], extra[512];
    snprintf(dir, sizeof dir, "%s/never_%s", ddp_test_parity_scratch(), cases[c].name);
    snprintf(extra, sizeof extra,
             "--max_steps 10 --optim adamw --weight_decay 1e-2 --weight_decay_grouping all "
             "--forward_flags 0 --ddp_find_unused_parameters true %s",
             cases[c].extra);
    free(train(cases[c].launch, g_model, dir, extra));
    for (int r = 0; r < 2; r++) {
      char pi[700], ps[700];
      snprintf(pi, sizeof pi, "%s/rank%d/init.safetensors", dir, r);
      ddp_st_file_t *fi = st_open(pi);
      for (int s = 0; s < 10; s++) {
        snprintf(ps, sizeof ps, "%s/rank%d/step%06d.safetensors", dir, r, s);
        ddp_st_file_t *fs = st_open(ps);
        const char *none = ddp_st_meta_get(fs, "grads_none");
        if (!none || strcmp(none, "heads.aux.0.weight,heads.aux.0.bias") != 0)
          fail_msg("%s rank %d step %d: grads_none \"%s\"", cases[c].name, r, s,
                   none ? none : "(absent)");
        if (s == 9) {
          if (!same_bytes(fi, fs, "param.heads.aux.0.weight") ||
              !same_bytes(fi, fs, "param.heads.aux.0.bias"))
            fail_msg("%s rank %d: the never-used aux head moved", cases[c].name, r);
          if (same_bytes(fi, fs, "param.fc1.weight"))
            fail_msg("%s rank %d: fc1.weight did not move", cases[c].name, r);
        }
        ddp_st_close(fs);
      }
      ddp_st_close(fi);
    }
    print_message("%-13s aux head bitwise unchanged after 10 AdamW steps (wd 1e-2), "
                  "grads_none at every step\n",
                  cases[c].name);
  }
}

/* Adam's state.<i>.step (checkpoint-10) of the aux head: 5 when it is used on odd steps
 * only (None on even steps), 10 when it is used on odd ranks only (globally used every
 * step), and 9 with zero-filling zero_grad (PyTorch 1.13's default: None only before its
 * first use). The other parameters: 10. */
static void test_adam_step_counts(void **state) {
  (void)state;
  if (access(ddp_test_tool("ddp-train"), X_OK) != 0) skip();
  write_models();
  const struct {
    const char *name, *extra;
    float aux_steps;
  } cases[] = {
      {"odd_steps", "--forward_flags 0:1", 5.0f},
      {"odd_ranks", "--forward_flags 0,1", 10.0f},
      {"odd_steps_zero_fill", "--forward_flags 0:1 --zero_grad_set_to_none false", 9.0f},
  };
  char launch[64];
  snprintf(launch, sizeof launch, "'%s' --threads 2", ddp_test_tool("ddp-train"));
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char dir[600], extra[512], path[800];
    snprintf(dir, sizeof dir, "%s/adam_%s", ddp_test_parity_scratch(), cases[c].name);
    snprintf(extra, sizeof extra,
             "--max_steps 10 --optim adam --weight_decay 0 --ddp_find_unused_parameters true "
             "--save_strategy steps --save_steps 10 %s",
             cases[c].extra);
    free(train(launch, g_model, dir, extra));
    snprintf(path, sizeof path, "%s.out/checkpoint-10/optimizer.safetensors", dir);
    ddp_st_file_t *f = st_open(path);
    for (int i = 0; i < 6; i++) {
      char nm[64];
      snprintf(nm, sizeof nm, "state.%d.step", i);
      float got = *(const float *)st_get(f, nm).data, want = i >= 4 ? cases[c].aux_steps : 10.0f;
      if (got != want) fail_msg("%s: %s = %g, want %g", cases[c].name, nm, got, want);
    }
    ddp_st_close(f);
    print_message("%-20s Adam step: aux head %g, others 10\n", cases[c].name, cases[c].aux_steps);
  }
}

/* zero_grad(set_to_none=false) and the default set_to_none=true give the same bits when
 * every parameter is reached at every step (today's behaviour, which zero-filled), with
 * the reducer and the flat allreduce and with gradient accumulation. */
static void test_set_to_none_false_bitwise(void **state) {
  (void)state;
  if (access(ddp_test_tool("ddp-train"), X_OK) != 0) skip();
  write_models();
  char launch[64];
  snprintf(launch, sizeof launch, "'%s' --threads 2", ddp_test_tool("ddp-train"));
  static const char *const modes[] = {"--ddp_reducer true", "--ddp_reducer false",
                                      "--gradient_accumulation_steps 2 --optim sgd "
                                      "--optim_args momentum=0.9 --weight_decay 1e-4"};
  for (size_t m = 0; m < 3; m++) {
    char hash[2][64];
    for (int z = 0; z < 2; z++) {
      char dir[600], extra[512];
      snprintf(dir, sizeof dir, "%s/stn_%zu_%d", ddp_test_parity_scratch(), m, z);
      snprintf(extra, sizeof extra,
               "--max_steps 6 --weight_decay 1e-2 %s "
               "--zero_grad_set_to_none %s",
               modes[m], z ? "true" : "false");
      char *out = train(launch, g_mlp, dir, extra);
      const char *h = strstr(out, "holds parameters ");
      assert_non_null(h);
      snprintf(hash[z], sizeof hash[z], "%.16s", h + 17);
      free(out);
    }
    if (strcmp(hash[0], hash[1]) != 0)
      fail_msg("%s: set_to_none=false %s, true %s", modes[m], hash[0], hash[1]);
    print_message("%-30.30s parameter hash %s with either zero_grad\n", modes[m], hash[0]);
  }
}

/* The knobs by name: fractional ddp_bucket_cap_mb, weight_decay_grouping's choices,
 * data_seed -1 = seed; and in a run: dataloader_shuffle false reads each rank's shard in
 * index order (rank r: r, r + W, ...), data_seed alone decides the order (two runs with
 * other seeds but one data_seed read the same indices). */
static void test_knobs(void **state) {
  (void)state;
  ddp_train_args_t a = DDP_TRAIN_ARGS_INIT;
  ddp_error_t err = {0};
  assert_int_equal(a.data_seed, -1);
  assert_true(a.zero_grad_set_to_none && a.dataloader_shuffle);
  assert_string_equal(a.weight_decay_grouping, "transformers");
  assert_int_equal(ddp_train_args_set(&a, "ddp_bucket_cap_mb", "0.25", &err), DDP_OK);
  DDP_ASSERT_EQ(a.ddp_bucket_cap_mb, 0.25);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "weight_decay_grouping", "bias", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "transformers, all"));
  assert_int_equal(ddp_train_args_set(&a, "data_seed", "-2", &err), DDP_ERR_INVALID_ARGUMENT);
  assert_int_equal(ddp_train_args_set(&a, "forward_flags", "0:1,2:", &err), DDP_OK);
  assert_int_equal(ddp_train_args_set(&a, "weight_decay_grouping", "all", &err), DDP_OK);
  assert_int_equal(ddp_train_args_validate(&a, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "colons"));
  if (access(ddp_test_tool("ddp-train"), X_OK) != 0) skip();
  write_models();
  char launch[64];
  snprintf(launch, sizeof launch, "'%s' --threads 2", ddp_test_tool("ddp-train"));
  const struct {
    const char *name, *extra;
  } runs[] = {{"noshuffle", "--dataloader_shuffle false"},
              {"ds_a", "--data_seed 99 --seed 1"},
              {"ds_b", "--data_seed 99 --seed 2"},
              {"ds_c", "--seed 99"}};
  for (size_t k = 0; k < 4; k++) {
    char dir[600], extra[256];
    snprintf(dir, sizeof dir, "%s/knob_%s", ddp_test_parity_scratch(), runs[k].name);
    snprintf(extra, sizeof extra, "--max_steps 2 %s", runs[k].extra);
    free(train(launch, g_mlp, dir, extra));
  }
  for (int r = 0; r < 2; r++)
    for (int s = 0; s < 2; s++) {
      char p[4][800];
      ddp_st_file_t *f[4];
      for (int k = 0; k < 4; k++) {
        snprintf(p[k], sizeof p[k], "%s/knob_%s/rank%d/step%06d.safetensors",
                 ddp_test_parity_scratch(), runs[k].name, r, s);
        f[k] = st_open(p[k]);
      }
      ddp_tensor_t ix = st_get(f[0], "input.index");
      for (int64_t i = 0; i < ix.numel; i++) {
        int64_t want = (s * 8 + i) * 2 + r, got = ((const int64_t *)ix.data)[i];
        if (got != want)
          fail_msg("no shuffle: rank %d step %d row %lld: index %lld, want %lld", r, s,
                   (long long)i, (long long)got, (long long)want);
      }
      if (!same_bytes(f[1], f[2], "input.index"))
        fail_msg("rank %d step %d: data_seed 99 gave two orders", r, s);
      if (!same_bytes(f[1], f[3], "input.index"))
        fail_msg("rank %d step %d: data_seed 99 differs from seed 99 with data_seed unset", r, s);
      for (int k = 0; k < 4; k++) ddp_st_close(f[k]);
    }
}

/* ---------------------------------------------------------------- ddp-compare ----- */

/* Rewrites file `path` with tensors whose name starts with one of the prefixes (NULL-ended)
 * changed at element 0 by +delta (f32); metadata kept. */
static void plant(const char *path, const char *const *names, float delta) {
  ddp_st_file_t *f = st_open(path);
  size_t n = ddp_st_count(f), nm = ddp_st_meta_count(f);
  ddp_st_entry_t *e = calloc(n, sizeof *e);
  ddp_tensor_t *t = calloc(n, sizeof *t);
  const char **mk = calloc(nm + 1, sizeof *mk), **mv = calloc(nm + 1, sizeof *mv);
  assert_true(e && t && mk && mv);
  for (size_t i = 0; i < n; i++) {
    ddp_tensor_t v;
    assert_int_equal(ddp_st_tensor(f, i, &v), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&t[i], v.dtype, v.ndim, v.shape), DDP_OK);
    memcpy(t[i].data, v.data, ddp_tensor_nbytes(&v));
    for (const char *const *p = names; *p; p++)
      if (!strcmp(ddp_st_name(f, i), *p)) ((float *)t[i].data)[0] += delta;
    e[i] = (ddp_st_entry_t){ddp_st_name(f, i), &t[i]};
  }
  for (size_t i = 0; i < nm; i++) {
    mk[i] = ddp_st_meta_key(f, i);
    mv[i] = ddp_st_meta_value(f, i);
  }
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.new", path);
  ddp_error_t err = {0};
  if (ddp_st_write(tmp, e, n, mk, mv, nm, &err) != DDP_OK) fail_msg("%s", err.msg);
  for (size_t i = 0; i < n; i++) ddp_tensor_free(&t[i]);
  ddp_st_close(f);
  assert_int_equal(rename(tmp, path), 0);
  free(e);
  free(t);
  free(mk);
  free(mv);
}

/* Two planted cases on a copy of a dump with local gradients: a changed local gradient
 * (and the averaged one it feeds) at step 1 is "local gradients already differ"; a changed
 * averaged gradient alone is "only the averaged gradients differ". The untouched copy
 * compares equal. */
static void test_compare_diagnosis(void **state) {
  (void)state;
  if (access(ddp_test_tool("ddp-train"), X_OK) != 0 ||
      access(ddp_test_tool("ddp-compare"), X_OK) != 0)
    skip();
  write_models();
  char launch[64], base[600];
  snprintf(launch, sizeof launch, "'%s' --threads 2", ddp_test_tool("ddp-train"));
  snprintf(base, sizeof base, "%s/diag_a", ddp_test_parity_scratch());
  free(train(launch, g_mlp, base, "--max_steps 3 --dump_local_grads true"));
  const struct {
    const char *name, *verdict, *phrase;
    const char *tensors[3];
  } cases[] = {
      {"compute",
       "local_gradients_differ",
       "local gradients already differ",
       {"local_grad.0.weight", "grad.0.weight", NULL}},
      {"communication",
       "averaged_gradients_differ",
       "only the averaged gradients differ",
       {"grad.0.weight", NULL, NULL}},
  };
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out, "'%s' '%s' '%s'", ddp_test_tool("ddp-compare"), base, base);
  if (rc != 0) fail_msg("a dump against itself: exit %d: %s", rc, out);
  free(out);
  for (size_t c = 0; c < 2; c++) {
    char copy[700], file[800];
    snprintf(copy, sizeof copy, "%s/diag_%s", ddp_test_parity_scratch(), cases[c].name);
    assert_int_equal(ddp_test_run_cmd(NULL, "rm -rf '%s' && cp -r '%s' '%s'", copy, base, copy), 0);
    snprintf(file, sizeof file, "%s/rank1/step000001.safetensors", copy);
    plant(file, cases[c].tensors, 1e-3f);
    rc = ddp_test_run_cmd(&out, "'%s' --json '%s' '%s'", ddp_test_tool("ddp-compare"), base, copy);
    cJSON *j = cJSON_Parse(out);
    if (!j) fail_msg("%s: no JSON (exit %d): %s", cases[c].name, rc, out);
    assert_int_equal(rc, 1);
    const cJSON *d = ddp_test_json_get(j, "diagnosis");
    const char *v = ddp_test_json_get(d, "verdict")->valuestring;
    if (strcmp(v, cases[c].verdict) != 0)
      fail_msg("%s: verdict %s, want %s", cases[c].name, v, cases[c].verdict);
    assert_int_equal(ddp_test_json_get(d, "step")->valueint, 1);
    free(out);
    cJSON_Delete(j);
    rc = ddp_test_run_cmd(&out, "'%s' '%s' '%s'", ddp_test_tool("ddp-compare"), base, copy);
    if (!strstr(out, cases[c].phrase))
      fail_msg("%s: the report lacks \"%s\": %s", cases[c].name, cases[c].phrase, out);
    print_message("planted %-13s -> %s\n", cases[c].name, cases[c].phrase);
    free(out);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_flags_schedule),
      cmocka_unit_test(test_named_add_model),
      cmocka_unit_test(test_optim_skips_none),
      cmocka_unit_test(test_never_used_backends),
      cmocka_unit_test(test_adam_step_counts),
      cmocka_unit_test(test_set_to_none_false_bitwise),
      cmocka_unit_test(test_knobs),
      cmocka_unit_test(test_compare_diagnosis),
  };
  return ddp_test_parity_main("ddp_fidelity", tests, sizeof tests / sizeof tests[0]);
}
