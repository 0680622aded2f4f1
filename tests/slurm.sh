#!/usr/bin/env bash
# Slurm for real (suite hosts): a one-node Slurm cluster on this machine runs ddp-train.
#
#   tests/slurm.sh DDP_TRAIN
#
# Starts slurmctld and slurmd from Debian's packages (slurmctld, slurmd, slurm-client;
# tools/deps.sh installs them) on 127.0.0.1, configured here in a temporary directory:
# its own ports from the kernel, state, spool, logs and pid files, authentication
# auth/none (no munge daemon to run), process tracking by /proc (no cgroups needed). Then
# `srun -n 2 ddp-train ...` (ranks from SLURM_PROCID/SLURM_NTASKS, the TCP store at
# MASTER_ADDR/MASTER_PORT) on the tcp and the shm backends must end with the parameter
# hash of `ddp-train --threads 2` on the same job, bit for bit.
#
# Exits 77 with the reason where Slurm cannot start: the programs are missing, or the
# daemons do not come up (no root, a container that forbids what slurmd needs). Daemons,
# steps and files are removed on every exit. Takes a few seconds.
set -u -o pipefail
train=$1
node=ddp-slurm-$$ # the node's name in this cluster only (slurmd -N)

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

for p in slurmctld slurmd srun sinfo; do
  command -v "$p" >/dev/null ||
    skip "no '$p' (Debian packages slurmctld slurmd slurm-client; tools/deps.sh installs them)"
done
py=$(command -v python3) || skip "no python3 to ask the kernel for free ports"
free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

work=$(mktemp -d /tmp/ddp-slurm-XXXXXX)
pids=()
cleanup() {
  local rc=$?
  stop_cluster
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

show_logs() {
  local f
  for f in "$work"/log/*.log; do
    [ -f "$f" ] || continue
    echo "--- $f (last 20 lines)"
    tail -n 20 "$f"
  done
}

# Writes slurm.conf with fresh ports; starts both daemons in the foreground (-D) as
# children of this script; waits until the node is idle. Returns 1 when they do not come
# up within 20 s; "Address already in use" (a port taken between the probe and the bind)
# is retried by the caller.
start_cluster() {
  local cport dport cpus i state
  cport=$(free_port) && dport=$(free_port) || return 1
  cpus=$(nproc)
  mkdir -p "$work/state" "$work/spool" "$work/log"
  rm -f "$work"/log/*
  cat >"$work/slurm.conf" <<EOF
ClusterName=ddptest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$cport
SlurmdPort=$dport
AuthType=auth/none
CredType=cred/none
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName=$node NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=ddp Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  export SLURM_CONF=$work/slurm.conf
  slurmctld -D -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
  pids+=($!)
  slurmd -D -N "$node" -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
  pids+=($!)
  for i in $(seq 1 100); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
    [ "$state" = idle ] && return 0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done
    sleep 0.2
  done
  return 1
}

# Cancels this cluster's jobs (SLURM_CONF names it) so no step outlives it, then stops
# both daemons, by pid.
stop_cluster() {
  local p
  [ ${#pids[@]} -gt 0 ] && scancel --quiet --full -u "$(id -un)" 2>/dev/null && sleep 0.2
  for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null; done
  for p in ${pids[@]+"${pids[@]}"}; do wait "$p" 2>/dev/null; done
  pids=()
}

t0=$SECONDS
up=0
for attempt in 1 2 3; do
  if start_cluster; then
    up=1
    break
  fi
  grep -qs "Address already in use" "$work"/log/* || break
  stop_cluster
done
if [ "$up" != 1 ]; then
  show_logs
  cat "$work"/log/*.out 2>/dev/null | tail -n 20
  skip "slurmctld/slurmd did not come up on 127.0.0.1 (logs above; slurmd needs root)"
fi
echo "== a one-node Slurm cluster ($node, $(nproc) CPUs) up in $((SECONDS - t0)) s"

hash_of() { sed -n 's/.*every rank holds parameters \([0-9a-f]*\).*/\1/p' "$1" | tail -1; }
job=(--max_steps 20 --logging_steps 10 --learning_rate 1e-3 --save_strategy no
     --disable_tqdm true --ddp_find_unused_parameters false)

OMP_NUM_THREADS=1 timeout -k 5 120 "$train" --threads 2 "${job[@]}" \
  --output_dir "$work/threads" >"$work/threads.log" 2>&1 ||
  { cat "$work/threads.log"; fail "ddp-train --threads 2 failed"; }
want=$(hash_of "$work/threads.log")
[ -n "$want" ] || { cat "$work/threads.log"; fail "no parameter hash from --threads 2"; }
echo "== ddp-train --threads 2: $want"

for be in tcp shm; do
  got=
  for attempt in 1 2 3; do
    # srun hands its environment to the tasks; rank 0 serves the TCP store on MASTER_PORT.
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) OMP_NUM_THREADS=1 \
      timeout -k 5 120 srun -n 2 -O -N 1 -J "ddp-$be" --kill-on-bad-exit=1 \
      "$train" --ddp_backend "$be" "${job[@]}" --output_dir "$work/srun-$be" \
      >"$work/srun-$be.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && break
    grep -q "Address already in use" "$work/srun-$be.log" || break
  done
  if [ "$rc" != 0 ]; then
    cat "$work/srun-$be.log"
    show_logs
    fail "srun -n 2 ddp-train --ddp_backend $be exited $rc"
  fi
  grep -q " x 2 ranks ($be)" "$work/srun-$be.log" ||
    { cat "$work/srun-$be.log"; fail "$be: the srun run does not report 2 ranks on $be"; }
  got=$(hash_of "$work/srun-$be.log")
  echo "== srun -n 2 ddp-train --ddp_backend $be: ${got:-(none)}"
  [ "$got" = "$want" ] || { cat "$work/srun-$be.log"; fail "$be: hash $got, --threads 2 $want"; }
done
echo "OK: srun -n 2 on tcp and shm equals --threads 2 bit for bit ($((SECONDS - t0)) s in all)"
