#!/usr/bin/env bash
# The flight recorder under ddprun (docs/launcher.md "Failures", docs/errors.md "Flight
# recorder"): when rank 1 hangs (DDP_FAULT kind hang) and rank 0 times out, ddprun asks the
# running ranks for their dumps (SIGUSR1) before it stops them, so every rank leaves a
# dump and tools/programs/ddp-fr-trace names rank 1 as the culprit that never entered the
# collective, as with --threads; without the grace, rank 1 was stopped before it dumped and
# the verdict was "no_dump" (rank 1 "died"). Also: a rank killed with SIGKILL (a crash,
# which writes nothing) still leaves the survivors' dumps.
#
#   tests/ddprun_fr.sh DDPRUN DDP_TRAIN
#
# Needs /usr/bin/python3 for ddp-fr-trace (exit 77 without it). About 10 s.
set -u
ddprun=$(realpath "$1")
train=$(realpath "$2")
root=${DDP_SOURCE_ROOT:?DDP_SOURCE_ROOT is not set}
py=/usr/bin/python3
[ -x "$py" ] || { echo "SKIP: no $py for tools/programs/ddp-fr-trace"; exit 77; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-fr-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

# 1. A hang: the culprit is named from both dumps.
start=$(date +%s.%N)
DDP_FR_DUMP_DIR=$dir/fr timeout 60 "$ddprun" --nproc_per_node 2 --standalone "$train" \
  --max_steps 20 --ddp_fault rank=1,step=5,kind=hang --ddp_timeout 3 --output_dir out1 \
  >log1 2>&1
rc=$?
end=$(date +%s.%N)
cat log1
[ "$rc" -eq 1 ] || fail "ddprun exited $rc, expected 1 (rank 0's timeout)"
grep -q 'asking the 1 other running rank(s) for their flight-recorder dumps (SIGUSR1)' log1 ||
  fail "ddprun did not ask for the dumps"
for r in 0 1; do [ -s fr/fr_rank_$r.json ] || fail "no dump from rank $r in $dir/fr"; done
"$py" "$root/tools/programs/ddp-fr-trace" fr >verdict || fail "ddp-fr-trace failed on $dir/fr"
cat verdict
grep -q '2 of 2 ranks dumped' verdict || fail "not every rank dumped"
grep -q 'Culprit: rank 1 never entered collective #[0-9]*, which rank 0 entered' verdict ||
  fail "ddp-fr-trace does not name rank 1 as the rank that never entered the collective"
"$py" "$root/tools/programs/ddp-fr-trace" --json fr >verdict.json || fail "ddp-fr-trace --json failed"
"$py" - verdict.json <<'PY' || fail "the JSON verdict is not a hang of rank 1"
import json, sys
v = json.load(open(sys.argv[1]))
assert v["kind"] == "not_entered", v
assert v["culprits"] == [1], v
PY
# Bounded: the 3 s timeout, the dumps, and the stop, well under the timeout + grace + slack.
awk -v a="$start" -v b="$end" 'BEGIN { exit !(b - a < 30) }' || fail "the job took too long"

# 2. A crash: rank 1 is killed by SIGKILL at a step (nothing is written by it); rank 0,
# which would only notice at its timeout (30 s here), is asked for its dump at once.
cat >crash.sh <<SH
#!/bin/sh
if [ "\$RANK" = 1 ]; then
  "$train" "\$@" & pid=\$!
  sleep 1.5; kill -9 \$pid; wait \$pid; exit \$?
fi
exec "$train" "\$@"
SH
chmod +x crash.sh
DDP_FR_DUMP_DIR=$dir/fr2 timeout 60 "$ddprun" --nproc_per_node 2 --standalone ./crash.sh \
  --max_steps 100000 --ddp_timeout 30 --output_dir out2 >log2 2>&1
rc=$?
cat log2
[ "$rc" -eq 137 ] || fail "ddprun exited $rc, expected 137 (rank 1's SIGKILL)"
[ -s fr2/fr_rank_0.json ] || fail "the survivor (rank 0) left no dump after rank 1's crash"
grep -o '"dump_reason": *"[a-z_]*"' fr2/fr_rank_0.json
echo "PASS"
