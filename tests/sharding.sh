#!/usr/bin/env bash
# ZeRO-1/2/3 in ddp-train (docs/sharding.md): the final parameter hash equals DDP's bit for bit
# (digits MLP, GPT-2 tiny, BERT tiny and Llama tiny, AdamW with weight decay and clipping, 20 steps, gradient
# accumulation 1 and 3, W = 2, 3, 4, threads, shm and tcp), checkpoints (shards,
# consolidation, resume at another W, a flipped bit caught; ZeRO-3's FULL_STATE_DICT and
# SHARDED_STATE_DICT), the per-rank state bytes of
# metrics.jsonl equal the formulas, ZeRO-1's --zero_parameters_as_bucket_view (DDP's hash) and
# --zero_comm_hook (the overlapped hooks agree with each other), and bad input is refused
# naming the value.
#
#   tests/sharding.sh DDP_TRAIN DDPRUN SRC_ROOT
#   SHARDING_FULL=1 tests/sharding.sh ...   every model x backend x W x GA (CI runs a cut)
set -u
train=$(realpath "$1")
ddprun=$(realpath "$2")
root=$(realpath "$3")
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-sharding-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"

printf '%s\n' '{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,' \
  '"n_layer": 2, "n_head": 4}' >gpt2.json
printf '%s\n' '{"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 32,' \
  '"num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256,' \
  '"max_position_embeddings": 64, "num_labels": 3}' >bert.json
printf '%s\n' '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,' \
  '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,' \
  '"intermediate_size": 172, "max_position_embeddings": 64}' >llama.json
echo '{"zero_optimization": {"stage": 1}}' >ds1.json
# reduce_bucket_size: the reducer's bucket cap (elements; tests/ds_config.sh checks it)
echo '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}}' >ds2.json
echo '{"zero_optimization": {"stage": 3}}' >ds3.json
common=(--max_steps 20 --optim adamw_torch --weight_decay 0.1 --max_grad_norm 0.5
  --logging_steps 20 --save_strategy no)
mlp=(--learning_rate 1e-2)
gpt=(--model gpt2.json --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3)
bert=(--model bert.json --data "$root/tests/data/text_topics.csv" --max_seq_length 16
  --per_device_train_batch_size 2 --learning_rate 1e-3)
llama=(--model llama.json --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3)
n=0

run() { train_run "$@"; }

for model in mlp gpt bert llama; do
  case $model in
    mlp) margs=("${mlp[@]}") ;;
    gpt) margs=("${gpt[@]}") ;;
    bert) margs=("${bert[@]}") ;;
    llama) margs=("${llama[@]}") ;;
  esac
  for be in threads shm tcp; do
    for w in 2 3 4; do
      # SHARDING_FULL=1 (outside CI): every model, backend, W and GA; CI runs the cut below,
      # and under DDP_TEST_CUT=1 (tools/test.sh --sanitize) every model on threads at W = 3,
      # the MLP and GPT-2 on shm at W = 2 with GA 3, and the MLP on threads at W = 2 with
      # GA 1: every sharded path once under ASan, and the runs the checks below read
      if [ "${DDP_TEST_CUT:-0}" = 1 ] && { [ $be = tcp ] || [ $w = 4 ] ||
        { [ $be = shm ] && [ $w = 3 ]; } ||
        { [ $be = threads ] && [ $w = 2 ] && [ $model != mlp ]; } ||
        { { [ $model = bert ] || [ $model = llama ]; } && { [ $be != threads ] || [ $w != 3 ]; }; }; }; then
        continue
      fi
      if [ "${SHARDING_FULL:-0}" != 1 ]; then
      # GPT-2 on shm: W = 2 and 3 only (two cores; the threads runs cover W = 4); tcp: W = 2
      # and 3, and GPT-2 at W = 2 with GA 3 only (tcp's path is the same reduce-scatter and
      # all-gather; its sockets and processes are the slow part on two cores)
      [ $model = gpt ] && [ $be = shm ] && [ $w = 4 ] && continue
      [ $be = tcp ] && [ $w = 4 ] && continue
      [ $model = gpt ] && [ $be = tcp ] && [ $w = 3 ] && continue
      # BERT: threads at W = 2 and 3 and shm at W = 2 (its units are BertLayers, the path
      # the other two models cover on every backend)
      [ $model = bert ] && { [ $be = tcp ] || [ $w = 4 ] || { [ $be = shm ] && [ $w = 3 ]; }; } &&
        continue
      # Llama: threads at W = 2 and 3 (its units are LlamaDecoderLayers)
      [ $model = llama ] && { [ $be != threads ] || [ $w = 4 ]; } && continue
      fi
      for ga in 1 3; do
        [ "${SHARDING_FULL:-0}" != 1 ] && [ $model = gpt ] && [ $be = tcp ] && [ $ga = 1 ] &&
          continue
        [ "${DDP_TEST_CUT:-0}" = 1 ] && [ $be = shm ] && [ $ga = 1 ] && continue
        [ "${DDP_TEST_CUT:-0}" = 1 ] && [ $be = threads ] && [ $w = 2 ] && [ $ga = 3 ] && continue
        tag=$model-$be-$w-$ga
        ref=$(run "ddp-$tag" $be $w "${margs[@]}" --gradient_accumulation_steps $ga)
        [ -n "$ref" ] || fail "ddp-$tag: no param_hash"
        for mode in "--deepspeed ds1.json" "--deepspeed ds2.json" "--fsdp shard_grad_op" \
          "--deepspeed ds3.json"; do
          # shellcheck disable=SC2086
          h=$(run "z$n-$tag" $be $w "${margs[@]}" --gradient_accumulation_steps $ga $mode)
          [ "$h" = "$ref" ] || fail "$tag $mode: $h, DDP $ref"
          n=$((n + 1))
        done
      done
    done
  done
  echo "ok: $model: ZeRO-1/2/3 end with DDP's param_hash ($n runs so far)"
