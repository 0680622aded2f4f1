#!/usr/bin/python3
"""Each framework's gradient-reduction arithmetic, emulated with PyTorch's CPU f32 kernels
(docs/sharding.md, "Framework arithmetic"; ddp-train --sharding_arithmetic).

    tools/torch/shard_arith.py --table [--n N] [--seed S]
        which arithmetic equals DDP's bits at W = 2, 3, 4, 6, 8, computed on N random f32
        gradients per rank, printed as docs/sharding.md's table
    tools/torch/shard_arith.py --check DUMP --arith NAME
        a ddp-train dump written with --dump_local_grads and --sharding_arithmetic NAME:
        every step's reduced gradient (grad.*) must equal, bit for bit, NAME's arithmetic
        applied here to the ranks' local gradients (local_grad.*); exit 1 otherwise
    tools/torch/shard_arith.py --check_sgd DUMP MODEL --arith NAME --node_size L
        hybrid sharding (--fsdp hybrid_shard): DUMP is a DDP run's one-step dump with
        --dump_local_grads (its rank0/init.safetensors the weights), --optim sgd
        --learning_rate 1 and no clipping; MODEL the
        model.safetensors that the hybrid run of the same job saved after that step. Every
        parameter must equal, bit for bit, weights - 1 * g, g NAME's arithmetic over nodes
        of L ranks applied here to the local gradients

Written from each framework's source (the division placement only; the sum is libddp's,
in rank order, ((g_0 + g_1) + g_2) + ..., as every emulation below spells out):

- ddp: PyTorch 1.13 `torch/csrc/distributed/c10d/reducer.cpp`, `copy_grad_to_bucket`:
  `at::mul_out(bucket_view, grad, 1 / div_factor)` (the reciprocal a double, the product in
  the gradient's f32), then the allreduce SUM.
- fsdp1: PyTorch 1.13 `torch/distributed/algorithms/_comm_hooks/default_hooks.py`
  (FSDP's default `allreduce_hook` / `reduce_scatter_hook`): `DefaultState`'s
  `_get_gradient_predivide_factor` (1 doubled while W % f == 0 and W / f > f),
  `gradient_postdivide_factor = W / f`; `grad.div_(pre)` if pre > 1, SUM, `div_(post)` if
  post > 1.
- fsdp2: PyTorch 2.x `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`,
  `_get_gradient_divide_factors` with f32 and `force_sum_reduction_for_comms` (a backend
  without AVG): pre None, post W, SUM; `_div_if_needed` is `tensor.div_(W)`. (On NCCL it
  returns ReduceOp.AVG, which NCCL computes as a pre-multiply by 1/W: ddp's arithmetic.)
- deepspeed: DeepSpeed `deepspeed/runtime/zero/stage_1_and_2.py`, `average_tensor`:
  `tensor.div_(dp_world_size / float(sequence_parallel_size))` before the reduce;
  ZeRO-3's `deepspeed/runtime/comm/coalesced_collectives.py` `reduce_scatter_coalesced`
  divides its interleaved chunks by W the same way before one reduce-scatter.
- deepspeed_allreduce: the same file with `"reduce_scatter": false`
  (`gradient_reduction_w_predivide`, postscale_gradients, predivide factor 1): allreduce
  SUM, then `tensor.mul_(1 / dp_world_size)`.

Hybrid sharding (nodes of L ranks; `reduce(..., node_size=L)`): FSDP reduce-scatters
inside the node and then all-reduces the shard across nodes, PyTorch 2.x
`torch/distributed/fsdp/_runtime_utils.py` `_reduce_grad` (`_div_if_needed(grad,
predivide)`, `reduce_scatter_tensor` over the node's `process_group`, `all_reduce` over
`_inter_node_pg`, `_div_if_needed(grad, postdivide)`), with FSDP1's factors of the whole
data-parallel size (`_init_utils.py` `_init_process_group_state`: `data_parallel_world_size
*= state._inter_node_pg.size()`); FSDP2's `foreach_reduce` (`_fsdp_collectives.py`) with a
`reduce_scatter_group` and an `all_reduce_group`, SUM-only: both sums, then `div_(W)`. The
sum is ((g_0 + ... + g_(L-1)) + (g_L + ... + g_(2L-1))) + ..., each node's in rank order,
then the nodes' in node order. ddp, deepspeed and deepspeed_allreduce are one sum over all
ranks, which libddp's hybrid mode keeps (rank order), so node_size changes nothing for them.

`tensor.div_(python_float)` on a CPU f32 tensor is a true division by the float rounded to
f32 (aten's div_true_kernel); `tensor.mul_(python_float)` multiplies by it rounded to f32.
"""
import argparse
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors  # noqa: E402  (tools/torch/safetensors.py)

ARITHS = ("ddp", "fsdp1", "fsdp2", "deepspeed", "deepspeed_allreduce")


