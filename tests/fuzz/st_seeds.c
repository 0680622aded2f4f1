/* Writes the fuzz target's seed corpus: valid safetensors files from libddp's own writer,
 * covering every dtype, scalars, empty tensors, misaligned offsets, metadata, and the empty
 * file. Usage: fuzz_safetensors_seeds DIR (docs/fuzzing.md). */
#include <stdio.h>
#include <string.h>

#include "ddp/io.h"

static int write_seed(const char *dir, const char *name, const ddp_st_entry_t *e, size_t n,
                      size_t nmeta) {
  static const char *const mk[] = {"format", "note"};
  static const char *const mv[] = {"pt", "h\xc3\xa9llo"};
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  ddp_error_t err;
  if (ddp_st_write(path, e, n, mk, mv, nmeta, &err) != DDP_OK) {
    fprintf(stderr, "fuzz_safetensors_seeds: %s\n", err.msg);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];
  unsigned char bytes[256];
  for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)(i * 37 + 11);
  static const struct {
    const char *name;
    ddp_dtype_t dt;
    int ndim;
    int64_t shape[3];
  } specs[] = {
      {"u8", DDP_U8, 1, {3}},        {"w.0", DDP_F32, 2, {2, 3}},  {"mask", DDP_BOOL, 1, {5}},
      {"f64", DDP_F64, 1, {2}},      {"h", DDP_F16, 3, {1, 2, 2}}, {"bf", DDP_BF16, 1, {3}},
      {"i32", DDP_I32, 1, {2}},      {"i64", DDP_I64, 2, {1, 1}},  {"scalar", DDP_F32, 0, {0}},
      {"empty", DDP_I64, 2, {0, 3}},
  };
  enum { N = sizeof specs / sizeof specs[0] };
  ddp_tensor_t t[N];
  ddp_st_entry_t e[N];
  for (size_t i = 0; i < N; i++) {
    if (ddp_tensor_view(&t[i], specs[i].dt, specs[i].ndim, specs[i].shape, bytes) != DDP_OK) {
      return 1;
    }
    e[i].name = specs[i].name;
    e[i].tensor = &t[i];
  }
  int rc = 0;
  rc |= write_seed(dir, "all-dtypes.safetensors", e, N, 2);
  rc |= write_seed(dir, "all-dtypes-nometa.safetensors", e, N, 0);
  rc |= write_seed(dir, "one.safetensors", &e[1], 1, 0);
  rc |= write_seed(dir, "aligned.safetensors", &e[3], 5, 1);
  rc |= write_seed(dir, "empty.safetensors", NULL, 0, 0);
  rc |= write_seed(dir, "meta-only.safetensors", NULL, 0, 2);
  return rc;
}
