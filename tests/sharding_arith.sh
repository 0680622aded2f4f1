#!/usr/bin/env bash
# --sharding_arithmetic (docs/sharding.md, "Framework arithmetic"): each framework's divide
# placement and clipping order in ddp-train, on the digits MLP with AdamW, weight decay and
# clipping, threads.
#
# - At W = 3, every step's reduced gradient of DDP with each arithmetic (and of ZeRO-1 with
#   fsdp1) equals, bit for bit, tools/torch/shard_arith.py's emulation of that framework's
#   arithmetic on the ranks' local gradients (its docstring cites each framework's source);
#   the ddp emulation differs from the fsdp1 run (the check can fail).
# - At W = 3, every step's gradient norm (the one clipping divides by) of ZeRO-1 and ZeRO-2
#   under deepspeed and deepspeed_allreduce (DeepSpeed's per-partition norm) and of ZeRO-2
#   under fsdp1 (DDP's order), from the run's own dump, and of ZeRO-3 under fsdp1, fsdp2
#   and deepspeed (FSDP1's flat-shard norm, FSDP2's DTensor norm, DeepSpeed ZeRO-3's
#   partition norm), from the dump of DDP under the same arithmetic without clipping
#   (ZeRO-3 writes no dump; without clipping both runs hold the same parameters), equals
#   the emulation's; DDP's order differs from each on some step (the check can fail); the
#   ZeRO-3 ones again on GPT-2 tiny (three units, two parameter groups).
# - At W = 3, ZeRO-1, ZeRO-2 and ZeRO-3 with each arithmetic end with the parameter hash of
#   DDP with that arithmetic where the framework clips in DDP's order (ddp; fsdp1 and fsdp2
#   at ZeRO-1/2), and off it, with clipping active, where its own order changes the norm
#   (deepspeed and deepspeed_allreduce at every stage, fsdp1 and fsdp2 at ZeRO-3), with DDP's
#   under the same arithmetic again without clipping (gradient accumulation 1 and 3); ZeRO-1
#   and ZeRO-2 under DeepSpeed's arithmetic end equal. Every non-DDP arithmetic ends off
#   DDP's hash.
# - At W = 2 and 4 every arithmetic ends with DDP's hash where it clips in DDP's order.
# - A bad value and a combination with --comm_hook are refused naming them.
#
#   tests/sharding_arith.sh DDP_TRAIN SRC_ROOT
set -u
train=$(realpath "$1")
root=$(realpath "$2")
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-sharding-arith-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"
TRAIN_TIMEOUT=120
for s in 1 2 3; do echo "{\"zero_optimization\": {\"stage\": $s}}" >"ds$s.json"; done
common=(--max_steps 20 --optim adamw_torch --weight_decay 0.1 --max_grad_norm 0.5
  --learning_rate 1e-2 --logging_steps 20 --save_strategy no)
ariths="ddp fsdp1 fsdp2 deepspeed deepspeed_allreduce"

# run NAME W [ARGS...]: thread ranks; prints the final param_hash
run() { train_run "$1" threads "${@:2}"; }

# own A S: whether arithmetic A clips in its framework's own order at ZeRO-S (else DDP's)
own() { [[ $1 = deepspeed* ]] || { [ "$2" = 3 ] && [[ $1 = fsdp* ]]; }; }

