/* ddp-bench-ddp: the DDP training-step benchmark of docs/benchmarks.md ("DDP steps").
 *
 * One rank of a W-rank job under ddprun (RANK/WORLD_SIZE/DDP_BACKEND from the launcher)
 * trains the MLP 784-1024-1024-1024-10 with SGD through the DDP reducer (ddp_ddp_*) on a
 * fixed random batch, and measures three phases in order:
 *
 *   1. throughput: `--steps` consecutive synchronised steps after `--warmup` untimed ones
 *      (the warm-up covers iteration 1's single bucket and the rebuild). steps/s is the
 *      step count over the wall time of the block; the per-step times give the p50.
 *   2. exposed communication: `--pairs` pairs of (synchronised step, no_sync step), each
 *      step started right after a barrier so that rank skew is not counted. Exposed
 *      communication is p50(synced) - p50(no_sync): the part of the gradient reduction
 *      that backward did not hide.
 *   3. the allreduce alone: `--ar-iters` SUM allreduces of the whole gradient (same element
 *      count, dtype and backend, in ddp_pg_alloc memory like the buckets), each after a
 *      barrier; its p50 is what a step would pay with no overlap at all.
 *
 * Two more figures say how far down the exposed part could go, and why it stops there:
 *   - CPU accounting (phase 2): the process CPU time (every thread of the rank, progress
 *     thread included) of each synchronised and each no_sync step. extra_cpu is the p50
 *     difference, the work the reduction adds to a step; nosync_busy is the no_sync step's
 *     CPU time over its wall time, the share of a core that compute alone keeps busy. When
 *     every CPU already runs a rank's compute (nosync_busy near 1 and as many ranks as
 *     CPUs), that work has nowhere to hide, and exposed communication cannot drop below
 *     about extra_cpu, however the reduction is scheduled.
 *   - floors (phase 3): the allreduce alone of the last bucket to become ready and of the
 *     last gradient tensor to become ready (the prev_iteration_grad_ready_order of the
 *     logging data). The last bucket is ready only when backward ends, so its allreduce is
 *     exposed on any machine; floor_bucket_ratio is its share of the whole allreduce. No
 *     bucket layout can split a tensor, so floor_tensor_ratio, the last tensor's share, is
 *     the least exposed ratio any bucketing reaches for this model.
 *
 * A step is zero_grad, forward, cross-entropy, backward (buckets reduce while it runs),
 * SGD step and context reset; the optimizer step is timed in both kinds of step, so the
 * difference is communication only. Timings are rank 0's. With --hook/--wrapper/--state a
 * communication hook is built (ddp_hooks_create, Accelerate's names) and registered, and the
 * payload bytes the last synchronised step handed to collectives come from
 * ddp_ddp_get_comm_stats. Phases 2 and 3 are skipped when their count is 0.
 *
 * With --model FILE (a Transformers config.json of a causal LM: GPT-2 or Llama) the model is
 * that model instead of the MLP: the input of a step is I64 token ids [batch, --seq] (fixed random
 * ids, different on every rank) and the loss is the causal-LM loss on the same ids as labels
 * (ddp_causal_lm_loss, as Transformers' GPT2LMHeadModel or LlamaForCausalLM with
 * labels = input_ids). --optim
 * adamw replaces SGD by AdamW (PyTorch's defaults: lr 1e-3, betas 0.9/0.999, eps 1e-8,
 * weight_decay 0.01). Started without a launcher (RANK and WORLD_SIZE unset), the program is
 * one process without a process group or DDP: zero_grad, forward, loss, ddp_backward and the
 * optimizer step, phase 1 only (tools/bench/bench_gpt2.sh's one-thread comparison).
 *
 * Rank 0 prints one line "RESULT key=value ..." that tools/bench/bench_ddp.sh and
 * tools/bench/bench_gpt2.sh parse; peak_rss_mb is the process's peak resident set
 * (getrusage ru_maxrss) at the end of the run.
 *
 *   ddprun --nproc_per_node 2 --backend shm ddp-bench-ddp [--steps N] [--warmup N]
 *       [--pairs N] [--ar-iters N] [--batch B] [--hook H] [--wrapper W] [--state JSON]
 *       [--trace FILE] [--bucket-cap-mb MB] [--grad-as-bucket-view]
 *       [--model CONFIG.json [--seq T]] [--optim sgd|adamw]
 *   ddp-bench-ddp --model CONFIG.json ...    (one process, no DDP)
 *   ddp-bench-ddp --blas-core    (the OpenBLAS kernel set in use: ddp_blas_core)
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "ddp.h"

static const char *model_json =
    "{\"dtype\": \"f32\", \"layers\": ["
    "{\"type\": \"linear\", \"in\": 784, \"out\": 1024}, {\"type\": \"relu\"},"
    "{\"type\": \"linear\", \"in\": 1024, \"out\": 1024}, {\"type\": \"relu\"},"
    "{\"type\": \"linear\", \"in\": 1024, \"out\": 1024}, {\"type\": \"relu\"},"
    "{\"type\": \"linear\", \"in\": 1024, \"out\": 10}]}";

enum { IN_DIM = 784, CLASSES = 10 };

typedef struct bench_config {
  int steps, warmup, pairs, ar_iters, batch, seq;
  const char *hook, *wrapper, *state, *trace;
  const char *model;    /* a Transformers config.json, or NULL for the MLP */
  bool adamw;           /* AdamW instead of SGD */
  double bucket_cap_mb; /* DDP_BUCKET_CAP_UNSET: PyTorch's default (25, 1 MiB first) */
  bool grad_view;       /* gradient_as_bucket_view */
  int inv_per_rank;     /* --invariant-shards-per-rank S: world_size_invariant_shards S W */
  int micro;            /* --micro-batches S: S passes per step, the first S - 1 no_sync */
} bench_config_t;

