#!/bin/bash
# bench_zero.sh: what ZeRO-1/2/3 save in memory and cost in time against DDP, through ddp-train
# (docs/benchmarks.md, "Sharding"; docs/sharding.md; issue 39's "Memory, in a benchmark").
# A benchmark, not a test: it prints figures and verdicts.
#
#   tools/bench/bench_zero.sh [-B BUILD_DIR] [-o OUT_DIR] [-r ROUNDS] [-s STEPS] [-p a|b|ab]
#                             [-m "MODE ..."]
#
# Modes: DDP, ZeRO-1 and ZeRO-2 (--deepspeed with zero_optimization.stage 1 and 2) and ZeRO-3
# (--fsdp "full_shard auto_wrap"), ranks as processes (ddprun --backend shm), AdamW
# (adamw_torch) with weight decay 0.1 and clipping at 1.0, one BLAS thread per rank.
# Part a: GPT-2 124M (n_layer 12, n_embd 768, n_head 12, vocab 50257, n_positions 1024),
# W = 4, batch 1 x 32 tokens per rank, 2 steps (every byte of state exists after the first):
# the peak resident set of each rank (metrics.jsonl peak_rss_mb, getrusage ru_maxrss), its
# largest over the ranks against DDP's (goals: ZeRO-3 <= 0.45, ZeRO-2 <= 0.7, ZeRO-1 <= 0.8),
# and the state bytes (param_bytes + grad_bytes + optim_bytes) summed over the ranks against
# W times the formula (DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/W, ZeRO-2 4Ψ + 12Ψ/W, ZeRO-3 16Ψ/W), which
# must be equal. Needs about 12 GB free (DDP: 4 x ~2.8 GB); the script checks first.
# Part b: W = 2, step time (metrics.jsonl step_time_ms, the mean of the last STEPS steps
# after as many warm-up steps) on the benchmark MLP (784-1024-1024-1024-10, ReLU, batch 64
# per rank of 784-feature 10-class data made here) and a GPT-2 10M (n_layer 4, n_embd 384,
# n_head 6, vocab 8192, n_positions 128, batch 4 x 64 tokens per rank); the modes run
# interleaved in each of ROUNDS rounds (default 3); each mode's best round against DDP's
# (goals: ZeRO-1, ZeRO-2 <= 1.1, ZeRO-3 <= 1.5), every round's figure shown. Also the bytes
# each rank sent in the step (metrics.jsonl sent_bytes, the flight recorder's count) against
# DDP's. Part b also runs ZeRO-1 with --zero_parameters_as_bucket_view (zero1bv: one broadcast
# per rank instead of one per parameter) and with --zero_comm_hook hook_with_zero_step
# (zero1hk: the step inside DDP's comm hook; it cannot clip and needs
# --ddp_find_unused_parameters false, so it runs without clipping and with that flag, and its
# first 2 steps update nothing: the warm-up steps cover them). -m runs only those part-b
# modes (ddp zero1 zero1bv zero1hk zero2 zero3; ddp is added when absent, every ratio
# is against it). STEPS defaults to 5. Runs and
# outputs go to OUT_DIR (default a fresh
# /tmp/bench-zero.XXXXXX).
# Exit status: 0 when every run finished (whatever the verdicts), 1 when one failed,
# 2 on bad usage or too little free memory for part a.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build"
out=""
rounds=3
steps=5
parts=ab
bmodes=(ddp zero1 zero1bv zero1hk zero2 zero3)
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -B|-o|-r|-s|-p|-m)
      [ $# -ge 2 ] || { echo "bench_zero.sh: $1 needs a value (try --help)" >&2; exit 2; }
      case "$1" in
        -B) build=$2 ;; -o) out=$2 ;; -r) rounds=$2 ;; -s) steps=$2 ;; -p) parts=$2 ;;
        -m) read -r -a bmodes <<<"$2"
            for m in "${bmodes[@]}"; do
              case $m in ddp|zero1|zero1bv|zero1hk|zero2|zero3) ;;
                *) echo "bench_zero.sh: -m: unknown mode '$m'" >&2; exit 2 ;; esac
            done
            [[ " ${bmodes[*]} " == *" ddp "* ]] || bmodes=(ddp "${bmodes[@]}") ;;
      esac
      shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench_zero.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in "$rounds" "$steps"; do
  case "$v" in ''|*[!0-9]*|0) echo "bench_zero.sh: -r and -s take positive integers" >&2
                                exit 2 ;; esac
done
case "$parts" in a|b|ab|ba) ;; *) echo "bench_zero.sh: -p takes a, b or ab" >&2; exit 2 ;; esac
train="$build/tools/ddp-train"
ddprun="$build/tools/ddprun"
for f in "$train" "$ddprun"; do
  [ -x "$f" ] || { echo "bench_zero.sh: $f not found; build first (ninja -C $build)" >&2; exit 2; }
