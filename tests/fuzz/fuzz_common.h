/* What every libFuzzer target here shares: the two entry points' prototypes,
 * LLVMFuzzerInitialize (it silences the library's log: every rejected input would print a
 * line), CHECK (an invariant: a violation prints FUZZ_TARGET and the condition, then aborts,
 * which libFuzzer reports) and fuzz_copy. Each target is an executable of its own and
 * includes this once, after defining FUZZ_TARGET as its name. */
#ifndef DDP_FUZZ_COMMON_H
#define DDP_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void drop_log(void *user, ddp_log_level_t level, const char *line) {
  (void)user;
  (void)level;
  (void)line;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  ddp_set_log_sink(drop_log, NULL);
  return 0;
}

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, FUZZ_TARGET ": invariant failed: %s\n", #cond); \
      abort();                                                        \
    }                                                                 \
  } while (0)

/* An exact-size copy of the input (one byte when it is empty), so that ASan catches a read
 * one byte past the end and nothing follows the bytes (no NUL). The caller frees it. */
static inline uint8_t *fuzz_copy(const uint8_t *data, size_t size) {
  uint8_t *copy = malloc(size ? size : 1);
  CHECK(copy);
  if (size) memcpy(copy, data, size);
  return copy;
}

#endif
