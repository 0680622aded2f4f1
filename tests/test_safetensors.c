/* safetensors reader and writer (src/io/safetensors.c).
 *
 * Oracles: the bytes written must equal the reference implementation's published test
 * vectors; every dtype round-trips bit-exactly through write + read (buffered, mmap and
 * in-memory parse); an independent Python implementation (tools/torch/safetensors.py, written from
 * the format description) reads what libddp writes and writes what libddp reads; and each
 * kind of hostile file is rejected with DDP_ERR_INVALID_DATA and a message naming the
 * problem. Allocations go through CMocka's allocator, so a leak fails the test. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/io.h"
#include "harness.h"

#define PYTHON "/usr/bin/python3"

extern char **environ;

/* ------------------------------------------------------------------ fixtures -------- */

typedef struct fixture {
  char dir[64];
} fixture_t;

/* Log lines are captured (not printed): an error must be logged exactly once, where it
 * starts, and the line must carry the message. */
typedef struct log_capture {
  int lines;
  char last[1024];
} log_capture_t;

static log_capture_t captured;

static void capture_sink(void *user, ddp_log_level_t level, const char *line) {
  log_capture_t *c = user;
  (void)level;
  c->lines++;
  snprintf(c->last, sizeof c->last, "%s", line);
}

static int setup(void **state) {
  fixture_t *fx = calloc(1, sizeof *fx);
  if (!fx) return -1;
  snprintf(fx->dir, sizeof fx->dir, "/tmp/ddp-st-XXXXXX");
  if (!mkdtemp(fx->dir)) return -1;
  *state = fx;
  memset(&captured, 0, sizeof captured);
  ddp_set_log_sink(capture_sink, &captured);
  ddp_test_use_cmocka_allocator();
  return 0;
}

static int teardown(void **state) {
  ddp_test_use_default_allocator();
  ddp_set_log_sink(NULL, NULL);
  fixture_t *fx = *state;
  DIR *d = opendir(fx->dir);
  if (d) {
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      snprintf(p, sizeof p, "%s/%s", fx->dir, e->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(fx->dir);
  free(fx);
  return 0;
}

static void path_in(const fixture_t *fx, const char *name, char *out, size_t cap) {
  snprintf(out, cap, "%s/%s", fx->dir, name);
}

static unsigned char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)n + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
  b[n] = 0;
  fclose(f);
  *len = (size_t)n;
  return b;
}

static void write_file(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, n, f), n);
  fclose(f);
}

static size_t dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
  }
  closedir(d);
  return n;
}

/* Runs /usr/bin/python3 tools/torch/safetensors.py args... (NULL-terminated, at most 254) with
 * stdout to out_path (or /dev/null); returns the exit code. */
