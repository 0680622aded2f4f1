#!/usr/bin/env bash
# tools/maint/check_layers.py's layout rules fail on a planted violation (issue 41):
#   tests/check_layers_rules.sh SOURCE_ROOT
# Copies docs/design.md, src/, include/ and tools/ of the tree into a temporary directory,
# checks that the copy passes, then plants one violation at a time and asserts that the
# check exits 1 naming the file and the rule: an include cycle in src/ (fault.h including
# pg_internal.h, which includes fault.h), a call cycle (fault.c calling pg.c's ddp_pg_rank), a Python oracle beside the shipped programs, a
# benchmark at the top of tools/, a benchmark among the maintenance scripts, and a folder of
# tools/ that is no kind. Python 3 standard library only; a few seconds.
set -uo pipefail
src=${1:?usage: check_layers_rules.sh SOURCE_ROOT}
py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
work=$(mktemp -d /tmp/ddp_check_layers_XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$work/docs"
cp "$src/docs/design.md" "$work/docs/"
cp -r "$src/src" "$src/include" "$src/tools" "$work/"
find "$work/tools" -name __pycache__ -prune -exec rm -rf {} +

check() { "$py" "$src/tools/maint/check_layers.py" --root "$work" >"$work/out" 2>&1; }
check
rc=$?
[ "$rc" = 0 ] || [ "$rc" = 77 ] || { cat "$work/out"; fail "the unplanted copy fails (rc $rc)"; }

# expect_violation WHAT PATTERN: the check exits 1 and its output matches PATTERN.
expect_violation() {
  check
  rc=$?
  [ "$rc" = 1 ] || { cat "$work/out"; fail "$1: exit $rc, expected 1"; }
  grep -Eq "$2" "$work/out" || { cat "$work/out"; fail "$1: no line matching '$2'"; }
  echo "ok: $1"
}

cp "$work/src/pg/fault.h" "$work/fault.h.orig"
sed -i 's|#include "ddp/pg.h"|#include "ddp/pg.h"\n#include "pg/pg_internal.h"|' "$work/src/pg/fault.h"
expect_violation "include cycle" \
  '^  src/pg/(fault|pg_internal)\.h:[0-9]+: include cycle among src/pg/fault, src/pg/pg_internal'
cp "$work/fault.h.orig" "$work/src/pg/fault.h"

cp "$work/src/pg/fault.c" "$work/fault.c.orig"
sed -i '0,/int rank = f->rank;/s//int rank = ddp_pg_rank(pg);/' "$work/src/pg/fault.c"
grep -q 'ddp_pg_rank(pg)' "$work/src/pg/fault.c" || fail "the call cycle was not planted"
expect_violation "call cycle" \
  '^  src/pg/(fault|pg)\.c:[0-9]+: call cycle among src/pg/fault, src/pg/pg: .*calls ddp_pg_rank of src/pg/pg'
cp "$work/fault.c.orig" "$work/src/pg/fault.c"

touch "$work/tools/programs/layer_oracle.py"
expect_violation "oracle beside the programs" \
  '^  tools/programs/layer_oracle\.py:1: a file of tools/torch/ in tools/programs/'
rm "$work/tools/programs/layer_oracle.py"

touch "$work/tools/bench_new.sh"
expect_violation "benchmark at the top of tools/" \
  '^  tools/bench_new\.sh:1: only .* sit at the top of tools/; this file belongs in tools/bench/'
rm "$work/tools/bench_new.sh"

touch "$work/tools/maint/peer_nccl.py"
expect_violation "peer among the maintenance scripts" \
  '^  tools/maint/peer_nccl\.py:1: a file of tools/bench/ in tools/maint/'
rm "$work/tools/maint/peer_nccl.py"

mkdir "$work/tools/misc" && touch "$work/tools/misc/x.sh"
expect_violation "a folder of no kind" '^  tools/misc/README\.md:1: tools/misc is no kind of tools/'
rm -r "$work/tools/misc"

check
rc=$?
[ "$rc" = 0 ] || [ "$rc" = 77 ] || { cat "$work/out"; fail "the repaired copy fails (rc $rc)"; }
echo "PASS"
