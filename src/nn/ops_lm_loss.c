/* The causal language-modelling loss of GPT-2 (ddp_causal_lm_loss): the logits at position t
 * predict the label at t + 1, cross-entropy averaged over the pairs whose label is not
 * ignore_index. It reads the logits in place (no shifted copy of the [B, T-1, V] block) and
 * saves only each counted row's log-sum-exp; backward recomputes the probabilities from the
 * logits, which the tape keeps alive anyway. For GPT-2's vocabulary (V = 50257) that is
 * 8 bytes per row saved instead of a copy of the logits.
 *
 * In F32 the exponentials over the vocabulary (2 x 12.9M per GPT-2 step at batch 4 x 64) go
 * through ddp__vexpf in vectorized loops, and a row's sum is taken in double with four
 * accumulators (fixed order, so still deterministic); F64 keeps libm's exp. */
#include <math.h>

#include "nn/ops_common.h"
#include "nn/ops_vexp.h"

/* max_j row[j] over 8 lanes (j mod 8), then across them: the same value as a sequential
 * scan (a maximum does not depend on the order; NaNs are skipped either way), but the
 * loop vectorizes. -INFINITY for an empty or all-NaN row. */
DDP__VEC_KERNEL static float row_max_f32(const float *row, int64_t n) {
  float m[8];
  for (int l = 0; l < 8; l++) m[l] = -INFINITY;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; l++) m[l] = row[j + l] > m[l] ? row[j + l] : m[l];
  for (; j < n; j++) m[0] = row[j] > m[0] ? row[j] : m[0];
  float mx = m[0];
  for (int l = 1; l < 8; l++) mx = m[l] > mx ? m[l] : mx;
  return mx;
}

/* grow[j] += (exp(row[j] - lse) - [j == target]) * s over one row. */
DDP__VEC_KERNEL static void lm_row_grad_f32(const float *row, float *grow, int64_t n,
                                            int64_t target, double lse, float s) {
  for (int64_t j = 0; j < target; j++) grow[j] += ddp__vexpf((float)((double)row[j] - lse)) * s;
  grow[target] += (ddp__vexpf((float)((double)row[target] - lse)) - 1) * s;
  for (int64_t j = target + 1; j < n; j++) grow[j] += ddp__vexpf((float)((double)row[j] - lse)) * s;
}

/* saved = lse per pair (double, [B, T-1]; rows whose label is ignored are not set);
 * a0 = number of counted pairs; i0 = ignore_index. */
static ddp_status_t bw_causal_lm_loss(ddp_ctx_t *c, ddp_node_t *n) {
  ddp_var_t *x = n->ins[0], *lab = n->ins[1];
  int64_t B = x->value.shape[0], nt = x->value.shape[1], V = x->value.shape[2];
  void *g = ddp__grad(c, x);
  if (!g) return OOM(c, n->name);
  const int64_t *l = lab->value.data;
  const double *lse = n->saved;
  if (x->value.dtype == DDP_F32) {
    float *gx = g;
    const float *xx = x->value.data;
    float s = ((const float *)n->out->grad.data)[0] / (float)n->a0;
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t + 1 < nt; t++) {
        int64_t target = l[b * nt + t + 1];
        if (target == n->i0) continue;
        lm_row_grad_f32(xx + (b * nt + t) * V, gx + (b * nt + t) * V, V, target,
                        lse[b * (nt - 1) + t], s);
      }
    return DDP_OK;
  }
  DISPATCH(x->value.dtype, {
    T *gx = g;
    const T *xx = x->value.data;
    T s = (T)(((const T *)n->out->grad.data)[0] / (T)n->a0);
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t + 1 < nt; t++) {
        int64_t target = l[b * nt + t + 1];
        if (target == n->i0) continue;
        const T *row = xx + (b * nt + t) * V;
        T *grow = gx + (b * nt + t) * V;
        double m = lse[b * (nt - 1) + t];
        for (int64_t j = 0; j < V; j++) {
          T p = (T)exp((double)row[j] - m);
          grow[j] += (p - (j == target ? 1 : 0)) * s;
        }
      }
  });
  return DDP_OK;
}

ddp_status_t ddp_causal_lm_loss(ddp_ctx_t *c, ddp_var_t *logits, ddp_var_t *labels,
                                int64_t ignore_index, ddp_var_t **y) {
  DDP_REQUIRE(c && logits && labels && y);
  const char *op = "causal_lm_loss";
  DDP_CHECK(check_float(c, op, logits));
  const ddp_tensor_t *x = &logits->value, *lt = &labels->value;
  if (x->ndim != 3 || lt->dtype != DDP_I64 || lt->ndim != 2 || lt->shape[0] != x->shape[0] ||
      lt->shape[1] != x->shape[1]) {
    char sx[128], sl[128];
    return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                          "%s: expected logits [B, T, V] and I64 labels [B, T], got logits %s "
                          "and labels %s",
                          op, ddp_tensor_describe(x, sx, sizeof sx),
                          ddp_tensor_describe(lt, sl, sizeof sl));
  }
  int64_t B = x->shape[0], nt = x->shape[1], V = x->shape[2];
  const int64_t *l = lt->data;
  int64_t count = 0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 1; t < nt; t++) {
      int64_t target = l[b * nt + t];
      if (target == ignore_index) continue;
      if (target < 0 || target >= V)
        return ddp__ctx_error(c, DDP_ERR_INVALID_ARGUMENT,
                              "%s: Target %lld is out of bounds (labels[%lld, %lld], "
                              "vocabulary size %lld)",
                              op, (long long)target, (long long)b, (long long)t, (long long)V);
      count++;
    }
  ddp_var_t *ins[2] = {logits, labels};
  ddp_node_t *n;
  DDP_CHECK(make_out(c, op, bw_causal_lm_loss, x->dtype, 0, NULL, 2, ins, y, &n));
  int64_t pairs = nt > 1 ? B * (nt - 1) : 0;
  double *lse = ddp__arena_alloc(c, (size_t)pairs * sizeof(double) + 1);
  if (!lse) return OOM(c, op);
  double total = 0;
  if (x->dtype == DDP_F32) {
    const float *xx = x->data;
    float *e = ddp__arena_alloc(c, (size_t)V * sizeof *e);
    if (!e) return OOM(c, op);
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t + 1 < nt; t++) {
        int64_t target = l[b * nt + t + 1];
        if (target == ignore_index) continue;
        const float *row = xx + (b * nt + t) * V;
        float mx = row_max_f32(row, V);
        double m = (double)mx + log(ddp__sum_expf(row, V, mx, e));
        lse[b * (nt - 1) + t] = m;
        total += m - (double)row[target];
      }
    ((float *)(*y)->value.data)[0] = (float)(total / (double)count);
  } else {
    DISPATCH(x->dtype, {
      const T *xx = x->data;
      for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t + 1 < nt; t++) {
          int64_t target = l[b * nt + t + 1];
          if (target == ignore_index) continue;
          const T *row = xx + (b * nt + t) * V;
          double mx = -INFINITY, sum = 0;
          for (int64_t j = 0; j < V; j++) mx = row[j] > mx ? row[j] : mx;
          for (int64_t j = 0; j < V; j++) sum += exp((double)row[j] - mx);
          double m = mx + log(sum);
          lse[b * (nt - 1) + t] = m;
          total += m - (double)row[target];
        }
      ((T *)(*y)->value.data)[0] = (T)(total / (double)count);
    });
  }
  if (n) {
    n->saved = lse;
    n->a0 = (double)count;
    n->i0 = ignore_index;
  }
  return DDP_OK;
}
