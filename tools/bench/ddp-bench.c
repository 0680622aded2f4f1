/* ddp-bench: collective benchmarks in the style of nccl-tests, for every backend and
 * algorithm, beside the machine's own reference lines (memcpy, TCP loopback).
 *
 *   ddp-bench [-b 4] [-e 256M] [-f 2] [-n 200] [--warmup 5] [-w 2]
 *             [--backends threads,shm,tcp] [--algos auto,canonical,ring,small]
 *             [--csv out.csv] [--plot out.png]
 *
 * For each backend and algorithm ddp-bench builds a group of W ranks (threads of this process
 * for `threads`; forked processes meeting through a file store in a fresh temporary directory
 * for `shm` and `tcp`), lets it settle (0.5 s of untimed 4-byte all-reduces), then sweeps the
 * sizes. At each size every iteration
 *   1. fills the buffer with data that changes every iteration (value of rank r at element i
 *      in iteration k: (r+1) * g, g = ((i + 5k) mod 13) + 1), so caches cannot replay the
 *      last result and a stale or misplaced element is caught;
 *   2. enters a barrier, so all ranks start together;
 *   3. times the all-reduce from the call to the end of the wait;
 *   4. counts the elements that differ from the exact expected value (for sum,
 *      W(W+1)/2 * g; small integers, so exact in every dtype and any order).
 * The per-iteration time of the collective is the slowest rank's (a MAX all-reduce of the
 * times after the sweep point); p50/p99 are taken over iterations. algbw = bytes / p50;
 * busbw = algbw * 2(W-1)/W (nccl-tests' all-reduce factor). Iterations shrink at large sizes
 * (see iters_for) so a full sweep stays short. docs/benchmarks.md is the user's copy.
 *
 * Exit status: 0 when every point ran and every element was right, 1 otherwise, 2 for a
 * usage error. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "ddp/pg.h"
#include "ddp/store.h"

/* Both come from tools/meson.build (the git revision as of configure time). */
#ifndef DDP_BENCH_VERSION
#define DDP_BENCH_VERSION "unknown"
#endif
#ifndef DDP_BENCH_GIT
#define DDP_BENCH_GIT "unknown"
#endif

#define EXIT_USAGE 2
#define MAX_BACKENDS 3
#define MAX_ALGOS 4
#define MAX_SIZES 64
#define REF_BYTES (64ull << 20)
#define SETTLE_MS 500

typedef struct bench_cfg {
  uint64_t minbytes, maxbytes, budget, calib_bytes, segment;
  uint64_t factor;
  int iters, warmup, min_iters, world;
  int64_t timeout_ms;
  const char *backends[MAX_BACKENDS];
  int nbackends;
  ddp_algorithm_t algos[MAX_ALGOS];
  int nalgos;
  bool place_in, place_out;
  ddp_redop_t op;
  ddp_dtype_t dt;
  bool calib;
  bool desync_cost; /* --desync-cost: the fingerprint check against a group without it */
  bool bind_core;   /* --bind-to core: rank r runs on the r-th allowed CPU (Open MPI's default) */
  bool async;       /* --async: time the work-handle path instead of the blocking call */
  bool private_mem; /* --memory private: buffers from ddp_malloc, not ddp_pg_alloc */
  const char *csv, *plot;
  uint64_t sizes[MAX_SIZES];
  int nsizes;
} bench_cfg_t;

/* Where rank 0 sends its rows: a pipe to the parent (forked ranks), or the parent's own
 * array (threads; rank 0 also prints). */
typedef struct bench_sink {
  int fd;
  bench_row_t *rows;
  size_t n, cap;
} bench_sink_t;

typedef struct rank_ctx {
  const bench_cfg_t *cfg;
  bench_sink_t *sink;
  const char *backend;
  const char *algo;
} rank_ctx_t;

/* ---------------------------------------------------------------- usage ---------- */

/* The backends ddp-bench runs: the entries of DDP_BACKEND_LIST that every build has
 * (threads, shm, tcp; the optional mpi and nccl need mpirun or GPUs), in the list's order,
 * joined by sep with `last` before the final one ("threads, shm or tcp"). */
static const char *bench_backends(char *buf, size_t cap, const char *sep, const char *last) {
  static const ddp_backend_info_t all[] = {
#define BENCH_BACKEND_(name, alias, ranks, optional) {name, alias, ranks, optional},
      DDP_BACKEND_LIST(BENCH_BACKEND_)
#undef BENCH_BACKEND_
  };
  size_t n = 0, o = 0, k = 0;
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) n += !all[i].optional;
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof all / sizeof all[0] && o < cap; i++) {
    if (all[i].optional) continue;
    o += (size_t)snprintf(buf + o, cap - o, "%s%s",
                          k == 0       ? ""
                          : k + 1 == n ? last
                                       : sep,
                          all[i].name);
    k++;
  }
  return buf;
}

