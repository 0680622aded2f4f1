/* Causal-LM blocks: a token stream cut into fixed-length samples, as Transformers'
 * run_clm.py does in group_texts. The concatenated ids are cut every block_size tokens,
 * the last partial block is dropped, and the labels are a copy of the ids: the model
 * shifts them (position t predicts token t + 1), so a block of block_size tokens gives
 * block_size - 1 predictions. Blocks do not overlap; sample i is tokens
 * [i * block_size, (i + 1) * block_size).
 *
 * The dataset keeps one copy of the used tokens and serves both the features and the
 * labels from it. */
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

typedef struct lm_blocks {
  int64_t nblocks, block_size;
  int64_t *ids; /* [nblocks * block_size], ddp__malloc */
} lm_blocks_t;

static int64_t blocks_length(void *self) { return ((lm_blocks_t *)self)->nblocks; }

static ddp_status_t blocks_get(void *self, int64_t i, void *feature, void *label,
                               ddp_error_t *err) {
  (void)err;
  const lm_blocks_t *b = self;
  size_t bytes = (size_t)b->block_size * sizeof(int64_t);
  const int64_t *src = b->ids + i * b->block_size;
  memcpy(feature, src, bytes);
  memcpy(label, src, bytes);
  return DDP_OK;
}

static void blocks_destroy(void *self) {
  lm_blocks_t *b = self;
  if (!b) return;
  ddp__free(b->ids);
  ddp__free(b);
}

static const ddp_dataset_ops_t lm_blocks_ops = {DDP_DATASET_OPS_VERSION, "lm_blocks", blocks_length,
                                                blocks_get, blocks_destroy};

ddp_status_t ddp_dataset_lm_blocks(const int64_t *tokens, int64_t n, int64_t block_size,
                                   int64_t vocab_size, ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(out && (tokens || n <= 0));
  *out = NULL;
  if (block_size < 2)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lm blocks: block_size %lld; a causal-LM block needs at least 2 tokens "
                      "(the model predicts token t + 1 from tokens 0..t)",
                      (long long)block_size);
  if (vocab_size < 1)
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "lm blocks: vocab_size %lld; it must be at least 1", (long long)vocab_size);
  if (n < block_size)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "lm blocks: the stream has %lld tokens, fewer than one block of "
                      "block_size %lld",
                      (long long)(n < 0 ? 0 : n), (long long)block_size);
  for (int64_t i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= vocab_size)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "lm blocks: token id %lld at position %lld is outside the vocabulary "
                        "[0, vocab_size %lld)",
                        (long long)tokens[i], (long long)i, (long long)vocab_size);
  lm_blocks_t *b = ddp__calloc(1, sizeof *b);
  if (!b) return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "lm blocks: dataset");
  b->block_size = block_size;
  b->nblocks = n / block_size;
  size_t used = (size_t)(b->nblocks * block_size);
  b->ids = ddp__malloc(used * sizeof(int64_t));
  if (!b->ids) {
    ddp__free(b);
    return ddp__error(err, -1, DDP_ERR_NO_MEMORY, "lm blocks: %zu tokens", used);
  }
  memcpy(b->ids, tokens, used * sizeof(int64_t));
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_I64;
  spec.feature_ndim = 1;
  spec.feature_shape[0] = block_size;
  spec.label_dtype = DDP_I64;
  spec.label_ndim = 1;
  spec.label_shape[0] = block_size;
  return ddp_dataset_create(&lm_blocks_ops, b, &spec, out, err);
}
