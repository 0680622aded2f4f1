#!/usr/bin/env bash
# Installs what is missing, builds libddp in build/, and runs the main job: ddp-train with
# 4 ranks as processes under ddprun on the shm backend, training the default MLP on the UCI
# 8x8 digits (Hugging Face TrainingArguments names; docs/train.md). The loss goes down, the
# throughput is printed, and the run ends with the replica check passing: every rank holds
# bit-identical parameters. Then the same job with 4 ranks as threads of one process ends
# with the same parameter hash, bit for bit (reductions add in rank order, D2). Last, where
# python3-torch is installed, real PyTorch DDP runs the job and ddp-compare checks libddp
# against it step by step. In between, a small GPT-2 learns the shipped English text on 2
# shm processes and prints a sample. The older ddp-demo (a hand-written data-parallel loop) still
# builds and runs: build/tools/ddp-demo.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh

ddp_ensure_packages "${DDP_BUILD_PACKAGES[@]}"
ddp_build build

# HF's default for ddp_find_unused_parameters is true for a model like this one, and PyTorch
# then warns on every rank that nothing was unused; the MLP uses every parameter, so say so.
out=build/quickstart
rm -rf "$out"
args=(--max_steps 200 --per_device_train_batch_size 16 --learning_rate 3e-3
      --warmup_ratio 0.05 --logging_steps 25 --eval_strategy steps --eval_steps 100
      --save_steps 100 --save_total_limit 1 --disable_tqdm
      --ddp_find_unused_parameters false)

echo "== 4 ranks as processes: ddprun --nproc_per_node 4 --backend shm --standalone build/tools/ddp-train ..."
build/tools/ddprun --nproc_per_node 4 --backend shm --standalone \
  build/tools/ddp-train "${args[@]}" --output_dir "$out/processes"
echo
echo "== the same job, 4 ranks as threads: build/tools/ddp-train --threads 4 ..."
build/tools/ddp-train --threads 4 "${args[@]}" --output_dir "$out/threads" | tail -n 3
echo

# A GPT-2 (Transformers' GPT2LMHeadModel: its config.json keys, names and checkpoint layout)
# learns the shipped King James Genesis and Exodus byte by byte on 2 processes, then rank 0
# prints a sample from a prompt (top-k 3, seeded: a model this small, greedy, soon repeats
# one word). The final model and each checkpoint are directories
# that Transformers' from_pretrained loads (config.json, model.safetensors).
echo "== a small GPT-2 on 2 ranks (ddprun, shm) on tests/data/kjv_genesis_exodus.txt"
mkdir -p "$out/gpt2"
cat >"$out/gpt2/config.json" <<'JSON'
{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
JSON
SECONDS=0
build/tools/ddprun --nproc_per_node 2 --backend shm --standalone \
  build/tools/ddp-train --model "$out/gpt2/config.json" --data tests/data/kjv_genesis_exodus.txt \
  --block_size 64 --per_device_train_batch_size 16 --max_steps 1500 --learning_rate 3e-3 \
  --warmup_steps 50 --logging_steps 250 --eval_strategy steps --eval_steps 750 \
  --save_strategy no --disable_tqdm --ddp_find_unused_parameters false \
  --sample_prompt "And God said, " --sample_top_k 3 --sample_max_new_tokens 100 \
  --output_dir "$out/gpt2/run"
echo "(GPT-2 run: ${SECONDS} s)"
echo

# The third use: the same job in real PyTorch DDP (gloo), then libddp from PyTorch's initial
# weights, compared tensor by tensor (docs/compare.md). Needs Debian's python3-torch, which
# tools/test.sh installs; skipped with a note when it is missing.
if /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then
  echo "== against PyTorch: tools/torch/torch_reference.py (real DDP, gloo, 4 ranks), ddp-train from its"
  echo "   initial weights, then ddp-compare of every step's inputs, gradients and parameters"
  cat >"$out/model.json" <<'JSON'
{"dtype": "f32", "layers": [{"type": "linear", "in": 64, "out": 64}, {"type": "relu"},
                            {"type": "linear", "in": 64, "out": 10}]}
JSON
  common=(--seed 42 --optim sgd --max_grad_norm 0)
  /usr/bin/python3 tools/torch/torch_reference.py --model "$out/model.json" --dump_dir "$out/torch" \
    --world 4 --max_steps 10 --per_device_train_batch_size 16 --learning_rate 0.05 \
    "${common[@]}" >"$out/torch.log" 2>&1 || { cat "$out/torch.log"; exit 1; }
  build/tools/ddp-train --threads 4 --model "$out/model.json" --init "$out/torch/weights.safetensors" \
    --max_steps 10 --per_device_train_batch_size 16 --learning_rate 0.05 "${common[@]}" \
    --lr_scheduler_type constant --ddp_find_unused_parameters false --save_strategy no \
    --disable_tqdm --dump_dir "$out/libddp" --output_dir "$out/compare" >/dev/null
  build/tools/ddp-compare "$out/torch" "$out/libddp"
else
  echo "== (the comparison against PyTorch DDP needs Debian's python3-torch: tools/test.sh installs it)"
fi
echo
echo "Metrics: $out/processes/metrics.jsonl   loss curve: $out/processes/loss.svg"
echo "Every flag: build/tools/ddp-train --help"
