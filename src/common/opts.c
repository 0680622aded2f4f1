/* The one compatibility policy for options structs (docs/design.md). */
#include <string.h>

#include "common/common.h"

void ddp__opts_read(void *dst, size_t dst_size, const void *src) {
  DDP_REQUIRE(dst && dst_size >= sizeof(size_t));
  if (src) {
    size_t n;
    memcpy(&n, src, sizeof n);
    DDP_REQUIRE(n >= sizeof(size_t) && n <= dst_size);
    memcpy(dst, src, n);
  }
  memcpy(dst, &dst_size, sizeof dst_size);
}
