/* libddp data layer: datasets, PyTorch's DistributedSampler (bit-exact shuffles), and a
 * per-rank batch loader.
 *
 * A dataset is a table of functions (length, get one sample) plus a fixed per-sample
 * layout: a feature tensor shape/dtype and a label tensor shape/dtype. Built-in sources:
 * in-memory tensors, a safetensors file, CSV, MNIST idx files, two synthetic tasks
 * drawn from the counter-based RNG, and text: token streams cut into causal-LM blocks and
 * a text classification CSV. Every source validates its input fully: a corrupt or
 * truncated file is DDP_ERR_INVALID_DATA with a message naming the file, the offset or
 * line, and what was wrong.
 *
 * DistributedSampler reproduces torch.utils.data.DistributedSampler (1.13) exactly,
 * including torch.randperm with a torch.Generator seeded with seed + epoch (MT19937), so
 * rank r sees the same sample indices as a PyTorch job with the same seed and epoch.
 *
 * Thread-safety: a dataset's get() may be called from several threads at once (built-in
 * sources are read-only after create). A sampler or loader belongs to one thread. */
#ifndef DDP_DATA_H
#define DDP_DATA_H

#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- datasets -------- */

/* The layout of one sample: features and label, each a dtype and a shape (without the
 * batch dimension). A scalar label has label_ndim 0. */
typedef struct ddp_sample_spec {
  ddp_dtype_t feature_dtype;
  int feature_ndim;
  int64_t feature_shape[DDP_MAX_DIMS];
  ddp_dtype_t label_dtype;
  int label_ndim;
  int64_t label_shape[DDP_MAX_DIMS];
} ddp_sample_spec_t;

/* A dataset implementation. `self` is the implementation's state. get() writes sample
 * `index` (0 <= index < length) into `feature` and `label`, buffers of exactly the spec's
 * sizes. destroy() releases self (may be NULL). Version 1. */
#define DDP_DATASET_OPS_VERSION 1
typedef struct ddp_dataset_ops {
  uint32_t version;
  const char *name;
  int64_t (*length)(void *self);
  ddp_status_t (*get)(void *self, int64_t index, void *feature, void *label, ddp_error_t *err);
  void (*destroy)(void *self);
} ddp_dataset_ops_t;

typedef struct ddp_dataset ddp_dataset_t;

/* Wraps a user implementation. ops must outlive the dataset; self is owned by it from now
 * on (destroy is called at ddp_dataset_destroy, or at once when create fails). */
DDP_API ddp_status_t ddp_dataset_create(const ddp_dataset_ops_t *ops, void *self,
                                        const ddp_sample_spec_t *spec, ddp_dataset_t **out,
                                        ddp_error_t *err);
DDP_API void ddp_dataset_destroy(ddp_dataset_t *ds);
DDP_API int64_t ddp_dataset_length(const ddp_dataset_t *ds);
DDP_API const ddp_sample_spec_t *ddp_dataset_spec(const ddp_dataset_t *ds);
DDP_API const char *ddp_dataset_name(const ddp_dataset_t *ds);
/* Elements of one sample's features / label. */
DDP_API int64_t ddp_dataset_feature_numel(const ddp_dataset_t *ds);
DDP_API int64_t ddp_dataset_label_numel(const ddp_dataset_t *ds);

/* Writes sample `index` into feature and label, tensors of the spec's dtypes and element
 * counts (any shape). Out-of-range index or mismatched tensors: DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_status_t ddp_dataset_get(const ddp_dataset_t *ds, int64_t index, ddp_tensor_t *feature,
                                     ddp_tensor_t *label, ddp_error_t *err);
/* Gathers n samples into features [n, ...] and labels [n, ...] (tensors holding at least
 * n samples of the spec's dtype; the first n rows are written). */
DDP_API ddp_status_t ddp_dataset_get_batch(const ddp_dataset_t *ds, const int64_t *indices,
                                           int64_t n, ddp_tensor_t *features, ddp_tensor_t *labels,
                                           ddp_error_t *err);

/* In-memory: features [N, ...] and labels [N, ...] or [N] (any dtypes). Both are copied. */
DDP_API ddp_status_t ddp_dataset_from_tensors(const ddp_tensor_t *features,
                                              const ddp_tensor_t *labels, ddp_dataset_t **out,
                                              ddp_error_t *err);

