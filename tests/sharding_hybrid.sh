#!/usr/bin/env bash
# Hybrid sharding (docs/sharding.md, "Hybrid sharding"): --fsdp hybrid_shard and
# hybrid_shard_zero2 at W = 4 ranks.
#
# - As 2 nodes of 2 (fsdp_config dp_shard_size on threads; the launcher's LOCAL_WORLD_SIZE
#   with two ddprun --nnodes 2 on localhost over tcp) and as 1 node of 4 (FULL_SHARD's
#   layout), the digits MLP and GPT-2 tiny (AdamW, weight decay, clipping, 20 steps, GA 1
#   and 3) end with DDP's param_hash: the default reduction is one rank-order sum over all
#   ranks. Its FULL_STATE_DICT checkpoint is DDP's byte for byte and resumes to the same end.
# - The state bytes of metrics.jsonl: each node holds the model once, 16Ψ over its ranks.
# - --sharding_arithmetic fsdp1 at 2 x 2: one SGD step at learning rate 1 ends, bit for bit,
#   with the weights minus tools/torch/shard_arith.py's emulation of FSDP's two-stage
#   order (in the node, then across nodes; its docstring cites FSDP's source) applied to a
#   DDP run's local gradients of the same step; the one-sum emulation (ddp) differs from it
#   (the check can fail). Skips (77) without torch.
# - Bad input: a node size that does not divide W, dp_shard_size without hybrid, hybrid
#   with SHARDED_STATE_DICT (saving, and resuming a ZeRO-3 one), two strategies at once.
#
#   tests/sharding_hybrid.sh DDP_TRAIN DDPRUN SRC_ROOT
set -u
train=$(realpath "$1")
ddprun=$(realpath "$2")
root=$(realpath "$3")
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-sharding-hybrid-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"
TRAIN_TIMEOUT=120

printf '%s\n' '{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,' \
  '"n_layer": 2, "n_head": 4}' >gpt2.json
common=(--max_steps 20 --optim adamw_torch --weight_decay 0.1 --max_grad_norm 0.5
  --logging_steps 20 --save_strategy no)
mlp=(--learning_rate 1e-2)
gpt=(--model gpt2.json --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3)
nodes2='{"dp_shard_size": 2, "min_num_params": 1000}'
hash_of() { grep -o '"param_hash": "[0-9a-f]*"' "$1/metrics.jsonl" | tail -1; }

# MLP (the GA 1 runs save a FULL_STATE_DICT checkpoint at step 10)
save=(--save_strategy steps --save_steps 10)
m1=$(train_run ddp-mlp-1 threads 4 "${mlp[@]}" "${save[@]}")
m3=$(train_run ddp-mlp-3 threads 4 "${mlp[@]}" --gradient_accumulation_steps 3)
h=$(train_run hy-mlp-1 threads 4 "${mlp[@]}" "${save[@]}" --fsdp hybrid_shard --fsdp_config "$nodes2")
[ "$h" = "$m1" ] || fail "MLP 2 x 2 hybrid_shard GA 1: $h, DDP $m1"
for f in model.safetensors optimizer.safetensors optimizer_group1.safetensors; do
  cmp -s "hy-mlp-1/checkpoint-10/$f" "ddp-mlp-1/checkpoint-10/$f" ||
    fail "hybrid_shard FULL_STATE_DICT $f differs from DDP's"
done
h=$(train_run hy-mlp-r threads 4 "${mlp[@]}" --fsdp hybrid_shard --fsdp_config "$nodes2" \
  --resume_from_checkpoint hy-mlp-1/checkpoint-10)
[ "$h" = "$m1" ] || fail "MLP 2 x 2 hybrid_shard resumed at step 10: $h, uninterrupted $m1"
h=$(train_run hy2-mlp-3 threads 4 "${mlp[@]}" --gradient_accumulation_steps 3 \
  --fsdp hybrid_shard_zero2 --fsdp_config "$nodes2")
[ "$h" = "$m3" ] || fail "MLP 2 x 2 hybrid_shard_zero2 GA 3: $h, DDP $m3"
# thread ranks without dp_shard_size: one node of 4, FULL_SHARD's layout
h=$(DDP_DEBUG=INFO train_run hy-mlp-1x4 threads 4 "${mlp[@]}" --gradient_accumulation_steps 3 \
  --fsdp "hybrid_shard auto_wrap" --fsdp_config '{"min_num_params": 1000}')
[ "$h" = "$m3" ] || fail "MLP 1 x 4 hybrid_shard GA 3: $h, DDP $m3"
grep -q "1 node(s) of 4 ranks (node size from all ranks in one process: one node)" hy-mlp-1x4.log ||
  fail "thread ranks without dp_shard_size: not one node of 4: $(cat hy-mlp-1x4.log)"
