#!/bin/bash
# bench_ddp.sh: libddp's DDP training step beside PyTorch DDP (gloo), and the comm hooks,
# on this machine, in one go (docs/benchmarks.md, "DDP steps").
#
#   tools/bench/bench_ddp.sh [-B BUILD_DIR] [-o OUT_DIR] [-s STEPS] [-r ROUNDS] [-b BATCH] [-n RATE]
#                      [-c BUCKET_CAP_MB]
#
# Setup: 2 ranks as 2 processes, each with one BLAS/OpenMP thread, the MLP
# 784-1024-1024-1024-10, SGD, batch BATCH (64) per rank, a fixed random batch.
# Part 1, ROUNDS (3) rounds of, in this order: PyTorch DDP over gloo
# (tools/bench/peer_torch_ddp.py with /usr/bin/python3), libddp on shm, libddp on tcp
# (ddp-bench-ddp under ddprun). Each run measures steps/s over STEPS (30) consecutive
# steps, p50 of STEPS barrier-aligned synced and no_sync steps, and p50 of the
# whole-gradient allreduce alone; per system the round with the highest steps/s is kept.
# Prints the side-by-side table and the goals of the DDP issue with PASS/FAIL:
#   libddp shm steps/s / PyTorch steps/s >= 1.5;  libddp tcp / PyTorch >= 1.2;
#   exposed communication (synced p50 - no_sync p50) / allreduce-alone p50 <= 0.25;
# then that exposed ratio beside its lower bounds: the allreduce alone of the last bucket
# and of the last gradient tensor to become ready (no bucketing splits a tensor), and the
# reduction's extra CPU time per step, which nothing hides when the ranks fill every CPU.
# Part 1b, one run each of PyTorch, libddp shm and libddp tcp without and with
# gradient_as_bucket_view: peak RSS per rank (rank 0), libddp <= PyTorch with PASS/FAIL.
# Part 2, libddp on tcp, one run per comm hook (no, fp16, bf16, power_sgd rank 1 and 4,
# batched_power_sgd rank 1, fp16 wrapper around power_sgd rank 1; PowerSGD with
# start_powerSGD_iter=2 so the timed steps compress), ROUNDS rounds, the best kept:
# payload bytes per step and steps/s.
# Part 3, only with -n RATE (e.g. 4gbit; needs root): PyTorch and libddp tcp with one rank
# in each of two network namespaces joined by a veth pair shaped to RATE, ROUNDS rounds:
# the table and the lower bounds of part 1 for a link where the wire sets the pace, then
# the goals libddp / PyTorch >= 1.5 and libddp / (1 / max(compute, wire)) >= 0.8 with
# PASS/FAIL (net_goals below says how the bound is computed), and the same 0.8 against
# the bound DDP's schedule allows (tools/bench/ddp_schedule.py on libddp's trace, sched_goals).
# Exit status: 0 when every run finished (whatever the ratios), 1 otherwise, 2 usage.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build"
out=""
steps=30
rounds=3
batch=64
rate=""
cap=""
while [ $# -gt 0 ]; do
  case "$1" in
    -B|-o|-s|-r|-b|-n|-c)
      [ $# -ge 2 ] || { echo "bench_ddp.sh: $1 needs a value" >&2; exit 2; }
      case "$1" in
        -B) build=$2 ;; -o) out=$2 ;; -s) steps=$2 ;; -r) rounds=$2 ;; -b) batch=$2 ;;
        -n) rate=$2 ;; -c) cap=$2 ;;
      esac
      shift 2 ;;
    -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_ddp.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in "$steps" "$rounds" "$batch"; do
  case "$v" in ''|*[!0-9]*|0) echo "bench_ddp.sh: -s, -r and -b take positive integers" >&2
                                exit 2 ;; esac
done
rate_bits=""
if [ -n "$rate" ]; then # tc's syntax, limited to Mbit/s and Gbit/s: 500mbit, 4gbit
  case "$rate" in
    *[0-9]mbit) rate_bits=$(( ${rate%mbit} * 1000000 )) ;;
    *[0-9]gbit) rate_bits=$(( ${rate%gbit} * 1000000000 )) ;;
  esac
  case "${rate%?bit}" in ''|*[!0-9]*|0) rate_bits="" ;; esac
  if [ -z "$rate_bits" ]; then
    echo "bench_ddp.sh: -n takes a rate like 500mbit or 4gbit, got '$rate'" >&2
    exit 2
  fi