static int run_tool(const char *const *args, const char *out_path) {
  char script[1024];
  const char *root = ddp_test_source_root();
  assert_non_null(root);
  snprintf(script, sizeof script, "%s/tools/torch/safetensors.py", root);
  char *argv[256] = {(char *)PYTHON, script};
  size_t n = 2;
  for (; args[n - 2]; n++) {
    assert_true(n < 255);
    argv[n] = (char *)args[n - 2];
  }
  argv[n] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path ? out_path : "/dev/null",
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid;
  int rc = posix_spawn(&pid, PYTHON, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  assert_int_equal(rc, 0);
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int run_tool2(const char *a1, const char *a2, const char *out_path) {
  const char *args[] = {a1, a2, NULL};
  return run_tool(args, out_path);
}

static bool have_python(void) { return access(PYTHON, X_OK) == 0; }

/* ------------------------------------------------------------------ test tensors ---- */

typedef struct spec {
  const char *name;
  ddp_dtype_t dtype;
  int ndim;
  int64_t shape[4];
} spec_t;

/* Every dtype, a scalar and an empty tensor. The byte-sized ones come first, so most of the
 * others start misaligned in the data block (the reader's realignment path). */
static const spec_t mixed[] = {
    {"u8", DDP_U8, 1, {3}},
    {"layer.0.weight", DDP_F32, 2, {4, 5}},
    {"mask", DDP_BOOL, 2, {2, 3}},
    {"f64", DDP_F64, 1, {7}},
    {"half", DDP_F16, 3, {2, 1, 3}},
    {"brain", DDP_BF16, 1, {9}},
    {"i32", DDP_I32, 2, {3, 3}},
    {"i64", DDP_I64, 1, {5}},
    {"scalar", DDP_F32, 0, {0}},
    {"empty", DDP_F64, 2, {0, 4}},
    {"caf\xc3\xa9.\xe2\x9c\x93", DDP_F32, 1, {2}},
};

enum { N_MIXED = sizeof mixed / sizeof mixed[0] };

/* Random values of each dtype, with the special floats (infinities, NaN, signed zero,
 * subnormals, extremes) at the front. */
static void fill(ddp_tensor_t *t, uint64_t seed) {
  ddp_rng_t r;
  ddp_rng_init(&r, seed, ddp_rng_stream(DDP_RNG_TEST, 0, 0));
  static const float fspecial[] = {INFINITY, -INFINITY, NAN, -0.0f, 1e-40f, 3.4028235e38f};
  static const uint16_t hspecial[] = {0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0001, 0x7BFF};
  static const uint16_t bspecial[] = {0x7F80, 0xFF80, 0x7FC0, 0x8000, 0x0001, 0x7F7F};
  for (int64_t i = 0; i < t->numel; i++) {
    float x = ddp_rng_normal(&r) * 10.0f;
    uint64_t u = ((uint64_t)ddp_rng_u32(&r) << 32) | ddp_rng_u32(&r);
    switch (t->dtype) {
      case DDP_F32: ((float *)t->data)[i] = i < 6 ? fspecial[i] : x; break;
      case DDP_F64: ((double *)t->data)[i] = i < 6 ? (double)fspecial[i] : (double)x / 3.0; break;
      case DDP_F16: ((uint16_t *)t->data)[i] = i < 6 ? hspecial[i] : ddp_f32_to_f16(x); break;
      case DDP_BF16: ((uint16_t *)t->data)[i] = i < 6 ? bspecial[i] : ddp_f32_to_bf16(x); break;
      case DDP_I32: ((int32_t *)t->data)[i] = (int32_t)(uint32_t)u; break;
      case DDP_I64: ((int64_t *)t->data)[i] = (int64_t)u; break;
      case DDP_U8: ((uint8_t *)t->data)[i] = (uint8_t)u; break;
      case DDP_BOOL: ((uint8_t *)t->data)[i] = (uint8_t)(u & 1); break;
      default: fail();
    }
  }
}

static void make_tensors(const spec_t *s, size_t n, ddp_tensor_t *t, ddp_st_entry_t *e) {
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(ddp_tensor_alloc(&t[i], s[i].dtype, s[i].ndim, s[i].shape), DDP_OK);
    fill(&t[i], 1000 + i);
    e[i].name = s[i].name;
    e[i].tensor = &t[i];
  }
}

static void free_tensors(ddp_tensor_t *t, size_t n) {
  for (size_t i = 0; i < n; i++) ddp_tensor_free(&t[i]);
}

static const char *const meta_k[] = {"format", "step", "note"};
static const char *const meta_v[] = {"pt", "42", "h\xc3\xa9llo \xe2\x9c\x93"};

/* The mixed tensors, the file they were written to, and that file's bytes. */
typedef struct mixed_file {
  ddp_tensor_t t[N_MIXED];
  ddp_st_entry_t e[N_MIXED];
  char path[256];
  unsigned char *bytes;
  size_t len;
} mixed_file_t;

/* Makes the mixed tensors, writes them with the metadata above to name in the fixture
 * directory, and reads the file's bytes back. */
static void write_mixed(const fixture_t *fx, const char *name, mixed_file_t *w) {
  make_tensors(mixed, N_MIXED, w->t, w->e);
  path_in(fx, name, w->path, sizeof w->path);
  assert_int_equal(ddp_st_write(w->path, w->e, N_MIXED, meta_k, meta_v, 3, NULL), DDP_OK);
  w->bytes = read_file(w->path, &w->len);
}

/* Frees what write_mixed made. */
static void free_mixed(mixed_file_t *w) {
  free(w->bytes);
  free_tensors(w->t, N_MIXED);
}

/* f holds exactly the entries, in order, with bit-identical data, aligned views, and the
 * metadata above. */
static void expect_contents(const ddp_st_file_t *f, const ddp_st_entry_t *e, size_t n,
                            bool with_meta) {
  assert_int_equal(ddp_st_count(f), n);
  for (size_t i = 0; i < n; i++) {
    const ddp_tensor_t *want = e[i].tensor;
    assert_string_equal(ddp_st_name(f, i), e[i].name);
    ddp_tensor_t v;
    assert_int_equal(ddp_st_tensor(f, i, &v), DDP_OK);
    assert_int_equal(v.dtype, want->dtype);
    assert_int_equal(v.ndim, want->ndim);
    for (int d = 0; d < v.ndim; d++) assert_int_equal(v.shape[d], want->shape[d]);
    assert_int_equal(v.numel, want->numel);
    assert_false(v.owns);
    size_t nb = ddp_tensor_nbytes(want);
    if (nb) {
      assert_int_equal((uintptr_t)v.data % ddp_dtype_size(v.dtype), 0);
      assert_memory_equal(v.data, want->data, nb);
    }
    size_t idx = SIZE_MAX;
    assert_int_equal(ddp_st_find(f, e[i].name, &idx), DDP_OK);
    assert_int_equal(idx, i);
  }
  size_t idx;
  assert_int_equal(ddp_st_find(f, "no.such.tensor", &idx), DDP_ERR_NOT_FOUND);
  if (!with_meta) {
    assert_int_equal(ddp_st_meta_count(f), 0);
    return;
  }
  assert_int_equal(ddp_st_meta_count(f), 3);
  for (size_t i = 0; i < 3; i++) {
    assert_string_equal(ddp_st_meta_key(f, i), meta_k[i]);
    assert_string_equal(ddp_st_meta_value(f, i), meta_v[i]);
  }
  assert_string_equal(ddp_st_meta_get(f, "step"), "42");
  assert_null(ddp_st_meta_get(f, "absent"));
}

/* ------------------------------------------------------------------ round trips ----- */

/* Every dtype round-trips bit-exactly through write and the three read paths; names,
 * shapes, order and metadata survive; views are aligned even where offsets are not. */
static void test_roundtrip_all_dtypes(void **state) {
  fixture_t *fx = *state;
  mixed_file_t w;
  write_mixed(fx, "m.safetensors", &w);
  assert_int_equal(dir_entries(fx->dir), 1); /* no temporary file left behind */
  struct stat sb;
  assert_int_equal(stat(w.path, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0644);

  ddp_error_t err = {0};
  for (int mode = 0; mode < 3; mode++) {
    ddp_st_file_t *f = NULL;
    if (mode < 2) {
      assert_int_equal(ddp_st_open(w.path, mode == 0 ? DDP_ST_READ : DDP_ST_MMAP, &f, &err),
                       DDP_OK);
    } else {
      assert_int_equal(ddp_st_parse(w.bytes, w.len, &f, &err), DDP_OK);
    }
    expect_contents(f, w.e, N_MIXED, true);
    ddp_st_close(f);
  }
  free_mixed(&w);
}

/* The file's layout: header length a multiple of 8, space padding, JSON keys in the given
 * order after __metadata__, data offsets ascending in the same order, data block = the
 * tensors' bytes back to back. Checked by reading the bytes directly, not through libddp. */
static void test_write_layout(void **state) {
  mixed_file_t w;
  write_mixed(*state, "layout.safetensors", &w);
  const unsigned char *b = w.bytes;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
  assert_int_equal(hlen % 8, 0);
  assert_true(8 + hlen <= w.len);
  size_t jlen = (size_t)hlen;
  while (jlen > 0 && b[8 + jlen - 1] == ' ') jlen--;
  assert_true(hlen - jlen < 8);
  assert_int_equal(b[8 + jlen - 1], '}');

  cJSON *root = cJSON_ParseWithLength((const char *)b + 8, jlen);
  assert_non_null(root);
  const cJSON *c = root->child;
  assert_string_equal(c->string, "__metadata__");
  size_t off = 0, k = 0;
  for (c = c->next; c; c = c->next, k++) {
    assert_true(k < N_MIXED);
    assert_string_equal(c->string, w.e[k].name);
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(c, "data_offsets");
    size_t nb = ddp_tensor_nbytes(&w.t[k]);
    assert_int_equal((size_t)cJSON_GetArrayItem(o, 0)->valuedouble, off);
    assert_int_equal((size_t)cJSON_GetArrayItem(o, 1)->valuedouble, off + nb);
    if (nb) assert_memory_equal(b + 8 + hlen + off, w.t[k].data, nb);
    off += nb;
  }
  assert_int_equal(k, N_MIXED);
  assert_int_equal(8 + hlen + off, w.len);
  cJSON_Delete(root);
  free_mixed(&w);
}

static void expect_file_bytes(const char *path, const char *json, size_t pad, const void *data,
                              size_t dlen) {
  size_t len;
  unsigned char *b = read_file(path, &len);
  size_t jlen = strlen(json);
  assert_int_equal(len, 8 + jlen + pad + dlen);
  unsigned char le[8] = {0};
  for (int i = 0; i < 8; i++) le[i] = (unsigned char)((jlen + pad) >> (8 * i));
  assert_memory_equal(b, le, 8);
  assert_memory_equal(b + 8, json, jlen);
  for (size_t i = 0; i < pad; i++) assert_int_equal(b[8 + jlen + i], ' ');
  if (dlen) assert_memory_equal(b + 8 + jlen + pad, data, dlen);
  free(b);
}

/* Byte-exact agreement with the reference implementation's published serialization tests
 * (huggingface/safetensors, tensor.rs: test_serialization, test_serialization_forced_
 * alignement, test_empty). */
static void test_reference_vectors(void **state) {
  fixture_t *fx = *state;
  char path[256];
  path_in(fx, "ref.safetensors", path, sizeof path);
  float vals[6] = {0, 1, 2, 3, 4, 5};
  ddp_tensor_t t;
  int64_t s3[3] = {1, 2, 3}, s4[4] = {1, 1, 2, 3};

  assert_int_equal(ddp_tensor_view(&t, DDP_F32, 3, s3, vals), DDP_OK);
  ddp_st_entry_t e = {"attn.0", &t};
  assert_int_equal(ddp_st_write(path, &e, 1, NULL, NULL, 0, NULL), DDP_OK);
  expect_file_bytes(path,
                    "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}", 0,
                    vals, sizeof vals);

  assert_int_equal(ddp_tensor_view(&t, DDP_F32, 4, s4, vals), DDP_OK);
  e.name = "attn0";
  assert_int_equal(ddp_st_write(path, &e, 1, NULL, NULL, 0, NULL), DDP_OK);
  expect_file_bytes(path,
                    "{\"attn0\":{\"dtype\":\"F32\",\"shape\":[1,1,2,3],\"data_offsets\":[0,24]}}",
                    7, vals, sizeof vals);

  assert_int_equal(ddp_st_write(path, NULL, 0, NULL, NULL, 0, NULL), DDP_OK);
  expect_file_bytes(path, "{}", 6, NULL, 0);
  const char *k = "framework", *v = "pt";
  assert_int_equal(ddp_st_write(path, NULL, 0, &k, &v, 1, NULL), DDP_OK);
  expect_file_bytes(path, "{\"__metadata__\":{\"framework\":\"pt\"}}", 5, NULL, 0);

  ddp_st_file_t *f;
  assert_int_equal(ddp_st_open(path, DDP_ST_MMAP, &f, NULL), DDP_OK);
  assert_int_equal(ddp_st_count(f), 0);
  assert_string_equal(ddp_st_meta_get(f, "framework"), "pt");
  ddp_st_close(f);
}

/* Tensors ordered by descending element size are all aligned in place, so mmap views are
 * zero-copy: consecutive views are adjacent in the one mapping. */
static void test_mmap_zero_copy(void **state) {
  fixture_t *fx = *state;
  static const spec_t sorted[] = {
      {"a", DDP_F64, 1, {3}}, {"b", DDP_I64, 1, {2}},  {"c", DDP_F32, 2, {3, 3}},
      {"d", DDP_I32, 1, {1}}, {"e", DDP_BF16, 1, {3}}, {"f", DDP_F16, 1, {5}},
      {"g", DDP_U8, 1, {7}},  {"h", DDP_BOOL, 1, {2}},
  };
  enum { N = sizeof sorted / sizeof sorted[0] };
  ddp_tensor_t t[N];
  ddp_st_entry_t e[N];
  make_tensors(sorted, N, t, e);
  char path[256];
  path_in(fx, "z.safetensors", path, sizeof path);
  assert_int_equal(ddp_st_write(path, e, N, NULL, NULL, 0, NULL), DDP_OK);
  ddp_st_file_t *f;
  assert_int_equal(ddp_st_open(path, DDP_ST_MMAP, &f, NULL), DDP_OK);
  expect_contents(f, e, N, false);
  for (size_t i = 1; i < N; i++) {
    ddp_tensor_t a, b;
    ddp_st_tensor(f, i - 1, &a);
    ddp_st_tensor(f, i, &b);
    assert_ptr_equal((unsigned char *)a.data + ddp_tensor_nbytes(&a), b.data);
  }
  ddp_st_close(f);
  free_tensors(t, N);
}

/* Writer argument errors are DDP_ERR_INVALID_ARGUMENT or DDP_ERR_SYSTEM naming the cause, and
 * a failed write leaves the previous file untouched and no temporary file behind. */
static void test_write_errors(void **state) {
  fixture_t *fx = *state;
  char path[256];
  path_in(fx, "w.safetensors", path, sizeof path);
  float x[2] = {1, 2};
  int64_t s[1] = {2};
  ddp_tensor_t t;
  assert_int_equal(ddp_tensor_view(&t, DDP_F32, 1, s, x), DDP_OK);
  ddp_st_entry_t one = {"x", &t};
  assert_int_equal(ddp_st_write(path, &one, 1, NULL, NULL, 0, NULL), DDP_OK);
  size_t len0;
  unsigned char *before = read_file(path, &len0);

  ddp_error_t err;
  ddp_st_entry_t dup[2] = {{"x", &t}, {"x", &t}};
  assert_int_equal(ddp_st_write(path, dup, 2, NULL, NULL, 0, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "duplicate tensor name 'x'"));
  ddp_st_entry_t bad[3] = {{"", &t}, {"__metadata__", &t}, {"\xff", &t}};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ddp_st_write(path, &bad[i], 1, NULL, NULL, 0, &err), DDP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(err.msg, "name"));
  }
  const char *mk[2] = {"k", "k"}, *mv[2] = {"1", "2"};
  assert_int_equal(ddp_st_write(path, &one, 1, mk, mv, 2, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "duplicate metadata key 'k'"));
  ddp_tensor_t broken = t;
  broken.numel = 3;
  ddp_st_entry_t be = {"x", &broken};
  assert_int_equal(ddp_st_write(path, &be, 1, NULL, NULL, 0, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "tensor 'x' is invalid"));

  char nodir[300];
  snprintf(nodir, sizeof nodir, "%s/missing/w.safetensors", fx->dir);
  assert_int_equal(ddp_st_write(nodir, &one, 1, NULL, NULL, 0, &err), DDP_ERR_SYSTEM);
  assert_non_null(strstr(err.msg, "mkostemp"));
  assert_non_null(strstr(err.msg, "errno"));

  size_t len1;
  unsigned char *after = read_file(path, &len1);
  assert_int_equal(len0, len1);
  assert_memory_equal(before, after, len0);
  assert_int_equal(dir_entries(fx->dir), 1);
  free(before);
  free(after);
}