def fsdp1_factors(world):
    """DefaultState: (gradient_predivide_factor, gradient_postdivide_factor)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor), world / float(factor)


def rank_order_sum(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc


def reduce(arith, grads, divide_in_place=False, node_size=0):
    """The reduced gradient every rank ends with; grads[r] is rank r's local f32 gradient;
    node_size L (0: all ranks): hybrid sharding's nodes of L ranks."""
    world = len(grads)
    g = [x.clone() for x in grads]
    if node_size and node_size != world and arith in ("fsdp1", "fsdp2"):
        pre, post = fsdp1_factors(world) if arith == "fsdp1" else (1.0, float(world))
        if pre > 1:
            for x in g:
                x.div_(pre)
        nodes = [rank_order_sum(g[n:n + node_size]) for n in range(0, world, node_size)]
        s = rank_order_sum(nodes)  # the all-reduce across nodes, in node order
        if post > 1:
            s.div_(post)
        return s
    if arith == "ddp":  # reducer.cpp: bucket = grad * (1 / W); bucket view: bucket /= W
        for x in g:
            if divide_in_place:
                x.div_(world)
            else:
                x.mul_(1.0 / world)
        return rank_order_sum(g)
    if arith == "fsdp1":  # default_hooks.py: div_(pre), all_reduce, div_(post)
        pre, post = fsdp1_factors(world)
        if pre > 1:
            for x in g:
                x.div_(pre)
        s = rank_order_sum(g)
        if post > 1:
            s.div_(post)
        return s
    if arith == "fsdp2":  # _fsdp_collectives.py: SUM, _div_if_needed(output, W)
        s = rank_order_sum(g)
        if world != 1:
            s.div_(float(world))
        return s
    if arith == "deepspeed":  # average_tensor: tensor.div_(W / 1.0), then reduce
        for x in g:
            x.div_(world / float(1))
        return rank_order_sum(g)
    if arith == "deepspeed_allreduce":  # all_reduce, then mul_(1 / W)
        s = rank_order_sum(g)
        s.mul_(1.0 / world)
        return s
    raise ValueError("unknown arithmetic %r; choices: %s" % (arith, ", ".join(ARITHS)))


def table(n, seed):
    gen = torch.Generator().manual_seed(seed)
    worlds = (2, 3, 4, 6, 8)
    print("| arithmetic | " + " | ".join("W = %d" % w for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for arith in ARITHS[1:]:
        cells = []
        for w in worlds:
            # gradients of several magnitudes, as a model's layers have
            grads = [torch.randn(n, generator=gen) * torch.logspace(-6, 2, n) for _ in range(w)]
            ref = reduce("ddp", grads)
            got = reduce(arith, grads)
            diff = int((got.view(torch.int32) != ref.view(torch.int32)).sum())
            cells.append("yes" if diff == 0 else "no (%d of %d differ)" % (diff, n))
        print("| %s | %s |" % (arith, " | ".join(cells)))
    return 0


def load_dump_step(path, prefix):
    tensors, _ = safetensors.load(path)
    out = {}
    for name, (dtype, shape, data) in tensors.items():
        if name.startswith(prefix):
            if dtype != "F32":
                raise SystemExit("%s: %s is %s; the check takes f32 gradients" % (path, name, dtype))
            out[name[len(prefix):]] = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return out


def check(dump, arith, divide_in_place):
    ranks = sorted(glob.glob(os.path.join(dump, "rank*")))
    steps = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ranks[0], "step*.safetensors")))
    if len(ranks) < 2 or not steps:
        raise SystemExit("%s: no dump of two or more ranks" % dump)
    checked = differ = 0
    for step in steps:
        local = [load_dump_step(os.path.join(r, step), "local_grad.") for r in ranks]
        if not local[0]:
            raise SystemExit("%s/%s: no local_grad.* (write it with --dump_local_grads true)" % (ranks[0], step))
        for r in ranks:
            got = load_dump_step(os.path.join(r, step), "grad.")
            for name in local[0]:
                want = reduce(arith, [lg[name] for lg in local], divide_in_place)
                bad = int((got[name].view(torch.int32) != want.view(torch.int32)).sum())
                checked += want.numel()
                if bad:
                    differ += bad
                    print("%s %s grad.%s: %d of %d elements differ from %s's arithmetic"
                          % (os.path.basename(r), step, name, bad, want.numel(), arith))
    print("%s: %d ranks, %d steps, %d elements checked, %d differ"
          % (arith, len(ranks), len(steps), checked, differ))
    return 1 if differ else 0


def check_sgd(dump, model, arith, node_size):
    ranks = sorted(glob.glob(os.path.join(dump, "rank*")))
    steps = sorted(glob.glob(os.path.join(ranks[0], "step*.safetensors")))
    if len(ranks) < 2 or len(steps) != 1:
        raise SystemExit("%s: want a one-step dump of two or more ranks" % dump)
    step = os.path.basename(steps[0])
    local = [load_dump_step(os.path.join(r, step), "local_grad.") for r in ranks]
    w0 = load_dump_step(os.path.join(ranks[0], "init.safetensors"), "param.")
    got = load_dump_step(model, "")
    checked = differ = 0
    for name in local[0]:
        g = reduce(arith, [lg[name] for lg in local], node_size=node_size)
        want = w0[name].clone().add_(g, alpha=-1.0)  # torch.optim.SGD, lr 1
        bad = int((got[name].view(torch.int32) != want.view(torch.int32)).sum())
        checked += want.numel()
        if bad:
            differ += bad
            print("%s: %d of %d elements differ from weights - %s's gradient over nodes of %d"
                  % (name, bad, want.numel(), arith, node_size))
    print("%s, nodes of %d: %d ranks, %d elements checked, %d differ"
          % (arith, node_size, len(ranks), checked, differ))
    return 1 if differ else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--n", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", metavar="DUMP")
    ap.add_argument("--arith", choices=ARITHS)
    ap.add_argument("--divide_in_place", action="store_true",
                    help="ddp with gradient_as_bucket_view (x / W)")
    ap.add_argument("--check_sgd", nargs=2, metavar=("DUMP", "MODEL"))
    ap.add_argument("--node_size", type=int, default=0,
                    help="hybrid sharding: ranks per node (0: one node)")
    a = ap.parse_args()
    if a.check_sgd and a.arith:
        return check_sgd(a.check_sgd[0], a.check_sgd[1], a.arith, a.node_size)
    if a.table:
        return table(a.n, a.seed)
    if a.check and a.arith:
        return check(a.check, a.arith, a.divide_in_place)
    ap.error("give --table, or --check DUMP --arith NAME")
    return 2


if __name__ == "__main__":
    sys.exit(main())
