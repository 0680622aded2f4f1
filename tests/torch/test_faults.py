"""Faults through the torch backend (suite torch; docs/torch.md, "Failures").

    test_faults.py PYTHONPATH_DIR FR_TRACE

Each case starts the ranks of tests/torch/fault_job.py as processes (file:// rendezvous, no
port) and asserts, in this parent:
  - kill: rank 1 is killed with SIGKILL mid-loop; the survivors fail within the timeout
    naming rank 1;
  - hang: DDP_FAULT hangs rank 1 in a collective; every rank exits within the timeout
    + 10% of entering the loop, and ddp-fr-trace on their dumps names rank 1;
  - shape: rank 1 reduces 4 elements, rank 0 5: both fail at the first call, naming both
    counts (DESYNC);
  - world: rank 1 thinks the world has 3 ranks: both fail at creation naming both sizes;
  - small /dev/shm: DDP's 4.2 MB bucket, made in the group's memory on an ordinary /dev/shm,
    is made in ordinary memory when a 16 MiB tmpfs (in a private mount namespace: as root,
    else the case is skipped) has no room for it, with one warning per rank naming /dev/shm
    and no error, and the job ends with the same parameters.
Skips (77) where /usr/bin/python3 cannot import torch and libddp_torch.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
fails = 0


def check(cond, what):
    global fails
    if cond:
        print(f"ok: {what}")
    else:
        fails += 1
        print(f"FAIL: {what}")


def run(mode, world, env, tmp, timeout=10.0, limit=60):
    init = os.path.join(tmp, f"init-{mode}")
    procs = [subprocess.Popen([PY, os.path.join(HERE, "fault_job.py"), mode, str(r), str(world),
                               init, str(timeout)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            se += "\n(killed by the test: no exit within %d s)" % limit
        out.append((p.returncode, so, se))
    return out


def run_small_shm(env, tmp, size="16m"):
    """The ddp job's two ranks in one private mount namespace whose /dev/shm is a tmpfs of
    `size`: [(exit status, stdout, stderr)] per rank, or None where the namespace cannot be
    made (not root)."""
    init = os.path.join(tmp, "init-small-shm")
    ranks = " ".join(
        f"{PY} {os.path.join(HERE, 'fault_job.py')} ddp {r} 2 {init} >{tmp}/o{r} 2>{tmp}/e{r} & "
        f"p{r}=$!;" for r in range(2))
    script = (f"mount --make-rprivate / && mount -t tmpfs -o size={size} tmpfs /dev/shm "
              f"|| exit 77; {ranks} wait $p0; echo $? >{tmp}/s0; wait $p1; echo $? >{tmp}/s1")
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        print(f"skipped: small /dev/shm: cannot make a private mount namespace "
              f"({p.returncode}): {p.stderr.strip()[:200]}")
        return None
    out = []
    for r in range(2):
        with open(f"{tmp}/s{r}") as s, open(f"{tmp}/o{r}") as o, open(f"{tmp}/e{r}") as e:
            out.append((int(s.read()), o.read(), e.read()))
    return out


def failed_line(so):
    m = re.search(r"^FAILED (\S+) (.*)$", so, re.M)
    return (float(m.group(1)), m.group(2)) if m else (None, "")


def main():
    pypath, fr_trace = sys.argv[1], sys.argv[2]
    env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1")
    for k in ("DDP_FAULT", "DDP_FR_DUMP_DIR", "DDP_BACKEND"):
        env.pop(k, None)
    if subprocess.run([PY, "-c", "import libddp_torch"], env=env).returncode != 0:
        print("SKIP: /usr/bin/python3 cannot import torch and libddp_torch")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        # kill -9 of rank 1: rank 0 names it, well within the 10 s timeout
        res = run("kill", 2, env, tmp)
        check(res[1][0] == -9, f"kill: rank 1 was killed by SIGKILL (exit {res[1][0]})")
        el, msg = failed_line(res[0][1])
        check(res[0][0] == 3 and el is not None and el < 10.0,
              f"kill: rank 0 failed within the timeout ({el} s)")
        check("rank 1" in msg, f"kill: rank 0's error names rank 1: {msg[:300]}")

        # hang: every rank out within timeout + 10 %, and the flight recorder names rank 1
        dumps = os.path.join(tmp, "fr")
        henv = dict(env, DDP_FAULT="rank=1,collective=8,kind=hang", DDP_FR_DUMP_DIR=dumps)
        res = run("hang", 3, henv, tmp, timeout=3.0)
        for r, (rc, so, se) in enumerate(res):
            el, msg = failed_line(so)
            check(rc == 3 and el is not None and el <= 3.3,
                  f"hang: rank {r} failed within 3.3 s of the loop's start ({el} s): {msg[:200]}")
        tr = subprocess.run([PY, fr_trace, "--json", dumps], capture_output=True, text=True)
        verdict = json.loads(tr.stdout) if tr.returncode == 0 else {}
        check(verdict.get("culprits") == [1],
              f"hang: ddp-fr-trace names rank 1: {tr.stdout.strip()[:400]} {tr.stderr[-300:]}")

        # shape mismatch at the first call: both sides named
        res = run("shape", 2, env, tmp)
        for r, (rc, so, se) in enumerate(res):
            el, msg = failed_line(so)
            check(rc == 3 and "DESYNC" in msg and "count 5" in msg and "count 4" in msg,
                  f"shape: rank {r} names both counts: {msg[:400]}")

        # world sizes that disagree: refused at creation on both ranks
        res = run("world", 2, env, tmp)
        for r, (rc, so, se) in enumerate(res):
            el, msg = failed_line(so)
            check(rc == 3 and "world_size 3" in msg and "rank 0 has 2" in msg,
                  f"world: rank {r} names both sizes: {msg[:300]}")

        # a /dev/shm with no room for DDP's bucket: ordinary memory, one warning, same result
        normal = run("ddp", 2, env, tmp)
        small = run_small_shm(env, tmp)
        hashes = [re.search(r"^HASH (\S+)", so, re.M) for _, so, _ in normal]
        for r, (rc, so, se) in enumerate(normal):
            ok = rc == 0 and "GRADS 2 of 2 in group memory" in so
            check(ok, f"ddp: rank {r}: the bucket in the group's memory (exit {rc})"
                      + ("" if ok else f": {so[-200:]} {se[-300:]}"))
        for r, (rc, so, se) in enumerate(small or []):
            h = re.search(r"^HASH (\S+)", so, re.M)
            ok = rc == 0 and "GRADS 0 of 2 in group memory" in so
            check(ok, f"small /dev/shm: rank {r}: the bucket in ordinary memory (exit {rc})"
                      + ("" if ok else f": {so[-200:]} {se[-300:]}"))
            warned = se.count("is made in ordinary memory")
            ok = warned == 1 and "/dev/shm has" in se and "libddp ERROR" not in se
            check(ok, f"small /dev/shm: rank {r}: {warned} warning naming /dev/shm, no error"
                      + ("" if ok else f": {se[-600:]}"))
            check(h and hashes[r] and h.group(1) == hashes[r].group(1),
                  f"small /dev/shm: rank {r}: the parameters of the ordinary run "
                  f"({h and h.group(1)[:16]} against {hashes[r] and hashes[r].group(1)[:16]})")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
