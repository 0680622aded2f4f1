/* ddp-bench's reports: the nccl-tests style table, the ratios to the machine's reference
 * lines, the CSV file and the busbw-versus-size plot (PNG through gnuplot, else an SVG drawn
 * here). Column definitions: docs/benchmarks.md. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

const char *bench_size_str(uint64_t bytes, char *buf, size_t cap) {
  static const char unit[] = {'\0', 'K', 'M', 'G', 'T'};
  int u = 0;
  while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, cap, "%llu", (unsigned long long)bytes);
  else
    snprintf(buf, cap, "%llu%c", (unsigned long long)bytes, unit[u]);
  return buf;
}

void bench_print_header_line(FILE *f) {
  fprintf(f, "#%8s %-9s %-5s %12s %11s %5s %5s %9s %9s %9s %9s %8s %8s %7s\n", "backend", "algo",
          "place", "size(B)", "count", "warm", "iters", "min(us)", "p50(us)", "p99(us)", "max(us)",
          "algbw", "busbw", "#wrong");
  fprintf(f, "#%8s %-9s %-5s %12s %11s %5s %5s %9s %9s %9s %9s %8s %8s %7s\n", "", "", "", "",
          "(elements)", "", "", "", "", "", "", "(GB/s)", "(GB/s)", "");
}

void bench_print_row(FILE *f, const bench_row_t *r) {
  fprintf(f, " %8s %-9s %-5s %12llu %11llu %5d %5d %9.2f %9.2f %9.2f %9.2f %8.3f %8.3f %7lld\n",
          r->backend, r->algo, r->place, (unsigned long long)r->bytes, (unsigned long long)r->count,
          r->warmup, r->iters, r->min_us, r->p50_us, r->p99_us, r->max_us, r->algbw, r->busbw,
          (long long)r->wrong);
  fflush(f);
}

static bool same_series(const bench_row_t *a, const bench_row_t *b) {
  return strcmp(a->backend, b->backend) == 0 && strcmp(a->algo, b->algo) == 0 &&
         strcmp(a->place, b->place) == 0;
}

/* The row of series s at exactly `bytes`, or NULL. */
static const bench_row_t *find(const bench_row_t *rows, size_t n, const bench_row_t *s,
                               uint64_t bytes) {
  for (size_t i = 0; i < n; i++)
    if (same_series(&rows[i], s) && rows[i].bytes == bytes) return &rows[i];
  return NULL;
}

static double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

void bench_print_ratios(FILE *f, const bench_row_t *rows, size_t n, const bench_calib_t *c,
                        uint64_t ref_bytes) {
  if (n == 0) return;
  uint64_t maxb = 0;
  for (size_t i = 0; i < n; i++)
    if (rows[i].bytes > maxb) maxb = rows[i].bytes;
  if (ref_bytes > maxb) ref_bytes = maxb;
  char rb[32];
  bench_size_str(ref_bytes, rb, sizeof rb);
  fprintf(f,
          "#\n# Reference lines (same run): memcpy %.2f GB/s (1 thread), %.2f GB/s (2 threads);"
          " TCP loopback %.3f GB/s (1 connection); TCP RTT p50 %.1f us, p99 %.1f us\n",
          c->memcpy1_gbs, c->memcpy2_gbs, c->tcp_bw_gbs, c->tcp_rtt_p50_us, c->tcp_rtt_p99_us);
  fprintf(f,
          "# Ratios: busbw at %s over each reference bandwidth; peak busbw; p50 latency at the"
          " smallest size and at 4K over the TCP round trip\n",
          rb);
  fprintf(f, "#%18s %9s %8s %8s %8s %9s %6s %9s %7s %9s %7s\n", "series", "busbw", "/memcpy1",
          "/memcpy2", "/tcp_bw", "peak", "at", "p50_min", "/rtt", "p50_4K", "/rtt");
  for (size_t i = 0; i < n; i++) {
    bool first = true;
    for (size_t j = 0; j < i; j++)
      if (same_series(&rows[j], &rows[i])) first = false;
    if (!first) continue;
    const bench_row_t *s = &rows[i];
    const bench_row_t *at = find(rows, n, s, ref_bytes);
    const bench_row_t *peak = NULL, *small = NULL;
    for (size_t j = 0; j < n; j++) {
      if (!same_series(&rows[j], s)) continue;
      if (!peak || rows[j].busbw > peak->busbw) peak = &rows[j];
      if (!small || rows[j].bytes < small->bytes) small = &rows[j];
    }
    const bench_row_t *k4 = find(rows, n, s, 4096);
    char name[48], pk[32];
    snprintf(name, sizeof name, "%s/%s/%s", s->backend, s->algo, s->place);
    double bw = at ? at->busbw : 0.0;
    fprintf(f, " %18s %9.3f %8.3f %8.3f %8.3f %9.3f %6s %9.2f %7.2f", name, bw,
            ratio(bw, c->memcpy1_gbs), ratio(bw, c->memcpy2_gbs), ratio(bw, c->tcp_bw_gbs),
            peak->busbw, bench_size_str(peak->bytes, pk, sizeof pk), small->p50_us,
            ratio(small->p50_us, c->tcp_rtt_p50_us));
    if (k4)
      fprintf(f, " %9.2f %7.2f\n", k4->p50_us, ratio(k4->p50_us, c->tcp_rtt_p50_us));
    else
      fprintf(f, " %9s %7s\n", "-", "-");
  }
}

