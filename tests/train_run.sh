# shellcheck shell=bash disable=SC2154  # train, ddprun, common: set by the sourcing test
# What the ddp-train shell tests share (sharding.sh, fsdp_prefetch.sh, sharding_arith.sh):
# sourced after the caller sets `train` (ddp-train's path), `ddprun` (for a backend other
# than threads) and the array `common` (the flags every run takes), in its scratch
# directory. TRAIN_TIMEOUT (seconds, default 300) bounds each run.

fail() {
  echo "FAIL: $*"
  exit 1
}

# train_run NAME BACKEND W [ARGS...]: ddp-train with common + ARGS into output_dir NAME, on W
# thread ranks (BACKEND threads) or under `ddprun --standalone` (a port from the OS) on
# BACKEND; its output in NAME.log, shown when it fails, which fails the test. Prints the
# final param_hash of NAME/metrics.jsonl.
train_run() {
  local name=$1 be=$2 w=$3
  shift 3
  if [ "$be" = threads ]; then
    timeout -k 5 "${TRAIN_TIMEOUT:-300}" "$train" --threads "$w" "${common[@]}" \
      --output_dir "$name" "$@" >"$name.log" 2>&1
  else
    timeout -k 5 "${TRAIN_TIMEOUT:-300}" "$ddprun" --nproc_per_node "$w" --backend "$be" \
      --standalone "$train" "${common[@]}" --output_dir "$name" "$@" >"$name.log" 2>&1
  fi || {
    cat "$name.log"
    fail "$name: ddp-train failed"
  }
  grep -o '"param_hash": "[0-9a-f]*"' "$name/metrics.jsonl" | tail -1
}

# expect_err WHAT ARGS...: ddp-train --threads 2 with common + ARGS must fail, its output
# containing WHAT (the value or flag the error names).
expect_err() {
  local what=$1
  shift
  if timeout -k 5 60 "$train" --threads 2 "${common[@]}" --output_dir bad "$@" >bad.log 2>&1; then
    fail "accepted: $*"
  fi
  grep -qF -- "$what" bad.log || {
    cat bad.log
    fail "no '$what' for: $*"
  }
}
