/* Optimizers, clipping and LR schedules against PyTorch 1.13 (tools/torch/optim_oracle.py):
 * ten steps of every SGD/Adam/AdamW configuration equal torch.optim bit for bit, the HF
 * schedule multipliers equal the Python formulas, state saved and loaded continues
 * bitwise, and bad hyper-parameters give torch's messages. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/io.h"
#include "ddp/optim.h"
#include "harness.h"

#define NPARAMS 3
#define NSTEPS 10
static const int64_t shapes[NPARAMS][2] = {{37, 1}, {8, 5}, {3, 1}};
static const int shape_nd[NPARAMS] = {1, 2, 1};

static int64_t pnumel(int i) {
  return shape_nd[i] == 1 ? shapes[i][0] : shapes[i][0] * shapes[i][1];
}

typedef struct ocase {
  const char *name;
  ddp_optim_options_t o;
  bool f64;
  const char *sched; /* NULL: constant lr */
  int warmup, total;
  double cycles;
  double clip; /* 0: no clipping */
  /* Generated inputs (as doubles; rounded to f32 for f32 cases) and oracle outputs. */
  double p0[NPARAMS][40];
  double g[NSTEPS][NPARAMS][40];
  double expect[NSTEPS][NPARAMS][40];
  double expect_lr[NSTEPS];
  double expect_norm[NSTEPS];
  int got_steps;
} ocase_t;

static ddp_optim_options_t sgd(double lr, double mom, double damp, bool nest, double wd, bool max) {
  ddp_optim_options_t o = DDP_SGD_OPTIONS_INIT;
  o.lr = lr;
  o.momentum = mom;
  o.dampening = damp;
  o.nesterov = nest;
  o.weight_decay = wd;
  o.maximize = max;
  return o;
}

static ddp_optim_options_t adam(ddp_optim_kind_t k, double lr, double wd, bool ams, double b1,
                                double b2, double eps) {
  ddp_optim_options_t o = k == DDP_OPTIM_ADAM ? (ddp_optim_options_t)DDP_ADAM_OPTIONS_INIT
                                              : (ddp_optim_options_t)DDP_ADAMW_OPTIONS_INIT;
  o.lr = lr;
  o.weight_decay = wd;
  o.amsgrad = ams;
  o.beta1 = b1;
  o.beta2 = b2;
  o.eps = eps;
  return o;
}

static ocase_t *make_cases(size_t *n) {
  static const struct {
    const char *name;
    int which;
  } list[] = {{"sgd_plain", 0},
              {"sgd_momentum", 1},
              {"sgd_nesterov", 2},
              {"sgd_wd", 3},
              {"sgd_dampening", 4},
              {"sgd_maximize", 5},
              {"adam", 6},
              {"adam_wd", 7},
              {"adamw", 8},
              {"adam_amsgrad", 9},
              {"adamw_amsgrad_cosine", 10},
              {"adam_linear_clip", 11},
              {"sgd_f64", 12},
              {"adam_f64_amsgrad", 13},
              {"sgd_const_warmup_clip", 14},
              {"adamw_betas", 15}};
  *n = sizeof list / sizeof list[0];
  ocase_t *c = calloc(*n, sizeof *c);
  for (size_t i = 0; i < *n; i++) {
    ocase_t *k = &c[i];
    k->name = list[i].name;
    k->cycles = 0.5;
    switch (list[i].which) {
      case 0: k->o = sgd(0.1, 0, 0, false, 0, false); break;
      case 1: k->o = sgd(0.05, 0.9, 0, false, 0, false); break;
      case 2: k->o = sgd(0.05, 0.9, 0, true, 0, false); break;
      case 3: k->o = sgd(0.03, 0.9, 0, false, 0.01, false); break;
      case 4: k->o = sgd(0.05, 0.8, 0.3, false, 0, false); break;
      case 5: k->o = sgd(0.02, 0.5, 0, true, 1e-3, true); break;
      case 6: k->o = adam(DDP_OPTIM_ADAM, 1e-3, 0, false, 0.9, 0.999, 1e-8); break;
      case 7: k->o = adam(DDP_OPTIM_ADAM, 3e-3, 0.1, false, 0.9, 0.999, 1e-8); break;
      case 8: k->o = adam(DDP_OPTIM_ADAMW, 1e-2, 0.01, false, 0.9, 0.999, 1e-8); break;
      case 9: k->o = adam(DDP_OPTIM_ADAM, 1e-2, 0, true, 0.9, 0.999, 1e-8); break;
      case 10:
        k->o = adam(DDP_OPTIM_ADAMW, 5e-2, 0.05, true, 0.9, 0.99, 1e-6);
        k->sched = "cosine", k->warmup = 3, k->total = 10;
        break;
      case 11:
        k->o = adam(DDP_OPTIM_ADAM, 1e-2, 0, false, 0.9, 0.999, 1e-8);
        k->sched = "linear", k->warmup = 2, k->total = 8, k->clip = 1.0;
        break;
      case 12: k->o = sgd(0.05, 0.9, 0, true, 0.01, false), k->f64 = true; break;
      case 13:
        k->o = adam(DDP_OPTIM_ADAM, 1e-2, 0.01, true, 0.9, 0.999, 1e-8), k->f64 = true;
        break;
      case 14:
        k->o = sgd(0.1, 0.9, 0.1, false, 0, false);
        k->sched = "constant_with_warmup", k->warmup = 4, k->clip = 2.5;
        break;
      case 15: k->o = adam(DDP_OPTIM_ADAMW, 2e-2, 0.2, false, 0.5, 0.75, 1e-3); break;
    }
    /* Inputs: N(0,1) params; gradients N(0,1) times a per-step scale, so that second
     * moments rise and fall (amsgrad's max matters) and clipping engages on some steps. */
    ddp_rng_t r;
    ddp_rng_init(&r, 1234 + i, ddp_rng_stream(DDP_RNG_TEST, 0, 0));
    static const double scale[NSTEPS] = {1, 0.1, 3, 0.5, 2, 0.01, 1, 5, 0.2, 1};
    for (int p = 0; p < NPARAMS; p++)
      for (int64_t e = 0; e < pnumel(p); e++) {
        double v = ddp_rng_normal(&r);
        k->p0[p][e] = k->f64 ? v + 1e-9 * ddp_rng_normal(&r) : (double)(float)v;
      }
    for (int s = 0; s < NSTEPS; s++)
      for (int p = 0; p < NPARAMS; p++)
        for (int64_t e = 0; e < pnumel(p); e++) {
          double v = scale[s] * ddp_rng_normal(&r);
          if (e % 11 == 3) v = 0.0;
          k->g[s][p][e] = k->f64 ? v + 1e-9 * ddp_rng_normal(&r) : (double)(float)v;
        }
  }
  return c;
}

