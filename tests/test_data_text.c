/* Text data: llm.c token files (written, read, and checked against numpy's view of the
 * format), token arrays in safetensors (I32, I64, U16, U8), raw text through the byte-level
 * tokenizer, causal-LM blocks and the DistributedSampler over them, the text classification
 * CSV with RFC 4180 quoting, the shipped corpus and CSV, and every error message: each
 * case asserts the status and the words of the message, including the file name. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ddp/data.h"
#include "ddp/io.h"
#include "harness.h"

/* ---------------------------------------------------------------- helpers --------- */

/* A scratch directory per test (mkdtemp), emptied and removed by tmp_done. */
typedef struct tmpdir {
  char dir[64];
} tmpdir_t;

static void tmp_init(tmpdir_t *t) {
  snprintf(t->dir, sizeof t->dir, "/tmp/ddp_text_XXXXXX");
  ddp_test_mkdtemp(t->dir); /* removed at exit, also on failure */
}

static const char *tmp_path(const tmpdir_t *t, const char *name, char *buf, size_t cap) {
  snprintf(buf, cap, "%s/%s", t->dir, name);
  return buf;
}

static void tmp_done(tmpdir_t *t) {
  DIR *d = opendir(t->dir);
  assert_non_null(d);
  struct dirent *e;
  char p[512];
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
      unlink(tmp_path(t, e->d_name, p, sizeof p));
  closedir(d);
  assert_int_equal(rmdir(t->dir), 0);
}

static void write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  assert_int_equal(fclose(f), 0);
}

static void write_str(const char *path, const char *s) { write_file(path, s, strlen(s)); }

static unsigned char *read_bytes(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc((size_t)len + 1);
  assert_int_equal(fread(b, 1, (size_t)len, f), (size_t)len);
  fclose(f);
  *n = (size_t)len;
  return b;
}

/* Fails unless st == want and err's message holds every needle; prints all of them. */
static void expect_err_(int line, ddp_status_t st, ddp_status_t want, const ddp_error_t *err,
                        const char *const *needles) {
  if (st != want)
    fail_msg("line %d: status %s, expected %s (message: %s)", line, ddp_status_name(st),
             ddp_status_name(want), err->msg);
  for (size_t i = 0; needles[i]; i++)
    if (!strstr(err->msg, needles[i]))
      fail_msg("line %d: the message lacks \"%s\": %s", line, needles[i], err->msg);
}
#define EXPECT_ERR(st, want, err, ...) \
  expect_err_(__LINE__, (st), (want), (err), (const char *const[]){__VA_ARGS__, NULL})

/* Fails unless n == want_n and a == b element for element, naming the first difference. */
static void expect_ids(const int64_t *a, int64_t n, const int64_t *b, int64_t want_n) {
  if (n != want_n) fail_msg("%lld ids, expected %lld", (long long)n, (long long)want_n);
  for (int64_t i = 0; i < n; i++)
    if (a[i] != b[i])
      fail_msg("id %lld is %lld, expected %lld", (long long)i, (long long)a[i], (long long)b[i]);
}

static void put32(unsigned char *p, int32_t v) {
  uint32_t u = (uint32_t)v;
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(u >> (8 * i));
}

/* An llm.c image: the 1024-byte header (magic, version, count) then `nbytes` payload bytes,
 * the first ntok of them uint16 (or uint32 when wide) tokens 0, 1, 2, ... scaled by mul. */
static unsigned char *llmc_image(int32_t magic, int32_t version, int32_t count, size_t nbytes,
                                 bool wide, int64_t mul, size_t *len) {
  *len = 1024 + nbytes;
  unsigned char *b = calloc(1, *len);
  put32(b, magic);
  put32(b + 4, version);
  put32(b + 8, count);
  size_t es = wide ? 4 : 2;
  for (size_t i = 0; (i + 1) * es <= nbytes; i++) {
    uint64_t v = (uint64_t)((int64_t)i * mul);
    for (size_t k = 0; k < es; k++) b[1024 + i * es + k] = (unsigned char)(v >> (8 * k));
  }
  return b;
}

static const char *source_path(const char *rel, char *buf, size_t cap) {
  const char *root = ddp_test_source_root();
  assert_non_null(root);
  snprintf(buf, cap, "%s/%s", root, rel);
  return buf;
}

/* The shipped corpus, tests/data/kjv_genesis_exodus.txt, as byte tokens (ddp_tokens_free). */
static void read_corpus(int64_t **tok, int64_t *n) {
  char src[512];
  ddp_error_t err = {0};
  assert_int_equal(ddp_tokens_read(source_path("tests/data/kjv_genesis_exodus.txt", src,
                                               sizeof src),
                                   tok, n, &err),
                   DDP_OK);
}

/* ---------------------------------------------------------------- llm.c ----------- */

/* Writer and reader agree, the bytes are llm.c's layout exactly, and numpy (reading and
 * writing the format as llm.c's Python does) agrees with both. */
