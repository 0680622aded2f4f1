"""Starts the ranks of a PyTorch peer script in tools/ on this host, for the benchmarks.

launch_ranks() runs `world` copies of the calling script with its own arguments, each with
RANK, WORLD_SIZE and PEER_INIT_FILE (a file in a fresh temporary directory, plus `env`),
and waits for them all, killing every copy once `timeout` seconds have passed. The copies
see RANK and run as ranks; init_method() gives them the rendezvous to pass to
init_process_group: a file store on PEER_INIT_FILE (no port, so no collision with another
job on this machine), else env:// (MASTER_ADDR/MASTER_PORT, as on several hosts).
Returns 0 when every rank exited 0, else 1.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time


def init_method():
    path = os.environ.get("PEER_INIT_FILE")
    return "file://" + path if path else "env://"


def launch_ranks(world, timeout, env=None):
    tmp = tempfile.mkdtemp(prefix="ddp-peer-")
    try:
        return _run(world, timeout, env, os.path.join(tmp, "store"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(world, timeout, env, store):
    script = os.path.abspath(sys.argv[0])
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), PEER_INIT_FILE=store,
                 **(env or {}))
        procs.append(subprocess.Popen([sys.executable, script] + sys.argv[1:], env=e))
    deadline = time.monotonic() + timeout
    rc = 0
    for p in procs:
        try:
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{os.path.basename(script)}: timed out after {timeout} s", file=sys.stderr)
            for q in procs:
                q.kill()
            code = 1
        rc = rc or code
    return 1 if rc else 0