fi
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
# -c CAP: DDP's bucket_cap_mb for both sides (PyTorch keeps its fixed 1 MiB first bucket;
# libddp then uses CAP for every bucket, the rule of an explicit cap)
[ -n "$cap" ] && counts+=(--bucket-cap-mb "$cap")

echo "# bench_ddp: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "# libddp git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown);" \
     "$(getconf _NPROCESSORS_ONLN) CPUs; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "# 2 ranks x 1 thread, MLP 784-1024-1024-1024-10, batch $batch per rank, SGD;" \
     "$steps timed steps per phase, $rounds rounds; outputs in $out"
echo "# OpenBLAS kernels for both: $OPENBLAS_CORETYPE"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew every figure)"
start=$(date +%s)

bench_timeout=300 bench_name_w=22 bench_secs_w=3
. "$here/bench_lib.sh"
run_hosts() { # name, then the command run on both hosts of part 3 at once, with @R@ the
              # host's index; host 0's output is $out/<name>.txt, host 1's <name>.h1.txt
  local name=$1 i rc=0 r pids=() t0
  shift
  t0=$(date +%s)
  for i in 0 1; do
    timeout -k 10 300 ip netns exec "${hosts[$i]}" "${@//@R@/$i}" \
      >"$out/$name$([ "$i" = 1 ] && echo .h1).txt" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}"; r=$?
    [ "$rc" -ne 0 ] || rc=$r
  done
  collect "$name" "$rc" "$t0"
}
echo
echo "## part 1: steps/s and exposed communication"
for r in $(seq 1 "$rounds"); do
  if [ -x "$py" ]; then
    run "torch.r$r" "$py" "$here/peer_torch_ddp.py" --world 2 "${counts[@]}" --pairs "$steps" \
      --ar-iters "$steps"
  else
    echo "## torch: $py missing, PyTorch peer skipped"
  fi
  for be in shm tcp; do
    run "$be.r$r" "$ddprun" --nproc_per_node 2 --backend "$be" "$tool" "${counts[@]}" \
      --pairs "$steps" --ar-iters "$steps"
  done
done

declare -A res
# The side-by-side table of the best rounds of the systems given (names of .res files).
table() {
  local k s f
  echo
  printf '%-28s' ""
  for s in "$@"; do printf ' %20s' "$s"; done
  echo
  for k in steps_per_s step_p50_ms sync_p50_ms nosync_p50_ms exposed_ms allreduce_p50_ms \
           exposed_ratio sync_cpu_ms nosync_cpu_ms extra_cpu_ms nosync_busy cpus \
           allreduce_last_bucket_p50_ms floor_bucket_ratio allreduce_last_tensor_p50_ms \
           floor_tensor_ratio; do
    printf '%-28s' "$k"
    for s in "$@"; do printf ' %20s' "$(get "${res[$s]:-/dev/null}" "$k")"; done
    echo
  done
  printf '%-28s' "rounds (steps/s)"
  for s in "$@"; do
    printf ' %20s' "$(for f in "$out/$s".r*.res; do get "$f" steps_per_s; done | paste -sd/)"
  done
  echo
}
# How low the exposed part can go (ddp-bench-ddp.c's header): the last tensor's allreduce
# follows backward under any bucketing, and when the ranks fill every CPU the reduction's
# CPU work (extra_cpu) cannot be hidden either.
floors() {
  local s f ar xc cpu_bound
  echo
  echo "## exposed communication / allreduce alone, and its lower bounds"
  printf '%-10s %9s %22s %22s %26s\n' "" "exposed" "last bucket (layout)" \
    "last tensor (any)" "extra CPU (all CPUs busy)"
  for s in "$@"; do
    f=${res[$s]:-/dev/null}
    ar=$(get "$f" allreduce_p50_ms); xc=$(get "$f" extra_cpu_ms)
    cpu_bound="-"
    [ -n "$ar" ] && [ -n "$xc" ] && cpu_bound=$(calc "$xc / $ar")
    printf '%-10s %9s %22s %22s %26s\n' "$s" "$(get "$f" exposed_ratio)" \
      "$(get "$f" floor_bucket_ratio)" "$(get "$f" floor_tensor_ratio)" "$cpu_bound"
  done
  echo "# extra CPU binds when the ranks fill every CPU: $(getconf _NPROCESSORS_ONLN) CPUs" \
       "here, 2 ranks, nosync_busy above"
}
for s in torch shm tcp; do res[$s]=$(best steps_per_s max "$out/$s".r*.res); done
table torch shm tcp

