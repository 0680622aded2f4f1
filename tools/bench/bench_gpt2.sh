#!/bin/bash
# bench_gpt2.sh: libddp against PyTorch 1.13 on GPT-2 (or, with -m llama, Llama) training
# steps (docs/benchmarks.md, "GPT-2" and "Llama training step"; issues 13 and 40's speed
# points). A benchmark, not a test: it prints figures and verdicts.
#
#   tools/bench/bench_gpt2.sh [-m gpt2|llama] [-B BUILD_DIR] [-o OUT_DIR] [-r ROUNDS]
#                       [-s STEPS] [-S DDP_STEPS] [-p a|b|ab]
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
# -m llama: the same parts on LlamaForCausalLM (tools/torch/hf_llama.py on PyTorch's side):
# part a a Llama of 124.7M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads,
# intermediate 2048, vocab 32000, untied head), goal libddp p50 / PyTorch p50 <= 0.8; part b
# a Llama of 10.2M (hidden 384, 4 layers, 6 heads, 2 KV heads, intermediate 1024, vocab
# 5120), goal >= 1.3. PyTorch also runs with torch.backends.mkldnn.enabled off beside its
# default on (peer_torch_ddp.py --mkldnn), and the faster of the two is its figure.
# The systems run side by side in each of ROUNDS rounds (default 3), so each round gives a
# ratio (libddp's best over PyTorch's best in that round); the verdicts are on the median of
# those per-round ratios, the figures measured side by side (a system's best over all rounds
# against the other's best may pair runs minutes apart, and PyTorch's step spreads 5-20 %
# between rounds where libddp's spreads 2-5 %, so its lucky round decides that ratio). The
# best of all rounds per system and their ratio are printed too. Runs and outputs go to
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
family=gpt2
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -B|-o|-r|-s|-S|-p|-m)
      [ $# -ge 2 ] || { echo "bench_gpt2.sh: $1 needs a value (try --help)" >&2; exit 2; }
      case "$1" in
        -B) build=$2 ;; -o) out=$2 ;; -r) rounds=$2 ;; -s) steps=$2 ;; -S) ddp_steps=$2 ;;
        -p) parts=$2 ;; -m) family=$2 ;;
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
case "$family" in gpt2|llama) ;; *) echo "bench_gpt2.sh: -m takes gpt2 or llama" >&2; exit 2 ;; esac
tool="$build/tools/ddp-bench-ddp"
ddprun="$build/tools/ddprun"
py=/usr/bin/python3
for f in "$tool" "$ddprun"; do
  [ -x "$f" ] || { echo "bench_gpt2.sh: $f not found; build first (ninja -C $build)" >&2; exit 2; }
done
[ -x "$py" ] || { echo "bench_gpt2.sh: $py (Debian's python3 with python3-torch) not found" >&2
                  exit 2; }
[ -n "$out" ] || out=$(mktemp -d "/tmp/bench-$family.XXXXXX")
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

cat >"$out/llama-124m.json" <<'EOF'
{"model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
 "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
 "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
 "initializer_range": 0.02, "tie_word_embeddings": false}
EOF
cat >"$out/llama-10m.json" <<'EOF'
{"model_type": "llama", "vocab_size": 5120, "hidden_size": 384, "intermediate_size": 1024,
 "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
 "max_position_embeddings": 128, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
 "initializer_range": 0.02, "tie_word_embeddings": false}
EOF
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

if [ "$family" = llama ]; then
  big="$out/llama-124m.json" small="$out/llama-10m.json" name_a="Llama 124.7M" name_b="Llama 10.2M"
  goal_a=0.8 tag_a=124M tag_b=10M mkldnn=(on off)
else
  big="$out/gpt2-124m.json" small="$out/gpt2-10m.json" name_a="GPT-2 124M" name_b="GPT-2 10.3M"
  goal_a=1.0 tag_a=124M tag_b=10M mkldnn=(on)
fi
tsys=(); for k in "${mkldnn[@]}"; do tsys+=("torch-mkldnn_$k"); done

echo "# bench_gpt2 -m $family: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
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
  local f r
  for r in $(seq 1 "$rounds"); do
    f="$out/$2.$3.r$r.res"; [ -f "$f" ] && get "$f" "$1"
  done | paste -sd/
}
round_ratios() { # key min|max prefix_a prefix_b -> per round, a's best over b's best, a line each
  local key=$1 how=$2 r fa fb va vb
  for r in $(seq 1 "$rounds"); do
    fa=$(shopt -s nullglob; best "$key" "$how" "$out"/$3.*.r"$r".res)
    fb=$(shopt -s nullglob; best "$key" "$how" "$out"/$4.*.r"$r".res)
    va=$(get "${fa:-/dev/null}" "$key"); vb=$(get "${fb:-/dev/null}" "$key")
    if [ -n "$va" ] && [ -n "$vb" ]; then calc "$va / $vb"; echo; fi
  done
}
median() { # values on stdin -> their median (empty when none)
  sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit
    printf "%.3f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
min_median() { # values on stdin -> "min M median D (sorted: a/b/c)"
  sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "-"; exit }
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    s = v[1]; for (i = 2; i <= NR; i++) s = s "/" v[i]
    printf "min %.3f median %.3f (sorted: %s)\n", v[1], m, s }'
}

