"""libddp_torch under launchers that do not set RANK (docs/torch.md, "Launching"):
libddp_torch.launcher_env maps Open MPI's, Slurm's and PMI's rank variables to torch's, so
init_process_group("libddp") with the default env:// works under mpirun and srun.

    test_launch.py PYTHONPATH_DIR

1. launcher_env on dictionaries: each launcher's variables, a RANK already set (nothing
   changes), Slurm's "2(x3)" per-node count, no launcher (nothing set).
2. mpirun -np 2 (Open MPI; skipped where mpirun is missing) runs tests/torch/launch_job.py:
   both ranks report rank, world size, LOCAL_RANK and the all_reduce's sum.
3. Two processes with the variables srun sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
   SLURM_NTASKS_PER_NODE), as srun would start them, run the same job.
MASTER_PORT comes from the OS (a port bound and released here). Skips (77) where
/usr/bin/python3 cannot import torch and libddp_torch."""
import os
import shutil
import socket
import subprocess
import sys

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "launch_job.py")
fails = 0


def check(what, ok, detail=""):
    global fails
    print(f"{'ok' if ok else 'FAIL'}: {what}{'' if ok else ': ' + detail}", flush=True)
    fails += not ok


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def mapping():
    import libddp_torch
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    got = libddp_torch.launcher_env(env)
    want = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    check("Open MPI's variables", got == "mpirun" and all(env[k] == v for k, v in want.items()),
          f"{got} {env}")
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2",
           "SLURM_NTASKS_PER_NODE": "3(x2)"}
    got = libddp_torch.launcher_env(env)
    check("Slurm's variables, '3(x2)' per node", got == "srun" and env["RANK"] == "5" and
          env["WORLD_SIZE"] == "6" and env["LOCAL_RANK"] == "2" and
          env["LOCAL_WORLD_SIZE"] == "3", f"{got} {env}")
    env = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    got = libddp_torch.launcher_env(env)
    check("PMI's variables", got == "mpiexec (PMI)" and env["RANK"] == "0" and
          env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0", f"{got} {env}")
    env = {"RANK": "3", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0",
           "OMPI_COMM_WORLD_SIZE": "2"}
    got = libddp_torch.launcher_env(env)
    check("RANK already set wins", got is None and env["RANK"] == "3" and
          env["WORLD_SIZE"] == "4" and "LOCAL_RANK" not in env, f"{got} {env}")
    env = {"PATH": "/usr/bin"}
    got = libddp_torch.launcher_env(env)
    check("no launcher: nothing set", got is None and env == {"PATH": "/usr/bin"}, f"{env}")


def reports(out, world):
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("LAUNCHED"))
    want = [f"LAUNCHED rank {r} world {world} RANK={r} LOCAL_RANK={r} LOCAL_WORLD_SIZE={world} "
            f"sum {world * (world + 1) // 2}" for r in range(world)]
    return lines == want, lines


def under_mpirun(base):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("skip: no mpirun")
        return
    env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    p = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                        "-x", "PYTHONPATH", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                        "-x", "OMP_NUM_THREADS", PY, JOB],
                       env=env, capture_output=True, text=True, timeout=120)
    ok, lines = reports(p.stdout, 2)
    check("mpirun -np 2: init_process_group('libddp') with env://", p.returncode == 0 and ok,
          f"exit {p.returncode}, {lines}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}")


def under_slurm_vars(base):
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, SLURM_PROCID=str(r),
                   SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NTASKS_PER_NODE="2")
        procs.append(subprocess.Popen([PY, JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    ok, lines = reports("".join(o for o, _ in outs), 2)
    codes = [p.returncode for p in procs]
    check("srun's variables, 2 tasks: init_process_group('libddp') with env://",
          codes == [0, 0] and ok, f"exits {codes}, {lines}\n{outs[0][1][-2000:]}")


def main():
    pypath = sys.argv[1]
    base = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "DDP_BACKEND", "TORCHELASTIC_USE_AGENT_STORE"):
        base.pop(k, None)
    if subprocess.run([PY, "-c", "import libddp_torch"], env=base).returncode != 0:
        print("SKIP: /usr/bin/python3 cannot import torch and libddp_torch")
        sys.exit(77)
    sys.path.insert(0, pypath)
    mapping()
    under_mpirun(base)
    under_slurm_vars(base)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
