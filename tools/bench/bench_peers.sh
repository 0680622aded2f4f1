#!/bin/bash
# bench_peers.sh: libddp's all-reduce beside Open MPI's and PyTorch gloo's, on this machine,
# in one go, on the same sizes, with the same data, barrier and timing (docs/benchmarks.md).
#
#   tools/bench/bench_peers.sh [-B BUILD_DIR] [-o OUT_DIR] [-r ROUNDS] [-- SWEEP_ARGS...]
#
# Runs, in order:
#   1. ddp-bench: backends threads, shm, tcp; algorithms auto, canonical, ring, small; the
#      reference lines (memcpy, TCP loopback); CSV and plot;
#   2. peer_mpi_allreduce under mpirun -np 2 with Open MPI's default transport (vader);
#   3. the same with --mca btl self,tcp;
#   4. tools/bench/peer_gloo_allreduce.py: 2 processes of /usr/bin/python3 with torch's gloo on lo;
# then prints two side-by-side tables (p50 latency and busbw per size per implementation),
# the acceptance ratios of the issues, and per size the p50 ratio libddp / Open MPI (shm and
# threads against vader, tcp against its tcp BTL) with PASS/FAIL. SWEEP_ARGS (default: the
# programs' own defaults, 4 B to 256 MiB) go to all four, so they measure the same points:
# -b -e -f -n --min-iters --budget --warmup. A step whose program is missing is skipped
# with a note.
# -r ROUNDS (default 1): after steps 1-3, ROUNDS - 1 more rounds in which each size of step
# 1's sweep is measured by ddp-bench (threads, shm, tcp; algorithm auto, no reference lines),
# vader and Open MPI tcp one after the other, a few seconds apart, so that a change of the
# machine's speed (a shared VM's) reaches both sides of a comparison alike; the per-size
# table then compares each implementation's median p50 over the rounds, and also prints
# every round's own PASS/FAIL count.
# Exit status: 0 when every step ran and no element was wrong, 1 otherwise, 2 usage.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build"
out=""
rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    -B) [ $# -ge 2 ] || { echo "bench_peers.sh: -B needs a directory" >&2; exit 2; }
        build=$2; shift 2 ;;
    -o) [ $# -ge 2 ] || { echo "bench_peers.sh: -o needs a directory" >&2; exit 2; }
        out=$2; shift 2 ;;
    -r) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || { echo "bench_peers.sh: -r needs a round count (1 or more)" >&2; exit 2; }
        rounds=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) echo "bench_peers.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
sweep=("$@")
bench="$build/tools/ddp-bench"
mpi_peer="$build/tools/peer_mpi_allreduce"
[ -x "$bench" ] || { echo "bench_peers.sh: $bench not found; build first (ninja -C $build)" >&2; exit 2; }
[ -n "$out" ] || out=$(mktemp -d /tmp/bench-peers.XXXXXX)
mkdir -p "$out" || exit 2
failed=0

echo "# bench_peers: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "# libddp git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown);" \
     "$(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "# sweep arguments: ${sweep[*]:-(defaults)}; outputs in $out"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew every figure)"
start=$(date +%s)

step() { # name, then the command; output goes to the terminal and to $out/<name>.txt
  local name=$1; shift
  echo
  echo "## $name: $*"
  local t0=$(date +%s)
  timeout -k 10 900 "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "## $name: exit $rc, $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || failed=1
}

# --bind-to core: Open MPI binds its two ranks to cores 0 and 1 by default (mpirun
# --report-bindings), so libddp's ranks are bound the same way.
step ddp "$bench" -w 2 --backends threads,shm,tcp --algos auto,canonical,ring,small \
  --bind-to core --csv "$out/ddp.csv" --plot "$out/busbw.png" "${sweep[@]}"

if [ -x "$mpi_peer" ] && command -v mpirun >/dev/null; then
  mpirun_=(mpirun --allow-run-as-root --oversubscribe -np 2)
  step ompi-vader "${mpirun_[@]}" "$mpi_peer" --label ompi-vader --csv "$out/ompi_vader.csv" "${sweep[@]}"
  step ompi-tcp "${mpirun_[@]}" --mca btl self,tcp "$mpi_peer" --label ompi-tcp \
    --csv "$out/ompi_tcp.csv" "${sweep[@]}"
