#!/usr/bin/env bash
# Ranks on three simulated hosts (suite hosts, docs/launcher.md "Testing several hosts").
#
#   tests/hosts_netns.sh DDPRUN DDP_TRAIN
#
# Three network namespaces are the hosts; each has one veth end (eth0, 10.231.0.N/24) whose
# other end sits on a bridge in a fourth "switch" namespace. No namespace has a link to the
# machine's own network, so all traffic stays between them. One ddprun per host starts that
# host's ranks with the tcp backend and MASTER_ADDR 10.231.0.1, the way a user starts a job
# on three machines. Checks:
#  1. 3 hosts x 1 rank: the final parameter hash equals `ddp-train --threads 3`; each rank
#     publishes its host's 10.231.0.N (host 0 from its store connection, host 1 from
#     GLOO_SOCKET_IFNAME=eth0, host 2 from DDP_SOCKET_IFNAME=eth0).
#  2. 3 hosts x 2 ranks over slow, lossy links: delay and loss with `tc netem` where the
#     kernel has it, otherwise (reported as a skip of that part) a tbf rate limit with a
#     short queue, which delays and drops packets too. The hash equals `--threads 6`.
#  3. 3 hosts x 2 ranks, host 2's link cut mid-run with --ddp_timeout 5: every ddprun exits
#     non-zero by itself within the timeout plus slack, hosts 0 and 1 name the collective
#     and a rank of host 2, and no process is left in any namespace.
# Every launch runs under `timeout`, and a launch ended by it fails the test. The namespaces
# are removed on any exit, and the test fails if one is left. Exits 77 (skip) where network
# namespaces cannot be created (no `ip`, not root).
set -u -o pipefail
ddprun=$1
train=$2
tag=ddpnet-$$
sw=$tag-sw
hosts=("$tag-h0" "$tag-h1" "$tag-h2")
master=10.231.0.1
cut_timeout=5   # --ddp_timeout of the cut run (s)
slack=10        # allowed on top: detection, ddprun's 3 s grace period, sanitizer builds
# ... times the load per CPU when the machine is busy (as DDP_TEST_BOUND_MS in the C tests:
# DDP_TEST_TIME_SCALE, else the 1-minute load average or the runnable threads, over nproc).
slack=$(awk -v s="${DDP_TEST_TIME_SCALE:-}" -v n="$(nproc)" -v b="$slack" '
  { l = $1; split($4, r, "/"); if (r[1] - 1 > l) l = r[1] - 1 }
  END { f = (s != "" && s + 0 >= 1) ? s + 0 : l / n; if (f < 1) f = 1; printf "%d", b * f + 0.5 }
' /proc/loadavg)
work=$(mktemp -d)

fail() { echo "FAIL: $*"; exit 1; }
note() { echo "== $*"; }

cleanup() {
  local rc=$? ns left
  for ns in "${hosts[@]}" "$sw"; do
    ip netns list 2>/dev/null | grep -qx "$ns\( .*\)\?" || continue
    # Processes this test started inside the namespace, by pid.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$work"
  left=$(ip netns list 2>/dev/null | grep -c "^$tag-")
  if [ "$left" -ne 0 ]; then
    echo "FAIL: $left namespace(s) $tag-* left behind"
    rc=1
  fi
  exit "$rc"
}

command -v ip >/dev/null || { echo "SKIP: no 'ip' command (iproute2)"; exit 77; }
if ! err=$(ip netns add "$sw" 2>&1); then
  echo "SKIP: cannot create a network namespace ($err); this test needs root (CAP_SYS_ADMIN)"
  rm -rf "$work"
  exit 77
fi
trap cleanup EXIT
trap 'exit 130' INT TERM

nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }
nsx "$sw" ip link set lo up || fail "switch: lo up"
nsx "$sw" ip link add br0 type bridge || fail "switch: bridge"
nsx "$sw" ip link set br0 up || fail "switch: br0 up"
for i in 0 1 2; do
  h=${hosts[$i]}
  ip netns add "$h" || fail "namespace $h"
  nsx "$sw" ip link add "p$i" type veth peer name eth0 netns "$h" || fail "veth for $h"
  nsx "$sw" ip link set "p$i" master br0 && nsx "$sw" ip link set "p$i" up || fail "port p$i"
  nsx "$h" ip link set lo up && nsx "$h" ip addr add "10.231.0.$((i + 1))/24" dev eth0 &&
    nsx "$h" ip link set eth0 up || fail "addresses of $h"