static void put_hex(FILE *f, const char *tag, const double *v, int64_t n, bool f64) {
  fputs(tag, f);
  for (int64_t e = 0; e < n; e++) {
    if (f64) {
      uint64_t b;
      memcpy(&b, &v[e], 8);
      fprintf(f, " %016llx", (unsigned long long)b);
    } else {
      float x = (float)v[e];
      uint32_t b;
      memcpy(&b, &x, 4);
      fprintf(f, " %08x", b);
    }
  }
  fputc('\n', f);
}

static int parse_hex(char *s, double *out, int64_t max, bool f64) {
  int64_t n = 0;
  char *tok = strtok(s, " \n");
  while (tok && n < max) {
    unsigned long long b = strtoull(tok, NULL, 16);
    if (f64) {
      memcpy(&out[n], &b, 8);
    } else {
      uint32_t w = (uint32_t)b;
      float x;
      memcpy(&x, &w, 4);
      out[n] = x;
    }
    n++;
    tok = strtok(NULL, " \n");
  }
  return (int)n;
}

/* Runs tools/torch/optim_oracle.py in `mode` from in to out and opens out for reading. NULL when
 * torch is unavailable: in and out are then removed and the caller skips. */
static FILE *run_oracle(const char *mode, const char *in, const char *out) {
  char args[512];
  snprintf(args, sizeof args, "%s %s %s", mode, in, out);
  if (!ddp_test_run_tool("optim_oracle.py", args)) {
    unlink(in);
    unlink(out);
    return NULL;
  }
  FILE *f = fopen(out, "r");
  assert_non_null(f);
  return f;
}

/* Runs one case in libddp; fills got[step][param][elem], lrs and norms. */
static void run_case(const ocase_t *k, double (*got)[NPARAMS][40], double *lrs, double *norms) {
  ddp_dtype_t dt = k->f64 ? DDP_F64 : DDP_F32;
  ddp_tensor_t p[NPARAMS], g[NPARAMS];
  ddp_optim_param_t pairs[NPARAMS];
  ddp_tensor_t *gp[NPARAMS];
  for (int i = 0; i < NPARAMS; i++) {
    assert_int_equal(ddp_tensor_alloc(&p[i], dt, shape_nd[i], shapes[i]), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&g[i], dt, shape_nd[i], shapes[i]), DDP_OK);
    for (int64_t e = 0; e < pnumel(i); e++) {
      if (k->f64)
        ((double *)p[i].data)[e] = k->p0[i][e];
      else
        ((float *)p[i].data)[e] = (float)k->p0[i][e];
    }
    pairs[i].param = &p[i];
    pairs[i].grad = &g[i];
    gp[i] = &g[i];
  }
  ddp_optim_t *opt = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_optim_create(&k->o, pairs, NPARAMS, &opt, &err), DDP_OK);
  ddp_lr_schedule_t sch = DDP_LR_SCHEDULE_INIT;
  if (k->sched) {
    assert_int_equal(ddp_lr_kind_from_name(k->sched, &sch.kind, &err), DDP_OK);
    sch.num_warmup_steps = k->warmup;
    sch.num_training_steps = k->total;
    sch.num_cycles = k->cycles;
    assert_int_equal(ddp_lr_schedule_check(&sch, &err), DDP_OK);
  }
  for (int s = 0; s < NSTEPS; s++) {
    if (k->sched) ddp_optim_set_lr(opt, ddp_lr_at(&sch, k->o.lr, s));
    lrs[s] = ddp_optim_get_lr(opt);
    for (int i = 0; i < NPARAMS; i++)
      for (int64_t e = 0; e < pnumel(i); e++) {
        if (k->f64)
          ((double *)g[i].data)[e] = k->g[s][i][e];
        else
          ((float *)g[i].data)[e] = (float)k->g[s][i][e];
      }
    if (k->clip > 0)
      assert_int_equal(ddp_clip_grad_norm(gp, NPARAMS, k->clip, 2.0, false, &norms[s], &err),
                       DDP_OK);
    assert_int_equal(ddp_optim_step(opt, &err), DDP_OK);
    for (int i = 0; i < NPARAMS; i++)
      for (int64_t e = 0; e < pnumel(i); e++)
        got[s][i][e] = k->f64 ? ((double *)p[i].data)[e] : ((float *)p[i].data)[e];
  }
  ddp_optim_destroy(opt);
  for (int i = 0; i < NPARAMS; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
  }
}