done

# ZeRO-2 with gradient_as_bucket_view at W = 3 (where x fl(1/3) and / 3 differ): the reducer
# multiplies gradients into its buckets and divides in place only those still bucket views
# (zero_grad(set_to_none=False), from the second step on); ZeRO-2 divides the same way.
for ztn in true false; do
  gav=(--gradient_as_bucket_view true --zero_grad_set_to_none $ztn)
  ref=$(run "ddp-gav-$ztn" threads 3 "${mlp[@]}" "${gav[@]}")
  h=$(run "z2-gav-$ztn" threads 3 "${mlp[@]}" "${gav[@]}" --deepspeed ds2.json)
  [ "$h" = "$ref" ] || fail "ZeRO-2 gradient_as_bucket_view, set_to_none $ztn: $h, DDP $ref"
done
echo "ok: ZeRO-2 with gradient_as_bucket_view ends with DDP's param_hash"

# ZeRO-3 through --fsdp with an explicit wrap policy: the MLP's Linear layers as units by
# size (min_num_params), GPT-2 one unit per GPT2Block, BERT per BertLayer, Llama per
# LlamaDecoderLayer
# (transformer_layer_cls_to_wrap), W = 3.
for model in mlp gpt bert llama; do
  case $model in
    mlp) margs=("${mlp[@]}" --fsdp_config '{"min_num_params": 1000}') ;;
    llama) margs=("${llama[@]}" --fsdp_config '{"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}') ;;
    gpt) margs=("${gpt[@]}" --fsdp_config '{"transformer_layer_cls_to_wrap": ["GPT2Block"]}') ;;
    bert) margs=("${bert[@]}" --fsdp_config '{"transformer_layer_cls_to_wrap": "BertLayer"}') ;;
  esac
  for ga in 1 3; do
    ref=$(grep -o '"param_hash": "[0-9a-f]*"' "ddp-$model-threads-3-$ga/metrics.jsonl" | tail -1)
    h=$(run "zf-$model-$ga" threads 3 "${margs[@]}" --gradient_accumulation_steps $ga \
      --fsdp "full_shard auto_wrap")
    [ "$h" = "$ref" ] || fail "$model GA $ga --fsdp full_shard auto_wrap: $h, DDP $ref"
  done
done
echo "ok: --fsdp full_shard auto_wrap (size and class policies) ends with DDP's param_hash"

