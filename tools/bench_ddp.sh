#!/bin/bash
# bench_ddp.sh: libddp's DDP training step beside PyTorch DDP (gloo), and the comm hooks,
# on this machine, in one go (docs/benchmarks.md, "DDP steps").
#
#   tools/bench_ddp.sh [-B BUILD_DIR] [-o OUT_DIR] [-s STEPS] [-r ROUNDS] [-b BATCH]
#
# Setup: 2 ranks as 2 processes, each with one BLAS/OpenMP thread, the MLP
# 784-1024-1024-1024-10, SGD, batch BATCH (64) per rank, a fixed random batch.
# Part 1, ROUNDS (2) rounds of, in this order: PyTorch DDP over gloo
# (tools/peer_torch_ddp.py with /usr/bin/python3), libddp on shm, libddp on tcp
# (ddp-bench-ddp under ddprun). Each run measures steps/s over STEPS (30) consecutive
# steps, p50 of STEPS barrier-aligned synced and no_sync steps, and p50 of the
# whole-gradient allreduce alone; per system the round with the highest steps/s is kept.
# Prints the side-by-side table and the goals of the DDP issue with PASS/FAIL:
#   libddp shm steps/s / PyTorch steps/s >= 1.5;  libddp tcp / PyTorch >= 1.2;
#   exposed communication (synced p50 - no_sync p50) / allreduce-alone p50 <= 0.25;
# then that exposed ratio beside its lower bounds: the allreduce alone of the last bucket
# and of the last gradient tensor to become ready (no bucketing splits a tensor), and the
# reduction's extra CPU time per step, which nothing hides when the ranks fill every CPU.
# Part 2, libddp on tcp, one run per comm hook (no, fp16, bf16, power_sgd rank 1 and 4,
# batched_power_sgd rank 1, fp16 wrapper around power_sgd rank 1; PowerSGD with
# start_powerSGD_iter=2 so the timed steps compress), ROUNDS rounds, the best kept:
# payload bytes per step and steps/s.
# Exit status: 0 when every run finished (whatever the ratios), 1 otherwise, 2 usage.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
build="$repo/build"
out=""
steps=30
rounds=2
batch=64
while [ $# -gt 0 ]; do
  case "$1" in
    -B|-o|-s|-r|-b)
      [ $# -ge 2 ] || { echo "bench_ddp.sh: $1 needs a value" >&2; exit 2; }
      case "$1" in
        -B) build=$2 ;; -o) out=$2 ;; -s) steps=$2 ;; -r) rounds=$2 ;; -b) batch=$2 ;;
      esac
      shift 2 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_ddp.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in "$steps" "$rounds" "$batch"; do
  case "$v" in ''|*[!0-9]*|0) echo "bench_ddp.sh: -s, -r and -b take positive integers" >&2
                                exit 2 ;; esac
done
tool="$build/tools/ddp-bench-ddp"
ddprun="$build/tools/ddprun"
py=/usr/bin/python3
for f in "$tool" "$ddprun"; do
  [ -x "$f" ] || { echo "bench_ddp.sh: $f not found; build first (ninja -C $build)" >&2; exit 2; }
done
[ -n "$out" ] || out=$(mktemp -d /tmp/bench-ddp.XXXXXX)
mkdir -p "$out" || exit 2
failed=0
export DDP_BLAS_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
# PyTorch's matmuls go through the same OpenBLAS: give it the kernel set libddp runs
# (libddp replaces OpenBLAS's pre-AVX2 fallback on CPUs it does not know; docs/environment.md).
[ -n "${OPENBLAS_CORETYPE:-}" ] || export OPENBLAS_CORETYPE="$("$tool" --blas-core)"
counts=(--steps "$steps" --warmup 5 --batch "$batch")

echo "# bench_ddp: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "# libddp git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown);" \
     "$(getconf _NPROCESSORS_ONLN) CPUs; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "# 2 ranks x 1 thread, MLP 784-1024-1024-1024-10, batch $batch per rank, SGD;" \
     "$steps timed steps per phase, $rounds rounds; outputs in $out"
echo "# OpenBLAS kernels for both: $OPENBLAS_CORETYPE"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew every figure)"
start=$(date +%s)

