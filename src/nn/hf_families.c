/* The table of Transformers families (nn_internal.h): each family defines its descriptor
 * beside its builder (gpt2.c, bert.c, llama.c) and is listed here once; pretrained.c finds a
 * model_type's builder here, so that nothing in the families calls back up into it. */
#include "nn/nn_internal.h"

static const ddp__hf_family_t *const families[] = {&ddp__gpt2_family, &ddp__bert_family,
                                                   &ddp__llama_family};

const ddp__hf_family_t *ddp__hf_family_find(ddp_hf_model_type_t type) {
  for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
    if (families[i]->type == type) return families[i];
  return NULL;
}