n=0
for ga in 1 3; do
  ddp=$(run "ddp-3-$ga" 3 --gradient_accumulation_steps $ga)
  [ -n "$ddp" ] || fail "ddp-3-$ga: no param_hash"
  for a in $ariths; do
    ref=$(run "$a-3-$ga" 3 --gradient_accumulation_steps $ga --sharding_arithmetic $a)
    ref0=$(run "$a-3-$ga-noclip" 3 --gradient_accumulation_steps $ga --sharding_arithmetic $a \
      --max_grad_norm 0)
    if [ $a = ddp ]; then
      [ "$ref" = "$ddp" ] || fail "W = 3 GA $ga: --sharding_arithmetic ddp $ref, DDP $ddp"
    else
      [ "$ref" != "$ddp" ] || fail "W = 3 GA $ga: --sharding_arithmetic $a ends with DDP's hash"
    fi
    for s in 1 2 3; do
      got=$(run "$a-3-$ga-z$s" 3 --gradient_accumulation_steps $ga --sharding_arithmetic $a \
        --deepspeed "ds$s.json")
      eval "z$s=\$got"
      if own $a $s; then
        [ "$got" != "$ref" ] ||
          fail "W = 3 GA $ga $a: ZeRO-$s ends with DDP's hash under $a: its clipping is DDP's"
        got=$(run "$a-3-$ga-z$s-noclip" 3 --gradient_accumulation_steps $ga \
          --sharding_arithmetic $a --deepspeed "ds$s.json" --max_grad_norm 0)
        [ "$got" = "$ref0" ] ||
          fail "W = 3 GA $ga $a without clipping: ZeRO-$s $got, DDP with the same arithmetic $ref0"
      else
        [ "$got" = "$ref" ] ||
          fail "W = 3 GA $ga $a: ZeRO-$s $got, DDP with the same arithmetic $ref"
      fi
      n=$((n + 1))
    done
    if [[ $a = deepspeed* ]]; then
      [ "$z1" = "$z2" ] || fail "W = 3 GA $ga $a: ZeRO-1 $z1, ZeRO-2 $z2 (the same arithmetic)"
    fi
  done
done
echo "W = 3: $n ZeRO runs end with DDP's hash under their arithmetic, or off it by their" \
  "clipping order alone; the 4 others differ from ddp"

for w in 2 4; do
  ddp=$(run "ddp-$w" $w)
  for a in $ariths; do
    own $a 2 && continue
    got=$(run "$a-$w-z2" $w --sharding_arithmetic $a --deepspeed ds2.json)
    [ "$got" = "$ddp" ] || fail "W = $w: $a with ZeRO-2 $got, DDP $ddp (a power of two)"
  done
done
echo "W = 2, 4: every arithmetic that clips in DDP's order ends with DDP's hash"

out=$("$train" --threads 2 --max_steps 1 --sharding_arithmetic fsdp3 --output_dir bad 2>&1) &&
  fail "--sharding_arithmetic fsdp3 accepted"
grep -q "sharding_arithmetic 'fsdp3' is not one of ddp, fsdp1, fsdp2, deepspeed" <<<"$out" ||
  fail "bad value: $out"
out=$("$train" --threads 2 --max_steps 1 --sharding_arithmetic fsdp1 --comm_hook fp16 \
  --output_dir bad 2>&1) && fail "--sharding_arithmetic with --comm_hook accepted"
grep -q "sharding_arithmetic fsdp1 does not combine with --comm_hook fp16" <<<"$out" ||
  fail "comm_hook: $out"

"$py" -c 'import torch' 2>/dev/null || {
  echo "SKIP: /usr/bin/python3 has no torch (the emulation checks)"
  exit 77
}
emu="$root/tools/torch/shard_arith.py"
for a in $ariths; do
  run "dump-$a" 3 --max_steps 3 --sharding_arithmetic $a --dump_dir "dump-$a" \
    --dump_local_grads true >/dev/null
  "$py" "$emu" --check "dump-$a" --arith $a || fail "$a: the reduced gradients differ"
done
run dump-z1 3 --max_steps 3 --sharding_arithmetic fsdp1 --deepspeed ds1.json --dump_dir dump-z1 \
  --dump_local_grads true >/dev/null
"$py" "$emu" --check dump-z1 --arith fsdp1 || fail "ZeRO-1 fsdp1: the reduced gradients differ"
"$py" "$emu" --check dump-fsdp1 --arith ddp >ddp-check.log &&
  fail "the ddp emulation matches the fsdp1 run: the check cannot tell them apart"

