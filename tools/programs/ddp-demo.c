/* ddp-demo: data-parallel training of a small MLP on the UCI 8x8 digits, end to end.
 *
 * Until the DDP reducer and ddp-train exist this is the most complete thing libddp runs:
 * W ranks (threads of this process with --threads, or processes under ddprun with the shm or
 * tcp backend) each build the same model from a JSON description, take rank 0's initial
 * weights by broadcast, read their own shard of the data through DistributedSampler, and
 * after every backward average their gradients with one allreduce over the flat gradient
 * buffer (what DDP does with a single bucket), then step SGD with momentum. Every 25 steps
 * rank 0 prints the mean loss over ranks; at the end every rank hashes its parameters and
 * the hashes are allgathered, so the run proves the replicas stayed bit-identical.
 *
 *   ddp-demo [--threads N] [--steps S] [--batch B] [--lr LR] [--seed S] [--data FILE]
 *   ddprun --nproc_per_node 2 --backend shm ddp-demo --steps 100
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp.h"

#ifndef DDP_DEMO_DATA
#define DDP_DEMO_DATA "tests/data/digits.safetensors"
#endif

static const char *model_json = "{\"dtype\": \"f32\", \"layers\": ["
                                "{\"type\": \"linear\", \"in\": 64, \"out\": 128},"
                                "{\"type\": \"layernorm\", \"dim\": 128},"
                                "{\"type\": \"relu\"},"
                                "{\"type\": \"linear\", \"in\": 128, \"out\": 128},"
                                "{\"type\": \"relu\"},"
                                "{\"type\": \"linear\", \"in\": 128, \"out\": 10}]}";

typedef struct demo_config {
  int threads;
  int steps;
  int batch;
  double lr;
  uint64_t seed;
  const char *data;
} demo_config_t;

/* What rank 0 reports back to main() for the summary. */
typedef struct demo_result {
  double first_loss, last_loss, accuracy, seconds;
  int identical;
} demo_result_t;

typedef struct demo_arg {
  const demo_config_t *cfg;
  demo_result_t *result;
} demo_arg_t;

#define CHECK(call, what)                                                                      \
  do {                                                                                         \
    ddp_status_t st_ = (call);                                                                 \
    if (st_ != DDP_OK) {                                                                       \
      fprintf(stderr, "ddp-demo: rank %d: %s failed: %s\n", rank, what, ddp_status_name(st_)); \
      return st_;                                                                              \
    }                                                                                          \
  } while (0)