static void print_help(void) {
  char list[128];
  printf("Usage: ddp-bench [options]\n"
         "All-reduce benchmark over libddp's backends and algorithms, nccl-tests style, with the\n"
         "machine's reference lines (memcpy, TCP loopback) measured in the same run.\n\n"
         "  -b, --minbytes SIZE    smallest message (default 4); SIZE takes K, M, G (x1024)\n"
         "  -e, --maxbytes SIZE    largest message (default 256M)\n"
         "  -f, --stepfactor N     size multiplier between points (default 2)\n"
         "  -n, --iters N          timed iterations per point, at most (default 200)\n"
         "      --min-iters N      timed iterations per point, at least (default 5)\n"
         "      --budget SIZE      bytes per point: iterations = clamp(SIZE/size, min-iters,\n"
         "                         iters) (default 256M), so large sizes run fewer\n"
         "      --warmup N         untimed iterations per point, at most (default 5; at least 1,\n"
         "                         and at most budget/(4*size))\n"
         "  -w, --world N          ranks (default 2)\n"
         "      --backends LIST    comma-separated: %s (default all three)\n"
         "      --algos LIST       auto,canonical,ring,small (default all; ring runs on tcp\n"
         "                         only: the shared-memory backends have no ring)\n"
         "  -o, --op OP            sum, min or max (default sum)\n"
         "  -d, --dtype T          f32, f64, i32 or i64 (default f32)\n"
         "      --place P          in, out or both: in-place and/or out-of-place (default in)\n"
         "      --segment SIZE     pipelining segment of ring/canonical (default: the group's)\n"
         "      --timeout S        collective timeout in seconds (default 120)\n"
         "      --csv FILE         write every point and the reference lines as CSV\n"
         "      --plot FILE        busbw vs size, one line per backend/algorithm: PNG through\n"
         "                         gnuplot, or SVG when FILE ends in .svg or gnuplot is missing\n"
         "      --calib-bytes SIZE buffer of the memcpy and loopback lines (default 256M)\n"
         "      --no-calib         skip the reference lines\n"
         "      --memory WHERE     group (default): buffers from ddp_pg_alloc (shm: in the shared\n"
         "                         segment, read in place by peers); private: ordinary memory,\n"
         "                         as a framework's tensors (shm then copies through staging)\n"
         "      --bind-to WHAT     core: rank r runs on the r-th CPU this process may use (modulo\n"
         "                         their number), as Open MPI binds its ranks by default; none\n"
         "                         (default): the scheduler places them\n"
         "      --async            time the asynchronous call (a work handle, then ddp_work_wait)\n"
         "                         instead of the blocking one (work == NULL), which is what\n"
         "                         MPI_Allreduce and PyTorch's default async_op=False do\n"
         "      --desync-cost      measure the desync check instead of the algorithms: every\n"
         "                         size alternates iterations with and without the fingerprint\n"
         "                         check on one group (rows 'fp' and 'no-fp', and the median\n"
         "                         paired difference in %%); shm and tcp only\n"
         "  -h, --help             this text\n\n"
         "Columns: time per iteration is the slowest rank's, from the call to the end of the "
         "wait,\n"
         "after a barrier; algbw = size/p50; busbw = algbw*2(W-1)/W; #wrong = elements that\n"
         "differ from the exact expected value (checked every iteration). docs/benchmarks.md.\n"
         "Exit status: 0 all good, 1 a failure or a wrong element, 2 usage error.\n",
         bench_backends(list, sizeof list, ",", ","));
}

static void usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "ddp-bench: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'ddp-bench --help'.\n");
  exit(EXIT_USAGE);
}

/* A size with an optional binary suffix K, M or G. */
static bool parse_size(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  if (!s[0] || s[0] == '-') return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s) return false;
  int shift = 0;
  if (*end == 'K' || *end == 'k')
    shift = 10;
  else if (*end == 'M' || *end == 'm')
    shift = 20;
  else if (*end == 'G' || *end == 'g')
    shift = 30;
  if (shift) end++;
  if ((*end == 'B' || *end == 'b') && end[1] == '\0') end++;
  if (*end != '\0') return false;
  if (shift && v > (UINT64_MAX >> shift)) return false;
  *out = (uint64_t)v << shift;
  return true;
}

static bool parse_int(const char *s, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end != '\0' || v < lo || v > hi) return false;
  *out = (int)v;
  return true;
}

static bool parse_algo(const char *s, ddp_algorithm_t *out) {
  static const ddp_algorithm_t all[] = {DDP_ALGO_AUTO, DDP_ALGO_CANONICAL, DDP_ALGO_RING,
                                        DDP_ALGO_SMALL};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(s, ddp_algorithm_name(all[i])) == 0) {
      *out = all[i];
      return true;
    }
  return false;
}

