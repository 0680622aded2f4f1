#!/usr/bin/env bash
# --deepspeed ds_config.json keys (docs/sharding.md, "Flags"; src/train/ds_config.c): the
# keys that change a libddp knob change it (reduce_bucket_size: the reducer's bucket cap in
# the dump's ddp.json; reduce_scatter false: DeepSpeed's allreduce arithmetic;
# stage3_param_persistence_threshold: fewer bytes sent; stage3_prefetch_bucket_size: more
# gathered at once) and none changes DDP's bits; "auto" is filled from the model's hidden
# size as Transformers fills it; keys that conflict with the flags, cannot apply on a CPU or
# are unknown are refused naming the key and both values.
#
#   tests/ds_config.sh DDP_TRAIN SRC_ROOT
set -u
train=$(realpath "$1")
root=$(realpath "$2")
ddprun=
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-ds-config-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"
py=/usr/bin/python3
[ -x $py ] || py=python3

printf '%s\n' '{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,' \
  '"n_layer": 2, "n_head": 4}' >gpt2.json
common=(--max_steps 6 --optim adamw_torch --weight_decay 0.1 --max_grad_norm 0.5
  --logging_steps 6 --save_strategy no)
mlp=(--learning_rate 1e-2)
gpt=(--model gpt2.json --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3)

# metric DIR KEY: rank 0's value of KEY on the last metrics.jsonl line that has it
metric() {
  $py -c 'import json, sys
l = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl") if sys.argv[2] in x][-1]
v = l[sys.argv[2]]
print(v[0] if isinstance(v, list) else v)' "$1" "$2"
}

# reduce_bucket_size (elements) is the reducer's bucket cap in bytes (x 4, f32), the first
# bucket included; the bits stay DDP's.
ddp=$(train_run ddp-mlp threads 3 "${mlp[@]}")
echo '{"zero_optimization": {"stage": 1, "reduce_bucket_size": 4000, "overlap_comm": true,
  "contiguous_gradients": true, "allgather_bucket_size": 5e8}}' >rbs.json
h=$(train_run rbs threads 3 "${mlp[@]}" --deepspeed rbs.json --dump_dir rbs-dump)
[ "$h" = "$ddp" ] || fail "reduce_bucket_size 4000: $h, DDP $ddp"
check_limits() { # DUMP BYTES
  $py - "$1/rank0/ddp.json" "$2" <<'PY' || fail "bucket limits of $1"
import json, sys
d, cap = json.load(open(sys.argv[1])), int(sys.argv[2])
lim = d["bucket_size_limits"]
assert lim["initial"] == [cap, cap] and lim["rebuilt"] == [cap, cap], lim
# DDP's rule: a bucket closes once it reaches the cap, so all but its last parameter fit
numel = [eval("*".join(map(str, s)) or "1") for s in d["param_shapes"]]
buckets = d["bucket_layouts"]["initial"]
assert len(buckets) > 1, buckets
for b, size in zip(buckets, d["bucket_sizes"]["initial"]):
    assert size == 4 * sum(numel[i] for i in b), (b, size)
    assert 4 * sum(numel[i] for i in b[:-1]) < cap, (b, size, cap)
print("ok: bucket limits %s, buckets %s bytes" % (lim["initial"], d["bucket_sizes"]["initial"]))
PY
}
check_limits rbs-dump 16000
# "auto": hidden_size x hidden_size elements (GPT-2 n_embd 32: 1024 elements, 4096 bytes)
dgpt=$(train_run ddp-gpt threads 2 "${gpt[@]}" --gradient_accumulation_steps 2)
echo '{"zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}}' >auto1.json
h=$(train_run auto1 threads 2 "${gpt[@]}" --gradient_accumulation_steps 2 --deepspeed auto1.json \
  --dump_dir auto1-dump)
[ "$h" = "$dgpt" ] || fail "reduce_bucket_size auto: $h, DDP $dgpt"
check_limits auto1-dump 4096

# A Transformers-style config with every key "auto" (and offload to cpu: a no-op) runs as
# the flags say: ZeRO-2 with DDP's bits.
cat >hf.json <<'EOF'
{"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16}, "bf16": {"enabled": "auto"},
 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
   "warmup_num_steps": "auto", "total_num_steps": "auto"}},
 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
   "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
   "reduce_scatter": true, "reduce_bucket_size": "auto", "contiguous_gradients": true},
 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
 "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false}