/* Every optimizer configuration, 10 steps, against torch.optim: bitwise for unclipped cases
 * and <= 1e-6 relative where clipping's norm may differ in the last bit. */
static void test_optim_vs_torch(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  size_t ncase;
  ocase_t *cases = make_cases(&ncase);
  char in[128], out[128];
  ddp_test_tmp_file(in, sizeof in, "optim", "in");
  ddp_test_tmp_file(out, sizeof out, "optim", "out");
  FILE *f = fopen(in, "w");
  for (size_t c = 0; c < ncase; c++) {
    ocase_t *k = &cases[c];
    const ddp_optim_options_t *o = &k->o;
    fprintf(f,
            "case %s %s lr=%.17g momentum=%.17g dampening=%.17g nesterov=%d "
            "weight_decay=%.17g maximize=%d beta1=%.17g beta2=%.17g eps=%.17g amsgrad=%d "
            "dtype=%s",
            k->name,
            o->kind == DDP_OPTIM_SGD    ? "sgd"
            : o->kind == DDP_OPTIM_ADAM ? "adam"
                                        : "adamw",
            o->lr, o->momentum, o->dampening, o->nesterov, o->weight_decay, o->maximize, o->beta1,
            o->beta2, o->eps, o->amsgrad, k->f64 ? "f64" : "f32");
    if (k->sched)
      fprintf(f, " sched=%s warmup=%d total=%d cycles=%.17g", k->sched, k->warmup, k->total,
              k->cycles);
    if (k->clip > 0) fprintf(f, " clip=%.17g", k->clip);
    fputc('\n', f);
    for (int i = 0; i < NPARAMS; i++) {
      if (shape_nd[i] == 1)
        fprintf(f, "shape %lld\n", (long long)shapes[i][0]);
      else
        fprintf(f, "shape %lld %lld\n", (long long)shapes[i][0], (long long)shapes[i][1]);
    }
    fprintf(f, "steps %d\n", NSTEPS);
    for (int i = 0; i < NPARAMS; i++) put_hex(f, "p", k->p0[i], pnumel(i), k->f64);
    for (int s = 0; s < NSTEPS; s++)
      for (int i = 0; i < NPARAMS; i++) put_hex(f, "g", k->g[s][i], pnumel(i), k->f64);
    fprintf(f, "end\n");
  }
  fclose(f);
  f = run_oracle("steps", in, out);
  if (!f) {
    free(cases);
    skip();
  }
  /* Parse the oracle's answers. */
  char *line = NULL;
  size_t cap = 0;
  ocase_t *cur = NULL;
  int step = 0, param = 0;
  while (getline(&line, &cap, f) > 0) {
    if (strncmp(line, "case ", 5) == 0) {
      line[strcspn(line, "\n")] = '\0';
      cur = NULL;
      for (size_t c = 0; c < ncase; c++)
        if (strcmp(cases[c].name, line + 5) == 0) cur = &cases[c];
      assert_non_null(cur);
      step = 0;
      param = 0;
    } else if (strncmp(line, "lr ", 3) == 0) {
      cur->expect_lr[step] = strtod(line + 3, NULL);
    } else if (strncmp(line, "norm ", 5) == 0) {
      double v;
      assert_int_equal(parse_hex(line + 5, &v, 1, cur->f64), 1);
      cur->expect_norm[step] = v;
    } else if (strncmp(line, "p ", 2) == 0) {
      assert_int_equal(parse_hex(line + 2, cur->expect[step][param], 40, cur->f64), pnumel(param));
      if (++param == NPARAMS) {
        param = 0;
        cur->got_steps = ++step;
      }
    }
  }
  free(line);
  fclose(f);
  unlink(in);
  unlink(out);

  double(*got)[NPARAMS][40] = calloc(NSTEPS, sizeof *got);
  double lrs[NSTEPS], norms[NSTEPS];
  for (size_t c = 0; c < ncase; c++) {
    ocase_t *k = &cases[c];
    assert_int_equal(k->got_steps, NSTEPS);
    run_case(k, got, lrs, norms);
    int64_t bit_diff = 0;
    double worst = 0;
    for (int s = 0; s < NSTEPS; s++) {
      if (lrs[s] != k->expect_lr[s])
        fail_msg("%s step %d: lr %.17g, torch's LambdaLR %.17g", k->name, s, lrs[s],
                 k->expect_lr[s]);
      if (k->clip > 0) {
        double rel = fabs(norms[s] - k->expect_norm[s]) / fabs(k->expect_norm[s]);
        if (rel > 1e-6)
          fail_msg("%s step %d: clip norm %.9g, torch %.9g", k->name, s, norms[s],
                   k->expect_norm[s]);
      }
      /* Relative to the tensor's magnitude (its largest |value|): an update that cancels
       * to near zero carries the rounding of the O(1) terms it came from. */
      for (int i = 0; i < NPARAMS; i++) {
        double mag = 0;
        for (int64_t e = 0; e < pnumel(i); e++)
          if (fabs(k->expect[s][i][e]) > mag) mag = fabs(k->expect[s][i][e]);
        for (int64_t e = 0; e < pnumel(i); e++) {
          double a = got[s][i][e], b = k->expect[s][i][e];
          if (a != b) bit_diff++;
          double rel = fabs(a - b) / mag;
          if (rel > worst) worst = rel;
          if (rel > 1e-6)
            fail_msg("%s step %d param %d elem %lld: libddp %.9g, torch %.9g (rel %.3g)", k->name,
                     s, i, (long long)e, a, b, rel);
        }
      }
    }
    if (k->clip == 0 && bit_diff != 0)
      fail_msg("%s: %lld values differ from torch in the last bits (worst rel %.3g); the "
               "update arithmetic should be bitwise equal",
               k->name, (long long)bit_diff, worst);
    printf("  %-24s 10 steps: %lld values off by rounding, worst rel %.3g\n", k->name,
           (long long)bit_diff, worst);
  }
  free(got);
  free(cases);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* HF schedule multipliers against the Python formulas, and LambdaLR's lr, exactly. */
static void test_schedules_vs_python(void **state) {
  (void)state;
  /* kwargs: the schedule's other lr_scheduler_kwargs, as the Python side reads them (JSON
   * with no spaces; "" for none), and the same values set below. */
  static const struct {
    const char *kind;
    int warmup, total;
    double cycles;
    const char *kwargs;
    double lr_end, power, rate;
    int timescale;
  } sc[] = {{"constant", 0, 0, 0.5, NULL, 0, 0, 0, 0},
            {"constant_with_warmup", 5, 0, 0.5, NULL, 0, 0, 0, 0},
            {"constant_with_warmup", 0, 0, 0.5, NULL, 0, 0, 0, 0},
            {"linear", 10, 100, 0.5, NULL, 0, 0, 0, 0},
            {"linear", 0, 37, 0.5, NULL, 0, 0, 0, 0},
            {"linear", 50, 50, 0.5, NULL, 0, 0, 0, 0},
            {"cosine", 10, 100, 0.5, NULL, 0, 0, 0, 0},
            {"cosine", 0, 30, 0.5, NULL, 0, 0, 0, 0},
            {"cosine", 7, 60, 1.5, NULL, 0, 0, 0, 0},
            {"cosine", 3, 3, 0.5, NULL, 0, 0, 0, 0},
            {"linear", 1, 1, 0.5, NULL, 0, 0, 0, 0},
            {"cosine_with_restarts", 10, 100, 1, NULL, 0, 0, 0, 0},
            {"cosine_with_restarts", 0, 50, 3, NULL, 0, 0, 0, 0},
            {"cosine_with_restarts", 5, 77, 2.5, NULL, 0, 0, 0, 0},
            {"polynomial", 10, 100, 0, NULL, 0, 0, 0, 0},
            {"polynomial", 0, 33, 0, NULL, 0, 0, 0, 0},
            {"inverse_sqrt", 10, 0, 0, NULL, 0, 0, 0, 0},
            {"inverse_sqrt", 0, 0, 0, NULL, 0, 0, 0, 0},
            {"polynomial", 5, 90, 0, "{\"lr_end\":1e-5,\"power\":2.5}", 1e-5, 2.5, 0, 0},
            {"polynomial", 0, 40, 0, "{\"power\":0.5}", 1e-7, 0.5, 0, 0},
            {"inverse_sqrt", 4, 0, 0, "{\"timescale\":30}", 0, 0, 0, 30},
            {"cosine_with_min_lr", 10, 100, 0.5, "{\"min_lr_rate\":0.1}", 0, 0, 0.1, 0},
            {"cosine_with_min_lr", 0, 60, 1.5, "{\"min_lr_rate\":0.25}", 0, 0, 0.25, 0},
            {"cosine_with_min_lr", 3, 3, 0.5, "{\"min_lr_rate\":0.5}", 0, 0, 0.5, 0}};
  const int nsteps = 120;
  const double base = 3e-4;
  char in[128], out[128];
  ddp_test_tmp_file(in, sizeof in, "optim", "sched_in");
  ddp_test_tmp_file(out, sizeof out, "optim", "sched_out");
  FILE *f = fopen(in, "w");
  for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++)
    fprintf(f, "%s %d %d %.17g %d %.17g %s\n", sc[i].kind, sc[i].warmup, sc[i].total, sc[i].cycles,
            nsteps, base, sc[i].kwargs ? sc[i].kwargs : "");
  fclose(f);
  f = run_oracle("sched", in, out);
  if (!f) skip();
  char *line = NULL;
  size_t cap = 0;
  for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
    ddp_lr_schedule_t s = DDP_LR_SCHEDULE_INIT;
    ddp_error_t err = {0};
    assert_int_equal(ddp_lr_kind_from_name(sc[i].kind, &s.kind, &err), DDP_OK);
    s.num_warmup_steps = sc[i].warmup;
    s.num_training_steps = sc[i].total;
    s.num_cycles = sc[i].cycles;
    s.lr_init = base; /* polynomial: the optimizer's lr, as HF reads it */
    if (sc[i].kwargs) {
      if (sc[i].lr_end) s.lr_end = sc[i].lr_end;
      if (sc[i].power) s.power = sc[i].power;
      s.min_lr_rate = sc[i].rate;
      s.timescale = sc[i].timescale;
    }
    assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_OK);
    for (int which = 0; which < 2; which++) {
      assert_true(getline(&line, &cap, f) > 0);
      DDP_ASSERT_PREFIX(line, which ? "lr " : "lam ");
      char *p = line + (which ? 3 : 4);
      for (int st = 0; st < nsteps; st++) {
        char *end;
        double want = strtod(p, &end);
        assert_true(end != p);
        p = end;
        double have = which ? ddp_lr_at(&s, base, st) : ddp_lr_lambda(&s, st);
        if (have != want)
          fail_msg("%s(w=%d,t=%d,c=%g) step %d: %s %.17g, python %.17g", sc[i].kind, sc[i].warmup,
                   sc[i].total, sc[i].cycles, st, which ? "lr" : "lambda", have, want);
      }
    }
  }
  free(line);
  fclose(f);
  unlink(in);
  unlink(out);
}