int bench_write_csv(const char *path, const bench_row_t *rows, size_t n, const bench_calib_t *c) {
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "ddp-bench: --csv %s: %s (errno %d)\n", path, strerror(errno), errno);
    return -1;
  }
  fprintf(f, "kind,backend,algorithm,place,op,dtype,world,bytes,count,warmup,iters,min_us,p50_us,"
             "p99_us,max_us,algbw_gbs,busbw_gbs,wrong\n");
  for (size_t i = 0; i < n; i++) {
    const bench_row_t *r = &rows[i];
    fprintf(f, "allreduce,%s,%s,%s,%s,%s,%d,%llu,%llu,%d,%d,%.3f,%.3f,%.3f,%.3f,%.6f,%.6f,%lld\n",
            r->backend, r->algo, r->place, r->op, r->dtype, r->world, (unsigned long long)r->bytes,
            (unsigned long long)r->count, r->warmup, r->iters, r->min_us, r->p50_us, r->p99_us,
            r->max_us, r->algbw, r->busbw, (long long)r->wrong);
  }
  /* The reference lines as rows of their own: a bandwidth goes in algbw and busbw, a round
   * trip in p50/p99. */
  unsigned long long cb = (unsigned long long)c->bytes;
  if (cb == 0) goto done; /* --no-calib */
  fprintf(f, "calibration,memcpy,1thread,,,,1,%llu,,,,,,,,%.6f,%.6f,\n", cb, c->memcpy1_gbs,
          c->memcpy1_gbs);
  fprintf(f, "calibration,memcpy,2threads,,,,2,%llu,,,,,,,,%.6f,%.6f,\n", cb, c->memcpy2_gbs,
          c->memcpy2_gbs);
  fprintf(f, "calibration,tcp_loopback,bandwidth,,,,2,%llu,,,,,,,,%.6f,%.6f,\n", cb, c->tcp_bw_gbs,
          c->tcp_bw_gbs);
  fprintf(f, "calibration,tcp_loopback,rtt,,,,2,8,,,,,%.3f,%.3f,,,,\n", c->tcp_rtt_p50_us,
          c->tcp_rtt_p99_us);
done:;
  int rc = ferror(f) ? -1 : 0;
  if (fclose(f) != 0) rc = -1;
  if (rc != 0) fprintf(stderr, "ddp-bench: --csv %s: write failed\n", path);
  return rc;
}

/* ---- plot ---- */

/* Index of the first row of each distinct series, in order of appearance. */
static size_t series_heads(const bench_row_t *rows, size_t n, size_t *heads, size_t cap) {
  size_t k = 0;
  for (size_t i = 0; i < n && k < cap; i++) {
    bool first = true;
    for (size_t j = 0; j < k; j++)
      if (same_series(&rows[heads[j]], &rows[i])) first = false;
    if (first) heads[k++] = i;
  }
  return k;
}

static void series_title(const bench_row_t *r, char *buf, size_t cap) {
  snprintf(buf, cap, "%s/%s%s", r->backend, r->algo, strcmp(r->place, "out") == 0 ? " (out)" : "");
}

#define MAX_SERIES 64
#define PLOT_COLORS 12
static const char *const plot_color[PLOT_COLORS] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                                    "#9467bd", "#8c564b", "#e377c2", "#17becf",
                                                    "#bcbd22", "#7f7f7f", "#000080", "#808000"};