# State bytes (f32 AdamW, Ψ parameters): per rank params 4Ψ, grads 4Ψ (ZeRO-2: 4Ψ_r), optimizer
# state 8Ψ (ZeRO-1/2: 8Ψ_r) where Ψ_r is the rank's partition, so the mean over the ranks is
# the formula: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/W, ZeRO-2 4Ψ + 12Ψ/W.
check_bytes() { # DIR KIND W
  /usr/bin/env python3 - "$1/metrics.jsonl" "$2" "$3" <<'PY' || fail "state bytes of $1"
import json, sys
path, kind, W = sys.argv[1], sys.argv[2], int(sys.argv[3])
line = [json.loads(l) for l in open(path) if '"param_bytes"' in l][-1]
psi = line["param_bytes"][0] // 4
if kind == "zero3":  # every byte sharded: Ψ is the sum of the ranks' parameter elements
    psi = sum(line["param_bytes"]) // 4
    assert len(line["gathered_bytes"]) == W and min(line["gathered_bytes"]) > 0, line
else:
    assert all(p == 4 * psi for p in line["param_bytes"]), line
f = {"ddp": (16, 0), "zero1": (8, 8), "zero2": (4, 12), "zero3": (0, 16)}[kind]
total = sum(line["state_bytes"])
assert line["sharding"] == kind, line["sharding"]
assert total == W * f[0] * psi + f[1] * psi, (kind, total, W * f[0] * psi + f[1] * psi)
assert len(line["state_bytes"]) == W
print("ok: %s W=%d Ψ=%d per-rank state bytes %s, mean %.1fΨ" % (kind, W, psi,
      line["state_bytes"], total / W / psi))
PY
}
check_bytes ddp-gpt-threads-3-1 ddp 3
check_bytes z0-mlp-threads-2-1 zero1 2
check_bytes "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 1p)" zero1 3
check_bytes "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 2p)" zero2 3
check_bytes "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 3p)" zero2 3
check_bytes "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 4p)" zero3 3
check_bytes zf-gpt-1 zero3 3

