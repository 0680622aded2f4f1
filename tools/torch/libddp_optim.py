#!/usr/bin/python3
"""A ddp-train checkpoint's optimizer state as torch.optim's state_dict (docs/train.md,
"Checkpoints"; docs/sharding.md, "Checkpoints").

ddp-train writes the state of each parameter group in its own file (optimizer.safetensors,
optimizer_group1.safetensors for Transformers' no-decay group; under ZeRO-1/2 rank 0
consolidates the ranks' shards into the same files) with the parameter's index in its
group (state.<i>.step, state.<i>.exp_avg, ...) and each state tensor flat. torch.optim's
state_dict numbers the parameters globally over the groups (group 0's, then group 1's, as
ZeroRedundancyOptimizer.consolidate_state_dict does too), keeps each tensor in its
parameter's shape and carries the groups' hyperparameters; AdamW.load_state_dict does not
check shapes, so a flat exp_avg would load and then fail at the first step. This module
converts, with the names and shapes from the checkpoint's trainer_state.json
(optimizer_groups) and model.safetensors, and the groups' hyperparameters from its
arguments, the learning rate being the one of the step after the checkpoint (what an
optimizer saved by Hugging Face's Trainer after scheduler.step() holds).

    load_into(optimizer, model, checkpoint_dir)   # into a torch optimizer over model
    libddp_optim.py CHECKPOINT_DIR [--out optimizer.pt]
        writes torch.save(state_dict) as Hugging Face's Trainer names it in a checkpoint

Run with /usr/bin/python3 (torch 1.13); tests/zero_optim_torch.sh loads a ZeRO-1 checkpoint
into torch.optim.AdamW this way and continues the run.
"""

import argparse
import json
import math
import os
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.dont_write_bytecode = True

import hf_schedules  # noqa: E402
import safetensors as st  # noqa: E402


def _group_file(ckpt, g):
    return os.path.join(ckpt, "optimizer.safetensors" if g == 0 else
                        "optimizer_group%d.safetensors" % g)


def read(ckpt):
    """The checkpoint's optimizer state: (groups, state), groups a list of dicts with the
    parameter names ("params"), weight_decay, lr, initial_lr, betas, eps, the optimizer's
    name; state {parameter name: {key: torch tensor in the parameter's shape}}."""
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        ts = json.load(f)
    args = ts["args"]
    model, _ = st.load_torch(os.path.join(ckpt, "model.safetensors"))
    warmup = args.get("warmup_steps", 0) or int(math.ceil(ts["max_steps"] *
                                                          args.get("warmup_ratio", 0.0)))
    lr0 = args["learning_rate"]
    kwargs = json.loads(args.get("lr_scheduler_kwargs") or "{}")
    lr = lr0 * hf_schedules.lr_lambda(args["lr_scheduler_type"], ts["global_step"], warmup,
                                      ts["max_steps"], lr0, **kwargs)
    groups, state = [], {}
    for g, og in enumerate(ts["optimizer_groups"]):
        path = _group_file(ckpt, g)
        tensors, meta = st.load_torch(path)
        names = og["params"]
        betas = [float(b) for b in meta.get("betas", "0.9,0.999").split(",")]
        groups.append({"params": names, "weight_decay": og["weight_decay"], "lr": lr,
                       "initial_lr": lr0, "betas": tuple(betas), "eps": args["adam_epsilon"],
                       "optimizer": meta.get("optimizer", ""),
                       "maximize": meta.get("maximize", "0") == "1"})
        for key, t in tensors.items():
            _, i, what = key.split(".", 2)
            i = int(i)
            if i >= len(names):
                raise SystemExit("%s: %s: group %d has %d parameters" % (path, key, g, len(names)))
            name = names[i]
            if what != "step":
                shape = model[name].shape
                if t.numel() != model[name].numel():
                    raise SystemExit("%s: %s has %d elements, parameter %s %s" %
                                     (path, key, t.numel(), name, tuple(shape)))
                t = t.reshape(shape)
            state.setdefault(name, {})[what] = t
    return groups, state


def state_dict(optimizer, model, ckpt):
    """torch.optim's state_dict for `optimizer` (its groups over model's parameters, in the
    checkpoint's group order) holding the checkpoint's state: global indices, shaped
    tensors, the optimizer's own group keys with the checkpoint's hyperparameters."""
    groups, state = read(ckpt)
    pname = {id(p): n for n, p in model.named_parameters()}
    if len(optimizer.param_groups) != len(groups):
        raise SystemExit("%s: %d parameter groups, the optimizer has %d" %
                         (ckpt, len(groups), len(optimizer.param_groups)))
    out_state, out_groups, i = {}, [], 0
    for g, (og, cg) in enumerate(zip(optimizer.param_groups, groups)):
        names = [pname[id(p)] for p in og["params"]]
        if names != cg["params"]:
            raise SystemExit("%s: group %d holds %s, the optimizer's %s" %
                             (ckpt, g, cg["params"], names))
        ng = {k: v for k, v in og.items() if k != "params"}
        for k in ("lr", "initial_lr", "betas", "eps", "weight_decay", "maximize"):
            if k in ng or k == "initial_lr":
                ng[k] = cg[k]
        ng["params"] = list(range(i, i + len(names)))
        for n in names:
            if n in state:  # no entry: the parameter has not been stepped (torch's too)
                out_state[i] = dict(state[n])
            i += 1
        out_groups.append(ng)
    return {"state": out_state, "param_groups": out_groups}


def load_into(optimizer, model, ckpt):
    """optimizer.load_state_dict with the checkpoint's state (state_dict above)."""
    optimizer.load_state_dict(state_dict(optimizer, model, ckpt))


def main(argv):
    p = argparse.ArgumentParser(prog="libddp_optim.py", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a ddp-train checkpoint-<step> directory")
    p.add_argument("--out", default=None, help="default: CHECKPOINT/optimizer.pt")
    a = p.parse_args(argv)
    import torch
    groups, state = read(a.checkpoint)
    model, _ = st.load_torch(os.path.join(a.checkpoint, "model.safetensors"))
    params = {n: torch.nn.Parameter(model[n].clone()) for g in groups for n in g["params"]}
    holder = torch.nn.Module()
    for n, t in params.items():
        holder.register_parameter(n.replace(".", "_"), t)
    name_of = {id(t): n for n, t in params.items()}

    class Named:  # model.named_parameters() under the checkpoint's names
        @staticmethod
        def named_parameters():
            return [(name_of[id(t)], t) for t in holder.parameters()]

    opt_name = groups[0]["optimizer"] if groups else "adamw"
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
           "sgd": torch.optim.SGD}.get(opt_name)
    if cls is None:
        raise SystemExit("%s: optimizer %r has no torch.optim class here" % (a.checkpoint,
                                                                               opt_name))
    kw = {} if cls is torch.optim.SGD else {"betas": groups[0]["betas"]}
    opt = cls([{"params": [params[n] for n in g["params"]],
                "weight_decay": g["weight_decay"]} for g in groups], lr=groups[0]["lr"], **kw)
    load_into(opt, Named, a.checkpoint)
    out = a.out or os.path.join(a.checkpoint, "optimizer.pt")
    torch.save(opt.state_dict(), out)
    print("wrote %s: %d parameter groups, state of %d parameters" %
          (out, len(groups), len(opt.state_dict()["state"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
