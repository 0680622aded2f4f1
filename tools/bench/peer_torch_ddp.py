#!/usr/bin/python3
"""PyTorch DDP peer of ddp-bench-ddp (docs/benchmarks.md, "DDP steps").

Runs the same measurement as tools/bench/ddp-bench-ddp.c with real PyTorch DistributedDataParallel
over gloo: W processes on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), one intra-op and one inter-op
thread each, the MLP 784-1024-1024-1024-10, SGD (lr 0.01), a fixed random batch per rank,
cross-entropy. Phases, in order, timed on rank 0:

  1. --steps consecutive synchronised steps after --warmup untimed ones: steps/s and p50;
  2. --pairs pairs of (synchronised step, no_sync step), each after a barrier: p50 of each;
  3. --ar-iters all_reduce calls on a float32 tensor of the gradient's element count, each
     after a barrier: p50.

A step is zero_grad, forward, loss, backward and optimizer step. Prints one line
"RESULT key=value ..." with the keys ddp-bench-ddp uses. Run it with Debian's interpreter:
    /usr/bin/python3 tools/bench/peer_torch_ddp.py [--world 2] [--steps 30] ...

With --model CONFIG.json (a Transformers GPT-2 or Llama config) the model is
tools/torch/hf_models.py's GPT2LMHeadModel or LlamaForCausalLM with Transformers'
initialisation, the input fixed random token ids
[--batch, --seq] and the loss the causal-LM loss with labels = the ids, as ddp-bench-ddp
--model. --optim adamw: torch.optim.AdamW with its defaults (lr 1e-3, weight_decay 0.01).
--world 1 runs in this process without torch.distributed or DDP (phase 1 only), as
ddp-bench-ddp without a launcher. peak_rss_mb is resource.getrusage's ru_maxrss at the end.
"""
import os

# Before torch is imported: one BLAS/OpenMP thread per rank, gloo on the loopback device.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the PyTorch side (tools/torch/): blas_kernels, hf_models
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
import blas_kernels  # noqa: E402

blas_kernels.match_libddp()  # before torch loads OpenBLAS: libddp's GEMM kernels
import peer_launch  # noqa: E402

import argparse  # noqa: E402
import datetime  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def p50_ms(samples):
    return statistics.median(samples) * 1e3 if samples else 0.0


def last_ready(ld, params):
    """Element counts of the last gradient to become ready in the last synchronised backward
    and of the bucket that holds it, from DDP's logging data (as ddp-bench-ddp does).
    rebuilt_per_bucket_param_indices lists each bucket's indices, buckets split by commas.
    (0, 0) before the first rebuild, when DDP has not recorded them yet."""
    order = ld.get("prev_iteration_grad_ready_order_indices", "").split(",")
    buckets = [[int(i) for i in b.split()]
               for b in ld.get("rebuilt_per_bucket_param_indices", "").split(",") if b.strip()]
    if not order[-1].strip() or not buckets:
        return 0, 0
    last = int(order[-1])
    home = next(b for b in buckets if last in b)
    return params[last].numel(), sum(params[i].numel() for i in home)


def model_name(args):
    if not args.model:
        return "mlp"
    import hf_models
    return hf_models.load_config(args.model).model_type


