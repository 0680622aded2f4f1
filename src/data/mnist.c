/* MNIST in LeCun's idx format: a 4-byte big-endian magic (0x00000803 for u8 images with
 * three dimensions, 0x00000801 for u8 labels with one), big-endian u32 dimension sizes,
 * then the bytes. Both files are read whole and checked against their headers before
 * any sample is served; the images stay as bytes and are widened to F32 per sample. */
#include <string.h>

#include "common/common.h"
#include "data/data_internal.h"

#define IDX_IMAGES_MAGIC 0x00000803u
#define IDX_LABELS_MAGIC 0x00000801u

typedef struct mnist_ds {
  int64_t n, rows, cols;
  bool scale;
  unsigned char *images; /* [n, rows, cols] */
  unsigned char *labels; /* [n] */
} mnist_ds_t;

static int64_t mnist_length(void *self) { return ((mnist_ds_t *)self)->n; }

static ddp_status_t mnist_get(void *self, int64_t i, void *feature, void *label, ddp_error_t *err) {
  mnist_ds_t *m = self;
  int64_t px = m->rows * m->cols;
  const unsigned char *src = m->images + i * px;
  float *dst = feature;
  /* ToTensor divides by 255 in f32: byte / 255.0f, one rounding. */
  for (int64_t k = 0; k < px; k++) dst[k] = m->scale ? (float)src[k] / 255.0f : (float)src[k];
  *(int64_t *)label = m->labels[i];
  return DDP_OK;
}

static void mnist_destroy(void *self) {
  mnist_ds_t *m = self;
  if (!m) return;
  ddp__free(m->images);
  ddp__free(m->labels);
  ddp__free(m);
}

static const ddp_dataset_ops_t mnist_ops = {DDP_DATASET_OPS_VERSION, "mnist", mnist_length,
                                            mnist_get, mnist_destroy};

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Checks an idx header: magic, and that the payload is exactly the product of the dims. */
static ddp_status_t check_idx(const char *path, const unsigned char *b, size_t len, uint32_t magic,
                              int ndims, uint32_t *dims, ddp_error_t *err) {
  size_t hdr = 4 + 4 * (size_t)ndims;
  if (len < hdr)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "mnist %s: file is %zu bytes, shorter than its %zu-byte idx header", path,
                      len, hdr);
  uint32_t m = be32(b);
  if (m != magic)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "mnist %s: idx magic at offset 0 is 0x%08x, expected 0x%08x (%s)", path, m,
                      magic, magic == IDX_IMAGES_MAGIC ? "idx3-ubyte images" : "idx1-ubyte labels");
  uint64_t payload = 1;
  for (int d = 0; d < ndims; d++) {
    dims[d] = be32(b + 4 + 4 * d);
    if (d > 0 && dims[d] == 0)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA, "mnist %s: dimension %d (offset %d) is zero",
                        path, d, 4 + 4 * d);
    payload *= dims[d]; /* at most 2^96 in theory; 3 dims of u32 checked below */
    if (payload > (uint64_t)1 << 48)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "mnist %s: header dimensions give an impossible size", path);
  }
  if (len - hdr != payload)
    return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                      "mnist %s: header promises %llu data bytes after offset %zu but the file "
                      "has %zu (%s)",
                      path, (unsigned long long)payload, hdr, len - hdr,
                      len - hdr < payload ? "truncated" : "trailing bytes");
  return DDP_OK;
}

ddp_status_t ddp_dataset_from_mnist(const char *images_path, const char *labels_path, bool scale,
                                    ddp_dataset_t **out, ddp_error_t *err) {
  DDP_REQUIRE(images_path && labels_path && out);
  *out = NULL;
  unsigned char *img = NULL, *lab = NULL;
  size_t ilen = 0, llen = 0;
  mnist_ds_t *m = NULL;
  ddp_status_t st;
  uint32_t idims[3], ldims[1];
  char *ib = NULL, *lb = NULL;
  st = ddp__file_read(images_path, 0, -1, "mnist", &ib, &ilen, err);
  img = (unsigned char *)ib;
  if (st != DDP_OK) goto fail;
  st = ddp__file_read(labels_path, 0, -1, "mnist", &lb, &llen, err);
  lab = (unsigned char *)lb;
  if (st != DDP_OK) goto fail;
  DDP_CHECK_GOTO(check_idx(images_path, img, ilen, IDX_IMAGES_MAGIC, 3, idims, err), st, fail);
  DDP_CHECK_GOTO(check_idx(labels_path, lab, llen, IDX_LABELS_MAGIC, 1, ldims, err), st, fail);
  if (idims[0] != ldims[0]) {
    st = ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                    "mnist: %s holds %u images but %s holds %u labels", images_path, idims[0],
                    labels_path, ldims[0]);
    goto fail;
  }
  m = ddp__calloc(1, sizeof *m);
  if (!m) {
    st = DDP_ERR_NO_MEMORY;
    goto fail;
  }
  m->n = idims[0];
  m->rows = idims[1];
  m->cols = idims[2];
  m->scale = scale;
  /* Keep the payloads in place: shift them to the buffers' starts. */
  memmove(img, img + 16, ilen - 16);
  memmove(lab, lab + 8, llen - 8);
  m->images = img;
  m->labels = lab;
  ddp_sample_spec_t spec;
  memset(&spec, 0, sizeof spec);
  spec.feature_dtype = DDP_F32;
  spec.feature_ndim = 2;
  spec.feature_shape[0] = m->rows;
  spec.feature_shape[1] = m->cols;
  spec.label_dtype = DDP_I64;
  spec.label_ndim = 0;
  return ddp_dataset_create(&mnist_ops, m, &spec, out, err);
fail:
  ddp__free(img);
  ddp__free(lab);
  return st;
}