/* ------------------------------------------------------------------ hand-made files - */

/* An image: 8-byte length (of json, or hlen when hlen >= 0), the json text, dlen data bytes
 * (i & 0xff). */
static unsigned char *image(const char *json, int64_t hlen, size_t dlen, size_t *len) {
  size_t j = strlen(json);
  *len = 8 + j + dlen;
  unsigned char *b = malloc(*len ? *len : 1);
  assert_non_null(b);
  uint64_t h = hlen >= 0 ? (uint64_t)hlen : j;
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(h >> (8 * i));
  memcpy(b + 8, json, j);
  for (size_t i = 0; i < dlen; i++) b[8 + j + i] = (unsigned char)i;
  return b;
}

/* Valid but unusual files: JSON order differs from data order; zero-byte tensors share
 * offsets (kept in JSON order); unknown fields are ignored; the header is padded with
 * whitespace and has an odd length, so the data block itself is misaligned. */
static void test_parse_unusual_valid(void **state) {
  fixture_t *fx = *state;
  const char *json =
      "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12],\"extra\":[1]},"
      "\"z2\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[4,4]},"
      "\"a\":{\"shape\":[],\"data_offsets\":[0,4],\"dtype\":\"I32\"},"
      "\"z1\":{\"dtype\":\"F64\",\"shape\":[3,0],\"data_offsets\":[4,4]},"
      "\"c\":{\"dtype\":\"F64\",\"shape\":[1,1],\"data_offsets\":[12,20]}}  \n\t ";
  size_t len;
  unsigned char *b = image(json, -1, 20, &len);
  char path[256];
  path_in(fx, "u.safetensors", path, sizeof path);
  write_file(path, b, len);
  for (int mode = 0; mode < 3; mode++) {
    ddp_st_file_t *f;
    ddp_error_t err;
    if (mode < 2) {
      assert_int_equal(ddp_st_open(path, mode, &f, &err), DDP_OK);
    } else {
      assert_int_equal(ddp_st_parse(b, len, &f, &err), DDP_OK);
    }
    const char *order[] = {"a", "z2", "z1", "b", "c"};
    assert_int_equal(ddp_st_count(f), 5);
    for (size_t i = 0; i < 5; i++) {
      assert_string_equal(ddp_st_name(f, i), order[i]);
      ddp_tensor_t v;
      ddp_st_tensor(f, i, &v);
      uint64_t lo, hi;
      ddp_st_offsets(f, i, &lo, &hi);
      if (lo != hi) {
        assert_int_equal((uintptr_t)v.data % ddp_dtype_size(v.dtype), 0);
        assert_memory_equal(v.data, b + 8 + strlen(json) + lo, hi - lo);
      }
    }
    ddp_tensor_t a;
    ddp_st_tensor(f, 0, &a);
    assert_int_equal(a.ndim, 0);
    assert_int_equal(a.numel, 1);
    ddp_st_close(f);
  }
  free(b);
}

