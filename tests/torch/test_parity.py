"""The torch backend against gloo and against itself (suite torch; docs/torch.md).

    test_parity.py DDPRUN PYTHONPATH_DIR

Runs tests/torch/train_ddp.py (plain PyTorch DDP: an MLP and a tiny GPT-2, AdamW, and a
sparse EmbeddingBag, SGD; 20 steps) under ddprun with no extra flag, and asserts on the
parameter hashes rank 0 prints:
  - 2 ranks: every run (MLP, GPT-2, the bag (the backend's sparse all_reduce), fp16 hook,
    ZeroRedundancyOptimizer, PowerSGD, find_unused_parameters with no_sync accumulation,
    static_graph with gradient_as_bucket_view and tiny buckets) ends with gloo's exact
    parameters: two-term sums are the same in any order;
  - 3 ranks: libddp over shm and over tcp, with three bucket caps, ends with one hash per
    model (plain, fp16 hook, ZeRO, the sparse bag), which gloo's ring need not give;
  - DDP's buckets on shm: made in the group's memory by default (every rank's last-step
    gradients, bucket views, are there), in ordinary memory with
    Options(bucket_memory="ordinary") (none there), with gloo's bits either way;
  - libddp_torch.allreduce_hook: the bits of PyTorch's allreduce_hook (on gloo at 2 ranks,
    against PyTorch's hook at 3), with the ordinary buckets moved into the group's memory.
Skips (77) where /usr/bin/python3 has no torch or the extension was not built.
"""
import os
import re
import subprocess
import sys

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))


def job(ddprun, env, nproc, *args):
    # --standalone: the store's port from the OS (29500 may be another job's)
    cmd = [ddprun, "--standalone", "--nproc_per_node", str(nproc), PY,
           os.path.join(HERE, "train_ddp.py"), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    found = re.findall(r"final parameters sha256 ([0-9a-f]{64}) run (\S+)", p.stdout)
    hashes = dict((run, h) for h, run in found)
    # rank r: k of the n gradients of run's last step were in the group's memory
    for r, k, n, run in re.findall(r"rank (\d+) gradients in group memory (\d+) of (\d+) run (\S+)",
                                   p.stdout):
        hashes[("memory", run, int(r))] = (int(k), int(n))
    return hashes


def expect_equal(what, a, b):
    if a != b:
        sys.exit(f"FAIL: {what}: {a} != {b}")
    print(f"ok: {what}: {a[:16]}")


def expect_moved(what, found, run, nproc, moved):
    """Every rank's last-step gradients all in the group's memory (moved) or none of them."""
    for r in range(nproc):
        k, n = found.get(("memory", run, r), (-1, -1))
        if n <= 0 or k != (n if moved else 0):
            sys.exit(f"FAIL: {what}: rank {r} had {k} of {n} gradients in the group's memory, "
                     f"expected {'all' if moved else 'none'}")
    print(f"ok: {what}: gradients in the group's memory: {'all' if moved else 'none'}")


def main():
    ddprun, pypath = sys.argv[1], sys.argv[2]
    env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1")
    if subprocess.run([PY, "-c", "import libddp_torch"], env=env).returncode != 0:
        print("SKIP: /usr/bin/python3 cannot import torch and libddp_torch")
        sys.exit(77)
    # The last run uses no Python hook: on gloo, PyTorch's worker thread drops a Python
    # hook's callback after the step returns and aborts the process if the interpreter is
    # finalizing by then (docs/torch.md, "Limits"; libddp's groups wait for theirs at exit).
    hooked = "hook=libddp,grad_as_bucket_view=1,bucket_cap_mb=0.05,bucket_memory=ordinary"
    ordinary = "find_unused=1,accumulate=3,grad_as_bucket_view=1,bucket_memory=ordinary"
    born = "static_graph=1,grad_as_bucket_view=1,bucket_cap_mb=0.01"
    runs2 = ["model=mlp", "model=gpt2", "model=bag", "hook=fp16", "zero=1", "hook=powersgd",
             hooked, ordinary, born]
    gloo = job(ddprun, env, 2, "--backend", "gloo", "--runs", ";".join(runs2))
    lib = job(ddprun, env, 2, "--backend", "libddp", "--runs", ";".join(runs2))
    for r in runs2:
        expect_equal(f"2 ranks, {r}: gloo against libddp", gloo.get(r), lib.get(r))
    expect_moved(f"2 ranks, shm, {hooked} (moved by the hook)", lib, hooked, 2, True)
    expect_moved(f"2 ranks, shm, {ordinary}", lib, ordinary, 2, False)
    expect_moved(f"2 ranks, shm, {born} (made there)", lib, born, 2, True)
    if gloo["model=mlp"] == gloo["model=gpt2"]:
        sys.exit("FAIL: the MLP and the GPT-2 ended with one hash: the script trains nothing")
    bag0 = job(ddprun, env, 2, "--backend", "libddp", "--runs", "model=bag,steps=0")
    if bag0["model=bag,steps=0"] == lib["model=bag"]:
        sys.exit("FAIL: the sparse EmbeddingBag model's parameters did not change in training")

    caps = ["25", "0.05", "0.2"]
    runs3 = [f"model={m},{extra}bucket_cap_mb={c}" for m, extra in
             [("gpt2", ""), ("mlp", "hook=fp16,"), ("mlp", "zero=1,"), ("bag", "")]
             for c in caps]
    # libddp's hook is PyTorch's allreduce_hook with the buckets in the group's memory: the
    # same bits, at 3 ranks too (x / 3, where DDP's own reduction multiplies by 1/3)
    view = "model=gpt2,grad_as_bucket_view=1,bucket_cap_mb=0.05,"
    runs3 += [view + "hook=allreduce", view + "hook=libddp,bucket_memory=ordinary"]
    shm = job(ddprun, env, 3, "--backend", "libddp", "--transport", "shm", "--runs", ";".join(runs3))
    expect_moved(f"3 ranks, shm, {runs3[-1]}", shm, runs3[-1], 3, True)
    tcp = job(ddprun, env, 3, "--backend", "libddp", "--transport", "tcp", "--runs", ";".join(runs3))
    for r in runs3[-2:]:
        expect_equal(f"3 ranks, {r}: shm against tcp", shm.get(r), tcp.get(r))
    expect_equal(f"3 ranks, {view}: libddp's hook against PyTorch's allreduce_hook",
                 shm.get(runs3[-1]), shm.get(view + "hook=allreduce"))
    runs3 = runs3[:-2]
    for i in range(0, len(runs3), len(caps)):
        group = runs3[i:i + len(caps)]
        for r in group:
            expect_equal(f"3 ranks, {r}: shm against tcp", shm.get(r), tcp.get(r))
            expect_equal(f"3 ranks, {r}: against {group[0]}", shm.get(r), shm.get(group[0]))


if __name__ == "__main__":
    main()