done
# Isolation: each host sees lo and eth0 only, and no route leads outside the subnet.
for h in "${hosts[@]}"; do
  links=$(nsx "$h" ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort | tr '\n' ' ')
  [ "$links" = "eth0 lo " ] || fail "$h has links: $links"
  routes=$(nsx "$h" ip route show)
  [ "$routes" = "10.231.0.0/24 dev eth0 proto kernel scope link src ${routes##*src }" ] ||
    fail "$h has routes: $routes"
done
note "topology: ${hosts[*]} on bridge br0 in $sw"

export DDP_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
train_args=(--learning_rate 1e-3 --save_strategy no --disable_tqdm true)

hash_of() { sed -n 's/.*every rank holds parameters \([0-9a-f]*\).*/\1/p' "$1" | tail -1; }

# Runs ddprun on every host in the background; per host: $work/$run.$i.{log,rc,end}.
# $1 run name, $2 ranks per host, $3 port, rest: ddp-train arguments.
launch() {
  local run=$1 nproc=$2 port=$3 i
  shift 3
  for i in 0 1 2; do
    (
      envs=()
      [ "$run" = plain ] && [ "$i" = 1 ] && envs=(GLOO_SOCKET_IFNAME=eth0)
      [ "$run" = plain ] && [ "$i" = 2 ] && envs=(DDP_SOCKET_IFNAME=eth0)
      timeout -k 5 60 ip netns exec "${hosts[$i]}" env DDP_DEBUG=INFO ${envs[@]+"${envs[@]}"} \
        "$ddprun" --nnodes 3 --node_rank "$i" --nproc_per_node "$nproc" \
        --master_addr "$master" --master_port "$port" --backend tcp \
        "$train" "$@" --output_dir "$work/$run.$i" >"$work/$run.$i.log" 2>&1
      echo $? >"$work/$run.$i.rc"
      date +%s.%N >"$work/$run.$i.end"
    ) &
  done
}

# Waits for the three ddpruns of a run; none may have been ended by `timeout`.
join_run() {
  local run=$1 i rc
  wait
  for i in 0 1 2; do
    rc=$(cat "$work/$run.$i.rc")
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      tail -20 "$work/$run.$i.log"
      fail "$run: ddprun on host $i hung and was killed by timeout (rc $rc)"
    fi
  done
}

# A 30-step run that must succeed on every host with the hash $4 of the threads run.
# $1 run name, $2 ranks per host, $3 port, $4 expected hash, $5 description.
train_run() {
  local run=$1 t0 i h
  t0=$(date +%s.%N)
  launch "$run" "$2" "$3" --max_steps 30 --logging_steps 10 "${train_args[@]}"
  join_run "$run"
  for i in 0 1 2; do
    [ "$(cat "$work/$run.$i.rc")" = 0 ] || { tail -20 "$work/$run.$i.log"; fail "$run: host $i exited $(cat "$work/$run.$i.rc")"; }
  done
  h=$(hash_of "$work/$run.0.log")
  note "$5: $h in $(since "$t0") s"
  [ "$h" = "$4" ] || fail "$5: hash $h, threads $4"
}

# The reference: the same training with thread ranks in one process.
for w in 3 6; do
  timeout 60 "$train" --threads "$w" --max_steps 30 --logging_steps 10 "${train_args[@]}" \
    --output_dir "$work/threads$w" >"$work/threads$w.log" 2>&1 || fail "ddp-train --threads $w"
  eval "ref$w=$(hash_of "$work/threads$w.log")"
done
[ -n "$ref3" ] && [ -n "$ref6" ] || fail "no parameter hash in the threads runs"
note "threads: 3 ranks $ref3, 6 ranks $ref6"

# 1. One rank per host.
train_run plain 1 29501 "$ref3" "3 hosts x 1 rank"
for i in 0 1 2; do
  why=(the\ local\ end\ of\ the\ store\ connection GLOO_SOCKET_IFNAME DDP_SOCKET_IFNAME)
  grep -q "\[rank$i\] libddp INFO: tcp: peers will connect to 10\.231\.0\.$((i + 1)):[0-9]* (from ${why[$i]})" \
    "$work/plain.$i.log" || { grep "peers will connect" "$work/plain.$i.log"; fail "rank $i published the wrong address"; }
