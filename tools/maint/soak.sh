#!/usr/bin/env bash
# The flakiness soak (issue 15): the tests that use processes, ports or timeouts, many times
# in a row and under pressure, then two copies of the whole suite at once. Not part of CI
# (hours at the full counts); run it after changing the harness, a launcher or a backend.
#
#   tools/maint/soak.sh [-n N] [-m M] [-k K] [-j J] [--tests "NAME..."] [--pair-args "ARGS"]
#                 [--no-asan] [--logdir DIR] [--resume]
#
#   -n N   rounds of the tests in the normal build (build/), default 50
#   -m M   rounds of the same tests under ASan + UBSan (build/sanitize), default 20
#   -k K   rounds of two copies of the whole suite started at the same moment (normal
#          build, both from build/), default 10
#   -j J   streams per round of the first two phases, default 2: the round's tests are
#          split into J groups of about equal time (from the last round's durations) and
#          the groups run at the same time, each one `meson test`; 1 runs them in one
#   --tests "A B"     the tests of the first two phases (meson test names); default: the
#                     suite 'soak', every test that starts processes, opens ports or
#                     asserts on time (marked in tests/meson.build)
#   --pair-args "..." extra `meson test` arguments for each copy in the third phase (for
#                     example "--suite unit --suite coll" to soak part of the suite)
#   --no-asan         skip the ASan phase (and its build)
#   --logdir DIR      where the results and failing rounds' logs go (default build/soak)
#   --resume          continue the soak recorded in the log directory: same commit and
#                     arguments, only the rounds not yet run (a soak longer than one sitting)
#
# During the first two phases two CPU-bound processes (shell busy loops) compete for the
# cores, so the timed assertions see a loaded machine, beside the round's other stream. A
# round runs every chosen test once; each test's result is read from meson's JSON log. At
# the end a table gives, per phase and test, the runs and failures; every failing round's
# full log is kept under build/soak/. Exits 1 when any test failed or timed out, 0
# otherwise.
set -u -o pipefail
cd "$(dirname "$0")/../.."
. tools/deps.sh

runs=50
asan_runs=20
pairs=10
asan=1
pair_args=""
streams=2
resume=0
soak=build/soak
# Default: meson's suite 'soak', the tests that start processes (fork, ddprun, srun, mpirun),
# open ports or assert on time; tests/meson.build marks them where each test is registered.
tests=""
while [ $# -gt 0 ]; do
  case $1 in
    -n) runs=$2; shift 2 ;;
    -m) asan_runs=$2; shift 2 ;;
    -k) pairs=$2; shift 2 ;;
    -j) streams=$2; shift 2 ;;
    --resume) resume=1; shift ;;
    --tests) tests=$2; shift 2 ;;
    --pair-args) pair_args=$2; shift 2 ;;
    --no-asan) asan=0; shift ;;
    --logdir) soak=$2; shift 2 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$runs" "$asan_runs" "$pairs" "$streams"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "soak.sh: counts are whole numbers, not '$v'" >&2; exit 2; }
