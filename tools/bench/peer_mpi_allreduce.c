/* peer_mpi_allreduce: Open MPI's MPI_Allreduce on ddp-bench's sweep, so tools/bench/bench_peers.sh
 * can put the two side by side. Same schedule, data and timing as ddp-bench
 * (docs/benchmarks.md): f32 sum, in place; 0.5 s of untimed 4-byte all-reduces to settle;
 * then at each size, warm-up then timed iterations, each one refilled with (rank+1) * g,
 * g = ((i + 5k) mod 13) + 1, preceded by MPI_Barrier, timed from the call to its return,
 * checked element by element against W(W+1)/2 * g. An iteration's time is the slowest
 * rank's. Rank 0 prints a table and writes ddp-bench's CSV columns.
 *
 *   mpirun -np 2 peer_mpi_allreduce --label ompi-vader [-b 4] [-e 256M] [-f 2] [-n 200]
 *          [--min-iters 5] [--budget 256M] [--warmup 5] [--csv FILE]
 *
 * Exit status: 0 when every element was right, 1 otherwise, 2 for a usage error. */
#include <errno.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cfg {
  uint64_t minbytes, maxbytes, budget, factor;
  int iters, min_iters, warmup;
  const char *label, *csv;
} cfg_t;

static int usage(int rank, const char *what, const char *arg) {
  if (rank == 0) fprintf(stderr, "peer_mpi_allreduce: %s '%s'\n", what, arg ? arg : "");
  MPI_Finalize();
  exit(2);
}

static int parse_size(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || s[0] == '-') return 0;
  int shift = 0;
  if (*end == 'K' || *end == 'k')
    shift = 10;
  else if (*end == 'M' || *end == 'm')
    shift = 20;
  else if (*end == 'G' || *end == 'g')
    shift = 30;
  if (shift) end++;
  if (*end != '\0' || v == 0) return 0;
  *out = (uint64_t)v << shift;
  return 1;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double pct(const double *v, int n, double p) {
  int k = (int)((p / 100.0) * n + 0.999999999);
  if (k < 1) k = 1;
  if (k > n) k = n;
  return v[k - 1];
}

static int iters_for(const cfg_t *c, uint64_t bytes) {
  uint64_t n = c->budget / bytes;
  if (n > (uint64_t)c->iters) n = (uint64_t)c->iters;
  if (n < (uint64_t)c->min_iters) n = (uint64_t)c->min_iters;
  return (int)n;
}