/* A safetensors file holding a features tensor [N, ...] and a labels tensor [N, ...]
 * under the given names (NULL means "features" and "labels"). The data are copied. A NaN or
 * an infinity in a floating tensor is DDP_ERR_INVALID_DATA naming the file, the tensor, the
 * element and its sample. */
DDP_API ddp_status_t ddp_dataset_from_safetensors(const char *path, const char *feature_name,
                                                  const char *label_name, ddp_dataset_t **out,
                                                  ddp_error_t *err);

/* CSV: a header row, then one sample per line of numeric fields separated by `delimiter`
 * (',' when 0). The label column is named by label_column (a header name), and its values
 * become labels of label_dtype: DDP_I64 for classes (must be integers) or DDP_F32 for
 * regression. All other columns are F32 features. Blank lines at the end are ignored; a
 * ragged row, an empty or non-numeric field, NaN, an infinity ("inf", "1e999"), a value
 * outside float32's range ("1e39"), or a missing label column is DDP_ERR_INVALID_DATA
 * naming the line and column. */
typedef struct ddp_csv_options {
  size_t struct_size;
  const char *label_column;
  ddp_dtype_t label_dtype;
  char delimiter;
} ddp_csv_options_t;
#define DDP_CSV_OPTIONS_INIT \
  { sizeof(ddp_csv_options_t), "label", DDP_I64, ',' }
DDP_API ddp_status_t ddp_dataset_from_csv(const char *path, const ddp_csv_options_t *opts,
                                          ddp_dataset_t **out, ddp_error_t *err);

/* MNIST idx files: images (idx3-ubyte: magic 0x00000803, big-endian count, rows, cols, then
 * bytes) and labels (idx1-ubyte: magic 0x00000801, count, bytes). Features are F32
 * [rows, cols], scaled by 1/255 when scale is true (torchvision's ToTensor) or raw 0..255
 * values otherwise; labels are I64 scalars. Wrong magic, counts that differ between the
 * files, a size that disagrees with the header (truncated or trailing bytes): all
 * DDP_ERR_INVALID_DATA with the file name and the offending value. */
DDP_API ddp_status_t ddp_dataset_from_mnist(const char *images_path, const char *labels_path,
                                            bool scale, ddp_dataset_t **out, ddp_error_t *err);

/* Synthetic regression: a fixed random teacher network y = W2 tanh(W1 x + b1) + b2 + noise,
 * with x ~ N(0, I). Sample i is a pure function of (seed, i): it is drawn on demand from
 * the Philox stream ddp_rng_stream(DDP_RNG_DATA, 0, i) under the seed, so any rank can read
 * any sample. Features F32 [in_dim], labels F32 [out_dim]. Teacher weights:
 * W1 [hidden, in_dim], b1 [hidden] from N(0, 1/in_dim)
 * and N(0, 1); W2 [out_dim, hidden], b2 [out_dim] from N(0, 1/hidden), N(0, 1); all from
 * the teacher stream ddp_rng_stream(DDP_RNG_DATA, 1, 0), in that order. The label is the
 * forward pass accumulated in double (index order) and rounded to f32, plus
 * noise_std * N(0, 1) drawn after the features. */
typedef struct ddp_synth_regression {
  uint64_t seed;
  int64_t n;
  int64_t in_dim, hidden, out_dim;
  float noise_std;
} ddp_synth_regression_t;
DDP_API ddp_status_t ddp_dataset_synthetic_regression(const ddp_synth_regression_t *cfg,
                                                      ddp_dataset_t **out, ddp_error_t *err);
/* The teacher of a synthetic regression dataset (views valid for the dataset's life):
 * w1 [hidden, in_dim], b1 [hidden], w2 [out_dim, hidden], b2 [out_dim].
 * DDP_ERR_INVALID_ARGUMENT for another kind of dataset. */
DDP_API ddp_status_t ddp_dataset_teacher(const ddp_dataset_t *ds, ddp_tensor_t *w1,
                                         ddp_tensor_t *b1, ddp_tensor_t *w2, ddp_tensor_t *b2);

/* Synthetic classification: a mixture of num_classes Gaussians in dim dimensions. Class
 * centres are N(0, separation^2 I) from the teacher stream; sample i has label
 * c = (u32 draw) mod num_classes and features centre[c] + N(0, I), from stream
 * ddp_rng_stream(DDP_RNG_DATA, 0, i). n is at most 2^32 for both tasks. Features F32 [dim],
 * labels I64. */
