#!/usr/bin/env bash
# ddprun launches plain PyTorch scripts as torchrun does (docs/launcher.md, "The store"):
# ddprun serves the job's store on node 0, speaking PyTorch 1.13's TCPStore protocol beside
# libddp's own, and tells the ranks TORCHELASTIC_USE_AGENT_STORE=True, so a script's
# init_process_group("gloo") (env://) connects to it instead of binding MASTER_PORT, which
# ddprun holds. Checked: a gloo all_reduce at 2 and 3 ranks, with --standalone, and after a
# restart (--max_restarts 1, rank 1 failing in attempt 0), with torchrun's worker
# environment (ROLE_*, GROUP_WORLD_SIZE, TORCHELASTIC_RUN_ID, OMP_NUM_THREADS=1 unless
# exported), and named as torchrun takes it (`ddprun ... gloo.py`); and libddp programs still work
# under it (ddp-demo: rank 0 is now a client of ddprun's store, with the job token), two
# --standalone jobs at once. Before, the script's rank 0 failed binding MASTER_PORT.
#
#   tests/ddprun_torch.sh DDPRUN DDP_DEMO
#
# The PyTorch parts need torch under /usr/bin/python3 (Debian's; exit 77 without it, after
# the libddp parts). A few seconds per PyTorch job (importing torch).
set -u
ddprun=$(realpath "$1")
demo=$(realpath "$2")
py=/usr/bin/python3
dir=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-torch-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

# libddp programs: two --standalone jobs at once, each rank 0 a client of its ddprun's store.
timeout 120 "$ddprun" --nproc_per_node 2 --backend tcp --standalone "$demo" --steps 20 >demo1 2>&1 &
p1=$!
timeout 120 "$ddprun" --nproc_per_node 2 --backend shm --standalone "$demo" --steps 20 >demo2 2>&1
rc2=$?
wait $p1
rc1=$?
cat demo1 demo2
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ] || fail "ddp-demo under ddprun exited $rc1 and $rc2"

if ! "$py" -c 'import torch.distributed' 2>/dev/null; then
  echo "SKIP: no torch under $py (the libddp parts passed)"
  exit 77
fi
cat >gloo.py <<'PY'
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if os.environ.get("FAIL_RANK_IN_ATTEMPT0") == str(r) and attempt == "0":
    print("rank %d: failing in attempt 0" % r, flush=True)
    sys.exit(3)
# torchrun's worker environment, and its OMP_NUM_THREADS default (1 unless exported)
env = {k: os.environ.get(k) for k in ("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                                      "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                      "OMP_NUM_THREADS")}
want = {"ROLE_RANK": str(r), "ROLE_WORLD_SIZE": str(w), "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "none",
        "OMP_NUM_THREADS": os.environ.get("EXPECT_OMP", "1")}
assert env == want, (env, want)
assert torch.get_num_threads() == int(want["OMP_NUM_THREADS"]), torch.get_num_threads()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
assert t.item() == w * (w + 1) / 2, (t.item(), w)
dist.barrier()
print("rank %d of %d: all_reduce %g ok in attempt %s" % (r, w, t.item(), attempt), flush=True)
dist.destroy_process_group()
PY
# run NAME EXPECTED_OK_LINES ARGS...: ddprun ARGS python3 gloo.py must exit 0 and every rank
# must print its line.
run() {
  local name=$1 n=$2
  shift 2
  timeout 120 "$ddprun" "$@" "$py" gloo.py >"$name.log" 2>&1
  local rc=$?
  cat "$name.log"
  [ "$rc" -eq 0 ] || fail "$name: ddprun $* exited $rc"
  [ "$(grep -c 'all_reduce .* ok' "$name.log")" -eq "$n" ] || fail "$name: not every rank reduced"
}
(unset OMP_NUM_THREADS && run two 2 --nproc_per_node 2) || exit 1 # meson test sets it
grep -q 'ddprun: OMP_NUM_THREADS is not set: each of the 2 ranks gets OMP_NUM_THREADS=1' two.log ||
  fail "two: ddprun did not say it set OMP_NUM_THREADS"
OMP_NUM_THREADS=2 EXPECT_OMP=2 run three 3 --nproc_per_node 3
grep -q 'OMP_NUM_THREADS is not set' three.log && fail "three: an exported OMP_NUM_THREADS was overridden"
run standalone 2 --standalone --nproc_per_node 2
# torchrun's own form, the script named without its interpreter: ddprun runs a *.py file
# with `python3 -u` (before, "cannot execute 'gloo.py'")
timeout 120 "$ddprun" --standalone --nproc_per_node 2 gloo.py >script.log 2>&1
rc=$?
cat script.log
[ "$rc" -eq 0 ] || fail "script: ddprun --nproc_per_node 2 gloo.py exited $rc"
[ "$(grep -c 'all_reduce .* ok' script.log)" -eq 2 ] || fail "script: not every rank reduced"
FAIL_RANK_IN_ATTEMPT0=1 run restart 2 --nproc_per_node 2 --standalone --max_restarts 1
grep -q 'rank 1: failing in attempt 0' restart.log || fail "restart: rank 1 did not fail first"
grep -q 'ok in attempt 1' restart.log || fail "restart: attempt 1 did not run"
grep -q '1 restart(s) used of --max_restarts 1; exit status 0' restart.log ||
  fail "restart: ddprun's report is missing"
# A store.wait that times out at the client (PyTorch's TCPStore client on ddprun's store):
# the connection's next requests are served, and answered with their own replies, also
# after the keys the abandoned wait named appear. Before, ddprun held the connection's
# requests behind the abandoned wait: rank 1's set never arrived and rank 0 timed out.
cat >store.py <<'PY'
import datetime, torch.distributed as dist
dist.init_process_group("gloo")
st, r = dist.distributed_c10d._get_default_store(), dist.get_rank()
if r == 1:
    try:
        st.wait(["late"], datetime.timedelta(milliseconds=300))
        raise SystemExit("rank 1: the wait for a missing key returned")
    except RuntimeError:
        pass
    st.set("after", "x")
else:
    st.wait(["after"], datetime.timedelta(seconds=20))
    st.set("late", "y")
dist.barrier()
got = (st.get("after"), st.add("n", 5), st.get("late"))
assert got == (b"x", 5 if r == 0 else 10, b"y") or got == (b"x", 10 if r == 0 else 5, b"y"), got
print("rank %d: store after an abandoned wait ok %r" % (r, got), flush=True)
PY
timeout 120 "$ddprun" --standalone --nproc_per_node 2 "$py" store.py >store.log 2>&1
rc=$?
cat store.log
[ "$rc" -eq 0 ] || fail "store: ddprun exited $rc"
[ "$(grep -c 'abandoned wait ok' store.log)" -eq 2 ] || fail "store: not every rank checked"
echo PASS
