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
ddp_status_t ddp__sample_spec_sizes(const ddp_sample_spec_t *spec, int64_t *fnumel,
                                    int64_t *lnumel, ddp_error_t *err);

/* A dataset over n rows held in two buffers from ddp__aligned_alloc, which it takes over
 * (freed with the dataset, or at once on failure). `name` is a static string. */
ddp_status_t ddp__dataset_memory(const char *name, const ddp_sample_spec_t *spec, int64_t n,
                                 void *features, void *labels, ddp_dataset_t **out,
                                 ddp_error_t *err);

/* The ops of the in-memory source and of the synthetic ones, to recognise them. */
extern const ddp_dataset_ops_t ddp__synth_regression_ops;
extern const ddp_dataset_ops_t ddp__synth_mixture_ops;

#endif /* DDP_SRC_DATA_INTERNAL_H */