# Traffic: the bytes each rank sent in the last step (metrics.jsonl sent_bytes, the flight
# recorder's ring-model count: all-reduce 2(W-1)/W S, all-gather, reduce-scatter and broadcast
# (W-1)/W S), GPT-2 tiny at W = 3 (Ψ = 35712 in P = 28 tensors, 4 bytes each), exactly:
#   DDP     2Ψ(W-1)/W, plus the reducer's used-parameter map (P int32, all-reduced);
#   ZeRO-1  DDP's, plus the owners' broadcasts Ψ(W-1)/W (ZeroRedundancyOptimizer's: 1.5x DDP's)
#           and the clipping norms (P f64, all-reduced);
#   ZeRO-2  (--fsdp shard_grad_op: DDP's bucket caps, not ds2.json's 5000 elements) one bucket
#           here (Ψ < 1 MiB), reduce-scattered over the owners' segments padded to
#           the largest, Ψ_r = max_r grad_bytes / 4: 4WΨ_r(W-1)/W, then the owners' broadcasts
#           4Ψ(W-1)/W, plus the norms;
#   ZeRO-3  3Ψ'(W-1)/W (all-gather in forward, reduce-scatter; Ψ' the padded units) less the
#           root unit (no re-gather in backward), which is FSDP's, plus Ψ'(W-1)/W (the gradient
#           all-gather that takes the norm in DDP's order).
check_sent() { # DIR KIND W
  /usr/bin/env python3 - "$1/metrics.jsonl" "$2" "$3" <<'PY' || fail "sent bytes of $1"
import json, sys
path, kind, W = sys.argv[1], sys.argv[2], int(sys.argv[3])
line = [json.loads(l) for l in open(path) if '"sent_bytes"' in l][-1]
psi, P, root = 35712, 28, 256 * 32 + 64 * 32 + 2 * 32  # wte, wpe, ln_f: ZeRO-3's root unit
f = (W - 1) / W
ar = lambda b: 2 * f * b
if kind == "ddp":
    want = ar(4 * psi) + ar(4 * P)
elif kind == "zero1":
    want = ar(4 * psi) + ar(4 * P) + f * 4 * psi + ar(8 * P)
elif kind == "zero2":
    want = f * W * max(line["grad_bytes"]) + f * 4 * psi + ar(8 * P)
else:
    pad = lambda n: -(-n // W) * W
    psi_pad = W * line["param_bytes"][0] // 4  # rank 0 holds every unit's full shard
    want = f * 4 * (4 * psi_pad - pad(root))
sent = line["sent_bytes"]
want = want if isinstance(want, list) else [want] * W
assert len(sent) == W and all(abs(s - w) < 0.01 for s, w in zip(sent, want)), (kind, sent, want)
print("ok: %s W=%d sent %.2f bytes per rank per step (mean) = %.4f x DDP's 2Ψ(W-1)/W" %
      (kind, W, sum(sent) / W, sum(sent) / W / ar(4 * psi)))
PY
}
check_sent ddp-gpt-threads-3-1 ddp 3
check_sent "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 1p)" zero1 3
check_sent "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 3p)" zero2 3
check_sent "$(ls -d z*-gpt-threads-3-1 | sort -t z -k2 -n | sed -n 4p)" zero3 3
check_sent zf-gpt-1 zero3 3

# Checkpoints (MLP, threads): ZeRO-1 at W = 4 saves at steps 10 and 20, each rank its
# optimizer shard (optimizer[_group1]-0000r-of-00004.safetensors), rank 0 the consolidated
# files, byte for byte DDP's; resuming at W = 4 ends as the uninterrupted run; at W = 2 and
# 3 (ZeRO-1 and ZeRO-2) as DDP resumed from the same checkpoint; a flipped bit in one shard
# is caught naming it.
save=(--save_strategy steps --save_steps 10)
h4=$(run zc-4 threads 4 "${mlp[@]}" --deepspeed ds1.json "${save[@]}")
d4=$(run zc-ddp-4 threads 4 "${mlp[@]}" "${save[@]}")
[ "$h4" = "$d4" ] || fail "checkpointed ZeRO-1 W=4 $h4, DDP $d4"
ck=zc-4/checkpoint-10
for f in optimizer.safetensors optimizer_group1.safetensors; do
  cmp -s "$ck/$f" "zc-ddp-4/checkpoint-10/$f" || fail "$ck/$f differs from DDP's"
done
for r in 1 2 3 4; do
  for f in optimizer optimizer_group1; do
    [ -f "$ck/$f-0000$r-of-00004.safetensors" ] || fail "no $f shard of rank $((r - 1))"
    grep -q " $f-0000$r-of-00004.safetensors\$" "$ck/checksums.sha256" ||
      fail "shard $f-0000$r-of-00004 not in checksums.sha256"
  done
done
h=$(run zc-r4 threads 4 "${mlp[@]}" --deepspeed ds1.json --resume_from_checkpoint "$ck")
[ "$h" = "$h4" ] || fail "ZeRO-1 resumed at W=4: $h, uninterrupted $h4"
for w in 2 3; do
  ref=$(run zc-rddp-$w threads $w "${mlp[@]}" --resume_from_checkpoint "$ck")
  for ds in ds1 ds2; do
    h=$(run zc-r$w-$ds threads $w "${mlp[@]}" --deepspeed $ds.json --resume_from_checkpoint "$ck")
    [ "$h" = "$ref" ] || fail "$ds resumed at W=$w from W=4: $h, DDP resumed $ref"
  done
done
cp -r "$ck" flipped
/usr/bin/env python3 - flipped/optimizer-00002-of-00004.safetensors <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[-5] ^= 0x10
open(sys.argv[1], "wb").write(bytes(b))
PY
if timeout -k 5 60 "$train" --threads 2 "${common[@]}" "${mlp[@]}" --deepspeed ds1.json \
  --output_dir zc-bad --resume_from_checkpoint flipped >zc-bad.log 2>&1; then
  fail "resumed from a flipped shard"
fi
grep -q "flipped/optimizer-00002-of-00004.safetensors is corrupt" zc-bad.log || {
  cat zc-bad.log
  fail "the flipped shard is not named"
}
echo "ok: ZeRO checkpoints: shards, consolidated = DDP's bytes, resume at W = 4, 2, 3, flipped bit caught"

# ZeRO-3 checkpoints (MLP, threads, units by size): FULL_STATE_DICT (the default) at W = 4
# gathers the units and writes DDP's files byte for byte; SHARDED_STATE_DICT has each rank
# write its flat shards (pytorch_model_fsdp_0-0000r-of-00004, optimizer_0-0000r-of-00004, in
# checksums.sha256, no model.safetensors). Each resumes at W = 4 as the uninterrupted run and
# at W = 2 and 3 as DDP resumed from DDP's checkpoint (zc-rddp-W above); the flipped bit, the
# refusals and another wrap policy are in "Bad input" below.
z3=(--fsdp full_shard --fsdp_config '{"min_num_params": 1000}')
z3s=(--fsdp full_shard --fsdp_config '{"min_num_params": 1000, "state_dict_type": "SHARDED_STATE_DICT"}')
h=$(run z3c-full threads 4 "${mlp[@]}" "${z3[@]}" "${save[@]}")
[ "$h" = "$d4" ] || fail "checkpointed ZeRO-3 W=4 $h, DDP $d4"
h=$(run z3c-sharded threads 4 "${mlp[@]}" "${z3s[@]}" "${save[@]}")
[ "$h" = "$d4" ] || fail "checkpointed ZeRO-3 (SHARDED_STATE_DICT) W=4 $h, DDP $d4"
for f in model.safetensors optimizer.safetensors optimizer_group1.safetensors; do
  cmp -s "z3c-full/checkpoint-10/$f" "zc-ddp-4/checkpoint-10/$f" ||
    fail "ZeRO-3 FULL_STATE_DICT $f differs from DDP's"
done
ck=z3c-sharded/checkpoint-10
[ -e $ck/model.safetensors ] && fail "$ck has a model.safetensors"
for r in 1 2 3 4; do
  for f in pytorch_model_fsdp_0 optimizer_0; do
    [ -f "$ck/$f-0000$r-of-00004.safetensors" ] || fail "no $f shard of rank $((r - 1))"
    grep -q " $f-0000$r-of-00004.safetensors\$" "$ck/checksums.sha256" ||
      fail "shard $f-0000$r-of-00004 not in checksums.sha256"
  done
done
for kind in full sharded; do
  h=$(run z3c-r4-$kind threads 4 "${mlp[@]}" "${z3[@]}" --resume_from_checkpoint z3c-$kind/checkpoint-10)
  [ "$h" = "$d4" ] || fail "ZeRO-3 resumed ($kind) at W=4: $h, uninterrupted $d4"
  for w in 2 3; do
    ref=$(grep -o '"param_hash": "[0-9a-f]*"' "zc-rddp-$w/metrics.jsonl" | tail -1)
    h=$(run z3c-r$w-$kind threads $w "${mlp[@]}" "${z3[@]}" --resume_from_checkpoint z3c-$kind/checkpoint-10)
    [ "$h" = "$ref" ] || fail "ZeRO-3 resumed ($kind) at W=$w from W=4: $h, DDP resumed $ref"
  done
done
# GPT-2 tiny at W = 3 (a unit per GPT2Block): FULL_STATE_DICT in Hugging Face's sharded layout
# (--max_shard_size) equal to DDP's files; SHARDED_STATE_DICT resumed at W = 2 as DDP resumed.
gsave=("${save[@]}" --max_shard_size 50KB)
d=$(run z3g-ddp threads 3 "${gpt[@]}" "${gsave[@]}")
h=$(run z3g-full threads 3 "${gpt[@]}" "${gsave[@]}" --fsdp "full_shard auto_wrap")
[ "$h" = "$d" ] || fail "checkpointed GPT-2 ZeRO-3 W=3 $h, DDP $d"
[ -f z3g-ddp/checkpoint-10/model-00002-of-00004.safetensors ] || fail "GPT-2: no HF shards"
for p in z3g-ddp/checkpoint-10/*; do
  f=${p##*/}
  case $f in trainer_state.json | checksums.sha256) continue ;; esac
  cmp -s "z3g-full/checkpoint-10/$f" "$p" ||
    fail "GPT-2 ZeRO-3 FULL_STATE_DICT $f differs from DDP's"
