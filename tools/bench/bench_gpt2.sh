#!/bin/bash
# bench_gpt2.sh: libddp against PyTorch 1.13 on GPT-2 training steps (docs/benchmarks.md,
# "GPT-2"; issue 13's speed point). A benchmark, not a test: it prints figures and verdicts.
#
#   tools/bench/bench_gpt2.sh [-B BUILD_DIR] [-o OUT_DIR] [-r ROUNDS] [-s STEPS] [-S DDP_STEPS]
#                       [-p a|b|ab]
#
# Part a: GPT-2 124M (n_layer 12, n_embd 768, n_head 12, vocab 50257, n_positions 1024,
# dropout 0 on both sides), batch 4 x 64 tokens, one process and one thread, a step being
# zero_grad, forward, causal-LM loss, backward and AdamW (PyTorch's defaults): libddp's
# ddp-bench-ddp --model without a launcher against tools/bench/peer_torch_ddp.py --world 1
# (tools/torch/hf_models.py's GPT2LMHeadModel), Debian's /usr/bin/python3. Each system runs with
# two OpenBLAS kernel settings: the environment's OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as
# they are, and both unset (OpenBLAS picks for the CPU itself); the best is reported.
# Figures: p50 wall time and CPU time of STEPS timed steps (after 2 warm-up steps) and the
# peak resident set (getrusage ru_maxrss, both sides). Goals: libddp p50 / PyTorch p50
# <= 1.0 and libddp peak RSS <= PyTorch's.
# Part b: 2 ranks x 1 thread DDP on a GPT-2 of 10.3M parameters (n_layer 4, n_embd 384,
# n_head 6, vocab 8192, n_positions 128), batch 4 x 64 tokens per rank, AdamW: steps/s of
# libddp under ddprun (shm and tcp) against PyTorch DDP over gloo, DDP_STEPS timed steps
# after 5 warm-up ones, both kernel settings. Goal: libddp steps/s / PyTorch's >= 1.3.
# Every figure is the best of ROUNDS rounds (default 3) per system. Runs and outputs go to
# OUT_DIR (default a fresh /tmp/bench-gpt2.XXXXXX).
# Exit status: 0 when every run finished (whatever the verdicts), 1 when one failed,
# 2 on bad usage.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build"
out=""
rounds=3
steps=5
ddp_steps=20
parts=ab
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -B|-o|-r|-s|-S|-p)
      [ $# -ge 2 ] || { echo "bench_gpt2.sh: $1 needs a value (try --help)" >&2; exit 2; }
      case "$1" in
        -B) build=$2 ;; -o) out=$2 ;; -r) rounds=$2 ;; -s) steps=$2 ;; -S) ddp_steps=$2 ;;
        -p) parts=$2 ;;
      esac
      shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench_gpt2.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
for v in "$rounds" "$steps" "$ddp_steps"; do
  case "$v" in ''|*[!0-9]*|0) echo "bench_gpt2.sh: -r, -s and -S take positive integers" >&2
                                exit 2 ;; esac
done
case "$parts" in a|b|ab|ba) ;; *) echo "bench_gpt2.sh: -p takes a, b or ab" >&2; exit 2 ;; esac
tool="$build/tools/ddp-bench-ddp"
ddprun="$build/tools/ddprun"
py=/usr/bin/python3
for f in "$tool" "$ddprun"; do
  [ -x "$f" ] || { echo "bench_gpt2.sh: $f not found; build first (ninja -C $build)" >&2; exit 2; }
done
[ -x "$py" ] || { echo "bench_gpt2.sh: $py (Debian's python3 with python3-torch) not found" >&2
                  exit 2; }
[ -n "$out" ] || out=$(mktemp -d /tmp/bench-gpt2.XXXXXX)
mkdir -p "$out" || exit 2
failed=0
export DDP_BLAS_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo

# The two kernel settings: "env" keeps OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE as the
# environment has them, "unset" removes both for that command alone. Without either set,
# the two are the same and only "unset" runs.
settings=(unset)
if [ -n "${OPENBLAS_CORETYPE:-}${OPENBLAS_L2_SIZE:-}" ]; then settings=(env unset); fi
with_setting() { # setting -> the env command that runs a program under it
  if [ "$1" = unset ]; then echo "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"; else echo env; fi
}

cat >"$out/gpt2-124m.json" <<'EOF'
{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
 "n_head": 12, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
 "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-05, "initializer_range": 0.02,
 "tie_word_embeddings": true}
EOF
cat >"$out/gpt2-10m.json" <<'EOF'
{"model_type": "gpt2", "vocab_size": 8192, "n_positions": 128, "n_embd": 384, "n_layer": 4,
 "n_head": 6, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
 "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-05, "initializer_range": 0.02,
 "tie_word_embeddings": true}
EOF

echo "# bench_gpt2: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "# libddp git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown);" \
     "$(getconf _NPROCESSORS_ONLN) CPUs; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "# kernel settings: ${settings[*]} (env: OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}" \
     "OPENBLAS_L2_SIZE=${OPENBLAS_L2_SIZE:-unset}); $rounds rounds; outputs in $out"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew every figure)"
start=$(date +%s)

bench_timeout=900 bench_name_w=26 bench_secs_w=4
. "$here/bench_lib.sh"
setting_of() { basename "$1" | cut -d. -f2; } # <system>.<setting>.r<k>.res
rounds_of() { # key system setting -> the values of every round, slash-separated
  local f
  for f in "$out/$2.$3".r*.res; do [ -f "$f" ] && get "$f" "$1"; done | paste -sd/
}