run() { # name, then the command; its RESULT line goes to $out/<name>.res
  local name=$1; shift
  timeout -k 10 300 "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  grep -o 'RESULT .*' "$out/$name.txt" | head -1 >"$out/$name.res"
  if [ "$rc" -ne 0 ] || [ ! -s "$out/$name.res" ]; then
    echo "## $name: FAILED (exit $rc); last lines of $out/$name.txt:"
    tail -5 "$out/$name.txt" | sed 's/^/##   /'
    failed=1
  fi
  printf '## %-22s %3d s  load %s\n' "$name" "$(( $(date +%s) - t0 ))" \
    "$(cut -d' ' -f1 /proc/loadavg)"
}
get() { # file key -> value (empty when missing)
  grep -o "[[:space:]]$2=[^[:space:]]*" "$1" 2>/dev/null | head -1 | cut -d= -f2
}
calc() { awk "BEGIN { printf \"%.3f\", $1 }" 2>/dev/null; }
verdict() { # value op goal
  awk -v v="$1" -v g="$3" -v op="$2" 'BEGIN {
    if (v == "") { print "FAIL (no value)"; exit }
    ok = (op == ">=") ? (v + 0 >= g + 0) : (v + 0 <= g + 0); print ok ? "PASS" : "FAIL" }'
}

echo
echo "## part 1: steps/s and exposed communication"
for r in $(seq 1 "$rounds"); do
  t0=$(date +%s)
  if [ -x "$py" ]; then
    run "torch.r$r" "$py" "$here/peer_torch_ddp.py" --world 2 "${counts[@]}" --pairs "$steps" \
      --ar-iters "$steps"
  else
    echo "## torch: $py missing, PyTorch peer skipped"
  fi
  for be in shm tcp; do
    t0=$(date +%s)
    run "$be.r$r" "$ddprun" --nproc_per_node 2 --backend "$be" "$tool" "${counts[@]}" \
      --pairs "$steps" --ar-iters "$steps"
  done
done

best() { # system -> the .res file of its round with the highest steps/s
  local f bestf="" bestv=-1
  for f in "$out/$1".r*.res; do
    local v; v=$(get "$f" steps_per_s)
    [ -n "$v" ] || continue
    if awk -v a="$v" -v b="$bestv" 'BEGIN { exit !(a > b) }'; then bestf=$f; bestv=$v; fi
  done
  echo "$bestf"
}
declare -A res
for s in torch shm tcp; do res[$s]=$(best "$s"); done

echo
printf '%-24s %14s %14s %14s\n' "" "pytorch-gloo" "libddp-shm" "libddp-tcp"
for k in steps_per_s step_p50_ms sync_p50_ms nosync_p50_ms exposed_ms allreduce_p50_ms \
         exposed_ratio sync_cpu_ms nosync_cpu_ms extra_cpu_ms nosync_busy cpus \
         allreduce_last_bucket_p50_ms floor_bucket_ratio allreduce_last_tensor_p50_ms \
         floor_tensor_ratio; do
  printf '%-24s' "$k"
  for s in torch shm tcp; do printf ' %14s' "$(get "${res[$s]:-/dev/null}" "$k")"; done
  echo
done
printf '%-24s' "rounds (steps/s)"
for s in torch shm tcp; do
  printf ' %14s' "$(for f in "$out/$s".r*.res; do get "$f" steps_per_s; done | paste -sd/)"
done
echo

tq=$(get "${res[torch]:-/dev/null}" steps_per_s)
sq=$(get "${res[shm]:-/dev/null}" steps_per_s)
cq=$(get "${res[tcp]:-/dev/null}" steps_per_s)
ratio_shm=""; ratio_tcp=""
[ -n "$tq" ] && [ -n "$sq" ] && ratio_shm=$(calc "$sq / $tq")
[ -n "$tq" ] && [ -n "$cq" ] && ratio_tcp=$(calc "$cq / $tq")
es=$(get "${res[shm]:-/dev/null}" exposed_ratio)
ec=$(get "${res[tcp]:-/dev/null}" exposed_ratio)
echo
echo "## goals (DDP issue)"
printf '%-52s %8s  goal %-7s %s\n' "libddp shm steps/s / PyTorch gloo steps/s" "${ratio_shm:--}" \
  ">= 1.5" "$(verdict "$ratio_shm" '>=' 1.5)"