static void test_llmc_round_trip(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256], q[256];
  tmp_path(&t, "x.bin", p, sizeof p);
  enum { N = 1000 };
  int64_t tok[N];
  for (int i = 0; i < N; i++) tok[i] = (int64_t)i * 7919 % 65536;
  tok[0] = 0;
  tok[1] = 65535;
  tok[2] = 256;
  ddp_error_t err = {0};
  assert_int_equal(ddp_tokens_write_llmc(p, tok, N, &err), DDP_OK);
  size_t len;
  unsigned char *b = read_bytes(p, &len);
  assert_int_equal(len, 1024 + 2 * N);
  /* 20240520 = 0x0134d888, little-endian; version 1; count 1000 = 0x3e8; then zeros. */
  static const unsigned char head[12] = {0x88, 0xd8, 0x34, 0x01, 1, 0, 0, 0, 0xe8, 0x03, 0, 0};
  assert_memory_equal(b, head, sizeof head);
  for (size_t i = 12; i < 1024; i++) assert_int_equal(b[i], 0);
  for (int i = 0; i < N; i++) assert_int_equal(b[1024 + 2 * i] | b[1024 + 2 * i + 1] << 8, tok[i]);
  free(b);
  int64_t *ids = NULL, n = 0;
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, tok, N);
  ddp_tokens_free(ids);

  /* numpy reads ours as llm.c lays it out and writes the reverse as llm.c does. */
  tmp_path(&t, "numpy.bin", q, sizeof q);
  char args[600];
  snprintf(args, sizeof args, "llmc %s %s", p, q);
  if (ddp_test_run_tool("data_oracle.py", args)) {
    assert_int_equal(ddp_tokens_read(q, &ids, &n, &err), DDP_OK);
    int64_t rev[N];
    for (int i = 0; i < N; i++) rev[i] = tok[N - 1 - i];
    expect_ids(ids, n, rev, N);
    ddp_tokens_free(ids);
  } else {
    print_message("numpy (under /usr/bin/python3) absent: the numpy round trip not checked\n");
  }

  /* llm.c's Llama 3 format: magic 20240801, version 7, uint32 tokens above 65535. */
  b = llmc_image(20240801, 7, 5, 20, true, 40000, &len);
  tmp_path(&t, "llama.bin", p, sizeof p);
  write_file(p, b, len);
  free(b);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  int64_t want[5] = {0, 40000, 80000, 120000, 160000};
  expect_ids(ids, n, want, 5);
  ddp_tokens_free(ids);

  /* The writer's limits. */
  int64_t bad[3] = {1, 65536, 2};
  EXPECT_ERR(ddp_tokens_write_llmc(p, bad, 3, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "token 65536 at position 1", "[0, 65535]", p);
  bad[1] = -1;
  EXPECT_ERR(ddp_tokens_write_llmc(p, bad, 3, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "token -1 at position 1");
  EXPECT_ERR(ddp_tokens_write_llmc(p, bad, 0, &err), DDP_ERR_INVALID_ARGUMENT, &err, "0 tokens",
             "1 to 2147483647");
  /* The refused writes left the earlier file whole. */
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, want, 5);
  ddp_tokens_free(ids);

  /* libddp's Llama 3 writer: the header, uint32 payload (ids above 65535 and up to 2^32 - 1),
   * read back; numpy reads it as llm.c's HEADERS_INFO["llama-3"] says and writes the reverse. */
  int64_t wide[6] = {0, 65535, 65536, 128000, 128255, 4294967295LL};
  tmp_path(&t, "llama3.bin", p, sizeof p);
  assert_int_equal(ddp_tokens_write_llmc_llama3(p, wide, 6, &err), DDP_OK);
  b = read_bytes(p, &len);
  assert_int_equal(len, 1024 + 4 * 6);
  /* 20240801 = 0x0134d9a1, little-endian; version 7; count 6. */
  static const unsigned char head3[12] = {0xa1, 0xd9, 0x34, 0x01, 7, 0, 0, 0, 6, 0, 0, 0};
  assert_memory_equal(b, head3, sizeof head3);
  for (size_t i = 12; i < 1024; i++) assert_int_equal(b[i], 0);
  static const unsigned char tok3[8] = {0x00, 0xf4, 0x01, 0x00, 0xff, 0xf4, 0x01, 0x00};
  assert_memory_equal(b + 1024 + 12, tok3, sizeof tok3); /* 128000, 128255 */
  free(b);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, wide, 6);
  ddp_tokens_free(ids);
  tmp_path(&t, "numpy3.bin", q, sizeof q);
  snprintf(args, sizeof args, "llmc %s %s", p, q);
  if (ddp_test_run_tool("data_oracle.py", args)) {
    assert_int_equal(ddp_tokens_read(q, &ids, &n, &err), DDP_OK);
    int64_t rev[6];
    for (int i = 0; i < 6; i++) rev[i] = wide[5 - i];
    expect_ids(ids, n, rev, 6);
    ddp_tokens_free(ids);
  }
  int64_t big[2] = {1, 4294967296LL};
  EXPECT_ERR(ddp_tokens_write_llmc_llama3(p, big, 2, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "token 4294967296 at position 1", "[0, 4294967295]", "Llama 3", "uint32");
  EXPECT_ERR(ddp_tokens_write_llmc(p, wide, 6, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "token 65536 at position 2", "GPT-2", "uint16");
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* Every fault of an llm.c file is refused with the file, the fault and both values. */
static void test_llmc_errors(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256];
  tmp_path(&t, "bad.bin", p, sizeof p);
  ddp_error_t err = {0};
  int64_t *ids = (int64_t *)&err, n = 7;
  size_t len;
  unsigned char *b;

  write_file(p, "", 0);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "the file is empty (0 bytes)");
  assert_null(ids);
  assert_int_equal(n, 0);

  b = llmc_image(12345, 1, 4, 8, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "wrong magic: expected 20240520", "found 12345", "bytes 39 30 00 00");

  b = llmc_image(20240522, 1, 4, 8, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, "found 20240522",
             "llm.c's eval file");

  b = llmc_image(20240520, 2, 4, 8, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "wrong version: expected 1", "found 2");

  /* The two formats' headers crossed (issue 40): Llama 3's magic with GPT-2's version 1,
   * and GPT-2's magic with Llama 3's version 7; each names the file and the element type
   * the magic implies. */
  b = llmc_image(20240801, 1, 4, 16, true, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "wrong version: expected 7 for magic 20240801 (uint32 tokens)", "found 1");
  b = llmc_image(20240520, 7, 4, 8, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "wrong version: expected 1 for magic 20240520 (uint16 tokens)", "found 7");

  b = llmc_image(20240520, 1, 10, 15, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "truncated: the header promises 10 uint16 tokens, 1044 bytes",
             "the file has 1039 bytes (missing 5)");

  b = llmc_image(20240520, 1, 4, 9, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
             "trailing bytes: the header promises 4 uint16 tokens, 1032 bytes",
             "the file has 1033 bytes (extra 1)");

  b = llmc_image(20240520, 1, 0, 0, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "empty: the header's token count is 0");

  b = llmc_image(20240520, 1, -3, 0, false, 1, &len);
  write_file(p, b, len);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
             "token count (int32 at offset 8) is negative: -3");

  b = llmc_image(20240520, 1, 4, 8, false, 1, &len);
  write_file(p, b, 500);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "truncated header: the file has 500 bytes", "header alone is 1024");
  write_file(p, b, 3);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, "truncated: 3 bytes");
  free(b);

  /* A planted fault in a real file: the shipped corpus written as llm.c tokens, then cut
   * short by one byte, then with its magic overwritten. */
  int64_t *corpus = NULL, nc = 0;
  read_corpus(&corpus, &nc);
  assert_int_equal(ddp_tokens_write_llmc(p, corpus, nc, &err), DDP_OK);
  b = read_bytes(p, &len);
  assert_int_equal(len, 1024 + 2 * (size_t)nc);
  write_file(p, b, len - 1);
  char want[160];
  snprintf(want, sizeof want, "truncated: the header promises %lld uint16 tokens, %zu bytes",
           (long long)nc, len);
  char want2[80];
  snprintf(want2, sizeof want2, "the file has %zu bytes (missing 1)", len - 1);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p, want, want2);
  b[0] ^= 0xff;
  write_file(p, b, len);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, "wrong magic",
             "found 20240503");
  free(b);
  ddp_tokens_free(corpus);

  tmp_path(&t, "absent.bin", p, sizeof p);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_NOT_FOUND, &err, p);
  EXPECT_ERR(ddp_tokens_read(t.dir, &ids, &n, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "not a regular file");
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- safetensors ----- */

static void st_write_1d(const char *path, const char *name, ddp_dtype_t dt, int64_t n,
                        const void *data, const char *other) {
  ddp_tensor_t v, w;
  int64_t shape[1] = {n};
  ddp_tensor_view(&v, dt, 1, shape, (void *)data);
  float f[2] = {1.5f, 2.5f};
  int64_t s2[1] = {2};
  ddp_tensor_view(&w, DDP_F32, 1, s2, f);
  ddp_st_entry_t e[2] = {{name, &v}, {other, &w}};
  ddp_error_t err = {0};
  assert_int_equal(ddp_st_write(path, e, other ? 2 : 1, NULL, NULL, 0, &err), DDP_OK);
}

/* A hand-made safetensors file (libddp's writer has no U16): header JSON, then data. */
static void st_write_raw(const char *path, const char *json, const void *data, size_t n) {
  size_t h = strlen(json);
  unsigned char *b = calloc(1, 8 + h + n);
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
  memcpy(b + 8, json, h);
  memcpy(b + 8 + h, data, n);
  write_file(path, b, 8 + h + n);
  free(b);
}

/* Token tensors of every accepted dtype, by name or as the only tensor; the faults. */
static void test_safetensors_tokens(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256];
  tmp_path(&t, "t.safetensors", p, sizeof p);
  ddp_error_t err = {0};
  int64_t *ids, n;
  const int64_t want[5] = {0, 1, 200, 255, 7};

  int32_t i32[5] = {0, 1, 200, 255, 7};
  st_write_1d(p, "tokens", DDP_I32, 5, i32, "other");
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, want, 5);
  ddp_tokens_free(ids);

  int64_t i64[5] = {0, 1, 200, 255, 7};
  st_write_1d(p, "ids", DDP_I64, 5, i64, NULL); /* the only tensor, any name */
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, want, 5);
  ddp_tokens_free(ids);

  uint8_t u8[5] = {0, 1, 200, 255, 7};
  st_write_1d(p, "tokens", DDP_U8, 5, u8, NULL);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, want, 5);
  ddp_tokens_free(ids);

  /* U16, beside an F32 tensor and metadata, in a file libddp's own reader refuses. */
  unsigned char data[18] = {0, 0, 1, 0, 0xff, 0xff, 0x34, 0x12, 7, 0};
  float f2[2] = {1.0f, -2.0f};
  memcpy(data + 10, f2, 8);
  st_write_raw(p,
               "{\"__metadata__\":{\"format\":\"pt\"},"
               "\"tokens\":{\"dtype\":\"U16\",\"shape\":[5],\"data_offsets\":[0,10]},"
               "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[10,18]}}",
               data, 18);
  ddp_st_file_t *f = NULL;
  assert_int_equal(ddp_st_open(p, DDP_ST_READ, &f, &err), DDP_ERR_UNSUPPORTED);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  const int64_t want16[5] = {0, 1, 65535, 0x1234, 7};
  expect_ids(ids, n, want16, 5);
  ddp_tokens_free(ids);
  /* Only "dtype" values are relabelled: a metadata value "U16" and a name with an escaped
   * quote pass through, and a header the reader refuses is still refused. */
  st_write_raw(p,
               "{\"__metadata__\":{\"note\":\"U16\"},"
               "\"tok\\\"ens\" : { \"dtype\" :\n\"U16\",\"shape\":[5],\"data_offsets\":[0,10]}}",
               data, 10);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, want16, 5);
  ddp_tokens_free(ids);
  st_write_raw(p, "{\"tokens\":{\"dtype\":\"U16\",\"shape\":[5],\"data_offsets\":[0,10]}}x", data,
               10);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "unexpected bytes after the JSON header");
  /* A U16 tensor whose bytes disagree with its shape: the reader's message, with a note. */
  st_write_raw(p, "{\"tokens\":{\"dtype\":\"U16\",\"shape\":[5],\"data_offsets\":[0,9]}}", data, 9);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p, "tensor 'tokens'",
             "span 9 bytes", "U16 tensors relabelled F16");

  st_write_1d(p, "a", DDP_I32, 5, i32, "b");
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "no tensor named 'tokens' and 2 tensors", "(the first: 'a')");
  float fl[5] = {0};
  st_write_1d(p, "tokens", DDP_F32, 5, fl, NULL);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
             "tensor 'tokens' has dtype F32", "I32, I64, U16 or U8");
  i32[2] = -3;
  st_write_1d(p, "tokens", DDP_I32, 5, i32, NULL);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
             "token id -3 at position 2");
  st_write_1d(p, "tokens", DDP_I32, 0, i32, NULL);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
             "tensor 'tokens' is empty (shape [0])");
  {
    ddp_tensor_t v;
    int64_t shape[2] = {2, 2};
    ddp_tensor_view(&v, DDP_I64, 2, shape, i64);
    ddp_st_entry_t e = {"tokens", &v};
    assert_int_equal(ddp_st_write(p, &e, 1, NULL, NULL, 0, &err), DDP_OK);
    EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err,
               "has shape [2, 2]; a token stream is 1-D");
  }
  /* A corrupt file: the safetensors reader's fault, under this file's name. */
  st_write_1d(p, "tokens", DDP_I64, 5, i64, NULL);
  size_t len;
  unsigned char *b = read_bytes(p, &len);
  write_file(p, b, len - 3);
  free(b);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p, "safetensors",
             "run past the end of the data block");
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- text ------------ */