/* Splits a comma list in place (s is a copy owned by the caller). */
static int split_list(char *s, char **items, int cap, const char *flag) {
  int n = 0;
  for (char *save = NULL, *t = strtok_r(s, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (n == cap) usage_error("too many items in %s", flag);
    items[n++] = t;
  }
  if (n == 0) usage_error("%s needs at least one item", flag);
  return n;
}

enum {
  O_MINBYTES = 1,
  O_MAXBYTES,
  O_FACTOR,
  O_ITERS,
  O_MINITERS,
  O_BUDGET,
  O_WARMUP,
  O_WORLD,
  O_BACKENDS,
  O_ALGOS,
  O_OP,
  O_DTYPE,
  O_PLACE,
  O_SEGMENT,
  O_TIMEOUT,
  O_CSV,
  O_PLOT,
  O_CALIB_BYTES,
  O_NO_CALIB,
  O_DESYNC_COST,
  O_BIND_TO,
  O_ASYNC_CALLS,
  O_MEMORY,
  O_HELP
};

static const struct {
  const char *lng;
  char shrt;
  int id;
  bool has_value;
} opt_table[] = {
    {"minbytes", 'b', O_MINBYTES, true},
    {"maxbytes", 'e', O_MAXBYTES, true},
    {"stepfactor", 'f', O_FACTOR, true},
    {"iters", 'n', O_ITERS, true},
    {"min-iters", 0, O_MINITERS, true},
    {"budget", 0, O_BUDGET, true},
    {"warmup", 0, O_WARMUP, true},
    {"world", 'w', O_WORLD, true},
    {"backends", 0, O_BACKENDS, true},
    {"algos", 0, O_ALGOS, true},
    {"op", 'o', O_OP, true},
    {"dtype", 'd', O_DTYPE, true},
    {"place", 0, O_PLACE, true},
    {"segment", 0, O_SEGMENT, true},
    {"timeout", 0, O_TIMEOUT, true},
    {"csv", 0, O_CSV, true},
    {"plot", 0, O_PLOT, true},
    {"calib-bytes", 0, O_CALIB_BYTES, true},
    {"no-calib", 0, O_NO_CALIB, false},
    {"help", 'h', O_HELP, false},
    {"desync-cost", 0, O_DESYNC_COST, false},
    {"bind-to", 0, O_BIND_TO, true},
    {"async", 0, O_ASYNC_CALLS, false},
    {"memory", 0, O_MEMORY, true},
};

static void parse_args(int argc, char **argv, bench_cfg_t *c) {
  *c = (bench_cfg_t){.minbytes = 4,
                     .maxbytes = 256ull << 20,
                     .budget = 256ull << 20,
                     .calib_bytes = 256ull << 20,
                     .factor = 2,
                     .iters = 200,
                     .warmup = 5,
                     .min_iters = 5,
                     .world = 2,
                     .timeout_ms = 120000,
                     .place_in = true,
                     .op = DDP_OP_SUM,
                     .dt = DDP_F32,
                     .calib = true};
  static char backends_buf[256], algos_buf[256];
  bench_backends(backends_buf, sizeof backends_buf, ",", ",");
  snprintf(algos_buf, sizeof algos_buf, "auto,canonical,ring,small");
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *val = NULL;
    int id = 0;
    bool has_value = false;
    if (a[0] == '-' && a[1] == '-' && a[2]) {
      const char *name = a + 2, *eq = strchr(name, '=');
      size_t len = eq ? (size_t)(eq - name) : strlen(name);
      for (size_t k = 0; k < sizeof opt_table / sizeof opt_table[0]; k++)
        if (strlen(opt_table[k].lng) == len && strncmp(opt_table[k].lng, name, len) == 0) {
          id = opt_table[k].id;
          has_value = opt_table[k].has_value;
        }
      if (!id) usage_error("unknown option '%s'", a);
      if (eq && !has_value) usage_error("option '%s' takes no value", a);
      if (eq) val = eq + 1;
    } else if (a[0] == '-' && a[1] && a[2] == '\0') {
      for (size_t k = 0; k < sizeof opt_table / sizeof opt_table[0]; k++)
        if (opt_table[k].shrt == a[1]) {
          id = opt_table[k].id;
          has_value = opt_table[k].has_value;
        }
      if (!id) usage_error("unknown option '%s'", a);
    } else {
      usage_error("unexpected argument '%s'", a);
    }
    if (has_value && !val) {
      if (i + 1 >= argc) usage_error("option '%s' needs a value", a);
      val = argv[++i];
    }
    switch (id) {
      case O_MINBYTES:
        if (!parse_size(val, &c->minbytes) || c->minbytes == 0)
          usage_error("--minbytes: bad size '%s'", val);
        break;
      case O_MAXBYTES:
        if (!parse_size(val, &c->maxbytes) || c->maxbytes == 0 || c->maxbytes > (16ull << 30))
          usage_error("--maxbytes: bad size '%s' (1 to 16G)", val);
        break;
      case O_FACTOR: {
        int f;
        if (!parse_int(val, 2, 1024, &f)) usage_error("--stepfactor: '%s' is not 2..1024", val);
        c->factor = (uint64_t)f;
        break;
      }
      case O_ITERS:
        if (!parse_int(val, 1, 1000000, &c->iters)) usage_error("--iters: bad count '%s'", val);
        break;
      case O_MINITERS:
        if (!parse_int(val, 1, 1000000, &c->min_iters))
          usage_error("--min-iters: bad count '%s'", val);
        break;
      case O_BUDGET:
        if (!parse_size(val, &c->budget) || c->budget == 0)
          usage_error("--budget: bad size '%s'", val);
        break;
      case O_WARMUP:
        if (!parse_int(val, 0, 1000000, &c->warmup)) usage_error("--warmup: bad count '%s'", val);
        break;
      case O_WORLD:
        if (!parse_int(val, 1, DDP_PG_MAX_WORLD, &c->world))
          usage_error("--world: '%s' is not 1..256", val);
        break;
      case O_BACKENDS: snprintf(backends_buf, sizeof backends_buf, "%s", val); break;
      case O_ALGOS: snprintf(algos_buf, sizeof algos_buf, "%s", val); break;
      case O_OP:
        if (strcmp(val, "sum") == 0)
          c->op = DDP_OP_SUM;
        else if (strcmp(val, "min") == 0)
          c->op = DDP_OP_MIN;
        else if (strcmp(val, "max") == 0)
          c->op = DDP_OP_MAX;
        else
          usage_error("--op: '%s' is not sum, min or max", val);
        break;
      case O_DTYPE:
        if (strcmp(val, "f32") == 0)
          c->dt = DDP_F32;
        else if (strcmp(val, "f64") == 0)
          c->dt = DDP_F64;
        else if (strcmp(val, "i32") == 0)
          c->dt = DDP_I32;
        else if (strcmp(val, "i64") == 0)
          c->dt = DDP_I64;
        else
          usage_error("--dtype: '%s' is not f32, f64, i32 or i64", val);
        break;
      case O_PLACE:
        if (strcmp(val, "in") == 0)
          c->place_in = true, c->place_out = false;
        else if (strcmp(val, "out") == 0)
          c->place_in = false, c->place_out = true;
        else if (strcmp(val, "both") == 0)
          c->place_in = true, c->place_out = true;
        else
          usage_error("--place: '%s' is not in, out or both", val);
        break;
      case O_SEGMENT:
        if (!parse_size(val, &c->segment)) usage_error("--segment: bad size '%s'", val);
        break;
      case O_TIMEOUT: {
        int s;
        if (!parse_int(val, 1, 86400, &s)) usage_error("--timeout: '%s' is not 1..86400 s", val);
        c->timeout_ms = (int64_t)s * 1000;
        break;
      }
      case O_CSV: c->csv = val; break;
      case O_PLOT: c->plot = val; break;
      case O_CALIB_BYTES:
        if (!parse_size(val, &c->calib_bytes) || c->calib_bytes < 4096)
          usage_error("--calib-bytes: bad size '%s' (at least 4K)", val);
        break;
      case O_NO_CALIB: c->calib = false; break;
      case O_DESYNC_COST: c->desync_cost = true; break;
      case O_ASYNC_CALLS: c->async = true; break;
      case O_MEMORY:
        if (strcmp(val, "group") != 0 && strcmp(val, "private") != 0)
          usage_error("--memory: '%s' is not group or private", val);
        c->private_mem = strcmp(val, "private") == 0;
        break;
      case O_BIND_TO:
        if (strcmp(val, "core") != 0 && strcmp(val, "none") != 0)
          usage_error("--bind-to: '%s' is not core or none", val);
        c->bind_core = strcmp(val, "core") == 0;
        break;
      case O_HELP: print_help(); exit(0);
    }
  }
  char *items[16];
  int n = split_list(backends_buf, items, 16, "--backends");
  for (int k = 0; k < n; k++) {
    const ddp_backend_info_t *b = ddp_backend_info(items[k]); /* "gloo" is tcp */
    if (!b || b->optional) {
      char list[128], fmt[192];
      snprintf(fmt, sizeof fmt, "--backends: '%%s' is not %s",
               bench_backends(list, sizeof list, ", ", " or "));
      usage_error(fmt, items[k]);
    }
    items[k] = (char *)b->name;
    for (int j = 0; j < c->nbackends; j++)
      if (strcmp(c->backends[j], items[k]) == 0) usage_error("--backends: '%s' twice", items[k]);
    if (c->nbackends == MAX_BACKENDS) usage_error("--backends: too many ('%s')", items[k]);
    c->backends[c->nbackends++] = items[k];
  }
  n = split_list(algos_buf, items, 16, "--algos");
  for (int k = 0; k < n; k++) {
    ddp_algorithm_t a;
    if (!parse_algo(items[k], &a))
      usage_error("--algos: '%s' is not auto, canonical, ring or small", items[k]);
    for (int j = 0; j < c->nalgos; j++)
      if (c->algos[j] == a) usage_error("--algos: '%s' twice", items[k]);
    if (c->nalgos == MAX_ALGOS) usage_error("--algos: too many ('%s')", items[k]);
    c->algos[c->nalgos++] = a;
  }
  size_t es = ddp_dtype_size(c->dt);
  if (c->minbytes > c->maxbytes) usage_error("--minbytes is larger than --maxbytes%s", "");
  if (c->maxbytes < es) usage_error("--maxbytes is smaller than one element%s", "");
  if (c->min_iters > c->iters) c->min_iters = c->iters;
  for (uint64_t s = c->minbytes; s <= c->maxbytes; s *= c->factor) {
    uint64_t b = s / es * es; /* whole elements */
    if (b > 0 && (c->nsizes == 0 || c->sizes[c->nsizes - 1] != b)) {
      if (c->nsizes == MAX_SIZES) usage_error("more than 64 sizes%s", "");
      c->sizes[c->nsizes++] = b;
    }
    if (s > UINT64_MAX / c->factor) break;
  }
  if (c->nsizes == 0) usage_error("no size holds a whole element%s", "");
}

