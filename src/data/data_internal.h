/* Private to src/data: the dataset handle and the in-memory source that the file sources
 * (safetensors, CSV) load into. */
#ifndef DDP_SRC_DATA_INTERNAL_H
#define DDP_SRC_DATA_INTERNAL_H

#include "ddp/data.h"

struct ddp_dataset {
  uint32_t magic;
  const ddp_dataset_ops_t *ops;
  void *self;
  ddp_sample_spec_t spec;
  int64_t feature_numel, label_numel; /* elements per sample */
  size_t feature_bytes, label_bytes;  /* bytes per sample */
};

/* Fills numel/bytes from a spec; DDP_ERR_INVALID_ARGUMENT for a bad dtype or shape. */
ddp_status_t ddp__sample_spec_sizes(const ddp_sample_spec_t *spec, int64_t *fnumel, int64_t *lnumel,
                                    ddp_error_t *err);

/* A dataset over n rows held in two buffers from ddp__aligned_alloc, which it takes over
 * (freed with the dataset, or at once on failure). `name` is a static string. */
ddp_status_t ddp__dataset_memory(const char *name, const ddp_sample_spec_t *spec, int64_t n,
                                 void *features, void *labels, ddp_dataset_t **out,
                                 ddp_error_t *err);

/* The in-memory entry points of the text parsers (the fuzz targets call them): `path`
 * only names the input in messages. ddp__tokens_parse_llmc reads llm.c's token format
 * from len bytes; ddp__text_csv_parse reads a text classification CSV from len bytes (no
 * NUL terminator needed). Contracts as ddp_tokens_read and ddp_dataset_from_text_csv. */
ddp_status_t ddp__tokens_parse_llmc(const char *path, const unsigned char *b, size_t len,
                                    int64_t **tokens, int64_t *n, ddp_error_t *err);
ddp_status_t ddp__text_csv_parse(const char *path, const char *text, size_t len,
                                 const ddp_text_csv_options_t *opts, ddp_dataset_t **out,
                                 ddp_error_t *err);

/* DDP_ERR_INVALID_DATA at the first NaN or infinity of a floating tensor (F32, F64, F16,
 * BF16), naming path, the tensor `name`, the element's flat index, its sample (index along
 * dimension 0) and its full index; other dtypes pass (finite.c). */
ddp_status_t ddp__data_check_finite(const ddp_tensor_t *t, const char *path, const char *name,
                                    ddp_error_t *err);

/* The ops of the in-memory source and of the synthetic ones, to recognise them. */
extern const ddp_dataset_ops_t ddp__synth_regression_ops;
extern const ddp_dataset_ops_t ddp__synth_mixture_ops;

#endif /* DDP_SRC_DATA_INTERNAL_H */