/* Schedule names and argument checks. */
static void test_schedule_errors(void **state) {
  (void)state;
  ddp_lr_kind_t k;
  ddp_error_t err = {0};
  assert_int_equal(ddp_lr_kind_from_name("reduce_lr_on_plateau", &k, &err),
                   DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "constant_with_warmup"));
  assert_non_null(strstr(err.msg, "reduce_lr_on_plateau"));
  assert_non_null(strstr(err.msg, "inverse_sqrt"));
  for (int i = 0; i < 8; i++) {
    assert_int_equal(ddp_lr_kind_from_name(ddp_lr_kind_name((ddp_lr_kind_t)i), &k, &err), DDP_OK);
    assert_int_equal((int)k, i);
  }
  ddp_lr_schedule_t s = DDP_LR_SCHEDULE_INIT;
  s.kind = DDP_LR_COSINE;
  s.num_training_steps = 0;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "num_training_steps"));
  s.num_training_steps = 10;
  s.num_warmup_steps = -1;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_ERR_INVALID_ARGUMENT);
  s.num_warmup_steps = 2;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_OK);
  /* Polynomial: HF's ValueError when lr_end is not below the optimizer's lr, and a decay
   * that would divide by zero steps. */
  s.kind = DDP_LR_POLYNOMIAL;
  s.lr_init = 1e-7;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "lr_end (1e-07) must be smaller than initial lr (1e-07)"));
  s.lr_init = 1e-3;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_OK);
  s.num_warmup_steps = 10;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "must exceed num_warmup_steps 10"));
  s.num_warmup_steps = 2;
  s.kind = DDP_LR_COSINE_WITH_RESTARTS;
  s.num_cycles = -1;
  assert_int_equal(ddp_lr_schedule_check(&s, &err), DDP_ERR_INVALID_ARGUMENT);
  s.num_cycles = 0.5;
  /* Linear decays to exactly zero at num_training_steps and stays there. */
  s.kind = DDP_LR_LINEAR;
  DDP_ASSERT_EQ(ddp_lr_lambda(&s, 10), 0.0);
  DDP_ASSERT_EQ(ddp_lr_lambda(&s, 25), 0.0);
  DDP_ASSERT_EQ(ddp_lr_lambda(&s, 1), 0.5);
  DDP_ASSERT_EQ(ddp_lr_lambda(&s, 2), 1.0);
}