/* ---------------------------------------------------------------- schedule ------- */

/* Timed iterations at `bytes`: the byte budget divided by the size, clamped to
 * [min_iters, iters]; warm-up: at least 1, at most `warmup` and a quarter of that budget. */
static int iters_for(const bench_cfg_t *c, uint64_t bytes) {
  uint64_t n = c->budget / bytes;
  if (n > (uint64_t)c->iters) n = (uint64_t)c->iters;
  if (n < (uint64_t)c->min_iters) n = (uint64_t)c->min_iters;
  return (int)n;
}

static int warmup_for(const bench_cfg_t *c, uint64_t bytes) {
  if (c->warmup == 0) return 0;
  uint64_t n = c->budget / (4 * bytes);
  if (n > (uint64_t)c->warmup) n = (uint64_t)c->warmup;
  return n < 1 ? 1 : (int)n;
}

/* ---------------------------------------------------------------- data ----------- */

/* The multiplier m with expected = m * g: the op folded over the ranks' factors r+1. */
static int64_t op_factor(ddp_redop_t op, int world) {
  switch (op) {
    case DDP_OP_MIN: return 1;
    case DDP_OP_MAX: return world;
    default: return (int64_t)world * (world + 1) / 2;
  }
}

/* Rank `rank`'s input of iteration `it`: (rank+1) * g(i, it). g cycles through 1..13, so
 * consecutive elements and consecutive iterations differ. */
#define DEFINE_FILL_CHECK(T, NAME)                                                  \
  static void fill_##NAME(T *x, size_t count, int64_t mul, uint64_t it) {           \
    unsigned g = (unsigned)((5 * it) % 13);                                         \
    for (size_t i = 0; i < count; i++) {                                            \
      x[i] = (T)(mul * (int64_t)(g + 1));                                           \
      g = g == 12 ? 0 : g + 1;                                                      \
    }                                                                               \
  }                                                                                 \
  static int64_t check_##NAME(const T *x, size_t count, int64_t mul, uint64_t it) { \
    unsigned g = (unsigned)((5 * it) % 13);                                         \
    int64_t wrong = 0;                                                              \
    for (size_t i = 0; i < count; i++) {                                            \
      wrong += !(x[i] == (T)(mul * (int64_t)(g + 1)));                              \
      g = g == 12 ? 0 : g + 1;                                                      \
    }                                                                               \
    return wrong;                                                                   \
  }
DEFINE_FILL_CHECK(float, f32)
DEFINE_FILL_CHECK(double, f64)
DEFINE_FILL_CHECK(int32_t, i32)
DEFINE_FILL_CHECK(int64_t, i64)

static void fill(ddp_dtype_t dt, void *x, size_t count, int64_t mul, uint64_t it) {
  switch (dt) {
    case DDP_F64: fill_f64(x, count, mul, it); break;
    case DDP_I32: fill_i32(x, count, mul, it); break;
    case DDP_I64: fill_i64(x, count, mul, it); break;
    default: fill_f32(x, count, mul, it); break;
  }
}

static int64_t check(ddp_dtype_t dt, const void *x, size_t count, int64_t mul, uint64_t it) {
  switch (dt) {
    case DDP_F64: return check_f64(x, count, mul, it);
    case DDP_I32: return check_i32(x, count, mul, it);
    case DDP_I64: return check_i64(x, count, mul, it);
    default: return check_f32(x, count, mul, it);
  }
}

/* ---------------------------------------------------------------- one rank ------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void sink_emit(bench_sink_t *s, const bench_row_t *r) {
  if (s->fd >= 0) {
    const char *p = (const char *)r;
    size_t left = sizeof *r;
    while (left > 0) {
      ssize_t k = write(s->fd, p, left);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return; /* the parent is gone; the rank ends with the group */
      p += k;
      left -= (size_t)k;
    }
    return;
  }
  if (s->n < s->cap) s->rows[s->n++] = *r;
  bench_print_row(stdout, r);
}

static ddp_error_t last_error(const ddp_pg_t *pg) {
  ddp_error_t e;
  ddp_pg_last_error_copy(pg, &e);
  return e;
}

/* Waits for a collective issued with status `st` (work w) and frees it; on failure prints
 * the message of the work or of the group. */
