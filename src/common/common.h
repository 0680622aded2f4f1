/* Private helpers of the common layer, shared by every layer of libddp: contracts, error
 * propagation, allocation wrappers and the logger. Not installed. */
#ifndef DDP_SRC_COMMON_H
#define DDP_SRC_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#include "ddp/common.h"
#include "ddp_config.h"

/* Programmer misuse (NULL handle, wrong magic, impossible state) is a contract failure:
 * it aborts with file, line and the expression. Peer, OS and data failures are statuses. */
#define DDP_REQUIRE(expr)                                         \
  do {                                                            \
    if (!(expr)) ddp__contract_failed(__FILE__, __LINE__, #expr); \
  } while (0)

#define DDP_CHECK(call)                                \
  do {                                                 \
    ddp_status_t ddp_check_st_ = (call);               \
    if (ddp_check_st_ != DDP_OK) return ddp_check_st_; \
  } while (0)

#define DDP_CHECK_GOTO(call, st, label) \
  do {                                  \
    (st) = (call);                      \
    if ((st) != DDP_OK) goto label;     \
  } while (0)

#define DDP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define DDP_MAX(a, b) ((a) > (b) ? (a) : (b))
#define DDP_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Function multiversioning for element-wise kernels: on x86-64 with GCC the function is also
 * compiled for AVX-512 and AVX2 (DDP_VEC_CLONES) or for FMA (DDP_FMA_CLONES), and the
 * variant is picked when the library loads. The clones may only vectorise what the plain
 * code computes lane for lane (no contraction, no reassociation), so every variant gives
 * the same bits. Not under ASan or TSan: the clones' ifunc resolvers run while the binary
 * loads, before the sanitizer's runtime is ready, and the binary then cannot load at all
 * (docs/building.md). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define DDP_FMA_CLONES __attribute__((target_clones("fma", "default")))
#if !defined(__clang__)
#define DDP_VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DDP_VEC_CLONES
#endif
#else
#define DDP_FMA_CLONES
#define DDP_VEC_CLONES
#endif

_Noreturn void ddp__contract_failed(const char *file, int line, const char *expr);

/* Allocation through the replaceable allocator, counted in ddp_alloc_stats. */
void *ddp__malloc(size_t size);
void *ddp__calloc(size_t n, size_t size);
void *ddp__realloc(void *ptr, size_t size);
void ddp__free(void *ptr);
char *ddp__strdup(const char *s);
/* 64-byte aligned blocks; free with ddp__aligned_free only. */
void *ddp__aligned_alloc(size_t size);
void ddp__aligned_free(void *ptr);

/* Logging. rank < 0 prints no rank prefix. */
bool ddp__log_enabled(ddp_log_level_t level);
void ddp__log(int rank, ddp_log_level_t level, const char *fmt, ...) DDP_PRINTF(3, 4);
void ddp__vlog(int rank, ddp_log_level_t level, const char *fmt, va_list ap);

/* Records an error where it starts: fills err (when non-NULL), logs it once at ERROR level
 * with the rank prefix, and returns st so that callers can write
 *   return ddp__error(err, rank, DDP_ERR_INVALID_DATA, "header length %llu past EOF", n); */
ddp_status_t ddp__error(ddp_error_t *err, int rank, ddp_status_t st, const char *fmt, ...)
    DDP_PRINTF(4, 5);
ddp_status_t ddp__verror(ddp_error_t *err, int rank, ddp_status_t st, const char *fmt, va_list ap);
/* Same, but does not log (for errors a caller expects and handles, such as a lookup miss
 * or a probe). */
ddp_status_t ddp__error_quiet(ddp_error_t *err, ddp_status_t st, const char *fmt, ...)
    DDP_PRINTF(3, 4);
void ddp__error_clear(ddp_error_t *err);

/* Fault injection (fault.c). Logs, at WARN and so always, the line tests and users time a
 * fault from: "fault injection: KIND on rank R at WHERE (t=SECONDS s, CLOCK_MONOTONIC)",
 * with the moment of injection; returns that moment in ns. */
int64_t ddp__fault_log(const ddp_fault_t *f, int rank, const char *where);
/* A process rank's crash: logs the line above, then SIGKILL to itself (no cleanup, no
 * message, like an OOM kill). */
_Noreturn void ddp__fault_crash_process(const ddp_fault_t *f, int rank, const char *where);
/* Flips the top exponent bit of element 0 of buf (count elements of es bytes, little-endian
 * floats; nothing when count is 0), so that value changes by orders of magnitude, and the
 * lowest bit of its last element. */
void ddp__fault_flip_bits(void *buf, size_t count, size_t es);

/* Files (file.c): the one atomic writer, the one mkdir -p and the one whole-file reader.
 *
 * One durability policy for every file libddp replaces (checkpoints, safetensors, dumps,
 * file-store keys, token files, config.json, metrics.jsonl when a resume cuts it): the
 * bytes go to a temporary "<dir>/.<name>.tmp.XXXXXX" (mkostemp) in the target's own
 * directory, every byte is written (short writes and EINTR retried), the file gets `mode`,
 * is fsynced, closed and renamed over the target, and the directory is fsynced so that the
 * rename is durable too (EINVAL, a file system that cannot sync a directory, is accepted).
 * Readers see the old file or the whole new one, never a prefix; a crash leaves at worst a
 * dot-named temporary; on any failure the temporary is removed and the target untouched.
 *
 * Failures are logged once, here, where they start, as "<what>: <step>(<file>): <strerror>
 * (errno N)" (what names the caller's job: "safetensors write 'x'", "dump", "file store
 * /d"; "" for none) with rank's prefix (rank < 0: none); rank DDP__QUIET fills err without logging,
 * for callers whose own caller reports the error (a tool's usage error). Writes fail with
 * DDP_ERR_SYSTEM; reads with DDP_ERR_NOT_FOUND (no such file), DDP_ERR_INVALID_ARGUMENT (a
 * directory or device), DDP_ERR_INVALID_DATA (larger than max), DDP_ERR_NO_MEMORY or
 * DDP_ERR_SYSTEM.
 *
 * Streaming: ddp__afile_open makes the temporary; ddp__afile_write appends (after a failure
 * it does nothing and returns that failure again); ddp__afile_commit finishes the file as
 * described, or, after a failure, discards it and returns the failure; ddp__afile_discard
 * drops an unfinished file (for a caller that fails for its own reasons). One call:
 * ddp__file_write_atomic. */
#define DDP__QUIET (-1000)
typedef struct ddp__afile {
  int fd;
  int rank;
  ddp_status_t st;  /* the first failure */
  const char *path; /* the caller's, used until commit */
  ddp_error_t *err;
  char what[256];
  char tmp[4200];
} ddp__afile_t;
ddp_status_t ddp__afile_open(ddp__afile_t *f, const char *path, int rank, const char *what,
                             ddp_error_t *err);
ddp_status_t ddp__afile_write(ddp__afile_t *f, const void *buf, size_t len);
ddp_status_t ddp__afile_commit(ddp__afile_t *f, unsigned mode);
void ddp__afile_discard(ddp__afile_t *f);
ddp_status_t ddp__file_write_atomic(const char *path, const void *buf, size_t len, unsigned mode,
                                    int rank, const char *what, ddp_error_t *err);
/* fsync of directory dir, so that the renames and new entries in it are durable (EINVAL
 * accepted as above). */
ddp_status_t ddp__sync_dir(const char *dir, int rank, const char *what, ddp_error_t *err);
/* mkdir -p path (mode 0755); an existing non-directory is DDP_ERR_INVALID_ARGUMENT. */
ddp_status_t ddp__mkdirs(const char *path, int rank, const char *what, ddp_error_t *err);
/* The whole regular file at path into a ddp__malloc'd buffer with a NUL byte after its
 * *len bytes (len may be NULL), so that text parsers may stop at it; max > 0 bounds the
 * size. A file that shrinks while it is read is returned as it then is. */
ddp_status_t ddp__file_read(const char *path, size_t max, int rank, const char *what, char **out,
                            size_t *len, ddp_error_t *err);

/* Parses text (NUL-terminated) as one JSON value into *out (cJSON_Delete frees it). src
 * names the text in messages: a path, or "model json". A syntax error, text after the value
 * included, is DDP_ERR_INVALID_DATA "<src>: line L, column C: JSON syntax error at ..."
 * (columns count bytes from 1), logged with rank's prefix as ddp__error does, or only
 * stored in err when rank is DDP__QUIET. (json_read.c) */
struct cJSON;
ddp_status_t ddp__json_read(const char *text, const char *src, int rank, struct cJSON **out,
                            ddp_error_t *err);

/* Reads a caller's options struct (whose first field is size_t struct_size) into dst,
 * which already holds the library's defaults (its ..._INIT), dst_size bytes. One policy for
 * every options struct: src NULL keeps every default; a caller built against an older
 * header passes a smaller struct_size and the fields past it keep their defaults; a
 * struct_size below sizeof(size_t) or above the library's (built against a newer libddp)
 * is a contract failure. dst->struct_size becomes dst_size. (opts.c) */
void ddp__opts_read(void *dst, size_t dst_size, const void *src);

#endif /* DDP_SRC_COMMON_H */