/* Hyper-parameter validation with torch's messages. */
static void test_option_errors(void **state) {
  (void)state;
  ddp_tensor_t p, g;
  int64_t shape[1] = {4};
  assert_int_equal(ddp_tensor_alloc(&p, DDP_F32, 1, shape), DDP_OK);
  assert_int_equal(ddp_tensor_alloc(&g, DDP_F32, 1, shape), DDP_OK);
  ddp_optim_param_t pr = {&p, &g};
  ddp_optim_t *opt = NULL;
  ddp_error_t err = {0};
  ddp_optim_options_t o = DDP_SGD_OPTIONS_INIT;
  o.lr = -1;
  assert_int_equal(ddp_optim_create(&o, &pr, 1, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "Invalid learning rate"));
  o.lr = 0.1;
  o.nesterov = true;
  assert_int_equal(ddp_optim_create(&o, &pr, 1, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "Nesterov momentum requires a momentum and zero dampening"));
  ddp_optim_options_t a = DDP_ADAM_OPTIONS_INIT;
  a.beta2 = 1.0;
  assert_int_equal(ddp_optim_create(&a, &pr, 1, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "Invalid beta parameter at index 1"));
  a.beta2 = 0.999;
  a.eps = -1;
  assert_int_equal(ddp_optim_create(&a, &pr, 1, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "Invalid epsilon value"));
  a.eps = 1e-8;
  /* A grad of another size is refused, naming the parameter. */
  ddp_tensor_t g2;
  int64_t s2[1] = {5};
  assert_int_equal(ddp_tensor_alloc(&g2, DDP_F32, 1, s2), DDP_OK);
  ddp_optim_param_t bad[2] = {{&p, &g}, {&p, &g2}};
  assert_int_equal(ddp_optim_create(&a, bad, 2, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "parameter 1"));
  assert_null(opt);
  /* An integer parameter is refused. */
  ddp_tensor_t pi;
  assert_int_equal(ddp_tensor_alloc(&pi, DDP_I32, 1, shape), DDP_OK);
  ddp_optim_param_t bi = {&pi, &pi};
  assert_int_equal(ddp_optim_create(&a, &bi, 1, &opt, &err), DDP_ERR_INVALID_ARGUMENT);
  /* A caller built against an older header (a smaller struct_size) gets its kind's
   * defaults past its struct: AdamW's weight decay 1e-2, Adam's betas. */
  ddp_optim_options_t old = DDP_ADAMW_OPTIONS_INIT;
  old.lr = 0.5;
  old.weight_decay = old.beta2 = -7;
  old.struct_size = offsetof(ddp_optim_options_t, weight_decay);
  assert_int_equal(ddp_optim_create(&old, &pr, 1, &opt, &err), DDP_OK);
  assert_float_equal(ddp_optim_options(opt)->lr, 0.5, 0);
  assert_float_equal(ddp_optim_options(opt)->weight_decay, 1e-2, 0);
  assert_float_equal(ddp_optim_options(opt)->beta2, 0.999, 0);
  assert_int_equal(ddp_optim_options(opt)->struct_size, sizeof(ddp_optim_options_t));
  ddp_optim_destroy(opt);
  ddp_tensor_free(&pi);
  ddp_tensor_free(&g2);
  ddp_tensor_free(&p);
  ddp_tensor_free(&g);
}