/* encode/decode over all 256 bytes, invalid UTF-8 kept; out-of-range ids refused. */
static void test_byte_tokenizer(void **state) {
  (void)state;
  char text[256], back[257];
  int64_t ids[256];
  for (int i = 0; i < 256; i++) text[i] = (char)(255 - i);
  assert_int_equal(ddp_byte_encode(text, 256, ids), DDP_OK);
  for (int i = 0; i < 256; i++) assert_int_equal(ids[i], 255 - i);
  ddp_error_t err = {0};
  memset(back, 'x', sizeof back);
  assert_int_equal(ddp_byte_decode(ids, 256, back, &err), DDP_OK);
  assert_memory_equal(back, text, 256);
  assert_int_equal(back[256], '\0');
  /* "h\xc3\xa9" is "hé": two tokens for the one character. */
  assert_int_equal(ddp_byte_encode("h\xc3\xa9", 3, ids), DDP_OK);
  assert_int_equal(ids[1], 0xc3);
  assert_int_equal(ids[2], 0xa9);
  ids[1] = 256;
  EXPECT_ERR(ddp_byte_decode(ids, 3, back, &err), DDP_ERR_INVALID_DATA, &err,
             "id 256 at position 1", "[0, 256)");
  ids[1] = -1;
  EXPECT_ERR(ddp_byte_decode(ids, 3, back, &err), DDP_ERR_INVALID_DATA, &err,
             "id -1 at position 1");
  assert_int_equal(ddp_byte_decode(ids, 0, back, &err), DDP_OK);
  assert_int_equal(back[0], '\0');
}

