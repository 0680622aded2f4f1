/* libFuzzer target for llm.c's token file reader (ddp__tokens_parse_llmc, behind
 * ddp_tokens_read for .bin files). Build and run: docs/fuzzing.md.
 *
 * Beyond "no crash, no sanitizer report": an accepted input has one of llm.c's two
 * magic/version pairs, a positive count equal to the returned length, exactly
 * 1024 + count * element-size bytes, and ids equal to the little-endian payload; a
 * rejected one comes with INVALID_DATA or NO_MEMORY, a message that names the input, and
 * no output. A violation aborts, which libFuzzer reports. */
#include "data/data_internal.h"

#define FUZZ_TARGET "fuzz_llmc_tokens"
#include "fuzz_common.h"

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t *copy = fuzz_copy(data, size);
  int64_t *ids = NULL, n = -1;
  ddp_error_t err = {0};
  ddp_status_t st = ddp__tokens_parse_llmc("fuzz.bin", copy, size, &ids, &n, &err);
  if (st != DDP_OK) {
    CHECK(ids == NULL && n == 0);
    CHECK(st == DDP_ERR_INVALID_DATA || st == DDP_ERR_NO_MEMORY);
    CHECK(err.status == st && strstr(err.msg, "fuzz.bin"));
    free(copy);
    return 0;
  }
  CHECK(size >= 1024 && ids && n > 0);
  uint32_t magic = le32(copy), version = le32(copy + 4);
  size_t es = magic == DDP_LLMC_MAGIC ? 2 : 4;
  CHECK((magic == DDP_LLMC_MAGIC && version == DDP_LLMC_VERSION) ||
        (magic == DDP_LLMC_MAGIC_U32 && version == DDP_LLMC_VERSION_U32));
  CHECK((int64_t)le32(copy + 8) == n && size == 1024 + (size_t)n * es);
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *p = copy + 1024 + (size_t)i * es;
    int64_t want = es == 2 ? (int64_t)(p[0] | p[1] << 8) : (int64_t)le32(p);
    CHECK(ids[i] == want);
  }
  ddp_tokens_free(ids);
  free(copy);
  return 0;
}