/* zero_grad zero-fills by default; set_to_none releases the grad, and a None grad leaves
 * its parameter and state untouched on step, as in torch. */
static void test_zero_grad(void **state) {
  (void)state;
  ddp_tensor_t p[2], g[2];
  int64_t shape[1] = {6};
  ddp_optim_param_t pr[2];
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ddp_tensor_alloc(&p[i], DDP_F32, 1, shape), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&g[i], DDP_F32, 1, shape), DDP_OK);
    for (int e = 0; e < 6; e++) {
      ((float *)p[i].data)[e] = (float)(e + 1);
      ((float *)g[i].data)[e] = 0.5f;
    }
    pr[i].param = &p[i];
    pr[i].grad = &g[i];
  }
  ddp_optim_options_t o = DDP_ADAM_OPTIONS_INIT;
  ddp_optim_t *opt;
  ddp_error_t err = {0};
  assert_int_equal(ddp_optim_create(&o, pr, 2, &opt, &err), DDP_OK);
  ddp_optim_zero_grad(opt, false);
  for (int i = 0; i < 2; i++)
    for (int e = 0; e < 6; e++) DDP_ASSERT_EQ(((float *)g[i].data)[e], 0.0f);
  /* Free grad 1 ("None"), give grad 0 a value, step: param 1 must not move. */
  ddp_tensor_free(&g[1]);
  assert_null(g[1].data);
  for (int e = 0; e < 6; e++) ((float *)g[0].data)[e] = 1.0f;
  assert_int_equal(ddp_optim_step(opt, &err), DDP_OK);
  for (int e = 0; e < 6; e++) {
    DDP_ASSERT_EQ(((float *)p[1].data)[e], (float)(e + 1));
    /* Adam's first step moves by lr * m_hat / (sqrt(v_hat) + eps) ~= lr. */
    assert_true(fabs(((float *)p[0].data)[e] - ((double)(e + 1) - 1e-3)) < 1e-5);
  }
  ddp_optim_zero_grad(opt, true);
  assert_null(g[0].data);
  assert_int_equal(ddp_optim_step(opt, &err), DDP_OK); /* nothing to do */
  ddp_optim_destroy(opt);
  for (int i = 0; i < 2; i++) {
    ddp_tensor_free(&p[i]);
    ddp_tensor_free(&g[i]);
  }
}