static int warmup_for(const cfg_t *c, uint64_t bytes) {
  if (c->warmup == 0) return 0;
  uint64_t n = c->budget / (4 * bytes);
  if (n > (uint64_t)c->warmup) n = (uint64_t)c->warmup;
  return n < 1 ? 1 : (int)n;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  cfg_t c = {4, 256ull << 20, 256ull << 20, 2, 200, 5, 5, "ompi", NULL};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (i + 1 >= argc) usage(rank, "missing value or unknown option", a);
    const char *v = argv[++i];
    int ok = 1;
    if (!strcmp(a, "-b") || !strcmp(a, "--minbytes"))
      ok = parse_size(v, &c.minbytes);
    else if (!strcmp(a, "-e") || !strcmp(a, "--maxbytes"))
      ok = parse_size(v, &c.maxbytes);
    else if (!strcmp(a, "-f") || !strcmp(a, "--stepfactor"))
      ok = parse_size(v, &c.factor) && c.factor >= 2;
    else if (!strcmp(a, "--budget"))
      ok = parse_size(v, &c.budget);
    else if (!strcmp(a, "-n") || !strcmp(a, "--iters"))
      ok = (c.iters = atoi(v)) > 0;
    else if (!strcmp(a, "--min-iters"))
      ok = (c.min_iters = atoi(v)) > 0;
    else if (!strcmp(a, "--warmup"))
      ok = (c.warmup = atoi(v)) >= 0;
    else if (!strcmp(a, "--label"))
      c.label = v;
    else if (!strcmp(a, "--csv"))
      c.csv = v;
    else
      usage(rank, "unknown option", a);
    if (!ok) usage(rank, "bad value for", a);
  }
  if (c.min_iters > c.iters) c.min_iters = c.iters;
  FILE *csv = NULL;
  if (rank == 0 && c.csv) {
    csv = fopen(c.csv, "w");
    if (!csv) {
      fprintf(stderr, "peer_mpi_allreduce: --csv %s: %s\n", c.csv, strerror(errno));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    fprintf(csv, "kind,backend,algorithm,place,op,dtype,world,bytes,count,warmup,iters,min_us,"
                 "p50_us,p99_us,max_us,algbw_gbs,busbw_gbs,wrong\n");
  }
  size_t maxcount = (size_t)(c.maxbytes / sizeof(float));
  float *buf = malloc(maxcount * sizeof(float) + 64);
  int max_iters = iters_for(&c, c.minbytes < 4 ? 4 : c.minbytes);
  double *t = malloc(sizeof(double) * (size_t)max_iters);
  if (!buf || !t) MPI_Abort(MPI_COMM_WORLD, 1);
  const float in_mul = (float)(rank + 1), out_mul = (float)world * (float)(world + 1) / 2.0f;
  if (rank == 0)
    printf("# %-10s %12s %6s %10s %10s %10s %9s %9s %7s\n", "impl", "size(B)", "iters", "p50(us)",
           "p99(us)", "max(us)", "algbw", "busbw", "#wrong");
  /* Settle as ddp-bench does: untimed 4-byte all-reduces for 0.5 s by rank 0's clock. */
  double settle_end = MPI_Wtime() + 0.5;
  for (int more = 1; more;) {
    more = rank == 0 && MPI_Wtime() < settle_end;
    MPI_Allreduce(MPI_IN_PLACE, &more, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  }
  long long total_wrong = 0;
  uint64_t it = 0;
  for (uint64_t s = c.minbytes; s <= c.maxbytes; s *= c.factor) {
    size_t count = (size_t)(s / sizeof(float));
    if (count == 0) continue;
    uint64_t bytes = count * sizeof(float);
    int nw = warmup_for(&c, bytes), ni = iters_for(&c, bytes);
    long long wrong = 0;
    for (int k = 0; k < nw + ni; k++, it++) {
      unsigned g = (unsigned)((5 * it) % 13);
      for (size_t i = 0; i < count; i++) {
        buf[i] = in_mul * (float)(g + 1);
        g = g == 12 ? 0 : g + 1;
      }
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double t1 = MPI_Wtime();
      if (k >= nw) t[k - nw] = (t1 - t0) * 1e6;
      g = (unsigned)((5 * it) % 13);
      for (size_t i = 0; i < count; i++) {
        wrong += !(buf[i] == out_mul * (float)(g + 1));
        g = g == 12 ? 0 : g + 1;
      }
    }
    MPI_Allreduce(MPI_IN_PLACE, t, ni, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    total_wrong += wrong;
    if (rank == 0) {
      qsort(t, (size_t)ni, sizeof *t, cmp_double);
      double p50 = pct(t, ni, 50), p99 = pct(t, ni, 99);
      double algbw = (double)bytes / (p50 * 1e3), busbw = algbw * 2.0 * (world - 1) / world;
      printf("  %-10s %12llu %6d %10.2f %10.2f %10.2f %9.3f %9.3f %7lld\n", c.label,
             (unsigned long long)bytes, ni, p50, p99, t[ni - 1], algbw, busbw, wrong);
      fflush(stdout);
      if (csv)
        fprintf(csv,
                "allreduce,%s,default,in,SUM,F32,%d,%llu,%llu,%d,%d,%.3f,%.3f,%.3f,%.3f,"
                "%.6f,%.6f,%lld\n",
                c.label, world, (unsigned long long)bytes, (unsigned long long)count, nw, ni, t[0],
                p50, p99, t[ni - 1], algbw, busbw, wrong);
    }
    if (s > UINT64_MAX / c.factor) break;
  }
  if (csv) fclose(csv);
  free(buf);
  free(t);
  MPI_Finalize();
  return total_wrong ? 1 : 0;
}