/* Feeds a gnuplot script on a pipe to `gnuplot`. 0 when gnuplot ran and exited 0. */
static int plot_gnuplot(const char *path, const bench_row_t *rows, size_t n,
                        const bench_calib_t *c) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(fds[0], 0);
    close(fds[0]);
    close(fds[1]);
    execlp("gnuplot", "gnuplot", (char *)NULL);
    _exit(127);
  }
  close(fds[0]);
  FILE *g = fdopen(fds[1], "w");
  if (!g) {
    close(fds[1]);
    waitpid(pid, NULL, 0);
    return -1;
  }
  size_t heads[MAX_SERIES];
  size_t ns = series_heads(rows, n, heads, MAX_SERIES);
  /* pngcairo draws dashes; Debian's gnuplot-nox has it. */
  fprintf(g, "set terminal pngcairo size 1200,720 font 'sans,10'\nset output '%s'\n", path);
  fprintf(g, "set title 'all-reduce %s %s, %d ranks: bus bandwidth'\n", rows[0].dtype, rows[0].op,
          rows[0].world);
  fprintf(g, "set logscale x 2\nset logscale y 10\nset format y '%%g'\nset grid\n"
             "set key outside right top\n"
             "set xlabel 'message size (bytes)'\nset ylabel 'busbw (GB/s)'\n");
  fprintf(g, "set xtics (");
  bool first = true;
  for (uint64_t b = 1; b <= (1ull << 40); b <<= 2) {
    char sb[32];
    fprintf(g, "%s\"%s\" %llu", first ? "" : ", ", bench_size_str(b, sb, sizeof sb),
            (unsigned long long)b);
    first = false;
  }
  fprintf(g, ")\n");
  for (size_t s = 0; s < ns; s++) {
    fprintf(g, "$d%zu << EOD\n", s);
    for (size_t i = 0; i < n; i++)
      if (same_series(&rows[i], &rows[heads[s]]) && rows[i].busbw > 0)
        fprintf(g, "%llu %.9g\n", (unsigned long long)rows[i].bytes, rows[i].busbw);
    fprintf(g, "EOD\n");
  }
  fprintf(g, "plot ");
  /* Colour by series, dash pattern by backend, so a backend's algorithms read as a family. */
  for (size_t s = 0; s < ns; s++) {
    char t[64];
    const bench_row_t *h = &rows[heads[s]];
    series_title(h, t, sizeof t);
    int dt = strcmp(h->backend, "threads") == 0 ? 1 : strcmp(h->backend, "shm") == 0 ? 2 : 4;
    fprintf(g, "%s$d%zu with linespoints lw 2 dt %d lc rgb '%s' title '%s'", s ? ", " : "", s, dt,
            plot_color[s % PLOT_COLORS], t);
  }
  if (c->memcpy1_gbs > 0)
    fprintf(g, ", %.6g with lines dt 2 lc rgb 'black' title 'memcpy 1 thread'", c->memcpy1_gbs);
  if (c->tcp_bw_gbs > 0)
    fprintf(g, ", %.6g with lines dt 3 lc rgb 'gray40' title 'TCP loopback, 1 connection'",
            c->tcp_bw_gbs);
  fprintf(g, "\n");
  fclose(g);
  int st;
  if (waitpid(pid, &st, 0) != pid) return -1;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* A log-log SVG chart: x = log2(bytes), y = log10(busbw). */
static int plot_svg(const char *path, const bench_row_t *rows, size_t n, const bench_calib_t *c) {
  const double W = 1000, H = 640, L = 80, R = 230, T = 50, B = 60;
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "ddp-bench: --plot %s: %s (errno %d)\n", path, strerror(errno), errno);
    return -1;
  }
  uint64_t bmin = UINT64_MAX, bmax = 0;
  double ymin = INFINITY, ymax = 0;
  for (size_t i = 0; i < n; i++) {
    if (rows[i].bytes < bmin) bmin = rows[i].bytes;
    if (rows[i].bytes > bmax) bmax = rows[i].bytes;
    if (rows[i].busbw > 0 && rows[i].busbw < ymin) ymin = rows[i].busbw;
    if (rows[i].busbw > ymax) ymax = rows[i].busbw;
  }
  double refs[2] = {c->memcpy1_gbs, c->tcp_bw_gbs};
  for (int k = 0; k < 2; k++)
    if (refs[k] > ymax) ymax = refs[k];
  if (!(ymin < INFINITY)) ymin = 1e-4;
  if (ymax <= 0) ymax = 1;
  double x0 = log2((double)bmin), x1 = log2((double)bmax);
  if (x1 <= x0) x1 = x0 + 1;
  double y0 = floor(log10(ymin)), y1 = ceil(log10(ymax));
  if (y1 <= y0) y1 = y0 + 1;