EOF
h=$(train_run hf threads 2 "${gpt[@]}" --gradient_accumulation_steps 2 --deepspeed hf.json)
[ "$h" = "$dgpt" ] || fail "Transformers-style config: $h, DDP $dgpt"
# the same values spelled out, equal to the flags, pass too
cat >hfv.json <<'EOF'
{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
   "warmup_num_steps": 0, "total_num_steps": 6}},
 "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
 "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
EOF
h=$(train_run hfv threads 2 "${gpt[@]}" --gradient_accumulation_steps 2 --deepspeed hfv.json)
[ "$h" = "$dgpt" ] || fail "config equal to the flags: $h, DDP $dgpt"
echo "ok: reduce_bucket_size sets the reducer's cap (given and auto), Transformers' auto config runs, DDP's bits"

# reduce_scatter false under --sharding_arithmetic deepspeed: DeepSpeed's allreduce path
# (SUM, then x 1/W): deepspeed_allreduce's bits, which differ from deepspeed's at W = 3.
echo '{"zero_optimization": {"stage": 1, "reduce_scatter": false}}' >rs1.json
echo '{"zero_optimization": {"stage": 2, "reduce_scatter": false}}' >rs2.json
echo '{"zero_optimization": {"stage": 1}}' >ds1.json
ar=$(train_run ar threads 3 "${mlp[@]}" --deepspeed ds1.json --sharding_arithmetic deepspeed_allreduce)
dv=$(train_run dv threads 3 "${mlp[@]}" --deepspeed ds1.json --sharding_arithmetic deepspeed)
[ "$ar" != "$dv" ] || fail "deepspeed and deepspeed_allreduce end alike at W = 3 ($ar)"
for s in 1 2; do
  h=$(train_run rs$s threads 3 "${mlp[@]}" --deepspeed rs$s.json --sharding_arithmetic deepspeed)
  [ "$h" = "$ar" ] || fail "stage $s reduce_scatter false: $h, deepspeed_allreduce $ar"
done
# under DDP's arithmetic (the default) it changes nothing
h=$(train_run rs1-ddp threads 3 "${mlp[@]}" --deepspeed rs1.json)
[ "$h" = "$ddp" ] || fail "reduce_scatter false, ddp arithmetic: $h, DDP $ddp"
echo "ok: reduce_scatter false selects deepspeed_allreduce under DeepSpeed's arithmetic"

# ZeRO-3 (GPT-2 tiny, a unit per GPT2Block, W = 2, GA 2): stage3_param_persistence_threshold
# above a block's size keeps the blocks gathered from their first forward to the window's
# reduction (fewer bytes sent than resharding, and than reshard_after_forward false, which
# gathers each micro-batch); stage3_prefetch_bucket_size "auto" (0.9 hidden^2 > 0) prefetches
# the next unit (more gathered at the peak than without); DDP's bits in each.
echo '{"zero_optimization": {"stage": 3}}' >z3.json
echo '{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e6}}' >z3p.json
echo '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
  "stage3_param_persistence_threshold": "auto"}}' >z3a.json
g2=("${gpt[@]}" --gradient_accumulation_steps 2)
for c in z3 z3p z3a; do
  h=$(train_run $c threads 2 "${g2[@]}" --deepspeed $c.json)
  [ "$h" = "$dgpt" ] || fail "$c: $h, DDP $dgpt"
done
h=$(train_run raf threads 2 "${g2[@]}" --fsdp "full_shard auto_wrap" \
  --fsdp_config '{"reshard_after_forward": false}')
s3=$(metric z3 sent_bytes) s3p=$(metric z3p sent_bytes) raf=$(metric raf sent_bytes)
$py -c "import sys; a, b, c = map(float, sys.argv[1:]); assert b < c < a, (a, b, c)" \
  "$s3" "$s3p" "$raf" || fail "persistence: sent $s3p, resharding $s3, reshard_after_forward false $raf"
g3=$(metric z3 gathered_bytes) g3a=$(metric z3a gathered_bytes)
[ "$g3a" -gt "$g3" ] || fail "prefetch auto: gathered peak $g3a, without prefetch $g3"
echo "ok: ZeRO-3 persistence threshold (sent $s3p < $raf < $s3 bytes), prefetch (peak $g3a > $g3 bytes), DDP's bits"