tq=$(get "${res[torch]:-/dev/null}" steps_per_s)
sq=$(get "${res[shm]:-/dev/null}" steps_per_s)
cq=$(get "${res[tcp]:-/dev/null}" steps_per_s)
ratio_shm=""; ratio_tcp=""
[ -n "$tq" ] && [ -n "$sq" ] && ratio_shm=$(calc "$sq / $tq")
[ -n "$tq" ] && [ -n "$cq" ] && ratio_tcp=$(calc "$cq / $tq")
es=$(get "${res[shm]:-/dev/null}" exposed_ratio)
ec=$(get "${res[tcp]:-/dev/null}" exposed_ratio)
goal_line() { # label value op goal: one line with PASS/FAIL (verdict)
  printf '%-56s %8s   goal %-7s %s\n' "$1" "${2:--}" "$3 $4" "$(verdict "$2" "$3" "$4")"
}
echo
echo "## goals (DDP issue)"
goal_line "libddp shm steps/s / PyTorch gloo steps/s" "$ratio_shm" ">=" 1.5
goal_line "libddp tcp steps/s / PyTorch gloo steps/s" "$ratio_tcp" ">=" 1.2
goal_line "libddp shm exposed comm / allreduce alone" "$es" "<=" 0.25
goal_line "libddp tcp exposed comm / allreduce alone" "$ec" "<=" 0.25

floors torch shm tcp

# Part 1b: memory. Peak RSS per rank (getrusage's ru_maxrss at the end of the run, rank 0)
# of the same DDP step, with and without gradient_as_bucket_view, one run each.
echo
echo "## part 1b: peak RSS per rank (MB), without and with gradient_as_bucket_view"
for gv in no yes; do
  gflag=(); [ "$gv" = yes ] && gflag=(--grad-as-bucket-view)
  [ -x "$py" ] && run "torch-mem-$gv" "$py" "$here/peer_torch_ddp.py" --world 2 "${counts[@]}"     --pairs 0 --ar-iters 0 "${gflag[@]}"
  for be in shm tcp; do
    run "$be-mem-$gv" "$ddprun" --nproc_per_node 2 --backend "$be" "$tool" "${counts[@]}"       --pairs 0 --ar-iters 0 "${gflag[@]}"
  done
done
printf '%-26s %10s %10s %10s   %s\n' "gradient_as_bucket_view" "torch" "shm" "tcp"   "goal: libddp <= PyTorch"
for gv in no yes; do
  t=$(get "$out/torch-mem-$gv.res" peak_rss_mb)
  s=$(get "$out/shm-mem-$gv.res" peak_rss_mb)
  c=$(get "$out/tcp-mem-$gv.res" peak_rss_mb)
  v="-"
  if [ -n "$t" ] && [ -n "$s" ] && [ -n "$c" ]; then
    v="shm $(verdict "$(calc "$s / $t")" '<=' 1), tcp $(verdict "$(calc "$c / $t")" '<=' 1)"
  fi
  printf '%-26s %10s %10s %10s   %s\n' "$gv" "${t:--}" "${s:--}" "${c:--}" "$v"
done

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
    run "hook$i.r$r" "$ddprun" --nproc_per_node 2 --backend tcp "$tool" "${counts[@]}" \
      --pairs 0 --ar-iters 0 "${args[@]}"
  done