static ddp_status_t finish(ddp_pg_t *pg, ddp_status_t st, ddp_work_t *w, const char *what,
                           const rank_ctx_t *x, uint64_t bytes) {
  if (st == DDP_OK && w) st = ddp_work_wait(w, -1);
  if (st != DDP_OK)
    fprintf(stderr, "ddp-bench: %s/%s rank %d: %s of %llu bytes: %s: %s\n", x->backend, x->algo,
            ddp_pg_rank(pg), what, (unsigned long long)bytes, ddp_status_name(st),
            w ? ddp_work_error(w) : last_error(pg).msg);
  ddp_work_free(w);
  return st;
}

/* The sweep on one rank of one group: every place and size, data-varying, checked every
 * iteration; rank 0 emits a row per point. */
/* One timed iteration: fill, barrier, allreduce; *us = this rank's time of the allreduce,
 * *wrong += elements that differ from the exact result. */
static ddp_status_t one_iter(ddp_pg_t *pg, const rank_ctx_t *x, void *send, void *recv,
                             size_t count, uint64_t it, double *us, int64_t *wrong) {
  const bench_cfg_t *c = x->cfg;
  int64_t in_mul = ddp_pg_rank(pg) + 1, out_mul = op_factor(c->op, ddp_pg_size(pg));
  uint64_t bytes = count * ddp_dtype_size(c->dt);
  fill(c->dt, send, count, in_mul, it);
  ddp_work_t *w = NULL, **out = c->async ? &w : NULL; /* NULL: blocking calls */
  ddp_status_t st = ddp_barrier(pg, out);
  st = finish(pg, st, w, "barrier", x, 0);
  if (st != DDP_OK) return st;
  w = NULL;
  int64_t t0 = ddp_now_ns();
  st = ddp_allreduce(pg, send, recv, count, c->dt, c->op, out);
  if (st == DDP_OK && w) st = ddp_work_wait(w, -1);
  int64_t t1 = ddp_now_ns();
  st = finish(pg, st, w, "allreduce", x, bytes);
  if (st != DDP_OK) return st;
  *us = (double)(t1 - t0) / 1e3;
  *wrong += check(c->dt, recv, count, out_mul, it);
  return DDP_OK;
}

/* Turns the ni timed iterations of one point into a row on rank 0: the time of an
 * iteration is its slowest rank's, #wrong is summed over ranks. */
static ddp_status_t emit_point(ddp_pg_t *pg, const rank_ctx_t *x, const char *algo, bool in_place,
                               uint64_t bytes, int nw, int ni, double *times, int64_t wrong) {
  const bench_cfg_t *c = x->cfg;
  int world = ddp_pg_size(pg);
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allreduce(pg, times, times, (size_t)ni, DDP_F64, DDP_OP_MAX, &w);
  st = finish(pg, st, w, "timing allreduce", x, bytes);
  if (st != DDP_OK) return st;
  w = NULL;
  st = ddp_allreduce(pg, &wrong, &wrong, 1, DDP_I64, DDP_OP_SUM, &w);
  st = finish(pg, st, w, "#wrong allreduce", x, bytes);
  if (st != DDP_OK || ddp_pg_rank(pg) != 0) return st;
  qsort(times, (size_t)ni, sizeof *times, cmp_double);
  bench_row_t r = {0};
  snprintf(r.backend, sizeof r.backend, "%s", x->backend);
  snprintf(r.algo, sizeof r.algo, "%s", algo);
  snprintf(r.place, sizeof r.place, "%s", in_place ? "in" : "out");
  snprintf(r.op, sizeof r.op, "%s", ddp_redop_name(c->op));
  snprintf(r.dtype, sizeof r.dtype, "%s", ddp_dtype_name(c->dt));
  r.world = world;
  r.warmup = nw;
  r.iters = ni;
  r.bytes = bytes;
  r.count = bytes / ddp_dtype_size(c->dt);
  r.min_us = times[0];
  r.p50_us = bench_percentile(times, ni, 50.0);
  r.p99_us = bench_percentile(times, ni, 99.0);
  r.max_us = times[ni - 1];
  r.algbw = r.p50_us > 0 ? (double)bytes / (r.p50_us * 1e3) : 0.0;
  r.busbw = r.algbw * 2.0 * (world - 1) / world;
  r.wrong = wrong;
  sink_emit(x->sink, &r);
  return DDP_OK;
}

/* Settle: untimed 4-byte all-reduces for SETTLE_MS by rank 0's clock, so start-up work
 * (page faults, threads and peers still starting) is over before the first point. */
static ddp_status_t settle(ddp_pg_t *pg, const rank_ctx_t *x) {
  int64_t settle_end = ddp_now_ns() + SETTLE_MS * 1000000LL;
  ddp_status_t st = DDP_OK;
  for (int32_t more = 1; more && st == DDP_OK;) {
    more = ddp_pg_rank(pg) == 0 && ddp_now_ns() < settle_end;
    ddp_work_t *w = NULL;
    st = ddp_allreduce(pg, &more, &more, 1, DDP_I32, DDP_OP_MAX, &w);
    st = finish(pg, st, w, "settle allreduce", x, 4);
  }
  return st;
}

/* --bind-to core: the calling thread (a forked rank: its process, and the group's progress
 * thread created after this) runs on the rank-th CPU of the allowed set, modulo its size.
 * A failure only warns: the figures are still valid, just unbound. */
static void bind_rank(const bench_cfg_t *c, int rank) {
  if (!c->bind_core) return;
  cpu_set_t all, one;
  if (sched_getaffinity(0, sizeof all, &all) != 0) {
    fprintf(stderr, "ddp-bench: rank %d: sched_getaffinity: %s; not bound\n", rank,
            strerror(errno));
    return;
  }
  int n = CPU_COUNT(&all), want = rank % (n > 0 ? n : 1), k = 0;
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
    if (CPU_ISSET(cpu, &all) && k++ == want) {
      CPU_SET(cpu, &one);
      break;
    }
  if (sched_setaffinity(0, sizeof one, &one) != 0)
    fprintf(stderr, "ddp-bench: rank %d: sched_setaffinity: %s; not bound\n", rank,
            strerror(errno));
}

/* The timed buffers: the group's memory (shm: the shared segment), or --memory private. */
static void *buf_alloc(ddp_pg_t *pg, const bench_cfg_t *c, uint64_t bytes) {
  return c->private_mem ? ddp_malloc((size_t)bytes) : ddp_pg_alloc(pg, (size_t)bytes);
}

