#!/usr/bin/env bash
# ZeRO-3 prefetch and the flight recorder's unit tags (docs/sharding.md, "Prefetch"):
# GPT-2 tiny (3 GPT2Blocks), W = 3 on threads and W = 2 on shm, gradient accumulation 2:
# every --fsdp_config prefetch setting (backward_prefetch pre/post/none in Transformers'
# spellings, forward_prefetch, limit_all_gathers, reshard_after_forward, version 2) ends
# with DDP's param_hash; a ZeRO-3 run's flight-recorder dump (rank 1 hangs at step 2, rank 0
# times out) tags each all-gather and reduce-scatter with its unit, its purpose and its
# first parameter names, and shows the prefetches in FSDP's order; bad values are refused
# naming them.
#
#   tests/fsdp_prefetch.sh DDP_TRAIN DDPRUN SRC_ROOT
set -u
train=$(realpath "$1")
ddprun=$(realpath "$2")
root=$(realpath "$3")
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/ddp-fsdp-prefetch-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
. "$root/tests/train_run.sh"
TRAIN_TIMEOUT=120
printf '%s\n' '{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32,' \
  '"n_layer": 3, "n_head": 4}' >gpt2.json
common=(--max_steps 8 --optim adamw_torch --weight_decay 0.1 --max_grad_norm 0.5
  --logging_steps 8 --save_strategy no --model gpt2.json
  --data "$root/tests/data/kjv_genesis_exodus.txt" --block_size 16
  --per_device_train_batch_size 2 --learning_rate 1e-3 --gradient_accumulation_steps 2)

run() { train_run "$@"; }

configs=('{"backward_prefetch": "backward_pre"}'
  '{"fsdp_backward_prefetch": "BACKWARD_POST", "limit_all_gathers": "false"}'
  '{"backward_prefetch": "NO_PREFETCH", "forward_prefetch": true}'
  '{"backward_prefetch": false, "forward_prefetch": "true", "limit_all_gathers": true}'
  '{"forward_prefetch": true, "backward_prefetch": "BACKWARD_PRE", "reshard_after_forward": false}'
  '{"version": 2, "reshard_after_forward": true}'
  '{"version": 2, "reshard_after_forward": false}')
for bw in threads:3 shm:2; do
  be=${bw%:*} w=${bw#*:}
  ref=$(run ddp-$be $be $w)
  [ -n "$ref" ] || fail "ddp-$be: no param_hash"
  i=0
  for cfg in "${configs[@]}"; do
    [ $be = shm ] && [ $i -ge 3 ] && break # shm: the three backward modes
    h=$(run z$i-$be $be $w --fsdp "full_shard auto_wrap" --fsdp_config "$cfg")
    [ "$h" = "$ref" ] || fail "$be W=$w $cfg: $h, DDP $ref"
    grep -q '"sharding": "zero3"' z$i-$be/metrics.jsonl || fail "z$i-$be did not run ZeRO-3"
    i=$((i + 1))
  done
done
echo "ok: every prefetch setting ends with DDP's param_hash"

# The flight recorder's dump of a ZeRO-3 run with forward and backward_pre prefetch.
DDP_FR_DUMP_DIR=$work/fr timeout -k 5 60 "$train" --threads 2 "${common[@]}" --output_dir frz \
  --fsdp "full_shard auto_wrap" \
  --fsdp_config '{"backward_prefetch": "backward_pre", "forward_prefetch": true}' \
  --ddp_fault rank=1,step=2,kind=hang --ddp_timeout 2 >frz.log 2>&1 &&
  fail "the hang did not fail the job"
for r in 0 1; do [ -s fr/fr_rank_$r.json ] || fail "no dump from rank $r"; done
"$py" - fr/fr_rank_0.json fr/fr_rank_1.json <<'PY' || fail "the dumps' unit tags"
import json, sys
h0 = "transformer.h.0.ln_1.weight,transformer.h.0.ln_1.bias,transformer.h.0.attn.c_attn.weight"
for path in sys.argv[1:]:
    tags = [e.get("ddp_tag", "") for e in json.load(open(path))["entries"]]
    want = [  # step 0 (collective #2 on): no forward prefetch yet (no previous order)
        "fsdp unit 0 all_gather (root), 4 params: transformer.wte.weight,transformer.wpe.weight,"
        "transformer.ln_f.weight,transformer.ln_f.bias",
        "fsdp unit 1 all_gather (forward), 12 params: " + h0,
        "fsdp unit 2 all_gather (forward), 12 params: transformer.h.1.ln_1.weight",
        "fsdp unit 3 all_gather (forward), 12 params: transformer.h.2.ln_1.weight",
        "fsdp unit 3 all_gather (backward), 12 params: transformer.h.2.ln_1.weight",
        "fsdp unit 2 all_gather (backward_pre prefetch), 12 params: transformer.h.1.",
        # the first micro-batch is no_sync (gradient accumulation 2): no reduction
        "fsdp unit 1 all_gather (backward_pre prefetch), 12 params: " + h0,
    ]
    for k, w in enumerate(want):
        assert tags[2 + k].startswith(w), (path, 2 + k, tags[2 + k], w)
    # the synchronising micro-batch reduces each unit, last first, tagged likewise
    red = [t.split(",")[0] for t in tags if "reduce_scatter" in t or "for the norm" in t]
    assert red[:8] == ["fsdp unit %d %s" % (u, w) for u in (3, 2, 1, 0) for w in
                       ("reduce_scatter (gradient)", "all_gather (gradient")], red[:8]
    # the second micro-batch forward prefetches units 2 and 3 in the first one's order
    assert any(t.startswith("fsdp unit 2 all_gather (forward prefetch)") for t in tags), path
    assert any(t.startswith("fsdp unit 3 all_gather (forward prefetch)") for t in tags), path
    assert all(len(t) < 256 for t in tags), path
print("ok: each ZeRO-3 collective in the dumps carries its unit and parameters")
PY

# Bad values of the prefetch keys, each refused naming it.
fsdp_err() { expect_err "$1" --fsdp full_shard "${@:2}"; }
fsdp_err "--fsdp_config: 'backward_prefetch' = \"backward_mid\"; expected backward_pre, backward_post or no_prefetch" \
  --fsdp_config '{"backward_prefetch": "backward_mid"}'
fsdp_err "--fsdp_config: 'forward_prefetch' = 1; expected true or false" \
  --fsdp_config '{"forward_prefetch": 1}'
fsdp_err "--fsdp_config: 'version' = 3; expected 1 or 2" --fsdp_config '{"version": 3}'
fsdp_err "--fsdp_config: 'forward_prefetch' is an FSDP1 option; with \"version\": 2 (FSDP2)" \
  --fsdp_config '{"version": 2, "forward_prefetch": true}'
fsdp_err "--fsdp_config: key 'activation_checkpointing' = true is not supported" \
  --fsdp_config '{"activation_checkpointing": true}'
echo "ok: bad --fsdp_config values refused"
