"""One rank of a small libddp-backend job that goes wrong (driven by test_faults.py).

    fault_job.py MODE RANK WORLD INIT_FILE [TIMEOUT_S]

MODE: kill (rank 1 SIGKILLs itself at iteration 5), hang (DDP_FAULT set by the driver),
shape (rank 1 reduces one element fewer), world (rank 1 believes the world is one larger),
ddp (3 DDP steps of a 1024 x 1024 linear layer, one 4.2 MB bucket, gradient_as_bucket_view;
prints "GRADS <k> of <n> in group memory" and "HASH <sha256 of the parameters>").
Prints "LOOP <monotonic>" when the loop starts, and on a failure "FAILED <elapsed s> <msg>";
exits 0 when the loop ends, 3 after a failure.
"""
import hashlib
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import libddp_torch

mode, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 10.0
if mode == "world" and rank == 1:
    world += 1
torch.set_num_threads(1)
t0 = None
try:
    dist.init_process_group("libddp", init_method="file://" + init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    t0 = time.monotonic()
    print(f"LOOP {t0}", flush=True)
    if mode == "ddp":
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024),
                                                          gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.rand(8, 1024, generator=torch.Generator().manual_seed(rank))
        for step in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        grads = [p.grad for p in model.parameters()]
        k = sum(libddp_torch.in_group_memory(g) for g in grads)
        print(f"GRADS {k} of {len(grads)} in group memory", flush=True)
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        print(f"HASH {h.hexdigest()}", flush=True)
    for i in range(40 if mode != "ddp" else 0):
        if mode == "kill" and rank == 1 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        n = 4 if (mode == "shape" and rank == 1) else 5
        t = torch.ones(n)
        dist.all_reduce(t)
        time.sleep(0.01)
except Exception as e:  # the backend's RuntimeError, with libddp's message
    elapsed = time.monotonic() - t0 if t0 is not None else -1.0
    msg = str(e).replace("\n", " ")
    print(f"FAILED {elapsed:.3f} {msg}", flush=True)
    os._exit(3)
print("DONE", flush=True)
dist.destroy_process_group()
