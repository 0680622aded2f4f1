"""A plain PyTorch DDP training script, as a user writes one: an MLP or a tiny GPT-2 in
plain PyTorch, AdamW (or a sparse EmbeddingBag before an MLP, SGD: --model bag), 20 steps,
under ddprun (env://). The backend is a flag, so the same
script runs on gloo and on libddp; rank 0 prints the sha256 of the final parameters.

    ddprun --nproc_per_node 2 python3 train_ddp.py --backend libddp --model gpt2
Flags: --backend gloo|libddp, --transport auto|shm|tcp, --bucket_cap_mb MB,
--hook none|allreduce|libddp|fp16|bf16|powersgd|batched_powersgd (allreduce: PyTorch's
default_hooks.allreduce_hook; libddp: libddp_torch.allreduce_hook), --zero (ZeroRedundancyOptimizer),
--find_unused, --static_graph, --grad_as_bucket_view, --accumulate K (no_sync), --steps N,
--bucket_memory group|ordinary (libddp_torch.Options; ordinary: DDP on a new libddp group);
--runs "model=gpt2;hook=fp16,zero=1" trains several jobs in one process group, one line each.
"""
import argparse
import hashlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class MLP(nn.Module):
    def __init__(self, with_unused=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(),
                                 nn.Linear(128, 10))
        if with_unused:  # reached by no rank: find_unused_parameters' case
            self.unused = nn.Linear(4, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class Bag(nn.Module):
    """A sparse EmbeddingBag before an MLP: DDP reduces the bag's sparse gradient in a bucket
    of its own (the backend's sparse all_reduce), the rest as usual."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(500, 32, mode="sum", sparse=True)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, y):
        return F.cross_entropy(self.net(self.emb(x)), y)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.c_mlp = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.h)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.c_mlp(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=256, d=64, h=4, layers=2, ctx=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, y):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(model, step, rank, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    if model == "mlp":
        return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    if model == "bag":  # bags of 6 of 500 ids: ranks share some rows, each has its own
        return torch.randint(0, 500, (16, 6), generator=g), torch.randint(0, 10, (16,), generator=g)
    idx = torch.randint(0, 256, (4, 33), generator=g)
    return idx[:, :-1], idx[:, 1:]


RUN_KEYS = {"model": str, "bucket_cap_mb": float, "hook": str, "zero": int, "find_unused": int,
            "static_graph": int, "grad_as_bucket_view": int, "accumulate": int, "steps": int,
            "bucket_memory": str}


def parse_run(spec, defaults):
    """'model=gpt2,hook=fp16' -> the defaults with those keys replaced."""
    run = dict(defaults)
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        if k not in RUN_KEYS:
            raise SystemExit(f"train_ddp.py: unknown run key {k!r} in {spec!r}")
        run[k] = RUN_KEYS[k](v)
    return run


def train(run, rank, transport):
    """The sha256 of the final parameters, and on libddp how many of the last step's
    gradients were in the group's memory ("K of N")."""
    where = None
    group = None  # DDP's group: the default one, or on libddp one with the run's bucket_memory
    if dist.get_backend() == "libddp" and run["bucket_memory"] != "group":
        import libddp_torch
        group = dist.new_group(backend="libddp", pg_options=libddp_torch.Options(
            transport=transport, bucket_memory=run["bucket_memory"]))
    torch.manual_seed(1234)
    net = {"mlp": lambda: MLP(run["find_unused"]), "bag": Bag, "gpt2": GPT2}[run["model"]]()
    model = DDP(net, bucket_cap_mb=run["bucket_cap_mb"], find_unused_parameters=bool(run["find_unused"]),
                static_graph=bool(run["static_graph"]),
                gradient_as_bucket_view=bool(run["grad_as_bucket_view"]), process_group=group)
    hook = run["hook"]
    if hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        if hook == "allreduce":
            model.register_comm_hook(group, dh.allreduce_hook)
        elif hook == "libddp":
            import libddp_torch
            model.register_comm_hook(group, libddp_torch.allreduce_hook)
        elif hook == "fp16":
            model.register_comm_hook(group, dh.fp16_compress_hook)
        elif hook == "bf16":
            model.register_comm_hook(group, dh.bf16_compress_hook)
        else:
            st = ps.PowerSGDState(process_group=group,
                                  matrix_approximation_rank=2 if hook == "powersgd" else 1,
                                  start_powerSGD_iter=2, random_seed=7)
            model.register_comm_hook(st, ps.powerSGD_hook if hook == "powersgd"
                                     else ps.batched_powerSGD_hook)
    if run["zero"]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3, weight_decay=0.01)
    elif run["model"] == "bag":  # AdamW takes no sparse gradients
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(run["steps"]):
        for micro in range(run["accumulate"]):
            x, y = batch(run["model"], step, rank, micro)
            if micro < run["accumulate"] - 1:
                with model.no_sync():
                    model(x, y).backward()
            else:
                model(x, y).backward()
        opt.step()
        if step == run["steps"] - 1 and dist.get_backend() == "libddp":
            # where the last step's gradients live (with gradient_as_bucket_view they are
            # views of the buckets: made in the group's memory, or moved there by libddp's
            # hook)
            import libddp_torch
            grads = [p.grad for p in model.parameters() if p.grad is not None and
                     not p.grad.is_sparse]
            where = sum(libddp_torch.in_group_memory(g, group=group) for g in grads)
            where = f"{where} of {len(grads)}"
        opt.zero_grad(set_to_none=True)
    h = hashlib.sha256()
    for name, p in model.module.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest(), where


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="libddp")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--model", default="mlp", choices=["mlp", "bag", "gpt2"])
    ap.add_argument("--bucket_cap_mb", type=float, default=25.0)
    ap.add_argument("--hook", default="none")
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--find_unused", action="store_true")
    ap.add_argument("--static_graph", action="store_true")
    ap.add_argument("--grad_as_bucket_view", action="store_true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--bucket_memory", default="group", choices=["group", "ordinary"],
                    help="libddp: Options.bucket_memory of DDP's group (ordinary: a new group)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", default="",
                    help="runs separated by ';', each a list of key=value changes to the flags")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.backend == "libddp":
        import libddp_torch
        dist.init_process_group("libddp", pg_options=libddp_torch.Options(transport=a.transport))
    else:
        dist.init_process_group(a.backend)
    rank = dist.get_rank()
    defaults = {k: getattr(a, k) for k in RUN_KEYS}
    defaults = {k: int(v) if isinstance(v, bool) else v for k, v in defaults.items()}
    for spec in a.runs.split(";") if a.runs else [""]:
        digest, where = train(parse_run(spec, defaults), rank, a.transport)
        if rank == 0:
            print(f"final parameters sha256 {digest} run {spec or 'default'}", flush=True)
        if where is not None:
            print(f"rank {rank} gradients in group memory {where} run {spec or 'default'}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