typedef struct bad_case {
  const char *json;
  int64_t hlen; /* -1: strlen(json) */
  size_t dlen;
  ddp_status_t want;
  const char *msg; /* substring the message must contain */
} bad_case_t;

#define T(dt, shape, b, e) \
  "{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" b "," e "]}"

static const bad_case_t bad_cases[] = {
    /* header length */
    {"{}", 1ll << 62, 0, DDP_ERR_INVALID_DATA, "exceeds the limit"},
    {"{}", 100000001, 0, DDP_ERR_INVALID_DATA, "exceeds the limit"},
    {"{}", 4096, 0, DDP_ERR_INVALID_DATA, "runs past the end of the file"},
    {"{\"a\":" T("F32", "[1]", "0", "4") "}", 1000, 4, DDP_ERR_INVALID_DATA,
     "header length 1000 runs past the end"},
    {"", -1, 0, DDP_ERR_INVALID_DATA, "does not start with '{'"},
    {"[]", -1, 0, DDP_ERR_INVALID_DATA, "does not start with '{'"},
    /* bytes and JSON */
    {"{\"\xff\":1}", -1, 0, DDP_ERR_INVALID_DATA, "not valid UTF-8 (file offset 10)"},
    {"{\"\xed\xa0\x80\":1}", -1, 0, DDP_ERR_INVALID_DATA, "not valid UTF-8"},
    {"{\"\xe2\x9c", -1, 0, DDP_ERR_INVALID_DATA, "not valid UTF-8 (file offset 10)"},
    {"{\"\xc0\xaf\":1}", -1, 0, DDP_ERR_INVALID_DATA, "not valid UTF-8 (file offset 10)"},
    {"{\"a\x01\":1}", -1, 0, DDP_ERR_INVALID_DATA, "control byte 0x01 at file offset 11"},
    {"{\"a\":", -1, 0, DDP_ERR_INVALID_DATA, "not valid JSON"},
    {"{\"a\":1,}", -1, 0, DDP_ERR_INVALID_DATA, "not valid JSON"},
    {"{} x", -1, 0, DDP_ERR_INVALID_DATA,
     "unexpected bytes after the JSON header (file offset 11)"},
    {"{}{}", -1, 0, DDP_ERR_INVALID_DATA, "unexpected bytes after the JSON header"},
    /* entries */
    {"{\"a\":[1,2]}", -1, 0, DDP_ERR_INVALID_DATA, "tensor 'a' is not a JSON object"},
    {"{\"a\":\"F32\"}", -1, 0, DDP_ERR_INVALID_DATA, "tensor 'a' is not a JSON object"},
    {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a' has no \"dtype\" field"},
    {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a' has no \"shape\" field"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a' has no \"data_offsets\" field"},
    {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", -1, 4,
     DDP_ERR_INVALID_DATA, "tensor 'a' has field \"dtype\" twice"},
    {"{\"a\":" T("F33", "[1]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a': unknown dtype \"F33\""},
    {"{\"a\":" T("f32", "[1]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA, "unknown dtype"},
    {"{\"a\":" T("I8", "[4]", "0", "4") "}", -1, 4, DDP_ERR_UNSUPPORTED,
     "dtype I8 is not supported"},
    {"{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a': \"dtype\" is not a string"},
    {"{\"a\":" T("F32", "4", "0", "16") "}", -1, 16, DDP_ERR_INVALID_DATA,
     "\"shape\" is not a list"},
    {"{\"a\":" T("F32", "[-1]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a': shape[0] is not a non-negative integer"},
    {"{\"a\":" T("F32", "[1,1.5]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "shape[1] is not a non-negative integer"},
    {"{\"a\":" T("F32", "[\"2\"]", "0", "8") "}", -1, 8, DDP_ERR_INVALID_DATA,
     "shape[0] is not a non-negative integer"},
    {"{\"a\":" T("F32", "[true]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "shape[0] is not a non-negative integer"},
    {"{\"a\":" T("F32", "[null]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "shape[0] is not a non-negative integer"},
    {"{\"a\":" T("F32", "[1e300]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "shape[0] is not a non-negative integer"},
    {"{\"a\":" T("U8", "[1,1,1,1,1,1,1,1,1]", "0", "1") "}", -1, 1, DDP_ERR_UNSUPPORTED,
     "shape has 9 dimensions, more than 8"},
    {"{\"a\":" T("F32", "[4294967296,4294967296]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "element count of the shape overflows"},
    {"{\"a\":" T("F64", "[1125899906842624,1024]", "0", "8") "}", -1, 8, DDP_ERR_INVALID_DATA,
     "overflows"},
    {"{\"a\":" T("F32", "[2]", "0", "4") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "tensor 'a': data_offsets [0, 4] span 4 bytes but F32 with 2 elements needs 8"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", -1, 4, DDP_ERR_INVALID_DATA,
     "\"data_offsets\" is not a list of two integers"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", -1, 4,
     DDP_ERR_INVALID_DATA, "\"data_offsets\" is not a list of two integers"},
    {"{\"a\":" T("F32", "[1]", "-4", "0") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "data_offsets are not non-negative integers"},
    {"{\"a\":" T("F32", "[1]", "0", "9007199254740994") "}", -1, 4, DDP_ERR_INVALID_DATA,
     "data_offsets are not non-negative integers"},
    {"{\"a\":" T("F32", "[0]", "8", "4") "}", -1, 8, DDP_ERR_INVALID_DATA,
     "tensor 'a': data_offsets [8, 4] have begin > end"},
    /* out of range / truncated data */
    {"{\"a\":" T("F32", "[4]", "0", "16") "}", -1, 8, DDP_ERR_INVALID_DATA,
     "tensor 'a': data_offsets [0, 16] run past the end of the data block (8 bytes; file "
     "truncated?)"},
    {"{\"a\":" T("F32", "[1]", "18446744073709551612", "18446744073709551616") "}", -1, 4,
     DDP_ERR_INVALID_DATA, "not non-negative integers"},
    /* coverage */
    {"{\"a\":" T("F32", "[2]", "0", "8") ",\"b\":" T("F32", "[2]", "4", "12") "}", -1, 12,
     DDP_ERR_INVALID_DATA, "tensors 'a' [0, 8] and 'b' [4, 12] overlap"},
    {"{\"b\":" T("F32", "[2]", "0", "8") ",\"a\":" T("F32", "[2]", "0", "8") "}", -1, 8,
     DDP_ERR_INVALID_DATA, "overlap"},
    {"{\"a\":" T("F32", "[1]", "0", "4") ",\"b\":" T("F32", "[1]", "8", "12") "}", -1, 12,
     DDP_ERR_INVALID_DATA,
     "hole of 4 bytes in the data block between 'a' (ends at 4) and 'b' (begins at 8)"},
    {"{\"a\":" T("F32", "[1]", "4", "8") "}", -1, 8, DDP_ERR_INVALID_DATA,
     "hole of 4 bytes at the start of the data block, before 'a' [4, 8]"},
    {"{\"a\":" T("F32", "[1]", "0", "4") "}", -1, 9, DDP_ERR_INVALID_DATA,
     "the data block has 9 bytes but the tensors cover only [0, 4): 5 trailing bytes"},
    {"{}", -1, 3, DDP_ERR_INVALID_DATA, "3 trailing bytes"},
    /* names and metadata */
    {"{\"a\":" T("F32", "[1]", "0", "4") ",\"a\":" T("F32", "[1]", "4", "8") "}", -1, 8,
     DDP_ERR_INVALID_DATA, "duplicate name 'a' in the header"},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", -1, 0, DDP_ERR_INVALID_DATA,
     "duplicate name '__metadata__'"},
    {"{\"__metadata__\":[\"a\"]}", -1, 0, DDP_ERR_INVALID_DATA,
     "\"__metadata__\" is not a JSON object"},
    {"{\"__metadata__\":{\"k\":1}}", -1, 0, DDP_ERR_INVALID_DATA,
     "__metadata__ value of key 'k' is not a string"},
    {"{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", -1, 0, DDP_ERR_INVALID_DATA,
     "value of key 'k' is not a string"},
    {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", -1, 0, DDP_ERR_INVALID_DATA,
     "__metadata__ has duplicate key 'k'"},
};

/* A raw image of n bytes. */
static void expect_bad(const fixture_t *fx, const unsigned char *b, size_t len, ddp_status_t want,
                       const char *msg, const char *label) {
  ddp_error_t err = {0};
  ddp_st_file_t *f = (ddp_st_file_t *)&err; /* must come back NULL */
  int lines = captured.lines;
  ddp_status_t st = ddp_st_parse(b, len, &f, &err);
  if (st != want || !strstr(err.msg, msg) || captured.lines != lines + 1 ||
      !strstr(captured.last, err.msg)) {
    print_error("case %s: parse gave %s \"%s\", want %s \"%s\"\n", label, ddp_status_name(st),
                err.msg, ddp_status_name(want), msg);
    fail();
  }
  assert_null(f);
  char path[256];
  path_in(fx, "bad.safetensors", path, sizeof path);
  write_file(path, b, len);
  for (int mode = 0; mode < 2; mode++) {
    err.msg[0] = 0;
    st = ddp_st_open(path, mode, &f, &err);
    if (st != want || !strstr(err.msg, msg) || !strstr(err.msg, path)) {
      print_error("case %s: open(mode %d) gave %s \"%s\", want %s \"%s\"\n", label, mode,
                  ddp_status_name(st), err.msg, ddp_status_name(want), msg);
      fail();
    }
    assert_null(f);
  }
  unlink(path);
}

enum { N_BAD = sizeof bad_cases / sizeof bad_cases[0] };

/* Every hostile case is rejected by all three read paths with the right status and a
 * message naming the problem. The independent Python reader rejects every case that is
 * corrupt (not the UNSUPPORTED ones: it knows more dtypes and any rank). */
static void test_corrupt_files(void **state) {
  fixture_t *fx = *state;
  static char paths[N_BAD][128];
  const char *args[N_BAD + 2] = {"check"};
  size_t nargs = 1;
  for (size_t i = 0; i < N_BAD; i++) {
    const bad_case_t *c = &bad_cases[i];
    size_t len;
    unsigned char *b = image(c->json, c->hlen, c->dlen, &len);
    char label[16];
    snprintf(label, sizeof label, "#%zu", i);
    expect_bad(fx, b, len, c->want, c->msg, label);
    if (c->want == DDP_ERR_INVALID_DATA) {
      snprintf(paths[i], sizeof paths[i], "%s/bad-%02zu.safetensors", fx->dir, i);
      write_file(paths[i], b, len);
      args[nargs++] = paths[i];
    }
    free(b);
  }
  if (have_python()) {
    char out[256];
    path_in(fx, "check.txt", out, sizeof out);
    assert_int_equal(run_tool(args, out), 0);
    size_t len;
    char *text = (char *)read_file(out, &len);
    char *save = NULL;
    size_t k = 1;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save), k++) {
      if (strncmp(line, "invalid: ", 9) != 0) {
        fail_msg("Python accepted %s: %s", args[k], line);
      }
    }
    assert_int_equal(k, nargs);
    free(text);
  }
  /* Shorter than the length field, including empty. */
  static const unsigned char tiny[7] = {1, 2, 3, 4, 5, 6, 7};
  for (size_t n = 0; n < sizeof tiny; n++) {
    expect_bad(fx, tiny, n, DDP_ERR_INVALID_DATA, "shorter than the 8-byte header length", "tiny");
  }
  /* Nesting far deeper than cJSON's limit is an error, not a stack overflow. */
  char deep[6000];
  size_t k = (size_t)snprintf(deep, sizeof deep, "{\"a\":");
  while (k < sizeof deep - 2) deep[k++] = '[';
  deep[k] = 0;
  size_t len;
  unsigned char *b = image(deep, -1, 0, &len);
  expect_bad(fx, b, len, DDP_ERR_INVALID_DATA, "not valid JSON", "deep");
  free(b);
}

/* Every proper prefix of a valid file is rejected as invalid data (never accepted, never
 * read past its end), and so is the file with one byte appended. */
static void test_truncations(void **state) {
  mixed_file_t w;
  write_mixed(*state, "t.safetensors", &w);
  const unsigned char *b = w.bytes;
  size_t len = w.len;
  /* libc's allocator here: CMocka's guard bytes would hide an over-read from ASan. */
  ddp_test_use_default_allocator();
  int64_t live = ddp_test_live_allocs();
  for (size_t n = 0; n < len; n++) {
    ddp_st_file_t *f = NULL;
    ddp_error_t err;
    /* A private copy of exactly n bytes, so ASan sees any read past it. */
    unsigned char *p = malloc(n ? n : 1);
    memcpy(p, b, n);
    assert_int_equal(ddp_st_parse(p, n, &f, &err), DDP_ERR_INVALID_DATA);
    assert_null(f);
    free(p);
  }
  unsigned char *longer = malloc(len + 1);
  memcpy(longer, b, len);
  longer[len] = 0;
  ddp_st_file_t *f = NULL;
  ddp_error_t err;
  assert_int_equal(ddp_st_parse(longer, len + 1, &f, &err), DDP_ERR_INVALID_DATA);
  assert_non_null(strstr(err.msg, "1 trailing bytes"));
  assert_int_equal(ddp_test_live_allocs(), live);
  ddp_test_use_cmocka_allocator();
  free(longer);
  free_mixed(&w);
}

/* Opening a missing file or a directory fails with the right status, naming the path. */
static void test_open_errors(void **state) {
  fixture_t *fx = *state;
  char path[256];
  path_in(fx, "absent.safetensors", path, sizeof path);
  ddp_st_file_t *f;
  ddp_error_t err;
  assert_int_equal(ddp_st_open(path, DDP_ST_READ, &f, &err), DDP_ERR_NOT_FOUND);
  assert_null(f);
  assert_non_null(strstr(err.msg, path));
  assert_non_null(strstr(err.msg, "errno 2"));
  assert_int_equal(ddp_st_open(fx->dir, DDP_ST_MMAP, &f, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "not a regular file"));
}

/* ------------------------------------------------------------------ Python ---------- */

/* Element i of the sample file's tensors, computed here independently from the formulas in
 * tools/torch/safetensors.py's sample_tensors() docstring. */
static void expect_sample_values(const char *name, const ddp_tensor_t *v) {
  for (int64_t i = 0; i < v->numel; i++) {
    switch (v->dtype) {
      case DDP_U8: assert_int_equal(((uint8_t *)v->data)[i], (i * 37 + 11) % 256); break;
      case DDP_F32: {
        float want = (float)((double)i * 0.1 - 1.0);
        float got = ((float *)v->data)[i];
        assert_memory_equal(&got, &want, 4);
        break;
      }
      case DDP_F64: {
        double want = (double)i * 0.1 - 1.0;
        assert_memory_equal(&((double *)v->data)[i], &want, 8);
        break;
      }
      case DDP_F16:
        DDP_ASSERT_EQ(ddp_f16_to_f32(((uint16_t *)v->data)[i]), (float)(i - 5) * 0.5f);
        break;
      case DDP_BF16:
        DDP_ASSERT_EQ(ddp_bf16_to_f32(((uint16_t *)v->data)[i]), (float)(i - 5) * 0.25f);
        break;
      case DDP_I32:
        assert_int_equal(((int32_t *)v->data)[i], (int32_t)(uint32_t)((uint64_t)i * 2654435761u));
        break;
      case DDP_I64:
        assert_int_equal(((int64_t *)v->data)[i], (int64_t)((uint64_t)i * 0x9E3779B97F4A7C15ull));
        break;
      case DDP_BOOL: assert_int_equal(((uint8_t *)v->data)[i], i % 3 == 0); break;
      default: fail_msg("unexpected dtype in %s", name);
    }
  }
}

/* A file written by the Python implementation loads in C with the right names, order,
 * dtypes, shapes, values and metadata, in both read modes. */
static void test_python_writes_c_reads(void **state) {
  fixture_t *fx = *state;
  if (!have_python()) skip();
  char path[256];
  path_in(fx, "py.safetensors", path, sizeof path);
  assert_int_equal(run_tool2("sample", path, NULL), 0);
  static const struct {
    const char *name;
    ddp_dtype_t dt;
    int ndim;
    int64_t shape[3];
  } want[] = {
      {"u8", DDP_U8, 1, {17}},        {"layer.0.weight", DDP_F32, 3, {2, 3, 4}},
      {"f64", DDP_F64, 1, {5}},       {"half", DDP_F16, 2, {3, 3}},
      {"brain", DDP_BF16, 2, {2, 5}}, {"i32", DDP_I32, 1, {7}},
      {"i64", DDP_I64, 2, {2, 2}},    {"mask", DDP_BOOL, 2, {3, 2}},
      {"scalar", DDP_F32, 0, {0}},    {"empty", DDP_I64, 2, {0, 3}},
  };
  for (int mode = 0; mode < 2; mode++) {
    ddp_st_file_t *f;
    ddp_error_t err;
    assert_int_equal(ddp_st_open(path, mode, &f, &err), DDP_OK);
    assert_int_equal(ddp_st_count(f), sizeof want / sizeof want[0]);
    for (size_t i = 0; i < ddp_st_count(f); i++) {
      assert_string_equal(ddp_st_name(f, i), want[i].name);
      ddp_tensor_t v;
      ddp_st_tensor(f, i, &v);
      assert_int_equal(v.dtype, want[i].dt);
      assert_int_equal(v.ndim, want[i].ndim);
      for (int d = 0; d < v.ndim; d++) assert_int_equal(v.shape[d], want[i].shape[d]);
      if (v.numel) assert_int_equal((uintptr_t)v.data % ddp_dtype_size(v.dtype), 0);
      expect_sample_values(want[i].name, &v);
    }
    assert_int_equal(ddp_st_meta_count(f), 3);
    assert_string_equal(ddp_st_meta_get(f, "format"), "pt");
    assert_string_equal(ddp_st_meta_get(f, "writer"), "tools/torch/safetensors.py");
    assert_string_equal(ddp_st_meta_get(f, "note"), "h\xc3\xa9llo \xe2\x9c\x93");
    ddp_st_close(f);
  }
}

static double c_value(const ddp_tensor_t *t, int64_t i) {
  switch (t->dtype) {
    case DDP_F32: return ((float *)t->data)[i];
    case DDP_F64: return ((double *)t->data)[i];
    case DDP_F16: return ddp_f16_to_f32(((uint16_t *)t->data)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((uint16_t *)t->data)[i]);
    default: fail(); return 0;
  }
}

static int64_t c_int(const ddp_tensor_t *t, int64_t i) {
  switch (t->dtype) {
    case DDP_I32: return ((int32_t *)t->data)[i];
    case DDP_I64: return ((int64_t *)t->data)[i];
    case DDP_U8:
    case DDP_BOOL: return ((uint8_t *)t->data)[i];
    default: fail(); return 0;
  }
}

/* A file libddp writes is read back by the Python implementation: it reports the same
 * names, order, dtypes, shapes, offsets, bytes and metadata, and its own decoding of each
 * element (F16 and BF16 included) equals libddp's. */
static void test_c_writes_python_reads(void **state) {
  fixture_t *fx = *state;
  if (!have_python()) skip();
  mixed_file_t w;
  write_mixed(fx, "c.safetensors", &w);
  const ddp_tensor_t *t = w.t;
  char out[256];
  path_in(fx, "c.json", out, sizeof out);
  assert_int_equal(run_tool2("dump", w.path, out), 0);
  size_t len;
  char *text = (char *)read_file(out, &len);
  cJSON *root = cJSON_Parse(text);
  assert_non_null(root);
  const cJSON *ts = cJSON_GetObjectItemCaseSensitive(root, "tensors");
  assert_int_equal(cJSON_GetArraySize(ts), N_MIXED);
  uint64_t off = 0;
  size_t k = 0;
  for (const cJSON *o = ts->child; o; o = o->next, k++) {
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(o, "name")->valuestring, w.e[k].name);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(o, "dtype")->valuestring,
                        ddp_dtype_name(t[k].dtype));
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(o, "shape");
    assert_int_equal(cJSON_GetArraySize(shape), t[k].ndim);
    for (int d = 0; d < t[k].ndim; d++) {
      assert_int_equal((int64_t)cJSON_GetArrayItem(shape, d)->valuedouble, t[k].shape[d]);
    }
    size_t nb = ddp_tensor_nbytes(&t[k]);
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(o, "data_offsets");
    assert_int_equal((uint64_t)cJSON_GetArrayItem(offs, 0)->valuedouble, off);
    assert_int_equal((uint64_t)cJSON_GetArrayItem(offs, 1)->valuedouble, off + nb);
    off += nb;
    const char *hex = cJSON_GetObjectItemCaseSensitive(o, "hex")->valuestring;
    assert_int_equal(strlen(hex), 2 * nb);
    for (size_t i = 0; i < nb; i++) {
      unsigned byte;
      assert_int_equal(sscanf(hex + 2 * i, "%2x", &byte), 1);
      assert_int_equal(byte, ((unsigned char *)t[k].data)[i]);
    }
    const cJSON *vals = cJSON_GetObjectItemCaseSensitive(o, "values");
    assert_int_equal(cJSON_GetArraySize(vals), t[k].numel);
    int64_t i = 0;
    bool is_float = t[k].dtype == DDP_F32 || t[k].dtype == DDP_F64 || t[k].dtype == DDP_F16 ||
                    t[k].dtype == DDP_BF16;
    for (const cJSON *v = vals->child; v; v = v->next, i++) {
      if (is_float) {
        double py = strtod(v->valuestring, NULL), c = c_value(&t[k], i);
        if (isnan(c)) {
          assert_true(isnan(py));
        } else {
          DDP_ASSERT_EQ(py, c);
          assert_int_equal(signbit(py) != 0, signbit(c) != 0);
        }
      } else {
        assert_int_equal(strtoll(v->valuestring, NULL, 10), c_int(&t[k], i));
      }
    }
  }
  const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
  k = 0;
  for (const cJSON *m = meta->child; m; m = m->next, k++) {
    assert_string_equal(m->string, meta_k[k]);
    assert_string_equal(m->valuestring, meta_v[k]);
  }
  assert_int_equal(k, 3);
  cJSON_Delete(root);
  free(text);
  free_mixed(&w);
}

/* The Python module's own checks (and its torch helpers where torch is importable). */
static void test_python_selftest(void **state) {
  (void)state;
  if (!have_python()) skip();
  assert_int_equal(run_tool2("selftest", NULL, NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_roundtrip_all_dtypes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_write_layout, setup, teardown),
      cmocka_unit_test_setup_teardown(test_reference_vectors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_mmap_zero_copy, setup, teardown),
      cmocka_unit_test_setup_teardown(test_write_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_parse_unusual_valid, setup, teardown),
      cmocka_unit_test_setup_teardown(test_corrupt_files, setup, teardown),
      cmocka_unit_test_setup_teardown(test_truncations, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_python_writes_c_reads, setup, teardown),
      cmocka_unit_test_setup_teardown(test_c_writes_python_reads, setup, teardown),
      cmocka_unit_test_setup_teardown(test_python_selftest, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
