/* libFuzzer target for the safetensors parser (ddp_st_parse). Build and run: docs/fuzzing.md.
 *
 * Beyond "no crash, no sanitizer report", every accepted input must satisfy the reader's
 * contract, checked here independently of the parser: tensors are in ascending, contiguous
 * offset order; each view's byte size is numel * element size; views are aligned for their
 * dtype; every byte of every view is readable (ASan faults otherwise); names are unique
 * (ddp_st_find returns each tensor's own index); metadata lookups agree. A rejected input
 * must come with a non-empty message. A violation aborts, which libFuzzer reports. */
#include "ddp/io.h"

#define FUZZ_TARGET "fuzz_safetensors"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ddp_st_file_t *f = NULL;
  ddp_error_t err = {0};
  ddp_status_t st = ddp_st_parse(data, size, &f, &err);
  if (st != DDP_OK) {
    CHECK(f == NULL);
    CHECK(err.status == st && err.msg[0] != '\0');
    CHECK(st == DDP_ERR_INVALID_DATA || st == DDP_ERR_UNSUPPORTED || st == DDP_ERR_NO_MEMORY);
    return 0;
  }
  CHECK(size >= 8);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | data[i];
  uint64_t data_len = size - 8 - hlen;
  uint64_t pos = 0;
  for (size_t i = 0; i < ddp_st_count(f); i++) {
    ddp_tensor_t v;
    CHECK(ddp_st_tensor(f, i, &v) == DDP_OK);
    uint64_t b, e;
    ddp_st_offsets(f, i, &b, &e);
    CHECK(b == pos && e >= b);
    pos = e;
    size_t es = ddp_dtype_size(v.dtype);
    CHECK(es > 0 && v.ndim >= 0 && v.ndim <= DDP_MAX_DIMS && !v.owns);
    int64_t numel = 1;
    for (int d = 0; d < v.ndim; d++) numel *= v.shape[d];
    CHECK(numel == v.numel && (uint64_t)numel * es == e - b);
    if (e > b) {
      CHECK((uintptr_t)v.data % es == 0);
      /* The view holds the file's bytes (and every one of them is readable). */
      CHECK(memcmp(v.data, data + 8 + hlen + b, (size_t)(e - b)) == 0);
    }
    size_t idx;
    CHECK(ddp_st_find(f, ddp_st_name(f, i), &idx) == DDP_OK && idx == i);
  }
  CHECK(pos == data_len);
  for (size_t i = 0; i < ddp_st_meta_count(f); i++) {
    CHECK(ddp_st_meta_get(f, ddp_st_meta_key(f, i)) == ddp_st_meta_value(f, i));
  }
  ddp_st_close(f);
  return 0;
}