#define PX(b) (L + (log2((double)(b)) - x0) / (x1 - x0) * (W - L - R))
#define PY(v) (H - B - (log10(v) - y0) / (y1 - y0) * (H - T - B))
  fprintf(f,
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
          "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
          "height=\"100%%\" fill=\"white\"/>\n",
          W, H);
  fprintf(f,
          "<text x=\"%.0f\" y=\"25\" font-size=\"15\">all-reduce %s %s, %d ranks: bus "
          "bandwidth (GB/s) vs message size (bytes)</text>\n",
          L, rows[0].dtype, rows[0].op, rows[0].world);
  fprintf(f,
          "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
          "stroke=\"black\"/>\n",
          L, T, W - L - R, H - T - B);
  for (double e = y0; e <= y1 + 1e-9; e += 1) {
    double y = PY(pow(10, e));
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", L, y,
            W - R, y);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n", L - 6, y + 4,
            pow(10, e));
  }
  for (uint64_t b = 1; b <= bmax; b <<= 2) {
    if (b < bmin) continue;
    char sb[32];
    double x = PX(b);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", x, T, x,
            H - B);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", x, H - B + 18,
            bench_size_str(b, sb, sizeof sb));
  }
  size_t heads[MAX_SERIES];
  size_t ns = series_heads(rows, n, heads, MAX_SERIES);
  for (size_t s = 0; s < ns; s++) {
    const char *col = plot_color[s % PLOT_COLORS];
    const char *be = rows[heads[s]].backend;
    const char *dash = strcmp(be, "threads") == 0 ? "none" : strcmp(be, "shm") == 0 ? "8,4" : "2,3";
    fprintf(f,
            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
            "stroke-dasharray=\"%s\" points=\"",
            col, dash);
    for (size_t i = 0; i < n; i++)
      if (same_series(&rows[i], &rows[heads[s]]) && rows[i].busbw > 0)
        fprintf(f, "%.1f,%.1f ", PX(rows[i].bytes), PY(rows[i].busbw));
    fprintf(f, "\"/>\n");
    char t[64];
    series_title(&rows[heads[s]], t, sizeof t);
    double ly = T + 16 + 18 * (double)s;
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"%s\" "
            "stroke-width=\"2\" stroke-dasharray=\"%s\"/><text x=\"%.0f\" y=\"%.1f\">%s"
            "</text>\n",
            W - R + 10, ly - 4, W - R + 34, ly - 4, col, dash, W - R + 40, ly, t);
  }
  const char *refname[2] = {"memcpy 1 thread", "TCP loopback"};
  for (int k = 0; k < 2; k++) {
    if (refs[k] <= 0) continue;
    double y = PY(refs[k]);
    double ly = T + 16 + 18 * (double)(ns + (size_t)k);
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"black\" "
            "stroke-dasharray=\"6,4\"/>\n",
            L, y, W - R, y);
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"black\" "
            "stroke-dasharray=\"6,4\"/><text x=\"%.0f\" y=\"%.1f\">%s</text>\n",
            W - R + 10, ly - 4, W - R + 34, ly - 4, W - R + 40, ly, refname[k]);
  }
#undef PX
#undef PY
  fprintf(f, "</svg>\n");
  int rc = ferror(f) ? -1 : 0;
  if (fclose(f) != 0) rc = -1;
  if (rc != 0) fprintf(stderr, "ddp-bench: --plot %s: write failed\n", path);
  return rc;
}

int bench_write_plot(const char *path, const bench_row_t *rows, size_t n, const bench_calib_t *c) {
  if (n == 0) {
    fprintf(stderr, "ddp-bench: --plot %s: nothing was measured\n", path);
    return -1;
  }
  size_t len = strlen(path);
  if (len >= 4 && strcmp(path + len - 4, ".svg") == 0) return plot_svg(path, rows, n, c);
  if (plot_gnuplot(path, rows, n, c) == 0) return 0;
  char *alt = malloc(len + 5);
  if (!alt) return -1;
  snprintf(alt, len + 5, "%s.svg", path);
  fprintf(stderr, "ddp-bench: gnuplot did not produce %s; writing an SVG to %s instead\n", path,
          alt);
  int rc = plot_svg(alt, rows, n, c);
  free(alt);
  return rc;
}
