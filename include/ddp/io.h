/* libddp io layer: safetensors read (buffered or mmap) and write.
 *
 * Format (huggingface/safetensors): 8-byte little-endian header length N, N bytes of UTF-8
 * JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 * "__metadata__": {"k": "v"}}, then the data block. Offsets are relative to the data block,
 * and the tensors' byte ranges must tile it exactly: no overlap, no hole, no trailing byte.
 * Tensor bytes are little-endian and row-major.
 *
 * The reader validates everything before handing out a view: a hostile file gets
 * DDP_ERR_INVALID_DATA with a message naming the problem (the tensor, its offsets, the file
 * offset), never an out-of-bounds read. A dtype that safetensors defines but libddp does not
 * support (I8, U16, F8_E4M3, ...) or a shape with more than DDP_MAX_DIMS dimensions is
 * DDP_ERR_UNSUPPORTED.
 *
 * Alignment: the format does not require a tensor's offset to be a multiple of its element
 * size (the reference writer achieves it by sorting tensors by descending element size; this
 * writer keeps the caller's order instead). Views are nevertheless always aligned for their
 * dtype: a tensor whose bytes would land misaligned in memory is copied once, at open, into
 * an aligned side buffer. Order entries by descending element size to make every mmap view
 * zero-copy.
 *
 * A ddp_st_file_t is immutable after open: concurrent readers of one file are safe. */
#ifndef DDP_IO_H
#define DDP_IO_H

#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_st_file ddp_st_file_t;

typedef enum ddp_st_open_flags {
  DDP_ST_READ = 0, /* read the whole file into memory */
  DDP_ST_MMAP = 1  /* map the file read-only; views point into the mapping. The file must
                      not be truncated while it is open (SIGBUS, as with any mapping). */
} ddp_st_open_flags_t;

/* The largest JSON header accepted, as in the reference implementation. */
#define DDP_ST_MAX_HEADER 100000000u

/* Opens and validates a file. On failure *out is NULL and err (optional) says why:
 * DDP_ERR_NOT_FOUND (no such file), DDP_ERR_SYSTEM (other open/read/mmap failures, with
 * errno), DDP_ERR_INVALID_ARGUMENT (not a regular file), DDP_ERR_INVALID_DATA (corrupt),
 * DDP_ERR_UNSUPPORTED, DDP_ERR_NO_MEMORY. */
DDP_API ddp_status_t ddp_st_open(const char *path, int flags, ddp_st_file_t **out,
                                 ddp_error_t *err);
/* Parses an in-memory image (the bytes are copied). The fuzz target's entry point. */
DDP_API ddp_status_t ddp_st_parse(const void *bytes, size_t len, ddp_st_file_t **out,
                                  ddp_error_t *err);
/* NULL is a no-op. Invalidates every view and string obtained from f. */
DDP_API void ddp_st_close(ddp_st_file_t *f);

/* Tensors in file order (the order of their data offsets, which is the order they were
 * written; safetensors' JSON object order is not significant, its data layout is). Zero-byte
 * tensors sharing an offset keep their JSON order. */
DDP_API size_t ddp_st_count(const ddp_st_file_t *f);
DDP_API const char *ddp_st_name(const ddp_st_file_t *f, size_t i);
/* A read-only view (owns == false) valid until ddp_st_close. */
DDP_API ddp_status_t ddp_st_tensor(const ddp_st_file_t *f, size_t i, ddp_tensor_t *view);
/* Index by name; DDP_ERR_NOT_FOUND when absent. */
DDP_API ddp_status_t ddp_st_find(const ddp_st_file_t *f, const char *name, size_t *index);
/* Byte range of tensor i inside the data block, as written in the header. */
DDP_API void ddp_st_offsets(const ddp_st_file_t *f, size_t i, uint64_t *begin, uint64_t *end);

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

/* Writes n tensors in the given order (data block and JSON keys alike, after __metadata__
 * when nmeta > 0) plus optional metadata (nmeta key/value pairs, written in the given order)
 * atomically: a temporary file in the same directory, fsync, rename over path, fsync of the
 * directory. The header is padded with spaces to a multiple of 8 bytes, as the reference
 * writer does. The file gets mode 0644. A failure leaves any previous file at path intact.
 *
 * DDP_ERR_INVALID_ARGUMENT: an empty, duplicate, non-UTF-8 or reserved ("__metadata__")
 * name, a duplicate or non-UTF-8 metadata key or value, an invalid tensor.
 * DDP_ERR_SYSTEM: a failed syscall (named in err with errno). */
DDP_API ddp_status_t ddp_st_write(const char *path, const ddp_st_entry_t *entries, size_t n,
                                  const char *const *meta_keys, const char *const *meta_values,
                                  size_t nmeta, ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_IO_H */