done
# Word lists (the names have no spaces or wildcards).
read -r -d '' -a test_list <<<"$tests"
[ ${#test_list[@]} -eq 0 ] && test_list=(--suite soak)
read -r -d '' -a pair_list <<<"$pair_args"
[ "$streams" -ge 1 ] || { echo "soak.sh: -j needs at least 1 stream" >&2; exit 2; }

ddp_ensure_packages "${DDP_BUILD_PACKAGES[@]}" "${DDP_TEST_PACKAGES[@]}"
ddp_build build
[ "$asan" = 1 ] && [ "$asan_runs" -gt 0 ] &&
  ddp_build build/sanitize -Db_sanitize=address,undefined -Db_lundef=false
# What a soak is, for --resume: the last commit that changed the code (documentation,
# Markdown anywhere and docs/, may change meanwhile), "-dirty" for uncommitted code changes,
# and the arguments that decide what runs.
code=(. ':(exclude)docs' ':(exclude)*.md')
rev=$(git log -1 --format=%h -- "${code[@]}" 2>/dev/null || echo unknown)
git diff --quiet HEAD -- "${code[@]}" 2>/dev/null || rev+=-dirty
what="code $rev; tests ${tests:-suite soak}; pairs ${pair_args:-whole suite}; asan $asan; streams $streams"
if [ "$resume" = 1 ]; then
  if [ ! -f "$soak/what" ] || [ "$(cat "$soak/what")" != "$what" ]; then
    echo "soak.sh: --resume: $soak/what does not match this soak:" >&2
    echo "  recorded: $(cat "$soak/what" 2>/dev/null || echo '(none)')" >&2
    echo "  now:      $what" >&2
    exit 2
  fi
else
  rm -rf "$soak"
  mkdir -p "$soak"
  echo "$what" >"$soak/what"
  : >"$soak/rounds"
  echo 0 >"$soak/seconds"
fi
touch "$soak/results"

# Results: one line "phase test result" per test run, in $soak/results.
hogs=()
start_hogs() {
  local i
  for i in 1 2; do
    (while :; do :; done) &
    hogs+=($!)
  done
}
stop_hogs() {
  local p
  for p in ${hogs[@]+"${hogs[@]}"}; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  hogs=()
}
trap 'stop_hogs' EXIT
trap 'exit 130' INT TERM

# Appends each test's result from meson's JSON log $2 to the results as phase $1; keeps the
# text log under $soak when something in it failed.
collect() {
  local phase=$1 json=$2
  if [ ! -s "$json" ]; then
    echo "$phase meson-test NO_LOG" >>"$soak/results"
    return
  fi
  python3 - "$phase" "$json" >>"$soak/results" <<'PY' || cp "${json%.json}.txt" "$soak/"
import json, sys
phase, path, bad = sys.argv[1], sys.argv[2], 0
for line in open(path):
    if line.strip():
        t = json.loads(line)
        print(phase, t["name"].split(" / ")[-1].replace(" ", "_"), t["result"])
        bad += t["result"] not in ("OK", "SKIP", "EXPECTEDFAIL")
sys.exit(1 if bad else 0)
PY
}

failures() { # phase prefix -> failures so far
  awk -v p="$1" 'index($1, p) == 1 && $3 != "OK" && $3 != "SKIP" && $3 != "EXPECTEDFAIL"' \
    "$soak/results" | wc -l
}

# Rounds of phase $1 already run (a resumed soak).
done_rounds() { awk -v p="$1" '$1 == p' "$soak/rounds" | wc -l; }

# The chosen tests, one name per line.
list_tests() {
  meson test -C "$1" --no-rebuild --list "${test_list[@]}" 2>/dev/null | sed -n 's|.* / ||p'
}

# Splits tests $2... into $streams groups of about equal time, longest first onto the least
# loaded group, with each test's duration from meson JSON log $1 (1 s when absent). Prints
# one line per group.
split_tests() {
  python3 -c '
import json, sys
n, path, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
dur = {}
try:
    for line in open(path):
        if line.strip():
            t = json.loads(line)
            dur[t["name"].split(" / ")[-1]] = t["duration"]
except OSError:
    pass
groups = [[0.0, []] for _ in range(n)]
for name in sorted(names, key=lambda x: -dur.get(x, 1.0)):
    g = min(groups, key=lambda g: g[0])
    g[0] += dur.get(name, 1.0)
    g[1].append(name)
for _, g in groups:
    if g:
        print(" ".join(g))
' "$streams" "$@"
}

# One round of the chosen tests in build dir $2 as phase $1, round $3 of $4: the groups of
# split_tests at the same time, each one `meson test` (two programs at a time).
round() {
  local phase=$1 dir=$2 r=$3 base="soak-$1-$3" g groups names pids=()
  mapfile -t names < <(list_tests "$dir")
  if [ ${#names[@]} -eq 0 ]; then
    echo "soak.sh: no tests match '${test_list[*]}' in $dir" >&2
    exit 2
  fi
  mapfile -t groups < <(split_tests "$dir/meson-logs/soak-$phase-last.json" "${names[@]}")
  for g in "${!groups[@]}"; do
    read -r -a names <<<"${groups[$g]}"
    meson test -C "$dir" --no-rebuild --num-processes 2 --logbase "$base-$g" "${names[@]}" \
      >/dev/null 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}" # not the hogs
  : >"$dir/meson-logs/soak-$phase-last.json"
  for g in "${!groups[@]}"; do
    collect "$phase" "$dir/meson-logs/$base-$g.json"
    cat "$dir/meson-logs/$base-$g.json" >>"$dir/meson-logs/soak-$phase-last.json" 2>/dev/null
  done
  echo "$phase $r" >>"$soak/rounds"
  printf '%s round %d/%s (%d s): %d failure(s) so far\n' "$phase" "$r" "$4" \
    $((SECONDS - t0 + t_before)) "$(failures "$phase")"
}

t0=$SECONDS
t_before=$(cat "$soak/seconds")
trap 'echo $((SECONDS - t0 + t_before)) >"$soak/seconds"; stop_hogs' EXIT
echo "== soak: ${test_list[*]}; $runs normal + $asan_runs ASan rounds with 2 CPU hogs" \
     "($streams stream(s) per round); $pairs paired whole-suite rounds"
[ "$resume" = 1 ] && echo "== resumed: $(cat "$soak/what"); rounds already run:" \
  "normal $(done_rounds normal), asan $(done_rounds asan), pairs $(done_rounds pairs)"
start_hogs
for r in $(seq $(($(done_rounds normal) + 1)) "$runs"); do round normal build "$r" "$runs"; done
if [ "$asan" = 1 ]; then
  for r in $(seq $(($(done_rounds asan) + 1)) "$asan_runs"); do
    round asan build/sanitize "$r" "$asan_runs"
  done
fi
stop_hogs
for r in $(seq $(($(done_rounds pairs) + 1)) "$pairs"); do
  for c in a b; do
    meson test -C build --no-rebuild --num-processes 2 --logbase "soak-pair$c-$r" \
      ${pair_list[@]+"${pair_list[@]}"} >/dev/null 2>&1 &
  done
  wait
  for c in a b; do collect "pair$c" "build/meson-logs/soak-pair$c-$r.json"; done
  echo "pairs $r" >>"$soak/rounds"
  printf 'pairs round %d/%s (%d s): %d failure(s) so far\n' "$r" "$pairs" \
    $((SECONDS - t0 + t_before)) "$(failures pair)"
done

echo
echo "== soak results ($(( (SECONDS - t0 + t_before) / 60 )) min; rounds: normal $runs," \
     "asan $asan_runs, pairs $pairs x 2 copies; $(cat "$soak/what"))"
printf '%-7s %-28s %5s %5s %5s\n' phase test runs skip fail
awk '
  { k = $1 " " $2; n[k]++; if ($3 == "SKIP") s[k]++
    else if ($3 != "OK" && $3 != "EXPECTEDFAIL") f[k]++ }
  END { for (k in n) { split(k, a, " "); printf "%-7s %-28s %5d %5d %5d\n", a[1], a[2], n[k], s[k], f[k] } }
' "$soak/results" | sort -k1,1 -k2,2
fails=$(failures "")
echo "total failures: $fails (logs of failing rounds: $soak/)"
[ "$fails" -eq 0 ]