# Refusals, each naming the key and the value(s).
bad() { # WHAT JSON [ARGS...]
  local what=$1
  echo "$2" >bad.json
  shift 2
  expect_err "$what" --deepspeed bad.json "$@"
}
bad "--deepspeed bad.json: the model's config has neither \`hidden_size\` nor \`hidden_sizes\`, therefore it's not possible to automatically fill out the following \`auto\` entries: ['zero_optimization.reduce_bucket_size']" \
  '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}'
bad 'zero_optimization.reduce_bucket_size = "big"; expected a number of elements > 0 or "auto"' \
  '{"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}}'
bad 'zero_optimization.reduce_bucket_size = 0; expected a number of elements > 0' \
  '{"zero_optimization": {"stage": 1, "reduce_bucket_size": 0}}'
bad 'zero_optimization.stage3_param_persistence_threshold = -1; expected a number of elements >= 0' \
  '{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}}'
bad 'zero_optimization.reduce_scatter = "no"; expected true or false' \
  '{"zero_optimization": {"stage": 2, "reduce_scatter": "no"}}'
bad 'zero_optimization.overlap_comm = 1; expected true or false' \
  '{"zero_optimization": {"stage": 2, "overlap_comm": 1}}'
bad 'zero_optimization.offload_param.device = "nvme"; libddp has no NVMe offload' \
  '{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}'
bad 'zero_optimization.zero_hpz_partition_size = 2; not supported by libddp (supported: stage, reduce_bucket_size' \
  '{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}'
bad 'fp16.enabled = true; libddp trains in the model'"'"'s f32 (or f64) on the CPU: no fp16/bf16 mixed precision and no loss scaling' \
  '{"fp16": {"enabled": true, "loss_scale": 0}}'
bad 'bf16.enabled = true' '{"bf16": {"enabled": true}}'
bad 'communication_data_type = "fp16"' '{"communication_data_type": "fp16"}'
bad "Please correct the following DeepSpeed config values that mismatch TrainingArguments values: - ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2; - ds gradient_clipping=1 vs hf max_grad_norm=0.5; - ds optimizer.params.betas=[0.9,0.99] vs hf adam_beta1+adam_beta2=[0.9, 0.999]. The easiest method is to set these DeepSpeed config values to 'auto'." \
  '{"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}}' \
  --per_device_train_batch_size 2
bad "- ds gradient_accumulation_steps=3 vs hf gradient_accumulation_steps=1; - ds train_batch_size=16 vs hf train_batch_size (calculated)=8" \
  '{"gradient_accumulation_steps": 3, "train_batch_size": 16}' --per_device_train_batch_size 4
bad "- ds optimizer.params.lr=0.001 vs hf learning_rate=0.01; - ds optimizer.params.weight_decay=0 vs hf weight_decay=0.1" \
  '{"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0}}}' "${mlp[@]}"
bad "- ds optimizer.type=Lamb vs hf optim=adamw_torch (libddp has no such optimizer" \
  '{"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}'
bad "- ds scheduler.type=WarmupLR vs hf lr_scheduler_type=linear (it is libddp's constant_with_warmup)" \
  '{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}'
bad "- ds scheduler.params.total_num_steps=100 vs hf num_training_steps (calculated)=6" \
  '{"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}'
bad "scheduler.params.warmup_type = absent (DeepSpeed's default \"log\") with 2 warmup steps: libddp's warmup is linear" \
  '{"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}}' --warmup_steps 2
bad "zero_optimization.reduce_bucket_size=1000 (4000 bytes) vs --ddp_bucket_cap_mb 25.0 (26214400 bytes): both set the bucket cap" \
  '{"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}' --ddp_bucket_cap_mb 25
bad "zero_optimization.reduce_scatter=true vs --sharding_arithmetic deepspeed_allreduce" \
  '{"zero_optimization": {"stage": 2, "reduce_scatter": true}}' --sharding_arithmetic deepspeed_allreduce
bad "zero_optimization.stage 4 is not a ZeRO stage (0, 1, 2 or 3)" '{"zero_optimization": {"stage": 4}}'
echo "ok: bad DeepSpeed config values refused"
