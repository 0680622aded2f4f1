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

    tools/torch/shard_arith.py --check_norms DUMP --arith NAME --mode MODE --metrics FILE
        every step's total gradient norm, as NAME's framework takes it for clipping in MODE
        (ddp, zero1, zero2, zero3), from the ranks' local gradients of DUMP (local_grad.*;
        a ZeRO-2 dump's grad.* are its local gradients), reduced as above, must equal the
        grad_norm FILE (a metrics.jsonl written with --logging_steps 1) logged for that
        step, to the log's 9 significant digits (every bit of an f32 norm); exit 1
        otherwise. --units 'a,b;c,d' names ZeRO-3's units (default: one unit, the model).

Each framework's clipping (the 2-norm), written from its source; every norm here is
libddp's kernel (`lnorm`: the squares summed in f64 in element order, the square root
rounded to f32, or kept in f64 where DeepSpeed takes `g.double().norm(2)`), the sums over
ranks are rank order:

- ddp (and FSDP1 NO_SHARD, FSDP at ZeRO-1/2 here): PyTorch 1.13
  `torch/nn/utils/clip_grad.py` `clip_grad_norm_`: the norm of the per-tensor norms.
- fsdp1 at ZeRO-3: `torch/distributed/fsdp/fully_sharded_data_parallel.py`
  `FullyShardedDataParallel.clip_grad_norm_` (use_orig_params=False): each rank's
  `_get_grad_norm` over its flat gradient shards (one per unit; PyTorch iterates a set of
  them, libddp takes unit order), `local ** 2` all-reduced, `** (1 / 2)`.
- fsdp2 at ZeRO-3: `clip_grad_norm_` over DTensor gradients sharded on dim 0
  (`torch.chunk`, ceil(rows / W) rows a rank): each rank's norm of its shards' norms is a
  `_NormPartial` (`torch/distributed/tensor/_ops/_math_ops.py`): `** 2`, all-reduce SUM,
  `** (1 / 2)`.
- deepspeed, deepspeed_allreduce at ZeRO-1/2: DeepSpeed `runtime/zero/stage_1_and_2.py`
  `scaled_global_norm` / `get_grad_norm_direct`: per parameter group, the flat group
  padded to a multiple of 2 W (`nccl_start_alignment_factor`), cut into W partitions
  (`get_data_parallel_partitions`, `get_partition_info`); each rank's pieces'
  `g.double()` norms squared and summed in f64, `.float()`, all-reduced, `** (1 / 2)`;
  the total the norm of the groups' norms. `unscale_and_clip_grads`: the gradients times
  1 / max(1, (total + 1e-6) / clip_grad).
- deepspeed at ZeRO-3: DeepSpeed `runtime/zero/stage3.py` `get_grad_norm_direct`: each
  parameter's partition (ceil(numel / W) elements a rank), f64 norms, squared and summed
  in f64, all-reduced in f64, `** (1 / 2)` per group; the total an f64 norm.