done
h=$(run z3g-sharded threads 3 "${gpt[@]}" "${gsave[@]}" --fsdp "full_shard auto_wrap" \
  --fsdp_config '{"state_dict_type": "SHARDED_STATE_DICT"}')
[ "$h" = "$d" ] || fail "checkpointed GPT-2 ZeRO-3 (SHARDED_STATE_DICT) W=3 $h, DDP $d"
ref=$(run z3g-rddp threads 2 "${gpt[@]}" --resume_from_checkpoint z3g-ddp/checkpoint-10)
h=$(run z3g-r2 threads 2 "${gpt[@]}" --fsdp "full_shard auto_wrap" \
  --resume_from_checkpoint z3g-sharded/checkpoint-10)
[ "$h" = "$ref" ] || fail "GPT-2 ZeRO-3 resumed (SHARDED) at W=2 from W=3: $h, DDP resumed $ref"
echo "ok: ZeRO-3 checkpoints: FULL = DDP's bytes (MLP, GPT-2 HF shards), SHARDED per-rank shards, resume at W = 4, 2, 3"

# Bad input: each a clear error naming the value.
# ZeRO-1 with PyTorch's parameters_as_bucket_view (one flat bucket per rank, one broadcast
# each): DDP's param_hash. MLP and GPT-2 tiny, W = 2 and 3, threads and shm.
for model in mlp gpt; do
  [ $model = mlp ] && margs=("${mlp[@]}") || margs=("${gpt[@]}")
  for be in threads shm; do
    for w in 2 3; do
      tag=bv-$model-$be-$w
      ref=$(run "ddp-$tag" $be $w "${margs[@]}")
      h=$(run "$tag" $be $w "${margs[@]}" --deepspeed ds1.json --zero_parameters_as_bucket_view true)
      if [ -z "$ref" ] || [ "$h" != "$ref" ]; then fail "$tag: $h, DDP $ref"; fi
    done
  done
