#!/usr/bin/env bash
# ZeRO-1's consolidated optimizer state loads into torch.optim.AdamW and continues the same
# steps (issue 39, "Against PyTorch 1.13"; docs/sharding.md, "Checkpoints"): ddp-train with
# ZeRO-1 (--deepspeed stage 1; AdamW, Transformers' decay and no-decay groups, weight decay,
# clipping, a linear schedule with warm-up) runs K + M steps at W = 2 and 3, saving a
# checkpoint at step K; tools/torch/torch_reference.py builds the plain PyTorch module from
# its model.safetensors, loads its consolidated optimizer.safetensors and
# optimizer_group1.safetensors into torch.optim.AdamW through tools/torch/libddp_optim.py
# (global parameter indices, shaped state, the groups' hyperparameters) and runs steps
# K..K+M-1 under PyTorch DDP on gloo with the same data; every parameter of every rank after
# each of those steps must equal the uninterrupted ddp-train run's within the DDP parity
# tolerance (rtol 1e-6, atol 1e-7). libddp_optim.py's CLI writes optimizer.pt, which
# AdamW.load_state_dict takes as is. Skips (77) without torch under /usr/bin/python3.
#
#   tests/zero_optim_torch.sh DDP_TRAIN SRC_ROOT
set -u
train=$(realpath "$1")
root=$(realpath "$2")
py=/usr/bin/python3
if ! [ -x $py ] || ! $py -c 'import torch' 2>/dev/null; then
  echo "skip: no torch under $py"
  exit 77
fi
ddprun=
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-zero-optim-torch-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"

K=5 M=5
# tests/test_zero_parity.c's model: three linear layers, six parameters in two groups
echo '{"dtype": "f32", "layers": [{"type": "linear", "in": 64, "out": 32}, {"type": "relu"},
  {"type": "linear", "in": 32, "out": 32}, {"type": "tanh"},
  {"type": "linear", "in": 32, "out": 10}]}' >mlp3.json
echo '{"zero_optimization": {"stage": 1}}' >ds1.json
job=(--per_device_train_batch_size 8 --learning_rate 1e-3 --weight_decay 0.1
  --max_grad_norm 0.5 --lr_scheduler_type linear --warmup_steps 3 --seed 7)
common=(--model mlp3.json --max_steps $((K + M)) --optim adamw --weight_decay_grouping
  transformers --zero_grad_set_to_none true --logging_steps 1 "${job[@]}")

for w in 2 3; do
  train_run z1-$w threads $w --deepspeed ds1.json --save_strategy steps --save_steps $K \
    --dump_dir z1-$w-dump >/dev/null
  ck=z1-$w/checkpoint-$K
  [ -f $ck/optimizer-00001-of-0000$w.safetensors ] || fail "$ck: no ZeRO-1 shards"
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 5 300 $py \
    "$root/tools/torch/torch_reference.py" --model mlp3.json --dump_dir t-$w --world $w \
    --steps $((K + M)) --start_step $K --init $ck/model.safetensors --optim_state $ck \
    --optim adamw --weight_decay_grouping transformers --zero_grad_set_to_none true \
    --batch 8 --lr 1e-3 --weight_decay 0.1 --max_grad_norm 0.5 --lr_scheduler_type linear \
    --warmup_steps 3 --seed 7 --shuffle true --timeout 60 >t-$w.log 2>&1 || {
    cat t-$w.log
    fail "torch_reference.py from $ck failed"
  }
  $py - "$root/tools/torch" z1-$w-dump t-$w $w $K $M <<'PY' || fail "W=$w: PyTorch's continuation differs"
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
import safetensors as st
libddp, ref, W, K, M = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
worst, n = 0.0, 0
for r in range(W):
    for k in range(K, K + M):
        name = "rank%d/step%06d.safetensors" % (r, k)
        a, _ = st.load_torch(os.path.join(libddp, name))
        b, _ = st.load_torch(os.path.join(ref, name))
        assert torch.equal(a["input.index"], b["input.index"]), (name, "another batch")
        for key in a:
            if not key.startswith("param."):
                continue
            x, y = a[key].double(), b[key].double()
            d = (x - y).abs()
            worst = max(worst, float(d.max()))
            n += 1
            assert bool((d <= 1e-7 + 1e-6 * y.abs()).all()), (name, key, float(d.max()))
print("ok: W=%d: steps %d..%d in PyTorch from ddp-train's ZeRO-1 checkpoint-%d: %d parameter "
      "tensors within rtol 1e-6 atol 1e-7 of the uninterrupted run (max abs %.3g)"
      % (W, K, K + M - 1, K, n, worst))
PY
done

# The converter's optimizer.pt: a torch.optim state_dict AdamW.load_state_dict takes, with
# global indices and the parameters' shapes.
$py "$root/tools/torch/libddp_optim.py" z1-3/checkpoint-$K --out opt.pt || fail "libddp_optim.py"
$py - opt.pt <<'PY' || fail "optimizer.pt"
import sys
import torch
sd = torch.load(sys.argv[1])
assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3, 4, 5]], sd["param_groups"]
assert [g["weight_decay"] for g in sd["param_groups"]] == [0.1, 0.0], sd["param_groups"]
shapes = [tuple(sd["state"][i]["exp_avg"].shape) for i in range(6)]
assert shapes == [(32, 64), (32, 32), (10, 32), (32,), (32,), (10,)], shapes
assert all(float(sd["state"][i]["step"]) == 5 for i in range(6))
ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
opt = torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:]}])
opt.load_state_dict(sd)
print("ok: optimizer.pt loads into torch.optim.AdamW: groups %s, lr %g (step 6's)"
      % ([g["params"] for g in sd["param_groups"]], sd["param_groups"][0]["lr"]))
PY