done
if [[ "$parts" == *a* ]]; then
  avail=$(awk '/^MemAvailable:/ { print int($2 / 1048576) }' /proc/meminfo)
  [ "${avail:-0}" -ge 12 ] || {
    echo "bench_zero.sh: part a needs about 12 GB of free memory, $avail GB available" \
         "(run -p b alone)" >&2
    exit 2
  }
fi
[ -n "$out" ] || out=$(mktemp -d /tmp/bench-zero.XXXXXX)
mkdir -p "$out" || exit 2
failed=0
export DDP_BLAS_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

gpt2_config() { # file n_layer n_embd n_head vocab n_positions
  printf '{"model_type": "gpt2", "n_layer": %s, "n_embd": %s, "n_head": %s, "vocab_size": %s,
 "n_positions": %s, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}\n' \
    "$2" "$3" "$4" "$5" "$6" >"$1"
}
gpt2_config "$out/gpt2-124m.json" 12 768 12 50257 1024
gpt2_config "$out/gpt2-10m.json" 4 384 6 8192 128
echo '{"zero_optimization": {"stage": 1}}' >"$out/ds1.json"
echo '{"zero_optimization": {"stage": 2}}' >"$out/ds2.json"
printf '{"dtype": "f32", "layers": [%s]}\n' \
  '{"type": "linear", "in": 784, "out": 1024}, {"type": "relu"},
   {"type": "linear", "in": 1024, "out": 1024}, {"type": "relu"},
   {"type": "linear", "in": 1024, "out": 1024}, {"type": "relu"},
   {"type": "linear", "in": 1024, "out": 10}' >"$out/mlp.json"
# Digits-like data for the MLP: 4096 samples of 784 features in [0, 1), 10 classes, each
# class a brighter band of pixels (a fixed LCG, so every run trains on the same bytes).
awk -v out="$out/mlp.csv" 'BEGIN {
  s = 12345; hdr = "label"; for (j = 0; j < 784; j++) hdr = hdr ",f" j; print hdr > out
  for (i = 0; i < 4096; i++) {
    c = i % 10; line = c
    for (j = 0; j < 784; j++) {
      s = (s * 1103515245 + 12345) % 2147483648; v = s / 2147483648
      if (int(j / 78.4) == c) v = 0.5 + v / 2; else v = v / 4
      line = line "," sprintf("%.3f", v)
    }
    print line > out
  } }'

modes=(ddp zero1 zero2 zero3)
mode_args() { # mode [mlp] -> ddp-train's switches in the array margs (ZeRO-3 on the MLP:
               # its Linear layers as units by size, as FSDP's size_based_auto_wrap_policy)
  margs=()
  case "$1" in
    zero1) margs=(--deepspeed "$out/ds1.json") ;;
    zero1bv) margs=(--deepspeed "$out/ds1.json" --zero_parameters_as_bucket_view true) ;;
    zero1hk) margs=(--deepspeed "$out/ds1.json" --zero_comm_hook hook_with_zero_step
                    --max_grad_norm 0 --ddp_find_unused_parameters false) ;;
    zero2) margs=(--deepspeed "$out/ds2.json") ;;
    zero3) margs=(--fsdp "full_shard auto_wrap")
           [ "${2:-}" = mlp ] && margs+=(--fsdp_config '{"min_num_params": 100000}') ;;
  esac
}
common=(--optim adamw_torch --weight_decay 0.1 --max_grad_norm 1.0 --save_strategy no
        --eval_strategy no --seed 1)
# train NAME W STEPS LOG_EVERY ARGS...: ddp-train under ddprun; its metrics.jsonl's last line
# with sharding goes to $out/NAME.res as key=value pairs (bench_lib's RESULT format)
train_run() {
  local name=$1 w=$2 n=$3 every=$4 t0 rc
  shift 4
  t0=$(date +%s)
  timeout -k 10 "$bench_timeout" "$ddprun" --nproc_per_node "$w" --backend shm --standalone \
    "$train" "${common[@]}" --max_steps "$n" --logging_steps "$every" --output_dir "$out/$name" \
    "$@" >"$out/$name.txt" 2>&1
  rc=$?
  [ -f "$out/$name/metrics.jsonl" ] &&
    grep '"sharding"' "$out/$name/metrics.jsonl" | tail -1 | /usr/bin/env python3 -c '
import json, sys
line = sys.stdin.read()
if line:
    m = json.loads(line)
    print("RESULT " + " ".join("%s=%s" % (k, ",".join(map(str, v)) if isinstance(v, list) else v)
                               for k, v in m.items()))' >>"$out/$name.txt"
  collect "$name" "$rc" "$t0"
}
maxof() { tr , '\n' <<<"$1" | sort -g | tail -1; }
sumof() { tr , '\n' <<<"$1" | awk '{ s += $1 } END { printf "%.0f", s }'; }

echo "# bench_zero: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "# libddp git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown);" \
     "$(getconf _NPROCESSORS_ONLN) CPUs; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //');" \
     "$(awk '/^MemTotal:/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
echo "# $rounds rounds; outputs in $out"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew every figure)"
start=$(date +%s)
bench_timeout=1200 bench_name_w=22 bench_secs_w=4
. "$here/bench_lib.sh"