typedef struct ddp_synth_mixture {
  uint64_t seed;
  int64_t n;
  int64_t dim;
  int64_t num_classes;
  float separation;
} ddp_synth_mixture_t;
DDP_API ddp_status_t ddp_dataset_synthetic_mixture(const ddp_synth_mixture_t *cfg,
                                                   ddp_dataset_t **out, ddp_error_t *err);
/* The class centres of a mixture dataset: a view [num_classes, dim]. */
DDP_API ddp_status_t ddp_dataset_centers(const ddp_dataset_t *ds, ddp_tensor_t *centers);

/* ---------------------------------------------------------------- randperm -------- */

/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) on CPU, bit for bit:
 * MT19937 seeded with the low 32 bits of seed, then torch's swap shuffle (for n below
 * 2^32/20, 32-bit draws taken mod n - i; above, torch's inside-out variant on 64-bit
 * draws). out has n entries. */
DDP_API void ddp_randperm(int64_t n, uint64_t seed, int64_t *out);

/* Splits ds deterministically into a training and a held-out part: the held-out part is the
 * first round(fraction * N) entries of torch.randperm(N, seed), the training part the
 * rest, each in ascending index order. fraction is in [0, 1) (ddp_train_args_t's
 * eval_split). Both views borrow ds, which must outlive them. */
DDP_API ddp_status_t ddp_dataset_split(const ddp_dataset_t *ds, double fraction, uint64_t seed,
                                       ddp_dataset_t **train, ddp_dataset_t **eval,
                                       ddp_error_t *err);

/* ---------------------------------------------------------------- sampler --------- */

typedef struct ddp_sampler_options {
  size_t struct_size;
  int64_t dataset_len; /* N */
  int num_replicas;    /* W */
  int rank;            /* 0 <= rank < W */
  bool shuffle;        /* torch default true */
  uint64_t seed;       /* torch default 0 */
  bool drop_last;      /* torch default false */
} ddp_sampler_options_t;
#define DDP_SAMPLER_OPTIONS_INIT \
  { sizeof(ddp_sampler_options_t), 0, 1, 0, true, 0, false }

typedef struct ddp_sampler ddp_sampler_t;

/* torch's checks and messages: rank outside [0, W-1] is DDP_ERR_INVALID_ARGUMENT
 * ("Invalid rank r, rank should be in the interval [0, W-1]"); so are W < 1 and N < 0. */
DDP_API ddp_status_t ddp_sampler_create(const ddp_sampler_options_t *opts, ddp_sampler_t **out,
                                        ddp_error_t *err);
DDP_API void ddp_sampler_destroy(ddp_sampler_t *s);
/* set_epoch: the next indices() call uses seed + epoch. */
DDP_API void ddp_sampler_set_epoch(ddp_sampler_t *s, int64_t epoch);
DDP_API int64_t ddp_sampler_epoch(const ddp_sampler_t *s);
/* num_samples (this rank's count; equal on every rank) and total_size = num_samples * W. */
DDP_API int64_t ddp_sampler_len(const ddp_sampler_t *s);
DDP_API int64_t ddp_sampler_total_size(const ddp_sampler_t *s);
DDP_API int64_t ddp_sampler_dataset_len(const ddp_sampler_t *s);
/* This rank's indices for the current epoch: *indices points at len() entries owned by
 * the sampler, valid until the next call or destroy. */
DDP_API ddp_status_t ddp_sampler_indices(ddp_sampler_t *s, const int64_t **indices, int64_t *n);

/* ---------------------------------------------------------------- loader ---------- */

typedef struct ddp_loader_options {
  size_t struct_size;
  int64_t batch_size; /* >= 1 */
  bool drop_last;     /* DataLoader's drop_last: drop a final partial batch */
} ddp_loader_options_t;
#define DDP_LOADER_OPTIONS_INIT \
  { sizeof(ddp_loader_options_t), 1, false }

/* One batch: views into loader-owned buffers, valid until the next ddp_loader_next. */
typedef struct ddp_batch {
  ddp_tensor_t features;  /* [size, feature shape...] */
  ddp_tensor_t labels;    /* [size, label shape...] */
  const int64_t *indices; /* [size] dataset indices of the rows */
  int64_t size;           /* rows; batch_size except perhaps the last */
  int64_t index;          /* batch number within the epoch, from 0 */
} ddp_batch_t;

