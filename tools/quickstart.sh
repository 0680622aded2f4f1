#!/usr/bin/env bash
# Installs what is missing, builds libddp in build/, and runs the end-to-end demo:
# data-parallel training of an MLP on the UCI 8x8 digits, first with 4 ranks as threads,
# then with 2 ranks as processes under ddprun on the shm and the tcp backends. The two
# process runs print the same losses bit for bit: reductions add in rank order (D2),
# whatever the transport.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh

ddp_ensure_packages "${DDP_BUILD_PACKAGES[@]}"
ddp_build build

echo "== 4 ranks as threads of one process"
build/tools/ddp-demo --threads 4 --steps 150
for backend in shm tcp; do
  echo
  echo "== 2 ranks as processes: ddprun --nproc_per_node 2 --backend $backend"
  build/tools/ddprun --nproc_per_node 2 --backend "$backend" --master_port 29517 \
    build/tools/ddp-demo --steps 100
done