if [[ "$parts" == *a* ]]; then
  echo
  echo "## part a: GPT-2 124M, W = 4 processes (shm), batch 1 x 32 per rank, 2 steps, AdamW"
  for m in "${modes[@]}"; do
    mode_args "$m"
    train_run "a-$m" 4 2 2 --model "$out/gpt2-124m.json" \
      --data "$repo/tests/data/kjv_genesis_exodus.txt" --block_size 32 \
      --per_device_train_batch_size 1 "${margs[@]}"
  done
  psi=$(( $(get "$out/a-ddp.res" param_bytes | cut -d, -f1) / 4 ))
  echo
  echo "Ψ = $psi parameters, W = 4; state bytes summed over the ranks against W x the formula"
  printf '%-6s %-22s %14s %14s %6s  %-28s %7s  %s\n' mode formula "state (sum)" "W x formula" \
    equal "peak RSS MB per rank" "max/DDP" "goal"
  ddp_rss=$(maxof "$(get "$out/a-ddp.res" peak_rss_mb)")
  for m in "${modes[@]}"; do
    f="$out/a-$m.res"
    case $m in
      ddp) form="16Ψ"; want=$((4 * 16 * psi)); goal="" ;;
      zero1) form="8Ψ + 8Ψ/W"; want=$((4 * 8 * psi + 8 * psi)); goal=0.8 ;;
      zero2) form="4Ψ + 12Ψ/W"; want=$((4 * 4 * psi + 12 * psi)); goal=0.7 ;;
      zero3) form="16Ψ/W"; want=$((16 * psi)); goal=0.45 ;;
    esac
    have=$(sumof "$(get "$f" state_bytes)")
    eq=no; [ "$have" = "$want" ] && eq=yes
    rss=$(get "$f" peak_rss_mb)
    ratio=""; [ -n "$rss" ] && [ -n "$ddp_rss" ] && ratio=$(calc "$(maxof "$rss") / $ddp_rss")
    v=""; [ -n "$goal" ] && v="<= $goal $(verdict "$ratio" '<=' "$goal")"
    printf '%-6s %-22s %14s %14s %6s  %-28s %7s  %s\n' "$m" "$form" "${have:--}" "$want" "$eq" \
      "${rss:--}" "${ratio:--}" "$v"
  done
fi

if [[ "$parts" == *b* ]]; then
  echo
  echo "## part b: W = 2 processes (shm), step time, the mean of $steps steps after $steps" \
       "warm-up steps; rounds interleaved"
  for r in $(seq 1 "$rounds"); do
    for m in "${bmodes[@]}"; do
      mode_args "$m" mlp
      train_run "mlp-$m.r$r" 2 $((2 * steps)) "$steps" --model "$out/mlp.json" \
        --data "$out/mlp.csv" --per_device_train_batch_size 64 --learning_rate 1e-3 \
        "${margs[@]}"
      mode_args "$m"
      train_run "gpt-$m.r$r" 2 $((2 * steps)) "$steps" --model "$out/gpt2-10m.json" \
        --data "$repo/tests/data/kjv_genesis_exodus.txt" --block_size 64 \
        --per_device_train_batch_size 4 "${margs[@]}"
    done
  done
  echo
  printf '%-10s %-7s %12s %8s  %-13s %-24s %12s %8s\n' model mode "best ms" ratio goal \
    "ms per round" "sent B/step" "/DDP's"
  for model in mlp gpt; do
    dbest=$(best step_time_ms min "$out/$model-ddp".r*.res)
    dms=$(get "${dbest:-/dev/null}" step_time_ms)
    dsent=$(get "${dbest:-/dev/null}" sent_bytes | cut -d, -f1)
    for m in "${bmodes[@]}"; do
      fb=$(best step_time_ms min "$out/$model-$m".r*.res)
      ms=$(get "${fb:-/dev/null}" step_time_ms)
      per=$(for f in "$out/$model-$m".r*.res; do
              v=$(get "$f" step_time_ms); printf '%.1f\n' "${v:-0}"; done | paste -sd/)
      sent=$(get "${fb:-/dev/null}" sent_bytes | cut -d, -f1)
      ratio=""; [ -n "$ms" ] && [ -n "$dms" ] && ratio=$(calc "$ms / $dms")
      srat=""; [ -n "$sent" ] && [ -n "$dsent" ] && srat=$(calc "$sent / $dsent")
      case $m in ddp) goal="" ;; zero3) goal=1.5 ;; *) goal=1.1 ;; esac
      v=""; [ -n "$goal" ] && v="<= $goal $(verdict "$ratio" '<=' "$goal")"
      printf '%-10s %-7s %12s %8s  %-13s %-24s %12s %8s\n' \
        "$([ $model = mlp ] && echo MLP || echo GPT-2-10M)" "$m" "$(printf '%.1f' "${ms:-0}")" \
        "${ratio:--}" "$v" "$per" "${sent:--}" "${srat:--}"
    done
  done
fi
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg); total $(( $(date +%s) - start )) s"
exit $failed
