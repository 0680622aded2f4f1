/* ddp-bench internals shared by its three files: the result row, the machine's reference
 * lines (bench_calib.c) and the reports (bench_report.c: table, ratios, CSV, plot).
 * docs/benchmarks.md defines every column. Only the ddp-bench program includes this. */
#ifndef DDP_TOOLS_BENCH_H
#define DDP_TOOLS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* One measured point: a (backend, algorithm, place, size) cell of the sweep. Plain data, so
 * a forked rank 0 can write it down a pipe as bytes. Times are microseconds; bandwidths are
 * 1e9 bytes per second (as nccl-tests). */
typedef struct bench_row {
  char backend[16];
  char algo[16];
  char place[4]; /* "in" or "out" */
  char op[8];
  char dtype[8];
  int world;
  int warmup;
  int iters;
  uint64_t bytes;
  uint64_t count;
  double min_us, p50_us, p99_us, max_us;
  double algbw, busbw; /* algbw = bytes / p50; busbw = algbw * 2(W-1)/W */
  int64_t wrong;       /* elements that differed from the exact expected value, all ranks */
} bench_row_t;

/* The machine's reference lines, measured in the same run (0 = not measured). */
typedef struct bench_calib {
  double memcpy1_gbs;    /* one thread copying calib_bytes, median of reps */
  double memcpy2_gbs;    /* two threads, each copying half, summed */
  double tcp_bw_gbs;     /* one loopback connection, one direction */
  double tcp_rtt_p50_us; /* 8-byte ping-pong round trip, TCP_NODELAY, blocking */
  double tcp_rtt_p99_us;
  uint64_t bytes; /* buffer size of the memcpy and TCP bandwidth runs */
} bench_calib_t;

/* Measures every reference line; a line that fails prints why on stderr and stays 0.
 * Returns 0 when all were measured. */
int bench_calibrate(uint64_t bytes, bench_calib_t *out);

/* Nearest-rank percentile (0 < p <= 100) of n sorted values. */
double bench_percentile(const double *sorted, int n, double p);

/* Human size: 4, 1K, 64M (binary prefixes), into buf. */
const char *bench_size_str(uint64_t bytes, char *buf, size_t cap);

void bench_print_header_line(FILE *f);
void bench_print_row(FILE *f, const bench_row_t *r);
/* Ratios of each series to the reference lines, at ref_bytes (or the largest size). */
void bench_print_ratios(FILE *f, const bench_row_t *rows, size_t n, const bench_calib_t *c,
                        uint64_t ref_bytes);
/* 0 on success; prints the reason on stderr otherwise. */
int bench_write_csv(const char *path, const bench_row_t *rows, size_t n, const bench_calib_t *c);
/* PNG through gnuplot when path does not end in .svg and gnuplot runs; otherwise an SVG
 * (at path, or path + ".svg" when a PNG was asked for). 0 on success. */
int bench_write_plot(const char *path, const bench_row_t *rows, size_t n, const bench_calib_t *c);

#endif /* DDP_TOOLS_BENCH_H */