typedef struct ddp_loader ddp_loader_t;

/* A loader over ds in the sampler's order (sampler may be NULL: all indices in order, as
 * torch's SequentialSampler). Both must outlive the loader. */
DDP_API ddp_status_t ddp_loader_create(const ddp_dataset_t *ds, ddp_sampler_t *sampler,
                                       const ddp_loader_options_t *opts, ddp_loader_t **out,
                                       ddp_error_t *err);
DDP_API void ddp_loader_destroy(ddp_loader_t *l);
/* Starts an epoch: sets the sampler's epoch and rewinds. */
DDP_API ddp_status_t ddp_loader_set_epoch(ddp_loader_t *l, int64_t epoch, ddp_error_t *err);
/* Batches per epoch on this rank (torch's len(DataLoader)). */
DDP_API int64_t ddp_loader_num_batches(const ddp_loader_t *l);
/* Positions the loader of `epoch` so that the next batch is batch number `batch` of that
 * epoch (batch * batch_size indices in), without reading the batches before it; sets the
 * epoch first when it differs. DDP_ERR_INVALID_ARGUMENT past the epoch's end. */
DDP_API ddp_status_t ddp_loader_seek(ddp_loader_t *l, int64_t epoch, int64_t batch,
                                     ddp_error_t *err);
/* The next batch of the current epoch, *has_batch false at the end (then the loader stays
 * at the end until set_epoch). The first call after create starts epoch 0 by itself. */
DDP_API ddp_status_t ddp_loader_next(ddp_loader_t *l, ddp_batch_t *batch, bool *has_batch,
                                     ddp_error_t *err);

/* ---------------------------------------------------------------- text data ------- */

/* Token streams, the byte-level tokenizer, causal-LM blocks and text classification CSV
 * (docs/data.md, "Text data"). A token stream is a 1-D array of non-negative ids held as
 * int64 whatever the file stored. */

/* llm.c's token files (karpathy/llm.c dev/data/data_common.py): a header of 256
 * little-endian int32 -- [0] magic, [1] version, [2] token count, the rest 0 -- then the
 * tokens, little-endian: uint16 for GPT-2's format (magic 20240520, version 1), uint32 for
 * its Llama 3 format (magic 20240801, version 7). */
#define DDP_LLMC_MAGIC 20240520
#define DDP_LLMC_VERSION 1
#define DDP_LLMC_MAGIC_U32 20240801
#define DDP_LLMC_VERSION_U32 7
#define DDP_LLMC_HEADER_INTS 256

/* The byte-level tokenizer's vocabulary: id = byte value. */
#define DDP_BYTE_VOCAB_SIZE 256

/* Reads a token stream. The format comes from the name's extension, or from the content
 * when the extension is none of these:
 *  - ".bin": llm.c's format (either magic);
 *  - ".safetensors": a 1-D integer tensor named "tokens", or the file's only tensor, of
 *    dtype I32, I64, U16 or U8 (the file is validated as a whole by the safetensors reader);
 *  - ".txt": raw bytes through the byte-level tokenizer (any bytes; invalid UTF-8 is kept).
 * Errors are DDP_ERR_INVALID_DATA naming the file and the fault: the magic (expected and
 * found), the version, a truncated file or trailing bytes (expected and actual sizes), an
 * empty stream, a negative id (with its position), a wrong dtype or rank; a missing file is
 * DDP_ERR_NOT_FOUND. On success *tokens (n >= 1 entries) is the caller's, freed with
 * ddp_tokens_free; on failure it is NULL. */
DDP_API ddp_status_t ddp_tokens_read(const char *path, int64_t **tokens, int64_t *n,
                                     ddp_error_t *err);
/* Frees what ddp_tokens_read returned (NULL is a no-op). */
DDP_API void ddp_tokens_free(int64_t *tokens);
/* Writes llm.c's GPT-2 format (magic 20240520, version 1, uint16 tokens) atomically: a
 * temporary file beside path, then rename. n must be in [1, 2^31 - 1] and every id in
 * [0, 65535]; otherwise DDP_ERR_INVALID_ARGUMENT naming the count or the id's position. */