printf '%-52s %8s  goal %-7s %s\n' "libddp tcp steps/s / PyTorch gloo steps/s" "${ratio_tcp:--}" \
  ">= 1.2" "$(verdict "$ratio_tcp" '>=' 1.2)"
printf '%-52s %8s  goal %-7s %s\n' "libddp shm exposed comm / allreduce alone" "${es:--}" \
  "<= 0.25" "$(verdict "$es" '<=' 0.25)"
printf '%-52s %8s  goal %-7s %s\n' "libddp tcp exposed comm / allreduce alone" "${ec:--}" \
  "<= 0.25" "$(verdict "$ec" '<=' 0.25)"

# How low the exposed part can go (ddp-bench-ddp.c's header): the last tensor's allreduce
# follows backward under any bucketing, and with every CPU busy with a rank's compute the
# reduction's CPU work (extra_cpu) cannot be hidden either.
echo
echo "## exposed communication / allreduce alone, and its lower bounds"
printf '%-8s %9s %22s %22s %26s\n' "" "exposed" "last bucket (layout)" "last tensor (any)" \
  "extra CPU (all CPUs busy)"
for s in torch shm tcp; do
  f=${res[$s]:-/dev/null}
  ar=$(get "$f" allreduce_p50_ms); xc=$(get "$f" extra_cpu_ms)
  cpu_bound="-"
  [ -n "$ar" ] && [ -n "$xc" ] && cpu_bound=$(calc "$xc / $ar")
  printf '%-8s %9s %22s %22s %26s\n' "$s" "$(get "$f" exposed_ratio)" \
    "$(get "$f" floor_bucket_ratio)" "$(get "$f" floor_tensor_ratio)" "$cpu_bound"
done
echo "# extra CPU binds when the ranks fill every CPU: $(getconf _NPROCESSORS_ONLN) CPUs here," \
     "2 ranks, nosync_busy above"

echo
echo "## part 2: comm hooks, libddp tcp"
psgd1='{"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}'
psgd4='{"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}'
hooks=("no|no|" "fp16|no|" "bf16|no|" "power_sgd|no|$psgd1" "power_sgd|no|$psgd4"
       "batched_power_sgd|no|$psgd1" "power_sgd|fp16|$psgd1")
labels=("no hook" "fp16" "bf16" "power_sgd r1" "power_sgd r4" "batched_power_sgd r1"
        "fp16 wrapper(power_sgd r1)")
for r in $(seq 1 "$rounds"); do
  for i in "${!hooks[@]}"; do
    IFS='|' read -r h w st <<<"${hooks[$i]}"
    args=(--hook "$h" --wrapper "$w")
    [ -n "$st" ] && args+=(--state "$st")
    t0=$(date +%s)
    run "hook$i.r$r" "$ddprun" --nproc_per_node 2 --backend tcp "$tool" "${counts[@]}" \
      --pairs 0 --ar-iters 0 "${args[@]}"
  done
done
echo
for i in "${!hooks[@]}"; do res[hook$i]=$(best "hook$i"); done
base_b=$(get "${res[hook0]:-/dev/null}" bytes_per_step)
base_s=$(get "${res[hook0]:-/dev/null}" steps_per_s)
printf '%-28s %14s %10s %9s %10s %10s  %s\n' "hook" "bytes/step" "vs no" "rate" "steps/s" "vs no" \
  "rounds (steps/s)"
for i in "${!hooks[@]}"; do
  f=${res[hook$i]:-/dev/null}
  b=$(get "$f" bytes_per_step); s=$(get "$f" steps_per_s); rt=$(get "$f" rate)
  rb=""; rs=""
  [ -n "$b" ] && [ -n "$base_b" ] && rb=$(calc "$b / $base_b")
  [ -n "$s" ] && [ -n "$base_s" ] && rs=$(calc "$s / $base_s")
  printf '%-28s %14s %10s %9s %10s %10s  %s\n' "${labels[$i]}" "${b:--}" "${rb:--}" "${rt:--}" \
    "${s:--}" "${rs:--}" "$(for g in "$out/hook$i".r*.res; do get "$g" steps_per_s; done | paste -sd/)"
done
echo
echo "# bytes/step: payload bytes this rank handed to allreduces in one synchronised step"
echo "# (ddp_ddp_get_comm_stats); rate: numel before / after compression, cumulative."
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg); total $(( $(date +%s) - start )) s"
exit $failed
