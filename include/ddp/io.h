/* libddp io layer: safetensors read (buffered or mmap) and write.
 *
 * Format (huggingface/safetensors): 8-byte little-endian header length N, N bytes of UTF-8
 * JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 * "__metadata__": {"k": "v"}}, then the data block. Offsets are relative to the data block.
 * The reader validates everything before handing out a view: a hostile file gets
 * DDP_ERR_INVALID_DATA with a message naming the problem, never an out-of-bounds read. */
#ifndef DDP_IO_H
#define DDP_IO_H

#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_st_file ddp_st_file_t;

typedef enum ddp_st_open_flags {
  DDP_ST_READ = 0,    /* read the whole file into memory */
  DDP_ST_MMAP = 1     /* map the file read-only; views point into the mapping */
} ddp_st_open_flags_t;

/* Opens and validates a file. On failure *out is NULL and err (optional) says why. */
DDP_API ddp_status_t ddp_st_open(const char *path, int flags, ddp_st_file_t **out,
                                 ddp_error_t *err);
/* Parses an in-memory image (the bytes are copied). The fuzz target's entry point. */
DDP_API ddp_status_t ddp_st_parse(const void *bytes, size_t len, ddp_st_file_t **out,
                                  ddp_error_t *err);
DDP_API void ddp_st_close(ddp_st_file_t *f);

/* Tensors in file order (the order of their data offsets, which is the order they were
 * written; safetensors' JSON object order is not significant, its data layout is). */
DDP_API size_t ddp_st_count(const ddp_st_file_t *f);
DDP_API const char *ddp_st_name(const ddp_st_file_t *f, size_t i);
/* A read-only view valid until ddp_st_close. */
DDP_API ddp_status_t ddp_st_tensor(const ddp_st_file_t *f, size_t i, ddp_tensor_t *view);
/* Index by name; DDP_ERR_NOT_FOUND when absent. */
DDP_API ddp_status_t ddp_st_find(const ddp_st_file_t *f, const char *name, size_t *index);

/* The __metadata__ string map, in file order. ddp_st_meta_get returns NULL when absent. */
DDP_API size_t ddp_st_meta_count(const ddp_st_file_t *f);
DDP_API const char *ddp_st_meta_key(const ddp_st_file_t *f, size_t i);
DDP_API const char *ddp_st_meta_value(const ddp_st_file_t *f, size_t i);
DDP_API const char *ddp_st_meta_get(const ddp_st_file_t *f, const char *key);

/* One entry to write. */
typedef struct ddp_st_entry {
  const char *name;
  const ddp_tensor_t *tensor;
} ddp_st_entry_t;

/* Writes n tensors in the given order plus optional metadata (nmeta key/value pairs)
 * atomically: a temporary file in the same directory, fsync, rename, fsync of the
 * directory. Duplicate or empty names are DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_status_t ddp_st_write(const char *path, const ddp_st_entry_t *entries, size_t n,
                                  const char *const *meta_keys, const char *const *meta_values,
                                  size_t nmeta, ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_IO_H */
