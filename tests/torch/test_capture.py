"""The capture on the libddp backend against gloo (suite torch; docs/compare.md).

    test_capture.py DDP_COMPARE PYTHONPATH_DIR

tests/torch_capture_job.py (a plain PyTorch DDP script with tools/torch/libddp_capture.py,
2 ranks) runs on gloo and on libddp; ddp-compare must find them equal (exit 0: at 2 ranks
the sums are the same), name step 2, bucket 1 and "communication" when the libddp run's
hook scales bucket 1 at step 2, and say "compute" when rank 1's input changes at step 1.
Skips (77) where /usr/bin/python3 cannot import torch and libddp_torch."""
import os
import subprocess
import sys
import tempfile

PY = "/usr/bin/python3"
JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "torch_capture_job.py")
fails = 0


def check(cond, what, detail=""):
    global fails
    print(f"{'ok' if cond else 'FAIL'}: {what}")
    if not cond:
        fails += 1
        print(detail[-3000:])


def main():
    compare, pypath = sys.argv[1], sys.argv[2]
    env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1")
    if subprocess.run([PY, "-c", "import libddp_torch"], env=env).returncode != 0:
        print("SKIP: /usr/bin/python3 cannot import torch and libddp_torch")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        def job(name, *extra):
            d = os.path.join(tmp, name)
            p = subprocess.run([PY, JOB, d, *extra], env=env, capture_output=True, text=True,
                               timeout=300)
            if p.returncode != 0:
                sys.exit(f"FAIL: torch_capture_job.py {name} {extra} exited {p.returncode}:\n"
                         f"{p.stdout[-2000:]}{p.stderr[-2000:]}")
            return d

        lib = ("--backend", "libddp", "--import", "libddp_torch")
        g = job("gloo")
        runs = {"same": job("libddp", *lib), "scaled": job("scaled", *lib, "--scale", "2:1"),
                "perturbed": job("perturbed", *lib, "--perturb", "1:1")}
        out = {k: subprocess.run([compare, g, d], capture_output=True, text=True)
               for k, d in runs.items()}
        p = out["same"]
        check(p.returncode == 0 and "result: within tolerance" in p.stdout,
              "gloo against libddp: exit 0, within tolerance", p.stdout + p.stderr)
        p = out["scaled"]
        check(p.returncode == 1 and "step 2, rank 0, bucket 1" in p.stdout
              and "only the averaged gradients differ (communication or hook)" in p.stdout,
              "a scaled bucket: step 2, bucket 1, communication", p.stdout + p.stderr)
        p = out["perturbed"]
        check(p.returncode == 1 and "local gradients already differ (compute)" in p.stdout
              and "step 1, rank 1" in p.stdout,
              "a changed input on rank 1: step 1, compute", p.stdout + p.stderr)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