done
# and a checkpoint of it resumes bit for bit (the buckets are views: save and load follow them)
bv=(--deepspeed ds1.json --zero_parameters_as_bucket_view true)
ref=$(run bv-full threads 2 "${mlp[@]}" "${bv[@]}")
run bv-save threads 2 "${mlp[@]}" "${bv[@]}" --save_strategy steps --save_steps 10 >/dev/null
h=$(run bv-save threads 2 "${mlp[@]}" "${bv[@]}" --resume_from_checkpoint bv-save/checkpoint-10)
[ "$h" = "$ref" ] || fail "bucket view resumed from step 10: $h, uninterrupted $ref"
grep -q "(from step 10)" bv-save.log || fail "bucket view: the second run did not resume"
echo "ok: ZeRO-1 --zero_parameters_as_bucket_view ends with DDP's param_hash, and resumes"

# The overlapped ZeRO-1 (--zero_comm_hook, PyTorch's hook_with_zero_step): its first 2 steps
# update nothing, so it cannot end with DDP's hash (test_zero_hook checks it against DDP
# with those 2 updates skipped, bit for bit). Here: both hooks, with and without
# shard_buckets, on threads and shm, end with the same bits, and not DDP's.
ovl=(--deepspeed ds1.json --max_grad_norm 0 --ddp_find_unused_parameters false)
for model in mlp gpt; do
  [ $model = mlp ] && margs=("${mlp[@]}" --ddp_bucket_cap_mb 0.01) ||
    margs=("${gpt[@]}" --ddp_bucket_cap_mb 0.05 --gradient_accumulation_steps 3)
  for w in 2 3; do
    ref=$(run "ovl-ddp-$model-$w" threads $w "${margs[@]}" --max_grad_norm 0)
    first=
    for be in threads shm; do
      for hk in hook_with_zero_step hook_with_zero_step_interleaved; do
        for sb in false true; do
          [ $be = shm ] && [ $sb = true ] && continue
          tag=ovl-$model-$be-$w-$hk-$sb
          h=$(run "$tag" $be $w "${margs[@]}" "${ovl[@]}" --zero_comm_hook $hk --zero_shard_buckets $sb)
          [ -n "$h" ] || fail "$tag: no param_hash"
          [ -n "$first" ] || first=$h
          [ "$h" = "$first" ] || fail "$tag: $h, the first hook run $first"
          [ "$h" != "$ref" ] || fail "$tag: DDP's hash $ref although 2 steps update nothing"
        done
      done
    done
  done
done
echo "ok: --zero_comm_hook hook_with_zero_step and _interleaved (shard_buckets or not) agree bit for bit"