def build_model(args, rank):
    """(model, inputs, targets, loss function): the MLP, or --model's GPT-2."""
    import torch
    g = torch.Generator().manual_seed(99 + rank)
    if args.model:
        import hf_models
        cfg = hf_models.load_config(args.model)
        if cfg.model_type not in ("gpt2", "llama"):
            raise SystemExit(f"{args.model}: --model takes a GPT-2 or Llama config.json")
        model = hf_models.build(cfg, torch.float32)
        hf_models.init_weights(model)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        return model, ids, ids, lambda logits, y: hf_models.compute_loss(model, logits, y)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10))
    x = torch.rand(args.batch, 784, generator=g) * 2 - 1
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return model, x, y, torch.nn.CrossEntropyLoss()


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.backends.mkldnn.enabled = args.mkldnn == "on"
    rank = int(os.environ.get("RANK", "0"))
    single = "RANK" not in os.environ  # --world 1 in this process: no group, no DDP
    if not single:
        dist.init_process_group("gloo", init_method=peer_launch.init_method(),
                                rank=rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(1234 + rank)
    model, x, y, lossf = build_model(args, rank)
    model.train()
    ddp = model if single else DDP(model, bucket_cap_mb=args.bucket_cap_mb,
                                   gradient_as_bucket_view=args.grad_as_bucket_view)
    if args.optim == "adamw":
        opt = torch.optim.AdamW(ddp.parameters())
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=False)
        lossf(ddp(x), y).backward()
        opt.step()

    def nosync_step():
        opt.zero_grad(set_to_none=False)
        with ddp.no_sync():
            lossf(ddp(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    if not single:
        dist.barrier()
    ts, cs = [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        a, c = time.perf_counter(), time.process_time()
        step()
        ts.append(time.perf_counter() - a)
        cs.append(time.process_time() - c)
    block = time.perf_counter() - t0
    steps_per_s = args.steps / block
    step_p50 = p50_ms(ts)
    if single:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(f"RESULT backend=none world=1 hook=no wrapper=no grad_numel="
              f"{sum(p.numel() for p in model.parameters())} steps={args.steps} "
              f"steps_per_s={steps_per_s:.3f} step_p50_ms={step_p50:.3f} "
              f"step_cpu_p50_ms={p50_ms(cs):.3f} model={model_name(args)} "
              f"batch={args.batch} seq={args.seq if args.model else 0} optim={args.optim} "
              f"blas_core={blas_kernels.core_name()} peak_rss_mb={rss:.1f} "
              f"mkldnn={args.mkldnn} torch={torch.__version__}", flush=True)
        return 0

    # process_time: CPU time of every thread of the process, gloo's included.
    sync_t, nosync_t, sync_c, nosync_c = [], [], [], []
    for _ in range(args.pairs):
        dist.barrier()
        a, c = time.perf_counter(), time.process_time()
        step()
        sync_t.append(time.perf_counter() - a)
        sync_c.append(time.process_time() - c)
        dist.barrier()
        a, c = time.perf_counter(), time.process_time()
        nosync_step()
        nosync_t.append(time.perf_counter() - a)
        nosync_c.append(time.process_time() - c)

    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    tensor_numel, bucket_numel = last_ready(ddp._get_ddp_logging_data(), params)

    def allreduce_alone(n):
        if n == 0:
            return 0.0
        buf = torch.full((n,), 1e-3)
        t = []
        for k in range(-3, args.ar_iters):
            dist.barrier()
            a = time.perf_counter()
            dist.all_reduce(buf)
            if k >= 0:
                t.append(time.perf_counter() - a)
        return p50_ms(t)

    if args.ar_iters > 0:
        ar, ar_bucket, ar_tensor = (allreduce_alone(numel), allreduce_alone(bucket_numel),
                                    allreduce_alone(tensor_numel))

    if rank == 0:
        fields = [f"backend=gloo world={args.world} hook=no wrapper=no grad_numel={numel}",
                  f"steps={args.steps} steps_per_s={steps_per_s:.3f} step_p50_ms={step_p50:.3f}"]
        if args.pairs > 0:
            s, n = p50_ms(sync_t), p50_ms(nosync_t)
            sc, nc = p50_ms(sync_c), p50_ms(nosync_c)
            fields.append(f"sync_p50_ms={s:.3f} nosync_p50_ms={n:.3f} exposed_ms={s - n:.3f}")
            fields.append(f"sync_cpu_ms={sc:.3f} nosync_cpu_ms={nc:.3f} extra_cpu_ms={sc - nc:.3f}"
                          f" nosync_busy={nc / n:.2f} cpus={len(os.sched_getaffinity(0))}")
        if args.ar_iters > 0:
            fields.append(f"allreduce_p50_ms={ar:.3f}")
            if args.pairs > 0:
                fields.append(f"exposed_ratio={(s - n) / ar:.3f}")
            fields.append(f"last_bucket_numel={bucket_numel} allreduce_last_bucket_p50_ms="
                          f"{ar_bucket:.3f} floor_bucket_ratio={ar_bucket / ar:.3f}"
                          f" last_tensor_numel={tensor_numel} allreduce_last_tensor_p50_ms="
                          f"{ar_tensor:.3f} floor_tensor_ratio={ar_tensor / ar:.3f}")
        fields.append(f"step_cpu_p50_ms={p50_ms(cs):.3f} model={model_name(args)}"
                      f" batch={args.batch} seq={args.seq if args.model else 0}"
                      f" optim={args.optim} blas_core={blas_kernels.core_name()}"
                      f" peak_rss_mb="
                      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0:.1f}")
        fields.append(f"mkldnn={args.mkldnn} torch={torch.__version__}")
        print("RESULT " + " ".join(fields), flush=True)
    dist.barrier()
    # Leave without the interpreter's teardown: with gloo's threads still up it can spin
    # for minutes after the work is done (seen with Debian's torch 1.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--ar-iters", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", help="a Transformers GPT-2 or Llama config.json instead of the MLP")
    ap.add_argument("--mkldnn", choices=("on", "off"), default="on",
                    help="torch.backends.mkldnn.enabled (PyTorch's default on)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample with --model")
    ap.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb (PyTorch's default 25)")
    ap.add_argument("--grad-as-bucket-view", action="store_true",
                    help="DDP's gradient_as_bucket_view=True (ddp-bench-ddp's flag name)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for the whole run")
    args = ap.parse_args()
    if args.world < 1 or args.steps < 1 or args.warmup < 0 or args.pairs < 0 \
            or args.ar_iters < 0 or args.batch < 1 or args.seq < 1:
        ap.error("counts must be positive (steps, batch, seq, world) or non-negative")
    if args.world == 1 and "RANK" not in os.environ:
        args.pairs = args.ar_iters = 0
        return rank_main(args)
    if "RANK" not in os.environ:
        return peer_launch.launch_ranks(args.world, args.timeout)
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