"""
import argparse
import glob
import json
import os
import re
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
    clip_table(gen, worlds)
    return 0


# the digits MLP's parameters (registration order), for the clipping table
MLP = (("0.weight", (128, 64)), ("0.bias", (128,)), ("2.weight", (128, 128)), ("2.bias", (128,)),
       ("4.weight", (10, 128)), ("4.bias", (10,)))


def clip_coef(framework, total, max_norm):
    """The coefficient each framework multiplies the gradients by, as its tensor ops round."""
    if framework == "deepspeed":  # unscale_and_clip_grads, loss_scale 1, total's dtype
        clip = torch.clamp(((total / 1.0) + 1e-6) / max_norm, min=1.0)
        return (1.0 / clip).float()
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_ (and FSDP's)


def clip_table(gen, worlds, trials=20, max_norm=0.5):
    """With clipping active: whether each arithmetic and mode ends with DDP's clipped
    gradients, bit for bit, over `trials` draws of the MLP's gradients on each rank."""
    names = [n for n, _ in MLP]
    shapes = dict(MLP)
    rows = (("fsdp1", "zero1", "zero2"), ("fsdp1", "zero3"), ("fsdp2", "zero3"),
            ("deepspeed", "zero1", "zero2"), ("deepspeed", "zero3"),
            ("deepspeed_allreduce", "zero1", "zero2"))
    print()
    print("| arithmetic, modes (clipping active) | " + " | ".join("W = %d" % w for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for row in rows:
        arith, mode = row[0], row[1]
        cells = []
        for w in worlds:
            bad = 0
            for _ in range(trials):
                local = [{n: torch.randn(shapes[n], generator=gen) * 10 ** (torch.rand((), generator=gen) * 2 - 1)
                          for n in names} for _ in range(w)]
                out = {}
                for a, m in ((arith, mode), ("ddp", "ddp")):
                    grads = {n: reduce(a, [lg[n].flatten() for lg in local]) for n in names}
                    total, _ = total_norm(a, m, grads, shapes, names, w, [names])
                    fw = "deepspeed" if a.startswith("deepspeed") else "torch"
                    coef = clip_coef(fw, total, max_norm)
                    out[a] = torch.cat([grads[n] * coef for n in names])
                got, ref = out[arith], out["ddp"]
                bad += int(bool((got.view(torch.int32) != ref.view(torch.int32)).any()))
            cells.append("yes" if bad == 0 else "no (%d of %d draws differ)" % (bad, trials))
        print("| %s %s | %s |" % (arith, "/".join("ZeRO-" + m[-1] for m in row[1:]), " | ".join(cells)))


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


def lnorm(x, f64=False):
    """libddp's norm: squares in f64 summed in element order (cumsum is sequential), sqrt."""
    x = x.double().flatten()
    acc = torch.cumsum(x * x, 0)[-1] if x.numel() else torch.zeros((), dtype=torch.float64)
    r = acc.sqrt()
    return r if f64 else r.float()


def rank_sum(vals):
    """all_reduce SUM in libddp's rank order."""
    acc = vals[0].clone()
    for v in vals[1:]:
        acc = acc + v
    return acc


def decay_groups(names):
    """Transformers' create_optimizer groups: weight decay (not biases, not LayerNorm), then
    no decay; registration order within each."""
    def nodecay(n):
        return n.endswith("bias") or "norm" in n.lower() or ".ln_" in n or n.startswith("ln_")
    return [[n for n in names if not nodecay(n)], [n for n in names if nodecay(n)]]


def chunk(x, r, w, rows):
    """Rank r's part of x when dim 0 (rows) is cut into ceil(rows / w) row chunks."""
    c = -(-rows // w)
    row = x.numel() // rows if rows else 0
    lo = min(r * c, rows)
    hi = min(lo + c, rows)
    return x.flatten()[lo * row:hi * row]


def total_norm(arith, mode, grads, shapes, names, world, units):
    """The norm NAME's framework clips by in MODE; grads: name -> reduced f32 gradient."""
    ds = arith in ("deepspeed", "deepspeed_allreduce")
    if mode == "zero3" and arith in ("fsdp1", "fsdp2"):
        locs = []
        for r in range(world):
            if arith == "fsdp1":
                parts = []
                for u in units:
                    flat = torch.cat([grads[n].flatten() for n in u])
                    s = -(-flat.numel() // world)
                    flat = torch.cat([flat, torch.zeros(s * world - flat.numel())])
                    parts.append(lnorm(flat[r * s:(r + 1) * s]))
            else:
                parts = [lnorm(chunk(grads[n], r, world, shapes[n][0] if shapes[n] else 1))
                         for n in names]
            loc = lnorm(torch.stack(parts))
            locs.append(loc * loc)
        return rank_sum(locs).sqrt(), False
    if mode == "zero3" and ds:
        gns = []
        for grp in decay_groups(names):
            sums = []
            for r in range(world):
                acc = torch.zeros((), dtype=torch.float64)
                for n in grp:
                    v = lnorm(chunk(grads[n], r, world, grads[n].numel()), True)
                    acc = acc + v * v
                sums.append(acc)
            gn = rank_sum(sums).sqrt()
            gns.append(gn if torch.isfinite(gn) else torch.tensor(-1.0, dtype=torch.float64))
        return lnorm(torch.stack(gns), True), True
    if mode in ("zero1", "zero2") and ds:
        gns = []
        for grp in [g for g in decay_groups(names) if g]:
            flat = torch.cat([grads[n].flatten() for n in grp])
            align = 2 * world
            psz = -(-flat.numel() // align) * align // world
            sums = []
            for r in range(world):
                acc = torch.zeros((), dtype=torch.float64)
                off = 0
                for n in grp:  # the pieces of partition r, in flat order
                    lo, hi = max(off, r * psz), min(off + grads[n].numel(), (r + 1) * psz)
                    if lo < hi:
                        v = lnorm(flat[lo:hi], True)
                        acc = acc + v * v
                    off += grads[n].numel()
                sums.append(acc.float())
            gn = rank_sum(sums).sqrt()
            gns.append(gn if torch.isfinite(gn) else torch.tensor(-1.0))
        return lnorm(torch.stack(gns)), False
    return lnorm(torch.stack([lnorm(grads[n]) for n in names])), False


def logged_norms(metrics):
    out = {}
    with open(metrics) as f:
        for line in f:
            m_step = re.search(r'"step": (\d+)', line)
            m_norm = re.search(r'"grad_norm": ([^,}]+)', line)
            if m_step and m_norm:
                out[int(m_step.group(1))] = m_norm.group(1).strip()
    return out


def check_norms(dump, arith, mode, metrics, units_spec):
    ranks = sorted(glob.glob(os.path.join(dump, "rank*")))
    with open(os.path.join(ranks[0], "ddp.json")) as f:
        meta = json.load(f)
    names = meta["param_names"]
    shapes = dict(zip(names, meta["param_shapes"]))
    units = [u.split(",") for u in units_spec.split(";")] if units_spec else [names]
    logged = logged_norms(metrics)
    steps = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ranks[0], "step*.safetensors")))
    differ = 0
    for k, step in enumerate(steps):
        local = [load_dump_step(os.path.join(r, step), "local_grad.") for r in ranks]
        if not local[0]:  # ZeRO-2 dumps its local gradients as grad.*
            local = [load_dump_step(os.path.join(r, step), "grad.") for r in ranks]
        grads = {n: reduce(arith, [lg[n] for lg in local]) for n in names}
        got, f64 = total_norm(arith, mode, grads, shapes, names, len(ranks), units)
        want = logged.get(k + 1)
        text = "%.9g" % float(got)
        ddp_text = "%.9g" % float(total_norm("ddp", "ddp", grads, shapes, names, len(ranks), units)[0])
        ok = want == text
        differ += 0 if ok else 1
        print("%s %s %s: emulated %s%s, logged %s (DDP's order: %s)%s"
              % (arith, mode, step, text, " (f64)" if f64 else "", want, ddp_text,
                 "" if ok else "  DIFFERS"))
    print("%s %s: %d steps, %d differ" % (arith, mode, len(steps), differ))
    return 1 if differ or not steps else 0


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
    ap.add_argument("--check_norms", metavar="DUMP")
    ap.add_argument("--mode", choices=("ddp", "zero1", "zero2", "zero3"), default="ddp")
    ap.add_argument("--metrics", metavar="FILE")
    ap.add_argument("--units", default="", help="ZeRO-3's units: 'a,b;c,d' (default one)")
    a = ap.parse_args()
    if a.check_sgd and a.arith:
        return check_sgd(a.check_sgd[0], a.check_sgd[1], a.arith, a.node_size)
    if a.table:
        return table(a.n, a.seed)
    if a.check_norms and a.arith and a.metrics:
        return check_norms(a.check_norms, a.arith, a.mode, a.metrics, a.units)
    if a.check and a.arith:
        return check(a.check, a.arith, a.divide_in_place)
    ap.error("give --table, or --check DUMP --arith NAME")
    return 2


if __name__ == "__main__":
    sys.exit(main())