/* Everything one rank needs for a training step. pg and ddp are NULL in a single process. */
typedef struct bench_rank {
  ddp_pg_t *pg;
  ddp_model_t *model;
  ddp_ddp_t *ddp;
  ddp_ctx_t *ctx;
  ddp_optim_t *opt;
  ddp_optim_param_t *pairs;
  float *x;
  int64_t *y;
  int64_t batch;
  int64_t *ids; /* --model: token ids [batch, seq], also the labels */
  int passes;   /* forward/backward passes per step: invariant shards or micro-batches */
  int64_t seq;
} bench_rank_t;

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Median of n samples in ns (sorts them), as milliseconds. */
static double p50_ms(int64_t *t, int n) {
  if (n <= 0) return 0.0;
  qsort(t, (size_t)n, sizeof *t, cmp_i64);
  double m = n % 2 ? (double)t[n / 2] : 0.5 * (double)(t[n / 2 - 1] + t[n / 2]);
  return m * 1e-6;
}

/* splitmix64: the synthetic batch, different on every rank. */
static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* CPU time of the whole process (all its threads), ns. */
static int64_t cpu_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* CPUs this process may run on. */
static int cpus_allowed(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

/* Peak resident set of this process so far, MiB. */
/* The RESULT line's model= value: the config's model_type, or mlp. */
static const char *model_name(const ddp_model_t *m) {
  const ddp_hf_config_t *hf = m ? ddp_model_hf_config(m) : NULL;
  if (!hf) return "mlp";
  return hf->model_type == DDP_HF_LLAMA ? "llama" : hf->model_type == DDP_HF_GPT2 ? "gpt2" : "hf";
}

static double peak_rss_mb(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0.0;
}

static ddp_status_t barrier(ddp_pg_t *pg) {
  if (!pg) return DDP_OK; /* one process */
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_barrier(pg, &w);
  return st == DDP_OK ? ddp_work_wait_free(w) : st;
}

/* One forward/backward of rows [row0, row0 + n) of the batch; sync selects a synchronised
 * or a no_sync pass. */
static ddp_status_t pass(bench_rank_t *r, bool sync, int64_t row0, int64_t n) {
  ddp_var_t *x, *t, *logits, *loss;
  bool old = r->ddp ? ddp_ddp_set_sync(r->ddp, sync) : true;
  ddp_status_t st;
  if (r->ids) { /* GPT-2: ids [B, T], labels = the same ids */
    int64_t s[2] = {n, r->seq};
    st = ddp_var_new(r->ctx, DDP_I64, 2, s, r->ids + row0 * r->seq, false, &x);
    t = x;
  } else {
    int64_t xs[2] = {n, IN_DIM};
    st = ddp_var_new(r->ctx, DDP_F32, 2, xs, r->x + row0 * IN_DIM, false, &x);
    if (st == DDP_OK) st = ddp_var_new(r->ctx, DDP_I64, 1, &n, r->y + row0, false, &t);
  }
  if (st == DDP_OK)
    st = r->ddp ? ddp_ddp_forward(r->ddp, r->ctx, x, 0, &logits)
                : ddp_model_forward(r->model, r->ctx, x, 0, &logits);
  if (st == DDP_OK)
    st = r->ids ? ddp_causal_lm_loss(r->ctx, logits, t, -100, &loss)
                : ddp_cross_entropy(r->ctx, logits, t, -100, &loss);
  if (st == DDP_OK)
    st = r->ddp ? ddp_ddp_backward(r->ddp, r->ctx, loss) : ddp_backward(r->ctx, loss);
  if (r->ddp) ddp_ddp_set_sync(r->ddp, old);
  ddp_ctx_reset(r->ctx);
  return st;
}

/* One training step; sync selects a synchronised or a no_sync step. With
 * --invariant-shards-per-rank S (or --micro-batches S) the batch is S shards (micro-batches),
 * one pass each, the last one synchronising. */
static ddp_status_t step(bench_rank_t *r, bool sync) {
  ddp_optim_zero_grad(r->opt, false);
  int S = r->passes;
  int64_t n = r->batch / S;
  ddp_status_t st = DDP_OK;
  for (int s = 0; st == DDP_OK && s < S; s++) st = pass(r, sync && s == S - 1, s * n, n);
  if (st == DDP_OK) st = ddp_optim_step(r->opt, NULL);
  if (st != DDP_OK) {
    ddp_error_t de = {0}, ce;
    if (r->ddp) ddp_ddp_last_error_copy(r->ddp, &de);
    ddp_ctx_last_error_copy(r->ctx, &ce);
    fprintf(stderr, "ddp-bench-ddp: rank %d: step: %s: %s %s\n", r->pg ? ddp_pg_rank(r->pg) : 0,
            ddp_status_name(st), de.msg, ce.msg);
  }
  ddp_ctx_reset(r->ctx);
  return st;
}

static ddp_status_t setup(bench_rank_t *r, const bench_config_t *cfg) {
  int rank = r->pg ? ddp_pg_rank(r->pg) : 0;
  ddp_error_t err = {0};
  ddp_status_t st;
  r->batch = cfg->batch;
  r->seq = cfg->seq;
  if ((st = cfg->model ? ddp_model_from_json_file(cfg->model, &r->model, &err)
                       : ddp_model_from_json(model_json, &r->model, &err)) != DDP_OK ||
      (st = ddp_model_init(r->model, 1234 + (uint64_t)rank)) != DDP_OK ||
      (st = ddp_ctx_create(&r->ctx)) != DDP_OK) {
    fprintf(stderr, "ddp-bench-ddp: rank %d: model: %s %s\n", rank, ddp_status_name(st), err.msg);
    return st;
  }
  const ddp_hf_config_t *hf = ddp_model_hf_config(r->model);
  if (cfg->model && (!hf || ddp_model_task(r->model) != DDP_TASK_CAUSAL_LM)) {
    fprintf(stderr,
            "ddp-bench-ddp: %s: --model takes a causal-LM config.json (model_type gpt2 or "
            "llama)\n",
            cfg->model);
    return DDP_ERR_INVALID_ARGUMENT;
  }
  if (cfg->model) {
    r->ids = malloc((size_t)cfg->batch * (size_t)cfg->seq * sizeof *r->ids);
    if (!r->ids) return DDP_ERR_NO_MEMORY;
    uint64_t s = 77 + (uint64_t)rank;
    for (size_t i = 0; i < (size_t)cfg->batch * (size_t)cfg->seq; i++)
      r->ids[i] = (int64_t)(mix(&s) % (uint64_t)(hf->model_type == DDP_HF_LLAMA
                                                     ? hf->llama.vocab_size
                                                     : hf->gpt2.vocab_size));
  }
  ddp_ddp_options_t o = DDP_DDP_OPTIONS_INIT;
  o.trace_path = cfg->trace;
  o.bucket_cap_mb = cfg->bucket_cap_mb;
  o.gradient_as_bucket_view = cfg->grad_view;
  r->passes = cfg->inv_per_rank > 0 ? cfg->inv_per_rank : (cfg->micro > 0 ? cfg->micro : 1);
  if (r->pg) o.world_size_invariant_shards = (int64_t)cfg->inv_per_rank * ddp_pg_size(r->pg);
  ddp_comm_hook_t hook = {0};
  if (r->pg && /* one process: no DDP */
      ((st = ddp_ddp_create(r->model, r->pg, &o, &r->ddp, &err)) != DDP_OK ||
       (st = ddp_hooks_create(cfg->hook, cfg->wrapper, cfg->state, rank, &hook, &err)) != DDP_OK ||
       (hook.fn && (st = ddp_ddp_register_comm_hook(r->ddp, &hook, &err)) != DDP_OK))) {
    if (hook.fn) hook.free_state(hook.state); /* created, but not registered */
    fprintf(stderr, "ddp-bench-ddp: rank %d: ddp: %s %s\n", rank, ddp_status_name(st), err.msg);
    return st;
  }
  size_t np = ddp_model_num_params(r->model);
  r->pairs = calloc(np, sizeof *r->pairs);
  r->x = malloc((size_t)cfg->batch * IN_DIM * sizeof *r->x);
  r->y = malloc((size_t)cfg->batch * sizeof *r->y);
  if (!r->pairs || !r->x || !r->y) return DDP_ERR_NO_MEMORY;
  for (size_t i = 0; i < np; i++) {
    ddp_param_t *p = ddp_model_param(r->model, i);
    r->pairs[i].param = &p->value;
    r->pairs[i].grad = &p->grad;
  }
  ddp_optim_options_t oo = DDP_SGD_OPTIONS_INIT;
  oo.lr = 0.01;
  if (cfg->adamw) oo = (ddp_optim_options_t)DDP_ADAMW_OPTIONS_INIT;
  if ((st = ddp_optim_create(&oo, r->pairs, np, &r->opt, &err)) != DDP_OK) {
    fprintf(stderr, "ddp-bench-ddp: rank %d: optim: %s %s\n", rank, ddp_status_name(st), err.msg);
    return st;
  }
  uint64_t s = 99 + (uint64_t)rank;
  for (size_t i = 0; i < (size_t)cfg->batch * IN_DIM; i++) {
    r->x[i] = (float)((double)(mix(&s) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  }
  for (int i = 0; i < cfg->batch; i++) r->y[i] = (int64_t)(mix(&s) % CLASSES);
  return DDP_OK;
}

static void teardown(bench_rank_t *r) {
  ddp_optim_destroy(r->opt);
  ddp_ddp_destroy(r->ddp);
  ddp_ctx_destroy(r->ctx);
  ddp_model_destroy(r->model);
  free(r->pairs);
  free(r->x);
  free(r->y);
  free(r->ids);
}

/* Phase 3: p50 of the whole-gradient allreduce alone, in ms. */
static ddp_status_t allreduce_alone(ddp_pg_t *pg, size_t numel, int iters, double *ms) {
  float *buf = ddp_pg_alloc(pg, numel * sizeof *buf);
  int64_t *t = calloc((size_t)iters, sizeof *t);
  ddp_status_t st = buf && t ? DDP_OK : DDP_ERR_NO_MEMORY;
  for (size_t i = 0; buf && i < numel; i++) buf[i] = 1e-3f * (float)(i % 1000);
  for (int k = -3; st == DDP_OK && k < iters; k++) {
    ddp_work_t *w = NULL;
    if ((st = barrier(pg)) != DDP_OK) break;
    int64_t t0 = ddp_now_ns();
    st = ddp_allreduce(pg, buf, buf, numel, DDP_F32, DDP_OP_SUM, &w);
    if (st == DDP_OK) st = ddp_work_wait_free(w);
    if (k >= 0) t[k] = ddp_now_ns() - t0;
  }
  if (st == DDP_OK) *ms = p50_ms(t, iters);
  free(t);
  if (buf) ddp_pg_free(pg, buf);
  return st;
}

/* Where the last gradient became ready in the last synchronised backward: the element
 * counts of that tensor and of the bucket that holds it (0 when unknown). */
static void last_ready(ddp_ddp_t *ddp, size_t *tensor_numel, size_t *bucket_numel) {
  ddp_ddp_logging_data_t ld;
  ddp_ddp_get_logging_data(ddp, &ld);
  *tensor_numel = *bucket_numel = 0;
  if (ld.num_prev_ready_order == 0) return;
  size_t last = ld.prev_iteration_grad_ready_order_indices[ld.num_prev_ready_order - 1];
  *tensor_numel = (size_t)ddp_ddp_param(ddp, last)->value.numel;
  for (size_t b = 0; b < ddp_ddp_num_buckets(ddp); b++) {
    size_t n, sum = 0;
    const size_t *idx = ddp_ddp_bucket_params(ddp, b, &n);
    bool here = false;
    for (size_t k = 0; k < n; k++) {
      sum += (size_t)ddp_ddp_param(ddp, idx[k])->value.numel;
      here |= idx[k] == last;
    }
    if (here) *bucket_numel = sum;
  }
}

static ddp_status_t run(ddp_pg_t *pg, const bench_config_t *cfg) {
  bench_rank_t r = {.pg = pg};
  int rank = pg ? ddp_pg_rank(pg) : 0;
  int nt = cfg->steps > cfg->pairs ? cfg->steps : cfg->pairs;
  int64_t *ts = calloc((size_t)nt + 1, sizeof *ts), *tn = calloc((size_t)nt + 1, sizeof *tn);
  int64_t *cpu_s = calloc((size_t)nt + 1, sizeof *cpu_s);
  int64_t *cpu_n = calloc((size_t)nt + 1, sizeof *cpu_n);
  ddp_status_t st = ts && tn && cpu_s && cpu_n ? setup(&r, cfg) : DDP_ERR_NO_MEMORY;
  double steps_per_s = 0, step_p50 = 0, sync_p50 = 0, nosync_p50 = 0, ar_p50 = 0;
  double sync_cpu = 0, nosync_cpu = 0, ar_bucket_p50 = 0, ar_tensor_p50 = 0, step_cpu_p50 = 0;
  size_t tensor_numel = 0, bucket_numel = 0;
  ddp_ddp_comm_stats_t cs = {0};

  for (int k = 0; st == DDP_OK && k < cfg->warmup; k++) st = step(&r, true);
  if (st == DDP_OK) st = barrier(pg);
  /* Phase 1: consecutive synchronised steps. */
  int64_t t0 = ddp_now_ns();
  for (int k = 0; st == DDP_OK && k < cfg->steps; k++) {
    int64_t a = ddp_now_ns(), c = cpu_now_ns();
    st = step(&r, true);
    ts[k] = ddp_now_ns() - a;
    cpu_s[k] = cpu_now_ns() - c;
  }
  int64_t block = ddp_now_ns() - t0;
  if (st == DDP_OK) {
    if (r.ddp) ddp_ddp_get_comm_stats(r.ddp, &cs);
    steps_per_s = cfg->steps / (block * 1e-9);
    step_p50 = p50_ms(ts, cfg->steps);
    step_cpu_p50 = p50_ms(cpu_s, cfg->steps);
  }
  /* Phase 2: barrier-aligned pairs of synchronised and no_sync steps. */
  for (int k = 0; st == DDP_OK && k < cfg->pairs; k++) {
    if ((st = barrier(pg)) != DDP_OK) break;
    int64_t a = ddp_now_ns(), c = cpu_now_ns();
    if ((st = step(&r, true)) != DDP_OK) break;
    ts[k] = ddp_now_ns() - a;
    cpu_s[k] = cpu_now_ns() - c;
    if ((st = barrier(pg)) != DDP_OK) break;
    a = ddp_now_ns();
    c = cpu_now_ns();
    st = step(&r, false);
    tn[k] = ddp_now_ns() - a;
    cpu_n[k] = cpu_now_ns() - c;
  }
  if (st == DDP_OK && cfg->pairs > 0) {
    sync_p50 = p50_ms(ts, cfg->pairs);
    nosync_p50 = p50_ms(tn, cfg->pairs);
    sync_cpu = p50_ms(cpu_s, cfg->pairs);
    nosync_cpu = p50_ms(cpu_n, cfg->pairs);
  }
  size_t numel = 0;
  for (size_t i = 0; r.model && i < ddp_model_num_params(r.model); i++) {
    numel += (size_t)ddp_model_param(r.model, i)->value.numel;
  }
  if (st == DDP_OK && cfg->ar_iters > 0) {
    last_ready(r.ddp, &tensor_numel, &bucket_numel);
    st = allreduce_alone(pg, numel, cfg->ar_iters, &ar_p50);
    if (st == DDP_OK && bucket_numel > 0)
      st = allreduce_alone(pg, bucket_numel, cfg->ar_iters, &ar_bucket_p50);
    if (st == DDP_OK && tensor_numel > 0)
      st = allreduce_alone(pg, tensor_numel, cfg->ar_iters, &ar_tensor_p50);
  }

  if (st == DDP_OK && rank == 0) {
    printf("RESULT backend=%s world=%d hook=%s wrapper=%s invariant_shards_per_rank=%d "
           "passes=%d buckets=%zu grad_numel=%zu steps=%d steps_per_s=%.3f step_p50_ms=%.3f",
           pg ? ddp_pg_backend_name(pg) : "none", pg ? ddp_pg_size(pg) : 1, cfg->hook, cfg->wrapper,
           cfg->inv_per_rank, r.passes, r.ddp ? ddp_ddp_num_buckets(r.ddp) : (size_t)0, numel,
           cfg->steps, steps_per_s, step_p50);
    if (cfg->pairs > 0) {
      printf(" sync_p50_ms=%.3f nosync_p50_ms=%.3f exposed_ms=%.3f", sync_p50, nosync_p50,
             sync_p50 - nosync_p50);
      printf(" sync_cpu_ms=%.3f nosync_cpu_ms=%.3f extra_cpu_ms=%.3f nosync_busy=%.2f cpus=%d",
             sync_cpu, nosync_cpu, sync_cpu - nosync_cpu,
             nosync_p50 > 0 ? nosync_cpu / nosync_p50 : 0.0, cpus_allowed());
    }
    if (cfg->ar_iters > 0) {
      printf(" allreduce_p50_ms=%.3f", ar_p50);
      if (cfg->pairs > 0) printf(" exposed_ratio=%.3f", (sync_p50 - nosync_p50) / ar_p50);
      printf(" last_bucket_numel=%zu allreduce_last_bucket_p50_ms=%.3f floor_bucket_ratio=%.3f"
             " last_tensor_numel=%zu allreduce_last_tensor_p50_ms=%.3f floor_tensor_ratio=%.3f",
             bucket_numel, ar_bucket_p50, ar_bucket_p50 / ar_p50, tensor_numel, ar_tensor_p50,
             ar_tensor_p50 / ar_p50);
    }
    printf(" bytes_per_step=%lld numel_before=%lld numel_after=%lld rate=%.2f",
           (long long)cs.bytes_last_step, (long long)cs.numel_before, (long long)cs.numel_after,
           cs.rate);
    printf(" step_cpu_p50_ms=%.3f model=%s batch=%d seq=%d optim=%s blas_core=%s"
           " peak_rss_mb=%.1f\n",
           step_cpu_p50, model_name(r.model), cfg->batch, cfg->model ? cfg->seq : 0,
           cfg->adamw ? "adamw" : "sgd", ddp_blas_core(), peak_rss_mb());
    fflush(stdout);
  }
  teardown(&r);
  free(ts);
  free(tn);
  free(cpu_s);
  free(cpu_n);
  return st;
}

static void usage(FILE *f) {
  fprintf(f, "usage: ddprun --nproc_per_node 2 --backend shm|tcp ddp-bench-ddp [--steps N]\n"
             "         [--warmup N] [--pairs N] [--ar-iters N] [--batch B] [--hook H]\n"
             "         [--wrapper W] [--state JSON] [--trace FILE] [--bucket-cap-mb MB]\n"
             "         [--grad-as-bucket-view] [--model CONFIG.json] [--seq T]\n"
             "         [--optim sgd|adamw] [--invariant-shards-per-rank S]\n"
             "         [--micro-batches S]\n"
             "       ddp-bench-ddp [--model CONFIG.json] ...   (one process, no DDP)\n"
             "  DDP step benchmark on the MLP 784-1024-1024-1024-10 (docs/benchmarks.md).\n"
             "  --steps 30 --warmup 5 --pairs 30 --ar-iters 30 --batch 64 per rank;\n"
             "  --hook no|fp16|bf16|power_sgd|batched_power_sgd, --wrapper no|fp16|bf16,\n"
             "  --state a JSON object of PowerSGDState keys (docs/hooks.md);\n"
             "  --trace writes the reducer's Chrome trace of every step (docs/ddp.md);\n"
             "  --bucket-cap-mb sets both caps (default: PyTorch's 25 MiB, 1 MiB first);\n"
             "  --grad-as-bucket-view: gradient_as_bucket_view=True (no bucket copies);\n"
             "  --model: a Transformers GPT-2 or Llama config.json instead of the MLP: ids\n"
             "  [batch, seq] (--seq 64), causal-LM loss; --optim adamw: PyTorch's AdamW\n"
             "  --invariant-shards-per-rank S: world_size_invariant_shards S x W, each step\n"
             "  S passes of batch / S samples (docs/ddp.md); no no_sync pairs;\n"
             "  --micro-batches S: the same S passes in normal DDP (S - 1 under no_sync)\n"
             "  defaults instead of SGD (lr 0.01). Without ddprun (RANK, WORLD_SIZE unset):\n"
             "  one process, no DDP, phase 1 only;\n"
             "  --blas-core alone prints the OpenBLAS kernel set libddp runs and exits.\n");
}

static int parse_count(const char *flag, const char *v, long lo, int *out) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > 1000000) {
    fprintf(stderr, "ddp-bench-ddp: %s expects an integer in [%ld, 1000000], got '%s'\n", flag, lo,
            v);
    return 0;
  }
  *out = (int)x;
  return 1;
}

int main(int argc, char **argv) {
  bench_config_t cfg =
      {30,    5, 30, 30, 64, 64, "no", "no", NULL, NULL, NULL, false, DDP_BUCKET_CAP_UNSET,
       false, 0, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--grad-as-bucket-view")) {
      cfg.grad_view = true;
      continue;
    }
    if (!strcmp(a,
                "--blas-core")) { /* for tools/bench/bench_ddp.sh: give PyTorch the same kernels */
      printf("%s\n", ddp_blas_core());
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ddp-bench-ddp: unknown flag or missing value: %s\n", a);
      usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    int ok = 1;
    if (!strcmp(a, "--steps"))
      ok = parse_count(a, v, 1, &cfg.steps);
    else if (!strcmp(a, "--warmup"))
      ok = parse_count(a, v, 2, &cfg.warmup);
    else if (!strcmp(a, "--pairs"))
      ok = parse_count(a, v, 0, &cfg.pairs);
    else if (!strcmp(a, "--ar-iters"))
      ok = parse_count(a, v, 0, &cfg.ar_iters);
    else if (!strcmp(a, "--batch"))
      ok = parse_count(a, v, 1, &cfg.batch);
    else if (!strcmp(a, "--seq"))
      ok = parse_count(a, v, 1, &cfg.seq);
    else if (!strcmp(a, "--invariant-shards-per-rank"))
      ok = parse_count(a, v, 1, &cfg.inv_per_rank);
    else if (!strcmp(a, "--micro-batches"))
      ok = parse_count(a, v, 1, &cfg.micro);
    else if (!strcmp(a, "--model"))
      cfg.model = v;
    else if (!strcmp(a, "--optim")) {
      if (strcmp(v, "sgd") && strcmp(v, "adamw")) {
        fprintf(stderr, "ddp-bench-ddp: --optim expects sgd or adamw, got '%s'\n", v);
        return 2;
      }
      cfg.adamw = !strcmp(v, "adamw");
    } else if (!strcmp(a, "--hook"))
      cfg.hook = v;
    else if (!strcmp(a, "--wrapper"))
      cfg.wrapper = v;
    else if (!strcmp(a, "--state"))
      cfg.state = v;
    else if (!strcmp(a, "--trace"))
      cfg.trace = v;
    else if (!strcmp(a, "--bucket-cap-mb")) {
      char *end;
      cfg.bucket_cap_mb = strtod(v, &end);
      if (*end || !(cfg.bucket_cap_mb > 0)) {
        fprintf(stderr, "ddp-bench-ddp: --bucket-cap-mb expects a positive number, got '%s'\n", v);
        return 2;
      }
    } else {
      fprintf(stderr, "ddp-bench-ddp: unknown flag: %s\n", a);
      usage(stderr);
      return 2;
    }
    if (!ok) return 2;
  }
  int passes = cfg.inv_per_rank > 0 ? cfg.inv_per_rank : cfg.micro;
  if (passes > 0) {
    if (cfg.batch % passes != 0) {
      fprintf(stderr, "ddp-bench-ddp: --batch %d is not a multiple of %d passes\n", cfg.batch,
              passes);
      return 2;
    }
    cfg.pairs = 0; /* a step is its passes, the last one synchronising: no no_sync steps */
  }
  ddp_error_t err = {0};
  if (ddp_hooks_validate(cfg.hook, cfg.wrapper, cfg.state, &err) != DDP_OK) {
    fprintf(stderr, "ddp-bench-ddp: %s\n", err.msg);
    return 2;
  }
  if (!ddp_env_is_set(DDP_ENV_RANK) || !ddp_env_is_set(DDP_ENV_WORLD_SIZE)) {
    /* One process: no group, no DDP, phase 1 only. */
    cfg.pairs = cfg.ar_iters = 0;
    if (!strcmp(cfg.hook, "no") && !strcmp(cfg.wrapper, "no") && !cfg.trace) {
      ddp_status_t st = run(NULL, &cfg);
      if (st != DDP_OK) fprintf(stderr, "ddp-bench-ddp: failed: %s\n", ddp_status_name(st));
      return st == DDP_OK ? 0 : 1;
    }
    fprintf(stderr, "ddp-bench-ddp: --hook, --wrapper and --trace need the ranks under ddprun "
                    "(RANK and WORLD_SIZE unset)\n");
    usage(stderr);
    return 2;
  }
  ddp_pg_t *pg = NULL;
  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.timeout_ms = 120000;
  ddp_status_t st = ddp_pg_create_from_env(&po, &pg, &err);
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-bench-ddp: process group: %s: %s\n", ddp_status_name(st), err.msg);
    return 1;
  }
  st = run(pg, &cfg);
  if (st != DDP_OK) {
    ddp_pg_last_error_copy(pg, &err);
    fprintf(stderr, "ddp-bench-ddp: failed: %s %s\n", ddp_status_name(st), err.msg);
  }
  ddp_pg_destroy(pg);
  return st == DDP_OK ? 0 : 1;
}