/* .txt files are byte streams; other names are recognised by content. */
static void test_text_tokens(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256];
  ddp_error_t err = {0};
  int64_t *ids, n;
  tmp_path(&t, "a.txt", p, sizeof p);
  write_str(p, "h\xc3\xa9llo\n\xff");
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  const int64_t want[8] = {'h', 0xc3, 0xa9, 'l', 'l', 'o', '\n', 0xff};
  expect_ids(ids, n, want, 8);
  ddp_tokens_free(ids);
  write_file(p, "", 0);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p,
             "the text file is empty");

  /* No known extension: text, llm.c and safetensors by content; binary refused. */
  tmp_path(&t, "corpus", p, sizeof p);
  write_str(p, "abc");
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  const int64_t abc[3] = {'a', 'b', 'c'};
  expect_ids(ids, n, abc, 3);
  ddp_tokens_free(ids);
  int64_t tok[3] = {9, 8, 7};
  char q[256];
  assert_int_equal(ddp_tokens_write_llmc(tmp_path(&t, "w.bin", q, sizeof q), tok, 3, &err), DDP_OK);
  assert_int_equal(rename(q, p), 0);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, tok, 3);
  ddp_tokens_free(ids);
  st_write_1d(p, "tokens", DDP_I64, 3, tok, NULL);
  assert_int_equal(ddp_tokens_read(p, &ids, &n, &err), DDP_OK);
  expect_ids(ids, n, tok, 3);
  ddp_tokens_free(ids);
  write_file(p, "ab\0cd", 5);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, p, "unknown format",
             "a NUL byte at offset 2", ".bin, .safetensors or .txt");
  write_file(p, "", 0);
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, "the file is empty");
  /* The extension wins over the content: text named .bin is a bad llm.c file. */
  tmp_path(&t, "text.bin", p, sizeof p);
  write_str(p, "hello world");
  EXPECT_ERR(ddp_tokens_read(p, &ids, &n, &err), DDP_ERR_INVALID_DATA, &err, "wrong magic",
             "bytes 68 65 6c 6c");
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- blocks ---------- */