done
echo
for i in "${!hooks[@]}"; do res[hook$i]=$(best steps_per_s max "$out/hook$i".r*.res); done
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
    "${s:--}" "${rs:--}" \
    "$(for g in "$out/hook$i".r*.res; do get "$g" steps_per_s; done | paste -sd/)"
done
echo
echo "# bytes/step: payload bytes this rank handed to allreduces in one synchronised step"
echo "# (ddp_ddp_get_comm_stats); rate: numel before / after compression, cumulative."

# Part 3: two hosts, each a network namespace with one rank, joined by a veth pair whose
# two ends tbf shapes to RATE (a burst of 1 ms at RATE, at least 64 KiB, and 50 ms of
# queue; a longer burst lets a whole bucket through unshaped). Over such a link the wire
# sets the allreduce's time, as between real hosts, while the CPU still pays for TCP.
hosts=("ddpbench-$$-h0" "ddpbench-$$-h1")
netns_cleanup() {
  local ns pid
  for ns in "${hosts[@]}"; do
    ip netns list 2>/dev/null | grep -qx "$ns\( .*\)\?" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}
netns_setup() { # on failure: status 1 and the reason in $why
  local i burst=$(( rate_bits / 8 / 1000 ))
  [ "$burst" -ge 65536 ] || burst=65536
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    why="no ip or tc (iproute2)"
    return 1
  fi
  why=$(ip netns add "${hosts[0]}" 2>&1) ||
    { why="cannot create a network namespace ($why): this part needs root"; return 1; }
  trap netns_cleanup EXIT
  trap 'exit 130' INT TERM
  why=$( { ip netns add "${hosts[1]}" &&
           ip link add eth0 netns "${hosts[0]}" type veth peer name eth0 \
             netns "${hosts[1]}"; } 2>&1) || return 1
  for i in 0 1; do
    why=$( { ip -n "${hosts[$i]}" link set lo up &&
             ip -n "${hosts[$i]}" addr add "10.232.0.$((i + 1))/24" dev eth0 &&
             ip -n "${hosts[$i]}" link set eth0 up &&
             ip netns exec "${hosts[$i]}" tc qdisc add dev eth0 root tbf rate "$rate" \
               burst "$burst" latency 50ms; } 2>&1) || return 1
  done
}
# The goals of part 3 (the performance issue): libddp tcp / PyTorch >= 1.5, and libddp at
# >= 0.8 of the bound 1 / max(compute, wire). compute: libddp's no_sync step p50 (forward
# and backward, no communication); wire: the bytes each rank sends per synchronised step
# (bytes_per_step x 2(W-1)/W, what ring and canonical send) at RATE. Beside it, for
# information, the bound with the CPU the step's communication costs (extra_cpu_ms: TCP's
# copies and the reduction), which nothing hides when the ranks fill every CPU.
net_goals() { # torch-name libddp-name
  local t=${res[$1]:-/dev/null} f=${res[$2]:-/dev/null} ts fs comp xc bytes w wire bound cbound
  ts=$(get "$t" steps_per_s); fs=$(get "$f" steps_per_s); comp=$(get "$f" nosync_p50_ms)
  xc=$(get "$f" extra_cpu_ms); bytes=$(get "$f" bytes_per_step); w=$(get "$f" world)
  echo
  echo "## part 3 goals ($rate)"
  if [ -z "$fs" ] || [ -z "$comp" ] || [ -z "$bytes" ] || [ -z "$w" ]; then
    echo "# no libddp result: goals not evaluated"
    return
  fi
  wire=$(calc "$bytes * 2 * ($w - 1) / $w * 8 / $rate_bits * 1000")
  bound=$(calc "1000 / ($comp > $wire ? $comp : $wire)")
  cbound=$(calc "1000 / ($comp + $xc > $wire ? $comp + $xc : $wire)")
  if [ -n "$ts" ]; then
    goal_line "libddp tcp steps/s / PyTorch gloo steps/s" "$(calc "$fs / $ts")" ">=" 1.5
  fi
  printf '%-56s %8s   (compute %s ms = libddp no_sync p50, wire %s ms = %s B x 2(W-1)/W at %s)\n' \
    "bound 1 / max(compute, wire), steps/s" "$bound" "$comp" "$wire" "$bytes" "$rate"
  goal_line "libddp tcp steps/s / bound" "$(calc "$fs / $bound")" ">=" 0.8
  printf '%-56s %8s   (extra CPU %s ms per synchronised step; informative)\n' \
    "bound 1 / max(compute + extra CPU, wire), steps/s" "$cbound" "$xc"
  printf '%-56s %8s\n' "libddp tcp steps/s / that bound" "$(calc "$fs / $cbound")"
  sched_goals "$fs" "$ts" "$comp" "$xc" "$w" "${f%.res}.trace.json"
}
# The bound above assumes that all of compute can overlap the wire, but DDP sends a
# gradient only once backward has produced it and starts the next forward only when every
# average is in. tools/bench/ddp_schedule.py replays the trace of libddp's best round: the
# buckets ready when they were (as a fraction of backward), crossing the link one after
# the other at RATE; tail = the part of that which ends after backward. The schedule
# bound 1 / (compute + tail) is the fastest step this bucket layout allows on a perfect
# link and idle CPUs; its ratio to PyTorch's steps/s is the most any DDP can gain here.
sched_goals() { # libddp-steps/s torch-steps/s compute extra-cpu world trace
  local fs=$1 ts=$2 comp=$3 xc=$4 w=$5 trace=$6 sf="${6%.trace.json}.schedule" tail first sbound
  if ! "$py" "$here/ddp_schedule.py" "$trace" --rate "$rate_bits" --world "$w" >"$sf" 2>&1; then
    echo "# schedule bound not evaluated: $(cat "$sf")"
    return
  fi
  tail=$(get "$sf" tail_ms); first=$(get "$sf" first_ready_ms)
  sbound=$(calc "1000 / ($comp + $tail)")
  printf '%-56s %8s   (tail %s ms after backward: first bucket ready at %s ms, last bucket %s ms on the wire)\n' \
    "schedule bound 1 / (compute + tail), steps/s" "$sbound" "$tail" "$first" \
    "$(get "$sf" last_wire_ms)"
  goal_line "libddp tcp steps/s / schedule bound" "$(calc "$fs / $sbound")" ">=" 0.8
  [ -n "$ts" ] && printf '%-56s %8s   (schedule bound / PyTorch steps/s)\n' \
    "the most libddp / PyTorch this schedule allows" "$(calc "$sbound / $ts")"
  printf '%-56s %8s   (1 / (compute + max(tail, extra CPU)); informative)\n' \
    "schedule bound with the extra CPU, steps/s" \
    "$(calc "1000 / ($comp + ($tail > $xc ? $tail : $xc))")"
}
if [ -n "$rate" ]; then
  echo
  echo "## part 3: 2 hosts (network namespaces, 1 rank each) over a link shaped to $rate"
  if ! netns_setup; then
    echo "## part 3 skipped: $why"
  else
    export DDP_JOB_TOKEN
    DDP_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    port=29580
    for r in $(seq 1 "$rounds"); do
      port=$((port + 1))
      if [ -x "$py" ]; then
        run_hosts "torch-net.r$r" env RANK=@R@ WORLD_SIZE=2 MASTER_ADDR=10.232.0.1 \
          MASTER_PORT="$port" GLOO_SOCKET_IFNAME=eth0 "$py" "$here/peer_torch_ddp.py" \
          --world 2 "${counts[@]}" --pairs "$steps" --ar-iters "$steps"
      fi
      port=$((port + 1))
      run_hosts "tcp-net.r$r" env GLOO_SOCKET_IFNAME=eth0 "$ddprun" --nnodes 2 --node_rank @R@ \
        --nproc_per_node 1 --master_addr 10.232.0.1 --master_port "$port" --backend tcp \
        "$tool" "${counts[@]}" --pairs "$steps" --ar-iters "$steps" \
        --trace "$out/tcp-net.r$r.trace.json"
    done
    for s in torch-net tcp-net; do res[$s]=$(best steps_per_s max "$out/$s".r*.res); done
    table torch-net tcp-net
    floors torch-net tcp-net
    net_goals torch-net tcp-net
    netns_cleanup
  fi
fi
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg); total $(( $(date +%s) - start )) s"
exit $failed