static uint64_t fnv1a(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/* Fraction of the whole dataset the model classifies correctly (no grad). */
static ddp_status_t evaluate(ddp_model_t *model, ddp_ctx_t *ctx, const ddp_dataset_t *ds,
                             double *accuracy) {
  int64_t n = ddp_dataset_length(ds), correct = 0;
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = 256;
  ddp_loader_t *loader = NULL;
  ddp_status_t st = ddp_loader_create(ds, NULL, &lo, &loader, NULL);
  if (st != DDP_OK) return st;
  bool prev = ddp_ctx_set_grad_enabled(ctx, false);
  ddp_model_train(model, false);
  for (;;) {
    ddp_batch_t b;
    bool has = false;
    if ((st = ddp_loader_next(loader, &b, &has, NULL)) != DDP_OK || !has) break;
    ddp_var_t *x, *y;
    if ((st = ddp_var_new(ctx, DDP_F32, b.features.ndim, b.features.shape, b.features.data, false,
                          &x)) != DDP_OK ||
        (st = ddp_model_forward(model, ctx, x, 0, &y)) != DDP_OK) {
      break;
    }
    const float *logits = y->value.data;
    const int64_t *labels = b.labels.data;
    for (int64_t i = 0; i < b.size; i++) {
      int best = 0;
      for (int c = 1; c < 10; c++) {
        if (logits[i * 10 + c] > logits[i * 10 + best]) best = c;
      }
      correct += best == labels[i];
    }
    ddp_ctx_reset(ctx);
  }
  ddp_model_train(model, true);
  ddp_ctx_set_grad_enabled(ctx, prev);
  ddp_loader_destroy(loader);
  *accuracy = n ? (double)correct / (double)n : 0.0;
  return st;
}

static ddp_status_t run_rank(ddp_pg_t *pg, void *argp) {
  demo_arg_t *arg = argp;
  const demo_config_t *cfg = arg->cfg;
  int rank = ddp_pg_rank(pg), world = ddp_pg_size(pg);
  ddp_error_t err = {0};
  ddp_model_t *model = NULL;
  ddp_ctx_t *ctx = NULL;
  ddp_dataset_t *ds = NULL;
  ddp_sampler_t *sampler = NULL;
  ddp_loader_t *loader = NULL;
  ddp_optim_t *opt = NULL;
  ddp_optim_param_t *pairs = NULL;
  ddp_status_t st;

  /* Every rank draws its own initial weights from a rank-dependent seed, on purpose: the
   * broadcast from rank 0 below is what makes the replicas equal, as in DDP's constructor. */
  if ((st = ddp_model_from_json(model_json, &model, &err)) != DDP_OK ||
      (st = ddp_model_init(model, cfg->seed + (uint64_t)rank)) != DDP_OK ||
      (st = ddp_ctx_create(&ctx)) != DDP_OK ||
      (st = ddp_dataset_from_safetensors(cfg->data, NULL, NULL, &ds, &err)) != DDP_OK) {
    fprintf(stderr, "ddp-demo: rank %d: setup failed: %s %s\n", rank, ddp_status_name(st), err.msg);
    goto out;
  }
  ddp_tensor_t params = ddp_model_flat_params(model, DDP_F32);
  ddp_tensor_t grads = ddp_model_flat_grads(model, DDP_F32);
  ddp_work_t *work = NULL;
  if ((st = ddp_broadcast(pg, params.data, (size_t)params.numel, DDP_F32, 0, &work)) != DDP_OK ||
      (st = ddp_work_wait_free(work)) != DDP_OK) {
    ddp_pg_last_error_copy(pg, &err);
    fprintf(stderr, "ddp-demo: rank %d: broadcast: %s\n", rank, err.msg);
    goto out;
  }

  ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
  so.dataset_len = ddp_dataset_length(ds);
  so.num_replicas = world;
  so.rank = rank;
  so.seed = cfg->seed;
  ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
  lo.batch_size = cfg->batch;
  lo.drop_last = true;
  size_t np = ddp_model_num_params(model);
  pairs = calloc(np, sizeof *pairs);
  if (!pairs) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(model, i);
    pairs[i].param = &p->value;
    pairs[i].grad = &p->grad;
  }
  ddp_optim_options_t oo = DDP_SGD_OPTIONS_INIT;
  oo.lr = cfg->lr;
  oo.momentum = 0.9;
  if ((st = ddp_sampler_create(&so, &sampler, &err)) != DDP_OK ||
      (st = ddp_loader_create(ds, sampler, &lo, &loader, &err)) != DDP_OK ||
      (st = ddp_optim_create(&oo, pairs, np, &opt, &err)) != DDP_OK) {
    fprintf(stderr, "ddp-demo: rank %d: %s %s\n", rank, ddp_status_name(st), err.msg);
    goto out;
  }

  int64_t t0 = ddp_now_ns(), epoch = 0;
  double window = 0.0;
  int in_window = 0;
  for (int step = 1; step <= cfg->steps; step++) {
    ddp_batch_t b;
    bool has = false;
    if ((st = ddp_loader_next(loader, &b, &has, &err)) != DDP_OK) goto out;
    if (!has) {
      if ((st = ddp_loader_set_epoch(loader, ++epoch, &err)) != DDP_OK ||
          (st = ddp_loader_next(loader, &b, &has, &err)) != DDP_OK) {
        goto out;
      }
    }
    ddp_var_t *x, *t, *logits, *loss;
    ddp_optim_zero_grad(opt, false);
    if ((st = ddp_var_new(ctx, DDP_F32, b.features.ndim, b.features.shape, b.features.data, false,
                          &x)) != DDP_OK ||
        (st = ddp_var_new(ctx, DDP_I64, 1, &b.size, b.labels.data, false, &t)) != DDP_OK ||
        (st = ddp_model_forward(model, ctx, x, 0, &logits)) != DDP_OK ||
        (st = ddp_cross_entropy(ctx, logits, t, -100, &loss)) != DDP_OK ||
        (st = ddp_backward(ctx, loss)) != DDP_OK) {
      ddp_ctx_last_error_copy(ctx, &err);
      fprintf(stderr, "ddp-demo: rank %d: step %d: %s %s\n", rank, step, ddp_status_name(st),
              err.msg);
      goto out;
    }
    /* The whole of DDP's communication in one line: average the flat gradient buffer. */
    if ((st = ddp_allreduce(pg, grads.data, grads.data, (size_t)grads.numel, DDP_F32, DDP_OP_AVG,
                            &work)) != DDP_OK ||
        (st = ddp_work_wait_free(work)) != DDP_OK || (st = ddp_optim_step(opt, &err)) != DDP_OK) {
      if (!err.msg[0]) ddp_pg_last_error_copy(pg, &err);
      fprintf(stderr, "ddp-demo: rank %d: step %d: %s\n", rank, step, err.msg);
      goto out;
    }
    float l = *(const float *)loss->value.data;
    ddp_ctx_reset(ctx);
    if ((st = ddp_allreduce(pg, &l, &l, 1, DDP_F32, DDP_OP_AVG, &work)) != DDP_OK ||
        (st = ddp_work_wait_free(work)) != DDP_OK) {
      goto out;
    }
    if (step == 1) arg->result->first_loss = l;
    window += l;
    in_window++;
    if (rank == 0 && (step % 25 == 0 || step == cfg->steps)) {
      printf("step %4d  epoch %2" PRId64 "  loss %.4f\n", step, epoch, window / in_window);
      fflush(stdout);
      window = 0.0;
      in_window = 0;
    }
    arg->result->last_loss = l;
  }
  double seconds = (double)(ddp_now_ns() - t0) * 1e-9;

  /* Replica check: allgather every rank's parameter hash. */
  uint64_t mine = fnv1a(params.data, ddp_tensor_nbytes(&params));
  uint64_t *all = calloc((size_t)world, sizeof *all);
  if (!all) {
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  if ((st = ddp_allgather(pg, &mine, all, 1, DDP_I64, &work)) == DDP_OK) {
    st = ddp_work_wait_free(work);
  }
  int identical = 1;
  for (int r = 0; st == DDP_OK && r < world; r++) identical &= all[r] == all[0];
  free(all);
  if (st != DDP_OK) goto out;
  if (rank == 0) {
    arg->result->identical = identical;
    arg->result->seconds = seconds;
    st = evaluate(model, ctx, ds, &arg->result->accuracy);
  }

out:
  ddp_optim_destroy(opt);
  free(pairs);
  ddp_loader_destroy(loader);
  ddp_sampler_destroy(sampler);
  ddp_dataset_destroy(ds);
  ddp_ctx_destroy(ctx);
  ddp_model_destroy(model);
  return st;
}

static void usage(FILE *f) {
  fprintf(f, "usage: ddp-demo [--threads N] [--steps S] [--batch B] [--lr LR] [--seed S] [--data "
             "FILE]\n"
             "  Data-parallel SGD on the UCI digits with W ranks: threads of this process\n"
             "  (--threads, default 4), or processes under ddprun (RANK/WORLD_SIZE set).\n");
}

static int parse_int(const char *flag, const char *v, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) {
    fprintf(stderr, "ddp-demo: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, v);
    return 0;
  }
  *out = x;
  return 1;
}

int main(int argc, char **argv) {
  demo_config_t cfg = {4, 150, 32, 0.05, 42, DDP_DEMO_DATA};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ddp-demo: unknown flag or missing value: %s\n", a);
      usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    long x;
    if (!strcmp(a, "--threads")) {
      if (!parse_int(a, v, 1, 64, &x)) return 2;
      cfg.threads = (int)x;
    } else if (!strcmp(a, "--steps")) {
      if (!parse_int(a, v, 1, 1000000, &x)) return 2;
      cfg.steps = (int)x;
    } else if (!strcmp(a, "--batch")) {
      if (!parse_int(a, v, 1, 4096, &x)) return 2;
      cfg.batch = (int)x;
    } else if (!strcmp(a, "--seed")) {
      if (!parse_int(a, v, 0, 1L << 30, &x)) return 2;
      cfg.seed = (uint64_t)x;
    } else if (!strcmp(a, "--lr")) {
      char *end;
      cfg.lr = strtod(v, &end);
      if (*end || !(cfg.lr > 0)) {
        fprintf(stderr, "ddp-demo: --lr expects a positive number, got '%s'\n", v);
        return 2;
      }
    } else if (!strcmp(a, "--data")) {
      cfg.data = v;
    } else {
      fprintf(stderr, "ddp-demo: unknown flag: %s\n", a);
      usage(stderr);
      return 2;
    }
  }

  demo_result_t result = {0};
  demo_arg_t arg = {&cfg, &result};
  ddp_status_t st;
  int world;
  bool launched = ddp_env_is_set(DDP_ENV_RANK) && ddp_env_is_set(DDP_ENV_WORLD_SIZE);
  ddp_error_t err = {0};
  if (launched) {
    ddp_pg_t *pg = NULL;
    ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
    po.timeout_ms = 60000;
    if ((st = ddp_pg_create_from_env(&po, &pg, &err)) != DDP_OK) {
      fprintf(stderr, "ddp-demo: process group: %s: %s\n", ddp_status_name(st), err.msg);
      return 1;
    }
    world = ddp_pg_size(pg);
    if (ddp_pg_rank(pg) == 0) {
      printf("ddp-demo: %d ranks as processes, backend %s\n", world, ddp_pg_backend_name(pg));
    }
    st = run_rank(pg, &arg);
    bool root = ddp_pg_rank(pg) == 0;
    ddp_pg_destroy(pg);
    if (!root) return st == DDP_OK ? 0 : 1;
  } else {
    world = cfg.threads;
    printf("ddp-demo: %d ranks as threads, backend threads\n", world);
    ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
    po.backend = "threads";
    po.timeout_ms = 60000;
    st = ddp_spawn_threads(world, &po, run_rank, &arg);
  }
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-demo: failed: %s\n", ddp_status_name(st));
    return 1;
  }
  printf("ddp-demo: %d steps x %d ranks x batch %d in %.2f s (%.1f steps/s)\n", cfg.steps, world,
         cfg.batch, result.seconds, cfg.steps / result.seconds);
  printf("ddp-demo: loss %.4f -> %.4f, accuracy on all %d digits %.1f%%\n", result.first_loss,
         result.last_loss, 1797, 100.0 * result.accuracy);
  printf("ddp-demo: replicas bit-identical after training: %s\n", result.identical ? "yes" : "NO");
  return result.identical ? 0 : 1;
}
