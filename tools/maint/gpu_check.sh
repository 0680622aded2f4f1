#!/usr/bin/env bash
# gpu_check.sh: the nccl backend on a machine with NVIDIA GPUs (docs/nccl.md).
#
#   tools/maint/gpu_check.sh [BUILD_DIR]      (default /tmp/ddp-gpu-check)
#
# 1. Configures with -Dnccl=enabled (fails clearly when CUDA or NCCL is missing) and builds.
# 2. Runs tests/test_nccl directly and requires exit 0: 77 (no usable GPU) is a failure here.
# 3. Trains a short ddp-train job under ddprun on the nccl backend and the same job on the CPU
#    reference (tcp backend), both with per-step dumps, and compares them with ddp-compare:
#    in canonical mode (the default) the gradient allreduce is bitwise equal on every
#    backend, so the dumps must agree exactly (--rtol 0 --atol 0).
# 4. The same job with DDP_ALGORITHM=ring (NCCL's own allreduce, another summation order)
#    must agree with the reference within ddp-compare's default tolerances.
# Ranks: one per GPU, at most 2 (NCCL allows one rank per GPU in a communicator).
# Exit 0 when every step passed; the first failure stops the script with its output.
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-/tmp/ddp-gpu-check}"
say() { printf '\n== %s\n' "$*"; }

say "configure and build ($build, -Dnccl=enabled)"
if [ -d "$build" ]; then
  meson configure "$build" -Dnccl=enabled
else
  meson setup "$build" "$src" -Dnccl=enabled
fi
ninja -C "$build"

say "nvidia-smi"
nvidia-smi -L || true
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${ngpu:-0}" -ge 1 ] || { echo "gpu_check: no GPU visible (nvidia-smi -L)"; exit 1; }
nproc=$(( ngpu >= 2 ? 2 : 1 ))

say "tests/test_nccl (must pass, not skip)"
set +e
"$build/tests/test_nccl"
rc=$?
set -e
[ $rc -eq 0 ] || { echo "gpu_check: test_nccl exited $rc (77 = no usable GPU)"; exit 1; }

cd "$src"
out="$build/gpu-check-runs"
rm -rf "$out"
mkdir -p "$out"
train() { # name backend algorithm
  say "ddp-train: $nproc rank(s), backend $2, DDP_ALGORITHM=$3"
  DDP_ALGORITHM="$3" "$build/tools/ddprun" --nproc_per_node "$nproc" --backend "$2" \
    "$build/tools/ddp-train" --max_steps 20 --logging_steps 10 --seed 3 \
    --output_dir "$out/$1-out" --dump_dir "$out/$1"
}
train cpu tcp canonical
train nccl nccl canonical
train nccl-ring nccl ring

say "ddp-compare: nccl (canonical) against the CPU reference, exactly"
"$build/tools/ddp-compare" --rtol 0 --atol 0 "$out/cpu" "$out/nccl"
say "ddp-compare: nccl (ring = ncclAllReduce) against the CPU reference, default tolerances"
"$build/tools/ddp-compare" "$out/cpu" "$out/nccl-ring"
say "gpu_check: all passed"