DDP_API ddp_status_t ddp_tokens_write_llmc(const char *path, const int64_t *tokens, int64_t n,
                                           ddp_error_t *err);
/* Writes llm.c's Llama 3 format (magic 20240801, version 7, uint32 tokens) the same way:
 * every id in [0, 2^32 - 1]. */
DDP_API ddp_status_t ddp_tokens_write_llmc_llama3(const char *path, const int64_t *tokens,
                                                  int64_t n, ddp_error_t *err);

/* Byte-level tokenizer. encode: ids[i] = (unsigned char)text[i] for i < len (ids has len
 * entries; always DDP_OK). decode: text[i] = ids[i] for i < n and text[n] = '\0' (text has
 * n + 1 bytes); the bytes are written as they are, valid UTF-8 or not. An id outside
 * [0, 255] is DDP_ERR_INVALID_DATA naming its position and value (the bytes of the ids
 * before it are written, nothing else). */
DDP_API ddp_status_t ddp_byte_encode(const char *text, size_t len, int64_t *ids);
DDP_API ddp_status_t ddp_byte_decode(const int64_t *ids, int64_t n, char *text, ddp_error_t *err);

/* Causal-LM blocks, as Transformers' run_clm group_texts: the stream cut into
 * n / block_size blocks of block_size tokens, the remainder dropped. Sample i: features
 * I64 [block_size] = labels I64 [block_size] = tokens[i * block_size, (i + 1) * block_size)
 * (the model shifts the labels). The tokens are copied. Every id of the stream must lie in
 * [0, vocab_size): one that does not is DDP_ERR_INVALID_DATA naming its position, value and
 * vocab_size. block_size < 2 or vocab_size < 1 is DDP_ERR_INVALID_ARGUMENT; a stream
 * shorter than one block is DDP_ERR_INVALID_DATA. The dataset is named "lm_blocks". */
DDP_API ddp_status_t ddp_dataset_lm_blocks(const int64_t *tokens, int64_t n, int64_t block_size,
                                           int64_t vocab_size, ddp_dataset_t **out,
                                           ddp_error_t *err);

/* Text classification CSV, as Transformers' run_glue reads a CSV with a text and a label
 * column: a header row naming the columns (other columns are ignored), then one record
 * per sample, RFC 4180 quoting (a field in double quotes may hold the delimiter, line
 * breaks and doubled quotes ""). Each text is byte-tokenized, truncated to max_length and
 * padded on the right with pad_token_id. Features I64 [2, max_length]: row 0 the ids, row
 * 1 the attention mask (1 for a text byte, 0 for padding). Labels: I64 scalars (class ids,
 * any integer) or F32 scalars (regression) by label_dtype. Records end in \n or \r\n; a
 * UTF-8 byte order mark is skipped; blank lines are allowed only at the end. Every error
 * is DDP_ERR_INVALID_DATA naming the file, the 1-based line and column: an empty file, a
 * missing column, a record of the wrong width, an empty text, a label that is not an
 * integer (or not a number), a class id outside [0, num_labels), an unterminated quote (with the
 * line where it opened), text after a closing quote, a NUL byte, no records. The dataset is named
 * "text_csv". */
typedef struct ddp_text_csv_options {
  size_t struct_size;
  const char *text_column;  /* header name of the text; "text" */
  const char *label_column; /* header name of the label; "label" */
  int64_t max_length;       /* tokens per sample, >= 1; 128 (run_glue's max_seq_length) */
  int64_t pad_token_id;     /* id written past the text; 0 */
  ddp_dtype_t label_dtype;  /* DDP_I64 (classes) or DDP_F32 (regression); DDP_I64 */
  char delimiter;           /* ',' (0 means ','); '\t' reads TSV */
  int64_t num_labels;       /* > 0 with I64 labels: each must be a class id in [0, num_labels)
                             * (the model's num_labels), checked as the file is read; 0: any */
} ddp_text_csv_options_t;
#define DDP_TEXT_CSV_OPTIONS_INIT \
  { sizeof(ddp_text_csv_options_t), "text", "label", 128, 0, DDP_I64, ',', 0 }
DDP_API ddp_status_t ddp_dataset_from_text_csv(const char *path, const ddp_text_csv_options_t *opts,
                                               ddp_dataset_t **out, ddp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif /* DDP_DATA_H */
