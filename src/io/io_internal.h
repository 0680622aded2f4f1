/* Private to src/io: what the safetensors reader and writer share. */
#ifndef DDP_SRC_IO_INTERNAL_H
#define DDP_SRC_IO_INTERNAL_H

#include <stddef.h>

#define ST_META_KEY "__metadata__"
/* Tensor names are printed truncated in messages, so one message fits DDP_ERROR_MSG_MAX. */
#define NM "%.80s"

/* Returns len when s[0..len) is valid UTF-8 (RFC 3629: no overlong forms, no surrogates,
 * nothing above U+10FFFF), else the offset of the first bad sequence. */
size_t ddp__st_utf8_check(const unsigned char *s, size_t len);
/* qsort comparison of two const char * by strcmp. */
int ddp__st_cmp_str_ptr(const void *a, const void *b);

#endif /* DDP_SRC_IO_INTERNAL_H */