if [[ "$parts" == *a* ]]; then
  echo
  echo "## part a: GPT-2 124M, batch 4 x 64, one thread, forward + backward + AdamW"
  a_args=(--model "$out/gpt2-124m.json" --optim adamw --batch 4 --seq 64 --steps "$steps"
          --warmup 2)
  for r in $(seq 1 "$rounds"); do
    for s in "${settings[@]}"; do
      run "torch.$s.r$r" $(with_setting "$s") "$py" "$here/peer_torch_ddp.py" --world 1 \
        "${a_args[@]}"
      run "libddp.$s.r$r" $(with_setting "$s") "$tool" "${a_args[@]}"
    done
  done
  echo
  printf '%-8s %-7s %-11s %12s %12s %12s  %s\n' system setting kernels "p50 ms" "cpu p50 ms" \
    "peak RSS MB" "p50 per round (ms)"
  declare -A besta
  for sys in torch libddp; do
    for s in "${settings[@]}"; do
      f=$(best step_p50_ms min "$out/$sys.$s".r*.res)
      printf '%-8s %-7s %-11s %12s %12s %12s  %s\n' "$sys" "$s" "$(get "$f" blas_core)" \
        "$(get "$f" step_p50_ms)" "$(get "$f" step_cpu_p50_ms)" "$(get "$f" peak_rss_mb)" \
        "$(rounds_of step_p50_ms "$sys" "$s")"
    done
    besta[$sys]=$(best step_p50_ms min "$out/$sys".*.r*.res)
  done
  tp=$(get "${besta[torch]:-/dev/null}" step_p50_ms)
  lp=$(get "${besta[libddp]:-/dev/null}" step_p50_ms)
  tm=$(get "${besta[torch]:-/dev/null}" peak_rss_mb)
  lm=$(get "${besta[libddp]:-/dev/null}" peak_rss_mb)
  rt=""; rm_=""
  [ -n "$tp" ] && [ -n "$lp" ] && rt=$(calc "$lp / $tp")
  [ -n "$tm" ] && [ -n "$lm" ] && rm_=$(calc "$lm / $tm")
  echo
  echo "best: libddp $lp ms ($(setting_of "${besta[libddp]:-x.none}") kernels," \
       "$(get "${besta[libddp]:-/dev/null}" blas_core)), PyTorch $tp ms" \
       "($(setting_of "${besta[torch]:-x.none}") kernels," \
       "$(get "${besta[torch]:-/dev/null}" blas_core))"
  printf '%-52s %8s  goal %-7s %s\n' "libddp step p50 / PyTorch step p50 (124M)" "${rt:--}" \
    "<= 1.0" "$(verdict "$rt" '<=' 1.0)"
  printf '%-52s %8s  goal %-7s %s\n' "libddp peak RSS / PyTorch peak RSS (124M)" "${rm_:--}" \
    "<= 1.0" "$(verdict "$rm_" '<=' 1.0)"
fi

if [[ "$parts" == *b* ]]; then
  echo
  echo "## part b: 2 ranks x 1 thread DDP, GPT-2 10.3M, batch 4 x 64 per rank, AdamW"
  b_args=(--model "$out/gpt2-10m.json" --optim adamw --batch 4 --seq 64 --steps "$ddp_steps"
          --warmup 5 --pairs 0 --ar-iters 0)
  for r in $(seq 1 "$rounds"); do
    for s in "${settings[@]}"; do
      run "ddp-torch.$s.r$r" $(with_setting "$s") "$py" "$here/peer_torch_ddp.py" --world 2 \
        "${b_args[@]}"
      for be in shm tcp; do
        run "ddp-$be.$s.r$r" $(with_setting "$s") "$ddprun" --nproc_per_node 2 --backend "$be" \
          "$tool" "${b_args[@]}"
      done
    done
  done
  echo
  printf '%-10s %-7s %-11s %10s %12s %12s  %s\n' system setting kernels "steps/s" "p50 ms" \
    "cpu p50 ms" "steps/s per round"
  declare -A bestb
  for sys in torch shm tcp; do
    for s in "${settings[@]}"; do
      f=$(best steps_per_s max "$out/ddp-$sys.$s".r*.res)
      printf '%-10s %-7s %-11s %10s %12s %12s  %s\n' "$sys" "$s" "$(get "$f" blas_core)" \
        "$(get "$f" steps_per_s)" "$(get "$f" step_p50_ms)" "$(get "$f" step_cpu_p50_ms)" \
        "$(rounds_of steps_per_s "ddp-$sys" "$s")"
    done
    bestb[$sys]=$(best steps_per_s max "$out/ddp-$sys".*.r*.res)
  done
  tq=$(get "${bestb[torch]:-/dev/null}" steps_per_s)
  echo
  for be in shm tcp; do
    q=$(get "${bestb[$be]:-/dev/null}" steps_per_s)
    ratio=""
    [ -n "$tq" ] && [ -n "$q" ] && ratio=$(calc "$q / $tq")
    printf '%-52s %8s  goal %-7s %s\n' "libddp $be steps/s / PyTorch gloo steps/s (10M)" \
      "${ratio:--}" ">= 1.3" "$(verdict "$ratio" '>=' 1.3)"
  done
fi
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg); total $(( $(date +%s) - start )) s"
exit $failed