done

# 2. Slow and lossy links.
# Puts qdisc "$@" on every host's eth0; fails (with tc's message in $err) if host 0
# refuses it, i.e. the kernel lacks it.
qdisc_all() {
  local i
  err=$(nsx "${hosts[0]}" tc qdisc add dev eth0 root "$@" 2>&1) || return 1
  for i in 1 2; do nsx "${hosts[$i]}" tc qdisc add dev eth0 root "$@" || fail "tc $* on host $i"; done
}
shaping=""
if qdisc_all netem delay 10ms 5ms loss 1%; then
  shaping="netem delay 10ms +-5ms, loss 1%"
else
  echo "SKIP (delay/loss part): tc netem is not available here: ${err//$'\n'/ }"
  if qdisc_all tbf rate 50mbit burst 16kb latency 5ms; then
    shaping="tbf 50 Mbit/s, 16 KiB burst, 5 ms queue (delays and drops)"
    echo "   shaping with $shaping instead"
  else
    echo "SKIP (shaped part): tc tbf is not available either: ${err//$'\n'/ }"
  fi
fi
if [ -n "$shaping" ]; then
  train_run shaped 2 29502 "$ref6" "3 hosts x 2 ranks, $shaping"
  for i in 0 1 2; do
    stats=$(nsx "${hosts[$i]}" tc -s qdisc show dev eth0 | tr '\n' ' ')
    echo "   host $i: ${stats//  / }"
    nsx "${hosts[$i]}" tc qdisc del dev eth0 root || fail "removing the qdisc of host $i"
  done
fi

# 3. A cut link. The run would last for minutes; host 2's link goes down once rank 0 has
# logged a few steps.
launch cut 2 29503 --max_steps 1000000 --logging_steps 100 --ddp_timeout "$cut_timeout" \
  "${train_args[@]}"
for _ in $(seq 300); do
  grep -q '^\[rank0\]: step ' "$work/cut.0.log" 2>/dev/null && break
  sleep 0.1
done
grep -q '^\[rank0\]: step ' "$work/cut.0.log" || { wait; cat "$work/cut.0.log"; fail "cut: training never started"; }
t_cut=$(date +%s.%N)
nsx "${hosts[2]}" ip link set eth0 down || fail "cutting host 2's link"
join_run cut
for i in 0 1 2; do
  rc=$(cat "$work/cut.$i.rc")
  after=$(awk -v a="$t_cut" -v b="$(cat "$work/cut.$i.end")" 'BEGIN { printf "%.2f", b - a }')
  note "cut: host $i ddprun exited $rc, $after s after the cut"
  grep -E 'libddp ERROR|^ddprun:' "$work/cut.$i.log" | head -4 | cut -c1-400
  [ "$rc" != 0 ] || fail "cut: host $i exited 0"
  awk -v a="$after" -v m=$((cut_timeout + slack)) 'BEGIN { exit !(a <= m) }' ||
    fail "cut: host $i needed $after s (timeout $cut_timeout s + $slack s)"
  [ -z "$(ip netns pids "${hosts[$i]}")" ] || fail "cut: processes left in host $i: $(ip netns pids "${hosts[$i]}")"
done
# Hosts 0 and 1 name the collective (kind and sequence number) and a rank of host 2 (4 or 5)
# with its address; a rank that instead saw a failed neighbour close its connection names that.
for i in 0 1; do
  grep -qE 'libddp ERROR: DDP_ERR_(TIMEOUT|REMOTE): rank [0-3]: [a-z_]+ #[0-9]+ \(' "$work/cut.$i.log" ||
    fail "cut: host $i's error does not name the collective"
done
grep -qE "timed out after [0-9]+ ms waiting for (.*, )?rank [45] \(10\.231\.0\.3:[0-9]+," \
  "$work/cut.0.log" "$work/cut.1.log" ||
  fail "cut: no error on hosts 0 and 1 names rank 4 or 5 at 10.231.0.3"
note "all checks passed"
