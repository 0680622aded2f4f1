# bench_lib.sh: the run-and-table helpers tools/bench/bench_ddp.sh and tools/bench/bench_gpt2.sh share.
# Sourced, not run. The sourcing script sets, before calling them:
#   out            the folder each run's output (<name>.txt) and RESULT line (<name>.res) go to
#   failed         set to 1 here when a run fails
#   bench_timeout  seconds one run may take before timeout(1) ends it
#   bench_name_w, bench_secs_w  the widths of the name and seconds of each run's progress line

run() { # name, then the command; its RESULT line goes to $out/<name>.res
  local name=$1 t0
  shift
  t0=$(date +%s)
  timeout -k 10 "$bench_timeout" "$@" >"$out/$name.txt" 2>&1
  collect "$name" $? "$t0"
}
collect() { # name rc t0: the RESULT line of $out/<name>.txt goes to $out/<name>.res; a
            # progress line gives the seconds since t0 (a date +%s)
  local name=$1 rc=$2 t0=$3
  grep -o 'RESULT .*' "$out/$name.txt" | head -1 >"$out/$name.res"
  if [ "$rc" -ne 0 ] || [ ! -s "$out/$name.res" ]; then
    echo "## $name: FAILED (exit $rc); last lines of $out/$name.txt:"
    tail -5 "$out/$name.txt" | sed 's/^/##   /'
    failed=1
  fi
  printf "## %-${bench_name_w}s %${bench_secs_w}d s  load %s\n" "$name" \
    "$(( $(date +%s) - t0 ))" "$(cut -d' ' -f1 /proc/loadavg)"
}
get() { # file key -> value (empty when missing)
  grep -o "[[:space:]]$2=[^[:space:]]*" "$1" 2>/dev/null | head -1 | cut -d= -f2
}
calc() { awk "BEGIN { printf \"%.3f\", $1 }" 2>/dev/null; }
verdict() { # value op goal
  awk -v v="$1" -v g="$3" -v op="$2" 'BEGIN {
    if (v == "") { print "FAIL (no value)"; exit }
    ok = (op == ">=") ? (v + 0 >= g + 0) : (v + 0 <= g + 0); print ok ? "PASS" : "FAIL" }'
}
best() { # key, "min" or "max", then .res files -> the file with the best value of key
  local key=$1 how=$2 f v bestf="" bestv=""
  shift 2
  for f in "$@"; do
    v=$(get "$f" "$key")
    [ -n "$v" ] || continue
    if [ -z "$bestv" ] || awk -v a="$v" -v b="$bestv" -v h="$how" \
         'BEGIN { exit !((h == "min") ? (a < b) : (a > b)) }'; then
      bestf=$f; bestv=$v
    fi
  done
  echo "$bestf"
}