# the clipping orders: every step's norm, clipping active (0.2 is below every step's norm).
# ZeRO-2 has no DDP reducer, so its dump holds no local gradients of the other ranks' shards:
# its norms are checked against ZeRO-1's dump under the same arithmetic, whose clipping is
# the same (DeepSpeed's stage_1_and_2 for both; DDP's order under fsdp1), so the two runs
# hold the same parameters and local gradients at every step.
for a in deepspeed deepspeed_allreduce fsdp1; do
  run "norm-$a-z1" 3 --max_steps 4 --logging_steps 1 --max_grad_norm 0.2 \
    --sharding_arithmetic $a --deepspeed ds1.json --dump_dir "dnorm-$a-z1" \
    --dump_local_grads true >/dev/null
  run "norm-$a-z2" 3 --max_steps 4 --logging_steps 1 --max_grad_norm 0.2 \
    --sharding_arithmetic $a --deepspeed ds2.json >/dev/null
  for s in 1 2; do
    "$py" "$emu" --check_norms "dnorm-$a-z1" --arith $a --mode zero$s \
      --metrics "norm-$a-z$s/metrics.jsonl" || fail "$a ZeRO-$s: the gradient norms differ"
  done
done
"$py" "$emu" --check_norms dnorm-deepspeed-z1 --arith deepspeed --mode ddp \
  --metrics norm-deepspeed-z2/metrics.jsonl >ds-ddp-order.log &&
  fail "DDP's norm order matches DeepSpeed's on every step: the check cannot tell them apart"
for a in fsdp1 fsdp2 deepspeed; do
  run "norm-$a" 3 --max_steps 4 --logging_steps 1 --max_grad_norm 0 --sharding_arithmetic $a \
    --dump_dir "dnorm-$a" --dump_local_grads true >/dev/null
  run "norm-$a-z3" 3 --max_steps 4 --logging_steps 1 --max_grad_norm 0 \
    --sharding_arithmetic $a --deepspeed ds3.json >/dev/null
  "$py" "$emu" --check_norms "dnorm-$a" --arith $a --mode zero3 \
    --metrics "norm-$a-z3/metrics.jsonl" || fail "$a ZeRO-3: the gradient norms differ"
  "$py" "$emu" --check_norms "dnorm-$a" --arith $a --mode ddp \
    --metrics "norm-$a-z3/metrics.jsonl" >"$a-ddp-order.log" &&
    fail "$a ZeRO-3: DDP's norm order matches on every step: the check cannot tell them apart"
done
# GPT-2 tiny: three ZeRO-3 units (the root: embeddings and ln_f; one per GPT2Block) and
# Transformers' two groups (LayerNorm weights and biases without decay)
printf '%s\n' '{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,' \
  '"n_layer": 2, "n_head": 4}' >gpt2.json
gpt=(--model gpt2.json --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3 --max_steps 4 --logging_steps 1
  --max_grad_norm 0)
for a in fsdp1 fsdp2 deepspeed; do
  run "gnorm-$a" 3 "${gpt[@]}" --sharding_arithmetic $a --dump_dir "dgnorm-$a" \
    --dump_local_grads true >/dev/null
  run "gnorm-$a-z3" 3 "${gpt[@]}" --sharding_arithmetic $a --deepspeed ds3.json >/dev/null
  units=$("$py" -c 'import json, sys
names = json.load(open(sys.argv[1]))["param_names"]
blocks = sorted({".".join(n.split(".")[:3]) for n in names if n.startswith("transformer.h.")})
units = [[n for n in names if not n.startswith("transformer.h.")]]
units += [[n for n in names if n.startswith(b + ".")] for b in blocks]
print(";".join(",".join(u) for u in units))' "dgnorm-$a/rank0/ddp.json")
  "$py" "$emu" --check_norms "dgnorm-$a" --arith $a --mode zero3 --units "$units" \
    --metrics "gnorm-$a-z3/metrics.jsonl" || fail "GPT-2 $a ZeRO-3: the gradient norms differ"
done
echo "PASS"