/* group_texts: n / block_size blocks, the remainder dropped, labels = ids; the checks. */
static void test_lm_blocks(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  int64_t tok[11];
  for (int i = 0; i < 11; i++) tok[i] = 100 + i;
  ddp_dataset_t *ds = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_lm_blocks(tok, 11, 4, 111, &ds, &err), DDP_OK);
  assert_string_equal(ddp_dataset_name(ds), "lm_blocks");
  assert_int_equal(ddp_dataset_length(ds), 2);
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  assert_int_equal(sp->feature_dtype, DDP_I64);
  assert_int_equal(sp->feature_ndim, 1);
  assert_int_equal(sp->feature_shape[0], 4);
  assert_int_equal(sp->label_dtype, DDP_I64);
  assert_int_equal(sp->label_ndim, 1);
  assert_int_equal(sp->label_shape[0], 4);
  int64_t fx[4], lx[4];
  ddp_tensor_t f, l;
  int64_t shape[1] = {4};
  ddp_tensor_view(&f, DDP_I64, 1, shape, fx);
  ddp_tensor_view(&l, DDP_I64, 1, shape, lx);
  for (int64_t i = 0; i < 2; i++) {
    assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
    expect_ids(fx, 4, tok + 4 * i, 4);
    expect_ids(lx, 4, tok + 4 * i, 4);
  }
  /* The dataset copied the stream. */
  tok[0] = -5;
  assert_int_equal(ddp_dataset_get(ds, 0, &f, &l, &err), DDP_OK);
  assert_int_equal(fx[0], 100);
  tok[0] = 100;
  ddp_dataset_destroy(ds);
  /* An exact multiple keeps every token. */
  assert_int_equal(ddp_dataset_lm_blocks(tok, 8, 2, 111, &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_length(ds), 4);
  ddp_dataset_destroy(ds);

  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 11, 1, 111, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "block_size 1", "at least 2 tokens");
  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 11, 0, 111, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "block_size 0");
  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 3, 4, 111, &ds, &err), DDP_ERR_INVALID_DATA, &err,
             "the stream has 3 tokens, fewer than one block of block_size 4");
  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 11, 4, 0, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "vocab_size 0");
  /* 110 is the last id of the stream: in the dropped remainder, still checked. */
  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 11, 4, 110, &ds, &err), DDP_ERR_INVALID_DATA, &err,
             "token id 110 at position 10", "vocab_size 110");
  assert_null(ds);
  tok[5] = -1;
  EXPECT_ERR(ddp_dataset_lm_blocks(tok, 11, 4, 1000, &ds, &err), DDP_ERR_INVALID_DATA, &err,
             "token id -1 at position 5");
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* The shipped corpus as blocks under DistributedSampler: each rank's blocks are
 * padded_epoch[r::W] (PyTorch's rule, and torch's own indices where torch is installed),
 * the ranks' positions are disjoint and together cover the padded epoch, and the loader's
 * rows are the corpus bytes at those blocks. */
