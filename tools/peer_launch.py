"""Starts the ranks of a PyTorch peer script in tools/ on this host, for the benchmarks.

launch_ranks() runs `world` copies of the calling script with its own arguments, each with
RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT (plus `env`), and waits for
them all, killing every copy once `timeout` seconds have passed. The copies see RANK and
run as ranks. Returns 0 when every rank exited 0, else 1.
"""
import os
import socket
import subprocess
import sys
import time


def launch_ranks(world, timeout, env=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.abspath(sys.argv[0])
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), **(env or {}))
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
