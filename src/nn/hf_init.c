/* What the Transformers families share, below them: their parameters' leaf vars and
 * Transformers' _init_weights (nn_internal.h). The families (gpt2.c, bert.c, llama.c) call
 * these; pretrained.c reaches the families only through hf_families.c's table. */
#include <string.h>

#include "nn/nn_internal.h"

ddp_status_t ddp__pvar(ddp_ctx_t *c, ddp_model_t *m, size_t i, ddp_var_t **v) {
  *v = ddp_param_var(c, ddp_model_param(m, i));
  if (!*v) return ddp__ctx_error(c, DDP_ERR_NO_MEMORY, "forward: arena exhausted");
  return DDP_OK;
}

void ddp__hf_init(ddp_model_t *m, const unsigned char *role, double std, double proj_std,
                  size_t pad_param, int64_t pad_row, uint64_t seed) {
  ddp_rng_t r;
  ddp_rng_init(&r, seed, ddp_rng_stream(DDP_RNG_INIT, 0, 0));
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    ddp_tensor_t *t = &ddp_model_param(m, i)->value;
    for (int64_t k = 0; k < t->numel; k++) {
      double v = role[i] == DDP__INIT_ONE ? 1.0 : 0.0;
      if (role[i] == DDP__INIT_NORMAL) v = std * ddp_rng_normal(&r);
      if (role[i] == DDP__INIT_PROJ) v = proj_std * ddp_rng_normal(&r);
      if (t->dtype == DDP_F32)
        ((float *)t->data)[k] = (float)v;
      else
        ((double *)t->data)[k] = v;
    }
  }
  if (pad_param == NONE) return;
  ddp_tensor_t *w = &ddp_model_param(m, pad_param)->value;
  size_t row = (size_t)w->shape[1] * ddp_dtype_size(w->dtype);
  memset((char *)w->data + (size_t)pad_row * row, 0, row);
}
