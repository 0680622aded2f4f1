/* The byte-level tokenizer: a vocabulary of 256 ids, id = byte value. It needs no
 * vocabulary file and round-trips any bytes, valid UTF-8 or not: a multi-byte character
 * is simply several tokens. */
#include "common/common.h"
#include "data/data_internal.h"

ddp_status_t ddp_byte_encode(const char *text, size_t len, int64_t *ids) {
  DDP_REQUIRE((text && ids) || len == 0);
  const unsigned char *b = (const unsigned char *)text;
  for (size_t i = 0; i < len; i++) ids[i] = b[i];
  return DDP_OK;
}

ddp_status_t ddp_byte_decode(const int64_t *ids, int64_t n, char *text, ddp_error_t *err) {
  DDP_REQUIRE(text && (ids || n == 0) && n >= 0);
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= DDP_BYTE_VOCAB_SIZE)
      return ddp__error(err, -1, DDP_ERR_INVALID_DATA,
                        "byte decode: id %lld at position %lld is outside the byte vocabulary "
                        "[0, %d)",
                        (long long)ids[i], (long long)i, DDP_BYTE_VOCAB_SIZE);
    text[i] = (char)(unsigned char)ids[i];
  }
  text[n] = '\0';
  return DDP_OK;
}