if [[ "$parts" == *a* ]]; then
  echo
  echo "## part a: $name_a, batch 4 x 64, one thread, forward + backward + AdamW"
  a_args=(--model "$big" --optim adamw --batch 4 --seq 64 --steps "$steps" --warmup 2)
  for r in $(seq 1 "$rounds"); do
    for s in "${settings[@]}"; do
      for k in "${mkldnn[@]}"; do
        run "torch-mkldnn_$k.$s.r$r" $(with_setting "$s") "$py" "$here/peer_torch_ddp.py" \
          --world 1 --mkldnn "$k" "${a_args[@]}"
      done
      run "libddp.$s.r$r" $(with_setting "$s") "$tool" "${a_args[@]}"
    done
  done
  echo
  printf '%-17s %-7s %-11s %12s %12s %12s  %s\n' system setting kernels "p50 ms" \
    "cpu p50 ms" "peak RSS MB" "p50 per round (ms)"
  declare -A besta
  for sys in "${tsys[@]}" libddp; do
    for s in "${settings[@]}"; do
      f=$(best step_p50_ms min "$out/$sys.$s".r*.res)
      printf '%-17s %-7s %-11s %12s %12s %12s  %s\n' "$sys" "$s" "$(get "$f" blas_core)" \
        "$(get "$f" step_p50_ms)" "$(get "$f" step_cpu_p50_ms)" "$(get "$f" peak_rss_mb)" \
        "$(rounds_of step_p50_ms "$sys" "$s")"
    done
  done
  besta[torch]=$(best step_p50_ms min "$out"/torch-*.r*.res)
  besta[libddp]=$(best step_p50_ms min "$out"/libddp.*.r*.res)
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
  echo "best of all rounds: step p50 ratio ${rt:--}, peak RSS ratio ${rm_:--}"
  mt=$(round_ratios step_p50_ms min libddp 'torch-*' | median)
  mm=$(round_ratios peak_rss_mb min libddp 'torch-*' | median)
  printf '%-52s %8s  goal %-7s %s\n' "libddp step p50 / PyTorch step p50 ($tag_a)" "${mt:--}" \
    "<= $goal_a" "$(verdict "$mt" '<=' "$goal_a")"
  printf '%-52s %8s  goal %-7s %s\n' "libddp peak RSS / PyTorch peak RSS ($tag_a)" "${mm:--}" \
    "<= 1.0" "$(verdict "$mm" '<=' 1.0)"
  echo "(verdicts: the median of the per-round ratios)"
  echo "per-round ratios, libddp / PyTorch (each round's best of each side):"
  echo "  step p50:     $(round_ratios step_p50_ms min libddp 'torch-*' | min_median)"
  echo "  step cpu p50: $(round_ratios step_cpu_p50_ms min libddp 'torch-*' | min_median)"
  echo "  peak RSS:     $(round_ratios peak_rss_mb min libddp 'torch-*' | min_median)"
fi

if [[ "$parts" == *b* ]]; then
  echo
  echo "## part b: 2 ranks x 1 thread DDP, $name_b, batch 4 x 64 per rank, AdamW"
  b_args=(--model "$small" --optim adamw --batch 4 --seq 64 --steps "$ddp_steps"
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
    echo "best of all rounds: libddp $be / PyTorch gloo steps/s ${ratio:--}"
  done
  for be in shm tcp; do
    ratio=$(round_ratios steps_per_s max "ddp-$be" ddp-torch | median)
    printf '%-52s %8s  goal %-7s %s\n' "libddp $be steps/s / PyTorch gloo steps/s ($tag_b)" \
      "${ratio:--}" ">= 1.3" "$(verdict "$ratio" '>=' 1.3)"
  done
  echo "(verdicts: the median of the per-round ratios)"
  echo "per-round ratios, libddp / PyTorch gloo steps/s (each round's best of each side):"
  for be in shm tcp; do
    echo "  $be: $(round_ratios steps_per_s max "ddp-$be" ddp-torch | min_median)"
  done
fi
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg); total $(( $(date +%s) - start )) s"
exit $failed