static void test_blocks_sampler(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  int64_t *tok = NULL, n = 0;
  ddp_error_t err = {0};
  read_corpus(&tok, &n);
  const int64_t B = 64;
  ddp_dataset_t *ds;
  assert_int_equal(ddp_dataset_lm_blocks(tok, n, B, DDP_BYTE_VOCAB_SIZE, &ds, &err), DDP_OK);
  const int64_t N = n / B;
  assert_int_equal(ddp_dataset_length(ds), N);
  assert_true(N % 3 != 0 && N % 4 != 0); /* both world sizes below need padding */

  /* torch's indices for the same (N, W, seed, epoch), where torch is installed. */
  char in[128], out[128];
  ddp_test_tmp_file(in, sizeof in, "text", "samp_in");
  ddp_test_tmp_file(out, sizeof out, "text", "samp_out");
  FILE *fi = fopen(in, "w");
  for (int w = 3; w <= 4; w++)
    for (int dl = 0; dl < 2; dl++) fprintf(fi, "sampler %lld %d 1 %d 42 1\n", (long long)N, w, dl);
  fclose(fi);
  char args[300];
  snprintf(args, sizeof args, "sampler %s %s", in, out);
  bool torch = ddp_test_run_tool("data_oracle.py", args);
  if (!torch)
    print_message("torch (under /usr/bin/python3) absent: torch's indices not compared\n");
  FILE *fo = torch ? fopen(out, "r") : NULL;

  int64_t *perm = malloc((size_t)N * sizeof *perm);
  ddp_randperm(N, 42 + 1, perm);
  int64_t *owner = malloc((size_t)(N + 4) * sizeof *owner);
  for (int w = 3; w <= 4; w++)
    for (int dl = 0; dl < 2; dl++) {
      int64_t total = dl ? N / w * w : (N + w - 1) / w * w;
      for (int64_t k = 0; k < total; k++) owner[k] = -1;
      for (int r = 0; r < w; r++) {
        ddp_sampler_options_t so = DDP_SAMPLER_OPTIONS_INIT;
        so.dataset_len = N;
        so.num_replicas = w;
        so.rank = r;
        so.seed = 42;
        so.drop_last = dl;
        ddp_sampler_t *s;
        assert_int_equal(ddp_sampler_create(&so, &s, &err), DDP_OK);
        ddp_loader_options_t lo = DDP_LOADER_OPTIONS_INIT;
        lo.batch_size = 8;
        ddp_loader_t *ld;
        assert_int_equal(ddp_loader_create(ds, s, &lo, &ld, &err), DDP_OK);
        assert_int_equal(ddp_loader_set_epoch(ld, 1, &err), DDP_OK);
        int64_t pos = 0;
        ddp_batch_t b;
        bool has;
        while (ddp_loader_next(ld, &b, &has, &err) == DDP_OK && has)
          for (int64_t k = 0; k < b.size; k++, pos++) {
            /* Position pos of rank r is slot r + pos * W of the padded epoch. */
            int64_t slot = r + pos * w;
            assert_true(slot < total);
            if (owner[slot] != -1)
              fail_msg("W=%d drop_last=%d: slot %lld taken by rank %lld and rank %d", w, dl,
                       (long long)slot, (long long)owner[slot], r);
            owner[slot] = r;
            int64_t want = perm[slot % N]; /* padding repeats the permutation's start */
            if (b.indices[k] != want)
              fail_msg("W=%d drop_last=%d rank %d position %lld: block %lld, expected %lld", w, dl,
                       r, (long long)pos, (long long)b.indices[k], (long long)want);
            const int64_t *row = (const int64_t *)b.features.data + k * B;
            const int64_t *lab = (const int64_t *)b.labels.data + k * B;
            for (int64_t j = 0; j < B; j++)
              if (row[j] != tok[want * B + j] || lab[j] != row[j])
                fail_msg("block %lld token %lld: %lld/%lld, corpus %lld", (long long)want,
                         (long long)j, (long long)row[j], (long long)lab[j],
                         (long long)tok[want * B + j]);
          }
        assert_int_equal(pos, total / w);
        if (fo) {
          const int64_t *idx;
          int64_t m;
          assert_int_equal(ddp_sampler_indices(s, &idx, &m), DDP_OK);
          long long tn;
          assert_int_equal(fscanf(fo, "%lld", &tn), 1);
          assert_int_equal(tn, m);
          for (int64_t k = 0; k < m; k++) {
            long long v;
            assert_int_equal(fscanf(fo, "%lld", &v), 1);
            if (v != idx[k])
              fail_msg("W=%d drop_last=%d rank %d position %lld: %lld, torch %lld", w, dl, r,
                       (long long)k, (long long)idx[k], v);
          }
        }
        ddp_loader_destroy(ld);
        ddp_sampler_destroy(s);
      }
      for (int64_t k = 0; k < total; k++)
        if (owner[k] < 0) fail_msg("W=%d drop_last=%d: slot %lld unserved", w, dl, (long long)k);
    }
  if (fo) fclose(fo);
  unlink(in);
  unlink(out);
  free(perm);
  free(owner);
  ddp_dataset_destroy(ds);
  ddp_tokens_free(tok);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- text CSV -------- */

/* Reads sample i of a text CSV dataset: ids, mask ([2, L]) and the I64 label. */
static void csv_sample(const ddp_dataset_t *ds, int64_t i, int64_t L, int64_t *fx, int64_t *y) {
  ddp_tensor_t f, l;
  int64_t shape[2] = {2, L};
  ddp_tensor_view(&f, DDP_I64, 2, shape, fx);
  ddp_tensor_view(&l, DDP_I64, 0, NULL, y);
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_get(ds, i, &f, &l, &err), DDP_OK);
}

/* Fails unless sample i's ids are the text's bytes (truncated, then padded with pad) and
 * its mask marks exactly the text. */
static void expect_text(const ddp_dataset_t *ds, int64_t i, int64_t L, int64_t pad,
                        const char *text, int64_t label) {
  int64_t fx[2 * 64], y = -7;
  assert_true(L <= 64);
  csv_sample(ds, i, L, fx, &y);
  int64_t k = (int64_t)strlen(text);
  for (int64_t j = 0; j < L; j++) {
    int64_t id = j < k ? (unsigned char)text[j] : pad, m = j < k;
    if (fx[j] != id || fx[L + j] != m)
      fail_msg("sample %lld position %lld: id %lld mask %lld, expected %lld %lld (text \"%s\")",
               (long long)i, (long long)j, (long long)fx[j], (long long)fx[L + j], (long long)id,
               (long long)m, text);
  }
  if (y != label)
    fail_msg("sample %lld: label %lld, expected %lld", (long long)i, (long long)y,
             (long long)label);
}