/* clip_grad_norm_ against a naive double computation on f64 grads (where the per-tensor
 * norms are exact to rounding), for the L2 and infinity norms, and with no clipping
 * needed (coef clamps to 1, grads unchanged). */
static void test_clip_naive(void **state) {
  (void)state;
  ddp_tensor_t g[3];
  int64_t sizes[3] = {10, 1, 33};
  ddp_rng_t r;
  ddp_rng_init(&r, 99, ddp_rng_stream(DDP_RNG_TEST, 1, 0));
  double orig[3][33];
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ddp_tensor_alloc(&g[i], DDP_F64, 1, &sizes[i]), DDP_OK);
    for (int64_t e = 0; e < sizes[i]; e++)
      orig[i][e] = ((double *)g[i].data)[e] = 3.0 * ddp_rng_normal(&r);
  }
  ddp_tensor_t *gp[3] = {&g[0], &g[1], &g[2]};
  double sq = 0, mx = 0;
  for (int i = 0; i < 3; i++) {
    double t = 0;
    for (int64_t e = 0; e < sizes[i]; e++) {
      t += orig[i][e] * orig[i][e];
      if (fabs(orig[i][e]) > mx) mx = fabs(orig[i][e]);
    }
    sq += t;
  }
  double want = sqrt(sq), total = 0;
  ddp_error_t err = {0};
  assert_int_equal(ddp_clip_grad_norm(gp, 3, 1.0, 2.0, true, &total, &err), DDP_OK);
  assert_true(fabs(total - want) <= 1e-12 * want);
  double coef = 1.0 / (want + 1e-6);
  for (int i = 0; i < 3; i++)
    for (int64_t e = 0; e < sizes[i]; e++)
      assert_true(fabs(((double *)g[i].data)[e] - orig[i][e] * coef) <= 1e-12 * fabs(orig[i][e]));
  /* Infinity norm on the original values. */
  for (int i = 0; i < 3; i++) memcpy(g[i].data, orig[i], (size_t)sizes[i] * 8);
  assert_int_equal(ddp_clip_grad_norm(gp, 3, 0.5, INFINITY, false, &total, &err), DDP_OK);
  DDP_ASSERT_EQ(total, mx);
  /* A large max_norm: coefficient 1, values unchanged. */
  for (int i = 0; i < 3; i++) memcpy(g[i].data, orig[i], (size_t)sizes[i] * 8);
  assert_int_equal(ddp_clip_grad_norm(gp, 3, 1e6, 2.0, false, &total, &err), DDP_OK);
  for (int i = 0; i < 3; i++) assert_memory_equal(g[i].data, orig[i], (size_t)sizes[i] * 8);
  /* Non-finite total with error_if_nonfinite: an error, and nothing is scaled. */
  ((double *)g[2].data)[5] = NAN;
  assert_int_equal(ddp_clip_grad_norm(gp, 3, 1.0, 2.0, true, &total, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "non-finite"));
  assert_memory_equal(g[0].data, orig[0], (size_t)sizes[0] * 8);
  assert_int_equal(ddp_clip_grad_norm(gp, 3, 1.0, 1.0, false, &total, &err), DDP_ERR_UNSUPPORTED);
  for (int i = 0; i < 3; i++) ddp_tensor_free(&g[i]);
}

/* Save after 5 steps, load into a fresh optimizer over copies of the parameters, run 5
 * more steps on both: the parameters stay bitwise equal. Also checks PyTorch's names. */