static void buf_free(ddp_pg_t *pg, const bench_cfg_t *c, void *p) {
  if (c->private_mem) {
    ddp_free(p);
  } else {
    ddp_pg_free(pg, p);
  }
}

static ddp_status_t bench_rank(ddp_pg_t *pg, void *arg) {
  const rank_ctx_t *x = arg;
  const bench_cfg_t *c = x->cfg;
  int rank = ddp_pg_rank(pg);
  bind_rank(c, rank); /* threads: this rank's thread (forked ranks are bound already) */
  size_t es = ddp_dtype_size(c->dt);
  uint64_t maxb = c->sizes[c->nsizes - 1];
  ddp_status_t st = DDP_OK;
  int max_iters = iters_for(c, c->sizes[0]);
  void *a = buf_alloc(pg, c, maxb), *b = c->place_out ? buf_alloc(pg, c, maxb) : NULL;
  double *times = ddp_malloc(sizeof(double) * (size_t)max_iters);
  if (!a || (c->place_out && !b) || !times) {
    fprintf(stderr, "ddp-bench: %s rank %d: cannot allocate 2 x %llu bytes\n", x->backend, rank,
            (unsigned long long)maxb);
    st = DDP_ERR_NO_MEMORY;
    goto out;
  }
  st = settle(pg, x);
  uint64_t it = 0;
  for (int place = 0; place < 2 && st == DDP_OK; place++) {
    if ((place == 0 && !c->place_in) || (place == 1 && !c->place_out)) continue;
    void *send = a, *recv = place == 0 ? a : b;
    for (int si = 0; si < c->nsizes && st == DDP_OK; si++) {
      uint64_t bytes = c->sizes[si];
      size_t count = (size_t)(bytes / es);
      int nw = warmup_for(c, bytes), ni = iters_for(c, bytes);
      int64_t wrong = 0;
      double warm;
      for (int k = 0; k < nw + ni && st == DDP_OK; k++, it++)
        st = one_iter(pg, x, send, recv, count, it, k >= nw ? &times[k - nw] : &warm, &wrong);
      if (st == DDP_OK) st = emit_point(pg, x, x->algo, place == 0, bytes, nw, ni, times, wrong);
    }
  }
out:
  ddp_free(times);
  if (b) buf_free(pg, c, b);
  if (a) buf_free(pg, c, a);
  return st;
}

/* --desync-cost. One group runs the same in-place allreduce with the fingerprint check on
 * and off (ddp_pg_set_desync_check), alternating every iteration. On a shared 2-vCPU host
 * the time of a small collective jumps between modes (both ranks running, or one queued
 * behind the other) for stretches of many iterations, by far more than the check costs, and
 * two separate groups differ by as much again (their memory, their progress threads); one
 * group and paired iterations cancel both, so the cost is the median of the paired
 * differences of the slowest rank's times, relative to the p50 without the check. The rows
 * are algorithms "fp" and "no-fp". */
static int cmp_dbl(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static ddp_status_t desync_cost_rank(ddp_pg_t *pg, const rank_ctx_t *x) {
  const bench_cfg_t *c = x->cfg;
  size_t es = ddp_dtype_size(c->dt);
  uint64_t maxb = c->sizes[c->nsizes - 1];
  int max_iters = iters_for(c, c->sizes[0]);
  void *buf = ddp_pg_alloc(pg, maxb);
  double *times[2] = {ddp_malloc(sizeof(double) * (size_t)max_iters),
                      ddp_malloc(sizeof(double) * (size_t)max_iters)};
  double *d = ddp_malloc(sizeof(double) * 2 * (size_t)max_iters);
  ddp_status_t st = buf && times[0] && times[1] && d ? DDP_OK : DDP_ERR_NO_MEMORY;
  if (st == DDP_OK) st = settle(pg, x);
  uint64_t it = 0;
  for (int si = 0; si < c->nsizes && st == DDP_OK; si++) {
    uint64_t bytes = c->sizes[si];
    size_t count = (size_t)(bytes / es);
    int nw = warmup_for(c, bytes), ni = iters_for(c, bytes);
    int64_t wrong[2] = {0, 0};
    double warm;
    for (int k = 0; k < nw + ni && st == DDP_OK; k++) {
      for (int g = 0; g < 2 && st == DDP_OK; g++, it++) {
        ddp_pg_set_desync_check(pg, g == 0);
        st = one_iter(pg, x, buf, buf, count, it, k >= nw ? &times[g][k - nw] : &warm, &wrong[g]);
      }
    }
    ddp_pg_set_desync_check(pg, true);
    for (int g = 0; g < 2 && st == DDP_OK; g++) {
      ddp_work_t *w = NULL;
      st = ddp_allreduce(pg, times[g], times[g], (size_t)ni, DDP_F64, DDP_OP_MAX, &w);
      st = finish(pg, st, w, "timing allreduce", x, bytes);
    }
    if (st == DDP_OK && ddp_pg_rank(pg) == 0) {
      double *base = d + ni;
      for (int k = 0; k < ni; k++) {
        d[k] = times[0][k] - times[1][k];
        base[k] = times[1][k];
      }
      qsort(d, (size_t)ni, sizeof *d, cmp_dbl);
      qsort(base, (size_t)ni, sizeof *base, cmp_dbl);
      double med = bench_percentile(d, ni, 50.0), p50 = bench_percentile(base, ni, 50.0);
      printf("# desync check cost: %s %llu B: median paired difference %+.3f us on a p50 of "
             "%.2f us without the check: %+.2f%% (%d pairs)\n",
             x->backend, (unsigned long long)bytes, med, p50, p50 > 0 ? 100.0 * med / p50 : 0.0,
             ni);
      fflush(stdout);
    }
    for (int g = 0; g < 2 && st == DDP_OK; g++)
      st = emit_point(pg, x, g == 0 ? "fp" : "no-fp", true, bytes, nw, ni, times[g], wrong[g]);
  }
  ddp_free(d);
  for (int g = 0; g < 2; g++) ddp_free(times[g]);
  if (buf) ddp_pg_free(pg, buf);
  return st;
}

/* Group options shared by every backend. */
static ddp_pg_options_t group_options(const bench_cfg_t *c, const char *backend,
                                      ddp_algorithm_t algo) {
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  o.backend = backend;
  o.world = c->world;
  o.timeout_ms = c->timeout_ms;
  o.algorithm = algo;
  o.segment_bytes = (size_t)c->segment;
  uint64_t maxb = c->sizes[c->nsizes - 1];
  o.shm_heap_bytes = (size_t)((c->place_out ? 2 : 1) * maxb + (4u << 20));
  return o;
}

/* ---------------------------------------------------------------- forked ranks --- */

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

/* One forked rank: a file store, then one group per algorithm, in order. Never returns. */
/* One group of this rank on the store prefix `name` (owned by *view, to destroy after the
 * group). */
static ddp_status_t open_group(const bench_cfg_t *c, const char *backend, ddp_algorithm_t algo,
                               ddp_store_t *store, const char *name, int rank, const char *token,
                               ddp_store_t **view, ddp_pg_t **pg) {
  ddp_error_t se = {0};
  ddp_status_t st = ddp_store_create_prefix(store, name, view, &se);
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-bench: %s rank %d: store prefix %s: %s\n", backend, rank, name, se.msg);
    return st;
  }
  ddp_pg_options_t o = group_options(c, backend, algo);
  o.rank = rank;
  o.store = *view;
  o.job_token = token;
  ddp_error_t err = {0};
  st = ddp_pg_create(&o, pg, &err);
  if (st != DDP_OK)
    fprintf(stderr, "ddp-bench: %s/%s rank %d: group creation: %s: %s\n", backend, name, rank,
            ddp_status_name(st), err.msg);
  return st;
}

