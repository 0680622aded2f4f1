#!/usr/bin/python3
"""A plain PyTorch DDP training script with tools/torch/libddp_capture.py added, for
tests/torch_capture.sh: an MLP 12-16-16-3, AdamW, 4 steps, 2 ranks on gloo started with
torch.multiprocessing (no launcher), small buckets so that the rebuilt layout has several.

    torch_capture_job.py DUMP_DIR [--scale STEP:BUCKET] [--perturb STEP:RANK]
                                  [--hook_before] [--world W] [--steps N] [--accum M]
                                  [--backend NAME] [--import MODULE]

--scale: the script's own comm hook (allreduce, then) multiplies bucket BUCKET's averaged
gradient by 0.999 at step STEP: a planted communication error. --perturb: rank RANK adds
1e-3 to its first input element at step STEP: a planted compute difference. --hook_before:
registers the hook before the Capture (refused, with a message). Without --scale the hook
is the capture's default (PyTorch's allreduce_hook). --accum: M micro-batches per step, all
but the last under no_sync(). A LambdaLR scheduler is created after the Capture.
--backend (default gloo; CPU tensors) with --import MODULE for a backend that a module
registers, so that the same script runs on gloo and on another backend."""

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools", "torch"))


def pair(text):
    a, _, b = text.partition(":")
    return int(a), int(b)


def worker(rank, world, port, a):
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    from libddp_capture import Capture, CaptureError

    torch.set_num_threads(1)
    if a.import_module:
        __import__(a.import_module)  # a module that registers a backend (libddp_torch)
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=60))
    dist.init_process_group(a.backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1024  # several buckets after the rebuild
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    ddp = DDP(model, bucket_cap_mb=1024 / 2 ** 20)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = {"step": 0}

    def scaling_hook(pg, bucket):
        fut = default_hooks.allreduce_hook(pg, bucket)
        if a.scale and (state["step"], bucket.index()) == a.scale:
            return fut.then(lambda f: f.value() * 0.999)
        return fut

    if a.hook_before:
        ddp.register_comm_hook(None, scaling_hook)
        try:
            Capture(ddp, opt, a.dump_dir)
        except CaptureError as e:
            print(e)
            sys.stdout.flush()
            os._exit(3)
    cap = Capture(ddp, opt, a.dump_dir, config={"script": "torch_capture_job.py"})
    if a.scale:
        ddp.register_comm_hook(None, scaling_hook)
    # A scheduler made after the Capture wraps the capture's optimizer.step.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))

    gen = torch.Generator().manual_seed(100 + rank)
    for k in range(a.steps):
        for m in range(a.accum):
            x = torch.randn(8, 12, generator=gen)
            y = torch.randint(0, 3, (8,), generator=gen)
            if a.perturb and a.perturb == (k, rank) and m == 0:
                x[0, 0] += 1e-3
            if m < a.accum - 1:
                with ddp.no_sync():
                    loss = torch.nn.functional.cross_entropy(ddp(x), y) / a.accum
                    loss.backward()
            else:
                loss = torch.nn.functional.cross_entropy(ddp(x), y) / a.accum
                loss.backward()
            cap.inputs(labels=y)
            cap.loss(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        state["step"] += 1
    cap.close()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def entry(rank, world, port, a):
    try:
        worker(rank, world, port, a)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dump_dir")
    p.add_argument("--scale", type=pair, default=None)
    p.add_argument("--perturb", type=pair, default=None)
    p.add_argument("--hook_before", action="store_true")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync)")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo)")
    p.add_argument("--import", dest="import_module", default=None,
                   help="a module to import first, for a backend it registers")
    a = p.parse_args()
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from datetime import timedelta
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                           wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=entry, args=(r, a.world, server.port, a))
             for r in range(a.world)]
    for q in procs:
        q.start()
    rc = 0
    for q in procs:
        q.join(120)
        if q.exitcode != 0:
            if q.exitcode is None:
                q.terminate()
            rc = rc or q.exitcode or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
