/* Causal language modelling in the trainer (docs/train.md, "Language models"): the loss a
 * GPT2LMHeadModel computes when given labels, and the count of predicted tokens that an
 * evaluation weights each batch's mean by, so that eval_loss is the mean over every
 * predicted token of the held-out set and perplexity = exp(eval_loss), as run_clm
 * reports it. */
#include "common/common.h"
#include "train/train_internal.h"

ddp_status_t ddp__train_lm_loss(ddp_ctx_t *ctx, ddp_var_t *logits, const ddp_tensor_t *labels,
                                ddp_var_t **loss) {
  ddp_var_t *y;
  DDP_CHECK(ddp_var_new(ctx, DDP_I64, labels->ndim, labels->shape, labels->data, false, &y));
  return ddp_causal_lm_loss(ctx, logits, y, -100, loss);
}

int64_t ddp__train_lm_targets(const ddp_tensor_t *labels) {
  if (labels->ndim < 2 || labels->dtype != DDP_I64) return 0;
  int64_t T = labels->shape[labels->ndim - 1], rows = labels->numel / (T ? T : 1), n = 0;
  const int64_t *l = labels->data;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t t = 1; t < T; t++) n += l[r * T + t] != -100;
  return n;
}