static void child_main(const bench_cfg_t *c, const char *backend, const char *dir,
                       const char *token, int rank, int fd, const ddp_algorithm_t *algos,
                       int nalgos) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  bind_rank(c, rank);
  bench_sink_t sink = {fd, NULL, 0, 0};
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = c->timeout_ms;
  so.rank = rank;
  ddp_store_t *store = NULL;
  ddp_status_t st = ddp_store_create_file(dir, &so, &store, NULL);
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-bench: %s rank %d: file store in %s: %s\n", backend, rank, dir,
            ddp_status_name(st));
    _exit(1);
  }
  for (int k = 0; k < nalgos && st == DDP_OK; k++) {
    const char *aname = ddp_algorithm_name(algos[k]);
    ddp_store_t *view = NULL;
    ddp_pg_t *pg = NULL;
    st = open_group(c, backend, algos[k], store, aname, rank, token, &view, &pg);
    if (st == DDP_OK) {
      rank_ctx_t x = {c, &sink, backend, aname};
      st = c->desync_cost ? desync_cost_rank(pg, &x) : bench_rank(pg, &x);
    }
    ddp_pg_destroy(pg);
    ddp_store_destroy(view);
  }
  ddp_store_destroy(store);
  if (fd >= 0) close(fd);
  _exit(st == DDP_OK ? 0 : 1);
}

/* Forks the W ranks of a process backend, collects rank 0's rows as they come, and reaps
 * every rank. A rank that fails makes the others end within a grace period (they are
 * killed if they do not). Returns 0 when every rank exited 0. */
static int run_forked(const bench_cfg_t *c, const char *backend, const ddp_algorithm_t *algos,
                      int nalgos, bench_sink_t *sink) {
  char dir[] = "/tmp/ddp-bench.XXXXXX";
  if (!mkdtemp(dir)) {
    fprintf(stderr, "ddp-bench: mkdtemp: %s (errno %d)\n", strerror(errno), errno);
    return -1;
  }
  char token[40];
  snprintf(token, sizeof token, "ddp-bench-%d-%lld", (int)getpid(), (long long)ddp_now_ns());
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    fprintf(stderr, "ddp-bench: pipe: %s (errno %d)\n", strerror(errno), errno);
    rmdir(dir);
    return -1;
  }
  pid_t pids[DDP_PG_MAX_WORLD];
  int started = 0, rc = 0;
  fflush(NULL);
  for (int r = 0; r < c->world; r++) {
    pid_t p = fork();
    if (p < 0) {
      fprintf(stderr, "ddp-bench: fork: %s (errno %d)\n", strerror(errno), errno);
      rc = -1;
      break;
    }
    if (p == 0) {
      close(fds[0]);
      if (r != 0) close(fds[1]);
      child_main(c, backend, dir, token, r, r == 0 ? fds[1] : -1, algos, nalgos);
    }
    pids[started++] = p;
  }
  close(fds[1]);
  /* Everything a rank does is bounded by its group timeout per collective; this outer
   * deadline only guards against a rank that stops making progress altogether. */
  bool alive[DDP_PG_MAX_WORLD];
  for (int r = 0; r < started; r++) alive[r] = true;
  int nalive = started;
  int64_t kill_at = rc != 0 ? ddp_now_ns() : INT64_MAX; /* INT64_MAX: no kill planned */
  bool killed = false;
  /* Watchdog: no row and no exit for this long means a rank stopped making progress. */
  const int64_t quiet_ns = (2 * c->timeout_ms + 30000) * 1000000LL;
  int64_t last_progress = ddp_now_ns();
  size_t got = 0;
  bench_row_t row;
  bool eof = false;
  while (nalive > 0 || !eof) {
    if (!eof) {
      struct pollfd pfd = {fds[0], POLLIN, 0};
      int pr = poll(&pfd, 1, 100);
      if (pr > 0) {
        ssize_t k = read(fds[0], (char *)&row + got, sizeof row - got);
        if (k > 0) {
          got += (size_t)k;
          last_progress = ddp_now_ns();
          if (got == sizeof row) {
            if (sink->n < sink->cap) sink->rows[sink->n++] = row;
            bench_print_row(stdout, &row);
            got = 0;
          }
        } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
          eof = true;
        }
      }
    } else {
      usleep(20000);
    }
    for (int r = 0; r < started; r++) {
      if (!alive[r]) continue;
      int ws;
      pid_t w = waitpid(pids[r], &ws, WNOHANG);
      if (w != pids[r]) continue;
      alive[r] = false;
      nalive--;
      last_progress = ddp_now_ns();
      if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
        if (WIFSIGNALED(ws))
          fprintf(stderr, "ddp-bench: %s rank %d killed by signal %d\n", backend, r, WTERMSIG(ws));
        else
          fprintf(stderr, "ddp-bench: %s rank %d exited with code %d\n", backend, r,
                  WEXITSTATUS(ws));
        rc = -1;
        /* Peers see the failure through the group (REMOTE) well within this grace. */
        if (kill_at == INT64_MAX) kill_at = ddp_now_ns() + (c->timeout_ms + 5000) * 1000000LL;
      }
    }
    if (kill_at == INT64_MAX && ddp_now_ns() - last_progress > quiet_ns) {
      fprintf(stderr, "ddp-bench: %s: no progress for %lld s; killing the ranks\n", backend,
              (long long)(quiet_ns / 1000000000LL));
      rc = -1;
      kill_at = ddp_now_ns();
    }
    if (!killed && ddp_now_ns() >= kill_at) {
      for (int r = 0; r < started; r++)
        if (alive[r]) kill(pids[r], SIGKILL);
      killed = true;
    }
    /* Every writer is gone; a killed rank 0 may leave a partial row behind. */
    if (nalive == 0 && killed) eof = true;
  }
  close(fds[0]);
  nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  return rc;
}