/* RFC 4180 quoting, CRLF, a BOM, columns found by name, truncation and padding, exact. */
static void test_text_csv(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256];
  tmp_path(&t, "t.csv", p, sizeof p);
  write_str(p, "\xEF\xBB\xBFid,label,text\r\n"
               "1,2,plain text\r\n"
               "2, 0 ,\"with, comma\"\r\n"
               "3,1,\"say \"\"hi\"\"\"\n"
               "4,-3,\"two\nlines\"\n"
               "5,7,a \"quote\" inside\n"
               "6,1,\"\"\"\"\n"
               "7,0,  spaced  \n"
               "8,5,exactly ten\r\n"
               "\n\r\n");
  ddp_text_csv_options_t o = DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = 10;
  o.pad_token_id = 3;
  ddp_dataset_t *ds = NULL;
  ddp_error_t err = {0};
  assert_int_equal(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_OK);
  assert_string_equal(ddp_dataset_name(ds), "text_csv");
  assert_int_equal(ddp_dataset_length(ds), 8);
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  assert_int_equal(sp->feature_dtype, DDP_I64);
  assert_int_equal(sp->feature_ndim, 2);
  assert_int_equal(sp->feature_shape[0], 2);
  assert_int_equal(sp->feature_shape[1], 10);
  assert_int_equal(sp->label_dtype, DDP_I64);
  assert_int_equal(sp->label_ndim, 0);
  expect_text(ds, 0, 10, 3, "plain text", 2);
  expect_text(ds, 1, 10, 3, "with, comma", 0); /* 11 bytes: truncated to 10 */
  expect_text(ds, 2, 10, 3, "say \"hi\"", 1);
  expect_text(ds, 3, 10, 3, "two\nlines", -3);
  expect_text(ds, 4, 10, 3, "a \"quote\" inside", 7);
  expect_text(ds, 5, 10, 3, "\"", 1);
  expect_text(ds, 6, 10, 3, "  spaced  ", 0);
  expect_text(ds, 7, 10, 3, "exactly ten", 5);
  ddp_dataset_destroy(ds);

  /* Defaults (max_length 128, pad 0) through a NULL options pointer; TSV; F32 labels. */
  write_str(p, "text,label\nab,1\n");
  assert_int_equal(ddp_dataset_from_text_csv(p, NULL, &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_spec(ds)->feature_shape[1], 128);
  int64_t big[256], y;
  csv_sample(ds, 0, 128, big, &y);
  assert_int_equal(big[0], 'a');
  assert_int_equal(big[1], 'b');
  assert_int_equal(big[2], 0);
  assert_int_equal(big[127], 0);
  assert_int_equal(big[128] + big[129] + big[130], 2);
  ddp_dataset_destroy(ds);
  write_str(p, "sentence\tscore\n\"a\tb\"\t0.25\nc,d\t-1e3\n");
  o = (ddp_text_csv_options_t)DDP_TEXT_CSV_OPTIONS_INIT;
  o.text_column = "sentence";
  o.label_column = "score";
  o.label_dtype = DDP_F32;
  o.delimiter = '\t';
  o.max_length = 4;
  assert_int_equal(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_OK);
  int64_t fx[8];
  float yf;
  ddp_tensor_t f, l;
  int64_t shape[2] = {2, 4};
  ddp_tensor_view(&f, DDP_I64, 2, shape, fx);
  ddp_tensor_view(&l, DDP_F32, 0, NULL, &yf);
  assert_int_equal(ddp_dataset_get(ds, 0, &f, &l, &err), DDP_OK);
  DDP_ASSERT_EQ(yf, 0.25f);
  assert_int_equal(fx[1], '\t');
  assert_int_equal(ddp_dataset_get(ds, 1, &f, &l, &err), DDP_OK);
  DDP_ASSERT_EQ(yf, -1000.0f);
  assert_int_equal(fx[1], ',');
  ddp_dataset_destroy(ds);
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* Every fault names the file, the line and the column. */
static void test_text_csv_errors(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  tmpdir_t t;
  tmp_init(&t);
  char p[256];
  tmp_path(&t, "bad.csv", p, sizeof p);
  ddp_dataset_t *ds = NULL;
  ddp_error_t err = {0};
  static const struct {
    const char *csv, *needle1, *needle2;
  } bad[] = {
      {"", "the file is empty (no header row)", ""},
      {"\n1,2\n", "line 1: missing header row", ""},
      {"sentence,label\nx,1\n", "line 1: no text column named 'text'",
       "(columns: 'sentence', 'label')"},
      {"text,class\nx,1\n", "line 1: no label column named 'label'", "'text', 'class'"},
      {"text,label,text\nx,1,y\n", "column 'text' appears twice (columns 1 and 3)", ""},
      {"text,label\n", "no records after the header", ""},
      {"text,label\nx,1\ny,1.5\n", "line 3 column 2 ('label'): label is not an integer: '1.5'", ""},
      {"text,label\nx,one\n", "line 2 column 2 ('label'): label is not an integer: 'one'", ""},
      {"text,label\nx,\n", "line 2 column 2 ('label'): empty label", ""},
      {"text,label\nx,99999999999999999999\n", "label out of the int64 range", ""},
      {"text,label\n,1\n", "line 2 column 1 ('text'): empty text", ""},
      {"text,label\nx,1\ny\n", "line 3 has 1 fields, the header has 2", ""},
      {"text,label\nx,1,2\n", "line 2 has 3 fields, the header has 2", ""},
      {"text,label\n\"a\nb\",1\n\"open,1\nmore\n", "line 4 column 1: unterminated quote",
       "runs to the end of the file"},
      {"text,label\n\"a\"b,1\n", "line 2 column 1: 'b' after the closing quote", ""},
      {"text,label\nx,1\n\ny,2\n", "line 3 is empty but a record follows on line 4", ""},
      {"text,label\n\"x\n\ny\",1\nz,oops\n", "line 5 column 2 ('label')", "'oops'"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_str(p, bad[i].csv);
    ddp_status_t st = ddp_dataset_from_text_csv(p, NULL, &ds, &err);
    if (st != DDP_ERR_INVALID_DATA || !strstr(err.msg, bad[i].needle1) ||
        !strstr(err.msg, bad[i].needle2) || !strstr(err.msg, p))
      fail_msg("case %zu: %s: %s (expected INVALID_DATA with \"%s\" and \"%s\")", i,
               ddp_status_name(st), err.msg, bad[i].needle1, bad[i].needle2);
    assert_null(ds);
  }
  write_file(p, "text,label\nx\0,1\n", 16);
  EXPECT_ERR(ddp_dataset_from_text_csv(p, NULL, &ds, &err), DDP_ERR_INVALID_DATA, &err,
             "line 2: a NUL byte (file offset 12)");
  ddp_text_csv_options_t o = DDP_TEXT_CSV_OPTIONS_INIT;
  o.label_dtype = DDP_F32;
  write_str(p, "text,label\nx,nan\n");
  EXPECT_ERR(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_ERR_INVALID_DATA, &err,
             "line 2 column 2 ('label'): label is not a finite number: 'nan'");
  o = (ddp_text_csv_options_t)DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = 0;
  EXPECT_ERR(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "max_length 0");
  o = (ddp_text_csv_options_t)DDP_TEXT_CSV_OPTIONS_INIT;
  o.label_column = "text";
  EXPECT_ERR(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "two different non-empty names");
  o = (ddp_text_csv_options_t)DDP_TEXT_CSV_OPTIONS_INIT;
  o.label_dtype = DDP_F16;
  EXPECT_ERR(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_ERR_INVALID_ARGUMENT, &err,
             "label_dtype must be I64 (classes) or F32 (regression), got F16");
  /* A caller built against an older header passes a smaller struct_size: the fields past
   * it keep their defaults (max_length 128), whatever the bytes there hold. */
  o = (ddp_text_csv_options_t)DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = 0;
  o.struct_size = offsetof(ddp_text_csv_options_t, max_length);
  write_str(p, "text,label\nab,1\n");
  assert_int_equal(ddp_dataset_from_text_csv(p, &o, &ds, &err), DDP_OK);
  assert_int_equal(ddp_dataset_spec(ds)->feature_shape[1], 128);
  ddp_dataset_destroy(ds);
  tmp_path(&t, "absent.csv", p, sizeof p);
  EXPECT_ERR(ddp_dataset_from_text_csv(p, NULL, &ds, &err), DDP_ERR_NOT_FOUND, &err, p);
  tmp_done(&t);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

/* ---------------------------------------------------------------- shipped data ---- */

/* The corpus and the topic CSV in tests/data/ load with the contents docs/data.md states. */
static void test_shipped_text_data(void **state) {
  (void)state;
  int64_t live0 = ddp_test_live_allocs();
  char src[512];
  int64_t *tok = NULL, n = 0;
  ddp_error_t err = {0};
  read_corpus(&tok, &n);
  assert_int_equal(n, 367272);
  static const char head[] = "Genesis\n\nChapter 1\nIn the beginning God created the heaven";
  char buf[sizeof head];
  assert_int_equal(ddp_byte_decode(tok, (int64_t)sizeof head - 1, buf, &err), DDP_OK);
  assert_string_equal(buf, head);
  int64_t lines = 0, chapters = 0;
  for (int64_t i = 0; i < n; i++) {
    if (tok[i] != '\n' && (tok[i] < 0x20 || tok[i] > 0x7e))
      fail_msg("byte %lld at %lld is not printable ASCII", (long long)tok[i], (long long)i);
    if (tok[i] == '\n') lines++;
    if (tok[i] == 'C' && (i == 0 || tok[i - 1] == '\n') && i + 8 < n && tok[i + 7] == ' ' &&
        tok[i + 1] == 'h')
      chapters++;
  }
  /* 2746 verses, 90 "Chapter N" lines, 2 book names; a blank line before each chapter
   * heading and one between the books. */
  assert_int_equal(lines, 2746 + 90 + 2 + 90 + 1);
  assert_int_equal(chapters, 50 + 40);
  assert_int_equal(tok[n - 1], '\n');
  ddp_tokens_free(tok);

  ddp_text_csv_options_t o = DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = 64;
  ddp_dataset_t *ds;
  assert_int_equal(ddp_dataset_from_text_csv(source_path("tests/data/text_topics.csv", src,
                                                         sizeof src),
                                             &o, &ds, &err),
                   DDP_OK);
  assert_int_equal(ddp_dataset_length(ds), 200);
  expect_text(ds, 0, 64, 0, "the dog sleeps in the barn", 0);
  expect_text(ds, 2, 64, 0, "i think the bread is ready for supper, she said \"yes\"", 2);
  int64_t counts[3] = {0, 0, 0};
  for (int64_t i = 0; i < 200; i++) {
    int64_t fx[128], y;
    csv_sample(ds, i, 64, fx, &y);
    assert_true(y >= 0 && y < 3);
    assert_int_equal(y, i % 3); /* the generator's order */
    counts[y]++;
    assert_int_equal(fx[64], 1);
  }
  assert_int_equal(counts[0], 67);
  assert_int_equal(counts[1], 67);
  assert_int_equal(counts[2], 66);
  ddp_dataset_destroy(ds);
  assert_int_equal(ddp_test_live_allocs(), live0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llmc_round_trip),    cmocka_unit_test(test_llmc_errors),
      cmocka_unit_test(test_safetensors_tokens), cmocka_unit_test(test_byte_tokenizer),
      cmocka_unit_test(test_text_tokens),        cmocka_unit_test(test_lm_blocks),
      cmocka_unit_test(test_blocks_sampler),     cmocka_unit_test(test_text_csv),
      cmocka_unit_test(test_text_csv_errors),    cmocka_unit_test(test_shipped_text_data),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
