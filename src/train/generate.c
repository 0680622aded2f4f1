/* Text generation from a causal language model (contract in include/ddp/train.h,
 * ddp_generate; user guide in docs/train.md, "Sampling").
 *
 * The loop Transformers' generate() runs for GPT-2 with do_sample=False (greedy) or with
 * top_k, without a key/value cache: each new token costs one forward over the most recent
 * `context` tokens (the model's n_positions unless the caller says fewer). The forward runs
 * with gradients off and the model in evaluation mode (no dropout), so generation records
 * nothing on a tape and touches no gradient. Only the last position's logits are used.
 *
 * Greedy picks the largest logit, the lowest index on ties (torch.argmax's choice).
 * Top-k keeps the k largest logits (ties broken toward the lower index), takes their softmax
 * in double with the maximum subtracted, and draws one of them by inverse CDF from a
 * uniform double of the Philox stream (DDP_RNG_SAMPLE, 0, 0) under the seed: the same seed
 * gives the same text on every machine and rank (D4). It does not reproduce torch's
 * multinomial draws. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "ddp/train.h"

/* The logits of the last position of y [1, T, V] as doubles, into row (V entries). */
static void last_row(const ddp_var_t *y, double *row) {
  int64_t V = y->value.shape[y->value.ndim - 1];
  int64_t off = y->value.numel - V;
  for (int64_t v = 0; v < V; v++) {
    row[v] = y->value.dtype == DDP_F64 ? ((const double *)y->value.data)[off + v]
                                       : (double)((const float *)y->value.data)[off + v];
  }
}

static int64_t argmax(const double *row, int64_t V) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; v++)
    if (row[v] > row[best]) best = v;
  return best;
}

/* One draw among the k largest entries of row (k < V); idx has room for k entries. */
static int64_t top_k_draw(const double *row, int64_t V, int64_t k, int64_t *idx, double *p,
                          ddp_rng_t *rng) {
  /* Selection by insertion into a sorted list of k: V and k are small (bytes: 256). */
  int64_t n = 0;
  for (int64_t v = 0; v < V; v++) {
    if (n == k && !(row[v] > row[idx[n - 1]])) continue;
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && row[v] > row[idx[j - 1]]) {
      idx[j] = idx[j - 1];
      j--;
    }
    idx[j] = v;
  }
  double mx = row[idx[0]], sum = 0;
  for (int64_t j = 0; j < n; j++) sum += p[j] = exp(row[idx[j]] - mx);
  double u = ddp_rng_uniform_f64(rng) * sum, acc = 0;
  for (int64_t j = 0; j < n; j++) {
    acc += p[j];
    if (u < acc) return idx[j];
  }
  return idx[n - 1];
}

ddp_status_t ddp_generate(ddp_model_t *m, const int64_t *prompt, int64_t n,
                          const ddp_generate_options_t *opts, int64_t **out, int64_t *nout,
                          ddp_error_t *err) {
  DDP_REQUIRE(m && out && nout && (prompt || n == 0));
  ddp_generate_options_t o = DDP_GENERATE_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  *out = NULL;
  *nout = 0;
  if (n < 1) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "generate: the prompt is empty (it needs at least one token)");
  }
  if (o.max_new_tokens < 0 || o.top_k < 0 || o.context < 0) {
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "generate: max_new_tokens %lld, top_k %lld and context %lld must be >= 0",
                      (long long)o.max_new_tokens, (long long)o.top_k, (long long)o.context);
  }
  int64_t ctxlen = o.context;
  if (ctxlen == 0) {
    const ddp_hf_config_t *cfg = ddp_model_hf_config(m);
    if (!cfg || (cfg->model_type != DDP_HF_GPT2 && cfg->model_type != DDP_HF_LLAMA)) {
      return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                        "generate: the model is no GPT-2 or Llama (no n_positions or "
                        "max_position_embeddings to crop the context to); give options.context");
    }
    ctxlen = cfg->model_type == DDP_HF_LLAMA ? cfg->llama.max_position_embeddings
                                             : cfg->gpt2.n_positions;
  }
  int64_t total = n + o.max_new_tokens;
  int64_t *seq = ddp__malloc((size_t)total * sizeof *seq);
  double *row = NULL, *p = NULL;
  int64_t *idx = NULL;
  ddp_ctx_t *ctx = NULL;
  ddp_status_t st = seq ? ddp_ctx_create(&ctx) : DDP_ERR_NO_MEMORY;
  if (st != DDP_OK) {
    ddp__free(seq);
    return ddp__error(err, -1, st, "generate: no memory");
  }
  memcpy(seq, prompt, (size_t)n * sizeof *seq);
  ddp_ctx_set_grad_enabled(ctx, false);
  ddp_model_train(m, false);
  ddp_rng_t rng;
  ddp_rng_init(&rng, o.seed, ddp_rng_stream(DDP_RNG_SAMPLE, 0, 0));
  int64_t len = n;
  while (st == DDP_OK && len < total) {
    int64_t T = DDP_MIN(len, ctxlen), shape[2] = {1, T};
    ddp_var_t *x, *y;
    st = ddp_var_new(ctx, DDP_I64, 2, shape, seq + len - T, false, &x);
    if (st == DDP_OK) st = ddp_model_forward(m, ctx, x, 0, &y);
    if (st != DDP_OK) {
      ddp_error_t ce;
      ddp_ctx_last_error_copy(ctx, &ce);
      st = ddp__error(err, -1, st, "generate: forward at token %lld: %s", (long long)len, ce.msg);
      break;
    }
    if (y->value.ndim != 3 || y->value.shape[1] != T) {
      st = ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "generate: the model is not a causal language model (its output has "
                      "%d dimensions; expected logits [1, %lld, vocab_size])",
                      y->value.ndim, (long long)T);
      break;
    }
    int64_t V = y->value.shape[2];
    if (!row) {
      row = ddp__malloc((size_t)V * sizeof *row);
      p = ddp__malloc((size_t)V * sizeof *p);
      idx = ddp__malloc((size_t)V * sizeof *idx);
      if (!row || !p || !idx) {
        st = ddp__error(err, -1, DDP_ERR_NO_MEMORY, "generate: no memory");
        break;
      }
    }
    last_row(y, row);
    seq[len++] = o.top_k > 0 ? top_k_draw(row, V, DDP_MIN(o.top_k, V), idx, p, &rng)
                             : argmax(row, V);
    ddp_ctx_reset(ctx);
  }
  ddp_model_train(m, true);
  ddp_ctx_destroy(ctx);
  ddp__free(row);
  ddp__free(p);
  ddp__free(idx);
  if (st != DDP_OK) {
    ddp__free(seq);
    return st;
  }
  int64_t *res = ddp_malloc((size_t)(o.max_new_tokens ? o.max_new_tokens : 1) * sizeof *res);
  if (res) memcpy(res, seq + n, (size_t)o.max_new_tokens * sizeof *res);
  ddp__free(seq);
  if (!res) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "generate: no memory");
  *out = res;
  *nout = o.max_new_tokens;
  return DDP_OK;
}