else
  echo "## Open MPI: skipped ($mpi_peer or mpirun missing: the build found no MPI)"
fi

# Rounds 2..N: the per-size comparison's programs again, size by size. This VM's speed
# changes between two levels every few seconds (small sizes: 0.22-0.30 or 0.60-0.74 us for
# libddp and vader alike), so a sweep of one program against a sweep of the other, a minute
# apart, compares the levels as often as the programs; one size of each program in turn
# puts them seconds apart. The sizes are those of step 1 (its auto rows); each program's
# CSV rows of the round are gathered into one file per round and program, as a sweep's.
paired() { # name csv: one size's run of the command that follows, its rows added to csv
  local name=$1 csv=$2 t0 rc
  shift 2
  t0=$(date +%s)
  rm -f "$out/one.csv" # a failed run must not pass off an earlier run's rows as its own
  timeout -k 10 900 "$@" --csv "$out/one.csv" >"$out/$name.txt" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ] || [ ! -s "$out/one.csv" ]; then
    echo "## $name: exit $rc, $(( $(date +%s) - t0 )) s (output in $out/$name.txt)"
    failed=1
    return
  fi
  [ -s "$csv" ] || head -1 "$out/one.csv" >"$csv"
  tail -n +2 "$out/one.csv" >>"$csv"
  rm -f "$out/one.csv"
}
sizes=$(awk -F, 'NR > 1 && $1 == "allreduce" && $3 == "auto" && $4 == "in" { print $8 }' \
          "$out/ddp.csv" 2>/dev/null | sort -nu)
if [ "$rounds" -gt 1 ] && [ -z "$sizes" ]; then
  echo "## rounds 2..$rounds skipped: step 1 measured no size ($out/ddp.csv)"
  failed=1
fi
for ((k = 2; k <= rounds; k++)); do
  echo
  echo "## round $k: ddp-bench, ompi-vader and ompi-tcp at each size in turn"
  t0=$(date +%s)
  rm -f "$out/ddp_r$k.csv" "$out/ompi_vader_r$k.csv" "$out/ompi_tcp_r$k.csv"
  for sz in $sizes; do
    paired "ddp-r$k-$sz" "$out/ddp_r$k.csv" "$bench" -w 2 --backends threads,shm,tcp \
      --algos auto --bind-to core --no-calib "${sweep[@]}" -b "$sz" -e "$sz"
    if [ -x "$mpi_peer" ] && command -v mpirun >/dev/null; then
      paired "ompi-vader-r$k-$sz" "$out/ompi_vader_r$k.csv" "${mpirun_[@]}" "$mpi_peer" \
        --label ompi-vader "${sweep[@]}" -b "$sz" -e "$sz"
      paired "ompi-tcp-r$k-$sz" "$out/ompi_tcp_r$k.csv" "${mpirun_[@]}" --mca btl self,tcp \
        "$mpi_peer" --label ompi-tcp "${sweep[@]}" -b "$sz" -e "$sz"
    fi
  done
  echo "## round $k: $(( $(date +%s) - t0 )) s"
done

if /usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
  step gloo env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    /usr/bin/python3 "$here/peer_gloo_allreduce.py" --world 2 --csv "$out/gloo.csv" "${sweep[@]}"
else
  echo "## gloo: skipped (/usr/bin/python3 has no torch with gloo)"
fi

echo
echo "## total $(( $(date +%s) - start )) s; load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/python3 - "$out" "$rounds" <<'PY' || failed=1
import csv, math, os, statistics, sys

out, nrounds = sys.argv[1], int(sys.argv[2])
calib = {}

def load(names):
    got = {}
    for name in names:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        for r in csv.DictReader(open(path)):
            if r["kind"] == "calibration":
                calib[(r["backend"], r["algorithm"])] = r
                continue
            if r["place"] != "in":
                continue
            impl = r["backend"] if r["algorithm"] in ("auto", "default") else \
                "%s-%s" % (r["backend"], r["algorithm"])
            got[(impl, int(r["bytes"]))] = r
    return got