/* ---------------------------------------------------------------- main ----------- */

static void print_preamble(const bench_cfg_t *c) {
  char a[32], b[32], bud[32];
  printf("# ddp-bench: libddp %s (git %s), all-reduce %s %s, world %d\n", DDP_BENCH_VERSION,
         DDP_BENCH_GIT, ddp_dtype_name(c->dt), ddp_redop_name(c->op), c->world);
  printf("# sizes %s..%s x%llu; iterations per point clamp(%s/size, %d, %d); warm-up <= %d; "
         "timeout %lld s\n",
         bench_size_str(c->sizes[0], a, sizeof a),
         bench_size_str(c->sizes[c->nsizes - 1], b, sizeof b), (unsigned long long)c->factor,
         bench_size_str(c->budget, bud, sizeof bud), c->min_iters, c->iters, c->warmup,
         (long long)(c->timeout_ms / 1000));
  printf("# calls: %s\n", c->async ? "asynchronous (a work handle, then ddp_work_wait; --async)"
                                   : "blocking (work == NULL, as MPI_Allreduce)");
  printf("# environment:");
  int any = 0;
  for (int id = 0; id < (int)DDP_ENV_COUNT_; id++)
    if (ddp_env_is_set((ddp_env_id_t)id)) {
      printf(" %s=%s", ddp_env_name((ddp_env_id_t)id), ddp_env_get((ddp_env_id_t)id));
      any = 1;
    }
  printf("%s\n", any ? "" : " (no DDP variable set)");
  fflush(stdout);
}

int main(int argc, char **argv) {
  bench_cfg_t cfg;
  parse_args(argc, argv, &cfg);
  signal(SIGPIPE, SIG_IGN);
  print_preamble(&cfg);

  bench_calib_t calib = {0};
  if (cfg.calib) {
    char cb[32];
    printf("# measuring reference lines (memcpy and TCP loopback, %s buffers)...\n",
           bench_size_str(cfg.calib_bytes, cb, sizeof cb));
    fflush(stdout);
    bench_calibrate(cfg.calib_bytes, &calib);
    printf("# reference: memcpy %.2f GB/s (1 thread), %.2f GB/s (2 threads); TCP loopback "
           "%.3f GB/s; TCP RTT p50 %.1f us, p99 %.1f us\n",
           calib.memcpy1_gbs, calib.memcpy2_gbs, calib.tcp_bw_gbs, calib.tcp_rtt_p50_us,
           calib.tcp_rtt_p99_us);
  }

  size_t cap = (size_t)MAX_BACKENDS * MAX_ALGOS * 2 * MAX_SIZES;
  bench_sink_t sink = {-1, ddp_malloc(cap * sizeof(bench_row_t)), 0, cap};
  if (!sink.rows) {
    fprintf(stderr, "ddp-bench: out of memory\n");
    return 1;
  }
  int failed = 0;
  bench_print_header_line(stdout);
  for (int bi = 0; bi < cfg.nbackends; bi++) {
    const char *be = cfg.backends[bi];
    bool shared = ddp_backend_find(be)->family == DDP_BACKEND_SHARED;
    bool threads = ddp_backend_info(be)->ranks == DDP_RANKS_THREADS;
    ddp_algorithm_t algos[MAX_ALGOS];
    int na = 0;
    for (int k = 0; k < cfg.nalgos; k++) {
      if (cfg.algos[k] == DDP_ALGO_RING && shared) {
        printf("# %s: ring is a link-backend algorithm (the group would run canonical); "
               "skipped\n",
               be);
        continue;
      }
      algos[na++] = cfg.algos[k];
    }
    if (threads && cfg.desync_cost) {
      printf("# threads: --desync-cost runs on shm and tcp (threads shares shm's check)\n");
    } else if (threads) {
      for (int k = 0; k < na; k++) {
        rank_ctx_t x = {&cfg, &sink, be, ddp_algorithm_name(algos[k])};
        ddp_pg_options_t o = group_options(&cfg, be, algos[k]);
        ddp_status_t st = ddp_spawn_threads(cfg.world, &o, bench_rank, &x);
        if (st != DDP_OK) {
          fprintf(stderr, "ddp-bench: threads/%s: %s\n", x.algo, ddp_status_name(st));
          failed = 1;
        }
      }
    } else if (na > 0 && run_forked(&cfg, be, algos, na, &sink) != 0) {
      failed = 1;
    }
  }

  int64_t wrong = 0;
  for (size_t i = 0; i < sink.n; i++) wrong += sink.rows[i].wrong;
  if (cfg.calib) bench_print_ratios(stdout, sink.rows, sink.n, &calib, REF_BYTES);
  printf("# %zu points, %lld wrong elements%s\n", sink.n, (long long)wrong,
         failed ? "; some runs FAILED (see stderr)" : "");
  if (cfg.csv && bench_write_csv(cfg.csv, sink.rows, sink.n, &calib) != 0) failed = 1;
  if (cfg.plot && bench_write_plot(cfg.plot, sink.rows, sink.n, &calib) != 0) failed = 1;
  ddp_free(sink.rows);
  return failed || wrong != 0 ? 1 : 0;
}