static void roundtrip(ddp_optim_options_t o, bool f64) {
  ddp_dtype_t dt = f64 ? DDP_F64 : DDP_F32;
  ddp_tensor_t pa[2], pb[2], g[2];
  ddp_optim_param_t A[2], B[2];
  int64_t shape[2][1] = {{13}, {7}};
  ddp_rng_t r;
  ddp_rng_init(&r, 5, ddp_rng_stream(DDP_RNG_TEST, 2, (uint64_t)o.kind));
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ddp_tensor_alloc(&pa[i], dt, 1, shape[i]), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&pb[i], dt, 1, shape[i]), DDP_OK);
    assert_int_equal(ddp_tensor_alloc(&g[i], dt, 1, shape[i]), DDP_OK);
    for (int e = 0; e < shape[i][0]; e++) {
      if (f64)
        ((double *)pa[i].data)[e] = ddp_rng_normal(&r);
      else
        ((float *)pa[i].data)[e] = ddp_rng_normal(&r);
    }
    A[i] = (ddp_optim_param_t){&pa[i], &g[i]};
    B[i] = (ddp_optim_param_t){&pb[i], &g[i]};
  }
  ddp_optim_t *oa, *ob;
  ddp_error_t err = {0};
  assert_int_equal(ddp_optim_create(&o, A, 2, &oa, &err), DDP_OK);
  o.lr *= 7; /* B starts with another lr: load must restore A's */
  assert_int_equal(ddp_optim_create(&o, B, 2, &ob, &err), DDP_OK);
  for (int s = 0; s < 10; s++) {
    if (s == 5) {
      char path[128];
      ddp_test_tmp_file(path, sizeof path, "optim", "state");
      assert_int_equal(ddp_optim_save(oa, path, &err), DDP_OK);
      for (int i = 0; i < 2; i++) memcpy(pb[i].data, pa[i].data, ddp_tensor_nbytes(&pa[i]));
      assert_int_equal(ddp_optim_load(ob, path, &err), DDP_OK);
      DDP_ASSERT_EQ(ddp_optim_get_lr(ob), ddp_optim_get_lr(oa));
      ddp_st_file_t *f;
      assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, &err), DDP_OK);
      size_t idx;
      if (o.kind == DDP_OPTIM_SGD) {
        assert_int_equal(ddp_st_find(f, "state.1.momentum_buffer", &idx), DDP_OK);
      } else {
        assert_int_equal(ddp_st_find(f, "state.0.exp_avg", &idx), DDP_OK);
        assert_int_equal(ddp_st_find(f, "state.1.exp_avg_sq", &idx), DDP_OK);
        assert_int_equal(ddp_st_find(f, "state.1.step", &idx), DDP_OK);
        ddp_tensor_t st;
        assert_int_equal(ddp_st_tensor(f, idx, &st), DDP_OK);
        assert_int_equal(st.dtype, DDP_F32);
        DDP_ASSERT_EQ(*(float *)st.data, 5.0f);
        assert_int_equal(ddp_st_find(f, "state.0.max_exp_avg_sq", &idx),
                         o.amsgrad ? DDP_OK : DDP_ERR_NOT_FOUND);
      }
      ddp_st_close(f);
      /* A state file of another optimizer kind is refused. */
      ddp_optim_options_t other = o.kind == DDP_OPTIM_SGD
                                      ? (ddp_optim_options_t)DDP_ADAM_OPTIONS_INIT
                                      : (ddp_optim_options_t)DDP_SGD_OPTIONS_INIT;
      ddp_optim_t *oc;
      assert_int_equal(ddp_optim_create(&other, B, 2, &oc, &err), DDP_OK);
      assert_int_equal(ddp_optim_load(oc, path, &err), DDP_ERR_INVALID_DATA);
      assert_non_null(strstr(err.msg, "optimizer"));
      ddp_optim_destroy(oc);
      unlink(path);
    }
    for (int i = 0; i < 2; i++)
      for (int e = 0; e < shape[i][0]; e++) {
        double v = (s % 3 + 1) * ddp_rng_normal(&r);
        if (f64)
          ((double *)g[i].data)[e] = v;
        else
          ((float *)g[i].data)[e] = (float)v;
      }
    assert_int_equal(ddp_optim_step(oa, &err), DDP_OK);
    if (s >= 5) assert_int_equal(ddp_optim_step(ob, &err), DDP_OK);
  }
  for (int i = 0; i < 2; i++) {
    assert_memory_equal(pa[i].data, pb[i].data, ddp_tensor_nbytes(&pa[i]));
    ddp_tensor_free(&pa[i]);
    ddp_tensor_free(&pb[i]);
    ddp_tensor_free(&g[i]);
  }
  ddp_optim_destroy(oa);
  ddp_optim_destroy(ob);
}

static void test_state_roundtrip(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  ddp_optim_options_t s = DDP_SGD_OPTIONS_INIT;
  s.lr = 0.05;
  s.momentum = 0.9;
  s.nesterov = true;
  roundtrip(s, false);
  ddp_optim_options_t a = DDP_ADAM_OPTIONS_INIT;
  a.amsgrad = true;
  a.weight_decay = 0.01;
  roundtrip(a, false);
  ddp_optim_options_t w = DDP_ADAMW_OPTIONS_INIT;
  roundtrip(w, true);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optim_vs_torch),  cmocka_unit_test(test_schedules_vs_python),
      cmocka_unit_test(test_schedule_errors), cmocka_unit_test(test_option_errors),
      cmocka_unit_test(test_zero_grad),       cmocka_unit_test(test_clip_naive),
      cmocka_unit_test(test_state_roundtrip),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