rows = load(("ddp.csv", "ompi_vader.csv", "ompi_tcp.csv", "gloo.csv"))
later = [load(("ddp_r%d.csv" % k, "ompi_vader_r%d.csv" % k, "ompi_tcp_r%d.csv" % k))
         for k in range(2, nrounds + 1)]

def size_str(b):
    for u, s in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if b >= u and b % u == 0:
            return "%d%s" % (b // u, s)
    return str(b)

impls = [i for i in ("threads", "shm", "tcp", "tcp-ring", "ompi-vader", "ompi-tcp", "gloo")
         if any(k[0] == i for k in rows)]
sizes = sorted({k[1] for k in rows})
wrong = sum(int(r["wrong"]) for t in [rows] + later for r in t.values())

def table(title, field, fmt):
    print("\n%s (threads/shm/tcp = libddp's default algorithm, auto; tcp-ring = algorithm ring)"
          % title)
    print("%8s" % "size" + "".join("%12s" % i for i in impls))
    for s in sizes:
        cells = []
        for i in impls:
            r = rows.get((i, s))
            cells.append("%12s" % (fmt % float(r[field]) if r else "-"))
        print("%8s" % size_str(s) + "".join(cells))

table("p50 latency (us)", "p50_us", "%.1f")
table("busbw (GB/s)", "busbw_gbs", "%.3f")

def get(impl, size, field):
    r = rows.get((impl, size))
    return float(r[field]) if r else None

def show(label, a, b, goal, ok):
    if a is None or b is None or b == 0:
        print("  %-58s  n/a (not measured)" % label)
        return
    x = a / b
    verdict = "PASS" if ok(x) else "FAIL"
    print("  %-58s %8.2fx   goal %-6s %s" % (label, x, goal, verdict))

M64, K4 = 64 << 20, 4096
print("\nAcceptance ratios (2 ranks, f32 sum, in place)")
show("shm busbw at 64M / Open MPI vader busbw", get("shm", M64, "busbw_gbs"),
     get("ompi-vader", M64, "busbw_gbs"), ">= 2", lambda x: x >= 2)
show("shm p50 at 4K / Open MPI vader p50", get("shm", K4, "p50_us"),
     get("ompi-vader", K4, "p50_us"), "<= 1.5", lambda x: x <= 1.5)
show("tcp busbw at 64M / gloo busbw", get("tcp", M64, "busbw_gbs"), get("gloo", M64, "busbw_gbs"),
     ">= 1.3", lambda x: x >= 1.3)
show("tcp-ring busbw at 64M / gloo busbw", get("tcp-ring", M64, "busbw_gbs"),
     get("gloo", M64, "busbw_gbs"), ">= 1.3", lambda x: x >= 1.3)
show("tcp p50 at 4K / Open MPI tcp p50", get("tcp", K4, "p50_us"), get("ompi-tcp", K4, "p50_us"),
     "<= 1", lambda x: x <= 1)
lb = calib.get(("tcp_loopback", "bandwidth"))
lbw = float(lb["busbw_gbs"]) if lb else None
for impl in ("tcp", "tcp-ring"):
    bw = get(impl, M64, "busbw_gbs")
    if bw is not None and lbw:
        print("  %-58s %8.2f    (1 connection loopback %.3f GB/s)"
              % ("2 x %s busbw at 64M / loopback bandwidth" % impl, 2 * bw / lbw, lbw))
    else:
        print("  %-58s  n/a" % ("2 x %s busbw at 64M / loopback bandwidth" % impl))

# The performance issue's goal: at every size libddp no slower (p50) than Open MPI on the same
# transport: shm and threads against vader, tcp against Open MPI's tcp BTL. With rounds, each
# implementation's p50 per size is the median of its rounds' p50s (all rounds measured);
# every round's own count is printed too.
per = [("shm", "ompi-vader"), ("threads", "ompi-vader"), ("tcp", "ompi-tcp")]
all_rounds = [rows] + later

def p50(impl, size):
    v = [float(t[(impl, size)]["p50_us"]) for t in all_rounds if (impl, size) in t]
    return statistics.median(v) if len(v) == len(all_rounds) else None

def verdicts(lookup):
    out_ = {}
    for s in sizes:
        for a, b in per:
            x, y = lookup(a, s), lookup(b, s)
            if x is not None and y:
                out_[(s, a)] = (x / y, x <= y)
    return out_

if nrounds > 1:
    print("\nPer round, libddp / Open MPI p50 at every size (PASS/FAIL counts)")
    for k, t in enumerate(all_rounds, 1):
        v = verdicts(lambda i, s: float(t[(i, s)]["p50_us"]) if (i, s) in t else None)
        print("  round %d: %d PASS, %d FAIL%s" % (
            k, sum(ok for _, ok in v.values()), sum(not ok for _, ok in v.values()),
            "".join("; %s %s %.2fx" % (a, size_str(s), x) for (s, a), (x, ok) in sorted(v.items())
                    if not ok)))
def per_size(v):
    print("%8s" % "size" + "".join("%22s" % ("%s/%s" % (a, b.replace("ompi-", ""))) for a, b in per))
    for s in sizes:
        cells = []
        for a, _ in per:
            x = v.get((s, a))
            cells.append("%22s" % ("%.2fx %s" % (x[0], "PASS" if x[1] else "FAIL") if x else "n/a"))
        print("%8s" % size_str(s) + "".join(cells))
    print("  %d PASS, %d FAIL" % (sum(ok for _, ok in v.values()),
                                  sum(not ok for _, ok in v.values())))

if nrounds > 1:
    print("\nPer size, median p50 over %d interleaved rounds, libddp / Open MPI (goal <= 1: PASS)"
          % nrounds)
    per_size(verdicts(p50))
    # The VM's two speed levels switch within a second (docs/benchmarks.md, "Pitfalls"), so
    # a median of three can still be one side's slow level against the other's fast one; the
    # best round of each implementation compares the two at their fast level.
    def best(impl, size):
        v = [float(t[(impl, size)]["p50_us"]) for t in all_rounds if (impl, size) in t]
        return min(v) if len(v) == len(all_rounds) else None
    print("\nPer size, best p50 of %d rounds for each implementation, libddp / Open MPI "
          "(goal <= 1: PASS)" % nrounds)
    per_size(verdicts(best))
else:
    print("\nPer size, p50 latency ratio libddp / Open MPI (goal <= 1: PASS)")
    per_size(verdicts(lambda i, s: get(i, s, "p50_us")))

print("\ncanonical vs ring, busbw ratio canonical/ring at >= 1M (> 1: canonical faster)")
for be in ("threads", "shm", "tcp"):
    pairs = [(s, get("%s-canonical" % be, s, "busbw_gbs"), get("%s-ring" % be, s, "busbw_gbs"))
             for s in sizes if s >= (1 << 20)]
    pairs = [(s, c, r) for s, c, r in pairs if c and r]
    if not pairs:
        note = "no ring on the shared-memory backends (the group runs canonical)" \
            if be != "tcp" else "not measured"
        print("  %-8s %s" % (be, note))
        continue
    ratios = [c / r for _, c, r in pairs]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print("  %-8s %s; geometric mean %.2f" % (
        be, " ".join("%s %.2f" % (size_str(s), x) for (s, _, _), x in zip(pairs, ratios)), geo))

if calib:
    def cv(k, f):
        r = calib.get(k)
        return float(r[f]) if r and r[f] else 0.0
    print("\nReference lines (same run): memcpy %.2f GB/s (1 thread), %.2f GB/s (2 threads); "
          "TCP loopback %.3f GB/s; RTT p50 %.1f us" % (
              cv(("memcpy", "1thread"), "busbw_gbs"), cv(("memcpy", "2threads"), "busbw_gbs"),
              cv(("tcp_loopback", "bandwidth"), "busbw_gbs"), cv(("tcp_loopback", "rtt"), "p50_us")))
print("wrong elements over all implementations: %d" % wrong)
sys.exit(1 if wrong else 0)
PY
echo "# files: $out (ddp.csv, busbw.png, ompi_*.csv, gloo.csv, *.txt)"
exit $failed