# two "nodes" of 2 processes on localhost over tcp: the node size is LOCAL_WORLD_SIZE
export DDP_JOB_TOKEN
DDP_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
# the store's port from the kernel (node 0's ddprun then holds it until its ranks start)
port=$(/usr/bin/env python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') ||
  fail "no free port from the kernel"
for nr in 0 1; do
  DDP_DEBUG=INFO timeout -k 5 "$TRAIN_TIMEOUT" "$ddprun" --nnodes 2 --node_rank $nr \
    --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $port --backend tcp \
    "$train" "${common[@]}" "${mlp[@]}" --output_dir hy-mlp-tcp --fsdp hybrid_shard \
    --fsdp_config '{"min_num_params": 1000}' >hy-mlp-tcp-$nr.log 2>&1 &
done
rc=0
wait %1 || rc=1
wait %2 || rc=1
[ $rc = 0 ] || {
  cat hy-mlp-tcp-0.log hy-mlp-tcp-1.log
  fail "ddprun --nnodes 2: ddp-train failed"
}
grep -q "hybrid_shard: 2 node(s) of 2 ranks (node size from the launcher's LOCAL_WORLD_SIZE)" \
  hy-mlp-tcp-0.log || fail "ddprun --nnodes 2: no 2 x 2 layout: $(cat hy-mlp-tcp-0.log)"
h=$(hash_of hy-mlp-tcp)
[ "$h" = "$m1" ] || fail "MLP 2 nodes x 2 (ddprun --nnodes 2, tcp) hybrid_shard: $h, DDP $m1"
echo "ok: MLP: hybrid_shard and hybrid_shard_zero2 (2 x 2 threads and tcp, 1 x 4) end with DDP's param_hash"

# GPT-2 tiny, a unit per GPT2Block
g1=$(train_run ddp-gpt-1 threads 4 "${gpt[@]}")
g3=$(train_run ddp-gpt-3 threads 4 "${gpt[@]}" --gradient_accumulation_steps 3)
h=$(train_run hy-gpt-1 threads 4 "${gpt[@]}" --fsdp "hybrid_shard auto_wrap" \
  --fsdp_config '{"dp_shard_size": 2}')
[ "$h" = "$g1" ] || fail "GPT-2 2 x 2 hybrid_shard GA 1: $h, DDP $g1"
h=$(train_run hy2-gpt-3 threads 4 "${gpt[@]}" --gradient_accumulation_steps 3 \
  --fsdp "hybrid_shard_zero2 auto_wrap" --fsdp_config '{"dp_shard_size": 2}')
[ "$h" = "$g3" ] || fail "GPT-2 2 x 2 hybrid_shard_zero2 GA 3: $h, DDP $g3"
# state bytes: GPT-2 tiny has Ψ = 35712; each of the 2 nodes holds 4Ψ of parameters and 16Ψ
# of state (f32 AdamW) over its 2 ranks, padding not counted
"$py" - hy-gpt-1/metrics.jsonl <<'PY' || fail "hybrid state bytes"
import json, sys
line = [json.loads(l) for l in open(sys.argv[1]) if '"param_bytes"' in l][-1]
psi, nodes = 35712, 2
assert line["sharding"] == "hybrid_shard", line["sharding"]
assert sum(line["param_bytes"]) == nodes * 4 * psi, (line["param_bytes"], nodes * 4 * psi)
assert sum(line["state_bytes"]) == nodes * 16 * psi, (line["state_bytes"], nodes * 16 * psi)
assert line["state_bytes"][0] == line["state_bytes"][2], line["state_bytes"]  # replicas
print("ok: hybrid_shard state bytes %s: 16Ψ per node of 2 (8Ψ per rank)" % line["state_bytes"])
PY
echo "ok: GPT-2 tiny: hybrid_shard and hybrid_shard_zero2 (2 x 2) end with DDP's param_hash"

# Bad input
expect_err "--fsdp hybrid_shard: the node size 3 (--fsdp_config dp_shard_size) does not divide the world size 2" \
  --fsdp hybrid_shard --fsdp_config '{"dp_shard_size": 3}'
expect_err "--fsdp_config: dp_shard_size 2 applies to --fsdp hybrid_shard and hybrid_shard_zero2 only (--fsdp 'full_shard')" \
  --fsdp full_shard --fsdp_config '{"dp_shard_size": 2}'
expect_err "--fsdp_config: 'dp_shard_size' = 0; expected a whole number of ranks per node" \
  --fsdp hybrid_shard --fsdp_config '{"dp_shard_size": 0}'
expect_err "--fsdp hybrid_shard_zero2: SHARDED_STATE_DICT checkpoints are not built for hybrid sharding" \
  --fsdp hybrid_shard_zero2 --fsdp_config '{"state_dict_type": "SHARDED_STATE_DICT"}'
train_run z3s threads 2 "${mlp[@]}" "${save[@]}" --fsdp full_shard \
  --fsdp_config '{"min_num_params": 1000, "state_dict_type": "SHARDED_STATE_DICT"}' >/dev/null
expect_err "--fsdp hybrid_shard: resuming z3s/checkpoint-10, a SHARDED_STATE_DICT checkpoint, is not built for hybrid sharding" \
  "${mlp[@]}" --fsdp hybrid_shard --fsdp_config '{"min_num_params": 1000}' \
  --resume_from_checkpoint z3s/checkpoint-10
expect_err "--fsdp 'full_shard hybrid_shard': full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2 and no_shard are exclusive" \
  --fsdp "full_shard hybrid_shard"
echo "ok: bad input refused"

"$py" -c 'import torch' 2>/dev/null || {
  echo "SKIP: /usr/bin/python3 has no torch (the emulation check)"
  exit 77
}
sgd=(--max_steps 1 --optim sgd --learning_rate 1 --max_grad_norm 0 --weight_decay 0)
train_run dump threads 4 "${sgd[@]}" --dump_dir dump --dump_local_grads true >/dev/null
train_run hy-fsdp1 threads 4 "${sgd[@]}" --sharding_arithmetic fsdp1 --fsdp hybrid_shard \
  --fsdp_config "$nodes2" --save_strategy steps --save_steps 1 >/dev/null
emu="$root/tools/torch/shard_arith.py"
model=hy-fsdp1/checkpoint-1/model.safetensors
"$py" "$emu" --check_sgd dump $model --arith fsdp1 --node_size 2 ||
  fail "fsdp1 at 2 x 2: the parameters differ from FSDP's two-stage order"
"$py" "$emu" --check_sgd dump $model --arith ddp --node_size 2 >ddp-check.log &&
  fail "the one-sum emulation matches the fsdp1 run: the check cannot tell the orders apart"
echo "PASS"