echo '{"zero_optimization": {"stage": 7}}' >ds7.json
echo '{"zero_optimization": {"stage": "two"}}' >dsx.json
cp -r z3c-sharded/checkpoint-10 z3flip
/usr/bin/env python3 - z3flip/pytorch_model_fsdp_0-00003-of-00004.safetensors <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[-5] ^= 0x10
open(sys.argv[1], "wb").write(bytes(b))
PY
expect_err "z3flip/pytorch_model_fsdp_0-00003-of-00004.safetensors is corrupt" "${mlp[@]}" "${z3[@]}" \
  --resume_from_checkpoint z3flip
expect_err "z3c-sharded/checkpoint-10 is a ZeRO-3 SHARDED_STATE_DICT checkpoint (pytorch_model_fsdp_0-*-of-00004 shards, no model.safetensors), which only ZeRO-3" \
  --deepspeed ds1.json --resume_from_checkpoint z3c-sharded/checkpoint-10
expect_err "pytorch_model_fsdp_0-00001-of-00004.safetensors was written for another model or wrap policy: units of 0,8320,16512,1290 elements (6 parameters), this model's 26122" \
  --deepspeed ds3.json --resume_from_checkpoint z3c-sharded/checkpoint-10
expect_err "--fsdp_config: 'state_dict_type' = \"LOCAL_STATE_DICT\"; expected FULL_STATE_DICT or SHARDED_STATE_DICT" \
  --fsdp full_shard --fsdp_config '{"state_dict_type": "LOCAL_STATE_DICT"}'
expect_err "transformer_layer_cls_to_wrap names 'GPT2Layer', which is no module of the model (its wrappable modules: GPT2Block)" \
  "${gpt[@]}" --fsdp "full_shard auto_wrap" --fsdp_config '{"transformer_layer_cls_to_wrap": "GPT2Layer"}'
expect_err "--fsdp_config: key 'sync_module_states'" --fsdp full_shard \
  --fsdp_config '{"sync_module_states": true}'
expect_err 'zero_optimization.stage 7 is not a ZeRO stage (0, 1, 2 or 3)' --deepspeed ds7.json
expect_err 'zero_optimization.stage "two" is not a ZeRO stage' --deepspeed dsx.json
expect_err "--fsdp 'shard_grad_op' and --deepspeed ds1.json: only one of FSDP and DeepSpeed" \
  --fsdp shard_grad_op --deepspeed ds1.json
expect_err "--fsdp: option 'sharded_grad' is unknown; choices: full_shard (ZeRO-3), shard_grad_op" \
  --fsdp sharded_grad
expect_err "--fsdp: option 'offload' is not supported by libddp" --fsdp "full_shard offload"
expect_err "nosuch.json" --deepspeed nosuch.json
expect_err "--zero_comm_hook hook_with_zero_step (ZeRO stage 1) does not combine with find_unused_parameters" \
  --deepspeed ds1.json --max_grad_norm 0 --zero_comm_hook hook_with_zero_step
expect_err "does not combine with --max_grad_norm > 0" --deepspeed ds1.json \
  --ddp_find_unused_parameters false --zero_comm_hook hook_with_zero_step_interleaved
expect_err "--zero_comm_hook 'hook_with_zero' is not one of no, hook_with_zero_step" \
  --deepspeed ds1.json --zero_comm_hook hook_with_zero
expect_err "--zero_parameters_as_bucket_view is PyTorch ZeroRedundancyOptimizer's (ZeRO-1): it needs --deepspeed with zero_optimization.stage 1 (the ZeRO stage is 2)" \
  --deepspeed ds2.json --zero_parameters_as_bucket_view true
expect_err "--zero_comm_hook is PyTorch ZeroRedundancyOptimizer's (ZeRO-1)" \
  --zero_comm_hook hook_with_zero_step
# GPT-2 tiny in one bucket: shard_buckets would need more runs than ranks (PyTorch asserts)
expect_err "shard_buckets cut DDP bucket 0 (35712 elements) into more than 2 runs" "${gpt[@]}" \
  "${ovl[@]}" --zero_comm_hook hook_with_zero_step --zero_shard_buckets true
echo "ok: bad input refused"
